"""Solver tags: what a solver declares about itself when it is registered, in the style of
scikit-learn's estimator tags. The diagnosis of missed solves (:mod:`deqbench.core.verdict`)
and the registry-driven tests read them, so a new solver needs no entry in a list elsewhere.

Declare them with the solver: ``@solver(Options, tags=SolverTags(rate="sublinear"))``
(:func:`deqbench.solvers.base.solver`), or, for a plain function, as its attribute ``tags`` (a
:class:`SolverTags` or a dict of its fields; ``registry.register(name, tags=...)`` sets it).
A solver that declares none gets the defaults.

Example:
    >>> from deqbench.core.tags import SolverTags, solver_tags
    >>> def halpern(f, z0, *, max_iter=50, tol=1e-4, stop_mode="rel"): ...
    >>> halpern.tags = {"rate": "sublinear"}
    >>> solver_tags(halpern).rate, solver_tags(print).rate
    ('sublinear', 'linear')
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

#: how fast a solver's residual falls on a contraction near its fixed point
RATES = ("superlinear", "linear", "sublinear")


@dataclass(frozen=True)
class SolverTags:
    """What a solver declares about itself.

    Attributes:
        rate: how its residual falls near a fixed point of a contraction: ``"superlinear"``
            (Newton-like, Anderson, Broyden), ``"linear"`` (geometric: a constant factor per
            step, the default) or ``"sublinear"`` (as a power of the step, e.g. Halpern's
            ``1/k`` or a vanishing-step scheme: it does not reach a tight tolerance in a few
            hundred steps). The diagnosis of a solve that missed its tolerance extrapolates its
            trace at this rate; the project's tests hold a sublinear solver to progress, not to
            a tight tolerance.
    """

    rate: str = "linear"

    def __post_init__(self) -> None:
        if self.rate not in RATES:
            raise ValueError(
                f"SolverTags.rate must be one of {', '.join(RATES)}, got {self.rate!r}"
            )


def as_tags(value: Any) -> SolverTags:
    """A :class:`SolverTags` from itself, a dict of its fields or None (the defaults)."""
    if value is None:
        return SolverTags()
    if isinstance(value, SolverTags):
        return value
    if isinstance(value, dict):
        known = {f.name for f in fields(SolverTags)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"unknown solver tag(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})"
            )
        return SolverTags(**value)
    raise TypeError(f"solver tags must be a SolverTags or a dict, got {type(value).__name__}")


def solver_tags(solver: Any) -> SolverTags:
    """The tags a solver declares: ``solver`` is the solver function or its registered name (an
    unknown name, e.g. a model's own loop, gets the defaults)."""
    if isinstance(solver, str):
        from .registry import solvers

        try:
            solver = solvers.get(solver)
        except Exception:  # noqa: BLE001 - not a registered solver: the defaults
            return SolverTags()
    try:
        return as_tags(getattr(solver, "tags", None))
    except (TypeError, ValueError):
        return SolverTags()
