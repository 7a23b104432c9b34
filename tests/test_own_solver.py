"""Models that run their own fixed-point loop (no DEQ layer) and report it through the
``last_solve_stats()`` hook (deqbench.contracts.OwnSolverModel): their cells say what solved
them (``solver=own:<name>``), their solves are measured (``last_stats``, ``solver_stats``) and
checked (a cell whose own solver misses its tolerance is flagged); without the hook the cells
say ``not measured`` and ``solver_stats`` is skipped with a note."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import write_suite
from torch import nn

import deqbench
from deqbench.core.deq import last_stats, own_solve_stats, own_solver, reports_solves
from deqbench.errors import PluginError
from deqbench.models import declare_defaults, own_solver_label, solver_columns
from deqbench.run.runner import run_suite
from deqbench.solvers.base import make_stats


class Picard(nn.Module):
    """z <- tanh(W z + U x) until the relative residual is below ``tol`` or ``max_iter``
    iterations (its own cap), then one step with gradient; a linear readout. ``counts``: the
    iterations of every solve it made."""

    solver_name = "picard"

    def __init__(self, in_shape, num_outputs, width=16, max_iter=100, tol=1e-4, scale=0.5):
        super().__init__()
        self.U = nn.Linear(math.prod(in_shape), width)
        self.W = nn.Linear(width, width, bias=False)
        self.head = nn.Linear(width, num_outputs)
        with torch.no_grad():  # ||W|| = scale: a contraction
            self.W.weight.mul_(scale / torch.linalg.matrix_norm(self.W.weight, ord=2))
        self.max_iter, self.tol = max_iter, tol
        self.stats: dict | None = None
        self.counts: list[int] = []

    def forward(self, x):
        u = self.U(x.flatten(1))
        z = torch.zeros_like(u)
        abs_tr, rel_tr, k = [], [], 0
        with torch.no_grad():
            while k < self.max_iter:
                k += 1
                fz = torch.tanh(self.W(z) + u)
                a = (fz - z).norm(dim=1)
                abs_tr.append(a)
                rel_tr.append(a / (fz.norm(dim=1) + 1e-9))  # the residual of z
                if float(rel_tr[-1].max()) < self.tol:
                    break
                z = fz
        self.counts.append(k)
        self.stats = {
            "nstep": k,
            "rel_residual": rel_tr[-1],
            "abs_residual": abs_tr[-1],
            "tol": self.tol,
            "max_iter": self.max_iter,
            "rel_trace": torch.stack(rel_tr),
            "abs_trace": torch.stack(abs_tr),
        }
        return self.head(torch.tanh(self.W(z) + u))  # one step with gradient at z*

    def last_solve_stats(self):
        return self.stats


class Silent(Picard):
    """The same loop, reporting nothing."""

    last_solve_stats = None  # type: ignore[assignment]


@declare_defaults(own_solver="picard")
def own_capped(in_shape=(64,), num_outputs=10):
    """Hits its own 3-iteration cap on every batch (tol 1e-10)."""
    return Picard(in_shape, num_outputs, max_iter=3, tol=1e-10)


@declare_defaults(own_solver="picard")
def own_converging(in_shape=(64,), num_outputs=10):
    """Converges within its cap."""
    return Picard(in_shape, num_outputs, max_iter=100, tol=1e-4)


@declare_defaults(solvers=(), backward_modes=())
def own_silent(in_shape=(64,), num_outputs=10):
    """Computes its own equilibrium and reports nothing."""
    return Silent(in_shape, num_outputs)


MODELS = {"own_capped": own_capped, "own_converging": own_converging, "own_silent": own_silent}


@pytest.fixture(scope="module", autouse=True)
def _registered():
    for name, fn in MODELS.items():
        deqbench.models.add(name, fn)
    yield
    for name in MODELS:
        deqbench.models.remove(name)


SUITE = """\
schema: 1
name: own
device: cpu
threads: 1
seeds: [0]
data: {name: digits, flatten: true, train_subset: 64, test_subset: 32}
defaults:
  model: {name: MODEL}
  solver: {name: fixed_point, max_iter: 15, tol: 1.0e-3}
  train: {epochs: 1, batch_size: 32}
analyses: [metrics, solver_stats]
output: results
"""


def _run(tmp_path, model):
    p = write_suite(tmp_path, SUITE, replace={"MODEL": model})
    run = run_suite(deqbench.load_suite(p), progress=False, plots=False)
    df = deqbench.load_results(run.run_dir)
    return df[df.analysis != "process"], run.run_dir


def _forward_rows(df):
    ss = df[df.analysis == "solver_stats"]
    return ss[ss.metric.str.startswith("forward_") & (ss.status != "skipped")]


def test_capped_own_solver_is_measured_and_flagged(tmp_path):
    df, run_dir = _run(tmp_path, "own_capped")
    assert set(df.solver) == {"own:picard"} and set(df.backward) == {"own"}
    runner = df[df.analysis == "runner"]
    assert list(runner.status) == ["flagged"], list(runner.note)
    assert "forward solve missed rel tol 1e-10" in runner.note.iloc[0]
    fwd = _forward_rows(df)
    assert {"train", "test", "final_test"} <= set(fwd.variant)
    nstep = fwd[fwd.metric == "forward_nstep"]
    assert (nstep.value == 3).all(), nstep  # its own cap, every pass
    conv = fwd[fwd.metric == "forward_converged"]
    assert (conv.value == 0).all()
    # the trace it reports is the solver_trace series (3 iterations per phase)
    (trace,) = (run_dir / "series").glob("solver_trace__*")
    assert "iteration" in trace.read_text().splitlines()[0]


def test_converging_own_solver_reports_its_own_count(tmp_path):
    df, _ = _run(tmp_path, "own_converging")
    assert set(df.solver) == {"own:picard"} and set(df.backward) == {"own"}
    assert list(df[df.analysis == "runner"].status) == ["ok"]
    fwd = _forward_rows(df)
    nstep = fwd[fwd.metric == "forward_nstep"]
    assert {"train", "test", "final_test"} <= set(nstep.variant)
    assert ((nstep.value > 1) & (nstep.value < 100)).all()
    assert (fwd[fwd.metric == "forward_converged"].value == 1).all()
    # last_stats (what training, evaluation and the analyses read) is the loop's own count
    model = deqbench.models.create("own_converging", in_shape=(64,), num_outputs=10)
    assert own_solver(model) == "own:picard" and reports_solves(model)
    for b in range(3):
        model(torch.randn(8 + b, 64))
        st = last_stats(model)
        assert st["forward_nstep"] == model.counts[-1] > 1
        assert st["forward_converged"] == 1.0 and st["forward_rel_residual"] < 1e-4
        assert "backward_nstep" not in st


def test_silent_own_solver_is_not_measured(tmp_path):
    df, _ = _run(tmp_path, "own_silent")
    assert set(df.solver) == {"not measured"} and set(df.backward) == {"not measured"}
    ss = df[df.analysis == "solver_stats"]
    assert list(ss.status) == ["skipped"]
    assert "solves its own equilibrium and reports no statistics" in ss.note.iloc[0]
    assert "last_solve_stats" in ss.note.iloc[0]
    assert list(df[df.analysis == "runner"].status) == ["ok"]
    model = deqbench.models.create("own_silent", in_shape=(64,), num_outputs=10)
    model(torch.randn(4, 64))
    assert own_solver(model) is None and not reports_solves(model) and last_stats(model) == {}


def test_labels_from_the_declaration_without_building():
    assert own_solver_label("own_capped") == ("own:picard", "own")
    assert own_solver_label("own_silent") == ("not measured", "not measured")
    assert own_solver_label("fc_deq_tiny") is None
    assert deqbench.models.computes_own_equilibrium("own_capped")
    # the built models agree with their declarations
    for name in MODELS:
        model = deqbench.models.create(name, in_shape=(64,), num_outputs=10)
        assert solver_columns(name, model) == own_solver_label(name)
    assert solver_columns("fc_deq_tiny", deqbench.models.create("fc_deq_tiny")) is None
    with pytest.raises(TypeError, match="own solver takes no deqbench solvers"):
        declare_defaults(own_solver="x", solvers=["anderson"])


class _Hooked(nn.Module):
    solver_name, backward_name = "mine", "implicit"

    def __init__(self, value=None, backward=None):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.value, self.backward = value, backward

    def forward(self, x):
        return self.lin(x)

    def last_solve_stats(self):
        return self.value

    def last_backward_solve_stats(self):
        return self.backward


def test_hook_accepts_solver_stats_and_dicts_and_checks_claims():
    r = torch.tensor([1e-5, 3e-5])
    st = make_stats("x", 7, [r * 10, r], [r * 10, r], r, r, 1e-4, "rel", diverged=False)
    m = _Hooked(st, {"nstep": 20, "abs_residual": 0.5, "tol": 1e-3, "converged": True})
    fw, bw = own_solve_stats(m)
    assert fw.nstep == 7 and fw.converged and fw.solver == "own:mine"
    assert fw.rel_trace.shape == (2, 2) and st.solver == "x"  # the model's object is untouched
    # the backward claims convergence with abs residual 0.5 > tol 1e-3: not believed
    assert bw.stop_mode == "abs" and not bw.converged and "0.5" in bw.extra["claim"]
    assert bw.solver == "own:implicit"
    s = last_stats(m)
    assert s["forward_nstep"] == 7 and s["forward_converged"] == 1.0
    assert s["backward_nstep"] == 20 and s["backward_converged"] == 0.0
    assert math.isnan(s["backward_rel_residual"]) and s["backward_abs_residual"] == 0.5
    # a plain float residual, status from the cap
    m.value = {"nstep": 50, "rel_residual": 0.2, "tol": 1e-4, "max_iter": 50}
    fw = own_solve_stats(m)[0]
    assert fw.status == "max_iter" and not fw.converged and fw.rel_max == pytest.approx(0.2)
    m.value = None
    assert own_solve_stats(m)[0] is None and "forward_nstep" not in last_stats(m)


@pytest.mark.parametrize(
    "value, match",
    [
        ({"nstep": 3, "rel_residual": 0.1}, "without tol"),
        ({"nstep": 3, "tol": 1e-4}, "without rel_residual or abs_residual"),
        ({"n_step": 3, "tol": 1e-4, "rel_residual": 0.1}, "did you mean 'nstep'"),
        ({"nstep": -1, "tol": 1e-4, "rel_residual": 0.1}, "nstep must be >= 0"),
        ({"nstep": 3, "tol": 1e-4, "abs_residual": 0.1, "stop_mode": "rel"}, "no rel_residual"),
        ({"nstep": 3, "tol": 1e-4, "rel_residual": 0.1, "status": "done"}, "status must be"),
        ((3, 0.1), "returned a tuple"),
    ],
)
def test_bad_hook_returns_name_the_model_and_the_hook(value, match):
    with pytest.raises(PluginError, match=match) as info:
        own_solve_stats(_Hooked(value))
    assert "model _Hooked: last_solve_stats()" in str(info.value)


@declare_defaults(own_solver="picard")
def _bad(in_shape=(64,), num_outputs=10):
    m = Picard(in_shape, num_outputs)
    m.last_solve_stats = lambda: {"nstep": 1, "rel_residual": 0.1}  # no tol
    return m


def _undeclared(in_shape=(64,), num_outputs=10):
    return Picard(in_shape, num_outputs)


@declare_defaults(own_solver="newton")
def _misnamed(in_shape=(64,), num_outputs=10):
    return Picard(in_shape, num_outputs)


@pytest.mark.parametrize(
    "factory, match",
    [
        (_bad, "last_solve_stats() returned a dict without tol"),
        (_undeclared, "reports its own solves (own:picard) but its factory declares nothing"),
        (_misnamed, "Picard.solver_name says own:picard but the factory declares own:newton"),
        (own_silent, None),
        (own_capped, None),
    ],
)
def test_validate_checks_the_hook_and_the_declaration(tmp_path, factory, match):
    from deqbench.run.plugin_checks import check_suite

    deqbench.models.add("own_checked", factory)
    try:
        p = write_suite(tmp_path, SUITE, replace={"MODEL": "own_checked"})
        lines = [v.line() for v in check_suite(deqbench.load_suite(p))]
    finally:
        deqbench.models.remove("own_checked")
    if match is None:
        assert lines == []
    else:
        assert any("[model.solve_stats]" in x and match in x for x in lines), lines


class _OwnBackward(Picard):
    """Picard whose gradient hook runs "its own adjoint solve" (recorded, 5 iterations)."""

    backward_name = "ift"

    def forward(self, x):
        self.bstats = None  # a forward without gradient reports no backward solve
        out = super().forward(x)
        if out.requires_grad:

            def adjoint(g):
                self.bstats = {"nstep": 5, "abs_residual": 1e-7, "tol": 1e-6, "max_iter": 50}

            out.register_hook(adjoint)
        return out

    def last_backward_solve_stats(self):
        return self.bstats


def test_own_backward_solves_are_recorded_after_the_backward_pass():
    from deqbench.core.deq import watch_own_solves
    from deqbench.core.verdict import solve_ledger

    m = _OwnBackward((64,), 10)
    assert watch_own_solves(m) and watch_own_solves(m)  # idempotent
    assert len(m._forward_hooks) == 1
    x = torch.randn(6, 64)
    with solve_ledger() as led:
        m(x).square().sum().backward()
    assert [(r.kind, r.solver, r.nstep) for r in led.records] == [
        ("forward", "own:picard", m.counts[-1]),
        ("adjoint", "own:ift", 5),
    ]
    assert all(r.converged for r in led.records)
    assert last_stats(m)["backward_nstep"] == 5
    with solve_ledger() as led, torch.no_grad():
        m(x)
    assert [r.kind for r in led.records] == ["forward"]
    assert "backward_nstep" not in last_stats(m)
