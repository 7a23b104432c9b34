"""Traces (torch.profiler, Chrome trace JSON) of single solves on the benchmark cells (fc1024, conv64), to see
where a solve's wall time goes: host work before the first kernel, GPU gaps, and the work after
the last one. A diagnostic; the targets are measured by benchmarks/vs_torchdeq.py.

Per case (after warm-up, so graphs are captured and Triton kernels compiled) one profiled call;
``--out DIR`` gets ``<case>.json``, and a one-line summary per case is printed: wall time of the
call, first kernel start and last kernel end relative to the call, GPU busy time (union of the
kernel intervals), and the top kernels by time.

    python benchmarks/trace_probe.py --out DIR [--quick] [--device cuda]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cells as cellmod  # noqa: E402

import deqbench  # noqa: E402
from deqbench.deq import DEQLayer, Runtime, SolverConfig  # noqa: E402
from deqbench.solvers import get as get_solver  # noqa: E402


def summarize(path: Path, wall_ms: float, marker: str = "probe_call") -> str:
    ev = json.loads(path.read_text())["traceEvents"]
    marks = [e for e in ev if e.get("name") == marker and "dur" in e]
    if not marks:
        return f"{path.stem}: no marker {marker} in trace"
    t0, t1 = marks[0]["ts"], marks[0]["ts"] + marks[0]["dur"]
    kern = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e
            and (marker == "probe_call" or t0 <= e["ts"] <= t1)]  # fmt: skip
    if not kern:
        return f"{path.stem}: no kernels in trace"
    # host waits and launches inside the marked region (cuda_runtime / cuda_driver events)
    rt_ev: dict[str, list[float]] = {}
    for e in ev:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "dur" in e and t0 <= e["ts"] <= t1:
            rt_ev.setdefault(e["name"], []).append(e["dur"])
    rts = "; ".join(
        f"{k} x{len(v)} {sum(v):.0f}us"
        for k, v in sorted(rt_ev.items(), key=lambda kv: -sum(kv[1]))[:6]
    )
    kern.sort(key=lambda e: e["ts"])
    busy, end = 0.0, -1e30
    for e in kern:
        s, f = e["ts"], e["ts"] + e["dur"]
        if f > end:
            busy += f - max(s, end)
            end = f
    first, last = kern[0]["ts"] - t0, kern[-1]["ts"] + kern[-1]["dur"] - t0
    by: dict[str, list[float]] = {}
    for e in kern:
        by.setdefault(e["name"][:60], []).append(e["dur"])
    top = sorted(by.items(), key=lambda kv: -sum(kv[1]))[:8]
    tops = "; ".join(f"{k} x{len(v)} {sum(v):.0f}us" for k, v in top)
    return (
        f"{path.stem}: wall {wall_ms:.3f} ms (traced call {(t1 - t0) / 1e3:.3f} ms), first kernel "
        f"at {first / 1e3:.3f} ms, last ends {last / 1e3:.3f} ms, GPU busy {busy / 1e3:.3f} ms, "
        f"{len(kern)} kernels\n    {tops}\n    host: {rts}"
    )


def trace(name: str, fn, out: Path, cuda: bool, marker: str = "probe_call") -> None:
    from torch.profiler import ProfilerActivity, profile, record_function

    for _ in range(3):
        fn()
    if cuda:
        torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        t = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        with record_function("probe_call"):
            fn()
            if cuda:
                torch.cuda.synchronize()
    p = out / f"{name}.json"
    prof.export_chrome_trace(str(p))
    print(summarize(p, min(ts) * 1e3, marker), flush=True)


def main() -> int:
    ap = cellmod.probe_parser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--ift",
        action="store_true",
        help="only the IFT training step (Anderson 1e-4, adjoint Anderson rel 1e-6): the "
        "backward's region (marker 'bwd') summarised",
    )
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dev, cuda = cellmod.probe_device(args, cudnn_benchmark=True)
    cells = {c.name: c for c in cellmod.cells(args.quick, dev)}
    if args.ift:
        from torch.profiler import record_function

        from deqbench.deq import BackwardConfig

        for cname, c in cells.items():
            mod, x, z0 = c.module, c.x, c.z0
            mod.requires_grad_(True)
            layer = DEQLayer(
                mod,
                SolverConfig("anderson", max_iter=100, tol=1e-4),
                BackwardConfig("ift", solver="anderson", max_iter=100, tol=1e-6),
            )
            R = torch.randn_like(z0)

            def step(layer=layer, x=x, z0=z0, R=R):
                z = layer(x, torch.zeros_like(z0))
                with record_function("bwd"):
                    (z * R).sum().backward()
                    if cuda:
                        torch.cuda.synchronize()

            trace(f"{cname}_ift_step", step, args.out, cuda, marker="bwd")
            bst = layer.last_backward_stats
            print(
                f"    adjoint: {bst.nstep if bst else '-'} steps, path {getattr(bst, 'path', '-')}"
            )
        return 0
    for cname, c in cells.items():
        mod, x, z0 = c.module, c.x, c.z0
        for sname, tol in (("fixed_point", 1e-4), ("anderson", 1e-4), ("broyden", 1e-4)):
            layer = DEQLayer(mod, SolverConfig(sname, max_iter=100, tol=tol))

            def solve(layer=layer, x=x, z0=z0):
                with torch.no_grad():
                    return layer.solve(x, torch.zeros_like(z0))

            trace(f"{cname}_{sname}_default", solve, args.out, cuda)
            if cname.startswith("conv") and sname == "anderson":
                fn = get_solver(sname)

                def eager(fn=fn, mod=mod, x=x, z0=z0, tol=tol):
                    with torch.no_grad():
                        return fn(lambda z: mod(z, x), torch.zeros_like(z0), max_iter=100, tol=tol)

                trace(f"{cname}_{sname}_eager", eager, args.out, cuda)
    # the conv_deq cell's f under float32, plain autocast and its bf16 path (20 calls)
    ch, size, batch = (16, 16, 16) if args.quick else (64, 32, 128)
    torch.manual_seed(0)
    model = deqbench.models.create(
        "conv_deq", in_shape=(3, size, size), num_outputs=10, channels=ch, inner=ch
    ).to(dev)
    cell = model.deq.cell
    with torch.no_grad():
        u = model.inject(torch.randn(batch, 3, size, size, device=dev))
    z = torch.randn_like(u)
    for label, amp, lowp in (("f32", "none", True), ("autocast", "bf16", False),
                             ("lowp", "bf16", True)):  # fmt: skip
        cell.lowp_norms = lowp
        rt = Runtime(amp=amp)

        def calls(rt=rt):
            with torch.no_grad(), rt.autocast(dev):
                for _ in range(20):
                    cell(z, u)

        trace(f"convdeq_f_{label}", calls, args.out, cuda)
    cell.lowp_norms = True
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
