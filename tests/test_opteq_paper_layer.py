"""OptEq as its paper defines it: no norm bound (``gamma: null``, W is the raw parameter) and
small initial operator norms (``init_norm``, the paper's section 7.4)."""

from __future__ import annotations

import pytest
import torch

import deqbench
from deqbench.errors import ConfigError
from deqbench.models.opteq import OptEqConvUnit, OptEqUnit

F64 = torch.float64


def _dense_norm(W: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(W.detach().double(), ord=2))


def _conv_norm(unit: OptEqConvUnit) -> float:
    """Exact ||W||_2 of the zero-padded conv operator from its dense matrix."""
    h, w = unit.spatial
    n = unit.state * h * w
    eye = torch.eye(n, dtype=F64).reshape(n, unit.state, h, w)
    with torch.no_grad():
        cols = unit.apply_W(eye, unit.weight().detach().double()).reshape(n, -1)
    return float(torch.linalg.matrix_norm(cols, ord=2))


def test_without_a_bound_w_is_the_raw_parameter() -> None:
    torch.manual_seed(0)
    unit = OptEqUnit(5, 7, alpha=0.8, gamma=None).to(F64)
    with torch.no_grad():
        unit.V.mul_(10.0)  # ||V||_2 well above 1: a bound would scale it down
    assert unit.weight() is unit.V
    z, u = torch.randn(3, 5, dtype=F64), torch.randn(3, 7, dtype=F64)
    V = unit.V.detach()
    want = 0.8 * torch.relu(z @ V.T + u) @ V + 0.2 * z
    assert torch.allclose(unit(z, u), want, rtol=1e-12, atol=1e-12)
    assert unit.weight_norm() == pytest.approx(_dense_norm(V), rel=1e-9)
    assert unit.weight_norm() > 1.0
    # the same V under the default bound is scaled to ||W||_2 = gamma
    bounded = OptEqUnit(5, 7, alpha=0.8, gamma=0.9).to(F64)
    with torch.no_grad():
        bounded.V.copy_(V)
    bounded.refresh()
    assert _dense_norm(bounded.weight()) == pytest.approx(0.9, rel=1e-9)


def test_model_without_bound_reports_inf_gamma_and_trains() -> None:
    from deqbench.data.base import load_data
    from deqbench.deq import BackwardConfig, SolverConfig, configure
    from deqbench.run.train import TrainConfig, train

    torch.manual_seed(1)
    data = load_data("synthetic", n_train=64, n_test=16, dim=20, num_classes=3)
    m = deqbench.models.create(
        "opteq_tiny", in_shape=data.in_shape, num_outputs=3, gamma=None, init_norm=0.1
    )
    assert m.gamma == float("inf")
    configure(m, SolverConfig("fixed_point", max_iter=50, tol=1e-4), BackwardConfig("ift"))
    before = [u.V.detach().clone() for u in m.units]
    res = train(m, data, TrainConfig(epochs=1, batch_size=32, lr=0.05, eval_before=False))
    assert res.status == "ok" and res.steps == 2
    for u, v0 in zip(m.units, before):
        assert not torch.equal(u.V.detach(), v0)
        assert u.weight() is u.V  # still unscaled after the optimiser steps
        assert m.weight_norms()[0] == pytest.approx(_dense_norm(u.V), rel=1e-6)


@pytest.mark.parametrize("gamma", [None, 0.9])
def test_init_norm_sets_each_initial_operator_norm(gamma) -> None:
    torch.manual_seed(2)
    m = deqbench.models.create("opteq_deep_tiny", in_shape=(64,), gamma=gamma, init_norm=0.05)
    for u in m.units:
        assert _dense_norm(u.weight()) == pytest.approx(0.05, rel=1e-6)
    torch.manual_seed(2)
    c = deqbench.models.create(
        "opteq_deep_conv_tiny", in_shape=(1, 6, 6), gamma=gamma, init_norm=0.05
    )
    for u in c.units:
        assert _conv_norm(u) == pytest.approx(0.05, rel=1e-4)
    # the default init's norms are far larger
    d = deqbench.models.create("opteq_deep_tiny", in_shape=(64,), gamma=None)
    assert min(_dense_norm(u.weight()) for u in d.units) > 0.2


def test_init_norm_above_the_bound_is_refused() -> None:
    with pytest.raises(ConfigError, match="init_norm 0.95 is above the norm bound gamma 0.9"):
        deqbench.models.create("opteq_tiny", gamma=0.9, init_norm=0.95)
    with pytest.raises(ConfigError, match="gamma"):
        deqbench.models.create("opteq_tiny", gamma=0.0)
