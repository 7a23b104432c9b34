"""The runner: cells x seeds -> tasks -> an executor -> rows -> the run directory.

The coordinator (:func:`run_suite`) alone writes the run directory: ``run.json``, the resolved
``suite.yaml``, ``results.csv`` (appended per finished task, crash-safe) with its
``manifest.jsonl`` (row count and checksum per task, checked by ``--resume``), ``series/``,
``log.txt`` (tracebacks of failed tasks) and ``plots/``. It holds ``run.lock``
(:mod:`deqbench.run.lock`) while it lives, so a run directory has one writer. SIGINT and SIGTERM
stop it cleanly (finished tasks on disk, ``run.json`` ``interrupted``, exit 130 / 143); a signal
after the last task finished leaves it ``complete``; a training task stopped by one writes its
checkpoint first (``checkpoints/``, :mod:`deqbench.run.checkpoints`), which ``--resume``
continues and the coordinator deletes once the task's rows are written. ``stop_after``
(``--stop-after``) stops the tasks at their next step boundary (exit 75). Nothing else
interrupts it: a ``SystemExit``,
``KeyboardInterrupt`` or ``GeneratorExit`` raised by plugin code is the failure of the task (or
analysis) that ran it (:mod:`deqbench.run.interrupts`), and the run goes on. Tasks (:class:`deqbench.run.task.Task`) are
picklable and independent; an :class:`Executor` runs them and yields their
:class:`~deqbench.run.task.TaskResult` in any order. :class:`InlineExecutor` runs them one by one in
this process; a distributed executor (Dask) implements the same ``run`` method.

Example:
    >>> import deqbench
    >>> suite = deqbench.load_suite("suites/smoke.yaml")            # doctest: +SKIP
    >>> summary = deqbench.run_suite(suite, out="results/")         # doctest: +SKIP
    >>> summary.run_dir, summary.failed                               # doctest: +SKIP
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..core.errors import ConfigError
from . import results as res
from .checkpoints import remove_checkpoint
from .interrupts import Interrupted, deadline, holds, is_interruption, marking, plugin_fault
from .lock import RunLock
from .placement import place_run
from .task import (
    SUSPENDED,
    Listener,
    Task,
    TaskResult,
    apply_numeric_flags,
    preserved_numerics,
    run_task,
)

if TYPE_CHECKING:  # pragma: no cover
    from .suite import Suite

__all__ = [
    "Executor",
    "InlineExecutor",
    "Interrupted",
    "RunSummary",
    "run_suite",
    "Task",
    "TaskResult",
    "run_task",
]


class Executor(Protocol):
    """Runs tasks and yields their results as they finish (any order)."""

    def run(
        self, tasks: Sequence[Task], listener: Listener | None = None
    ) -> Iterator[TaskResult]: ...


class InlineExecutor:
    """Runs tasks one after another in this process."""

    def run(self, tasks: Sequence[Task], listener: Listener | None = None) -> Iterator[TaskResult]:
        for t in tasks:
            yield run_task(t, listener)


@dataclass
class RunSummary:
    run_dir: Path
    run_id: str
    tasks: int  # tasks run now (excluding those a resume skipped)
    skipped: int = 0  # finished tasks a resume skipped
    #: (cell_id, seed, status, note) of every failed task in the run directory
    failed: list[tuple[str, int, str, str]] = field(default_factory=list)
    interrupted: bool = False
    plots: list[Path] = field(default_factory=list)
    #: the signal that interrupted the run (SIGINT, SIGTERM); None for a KeyboardInterrupt
    #: raised otherwise, or no interruption
    signal: int | None = None
    #: why the run stopped early other than a signal (an OSError while writing, e.g. disk full)
    cause: str | None = None
    #: the run directory's results as the run ended (``load_results``), for the caller's summary
    results: Any = field(default=None, repr=False, compare=False)
    #: the tasks the ``--stop-after`` deadline stopped unfinished: (cell_id, seed, note)
    stopped: list[tuple[str, int, str]] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        """0 every task ok; 1 some task failed or was flagged; 2 stopped by an error writing the
        run directory (``cause``); 128 + the signal when interrupted (130 SIGINT, 143
        SIGTERM); 130 for a KeyboardInterrupt raised otherwise; :data:`STOPPED_EXIT` (75) when
        the ``--stop-after`` deadline left tasks unfinished (``stopped``)."""
        if self.interrupted:
            if self.cause:
                return 2
            if self.signal is None and self.stopped:
                return STOPPED_EXIT
            return 128 + self.signal if self.signal else 130
        return 1 if self.failed else 0


#: the exit code of a run that ``--stop-after`` stopped with tasks unfinished (EX_TEMPFAIL of
#: sysexits.h: a temporary failure, to be tried again: ``--resume``)
STOPPED_EXIT = 75


class _Signals:
    """SIGINT and SIGTERM handlers for the life of a run (main thread only; the previous
    handlers come back on exit). Modes: ``defer`` (record the signal: while the run directory
    is prepared), ``raise`` (raise :class:`Interrupted`, except inside :meth:`deferred`, which
    raises at its end: a task's rows and manifest record are written whole) and ``finish``
    (after the last task: record only, except inside :meth:`interruptible`)."""

    def __init__(self, mode: str = "defer") -> None:
        self.mode = mode
        self.pending: int | None = None  # a signal not acted on yet
        self.late: int | None = None  # a signal that came after the last task
        self._depth = 0
        self._old: dict[int, Any] = {}

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                try:
                    self._old[s] = signal.signal(s, self._handle)
                except (ValueError, OSError):  # pragma: no cover - e.g. an embedded interpreter
                    pass
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old.clear()

    @marking  # a real signal raises Interrupted or is recorded, never a plain KeyboardInterrupt
    def _handle(self, signum: int, frame: Any) -> None:
        if self.mode.startswith("finish"):
            self.late = self.late or signum
            if self.mode == "finish-raise":
                self.mode = "finish"
                raise Interrupted(signum)
            return
        self.pending = self.pending or signum
        if self.mode == "raise" and not self._depth:
            self.pending = None
            if holds(signum):  # a training step ends whole first (and writes its checkpoint)
                return
            raise Interrupted(signum)

    def arm(self) -> None:
        """From now on a signal interrupts; one that came while preparing does so now."""
        self.mode = "raise"
        if self.pending is not None and not self._depth:
            signum, self.pending = self.pending, None
            raise Interrupted(signum)

    @contextmanager
    def deferred(self) -> Iterator[None]:
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
        if self.mode == "raise":
            self.arm()

    def finishing(self) -> None:
        self.mode, self.pending = "finish", None

    @contextmanager
    def interruptible(self) -> Iterator[None]:
        """In ``finish`` mode: a signal raises :class:`Interrupted` inside this block."""
        self.mode = "finish-raise"
        try:
            yield
        finally:
            self.mode = "finish"


@contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM are ignored inside (for what follows a finished run, e.g. the CLI's
    summary: the run's status and exit code stand)."""
    with _Signals("finish"):
        yield


class _Progress:
    """Progress on stderr: a rich bar when stderr is a terminal, else one line per task."""

    def __init__(self, total: int, enabled: bool | None) -> None:
        self.total, self.done = total, 0
        tty = sys.stderr.isatty()
        self.bar = None
        if (enabled is None and tty) or enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self.bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self.cells = self.bar.add_task("cells", total=total)
            self.epochs = self.bar.add_task("", total=1, visible=False)
        self.quiet = enabled is False

    def __enter__(self) -> _Progress:
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.stop()

    def task_started(self, task: Task) -> None:
        if self.bar is not None:
            epochs = max(1, int(task.cell.train.get("epochs", 1)))
            self.bar.reset(
                self.epochs,
                total=epochs,
                visible=True,
                description=f"{task.cell.id} seed={task.seed} epochs",
            )

    def epoch(self, task: Task, epoch: int) -> None:
        if self.bar is not None:
            self.bar.update(self.epochs, completed=max(0, epoch - 1))

    def finished(self, r: TaskResult) -> None:
        self.done += 1
        line = f"[{self.done}/{self.total}] {r.cell_id} seed={r.seed}: {r.status} ({r.wall_time:.2f} s)"
        if r.note and r.status != res.FLAGGED:  # a flag's note is printed once, with the summary
            line += f" {r.note}"
        if self.bar is not None:
            self.bar.advance(self.cells)
            if r.failed:
                from rich.markup import escape

                self.bar.console.print(f"[red]{escape(line)}[/red]", markup=True, highlight=False)
        elif not self.quiet:
            print(line, file=sys.stderr, flush=True)


def _log(run_dir: Path, text: str) -> None:
    try:
        with open(run_dir / "log.txt", "a", encoding="utf-8") as fh:
            fh.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text.rstrip()}\n")
    except OSError:  # e.g. disk full: log.txt is informational
        pass


def stop_rules(cells: Any) -> dict[str, dict[str, Any]]:
    """What judged each cell's forward solves: ``{cell id: {"tol", "stop_mode", "stop"}}`` (the
    solver settings; ``stop`` is the stop rule, the solver option, default ``sample_max``), for
    the cells that have a solver (``run.json``'s ``stop_rules``)."""
    out = {}
    for c in cells:
        sv = c.solver or {}
        if "name" in sv:
            out[c.id] = {
                "tol": sv.get("tol"),
                "stop_mode": sv.get("stop_mode", "rel"),
                "stop": sv.get("stop", "sample_max"),
            }
    return out


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _prepare(
    suite: Suite,
    out: str | Path | None,
    resume: str | Path | None,
    command: list[str] | None,
    stack: ExitStack,
) -> tuple[Path, dict[str, Any], set[tuple[str, int]], list[str]]:
    """The run directory (locked for this process: the lock is released by ``stack``), its
    ``run.json`` contents, the finished tasks and the lines to log (lock take-over, tasks that
    a resume runs again)."""
    from .env import collect

    notes: list[str] = []
    if resume is not None:
        run_dir = Path(resume)
        meta_path = run_dir / "run.json"
        if not meta_path.exists():
            raise ConfigError(f"--resume {resume}: not a run directory (no run.json)")
        lock = stack.enter_context(RunLock(run_dir, command or list(sys.argv)))
        notes += [lock.note] if lock.note else []
        try:
            meta = res.read_json(meta_path)
        except (ValueError, OSError) as exc:  # JSONDecodeError, UnicodeDecodeError
            why = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
            raise ConfigError(
                f"--resume {resume}: corrupt run.json: not valid JSON ({why}); start a new run: "
                f"deqbench run {run_dir / 'suite.yaml'}"
            ) from None
        if not isinstance(meta, dict):
            raise ConfigError(f"--resume {resume}: corrupt run.json: expected a JSON object")
        schema = meta.get("results_schema", 1)
        if schema != res.RESULTS_SCHEMA:
            raise ConfigError(
                f"--resume {resume}: its results.csv has results schema {schema} (this deqbench "
                f"writes {res.RESULTS_SCHEMA}: a backward column after solver), so rows would not "
                f"line up; start a new run: deqbench run {run_dir / 'suite.yaml'}"
            )
        if meta.get("suite_hash") != suite.hash:
            raise ConfigError(
                f"--resume {resume}: made from a different suite (hash {meta.get('suite_hash')} "
                f"!= {suite.hash}); resume with the suite that made it: "
                f"deqbench run {run_dir / 'suite.yaml'} --resume {run_dir}"
            )
        made = {c.id for c in suite.cells}
        stale = [c for c in meta.get("cells", []) if c not in made]
        if stale:  # ids of an older deqbench (e.g. before unrolled cells were named by K)
            raise ConfigError(
                f"--resume {resume}: its cell ids are not those this deqbench makes from the same "
                f"suite ({len(stale)} differ, e.g. '{stale[0]}'); rows would not line up: start a "
                f"new run (deqbench run {run_dir / 'suite.yaml'}) and compare the two with "
                "deqbench compare"
            )
        done, rerun = res.check_finished(run_dir)
        notes += [f"resume: {line}" for line in rerun]
        meta.setdefault("resumed", []).append(
            {
                "at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "command": command or list(sys.argv),
                "skipped_tasks": len(done),
                **({"rerun": rerun} if rerun else {}),
            }
        )
        meta["status"] = "running"
        meta.pop("cause", None)
        return run_dir, meta, done, notes
    meta = {
        "run_id": "",  # the directory's name, once it exists
        "results_schema": res.RESULTS_SCHEMA,
        "suite": suite.name,
        "suite_source": suite.source,
        "suite_hash": suite.hash,
        "seeds": suite.seeds,
        "cells": [c.id for c in suite.cells],
        "analyses": [n for n, _ in suite.analyses],
        "dtype": suite.dtype,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "status": "running",
        "tasks_total": len(suite.cells) * len(suite.seeds),
        "stop_rules": stop_rules(suite.cells),
        **({"paper": suite.paper} if suite.paper else {}),  # the suite's paper: block
        **collect(suite.device, command),
    }
    # run.json and suite.yaml appear with the directory (renamed into place): a run killed at
    # any moment leaves no directory or a loadable, resumable one
    text = suite.to_yaml()

    def files(run_id: str) -> dict[str, str]:
        meta["run_id"] = run_id
        return {"run.json": json.dumps(meta, indent=2, default=str) + "\n", "suite.yaml": text}

    run_dir = res.new_run_dir(out if out is not None else suite.output, suite.name, files)
    stack.enter_context(RunLock(run_dir, command or list(sys.argv)))
    return run_dir, meta, set(), notes


def run_suite(
    suite: Suite,
    out: str | Path | None = None,
    *,
    resume: str | Path | None = None,
    executor: Executor | None = None,
    progress: bool | None = None,
    plots: bool = True,
    command: list[str] | None = None,
    stop_after: float | None = None,
) -> RunSummary:
    """Run every (cell, seed) of ``suite`` and write the run directory.

    Args:
        suite: a validated suite (:func:`deqbench.load_suite`).
        out: results root (default ``suite.output``); the run goes to ``out/<suite>/<run_id>``.
        resume: an existing run directory: finished tasks are skipped; refused if it was made
            from a different suite.
        executor: default :class:`InlineExecutor`.
        progress: True/False forces the progress bar on/off; None: on when stderr is a terminal.
        plots: write ``plots/*.png`` at the end.
        command: recorded in ``run.json`` (default ``sys.argv``).
        stop_after: seconds from now after which the tasks stop at their next step boundary,
            each writing its checkpoint (:mod:`deqbench.run.checkpoints`), and tasks not begun do
            not start; the run then ends ``interrupted`` with ``stopped`` set (exit code 75) and
            ``--resume`` continues it. Also the process's deadline
            (:func:`deqbench.run.interrupts.stop_after`), whichever comes first.

    Returns:
        :class:`RunSummary` (``exit_code`` 0, 1 if a task failed, 130 if interrupted).
        KeyboardInterrupt is caught: rows of finished tasks are on disk, ``run.json`` says
        ``interrupted``. The suite's ``threads`` and numeric flags hold for the run; the
        process's own settings are restored afterwards.
    """
    stop_at = deadline()
    if stop_after is not None:
        mine = time.time() + float(stop_after)
        stop_at = mine if stop_at is None else min(stop_at, mine)
    with preserved_numerics():
        return _run_suite(suite, out, resume, executor, progress, plots, command, stop_at)


def _run_suite(
    suite: Suite,
    out: str | Path | None,
    resume: str | Path | None,
    executor: Executor | None,
    progress: bool | None,
    plots: bool,
    command: list[str] | None,
    stop_at: float | None = None,
) -> RunSummary:
    if suite.threads:
        import torch

        torch.set_num_threads(suite.threads)  # before collect(): run.json records it
    # likewise (TF32, cudnn.benchmark); a remote executor's workers set them for their cells
    apply_numeric_flags(suite, compiles=not getattr(executor, "remote", False))
    # epoch seconds of the run's phases (deqbench.run.timeline reads them from run.json)
    phases: dict[str, float | None] = {"process_start": _process_start(), "run_start": time.time()}
    with _Signals() as sig, ExitStack() as stack:  # the stack holds run.lock
        try:
            run_dir, meta, done, notes = _prepare(suite, out, resume, command, stack)
            describe = getattr(executor, "describe", None)
            if callable(describe):  # e.g. the Dask cluster's layout
                meta["executor"] = describe()
            devices, placed = place_run(suite, meta, executor, resume is not None)  # cell: device
            notes += placed
            meta["tasks_total"] = len(suite.cells) * len(suite.seeds)  # planned (cells x seeds)
            res.write_json(run_dir / "run.json", meta)
            writer = res.ResultsWriter(run_dir)
            (run_dir / "series").mkdir(exist_ok=True)
        except OSError as exc:  # e.g. an unwritable or full file system
            raise ConfigError(
                f"cannot write the run directory: {type(exc).__name__}: {exc}"
            ) from None
        for line in notes:
            _say(f"note: {line}")
            _log(run_dir, line)
        tasks = [
            Task(suite, c, s, devices[c.id], meta["run_id"], str(run_dir), stop_at)
            for c in suite.cells
            for s in suite.seeds
            if (c.id, s) not in done
        ]
        for c_id, s in done:  # left by a run stopped between writing the rows and deleting it
            remove_checkpoint(run_dir, c_id, s)
        summary = RunSummary(run_dir, meta["run_id"], len(tasks), len(done))
        _log(
            run_dir,
            f"{'resume' if resume else 'start'}: {len(tasks)} tasks on "
            f"{'/'.join(sorted(set(devices.values())))} "
            f"({len(done)} already finished)",
        )
        written = 0
        results: Iterator[TaskResult] | None = None
        preload: threading.Thread | None = None
        pool: Any = None  # plots.PlotPool: the figures drawn side by side at the end
        timings: list[dict[str, Any]] = []  # one per finished task (timeline.csv)
        try:  # the plot pool (if any) is closed however the run ends
            try:
                with _Progress(len(tasks), progress) as prog:
                    sig.arm()
                    phases["tasks_start"] = time.time()
                    if plots and getattr(executor, "remote", False):
                        preload = _preload_finishing(suite)  # the coordinator idles meanwhile
                        if not getattr(executor, "uses_local_cores", False):
                            pool = _plot_pool(suite)
                    results = iter((executor or InlineExecutor()).run(tasks, prog))
                    for r in results:
                        for line in r.notes:
                            _say(f"note: {r.cell_id} seed={r.seed}: {line}")
                            _log(run_dir, f"{r.cell_id} seed={r.seed}: {line}")
                        if r.status == SUSPENDED:  # unfinished: nothing written, --resume runs it
                            summary.stopped.append((r.cell_id, r.seed, r.note))
                            _log(run_dir, f"{r.cell_id} seed={r.seed}: {r.note}")
                            continue
                        r.timing["received"] = time.time()
                        timings.append(
                            {"cell_id": r.cell_id, "seed": r.seed, "status": r.status,
                             "wall_time": r.wall_time, **r.timing}
                        )  # fmt: skip
                        try:
                            with sig.deferred():  # a task's files are written whole
                                _record(run_dir, writer, r)
                                written += 1
                        except OSError as exc:  # disk full, I/O error: stop, resumable
                            summary.interrupted = True
                            summary.cause = f"{type(exc).__name__}: {exc}"
                            _log(run_dir, f"stopped: {summary.cause}")
                            break
                        prog.finished(r)
                if summary.stopped and not summary.interrupted:
                    summary.interrupted = True
                    _log(run_dir, f"stopped by --stop-after: {len(summary.stopped)} task(s) "
                                  "unfinished; --resume continues them")  # fmt: skip
            except KeyboardInterrupt as exc:
                if written < len(tasks):
                    summary.interrupted = True
                    summary.signal = getattr(exc, "signum", None)
                    how = (
                        signal.Signals(summary.signal).name
                        if summary.signal
                        else "KeyboardInterrupt"
                    )
                    _log(run_dir, f"interrupted ({how}); finished tasks are in results.csv")
            finally:
                sig.finishing()  # from here on a signal no longer interrupts: the run ends as it is
                close = getattr(results, "close", None)
                if callable(close):
                    close()  # e.g. the Dask executor cancels what is in flight
            phases["tasks_end"] = time.time()
            if getattr(executor, "release_when_done", False):
                executor.release()  # type: ignore[union-attr]  # closes while the plots are drawn
            try:
                with sig.interruptible():
                    canonical_order(run_dir, [(c.id, s) for c in suite.cells for s in suite.seeds])
            except KeyboardInterrupt:
                pass  # the rows stay in the order they finished: nothing is lost
            except OSError as exc:
                _log(run_dir, f"results.csv left in finishing order: {type(exc).__name__}: {exc}")
            if preload is not None:
                preload.join()  # the registries it loads must be whole before the plots read them
            timeline = {
                "phases": phases,
                "cluster": dict(getattr(executor, "timeline", None) or {}),
            }
            _finish(run_dir, meta, summary, plots, sig, describe, timeline, timings, pool)
            if sig.late is not None and not summary.interrupted:
                name = signal.Signals(sig.late).name
                _log(run_dir, f"{name} after the last task finished: the run is complete")
                _say(f"note: {name} after the last task finished: the run is complete")
            return summary
        finally:
            if pool is not None:
                pool.close()


def _preload_finishing(suite: Suite) -> threading.Thread:
    """Import what the plots and the post-run reports need (matplotlib, the suite's analysis
    modules and their figures, the report modules) in a background thread, while the
    tasks run elsewhere (an executor with ``remote = True``): 1-2 s off the run's serial end.
    Never with the inline executor, whose cells' timings it would disturb. The caller joins the
    thread before drawing."""

    def target() -> None:
        try:
            import matplotlib.backends.backend_agg  # noqa: F401
            import matplotlib.figure  # noqa: F401

            from .plots import _import_analyses
            from .reports import names

            names()  # imports the report modules

            _import_analyses({name for name, _ in suite.analyses}, [])
        except Exception:  # noqa: BLE001 - the plots import again and report
            pass

    thread = threading.Thread(target=target, name="deqbench-preload", daemon=True)
    thread.start()
    return thread


def _plot_pool(suite: Suite) -> Any:
    """A :class:`~deqbench.run.plots.PlotPool` started now (its processes import while the
    tasks run elsewhere: a GPU cluster or a cluster of yours, never a local CPU cluster, whose
    workers use the cores), or None: no cores to spare
    (:func:`~deqbench.run.plots.plot_processes`) or it could not start (the coordinator then
    draws, one figure after another). ``run.json`` ``timelines[-1].plot_pool``: its processes
    and how many plot functions they drew."""
    try:
        from .plots import PlotPool, plot_processes

        n = plot_processes()
        return PlotPool({name for name, _ in suite.analyses}, n) if n > 0 else None
    except Exception:  # noqa: BLE001 - drawing in the coordinator is the fallback
        return None


def _record(run_dir: Path, writer: res.ResultsWriter, r: TaskResult) -> None:
    """Write one finished task: its series files, its manifest record and rows, its log lines."""
    for fname, text in r.series.items():
        res.write_atomic(run_dir / "series" / fname, text)
    writer.append(r.rows)  # its manifest record first, then the rows
    remove_checkpoint(run_dir, r.cell_id, r.seed)  # the task is finished: its rows are written
    _log(run_dir, f"{r.cell_id} seed={r.seed}: {r.status} {r.wall_time:.3f} s {r.note}")
    if r.traceback:
        _log(run_dir, f"{r.cell_id} seed={r.seed} traceback:\n{r.traceback}")


def _process_start() -> float | None:
    """Epoch seconds at which this process was created (psutil, when installed)."""
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:  # noqa: BLE001 - informational
        return None


def canonical_order(run_dir: Path, order: Sequence[tuple[str, int]]) -> bool:
    """Rewrite ``results.csv`` (atomically) with each task's rows in ``order`` (the suite's
    cells x seeds), whatever order the tasks finished in; a task's own rows keep their order and
    ``manifest.jsonl``'s per-task checksums stay valid. Tasks not in ``order`` follow in the
    order they were written. Nothing is rewritten when the file is already in order or has a
    line that does not parse (a torn write: ``--resume`` repairs it). True if rewritten."""
    path = run_dir / "results.csv"
    if not path.exists():
        return False
    header, lines, torn = res._task_lines(path)
    if torn or any(k is None for k, _, _ in lines):
        return False
    rank = {(c, str(s)): i for i, (c, s) in enumerate(order)}
    blocks: dict[tuple[str, str], list[bytes]] = {}
    for k, ln, _ in lines:
        blocks.setdefault(k, []).append(ln)  # type: ignore[arg-type]
    keys = list(blocks)
    want = sorted(keys, key=lambda k: (rank.get(k, len(rank)), keys.index(k)))
    contiguous = sum(1 for i, (k, _, _) in enumerate(lines) if i == 0 or lines[i - 1][0] != k)
    if want == keys and contiguous == len(keys):
        return False
    res.write_atomic(path, header + b"".join(b"".join(blocks[k]) for k in want))
    return True


#: columns of ``timeline.csv`` (one line per finished task; epoch seconds)
TIMELINE_COLUMNS = [
    "cell_id", "seed", "status", "wall_time", "worker", "pid", "attempts", "submitted",
    "worker_received", "start", "end", "received", "process_start", "warmup_start", "warmup_end",
    "device",
]  # fmt: skip


def _write_timeline(run_dir: Path, timings: list[dict[str, Any]]) -> None:
    """``timeline.csv``: where and when each task of this invocation ran (appended on resume)."""
    import csv
    import io

    path = run_dir / "timeline.csv"
    buf = io.StringIO()
    w = csv.DictWriter(buf, TIMELINE_COLUMNS, extrasaction="ignore", lineterminator="\n")
    if not path.exists():
        w.writeheader()
    w.writerows(timings)
    try:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(buf.getvalue())
    except OSError as exc:  # informational
        _log(run_dir, f"timeline.csv not written: {type(exc).__name__}: {exc}")


def _finish(
    run_dir: Path,
    meta: dict[str, Any],
    summary: RunSummary,
    plots: bool,
    sig: _Signals,
    describe: Any,
    timeline: dict[str, Any] | None = None,
    timings: list[dict[str, Any]] | None = None,
    pool: Any = None,
) -> None:
    """Statuses, plots, post-run reports and the final ``run.json`` (signals do not stop it;
    one during the plots skips the rest of them). ``timeline``: the phases so far, completed
    here and stored in ``run.json``; ``timings``: the tasks' lines of ``timeline.csv``;
    ``pool``: a :class:`~deqbench.run.plots.PlotPool` draws the figures while the post-run reports
    run here (``outcomes_end`` then precedes ``plots_end``)."""
    phases = (timeline or {}).setdefault("phases", {})
    phases["finish_start"] = time.time()
    df = summary.results = res.load_results(run_dir)
    st = res.task_status(df)
    summary.failed = [
        (c, int(s), t, n)
        for c, s, t, n in zip(st["cell_id"], st["seed"], st["status"], st["note"])
        if t != "ok"
    ]
    if not summary.interrupted:
        try:
            with sig.interruptible():
                phases["plots_start"] = time.time()

                def reports() -> None:  # its phase keeps the name run.json has used
                    _reports(run_dir)
                    phases["outcomes_end"] = time.time()

                if plots:  # a copy: a plugin's plot may modify it; the summary prints df
                    if pool is None:
                        summary.plots = _plots(run_dir, df.copy())
                    else:
                        summary.plots = _plots(run_dir, df.copy(), pool, reports)
                phases["plots_end"] = time.time()
                if "outcomes_end" not in phases:
                    reports()
        except KeyboardInterrupt as exc:
            _log(run_dir, f"plots and post-run reports cut short by {exc}")
    if pool is not None and timeline is not None:  # how many plot functions it drew
        timeline["plot_pool"] = {"processes": pool.processes, "drawn": pool.drawn}
    if timings is not None:
        _write_timeline(run_dir, timings)
    if callable(describe):  # the cluster as it ended (workers joined, grouping)
        meta["executor"] = describe()
    meta.update(
        status="interrupted" if summary.interrupted else "complete",
        finished=time.strftime("%Y-%m-%dT%H:%M:%S"),
        tasks_finished=len(st),
        tasks_ok=int((st["status"] == "ok").sum()),
        tasks_flagged=int((st["status"] == res.FLAGGED).sum()),
        tasks_failed=int((~st["status"].isin(["ok", res.FLAGGED])).sum()),
        exit_code=summary.exit_code,
    )
    if timeline is not None:
        phases["end"] = time.time()
        meta.setdefault("timelines", []).append(timeline)  # one per invocation (resumes)
    if summary.signal:
        meta["cause"] = signal.Signals(summary.signal).name
    elif summary.cause:
        meta["cause"] = summary.cause
    elif summary.stopped:
        meta["cause"] = f"--stop-after: {len(summary.stopped)} task(s) unfinished"
    try:
        res.write_json(run_dir / "run.json", meta)
    except OSError as exc:
        _say(f"error: cannot update {run_dir / 'run.json'}: {type(exc).__name__}: {exc}")


def _reports(run_dir: Path) -> None:
    """Call the registered post-run reports (:mod:`deqbench.run.reports`: the claim summary
    ``summary.csv`` among them); their errors go to the log, never failing the run."""
    from .reports import write_reports

    for e in write_reports(run_dir):
        _log(run_dir, e)


def _plots(run_dir: Path, df: Any, pool: Any = None, meanwhile: Any = None) -> list[Path]:
    from .plots import write_plots

    try:
        paths, errors = write_plots(run_dir, df, pool, meanwhile)
    except BaseException as exc:  # plotting never fails a run (nor a plot's sys.exit ends it)
        if is_interruption(exc):
            raise
        paths, errors = [], [f"plots: {plugin_fault(exc)}"]
    for e in errors:
        _log(run_dir, e)
        _say(_plot_error_line(e))  # also on stderr (e.g. a full disk); the exit code stays
    return paths


def _plot_error_line(error: str) -> str:
    """One stderr line for an error line of :func:`~deqbench.run.plots.write_plots`:
    ``plots: <name> not written: <error>``."""
    first = error.strip().splitlines()[0] if error.strip() else "unknown error"
    head, sep, why = first.partition(" failed: ")
    if sep and head.startswith("plot '") and head.endswith("'"):
        return f"plots: {head[6:-1]} not written: {why}"
    return first if first.startswith("plots: ") else f"plots: {first}"
