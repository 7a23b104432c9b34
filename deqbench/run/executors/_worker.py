"""Preloaded by every Dask worker of deqbench: by the local cluster's workers, and by workers
you start yourself with ``dask worker ... --preload deqbench.run.executors.worker``.

At worker start, before the worker registers with the scheduler (so before its first cell):

* **Warm-up**: :func:`deqbench.run.task.warm_up` pays the process's one-off costs (imports,
  CUDA context, cuBLAS/cuDNN handles, the first DEQ forward/backward kernels) on the worker's
  device; the time is reported on the ``process`` / ``warmup_time`` row of the worker's first
  cell and is never part of a cell's ``wall_time``. ``DEQBENCH_WARMUP`` chooses it:
  ``off``, ``DTYPE`` or ``DEVICE:DTYPE`` (default ``auto:float32``: CUDA when a GPU is
  visible). On a GPU, cuBLAS is used here for the first time, so the worker's
  ``CUBLAS_WORKSPACE_CONFIG`` is set first (``:4096:8`` unless the environment sets one): the
  setting ``deterministic: true`` needs, which cuBLAS reads once per process.
* **Ctrl-C**: a worker started by a nanny ignores SIGINT. Ctrl-C sends it to the whole process
  group; the coordinator handles it (finished cells are on disk, the rest is cancelled and the
  cluster closed) and the nanny stops its worker, instead of every worker dying with tracebacks
  of its own.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
from typing import Any

#: ``off`` | ``DTYPE`` | ``DEVICE:DTYPE`` (default ``auto:float32``)
WARMUP_ENV = "DEQBENCH_WARMUP"
CUBLAS_DETERMINISTIC = ":4096:8"

log = logging.getLogger("deqbench.worker")

#: this worker process's start-up in epoch seconds: ``process_start`` (its creation),
#: ``warmup_start``, ``warmup_end``; attached to every task result it returns
#: (:mod:`deqbench.run.timeline`)
WORKER_TIMES: dict[str, float] = {}


def _process_start() -> float | None:
    try:
        import psutil  # a dependency of distributed

        return float(psutil.Process().create_time())
    except Exception:  # noqa: BLE001 - informational
        return None


def parse_warmup(spec: str | None) -> tuple[str, str] | None:
    """``DEQBENCH_WARMUP`` -> (device, dtype), or None for ``off``.

    >>> parse_warmup(None), parse_warmup("cuda:float64"), parse_warmup("off")
    (('auto', 'float32'), ('cuda', 'float64'), None)
    """
    spec = (spec or "").strip()
    if spec.lower() in ("off", "0", "no", "false", "none"):
        return None
    device, _, dtype = spec.rpartition(":")
    return device or "auto", dtype or "float32"


def warm_up_worker() -> float | None:
    """The worker's warm-up (see the module docstring); seconds, or None when off or failed
    (a failed warm-up never stops the worker: its first cell warms up and reports any error)."""
    import time

    started = _process_start()
    if started is not None:
        WORKER_TIMES["process_start"] = started
    WORKER_TIMES["warmup_start"] = time.time()
    parsed = parse_warmup(os.environ.get(WARMUP_ENV))
    if parsed is None:
        WORKER_TIMES["warmup_end"] = WORKER_TIMES["warmup_start"]
        return None
    try:
        import torch

        from ..env import resolve_device
        from ..task import warm_up

        device = resolve_device(parsed[0])
        if device.startswith("cuda"):
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC)
        took = warm_up(device, getattr(torch, parsed[1]))
    except Exception as exc:  # noqa: BLE001 - reported by the first cell instead
        log.warning("deqbench warm-up failed (%s); the first cell warms up", exc)
        return None
    finally:
        WORKER_TIMES["warmup_end"] = time.time()
    if took is not None:
        log.info("deqbench warm-up on %s %s: %.2f s", device, parsed[1], took)
    return took


async def dask_setup(worker: Any) -> None:
    if multiprocessing.parent_process() is not None:  # under a nanny (not --no-nanny)
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        except ValueError:  # not the main thread (in-process workers): leave it
            pass
    # In the thread that runs the worker's cells: PyTorch keeps cuBLAS/cuDNN handles per thread.
    executor = getattr(worker, "executors", {}).get("default")
    if executor is None:
        warm_up_worker()
    else:
        await asyncio.get_running_loop().run_in_executor(executor, warm_up_worker)
