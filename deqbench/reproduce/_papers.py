"""The one loader of the per-paper modules of :mod:`.checks` and :mod:`.extract`."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterable
from typing import Any


def load_papers(package: str, path: Iterable[str], namespace: dict[str, Any]) -> None:
    """Import every module of ``package`` (``p001_kglm``, ...) in name order: each registers its
    checkers or extractors on import. The names in a module's ``__all__`` go into ``namespace``
    (the package's globals); two modules exporting the same name is an error."""
    for info in sorted(pkgutil.iter_modules(path), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{package}.{info.name}")
        for name in mod.__all__:
            value = getattr(mod, name)
            if namespace.get(name, value) is not value:
                raise ImportError(f"{mod.__name__}.{name} shadows {package}.{name}")
            namespace[name] = value
