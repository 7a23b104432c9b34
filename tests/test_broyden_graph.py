"""Broyden's static-buffer path (``cuda_graph``). On CPU the static step runs eagerly
and must make the eager path's iterates (the points f is evaluated at, the traces, the counts);
the gpu-marked test captures it in a CUDA graph, caches it and replays it."""

from __future__ import annotations

import pytest
import torch

from deqbench.solvers import get
from deqbench.solvers.base import (
    AUTO_STEPS,
    GRAPH_STEPS_MAX,
    SolverOptionError,
    clear_graph_cache,
    residuals,
    supports_graph,
)

B, N = 4, 20


class Cell:
    """z -> tanh(W z + U x) (or W z + x, ``linear``) with ||W||_2 = 0.8; reads its input ``x``
    (a static tensor: copy new inputs into it) at every call, records the points it is
    evaluated at and counts the calls."""

    def __init__(self, linear=False, seed=0, dtype=torch.float64, device="cpu"):
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(N, N, generator=g, dtype=torch.float64)
        self.W = (w * 0.8 / torch.linalg.matrix_norm(w, 2)).to(device, dtype)
        self.U = torch.randn(N, N, generator=g, dtype=torch.float64).to(device, dtype)
        self.x = torch.randn(B, N, generator=g, dtype=torch.float64).to(device, dtype)
        self.linear = linear
        self.seen: list[torch.Tensor] = []
        self.record = True

    def __call__(self, z):
        if self.record:
            self.seen.append(z.clone())
        if self.linear:
            return z @ self.W.T + self.x
        return torch.tanh(z @ self.W.T + self.x @ self.U.T)

    def run(self, z0, **kw):
        self.seen = []
        z, st = get("broyden")(self, z0, **kw)
        return z, st, torch.stack(self.seen)


def z0_like(cell):
    return torch.zeros(B, N, dtype=cell.W.dtype, device=cell.W.device)


def assert_same_solve(eager, static, atol=1e-10):
    (ze, se, pe), (zs, ss, ps) = eager, static
    assert (ss.nstep, ss.status, ss.converged) == (se.nstep, se.status, se.converged)
    assert ps.shape == pe.shape and ss.nstep == ps.shape[0]
    torch.testing.assert_close(ps, pe, rtol=0, atol=atol)
    torch.testing.assert_close(zs, ze, rtol=0, atol=atol)
    for name in ("pairs", "restarts"):
        assert ss.extra[name] == se.extra[name], name
    assert torch.equal(ss.extra["skipped_updates"], se.extra["skipped_updates"])


OPTS = [
    {},
    {"memory": 3},  # restarts
    {"memory": 2, "stop_mode": "abs"},
    {"memory": 3, "on_full": "ring"},
    {"returns": "last"},
    {"line_search": True},
    {"line_search": True, "memory": 3},
    {"line_search": True, "memory": 3, "on_full": "ring"},
]


def test_supports_cuda_graph():
    assert supports_graph(get("broyden"))


#: the max_iter case's budget per cell: the solve stops while its residuals are still far above
#: float64 rounding (batch max >= ~1e-9 tanh, ~1e-10 linear at the last step). With 25 steps the
#: tanh cell reached f(z) == z exactly (residual 0) from step ~17 on: from there every update is
#: degenerate, and the skip decisions, line-search acceptances and per-sample lowest iterates
#: the two paths are compared on are rounding ties (machine-dependent)
BUDGET = {False: 10, True: 20}
#: the lowest stop-mode residual a max_iter solve may reach (about 5000 float64 eps): above it a
#: step changes the residual by far more than rounding, so no decision above is a tie
FLOOR = 1e-12
#: a converged solve's stop decision is robust where no recorded residual lies within this
#: factor of tol (the paths' residuals agree to ~1e-6 relative near tol 1e-10)
MARGIN = 1.05


def stop_residuals(st, opts):
    """Per recorded step, the value the tracker compares with tol (``best < tol``): the batch max
    of the per-sample running-lowest residual (``returns="last"``: of the residual)."""
    tr = st.abs_trace if opts.get("stop_mode") == "abs" else st.rel_trace
    return (tr if opts.get("returns") == "last" else torch.cummin(tr, 0).values).amax(1)


@pytest.mark.parametrize("linear", [False, True])
@pytest.mark.parametrize("opts", OPTS)
# converged; max_iter at tol 0: convergence needs a residual strictly below tol and stagnation
# one below 3 tol, so no residual (not even one that rounds to exactly 0, which met tol 1e-30
# on some CPUs) ends a tol-0 solve before max_iter: the status is certain
@pytest.mark.parametrize("tol", [1e-10, 0.0], ids=["converged", "max_iter"])
def test_static_path_makes_the_eager_iterates(linear, opts, tol):
    cell = Cell(linear=linear)
    max_iter = 100 if tol > 0 else BUDGET[linear]
    kw = dict(max_iter=max_iter, tol=tol, **opts)
    eager = cell.run(z0_like(cell), **kw)
    static = cell.run(z0_like(cell), cuda_graph=True, **kw)
    se, ss = eager[1], static[1]
    # the premises under which the comparisons below are machine-independent (not part of the
    # paths' agreement: a failure here means the test problem lost its margin, not a bug)
    for st in (se, ss):
        res = stop_residuals(st, opts)
        if tol > 0:  # no residual near tol: both paths stop at the same step
            near = (res > tol / MARGIN) & (res < tol * MARGIN)
            assert not bool(near.any()), ("a residual within 5% of tol", res.tolist())
        else:  # far from rounding level: no decision of the solve is a rounding tie
            assert float(res.min()) > FLOOR, ("solve reached rounding level", res.tolist())
    assert_same_solve(eager, static)
    if tol > 0:
        assert se.status == "converged" and ss.nstep == se.nstep < max_iter
        assert float(stop_residuals(se, opts)[-1]) < tol  # the status follows the residuals
    else:
        assert se.status == "max_iter" and ss.nstep == se.nstep == max_iter
    if se.abs_trace.shape[0] == se.nstep:  # no backtracking: the eager path's traces
        torch.testing.assert_close(ss.abs_trace, se.abs_trace, rtol=0, atol=1e-10)
        torch.testing.assert_close(ss.rel_trace, se.rel_trace, rtol=0, atol=1e-10)
        assert torch.equal(ss.extra["lowest_steps"], se.extra["lowest_steps"])
    else:  # rejected trials are recorded as the accepted point again
        assert opts.get("line_search") and ss.abs_trace.shape[0] == ss.nstep
        rows = torch.unique_consecutive(ss.abs_trace, dim=0)
        torch.testing.assert_close(rows, se.abs_trace, rtol=0, atol=1e-10)
    assert ss.extra["cuda_graph"] == "capture" and ss.extra["graph_steps"] == AUTO_STEPS
    assert ss.path == "eager"  # CPU: the static step ran eagerly, no graph
    # the reported residual is that of the returned iterate (f evaluated again: equal up to its
    # rounding, which is ~1e-6 of a residual near 1e-10; other iterates' differ by factors)
    a, r = residuals(cell(static[0]), static[0])
    torch.testing.assert_close(ss.abs_residual, a, rtol=1e-5, atol=1e-14)
    torch.testing.assert_close(ss.rel_residual, r, rtol=1e-5, atol=1e-14)
    if opts.get("returns") == "last":
        torch.testing.assert_close(static[0], static[2][-1], rtol=0, atol=0)
        torch.testing.assert_close(ss.rel_residual, ss.rel_trace[-1], rtol=0, atol=0)
    if opts.get("memory") == 3 and opts.get("on_full") != "ring" and tol == 0:
        assert ss.extra["restarts"] > 0


def test_chunked_layout(monkeypatch):
    """The CUDA layout (each sample's vector as chunks for the batched products) on CPU."""
    import deqbench.solvers.broyden as mod

    monkeypatch.setattr(mod, "chunking", lambda bsz, dim, device: (4, dim // 4))
    cell = Cell()
    for opts in ({}, {"memory": 3}, {"memory": 3, "line_search": True}):
        kw = dict(max_iter=100, tol=1e-10, **opts)
        assert_same_solve(
            cell.run(z0_like(cell), **kw), cell.run(z0_like(cell), cuda_graph=True, **kw)
        )


@pytest.mark.parametrize(
    "opts", [{}, {"memory": 3}, {"memory": 3, "on_full": "ring"}, {"line_search": True}]
)
def test_large_state_buckets_of_one_pair(monkeypatch, opts):
    """States above AUTO_NUMEL (conv64) read exactly the pairs that can be in use at each step
    (LARGE_GRAIN = 1: one captured graph per pair count) and still make the eager
    path's iterates; a bucket one pair short would drop a pair in use and change them."""
    import deqbench.solvers.broyden as mod

    seen: list[int] = []
    real = mod.graph_loop
    short = [0]  # pairs a bucket leaves out (the negative control below)

    def spy(*a, phase, **kw):
        def ph(n):
            seen.append(max(1, phase(n) - short[0]))
            return seen[-1]

        return real(*a, phase=ph, **kw)

    monkeypatch.setattr(mod, "AUTO_NUMEL", B * N - 1)
    monkeypatch.setattr(mod, "graph_loop", spy)
    cell = Cell()
    kw = dict(max_iter=100, tol=1e-10, graph_steps=1, **opts)
    eager = cell.run(z0_like(cell), **kw)
    static = cell.run(z0_like(cell), cuda_graph=True, **kw)
    assert_same_solve(eager, static)
    cap = opts.get("memory", 20)
    # one chunk per evaluation, reading the pairs in use then: the eager path's pair count
    # (one more per update from the second evaluation on; the restart rule empties a full
    # memory and keeps the restart's own pair; a ring stays full; a line search: the bound
    # n - 2, since a rejected trial makes no pair)
    want, npairs = [], 0
    for n in range(static[1].nstep):
        full = npairs >= cap and opts.get("on_full", "restart") == "restart"
        want.append(min(cap, max(1, n - 2 if "line_search" in opts else 0 if full else npairs)))
        if n >= 2:
            npairs = 1 if full else npairs + 1
    assert seen == want
    if opts.get("memory") == 3 and "on_full" not in opts:
        assert static[1].nstep > 6 and min(seen[5:]) < 3  # pairs read fell after a restart
    if "line_search" not in opts:  # a bucket one pair short drops a pair in use
        seen.clear()
        short[0] = 1
        with pytest.raises(AssertionError):
            assert_same_solve(eager, cell.run(z0_like(cell), cuda_graph=True, **kw))


@pytest.mark.parametrize(
    "opts", [{}, {"memory": 3}, {"memory": 3, "on_full": "ring"}, {"line_search": True}]
)
@pytest.mark.parametrize("large", [True, False])
def test_uninitialised_buffers_are_never_read(monkeypatch, opts, large):
    """Every static buffer the path allocates uninitialised (torch.empty, filled with NaN here)
    is written before it is read: on a large state (exact pairs per step) only [g, dx] and the
    first pair are zeroed at the start, so a row read before this solve wrote it would spread
    NaN into the iterates (zero coefficients do not cancel it)."""
    import deqbench.solvers.broyden as mod

    real = torch.empty

    def nan_empty(*a, **kw):
        t = real(*a, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    if large:
        monkeypatch.setattr(mod, "AUTO_NUMEL", B * N - 1)
    cell = Cell()
    kw = dict(max_iter=100, tol=1e-10, graph_steps=1, **opts)
    eager = cell.run(z0_like(cell), **kw)
    monkeypatch.setattr(torch, "empty", nan_empty)
    static = cell.run(z0_like(cell), cuda_graph=True, **kw)
    monkeypatch.setattr(torch, "empty", real)
    assert_same_solve(eager, static)
    assert static[1].status == "converged"


@pytest.mark.parametrize("max_iter", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("opts", [{}, {"line_search": True}, {"on_full": "ring", "memory": 2}])
def test_max_iter_reached(max_iter, opts):
    cell = Cell()
    kw = dict(max_iter=max_iter, tol=1e-14, **opts)
    eager = cell.run(z0_like(cell), **kw)
    static = cell.run(z0_like(cell), cuda_graph="cache", **kw)  # CPU: nothing is cached
    assert_same_solve(eager, static)
    assert static[1].status == "max_iter" and static[1].nstep == max_iter


def test_diverging_maps_are_reported_as_diverged():
    z0 = torch.zeros(B, N, dtype=torch.float64)

    def nan_map(z):  # no fixed point; NaN once |z| > 0.5
        return torch.where(z.abs() > 0.5, torch.full_like(z, float("nan")), z + 0.1)

    def blow_up(z):  # the abs residual jumps past protect_thres (1e6) times the first
        return z + 1 + torch.where(z.abs() > 0.5, 1e8, 0.0)

    for f in (nan_map, blow_up):
        ze, se = get("broyden")(f, z0, max_iter=50, tol=1e-6)
        zs, ss = get("broyden")(f, z0, max_iter=50, tol=1e-6, cuda_graph=True)
        assert ss.status == se.status == "diverged" and not ss.converged
        assert ss.nstep == se.nstep < 50
        assert torch.isfinite(zs).all() and torch.equal(zs, ze)


def test_line_search_backtracks_on_the_device():
    """A full first step overshoots into NaN; the line search halves it. The decisions (and so
    the points f is evaluated at) are the eager path's; a rejected trial is recorded as the
    accepted point again, so the traces have one row per f-evaluation."""
    g = torch.Generator().manual_seed(3)
    c = 0.3 + 0.7 * torch.rand(B, N, generator=g, dtype=torch.float64)
    seen = []

    def f(z):
        seen.append(z.clone())
        return torch.where(z.abs().amax(1, keepdim=True) > 2, torch.nan, z - 3 * (z - c))

    z0 = torch.zeros(B, N, dtype=torch.float64)
    for opts in ({}, {"returns": "last"}, {"memory": 2}):
        kw = dict(max_iter=60, tol=1e-10, line_search=True, **opts)
        seen.clear()
        ze, se = get("broyden")(f, z0, **kw)
        pe = torch.stack(seen)
        seen.clear()
        zs, ss = get("broyden")(f, z0, cuda_graph=True, **kw)
        ps = torch.stack(seen)
        assert ss.status == se.status == "converged" and ss.nstep == se.nstep == ps.shape[0]
        assert ps.shape == pe.shape and float(ps[1].abs().max()) > 2  # the NaN trial
        torch.testing.assert_close(ps, pe, rtol=0, atol=1e-12)
        torch.testing.assert_close(zs, c, rtol=0, atol=1e-10)
        torch.testing.assert_close(zs, ze, rtol=0, atol=1e-12)
        assert se.abs_trace.shape[0] < ss.abs_trace.shape[0] == ss.nstep
        rows = torch.unique_consecutive(ss.abs_trace, dim=0)
        torch.testing.assert_close(rows, se.abs_trace, rtol=0, atol=1e-12)


def test_graph_steps():
    cell = Cell()
    z, st, pts = cell.run(z0_like(cell), max_iter=100, tol=1e-10, cuda_graph=True, graph_steps=3)
    assert st.converged and st.extra["graph_steps"] == 3
    assert st.nstep == pts.shape[0] == st.abs_trace.shape[0] <= 100
    _, r = residuals(cell(z), z)
    assert float(r.max()) <= 1e-10
    z, st, pts = cell.run(z0_like(cell), max_iter=10, tol=1e-14, cuda_graph=True, graph_steps=3)
    assert st.status == "max_iter" and st.nstep == pts.shape[0] == 10


@pytest.mark.parametrize(
    "opts",
    [
        {"cuda_graph": "yes"},
        {"cuda_graph": 1},
        {"cuda_graph": "capture"},
        {"graph_steps": 0},
        {"graph_steps": GRAPH_STEPS_MAX + 1},
        {"graph_steps": 2.5},
        {"graph_steps": True},
        {"cuda_graph": True, "graph_steps": -1},
        {"cuda_graph": True, "grahp_steps": 2},
    ],
)
def test_bad_options_rejected(opts):
    cell = Cell()
    with pytest.raises(SolverOptionError):
        get("broyden")(cell, z0_like(cell), max_iter=5, tol=1e-3, **opts)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "opts",
    [{}, {"memory": 3}, {"memory": 3, "on_full": "ring"}, {"line_search": True, "memory": 3}],
)
def test_cuda_graph_cache_replays_and_matches_eager(opts):
    from deqbench.solvers import base

    clear_graph_cache()
    cell = Cell(device="cuda")
    cell.record = False  # f must not sync or keep references during capture
    z0 = z0_like(cell)
    kw = dict(max_iter=80, tol=1e-11, **opts)
    try:
        sizes = []
        for seed in (0, 1):  # the first solve captures, the second replays the cached graphs
            cell.x.copy_(torch.randn(B, N, generator=torch.Generator().manual_seed(seed)).cuda())
            ze, se = get("broyden")(cell, z0, **kw)
            zs, ss = get("broyden")(cell, z0, cuda_graph="cache", graph_steps=1, **kw)
            assert ss.path == "graph" and ss.extra["cuda_graph"] == "cache"
            assert ss.status == se.status == "converged" and ss.nstep == se.nstep
            torch.testing.assert_close(zs, ze, rtol=0, atol=1e-9)
            assert ss.extra["pairs"] == se.extra["pairs"]
            assert ss.extra["restarts"] == se.extra["restarts"]
            # several steps per replay: the host reads the residuals a replay late unless their
            # trend predicts convergence, so up to 2 * 3 - 1 steps past tol, never past max_iter
            z3, s3 = get("broyden")(cell, z0, cuda_graph="cache", graph_steps=3, **kw)
            assert s3.path == "graph" and s3.converged
            assert s3.extra.get("nstep_to_tol", s3.nstep) == se.nstep <= s3.nstep <= se.nstep + 5
            _, r = residuals(cell(z3), z3)
            assert float(r.max()) < 1e-11
            kw7 = dict(kw, max_iter=7, tol=0.0)
            zm, sm = get("broyden")(cell, z0, cuda_graph="cache", graph_steps=3, **kw7)
            zme, sme = get("broyden")(cell, z0, **kw7)
            assert sm.status == "max_iter" and sm.nstep == 7 == sme.nstep
            torch.testing.assert_close(zm, zme, rtol=0, atol=1e-9)
            sizes.append(sum(1 for k in base._GRAPH_CACHE if k[0] == "broyden" and k[1] is cell))
        assert sizes == [3, 3]  # one graph per (max_iter, graph_steps), reused by the 2nd solves
    finally:
        clear_graph_cache()
