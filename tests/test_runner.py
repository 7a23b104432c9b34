"""The runner: run directory contents, failure capture, skip-training, interrupts, executors,
determinism, and kill -9 + --resume."""

from __future__ import annotations

import json
import math
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import TINY_SUITE, write_suite
from torch import nn

from deqbench.analyses.base import Analysis, Row
from deqbench.core.registry import analyses, models
from deqbench.errors import ConfigError
from deqbench.run.results import RUNNER, load_results
from deqbench.run.runner import InlineExecutor, run_suite
from deqbench.run.suite import load_suite
from deqbench.run.task import run_task


class _Boom(nn.Module):
    """Evaluates fine, fails on the first training forward."""

    def __init__(self, in_shape, num_outputs, kind="error"):
        super().__init__()
        self.lin = nn.Linear(math.prod(in_shape), num_outputs)
        self.kind = kind

    def forward(self, x):
        if self.training:
            if self.kind == "oom":
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            raise RuntimeError("boom in forward")
        return self.lin(x.flatten(1))


class _Probe(Analysis):
    """Records which hooks ran; for seed 1, when asked, sends this process a SIGINT (Ctrl-C)."""

    name = "test_probe"
    needs_training = False

    def before_training(self, ctx):
        if ctx.seed == 1 and os.environ.get("TEST_PROBE_INTERRUPT"):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler raises at once; never reached
        yield Row("before", 1.0)
        yield Row("param_bits", torch.finfo(next(ctx.model.parameters()).dtype).bits)

    def on_epoch(self, ctx, info):
        yield Row("epoch", float(info.epoch), step=info.epoch)

    def after_training(self, ctx):
        yield Row("after", 1.0)


@pytest.fixture(autouse=True, scope="module")
def _test_plugins():
    models.add("test_boom", lambda in_shape, num_outputs: _Boom(in_shape, num_outputs))
    models.add("test_oom", lambda in_shape, num_outputs: _Boom(in_shape, num_outputs, "oom"))
    analyses.add("test_probe", _Probe)
    yield
    for n in ("test_boom", "test_oom"):
        models.remove(n)
    analyses.remove("test_probe")


def _key_rows(df: pd.DataFrame) -> pd.DataFrame:
    """Results without run id, timings and per-process start-up rows, in a canonical order."""
    df = df[df.analysis != "process"].drop(columns=["run_id"]).copy()
    df.loc[df.unit == "s", "value"] = math.nan
    keys = ["cell_id", "seed", "analysis", "variant", "metric", "step", "repeat"]
    return df.sort_values(keys).reset_index(drop=True)


def test_run_directory_and_declared_rows(tiny_suite):
    suite = load_suite(tiny_suite)
    summary = run_suite(suite, progress=False)
    d = summary.run_dir
    assert summary.exit_code == 0 and d.parent.name == "tiny"
    assert {p.name for p in d.iterdir()} >= {
        "run.json",
        "suite.yaml",
        "results.csv",
        "series",
        "plots",
        "log.txt",
    }
    meta = json.loads((d / "run.json").read_text())
    assert (
        meta["suite_hash"] == suite.hash and meta["seeds"] == [0] and meta["status"] == "complete"
    )
    assert meta["versions"]["torch"] == torch.__version__ and meta["flags"]["threads"] == 1
    assert meta["device"] == "cpu" and "command" in meta and "commit" in meta["git"]
    assert load_suite(d / "suite.yaml").hash == suite.hash
    df = load_results(d)
    assert set(df.status) == {"ok"} and set(df.run_id) == {d.name}
    got = {(c, a, m) for c, a, m in zip(df.cell_id, df.analysis, df.metric)}
    fwd = ["forward_nstep", "forward_rel_residual", "forward_abs_residual", "forward_converged"]
    for cell in ("fc_deq_tiny-fixed_point-ift", "fc_deq_tiny-unrolled5"):
        want = {(cell, "metrics", m) for m in ("loss", "accuracy")}
        want |= {(cell, "solver_stats", m) for m in fwd + ["forward_nstep_max"]}
        want |= {(cell, RUNNER, "wall_time")}
        assert want <= got, want - got
    ift = df[(df.cell_id == "fc_deq_tiny-fixed_point-ift") & (df.analysis == "solver_stats")]
    assert {"backward_nstep", "backward_rel_residual", "backward_nstep_max"} <= set(ift.metric)
    unrolled = df[(df.cell_id == "fc_deq_tiny-unrolled5") & (df.metric == "forward_nstep")]
    # an unrolled cell is its K = 5 steps in training and in evaluation (not the solver)
    assert list(unrolled[(unrolled.variant == "train") & (unrolled.step == 1)].value) == [5.0]
    assert (unrolled.value == 5).all()
    assert not df[(df.cell_id == "fc_deq_tiny-unrolled5") & (df.metric == "backward_nstep")].size
    assert (
        sorted(p.name.split("__")[0] for p in (d / "series").iterdir())
        == ["solver_steps"] * 2 + ["solver_trace"] * 2
    )
    assert {p.name for p in (d / "plots").iterdir()} == {
        "solver_iterations.png",
        "residual_traces.png",
        "training_curves.png",
    }


def test_failures_are_recorded_and_other_cells_finish(tmp_path):
    p = write_suite(
        tmp_path,
        TINY_SUITE,
        replace={
            "backward: [ift, unrolled]": "model: [fc_deq_tiny, test_boom, test_oom]",
            "[metrics, solver_stats]": "[metrics]",
        },
    )
    summary = run_suite(load_suite(p), progress=False, plots=False)
    assert summary.exit_code == 1
    df = load_results(summary.run_dir)
    status = df[df.analysis == RUNNER].set_index("cell_id")
    assert status.status.to_dict() == {
        "fc_deq_tiny-fixed_point-ift": "ok",
        "test_boom-fixed_point-ift": "error",
        "test_oom-fixed_point-ift": "oom",
    }
    assert status.note["test_boom-fixed_point-ift"] == "RuntimeError: boom in forward"
    assert status.note["test_oom-fixed_point-ift"].startswith(
        "OutOfMemoryError: CUDA out of memory"
    )
    # the evaluation before training was measured and is kept
    boom = df[(df.cell_id == "test_boom-fixed_point-ift") & (df.analysis == "metrics")]
    assert set(boom.step) == {0} and len(boom) == 4
    log = (summary.run_dir / "log.txt").read_text()
    assert "Traceback" in log and "boom in forward" in log
    assert sorted(f[0] for f in summary.failed) == [
        "test_boom-fixed_point-ift",
        "test_oom-fixed_point-ift",
    ]


def test_divergence_is_recorded(tmp_path):
    p = write_suite(
        tmp_path,
        TINY_SUITE,
        replace={
            "{name: fc_deq_tiny, width: 8}": "{name: fc_deq_tiny, width: 8, activation: relu}\n  init: {name: spectral, target: 50}",
            "matrix:\n  backward: [ift, unrolled]\n": "",
        },
    )
    summary = run_suite(load_suite(p), progress=False, plots=False)
    df = load_results(summary.run_dir)
    r = df[df.analysis == RUNNER].iloc[0]
    assert summary.exit_code == 1 and r.status in ("diverged", "nan"), r.to_dict()
    assert "diverged" in r.note or "non-finite" in r.note


def test_non_deq_model_and_skipped_training(tmp_path):
    p = write_suite(
        tmp_path,
        TINY_SUITE,
        replace={
            "backward: [ift, unrolled]": "model: [{name: tied_repeat_tiny, cell: fc, repeats: 2}]",
            "epochs: 1": "epochs: 0",
            "[metrics, solver_stats]": "[solver_stats, test_probe]",
        },
    )
    df = load_results(run_suite(load_suite(p), progress=False, plots=False).run_dir)
    sk = df[df.analysis == "solver_stats"]
    assert len(sk) == 1 and sk.status.iloc[0] == "skipped" and "not a DEQ" in sk.note.iloc[0]
    # solver_stats needs training -> train() runs with 0 epochs: only the epoch-0 evaluation
    probe = df[df.analysis == "test_probe"]
    assert sorted(probe.metric) == ["after", "before", "epoch", "param_bits"]
    assert probe[probe.metric == "param_bits"].value.iloc[0] == 32
    p = write_suite(
        tmp_path,
        TINY_SUITE,
        name="b.yaml",
        replace={
            "epochs: 1": "epochs: 0",
            "[metrics, solver_stats]": "[test_probe]",
            "threads: 1": "threads: 1\ndtype: float64",
        },
    )
    df = load_results(run_suite(load_suite(p), progress=False, plots=False).run_dir)
    probe = df[(df.analysis == "test_probe") & (df.metric != "param_bits")]
    assert sorted(probe.metric) == ["after", "after", "before", "before"]  # training skipped
    assert set(df[df.metric == "param_bits"].value) == {64.0}


def test_interrupt_keeps_finished_tasks_then_resume(tmp_path, monkeypatch):
    p = write_suite(
        tmp_path,
        TINY_SUITE,
        replace={
            "seeds: [0]": "seeds: [0, 1]",
            "matrix:\n  backward: [ift, unrolled]\n": "",
            "[metrics, solver_stats]": "[metrics, test_probe]",
        },
    )
    monkeypatch.setenv("TEST_PROBE_INTERRUPT", "1")
    summary = run_suite(load_suite(p), progress=False)
    assert summary.interrupted and summary.exit_code == 130
    df = load_results(summary.run_dir)
    assert set(df.seed) == {0} and (df.analysis == RUNNER).sum() == 1
    assert json.loads((summary.run_dir / "run.json").read_text())["status"] == "interrupted"
    monkeypatch.delenv("TEST_PROBE_INTERRUPT")
    again = run_suite(load_suite(p), resume=summary.run_dir, progress=False)
    assert again.exit_code == 0 and again.skipped == 1 and again.tasks == 1
    df = load_results(summary.run_dir)
    assert sorted(df[df.analysis == RUNNER].seed) == [0, 1]
    other = write_suite(tmp_path, TINY_SUITE, name="other.yaml")
    with pytest.raises(ConfigError, match="made from a different suite"):
        run_suite(load_suite(other), resume=summary.run_dir, progress=False)


class _PickleReverse:
    """An executor that ships tasks through pickle (as a distributed one would) and returns
    results in reverse order."""

    def run(self, tasks, listener=None):
        results = [run_task(pickle.loads(pickle.dumps(t))) for t in tasks]
        yield from reversed([pickle.loads(pickle.dumps(r)) for r in results])


def test_executor_interface_and_determinism(tiny_suite):
    suite = load_suite(tiny_suite, seeds=[0, 1])
    a = load_results(
        run_suite(suite, executor=InlineExecutor(), progress=False, plots=False).run_dir
    )
    b = load_results(
        run_suite(suite, executor=_PickleReverse(), progress=False, plots=False).run_dir
    )
    # the tasks finished in reverse order; results.csv is rewritten in the suite's order
    # so that both files list the cells and seeds alike
    order = ["cell_id", "seed"]
    assert b[order].drop_duplicates().values.tolist() == a[order].drop_duplicates().values.tolist()
    keys = a[order].drop_duplicates().values.tolist()
    assert keys != keys[::-1]  # the reverse executor's finishing order differs from it
    pd.testing.assert_frame_equal(_key_rows(a), _key_rows(b))


def _finished(path) -> int:
    try:
        return int((load_results(path).analysis == RUNNER).sum())
    except Exception:
        return 0


@pytest.mark.slow  # two runs and a killed one: about 20 s on 2 cores
def test_sigkill_then_resume_equals_an_uninterrupted_run(tmp_path):
    p = write_suite(
        tmp_path,
        TINY_SUITE,
        replace={
            "seeds: [0]": "seeds: [0, 1, 2]",
            "epochs: 1": "epochs: 2",
            # a contraction at init, so that plain iteration converges for every seed (the
            # run must exit 0: no cell flagged)
            "  train:": "  init: {name: spectral, target: 0.5}\n  train:",
        },
    )
    out = tmp_path / "killed"
    cmd = [
        sys.executable,
        "-m",
        "deqbench",
        "run",
        str(p),
        "--out",
        str(out),
        "--no-progress",
        "--no-plots",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 300
    csv = None
    while time.time() < deadline and proc.poll() is None:
        found = list(out.glob("tiny/*/results.csv"))
        if found and _finished(found[0]) >= 1:
            csv = found[0]
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert csv is not None, proc.stderr.read().decode()[-2000:]
    run_dir = csv.parent
    done = _finished(csv)
    assert 1 <= done < 6, "the run finished before it could be killed"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "deqbench",
            "run",
            str(p),
            "--resume",
            str(run_dir),
            "--no-progress",
            "--no-plots",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    resumed = load_results(run_dir)
    runner = resumed[resumed.analysis == RUNNER]
    assert len(runner) == 6 and not runner.duplicated(["cell_id", "seed"]).any()
    keys = ["cell_id", "seed", "analysis", "variant", "metric", "step", "repeat"]
    assert not resumed.duplicated(keys).any()
    full = load_results(
        run_suite(load_suite(p), out=tmp_path / "full", progress=False, plots=False).run_dir
    )
    pd.testing.assert_frame_equal(_key_rows(resumed), _key_rows(full))
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["status"] == "complete" and meta["resumed"][0]["skipped_tasks"] == done


def test_shipped_suites_validate():
    from deqbench.core.registry import models

    smoke = load_suite("suites/smoke.yaml")
    assert len(smoke.cells) == 20 and smoke.seeds == [0, 1] and smoke.device == "cpu"
    assert {"fixed_point", "anderson", "broyden"} <= {c.solver["name"] for c in smoke.cells}
    # every built-in tiny model variant (one per model of every family) runs in the smoke suite
    builtin_tiny = {n for n in models.names("*_tiny") if models.entry(n).is_builtin}
    assert builtin_tiny <= {c.model["name"] for c in smoke.cells}
    families = {c.model["name"].split("_")[0] for c in smoke.cells}
    assert {"fc", "conv", "tied", "pcdeq", "mondeq", "opteq", "kglm"} <= families
    assert {c.backward["name"] for c in smoke.cells} == {"ift", "unrolled"}
    assert len(load_suite("suites/solvers.yaml").cells) == 16  # 4 solvers x 4 backward modes
    # pcdeq: L (64-d input) and MC (28x28) cells, four activations and a control each, one run
    pcdeq = load_suite("suites/pcdeq.yaml")
    by_model = {
        m: [c for c in pcdeq.cells if c.model["name"] == m] for m in ("pcdeq_l", "pcdeq_mc")
    }
    assert len(pcdeq.cells) == 10 and all(len(v) == 5 for v in by_model.values())
    for cells in by_model.values():
        acts = {c.model.get("activation") for c in cells}
        assert acts == {"tanh", "softsign", "relu6", "sigmoid"}
        assert [c.model.get("nonneg", True) for c in cells].count(False) == 1
    assert {c.data.get("size", 8) for c in by_model["pcdeq_l"]} == {8}
    assert {c.data["size"] for c in by_model["pcdeq_mc"]} == {28}


@pytest.mark.parametrize(
    "path", sorted(p.name for p in (Path(__file__).resolve().parents[1] / "suites").glob("*.yaml"))
)
def test_every_shipped_suite_validates(path):
    """Every suite in suites/ passes validation (names, params, analyses) on a CPU-only machine;
    vs_torchdeq.yaml needs the TorchDEQ plugin, and says so before anything runs without it
    (with it: tests/test_torchdeq_plugin.py)."""
    from deqbench.core.registry import solvers
    from deqbench.run.suite import load_suites

    root = Path(__file__).resolve().parents[1] / "suites"
    if path == "vs_torchdeq.yaml" and "torchdeq_anderson" not in solvers:
        with pytest.raises(ConfigError, match="unknown solver 'torchdeq_"):
            load_suite(root / path, device="cpu")
        return
    for suite in load_suites(root / path, device="cpu"):  # a collection: every part
        assert suite.cells


def test_suite_numeric_flags_are_applied_recorded_and_hashed(tmp_path):
    """`tf32` / `cudnn_benchmark` / `deterministic` set torch's flags for the run (run.json
    records them), enter the hash only when set (older suites keep theirs), and reject
    non-booleans."""
    for d in ("a", "b", "c"):
        (tmp_path / d).mkdir()
    plain = load_suite(write_suite(tmp_path / "a"))
    assert plain.numeric_flags() == {}
    flagged_path = write_suite(
        tmp_path / "b",
        replace={
            "threads: 1": "threads: 1\ntf32: false\ncudnn_benchmark: true\ndeterministic: true"
        },
    )
    flagged = load_suite(flagged_path)
    assert flagged.numeric_flags() == {
        "tf32": False,
        "cudnn_benchmark": True,
        "deterministic": True,
    }
    assert flagged.hash != plain.hash
    old = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    )
    try:
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = False
        torch.use_deterministic_algorithms(False)
        threads_before = torch.get_num_threads()
        summary = run_suite(flagged, progress=False, plots=False)
        meta = json.loads((summary.run_dir / "run.json").read_text())
        text = json.dumps(meta)
        assert '"tf32_cudnn": false' in text and '"cudnn_benchmark": true' in text
        assert '"tf32_matmul": false' in text
        assert '"cudnn_deterministic": true' in text and '"deterministic_algorithms": true' in text
        # afterwards the process is as before (the next run, e.g. a collection's next part,
        # does not inherit the flags)
        assert torch.backends.cudnn.allow_tf32 and not torch.backends.cudnn.benchmark
        assert not torch.are_deterministic_algorithms_enabled()
        assert not torch.backends.cudnn.deterministic
        assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == old[6]
        assert torch.get_num_threads() == threads_before
        # the resolved suite written next to the results keeps the flags (resume reloads it)
        assert load_suite(summary.run_dir / "suite.yaml").hash == flagged.hash
    finally:
        (
            torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32,
            torch.backends.cudnn.benchmark,
            torch.backends.cudnn.deterministic,
        ) = old[:4]
        torch.use_deterministic_algorithms(old[4], warn_only=old[5])
        if old[6] is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    bad = write_suite(tmp_path / "c", replace={"threads: 1": "threads: 1\ntf32: sometimes"})
    with pytest.raises(ConfigError, match="tf32"):
        load_suite(bad)
