"""monDEQ: monotone parameterisation, FB/PR splitting solvers against dense solves, the splitting
backward against the dense IFT gradient, the sweep analysis and its rows."""

from __future__ import annotations

import math

import pytest
import torch

import deqbench
from deqbench.deq import CellMap, SolverConfig, configure
from deqbench.errors import ConfigError
from deqbench.solvers.splitting import MonotoneCell

torch.set_num_threads(1)


def _dense_W(cell, shape) -> torch.Tensor:
    """The cell's W as a dense matrix acting on flattened states of ``shape``."""
    n = math.prod(shape)
    E = torch.eye(n, dtype=torch.float64).view(n, *shape)
    with torch.no_grad():
        return cell.splitting_ops().W(E).reshape(n, n).T


def _dense_fixed_point(W: torch.Tensor, u: torch.Tensor, mask: torch.Tensor | None = None):
    """z = P relu(W z + u) by semismooth Newton on the piecewise-linear system (dense, float64);
    P zeroes the entries outside ``mask`` (the conv border frame)."""
    n = W.shape[0]
    keep = torch.ones(n, dtype=W.dtype) if mask is None else mask
    z = torch.zeros_like(u)
    eye = torch.eye(n, dtype=W.dtype)
    for _ in range(100):
        pre = z @ W.T + u
        F = z - torch.relu(pre) * keep
        if float(F.abs().max()) < 1e-14:
            break
        for b in range(u.shape[0]):
            D = (pre[b] > 0).to(W.dtype) * keep
            J = eye - D[:, None] * W
            z[b] = z[b] - torch.linalg.solve(J, F[b])
    return z


def _mon_fc(seed: int = 0, width: int = 12, m: float = 1.0):
    torch.manual_seed(seed)
    return deqbench.models.create("mondeq_fc_tiny", width=width, m=m).double()


def _mon_conv(seed: int = 0):
    torch.manual_seed(seed)
    return deqbench.models.create("mondeq_conv_tiny", in_shape=(1, 4, 4), channels=3).double()


@pytest.mark.parametrize("m", [0.05, 0.5, 1.0])
def test_monotone_for_random_parameters(m):
    g = torch.Generator().manual_seed(1)
    for trial in range(4):
        model = _mon_fc(trial, width=10, m=m)
        cell = model.deq.cell
        with torch.no_grad():
            cell.A.copy_(torch.randn(10, 10, generator=g, dtype=torch.float64) * 3)
            cell.B.copy_(torch.randn(10, 10, generator=g, dtype=torch.float64) * 3)
        W = cell.weight().detach()
        lam = float(torch.linalg.eigvalsh((W + W.T) / 2).max())
        assert lam <= 1 - m + 1e-10
        assert cell.monotonicity() == pytest.approx(lam, abs=1e-10)
    conv = _mon_conv().deq.cell
    conv.m = m
    with torch.no_grad():
        conv.A_w.copy_(torch.randn(conv.A_w.shape, generator=g, dtype=torch.float64))
        conv.B_w.copy_(torch.randn(conv.B_w.shape, generator=g, dtype=torch.float64))
        conv.g.fill_(-2.5)  # g enters squared: still monotone
        conv.h.fill_(3.0)
    Wd = _dense_W(conv, (3, 6, 6))
    lam = float(torch.linalg.eigvalsh((Wd + Wd.T) / 2).max())
    assert lam <= 1 - m + 1e-10
    assert conv.monotonicity() == pytest.approx(lam, abs=1e-9)
    assert conv.lipschitz() == pytest.approx(
        float(torch.linalg.matrix_norm(torch.eye(Wd.shape[0], dtype=Wd.dtype) - Wd, ord=2)),
        rel=1e-9,
    )


def test_conv_operators_adjoint_and_fft_resolvent():
    cell = _mon_conv(3).deq.cell
    Wd = _dense_W(cell, (3, 6, 6))
    ops = cell.splitting_ops(0.3)
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    flat = x.reshape(2, -1)
    assert torch.allclose(ops.WT(x).reshape(2, -1), flat @ Wd, atol=1e-12)
    V = torch.linalg.inv(torch.eye(Wd.shape[0], dtype=Wd.dtype) * 1.3 - 0.3 * Wd)
    assert torch.allclose(ops.V(x).reshape(2, -1), flat @ V.T, atol=1e-12)
    assert torch.allclose(ops.VT(x).reshape(2, -1), flat @ V, atol=1e-12)


@pytest.mark.parametrize("solver", ["forward_backward", "peaceman_rachford"])
def test_splitting_fixed_points_match_dense_solve(solver):
    model = _mon_fc(2)
    cell = model.deq.cell
    x = torch.rand(5, 64, dtype=torch.float64)
    with torch.no_grad():
        u = model.inject(x)
    z_ref = _dense_fixed_point(cell.weight().detach(), u)
    alpha = 1.2 * cell.lipschitz() ** -2 if solver == "forward_backward" else 1.0
    z, st = deqbench.solvers.get(solver)(
        CellMap(cell, u), torch.zeros_like(u), max_iter=2000, tol=1e-13, alpha=alpha
    )
    assert st.converged and st.status == "converged"
    assert torch.allclose(z, z_ref, atol=1e-9)
    # single-conv tier: dense solve of the materialised operator, border frame projected out
    conv_model = _mon_conv(4)
    ccell = conv_model.deq.cell
    with torch.no_grad():
        cu = conv_model.inject(torch.rand(2, 1, 4, 4, dtype=torch.float64))
    mask = ccell.interior.expand(1, 3, 6, 6).reshape(-1).double()
    zc_ref = _dense_fixed_point(_dense_W(ccell, (3, 6, 6)), cu.reshape(2, -1), mask)
    zc, st = deqbench.solvers.get(solver)(
        CellMap(ccell, cu),
        torch.zeros_like(cu),
        max_iter=3000,
        tol=1e-13,
        alpha=0.5 * ccell.lipschitz() ** -2 if solver == "forward_backward" else 0.5,
    )
    assert st.converged
    assert torch.allclose(zc.reshape(2, -1), zc_ref, atol=1e-9)


@pytest.mark.parametrize("solver", ["forward_backward", "peaceman_rachford"])
def test_splitting_backward_matches_dense_ift(solver):
    model = _mon_fc(5)
    cell = model.deq.cell
    alpha = 1.2 * cell.lipschitz() ** -2 if solver == "forward_backward" else 0.7
    cfg = SolverConfig(solver, max_iter=3000, tol=1e-12, options={"alpha": alpha})
    bw = deqbench.deq.BackwardConfig(
        "ift", solver=solver, max_iter=3000, tol=1e-12, options={"alpha": alpha}
    )
    configure(model, cfg, bw)
    x = torch.rand(4, 64, dtype=torch.float64)
    r = torch.randn(4, 12, dtype=torch.float64)
    params = [cell.A, cell.B, model.U.weight, model.U.bias]
    u = model.inject(x)
    z = model.deq(u)
    grads = torch.autograd.grad((z * r).sum(), params)
    assert model.deq.last_backward_stats.converged
    assert model.deq.last_backward_stats.solver == solver
    # dense IFT: w = (I - D W)^-T r per sample, then (d pre / d theta)^T (D w)
    W = cell.weight()
    zs = _dense_fixed_point(W.detach(), u.detach())
    assert torch.allclose(z.detach(), zs, atol=1e-9)
    pre = zs @ W.T + model.inject(x)
    D = (pre.detach() > 0).double()
    eye = torch.eye(12, dtype=torch.float64)
    w = torch.stack(
        [torch.linalg.solve((eye - D[b][:, None] * W.detach()).T, r[b]) for b in range(4)]
    )
    ref = torch.autograd.grad(pre, params, grad_outputs=D * w)
    for a, b in zip(grads, ref):
        assert torch.allclose(a, b, atol=1e-8), float((a - b).abs().max())


def test_conv_splitting_backward_matches_dense_ift():
    model = _mon_conv(6)
    cell = model.deq.cell
    configure(
        model,
        SolverConfig("peaceman_rachford", max_iter=2000, tol=1e-13, options={"alpha": 0.5}),
        deqbench.deq.BackwardConfig(
            "ift", solver="peaceman_rachford", max_iter=2000, tol=1e-13, options={"alpha": 0.5}
        ),
    )
    x = torch.rand(2, 1, 4, 4, dtype=torch.float64)
    r = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    params = [cell.A_w, cell.B_w, cell.g, cell.h]
    z = model.deq(model.inject(x))
    grads = torch.autograd.grad((z * r).sum(), params)
    # reference: the unrolled-free dense IFT with the materialised operator
    Wd = _dense_W(cell, (3, 6, 6))
    mask = cell.interior.expand(1, 3, 6, 6).reshape(-1).double()
    u = model.inject(x).detach()
    zs = _dense_fixed_point(Wd, u.reshape(2, -1), mask).reshape(2, 3, 6, 6)
    A, B = cell.kernels()
    from deqbench.models.mondeq import _adj_kernel

    pre = cell._w_apply(zs, A, B - _adj_kernel(B), False) + u
    D = cell.prox_mask(pre.detach()).reshape(2, -1)
    eye = torch.eye(Wd.shape[0], dtype=torch.float64)
    rf = r.reshape(2, -1)
    w = torch.stack([torch.linalg.solve((eye - D[b][:, None] * Wd).T, rf[b]) for b in range(2)])
    ref = torch.autograd.grad(pre, params, grad_outputs=(D * w).reshape(2, 3, 6, 6))
    for a, b in zip(grads, ref):
        assert torch.allclose(a, b, atol=1e-8), float((a - b).abs().max())


def test_splitting_solvers_need_a_monotone_cell():
    fc = deqbench.models.create("fc_deq_tiny")
    u = fc.inject(torch.rand(2, 64)).detach()
    pr = deqbench.solvers.get("peaceman_rachford")
    with pytest.raises(ConfigError, match="monotone-operator cell"):
        pr(CellMap(fc.deq.cell, u), torch.zeros_like(u))
    with pytest.raises(ConfigError, match="plain callable"):
        pr(lambda z: z, torch.zeros(2, 3))
    configure(fc, SolverConfig("forward_backward"))
    with pytest.raises(ConfigError, match="fc_deq|FCCell"):
        fc(torch.rand(2, 64))
    assert isinstance(_mon_fc().deq.cell, MonotoneCell)
    assert not isinstance(fc.deq.cell, MonotoneCell)
    with pytest.raises(ConfigError, match="unknown option 'alpa'"):
        pr(
            CellMap(_mon_fc().deq.cell, torch.zeros(1, 12, dtype=torch.float64)),
            torch.zeros(1, 12, dtype=torch.float64),
            alpa=0.5,
        )


def test_auto_alpha_and_default_config():
    model = _mon_fc(7)
    assert model.deq.solver_cfg.name == "peaceman_rachford"
    assert model.deq.backward_cfg.solver == "peaceman_rachford"
    configure(
        model,
        SolverConfig("peaceman_rachford", max_iter=300, tol=1e-8, options={"alpha": "auto"}),
        deqbench.deq.BackwardConfig(
            "ift", solver="peaceman_rachford", max_iter=300, tol=1e-8, options={"alpha": "auto"}
        ),
    )
    x = torch.rand(8, 64, dtype=torch.float64)
    out = model(x)
    out.sum().backward()
    alpha, calls = model.deq.cell._splitting_alpha["pr"]
    assert alpha in [2.0**-k for k in range(7)] and calls == 1
    assert model.deq.last_forward_stats.converged
    assert model.deq.last_forward_stats.extra["alpha"] == alpha
    assert model.deq.last_backward_stats.extra["alpha"] == alpha


def test_conv_model_trains_and_splitting_sweep_rows(tmp_path):
    from deqbench.data.base import load_data
    from deqbench.run.train import TrainConfig, train
    from deqbench.splitting.analysis import SplittingSweep, splitting_sweep

    torch.manual_seed(0)
    conv = deqbench.models.create("mondeq_conv_tiny")
    data = load_data("digits", train_subset=64, test_subset=32)
    res = train(conv, data, TrainConfig(epochs=1, batch_size=32, lr=1e-2, eval_before=False))
    assert res.status == "ok"
    assert res.history[-1]["train_backward_nstep"] > 0
    assert conv.spectral_quantities()["monotonicity_gap"] >= -1e-5

    model = _mon_fc(8, width=16)
    table, info = splitting_sweep(model, torch.rand(32, 64), tol=1e-6, max_iter=400)
    assert len(table) == 10
    assert table[table.method == "peaceman_rachford"].converged.all()
    assert info["fb_alpha_bound"] == pytest.approx(2 / info["lipschitz_I_minus_W"] ** 2)
    assert info["lambda_max_sym_W"] <= 1e-10

    from deqbench.analyses.base import CellContext

    dig = load_data("digits", flatten=True, test_subset=32)
    ctx = CellContext(model.float(), dig, "cpu", torch.float32, 0, "c0", {}, run_dir=tmp_path)
    rows = list(SplittingSweep({"max_iter": 400}).after_training(ctx))
    import pandas as pd

    df = pd.DataFrame(
        [
            {
                "cell_id": "c0",
                "seed": 0,
                "analysis": "splitting_sweep",
                "variant": r.variant,
                "metric": r.metric,
                "step": r.step,
                "value": r.value,
                "status": r.status,
                "note": r.note,
            }
            for r in rows
        ]
    )
    # the splitting theory (a guarantee, not a measured expectation): PR converges for every
    # alpha, FB for every alpha below its bound 2m/||I-W||^2
    bound = float(df[df.metric == "fb_alpha_bound"]["value"].iloc[0])
    conv = df[df.metric == "converged"].set_index("variant")["value"]
    alpha = {v: float(v.partition("/alpha=")[2]) for v in conv.index}
    pr = [v for v in conv.index if v.startswith("peaceman_rachford/")]
    fb_below = [v for v in conv.index if v.startswith("forward_backward/") and alpha[v] < bound]
    assert len(pr) == 5 and fb_below
    assert all(conv[v] == 1.0 for v in pr + fb_below), conv.to_dict()
    assert (tmp_path / "series").exists()


def test_splitting_lowest_step_is_where_the_residual_was_lowest():
    """Forward-backward far above its step bound first drops, then grows: the returned iterate
    is the lowest-residual one and ``lowest_step`` points at it (per sample in the extra)."""
    model = _mon_fc(3)
    cell = model.deq.cell
    with torch.no_grad():
        u = model.inject(torch.rand(3, 64, dtype=torch.float64))
    _, st = deqbench.solvers.get("forward_backward")(
        CellMap(cell, u), torch.zeros_like(u), max_iter=40, tol=1e-14,
        alpha=20.0 * cell.lipschitz() ** -2, protect_thres=1e30,
    )  # fmt: skip
    per_sample = st.rel_trace.argmin(dim=0)
    assert st.nstep == 40 and int(per_sample.max()) < 39  # the residual did grow at the end
    assert st.lowest_step == int(per_sample.max())
    assert st.extra["lowest_steps"].tolist() == per_sample.tolist()


@pytest.mark.parametrize("name", ["mondeq_fc_tiny", "mondeq_conv_tiny"])
@pytest.mark.parametrize("m", [0.0, -1.0])
def test_margin_must_be_positive(name, m):
    """m <= 0 would make W lose strong monotonicity (and the FB step bound negative)."""
    from deqbench.errors import ConfigError

    with pytest.raises(ConfigError, match="margin m must be > 0"):
        deqbench.models.create(name, in_shape=(1, 8, 8), num_outputs=10, m=m)


@pytest.mark.parametrize("alpha", ["atuo", 0, -0.5, None])
def test_bad_alpha_names_the_option(alpha):
    from deqbench.solvers.base import SolverOptionError

    torch.manual_seed(0)
    model = deqbench.models.create("mondeq_fc_tiny", in_shape=(1, 8, 8), num_outputs=10)
    configure(model, SolverConfig("peaceman_rachford", options={"alpha": alpha}))
    with pytest.raises(SolverOptionError, match="alpha must be a number > 0 or 'auto'"):
        model(torch.randn(2, 1, 8, 8))
