"""Lazy public faces of the family packages (``deqbench.ntk``, ``.hessian``, ``.landscape``,
``.spectral``): the package re-exports the public names of its math module, imported on first
attribute access, so that importing the package (or its CLI verb) imports no torch."""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any


def face(package: str, module: str) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` that forward to ``module`` (PEP 562)."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(import_module(module), name)

    def __dir__() -> list[str]:
        return sorted(n for n in dir(import_module(module)) if not n.startswith("_"))

    return __getattr__, __dir__
