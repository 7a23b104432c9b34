"""Hessian family: curvature of the loss (math: ``spectrum``, ``estimators``), its analysis
(``analysis``), plots (``plots``) and the ``deqbench hessian`` verb (``cli``).

The public names of :mod:`deqbench.hessian.spectrum` are importable from here
(``deqbench.hessian.HVPOperator``); they are imported on first use, so that the family's CLI verb
(``deqbench.hessian.cli``) imports no torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module("deqbench.hessian.spectrum"), name)


def __dir__() -> list[str]:
    return sorted(
        n for n in dir(import_module("deqbench.hessian.spectrum")) if not n.startswith("_")
    )
