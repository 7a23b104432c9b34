"""The worker side of the Dask executor: :func:`run_cell` runs one (cell, seed) on a worker
(its placed device, or ``device: auto`` resolved there on a cluster of yours, a pinned worker's
GPU, its thread count, the timing of where and when), :func:`gpu_memory` reports the worker's
GPU memory and :func:`_pinned_gpu` the GPU it is pinned to. :mod:`deqbench.run.executors.dask` submits them.
"""

from __future__ import annotations

import dataclasses
import os
import time

from ..task import Task, TaskResult, run_task
from ._worker import WORKER_TIMES

#: Set in the environment of a local worker pinned to one GPU (its id on the host).
PINNED_ENV = "DEQBENCH_DASK_GPU"
#: torch threads of a local worker's cells when the suite does not set ``threads``.
THREADS_ENV = "DEQBENCH_DASK_THREADS"
#: a pinned GPU worker measures its GPU's busy fraction over its first this many cells
BUSY_TASKS = 2
_TASKS_RUN = [0]  # cells this worker process ran


def run_cell(task: Task) -> TaskResult:
    """Worker side: run one (cell, seed). On a local worker a cell runs on the device it was
    placed on (``device: auto``: :mod:`deqbench.run.placement`); on a worker of a cluster of
    yours ``device: auto`` is resolved there (the coordinator may have no GPU). A worker pinned
    to one GPU runs ``cuda``/``cuda:N`` on it."""
    device = task.device
    if task.suite.device == "auto" and not os.environ.get(THREADS_ENV):
        from ..env import resolve_device

        device = resolve_device("cuda_if_available")
    elif device.startswith("cuda") and os.environ.get(PINNED_ENV):
        device = "cuda"
    if device != task.device:
        task = dataclasses.replace(task, device=device)
    threads = os.environ.get(THREADS_ENV)
    if threads and not task.suite.threads:
        import torch

        torch.set_num_threads(int(threads))
    received = time.time()
    k = _TASKS_RUN[0]
    _TASKS_RUN[0] += 1
    meter = None
    if k < BUSY_TASKS and os.environ.get(PINNED_ENV) and device.startswith("cuda"):
        from ..env import GpuBusy

        meter = GpuBusy().start()
    result = run_task(task)
    timing = getattr(result, "timing", None)
    if isinstance(timing, dict):  # where and when (deqbench.run.timeline)
        timing["worker_received"] = received
        timing["worker_task"] = k
        if meter is not None:  # the grouping decision reads it (DaskExecutor.add_gpu_workers)
            timing["gpu_busy"] = meter.stop()
        timing.update(WORKER_TIMES)  # the worker's own start-up
        try:
            from distributed import get_worker

            w = get_worker()
            timing["worker"] = str(w.name if w.name is not None else w.address)
        except (ImportError, ValueError):
            pass
    return result


def gpu_memory() -> dict[str, int]:
    """Worker side: this process's peak reserved GPU memory and its GPU's free/total bytes
    (empty without CUDA). The coordinator asks for it before it adds workers to a GPU."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    free, total = torch.cuda.mem_get_info()
    return {"peak": int(torch.cuda.max_memory_reserved()), "free": int(free), "total": int(total)}


def _pinned_gpu() -> str | None:
    return os.environ.get(PINNED_ENV)
