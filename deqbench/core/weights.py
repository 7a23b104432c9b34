"""Which parameters of a cell are its weights: :func:`cell_weights` (what inits rescale, spectral
and landscape norms measure) without the :func:`injection_parameters` a cell declares. A leaf
module (torch only), read by :mod:`deqbench.core.deq` and re-exported by
:mod:`deqbench.contracts`, whose clauses describe ``injection_parameters()``.
"""

from __future__ import annotations

from torch import nn


def injection_parameters(cell: nn.Module) -> list[nn.Parameter]:
    """The parameters ``cell`` declares as injection (``cell.injection_parameters()``; none by
    default): they sit in the cell module but are not cell weights."""
    fn = getattr(cell, "injection_parameters", None)
    return list(fn()) if callable(fn) else []


def cell_weights(cell: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``cell.named_parameters()`` without its :func:`injection_parameters`: what inits rescale,
    spectral and landscape norms measure and Lipschitz bounds multiply."""
    skip = {id(p) for p in injection_parameters(cell)}
    return [(n, p) for n, p in cell.named_parameters() if id(p) not in skip]
