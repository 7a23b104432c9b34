"""Host-side timers of the DEQ layer's graph-path solve on the fc1024 cell (launch-bound: the
host's work decides the wall time). Wraps the steps of a solve with perf_counter timers and
prints microseconds per solve: the whole call, the time until the first graph replay is
launched, after the last replay returns, and inclusive times of the tracker's methods (``stop``
and ``finish`` include their waits for the GPU). A diagnostic for trimming host work.

    python benchmarks/host_probe.py [--quick] [--device cuda] [--solves 200]
"""

from __future__ import annotations

import functools
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cells as cellmod  # noqa: E402

from deqbench.deq import DEQLayer, SolverConfig  # noqa: E402
from deqbench.solvers import base  # noqa: E402

ACC: dict[str, float] = defaultdict(float)
MARK: dict[str, float] = {}


def timer(name: str, fn):
    @functools.wraps(fn)
    def wrapped(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            ACC[name] += time.perf_counter() - t

    return wrapped


def main() -> int:
    ap = cellmod.probe_parser()
    ap.add_argument("--solves", type=int, default=200)
    args = ap.parse_args()
    dev, cuda = cellmod.probe_device(args)
    cell = [c for c in cellmod.cells(args.quick, dev) if c.name == "fc"][0]
    for name in ("enable_device_mode", "commit", "stop", "finish", "_consume"):
        setattr(base.Tracker, name, timer(name, getattr(base.Tracker, name)))
    if cuda:
        orig = torch.cuda.CUDAGraph.replay

        def replay(self):
            MARK.setdefault("first", time.perf_counter())
            ACC["replay"] += 0.0
            t = time.perf_counter()
            orig(self)
            MARK["last"] = time.perf_counter()
            ACC["replay"] += MARK["last"] - t

        torch.cuda.CUDAGraph.replay = replay
    for sname in ("fixed_point", "anderson", "broyden"):
        layer = DEQLayer(cell.module, SolverConfig(sname, max_iter=100, tol=1e-4))
        z0 = torch.zeros_like(cell.z0)
        for _ in range(5):
            with torch.no_grad():
                layer.solve(cell.x, z0)
        if cuda:
            torch.cuda.synchronize()
        ACC.clear()
        walls, pre, post = [], [], []
        for _ in range(args.solves):
            MARK.clear()
            t0 = time.perf_counter()
            with torch.no_grad():
                _, st = layer.solve(cell.x, z0)
            t1 = time.perf_counter()
            if cuda:
                torch.cuda.synchronize()
            t2 = time.perf_counter()
            walls.append(t2 - t0)
            if "first" in MARK:
                pre.append(MARK["first"] - t0)
                post.append(t1 - MARK["last"])
        n = args.solves
        walls.sort()
        us = {k: v / n * 1e6 for k, v in ACC.items()}
        print(
            f"{sname:12s} path {st.path} nstep {st.nstep}: wall median "
            f"{walls[n // 2] * 1e6:.0f} us (min {walls[0] * 1e6:.0f}); until the first replay "
            f"{sorted(pre)[len(pre) // 2] * 1e6 if pre else 0:.0f} us, after the last replay "
            f"{sorted(post)[len(post) // 2] * 1e6 if post else 0:.0f} us"
        )
        print("    " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(us.items())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
