"""Where a run's wall time went: the breakdown of one ``deqbench run`` and its Amdahl bound.

The runner records, per invocation, the epoch seconds of its phases in ``run.json``
(``timelines[-1]``: ``phases`` and the Dask cluster's start in ``cluster``) and one line per
finished task in ``timeline.csv`` (worker, ``start``/``end`` of :func:`~deqbench.run.task.run_task`
on the worker, ``submitted``/``received`` by the coordinator, the worker's own start-up).
:func:`breakdown` cuts the wall time of the whole process, from ``launched`` (default: the
coordinator process's creation) to ``exited`` (default: the end of the run), into contiguous
phases, so that they sum to it:

=====================  ==================================================================
start-up               process start -> the runner starts (imports, CLI, suite validation;
                       a local cluster starts in the background meanwhile)
run directory          run.json, suite.yaml, tasks built
cluster wait           the coordinator waiting for its cluster (start not hidden)
tasks, all busy        cluster ready -> the first worker with nothing left to run
tail                   -> the last result (fewer workers busy than there are)
after last result      -> the executor let go (cancelling, closing an owned cluster)
result order           results.csv rewritten in the suite's order
plots                  plots/*.png (with the outcome checks where a plot pool drew them)
outcome checks         summary.csv (paper claims), after the plots
finishing              statuses, run.json
exit                   -> ``exited`` (the CLI closes the cluster, the interpreter exits)
=====================  ==================================================================

and, per worker, its time in the task phases (cluster ready -> last result): ``late start``
(until its first task started), ``cell work`` (the tasks' ``wall_time``: what a cell measures
itself), ``task overhead`` (the rest of :func:`run_task` on the worker: a warm-up left to the
first task, data loading, building the model rows), ``gaps`` (between its tasks: scheduling,
transfer, the coordinator's turn-around) and ``idle at the end``. ``first-task excess`` is the
first task's wall_time minus the median of the other seeds of its cell (CUDA/Triton compilation
and graph capture that later tasks of the same shape reuse), part of ``cell work``;
``first-task overhead`` vs ``later overhead median`` splits ``task overhead`` likewise (data
loaded once per worker, a warm-up not done at the worker's start); ``warm-up`` and ``ready`` are
the worker's own start-up (before it registered) and when it ended, from the launch.

:func:`amdahl` turns a breakdown into the best speed-up possible over a baseline (inline) run.

Example:
    >>> from deqbench.run.timeline import breakdown                       # doctest: +SKIP
    >>> b = breakdown("results/smoke/20250101-120000")                     # doctest: +SKIP
    >>> sum(b["phases"].values()) - b["wall_s"]                           # doctest: +SKIP
    0.0
"""

from __future__ import annotations

import csv
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

__all__ = ["PHASES", "breakdown", "amdahl", "format_breakdown"]

#: phases of :func:`breakdown`, in order (they sum to the wall time)
PHASES = [
    "start-up",
    "run directory",
    "cluster wait",
    "tasks, all busy",
    "tail",
    "after last result",
    "result order",
    "plots",
    "outcome checks",
    "finishing",
    "exit",
]


def _float(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if f == f else None


def wall_seconds(meta: dict[str, Any]) -> float | None:
    """A run's own wall time from its ``run.json`` (``meta``): the sum over its invocations
    (``timelines``, one per start and resume) of each one's ``run_start`` to ``end``, so that a
    run carried across several calls does not count the time between them (nor, where one
    process ran several suites, as ``deqbench reproduce`` does, the suites before it: its
    ``process_start`` is the process's); ``None`` without timelines.

    Example:
        >>> wall_seconds({"timelines": [{"phases": {"run_start": 0, "end": 480}},
        ...                             {"phases": {"run_start": 6000, "end": 6207}}]})
        687.0
    """
    total, seen = 0.0, False
    for tl in meta.get("timelines") or []:
        ph = tl.get("phases") if isinstance(tl, dict) else None
        if not isinstance(ph, dict):
            continue
        t0, t1 = _float(ph.get("run_start")), _float(ph.get("end"))
        if t0 is not None and t1 is not None and t1 >= t0:
            total, seen = total + (t1 - t0), True
    return total if seen else None


def _tasks(run_dir: Path, since: float) -> list[dict[str, Any]]:
    path = run_dir / "timeline.csv"
    if not path.exists():
        return []
    out = []
    with open(path, encoding="utf-8", newline="") as fh:
        for r in csv.DictReader(fh):
            t: dict[str, Any] = {
                k: _float(v) if k not in ("cell_id", "status", "worker", "device") else v
                for k, v in r.items()
            }
            received = t.get("received")
            if isinstance(received, float) and received >= since:
                out.append(t)
    return out


def _worker_accounting(
    ts: list[dict[str, Any]],
    walls: dict[str, list[float]],
    t_ready: float,
    last: float,
    t_launch: float,
) -> dict[str, Any]:
    """One worker's accounting in :func:`breakdown` (``ts``: its tasks, by start; ``walls``:
    the wall times of every cell's seeds)."""
    busy = sum(t["end"] - t["start"] for t in ts)
    work = sum(t["wall_time"] for t in ts)
    gaps = sum(max(0.0, b["start"] - a["end"]) for a, b in zip(ts, ts[1:]))
    first = ts[0]
    others = list(walls[first["cell_id"]])
    others.remove(first["wall_time"])
    excess = first["wall_time"] - statistics.median(others) if others else None
    warm = None
    if first.get("warmup_end") is not None and first.get("warmup_start") is not None:
        warm = first["warmup_end"] - first["warmup_start"]
    dispatch = [
        (t["received"] - t["submitted"]) - (t["end"] - t["start"])
        for t in ts
        if t.get("submitted") is not None
    ]
    return {
        "tasks": len(ts),
        "late start": first["start"] - t_ready,
        "cell work": work,
        "task overhead": busy - work,
        "gaps": gaps,
        "idle at the end": last - ts[-1]["end"],
        "first-task excess": excess,
        "first task wall": first["wall_time"],
        # the first task's time on the worker outside its cell's wall_time (data loading, a
        # warm-up the worker did not do at start) vs the median of the later tasks'
        "first-task overhead": (first["end"] - first["start"]) - first["wall_time"],
        "later overhead median": statistics.median(
            [(t["end"] - t["start"]) - t["wall_time"] for t in ts[1:]]
        )
        if len(ts) > 1
        else None,
        "warm-up": warm,
        "process start": (first.get("process_start") or 0) - t_launch
        if first.get("process_start")
        else None,
        "ready": (first["warmup_end"] - t_launch) if first.get("warmup_end") else None,
        "dispatch latency median": statistics.median(dispatch) if dispatch else None,
    }


def breakdown(
    run_dir: str | Path, launched: float | None = None, exited: float | None = None
) -> dict[str, Any]:
    """The breakdown of the last invocation of ``run_dir`` (see the module docstring).

    Args:
        run_dir: a run directory written by this deqbench.
        launched: epoch seconds the process was launched (default: its recorded creation,
            else the runner's start).
        exited: epoch seconds it exited (default: the end of the run: ``exit`` is then 0).

    Returns:
        ``wall_s``; ``phases`` (name -> seconds, :data:`PHASES`, summing to ``wall_s``);
        ``cluster`` (``start_s``: its start in the background, ``wait_s``); ``workers`` (name ->
        its accounting, each summing to the task phases' length); ``totals`` (over workers);
        ``tasks``; ``slots``; ``serial_s`` (everything but the task phases) and ``task_time_s``
        (the tasks' time on their workers, ``end - start``).
    """
    run_dir = Path(run_dir)
    meta = json.loads((run_dir / "run.json").read_text())
    tl = (meta.get("timelines") or [{}])[-1]
    ph = {k: _float(v) for k, v in (tl.get("phases") or {}).items()}
    cl = {k: _float(v) for k, v in (tl.get("cluster") or {}).items()}
    run_start = ph.get("run_start")
    if run_start is None:
        raise ValueError(f"{run_dir}: no timeline in run.json (written by an older deqbench?)")
    t_launch = launched if launched is not None else (ph.get("process_start") or run_start)
    tasks = _tasks(run_dir, run_start)
    tasks_start = ph.get("tasks_start") or run_start
    wait = cl.get("cluster_wait_s") or 0.0
    t_ready = tasks_start + wait
    tasks_end = ph.get("tasks_end") or t_ready
    last = max([t["received"] for t in tasks], default=t_ready)
    last = min(max(last, t_ready), tasks_end)
    by_worker: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for t in tasks:
        by_worker[str(t.get("worker") or "?")].append(t)
    for ts in by_worker.values():
        ts.sort(key=lambda t: t["start"])
    # the first worker with nothing left: the earliest of the workers' last task ends
    idle = min((ts[-1]["end"] for ts in by_worker.values()), default=last)
    idle = min(max(idle, t_ready), last)
    finish = ph.get("finish_start") or tasks_end
    end = ph.get("end") or finish
    p_start = ph.get("plots_start") or finish
    p_end = ph.get("plots_end") or p_start
    o_end = ph.get("outcomes_end") or p_end
    # drawn by a PlotPool, the figures and the outcome checks overlap (outcomes_end first):
    # the overlap is counted under plots
    o_end = max(o_end, p_end)
    t_exit = exited if exited is not None else end
    phases = {
        "start-up": run_start - t_launch,
        "run directory": tasks_start - run_start,
        "cluster wait": wait,
        "tasks, all busy": idle - t_ready,
        "tail": last - idle,
        "after last result": tasks_end - last,
        "result order": finish - tasks_end,
        "plots": p_end - p_start,
        "outcome checks": o_end - p_end,
        "finishing": (p_start - finish) + (end - o_end),
        "exit": t_exit - end,
    }
    # the cell of each task -> the wall times of its seeds (first-task excess)
    walls: dict[str, list[float]] = defaultdict(list)
    for t in tasks:
        walls[t["cell_id"]].append(t["wall_time"])
    workers: dict[str, dict[str, Any]] = {}
    for name, ts in sorted(by_worker.items()):
        workers[name] = _worker_accounting(ts, walls, t_ready, last, t_launch)
    keys = ["late start", "cell work", "task overhead", "gaps", "idle at the end"]
    totals = {k: sum(w[k] for w in workers.values()) for k in keys}
    ex = [w["first-task excess"] for w in workers.values() if w["first-task excess"] is not None]
    totals["first-task excess"] = sum(ex) if ex else None
    wall = t_exit - t_launch
    task_phase = phases["tasks, all busy"] + phases["tail"]
    cluster_start: float | None = None
    ready, begun = cl.get("cluster_ready"), cl.get("cluster_start")
    if ready is not None and begun is not None:
        cluster_start = float(ready) - float(begun)
    return {
        "wall_s": wall,
        "phases": phases,
        "cluster": {"start_s": cluster_start, "wait_s": wait},
        "workers": workers,
        "totals": totals,
        "tasks": len(tasks),
        "slots": max(1, len(workers)),
        "task_phase_s": task_phase,
        "serial_s": wall - task_phase,
        "task_time_s": sum(t["end"] - t["start"] for t in tasks),
        "cell_work_s": sum(t["wall_time"] for t in tasks),
    }


def amdahl(base: dict[str, Any], run: dict[str, Any], gpus: int) -> dict[str, float]:
    """Bounds on the speed-up of ``run`` over ``base`` (two :func:`breakdown` results; ``base``
    inline on one GPU, ``run`` on ``gpus`` GPUs):

    * ``measured``: base wall / run wall;
    * ``packing``: ``run``'s serial time plus its task time packed perfectly over its workers
      (no gaps, no tail): what better scheduling alone could reach;
    * ``amdahl``: ``run``'s serial time plus the baseline's task time split over ``gpus``
      (every GPU as fast per task as inline, no sharing loss): the best any scheduling and any
      worker layout can reach while the serial costs stay as measured;
    * ``limit``: base wall / ``run``'s serial time (infinitely many GPUs);
    * ``serial_for(target)`` is in :func:`serial_budget`.
    """
    w1 = base["wall_s"]
    s = run["serial_s"]
    p1 = base["task_phase_s"]
    return {
        "measured": w1 / run["wall_s"] if run["wall_s"] > 0 else float("nan"),
        "packing": w1 / (s + run["task_time_s"] / run["slots"]),
        "amdahl": w1 / (s + p1 / max(1, gpus)),
        "limit": w1 / s if s > 0 else float("inf"),
    }


def serial_budget(base: dict[str, Any], gpus: int, target: float) -> float:
    """The most serial time a run on ``gpus`` GPUs may have to reach ``target`` x ``base``'s
    speed with the baseline's task time split perfectly over the GPUs (negative: impossible)."""
    return base["wall_s"] / target - base["task_phase_s"] / max(1, gpus)


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def format_breakdown(b: dict[str, Any], label: str = "") -> str:
    """Markdown tables of a :func:`breakdown`: the phases (with their share of the wall time),
    the cluster's start and, per worker, its accounting."""
    wall = b["wall_s"]
    lines = [f"breakdown{' ' + label if label else ''}: wall {wall:.2f} s, {b['tasks']} tasks, "
             f"{b['slots']} workers", "", "| phase | s | share |", "|---|---|---|"]  # fmt: skip
    for k in PHASES:
        v = b["phases"][k]
        lines.append(
            f"| {k} | {v:.2f} | {v / wall:.1%} |" if wall > 0 else f"| {k} | {v:.2f} | - |"
        )
    lines.append(f"| **sum** | {sum(b['phases'].values()):.2f} | |")
    c = b["cluster"]
    lines += ["", f"cluster start (in the background) {_s(c['start_s'])} s, waited {c['wait_s']:.2f} s; "
              f"serial {b['serial_s']:.2f} s, task phases {b['task_phase_s']:.2f} s, task time on "
              f"workers {b['task_time_s']:.2f} s (cell work {b['cell_work_s']:.2f} s)", ""]  # fmt: skip
    cols = ["tasks", "ready", "warm-up", "late start", "cell work", "first-task excess",
            "task overhead", "gaps", "idle at the end", "first-task overhead",
            "later overhead median", "dispatch latency median"]  # fmt: skip
    lines += ["| worker | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, w in b["workers"].items():
        vals = [str(w["tasks"])] + [_s(w.get(k)) for k in cols[1:]]
        lines.append(f"| {name} | " + " | ".join(vals) + " |")
    t = b["totals"]
    lines.append("| **all** | " + str(b["tasks"]) + " | | | " + " | ".join(
        _s(t.get(k)) for k in cols[3:9]) + " | | | |")  # fmt: skip
    return "\n".join(lines)
