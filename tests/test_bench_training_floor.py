"""benchmarks/training_floor.py: the counts its floor replays and the data it times on (no
timing)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from deqbench.data.base import DataBundle

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "training_floor.py"


def _module():
    spec = importlib.util.spec_from_file_location("training_floor", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_step_counts_average_the_solver_stats():
    tf = _module()
    stats = [
        {"forward_nstep": 10.0, "backward_nstep": 7.0},
        {"forward_nstep": 13.0, "backward_nstep": 8.0},
        {"forward_nstep": 12.0},  # no adjoint record: 0 VJPs
    ]
    c = tf.step_counts(stats)
    assert c.forward == pytest.approx(35 / 3) and c.adjoint == pytest.approx(5.0)
    assert c.steps == 3
    with pytest.raises(ValueError, match="forward_nstep"):
        tf.step_counts([{"backward_nstep": 3.0}])
    with pytest.raises(ValueError):
        tf.step_counts([])
    assert tf.ratio(6.0, 2.0) == 3.0 and math.isnan(tf.ratio(1.0, 0.0))


def test_tiled_data_covers_every_timed_step_in_one_epoch():
    X, y = torch.arange(10.0).view(10, 1), torch.arange(10)
    data = DataBundle("d", (X, y), (X[:6], y[:6]), (1,), 10)
    t = data.tiled(25, 4)
    assert t.train[0].shape == (30, 1) and t.train[1].shape == (30,)
    assert torch.equal(t.train[0][20:], X) and torch.equal(t.train[1][10:20], y)
    assert t.test[0].shape == (4, 1) and (t.in_shape, t.num_outputs) == ((1,), 10)


def test_floor_step_runs_the_counted_f_evaluations_and_vjps():
    tf = _module()
    import deqbench

    torch.manual_seed(0)
    model = deqbench.models.create("fc_deq_tiny", in_shape=(8,), num_outputs=3)
    cell = next(iter(tf.deq_layers(model))).cell
    calls = {"f": 0}
    cell.register_forward_hook(lambda *a: calls.__setitem__("f", calls["f"] + 1))
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])
    opt = tf.floor_optimizer(model, cuda=False)
    before = [p.detach().clone() for p in model.parameters()]
    loss = tf.floor_step(model, x, y, 6, 4, opt)()
    assert calls["f"] == 6 + 1  # no_grad evaluations + the one with grad
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters())
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_floor_step_follows_a_chain_of_equilibria():
    """pcdeq_mc (three DEQ layers): each layer's own counts, the injections' gradients through
    the links (every parameter gets one)."""
    tf = _module()
    import deqbench

    torch.manual_seed(0)
    model = deqbench.models.create("pcdeq_mc", in_shape=(64,), num_outputs=3, channels=[2, 3, 4])
    calls = []
    for k, layer in enumerate(tf.deq_layers(model)):
        layer.cell.register_forward_hook(lambda *a, k=k: calls.append(k))
    x, y = torch.rand(4, 64), torch.tensor([0, 1, 2, 0])
    opt = tf.floor_optimizer(model, cuda=False)
    loss = tf.floor_step(model, x, y, [3, 5, 2], [1, 2, 4], opt)()
    # forward: 3, 5, 2 no_grad evaluations; backward from the last: one with grad each
    assert calls == [0] * 3 + [1] * 5 + [2] * 2 + [2, 1, 0]
    assert torch.isfinite(loss)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    with pytest.raises(ValueError, match="counts for 1/1 layers; the model has 3"):
        tf.floor_step(model, x, y, 3, 1, opt)
