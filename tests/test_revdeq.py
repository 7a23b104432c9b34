"""RevDEQ (the ``reversible`` forward solver and backward mode) against independent
references on CPU in float64 (BACKWARD_LAB.md 1.6 and 4): the reversal reconstructs the initial
pair; the gradient equals autograd through the same stored (masked) iteration; it tends to the
dense IFT gradient as the forward converges, the difference of the order of the forward residual;
its saved memory does not grow with the number of steps; gradcheck."""

from __future__ import annotations

import pytest
import torch
from lab_helpers import TanhCell, dense_ift_adjoint, one_thread_seeded  # noqa: F401

from deqbench.backward.reversible import reverse
from deqbench.deq import BackwardConfig, DEQLayer, SolverConfig
from deqbench.errors import ConfigError
from deqbench.performance.memory import saved_tensor_bytes

D = 8


def _layer(cell, beta, max_iter, tol=0.0, **opts):
    fwd = SolverConfig("reversible", max_iter=max_iter, tol=tol, options={"beta": beta, **opts})
    return DEQLayer(cell, fwd, BackwardConfig("reversible"))


def _grads(layer, x, zbar):
    """(z, gradient of <z, zbar> w.r.t. the cell's parameters and x, flattened)."""
    x = x.detach().requires_grad_()
    z = layer(x)
    gs = torch.autograd.grad((z * zbar).sum(), [*layer.cell.parameters(), x])
    return z, torch.cat([g.reshape(-1) for g in gs])


def _unrolled_reference(cell, x, beta, steps, zbar):
    """Autograd through the explicit coupled loop, each sample frozen after its own steps."""
    x = x.detach().requires_grad_()
    z = torch.zeros_like(x)
    y, F = z, cell(z, x)
    for k in range(int(steps.max())):
        m = (steps > k).view(-1, 1)
        yn = (1 - beta) * y + beta * F
        zn = (1 - beta) * z + beta * cell(yn, x)
        Fz = cell(zn, x)
        y, z, F = torch.where(m, yn, y), torch.where(m, zn, z), torch.where(m, Fz, F)
    gs = torch.autograd.grad((z * zbar).sum(), [*cell.parameters(), x])
    return z, torch.cat([g.reshape(-1) for g in gs])


def _ift_reference(cell, x, zbar):
    """The dense IFT gradient (lab_helpers.dense_ift_adjoint): grads = w^T df/d(theta, x)."""
    z, w = dense_ift_adjoint(cell, x, zbar)
    xx = x.detach().requires_grad_()
    gs = torch.autograd.grad(cell(z, xx), [*cell.parameters(), xx], w)
    return torch.cat([g.reshape(-1) for g in gs])


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize(("beta", "n"), [(0.5, 14), (0.8, 6), (1.2, 6)])
def test_the_reversal_reconstructs_the_initial_pair(beta, n):
    """Forward N steps, then only reconstruct: float64 states come back to 1e-10. The round-off
    of every reversed half-step is divided by |1 - beta| again, so N is kept where that growth
    stays small (beta 0.5: 2 per half-step; 0.8 and 1.2: 5)."""
    cell = TanhCell()
    x = torch.randn(4, D, dtype=torch.float64)
    layer = _layer(cell, beta, 2 * n + 1, keep_state=True)
    z0 = torch.zeros(4, D, dtype=torch.float64)
    z, st = layer.solve(x, z0)
    zN, yN, steps = st.extra["state"]
    assert st.nstep == 2 * n + 1 and steps.tolist() == [n] * 4

    def f(v):
        return cell(v, x)

    with torch.no_grad():
        z_hat, y_hat, *_ = reverse(f, zN, yN, steps, beta, torch.zeros_like(zN), [], zN.dtype)
    assert float((z_hat - z0).abs().max()) <= 1e-10
    assert float((y_hat - z0).abs().max()) <= 1e-10


def test_reconstruction_error_grows_with_steps_and_in_float32_states():
    """Reported, not hidden: the reconstruction error grows about |1 - beta|^-2 per step, and
    with float32 states (state_dtype 'input') it is far larger than with float64 ones."""
    x = torch.randn(4, D, dtype=torch.float64)
    zbar = torch.randn(4, D, dtype=torch.float64)
    err = {}
    for n in (4, 8, 12):
        layer = _layer(TanhCell(), 0.8, 2 * n + 1)
        _grads(layer, x, zbar)
        err[n] = layer.last_backward_info["reconstruction_error"]
    assert err[4] < 1e-11 and err[8] > 30 * err[4] and err[12] > 30 * err[8], err
    cell32 = TanhCell(dtype=torch.float32)
    e = {}
    for sd in ("float64", "input"):
        layer = _layer(cell32, 0.8, 17, state_dtype=sd)
        _grads(layer, x.float(), zbar.float())
        e[sd] = layer.last_backward_info["reconstruction_error"]
    assert e["input"] > 1e3 * max(e["float64"], 1e-12), e
    print(f"reconstruction error, beta 0.8, float64: {err}; 8 steps f32 model: {e}")


@pytest.mark.parametrize("beta", [0.5, 0.8, 1.2])
@pytest.mark.parametrize("per_sample", [True, False])
def test_the_gradient_equals_autograd_through_the_stored_iteration(beta, per_sample):
    """Samples stop at their own step counts (tol 1e-3, per_sample) or together: the reversal's
    gradients of theta and x equal autograd through the same masked loop to 1e-10."""
    cell = TanhCell(scale=0.7)
    x = torch.randn(5, D, dtype=torch.float64) * torch.tensor([0.1, 0.5, 1.0, 2.0, 4.0])[:, None]
    zbar = torch.randn(5, D, dtype=torch.float64)
    layer = _layer(cell, beta, 41, tol=1e-3, per_sample=per_sample)
    z, g = _grads(layer, x, zbar)
    steps = layer.last_forward_stats.extra["steps"]
    if per_sample:
        assert len(set(steps.tolist())) > 1, steps  # samples stopped at different N
    else:
        assert len(set(steps.tolist())) == 1
    z_ref, g_ref = _unrolled_reference(cell, x, beta, steps, zbar)
    assert torch.equal(z, z_ref)
    assert _rel(g, g_ref) <= 1e-10
    assert layer.last_backward_stats.nstep == 2 * int(steps.max())


def test_the_gradient_survives_a_reconstruction_that_has_not():
    """beta 0.8, 20 steps: (z_0, y_0) come back wrong by far more than round-off, yet the
    gradient still equals autograd through the loop: the round-off grows in the directions the
    forward contracts fastest, where the adjoint has decayed as fast (why the reconstruction
    error is reported, not enforced)."""
    cell = TanhCell()
    x = torch.randn(4, D, dtype=torch.float64)
    zbar = torch.randn(4, D, dtype=torch.float64)
    layer = _layer(cell, 0.8, 41)
    _, g = _grads(layer, x, zbar)
    _, g_ref = _unrolled_reference(cell, x, 0.8, layer.last_forward_stats.extra["steps"], zbar)
    assert layer.last_backward_info["reconstruction_error"] > 1e-4
    assert _rel(g, g_ref) <= 1e-9


def test_on_the_conv_cell_the_reversal_is_flagged_where_the_gradient_degrades():
    """On conv_deq_tiny (float64) the round-off does reach the gradient: 5 steps match autograd
    through the loop and pass the reconstruction check, 20 steps do neither, and the check
    (reversal_tol) says so."""
    import deqbench

    torch.manual_seed(0)
    m = deqbench.models.create("conv_deq_tiny", in_shape=(1, 8, 8), num_outputs=10).double()
    cell = m.deq.cell
    with torch.no_grad():
        u = m.inject(torch.randn(4, 1, 8, 8, dtype=torch.float64))
    zbar = torch.randn_like(u)

    def loop_gradient(steps):
        uu = u.detach().requires_grad_()
        z = torch.zeros_like(uu)
        y, F = z, cell(z, uu)
        for k in range(int(steps.max())):
            mk = (steps > k).view(-1, 1, 1, 1)
            yn = 0.2 * y + 0.8 * F
            zn = 0.2 * z + 0.8 * cell(yn, uu)
            y, z, F = (
                torch.where(mk, yn, y),
                torch.where(mk, zn, z),
                torch.where(mk, cell(zn, uu), F),
            )
        gs = torch.autograd.grad((z * zbar).sum(), [*cell.parameters(), uu])
        return torch.cat([g.reshape(-1) for g in gs])

    errs = {}
    for n in (5, 20):
        layer = _layer(cell, 0.8, 2 * n + 1)
        uu = u.detach().requires_grad_()
        gs = torch.autograd.grad((layer(uu) * zbar).sum(), [*cell.parameters(), uu])
        g = torch.cat([t.reshape(-1) for t in gs])
        errs[n] = _rel(g, loop_gradient(layer.last_forward_stats.extra["steps"]))
        errs[f"ok{n}"] = layer.last_backward_stats.converged
    print("conv cell, beta 0.8, gradient vs the loop:", errs)
    assert errs[5] <= 1e-8 and errs["ok5"]
    assert errs[20] > 1e-4 and not errs["ok20"]


def test_the_gradient_tends_to_ift_with_the_forward_residual():
    """Not the IFT gradient, but its distance to it is of the order of the forward residual:
    over N = 5 ... 30 steps the ratio error / residual stays within two orders of magnitude,
    and a converged forward (rel 1e-10) agrees with the dense IFT gradient to 1e-8."""
    cell = TanhCell()
    x = torch.randn(4, D, dtype=torch.float64)
    zbar = torch.randn(4, D, dtype=torch.float64)
    g_ift = _ift_reference(cell, x, zbar)
    rows = []
    for n in (5, 10, 15, 20, 30):
        layer = _layer(cell, 0.5, 2 * n + 1)
        _, g = _grads(layer, x, zbar)
        rows.append((n, layer.last_forward_stats.rel_max, _rel(g, g_ift)))
    print("N, forward rel residual, gradient error vs IFT:", rows)
    errs = [e for _, _, e in rows]
    assert all(a > b for a, b in zip(errs, errs[1:]))  # falls with the residual
    ratios = [e / r for _, r, e in rows]
    assert max(ratios) / min(ratios) < 100 and 0.01 < min(ratios), ratios
    layer = _layer(cell, 0.5, 201, tol=1e-10)
    _, g = _grads(layer, x, zbar)
    assert layer.last_forward_stats.converged
    assert _rel(g, g_ift) <= 1e-8


def test_saved_memory_is_independent_of_the_steps():
    """What autograd keeps for the backward (CPU: the saved tensors; CUDA: see the gpu test) is
    the same for N = 4 and N = 32 (unrolled K grows with K: the contrast)."""
    cell = TanhCell()
    x = torch.randn(16, D, dtype=torch.float64, requires_grad=True)

    def saved(layer):
        nbytes, z = saved_tensor_bytes(lambda: layer(x))
        return nbytes

    rev = [saved(_layer(cell, 0.5, 2 * n + 1)) for n in (4, 32)]
    assert rev[0] == rev[1] > 0
    unr = [saved(DEQLayer(cell, backward=BackwardConfig("unrolled", k=k))) for k in (4, 32)]
    assert unr[1] > 4 * unr[0]
    assert rev[1] < unr[1]


@pytest.mark.gpu
def test_cuda_peak_memory_is_independent_of_the_steps():
    cell = TanhCell(d=256).cuda()
    x = torch.randn(512, 256, dtype=torch.float64, device="cuda", requires_grad=True)
    peaks = []
    for n in (4, 32):
        layer = _layer(cell, 0.5, 2 * n + 1)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        z = layer(x)
        z.sum().backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        del z
    assert peaks[1] < 1.1 * peaks[0], peaks


def test_gradcheck():
    cell = TanhCell(d=4)
    layer = _layer(cell, 0.8, 9)
    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    W = cell.W.detach().clone().requires_grad_()
    from torch.func import functional_call

    def fn(x_, W_):
        return functional_call(layer, {"cell.W": W_}, (x_,))

    assert torch.autograd.gradcheck(fn, (x, W), eps=1e-6, atol=1e-7)


def test_the_mode_needs_its_forward_and_float32_models_work():
    with pytest.raises(ConfigError, match="needs the forward solver 'reversible'"):
        DEQLayer(TanhCell(), SolverConfig("anderson"), BackwardConfig("reversible"))
    with pytest.raises(ConfigError, match="beta = 1 cannot be reversed"):
        _layer(TanhCell(), 1.0, 9)(torch.randn(2, D, dtype=torch.float64))
    cell = TanhCell(dtype=torch.float32)
    layer = _layer(cell, 0.5, 21)
    x = torch.randn(3, D)
    z, g = _grads(layer, x, torch.randn(3, D))
    assert z.dtype == torch.float32 and torch.isfinite(g).all()
    assert layer.last_forward_stats.extra["state_dtype"] == "float64"
    with torch.no_grad():  # evaluation runs the same iteration through the solver
        assert torch.allclose(layer(x), z)
