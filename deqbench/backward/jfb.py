"""``jfb``: Jacobian-free backpropagation (Fung et al. 2022). The forward solves z* under no_grad
and one step ``f(z*, u)`` runs with grad, so the adjoint is approximated by the identity
((I - J)^{-1} ~ I): one VJP, no adjoint solve."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ..core.registry import backward_modes
from .base import BackwardMode
from .phantom import phantom_steps


@backward_modes.register("jfb")
class JFB(BackwardMode):
    """One step f(z*) with grad from the detached fixed point."""

    name = "jfb"

    def apply(self, layer: Any, u: Tensor, z0: Tensor) -> Tensor:
        return phantom_steps(layer, u, z0, 1, 1.0)
