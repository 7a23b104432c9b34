"""The fused Broyden step (``fused.broyden_update``, three Triton kernels) against the torch code
of ``_static_steps`` it replaces and against the eager Broyden path: whole solves with restarts,
ring wraparound, chunked and split layouts and rejected updates. CPU: the kernels run under
Triton's interpreter in a subprocess (``TRITON_INTERPRET=1`` must be set before Triton is
imported); GPU: the same checks on CUDA, captured in CUDA graphs, in a ``gpu``-marked test."""

from __future__ import annotations

import textwrap

import pytest
import torch
from kernel_checks import run_checks

triton = pytest.importorskip("triton")

#: the checks, run as a script (CPU under the interpreter, or CUDA in-process)
CHECKS = textwrap.dedent(
    r"""
    import json, sys
    import torch
    import deqbench
    import deqbench.solvers.broyden as bm
    from deqbench.solvers import fused
    from deqbench.solvers.base import clear_graph_cache

    dev = sys.argv[1]
    cpu = dev == "cpu"
    if cpu:  # the tracker's own fused kernels are tested elsewhere: keep the interpreter short
        fused.tracker_usable = lambda *a, **k: False
    calls = [0]
    _update = fused.broyden_update

    def counted(*a, **k):
        calls[0] += 1
        _update(*a, **k)

    fused.broyden_update = counted
    PIECE, UNROLL = fused.BROYDEN_PIECE, fused.BROYDEN_UNROLL

    class Cell:
        # z -> tanh(W z + b), ||W||_2 = 0.8; sample 1 of a ``degenerate`` cell is z -> z + b
        # instead (g = b at every point: every update's denominator v.dg is 0, so rejected);
        # records the points it is evaluated at (CPU: no capture)
        def __init__(self, B, D, dt, degenerate):
            g = torch.Generator().manual_seed(D)
            w = torch.randn(D, D, generator=g, dtype=torch.float64)
            self.W = (w * 0.8 / torch.linalg.matrix_norm(w, 2)).to(dev, dt)
            self.b = torch.randn(B, D, generator=g, dtype=torch.float64).to(dev, dt)
            self.deg = (torch.arange(B, device=dev) == 1) if degenerate else None
            self.seen = []

        def __call__(self, z):
            if cpu:
                self.seen.append(z.clone())
            fz = torch.tanh(z @ self.W.T + self.b)
            if self.deg is not None:
                fz = torch.where(self.deg[:, None], z + self.b, fz)
            return fz

    def solve(cell, graph, on, **kw):
        fused.ENABLED = on
        clear_graph_cache()
        cell.seen = []
        n0 = calls[0]
        z, s = deqbench.solvers.get("broyden")(
            cell, torch.zeros_like(cell.b), cuda_graph=graph, **kw)
        want = graph and on and not kw.get("line_search")  # a line search: the torch code
        assert (calls[0] > n0) == want, ("fused path taken", graph, on, kw)
        pts = torch.stack(cell.seen) if cpu else None
        return z, s, pts

    def close(a, b, r, what):
        # relative to the largest entry: traces fall by orders of magnitude
        err = float((a - b).abs().max())
        assert err <= r * float(b.abs().max()) + 1e-30, (what, err)

    def same(x, y, r, what):
        (z0, s0, p0), (z1, s1, p1) = x, y
        assert (s0.nstep, s0.status) == (s1.nstep, s1.status), (what, s0.nstep, s1.nstep)
        for k in ("pairs", "restarts"):
            assert s0.extra[k] == s1.extra[k], (what, k, s0.extra[k], s1.extra[k])
        assert torch.equal(s0.extra["skipped_updates"], s1.extra["skipped_updates"]), what
        close(z1, z0, r, what + " z")
        close(s1.abs_trace, s0.abs_trace, r, what + " abs_trace")
        close(s1.rel_trace, s0.rel_trace, r, what + " rel_trace")
        if p0 is not None:
            assert p0.shape == p1.shape, what
            close(p1, p0, r, what + " points")

    # (dtype, B, D, nc, piece, unroll, on_full, degenerate, memory, max_iter); the solves stop
    # before the residual reaches rounding level (where the skip decisions would be noise and a
    # residual could round to 0): float32 after 8 steps (rel ~1e-5; 12 reached 4e-8, below
    # float32's eps), float64 after 14 (~1e-9) or 24 (~6e-14); checked by ``floor`` below
    cases = [
        (torch.float64, 3, 12, 1, PIECE, UNROLL, "restart", False, 3, 14),
        (torch.float64, 3, 12, 1, PIECE, UNROLL, "ring", True, 3, 14),
        (torch.float64, 3, 12, 3, PIECE, UNROLL, "restart", True, 3, 14),
        (torch.float64, 3, 12, 3, PIECE, UNROLL, "ring", False, 3, 14),
        (torch.float64, 3, 12, 1, 5, 1, "restart", False, 3, 14),  # 3 pieces, rolled loops
        (torch.float64, 3, 12, 2, 4, 2, "ring", True, 3, 14),  # 2 chunks of 2 pieces
        (torch.float32, 3, 12, 1, PIECE, UNROLL, "restart", True, 3, 8),
        (torch.float32, 3, 12, 3, PIECE, UNROLL, "ring", False, 3, 8),
        (torch.float32, 3, 12, 2, 4, 2, "restart", False, 3, 8),
    ]
    if not cpu:  # the real sizes: 2 pieces of 2500; 20 pairs (42 rows, unrolled by 3); 4 chunks
        cases += [
            (torch.float64, 8, 5000, 1, PIECE, 3, "restart", True, 20, 24),
            (torch.float32, 8, 5000, 1, PIECE, UNROLL, "ring", False, 4, 8),
            (torch.float32, 8, 4096, 4, PIECE, UNROLL, "restart", True, 4, 8),
        ]
    out = {}
    for dt, B, D, nc, piece, unroll, on_full, degenerate, memory, n in cases:
        bm.chunking = lambda bsz, dim, device, nc=nc: (nc, dim // nc)
        fused.BROYDEN_PIECE, fused.BROYDEN_UNROLL = piece, unroll
        cell = Cell(B, D, dt, degenerate)
        # tol 0: convergence needs a residual strictly below tol, so max_iter is certain (1e-30
        # was met by a residual that rounds to exactly 0)
        kw = dict(max_iter=n, tol=0.0, memory=memory, on_full=on_full)
        r = 1e-5 if dt == torch.float32 else 1e-10
        name = f"{dt}/{B}x{D}/nc{nc}/p{piece}/{on_full}/deg{int(degenerate)}"
        torch_ = solve(cell, True, False, **kw)
        fused_ = solve(cell, True, True, **kw)
        same(torch_, fused_, r, name + " fused vs torch")
        s = fused_[1]
        assert s.nstep == n and s.status == "max_iter", (name, s.status)
        # the premise of comparing skip decisions: every sample that can converge is still
        # far above rounding level (the degenerate sample's g = b never shrinks)
        res = s.rel_trace[:, [i for i in range(B) if not (degenerate and i == 1)]]
        floor = 64 * torch.finfo(dt).eps
        assert float(res.min()) > floor, (name, "rounding level reached", float(res.min()))
        assert (s.extra["restarts"] > 0) == (on_full == "restart"), name  # or a ring wrapped
        skipped = s.extra["skipped_updates"].tolist()  # n - 2 updates, all rejected in sample 1
        assert (skipped[1] == n - 2) == degenerate and sum(skipped) == (n - 2) * degenerate
        if dt == torch.float64:  # the eager path's iterates up to rounding
            same(solve(cell, False, False, **kw), fused_, 1e-9, name + " fused vs eager")
        out[name] = [s.extra["restarts"], *skipped]
    solve(Cell(3, 12, torch.float64, False), True, True, max_iter=6, tol=1e-30, line_search=True)
    print(json.dumps(out))
    """
)


@pytest.mark.slow  # Triton interpreter: about 20 s on 2 cores
def test_fused_broyden_matches_torch_and_eager_on_cpu_interpreter():
    out = run_checks(CHECKS, "cpu")
    assert len(out) == 9


def test_fused_broyden_is_off_without_interpreter_and_for_other_dtypes():
    from deqbench.solvers import fused

    A = torch.zeros(2, 1, 4, 8)
    assert fused.INTERPRET or not fused.usable(A)
    assert not fused.usable(A.to(torch.float16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_broyden_matches_torch_and_eager_on_cuda():
    out = run_checks(CHECKS, "cuda")
    assert len(out) == 12
