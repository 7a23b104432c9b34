"""Hessian: own autograd / FD / pyhessian backends against brute-force Hessians (float64) on a tiny
MLP and a tiny tanh DEQ (differentiable IFT); estimators within their stated errors; a hook-based
IFT gives a wrong Hessian that the gates flag; the analysis and the CLI through the runner."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn
from torch.func import functional_call

import deqbench
from deqbench import hessian as hs
from deqbench.deq import BackwardConfig, SolverConfig, configure
from deqbench.hessian.estimators import _rademacher

torch.set_num_threads(1)
LOSS = nn.functional.cross_entropy


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def _deq():
    """fc_deq_tiny, tanh, ||W||_2 = 0.3, IFT backward with tight tolerances (38 parameters)."""
    torch.manual_seed(0)
    m = deqbench.models.create("fc_deq_tiny", in_shape=(3,), width=4, num_outputs=3).double()
    configure(
        m,
        SolverConfig("fixed_point", max_iter=100, tol=1e-13),
        BackwardConfig("ift", solver="fixed_point", max_iter=100, tol=1e-13, refine=30),
    )
    with torch.no_grad():
        W = m.deq.cell.W.weight
        W.mul_(0.3 / torch.linalg.matrix_norm(W, 2))
    return m


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 3, generator=g, dtype=torch.float64), torch.randint(
        0, 3, (8,), generator=g
    )


def brute_force_hessian(model, X, y):
    """torch.autograd.functional.hessian on the flattened parameters through functional_call."""
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def loss(v):
        parts, i = {}, 0
        for n, s in zip(names, shapes):
            parts[n] = v[i : i + s.numel()].view(s)
            i += s.numel()
        return LOSS(functional_call(model, parts, (X,)), y)

    was = model.training
    model.eval()
    H = torch.autograd.functional.hessian(loss, flat)
    model.train(was)
    return H


_H: dict[str, torch.Tensor] = {}


def hessian_of(kind):
    """Brute-force Hessian of the (deterministic) tiny model ``kind``, computed once."""
    if kind not in _H:
        _H[kind] = brute_force_hessian(_mlp() if kind == "mlp" else _deq(), *_data())
    return _H[kind]


@pytest.fixture(scope="module", params=["mlp", "deq"])
def case(request):
    model = _mlp() if request.param == "mlp" else _deq()
    X, y = _data()
    return request.param, model, X, y, hessian_of(request.param)


def test_ift_gradient_through_functional_call_matches_module_gradient():
    """Every backend differentiates the model through functional_call on detached parameter
    copies; the IFT backward must use those, not the cell's own attributes."""
    model = _deq()
    X, y = _data()
    with hs.HVPOperator(model, LOSS, (X, y)) as op:
        g = op.gradient()
    model.eval()
    ref = torch.autograd.grad(LOSS(model(X), y), list(model.parameters()))
    torch.testing.assert_close(g, torch.cat([r.reshape(-1) for r in ref]), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("backend", ["autograd", "pyhessian"])
def test_top_eigenvalue_and_trace_match_brute_force(case, backend):
    name, model, X, y, H = case
    assert float((H - H.T).abs().max()) < 1e-12
    ev = torch.linalg.eigvalsh(H)
    with hs.HVPOperator(model, LOSS, (X, y), backend=backend) as op:
        assert op.dim == H.shape[0]
        top = hs.lanczos(op, k=2, tol=1e-8, seed=0)
        assert top.converged
        assert abs(top.eigenvalues[0] - float(ev[-1])) <= 1e-6 * abs(float(ev[-1]))
        assert abs(top.eigenvalues[1] - float(ev[-2])) <= 1e-6 * abs(float(ev[-1]))
        assert top.lambda_min == pytest.approx(float(ev[0]), rel=1e-5)
        # a target the probes reach well before the cap, so that the stopping rule is exercised
        tr = hs.hutchinson_trace(op, rel_target_se=0.3, min_samples=10, max_samples=400, seed=0)
    assert tr.converged and tr.n < 400 and tr.se <= tr.target_se, (tr.n, tr.se, tr.target_se)
    exact = float(H.trace())
    assert math.isfinite(tr.se) and tr.se > 0
    assert abs(tr.trace - exact) <= 3 * tr.se, (tr.trace, exact, tr.se)  # the stated error
    # The same probes through the dense Hessian give the same estimate (deterministic part).
    g = torch.Generator().manual_seed(0)
    probe_op = type("P", (), {"dim": H.shape[0], "device": H.device, "dtype": H.dtype})()
    vs = [_rademacher(probe_op, g) for _ in range(tr.n)]
    same = sum(float(v @ H @ v) for v in vs) / tr.n
    assert tr.trace == pytest.approx(same, rel=1e-9)
    # it stopped at the first n >= min_samples whose standard error met the target
    prefix = [float(v @ H @ v) for v in vs[:-1]]
    if len(prefix) >= 10:
        m = sum(prefix) / len(prefix)
        se = (sum((x - m) ** 2 for x in prefix) / (len(prefix) - 1) / len(prefix)) ** 0.5
        assert se > 0.3 * abs(m)


class DenseOp:
    """A symmetric matrix as an operator (for the estimators alone)."""

    def __init__(self, A):
        self.A, self.dim, self.dtype, self.device, self.n_hvp = A, A.shape[0], A.dtype, A.device, 0

    def __call__(self, v):
        self.n_hvp += 1
        return self.A @ v


def test_power_iteration_algebraic_top_with_negative_dominant():
    g = torch.Generator().manual_seed(0)
    Q, _ = torch.linalg.qr(torch.randn(30, 30, generator=g, dtype=torch.float64))
    lam = torch.linspace(-0.5, 1.0, 30, dtype=torch.float64)
    lam[0] = -3.0  # dominant in magnitude, negative
    op = DenseOp(Q @ torch.diag(lam) @ Q.T)
    p = hs.power_iteration(op, tol=1e-9, max_iter=5000, seed=0)
    assert p.converged and p.eigenvalues[0] == pytest.approx(1.0, rel=1e-6)
    assert p.lambda_min == pytest.approx(-3.0, rel=1e-6)
    top = hs.lanczos(op, k=3, tol=1e-10, seed=0)
    assert top.eigenvalues == pytest.approx(lam.sort(descending=True).values[:3].tolist(), rel=1e-9)
    assert top.lambda_min == pytest.approx(-3.0, rel=1e-9)


def test_power_iteration_on_mlp_and_fd_backend_on_deq():
    model = _mlp()
    X, y = _data()
    ev = torch.linalg.eigvalsh(hessian_of("mlp"))
    with hs.HVPOperator(model, LOSS, (X, y), backend="autograd") as op:
        p = hs.power_iteration(op, tol=1e-6, max_iter=2000, seed=0)
    assert p.converged and abs(p.eigenvalues[0] - float(ev[-1])) <= 1e-6 * float(ev[-1])
    model, H = _deq(), hessian_of("deq")
    with hs.HVPOperator(model, LOSS, (X, y), backend="fd") as fd:
        Hfd = hs.dense_hessian(fd)
        assert float((Hfd - H).norm() / H.norm()) < 1e-7
        res = fd.residuals()
        assert res["forward_rel_residual_max"] < 1e-12 and res["backward_rel_residual_max"] < 1e-12


def test_slq_density_nodes_and_weights():
    model = _mlp()
    X, y = _data()
    ev = torch.linalg.eigvalsh(hessian_of("mlp"))
    with hs.HVPOperator(model, LOSS, (X, y)) as op:
        dens = hs.slq(op, n_probes=2, steps=op.dim, seed=0)
    for nodes, weights in zip(dens.nodes, dens.weights):
        assert sum(weights) == pytest.approx(1.0, abs=1e-10)
        for x, w in zip(nodes, weights):
            if w > 1e-8:  # a node that carries weight is an eigenvalue
                assert float((ev - x).abs().min()) < 1e-7
    grid, d, sigma = dens.curve(sigma_rel=0.02)
    area = float(torch.trapezoid(d, grid))
    assert area == pytest.approx(1.0, abs=1e-3) and sigma > 0


class HookIFT(nn.Module):
    """IFT by a gradient hook, as locuslab/deq does: z* under no_grad, one tracked step from the
    detached z*, and a hook that replaces the incoming gradient by the adjoint solution (solved
    without create_graph). First-order exact; second order silently wrong."""

    def __init__(self, base):
        super().__init__()
        self.U, self.cell, self.head = base.U, base.deq.cell, base.head

    def forward(self, x):
        u = self.U(x)
        with torch.no_grad():
            z = torch.zeros_like(u)
            for _ in range(100):
                z = self.cell(z, u)
        z0 = z.clone().requires_grad_()
        f0 = self.cell(z0, u)
        if f0.requires_grad:

            def hook(g):
                handle.remove()  # the hook removes itself before solving (locuslab)
                w = g
                for _ in range(100):
                    w = torch.autograd.grad(f0, z0, w, retain_graph=True)[0] + g
                return w

            handle = f0.register_hook(hook)
        return self.head(f0)


def test_hook_ift_hessian_is_wrong_and_gates_flag_it():
    base = _deq()
    X, y = _data()
    H = hessian_of("deq")
    hook = HookIFT(base)
    with hs.HVPOperator(hook, LOSS, (X, y)) as op, hs.HVPOperator(base, LOSS, (X, y)) as good:
        g_hook, g_true = op.gradient(), good.gradient()
        assert float((g_hook - g_true).norm() / g_true.norm()) < 1e-10  # first order is exact
        Hh = hs.dense_hessian(op)
        assert float((Hh - H).norm() / H.norm()) > 0.1  # second order is not
        rep = hs.run_gates(op, n=2, seed=0)
        assert rep.passed["grad_check"]
        assert not rep.passed["hvp_vs_fd"] and rep.hvp_vs_fd > 1e-2
        assert not rep.ok
        ok = hs.run_gates(good, n=2, seed=0)
        assert ok.ok, ok.as_dict()
        assert ok.symmetry < 1e-10 and ok.loss_label == "fixed-point loss (IFT)"


def test_pyhessian_backend_cleans_up():
    model = _deq()
    model.train()
    X, y = _data()
    rg = {n: p.requires_grad for n, p in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # its create_graph warning must not escape
        with hs.HVPOperator(
            model, LOSS, (X, y), backend="pyhessian", params=["deq.cell.W.weight"]
        ) as op:
            assert op.dim == 16
            hv = op(torch.ones(16, dtype=torch.float64))
    assert torch.isfinite(hv).all()
    assert all(p.grad is None for p in model.parameters())
    assert {n: p.requires_grad for n, p in model.named_parameters()} == rg
    assert model.training
    with hs.HVPOperator(model, LOSS, [(X[:4], y[:4]), (X[4:], y[4:])], backend="pyhessian") as a:
        with hs.HVPOperator(model, LOSS, (X, y), backend="autograd") as b:
            assert hs.hvp_agreement(a, b, n=1) < 1e-10  # dataloader path = weighted mean


def test_hessian_analysis_hook():
    from deqbench.analyses.base import CellContext
    from deqbench.data.base import DataBundle
    from deqbench.hessian.analysis import Hessian

    model = _deq()
    X, y = _data()
    data = DataBundle("toy", (X, y), (X, y), (3,), 3)
    ctx = CellContext(model, data, torch.device("cpu"), torch.float64, 0, "cell", {}, None)
    params = {
        "samples": 8,
        "top_k": 2,
        "eig_tol": 1e-8,
        "trace_max_samples": 12,
        "slq_steps": 8,
        "slq_probes": 1,
        "compare": ["pyhessian"],
        "refine": 40,
        "gate_vectors": 1,
    }
    rows = list(Hessian(params).after_training(ctx))
    got = {(r.metric, r.variant, r.repeat): r for r in rows}
    ev = torch.linalg.eigvalsh(hessian_of("deq"))
    assert got[("top_eigenvalue", "autograd", 0)].value == pytest.approx(float(ev[-1]), rel=1e-6)
    assert got[("gate_ok", "autograd", 0)].value == 1.0
    assert got[("agreement_top_eigenvalue", "autograd:pyhessian", 0)].value < 1e-8
    assert got[("agreement_trace", "autograd:pyhessian", 0)].value < 1e-10
    assert model.deq.solver_cfg.tol == 1e-13  # the analysis restored the solver settings


def test_hessian_command_through_runner(tmp_path):
    from typer.testing import CliRunner

    from deqbench.cli import app

    res = CliRunner().invoke(app, ["hessian", "--help"])
    assert res.exit_code == 0 and "deqbench hessian" in res.output
    args = [
        "hessian",
        "--model",
        "fc_deq_tiny",
        "--data",
        "synthetic",
        "--set",
        "data.dim=3",
        "--set",
        "data.n_train=32",
        "--set",
        "defaults.model.width=4",
        "--epochs",
        "1",
        "--samples",
        "16",
        "--top-k",
        "1",
        "--max-probes",
        "10",
        "--slq-steps",
        "6",
        "--slq-probes",
        "1",
        "--compare",
        "pyhessian",
        "--refine",
        "60",
        "--dtype",
        "float64",
        "--device",
        "cpu",
        "--solver",
        "fixed_point",
        "--out",
        str(tmp_path),
        "--no-progress",
        "--set",
        "threads=1",
    ]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    run = next((tmp_path / "hessian").iterdir())
    df = deqbench.load_results(run)
    h = df[df.analysis == "hessian"]
    assert {"top_eigenvalue", "trace", "trace_se", "gate_ok", "agreement_top_eigenvalue"} <= set(
        h.metric
    )
    assert float(h[h.metric == "gate_ok"].value.iloc[0]) == 1.0
    assert list((run / "series").glob("hessian_density__*.csv"))
    assert (run / "plots" / "hessian_density.png").exists()


def test_density_plot_leaves_out_flagged_cells_and_names_them(tmp_path):
    """A cell whose estimates are flagged (status error) is not drawn, so its arbitrary values
    cannot stretch the axis; it is named in a note. Series files come back in natural order."""
    import numpy as np
    import pandas as pd

    from deqbench.hessian.analysis import hessian_plots
    from deqbench.run import plots

    (tmp_path / "series").mkdir()
    lam = np.linspace(-1.0, 5.0, 50)
    for cell, scale in (("net-repeats=11", 1.0), ("net-repeats=6", 1.0), ("deq", 1e19)):
        pd.DataFrame({"lambda": lam * scale, "density": np.exp(-(lam**2))}).to_csv(
            tmp_path / "series" / f"hessian_density__{cell}__seed0.csv", index=False
        )
    assert list(plots.read_series(tmp_path, "hessian_density").cell_id.unique()) == [
        "deq",
        "net-repeats=6",
        "net-repeats=11",
    ]
    rows = [
        {
            "cell_id": c,
            "seed": 0,
            "analysis": "hessian",
            "metric": "top_eigenvalue",
            "repeat": 0,
            "value": v,
            "status": st,
        }
        for c, v, st in (
            ("net-repeats=6", 4.0, "ok"),
            ("net-repeats=11", 4.5, "ok"),
            ("deq", 3e19, "error"),
        )
    ]
    fig = hessian_plots(pd.DataFrame(rows), tmp_path)["hessian_density"]
    ax = fig.axes[0]
    assert [ln.get_label() for ln in ax.get_lines() if not ln.get_label().startswith("_")] == [
        "net-repeats=6",
        "net-repeats=11",
    ]
    assert ax.get_xlim()[1] < 100
    assert any("deq" in t.get_text() for t in ax.texts)


def test_power_method_gives_the_top_eigenvalue_only():
    """method power with an explicit top_k > 1 is refused (Lanczos gives the top k); without
    top_k it means top_k 1, not the default 3 silently cut to one value."""
    from deqbench.hessian.analysis import Hessian

    assert Hessian.Params(method="power").top_k == 1
    assert Hessian.Params(method="lanczos", top_k=3).top_k == 3
    with pytest.raises(ValueError, match="use method lanczos"):
        Hessian.Params(method="power", top_k=3)


def _analysis_rows(model, params, dtype=torch.float64):
    from deqbench.analyses.base import CellContext
    from deqbench.data.base import DataBundle
    from deqbench.hessian.analysis import Hessian

    X, y = _data()
    X = X.to(dtype)
    data = DataBundle("toy", (X, y), (X, y), (3,), 3)
    ctx = CellContext(model, data, torch.device("cpu"), dtype, 0, "cell", {}, None)
    base = {"samples": 8, "top_k": 1, "trace_max_samples": 10, "slq_steps": 6, "slq_probes": 1,
            "compare": [], "gate_vectors": 1}  # fmt: skip
    return list(Hessian({**base, **params}).after_training(ctx))


def test_failed_gate_flags_rows_and_names_the_fd_fallback():
    """A hook-based IFT (first order exact, double backward wrong) fails gate hvp_vs_fd: its gate
    rows are flagged with one note naming the cause and the fix, and the estimates come from the
    finite-difference fallback, named in the rows (variant fd, fd_fallback 1, the note)."""
    rows = _analysis_rows(HookIFT(_deq()), {})
    by = {(r.metric, r.variant): r for r in rows}
    gate = by[("gate_hvp_vs_fd", "autograd")]
    assert gate.status == "flagged" and gate.value > 1e-2
    assert "finite-difference fallback" in gate.note and "--backend fd" in gate.note
    assert "\n" not in gate.note
    assert by[("gate_grad_check", "autograd")].status == "ok"
    assert by[("fd_fallback", "fd")].value == 1.0
    top = by[("top_eigenvalue", "fd")]
    assert top.status == "ok" and "finite-difference fallback" in top.note
    ev = torch.linalg.eigvalsh(hessian_of("deq"))
    assert top.value == pytest.approx(float(ev[-1]), rel=1e-5)  # the fallback is right
    assert {r.note for r in rows if r.status == "flagged"} == {gate.note}  # one cause, one line


def test_starved_solves_flag_the_estimates():
    """The analysis's own solves at the trained weights miss their tolerance (a budget of one
    iteration): the residual gate rows and every estimate are flagged, with the cause and fix."""
    model = _deq()
    configure(
        model,
        SolverConfig("fixed_point", max_iter=1, tol=1e-13),
        BackwardConfig("ift", solver="fixed_point", max_iter=1, tol=1e-13),
    )
    rows = _analysis_rows(model, {"max_iter": 1, "direct": "off"})
    by = {(r.metric, r.variant, r.repeat): r for r in rows}
    conv = by[("gate_forward_all_converged", "autograd", 0)]
    assert conv.value == 0.0 and conv.status == "flagged"
    assert conv.note.startswith("DEQ solves at the trained weights missed their tolerance (forward")
    assert "--max-iter" in conv.note
    for metric in ("top_eigenvalue", "trace"):
        assert by[(metric, by[(metric, "autograd", 0)].variant, 0)].status == "flagged"
    assert model.deq.solver_cfg.max_iter == 1  # restored


def test_hvp_gate_retries_a_smaller_fd_step_over_a_kink():
    """An FD-HVP whose step crosses a kink of the loss (ReLU) is off by the jump over the step; the
    gate retakes it with smaller steps, so a right HVP passes and a wrong one still fails."""
    g = torch.Generator().manual_seed(0)
    A = torch.randn(6, 6, generator=g, dtype=torch.float64)
    A = A + A.T

    class KinkFD(DenseOp):
        fd_eps = 1e-5

        def __call__(self, v):  # a kink at distance 5e-6 along every direction
            return super().__call__(v) + (50.0 * v if self.fd_eps > 5e-6 else 0.0)

    fd = KinkFD(A)
    err, retried = hs.hvp_vs_fd(DenseOp(A), fd, 2, seed=0, threshold=1e-6)
    assert err < 1e-12 and retried == 2 and fd.fd_eps == 1e-5
    err, _ = hs.hvp_vs_fd(DenseOp(2 * A), fd, 2, seed=0, threshold=1e-6)
    assert err > 0.1


def test_density_plot_names_the_fd_fallback(tmp_path):
    import numpy as np
    import pandas as pd

    from deqbench.hessian.analysis import hessian_plots

    (tmp_path / "series").mkdir()
    lam = np.linspace(-1.0, 5.0, 50)
    for cell, backend, fb in (("a", "autograd", False), ("b", "fd", True)):
        pd.DataFrame(
            {"lambda": lam, "density": np.exp(-(lam**2)), "backend": backend, "fd_fallback": fb}
        ).to_csv(tmp_path / "series" / f"hessian_density__{cell}__seed0.csv", index=False)
    rows = pd.DataFrame(
        [
            {
                "cell_id": c,
                "seed": 0,
                "analysis": "hessian",
                "metric": "top_eigenvalue",
                "repeat": 0,
                "value": 4.0,
                "status": "ok",
            }  # fmt: skip
            for c in ("a", "b")
        ]
    )
    ax = hessian_plots(rows, tmp_path)["hessian_density"].axes[0]
    assert "finite-difference fallback" in ax.get_title()
    labels = [ln.get_label() for ln in ax.get_lines() if not ln.get_label().startswith("_")]
    assert labels == ["a [autograd]", "b [finite-difference fallback]"]
