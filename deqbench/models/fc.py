"""Fully connected DEQ: z = sigma(W z + U x + b), linear readout."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from ..core.deq import DEQLayer, DEQModel
from ..core.registry import models
from . import declare_defaults
from ._common import activation, numel


class FCCell(nn.Module):
    """f(z, u) = sigma(W z + u), where u = U x + b is the injection."""

    def __init__(self, width: int, act: str = "tanh") -> None:
        super().__init__()
        self.W = nn.Linear(width, width, bias=False)
        self.act_name = act
        self.act = activation(act)

    def forward(self, z: Tensor, u: Tensor) -> Tensor:
        return self.act(self.W(z) + u)


class FCDEQ(DEQModel):
    """Fully connected DEQ with injection U x + b and a linear head on z*."""

    def __init__(self, in_features: int, width: int, num_outputs: int, act: str = "tanh") -> None:
        super().__init__()
        self.U = nn.Linear(in_features, width)
        self.deq = DEQLayer(FCCell(width, act))
        self.head = nn.Linear(width, num_outputs)

    def inject(self, x: Tensor) -> Tensor:
        return self.U(x.flatten(1))

    def readout(self, z: Tensor) -> Tensor:
        return self.head(z)


#: Declared defaults (deqbench.models.declare_defaults). W is unconstrained, so the cell's
#: Jacobian diag(1 - z^2) W can reach spectral radius >= 1 during training: plain iteration is
#: not a safe default, on the forward or the adjoint. Forward: Broyden. Anderson (m = 5, beta = 1)
#: stalled at rel ~1e-2 on 1-15 of 115 training batches of `fc_deq_tiny` on digits (5 epochs,
#: Adam 1e-3), also on a sample where rho(J*) = 0.84 and plain iteration converges (its history
#: stagnates; TorchDEQ's absolute lam behaves the same); Broyden missed 0. Adjoint: Anderson (a
#: linear problem, where it behaves like GMRES; 0 misses), tighter than the forward since its
#: error enters the gradient. Init: spectral, ||W||_2 = 0.5 (a contraction at init; PyTorch's
#: default uniform init gives ||W||_2 ~ 1.15, from which Broyden still missed 1-5 batches).
DEFAULTS: dict[str, Any] = dict(
    solver={"name": "broyden", "max_iter": 100, "tol": 1e-4},
    backward={"name": "ift", "solver": "anderson", "max_iter": 100, "tol": 1e-5},
    init={"name": "spectral", "target": 0.5},
)


@models.register("fc_deq")
@declare_defaults(**DEFAULTS)
def fc_deq(
    in_shape=(64,), num_outputs: int = 10, width: int = 128, activation: str = "tanh"
) -> FCDEQ:
    """z = sigma(W z + U x + b); sigma in tanh | relu | sigmoid (| softsign | relu6)."""
    return FCDEQ(numel(in_shape), width, num_outputs, activation)


@models.register("fc_deq_tiny")
@declare_defaults(**DEFAULTS)
def fc_deq_tiny(
    in_shape=(64,), num_outputs: int = 10, width: int = 32, activation: str = "tanh"
) -> FCDEQ:
    """Tiny fc_deq for tests (width 32)."""
    return FCDEQ(numel(in_shape), width, num_outputs, activation)
