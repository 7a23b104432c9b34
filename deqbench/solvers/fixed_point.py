"""Plain (optionally damped) fixed-point iteration z <- tau f(z) + (1 - tau) z.

Per step: one f-evaluation, the difference f(z) - z, two per-sample norms and the shared
:class:`~deqbench.solvers.base.Tracker` bookkeeping (a few (B,)-sized kernels, no host sync).
With ``tau == 1`` the next iterate is f's output itself (no mixing, no copy); with damping the
difference is reused for the update. ``cuda_graph`` replays one captured step instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from pydantic import Field
from torch import Tensor

from ..core.registry import solvers
from .base import (
    GraphOptions,
    SolverStats,
    Tracker,
    check_output,
    graph_loop,
    graph_mode,
    graph_state,
    graph_steps,
    solver,
    steps_label,
)


class FixedPointOptions(GraphOptions):
    tau: float = Field(1.0, gt=0, le=1, description="damping: z <- tau f(z) + (1 - tau) z.")


@solvers.register("fixed_point")
@solver(FixedPointOptions, cuda_graph=True)
def fixed_point(
    f: Callable[[Tensor], Tensor],
    z0: Tensor,
    opts: FixedPointOptions,
    *,
    max_iter: int = 50,
    tol: float = 1e-4,
    stop_mode: str = "rel",
) -> tuple[Tensor, SolverStats]:
    """Fixed-point iteration with optional damping ``tau`` (default 1: no mixing).

    ``cuda_graph``: one captured step (f and the bookkeeping on static buffers) replayed; f is
    called in the eager step and once during capture (which evaluates nothing), not per
    replay, and ``nstep`` counts evaluations. A DEQ layer turns "cache" on by itself on CUDA
    (``Runtime.cuda_graph``). Options: :class:`FixedPointOptions`.

    Example:
        >>> z, st = fixed_point(lambda z: 0.5 * z + 1, torch.zeros(2, 3), max_iter=100, tol=1e-8)
        >>> st.status, round(float(z.max()), 6)
        ('converged', 2.0)
    """
    tau = opts.tau
    gmode = graph_mode(opts)
    tracker = Tracker(
        "fixed_point", z0, max_iter=max_iter, tol=tol, stop_mode=stop_mode, common=opts,
        static=gmode is not None,
    )  # fmt: skip
    if gmode is not None:
        steps = graph_steps(opts, z0)
        key = ("fixed_point", f, tuple(z0.shape), z0.dtype, z0.device, max_iter, tau,
               opts.returns, stop_mode, opts.stop, steps)  # fmt: skip
        graph, state = graph_state(gmode, key)
        state["bufs"] = tracker.enable_device_mode(z0, state.get("bufs"))
        if "zs" not in state:
            state["zs"] = torch.empty_like(z0, memory_format=torch.contiguous_format)
        zs = state["zs"]  # the static iterate
        zs.copy_(z0)

        def body() -> None:
            fz = f(zs)
            if tau == 1.0:
                tracker.device_record(zs, fz, None, copy_to=zs)
            else:
                d = fz - zs
                tracker.device_record(zs, fz, d)
                zs.add_(d, alpha=tau)

        nstep = graph_loop(
            "fixed_point",
            tracker,
            body,
            max_iter,
            mode=gmode,
            key=key,
            graph=graph,
            state=state,
            steps=steps,
        )
        return tracker.finish(
            nstep, {"tau": tau, "cuda_graph": gmode, "graph_steps": steps_label(steps)}
        )

    z = z0
    nstep = 0
    while True:
        fz = f(z)
        nstep += 1
        if nstep == 1:
            check_output("fixed_point", z, fz)
        if tau == 1.0:
            tracker.record(z, fz, None)
            if tracker.stop() or nstep >= max_iter:
                break
            z = fz  # f's output itself: no mixing, no copy
        else:
            d = fz - z
            tracker.record(z, fz, d)
            if tracker.stop() or nstep >= max_iter:
                break
            z = torch.add(z, d, alpha=tau)  # a fresh tensor: the tracker holds earlier iterates
    return tracker.finish(nstep, {"tau": tau})
