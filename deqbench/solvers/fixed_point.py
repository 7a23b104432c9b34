"""Plain (optionally damped) fixed-point iteration z <- tau f(z) + (1 - tau) z.

Per step: one f-evaluation, the difference f(z) - z, two per-sample norms and the shared
:class:`~deqbench.solvers.base.Tracker` bookkeeping (a few (B,)-sized kernels, no host sync).
With ``tau == 1`` the next iterate is f's output itself (no mixing, no copy); with damping the
difference is reused for the update. ``cuda_graph`` replays one captured step instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..core.registry import solvers
from .base import (
    COMMON_OPTIONS,
    CommonOptions,
    SolverStats,
    Tracker,
    check_budget,
    check_options,
    check_output,
    graph_loop,
    graph_mode,
    graph_state,
    graph_steps,
    option_error,
)

OPTIONS = COMMON_OPTIONS | {"tau", "cuda_graph", "graph_steps"}


@solvers.register("fixed_point")
@torch.no_grad()
def fixed_point(
    f: Callable[[Tensor], Tensor],
    z0: Tensor,
    *,
    max_iter: int = 50,
    tol: float = 1e-4,
    stop_mode: str = "rel",
    **options,
) -> tuple[Tensor, SolverStats]:
    """Fixed-point iteration with optional damping ``tau`` (default 1: no mixing).

    Args:
        f: batched map (B, ...) -> (B, ...).
        z0: initial iterate.
        max_iter: maximum number of f-evaluations.
        tol: stop when the batch max residual (``stop_mode``) of the returned iterates is below
            ``tol``.
        stop_mode: "rel" or "abs".
        tau: damping in (0, 1].
        returns: "lowest" (default) returns, per sample, the iterate x with the lowest measured
            residual; "last" the last measured iterate. The reported residual is that of x.
        check_every: read the convergence test on the host exactly every k f-evaluations
            (default None: every step on CPU; on CUDA one step late without stalling the GPU,
            exactly near convergence).
        protect_thres: stop as diverged when the batch max abs residual exceeds this factor
            times the first one (default 1e6); non-finite residuals always stop as diverged.
        cuda_graph: False (default); True captures one step (f and the bookkeeping, on static
            buffers) in a CUDA graph after one eager step and replays it; "cache" also keeps the
            graph for later solves with the same f object, shapes and options, replaying it from
            the first step. For cheap, launch-bound cells, where one step otherwise costs a
            launch per kernel. f must be capturable (no host syncs, fixed shapes) and, for
            "cache", read the same tensors at the same addresses every call (copy new inputs
            into them). f is called in the eager step and once during capture (which evaluates
            nothing), not per replay; ``nstep`` counts evaluations. On CPU the static step runs
            eagerly. A DEQ layer turns "cache" on by itself on CUDA (``Runtime.cuda_graph``).
        graph_steps: steps per captured graph (default "auto": 2 for states of at most 2M
            elements, else 1): the host reads the residuals once per replay, so up to
            graph_steps - 1 steps past convergence may be made (``extra["nstep_to_tol"]``).

    Returns:
        (z, SolverStats)

    Example:
        >>> z, st = fixed_point(lambda z: 0.5 * z + 1, torch.zeros(2, 3), max_iter=100, tol=1e-8)
        >>> st.status, round(float(z.max()), 6)
        ('converged', 2.0)
    """
    check_options("fixed_point", options, OPTIONS)
    check_budget("fixed_point", max_iter, tol, stop_mode)
    common = CommonOptions.parse("fixed_point", options)
    tau = float(options.get("tau", 1.0))
    if not 0 < tau <= 1:
        raise option_error("fixed_point", f"tau must be in (0, 1], got {tau}")

    gmode = graph_mode("fixed_point", options)
    tracker = Tracker(
        "fixed_point", z0, max_iter=max_iter, tol=tol, stop_mode=stop_mode, common=common,
        static=gmode is not None,
    )  # fmt: skip
    if gmode is not None:
        steps = graph_steps("fixed_point", options, z0)
        key = ("fixed_point", f, tuple(z0.shape), z0.dtype, z0.device, max_iter, tau,
               common.returns, stop_mode, steps)  # fmt: skip
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
        return tracker.finish(nstep, {"tau": tau, "cuda_graph": gmode, "graph_steps": steps})

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


fixed_point.supports_cuda_graph = True  # type: ignore[attr-defined]
