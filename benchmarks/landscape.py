"""Landscape speed: a G x G grid over N examples vs the floor measured in the same run.

The floor is (grid points) x (one eval pass): for every grid point the parameters are written
into the model in place (not timed) and one plain ``model(X)`` under ``no_grad`` in ``eval()`` is
timed, so the floor does exactly the solver work of that point and nothing else. The landscape
is :func:`deqbench.landscape.evaluate_grid` on the same grid, directions and examples (its
parameter arithmetic, ``functional_call``, loss/accuracy and per-point solver statistics
included). Target (issue 7): landscape <= 1.2 x floor for ``conv_deq``, 51 x 51, 1024 examples,
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
(reported for both passes so one can check they did the same work).
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
    args = ap.parse_args()
    if args.merge:
        merge(args.merge, args.json)
        return

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
