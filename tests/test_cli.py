"""The deqbench command line: help, exit codes, one-line errors, ls/info/validate/run/plot/compare."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from conftest import TINY_SUITE, write_suite
from typer.testing import CliRunner

from deqbench.cli import app

ROOT = Path(__file__).resolve().parents[1]

COMMANDS = ["run", "validate", "ls", "info", "plot", "compare"]


def invoke(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_help_does_not_import_torch():
    code = (
        "import sys; from typer.testing import CliRunner; from deqbench.cli import app; "
        "r = CliRunner().invoke(app, ['--help']); assert r.exit_code == 0, r.output; "
        "assert 'torch' not in sys.modules, 'torch imported'; print(r.output)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    for cmd in COMMANDS:
        assert re.search(rf"^\W*{cmd}\s", out.stdout, re.M), cmd
    out = subprocess.run(
        [sys.executable, "-m", "deqbench", "--help"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and "Usage" in out.stdout and "Example" in out.stdout


@pytest.mark.parametrize("cmd", COMMANDS)
def test_every_command_help_has_an_example(cmd):
    r = invoke(cmd, "--help")
    assert r.exit_code == 0 and "Example: deqbench " + cmd in r.output


@pytest.mark.parametrize(
    ("old", "new", "where"),
    [
        ("seeds: [0]", "seeds: [0]\nbogus: 1", ":6:1: bogus: unknown key"),
        (
            "epochs: 1",
            "epochs: [1]",
            ":11:19: defaults.train.epochs: Input should be a valid integer",
        ),
        (
            "fc_deq_tiny, width",
            "fc_dq_tiny, width",
            ":8:17: defaults.model.name: unknown model 'fc_dq_tiny'",
        ),
        (
            "{name: fixed_point, max",
            "{name: fixd_point, max",
            ":9:18: defaults.solver.name: unknown solver",
        ),
        ("  train:", "  init: nrmal\n  train:", ":11:9: defaults.init.name: unknown init 'nrmal'"),
        (
            "[metrics, solver_stats]",
            "[metrics, solverstats]",
            ":14:21: analyses[1]: unknown analysis",
        ),
        ("backward: [ift, unrolled]", "backward: []", ":13:13: matrix.backward: empty list"),
        ("seeds: [0]", "seeds: [0", ": invalid YAML:"),
    ],
)
def test_bad_suites_exit_2_with_one_line_and_no_run_dir(tmp_path, old, new, where):
    p = write_suite(tmp_path, TINY_SUITE, replace={old: new})
    for cmd in ("run", "validate"):
        r = invoke(cmd, p)
        assert r.exit_code == 2, r.output
        lines = r.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {p}:") and where in lines[0], (
            r.output
        )
        assert "Traceback" not in r.output
    assert not (tmp_path / "results").exists()


def test_missing_file_and_unavailable_device_exit_2(tmp_path, monkeypatch):
    import torch

    r = invoke("run", tmp_path / "nope.yaml")
    assert r.exit_code == 2 and r.output.strip() == f"error: {tmp_path / 'nope.yaml'}: no such file"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    p = write_suite(tmp_path, TINY_SUITE, replace={"device: cpu": "device: cuda"})
    r = invoke("run", p)
    assert r.exit_code == 2 and r.output.strip().startswith(
        f"error: {p}:3:9: device: CUDA is not available"
    )
    r = invoke("run", write_suite(tmp_path, name="ok.yaml"), "--device", "cuda")
    assert r.exit_code == 2 and "--device cuda: CUDA is not available" in r.output
    assert not (tmp_path / "results").exists()
    assert invoke("run", p, "--seeds", "a,b").exit_code == 2


def test_ls_lists_names_with_origin():
    r = invoke("ls", "models", "fc_*")
    assert r.exit_code == 0
    lines = [ln.split() for ln in r.output.strip().splitlines()]
    assert ["models", "fc_deq_tiny", "built-in"] in lines and all(
        ln[1].startswith("fc_") for ln in lines
    )
    r = invoke("ls")
    kinds = {ln.split()[0] for ln in r.output.strip().splitlines()}
    assert kinds == {
        "models",
        "solvers",
        "inits",
        "analyses",
        "kernels",
        "datasets",
        "backward",
        "plots",
    }
    assert "solver_stats" in invoke("ls", "analysis").output
    # the unknown-kernel error points here: `deqbench ls kernels`
    assert ["kernels", "periodic_se", "built-in"] in [
        ln.split() for ln in invoke("ls", "kernels").output.splitlines()
    ]
    r = invoke("ls", "modles")
    assert r.exit_code == 2 and "did you mean 'models'" in r.output


def test_info_and_validate(tiny_suite):
    r = invoke("info")
    assert r.exit_code == 0
    keys = [ln.split(":")[0] for ln in r.output.splitlines() if not ln.startswith(" ")]
    assert keys[:7] == ["deqbench", "python", "torch", "numpy", "cuda", "cudnn", "driver"]
    assert "device" in keys and "flags" in keys and "plugins" in keys
    meta = json.loads(invoke("info", "--json").output)
    assert meta["versions"]["deqbench"] and "threads" in meta["flags"]
    r = invoke("validate", tiny_suite, "--seeds", "0-2", "--set", "matrix.solver.tol=[1e-2, 1e-3]")
    assert r.exit_code == 0
    lines = r.output.strip().splitlines()
    assert (
        lines[0]
        == f"{tiny_suite}: ok: 4 cells x 3 seeds = 12 tasks; device cpu; analyses: metrics, solver_stats"
    )
    assert lines[1].split("\t")[0] == "fc_deq_tiny-fixed_point-ift-tol=0.01" and len(lines) == 5


@pytest.mark.slow  # two runs, plots and a compare: about 10 s on 2 cores
def test_run_plot_compare(tmp_path, tiny_suite):
    out = tmp_path / "out"
    r = invoke("run", tiny_suite, "--out", out, "--no-progress", "--set", "matrix.backward=[ift]")
    assert r.exit_code == 0, r.output
    run_a = out / "tiny" / r.output.strip().splitlines()[-1].split("/tiny/")[1]
    assert r.output.strip().splitlines()[-1] == f"run directory: {run_a}"
    assert "fc_deq_tiny-fixed_point-ift" in r.output and "1/1" in r.output
    assert (run_a / "results.csv").exists() and (run_a / "run.json").exists()
    for png in (run_a / "plots").iterdir():
        png.unlink()
    r = invoke("plot", run_a)
    assert r.exit_code == 0 and len(r.output.strip().splitlines()) == 3
    assert {p.name for p in (run_a / "plots").iterdir()} == {
        "solver_iterations.png",
        "residual_traces.png",
        "training_curves.png",
    }
    assert invoke("plot", tmp_path).exit_code == 2
    # B: a copy of A whose forward iterations doubled
    run_b = tmp_path / "b"
    run_b.mkdir()
    df = pd.read_csv(run_a / "results.csv", keep_default_na=False)
    df.loc[df.metric == "forward_nstep", "value"] = (
        df.loc[df.metric == "forward_nstep", "value"].astype(float) * 2
    )
    df.to_csv(run_b / "results.csv", index=False)
    r = invoke("compare", run_a, run_b, "--csv", tmp_path / "cmp.csv")
    assert r.exit_code == 0
    changed = [ln for ln in r.output.splitlines() if "CHANGED" in ln and "(rtol" in ln]
    assert len(changed) == 3 and all("forward_nstep " in ln and " 2 " in ln for ln in changed), (
        r.output
    )
    per_cell = [ln for ln in r.output.splitlines() if ln.startswith("│ CHANGED")]
    assert len(per_cell) == 3 and all("forward_nstep" in ln for ln in per_cell), r.output
    cmp = pd.read_csv(tmp_path / "cmp.csv", keep_default_na=False)
    fw = cmp[cmp.metric == "forward_nstep"]
    assert (
        list(fw.ratio) == [2.0] * 3
        and fw.changed.all()
        and not cmp[cmp.metric == "loss"].changed.any()
    )
    cells = pd.read_csv(tmp_path / "cmp-cells.csv", keep_default_na=False)
    assert set(cells.metric) == {"forward_nstep"} and (cells.ratio == 2.0).all()
    assert invoke("compare", run_a, run_b, "--fail-on-change").exit_code == 1
    assert not (run_b / f"compare-{run_a.name}.csv").exists()  # a CSV only with --csv
    # the factor is for timings; a deterministic change passes only a loose enough --rtol
    assert invoke("compare", run_a, run_b, "--factor", "3", "--fail-on-change").exit_code == 1
    assert invoke("compare", run_a, run_b, "--rtol", "0.5", "--fail-on-change").exit_code == 0


def test_failed_cell_exits_1_and_interrupt_exits_130(tmp_path, monkeypatch):
    p = write_suite(
        tmp_path,
        TINY_SUITE,
        replace={
            "{name: fc_deq_tiny, width: 8}": "{name: fc_deq_tiny, width: 8, activation: relu}\n  init: {name: spectral, target: 50}",
            "backward: [ift, unrolled]": "init: [default, {name: spectral, target: 50}]",
            "[metrics, solver_stats]": "[metrics]",
        },
    )
    r = invoke("run", p, "--no-plots")
    assert r.exit_code == 1, r.output
    assert re.search(
        r"(diverged|nan) fc_deq_tiny-fixed_point-ift-spectral-target=50 seed=0", r.output
    )

    import deqbench.run.runner

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(deqbench.run.runner, "run_task", interrupted)
    r = invoke("run", write_suite(tmp_path, name="ok.yaml"), "--no-plots")
    assert r.exit_code == 130 and "interrupted" in r.output and "--resume" in r.output


def test_collection_file_runs_its_suites_one_after_another(tmp_path):
    """A collection (suites: [...]) is validated as a whole, then each part runs into its own
    run directory with the same overrides; --resume is refused; its problems name the part."""
    write_suite(tmp_path, name="a.yaml")
    write_suite(tmp_path, name="b.yaml", replace={"name: tiny": "name: tiny_b"})
    coll = tmp_path / "all.yaml"
    coll.write_text("schema: 1\nname: both\nsuites: [a.yaml, b.yaml]\n")
    r = invoke("validate", coll)
    assert r.exit_code == 0, r.output
    assert r.output.count(": ok: 2 cells x 1 seed") == 2
    r = invoke("run", coll, "--no-plots", "--no-progress", "--set", "matrix.backward=[ift]")
    assert r.exit_code == 0, r.output
    runs = sorted(p.parent.parent.name for p in (tmp_path / "results").glob("*/*/run.json"))
    assert runs == ["tiny", "tiny_b"]
    for name in runs:
        df = pd.read_csv(next((tmp_path / "results" / name).glob("*/results.csv")))
        assert set(df.cell_id) == {"fc_deq_tiny-fixed_point-ift"}  # the override reached both
    assert "2 of 2 suites run" in r.output
    r = invoke("run", coll, "--resume", tmp_path)
    assert r.exit_code == 2 and "collection of 2 suites" in r.output
    # a broken part: the collection's line, the part and the part's own located error
    coll.write_text("schema: 1\nname: both\nsuites: [a.yaml, missing.yaml, all.yaml]\n")
    r = invoke("validate", coll)
    assert r.exit_code == 2
    assert "all.yaml:3:" in r.output and "missing.yaml: no such file" in r.output
    assert "all.yaml is this file" in r.output
    coll.write_text("schema: 1\nname: both\nsuite: [a.yaml]\n")
    r = invoke("validate", coll)
    assert r.exit_code == 2  # not a collection (no `suites`): a suite with an unknown key


def test_shipped_kglm_collection_names_the_five_parts():
    from deqbench.run.suite import load_suite, load_suites

    root = ROOT / "suites"
    parts = load_suites(root / "kglm.yaml", device="cpu")
    assert [s.name for s in parts] == [
        "kglm_klr", "kglm_smooth", "kglm_denoise", "kglm_init_cost", "kglm_pcdeq_sigma",
    ]  # fmt: skip
    with pytest.raises(Exception, match="collection of suites"):
        load_suite(root / "kglm.yaml")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS: Linux only")
@pytest.mark.parametrize(
    "cmd", [["ls", "models", "--verbose"], ["validate", "suites/smoke.yaml"]]
)  # plain `ls` imports no PyTorch (tests/test_fast_start.py); -v reads the models' declarations
def test_address_space_limit_at_import_is_one_line_exit_2(tmp_path, cmd):
    """`ulimit -v` below what PyTorch maps at import (libtorch_cpu.so: failed to map segment):
    one error line naming the limit and the fix, exit 2, no traceback."""
    import os
    import resource

    limit = 3 * 2**29  # 1.5 GiB: Python, Typer and the suite loader fit, PyTorch does not

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "deqbench", *cmd],
        cwd=ROOT, env=env, preexec_fn=cap, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith("error: out of memory while loading PyTorch (address-space limit")
    assert "ulimit -v 1572864" in out.stderr and "raise `ulimit -v`" in out.stderr


def test_summary_shows_f_evaluation_columns_only_with_solver_stats(capsys):
    """The summary table's f-evaluation columns appear when some cell ran ``solver_stats``
    (one-cell analysis suites such as ``deqbench landscape``'s do not: no empty columns)."""
    import pandas as pd

    from deqbench.run.console import print_summary

    def row(cell, analysis, metric, value, variant="", step=None):
        return dict(cell_id=cell, analysis=analysis, metric=metric, variant=variant, step=step,
                    value=value, status="ok")  # fmt: skip

    base = [row("a", "runner", "wall_time", 1.5), row("a", "metrics", "accuracy", 0.9, "test", 0)]
    print_summary(pd.DataFrame(base))
    out = capsys.readouterr().out
    assert "test acc" in out and "f-evals" not in out and "0.9" in out
    stats = [row("a", "solver_stats", "forward_nstep", 7.0, "train", 0)]
    print_summary(pd.DataFrame(base + stats))
    out = capsys.readouterr().out
    assert "fwd f-evals/batch" in out and "bwd f-evals" not in out
    (line,) = [ln for ln in out.splitlines() if ln.startswith("│ a ")]
    assert [c.strip() for c in line.split("│")][1:5] == ["a", "ok 1/1", "0.9", "7"]
