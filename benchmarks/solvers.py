"""Solver benchmark: f-evaluations, time to tolerance and per-f-eval overhead.

For each cell (benchmarks/cells.py), relative tolerance and solver (fixed_point, anderson,
broyden, newton_krylov; optionally TorchDEQ's), this measures in the same repeat the wall time to
tolerance and the f-evaluations (counted by wrapping f; newton_krylov's Jacobian-vector products
are counted apart, column ``jvps``, and ``overhead`` divides by f-evaluations only), and reports

    overhead = median time / (f-evals * t_f),

where t_f is the median per-call time of f in a plain loop z <- f(z) at the same batch (no
bookkeeping, no grad): a solver with free bookkeeping has overhead 1. The residual reported is
recomputed on the returned iterate with one extra (untimed) f call.

GPU: CUDA events, warm-ups, median (and IQR) of ``--repeats`` runs; float32 with TF32 off and
cudnn.benchmark on. CPU: perf_counter and thread CPU time with an explicit thread count.

Usage:
    python benchmarks/solvers.py                          # full cells on CUDA if available
    python benchmarks/solvers.py --quick --device cpu     # small cells, < 1 min on 2 cores
    python benchmarks/solvers.py --torchdeq --out results/bench/solvers.csv
"""

from __future__ import annotations

import argparse
import csv
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cells as cellmod  # noqa: E402

import deqbench  # noqa: E402
from deqbench.performance.measure import Timing, f_time  # noqa: E402
from deqbench.solvers.base import residuals  # noqa: E402

SOLVERS = ("fixed_point", "anderson", "broyden", "newton_krylov")
GRAPH_SOLVERS = (
    "fixed_point[cuda_graph]",
    "anderson[cuda_graph]",
    "fixed_point[cuda_graph=cache]",
    "anderson[cuda_graph=cache]",
)
TOLS = (1e-4, 1e-6)


class Timer:
    """Wall time of a callable: CUDA events on GPU, perf_counter (+ thread CPU time) on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], Any]) -> tuple[float, float, Any]:
        """(wall ms, thread CPU ms, result)."""
        if self.cuda:
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            c0 = time.thread_time()
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end), (time.thread_time() - c0) * 1e3, out
        c0 = time.thread_time()
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        return (t1 - t0) * 1e3, (time.thread_time() - c0) * 1e3, out


def time_f(cell: cellmod.Cell, repeats: int, loop: int = 20) -> tuple[float, float]:
    """Median per-call (wall ms, thread CPU ms) of f in a plain loop z <- f(z) (no bookkeeping):
    deqbench.performance.measure.f_time, the same t_f the analyses use."""
    t = f_time(cell.f, cell.z0, repeats=max(repeats, 5), warmup=3, loop=loop)
    cpu = statistics.median(t.cpu_times) * 1e3 if t.cpu_times else float("nan")
    return t.median * 1e3, cpu


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """ "anderson" or "anderson[cuda_graph,m=5]" -> (name, options)."""
    if "[" not in spec:
        return spec, {}
    name, rest = spec.split("[", 1)
    opts: dict[str, Any] = {}
    for item in rest.rstrip("]").split(","):
        if not item:
            continue
        key, _, val = item.partition("=")
        if not val:
            opts[key] = True
            continue
        try:
            opts[key] = int(val)
        except ValueError:
            try:
                opts[key] = float(val)
            except ValueError:
                opts[key] = val
    return name, opts


def deqbench_runner(spec: str, tol: float, max_iter: int):
    name, opts = parse_spec(spec)
    solver = deqbench.solvers.get(name)

    def run(f: Callable, z0: torch.Tensor) -> tuple[torch.Tensor, int | None, str, int]:
        z, st = solver(f, z0, max_iter=max_iter, tol=tol, stop_mode="rel", **opts)
        return z, st.nstep, st.status, st.njvp

    return run


def torchdeq_runners(tol: float, max_iter: int) -> dict[str, Callable] | None:
    try:
        from torchdeq.solver import anderson_solver, broyden_solver, fixed_point_iter
    except Exception:  # not installed, or broken
        return None

    def wrap(fn: Callable, **kw: Any) -> Callable:
        def run(f: Callable, z0: torch.Tensor) -> tuple[torch.Tensor, int | None, str, int]:
            with torch.no_grad():
                out = fn(f, z0, max_iter=max_iter, tol=tol, stop_mode="rel", **kw)
            return out[0], None, "", 0

        return run

    return {
        "torchdeq.fixed_point_iter": wrap(fixed_point_iter),
        "torchdeq.anderson": wrap(anderson_solver),
        "torchdeq.anderson(lam=1e-10)": wrap(anderson_solver, lam=1e-10),
        "torchdeq.broyden": wrap(broyden_solver),
    }


def bench_one(
    cell: cellmod.Cell,
    run: Callable,
    timer: Timer,
    repeats: int,
    warmup: int,
) -> dict[str, Any]:
    calls = [0]

    def f(z: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return cell.f(z)

    with torch.no_grad():
        for _ in range(warmup):
            run(f, cell.z0)
        walls, cpus, evals = [], [], []
        out = None
        for _ in range(repeats):
            calls[0] = 0
            wall, cpu, out = timer(lambda: run(f, cell.z0))
            walls.append(wall)
            cpus.append(cpu)
            evals.append(calls[0])
        assert out is not None
        z, nstep, status, njvp = out
        fz = cell.f(z)
        a, r = residuals(fz, z)
    wt = Timing(times=walls)
    med, iqr = wt.median, wt.iqr
    return {
        # a CUDA-graph solve calls f in its eager step and capture only: trust nstep there
        "f_evals": nstep if nstep is not None else evals[-1],
        # Jacobian-vector products (newton_krylov): forward-mode AD, each also one call of f
        # (its primal), counted apart from the f-evaluations
        "jvps": njvp,
        "f_calls": evals[-1],
        "f_evals_constant": len(set(evals)) == 1,
        "nstep_reported": nstep,
        "status": status,
        "time_ms": med,
        "time_iqr_ms": iqr,
        "cpu_ms": statistics.median(cpus),
        "times_ms": ";".join(f"{t:.4f}" for t in walls),
        "rel_residual": float(r.max()),
        "abs_residual": float(a.max()),
    }


def environment(device: torch.device, threads: int) -> dict[str, Any]:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    return {
        "device": str(device),
        "device_name": name or platform.machine(),
        "torch": torch.__version__,
        "dtype": "float32",
        "tf32": bool(torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "threads": threads,
    }


def fmt(x: float, spec: str) -> str:
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=10, help="timed repeats per case (median)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default="results/bench/solvers.csv", help="CSV path ('' for none)")
    ap.add_argument("--quick", action="store_true", help="small cells (CPU sanity run)")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default 1 on CPU)")
    ap.add_argument("--max-iter", type=int, default=100)
    ap.add_argument("--tols", type=float, nargs="+", default=list(TOLS))
    ap.add_argument(
        "--solvers",
        nargs="+",
        default=None,
        help="solver specs, e.g. anderson 'anderson[cuda_graph,m=5]' (default: the three "
        "built-ins, plus fixed_point and anderson with cuda_graph on CUDA)",
    )
    ap.add_argument("--cells", nargs="+", default=["conv", "fc"], choices=["conv", "fc"])
    ap.add_argument(
        "--torchdeq", action="store_true", help="also run TorchDEQ's solvers if installed"
    )
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available", file=sys.stderr)
        return 2
    threads = args.threads or (1 if device.type == "cpu" else torch.get_num_threads())
    torch.set_num_threads(threads)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = True
    env = environment(device, threads)
    timer = Timer(device)
    repeats = args.repeats if not args.quick or args.repeats != 10 else 3
    warmup = args.warmup if not args.quick else min(args.warmup, 1)

    solvers = args.solvers or list(SOLVERS) + (list(GRAPH_SOLVERS) if device.type == "cuda" else [])
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    if args.torchdeq and torchdeq_runners(1e-4, 1) is None:
        notes.append("torchdeq is not installed: TorchDEQ rows skipped")
    for cell in cellmod.cells(quick=args.quick, device=device):
        if cell.name not in args.cells:
            continue
        t_f, t_f_cpu = time_f(cell, repeats, loop=10 if args.quick else 20)
        for tol in args.tols:
            runners: dict[str, Callable] = {
                s: deqbench_runner(s, tol, args.max_iter) for s in solvers
            }
            if args.torchdeq:
                runners.update(torchdeq_runners(tol, args.max_iter) or {})
            for sname, run in runners.items():
                try:
                    res = bench_one(cell, run, timer, repeats, warmup)
                except Exception as exc:  # report and go on with the other cases
                    notes.append(f"{cell.name} {tol:g} {sname}: {type(exc).__name__}: {exc}")
                    continue
                # (a CUDA-graph solve calls f in its eager step and capture only)
                graph = "cuda_graph" in sname
                if (
                    res["nstep_reported"] is not None
                    and not graph
                    and res["f_calls"] != res["f_evals"] + res["jvps"]
                ):
                    notes.append(
                        f"{cell.name} {tol:g} {sname}: nstep {res['nstep_reported']} but "
                        f"{res['f_calls']} f calls"
                    )
                row = {
                    "cell": cell.name,
                    "cell_desc": cell.desc,
                    "tol": tol,
                    "solver": sname,
                    **res,
                    "t_f_ms": t_f,
                    "t_f_cpu_ms": t_f_cpu,
                    # GPU: event (wall) times; CPU: thread CPU time, robust to a loaded machine
                    "overhead": (
                        (res["time_ms"] / t_f if device.type == "cuda" else res["cpu_ms"] / t_f_cpu)
                        / res["f_evals"]
                        if res["f_evals"]
                        else float("nan")
                    ),
                    "max_iter": args.max_iter,
                    "repeats": repeats,
                    **env,
                }
                rows.append(row)
                print(
                    f"  {cell.name:4s} {tol:7.0e} {sname:28s} f={res['f_evals']:3d} "
                    f"t={res['time_ms']:9.3f} ms  ovh={row['overhead']:.2f}",
                    file=sys.stderr,
                    flush=True,
                )

    cpu = device.type == "cpu"
    tkey, fkey = ("cpu_ms", "t_f_cpu_ms") if cpu else ("time_ms", "t_f_ms")
    print(
        f"\nSolver benchmark on {env['device_name']} ({env['device']}), torch {env['torch']}, "
        f"float32, TF32 {'on' if env['tf32'] else 'off'}, cudnn.benchmark "
        f"{env['cudnn_benchmark']}, threads {threads}, max_iter {args.max_iter}, "
        f"median of {repeats} (warm-up {warmup}); times are "
        f"{'thread CPU time' if cpu else 'CUDA-event wall time'}\n"
    )
    print(
        "| cell | tol | solver | f-evals | JVPs | time ms | t_f ms | overhead | rel residual "
        "| status |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['cell_desc']} | {r['tol']:.0e} | {r['solver']} | {r['f_evals']} | {r['jvps']} | "
            f"{fmt(r[tkey], '.3f')} | {fmt(r[fkey], '.4f')} | {fmt(r['overhead'], '.2f')} | "
            f"{r['rel_residual']:.2e} | {r['status'] or '-'} |"
        )
    tdq = {
        (r["cell"], r["tol"], r["solver"]): r for r in rows if r["solver"].startswith("torchdeq.")
    }
    if tdq:
        pairs = {
            "fixed_point": "torchdeq.fixed_point_iter",
            "anderson": "torchdeq.anderson",
            "broyden": "torchdeq.broyden",
        }
        print("\nRatios deqbench / TorchDEQ (f-evals, time):\n")
        print("| cell | tol | solver | f-evals | TorchDEQ f-evals | time ratio |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            other = tdq.get((r["cell"], r["tol"], pairs.get(r["solver"], "")))
            if other:
                print(
                    f"| {r['cell_desc']} | {r['tol']:.0e} | {r['solver']} | {r['f_evals']} | "
                    f"{other['f_evals']} | {r[tkey] / other[tkey]:.2f} |"
                )
    for n in notes:
        print(f"\nnote: {n}")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(rows[0]) if rows else ["cell"])
            w.writeheader()
            w.writerows(rows)
        print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
