"""Limited-memory Broyden's first ("good") method on g(x) = f(x) - x.

The inverse Jacobian of g is approximated per sample as B = -I + sum_j u_j v_j^T (B_0 = -I, so
the first step is a plain fixed-point step). A step with q = B g and p = -q is
x+ = x + s p (s = 1, or Armijo backtracking on ||g||^2 when ``line_search`` is on); with
dx = x+ - x and dg = g(x+) - g(x) the Sherman-Morrison form of Broyden's first update is

    v = B^T dx,   u = (dx - B dg) / (v^T dg),   B+ = B + u v^T.

Implementation notes (derived from these equations):

* All pair products a step needs come from one batched matrix product of the buffer
  A = [g+, dx, u_0, v_0, u_1, v_1, ...] with [g+, dx]: u_j.g+, v_j.g+, u_j.dx, v_j.dx,
  g+.dx and dx.dx; a second product with a (2 x 2n+2) coefficient matrix gives
  B g+ = -g+ + sum_j (v_j.g+) u_j and v = -dx + sum_j (u_j.dx) v_j, written straight into the
  new pair's rows. So each step reads the memory twice, whatever its size (on CUDA over chunks
  of each sample's vector, see :func:`~deqbench.solvers.base.chunking`).
* With q the previous B g (dx = -s q): B dg = B g+ - q, e := v.g+ = dx.B g+ and
  v.dg = e + dx.dx / s. For s = 1 this gives u = -B g+ / (v.dg) and the next
  q+ = B+ g+ = B g+ (dx.dx) / (v.dg): a per-sample scale of B g+, no extra state pass.
* A pair whose denominator v.dg is non-finite or lost in rounding (below sqrt(eps) times
  |e| + dx.dx) is stored as u = 0: it then contributes nothing, and the step uses B g+. The pairs live in a buffer of at most ``memory`` pairs, allocated on the first
  update. When it is full the default is to restart from B = -I, with this step's own Broyden
  update of -I as the first new pair (the step came from the old matrix, so that update is
  formed from g before and after the step, not from the shortcuts above): overwriting the oldest pair
  (``on_full="ring"``) leaves later pairs built on a matrix that no longer exists, and that
  diverged on a 32-dim linear problem (memory 20) and on the conv cell (memory 5), where the
  restart converged.

It stops on tol, divergence (non-finite or blown-up residual) or stagnation (more than 30 steps,
lowest residual below 3 tol and max/min of the last 30 residuals below 1.3), and returns x (not
f(x)), the lowest-residual iterate per sample by default.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..registry import solvers
from .base import (
    COMMON_OPTIONS,
    CommonOptions,
    SolverStats,
    Tracker,
    batch_norm,
    check_budget,
    check_options,
    check_output,
    chunking,
    flat,
    option_error,
    positive_int,
)

OPTIONS = COMMON_OPTIONS | {
    "memory",
    "on_full",
    "line_search",
    "ls_max_trials",
    "ls_c1",
    "stagnation",
}


def _dot(a: Tensor, b: Tensor) -> Tensor:
    """Per-sample dot products of chunked vectors: (B, nc, cd) x (B, nc, cd) -> (B,)."""
    return torch.linalg.vecdot(a, b).sum(1)


@solvers.register("broyden")
@torch.no_grad()
def broyden(
    f: Callable[[Tensor], Tensor],
    z0: Tensor,
    *,
    max_iter: int = 50,
    tol: float = 1e-4,
    stop_mode: str = "rel",
    **options,
) -> tuple[Tensor, SolverStats]:
    """Limited-memory Broyden (first method) root finding on g(x) = f(x) - x.

    Args:
        f: batched map (B, ...) -> (B, ...).
        z0: initial iterate.
        max_iter: maximum number of f-evaluations (line-search trials included).
        tol: stop when the batch max residual (``stop_mode``) of the returned iterates is below
            ``tol``.
        stop_mode: "rel" or "abs".
        memory: number of rank-one pairs kept (default 20).
        on_full: what happens when ``memory`` pairs are stored: "restart" (default) drops
            them all (B = -I again); "ring" overwrites the oldest pair (TorchDEQ's
            ``LBFGS_thres``), which is cheaper per restart but not a Broyden matrix any more and
            can diverge on long solves.
        line_search: Armijo backtracking on ||g||^2 (default False). Each trial is one
            f-evaluation, and deciding whether to backtrack reads one flag on the host.
        ls_max_trials: trials per step, step size halved each time (default 4).
        ls_c1: Armijo constant: accept when ||g(x + s p)||^2 <= (1 - c1 s) ||g(x)||^2
            (default 1e-4).
        stagnation: stop as stagnated, see the module docstring (default True).
        returns, check_every, protect_thres: as for ``fixed_point``.

    Returns:
        (z, SolverStats); ``extra["skipped_updates"]`` counts per-sample rejected updates.

    Example:
        >>> import torch
        >>> A = torch.tensor([[0.5, 0.3], [0.0, 0.4]], dtype=torch.float64)
        >>> z, st = broyden(lambda z: z @ A.T + 1, torch.zeros(1, 2, dtype=torch.float64),
        ...                 max_iter=20, tol=1e-10)
        >>> st.status
        'converged'
    """
    check_options("broyden", options, OPTIONS)
    check_budget("broyden", max_iter, tol, stop_mode)
    common = CommonOptions.parse("broyden", options)
    memory = positive_int("broyden", "memory", options.get("memory", 20))
    line_search = bool(options.get("line_search", False))
    ls_trials = positive_int("broyden", "ls_max_trials", options.get("ls_max_trials", 4))
    c1 = float(options.get("ls_c1", 1e-4))
    if not 0 <= c1 < 1:
        raise option_error("broyden", f"ls_c1 must be in [0, 1), got {c1}")
    on_full = options.get("on_full", "restart")
    if on_full not in ("restart", "ring"):
        raise option_error("broyden", f"on_full must be 'restart' or 'ring', got {on_full!r}")
    stagnation = (30, 1.3, 3.0) if options.get("stagnation", True) else None

    tracker = Tracker(
        "broyden",
        z0,
        max_iter=max_iter,
        tol=tol,
        stop_mode=stop_mode,
        common=common,
        stagnation=stagnation,
    )
    shape = z0.shape
    bsz = int(shape[0])
    dev, dt = z0.device, z0.dtype
    dim = flat(z0).shape[1]
    nc, cd = chunking(bsz, dim, dev)  # each sample's vector as nc chunks of length cd
    cap = max(1, min(memory, max_iter - 2))  # pairs ever stored

    def rows(buf: Tensor, a: int, b: int) -> Tensor:
        """Rows a:b of every sample as a (B * nc, b - a, cd) view (no copy)."""
        return buf[:, :, a:b].reshape(bsz * nc, b - a, cd)

    # A = [g, dx, u_0, v_0, u_1, v_1, ...] per sample (B, nc, 2 + 2 cap, cd): the two work rows
    # sit in front of the pairs so that every product reads one contiguous slice. It is
    # allocated at the first update; until then the work rows live in T.
    A: Tensor | None = None
    W = torch.empty(bsz, nc, 2, cd, dtype=dt, device=dev)  # the work rows [g, dx]
    C: Tensor | None = None
    skipped = torch.zeros(bsz, dtype=torch.int64, device=dev)
    restarts = 0
    # skip updates whose denominator is lost in rounding (cancellation of dx.B g+ and dx.q)
    tiny = torch.finfo(dt).eps ** 0.5

    x = z0.reshape(bsz, nc, cd)
    fx = f(z0)
    check_output("broyden", z0, fx)
    nstep = 1
    torch.sub(fx.reshape(bsz, nc, cd), x, out=W[:, :, 0])
    tracker.record(z0, fx, W[:, :, 0])
    npairs = 0
    q = None if not line_search else -W[:, :, 0]  # q = B g (line search only; else dx = -q)
    W[:, :, 1].copy_(W[:, :, 0])  # dx = -B_0 g = g: the first step is a fixed-point step
    gnorm2 = None
    s = None
    done = tracker.stop() or nstep >= max_iter
    g_prev: Tensor | None = None
    while not done:
        restart = A is not None and npairs >= cap and on_full == "restart"
        if restart:  # the update after this step starts from B = -I: it needs g itself
            g_prev = W[:, :, 0].clone()
        # -- step x+ = x + dx, dx = -s q ---------------------------------------------------
        if not line_search:
            xn = x + W[:, :, 1]
            fxn = f(xn.view(shape))
            nstep += 1
            torch.sub(fxn.reshape(bsz, nc, cd), xn, out=W[:, :, 0])
        else:
            assert q is not None
            if gnorm2 is None:
                gnorm2 = batch_norm(W[:, :, 0]) ** 2
            s = torch.ones(bsz, 1, 1, dtype=dt, device=dev)
            trials = 0
            while True:
                xn = torch.addcmul(x, s, q, value=-1.0)
                fxn = f(xn.view(shape))
                nstep += 1
                trials += 1
                gtry = fxn.reshape(bsz, nc, cd) - xn
                gn2 = batch_norm(gtry) ** 2
                ok = gn2 <= (1 - c1 * s.view(bsz)) * gnorm2
                if trials >= ls_trials or nstep >= max_iter or bool(ok.all()):
                    break
                s = torch.where(ok.view(bsz, 1, 1), s, 0.5 * s)
            gnorm2 = gn2
            W[:, :, 0].copy_(gtry)
            torch.mul(q, -s, out=W[:, :, 1])
        tracker.record(xn.view(shape), fxn, W[:, :, 0])
        if tracker.stop() or nstep >= max_iter:
            break
        # -- Broyden update ----------------------------------------------------------------
        if A is None:
            A = torch.empty(bsz, nc, 2 + 2 * cap, cd, dtype=dt, device=dev)
            A[:, :, :2].copy_(W)
            W = A[:, :, :2]
            C = torch.zeros(bsz, 2, 2 + 2 * cap, dtype=dt, device=dev)
            C[:, 0, 0] = -1.0
            C[:, 1, 1] = -1.0
        assert C is not None
        if restart:
            # B = -I again, and its first update from this step. The step came from the old B,
            # so the shortcuts below (B dg = B g+ - q) do not hold: with B = -I,
            # v = -dx, B dg = -dg, u = (dx + dg) / (v . dg), and q+ = -g+ + u (v . g+).
            assert g_prev is not None
            restarts += 1
            gp, dxv = W[:, :, 0], W[:, :, 1]
            dg = gp - g_prev
            den = -_dot(dxv, dg)  # v . dg
            dxg = _dot(dxv, gp)  # dx . g+ (= -v . g+)
            inv = 1.0 / den
            ok = torch.isfinite(inv) & (den.abs() > tiny * (dxg.abs() + _dot(dxv, g_prev).abs()))
            skipped += ~ok
            inv = torch.where(ok, inv, 0.0).view(bsz, 1, 1)
            u, v = A[:, :, 2], A[:, :, 3]
            torch.neg(dxv, out=v)
            torch.add(dxv, dg, out=u).mul_(inv)
            # q+ = -g+ - u (dx . g+); the next step is dx+ = -q+ (line search: -s q+)
            if not line_search:
                torch.addcmul(gp, u, dxg.view(bsz, 1, 1), out=W[:, :, 1])
            else:
                q = torch.addcmul(-gp, u, dxg.view(bsz, 1, 1), value=-1.0)
            npairs = 1
            x = xn
            continue
        used = 2 + 2 * min(npairs, cap)
        An = rows(A, 0, used)
        P = torch.bmm(An, rows(A, 0, 2).transpose(1, 2))  # products with g+ and dx
        P = P.view(bsz, nc, used, 2).sum(1) if nc > 1 else P.view(bsz, used, 2)
        Cn = C[:, :, :used]
        if npairs:
            Cn[:, 0, 2::2] = P[:, 3::2, 0]  # v_j . g+
            Cn[:, 1, 3::2] = P[:, 2::2, 1]  # u_j . dx
        Cr = Cn.unsqueeze(1).expand(bsz, nc, 2, used).reshape(bsz * nc, 2, used)
        slot = npairs % cap
        # [B g+, v] straight into the new pair's rows (a ring overwrites a row it reads)
        if 2 + 2 * slot >= used:
            torch.bmm(Cr, An, out=rows(A, 2 + 2 * slot, 4 + 2 * slot))
        else:
            rows(A, 2 + 2 * slot, 4 + 2 * slot).copy_(torch.bmm(Cr, An))
        Bg = A[:, :, 2 + 2 * slot]  # becomes u below; v is in place already
        e = torch.linalg.vecdot(Cn[:, 0], P[:, :, 1])  # dx . B g+  (= v . g+)
        dd = P[:, 1, 1]  # dx . dx
        den = e + dd if s is None else e + dd / s.view(bsz)
        inv = 1.0 / den
        ok = torch.isfinite(inv) & (den.abs() > tiny * (e.abs() + dd))
        skipped += ~ok
        inv = torch.where(ok, inv, 0.0)
        if s is None:
            # next dx = -q+ = -B g+ (dx.dx) / den (-B g+ if the update is skipped);
            # u = -B g+ / den
            dxs = torch.where(ok, -dd * inv, -1.0).view(bsz, 1, 1)
            torch.mul(Bg, dxs, out=W[:, :, 1])
            Bg.mul_(-inv.view(bsz, 1, 1))
        else:
            # u = (dx (1 - 1/s) - B g+) / den ;  q+ = B g+ + u (v . g+)
            bg = Bg.clone()
            torch.mul(W[:, :, 1], 1.0 - 1.0 / s, out=Bg)
            Bg.sub_(bg).mul_(inv.view(bsz, 1, 1))
            q = torch.addcmul(bg, Bg, e.view(bsz, 1, 1))
        npairs += 1
        x = xn
    return tracker.finish(
        nstep,
        {
            "memory": memory,
            "pairs": min(npairs, cap),
            "restarts": restarts,
            "skipped_updates": skipped,
        },
    )
