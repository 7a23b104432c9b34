"""Spectral analysis: layer spectral norms, the cell Jacobian at the fixed point, a Lipschitz
bound, and family quantities (monDEQ, pcDEQ), before training and per epoch.

Rows (analysis ``spectral``; ``step`` = epoch, 0 = before training):

* per layer (``variant`` = the layer's module path, e.g. ``deq.cell.W1``):
  ``sigma_max`` (dense: exact; conv: Sedghi et al. exact *circular* norm on the layer's input
  size, an upper bound for zero padding) and ``sigma_max_power`` (power iteration of the operator
  as applied, i.e. the exact zero-padded norm of a conv);
* ``sigma_max`` with ``variant="mean"`` / ``"max"`` over the layers in scope (the "average
  spectral norm" of Tsuchida et al. 2022 figure 6);
* with ``jacobian: true``, on ``jacobian_batch`` test inputs at z*: ``jacobian_spectral_radius``
  (power iteration on VJPs + short Arnoldi), ``jacobian_spectral_norm`` (power iteration on
  J^T J), ``jacobian_frobenius`` (Hutchinson), each with variant ``mean`` and ``max`` over the
  samples; ``lipschitz_bound`` (product of the cell's layer norms, or the cell's own
  ``lipschitz_bound()``);
* family quantities from ``model.spectral_quantities()`` when the model has it (monDEQ:
  ``lambda_max_sym_W`` ...; pcDEQ: ``sigma_max/layer<i>`` ...), metric = key.

Example (the plain functions):
    >>> import deqbench, torch
    >>> from deqbench.spectral.analysis import layer_norms, jacobian_summary
    >>> m = deqbench.models.create("kglm_conv_deq_tiny")
    >>> rows = layer_norms(m, torch.rand(2, 2, 8, 8))        # [(layer, metric, value, note)]
    >>> js = jacobian_summary(m, torch.rand(2, 2, 8, 8))      # {metric: (B,) tensor}
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn

from ..analyses.base import Analysis, CellContext, Row, mean_max
from ..core.deq import deq_layers, is_deq
from ..core.registry import analyses
from . import norms as sp


def _scope_modules(model: Any, scope: str) -> list[tuple[str, nn.Linear | nn.Conv2d]]:
    """(path, module) of the Linear/Conv2d layers: in the DEQ cells (``cell``) or anywhere."""
    if scope == "model":
        return sp.layers(model)
    out: list[tuple[str, nn.Linear | nn.Conv2d]] = []
    cell_ids = {id(layer.cell) for layer in deq_layers(model)}
    if not cell_ids and hasattr(model, "cell"):
        cell_ids = {id(model.cell)}
    for name, m in model.named_modules():
        if id(m) in cell_ids:
            out += [(f"{name}.{n}" if n else name, c) for n, c in sp.layers(m)]
    return out


def conv_input_sizes(model: Any, x: Tensor) -> dict[int, tuple[int, int]]:
    """Spatial input size of every Conv2d of ``model``, recorded on one no-grad forward of x
    (keys: ``id(module)``)."""
    sizes: dict[int, tuple[int, int]] = {}
    hooks = []
    for m in model.modules():
        if isinstance(m, nn.Conv2d):

            def pre(mod, args, _m=m):
                sizes.setdefault(id(_m), tuple(args[0].shape[-2:]))

            hooks.append(m.register_forward_pre_hook(pre))
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(x)
    finally:
        model.train(was)
        for h in hooks:
            h.remove()
    return sizes


def layer_norms(
    model: Any,
    x: Tensor | None = None,
    *,
    scope: str = "cell",
    input_size: int | None = None,
    power: bool = True,
    power_iters: int = 100,
    seed: int = 0,
) -> list[tuple[str, str, float, str]]:
    """Spectral norms of the model's layers: ``[(layer, metric, value, note)]``.

    Args:
        model: any module.
        x: a small input batch; one forward records the conv input sizes.
        scope: ``cell`` (layers of the DEQ cell(s)) or ``model`` (all Linear/Conv2d layers).
        input_size: conv input size n (n x n), overriding the recorded sizes.
        power: also run power iteration (``sigma_max_power``).
    """
    mods = _scope_modules(model, scope)
    sizes: dict[int, tuple[int, int]] = {}
    if x is not None and any(isinstance(m, nn.Conv2d) for _, m in mods) and input_size is None:
        sizes = conv_input_sizes(model, x)
    out: list[tuple[str, str, float, str]] = []
    for name, m in mods:
        if isinstance(m, nn.Conv2d):
            hw = (input_size, input_size) if input_size else sizes.get(id(m))
            if hw is None:
                out.append((name, "sigma_max", math.nan, "conv input size unknown"))
                continue
            hw = (int(hw[0]), int(hw[1]))
            exact_circ = m.padding_mode == "circular" and m.stride == (1, 1)
            note = f"circular FFT norm on {hw[0]}x{hw[1]}" + (
                "" if exact_circ else " (upper bound for the zero-padded layer)"
            )
            if m.stride != (1, 1) or m.dilation != (1, 1):
                note += "; strided/dilated: FFT value is of the stride-1 operator"
            out.append((name, "sigma_max", sp.conv_spectral_norm(m.weight, hw), note))
            if power:
                v = sp.spectral_norm(m, hw, method="power", iters=power_iters, seed=seed)
                out.append(
                    (name, "sigma_max_power", v, f"power iteration, padding {m.padding_mode}")
                )
        else:
            out.append((name, "sigma_max", sp.dense_norm(m.weight), "exact"))
            if power:
                v = sp.dense_power_norm(m.weight, iters=power_iters, seed=seed)
                out.append((name, "sigma_max_power", v, "power iteration"))
    return out


def jacobian_summary(
    model: Any,
    x: Tensor,
    *,
    power_iters: int = 100,
    hutchinson_vectors: int = 8,
    seed: int = 0,
) -> dict[str, Tensor]:
    """Per-sample Jacobian quantities of the model's DEQ cell at its fixed point for input x.

    Returns ``{"jacobian_spectral_radius", "jacobian_spectral_norm", "jacobian_frobenius"}``
    -> (B,) tensors. Needs a model with ``equilibrium(x) -> (z*, u)`` and ``deq.cell``.
    """
    if not hasattr(model, "equilibrium") or not hasattr(model, "deq"):
        raise TypeError(f"{type(model).__name__} has no single DEQ layer with equilibrium()")
    was = model.training
    model.eval()
    try:
        z, u = model.equilibrium(x)
        cell = model.deq.cell
        return {
            "jacobian_spectral_radius": sp.jacobian_spectral_radius(
                cell, z, u, iters=power_iters, seed=seed
            ),
            "jacobian_spectral_norm": sp.jacobian_spectral_norm(
                cell, z, u, iters=power_iters, seed=seed
            ),
            "jacobian_frobenius": sp.jacobian_frobenius(
                cell, z, u, n_vectors=hutchinson_vectors, seed=seed
            ),
        }
    finally:
        model.train(was)


def family_quantities(model: Any) -> dict[str, float]:
    """``model.spectral_quantities()`` (monDEQ, pcDEQ, plugins), or of its cell; {} if none."""
    for obj in (model, getattr(model, "cell", None)):
        fn = getattr(obj, "spectral_quantities", None)
        if callable(fn):
            return {str(k): float(v) for k, v in fn().items()}
    return {}


@analyses.register("spectral")
class SpectralAnalysis(Analysis):
    """Layer spectral norms, cell-Jacobian spectra at z*, Lipschitz bound, family quantities."""

    name = "spectral"
    version = "1"
    needs_training = False
    params: Params  # narrowed for type checkers

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        every: Literal["epoch", "end"] = "epoch"
        scope: Literal["cell", "model"] = "cell"
        power: bool = True
        power_iters: int = Field(100, ge=1)
        input_size: int | None = Field(None, ge=1)
        jacobian: bool = True
        jacobian_batch: int = Field(16, ge=1)
        hutchinson_vectors: int = Field(8, ge=1)

    def measure(self, ctx: CellContext, step: int) -> Iterable[Row]:
        """All rows for the model's current weights, tagged ``step``."""
        p = self.params
        model = ctx.model
        X = ctx.data.test[0][: p.jacobian_batch]
        rows: list[Row] = []
        norms = layer_norms(
            model,
            X,
            scope=p.scope,
            input_size=p.input_size,
            power=p.power,
            power_iters=p.power_iters,
            seed=ctx.seed,
        )
        vals = []
        for layer, metric, value, note in norms:
            rows.append(Row(metric, value, variant=layer, step=step, note=note))
            if metric == "sigma_max":
                vals.append(value)
        if vals:
            rows += mean_max(
                "sigma_max", vals, step=step, note=f"over {len(vals)} layers ({p.scope})"
            )
        for k, v in family_quantities(model).items():
            rows.append(Row(k, v, variant="family", step=step))
        if p.jacobian:
            rows += self._jacobian_rows(ctx, X, step)
        return rows

    def _jacobian_rows(self, ctx: CellContext, X: Tensor, step: int) -> list[Row]:
        model = ctx.model
        p = self.params
        layers = list(deq_layers(model))
        if not is_deq(model) or len(layers) != 1 or not hasattr(model, "equilibrium"):
            why = "not a DEQ" if not is_deq(model) else "several DEQ layers"
            return [
                Row.skipped(
                    "jacobian_spectral_radius", f"{why}: no single cell Jacobian", step=step
                )
            ]
        rows: list[Row] = []
        try:
            js = jacobian_summary(
                model,
                X,
                power_iters=p.power_iters,
                hutchinson_vectors=p.hutchinson_vectors,
                seed=ctx.seed,
            )
        except Exception as exc:  # a cell the Jacobian tools cannot handle: say so, go on
            return [Row.failed("jacobian_spectral_radius", exc, step=step)]
        for k, v in js.items():
            rows += mean_max(k, v.double().tolist(), step=step)
        cell = layers[0].cell
        try:
            if p.input_size:
                hw: dict[str, tuple[int, int] | None] = {
                    n: (p.input_size, p.input_size) for n, _ in sp.layers(cell)
                }
            else:
                sizes = (
                    conv_input_sizes(model, X)
                    if any(isinstance(m, nn.Conv2d) for m in cell.modules())
                    else {}
                )
                hw = {n: sizes.get(id(m)) for n, m in sp.layers(cell)}
            bound, note = sp.lipschitz_upper_bound(cell, hw)
            status = "ok" if math.isfinite(bound) else "skipped"  # NaN: not available
            rows.append(Row("lipschitz_bound", bound, step=step, status=status, note=note))
        except Exception as exc:
            rows.append(Row.failed("lipschitz_bound", exc, step=step))
        return rows

    @classmethod
    def plot(cls, df: Any, run_dir: Any) -> dict[str, Any]:
        fig = spectral_plot(df)
        return {"spectral_norms": fig} if fig is not None else {}


def spectral_plot(df: Any) -> Any | None:
    """Mean layer sigma_max per epoch (one line per cell; min-max band over seeds) and, when
    measured, the mean Jacobian spectral radius."""
    from ..plots import legend, lines, new_figure

    d = df[(df["analysis"] == "spectral") & (df["status"] == "ok") & df["step"].notna()]
    if d.empty:
        return None
    d = d.assign(epoch=d["step"].astype(int))
    s = d[(d.metric == "sigma_max") & (d.variant == "mean")]
    title = "layer spectral norm (mean over layers)"
    fam = d[d.metric.str.startswith("sigma_max/max")]
    if s.empty and not fam.empty:  # e.g. pcDEQ: weights outside Linear/Conv2d modules
        s, title = fam, "sigma_max of the DEQ weight (max over layers)"
    j = d[(d.metric == "jacobian_spectral_radius") & (d.variant == "mean")]
    if s.empty and j.empty:
        return None
    fig = new_figure(5.0, 4.0, ncols=2 if not j.empty else 1)
    lines(fig.axes[0], s, "epoch", title, "sigma_max")
    if not j.empty:
        lines(fig.axes[1], j, "epoch", "cell Jacobian at z*", "spectral radius (mean)")
    legend(fig, fig.axes[0])
    return fig
