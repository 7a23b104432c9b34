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

``cuda_graph`` runs the same method on static buffers (:func:`_static_steps`): the pair count,
ring slot and restart flag live on the device, every step reads the pairs that can be in use by
then (in buckets of 4 pairs or memory / 8, of one pair on states above 2M elements; one
captured graph per bucket) with zero coefficients on those not in use, and the restart update is folded into the ordinary one (B dg = B g+ - r with r = B g
the previous direction, or -g on a restart), so a few captured steps serve the whole solve and
make the eager path's iterates up to rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, cast

import torch
from pydantic import Field, model_validator
from torch import Tensor

from ..core.registry import solvers
from . import fused
from .base import (
    AUTO_NUMEL,
    LARGE_NUMEL,
    GraphOptions,
    SolverStats,
    Tracker,
    batch_norm,
    check_output,
    chunking,
    flat,
    graph_loop,
    graph_mode,
    graph_state,
    graph_steps,
    solver,
    steps_label,
)


class BroydenOptions(GraphOptions):
    memory: int = Field(20, gt=0, description="number of rank-one pairs kept.")
    on_full: Literal["restart", "ring"] = Field(
        "restart",
        description="when memory pairs are stored: 'restart' drops them all (B = -I again); "
        "'ring' overwrites the oldest pair (TorchDEQ's LBFGS_thres), cheaper per restart but "
        "not a Broyden matrix any more, and can diverge on long solves.",
    )
    line_search: bool = Field(
        False,
        description="Armijo backtracking on ||g||^2; each trial is one f-evaluation, and "
        "deciding whether to backtrack reads one flag on the host (on the device with "
        "cuda_graph).",
    )
    ls_max_trials: int = Field(4, gt=0, description="trials per step, step size halved each time.")
    ls_c1: float = Field(
        1e-4,
        ge=0,
        lt=1,
        description="Armijo constant: accept when ||g(x + s p)||^2 <= (1 - c1 s) ||g(x)||^2.",
    )
    stagnation: bool = Field(
        True,
        description="stop as stagnated (more than 30 steps, lowest residual below 3 tol, "
        "max/min of the last 30 residuals below 1.3).",
    )
    keep_inverse: bool = Field(
        False,
        description="hand out the final inverse-Jacobian estimate B = -I + sum_j u_j v_j^T "
        "(SHINE's backward): extra['inverse'] = the pairs' rows of the buffer, (B, nc, 2 m, cd) "
        "as [u_0, v_0, u_1, v_1, ...] per sample (None before the first update). Eager path "
        "only (not with cuda_graph).",
    )

    @model_validator(mode="after")
    def _eager_inverse(self) -> BroydenOptions:
        if self.keep_inverse and self.cuda_graph:
            raise ValueError("keep_inverse needs the eager path: set cuda_graph to false")
        return self


#: pairs per captured-graph bucket for states above AUTO_NUMEL (see ``_static_steps``)
LARGE_GRAIN = 1


def pairs_in_use(n: int, cap: int, restart: bool, line_search: bool) -> int:
    """Pairs the update after n evaluations reads (``_static_steps``): without a line search
    the pair count follows the step count (an update is made from the second evaluation on,
    and the restart rule's restart at ``cap`` pairs leaves one; a ring stays full); with a line
    search a rejected trial makes none, so only the bound n - 2."""
    if line_search or n < 2 + cap:
        return max(0, n - 2)
    if not restart:  # a full ring
        return cap
    # restart rule, after the first restart (update n = cap + 2 reads none): a cycle of cap
    # updates reading 1, 2, ..., cap - 1 pairs, then a restart (none)
    j = (n - cap - 3) % cap + 1
    return 0 if j >= cap else j


def _dot(a: Tensor, b: Tensor) -> Tensor:
    """Per-sample dot products of chunked vectors: (B, nc, cd) x (B, nc, cd) -> (B,)."""
    return torch.linalg.vecdot(a, b).sum(1)


@solvers.register("broyden")
# One piece (over 120 lines): the eager loop is the reference the captured path
# (_static_steps) must match up to rounding; its state (the pair buffer A with the work rows W
# as a view into it from the first update, C, q, s, gnorm2, npairs, the restart flag) is
# rebound and aliased step to step, and splitting it would pass all of it through every helper.
# captured up to LARGE_NUMEL elements: on conv64 (8.4M) the captured step (two fused kernels
# reading only the pairs in use) beats the eager one, overhead 1.85 vs 2.26 on an H200
@solver(BroydenOptions, cuda_graph=True, graph_numel=LARGE_NUMEL)
def broyden(
    f: Callable[[Tensor], Tensor],
    z0: Tensor,
    opts: BroydenOptions,
    *,
    max_iter: int = 50,
    tol: float = 1e-4,
    stop_mode: str = "rel",
) -> tuple[Tensor, SolverStats]:
    """Limited-memory Broyden (first method) root finding on g(x) = f(x) - x.

    ``max_iter`` counts line-search trials too (each one f-evaluation). With ``cuda_graph`` a
    step works on the pairs that can be in use by then (those not in use get zero
    coefficients; one captured graph per bucket of pairs) and the restart or ring rule is
    applied on the device, so a few captured steps serve the whole solve, with the eager path's
    iterates up to rounding. With ``line_search`` each trial is one step and the backtracking
    decision is made on the device; a rejected trial is recorded as the accepted point again,
    so the traces have one row per f-evaluation (the eager path's one per accepted point) while
    the stop decisions and the returned iterate are the eager path's (the stagnation window
    counts rows, repeats included). Options: :class:`BroydenOptions`.

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
    memory, line_search, on_full = opts.memory, opts.line_search, opts.on_full
    ls_trials, c1 = opts.ls_max_trials, opts.ls_c1
    stagnation = (30, 1.3, 3.0) if opts.stagnation else None
    gmode = graph_mode(opts)
    steps = graph_steps(opts, z0)

    tracker = Tracker(
        "broyden",
        z0,
        max_iter=max_iter,
        tol=tol,
        stop_mode=stop_mode,
        common=opts,
        stagnation=stagnation,
        static=gmode is not None,
    )
    shape = z0.shape
    bsz = int(shape[0])
    dev, dt = z0.device, z0.dtype
    dim = flat(z0).shape[1]
    nc, cd = chunking(bsz, dim, dev)  # each sample's vector as nc chunks of length cd
    cap = max(1, min(memory, max_iter - 2))  # pairs ever stored
    if gmode is not None:
        nstep, counts, skipped = _static_steps(
            f, z0, tracker, gmode, opts.returns, stop_mode, cap, nc, cd, on_full,
            line_search, ls_trials, c1, max_iter, steps,
        )  # fmt: skip
        info: dict[str, Any] = {"memory": memory}
        info |= {"skipped_updates": skipped, "cuda_graph": gmode, "graph_steps": steps_label(steps)}
        z, stats = tracker.finish(nstep, info)
        npairs, restarts = counts()  # after finish's wait: no sync of its own in practice
        stats.extra |= {"pairs": min(npairs, cap), "restarts": restarts}
        return z, stats

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
    info = {
        "memory": memory,
        "pairs": min(npairs, cap),
        "restarts": restarts,
        "skipped_updates": skipped,
    }
    if opts.keep_inverse:  # the pairs in use (a skipped update's u is 0: it adds nothing)
        info["inverse"] = None if A is None else A[:, :, 2 : 2 + 2 * min(npairs, cap)]
    return tracker.finish(nstep, info)


# One piece (over 120 lines): ``body`` is the region captured in a CUDA graph and replayed
# (graph_loop), and the setup before it binds the static buffers (views into ``st``) that the
# captured kernels read and write; they must be the same tensors at capture and at every replay,
# so the buffers, their views and the step are kept in one scope. GPU-only paths: not exercised
# on a CPU test machine.
def _static_steps(
    f: Callable[[Tensor], Tensor],
    z0: Tensor,
    tracker: Tracker,
    gmode: str,
    returns: str,
    stop_mode: str,
    cap: int,
    nc: int,
    cd: int,
    on_full: str,
    line_search: bool,
    ls_trials: int,
    c1: float,
    max_iter: int,
    steps: int,
) -> tuple[int, Callable[[], tuple[int, int]], Tensor]:
    """Broyden on static buffers, one f-evaluation per step, so that a step can be captured in
    a CUDA graph and replayed. Returns (nstep, a function giving (pairs made, restarts),
    skipped_updates).

    A step first makes the update from the previous evaluation (the eager loop's update, moved
    to the next step so that the last evaluation makes none), then evaluates f at the new
    point. The step counter, pair count (hence the restart flag and the ring slot) and, with a
    line search, the step sizes, trial count, accepted point and the decision whether to accept
    the last trial (made right after its evaluation, which is recorded as the accepted point
    again when rejected) live on the device. A step forms the products with every pair that
    can be in use by then (the update after n evaluations reads at most n - 2 pairs), rounded
    up to a multiple of 4 or memory / 8 (one captured graph per bucket, so a 10-step solve with
    memory 20 reads 4-8 pairs a step instead of 20); states above AUTO_NUMEL, which are
    bandwidth-bound, take buckets of one pair (``LARGE_GRAIN``); pairs not in use (not yet
    written, or dropped by a restart) get zero coefficients.
    With r = B g(x) (q, or -dx / s) and r = -g(x) on a restart (B = -I again), B dg = B g+ - r,
    so

        u = (dx - B g+ + r) / den,   den = v.dg = e - dx.r,   q+ = B g+ + u e,   e = dx.B g+,

    which is the eager path's ordinary update (r = -dx / s) and its restart update (B g+ = -g+,
    v = -dx) in one set of kernels, with per-sample coefficients that select the eager path's
    own expressions. Before the first evaluation every buffer is zero and the update is a no-op
    (dx = 0); after it, dx = 0 makes the update degenerate, which leaves q+ = -g_0: the eager
    path's first (fixed-point) step. Neither stores a pair or counts a skip.

    Without a line search, where :func:`~deqbench.solvers.fused.usable` (CUDA with Triton), the
    update and ``gx = g`` are :func:`~deqbench.solvers.fused.broyden_update`: three Triton
    kernels instead of ~60 small torch ones (restart rule; ~45 for the ring), the same
    arithmetic up to sum order; the torch code below is the reference and runs elsewhere.
    """
    shape, dev, dt = z0.shape, z0.device, z0.dtype
    bsz = int(shape[0])
    R = 2 + 2 * cap  # rows of A: [g, dx, u_0, v_0, ...]
    restart = on_full == "restart"
    key = ("broyden", f, tuple(shape), dt, dev, max_iter, cap, on_full, line_search, ls_trials,
           c1, returns, stop_mode, tracker.rule, steps)  # fmt: skip
    graph, st = graph_state(gmode, key)
    st["bufs"] = tracker.enable_device_mode(z0, st.get("bufs"))
    if "xs" not in st:
        st["xs"] = torch.empty_like(z0, memory_format=torch.contiguous_format)
        st["A"] = torch.empty(bsz, nc, R, cd, dtype=dt, device=dev)
        C = st["C"] = torch.zeros(bsz, 2, R, dtype=dt, device=dev)
        C[:, 0, 0] = -1.0  # row 0: B g+ = -g+ + sum_j (v_j.g+) u_j
        C[:, 1, 1] = -1.0  # row 1: v = B^T dx = -dx + sum_j (u_j.dx) v_j
        st["ids"] = torch.arange(cap, device=dev)
        st["cnt"] = torch.empty(4, dtype=torch.long, device=dev)  # evals, pairs, restarts, trials
        st["skipped"] = torch.empty(bsz, dtype=torch.int64, device=dev)
        if restart or line_search:  # g at the point the last step came from (restart update)
            st["gx"] = torch.empty(bsz, nc, cd, dtype=dt, device=dev)
        if line_search:
            st["xa"] = torch.empty(bsz, nc, cd, dtype=dt, device=dev)  # the accepted point
            st["q"] = torch.empty(bsz, nc, cd, dtype=dt, device=dev)  # B g(xa)
            st["s"] = torch.empty(bsz, 1, 1, dtype=dt, device=dev)  # step sizes
            st["gn2"] = torch.empty(2, bsz, dtype=dt, device=dev)  # ||g||^2: accepted, trial
            st["Fa"] = torch.empty_like(z0, memory_format=torch.contiguous_format)  # f(xa)
            st["okb"] = torch.empty(bsz + 1, dtype=torch.bool, device=dev)  # Armijo, accept
    xs, A, C, ids, cnt, skipped = st["xs"], st["A"], st["C"], st["ids"], st["cnt"], st["skipped"]
    xs.copy_(z0)
    # at most ~8 buckets, hence captured graphs; a state above AUTO_NUMEL is bandwidth-bound,
    # and reading pairs not in use costs more there than capturing a graph per pair count
    grain = LARGE_GRAIN if z0.numel() > AUTO_NUMEL else max(4, -(-cap // 8))
    # zero coefficients must meet finite rows (a NaN left by an earlier solve would spread):
    # where each step reads exactly the pairs in use (one pair per bucket and per graph, no line
    # search) every row it reads was written in this solve, except [g, dx] and the first pair
    # (read, unused, before any pair is made); else every row (33.5 MB a row on conv64)
    if grain == 1 and steps == 1 and not line_search:
        A[:, :, :4].zero_()
    else:
        A.zero_()
    cnt.zero_()
    skipped.zero_()
    it, npairs, nrestarts, trials = cnt[0:1], cnt[1:2], cnt[2:3], cnt[3:4]
    # set with restart or line_search, the only paths that read it (None otherwise)
    gx = cast(Tensor, st.get("gx"))
    if gx is not None:
        gx.zero_()
    if line_search:
        xa, q, s, gn2, Fa, okb = st["xa"], st["q"], st["s"], st["gn2"], st["Fa"], st["okb"]
        xa.zero_()
        q.zero_()
        s.fill_(1.0)
        gn2.zero_()
        okb.fill_(True)  # before the first evaluation: "accept" z0 itself
        gn2a, gn2t = gn2[0], gn2[1]
        ok_ls, accb = okb[:bsz], okb[bsz:]
    tiny = torch.finfo(dt).eps ** 0.5
    xv = xs.view(bsz, nc, cd)
    g, dx = A[:, :, 0], A[:, :, 1]
    # the update and gx = g as three Triton kernels (fused.broyden_update) where they can run
    fz = not line_search and fused.usable(A, xs, *(() if gx is None else (gx,)))
    if fz and "fused" not in st:
        st["fused"] = fused.broyden_buffers(A)  # partial products, snapshot, coefficients
    Wn = A[:, :, :2].view(bsz * nc, 2, cd)  # [g+, dx]

    def rows_in_use(n: int) -> int:
        """Pairs the ``steps`` updates of a chunk after n evaluations can use, rounded up to a
        multiple of ``grain`` (one captured graph per bucket): the update after evaluation k
        (k >= 2) reads the pairs made before it, which the last restart emptied."""
        most = max(pairs_in_use(n + i, cap, restart, line_search) for i in range(max(1, steps)))
        return min(cap, max(1, -(-most // grain) * grain))

    views: dict[int, tuple[Tensor, Tensor, Tensor]] = {}

    def view(pb: int) -> tuple[Tensor, Tensor, Tensor]:
        """A's first 2 + 2 pb rows (B * nc, rows, cd), C's columns for them, ids of the pairs."""
        if pb not in views:
            rp = 2 + 2 * pb
            views[pb] = (A[:, :, :rp].reshape(bsz * nc, rp, cd), C[:, :, :rp], ids[:pb])
        return views[pb]

    def update(pb: int) -> None:
        """The Broyden update from the last evaluation (g+ = g, dx: the step to it) and the
        point to evaluate next (without a line search: and gx = g, see ``body``)."""
        if fz:
            fused.broyden_update(A, xv, gx, cnt, skipped, st["fused"], pb, cap, tiny)
            return
        upd = it >= 2  # whether an update is made (counted)
        if line_search:
            acc = accb  # the last trial was accepted (decided after its evaluation)
            upd = upd & acc
            torch.mul(q, -s, out=dx)
        # -- pairs in use, the slot of the new pair -------------------------------------------
        if restart:
            rs = npairs >= cap  # B = -I again, then this step's update of it
            eff = torch.where(rs, 0, npairs)
            slot = eff
        else:
            rs = None
            eff = npairs.clamp(max=cap)
            slot = npairs.remainder(cap)
        An, Cp, idp = view(pb)
        rp = An.shape[1]
        use = idp < eff
        # -- [B g+, v] from two products over A, as the eager path (unused pairs zeroed) ------
        P = torch.bmm(An, Wn.transpose(1, 2))
        P = P.view(bsz, nc, rp, 2).sum(1) if nc > 1 else P.view(bsz, rp, 2)
        Cp[:, 0, 2::2] = torch.where(use, P[:, 3::2, 0], 0.0)  # v_j . g+
        Cp[:, 1, 3::2] = torch.where(use, P[:, 2::2, 1], 0.0)  # u_j . dx
        Cx = Cp if nc == 1 else Cp.unsqueeze(1).expand(bsz, nc, 2, rp).reshape(-1, 2, rp)
        Y = torch.bmm(Cx, An).view(bsz, nc, 2, cd)
        Bg = Y[:, :, 0]
        e = torch.linalg.vecdot(Cp[:, 0], P[:, :, 1])  # dx . B g+ (= v . g+)
        dd = P[:, 1, 1]  # dx . dx
        den = e + dd / s.view(bsz) if line_search else e + dd  # v . dg with r = -dx / s
        ref = dd
        if rs is not None:  # r = -g: v . dg = -dx . dg = e + dx . g
            dxg = _dot(dx, gx)
            den = torch.where(rs, e + dxg, den)
            ref = torch.where(rs, dxg.abs(), dd)
        inv = 1.0 / den
        ok = torch.isfinite(inv) & (den.abs() > tiny * (e.abs() + ref))
        inv = torch.where(ok, inv, 0.0)
        skipped.add_(~ok & upd)
        # u = (dx + r - B g+) / den: -B g+ / den, plus dx (1 - 1/s) / den with a line search,
        # plus (dx - g) / den on a restart
        invb = inv.view(bsz, 1, 1)
        u = Bg * -invb
        if line_search:
            cw = 1.0 - 1.0 / s
            if rs is not None:
                cw = torch.where(rs, 1.0, cw)
            u.addcmul_(dx, cw * invb)
        elif rs is not None:
            u.addcmul_(dx, rs * invb)
        if rs is not None:
            u.addcmul_(gx, rs * invb, value=-1.0)
        if not line_search:
            # next dx = -q+ = -(B g+ + u e): the eager path's -B g+ (dx.dx) / den when updated
            # (-B g+ when skipped); on a restart -B g+ - u e
            a = torch.where(ok, -dd * inv, -1.0)
            if rs is not None:
                a = torch.where(rs, -1.0, a)
            torch.mul(Bg, a.view(bsz, 1, 1), out=dx)
            if rs is not None:
                dx.addcmul_(u, torch.where(rs, -e, 0.0).view(bsz, 1, 1))
            rows = 2 + 2 * slot  # written even when no update is made: then not in use
            A.index_copy_(2, rows, u.unsqueeze(2))
            A.index_copy_(2, rows + 1, Y[:, :, 1:2])
            xv.add_(dx)
        else:
            qn = torch.addcmul(Bg, u, e.view(bsz, 1, 1))
            Bg.copy_(u)  # Y = [u, v]
            rows = torch.cat([2 + 2 * slot, 3 + 2 * slot])
            A.index_copy_(2, rows, torch.where(upd, Y, A.index_select(2, rows)))
            torch.where(acc, qn, q, out=q)
            torch.where(acc, xv, xa, out=xa)
            torch.where(acc, g, gx, out=gx)
            torch.where(acc, gn2t, gn2a, out=gn2a)
            torch.where(ok_ls.view(bsz, 1, 1), s, 0.5 * s, out=s).masked_fill_(acc, 1.0)
            trials.masked_fill_(acc, 0)
            torch.addcmul(xa, s, q, value=-1.0, out=xv)  # the next trial point x - s q
        if rs is not None:
            nrestarts.add_(rs & upd)
            torch.where(upd, torch.where(rs, 1, npairs + 1), npairs, out=npairs)
        else:
            torch.where(upd, npairs + 1, npairs, out=npairs)

    def body(pb: int) -> None:
        update(pb)
        if restart and not line_search and not fz:
            gx.copy_(g)  # g before the step (line search: g at the accepted point, above)
        fx = f(xs)
        check_output("broyden", xs, fx)
        torch.sub(fx.reshape(bsz, nc, cd), xv, out=g)
        if not fz:  # the fused update counted it
            it.add_(1)
        if not line_search:
            tracker.device_record(xs, fx, g)
            return
        # accept the trial as the eager path does: all samples pass Armijo, or the trials or
        # the evaluations are used up; a rejected trial is recorded as the accepted point again
        trials.add_(1)
        batch_norm(g, out=gn2t).square_()
        torch.le(gn2t, (1 - c1 * s.view(bsz)) * gn2a, out=ok_ls)
        acc = (it == 1) | ok_ls.all() | (trials >= ls_trials) | (it >= max_iter)
        accb.copy_(acc)
        torch.where(acc, fx, Fa, out=Fa)
        zr = torch.where(acc, xs, xa.view(shape))
        tracker.device_record(zr, Fa, torch.where(acc, g, gx))

    nstep = graph_loop(
        "broyden", tracker, body, max_iter, mode=gmode, key=key, graph=graph, state=st,
        steps=steps, phase=rows_in_use,
    )  # fmt: skip
    skipped = skipped.clone()
    if not xs.is_cuda:
        pr = cnt[1:3].tolist()
        return nstep, lambda: (pr[0], pr[1]), skipped
    # the counters to pinned memory behind the last step, read after the tracker's final wait
    # (a synchronous read here would stall the host before that wait, for a pageable copy)
    if "cnt_host" not in st:
        st["cnt_host"] = torch.empty(2, dtype=torch.long, pin_memory=True)
    host = st["cnt_host"]
    host.copy_(cnt[1:3], non_blocking=True)
    done = torch.cuda.Event()
    done.record(tracker.stream)

    def counts() -> tuple[int, int]:
        done.synchronize()
        pr = host.tolist()
        return pr[0], pr[1]

    return nstep, counts, skipped
