"""Landscape speed: a G x G grid over N examples vs the floor measured in the same run.

The floor is (grid points) x (one eval pass): for every grid point the parameters are written
into the model in place (not timed) and one plain ``model(X)`` under ``no_grad`` in ``eval()`` is
timed, so the floor does exactly the solver work of that point and nothing else. The landscape
is :func:`deqbench.landscape.evaluate_grid` on the same grid, directions and examples (its
parameter arithmetic, ``functional_call``, loss/accuracy and per-point solver statistics
included). Target: landscape <= 1.2 x floor for ``conv_deq``, 51 x 51, 1024 examples,
on an H100.

    python benchmarks/landscape.py --device cuda                       # 51 x 51, 1024, conv_deq
    python benchmarks/landscape.py --device cpu --model conv_deq_tiny --grid 5 --examples 64

A 51 x 51 conv_deq grid takes about 9 minutes per pass on an H100 (about 0.2 s a point), so the
grid can be split into shards of interleaved rows, each timed the same way (landscape and floor
on the same points), and merged:

    for k in 0 1 2; do python benchmarks/landscape.py --shard $k/3 --json shard$k.json; done
    python benchmarks/landscape.py --merge shard0.json shard1.json shard2.json

Prints a markdown table row and writes JSON (``--json``). Synthetic images (seeded N(0, 1), random
labels) are used: only the cost is measured, which depends on the solver's iteration counts
(reported for both passes so one can check they did the same work). The landscape of this mode is
solved cold (``--warm-start off``, the floor's own start) unless ``--warm-start`` says otherwise.

**Warm vs cold** (``--warm``): the same grid, directions, weights (the model's seeded
initialisation, ``torch.manual_seed(0)``: not trained) and examples solved twice in one process,
cold (every point from the model's own initial state) and warm (``warm_start="neighbour"``: every
point from its solved grid neighbours' fixed points, per example), same solver, tolerance and
stop rule. Reports the mean f-evaluations per point and the wall time of both and their ratios,
the converged share of both, the points that converged cold but not warm (target: none), the
largest relative loss difference warm vs cold (over the points both converged, and over all
points at their measured loss) and every point above ``--rel-threshold`` (1e-4) with both
losses and convergence: where both solves met the tolerance and the losses still differ, the
model has several fixed points there and the two starts found different ones. Target:
``conv_deq`` 51 x 51, 256 examples on an H100: warm <= 0.5 x cold f-evaluations, <= 0.6 x
cold time.

    python benchmarks/landscape.py --warm --examples 256 --out results_dir    # GPU, conv_deq
    python benchmarks/landscape.py --warm --quick                            # CPU wiring check

Memory: the peak of allocated device memory of each pass (CUDA), the ratio warm / cold
(``peak_memory_ratio``; target <= 2) and what the warm starts kept at most (fixed points of how
many grid points, in all and on the device). ``--warm-store`` says where the warm starts keep
them (``auto``: host memory on a GPU, the few a point reads copied to the device; ``device``;
``host``); a comma-separated list runs the headline warm start once more per further store and
checks that it solved every point the same (``same_solves_as_headline``):

    python benchmarks/landscape.py --warm --examples 256 --warm-store host,device --out DIR

Writes ``warm_vs_cold.json`` (the summary; ``cold`` part written as soon as the cold pass is
done) and ``warm_vs_cold_points.csv`` (every point: cold and warm loss, convergence,
f-evaluations, warm init and relative difference) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import deqbench  # noqa: E402
from deqbench import landscape as ls  # noqa: E402
from deqbench.deq import SolverConfig, configure, deq_layers, is_deq  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    """Seconds of ``fn()`` (CUDA events on GPU, perf_counter on CPU)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def nsteps(model) -> float:
    return float(
        sum(
            layer.last_forward_stats.nstep
            for layer in deq_layers(model)
            if layer.last_forward_stats is not None
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="conv_deq")
    ap.add_argument(
        "--model-param",
        action="append",
        default=[],
        help="KEY=VALUE model factory params (repeatable)",
    )
    ap.add_argument("--grid", type=int, default=51)
    ap.add_argument("--range", default="-1:1")
    ap.add_argument("--examples", type=int, default=1024)
    ap.add_argument("--shape", default="3,32,32")
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--solver", default="anderson")
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--max-iter", type=int, default=50)
    ap.add_argument(
        "--batch-size", type=int, default=None, help="eval batch (default all examples)"
    )
    ap.add_argument("--points-per-batch", type=int, default=None)
    ap.add_argument(
        "--floor-every",
        type=int,
        default=1,
        help="time the floor on every k-th grid point and scale up",
    )
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--shard", default=None, help="K/N: only grid rows (beta values) with index = K mod N"
    )
    ap.add_argument(
        "--merge", nargs="+", default=None, help="merge shard JSON files and print the table"
    )
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--warm-start",
        default="off",
        help="warm start of the landscape in the floor mode (neighbour | nearest | centre | off)",
    )
    ap.add_argument("--warm", action="store_true", help="warm (neighbour) vs cold landscape")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="CPU wiring check: conv_deq_tiny on 1x8x8 inputs, 9 x 9, 32 examples (unless given)",
    )
    ap.add_argument("--rel-threshold", type=float, default=1e-4)
    ap.add_argument(
        "--warm-modes",
        default="neighbour",
        help="--warm: warm starts to time against cold, comma-separated (the first is the "
        "headline; e.g. neighbour,nearest)",
    )
    ap.add_argument(
        "--warm-store",
        default="auto",
        help="--warm: where the warm starts keep fixed points (auto | device | host), "
        "comma-separated: the first is the headline, each other one runs the headline warm "
        "start again and is checked point by point against it (e.g. host,device)",
    )
    ap.add_argument("--out", default=None, help="directory for the --warm mode's files")
    args = ap.parse_args()
    if args.merge:
        merge(args.merge, args.json)
        return
    if args.quick:
        given = set(sys.argv[1:])
        for flag, attr, value in (
            ("--model", "model", "conv_deq_tiny"),
            ("--shape", "shape", "1,8,8"),
            ("--grid", "grid", 9),
            ("--examples", "examples", 32),
            ("--device", "device", "cpu"),
            ("--warmup", "warmup", 1),
        ):
            if flag not in given:
                setattr(args, attr, value)

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.benchmark = True
    shape = tuple(int(s) for s in args.shape.split(","))
    g = torch.Generator().manual_seed(0)
    X = torch.randn(args.examples, *shape, generator=g).to(device=device, dtype=dtype)
    y = torch.randint(0, args.classes, (args.examples,), generator=g).to(device)
    mparams = {}
    for kv in args.model_param:
        k, _, v = kv.partition("=")
        mparams[k] = int(v) if v.lstrip("-").isdigit() else v
    torch.manual_seed(0)
    model = deqbench.models.create(args.model, in_shape=shape, num_outputs=args.classes, **mparams)
    model = model.to(device=device, dtype=dtype).eval()
    if is_deq(model):
        configure(model, SolverConfig(args.solver, max_iter=args.max_iter, tol=args.tol))
    dirs = ls.resolve_directions(model, ls.random_directions(model, 2, seed=0))
    ax = ls.axis(args.grid, *ls.parse_range(args.range))
    betas = ax
    if args.shard:
        k, n = (int(v) for v in args.shard.split("/"))
        betas = [b for i, b in enumerate(ax) if i % n == k]
    coords = [(a, b) for b in betas for a in ax]
    bs = args.batch_size or args.examples

    def eval_pass() -> None:
        with torch.no_grad():
            for i in range(0, args.examples, bs):
                model(X[i : i + bs])

    for _ in range(args.warmup):
        eval_pass()
    sync(device)

    if args.warm:
        warm_vs_cold(args, model, dirs, X, y, ax, betas, device)
        return

    # Landscape (all points).
    df = ls.evaluate_grid(
        model,
        dirs,
        X,
        y,
        alphas=ax,
        betas=betas,
        batch_size=args.batch_size,
        points_per_batch=args.points_per_batch,
        warm_start=args.warm_start,
    )
    land_s = float(df.attrs["seconds"])

    # Floor: the same points, parameters written in place (untimed), one plain eval pass timed.
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = dict(model.named_parameters())
    floor_times, floor_steps = [], []
    sample = coords[:: max(1, args.floor_every)]
    try:
        for a, b in sample:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(base[n] + a * dirs[0][n] + b * dirs[1][n])
            sync(device)
            floor_times.append(timed(eval_pass, device))
            floor_steps.append(nsteps(model))
    finally:
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(base[n])
    floor_s = sum(floor_times) * len(coords) / len(sample)
    land_steps = float(df["f_nstep"].sum()) if df["f_nstep"].notna().any() else math.nan
    floor_steps_total = sum(floor_steps) * len(coords) / len(sample) if is_deq(model) else math.nan
    out = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "model": args.model,
        "dtype": args.dtype,
        "grid": f"{args.grid}x{args.grid}",
        "shard": args.shard,
        "points": len(coords),
        "examples": args.examples,
        "solver": f"{args.solver} tol={args.tol} max_iter={args.max_iter}",
        "tf32": False if device.type == "cuda" else None,
        "cudnn_benchmark": device.type == "cuda",
        "threads": torch.get_num_threads(),
        "landscape_s": land_s,
        "floor_s": floor_s,
        "ratio": land_s / floor_s,
        "ms_per_point": 1e3 * land_s / len(coords),
        "floor_ms_per_point_median": 1e3 * statistics.median(floor_times),
        "f_evals_landscape": land_steps,
        "f_evals_floor": floor_steps_total,
        "floor_points_timed": len(sample),
        "vmap": bool(df.attrs.get("vmap")),
        "nonconverged_points": int((~df["converged"]).sum()),
    }
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    table(out)


def _env(args, device: torch.device) -> dict:
    cuda = device.type == "cuda"
    return {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "model": args.model,
        "weights": "initialisation (torch.manual_seed(0)), not trained",
        "data": f"synthetic N(0, 1) images {args.shape}, random labels, seed 0",
        "dtype": args.dtype,
        "grid": f"{args.grid}x{args.grid}",
        "range": args.range,
        "shard": args.shard,
        "examples": args.examples,
        "batch_size": args.batch_size or args.examples,
        "solver": f"{args.solver} tol={args.tol} max_iter={args.max_iter}",
        "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32) if cuda else None,
        "tf32_cudnn": bool(torch.backends.cudnn.allow_tf32) if cuda else None,
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark) if cuda else None,
        "threads": torch.get_num_threads(),
    }


def _pass(args, model, dirs, X, y, ax, betas, device, warm: str, store: str = "auto"):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    cpu0 = time.process_time()
    df = ls.evaluate_grid(
        model,
        dirs,
        X,
        y,
        alphas=ax,
        betas=betas,
        batch_size=args.batch_size,
        points_per_batch=args.points_per_batch,
        warm_start=warm,
        warm_store=store,
        spec_norm=False,
    )
    conv = df["converged"].astype(bool)
    info = {
        "warm_start": df.attrs["warm_start"],
        "seconds": float(df.attrs["seconds"]),
        "cpu_seconds": time.process_time() - cpu0,
        "ms_per_point": 1e3 * float(df.attrs["seconds"]) / len(df),
        "f_evals_per_point": float(df["f_nstep"].mean()),
        "f_evals_per_point_converged": float(df.loc[conv, "f_nstep"].mean()),
        "converged_points": int(conv.sum()),
        "converged_share": float(conv.mean()),
        "converged_examples_share": float(df["f_converged_frac"].mean()),
        "init": {str(k): int(v) for k, v in df["init"].value_counts().items()},
        "peak_memory_gib": (
            torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        ),
    }
    if "warm_frac" in df:
        info["warm_examples_share"] = float(df["warm_frac"].mean())
        info["predicted_examples_share"] = float(df["predicted_frac"].mean())
        info["retried_points"] = int(df["warm_retried"].astype(bool).sum())
    if "warm_store" in df.attrs:  # what the warm starts held at most
        info["warm_store"] = df.attrs["warm_store"]
        info["warm_kept_peak_points"] = int(df.attrs["warm_kept_peak_points"])
        info["warm_kept_peak_gib"] = df.attrs["warm_kept_peak_bytes"] / 2**30
        info["warm_device_peak_gib"] = df.attrs["warm_device_peak_bytes"] / 2**30
    return df, info


#: the per-point columns a warm pass determines (two stores must agree on every one)
SOLVE_COLS = ["loss_raw", "f_nstep", "f_residual", "converged", "warm_frac", "predicted_frac"]


def same_solves(a, b) -> dict:
    """Whether two warm passes over the same grid solved every point the same, bit for bit."""
    keys = ["alpha", "beta"]
    m = a[keys + SOLVE_COLS].merge(b[keys + SOLVE_COLS], on=keys, suffixes=("_a", "_b"))
    differ = {
        c: int((m[f"{c}_a"].astype(str) != m[f"{c}_b"].astype(str)).sum()) for c in SOLVE_COLS
    }
    return {"identical": not any(differ.values()), "points_differing": differ}


def compare(cold, warm, c: dict, w: dict, threshold: float):
    """The warm pass against the cold one: ratios, convergence, loss differences, the points
    above ``threshold`` (with why); and the merged per-point frame."""
    out: dict = {"warm": w}
    out["f_evals_ratio"] = w["f_evals_per_point"] / c["f_evals_per_point"]
    out["time_ratio"] = w["seconds"] / c["seconds"]
    pc, pw = c.get("peak_memory_gib"), w.get("peak_memory_gib")
    out["peak_memory_ratio"] = pw / pc if pc and pw is not None else None
    keys = ["alpha", "beta"]
    cols = ["loss_raw", "converged", "f_nstep", "f_converged_frac", "f_residual", "status"]
    extra = [
        k for k in ("init", "warm_frac", "predicted_frac", "init_alpha", "init_beta") if k in warm
    ]
    m = cold[keys + cols].merge(warm[keys + cols + extra], on=keys, suffixes=("_cold", "_warm"))
    m["converged_cold"] = m["converged_cold"].astype(bool)
    m["converged_warm"] = m["converged_warm"].astype(bool)
    m["rel_diff"] = (m["loss_raw_warm"] - m["loss_raw_cold"]).abs() / m["loss_raw_cold"].abs()
    both = m["converged_cold"] & m["converged_warm"]
    out["cold_converged_not_warm"] = int((m["converged_cold"] & ~m["converged_warm"]).sum())
    out["warm_converged_not_cold"] = int((~m["converged_cold"] & m["converged_warm"]).sum())
    out["max_rel_loss_diff_both_converged"] = float(m.loc[both, "rel_diff"].max())
    out["max_rel_loss_diff_all"] = float(m["rel_diff"].max())
    out["rel_threshold"] = threshold
    big = m[(m["rel_diff"] > threshold) | (m["converged_cold"] & ~m["converged_warm"])]

    def why(r) -> str:
        if r.converged_cold and r.converged_warm:
            return "both met the tolerance: different fixed points (the model has several there)"
        if not r.converged_cold and not r.converged_warm:
            return "neither met the tolerance"
        return "cold did not meet the tolerance" if not r.converged_cold else "warm did not"

    out["points_above_threshold"] = [
        {
            "alpha": float(r.alpha),
            "beta": float(r.beta),
            "rel_diff": float(r.rel_diff),
            "loss_cold": float(r.loss_raw_cold),
            "loss_warm": float(r.loss_raw_warm),
            "converged_cold": bool(r.converged_cold),
            "converged_warm": bool(r.converged_warm),
            "examples_converged_cold": float(r.f_converged_frac_cold),
            "examples_converged_warm": float(r.f_converged_frac_warm),
            "f_evals_cold": float(r.f_nstep_cold),
            "f_evals_warm": float(r.f_nstep_warm),
            "warm_init": str(getattr(r, "init", "")),
            "why": why(r),
        }
        for r in big.sort_values("rel_diff", ascending=False).itertuples()
    ]
    out["several_fixed_points"] = any(
        q["converged_cold"] and q["converged_warm"] for q in out["points_above_threshold"]
    )
    return out, m


def warm_vs_cold(args, model, dirs, X, y, ax, betas, device) -> None:
    """Cold and warm (neighbour) passes over the same grid; the comparison (module docstring)."""
    out_dir = Path(args.out) if args.out else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    res = {**_env(args, device), "points": len(ax) * len(betas)}

    def write() -> None:
        if out_dir is not None:
            (out_dir / "warm_vs_cold.json").write_text(json.dumps(res, indent=1))

    cold, res["cold"] = _pass(args, model, dirs, X, y, ax, betas, device, "off")
    write()
    print(f"cold: {json.dumps(res['cold'])}", flush=True)
    modes = [m.strip() for m in args.warm_modes.split(",") if m.strip()]
    stores = [v.strip() for v in args.warm_store.split(",") if v.strip()] or ["auto"]
    res["modes"] = {}
    headline = None
    for k, mode in enumerate(modes):
        warm, info = _pass(args, model, dirs, X, y, ax, betas, device, mode, stores[0])
        cmp, m = compare(cold, warm, res["cold"], info, args.rel_threshold)
        res["modes"][mode] = cmp
        if k == 0:
            headline = warm
            res["warm"] = info
            res.update({k2: v for k2, v in cmp.items() if k2 != "warm"})
            if out_dir is not None:
                m.to_csv(out_dir / "warm_vs_cold_points.csv", index=False)
        elif out_dir is not None:
            m.to_csv(out_dir / f"warm_vs_cold_points_{mode}.csv", index=False)
        write()
        print(f"{mode}: {json.dumps(cmp)}", flush=True)
    res["stores"] = {}
    for store in stores[1:]:  # the headline warm start again, its fixed points kept elsewhere
        other, info = _pass(args, model, dirs, X, y, ax, betas, device, modes[0], store)
        same = same_solves(headline, other)
        pc, pw = res["cold"]["peak_memory_gib"], info["peak_memory_gib"]
        res["stores"][store] = {
            "warm": info,
            "same_solves_as_headline": same,
            "peak_memory_ratio": pw / pc if pc and pw is not None else None,
        }
        write()
        print(f"{modes[0]}, warm_store {store}: {json.dumps(res['stores'][store])}", flush=True)
    print_warm_tables(args, res)


def _gib(v) -> str:
    return "-" if v is None else f"{v:.3g}"


def print_warm_tables(args, res: dict) -> None:
    """The warm-vs-cold table, the memory table and the points where warm and cold differ."""
    import pandas as pd

    c = res["cold"]
    print(
        "| card | model | grid | examples | dtype | warm start | cold s | warm s | time ratio | "
        "f-evals/point cold | warm | ratio | converged cold | warm | cold-not-warm | "
        "max rel loss diff (both conv.) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for mode, cmp in res["modes"].items():
        w = cmp["warm"]
        print(
            f"| {res['device']} | {res['model']} | {res['grid']} | {res['examples']} | "
            f"{res['dtype']} | {mode} | {c['seconds']:.2f} | {w['seconds']:.2f} | "
            f"{cmp['time_ratio']:.3f} | {c['f_evals_per_point']:.2f} | "
            f"{w['f_evals_per_point']:.2f} | {cmp['f_evals_ratio']:.3f} | "
            f"{c['converged_share']:.3f} | {w['converged_share']:.3f} | "
            f"{cmp['cold_converged_not_warm']} | {cmp['max_rel_loss_diff_both_converged']:.2e} |"
        )
    # peak allocated device memory (None on the CPU) and what the warm starts kept at most
    print(
        "| warm start | warm_store | peak GiB cold | peak GiB warm | warm / cold | "
        "kept points | kept GiB | of it on the device GiB | s | f-evals/point | same solves |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = [(mode, cmp["warm"], cmp["peak_memory_ratio"], "") for mode, cmp in res["modes"].items()]
    first = next(iter(res["modes"]), "")
    for st in res["stores"].values():
        same = "yes" if st["same_solves_as_headline"]["identical"] else "NO"
        rows.append((first, st["warm"], st["peak_memory_ratio"], same))
    for mode, w, ratio, same in rows:
        print(
            f"| {mode} | {w.get('warm_store', '-')} | {_gib(c['peak_memory_gib'])} | "
            f"{_gib(w['peak_memory_gib'])} | {'-' if ratio is None else f'{ratio:.2f}'} | "
            f"{w.get('warm_kept_peak_points', '-')} | {_gib(w.get('warm_kept_peak_gib'))} | "
            f"{_gib(w.get('warm_device_peak_gib'))} | {w['seconds']:.2f} | "
            f"{w['f_evals_per_point']:.2f} | {same or 'headline'} |"
        )
    for mode, cmp in res["modes"].items():
        big = cmp["points_above_threshold"]
        print(
            f"{mode}: {len(big)} points with rel loss diff > {args.rel_threshold:g} or "
            "converged cold only"
        )
        if big:
            print(pd.DataFrame(big).to_string(index=False))
        if cmp["several_fixed_points"]:
            print(
                f"NOTE ({mode}): at some points both solves met the tolerance with different "
                "losses: the model has several fixed points there and the warm start found "
                "another one."
            )
    print(json.dumps(res, indent=1))


def table(out: dict) -> None:
    print(
        "| card | model | grid | examples | landscape s | floor s | ratio | ms/point | f-evals landscape / floor |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {out['device']} | {out['model']} | {out['grid']} | {out['examples']} | {out['landscape_s']:.2f} | "
        f"{out['floor_s']:.2f} | {out['ratio']:.3f} | {out['ms_per_point']:.2f} | "
        f"{out['f_evals_landscape']:.0f} / {out['f_evals_floor']:.0f} |"
    )
    print(json.dumps(out, indent=1))


def merge(paths: list[str], dest: str | None) -> None:
    """Sum the shards' times, points and f-evaluations (same card, model and grid)."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    out = dict(parts[0])
    for key in ("device", "model", "grid", "examples", "dtype", "solver"):
        if any(p[key] != out[key] for p in parts):
            raise SystemExit(f"cannot merge: shards differ in {key}")
    for key in (
        "landscape_s",
        "floor_s",
        "points",
        "f_evals_landscape",
        "f_evals_floor",
        "floor_points_timed",
        "nonconverged_points",
    ):
        out[key] = sum(p[key] for p in parts)
    out["shard"] = f"merged {len(parts)}"
    out["ratio"] = out["landscape_s"] / out["floor_s"]
    out["ms_per_point"] = 1e3 * out["landscape_s"] / out["points"]
    out["floor_ms_per_point_median"] = statistics.median(
        p["floor_ms_per_point_median"] for p in parts
    )
    if dest:
        Path(dest).write_text(json.dumps(out, indent=1))
    table(out)


if __name__ == "__main__":
    main()
