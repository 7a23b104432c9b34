"""Executors for :func:`deqbench.runner.run_suite` beyond the inline one.

An executor is any object with ``run(tasks, listener=None)`` yielding
:class:`~deqbench.task.TaskResult` in any order (:class:`deqbench.runner.Executor`); the
coordinator alone writes the run directory. :func:`make_executor` builds one from the CLI's
``--executor/--scheduler/--workers`` options.

Example:
    >>> from deqbench.executors import make_executor
    >>> ex = make_executor("dask", workers=2)           # doctest: +SKIP
    >>> deqbench.run_suite(suite, executor=ex)           # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import ConfigError

__all__ = ["EXECUTORS", "make_executor", "open_executor"]

EXECUTORS = ("inline", "dask")


def make_executor(
    name: str = "inline", *, scheduler: str | None = None, workers: int | None = None
) -> Any:
    """The executor called ``name`` (``inline`` | ``dask``).

    Args:
        name: ``inline`` runs cells one by one in this process; ``dask`` runs each (cell, seed)
            as one Dask task (needs the extra ``deqbench[dask]``).
        scheduler: address of a running Dask scheduler to join (``dask`` only).
        workers: number of local workers to start (``dask`` only, without ``scheduler``).

    Raises:
        ConfigError: unknown name, options that do not fit the executor, Dask not installed.
    """
    if name not in EXECUTORS:
        raise ConfigError(f"--executor {name}: unknown executor; use one of {', '.join(EXECUTORS)}")
    if name == "inline":
        if scheduler is not None or workers is not None:
            opt = "--scheduler" if scheduler is not None else "--workers"
            raise ConfigError(f"{opt} needs --executor dask")
        from ..runner import InlineExecutor

        return InlineExecutor()
    from .dask import DaskExecutor

    return DaskExecutor(scheduler=scheduler, workers=workers)


@contextmanager
def open_executor(
    name: str = "inline",
    *,
    scheduler: str | None = None,
    workers: int | None = None,
    suite: Any = None,
) -> Iterator[Any]:
    """:func:`make_executor`, started for ``suite`` (a cluster is up, or its scheduler reached,
    before the run directory is made) and closed on exit. What ``deqbench run`` uses."""
    ex = make_executor(name, scheduler=scheduler, workers=workers)
    start = getattr(ex, "start", None)
    try:
        if start is not None and suite is not None:
            start(suite.resolved_device(), suite.threads)
        yield ex
    finally:
        close = getattr(ex, "close", None)
        if close is not None:
            close()
