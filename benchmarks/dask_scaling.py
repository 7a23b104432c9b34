"""Dask executor scaling: cells per hour inline on one GPU vs the local Dask cluster.

Two steps, so that the inline baseline can run while other work uses the second GPU:

    # 1. time one run (wall clock of the whole `deqbench run` process: start-up, cluster start,
    #    data, training, analyses, plots), then count its finished tasks (cell x seed)
    CUDA_VISIBLE_DEVICES=0 python benchmarks/dask_scaling.py time suites/kglm_denoise_gpu.yaml \\
        --executor inline --out results/scale --json inline.json
    python benchmarks/dask_scaling.py time suites/kglm_denoise_gpu.yaml \\
        --executor dask --out results/scale --json dask.json          # one worker per GPU
    # 2. ratio of cells per hour, and whether both runs produced the same rows
    python benchmarks/dask_scaling.py report inline.json dask.json

`time` also prints the run's breakdown (deqbench.run.timeline: start-up, run directory, cluster
wait, tasks with all workers busy, the tail, plots, outcome checks, exit; per worker its warm-up,
late start, cell work, first-task excess, task overhead, gaps, idle at the end) and keeps it in
the JSON; `report` prints both breakdowns and the Amdahl bound of the Dask run (its serial time
plus the inline task time split over the GPUs) next to the measured ratio. The
measurement with the defaults (CUDA graphs on):

    for n in 2 4; do
      CUDA_VISIBLE_DEVICES=0 python benchmarks/dask_scaling.py time suites/kglm_denoise_gpu.yaml \
          --executor inline --out results/scale$n --json inline$n.json -- --set deterministic=true
      CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n-1))) python benchmarks/dask_scaling.py time \
          suites/kglm_denoise_gpu.yaml --executor dask --out results/scale$n --json dask$n.json \
          -- --set deterministic=true
      python benchmarks/dask_scaling.py report inline$n.json dask$n.json --rtol 0
    done

`time` passes any extra arguments after `--` to `deqbench run` (e.g. `-- --set
defaults.train.epochs=2`). `report` compares every result row of the two runs (keys: cell, seed,
analysis, variant, metric, step, repeat), timing rows (unit s) aside: the set of keys must be
equal; values are compared with a relative tolerance (``--rtol``, default 1e-4: cuDNN picks
kernels per process, so GPU runs agree to rounding, not bit for bit) and the largest difference
is printed. Target: dask cells/hour >= 1.8 x inline on 2 GPUs (3.4 x on 4),
same results. `benchmarks/dask_profile.py` shows where a cell's time goes in a worker vs inline.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KEYS = ["cell_id", "seed", "analysis", "variant", "metric", "step", "repeat"]
#: targets: cells/hour of the Dask run over inline, by GPUs
TARGETS = {2: 1.8, 4: 3.4}


def _gpus() -> list[str]:
    try:
        import torch

        if torch.cuda.is_available():
            return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - best effort description only
        pass
    return []


def cmd_time(args: argparse.Namespace, extra: list[str]) -> None:
    out = Path(args.out) / args.executor
    cmd = [sys.executable, "-m", "deqbench", "run", args.suite, "--out", str(out), "--no-progress"]
    cmd += ["--executor", args.executor]
    if args.workers:
        cmd += ["--workers", str(args.workers)]
    cmd += extra
    print("+", " ".join(cmd), flush=True)
    launched = time.time()  # epoch: the breakdown lines it up with the run's own timestamps
    t0 = time.perf_counter()
    rc = subprocess.call(cmd)
    wall = time.perf_counter() - t0
    exited = time.time()
    runs = sorted(p.parent for p in out.glob("*/*/run.json"))
    if not runs:
        raise SystemExit(f"no run directory under {out} (exit {rc})")
    run_dir = runs[-1]
    from deqbench.run.results import RUNNER, load_results

    df = load_results(run_dir)
    tasks = df[["cell_id", "seed"]].drop_duplicates()
    failed = df[df.status != "ok"][["cell_id", "seed"]].drop_duplicates()
    task_time = df[(df.analysis == RUNNER) & (df.metric == "wall_time")]["value"].astype(float)
    rec = {
        "executor": args.executor,
        "workers": args.workers,
        "suite": args.suite,
        "extra": extra,
        "exit_code": rc,
        "wall_s": wall,
        "tasks": len(tasks),
        "tasks_not_ok": len(failed),
        "cells_per_hour": len(tasks) / wall * 3600.0,
        # sum of the tasks' own wall times (in their process): the work itself, without start-up,
        # cluster start, scheduling gaps and plots; inline vs dask shows any in-worker slowdown
        "task_time_sum_s": float(task_time.sum()),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        # the Dask cluster as it ended: workers per GPU, grouping of short cells
        "layout": json.loads((run_dir / "run.json").read_text()).get("executor"),
        "gpus": _gpus(),
        "run_dir": str(run_dir),
        "launched": launched,
        "exited": exited,
    }
    from deqbench.run.timeline import breakdown, format_breakdown

    try:
        rec["breakdown"] = breakdown(run_dir, launched=launched, exited=exited)
    except (ValueError, OSError, KeyError) as exc:  # a run of an older deqbench
        print(f"no breakdown: {exc}", flush=True)
    print(json.dumps({k: v for k, v in rec.items() if k != "breakdown"}, indent=1))
    if "breakdown" in rec:
        print("\n" + format_breakdown(rec["breakdown"], args.executor))
    if args.json:
        Path(args.json).write_text(json.dumps(rec, indent=1))


def _rows(run_dir: str):
    from deqbench.run.results import load_results

    df = load_results(run_dir)
    df = df[df.unit != "s"]
    return df.set_index(KEYS)["value"].astype(float).sort_index()


def compare(a_dir: str, b_dir: str, rtol: float) -> dict:
    a, b = _rows(a_dir), _rows(b_dir)
    only_a = a.index.difference(b.index)
    only_b = b.index.difference(a.index)
    common = a.index.intersection(b.index)
    av, bv = a.loc[common], b.loc[common]
    both_nan = av.isna() & bv.isna()
    diff = (av - bv).abs()
    scale = av.abs().combine(bv.abs(), max).clip(lower=1e-12)
    rel = (diff / scale).where(~both_nan, 0.0).fillna(math.inf)
    worst = rel.idxmax() if len(rel) else None
    return {
        "rows": int(len(common)),
        "only_in_first": int(len(only_a)),
        "only_in_second": int(len(only_b)),
        "rows_over_rtol": int((rel > rtol).sum()),
        "max_rel_diff": float(rel.max()) if len(rel) else 0.0,
        "worst_row": [str(k) for k in worst] if worst is not None else None,
        "rtol": rtol,
    }


def cmd_report(args: argparse.Namespace) -> None:
    base = json.loads(Path(args.baseline).read_text())
    other = json.loads(Path(args.other).read_text())
    ratio = other["cells_per_hour"] / base["cells_per_hour"]
    same = compare(base["run_dir"], other["run_dir"], args.rtol)
    gpus = ", ".join(sorted(set(base["gpus"] + other["gpus"]))) or "cpu"
    print(f"{gpus}; suite {base['suite']} {' '.join(base['extra'])}\n")
    print(
        "| executor | GPUs | tasks | not ok | wall s | sum of task times s | cells/hour | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r, x in ((base, 1.0), (other, ratio)):
        n = len(r["gpus"]) if r["gpus"] else 0
        label = r["executor"] + (f" --workers {r['workers']}" if r["workers"] else "")
        busy = r.get("task_time_sum_s")
        busy_s = f"{busy:.1f}" if busy is not None else "-"
        print(
            f"| {label} | {n} | {r['tasks']} | {r['tasks_not_ok']} | {r['wall_s']:.1f} | "
            f"{busy_s} | {r['cells_per_hour']:.0f} | {x:.2f} |"
        )
    for r in (base, other):
        if r.get("layout"):
            print(f"\n{r['executor']} layout: {json.dumps(r['layout'])}")
    ok = same["only_in_first"] == 0 and same["only_in_second"] == 0
    ok = ok and same["rows_over_rtol"] == 0
    print(
        f"\nsame rows: {'yes' if ok else 'NO'} ({same['rows']} rows compared, "
        f"{same['only_in_first']} / {same['only_in_second']} only in one run, "
        f"{same['rows_over_rtol']} over rtol {args.rtol:g}; max rel diff {same['max_rel_diff']:.2e}"
        f" at {same['worst_row']})"
    )
    n = len(other["gpus"]) or (other.get("workers") or 1)
    target = args.target if args.target is not None else TARGETS.get(n, 1.8)
    print(f"target cells/hour >= {target}x on {n} GPUs: {'met' if ratio >= target else 'NOT met'} "
          f"({ratio:.2f})")  # fmt: skip
    bounds = None
    from deqbench.run.timeline import amdahl, breakdown, format_breakdown, serial_budget

    for r in (base, other):  # recomputed from the run directory where it is still there
        try:
            r["breakdown"] = breakdown(r["run_dir"], launched=r["launched"], exited=r["exited"])
        except (KeyError, ValueError, OSError):
            pass
    if base.get("breakdown") and other.get("breakdown"):
        b, o = base["breakdown"], other["breakdown"]
        for label, r in ((base["executor"], b), (other["executor"], o)):
            print("\n" + format_breakdown(r, label))
        bounds = amdahl(b, o, n)
        budget = serial_budget(b, n, target)
        print(
            f"\nspeed-up on {n} GPUs: measured {bounds['measured']:.2f}; perfect packing of this "
            f"run's tasks {bounds['packing']:.2f}; Amdahl bound (this run's serial "
            f"{o['serial_s']:.1f} s + inline task time {b['task_phase_s']:.1f} s / {n}) "
            f"{bounds['amdahl']:.2f}; limit (serial only) {bounds['limit']:.2f}"
        )
        verdict = "possible" if budget > 0 and o["serial_s"] <= budget else "impossible"
        print(
            f"target {target}x needs serial time <= {budget:.1f} s with the inline task time "
            f"split perfectly over {n} GPUs; this run's serial time is {o['serial_s']:.1f} s: "
            f"{verdict} without cutting fixed costs"
            + (" (the inline task time alone exceeds it)" if budget <= 0 else "")
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"baseline": base, "other": other, "ratio": ratio, "same": same, "bounds": bounds},
                indent=1,
            )
        )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("time", help="run a suite once and record wall time and finished tasks")
    t.add_argument("suite")
    t.add_argument("--executor", choices=["inline", "dask"], default="inline")
    t.add_argument("--workers", type=int, default=None)
    t.add_argument("--out", default="results/scale")
    t.add_argument("--json", default=None)
    r = sub.add_parser("report", help="cells/hour ratio and row comparison of two `time` runs")
    r.add_argument("baseline")
    r.add_argument("other")
    r.add_argument("--rtol", type=float, default=1e-4)
    r.add_argument("--target", type=float, default=None, help="default: 1.8 on 2 GPUs, 3.4 on 4")
    r.add_argument("--json", default=None)
    argv = sys.argv[1:]
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    args = ap.parse_args(argv)
    if args.cmd == "time":
        cmd_time(args, extra)
    else:
        cmd_report(args)


if __name__ == "__main__":
    main()
