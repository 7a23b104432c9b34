"""Operator-splitting solvers of monotone DEQs (Winston & Kolter 2020): ``forward_backward`` and
``peaceman_rachford``.

They need the model's monotone structure, so they only work on cells implementing
:class:`MonotoneCell`: ``f(z, u) = prox(W z + u)`` with ``sym(I - W) >= m I`` and ``prox`` the
projection onto a closed convex set (ReLU: the nonnegative orthant). The solver reaches the cell
through the map it is given: :class:`deqbench.deq.CellMap` (forward) and
:class:`deqbench.core.backward.AdjointMap` (IFT adjoint) expose ``.cell``. Given any other callable,
they raise a ConfigError.

Forward, with c = u:

* FB: ``z <- prox((1 - alpha) z + alpha (W z + c))``; guaranteed only for alpha < 2m/||I - W||^2.
* PR: with ``V = (I + alpha (I - W))^-1``: ``u' = 2z - u; z' = V(u' + alpha c); u = 2z' - u';
  z = prox(u)``; converges for every alpha > 0.

Backward (the matching splitting of the linear IFT system): with D = prox'(W z* + c) (0/1) and
g = dl/dz*, ``delta = D (W^T delta + g)`` is the same kind of problem with W^T for W, the linear
projection D for prox and g for c, so FB/PR apply unchanged (with V^T). The adjoint returned to
the IFT is ``w = W^T delta + g`` (then ``(df/dtheta)^T w`` are the parameter gradients).

Residual: by default the canonical one, ``||f(z) - z|| / ||f(z)||`` per sample with
``f(z) = prox(W z + c)`` (for the adjoint: the delta problem's map); ``residual="splitting"``
uses the successive difference ``||z_{k+1} - z_k|| / ||z_{k+1}||`` of monotone_op_net instead.
``nstep`` counts splitting iterations (each one W product, plus one resolvent for PR).

Example:
    >>> import torch, deqbench
    >>> from deqbench.deq import CellMap
    >>> model = deqbench.models.create("mondeq_fc_tiny")                  # doctest: +SKIP
    >>> u = model.inject(torch.randn(4, 64))                              # doctest: +SKIP
    >>> pr = deqbench.solvers.get("peaceman_rachford")                    # doctest: +SKIP
    >>> z, st = pr(CellMap(model.deq.cell, u), torch.zeros_like(u), max_iter=100, tol=1e-6,
    ...            alpha=0.5)                                             # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Any, Literal

import torch
from annotated_types import Gt
from pydantic import Field
from torch import Tensor

# the monotone-cell protocol and its operators are contracts (deqbench.contracts); re-exported
from ..core.contracts import MonotoneCell, SplittingOps  # noqa: F401
from ..core.registry import solvers
from .base import (
    SolverOptions,
    SolverStats,
    make_stats,
    residuals,
    solver,
)


class SplittingOptions(SolverOptions):
    alpha: Annotated[float, Gt(0)] | Literal["auto"] = Field(
        1.0, description="the step, or 'auto' (halving search, cached on the cell)."
    )
    returns: Literal["lowest", "last"] = Field("lowest", description="'lowest' or 'last'.")
    residual: Literal["canonical", "splitting"] = Field(
        "canonical",
        description="'canonical' (||f(z) - z|| / ||f(z)||) or 'splitting' (the successive "
        "difference of monotone_op_net).",
    )
    check_every: int = Field(1, gt=0, description="host convergence check every k iterations.")
    tune_every: int = Field(
        0, ge=0, description="with alpha 'auto', retune every k forward solves (0: once)."
    )
    protect_thres: float = Field(
        1e6,
        gt=1,
        description="diverged when the residual exceeds this factor times the first.",
    )


TUNE_ALPHAS = tuple(2.0**-k for k in range(7))  # 1 ... 1/64
_NAMES = {"fb": "forward_backward", "pr": "peaceman_rachford"}


def monotone_cell(f: Any, solver: str) -> MonotoneCell:
    """The MonotoneCell behind solver map ``f``, or a ConfigError saying why there is none."""
    from ..core.errors import ConfigError

    cell = getattr(f, "cell", None)
    if cell is None or not isinstance(cell, MonotoneCell):
        what = "a plain callable" if cell is None else f"cell {type(cell).__name__}"
        raise ConfigError(
            f"solver '{solver}' needs a model with a monotone-operator cell (mondeq_fc, "
            f"mondeq_conv, or a cell implementing deqbench.contracts.MonotoneCell); "
            f"got {what}. Use fixed_point, anderson or broyden for this model."
        )
    return cell


def fb_step_bound(cell: MonotoneCell) -> float:
    """2m / ||I - W||^2: forward-backward is guaranteed to converge for alpha below it."""
    L = cell.lipschitz()
    return 2.0 * float(cell.m) / (L * L) if L > 0 else math.inf


def _run(
    method: str,
    W: Callable[[Tensor], Tensor],
    V: Callable[[Tensor], Tensor] | None,
    prox: Callable[[Tensor], Tensor],
    c: Tensor,
    z0: Tensor,
    alpha: float,
    max_iter: int,
    tol: float,
    stop_mode: str,
    returns: str,
    check_every: int,
    residual: str,
    protect: float,
) -> tuple[Tensor, SolverStats]:
    """The splitting loop, shared by forward solves and adjoint solves."""
    z = z0
    u = z0.clone() if method == "pr" else None  # PR's reflected variable (z = prox(u))
    abs_tr: list[Tensor] = []
    rel_tr: list[Tensor] = []
    best_z = z0
    best_abs = best_rel = best_res = None
    lowest_steps = None  # per sample: the step of the returned iterate
    diverged = False
    first = None  # batch max residual of the first step (device)
    limit = None  # protect times it, read on the host at the first check
    nstep = 0
    for k in range(max_iter):
        nstep += 1
        if residual == "canonical":
            Wz = W(z)
            a, r = residuals(prox(Wz + c), z)
            cand = z
        if method == "fb":
            if residual != "canonical":
                Wz = W(z)
            z_new = prox((1 - alpha) * z + alpha * (Wz + c))
        else:
            assert V is not None and u is not None
            u_half = 2 * z - u
            z_half = V(u_half + alpha * c)
            u = 2 * z_half - u_half
            z_new = prox(u)
        if residual != "canonical":
            a, r = residuals(z_new, z)
            cand = z_new
        abs_tr.append(a)
        rel_tr.append(r)
        res = r if stop_mode == "rel" else a
        if returns == "last" or best_abs is None:
            best_z, best_abs, best_rel, best_res = cand, a, r, res
            lowest_steps = torch.full(res.shape, k, dtype=torch.int64, device=res.device)
        else:
            assert best_rel is not None and best_res is not None and lowest_steps is not None
            better = res < best_res
            mask = better.view(-1, *([1] * (z.dim() - 1)))
            best_z = torch.where(mask, cand, best_z)
            best_abs = torch.where(better, a, best_abs)
            best_rel = torch.where(better, r, best_rel)
            best_res = torch.where(better, res, best_res)
            lowest_steps = torch.where(better, k, lowest_steps)  # on the device, no sync
        if first is None:
            first = res.max()
        z = z_new
        if (k + 1) % check_every == 0 or k == max_iter - 1:
            mv = float(res.max())
            if limit is None:
                limit = protect * max(float(first), 1e-30)
            if not math.isfinite(mv) or mv > limit:
                diverged = True
                break
            if mv < tol:
                break
    assert best_abs is not None and best_rel is not None and lowest_steps is not None
    extra = {
        "lowest_steps": lowest_steps,
        "alpha": float(alpha),
        "iterations": nstep,
        "residual": residual,
        "resolvents": nstep if method == "pr" else 0,
    }
    return best_z, make_stats(
        _NAMES[method],
        nstep,
        abs_tr,
        rel_tr,
        best_abs,
        best_rel,
        tol,
        stop_mode,
        diverged,
        int(lowest_steps.max()),
        extra=extra,
    )


def _solve(
    method: str,
    f: Any,
    z0: Tensor,
    opts: SplittingOptions,
    max_iter: int,
    tol: float,
    stop_mode: str,
) -> tuple[Tensor, SolverStats]:
    name = _NAMES[method]
    cell = monotone_cell(f, name)
    alpha_opt = opts.alpha
    adjoint = hasattr(f, "g") and hasattr(f, "z")
    tangent = hasattr(f, "c") and hasattr(f, "z")  # backward.TangentMap (double backward)
    kw: dict[str, Any] = dict(
        max_iter=max_iter,
        tol=tol,
        stop_mode=stop_mode,
        returns=opts.returns,
        check_every=opts.check_every,
        residual=opts.residual,
        protect=opts.protect_thres,
    )

    def run(alpha: float) -> tuple[Tensor, SolverStats]:
        ops = cell.splitting_ops(alpha if method == "pr" else None)
        if tangent:
            # Tangent v = D W v + c (the adjoint's transpose): q = v - c solves the forward-type
            # problem q = D (W q + W c), with the linear projection D for prox.
            D = cell.prox_mask(ops.W(f.z) + f.u).to(f.c.dtype)
            q, st = _run(method, ops.W, ops.V, lambda x: D * x, ops.W(f.c), D * (z0 - f.c),
                         alpha, **kw)  # fmt: skip
            return q + f.c, st
        if not adjoint:
            return _run(method, ops.W, ops.V, cell.prox, f.u, z0, alpha, **kw)
        # Adjoint: delta = D (W^T delta + g); return w = W^T delta + g.
        D = cell.prox_mask(ops.W(f.z) + f.u).to(f.g.dtype)
        delta0 = D * z0
        delta, st = _run(method, ops.WT, ops.VT, lambda x: D * x, f.g, delta0, alpha, **kw)
        return ops.WT(delta) + f.g, st

    if alpha_opt == "auto":
        alpha = _auto_alpha(cell, method, run, adjoint or tangent, opts.tune_every)
    else:
        alpha = float(alpha_opt)
    return run(alpha)


def _auto_alpha(cell: Any, method: str, run, adjoint: bool, tune_every: int) -> float:
    """Alpha tuning as in monotone_op_net: from alpha = 1 halve while the iteration count does
    not increase; keep the last good alpha. Tuned on the first forward solve (and every
    ``tune_every`` forward solves if > 0); stored on the cell and reused by the adjoint."""
    state = cell.__dict__.setdefault("_splitting_alpha", {})
    alpha, calls = state.get(method, (None, 0))
    if adjoint:
        return alpha if alpha is not None else 1.0
    if alpha is None or (tune_every > 0 and calls % tune_every == 0):
        best, best_n = TUNE_ALPHAS[0], None
        for a in TUNE_ALPHAS:
            _, st = run(a)
            n = st.nstep if st.converged else math.inf
            if best_n is not None and n > best_n:
                break
            best, best_n = a, n
        alpha = best
    state[method] = (alpha, calls + 1)
    return alpha


@solvers.register("forward_backward")
# they need the monotone structure behind the map they are given (a CellMap or an AdjointMap;
# generic maps go to a generic solver) and solve the tangent system of a double backward
# (backward.TangentMap) too
@solver(SplittingOptions, needs_structure=True, solves_tangent=True)
def forward_backward(
    f: Callable[[Tensor], Tensor],
    z0: Tensor,
    opts: SplittingOptions,
    *,
    max_iter: int = 50,
    tol: float = 1e-4,
    stop_mode: str = "rel",
) -> tuple[Tensor, SolverStats]:
    """Forward-backward splitting ``z <- prox((1 - alpha) z + alpha (W z + c))`` on a monotone
    cell (forward solve or, given an AdjointMap, the IFT adjoint system).

    f is a CellMap/AdjointMap whose ``cell`` implements :class:`MonotoneCell`; z0 the initial
    iterate (adjoint: initial guess of w; it is projected with D). Options:
    :class:`SplittingOptions`.

    Returns:
        (z, SolverStats); ``stats.extra`` holds alpha and the iteration count.
    """
    return _solve("fb", f, z0, opts, max_iter, tol, stop_mode)


@solvers.register("peaceman_rachford")
@solver(SplittingOptions, needs_structure=True, solves_tangent=True)
def peaceman_rachford(
    f: Callable[[Tensor], Tensor],
    z0: Tensor,
    opts: SplittingOptions,
    *,
    max_iter: int = 50,
    tol: float = 1e-4,
    stop_mode: str = "rel",
) -> tuple[Tensor, SolverStats]:
    """Peaceman-Rachford splitting with ``V = (I + alpha (I - W))^-1`` on a monotone cell;
    converges for every alpha > 0. Options as :func:`forward_backward`.

    Example:
        >>> z, st = peaceman_rachford(CellMap(cell, u), torch.zeros_like(u), tol=1e-6,
        ...                           alpha=0.5)                           # doctest: +SKIP
    """
    return _solve("pr", f, z0, opts, max_iter, tol, stop_mode)
