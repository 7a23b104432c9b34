"""On CPU: the run's time breakdown (deqbench.run.timeline) adds up, longest tasks are
handed out first (deqbench.run.schedule) while results.csv keeps the suite's order, and a
cluster started with Dask's own CLI (``dask scheduler`` / ``dask worker``) gives the inline rows.
No timing is asserted: only the arithmetic of the breakdown."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from conftest import write_suite
from test_dask import (  # noqa: F401  (fast_workers is a fixture)
    FLAGS,
    HAVE_DASK,
    _key_rows,
    _run_dir,
    _stop,
    fast_workers,
    invoke,
    needs_dask,
)

from deqbench.run.results import RUNNER, load_results
from deqbench.run.schedule import CostModel, lpt_order, static_cost
from deqbench.run.timeline import PHASES, amdahl, breakdown, format_breakdown, serial_budget

ROOT = Path(__file__).resolve().parents[1]
#: slack of the breakdown's sums: they are differences of the same timestamps (float rounding)
SLACK = 1e-6
#: two cells of different cost (forward max_iter 5 and 40), two seeds
LPT = {
    "matrix:\n  backward: [ift, unrolled]": "matrix:\n  solver:\n"
    "    - {name: fixed_point, max_iter: 5, tol: 1.0e-3}\n"
    "    - {name: fixed_point, max_iter: 40, tol: 1.0e-3}",
    "seeds: [0]": "seeds: [0, 1]",
}


def _task_order(run_dir: Path) -> list[tuple[str, int]]:
    df = load_results(run_dir)
    return list(dict.fromkeys(zip(df.cell_id, df.seed)))


def check_breakdown(b: dict) -> None:
    """Every phase and every worker's account is non-negative and they add up."""
    assert list(b["phases"]) == PHASES
    assert all(v >= -SLACK for v in b["phases"].values()), b["phases"]
    assert abs(sum(b["phases"].values()) - b["wall_s"]) < SLACK
    assert abs(b["serial_s"] + b["task_phase_s"] - b["wall_s"]) < SLACK
    span = b["task_phase_s"]
    for name, w in b["workers"].items():
        parts = ["late start", "cell work", "task overhead", "gaps", "idle at the end"]
        assert all(w[k] >= -SLACK for k in parts), (name, w)
        assert abs(sum(w[k] for k in parts) - span) < SLACK, (name, w, span)
    assert b["task_time_s"] >= b["cell_work_s"] - SLACK


def test_static_cost_and_lpt_order():
    class C:
        def __init__(self, it, epochs=1):
            self.solver, self.backward, self.train = (
                {"max_iter": it},
                {"max_iter": 10},
                {"epochs": epochs},
            )

    assert static_cost(C(40)) > static_cost(C(5)) and static_cost(C(5, 3)) > static_cost(C(5))
    m = CostModel()
    keys = [
        ("a", 0, 1.0),
        ("b", 0, 4.0),
        ("c", 0, 4.0),
        ("a", 1, 1.0),
        ("b", 1, 4.0),
        ("c", 1, 4.0),
    ]
    # nothing measured: seed-major, static cost decreasing, ties in the given order
    assert lpt_order(keys, m) == [1, 2, 0, 4, 5, 3]
    # measured: "a" turned out long (10 s), "b" short (1 s): "c" is scaled by b's s/unit
    m.observe("a", 1.0, 10.0)
    m.observe("b", 4.0, 1.0)
    assert m.estimate("c", 4.0) == pytest.approx(4.0 * (10.0 + 0.25) / 2)
    assert lpt_order(keys[3:], m) == [2, 0, 1]  # c 20.5 s, a 10 s, b 1 s


def test_breakdown_of_an_inline_run_adds_up(tmp_path):
    p = write_suite(tmp_path, replace=LPT)
    r = invoke("run", p, *FLAGS, "--out", tmp_path / "inline")
    assert r.exit_code in (0, 1), r.output
    d = _run_dir(tmp_path / "inline")
    b = breakdown(d)
    check_breakdown(b)
    assert b["tasks"] == 4 and len(b["workers"]) == 1
    assert b["phases"]["tail"] < 0.05 and b["phases"]["cluster wait"] == 0.0  # one worker
    assert "| **sum** |" in format_breakdown(b)
    # externally measured launch and exit (the benchmark's) widen start-up and exit only
    run_start = json.loads((d / "run.json").read_text())["timelines"][-1]["phases"]["run_start"]
    end = run_start + sum(list(b["phases"].values())[1:])
    ext = breakdown(d, launched=run_start - 1.5, exited=end + 0.5)
    check_breakdown(ext)
    assert ext["phases"]["start-up"] == pytest.approx(1.5)
    assert ext["phases"]["exit"] == pytest.approx(0.5, abs=1e-5)
    assert ext["wall_s"] == pytest.approx(b["wall_s"] - b["phases"]["start-up"] + 2.0, abs=1e-5)
    # figures drawn by a plot pool while the outcome checks ran: the overlap counts as plots
    meta = json.loads((d / "run.json").read_text())
    ph = meta["timelines"][-1]["phases"]
    ph["plots_end"] = ph["outcomes_end"] + 1.0
    ph["outcomes_end"] = ph["plots_start"] + 0.5
    ph["end"] += 1.0
    (d / "run.json").write_text(json.dumps(meta))
    lap = breakdown(d)
    check_breakdown(lap)
    assert lap["phases"]["outcome checks"] == 0.0
    assert lap["phases"]["plots"] == pytest.approx(ph["plots_end"] - ph["plots_start"])
    assert lap["wall_s"] == pytest.approx(b["wall_s"] + 1.0)


@needs_dask
@pytest.mark.slow
def test_dask_run_breakdown_lpt_order_and_suite_ordered_rows(
    tmp_path,
    fast_workers,  # noqa: F811
    monkeypatch,
):
    """Two local workers: the breakdown adds up per phase and per worker; the long cell's first
    seed is submitted first (Dask priorities decreasing); results.csv lists the tasks in the
    suite's order with the inline rows, whatever finished first; the Amdahl bound is computed.
    A plot pool (two processes) draws the figures while the outcome checks run."""
    from deqbench.run.plots import PLOT_PROCESSES_ENV

    monkeypatch.setenv(PLOT_PROCESSES_ENV, "2")
    from deqbench.run.executors.dask import DaskExecutor
    from deqbench.run.runner import run_suite
    from deqbench.run.suite import load_suite

    # no pool beside a local CPU cluster (its workers use the cores); this one stands in for a
    # GPU cluster or a cluster of yours
    cpu = DaskExecutor(workers=2)
    cpu.layout = cpu.worker_specs("cpu", None)[1]
    assert cpu.uses_local_cores
    monkeypatch.setattr(DaskExecutor, "uses_local_cores", property(lambda self: False))

    p = write_suite(tmp_path, replace=LPT)
    r = invoke("run", p, *FLAGS, "--out", tmp_path / "inline")
    assert r.exit_code in (0, 1), r.output
    inline = _run_dir(tmp_path / "inline")
    suite = load_suite(p)
    ex = DaskExecutor(workers=2)
    with ex:
        ex.start("cpu", suite.threads, wait=False)
        summary = run_suite(suite, out=tmp_path / "dask", executor=ex, progress=False, plots=True)
    assert summary.exit_code in (0, 1)
    d = summary.run_dir
    assert summary.plots and all(p.is_file() and p.parent == d / "plots" for p in summary.plots)
    tl = json.loads((d / "run.json").read_text())["timelines"][-1]
    ph = tl["phases"]
    assert ph["plots_start"] <= ph["outcomes_end"] <= ph["plots_end"]  # side by side
    assert tl["plot_pool"]["processes"] == 2 and tl["plot_pool"]["drawn"] >= 2  # drawn there
    long_cell, short_cell = suite.cells[1].id, suite.cells[0].id
    assert "40" in str(suite.cells[1].solver["max_iter"])
    got = [(c, s) for c, s, _ in ex.submitted]
    assert got[:2] == [(long_cell, 0), (short_cell, 0)], got  # seed-major, longest first
    assert sorted(s for _, s in got[2:]) == [1, 1]
    prios = [pr for _, _, pr in ex.submitted]
    assert prios == sorted(prios, reverse=True) and len(set(prios)) == len(prios)
    # rows: the inline ones, in the suite's order of tasks
    assert _task_order(d) == _task_order(inline) == [(c.id, s) for c in suite.cells for s in (0, 1)]
    pd.testing.assert_frame_equal(_key_rows(load_results(d)), _key_rows(load_results(inline)))
    b = breakdown(d)
    check_breakdown(b)
    assert b["tasks"] == 4 and 1 <= len(b["workers"]) <= 2
    assert b["cluster"]["start_s"] is not None and b["cluster"]["start_s"] > 0
    assert all(w["warm-up"] is not None for w in b["workers"].values())
    base = breakdown(inline)
    bounds = amdahl(base, b, gpus=2)
    assert bounds["limit"] >= bounds["amdahl"] > 0 and bounds["packing"] > 0
    assert serial_budget(base, 2, 1.8) < base["wall_s"]


@needs_dask
def test_canonical_order_is_restored_after_completion_order(tmp_path):
    """results.csv written in completion order (blocks of tasks) is rewritten in the suite's
    order; a resume's manifest check still accepts every task."""
    from deqbench.run.results import check_finished
    from deqbench.run.runner import canonical_order

    p = write_suite(tmp_path, replace=LPT)
    r = invoke("run", p, *FLAGS, "--out", tmp_path / "inline")
    d = _run_dir(tmp_path / "inline")
    want = _task_order(d)
    lines = (d / "results.csv").read_text().splitlines(keepends=True)
    df = load_results(d)
    blocks: dict = {}
    for line, c, s in zip(lines[1:], df.cell_id, df.seed):
        blocks.setdefault((c, s), []).append(line)
    (d / "results.csv").write_text(lines[0] + "".join("".join(blocks[k]) for k in reversed(want)))
    assert _task_order(d) == want[::-1]
    assert canonical_order(d, want) is True
    assert _task_order(d) == want and canonical_order(d, want) is False
    done, notes = check_finished(d)
    assert len(done) == 4 and not notes
    assert r.exit_code in (0, 1)


def _dask_cli_cluster(tmp_path: Path, n: int, env: dict) -> tuple[list, str, object]:
    dask_cli = [sys.executable, "-m", "dask"]
    sched_file = tmp_path / "scheduler.json"
    log = open(tmp_path / "cluster.log", "w")  # noqa: SIM115 - closed by the caller
    procs = [
        subprocess.Popen(
            [*dask_cli, "scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
             "--scheduler-file", str(sched_file)],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    ]  # fmt: skip
    for i in range(n):
        procs.append(subprocess.Popen(
            [*dask_cli, "worker", "--scheduler-file", str(sched_file), "--host", "127.0.0.1",
             "--nworkers", "1", "--nthreads", "1", "--no-dashboard", "--name", f"host{i}-gpu0",
             "--preload", "deqbench.run.executors.worker"],
            env={**env, "CUDA_VISIBLE_DEVICES": ""}, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        ))  # fmt: skip
    return procs, str(sched_file), log


@needs_dask
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_multi_host_recipe_gives_inline_rows(tmp_path):
    """The recipe of docs/dask.md ("Several machines") with separate processes on one machine:
    `dask scheduler` on a free port, two `dask worker` processes (one thread each, deqbench's
    preload, pinned through CUDA_VISIBLE_DEVICES), `deqbench run --executor dask --scheduler
    tcp://...` as a subprocess: the rows equal the inline run's, in the suite's order, and the
    breakdown names both workers. Processes are stopped whatever happens."""
    if not HAVE_DASK:
        pytest.skip("dask[distributed] is not installed")
    p = write_suite(tmp_path, replace=LPT)
    r = invoke("run", p, *FLAGS, "--out", tmp_path / "inline")
    assert r.exit_code in (0, 1), r.output
    env = {
        **os.environ,
        "DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES": "1",
        "DEQBENCH_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    procs, sched_file, log = _dask_cli_cluster(tmp_path, 2, env)
    try:
        deadline = time.monotonic() + 90
        while not Path(sched_file).exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        address = json.loads(Path(sched_file).read_text())["address"]
        assert address.startswith("tcp://127.0.0.1:")
        from distributed import Client

        with Client(address, timeout=30, set_as_default=False) as c:
            c.wait_for_workers(2, timeout=120)
        run = subprocess.run(
            [sys.executable, "-m", "deqbench", "run", str(p), *FLAGS, "--out",
             str(tmp_path / "dask"), "--executor", "dask", "--scheduler", address],
            env=env, capture_output=True, text=True, timeout=150,
        )  # fmt: skip
        assert run.returncode in (0, 1), run.stderr[-3000:]
        assert all(q.poll() is None for q in procs)  # the cluster is not ours to stop
    finally:
        for q in reversed(procs):
            _stop(q)
        log.close()
    d, inline = _run_dir(tmp_path / "dask"), _run_dir(tmp_path / "inline")
    got = load_results(d)
    assert len(got[got.analysis == RUNNER]) == 4
    assert _task_order(d) == _task_order(inline)
    pd.testing.assert_frame_equal(_key_rows(got), _key_rows(load_results(inline)))
    b = breakdown(d)
    check_breakdown(b)
    assert set(b["workers"]) <= {"host0-gpu0", "host1-gpu0"}
    meta = json.loads((d / "run.json").read_text())
    assert meta["executor"]["scheduler"] == address
