"""The runner: cells x seeds -> tasks -> an executor -> rows -> the run directory.

The coordinator (:func:`run_suite`) alone writes the run directory: ``run.json``, the resolved
``suite.yaml``, ``results.csv`` (appended per finished task, crash-safe), ``series/``,
``log.txt`` (tracebacks of failed tasks) and ``plots/``. Tasks (:class:`deqbench.run.task.Task`) are
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

import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..core.errors import ConfigError
from . import results as res
from .task import Listener, Task, TaskResult, apply_numeric_flags, run_task

if TYPE_CHECKING:  # pragma: no cover
    from .suite import Suite

__all__ = [
    "Executor",
    "InlineExecutor",
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

    @property
    def exit_code(self) -> int:
        if self.interrupted:
            return 130
        return 1 if self.failed else 0


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
        if r.note:
            line += f" {r.note}"
        if self.bar is not None:
            self.bar.advance(self.cells)
            if r.failed:
                from rich.markup import escape

                self.bar.console.print(f"[red]{escape(line)}[/red]", markup=True, highlight=False)
        elif not self.quiet:
            print(line, file=sys.stderr, flush=True)


def _log(run_dir: Path, text: str) -> None:
    with open(run_dir / "log.txt", "a", encoding="utf-8") as fh:
        fh.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text.rstrip()}\n")


def _prepare(
    suite: Suite, out: str | Path | None, resume: str | Path | None, command: list[str] | None
) -> tuple[Path, dict[str, Any], set[tuple[str, int]]]:
    from .env import collect

    if resume is not None:
        run_dir = Path(resume)
        meta_path = run_dir / "run.json"
        if not meta_path.exists():
            raise ConfigError(f"--resume {resume}: not a run directory (no run.json)")
        meta = res.read_json(meta_path)
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
        done = res.drop_unfinished(run_dir)
        meta.setdefault("resumed", []).append(
            {
                "at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "command": command or list(sys.argv),
                "skipped_tasks": len(done),
            }
        )
        meta["status"] = "running"
        return run_dir, meta, done
    run_dir = res.new_run_dir(out if out is not None else suite.output, suite.name)
    (run_dir / "suite.yaml").write_text(suite.to_yaml(), encoding="utf-8")
    meta = {
        "run_id": run_dir.name,
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
        **collect(suite.device, command),
    }
    return run_dir, meta, set()


def run_suite(
    suite: Suite,
    out: str | Path | None = None,
    *,
    resume: str | Path | None = None,
    executor: Executor | None = None,
    progress: bool | None = None,
    plots: bool = True,
    command: list[str] | None = None,
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

    Returns:
        :class:`RunSummary` (``exit_code`` 0, 1 if a task failed, 130 if interrupted).
        KeyboardInterrupt is caught: rows of finished tasks are on disk, ``run.json`` says
        ``interrupted``. The suite's ``threads`` and numeric flags hold for the run; the
        process's own settings are restored afterwards.
    """
    from ..performance.measure import preserved_numerics

    with preserved_numerics():
        return _run_suite(suite, out, resume, executor, progress, plots, command)


def _run_suite(
    suite: Suite,
    out: str | Path | None,
    resume: str | Path | None,
    executor: Executor | None,
    progress: bool | None,
    plots: bool,
    command: list[str] | None,
) -> RunSummary:
    if suite.threads:
        import torch

        torch.set_num_threads(suite.threads)  # before collect(): run.json records it
    apply_numeric_flags(suite)  # likewise (TF32, cudnn.benchmark)
    run_dir, meta, done = _prepare(suite, out, resume, command)
    describe = getattr(executor, "describe", None)
    if callable(describe):  # e.g. the Dask cluster's layout
        meta["executor"] = describe()
    device = suite.resolved_device()
    meta["tasks_total"] = len(suite.cells) * len(suite.seeds)  # planned (cells x seeds)
    res.write_json(run_dir / "run.json", meta)
    writer = res.ResultsWriter(run_dir)
    tasks = [
        Task(suite, c, s, device, meta["run_id"], str(run_dir))
        for c in suite.cells
        for s in suite.seeds
        if (c.id, s) not in done
    ]
    summary = RunSummary(run_dir, meta["run_id"], len(tasks), len(done))
    _log(
        run_dir,
        f"{'resume' if resume else 'start'}: {len(tasks)} tasks on {device} "
        f"({len(done)} already finished)",
    )
    (run_dir / "series").mkdir(exist_ok=True)
    try:
        with _Progress(len(tasks), progress) as prog:
            for r in (executor or InlineExecutor()).run(tasks, prog):
                for fname, text in r.series.items():
                    res.write_atomic(run_dir / "series" / fname, text)
                writer.append(r.rows)
                _log(run_dir, f"{r.cell_id} seed={r.seed}: {r.status} {r.wall_time:.3f} s {r.note}")
                if r.traceback:
                    _log(run_dir, f"{r.cell_id} seed={r.seed} traceback:\n{r.traceback}")
                prog.finished(r)
    except KeyboardInterrupt:
        summary.interrupted = True
        _log(run_dir, "interrupted (KeyboardInterrupt); finished tasks are in results.csv")
    df = res.load_results(run_dir)
    st = res.task_status(df)
    summary.failed = [
        (c, int(s), t, n)
        for c, s, t, n in zip(st["cell_id"], st["seed"], st["status"], st["note"])
        if t != "ok"
    ]
    if plots and not summary.interrupted:
        summary.plots = _plots(run_dir, df)
    if not summary.interrupted:
        _outcomes(run_dir)
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
    res.write_json(run_dir / "run.json", meta)
    return summary


def _outcomes(run_dir: Path) -> None:
    """Write ``summary.csv`` (expected-behaviour checks) when the suite has a checker."""
    try:
        from ..outcomes import summarize

        summarize(run_dir)
    except Exception as exc:  # outcome checks never fail a run
        _log(run_dir, f"outcomes: {type(exc).__name__}: {exc}")


def _plots(run_dir: Path, df: Any) -> list[Path]:
    from .plots import write_plots

    try:
        paths, errors = write_plots(run_dir, df)
    except Exception as exc:  # plotting never fails a run
        paths, errors = [], [f"plots: {type(exc).__name__}: {exc}"]
    for e in errors:
        _log(run_dir, e)
    return paths
