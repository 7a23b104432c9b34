"""The training loop suites use: optimiser, schedule, clipping, per-step/per-epoch callbacks.

Example:
    >>> import deqbench
    >>> from deqbench.run.data import load_data
    >>> from deqbench.run.train import TrainConfig, train
    >>> data = load_data("digits")                                     # doctest: +SKIP
    >>> model = deqbench.models.create("conv_deq_tiny")               # doctest: +SKIP
    >>> result = train(model, data, TrainConfig(epochs=2))            # doctest: +SKIP
    >>> result.status, result.history[-1]["test_accuracy"]            # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..analyses.base import CellContext, EpochInfo, Row, StepInfo
from ..core.deq import Runtime, deq_layers, last_stats
from ..core.runtime import autocast, for_loss, model_runtime
from .data import DataBundle
from .evaluation import evaluate, loss_function  # noqa: F401 - part of train's API

OPTIMIZERS = ("adam", "adamw", "sgd")
SCHEDULES = (None, "none", "step", "multistep", "cosine")


@dataclass
class TrainConfig:
    """Training hyperparameters (the suite's ``train:`` block)."""

    epochs: int = 2
    batch_size: int = 64
    optimizer: str = "adam"
    lr: float = 1e-3
    weight_decay: float = 0.0
    momentum: float = 0.9
    schedule: str | None = None  # step | multistep | cosine
    step_size: int = 30  # epochs, for "step"
    milestones: list[int] = field(default_factory=list)  # epochs, for "multistep"
    gamma: float = 0.1
    eta_min: float = 0.0  # for "cosine" (stepped per batch over all steps)
    grad_clip: float | None = None
    eval_batch_size: int = 512
    eval_before: bool = True  # evaluate at epoch 0, before training
    full_batch: bool = False  # one step per epoch over the whole train set (gradient descent)
    max_steps: int | None = None  # stop after this many optimiser steps


#: share of training batches allowed to miss the solver tolerance before a cell is flagged
MISSED_SHARE = 0.01
#: the tightest tolerance advised under bf16 autocast (its relative residual floor is ~4e-3)
BF16_TOL = 1e-2


@dataclass
class SolveTally:
    """Training batches whose forward solve / IFT adjoint solve missed its tolerance.

    The forward is counted only where it is a solve (not an ``unrolled`` K-step forward), the
    adjoint only where one ran (``ift``). ``worst`` is the largest batch-max relative residual
    among the batches that missed."""

    kind: str  # forward | adjoint
    batches: int = 0
    missed: int = 0
    worst: float = 0.0
    tol: float = float("nan")
    solver: str = ""  # the solver that ran (for the fix hint)
    amp: str = "none"  # the runtime's autocast (bf16: the fix is a looser tolerance)

    def add(self, converged: float, residual: float, tol: float, solver: str = "") -> None:
        self.batches += 1
        self.tol = tol
        self.solver = solver
        if not converged >= 1.0:
            self.missed += 1
            if self.worst == self.worst and not residual <= self.worst:  # NaN stays worst
                self.worst = residual

    @property
    def flagged(self) -> bool:
        return self.batches > 0 and self.missed > MISSED_SHARE * self.batches

    def note(self) -> str:
        """One line: what missed, by how much, and (when flagged) the fix."""
        share = f"{self.missed} of {self.batches} training batches ({100 * self.missed / self.batches:.1f}%"
        if not self.flagged:
            return (f"{self.kind} solve missed tol {self.tol:g} in {share} <= "
                    f"{100 * MISSED_SHARE:g}%, not flagged; worst rel {self.worst:.3g})")  # fmt: skip
        others = [x for x in ("broyden", "anderson", "newton_krylov") if x != self.solver]
        key = "solver.tol" if self.kind == "forward" else "backward.tol"
        if self.amp == "bf16" and self.tol < BF16_TOL:
            fix = (f"bf16's relative residual floor is about 4e-3: set {key} >= {BF16_TOL:g} "
                   "or runtime.amp: none")  # fmt: skip
        elif self.kind == "forward":
            fix = f"raise solver.max_iter (--max-iter) or try another solver (e.g. {others[0]})"
        else:
            fix = (f"raise backward.max_iter or try another adjoint solver (backward.solver: "
                   f"{' or '.join(others)})")  # fmt: skip
        return (f"{self.kind} solve missed tol {self.tol:g} in {share} > "
                f"{100 * MISSED_SHARE:g}%; worst rel {self.worst:.3g}): {fix}")  # fmt: skip


@dataclass
class TrainResult:
    status: str = "ok"  # ok | nan | diverged
    note: str = ""
    history: list[dict[str, float]] = field(default_factory=list)
    steps: int = 0
    forward: SolveTally = field(default_factory=lambda: SolveTally("forward"))
    adjoint: SolveTally = field(default_factory=lambda: SolveTally("adjoint"))

    def flags(self) -> list[str]:
        """Notes of the solves that missed tolerance in more than MISSED_SHARE of the batches."""
        return [t.note() for t in (self.forward, self.adjoint) if t.flagged]


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(
            params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
    from ..core.errors import ConfigError

    raise ConfigError(
        f"train.optimizer: unknown optimizer '{cfg.optimizer}'; choose from {OPTIMIZERS}"
    )


def make_schedule(opt: torch.optim.Optimizer, cfg: TrainConfig, steps_per_epoch: int):
    """(scheduler, per_batch) or (None, False)."""
    s = cfg.schedule
    if s in (None, "none"):
        return None, False
    if s == "step":
        return torch.optim.lr_scheduler.StepLR(opt, cfg.step_size, cfg.gamma), False
    if s == "multistep":
        return torch.optim.lr_scheduler.MultiStepLR(opt, cfg.milestones, cfg.gamma), False
    if s == "cosine":
        total = max(1, cfg.epochs * steps_per_epoch)
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, total, eta_min=cfg.eta_min), True
    from ..core.errors import ConfigError

    raise ConfigError(
        f"train.schedule: unknown schedule '{s}'; choose from step, multistep, cosine"
    )


def post_step(model: nn.Module) -> None:
    """Call ``post_step()`` on every submodule that defines it (e.g. pcDEQ's projection onto
    nonnegative weights). Plugins can define the same hook."""
    for m in model.modules():
        hook = getattr(m, "post_step", None)
        if callable(hook):
            hook()


@torch.no_grad()
def _batches(n: int, bs: int, gen: torch.Generator, device) -> Iterable[Tensor]:
    perm = torch.randperm(n, generator=gen).to(device)
    for i in range(0, n, bs):
        yield perm[i : i + bs]


def _emit(
    emit: Callable[[Any, Iterable[Row]], None] | None, analysis: Any, rows: Iterable[Row] | None
) -> None:
    if emit is not None and rows is not None:
        emit(analysis, rows)


def train(
    model: nn.Module,
    data: DataBundle,
    cfg: TrainConfig,
    *,
    ctx: CellContext | None = None,
    callbacks: Iterable[Any] = (),
    emit: Callable[[Any, Iterable[Row]], None] | None = None,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
    runtime: Runtime | None = None,
) -> TrainResult:
    """Train ``model`` on ``data`` (tensors already on the target device/dtype).

    ``callbacks`` are analyses (objects with ``on_step``/``on_epoch`` hooks); ``emit(analysis,
    rows)`` receives what they return. A NaN/inf loss stops training with status ``nan``
    (``diverged`` if the forward solver diverged on that batch); nothing is raised.
    ``runtime`` (default: the model's DEQ layers'; see :mod:`deqbench.core.runtime`): the forward and
    the loss run under its autocast (bf16), the loss in float32; parameters, gradients and the
    optimiser stay in the model's dtype.
    """
    if runtime is None:
        runtime = model_runtime(model)
    callbacks = list(callbacks)
    Xtr, ytr = data.train
    Xte, yte = data.test
    loss_fn = loss_function(data.task)
    opt = make_optimizer(model, cfg)
    if ctx is not None:
        ctx.optimizer = opt
        ctx.loss_fn = loss_fn
    n = Xtr.shape[0]
    bs = n if cfg.full_batch else min(cfg.batch_size, n)
    steps_per_epoch = math.ceil(n / bs)
    sched, per_batch = make_schedule(opt, cfg, steps_per_epoch)
    gen = torch.Generator().manual_seed(seed)
    result = TrainResult()

    def epoch_end(epoch: int, train_stats: dict[str, float]) -> None:
        test = evaluate(model, Xte, yte, data.task, cfg.eval_batch_size, runtime)
        rec = {
            "epoch": float(epoch),
            **{f"train_{k}": v for k, v in train_stats.items()},
            **{f"test_{k}": v for k, v in test.items()},
        }
        result.history.append(rec)
        info = EpochInfo(epoch, train_stats, test)
        for cb in callbacks:
            _emit(emit, cb, cb.on_epoch(ctx, info))

    result.forward.amp = result.adjoint.amp = runtime.amp
    if cfg.eval_before:
        ev = evaluate(model, Xtr, ytr, data.task, cfg.eval_batch_size, runtime)
        epoch_end(0, ev)

    step = 0
    layers = list(deq_layers(model))
    has_deq = bool(layers)
    # an unrolled K-step forward is not a solve: its tolerance is not a target
    forward_is_solve = has_deq and all(ly.backward_cfg.name != "unrolled" for ly in layers)
    for epoch in range(1, cfg.epochs + 1):
        model.train()
        sums: dict[str, float] = {}
        count = 0
        for idx in _batches(n, bs, gen, Xtr.device):
            xb, yb = Xtr[idx], ytr[idx]
            opt.zero_grad(set_to_none=True)
            with autocast(runtime, xb.device):
                out = model(xb)
                loss = loss_fn(for_loss(out, runtime), yb)
            lv = float(loss.detach())
            # The solvers' status strings are already on the host: no device sync per step here;
            # the residual summaries (which sync) are read once per step, after backward.
            diverged = has_deq and any(
                layer.last_forward_stats is not None
                and layer.last_forward_stats.status == "diverged"
                for layer in deq_layers(model)
            )
            if not math.isfinite(lv) or diverged:
                # A diverged forward solve stops the cell even if the loss is still finite
                # (the solver returns its lowest-residual iterate, which can hide a blow-up).
                fwd = last_stats(model) if has_deq else {}
                res = fwd.get("forward_rel_residual", math.nan)
                if fwd.get("forward_diverged") and math.isfinite(res):
                    result.status = "diverged"
                    result.note = f"forward solver diverged at epoch {epoch} step {step + 1}"
                else:
                    result.status = "nan"
                    result.note = f"non-finite loss {lv} at epoch {epoch} step {step + 1}"
                if fwd:
                    result.note += f" (forward rel residual {res:.3g}, {fwd.get('forward_nstep', 0):.0f} f-evals)"
                return result
            loss.backward()
            if cfg.grad_clip:
                nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            post_step(model)
            if sched is not None and per_batch:
                sched.step()
            step += 1
            st = last_stats(model) if has_deq else {}
            if forward_is_solve and "forward_converged" in st:
                result.forward.add(
                    st["forward_converged"],
                    st["forward_rel_residual"],
                    max(ly.solver_cfg.tol for ly in layers),
                    layers[0].solver_cfg.name,
                )
            if "backward_converged" in st:
                result.adjoint.add(
                    st["backward_converged"],
                    st["backward_rel_residual"],
                    max(ly.backward_cfg.tol for ly in layers),
                    layers[0].backward_cfg.solver,
                )
            rec = {"loss": lv, **st}
            if data.task == "classification":
                rec["accuracy"] = float((out.detach().argmax(1) == yb).float().mean())
            else:  # the loss is the MSE (as in evaluate), so every epoch has a train MSE row
                rec["mse"] = lv
            for k, v in rec.items():
                sums[k] = sums.get(k, 0.0) + v
            count += 1
            info = StepInfo(epoch, step, lv, st, (xb, yb))
            for cb in callbacks:
                _emit(emit, cb, cb.on_step(ctx, info))
            if progress is not None:
                progress(epoch, step)
            if cfg.max_steps is not None and step >= cfg.max_steps:
                break
        if sched is not None and not per_batch:
            sched.step()
        epoch_end(epoch, {k: v / max(count, 1) for k, v in sums.items()})
        result.steps = step
        if cfg.max_steps is not None and step >= cfg.max_steps:
            break
    return result
