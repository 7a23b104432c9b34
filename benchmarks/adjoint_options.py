"""Adjoint options against a float64 reference: what each backward choice costs in a training
step and how far its gradient is from the exact one.

For each bare cell of ``benchmarks/cells.py`` (conv64 and fc1024; ``--quick``: the small cells
of the same builders, for a CPU check), with the forward of the IFT training-step benchmark
(``benchmarks/vs_torchdeq.py --stages train_step``: loss <R, z*> for a fixed seeded R, Anderson
forward rel 1e-4, max_iter 100, the captured path where the layer takes it), one training step
(forward with grad, loss, parameter gradients) is measured for every backward choice of
:func:`choices`:

* ``step ms``: forward + backward, median over ``--repeats`` after ``--warmup`` (CUDA events,
  the device synchronised around each repeat; CPU: wall time), with its forward and backward
  parts;
* ``/ unrolled-30``: the step over the unrolled-30 step of the same cell (the ratio the train-step benchmark reports);
* ``VJP bound / unrolled-30``: (the row's forward ms + its backward VJPs x t_vjp) over the
  unrolled-30 step, t_vjp one z-only VJP of the cell at z* timed alone: what the row would cost
  with no adjoint bookkeeping at all;
* ``backward VJPs``: every VJP through f the backward makes (IFT: the adjoint steps plus the one
  parameter VJP; SHINE: the refinement's VJPs plus one; JFB 1; phantom k; unrolled K);
* ``adjoint rel res``: the residual the backward's own solve reports (IFT's adjoint, SHINE's
  refinement), marked when it missed its tolerance;
* ``grad rel error``: ||g - g_ref|| / ||g_ref|| over all parameters, g_ref the same weights and
  batch cast to float64, forward solved to rel 1e-12 and the adjoint to rel 1e-12
  (:func:`deqbench.performance.gradients.reference_gradient`: a dense per-sample solve when the
  state has at most 128 entries, else Anderson; both residuals measured afresh, the table header
  says what the reference reached).

The cells, the training-step timing (``train_row``, ``solve_parts``) and the reference settings
are those of ``benchmarks/vs_torchdeq.py``, imported.

Usage:
    python benchmarks/adjoint_options.py --device cuda --json adjoint_options.json   # both cells
    python benchmarks/adjoint_options.py --device cpu --quick                          # < 1 min
    python benchmarks/adjoint_options.py --device cpu --quick --choices baseline jfb unrolled30
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cells as cellmod  # noqa: E402
import vs_torchdeq as vs  # noqa: E402

from deqbench import solvers  # noqa: E402
from deqbench.deq import BackwardConfig, SolverConfig  # noqa: E402
from deqbench.performance.gradients import (  # noqa: E402
    CellModel,
    GradVector,
    InnerProductLoss,
    grad_vector,
    gradient_accuracy,
    reference_gradient,
)
from deqbench.solvers.base import residuals  # noqa: E402

#: the forward of the IFT training-step benchmark
FORWARD_TOL = 1e-4
#: the adjoint tolerance of that benchmark's IFT step
ADJOINT_TOL = 1e-6
#: the float64 reference's tolerance (forward and adjoint, rel)
REF_TOL = 1e-12
#: the unrolled baseline every step is compared with
UNROLLED = "unrolled30"


@dataclass(frozen=True)
class Choice:
    """One backward choice: ``key`` (``--choices``), the table's words, the backward config
    and the forward solver it runs with (Anderson, or Broyden where SHINE needs it)."""

    key: str
    text: str
    backward: BackwardConfig
    forward: str = "anderson"
    extra: dict[str, Any] = field(default_factory=dict)


def choices(max_iter: int = 100) -> list[Choice]:
    """The backward choices, unrolled-30 first (every ratio's denominator)."""

    def ift(solver: str, tol: float = ADJOINT_TOL, **kw: Any) -> BackwardConfig:
        return BackwardConfig("ift", solver=solver, max_iter=max_iter, tol=tol, **kw)

    def shine(refine: int) -> BackwardConfig:
        opts = {"refine_steps": refine} if refine else {}
        return BackwardConfig("shine", max_iter=max_iter, tol=ADJOINT_TOL, options=opts)

    return [
        Choice(UNROLLED, "unrolled-30 (backprop through 30 steps from z0)",
               BackwardConfig("unrolled", k=30)),
        Choice("baseline", "IFT, Anderson adjoint rel 1e-6, w0 = g (the train-step benchmark's)",
               ift("anderson")),
        Choice("w0_zeros", "IFT, Anderson adjoint rel 1e-6, w0 = 0", ift("anderson", b_init="zeros")),
        Choice("fixed_point", "IFT, fixed-point adjoint rel 1e-6", ift("fixed_point")),
        Choice("broyden", "IFT, Broyden adjoint rel 1e-6", ift("broyden")),
        Choice("gmres", "IFT, Newton-Krylov adjoint rel 1e-6 (GMRES on the linear system)",
               ift("newton_krylov")),
        Choice("anderson_1e-4", "IFT, Anderson adjoint rel 1e-4", ift("anderson", 1e-4)),
        Choice("anderson_1e-3", "IFT, Anderson adjoint rel 1e-3", ift("anderson", 1e-3)),
        Choice("broyden_fwd", "IFT, Anderson adjoint rel 1e-6, Broyden forward (SHINE's forward)",
               ift("anderson"), forward="broyden"),
        Choice("shine_refine", f"SHINE + Broyden refinement to rel 1e-6 (<= {max_iter} steps), "
               "Broyden forward", shine(max_iter), forward="broyden"),
        Choice("shine", "SHINE (no refinement), Broyden forward", shine(0), forward="broyden"),
        Choice("jfb", "JFB (one VJP)", BackwardConfig("jfb")),
        Choice("phantom5", "phantom gradient, k = 5, tau = 0.5",
               BackwardConfig("phantom", k=5, tau=0.5)),
    ]  # fmt: skip


def quick_cells(device: torch.device) -> list[Any]:
    """The ``--quick`` cells: those of the other benchmarks' ``--quick``."""
    return cellmod.cells(quick=True, device=device)


def cell_model(cell: Any, max_iter: int) -> tuple[Any, SolverConfig]:
    """The bare cell as a DEQ model (a copy of its module) with the train-step benchmark's forward and backward."""
    solver = SolverConfig("anderson", max_iter, FORWARD_TOL, "rel")
    bcfg = BackwardConfig("ift", solver="anderson", max_iter=max_iter, tol=ADJOINT_TOL)
    model = CellModel(copy.deepcopy(cell.module), solver, bcfg, cell.z0.shape[1:])
    return model.to(cell.z0.device), solver


def loss_direction(cell: Any) -> torch.Tensor:
    """R of the loss <R, z*> (seed 1, as the train-step benchmark)."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(cell.z0.shape, generator=g).to(cell.z0.device)


def reference(
    model: Any, cell: Any, R: torch.Tensor, adjoint: str = "auto", tol: float = REF_TOL
) -> tuple[GradVector, dict[str, Any]]:
    """The float64 reference gradient of <R, z*> at the model's weights and the cell's batch:
    forward Anderson to ``tol`` (rel; the library's fallbacks after it), adjoint ``adjoint``
    ("auto": dense per sample when the state has at most 128 entries, else Anderson; "dense";
    or a solver name) to ``tol``."""
    return reference_gradient(
        model,
        cell.x,
        R,
        InnerProductLoss(),
        solver="anderson",
        tol=tol,
        max_iter=2000,
        adjoint_solver=adjoint,
    )


def captured_step(
    model: Any, cell: Any, R: torch.Tensor, fwd: SolverConfig, bcfg: BackwardConfig,
    names: list[str],
) -> tuple[GradVector, torch.Tensor]:  # fmt: skip
    """One gradient pass of the step with ``fwd`` and ``bcfg`` (``grad_vector``, names in the
    reference's order) and the state z the DEQ layer returned in that same pass."""
    layer = model.deq
    saved = layer.solver_cfg, layer.backward_cfg
    box: dict[str, torch.Tensor] = {}

    def keep(_m: Any, _i: Any, out: torch.Tensor) -> None:
        box["z"] = out.detach().clone()

    hook = layer.register_forward_hook(keep)
    try:
        layer.configure(fwd, bcfg)
        g = grad_vector(model, cell.x, R, InnerProductLoss(), names=names)
    finally:
        hook.remove()
        layer.solver_cfg, layer.backward_cfg = saved
    return g, box["z"]


def exact_at(
    module: torch.nn.Module,
    x: torch.Tensor,
    R: torch.Tensor,
    z: torch.Tensor,
    names: list[str],
    prefix: str = "deq.cell.",
    tol: float = REF_TOL,
    max_iter: int = 2000,
) -> tuple[GradVector, float]:
    """The implicit gradient of <R, z*> with J = df/dz taken at ``z`` as given (not solved
    again), in float64: the adjoint (I - J^T) w = R by Anderson to ``tol`` (rel), then
    (df/dtheta)^T w. What an exact backward returns for that forward iterate, so that the
    error of a row's gradient against it is the backward's own. ``names`` are the model's
    parameter names (``prefix`` + the module's). Returns (gradient, the adjoint's rel residual
    measured afresh)."""
    mod = copy.deepcopy(module).double()
    own = dict(mod.named_parameters())
    params = [own[n.removeprefix(prefix)] for n in names]
    r64 = R.detach().double()
    with torch.enable_grad():
        z_ = z.detach().double().requires_grad_()
        out = mod(z_, x.detach().double())

        def adj(w: torch.Tensor) -> torch.Tensor:
            (gz,) = torch.autograd.grad(out, z_, w, retain_graph=True)
            return gz + r64

        with torch.no_grad():
            w, _ = solvers.get("anderson")(adj, r64.clone(), max_iter=max_iter, tol=tol,
                                           stop_mode="rel")  # fmt: skip
            _, rel = residuals(adj(w), w)
        grads = torch.autograd.grad(out, params, w)
    vec = torch.cat([g.reshape(-1) for g in grads]).cpu()
    return GradVector(vec, list(names)), float(rel.max())


class ExactCache:
    """:func:`exact_at` once per distinct forward iterate (rows with the same forward solve
    return the same z bit for bit)."""

    def __init__(self, module: torch.nn.Module, x: torch.Tensor, R: torch.Tensor) -> None:
        self.module, self.x, self.R = module, x, R
        self.seen: list[tuple[torch.Tensor, GradVector, float]] = []

    def __call__(self, z: torch.Tensor, names: list[str]) -> tuple[GradVector, float]:
        for zz, g, res in self.seen:
            if zz.shape == z.shape and torch.equal(zz, z):
                return g, res
        g, res = exact_at(self.module, self.x, self.R, z, names)
        self.seen.append((z, g, res))
        return g, res


def run_cell(cell: Any, picked: list[Choice], args: argparse.Namespace) -> dict[str, Any]:
    """Every picked choice on one cell: its rows, the reference's residuals and t_vjp."""
    model, anderson_fwd = cell_model(cell, args.max_iter)
    R = loss_direction(cell)
    loss = InnerProductLoss()
    t0 = time.perf_counter()
    g_ref, info = reference(model, cell, R)
    ref = {
        "time_s": time.perf_counter() - t0,
        "converged": bool(info.get("converged")),
        "note": info.get("note", ""),
        "forward_rel_residual": info.get("forward_rel_residual", math.nan),
        "backward_rel_residual": info.get("backward_rel_residual", math.nan),
        "forward_method": info.get("forward_method", ""),
        "adjoint_method": info.get("adjoint_method", ""),
    }
    vs.log(
        f"[adjoint_options] {cell.desc}: float64 reference in {ref['time_s']:.1f} s "
        f"(forward {ref['forward_method']} rel {ref['forward_rel_residual']:.1e}, adjoint "
        f"{ref['adjoint_method']} rel {ref['backward_rel_residual']:.1e})"
    )
    parts = vs.solve_parts(model, cell, anderson_fwd, args)
    exact = ExactCache(model.deq.cell, cell.x, R)
    rows = []
    for ch in picked:
        fwd = SolverConfig(ch.forward, args.max_iter, FORWARD_TOL, "rel")
        try:
            r = vs.train_row(cell, f"deqbench_{ch.key}", model, ch.backward, fwd, R, loss,
                             g_ref, info, args)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - reported, the other choices still run
            msg = str(exc).splitlines()[0] if str(exc) else ""
            vs.log(f"  {cell.name} {ch.key:14s} ERROR {type(exc).__name__}: {msg}")
            rows.append(
                {"choice": ch.key, "text": ch.text, "error": f"{type(exc).__name__}: {msg}"}
            )
            continue
        r.update(choice=ch.key, text=ch.text, forward_solver=ch.forward,
                 backward=ch.backward.name, adjoint_solver=ch.backward.solver,
                 adjoint_tol=ch.backward.tol, b_init=ch.backward.b_init,
                 backward_vjps=int(getattr(model.deq, "vjp_bwd", 0)))  # fmt: skip
        r["vjp_bound_ms"] = r["forward_ms"] + r["backward_vjps"] * parts["vjp_ms"]
        g_row, z_row = captured_step(model, cell, R, fwd, ch.backward, g_ref.names)
        # only SHINE sets it (the other modes leave the last SHINE step's value there)
        info_row = dict(model.deq.last_backward_info or {}) if ch.backward.name == "shine" else {}
        r["fallback_fraction"] = float(info_row.get("fallback_fraction", math.nan))
        g_at, r["exact_at_rel_residual"] = exact(z_row, g_ref.names)
        r["backward_own_error"] = gradient_accuracy(g_row, g_at)[1]
        r["adjoint_missed_tol"] = _missed(r, ch.backward)
        rows.append(r)
        vs.log(
            f"  {cell.name} {ch.key:14s} step {r['step_ms']:8.2f} ms (fwd {r['forward_ms']:.2f}, "
            f"bwd {r['backward_ms']:.2f}; {r['forward_path']}) VJPs {r['backward_vjps']} "
            f"grad err {r['grad_rel_error']:.2e} (own {r['backward_own_error']:.2e})"
        )
    base = next((r for r in rows if r.get("choice") == UNROLLED and "step_ms" in r), None)
    for r in rows:
        un = base["step_ms"] if base is not None else math.nan
        r["ratio_unrolled30"] = r["step_ms"] / un if "step_ms" in r else math.nan
        r["vjp_bound_ratio"] = r["vjp_bound_ms"] / un if "vjp_bound_ms" in r else math.nan
    return {"cell": cell.name, "cell_desc": cell.desc, "reference": ref, "parts": parts,
            "rows": rows}  # fmt: skip


def _missed(r: dict[str, Any], bcfg: BackwardConfig) -> bool:
    """The backward solved something to a tolerance (IFT's adjoint, SHINE's refinement) and
    its own reported residual is above it."""
    res = r.get("backward_rel_residual", math.nan)
    if bcfg.name not in ("ift", "shine") or not isinstance(res, float) or math.isnan(res):
        return False
    return not res <= bcfg.tol


def environment(dev: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    from deqbench.run.env import device_name

    return {
        "device": device_name(str(dev)),
        "device_type": dev.type,
        "torch": torch.__version__,
        "dtype": "float32",
        "tf32": bool(torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark) if dev.type == "cuda" else None,
        "threads": torch.get_num_threads() if dev.type == "cpu" else None,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "max_iter": args.max_iter,
        "quick": bool(args.quick),
        "forward": f"anderson rel {FORWARD_TOL:g}",
        "reference_tol": REF_TOL,
    }


def _num(v: Any, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def table(result: dict[str, Any]) -> str:
    """The markdown: one header line naming the device, then one table per cell."""
    env = result["env"]
    threads = f", {env['threads']} thread(s)" if env["threads"] else ""
    bench = ", cudnn.benchmark on" if env.get("cudnn_benchmark") else ""
    lines = [
        f"{env['device']} ({env['device_type']}{threads}), torch {env['torch']}, "
        f"{env['dtype']}, TF32 {'on' if env['tf32'] else 'off'}{bench}; forward "
        f"{env['forward']} (max_iter {env['max_iter']}); median of {env['repeats']} steps after "
        f"{env['warmup']} warm-up{' (--quick cells)' if env['quick'] else ''}",
        "",
    ]
    for c in result["cells"]:
        ref, parts = c["reference"], c["parts"]
        ok = "" if ref["converged"] else f" **NOT CONVERGED: {ref['note']}**"
        lines += [
            f"**{c['cell']}** ({c['cell_desc']}); float64 reference: forward "
            f"{ref['forward_method']} rel {ref['forward_rel_residual']:.1e}, adjoint "
            f"{ref['adjoint_method']} rel {ref['backward_rel_residual']:.1e}{ok}; "
            f"t_vjp {parts['vjp_ms']:.3f} ms, Anderson forward alone {parts['solve_ms']:.2f} ms "
            f"({parts['solve_nstep']} f-evals, {parts['solve_path']})",
            "",
            "| choice | step ms (fwd + bwd) | / unrolled-30 | VJP bound / unrolled-30 | "
            "backward VJPs | adjoint rel res | grad rel error vs float64 | backward's own "
            "error |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in c["rows"]:
            if "step_ms" not in r:
                lines.append(f"| {r['text']} | error: {r.get('error', '')} | | | | | | |")
                continue
            res = _num(r.get("backward_rel_residual"), ".1e")
            if r["adjoint_missed_tol"]:
                res += " (missed tol)"
            if not math.isnan(r["fallback_fraction"]):
                res += f" (fallback {100 * r['fallback_fraction']:.0f}%)"
            err = _num(r["grad_rel_error"], ".2e") if ref["converged"] else "n/a"
            own = _num(r["backward_own_error"], ".2e")
            if not r["exact_at_rel_residual"] <= 1e3 * REF_TOL:
                own = "n/a"
            lines.append(
                f"| {r['text']} | {r['step_ms']:.2f} ({r['forward_ms']:.2f} + "
                f"{r['backward_ms']:.2f}) | {_num(r['ratio_unrolled30'], '.2f')} | "
                f"{_num(r['vjp_bound_ratio'], '.2f')} | {r['backward_vjps']} | {res} | {err} | "
                f"{own} |"
            )
        lines.append("")
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    keys = [c.key for c in choices()]
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="small cells (a CPU check, < 1 min)")
    ap.add_argument("--cells", nargs="+", default=["conv", "fc"], choices=["conv", "fc"])
    ap.add_argument(
        "--choices",
        nargs="+",
        default=keys,
        choices=keys,
        help=f"backward choices (default: all; {UNROLLED} is always run first)",
    )
    ap.add_argument("--repeats", type=int, default=None, help="timed steps (default 10; quick 3)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 3; quick 1)")
    ap.add_argument("--max-iter", type=int, default=100, help="forward and adjoint budget")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    ap.add_argument("--json", default=None, help="write every row and the environment here")
    args = ap.parse_args(argv)  # fmt: skip
    args.repeats = args.repeats or (3 if args.quick else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    dev, cuda = cellmod.probe_device(args, cudnn_benchmark=True)
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (use --device cpu)")
    if not cuda:
        torch.set_num_threads(args.threads)
    wanted = set(args.choices) | {UNROLLED}
    picked = [c for c in choices(args.max_iter) if c.key in wanted]
    built = quick_cells(dev) if args.quick else cellmod.cells(device=dev)
    t0 = time.perf_counter()
    result: dict[str, Any] = {"env": environment(dev, args), "cells": []}
    for cell in built:
        if cell.name in args.cells:
            result["cells"].append(run_cell(cell, picked, args))
    result["env"]["wall_s"] = time.perf_counter() - t0
    text = table(result)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
