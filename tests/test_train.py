"""Training loop: accuracy on digits, callbacks, projections, NaN/divergence as status."""

from __future__ import annotations

import time

import pytest
import torch

import deqbench
from deqbench.analyses.base import Analysis, Row
from deqbench.data.base import load_data
from deqbench.deq import BackwardConfig, SolverConfig, configure
from deqbench.run.train import TrainConfig, train


@pytest.mark.slow  # several seconds on 2 cores: out of the fast lane
def test_conv_deq_tiny_learns_digits_with_ift():
    torch.manual_seed(0)
    torch.set_num_threads(2)
    data = load_data("digits", split=0.8, seed=0)
    model = deqbench.models.create("conv_deq_tiny", in_shape=data.in_shape, num_outputs=10)
    configure(
        model,
        SolverConfig("anderson", max_iter=25, tol=1e-3),
        BackwardConfig("ift", solver="anderson", max_iter=25, tol=1e-4),
    )
    t0 = time.perf_counter()
    res = train(model, data, TrainConfig(epochs=4, batch_size=64, lr=3e-3), seed=0)
    elapsed = time.perf_counter() - t0
    assert res.status == "ok"
    acc = res.history[-1]["test_accuracy"]
    assert acc > 0.85, (acc, elapsed)
    # forward/backward f-evaluations per batch are recorded
    assert res.history[-1]["train_forward_nstep"] >= 1
    assert res.history[-1]["train_backward_nstep"] >= 1


class _Counter(Analysis):
    name = "counter"

    def __init__(self):
        super().__init__()
        self.steps = 0
        self.epochs = []

    def on_step(self, ctx, info):
        self.steps += 1
        return ()

    def on_epoch(self, ctx, info):
        self.epochs.append(info.epoch)
        yield Row("acc", info.test["accuracy"], step=info.epoch)


def test_callbacks_schedule_and_rows():
    torch.manual_seed(1)
    data = load_data("synthetic", n_train=64, n_test=32, dim=5, num_classes=3)
    model = deqbench.models.create("fc_deq_tiny", in_shape=data.in_shape, num_outputs=3)
    configure(model, SolverConfig("fixed_point", max_iter=30, tol=1e-5))
    cb = _Counter()
    rows = []
    cfg = TrainConfig(
        epochs=3, batch_size=16, optimizer="sgd", lr=0.1, schedule="cosine", grad_clip=1.0
    )
    res = train(model, data, cfg, callbacks=[cb], emit=lambda a, r: rows.extend(r))
    assert res.status == "ok" and cb.steps == 12 and cb.epochs == [0, 1, 2, 3]
    assert [r.step for r in rows] == [0, 1, 2, 3]


def test_nan_loss_is_a_status_not_a_crash():
    data = load_data("synthetic", n_train=32, n_test=8, dim=4, num_classes=2)
    data.train[0][5, 0] = float("nan")
    model = deqbench.models.create("fc_deq_tiny", in_shape=(4,), num_outputs=2)
    configure(model, SolverConfig("fixed_point", max_iter=10, tol=1e-4))
    res = train(model, data, TrainConfig(epochs=2, batch_size=32, eval_before=False))
    # the NaN input reaches the solver first: its residual is named, the loss of z0 is finite
    assert res.status == "nan" and "forward solver produced a non-finite residual" in res.note


def test_divergent_forward_is_reported_as_diverged():
    torch.manual_seed(2)
    data = load_data("synthetic", n_train=32, n_test=8, dim=4, num_classes=2)
    model = deqbench.models.create("fc_deq_tiny", in_shape=(4,), num_outputs=2, activation="relu")
    with torch.no_grad():
        W = model.deq.cell.W.weight
        W.copy_(torch.eye(W.shape[0]) * 50.0)  # relu(50 z + u) blows up
        model.U.bias.fill_(1.0)
    configure(model, SolverConfig("fixed_point", max_iter=200, tol=1e-4))
    res = train(model, data, TrainConfig(epochs=1, batch_size=32, eval_before=False))
    assert res.status == "diverged", res
    assert model.last_forward_stats.status == "diverged"


def test_post_step_hook_is_called():
    calls = []

    class Proj(torch.nn.Module):
        def post_step(self):
            calls.append(1)

    data = load_data("synthetic", n_train=32, n_test=8, dim=4, num_classes=2)
    model = deqbench.models.create("fc_deq_tiny", in_shape=(4,), num_outputs=2)
    model.proj = Proj()
    configure(model, SolverConfig("fixed_point", max_iter=10, tol=1e-4))
    train(model, data, TrainConfig(epochs=1, batch_size=8, eval_before=False))
    assert len(calls) == 4
