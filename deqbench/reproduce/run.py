"""``deqbench reproduce``: run the claim suites, apply the checkers, write the report.

:func:`reproduce` picks the claims (by paper or id), resolves each claim's suite file for the
scale (:func:`suite_file`), runs every needed suite once through the runner (claims sharing a
suite share its run), extracts each claim's checker inputs from the run directory
(:mod:`.extract`), applies its checker (:mod:`.checks`) and writes ``reproduction.csv``
(:data:`REPORT_COLUMNS`) and ``reproduction.md`` into the output folder.

Scales:

* ``cpu``: ``suites/repro/<suite>_cpu.yaml`` where it exists (3 seeds, real ``mnist5k`` digits
  where the claim is about MNIST, small models; :data:`CPU_SUITES` maps suites that share a
  run), else ``suites/<suite>.yaml``. Absolute claims are not run (reason ``scale``).
* ``paper``: ``suites/paper/<suite>.yaml`` (:data:`PAPER_SUITES` maps suites that share a run),
  every hyperparameter cited to the paper, the paper's dataset where its files are under
  ``--data-root`` and ``mnist5k`` standing in elsewhere (the ``data`` column says which); none:
  the claim is ``not run`` with reason ``no paper-scale suite``.

Flagged and diverged cells are measurements (the checker's convergence rule decides); a suite
that failed (an error, errored tasks) or was interrupted gives ``not run`` for every claim resting
on it, with that reason, and the command's exit code says so (:func:`reproduce_run`).

Example:
    >>> from deqbench.reproduce.run import suite_file
    >>> suite_file("kglm_smooth", "cpu").name
    'kglm_smooth_cpu.yaml'
"""

from __future__ import annotations

import contextlib
import csv
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from ..run.results_reader import run_meta
from ..run.timeline import wall_seconds
from .claims import CLAIMS, PAPERS, Claim
from .verdicts import (
    CPU_SUITES,
    PAPER_DATA,
    PAPER_SUITES,
    REPORT_COLUMNS,
    ROOT_DATASETS,
    SuiteRun,
    data_text,
    describe_data,
    report_row,
    run_epochs,
    run_steps,
    selected,
    solver_text,
    steps_text,
    suite_file,
    suites_dir,
    verdict_for,
)

__all__ = [
    "CPU_SUITES",
    "PAPER_DATA",
    "PAPER_SUITES",
    "REPORT_COLUMNS",
    "ROOT_DATASETS",
    "RunOptions",
    "SuiteRun",
    "data_text",
    "describe_data",
    "rejudgeable_claims",
    "reproduce",
    "reproduce_run",
    "run_one",
    "select_claims",
    "suite_file",
    "suites_dir",
    "verdict_for",
    "write_report",
]


def rejudgeable_claims(paper: str, out: Path) -> list[str]:
    """The claim ids of ``paper`` that a report folder ``out`` can judge at paper scale without
    running anything: those whose paper-scale suite has a finished run under ``out/runs``, and
    those with no paper-scale suite (``not run``)."""
    ids = []
    for c in select_claims([paper]):
        f = None if c.suite is None else suite_file(c.suite, "paper")
        if f is None or previous_run(Path(out), f) is not None:
            ids.append(c.id)
    return ids


#: paper names accepted wherever a paper number is (case-insensitive): name -> key in PAPERS
PAPER_NAMES: dict[str, str] = {
    "kglm": "001",
    "pcdeq": "002",
    "opteq": "003",
    "thesis": "004",
    "ntk": "004",
}


def claim_id(name: str) -> str:
    """A claim id from its name: ``"pcdeq-lipschitz"`` (the paper's name, :data:`PAPER_NAMES`)
    and ``"002-lipschitz"`` (its number) name the same claim.

    Example:
        >>> claim_id("pcdeq-lipschitz"), claim_id("002-lipschitz")
        ('002-lipschitz', '002-lipschitz')
    """
    head, sep, rest = name.strip().partition("-")
    number = PAPER_NAMES.get(head.lower())
    return f"{number}-{rest}" if sep and number is not None else name.strip()


def select_claims(papers: Sequence[str] = (), ids: Sequence[str] = ()) -> list[Claim]:
    """Claims of ``papers`` (a name of :data:`PAPER_NAMES` such as ``"pcdeq"``, or its number
    ``"002"`` / ``"2"``; all when empty), restricted to ``ids`` (``pcdeq-lipschitz`` or
    ``002-lipschitz``: :func:`claim_id`)."""
    from ..core.errors import ConfigError

    norm = []
    for p in papers:
        q = PAPER_NAMES.get(p.strip().lower(), p.strip().zfill(3))
        if q not in PAPERS:
            names = ", ".join(f"{n} ({k})" for n, k in PAPER_NAMES.items())
            raise ConfigError(f"unknown paper {p!r}; known: {names}")
        norm.append(q)
    known = {c.id for c in CLAIMS}
    ids = [claim_id(i) for i in ids]
    bad = [i for i in ids if i not in known]
    if bad:
        raise ConfigError(f"unknown claim {', '.join(bad)}; known: {', '.join(sorted(known))}")
    return [c for c in CLAIMS if (not norm or c.paper in norm) and (not ids or c.id in ids)]


def _data_overrides(path: Path, data_root: Path | None) -> list[str]:
    """``data.root=DIR`` for a suite reading a torchvision dataset (``--data-root``)."""
    if data_root is None:
        return []
    from ..run.yamlio import read_yaml

    raw, _ = read_yaml(path)
    data = raw.get("data") if isinstance(raw, dict) else None
    name = data.get("name") if isinstance(data, dict) else data
    return [f"data.root={data_root}"] if name in ROOT_DATASETS else []


@dataclass(frozen=True)
class RunOptions:
    """How :func:`run_one` runs each suite: ``--set`` overrides (applied after the data root)
    and the executor (``deqbench run``'s ``--executor/--scheduler/--workers``)."""

    overrides: tuple[str, ...] = ()
    executor: str = "inline"
    scheduler: str | None = None
    workers: int | None = None
    #: continue the report folder's earlier runs: a finished run is reused as it is, an
    #: interrupted one resumed (``deqbench run --resume``), a missing one started
    resume: bool = False
    #: judge the report folder's runs as they are: nothing is started or resumed, a stopped
    #: run is judged on its finished tasks (:func:`judge_existing`)
    judge_only: bool = False


def previous_run(out: Path, path: Path) -> Path | None:
    """The latest run directory of the suite ``path`` under ``out/runs`` (None: none)."""
    found = sorted((out / "runs" / _suite_name(path)).glob("*/run.json"))
    return found[-1].parent if found else None


#: suite.yaml keys that may differ between the parts of one suite's grid judged together: the
#: part's cells (``select``, the matrix each part's cells come from), where it ran, its wording
#: and the ``paper:`` block (what the paper states, its cell patterns named as the cells were
#: then; read from the newest part); everything else (data, defaults, seeds, dtype, numeric
#: flags, analyses) must match
PART_KEYS = ("select", "matrix", "device", "threads", "output", "description", "paper")


def _cells_of(run_dir: Path) -> set[str]:
    """The cell ids a run ran (its run.json ``cells``)."""
    c = run_meta(run_dir).get("cells")
    return {str(x) for x in c} if isinstance(c, list) else set()


def companion_runs(out: Path, path: Path, run_dir: Path | None) -> list[Path]:
    """The other runs of suite ``path`` under ``out/runs`` to judge together with ``run_dir``:
    newest first, each with results, the same suite settings but :data:`PART_KEYS`, and none
    of the cells of ``run_dir`` or of a newer one taken (a part of the grid run separately,
    ``select``; a run of cells measured again later is left out). A part's own state counts:
    its errored or unfinished tasks are the suite's (:func:`part_state`)."""
    from .extract import suite_raw

    if run_dir is None:
        return []

    def settings(d: Path) -> str:
        raw = suite_raw(d)
        return repr(sorted((k, repr(v)) for k, v in raw.items() if k not in PART_KEYS))

    want, taken, found = settings(run_dir), _cells_of(run_dir), []
    if not taken:
        return []
    for d in sorted((out / "runs" / _suite_name(path)).glob("*/run.json"), reverse=True):
        d = d.parent
        if d.resolve() == run_dir.resolve() or not (d / "results.csv").is_file():
            continue
        mine = _cells_of(d)
        if mine and not mine & taken and settings(d) == want:
            found.append(d)
        taken |= mine
    return found


def part_state(run_dir: Path) -> tuple[list[str], list[str]]:
    """(errored, unfinished) tasks of a run: those whose training failed (:func:`errored_tasks`)
    and those with no results (:func:`unfinished_tasks`)."""
    return errored_tasks(run_dir), unfinished_tasks(run_dir)


def unfinished_tasks(run_dir: Path) -> list[str]:
    """For a run that did not end (stopped, interrupted, still running), its tasks with no
    results, as ``cell seed N`` (a complete run: none, its results not read)."""
    from ..run.results import load_results, task_status

    meta = run_meta(run_dir)
    if meta.get("status") == "complete":
        return []
    try:
        st = task_status(load_results(run_dir, check_keys=False))
        have = {(str(c), int(sd)) for c, sd in zip(st["cell_id"], st["seed"])}
    except Exception:
        have = set()
    cells, seeds = meta.get("cells") or [], meta.get("seeds") or []
    return [f"{c} seed {sd}" for c in cells for sd in seeds if (str(c), int(sd)) not in have]


def covers_grid(path: Path, dirs: Sequence[Path]) -> bool:
    """Whether the runs ``dirs`` together measured every cell of suite ``path``'s grid."""
    from ..run.suite import load_suite

    try:  # the grid, wherever this runs (a GPU suite's cells are the same on a CPU)
        want = {c.id for c in load_suite(path, overrides=["device=cpu"]).cells}
    except Exception:
        return False
    have: set[str] = set()
    for d in dirs:
        have |= _cells_of(d)
    return bool(want) and want <= have


def judge_existing(path: Path, out: Path, data_root: Path | None, log: TextIO,
                   options: RunOptions | None = None) -> SuiteRun:  # fmt: skip
    """``--judge-only``: suite ``path``'s latest run with results in ``out/runs`` as it is,
    nothing started or resumed. A run that did not end (``--stop-after``, a signal) is judged on
    its finished tasks, the others listed in :attr:`SuiteRun.unfinished`."""
    res = SuiteRun(path)
    found = sorted((out / "runs" / _suite_name(path)).glob("*/results.csv"))
    if not found:
        res.error = "not run: --judge-only and the folder holds no run of this suite with results"
        print(f"reproduce: suite {path.stem}: no run to judge", file=log, flush=True)
        return res
    run_dir = found[-1].parent
    code = run_meta(run_dir).get("exit_code")
    res.run_dir = run_dir
    res.exit_code = code if isinstance(code, int) else None
    res.errored, res.unfinished = part_state(run_dir)
    print(f"reproduce: suite {path.stem} judged as it is ({run_dir}"
          + (f"; {len(res.unfinished)} task(s) unfinished" if res.unfinished else "") + ")",
          file=log, flush=True)  # fmt: skip
    return res


def _status(run_dir: Path) -> tuple[str, int | None]:
    meta = run_meta(run_dir)
    if not meta:
        return "unreadable", None
    code = meta.get("exit_code")
    return str(meta.get("status", "")), code if isinstance(code, int) else None


def run_one(
    path: Path,
    out: Path,
    data_root: Path | None,
    log: TextIO,
    options: RunOptions | None = None,
) -> SuiteRun:
    """Run one suite into ``out/runs``; errors are kept in the result, not raised."""
    from ..run.executors import open_executor
    from ..run.runner import run_suite
    from ..run.suite import load_suite

    opt = RunOptions() if options is None else options

    res = SuiteRun(path)
    earlier = previous_run(out, path) if opt.resume else None
    if earlier is not None:
        status, code = _status(earlier)
        errored = errored_tasks(earlier)
        if status == "complete" and not errored:
            res.run_dir, res.exit_code, res.seconds = earlier, code, 0.0
            print(f"reproduce: suite {path.stem} reused ({earlier}, complete)", file=log,
                  flush=True)  # fmt: skip
            return res
        if status == "complete":  # errored tasks are run again, in a new run of the suite
            print(f"reproduce: suite {path.stem}: {len(errored)} errored task(s) in {earlier}, "
                  "running the suite again", file=log, flush=True)  # fmt: skip
            earlier = None
    what = f"resumed ({earlier})" if earlier is not None else f"started ({path})"
    print(f"reproduce: suite {path.stem} {what}", file=log, flush=True)
    t0 = time.perf_counter()
    try:
        suite = load_suite(path, overrides=[*_data_overrides(path, data_root), *opt.overrides])
        with open_executor(opt.executor, scheduler=opt.scheduler, workers=opt.workers,
                           suite=suite) as ex:  # fmt: skip
            summary = run_suite(suite, out / "runs", progress=False, plots=False,
                                command=sys.argv, executor=ex, resume=earlier)  # fmt: skip
        res.run_dir, res.exit_code = Path(summary.run_dir), summary.exit_code
        if summary.cause:
            res.error = str(summary.cause)
        if summary.interrupted and not summary.cause:
            res.interrupted = summary.exit_code
        res.errored = [f"{c} seed {sd} {st}: {n}" for c, sd, st, n in summary.failed
                       if st in ERRORED]  # fmt: skip
    except KeyboardInterrupt as exc:
        res.interrupted = getattr(exc, "exit_code", 130)
        found = sorted((out / "runs" / _suite_name(path)).glob("*/results.csv"))
        res.run_dir = found[-1].parent if found else None
    except Exception as exc:  # a failed suite still gives verdicts ("not run": why)
        res.error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
        found = sorted((out / "runs" / _suite_name(path)).glob("*/results.csv"))
        if found:
            res.run_dir = found[-1].parent
    res.seconds = time.perf_counter() - t0
    state = f"exit {res.exit_code}" if res.exit_code is not None else f"failed: {res.error}"
    print(
        f"reproduce: suite {path.stem} finished in {res.seconds:.1f} s ({state})"
        + (f" -> {res.run_dir}" if res.run_dir else ""),
        file=log,
        flush=True,
    )
    return res


#: task statuses of a task whose training failed (a run with one of them is run again by
#: ``--resume``; a flagged or diverged task is a measurement and stays)
ERRORED = ("error", "oom")


def errored_tasks(run_dir: Path) -> list[str]:
    """``cell seed status: note`` of the tasks of ``run_dir`` whose training failed."""
    from ..run.results import load_results, task_status

    try:
        st = task_status(load_results(run_dir, check_keys=False))
    except Exception:
        return []
    return [
        f"{c} seed {int(sd)} {t}: {n}"
        for c, sd, t, n in zip(st["cell_id"], st["seed"], st["status"], st["note"])
        if t in ERRORED
    ]


def _suite_name(path: Path) -> str:
    from ..run.yamlio import read_yaml

    try:
        raw, _ = read_yaml(path)
        return str(raw.get("name", path.stem)) if isinstance(raw, dict) else path.stem
    except Exception:
        return path.stem


def reproduce(papers: Sequence[str] = (), **kwargs: Any) -> Path:
    """Run the suites of the chosen claims and write the report; returns the output folder.
    The keyword arguments are :func:`reproduce_run`'s (which also returns the exit code)."""
    return reproduce_run(papers, **kwargs)[0]


def reproduce_run(
    papers: Sequence[str] = (),
    *,
    scale: str = "cpu",
    claim_ids: Sequence[str] = (),
    out: Path | None = None,
    data_root: Path | None = None,
    log: TextIO | None = None,
    options: RunOptions | None = None,
    runner: Callable[..., SuiteRun] | None = None,
) -> tuple[Path, int]:
    """Run the suites of the chosen claims and write the report; returns ``(folder, exit
    code)``.

    Args:
        papers: paper names or numbers (``"pcdeq"``, ``"002"`` ...); all when empty.
        scale: ``"cpu"`` or ``"paper"``.
        claim_ids: only these claim ids (after ``papers``).
        out: output folder (default ``results/reproduction/<YYYYmmdd-HHMMSS>``).
        data_root: root of torchvision datasets (also sets ``DEQBENCH_DATA_ROOT``).
        log: progress lines (default stderr): one per suite started and finished.
        options: ``--set`` overrides and the executor for every suite (:class:`RunOptions`).
        runner: runs one suite (default :func:`run_one`; tests pass a fake).

    The exit code: 0 when every suite ran to its end
    with every task trained, 1 when some suite failed (its claims are ``not run``, reason
    ``run failed``), 130 / 143 when a signal stopped the command (the suite running then and
    those after it are not run; the report says so and the resume command is printed). One
    writer per ``--out`` folder: a second ``reproduce`` on it is refused (RunLocked, exit 2)."""
    from ..core.errors import ConfigError
    from ..run.lock import RunLock

    if scale not in ("cpu", "paper"):
        raise ConfigError(f"--scale must be cpu or paper, got {scale!r}")
    log = sys.stderr if log is None else log
    if runner is None:
        runner = judge_existing if options is not None and options.judge_only else run_one
    claims = select_claims(papers, claim_ids)
    if not claims:
        raise ConfigError("no claim selected")
    if out is None:
        if options is not None and options.resume:
            raise ConfigError("--resume continues a report folder: name it with --out DIR")
        out = Path("results") / "reproduction" / time.strftime("%Y%m%d-%H%M%S")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a folder; name a folder")
    out.mkdir(parents=True, exist_ok=True)
    if data_root is not None:
        data_root = Path(data_root).expanduser()
        os.environ["DEQBENCH_DATA_ROOT"] = str(data_root)
    files: dict[str, Path | None] = {}
    for c in claims:
        skip = c.scale == "absolute" and scale == "cpu"
        files[c.id] = None if skip or c.suite is None else suite_file(c.suite, scale)
    runs: dict[Path, SuiteRun] = {}
    stopped: int | None = None
    t0 = time.perf_counter()
    with RunLock(out, command=list(sys.argv)), _terminate_interrupts():
        for path in dict.fromkeys(p for p in files.values() if p is not None):
            if stopped is not None:
                runs[path] = SuiteRun(path, error="not started: the command was interrupted")
                continue
            try:
                sr = runner(path, out, data_root, log, options)
            except KeyboardInterrupt as exc:
                sr = SuiteRun(path, interrupted=getattr(exc, "exit_code", 130))
            if sr.run_dir is not None and not sr.parts:
                sr.parts = companion_runs(out, path, sr.run_dir)
                for d in sr.parts:  # a part's failed or unfinished tasks are the suite's
                    errored, unfinished = part_state(d)
                    sr.errored += errored
                    sr.unfinished += unfinished
                if sr.parts:
                    sr.whole_grid = covers_grid(path, sr.dirs)
            runs[path] = sr
            if sr.interrupted is not None:
                stopped = sr.interrupted
        rows = []
        for c in claims:
            f = files[c.id]
            used = runs.get(f) if f is not None else None
            v, data = verdict_for(c, scale, used)
            rel = "; ".join(_rel(d, out) for d in used.dirs) if used else ""
            rd = used.dirs if used and used.dirs else None
            steps = steps_text(c, run_steps(rd), run_epochs(rd)) if rd is not None else ""
            rows.append(report_row(c, v, data, scale, rel, steps, solver_text(used)))
        write_report(out, rows, scale, runs, time.perf_counter() - t0)
    print(f"reproduce: wrote {out / 'reproduction.csv'} and {out / 'reproduction.md'}", file=log)
    if stopped is not None:
        again = " ".join(_resume_command(papers, scale, claim_ids, out, data_root))
        print(f"reproduce: interrupted; the report marks the claims of unfinished suites "
              f"'not run'. Resume with: {again}", file=log)  # fmt: skip
        return out, stopped
    failed = [f.stem for f, sr in runs.items() if not sr.complete]
    if failed:
        print(f"reproduce: {len(failed)} suite(s) failed: {', '.join(failed)} (their claims are "
              "not run; see the report's last table)", file=log)  # fmt: skip
        return out, 1
    partial = [f.stem for f, sr in runs.items() if sr.unfinished]
    if partial:  # not a success: the verdicts rest on a part of what the suites declare
        print(f"reproduce: {len(partial)} suite(s) judged on the finished tasks of a stopped "
              f"run: {', '.join(partial)} (the others are listed in each claim's reason)",
              file=log)  # fmt: skip
        return out, 1
    return out, 0


@contextlib.contextmanager
def _terminate_interrupts() -> Iterator[None]:
    """SIGTERM between suites interrupts like Ctrl-C (``Interrupted``, exit 143); inside a suite
    the runner's own handlers take over. Main thread only; the previous handler comes back."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    from ..run.runner import Interrupted

    def handler(signum: int, frame: object) -> None:
        raise Interrupted(signum)

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _resume_command(
    papers: Sequence[str], scale: str, claim_ids: Sequence[str], out: Path,
    data_root: Path | None,
) -> list[str]:  # fmt: skip
    cmd = ["deqbench", "reproduce", *papers, "--scale", scale, "--out", str(out), "--resume"]
    if claim_ids:
        cmd += ["--claims", ",".join(claim_ids)]
    if data_root is not None:
        cmd += ["--data-root", str(data_root)]
    return cmd


def _judged_by() -> str:
    """The commit of the code that judged (``+dirty`` for uncommitted changes), ``unknown``
    outside a git checkout."""
    from ..run.env import git_info

    g = git_info()
    if not g.get("commit"):
        return "unknown"
    return str(g["commit"])[:12] + ("+dirty" if g.get("dirty") else "")


def _rel(p: Path, base: Path) -> str:
    try:
        return str(Path(p).resolve().relative_to(base.resolve()))
    except ValueError:
        return str(p)


def _md(text: str) -> str:
    """A table cell: ``|`` escaped, one line, and ``[``/``]`` escaped (the measured notes in
    brackets are text, not links or cross-references)."""
    out = str(text).replace("|", "\\|").replace("\n", " ")
    return out.replace("[", "\\[").replace("]", "\\]")


def _provenance(sr: SuiteRun, run_dir: Path | None = None) -> tuple[str, str, float, str, str]:
    """(device, commit, seconds, cells, executor) of a suite's run from its ``run.json``: the
    device name (the card on CUDA), the commit with ``+dirty`` for uncommitted changes, the
    run's own wall time (:func:`~deqbench.run.timeline.wall_seconds`: summed over its start and
    resumes, so a reused or resumed run reports its own time, not this call's nor the time
    between its calls), how many cells ran (with the suite's ``select`` patterns when it ran a part of
    its grid) and how the tasks shared the machine (workers, GPUs, threads)."""
    import datetime as dt

    run_dir = sr.run_dir if run_dir is None else run_dir
    secs = sr.seconds if run_dir == sr.run_dir else math.nan
    meta: dict[str, Any] = {} if run_dir is None else run_meta(run_dir)
    if run_dir is None or not meta:
        return "", "", secs, "", ""
    device = str(meta.get("device_name") or meta.get("device") or "")
    git: dict[str, Any] = meta["git"] if isinstance(meta.get("git"), dict) else {}
    commit = str(git.get("commit") or "")[:12] + ("+dirty" if git.get("dirty") else "")
    if (own := wall_seconds(meta)) is not None:
        secs = own
    else:  # a run.json without timelines: start to finish
        try:
            t0, t1 = (dt.datetime.fromisoformat(str(meta[k])) for k in ("started", "finished"))
            secs = (t1 - t0).total_seconds()
        except (KeyError, ValueError, TypeError):
            pass
    return device, commit, secs, _cells_run(run_dir, meta), _sharing(meta)


def _cells_run(run_dir: Path, meta: dict[str, Any]) -> str:
    """``5 cells (select pcdeq_l-*)``: the cells of the run, and the ``select`` patterns of its
    suite.yaml when the run was a part of the suite's grid."""
    cells = meta.get("cells")
    n = len(cells) if isinstance(cells, list) else None
    text = "" if n is None else f"{n} cell" + ("" if n == 1 else "s")
    sel = selected(run_dir)
    return text + (f" (select {', '.join(sel)})" if sel else "")


def _sharing(meta: dict[str, Any]) -> str:
    """How the run's tasks shared the machine: ``inline`` or ``dask: 16 workers on 1 GPU`` /
    ``dask: 15 workers x 1 thread (CPU)``, and over how many calls a resumed run ran (its start
    and each resume; a call killed before its finish recorded no timeline, which is said)."""
    resumed = meta.get("resumed")
    calls = 1 + (len(resumed) if isinstance(resumed, list) else 0)  # each start and resume
    timed = len(meta.get("timelines") or [])
    over = f", over {calls} calls (--resume)" if calls > 1 else ""
    if timed and calls > timed:  # a call killed before its finish recorded no time
        over += f"; the seconds leave out {calls - timed} call(s) that recorded no time"
    ex = meta.get("executor")
    if not isinstance(ex, dict):
        return "inline" + over
    n = ex.get("workers_joined") or ex.get("workers")
    gpus = ex.get("gpus") or []
    if gpus:
        where = f"on {len(set(map(str, gpus)))} GPU" + ("s" if len(set(map(str, gpus))) > 1 else "")
    else:
        where = f"x {ex.get('torch_threads', '?')} thread(s) (CPU)"
    asked = [_workers_asked(c) for c in _call_commands(meta)]
    if len(set(asked)) > 1:  # the executor recorded is the last call's: say each call's
        over += "; --workers per call: " + ", ".join(asked)
        return f"{ex.get('kind', '?')}: {n} workers {where} in the last call{over}"
    return f"{ex.get('kind', '?')}: {n} workers {where}{over}"


def _call_commands(meta: dict[str, Any]) -> list[list[str] | None]:
    """The command line of a run's start and of each of its resumes, in order (None where a
    call's was not recorded)."""
    resumed = meta.get("resumed")
    calls = resumed if isinstance(resumed, list) else []
    cmds = [meta.get("command")] + [r.get("command") if isinstance(r, dict) else None
                                    for r in calls]  # fmt: skip
    return [[str(a) for a in c] if isinstance(c, list) else None for c in cmds]


def _workers_asked(argv: list[str] | None) -> str:
    """The ``--workers`` value of a command line as the CLI reads it (the last one given),
    ``default`` where none is, ``?`` where the command was not recorded."""
    if argv is None:
        return "?"
    found = "default"
    for i, a in enumerate(argv):
        if a == "--workers" and i + 1 < len(argv):
            found = argv[i + 1]
        elif a.startswith("--workers="):
            found = a.split("=", 1)[1]
    return found


def write_report(
    out: Path,
    rows: Sequence[dict[str, str]],
    scale: str,
    runs: dict[Path, SuiteRun],
    seconds: float,
) -> None:
    """``reproduction.csv`` (:data:`REPORT_COLUMNS`) and ``reproduction.md`` into ``out``;
    ``seconds`` (this call's) is the total only where there are no runs: with runs, the total
    is the sum of their own wall times (start to finish in each ``run.json``)."""
    with open(out / "reproduction.csv", "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=list(REPORT_COLUMNS))
        w.writeheader()
        w.writerows(rows)
    counts = {k: sum(r["verdict"] == k for r in rows) for k in ("reproduced", "not reproduced",
                                                                 "not run")}  # fmt: skip
    # each run.json read once; a suite judged on several runs (parts of its grid): one each
    none: list[Path | None] = [None]  # a suite with no run: its row still says why
    prov = {(f, d): _provenance(sr, d) for f, sr in runs.items() for d in sr.dirs or none}
    # the runs' own wall times (a re-judged or resumed report: not this call's few seconds)
    if runs:
        seconds = sum(p[2] for p in prov.values() if not math.isnan(p[2]))
    lines = [
        f"# Reproduction report (scale {scale})",
        "",
        f"{len(rows)} claims: "
        + ", ".join(f"{n} {k}" for k, n in counts.items())
        + f"; {len(prov) if runs else 0} suite runs, {seconds:.0f} s in total.",
        "",
        f"Verdicts by deqbench at commit {_judged_by()}; each run's own commit is in the last "
        "table.",
        "",
        "A trend is reproduced when every one of >= 3 seeds goes the paper's way beyond the "
        "claim's threshold (thresholds and their sources: `thresholds` column of "
        "reproduction.csv). A claim about training dynamics measured below the paper's "
        "optimizer-step budget is `not run` (reason `scale: N of M paper steps`) whatever its "
        "direction; `direction` says where the measurement pointed.",
    ]
    for paper, cite in PAPERS.items():
        mine = [r for r in rows if r["paper"] == paper]
        if not mine:
            continue
        lines += [
            "",
            f"## {paper}: {cite}",
            "",
            "| claim | where | verdict | direction | measured | paper's value | steps (ours of "
            "paper's) | solver (stop rule) | data | reason | cause |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        cols = ("claim_id", "where", "verdict", "direction", "measured", "paper_value", "steps",
                "solver", "data", "reason", "cause")  # fmt: skip
        lines += ["| " + " | ".join(_md(r[k]) for k in cols) + " |" for r in mine]
    if runs:
        lines += [
            "",
            "| suite | seconds | device | cells | shared by | commit | run directory | error |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for (f, d), (device, commit, secs, cells, sharing) in prov.items():
            sr = runs[f]
            rd = _rel(d, out) if d else ""
            err = sr.error if d == sr.run_dir else ""
            # this run's own unfinished tasks, not a part's
            left = unfinished_tasks(d) if d is not None and sr.unfinished else []
            if left:
                err = (f"{err}; " if err else "") + (
                    f"stopped: {len(left)} task(s) unfinished, judged on the others"
                )
            lines.append(
                f"| {f.stem} | {secs:.1f} | {_md(device)} | {_md(cells)} | {_md(sharing)} | "
                f"{_md(commit)} | {_md(rd)} | {_md(err)} |"
            )
    (out / "reproduction.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
