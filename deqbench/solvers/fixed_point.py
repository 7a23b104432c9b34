"""Plain (optionally damped) fixed-point iteration z <- tau f(z) + (1 - tau) z."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from ..registry import solvers
from .base import SolverStats, check_options, check_stop_mode, make_stats, residuals

OPTIONS = {"tau", "returns", "check_every", "protect_thres"}


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
        tol: stop when the batch max residual (``stop_mode``) is below ``tol``.
        stop_mode: "rel" or "abs".
        tau: damping in (0, 1].
        returns: "lowest" (default) returns the iterate x with the lowest measured residual per
            sample; "last" the last measured iterate. The reported residual is that of x.
        check_every: test convergence on the host every k f-evaluations (default 1).
        protect_thres: stop as diverged when the max residual exceeds this factor times the
            first residual (default 1e6).

    Returns:
        (z, SolverStats)

    Example:
        >>> z, st = fixed_point(lambda z: 0.5 * z + 1, torch.zeros(2, 3), max_iter=100, tol=1e-8)
    """
    check_options("fixed_point", options, OPTIONS)
    check_stop_mode(stop_mode)
    tau = float(options.get("tau", 1.0))
    returns = options.get("returns", "lowest")
    check_every = max(1, int(options.get("check_every", 1)))
    protect = float(options.get("protect_thres", 1e6))
    if not 0 < tau <= 1:
        raise ValueError(f"fixed_point: tau must be in (0, 1], got {tau}")

    z = z0
    abs_tr: list[Tensor] = []
    rel_tr: list[Tensor] = []
    best_z = z0
    best_abs = best_rel = None
    lowest = -1
    diverged = False
    nstep = 0
    first = None
    for k in range(max_iter):
        fz = f(z)
        nstep += 1
        a, r = residuals(fz, z)
        abs_tr.append(a)
        rel_tr.append(r)
        res = r if stop_mode == "rel" else a
        if returns == "last" or best_abs is None:
            best_z, best_abs, best_rel, lowest = z, a, r, k
            best_res = res
        else:
            better = res < best_res
            mask = better.view(-1, *([1] * (z.dim() - 1)))
            best_z = torch.where(mask, z, best_z)
            best_abs = torch.where(better, a, best_abs)
            best_rel = torch.where(better, r, best_rel)
            best_res = torch.where(better, res, best_res)
            lowest = k
        if first is None:
            first = res.max()
        if (k + 1) % check_every == 0 or k == max_iter - 1:
            mv = float(res.max())
            if not math.isfinite(mv) or mv > protect * max(float(first), 1e-30):
                diverged = True
                break
            if mv < tol:
                break
        z = fz if tau == 1.0 else tau * fz + (1 - tau) * z
    assert best_abs is not None
    return best_z, make_stats(
        "fixed_point", nstep, abs_tr, rel_tr, best_abs, best_rel, tol, stop_mode, diverged, lowest
    )
