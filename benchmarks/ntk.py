"""Empirical NTK speed benchmark.

Model: the tanh fc_deq, z = tanh(W z + U x + b), ||W||_2 = 0.7, linear head, input dim 32
(H = 300: P = 100,201). Solves in float32 with 60 plain iterations each (fixed_point, no early
stop, last iterate), per-sample gradients in float32, K accumulated in float64, eigvalsh in
float64, TF32 off. Times: median over repeats after warm-ups (CUDA events on GPU).

Measured side by side in one run:

* the parts: forward solve; forward + adjoint solve (``deqbench.ntk.prepare``; the adjoint is
  the difference; by default solved directly: per-sample H x H Jacobians and one batched LU
  solve, ``adjoint="auto"``); per-sample Jacobian of the surrogate (all blocks); contraction
  K = sum_b G_b G_b^T; eigvalsh;
* the whole evaluation with the adjoint iterated by the layer's solver instead (60 steps);
* the whole evaluation: ``empirical_ntk`` + ``ntk_summary`` (eigvalsh);
* the naive loop (N separate IFT backward passes through the model, timed with the same
  plain adjoint iteration) and the batched K's agreement with a reference: the naive loop on a
  float64 copy solved to 1e-12 (Anderson adjoint), reported as an error (no comparison) if it
  missed that tolerance; the gram fast path;
* lambda_min beside its noise floor (``ntk_summary``: K's float64 rounding plus that of the
  float32 gradients); a K singular to working precision is reported as such (lambda_min ~ 0,
  ``spectrum`` "singular"), never as NaN.
* scaling in N (128, 512, 2048) at P ~ 100k and in P (10k, 100k, 1M) at N = 512; the
  contraction is blockwise (blocks of at most a quarter of the free GPU memory, 8 GiB), so J is
  never held whole when it does not fit; ``--block-mib`` sets the budget.

Targets on an H100: N = 512, P ~ 100k in <= 25 ms and <= 1.3 x the sum of its parts;
>= 50 x faster than the naive loop; N = 2048 in <= 80 ms. The NTK target: N = 512, P ~ 100k in
<= 20 ms (``--quick-target``: that case alone, with its parts, no naive loop, no scaling sweeps;
the JSON's ``target`` says met / not met).

Usage::

    python benchmarks/ntk.py --device cuda --out benchmarks/results/ntk_h100.json
    python benchmarks/ntk.py --device cpu --quick          # small CPU smoke run
    python benchmarks/ntk.py --device cuda --quick-target --out ntk.json   # the NTK target only
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import deqbench
from deqbench.deq import BackwardConfig, SolverConfig, configure
from deqbench.ntk import (
    _numerics,
    contract,
    empirical_ntk,
    jacobian_blocks,
    naive_ntk,
    ntk_summary,
    prepare,
    reference_converged,
)

#: the NTK target: N = 512, P ~ 100k, whole evaluation (empirical_ntk + ntk_summary)
TARGET_MS = 20.0


def build(width: int, n_in: int, device: str, iters: int, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    m = deqbench.models.create("fc_deq", in_shape=(n_in,), num_outputs=1, width=width)
    with torch.no_grad():
        W = m.deq.cell.W.weight
        W.mul_(0.7 / torch.linalg.matrix_norm(W, ord=2))
    m = m.to(device)
    # 60 plain iterations each: no early stop (tol 0), no lowest-iterate tracking
    opts = {"returns": "last"}
    configure(
        m,
        SolverConfig("fixed_point", max_iter=iters, tol=0.0, options=opts),
        BackwardConfig("ift", solver="fixed_point", max_iter=iters, tol=0.0, options=opts),
    )
    return m.eval()


def n_params(m: Any) -> int:
    return sum(p.numel() for p in m.parameters())


class Timer:
    def __init__(self, device: str, repeats: int, warmup: int) -> None:
        self.cuda = device.startswith("cuda")
        self.repeats, self.warmup = repeats, warmup

    def __call__(
        self, fn: Callable[[], Any], repeats: int | None = None
    ) -> tuple[float, list[float]]:
        """Median seconds of fn() and all repeats."""
        reps = self.repeats if repeats is None else repeats
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(reps):
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                a.record()
                fn()
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
            else:
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
        return statistics.median(times), times


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(
    width: int, n: int, args: Any, timer: Timer, parts: bool, naive: bool
) -> dict[str, Any]:
    dev = args.device
    m = build(width, args.n_in, dev, args.iters)
    X = torch.randn(n, args.n_in, device=dev)
    row: dict[str, Any] = {"N": n, "H": width, "P": n_params(m)}
    bb = args.block_mib << 20 if args.block_mib else None

    def whole() -> dict[str, Any]:
        K = empirical_ntk(m, X, block_bytes=bb)
        return ntk_summary(K, eps=torch.finfo(torch.float32).eps)

    row["whole_s"], row["whole_all_s"] = timer(whole)
    s = whole()
    row.update(
        lambda_min=s["lambda_min"],
        lambda_max=s["lambda_max"],
        condition=s["condition"],
        noise_floor=s["noise_floor"],
        resolved=s["resolved"],
        spectrum=s["status"],  # resolved | singular (lambda_min <= floor) | non-finite
    )
    if parts:

        def fwd() -> None:
            with torch.no_grad():
                u = m.inject(X)
                m.deq.solve(u, m.z0(u))
                sync(dev)

        row["forward_s"], _ = timer(fwd)
        row["solves_s"], _ = timer(lambda: (prepare(m, X), sync(dev)))
        row["adjoint_s"] = row["solves_s"] - row["forward_s"]
        st = prepare(m, X)
        row["blocks"] = sum(1 for _ in jacobian_blocks(st, block_bytes=bb))

        def jac() -> None:
            for _ in jacobian_blocks(st, block_bytes=bb):
                pass

        row["jacobian_s"], _ = timer(jac)
        jbytes = n * row["P"] * 4
        if jbytes <= args.hold_gib * (1 << 30):
            blocks = list(jacobian_blocks(st, block_bytes=bb))
            row["contraction_s"], _ = timer(lambda: contract(blocks, st.rows))
            K = contract(blocks, st.rows)
            del blocks
        else:  # J does not fit whole: contraction = (jacobian + contraction) - jacobian
            both, _ = timer(lambda: contract(jacobian_blocks(st, block_bytes=bb), st.rows))
            row["contraction_s"] = both - row["jacobian_s"]
            K = contract(jacobian_blocks(st, block_bytes=bb), st.rows)
        Ks = 0.5 * (K + K.T)
        row["eigvalsh_s"], _ = timer(lambda: (torch.linalg.eigvalsh(Ks), sync(dev)))
        row["parts_sum_s"] = sum(
            row[k] for k in ("solves_s", "jacobian_s", "contraction_s", "eigvalsh_s")
        )
        row["whole_over_parts"] = row["whole_s"] / row["parts_sum_s"]
    if naive:
        # the same evaluation with the adjoint iterated by the layer's backward solver
        row["whole_adjoint_solver_s"], _ = timer(
            lambda: ntk_summary(
                empirical_ntk(m, X, block_bytes=bb, adjoint="solver"),
                eps=torch.finfo(torch.float32).eps,
            )
        )

        def nv() -> Any:
            # timed with the configured (plain) adjoint, as the batched path iterates it
            with _numerics():
                K, _ = naive_ntk(m, X, "sum", None, None, robust=False)
            sync(dev)
            return K

        row["naive_s"], _ = timer(nv, repeats=args.naive_repeats)
        row["naive_speedup"] = row["naive_s"] / row["whole_s"]
        Kb = empirical_ntk(m, X, block_bytes=bb)
        # accuracy reference: the naive loop on a float64 copy, solved to 1e-12 (Anderson
        # adjoint); a reference that missed its tolerance is reported, never compared against
        m64 = copy.deepcopy(m).double()
        Kn, info = empirical_ntk(
            m64, X.double(), method="naive", tol=1e-12, max_iter=2000, return_info=True
        )
        ok, why = reference_converged(info)
        row["naive_ref"] = "ok (float64, tol 1e-12)" if ok else f"error: reference {why}"
        row["naive_rel_err"] = float((Kb - Kn).norm() / Kn.norm()) if ok else None
        del m64, Kn
        row["gram_s"], _ = timer(lambda: (empirical_ntk(m, X, method="gram"), sync(dev)))
        row["gram_rel_err"] = float((empirical_ntk(m, X, method="gram") - Kb).norm() / Kb.norm())
    if dev.startswith("cuda"):
        torch.cuda.empty_cache()
    return row


def env(device: str) -> dict[str, Any]:
    e = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": device,
        "threads": torch.get_num_threads(),
        "tf32": "off inside the NTK (forced)",
        "deqbench": deqbench.__version__,
    }
    if device.startswith("cuda"):
        e["gpu"] = torch.cuda.get_device_name(device)
        e["cuda"] = torch.version.cuda
        e["cudnn.benchmark"] = torch.backends.cudnn.benchmark
    else:
        e["cpu"] = platform.processor() or platform.machine()
    return e


def fmt_ms(v: Any) -> str:
    return f"{1e3 * v:.1f}" if isinstance(v, float) else "-"


def table(rows: list[dict[str, Any]]) -> str:
    cols = [
        ("N", "N"),
        ("P", "P"),
        ("blocks", "blocks"),
        ("forward_s", "fwd ms"),
        ("adjoint_s", "adj ms"),
        ("jacobian_s", "J ms"),
        ("contraction_s", "JJ^T ms"),
        ("eigvalsh_s", "eig ms"),
        ("parts_sum_s", "parts ms"),
        ("whole_s", "whole ms"),
        ("whole_over_parts", "whole/parts"),
        ("naive_s", "naive ms"),
        ("naive_speedup", "naive/whole"),
        ("naive_rel_err", "naive err"),
        ("naive_ref", "naive ref"),
        ("gram_s", "gram ms"),
        ("whole_adjoint_solver_s", "whole, iterated adjoint ms"),
        ("lambda_min", "lambda_min"),
        ("noise_floor", "floor"),
        ("condition", "cond"),
        ("spectrum", "spectrum"),
    ]
    lines = ["| " + " | ".join(c[1] for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for k, _ in cols:
            v = r.get(k)
            if k.endswith("_s"):
                cells.append(fmt_ms(v))
            elif k in ("whole_over_parts", "naive_speedup"):
                cells.append(f"{v:.2f}" if v is not None else "-")
            elif k in ("naive_rel_err", "lambda_min", "condition", "noise_floor"):
                cells.append(f"{v:.3g}" if v is not None else "-")
            else:
                cells.append(str(v) if v is not None else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--n-in", type=int, default=32)
    ap.add_argument("--iters", type=int, default=60, help="plain iterations per solve")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--naive-repeats", type=int, default=3)
    ap.add_argument("--block-mib", type=int, default=0, help="block budget (0: default)")
    ap.add_argument(
        "--hold-gib",
        type=float,
        default=4.0,
        help="hold J for the contraction timing up to this size",
    )
    ap.add_argument("--quick", action="store_true", help="small sizes (CPU smoke run)")
    ap.add_argument(
        "--quick-target",
        action="store_true",
        help=f"only the NTK target case (N = 512, P ~ 100k; with --quick the small one) and its "
        f"parts: no naive loop, no scaling sweeps; target whole <= {TARGET_MS:g} ms",
    )
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--out", type=Path, default=None, help="write JSON (and a .md table next to it)"
    )
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    elif not args.device.startswith("cuda"):
        torch.set_num_threads(1)
    timer = Timer(args.device, args.repeats, args.warmup)
    if args.quick:
        main_cfg, n_scan, p_scan = (96, 128), [64, 128], [(32, 128), (96, 128)]
    else:
        main_cfg, n_scan = (300, 512), [128, 512, 2048]
        p_scan = [(88, 512), (300, 512), (990, 512)]  # P ~ 10.7k, 100k, 1.01M
    out: dict[str, Any] = {
        "env": env(args.device),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    print(f"# NTK benchmark on {out['env'].get('gpu', out['env'].get('cpu'))}", file=sys.stderr)
    headline = measure(
        main_cfg[0], main_cfg[1], args, timer, parts=True, naive=not args.quick_target
    )
    out["headline"] = headline
    print(table([headline]), flush=True)
    ms = 1e3 * headline["whole_s"]
    out["target"] = {
        "issue": 17,
        "case": f"N = {headline['N']}, P = {headline['P']}",
        "whole_ms": ms,
        "target_ms": TARGET_MS,
        "met": ms <= TARGET_MS,
        "device": out["env"].get("gpu", out["env"].get("cpu")),
    }
    print(
        f"NTK target: {out['target']['case']} whole {ms:.2f} ms <= {TARGET_MS:g} ms: "
        f"{'met' if ms <= TARGET_MS else 'NOT met'} ({out['target']['device']})",
        flush=True,
    )
    n_scan, p_scan = ([], []) if args.quick_target else (n_scan, p_scan)
    out["scaling_N"] = [
        measure(main_cfg[0], n, args, timer, parts=True, naive=False) for n in n_scan
    ]
    if n_scan:
        print(table(out["scaling_N"]), flush=True)
    out["scaling_P"] = [measure(h, n, args, timer, parts=True, naive=False) for h, n in p_scan]
    if p_scan:
        print(table(out["scaling_P"]), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2, default=str))
        md = [
            "## headline (N=512, P~100k)",
            table([headline]),
            "",
            f"NTK target: whole {ms:.2f} ms <= {TARGET_MS:g} ms: "
            f"{'met' if out['target']['met'] else 'NOT met'} ({out['target']['device']})",
        ]
        if not args.quick_target:
            md += [
                "",
                "## scaling in N",
                table(out["scaling_N"]),
                "",
                "## scaling in P",
                table(out["scaling_P"]),
            ]
        args.out.with_suffix(".md").write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
