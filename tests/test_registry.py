"""Registry: lookup, unknown names, plugin discovery through real entry-point metadata."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

import deqbench
from deqbench.core.registry import REGISTRIES
from deqbench.errors import PluginError, UnknownNameError

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "deqbench-example-plugin"


def _dist_info(root: Path, name: str, version: str, groups: dict[str, dict[str, str]]) -> None:
    """Write an installed-distribution record (dist-info) that importlib.metadata discovers."""
    d = root / f"{name.replace('-', '_')}-{version}.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = []
    for group, eps in groups.items():
        lines.append(f"[{group}]")
        lines += [f"{k} = {v}" for k, v in eps.items()]
        lines.append("")
    (d / "entry_points.txt").write_text("\n".join(lines))


@pytest.fixture
def plugin_path(tmp_path, monkeypatch):
    """A fresh site dir on sys.path; registries rescan plugins before and after the test."""
    monkeypatch.delenv("DEQBENCH_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    for r in REGISTRIES.values():
        r.reset_plugins()
    yield tmp_path
    for r in REGISTRIES.values():
        r.reset_plugins()
    for mod in [m for m in sys.modules if m.startswith(("deqbench_example_plugin", "fakeplug"))]:
        del sys.modules[mod]


def _install_example(site: Path) -> None:
    """'Install' the shipped example plugin: its sources and a dist-info built from its
    pyproject.toml entry points."""
    import tomllib

    meta = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())
    proj = meta["project"]
    sys.path.insert(0, str(EXAMPLE / "src"))
    _dist_info(site, proj["name"], proj["version"], proj["entry-points"])


def test_builtins_listed_and_created():
    names = deqbench.models.names()
    for n in ("fc_deq", "fc_deq_tiny", "conv_deq", "conv_deq_tiny", "tied_repeat"):
        assert n in names
    assert deqbench.models.origin("fc_deq") == "built-in"
    assert deqbench.models.names("conv_*") == [n for n in names if n.startswith("conv_")]
    m = deqbench.models.create("fc_deq_tiny", in_shape=(12,), num_outputs=3)
    assert m(torch.randn(2, 12)).shape == (2, 3)


def test_unknown_name_one_line_with_suggestion():
    with pytest.raises(UnknownNameError) as ei:
        deqbench.solvers.get("andersen")
    msg = str(ei.value)
    assert "\n" not in msg
    assert "solver" in msg and "'anderson'" in msg and "deqbench ls solvers" in msg


def test_example_plugin_found_created_and_run(plugin_path):
    _install_example(plugin_path)
    try:
        assert "sine_deq" in deqbench.models.names()
        assert deqbench.models.origin("sine_deq") == "deqbench-example-plugin 0.1.0"
        assert "relaxed_picard" in deqbench.solvers.names()
        model = deqbench.models.create("sine_deq_tiny", in_shape=(64,), num_outputs=10)
        solve = deqbench.solvers.get("relaxed_picard")
        from deqbench.deq import SolverConfig, configure

        configure(model, SolverConfig("relaxed_picard", max_iter=100, tol=1e-6))
        x = torch.randn(5, 64)
        out = model(x)
        assert out.shape == (5, 10)
        st = model.last_forward_stats
        assert st.solver == "relaxed_picard" and st.converged
        # the solver also runs stand-alone on the contract's signature
        z, st2 = solve(lambda z: 0.5 * z + 1.0, torch.zeros(3, 4), max_iter=200, tol=1e-8)
        assert torch.allclose(z, torch.full((3, 4), 2.0), atol=1e-6)
        # and the plugin model trains with a built-in solver and the IFT backward
        configure(model, SolverConfig("fixed_point", max_iter=100, tol=1e-6))
        out = model(x)
        out.sum().backward()
        assert model.deq.cell.W.weight.grad is not None
    finally:
        sys.path.remove(str(EXAMPLE / "src"))


def test_plugin_may_not_shadow_builtin(plugin_path):
    (plugin_path / "fakeplug_a.py").write_text("def f(**kw):\n    return 'plugin'\n")
    _dist_info(plugin_path, "fakeplug-a", "1.0", {"deqbench.models": {"fc_deq": "fakeplug_a:f"}})
    with pytest.warns(UserWarning, match="fakeplug-a 1.0.*built-in"):
        names = deqbench.models.names()
    assert "fc_deq" in names
    assert deqbench.models.origin("fc_deq") == "built-in"


def test_two_plugins_same_name_is_ambiguous(plugin_path):
    (plugin_path / "fakeplug_b.py").write_text("def f(**kw):\n    return 'b'\n")
    (plugin_path / "fakeplug_c.py").write_text("def f(**kw):\n    return 'c'\n")
    _dist_info(plugin_path, "fakeplug-b", "1.0", {"deqbench.models": {"twin": "fakeplug_b:f"}})
    _dist_info(plugin_path, "fakeplug-c", "2.0", {"deqbench.models": {"twin": "fakeplug_c:f"}})
    with pytest.raises(PluginError) as ei:
        deqbench.models.get("twin")
    assert "fakeplug-b 1.0" in str(ei.value) and "fakeplug-c 2.0" in str(ei.value)


def test_broken_plugin_reported_others_work(plugin_path):
    (plugin_path / "fakeplug_d.py").write_text("raise ImportError('missing dependency xyz')\n")
    (plugin_path / "fakeplug_e.py").write_text("def ok(f, z0, **kw):\n    return z0, None\n")
    _dist_info(plugin_path, "fakeplug-d", "0.3", {"deqbench.solvers": {"broken": "fakeplug_d:s"}})
    _dist_info(plugin_path, "fakeplug-e", "0.1", {"deqbench.solvers": {"fine": "fakeplug_e:ok"}})
    with pytest.raises(PluginError) as ei:
        deqbench.solvers.get("broken")
    assert "fakeplug-d 0.3" in str(ei.value) and "missing dependency xyz" in str(ei.value)
    assert deqbench.solvers.registry.plugin_errors
    assert callable(deqbench.solvers.get("fine"))
    assert callable(deqbench.solvers.get("fixed_point"))


def test_autoload_can_be_disabled(plugin_path, monkeypatch):
    (plugin_path / "fakeplug_f.py").write_text("def f(**kw):\n    return 1\n")
    _dist_info(
        plugin_path, "fakeplug-f", "1.0", {"deqbench.models": {"hidden_model": "fakeplug_f:f"}}
    )
    monkeypatch.setenv("DEQBENCH_DISABLE_PLUGIN_AUTOLOAD", "1")
    for r in REGISTRIES.values():
        r.reset_plugins()
    assert "hidden_model" not in deqbench.models.names()


def test_importing_deqbench_does_not_import_torch():
    import subprocess

    code = "import sys, deqbench; deqbench.models.registry; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
