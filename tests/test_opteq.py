"""OptEq family, SAM solver, feature regularisers, unroll_compare analysis (Xie et al. 2023)."""

from __future__ import annotations

import math
import os

os.environ.setdefault("DEQBENCH_DISABLE_PLUGIN_AUTOLOAD", "1")

import pytest
import torch

import deqbench
from deqbench.deq import BackwardConfig, SolverConfig, configure
from deqbench.errors import ConfigError
from deqbench.models.opteq import ConvexObjective, OptEqConvUnit, OptEqUnit
from deqbench.solvers.regularizers import REGULARIZERS, get_regularizer

torch.set_num_threads(1)
F64 = torch.float64


def _fp(f, z0, tol=1e-13, max_iter=2000):
    return deqbench.solvers.get("fixed_point")(f, z0, max_iter=max_iter, tol=tol)


# -- registry and shapes ------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["opteq_tiny", "opteq_deep_tiny", "opteq_conv_tiny", "opteq_deep_conv_tiny"]
)
def test_tiny_models_forward_backward(name):
    shape = (1, 8, 8) if "conv" in name else (64,)
    torch.manual_seed(0)
    m = deqbench.models.create(name, in_shape=shape, num_outputs=10)
    configure(
        m, SolverConfig("fixed_point", max_iter=100, tol=1e-5), BackwardConfig("ift", max_iter=100)
    )
    out = m(torch.randn(4, *shape))
    assert out.shape == (4, 10)
    out.square().sum().backward()
    assert all(p.grad is not None for p in m.cell_parameters())
    assert m.last_forward_stats.converged
    assert max(m.weight_norms()) <= 0.9 * (1 + 1e-5)


def test_all_variants_registered():
    names = deqbench.models.names("opteq*")
    for base in ("opteq", "opteq_deep", "opteq_conv", "opteq_deep_conv"):
        assert base in names and f"{base}_tiny" in names
    assert "sam" in deqbench.solvers.names()
    assert "unroll_compare" in deqbench.analyses.names()


def test_bad_params_are_config_errors():
    with pytest.raises(ConfigError, match="alpha"):
        deqbench.models.create("opteq_tiny", alpha=1.5)
    with pytest.raises(ConfigError, match="activation"):
        deqbench.models.create("opteq_tiny", activation="gelu")
    with pytest.raises(ConfigError, match="did you mean 'l1'"):
        deqbench.models.create("opteq_tiny", regularizer="l11")
    with pytest.raises(ConfigError, match="prior"):
        deqbench.solvers.get("sam")(lambda z: z, torch.zeros(1, 2), max_iter=2, tol=0, prior="nope")
    with pytest.raises(ConfigError, match="unknown option"):
        deqbench.solvers.get("sam")(lambda z: z, torch.zeros(1, 2), max_iter=2, tol=0, rh0=0.1)


# -- the convex objective (Theorem 1) ------------------------------------------------------


@pytest.mark.parametrize("alpha", [1.0, 0.6])
def test_fixed_point_minimises_objective(alpha):
    """ReLU, gamma < 1: grad G(z*) = z* - W^T relu(W z* + u) = 0 to 1e-8, and z* is the
    minimiser found independently by L-BFGS on G."""
    torch.manual_seed(1)
    m = deqbench.models.create("opteq_tiny", in_shape=(64,), gamma=0.8, alpha=alpha).to(F64)
    cell = m.deq.cell
    assert isinstance(cell, ConvexObjective)
    x = torch.randn(5, 64, dtype=F64)
    with torch.no_grad():
        u = m.inject(x)
        z, st = _fp(lambda z: cell(z, u), m.z0(u))
    assert st.converged
    with torch.no_grad():
        g = cell.objective_grad(z, u)
    assert float(g.norm(dim=1).max()) < 1e-8
    # independent reference: minimise G from a random start
    zl = torch.randn_like(z).requires_grad_(True)
    opt = torch.optim.LBFGS(
        [zl],
        lr=1,
        max_iter=500,
        tolerance_grad=1e-14,
        tolerance_change=0,
        line_search_fn="strong_wolfe",
    )

    def closure():
        opt.zero_grad()
        loss = cell.objective(zl, u.detach()).sum()
        loss.backward()
        return loss

    opt.step(closure)
    assert torch.allclose(zl.detach(), z, atol=1e-7)
    with torch.no_grad():
        G0 = cell.objective(z, u)
        for _ in range(5):
            assert bool((cell.objective(z + 1e-3 * torch.randn_like(z), u) >= G0).all())


# -- the norm bound -------------------------------------------------------------------------


def _conv_operator_norm(unit: OptEqConvUnit) -> float:
    """Exact ||W||_2 of the zero-padded conv operator from its dense matrix."""
    h, w = unit.spatial
    n = unit.state * h * w
    eye = torch.eye(n, dtype=F64).reshape(n, unit.state, h, w)
    with torch.no_grad():
        cols = unit.apply_W(eye, unit.weight().detach().double()).reshape(n, -1)
    return float(torch.linalg.matrix_norm(cols, ord=2))


def test_conv_transpose_is_adjoint_and_power_norm_is_exact():
    torch.manual_seed(2)
    unit = OptEqConvUnit(3, 4, (6, 6), gamma=0.7).to(F64)
    z = torch.randn(2, 3, 6, 6, dtype=F64)
    h = torch.randn(2, 4, 6, 6, dtype=F64)
    W = unit.weight().detach()
    lhs = (unit.apply_W(z, W) * h).sum()
    rhs = (z * unit.apply_Wt(h, W)).sum()
    assert torch.allclose(lhs, rhs, rtol=1e-12)
    unit.refresh(iters=2000)
    with torch.no_grad():
        V = unit.V.double()
        n = 3 * 36
        mat = unit.apply_W(torch.eye(n, dtype=F64).reshape(n, 3, 6, 6), V).reshape(n, -1)
    assert float(unit.sigma().detach()) == pytest.approx(
        float(torch.linalg.matrix_norm(mat, ord=2)), rel=1e-5
    )


def test_norm_bound_holds_after_training_steps():
    """||W||_2 <= gamma after optimiser steps that push V's norm up (exact dense check)."""
    from deqbench.data.base import load_data
    from deqbench.run.train import TrainConfig, train

    data = load_data("digits", flatten=True, train_subset=128, test_subset=32)
    cases = (
        ("opteq_deep_tiny", "exact", False),
        ("opteq_tiny", "power", False),
        ("opteq_conv_tiny", "power", True),
    )
    for name, method, conv in cases:
        torch.manual_seed(3)
        d = load_data("digits", train_subset=128, test_subset=32) if conv else data
        m = deqbench.models.create(name, in_shape=d.in_shape, gamma=0.5, norm_method=method)
        configure(
            m, SolverConfig("fixed_point", max_iter=60, tol=1e-4), BackwardConfig("unrolled", k=5)
        )
        with torch.no_grad():
            for u in m.units:
                u.V.mul_(0.1)  # start inside the ball: the bound must become active in training
        res = train(
            m, d, TrainConfig(epochs=1, batch_size=32, lr=0.2, max_steps=4, eval_before=False)
        )
        assert res.status == "ok"
        for unit in m.units:
            if isinstance(unit, OptEqConvUnit):
                exact = _conv_operator_norm(unit)
            else:
                exact = float(torch.linalg.matrix_norm(unit.weight().detach().double(), ord=2))
            assert exact <= 0.5 * (1 + 1e-4), (name, exact)
        assert max(float(unit.sigma().detach()) for unit in m.units) > 1.0  # the bound was active


# -- SAM selects the minimum-norm fixed point ----------------------------------------------


def _nonunique_case(m: int = 6, B: int = 3):
    """W with ||W|| = 1 (singular value 1 twice): with ReLU active, Fix(T) is locally the affine
    set z_p + span(R_1, R_2); z_p = (I - W^T W)^+ W^T u is its minimum-norm point."""
    g = torch.Generator().manual_seed(0)
    P = torch.rand(m, B, generator=g, dtype=F64) + 0.5  # W z_p + u, positive
    A = torch.cat([P, torch.randn(m, m - B, generator=g, dtype=F64)], 1)
    Qf, _ = torch.linalg.qr(A)
    Q = torch.cat([Qf[:, B : B + 2], Qf[:, :B], Qf[:, B + 2 :]], 1)  # Q_1, Q_2 orthogonal to P
    R, _ = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=F64))
    s = torch.tensor([1.0, 1.0, 0.5, 0.3, 0.6, 0.2], dtype=F64)
    W = Q @ torch.diag(s) @ R.T
    U = Q @ (torch.diag(1 - s**2) @ (Q.T @ P))
    zp = torch.linalg.pinv(torch.eye(m, dtype=F64) - W.T @ W) @ (W.T @ U)
    unit = OptEqUnit(m, m, alpha=1.0, gamma=1.0, act="relu").to(F64)
    with torch.no_grad():
        unit.V.copy_(W)
    unit.refresh()
    z0 = zp.T + 2.0 * torch.randn(B, m, generator=g, dtype=F64)
    return unit, U.T.contiguous(), zp.T.contiguous(), z0


def test_sam_l2_selects_minimum_norm_fixed_point():
    unit, u, zp, z0 = _nonunique_case()
    assert unit.weight_norm() == pytest.approx(1.0, abs=1e-12)

    def T(z):
        return unit(z, u)

    with torch.no_grad():
        assert float((T(zp) - zp).abs().max()) < 1e-12  # z_p is a fixed point
    zf, st = _fp(T, z0)
    assert st.converged
    assert float((zf - zp).norm(dim=1).min()) > 0.5  # plain iteration keeps z0's component
    sam = deqbench.solvers.get("sam")
    zs, st = sam(T, z0, max_iter=600, tol=0, prior="l2", rho=0.5, c=0.4)
    err = float((zs - zp).norm(dim=1).max())
    assert err < 0.05 * float(zp.norm(dim=1).min())  # O(beta_K) bias of SAM
    zs, st = sam(T, z0, max_iter=600, tol=0, prior="l2", rho=0.5, c=0.4, polish=20)
    assert float((zs - zp).norm(dim=1).max()) < 1e-5  # selection converged, bias removed
    assert st.rel_max < 1e-10
    assert st.extra["prior"] == "l2"


def test_sam_unrolled_training_uses_sam_steps():
    """backward unrolled + solver sam trains through the K-th SAM iterate (Xie et al. 2023 Eq. 12)."""
    torch.manual_seed(4)
    m = deqbench.models.create("opteq_tiny", gamma=0.9).to(F64)
    opts = {"prior": "l1", "rho": 0.5, "c": 0.3}
    configure(
        m, SolverConfig("sam", max_iter=8, tol=0, options=opts), BackwardConfig("unrolled", k=7)
    )
    x = torch.randn(3, 64, dtype=F64)
    out = m(x)
    out.sum().backward()
    assert m.deq.cell.units[0].V.grad is not None
    with torch.no_grad():
        u = m.inject(x)
        z8, _ = deqbench.solvers.get("sam")(
            lambda z: m.deq.cell(z, u), m.z0(u), max_iter=8, tol=0, **opts
        )
    assert torch.allclose(m.readout(z8), out, atol=1e-12)  # z_7 = 8th measured iterate


# -- regularisers ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,params",
    [(n, {}) for n in sorted(REGULARIZERS)] + [("hsic", {"sigma": 0.7})],
)
def test_regularizer_gradients_match_autograd_and_finite_differences(name, params):
    """Closed-form grad = autograd of value = central differences of value (float64); for HSIC
    also with the default bandwidth, which depends on z (one feature clamped at min_sigma)."""
    torch.manual_seed(5)
    r = get_regularizer(name, weight=0.3, **params)
    z = (torch.randn(6, 5, dtype=F64) + 0.1).requires_grad_(True)
    if name == "hsic":
        with torch.no_grad():
            z[:, 2] = 0.5 + 1e-6 * torch.randn(6, dtype=F64)  # std below min_sigma
    (g_auto,) = torch.autograd.grad(r.value(z), z)
    g = r.grad(z.detach())
    if name == "l1":
        assert torch.allclose(g, g_auto)
        return
    assert torch.allclose(g, g_auto, atol=1e-10), (g - g_auto).abs().max()
    h, fd = 1e-6, torch.zeros(z.shape, dtype=F64)
    for i in range(z.numel()):
        e = torch.zeros(z.numel(), dtype=F64)
        e[i] = h
        e = e.view_as(z)
        fd.view(-1)[i] = (r.value(z.detach() + e) - r.value(z.detach() - e)) / (2 * h)
    assert torch.allclose(g, fd, atol=1e-7), (g - fd).abs().max()


def test_prox_optimality():
    torch.manual_seed(6)
    z = torch.randn(4, 7, dtype=F64)
    for name in ("l1", "l2"):
        r = get_regularizer(name, weight=0.4)
        p = r.prox(z, 0.5)

        # p = argmin 0.5 ||x - z||^2 + 0.5 R(x): compare with a perturbation search
        def obj(x, r=r):
            return 0.5 * (x - z).pow(2).sum() + 0.5 * r.value(x)

        for _ in range(20):
            assert obj(p) <= obj(p + 1e-3 * torch.randn_like(p)) + 1e-15


def test_rstar_l1_sparsifies_and_ift_matches_unrolled():
    """R-star inside the layer: L1 prox gives sparser equilibria; with a batch regulariser
    (decorrelation, gradient step) the IFT gradient matches backprop through a long unroll."""
    torch.manual_seed(7)
    x = torch.randn(8, 64, dtype=F64)
    base = deqbench.models.create("opteq_tiny", gamma=0.8).to(F64)
    sparse = deqbench.models.create(
        "opteq_tiny", gamma=0.8, regularizer={"name": "l1", "weight": 1.0}, reg_step=0.2
    ).to(F64)
    sparse.load_state_dict(base.state_dict())
    for m in (base, sparse):
        configure(m, SolverConfig("fixed_point", max_iter=500, tol=1e-12))
    zb, _ = base.equilibrium(x)
    zs, _ = sparse.equilibrium(x)
    assert float(zs.abs().sum()) < float(zb.abs().sum())

    m = deqbench.models.create(
        "opteq_tiny",
        gamma=0.8,
        alpha=0.8,
        regularizer={"name": "decorrelation", "weight": 0.02},
        reg_step=0.1,
    ).to(F64)
    grads = {}
    for mode in ("ift", "unrolled"):
        configure(
            m,
            SolverConfig("fixed_point", max_iter=500, tol=1e-13),
            BackwardConfig(mode, k=400, max_iter=500, tol=1e-13),
        )
        m.zero_grad()
        m(x).square().sum().backward()
        grads[mode] = torch.cat([p.grad.flatten() for p in m.parameters()])
    assert m.last_forward_stats is not None
    assert torch.allclose(grads["ift"], grads["unrolled"], rtol=1e-6, atol=1e-9)


def test_deep_opteq_is_one_fixed_point_of_the_composition():
    torch.manual_seed(8)
    m = deqbench.models.create("opteq_deep_tiny", gamma=0.95, depth=3, hidden=[8, 16, 12]).to(F64)
    configure(m, SolverConfig("fixed_point", max_iter=1000, tol=1e-13))
    x = torch.randn(4, 64, dtype=F64)
    z, u = m.equilibrium(x)
    # independent composition from the explicit formula of Eq. 6
    with torch.no_grad():
        zz = z
        for unit, ui in zip(m.units, torch.split(u, [8, 16, 12], dim=1)):
            W = unit.weight()
            zz = unit.alpha * torch.relu(zz @ W.T + ui) @ W + (1 - unit.alpha) * zz
    assert torch.allclose(zz, z, atol=1e-11)
    assert m.contraction_bound() < 1


# -- the unroll_compare analysis and its table -----------------------------------------------


@pytest.mark.slow  # several seconds on 2 cores: out of the fast lane
def test_unroll_compare_rows_and_table():
    import pandas as pd

    from deqbench.analyses.base import CellContext
    from deqbench.data.base import load_data
    from deqbench.performance.unroll_compare import (
        UnrollCompare,
        plot_unroll_compare,
        unroll_table,
    )

    data = load_data("digits", flatten=True, train_subset=64, test_subset=64)
    rows = []
    for gamma in (0.5, 0.8):
        for i, bw in enumerate(
            [
                BackwardConfig("unrolled", k=2),
                BackwardConfig("unrolled", k=6),
                BackwardConfig("ift", tol=1e-3, max_iter=200),
            ]
        ):
            torch.manual_seed(9)
            m = deqbench.models.create("opteq_tiny", gamma=gamma)
            configure(m, SolverConfig("fixed_point", max_iter=200, tol=1e-4), bw)
            ctx = CellContext(
                m,
                data,
                torch.device("cpu"),
                torch.float32,
                0,
                f"c{gamma}{i}",
                {"train": {"batch_size": 32}},
            )
            # CPU peak RSS (a fresh worker process each) for the K=2 and IFT cells of gamma=0.5
            mem_cpu = gamma == 0.5 and i != 1
            a = UnrollCompare(
                {"repeats": 2, "warmup": 0, "timing_batches": 1, "sam_prior": "l2", "sam_iters": 40,
                 "memory_cpu": mem_cpu}
            )  # fmt: skip
            list(a.before_training(ctx))
            if bw.name == "ift":
                assert m.deq.solver_cfg.tol == 1e-3  # tied to the backward threshold
            for r in a.after_training(ctx):
                rows.append(
                    {
                        "cell_id": ctx.cell_id,
                        "seed": 0,
                        "analysis": "unroll_compare",
                        "variant": r.variant,
                        "metric": r.metric,
                        "value": r.value,
                        "status": r.status,
                        "note": r.note,
                        "repeat": r.repeat,
                        "cpu_peak": mem_cpu,
                    }
                )
    df = pd.DataFrame(rows)
    metrics = set(df["metric"])
    # every repeat stored, then median / IQR / spread over the repeats
    for t in ("inference_ms", "train_forward_ms", "backprop_ms"):
        assert {f"{t}_median", f"{t}_iqr", f"{t}_spread"} <= metrics
        per_cell = df[df.metric == t].groupby("variant")["repeat"].nunique()
        assert (per_cell == 2).all()
    # peak memory of a training step: measured in a fresh worker where asked, else skipped
    peak = df[df.metric == "peak_memory"]
    measured = peak[peak.cpu_peak]
    # (a tiny step fits in pages the warm-up already mapped: the extra RSS may be 0)
    assert len(measured) == 2 and (measured.status == "ok").all() and (measured.value >= 0).all()
    assert measured.note.str.contains("rss").all(), measured.note.tolist()
    assert (peak[~peak.cpu_peak].status == "skipped").all()
    for name in (
        "test_accuracy",
        "rel_residual_opteq",
        "inference_ms",
        "backprop_ms",
        "activation_memory",
        "gamma",
        "unroll_k",
        "threshold",
        "weight_norm_max",
        "sam_prior_value",
        "plain_prior_value",
        "sam_gap",
    ):
        assert name in metrics
    # mechanisms of the OptEq unit (not the paper's claims, which deqbench.reproduce judges):
    # K steps of a contraction shrink the residual, ||W|| <= gamma by construction, and IFT's
    # saved activations do not depend on the threshold and stay below unrolled K=2
    tab = unroll_table(df)
    assert len(tab) == 6 and {"method", "gamma", "unroll_k", "threshold"} <= set(tab.columns)
    for gamma, g in tab.groupby("gamma"):
        unr = g[g["unroll_k"].notna()].sort_values("unroll_k")
        assert unr["unroll_k"].tolist() == [2, 6]
        res = unr["rel_residual_opteq"].tolist()
        assert res[1] < res[0], (gamma, res)
        assert g["weight_norm_max"].max() <= gamma * (1 + 1e-4)
        ift = g[g["unroll_k"].isna()]
        assert len(ift) == 1 and ift["activation_memory"].max() < unr["activation_memory"].min()
        assert unr["activation_memory"].iloc[1] > unr["activation_memory"].iloc[0]
    fig = plot_unroll_compare(df)
    assert len(fig.axes) == 2
    assert not math.isnan(df[df.metric == "rel_residual_opteq"]["value"].max())


def test_z0_input_starts_the_iteration_at_the_input_features():
    """``z0: input`` (the paper's Algorithm 1, z0 = x = g(x0)): the unrolled iteration's first
    iterate is the extracted features, so K = 1 plain step gives T(g(x)); widths must match, and
    z0 of a u from another inject is refused."""
    import torch

    from deqbench import models
    from deqbench.errors import ConfigError

    torch.manual_seed(0)
    m = models.create("opteq_conv", in_shape=(1, 8, 8), num_outputs=10, width=8, extractor=8,
                      z0="input")  # fmt: skip
    m.eval()
    x = torch.rand(3, 1, 8, 8)
    u = m.inject(x)
    gx = m.extractor(x)
    assert torch.equal(m.z0(u), gx)
    one_step = m.deq.cell(gx, u)  # T(z0) with z0 = g(x)
    zero = models.create("opteq_conv", in_shape=(1, 8, 8), num_outputs=10, width=8, extractor=8)
    zero.load_state_dict(m.state_dict())
    zero.eval()
    assert not torch.allclose(zero.deq.cell(zero.z0(zero.inject(x)), u), one_step)
    with pytest.raises(RuntimeError, match="call inject"):
        m.z0(u.clone())
    with pytest.raises(ConfigError, match="must equal the state width"):
        models.create("opteq_conv", in_shape=(1, 8, 8), num_outputs=10, width=8, extractor=4,
                      z0="input")  # fmt: skip
    with pytest.raises(ConfigError, match="z0 must be one of"):
        models.create("opteq_deep", in_shape=(8,), num_outputs=10, width=8, z0="ones")


@pytest.mark.parametrize("name", ["opteq_conv_tiny", "opteq_tiny"])
def test_a_loaded_state_computes_what_the_saved_model_did(name):
    """A checkpoint's state loaded into a fresh model: its first forward equals the saved
    model's bit for bit (the loaded singular vectors are taken as current, not refreshed once
    more, which moved a resumed training run from about the 5th digit)."""
    shape = (1, 8, 8) if "conv" in name else (64,)
    torch.manual_seed(0)
    m = deqbench.models.create(name, in_shape=shape, num_outputs=10, gamma=0.5,
                               norm_method="power").double()  # fmt: skip
    cfg = (SolverConfig("fixed_point", max_iter=200, tol=1e-12), BackwardConfig("ift"))
    configure(m, *cfg)
    x = torch.randn(4, *shape, dtype=F64)
    with torch.no_grad():
        m(x)  # the norms refreshed for V
        for u in m.units:
            u.V.mul_(1.5)  # an optimiser step: V changed, refreshed at the next forward
        m(x)
        y0 = m(x)
    torch.manual_seed(1)
    m2 = deqbench.models.create(name, in_shape=shape, num_outputs=10, gamma=0.5,
                                norm_method="power").double()  # fmt: skip
    configure(m2, *cfg)
    m2.load_state_dict(m.state_dict())
    with torch.no_grad():
        y1 = m2(x)
    assert torch.equal(y0, y1)
