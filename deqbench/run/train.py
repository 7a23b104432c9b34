"""The training loop suites use: optimiser, schedule, clipping, per-step/per-epoch callbacks.

Example:
    >>> import deqbench
    >>> from deqbench.data.base import load_data
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
from ..core.deq import Runtime, deq_layers, last_stats, own_solver
from ..core.evaluation import evaluate, loss_function
from ..core.runtime import autocast, for_loss, model_runtime
from ..core.verdict import solve_ledger, verify_solves
from ..data.base import DataBundle
from .captured_step import CapturedStep, capture_problem
from .checkpoints import Suspended, TaskCheckpoint, rng_states, set_rng_states
from .interrupts import held_signals
from .solves import BF16_TOL, MISSED_SHARE, SolveTally, Tallies  # noqa: F401 - train's API

OPTIMIZERS = ("adam", "adamw", "sgd")
SCHEDULES = (None, "none", "step", "multistep", "cosine")


@dataclass
class TrainConfig:
    """Training hyperparameters (the suite's ``train:`` block).

    Attributes:
        checkpoint_every: seconds of training between the checkpoints a task of a run writes
            into its run directory, at step boundaries (``--resume`` continues an unfinished
            task from its last one; a SIGINT/SIGTERM or ``--stop-after`` writes one too); null:
            none at all. How a run saves, not what it computes: not part of the suite hash.
    """

    epochs: int = 2
    batch_size: int = 64
    optimizer: str = "adam"
    lr: float = 1e-3
    weight_decay: float = 0.0
    momentum: float = 0.9
    schedule: str | None = None  # step | multistep | cosine
    step_size: int = 30  # epochs, for "step"
    milestones: list[int] = field(default_factory=list)  # epochs, for "multistep"
    gamma: float = 0.1  # LR factor of step, multistep and lr_milestone_steps
    eta_min: float = 0.0  # for "cosine" (stepped per batch over all steps)
    grad_clip: float | None = None
    eval_batch_size: int = 512
    eval_before: bool = True  # evaluate at epoch 0, before training
    full_batch: bool = False  # one step per epoch over the whole train set (gradient descent)
    max_steps: int | None = None  # stop after this many optimiser steps
    #: the LR is multiplied by ``gamma`` after each of these optimiser-step counts (stepped per
    #: batch, so a schedule is stated in steps whatever the data size); not with ``schedule``
    lr_milestone_steps: list[int] = field(default_factory=list)
    #: recompute BatchNorm running statistics over the training set (no_grad, train mode,
    #: cumulative average as torch.optim.swa_utils.update_bn) after each epoch, before the
    #: evaluation: with few steps, momentum-0.1 running statistics still weigh the initial
    #: ones, so eval mode normalises differently from training (conv_deq_tiny after 4 steps:
    #: every evaluation solve at max_iter, accuracy 0.39; with this: converged, 0.73)
    precise_bn: bool = False
    #: seconds of training between a task's checkpoints (see the class docstring)
    checkpoint_every: float | None = 60.0
    #: take each training step as captured parts whose solves stop on the device
    #: (:mod:`deqbench.run.captured_step`; CUDA graphs on a GPU, the same parts eagerly on CPU);
    #: a model or configuration it does not support is a ConfigError naming why
    capture: bool = False


@dataclass
class TrainResult:
    status: str = "ok"  # ok | nan | diverged
    note: str = ""
    history: list[dict[str, float]] = field(default_factory=list)
    #: optimiser steps taken (all epochs; up to the failing step where training stopped early)
    steps: int = 0
    #: optimiser steps in one full epoch (batches per pass over the training set)
    steps_per_epoch: int = 0
    #: every DEQ solve of training, evaluation and the analyses' hooks, by (kind, phase)
    tallies: Tallies = field(default_factory=Tallies)

    @property
    def forward(self) -> SolveTally:
        """The training batches' forward solves."""
        return self.tallies.get("forward", "train")

    @property
    def adjoint(self) -> SolveTally:
        """The training batches' IFT adjoint solves."""
        return self.tallies.get("adjoint", "train")

    def flags(self) -> list[str]:
        """Notes of the phases whose solves missed tolerance in more than MISSED_SHARE."""
        return self.tallies.flags()


def make_optimizer(
    model: nn.Module, cfg: TrainConfig, capturable: bool = False
) -> torch.optim.Optimizer:
    """The suite's optimiser, stepping with ``foreach=True`` (one call over every parameter
    tensor, the single-tensor loop's arithmetic). Not torch's ``fused=True`` Adam kernel, though
    its host time is lower: it updates the parameters without bumping their version counters,
    and deqbench's caches of parameter-derived values (OptEq's norm scale and singular vectors)
    see a change by the version. ``capturable``: Adam and AdamW with their state on the
    device, so that a CUDA graph can hold the step (captured training steps)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optimizer == "adam":
        return torch.optim.Adam(
            params, lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=True, capturable=capturable
        )
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(
            params, lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=True, capturable=capturable
        )
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(
            params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
            foreach=True,
        )  # fmt: skip
    from ..core.errors import ConfigError

    raise ConfigError(
        f"train.optimizer: unknown optimizer '{cfg.optimizer}'; choose from {OPTIMIZERS}"
    )


def schedule_problem(schedule: str | None, lr_milestone_steps: list[int]) -> str | None:
    """Why ``train.lr_milestone_steps`` cannot be used as given (with an epoch-based
    ``schedule``, or not strictly increasing positive step counts), or None."""
    if not lr_milestone_steps:
        return None
    if schedule not in (None, "none"):
        return (
            f"train.lr_milestone_steps states the LR schedule in optimiser steps; it cannot be "
            f"combined with train.schedule '{schedule}' (drop one of them)"
        )
    if any(m < 1 for m in lr_milestone_steps) or any(
        b <= a for a, b in zip(lr_milestone_steps, lr_milestone_steps[1:])
    ):
        return (
            "train.lr_milestone_steps must be strictly increasing positive step counts, got "
            f"{list(lr_milestone_steps)}"
        )
    return None


def make_schedule(opt: torch.optim.Optimizer, cfg: TrainConfig, steps_per_epoch: int):
    """(scheduler, per_batch) or (None, False). ``lr_milestone_steps``: a multistep schedule
    stepped per batch (LR x gamma once that many optimiser steps are done)."""
    s = cfg.schedule
    if cfg.lr_milestone_steps:
        why = schedule_problem(s, list(cfg.lr_milestone_steps))
        if why:
            from ..core.errors import ConfigError

            raise ConfigError(why)
        steps = list(cfg.lr_milestone_steps)
        return torch.optim.lr_scheduler.MultiStepLR(opt, steps, cfg.gamma), True
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
    for hook in post_step_hooks(model):
        hook()


def post_step_hooks(model: nn.Module) -> list[Callable[[], Any]]:
    """The ``post_step`` methods of ``model``'s submodules (what :func:`post_step` calls; the
    training loop looks them up once)."""
    hooks = []
    for m in model.modules():
        hook = getattr(m, "post_step", None)
        if callable(hook):
            hooks.append(hook)
    return hooks


@torch.no_grad()
def recompute_batchnorm(
    model: nn.Module, X: Tensor, batch_size: int, runtime: Runtime | None = None
) -> int:
    """Reset every BatchNorm's running statistics and recompute them as the cumulative average
    over ``X`` in batches (train mode, no gradients; momentum restored afterwards), as
    ``torch.optim.swa_utils.update_bn`` does. Returns the number of BatchNorm modules."""
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not bns:
        return 0
    momenta = [m.momentum for m in bns]
    was = model.training
    rt = runtime if runtime is not None else model_runtime(model)
    try:
        for m in bns:
            m.reset_running_stats()
            m.momentum = None
        model.train()
        for i in range(0, X.shape[0], batch_size):
            xb = X[i : i + batch_size]
            with autocast(rt, xb.device):
                model(xb)
    finally:
        for m, mom in zip(bns, momenta):
            m.momentum = mom
        model.train(was)
    return len(bns)


def _emit(
    emit: Callable[[Any, Iterable[Row]], None] | None, analysis: Any, rows: Iterable[Row] | None
) -> None:
    if emit is not None and rows is not None:
        emit(analysis, rows)
    elif rows is not None:
        for _ in rows:  # a generator hook runs (and solves) only when consumed
            pass


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
    tallies: Tallies | None = None,
    checkpoint: TaskCheckpoint | None = None,
) -> TrainResult:
    """Train ``model`` on ``data`` (tensors already on the target device/dtype).

    ``callbacks`` are analyses (objects with ``on_step``/``on_epoch`` hooks); ``emit(analysis,
    rows)`` receives what they return. A NaN/inf loss stops training with status ``nan``
    (``diverged`` if the forward solver diverged on that batch); nothing is raised.
    ``runtime`` (default: the model's DEQ layers'; see :mod:`deqbench.core.runtime`): the forward and
    the loss run under its autocast (bf16), the loss in float32; parameters, gradients and the
    optimiser stay in the model's dtype. ``tallies`` (default: new) receives every DEQ solve of
    the training batches, the evaluation passes and the analyses' hooks, by phase
    (:mod:`deqbench.run.solves`); the evaluation passes and the last training batch of each
    epoch verify their forward solves (one more f-evaluation each). ``checkpoint``
    (:class:`~deqbench.run.checkpoints.TaskCheckpoint`): continue from its loaded state, write
    one at step boundaries where due, on a SIGINT/SIGTERM that came during a step (then
    :class:`~deqbench.run.interrupts.Interrupted` is raised) and at its deadline (then
    :class:`~deqbench.run.checkpoints.Suspended`).
    """
    t = _Trainer(model, data, cfg, ctx, list(callbacks), emit, seed, runtime, tallies)
    t.progress, t.checkpoint = progress, checkpoint
    return t.run()


class _Trainer:
    """One call of :func:`train`: its optimiser, schedule, data order and result, and the loop
    that a checkpoint can stop and continue at every step boundary."""

    progress: Callable[[int, int], None] | None = None
    checkpoint: TaskCheckpoint | None = None

    def __init__(
        self,
        model: nn.Module,
        data: DataBundle,
        cfg: TrainConfig,
        ctx: CellContext | None,
        callbacks: list[Any],
        emit: Callable[[Any, Iterable[Row]], None] | None,
        seed: int,
        runtime: Runtime | None,
        tallies: Tallies | None,
    ) -> None:
        self.model, self.data, self.cfg, self.ctx = model, data, cfg, ctx
        self.callbacks, self.emit = callbacks, emit
        self.runtime = model_runtime(model) if runtime is None else runtime
        self.X, self.y = data.train
        self.loss_fn = loss_function(data.task)
        #: captured training steps, one per batch shape (an epoch's last, partial batch has its
        #: own static buffers and graphs; the optimiser and gradients are shared)
        self.captured: dict[tuple[int, ...], CapturedStep] | None = None
        if cfg.capture:
            why = capture_problem(model, cfg)
            if why is not None:
                from ..core.errors import ConfigError

                raise ConfigError(f"train.capture: not for this cell: {why}")
        self.opt = make_optimizer(model, cfg, capturable=cfg.capture and self.X.is_cuda)
        if ctx is not None:
            ctx.optimizer, ctx.loss_fn = self.opt, self.loss_fn
        n = self.X.shape[0]
        self.bs = n if cfg.full_batch else min(cfg.batch_size, n)
        self.steps_per_epoch = math.ceil(n / self.bs)
        self.sched, self.per_batch = make_schedule(self.opt, cfg, self.steps_per_epoch)
        self.gen = torch.Generator().manual_seed(seed)
        self.result = TrainResult(
            steps_per_epoch=self.steps_per_epoch,
            tallies=Tallies() if tallies is None else tallies,
        )
        self.result.tallies.amp, self.result.tallies.device = self.runtime.amp, self.X.device.type
        # PSNR/SSIM of image targets
        self.data_range = float((data.meta or {}).get("data_range", 1.0))
        self.own = own_solver(model) is not None  # a model that reports its own solves
        self.layers = list(deq_layers(model))  # looked up once: the model's structure stays
        self.has_deq = self.own or bool(self.layers)
        self.after_step = post_step_hooks(model)
        self.loop = _Loop()
        if cfg.capture:
            self.captured = {}

    def hook(self, phase: str, cb: Any, method: str, info: Any) -> None:
        """An analysis hook, its solves counted as ``phase`` (a generator runs inside)."""
        with self.result.tallies.counting(phase, cb):
            _emit(self.emit, cb, getattr(cb, method)(self.ctx, info))

    def evaluate(self, X: Tensor, y: Tensor) -> dict[str, float]:
        c = self.cfg
        return evaluate(
            self.model, X, y, self.data.task, c.eval_batch_size, self.runtime, self.data_range
        )

    def epoch_end(self, epoch: int, train_stats: dict[str, float]) -> None:
        phase = "init" if epoch == 0 else "eval"
        with self.result.tallies.counting(phase):  # evaluate verifies its solves
            test = self.evaluate(*self.data.test)
        rec = {
            "epoch": float(epoch),
            **{f"train_{k}": v for k, v in train_stats.items()},
            **{f"test_{k}": v for k, v in test.items()},
        }
        self.result.history.append(rec)
        info = EpochInfo(epoch, train_stats, test)
        for cb in self.callbacks:
            self.hook(phase if epoch == 0 else "probe", cb, "on_epoch", info)

    def capped(self) -> bool:
        return self.cfg.max_steps is not None and self.loop.step >= self.cfg.max_steps

    def save(self) -> None:
        if self.checkpoint is not None:
            state = _state(self.model, self.opt, self.sched, self.gen, self.loop, self.result)
            self.checkpoint.save(state, self.loop.step)

    def run(self) -> TrainResult:
        cfg, loop, result, ck = self.cfg, self.loop, self.result, self.checkpoint
        if ck is not None and ck.loaded is not None:
            self.loop = loop = _resume(ck, self.model, self.opt, self.sched, self.gen, result)
        elif cfg.eval_before:
            with result.tallies.counting("init"):
                ev = self.evaluate(self.X, self.y)
            self.epoch_end(0, ev)
        while loop.epoch <= cfg.epochs and not (self.capped() and loop.batch == 0):
            epoch = loop.epoch
            self.model.train()
            if loop.perm is None:
                loop.perm = torch.randperm(self.X.shape[0], generator=self.gen)
            perm = loop.perm.to(self.X.device)
            while loop.batch < self.steps_per_epoch and not self.capped():
                try:
                    with held_signals(self.save):  # a signal stops training between two steps
                        self.step(epoch, perm)
                except _Failed:
                    return result
                _boundary(ck, self.save, loop.step)
            with held_signals(self.save):
                if self.sched is not None and not self.per_batch:
                    self.sched.step()
                if cfg.precise_bn:
                    with result.tallies.counting("train"):
                        recompute_batchnorm(self.model, self.X, self.bs, self.runtime)
                self.epoch_end(epoch, {k: v / max(loop.count, 1) for k, v in loop.sums.items()})
                result.steps = loop.step
                loop.next_epoch()
            _boundary(ck, self.save, loop.step)
        return result

    def step(self, epoch: int, perm: Tensor) -> None:
        """One optimiser step on the loop's next batch, its records and hooks; raises
        :class:`_Failed` where training must stop (status and note in ``result``)."""
        cfg, loop, model, opt = self.cfg, self.loop, self.model, self.opt
        i = loop.batch
        idx = perm[i * self.bs : (i + 1) * self.bs]
        xb, yb = self.X[idx], self.y[idx]
        if self.captured is not None:
            self.captured_step(epoch, xb, yb)
            return
        opt.zero_grad(set_to_none=True)
        # the last batch of an epoch (or of training) is verified: its forward solves'
        # residuals are recomputed with one more f-evaluation
        last = i == self.steps_per_epoch - 1 or (
            cfg.max_steps is not None and loop.step + 1 >= cfg.max_steps
        )
        out, lv, fwd, records = _forward_backward(
            model, xb, yb, self.loss_fn, self.runtime, verify=last, layers=self.layers,
            own=self.own,
        )  # fmt: skip
        if fwd is not None:
            where = f"epoch {epoch} step {loop.step + 1}"
            self.result.status, self.result.note = _stopped(lv, fwd, where)
            self.result.steps = loop.step
            raise _Failed
        self.result.tallies.add("train", records)
        if cfg.grad_clip:
            nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        for fn in self.after_step:
            fn()
        st = last_stats(model, self.layers) if self.has_deq else {}
        self.stepped(epoch, lv, st, _step_record(lv, st, out, yb, self.data.task), (xb, yb))

    def stepped(
        self, epoch: int, lv: float, st: dict[str, float], rec: dict[str, float], batch: Any
    ) -> None:
        """After an optimiser step: the per-batch schedule, the loop's counters, the epoch's
        sums of the step's record ``rec``, the analyses' step hooks and the progress."""
        loop = self.loop
        if self.sched is not None and self.per_batch:
            self.sched.step()
        loop.step += 1
        loop.batch += 1
        for k, v in rec.items():
            loop.sums[k] = loop.sums.get(k, 0.0) + v
        loop.count += 1
        info = StepInfo(epoch, loop.step, lv, st, batch)
        for cb in self.callbacks:
            self.hook("probe", cb, "on_step", info)
        if self.progress is not None:
            self.progress(epoch, loop.step)

    def captured_step(self, epoch: int, xb: Tensor, yb: Tensor) -> None:
        """:meth:`step` as captured parts (``train.capture``): the same records and hooks."""
        loop, caps = self.loop, self.captured
        assert caps is not None
        cap = caps.get(tuple(xb.shape))
        if cap is None:
            cap = caps[tuple(xb.shape)] = CapturedStep(
                self.model, self.opt, self.loss_fn, self.data.task, self.after_step
            )
        with solve_ledger() as led:
            lv, acc, fst, ast = cap.step(xb, yb)
            cap.record(fst, ast)
        st = last_stats(self.model, self.layers)
        if ast is None:  # a diverged forward solve or a non-finite loss: no update was made
            where = f"epoch {epoch} step {loop.step + 1}"
            self.result.status, self.result.note = _stopped(lv, st, where)
            self.result.steps = loop.step
            raise _Failed
        self.result.tallies.add("train", led.records)
        rec = {"loss": lv, **st}
        if self.data.task == "classification":
            rec["accuracy"] = acc
        else:
            rec["mse"] = lv
        self.stepped(epoch, lv, st, rec, (xb, yb))


class _Failed(Exception):
    """A training step that stopped training (a non-finite loss, a diverged solve)."""


def _boundary(checkpoint: TaskCheckpoint | None, save: Callable[[], None], step: int) -> None:
    """Between two steps: the periodic checkpoint where one is due; at the deadline a checkpoint
    and :class:`~deqbench.run.checkpoints.Suspended`."""
    if checkpoint is None:
        return
    stop = checkpoint.deadline_passed()
    if stop or checkpoint.due():
        save()
    if stop:
        kept = checkpoint.saved_step == step
        raise Suspended(
            f"stopped by --stop-after at step {step}; "
            + ("--resume continues it from its checkpoint" if kept
               else "no checkpoint: --resume runs it from scratch")
        )  # fmt: skip


@dataclass
class _Loop:
    """Where the training loop is: the epoch (from 1), the batches done in it, the optimiser
    steps done, the epoch's sums of the step records, and the epoch's batch order (a CPU
    permutation; None before the epoch draws it)."""

    epoch: int = 1
    batch: int = 0
    step: int = 0
    sums: dict[str, float] = field(default_factory=dict)
    count: int = 0
    perm: Tensor | None = None

    def next_epoch(self) -> None:
        self.epoch, self.batch, self.sums, self.count, self.perm = self.epoch + 1, 0, {}, 0, None


def _state(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    sched: Any,
    gen: torch.Generator,
    loop: _Loop,
    result: TrainResult,
) -> dict[str, Any]:
    """The training loop's part of a checkpoint (:mod:`deqbench.run.checkpoints`)."""
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict() if sched is not None else None,
        "data_order": gen.get_state(),
        "rng": rng_states(),
        "loop": dict(vars(loop)),
        "history": result.history,
        "status": (result.status, result.note, result.steps),
    }


def _resume(
    checkpoint: TaskCheckpoint,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    sched: Any,
    gen: torch.Generator,
    result: TrainResult,
) -> _Loop:
    """Put the training loop's state of ``checkpoint`` back (then the task's part), and return
    where the loop goes on."""
    assert checkpoint.loaded is not None
    st = checkpoint.loaded["train"]
    model.load_state_dict(st["model"])
    opt.load_state_dict(st["optimizer"])
    if sched is not None and st["scheduler"] is not None:
        sched.load_state_dict(st["scheduler"])
    gen.set_state(st["data_order"])
    result.history = list(st["history"])
    result.status, result.note, result.steps = st["status"]
    checkpoint.resume_task()
    set_rng_states(st["rng"])  # last: nothing after it draws
    return _Loop(**st["loop"])


def _forward_backward(
    model: nn.Module,
    xb: Tensor,
    yb: Tensor,
    loss_fn: Callable[[Any, Tensor], Tensor],
    runtime: Runtime,
    *,
    verify: bool,
    layers: list[Any],
    own: bool,
) -> tuple[Any, float, dict[str, float] | None, list[Any]]:
    """One training batch's forward, loss and backward, its DEQ solves recorded (and verified
    where ``verify``). ``layers``: the model's DEQ layers. Returns the output, the loss, the
    forward solves' stats where training must stop (a NaN/inf loss or a diverged forward solve:
    no backward then; None otherwise) and the solves' records."""
    has_deq = own or bool(layers)
    with solve_ledger() as led:
        with verify_solves(verify), autocast(runtime, xb.device):
            out = model(xb)
            loss = loss_fn(for_loss(out, runtime), yb)
        lv = float(loss.detach())
        # The solvers' status strings are already on the host: no device sync per step
        # here; the residual summaries (which sync) are read once per step, after
        # backward.
        diverged = any(
            layer.last_forward_stats is not None and layer.last_forward_stats.status == "diverged"
            for layer in layers
        ) or (own and bool(last_stats(model).get("forward_diverged")))
        if not math.isfinite(lv) or diverged:
            # A diverged forward solve stops the cell even if the loss is still finite
            # (the solver returns its lowest-residual iterate, which can hide a blow-up).
            return out, lv, (last_stats(model, layers) if has_deq else {}), led.records
        loss.backward()
    return out, lv, None, led.records


def _step_record(
    lv: float, st: dict[str, float], out: Any, yb: Tensor, task: str
) -> dict[str, float]:
    """A training step's values, summed into the epoch's means: the loss, the solver stats, and
    the batch accuracy (classification) or MSE."""
    rec = {"loss": lv, **st}
    if task == "classification":
        rec["accuracy"] = float((out.detach().argmax(1) == yb).float().mean())
    else:  # the loss is the MSE (as in evaluate), so every epoch has a train MSE row
        rec["mse"] = lv
    return rec


def _stopped(loss: float, fwd: dict[str, float], where: str) -> tuple[str, str]:
    """(status, note) of a training stopped by a non-finite loss or a diverged forward solve
    (``fwd``: :func:`last_stats` of the batch): a solver that produced NaN is named as such, not
    reported as a non-finite loss the loss does not show."""
    res = fwd.get("forward_rel_residual", math.nan)
    evals = f"{fwd.get('forward_nstep', 0):.0f} f-evals"
    if fwd.get("forward_diverged") and math.isfinite(res):
        return "diverged", f"forward solver diverged at {where} (rel residual {res:.3g}, {evals})"
    if fwd.get("forward_diverged") or (fwd and not math.isfinite(res)):
        tail = "" if math.isfinite(loss) else f", loss {loss}"
        return (
            "nan",
            f"forward solver produced a non-finite residual ({res}) at {where} ({evals}{tail})",
        )
    note = f"non-finite loss {loss} at {where}"
    if fwd:
        note += f" (forward rel residual {res:.3g}, {evals})"
    return "nan", note
