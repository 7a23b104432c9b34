"""Plot functions build Figures from results DataFrames; the registry; no pyplot."""

from __future__ import annotations

import subprocess
import sys

import pandas as pd
import pytest
from matplotlib.figure import Figure

from deqbench.run import plots
from deqbench.run.results import ResultsWriter


def _results() -> pd.DataFrame:
    rows = []
    for cell in ("fc-anderson-ift", "fc-broyden-ift"):
        for seed in (0, 1):
            for epoch in (0, 1, 2):
                for analysis, variant, metric, value in (
                    ("solver_stats", "train", "forward_nstep", 10 + epoch + seed),
                    ("solver_stats", "train", "backward_nstep", 20 - epoch),
                    ("metrics", "train", "loss", 2.0 / (epoch + 1)),
                    ("metrics", "test", "loss", 2.1 / (epoch + 1)),
                    ("metrics", "test", "accuracy", 0.3 * epoch),
                ):
                    rows.append(
                        {
                            "run_id": "r",
                            "cell_id": cell,
                            "model": "fc",
                            "solver": cell.split("-")[1],
                            "init": "default",
                            "seed": seed,
                            "analysis": analysis,
                            "variant": variant,
                            "metric": metric,
                            "step": epoch,
                            "repeat": 0,
                            "value": float(value),
                            "unit": "",
                            "status": "ok",
                            "note": "",
                        }
                    )
    return pd.DataFrame(rows)


def test_plot_functions_return_figures_with_the_data():
    df = _results()
    fig = plots.iterations_per_epoch(df)
    assert isinstance(fig, Figure) and len(fig.axes) == 2
    ax = fig.axes[0]
    lines = [ln for ln in ax.lines if not ln.get_label().startswith("_")]
    assert len(lines) == 2
    # median over seeds 0 and 1 of 10 + epoch + seed
    assert list(lines[0].get_ydata()) == [10.5, 11.5, 12.5]
    assert sorted(t.get_text() for t in fig.axes[1].get_legend().get_texts()) == [
        "anderson",
        "broyden",
    ]
    fig = plots.training_curves(df)
    assert isinstance(fig, Figure) and [a.get_title() for a in fig.axes] == [
        "fc: train cross-entropy",
        "fc: test cross-entropy",
        "fc: test accuracy",
    ]
    assert plots.iterations_per_epoch(df[df.analysis == "metrics"]) is None
    assert plots.training_curves(df.iloc[0:0]) is None
    traces = pd.DataFrame(
        {
            "cell_id": "c",
            "seed": 0,
            "phase": ["init", "init", "final", "final"],
            "layer": 0,
            "iteration": [1, 2, 1, 2],
            "rel_max": [1.0, 0.1, 1.0, 0.01],
        }
    )
    fig = plots.residual_traces(traces)
    assert isinstance(fig, Figure) and [len(a.lines) for a in fig.axes] == [1, 1]


def test_short_labels_drop_shared_parts():
    ids = [
        "conv-anderson-ift-tol=1e-06",
        "conv-anderson-ift-tol=1e-04",
        "conv-broyden-ift-tol=1e-06",
    ]
    assert plots.short_labels(ids) == {
        "conv-anderson-ift-tol=1e-06": "anderson-tol=1e-06",
        "conv-anderson-ift-tol=1e-04": "anderson-tol=1e-04",
        "conv-broyden-ift-tol=1e-06": "broyden-tol=1e-06",
    }


def _register_test_plots() -> None:
    """Two plots registered in this process only: one failing, one drawing (``extra.png``)."""

    @plots.register("test_broken")
    def broken(df, run_dir):
        raise RuntimeError("boom")

    @plots.register("test_extra")
    def extra(df, run_dir):
        fig = plots.new_figure()
        fig.axes[0].plot([0, 1], [len(df), len(df)])
        return {"extra": fig}


def test_registry_and_write_plots_survive_a_failing_plot(tmp_path):
    ResultsWriter(tmp_path).append(_results().to_dict("records"))

    _register_test_plots()

    try:
        assert {"solver_stats", "metrics", "test_broken", "test_extra"} <= set(plots.names())
        paths, errors = plots.write_plots(tmp_path)
    finally:
        plots._REGISTRY.pop("test_broken")
        plots._REGISTRY.pop("test_extra")
    names = sorted(p.name for p in paths)
    assert names == ["extra.png", "solver_iterations.png", "training_curves.png"]
    assert all(p.stat().st_size > 1000 and p.read_bytes()[:4] == b"\x89PNG" for p in paths)
    assert errors == ["plot 'test_broken' failed: RuntimeError: boom"]


@pytest.mark.slow  # several seconds on 2 cores: out of the fast lane
def test_library_plots_do_not_import_pyplot(tmp_path):
    ResultsWriter(tmp_path).append(_results().to_dict("records"))
    code = (
        "import sys; from deqbench.run.plots import write_plots; p, e = write_plots(sys.argv[1]); "
        "assert p and not e, e; assert 'matplotlib.pyplot' not in sys.modules; print('ok')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert out.stdout.strip() == "ok", out.stderr


@pytest.mark.slow  # several seconds on 2 cores: out of the fast lane
def test_plot_pool_draws_the_same_figures_in_its_processes(tmp_path):
    """A PlotPool's processes draw the built-in figures byte for byte as the coordinator does;
    a plot registered only here (unknown to them) and a failing one are drawn here, in the
    same order and with the same error line; the outcome checks' callback runs meanwhile."""
    import os

    df = _results()
    serial, pooled = tmp_path / "serial", tmp_path / "pooled"
    for d in (serial, pooled):
        d.mkdir()
        ResultsWriter(d).append(df.to_dict("records"))

    _register_test_plots()

    # a plot the pool's processes import too (a module of the user's), and one failing there
    mod = tmp_path / "pool_plot_mod.py"
    mod.write_text(
        "from deqbench.run import plots\n"
        "@plots.register('test_pool_broken')\n"
        "def broken(df, run_dir):\n"
        "    raise ValueError('in the pool')\n"
    )
    sys.path.insert(0, str(tmp_path))
    import pool_plot_mod  # noqa: F401

    called: list[int] = []
    pool = plots.PlotPool(set(), 2, modules=["pool_plot_mod"])
    try:
        pids = pool.pids()
        assert len(pids) == 2 and os.getpid() not in pids
        jobs = pool.submit(["metrics", "test_extra"], df, pooled)
        assert pool.result(jobs["test_extra"]) is None  # not registered in the pool's processes
        drawn = pool.result(jobs["metrics"])
        assert drawn is not None and drawn == ([pooled / "plots" / "training_curves.png"], [])
        broke = pool.result(pool.submit(["test_pool_broken"], df, pooled)["test_pool_broken"])
        assert broke == ([], ["plot 'test_pool_broken' failed: ValueError: in the pool"])
        pool.drawn = 0
        got = plots.write_plots(pooled, pool=pool, meanwhile=lambda: called.append(1))
        want = plots.write_plots(serial)
        n_names = len(plots.names())
    finally:
        pool.close()
        sys.path.remove(str(tmp_path))
        for name in ("test_broken", "test_extra", "test_pool_broken"):
            plots._REGISTRY.pop(name)
    # drawn there: every plot but the two registered only here (drawn here)
    assert pool.drawn == n_names - 2 and pool.drawn >= 3
    assert called == [1]
    assert [p.name for p in got[0]] == [p.name for p in want[0]]
    assert {p.name for p in got[0]} == {"extra.png", "solver_iterations.png", "training_curves.png"}
    assert (
        got[1]
        == want[1]
        == [
            "plot 'test_broken' failed: RuntimeError: boom",
            "plot 'test_pool_broken' failed: ValueError: in the pool",
        ]
    )
    for a, b in zip(got[0], want[0]):
        assert a.read_bytes() == b.read_bytes(), a.name


def test_plot_processes_follows_the_cores_and_the_variable(monkeypatch):
    monkeypatch.delenv(plots.PLOT_PROCESSES_ENV, raising=False)
    assert [plots.plot_processes(c) for c in (2, 4, 8, 16, 64)] == [0, 0, 2, 4, 4]
    monkeypatch.setenv(plots.PLOT_PROCESSES_ENV, "3")
    assert plots.plot_processes(2) == 3
    monkeypatch.setenv(plots.PLOT_PROCESSES_ENV, "0")
    assert plots.plot_processes(64) == 0
