"""Run a suite on a Dask cluster: each (cell, seed) is one Dask task.

``deqbench run SUITE --executor dask`` either joins a running cluster (``--scheduler ADDRESS``:
``dask scheduler`` + ``dask worker``, dask-jobqueue, Kubernetes, ...) or starts a local one:
one worker process per visible GPU, each pinned to its GPU through ``CUDA_VISIBLE_DEVICES``, or
``--workers N`` processes (on CPU, or spread round-robin over the GPUs). Every local worker has
one Dask thread, so it runs one cell at a time.

The coordinator (:func:`deqbench.run.runner.run_suite`) alone writes the run directory: workers
return :class:`~deqbench.run.task.TaskResult` objects, which stream back as they finish, so
``results.csv`` has the same atomicity, failure statuses and ``--resume`` semantics as with the
inline executor. The coordinator keeps at most one cell per worker thread in flight (more as
workers join, checked every ``poll`` seconds), so a worker that dies takes down only the cell it
was running. On the local cluster such a cell (Dask's ``KilledWorker``) is submitted once more
when a worker is free, i.e. on another worker or on the dead one's restarted process; if that
one dies too, the cell is recorded as ``error`` with the reason and the run goes on. On a
cluster of yours the scheduler's ``distributed.scheduler.allowed-failures`` decides (Dask's
default 3 restarts; start the scheduler with ``DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES=1``
for the same policy). Either way each cell a dead worker took down is one line in the run's
``log.txt`` (cell, seed, worker and cause): resubmitted here, or, on a cluster of yours, the
scheduler's ``remove-worker`` event (the coordinator subscribes to its ``all`` topic). An
exception that escapes the task itself (it cannot be unpickled on the worker, say) is retried
once (``retries=1``).

Fixed costs are paid off the cells' clock and overlap the coordinator's own start: the local
cluster starts in the background (:meth:`DaskExecutor.start` with ``wait=False``, as ``deqbench
run`` does) while the coordinator writes the run directory and builds the tasks, and every
worker warms up at start, before it registers (imports, CUDA context, first kernels:
:mod:`deqbench.run.executors.worker`, reported on its first cell's ``process`` rows). Short cells
are grouped: on a local GPU cluster whose first cells (a few per worker) took less than
``short_task`` seconds each and whose GPUs one worker leaves idle enough (``max_busy``), a second
worker joins on every GPU with room in its memory, so that two cells share each GPU (small
models leave most of a GPU idle between their kernel launches);
every Dask task is still one cell, so a dead worker costs only the cell it was running.

On GPUs local workers fork from a forkserver that imported ``distributed``, torch and deqbench
once (:mod:`._forkserver`; ``deqbench run`` launches it before importing them itself), so they
start and restart without those imports; Dask's ``distributed.worker.multiprocessing-method`` wins
where the user set it (e.g. ``DASK_DISTRIBUTED__WORKER__MULTIPROCESSING_METHOD=forkserver`` on
CPU, where Dask's default ``spawn`` is kept). A second worker joins a GPU only where the first
left it idle (:meth:`DaskExecutor.add_gpu_workers`, ``max_busy``).

Example:
    >>> import deqbench
    >>> from deqbench.run.executors.dask import DaskExecutor
    >>> suite = deqbench.load_suite("suites/smoke.yaml")                  # doctest: +SKIP
    >>> with DaskExecutor(workers=2) as ex:                                # doctest: +SKIP
    ...     deqbench.run_suite(suite, executor=ex)
    >>> DaskExecutor(scheduler="tcp://10.0.0.5:8786")                     # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import logging
import os
import statistics
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ...core.errors import ConfigError, DeqbenchError
from ..results import FLAGGED, RUNNER
from ..schedule import CostModel, known_costs, lpt_order, static_cost
from ..task import Listener, Task, TaskResult
from ._worker import WARMUP_ENV
from .dask_cell import PINNED_ENV, THREADS_ENV, _pinned_gpu, gpu_memory, run_cell

__all__ = ["DaskExecutor", "run_cell", "failed_result", "gpu_ids", "INSTALL_HINT"]

INSTALL_HINT = "pip install 'deqbench[dask]'"
#: Dask config key of the variables a nanny exports before it spawns a worker process.
PRE_SPAWN_ENV = "distributed.nanny.pre-spawn-environ"

#: GPU memory (bytes) counted per worker process beyond its cells' peak (CUDA context, handles)
CONTEXT_BYTES = 1 << 30
#: statuses whose wall time measures a whole cell (the grouping decision reads them)
TIMED = ("ok", FLAGGED)


#: seconds of estimated remaining work per worker above which a second worker joins each GPU
MIN_REMAINING_S = 20.0


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
    from ..env import visible_gpu_count

    n = visible_gpu_count() or 0  # without importing torch where the driver answers
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [x.strip() for x in env.split(",") if x.strip()][:n] if env is not None else []
    if env is None:
        ids = [str(i) for i in range(n)]
    if ":" in device:
        k = int(device.split(":", 1)[1])
        ids = ids[k : k + 1]
    return ids


def failed_result(task: Task, note: str, tb: str | None = None, wall: float = 0.0) -> TaskResult:
    """A TaskResult with only the runner's ``error`` status row (the task never returned)."""
    row = {
        **task.row_base(),
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
    return TaskResult(task.cell.id, task.seed, [row], "error", note, tb, wall)


def _last_worker(exc: BaseException) -> str:
    """The address of the worker a ``KilledWorker`` last died on (``?`` if unknown)."""
    try:
        return str(exc.last_worker.address)  # type: ignore[attr-defined]
    except Exception:
        return "?"


def _log_task(task: Task, text: str) -> None:
    """One line about ``task`` in its run's ``log.txt`` (coordinator side, as the runner's)."""
    if task.run_dir:
        from ..runner import _log

        _log(Path(task.run_dir), f"{task.cell.id} seed={task.seed}: {text}")


def _watch_removed_workers(
    client: Any, keys: dict[str, Task], lost: deque[tuple[str, str, bool]]
) -> bool:
    """Subscribe ``client`` to the scheduler's ``remove-worker`` events (topic ``all``): the
    keys of ``keys`` that a removed worker was running go to ``lost`` as ``(worker, key,
    expected)`` (the handler runs in the client's event-loop thread; the coordinator logs them).
    False when the subscription fails (an old scheduler): nothing is logged then."""

    def handler(event: Any) -> None:
        try:
            msg = event[1]
            if not isinstance(msg, dict) or msg.get("action") != "remove-worker":
                return
            for key in msg.get("processing-tasks") or ():
                if str(key) in keys:
                    lost.append((str(msg.get("worker", "?")), str(key), bool(msg.get("expected"))))
        except Exception:  # a log line is never worth a failed run
            pass

    try:
        client.subscribe_topic("all", handler)
    except Exception:
        return False
    return True


class DaskExecutor:
    """Runs tasks on a Dask cluster (see the module docstring).

    Args:
        scheduler: address of a running scheduler (``tcp://host:8786``); None starts a local
            cluster on 127.0.0.1.
        workers: local worker processes (default: one per visible GPU when the suite runs on
            CUDA, else ``cpu_count // threads``). Not with ``scheduler``. Fixes the layout: no
            worker is added for short cells.
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
        max_per_gpu: local GPU cluster without ``workers``: at most this many workers share a
            GPU once the first cells turned out short (1: never add workers).
        short_task: seconds; first cells (median, one per worker) shorter than this are short.
        max_busy: no worker is added where the GPUs were busy (a kernel running) this fraction
            of the workers' second cells or more (NVML's utilisation samples; not measured
            without NVML: then the cells' times alone decide).
        profile: keep Dask's statistical profiler on in local workers (off by default: it
            samples the cell's thread every 10 ms, taking the GIL from it).
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
        max_per_gpu: int = 2,
        short_task: float = 20.0,
        max_busy: float = 0.6,
        profile: bool = False,
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
        self.max_per_gpu = max(1, max_per_gpu)
        self.short_task = short_task
        self.max_busy = max_busy
        self.profile = profile
        self.client: Any = None
        self.cluster: Any = None
        self.layout: dict[str, Any] = {}
        self._starting: threading.Thread | None = None
        self._start_error: BaseException | None = None
        self._closing: threading.Thread | None = None  # release(): closing in the background
        self._final_info: dict[str, Any] | None = None  # describe() as the run ended
        self._specs: dict[str, Any] = {}
        self._dtype = "float32"
        #: epoch seconds of the cluster's start (``cluster_start``, ``cluster_ready``) and the
        #: seconds the coordinator waited for it (``cluster_wait_s``): run.json ``timeline``
        self.timeline: dict[str, float] = {}
        #: (cell id, seed, priority) of every submission of the last :meth:`run`, in order
        self.submitted: list[tuple[str, int, int]] = []

    # -- lifecycle ------------------------------------------------------------------------
    def start(
        self,
        device: str = "cpu",
        threads: int | None = None,
        *,
        dtype: str | None = None,
        wait: bool = True,
    ) -> DaskExecutor:
        """Connect to ``scheduler`` or start the local cluster for ``device`` (resolved:
        ``cpu`` | ``cuda`` | ``cuda:N``) with ``threads`` torch threads per cell; its workers
        warm up on ``dtype`` (default float32) at start. Idempotent.

        ``wait=False`` starts a local cluster in a background thread and returns at once (the
        layout is checked first, so a configuration error is raised here); :meth:`run` waits
        for it. Reaching a ``scheduler`` is always done before returning."""
        if self.client is not None or self._starting is not None:
            if wait:
                self._ready()
            return self
        from distributed import Client

        self._final_info = None  # a cluster released by an earlier run is not this one
        self.timeline = {"cluster_start": time.time()}
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
            self.timeline["cluster_ready"] = time.time()
            return self
        self._dtype = dtype or "float32"
        specs, self.layout = self.worker_specs(device, threads)
        if wait:
            self._start_local(specs)
            return self
        self._start_error = None

        def target() -> None:
            try:
                self._start_local(specs)
            except BaseException as exc:  # re-raised by _ready() in the caller's thread
                self._start_error = exc

        self._starting = threading.Thread(target=target, name="deqbench-dask-start", daemon=True)
        self._starting.start()
        return self

    def _start_local(self, specs: dict[str, Any]) -> None:
        from distributed import Client

        cluster = self._local_cluster(specs)
        try:
            self.client = Client(cluster, set_as_default=False)
        except BaseException:
            cluster.close()
            raise
        self.cluster = cluster
        # SpecCluster returns once its workers run: each warmed up before it registered
        self.timeline["cluster_ready"] = time.time()

    def _ready(self) -> None:
        """Wait for a background start (``start(wait=False)``); re-raise its error."""
        thread, self._starting = self._starting, None
        if thread is not None:
            t = time.perf_counter()
            thread.join()
            self.timeline["cluster_wait_s"] = time.perf_counter() - t
        if self._start_error is not None:
            err, self._start_error = self._start_error, None
            raise err

    #: the cells run in other processes: the coordinator may prepare its plots meanwhile
    remote = True

    @property
    def uses_local_cores(self) -> bool:
        """A local cluster on CPU: its workers use this machine's cores (no plot pool beside
        them)."""
        return self.scheduler is None and not self.layout.get("gpus")

    #: set by :func:`~deqbench.run.executors.open_executor` (``deqbench run``), whose executor
    #: serves one run: the runner then calls :meth:`release` once the last task returned
    release_when_done = False

    def release(self) -> None:
        """Start closing the client and the local cluster in a background thread (the
        coordinator draws the plots meanwhile); :meth:`close` waits for it. The layout is kept
        for :meth:`describe`."""
        if self._closing is not None:
            return
        self._final_info = self.describe()
        self.release_when_done = False  # a later run on this executor starts a fresh cluster
        self.timeline["released"] = time.time()
        self._closing = threading.Thread(
            target=self._close_now, name="deqbench-dask-close", daemon=True
        )
        self._closing.start()

    def close(self) -> None:
        """Close the client and the local cluster (if this executor started one)."""
        closing, self._closing = self._closing, None
        if closing is not None:
            closing.join()
        self._close_now()

    def _close_now(self) -> None:
        if self._starting is not None:
            self._starting.join()
            self._starting = None
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
        """What ``run.json`` records under ``executor`` (never waits for a background start)."""
        if self._final_info is not None and (self._closing is not None or self.client is None):
            return dict(self._final_info)  # released: the cluster as the run ended
        info = dict(self.layout) or {"kind": "dask", "scheduler": self.scheduler}
        if self.client is not None and self._starting is None:
            try:
                info["scheduler"] = self.client.scheduler.address
                nthreads = self.client.nthreads()
                info["workers_joined"] = len(nthreads)
                info["threads_joined"] = int(sum(nthreads.values()))
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
        else its share of the cores. Workers warm up at start on their device (``DEQBENCH_WARMUP``).
        """
        from distributed.worker_memory import parse_memory_limit

        cpus = os.cpu_count() or 1
        gpus = gpu_ids(device)
        if device.startswith("cuda") and not gpus:
            raise ConfigError(f"device {device}: no GPU is visible for the local Dask cluster")
        n = self.workers or (len(gpus) if gpus else max(1, cpus // (threads or 1)))
        # Dask sets OMP_NUM_THREADS=1 in its workers; give each its share of the cores instead
        # (on GPUs, of the cores left once workers were added for short cells).
        most = len(gpus) * self.max_per_gpu if gpus and self.workers is None else n
        omp = str(threads or max(1, cpus // max(n, most)))
        self._memory = parse_memory_limit("auto", 1, n, logger=logging.getLogger(__name__))
        self._omp = omp
        specs = {
            f"deqbench-{i}": self._spec(gpus[i % len(gpus)] if gpus else None) for i in range(n)
        }
        self._specs = dict(specs)
        self._gpus = gpus
        layout = {
            "kind": "dask",
            "scheduler": "local",
            "workers": n,
            "gpus": [gpus[i % len(gpus)] for i in range(n)] if gpus else [],
            "torch_threads": int(omp),
            "allowed_failures": self.allowed_failures,
        }
        return specs, layout

    def _spec(self, gpu: str | None) -> dict[str, Any]:
        from distributed import Nanny

        omp = self._omp
        env = {
            "OMP_NUM_THREADS": omp,
            "MKL_NUM_THREADS": omp,
            "OPENBLAS_NUM_THREADS": omp,
            THREADS_ENV: omp,
            WARMUP_ENV: f"{'cuda' if gpu is not None else 'cpu'}:{self._dtype}",
        }
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = env[PINNED_ENV] = gpu
            # cuBLAS reads it once per process (in the warm-up): what `deterministic` needs
            env["CUBLAS_WORKSPACE_CONFIG"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        return {
            "cls": Nanny,
            "options": {
                "nthreads": 1,
                "host": "127.0.0.1",
                "env": env,
                "preload": ["deqbench.run.executors._worker", *self.preload],
                "memory_limit": self._memory,
                "dashboard": False,
                "silence_logs": self.silence_logs,
            },
        }

    def _local_cluster(self, specs: dict[str, Any]) -> Any:
        import dask
        from distributed import Scheduler, SpecCluster

        from ._forkserver import start_method, use_method

        # Dask's nanny exports MALLOC_TRIM_THRESHOLD_=65536 to every worker it spawns (to hand
        # freed memory back to the OS). With PyTorch's allocation pattern glibc then trims on
        # almost every free: a CPU conv forward/backward loop ran 4x slower with it, and smoke
        # tasks 1.4-2.8x slower in workers than inline. Unset it (None removes the variable);
        # a value in the user's own environment is still inherited.
        dask.config.set({f"{PRE_SPAWN_ENV}.MALLOC_TRIM_THRESHOLD_": None})
        # Dask's statistical profiler samples the cell's thread every 10 ms (taking the GIL
        # from it); the nanny hands this config to the worker processes it starts.
        dask.config.set({"distributed.worker.profile.enabled": bool(self.profile)})
        # forkserver on GPUs unless the user's Dask config says otherwise (see _forkserver)
        method = start_method(gpu=bool(getattr(self, "_gpus", None)))
        use_method(method)
        self.layout["start_method"] = method  # run.json: how the workers were started
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

    # -- grouping short cells -------------------------------------------------------------
    def _may_add_workers(self) -> bool:
        return (
            self.cluster is not None
            and self.workers is None
            and bool(getattr(self, "_gpus", None))
            and self.max_per_gpu > 1
        )

    def add_gpu_workers(
        self, first_walls: Sequence[float], remaining: int, busy: Sequence[float] | None = None
    ) -> list[str]:
        """Group short cells: when the median of ``first_walls`` (the cells finished by the
        time the workers' GPU busy fractions were read: at least one per worker, up to three)
        is under ``short_task`` s, the ``remaining`` cells keep the workers busy for a while and
        the GPUs are idle enough for a second process (the median of ``busy``, the fractions
        read over the workers' second cells, under ``max_busy``; None: none could be read, e.g.
        no NVML), add a worker on every GPU that has fewer than ``max_per_gpu`` and
        room for one more of them in its free memory. Returns the GPU ids that got one (the
        workers join once warm; the coordinator submits to them as they do)."""
        if not self._may_add_workers() or not first_walls:
            return []
        median = statistics.median(first_walls)
        busy_median = round(statistics.median(busy), 3) if busy else None
        if busy_median is not None and busy_median >= self.max_busy:
            # without MPS two processes take turns on a GPU: a second one only uses the time
            # the first leaves idle (measured: cells 2.04x slower each, 10% fewer per hour)
            self.layout["grouping"] = {
                "median_first_cell_s": round(median, 3),
                "gpu_busy": busy_median,
                "added": [],
            }
            return []
        # The remaining work is estimated from the mean, not the median: cells whose solves
        # miss tolerance run to max_iter and take several times the median (a 4x H100 run
        # of kglm_denoise_gpu: median 1.89 s, flagged cells 6-11 s), so the median underestimated it 2x.
        per_cell = max(median, statistics.fmean(first_walls))
        per_worker = len(self._specs)
        # A worker starts in the background (~10-20 s) while the others keep working, so adding
        # one costs little: worth it once the remaining work per worker outlasts that start.
        if median >= self.short_task or remaining * per_cell / per_worker < MIN_REMAINING_S:
            self.layout["grouping"] = {
                "median_first_cell_s": round(median, 3),
                "mean_first_cell_s": round(per_cell, 3),
                "gpu_busy": busy_median,
                "added": [],
            }
            return []
        try:
            mem = self.client.run(gpu_memory)  # worker address -> {peak, free, total}
            pinned = self.client.run(_pinned_gpu)
        except Exception:
            return []
        added: list[str] = []
        for gpu in dict.fromkeys(self._gpus):
            here = [a for a, g in pinned.items() if g == gpu and mem.get(a)]
            if not here or len(here) >= self.max_per_gpu:
                continue
            need = max(mem[a]["peak"] for a in here) + CONTEXT_BYTES
            if min(mem[a]["free"] for a in here) < 2 * need:
                continue
            name = f"deqbench-{len(self._specs)}"
            self._specs[name] = self.cluster.worker_spec[name] = self._spec(gpu)
            added.append(gpu)
        if added:
            self.cluster.loop.add_callback(self.cluster._correct_state)
            self.layout["workers"] = len(self._specs)
            self.layout["gpus"] = list(self.layout.get("gpus", [])) + added
        self.layout["grouping"] = {
            "median_first_cell_s": round(median, 3),
            "mean_first_cell_s": round(per_cell, 3),
            "gpu_busy": busy_median,
            "added": added,
        }
        return added

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

        owned = self.client is None and self._starting is None
        if owned:
            task0 = tasks[0]
            self.start(task0.device, task0.suite.threads, dtype=task0.suite.dtype)
        self._ready()
        client = self.client
        # Our local scheduler gives up on a task at its first dead worker; the cell is then
        # submitted again here, once a worker is free (never queued behind a busy one).
        resubmit = self.allowed_failures if self.cluster is not None else 0
        # Ship the suite without its cells: every task carries its own cell.
        slim = {id(t.suite): dataclasses.replace(t.suite, cells=[]) for t in tasks}
        token = uuid.uuid4().hex[:8]
        # Longest tasks first (deqbench.run.schedule): seed-major, then by decreasing estimated
        # cost, re-estimated as tasks finish; results are written in the suite's order anyway.
        statics = {t.cell.id: static_cost(t.cell) for t in tasks}
        costs = CostModel(statics)
        for cell_id, walls in known_costs(tasks[0].run_dir).items():
            for w in walls:
                costs.observe(cell_id, statics.get(cell_id, 1.0), w)
        ranks = {s: r for r, s in enumerate(tasks[0].suite.seeds)}
        plan = [(t.cell.id, ranks.get(t.seed, len(ranks)), statics[t.cell.id]) for t in tasks]
        # (index, task, attempt, first submission time)
        queue: deque[tuple[int, Task, int, float | None]] = deque(
            (i, tasks[i], 0, None) for i in lpt_order(plan, costs)
        )
        self.submitted = []
        sorted_at = [len(costs.walls)]

        def reorder() -> None:
            """Re-sort the tasks not yet submitted by the costs measured so far (resubmitted
            cells, at the front, stay there)."""
            if len(queue) < 2 or sum(map(len, costs.walls.values())) == sorted_at[0]:
                return
            sorted_at[0] = sum(map(len, costs.walls.values()))
            again = [q for q in queue if q[2] > 0]
            fresh = [q for q in queue if q[2] == 0]
            order = lpt_order([plan[q[0]] for q in fresh], costs)
            queue.clear()
            queue.extend(again + [fresh[k] for k in order])

        inflight: dict[Any, tuple[int, Task, int, float]] = {}
        keys: dict[str, Task] = {}  # every key submitted in this run -> its task
        # A scheduler of yours runs the cell of a worker that died again by itself (its
        # allowed-failures): its remove-worker events name the keys the worker was running.
        lost: deque[tuple[str, str, bool]] = deque()  # (worker, key, expected), event thread
        watch = self.cluster is None and _watch_removed_workers(client, keys, lost)
        first_walls: list[float] | None = [] if self._may_add_workers() else None
        busy: list[float] = []  # the workers' GPU busy fractions (their second cells)
        unread = 0  # cells whose worker could not read its GPU's busy fraction
        submitted: dict[tuple[int, int], float] = {}  # (index, attempt) -> epoch seconds
        n_first = len(self._specs)

        def fill() -> None:
            slots = self._slots()
            while queue and len(inflight) < slots:
                i, t, attempt, t0 = queue.popleft()
                wire = dataclasses.replace(t, suite=slim[id(t.suite)])
                # Dask's priority (higher first) follows the submission order, for a scheduler
                # that holds several of our tasks at once (max_in_flight, a cluster of yours)
                priority = len(tasks) - len(self.submitted)
                fut = client.submit(
                    run_cell,
                    wire,
                    key=f"deqbench_cell-{token}-{i}-{attempt}",
                    retries=self.retries,
                    pure=False,
                    priority=priority,
                )
                self.submitted.append((t.cell.id, t.seed, priority))
                submitted[(i, attempt)] = time.time()
                inflight[fut] = (i, t, attempt, time.perf_counter() if t0 is None else t0)
                keys[str(fut.key)] = t

        def log_lost() -> None:
            while lost:
                worker, key, expected = lost.popleft()
                again = (
                    "the scheduler runs it again elsewhere"
                    if expected
                    else "the scheduler runs it again unless its "
                    "distributed.scheduler.allowed-failures are used up (then KilledWorker)"
                )
                how = "was retired" if expected else "died"
                _log_task(
                    keys[key],
                    f"worker {worker} {how} running this cell (Dask remove-worker event); {again}",
                )

        try:
            fill()
            while inflight:
                try:
                    with client.as_current():  # wait() looks up the current client
                        wait(list(inflight), timeout=self.poll, return_when="FIRST_COMPLETED")
                except TimeoutError:
                    log_lost()
                    fill()  # workers may have joined
                    continue
                log_lost()
                done = sorted((f for f in inflight if f.done()), key=lambda f: inflight[f][0])
                results = []
                for fut in done:
                    i, t, attempt, t0 = inflight.pop(fut)
                    if (
                        fut.status == "error"
                        and attempt < resubmit
                        and isinstance(exc := fut.exception(), KilledWorker)
                    ):
                        fut.release()
                        queue.appendleft((i, t, attempt + 1, t0))
                        _log_task(
                            t,
                            f"worker {_last_worker(exc)} died running this cell (KilledWorker); "
                            f"submitted again (attempt {attempt + 2} of {resubmit + 1})",
                        )
                        continue
                    r = self._collect(fut, t, time.perf_counter() - t0, attempt + 1)
                    r.timing.update(submitted=submitted.get((i, attempt)), attempts=attempt + 1)
                    if r.status in TIMED:
                        costs.observe(t.cell.id, statics[t.cell.id], r.wall_time)
                    results.append(r)
                    fut.release()
                reorder()
                # The freed workers get their next cells before the caller writes these results
                # (a worker never idles while the coordinator writes results.csv).
                fill()
                if first_walls is not None:
                    first_walls += [r.wall_time for r in results if r.status in TIMED]
                    for r in results:
                        if "gpu_busy" in r.timing:
                            b = r.timing["gpu_busy"]
                            if b is None:  # no NVML on that worker: nothing to wait for
                                unread += 1
                            elif r.timing.get("worker_task", 0) >= 1:
                                busy.append(b)  # the first cell compiles and captures: not read
                    if len(first_walls) >= min(n_first, len(tasks)) and (
                        len(busy) + unread >= n_first
                        or len(first_walls) >= 3 * n_first
                        or not queue
                    ):
                        self.add_gpu_workers(first_walls, len(queue), busy=busy or None)
                        first_walls = None
                yield from results
        finally:
            if watch:
                try:
                    client.unsubscribe_topic("all")
                except Exception:
                    pass
                log_lost()
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
            last = _last_worker(exc)
            try:
                tries = str(submissions * (exc.allowed_failures + 1))
            except Exception:
                tries = "several"
            note = (
                f"worker died running this cell ({tries} attempts, the last on {last}; "
                "KilledWorker): see the worker logs"
            )
            return failed_result(task, note, None, wall)
        tb = "".join(traceback.format_exception(type(exc), exc, fut.traceback()))
        return failed_result(task, f"dask: {_one_line(exc)}", tb, wall)
