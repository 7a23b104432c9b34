"""Family statistics per epoch: per-layer solver iterations and failures, test accuracy, and the
family's own spectral quantities (``model.spectral_quantities()``: pcDEQ sigma_max per layer,
monDEQ lambda_max((W + W^T)/2), ||I - W||, FB step bound).

This is what the pcDEQ and monDEQ reproductions check (Gabor et al. 2024 figures 3 and 4: iterations
and the largest singular value per epoch). It works on any DEQ; models without
``spectral_quantities`` only get the solver rows.

Rows (analysis ``family_stats``; ``step`` = epoch, 0 = before training):

* before training: ``layers`` (number of DEQ layers); for pcDEQ models ``nonneg_constraint``
  (1: W >= 0 enforced; 0: unconstrained control) with the model description in ``note``;
* per epoch, over that epoch's training batches: ``forward_nstep`` / ``backward_nstep`` (mean
  f-evaluations per layer solve; variant ``""`` = mean over layers, ``layer<i>`` per layer),
  ``forward_nstep_max``, ``forward_not_converged`` / ``backward_not_converged`` (layer solves
  that stopped at max_iter, diverged or stagnated), ``forward_diverged``, ``steps``;
* per epoch: ``test_accuracy`` (or ``test_mse``), ``test_forward_converged``;
* per epoch: every key of ``model.spectral_quantities()``; a key ``metric/variant`` is split
  (``sigma_max/layer0`` -> metric ``sigma_max``, variant ``layer0``).

Example (without the runner):
    >>> import deqbench, torch
    >>> from deqbench.training.family_stats import spectral_rows
    >>> spectral_rows(deqbench.models.create("pcdeq_l_tiny"), step=0)   # doctest: +SKIP
    [Row(metric='sigma_max', value=0.02..., variant='layer0', step=0, ...), ...]
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict
from torch import nn

from ..analyses.base import Analysis, CellContext, EpochInfo, Row, StepInfo
from ..core.deq import deq_layers
from ..core.registry import analyses


def spectral_quantities(model: nn.Module) -> dict[str, float]:
    """``model.spectral_quantities()`` if the model has it, else {}."""
    fn = getattr(model, "spectral_quantities", None)
    return {str(k): float(v) for k, v in fn().items()} if callable(fn) else {}


def spectral_rows(model: nn.Module, step: int | None) -> list[Row]:
    """Rows of the model's family quantities (``metric/variant`` keys are split)."""
    rows = []
    for key, value in spectral_quantities(model).items():
        metric, _, variant = key.partition("/")
        rows.append(Row(metric, value, variant=variant, step=step))
    return rows


class _EpochAccumulator:
    """Per-layer forward/backward counts over one epoch's training steps."""

    def __init__(self) -> None:
        self.fw: dict[int, list[int]] = {}
        self.bw: dict[int, list[int]] = {}
        self.fw_fail = self.bw_fail = self.fw_div = self.steps = 0

    def add(self, model: nn.Module) -> None:
        self.steps += 1
        for i, layer in enumerate(deq_layers(model)):
            fs, bs = layer.last_forward_stats, layer.last_backward_stats
            if fs is not None:
                self.fw.setdefault(i, []).append(fs.nstep)
                self.fw_fail += int(not fs.converged)
                self.fw_div += int(fs.status == "diverged")
            if bs is not None:
                self.bw.setdefault(i, []).append(bs.nstep)
                self.bw_fail += int(not bs.converged)

    def rows(self, epoch: int) -> list[Row]:
        rows: list[Row] = []
        for kind, per in (("forward", self.fw), ("backward", self.bw)):
            if not per:
                continue
            means = {i: sum(v) / len(v) for i, v in sorted(per.items())}
            rows.append(
                Row(
                    f"{kind}_nstep",
                    sum(means.values()) / len(means),
                    step=epoch,
                    unit="f-evals",
                    note="mean per layer solve",
                )
            )
            if len(means) > 1:
                rows += [
                    Row(f"{kind}_nstep", m, variant=f"layer{i}", step=epoch, unit="f-evals")
                    for i, m in means.items()
                ]
        if self.fw:
            rows.append(
                Row(
                    "forward_nstep_max",
                    max(max(v) for v in self.fw.values()),
                    step=epoch,
                    unit="f-evals",
                )
            )
            rows.append(Row("forward_not_converged", self.fw_fail, step=epoch, unit="solves"))
            rows.append(Row("forward_diverged", self.fw_div, step=epoch, unit="solves"))
        if self.bw:
            rows.append(Row("backward_not_converged", self.bw_fail, step=epoch, unit="solves"))
        rows.append(Row("steps", self.steps, step=epoch))
        return rows


@analyses.register("family_stats")
class FamilyStats(Analysis):
    """Per-layer solver iterations and failures, test accuracy and family spectral quantities,
    per epoch."""

    name = "family_stats"
    version = "1"

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        spectral: bool = True

    params: Params  # narrowed for type checkers

    def __init__(self, params: Any = None) -> None:
        super().__init__(params)
        self._acc = _EpochAccumulator()

    def before_training(self, ctx: CellContext) -> Iterable[Row]:
        self._acc = _EpochAccumulator()
        model = ctx.model
        yield Row("layers", sum(1 for _ in deq_layers(model)))
        if hasattr(model, "nonneg"):
            describe = getattr(model, "describe", None)
            yield Row(
                "nonneg_constraint",
                float(bool(model.nonneg)),
                note=describe() if callable(describe) else "",
            )

    def on_step(self, ctx: CellContext, info: StepInfo) -> Iterable[Row]:
        self._acc.add(ctx.model)
        return ()

    def on_epoch(self, ctx: CellContext, info: EpochInfo) -> Iterable[Row]:
        rows = self._acc.rows(info.epoch) if self._acc.steps else []
        self._acc = _EpochAccumulator()
        for key in ("accuracy", "mse"):
            if key in info.test:
                rows.append(Row(f"test_{key}", info.test[key], step=info.epoch))
        if "forward_converged" in info.test:
            rows.append(
                Row("test_forward_converged", info.test["forward_converged"], step=info.epoch)
            )
        if self.params.spectral:
            rows += spectral_rows(ctx.model, info.epoch)
        return rows

    @classmethod
    def plot(cls, df: Any, run_dir: Any) -> dict[str, Any]:
        out = {}
        fig = iterations_plot(df)
        if fig is not None:
            out["family_iterations"] = fig
        fig = sigma_plot(df)
        if fig is not None:
            out["family_spectral"] = fig
        return out


# -- plots (Gabor et al. 2024 figures 3 and 4) ----------------------------------------------------


def _family(df: Any) -> Any:
    d = df[(df["analysis"] == "family_stats") & (df["status"] == "ok") & df["step"].notna()]
    return d.assign(epoch=d["step"].astype(int))


def iterations_plot(df: Any) -> Any | None:
    """Forward and backward iterations per layer solve (mean over layers) per epoch, one line
    per cell (Gabor et al. 2024 figure 3)."""
    from ..plots import legend, lines, new_figure

    d = _family(df)
    fw = d[(d.metric == "forward_nstep") & (d.variant.fillna("") == "")]
    bw = d[(d.metric == "backward_nstep") & (d.variant.fillna("") == "")]
    if fw.empty:
        return None
    fig = new_figure(5.0, 4.0, ncols=2 if not bw.empty else 1)
    ids = d["cell_id"].unique()
    lines(fig.axes[0], fw, "epoch", "forward iterations", "f-evals per layer solve", all_ids=ids)
    if not bw.empty:
        lines(
            fig.axes[1], bw, "epoch", "backward iterations", "f-evals per layer solve", all_ids=ids
        )
    legend(fig, fig.axes[0])
    return fig


def sigma_plot(df: Any) -> Any | None:
    """Largest singular value of W (max over pcDEQ layers) per epoch, or monDEQ's
    lambda_max((W + W^T)/2) and ||I - W|| (Gabor et al. 2024 figure 4)."""
    from ..plots import legend, lines, new_figure

    d = _family(df)
    s = d[(d.metric == "sigma_max") & (d.variant == "max")]
    if not s.empty:
        fig = new_figure(7.5, 4.0)
        lines(fig.axes[0], s, "epoch", "sigma_max(W), max over layers", "sigma_max(W)")
        fig.axes[0].axhline(1.0, color="grey", lw=0.8, ls="--")
        legend(fig, fig.axes[0])
        return fig
    lam = d[d.metric == "lambda_max_sym_W"]
    lip = d[d.metric == "lipschitz_I_minus_W"]
    if lam.empty:
        return None
    fig = new_figure(5.0, 4.0, ncols=2)
    lines(fig.axes[0], lam, "epoch", "monotonicity: lambda_max((W+W^T)/2) <= 1-m", "lambda_max")
    lines(fig.axes[1], lip, "epoch", "||I - W||", "spectral norm")
    legend(fig, fig.axes[0])
    return fig
