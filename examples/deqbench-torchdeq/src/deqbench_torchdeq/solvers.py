"""TorchDEQ 0.1.0's forward solvers behind deqbench's solver contract.

``solve(f, z0, *, max_iter, tol, stop_mode="rel", **options) -> (z, SolverStats)``:

* the stop mode and tolerance are always passed to TorchDEQ explicitly (its default is
  ``stop_mode='abs'``; TorchDEQ ignores misspelt keys), and unknown options are
  rejected (TorchDEQ swallows them silently);
* ``nstep`` counts f-evaluations by wrapping ``f``, exactly as deqbench counts them for its own
  solvers; TorchDEQ's own ``nstep`` (the index of the lowest-residual step) is kept in
  ``extra["torchdeq_nstep"]``;
* traces hold one row per measured iterate: TorchDEQ's leading ``1e8`` sentinel and its padding
  after an early stop are removed;
* the residual reported is that of the returned iterate. TorchDEQ's Anderson and fixed-point
  solvers return f(x_best), one contraction past the iterate their ``rel_lowest`` describes, so
  with ``check_returned=True`` (the default) the adapter recomputes it with one extra f-evaluation
  that is *not* counted. Benchmarks time with ``check_returned=False`` and
  recompute the residual themselves, untimed, for every solver alike.

Example:
    >>> import torch
    >>> z, st = torchdeq_anderson(lambda z: 0.5 * z + 1, torch.zeros(2, 3), max_iter=50, tol=1e-6)
    >>> st.status, st.solver
    ('converged', 'torchdeq_anderson')
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from deqbench.solvers.base import (
    SolverStats,
    check_budget,
    check_options,
    make_stats,
    option_error,
    residuals,
)

#: deqbench solver name -> TorchDEQ solver key
TORCHDEQ_NAMES = {
    "torchdeq_anderson": "anderson",
    "torchdeq_broyden": "broyden",
    "torchdeq_fixed_point": "fixed_point_iter",
}

#: options each adapter passes on to TorchDEQ (everything else is rejected)
PASSED = {
    "anderson": {"m", "lam", "tau", "return_final"},
    "broyden": {"LBFGS_thres", "return_final"},
    "fixed_point_iter": {"tau", "return_final"},
}
ADAPTER_OPTIONS = {"check_returned"}

#: the iterate TorchDEQ returns: f(x) of the lowest-residual x, or x itself
RETURNED = {"anderson": "f(x)", "broyden": "x", "fixed_point_iter": "f(x)"}


def torchdeq_solver(key: str) -> Callable[..., Any]:
    """TorchDEQ's solver function for ``key`` (``anderson``, ``broyden``, ``fixed_point_iter``)."""
    from torchdeq.solver import get_solver

    return get_solver(key)


def measured_rows(key: str, nfe: int) -> int:
    """How many iterates' residuals a TorchDEQ solver measured in ``nfe`` f-evaluations.

    Anderson evaluates f(x0) and f(f(x0)) before its first measured step; Broyden evaluates
    g(x0) once before its loop (no line search); fixed-point iteration measures every call."""
    if key == "anderson":
        return max(nfe - 2, 0)
    if key == "broyden":
        return max(nfe - 1, 0)
    return nfe


def stats_from_info(
    name: str,
    key: str,
    info: dict[str, Any],
    nfe: int,
    tol: float,
    stop_mode: str,
    max_iter: int,
    abs_res: Tensor | None = None,
    rel_res: Tensor | None = None,
    extra: dict[str, Any] | None = None,
) -> SolverStats:
    """deqbench SolverStats from TorchDEQ's ``info`` dict and the counted f-evaluations.

    ``abs_res``/``rel_res``: the recomputed residual of the returned iterate; when None the
    solver's own lowest residual is reported (``extra["residual_source"]`` says which)."""
    rows = measured_rows(key, nfe)
    abs_tr = info["abs_trace"]
    rel_tr = info["rel_trace"]
    if abs_tr.dim() == 2 and abs_tr.shape[1] > 1:
        rows = min(rows, abs_tr.shape[1] - 1)
        abs_trace = abs_tr[:, 1 : 1 + rows].t().contiguous()
        rel_trace = rel_tr[:, 1 : 1 + rows].t().contiguous()
    else:
        B = info["abs_lowest"].shape[0]
        abs_trace = info["abs_lowest"].new_zeros(0, B)
        rel_trace = abs_trace
        rows = 0
    source = "recomputed" if abs_res is not None else "torchdeq_lowest"
    if abs_res is None or rel_res is None:
        abs_res, rel_res = info["abs_lowest"], info["rel_lowest"]
    td_nstep = info["nstep"]
    first = {"anderson": 3, "broyden": 1, "fixed_point_iter": 1}[key]  # TorchDEQ step of row 0
    lowest = int(td_nstep.max()) - first if rows else -1
    r = rel_res if stop_mode == "rel" else abs_res
    stagnated = (
        key == "broyden"
        and nfe < max_iter + 1
        and bool(torch.isfinite(r).all())
        and not bool((r < tol).all())
    )
    ext = {
        "returned": RETURNED[key],
        "torchdeq_nstep": td_nstep,
        "residual_source": source,
        "library": "torchdeq",
    }
    ext.update(extra or {})
    return make_stats(
        name,
        nfe,
        abs_trace,
        rel_trace,
        abs_res,
        rel_res,
        tol,
        stop_mode,
        diverged=not bool(torch.isfinite(r).all()),
        lowest_step=lowest,
        stagnated=stagnated,
        extra=ext,
    )


def _make(name: str) -> Callable[..., tuple[Tensor, SolverStats]]:
    key = TORCHDEQ_NAMES[name]
    allowed = PASSED[key] | ADAPTER_OPTIONS

    @torch.no_grad()
    def solve(
        f: Callable[[Tensor], Tensor],
        z0: Tensor,
        *,
        max_iter: int = 50,
        tol: float = 1e-4,
        stop_mode: str = "rel",
        **options: Any,
    ) -> tuple[Tensor, SolverStats]:
        check_options(name, options, allowed)
        check_budget(name, max_iter, tol, stop_mode)
        if key == "anderson" and max_iter < 3:
            raise option_error(
                name,
                "TorchDEQ's Anderson needs max_iter >= 3 (it measures from its 3rd f-evaluation)",
            )
        opts = dict(options)
        check = bool(opts.pop("check_returned", True))
        calls = [0]

        def fc(z: Tensor) -> Tensor:
            calls[0] += 1
            return f(z)

        # stop_mode and tol are passed explicitly: TorchDEQ defaults to stop_mode='abs'.
        z, _, info = torchdeq_solver(key)(
            fc,
            z0,
            max_iter=int(max_iter),
            tol=float(tol),
            stop_mode=stop_mode,
            indexing=None,
            **opts,
        )
        z = z.reshape(z0.shape)
        a = r = None
        if check:
            a, r = residuals(f(z), z)  # one extra f-evaluation, not counted
        return z, stats_from_info(
            name,
            key,
            info,
            calls[0],
            tol,
            stop_mode,
            int(max_iter),
            a,
            r,
            {"check_returned": check},
        )

    solve.__name__ = name
    solve.__qualname__ = name
    solve.__doc__ = (
        f"TorchDEQ 0.1.0 ``{key}`` behind deqbench's solver contract (stop_mode and tol passed "
        f"explicitly; f-evaluations counted by wrapping f). Options: {', '.join(sorted(allowed))}."
    )
    solve.OPTIONS = allowed  # type: ignore[attr-defined]
    return solve


torchdeq_anderson = _make("torchdeq_anderson")
torchdeq_broyden = _make("torchdeq_broyden")
torchdeq_fixed_point = _make("torchdeq_fixed_point")
