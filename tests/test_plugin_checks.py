"""Contract checks at `deqbench validate` / `run` time (deqbench/plugin_checks.py): each known
violation gives one line naming the distribution, the entry point and the clause, exit 2; the
frozen example plugin and every shipped suite pass."""

from __future__ import annotations

import importlib
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import write_suite
from typer.testing import CliRunner

import deqbench
from deqbench.cli import app
from deqbench.contracts import CLAUSES, MonotoneCell, Solver, reference_markdown
from deqbench.core.registry import REGISTRIES

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "deqbench-example-plugin"

SUITE = """\
schema: 1
name: pc
device: cpu
threads: 1
seeds: [0]
data: {name: digits, flatten: true, train_subset: 32, test_subset: 16}
defaults:
  model: {name: MODEL}
  solver: {name: SOLVER, max_iter: 20, tol: 1.0e-3}
  backward: {name: ift, solver: fixed_point, max_iter: 20, tol: 1.0e-3}
  train: {epochs: 1, batch_size: 16}
analyses: [metrics]
output: results
"""


def _dist_info(site: Path, name: str, version: str, groups: dict[str, dict[str, str]]) -> None:
    d = site / f"{name.replace('-', '_')}-{version}.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = []
    for group, eps in groups.items():
        lines += [f"[{group}]", *[f"{k} = {v}" for k, v in eps.items()], ""]
    (d / "entry_points.txt").write_text("\n".join(lines))


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A fresh site dir on sys.path with plugin discovery on; registries rescanned around."""
    monkeypatch.delenv("DEQBENCH_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    d = tmp_path / "site"
    d.mkdir()
    monkeypatch.syspath_prepend(str(d))
    importlib.invalidate_caches()
    for r in REGISTRIES.values():
        r.reset_plugins()
    yield d
    for r in REGISTRIES.values():
        r.reset_plugins()
    for mod in [m for m in sys.modules if m.startswith(("pcplug", "deqbench_example_plugin"))]:
        del sys.modules[mod]


def _plugin(site: Path, module: str, source: str, groups: dict[str, dict[str, str]]) -> None:
    (site / f"{module}.py").write_text(textwrap.dedent(source))
    _dist_info(site, "pcplug-dist", "1.0", groups)


def _validate(tmp_path: Path, model: str, solver: str = "fixed_point", *args: str):
    tmp_path.mkdir(parents=True, exist_ok=True)
    p = write_suite(tmp_path, SUITE, replace={"MODEL": model, "SOLVER": solver})
    return CliRunner().invoke(app, ["validate", str(p), *args])


def _error_lines(output: str) -> list[str]:
    return [ln for ln in output.splitlines() if ln.startswith("error:")]


def test_solver_returning_only_z(site, tmp_path):
    """Today: "ValueError: too many values to unpack (expected 2)" at run time."""
    _plugin(
        site,
        "pcplug_s",
        """
        def only_z(f, z0, *, max_iter=50, tol=1e-4, stop_mode="rel"):
            z = z0
            for _ in range(max_iter):
                z = f(z)
            return z
        """,
        {"deqbench.solvers": {"only_z": "pcplug_s:only_z"}},
    )
    r = _validate(tmp_path, "fc_deq_tiny", "only_z")
    assert r.exit_code == 2, r.output
    (line,) = _error_lines(r.output)
    assert "plugin pcplug-dist 1.0: solver 'only_z' (pcplug_s:only_z): [solver.returns]" in line
    assert "returned a Tensor, not (z, SolverStats)" in line
    # `run` refuses before it starts (no run directory)
    p = tmp_path / "suite.yaml"
    r = CliRunner().invoke(app, ["run", str(p), "--no-progress", "--no-plots"])
    assert r.exit_code == 2 and "[solver.returns]" in r.output
    assert not (tmp_path / "results").exists()


def test_factory_without_in_shape(site, tmp_path):
    """Today: passes validate, then "TypeError: nosig() got an unexpected keyword argument"."""
    _plugin(
        site,
        "pcplug_m",
        """
        def nosig():
            import deqbench
            return deqbench.models.create("fc_deq_tiny")
        """,
        {"deqbench.models": {"nosig": "pcplug_m:nosig"}},
    )
    r = _validate(tmp_path, "nosig")
    assert r.exit_code == 2, r.output
    (line,) = _error_lines(r.output)
    assert "plugin pcplug-dist 1.0: model 'nosig' (pcplug_m:nosig): [model.factory]" in line
    assert "does not accept in_shape and num_outputs" in line


def test_structure_solver_on_a_non_monotone_model(tmp_path):
    """Today: peaceman_rachford on fc_deq passes validate and fails at run time."""
    r = _validate(tmp_path, "fc_deq_tiny", "peaceman_rachford")
    assert r.exit_code == 2, r.output
    (line,) = _error_lines(r.output)
    assert "cell fc_deq_tiny-peaceman_rachford-ift: built-in: model 'fc_deq_tiny'" in line
    assert (
        "[structure.cell] the forward solver 'peaceman_rachford' needs cells implementing " in line
    )
    assert "MonotoneCell" in line and "lacks lipschitz, m, monotonicity, prox" in line
    # on a monotone model it is fine (and validate lists the cells)
    r = _validate(tmp_path / "ok", "mondeq_fc_tiny", "peaceman_rachford")
    assert r.exit_code == 0, r.output
    assert "mondeq_fc_tiny-peaceman_rachford-ift" in r.output


def test_model_failing_in_forward_names_the_plugin(site, tmp_path):
    """Old third-party code (e.g. torch.rfft, removed from PyTorch) fails in one line."""
    _plugin(
        site,
        "pcplug_old",
        """
        import math
        import torch
        from torch import nn
        from deqbench.deq import DEQLayer, DEQModel

        class OldCell(nn.Module):
            def __init__(self, n):
                super().__init__()
                self.lin = nn.Linear(n, n)

            def forward(self, z, u):
                return torch.rfft(self.lin(z), 1) + u

        class Old(DEQModel):
            def __init__(self, d, n, k):
                super().__init__()
                self.U, self.head = nn.Linear(d, n), nn.Linear(n, k)
                self.deq = DEQLayer(OldCell(n))

            def inject(self, x):
                return self.U(x.flatten(1))

            def readout(self, z):
                return self.head(z)

        def old_deq(in_shape=(64,), num_outputs=10):
            return Old(math.prod(in_shape), 8, num_outputs)
        """,
        {"deqbench.models": {"old_deq": "pcplug_old:old_deq"}},
    )
    r = _validate(tmp_path, "old_deq")
    assert r.exit_code == 2, r.output
    (line,) = _error_lines(r.output)
    assert "plugin pcplug-dist 1.0: model 'old_deq' (pcplug_old:old_deq): [model.forward]" in line
    assert "AttributeError" in line and "rfft" in line and "pcplug_old.py:" in line


def test_solver_stats_shapes_and_declared_compatibility(site, tmp_path):
    _plugin(
        site,
        "pcplug_t",
        """
        import torch
        from deqbench.models import declare_defaults
        from deqbench.solvers.base import make_stats, residuals

        def flat_trace(f, z0, *, max_iter=50, tol=1e-4, stop_mode="rel"):
            z = z0
            for k in range(max_iter):
                fz = f(z)
                a, r = residuals(fz, z)
                z = fz
            st = make_stats("flat_trace", max_iter, a, r, a, r, tol, stop_mode, False)
            return z, st

        @declare_defaults(solver="anderson", backward="ift", solvers=["anderson"],
                          backward_modes=["ift"])
        def picky(in_shape=(64,), num_outputs=10):
            import deqbench
            return deqbench.models.create("fc_deq_tiny", in_shape=in_shape,
                                          num_outputs=num_outputs)

        @declare_defaults(solver="broyden", solvers=["anderson"], backward_modes=["ifft"])
        def typo(in_shape=(64,), num_outputs=10):
            return picky(in_shape, num_outputs)
        """,
        {
            "deqbench.solvers": {"flat_trace": "pcplug_t:flat_trace"},
            "deqbench.models": {"picky": "pcplug_t:picky", "typo": "pcplug_t:typo"},
        },
    )
    r = _validate(tmp_path, "fc_deq_tiny", "flat_trace")
    assert r.exit_code == 2, r.output
    (line,) = _error_lines(r.output)
    assert (
        "solver 'flat_trace' (pcplug_t:flat_trace): [solver.stats] on a forward map: abs_trace is (2,)"
        in line
    )
    r = _validate(tmp_path / "b", "picky", "broyden")
    assert r.exit_code == 2, r.output
    lines = _error_lines(r.output)
    assert len(lines) == 2 and all("[model.declared]" in ln for ln in lines)
    assert "forward solver 'broyden' is not among the solvers the model declares" in lines[0]
    assert "adjoint solver 'fixed_point'" in lines[1]
    r = _validate(tmp_path / "c", "typo", "anderson")
    assert r.exit_code == 2, r.output
    text = "\n".join(_error_lines(r.output))
    assert "[model.declared] declares unknown backward mode 'ifft'" in text
    assert "its default solver 'broyden' is not among its declared solvers (anderson)" in text


def test_frozen_example_plugin_passes(site, tmp_path):
    """examples/deqbench-example-plugin, unchanged, passes validate and a one-epoch run."""
    import tomllib

    proj = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
    _dist_info(site, proj["name"], proj["version"], proj["entry-points"])
    sys.path.insert(0, str(EXAMPLE / "src"))
    try:
        r = _validate(tmp_path, "sine_deq_tiny", "relaxed_picard")
        assert r.exit_code == 0, r.output
        p = tmp_path / "suite.yaml"
        r = CliRunner().invoke(app, ["run", str(p), "--no-progress", "--no-plots"])
        assert r.exit_code == 0, r.output
    finally:
        sys.path.remove(str(EXAMPLE / "src"))


@pytest.mark.slow  # several seconds on 2 cores: out of the fast lane
def test_every_shipped_suite_passes_the_contract_checks():
    """Built-ins follow the contracts; the checks of all shipped suites stay cheap."""
    from deqbench.run.plugin_checks import check_all
    from deqbench.run.suite import load_suites

    suites = []
    for p in sorted((ROOT / "suites").glob("*.yaml")):
        if p.name == "vs_torchdeq.yaml" and "torchdeq_anderson" not in deqbench.solvers.names():
            continue
        suites += load_suites(p, device="cpu")
    t = time.process_time()
    violations = check_all(suites)
    assert [v.line() for v in violations] == []
    assert time.process_time() - t < 30


def test_contracts_are_documented_and_rendered():
    assert isinstance(deqbench.solvers.get("peaceman_rachford"), Solver)
    assert isinstance(deqbench.models.create("mondeq_fc_tiny").deq.cell, MonotoneCell)
    from deqbench.run.scaffold import update_guide

    doc = (ROOT / "docs" / "plugins.md").read_text()
    assert reference_markdown() in doc
    assert update_guide(doc) == doc, "stale: python -m deqbench.run.scaffold docs/plugins.md"
    for cid in CLAUSES:
        assert f"[{cid}]" in doc or f"`{cid}`" in doc
    assert "docs/plugins.md" in (ROOT / "README.md").read_text()


def test_data_shapes_match_the_loaded_data():
    from deqbench.data.base import load_data
    from deqbench.run.plugin_checks import data_shape

    for name, params in [
        ("digits", {}),
        ("digits", {"flatten": True, "target": "binary"}),
        ("synthetic", {"dim": 7}),
        ("gp_sequence", {"length": 20, "n_train": 10, "n_test": 5}),
        ("denoise", {"n_train": 4, "n_test": 2, "size": 8}),
        ("digits_klr", {"flatten": True}),
    ]:
        d = load_data(name, **params)
        assert data_shape(name, params) == (tuple(d.in_shape), d.num_outputs), (name, params)
