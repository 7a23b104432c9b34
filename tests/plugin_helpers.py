"""A plugin distribution installed for one test: its modules and a dist-info with entry points
in a fresh site folder on ``sys.path``, plugin discovery on, the registries rescanned before and
after (the shared part of the plugin-test fixtures)."""

from __future__ import annotations

import contextlib
import importlib
import sys
import textwrap
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def installed_plugin(
    site: Path,
    monkeypatch: Any,
    dist: str,
    modules: Mapping[str, str],
    entry_points: Mapping[str, Mapping[str, str]],
    version: str = "1.0",
) -> Iterator[Path]:
    """Install ``modules`` (module name -> source, dedented) and the distribution ``dist``
    (``entry_points``: group -> {name: "module:attr"}) into ``site``; yields ``site``."""
    from deqbench.core.registry import REGISTRIES

    monkeypatch.delenv("DEQBENCH_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    site.mkdir(parents=True, exist_ok=True)
    for name, source in modules.items():
        (site / f"{name}.py").write_text(textwrap.dedent(source))
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = []
    for group, eps in entry_points.items():
        lines += [f"[{group}]", *(f"{k} = {v}" for k, v in eps.items()), ""]
    (info / "entry_points.txt").write_text("\n".join(lines))
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    for r in REGISTRIES.values():
        r.reset_plugins()
    try:
        yield site
    finally:
        for r in REGISTRIES.values():
            r.reset_plugins()
        for mod in [m for m in sys.modules if m in modules]:
            del sys.modules[mod]
