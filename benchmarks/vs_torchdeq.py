"""deqbench vs TorchDEQ 0.1.0 side by side, through the plugin path, with the issue-6 targets.

One run, one device, float32, TF32 off, the same seeded batches and tolerances for both
libraries; TorchDEQ is reached only through the registered plugin (examples/deqbench-torchdeq:
solvers ``torchdeq_*`` and the model wrapper ``torchdeq_deq``), f-evaluations are counted by
deqbench wrapping f for both. Stages (each can be skipped):

1. ``solvers``: the REFERENCE.md 2.6 bare cells (benchmarks/cells.py: conv64 at batch 128,
   fc1024 at batch 512), rel tol 1e-4 and 1e-6, max_iter 100: time to tolerance (every repeat
   kept), f-evaluations, t_f (plain loop), overhead, the residual of the returned iterate
   recomputed by deqbench for both, peak extra memory of a solve (GPU);
2. ``train_step``: one IFT training step on each bare cell (loss <R, z*>, Anderson forward rel
   1e-4 and adjoint rel 1e-6, max_iter 100; REFERENCE.md 3.2): deqbench IFT, TorchDEQ IFT
   (``torchdeq_deq`` wrapper on the same cell) and deqbench unrolled-30: forward / backward /
   step time, peak extra memory, gradient cosine and relative error against a float64 IFT
   reference (tol 1e-12) on the same batch;
3. ``throughput``: the ``throughput`` analysis' eval forward of ``conv_deq`` (64 ch, batch 128)
   against a hand-written timing loop of the same model;
4. ``suites``: suites/vs_torchdeq.yaml and suites/perf.yaml through the runner (trained cells).

Writes into ``--out``: ``solvers.csv``, ``train_step.csv``, ``throughput.csv``, ``env.json``,
``summary.md`` (tables and each target marked met / not met with its ratio), ``*.png``, and the
suite runs under ``runs/``.

Usage:
    pip install torchdeq==0.1.0 && pip install -e examples/deqbench-torchdeq   # the plugin
    python benchmarks/vs_torchdeq.py --out results/vs_torchdeq                 # H100: ~5 min
    python benchmarks/vs_torchdeq.py --quick --device cpu --out /tmp/vs --stages solvers train_step
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
from deqbench.analyses.backward import measure_mode  # noqa: E402
from deqbench.analyses.throughput import measure_throughput, reference_loop_ms  # noqa: E402
from deqbench.deq import BackwardConfig, SolverConfig, configure  # noqa: E402
from deqbench.gradients import CellModel, InnerProductLoss, reference_gradient  # noqa: E402
from deqbench.measure import f_time, gpu_peak_memory, is_cuda, solver_time_to_tol  # noqa: E402

PAIRS = (
    ("fixed_point", "torchdeq_fixed_point"),
    ("anderson", "torchdeq_anderson"),
    ("broyden", "torchdeq_broyden"),
)
TIME_TARGET = {"fixed_point": 0.8, "anderson": 0.6, "broyden": 0.6}
STAGES = ("solvers", "train_step", "throughput", "suites")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def environment(device: torch.device, threads: int) -> dict[str, Any]:
    import torchdeq

    return {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else (platform.processor() or platform.machine()),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "torchdeq": getattr(torchdeq, "__version__", "0.1.0"),
        "deqbench": deqbench.__version__,
        "plugin": deqbench.solvers.origin("torchdeq_anderson"),
        "dtype": "float32",
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "threads": threads,
    }


def check_plugin() -> str | None:
    try:
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


def bench_solvers(cells: list[Any], tols: list[float], args: argparse.Namespace) -> list[dict]:
    rows = []
    for cell in cells:
        with torch.no_grad():
            tf = f_time(cell.f, cell.z0, repeats=args.repeats, warmup=args.warmup, loop=20)
        log(f"[solvers] {cell.desc}: t_f {tf.median * 1e3:.4f} ms")
        for tol in tols:
            for ours, theirs in PAIRS:
                for name in (ours, theirs):  # interleaved: drift affects both alike
                    solve = deqbench.solvers.get(name)
                    st = solver_time_to_tol(
                        solve,
                        cell.f,
                        cell.z0,
                        max_iter=args.max_iter,
                        tol=tol,
                        repeats=args.repeats,
                        warmup=args.warmup,
                        t_f=tf.median,
                    )
                    peak = math.nan
                    if is_cuda(cell.z0.device):
                        opts = {"check_returned": False} if name.startswith("torchdeq_") else {}
                        step = functools.partial(
                            solve, cell.f, cell.z0, max_iter=args.max_iter, tol=tol, **opts
                        )
                        with torch.no_grad():
                            mem = gpu_peak_memory(step, cell.z0.device)
                        peak = mem.peak_mib
                    t = st.timing
                    rows.append(
                        {
                            "cell": cell.name,
                            "cell_desc": cell.desc,
                            "tol": tol,
                            "pair": ours,
                            "library": "torchdeq" if name.startswith("torchdeq_") else "deqbench",
                            "solver": name,
                            "f_evals": st.nfe[-1],
                            "f_evals_constant": len(set(st.nfe)) == 1,
                            "time_ms": t.median * 1e3,
                            "iqr_ms": t.iqr * 1e3,
                            "spread": t.spread,
                            "cpu_ms": (
                                sorted(t.cpu_times)[len(t.cpu_times) // 2] * 1e3
                                if t.cpu_times
                                else math.nan
                            ),
                            "times_ms": ";".join(f"{x * 1e3:.4f}" for x in t.times),
                            "t_f_ms": tf.median * 1e3,
                            "overhead": st.overhead,
                            "rel_residual": st.rel_residual,
                            "abs_residual": st.abs_residual,
                            "status": st.stats.status,
                            "peak_mib": peak,
                        }
                    )
                    r = rows[-1]
                    log(
                        f"  {cell.name} {tol:.0e} {name:22s} f={r['f_evals']:3d} "
                        f"t={r['time_ms']:9.3f} ms ovh={r['overhead']:.2f} "
                        f"res={r['rel_residual']:.2e} {r['status']}"
                    )
    return rows


# -- 2. IFT training step --------------------------------------------------------------------------


def bench_train_step(cells: list[Any], args: argparse.Namespace) -> list[dict]:
    wrapper = deqbench.models.get("torchdeq_deq")
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
        variants = [
            ("deqbench_ift", model, ift),
            ("torchdeq_ift", wrapper(wrap=copy.deepcopy(model)), ift),
            ("deqbench_unrolled30", model, BackwardConfig("unrolled", k=30)),
        ]
        for label, m, bcfg in variants:
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
            rows.append(
                {
                    "cell": cell.name,
                    "cell_desc": cell.desc,
                    "variant": label,
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
                }
            )
            r = rows[-1]
            log(
                f"  {cell.name} {label:20s} step {r['step_ms']:8.2f} ms (fwd {r['forward_ms']:.2f}, "
                f"bwd {r['backward_ms']:.2f}) peak {r['peak_mib']:.1f} MiB "
                f"grad err {r['grad_rel_error']:.2e} cos {r['grad_cosine']:.6f}"
            )
    return rows


# -- 3. throughput vs a hand-written loop -----------------------------------------------------------


def bench_throughput(device: torch.device, quick: bool, args: argparse.Namespace) -> list[dict]:
    torch.manual_seed(0)
    ch, size, batch = (16, 16, 16) if quick else (64, 32, 128)
    model = deqbench.models.create(
        "conv_deq", in_shape=(3, size, size), num_outputs=10, channels=ch, inner=ch
    ).to(device)
    configure(model, SolverConfig("anderson", args.max_iter, 1e-4))
    x = torch.randn(batch, 3, size, size, device=device)
    iters = 5 if quick else 20
    hand1 = reference_loop_ms(model, x, iters=iters, warmup=3)
    res = measure_throughput(model, x, repeats=iters, warmup=3, train_step=False, memory=False)
    hand2 = reference_loop_ms(model, x, iters=iters, warmup=1)
    hand = (hand1 + hand2) / 2
    med = res["eval"].median * 1e3
    log(
        f"[throughput] conv_deq {ch}ch b{batch}: analysis {med:.3f} ms, hand loop {hand1:.3f} / "
        f"{hand2:.3f} ms, ratio {med / hand:.3f}"
    )
    return [
        {
            "model": f"conv_deq {ch}ch/{ch} {size}x{size}",
            "batch": batch,
            "analysis_ms": med,
            "analysis_iqr_ms": res["eval"].iqr * 1e3,
            "hand_loop_ms_before": hand1,
            "hand_loop_ms_after": hand2,
            "ratio": med / hand,
            "samples_per_s": batch / (med / 1e3),
            "f_evals": res["eval_nstep"][-1],
        }
    ]


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


def summarize(
    env: dict, solvers: list[dict], steps: list[dict], thr: list[dict], suites: list[dict]
) -> str:
    L = [
        f"# deqbench vs TorchDEQ {env['torchdeq']} (plugin: {env['plugin']})",
        "",
        f"{env['device_name']} ({env['device']}), torch {env['torch']}, CUDA {env['cuda']}, "
        f"cuDNN {env['cudnn']}, float32, TF32 matmul/cuDNN {env['tf32_matmul']}/"
        f"{env['tf32_cudnn']}, cudnn.benchmark {env['cudnn_benchmark']}, threads "
        f"{env['threads']}; medians of every timed repeat (CUDA events on GPU).",
        "",
    ]
    if solvers:
        L += [
            "## Solver time to tolerance (same cell, batch, tolerance; rel stop mode)",
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
        by = {(r["cell"], r["tol"], r["solver"]): r for r in solvers}
        for r in solvers:
            if r["library"] != "deqbench":
                continue
            o = by[(r["cell"], r["tol"], "torchdeq_" + r["pair"])]
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
    if steps:
        L += [
            "## Training step (loss <R, z*>, Anderson fwd rel 1e-4 / adjoint rel 1e-6)",
            "",
            "| cell | variant | step ms | fwd ms | bwd ms | peak extra MiB | activation MiB | "
            "f-evals fwd / bwd | grad cosine | grad rel error |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in steps:
            L.append(
                f"| {r['cell_desc']} | {r['variant']} | {r['step_ms']:.2f} | "
                f"{r['forward_ms']:.2f} | {r['backward_ms']:.2f} | {r['peak_mib']:.1f} | "
                f"{r['activation_mib']:.1f} | {r['forward_nstep']} / {r['backward_nstep']} | "
                f"{r['grad_cosine']:.6f} | {r['grad_rel_error']:.2e} |"
            )
        L.append("")
        conv = {r["variant"]: r for r in steps if r["cell"] == "conv"}
        if {"deqbench_ift", "torchdeq_ift", "deqbench_unrolled30"} <= set(conv):
            dq, td, un = conv["deqbench_ift"], conv["torchdeq_ift"], conv["deqbench_unrolled30"]
            tr = dq["step_ms"] / td["step_ms"]
            mr = dq["peak_mib"] / td["peak_mib"] if td["peak_mib"] > 0 else math.nan
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
                f"TorchDEQ {td['grad_rel_error']:.2e}",
                "",
            ]
    if thr:
        r = thr[0]
        ok = abs(r["ratio"] - 1) <= 0.05
        L += [
            "## Throughput analysis vs a hand-written loop",
            "",
            f"{r['model']} batch {r['batch']}: analysis {r['analysis_ms']:.3f} ms (IQR "
            f"{r['analysis_iqr_ms']:.3f}), hand loop {r['hand_loop_ms_before']:.3f} / "
            f"{r['hand_loop_ms_after']:.3f} ms (before / after): ratio {r['ratio']:.3f}, within "
            f"5%: {mark(ok)}",
            "",
        ]
    for s in suites:
        L.append(f"- suite {s['suite']}: {s['run_dir']} (exit {s['exit_code']})")
    return "\n".join(L) + "\n"


def plots(out: Path, solvers: list[dict], steps: list[dict]) -> None:
    from deqbench.plots import new_figure, save_figure

    if solvers:
        dq = [r for r in solvers if r["library"] == "deqbench"]
        by = {(r["cell"], r["tol"], r["solver"]): r for r in solvers}
        fig = new_figure(7.0, 3.8)
        ax = fig.axes[0]
        labels, ratios = [], []
        for r in dq:
            o = by[(r["cell"], r["tol"], "torchdeq_" + r["pair"])]
            labels.append(f"{r['cell']} {r['tol']:.0e}\n{r['pair']}")
            ratios.append(r["time_ms"] / o["time_ms"])
        ax.bar(range(len(ratios)), ratios, color="tab:blue")
        for i, r in enumerate(dq):
            ax.hlines(TIME_TARGET[r["pair"]], i - 0.4, i + 0.4, colors="tab:red")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xticks(range(len(labels)), labels, fontsize=6)
        ax.set_ylabel("time to tolerance, deqbench / TorchDEQ")
        ax.set_title("solver time ratio (red: target)")
        save_figure(fig, out / "solver_ratio.png")
    if steps:
        fig = new_figure(4.5, 3.6, ncols=2)
        for ax, key, lab in zip(
            fig.axes, ("step_ms", "peak_mib"), ("step (ms)", "peak extra (MiB)")
        ):
            names = [f"{r['cell']}\n{r['variant']}" for r in steps]
            ax.bar(range(len(steps)), [r[key] for r in steps], color="tab:green")
            ax.set_xticks(range(len(steps)), names, fontsize=6, rotation=45, ha="right")
            ax.set_ylabel(lab)
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
    args = ap.parse_args(argv)
    args.repeats = args.repeats or (3 if args.quick else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)

    why = check_plugin()
    if why:
        print(why, file=sys.stderr)
        return 2
    device = torch.device(args.device)
    threads = args.threads or (1 if device.type == "cpu" else torch.get_num_threads())
    torch.set_num_threads(threads)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = not args.no_cudnn_benchmark
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment(device, threads)
    (out / "env.json").write_text(json.dumps(env, indent=2, default=str))
    cells = cellmod.cells(quick=args.quick, device=device)
    tols = [1e-4, 1e-6]
    solvers, steps, thr, suites = [], [], [], []
    t0 = time.perf_counter()
    if "solvers" in args.stages:
        solvers = bench_solvers(cells, tols, args)
        write_csv(out / "solvers.csv", solvers)
    if "train_step" in args.stages:
        steps = bench_train_step(cells, args)
        write_csv(out / "train_step.csv", steps)
    if "throughput" in args.stages:
        thr = bench_throughput(device, args.quick, args)
        write_csv(out / "throughput.csv", thr)
    (out / "summary.md").write_text(summarize(env, solvers, steps, thr, suites))
    plots(out, solvers, steps)
    log(f"[bench] stages done in {time.perf_counter() - t0:.0f} s")
    if "suites" in args.stages:
        suites = run_suites(args.suites, out, "cuda" if device.type == "cuda" else "cpu")
    text = summarize(env, solvers, steps, thr, suites)
    (out / "summary.md").write_text(text)
    print(text)
    return 0 if all(s["exit_code"] == 0 for s in suites) else 1


if __name__ == "__main__":
    raise SystemExit(main())
