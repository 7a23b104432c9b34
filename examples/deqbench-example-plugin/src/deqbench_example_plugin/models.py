"""A sine DEQ: z = 0.5 sin(W z + U x + b), linear readout. ||J|| <= 0.5 ||W||."""

from __future__ import annotations

import math

import torch
from torch import nn

from deqbench.deq import DEQLayer, DEQModel


class SineCell(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.W = nn.Linear(width, width, bias=False)

    def forward(self, z: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return 0.5 * torch.sin(self.W(z) + u)


class SineDEQ(DEQModel):
    def __init__(self, in_features: int, width: int, num_outputs: int) -> None:
        super().__init__()
        self.U = nn.Linear(in_features, width)
        self.deq = DEQLayer(SineCell(width))
        self.head = nn.Linear(width, num_outputs)

    def inject(self, x: torch.Tensor) -> torch.Tensor:
        return self.U(x.flatten(1))

    def readout(self, z: torch.Tensor) -> torch.Tensor:
        return self.head(z)


def sine_deq(in_shape=(64,), num_outputs: int = 10, width: int = 64) -> SineDEQ:
    """Sine DEQ (deqbench factory convention: in_shape and num_outputs come from the data)."""
    return SineDEQ(math.prod(in_shape), width, num_outputs)


def sine_deq_tiny(in_shape=(64,), num_outputs: int = 10) -> SineDEQ:
    return SineDEQ(math.prod(in_shape), 16, num_outputs)
