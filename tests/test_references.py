"""The float64 gradient reference of the ``backward`` analysis: solved to its
tolerance by robust methods whatever the model's solver settings, its residuals checked, and
never the basis of an accuracy figure when it did not converge."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import deqbench
from deqbench.analyses.base import CellContext
from deqbench.data.base import DataBundle
from deqbench.deq import BackwardConfig, SolverConfig, configure
from deqbench.performance.gradients import (
    CellModel,
    InnerProductLoss,
    gradient_accuracy,
    reference_gradient,
)

GRAD = ("grad_rel_error", "grad_cosine")


@pytest.fixture(autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _mondeq(backward: str = "fixed_point") -> nn.Module:
    """A float64 monDEQ whose Jacobian has spectral radius ~4: plain iteration diverges on the
    adjoint, the splitting solvers and Anderson converge (a third-party monDEQ)."""
    torch.manual_seed(0)
    m = deqbench.models.create("mondeq_fc_tiny", in_shape=(12,), num_outputs=3, width=16)
    with torch.no_grad():
        m.deq.cell.B.mul_(3.0)
        assert float(torch.linalg.eigvals(m.deq.cell.weight()).abs().max()) > 2
    m = m.double()
    pr = {"alpha": 1.0}
    configure(
        m,
        SolverConfig("peaceman_rachford", 500, 1e-10, options=pr),
        BackwardConfig(
            "ift",
            solver=backward,
            max_iter=200,
            tol=1e-8,
            options=pr if backward == "peaceman_rachford" else {},
        ),
    )
    return m


def _data(n: int = 8) -> DataBundle:
    g = torch.Generator().manual_seed(1)
    X = torch.rand(n, 12, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (n,), generator=g)
    return DataBundle("toy", (X, y), (X, y), (12,), 3)


def _ctx(model: nn.Module, data: DataBundle) -> CellContext:
    cell = {"model": {"name": "mondeq_fc_tiny"}, "train": {"epochs": 0, "batch_size": 8}}
    return CellContext(model, data, torch.device("cpu"), torch.float64, 0, "c", cell)


def _loss_fd(model: nn.Module, x, y, v: list[torch.Tensor], eps: float = 1e-6) -> float:
    """Central difference of the training loss along v (forward solved to 1e-14)."""
    params = [p for p in model.parameters() if p.requires_grad]

    def loss(s: float) -> float:
        with torch.no_grad():
            for p, d in zip(params, v):
                p.add_(s * d)
            out = float(nn.functional.cross_entropy(model(x), y))
            for p, d in zip(params, v):
                p.sub_(s * d)
        return out

    return (loss(eps) - loss(-eps)) / (2 * eps)


def test_reference_is_right_where_plain_iteration_diverges_on_the_adjoint():
    m = _mondeq("fixed_point")
    x, y = _data().train
    g_ref, info = reference_gradient(m, x, y)
    # finite differences of the loss along random directions
    probe = _mondeq()
    configure(probe, SolverConfig("peaceman_rachford", 3000, 1e-14, options={"alpha": 1.0}))
    gen = torch.Generator().manual_seed(2)
    for _ in range(2):
        v = [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in probe.parameters()]
        fd = _loss_fd(probe, x, y, v)
        dot = float(g_ref.vec @ torch.cat([d.reshape(-1) for d in v]))
        assert dot == pytest.approx(fd, rel=1e-6, abs=1e-9)
    assert info["backward_rel_residual"] < 1e-12 and info["forward_rel_residual"] < 1e-12
    assert info["converged"] and info["note"] == ""
    assert info["adjoint_method"] == "dense"  # 16 state entries: a direct solve
    # the Anderson path (no dense solve) agrees
    g_and, info_a = reference_gradient(m, x, y, dense_max=0)
    assert info_a["converged"] and info_a["adjoint_method"] == "anderson"
    assert gradient_accuracy(g_and, g_ref)[1] < 1e-9
    # the model's own fixed_point adjoint is what is wrong, not the reference
    g_fp, info_fp = reference_gradient(m, x, y, adjoint_solver="fixed_point", max_iter=200)
    assert not info_fp["converged"] and "adjoint did not converge" in info_fp["note"]
    assert gradient_accuracy(g_fp, g_ref)[1] > 0.1


def test_backward_analysis_ranks_against_a_converged_reference_and_flags_diverged_modes():
    m = _mondeq("fixed_point")  # the cell's adjoint: plain iteration, diverges
    a = deqbench.analyses.get("backward")(
        {
            "modes": [
                {"name": "ift", "label": "ift-fixed_point"},
                {"name": "ift", "solver": "anderson", "label": "ift-anderson"},
                {
                    "name": "ift",
                    "solver": "peaceman_rachford",
                    "options": {"alpha": 1.0},
                    "label": "ift-pr",
                },
                {"name": "jfb"},
            ],
            "repeats": 1,
            "warmup": 0,
            "memory": False,
            "memory_series": [],
            "at": ["init"],
        }
    )
    rows = list(a.before_training(_ctx(m, _data())))
    err = {r.variant: r for r in rows if r.metric == "grad_rel_error"}
    assert err["ift-anderson"].value < 1e-6 and err["ift-pr"].value < 1e-6
    assert err["ift-anderson"].status == err["ift-pr"].status == "ok"
    # the diverged adjoint ranks last, not first, and all its rows are flagged with the cause
    assert err["ift-fixed_point"].value > 0.1
    assert err["ift-fixed_point"].value > max(err["ift-anderson"].value, err["ift-pr"].value)
    (conv,) = [r for r in rows if r.metric == "reference_converged"]
    assert conv.status == "ok" and conv.value == 1.0
    fp = [r for r in rows if r.variant == "ift-fixed_point"]
    assert fp and all(r.status == "flagged" for r in fp)
    assert "adjoint did not converge" in fp[0].note and "\n" not in fp[0].note
    assert all(r.status == "ok" for r in rows if r.variant in ("ift-anderson", "ift-pr"))


def test_starved_reference_gives_error_rows_and_no_accuracy_figures():
    m = _mondeq("anderson")
    x, y = _data().train
    _, info = reference_gradient(m, x, y, max_iter=2, dense_max=0)
    assert not info["converged"] and "did not converge" in info["note"]
    a = deqbench.analyses.get("backward")(
        {
            "modes": [{"name": "ift"}, {"name": "jfb"}],
            "repeats": 1,
            "warmup": 0,
            "memory": False,
            "memory_series": [],
            "at": ["init"],
            "ref_max_iter": 2,
            "ref_dense_max": 0,
        }
    )
    rows = list(a.before_training(_ctx(m, _data())))
    (conv,) = [r for r in rows if r.metric == "reference_converged"]
    assert conv.status == "error" and math.isnan(conv.value) and "ref_max_iter" in conv.note
    ref = [r for r in rows if r.variant == "reference" and "residual" in r.metric]
    assert ref and all(r.status == "flagged" for r in ref)
    acc = [r for r in rows if r.metric in GRAD]
    assert len(acc) == 4
    assert all(r.status == "error" and math.isnan(r.value) for r in acc)
    assert all("no gradient reference" in r.note for r in acc)
    # the modes' own measurements are still there (the ift mode's solves converged)
    own = [r for r in rows if r.variant == "ift-tol=1e-08" and r.metric not in GRAD]
    assert own and all(r.status == "ok" for r in own)


def test_reference_checks_the_dense_solve_against_the_true_map():
    """A cell coupling the samples (batch mean): the per-sample dense Jacobian is wrong, the
    residual check sees it and Anderson finishes the solve."""

    class Coupled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.W = nn.Parameter(
                0.3 * torch.randn(6, 6, generator=torch.Generator().manual_seed(3))
            )

        def forward(self, z, u):
            return torch.tanh(z @ self.W.T + u + 0.5 * z.mean(0, keepdim=True))

    model = CellModel(Coupled())
    gen = torch.Generator().manual_seed(4)
    x, r = torch.randn(5, 6, generator=gen), torch.randn(5, 6, generator=gen)
    g, info = reference_gradient(model, x, r, InnerProductLoss(), tol=1e-11)
    assert info["converged"] and info["adjoint_method"] == "dense+anderson"
    g_and, _ = reference_gradient(model, x, r, InnerProductLoss(), tol=1e-11, dense_max=0)
    assert gradient_accuracy(g, g_and)[1] < 1e-9


def test_reference_forward_falls_back_when_the_named_solver_diverges():
    """Plain iteration diverges on the forward (spectral radius 1.5): the reference goes on
    with a dense Newton polish (small state) or Broyden and still converges."""

    class Expanding(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            w = torch.randn(8, 8, generator=torch.Generator().manual_seed(3))
            self.W = nn.Parameter(1.5 * w / torch.linalg.eigvals(w).abs().max())

        def forward(self, z, u):
            return torch.tanh(z @ self.W.T + u)

    model = CellModel(Expanding(), SolverConfig("fixed_point", 50, 1e-4))
    gen = torch.Generator().manual_seed(4)
    x, r = torch.randn(6, 8, generator=gen), torch.randn(6, 8, generator=gen)
    kw = {"solver": "fixed_point", "max_iter": 300}
    g, info = reference_gradient(model, x, r, InnerProductLoss(), **kw)
    assert info["converged"] and info["forward_method"] == "fixed_point+newton"
    g_b, info_b = reference_gradient(model, x, r, InnerProductLoss(), dense_max=0, **kw)
    assert info_b["converged"] and info_b["forward_method"] == "fixed_point+broyden"
    assert info_b["adjoint_method"] == "anderson"
    assert gradient_accuracy(g_b, g)[1] < 1e-9
