"""How a local Dask cluster's nannies start their worker processes, and a forkserver started
before anything heavy is imported.

On a GPU a worker's start is the run's critical path: the coordinator imports ``distributed``
before its nannies spawn anything (about 3 s on a GPU host), then each spawned worker imports
``distributed`` again, torch, ``torch._dynamo`` (the first optimiser) and warms up (11 s). With a
**forkserver** started by :func:`start_forkserver` as the command begins (before the coordinator
imports ``distributed`` or torch), those imports run once, in the server, while the coordinator
validates the suite; every worker, and every restart after a crash, forks from it with them done
and only creates its CUDA context and first kernels. The server never touches CUDA (workers choose
their GPU after the fork: ``CUDA_VISIBLE_DEVICES`` is read at CUDA's initialisation).

:func:`start_method`: Dask's ``distributed.worker.multiprocessing-method`` where the user set it
(a Dask config file, ``DASK_DISTRIBUTED__WORKER__MULTIPROCESSING_METHOD``, or ``dask.config.set``
to something other than Dask's default ``spawn``), else ``forkserver`` on GPUs and ``spawn`` on
CPU (there the server's imports would compete with the coordinator's for few cores). A process
that started a GPU cluster keeps the forkserver for its later local clusters.

This module imports neither ``distributed`` nor torch.
"""

from __future__ import annotations

import multiprocessing
from typing import Any

#: what the forkserver imports before it forks a worker (``_warm``: torch, the registries, the
#: data/task/train modules, ``torch._dynamo`` through a first optimiser; never CUDA)
PRELOAD = ["distributed", "deqbench.run.executors._warm"]
METHOD_KEY = "distributed.worker.multiprocessing-method"


def user_method() -> str | None:
    """The start method the user chose through Dask's configuration, or None."""
    try:
        import dask.config
    except ImportError:  # pragma: no cover - the dask extra is missing: reported elsewhere
        return None
    collected = dask.config.collect()  # config files and DASK_* variables, no defaults
    chosen = dask.config.get(METHOD_KEY, None, config=collected)
    if chosen:
        return str(chosen)
    current = dask.config.get(METHOD_KEY, None)  # dask.config.set in this process
    return str(current) if current not in (None, "spawn") else None


def start_method(gpu: bool) -> str:
    """The start method of a local cluster's worker processes (see the module docstring)."""
    forks = "forkserver" in multiprocessing.get_all_start_methods()  # not on Windows
    return user_method() or ("forkserver" if gpu and forks else "spawn")


def use_method(method: str) -> None:
    """Set Dask's start method for this process's nannies (read at every worker start and
    restart), and start the forkserver for ``forkserver``. Once set to ``forkserver`` (a GPU
    cluster), later local clusters of the process, on CPU too, keep it."""
    import dask.config

    if dask.config.get(METHOD_KEY, None) != method:
        dask.config.set({METHOD_KEY: method})
    if method == "forkserver":
        start_forkserver()


def start_forkserver() -> None:
    """Start the forkserver with :data:`PRELOAD` now, unless it runs already. Cheap here (one
    process launched); the server imports in the background and answers the first fork once it
    is done."""
    from multiprocessing import forkserver

    server: Any = getattr(forkserver, "_forkserver", None)
    running = getattr(server, "_forkserver_pid", None) is not None
    if not running:  # a running server keeps the preload it started with
        multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()
