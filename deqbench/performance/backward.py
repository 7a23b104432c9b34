"""Backward modes compared on one batch: cost and gradient accuracy against a float64 reference.

For each entry of ``modes`` (``ift`` at several adjoint tolerances, ``unrolled`` K, ``jfb``,
``phantom`` k/tau; optionally through a *wrapper* model, e.g. the TorchDEQ plugin's
``torchdeq_deq``, on the same trained parameters) one training step (forward with grad, loss,
parameter gradients with ``autograd.grad``) is measured on the same seeded batch:

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
  calls), ``forward_rel_residual``, ``backward_rel_residual``.

A mode whose own solves missed their tolerance (the forward of ``ift``, ``jfb``, ``phantom``; the
adjoint of ``ift``; not the K fixed steps of ``unrolled``) has every row status ``flagged`` with
a one-line note naming the variant, the residual and the fix: its accuracy and cost describe a
failed solve.

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
from collections.abc import Sequence
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
from .gradients import (  # noqa: F401  (re-exported: the plain functions of this analysis)
    DENSE_MAX,
    GradVector,
    _param_dict,
    grad_vector,
    gradient_accuracy,
    native_copy,
    reference_gradient,
)
from .measure import MIB, Memory, flag_rows, peak_memory, saved_tensor_bytes, time_phases

# -- one backward mode ---------------------------------------------------------------------------


class ModeSpec(BaseModel):
    """One backward mode to measure. Unset fields come from the cell's ``backward`` section."""

    model_config = ConfigDict(extra="forbid")
    name: Literal["ift", "unrolled", "jfb", "phantom"]
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
        """Wrapper model and solver names are checked with the suite, before anything runs."""
        from ..core.registry import models, solvers

        if self.wrapper is not None and self.wrapper not in models:
            raise ValueError(f"wrapper: {models.unknown(self.wrapper)}")
        fwd = (self.forward or {}).get("name")
        for what, name in (("forward.name", fwd), ("solver", self.solver)):
            if name is not None and name not in solvers:
                raise ValueError(f"{what}: {solvers.unknown(name)}")
        return self

    def backward_config(self, base: BackwardConfig) -> BackwardConfig:
        kw = {
            k: getattr(self, k)
            for k in ("solver", "max_iter", "tol", "stop_mode", "k", "tau", "b_init", "options")
            if getattr(self, k) is not None
        }
        return replace(base, name=self.name, **kw)

    def forward_config(self, base: SolverConfig) -> SolverConfig:
        if not self.forward:
            return replace(base)
        d = dict(self.forward)
        generic = {"name", "max_iter", "tol", "stop_mode"}
        name = d.get("name", base.name)
        opts = dict(base.options) if name == base.name else {}
        opts.update({k: v for k, v in d.items() if k not in generic})
        return SolverConfig(
            name,
            int(d.get("max_iter", base.max_iter)),
            float(d.get("tol", base.tol)),
            d.get("stop_mode", base.stop_mode),
            opts,
        )

    def variant(self, cfg: BackwardConfig, fwd: SolverConfig | None = None) -> str:
        if self.label:
            return self.label
        if cfg.name == "ift":
            s = f"ift-tol={cfg.tol:g}"
        elif cfg.name == "unrolled":
            s = f"unrolled-k={cfg.k}"
        elif cfg.name == "phantom":
            s = f"phantom-k={cfg.k}-tau={cfg.tau:g}"
        else:
            s = "jfb"
        if self.forward and fwd is not None:
            s += f"-fwd={fwd.name}" + (f"-ftol={fwd.tol:g}" if "tol" in self.forward else "")
        return f"{self.wrapper}:{s}" if self.wrapper else s


DEFAULT_MODES: list[dict[str, Any]] = [
    {"name": "ift", "tol": 1e-2},
    {"name": "ift", "tol": 1e-4},
    {"name": "ift", "tol": 1e-6},
    {"name": "unrolled", "k": 30},
    {"name": "jfb"},
    {"name": "phantom", "k": 5, "tau": 0.5},
]


def _first_layer(model: nn.Module) -> DEQLayer:
    layers = list(deq_layers(model))
    if not layers:
        raise ValueError("backward: the model has no DEQ layer")
    return layers[0]


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
    ``stats`` (:func:`deqbench.deq.last_stats` of the untimed gradient pass), ``f_evals_grad``,
    ``cosine`` and ``rel_error`` (NaN without ``g_ref``)."""
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
        fe_grad = sum(int(layer.f_evals_grad) for layer in deq_layers(model))
        with preserved(model), autocast(rt, device):
            model.train()
            act, _ = saved_tensor_bytes(lambda: loss_fn(for_loss(model(x), rt), y))
        mem = (
            peak_memory(GradStep(model, x, y, task, rt), device, cpu=memory_cpu) if memory else None
        )
    cos, err = gradient_accuracy(g, g_ref) if g_ref is not None else (math.nan, math.nan)
    return {
        "timing": timing,
        "memory": mem,
        "activation_bytes": act,
        "stats": stats,
        "f_evals_grad": fe_grad,
        "cosine": cos,
        "rel_error": err,
    }


GRAD_METRICS = ("grad_cosine", "grad_rel_error")


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
    for ift/jfb/phantom, its adjoint for ift; unrolled runs K fixed steps) with the fix, or ""."""
    out = []
    if backward.name != "unrolled" and stats.get("forward_converged", 1.0) < 1:
        k = "forward_rel_residual" if forward.stop_mode == "rel" else "forward_abs_residual"
        out.append(
            f"{variant}: forward solver did not converge ({forward.stop_mode} "
            f"{stats.get(k, math.nan):.2e} > {forward.tol:g}, {forward.name}): raise its "
            "max_iter or use a forward solver that converges for this model"
        )
    if backward.name == "ift" and stats.get("backward_converged", 1.0) < 1:
        k = "backward_rel_residual" if backward.stop_mode == "rel" else "backward_abs_residual"
        out.append(
            f"{variant}: adjoint did not converge ({backward.stop_mode} "
            f"{stats.get(k, math.nan):.2e} > {backward.tol:g}, {backward.solver}): use an "
            "adjoint solver that converges for this model (e.g. anderson) or raise max_iter"
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
    if res["memory"] is not None:
        rows.append(res["memory"].row("peak_memory", variant=variant, step=step))
    return rows


def memory_vs_iterations(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    task: Any = "classification",
    *,
    iterations: Sequence[int] = (5, 10, 20, 40),
    modes: Sequence[str] = ("ift", "unrolled"),
    memory: bool = True,
    memory_cpu: bool = True,
    runtime: Runtime | None = None,
) -> Any:
    """Memory of one training step against the number of forward iterations N: ``ift`` with a
    forward of exactly N fixed-point iterations (tol 0) and the model's adjoint settings, and
    ``unrolled`` with K = N, under ``runtime`` (default: the model's DEQ layers'). Returns a
    DataFrame: mode, iterations, activation_mib, peak_mib, forward_nstep."""
    import pandas as pd

    layer = _first_layer(model)
    rt = runtime if runtime is not None else model_runtime(model)
    base_b = layer.backward_cfg
    out = []
    with preserved(model):
        loss_fn = loss_for(task)
        for mode in modes:
            for n in iterations:
                if mode == "ift":
                    fwd = SolverConfig("fixed_point", max_iter=int(n), tol=0.0, stop_mode="rel")
                    bwd = replace(base_b, name="ift")
                elif mode == "unrolled":
                    fwd, bwd = replace(layer.solver_cfg), replace(base_b, name="unrolled", k=int(n))
                else:
                    raise ValueError(
                        f"memory_vs_iterations: mode must be ift or unrolled, got {mode!r}"
                    )
                configure(model, fwd, bwd)
                model.train()
                with autocast(rt, x.device):
                    act, _ = saved_tensor_bytes(lambda: loss_fn(for_loss(model(x), rt), y))
                nf = forward_nstep(model)
                mem = (
                    peak_memory(GradStep(model, x, y, task, rt), x.device, cpu=memory_cpu)
                    if memory
                    else Memory(math.nan, note="memory off")
                )
                out.append(
                    {
                        "mode": mode,
                        "iterations": int(n),
                        "activation_mib": act / MIB,
                        "peak_mib": mem.peak_mib,
                        "forward_nstep": nf,
                        "method": mem.method,
                    }
                )
    return pd.DataFrame(out)


# -- the analysis --------------------------------------------------------------------------------


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
        from .. import models as model_registry

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

            def unmeasured(v: str, status: str, note: str) -> Row:
                return Row(
                    "step_ms_median", math.nan, variant=v, step=step, status=status, note=note
                )

            for spec in p.modes:
                bcfg = spec.backward_config(layer.backward_cfg)
                fcfg = spec.forward_config(layer.solver_cfg)
                v = spec.variant(bcfg, fcfg)
                model = ctx.model
                if spec.wrapper:
                    fac = model_registry.get(spec.wrapper)
                    if not getattr(fac, "wraps", False):
                        yield unmeasured(
                            v, "skipped", f"model '{spec.wrapper}' does not accept wrap=model"
                        )
                        continue
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
                    yield unmeasured(v, "oom", str(exc).splitlines()[0])
                    continue
                except Exception as exc:  # a mode the implementation lacks (torchdeq: unrolled)
                    from ..core.errors import DeqbenchError

                    if not isinstance(exc, DeqbenchError):
                        raise
                    yield unmeasured(v, "skipped", str(exc))
                    continue
                rows = mode_rows(res, v, step)
                if g_ref is None:
                    for r in rows:
                        if r.metric in GRAD_METRICS:
                            r.status = "skipped" if not p.reference else "error"
                            r.note = gnote
                yield from flag_unconverged(rows, solve_note(res["stats"], bcfg, fcfg, v))
            if p.memory_series:
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
            yield Row("batch_size", bs, step=step, unit="samples", note=note)
            yield from flag_rows(ctx.device, step=step)

    @classmethod
    def plot(cls, df: Any, run_dir: Any) -> dict[str, Any]:
        """The figures (``deqbench.plots``)."""
        return _perf_plots._backward_plots(df, run_dir)


from . import plots as _perf_plots  # noqa: E402  (the figures of Backward.plot)
