"""Pieces shared by the performance analyses (``throughput``, ``backward``, ``solver_overhead``):
params, batch choice, when to measure, state preservation and picklable steps.

A *step* is an instance of a module-level class holding the model and the batch, so the same
object is timed in-process, measured for GPU peak memory in its own pass, and pickled into a
fresh worker for CPU peak RSS (:func:`deqbench.performance.measure.cpu_peak_rss`). A step runs the model
forward and the loss under its ``runtime``'s autocast (default: the model's DEQ layers' runtime;
the analyses pass the cell's), the loss in float32, as training does.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn

from ..analyses.base import Analysis, CellContext
from ..core.deq import Runtime, deq_layers, own_solve_stats, own_solver
from ..core.runtime import autocast, for_loss, model_runtime

Phase = Literal["init", "trained"]
PositiveInt = Annotated[int, Field(ge=1)]


class PerfParams(BaseModel):
    """Params every performance analysis accepts."""

    model_config = ConfigDict(extra="forbid")
    #: samples per measured batch: an int, a mapping model name -> int (suites whose matrix mixes
    #: models measured at different batch sizes), or null for ``train.batch_size``
    batch_size: PositiveInt | dict[str, PositiveInt] | None = None
    #: which split the batch is drawn from (seeded, the same for every variant compared)
    split: Literal["train", "test"] = "train"
    repeats: int = Field(5, ge=1)
    warmup: int = Field(2, ge=0)
    #: measure before training (step 0), after training (step = epochs), or both
    at: list[Phase] = Field(default_factory=lambda: list[Phase](["trained"]), min_length=1)
    #: peak memory in its own pass (GPU: max_memory_allocated; CPU: see memory_cpu)
    memory: bool = True
    #: on CPU, peak RSS of a fresh worker process per measurement (a process start each)
    memory_cpu: bool = True
    #: TF32 for matmul and cuDNN during the measurement (reference numbers keep it off)
    tf32: bool = False
    #: torch intra-op threads during the measurement (null: leave as set by the suite)
    threads: int | None = Field(None, ge=1)


def phase_step(ctx: CellContext, phase: str) -> int:
    """``step`` column of a measurement: 0 before training, the epochs after."""
    if phase == "init":
        return 0
    return int((ctx.cell.get("train") or {}).get("epochs", 0))


def batch_size(params: PerfParams, ctx: CellContext) -> int:
    """Resolve ``batch_size`` (int, per-model mapping or the train batch size)."""
    from ..core.errors import ConfigError

    bs = params.batch_size
    model = (ctx.cell.get("model") or {}).get("name", "")
    if isinstance(bs, dict):
        if model not in bs:
            raise ConfigError(
                f"batch_size: no entry for model '{model}' (has {', '.join(bs) or 'none'})"
            )
        return int(bs[model])
    if bs is None:
        return int((ctx.cell.get("train") or {}).get("batch_size", 64))
    return int(bs)


def pick_batch(ctx: CellContext, n: int, split: str = "train") -> tuple[Tensor, Tensor, str]:
    """A seeded batch of ``n`` samples (x, y, note); samples are repeated when the split is
    smaller than ``n`` (the note says so)."""
    X, y = ctx.data.train if split == "train" else ctx.data.test
    g = torch.Generator().manual_seed(int(ctx.seed) + 12345)
    idx = torch.randperm(X.shape[0], generator=g)
    note = ""
    if n > X.shape[0]:
        idx = idx.repeat((n + X.shape[0] - 1) // X.shape[0])
        note = f"{split} split has {X.shape[0]} samples < batch {n}: samples repeated"
    idx = idx[:n].to(X.device)
    return X[idx], y[idx], note


@contextlib.contextmanager
def preserved(model: nn.Module) -> Iterator[nn.Module]:
    """Restore the model's buffers (BatchNorm running stats), train/eval mode and DEQ configs
    after the block: measuring must not change the model under analysis.

    A buffer is restored whatever the block did to it: copied back in place when it kept its
    shape, dtype and device, else the saved tensor is registered again (a solver that keeps
    per-batch state in buffers shaped by the batch); a buffer registered inside the block is
    removed."""
    saved = {
        (m, n): b.detach().clone()
        for m in model.modules()
        for n, b in m._buffers.items()
        if b is not None
    }
    modes = {m: m.training for m in model.modules()}
    configs = [(layer, layer.solver_cfg, layer.backward_cfg) for layer in deq_layers(model)]
    try:
        yield model
    finally:
        _restore_buffers(model, saved)
        for m, t in modes.items():
            m.training = t
        for layer, s, b in configs:
            layer.solver_cfg, layer.backward_cfg = s, b


def _restore_buffers(model: nn.Module, saved: dict[tuple[nn.Module, str], Tensor]) -> None:
    with torch.no_grad():
        for (m, n), old in saved.items():
            cur = m._buffers.get(n)
            same = (
                cur is not None
                and cur.shape == old.shape
                and cur.dtype == old.dtype
                and cur.device == old.device
            )
            if same:
                cur.copy_(old)  # type: ignore[union-attr]
            else:  # reshaped, retyped, moved or dropped: the saved tensor is the buffer again
                m._buffers[n] = old
        for m in model.modules():
            for n in [n for n, b in m._buffers.items() if b is not None and (m, n) not in saved]:
                del m._buffers[n]
                m._non_persistent_buffers_set.discard(n)


@contextlib.contextmanager
def measuring(params: PerfParams) -> Iterator[None]:
    """Threads and TF32 for the measurement block, restored afterwards (by numeric_flags)."""
    from .measure import numeric_flags

    with numeric_flags(tf32=params.tf32):
        if params.threads is not None:
            torch.set_num_threads(params.threads)
        yield


class PerfAnalysis(Analysis):
    """Base of the performance analyses: ``_measure(ctx, phase)`` runs before training (phase
    ``init``) and/or after it (``trained``), as ``params.at`` says."""

    params: PerfParams  # narrowed for type checkers

    def _measure(self, ctx: CellContext, phase: str) -> Iterator[Any]:
        raise NotImplementedError

    def before_training(self, ctx: CellContext):
        if "init" in self.params.at:
            yield from self._measure(ctx, "init")

    def after_training(self, ctx: CellContext):
        if "trained" in self.params.at:
            yield from self._measure(ctx, "trained")


def _nstep(model: nn.Module, stats: str) -> int:
    layers = list(deq_layers(model))
    if not layers and own_solver(model) is not None:  # a model that runs its own solver
        own = own_solve_stats(model)[0 if stats == "last_forward_stats" else 1]
        return int(own.nstep) if own is not None else 0
    return sum(int(s.nstep) for layer in layers if (s := getattr(layer, stats)) is not None)


def forward_nstep(model: nn.Module) -> int:
    """Forward f-evaluations of the last pass, summed over DEQ layers (host ints: no sync), or
    those a model that runs its own solver reports (``last_solve_stats()``)."""
    return _nstep(model, "last_forward_stats")


def backward_nstep(model: nn.Module) -> int:
    """Adjoint solver steps of the last backward pass, summed over DEQ layers."""
    return _nstep(model, "last_backward_stats")


def loss_for(task: Any) -> Any:
    """The loss of a task name ("classification", "regression"), or ``task`` itself when it is
    a callable ``loss(output, target)`` (e.g. :class:`deqbench.performance.gradients.InnerProductLoss`)."""
    if callable(task):
        return task
    from ..core.evaluation import loss_function

    return loss_function(task)


# -- picklable steps ---------------------------------------------------------------------------


def _runtime(step: Any) -> Runtime:
    rt = getattr(step, "runtime", None)
    return rt if rt is not None else model_runtime(step.model)


class EvalStep:
    """One no-grad forward of ``model`` (eval mode) on ``x``; returns forward f-evaluations."""

    def __init__(self, model: nn.Module, x: Tensor, runtime: Runtime | None = None) -> None:
        self.model, self.x, self.runtime = model, x, runtime

    def __call__(self) -> int:
        self.model.eval()
        with torch.no_grad(), autocast(_runtime(self), self.x.device):
            self.model(self.x)
        return forward_nstep(self.model)


class GradStep:
    """Forward with grad, loss, and the parameter gradients (``autograd.grad``; ``.grad`` is not
    touched); returns (forward f-evals, backward f-evals)."""

    def __init__(
        self, model: nn.Module, x: Tensor, y: Tensor, task: Any, runtime: Runtime | None = None
    ) -> None:
        self.model, self.x, self.y, self.task, self.runtime = model, x, y, task, runtime

    def params(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def __call__(self) -> tuple[int, int]:
        self.model.train()
        rt = _runtime(self)
        with torch.enable_grad():
            with autocast(rt, self.x.device):
                loss = loss_for(self.task)(for_loss(self.model(self.x), rt), self.y)
            torch.autograd.grad(loss, self.params(), allow_unused=True)
        return forward_nstep(self.model), backward_nstep(self.model)


class TrainStep:
    """A full optimiser step on ``model`` (zero_grad, forward, loss, backward, step) with the
    cell's optimiser; the optimiser is built on first call. Returns (forward, backward)
    f-evaluations.

    The gradients are dropped after the step (``zero_grad(set_to_none=True)``), so no ``.grad``
    of a warm-up step is in a peak-memory baseline and freed inside the measured step (which
    would leave the step's own gradients out of its peak)."""

    def __init__(
        self,
        model: nn.Module,
        x: Tensor,
        y: Tensor,
        task: Any,
        train: dict[str, Any] | None = None,
        runtime: Runtime | None = None,
    ) -> None:
        self.model, self.x, self.y, self.task = model, x, y, task
        self.train = dict(train or {})
        self.runtime = runtime
        self.opt: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "opt": None}

    def __call__(self) -> tuple[int, int]:
        from ..run.train import TrainConfig, make_optimizer

        if self.opt is None:
            known = set(TrainConfig.__dataclass_fields__)
            self.opt = make_optimizer(
                self.model, TrainConfig(**{k: v for k, v in self.train.items() if k in known})
            )
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        rt = _runtime(self)
        with torch.enable_grad():
            with autocast(rt, self.x.device):
                loss = loss_for(self.task)(for_loss(self.model(self.x), rt), self.y)
            loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return forward_nstep(self.model), backward_nstep(self.model)


def detached_copy(model: nn.Module) -> nn.Module:
    """A deep copy (its own parameters, buffers and DEQ configs)."""
    return copy.deepcopy(model)
