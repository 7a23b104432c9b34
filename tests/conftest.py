"""Shared test set-up: plugin discovery off by default (plugin tests turn it back on), the ``gpu``
marker skips without CUDA, and helpers to write tiny suites."""

from __future__ import annotations

import importlib
import os
import sys
import textwrap
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("DEQBENCH_DISABLE_PLUGIN_AUTOLOAD", "1")

#: A suite that trains in well under a second per cell on one CPU thread.
TINY_SUITE = """\
schema: 1
name: tiny
device: cpu
threads: 1
seeds: [0]
data: {name: digits, train_subset: 64, test_subset: 32}
defaults:
  model: {name: fc_deq_tiny, width: 8}
  solver: {name: fixed_point, max_iter: 15, tol: 1.0e-3}
  backward: {name: ift, max_iter: 15, tol: 1.0e-3}
  train: {epochs: 1, batch_size: 32}
matrix:
  backward: [ift, unrolled]
analyses: [metrics, solver_stats]
output: results
"""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


def write_suite(
    directory: Path,
    text: str = TINY_SUITE,
    name: str = "suite.yaml",
    replace: dict[str, str] | None = None,
) -> Path:
    """Write ``text`` (dedented; ``replace`` maps old -> new substrings) to ``directory/name``,
    with the output under ``directory/results``."""
    text = textwrap.dedent(text).replace(
        "output: results", f"output: {Path(directory) / 'results'}"
    )
    for old, new in (replace or {}).items():
        assert old in text, old
        text = text.replace(old, new)
    path = Path(directory) / name
    path.write_text(text)
    return path


@pytest.fixture
def tiny_suite(tmp_path: Path) -> Path:
    """Path of :data:`TINY_SUITE` written under ``tmp_path`` (output goes to tmp_path/results)."""
    return write_suite(tmp_path)


def install_example(example: Path, site: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """'Install' the plugin package ``example`` (under examples/) for one test: its ``src`` and a
    dist-info with the entry points of its pyproject.toml on sys.path, plugin discovery on; its
    modules are unloaded afterwards. Use as ``yield from install_example(...)`` in a fixture."""
    proj = tomllib.loads((example / "pyproject.toml").read_text())["project"]
    src = example / "src"
    d = site / f"{proj['name'].replace('-', '_')}-{proj['version']}.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {proj['name']}\nVersion: {proj['version']}\n"
    )
    lines = []
    for group, eps in proj["entry-points"].items():
        lines += [f"[{group}]", *[f"{k} = {v}" for k, v in eps.items()], ""]
    (d / "entry_points.txt").write_text("\n".join(lines))
    monkeypatch.delenv("DEQBENCH_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.syspath_prepend(str(src))
    importlib.invalidate_caches()
    from deqbench.core.registry import REGISTRIES

    for r in REGISTRIES.values():
        r.reset_plugins()
    yield
    for r in REGISTRIES.values():
        r.reset_plugins()
    packages = tuple(p.name for p in src.iterdir() if p.is_dir() and not p.name.startswith("."))
    for mod in [m for m in sys.modules if m.split(".")[0] in packages]:
        del sys.modules[mod]
