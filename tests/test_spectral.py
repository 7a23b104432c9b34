"""Spectral tools against dense references."""

from __future__ import annotations

import math
import os

os.environ.setdefault("DEQBENCH_DISABLE_PLUGIN_AUTOLOAD", "1")

import pytest
import torch
from torch import nn

import deqbench
from deqbench import spectral as sp
from deqbench.analyses.base import CellContext, EpochInfo
from deqbench.data.base import DataBundle
from deqbench.deq import SolverConfig, configure

torch.set_num_threads(1)


@pytest.mark.parametrize(
    "c_out,c_in,k,hw",
    [(1, 1, 3, (7, 7)), (2, 3, 3, (5, 5)), (4, 2, 5, (6, 6)), (3, 3, 5, (4, 4)), (2, 2, 3, (5, 7))],
)
def test_conv_fft_norm_equals_dense_circular_matrix(c_out, c_in, k, hw):
    g = torch.Generator().manual_seed(c_out * 100 + k)
    w = torch.randn(c_out, c_in, k, k, generator=g, dtype=torch.float64)
    M = sp.conv_matrix(w, hw, padding_mode="circular")
    assert M.shape == (c_out * hw[0] * hw[1], c_in * hw[0] * hw[1])
    dense = float(torch.linalg.matrix_norm(M, ord=2))
    assert sp.conv_spectral_norm(w, hw) == pytest.approx(dense, rel=1e-10, abs=1e-6)
    # power iteration of the circular operator (VJP adjoint) agrees as well
    assert sp.conv_power_norm(w, hw, padding_mode="circular") == pytest.approx(dense, rel=1e-6)


@pytest.mark.parametrize("c_out,c_in,k,n", [(2, 3, 3, 5), (4, 2, 5, 6), (3, 3, 5, 8)])
def test_zero_pad_power_iteration_equals_dense_matrix(c_out, c_in, k, n):
    g = torch.Generator().manual_seed(7 + n)
    w = torch.randn(c_out, c_in, k, k, generator=g, dtype=torch.float64)
    dense = float(torch.linalg.matrix_norm(sp.conv_matrix(w, n), ord=2))  # zero padding k//2
    assert sp.conv_power_norm(w, n) == pytest.approx(dense, rel=1e-6)
    # the circular FFT norm is an upper bound of the zero-padded one
    assert sp.conv_spectral_norm(w, n) >= dense - 1e-9
    conv = nn.Conv2d(c_in, c_out, k, padding=k // 2, bias=False).double()
    with torch.no_grad():
        conv.weight.copy_(w)
    assert sp.spectral_norm(conv, (n, n), method="power") == pytest.approx(dense, rel=1e-6)
    assert sp.spectral_norm(conv, (n, n)) == pytest.approx(sp.conv_spectral_norm(w, n))


def test_conv_norm_of_box_filter_is_dc_gain():
    assert sp.conv_spectral_norm(torch.ones(1, 1, 3, 3), (8, 8)) == pytest.approx(9.0)
    assert sp.conv_norm_fft(torch.ones(1, 1, 3, 3), 8) == pytest.approx(9.0)  # old name


def test_dense_power_iteration_matches_matrix_norm():
    g = torch.Generator().manual_seed(0)
    for shape in [(30, 20), (5, 50), (64, 64)]:
        W = torch.randn(shape, generator=g, dtype=torch.float64)
        exact = float(torch.linalg.matrix_norm(W, ord=2))
        assert sp.dense_power_norm(W) == pytest.approx(exact, rel=1e-8)
        assert sp.spectral_norm(W) == pytest.approx(exact, rel=1e-12)
        assert sp.spectral_norm(W, method="power") == pytest.approx(exact, rel=1e-8)
    lin = nn.Linear(6, 4)
    assert sp.spectral_norm(lin) == pytest.approx(sp.dense_norm(lin.weight))


def test_spectral_norm_errors():
    from deqbench.errors import ConfigError

    with pytest.raises(ConfigError, match="input_hw"):
        sp.spectral_norm(nn.Conv2d(1, 1, 3))
    with pytest.raises(ConfigError, match="method"):
        sp.spectral_norm(torch.eye(2), method="lanczos")
    with pytest.raises(ConfigError, match=r"shape \(C_out, C_in, k1, k2\); got \(1, 3, 3\)"):
        sp.conv_spectral_norm(torch.ones(1, 3, 3), (4, 4))
    for bad in ((0, 0), (-4, 4)):
        with pytest.raises(ConfigError, match="positive sizes"):
            sp.conv_spectral_norm(torch.ones(1, 1, 3, 3), bad)


def test_rectangular_kernel_circular_operator_and_strided_bound():
    """A 3x5 kernel: the default padding is (1, 2), so the circular operator keeps the input
    size and its FFT norm is exact; a stride-2 conv is bounded by the stride-1 FFT norm."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(2, 3, 3, 5, generator=g, dtype=torch.float64)
    M = sp.conv_matrix(w, (6, 6), padding_mode="circular")
    assert M.shape == (2 * 36, 3 * 36)
    dense = float(torch.linalg.matrix_norm(M, ord=2))
    assert sp.conv_spectral_norm(w, (6, 6)) == pytest.approx(dense, rel=1e-10)
    strided = float(torch.linalg.matrix_norm(sp.conv_matrix(w, (6, 6), stride=2), ord=2))
    assert strided <= sp.conv_spectral_norm(w, (6, 6)) + 1e-12


def test_monotonicity_margin_uses_largest_algebraic_eigenvalue():
    # symmetric part diag(-5, 0.5): power iteration would report -5, the margin is 0.5
    W = torch.tensor([[-5.0, 1.0], [-1.0, 0.5]], dtype=torch.float64)
    assert sp.monotonicity_margin(W) == pytest.approx(0.5)


def _tiny_deq(seed: int, gain: float = 2.0):
    torch.manual_seed(seed)
    m = deqbench.models.create("fc_deq_tiny", in_shape=(6,), width=10).double()
    with torch.no_grad():
        m.deq.cell.W.weight.mul_(gain)
    configure(m, SolverConfig("fixed_point", 500, 1e-13))
    x = torch.randn(3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    z, u = m.equilibrium(x)
    return m, z, u


@pytest.mark.parametrize("seed", [0, 1])
def test_jacobian_quantities_match_dense_jacobian(seed):
    m, z, u = _tiny_deq(seed)
    cell = m.deq.cell
    rho = sp.jacobian_spectral_radius(cell, z, u, iters=50)
    rho_jvp = sp.jacobian_spectral_radius(cell, z, u, iters=50, mode="jvp")
    sn = sp.jacobian_spectral_norm(cell, z, u, iters=50)
    fro = sp.jacobian_frobenius(cell, z, u, n_vectors=400, seed=seed)
    for b in range(z.shape[0]):
        J = torch.autograd.functional.jacobian(
            lambda zz, b=b: cell(zz[None], u[b : b + 1])[0], z[b]
        )
        ev = float(torch.linalg.eigvals(J).abs().max())
        assert float(rho[b]) == pytest.approx(ev, rel=1e-8)
        assert float(rho_jvp[b]) == pytest.approx(ev, rel=1e-8)
        assert float(sn[b]) == pytest.approx(float(torch.linalg.matrix_norm(J, 2)), rel=1e-8)
        assert float(fro[b]) == pytest.approx(float(torch.linalg.matrix_norm(J)), rel=0.15)
        assert float(sn[b]) >= float(rho[b]) - 1e-12


def test_spectral_radius_resolves_complex_dominant_pair():
    # J has the complex pair 0.9 e^{+-0.7i} beside 0.85 and -0.8: plain power iteration
    # oscillates; the Arnoldi (Rayleigh-Ritz) step recovers the pair's modulus
    class Lin(nn.Module):
        def __init__(self, A):
            super().__init__()
            self.A = A

        def forward(self, z, u):
            return z @ self.A.T + u

    c, s = math.cos(0.7), math.sin(0.7)
    A = torch.zeros(4, 4, dtype=torch.float64)
    A[:2, :2] = 0.9 * torch.tensor([[c, -s], [s, c]], dtype=torch.float64)
    A[2:, 2:] = torch.tensor([[0.85, 0.3], [0.0, -0.8]], dtype=torch.float64)
    z = torch.zeros(2, 4, dtype=torch.float64)
    rho = sp.jacobian_spectral_radius(Lin(A), z, z, iters=10, arnoldi=4)
    assert torch.allclose(rho, torch.full_like(rho, 0.9), rtol=1e-10)


def test_lipschitz_bound():
    m, z, u = _tiny_deq(0)
    bound, note = sp.lipschitz_upper_bound(m.deq.cell)
    assert bound == pytest.approx(sp.dense_norm(m.deq.cell.W.weight))
    assert "product" in note
    assert bound >= float(sp.jacobian_spectral_norm(m.deq.cell, z, u).max()) - 1e-12
    k = deqbench.models.create("kglm_deq_tiny", family="bernoulli")
    b2, note2 = sp.lipschitz_upper_bound(k.deq.cell)
    assert b2 == pytest.approx(0.25 * sp.dense_norm(k.deq.cell.W1.weight), rel=1e-6)
    assert "lipschitz_bound" in note2


class _Stub(deqbench.models.get("fc_deq_tiny")().__class__):  # FCDEQ with a family method
    def spectral_quantities(self):
        return {"lambda_max_sym_W": 0.25}


def test_spectral_analysis_hooks():
    from deqbench.spectral.analysis import SpectralAnalysis

    torch.manual_seed(0)
    model = _Stub(8, 12, 3).double()
    configure(model, SolverConfig("fixed_point", 200, 1e-10))
    X = torch.randn(10, 8, dtype=torch.float64)
    data = DataBundle(
        "toy",
        (X, torch.zeros(10, dtype=torch.long)),
        (X, torch.zeros(10, dtype=torch.long)),
        (8,),
        3,
    )
    ctx = CellContext(model, data, "cpu", torch.float64, 0, "cell", {"train": {"epochs": 1}})
    a = deqbench.analyses.get("spectral")({"power_iters": 30, "jacobian_batch": 4})
    assert isinstance(a, SpectralAnalysis)
    rows = list(a.before_training(ctx))
    by = {(r.metric, r.variant): r for r in rows}
    assert by[("sigma_max", "deq.cell.W")].value == pytest.approx(
        sp.dense_norm(model.deq.cell.W.weight)
    )
    assert by[("sigma_max_power", "deq.cell.W")].value == pytest.approx(
        by[("sigma_max", "deq.cell.W")].value, rel=1e-6
    )
    assert by[("lambda_max_sym_W", "family")].value == 0.25
    assert by[("jacobian_spectral_radius", "max")].value <= by[("lipschitz_bound", "")].value
    assert all(r.step == 0 for r in rows)
    assert list(a.on_epoch(ctx, EpochInfo(0))) == []  # epoch 0 already measured
    rows1 = list(a.on_epoch(ctx, EpochInfo(1)))
    assert rows1 and all(r.step == 1 for r in rows1)
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        deqbench.analyses.get("spectral")({"evry": "epoch"})


def test_spectral_analysis_conv_model_scope_model():
    from deqbench.spectral.analysis import layer_norms

    m = deqbench.models.create("kglm_conv_deq_tiny", in_shape=(2, 6, 6)).double()
    deqbench.inits.get("kglm_informed")(m, seed=0, scale=0.7)
    rows = layer_norms(m, torch.rand(2, 2, 6, 6, dtype=torch.float64), scope="model")
    vals = {(layer, metric): v for layer, metric, v, _ in rows}
    assert len({layer for layer, *_ in rows}) == 4
    assert vals[("deq.cell.conv1", "sigma_max")] == pytest.approx(0.7, rel=1e-9)
    assert vals[("deq.cell.conv1", "sigma_max_power")] <= 0.7 + 1e-9
    dense = float(torch.linalg.matrix_norm(sp.conv_matrix(m.conv1.weight, 6), 2))
    assert vals[("deq.cell.conv1", "sigma_max_power")] == pytest.approx(dense, rel=1e-6)


def test_jacobian_tools_with_a_zero_jacobian_sample_in_float32():
    # one sample's Jacobian is exactly 0 (saturated activation): no NaN from 0/0 in float32
    A = torch.randn(5, 5, generator=torch.Generator().manual_seed(0)) * 0.3

    class Per(nn.Module):
        def forward(self, z, u):
            out = z @ A.T
            return torch.stack([0 * out[0], out[1]]) + u

    z = torch.zeros(2, 5)
    rho = sp.jacobian_spectral_radius(Per(), z, z, iters=20)
    sn = sp.jacobian_spectral_norm(Per(), z, z)
    assert float(rho[0]) == 0.0 and float(sn[0]) == 0.0
    assert float(rho[1]) == pytest.approx(float(torch.linalg.eigvals(A).abs().max()), rel=1e-4)
    assert float(sn[1]) == pytest.approx(float(torch.linalg.matrix_norm(A, 2)), rel=1e-4)


def test_public_functions_reachable_from_the_package():
    import deqbench

    assert deqbench.spectral is sp
    assert deqbench.spectral.conv_spectral_norm(torch.ones(1, 1, 3, 3), (8, 8)) == 9.0
    assert callable(deqbench.klr.fit_klr) and callable(deqbench.kernels.make_kernel)
    with pytest.raises(AttributeError, match="no attribute 'spectrall'"):
        deqbench.spectrall  # noqa: B018
