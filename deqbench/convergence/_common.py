"""Pieces shared by the convergence analyses: when they measure, the DEQ layer they look at,
the evaluation batches, a model forward with one layer's forward replaced, and the words of a
figure title (model, device)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn

from ..analyses.base import Analysis, CellContext, Row
from ..core.deq import DEQLayer, deq_layers
from ..performance.measure import quantile as quantile  # re-exported for the analyses

Phase = Literal["init", "trained"]


class ConvergenceParams(BaseModel):
    """Parameters both convergence analyses take."""

    model_config = ConfigDict(extra="forbid")
    at: list[Phase] = Field(
        default_factory=lambda: list[Phase](["trained"]),
        min_length=1,
        description="measure before training (step 0), after training (step = epochs), or both",
    )
    split: Literal["train", "test"] = Field("test", description="the split the batches come from")
    layer: int = Field(0, ge=0, description="the DEQ layer analysed (models with several)")


class PhasedAnalysis(Analysis):
    """Runs ``_measure(ctx, step)`` before and/or after training as ``params.at`` says; an
    exception gives one error row (a :class:`~deqbench.core.errors.DeqbenchError` is raised:
    a configuration mistake stops the task, as everywhere)."""

    needs_training = False
    judges_own_solves = True  # their solves are judged (and counted) by the analyses

    def _measure(self, ctx: CellContext, step: int) -> Iterable[Row]:
        raise NotImplementedError

    def __init__(self, params: Any = None) -> None:
        super().__init__(params)
        self._series: list[Any] = []  # the figure's series, written by the task

    def _guarded(self, ctx: CellContext, step: int) -> list[Row]:
        return self._rows_or_error(lambda: self._measure(ctx, step), step)

    def before_training(self, ctx: CellContext) -> list[Row]:
        return self._guarded(ctx, 0) if "init" in self.params.at else []  # type: ignore[attr-defined]

    def after_training(self, ctx: CellContext) -> list[Row]:
        if "trained" not in self.params.at:  # type: ignore[attr-defined]
            return []
        return self._guarded(ctx, int((ctx.cell.get("train") or {}).get("epochs", 0) or 0))


def pick_layer(model: nn.Module, index: int) -> tuple[DEQLayer | None, str]:
    """The DEQ layer ``index`` of ``model``, or None and why not."""
    layers = list(deq_layers(model))
    if not layers:
        return None, "the model has no DEQ layer (not a DEQ, or it runs its own solver)"
    if index >= len(layers):
        return None, f"layer {index} asked for, the model has {len(layers)} DEQ layer(s)"
    return layers[index], ""


def model_name(ctx: CellContext) -> str:
    return str((ctx.cell.get("model") or {}).get("name", "?"))


def batches_of(
    ctx: CellContext, split: str, batch_size: int, count: int | None
) -> tuple[list[tuple[Tensor, Tensor]], str]:
    """Equal-sized batches of a seeded permutation of ``split`` (at most ``count``; the
    remainder that does not fill a batch is left out) and a note saying what was used."""
    X, y = ctx.data.train if split == "train" else ctx.data.test
    n = int(X.shape[0])
    bs = min(int(batch_size), n)
    g = torch.Generator().manual_seed(int(ctx.seed) + 34)
    idx = torch.randperm(n, generator=g).to(X.device)
    nb = n // bs if count is None else min(int(count), n // bs)
    out = [(X[idx[i * bs : (i + 1) * bs]], y[idx[i * bs : (i + 1) * bs]]) for i in range(nb)]
    note = f"{nb} batches of {bs} {split} samples"
    if bs < batch_size:
        note += f" (the split has {n} < {batch_size})"
    return out, note


@contextlib.contextmanager
def replaced_forward(layer: DEQLayer, fn: Callable[..., Tensor]) -> Iterator[None]:
    """``layer(u, z0)`` calls ``fn(u, z0)`` inside the block (an instance attribute shadows the
    method; the model's own forward, inject and readout run as they are)."""
    layer.forward = fn  # type: ignore[method-assign]
    try:
        yield
    finally:
        del layer.forward


def start_of(layer: DEQLayer, u: Tensor, z0: Tensor | None) -> tuple[Tensor, Tensor]:
    """(u, z0) as the layer's own forward makes them (state dtype; zeros when z0 is None)."""
    u = layer.state_dtype(u)
    return u, torch.zeros_like(u) if z0 is None else layer.state_dtype(z0)


def run_info(run_dir: Any) -> dict[str, Any]:
    """``run.json`` of ``run_dir`` (empty when there is none)."""
    try:
        return json.loads((Path(run_dir) / "run.json").read_text())
    except (OSError, TypeError, ValueError):
        return {}


def device_words(run_dir: Any) -> str:
    """``cpu (AMD EPYC), 1 thread`` or ``cuda (NVIDIA H100 80GB HBM3)`` from ``run.json``."""
    info = run_info(run_dir)
    dev = str(info.get("device", "") or "")
    if not dev:
        return "device not recorded"
    name = str(info.get("device_name", "") or "")
    text = f"{dev} ({name})" if name and name != dev else dev
    flags = info.get("flags") or {}
    threads = flags.get("threads") if isinstance(flags, dict) else None
    if dev == "cpu" and threads:
        text += f", {threads} thread{'s' if threads != 1 else ''}"
    return text
