"""Plain (optionally damped) fixed-point iteration z <- tau f(z) + (1 - tau) z.

Per step: one f-evaluation, the difference f(z) - z (needed for the residual and reused for the
damped update), two norms and the shared :class:`~deqbench.solvers.base.Tracker` bookkeeping.
With ``tau == 1`` the next iterate is f's output itself (no mixing, no copy).
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
    check_budget,
    check_options,
    option_error,
)

OPTIONS = COMMON_OPTIONS | {"tau"}


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

    tracker = Tracker(
        "fixed_point", z0, max_iter=max_iter, tol=tol, stop_mode=stop_mode, common=common
    )
    z = z0
    nstep = 0
    while True:
        fz = f(z)
        nstep += 1
        d = fz - z
        tracker.record(z, fz, d)
        if tracker.stop() or nstep >= max_iter:
            break
        # A fresh tensor every step: the tracker holds references to earlier iterates.
        z = fz if tau == 1.0 else torch.add(z, d, alpha=tau)
    return tracker.finish(nstep, {"tau": tau})
