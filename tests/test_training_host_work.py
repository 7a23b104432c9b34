"""The host work of a training step: the CPU tracker's numpy bookkeeping against the torch code,
torch ops per solver step, the optimiser's fused step, the IFT backward's own-parameter path,
and a few training steps against a plain reference loop written here (float64)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import deqbench
import deqbench.core.backward as core_backward
from deqbench.core.registry import solvers
from deqbench.data.base import DataBundle
from deqbench.deq import BackwardConfig, DEQLayer, SolverConfig, configure
from deqbench.run.train import TrainConfig, make_optimizer, train
from deqbench.solvers import tracker as tracker_mod

EPS = 1e-9


# -- the CPU bookkeeping against the torch code ----------------------------------------------


def _oscillating_map(B: int, dtype: torch.dtype):
    """f(z) = J z + c per sample with J = 0.97 P R(theta) P^-1 (R a rotation, P = diag(1, 6)):
    each residual oscillates as it decays, in a phase of its own (theta per sample), so the
    lowest iterate differs per sample and not every step improves every sample."""
    theta = torch.linspace(0.4, 1.3, B, dtype=torch.float64)
    cos, sin = torch.cos(theta), torch.sin(theta)
    J = torch.stack([torch.stack([cos, -6 * sin], 1), torch.stack([sin / 6, cos], 1)], 1)
    J = (0.97 * J).to(dtype)
    c = torch.linspace(-1.0, 1.0, 2 * B, dtype=dtype).view(B, 2)

    def f(z: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bij,bj->bi", J, z) + c

    return f


def _solve(monkeypatch, host: bool, solver: str, dtype: torch.dtype, **opts):
    monkeypatch.setattr(tracker_mod, "HOST_ENABLED", host)
    f = _oscillating_map(6, dtype)
    z0 = torch.zeros(6, 2, dtype=dtype)
    return solvers.get(solver)(f, z0, max_iter=25, tol=1e-5, **opts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("returns", ["lowest", "last"])
@pytest.mark.parametrize("stop_mode", ["rel", "abs"])
@pytest.mark.parametrize("stop", ["sample_max", "batch_fro", "batch_mean"])
def test_cpu_bookkeeping_matches_the_torch_code_bitwise(monkeypatch, stop, stop_mode, returns,
                                                        dtype):  # fmt: skip
    for solver, extra in [("fixed_point", {}), ("fixed_point", {"check_every": 3}),
                          ("anderson", {})]:  # fmt: skip
        opts = dict(stop=stop, returns=returns, stop_mode=stop_mode, **extra)
        z_ref, ref = _solve(monkeypatch, False, solver, dtype, **opts)
        z, st = _solve(monkeypatch, True, solver, dtype, **opts)
        what = (solver, extra)
        assert torch.equal(z, z_ref), what
        assert (st.nstep, st.status, st.converged, st.lowest_step) == (
            ref.nstep, ref.status, ref.converged, ref.lowest_step
        ), what  # fmt: skip
        for name in ("abs_trace", "rel_trace", "abs_residual", "rel_residual"):
            assert torch.equal(getattr(st, name), getattr(ref, name)), (what, name)
        assert torch.equal(st.extra["lowest_steps"], ref.extra["lowest_steps"]), what
        assert (st.fz_norm is None) == (ref.fz_norm is None), what
        if st.fz_norm is not None:
            assert torch.equal(st.fz_norm, ref.fz_norm), what
    # the map makes the lowest iterate differ per sample somewhere (the masks are exercised)
    _, st = _solve(monkeypatch, True, "fixed_point", dtype, stop=stop, stop_mode=stop_mode)
    assert (st.extra["lowest_steps"] != st.extra["lowest_steps"][0]).any() or returns == "last"


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def test_a_cpu_solver_step_dispatches_four_torch_ops_besides_f():
    """Per fixed-point step under batch_fro (rel): f's two ops, then f(x) - x, the two
    per-sample norms and the kept pair's batch norms; the rest of the bookkeeping is numpy
    (the torch code dispatched about twenty per step)."""
    c = torch.ones(64, 80)

    def f(z):
        return z * 0.5 + c  # two ops

    fp = solvers.get("fixed_point")

    def ops(steps: int) -> int:
        with _Ops() as mode:
            fp(f, torch.zeros(64, 80), max_iter=steps, tol=0.0, stop="batch_fro")
        return mode.n

    per_step = (ops(12) - ops(4)) / 8
    assert per_step <= 2 + 4, per_step


# -- the optimiser ------------------------------------------------------------------------------


def test_every_optimizer_steps_with_foreach_and_bumps_the_parameter_versions():
    """One call over all parameters (foreach), never torch's fused Adam kernel: that one leaves
    the parameters' version counters where they were, and caches keyed by the version (OptEq's
    norm scale) would then serve the weights before the step."""
    model = torch.nn.Linear(3, 2)
    for name in ("adam", "adamw", "sgd"):
        opt = make_optimizer(model, TrainConfig(optimizer=name))
        assert opt.param_groups[0]["foreach"] is True and not opt.param_groups[0].get("fused")
        before = [p._version for p in model.parameters()]
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        assert all(p._version > v for p, v in zip(model.parameters(), before)), name


# -- the IFT backward's f graph ----------------------------------------------------------------


def test_ift_backward_runs_the_cell_itself_unless_a_parameter_has_a_hook(monkeypatch):
    calls: list[int] = []
    real = core_backward.functional_call

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(core_backward, "functional_call", counted)
    torch.manual_seed(0)
    cell = _TanhCell(6)
    layer = DEQLayer(
        cell,
        SolverConfig("fixed_point", max_iter=80, tol=1e-8),
        BackwardConfig("ift", solver="fixed_point", max_iter=80, tol=1e-8),
    )
    u = torch.randn(4, 6, requires_grad=True)

    def grads() -> list[torch.Tensor]:
        for p in cell.parameters():
            p.grad = None
        u.grad = None
        (layer(u, torch.zeros_like(u)) ** 2).sum().backward()
        return [p.grad.clone() for p in cell.parameters()] + [u.grad.clone()]

    plain = grads()
    assert calls == []  # the cell's own call: no functional_call rebinding
    seen: list[torch.Tensor] = []
    p0 = next(cell.parameters())
    handle = p0.register_hook(lambda g: seen.append(g.clone()))
    hooked = grads()
    handle.remove()
    assert calls == [1]  # a hooked parameter: detached copies, as before
    assert len(seen) == 1  # the hook ran once, on the accumulated gradient
    for a, b in zip(plain, hooked):
        assert torch.equal(a, b)


class _TanhCell(torch.nn.Module):
    """f(z, u) = tanh(W z + u) with a contracting W."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.W = torch.nn.Parameter(0.3 * torch.randn(d, d) / d**0.5)
        self.b = torch.nn.Parameter(torch.zeros(d))

    def forward(self, z: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return torch.tanh(z @ self.W.T + self.b + u)


# -- training steps against a plain reference loop ---------------------------------------------


def _reference_solve(f, x0, tol, max_iter, rule):
    """Fixed-point iteration x <- f(x) returning, per sample, the measured iterate x of lowest
    rel residual (ties: the newer), stopped at the first step whose returned iterates meet
    ``rule`` (sample_max: every rel residual below tol; batch_fro: ||abs||_2 / ||f(x)||_2
    below tol). Returns (iterate, f-evaluations)."""
    x, low = x0, None
    ret = ret_a = ret_n = ret_r = None
    for k in range(max_iter):
        fx = f(x)
        a = torch.sqrt(((fx - x) ** 2).flatten(1).sum(1))
        n = torch.sqrt((fx**2).flatten(1).sum(1))
        r = a / (n + EPS)
        take = torch.ones_like(r, dtype=torch.bool) if low is None else r <= low
        low = r if low is None else torch.minimum(r, low)
        m = take.view(-1, *([1] * (x.dim() - 1)))
        ret = x if ret is None else torch.where(m, x, ret)
        ret_a = a if ret_a is None else torch.where(take, a, ret_a)
        ret_n = n if ret_n is None else torch.where(take, n, ret_n)
        ret_r = r if ret_r is None else torch.where(take, r, ret_r)
        if rule == "batch_fro":
            value = torch.sqrt((ret_a**2).sum()) / (torch.sqrt((ret_n**2).sum()) + EPS)
        else:
            value = ret_r.max()
        if value < tol:
            return ret, k + 1
        x = fx
    return ret, max_iter


def _adjoint_map(fz, zl, g, w):
    """w -> J^T w + g, J = df/dz at the solution (one VJP)."""
    (gz,) = torch.autograd.grad(fz, zl, w, retain_graph=True)
    return gz + g


def _reference_adamw(params, state, lr, wd, betas=(0.9, 0.999), eps=1e-8):
    for p in params:
        st = state.setdefault(p, {"t": 0, "m": torch.zeros_like(p), "v": torch.zeros_like(p)})
        st["t"] += 1
        g = p.grad
        st["m"] = betas[0] * st["m"] + (1 - betas[0]) * g
        st["v"] = betas[1] * st["v"] + (1 - betas[1]) * g * g
        mhat = st["m"] / (1 - betas[0] ** st["t"])
        vhat = st["v"] / (1 - betas[1] ** st["t"])
        with torch.no_grad():
            p.mul_(1 - lr * wd)
            p.sub_(lr * mhat / (vhat.sqrt() + eps))


def _reference_training(model, X, y, steps, bs, seed, tol, max_iter, lr, wd):
    """What a training step is: the injection, the forward solve (batch_fro), the loss, the IFT
    adjoint w = J^T w + g by plain iteration from g (sample_max), the parameter and injection
    VJP, AdamW and the projection. Per step: loss, forward and adjoint f-evaluations, z*."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(X.shape[0], generator=gen)
    params = [p for p in model.parameters() if p.requires_grad]
    state: dict = {}
    cell = model.deq.cell
    out = []
    model.train()
    for s in range(steps):
        idx = perm[s * bs : (s + 1) * bs]
        xb, yb = X[idx], y[idx]
        for p in params:
            p.grad = None
        u = model.inject(xb)
        ud = u.detach()
        with torch.no_grad():
            zs, nf = _reference_solve(functools.partial(cell, u=ud), model.z0(ud), tol,
                                      max_iter, "batch_fro")  # fmt: skip
        zr = zs.detach().requires_grad_()
        loss = torch.nn.functional.cross_entropy(model.readout(zr), yb)
        loss.backward()
        g = zr.grad.detach()
        zl = zs.detach().requires_grad_()
        fz = cell(zl, u)
        with torch.no_grad():
            adjoint = functools.partial(_adjoint_map, fz, zl, g)
            w, nb = _reference_solve(adjoint, g.clone(), tol, max_iter, "sample_max")
        fz.backward(w)
        _reference_adamw(params, state, lr, wd)
        cell.post_step()
        out.append((loss.item(), nf, nb, zs.detach().clone()))
    return out


def test_training_steps_match_a_plain_reference_loop():
    """pcdeq_l (width 16) in float64, four AdamW steps of deqbench's training loop against the
    loop above: the same losses (to 1e-10), forward and adjoint f-evaluation counts (exactly),
    equilibria, gradients and parameters (to 1e-9)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    X = torch.rand(128, 1, 8, 8, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (128,), generator=g)
    data = DataBundle("host", (X, y), (X[:32], y[:32]), (1, 8, 8), 4)
    model = deqbench.models.create("pcdeq_l", in_shape=(1, 8, 8), num_outputs=4, width=16)
    model = model.double()
    with torch.no_grad():  # a slower contraction than the init's: several steps per solve
        model.deq.cell.v.mul_(30.0)
        model.deq.cell.g.mul_(30.0)
    tol, max_iter, lr, wd, steps, bs = 1e-7, 200, 1e-2, 0.02, 4, 32
    configure(
        model,
        SolverConfig("fixed_point", max_iter=max_iter, tol=tol, options={"stop": "batch_fro"}),
        BackwardConfig("ift", solver="fixed_point", max_iter=max_iter, tol=tol),
    )
    ref_model = copy.deepcopy(model)
    expected = _reference_training(ref_model, X, y, steps, bs, 0, tol, max_iter, lr, wd)

    seen: list[tuple] = []
    zstar: list[torch.Tensor] = []
    model.deq.register_forward_hook(lambda m, i, o: zstar.append(o.detach().clone()))

    class Steps:
        def on_step(self, ctx, info):
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            seen.append((info.loss, info.deq["forward_nstep"], info.deq["backward_nstep"], grads))
            return ()

        def on_epoch(self, ctx, info):
            return ()

    cfg = TrainConfig(epochs=1, batch_size=bs, optimizer="adamw", lr=lr, weight_decay=wd,
                      eval_before=False, max_steps=steps, eval_batch_size=32)  # fmt: skip
    res = train(model, data, cfg, callbacks=[Steps()], seed=0)
    assert res.status == "ok"
    assert len(seen) == steps
    for s, ((loss, nf, nb, _), (eloss, enf, enb, ez)) in enumerate(zip(seen, expected)):
        assert (nf, nb) == (enf, enb), (s, (nf, nb), (enf, enb))
        assert loss == pytest.approx(eloss, rel=1e-10, abs=1e-12), s
        assert torch.allclose(zstar[s], ez, rtol=0, atol=1e-9), s
    assert max(e[1] for e in expected) >= 5  # the stop test decided several steps per solve
    for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=1e-9), n
    # the last step's gradients (the reference's are still on its parameters)
    for n, q in ref_model.named_parameters():
        assert torch.allclose(seen[-1][3][n], q.grad, rtol=0, atol=1e-9), n
