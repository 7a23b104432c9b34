"""Post-run reports: functions the runner calls on every finished run directory, after the
plots, that write a file of their own beside ``results.csv`` (the claim summary
``summary.csv`` of :mod:`deqbench.outcomes` is one).

A report registers with ``@reports.register("name")`` in its own module, as a plot does with
``@plots.register``. The runner names none of them: :data:`registry` (a
:class:`~deqbench.core.registry.Registry` of kind ``reports``) imports its built-ins from the
modules the source index (:mod:`deqbench.core.index`) finds registering one, and plugins add
theirs through the entry-point group ``deqbench.reports``. A report that raises never fails a
run: :func:`write_reports` returns its error line for the run's log and goes on with the next.

Example:
    >>> from deqbench.run import reports
    >>> @reports.register("row_count")                           # doctest: +SKIP
    ... def row_count(run_dir):
    ...     n = sum(1 for _ in open(run_dir / "results.csv")) - 1
    ...     (run_dir / "row_count.txt").write_text(f"{n}\\n")
    >>> reports.write_reports("results/smoke/<run_id>")          # doctest: +SKIP
    []
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..core.registry import Registry

#: ``fn(run_dir)``; its return value is ignored
ReportFn = Callable[[Path], Any]
registry: Registry[ReportFn] = Registry("reports", __name__, singular="post-run report")
register = registry.register
names = registry.names
get = registry.get


def builtin_modules() -> list[str]:
    """The modules of the package that register a report, found in the source by
    :mod:`deqbench.core.index` (imported by :data:`registry` on first use)."""
    from ..core.index import modules

    return modules("reports")


def write_reports(run_dir: str | Path) -> list[str]:
    """Call every registered report on ``run_dir``, in the order of :func:`names`; returns the
    error lines (``NAME: ExceptionType: message``) of those that failed or could not load."""
    run_dir = Path(run_dir)
    try:
        listed = names()
    except Exception as exc:  # a report module that cannot be imported: the run goes on
        return [f"reports: {type(exc).__name__}: {exc}"]
    errors = []
    for name in listed:
        try:
            get(name)(run_dir)
        except Exception as exc:  # a report never fails a run
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
    return errors
