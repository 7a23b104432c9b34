"""Solver statistics: forward and backward f-evaluations and final residuals of the DEQ layers.

Rows (analysis ``solver_stats``):

* every epoch (``step`` = epoch), variant ``train``: means over the epoch's training batches of
  ``forward_nstep``, ``forward_rel_residual``, ``forward_abs_residual``, ``forward_converged``
  (fraction of batches whose forward solve converged), ``backward_nstep``,
  ``backward_rel_residual``, ``backward_converged`` (backward rows only where the mode solves an
  adjoint, i.e. ``ift``). Epoch 0 (before training) is an evaluation pass: forward rows only.
* every epoch, variant ``test``: the test-set evaluation pass (``forward_nstep`` mean over batches,
  ``forward_rel_residual`` max, ``forward_converged`` min).
* after training, variant ``final_test``: a pass over the test set with gradients, per batch, so
  both solves are measured: ``forward_nstep`` / ``backward_nstep`` mean and ``*_max``, residual
  max, converged fraction.

The ``forward_nstep`` rows' note says what ran (the cell's ``runtime``): how the forward solves
ran (``path=eager | graph | compiled``, ``+``-joined when an epoch saw several) and the autocast
(``amp=none | bf16``), plus ``compile=<backend>`` when compiled, e.g. ``path=graph, amp=bf16``.
The passes this analysis makes itself run under the cell's runtime too. The
``forward_converged`` / ``backward_converged`` rows' note names the stop rule that judged the
solves (``stop rule batch_fro``; the solver option ``stop``) where it is not the default
``sample_max``.

Series: ``solver_steps`` (one line per training batch) and ``solver_trace`` (the residual after
each forward iteration on ``trace_samples`` test inputs, at init and after training).
A model without DEQ layers that runs its own solver and reports it (``last_solve_stats()``,
:class:`deqbench.contracts.OwnSolverModel`) gets the same forward rows (backward rows where it
reports its own backward solve) and, where it gives a trace, the ``solver_trace`` series. A
model that solves its own equilibrium and reports nothing, and a model without DEQ layers
(``tied_repeat``), get one ``skipped`` row with a note saying which.

Example (the plain functions, without the runner):
    >>> import deqbench, torch
    >>> from deqbench.performance.solver_stats import residual_trace, solve_stats
    >>> model = deqbench.models.create("fc_deq_tiny")
    >>> trace = residual_trace(model, torch.randn(8, 64))          # iteration, rel_max, ...
    >>> per_batch = solve_stats(model, torch.randn(32, 64), torch.randint(0, 10, (32,)),
    ...                         batch_size=16, backward=True)       # forward/backward nstep
"""

from __future__ import annotations

import math
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from ..analyses.base import Analysis, CellContext, EpochInfo, Row, StepInfo
from ..core.deq import Runtime, deq_layers, last_stats, own_solve_stats, reports_solves
from ..core.registry import analyses
from ..core.runtime import autocast, for_loss, forward_paths, model_runtime, runtime_note

FORWARD = (
    "forward_nstep",
    "forward_njvp",  # only for solvers that take JVPs (newton_krylov)
    "forward_rel_residual",
    "forward_abs_residual",
    "forward_converged",
)
BACKWARD = ("backward_nstep", "backward_rel_residual", "backward_converged")
UNITS = {"forward_nstep": "f-evals", "backward_nstep": "f-evals", "forward_njvp": "JVPs"}


def stop_rule_notes(model: torch.nn.Module) -> dict[str, str]:
    """``{"forward_converged": "stop rule batch_fro", ...}``: the stop rules (solver option
    ``stop``) the model's DEQ layers declare for their forward and IFT adjoint solves, where not
    the default ``sample_max``."""
    from ..core.verdict import rule_text

    rules: dict[str, set[str]] = {"forward_converged": set(), "backward_converged": set()}
    for layer in deq_layers(model):
        rules["forward_converged"].add(str(layer.solver_cfg.options.get("stop", "sample_max")))
        if layer.backward_cfg.name == "ift":
            rules["backward_converged"].add(
                str(layer.backward_cfg.options.get("stop", "sample_max"))
            )
    out = {}
    for k, v in rules.items():
        names = sorted(r for r in v if rule_text(r))
        if names:
            out[k] = ", ".join(f"stop rule {r}" for r in names)
    return out


def residual_trace(model: torch.nn.Module, x: torch.Tensor, runtime: Runtime | None = None) -> Any:
    """Per-iteration residuals of the forward solve(s) of ``model`` on input ``x`` (under
    ``runtime``'s autocast; default: the model's DEQ layers' runtime).

    Returns a DataFrame with columns layer, iteration (1-based f-evaluation), rel_max, rel_mean,
    abs_max, abs_mean (over the batch). A model that runs its own solver gives layer 0 from the
    trace it reports. Empty for a model without DEQ layers or trace.
    """
    import pandas as pd

    rt = runtime if runtime is not None else model_runtime(model)
    was = model.training
    model.eval()
    with torch.no_grad(), autocast(rt, x.device):
        model(x)
    model.train(was)
    frames = []
    stats = [layer.last_forward_stats for layer in deq_layers(model)]
    if not stats:
        stats = [own_solve_stats(model)[0]]
    for i, st in enumerate(stats):
        if st is None or st.rel_trace.numel() == 0:
            continue
        rel, ab = st.rel_trace.double().cpu(), st.abs_trace.double().cpu()
        frames.append(
            pd.DataFrame(
                {
                    "layer": i,
                    "iteration": range(1, rel.shape[0] + 1),
                    "rel_max": rel.max(1).values.numpy(),
                    "rel_mean": rel.mean(1).numpy(),
                    "abs_max": ab.max(1).values.numpy(),
                    "abs_mean": ab.mean(1).numpy(),
                }
            )
        )
    cols = ["layer", "iteration", "rel_max", "rel_mean", "abs_max", "abs_mean"]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=cols)


def solve_stats(
    model: torch.nn.Module,
    X: torch.Tensor,
    y: torch.Tensor | None = None,
    *,
    batch_size: int = 256,
    backward: bool = False,
    loss_fn: Any = None,
    max_batches: int | None = None,
    runtime: Runtime | None = None,
) -> Any:
    """Forward (and, with ``backward=True``, backward) solver statistics per batch of ``X``.

    The model is put in eval mode; with ``backward`` the loss gradient w.r.t. the parameters is
    computed with :func:`torch.autograd.grad` (``.grad`` is not touched, nothing is stepped), so the
    configured backward mode runs its adjoint solve. The forward runs under ``runtime``'s
    autocast (default: the model's DEQ layers' runtime), the loss in float32. Returns a
    DataFrame, one row per batch, with the keys of :func:`deqbench.deq.last_stats` and ``path``
    (how the forward solves ran: eager, graph or compiled).
    """
    import pandas as pd

    rt = runtime if runtime is not None else model_runtime(model)
    if loss_fn is None:
        loss_fn = torch.nn.functional.cross_entropy
    params = [p for p in model.parameters() if p.requires_grad]
    was = model.training
    model.eval()
    out = []
    try:
        for b, i in enumerate(range(0, X.shape[0], batch_size)):
            if max_batches is not None and b >= max_batches:
                break
            xb = X[i : i + batch_size]
            if backward and y is not None and params:
                with torch.enable_grad():
                    with autocast(rt, xb.device):
                        loss = loss_fn(for_loss(model(xb), rt), y[i : i + batch_size])
                    torch.autograd.grad(loss, params, allow_unused=True)
            else:
                with torch.no_grad(), autocast(rt, xb.device):
                    model(xb)
            out.append(
                {
                    "batch": b,
                    "size": int(xb.shape[0]),
                    **last_stats(model),
                    "path": forward_paths(model),
                }
            )
    finally:
        model.train(was)
    return pd.DataFrame(out)


@analyses.register("solver_stats")
class SolverStatsAnalysis(Analysis):
    """Forward/backward f-evaluations and residuals per batch, per epoch and on the test set."""

    name = "solver_stats"
    version = "1"

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        final_backward: bool = True  #: measure backward solves in the final test pass
        trace_samples: int = Field(64, ge=1)  #: test inputs whose residual trace is recorded
        max_test_batches: int | None = Field(None, ge=1)  #: limit the final test pass

    params: Params

    def __init__(self, params: Any = None) -> None:
        super().__init__(params)
        self.steps: list[dict[str, float]] = []
        self.traces: list[Any] = []
        self.paths: dict[int, set[str]] = {}  # epoch -> how its training solves ran

    def _trace(self, ctx: CellContext, phase: str) -> None:
        df = residual_trace(ctx.model, ctx.data.test[0][: self.params.trace_samples], ctx.runtime)
        if df.empty:  # a model that runs its own solver and reports no trace
            return
        df.insert(0, "phase", phase)
        self.traces.append(df)
        import pandas as pd

        ctx.write_series("solver_trace", pd.concat(self.traces, ignore_index=True))

    def before_training(self, ctx: CellContext):
        if not reports_solves(ctx.model):
            from ..core.own_solves import NOT_MEASURED
            from ..models import solver_columns

            name = ctx.cell.get("model", {}).get("name", "?")
            if solver_columns(name, ctx.model) == (NOT_MEASURED, NOT_MEASURED):
                note = (
                    f"model '{name}' solves its own equilibrium and reports no statistics (add "
                    "last_solve_stats() to the model: deqbench.contracts.OwnSolverModel)"
                )
            else:
                note = f"model '{name}' is not a DEQ (no DEQ layer): no solver statistics"
            yield Row("forward_nstep", math.nan, status="skipped", note=note)
            return
        self._trace(ctx, "init")

    def on_step(self, ctx: CellContext, info: StepInfo):
        if info.deq:
            self.steps.append(
                {"epoch": info.epoch, "step": info.step, "loss": info.loss, **info.deq}
            )
            self.paths.setdefault(info.epoch, set()).add(forward_paths(ctx.model))
        return ()

    def on_epoch(self, ctx: CellContext, info: EpochInfo):
        if not reports_solves(ctx.model):
            return
        rt = ctx.runtime
        test_path = forward_paths(ctx.model)  # the test pass just ran
        notes = {
            # epoch 0's train variant is an evaluation pass like the test one
            "train": runtime_note(self.paths.get(info.epoch) or test_path, rt),
            "test": runtime_note(test_path, rt),
        }
        rules = stop_rule_notes(ctx.model)
        for variant, stats in (("train", info.train), ("test", info.test)):
            for k in FORWARD + BACKWARD:
                if k in stats:
                    note = notes[variant] if k == "forward_nstep" else rules.get(k, "")
                    yield Row(k, stats[k], variant=variant, step=info.epoch,
                              unit=UNITS.get(k, ""), note=note)  # fmt: skip
        if self.steps:
            import pandas as pd

            ctx.write_series("solver_steps", pd.DataFrame(self.steps))

    def after_training(self, ctx: CellContext):
        if not reports_solves(ctx.model):
            return
        from ..core.evaluation import loss_function

        X, y = ctx.data.test
        df = solve_stats(
            ctx.model,
            X,
            y,
            batch_size=256,
            backward=self.params.final_backward,
            loss_fn=ctx.loss_fn or loss_function(ctx.task),
            max_batches=self.params.max_test_batches,
            runtime=ctx.runtime,
        )
        w = df["size"] / df["size"].sum()
        note = runtime_note(set(df["path"]) if "path" in df else None, ctx.runtime)
        for k in ("forward_nstep", "forward_njvp", "backward_nstep"):
            if k in df:
                unit = UNITS[k]
                yield Row(k, float((df[k].fillna(0) * w).sum()), variant="final_test", unit=unit,
                          note=note if k == "forward_nstep" else "")  # fmt: skip
                yield Row(f"{k}_max", float(df[k].max()), variant="final_test", unit=unit)
        for k in ("forward_rel_residual", "forward_abs_residual", "backward_rel_residual"):
            if k in df:
                yield Row(k, float(df[k].max()), variant="final_test")
        rules = stop_rule_notes(ctx.model)
        for k in ("forward_converged", "backward_converged"):
            if k in df:
                yield Row(k, float((df[k] * w).sum()), variant="final_test",
                          note=rules.get(k, ""))  # fmt: skip
        self._trace(ctx, "final")
