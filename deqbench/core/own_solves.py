"""Models that run their own fixed-point loop: the optional hook through which they report it.

A model without a :class:`deqbench.deq.DEQLayer` whose forward computes its equilibrium with
its own code (a wrapped third-party DEQ) is invisible to deqbench's solver statistics unless it
says what its solver did. The hook (:class:`deqbench.contracts.OwnSolverModel`):

* ``last_solve_stats(self) -> SolverStats | dict | None``: the last forward solve (None: none
  ran). A :class:`deqbench.solvers.base.SolverStats` (e.g. from
  :func:`~deqbench.solvers.base.make_stats`) or a plain dict, for plugins that do not import
  deqbench, with the keys of :data:`KEYS` (``nstep``, ``tol`` and ``rel_residual`` and/or
  ``abs_residual`` required);
* ``last_backward_solve_stats(self)`` (optional): the last backward (adjoint) solve the model
  ran itself, the same way; None when the last forward ran without gradient;
* ``solver_name`` / ``backward_name`` (optional class attributes): the cells' ``solver`` and
  ``backward`` columns say ``own:<solver_name>`` / ``own:<backward_name>`` (``own`` unnamed).

:func:`read` validates and normalises what the hooks return into ``SolverStats`` (a bad value
is a :class:`~deqbench.errors.PluginError` naming the model and the hook), with the model's
claimed convergence checked against the residual and tolerance it reports
(:func:`deqbench.core.verdict.check_claim`). :func:`watch` adds a forward hook to such a model
(:func:`deqbench.models.create` does it) that records each of its solves, forward and own
backward, in the runner's open solve ledger, as a DEQ layer records its own.

Example:
    >>> import torch
    >>> class Net(torch.nn.Module):
    ...     solver_name = "picard"
    ...     def last_solve_stats(self):
    ...         return {"nstep": 12, "rel_residual": 3e-5, "tol": 1e-4, "max_iter": 100}
    >>> st = read(Net(), "own:picard")[0]
    >>> st.nstep, st.converged, st.status, st.solver
    (12, True, 'converged', 'own:picard')
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import functools
import math
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from ..solvers.base import STATUSES, SolverStats
from . import verdict
from .errors import PluginError

#: the model method reporting its last forward solve
STATS_HOOK = "last_solve_stats"
#: the optional model method reporting its last own backward (adjoint) solve
BACKWARD_HOOK = "last_backward_solve_stats"
#: the optional class attributes naming the model's own solver and backward
SOLVER_ATTR = "solver_name"
BACKWARD_ATTR = "backward_name"
#: the prefix of the ``solver`` / ``backward`` columns of a model that reports its own solves
OWN = "own"
#: the ``solver`` / ``backward`` columns of a model that solves its own equilibrium and reports
#: nothing
NOT_MEASURED = "not measured"
#: the dict form of a hook's return: key -> what it is (required: nstep, tol and a residual)
KEYS = {
    "nstep": "f-evaluations (iterations) the solve made, an int >= 0 (required)",
    "tol": "the tolerance its stopping test used (required)",
    "rel_residual": "relative residual of the returned iterate: a float (batch max) or a (B,) "
    "tensor per sample (rel_residual and/or abs_residual required)",
    "abs_residual": "absolute residual, the same way",
    "stop_mode": "'rel' or 'abs': the residual its stopping test used (default: rel when "
    "rel_residual is given, else abs)",
    "converged": "bool (default: the stop-mode residual is below tol)",
    "status": f"one of {', '.join(STATUSES)} (default: from converged, the residual and max_iter)",
    "max_iter": "the solver's own cap on nstep",
    "rel_trace": "residual after each iteration: a sequence or a (T,) or (T, B) tensor",
    "abs_trace": "the same, absolute",
    "njvp": "Jacobian-vector products made, counted apart from nstep",
    "extra": "a dict of anything else (kept in SolverStats.extra)",
}
_REQUIRED = "nstep, tol and rel_residual or abs_residual"


def own_label(name: Any) -> str:
    """``own:<name>``, or ``own`` for an unnamed solver (``name`` None or empty)."""
    return f"{OWN}:{name}" if isinstance(name, str) and name else OWN


def has_hook(model: Any) -> bool:
    """Whether ``model`` defines the forward hook ``last_solve_stats`` (DEQ layers aside)."""
    return callable(getattr(model, STATS_HOOK, None))


def _who(model: Any, hook: str) -> str:
    return f"model {type(model).__name__}: {hook}()"


def _vector(value: Any, what: str, who: str) -> Tensor:
    """A residual as a 1-D tensor (B,) (a scalar becomes (1,)), detached."""
    if isinstance(value, bool) or value is None:
        raise PluginError(f"{who}: {what} must be a number or a tensor, got {value!r}")
    try:
        t = (
            value.detach()
            if isinstance(value, Tensor)
            else torch.as_tensor(value, dtype=torch.float64)
        )
    except (TypeError, ValueError, RuntimeError) as exc:
        raise PluginError(f"{who}: {what} must be a number or a tensor, got {value!r}") from exc
    if not (t.is_floating_point() or t.dtype in (torch.int32, torch.int64)):
        raise PluginError(f"{who}: {what} must be a real number or tensor, got dtype {t.dtype}")
    if t.dim() > 1:
        raise PluginError(f"{who}: {what} must be a float or a (B,) tensor, got {tuple(t.shape)}")
    t = t.reshape(-1)
    return t if t.is_floating_point() else t.double()


def _trace(value: Any, what: str, who: str, like: Tensor) -> Tensor:
    """A trace as (T, B) (a (T,) trace becomes (T, 1))."""
    if isinstance(value, Tensor):
        t = value.detach()
    else:
        try:
            items = list(value)
        except TypeError as exc:
            raise PluginError(f"{who}: {what} must be a sequence or a tensor") from exc
        if not items:
            return like.new_zeros(0, 1)
        if all(isinstance(v, Tensor) for v in items):
            t = torch.stack([v.detach().reshape(-1) for v in items])
        else:
            t = torch.as_tensor(items, dtype=torch.float64)
    if t.dim() == 1:
        t = t[:, None]
    if t.dim() != 2:
        raise PluginError(f"{who}: {what} must be (T,) or (T, B), got {tuple(t.shape)}")
    return t if t.is_floating_point() else t.double()


def _int(value: Any, what: str, who: str) -> int:
    if isinstance(value, Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value:
        raise PluginError(f"{who}: {what} must be an integer, got {value!r}")
    if value < 0:
        raise PluginError(f"{who}: {what} must be >= 0, got {value!r}")
    return int(value)


def _from_dict(d: Mapping[str, Any], who: str) -> SolverStats:
    unknown = sorted(set(d) - set(KEYS))
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(KEYS), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise PluginError(
            f"{who}: unknown key '{unknown[0]}'{hint}; keys: {', '.join(KEYS)} "
            "(deqbench.contracts.OwnSolverModel)"
        )
    missing = [k for k in ("nstep", "tol") if k not in d]
    if "rel_residual" not in d and "abs_residual" not in d:
        missing.append("rel_residual or abs_residual")
    if missing:
        raise PluginError(
            f"{who} returned a dict without {', '.join(missing)} (required: {_REQUIRED}; "
            "deqbench.contracts.OwnSolverModel)"
        )
    nstep = _int(d["nstep"], "nstep", who)
    try:
        tol = float(d["tol"])
    except (TypeError, ValueError) as exc:
        raise PluginError(f"{who}: tol must be a number, got {d['tol']!r}") from exc
    if not tol >= 0:
        raise PluginError(f"{who}: tol must be >= 0, got {d['tol']!r}")
    res = {k: _vector(d[k], k, who) for k in ("rel_residual", "abs_residual") if k in d}
    stop_mode = d.get("stop_mode", "rel" if "rel_residual" in res else "abs")
    if stop_mode not in ("rel", "abs"):
        raise PluginError(f"{who}: stop_mode must be 'rel' or 'abs', got {stop_mode!r}")
    if f"{stop_mode}_residual" not in res:
        raise PluginError(f"{who}: stop_mode is '{stop_mode}' but there is no {stop_mode}_residual")
    given = res[f"{stop_mode}_residual"]
    for k in ("rel_residual", "abs_residual"):
        if k not in res:
            res[k] = torch.full_like(given, math.nan)
    r = given.double()
    finite = bool(torch.isfinite(r).all()) and r.numel() > 0
    below = finite and bool((r < tol).all())
    if "converged" in d:
        c = d["converged"]
        if isinstance(c, Tensor) and c.numel() == 1:
            c = bool(c.item())
        if not isinstance(c, bool | int) or c not in (0, 1):
            raise PluginError(f"{who}: converged must be a bool, got {c!r}")
        converged = bool(c)
    else:
        converged = below
    max_iter = _int(d["max_iter"], "max_iter", who) if d.get("max_iter") is not None else None
    if "status" in d:
        status = d["status"]
        if status not in STATUSES:
            raise PluginError(f"{who}: status must be one of {', '.join(STATUSES)}, got {status!r}")
        if (status == "converged") != converged:
            raise PluginError(f"{who}: status '{status}' contradicts converged={converged}")
    elif converged:
        status = "converged"
    elif not finite:
        status = "diverged"
    elif max_iter is not None and nstep < max_iter:
        status = "stagnated"  # stopped by its own rule before its cap
    else:
        status = "max_iter"
    traces = {
        k: _trace(d[k], k, who, given) for k in ("rel_trace", "abs_trace") if d.get(k) is not None
    }
    if traces:
        shape = next(iter(traces.values())).shape
        for k in ("rel_trace", "abs_trace"):
            traces.setdefault(k, torch.full(shape, math.nan, dtype=torch.float64))
    else:
        traces = {k: given.new_zeros(0, given.shape[0]) for k in ("rel_trace", "abs_trace")}
    extra = d.get("extra") or {}
    if not isinstance(extra, Mapping):
        raise PluginError(f"{who}: extra must be a dict, got {type(extra).__name__}")
    extra = dict(extra)
    if max_iter is not None:
        extra["max_iter"] = max_iter
    return SolverStats(
        nstep=nstep,
        abs_residual=res["abs_residual"],
        rel_residual=res["rel_residual"],
        abs_trace=traces["abs_trace"],
        rel_trace=traces["rel_trace"],
        converged=converged,
        status=status,
        tol=tol,
        stop_mode=stop_mode,
        extra=extra,
        njvp=_int(d.get("njvp", 0), "njvp", who),
    )


def _checked(st: SolverStats, who: str) -> SolverStats:
    """A copy of a returned SolverStats, its fields checked."""
    _int(st.nstep, "SolverStats.nstep", who)
    for k in ("abs_residual", "rel_residual", "abs_trace", "rel_trace"):
        if not isinstance(getattr(st, k), Tensor):
            raise PluginError(f"{who}: SolverStats.{k} must be a tensor")
    if st.status not in STATUSES:
        raise PluginError(f"{who}: SolverStats.status must be one of {', '.join(STATUSES)}")
    if st.stop_mode not in ("rel", "abs"):
        raise PluginError(f"{who}: SolverStats.stop_mode must be 'rel' or 'abs'")
    if not float(st.tol) >= 0:
        raise PluginError(f"{who}: SolverStats.tol must be set (>= 0), got {st.tol!r}")
    return replace(st, extra=dict(st.extra))


def parse(value: Any, model: Any, hook: str = STATS_HOOK, label: str = OWN) -> SolverStats | None:
    """What ``model.<hook>()`` returned as a checked :class:`SolverStats` (None stays None).

    ``solver`` becomes ``label``; the claimed convergence is checked against the reported
    residual and tolerance (:func:`deqbench.core.verdict.check_claim`)."""
    if value is None:
        return None
    who = _who(model, hook)
    if isinstance(value, SolverStats):
        st = _checked(value, who)
    elif isinstance(value, Mapping):
        st = _from_dict(value, who)
    else:
        raise PluginError(
            f"{who} returned a {type(value).__name__}; it must return None, a "
            "deqbench.solvers.base.SolverStats or a dict with "
            f"{_REQUIRED} (deqbench.contracts.OwnSolverModel)"
        )
    st.solver = label
    verdict.check_claim(st, st.tol, st.stop_mode)
    return st


def read(
    model: Any, label: str = OWN, backward_label: str = OWN
) -> tuple[SolverStats | None, SolverStats | None]:
    """(forward, backward) stats of ``model``'s last own solves (each None when not reported).
    ``model`` must define ``last_solve_stats``; the caller checks that it has no DEQ layer."""
    fw = parse(getattr(model, STATS_HOOK)(), model, STATS_HOOK, label)
    bhook = getattr(model, BACKWARD_HOOK, None)
    bw = parse(bhook(), model, BACKWARD_HOOK, backward_label) if callable(bhook) else None
    return fw, bw


def labels(model: Any) -> tuple[str, str]:
    """The ``solver`` and ``backward`` columns of a model that reports its own solves."""
    return own_label(getattr(model, SOLVER_ATTR, None)), own_label(
        getattr(model, BACKWARD_ATTR, None)
    )


# -- what the run asks of a model's own loop ---------------------------------------------------

_RULE: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "deqbench_own_rule", default=None
)
_PURITY: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "deqbench_own_purity", default=None
)


@contextlib.contextmanager
def judged_under(stop: str | None) -> Iterator[None]:
    """Inside the block, a model's own loop measured by deqbench
    (:class:`deqbench.adapters.OwnLoop`) is judged under the stop rule ``stop`` (the run's:
    the cell's ``solver.stop``; None: the default ``sample_max``), whatever rule the library
    stops on; the library's own verdict is kept beside it."""
    token = _RULE.set(stop)
    try:
        yield
    finally:
        _RULE.reset(token)


def run_rule() -> str:
    """The stop rule a model's own loop is judged under now (:func:`judged_under`)."""
    return _RULE.get() or "sample_max"


@contextlib.contextmanager
def purity_probe() -> Iterator[list[str]]:
    """Inside the block, a model's own loop measured by deqbench compares the model's buffers
    before and after one call of its map (the second iteration, so that a cache filled once
    passes), puts them back, and appends the names of those that changed to the yielded list
    (the contract check [model.cell_pure] of own-loop maps)."""
    found: list[str] = []
    token = _PURITY.set(found)
    try:
        yield found
    finally:
        _PURITY.reset(token)


def probing_purity() -> list[str] | None:
    """The list of :func:`purity_probe` (None outside one)."""
    return _PURITY.get()


# -- recording each solve in the runner's ledger ----------------------------------------------

#: marks a model whose solves :func:`watch` records (copied with the model)
_WATCHED = "_deqbench_own_solves_watched"


def _record_backward(model: nn.Module) -> None:
    bhook = getattr(model, BACKWARD_HOOK, None)
    if not callable(bhook):
        return
    st = parse(bhook(), model, BACKWARD_HOOK, labels(model)[1])
    if st is not None:
        verdict.record("adjoint", st, st.extra.get("max_iter"))


def _after_output_grad(model: nn.Module, ctx: contextvars.Context, grad: Tensor) -> None:
    """The output's gradient is known: the model's own backward runs next; read its stats
    once the whole backward pass is done, in the context (ledger) of the forward."""
    torch.autograd.Variable._execution_engine.queue_callback(  # type: ignore[attr-defined]
        functools.partial(ctx.run, _record_backward, model)
    )


def _forward_hook(model: nn.Module, args: Any, output: Any) -> None:
    """After each forward of a watched model: record its solve; arrange for its own backward
    solve to be recorded after the backward pass."""
    solver, backward = labels(model)
    st = parse(getattr(model, STATS_HOOK)(), model, STATS_HOOK, solver)
    if st is not None:
        verdict.record("forward", st, st.extra.get("max_iter"))
    if (
        isinstance(output, Tensor)
        and output.requires_grad
        and callable(getattr(model, BACKWARD_HOOK, None))
    ):
        output.register_hook(
            functools.partial(_after_output_grad, model, contextvars.copy_context())
        )


def watch(model: nn.Module) -> bool:
    """Record every solve of ``model`` (which reports its own solves and has no DEQ layer) in
    the open solve ledger, from now on (idempotent; copies of the model keep it). Returns
    whether the model is watched."""
    if not has_hook(model) or not isinstance(model, nn.Module):
        return False
    if not model.__dict__.get(_WATCHED):
        model.register_forward_hook(_forward_hook)
        model.__dict__[_WATCHED] = True
    return True
