"""Executors for :func:`deqbench.run.runner.run_suite` beyond the inline one.

An executor is any object with ``run(tasks, listener=None)`` yielding
:class:`~deqbench.run.task.TaskResult` in any order (:class:`deqbench.run.runner.Executor`); the
coordinator alone writes the run directory. :func:`make_executor` builds one from the CLI's
``--executor/--scheduler/--workers`` options.

Example:
    >>> from deqbench.run.executors import make_executor
    >>> ex = make_executor("dask", workers=2)           # doctest: +SKIP
    >>> deqbench.run_suite(suite, executor=ex)           # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ...core.errors import ConfigError

__all__ = ["EXECUTORS", "make_executor", "open_executor", "prestart"]

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


def prestart(
    name: str,
    *,
    scheduler: str | None = None,
    workers: int | None = None,
    path: str | Path,
    device: str | None = None,
    overrides: Sequence[str] = (),
) -> Any | None:
    """Start a local Dask cluster in the background before the suite is validated (what
    ``deqbench run --executor dask`` does first), so that its workers start and warm up while
    the coordinator validates the suite, writes the run directory and builds the tasks.

    The device, ``threads`` and ``dtype`` are read from the suite file and the command's
    ``--device`` / ``--set`` without validating anything; :func:`open_executor` checks them
    against the validated suite and starts a fresh cluster if they differ. Returns None (and
    starts nothing) for other executors, ``--scheduler``, collection files or a file that does
    not read as a mapping; the normal path then reports any problem."""
    if name != "dask" or scheduler is not None or (workers is not None and workers < 1):
        return None
    try:
        from ..yamlio import read_yaml  # the size, depth and alias limits of every suite read

        raw, _ = read_yaml(path)
        if not isinstance(raw, dict) or "suites" in raw:
            return None
        over = dict(o.split("=", 1) for o in overrides if "=" in o)
        threads: str | int | None = over.get("threads", raw.get("threads"))
        threads = int(threads) if threads not in (None, "", "null") else None
        dtype = str(over.get("dtype") or raw.get("dtype") or "float32")
        from ..env import resolve_device

        # from the driver where it can: importing torch here would hold back the workers'
        # start by its import time (4 s on a GPU host)
        dev = resolve_device(
            str(device or over.get("device") or raw.get("device") or "auto"), quick=True
        )
        from importlib.util import find_spec

        if dev.startswith("cuda") and find_spec("distributed") is not None:
            # before this process imports distributed or torch: the server imports them for the
            # workers meanwhile (._forkserver)
            from ._forkserver import start_method, use_method

            use_method(start_method(gpu=True))
        ex = make_executor(name, scheduler=scheduler, workers=workers)
    except Exception:  # noqa: BLE001 - validation reports it properly
        return None
    try:
        ex.start(dev, threads, dtype=dtype, wait=False)
    except Exception:  # noqa: BLE001 - e.g. no GPU visible: open_executor reports it
        ex.close()
        return None
    ex.started_for = (dev, threads)
    return ex


@contextmanager
def open_executor(
    name: str = "inline",
    *,
    scheduler: str | None = None,
    workers: int | None = None,
    suite: Any = None,
    started: Any = None,
) -> Iterator[Any]:
    """:func:`make_executor`, started for ``suite`` and closed on exit. What ``deqbench run``
    uses. A scheduler given by address is reached before the run directory is made; a local
    cluster starts in the background while the coordinator writes the run directory and builds
    the tasks (the executor's ``run`` waits for it). ``started``: an executor from
    :func:`prestart`, used when it was started for the suite's device and threads (else
    closed)."""
    if started is not None:
        want = (suite.resolved_device(), suite.threads) if suite is not None else None
        if getattr(started, "started_for", None) == want:
            started.release_when_done = True  # this run is its only one
            try:
                yield started
            finally:
                started.close()
            return
        started.close()
    ex = make_executor(name, scheduler=scheduler, workers=workers)
    start = getattr(ex, "start", None)
    try:
        if start is not None and suite is not None:
            start(suite.resolved_device(), suite.threads, dtype=suite.dtype, wait=False)
        if hasattr(ex, "release"):
            ex.release_when_done = True  # this run is its only one
        yield ex
    finally:
        close = getattr(ex, "close", None)
        if close is not None:
            close()
