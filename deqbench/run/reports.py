"""Post-run reports: functions the runner calls on every finished run directory, after the
plots, that write a file of their own beside ``results.csv`` (the claim summary
``summary.csv`` of :mod:`deqbench.outcomes` is one).

A report registers with ``@reports.register("name")`` in its own module, as a plot does with
``@plots.register``. The runner names none of them: the source index
(:mod:`deqbench.core.index`, kind ``reports``) finds the modules of the package that register
one, and :func:`load_builtins` imports them by name the first time the reports are listed. A
report that raises never fails a run: :func:`write_reports` returns its error line for the run's
log and goes on with the next.

Example:
    >>> from deqbench.run import reports
    >>> @reports.register("row_count")
    ... def row_count(run_dir):
    ...     n = sum(1 for _ in open(run_dir / "results.csv")) - 1
    ...     (run_dir / "row_count.txt").write_text(f"{n}\\n")
    >>> reports.write_reports("results/smoke/<run_id>")  # doctest: +SKIP
    []
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: ``fn(run_dir)``; its return value is ignored
ReportFn = Callable[[Path], Any]
_REGISTRY: dict[str, ReportFn] = {}
_LOADED: list[str] = []  # the built-in report modules imported so far


def register(name: str) -> Callable[[ReportFn], ReportFn]:
    """Register ``fn(run_dir)`` under ``name``: called after every run's plots."""

    def deco(fn: ReportFn) -> ReportFn:
        _REGISTRY[name] = fn
        return fn

    return deco


def load_builtins() -> list[str]:
    """Import the package's modules that register a report (found by the source index, once);
    returns an error line for each that cannot be imported."""
    from ..core.index import modules

    errors = []
    for module in modules("reports"):
        if module in _LOADED:
            continue
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - one broken report never stops the others
            errors.append(f"reports: {module} cannot be imported: {type(exc).__name__}: {exc}")
            continue
        _LOADED.append(module)
    return errors


def names() -> list[str]:
    """The registered reports (the built-ins imported first), sorted."""
    load_builtins()
    return sorted(_REGISTRY)


def get(name: str) -> ReportFn:
    load_builtins()
    return _REGISTRY[name]


def write_reports(run_dir: str | Path) -> list[str]:
    """Call every registered report on ``run_dir``, in the order of :func:`names`; returns the
    error lines (``NAME: ExceptionType: message``) of those that failed or could not load."""
    run_dir = Path(run_dir)
    errors = load_builtins()
    for name in sorted(_REGISTRY):
        try:
            _REGISTRY[name](run_dir)
        except Exception as exc:  # a report never fails a run
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
    return errors
