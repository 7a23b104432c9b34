"""newton_krylov against independent references (float64 unless stated): dense Newton with the
exact Jacobian, dense linear solves for the adjoint, finite differences of the loss, unrolled
Hessian-vector products; per-sample stopping and the f-evaluation / JVP counts."""

from __future__ import annotations

import pytest
import torch

import deqbench
from deqbench.core.backward import AdjointMap
from deqbench.deq import BackwardConfig, SolverConfig, configure
from deqbench.errors import ConfigError
from deqbench.solvers.base import residuals

N, B = 16, 4


def nk(f, z0, **kw):
    return deqbench.solvers.get("newton_krylov")(f, z0, **kw)


class TanhMap:
    """f(z)_i = tanh(A z_i + b_i); A = Q diag(linspace(lo, hi)) Q^T. Also the per-sample map
    and its exact Jacobian for the dense reference."""

    def __init__(self, lo, hi, n=N, bsz=B, seed=0, dtype=torch.float64):
        g = torch.Generator().manual_seed(seed)
        q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
        self.A = ((q * torch.linspace(lo, hi, n, dtype=torch.float64)) @ q.T).to(dtype)
        self.b = torch.randn(bsz, n, generator=g, dtype=torch.float64).to(dtype)
        self.calls = 0

    def __call__(self, z):
        self.calls += 1
        return torch.tanh(z @ self.A.T + self.b)

    def jacobian(self, z, i):
        t = torch.tanh(z[i] @ self.A.T + self.b[i])
        return (1 - t**2)[:, None] * self.A


def dense_newton(fmap, z0, iters=50, tol=1e-14):
    """Undamped Newton, z <- z - (J - I)^-1 g(z), J the exact Jacobian, one sample at a time."""
    z = z0.clone()
    eye = torch.eye(z.shape[1], dtype=z.dtype)
    for _ in range(iters):
        fz = torch.tanh(z @ fmap.A.T + fmap.b)
        g = fz - z
        if float((g.norm(dim=1) / fz.norm(dim=1)).max()) < tol:
            return z, True
        for i in range(z.shape[0]):
            z[i] = z[i] - torch.linalg.solve(fmap.jacobian(z, i) - eye, g[i])
    return z, False


# -- against dense Newton ----------------------------------------------------------------------
@pytest.mark.parametrize("jvp", ["forward", "fd"])
def test_reaches_dense_newton_root_where_plain_iteration_fails(jvp):
    fmap = TanhMap(-4.0, -1.5)  # Jacobian eigenvalues near -3.8 at the root
    z0 = torch.zeros(B, N, dtype=torch.float64)
    zd, ok = dense_newton(fmap, z0)
    assert ok
    lam = torch.linalg.eigvals(fmap.jacobian(zd, 0)).real
    assert float(lam.min()) < -1  # plain iteration cannot converge here
    _, st_fp = deqbench.solvers.get("fixed_point")(fmap, z0, max_iter=300, tol=1e-10)
    assert not st_fp.converged
    z, st = nk(fmap, z0, max_iter=500, tol=1e-10, jvp=jvp)
    assert st.status == "converged" and st.rel_max < 1e-10
    _, r = residuals(fmap(z), z)
    assert float(r.max()) < 1e-10
    assert float((z - zd).abs().max()) < 1e-9  # the same root
    assert st.extra["newton_steps"] <= 10  # quadratic convergence, not a crawl
    if jvp == "forward":
        assert st.njvp == st.extra["matvecs"] > 0
    else:
        assert st.njvp == 0 and st.nstep > st.extra["matvecs"]


def test_contractive_map_and_float32():
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-5)):
        fmap = TanhMap(-0.9, 0.9, n=32, dtype=dtype)
        z0 = torch.zeros(B, 32, dtype=dtype)
        z, st = nk(fmap, z0, max_iter=300, tol=tol)
        assert st.converged, (dtype, st.status, st.rel_max)
        zr, _ = deqbench.solvers.get("anderson")(fmap, z0, max_iter=300, tol=tol)
        assert float((z - zr).abs().max()) < 100 * tol


def test_counts_and_budget():
    fmap = TanhMap(-4.0, -1.5)
    z0 = torch.zeros(B, N, dtype=torch.float64)
    z, st = nk(fmap, z0, max_iter=500, tol=1e-10, jvp="forward")
    # each JVP through torch.func.jvp also calls f once (its primal): counted apart
    assert fmap.calls == st.nstep + st.njvp
    assert st.rel_trace.shape == (st.extra["newton_steps"] + 1, B)  # one row per Newton step
    fd = TanhMap(-4.0, -1.5)
    _, st = nk(fd, z0, max_iter=500, tol=1e-10, jvp="fd")
    assert fd.calls == st.nstep and st.njvp == 0
    # max_iter bounds f-evaluations + JVPs; max_jvp splits the budget
    small = TanhMap(-4.0, -1.5)
    _, st = nk(small, z0, max_iter=12, tol=1e-10, jvp="forward")
    assert st.status == "max_iter" and st.nstep + st.njvp <= 12
    _, st = nk(TanhMap(-4.0, -1.5), z0, max_iter=12, max_jvp=100, tol=1e-10, jvp="forward")
    assert st.nstep <= 12 and st.njvp <= 100 and st.converged


def test_per_sample_stopping_and_independence():
    fmap = TanhMap(-3.0, -1.2, bsz=3)
    z0 = torch.zeros(3, N, dtype=torch.float64)
    zb, st = nk(fmap, z0, max_iter=500, tol=1e-11)
    assert st.converged
    # each sample alone gives the same iterate: every decision is per sample
    for i in range(3):
        one = TanhMap(-3.0, -1.2, bsz=3)
        one.b = one.b[i : i + 1]
        zi, sti = nk(one, z0[i : i + 1], max_iter=500, tol=1e-11)
        assert torch.allclose(zi[0], zb[i], atol=1e-13, rtol=0)
    # a sample that starts at its root takes no step (its iterate never moves)
    z0 = zb.clone()
    z0[1:] = 0
    z, st = nk(fmap, z0, max_iter=500, tol=1e-11)
    assert st.converged and torch.equal(z[0], zb[0])
    assert torch.all(st.rel_trace[:, 0] == st.rel_trace[0, 0])
    assert float(st.rel_trace[0, 1:].min()) > 1e-3  # the others did start away from theirs


def test_no_root_ends_non_converged():
    # z = z^2 + 1 has no real root; z = z + 1 neither (J - I = 0)
    for f in (lambda z: z * z + 1.0, lambda z: z + 1.0):
        z, st = nk(f, torch.zeros(B, 3, dtype=torch.float64), max_iter=10_000, tol=1e-10)
        assert not st.converged and st.status in ("stagnated", "max_iter")
        assert st.nstep + st.njvp < 200  # stops on its own, long before the budget
        assert bool(st.extra["stalled"].all())
        assert torch.isfinite(z).all()


def test_options_are_validated():
    f, z0 = (lambda z: 0.5 * z), torch.ones(2, 3)
    for bad in ({"jvp": "reverse"}, {"restart": 0}, {"forcing": 1.5}, {"max_restarts": -1},
                {"ls_c1": 1.0}, {"restrat": 5}):  # fmt: skip
        with pytest.raises(ConfigError):
            nk(f, z0, **bad)
    z, st = nk(f, z0, tol=1e-6, forcing=0.1, restart=3, line_search=False)
    assert st.converged


# -- as the adjoint solver ---------------------------------------------------------------------
def test_adjoint_map_solved_directly_with_its_own_products():
    g = torch.Generator().manual_seed(3)
    A = torch.randn(N, N, generator=g, dtype=torch.float64)
    A *= 1.5 / torch.linalg.matrix_norm(A, ord=2)  # plain adjoint iteration would diverge
    rhs = torch.randn(B, N, generator=g, dtype=torch.float64)
    calls = []

    def fn(w):
        calls.append(1)
        return w @ A + rhs  # per sample: A^T w + g

    w, st = nk(AdjointMap(fn, None, None, None, rhs), rhs.clone(), max_iter=200, tol=1e-12)
    ref = torch.linalg.solve(torch.eye(N, dtype=torch.float64) - A.T, rhs.T).T
    assert st.converged and float((w - ref).abs().max()) < 1e-10
    assert st.extra["jvp_mode"] == "affine" and st.njvp == 0
    assert len(calls) == st.nstep  # every product is one call of the adjoint map (a VJP)
    assert st.extra["newton_steps"] <= 2  # a linear system: one solve, at most one refinement


def tiny_tanh_deq(seed=0, width=12, in_dim=6, norm=0.95):
    torch.manual_seed(seed)
    m = deqbench.models.create(
        "fc_deq_tiny", in_shape=(in_dim,), num_outputs=3, width=width
    ).double()
    with torch.no_grad():
        W = m.deq.cell.W.weight
        W.mul_(norm / torch.linalg.matrix_norm(W, ord=2))
    return m


TIGHT = SolverConfig("newton_krylov", max_iter=400, tol=1e-14)
NK_ADJ = BackwardConfig("ift", solver="newton_krylov", max_iter=400, tol=1e-13)


def flat(ts):
    return torch.cat([t.reshape(-1) for t in ts])


def test_ift_gradient_with_newton_krylov_matches_finite_differences():
    m = tiny_tanh_deq()
    x = torch.randn(5, 6, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 1, 0])
    params = list(m.parameters())
    loss = lambda: torch.nn.functional.cross_entropy(m(x), y)  # noqa: E731
    configure(m, TIGHT, NK_ADJ)
    grad = flat(torch.autograd.grad(loss(), params))
    fw, bw = m.deq.last_forward_stats, m.deq.last_backward_stats
    assert fw.converged and fw.solver == "newton_krylov"
    assert bw.converged and bw.solver == "newton_krylov" and bw.extra["jvp_mode"] == "affine"
    assert m.deq.vjp_bwd == bw.nstep + 1  # adjoint products + the final parameter VJP
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
        assert abs(fd - float(grad @ d)) / (abs(fd) + 1e-12) < 1e-6


def test_ift_hvp_with_newton_krylov_adjoint_matches_unrolled():
    # the double backward solves the tangent system v = J v + c with newton_krylov too (JVPs
    # through the map, nested forward-mode AD)
    m = tiny_tanh_deq(seed=3, norm=0.8)
    x = torch.randn(4, 6, dtype=torch.float64)
    y = torch.tensor([0, 2, 1, 1])
    params = list(m.parameters())
    loss = lambda: torch.nn.functional.cross_entropy(m(x), y)  # noqa: E731
    v = torch.randn(sum(p.numel() for p in params), dtype=torch.float64,
                    generator=torch.Generator().manual_seed(7))  # fmt: skip
    hv = {}
    for name, bw in (("nk", NK_ADJ), ("unrolled", BackwardConfig("unrolled", k=400))):
        configure(m, TIGHT, bw)
        g = flat(torch.autograd.grad(loss(), params, create_graph=True))
        hv[name] = flat(torch.autograd.grad(g @ v, params))
        tangent = getattr(m.deq, "last_tangent_stats", None)
        if name == "nk" and tangent is not None:  # solved as the affine map it is
            assert tangent.converged and tangent.extra["jvp_mode"] == "affine"
    ref = hv["unrolled"]
    assert float((hv["nk"] - ref).norm() / ref.norm()) < 1e-9


def test_forward_on_conv_cell_float32():
    torch.manual_seed(0)
    m = deqbench.models.create("conv_deq_tiny")
    with torch.no_grad():
        u = m.inject(torch.randn(2, 1, 8, 8))
        f = deqbench.deq.CellMap(m.cell, u)
        z, st = nk(f, torch.zeros_like(u), max_iter=100, tol=1e-4)
        assert st.converged and st.extra["jvp_mode"] == "forward"
        _, r = residuals(f(z), z)
    assert float(r.max()) < 1e-4


def test_solver_stats_report_jvps_beside_f_evaluations(tmp_path):
    """A suite cell with newton_krylov records forward_njvp (unit JVPs) per epoch and in the
    final test pass; cells of other solvers get no such rows."""
    import deqbench
    from deqbench.run.suite import suite_from_dict

    raw = {
        "schema": 1,
        "name": "nk",
        "device": "cpu",
        "threads": 1,
        "data": {"name": "digits", "train_subset": 64, "test_subset": 32},
        "defaults": {
            "model": {"name": "fc_deq_tiny", "width": 8},
            "train": {"epochs": 1, "batch_size": 32},
        },
        "matrix": {"solver": ["newton_krylov", "broyden"]},
        "analyses": [{"solver_stats": {"trace_samples": 4}}],
        "output": str(tmp_path),
    }
    summary = deqbench.run_suite(suite_from_dict(raw), progress=False, plots=False)
    df = deqbench.load_results(summary.run_dir)
    jvp = df[df.metric == "forward_njvp"]
    assert set(jvp.solver) == {"newton_krylov"}
    assert (jvp.unit == "JVPs").all() and (jvp.value > 0).all()
    assert {"train", "final_test"} <= set(jvp.variant)
