"""``ift``: the implicit function theorem. The forward solves z* = f(z*, u) under no_grad; the
backward solves the adjoint ``w = J^T w + g`` (J = df/dz at z*) with ``BackwardConfig.solver`` to
``tol`` and returns ``(df/du)^T w`` and ``(df/dtheta)^T w``; double backward (Hessian-vector
products) is exact (``second_order``). The machinery (the autograd Functions, the captured CUDA
adjoint, the direct per-sample solver) is in :mod:`deqbench.core.backward`."""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor

from ..core import backward as core
from ..core.registry import backward_modes
from .base import BackwardMode


@backward_modes.register("ift")
class IFT(BackwardMode):
    """Implicit differentiation; the adjoint solved with ``solver`` to ``tol``."""

    name = "ift"
    adjoint_solver = True
    checks_backward = True
    fields: ClassVar[tuple[str, ...]] = (
        "solver", "max_iter", "tol", "stop_mode", "b_init", "second_order", "refine", "options",
    )  # fmt: skip

    def apply(self, layer: Any, u: Tensor, z0: Tensor) -> Tensor:
        return core.implicit(layer, u, z0)

    def label(self, cfg: Any, forward: Any = None) -> str:
        return f"ift-tol={cfg.tol:g}" if cfg is not None else self.name
