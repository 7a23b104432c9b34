"""DEQ layer and backward modes against independent references (float64)."""

from __future__ import annotations

import pytest
import torch

import deqbench
from deqbench.deq import BackwardConfig, SolverConfig, configure, deq_layers, is_deq, last_stats

TIGHT = SolverConfig("fixed_point", max_iter=600, tol=1e-14)


def tiny_tanh_deq(seed: int = 0, width: int = 12, in_dim: int = 6, norm: float = 0.8):
    torch.manual_seed(seed)
    m = deqbench.models.create(
        "fc_deq_tiny", in_shape=(in_dim,), num_outputs=3, width=width
    ).double()
    with torch.no_grad():
        W = m.deq.cell.W.weight
        W.mul_(norm / torch.linalg.matrix_norm(W, ord=2))
    return m


def flat_grad(model, loss_fn, create_graph=False):
    params = [p for p in model.parameters()]
    g = torch.autograd.grad(loss_fn(), params, create_graph=create_graph)
    return torch.cat([t.reshape(-1) for t in g]), params


def test_ift_gradient_matches_finite_differences_and_unrolled():
    m = tiny_tanh_deq()
    x = torch.randn(5, 6, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 1, 0])
    loss = lambda: torch.nn.functional.cross_entropy(m(x), y)  # noqa: E731

    configure(m, TIGHT, BackwardConfig("ift", max_iter=600, tol=1e-14))
    g_ift, params = flat_grad(m, loss)
    configure(m, TIGHT, BackwardConfig("unrolled", k=400))
    g_unr, _ = flat_grad(m, loss)
    assert (g_ift - g_unr).norm() / g_unr.norm() < 1e-6

    # central finite differences of the (converged) forward loss along random directions
    configure(m, TIGHT, BackwardConfig("ift", max_iter=600, tol=1e-14))
    vec = torch.nn.utils.parameters_to_vector(params).detach().clone()
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        d = torch.randn(vec.shape, generator=gen, dtype=torch.float64)
        d /= d.norm()
        eps = 1e-6
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(vec + eps * d, params)
            lp = float(loss())
            torch.nn.utils.vector_to_parameters(vec - eps * d, params)
            lm = float(loss())
            torch.nn.utils.vector_to_parameters(vec, params)
        fd = (lp - lm) / (2 * eps)
        assert abs(fd - float(g_ift @ d)) / (abs(fd) + 1e-12) < 1e-6


def test_ift_hessian_vector_product_matches_unrolled():
    m = tiny_tanh_deq(seed=3)
    x = torch.randn(4, 6, dtype=torch.float64)
    y = torch.tensor([0, 2, 1, 1])
    loss = lambda: torch.nn.functional.cross_entropy(m(x), y)  # noqa: E731
    v = None
    hv = {}
    for name, bw in [
        ("ift", BackwardConfig("ift", max_iter=600, tol=1e-14)),  # exact implicit 2nd order
        (
            "refine",
            BackwardConfig("ift", max_iter=600, tol=1e-14, second_order="refine", refine=150),
        ),
        ("unrolled", BackwardConfig("unrolled", k=400)),
    ]:
        configure(m, TIGHT, bw)
        g, params = flat_grad(m, loss, create_graph=True)
        if v is None:
            v = torch.randn(
                g.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64
            )
        h = torch.autograd.grad(g @ v, params)
        hv[name] = torch.cat([t.reshape(-1) for t in h])
    ref = hv["unrolled"]
    assert (hv["ift"] - ref).norm() / ref.norm() < 1e-9
    assert (hv["refine"] - ref).norm() / ref.norm() < 1e-5


def test_ift_hvp_is_symmetric():
    m = tiny_tanh_deq(seed=4)
    x = torch.randn(4, 6, dtype=torch.float64)
    configure(m, TIGHT, BackwardConfig("ift", max_iter=600, tol=1e-14, refine=150))
    g, params = flat_grad(m, lambda: m(x).pow(2).sum(), create_graph=True)
    gen = torch.Generator().manual_seed(0)
    u = torch.randn(g.shape, generator=gen, dtype=torch.float64)
    w = torch.randn(g.shape, generator=gen, dtype=torch.float64)
    hu = torch.cat([t.reshape(-1) for t in torch.autograd.grad(g @ u, params, retain_graph=True)])
    hw = torch.cat([t.reshape(-1) for t in torch.autograd.grad(g @ w, params)])
    assert abs(float(w @ hu) - float(u @ hw)) < 1e-8 * abs(float(w @ hu))


@pytest.mark.parametrize("mode", ["jfb", "phantom"])
def test_inexact_gradients_run_and_are_reported(mode):
    m = tiny_tanh_deq(seed=5)
    x = torch.randn(8, 6, dtype=torch.float64)
    loss = lambda: m(x).pow(2).sum()  # noqa: E731
    configure(m, TIGHT, BackwardConfig("ift", max_iter=600, tol=1e-14))
    g_ref, _ = flat_grad(m, loss)
    configure(m, TIGHT, BackwardConfig(mode, k=5, tau=0.8))
    g, _ = flat_grad(m, loss)
    cos = float(g @ g_ref / (g.norm() * g_ref.norm()))
    assert 0.5 < cos < 1.0  # inexact but aligned
    assert deq_layers(m).__next__().f_evals_grad == (1 if mode == "jfb" else 5)


def test_layer_exposes_stats():
    m = tiny_tanh_deq()
    configure(
        m, SolverConfig("fixed_point", max_iter=100, tol=1e-8), BackwardConfig("ift", tol=1e-8)
    )
    x = torch.randn(3, 6, dtype=torch.float64)
    m(x).sum().backward()
    st = last_stats(m)
    assert st["forward_converged"] == 1.0 and st["forward_rel_residual"] < 1e-8
    assert st["backward_converged"] == 1.0 and st["backward_nstep"] >= 1
    assert m.last_forward_stats.nstep == st["forward_nstep"]
    assert is_deq(m)
    assert not is_deq(deqbench.models.create("tied_repeat_tiny"))


def test_unknown_backward_mode_is_config_error():
    from deqbench.errors import ConfigError

    m = tiny_tanh_deq()
    with pytest.raises(ConfigError, match="backward mode"):
        configure(m, backward=BackwardConfig("ifft"))


@pytest.mark.parametrize(
    "kw,msg",
    [
        ({"second_order": "exact"}, "second_order must be one of implicit, refine"),
        ({"b_init": "gard"}, "b_init must be one of grad, zeros"),
        ({"k": 0}, "k must be an integer >= 1"),
        ({"tau": 0.0}, r"tau must be in \(0, 1\]"),
        ({"name": "ifft"}, "unknown backward mode 'ifft'; did you mean 'ift'"),
        ({"stop_mode": "relative"}, "stop_mode must be one of rel, abs"),
    ],
)
def test_backward_config_rejects_bad_values(kw, msg):
    """A typo must not silently pick another behaviour (second_order 'exact' took the refine
    path: an HVP 61% off)."""
    from deqbench.errors import ConfigError

    with pytest.raises(ConfigError, match=msg):
        BackwardConfig(**kw)


def test_suite_rejects_unknown_second_order():
    from deqbench.errors import ConfigError
    from deqbench.run.suite import suite_from_dict

    raw = {
        "schema": 1, "name": "x", "device": "cpu", "data": {"name": "digits"},
        "defaults": {"model": {"name": "fc_deq_tiny"},
                     "backward": {"name": "ift", "second_order": "exact"}},
    }  # fmt: skip
    with pytest.raises(ConfigError, match="second_order"):
        suite_from_dict(raw)
