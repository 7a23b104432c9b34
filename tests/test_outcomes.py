"""``summary.csv`` of a run directory: the verdicts of the paper claims its suite measures
(:mod:`deqbench.outcomes`), on tiny run directories written the way the runner writes them."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from deqbench.outcomes import base_suite, claims_for, run_scale, suite_name, summarize
from deqbench.reproduce.run import REPORT_COLUMNS
from deqbench.run.results import ResultsWriter

SEEDS = (0, 1, 2)
PCDEQ_CLAIMS = ["002-mnist-accuracy", "002-iterations", "002-lipschitz", "002-unconstrained",
                "002-any-norm-convergence", "002-backward-iterations"]  # fmt: skip


def row(cell: str, seed: int, analysis: str, metric: str, value: float, **kw: Any) -> dict:
    base = {"run_id": "r", "cell_id": cell, "model": "", "solver": "", "backward": "",
            "init": "", "seed": seed, "analysis": analysis, "variant": "", "metric": metric,
            "step": None, "repeat": None, "value": value, "unit": "", "status": "ok",
            "note": ""}  # fmt: skip
    base.update(kw)
    return base


def write_run(
    root: Path,
    rows: list[dict],
    suite: dict[str, Any],
    meta: dict[str, Any] | None = None,
) -> Path:
    """``root/<suite>/<run_id>`` with results.csv, suite.yaml and (unless None) run.json."""
    run = root / str(suite.get("name", "x")) / "20250101-000000"
    run.mkdir(parents=True)
    ResultsWriter(run).append(rows)
    (run / "suite.yaml").write_text(yaml.safe_dump(suite))
    if meta is not None:
        (run / "run.json").write_text(json.dumps(meta))
    return run


def pcdeq_rows(steps_per_epoch: int = 12_510) -> list[dict]:
    """Two pcDEQ cells whose iterations stay flat, one unconstrained control whose iterations
    grow; sigma_max of tanh above 1, of relu6 below; 3 seeds. Epochs 1-3 of
    ``steps_per_epoch`` optimizer steps each (default: 37,530, the paper's budget of 37,520)."""
    rows = []
    cells = (("pcdeq_l-activation=tanh", 1), ("pcdeq_l-activation=relu6", 1),
             ("pcdeq_l-activation=tanh-nonneg=false", 0))  # fmt: skip
    for cell, nonneg in cells:
        for s in SEEDS:
            rows.append(row(cell, s, "family_stats", "nonneg_constraint", nonneg,
                            model="pcdeq_l", step=0))  # fmt: skip
            for e in range(4):
                it = 5.0 + (4 * e if not nonneg else 0)
                sig = 0.5 if "relu6" in cell else 1.5
                rows += [
                    row(cell, s, "family_stats", "forward_nstep", it, step=e, model="pcdeq_l"),
                    row(cell, s, "family_stats", "sigma_max", sig, variant="layer0", step=e,
                        model="pcdeq_l"),
                    row(cell, s, "family_stats", "test_accuracy", 0.9 + e / 100, step=e,
                        model="pcdeq_l"),
                ]  # fmt: skip
                if e:
                    rows.append(row(cell, s, "family_stats", "steps", steps_per_epoch, step=e,
                                    model="pcdeq_l"))  # fmt: skip
            rows.append(row(cell, s, "runner", "wall_time", 1.0, model="pcdeq_l"))
    return rows


def read_summary(run: Path) -> list[dict[str, str]]:
    with open(run / "summary.csv", newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def test_pcdeq_run_writes_the_claim_verdicts(tmp_path):
    meta = {"suite": "pcdeq_cpu", "suite_source": "suites/repro/pcdeq_cpu.yaml", "device": "cpu"}
    run = write_run(tmp_path, pcdeq_rows(), {"name": "pcdeq_cpu", "data": {"name": "mnist5k"}},
                    meta)  # fmt: skip
    out = summarize(run)
    assert list(out.columns) == list(REPORT_COLUMNS)
    rows = read_summary(run)
    assert list(rows[0]) == list(REPORT_COLUMNS)
    got = {r["claim_id"]: r for r in rows}
    assert list(got) == PCDEQ_CLAIMS  # 002-lipschitz too: its suite's CPU file is the pcDEQ run
    assert {r["scale"] for r in rows} == {"cpu"}
    assert {r["run_dir"] for r in rows} == {run.name}
    assert {r["paper"] for r in rows} == {"002"}
    # generated from the run's suite.yaml, not written by hand
    assert got["002-iterations"]["data"].startswith("mnist5k (5,000 real 28x28 MNIST digits")
    assert "stand-in for MNIST" in got["002-iterations"]["data"]
    # the paper's direction: pcDEQ iterations do not grow, the unconstrained control's do
    assert got["002-iterations"]["verdict"] == "reproduced", got["002-iterations"]["reason"]
    assert got["002-unconstrained"]["verdict"] == "reproduced"
    # an absolute claim is not judged at CPU scale; a trend with activations missing is not run
    assert got["002-mnist-accuracy"]["verdict"] == "not run"
    assert "scale" in got["002-mnist-accuracy"]["reason"]
    assert got["002-lipschitz"]["verdict"] == "not run"
    assert "softsign" in got["002-lipschitz"]["reason"]
    # sigma_max 1.5 without failure counts: the converged share is not known, so not run (data)
    assert got["002-any-norm-convergence"]["verdict"] == "not run"
    assert got["002-any-norm-convergence"]["reason"].startswith("data: the converged share")
    assert got["002-any-norm-convergence"]["window"] == "none"
    assert all(r["paper_value"] and r["claim"] and r["where"] for r in rows)
    assert sorted(p.name for p in run.iterdir() if "summary" in p.name) == ["summary.csv"]


def test_below_the_papers_step_budget_a_trend_is_not_run(tmp_path):
    """3,000 optimizer steps against the paper's 37,520: the training-dynamics claims are not
    run whatever their direction, the direction and both step counts shown; a run shorter than
    two of the paper's epochs shows no direction and says why."""
    short = write_run(tmp_path / "short", pcdeq_rows(steps_per_epoch=100),
                      {"name": "pcdeq_cpu", "data": {"name": "mnist5k"}}, {"suite": "pcdeq_cpu"})  # fmt: skip
    summarize(short)
    r = {r["claim_id"]: r for r in read_summary(short)}["002-iterations"]
    assert r["verdict"] == "not run" and r["direction"] == "", r
    assert "fewer than two of the paper's epochs (938 steps)" in r["reason"], r["reason"]
    run = write_run(tmp_path, pcdeq_rows(steps_per_epoch=1000), {"name": "pcdeq_cpu",
                    "data": {"name": "mnist5k"}}, {"suite": "pcdeq_cpu"})  # fmt: skip
    summarize(run)
    got = {r["claim_id"]: r for r in read_summary(run)}
    for cid in ("002-iterations", "002-unconstrained"):
        r = got[cid]
        assert r["verdict"] == "not run", r
        assert r["reason"].startswith("scale: 3000 of 37520 paper steps"), r["reason"]
        assert r["direction"] == "with the paper" and "measured direction" in r["reason"]
        assert r["steps"] == "3000 of 37520" and r["window"] == "training"


def test_a_flat_control_is_not_reproduced(tmp_path):
    """The verdicts follow the measurements: an unconstrained control that does not slow down
    contradicts 002-unconstrained."""
    rows = [
        r
        for r in pcdeq_rows()
        if not (r["cell_id"].endswith("nonneg=false") and r["metric"] == "forward_nstep")
    ]
    for s in SEEDS:
        rows += [row("pcdeq_l-activation=tanh-nonneg=false", s, "family_stats", "forward_nstep",
                     5.0, step=e, model="pcdeq_l") for e in range(4)]  # fmt: skip
    run = write_run(tmp_path, rows, {"name": "pcdeq", "data": {"name": "mnist5k"}})
    summarize(run)
    got = {r["claim_id"]: r["verdict"] for r in read_summary(run)}
    assert got["002-unconstrained"] == "not reproduced"
    assert got["002-iterations"] == "reproduced"


def test_suite_without_claims_writes_no_summary(tmp_path):
    run = write_run(tmp_path, pcdeq_rows(), {"name": "smoke"}, {"suite": "smoke"})
    out = summarize(run)
    assert out.empty and list(out.columns) == list(REPORT_COLUMNS)
    assert not (run / "summary.csv").exists()
    assert not any(p.name.startswith(".summary") for p in run.iterdir())


def test_claims_without_measurements_are_not_run(tmp_path):
    """An opteq run that wrote no unroll_compare rows: every 003 claim appears, not run."""
    run = write_run(tmp_path, [row("c", 0, "runner", "wall_time", 1.0)], {"name": "opteq"},
                    {"suite": "opteq"})  # fmt: skip
    summarize(run)
    rows = read_summary(run)
    assert [r["claim_id"] for r in rows] == [
        "003-residual-vs-k", "003-accuracy-vs-k", "003-unrolled-speed", "003-ift-memory",
        "003-ift-threshold", "003-unrolled-vs-ift-accuracy"]  # fmt: skip
    assert {r["verdict"] for r in rows} == {"not run"}
    assert all(r["reason"] for r in rows)


def test_paper_scale_suite_and_name_from_suite_yaml(tmp_path):
    """No run.json: the name comes from suite.yaml; a ``_gpu`` suite is judged at paper scale,
    so the absolute claim is not refused for its scale."""
    run = write_run(tmp_path, pcdeq_rows(), {"name": "pcdeq_gpu", "data": {"name": "mnist5k"}})
    assert suite_name(run) == "pcdeq_gpu"
    out = summarize(run, write=False).set_index("claim_id")
    assert not (run / "summary.csv").exists()
    assert list(out.index) == PCDEQ_CLAIMS
    assert set(out["scale"]) == {"paper"}
    assert out.loc["002-mnist-accuracy", "reason"] != "scale"
    forced = summarize(run, write=False, scale="cpu").set_index("claim_id")
    assert forced.loc["002-mnist-accuracy", "reason"] == "scale"
    with pytest.raises(ValueError, match="scale"):
        summarize(run, scale="gpu")


@pytest.mark.parametrize(
    ("name", "base"),
    [("pcdeq", "pcdeq"), ("pcdeq_cpu", "pcdeq"), ("pcdeq_gpu", "pcdeq"), ("pcdeq_paper", "pcdeq"),
     ("paper_pcdeq", "pcdeq"), ("repro_opteq_cpu", "opteq"), ("kglm_pcdeq_sigma",
     "kglm_pcdeq_sigma"), ("_cpu", "_cpu")],
)  # fmt: skip
def test_base_suite(name, base):
    assert base_suite(name) == base


def test_claims_for_and_run_scale():
    assert [c.id for c in claims_for("pcdeq")] == PCDEQ_CLAIMS
    assert [c.id for c in claims_for("kglm_pcdeq_sigma")] == ["002-lipschitz"]
    assert [c.id for c in claims_for("mondeq_gpu")] == ["004-pr-fb"]
    assert [c.id for c in claims_for("trajectory_cpu")] == [
        "004-trajectory-init", "004-trajectory-init-var", "004-trajectory-separation",
        "004-trajectory-separation-var", "004-trajectory-complexity",
        "004-trajectory-complexity-var"]  # fmt: skip
    assert [c.id for c in claims_for("kglm_smooth_cpu")] == [
        "001-gp-informed-init", "001-gp-naive-init"]  # fmt: skip
    assert claims_for("kglm") == [] and claims_for("smoke") == []
    assert run_scale("pcdeq") == "cpu" and run_scale("pcdeq_cpu") == "cpu"
    assert run_scale("pcdeq_gpu") == "paper" and run_scale("pcdeq_paper") == "paper"
    assert run_scale("pcdeq", "suites/paper/pcdeq.yaml") == "paper"
    assert run_scale("pcdeq", "suites/pcdeq.yaml") == "cpu"


def test_no_claim_imports_no_extractor(tmp_path):
    """After every run: a suite that no claim uses costs no extractor import."""
    run = write_run(tmp_path, [row("c", 0, "runner", "wall_time", 1.0)], {"name": "smoke"})
    code = (
        "import sys; from deqbench.outcomes import summarize; "
        f"summarize({str(run)!r}); print('deqbench.reproduce.extract' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
