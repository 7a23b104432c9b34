"""Trustworthy results by default: model-declared defaults fill what a suite leaves
unset, and a measurement whose own solves missed tolerance is ``flagged`` (never ``ok``), in
results.csv, the runner row, run.json, the summary and the exit code; warm-up out of wall_time."""

from __future__ import annotations

import json

from conftest import write_suite
from typer.testing import CliRunner

import deqbench
from deqbench.cli import app
from deqbench.run.suite import suite_from_dict


def _raw(defaults: dict, matrix: dict | None = None) -> dict:
    raw = {
        "schema": 1,
        "name": "t",
        "device": "cpu",
        "data": {"name": "digits", "train_subset": 64, "test_subset": 32},
        "defaults": defaults,
        "analyses": ["metrics"],
    }
    if matrix:
        raw["matrix"] = matrix
    return raw


# -- model-declared defaults -----------------------------------------------------------------


def test_unset_fields_come_from_the_models_declaration():
    decl = deqbench.models.defaults("fc_deq_tiny")
    assert decl["backward"]["solver"] != "fixed_point"  # rho(J) can exceed 1 for fc_deq
    (cell,) = suite_from_dict(_raw({"model": "fc_deq_tiny"})).cells
    for k, v in decl["solver"].items():
        assert cell.solver[k] == v, k
    for k, v in decl["backward"].items():
        assert cell.backward[k] == v, k
    assert cell.id.startswith(f"fc_deq_tiny-{decl['solver']['name']}-ift")
    assert cell.init == decl["init"]
    # monDEQ declares its splitting solver: the cell id and the adjoint say so
    (mon,) = suite_from_dict(_raw({"model": "mondeq_fc_tiny"})).cells
    assert (
        mon.solver["name"] == "peaceman_rachford" and mon.backward["solver"] == "peaceman_rachford"
    )
    assert mon.id.startswith("mondeq_fc_tiny-peaceman_rachford-ift")


def test_suite_values_win_and_another_solver_keeps_only_generic_fields():
    s = suite_from_dict(
        _raw(
            {"model": "conv_deq_tiny", "backward": {"tol": 1e-3}},
            {"solver": ["fixed_point", {"name": "anderson", "max_iter": 7}]},
        )
    )
    fp, an = s.cells
    decl = deqbench.models.defaults("conv_deq_tiny")["solver"]
    assert decl["name"] == "anderson"
    # another solver than the declared one: generic fields carry over, anderson's `m` does not
    assert fp.solver["name"] == "fixed_point" and "m" not in fp.solver
    assert fp.solver["max_iter"] == decl["max_iter"] and fp.solver["tol"] == decl["tol"]
    # the declared solver: its options carry over, the suite's max_iter wins
    assert an.solver["max_iter"] == 7 and an.solver["m"] == decl["m"]
    # the suite's backward tol wins; the declared adjoint solver fills the rest
    assert fp.backward["tol"] == 1e-3 and fp.backward["solver"] == "anderson"


def test_python_api_create_applies_declared_defaults():
    m = deqbench.models.create("mondeq_fc_tiny", in_shape=(64,), num_outputs=10)
    assert m.deq.solver_cfg.name == "peaceman_rachford"
    assert m.deq.backward_cfg.solver == "peaceman_rachford"


def test_a_plugin_factory_declares_defaults_the_same_way():
    from deqbench.models.fc import fc_deq_tiny

    @deqbench.models.declare_defaults(
        solver={"name": "broyden", "max_iter": 77, "tol": 1e-5}, backward="jfb"
    )
    def my_model(in_shape=(64,), num_outputs=10):
        return fc_deq_tiny(in_shape, num_outputs)

    deqbench.models.add("my_model_t13", my_model)
    try:
        (cell,) = suite_from_dict(_raw({"model": "my_model_t13"})).cells
        assert cell.solver["name"] == "broyden" and cell.solver["max_iter"] == 77
        assert cell.backward["name"] == "jfb"
        assert cell.id == "my_model_t13-broyden-jfb"
    finally:
        deqbench.models.remove("my_model_t13")


def test_every_registered_model_declares_defaults_that_validate():
    for name in deqbench.models.names():
        if name.startswith("tied_repeat"):  # an explicit net: nothing to solve
            continue
        decl = deqbench.models.defaults(name)
        assert {"solver", "backward"} <= set(decl), name
        suite_from_dict(_raw({"model": name}))  # the schema accepts the declaration


# -- status `flagged` ------------------------------------------------------------------------

STARVED = """\
schema: 1
name: starved
device: cpu
threads: 1
seeds: [0]
data: {name: digits, train_subset: 64, test_subset: 32}
defaults:
  model: {name: conv_deq_tiny, channels: 8, inner: 8}
  train: {epochs: 1, batch_size: 32}
analyses: [metrics, solver_stats]
output: results
"""


def _run(tmp_path, **replace):
    tmp_path.mkdir(parents=True, exist_ok=True)
    p = write_suite(tmp_path, STARVED, replace=replace)
    r = CliRunner().invoke(app, ["run", str(p), "--no-progress", "--no-plots"])
    run_dir = next((tmp_path / "results" / "starved").iterdir())
    return r, run_dir, deqbench.load_results(run_dir)


def test_converged_defaults_give_ok_and_exit_0(tmp_path):
    r, run_dir, df = _run(tmp_path)
    assert r.exit_code == 0, r.output
    runner = df[df.analysis == "runner"]
    assert list(runner.status) == ["ok"]
    conv = df[df.analysis == "convergence"].set_index(["metric", "variant"])
    # training, evaluation and probe solves all converged (init: at max_iter, reported only)
    for phase in ("train", "eval", "probe"):
        assert conv.loc[("forward_unconverged_batches", phase), "value"] == 0
    assert conv.loc[("adjoint_unconverged_batches", "train"), "value"] == 0
    assert "1 ok" in r.output


def test_unconverged_forward_is_flagged_and_exits_1(tmp_path):
    r, run_dir, df = _run(
        tmp_path,
        **{"  train:": "  solver: {name: fixed_point, max_iter: 2, tol: 1.0e-6}\n  train:"},
    )
    assert r.exit_code == 1, r.output
    runner = df[df.analysis == "runner"].iloc[0]
    assert runner.status == "flagged"
    assert "forward solve missed rel tol 1e-06 in 2 of 2 training batches" in runner.note
    assert "Raise solver.max_iter (all 2 steps used" in runner.note
    assert runner.note.count("Raise solver.max_iter") == 1  # one fix per kind of solve
    row = df[(df.analysis == "convergence") & (df.metric == "forward_unconverged_batches")
             & (df.variant == "train")]  # fmt: skip
    assert row.status.item() == "flagged" and row.value.item() == 1.0
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["tasks_flagged"] == 1 and meta["tasks_failed"] == 0 and meta["exit_code"] == 1
    assert "flagged" in r.output and "1 flagged" in r.output


def test_unconverged_adjoint_is_flagged(tmp_path):
    r, _, df = _run(
        tmp_path,
        **{"  train:": "  backward: {name: ift, solver: fixed_point, max_iter: 2, tol: 1.0e-8}\n"
           "  train:"},
    )  # fmt: skip
    assert r.exit_code == 1, r.output
    runner = df[df.analysis == "runner"].iloc[0]
    assert runner.status == "flagged" and "adjoint solve missed rel tol 1e-08" in runner.note
    assert "Raise backward.max_iter" in runner.note
    fwd = df[(df.analysis == "convergence") & (df.metric == "forward_unconverged_batches")
             & (df.variant == "train")]  # fmt: skip
    assert fwd.status.item() == "ok"


def test_unrolled_forward_is_not_a_solve_and_not_flagged(tmp_path):
    r, _, df = _run(
        tmp_path,
        **{"  train:": "  backward: {name: unrolled, k: 2}\n  train:"},
    )
    assert r.exit_code == 0, r.output
    assert df[df.analysis == "convergence"].empty


def test_compare_keeps_flagged_rows(tmp_path):
    from deqbench.run.results import compare

    _, _, ok = _run(tmp_path / "a")
    _, _, bad = _run(
        tmp_path / "b", **{"  train:": "  solver: {max_iter: 2, tol: 1.0e-6}\n  train:"}
    )  # the same cell id (the declared solver), starved
    summary, joined = compare(ok, bad)
    row = summary[(summary.analysis == "runner") & (summary.metric == "wall_time")]
    assert row.n.item() == 1 and row.flagged.item() == 1
    assert set(joined.status_b) >= {"flagged"}


def test_warm_up_is_recorded_once_per_process_and_out_of_wall_time(tmp_path, monkeypatch):
    from deqbench.run import task as task_mod

    monkeypatch.setattr(task_mod, "_WARMUP", {})
    monkeypatch.setattr(task_mod, "_DATA_CACHE", {})
    p = write_suite(tmp_path, STARVED, replace={"seeds: [0]": "seeds: [0, 1]"})
    suite = deqbench.load_suite(p)
    summary = deqbench.run_suite(suite, progress=False, plots=False)
    df = deqbench.load_results(summary.run_dir)
    proc = df[df.analysis == "process"]
    assert sorted(proc.metric) == ["data_load_time", "warmup_time"]
    assert set(proc.seed) == {0}  # the first task of the process only
    assert (proc.value > 0).all()


def test_an_analysis_that_failed_outright_is_never_ok(tmp_path):
    """An analysis row with status error (e.g. an exception or OOM inside the NTK) leaves the
    trained cell's measurement missing: the cell is flagged, the run exits 1."""
    from deqbench.analyses.base import Analysis, Row
    from deqbench.core.registry import analyses

    class Broken(Analysis):
        name = "broken_t13"

        def after_training(self, ctx):
            yield Row("lambda_min", float("nan"), status="error", note="RuntimeError: boom")

    analyses.add("broken_t13", Broken)
    try:
        r, _, df = _run(tmp_path, **{"analyses: [metrics, solver_stats]": "analyses: [broken_t13]"})
    finally:
        analyses.remove("broken_t13")
    assert r.exit_code == 1, r.output
    runner = df[df.analysis == "runner"].iloc[0]
    assert runner.status == "flagged"
    assert "broken_t13: lambda_min not measured (error: RuntimeError: boom)" in runner.note
