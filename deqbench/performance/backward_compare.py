"""What the ``backward`` analysis measures beyond time and gradient error: where the
memory of a training step goes, whether a mode's gradient is a descent direction of the true
loss, and the test accuracy after the same number of optimiser steps.

* :func:`memory_split`: the bytes autograd saves during one training forward, split into
  ``activations`` (outside the DEQ layers: injection, readout, loss), ``unroll`` (inside
  differentiable f-evaluations of the DEQ layers: unrolled K, phantom k, JFB's one step) and
  ``backward_state`` (what a DEQ layer's own autograd Function keeps for its backward: z* and u
  for IFT, the float64 pair (z_N, y_N) for RevDEQ, z* and Broyden's inverse-estimate pairs for
  SHINE). Device independent.
* :func:`solver_history` (CUDA): the peak memory of each forward solve above its baseline, less
  the returned state: the solver's own history (Anderson's window, Broyden's pairs, the
  reversible states, the residual traces).
* :class:`DescentCheck`: the loss of the float64 reference model (tight forward solves) after a
  step ``-eta g`` along a mode's gradient, against the same step along the reference gradient.
* :func:`train_steps`: a copy of the model trained for a fixed number of optimiser steps with a
  mode (the same seeded batches for every mode), then evaluated on the test split.
* :func:`memory_vs_iterations`: the memory of one training step against the number of forward
  iterations, IFT against unrolled.

Example:
    >>> import deqbench, torch
    >>> from deqbench.performance.backward_compare import memory_split
    >>> model = deqbench.models.create("fc_deq_tiny")
    >>> x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
    >>> split = memory_split(model, x, y)
    >>> split["unroll"] == 0 and split["backward_state"] > 0   # IFT saves z* and u only
    True
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from ..core.deq import DEQLayer, Runtime, SolverConfig, configure, deq_layers
from ..core.runtime import autocast, for_loss, model_runtime
from ._perf import GradStep, forward_nstep, loss_for, preserved
from .gradients import GradVector, ReferenceSettings, reference_copy
from .measure import MIB, Memory, peak_memory, saved_tensor_bytes


@contextlib.contextmanager
def _deq_scopes(model: nn.Module, where: list[str]) -> Iterator[None]:
    """While the block runs, ``where[-1]`` says whether autograd is inside a DEQ layer's
    forward ("deq"), inside one of its f-evaluations ("f") or outside ("out"): the layers'
    forward and ``f`` are wrapped on the instances (restored afterwards)."""
    layers = list(deq_layers(model))
    saved: list[tuple[DEQLayer, Any, Any]] = []
    for layer in layers:
        fwd, f = layer.__dict__.get("forward"), layer.__dict__.get("f")
        saved.append((layer, fwd, f))
        cls_fwd, cls_f = type(layer).forward, type(layer).f

        def wrapped_forward(*a: Any, _l: DEQLayer = layer, _c: Any = cls_fwd, **k: Any) -> Any:
            where.append("deq")
            try:
                return _c(_l, *a, **k)
            finally:
                where.pop()

        def wrapped_f(*a: Any, _l: DEQLayer = layer, _c: Any = cls_f, **k: Any) -> Any:
            where.append("f")
            try:
                return _c(_l, *a, **k)
            finally:
                where.pop()

        layer.__dict__["forward"] = wrapped_forward
        layer.__dict__["f"] = wrapped_f
    try:
        yield
    finally:
        for layer, fwd, f in saved:
            for key, old in (("forward", fwd), ("f", f)):
                if old is None:
                    layer.__dict__.pop(key, None)
                else:
                    layer.__dict__[key] = old


def memory_split(
    model: nn.Module, x: Tensor, y: Tensor, task: Any = "classification",
    runtime: Runtime | None = None,
) -> dict[str, int]:  # fmt: skip
    """Bytes autograd saves during one training forward of ``model`` (train mode, buffers
    restored), by where they are saved: ``activations``, ``unroll``, ``backward_state`` (see the
    module docstring) and ``total``. A storage saved twice counts once, in the first place it
    was saved."""
    rt = runtime if runtime is not None else model_runtime(model)
    where = ["out"]
    seen: dict[tuple[Any, int], tuple[str, int]] = {}

    def pack(t: Tensor) -> Tensor:
        try:
            st = t.untyped_storage()
            key = (t.device, st.data_ptr())
            if key not in seen:
                seen[key] = (where[-1], st.nbytes())
        except Exception:  # pragma: no cover - exotic tensors
            pass
        return t

    with preserved(model), _deq_scopes(model, where), torch.enable_grad():
        model.train()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with autocast(rt, x.device):
                loss = loss_for(task)(for_loss(model(x), rt), y)
        del loss
    out = {"activations": 0, "unroll": 0, "backward_state": 0}
    names = {"out": "activations", "f": "unroll", "deq": "backward_state"}
    for scope, nbytes in seen.values():
        out[names[scope]] += nbytes
    out["total"] = sum(out.values())
    return out


def solver_history(
    model: nn.Module, x: Tensor, y: Tensor, task: Any = "classification",
    runtime: Runtime | None = None,
) -> float:  # fmt: skip
    """CUDA only: the largest peak, over the forward solves of one training step, of the memory
    a solve allocates above its baseline, less the state it returns (bytes): what the forward
    solver keeps while it iterates (its history). NaN on other devices."""
    if x.device.type != "cuda":
        return math.nan
    rt = runtime if runtime is not None else model_runtime(model)
    peaks: list[float] = []
    saved = []
    for layer in deq_layers(model):
        saved.append((layer, layer.__dict__.get("solve")))
        cls_solve = type(layer).solve

        def solve(*a: Any, _l: DEQLayer = layer, _c: Any = cls_solve, **k: Any) -> Any:
            dev = x.device
            torch.cuda.synchronize(dev)
            base = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            z, st = _c(_l, *a, **k)
            torch.cuda.synchronize(dev)
            peaks.append(float(torch.cuda.max_memory_allocated(dev) - base - z.nbytes))
            return z, st

        layer.__dict__["solve"] = solve
    try:
        with preserved(model), torch.enable_grad():
            model.train()
            params = [p for p in model.parameters() if p.requires_grad]
            with autocast(rt, x.device):
                loss = loss_for(task)(for_loss(model(x), rt), y)
            torch.autograd.grad(loss, params, allow_unused=True)
    finally:
        for layer, old in saved:
            if old is None:
                layer.__dict__.pop("solve", None)
            else:
                layer.__dict__["solve"] = old
    return max(peaks) if peaks else 0.0


class DescentCheck:
    """The float64 reference loss along gradient steps: built once per batch, then :meth:`gain`
    of any gradient vector (in the reference gradient's order). The step ``theta - eta g`` takes
    eta such that the step along the reference gradient ``g_ref`` moves the parameters by
    ``step`` of their norm. A gain ratio near 1: as good a step as the exact gradient; near
    cos * ||g|| / ||g_ref|| for small steps; negative: an ascent direction."""

    def __init__(
        self,
        model: nn.Module,
        x: Tensor,
        y: Tensor,
        task: Any,
        g_ref: GradVector,
        settings: ReferenceSettings,
        step: float = 1e-3,
    ) -> None:
        self.ref = reference_copy(model, settings).double()
        self.x = x.double() if x.is_floating_point() else x
        self.y = y.double() if y.is_floating_point() else y
        self.loss_fn = loss_for(task)
        self.names = list(g_ref.names)
        params = dict(self.ref.named_parameters())
        self.theta = torch.cat([params[n].detach().reshape(-1).cpu() for n in self.names])
        self.shapes = [(n, params[n].shape, params[n].device) for n in self.names]
        nref = float(torch.linalg.vector_norm(g_ref.vec))
        ntheta = float(torch.linalg.vector_norm(self.theta))
        # the reference step moves the parameters by ``step`` of their norm
        self.eta = step * max(ntheta, 1e-12) / max(nref, 1e-300)
        self.loss0 = self.loss(self.theta)
        self.gain_ref = self.loss0 - self.loss(self.theta - self.eta * g_ref.vec)

    def loss(self, theta: Tensor) -> float:
        """The reference loss with the parameters ``theta`` (float64, tight solves)."""
        from torch.func import functional_call

        tensors, i = {}, 0
        for n, shape, dev in self.shapes:
            k = math.prod(shape)
            tensors[n] = theta[i : i + k].reshape(shape).to(dev)
            i += k
        self.ref.train()  # the training loss the gradients are of (batch statistics)
        with torch.no_grad():
            out = functional_call(self.ref, tensors, (self.x,))
            return float(self.loss_fn(out, self.y))

    def gain(self, g: GradVector) -> tuple[float, float]:
        """(loss decrease along -eta g, that decrease over the reference gradient's)."""
        d = self.loss0 - self.loss(self.theta - self.eta * g.vec)
        ratio = d / self.gain_ref if self.gain_ref > 0 else math.nan
        return d, ratio


def train_steps(
    model: nn.Module,
    data: Any,
    task: Any,
    *,
    steps: int,
    batch_size: int,
    train: dict[str, Any],
    seed: int = 0,
    runtime: Runtime | None = None,
    eval_samples: int | None = None,
) -> dict[str, float]:
    """Train a deep copy of ``model`` (its DEQ configs as set) for ``steps`` optimiser steps
    on seeded random batches of the train split (the same batches for the same ``seed``), with
    the optimiser and learning rate of ``train`` (the cell's ``train`` section); evaluate on the
    test split (at most ``eval_samples``). Returns ``loss`` (the mean training loss of the last
    steps), ``test_loss``, ``test_accuracy`` (classification) or ``test_mse``, and
    ``finite`` (0 when a loss or gradient became non-finite; training then stops)."""
    from ..core.evaluation import evaluate
    from ..run.train import TrainConfig, make_optimizer

    m = copy.deepcopy(model)
    rt = runtime if runtime is not None else model_runtime(m)
    known = set(TrainConfig.__dataclass_fields__)
    opt = make_optimizer(m, TrainConfig(**{k: v for k, v in train.items() if k in known}))
    X, Y = data.train
    gen = torch.Generator().manual_seed(int(seed) + 4242)
    loss_fn = loss_for(task)
    losses: list[float] = []
    finite = 1.0
    m.train()
    for _ in range(int(steps)):
        idx = torch.randint(0, X.shape[0], (batch_size,), generator=gen).to(X.device)
        opt.zero_grad(set_to_none=True)
        with torch.enable_grad(), autocast(rt, X.device):
            loss = loss_fn(for_loss(m(X[idx]), rt), Y[idx])
        loss.backward()
        value = float(loss.detach())
        if not math.isfinite(value) or not all(
            bool(torch.isfinite(p.grad).all()) for p in m.parameters() if p.grad is not None
        ):
            finite = 0.0
            break
        opt.step()
        losses.append(value)
    Xt, Yt = data.test
    if eval_samples is not None:
        Xt, Yt = Xt[:eval_samples], Yt[:eval_samples]
    res = evaluate(m, Xt, Yt, task if isinstance(task, str) else "regression", runtime=rt)
    tail = losses[-max(1, len(losses) // 5) :] if losses else [math.nan]
    out = {"loss": sum(tail) / len(tail), "test_loss": res["loss"], "finite": finite}
    if "accuracy" in res:
        out["test_accuracy"] = res["accuracy"]
    else:
        out["test_mse"] = res.get("mse", res["loss"])
    return out


def _first_layer(model: nn.Module) -> DEQLayer:
    layers = list(deq_layers(model))
    if not layers:
        raise ValueError("backward: the model has no DEQ layer")
    return layers[0]


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
