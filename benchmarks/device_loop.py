"""Solves without host round trips: the device loop (``graph_steps="loop"``) against the
chunked CUDA-graph path and the eager solver, on the benchmark cells.

For conv64 (batch 128) and fc1024 (batch 512) of :mod:`cells`, fixed point, Anderson and
Broyden at rel tol 1e-4 and 1e-6 (max_iter 100, float32, TF32 off), each solve through the
solver with ``cuda_graph="cache"`` (what the DEQ layer's default path calls) and
``graph_steps`` in {1, "auto", "loop"}:

* ms a solve: median of ``--repeats`` solves after ``--warmup`` (the graph captured in the
  first), the device synchronised around each;
* f-evaluations made (``nstep``) and up to the first iterate under tol (``nstep_to_tol``);
* overhead: ms / (nstep_to_tol x t_f), t_f the fastest of the repeats of a plain loop of
  f-evaluations (the benchmark's floor, as benchmarks/vs_torchdeq.py defines it);
* same: whether the returned iterate, ``nstep`` and the status equal those of
  ``graph_steps=1`` (one step per replay: the host reads every step, so it stops where the
  eager test does) bit for bit.

    python benchmarks/device_loop.py --out results/device_loop          # CUDA
    python benchmarks/device_loop.py --quick --device cpu --out /tmp/dl  # the wiring, on CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cells import cells, probe_device  # noqa: E402

from deqbench.core.registry import solvers  # noqa: E402
from deqbench.solvers.base import clear_graph_cache, loop_supported  # noqa: E402

SOLVERS = ("fixed_point", "anderson", "broyden")
TOLS = (1e-4, 1e-6)
MODES: tuple[Any, ...] = (1, "auto", "loop")


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def t_f(f: Any, z: torch.Tensor, cuda: bool, n: int = 20, repeats: int = 5) -> float:
    """Seconds per f-evaluation of a plain loop (the fastest of ``repeats``)."""
    best = float("inf")
    with torch.no_grad():
        for _ in range(repeats):
            sync(cuda)
            t = time.perf_counter()
            y = z
            for _ in range(n):
                y = f(y)
            sync(cuda)
            best = min(best, (time.perf_counter() - t) / n)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--max-iter", type=int, default=100)
    ap.add_argument("--solvers", nargs="+", default=list(SOLVERS))
    args = ap.parse_args()
    dev, cuda = probe_device(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "loop_supported": loop_supported(),
    }
    print(json.dumps(env), flush=True)
    rows = []
    for cell in cells(args.quick, dev):
        f = cell.f  # one bound method: the graph cache keys on f itself
        with torch.no_grad():
            tf = t_f(f, cell.z0, cuda)
            for name in args.solvers:
                fn = solvers.get(name)
                for tol in TOLS:
                    ref = None
                    for mode in MODES:
                        clear_graph_cache()
                        kw = dict(max_iter=args.max_iter, tol=tol, stop_mode="rel")
                        times = []
                        for i in range(args.warmup + args.repeats):
                            sync(cuda)
                            t = time.perf_counter()
                            z, st = fn(f, cell.z0, **kw, cuda_graph="cache", graph_steps=mode)
                            sync(cuda)
                            if i >= args.warmup:
                                times.append(time.perf_counter() - t)
                        to_tol = int(st.extra.get("nstep_to_tol", st.nstep))
                        if mode == 1:
                            ref = (z, st.nstep, st.status)
                        assert ref is not None
                        same = torch.equal(z, ref[0]) and st.nstep == ref[1] and st.status == ref[2]
                        ms = statistics.median(times) * 1e3
                        row = {
                            "cell": cell.name,
                            "desc": cell.desc,
                            "solver": name,
                            "tol": tol,
                            "graph_steps": str(mode),
                            "ran": str(st.extra.get("graph_steps", "")),
                            "ms": round(ms, 4),
                            "nstep": st.nstep,
                            "nstep_to_tol": to_tol,
                            "status": st.status,
                            "t_f_ms": round(tf * 1e3, 5),
                            "overhead": round(ms / (to_tol * tf * 1e3), 3),
                            "same_as_1": same,
                            "path": getattr(st, "path", ""),
                        }
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    (out / "device_loop.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    lines = [
        f"# device loop vs chunked graphs ({env['device']}, torch {env['torch']}, "
        f"CUDA {env['cuda']}, float32, TF32 off)",
        "",
        f"Device loop available in this torch: {env['loop_supported']} (where not, 'loop' runs "
        "what 'auto' runs: the 'ran' column).",
        "",
        "| cell | solver | tol | graph_steps (ran) | ms | nstep (to tol) | overhead | same as 1 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['cell']} | {r['solver']} | {r['tol']:g} | {r['graph_steps']} ({r['ran']}) "
            f"| {r['ms']:.3f} "
            f"| {r['nstep']} ({r['nstep_to_tol']}) | {r['overhead']:.2f} | {r['same_as_1']} |"
        )
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
