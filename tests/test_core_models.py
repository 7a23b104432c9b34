"""Built-in base models and inits: shapes, fixed points, tied baseline, init semantics."""

from __future__ import annotations

import pytest
import torch

import deqbench
from deqbench.deq import SolverConfig, configure
from deqbench.inits.basic import cell_weights
from deqbench.spectral import conv_norm_fft, dense_norm

BASE = ["fc_deq", "fc_deq_tiny", "conv_deq", "conv_deq_tiny", "tied_repeat", "tied_repeat_tiny"]


@pytest.mark.parametrize("name", BASE)
def test_model_forward_backward_shapes(name):
    torch.manual_seed(0)
    m = deqbench.models.create(name, in_shape=(1, 8, 8), num_outputs=10)
    configure(m, SolverConfig("fixed_point", max_iter=30, tol=1e-4))
    x = torch.randn(3, 1, 8, 8)
    out = m(x)
    assert out.shape == (3, 10)
    out.sum().backward()
    assert all(p.grad is not None for p in m.parameters() if p.requires_grad)


@pytest.mark.parametrize("act", ["tanh", "relu", "sigmoid"])
def test_fc_deq_solves_its_equation(act):
    torch.manual_seed(1)
    m = deqbench.models.create("fc_deq_tiny", in_shape=(5,), activation=act).double()
    deqbench.inits.get("spectral")(m, seed=0, target=0.5)
    configure(m, SolverConfig("fixed_point", max_iter=200, tol=1e-13))
    x = torch.randn(4, 5, dtype=torch.float64)
    z, u = m.equilibrium(x)
    W = m.deq.cell.W.weight
    f = {"tanh": torch.tanh, "relu": torch.relu, "sigmoid": torch.sigmoid}[act]
    assert torch.allclose(z, f(z @ W.T + m.U(x)), atol=1e-12)


def test_conv_cell_matches_its_equation():
    torch.manual_seed(2)
    m = deqbench.models.create("conv_deq_tiny").double().eval()
    cell = m.deq.cell
    z = torch.randn(2, 16, 8, 8, dtype=torch.float64)
    x = torch.randn(2, 16, 8, 8, dtype=torch.float64)
    gn = torch.nn.functional.group_norm
    y = gn(
        torch.relu(torch.nn.functional.conv2d(z, cell.conv1.weight, padding=1)),
        4,
        cell.norm1.weight,
        cell.norm1.bias,
    )
    ref = gn(
        torch.relu(
            z
            + gn(
                x + torch.nn.functional.conv2d(y, cell.conv2.weight, padding=1),
                4,
                cell.norm2.weight,
                cell.norm2.bias,
            )
        ),
        4,
        cell.norm3.weight,
        cell.norm3.bias,
    )
    assert torch.allclose(cell(z, x), ref, atol=1e-12)


def test_tied_repeat_applies_cell_n_times():
    torch.manual_seed(3)
    m = deqbench.models.create(
        "tied_repeat_tiny", cell="fc", repeats=4, in_shape=(6,), num_outputs=2
    )
    x = torch.randn(2, 6)
    u = m.base.inject(x)
    z = torch.zeros_like(u)
    for _ in range(4):
        z = m.cell(z, u)
    assert torch.allclose(m(x), m.base.readout(z))
    assert not any(isinstance(mod, deqbench.deq.DEQLayer) for mod in m.modules())


def test_inits():
    torch.manual_seed(4)
    m = deqbench.models.create("fc_deq_tiny", in_shape=(5,))
    deqbench.inits.get("spectral")(m, seed=0, target=0.9)
    assert abs(dense_norm(m.deq.cell.W.weight) - 0.9) < 1e-5
    deqbench.inits.get("small")(m, seed=0)
    w = m.deq.cell.W.weight
    assert abs(float(w.detach().std()) - 0.01) < 0.002
    a = w.clone()
    deqbench.inits.get("small")(m, seed=0)
    assert torch.equal(a, m.deq.cell.W.weight)  # seeded
    deqbench.inits.get("normal")(m, seed=1, std=0.3)
    assert abs(float(m.deq.cell.W.weight.detach().std()) - 0.3) < 0.05
    before = {k: v.clone() for k, v in m.state_dict().items()}
    deqbench.inits.get("default")(m, seed=0)
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())

    c = deqbench.models.create("conv_deq_tiny")
    deqbench.inits.get("spectral")(c, seed=0, target=0.7, input_size=8)
    for p in cell_weights(c):
        assert abs(conv_norm_fft(p, 8) - 0.7) < 1e-5


def test_conv_fft_norm_equals_dense_circular_operator():
    torch.manual_seed(5)
    w = torch.randn(3, 2, 3, 3, dtype=torch.float64)
    n = 5
    # dense matrix of the circular convolution on n x n inputs
    cols = []
    for i in range(2 * n * n):
        e = torch.zeros(2 * n * n, dtype=torch.float64)
        e[i] = 1
        xin = torch.nn.functional.pad(e.view(1, 2, n, n), (1, 1, 1, 1), mode="circular")
        cols.append(torch.nn.functional.conv2d(xin, w).reshape(-1))
    M = torch.stack(cols, 1)
    assert abs(conv_norm_fft(w, n) - float(torch.linalg.matrix_norm(M, ord=2))) < 1e-10


def test_variant_is_its_base_with_other_defaults():
    import inspect
    import pickle

    from deqbench.models import declare_defaults
    from deqbench.models._common import variant
    from deqbench.models.opteq import opteq_deep_conv_tiny

    @declare_defaults(solver="anderson")
    def base(in_shape=(4,), num_outputs: int = 10, width: int = 8, act: str = "tanh"):
        """Base."""
        return (in_shape, num_outputs, width, act)

    @variant(base, width=2, in_shape=(3,))
    def small():
        """Small base."""

    sig = inspect.signature(small)
    assert {k: p.default for k, p in sig.parameters.items()} == {
        "in_shape": (3,),
        "num_outputs": 10,
        "width": 2,
        "act": "tanh",
    }
    assert (
        sig.parameters["width"].annotation == inspect.signature(base).parameters["width"].annotation
    )
    assert small() == ((3,), 10, 2, "tanh")
    assert small((5,), act="relu") == ((5,), 10, 2, "relu")
    assert small(width=7) == ((3,), 10, 7, "tanh")
    assert (small.__name__, small.__doc__) == ("small", "Small base.")
    assert small.deqbench_defaults == base.deqbench_defaults  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="no parameter depth"):
        variant(base, depth=2)
    with pytest.raises(TypeError):
        small(widht=3)
    # a registered variant: the name it is registered under, importable and picklable
    made = deqbench.models.get("opteq_deep_conv_tiny")
    assert made is opteq_deep_conv_tiny and pickle.loads(pickle.dumps(made)) is made
    assert inspect.signature(made).parameters["hidden"].default == (4, 8)
