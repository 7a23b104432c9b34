"""examples/deqbench-deepinv: DeepInverse's deep equilibrium PnP-PGD (deepinv 0.5.0, a small
DnCNN prior with random weights) through deqbench's documented plugin route. Its own loop (a
dict iterate, a ``(dict, metrics)`` return value, two map calls after the loop) and its own
implicit backward are measured as they are, by an adapter of <= 60 lines with no workaround,
and the same map runs under deqbench's solvers. Skipped where deepinv is not installed (CI
installs it, see noxfile.py)."""

from __future__ import annotations

import re
import subprocess
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
from conftest import install_example, write_suite
from typer.testing import CliRunner

pytest.importorskip("deepinv")

import deqbench  # noqa: E402
from deqbench.cli import app  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "deqbench-deepinv"
ADAPTER = EXAMPLE / "src" / "deqbench_deepinv" / "__init__.py"


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    yield from install_example(EXAMPLE, tmp_path / "site", monkeypatch)


def test_the_pinned_version_a_short_adapter_and_no_special_case_in_deqbench():
    pinned = (EXAMPLE / "pyproject.toml").read_text()
    assert '"deepinv==0.5.0"' in pinned and version("deepinv") == "0.5.0"
    code = [ln for ln in ADAPTER.read_text().splitlines()
            if ln.strip() and not ln.strip().startswith("#")]  # fmt: skip
    assert len(code) <= 60, len(code)
    text = "\n".join(code)
    for workaround in ("__reduce__", "register_hook", "autograd", "del_buffer", "_buffers"):
        assert workaround not in text, workaround
    hits = subprocess.run(["grep", "-ril", "deepinv", str(ROOT / "deqbench")],
                          capture_output=True, text=True).stdout  # fmt: skip
    assert hits == "", hits


def _batch(n=4, size=8):
    from deqbench_deepinv.data import noisy_mnist5k

    b = noisy_mnist5k(size=size, train_subset=20, test_subset=10)
    return b.train[0][:n], b.train[1][:n]


def test_the_own_loop_and_backward_are_measured_as_deepinv_ran_them(plugin):
    torch.manual_seed(0)
    m = deqbench.models.create("deepinv_pgd", in_shape=(1, 8, 8), num_outputs=64)
    x, y = _batch()
    out = m(x)
    torch.nn.functional.mse_loss(out, y).backward()
    st, bst = m.last_solve_stats(), m.last_backward_solve_stats()
    # deepinv's own record of the same loop: the per-sample residual of each iteration
    with torch.no_grad():
        _, metrics = m.net.pgd.fixed_point(x, m.net.physics, compute_metrics=True)
    theirs = torch.tensor(metrics["residual"]).T  # (iterations, samples)
    assert theirs.shape == st.rel_trace.shape
    torch.testing.assert_close(st.rel_trace, theirs.to(st.rel_trace.dtype), rtol=1e-4, atol=1e-6)
    # the loop's iterations and the two calls after it (the step with gradient, and the one at
    # a detached copy the implicit backward differentiates) are told apart by the adapter
    assert st.extra["calls_after_loop"] == 2 and st.extra["map_calls"] == st.nstep + 2
    assert 1 <= st.nstep <= 60 and st.extra["returned"] == "input of the call after the loop"
    # deepinv stops on the batch mean of its residual: deqbench keeps that verdict beside its own
    assert st.extra["own_rule"] == "batch_mean"
    assert st.extra["own_converged"] == bool(st.rel_residual.mean() < st.tol)
    # the own adjoint solve: its VJPs counted, the residual of w = J^T w + g recomputed
    assert bst is not None and bst.nstep == bst.extra["vjps"] >= 1
    assert bst.rel_trace.shape == (bst.nstep, 4)
    # a Jacobian-free deepinv DEQ has no adjoint solve
    jfb = deqbench.models.create("deepinv_pgd", in_shape=(1, 8, 8), num_outputs=64, backward="jfb")
    jfb(x).sum().backward()
    assert jfb.last_backward_solve_stats() is None


def test_the_map_under_deqbenchs_solver_holds_the_prior(plugin):
    m = deqbench.models.create("deepinv_pgd_map", in_shape=(1, 8, 8), num_outputs=64)
    held = {id(p) for p in m.deq.cell.parameters()}
    assert {id(p) for p in m.net.pgd.prior.parameters()} <= held
    x, _ = _batch()
    torch.testing.assert_close(m.deq.cell(x, x), m.net.step(x, x))


SUITE = """\
schema: 1
name: deepinv_tiny
device: cpu
threads: 1
seeds: [0]
data: {name: noisy_mnist5k, size: 8, train_subset: 20, test_subset: 10}
defaults:
  model: {name: deepinv_pgd, max_iter: 20}
  train: {epochs: 1, batch_size: 10, lr: 1.0e-3}
matrix:
  case:
    - {model: {name: deepinv_pgd, max_iter: 20}}
    - {model: {name: deepinv_pgd_map}, solver: {name: anderson, max_iter: 20, tol: 1.0e-4}, backward: jfb}
analyses: [metrics, solver_stats]
output: results
"""


def test_validate_and_run_a_tiny_suite(plugin, tmp_path):
    p = write_suite(tmp_path, SUITE)
    r = CliRunner().invoke(app, ["validate", str(p)])
    assert r.exit_code == 0, r.output
    assert re.search(r"deepinv_pgd-own_plain-own_ift\s", r.output), r.output
    r = CliRunner().invoke(app, ["run", str(p), "--no-progress", "--no-plots"])
    assert r.exit_code in (0, 1), r.output
    (run_dir,) = (tmp_path / "results" / "deepinv_tiny").iterdir()
    df = deqbench.load_results(run_dir)
    runner = df[df.analysis == "runner"]
    assert set(runner.status) <= {"ok", "flagged"}, runner[["cell_id", "status", "note"]]
    own = df[(df.model == "deepinv_pgd") & (df.analysis == "solver_stats")]
    assert set(own.solver) == {"own:plain"} and set(own.backward) == {"own:ift"}
    # solver_stats has adjoint rows for the model's own backward
    assert (own.metric == "backward_nstep").any() and (own.metric == "forward_nstep").any()
