"""docs/contributing.md is followed as written: each of its complete files is written
into a temporary package, the source index finds its registered name (so no list needs an
edit), it imports, and its conformance check passes (deqbench.testing)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

import deqbench
from deqbench import testing
from deqbench.core.index import scan_source
from deqbench.core.registry import registry

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "contributing.md"
BLOCK = re.compile(r"```python\n# (deqbench/\S+\.py)\n(.*?)```", re.S)
#: registry kind -> the conformance check of the guide's section
CHECKS = {
    "solvers": testing.check_solver,
    "models": testing.check_model,
    "inits": testing.check_init,
    "analyses": testing.check_analysis,
    "datasets": testing.check_dataset,
}


def _files() -> list[tuple[str, str]]:
    return BLOCK.findall(GUIDE.read_text())


def test_the_guide_covers_every_kind():
    kinds = set()
    for rel, source in _files():
        kinds |= set(scan_source(source, rel.removeprefix("deqbench/")).names)
    assert set(CHECKS) <= kinds, kinds


@pytest.mark.parametrize("index", range(5))
def test_following_the_guide(index, tmp_path):
    files = _files()
    assert len(files) == 5
    rel, source = files[index]
    found = scan_source(source, rel.removeprefix("deqbench/")).names
    (kind, (name,)), *rest = [(k, v) for k, v in found.items() if k != "plots"]
    assert not rest, found
    path = tmp_path / Path(rel).name
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"contrib_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    reg = registry(kind)
    try:
        spec.loader.exec_module(mod)
        assert name in reg.names()
        CHECKS[kind](name)
    finally:
        reg._entries.pop(name, None)
    assert name not in deqbench.core.registry.registry(kind).names()
