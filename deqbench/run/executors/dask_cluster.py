"""The local Dask cluster's lifecycle and worker management for
:class:`~deqbench.run.executors.dask.DaskExecutor`: connecting to a scheduler or starting a local
cluster (in the background), its worker specs (one per GPU, pinned, warmed up), closing it, and
adding a second worker on each GPU the first cells leave idle (grouping short cells). Task
dispatch is in :mod:`deqbench.run.executors.dask`."""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any, Self

from ...core.errors import ConfigError
from ._worker import WARMUP_ENV
from .dask_cell import PINNED_ENV, THREADS_ENV, _pinned_gpu, gpu_memory

#: Dask config key of the variables a nanny exports before it spawns a worker process.
PRE_SPAWN_ENV = "distributed.nanny.pre-spawn-environ"

#: GPU memory (bytes) counted per worker process beyond its cells' peak (CUDA context, handles)
CONTEXT_BYTES = 1 << 30

#: seconds of estimated remaining work per worker above which a second worker joins each GPU
MIN_REMAINING_S = 20.0

#: Dask resources of the local workers: a GPU worker has one GPU slot, a CPU worker one CPU slot
#: (a ``device: auto`` run routes each cell to its kind; other runs request none)
GPU_SLOT = "deqbench-gpu"
CPU_SLOT = "deqbench-cpu"
#: name prefix of the CPU workers a ``device: auto`` run adds beside the GPU workers
CPU_WORKER = "deqbench-cpu-"


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


class DaskCluster:
    """The cluster half of :class:`~deqbench.run.executors.dask.DaskExecutor` (whose
    ``__init__`` sets the attributes below): start or join a cluster, describe and close it, and
    add workers for short cells."""

    scheduler: str | None
    workers: int | None
    preload: list[str]
    allowed_failures: int
    connect_timeout: float
    silence_logs: int
    max_per_gpu: int
    short_task: float
    max_busy: float
    profile: bool
    client: Any
    cluster: Any
    layout: dict[str, Any]
    timeline: dict[str, float]
    _starting: threading.Thread | None
    _start_error: BaseException | None
    _closing: threading.Thread | None
    _final_info: dict[str, Any] | None
    _specs: dict[str, Any]
    _dtype: str
    _memory: Any
    _omp: str
    _gpus: list[str]

    # -- lifecycle ------------------------------------------------------------------------
    def start(
        self,
        device: str = "cpu",
        threads: int | None = None,
        *,
        dtype: str | None = None,
        wait: bool = True,
    ) -> Self:
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

    @property
    def uses_local_cores(self) -> bool:
        """A local cluster on CPU, or with CPU workers beside its GPU workers: its workers use
        this machine's cores (no plot pool beside them)."""
        return self.scheduler is None and (
            not self.layout.get("gpus") or bool(self.layout.get("cpu_workers"))
        )

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

    def __enter__(self) -> Self:
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

    def _spec(self, gpu: str | None, omp: str | None = None, memory: Any = None) -> dict[str, Any]:
        from distributed import Nanny

        omp = omp or self._omp
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
                "memory_limit": self._memory if memory is None else memory,
                "resources": {GPU_SLOT if gpu is not None else CPU_SLOT: 1},
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

    # -- CPU workers beside the GPU workers (device: auto) ---------------------------------
    def placement_pool(self, suite: Any) -> Any:
        """The :class:`~deqbench.run.placement.Pool` a ``device: auto`` suite is placed for:
        the visible GPUs, and the CPU workers this local cluster adds beside its GPU workers
        (:meth:`add_cpu_workers`): the cores less one per GPU worker (``max_per_gpu`` per GPU,
        or ``--workers``) and one for the coordinator, divided by the suite's ``threads``
        (default 1). None on a cluster of yours: its workers resolve ``auto`` each on their
        own."""
        from ..placement import Pool

        if self.scheduler is not None:
            return None
        gpus = gpu_ids("cuda")
        threads = suite.threads or 1
        gpu_workers = self.workers or len(gpus) * self.max_per_gpu
        spare = max(0, (os.cpu_count() or 1) - gpu_workers - 1)
        return Pool(gpus=len(gpus), cpu_workers=spare // threads, cpu_threads=threads)

    def add_cpu_workers(self, n: int, threads: int) -> int:
        """Add ``n`` single-threaded (``threads`` torch threads) CPU workers to the local GPU
        cluster, for the cells placed on CPU; they join once warm. Returns how many were
        added (0 without a local cluster or GPU workers, or where they were added before)."""
        if self.cluster is None or not getattr(self, "_gpus", None) or n < 1:
            return 0
        if any(k.startswith(CPU_WORKER) for k in self._specs):
            return 0
        from distributed.worker_memory import parse_memory_limit

        # every worker's share of the memory once these join
        share = len(self._specs) + n
        memory = parse_memory_limit("auto", 1, share, logger=logging.getLogger(__name__))
        for i in range(n):
            name = f"{CPU_WORKER}{i}"
            spec = self._spec(None, str(threads), memory)
            self._specs[name] = self.cluster.worker_spec[name] = spec
        self.cluster.loop.add_callback(self.cluster._correct_state)
        self.layout.update(cpu_workers=n, cpu_threads=threads)
        return n

    def _gpu_specs(self) -> dict[str, Any]:
        return {k: v for k, v in self._specs.items() if not k.startswith(CPU_WORKER)}

    def slots_by_kind(self) -> dict[str, int]:
        """Threads of the joined workers by kind (``GPU_SLOT`` / ``CPU_SLOT``), at least 1 for
        a kind whose workers were asked for (they may still be starting: the scheduler holds
        their cells meanwhile)."""
        out = {GPU_SLOT: 0, CPU_SLOT: 0}
        try:
            for w in self.client.scheduler_info()["workers"].values():
                for kind in out:
                    if (w.get("resources") or {}).get(kind):
                        out[kind] += int(w.get("nthreads", 1))
        except Exception:
            pass
        asked = {
            CPU_SLOT: len(self._specs) - len(self._gpu_specs()),
            GPU_SLOT: len(self._gpu_specs()),
        }
        return {k: max(v, 1 if asked[k] else 0) for k, v in out.items()}

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
        per_worker = len(self._gpu_specs())
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
            name = f"deqbench-{len(self._gpu_specs())}"
            self._specs[name] = self.cluster.worker_spec[name] = self._spec(gpu)
            added.append(gpu)
        if added:
            self.cluster.loop.add_callback(self.cluster._correct_state)
            self.layout["workers"] = len(self._gpu_specs())
            self.layout["gpus"] = list(self.layout.get("gpus", [])) + added
        self.layout["grouping"] = {
            "median_first_cell_s": round(median, 3),
            "mean_first_cell_s": round(per_cell, 3),
            "gpu_busy": busy_median,
            "added": added,
        }
        return added
