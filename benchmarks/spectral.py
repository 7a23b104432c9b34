"""Spectral-norm and kGLM-init microbenchmarks (Tsuchida et al. 2022 figure 8).

Part 1, convolution spectral norms (C -> C, k x k, n x n input):
  * ``fft``: the exact circular norm by the FFT method of Sedghi, Gupta & Long (2018);
  * ``power_zero``: power iteration (+10 Lanczos steps) of the zero-padded operator with
    conv2d / conv_transpose2d;
  * ``power_circ``: the same for the circular operator (VJP adjoint);
  * ``dense``: SVD of the explicit operator matrix, only where C n^2 <= --dense-max.
  The table gives each time (median, IQR) and value; the gap fft - power_zero is how loose the
  circular bound is for zero padding.

Part 2, initialisation cost: kGLM vs random init of a fully connected layer pair (n x n) and a
C -> C 5x5 conv pair on 32x32 inputs (deqbench.kglm.analysis.init_cost_fc / init_cost_conv).

GPU: CUDA events after warm-ups, float32 with TF32 off, cudnn.benchmark on; the FFT and the
per-frequency SVDs run in float64 on the device. CPU: perf_counter and thread CPU time with an
explicit thread count. Every repeat is stored in the CSV.

Usage:
    python benchmarks/spectral.py                         # CUDA if available
    python benchmarks/spectral.py --quick --device cpu    # small sizes, ~1 min on 2 cores
    python benchmarks/spectral.py --out results/bench/spectral.csv
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deqbench import spectral as sp  # noqa: E402
from deqbench.kglm.analysis import init_cost_conv, init_cost_fc  # noqa: E402


def timed(
    fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int = 2
) -> tuple[list[float], list[float], Any]:
    """(wall ms per repeat, thread CPU ms per repeat, last result)."""
    out = None
    for _ in range(warmup):
        out = fn()
    walls, cpus = [], []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            c0 = time.thread_time()
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            walls.append(start.elapsed_time(end))
            cpus.append((time.thread_time() - c0) * 1e3)
        else:
            c0, t0 = time.thread_time(), time.perf_counter()
            out = fn()
            walls.append((time.perf_counter() - t0) * 1e3)
            cpus.append((time.thread_time() - c0) * 1e3)
    return walls, cpus, out


def med_iqr(xs: list[float]) -> tuple[float, float]:
    med = statistics.median(xs)
    if len(xs) < 4:
        return med, float("nan")
    q = statistics.quantiles(xs, n=4)
    return med, q[2] - q[0]


def conv_norms(args: argparse.Namespace, device: torch.device, writer: Any) -> list[str]:
    lines = ["| C | n | k | method | value | median ms | IQR ms |", "|---|---|---|---|---|---|---|"]
    g = torch.Generator().manual_seed(0)
    for c in args.channels:
        w = torch.randn(c, c, args.kernel, args.kernel, generator=g).to(device)
        n = args.size
        methods: dict[str, Callable[[], float]] = {
            "fft": lambda w=w, n=n: sp.conv_spectral_norm(w, (n, n)),
            "power_zero": lambda w=w, n=n: sp.conv_power_norm(w, (n, n), iters=args.power_iters),
            "power_circ": lambda w=w, n=n: sp.conv_power_norm(
                w, (n, n), padding_mode="circular", iters=args.power_iters
            ),
        }
        if c * n * n <= args.dense_max:
            methods["dense_zero"] = lambda w=w, n=n: float(
                torch.linalg.matrix_norm(sp.conv_matrix(w, (n, n)), ord=2)
            )
        for name, fn in methods.items():
            reps = args.repeats if name != "dense_zero" else min(args.repeats, 3)
            walls, cpus, val = timed(fn, device, reps, warmup=1)
            m, iqr = med_iqr(walls)
            lines.append(
                f"| {c} | {n} | {args.kernel} | {name} | {val:.6g} | {m:.3f} | {iqr:.3f} |"
            )
            for i, (wt, ct) in enumerate(zip(walls, cpus)):
                writer.writerow(["conv_norm", name, c, n, args.kernel, i, wt, ct, val])
            print(lines[-1], flush=True)
    return lines


def init_costs(args: argparse.Namespace, device: torch.device, writer: Any) -> list[str]:
    lines = ["| layer | size | kGLM median ms | random median ms |", "|---|---|---|---|"]
    for layer, sizes, fn in (
        ("fc", args.widths, lambda s: init_cost_fc(s, repeats=args.repeats, device=device)),
        (
            "conv",
            args.init_channels,
            lambda s: init_cost_conv(
                s, size=32, kernel_size=5, repeats=args.repeats, device=device
            ),
        ),
    ):
        for s in sizes:
            res = fn(s)
            for scheme, times in res.items():
                for i, t in enumerate(times):
                    writer.writerow(
                        ["init_cost", f"{layer}/{scheme}", s, "", "", i, t * 1e3, "", ""]
                    )
            kg, rd = statistics.median(res["kglm"]) * 1e3, statistics.median(res["random"]) * 1e3
            lines.append(f"| {layer} | {s} | {kg:.3f} | {rd:.3f} |")
            print(lines[-1], flush=True)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="small sizes (CPU smoke run)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--power-iters", type=int, default=100)
    ap.add_argument("--dense-max", type=int, default=4096, help="largest C*n*n for dense SVD")
    ap.add_argument("--out", default="results/bench/spectral.csv")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.benchmark = True
    args.kernel = 5
    if args.quick:
        args.channels, args.size = [1, 3, 8], 16
        args.widths, args.init_channels = [50, 250, 450], [1, 8, 16]
        args.repeats = min(args.repeats, 5)
    else:
        args.channels, args.size = [1, 3, 8, 16, 32, 64], 32
        args.widths = [50, 150, 250, 350, 450, 550, 650, 750, 850, 950]
        args.init_channels = [1, 3, 7, 15, 31, 63]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    header = (
        f"device {device} ({name}); torch {torch.__version__}; threads {args.threads}; "
        f"TF32 off; cudnn.benchmark {torch.backends.cudnn.benchmark}; "
        f"repeats {args.repeats}; power iterations {args.power_iters} (+10 Lanczos)"
    )
    print(header, flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as fh:
        wr = csv.writer(fh)
        wr.writerow(
            [
                "part",
                "method",
                "channels_or_width",
                "n",
                "k",
                "repeat",
                "wall_ms",
                "cpu_ms",
                "value",
            ]
        )
        lines = [f"<!-- {header} -->", "", "Convolution spectral norms", ""]
        lines += conv_norms(args, device, wr)
        lines += ["", "Initialisation cost", ""]
        lines += init_costs(args, device, wr)
    md = out.with_suffix(".md")
    md.write_text("\n".join(lines) + "\n")
    print(f"wrote {out} and {md}", file=sys.stderr)


if __name__ == "__main__":
    os.environ.setdefault("DEQBENCH_DISABLE_PLUGIN_AUTOLOAD", "1")
    main()
