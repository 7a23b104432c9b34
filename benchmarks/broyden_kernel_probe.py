"""Bandwidth of Broyden's fused update kernels (``fused.broyden_update``) on the conv64 state
(batch 128 x 65536): time per call and effective GB/s (rows read twice, five rows
written) for several pair counts, warps and unroll factors, beside a plain copy of the same
rows (the copy of the whole contiguous buffer gives the card's bandwidth); then whole captured
conv64 solves at rel 1e-4 and 1e-6 with their overhead and this representation's floor (f
plus the update's bytes at that bandwidth).

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
from deqbench.solvers.base import chunking, clear_graph_cache  # noqa: E402
from deqbench.solvers.broyden import pairs_in_use  # noqa: E402


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
    defaults = (fused.BROYDEN_WARPS, fused.BROYDEN_UNROLL)
    variants = [(w, u) for w in (4, 8) for u in (1, 2, 4)]
    print("pb rows | copy ms GB/s | warps/unroll: ms GB/s (rows read twice, 5 written) ...")
    bw = 0.0
    for pb in (2, 4, 6, 8, 12, 16, 20):
        rp = 2 + 2 * pb
        nbytes = (2 * rp + 5) * bsz * dim * 4
        src = A[:, :, :rp]
        cms = timed(lambda src=src: src.clone())
        if rp == R:  # the whole buffer, contiguous: the card's copy bandwidth (read + write)
            bw = 2 * rp * bsz * dim * 4 / cms / 1e6
        line = f"{pb:2d} {rp:3d} | {cms:.3f} {2 * rp * bsz * dim * 4 / cms / 1e6:6.0f} |"
        for warps, unroll in variants:
            fused.BROYDEN_WARPS, fused.BROYDEN_UNROLL = warps, unroll
            scratch = fused.broyden_buffers(A)
            ms = timed(
                lambda s=scratch, p=pb: fused.broyden_update(
                    A, x, gx, cnt, skipped, s, p, cap, 1e-3
                )
            )
            line += f" {warps}/{unroll}: {ms:.3f} {nbytes / ms / 1e6:5.0f}"
        fused.BROYDEN_WARPS, fused.BROYDEN_UNROLL = defaults
        print(line, flush=True)
    # whole captured solves on the conv64 cell (pairs read: exactly those in use)
    from deqbench.deq import DEQLayer, SolverConfig

    cell = cellmod.cells(args.quick, dev)[0]
    with torch.no_grad():
        tf = timed(lambda: cell.module(cell.z0, cell.x), 20)
    for tol, (warps, unroll) in itertools.product((1e-4, 1e-6), ((4, 1), defaults)):
        fused.BROYDEN_WARPS, fused.BROYDEN_UNROLL = warps, unroll
        clear_graph_cache()  # graphs captured with the other kernels must not replay
        layer = DEQLayer(cell.module, SolverConfig("broyden", max_iter=100, tol=tol))
        z, st = layer.solve(cell.x, torch.zeros_like(cell.z0))
        ms = timed(lambda layer=layer: layer.solve(cell.x, torch.zeros_like(cell.z0)), 10)
        z, st = layer.solve(cell.x, torch.zeros_like(cell.z0))
        n = st.extra.get("nstep_to_tol", st.nstep)
        # the floor of this representation: n evaluations of f, and per update the pair
        # rows in use read twice plus gx, x read and u, v, dx, x, gx written (2 rp + 8 rows of
        # the state) at the copy bandwidth of the contiguous buffer (restart rule, memory 20)
        nrows = sum(2 * (2 + 2 * pairs_in_use(k, 20, True, False)) + 8 for k in range(2, n))
        floor = (n * tf + nrows * cell.z0.numel() * 4 / bw / 1e6) / (n * tf)
        print(
            f"solve tol {tol:g} warps {warps} unroll {unroll}: {ms:.2f} ms path "
            f"{st.path} nstep {st.nstep} to_tol {n} overhead {ms / (n * tf):.2f} "
            f"(t_f {tf:.3f} ms); floor {floor:.2f} (update bytes at {bw:.0f} GB/s)",
            flush=True,
        )
    fused.BROYDEN_WARPS, fused.BROYDEN_UNROLL = defaults
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
