"""Mid-task checkpoints: a training task stopped by a signal, by --stop-after or by a crash
continues from its checkpoint on --resume, and its rows are those of an uninterrupted run
(bitwise on CPU float64, timings aside)."""

from __future__ import annotations

import math
import os
import random
import signal

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import write_suite
from typer.testing import CliRunner

from deqbench.analyses.base import Analysis, Row
from deqbench.core.registry import analyses
from deqbench.run import checkpoints
from deqbench.run.checkpoints import TaskCheckpoint, checkpoint_path
from deqbench.run.results import load_results
from deqbench.run.runner import STOPPED_EXIT, run_suite
from deqbench.run.suite import load_suite

# 64 training images at batch 16: 4 steps an epoch, 3 epochs (12 steps); float64 on CPU
SUITE = """\
schema: 1
name: ckpt
device: cpu
dtype: float64
threads: 1
seeds: [0]
data: {name: digits, train_subset: 64, test_subset: 32}
defaults:
  model: {name: fc_deq_tiny, width: 8}
  solver: {name: anderson, max_iter: 15, tol: 1.0e-4}
  backward: {name: ift, max_iter: 15, tol: 1.0e-4}
  train: {epochs: 3, batch_size: 16, lr: 1.0e-2, schedule: cosine}
matrix:
  case:
    - {}
    - {train: {optimizer: sgd, lr: 5.0e-2, epochs: 2}}
analyses: [metrics, solver_stats, test_ckpt_probe]
output: results
"""

#: (cell index, global step) at which the probe acts, and what it does: "signal" sends this
#: process SIGTERM, "deadline" makes the --stop-after deadline pass
ACT: dict[str, object] = {"at": None, "how": "signal", "cell": None}
DEADLINE = {"passed": False}


class _Probe(Analysis):
    """State across hooks (the steps' losses, draws of every global RNG, a link to the live
    model) turned into rows after training; on request it stops the task at one step."""

    name = "test_ckpt_probe"

    def before_training(self, ctx):
        self.model = ctx.model  # linked, not copied, by a checkpoint
        self.losses: list[float] = []
        self.draws: list[float] = []
        return [Row("before", 1.0)]

    def on_step(self, ctx, info):
        self.losses.append(info.loss)
        self.draws.append(float(torch.rand(())) + float(np.random.rand()) + random.random())
        if ACT["at"] == info.step and ACT["cell"] in (None, ctx.cell_id):
            ACT["at"] = None  # once
            if ACT["how"] == "signal":
                os.kill(os.getpid(), signal.SIGTERM)
            else:
                DEADLINE["passed"] = True
        return [Row("step_loss", info.loss, step=info.step)]

    def after_training(self, ctx):
        norm = math.sqrt(sum(float(p.detach().square().sum()) for p in self.model.parameters()))
        yield Row("loss_sum", sum(self.losses))
        yield Row("draws", sum(self.draws))
        yield Row("steps_seen", len(self.losses))
        yield Row("linked_param_norm", norm)


@pytest.fixture(autouse=True)
def _probe(monkeypatch):
    analyses.add("test_ckpt_probe", _Probe)
    ACT.update(at=None, how="signal", cell=None)
    DEADLINE["passed"] = False
    real = TaskCheckpoint.deadline_passed
    monkeypatch.setattr(
        TaskCheckpoint, "deadline_passed", lambda self: DEADLINE["passed"] or real(self)
    )
    yield
    analyses.remove("test_ckpt_probe")


def _rows(run_dir) -> pd.DataFrame:
    """The run's rows but timings (unit s) and per-process start-up rows, in key order."""
    df = load_results(run_dir)
    df = df[(df.analysis != "process") & (df.unit != "s")].drop(columns=["run_id"])
    keys = ["cell_id", "seed", "analysis", "variant", "metric", "step", "repeat"]
    return df.sort_values(keys).reset_index(drop=True)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> pd.DataFrame:
    """The rows of the suite run without interruption."""
    d = tmp_path_factory.mktemp("straight")
    analyses.add("test_ckpt_probe", _Probe)
    try:
        summary = run_suite(load_suite(write_suite(d, SUITE)), progress=False, plots=False)
    finally:
        analyses.remove("test_ckpt_probe")
    assert summary.exit_code == 0
    return _rows(summary.run_dir)


def _cell(suite, i: int) -> str:
    return suite.cells[i].id


def test_sigterm_mid_task_checkpoints_and_resume_matches_straight_run(tmp_path, straight):
    suite = load_suite(write_suite(tmp_path, SUITE))
    ACT.update(at=6, how="signal", cell=_cell(suite, 0))  # epoch 2, step 2 of the first cell
    first = run_suite(suite, progress=False, plots=False)
    assert first.interrupted and first.exit_code == 143
    ckpt = checkpoint_path(first.run_dir, _cell(suite, 0), 0)
    assert ckpt.exists()  # written at the step boundary, before the signal was raised
    assert torch.load(ckpt, weights_only=False)["step"] == 6
    assert not (first.run_dir / "results.csv").exists() or load_results(first.run_dir).empty

    again = run_suite(suite, resume=first.run_dir, progress=False, plots=False)
    assert again.exit_code == 0 and not ckpt.exists()  # deleted once its rows are written
    log = (first.run_dir / "log.txt").read_text()
    assert "continued from its checkpoint at step 6" in log
    pd.testing.assert_frame_equal(_rows(again.run_dir), straight, check_exact=True)


def test_stop_after_deadline_suspends_and_resume_matches(tmp_path, straight):
    suite = load_suite(write_suite(tmp_path, SUITE))
    # the deadline passes during the first cell's step 4 (an epoch's last step: the epoch's
    # evaluation comes after the resume); the second cell stops after its first step (the
    # deadline of this test is the checkpoint's alone: the task starts)
    ACT.update(at=4, how="deadline", cell=_cell(suite, 0))
    first = run_suite(suite, progress=False, plots=False, stop_after=3600)
    assert first.interrupted and first.exit_code == STOPPED_EXIT == 75
    assert [(c, s) for c, s, _ in first.stopped] == [(_cell(suite, 0), 0), (_cell(suite, 1), 0)]
    assert "at step 4; --resume continues it from its checkpoint" in first.stopped[0][2]
    assert "at step 1; " in first.stopped[1][2]
    assert not (first.run_dir / "results.csv").exists() or load_results(first.run_dir).empty
    for i, step in ((0, 4), (1, 1)):
        ckpt = checkpoint_path(first.run_dir, _cell(suite, i), 0)
        assert torch.load(ckpt, weights_only=False)["step"] == step
    DEADLINE["passed"] = False
    again = run_suite(suite, resume=first.run_dir, progress=False, plots=False)
    assert again.exit_code == 0 and not list((first.run_dir / "checkpoints").iterdir())
    pd.testing.assert_frame_equal(_rows(again.run_dir), straight, check_exact=True)


def test_checkpoint_of_another_task_is_ignored_with_a_note(tmp_path, straight):
    suite = load_suite(write_suite(tmp_path, SUITE))
    ACT.update(at=5, how="signal", cell=_cell(suite, 0))
    first = run_suite(suite, progress=False, plots=False)
    ckpt = checkpoint_path(first.run_dir, _cell(suite, 0), 0)
    state = torch.load(ckpt, weights_only=False)
    state["fingerprint"] = "0" * 16  # as if made by another cell or suite
    torch.save(state, ckpt)
    again = run_suite(suite, resume=first.run_dir, progress=False, plots=False)
    assert again.exit_code == 0
    log = (first.run_dir / "log.txt").read_text()
    assert "ignored: made for another task" in log and "from scratch" in log
    pd.testing.assert_frame_equal(_rows(again.run_dir), straight, check_exact=True)


def test_corrupt_checkpoint_is_ignored_and_the_task_reruns(tmp_path, straight):
    suite = load_suite(write_suite(tmp_path, SUITE))
    ACT.update(at=3, how="signal", cell=_cell(suite, 1))
    first = run_suite(suite, progress=False, plots=False)
    ckpt = checkpoint_path(first.run_dir, _cell(suite, 1), 0)
    ckpt.write_bytes(ckpt.read_bytes()[:100])  # torn
    again = run_suite(suite, resume=first.run_dir, progress=False, plots=False)
    assert again.exit_code == 0 and "ignored: unreadable" in (first.run_dir / "log.txt").read_text()
    pd.testing.assert_frame_equal(_rows(again.run_dir), straight, check_exact=True)


def test_periodic_checkpoint_survives_a_crash_and_train_continues_bitwise(tmp_path):
    """train() alone: a checkpoint at every step boundary; a crash in step 7 loses that step
    only; the resumed training ends with the parameters and history of a straight one."""
    from deqbench.core.registry import models
    from deqbench.data.base import load_data
    from deqbench.run.train import TrainConfig, train

    data = load_data("digits", train_subset=48, test_subset=16).to("cpu", torch.float64)
    cfg = TrainConfig(epochs=3, batch_size=16, lr=1e-2, lr_milestone_steps=[4], gamma=0.5)

    def fresh():
        torch.manual_seed(0)
        m = models.create("fc_deq_tiny", in_shape=data.in_shape, num_outputs=10, width=8)
        return m.to(torch.float64)

    ref_model = fresh()
    ref = train(ref_model, data, cfg, seed=3)

    class Crash(Exception):
        pass

    def crash_at_7(epoch, step):
        if step == 7:
            raise Crash

    path = tmp_path / "t.pt"
    ck = TaskCheckpoint(path, 1e-9, "fp")
    with pytest.raises(Crash):
        train(fresh(), data, cfg, seed=3, checkpoint=ck, progress=crash_at_7)
    assert torch.load(path, weights_only=False)["step"] == 6
    torch.manual_seed(123)  # the resumed process's RNG is elsewhere
    ck2 = TaskCheckpoint(path, None, "fp")
    assert ck2.load() is not None
    model = fresh()
    res = train(model, data, cfg, seed=3, checkpoint=ck2)
    assert res.steps == ref.steps == 9 and res.history == ref.history
    for a, b in zip(model.state_dict().values(), ref_model.state_dict().values()):
        assert torch.equal(a, b)
    assert TaskCheckpoint(path, None, "other").load() is None  # another task's fingerprint


def test_checkpoint_every_null_writes_none(tmp_path):
    text = SUITE.replace("schedule: cosine}", "schedule: cosine, checkpoint_every: null}")
    suite = load_suite(write_suite(tmp_path, text))
    ACT.update(at=2, how="signal", cell=_cell(suite, 0))
    first = run_suite(suite, progress=False, plots=False)
    assert first.exit_code == 143 and not (first.run_dir / "checkpoints").exists()
    # not part of the suite hash: the run resumes with the default
    assert load_suite(write_suite(tmp_path, SUITE, name="b.yaml")).hash == suite.hash


def test_cli_stop_after_exits_75_with_the_resume_line(tmp_path):
    from deqbench.cli import app

    p = write_suite(tmp_path, SUITE)
    res = CliRunner().invoke(
        app, ["run", str(p), "--stop-after", "0", "--no-progress", "--no-check"]
    )
    assert res.exit_code == STOPPED_EXIT, res.output
    assert "interrupted by --stop-after: 2 tasks unfinished; resume with" in res.output
    assert "not started: the --stop-after deadline had passed" in res.output


def test_held_signal_is_not_lost_when_the_step_raises():
    from deqbench.run.interrupts import Interrupted, held_signals, holds

    with pytest.raises(Interrupted) as info:
        with held_signals():
            assert holds(signal.SIGTERM)  # recorded, the step goes on
            assert not holds(signal.SIGINT)  # a second signal raises at once
            raise RuntimeError("the step failed")
    assert info.value.signum == signal.SIGTERM
    saved = []
    with pytest.raises(Interrupted):
        with held_signals(lambda: saved.append(1)):
            holds(signal.SIGINT)
    assert saved == [1]


def test_fingerprint_ignores_checkpoint_every_only():
    cell = {"train": {"epochs": 1, "checkpoint_every": 60.0}, "model": {"name": "m"}}
    fp = checkpoints.task_fingerprint(cell, "c", 0, {"dtype": "float64"}, "cpu")
    cell2 = {"train": {"epochs": 1, "checkpoint_every": 5.0}, "model": {"name": "m"}}
    assert checkpoints.task_fingerprint(cell2, "c", 0, {"dtype": "float64"}, "cpu") == fp
    assert checkpoints.task_fingerprint(cell, "c", 1, {"dtype": "float64"}, "cpu") != fp
    assert checkpoints.task_fingerprint(cell, "c", 0, {"dtype": "float32"}, "cpu") != fp


LONG = """\
schema: 1
name: ckpt_long
device: cpu
dtype: float64
threads: 1
seeds: [0]
data: {name: digits, train_subset: 256, test_subset: 64}
defaults:
  model: {name: fc_deq_tiny, width: 16}
  solver: {name: anderson, max_iter: 20, tol: 1.0e-4}
  backward: {name: ift, max_iter: 20, tol: 1.0e-4}
  train: {epochs: 40, batch_size: 16, lr: 1.0e-2}
analyses: [metrics, solver_stats]
output: results
"""


@pytest.mark.slow  # about 15 s on 2 shared cores: a local Dask cluster and a 5 s task, twice
def test_dask_worker_stops_at_the_deadline_and_resumes_from_its_checkpoint(tmp_path):
    pytest.importorskip("distributed")
    import dask

    from deqbench.run.executors._forkserver import use_method
    from deqbench.run.executors.dask import DaskExecutor

    suite = load_suite(write_suite(tmp_path, LONG))
    straight = run_suite(suite, out=tmp_path / "inline", progress=False, plots=False)
    with dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"}):
        use_method("forkserver")
        with DaskExecutor(workers=1) as ex:  # the task runs in a worker process's thread
            ex.start("cpu", 1, dtype="float64")  # up and warm before the deadline's clock starts
            first = run_suite(suite, executor=ex, progress=False, plots=False, stop_after=2.0)
        assert first.exit_code == STOPPED_EXIT, first.stopped
        ((cell, seed, note),) = first.stopped
        assert "--resume continues it from its checkpoint" in note
        assert checkpoint_path(first.run_dir, cell, seed).exists()
        with DaskExecutor(workers=1) as ex:
            again = run_suite(suite, executor=ex, resume=first.run_dir, progress=False, plots=False)
    assert again.exit_code in (0, 1) and not checkpoint_path(first.run_dir, cell, seed).exists()
    assert "continued from its checkpoint" in (first.run_dir / "log.txt").read_text()
    pd.testing.assert_frame_equal(_rows(again.run_dir), _rows(straight.run_dir), check_exact=True)


# the same task as captured training steps: fixed-point forward and adjoint, AdamW, an LR
# milestone after the resume
CAPTURED = (
    SUITE.split("defaults:")[0].replace("name: ckpt", "name: ckpt_captured")
    + """\
defaults:
  model: {name: fc_deq_tiny, width: 8}
  solver: {name: fixed_point, max_iter: 30, tol: 1.0e-4}
  backward: {name: ift, solver: fixed_point, max_iter: 30, tol: 1.0e-4}
  train: {epochs: 3, batch_size: 16, optimizer: adamw, lr: 1.0e-2, capture: true,
          lr_milestone_steps: [5], gamma: 0.1}
analyses: [metrics, solver_stats, test_ckpt_probe]
output: results
"""
)


def test_captured_training_steps_resume_from_a_checkpoint_bitwise(tmp_path):
    """A task of captured training steps (train.capture, the same parts eagerly on CPU) stopped
    mid-epoch continues from its checkpoint with the rows of the straight run, across an LR
    milestone after the resume."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    straight = run_suite(load_suite(write_suite(tmp_path / "a", CAPTURED)), progress=False,
                         plots=False)  # fmt: skip
    assert straight.exit_code == 0
    suite = load_suite(write_suite(tmp_path / "b", CAPTURED))
    ACT.update(at=3, how="deadline", cell=_cell(suite, 0))
    first = run_suite(suite, progress=False, plots=False, stop_after=3600)
    assert first.exit_code == STOPPED_EXIT
    assert torch.load(checkpoint_path(first.run_dir, _cell(suite, 0), 0),
                      weights_only=False)["step"] == 3  # fmt: skip
    DEADLINE["passed"] = False
    again = run_suite(suite, resume=first.run_dir, progress=False, plots=False)
    assert again.exit_code == 0
    rows = _rows(again.run_dir)
    assert (rows.metric == "step_loss").sum() == 12
    pd.testing.assert_frame_equal(rows, _rows(straight.run_dir), check_exact=True)
