"""Where a cell's time goes in a Dask worker vs inline.

The same cells (seed 0) run on one device in several settings, each after a warm-up cell (the
first cell again, not counted); per setting: the cells' own ``wall_time`` (as results.csv
records it), the thread CPU time of the cell's thread, the time inside ``train()`` and the
torch threads:

    inline          this process's main thread (the inline executor)
    thread          a thread of this process (a Dask worker runs cells in one)
    thread+sampler  that thread while another samples its stack every 10 ms (as Dask's
                    statistical profiler does, taking the GIL)
    dask+profile    local cluster, 1 worker, Dask's profiler on (distributed's default)
    dask            local cluster, 1 worker, deqbench's defaults (profiler off)
    dask 2/gpu      2 workers on the same device, the cells submitted at once: wall clock of the
                    batch (throughput), vs the inline sum

    CUDA_VISIBLE_DEVICES=0 python benchmarks/dask_profile.py suites/kglm_denoise_gpu.yaml \\
        --cells 3 -- --set deterministic=true

Prints a markdown table (card, dtype and flags in its header); ``--json`` keeps every number.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def measured(task):
    """Run one cell as a worker does (``run_cell``); its timings."""
    import time

    import torch

    from deqbench.run import train as trainmod
    from deqbench.run.executors.dask import run_cell

    spent = {"train": 0.0}
    orig = trainmod.train

    def timed_train(*a, **k):
        t = time.perf_counter()
        try:
            return orig(*a, **k)
        finally:
            spent["train"] += time.perf_counter() - t

    trainmod.train = timed_train
    c0, t0 = time.thread_time(), time.perf_counter()
    try:
        r = run_cell(task)
    finally:
        trainmod.train = orig
    return {
        "cell": task.cell.id,
        "status": r.status,
        "wall_time": r.wall_time,
        "outer": time.perf_counter() - t0,
        "thread_cpu": time.thread_time() - c0,
        "train": spent["train"],
        "torch_threads": torch.get_num_threads(),
    }


def sampler(stop: threading.Event, ident: int, interval: float = 0.01) -> None:
    """Walk another thread's stack every ``interval`` s (what a statistical profiler does)."""
    while not stop.wait(interval):
        frame = sys._current_frames().get(ident)
        seen = []
        while frame is not None:
            seen.append((frame.f_code.co_filename, frame.f_code.co_name, frame.f_lineno))
            frame = frame.f_back


def smi() -> str:
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=index,name,clocks.sm,clocks.max.sm,power.draw,"
             "temperature.gpu,utilization.gpu", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10,
        ).stdout.strip()  # fmt: skip
    except Exception:  # noqa: BLE001
        return ""


def in_thread(tasks, with_sampler: bool):
    out = []
    with ThreadPoolExecutor(1) as pool:
        pool.submit(measured, tasks[0]).result()  # warm cell: this thread's cuBLAS/cuDNN handles
        ident = pool.submit(threading.get_ident).result()
        stop = threading.Event()
        th = threading.Thread(target=sampler, args=(stop, ident), daemon=True)
        if with_sampler:
            th.start()
        try:
            for t in tasks:
                out.append(pool.submit(measured, t).result())
        finally:
            stop.set()
    return out


def in_dask(tasks, workers: int, profile: bool, device: str, concurrent: bool):
    from deqbench.run.executors.dask import DaskExecutor

    ex = DaskExecutor(workers=workers, profile=profile, max_per_gpu=1)
    t = time.perf_counter()
    ex.start(device, tasks[0].suite.threads, dtype=tasks[0].suite.dtype)
    started = time.perf_counter() - t
    try:
        c = ex.client
        c.submit(measured, tasks[0], pure=False).result()  # warm cell
        if workers > 1:  # warm the others too
            c.gather([c.submit(measured, x, pure=False) for x in tasks[:workers]])
        t = time.perf_counter()
        if concurrent:
            out = c.gather([c.submit(measured, x, pure=False) for x in tasks])
        else:
            out = [c.submit(measured, x, pure=False).result() for x in tasks]
        batch = time.perf_counter() - t
    finally:
        ex.close()
    return out, started, batch


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("suite")
    ap.add_argument("--cells", type=int, default=3, help="cells, spread over the suite's grid")
    ap.add_argument("--repeats", type=int, default=1, help="passes over the cells (median)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--only", nargs="*", default=None, help="settings to run (default all)")
    ap.add_argument("--json", default=None)
    argv = sys.argv[1:]
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    args = ap.parse_args(argv)
    overrides = [extra[i + 1] for i, a in enumerate(extra) if a == "--set"]

    import torch

    from deqbench.run.suite import load_suite
    from deqbench.run.task import Task

    suite = load_suite(args.suite, overrides=overrides, device=args.device, seeds=[0])
    device = suite.resolved_device()
    n = len(suite.cells)
    idx = sorted({round(k * (n - 1) / max(1, args.cells - 1)) for k in range(args.cells)})
    cells = [Task(suite, suite.cells[i], 0, device, "profile", None) for i in idx]
    tasks = cells * max(1, args.repeats)
    card = torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu"
    flags = suite.numeric_flags()
    print(f"# {card}; {suite.name}, {len(cells)} cells x {args.repeats}, {suite.dtype}, {flags}")

    settings = {
        "inline": lambda: ([measured(t) for t in tasks], None, None),
        "thread": lambda: (in_thread(tasks, False), None, None),
        "thread+sampler": lambda: (in_thread(tasks, True), None, None),
        "dask+profile": lambda: in_dask(tasks, 1, True, device, False),
        "dask": lambda: in_dask(tasks, 1, False, device, False),
        "dask 2/gpu": lambda: in_dask(tasks, 2, False, device, True),
    }
    measured(tasks[0])  # this process's warm-up, data load and first kernels
    rows = {}
    for name, fn in settings.items():
        if args.only and name not in args.only:
            continue
        before = smi()
        if name == "inline":
            measured(tasks[0])  # warm cell
        t = time.perf_counter()
        out, started, batch = fn()
        rows[name] = {
            "cells": out,
            "cluster_start_s": started,
            "batch_s": batch if batch is not None else time.perf_counter() - t,
            "smi_before": before,
            "smi_after": smi(),
        }
        tot = sum(c["wall_time"] for c in out)
        print(
            f"{name}: sum wall {tot:.2f} s, {[round(c['wall_time'], 2) for c in out]}", flush=True
        )

    def total(out, key="wall_time"):  # sum over cells of the median over repeats
        by: dict[str, list[float]] = {}
        for c in out:
            by.setdefault(c["cell"], []).append(c[key])
        return sum(statistics.median(v) for v in by.values())

    base = total(rows["inline"]["cells"]) if "inline" in rows else None
    print(f"\n{card}, {suite.dtype}, {flags}, torch {torch.__version__}\n")
    print("| setting | sum of cell wall_time s (median of repeats) | vs inline | thread CPU s | in train() s | "
          "torch threads | batch wall s | cluster start s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        cells = r["cells"]
        tot = total(cells)
        ratio = f"{tot / base:.3f}" if base else "-"
        cpu = total(cells, "thread_cpu")
        train = total(cells, "train")
        thr = statistics.mode(c["torch_threads"] for c in cells)
        cs = f"{r['cluster_start_s']:.1f}" if r["cluster_start_s"] is not None else "-"
        print(f"| {name} | {tot:.2f} | {ratio} | {cpu:.2f} | {train:.2f} | {thr} | "
              f"{r['batch_s']:.2f} | {cs} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"card": card, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
