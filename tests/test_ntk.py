"""Empirical NTK (deqbench.ntk) and the ``ntk`` analysis against independent references
(float64): naive per-probe IFT gradients, unrolled-to-convergence gradients, torch.func's
Jacobian-contraction NTK."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev, vmap

import deqbench
from deqbench.deq import BackwardConfig, SolverConfig, configure
from deqbench.ntk import empirical_ntk, ntk_summary

TIGHT = SolverConfig("fixed_point", max_iter=800, tol=1e-14)
TIGHT_B = BackwardConfig("ift", max_iter=800, tol=1e-14)


@pytest.fixture(autouse=True)
def _threads(monkeypatch):
    monkeypatch.setenv("DEQBENCH_DISABLE_PLUGIN_AUTOLOAD", "1")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def tiny_tanh_deq(seed: int = 0, width: int = 12, in_dim: int = 6, outputs: int = 3, norm=0.7):
    torch.manual_seed(seed)
    m = deqbench.models.create(
        "fc_deq_tiny", in_shape=(in_dim,), num_outputs=outputs, width=width
    ).double()
    with torch.no_grad():
        W = m.deq.cell.W.weight
        W.mul_(norm / torch.linalg.matrix_norm(W, ord=2))
    configure(m, TIGHT, TIGHT_B)
    return m


def unrolled_ntk(model, X, output, k=150):
    """Reference: naive per-probe gradients through k unrolled steps from z0 (rho^k << eps)."""
    saved = model.deq.backward_cfg
    configure(model, backward=BackwardConfig("unrolled", k=k))
    try:
        return empirical_ntk(model, X, output=output, method="naive")
    finally:
        model.deq.backward_cfg = saved


@pytest.mark.parametrize("output", ["sum", 1, "full"])
def test_tanh_deq_batched_matches_naive_ift_and_unrolled(output):
    m = tiny_tanh_deq()
    X = torch.randn(7, 6, dtype=torch.float64)
    K, info = empirical_ntk(m, X, output=output, return_info=True)
    R = 7 * 3 if output == "full" else 7
    assert K.shape == (R, R) and K.dtype == torch.float64
    assert info["forward_converged"] == 1.0 and info["adjoint_converged"] == 1.0
    K_naive = empirical_ntk(m, X, output=output, method="naive")
    K_unr = unrolled_ntk(m, X, output)
    assert rel(K, K_naive) < 1e-8
    assert rel(K, K_unr) < 1e-8
    assert rel(empirical_ntk(m, X, output=output, method="gram"), K) < 1e-10
    assert torch.allclose(K, K.T, atol=1e-12 * float(K.abs().max()))


def test_blockwise_contraction_and_chunking_give_the_same_kernel():
    m = tiny_tanh_deq(width=10)
    X = torch.randn(5, 6, dtype=torch.float64)
    K = empirical_ntk(m, X)
    # a 2 KiB budget slices every weight tensor into many flat pieces
    K_small = empirical_ntk(m, X, block_bytes=2048, chunk_size=2)
    assert rel(K_small, K) < 1e-13


def test_direct_and_iterated_adjoints_agree():
    m = tiny_tanh_deq(width=10)
    X = torch.randn(5, 6, dtype=torch.float64)
    Kd, info_d = empirical_ntk(m, X, adjoint="direct", return_info=True)
    Ks, info_s = empirical_ntk(m, X, adjoint="solver", return_info=True)
    assert info_d["adjoint_nstep"] == 0 and info_s["adjoint_nstep"] > 0
    assert info_d["adjoint_rel_residual"] < 1e-13 and rel(Kd, Ks) < 1e-12


def test_untraceable_forward_falls_back_to_naive():
    from deqbench.models.fc import FCDEQ

    class Untraceable(FCDEQ):
        """A custom forward with a side effect torch.func cannot trace (reads data_ptr())."""

        def forward(self, x):
            self.seen = self.U.weight.data_ptr()
            return super().forward(x)

    torch.manual_seed(5)
    m = Untraceable(6, 8, 2).double()
    configure(m, TIGHT, TIGHT_B)
    X = torch.randn(3, 6, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="naive"):
        K, info = empirical_ntk(m, X, return_info=True)
    assert "fallback" in info
    assert rel(K, empirical_ntk(m, X, method="naive")) < 1e-12


def test_mlp_matches_torch_func_jacobian_contraction():
    torch.manual_seed(1)
    mlp = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))
    mlp = mlp.double()
    X = torch.randn(9, 5, dtype=torch.float64)
    params = {k: v.detach() for k, v in mlp.named_parameters()}

    def f(p, x):
        return functional_call(mlp, p, (x.unsqueeze(0),)).squeeze(0)

    jac = vmap(jacrev(f), in_dims=(None, 0))(params, X)  # name -> (N, O, *shape)
    full = sum(torch.einsum("iaP,jbP->iajb", j.flatten(2), j.flatten(2)) for j in jac.values())
    n, o = 9, 4
    K_ref = {
        "sum": full.sum(dim=(1, 3)),
        2: full[:, 2, :, 2],
        "full": full.reshape(n * o, n * o),
    }
    for output, ref in K_ref.items():
        assert rel(empirical_ntk(mlp, X, output=output), ref) < 1e-12
    assert rel(empirical_ntk(mlp, X, output=2, method="naive"), K_ref[2]) < 1e-12


def test_tied_repeat_uses_the_plain_per_sample_ntk():
    torch.manual_seed(2)
    m = deqbench.models.create("tied_repeat_tiny", in_shape=(6,), num_outputs=2, cell="fc").double()
    X = torch.randn(5, 6, dtype=torch.float64)
    assert rel(empirical_ntk(m, X), empirical_ntk(m, X, method="naive")) < 1e-12


@pytest.mark.parametrize("name", ["pcdeq_mc_tiny", "kglm_deq_tiny"])
def test_custom_forward_and_multi_layer_deqs_match_naive(name):
    """Models that call their DEQ layers from their own forward (pcDEQ MC: three stages; kGLM)
    go through the generic per-layer surrogate: one batched solve and adjoint per layer call."""
    torch.manual_seed(4)
    m = deqbench.models.create(name, in_shape=(1, 8, 8), num_outputs=2).double()
    configure(
        m,
        SolverConfig("anderson", max_iter=300, tol=1e-13),
        BackwardConfig("ift", solver="anderson", max_iter=300, tol=1e-13),
    )
    X = torch.rand(4, 1, 8, 8, dtype=torch.float64)
    K, info = empirical_ntk(m, X, output="full", return_info=True)
    assert info["forward_converged"] == 1.0 and info["adjoint_converged"] == 1.0
    assert "fallback" not in info and info["deq_calls"] >= 1
    assert rel(K, empirical_ntk(m, X, output="full", method="naive")) < 1e-8


def _mondeq_available() -> bool:
    return "mondeq_fc_tiny" in deqbench.models.names()


def unrolled_fb_ntk(model, X, alpha: float, k: int):
    """Reference for monDEQ: per-probe gradients through k unrolled forward-backward steps
    z <- relu((1 - alpha) z + alpha (W z + U x + b)) from 0 (same fixed point; contracts)."""
    params = [p for p in model.parameters() if p.requires_grad]
    cell = model.deq.cell
    rows = []
    for i in range(X.shape[0]):
        u = model.inject(X[i : i + 1])
        W = cell.weight()
        z = torch.zeros_like(u)
        for _ in range(k):
            z = torch.relu((1 - alpha) * z + alpha * (z @ W.T + u))
        gs = torch.autograd.grad(model.readout(z).sum(), params)
        rows.append(torch.cat([g.reshape(-1) for g in gs]))
    J = torch.stack(rows)
    return J @ J.T


@pytest.mark.skipif(not _mondeq_available(), reason="model mondeq_fc_tiny is not registered")
def test_mondeq_batched_matches_naive_ift_and_unrolled():
    torch.manual_seed(3)
    m = deqbench.models.create("mondeq_fc_tiny", in_shape=(6,), num_outputs=2, m=0.5).double()
    H = m.deq.cell.A.shape[0]
    with torch.no_grad():  # the monDEQ scales: A, B at 0.4/sqrt(H)
        m.deq.cell.A.copy_(torch.randn(H, H) * 0.4 / H**0.5)
        m.deq.cell.B.copy_(torch.randn(H, H) * 0.4 / H**0.5)
    X = torch.randn(6, 6, dtype=torch.float64)
    pr = {"alpha": 1.0}
    configure(
        m,
        SolverConfig("peaceman_rachford", max_iter=1000, tol=1e-14, options=pr),
        BackwardConfig("ift", solver="peaceman_rachford", max_iter=1000, tol=1e-14, options=pr),
    )
    K, info = empirical_ntk(m, X, return_info=True)
    assert info["forward_converged"] == 1.0 and info["adjoint_converged"] == 1.0
    assert rel(empirical_ntk(m, X, method="naive"), K) < 1e-8
    assert rel(empirical_ntk(m, X, method="gram"), K) < 1e-10
    L = m.deq.cell.lipschitz()
    alpha = 0.5 / L**2  # m / L^2: FB contracts with factor sqrt(1 - alpha m)
    k = int(math.log(1e-16) / math.log(math.sqrt(1 - alpha * 0.5))) + 50
    assert rel(unrolled_fb_ntk(m, X, alpha, k), K) < 1e-8


def test_summary_noise_floor_and_unresolved():
    s = ntk_summary(torch.diag(torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64)))
    assert s["lambda_min"] == pytest.approx(1.0) and s["condition"] == pytest.approx(4.0)
    assert s["trace"] == pytest.approx(7.0) and s["resolved"]
    assert s["noise_floor"] == pytest.approx(torch.finfo(torch.float64).eps * 3 * 4.0)
    # a rank-deficient kernel (duplicated probes): lambda_min is rounding noise, reported as
    # K singular to working precision (0 <= lambda_min <= floor), never NaN or negative
    J = torch.randn(6, 40, dtype=torch.float64)
    J[5] = J[4]
    s = ntk_summary(J @ J.T)
    assert not s["resolved"] and s["status"] == "singular" and s["condition"] == math.inf
    assert 0.0 <= s["lambda_min"] <= s["noise_floor"] and "singular" in s["note"]
    assert s["condition_lower_bound"] == pytest.approx(s["lambda_max"] / s["noise_floor"])
    # float32 gradients of near-duplicate probes: below the float32 floor
    m = tiny_tanh_deq().float()
    configure(
        m,
        SolverConfig("fixed_point", max_iter=400, tol=1e-7),
        BackwardConfig("ift", max_iter=400, tol=1e-7),
    )
    X = torch.randn(4, 6)
    X = torch.cat([X, X + 1e-6 * torch.randn(4, 6)])
    K, info = empirical_ntk(m, X, return_info=True)
    assert info["eps"] == torch.finfo(torch.float32).eps
    assert not ntk_summary(K, eps=info["eps"])["resolved"]


def test_tf32_and_mode_restored_and_errors():
    m = tiny_tanh_deq()
    m.train()
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        empirical_ntk(m, torch.randn(3, 6, dtype=torch.float64))
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(prev)
    assert m.training
    from deqbench.errors import ConfigError

    with pytest.raises(ConfigError, match="scalar"):
        empirical_ntk(m, torch.randn(3, 6, dtype=torch.float64), output="scalar")
    with pytest.raises(ConfigError, match="method"):
        empirical_ntk(m, torch.randn(3, 6, dtype=torch.float64), method="fast")
    mlp = nn.Sequential(nn.Linear(6, 2)).double()
    with pytest.raises(ConfigError, match="gram"):
        empirical_ntk(mlp, torch.randn(3, 6, dtype=torch.float64), method="gram")


def test_digits_regression_targets():
    from deqbench.data.base import load_data

    d = load_data("digits", flatten=True, target="onehot", train_subset=20, test_subset=5)
    assert d.task == "regression" and d.num_outputs == 10 and d.train[1].shape == (20, 10)
    assert torch.all(d.train[1].sum(1) == 1)
    b = load_data("digits", flatten=True, target="binary", train_subset=20, test_subset=5)
    assert b.num_outputs == 1 and set(b.train[1].flatten().tolist()) <= {-1.0, 1.0}
    assert load_data("digits", train_subset=4).task == "classification"


def test_analysis_hooks_write_series_rows_and_plot(tmp_path):
    import pandas as pd

    from deqbench.analyses.base import CellContext
    from deqbench.data.base import load_data
    from deqbench.run.train import TrainConfig, train

    data = load_data("digits", flatten=True, target="binary", train_subset=16, test_subset=8)
    data = data.to(dtype=torch.float64)
    torch.manual_seed(0)
    m = deqbench.models.create("fc_deq_tiny", in_shape=data.in_shape, num_outputs=1).double()
    configure(
        m,
        SolverConfig("fixed_point", max_iter=200, tol=1e-10),
        BackwardConfig("ift", max_iter=200, tol=1e-10),
    )
    a = deqbench.analyses.get("ntk")({"n": 16, "every": 2, "output": "scalar"})
    ctx = CellContext(
        model=m,
        data=data,
        device="cpu",
        dtype=torch.float64,
        seed=0,
        cell_id="c0",
        cell={"train": {"full_batch": True}},
        run_dir=tmp_path,
    )
    rows = list(a.before_training(ctx))
    cfg = TrainConfig(epochs=4, optimizer="sgd", momentum=0.0, lr=0.05, full_batch=True)
    res = train(m, data, cfg, ctx=ctx, callbacks=[a], emit=lambda an, rs: rows.extend(rs))
    rows += list(a.after_training(ctx))
    assert res.status == "ok"
    df = pd.read_csv(tmp_path / "series" / "ntk__c0__seed0.csv")
    assert df["step"].tolist() == [0, 2, 4]
    assert (df["lambda_min"] > 0).all() and (df["resolved"] == 1).all()
    assert df["pred_log_loss_slope"].iloc[1:].lt(0).all()  # GD on the whole train split
    assert df["loss_at_eval"].iloc[-1] < df["loss_at_eval"].iloc[0]
    probes = pd.read_csv(tmp_path / "series" / "ntk_probes__c0__seed0.csv")
    assert len(probes) == 16 and probes["index"].nunique() == 16 and "x63" in probes
    metrics = {r.metric for r in rows}
    assert {
        "lambda_min",
        "lambda_max",
        "condition",
        "trace",
        "noise_floor",
        "loss_at_eval",
    } <= metrics
    from deqbench.ntk.analysis import ntk_plots

    figs = ntk_plots(None, tmp_path)
    assert set(figs) == {"ntk"} and len(figs["ntk"].axes) == 3


def test_cli_ntk_runs_a_one_cell_suite(tmp_path):
    import pandas as pd
    from typer.testing import CliRunner

    from deqbench.cli import app

    r = CliRunner().invoke(app, ["ntk", "--help"])
    assert r.exit_code == 0 and "Example: deqbench ntk" in r.output
    args = [
        "ntk",
        "--model",
        "fc_deq_tiny",
        "--train-subset",
        "12",
        "--n",
        "12",
        "--epochs",
        "2",
        "--every",
        "1",
        "--lr",
        "0.02",
        "--device",
        "cpu",
        "--out",
        str(tmp_path),
        "--no-progress",
        "--set",
        "data.test_subset=8",
    ]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    run_dir = next((tmp_path / "ntk").iterdir())
    series = list((run_dir / "series").glob("ntk__*.csv"))
    assert len(series) == 1 and len(list((run_dir / "series").glob("ntk_probes__*.csv"))) == 1
    df = pd.read_csv(series[0])
    assert df["step"].tolist() == [0, 1, 2] and (df["n"] == 12).all()
    assert (run_dir / "plots" / "ntk.png").exists()
    res = pd.read_csv(run_dir / "results.csv")
    lm = res[(res.analysis == "ntk") & (res.metric == "lambda_min")]
    assert len(lm) == 3 and (lm.value > 0).all()


def test_params_are_validated():
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        deqbench.analyses.get("ntk")({"n": 8, "evry": 2})
    with pytest.raises(ValidationError):
        deqbench.analyses.get("ntk")({"output": "mean"})


def test_predicted_slope_formula_and_step_size_limit():
    """2 log max(|1 - q_min|, |1 - q_max|), q = 2 lr lambda / N: the lambda_min form while
    lr (lambda_min + lambda_max) <= N; no decay guaranteed (>= 0) once 2 lr lambda_max / N >= 2."""
    from deqbench.ntk.analysis import predicted_log_loss_slope as slope

    assert slope(1.0, 0.1, 10) == pytest.approx(2 * math.log(0.98), rel=1e-15)
    assert slope(1.0, 0.1, 10, lambda_max=50.0) == pytest.approx(2 * math.log(0.98))
    assert slope(1.0, 0.1, 10, lambda_max=150.0) == pytest.approx(2 * math.log(2.0))
    assert slope(1.0, 0.1, 10, lambda_max=120.0) == pytest.approx(2 * math.log(1.4))
    assert math.isnan(slope(-1.0, 0.1, 10))
    # a linear model (its NTK is exact): the measured per-step slope of GD is never slower
    torch.manual_seed(0)
    lin = nn.Linear(8, 1, bias=False).double()
    X, y = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 1, dtype=torch.float64)
    s = ntk_summary(empirical_ntk(lin, X))
    assert s["resolved"]
    for lr in (0.5 * 4 / (s["lambda_min"] + s["lambda_max"]), 1.2 * 4 / s["lambda_max"]):
        opt = torch.optim.SGD(lin.parameters(), lr=lr)
        losses = []
        for _ in range(6):
            opt.zero_grad()
            loss = nn.functional.mse_loss(lin(X), y)
            losses.append(loss.item())
            loss.backward()
            opt.step()
        measured = max(math.log(b / a) for a, b in zip(losses, losses[1:]))
        bound = slope(s["lambda_min"], lr, 4, lambda_max=s["lambda_max"])
        assert measured <= bound + 1e-9


def test_tf32_off_and_highest_precision_during_the_computation():
    m = tiny_tanh_deq()
    seen = []
    hook = m.register_forward_hook(
        lambda *_: seen.append(
            (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32)
        )
    )
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        empirical_ntk(m, torch.randn(3, 6, dtype=torch.float64), method="naive")
    finally:
        torch.set_float32_matmul_precision(prev)
        hook.remove()
    assert seen and all(s == ("highest", False) for s in seen)


def test_bad_inputs_are_config_errors_and_default_tolerance_is_tight():
    from deqbench.errors import ConfigError

    m = tiny_tanh_deq()
    for X in (torch.randn(0, 6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)):
        with pytest.raises(ConfigError, match="N >= 1 probes"):
            empirical_ntk(m, X)
    with pytest.raises(ConfigError, match="square"):
        ntk_summary(torch.ones(3, 4))
    bad = ntk_summary(torch.full((2, 2), math.nan))
    assert not bad["resolved"] and math.isnan(bad["lambda_min"])
    assert bad["status"] == "non-finite" and "non-finite" in bad["note"]
    # a model trained at loose tolerances: the NTK's own solves are tight by default
    X = torch.randn(5, 6, dtype=torch.float64)
    ref = empirical_ntk(m, X)  # TIGHT: 1e-14
    configure(m, SolverConfig("anderson", max_iter=50, tol=1e-4), BackwardConfig("ift", tol=1e-4))
    assert rel(empirical_ntk(m, X), ref) < 1e-9
    assert rel(empirical_ntk(m, X, tol=1e-4), ref) > 1e-8  # what the old default gave


# -- singular and ill-conditioned K, references that converge, flagged solves --------


def small_fc(dtype=torch.float32, width=3, in_dim=2, seed=0):
    """A tiny fc_deq with P < 32 parameters, solved tightly in ``dtype``."""
    torch.manual_seed(seed)
    m = deqbench.models.create("fc_deq_tiny", in_shape=(in_dim,), num_outputs=1, width=width)
    m = m.to(dtype)
    with torch.no_grad():
        W = m.deq.cell.W.weight
        W.mul_(0.7 / torch.linalg.matrix_norm(W, ord=2))
    tol = 1e-7 if dtype == torch.float32 else 1e-13
    configure(
        m,
        SolverConfig("anderson", max_iter=300, tol=tol),
        BackwardConfig("ift", solver="anderson", max_iter=300, tol=tol),
    )
    return m


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_singular_kernel_is_reported_as_singular_never_nan(dtype):
    """Duplicated probes and N > P make K singular: lambda_min is reported near 0 beside its
    noise floor with status "singular", never NaN (the N = 2048 benchmark printed NaN)."""
    m = small_fc(dtype)
    P = sum(p.numel() for p in m.parameters())
    X = torch.randn(20, 2, dtype=dtype)
    X = torch.cat([X, X[:12]])  # 12 duplicated probes; N = 32 > P
    assert X.shape[0] > P
    K, info = empirical_ntk(m, X, return_info=True)
    s = ntk_summary(K, eps=info["eps"])
    assert s["status"] == "singular" and not s["resolved"]
    assert math.isfinite(s["lambda_min"]) and 0.0 <= s["lambda_min"] <= s["noise_floor"]
    assert s["noise_floor"] < 1e-6 * s["lambda_max"]  # a floor near 0, not a blanket NaN
    assert s["condition"] == math.inf and math.isfinite(s["condition_lower_bound"])
    assert s["condition_lower_bound"] > 1e5 and "singular" in s["note"]


def test_float32_gradients_resolve_an_ill_conditioned_kernel():
    """The N = 2048 nan: with float32 gradients the floor was eps32 * N * lambda_max although K
    is accumulated in float64, so any cond > 1 / (eps32 N) read as unresolved (NaN). A K with
    cond ~ 1e7 from float32 gradients is resolved and matches the float64 lambda_min."""
    m = small_fc(torch.float32, width=16, in_dim=6)
    torch.manual_seed(1)
    X = torch.randn(24, 6, dtype=torch.float64)
    X = torch.cat([X, X + 3e-3 * torch.randn(24, 6, dtype=torch.float64)])  # near-duplicates
    K32, info = empirical_ntk(m, X.float(), return_info=True)
    s32 = ntk_summary(K32, eps=info["eps"])
    m64 = small_fc(torch.float64, width=16, in_dim=6)
    m64.load_state_dict({k: v.double() for k, v in m.state_dict().items()})
    s64 = ntk_summary(empirical_ntk(m64, X.float().double()))
    assert s64["resolved"] and s64["condition"] > 1.0 / (torch.finfo(torch.float32).eps * 48)
    assert s32["resolved"] and s32["status"] == "resolved"
    assert s32["lambda_min"] == pytest.approx(s64["lambda_min"], rel=1e-3)


def expanding_fc():
    """fc_deq whose Jacobian has spectral radius ~1.5 at the fixed point: Anderson finds z*, a
    plain fixed-point adjoint iteration diverges."""
    torch.manual_seed(0)
    m = deqbench.models.create("fc_deq_tiny", in_shape=(3,), num_outputs=2, width=5).double()
    with torch.no_grad():
        Q, _ = torch.linalg.qr(torch.randn(5, 5, dtype=torch.float64))
        m.deq.cell.W.weight.copy_(1.5 * Q)
        m.U.weight.mul_(0.05)
        m.U.bias.zero_()
    configure(
        m,
        SolverConfig("anderson", max_iter=200, tol=1e-12),
        BackwardConfig("ift", solver="fixed_point", max_iter=200, tol=1e-12),
    )
    return m


def test_naive_reference_solves_its_adjoint_robustly_and_reports_convergence():
    """The naive loop is a reference; a plain fixed-point adjoint (rho(J) > 1
    here) is solved by Anderson, and every probe's convergence is reported."""
    from deqbench.ntk import naive_ntk, reference_converged

    m = expanding_fc()
    X = torch.randn(4, 3, dtype=torch.float64)
    Kb, info_b = empirical_ntk(m, X, adjoint="direct", return_info=True)
    Kn, info_n = empirical_ntk(m, X, method="naive", return_info=True)
    assert info_n["adjoint_solver"] == "anderson" and info_n["adjoint_converged"] == 1.0
    assert reference_converged(info_n) == (True, "")
    assert rel(Kn, Kb) < 1e-9
    # the configured plain iteration diverges: reported, so a caller never compares against it
    K0, info_0 = naive_ntk(m, X, "sum", None, None, robust=False)
    ok, why = reference_converged(info_0)
    assert not ok and "adjoint solve not converged" in why and rel(K0, Kb) > 1e-3
    assert m.deq.backward_cfg.solver == "fixed_point"  # the model's settings are restored


def test_starved_ntk_solves_flag_the_rows_with_cause_and_fix(tmp_path):
    """Solves that miss their tolerance: the evaluation's rows are "flagged" with a one-line
    cause and fix (the run then exits 1), never "ok"."""
    from deqbench.analyses.base import CellContext
    from deqbench.data.base import load_data

    data = load_data("digits", flatten=True, target="binary", train_subset=12, test_subset=4)
    data = data.to(dtype=torch.float64)
    torch.manual_seed(0)
    m = deqbench.models.create("fc_deq_tiny", in_shape=data.in_shape, num_outputs=1).double()
    configure(
        m,
        SolverConfig("fixed_point", max_iter=200, tol=1e-10),
        BackwardConfig("ift", max_iter=200, tol=1e-10),
    )
    ctx = CellContext(
        model=m,
        data=data,
        device="cpu",
        dtype=torch.float64,
        seed=0,
        cell_id="c0",
        cell={"train": {"full_batch": True}},
        run_dir=tmp_path,
    )
    a = deqbench.analyses.get("ntk")({"n": 12, "max_iter": 2, "adjoint": "solver"})
    rows = list(a.before_training(ctx))
    lam = next(r for r in rows if r.metric == "lambda_min")
    assert lam.status == "flagged" and "\n" not in lam.note
    assert "solves missed" in lam.note and "--ntk-max-iter" in lam.note
    assert {r.status for r in rows if r.metric in ("lambda_max", "trace")} == {"flagged"}
    assert next(r for r in rows if r.metric == "loss_at_eval").status == "ok"
    summary = {r.metric: r for r in a.after_training(ctx)}
    assert summary["lambda_min_final"].status == "flagged"
    # the same analysis with its default budget converges: nothing flagged
    ok = deqbench.analyses.get("ntk")({"n": 12})
    assert all(r.status == "ok" for r in ok.before_training(ctx))


def test_cli_ntk_exits_nonzero_when_its_solves_miss_tolerance(tmp_path):
    from typer.testing import CliRunner

    from deqbench.cli import app

    args = [
        "ntk",
        "--model",
        "fc_deq_tiny",
        "--train-subset",
        "12",
        "--n",
        "12",
        "--epochs",
        "1",
        "--every",
        "1",
        "--ntk-max-iter",
        "2",
        "--device",
        "cpu",
        "--out",
        str(tmp_path),
        "--no-progress",
        "--set",
        "data.test_subset=8",
    ]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 1, r.output
    assert "flagged" in r.output and "--ntk-max-iter" in r.output
