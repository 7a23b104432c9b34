"""Hints that fit: a missed solve's note names the rule it stopped on (its cap, its own test, a
blow-up) and the one fix that rule needs, read with the rate of its trace; a solver that
produced NaN is named as such."""

from __future__ import annotations

import pytest
import torch
from conftest import write_suite
from pydantic import Field
from torch import nn
from typer.testing import CliRunner

import deqbench
from deqbench.adapters import OwnLoop
from deqbench.cli import app
from deqbench.core import own_solves, verdict
from deqbench.run.solves import Tallies
from deqbench.solvers.base import CommonOptions, Tracker, make_stats, solver


def _tally(records, kind="forward", phase="train", device="cpu"):
    tallies = Tallies()
    tallies.device = device
    tallies.add(phase, records)
    return tallies.get(kind, phase)


def _own_records(model, x, batches=3):
    """The ledger records of ``batches`` forwards of an own-loop model, as the runner makes
    them (the hook's stats parsed under the model's own label)."""
    with verdict.solve_ledger() as led:
        for _ in range(batches):
            with torch.no_grad():
                model(x)
            st = own_solves.parse(model.last_solve_stats(), model, label="own:picard")
            verdict.record("forward", st, st.extra.get("max_iter"))
    return led.records


class _EarlyStop(nn.Module):
    """A loop that stops on its own test (the step ``||z_new - z||`` below 1e-2) long before
    its cap of 50, on a contraction whose rel residual is then still ~1e-2."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        with torch.no_grad():
            self.lin.weight.copy_(0.9 * torch.eye(8))
        self.own_tol, self.max_iter = 1e-2, 50

    def f(self, z, x):
        return self.lin(z) + x

    def forward(self, x):
        z = torch.zeros_like(x)
        for _ in range(self.max_iter):
            z_new = self.f(z, x)
            if (z_new - z).norm(dim=1).max() < self.own_tol:
                break
            z = z_new
        return z


def test_an_own_loop_that_stops_on_its_own_test_is_told_to_tighten_that_test():
    torch.manual_seed(0)
    model = OwnLoop(_EarlyStop(), map="f", tol=1e-6, max_iter="max_iter", solver_name="picard")
    recs = _own_records(model, torch.randn(4, 8) * 0.1)
    assert all(r.status == "stagnated" and r.nstep < 50 for r in recs), recs
    note = _tally(recs).note()
    assert "stopped on its own test after" in note and "of 50 steps" in note, note
    assert "tighten that test" in note
    assert "iteration cap" not in note and "max_iter" not in note, note
    assert note.count(". ") <= 1 and len(note) < 300, note  # two short sentences


class _BlowUp(nn.Module):
    """An expanding map iterated 30 times: its residual grows 2^30-fold, finite throughout."""

    def __init__(self):
        super().__init__()
        self.max_iter = 30

    def f(self, z, x):
        return 2.0 * z + x

    def forward(self, x):
        z = torch.zeros_like(x)
        for _ in range(self.max_iter):
            z = self.f(z, x)
        return z


def test_a_finite_blow_up_of_an_own_loop_is_diverged():
    model = OwnLoop(_BlowUp(), map="f", tol=1e-4, max_iter="max_iter", solver_name="picard")
    with torch.no_grad():
        model(torch.ones(2, 3))
    st = model.last_solve_stats()
    assert torch.isfinite(st.abs_residual).all() and float(st.abs_residual.max()) > 1e6
    assert st.status == "diverged", st.status
    recs = _own_records(model, torch.ones(2, 3), batches=2)
    note = _tally(recs).note()
    assert "diverged" in note and "iteration cap" not in note, note


class _HalpernOptions(CommonOptions):
    anchor: float = Field(1.0, gt=0, description="weight of the anchor z0 (beta_k = anchor/(k+2))")


@solver(_HalpernOptions, name="t_halpern", tags={"rate": "sublinear"})
def halpern(f, z0, opts, *, max_iter=50, tol=1e-4, stop_mode="rel"):
    """Halpern's iteration z_{k+1} = b_k z0 + (1 - b_k) f(z_k), b_k = 1/(k+2): on a
    nonexpansive map its residual falls as 1/k."""
    tracker = Tracker("t_halpern", z0, max_iter=max_iter, tol=tol, stop_mode=stop_mode, common=opts)
    z, nstep = z0, 0
    while True:
        fz = f(z)
        nstep += 1
        tracker.record(z, fz, None)
        if tracker.stop() or nstep >= max_iter:
            return tracker.finish(nstep, {})
        b = opts.anchor / (nstep + 1)
        z = b * z0 + (1 - b) * fz


@pytest.fixture
def halpern_solver():
    deqbench.solvers.add("t_halpern", halpern)
    yield "t_halpern"
    deqbench.solvers.remove("t_halpern")


def test_a_sublinear_solver_is_not_told_more_steps_will_not_help(halpern_solver):
    """On a contraction Halpern's anchor keeps the residual falling as 1/k: the missed
    tolerance is a matter of many more steps (or a faster solver), not of a cycle."""
    z0 = torch.zeros(3, 2, dtype=torch.float64)
    f = lambda z: 0.5 * z + 1  # noqa: E731
    z, st = deqbench.solvers.get(halpern_solver)(f, z0, max_iter=50, tol=1e-6, stop_mode="abs")
    assert not st.converged and st.nstep == 50
    st.extra["registered"] = halpern_solver
    tr = st.abs_trace.amax(dim=1)
    assert abs(float(tr[24] / tr[49]) / 2 - 1) < 0.05  # the residual falls as 1/k
    with verdict.solve_ledger() as led:
        verdict.record("forward", st, 50)
    (rec,) = led.records
    assert rec.rate == "sublinear" and not rec.plateau
    assert 0.7 < rec.power < 1.4 and rec.to_tol > 1000 * 50
    note = _tally(led.records).note()
    assert "will not help" not in note and "cycle" not in note, note
    assert "k^-1" in note and "try solver anderson" in note, note


def _nan_solver(f, z0, *, max_iter=50, tol=1e-4, stop_mode="rel", **options):
    """Returns z0 (finite) with a NaN residual, as a solver whose iterates overflowed."""
    nan = torch.full((z0.shape[0],), float("nan"), dtype=z0.dtype)
    return z0, make_stats("nan", 1, [nan], [nan], nan, nan, tol, stop_mode, True)


SUITE = """\
schema: 1
name: h
device: cpu
threads: 1
seeds: [0]
data: {name: digits, train_subset: 64, test_subset: 32}
defaults:
  model: {name: fc_deq_tiny}
  solver: {name: t_nan_solver, max_iter: 30, tol: 1.0e-4}
  backward: {name: ift, solver: fixed_point, max_iter: 30, tol: 1.0e-4}
  train: {epochs: 1, batch_size: 32, eval_before: false}
analyses: [metrics]
output: results
"""


def test_training_names_a_solver_nan_not_a_finite_loss():
    from deqbench.data.base import DataBundle
    from deqbench.deq import SolverConfig, configure
    from deqbench.run.train import TrainConfig, train

    deqbench.solvers.add("t_nan_solver", _nan_solver)
    try:
        torch.manual_seed(0)
        model = deqbench.models.create("fc_deq_tiny", in_shape=(64,), num_outputs=10)
        configure(model, SolverConfig("t_nan_solver", max_iter=30, tol=1e-4))
        x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
        data = DataBundle("d", (x, y), (x, y), (64,), 10)
        res = train(model, data, TrainConfig(epochs=1, batch_size=16, eval_before=False))
    finally:
        deqbench.solvers.remove("t_nan_solver")
    assert res.status == "nan" and res.steps == 0, (res.status, res.note)
    assert "forward solver produced a non-finite residual (nan)" in res.note, res.note
    assert "non-finite loss" not in res.note  # the loss of z0's readout was finite


@pytest.mark.slow  # a run through the CLI: several seconds
def test_a_solver_that_produced_nan_is_named_in_the_note(tmp_path):
    deqbench.solvers.add("t_nan_solver", _nan_solver)
    try:
        p = write_suite(tmp_path, SUITE)
        # --no-check: the up-front contract check would refuse a solver making no progress
        r = CliRunner().invoke(app, ["run", str(p), "--no-progress", "--no-plots", "--no-check"])
    finally:
        deqbench.solvers.remove("t_nan_solver")
    assert (tmp_path / "results" / "h").exists(), r.output
    run_dir = next((tmp_path / "results" / "h").iterdir())
    df = deqbench.load_results(run_dir)
    runner = df[df.analysis == "runner"].iloc[0]
    assert runner.status == "nan", (runner.status, runner.note)
    assert "forward solver produced a non-finite residual (nan)" in runner.note, runner.note
    assert "non-finite loss" not in runner.note  # the loss was finite
    assert r.output.count("produced a non-finite residual") == 1, r.output  # printed once
