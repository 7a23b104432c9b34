"""``phantom``: phantom gradients (Geng et al. 2021). The forward solves z* under no_grad; then k
damped steps ``z <- tau f(z) + (1 - tau) z`` from z* (detached) run with grad, so the backward is
backpropagation through those k steps only: a cheap approximation of the implicit gradient whose
error decays like the contraction of the damped map to the power k."""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor

from ..core.registry import backward_modes
from .base import BackwardMode


def phantom_steps(layer: Any, u: Tensor, z0: Tensor, k: int, tau: float) -> Tensor:
    """z* from the layer's forward solve, then ``k`` differentiable damped steps from it."""
    zs, _ = layer.solve(u, z0)
    z = zs.detach()
    for _ in range(k):
        fz = layer.f(z, u)
        z = fz if tau == 1.0 else tau * fz + (1 - tau) * z
    layer.last_backward_stats = None
    layer.f_evals_grad = k
    layer.vjp_bwd = k
    return z


@backward_modes.register("phantom")
class Phantom(BackwardMode):
    """k damped steps from z* with grad (``k``, ``tau``)."""

    name = "phantom"
    fields: ClassVar[tuple[str, ...]] = ("k", "tau")

    def apply(self, layer: Any, u: Tensor, z0: Tensor) -> Tensor:
        cfg = layer.backward_cfg
        return phantom_steps(layer, u, z0, max(1, int(cfg.k)), float(cfg.tau))

    def label(self, cfg: Any, forward: Any = None) -> str:
        return f"phantom-k={cfg.k}-tau={cfg.tau:g}" if cfg is not None else self.name
