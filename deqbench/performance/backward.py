"""Backward modes compared on one batch: cost and gradient accuracy against a float64 reference.

For each entry of ``modes`` (any registered backward mode, :mod:`deqbench.backward`: ``ift`` at
several adjoint tolerances, ``unrolled`` K, ``jfb``, ``phantom`` k/tau, ``reversible`` (RevDEQ,
with its own forward), ``shine`` (with Broyden's inverse estimate), a plugin's; a mode that needs
a forward solver gets it with the cell's budget and tolerance unless its ``forward`` says
otherwise; optionally through a *wrapper* model, e.g. the TorchDEQ plugin's ``torchdeq_deq``, on
the same trained parameters) one training step (forward with grad, loss, parameter gradients
with ``autograd.grad``) is measured on the same seeded batch and weights:

* ``forward_ms`` / ``backward_ms`` / ``step_ms`` per repeat + ``_median`` / ``_iqr`` / ``_spread``;
* ``peak_memory`` (MiB, own pass: GPU ``max_memory_allocated`` above the baseline, CPU peak RSS
  of a fresh worker) and ``activation_memory`` (MiB autograd saves during the forward; device
  independent: O(1) in the iterations for IFT, O(K) for unrolled);
* ``grad_cosine`` and ``grad_rel_error`` = ||g - g_ref|| / ||g_ref|| over all trainable
  parameters, against the reference g_ref: the same step in float64 with the implicit gradient,
  forward and adjoint solved to ``ref_tol`` by robust methods independent of the cell's solver
  settings (:func:`deqbench.performance.gradients.reference_gradient`: a dense direct adjoint solve per
  sample when the state has at most ``ref_dense_max`` entries, else Anderson), reported as variant
  ``reference`` with its residuals (measured afresh) and ``reference_converged``. A reference
  that misses ``ref_tol`` gives ``reference_converged`` status ``error``, its residual rows
  ``flagged``, and every ``grad_cosine`` / ``grad_rel_error`` row ``error`` (no value): it is never
  the basis of an accuracy figure;
* ``forward_nstep``, ``backward_nstep`` (adjoint solver steps), ``f_evals_grad`` (tracked f
  calls), ``backward_vjps`` (VJPs through f in the backward), ``forward_rel_residual``,
  ``backward_rel_residual``, and the mode's own diagnostics (``layer.last_backward_info``:
  SHINE's ``fallback_fraction`` and ``inverse_pairs``, RevDEQ's ``reconstruction_error`` and
  ``reversal_steps``);
* the memory split (:mod:`deqbench.performance.backward_compare`, MiB): ``memory_activations``
  (saved outside the DEQ layers), ``memory_unroll`` (saved by differentiable f-steps),
  ``memory_backward_state`` (kept by a DEQ layer's backward: z*, RevDEQ's float64 pair, SHINE's
  Broyden pairs), and on CUDA ``memory_solver_history`` (the forward solve's peak above its
  baseline, less its output);
* ``descent_gain`` and ``descent_gain_ratio`` (``descent_step`` > 0, with the reference): the
  float64 reference loss decrease after a step -eta g over the decrease after -eta g_ref (1: as
  good a step as the exact gradient; <= 0: not a descent step);
* with ``train_steps``: ``test_accuracy`` (or ``test_mse``), ``test_loss`` and ``train_loss`` of
  a copy of the model trained that many optimiser steps with the mode (the cell's optimiser and
  learning rate, the same seeded batches for every mode).

A mode whose own solves missed their tolerance (its forward where it solves one,
``BackwardMode.solves_forward``: not the K fixed steps of ``unrolled``; its backward's where
``checks_backward``: the adjoint of ``ift``) has every row status ``flagged`` with a one-line
note naming the variant, the residual and the fix: its accuracy and cost describe a failed
solve.

The figure ``backward_accuracy`` draws, per cell, the gradient error (log) against the backward
time, one labelled marker per variant, its area the memory of the step (the CUDA peak; on CPU the
bytes autograd saves), its colour the mode family, hollow when flagged.

The memory-against-iterations series (``memory_series``): IFT whose forward runs exactly N
fixed-point iterations (tol 0) and unrolled K = N, for each N: ``series_activation_memory`` and
``series_peak_memory`` rows (variant ``<mode>-n=<N>``), ``series/backward_memory__*.csv`` and the
plot ``backward_memory`` (IFT flat, unrolled linear).

Rows have ``step`` 0 (before training) or the number of epochs (after training).

The measured steps (timed, activation and peak memory, the series) run under the cell's
``runtime`` (bf16 autocast, the loss in float32); the reference gradient stays float64 (autocast
leaves float64 alone).

The gradient functions (reference, accuracy) are in :mod:`deqbench.performance.gradients`.

Example (plain functions):
    >>> import deqbench, torch
    >>> from deqbench.deq import BackwardConfig
    >>> from deqbench.performance.backward import measure_mode
    >>> from deqbench.performance.gradients import reference_gradient
    >>> model = deqbench.models.create("fc_deq_tiny")
    >>> x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    >>> g_ref, _ = reference_gradient(model, x, y)
    >>> res = measure_mode(model, x, y, "classification", BackwardConfig("jfb"), g_ref=g_ref,
    ...                    repeats=2, warmup=1, memory=False)
    >>> 0 < res["cosine"] < 1, res["f_evals_grad"]
    (True, 1)
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor, nn

from ..analyses.base import CellContext, Row
from ..core.deq import (
    BackwardConfig,
    DEQLayer,
    Runtime,
    SolverConfig,
    configure,
    deq_layers,
    last_stats,
)
from ..core.registry import analyses
from ..core.runtime import autocast, for_loss, model_runtime
from ._perf import (
    GradStep,
    PerfAnalysis,
    PerfParams,
    PositiveInt,
    backward_nstep,
    batch_size,
    detached_copy,
    forward_nstep,
    loss_for,
    measuring,
    phase_step,
    pick_batch,
    preserved,
)
from .backward_compare import (  # noqa: F401  (memory_vs_iterations: re-exported)
    DescentCheck,
    _first_layer,
    memory_split,
    memory_vs_iterations,
    solver_history,
    train_steps,
)
from .gradients import (  # noqa: F401  (re-exported: the plain functions of this analysis)
    DENSE_MAX,
    GradVector,
    ReferenceSettings,
    _param_dict,
    grad_vector,
    gradient_accuracy,
    native_copy,
    reference_gradient,
)
from .measure import MIB, flag_rows, peak_memory, saved_tensor_bytes, time_phases

# -- one backward mode ---------------------------------------------------------------------------


class ModeSpec(BaseModel):
    """One backward mode to measure. Unset fields come from the cell's ``backward`` section;
    ``options`` are the mode's own (``shine``: refine_steps, ...) or, for ``ift``, the adjoint
    solver's. A mode that needs its own forward solver (``reversible``, ``shine``) gets it with
    the cell's budget and tolerance unless ``forward`` says otherwise."""

    model_config = ConfigDict(extra="forbid")
    #: a registered backward mode (built-in or plugin: ``deqbench ls backward``)
    name: str
    label: str | None = None
    #: a registered model factory that converts a built model (``wrap=model``), e.g. the
    #: TorchDEQ plugin's ``torchdeq_deq``: the mode then runs on that implementation
    wrapper: str | None = None
    #: forward solver override ``{name, max_iter, tol, stop_mode, **options}``
    forward: dict[str, Any] | None = None
    solver: str | None = None  #: adjoint solver (ift)
    max_iter: int | None = Field(None, ge=1)
    tol: float | None = Field(None, ge=0)
    stop_mode: Literal["rel", "abs"] | None = None
    k: int | None = Field(None, ge=1)
    tau: float | None = Field(None, gt=0, le=1)
    b_init: Literal["grad", "zeros"] | None = None
    options: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _registered(self) -> ModeSpec:
        """Mode, wrapper model and solver names, the mode's options and the forward it needs
        are checked with the suite, before anything runs."""
        from ..backward.base import forward_problem, mode_of, option_problems
        from ..core.errors import DeqbenchError
        from ..core.registry import backward_modes, models, solvers

        if self.name not in backward_modes:
            raise ValueError(f"name: {backward_modes.unknown(self.name)}")
        try:
            mode = mode_of(self.name)
        except DeqbenchError as exc:
            raise ValueError(f"name: {exc}") from exc
        if self.wrapper is not None and self.wrapper not in models:
            raise ValueError(f"wrapper: {models.unknown(self.wrapper)}")
        fwd = (self.forward or {}).get("name")
        for what, name in (("forward.name", fwd), ("solver", self.solver)):
            if name is not None and name not in solvers:
                raise ValueError(f"{what}: {solvers.unknown(name)}")
        if fwd is not None and (why := forward_problem(mode, fwd)):
            raise ValueError(f"forward.name: {why}")
        if self.options and mode.Options is not None and not mode.adjoint_solver:
            problems = option_problems(mode, self.options)
            if problems:
                raise ValueError("options: " + "; ".join(problems))
        return self

    def backward_config(self, base: BackwardConfig) -> BackwardConfig:
        from ..backward.base import mode_of

        kw = {
            k: getattr(self, k)
            for k in ("solver", "max_iter", "tol", "stop_mode", "k", "tau", "b_init")
            if getattr(self, k) is not None
        }
        opts = self.options
        if opts is None:  # the cell's options only where they mean the same (adjoint solver's)
            a, b = mode_of(self.name), mode_of(base.name)
            same = a is b or (a.Options is None and b.Options is None)
            opts = dict(base.options) if same else {}
        return replace(base, name=self.name, options=dict(opts), **kw)

    def forward_config(self, base: SolverConfig) -> SolverConfig:
        from ..backward.base import mode_of

        need = mode_of(self.name).forward
        if not self.forward and need in (None, base.name):
            return replace(base)
        d = dict(self.forward or {})
        generic = {"name", "max_iter", "tol", "stop_mode"}
        name = d.get("name", need or base.name)
        if name == base.name:
            opts = dict(base.options)
        else:
            opts = dict(mode_of(self.name).forward_options) if name == need else {}
        opts.update({k: v for k, v in d.items() if k not in generic})
        return SolverConfig(
            name,
            int(d.get("max_iter", base.max_iter)),
            float(d.get("tol", base.tol)),
            d.get("stop_mode", base.stop_mode),
            opts,
        )

    def variant(self, cfg: BackwardConfig, fwd: SolverConfig | None = None) -> str:
        from ..backward.base import mode_of

        if self.label:
            return self.label
        mode = mode_of(cfg.name)
        s = mode.label(cfg, fwd)
        if self.forward and fwd is not None:
            if mode.forward is None:  # the forward solver is the spec's choice
                s += f"-fwd={fwd.name}"
            s += f"-ftol={fwd.tol:g}" if "tol" in self.forward else ""
            if mode.forward is not None and "max_iter" in self.forward:
                s += f"-fmax={fwd.max_iter}"
        return f"{self.wrapper}:{s}" if self.wrapper else s


DEFAULT_MODES: list[dict[str, Any]] = [
    {"name": "ift", "tol": 1e-2},
    {"name": "ift", "tol": 1e-4},
    {"name": "ift", "tol": 1e-6},
    {"name": "unrolled", "k": 30},
    {"name": "jfb"},
    {"name": "phantom", "k": 5, "tau": 0.5},
    {"name": "reversible", "forward": {"max_iter": 41}},
    {"name": "shine"},
    {"name": "shine", "options": {"refine_steps": 5}},
]


def measure_mode(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    task: Any,
    backward: BackwardConfig,
    forward: SolverConfig | None = None,
    *,
    g_ref: GradVector | None = None,
    repeats: int = 5,
    warmup: int = 2,
    memory: bool = True,
    memory_cpu: bool = True,
    runtime: Runtime | None = None,
) -> dict[str, Any]:
    """Time, memory, solver counts and gradient accuracy of one training step of ``model`` with
    ``backward`` (and the forward solver ``forward``, default: the model's), under ``runtime``
    (default: the model's DEQ layers'). The model's configs, buffers and mode are restored
    afterwards.

    Returns a dict with ``timing`` ({forward, backward, total} Timings, results = (forward,
    backward) f-evals per repeat), ``memory`` (Memory or None), ``activation_bytes``,
    ``memory_split`` (:func:`~deqbench.performance.backward_compare.memory_split`),
    ``solver_history_bytes`` (CUDA, else NaN), ``stats`` (:func:`deqbench.deq.last_stats` of the
    untimed gradient pass), ``f_evals_grad``, ``backward_vjps``, ``backward_info`` (the mode's
    own diagnostics), ``grad`` (the GradVector), ``cosine`` and ``rel_error`` (NaN without
    ``g_ref``)."""
    device = x.device
    rt = runtime if runtime is not None else model_runtime(model)
    with preserved(model):
        configure(model, forward, backward)
        params = list(_param_dict(model).values())
        loss_fn = loss_for(task)

        def step(mark: Any) -> tuple[int, int]:
            model.train()
            with autocast(rt, device):
                loss = loss_fn(for_loss(model(x), rt), y)
            nf = forward_nstep(model)
            mark("forward")
            torch.autograd.grad(loss, params, allow_unused=True)
            return nf, backward_nstep(model)

        timing = time_phases(
            step, ("forward", "backward"), device=device, repeats=repeats, warmup=warmup
        )
        with autocast(rt, device):
            g = grad_vector(model, x, y, task, names=g_ref.names if g_ref is not None else None)
        stats = last_stats(model)
        layers = list(deq_layers(model))
        fe_grad = sum(int(layer.f_evals_grad) for layer in layers)
        vjps = sum(int(getattr(layer, "vjp_bwd", 0)) for layer in layers)
        info = backward_info(layers)
        with preserved(model), autocast(rt, device):
            model.train()
            act, _ = saved_tensor_bytes(lambda: loss_fn(for_loss(model(x), rt), y))
        split = memory_split(model, x, y, task, rt)
        mem = (
            peak_memory(GradStep(model, x, y, task, rt), device, cpu=memory_cpu) if memory else None
        )
        history = solver_history(model, x, y, task, rt) if memory else math.nan
    cos, err = gradient_accuracy(g, g_ref) if g_ref is not None else (math.nan, math.nan)
    return {
        "timing": timing,
        "memory": mem,
        "activation_bytes": act,
        "memory_split": split,
        "solver_history_bytes": history,
        "stats": stats,
        "f_evals_grad": fe_grad,
        "backward_vjps": vjps,
        "backward_info": info,
        "grad": g,
        "cosine": cos,
        "rel_error": err,
    }


def backward_info(layers: Sequence[DEQLayer]) -> dict[str, float]:
    """The ``last_backward_info`` of ``layers`` (a mode's own diagnostics, e.g. SHINE's
    ``fallback_fraction``, RevDEQ's ``reconstruction_error``), each key maxed over layers."""
    out: dict[str, float] = {}
    for layer in layers:
        for k, v in (getattr(layer, "last_backward_info", None) or {}).items():
            try:
                v = float(v)
            except (TypeError, ValueError):
                continue
            out[k] = max(out[k], v) if k in out else v
    return out


GRAD_METRICS = ("grad_cosine", "grad_rel_error", "descent_gain", "descent_gain_ratio")


def descent_rows(check: DescentCheck, g: GradVector, variant: str, step: int | None) -> list[Row]:
    """``descent_gain`` (the float64 reference loss decrease along -eta g) and
    ``descent_gain_ratio`` (over the reference gradient's decrease: 1 as good a step as the
    exact gradient, <= 0 not a descent step)."""
    gain, ratio = check.gain(g)
    note = f"step eta = {check.eta:.3g} (the reference step moves theta by its norm x step)"
    return [
        Row("descent_gain", gain, variant=variant, step=step, note=note),
        Row("descent_gain_ratio", ratio, variant=variant, step=step, note=note),
    ]


def training_rows(
    ctx: CellContext,
    model: nn.Module,
    bcfg: BackwardConfig,
    fcfg: SolverConfig,
    p: Any,
    variant: str,
    step: int | None,
) -> list[Row]:
    """Test accuracy (or MSE) and final training loss of a copy of ``model`` trained for
    ``p.train_steps`` optimiser steps with the mode (:func:`train_steps`; the same seeded
    batches for every mode)."""
    m = detached_copy(model)
    configure(m, fcfg, bcfg)
    bs = p.train_batch_size or int((ctx.cell.get("train") or {}).get("batch_size", 64))
    res = train_steps(
        m, ctx.data, ctx.task, steps=p.train_steps, batch_size=bs,
        train=dict(ctx.cell.get("train") or {}), seed=int(ctx.seed), runtime=ctx.runtime,
        eval_samples=p.eval_samples,
    )  # fmt: skip
    note = f"after {p.train_steps} optimiser steps of batch {bs} from the cell's weights"
    status = "ok" if res["finite"] else "diverged"
    if not res["finite"]:
        note = "a loss or gradient became non-finite: " + note
    rows = []
    for key in ("test_accuracy", "test_mse", "test_loss"):
        if key in res:
            unit = "fraction" if key == "test_accuracy" else ""
            rows.append(Row(key, res[key], variant=variant, step=step, unit=unit,
                            status=status, note=note))  # fmt: skip
    rows.append(Row("train_loss", res["loss"], variant=variant, step=step, status=status,
                    note="mean of the last fifth of the steps"))  # fmt: skip
    return rows


def reference_rows(info: dict[str, Any], step: int | None = None) -> list[Row]:
    """Rows of variant ``reference`` from :func:`reference_gradient`'s info: residuals and steps
    (``flagged`` when it did not converge), ``time_s`` and ``reference_converged`` (1, or an
    ``error`` row with the one-line cause when it missed its tolerance)."""
    note = info.get("note", "")
    status = "flagged" if note else "ok"
    rows = [
        Row(k, info[k], variant="reference", step=step, status=status, note=note)
        for k in (
            "forward_rel_residual",
            "backward_rel_residual",
            "forward_nstep",
            "backward_nstep",
        )
        if k in info
    ]
    rows.append(Row("time_s", info["time_s"], variant="reference", step=step, unit="s"))
    method = f"forward {info.get('forward_method', '')}, adjoint {info.get('adjoint_method', '')}"
    if note:
        rows.append(
            Row("reference_converged", math.nan, "reference", step, status="error", note=note)
        )
    else:
        rows.append(Row("reference_converged", 1.0, "reference", step, note=method))
    return rows


def solve_note(
    stats: dict[str, float], backward: BackwardConfig, forward: SolverConfig, variant: str
) -> str:
    """One line naming the solves of a measured mode that missed their tolerance (its forward
    where the mode solves one, ``BackwardMode.solves_forward``: not unrolled's K fixed steps;
    its backward's where ``checks_backward``: ift's adjoint) with the fix, or ""."""
    from ..backward.base import mode_of

    mode = mode_of(backward.name)
    out = []
    if mode.solves_forward and stats.get("forward_converged", 1.0) < 1:
        k = "forward_rel_residual" if forward.stop_mode == "rel" else "forward_abs_residual"
        out.append(
            f"{variant}: forward solver did not converge ({forward.stop_mode} "
            f"{stats.get(k, math.nan):.2e} > {forward.tol:g}, {forward.name}): raise its "
            "max_iter or use a forward solver that converges for this model"
        )
    if mode.checks_backward and stats.get("backward_converged", 1.0) < 1:
        k = "backward_rel_residual" if backward.stop_mode == "rel" else "backward_abs_residual"
        if mode.adjoint_solver:
            out.append(
                f"{variant}: adjoint did not converge ({backward.stop_mode} "
                f"{stats.get(k, math.nan):.2e} > {backward.tol:g}, {backward.solver}): use an "
                "adjoint solver that converges for this model (e.g. anderson) or raise max_iter"
            )
        else:
            hint = f": {mode.backward_hint}" if mode.backward_hint else ""
            out.append(
                f"{variant}: the {backward.name} backward missed its own tolerance (rel "
                f"{stats.get('backward_rel_residual', math.nan):.2e}){hint}"
            )
    return "; ".join(out)


def flag_unconverged(rows: list[Row], note: str) -> list[Row]:
    """Mark the ``ok`` rows of a mode ``flagged`` with ``note`` (when non-empty)."""
    if note:
        for r in rows:
            if r.status == "ok":
                r.status = "flagged"
                r.note = note + (f" ({r.note})" if r.note else "")
    return rows


def mode_rows(
    res: dict[str, Any], variant: str, step: int | None = None, note: str = ""
) -> list[Row]:
    """Result rows of :func:`measure_mode`."""
    t = res["timing"]
    rows: list[Row] = []
    rows += t["forward"].rows("forward_ms", variant=variant, step=step)
    rows += t["backward"].rows("backward_ms", variant=variant, step=step)
    rows += t["total"].rows("step_ms", variant=variant, step=step)
    for i, (nf, nb) in enumerate(t["total"].results):
        rows.append(Row("forward_nstep", nf, variant=variant, step=step, repeat=i, unit="f-evals"))
        rows.append(Row("backward_nstep", nb, variant=variant, step=step, repeat=i, unit="steps"))
    rows.append(
        Row("f_evals_grad", res["f_evals_grad"], variant=variant, step=step, unit="f-evals")
    )
    st = res["stats"]
    for k in ("forward_rel_residual", "backward_rel_residual"):
        if k in st:
            rows.append(Row(k, st[k], variant=variant, step=step))
    rows.append(Row("grad_cosine", res["cosine"], variant=variant, step=step, note=note))
    rows.append(Row("grad_rel_error", res["rel_error"], variant=variant, step=step, note=note))
    rows.append(
        Row(
            "activation_memory",
            res["activation_bytes"] / MIB,
            variant=variant,
            step=step,
            unit="MiB",
            note="bytes autograd saves during the forward",
        )
    )
    split = res.get("memory_split") or {}
    for key, note in SPLIT_NOTES.items() if split else ():
        rows.append(
            Row(f"memory_{key}", split[key] / MIB, variant=variant, step=step, unit="MiB",
                note=note)
        )  # fmt: skip
    hist = res.get("solver_history_bytes", math.nan)
    if math.isfinite(hist):
        rows.append(
            Row("memory_solver_history", max(hist, 0.0) / MIB, variant=variant, step=step,
                unit="MiB", note="peak of the forward solve above its baseline, less its output "
                "(cuda_max_memory_allocated)")
        )  # fmt: skip
    if res["memory"] is not None:
        rows.append(res["memory"].row("peak_memory", variant=variant, step=step))
    if "backward_vjps" in res:
        rows.append(
            Row("backward_vjps", res["backward_vjps"], variant=variant, step=step, unit="VJPs",
                note="VJPs through f in the backward")
        )  # fmt: skip
    for key, value in sorted((res.get("backward_info") or {}).items()):
        rows.append(Row(key, value, variant=variant, step=step, note="the mode's own diagnostic"))
    return rows


#: the parts of :func:`~deqbench.performance.backward_compare.memory_split`, with their notes
SPLIT_NOTES = {
    "activations": "saved outside the DEQ layers (injection, readout, loss)",
    "unroll": "saved inside differentiable f-steps (unrolled K, phantom k, JFB)",
    "backward_state": "kept by the DEQ layer's backward (z*, u; RevDEQ's float64 pair; "
    "SHINE's Broyden pairs)",
}


# -- the analysis --------------------------------------------------------------------------------


def _unmeasured(v: str, step: int | None, status: str, note: str) -> Row:
    """The row of a backward mode that could not be measured."""
    return Row("step_ms_median", math.nan, variant=v, step=step, status=status, note=note)


@analyses.register("backward")
class Backward(PerfAnalysis):
    """Backward modes on one batch: time, memory, gradient accuracy (see module docstring)."""

    judges_own_solves = True  # see Analysis.judges_own_solves
    name = "backward"
    #: the cell deqbench.testing.check_analysis runs it on (over testing.DEFAULT_EXAMPLE)
    example: ClassVar[dict[str, Any]] = {
        "params": {"repeats": 1, "warmup": 0, "batch_size": 8, "memory_cpu": False}
    }
    version = "1"
    needs_training = False

    class Params(PerfParams):
        modes: list[ModeSpec] = Field(
            default_factory=lambda: [ModeSpec(**m) for m in DEFAULT_MODES], min_length=1
        )
        #: float64 reference gradient (forward and adjoint to ref_tol, residuals checked)
        reference: bool = True
        #: forward solver tried first (then the cell's own, then dense Newton or Broyden)
        ref_solver: str = "anderson"
        #: "auto" (dense direct solve for states of at most ref_dense_max entries, else
        #: Anderson), "dense", or a registered solver
        ref_adjoint_solver: str = "auto"
        ref_tol: float = Field(1e-12, gt=0)
        ref_max_iter: int = Field(1000, ge=1)
        ref_dense_max: int = Field(DENSE_MAX, ge=0)
        #: forward iterations N of the memory-vs-iterations series (empty: no series)
        memory_series: list[int] = Field(default_factory=lambda: [5, 10, 20, 40])
        memory_series_modes: list[Literal["ift", "unrolled"]] = Field(
            default_factory=lambda: list[Literal["ift", "unrolled"]](["ift", "unrolled"])
        )
        #: descent check: the float64 reference loss after a step along each mode's gradient
        #: (needs the reference), the reference step moving the parameters by this fraction
        #: of their norm (0: off)
        descent_step: float = Field(1e-3, ge=0)
        #: optimiser steps each mode trains a copy of the model for, from the same weights and
        #: on the same seeded batches, before its test accuracy is measured (0: off)
        train_steps: int = Field(0, ge=0)
        #: batch size of those steps (null: the cell's train.batch_size)
        train_batch_size: PositiveInt | None = None
        #: test samples the trained copies are evaluated on (null: the whole test split)
        eval_samples: PositiveInt | None = None

        @model_validator(mode="after")
        def _ref_solvers(self) -> Backward.Params:
            from ..core.registry import solvers

            if self.ref_solver not in solvers:
                raise ValueError(f"ref_solver: {solvers.unknown(self.ref_solver)}")
            a = self.ref_adjoint_solver
            if a not in ("auto", "dense") and a not in solvers:
                raise ValueError(f"ref_adjoint_solver: 'auto', 'dense' or {solvers.unknown(a)}")
            return self

    params: Params  # narrowed for type checkers

    def _measure(self, ctx: CellContext, phase: str):
        p = self.params
        step = phase_step(ctx, phase)
        if not any(True for _ in deq_layers(ctx.model)):
            yield Row(
                "grad_rel_error",
                math.nan,
                step=step,
                status="skipped",
                note="the model has no DEQ layer",
            )
            return
        bs = batch_size(p, ctx)
        x, y, note = pick_batch(ctx, bs, p.split)
        task = ctx.task
        with measuring(p):
            g_ref = None
            gnote = "reference: false (no gradient reference)"
            if p.reference:
                g, info = reference_gradient(
                    ctx.model,
                    x,
                    y,
                    task,
                    solver=p.ref_solver,
                    tol=p.ref_tol,
                    max_iter=p.ref_max_iter,
                    adjoint_solver=p.ref_adjoint_solver,
                    dense_max=p.ref_dense_max,
                )
                yield from reference_rows(info, step)
                if info["converged"]:
                    g_ref = g
                else:  # never the basis of an accuracy figure
                    gnote = "no gradient reference: " + info["note"]
            layer = _first_layer(ctx.model)
            descent = None
            if g_ref is not None and p.descent_step > 0:
                settings = ReferenceSettings(
                    p.ref_solver, p.ref_adjoint_solver, p.ref_tol, p.ref_max_iter,
                    p.ref_dense_max,
                )  # fmt: skip
                descent = DescentCheck(ctx.model, x, y, task, g_ref, settings, p.descent_step)

            for spec in p.modes:
                yield from self._mode_rows(ctx, spec, layer, x, y, g_ref, gnote, descent, step)
            if p.memory_series:
                yield from self._memory_series_rows(ctx, x, y, step)
            yield Row("batch_size", bs, step=step, unit="samples", note=note)
            yield from flag_rows(ctx.device, step=step)

    def _mode_rows(
        self,
        ctx: CellContext,
        spec: Any,
        layer: Any,
        x: Tensor,
        y: Tensor,
        g_ref: Any,
        gnote: str,
        descent: DescentCheck | None,
        step: int | None,
    ) -> Iterator[Row]:
        """The rows of one backward mode (``spec``, of ``modes``): time, memory and the gradient
        against ``g_ref`` (its rows not judged where there is none: ``gnote`` says why), the
        descent check and training steps where asked; one unmeasured row where the mode cannot
        run (out of memory, a wrapper that does not wrap, a mode the implementation lacks)."""
        from .. import models as model_registry

        p = self.params
        task = ctx.task
        bcfg = spec.backward_config(layer.backward_cfg)
        fcfg = spec.forward_config(layer.solver_cfg)
        v = spec.variant(bcfg, fcfg)
        model = ctx.model
        if spec.wrapper:
            fac = model_registry.get(spec.wrapper)
            if not getattr(fac, "wraps", False):
                yield _unmeasured(
                    v, step, "skipped", f"model '{spec.wrapper}' does not accept wrap=model"
                )
                return
            model = fac(wrap=detached_copy(ctx.model))
        try:
            res = measure_mode(
                model,
                x,
                y,
                task,
                bcfg,
                fcfg,
                g_ref=g_ref,
                repeats=p.repeats,
                warmup=p.warmup,
                memory=p.memory,
                memory_cpu=p.memory_cpu,
                runtime=ctx.runtime,
            )
        except torch.cuda.OutOfMemoryError as exc:
            torch.cuda.empty_cache()
            yield _unmeasured(v, step, "oom", str(exc).splitlines()[0])
            return
        except Exception as exc:  # a mode the implementation lacks (torchdeq: unrolled)
            from ..core.errors import DeqbenchError

            if not isinstance(exc, DeqbenchError):
                raise
            yield _unmeasured(v, step, "skipped", str(exc))
            return
        rows = mode_rows(res, v, step)
        if g_ref is None:
            for r in rows:
                if r.metric in GRAD_METRICS:
                    r.status = "skipped" if not p.reference else "error"
                    r.note = gnote
        if descent is not None:
            rows += descent_rows(descent, res["grad"], v, step)
        if p.train_steps:
            rows += training_rows(ctx, model, bcfg, fcfg, p, v, step)
        yield from flag_unconverged(rows, solve_note(res["stats"], bcfg, fcfg, v))

    def _memory_series_rows(
        self, ctx: CellContext, x: Tensor, y: Tensor, step: int | None
    ) -> Iterator[Row]:
        """Activation and peak memory against the solver's iterations (``memory_series``),
        also written as the ``backward_memory`` series."""
        p = self.params
        task = ctx.task
        df = memory_vs_iterations(
            ctx.model,
            x,
            y,
            task,
            iterations=p.memory_series,
            modes=p.memory_series_modes,
            memory=p.memory,
            memory_cpu=p.memory_cpu,
            runtime=ctx.runtime,
        )
        df.insert(0, "step", step)
        self._series = getattr(self, "_series", [])
        self._series.append(df)
        import pandas as pd

        ctx.write_series("backward_memory", pd.concat(self._series, ignore_index=True))
        for r in df.itertuples():
            v = f"{r.mode}-n={r.iterations}"
            yield Row(
                "series_activation_memory",
                r.activation_mib,
                variant=v,
                step=step,
                unit="MiB",
            )
            if math.isfinite(r.peak_mib):
                yield Row(
                    "series_peak_memory",
                    r.peak_mib,
                    variant=v,
                    step=step,
                    unit="MiB",
                    note=r.method,
                )

    @classmethod
    def plot(cls, df: Any, run_dir: Any) -> dict[str, Any]:
        """The figures (``deqbench.plots``)."""
        return _perf_plots._backward_plots(df, run_dir)


from . import plots as _perf_plots  # noqa: E402  (the figures of Backward.plot)
