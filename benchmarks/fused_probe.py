"""Probe of the fused bookkeeping kernels (deqbench/solvers/fused.py) on the benchmark cells (fc1024, conv64): the
DEQ layer's default solve with the fused kernels on and off (``fused.ENABLED``), in one process,
side by side, and a kernel table (torch.profiler) of one solve per cell and solver, to see where
a step's time goes. A diagnostic; the targets are measured by benchmarks/vs_torchdeq.py.

    python benchmarks/fused_probe.py [--quick] [--device cuda] [--profile]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cells as cellmod  # noqa: E402
from graph_probe import timed  # noqa: E402

from deqbench.deq import DEQLayer, SolverConfig  # noqa: E402
from deqbench.solvers import fused  # noqa: E402
from deqbench.solvers.base import clear_graph_cache  # noqa: E402


def main() -> int:
    ap = cellmod.probe_parser()
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    dev, cuda = cellmod.probe_device(args, cudnn_benchmark=True)
    name = torch.cuda.get_device_name(dev) if cuda else "cpu"
    print(f"device: {name}  torch {torch.__version__}  fused usable: {fused.triton is not None}")
    for cell in cellmod.cells(args.quick, dev):
        mod, x = cell.module, cell.x
        with torch.no_grad():
            tf, _ = timed(
                lambda mod=mod, z0=cell.z0, x=x: [mod(z0, x) for _ in range(20)], 10, 2, cuda
            )
        tf /= 20
        print(f"\n{cell.desc}: t_f {tf:.4f} ms")
        xs = [x + 0.01 * i for i in range(4)]
        for sname in ("fixed_point", "anderson", "broyden"):
            for on in (False, True):
                fused.ENABLED = on
                clear_graph_cache()
                layer = DEQLayer(mod, SolverConfig(sname, max_iter=100, tol=args.tol))
                it = iter(range(10**9))

                def solve(layer=layer, it=it, xs=xs, z0=cell.z0):
                    with torch.no_grad():
                        return layer.solve(xs[next(it) % 4], torch.zeros_like(z0))

                ms, (z, st) = timed(solve, args.repeats, 2, cuda)
                to_tol = st.extra.get("nstep_to_tol", st.nstep)
                print(
                    f"  {sname:12s} fused={str(on):5s} {ms:8.3f} ms  path {st.path:6s} nstep "
                    f"{st.nstep:3d} to_tol {to_tol:3d} rel {st.rel_max:.2e}  overhead "
                    f"{ms / (to_tol * tf):.2f}  {st.status}"
                )
                if args.profile and on and cuda:
                    from torch.profiler import ProfilerActivity, profile

                    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                        solve()
                        torch.cuda.synchronize()
                    print(
                        prof.key_averages().table(
                            sort_by="cuda_time_total", row_limit=25, max_name_column_width=60
                        )
                    )
        fused.ENABLED = True
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
