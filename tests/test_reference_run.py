"""What is committed is what the code makes: a fresh run of suites/smoke.yaml must reproduce the
committed plots/smoke (the same tasks, every status, counts, accuracies and residuals within the
tolerances of :mod:`deqbench.run.reference`), and no two of its cells are one computation under
two names. A change of behaviour fails here until `nox -s figures -- smoke` regenerates it."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

import deqbench
from deqbench.run.reference import check_against_reference

#: every test here reads one fresh run of the whole smoke suite: about 25 s on 2 cores
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "plots" / "smoke"


@pytest.fixture(scope="module")
def fresh_smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke")
    suite = deqbench.load_suite(ROOT / "suites" / "smoke.yaml")
    deqbench.run_suite(suite, out=out, progress=False, plots=False)
    (run,) = (out / "smoke").iterdir()
    return run


def test_the_committed_smoke_run_comes_from_a_clean_tree_and_says_its_commit():
    meta = json.loads((REFERENCE / "run.json").read_text())
    git = meta["git"]
    assert len(git["commit"]) == 40 and git["dirty"] is False, git


def test_a_fresh_smoke_run_reproduces_the_committed_one(fresh_smoke):
    problems = check_against_reference(REFERENCE, fresh_smoke)
    assert not problems, (
        "the smoke run no longer matches plots/smoke (regenerate it with "
        "`nox -s figures -- smoke` and commit it with the change):\n" + "\n".join(problems)
    )


def test_no_two_smoke_cells_are_one_computation(fresh_smoke):
    df = deqbench.load_results(fresh_smoke)
    loss = df[(df.analysis == "metrics") & (df.metric == "loss") & (df.variant == "train")]
    curves = {
        cell: tuple(g.sort_values(["seed", "step"]).value.round(12))
        for cell, g in loss[loss.step >= 1].groupby("cell_id")
    }
    assert len(curves) == df.cell_id.nunique()
    same = [(a, b) for a, b in itertools.combinations(curves, 2) if curves[a] == curves[b]]
    assert not same, same


def test_every_smoke_cell_is_ok_converged_and_learns(fresh_smoke):
    df = deqbench.load_results(fresh_smoke)
    runner = df[df.analysis == "runner"]
    assert set(runner.status) == {"ok"}, runner[runner.status != "ok"][["cell_id", "note"]]
    conv = df[df.analysis == "convergence"]
    late = conv[conv.variant.isin(["train", "eval"])]
    assert (late.value <= 0.01).all(), late[late.value > 0.01]
    acc = df[(df.analysis == "metrics") & (df.metric == "accuracy") & (df.variant == "test")]
    final = acc[acc.step == acc.groupby(["cell_id", "seed"]).step.transform("max")]
    assert (final.value >= 0.2).all(), final[final.value < 0.2][["cell_id", "seed", "value"]]


def test_smoke_suite_writes_every_declared_row(fresh_smoke):
    """The whole smoke suite (about a minute on 2 cores): every (cell, seed) ok, and every cell has
    the rows its analyses declare for every seed."""
    df = deqbench.load_results(fresh_smoke)
    assert (df[df.analysis == "runner"].status == "ok").sum() == 40
    metrics = {("metrics", v, m) for v in ("train", "test") for m in ("loss", "accuracy")}
    solver = {
        ("solver_stats", v, m)
        for v in ("train", "test")
        for m in (
            "forward_nstep",
            "forward_rel_residual",
            "forward_converged",
        )
    }
    final = {
        ("solver_stats", "final_test", m)
        for m in ("forward_nstep", "forward_nstep_max", "forward_rel_residual")
    }
    cells = {c.id: c for c in deqbench.load_suite(ROOT / "suites" / "smoke.yaml").cells}
    for (cell, seed), g in df.groupby(["cell_id", "seed"]):
        got = set(zip(g.analysis, g.variant, g.metric, g.step.fillna(-1)))
        epochs = range(1, int(cells[cell].train["epochs"]) + 1)
        per_epoch = metrics | solver
        if cells[cell].data["name"] == "denoise":  # regression (kglm_conv_deq_tiny): mse
            per_epoch = {("metrics", v, m) for v in ("train", "test") for m in ("loss", "mse")}
            per_epoch |= solver
        if cell.startswith("tied_repeat"):  # explicit network: metrics only, solver_stats skipped
            for epoch in (0, *epochs):
                assert {(*k, epoch) for k in per_epoch if k[0] == "metrics"} <= got
            assert (g[g.analysis == "solver_stats"].status == "skipped").all()
            continue
        if "unrolled" in cell:  # K plain steps: no solve to converge, no adjoint
            per_epoch = {k for k in per_epoch if k[2] != "forward_converged"}
        for epoch in (0, *epochs):
            assert {(*k, epoch) for k in per_epoch} <= got, (cell, seed, epoch)
        assert {(*k, -1) for k in final} <= got, (cell, seed)
        assert {("solver_stats", "train", "forward_abs_residual", e) for e in epochs} <= got
        if "-ift" in cell:
            assert {("solver_stats", "train", "backward_nstep", e) for e in epochs} <= got
