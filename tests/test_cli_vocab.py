"""One CLI vocabulary: --version without torch, one-line errors that name the
option the user wrote (no repeated value, no pydantic internals), help reflowed for 80 columns."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import write_suite
from typer.testing import CliRunner

from deqbench.cli import app


def _err(*args: str) -> str:
    r = CliRunner().invoke(app, list(args))
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1, r.output
    return lines[0]


def test_version_without_importing_torch():
    code = (
        "import sys; sys.argv = ['deqbench', '--version']\n"
        "from deqbench.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    # the normal exit: the assertion after main() runs only without deqbench's os._exit
    env = {**os.environ, "DEQBENCH_SLOW_EXIT": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith("deqbench ")
    assert "torch imported" not in out.stderr


def test_bad_device_names_the_value_once(tmp_path):
    line = _err("run", str(write_suite(tmp_path)), "--device", "gpu")
    assert line.startswith("error: --device gpu: ")
    assert line.count("'gpu'") == 1 and "Value error" not in line


@pytest.mark.parametrize(
    ("args", "start"),
    [
        (["landscape", "--grid", "4"], "error: --grid 4: grid must be odd"),
        (["landscape", "--split", "val"], "error: --split val: "),
        (["ntk", "--output", "foo"], "error: --output foo: expected "),
        (["landscape", "--model", "fc_dq"], "error: --model fc_dq: unknown model 'fc_dq'"),
    ],
)
def test_option_errors_name_the_option(args, start):
    line = _err(*args, "--device", "cpu")
    assert line.startswith(start), line
    for internal in ("analyses[", "Value error", "literal[", ".int:"):
        assert internal not in line, line


def test_unknown_name_message_has_no_stray_semicolon(monkeypatch):
    from deqbench.core.registry import solvers

    msg = str(solvers.unknown("relaxed_picard"))
    assert "; (see" not in msg and msg.endswith("(see `deqbench ls solvers`)")
    assert "did you mean" not in msg or "; did you mean" in msg


def test_help_is_reflowed_at_80_columns():
    env = {**os.environ, "COLUMNS": "80", "TERM": "dumb"}
    out = subprocess.run(
        [sys.executable, "-m", "deqbench", "run", "--help"], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0
    text = out.stdout
    assert "``" not in text
    # the paragraph is reflowed: no line ends after a single word of a sentence
    body = [ln.strip() for ln in text.splitlines() if "collection file" in ln or "another," in ln]
    assert body and all(len(ln) > 30 for ln in body), body


def test_single_model_commands_print_their_headline(tmp_path):
    r = CliRunner().invoke(
        app,
        ["landscape", "--model", "fc_deq_tiny", "--epochs", "1", "--grid", "3", "--dims", "1",
         "--max-samples", "32", "--train-subset", "64", "--device", "cpu", "--no-progress",
         "--out", str(tmp_path)],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    line = next(ln for ln in r.output.splitlines() if ln.startswith("landscape fc_deq_tiny"))
    assert "centre loss" in line and "points converged" in line


def _rows(*rows):
    import pandas as pd

    return pd.DataFrame(
        [{"metric": m, "variant": v, "value": x, "repeat": 0, "status": st} for m, v, x, st in rows]
    )


def test_hessian_headline_names_the_backend_and_the_fallback():
    from deqbench.hessian.analysis import Hessian

    ok = _rows(("top_eigenvalue", "autograd", 17.1, "ok"), ("trace", "autograd", 97.2, "ok"),
               ("fd_fallback", "autograd", 0.0, "ok"), ("gate_ok", "autograd", 1.0, "ok"))  # fmt: skip
    (line,) = Hessian.headline(ok)
    assert "top eigenvalue 17.1" in line and "trace 97.2" in line and "by autograd" in line
    assert "gates passed" in line and "flagged" not in line
    fb = _rows(("top_eigenvalue", "fd", 3.0, "flagged"), ("fd_fallback", "fd", 1.0, "flagged"),
               ("gate_ok", "autograd", 0.0, "flagged"))  # fmt: skip
    (line,) = Hessian.headline(fb)
    assert "finite differences (fallback)" in line and "GATES FAILED" in line and "flagged" in line


def test_ntk_headline_says_when_no_decay_is_guaranteed():
    from deqbench.ntk.analysis import NTK

    base = [("lambda_min_init", "summary", 1e-3, "ok"), ("lambda_min_final", "summary", 5e-3, "ok"),
            ("log_loss_slope_fit", "summary", -0.02, "ok")]  # fmt: skip
    (line,) = NTK.headline(_rows(*base, ("pred_log_loss_slope_mean", "summary", 0.4, "ok")))
    assert "guarantees no decay" in line and "0.001" in line and "0.005" in line
    (line,) = NTK.headline(_rows(*base, ("pred_log_loss_slope_mean", "summary", -0.01, "ok")))
    assert "matched the guarantee" in line
    (line,) = NTK.headline(_rows(*base, ("pred_log_loss_slope_mean", "summary", -0.05, "ok")))
    assert "did not match" in line
