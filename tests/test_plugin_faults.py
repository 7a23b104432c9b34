"""Plugin code that exits, interrupts or raises: every exit code tells the truth.

A dataset loader, a model factory, a model's forward and an analysis of an installed plugin call
``sys.exit(0)``, ``sys.exit(3)``, raise ``KeyboardInterrupt`` or ``GeneratorExit``. Each is that
code's failure: the cell's ``error`` (training failed) or the analysis's failed row (the cell
``flagged``), with a note naming the exception and the plugin; the other cells run, ``run.json``
ends ``complete`` and the command exits 1. ``validate`` (and ``run``'s up-front checks) give
exit 2 and one line. Only a signal to deqbench's own process interrupts (exit 130).
"""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest
from conftest import write_suite
from typer.testing import CliRunner

from deqbench.cli import app
from deqbench.run.results import RUNNER, load_results
from tests.plugin_helpers import installed_plugin

#: fault kind -> (what the plugin does, a substring of the note)
FAULTS = {
    "exit0": ("sys.exit(0)", "SystemExit: 0 (plugin code called sys.exit(0))"),
    "exit3": ("sys.exit(3)", "SystemExit: 3 (plugin code called sys.exit(3))"),
    "kbint": ("raise KeyboardInterrupt", "KeyboardInterrupt (raised by plugin code"),
    "genexit": ("raise GeneratorExit", "GeneratorExit (raised by plugin code)"),
}

PLUGIN = '''
import os
import signal
import sys
import time

from torch import nn

from deqbench.analyses.base import Analysis, Row


def fault(kind):
    if kind == "exit0":
        sys.exit(0)
    if kind == "exit3":
        sys.exit(3)
    if kind == "kbint":
        raise KeyboardInterrupt
    if kind == "genexit":
        raise GeneratorExit
    if kind == "error":
        raise RuntimeError("the analysis broke")
    if kind == "sigint":  # a real Ctrl-C: a signal to this process
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)


class Faulty(nn.Module):
    """A linear model whose training forward (batches over 2) faults."""

    def __init__(self, in_shape, num_outputs, kind):
        super().__init__()
        self.lin = nn.Linear(int(__import__("math").prod(in_shape)), num_outputs)
        self.kind = kind

    def forward(self, x):
        if self.training and x.shape[0] > 2:
            fault(self.kind)
        return self.lin(x.flatten(1))


class Unpicklable(nn.Module):
    """A model holding a lambda (as real libraries' models do): torch.save cannot pickle it."""

    def __init__(self, in_shape, num_outputs):
        super().__init__()
        self.lin = nn.Linear(int(__import__("math").prod(in_shape)), num_outputs)
        self.act = lambda t: t

    def forward(self, x):
        return self.act(self.lin(x.flatten(1)))


def unpicklable(in_shape, num_outputs):
    return Unpicklable(in_shape, num_outputs)


def _make(kind):
    def forward_model(in_shape, num_outputs):
        return Faulty(in_shape, num_outputs, kind)

    def factory(in_shape, num_outputs):
        fault(kind)

    def data(**params):
        fault(kind)

    class Bad(Analysis):
        name = "bad_" + kind
        needs_training = False

        def on_epoch(self, ctx, info):
            yield Row("epoch_seen", float(info.epoch), step=info.epoch)

        def after_training(self, ctx):
            yield Row("before_fault", 1.0)
            fault(kind)
            yield Row("after_fault", 1.0)

    return forward_model, factory, data, Bad


for _k in ("exit0", "exit3", "kbint", "genexit", "error", "sigint"):
    (
        globals()["fwd_" + _k],
        globals()["factory_" + _k],
        globals()["data_" + _k],
        globals()["bad_" + _k],
    ) = _make(_k)
'''

KINDS = [*FAULTS, "error", "sigint"]

SUITE = """\
schema: 1
name: faults
device: cpu
threads: 1
seeds: [0]
data: {name: digits, train_subset: 64, test_subset: 32}
defaults:
  model: {name: fc_deq_tiny, width: 8}
  solver: {name: fixed_point, max_iter: 15, tol: 1.0e-3}
  train: {epochs: 1, batch_size: 32}
analyses: [metrics]
output: results
"""


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """The plugin distribution ``faultplug 1.0`` installed (entry points of every kind)."""
    groups: dict[str, dict[str, str]] = {
        "deqbench.models": {"unpicklable": "faultplug:unpicklable"},
        "deqbench.datasets": {},
        "deqbench.analyses": {},
    }
    for k in KINDS:
        groups["deqbench.models"][f"fwd_{k}"] = f"faultplug:fwd_{k}"
        groups["deqbench.models"][f"factory_{k}"] = f"faultplug:factory_{k}"
        groups["deqbench.datasets"][f"data_{k}"] = f"faultplug:data_{k}"
        groups["deqbench.analyses"][f"bad_{k}"] = f"faultplug:bad_{k}"
    groups["deqbench.models"]["kbimport"] = "faultplug_kbimport:model"
    modules = {"faultplug": PLUGIN, "faultplug_kbimport": "raise KeyboardInterrupt\n"}
    monkeypatch.chdir(tmp_path)
    with installed_plugin(tmp_path / "site", monkeypatch, "faultplug", modules, groups):
        yield tmp_path


def invoke(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args])


def suite_file(where: Path, name: str, replace: dict[str, str]) -> Path:
    return write_suite(where, SUITE, name=name, replace=replace)


def the_run(where: Path) -> Path:
    (run,) = (where / "results" / "faults").iterdir()
    return run


def no_exception(result) -> None:
    """The command ended through its exit code, not an exception of plugin code."""
    exc = result.exception
    assert exc is None or (isinstance(exc, SystemExit) and exc.code == result.exit_code), (
        repr(exc),
        result.output,
    )


@pytest.mark.parametrize("kind", list(FAULTS))
def test_a_faulting_loader_factory_or_forward_is_the_cells_error(plugin, kind):
    """Training fails in three cells (dataset loader, model factory, training forward); the
    fourth, a built-in model on built-in data, runs: exit 1, each failure an ``error`` row whose
    note names the exception and the plugin, run.json complete."""
    path = suite_file(
        plugin,
        f"{kind}.yaml",
        {
            "analyses: [metrics]": textwrap.dedent(f"""\
                analyses: [metrics]
                matrix:
                  case:
                    - {{id: ok}}
                    - {{model: fwd_{kind}}}
                    - {{model: factory_{kind}}}
                    - {{data: data_{kind}, model: fwd_{kind}, id: data}}
                """)
        },
    )
    r = invoke("run", path, "--no-check", "--no-plots")
    no_exception(r)
    assert r.exit_code == 1, r.output
    run = the_run(plugin)
    meta = json.loads((run / "run.json").read_text())
    assert meta["status"] == "complete" and meta["exit_code"] == 1, meta
    df = load_results(run)
    status = df[df.analysis == RUNNER].set_index("cell_id")
    assert len(status) == 4, status
    ok = [c for c in status.index if c == "ok"]  # the case id names the cell
    assert [status.status[c] for c in ok] == ["ok"]  # the other cell ran
    metrics = df[(df.cell_id == ok[0]) & (df.analysis == "metrics")]
    assert len(metrics) > 0
    failed = status[status.status != "ok"]
    assert set(failed.status) == {"error"} and len(failed) == 3, failed
    want = FAULTS[kind][1]
    for cell, note in failed.note.items():
        assert want in note and "(plugin faultplug 1.0)" in note, (cell, note)
    notes = " | ".join(failed.note)
    assert f"loading dataset 'data_{kind}'" in notes
    assert f"building model 'factory_{kind}'" in notes
    assert f"training model 'fwd_{kind}'" in notes


@pytest.mark.parametrize("kind", [*FAULTS, "error"])
def test_an_analysis_that_raises_gives_its_failed_row_and_flags_the_cell(plugin, kind):
    """The analysis's rows before the fault and its failed row; training's rows and the other
    analyses stand; the cell is flagged naming the analysis; exit 1."""
    path = suite_file(plugin, f"a_{kind}.yaml", {"[metrics]": f"[metrics, bad_{kind}]"})
    r = invoke("run", path, "--no-plots")
    no_exception(r)
    assert r.exit_code == 1, r.output
    run = the_run(plugin)
    assert json.loads((run / "run.json").read_text())["status"] == "complete"
    df = load_results(run)
    (runner,) = df[df.analysis == RUNNER].itertuples()
    assert runner.status == "flagged" and f"bad_{kind}:" in runner.note, runner
    metrics = df[df.analysis == "metrics"]
    assert set(metrics.status) == {"ok"} and {0, 1} <= set(metrics.step), metrics
    bad = df[df.analysis == f"bad_{kind}"]
    assert list(bad.metric) == ["epoch_seen", "epoch_seen", "before_fault", f"bad_{kind}"]
    failed = bad.iloc[-1]
    assert failed.status == "error" and math.isnan(failed.value)
    want = FAULTS[kind][1] if kind in FAULTS else "RuntimeError: the analysis broke"
    assert want in failed.note and "after_training" in failed.note, failed.note
    assert want in runner.note


def test_a_model_that_cannot_be_pickled_keeps_its_throughput_rows(plugin):
    """throughput's CPU memory probe pickles the step for a fresh process; a model holding a
    lambda cannot be pickled: the memory rows say so, the timings stand, the cell is not an
    error."""
    path = suite_file(
        plugin,
        "lambda.yaml",
        {
            "{name: fc_deq_tiny, width: 8}": "{name: unpicklable}",
            "[metrics]": "[metrics, {throughput: {repeats: 1, warmup: 0, batch_size: 8}}]",
        },
    )
    r = invoke("run", path, "--no-plots")
    no_exception(r)
    df = load_results(the_run(plugin))
    (runner,) = df[df.analysis == RUNNER].itertuples()
    assert runner.status in ("ok", "flagged"), runner
    tp = df[df.analysis == "throughput"]
    assert set(tp[tp.metric.isin(["eval_ms", "train_ms"])].status) == {"ok"}, tp
    mem = tp[tp.metric.isin(["eval_peak_memory", "train_peak_memory"])]
    assert len(mem) == 2 and "error" not in set(mem.status), mem
    assert all("cannot be pickled" in n for n in mem.note), mem.note


@pytest.mark.parametrize("kind", list(FAULTS))
def test_validate_with_a_faulting_factory_is_exit_2_and_one_line(plugin, kind):
    path = suite_file(plugin, f"v_{kind}.yaml", {"fc_deq_tiny, width: 8": f"factory_{kind}"})
    for command in ("validate", "run"):
        r = invoke(command, path)
        no_exception(r)
        assert r.exit_code == 2, (command, r.output)
        errors = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1, r.output
        assert f"model 'factory_{kind}'" in errors[0] and "[model.factory]" in errors[0]
        assert FAULTS[kind][1].partition(" (")[0] in errors[0], errors[0]
        assert not (plugin / "results").exists()  # nothing written


@pytest.mark.parametrize("kind", list(FAULTS))
def test_validate_with_a_faulting_loader_is_exit_2_and_one_line(plugin, kind):
    path = suite_file(plugin, f"d_{kind}.yaml", {"name: digits, ": f"name: data_{kind}, "})
    r = invoke("validate", path)
    no_exception(r)
    assert r.exit_code == 2, r.output
    errors = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and f"dataset 'data_{kind}'" in errors[0], r.output


def test_only_a_signal_to_deqbench_interrupts(plugin):
    """A KeyboardInterrupt that a plugin's import raises is its failure (exit 2, one line, not
    "interrupted"); a SIGINT sent to this process from inside plugin code is Ctrl-C: exit 130,
    the run ``interrupted``."""
    path = suite_file(plugin, "kbimport.yaml", {"fc_deq_tiny, width: 8": "kbimport"})
    for command in ("validate", "run"):
        r = invoke(command, path)
        no_exception(r)
        assert r.exit_code == 2 and "interrupted" not in r.output, (command, r.output)
        errors = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1 and "KeyboardInterrupt" in errors[0], r.output
    assert not (plugin / "results").exists()
    path = suite_file(plugin, "sigint.yaml", {"[metrics]": "[metrics, bad_sigint]"})
    r = invoke("run", path, "--no-plots")
    assert r.exit_code == 130 and "interrupted" in r.output, r.output
    assert json.loads((the_run(plugin) / "run.json").read_text())["status"] == "interrupted"
