"""Gradient vectors of a training step, their accuracy, and the float64 IFT reference.

The reference gradient (REFERENCE.md 3.2) is the same training step in float64 with deqbench's
differentiable IFT, forward and adjoint solved to a tight tolerance, on a copy of the model whose
DEQ layers (of any implementation, e.g. a plugin's) are plain deqbench layers around the same
cells. Accuracy is the cosine and the relative error ||g - g_ref|| / ||g_ref|| over all trainable
parameters, matched by name. ``task`` is "classification" / "regression" (the training loss) or
a callable ``loss(output, target)``; :class:`CellModel` with :class:`InnerProductLoss` gives the
bare-cell setting of REFERENCE.md 3.2 (loss <R, z*> for a fixed R).

Example:
    >>> import deqbench, torch
    >>> from deqbench.gradients import reference_gradient, grad_vector, gradient_accuracy
    >>> model = deqbench.models.create("fc_deq_tiny")
    >>> x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    >>> g_ref, info = reference_gradient(model, x, y)
    >>> cos, err = gradient_accuracy(grad_vector(model, x, y, names=g_ref.names), g_ref)
    >>> cos > 0.99, err < 1e-3
    (True, True)
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from .analyses._perf import loss_for, preserved
from .deq import BackwardConfig, DEQLayer, DEQModel, SolverConfig, last_stats


class CellModel(DEQModel):
    """A bare cell ``f(z, x)`` as a DEQ model: ``inject`` and ``readout`` are the identity, so
    the output is z* itself (REFERENCE.md 2.6 benchmark cells; train with
    :class:`InnerProductLoss`). ``state_shape`` is the per-sample shape of z when it differs
    from x's (z0 = 0)."""

    def __init__(
        self,
        cell: nn.Module,
        solver: SolverConfig | None = None,
        backward: BackwardConfig | None = None,
        state_shape: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        self.deq = DEQLayer(cell, solver, backward)
        self.state_shape = tuple(state_shape) if state_shape is not None else None

    def inject(self, x: Tensor) -> Tensor:
        return x

    def z0(self, u: Tensor) -> Tensor:
        if self.state_shape is None:
            return torch.zeros_like(u)
        return u.new_zeros((u.shape[0], *self.state_shape))

    def readout(self, z: Tensor) -> Tensor:
        return z


class InnerProductLoss:
    """loss(z, R) = <R, z> summed over the batch: the fixed-direction loss of REFERENCE.md 3.2
    (picklable, for peak memory in a fresh worker)."""

    def __call__(self, out: Tensor, target: Tensor) -> Tensor:
        return (out * target).sum()


@dataclass
class GradVector:
    """Flattened parameter gradients, in the order of ``names`` (float64, on the CPU)."""

    vec: Tensor
    names: list[str]


def _param_dict(model: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def grad_vector(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    task: Any = "classification",
    names: Sequence[str] | None = None,
) -> GradVector:
    """Gradients of the training loss on (x, y) w.r.t. the trainable parameters (train mode,
    buffers restored), flattened in the order of ``names`` (default: the model's own); a
    parameter without gradient contributes zeros."""
    params = _param_dict(model)
    names = list(names) if names is not None else list(params)
    missing = [n for n in names if n not in params]
    if missing:
        raise ValueError(f"grad_vector: the model has no parameter {missing[0]!r}")
    with preserved(model):
        model.train()
        with torch.enable_grad():
            loss = loss_for(task)(model(x), y)
            plist = [params[n] for n in names]
            grads = torch.autograd.grad(loss, plist, allow_unused=True)
    parts = [
        (g if g is not None else torch.zeros_like(p)).detach().reshape(-1).double().cpu()
        for g, p in zip(grads, plist)
    ]
    return GradVector(torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64), names)


def gradient_accuracy(g: GradVector | Tensor, g_ref: GradVector | Tensor) -> tuple[float, float]:
    """(cosine, relative error ||g - g_ref|| / ||g_ref||) of two gradient vectors."""
    a = (g.vec if isinstance(g, GradVector) else g).double().reshape(-1)
    b = (g_ref.vec if isinstance(g_ref, GradVector) else g_ref).double().reshape(-1)
    nb = float(torch.linalg.vector_norm(b))
    na = float(torch.linalg.vector_norm(a))
    cos = float(a @ b) / (na * nb) if na > 0 and nb > 0 else math.nan
    err = float(torch.linalg.vector_norm(a - b)) / nb if nb > 0 else math.nan
    return cos, err


def native_copy(model: nn.Module, solver: SolverConfig, backward: BackwardConfig) -> nn.Module:
    """A deep copy of ``model`` whose DEQ layers (any DEQLayer subclass, e.g. a plugin's) are
    plain deqbench DEQLayers around the copied cells, configured with ``solver``/``backward``."""
    ref = copy.deepcopy(model)
    targets = [
        (parent, name, child)
        for parent in ref.modules()
        for name, child in parent.named_children()
        if isinstance(child, DEQLayer)
    ]
    for parent, name, child in targets:
        setattr(parent, name, DEQLayer(child.cell, replace(solver), replace(backward)))
    return ref


def reference_gradient(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    task: Any = "classification",
    *,
    solver: str = "anderson",
    tol: float = 1e-12,
    max_iter: int = 1000,
    adjoint_solver: str = "fixed_point",
    options: dict[str, Any] | None = None,
) -> tuple[GradVector, dict[str, float]]:
    """The reference gradient: the same training step in float64 with deqbench's IFT, forward
    solved with ``solver`` and the adjoint with ``adjoint_solver``, both to ``tol`` (rel).

    Returns (gradient, info) where info has the achieved ``forward_rel_residual``,
    ``backward_rel_residual``, ``forward_nstep``, ``backward_nstep`` and ``time_s``."""
    scfg = SolverConfig(
        solver, max_iter=max_iter, tol=tol, stop_mode="rel", options=dict(options or {})
    )
    bcfg = BackwardConfig("ift", solver=adjoint_solver, max_iter=max_iter, tol=tol, stop_mode="rel")
    ref = native_copy(model, scfg, bcfg).double()
    x64 = x.double() if x.is_floating_point() else x
    y64 = y.double() if y.is_floating_point() else y
    t0 = time.perf_counter()
    g = grad_vector(ref, x64, y64, task)
    info = {"time_s": time.perf_counter() - t0, **last_stats(ref)}
    return g, info
