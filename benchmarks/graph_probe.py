"""Probe of the DEQ layer's solve paths on the benchmark cells (fc1024, conv64) (a diagnostic for choosing
``graph_steps``; the targets are measured by benchmarks/vs_torchdeq.py).

For conv64 and fc1024 (benchmarks/cells.py), float32, TF32 off: t_f of a plain loop, then per
solver the time of ``DEQLayer.solve`` eager and on the graph path with graph_steps 1, 2, 4, 8
(new inputs copied in every repeat, the capture in the warm-up), the f-evaluations made and up
to the first iterate below tol, and the overhead time / (nstep_to_tol x t_f). Then one IFT
training step (forward + backward) eager vs graph forward, split into parts.

    python benchmarks/graph_probe.py [--quick] [--device cuda]
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
from deqbench.solvers import get as get_solver  # noqa: E402
from deqbench.solvers.base import supports_graph  # noqa: E402


def timed(fn, repeats: int, warmup: int, cuda: bool) -> tuple[float, object]:
    out = None
    for _ in range(warmup):
        out = fn()
    ts = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3, out


def probe(cell, solvers: list[str], args: argparse.Namespace, cuda: bool) -> None:
    mod, x = cell.module, cell.x
    with torch.no_grad():
        tf, _ = timed(lambda: [mod(cell.z0, x) for _ in range(20)], 5, 3, cuda)
    tf /= 20
    print(f"\n{cell.desc}: t_f {tf:.4f} ms")
    xs = [x + 0.01 * i for i in range(4)]
    for sname in solvers:
        variants = [("eager", None)] + [(f"graph k={k}", k) for k in (1, 2, 4, 8)]
        for label, k in variants:
            opts = {} if k is None else {"graph_steps": k}
            layer = DEQLayer(mod, SolverConfig(sname, max_iter=100, tol=args.tol, options=opts))
            if k is None:
                layer.set_runtime(Runtime(cuda_graph="off"))
            it = iter(range(10**9))

            def solve(layer=layer, it=it):
                u = xs[next(it) % len(xs)]
                return layer.solve(u, torch.zeros_like(cell.z0))

            ms, (z, st) = timed(solve, args.repeats, 3, cuda)
            to_tol = st.extra.get("nstep_to_tol", st.nstep)
            print(
                f"  {sname:12s} {label:10s} {ms:8.3f} ms  path {st.path:6s} nstep {st.nstep:3d} "
                f"to_tol {to_tol:3d} rel {st.rel_max:.1e}  overhead {ms / (to_tol * tf):.2f}"
            )
    # one IFT training step: forward solve + adjoint, eager vs graph forward
    for label, rt in (("eager", Runtime(cuda_graph="off")), ("graph", Runtime())):
        layer = DEQLayer(
            mod,
            SolverConfig("anderson", max_iter=100, tol=1e-4),
            BackwardConfig("ift", solver="anderson", max_iter=100, tol=1e-6),
        )
        layer.set_runtime(rt)
        mod.requires_grad_(True)
        R = torch.randn_like(cell.z0)

        def fwd(layer=layer):
            return layer(x, torch.zeros_like(cell.z0))

        def step(layer=layer, R=R):
            z = fwd()
            (z * R).sum().backward()
            return z

        fms, _ = timed(lambda: fwd().detach(), args.repeats, 3, cuda)
        sms, _ = timed(step, args.repeats, 3, cuda)
        bst = layer.last_backward_stats
        print(
            f"  IFT step {label:6s} {sms:8.3f} ms (forward {fms:.3f} ms, backward "
            f"{sms - fms:.3f} ms; fwd nstep {layer.last_forward_stats.nstep}, adjoint nstep "
            f"{bst.nstep if bst else '-'} path {layer.last_forward_stats.path})"
        )
    with torch.enable_grad():
        mod.requires_grad_(True)

        def unrolled():
            z = cell.z0
            for _ in range(30):
                z = mod(z, x)
            (z * R).sum().backward()

        ums, _ = timed(unrolled, args.repeats, 3, cuda)
    print(f"  unrolled-30 step {ums:.3f} ms")


def main() -> int:
    ap = cellmod.probe_parser()
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--tol", type=float, default=1e-4)
    args = ap.parse_args()
    dev, cuda = cellmod.probe_device(args)
    print(
        f"device: {torch.cuda.get_device_name(dev) if cuda else 'cpu'}  torch {torch.__version__}"
    )
    solvers = [s for s in ("fixed_point", "anderson", "broyden") if supports_graph(get_solver(s))]
    for cell in cellmod.cells(args.quick, dev):
        probe(cell, solvers, args, cuda)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
