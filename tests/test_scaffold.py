"""`deqbench new-plugin NAME`: the package it writes passes its own test (validate and a
one-cell suite) once installed; here 'installed' = its sources and a dist-info built from its
pyproject.toml on PYTHONPATH (CI installs it with pip, see noxfile.py)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tomllib

import pytest
from typer.testing import CliRunner

from deqbench.cli import app


@pytest.mark.slow  # several seconds on 2 cores: out of the fast lane
def test_new_plugin_passes_its_own_test(tmp_path):
    r = CliRunner().invoke(app, ["new-plugin", "deqbench-tinydeq", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert "model tinydeq_deq, solver tinydeq_picard" in r.output
    root = tmp_path / "deqbench-tinydeq"
    # the printed next steps install the test extra (pytest) and run the venv's own pytest
    extra, pkg = shlex.quote(f"{root}[test]"), shlex.quote(str(root))
    assert f"next: pip install -e {extra} && python -m pytest {pkg}" in r.output
    proj = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert proj["optional-dependencies"]["test"] == ["pytest"]
    readme = (root / "README.md").read_text()
    assert "pip install -e '.[test]'" in readme and "python -m pytest" in readme
    assert proj["entry-points"]["deqbench.models"] == {
        "tinydeq_deq": "deqbench_tinydeq.models:tinydeq_deq"
    }
    site = tmp_path / "site"
    info = site / f"deqbench_tinydeq-{proj['version']}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {proj['name']}\nVersion: {proj['version']}\n"
    )
    lines = []
    for group, eps in proj["entry-points"].items():
        lines += [f"[{group}]", *[f"{k} = {v}" for k, v in eps.items()], ""]
    (info / "entry_points.txt").write_text("\n".join(lines))
    env = {k: v for k, v in os.environ.items() if k != "DEQBENCH_DISABLE_PLUGIN_AUTOLOAD"}
    env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), str(site)])
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(root)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "5 passed" in out.stdout


def test_new_plugin_refuses_bad_names_and_non_empty_folders(tmp_path):
    r = CliRunner().invoke(app, ["new-plugin", "1bad name", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "not a distribution name" in r.output
    (tmp_path / "deqbench-x" / "keep").mkdir(parents=True)
    r = CliRunner().invoke(app, ["new-plugin", "deqbench-x", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "exists and is not empty" in r.output
    r = CliRunner().invoke(app, ["new-plugin", "--help"])
    assert r.exit_code == 0 and "Example: deqbench new-plugin" in r.output
    help_text = " ".join(r.output.split())  # rich wraps the help
    assert "pip install -e 'deqbench-mydeq[test]' && python -m pytest deqbench-mydeq" in help_text
    assert "pip install -e 'NAME[test]'" in help_text and "python -m pytest NAME" in help_text
