"""Loss-landscape family: surfaces and curves around the trained weights (math: ``surface``,
``directions``), its analysis (``analysis``), plots (``plots``) and the ``deqbench landscape`` verb
(``cli``).

The public names of :mod:`deqbench.landscape.surface` are importable from here
(``deqbench.landscape.landscape``); they are imported on first use, so that the family's CLI verb
(``deqbench.landscape.cli``) imports no torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module("deqbench.landscape.surface"), name)


def __dir__() -> list[str]:
    return sorted(
        n for n in dir(import_module("deqbench.landscape.surface")) if not n.startswith("_")
    )
