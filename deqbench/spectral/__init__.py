"""Spectral family: spectral norms of convolutions and Jacobians (math: ``norms``) and the
``spectral`` analysis (``analysis``, with its plots).

The public names of :mod:`deqbench.spectral.norms` are importable from here
(``deqbench.spectral.conv_spectral_norm``); they are imported on first use, so that importing
the package imports no torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module("deqbench.spectral.norms"), name)


def __dir__() -> list[str]:
    return sorted(n for n in dir(import_module("deqbench.spectral.norms")) if not n.startswith("_"))
