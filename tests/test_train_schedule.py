"""Schedules stated in optimiser steps: ``train.lr_milestone_steps`` (LR x gamma after that many
steps, stepped per batch), its refusal beside an epoch-based ``schedule``, and the optimiser
steps each task took, recorded in the run directory (``training`` rows)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import deqbench
from deqbench.analyses.base import Analysis
from deqbench.core.errors import ConfigError
from deqbench.data.base import load_data
from deqbench.deq import SolverConfig, configure
from deqbench.run.results import load_results
from deqbench.run.runner import run_suite
from deqbench.run.suite import suite_from_dict
from deqbench.run.train import TrainConfig, train


class _LR(Analysis):
    """The optimiser's LR after each step (what the next step will use)."""

    name = "lr_probe"

    def __init__(self) -> None:
        super().__init__()
        self.after: dict[int, float] = {}

    def on_step(self, ctx, info):
        self.after[info.step] = ctx.optimizer.param_groups[0]["lr"]
        return ()


def _model(data):
    torch.manual_seed(0)
    model = deqbench.models.create("fc_deq_tiny", in_shape=data.in_shape, num_outputs=3)
    configure(model, SolverConfig("fixed_point", max_iter=20, tol=1e-4))
    return model


def test_lr_is_multiplied_by_gamma_after_each_milestone_step() -> None:
    data = load_data("synthetic", n_train=64, n_test=16, dim=5, num_classes=3)
    probe = _LR()
    cfg = TrainConfig(
        epochs=3, batch_size=16, optimizer="sgd", lr=0.1, lr_milestone_steps=[3, 6], gamma=0.5,
        eval_before=False,
    )  # fmt: skip
    res = train(_model(data), data, cfg, ctx=SimpleNamespace(), callbacks=[probe])
    assert res.status == "ok"
    # 4 steps per epoch: the milestones fall inside epoch 1 and 2, not on epoch boundaries
    assert res.steps == 12 and res.steps_per_epoch == 4
    assert probe.after[1] == pytest.approx(0.1) and probe.after[2] == pytest.approx(0.1)
    assert probe.after[3] == pytest.approx(0.05) and probe.after[5] == pytest.approx(0.05)
    assert probe.after[6] == pytest.approx(0.025) and probe.after[12] == pytest.approx(0.025)


def test_max_steps_stops_mid_epoch_and_counts_steps() -> None:
    data = load_data("synthetic", n_train=64, n_test=16, dim=5, num_classes=3)
    cfg = TrainConfig(epochs=5, batch_size=16, max_steps=7, lr_milestone_steps=[2])
    res = train(_model(data), data, cfg)
    assert res.status == "ok" and res.steps == 7 and len(res.history) == 3  # epochs 0, 1, 2


def test_milestone_steps_with_an_epoch_schedule_are_refused() -> None:
    data = load_data("synthetic", n_train=32, n_test=8, dim=5, num_classes=3)
    cfg = TrainConfig(epochs=1, schedule="multistep", milestones=[1], lr_milestone_steps=[3])
    with pytest.raises(ConfigError, match="lr_milestone_steps.*schedule 'multistep'"):
        train(_model(data), data, cfg)


def _suite(train_cfg: dict, tmp: Path):
    raw = {
        "schema": 1,
        "name": "steps",
        "device": "cpu",
        "seeds": [0],
        "threads": 1,
        "data": {"name": "synthetic", "n_train": 40, "n_test": 8, "dim": 5, "num_classes": 3},
        "defaults": {
            "model": {"name": "fc_deq_tiny"},
            "solver": {"name": "fixed_point", "max_iter": 20, "tol": 1.0e-4},
            "train": train_cfg,
        },
        "analyses": ["metrics"],
        "output": str(tmp),
    }
    return suite_from_dict(raw, "<steps>")


@pytest.mark.parametrize(
    "train_cfg, message",
    [
        ({"schedule": "cosine", "lr_milestone_steps": [5]}, "cannot be combined"),
        ({"lr_milestone_steps": [5, 3]}, "strictly increasing"),
        ({"lr_milestone_steps": [0]}, "greater than 0"),
    ],
)
def test_suite_refuses_bad_milestone_steps(train_cfg: dict, message: str, tmp_path) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        _suite({"epochs": 1, **train_cfg}, tmp_path)
    assert "lr_milestone_steps" in str(err.value)


def test_run_directory_records_each_tasks_optimizer_steps(tmp_path: Path) -> None:
    suite = _suite({"epochs": 3, "batch_size": 16, "max_steps": 5}, tmp_path)
    summary = run_suite(suite, tmp_path, progress=False, plots=False, command=["test"])
    df = load_results(summary.run_dir)
    t = df[df["analysis"] == "training"].set_index("metric")["value"]
    assert t["optimizer_steps"] == 5  # max_steps, inside epoch 2 of 3 batches each
    assert t["steps_per_epoch"] == 3
