"""Solver options: the pydantic options models a solver declares (:class:`SolverOptions`,
:class:`CommonOptions`, :class:`GraphOptions`), their validation into a frozen object with
errors that name the solver and the option (:class:`SolverOptionError`), the checks of the
budget arguments every solve takes, and the option domains the docs' tables print.
"""

from __future__ import annotations

import types
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

from annotated_types import Ge, Gt, Le
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from ..core.errors import ConfigError

#: the stop rules (option ``stop``): the reduction over the batch that decides convergence,
#: independent of ``stop_mode`` (which per-sample residual, rel or abs):
#:
#: * ``sample_max`` (default): the largest per-sample residual of the returned iterates < tol;
#: * ``batch_fro``: one ratio over the whole batch, ``||f(z) - z||_F / ||f(z)||_F`` (Frobenius
#:   norms over every sample's elements; for plain iteration z_{k+1} = f(z_k) this is the
#:   successive-difference form ``||z_{k+1} - z_k||_F / ||z_{k+1}||_F``) under ``stop_mode``
#:   rel, ``||f(z) - z||_F`` (the Frobenius norm of the whole batch's residual, i.e. the 2-norm
#:   of the per-sample abs residuals) under abs;
#: * ``batch_mean``: the mean over samples of the per-sample residual < tol.
STOP_RULES = ("sample_max", "batch_fro", "batch_mean")
DEFAULT_STOP = "sample_max"


class SolverOptionError(ConfigError, ValueError):
    """An invalid solver option or option value (a ConfigError that is also a ValueError)."""


#: most steps captured in one graph (``graph_steps``)
GRAPH_STEPS_MAX = 16


def check_stop_mode(stop_mode: str) -> None:
    if stop_mode not in ("rel", "abs"):
        raise SolverOptionError(f"stop_mode must be 'rel' or 'abs', got {stop_mode!r}")


def check_stop(stop: Any) -> str:
    """``stop`` if it is a stop rule (:data:`STOP_RULES`), else a SolverOptionError."""
    if stop not in STOP_RULES:
        raise SolverOptionError(f"stop must be one of {', '.join(STOP_RULES)}, got {stop!r}")
    return str(stop)


def check_options(solver: str, options: dict[str, Any], allowed: set[str]) -> None:
    """Reject unknown solver options (TorchDEQ silently accepts typos; we do not)."""
    unknown = set(options) - allowed
    if unknown:
        import difflib

        bad = sorted(unknown)[0]
        close = difflib.get_close_matches(bad, sorted(allowed), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise SolverOptionError(
            f"solver '{solver}': unknown option '{bad}'{hint}; options: {', '.join(sorted(allowed))}"
        )


def option_error(solver: str, msg: str) -> SolverOptionError:
    return SolverOptionError(f"solver '{solver}': {msg}")


def positive_int(solver: str, name: str, value: Any) -> int:
    """``value`` as an int, or a SolverOptionError unless it is a positive integer (not a bool)."""
    if isinstance(value, bool) or int(value) != value or value < 1:
        raise option_error(solver, f"{name} must be a positive integer, got {value!r}")
    return int(value)


def check_budget(solver: str, max_iter: int, tol: float, stop_mode: str) -> None:
    check_stop_mode(stop_mode)
    positive_int(solver, "max_iter", max_iter)
    if not (tol >= 0):  # also rejects NaN
        raise option_error(solver, f"tol must be >= 0, got {tol!r}")


class SolverOptions(BaseModel):
    """Base of a solver's options model: unknown options are errors, values are checked
    strictly (no bool for a number, no string for a number, an integer option takes no float)
    and the validated object is frozen (one object serves every solve with the same options).

    Subclass :class:`CommonOptions` (or :class:`GraphOptions`) for a solver built on
    :class:`Tracker`; subclass this for one that takes none of them.
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class CommonOptions(SolverOptions):
    """The options every solver built on :class:`Tracker` takes (its bookkeeping reads them)."""

    returns: Literal["lowest", "last"] = Field(
        "lowest",
        description="'lowest': per sample, the iterate x with the lowest measured residual; "
        "'last': the last measured iterate. The reported residual is that of x.",
    )
    check_every: Annotated[int, Gt(0)] | None = Field(
        None,
        description="read the convergence test on the host exactly every k f-evaluations "
        "(None: every step on CPU; on CUDA one step late without stalling the GPU, exactly "
        "near convergence).",
    )
    protect_thres: float = Field(
        1e6,
        gt=1,
        description="stop as diverged when the batch max abs residual exceeds this factor times "
        "the first one (non-finite residuals always stop as diverged).",
    )
    stop: Literal["sample_max", "batch_fro", "batch_mean"] = Field(
        "sample_max",
        description="stop rule, the reduction over the batch that decides convergence (with "
        "stop_mode rel or abs per sample): 'sample_max': the largest per-sample residual < tol; "
        "'batch_fro': one batch-wide ratio ||f(z) - z||_F / ||f(z)||_F (rel; abs: "
        "||f(z) - z||_F) < tol; 'batch_mean': the mean per-sample residual < tol.",
    )


class GraphOptions(CommonOptions):
    """:class:`CommonOptions` plus the CUDA-graph options (``@solver(..., cuda_graph=True)``)."""

    cuda_graph: StrictBool | Literal["cache"] | None = Field(
        False,
        description="True: capture the solver step (f and the bookkeeping, on static buffers) "
        "in a CUDA graph after one eager step and replay it; 'cache': also keep the graph for "
        "later solves with the same f object, shapes and options. f must be capturable (no host "
        "syncs, fixed shapes). On CPU the static step runs eagerly. See deqbench.solvers.base.",
    )
    graph_steps: Literal["auto", "loop"] | Annotated[int, Ge(1), Le(GRAPH_STEPS_MAX)] = Field(
        "auto",
        description="steps per captured graph ('auto': 2 for states of at most 2M elements, "
        "else 1); the host reads the residuals once per replay, so up to graph_steps - 1 steps "
        "past convergence may be made (extra['nstep_to_tol']). 'loop': the whole solve in one "
        "graph, a loop on the device whose stop test runs there too (CUDA graph conditional "
        "nodes, CUDA >= 12.4; else 'auto'): one launch and one host read per solve, the eager "
        "path's steps.",
    )


#: options every built-in solver built on :class:`Tracker` accepts
COMMON_OPTIONS = frozenset(CommonOptions.model_fields)

_Opts = TypeVar("_Opts", bound=SolverOptions)


def _bound_text(meta: Any, integer: bool) -> str:
    lo = hi = None
    lo_in = hi_in = False
    for m in meta:
        for attr, incl, upper in (("gt", False, False), ("ge", True, False),
                                  ("lt", False, True), ("le", True, True)):  # fmt: skip
            v = getattr(m, attr, None)
            if v is None or type(m).__name__.lower() != attr:
                continue
            if upper:
                hi, hi_in = v, incl
            else:
                lo, lo_in = v, incl
    if integer and hi is None and lo is not None and (lo == 0 and not lo_in or lo == 1 and lo_in):
        return "a positive integer"
    what = "an integer" if integer else "a number"
    if lo is not None and hi is not None:
        return f"{what} in {'[' if lo_in else '('}{lo}, {hi}{']' if hi_in else ')'}"
    if lo is not None:
        return f"{what} {'>=' if lo_in else '>'} {lo}"
    if hi is not None:
        return f"{what} {'<=' if hi_in else '<'} {hi}"
    return what


def _domain_parts(tp: Any, meta: tuple[Any, ...] = ()) -> list[str]:
    origin = get_origin(tp)
    if origin is Annotated:
        base, *more = get_args(tp)
        return _domain_parts(base, (*meta, *more))
    if origin in (Union, types.UnionType):
        return [p for a in get_args(tp) for p in _domain_parts(a, meta)]
    if origin is Literal:
        return [repr(a) for a in get_args(tp)]
    if tp is type(None):
        return ["None"]
    if tp is bool:
        return ["False", "True"]
    if tp in (int, float):
        return [_bound_text(meta, tp is int)]
    if tp is str:
        return ["a string"]
    if tp is dict or origin is dict:
        return ["a mapping"]
    return [] if tp is Any else [getattr(tp, "__name__", str(tp))]


def option_domain(options: type[SolverOptions], name: str) -> str:
    """What option ``name`` of an options model takes, in words (errors and the docs' tables):
    ``'lowest' or 'last'``, ``a number in (0, 1]``, ``'auto' or an integer in [1, 16]``."""
    f = options.model_fields[name]
    parts = _domain_parts(f.annotation, tuple(f.metadata))
    if not parts:
        return "any value"
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " or " + parts[-1]


def option_problems(options: type[SolverOptions], given: dict[str, Any]) -> list[tuple[str, str]]:
    """``(option, problem)`` for each option of ``given`` whose value ``options`` rejects
    (``("tau", "must be a number in (0, 1], got 0.0")``; option '' for a problem of several
    together); unknown names are left to :func:`check_options`. Suites report these at build
    time (``defaults.solver.tau: must be ...``), a direct call raises the first."""
    try:
        options.model_validate({k: v for k, v in given.items() if k in options.model_fields})
    except ValidationError as exc:
        out: list[tuple[str, str]] = []
        for e in exc.errors(include_url=False):
            key = str(e["loc"][0]) if e["loc"] else ""
            if any(k == key for k, _ in out):  # a union reports each member: one line
                continue
            if e["type"] == "value_error":
                msg = str(e["ctx"]["error"])
            elif key in options.model_fields:
                msg = f"must be {option_domain(options, key)}, got {given[key]!r}"
            else:
                msg = e["msg"]
            out.append((key, msg))
        return out
    return []


def problem_text(key: str, problem: str) -> str:
    """One line for an :func:`option_problems` entry: ``tau must be ...``, ``prior: ...``."""
    if not key:
        return problem
    return f"{key} {problem}" if problem.startswith("must be") else f"{key}: {problem}"


def _freeze(v: Any) -> Any:
    """A hashable key of an option value (its type included: True, 1 and 1.0 are equal keys)."""
    if isinstance(v, dict):
        return (dict, tuple(sorted((str(k), _freeze(x)) for k, x in v.items())))
    if isinstance(v, (list, tuple)):
        return (type(v), tuple(_freeze(x) for x in v))
    hash(v)  # TypeError: not cached
    return (type(v), v)


def stop_problem(solver: str, fields: Any, value: Any) -> str | None:
    """Why a solver whose options are ``fields`` cannot take ``stop=value``, else None: an
    unknown rule, or a rule other than ``sample_max`` for a solver that does not declare the
    option ``stop`` (it stops on the batch max, the default rule, and says nothing else)."""
    if value not in STOP_RULES:
        return f"stop must be one of {', '.join(STOP_RULES)}, got {value!r}"
    if "stop" in fields or value == DEFAULT_STOP:
        return None
    return (
        f"stop rule {value!r} is not supported by solver '{solver}' (it stops on the batch max "
        "of the per-sample residual: stop 'sample_max' only)"
    )


def parse_options(solver: str, options: type[_Opts], given: dict[str, Any]) -> _Opts:
    """The validated options object, or a SolverOptionError naming the solver and the option
    (an unknown one with "did you mean"). A model without the option ``stop`` takes
    ``stop="sample_max"`` (its rule, dropped here) and refuses another (:func:`stop_problem`)."""
    if "stop" in given and "stop" not in options.model_fields:
        msg = stop_problem(solver, options.model_fields, given["stop"])
        if msg is not None:
            raise SolverOptionError(
                msg if msg.startswith("stop rule") else f"solver '{solver}': {msg}"
            )
        given = {k: v for k, v in given.items() if k != "stop"}
    check_options(solver, given, set(options.model_fields))
    problems = option_problems(options, given)
    if problems:
        raise option_error(solver, problem_text(*problems[0]))
    return options.model_validate(given)
