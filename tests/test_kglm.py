"""kGLM models, inits, kernels, KLR reference and analyses (Tsuchida et al. 2022)."""

from __future__ import annotations

import math
import os

os.environ.setdefault("DEQBENCH_DISABLE_PLUGIN_AUTOLOAD", "1")

import pytest
import torch

import deqbench
from deqbench.analyses.base import CellContext
from deqbench.data.base import load_data
from deqbench.deq import SolverConfig, configure
from deqbench.errors import ConfigError
from deqbench.kernels import kernels, make_kernel
from deqbench.klr import fit_klr

torch.set_num_threads(1)


# -- kernels ---------------------------------------------------------------------------------


def test_kernels_registry_and_gp_task_kernel():
    assert {"se", "periodic", "periodic_se", "white"} <= set(kernels.names())
    x = torch.linspace(-3, 5, 13, dtype=torch.float64)
    d = x[:, None] - x[None, :]
    K = make_kernel("periodic_se")(x, x)
    ref = 0.1 * torch.exp(-(d**2) / 2) * torch.exp(-(torch.sin(d) ** 2))
    assert torch.allclose(K, ref, atol=1e-15)
    se = make_kernel({"name": "se", "lengthscale": 2.0})(x, x)
    assert torch.allclose(se, torch.exp(-(d**2) / 8), atol=1e-15)
    both = make_kernel(["se", {"name": "white", "variance": 1e-3}])(x, x)
    assert torch.allclose(both - make_kernel("se")(x, x), 1e-3 * torch.eye(13, dtype=torch.float64))
    with pytest.raises(ConfigError):
        make_kernel({"name": "se", "lenghtscale": 1.0})
    # pluggable: a kernel added at run time (plugins use the entry-point group deqbench.kernels)
    from deqbench.kernels import Kernel

    class Linear(Kernel):
        def __call__(self, a, b):
            return torch.as_tensor(a).reshape(len(a), -1) @ torch.as_tensor(b).reshape(len(b), -1).T

    kernels.add("test_linear", lambda: Linear())
    try:
        assert torch.allclose(make_kernel("test_linear")(x, x), x[:, None] * x[None, :])
    finally:
        kernels.remove("test_linear")
    with pytest.raises(deqbench.errors.UnknownNameError, match="did you mean"):
        make_kernel("periodic_sa")


# -- KLR reference -------------------------------------------------------------------------------


def test_fit_klr_solves_the_stationarity_condition():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(20, 2, generator=g, dtype=torch.float64) * 4
    K = make_kernel("se")(x, x)
    y = (torch.rand(3, 20, generator=g) > 0.5).double()
    lam = 0.3
    res = fit_klr(K, y, lam, steps=12)
    grad = (res.p - y) @ K + lam * res.alpha @ K  # K (p - y) + lam K alpha per row
    assert float(grad.abs().max()) < 1e-12
    assert res.step_norms[-1] < 1e-12
    # the objective is minimal: perturbations increase it
    from deqbench.klr import klr_objective

    base = klr_objective(K, y, lam, res.alpha)
    for _ in range(3):
        pert = res.alpha + 1e-3 * torch.randn(res.alpha.shape, generator=g, dtype=torch.float64)
        assert bool((klr_objective(K, y, lam, pert) > base).all())


# -- the key test: kGLM DEQ == KLR on every pixel (Tsuchida et al. 2022 App. G) ------------------------------


def _pixel_kernel() -> tuple[torch.Tensor, float]:
    """K = SE(lengthscale 1) + 1e-8 I on the 8x8 pixel grid, built here independently."""
    ii, jj = torch.meshgrid(torch.arange(8.0), torch.arange(8.0), indexing="ij")
    P = torch.stack([ii.flatten(), jj.flatten()], 1).double()
    K = torch.exp(-(torch.cdist(P, P) ** 2) / 2) + 1e-8 * torch.eye(64, dtype=torch.float64)
    return K, 2 * float(torch.linalg.matrix_norm(K, ord=2))


@pytest.fixture(scope="module")
def klr_setup():
    d = load_data("digits_klr", split=0.5, seed=0)
    Y = torch.cat([d.train[0], d.test[0]]).double()  # all 1797 images
    K, lam = _pixel_kernel()
    res = fit_klr(K, Y.flatten(1), lam, steps=8)
    return Y, res


def _deq(init: str, tol: float = 1e-15, **params):
    m = deqbench.models.create("kglm_deq", in_shape=(1, 8, 8), family="bernoulli").double()
    deqbench.inits.get(init)(m, seed=0, **params)
    configure(m, SolverConfig("fixed_point", 100, tol))
    return m


def test_kglm_deq_agrees_with_klr_on_every_pixel(klr_setup):
    Y, res = klr_setup
    # tol 1e-13, not 1e-15: the batch max (1797 images) of the rel residual levels off at
    # rounding, ~5e-16 here (2x below 1e-15: machine-dependent whether it gets below); at a
    # factor 1/8 per step 1e-13 comes ~2 steps before 1e-15 would, and p agrees as closely
    m = _deq("kglm_informed", tol=1e-13, kernel=["se", {"name": "white", "variance": 1e-8}],
             scale=0.5)  # fmt: skip
    with torch.no_grad():
        p = torch.sigmoid(m(Y))
    st = m.last_forward_stats
    assert st.converged and st.nstep < 40  # contraction factor <= 1/8
    assert float((p - res.p).abs().max()) < 1e-10
    assert int(((p > 0.5) != (res.p > 0.5)).sum()) == 0


def test_random_init_deq_does_not_agree_with_klr(klr_setup):
    Y, res = klr_setup
    m = _deq("kglm_random")
    with torch.no_grad():
        p = torch.sigmoid(m(Y))
    assert float((p - res.p).abs().max()) > 1e-2
    assert int(((p > 0.5) != (res.p > 0.5)).sum()) > 100


def test_klr_agreement_analysis_hooks():
    d = load_data("digits_klr", split=0.5, seed=1)
    # float64 model (as the suite kglm_klr runs it); the analysis evaluates it in both dtypes
    m = deqbench.models.create("kglm_deq", in_shape=d.in_shape, family="bernoulli").double()
    deqbench.inits.get("kglm_informed")(m, seed=0, kernel=["se", {"name": "white"}], scale=0.5)
    configure(m, SolverConfig("fixed_point", 100, 1e-15))
    ctx = CellContext(m, d, "cpu", torch.float64, 0, "c", {})
    a = deqbench.analyses.get("klr_agreement")({"max_images": 40, "newton_steps": 8})
    rows = {(r.variant, r.metric): r.value for r in a.before_training(ctx)}
    assert rows[("float64", "disagreeing_pixels")] == 0
    assert rows[("float64", "max_abs_dp")] < 1e-10
    assert rows[("float32", "max_abs_dp")] < 1e-5
    assert rows[("float32", "deq_nstep")] < 100  # tolerance raised to float32 resolution
    assert rows[("float64", "images")] == 40 and rows[("klr", "newton_steps")] == 8


# -- kernel ridge regression (gaussian family): an independent closed form ------------------------


def test_gaussian_kglm_deq_is_kernel_ridge_regression():
    m = deqbench.models.create("kglm_deq_tiny", in_shape=(16,), num_outputs=12, family="gaussian")
    m = m.double()
    x = torch.linspace(-2, 2, 16, dtype=torch.float64)
    xo = torch.linspace(-2.5, 1.5, 12, dtype=torch.float64)
    deqbench.inits.get("kglm_informed")(
        m, seed=0, kernel="se", coords=x.tolist(), out_coords=xo.tolist(), scale=0.5
    )
    configure(m, SolverConfig("fixed_point", 200, 1e-14))
    y = torch.randn(5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = m(y)
    k = make_kernel("se")
    K = k(x, x)
    lam = float(torch.linalg.matrix_norm(K, 2)) / 0.5
    alpha = torch.linalg.solve(K + lam * torch.eye(16, dtype=torch.float64), y.T).T
    assert torch.allclose(out, alpha @ k(xo, x).T, atol=1e-12)


# -- inits ------------------------------------------------------------------------------------


def test_informed_init_gp_task_weights():
    m = deqbench.models.create("kglm_deq", in_shape=(100,), family="log2cosh")
    deqbench.inits.get("kglm_informed")(
        m, seed=0, kernel="periodic_se", x_range=["-2pi", "2pi"], out_shift=-2
    )
    t = torch.linspace(-2 * math.pi, 2 * math.pi, 100, dtype=torch.float64)
    k = make_kernel("periodic_se")
    K = k(t, t)
    lam = float(torch.linalg.matrix_norm(K, 2))
    W1 = m.deq.cell.W1.weight.detach().double()
    assert torch.allclose(W1, -K / lam, atol=1e-7)
    assert torch.allclose(m.W2.weight.double(), K / lam, atol=1e-7)
    assert torch.allclose(m.V2.weight.double(), k(t - 2, t) / lam, atol=1e-7)
    assert torch.allclose(m.V1.weight.double(), -k(t - 2, t) / lam, atol=1e-7)
    assert float(torch.linalg.matrix_norm(W1, 2)) == pytest.approx(1.0, rel=1e-6)
    assert float(m.W2.bias.detach().abs().max()) == 0.0
    assert float(m.V1.bias.detach().abs().max()) == 0.0


def test_naive_and_random_inits():
    m = deqbench.models.create("kglm_deq_tiny")
    deqbench.inits.get("kglm_naive")(m, seed=3)
    t = torch.linspace(-2 * math.pi, 2 * math.pi, 16, dtype=torch.float64)
    K = torch.exp(-((t[:, None] - t[None]) ** 2) / 2)
    assert torch.allclose(
        m.deq.cell.W1.weight.double(), -K / torch.linalg.matrix_norm(K, 2), atol=1e-7
    )
    assert float(m.V2.weight.detach().abs().max()) == 0.0 and m.V2.weight.requires_grad
    r = deqbench.models.create("kglm_deq_tiny")
    deqbench.inits.get("kglm_random")(r, seed=0)
    assert float(r.V2.weight.detach().abs().max()) == 0.0 and not r.V2.weight.requires_grad
    bound = 1 / math.sqrt(16)
    assert 0.5 * bound < float(r.deq.cell.W1.weight.detach().abs().max()) <= bound
    r2 = deqbench.models.create("kglm_deq_tiny")
    deqbench.inits.get("kglm_random")(r2, seed=0)
    assert torch.equal(r.deq.cell.W1.weight, r2.deq.cell.W1.weight)  # seeded
    with pytest.raises(ConfigError, match="kGLM model"):
        deqbench.inits.get("kglm_informed")(deqbench.models.create("fc_deq_tiny"), seed=0)


def test_conv_informed_init():
    from deqbench.spectral import conv_spectral_norm

    m = deqbench.models.create("kglm_conv_deq", in_shape=(3, 12, 12))
    deqbench.inits.get("kglm_informed")(m, seed=0, scale=2.5)
    w1, w2 = m.conv1.weight.detach().double(), m.conv2.weight.detach().double()
    assert conv_spectral_norm(w1, (12, 12)) == pytest.approx(2.5, rel=1e-6)
    assert torch.allclose(w1, -w2)
    assert torch.allclose(w2, w2.transpose(0, 1))  # symmetrised over channels
    assert torch.allclose(w2, w2.flip(-1)) and torch.allclose(w2, w2.flip(-2))  # SE is symmetric
    assert bool((w2 >= 0).all()) and float(w2[2, 0].max()) > 0  # lower triangle, symmetrised
    assert torch.equal(m.conv_out1.weight, m.conv1.weight)
    r = deqbench.models.create("kglm_conv_deq", in_shape=(3, 12, 12))
    deqbench.inits.get("kglm_random")(r, seed=0, scale=1.9)
    assert float(r.conv1.weight.detach().std()) == pytest.approx(0.1, rel=0.2)
    y = torch.rand(2, 3, 12, 12)
    assert m(y).shape == (2, 3, 12, 12)


def test_parse_number():
    from deqbench.kglm.inits import parse_number

    assert parse_number("-2pi") == pytest.approx(-2 * math.pi)
    assert parse_number("0.5*pi") == pytest.approx(math.pi / 2)
    assert parse_number("pi") == pytest.approx(math.pi)
    assert parse_number(3) == 3.0
    with pytest.raises(ConfigError):
        parse_number("two pi")


# -- data ------------------------------------------------------------------------------------


def test_gp_sequence_matches_paper_grid():
    d = load_data("gp_sequence", n_train=20, n_test=5, seed=0)
    t_in, t_out = torch.tensor(d.meta["t_in"]), torch.tensor(d.meta["t_out"])
    assert float(t_in[0]) == pytest.approx(-2 * math.pi) and float(t_in[-1]) == pytest.approx(
        2 * math.pi
    )
    assert float(t_out[0]) == pytest.approx(-2 * math.pi - 2)
    assert float(t_out[-1]) == pytest.approx(2 * math.pi - 2)
    assert d.train[0].shape == (20, 100) and d.task == "regression"


def test_digits_klr_corruption():
    d = load_data("digits_klr", split=0.5, corrupt=1 / 3)
    X = torch.cat([d.train[0], d.test[0]]).flatten(1)
    Y = torch.cat([d.train[1], d.test[1]])
    changed = (X != Y).sum(1)
    assert int(changed.max()) <= d.meta["corrupted_pixels"] == 21
    assert float(changed.float().mean()) > 5
    assert set(X.unique().tolist()) <= {0.0, 1.0}


def test_digits_klr_binarised_mnist_with_flipped_bits():
    """source mnist5k: the 5,000 real 28x28 digits binarised at 1/2; corruption flip: exactly
    int(784 * 0.3) bits of each image flipped in place (the paper's App. G corruption)."""
    from deqbench.data.images import _mnist5k_arrays

    d = load_data("digits_klr", split=0.5, corrupt=0.3, source="mnist5k", corruption="flip")
    assert d.in_shape == (1, 28, 28) and d.num_outputs == 784
    X = torch.cat([d.train[0], d.test[0]]).flatten(1)
    Y = torch.cat([d.train[1], d.test[1]])
    assert X.shape == (5000, 784) and set(X.unique().tolist()) == {0.0, 1.0}
    assert int(784 * 0.3) == d.meta["corrupted_pixels"] == 235
    assert ((X != Y).sum(1) == 235).all()
    raw = torch.tensor(_mnist5k_arrays()[0].reshape(5000, -1).astype("float32")) / 255
    clean = (raw > 0.5).float()  # every clean target is one of the digits, binarised at 1/2
    assert {tuple(r) for r in Y[:50].int().tolist()} <= {tuple(r) for r in clean.int().tolist()}
    with pytest.raises(ConfigError, match="data.source must be one of digits, mnist5k"):
        load_data("digits_klr", source="cifar10")
    with pytest.raises(ConfigError, match="data.corruption must be one of copy, flip"):
        load_data("digits_klr", corruption="swap")


def test_kglm_deq_output_activation_is_the_bernoulli_mean():
    """output_activation sigmoid: the output is sigmoid of the linear readout (App. G's greyscale
    prediction), same parameters and fixed point as without it."""
    x = torch.rand(5, 1, 8, 8)
    a = deqbench.models.create("kglm_deq", in_shape=(1, 8, 8), family="bernoulli")
    b = deqbench.models.create(
        "kglm_deq", in_shape=(1, 8, 8), family="bernoulli", output_activation="sigmoid"
    )
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        la, pb = a(x), b(x)
    assert torch.allclose(torch.sigmoid(la), pb, atol=1e-6)
    assert float(pb.min()) > 0 and float(pb.max()) < 1 and float(la.min()) < 0


def test_klr_agreement_fits_in_chunks_as_at_once(monkeypatch):
    """The KLR reference fitted in chunks of images (memory) gives the probabilities of one fit."""
    import deqbench.kglm.analysis as an

    d = load_data("digits_klr", split=0.5, seed=2)
    m = deqbench.models.create("kglm_deq", in_shape=d.in_shape, family="bernoulli").double()
    deqbench.inits.get("kglm_informed")(m, seed=0, kernel=["se", {"name": "white"}], scale=0.5)
    configure(m, SolverConfig("fixed_point", 100, 1e-15))
    Y = d.test[0][:30]
    one, _ = an.klr_agreement(m, Y, newton_steps=6)
    monkeypatch.setattr(an, "KLR_CHUNK_BYTES", 2 * 64 * 64 * 8 * 7)  # 7 images a chunk: 5 chunks
    chunked, _ = an.klr_agreement(m, Y, newton_steps=6)
    assert chunked["float64"]["max_abs_dp"] == pytest.approx(
        one["float64"]["max_abs_dp"], abs=1e-15
    )
    assert chunked["klr"]["last_step_norm"] == pytest.approx(
        one["klr"]["last_step_norm"], abs=1e-12
    )
    assert chunked["float64"]["disagreeing_pixels"] == one["float64"]["disagreeing_pixels"] == 0


def test_denoise_data(monkeypatch):
    import deqbench.data.kglm as data_mod

    d = load_data("denoise", n_train=6, n_test=4, size=8, channels=2, noise=0.2)
    assert d.train[0].shape == (6, 2, 8, 8) and d.in_shape == (2, 8, 8)
    assert float(d.train[0].min()) >= 0 and float(d.train[0].max()) <= 1
    assert 0 < d.meta["noisy_mse_test"] < 0.04

    def missing(*a, **k):  # no torchvision import in tests: CIFAR-10 "not on disk"
        raise data_mod.DataError("dataset 'cifar10' not found under /nonexistent")

    monkeypatch.setattr(data_mod, "_torchvision", missing)
    f = load_data("denoise", source="cifar10", root="/nonexistent", n_train=2, n_test=2)
    assert f.in_shape == (3, 32, 32) and "not found" in f.meta["source"]


# -- analyses: init cost --------------------------------------------------------------------------


def test_init_cost_rows():
    d = load_data("gp_sequence", n_train=4, n_test=4, length=8)
    m = deqbench.models.create("kglm_deq_tiny", in_shape=d.in_shape)
    ctx = CellContext(m, d, torch.device("cpu"), torch.float32, 0, "c", {})
    a = deqbench.analyses.get("kglm_init_cost")(
        {"fc_widths": [8, 16], "conv_channels": [1, 2], "conv_size": 8, "repeats": 2}
    )
    rows = list(a.before_training(ctx))
    med = [r for r in rows if r.metric == "init_time_median"]
    assert {r.variant for r in med} == {"fc/kglm", "fc/random", "conv/kglm", "conv/random"}
    assert {(r.variant, r.step) for r in med} == {
        (f"{layer}/{scheme}", n)
        for layer, sizes in (("fc", (8, 16)), ("conv", (1, 2)))
        for scheme in ("kglm", "random")
        for n in sizes
    }
    assert all(r.value > 0 for r in rows)


def test_white_noise_on_coinciding_points_keeps_v1_equal_to_w1():
    """Theorem 3 with X~ = X needs V1 = W1 with the white-noise term too; torch.cdist's matmul
    path misses exact zeros on such coordinates (the old code added the noise only there)."""
    from deqbench.kglm.inits import kernel_weights

    torch.manual_seed(0)
    X = torch.rand(200, 3, dtype=torch.float64) * 10
    assert int((torch.cdist(X, X) == 0).sum()) < 200  # the trap this guards against
    p = kernel_weights("se", X, X, white_noise=1e-3)
    assert torch.equal(p["V1"], p["W1"])


@pytest.mark.parametrize(
    "init,params,bad",
    [
        ("kglm_informed", {"scale": 0.0}, "scale"),
        ("kglm_informed", {"scale": -1.0}, "scale"),
        ("kglm_informed", {"white_noise": -1.0}, "white_noise"),
        ("kglm_naive", {"scale": -2.0}, "scale"),
        ("kglm_random", {"scale": 0.0}, "scale"),
    ],
)
def test_bad_init_scales_are_config_errors(init, params, bad):
    for model_name in ("kglm_deq_tiny", "kglm_conv_deq_tiny"):
        shape = (1, 8, 8)
        model = deqbench.models.create(model_name, in_shape=shape, num_outputs=64)
        with pytest.raises(ConfigError, match=f"{init}: {bad} must be"):
            deqbench.inits.get(init)(model, **params)
