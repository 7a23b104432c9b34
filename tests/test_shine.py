"""SHINE (the ``shine`` backward mode with Broyden's ``keep_inverse``) against
independent references on CPU in float64 (BACKWARD_LAB.md 2.7 and 4): the algebra of the inverse
estimate Broyden hands out (adjoint identity, secant condition of every update), a linear sanity
check, the cosine and norm ratio against the dense IFT gradient beside the Jacobian-free
baseline, refinement converging to IFT, the per-sample fallback, and the parameter-gradient wiring
(the same w through f's VJP)."""

from __future__ import annotations

import pytest
import torch
from lab_helpers import TanhCell, dense_ift_adjoint, one_thread_seeded  # noqa: F401

import deqbench
from deqbench.backward.shine import inverse_pairs, matvec, rmatvec, shine_adjoint
from deqbench.deq import BackwardConfig, CellMap, DEQLayer, SolverConfig
from deqbench.errors import ConfigError


def _broyden(f, z0, max_iter, tol=0.0, **opts):
    solve = deqbench.solvers.get("broyden")
    opts = {"keep_inverse": True, "stagnation": False, **opts}
    z, st = solve(f, z0, max_iter=max_iter, tol=tol, **opts)
    U, V = inverse_pairs(st.extra["inverse"], z0.shape[0], z0[0].numel())
    return z, st, U, V


def _oracle(cell, x, zbar):
    """Dense IFT (lab_helpers.dense_ift_adjoint); returns (z*, w, gradient of theta = w^T
    df/dtheta, flattened)."""
    z, w = dense_ift_adjoint(cell, x, zbar)
    gs = torch.autograd.grad(cell(z, x), list(cell.parameters()), w)
    return z, w, torch.cat([g.reshape(-1) for g in gs])


def _grad(cell, x, zbar, backward, forward=None):
    layer = DEQLayer(cell, forward or SolverConfig("broyden", 200, 1e-12), backward)
    z = layer(x)
    gs = torch.autograd.grad((z * zbar).sum(), list(cell.parameters()))
    return layer, torch.cat([g.reshape(-1) for g in gs])


def _cos_ratio(g, ref):
    return float(g @ ref / (g.norm() * ref.norm())), float(g.norm() / ref.norm())


def test_adjoint_identity_and_secant_condition_of_every_update():
    """<p, H q> = <H^T p, q> to 1e-12; the trajectory rebuilt from the handed-out estimates
    (x+ = x - H g) is the solver's own, and each estimate meets the secant condition of its
    last update H_{k+1} t_k = s_k to 1e-10."""
    cell = TanhCell(d=6, scale=0.8).requires_grad_(False)
    x = torch.randn(3, 6, dtype=torch.float64)
    f = CellMap(cell, x)
    z0 = torch.zeros(3, 6, dtype=torch.float64)

    def g(z):
        return f(z) - z

    _, _, U, V = _broyden(f, z0, 9)
    p, q = torch.randn(3, 6, dtype=torch.float64), torch.randn(3, 6, dtype=torch.float64)
    lhs = (p * matvec(U, V, q)).sum(1)
    rhs = (rmatvec(U, V, p) * q).sum(1)
    assert float((lhs - rhs).abs().max()) <= 1e-12 * float(lhs.abs().max())

    xs = [z0]
    for k in range(7):  # H_k from a solve of k + 2 evaluations (k updates)
        if k == 0:
            Uk, Vk = U[:, :0], V[:, :0]
        else:
            _, _, Uk, Vk = _broyden(f, z0, k + 2)
            assert Uk.shape[1] == k
        xs.append(xs[-1] - matvec(Uk, Vk, g(xs[-1])))
        z_last, _, _, _ = _broyden(f, z0, k + 2, returns="last")
        assert torch.allclose(z_last, xs[-1], rtol=0, atol=1e-13)  # the solver's own iterate
    for k in range(6):
        s, t = xs[k + 1] - xs[k], g(xs[k + 1]) - g(xs[k])
        _, _, Uk, Vk = _broyden(f, z0, k + 3)  # H_{k+1}
        err = (matvec(Uk, Vk, t) - s).norm(dim=1) / s.norm(dim=1)
        assert float(err.max()) <= 1e-10, (k, err)


def test_linear_problem_root_in_2d_steps_and_inverse_quality():
    """g(z) = A z - b, A well conditioned: Broyden reaches the root within 2d steps; -H^T zbar
    against the exact -A^-T zbar is reported (quality, not exactness)."""
    d = 10
    gen = torch.Generator().manual_seed(1)
    R = torch.randn(d, d, generator=gen, dtype=torch.float64)
    A = -torch.eye(d, dtype=torch.float64) + 0.4 * R / torch.linalg.matrix_norm(R, 2)
    b = torch.randn(2, d, generator=gen, dtype=torch.float64)

    def f(z):  # f(z) - z = A z - b
        return z + z @ A.T - b

    z, st, U, V = _broyden(f, torch.zeros(2, d, dtype=torch.float64), 2 * d + 1, tol=1e-10)
    assert st.converged and st.nstep <= 2 * d + 1
    assert torch.allclose(z, torch.linalg.solve(A, b.T).T, atol=1e-8)
    zbar = torch.randn(2, d, generator=gen, dtype=torch.float64)
    w = -rmatvec(U, V, zbar)
    w_exact = -torch.linalg.solve(A.T, zbar.T).T
    cos = torch.nn.functional.cosine_similarity(w, w_exact, dim=1)
    print(f"linear, d={d}: {st.nstep} evaluations; cosine(-H^T zbar, -A^-T zbar) = {cos.tolist()}")
    assert bool((cos > 0.5).all())


@pytest.mark.parametrize(("d", "scale", "seed"), [(8, 0.5, 0), (16, 0.5, 1), (16, 0.8, 2)])
def test_shine_beats_jacobian_free_against_the_ift_oracle(d, scale, seed):
    """Cosine and norm ratio of the parameter gradient against the dense IFT oracle: plain SHINE
    has no equality target but is closer than JFB on these well-conditioned problems; SHINE with
    enough refinement steps matches IFT to ~1e-8 (from the transposed estimate or from -I)."""
    cell = TanhCell(d=d, scale=scale, seed=seed)
    gen = torch.Generator().manual_seed(seed + 10)
    x = torch.randn(4, d, generator=gen, dtype=torch.float64)
    zbar = torch.randn(4, d, generator=gen, dtype=torch.float64)
    _, _, g_ift = _oracle(cell, x, zbar)
    _, g_jfb = _grad(cell, x, zbar, BackwardConfig("jfb"))
    layer, g_shine = _grad(cell, x, zbar, BackwardConfig("shine"))
    cos_j, ratio_j = _cos_ratio(g_jfb, g_ift)
    cos_s, ratio_s = _cos_ratio(g_shine, g_ift)
    err_j = float((g_jfb - g_ift).norm() / g_ift.norm())
    err_s = float((g_shine - g_ift).norm() / g_ift.norm())
    print(
        f"d={d} ||W||={scale}: SHINE cos {cos_s:.6f} ratio {ratio_s:.4f} err {err_s:.3g}; "
        f"JFB cos {cos_j:.6f} ratio {ratio_j:.4f} err {err_j:.3g}; "
        f"pairs {layer.last_backward_info['inverse_pairs']:.0f}"
    )
    assert cos_s > cos_j and err_s < err_j
    assert layer.last_backward_info["fallback_fraction"] == 0.0
    for init in ("transpose", "identity"):
        opts = {"refine_steps": 60, "refine_init": init}
        layer, g_ref = _grad(cell, x, zbar, BackwardConfig("shine", tol=1e-13, options=opts))
        assert float((g_ref - g_ift).norm() / g_ift.norm()) <= 1e-8
        assert layer.last_backward_stats.solver == "shine_refine"


def test_refinement_from_the_shared_estimate_beats_refinement_from_identity():
    """A few refinement steps started from the forward's H^T get closer to IFT than as many
    started from -I (the sharing is what SHINE adds)."""
    errs = {"transpose": [], "identity": []}
    for seed in range(3):
        cell = TanhCell(d=16, scale=0.8, seed=seed)
        gen = torch.Generator().manual_seed(seed + 10)
        x = torch.randn(4, 16, generator=gen, dtype=torch.float64)
        zbar = torch.randn(4, 16, generator=gen, dtype=torch.float64)
        _, _, g_ift = _oracle(cell, x, zbar)
        for init in errs:
            opts = {"refine_steps": 3, "refine_init": init}
            _, g = _grad(cell, x, zbar, BackwardConfig("shine", tol=1e-14, options=opts))
            errs[init].append(float((g - g_ift).norm() / g_ift.norm()))
    print("3 refinement steps, error vs IFT:", errs)
    assert sum(errs["transpose"]) < sum(errs["identity"])


def test_fallback_replaces_exactly_the_samples_above_the_threshold():
    g = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    # H = -I + u v^T per sample: sample 0 gets w = g - v (u . g) = 3 g (norm ratio 3 > 1.8)
    U = torch.tensor([[[1.0, 0.0]], [[0.0, 0.0]], [[0.5, 0.5]]], dtype=torch.float64)
    V = torch.tensor([[[-2.0, 0.0]], [[0.0, 0.0]], [[0.2, 0.2]]], dtype=torch.float64)
    w_plain, none = shine_adjoint(g, U, V, fallback=False)
    assert torch.allclose(w_plain[0], 3 * g[0]) and not none.any()
    w, bad = shine_adjoint(g, U, V, fallback=True, threshold=1.8)
    assert bad.tolist() == [True, False, False]
    assert torch.equal(w[0], g[0])  # exactly the Jacobian-free cotangent
    assert torch.equal(w[1:], w_plain[1:])  # the others untouched
    w, bad = shine_adjoint(g, U, V, fallback=True, threshold=3.5)
    assert not bad.any()


def _fallback_batch():
    """Sample 0 near the linear regime of a cell whose J has spectral radius 0.97 (the exact w
    is large: the fallback triggers), sample 1 saturated (J ~ 0, w ~ zbar: it does not)."""
    d = 6
    Q, _ = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(3),
                                       dtype=torch.float64))  # fmt: skip
    cell = TanhCell(d=d, W=0.97 * Q)
    with torch.no_grad():
        cell.U.copy_(torch.eye(d, dtype=torch.float64))
        cell.b.zero_()
    x = torch.stack([torch.full((d,), 0.01), torch.full((d,), 8.0)]).double()
    zbar = torch.randn(2, d, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    return cell, x, zbar


def test_the_fallback_is_taken_per_sample_when_the_estimate_is_large():
    cell, x, zbar = _fallback_batch()
    fwd = SolverConfig("broyden", 300, 1e-12)
    layer, _ = _grad(cell, x, zbar, BackwardConfig("shine"), fwd)
    assert layer.last_backward_info["fallback_fraction"] == 0.5
    # the same pairs from a direct solve: sample 0's SHINE w is above 1.8 ||zbar||
    _, _, U, V = _broyden(CellMap(cell, x), torch.zeros_like(x), 300, tol=1e-12)
    w_plain, _ = shine_adjoint(zbar, U, V, fallback=False)
    ratio = (w_plain.norm(dim=1) / zbar.norm(dim=1)).tolist()
    assert ratio[0] > 1.8 > ratio[1], ratio


@pytest.mark.parametrize("fallback", [True, False])
def test_parameter_gradient_is_w_through_f_to_1e_12(fallback):
    """The layer's gradient equals w^T df/dtheta (one VJP at z*) for the w computed here from
    the same Broyden pairs: the wiring, apart from the approximation."""
    cell, x, zbar = _fallback_batch()
    x = x.clone().requires_grad_()
    fwd = SolverConfig("broyden", 300, 1e-12)
    layer = DEQLayer(cell, fwd, BackwardConfig("shine", options={"fallback": fallback}))
    z = layer(x)
    params = [*cell.parameters(), x]
    g_layer = torch.autograd.grad((z * zbar).sum(), params)
    z_d, _, U, V = _broyden(CellMap(cell, x.detach()), torch.zeros_like(x), 300, tol=1e-12)
    assert torch.equal(z_d, z.detach())
    w, bad = shine_adjoint(zbar, U, V, fallback=fallback)
    assert bad.tolist() == ([True, False] if fallback else [False, False])
    xx = x.detach().requires_grad_()
    g_ref = torch.autograd.grad(cell(z_d, xx), [*cell.parameters(), xx], w)
    for a, b in zip(g_layer, g_ref):
        assert float((a - b).norm()) <= 1e-12 * max(float(b.norm()), 1.0)


def test_shine_needs_broyden_and_validates_its_options():
    with pytest.raises(ConfigError, match="needs the forward solver 'broyden'"):
        DEQLayer(TanhCell(), SolverConfig("anderson"), BackwardConfig("shine"))
    with pytest.raises(ConfigError, match="refine_step.*did you mean 'refine_steps'"):
        BackwardConfig("shine", options={"refine_step": 3})
    with pytest.raises(ConfigError, match="fallback_threshold"):
        BackwardConfig("shine", options={"fallback_threshold": -1.0})
    with pytest.raises(ConfigError, match="keep_inverse needs the eager path"):
        deqbench.solvers.get("broyden")(
            lambda z: 0.5 * z, torch.zeros(1, 2), keep_inverse=True, cuda_graph=True
        )
    # without keep_inverse, Broyden hands nothing out (the default path is unchanged)
    _, st = deqbench.solvers.get("broyden")(lambda z: 0.5 * z + 1, torch.zeros(2, 3), tol=1e-8)
    assert "inverse" not in st.extra


@pytest.mark.gpu
def test_shine_solves_eagerly_on_cuda_where_broyden_would_be_captured():
    cell = TanhCell(d=64).cuda()
    x = torch.randn(32, 64, dtype=torch.float64, device="cuda")
    plain = DEQLayer(cell, SolverConfig("broyden", 50, 1e-8))
    with torch.no_grad():
        plain(x)
    assert plain.last_forward_stats.path == "graph"
    layer = DEQLayer(cell, SolverConfig("broyden", 50, 1e-8), BackwardConfig("shine"))
    z = layer(x.requires_grad_())
    z.sum().backward()
    assert layer.last_forward_stats.path == "eager"
    assert layer.last_backward_info["inverse_pairs"] > 0
