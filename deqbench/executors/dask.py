"""Run a suite on a Dask cluster: each (cell, seed) is one Dask task.

``deqbench run SUITE --executor dask`` either joins a running cluster (``--scheduler ADDRESS``:
``dask scheduler`` + ``dask worker``, dask-jobqueue, Kubernetes, ...) or starts a local one:
one worker process per visible GPU, each pinned to its GPU through ``CUDA_VISIBLE_DEVICES``, or
``--workers N`` processes (on CPU, or spread round-robin over the GPUs). Every local worker has
one Dask thread, so it runs one cell at a time.

The coordinator (:func:`deqbench.runner.run_suite`) alone writes the run directory: workers
return :class:`~deqbench.task.TaskResult` objects, which stream back as they finish, so
``results.csv`` has the same atomicity, failure statuses and ``--resume`` semantics as with the
inline executor. The coordinator keeps at most one cell per worker thread in flight (more as
workers join, checked every ``poll`` seconds), so a worker that dies takes down only the cell it
was running. On the local cluster such a cell (Dask's ``KilledWorker``) is submitted once more
when a worker is free, i.e. on another worker or on the dead one's restarted process; if that
one dies too, the cell is recorded as ``error`` with the reason and the run goes on. On a
cluster of yours the scheduler's ``distributed.scheduler.allowed-failures`` decides (Dask's
default 3 restarts; start the scheduler with ``DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES=1``
for the same policy). An exception that escapes the task itself (it cannot be unpickled on the
worker, say) is retried once (``retries=1``).

With Dask's ``distributed.worker.multiprocessing-method: forkserver`` (environment variable
``DASK_DISTRIBUTED__WORKER__MULTIPROCESSING_METHOD=forkserver``) local workers fork from a
server that imported torch and deqbench once, so they start and restart in well under a second
instead of importing torch each (Dask's default, ``spawn``). Only tested on CPU.

Example:
    >>> import deqbench
    >>> from deqbench.executors.dask import DaskExecutor
    >>> suite = deqbench.load_suite("suites/smoke.yaml")                  # doctest: +SKIP
    >>> with DaskExecutor(workers=2) as ex:                                # doctest: +SKIP
    ...     deqbench.run_suite(suite, executor=ex)
    >>> DaskExecutor(scheduler="tcp://10.0.0.5:8786")                     # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import traceback
import uuid
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

from ..errors import ConfigError, DeqbenchError
from ..results import RUNNER
from ..task import Listener, Task, TaskResult, run_task

__all__ = ["DaskExecutor", "run_cell", "failed_result", "gpu_ids", "INSTALL_HINT"]

INSTALL_HINT = "pip install 'deqbench[dask]'"
#: Dask config key of the variables a nanny exports before it spawns a worker process.
PRE_SPAWN_ENV = "distributed.nanny.pre-spawn-environ"

#: Set in the environment of a local worker pinned to one GPU (its id on the host).
PINNED_ENV = "DEQBENCH_DASK_GPU"
#: torch threads of a local worker's cells when the suite does not set ``threads``.
THREADS_ENV = "DEQBENCH_DASK_THREADS"


def _require_distributed() -> Any:
    try:
        import distributed
    except ImportError as exc:
        missing = getattr(exc, "name", None) or "dask.distributed"
        raise ConfigError(
            f"--executor dask needs Dask ({missing} is not installed); install the extra "
            f"deqbench[dask]: {INSTALL_HINT}"
        ) from None
    return distributed


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def gpu_ids(device: str) -> list[str]:
    """The host GPU ids a local cluster pins its workers to for ``device`` (``cuda`` | ``cuda:N``),
    honouring this process's ``CUDA_VISIBLE_DEVICES``; empty for other devices."""
    if not device.startswith("cuda"):
        return []
    import torch

    n = torch.cuda.device_count()
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [x.strip() for x in env.split(",") if x.strip()][:n] if env is not None else []
    if env is None:
        ids = [str(i) for i in range(n)]
    if ":" in device:
        k = int(device.split(":", 1)[1])
        ids = ids[k : k + 1]
    return ids


def run_cell(task: Task) -> TaskResult:
    """Worker side: run one (cell, seed). ``device: auto`` is resolved on the worker (the
    coordinator may have no GPU); a worker pinned to one GPU runs ``cuda``/``cuda:N`` on it."""
    device = task.device
    if task.suite.device == "auto":
        from ..env import resolve_device

        device = resolve_device("auto")
    elif device.startswith("cuda") and os.environ.get(PINNED_ENV):
        device = "cuda"
    if device != task.device:
        task = dataclasses.replace(task, device=device)
    threads = os.environ.get(THREADS_ENV)
    if threads and not task.suite.threads:
        import torch

        torch.set_num_threads(int(threads))
    return run_task(task)


def failed_result(task: Task, note: str, tb: str | None = None, wall: float = 0.0) -> TaskResult:
    """A TaskResult with only the runner's ``error`` status row (the task never returned)."""
    cell = task.cell
    row = {
        "run_id": task.run_id,
        "cell_id": cell.id,
        "model": cell.model["name"],
        "solver": cell.solver["name"],
        "backward": cell.backward.get("name", ""),
        "init": cell.init["name"],
        "seed": task.seed,
        "analysis": RUNNER,
        "variant": "",
        "metric": "wall_time",
        "step": None,
        "repeat": 0,
        "value": wall,
        "unit": "s",
        "status": "error",
        "note": note,
    }
    return TaskResult(cell.id, task.seed, [row], "error", note, tb, wall)


def _warm_forkserver() -> None:
    """With Dask's ``multiprocessing-method: forkserver``, let the forkserver import torch and
    deqbench once so that workers (and restarts after a crash) start warm. No effect once the
    forkserver runs."""
    import multiprocessing

    from distributed.utils import get_mp_context

    get_mp_context()  # Dask sets its own preload list first; ours replaces it
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        ["distributed", "deqbench.executors._warm"]
    )


class DaskExecutor:
    """Runs tasks on a Dask cluster (see the module docstring).

    Args:
        scheduler: address of a running scheduler (``tcp://host:8786``); None starts a local
            cluster on 127.0.0.1.
        workers: local worker processes (default: one per visible GPU when the suite runs on
            CUDA, else ``cpu_count // threads``). Not with ``scheduler``.
        preload: modules or ``.py`` files every local worker imports at start (and again when
            a worker is restarted), e.g. to register models that are not installed as plugins.
            Workers you start yourself take ``dask worker --preload``.
        retries: Dask retries of a task that raised (run_task itself never raises).
        allowed_failures: local cluster: how many times a cell is submitted again after the
            worker running it died (a cluster of yours: its scheduler's
            ``distributed.scheduler.allowed-failures`` decides).
        max_in_flight: cells submitted at once (default: one per worker thread, refreshed
            every ``poll`` seconds).
        connect_timeout: seconds to reach ``scheduler``.
        poll: seconds between checks for workers that joined.
        silence_logs: log level of the local cluster's Dask loggers.
    """

    def __init__(
        self,
        scheduler: str | None = None,
        workers: int | None = None,
        *,
        preload: Sequence[str] = (),
        retries: int = 1,
        allowed_failures: int = 1,
        max_in_flight: int | None = None,
        connect_timeout: float = 30.0,
        poll: float = 1.0,
        silence_logs: int = logging.ERROR,
    ) -> None:
        _require_distributed()
        if scheduler is not None and workers is not None:
            raise ConfigError(
                "--workers starts a local cluster; with --scheduler the cluster's workers are "
                "the ones you started (drop --workers)"
            )
        if workers is not None and workers < 1:
            raise ConfigError(f"--workers {workers}: needs at least 1 worker")
        self.scheduler = scheduler
        self.workers = workers
        self.preload = list(preload)
        self.retries = retries
        self.allowed_failures = allowed_failures
        self.max_in_flight = max_in_flight
        self.connect_timeout = connect_timeout
        self.poll = poll
        self.silence_logs = silence_logs
        self.client: Any = None
        self.cluster: Any = None
        self.layout: dict[str, Any] = {}

    # -- lifecycle ------------------------------------------------------------------------
    def start(self, device: str = "cpu", threads: int | None = None) -> DaskExecutor:
        """Connect to ``scheduler`` or start the local cluster for ``device`` (resolved:
        ``cpu`` | ``cuda`` | ``cuda:N``) with ``threads`` torch threads per cell. Idempotent."""
        if self.client is not None:
            return self
        from distributed import Client

        if self.scheduler is not None:
            try:
                self.client = Client(
                    self.scheduler, timeout=self.connect_timeout, set_as_default=False
                )
            except (OSError, TimeoutError) as exc:
                raise ConfigError(
                    f"--scheduler {self.scheduler}: cannot reach the Dask scheduler "
                    f"({_one_line(exc)})"
                ) from None
            self.layout = {"kind": "dask", "scheduler": self.scheduler}
            return self
        self.cluster = self._local_cluster(device, threads)
        try:
            self.client = Client(self.cluster, set_as_default=False)
        except BaseException:
            self.cluster.close()
            self.cluster = None
            raise
        return self

    def close(self) -> None:
        """Close the client and the local cluster (if this executor started one)."""
        client, cluster = self.client, self.cluster
        self.client = self.cluster = None
        if client is not None:
            try:
                client.close()
            except Exception:  # closing never fails a run
                pass
        if cluster is not None:
            try:
                cluster.close()
            except Exception:
                pass

    def __enter__(self) -> DaskExecutor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def describe(self) -> dict[str, Any]:
        """What ``run.json`` records under ``executor``."""
        info = dict(self.layout) or {"kind": "dask", "scheduler": self.scheduler}
        if self.client is not None:
            try:
                info["scheduler"] = self.client.scheduler.address
                nthreads = self.client.nthreads()
                info["workers_at_start"] = len(nthreads)
                info["threads_at_start"] = int(sum(nthreads.values()))
            except Exception:
                pass
        return info

    def worker_specs(
        self, device: str, threads: int | None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The local cluster's worker specs (``SpecCluster`` form) and its layout (``run.json``).

        One single-threaded worker per GPU of ``device`` (each pinned through
        ``CUDA_VISIBLE_DEVICES``), ``workers`` of them round-robin over the GPUs, or on CPU
        ``workers`` (default ``cpu_count // threads``). Every cell gets ``threads`` torch threads,
        else its share of the cores.
        """
        from distributed import Nanny
        from distributed.worker_memory import parse_memory_limit

        cpus = os.cpu_count() or 1
        gpus = gpu_ids(device)
        if device.startswith("cuda") and not gpus:
            raise ConfigError(f"device {device}: no GPU is visible for the local Dask cluster")
        n = self.workers or (len(gpus) if gpus else max(1, cpus // (threads or 1)))
        # Dask sets OMP_NUM_THREADS=1 in its workers; give each its share of the cores instead.
        omp = str(threads or max(1, cpus // n))
        memory = parse_memory_limit("auto", 1, n, logger=logging.getLogger(__name__))
        specs: dict[str, Any] = {}
        for i in range(n):
            env = {
                "OMP_NUM_THREADS": omp,
                "MKL_NUM_THREADS": omp,
                "OPENBLAS_NUM_THREADS": omp,
                THREADS_ENV: omp,
            }
            if gpus:
                env["CUDA_VISIBLE_DEVICES"] = env[PINNED_ENV] = gpus[i % len(gpus)]
            specs[f"deqbench-{i}"] = {
                "cls": Nanny,
                "options": {
                    "nthreads": 1,
                    "host": "127.0.0.1",
                    "env": env,
                    "preload": ["deqbench.executors._worker", *self.preload],
                    "memory_limit": memory,
                    "dashboard": False,
                    "silence_logs": self.silence_logs,
                },
            }
        layout = {
            "kind": "dask",
            "scheduler": "local",
            "workers": n,
            "gpus": [gpus[i % len(gpus)] for i in range(n)] if gpus else [],
            "torch_threads": int(omp),
            "allowed_failures": self.allowed_failures,
        }
        return specs, layout

    def _local_cluster(self, device: str, threads: int | None) -> Any:
        import dask
        from distributed import Scheduler, SpecCluster

        specs, self.layout = self.worker_specs(device, threads)
        # Dask's nanny exports MALLOC_TRIM_THRESHOLD_=65536 to every worker it spawns (to hand
        # freed memory back to the OS). With PyTorch's allocation pattern glibc then trims on
        # almost every free: a CPU conv forward/backward loop ran 4x slower with it, and smoke
        # tasks 1.4-2.8x slower in workers than inline. Unset it (None removes the variable);
        # a value in the user's own environment is still inherited.
        dask.config.set({f"{PRE_SPAWN_ENV}.MALLOC_TRIM_THRESHOLD_": None})
        if dask.config.get("distributed.worker.multiprocessing-method") == "forkserver":
            _warm_forkserver()
        scheduler = {
            "cls": Scheduler,
            "options": {
                "host": "127.0.0.1",
                "port": 0,
                "dashboard": False,
                "dashboard_address": "127.0.0.1:0",
                "allowed_failures": 0,  # the coordinator resubmits (see run)
            },
        }
        return SpecCluster(
            workers=specs, scheduler=scheduler, silence_logs=self.silence_logs, name="deqbench"
        )

    # -- running --------------------------------------------------------------------------
    def _slots(self) -> int:
        if self.max_in_flight is not None:
            return max(1, self.max_in_flight)
        try:
            return max(1, int(sum(self.client.nthreads().values())))
        except Exception:
            return 1

    def run(self, tasks: Sequence[Task], listener: Listener | None = None) -> Iterator[TaskResult]:
        """Submit the tasks (one Dask task per (cell, seed)) and yield results as they finish.

        ``listener`` is not called: progress is counted by the coordinator per finished cell.
        A local cluster started here is closed at the end; one started with :meth:`start`
        stays up until :meth:`close`.
        """
        if not tasks:
            return
        from distributed import KilledWorker, wait

        owned = self.client is None
        if owned:
            self.start(tasks[0].device, tasks[0].suite.threads)
        client = self.client
        # Our local scheduler gives up on a task at its first dead worker; the cell is then
        # submitted again here, once a worker is free (never queued behind a busy one).
        resubmit = self.allowed_failures if self.cluster is not None else 0
        # Ship the suite without its cells: every task carries its own cell.
        slim = {id(t.suite): dataclasses.replace(t.suite, cells=[]) for t in tasks}
        token = uuid.uuid4().hex[:8]
        # (index, task, attempt, first submission time)
        queue: deque[tuple[int, Task, int, float | None]] = deque(
            (i, t, 0, None) for i, t in enumerate(tasks)
        )
        inflight: dict[Any, tuple[int, Task, int, float]] = {}

        def fill() -> None:
            slots = self._slots()
            while queue and len(inflight) < slots:
                i, t, attempt, t0 = queue.popleft()
                wire = dataclasses.replace(t, suite=slim[id(t.suite)])
                fut = client.submit(
                    run_cell,
                    wire,
                    key=f"deqbench_cell-{token}-{i}-{attempt}",
                    retries=self.retries,
                    pure=False,
                )
                inflight[fut] = (i, t, attempt, time.perf_counter() if t0 is None else t0)

        try:
            fill()
            while inflight:
                try:
                    with client.as_current():  # wait() looks up the current client
                        wait(list(inflight), timeout=self.poll, return_when="FIRST_COMPLETED")
                except TimeoutError:
                    fill()  # workers may have joined
                    continue
                done = sorted((f for f in inflight if f.done()), key=lambda f: inflight[f][0])
                results = []
                for fut in done:
                    i, t, attempt, t0 = inflight.pop(fut)
                    if (
                        fut.status == "error"
                        and attempt < resubmit
                        and isinstance(fut.exception(), KilledWorker)
                    ):
                        fut.release()
                        queue.appendleft((i, t, attempt + 1, t0))
                        continue
                    results.append(self._collect(fut, t, time.perf_counter() - t0, attempt + 1))
                    fut.release()
                # The freed workers get their next cells before the caller writes these results
                # (a worker never idles while the coordinator writes results.csv).
                fill()
                yield from results
        finally:
            if inflight and self.client is not None:
                try:
                    self.client.cancel(list(inflight), force=True)
                except Exception:
                    pass
            if owned:
                self.close()

    def _collect(self, fut: Any, task: Task, wall: float, submissions: int) -> TaskResult:
        from distributed import KilledWorker

        if fut.status == "finished":
            try:
                return fut.result()
            except Exception as err:  # e.g. the result cannot be unpickled here
                return failed_result(task, f"dask: {_one_line(err)}", traceback.format_exc(), wall)
        if fut.status == "cancelled":
            where = f" ({task.run_dir})" if task.run_dir else ""
            raise DeqbenchError(
                f"the Dask cluster cancelled cell {task.cell.id} seed={task.seed} (scheduler "
                f"lost?); finished cells are on disk{where}: rerun the same command with "
                f"--resume {task.run_dir or 'RUN_DIR'}"
            )
        exc = fut.exception()
        if isinstance(exc, KilledWorker):
            try:
                last = exc.last_worker.address
                tries = str(submissions * (exc.allowed_failures + 1))
            except Exception:
                last, tries = "?", "several"
            note = (
                f"worker died running this cell ({tries} attempts, the last on {last}; "
                "KilledWorker): see the worker logs"
            )
            return failed_result(task, note, None, wall)
        tb = "".join(traceback.format_exception(type(exc), exc, fut.traceback()))
        return failed_result(task, f"dask: {_one_line(exc)}", tb, wall)
