"""Every "ok" earned: evaluation solves count, a solver's claim is verified, notes say
what missed and a fix that can work, names say what ran, an unrolled cell evaluates its K steps."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import write_suite
from torch import nn
from typer.testing import CliRunner

import deqbench
from deqbench.cli import app
from deqbench.core.verdict import SolveRecord, solve_ledger, verify_solves
from deqbench.deq import BackwardConfig, DEQLayer, SolverConfig
from deqbench.run.solves import SolveTally
from deqbench.solvers.base import make_stats, residuals

SUITE = """\
schema: 1
name: v
device: cpu
threads: 1
seeds: [0]
data: {name: digits, train_subset: 64, test_subset: 32}
defaults:
  model: {name: MODEL}
  solver: {name: SOLVER, max_iter: 30, tol: 1.0e-4}
  backward: {name: ift, solver: fixed_point, max_iter: 30, tol: 1.0e-4}
  train: {epochs: 1, batch_size: 32, eval_before: false}
analyses: [metrics]
output: results
"""


def _run(tmp_path, model: str, solver: str = "fixed_point"):
    p = write_suite(tmp_path, SUITE, replace={"MODEL": model, "SOLVER": solver})
    r = CliRunner().invoke(app, ["run", str(p), "--no-progress", "--no-plots"])
    run_dir = next((tmp_path / "results" / "v").iterdir())
    df = deqbench.load_results(run_dir)
    runner = df[df.analysis == "runner"].iloc[0]
    conv = df[(df.analysis == "convergence") & (df.metric == "forward_unconverged_batches")]
    return r, runner, conv


class _ModeCell(nn.Module):
    """z -> tanh(a W z + u) with |W|_2 = 1: a = 0.5 (a contraction) in train mode, a = 3 in
    eval mode (no fixed point plain iteration reaches)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        w = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(0)))[0]
        self.w = nn.Parameter(w)

    def forward(self, z, u):
        a = 0.5 if self.training else 3.0
        return torch.tanh(a * z @ self.w.T + u)


class _ModeDEQ(deqbench.deq.DEQModel):
    def __init__(self, in_shape, num_outputs):
        super().__init__()
        d = 16
        self.inp = nn.Linear(math.prod(in_shape), d)
        self.deq = DEQLayer(_ModeCell(d))
        self.out = nn.Linear(d, num_outputs)

    def inject(self, x):
        return self.inp(x.flatten(1))

    def readout(self, z):
        return self.out(z)


@pytest.fixture
def mode_model():
    deqbench.models.add("t25_mode", lambda in_shape, num_outputs: _ModeDEQ(in_shape, num_outputs))
    yield "t25_mode"
    deqbench.models.remove("t25_mode")


def test_unconverged_evaluation_solves_flag_the_cell(tmp_path, mode_model):
    r, runner, conv = _run(tmp_path, mode_model)
    assert r.exit_code == 1, r.output
    assert runner.status == "flagged"
    assert "evaluation batches" in runner.note
    # a = 3: plain iteration cycles at residual ~1; more steps would not help
    assert "more steps will not help" in runner.note and "Raise solver.max_iter" not in runner.note
    rows = conv.set_index("variant")
    assert rows.loc["train", "value"] == 0 and rows.loc["train", "status"] == "ok"
    assert rows.loc["eval", "value"] == 1 and rows.loc["eval", "status"] == "flagged"


def _liar(f, z0, *, max_iter=50, tol=1e-4, stop_mode="rel", **options):
    """Two plain steps, then a claim of convergence whatever its own residual says."""
    z = z0
    abs_tr, rel_tr = [], []
    for _ in range(2):
        fz = f(z)
        a, rr = residuals(fz, z)
        abs_tr.append(a)
        rel_tr.append(rr)
        z = fz
    return z, make_stats("liar", 2, abs_tr, rel_tr, abs_tr[-1], rel_tr[-1], tol, stop_mode,
                         False, converged=True)  # fmt: skip


def _forger(f, z0, *, max_iter=50, tol=1e-4, stop_mode="rel", **options):
    """Three plain steps, reported with a zero residual (only a recomputation can tell)."""
    z = z0
    for _ in range(3):
        z = f(z)
    zero = torch.zeros(z0.shape[0], dtype=z0.dtype)
    return z, make_stats("forger", 3, [zero], [zero], zero, zero, tol, stop_mode, False,
                         converged=True)  # fmt: skip


@pytest.fixture
def lying_solvers():
    deqbench.solvers.add("t25_liar", _liar)
    deqbench.solvers.add("t25_forger", _forger)
    yield
    deqbench.solvers.remove("t25_liar")
    deqbench.solvers.remove("t25_forger")


def test_a_solver_claiming_convergence_against_its_own_residual_is_not_believed(
    tmp_path, lying_solvers
):
    r, runner, conv = _run(tmp_path, "fc_deq_tiny", "t25_liar")
    assert runner.status == "flagged", runner.note
    assert "solver 't25_liar' reported converged, its own rel residual" in runner.note
    assert "> tol 0.0001" in runner.note
    assert (conv.set_index("variant").loc[["train", "eval"], "value"] == 1).all()


def test_a_forged_residual_is_caught_by_the_recomputation(tmp_path, lying_solvers):
    r, runner, conv = _run(tmp_path, "fc_deq_tiny", "t25_forger")
    assert runner.status == "flagged", runner.note
    assert "reported converged, recomputed rel residual" in runner.note
    v = conv.set_index("variant")
    # every evaluation batch is verified; training only its last batch per epoch
    assert v.loc["eval", "value"] == 1
    assert v.loc["train", "value"] == pytest.approx(0.5)


def test_the_layer_checks_claims_and_records_solves():
    torch.manual_seed(0)
    deqbench.solvers.add("t25_forger", _forger)
    try:
        layer = DEQLayer(_Affine(nn.Linear(4, 4)), SolverConfig("t25_forger", max_iter=5, tol=1e-6))
        u = torch.randn(3, 4)
        with solve_ledger() as led:
            _, st = layer.solve(u, torch.zeros(3, 4))
            assert st.converged  # no recomputation outside verify_solves
            with verify_solves():
                _, st = layer.solve(u, torch.zeros(3, 4))
        assert not st.converged and st.extra["solver_converged"]
        assert [r.converged for r in led.records] == [True, False]
        assert led.records[1].verified and led.records[1].residual > 0.1
    finally:
        deqbench.solvers.remove("t25_forger")


def test_an_honest_solve_passes_verification():
    torch.manual_seed(0)
    cell = nn.Linear(4, 4)
    with torch.no_grad():
        cell.weight.mul_(0.3)
    layer = DEQLayer(_Affine(cell), SolverConfig("anderson", max_iter=50, tol=1e-6))
    with solve_ledger() as led, verify_solves():
        layer.solve(torch.randn(3, 4), torch.zeros(3, 4))
    (rec,) = led.records
    assert rec.converged and rec.verified and rec.residual < 2e-6


def _rec(converged: bool, nstep: int, status: str, residual: float = 2e-3) -> SolveRecord:
    return SolveRecord("forward", converged, converged, residual, "abs", 1e-3, status,
                       "broyden", nstep, max_iter=100)  # fmt: skip


def test_the_note_names_the_tested_residual_and_a_fix_that_can_work():
    own = SolveTally("forward", "train")
    for _ in range(3):
        own.add_record(_rec(False, 5, "stagnated", residual=2.5e-3))
    own.add_record(_rec(True, 4, "converged"))
    note = own.note()
    assert "abs tol 0.001" in note and "worst abs residual 0.0025" in note
    assert "max_iter" not in note  # the solver stopped by its own rule after 5 of 100 steps
    assert "stopped by its own rule (stagnated) after 5-5 of 100 steps" in note
    cap = SolveTally("forward", "eval")
    cap.add_record(_rec(False, 100, "max_iter"))
    assert "Raise solver.max_iter" in cap.note() and "evaluation batches" in cap.note()
    init = SolveTally("forward", "init")
    init.add_record(_rec(False, 100, "max_iter"))
    assert not init.flagged and "reported only" in init.note()


def test_an_unrolled_layer_evaluates_its_k_steps_not_the_fixed_point():
    torch.manual_seed(0)
    cell = nn.Linear(4, 4)
    with torch.no_grad():
        cell.weight.mul_(0.5)
    layer = DEQLayer(
        lambda_cell := _Affine(cell),
        SolverConfig("anderson", max_iter=100, tol=1e-8),
        BackwardConfig(name="unrolled", k=3),
    )
    u = torch.randn(2, 4)
    z = torch.zeros(2, 4)
    for _ in range(3):
        z = lambda_cell(z, u)
    with torch.no_grad():
        out = layer(u)
    torch.testing.assert_close(out, z)
    zs, _ = layer.solve(u, torch.zeros(2, 4))
    assert (out - zs).abs().max() > 1e-3  # K = 3 steps are not the fixed point


class _Affine(nn.Module):
    def __init__(self, lin: nn.Module) -> None:
        super().__init__()
        self.lin = lin

    def forward(self, z, u):
        return self.lin(z) + u


def test_cell_ids_and_columns_name_what_ran():
    from deqbench.run.labels import cell_labels
    from deqbench.run.suite import load_suite

    cells = {c.id: c for c in load_suite("suites/smoke.yaml").cells}
    assert "fc_deq_tiny-unrolled5-lr=0.02_batch_size=32" in cells
    assert "conv_deq_tiny-unrolled5" in cells
    assert cell_labels(cells["conv_deq_tiny-unrolled5"].as_dict()) == ("none", "unrolled")
    tied = next(c for i, c in cells.items() if i.startswith("tied_repeat_tiny"))
    assert cell_labels(tied.as_dict()) == ("none", "none") and "anderson" not in tied.id
    sam = next(i for i in cells if i.startswith("opteq_deep_tiny"))
    assert sam.startswith("opteq_deep_tiny-sam-unrolled10")  # SAM unrolls itself
    # one computation, one cell: no two cells differ only in a solver that does not run
    seen = {}
    for cid, c in cells.items():
        d = c.as_dict()
        solver, backward = cell_labels(d)
        if solver == "none":
            d.pop("solver")
        key = repr(sorted(d.items()))
        assert key not in seen, (cid, seen.get(key))
        seen[key] = cid


def test_a_plateau_at_the_cap_is_not_told_to_raise_max_iter():
    from deqbench.core.verdict import plateaued

    flat = torch.tensor([1.0, 0.1, 0.01, 2e-3, 1.8e-3, 1.7e-3, 1.7e-3, 1.6e-3, 1.7e-3, 1.6e-3])
    falling = torch.logspace(0, -9, 10)
    z = torch.zeros(1)
    st = make_stats("x", 10, list(flat[:, None]), list(flat[:, None]), z, z, 1e-4, "rel", False)
    assert plateaued(st)
    st = make_stats("x", 10, list(falling[:, None]), list(falling[:, None]), z, z, 1e-12, "rel",
                    False)  # fmt: skip
    assert not plateaued(st)
    tally = SolveTally("forward", "eval")
    rec = _rec(False, 100, "max_iter")
    rec.plateau = True
    tally.add_record(rec)
    assert "Raise solver.max_iter" not in tally.note()
    assert "more steps will not help" in tally.note() and "tf32" not in tally.note()  # on CPU
    tally.device = "cuda"
    assert "tf32: false" in tally.note()  # 2e-3: a precision floor, TF32 on CUDA


def test_resume_refuses_a_run_whose_ids_this_code_would_not_make(tmp_path):
    import json

    from deqbench.errors import ConfigError
    from deqbench.run.runner import run_suite

    p = write_suite(tmp_path, SUITE, replace={"MODEL": "fc_deq_tiny", "SOLVER": "fixed_point"})
    suite = deqbench.load_suite(p)
    run = run_suite(suite, progress=False, plots=False).run_dir
    meta = json.loads((run / "run.json").read_text())
    # an id from before unrolled cells were named by their K
    meta["cells"] = ["fc_deq_tiny-fixed_point-unrolled"]
    (run / "run.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="cell ids are not those this deqbench makes"):
        run_suite(suite, resume=run, progress=False, plots=False)
