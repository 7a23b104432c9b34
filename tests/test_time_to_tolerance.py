"""Time to tolerance: the f-evaluations at which each tolerance is first reached are
those at which a solve with that tolerance stops (SolverStats.nstep), per batch, forward and
adjoint; the rows summarise them over batches; a tolerance not reached is recorded as such."""

from __future__ import annotations

import statistics

import pytest
import torch

import deqbench
from deqbench.convergence._common import batches_of
from deqbench.convergence.time_to_tolerance import first_reach, timed_solve
from deqbench.core.config import BackwardConfig, SolverConfig
from deqbench.core.registry import analyses
from deqbench.testing import example_context

SOLVERS = ("fixed_point", "anderson", "broyden")
TOLS = [1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-8]


def contraction(B: int = 6, D: int = 24, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(D, D, generator=g, dtype=torch.float64)
    W *= 0.9 / torch.linalg.matrix_norm(W, 2)
    b = torch.randn(B, D, generator=g, dtype=torch.float64)
    return lambda z: torch.tanh(z @ W.T + b), torch.zeros(B, D, dtype=torch.float64)


@pytest.mark.parametrize("name", SOLVERS)
def test_first_reach_is_where_a_solve_with_that_tolerance_stops(name):
    f, z0 = contraction()
    solve = deqbench.solvers.get(name)
    long = timed_solve(solve, f, z0, max_iter=200, tol=min(TOLS))
    assert long.stats.converged and long.aligned
    assert len(long.times) == long.stats.nstep
    assert all(b > a for a, b in zip(long.times, long.times[1:]))  # one stamp per f-evaluation
    assert long.times[-1] <= long.total
    reach = first_reach(long.stats, TOLS)
    assert reach[-1] == long.stats.nstep
    for tol, k in zip(TOLS, reach):
        _, st = solve(f, z0, max_iter=200, tol=tol)
        assert st.converged and k == st.nstep, (name, tol, k, st.nstep)
    assert reach == sorted(reach) and reach[0] < reach[-1]  # the levels are distinct


def test_a_tolerance_not_reached_is_none_never_interpolated():
    f, z0 = contraction()
    ts = timed_solve(deqbench.solvers.get("fixed_point"), f, z0, max_iter=6, tol=1e-8)
    assert not ts.stats.converged and ts.stats.nstep == 6
    reach = first_reach(ts.stats, [1e-1, 1e-8])
    assert reach[0] is not None and reach[0] <= 6 and reach[1] is None


def _rows(rows, variant):
    return {r.metric: r for r in rows if r.variant == variant}


def test_rows_agree_with_the_solver_statistics_forward_and_adjoint():
    """The analysis on fc_deq_tiny (float64, 4 batches of 4, cell weights N(0, 0.01): the
    batches need different counts): for every solver, pass and tolerance,
    nfev_to_tol median/min/max equal those of the SolverStats the DEQ layer reports when it
    solves with that tolerance (forward: ``layer.solve``; adjoint: the IFT backward of a real
    ``autograd.grad``, forward-solved by the solver whose z* the analysis used)."""
    ctx = example_context("fc_deq_tiny", dtype="float64", init={"name": "normal", "var": 0.01},
                          train={"epochs": 0, "batch_size": 4})  # fmt: skip
    solvers, tols, max_iter = ["anderson", "fixed_point"], [1e-2, 1e-4, 1e-6], 100
    a = analyses.get("time_to_tolerance")(
        {"solvers": solvers, "tols": tols, "max_iter": max_iter, "batches": 4, "warmup": 0}
    )
    rows = a.after_training(ctx)
    model, layer = ctx.model, ctx.model.deq
    model.eval()
    data, _ = batches_of(ctx, "test", 4, 4)
    fwd = {(s, t): [] for s in solvers for t in tols}
    adj = {(s, t): [] for s in solvers for t in tols}
    params = [p for p in model.parameters() if p.requires_grad]
    for x, y in data:
        with torch.no_grad():
            u = model.inject(x)
            z0 = model.z0(u)
            res = {}
            for s in solvers:
                for t in tols:
                    _, st = layer.solve(u, z0, SolverConfig(s, max_iter=max_iter, tol=t))
                    fwd[(s, t)].append(st.nstep)
                res[s] = layer.solve(u, z0, SolverConfig(s, max_iter=max_iter, tol=min(tols)))
                res[s] = res[s][1].rel_max
        best = min(solvers, key=lambda s: (res[s], solvers.index(s)))
        for s in solvers:
            for t in tols:
                layer.configure(
                    SolverConfig(best, max_iter=max_iter, tol=min(tols)),
                    BackwardConfig("ift", solver=s, max_iter=max_iter, tol=t),
                )
                loss = torch.nn.functional.cross_entropy(model(x), y)
                torch.autograd.grad(loss, params)
                adj[(s, t)].append(layer.last_backward_stats.nstep)
    checked, varied = 0, 0
    for kind, ref in (("forward", fwd), ("adjoint", adj)):
        for (s, t), counts in ref.items():
            r = _rows(rows, f"{s}-{kind}-tol={t:g}")
            assert r["reached"].value == 1.0, (s, kind, t, r["reached"].note)
            assert r["nfev_to_tol_median"].value == statistics.median(counts), (s, kind, t, counts)
            assert r["nfev_to_tol_min"].value == min(counts)
            assert r["nfev_to_tol_max"].value == max(counts)
            varied += min(counts) < max(counts)
            q1, med, q3 = (r[f"time_to_tol_ms_{m}"].value for m in ("q1", "median", "q3"))
            assert 0 < q1 <= med <= q3
            checked += 1
        for s in solvers:
            r = _rows(rows, f"{s}-{kind}")
            assert r["nstep_median"].value == statistics.median(ref[(s, min(tols))])
    assert checked == 2 * len(solvers) * len(tols) and varied >= 4  # the batches differ
    # the tighter the tolerance, the more f-evaluations (distinct levels: the test can fail)
    meds = [_rows(rows, f"fixed_point-forward-tol={t:g}")["nfev_to_tol_median"].value for t in tols]
    assert meds == sorted(meds) and meds[0] < meds[-1]


def test_unreached_tolerances_are_rows_saying_so():
    ctx = example_context("fc_deq_tiny", train={"epochs": 0, "batch_size": 16})
    a = analyses.get("time_to_tolerance")(
        {
            "solvers": ["fixed_point"],
            "tols": [0.5, 1e-9],
            "max_iter": 4,
            "batches": 2,
            "warmup": 0,
            "passes": ["forward"],
        }  # fmt: skip
    )
    rows = a.after_training(ctx)
    loose = _rows(rows, "fixed_point-forward-tol=0.5")
    tight = _rows(rows, "fixed_point-forward-tol=1e-09")
    assert loose["reached"].value == 1.0 and loose["nfev_to_tol_median"].status == "ok"
    assert tight["reached"].value == 0.0
    for m in ("nfev_to_tol_median", "time_to_tol_ms_median"):
        assert tight[m].status == "skipped" and "not reached by 2 of 2 batches" in tight[m].note
    assert "time_to_tol_ms_q1" not in tight  # no number for a level not reached
    assert _rows(rows, "fixed_point-forward")["converged"].value == 0.0
    assert not any("adjoint" in r.variant for r in rows)


def test_headline_ranks_the_solvers():
    import pandas as pd

    ctx = example_context("fc_deq_tiny", train={"epochs": 0, "batch_size": 16})
    cls = analyses.get("time_to_tolerance")
    a = cls({"solvers": ["anderson", "fixed_point"], "tols": [1e-2, 1e-4], "batches": 2})
    rows = a.after_training(ctx)
    df = pd.DataFrame([vars(r) for r in rows])
    lines = cls.headline(df)
    assert len(lines) == 2 and lines[0].startswith("forward to rel 0.0001")
    assert "anderson" in lines[0] and "fixed_point" in lines[0]
