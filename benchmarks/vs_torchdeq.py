"""deqbench vs TorchDEQ 0.1.0 side by side, through the plugin path, with the targets for
solver time against TorchDEQ and for the default path's overhead.

One run, one device, float32, TF32 off, the same seeded batches and tolerances for both
libraries; TorchDEQ is reached only through the registered plugin (examples/deqbench-torchdeq:
solvers ``torchdeq_*`` and the model wrapper ``torchdeq_deq``; registered from the source tree
when TorchDEQ is importable but the plugin is not installed), f-evaluations are counted by
deqbench wrapping f for both. Without TorchDEQ every stage still runs its deqbench rows and the
summary says "TorchDEQ not installed". Stages (each can be skipped):

1. ``solvers``: the bare cells (benchmarks/cells.py: conv64 at batch 128,
   fc1024 at batch 512), rel tol 1e-4 and 1e-6, max_iter 100: time to tolerance (every repeat
   kept), f-evaluations, t_f (plain loop), overhead, the residual of the returned iterate
   recomputed by deqbench in float32 for both, peak extra memory of a solve (GPU). deqbench runs
   two variants: ``eager`` (the solver function called directly on the bare cell map) and
   ``default`` (what a user gets: ``DEQLayer(cell).solve(u, z0, cfg)``; on CUDA the solve is
   captured as a CUDA graph on the warm-up call and replayed afterwards, a new ``u`` of the same
   shape copied in each repeat; ``path`` says which path ran). ``nstep`` counts the
   f-evaluations made, ``nstep_to_tol`` those up to the first iterate that met the tolerance
   (the graph path checks once per replayed chunk of steps); the overhead is
   time / (nstep_to_tol x t_f). With ``--amp`` (default on) the rows at rel tol 1e-2 are run in
   float32 and under ``Runtime(amp="bf16")`` (TorchDEQ: its solve under
   ``torch.autocast(dtype=torch.bfloat16)``), the residual recomputed in float32;
2. ``train_step``: one IFT training step on each bare cell (loss <R, z*>, Anderson forward rel
   1e-4 and adjoint rel 1e-6, max_iter 100): deqbench IFT (through the
   DEQ layer: the graph forward path on CUDA), TorchDEQ IFT (``torchdeq_deq`` wrapper on the
   same cell) and deqbench unrolled-30: forward / backward / step time, the forward solve alone
   and the adjoint's VJPs, peak extra memory, gradient cosine and relative error against a
   float64 IFT reference (tol 1e-12) on the same batch;
3. ``throughput``: the ``throughput`` analysis' eval forward of ``conv_deq`` (64 ch, batch 128)
   against a hand-written timing loop of the same model, at tol 1e-4 and (``--amp``) at tol 1e-2
   in float32 and bf16;
4. ``suites``: suites/vs_torchdeq.yaml and suites/perf.yaml through the runner (trained cells).

Writes into ``--out``: ``solvers.csv``, ``train_step.csv``, ``throughput.csv``, ``env.json``,
``summary.md`` (tables and each target marked met / not met with its ratio; rewritten after each
stage), ``*.png``, and the suite runs under ``runs/``.

Usage:
    pip install torchdeq==0.1.0 && pip install -e examples/deqbench-torchdeq   # the plugin
    python benchmarks/vs_torchdeq.py --out results/vs_torchdeq                 # H100: ~5 min
    python benchmarks/vs_torchdeq.py --quick --device cpu --out /tmp/vs --stages solvers train_step
    bash benchmarks/gpu_solvers_vs_torchdeq.sh results/gpu_solvers_vs_torchdeq   # GPU stages + NTK target
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

import cells as cellmod  # noqa: E402

import deqbench  # noqa: E402
from deqbench.deq import (  # noqa: E402
    BackwardConfig,
    CellMap,
    DEQLayer,
    Runtime,
    SolverConfig,
    configure,
    set_runtime,
)
from deqbench.performance.backward import measure_mode  # noqa: E402
from deqbench.performance.gradients import CellModel, InnerProductLoss, reference_gradient  # noqa: E402
from deqbench.performance.measure import (  # noqa: E402
    Timing,
    f_time,
    gpu_peak_memory,
    is_cuda,
    solver_time_to_tol,
    time_fn,
)
from deqbench.performance.throughput import measure_throughput, reference_loop_ms  # noqa: E402
from deqbench.solvers.base import residuals  # noqa: E402

PAIRS = (
    ("fixed_point", "torchdeq_fixed_point"),
    ("anderson", "torchdeq_anderson"),
    ("broyden", "torchdeq_broyden"),
)
TIME_TARGET = {"fixed_point": 0.8, "anderson": 0.6, "broyden": 0.6}
#: targets: overhead of the default path, time / (nstep_to_tol x t_f), float32, per cell
OVERHEAD_TARGET = {
    "fc": {"fixed_point": 1.5, "anderson": 2.5, "broyden": 3.0},
    "conv": {"fixed_point": 1.15, "anderson": 1.5, "broyden": 2.5},
}
TOLS = (1e-4, 1e-6)  # the float32 rows
AMP_TOL = 1e-2  # the bf16 rows and the float32 rows they are compared with
IFT_VS_UNROLLED = 1.0  # target: fc IFT step <= 1.0 x unrolled-30
BF16_SPEEDUP = 1.5  # target: bf16 conv64 throughput >= 1.5 x float32 (same tol)
BF16_ITERS = 0.2  # ... with iteration counts within 20%
NO_TORCHDEQ = "TorchDEQ not installed"
STAGES = ("solvers", "train_step", "throughput", "suites")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def environment(device: torch.device, threads: int, why: str | None, amp: bool) -> dict[str, Any]:
    try:
        import torchdeq

        tdv = getattr(torchdeq, "__version__", "0.1.0")
    except ImportError:
        tdv = None
    return {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else (platform.processor() or platform.machine()),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "torchdeq": tdv if why is None else NO_TORCHDEQ,
        "torchdeq_missing": why,
        "deqbench": deqbench.__version__,
        "plugin": deqbench.solvers.origin("torchdeq_anderson") if why is None else NO_TORCHDEQ,
        "dtype": "float32",
        "amp_rows": f"bf16 autocast at rel tol {AMP_TOL:g}" if amp else "off",
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "threads": threads,
    }


def register_source_plugin() -> None:
    """TorchDEQ importable but the plugin not installed: register examples/deqbench-torchdeq
    from the source tree (what ``pip install -e`` would register through its entry points)."""
    if "torchdeq_anderson" in deqbench.solvers.names():
        return
    try:
        import torchdeq  # noqa: F401
    except ImportError:
        return
    src = ROOT / "examples" / "deqbench-torchdeq" / "src"
    if not src.is_dir():
        return
    sys.path.insert(0, str(src))
    import deqbench_torchdeq
    from deqbench_torchdeq import models as td_models
    from deqbench_torchdeq import solvers as td_solvers

    origin = f"deqbench-torchdeq {deqbench_torchdeq.__version__} (source tree, not installed)"
    for _, name in PAIRS:
        deqbench.solvers.add(name, getattr(td_solvers, name), origin=origin)
    deqbench.models.add("torchdeq_deq", td_models.torchdeq_deq, origin=origin)


def check_plugin() -> str | None:
    try:
        register_source_plugin()
        origin = deqbench.solvers.origin("torchdeq_anderson")
        deqbench.models.get("torchdeq_deq")
        import torchdeq  # noqa: F401
    except Exception as exc:
        return (
            f"the TorchDEQ plugin is not installed ({exc}); run: pip install torchdeq==0.1.0 "
            "&& pip install -e examples/deqbench-torchdeq"
        )
    if origin == "built-in":
        return "torchdeq_anderson is not a plugin solver"
    return None


# -- 1. solvers ------------------------------------------------------------------------------------


def residual32(cell: Any, z: torch.Tensor) -> tuple[float, float]:
    """(rel, abs) batch max residual of ``z`` recomputed with the float32 cell (no autocast)."""
    with torch.no_grad():
        z = z.float()
        a, r = residuals(cell.module(z, cell.x), z)
    return float(r.max()), float(a.max())


def autocast_solve(solve: Any, device: torch.device) -> Any:
    """``solve`` with its whole call under bfloat16 autocast (TorchDEQ's bf16 rows)."""

    def run(f: Any, z0: torch.Tensor, **kw: Any) -> Any:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return solve(f, z0, **kw)

    return run


def time_default(layer: DEQLayer, cell: Any, cfg: SolverConfig, args: argparse.Namespace) -> Any:
    """Time ``layer.solve(u, z0, cfg)`` (the default path) with a new ``u`` (same shape and
    values, a fresh tensor) made before each call, untimed: on CUDA it is copied into the captured
    graph's static input, so the warm-up call captures and the timed calls replay."""
    box: dict[str, Any] = {}

    def setup() -> None:
        box["u"] = cell.x.clone()

    def run() -> int:
        z, st = layer.solve(box["u"], cell.z0, cfg)
        box["z"], box["stats"] = z, st
        return st.nstep

    t = time_fn(
        run,
        device=cell.z0.device,
        repeats=-(-args.repeats // ROUNDS),
        warmup=max(1, args.warmup),
        setup=setup,
    )
    return t, [int(n) for n in t.results], box["stats"], box["z"]


def solver_row(
    cell: Any,
    layer: DEQLayer,
    f: Any,
    tf: Any,
    amp: str,
    tol: float,
    variant: str,
    pair: str,
    name: str,
    args: argparse.Namespace,
    peak_memory: bool = True,
) -> dict[str, Any]:
    """One timed row: deqbench ``eager`` (the solver on ``f``), deqbench ``default`` (through
    ``layer``) or TorchDEQ (``eager``, on the bare cell; under autocast for bf16). The peak
    memory pass only with ``peak_memory`` (the last of a comparison's rounds)."""
    td = name.startswith("torchdeq_")
    dev = cell.z0.device
    row: dict[str, Any] = {
        "cell": cell.name,
        "cell_desc": cell.desc,
        "amp": amp,
        "tol": tol,
        "pair": pair,
        "variant": variant,
        "library": "torchdeq" if td else "deqbench",
        "solver": name,
        "t_f_ms": tf.median * 1e3,
        "error": "",
    }
    try:
        cfg = SolverConfig(name, args.max_iter, tol, "rel")
        if variant == "default":
            t, nfe, stats, z = time_default(layer, cell, cfg, args)
            u = cell.x.clone()

            def step() -> Any:
                return layer.solve(u, cell.z0, cfg)

        else:
            solve = deqbench.solvers.get(name)
            opts = {"check_returned": False} if td else {}
            fx = cell.f if td else f  # TorchDEQ: the bare cell, its solve under autocast
            fn = autocast_solve(solve, dev) if td and amp != "none" else solve
            box: dict[str, Any] = {}

            def keep(f_: Any, z0_: torch.Tensor, **kw: Any) -> Any:
                out = fn(f_, z0_, **kw)
                box["z"] = out[0]
                return out

            st = solver_time_to_tol(
                keep,
                fx,
                cell.z0,
                max_iter=args.max_iter,
                tol=tol,
                options=opts,
                repeats=-(-args.repeats // ROUNDS),
                warmup=args.warmup,
                t_f=tf.median,
            )
            t, nfe, stats, z = st.timing, st.nfe, st.stats, box["z"]
            step = functools.partial(fn, fx, cell.z0, max_iter=args.max_iter, tol=tol, **opts)
        peak = math.nan
        if is_cuda(dev) and peak_memory:
            with torch.no_grad():
                peak = gpu_peak_memory(step, dev).peak_mib
        nstep = int(stats.nstep) if variant == "default" else nfe[-1]
        to_tol = nstep if td else int(stats.extra.get("nstep_to_tol", nstep))
        rel, ab = residual32(cell, z)
        ovh = [x / (n * tf.median) if n else math.nan for x, n in zip(t.times, nfe)]
        row.update(
            path=getattr(stats, "path", "eager"),
            f_evals=nstep,
            nstep=nstep,
            nstep_to_tol=to_tol,
            f_evals_constant=len(set(nfe)) == 1,
            time_ms=t.median * 1e3,
            iqr_ms=t.iqr * 1e3,
            spread=t.spread,
            cpu_ms=(sorted(t.cpu_times)[len(t.cpu_times) // 2] * 1e3 if t.cpu_times else math.nan),
            times_ms=";".join(f"{x * 1e3:.4f}" for x in t.times),
            overhead=sorted(ovh)[len(ovh) // 2] if ovh else math.nan,
            overhead_to_tol=t.median / (to_tol * tf.median) if to_tol else math.nan,
            rel_residual=rel,
            abs_residual=ab,
            status=stats.status,
            peak_mib=peak,
            _times=list(t.times),
            _cpu=list(t.cpu_times),
            _ovh=ovh,
            _to_tol_tf=to_tol * tf.median,
        )
    except Exception as exc:  # noqa: BLE001 - a row that failed is reported, not fatal
        msg = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        row.update(
            path="-",
            f_evals=0,
            nstep=0,
            nstep_to_tol=0,
            f_evals_constant=True,
            time_ms=math.nan,
            iqr_ms=math.nan,
            spread=math.nan,
            cpu_ms=math.nan,
            times_ms="",
            overhead=math.nan,
            overhead_to_tol=math.nan,
            rel_residual=math.nan,
            abs_residual=math.nan,
            status="error",
            peak_mib=math.nan,
            error=msg,
        )
    return row


#: rounds of each solver comparison (see bench_solvers); each round makes repeats / ROUNDS
#: timed calls (rounded up) after its own warm-up
ROUNDS = 3


def merge_rounds(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from the rounds of the same row: every timed repeat together (median, IQR,
    spread and per-repeat overhead over all of them); the rest from the last round."""
    row = {k: v for k, v in parts[-1].items() if not k.startswith("_")}
    err = next((p["error"] for p in parts if p.get("error")), "")
    if err or any("_times" not in p for p in parts):
        row["error"] = err or row.get("error", "")
        return row
    t = Timing(times=[x for p in parts for x in p["_times"]])
    ovh = sorted(x for p in parts for x in p["_ovh"])
    cpu = sorted(x for p in parts for x in p["_cpu"])
    row.update(
        time_ms=t.median * 1e3,
        iqr_ms=t.iqr * 1e3,
        spread=t.spread,
        cpu_ms=cpu[len(cpu) // 2] * 1e3 if cpu else math.nan,
        times_ms=";".join(f"{x * 1e3:.4f}" for x in t.times),
        overhead=ovh[len(ovh) // 2] if ovh else math.nan,
        overhead_to_tol=t.median / parts[-1]["_to_tol_tf"] if parts[-1]["_to_tol_tf"] else math.nan,
        f_evals_constant=all(p["f_evals_constant"] for p in parts)
        and len({p["nstep"] for p in parts}) == 1,
        rounds=len(parts),
    )
    return row


def bench_solvers(cells: list[Any], tols: list[float], args: argparse.Namespace) -> list[dict]:
    rows = []
    for cell in cells:
        layer = DEQLayer(cell.module)  # the default path: what a user of the DEQ layer gets
        runs = [("none", [*tols, AMP_TOL] if args.amp else list(tols))]
        if args.amp:
            runs.append(("bf16", [AMP_TOL]))
        for amp, amp_tols in runs:
            rt = Runtime(amp=amp)
            layer.set_runtime(rt)
            # the eager map: the bare cell (float32), or the cell under the runtime's autocast
            f = cell.f if amp == "none" else CellMap(cell.module, cell.x, runtime=rt)
            with torch.no_grad():
                tf = f_time(f, cell.z0, repeats=args.repeats, warmup=args.warmup, loop=20)
            # t_f is the fastest repeat, not the median: the plain eager loop of a launch-bound
            # cell is host-bound, and its median moved 0.06-0.14 ms between H100 runs of fc1024
            # (the solves on the graph path did not); the fastest repeat is the floor, so an
            # overhead against it can only come out larger
            tf.times = [min(tf.times)]
            log(f"[solvers] {cell.desc} amp {amp}: t_f {tf.median * 1e3:.4f} ms")
            for tol in amp_tols:
                for ours, theirs in PAIRS:
                    todo = [("eager", ours), ("default", ours)]
                    if args.td:
                        todo.append(("eager", theirs))
                    # the repeats in ROUNDS rounds over the three rows (deqbench eager,
                    # default, TorchDEQ), merged per row: a slow period of the host (runs
                    # showed single rows 2-3x slower for a whole measurement) falls on all
                    # of them alike instead of deciding one comparison
                    parts: dict[int, list[dict]] = {i: [] for i in range(len(todo))}
                    for rnd in range(ROUNDS):
                        last = rnd == ROUNDS - 1  # its peak memory pass and fields are kept
                        for i, (variant, name) in enumerate(todo):
                            parts[i].append(
                                solver_row(
                                    cell,
                                    layer,
                                    f,
                                    tf,
                                    amp,
                                    tol,
                                    variant,
                                    ours,
                                    name,
                                    args,
                                    peak_memory=last,
                                )  # fmt: skip
                            )
                    for i in range(len(todo)):
                        r = merge_rounds(parts[i])
                        name, variant = r["solver"], r["variant"]
                        rows.append(r)
                        log(
                            f"  {cell.name} {amp:4s} {tol:.0e} {name:20s} {variant:7s} "
                            f"{r['path']:6s} n={r['nstep']:3d} to_tol={r['nstep_to_tol']:3d} "
                            f"t={r['time_ms']:9.3f} ms ovh={r['overhead_to_tol']:.2f} "
                            f"res={r['rel_residual']:.2e} {r['status']} {r['error']}"
                        )
        layer.reset_runtime_caches()
    return rows


# -- 2. IFT training step --------------------------------------------------------------------------


def solve_parts(model: Any, cell: Any, solver: SolverConfig, args: argparse.Namespace) -> dict:
    """The IFT step's parts on their own: the forward solve through the DEQ layer in train mode
    (the path a training step takes; graph on CUDA) and one VJP of the cell at z* (the adjoint
    solve makes one per step)."""
    layer = model.deq
    was = model.training
    model.train()
    try:
        box: dict[str, Any] = {}

        def solve() -> int:
            z, st = layer.solve(cell.x, model.z0(cell.x), solver)
            box["z"], box["st"] = z, st
            return st.nstep

        t = time_fn(solve, device=cell.z0.device, repeats=args.repeats, warmup=args.warmup)
        st = box["st"]
        with torch.enable_grad():
            z = box["z"].detach().requires_grad_()
            fz = layer.f(z, cell.x)
            w = torch.randn_like(fz)

            def vjp() -> None:
                torch.autograd.grad(fz, z, w, retain_graph=True)

            tv = time_fn(vjp, device=cell.z0.device, repeats=args.repeats, warmup=args.warmup)
        return {
            "solve_ms": t.median * 1e3,
            "solve_path": st.path,
            "solve_nstep": int(st.nstep),
            "solve_nstep_to_tol": int(st.extra.get("nstep_to_tol", st.nstep)),
            "vjp_ms": tv.median * 1e3,
        }
    finally:
        model.train(was)


def bench_train_step(cells: list[Any], args: argparse.Namespace) -> list[dict]:
    wrapper = deqbench.models.get("torchdeq_deq") if args.td else None
    rows = []
    for cell in cells:
        dev = cell.z0.device
        solver = SolverConfig("anderson", args.max_iter, 1e-4, "rel")
        ift = BackwardConfig("ift", solver="anderson", max_iter=args.max_iter, tol=1e-6)
        model = CellModel(copy.deepcopy(cell.module), solver, ift, cell.z0.shape[1:]).to(dev)
        g = torch.Generator().manual_seed(1)
        R = torch.randn(cell.z0.shape, generator=g).to(dev)
        loss = InnerProductLoss()
        t0 = time.perf_counter()
        g_ref, info = reference_gradient(
            model,
            cell.x,
            R,
            loss,
            solver="anderson",
            tol=1e-12,
            max_iter=2000,
            adjoint_solver="anderson",
        )
        log(
            f"[train_step] {cell.desc}: float64 reference in {time.perf_counter() - t0:.1f} s "
            f"(fwd res {info.get('forward_rel_residual', math.nan):.1e}, "
            f"adjoint res {info.get('backward_rel_residual', math.nan):.1e})"
        )
        variants = [("deqbench_ift", model, ift)]
        if wrapper is not None:
            variants.append(("torchdeq_ift", wrapper(wrap=copy.deepcopy(model)), ift))
        variants.append(("deqbench_unrolled30", model, BackwardConfig("unrolled", k=30)))
        for label, m, bcfg in variants:
            ours = label.startswith("deqbench")
            if ours:
                m.deq.last_forward_stats = None
            try:
                r = train_row(cell, label, m, bcfg, solver, R, loss, g_ref, info, args)
            except Exception as exc:  # noqa: BLE001 - reported, the other variants still run
                err = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                log(f"  {cell.name} {label:20s} ERROR {err}")
                rows.append({"cell": cell.name, "cell_desc": cell.desc, "variant": label})
                rows[-1]["error"] = err
                continue
            rows.append(r)
            log(
                f"  {cell.name} {label:20s} step {r['step_ms']:8.2f} ms (fwd {r['forward_ms']:.2f}, "
                f"bwd {r['backward_ms']:.2f}; path {r['forward_path']}) peak {r['peak_mib']:.1f} "
                f"MiB grad err {r['grad_rel_error']:.2e} cos {r['grad_cosine']:.6f}"
            )
    return rows


def train_row(
    cell: Any,
    label: str,
    m: Any,
    bcfg: BackwardConfig,
    solver: SolverConfig,
    R: torch.Tensor,
    loss: Any,
    g_ref: Any,
    info: dict,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One measured training-step variant (``measure_mode``) and, for deqbench IFT, its parts."""
    dev = cell.z0.device
    ours = label.startswith("deqbench")
    res = measure_mode(
        m,
        cell.x,
        R,
        loss,
        bcfg,
        solver,
        g_ref=g_ref,
        repeats=args.repeats,
        warmup=args.warmup,
        memory=is_cuda(dev),
        memory_cpu=False,
    )
    t = res["timing"]
    st = res["stats"]
    fst = m.deq.last_forward_stats if ours else None
    r = {
        "cell": cell.name,
        "cell_desc": cell.desc,
        "variant": label,
        "forward_path": getattr(fst, "path", "-") if ours else "torchdeq",
        "step_ms": t["total"].median * 1e3,
        "step_iqr_ms": t["total"].iqr * 1e3,
        "forward_ms": t["forward"].median * 1e3,
        "backward_ms": t["backward"].median * 1e3,
        "step_times_ms": ";".join(f"{x * 1e3:.4f}" for x in t["total"].times),
        "peak_mib": res["memory"].peak_mib if res["memory"] is not None else math.nan,
        "activation_mib": res["activation_bytes"] / 2**20,
        "grad_cosine": res["cosine"],
        "grad_rel_error": res["rel_error"],
        "forward_nstep": t["total"].results[-1][0],
        "backward_nstep": t["total"].results[-1][1],
        "forward_rel_residual": st.get("forward_rel_residual", math.nan),
        "backward_rel_residual": st.get("backward_rel_residual", math.nan),
        "ref_forward_rel_residual": info.get("forward_rel_residual", math.nan),
        "ref_backward_rel_residual": info.get("backward_rel_residual", math.nan),
        "error": "",
    }
    if label == "deqbench_ift":
        r.update(solve_parts(m, cell, solver, args))
    return r


# -- 3. throughput vs a hand-written loop -----------------------------------------------------------


def bench_throughput(device: torch.device, quick: bool, args: argparse.Namespace) -> list[dict]:
    torch.manual_seed(0)
    ch, size, batch = (16, 16, 16) if quick else (64, 32, 128)
    model = deqbench.models.create(
        "conv_deq", in_shape=(3, size, size), num_outputs=10, channels=ch, inner=ch
    ).to(device)
    x = torch.randn(batch, 3, size, size, device=device)
    iters = 5 if quick else 20
    runs = [("none", 1e-4)] + ([("none", AMP_TOL), ("bf16", AMP_TOL)] if args.amp else [])
    rows = []
    name = f"conv_deq {ch}ch/{ch} {size}x{size}"
    for amp, tol in runs:
        try:
            rows.append(throughput_row(model, name, x, amp, tol, iters, args))
        except Exception as exc:  # noqa: BLE001 - reported, the other rows still run
            err = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            log(f"[throughput] amp {amp} tol {tol:g}: ERROR {err}")
            rows.append({"model": name, "amp": amp, "tol": tol, "error": err})
    set_runtime(model, Runtime())
    return rows


def throughput_row(
    model: Any, name: str, x: torch.Tensor, amp: str, tol: float, iters: int, args: Any
) -> dict[str, Any]:
    """The analysis' eval forward of ``model`` under ``Runtime(amp=amp)`` at ``tol`` beside a
    hand-written loop, the path, f-evals and the float32 residual of z*."""
    device, batch = x.device, x.shape[0]
    rt = Runtime(amp=amp)
    set_runtime(model, rt)
    configure(model, SolverConfig("anderson", args.max_iter, tol))
    # the analysis runs the whole model forward under the runtime's autocast: so does the hand
    # loop (what a user writes: `with torch.autocast(...): model(x)`)
    with rt.autocast(device):
        hand1 = reference_loop_ms(model, x, iters=iters, warmup=3)
    res = measure_throughput(model, x, repeats=iters, warmup=3, train_step=False, memory=False)
    with rt.autocast(device):
        hand2 = reference_loop_ms(model, x, iters=iters, warmup=1)
    hand = (hand1 + hand2) / 2
    med = res["eval"].median * 1e3
    st = model.deq.last_forward_stats
    was = model.training
    model.eval()
    with rt.autocast(device):  # the same runtime; the residual recomputed in float32
        z, u = model.equilibrium(x)
    model.train(was)
    with torch.no_grad():
        _, r = residuals(model.deq.cell(z.float(), u.float()), z.float())
    log(
        f"[throughput] {name} b{batch} amp {amp} tol {tol:g}: analysis {med:.3f} ms, hand loop "
        f"{hand1:.3f} / {hand2:.3f} ms, ratio {med / hand:.3f}, path "
        f"{getattr(st, 'path', '-')}, f-evals {res['eval_nstep'][-1]}, res {float(r.max()):.2e}, "
        f"state {z.dtype}"
    )
    return {
        "model": name,
        "batch": batch,
        "amp": amp,
        "tol": tol,
        "path": getattr(st, "path", "-"),
        "analysis_ms": med,
        "analysis_iqr_ms": res["eval"].iqr * 1e3,
        "hand_loop_ms_before": hand1,
        "hand_loop_ms_after": hand2,
        "ratio": med / hand,
        "samples_per_s": batch / (med / 1e3),
        "f_evals": res["eval_nstep"][-1],
        "nstep_to_tol": int(st.extra.get("nstep_to_tol", st.nstep)) if st else 0,
        "rel_residual": float(r.max()),
        "state_dtype": str(z.dtype).replace("torch.", ""),
        "error": "",
    }


# -- 4. suites --------------------------------------------------------------------------------------


def run_suites(names: list[str], out: Path, device: str) -> list[dict]:
    done = []
    for name in names:
        t0 = time.perf_counter()
        suite = deqbench.load_suite(ROOT / "suites" / f"{name}.yaml", device=device)
        summary = deqbench.run_suite(
            suite, out=out / "runs", progress=False, command=["benchmarks/vs_torchdeq.py", name]
        )
        log(
            f"[suites] {name}: {summary.run_dir} exit {summary.exit_code} "
            f"({time.perf_counter() - t0:.0f} s)"
        )
        done.append(
            {
                "suite": name,
                "run_dir": str(summary.run_dir),
                "exit_code": summary.exit_code,
                "failed": summary.failed,
            }
        )
    return done


# -- summary ---------------------------------------------------------------------------------------


def mark(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "NOT met")


def num(v: Any, spec: str = ".2f") -> str:
    """``v`` formatted, "-" for None / NaN."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec)


def within(a: float, b: float, frac: float) -> bool | None:
    """|a - b| <= frac * b (None when either is missing)."""
    if not (a and b) or math.isnan(a) or math.isnan(b):
        return None
    return abs(a - b) <= frac * b


def solver_sections(env: dict, solvers: list[dict], td: bool) -> list[str]:
    card = env["device_name"]
    by = {(r["cell"], r["amp"], r["tol"], r["variant"], r["solver"]): r for r in solvers}

    def theirs(r: dict) -> dict | None:
        return by.get((r["cell"], r["amp"], r["tol"], "eager", "torchdeq_" + r["pair"]))

    def vs_td(r: dict) -> tuple[str, str, bool | None]:
        o = theirs(r) if td else None
        if o is None:
            return ("-", "-", None) if td else (NO_TORCHDEQ, "-", None)
        ratio = r["time_ms"] / o["time_ms"] if o["time_ms"] > 0 else math.nan
        ok = None if math.isnan(ratio) else ratio < 1.0
        return num(o["time_ms"], ".3f"), num(ratio), ok

    ours = [r for r in solvers if r["library"] == "deqbench"]
    f32 = [r for r in ours if r["amp"] == "none" and r["tol"] in TOLS]
    L = [
        f"## Solver overhead, eager vs default path (float32; {card})",
        "",
        "`eager`: the solver called directly on the bare cell map; `default`: "
        "`DEQLayer(cell).solve(u, z0, cfg)`, what a user gets (on CUDA: captured on the warm-up "
        "call, replayed with a new u copied in each repeat). `nstep`: f-evaluations made; `to "
        "tol`: up to the first iterate that met the tolerance; overhead = time / (to tol x t_f), t_f the "
        "fastest repeat of a plain 20-call loop; "
        "rel residual of the returned iterate recomputed in float32.",
        "",
        "| cell | tol | solver | variant | path | nstep / to tol | time ms | t_f ms | overhead | "
        "target | TorchDEQ ms | / TorchDEQ | ahead | rel residual | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    marks: list[str] = []
    known = [(r, vs_td(r)) for r in ours]
    known = [(r, v) for r, v in known if v[2] is not None]
    behind = [
        f"{r['cell']} {r['amp']} {r['tol']:.0e} {r['pair']} {r['variant']} ({v[1]})"
        for r, v in known
        if not v[2]
    ]
    for r in f32:
        tgt = OVERHEAD_TARGET.get(r["cell"], {}).get(r["pair"])
        tdm, ratio, ok = vs_td(r)
        t_txt = "-"
        if r["variant"] == "default" and tgt is not None:
            met = None if math.isnan(r["overhead_to_tol"]) else r["overhead_to_tol"] <= tgt
            t_txt = f"<= {tgt}: {mark(met)}"
            marks.append(
                f"- {r['cell_desc']}, {r['pair']}, tol {r['tol']:.0e}: overhead "
                f"{num(r['overhead_to_tol'])} (path {r['path']}, {r['nstep_to_tol']} of "
                f"{r['nstep']} f-evals to tol) <= {tgt}: {mark(met)}"
            )
        L.append(
            f"| {r['cell_desc']} | {r['tol']:.0e} | {r['pair']} | {r['variant']} | {r['path']} | "
            f"{r['nstep']} / {r['nstep_to_tol']} | {num(r['time_ms'], '.3f')} | "
            f"{num(r['t_f_ms'], '.4f')} | {num(r['overhead_to_tol'])} | {t_txt} | {tdm} | "
            f"{ratio} | {mark(ok) if ok is not None else '-'} | {num(r['rel_residual'], '.2e')} | "
            f"{r['status']}{' ' + r['error'] if r['error'] else ''} |"
        )
    L += ["", f"Targets (default path, float32, {card}):", "", *marks]
    if td:
        ok = not behind if known else None
        L.append(
            f"- every deqbench row (eager and default, float32 and bf16) ahead of TorchDEQ: "
            f"{len(known) - len(behind)} of {len(known)} rows: {mark(ok)}"
            + (f" (behind: {'; '.join(behind)})" if behind else "")
        )
    else:
        L.append(f"- every row ahead of TorchDEQ: n/a ({NO_TORCHDEQ})")
    L.append("")
    amp_rows = [r for r in ours if r["tol"] == AMP_TOL]
    if amp_rows:
        L += [
            f"## bf16 (Runtime(amp='bf16'), rel tol {AMP_TOL:g}) beside float32 at rel tol "
            f"{AMP_TOL:g}",
            "",
            "bf16 rows use rel tol 1e-2 (bf16's relative residual floor is about 4e-3); the "
            "residual is recomputed in float32. TorchDEQ: its solve under "
            "`torch.autocast(dtype=torch.bfloat16)`.",
            "",
            "| cell | solver | variant | amp | path | nstep / to tol | time ms | overhead | "
            "rel residual (float32) | status | TorchDEQ ms | ahead |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in amp_rows:
            tdm, ratio, ok = vs_td(r)
            L.append(
                f"| {r['cell_desc']} | {r['pair']} | {r['variant']} | {r['amp']} | {r['path']} | "
                f"{r['nstep']} / {r['nstep_to_tol']} | {num(r['time_ms'], '.3f')} | "
                f"{num(r['overhead_to_tol'])} | {num(r['rel_residual'], '.2e')} | {r['status']}"
                f"{' ' + r['error'] if r['error'] else ''} | {tdm} | "
                f"{mark(ok) if ok is not None else '-'} |"
            )
        L += ["", "bf16 vs float32 at the same tol (solver stage, default path):", ""]
        for r in amp_rows:
            if r["amp"] != "bf16" or r["variant"] != "default":
                continue
            f = by.get((r["cell"], "none", r["tol"], "default", r["solver"]))
            if f is None:
                continue
            sp = f["time_ms"] / r["time_ms"] if r["time_ms"] > 0 else math.nan
            it = within(float(r["nstep_to_tol"]), float(f["nstep_to_tol"]), BF16_ITERS)
            L.append(
                f"- {r['cell_desc']}, {r['pair']}: float32 {num(f['time_ms'], '.3f')} ms / bf16 "
                f"{num(r['time_ms'], '.3f')} ms = {num(sp)}x; f-evals to tol float32 "
                f"{f['nstep_to_tol']} / bf16 {r['nstep_to_tol']}: within 20% {mark(it)}; bf16 "
                f"residual {num(r['rel_residual'], '.2e')}"
            )
        if td:
            bf = [r for r in amp_rows if r["amp"] == "bf16"]
            ok_rows = [vs_td(r)[2] for r in bf]
            known = [o for o in ok_rows if o is not None]
            L.append(
                f"- bf16 rows ahead of TorchDEQ (its bf16 autocast rows): {sum(known)} of "
                f"{len(known)}: {mark(all(known) if known else None)}"
            )
        L.append("")
    # deqbench eager vs TorchDEQ
    if not td:
        L += [f"## Solver time vs TorchDEQ: {NO_TORCHDEQ}", ""]
        return L
    L += [
        "## Solver time to tolerance vs TorchDEQ (eager rows, float32, rel stop mode)",
        "",
        "Target: time deqbench / TorchDEQ <= 0.6 (anderson, broyden), <= 0.8 (fixed_point), "
        "at equal or lower final residual (the residual of the returned iterate, recomputed "
        "by deqbench for both; TorchDEQ returns f(x) of its best x, one contraction further).",
        "",
        "| cell | tol | solver | f-evals dq / td | time ms dq / td | ratio | time target | "
        "rel residual dq / td | residual <= td | target | peak MiB dq / td | "
        "overhead dq / td | status dq / td |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in f32:
        o = theirs(r)
        if r["variant"] != "eager" or o is None:
            continue
        ratio = r["time_ms"] / o["time_ms"]
        tgt = TIME_TARGET[r["pair"]]
        t_ok = ratio <= tgt
        res_ok = r["rel_residual"] <= o["rel_residual"]
        L.append(
            f"| {r['cell_desc']} | {r['tol']:.0e} | {r['pair']} | {r['f_evals']} / "
            f"{o['f_evals']} | {r['time_ms']:.3f} / {o['time_ms']:.3f} | {ratio:.2f} | "
            f"<= {tgt}: {'yes' if t_ok else 'no'} | {r['rel_residual']:.2e} / "
            f"{o['rel_residual']:.2e} | {'yes' if res_ok else 'no'} | "
            f"{mark(t_ok and res_ok)} | {r['peak_mib']:.1f} / {o['peak_mib']:.1f} | "
            f"{r['overhead']:.2f} / {o['overhead']:.2f} | {r['status']} / {o['status']} |"
        )
    L.append("")
    return L


def summarize(
    env: dict,
    solvers: list[dict],
    steps: list[dict],
    thr: list[dict],
    suites: list[dict],
    quick: bool = False,
) -> str:
    td = env.get("torchdeq_missing") is None
    card = env["device_name"]
    title = f"TorchDEQ {env['torchdeq']} (plugin: {env['plugin']})" if td else f"({NO_TORCHDEQ})"
    L = [
        f"# deqbench vs {title}",
        "",
        f"{card} ({env['device']}), torch {env['torch']}, CUDA {env['cuda']}, "
        f"cuDNN {env['cudnn']}, float32 (bf16 rows: {env.get('amp_rows', 'off')}), TF32 "
        f"matmul/cuDNN {env['tf32_matmul']}/{env['tf32_cudnn']}, cudnn.benchmark "
        f"{env['cudnn_benchmark']}, threads {env['threads']}; medians of every timed repeat "
        f"(CUDA events on GPU); a solver comparison (deqbench eager, default, TorchDEQ) is "
        f"timed in {ROUNDS} rounds over its rows, so that a slow period of the host falls on "
        "all of them.",
        "",
    ]
    if not td:
        L += [f"**{NO_TORCHDEQ}** ({env.get('torchdeq_missing')}): deqbench rows only.", ""]
    if quick:
        L += [
            "**Quick run**: small cells, not conv64 / fc1024; the targets are marked to check "
            "the wiring only.",
            "",
        ]
    if solvers:
        L += solver_sections(env, solvers, td)
    failed = [r for r in steps + thr if r.get("error")]
    steps = [r for r in steps if not r.get("error")]
    thr = [r for r in thr if not r.get("error")]
    if failed:
        L += ["## Failed measurements", ""]
        L += [
            f"- {r.get('cell_desc', r.get('model', ''))} {r.get('variant', r.get('amp', ''))} "
            f"{r.get('tol', '')}: {r['error']}"
            for r in failed
        ]
        L.append("")
    if steps:
        L += [
            "## Training step (loss <R, z*>, Anderson fwd rel 1e-4 / adjoint rel 1e-6)",
            "",
            "`solve ms`: the forward solve alone through the DEQ layer in train mode (its path "
            "and f-evals); `VJP ms`: one VJP of the cell at z* (the adjoint makes one per step).",
            "",
            "| cell | variant | fwd path | step ms | fwd ms | bwd ms | solve ms (path, n) | "
            "VJP ms | peak extra MiB | activation MiB | f-evals fwd / bwd | grad cosine | "
            "grad rel error |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in steps:
            solve = (
                f"{r['solve_ms']:.2f} ({r['solve_path']}, {r['solve_nstep']})"
                if "solve_ms" in r and not math.isnan(r.get("solve_ms", math.nan))
                else "-"
            )
            L.append(
                f"| {r['cell_desc']} | {r['variant']} | {r['forward_path']} | "
                f"{r['step_ms']:.2f} | {r['forward_ms']:.2f} | {r['backward_ms']:.2f} | {solve} | "
                f"{num(r.get('vjp_ms'), '.3f')} | {r['peak_mib']:.1f} | "
                f"{r['activation_mib']:.1f} | {r['forward_nstep']} / {r['backward_nstep']} | "
                f"{r['grad_cosine']:.6f} | {r['grad_rel_error']:.2e} |"
            )
        L.append("")
        L += [f"Targets ({card}):", ""]
        for cell in dict.fromkeys(r["cell"] for r in steps):
            v = {r["variant"]: r for r in steps if r["cell"] == cell}
            if not {"deqbench_ift", "deqbench_unrolled30"} <= set(v):
                continue
            dq, un = v["deqbench_ift"], v["deqbench_unrolled30"]
            ratio = dq["step_ms"] / un["step_ms"]
            tgt = (
                f"<= {IFT_VS_UNROLLED}: {mark(ratio <= IFT_VS_UNROLLED)}"
                if cell == "fc"
                else "no target (shown)"
            )
            adj = dq["backward_nstep"] * dq.get("vjp_ms", math.nan)
            L += [
                f"- {dq['cell_desc']}: IFT step / unrolled-30 step = {dq['step_ms']:.2f} / "
                f"{un['step_ms']:.2f} ms = {ratio:.2f}: {tgt}",
                f"  - IFT: forward {dq['forward_ms']:.2f} ms (path {dq['forward_path']}; the solve alone "
                f"{num(dq.get('solve_ms'))} ms, path {dq.get('solve_path', '-')}, "
                f"{dq.get('solve_nstep', '-')} f-evals, {dq.get('solve_nstep_to_tol', '-')} to "
                f"tol) + backward {dq['backward_ms']:.2f} ms (adjoint {dq['backward_nstep']} "
                f"steps x VJP {num(dq.get('vjp_ms'), '.3f')} ms = {num(adj)} ms; the rest: "
                "solver bookkeeping, the parameter VJP)",
                f"  - unrolled-30: forward {un['forward_ms']:.2f} ms + backward "
                f"{un['backward_ms']:.2f} ms",
            ]
        L.append("")
        conv = {r["variant"]: r for r in steps if r["cell"] == "conv"}
        if not td:
            L += [f"TorchDEQ time-ratio targets (conv cell): {NO_TORCHDEQ}", ""]
        elif {"deqbench_ift", "torchdeq_ift", "deqbench_unrolled30"} <= set(conv):
            dq, tdr, un = conv["deqbench_ift"], conv["torchdeq_ift"], conv["deqbench_unrolled30"]
            tr = dq["step_ms"] / tdr["step_ms"]
            mr = dq["peak_mib"] / tdr["peak_mib"] if tdr["peak_mib"] > 0 else math.nan
            ur = dq["peak_mib"] / un["peak_mib"] if un["peak_mib"] > 0 else math.nan
            L += [
                "Targets (conv cell):",
                "",
                f"- IFT step time <= 0.8 x TorchDEQ: ratio {tr:.2f}: {mark(tr <= 0.8)}",
                f"- IFT peak extra memory <= TorchDEQ: ratio {mr:.2f}: "
                f"{mark(None if math.isnan(mr) else mr <= 1.0)}",
                f"- IFT peak memory <= 0.2 x unrolled-30: ratio {ur:.2f}: "
                f"{mark(None if math.isnan(ur) else ur <= 0.2)}",
                f"- gradient rel error vs float64 reference: deqbench {dq['grad_rel_error']:.2e}, "
                f"TorchDEQ {tdr['grad_rel_error']:.2e}",
                "",
            ]
    if thr:
        L += [
            "## Throughput analysis vs a hand-written loop (conv_deq eval forward, Anderson)",
            "",
            "| model | batch | amp | tol | path | state dtype | analysis ms (IQR) | hand loop ms "
            "before / after | ratio | within 5% | samples/s | f-evals (to tol) | rel residual "
            "(float32) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in thr:
            ok = abs(r["ratio"] - 1) <= 0.05
            L.append(
                f"| {r['model']} | {r['batch']} | {r['amp']} | {r['tol']:g} | {r['path']} | "
                f"{r['state_dtype']} | {r['analysis_ms']:.3f} ({r['analysis_iqr_ms']:.3f}) | "
                f"{r['hand_loop_ms_before']:.3f} / {r['hand_loop_ms_after']:.3f} | "
                f"{r['ratio']:.3f} | {mark(ok)} | {r['samples_per_s']:.0f} | {r['f_evals']} "
                f"({r['nstep_to_tol']}) | {r['rel_residual']:.2e} |"
            )
        L.append("")
        f = next((r for r in thr if r["amp"] == "none" and r["tol"] == AMP_TOL), None)
        b = next((r for r in thr if r["amp"] == "bf16"), None)
        if f is not None and b is not None:
            sp = b["samples_per_s"] / f["samples_per_s"]
            it = within(float(b["f_evals"]), float(f["f_evals"]), BF16_ITERS)
            L += [
                f"Target ({card}): bf16 conv64 throughput >= {BF16_SPEEDUP}x float32 at "
                f"the same rel tol {AMP_TOL:g}, iteration counts within 20%:",
                "",
                f"- {b['model']} batch {b['batch']}: bf16 {b['samples_per_s']:.0f} / float32 "
                f"{f['samples_per_s']:.0f} samples/s = {sp:.2f}x: {mark(sp >= BF16_SPEEDUP)}; "
                f"f-evals float32 {f['f_evals']} / bf16 {b['f_evals']}: within 20% {mark(it)}; "
                f"bf16 residual (float32) {b['rel_residual']:.2e}; both: "
                f"{mark(sp >= BF16_SPEEDUP and bool(it))}",
                "",
            ]
    for s in suites:
        L.append(f"- suite {s['suite']}: {s['run_dir']} (exit {s['exit_code']})")
    return "\n".join(L) + "\n"


def plots(out: Path, solvers: list[dict], steps: list[dict]) -> None:
    from deqbench.run.plots import new_figure, save_figure

    by = {(r["cell"], r["amp"], r["tol"], r["variant"], r["solver"]): r for r in solvers}
    dq = [
        r for r in solvers if r["library"] == "deqbench" and r["amp"] == "none" and r["tol"] in TOLS
    ]
    if dq:
        # one group per (cell, tol, solver): the eager bar beside the default-path bar
        groups = list(dict.fromkeys((r["cell"], r["tol"], r["pair"]) for r in dq))
        labels = [f"{c} {t:.0e}\n{p}" for c, t, p in groups]
        variants = (("eager", "tab:blue"), ("default", "tab:orange"))

        def grouped(ax, value, target, ylabel: str, title: str, fname: str) -> None:
            w = 0.38
            for j, (var, color) in enumerate(variants):
                xs, ys = [], []
                for i, g in enumerate(groups):
                    r = by.get((g[0], "none", g[1], var, g[2]))
                    if r is not None:
                        xs.append(i + (j - 0.5) * w)
                        ys.append(value(r))
                ax.bar(xs, ys, width=w, color=color, label=f"deqbench {var}")
            drawn = False
            for i, g in enumerate(groups):
                t = target(g)
                if t is not None:
                    ax.hlines(t, i - 0.45, i + 0.45, colors="tab:red",
                              label=None if drawn else "target")  # fmt: skip
                    drawn = True
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")
            ax.set_xticks(range(len(groups)), labels, fontsize=7, rotation=45, ha="right")
            ax.set_ylabel(ylabel)
            ax.set_title(title, fontsize=9)
            ax.legend(fontsize=7, loc="upper left")
            save_figure(ax.figure, out / fname)

        def vs_torchdeq(r: dict) -> float:
            o = by.get((r["cell"], r["amp"], r["tol"], "eager", "torchdeq_" + r["pair"]))
            return r["time_ms"] / o["time_ms"] if o is not None else math.nan

        if any(by.get((c, "none", t, "eager", "torchdeq_" + p)) for c, t, p in groups):
            fig = new_figure(8.0, 4.2)
            grouped(fig.axes[0], vs_torchdeq, lambda g: TIME_TARGET[g[2]],
                    "time to tolerance, deqbench / TorchDEQ",
                    "time ratio to TorchDEQ (float32; red: time-ratio target)", "solver_ratio.png")  # fmt: skip
        fig = new_figure(8.0, 4.2)
        grouped(fig.axes[0], lambda r: r["overhead_to_tol"],
                lambda g: OVERHEAD_TARGET.get(g[0], {}).get(g[2]),
                "time / (f-evals to tol x t_f)",
                "solver overhead (float32; red: overhead target for the default path)",
                "solver_overhead.png")  # fmt: skip
    steps = [r for r in steps if not r.get("error")]
    if steps:
        fig = new_figure(4.5, 3.6, ncols=2)
        for ax, key, lab in zip(
            fig.axes, ("step_ms", "peak_mib"), ("step (ms)", "peak extra (MiB)")
        ):
            names = [f"{r['cell']}\n{r['variant']}" for r in steps]
            ax.bar(range(len(steps)), [r[key] for r in steps], color="tab:green")
            ax.set_xticks(range(len(steps)), names, fontsize=6, rotation=45, ha="right")
            ax.set_ylabel(lab)
        fig.suptitle(
            "training step, loss <R, z*> (Anderson forward rel 1e-4, adjoint 1e-6): time and "
            "peak memory above the model",
            fontsize=8,
        )
        save_figure(fig, out / "train_step.png")


def write_csv(path: Path, rows: list[dict]) -> None:
    import pandas as pd

    if rows:
        pd.DataFrame(rows).to_csv(path, index=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="small cells (CPU check of the wiring)")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats (default 10; quick 3)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up calls (default 3; quick 1)")
    ap.add_argument("--max-iter", type=int, default=100)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default 1 on CPU)")
    ap.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    ap.add_argument("--suites", nargs="+", default=["vs_torchdeq", "perf"])
    ap.add_argument("--no-cudnn-benchmark", action="store_true")
    ap.add_argument(
        "--amp",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"also the bf16 rows (Runtime(amp='bf16'), rel tol {AMP_TOL:g}) and float32 rows at "
        f"that tol (default on; --no-amp skips them)",
    )
    args = ap.parse_args(argv)
    args.repeats = args.repeats or (3 if args.quick else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)

    why = check_plugin()
    args.td = why is None
    if why:
        log(f"{NO_TORCHDEQ}: {why}; every stage runs its deqbench rows only")
    device = torch.device(args.device)
    threads = args.threads or (1 if device.type == "cpu" else torch.get_num_threads())
    torch.set_num_threads(threads)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = not args.no_cudnn_benchmark
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment(device, threads, why, args.amp)
    (out / "env.json").write_text(json.dumps(env, indent=2, default=str))
    cells = cellmod.cells(quick=args.quick, device=device)
    tols = list(TOLS)
    solvers, steps, thr, suites = [], [], [], []

    def checkpoint() -> None:  # a summary after each stage: a cut run still reports what ran
        (out / "summary.md").write_text(summarize(env, solvers, steps, thr, suites, args.quick))

    t0 = time.perf_counter()
    failed: list[str] = []

    def stage(name: str, fn: Any, *a: Any) -> list[dict]:
        """Run one stage; a stage that fails is logged and the next one still runs."""
        if name not in args.stages:
            return []
        try:
            rows = fn(*a)
        except Exception:  # noqa: BLE001 - the other stages still run, the exit code says it
            import traceback

            traceback.print_exc()
            failed.append(name)
            return []
        write_csv(out / f"{name}.csv", rows)
        log(f"[bench] {name} done at {time.perf_counter() - t0:.0f} s")
        return rows

    solvers = stage("solvers", bench_solvers, cells, tols, args)
    checkpoint()
    steps = stage("train_step", bench_train_step, cells, args)
    checkpoint()
    thr = stage("throughput", bench_throughput, device, args.quick, args)
    checkpoint()
    try:
        plots(out, solvers, steps)
    except Exception as exc:  # noqa: BLE001 - figures are optional
        log(f"[bench] plots failed: {exc}")
    log(f"[bench] stages done in {time.perf_counter() - t0:.0f} s")
    if "suites" in args.stages:
        suites = run_suites(args.suites, out, "cuda" if device.type == "cuda" else "cpu")
    text = summarize(env, solvers, steps, thr, suites, args.quick)
    if failed:
        text += f"\nFailed stages (traceback in the log): {', '.join(failed)}\n"
    (out / "summary.md").write_text(text)
    print(text)
    return 0 if not failed and all(s["exit_code"] == 0 for s in suites) else 1


if __name__ == "__main__":
    raise SystemExit(main())
