"""``runtime.compile`` on the benchmark cells (fc1024, conv64): the time of ``DEQLayer.solve`` (Anderson, rel tol
1e-4, new inputs copied in each repeat) with the cell eager vs compiled by ``torch.compile``
(inductor), each on the layer's default path (CUDA graph for fc1024, eager for conv64), and one
IFT training step. float32, TF32 off; the compile time is reported apart (first call).

    python benchmarks/compile_probe.py [--quick] [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cells as cellmod  # noqa: E402

from deqbench.deq import BackwardConfig, DEQLayer, Runtime, SolverConfig  # noqa: E402


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def timed(fn, repeats: int, cuda: bool) -> float:
    ts = []
    for _ in range(repeats):
        _sync(cuda)
        t0 = time.perf_counter()
        fn()
        _sync(cuda)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def probe(cell, args: argparse.Namespace, cuda: bool) -> None:
    mod, x = cell.module, cell.x
    print(f"\n{cell.desc}")
    for label, rt in (("eager cell", Runtime()), ("compiled cell", Runtime(compile=True))):
        layer = DEQLayer(
            mod,
            SolverConfig("anderson", max_iter=100, tol=1e-4),
            BackwardConfig("ift", solver="anderson", max_iter=100, tol=1e-6),
        )
        layer.set_runtime(rt)
        xs = [x + 0.01 * i for i in range(3)]
        it = iter(range(10**9))

        def solve(layer=layer, xs=xs, it=it):
            with torch.no_grad():
                return layer.solve(xs[next(it) % 3], torch.zeros_like(cell.z0))

        _sync(cuda)
        t0 = time.perf_counter()
        solve()
        _sync(cuda)
        first = time.perf_counter() - t0
        for _ in range(3):
            solve()
        ms = timed(solve, args.repeats, cuda)
        _, st = solve()
        R = torch.randn_like(cell.z0)

        def step(layer=layer, R=R):
            (layer(x, torch.zeros_like(cell.z0)) * R).sum().backward()

        for _ in range(3):
            step()
        sms = timed(step, args.repeats, cuda)
        print(
            f"  {label:14s} solve {ms:8.3f} ms (path {st.path}, nstep {st.nstep}, rel "
            f"{st.rel_max:.1e}; first call {first:.1f} s)  IFT step {sms:8.3f} ms"
        )


def main() -> int:
    ap = cellmod.probe_parser()
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    dev, cuda = cellmod.probe_device(args)
    name = torch.cuda.get_device_name(dev) if cuda else "cpu"
    print(f"device: {name}  torch {torch.__version__}  float32, TF32 off")
    for cell in cellmod.cells(args.quick, dev):
        probe(cell, args, cuda)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
