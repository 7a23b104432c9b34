"""NTK family: the empirical NTK of a DEQ (math: ``empirical``, ``engine``, ``gram``), its
analysis (``analysis``), plots and the ``deqbench ntk`` verb (``cli``).

The public names of :mod:`deqbench.ntk.empirical` are importable from here
(``deqbench.ntk.empirical_ntk``); they are imported on first use, so that the family's CLI verb
(``deqbench.ntk.cli``) imports no torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module("deqbench.ntk.empirical"), name)


def __dir__() -> list[str]:
    return sorted(n for n in dir(import_module("deqbench.ntk.empirical")) if not n.startswith("_"))
