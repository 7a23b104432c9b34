"""`deqbench validate` checks each DEQ layer's cell directly: a cell that does not keep
z's shape is named under [model.cell] (not [model.forward]), and a cell whose f-evaluations
change buffers (BatchNorm in training mode inside the map) under [model.cell_pure], with the
fix."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import write_suite
from torch import nn

import deqbench
from deqbench.contracts import CLAUSES
from deqbench.deq import DEQLayer, DEQModel
from deqbench.run.plugin_checks import check_all

SUITE = """\
schema: 1
name: cells
device: cpu
threads: 1
seeds: [0]
data: {name: digits, train_subset: 32, test_subset: 16}
defaults:
  model: {name: MODEL}
  solver: {name: fixed_point, max_iter: 20, tol: 1.0e-3}
  backward: {name: ift, solver: fixed_point, max_iter: 20, tol: 1.0e-3}
  train: {epochs: 1, batch_size: 16}
analyses: [metrics]
output: results
"""


class HalfChannels(nn.Module):
    """Drops half of z's channels: (B, C, H, W) -> (B, C/2, H, W)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c // 2, 3, padding=1)

    def forward(self, z, u):
        return torch.tanh(self.conv(z) + u[:, : z.shape[1] // 2])


class BNCell(nn.Module):
    """A conv cell with BatchNorm inside the map."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(c)

    def forward(self, z, u):
        return torch.tanh(self.norm(self.conv(z)) + u)


class CountingCell(nn.Module):
    """Keeps a count of its evaluations in a buffer (not a BatchNorm)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, z, u):
        self.calls += 1
        return torch.tanh(0.1 * self.conv(z) + u)


class LazyCacheCell(nn.Module):
    """Fills a buffer once, on its first evaluation (a lazily refreshed cache): pure after."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.register_buffer("scale", torch.zeros(()))

    def forward(self, z, u):
        if float(self.scale) == 0:
            self.scale.fill_(0.1)
        return torch.tanh(self.scale * self.conv(z) + u)


class Conv(DEQModel):
    def __init__(self, in_shape, num_outputs, cell_cls, c=4):
        super().__init__()
        s = math.isqrt(math.prod(in_shape))
        self.shape = tuple(in_shape) if len(in_shape) == 3 else (1, s, s)
        self.stem = nn.Conv2d(self.shape[0], c, 3, padding=1)
        self.deq = DEQLayer(cell_cls(c))
        self.head = nn.Linear(c * self.shape[1] * self.shape[2], num_outputs)

    def inject(self, x):
        return self.stem(x.reshape(x.shape[0], *self.shape))

    def readout(self, z):
        return self.head(z.flatten(1))


@pytest.fixture
def register():
    added = []

    def add(name, cell_cls):
        def factory(in_shape=(1, 8, 8), num_outputs=10):
            return Conv(in_shape, num_outputs, cell_cls)

        deqbench.models.add(name, factory)
        added.append(name)

    yield add
    for name in added:
        deqbench.models.remove(name)


def _violations(tmp_path, model):
    tmp_path.mkdir(parents=True, exist_ok=True)
    p = write_suite(tmp_path, SUITE, replace={"MODEL": model})
    return check_all([deqbench.load_suite(p)])


def test_the_clauses_exist():
    assert "model.cell" in CLAUSES and "model.cell_pure" in CLAUSES


def test_a_cell_dropping_half_of_zs_channels_is_named_under_model_cell(register, tmp_path):
    register("half_channels_deq", HalfChannels)
    (v,) = _violations(tmp_path, "half_channels_deq")
    assert v.clause == "model.cell", v.line()
    assert v.name == "half_channels_deq" and v.origin == "runtime"
    assert "deq.cell(z, u) returned shape (2, 2, 8, 8) for z of shape (2, 4, 8, 8)" in v.message
    assert "a cell must keep z's shape" in v.message
    assert "[model.cell]" in v.line() and "[model.forward]" not in v.line()


def test_batchnorm_inside_the_cell_is_named_with_the_fix(register, tmp_path):
    register("bn_cell_deq", BNCell)
    (v,) = _violations(tmp_path, "bn_cell_deq")
    assert v.clause == "model.cell_pure", v.line()
    assert "deq.cell.norm (BatchNorm2d in training mode) updates its running statistics" in (
        v.message
    )
    assert "use GroupNorm/LayerNorm inside the cell, or keep BatchNorm outside the map" in v.message


def test_any_buffer_an_f_evaluation_changes_is_named(register, tmp_path):
    register("counting_cell_deq", CountingCell)
    (v,) = _violations(tmp_path, "counting_cell_deq")
    assert v.clause == "model.cell_pure"
    assert "deq.cell (CountingCell) changes its buffer(s) calls on every f-evaluation" in v.message


def test_a_cache_filled_once_and_batchnorm_outside_the_cell_pass(register, tmp_path):
    register("lazy_cell_deq", LazyCacheCell)
    assert _violations(tmp_path, "lazy_cell_deq") == []
    # conv_deq_tiny: BatchNorm in the stem and after the equilibrium, none in the cell
    assert _violations(tmp_path / "conv", "conv_deq_tiny") == []


def test_the_check_leaves_the_modes_and_buffers_of_the_model_as_they_were():
    from deqbench.run.plugin_checks import _check_cell

    model = Conv((1, 8, 8), 10, BNCell).eval()
    u = model.inject(torch.rand(2, 1, 8, 8))
    before = {n: b.clone() for n, b in model.named_buffers()}
    model.deq.cell(torch.zeros_like(u), u)  # eval mode: no update
    clause, message = _check_cell(model, model.deq, u, None, "deq.cell")
    assert clause == "model.cell_pure" and "deq.cell.norm" in message
    assert not model.training and not model.deq.cell.norm.training
    # the second evaluation's update is undone (the first one's stays)
    assert before.keys() == dict(model.named_buffers()).keys()
