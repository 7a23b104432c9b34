"""Backward modes as a registry: the built-ins and the forward each needs, validation
of names, options and forward solvers (config, layer, suite), a third-party mode registered
through the ``deqbench.backward`` entry-point group joining the ``backward`` analysis'
comparison, and the analysis' new rows (memory split, descent check, accuracy after the same
optimiser steps, the modes' own diagnostics) and figure."""

from __future__ import annotations

import importlib
import math
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from lab_helpers import one_thread_seeded  # noqa: F401

import deqbench
from deqbench.analyses.base import CellContext
from deqbench.core.registry import REGISTRIES
from deqbench.data.base import load_data
from deqbench.deq import BACKWARD_MODES, BackwardConfig, DEQLayer, SolverConfig, configure
from deqbench.errors import ConfigError, UnknownNameError
from deqbench.testing import check_backward

ROOT = Path(__file__).resolve().parents[1]


def test_builtins_are_registered_and_declare_their_forward():
    names = deqbench.backward.names()
    assert set(BACKWARD_MODES) == set(names)
    assert all(deqbench.backward.origin(n) == "built-in" for n in names)
    mode = deqbench.backward.mode
    assert mode("reversible").forward == "reversible" and mode("shine").forward == "broyden"
    assert all(mode(n).forward is None for n in ("ift", "unrolled", "jfb", "phantom"))
    assert mode("ift").adjoint_solver and not mode("unrolled").solves_forward
    with pytest.raises(UnknownNameError, match="unknown backward mode 'shin'.*'shine'"):
        deqbench.backward.get("shin")


def test_names_options_and_forward_are_validated():
    with pytest.raises(ConfigError, match="unknown backward mode 'jbf'; did you mean 'jfb'"):
        BackwardConfig("jbf")
    with pytest.raises(ConfigError, match="reversal_tol"):
        BackwardConfig("reversible", options={"reversal_tol": 0})
    m = deqbench.models.create("fc_deq_tiny")
    with pytest.raises(ConfigError, match="'shine' needs the forward solver 'broyden', not"):
        configure(m, SolverConfig("anderson"), BackwardConfig("shine"))
    assert m.deq.backward_cfg.name == "ift"  # a refused configuration changes nothing
    configure(m, SolverConfig("broyden"), BackwardConfig("shine"))
    with pytest.raises(ConfigError, match="needs the forward solver 'broyden'"):
        configure(m, solver=SolverConfig("anderson"))  # the solver alone, against the mode
    with pytest.raises(ConfigError, match="needs the forward solver 'reversible'"):
        DEQLayer(m.deq.cell, backward=BackwardConfig("reversible"))


SUITE = """\
schema: 1
name: bw_modes
device: cpu
threads: 1
seeds: [0]
data: {name: digits, train_subset: 32, test_subset: 16}
defaults:
  model: {name: fc_deq_tiny, width: 8}
  solver: {name: broyden, max_iter: 30, tol: 1.0e-4}
  backward: {name: shine, refine_steps: 2}
  train: {epochs: 1, batch_size: 16}
analyses: [metrics]
output: results
"""


def test_suite_validation_names_the_forward_a_mode_needs_and_its_options(tmp_path):
    from conftest import write_suite

    ok = deqbench.load_suite(write_suite(tmp_path, SUITE))
    assert ok.cells[0].backward_config().options == {"refine_steps": 2}
    bad = write_suite(tmp_path, SUITE, name="bad.yaml", replace={"name: broyden": "name: anderson"})
    with pytest.raises(ConfigError) as ei:
        deqbench.load_suite(bad)
    msg = str(ei.value)
    assert ":10:" in msg and "backward mode 'shine' needs the forward solver 'broyden'" in msg
    typo = write_suite(tmp_path, SUITE, name="typo.yaml", replace={"refine_steps": "refine_stesp"})
    with pytest.raises(ConfigError, match="refine_stesp.*did you mean 'refine_steps'"):
        deqbench.load_suite(typo)
    unknown = write_suite(tmp_path, SUITE, name="u.yaml", replace={"name: shine,": "name: shien,"})
    with pytest.raises(ConfigError, match="unknown backward mode 'shien' \\(did you mean 'shine'"):
        deqbench.load_suite(unknown)


def test_a_suite_trains_with_each_new_mode(tmp_path):
    from conftest import write_suite

    text = SUITE.replace("analyses: [metrics]", "matrix:\n  case:\n"
                         "    - {id: shine}\n"
                         "    - {id: rev, solver: {name: reversible, max_iter: 21, tol: 1.0e-3},"
                         " backward: {name: reversible}}\n"
                         "analyses: [metrics]")  # fmt: skip
    summary = deqbench.run_suite(deqbench.load_suite(write_suite(tmp_path, text)), progress=False)
    assert summary.exit_code == 0, summary.failed
    df = deqbench.load_results(summary.run_dir)
    assert set(df["backward"]) == {"shine", "reversible"}
    acc = df[(df["metric"] == "accuracy") & (df["step"] == 1) & (df["variant"] == "test")]
    assert len(acc) == 2 and acc["value"].between(0, 1).all(), acc


# -- a third-party backward mode through the entry-point group ------------------------------------

PLUGIN = '''
"""A third-party backward mode: a damped Jacobian-free step."""
from deqbench.backward import BackwardMode


class DampedJFB(BackwardMode):
    name = "damped_jfb"

    def apply(self, layer, u, z0):
        z, _ = layer.solve(u, z0)
        z = z.detach()
        layer.last_backward_stats = None
        return 0.5 * z + 0.5 * layer.f(z, u)

    def label(self, cfg, forward=None):
        return "damped_jfb"
'''


@pytest.fixture
def backward_plugin(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    (site / "bwplug.py").write_text(textwrap.dedent(PLUGIN))
    info = site / "bwplug-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: bwplug\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[deqbench.backward]\ndamped_jfb = bwplug:DampedJFB\nift = bwplug:DampedJFB\n"
    )
    monkeypatch.delenv("DEQBENCH_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    for r in REGISTRIES.values():
        r.reset_plugins()
    yield site
    for r in REGISTRIES.values():
        r.reset_plugins()
    sys.modules.pop("bwplug", None)


PERF_SUITE = """\
schema: 1
name: bw_plugin
device: cpu
threads: 1
seeds: [0]
data: {name: digits, train_subset: 48, test_subset: 16}
defaults:
  model: {name: fc_deq_tiny, width: 8}
  init: {name: spectral, target: 0.5}
  solver: {name: anderson, max_iter: 40, tol: 1.0e-6}
  backward: {name: ift, solver: anderson, max_iter: 40, tol: 1.0e-6}
  train: {epochs: 0, batch_size: 16}
analyses:
  - backward: {modes: [{name: ift}, {name: jfb}, {name: damped_jfb}], repeats: 1, warmup: 0,
               memory_cpu: false, memory_series: [], at: [init], train_steps: 2,
               ref_tol: 1.0e-10}
output: results
"""


def test_a_plugin_mode_is_listed_checked_and_joins_the_comparison(backward_plugin, tmp_path):
    from conftest import write_suite
    from typer.testing import CliRunner

    from deqbench.cli import app

    with pytest.warns(UserWarning, match="bwplug 1.0 tries to register backward mode 'ift'"):
        assert "damped_jfb" in deqbench.backward.names()
    assert deqbench.backward.origin("damped_jfb") == "bwplug 1.0"
    assert deqbench.backward.origin("ift") == "built-in"  # no shadowing
    r = CliRunner().invoke(app, ["ls", "backward"])
    rows = [ln.split() for ln in r.output.splitlines()]
    assert ["backward", "damped_jfb", "bwplug", "1.0"] in rows
    assert ["backward", "shine", "built-in"] in rows
    check_backward("damped_jfb")  # the conformance kit a plugin runs in its own tests

    summary = deqbench.run_suite(
        deqbench.load_suite(write_suite(tmp_path, PERF_SUITE)), progress=False
    )
    assert summary.exit_code == 0, summary.failed
    df = deqbench.load_results(summary.run_dir)
    err = df[(df["metric"] == "grad_rel_error")].set_index("variant")["value"]
    assert set(err.index) == {"ift-tol=1e-06", "jfb", "damped_jfb"}
    assert err["ift-tol=1e-06"] < err["damped_jfb"] and math.isfinite(err["damped_jfb"])
    acc = df[df["metric"] == "test_accuracy"].set_index("variant")["value"]
    assert acc.between(0, 1).all() and "damped_jfb" in acc.index
    assert (summary.run_dir / "plots" / "backward_accuracy.png").exists()


# -- the analysis' new rows ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits():
    return load_data("digits", flatten=True, train_subset=48, test_subset=16)


def _by(rows, metric, variant):
    out = [r for r in rows if r.metric == metric and r.variant == variant]
    assert len(out) == 1, (metric, variant, out)
    return out[0]


def test_every_mode_side_by_side_rows(digits, tmp_path):
    torch.manual_seed(0)
    model = deqbench.models.create("fc_deq_tiny", in_shape=(64,), num_outputs=10, width=8)
    deqbench.inits.get("spectral")(model, seed=0, target=0.5)
    configure(model, SolverConfig("anderson", 100, 1e-6), BackwardConfig("ift", max_iter=100,
                                                                          tol=1e-6))  # fmt: skip
    cell = {"model": {"name": "fc_deq_tiny"}, "train": {"epochs": 0, "batch_size": 16, "lr": 1e-2}}
    ctx = CellContext(model, digits, torch.device("cpu"), torch.float32, 0, "c", cell, tmp_path)
    modes = [
        {"name": "ift"},
        {"name": "unrolled", "k": 10},
        {"name": "jfb"},
        {"name": "phantom", "k": 3, "tau": 0.5},
        {"name": "reversible", "forward": {"max_iter": 61, "beta": 0.5}},
        {"name": "shine"},
        {"name": "shine", "options": {"refine_steps": 20}},
    ]
    a = deqbench.analyses.get("backward")(
        {"modes": modes, "repeats": 1, "warmup": 0, "memory": False, "memory_series": [],
         "at": ["init"], "train_steps": 3, "ref_tol": 1e-11}
    )  # fmt: skip
    rows = list(a.before_training(ctx))
    v = ["ift-tol=1e-06", "unrolled-k=10", "jfb", "phantom-k=3-tau=0.5",
         "reversible-beta=0.5-fmax=61", "shine", "shine-refine=20"]  # fmt: skip
    err = {x: _by(rows, "grad_rel_error", x).value for x in v}
    print({k: f"{e:.2e}" for k, e in err.items()})
    assert all(_by(rows, "grad_rel_error", x).status == "ok" for x in v)
    assert err["ift-tol=1e-06"] < 1e-4 and err["shine-refine=20"] < 1e-4
    assert err["reversible-beta=0.5-fmax=61"] < 1e-4
    assert max(err["unrolled-k=10"], err["phantom-k=3-tau=0.5"], err["shine"]) < err["jfb"]
    # the memory split: unrolled saves its steps, IFT only z* and u; SHINE keeps its pairs
    mem = {x: {k: _by(rows, f"memory_{k}", x).value for k in ("unroll", "backward_state")}
           for x in v}  # fmt: skip
    assert mem["ift-tol=1e-06"]["unroll"] == 0 and mem["unrolled-k=10"]["unroll"] > 0
    assert mem["unrolled-k=10"]["backward_state"] == 0
    assert mem["shine"]["backward_state"] > mem["ift-tol=1e-06"]["backward_state"] > 0
    assert mem["jfb"]["unroll"] < mem["phantom-k=3-tau=0.5"]["unroll"]
    # the descent check: the exact gradient's step is the reference, JFB's still descends
    assert _by(rows, "descent_gain_ratio", "ift-tol=1e-06").value == pytest.approx(1, abs=1e-3)
    assert 0 < _by(rows, "descent_gain_ratio", "jfb").value
    # accuracy after the same optimiser steps; the modes' own diagnostics
    for x in v:
        assert 0 <= _by(rows, "test_accuracy", x).value <= 1
        assert math.isfinite(_by(rows, "train_loss", x).value)
    assert _by(rows, "fallback_fraction", "shine").value == 0.0
    assert _by(rows, "inverse_pairs", "shine").value > 0
    assert _by(rows, "reconstruction_error", "reversible-beta=0.5-fmax=61").value < 1e-3
    assert _by(rows, "backward_vjps", "shine").value == 1
    assert _by(rows, "backward_vjps", "shine-refine=20").value > 2
    # the model under analysis is unchanged
    assert model.deq.backward_cfg.name == "ift" and model.deq.solver_cfg.name == "anderson"


def test_a_mode_spec_is_checked_against_the_registry():
    from pydantic import ValidationError

    from deqbench.performance.backward import ModeSpec

    with pytest.raises(ValidationError, match="unknown backward mode 'shien'"):
        ModeSpec(name="shien")
    with pytest.raises(ValidationError, match="needs the forward solver 'broyden'"):
        ModeSpec(name="shine", forward={"name": "anderson"})
    with pytest.raises(ValidationError, match="refine_stesp"):
        ModeSpec(name="shine", options={"refine_stesp": 2})
    base_s, base_b = (
        SolverConfig("anderson", 30, 1e-5, options={"m": 3}),
        BackwardConfig("ift", solver="anderson", options={"m": 4}),
    )
    spec = ModeSpec(name="shine")
    assert spec.forward_config(base_s) == SolverConfig("broyden", 30, 1e-5)
    assert spec.backward_config(base_b).options == {}  # not the adjoint solver's options
    assert ModeSpec(name="jfb").forward_config(base_s) == base_s


def test_the_figure_draws_every_variant_sized_by_memory(tmp_path):
    import pandas as pd

    from deqbench.performance.plots import plot_accuracy_vs_time
    from deqbench.run import plots

    recs = []
    for cell in ("fc_deq_tiny", "conv_deq_tiny"):
        for i, (v, mem) in enumerate([("ift-tol=1e-06", 1.0), ("jfb", 0.5), ("shine", 2.0),
                                      ("unrolled-k=20", 8.0), ("damped_jfb", 0.5)]):  # fmt: skip
            for metric, value in (("grad_rel_error", 10.0 ** -(i + 1)),
                                  ("backward_ms_median", 1.0 + i), ("peak_memory", mem)):  # fmt: skip
                recs.append({"analysis": "backward", "cell_id": cell, "step": 0, "variant": v,
                             "metric": metric, "value": value, "status": "ok",
                             "note": "cuda_max_memory_allocated"})  # fmt: skip
    fig = plot_accuracy_vs_time(pd.DataFrame(recs))
    assert len(fig.axes) >= 2
    ax = fig.axes[0]
    gids = sorted(c.get_gid().split("|")[1] for c in ax.collections)
    assert gids == sorted(["ift-tol=1e-06", "jfb", "shine", "unrolled-k=20", "damped_jfb"])
    sizes = {c.get_gid().split("|")[1]: float(c.get_sizes()[0]) for c in ax.collections}
    assert sizes["unrolled-k=20"] > sizes["shine"] > sizes["ift-tol=1e-06"] > sizes["jfb"]
    texts = {t.get_text() for t in ax.texts}  # every marker labelled, with its memory
    assert {f"{v} ({m:.3g} MiB)" for v, m in [("jfb", 0.5), ("unrolled-k=20", 8.0)]} <= texts
    assert len(texts) == 5
    assert ax.get_yscale() == "log" and "backward time" in ax.get_xlabel()
    plots.save_figure(fig, tmp_path / "backward_accuracy.png")
