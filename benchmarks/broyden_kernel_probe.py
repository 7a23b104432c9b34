"""Bandwidth of Broyden's two fused update kernels (``fused.broyden_update``) on the conv64
state (batch 128 x 65536, issue 31): time per call and effective GB/s (rows read twice, four
rows written) for several pair counts and tilings, beside a plain copy of the same rows.

    python benchmarks/broyden_kernel_probe.py [--quick]
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cells as cellmod  # noqa: E402

from deqbench.solvers import fused  # noqa: E402
from deqbench.solvers.base import chunking  # noqa: E402


def timed(fn, n: int = 30) -> float:
    for _ in range(3):
        fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n


def main() -> int:
    ap = cellmod.probe_parser()
    args = ap.parse_args()
    dev, cuda = cellmod.probe_device(args)
    assert cuda, "a CUDA probe"
    bsz, dim = (16, 8192) if args.quick else (128, 65536)
    cap = 20
    nc, cd = chunking(bsz, dim, dev)
    R = 2 + 2 * cap
    print(f"{torch.cuda.get_device_name(dev)}: B {bsz} dim {dim} chunks {nc} x {cd}, cap {cap}")
    A = torch.randn(bsz, nc, R, cd, device=dev) * 1e-3
    x = torch.randn(bsz, nc, cd, device=dev)
    gx = torch.randn(bsz, nc, cd, device=dev)
    cnt = torch.tensor([5, 3, 0, 0], device=dev)
    skipped = torch.zeros(bsz, dtype=torch.int64, device=dev)
    defaults = (fused.BROYDEN_PIECE, fused.BROYDEN_TILE, fused.BROYDEN_WARPS)
    print("pb rows | copy ms GB/s | piece tile warps: ms GB/s ...")
    for pb in (2, 4, 8, 12, 16, 20):
        rp = 2 + 2 * pb
        nbytes = (2 * rp + 5) * bsz * dim * 4
        src = A[:, :, :rp]
        cms = timed(lambda src=src: src.clone())
        line = f"{pb:2d} {rp:3d} | {cms:.3f} {2 * rp * bsz * dim * 4 / cms / 1e6:6.0f} |"
        for piece, tile, warps in itertools.product(
            (1 << 10, 1 << 12), (1 << 11, 1 << 12, 1 << 13), (4, 8)
        ):
            fused.BROYDEN_PIECE, fused.BROYDEN_TILE, fused.BROYDEN_WARPS = piece, tile, warps
            scratch = fused.broyden_buffers(A)
            ms = timed(
                lambda s=scratch, p=pb: fused.broyden_update(
                    A, x, gx, cnt, skipped, s, p, cap, 1e-3
                )
            )
            line += f" {piece >> 10}k/{tile >> 10}k/{warps}: {ms:.3f} {nbytes / ms / 1e6:5.0f}"
        fused.BROYDEN_PIECE, fused.BROYDEN_TILE, fused.BROYDEN_WARPS = defaults
        print(line, flush=True)
    # whole captured solves on the conv64 cell: pairs per graph bucket (LARGE_GRAIN)
    from deqbench.deq import DEQLayer, SolverConfig
    from deqbench.solvers import broyden as bmod

    cell = cellmod.cells(args.quick, dev)[0]
    with torch.no_grad():
        tf = timed(lambda: cell.module(cell.z0, cell.x), 20)
    for tol in (1e-4, 1e-6):
        for grain in (1, 2, 4):
            bmod.LARGE_GRAIN = grain
            layer = DEQLayer(cell.module, SolverConfig("broyden", max_iter=100, tol=tol))
            z, st = layer.solve(cell.x, torch.zeros_like(cell.z0))
            ms = timed(lambda layer=layer: layer.solve(cell.x, torch.zeros_like(cell.z0)), 10)
            z, st = layer.solve(cell.x, torch.zeros_like(cell.z0))
            n = st.extra.get("nstep_to_tol", st.nstep)
            print(
                f"solve tol {tol:g} grain {grain}: {ms:.2f} ms path {st.path} nstep {st.nstep} "
                f"to_tol {n} overhead {ms / (n * tf):.2f} (t_f {tf:.3f} ms)",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
