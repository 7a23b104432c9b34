"""``unrolled``: backpropagation through K steps of plain iteration z <- f(z) from z0 (or through
the forward solver's own differentiable ``unroll`` when it defines one, e.g. SAM), whatever the
forward solver. The layer *is* that K-step network, also at evaluation (its fixed point is another
model; analyses that need z* call ``solve()``). The reported forward residual is ||z_K -
z_{K-1}||, that of z_{K-1} (no extra f-evaluation). Memory grows linearly in K."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from ..core.registry import backward_modes
from ..solvers.base import make_stats, residuals
from .base import BackwardMode


def unrolled_steps(layer: Any, u: Tensor, z0: Tensor) -> Tensor:
    """K (``backward_cfg.k``) differentiable steps from z0; records the forward stats."""
    k = max(1, int(layer.backward_cfg.k))
    from .. import solvers

    # A forward solver may define its own differentiable k-step iteration (e.g. SAM, Xie et al. 2023
    # Eq. 12); otherwise unroll plain iteration.
    unroll = getattr(solvers.get(layer.solver_cfg.name), "unroll", None)
    if unroll is not None:
        z, abs_tr, rel_tr = unroll(lambda z_: layer.f(z_, u), z0, k, **layer.solver_cfg.options)
    else:
        z = z0
        prev = z
        abs_tr, rel_tr = [], []
        for _ in range(k):
            prev = z
            z = layer.f(z, u)
            a, r = residuals(z.detach(), prev.detach())
            abs_tr.append(a)
            rel_tr.append(r)
    # The residual of the last iterate is that of z_{K-1} (f(z_{K-1}) = z_K is what we return).
    cfg = layer.solver_cfg
    layer.last_forward_stats = make_stats(
        "unrolled",
        k,
        abs_tr,
        rel_tr,
        abs_tr[-1],
        rel_tr[-1],
        cfg.tol,
        cfg.stop_mode,
        diverged=not bool(torch.isfinite(z.detach()).all()),
        lowest_step=k - 1,
    )
    layer.last_backward_stats = None
    layer.f_evals_grad = k
    layer.vjp_bwd = k
    return z


@backward_modes.register("unrolled")
class Unrolled(BackwardMode):
    """Backpropagation through K steps from z0 (``k``); the K-step network at evaluation too."""

    name = "unrolled"
    solves_forward = False
    fields: ClassVar[tuple[str, ...]] = ("k",)

    def apply(self, layer: Any, u: Tensor, z0: Tensor) -> Tensor:
        return unrolled_steps(layer, u, z0)

    def evaluate(self, layer: Any, u: Tensor, z0: Tensor) -> Tensor | None:
        with torch.no_grad():
            return unrolled_steps(layer, u, z0)

    def label(self, cfg: Any, forward: Any = None) -> str:
        return f"unrolled-k={cfg.k}" if cfg is not None else self.name
