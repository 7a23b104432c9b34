"""results.csv schema 2 (a ``backward`` column after ``solver``; ``results_schema`` in run.json),
loading and comparing schema-1 runs, refusing to resume them, and run.json's task counts."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import TINY_SUITE, write_suite
from typer.testing import CliRunner

from deqbench.cli import app
from deqbench.errors import ConfigError
from deqbench.run.executors.dask import failed_result
from deqbench.run.results import COLUMNS, RESULTS_SCHEMA, RUNNER, compare, load_results
from deqbench.run.runner import InlineExecutor, run_suite
from deqbench.run.suite import load_suite
from deqbench.run.task import Task

MODES = ["ift", "unrolled", "jfb", "phantom"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One tiny run (no training) over the four backward modes and a model without DEQ layers."""
    tmp = tmp_path_factory.mktemp("schema")
    p = write_suite(
        tmp,
        TINY_SUITE,
        replace={
            "backward: [ift, unrolled]": "backward: [ift, unrolled, jfb, phantom]",
            "epochs: 1": "epochs: 0",
            "[metrics, solver_stats]": "[metrics]",
        },
    )
    summary = run_suite(load_suite(p), progress=False, plots=False)
    assert summary.exit_code == 0
    return summary.run_dir


def _schema1(run_dir, dest, suite_yaml=True):
    """A copy of ``run_dir`` as deqbench wrote it before schema 2."""
    shutil.copytree(run_dir, dest)
    lines = (dest / "results.csv").read_text().splitlines()
    i = lines[0].split(",").index("backward")
    # no quoted commas in these rows: a plain split is exact
    old = [",".join(c for j, c in enumerate(line.split(",")) if j != i) for line in lines]
    (dest / "results.csv").write_text("\n".join(old) + "\n")
    meta = json.loads((dest / "run.json").read_text())
    del meta["results_schema"]
    (dest / "run.json").write_text(json.dumps(meta))
    if not suite_yaml:
        (dest / "suite.yaml").unlink()
    return dest


def test_backward_column_after_solver_and_schema_in_run_json(run):
    header = (run / "results.csv").read_text().splitlines()[0].split(",")
    assert header == COLUMNS and header[header.index("solver") + 1] == "backward"
    df = load_results(run)
    by_cell = df.groupby("cell_id").backward.unique()
    # an unrolled cell is named by its K (its forward is K plain steps, not the solver)
    assert {c: list(v) for c, v in by_cell.items()} == {
        (f"fc_deq_tiny-fixed_point-{m}" if m != "unrolled" else "fc_deq_tiny-unrolled5"): [m]
        for m in MODES
    }
    meta = json.loads((run / "run.json").read_text())
    assert meta["results_schema"] == RESULTS_SCHEMA == 2


def test_an_explicit_network_names_no_solver_and_no_backward(tmp_path):
    p = write_suite(
        tmp_path,
        TINY_SUITE,
        replace={
            "backward: [ift, unrolled]": "model: [{name: tied_repeat_tiny, cell: fc, repeats: 2}]",
            "epochs: 1": "epochs: 0",
            "[metrics, solver_stats]": "[metrics]",
        },
    )
    suite = load_suite(p)
    df = load_results(run_suite(suite, progress=False, plots=False).run_dir)
    assert suite.cells[0].id == "tied_repeat_tiny"
    assert set(df.backward) == set(df.solver) == {"none"}


def test_failed_worker_row_has_backward(tmp_path):
    suite = load_suite(write_suite(tmp_path))
    cell = suite.cells[1]
    (row,) = failed_result(Task(suite, cell, 0, "cpu", "r", str(tmp_path)), "worker died").rows
    assert list(row) == COLUMNS and row["backward"] == "unrolled" and row["analysis"] == RUNNER


def test_schema1_run_loads_with_backward_from_suite_yaml_and_compares(run, tmp_path):
    old = _schema1(run, tmp_path / "old")
    df = load_results(old)
    assert list(df.columns) == COLUMNS
    new = load_results(run)
    assert (df.backward == new.backward).all() and set(df.backward) == set(MODES)
    bare = load_results(_schema1(run, tmp_path / "bare", suite_yaml=False))
    # without suite.yaml the mode comes from the cell id's third part (model-solver-MODE-...)
    assert list(bare.columns) == COLUMNS and (bare.backward == new.backward).all()
    summary, joined = compare(df, new)
    assert len(joined) == len(new) and (summary.ratio.dropna() > 0).all()
    r = CliRunner().invoke(app, ["compare", str(old), str(run), "--csv", str(tmp_path / "c.csv")])
    assert r.exit_code == 0, r.output


def test_resume_of_schema1_run_is_refused(run, tmp_path):
    old = _schema1(run, tmp_path / "old")
    before = (old / "results.csv").read_text()
    with pytest.raises(ConfigError, match="results schema 1") as e:
        run_suite(load_suite(old / "suite.yaml"), resume=old, progress=False, plots=False)
    assert "\n" not in str(e.value)
    r = CliRunner().invoke(app, ["run", str(old / "suite.yaml"), "--resume", str(old)])
    assert r.exit_code == 2 and "results schema 1" in r.output
    assert (old / "results.csv").read_text() == before  # untouched


class _StopAfterOne:
    """Runs the first task, then a Ctrl-C."""

    def run(self, tasks, listener=None):
        it = InlineExecutor().run(tasks, listener)
        yield next(it)
        raise KeyboardInterrupt


def test_run_json_counts_planned_and_finished_tasks(run, tmp_path):
    meta = json.loads((run / "run.json").read_text())
    assert meta["tasks_total"] == meta["tasks_finished"] == meta["tasks_ok"] == 4
    assert meta["tasks_flagged"] == meta["tasks_failed"] == 0
    p = write_suite(
        tmp_path,
        TINY_SUITE,
        replace={"seeds: [0]": "seeds: [0, 1]", "epochs: 1": "epochs: 0",
                 "[metrics, solver_stats]": "[metrics]"},
    )  # fmt: skip
    summary = run_suite(load_suite(p), executor=_StopAfterOne(), progress=False, plots=False)
    assert summary.interrupted
    meta = json.loads((summary.run_dir / "run.json").read_text())
    assert meta["status"] == "interrupted"
    assert meta["tasks_total"] == 4 and meta["tasks_finished"] == meta["tasks_ok"] == 1
    assert meta["tasks_failed"] == meta["tasks_flagged"] == 0
