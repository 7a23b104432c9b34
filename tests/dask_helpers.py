"""Test-only model for tests/test_dask.py, registered on import: in the test process, and on
Dask workers through their ``preload`` (so it is there again after a worker restarts).

``test_slow`` sleeps in its first attempt, so that a test can kill that worker from outside.
``test_die`` kills the worker process running it (``os._exit``) while its cell is being built:
``always: true`` on every attempt, otherwise only on the first attempt of its ``key``. Every
attempt appends a line to the marker file :func:`marker` ``(key)``. It never kills a process
that is not a Dask worker process (the test process itself builds nothing, but be safe).
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import time
from pathlib import Path

from deqbench.core.registry import models


def marker(key: str) -> Path:
    return Path(tempfile.gettempdir()) / f"deqbench-test-dask-{key}"


def _in_worker_process() -> bool:
    if multiprocessing.parent_process() is None:
        return False
    try:
        from distributed import get_worker

        get_worker()
    except (ImportError, ValueError):
        return False
    return True


def test_die(in_shape, num_outputs, key: str = "x", always: bool = False, width: int = 8):
    path = marker(key)
    first = not path.exists()
    with open(path, "a") as fh:
        fh.write(f"{os.getpid()}\n")
    if (always or first) and _in_worker_process():
        os._exit(17)
    return models.create("fc_deq_tiny", in_shape=in_shape, num_outputs=num_outputs, width=width)


def test_slow(in_shape, num_outputs, key: str = "x", seconds: float = 30.0, width: int = 8):
    """Appends ``PID WORKER`` (1 in a Dask worker process, else 0: the coordinator checks the
    suite by building its models) to :func:`marker` ``(key)``; on the first attempt of ``key``
    in a worker it then sleeps ``seconds`` while the cell is being built, so that a test can
    kill that worker mid-cell."""
    path = marker(key)
    worker = _in_worker_process()
    first = worker and not (path.exists() and " 1" in path.read_text())
    with open(path, "a") as fh:
        fh.write(f"{os.getpid()} {int(worker)}\n")
    if first:
        time.sleep(seconds)
    return models.create("fc_deq_tiny", in_shape=in_shape, num_outputs=num_outputs, width=width)


test_die.__test__ = False  # type: ignore[attr-defined]  # not a pytest test
test_slow.__test__ = False  # type: ignore[attr-defined]

if "test_die" not in models:
    models.add("test_die", test_die)
if "test_slow" not in models:
    models.add("test_slow", test_slow)
