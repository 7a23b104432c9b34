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

This module dispatches the tasks; starting, describing and closing the cluster and adding workers
live in :mod:`deqbench.run.executors.dask_cluster` (:class:`DaskExecutor` extends its
:class:`~deqbench.run.executors.dask_cluster.DaskCluster`).

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
from .dask_cell import PINNED_ENV as PINNED_ENV  # re-exported
from .dask_cell import gpu_memory as gpu_memory  # re-exported
from .dask_cell import run_cell
from .dask_cluster import CPU_SLOT, GPU_SLOT, DaskCluster, _one_line
from .dask_cluster import gpu_ids as gpu_ids  # re-exported

__all__ = ["DaskExecutor", "run_cell", "failed_result", "gpu_ids", "INSTALL_HINT"]

INSTALL_HINT = "pip install 'deqbench[dask]'"
#: statuses whose wall time measures a whole cell (the grouping decision reads them)
TIMED = ("ok", FLAGGED)


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


class _Dispatch:
    """The tasks of one :meth:`DaskExecutor.run`: those waiting (longest first: seed-major, then
    by decreasing estimated cost, re-estimated as tasks finish; :mod:`deqbench.run.schedule`),
    those in flight, every key submitted, and the cells a removed worker took down."""

    def __init__(self, tasks: Sequence[Task]) -> None:
        self.tasks = tasks
        # Ship the suite without its cells: every task carries its own cell.
        self.slim = {id(t.suite): dataclasses.replace(t.suite, cells=[]) for t in tasks}
        self.token = uuid.uuid4().hex[:8]
        # results are written in the suite's order anyway
        self.statics = {t.cell.id: static_cost(t.cell) for t in tasks}
        self.costs = CostModel(self.statics)
        for cell_id, walls in known_costs(tasks[0].run_dir).items():
            for w in walls:
                self.costs.observe(cell_id, self.statics.get(cell_id, 1.0), w)
        ranks = {s: r for r, s in enumerate(tasks[0].suite.seeds)}
        self.plan = [
            (t.cell.id, ranks.get(t.seed, len(ranks)), self.statics[t.cell.id]) for t in tasks
        ]
        # (index, task, attempt, first submission time)
        self.queue: deque[tuple[int, Task, int, float | None]] = deque(
            (i, tasks[i], 0, None) for i in lpt_order(self.plan, self.costs)
        )
        self.sorted_at = len(self.costs.walls)
        self.inflight: dict[Any, tuple[int, Task, int, float]] = {}
        self.keys: dict[str, Task] = {}  # every key submitted in this run -> its task
        self.lost: deque[tuple[str, str, bool]] = deque()  # (worker, key, expected), event thread
        self.submitted_at: dict[tuple[int, int], float] = {}  # (index, attempt) -> epoch seconds

    def observe(self, task: Task, wall: float) -> None:
        """A cell's measured wall time, for the order of the cells not yet submitted."""
        self.costs.observe(task.cell.id, self.statics[task.cell.id], wall)

    def reorder(self) -> None:
        """Re-sort the tasks not yet submitted by the costs measured so far (resubmitted
        cells, at the front, stay there)."""
        queue, costs = self.queue, self.costs
        if len(queue) < 2 or sum(map(len, costs.walls.values())) == self.sorted_at:
            return
        self.sorted_at = sum(map(len, costs.walls.values()))
        again = [q for q in queue if q[2] > 0]
        fresh = [q for q in queue if q[2] == 0]
        order = lpt_order([self.plan[q[0]] for q in fresh], costs)
        queue.clear()
        queue.extend(again + [fresh[k] for k in order])

    def fill(
        self,
        client: Any,
        slots: int | dict[str, int],
        retries: int,
        submitted: list[tuple[str, int, int]],
    ) -> None:
        """Submit waiting tasks until ``slots`` are in flight; ``submitted`` gets (cell id,
        seed, priority) of each. ``slots`` by worker kind (``{GPU_SLOT: n, CPU_SLOT: m}``, a
        ``device: auto`` run with CPU workers): each task asks for its kind's Dask resource
        and the first waiting task of a kind with room goes next."""
        while self.queue:
            pick = self._next(slots)
            if pick is None:
                return
            i, t, attempt, t0 = pick
            wire = dataclasses.replace(t, suite=self.slim[id(t.suite)])
            # Dask's priority (higher first) follows the submission order, for a scheduler
            # that holds several of our tasks at once (max_in_flight, a cluster of yours)
            priority = len(self.tasks) - len(submitted)
            kind = {"resources": {slot_of(t): 1}} if isinstance(slots, dict) else {}
            fut = client.submit(
                run_cell,
                wire,
                key=f"deqbench_cell-{self.token}-{i}-{attempt}",
                retries=retries,
                pure=False,
                priority=priority,
                **kind,
            )
            submitted.append((t.cell.id, t.seed, priority))
            self.submitted_at[(i, attempt)] = time.time()
            self.inflight[fut] = (i, t, attempt, time.perf_counter() if t0 is None else t0)
            self.keys[str(fut.key)] = t

    def _next(self, slots: int | dict[str, int]) -> tuple[int, Task, int, float | None] | None:
        """The next waiting task to submit (taken off the queue), or None: no room."""
        if isinstance(slots, int):
            return self.queue.popleft() if len(self.inflight) < slots else None
        busy = {k: 0 for k in slots}
        for _, t, _, _ in self.inflight.values():
            busy[slot_of(t)] = busy.get(slot_of(t), 0) + 1
        for q in self.queue:
            k = slot_of(q[1])
            if busy.get(k, 0) < slots.get(k, 0):
                self.queue.remove(q)
                return q
        return None

    def log_lost(self) -> None:
        """One ``log.txt`` line per cell a removed worker was running (its remove-worker
        event)."""
        while self.lost:
            worker, key, expected = self.lost.popleft()
            again = (
                "the scheduler runs it again elsewhere"
                if expected
                else "the scheduler runs it again unless its "
                "distributed.scheduler.allowed-failures are used up (then KilledWorker)"
            )
            how = "was retired" if expected else "died"
            _log_task(
                self.keys[key],
                f"worker {worker} {how} running this cell (Dask remove-worker event); {again}",
            )


def slot_of(task: Task) -> str:
    """The Dask resource a task of a ``device: auto`` run asks for: a CPU worker's slot for a
    cell placed on CPU, else a GPU worker's."""
    return CPU_SLOT if task.device == "cpu" else GPU_SLOT


class _FirstCells:
    """What the grouping decision (:meth:`DaskExecutor.add_gpu_workers`) reads: the wall times
    of the first cells and the workers' GPU busy fractions over their second cells."""

    def __init__(self, n_first: int) -> None:
        self.n_first = n_first  # the workers at start
        self.walls: list[float] = []
        self.busy: list[float] = []  # the workers' GPU busy fractions (their second cells)
        self.unread = 0  # cells whose worker could not read its GPU's busy fraction

    def observe(self, results: Sequence[TaskResult], n_tasks: int, queued: bool) -> bool:
        """Take finished cells in; True once enough were read to decide (a cell per worker
        and a busy fraction per worker, three cells per worker, or nothing left to submit)."""
        self.walls += [r.wall_time for r in results if r.status in TIMED]
        for r in results:
            if "gpu_busy" in r.timing:
                b = r.timing["gpu_busy"]
                if b is None:  # no NVML on that worker: nothing to wait for
                    self.unread += 1
                elif r.timing.get("worker_task", 0) >= 1:
                    self.busy.append(b)  # the first cell compiles and captures: not read
        n_first = self.n_first
        return len(self.walls) >= min(n_first, n_tasks) and (
            len(self.busy) + self.unread >= n_first or len(self.walls) >= 3 * n_first or not queued
        )


class DaskExecutor(DaskCluster):
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
        #: the last :meth:`run` routes cells by kind (CPU workers beside the GPU workers)
        self.mixed = False

    #: the cells run in other processes: the coordinator may prepare its plots meanwhile
    remote = True

    # -- running --------------------------------------------------------------------------
    def _slots(self) -> int | dict[str, int]:
        if self.mixed:
            return self.slots_by_kind()
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
        from distributed import wait

        owned = self.client is None and self._starting is None
        if owned:
            s0 = tasks[0].suite
            self.start(s0.resolved_device(), s0.threads, dtype=s0.dtype)
        self._ready()
        client = self.client
        # device: auto placed some cells on CPU: CPU workers join beside the GPU workers
        on_cpu = sum(t.device == "cpu" for t in tasks)
        pool = (
            self.placement_pool(tasks[0].suite) if on_cpu and getattr(self, "_gpus", None) else None
        )
        self.mixed = pool is not None and (
            self.add_cpu_workers(min(on_cpu, pool.cpu_workers), pool.cpu_threads) > 0
            or bool(self.layout.get("cpu_workers"))
        )
        # Our local scheduler gives up on a task at its first dead worker; the cell is then
        # submitted again here, once a worker is free (never queued behind a busy one).
        resubmit = self.allowed_failures if self.cluster is not None else 0
        d = _Dispatch(tasks)
        self.submitted = []
        # A scheduler of yours runs the cell of a worker that died again by itself (its
        # allowed-failures): its remove-worker events name the keys the worker was running.
        watch = self.cluster is None and _watch_removed_workers(client, d.keys, d.lost)
        first = _FirstCells(len(self._gpu_specs())) if self._may_add_workers() else None

        def fill() -> None:
            d.fill(client, self._slots(), self.retries, self.submitted)

        try:
            fill()
            while d.inflight:
                try:
                    with client.as_current():  # wait() looks up the current client
                        wait(list(d.inflight), timeout=self.poll, return_when="FIRST_COMPLETED")
                except TimeoutError:
                    d.log_lost()
                    fill()  # workers may have joined
                    continue
                d.log_lost()
                results = self._finished(d, resubmit)
                d.reorder()
                # The freed workers get their next cells before the caller writes these results
                # (a worker never idles while the coordinator writes results.csv).
                fill()
                on_gpu = [r for r in results if r.timing.get("device") != "cpu"]
                if first is not None and first.observe(on_gpu, len(tasks) - on_cpu, bool(d.queue)):
                    waiting = sum(q[1].device != "cpu" for q in d.queue)
                    self.add_gpu_workers(first.walls, waiting, busy=first.busy or None)
                    first = None
                yield from results
        finally:
            if watch:
                try:
                    client.unsubscribe_topic("all")
                except Exception:
                    pass
                d.log_lost()
            if d.inflight and self.client is not None:
                try:
                    self.client.cancel(list(d.inflight), force=True)
                except Exception:
                    pass
            if owned:
                self.close()

    def _finished(self, d: _Dispatch, resubmit: int) -> list[TaskResult]:
        """The results of the futures of ``d`` that are done, in the suite's order; a cell whose
        worker died (``KilledWorker``) goes back to the front of the queue, ``resubmit`` times
        at most."""
        from distributed import KilledWorker

        done = sorted((f for f in d.inflight if f.done()), key=lambda f: d.inflight[f][0])
        results = []
        for fut in done:
            i, t, attempt, t0 = d.inflight.pop(fut)
            if (
                fut.status == "error"
                and attempt < resubmit
                and isinstance(exc := fut.exception(), KilledWorker)
            ):
                fut.release()
                d.queue.appendleft((i, t, attempt + 1, t0))
                _log_task(
                    t,
                    f"worker {_last_worker(exc)} died running this cell (KilledWorker); "
                    f"submitted again (attempt {attempt + 2} of {resubmit + 1})",
                )
                continue
            r = self._collect(fut, t, time.perf_counter() - t0, attempt + 1)
            r.timing.update(submitted=d.submitted_at.get((i, attempt)), attempts=attempt + 1)
            r.timing.setdefault("device", t.device)  # a cell that never returned: as placed
            if r.status in TIMED:
                d.observe(t, r.wall_time)
            results.append(r)
            fut.release()
        return results

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
