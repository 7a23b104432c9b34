"""Datasets as plugins: the entry-point group ``deqbench.datasets``, listed by
``deqbench ls`` with their distribution, run in a suite like a built-in, their contract
(deqbench.contracts.DatasetLoader) checked by ``deqbench validate`` (one line naming the
distribution and the clause) and by ``deqbench.testing.check_dataset``."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import write_suite
from typer.testing import CliRunner

from deqbench.cli import app
from deqbench.contracts import CLAUSES
from deqbench.core.errors import ConfigError, PluginError
from deqbench.core.registry import datasets
from deqbench.testing import ConformanceError, check_dataset, conformance_names
from tests.plugin_helpers import installed_plugin

DIST = "dsplug-dist 1.0"

PLUGIN = """
import torch

from deqbench.data.base import DataBundle


def _blobs(n_train, n_test, dim, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_train + n_test, dim, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()  # 3 classes
    return (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])


def blobs(n_train: int = 64, n_test: int = 32, dim: int = 6, seed: int = 0) -> DataBundle:
    tr, te = _blobs(n_train, n_test, dim, seed)
    return DataBundle("blobs", tr, te, in_shape=(dim,), num_outputs=3)


blobs.shape = lambda p: ((int(p["dim"]),), 3)


def blobs_loaded(n: int = 48, dim: int = 4) -> DataBundle:  # no declared shape: validate loads it
    tr, te = _blobs(n, n // 2, dim, 0)
    return DataBundle("blobs_loaded", tr, te, in_shape=(dim,), num_outputs=3)


def raising(n: int = 8):
    raise RuntimeError("the data server is down")


def as_tuple(n: int = 8):
    tr, te = _blobs(n, n, 3, 0)
    return tr, te, (3,), 3


def bad_shape(n: int = 8) -> DataBundle:
    tr, te = _blobs(n, n, 3, 0)
    return DataBundle("bad_shape", tr, te, in_shape=(3,), num_outputs=3)


bad_shape.shape = lambda p: "three"


def wrong_shape(n: int = 8) -> DataBundle:  # declares 5 inputs, loads 3
    tr, te = _blobs(n, n, 3, 0)
    return DataBundle("wrong_shape", tr, te, in_shape=(3,), num_outputs=3)


wrong_shape.shape = lambda p: ((5,), 3)
"""

ENTRY_POINTS = {
    "blobs": "dsplug:blobs",
    "blobs_loaded": "dsplug:blobs_loaded",
    "raising": "dsplug:raising",
    "as_tuple": "dsplug:as_tuple",
    "bad_shape": "dsplug:bad_shape",
    "wrong_shape": "dsplug:wrong_shape",
    "missing": "dsplug_missing:load",  # a module that is not there
}

SUITE = """\
schema: 1
name: dsp
device: cpu
threads: 1
seeds: [0]
data: {name: DATA}
defaults:
  model: {name: fc_deq_tiny}
  solver: {name: fixed_point, max_iter: 15, tol: 1.0e-3}
  backward: {name: ift, max_iter: 15, tol: 1.0e-3}
  train: {epochs: 1, batch_size: 32}
analyses: [metrics]
output: results
"""


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """The plugin ``dsplug`` installed (a dist-info with its entry points) in a fresh site dir on
    sys.path, plugin discovery on; the registries rescanned around the test."""
    eps = {"deqbench.datasets": ENTRY_POINTS}
    with installed_plugin(tmp_path / "site", monkeypatch, "dsplug-dist", {"dsplug": PLUGIN},
                          eps) as site:  # fmt: skip
        yield site


def _suite(tmp_path: Path, data: str) -> Path:
    d = tmp_path / data.strip("{}").split(",")[0].split(":")[1].strip()
    d.mkdir(parents=True, exist_ok=True)
    return write_suite(d, SUITE, replace={"{name: DATA}": data})


def _error_lines(output: str) -> list[str]:
    return [ln for ln in output.splitlines() if ln.startswith("error:")]


def test_ls_lists_plugin_datasets_with_their_distribution(plugin):
    r = CliRunner().invoke(app, ["ls", "datasets"])
    assert r.exit_code == 0, r.output
    rows = [ln.split(maxsplit=2) for ln in r.output.splitlines() if ln.startswith("datasets")]
    assert ["datasets", "blobs", DIST] in rows and ["datasets", "missing", DIST] in rows
    assert ["datasets", "digits", "built-in"] in rows
    assert datasets.origin("blobs") == DIST and "blobs" in conformance_names("datasets")
    assert "blobs" not in conformance_names("datasets", builtin_only=True)
    # --check imports every plugin: the one whose module is missing is BROKEN
    r = CliRunner().invoke(app, ["ls", "datasets", "--check"])
    assert r.exit_code == 1
    (broken,) = [ln for ln in r.output.splitlines() if "BROKEN" in ln]
    assert broken.split()[1] == "missing" and "No module named 'dsplug_missing'" in broken


def test_ls_reads_plugin_datasets_without_importing_torch(tmp_path):
    from test_fast_start import probe

    site = tmp_path / "site"
    site.mkdir()
    (site / "dsplug.py").write_text("raise SystemExit('dsplug was imported')\n")
    info = site / "dsplug_dist-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dsplug-dist\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[deqbench.datasets]\nblobs = dsplug:blobs\n")
    env = {"PYTHONPATH": str(site), "DEQBENCH_DISABLE_PLUGIN_AUTOLOAD": "0"}
    rc, loaded, stdout, stderr = probe(tmp_path, "ls", "datasets", env=env)
    assert rc == 0 and loaded == [], (loaded, stderr)
    assert ["datasets", "blobs", DIST] in [ln.split(maxsplit=2) for ln in stdout.splitlines()]


def test_a_plugin_dataset_runs_in_a_suite(plugin, tmp_path):
    import deqbench

    path = _suite(tmp_path, "{name: blobs, dim: 5, n_train: 48, n_test: 16}")
    r = CliRunner().invoke(app, ["validate", str(path)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["run", str(path), "--no-progress", "--no-plots"])
    assert r.exit_code == 0, r.output
    (run,) = (path.parent / "results" / "dsp").iterdir()
    df = deqbench.load_results(run)
    assert len(df) and set(df["status"]) == {"ok"}
    metrics = df[df["analysis"] == "metrics"]
    assert {("accuracy", "test"), ("loss", "train")} <= set(
        zip(metrics["metric"], metrics["variant"])
    )
    assert metrics["value"].notna().all()
    assert "data: {name: blobs, dim: 5" in (run / "suite.yaml").read_text()
    # the loader's signature is the schema: a misspelt key is refused with a close match
    bad = _suite(tmp_path / "bad", "{name: blobs, dimm: 5}")
    r = CliRunner().invoke(app, ["validate", str(bad)])
    assert r.exit_code == 2 and "data.dimm: unknown key (did you mean 'dim'?)" in r.output


def test_a_plugin_dataset_without_a_declared_shape_is_loaded_by_validate(plugin, tmp_path):
    from deqbench.run.plugin_checks import dataset_shape

    assert dataset_shape("blobs_loaded", {"dim": 7}) == (((7,), 3), None)
    assert dataset_shape("blobs", {"dim": 7}) == (((7,), 3), None)  # declared, not loaded
    r = CliRunner().invoke(app, ["validate", str(_suite(tmp_path, "{name: blobs_loaded}"))])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize(
    ("name", "clause", "message"),
    [
        ("missing", "dataset.import", "ModuleNotFoundError: No module named 'dsplug_missing'"),
        ("raising", "dataset.load", "raising() raised RuntimeError: the data server is down"),
        ("as_tuple", "dataset.load", "returned a tuple, not a deqbench.data.base.DataBundle"),
        ("bad_shape", "dataset.declared", "shape(params) returned 'three'"),
    ],
)
def test_validate_names_a_broken_plugin_dataset(plugin, tmp_path, name, clause, message):
    r = CliRunner().invoke(app, ["validate", str(_suite(tmp_path, f"{{name: {name}}}"))])
    assert r.exit_code == 2, r.output
    (line,) = _error_lines(r.output)
    target = ENTRY_POINTS[name]
    assert f"error: plugin {DIST}: dataset '{name}' ({target}): [{clause}]" in line, line
    assert message in line and clause in CLAUSES
    assert "Traceback" not in r.output


def test_an_unknown_dataset_is_one_line_with_close_matches(plugin, tmp_path):
    r = CliRunner().invoke(app, ["validate", str(_suite(tmp_path, "{name: blob}"))])
    assert r.exit_code == 2
    (line,) = _error_lines(r.output)
    assert "data.name: unknown dataset 'blob'; did you mean 'blobs'" in line
    with pytest.raises(ConfigError, match="unknown dataset 'blobz'; did you mean 'blobs'"):
        from deqbench.data.base import load_data

        load_data("blobz")


def test_check_dataset_on_plugin_datasets(plugin):
    from deqbench.data.base import DATASETS, load_data

    check_dataset("blobs", dim=5)
    check_dataset("blobs_loaded")
    assert "blobs" in DATASETS and DATASETS["blobs"].__module__ == "dsplug"
    with pytest.raises(ConformanceError, match=r"\[dataset.load\] returned a tuple"):
        check_dataset("as_tuple")
    with pytest.raises(ConformanceError, match=r"\[dataset.shape\] the declared shape"):
        check_dataset("wrong_shape")
    with pytest.raises(ConformanceError, match=r"\[dataset.declared\]"):
        check_dataset("bad_shape")
    with pytest.raises(ConformanceError, match=r"failed to import dataset 'missing'"):
        check_dataset("missing")
    with pytest.raises(PluginError, match=rf"plugin {DIST}: dataset 'as_tuple': \[dataset.load\]"):
        load_data("as_tuple")


def test_builtin_datasets_declare_their_shapes():
    """Every built-in declares its shape: validate never loads one (deqbench.data)."""
    from deqbench.data.base import declared_shape

    for name in conformance_names("datasets", builtin_only=True):
        fn = datasets.get(name)
        assert callable(getattr(fn, "shape", None)), name
        assert declared_shape(fn, {}) is not None
