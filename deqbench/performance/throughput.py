"""Throughput: eval and train samples/s and time per batch, peak memory, parameter count.

Rows (analysis ``throughput``; ``step`` 0 = before training, = epochs after training):

* ``eval_ms`` (one row per timed repeat, ``repeat`` = index) and ``eval_ms_median`` /
  ``_iqr`` / ``_spread`` (IQR / median; the note flags a spread above 10%): a no-grad forward of
  one batch in eval mode; ``eval_samples_per_s`` from the median; ``eval_forward_nstep``: the
  f-evaluations of every timed repeat (counted in the same repeat; the note says how the solve
  ran and under which autocast, e.g. ``path=graph, amp=bf16``); ``eval_forward_rel_residual`` /
  ``eval_forward_converged``: the final residual (batch max) of the last timed repeat's solve
  and whether it met the solver's tolerance (read after the timing: no sync inside it);
* ``train_ms`` (same layout), ``train_samples_per_s``, ``train_forward_nstep`` /
  ``train_backward_nstep``, ``train_{forward,backward}_{rel_residual,converged}``: a full
  optimiser step (zero_grad, forward, loss, backward, step with the cell's optimiser) on a copy
  of the model, so the model under analysis is not changed;
* ``eval_peak_memory`` / ``train_peak_memory`` (MiB) in their own pass: GPU
  ``max_memory_allocated`` above the baseline; CPU peak RSS of a fresh worker process (of this
  process, the note says why, for a model that cannot be pickled);
* ``param_count``, ``batch_size``, ``threads`` (and on GPU the TF32 / cudnn.benchmark flags).

Timing: CUDA events on GPU, ``perf_counter`` on CPU with the thread count recorded; ``warmup``
untimed calls first; every repeat stored (DESIGN.md "Measuring"). Every pass (timed and memory)
runs under the cell's ``runtime`` (bf16 autocast, compiled cell, CUDA graphs), as training does.

Example (plain functions):
    >>> import deqbench, torch
    >>> from deqbench.performance.throughput import measure_throughput
    >>> model = deqbench.models.create("fc_deq_tiny")
    >>> res = measure_throughput(model, torch.randn(32, 64), torch.randint(0, 10, (32,)),
    ...                          repeats=3, warmup=1, memory=False)
    >>> res["eval"].median > 0, res["eval_nstep"][0] > 0
    (True, True)
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from pydantic import Field
from torch import Tensor, nn

from ..analyses.base import CellContext, Row
from ..core.deq import Runtime, last_stats
from ..core.registry import analyses
from ..core.runtime import forward_paths, model_runtime, runtime_note
from ._perf import (
    EvalStep,
    PerfAnalysis,
    PerfParams,
    TrainStep,
    batch_size,
    detached_copy,
    measuring,
    phase_step,
    pick_batch,
    preserved,
)
from .measure import Memory, Timing, flag_rows, param_count, peak_memory, sync, time_fn


def measure_throughput(
    model: nn.Module,
    x: Tensor,
    y: Tensor | None = None,
    *,
    task: Any = "classification",
    train: dict[str, Any] | None = None,
    repeats: int = 10,
    warmup: int = 3,
    train_step: bool = True,
    memory: bool = True,
    memory_cpu: bool = True,
    runtime: Runtime | None = None,
) -> dict[str, Any]:
    """Eval forward and train step timings and peak memory of ``model`` on batch ``x``, under
    ``runtime`` (default: the model's DEQ layers').

    Returns a dict: ``eval`` (:class:`~deqbench.performance.measure.Timing`), ``eval_nstep`` (f-evals per
    repeat), ``eval_stats`` (:func:`~deqbench.deq.last_stats` of the last timed repeat),
    ``eval_path`` (how its solves ran), ``eval_memory`` (:class:`~deqbench.performance.measure.Memory`), and
    with ``train_step`` and ``y``: ``train``, ``train_nstep`` (forward, backward per repeat),
    ``train_stats``, ``train_path``, ``train_memory``; ``runtime``. The model's buffers and mode
    are restored; the train step runs on a copy.
    """
    device = x.device
    rt = runtime if runtime is not None else model_runtime(model)
    out: dict[str, Any] = {"runtime": rt}
    with preserved(model):
        ev = EvalStep(model, x, rt)
        t = time_fn(ev, device=device, repeats=repeats, warmup=warmup)
        out["eval"], out["eval_nstep"] = t, list(t.results)
        out["eval_stats"], out["eval_path"] = last_stats(model), forward_paths(model)
        if memory:
            out["eval_memory"] = peak_memory(ev, device, cpu=memory_cpu)
    if train_step and y is not None:
        ts = TrainStep(detached_copy(model), x, y, task, train, rt)
        t = time_fn(ts, device=device, repeats=repeats, warmup=warmup)
        out["train"], out["train_nstep"] = t, list(t.results)
        out["train_stats"], out["train_path"] = last_stats(ts.model), forward_paths(ts.model)
        if memory:
            out["train_memory"] = peak_memory(
                TrainStep(detached_copy(model), x, y, task, train, rt), device, cpu=memory_cpu
            )
    return out


def reference_loop_ms(model: nn.Module, x: Tensor, iters: int = 20, warmup: int = 3) -> float:
    """A hand-written timing loop without measurement machinery: ``iters`` no-grad eval
    forwards between two synchronisations, mean milliseconds per batch (the baseline the
    ``throughput`` numbers are checked against)."""
    import time

    was = model.training
    model.eval()
    with torch.no_grad():
        for _ in range(warmup):
            model(x)
        sync(x.device)
        t0 = time.perf_counter()
        for _ in range(iters):
            model(x)
        sync(x.device)
        dt = time.perf_counter() - t0
    model.train(was)
    return dt / iters * 1e3


_NSTEP_METRICS = {
    "eval": ("eval_forward_nstep",),
    "train": ("train_forward_nstep", "train_backward_nstep"),
}
#: last_stats keys -> metric suffix of the residual rows beside the timings
_RESIDUALS = {
    "forward_rel_residual": "forward_rel_residual",
    "forward_converged": "forward_converged",
    "backward_rel_residual": "backward_rel_residual",
    "backward_converged": "backward_converged",
}


def throughput_rows(
    res: dict[str, Any], batch: int, *, step: int | None = None, variant: str = ""
) -> list[Row]:
    """Result rows of :func:`measure_throughput`."""
    rows: list[Row] = []
    for kind in ("eval", "train"):
        t: Timing | None = res.get(kind)
        if t is None:
            continue
        rows += t.rows(f"{kind}_ms", variant=variant, step=step)
        med = t.median
        rows.append(
            Row(
                f"{kind}_samples_per_s",
                batch / med if med > 0 else math.nan,
                variant=variant,
                step=step,
                unit="samples/s",
            )
        )
        # f-evals per repeat: eval n = forward; train n = (forward, backward)
        metrics = _NSTEP_METRICS[kind]
        rt = res.get("runtime")
        note = runtime_note(res.get(f"{kind}_path"), rt) if rt is not None else ""
        for i, n in enumerate(res.get(f"{kind}_nstep") or []):
            values = (n,) if kind == "eval" else n
            rows += [
                Row(m, v, variant=variant, step=step, repeat=i, unit="f-evals", note=note)
                for m, v in zip(metrics, values)
            ]
        # the final residuals of the last timed repeat's solves, beside its counts
        stats = res.get(f"{kind}_stats") or {}
        for k, suffix in _RESIDUALS.items():
            if k in stats:
                rows.append(Row(f"{kind}_{suffix}", stats[k], variant=variant, step=step))
        mem: Memory | None = res.get(f"{kind}_memory")
        if mem is not None:
            rows.append(mem.row(f"{kind}_peak_memory", variant=variant, step=step))
    return rows


@analyses.register("throughput")
class Throughput(PerfAnalysis):
    """Eval/train samples per second, time per batch and peak memory (see module docstring)."""

    name = "throughput"
    #: the cell deqbench.testing.check_analysis runs it on (over testing.DEFAULT_EXAMPLE)
    example: ClassVar[dict[str, Any]] = {
        "params": {"repeats": 2, "warmup": 1, "batch_size": 16, "memory_cpu": False}
    }
    version = "1"
    needs_training = False

    class Params(PerfParams):
        repeats: int = Field(10, ge=1)
        warmup: int = Field(3, ge=0)
        #: also time a full optimiser step (on a copy of the model)
        train_step: bool = True

    params: Params  # narrowed for type checkers

    def _measure(self, ctx: CellContext, phase: str):
        p = self.params
        step = phase_step(ctx, phase)
        bs = batch_size(p, ctx)
        x, y, note = pick_batch(ctx, bs, p.split)
        with measuring(p):
            res = measure_throughput(
                ctx.model,
                x,
                y,
                task=ctx.task,
                train=(ctx.cell.get("train") or {}),
                repeats=p.repeats,
                warmup=p.warmup,
                train_step=p.train_step,
                memory=p.memory,
                memory_cpu=p.memory_cpu,
                runtime=ctx.runtime,
            )
            yield from throughput_rows(res, bs, step=step)
            yield Row("param_count", param_count(ctx.model), step=step, unit="parameters")
            yield Row("batch_size", bs, step=step, unit="samples", note=note)
            yield from flag_rows(ctx.device, step=step)
