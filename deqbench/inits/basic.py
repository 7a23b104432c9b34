"""Built-in initialisations: default, normal, small, spectral. ``init(model, *, seed, **params)``."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from ..core.registry import inits


def cell_weights(model: nn.Module) -> list[nn.Parameter]:
    """The weight tensors (dim > 1) of the model's equilibrium cell(s) (or tied cell), without
    the parameters a cell declares as injection (``cell.injection_parameters()``)."""
    from ..core.contracts import cell_weights as own
    from ..core.deq import deq_layers

    cells = [layer.cell for layer in deq_layers(model)]
    if not cells and hasattr(model, "cell"):
        cells = [cast(nn.Module, model.cell)]
    return [p for c in cells for n, p in own(c) if p.dim() > 1]


def _generator(seed: int, device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(int(seed))
    return g


@inits.register("default")
def default(model: nn.Module, *, seed: int = 0) -> None:
    """Keep the model's own (PyTorch/family) initialisation."""
    return None


@inits.register("normal")
def normal(
    model: nn.Module, *, seed: int = 0, std: float | None = None, var: float | None = None
) -> None:
    """Cell weights ~ N(0, std^2), or N(0, var) when ``var`` (the variance) is given (default
    std 0.01). Nguyen 2022 section 4.1 writes N(0, sigma^2) with the variance: its
    "N(0, 0.01)" small init is ``var=0.01`` (std 0.1) and "N(0, 1)" is ``var=1``.

    Example:
        >>> import deqbench
        >>> m = deqbench.models.create("fc_deq_tiny", in_shape=(5,))
        >>> deqbench.inits.get("normal")(m, seed=0, var=0.01)   # std 0.1
    """
    from ..core.errors import ConfigError

    if std is not None and var is not None:
        raise ConfigError("init 'normal': give std or var (the variance), not both")
    if var is not None:
        if not var >= 0:
            raise ConfigError(f"init 'normal': var must be >= 0, got {var!r}")
        std = float(var) ** 0.5
    std = 0.01 if std is None else float(std)
    with torch.no_grad():
        for p in cell_weights(model):
            g = _generator(seed, p.device)
            p.copy_(torch.randn(p.shape, generator=g, device=p.device, dtype=p.dtype) * std)
            seed += 1


@inits.register("small")
def small(model: nn.Module, *, seed: int = 0) -> None:
    """Cell weights ~ N(0, 0.01^2): std 0.01 (variance 1e-4), the implicit-layers tutorial's conv
    init (conv_deq's own). Not Nguyen's "N(0, 0.01)" small init, whose 0.01 is the variance
    (std 0.1): that one is ``normal`` with ``var=0.01``."""
    normal(model, seed=seed, std=0.01)


@inits.register("spectral")
def spectral(model: nn.Module, *, seed: int = 0, target: float = 0.9, input_size: int = 32) -> None:
    """Rescale every cell weight to spectral norm ``target`` (dense: exact; conv: exact circular
    operator norm on ``input_size`` x ``input_size`` inputs, Sedghi et al.)."""
    from ..spectral.norms import operator_norm

    with torch.no_grad():
        for p in cell_weights(model):
            s = operator_norm(p, input_size=input_size)
            if s > 0:
                p.mul_(target / s)
