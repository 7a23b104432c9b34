"""Performance analyses ``throughput``, ``backward``, ``solver_overhead`` on tiny CPU models:
rows, units, statuses, and the numerical claims of the gradient-accuracy metric (never
timings)."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest
import torch

import deqbench
import deqbench.errors
from deqbench.analyses.base import CellContext
from deqbench.data.base import load_data
from deqbench.deq import BackwardConfig, SolverConfig, configure
from deqbench.performance.backward import measure_mode
from deqbench.performance.gradients import grad_vector, gradient_accuracy, reference_gradient


@pytest.fixture(autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def digits():
    return load_data("digits", flatten=True, train_subset=48, test_subset=16)


def _fc(width: int = 8, dtype=torch.float32):
    torch.manual_seed(0)
    m = deqbench.models.create("fc_deq_tiny", in_shape=(64,), num_outputs=10, width=width)
    deqbench.inits.get("spectral")(m, seed=0, target=0.5)  # contractive: everything converges
    configure(m, SolverConfig("anderson", 100, 1e-6), BackwardConfig("ift", max_iter=100, tol=1e-6))
    return m.to(dtype)


def _ctx(model, data, run_dir=None, epochs=1, batch=16, name="fc_deq_tiny"):
    cell = {"model": {"name": name}, "train": {"epochs": epochs, "batch_size": batch}}
    return CellContext(model, data, torch.device("cpu"), torch.float32, 0, "cell", cell, run_dir)


def _by(rows, metric, variant=None):
    return [r for r in rows if r.metric == metric and (variant is None or r.variant == variant)]


def test_gradient_accuracy_of_the_reference_itself_and_of_unrolled_large_k():
    m = _fc()
    x, y = torch.randn(6, 64), torch.randint(0, 10, (6,))
    g_ref, info = reference_gradient(m, x, y, tol=1e-12, max_iter=500)
    assert info["forward_rel_residual"] < 1e-11 and info["backward_rel_residual"] < 1e-11
    again, _ = reference_gradient(m, x, y, tol=1e-12, max_iter=500)
    cos, err = gradient_accuracy(again, g_ref)
    assert cos == pytest.approx(1.0, abs=1e-14) and err == pytest.approx(0.0, abs=1e-14)
    assert gradient_accuracy(-g_ref.vec, g_ref) == pytest.approx((-1.0, 2.0))

    # the same model in float64: unrolled with a large K and tight IFT match the reference
    m64 = _fc(dtype=torch.float64)
    x64 = x.double()
    kw = {"g_ref": g_ref, "repeats": 1, "warmup": 0, "memory": False}
    unrolled = measure_mode(m64, x64, y, "classification", BackwardConfig("unrolled", k=200), **kw)
    assert unrolled["rel_error"] < 1e-10 and unrolled["cosine"] == pytest.approx(1.0, abs=1e-12)
    tight = SolverConfig("anderson", 500, 1e-12)
    ift = measure_mode(
        m64, x64, y, "classification", BackwardConfig("ift", max_iter=500, tol=1e-12), tight, **kw
    )
    assert ift["rel_error"] < 1e-9
    jfb = measure_mode(m64, x64, y, "classification", BackwardConfig("jfb"), tight, **kw)
    assert jfb["rel_error"] > 1e3 * ift["rel_error"] and jfb["cosine"] < 1.0
    # float32 IFT: accurate to the forward/adjoint tolerance, gradients matched by name
    g32 = grad_vector(m, x, y, names=g_ref.names)
    assert gradient_accuracy(g32, g_ref)[1] < 1e-4
    # measuring restored the model's configs
    assert m64.deq.backward_cfg.name == "ift" and m64.deq.solver_cfg.tol == 1e-6


def test_backward_analysis_rows_series_and_statuses(digits, tmp_path):
    model = _fc()
    before = [p.detach().clone() for p in model.parameters()]
    ctx = _ctx(model, digits, tmp_path)
    a = deqbench.analyses.get("backward")(
        {
            "modes": [
                {"name": "ift", "tol": 1e-3},
                {"name": "ift", "tol": 1e-6},
                {"name": "unrolled", "k": 20},
                {"name": "jfb"},
                {"name": "phantom", "k": 3, "tau": 0.5},
                {"name": "ift", "wrapper": "fc_deq_tiny", "label": "not_a_wrapper"},
            ],
            "repeats": 2,
            "warmup": 0,
            "memory": False,
            "at": ["init", "trained"],
            "ref_tol": 1e-11,
            "ref_max_iter": 300,
            "memory_series": [2, 4, 8],
        }
    )
    rows = list(a.before_training(ctx)) + list(a.after_training(ctx))
    assert {r.step for r in rows} == {0, 1}  # init and after the cell's 1 epoch
    init = [r for r in rows if r.step == 0]
    variants = {"ift-tol=0.001", "ift-tol=1e-06", "unrolled-k=20", "jfb", "phantom-k=3-tau=0.5"}
    for v in variants:
        assert len(_by(init, "step_ms", v)) == 2  # every repeat stored
        assert _by(init, "step_ms_median", v)[0].unit == "ms"
        (err,) = _by(init, "grad_rel_error", v)
        assert math.isfinite(err.value) and err.status == "ok"
        assert _by(init, "peak_memory", v) == []  # memory: false
        act = _by(init, "activation_memory", v)[0]
        assert act.value > 0 and act.unit == "MiB"
    err = {v: _by(init, "grad_rel_error", v)[0].value for v in variants}
    assert err["ift-tol=1e-06"] < err["ift-tol=0.001"] and err["ift-tol=1e-06"] < err["jfb"]
    assert err["unrolled-k=20"] < 1e-4  # rho(J) <= 0.5: 20 steps are converged
    assert _by(init, "f_evals_grad", "unrolled-k=20")[0].value == 20
    assert _by(init, "f_evals_grad", "phantom-k=3-tau=0.5")[0].value == 3
    assert _by(init, "backward_nstep", "ift-tol=1e-06")[0].unit == "steps"
    (skip,) = _by(init, "step_ms_median", "not_a_wrapper")
    assert skip.status == "skipped" and "wrap" in skip.note
    assert _by(init, "forward_rel_residual", "reference")[0].value < 1e-10
    # memory against forward iterations: IFT flat, unrolled linear
    act = {r.variant: r.value for r in init if r.metric == "series_activation_memory"}
    assert act["ift-n=2"] == act["ift-n=4"] == act["ift-n=8"]
    assert act["unrolled-n=2"] < act["unrolled-n=4"] < act["unrolled-n=8"]
    series = pd.read_csv(next((tmp_path / "series").glob("backward_memory__*.csv")))
    assert set(series["step"]) == {0, 1} and set(series["mode"]) == {"ift", "unrolled"}
    # the model under analysis is unchanged
    assert all(torch.equal(p, q) for p, q in zip(before, model.parameters()))
    assert model.deq.backward_cfg.name == "ift" and model.training


def test_throughput_rows(digits):
    model = _fc()
    before = [p.detach().clone() for p in model.parameters()]
    a = deqbench.analyses.get("throughput")(
        {
            "batch_size": {"fc_deq_tiny": 24, "conv_deq": 128},
            "repeats": 3,
            "warmup": 1,
            "memory_cpu": False,
            "at": ["init"],
            "threads": 1,
        }
    )
    rows = list(a.before_training(_ctx(model, digits)))
    assert list(a.after_training(_ctx(model, digits))) == []
    for kind in ("eval", "train"):
        assert [r.repeat for r in _by(rows, f"{kind}_ms")] == [0, 1, 2]
        assert _by(rows, f"{kind}_ms_median")[0].unit == "ms"
        assert _by(rows, f"{kind}_ms_cpu_median")[0].unit == "ms"
        sps = _by(rows, f"{kind}_samples_per_s")[0]
        assert sps.unit == "samples/s" and sps.value > 0
        mem = _by(rows, f"{kind}_peak_memory")[0]
        assert mem.status == "skipped" and "memory_cpu" in mem.note
    assert [r.value > 0 for r in _by(rows, "eval_forward_nstep")] == [True] * 3
    assert len(_by(rows, "train_backward_nstep")) == 3
    n = sum(p.numel() for p in model.parameters())
    assert _by(rows, "param_count")[0].value == n
    assert _by(rows, "batch_size")[0].value == 24 and _by(rows, "threads")[0].value == 1
    assert all(torch.equal(p, q) for p, q in zip(before, model.parameters()))  # step on a copy
    with pytest.raises(deqbench.errors.ConfigError, match="no entry for model"):
        list(a.before_training(_ctx(model, digits, name="other")))


def test_solver_overhead_rows_and_skip(digits):
    model = _fc()
    a = deqbench.analyses.get("solver_overhead")(
        {
            "solvers": ["fixed_point", {"name": "anderson", "label": "anderson_m3", "m": 3}],
            "tols": [1e-3, 1e-5],
            "repeats": 2,
            "warmup": 0,
            "f_repeats": 2,
            "f_loop": 2,
            "memory": False,
            "at": ["trained"],
        }
    )
    rows = list(a.after_training(_ctx(model, digits, epochs=3)))
    assert {r.step for r in rows} == {3}
    for v in (
        "fixed_point-tol=0.001",
        "fixed_point-tol=1e-05",
        "anderson_m3-tol=0.001",
        "anderson_m3-tol=1e-05",
    ):
        tol = float(v.rpartition("=")[2])
        fe = _by(rows, "f_evals", v)
        assert len(fe) == 2 and fe[0].value == fe[1].value > 0 and fe[0].unit == "f-evals"
        assert len(_by(rows, "time_ms", v)) == 2
        assert _by(rows, "rel_residual", v)[0].value < tol
        assert _by(rows, "converged", v)[0].value == 1.0
        assert _by(rows, "overhead_median", v)[0].value > 0
    assert _by(rows, "t_f_ms_median")[0].value > 0
    # Anderson needs fewer f-evaluations than plain iteration at the tight tolerance
    assert (
        _by(rows, "f_evals", "anderson_m3-tol=1e-05")[0].value
        < _by(rows, "f_evals", "fixed_point-tol=1e-05")[0].value
    )

    torch.manual_seed(0)
    tied = deqbench.models.create("tied_repeat_tiny", in_shape=(64,), num_outputs=10)
    (row,) = list(a.after_training(_ctx(tied, digits, name="tied_repeat_tiny")))
    assert row.status == "skipped" and "DEQ layer" in row.note


# -- CPU peak memory on: the fresh-worker path through each analysis (one worker ~2-3 s) ---------


def _fresh_worker_row(row):
    """A CPU peak-memory row measured as the peak RSS of a fresh worker process."""
    assert row.status == "ok", row.note
    assert row.unit == "MiB" and math.isfinite(row.value) and row.value >= 0, row
    assert "rss_fresh_worker" in row.note, row.note


@pytest.mark.slow  # several seconds on 2 cores: out of the fast lane
def test_throughput_cpu_peak_memory_in_a_fresh_worker(digits):
    a = deqbench.analyses.get("throughput")(
        {"batch_size": 8, "repeats": 1, "warmup": 0, "at": ["init"], "threads": 1}
    )
    rows = list(a.before_training(_ctx(_fc(), digits)))
    for kind in ("eval", "train"):
        (mem,) = _by(rows, f"{kind}_peak_memory")
        _fresh_worker_row(mem)


def test_backward_cpu_peak_memory_in_a_fresh_worker(digits):
    a = deqbench.analyses.get("backward")(
        {
            "modes": [{"name": "ift"}],
            "batch_size": 8,
            "repeats": 1,
            "warmup": 0,
            "reference": False,
            "memory_series": [],
            "at": ["init"],
        }
    )
    rows = list(a.before_training(_ctx(_fc(), digits)))
    (mem,) = _by(rows, "peak_memory", "ift-tol=1e-06")
    _fresh_worker_row(mem)


def test_solver_overhead_cpu_peak_memory_in_a_fresh_worker(digits):
    a = deqbench.analyses.get("solver_overhead")(
        {
            "solvers": ["anderson"],
            "tols": [1e-4],
            "batch_size": 8,
            "repeats": 1,
            "warmup": 0,
            "f_repeats": 1,
            "f_loop": 1,
            "memory_cpu": True,  # off by default for this analysis
            "at": ["init"],
        }
    )
    rows = list(a.before_training(_ctx(_fc(), digits)))
    (mem,) = _by(rows, "peak_memory", "anderson-tol=0.0001")
    _fresh_worker_row(mem)


SUITE = """\
schema: 1
name: perf_tiny
device: cpu
threads: 1
seeds: [0]
data: {name: digits, flatten: true, train_subset: 32, test_subset: 16}
defaults:
  model: {name: fc_deq_tiny, width: 8}
  solver: {name: anderson, max_iter: 40, tol: 1.0e-4}
  backward: {name: ift, max_iter: 40, tol: 1.0e-5}
  train: {epochs: 1, batch_size: 16}
analyses:
  - throughput: {repeats: 2, warmup: 0, memory_cpu: false, at: [init]}
  - backward: {modes: [{name: ift}, {name: unrolled, k: 5}], repeats: 2, warmup: 0,
               memory_cpu: false, memory_series: [2, 4], ref_tol: 1.0e-10}
  - solver_overhead: {solvers: [fixed_point, anderson], tols: [1.0e-4], repeats: 2,
                      warmup: 0, f_repeats: 2, f_loop: 2, memory: false}
output: results
"""


def test_suite_runs_the_analyses_through_the_runner(tmp_path: Path):
    from conftest import write_suite

    suite = deqbench.load_suite(write_suite(tmp_path, SUITE))
    summary = deqbench.run_suite(suite, progress=False)
    assert summary.exit_code == 0, summary.failed
    df = deqbench.load_results(summary.run_dir)
    assert {"throughput", "backward", "solver_overhead"} <= set(df["analysis"])
    bw = df[df["analysis"] == "backward"]
    assert {"ift-tol=1e-05", "unrolled-k=5", "reference"} <= set(bw["variant"])
    plots = {p.name for p in (summary.run_dir / "plots").glob("*.png")}
    assert {"backward_memory.png", "backward_accuracy.png", "solver_overhead.png"} <= plots
