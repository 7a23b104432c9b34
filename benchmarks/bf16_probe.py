"""Probe of bfloat16 autocast on the conv_deq cell (64 channels, 32x32, batch 128; the bf16
throughput cell): where the time of one f-evaluation goes and how far each variant's f(z) is
from float64. A diagnostic for choosing the cell's bf16 path; the target is measured by the
``throughput`` stage of benchmarks/vs_torchdeq.py.

Variants of the same cell map: ``float32``; ``autocast`` (plain autocast: bf16 convolutions,
float32 GroupNorms, ``ResNetCell.lowp_norms = False``); ``lowp`` (the cell's bf16 path: every
activation in bf16, GroupNorm statistics in float32); each also in channels_last. Per variant:
ms per f (eager loop of 20 calls and a CUDA graph of the same loop), the relative error of f(z)
at a random z against float64, and plain fixed-point iteration from z = 0: steps to rel 1e-2
and the lowest relative residual in 40 steps (recomputed in float32). Then, with ``--solve``,
the DEQ layer's Anderson solve (the throughput stage's solver, rel 1e-2) per variant.

    python benchmarks/bf16_probe.py [--quick] [--device cuda] [--solve]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cells as cellmod  # noqa: E402

import deqbench  # noqa: E402
from deqbench.deq import DEQLayer, Runtime, SolverConfig  # noqa: E402


def timed(fn, repeats: int, cuda: bool) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return min(ts) * 1e3


def main() -> int:
    ap = cellmod.probe_parser()
    ap.add_argument("--solve", action="store_true")
    args = ap.parse_args()
    dev, cuda = cellmod.probe_device(args, cudnn_benchmark=True)
    ch, size, batch = (16, 16, 16) if args.quick else (64, 32, 128)
    torch.manual_seed(0)
    model = deqbench.models.create(
        "conv_deq", in_shape=(3, size, size), num_outputs=10, channels=ch, inner=ch
    ).to(dev)
    model.eval()
    cell = model.deq.cell
    x = torch.randn(batch, 3, size, size, device=dev)
    with torch.no_grad():
        u = model.inject(x)
        zr = torch.randn_like(u)
        ref = cell.double()(zr.double(), u.double())
        cell.float()
    name = torch.cuda.get_device_name(dev) if cuda else "cpu"
    print(f"device: {name}  torch {torch.__version__}; conv_deq {ch}ch {size}x{size} b{batch}")
    variants = [
        ("float32", "none", False),
        ("autocast", "bf16", False),
        ("lowp", "bf16", True),
    ]
    for fmt in (torch.contiguous_format, torch.channels_last):
        cl = fmt == torch.channels_last
        cell.to(memory_format=fmt)
        uu, zz = u.contiguous(memory_format=fmt), zr.contiguous(memory_format=fmt)
        for label, amp, lowp in variants:
            cell.lowp_norms = lowp
            rt = Runtime(amp=amp)

            def f(z, rt=rt, uu=uu):
                if rt.amp == "none":
                    return cell(z, uu)
                with rt.autocast(dev):
                    return cell(z, uu).to(z.dtype)

            with torch.no_grad():
                err = float((f(zz).double() - ref).norm() / ref.norm())
                loop = timed(lambda zz=zz: [f(zz) for _ in range(20)], 10, cuda) / 20
                graph_ms = float("nan")
                if cuda:
                    s = torch.cuda.Stream()
                    s.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(s):
                        for _ in range(2):
                            f(zz)
                    torch.cuda.current_stream().wait_stream(s)
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        for _ in range(20):
                            f(zz)
                    graph_ms = timed(g.replay, 10, cuda) / 20
                z = torch.zeros_like(uu)
                hist = []
                for _ in range(40):
                    fz = f(z)
                    r = (fz.float() - z.float()).flatten(1).norm(dim=1) / (
                        fz.float().flatten(1).norm(dim=1) + 1e-9
                    )
                    hist.append(float(r.max()))
                    z = fz
            to_tol = next((i + 1 for i, h in enumerate(hist) if h < 1e-2), None)
            print(
                f"{label:9s} {'channels_last' if cl else 'contiguous':13s} f loop {loop:.4f} ms "
                f"graph {graph_ms:.4f} ms  rel err vs f64 {err:.2e}  fixed point: to 1e-2 "
                f"{to_tol} steps, lowest {min(hist):.2e}"
            )
            if args.solve:
                layer = DEQLayer(cell, SolverConfig("anderson", 60, 1e-2, options={"m": 5}))
                layer.set_runtime(rt)
                solve = lambda layer=layer, uu=uu: layer.solve(uu, torch.zeros_like(uu))  # noqa: E731
                ms = timed(solve, 10, cuda)
                _, st = solve()
                print(
                    f"    anderson rel 1e-2: {ms:.3f} ms path {st.path} nstep {st.nstep} rel "
                    f"{st.rel_max:.2e} {st.status}"
                )
    cell.to(memory_format=torch.contiguous_format)
    cell.lowp_norms = True
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
