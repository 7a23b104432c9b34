"""The DEQ layer's automatic CUDA-graph path: same answers as eager, recaptures or
falls back when it must, says which path ran. GPU only (CI has none); the static step bodies
themselves are tested on CPU in test_solvers.py / test_broyden_graph.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from deqbench.deq import DEQLayer, Runtime, SolverConfig
from deqbench.solvers import get as get_solver
from deqbench.solvers.base import supports_graph

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


class TanhCell(nn.Module):
    def __init__(self, d: int, scale: float = 0.7) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        w = torch.randn(d, d, generator=g)
        self.W = nn.Parameter(w / torch.linalg.matrix_norm(w, 2) * scale)

    def forward(self, z: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return torch.tanh(z @ self.W.T + u)


class SyncCell(TanhCell):
    """Reads a value on the host every call: cannot be captured."""

    def forward(self, z: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        if float(z.abs().max()) > 1e9:  # host sync
            raise AssertionError
        return super().forward(z, u)


GRAPH_SOLVERS = [n for n in ("fixed_point", "anderson", "broyden") if supports_graph(get_solver(n))]


def _scribble() -> None:
    """Overwrite freed GPU memory: a replayed graph must not read a tensor of an earlier
    solve that is gone (the bug this catches returned rel residual 1.0 from every replay)."""
    torch.cuda.empty_cache()
    junk = [torch.full((1 << 22,), float("nan"), device="cuda") for _ in range(8)]
    del junk


def _pair(cell: nn.Module, solver: str, steps: str | int = "auto"):
    opts = {} if steps == "auto" else {"graph_steps": steps}
    cfg = SolverConfig(solver, max_iter=60, tol=1e-5, options=opts)
    fast = DEQLayer(cell, cfg).cuda()
    slow = DEQLayer(cell, SolverConfig(solver, max_iter=60, tol=1e-5)).cuda()
    slow.set_runtime(Runtime(cuda_graph="off"))
    return fast, slow


@pytest.mark.parametrize("solver", GRAPH_SOLVERS)
@pytest.mark.parametrize("steps", ["auto", 1, 3])
@pytest.mark.parametrize("shape", [(32, 64), (128, 8192)])  # the second: Anderson's chunked Gram
def test_graph_path_matches_eager_and_replays(solver, steps, shape):
    cell = TanhCell(shape[1]).cuda()
    fast, slow = _pair(cell, solver, steps)
    for seed in range(3):  # the first call captures, the next ones replay the cached graph
        u = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).cuda()
        z, st = fast.solve(u, torch.zeros_like(u))
        ze, ste = slow.solve(u, torch.zeros_like(u))
        _scribble()
        assert st.path == "graph" and ste.path == "eager"
        assert st.converged and ste.converged
        assert float(st.rel_residual.max()) < 1e-5
        # the same iteration (Anderson's static ring masks unused slots instead of growing
        # the system: float32 rounding may move the crossing by a step)
        to_tol = st.extra.get("nstep_to_tol", st.nstep)
        assert abs(to_tol - ste.extra.get("nstep_to_tol", ste.nstep)) <= 1
        assert st.nstep <= 60
        torch.testing.assert_close(z, ze, rtol=1e-3, atol=1e-4)
    assert len(fast._static_maps) == 1


def test_new_batch_size_and_new_parameter_storage_recapture():
    cell = TanhCell(32).cuda()
    fast, slow = _pair(cell, "anderson")
    for b in (16, 8, 16):
        u = torch.randn(b, 32, device="cuda")
        z, st = fast.solve(u, torch.zeros_like(u))
        ze, _ = slow.solve(u, torch.zeros_like(u))
        assert st.path == "graph"
        torch.testing.assert_close(z, ze, rtol=1e-3, atol=1e-4)
    assert len(fast._static_maps) == 2
    # replace the parameter's storage (not in place): the old graph must not be replayed
    with torch.no_grad():
        cell.W = nn.Parameter(cell.W.detach().clone() * 0.5)
    u = torch.randn(16, 32, device="cuda")
    z, st = fast.solve(u, torch.zeros_like(u))
    ze, _ = slow.solve(u, torch.zeros_like(u))
    torch.testing.assert_close(z, ze, rtol=1e-3, atol=1e-4)
    # an in-place update (what optimisers do) is seen by the replayed graph
    with torch.no_grad():
        cell.W.mul_(0.9)
    z, st = fast.solve(u, torch.zeros_like(u))
    ze, _ = slow.solve(u, torch.zeros_like(u))
    assert st.path == "graph"
    torch.testing.assert_close(z, ze, rtol=1e-3, atol=1e-4)


def test_uncapturable_cell_falls_back_to_eager_once():
    cell = SyncCell(32).cuda()
    fast, slow = _pair(cell, "fixed_point")
    u = torch.randn(8, 32, device="cuda")
    z, st = fast.solve(u, torch.zeros_like(u))
    ze, _ = slow.solve(u, torch.zeros_like(u))
    assert st.path == "eager" and st.converged
    torch.testing.assert_close(z, ze)
    assert fast._no_graph  # remembered: the next solve goes eager at once
    z, st = fast.solve(u, torch.zeros_like(u))
    assert st.path == "eager"


def test_training_through_graph_forward_matches_eager():
    """IFT training steps with the graph forward give the eager gradients."""
    from deqbench.deq import BackwardConfig

    torch.manual_seed(0)
    cells = [TanhCell(48).cuda(), TanhCell(48).cuda()]
    cells[1].load_state_dict(cells[0].state_dict())
    layers = [
        DEQLayer(c, SolverConfig("anderson", max_iter=60, tol=1e-6), BackwardConfig(tol=1e-6))
        for c in cells
    ]
    layers[1].set_runtime(Runtime(cuda_graph="off"))
    opts = [torch.optim.SGD(c.parameters(), lr=0.1) for c in cells]
    for step in range(3):
        u = torch.randn(16, 48, generator=torch.Generator().manual_seed(step)).cuda()
        for layer, opt in zip(layers, opts):
            opt.zero_grad()
            layer(u).square().sum().backward()
            opt.step()
            _scribble()
        assert layers[0].last_forward_stats.path == "graph"
        assert layers[0].last_backward_stats.path == "graph"
        assert layers[1].last_backward_stats.path == "eager"
        assert layers[0].last_backward_stats.converged == layers[1].last_backward_stats.converged
        torch.testing.assert_close(cells[0].W, cells[1].W, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("adjoint", ["fixed_point", "anderson"])
def test_graph_adjoint_gradients_match_eager(adjoint):
    """Parameter and input gradients through the captured adjoint equal the eager ones, over
    several backwards with new inputs (replays of the cached adjoint)."""
    from deqbench.deq import BackwardConfig

    cell = TanhCell(40).cuda()
    fast = DEQLayer(cell, SolverConfig("anderson", max_iter=80, tol=1e-7),
                    BackwardConfig(solver=adjoint, max_iter=80, tol=1e-7))  # fmt: skip
    slow = DEQLayer(cell, SolverConfig("anderson", max_iter=80, tol=1e-7),
                    BackwardConfig(solver=adjoint, max_iter=80, tol=1e-7))  # fmt: skip
    slow.set_runtime(Runtime(cuda_graph="off"))
    for seed in range(3):
        x = torch.randn(24, 40, generator=torch.Generator().manual_seed(seed)).cuda()
        R = torch.randn(24, 40, generator=torch.Generator().manual_seed(10 + seed)).cuda()
        got = []
        for layer in (fast, slow):
            u = x.clone().requires_grad_()
            (gw, gu) = torch.autograd.grad((layer(u) * R).sum(), [cell.W, u])
            got.append((gw, gu, layer.last_backward_stats))
        _scribble()
        assert got[0][2].path == "graph" and got[1][2].path == "eager"
        torch.testing.assert_close(got[0][0], got[1][0], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(got[0][1], got[1][1], rtol=1e-4, atol=1e-6)


def test_bf16_runtime_keeps_float32_state():
    cell = TanhCell(64).cuda()
    layer = DEQLayer(cell, SolverConfig("anderson", max_iter=60, tol=1e-2))
    layer.set_runtime(Runtime(amp="bf16"))
    u = torch.randn(32, 64, device="cuda")
    z, st = layer.solve(u, torch.zeros_like(u))
    assert z.dtype == torch.float32 and st.converged and st.path == "graph"
    ref = DEQLayer(cell, SolverConfig("anderson", max_iter=60, tol=1e-6))
    zr, _ = ref.solve(u, torch.zeros_like(u))
    assert float((z - zr).norm() / zr.norm()) < 3e-2


def test_substituted_parameters_stay_eager():
    """Under functional_call (landscapes, finite-difference Hessians) the parameters are new
    tensors at every call: no capture per call, the eager path, the same answer."""
    from torch.func import functional_call

    cell = TanhCell(32).cuda()
    layer = DEQLayer(cell, SolverConfig("anderson", max_iter=60, tol=1e-6))
    u = torch.randn(8, 32, device="cuda")
    for scale in (1.0, 0.9):
        w = {"W": cell.W.detach() * scale}
        z = functional_call(layer, {f"cell.{k}": v for k, v in w.items()}, (u,), strict=False)
        st = layer.last_forward_stats
        assert st.path == "eager" and st.converged
        zr = torch.zeros_like(u)
        for _ in range(200):
            zr = torch.tanh(zr @ w["W"].T + u)
        torch.testing.assert_close(z, zr, rtol=1e-4, atol=1e-5)
    assert not layer._static_maps


def test_cells_with_python_state_opt_out():
    """OptEq's units cache their scale and refresh power-iteration vectors in Python: its cell
    declares cuda_graph_safe = False and its solves and adjoints stay eager."""
    import deqbench

    model = deqbench.models.create("opteq_tiny").cuda()
    x = torch.randn(4, *model.in_shape, device="cuda") if hasattr(model, "in_shape") else None
    if x is None:
        pytest.skip("opteq_tiny has no in_shape attribute")
    model(x).sum().backward()
    assert model.deq.last_forward_stats.path == "eager"
    assert model.deq.last_backward_stats.path == "eager"
