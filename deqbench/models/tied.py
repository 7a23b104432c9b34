"""Explicit weight-tied baseline: the DEQ cell applied a fixed N times with shared weights,
trained by ordinary backprop (Nguyen 2022 section 4.2.1)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..core.registry import models
from . import explicit_network
from .conv import ConvDEQ
from .fc import FCDEQ


class TiedRepeat(nn.Module):
    """Wraps a DEQ model's inject/cell/readout; forward applies the cell ``repeats`` times."""

    def __init__(self, base: ConvDEQ | FCDEQ, repeats: int) -> None:
        super().__init__()
        if repeats < 1:
            from ..core.errors import ConfigError

            raise ConfigError(f"tied_repeat: repeats must be >= 1, got {repeats}")
        # Keep the base model's injection and head, but hold the cell directly: this is an
        # explicit network, not a DEQ (no DEQLayer inside, so analyses treat it as explicit).
        self.cell = base.deq.cell
        del base._modules["deq"]
        self.base = base
        self.repeats = int(repeats)

    def forward(self, x: Tensor) -> Tensor:
        u = self.base.inject(x)
        z = torch.zeros_like(u)
        for _ in range(self.repeats):
            z = self.cell(z, u)
        return self.base.readout(z)


@models.register("tied_repeat")
@explicit_network
def tied_repeat(
    in_shape=(1, 8, 8),
    num_outputs: int = 10,
    repeats: int = 6,
    cell: str = "conv",
    channels: int = 48,
    inner: int = 64,
    width: int = 128,
    activation: str = "tanh",
) -> TiedRepeat:
    """Weight-tied network of ``repeats`` applications of the ``cell`` ('conv' or 'fc')."""
    if cell == "conv":
        base: ConvDEQ | FCDEQ = ConvDEQ(in_shape, num_outputs, channels, inner)
    elif cell == "fc":
        from ._common import numel

        base = FCDEQ(numel(in_shape), width, num_outputs, activation)
    else:
        from ..core.errors import ConfigError

        raise ConfigError(f"tied_repeat: cell must be 'conv' or 'fc', got {cell!r}")
    return TiedRepeat(base, repeats)


@models.register("tied_repeat_tiny")
@explicit_network
def tied_repeat_tiny(
    in_shape=(1, 8, 8), num_outputs: int = 10, repeats: int = 6, cell: str = "conv"
) -> TiedRepeat:
    """Tiny tied_repeat for tests (16 channels / width 32)."""
    return tied_repeat(in_shape, num_outputs, repeats, cell, channels=16, inner=32, width=32)
