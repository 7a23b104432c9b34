"""What a cell computes, in its id and its ``solver``/``backward`` columns.

A cell's metrics come from one computation, and its name says which: ``<model>-<solver>-
<backward>`` for a DEQ solved by a registered solver; ``<model>-unrolled<K>`` for K plain
unrolled steps (trained and evaluated; ``<model>-sam-unrolled<K>`` where the solver unrolls
itself, e.g. SAM); ``<model>`` for an explicit network; ``own:<name>`` columns (``own_<name>`` in
the id) for a model that runs and reports its own solver, ``not measured`` for one that does not
report. A suite's solver that only serves analyses (the reference z* of an unrolled cell) is
not the cell's solver: ``deqbench validate`` shows it as ``reference=``.

Example:
    >>> from deqbench.run.labels import cell_labels
    >>> cell_labels({"model": {"name": "fc_deq_tiny"}, "solver": {"name": "anderson"},
    ...              "backward": {"name": "unrolled", "k": 10}})
    ('none', 'unrolled')
"""

from __future__ import annotations

from typing import Any

#: the solver/backward column of a cell whose computation has none (an explicit network; the
#: forward of an unrolled cell without a solver-specific unroll)
NONE = "none"


def cell_labels(sections: dict[str, Any]) -> tuple[str, str]:
    """The ``solver`` and ``backward`` columns of a cell: the computation that produced its
    metrics. An explicit network (:func:`deqbench.models.is_explicit`): ``none``/``none``. A
    model with its own solver: ``own:<name>`` and its backward (or ``not measured`` where it
    reports no statistics; :func:`deqbench.models.own_solver_label`). An ``unrolled`` cell:
    the solver's name only where the solver defines its own differentiable K-step ``unroll``
    (SAM), else ``none`` (K plain steps; the suite's solver is at most a reference for
    analyses that compare with z*)."""
    from .. import models, solvers

    model = str(sections.get("model", {}).get("name", ""))
    solver = str(sections.get("solver", {}).get("name", NONE))
    backward = sections.get("backward", {}) or {}
    bname = str(backward.get("name", "ift"))
    if models.is_explicit(model):
        return NONE, NONE
    params = {k: v for k, v in (sections.get("model") or {}).items() if k != "name"}
    label = models.own_solver_label(model, params)
    if label is not None:
        return label
    if bname == "unrolled":
        try:
            has_unroll = getattr(solvers.get(solver), "unroll", None) is not None
        except Exception:
            has_unroll = False
        return (solver if has_unroll else NONE), bname
    return solver, bname


def _unroll_k(sections: dict[str, Any]) -> int:
    from ..core.deq import BackwardConfig

    k = (sections.get("backward", {}) or {}).get("k", BackwardConfig.k)
    return int(k) if isinstance(k, int) and not isinstance(k, bool) else BackwardConfig.k


def id_head(head: list[str], sections: dict[str, Any]) -> list[str]:
    """The start of a cell id, naming what ran (:func:`cell_labels`): ``<model>`` for an
    explicit network, ``<model>-unrolled<K>`` for K plain unrolled steps (``<model>-sam-
    unrolled<K>`` where the solver unrolls itself), ``<model>-own:<name>-<backward>`` for a
    model with its own solver, else ``<model>-<solver>-<backward>``."""
    solver, backward = cell_labels(sections)
    if solver == NONE and backward == NONE:
        return head[:1]
    if backward == "unrolled":
        tail = f"unrolled{_unroll_k(sections)}"
        return head[:1] + ([solver] if solver != NONE else []) + [tail]
    return [head[0], solver, backward]
