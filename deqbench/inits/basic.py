"""Built-in initialisations: default, normal, small, spectral. ``init(model, *, seed, **params)``."""

from __future__ import annotations

import torch
from torch import nn

from ..registry import inits


def cell_weights(model: nn.Module) -> list[nn.Parameter]:
    """The weight tensors (dim > 1) of the model's equilibrium cell(s) (or tied cell)."""
    from ..deq import deq_layers

    cells = [layer.cell for layer in deq_layers(model)]
    if not cells and hasattr(model, "cell"):
        cells = [model.cell]
    return [p for c in cells for n, p in c.named_parameters() if p.dim() > 1]


def _generator(seed: int, device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(int(seed))
    return g


@inits.register("default")
def default(model: nn.Module, *, seed: int = 0) -> None:
    """Keep the model's own (PyTorch/family) initialisation."""
    return None


@inits.register("normal")
def normal(model: nn.Module, *, seed: int = 0, std: float = 0.01) -> None:
    """Cell weights ~ N(0, std^2)."""
    with torch.no_grad():
        for p in cell_weights(model):
            g = _generator(seed, p.device)
            p.copy_(torch.randn(p.shape, generator=g, device=p.device, dtype=p.dtype) * std)
            seed += 1


@inits.register("small")
def small(model: nn.Module, *, seed: int = 0) -> None:
    """Cell weights ~ N(0, 0.01^2), the small init of papers/004 section 4.1."""
    normal(model, seed=seed, std=0.01)


@inits.register("spectral")
def spectral(model: nn.Module, *, seed: int = 0, target: float = 0.9, input_size: int = 32) -> None:
    """Rescale every cell weight to spectral norm ``target`` (dense: exact; conv: exact circular
    operator norm on ``input_size`` x ``input_size`` inputs, Sedghi et al.)."""
    from ..spectral import operator_norm

    with torch.no_grad():
        for p in cell_weights(model):
            s = operator_norm(p, input_size=input_size)
            if s > 0:
                p.mul_(target / s)
