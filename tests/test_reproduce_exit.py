"""``deqbench reproduce`` is a run like any other: its exit code says whether every suite ran
to its end, an interrupted command stops (no further suite, the unfinished suites' claims
``not run``, the resume command printed), one writer per ``--out`` folder, and ``--resume``
runs a suite again whose earlier run has errored tasks."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import pytest

from deqbench.reproduce.run import RunOptions, SuiteRun, errored_tasks, reproduce_run, run_one
from deqbench.run.results import ResultsWriter
from tests.test_reproduce import TINY_INIT_COST, done


def _rows(out: Path) -> dict[str, dict[str, str]]:
    with open(out / "reproduction.csv", newline="") as fh:
        return {r["claim_id"]: r for r in csv.DictReader(fh)}


# 001-gp-informed-init (kglm_smooth) and 001-denoise (kglm_denoise) are measured by two suites
CLAIMS = ["001-gp-informed-init", "001-denoise"]


def test_interrupt_stops_the_command_and_marks_the_unfinished_claims(tmp_path):
    started: list[str] = []

    def runner(path: Path, out: Path, data_root: Any, log: Any, options: Any) -> SuiteRun:
        started.append(path.stem)
        return SuiteRun(path, interrupted=143)  # SIGTERM during the first suite

    log = io.StringIO()
    out, code = reproduce_run(claim_ids=CLAIMS, out=tmp_path / "r", runner=runner, log=log)
    assert code == 143
    assert len(started) == 1  # the second suite never started
    rows = _rows(out)
    assert all(r["verdict"] == "not run" for r in rows.values())
    reasons = sorted(r["reason"] for r in rows.values())
    assert any("interrupted (exit 143)" in x for x in reasons), reasons
    assert any("not started" in x for x in reasons), reasons
    assert "Resume with: deqbench reproduce" in log.getvalue() and "--resume" in log.getvalue()


def test_a_keyboard_interrupt_from_the_runner_is_130(tmp_path):
    def runner(*a: Any) -> SuiteRun:
        raise KeyboardInterrupt

    out, code = reproduce_run(claim_ids=CLAIMS[:1], out=tmp_path / "r", runner=runner,
                              log=io.StringIO())  # fmt: skip
    assert code == 130
    assert _rows(out)["001-gp-informed-init"]["verdict"] == "not run"


def test_a_failed_suite_exits_1_and_its_claims_are_not_run(tmp_path):
    def runner(path: Path, *a: Any) -> SuiteRun:
        run_dir = tmp_path / "runs" / path.stem
        run_dir.mkdir(parents=True)
        (run_dir / "results.csv").write_text("x\n")
        return SuiteRun(path, run_dir=run_dir, exit_code=1,
                        errored=["c seed 0 error: ModuleNotFoundError: No module named 'x'"])  # fmt: skip

    out, code = reproduce_run(claim_ids=CLAIMS[:1], out=tmp_path / "r", runner=runner,
                              log=io.StringIO())  # fmt: skip
    assert code == 1
    r = _rows(out)["001-gp-informed-init"]
    assert r["verdict"] == "not run" and r["reason"].startswith("run failed: 1 task(s) errored")


def test_every_suite_complete_exits_0(tmp_path):
    def runner(path: Path, *a: Any) -> SuiteRun:
        return SuiteRun(path, error="")  # ran, wrote nothing: the claim is not run, no failure

    _, code = reproduce_run(claim_ids=["004-pr-fb"], scale="paper",
                            out=tmp_path / "r", runner=runner, log=io.StringIO())  # fmt: skip
    assert code == 0  # no paper-scale suite: nothing ran, nothing failed


def test_one_writer_per_out_folder(tmp_path):
    from deqbench.run.lock import RunLock, RunLocked

    out = tmp_path / "r"
    out.mkdir()
    with RunLock(out):
        with pytest.raises(RunLocked):
            reproduce_run(claim_ids=CLAIMS[:1], out=out, runner=lambda *a: None,
                          log=io.StringIO())  # fmt: skip
    assert not (out / "reproduction.csv").exists()


def test_out_naming_a_file_is_refused(tmp_path):
    from deqbench.core.errors import ConfigError

    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="not a folder"):
        reproduce_run(claim_ids=CLAIMS[:1], out=f, log=io.StringIO())


def test_cli_exit_code_follows_the_suites(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from deqbench.cli import app
    from deqbench.reproduce import run as rrun

    def runner(path: Path, *a: Any) -> SuiteRun:
        return SuiteRun(path, interrupted=130)

    monkeypatch.setattr(rrun, "run_one", runner)
    r = CliRunner().invoke(app, ["reproduce", "--claims", CLAIMS[0], "--out",
                                 str(tmp_path / "r")])  # fmt: skip
    assert r.exit_code == 130, r.output


def _errored_run(out: Path) -> Path:
    run = out / "runs" / "tiny_init_cost" / "20200101-000000"
    run.mkdir(parents=True)
    ResultsWriter(run).append([done("c", 0, status="error", note="ModuleNotFoundError: mlxtend")])
    (run / "run.json").write_text(json.dumps({"status": "complete", "exit_code": 1}))
    return run


def test_errored_tasks_are_found(tmp_path):
    run = _errored_run(tmp_path)
    (task,) = errored_tasks(run)
    assert task.startswith("c seed 0 error: ModuleNotFoundError")


def test_resume_runs_a_suite_with_errored_tasks_again(tmp_path):
    """The earlier run errored (e.g. an extra was missing): --resume must not reuse it."""
    tiny = tmp_path / "tiny_init_cost.yaml"
    tiny.write_text(TINY_INIT_COST)
    out = tmp_path / "r"
    earlier = _errored_run(out)
    log = io.StringIO()
    sr = run_one(tiny, out, None, log, RunOptions(resume=True))
    assert "errored task(s)" in log.getvalue() and "running the suite again" in log.getvalue()
    assert sr.run_dir is not None and sr.run_dir != earlier and sr.complete, sr
