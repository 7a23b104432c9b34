"""examples/deqbench-ownloop: a third-party implicit conv network (conv layers,
GroupNorm in the map, BatchNorm around it, its own damped Picard loop and its own Jacobian-free
backward) written with no deqbench import and not edited since (its files' hashes are pinned),
adapted in <= 30 lines with deqbench.adapters. Through the adapter deqbench measures the
network's own loop (f-evaluations, residual traces, converged as judged by deqbench), and the
same map runs under deqbench's solvers and backward modes."""

from __future__ import annotations

import ast
import hashlib
from pathlib import Path

import pytest
import torch
from conftest import install_example, write_suite
from typer.testing import CliRunner

import deqbench
from deqbench.cli import app

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "deqbench-ownloop"
SRC = EXAMPLE / "src"
#: the network as first committed (2af8a36): the adapter may not edit it
PINNED = {
    "__init__.py": "70232cc33e2d94cd64744a9f89740b40bf18cf36ceb8045b2ece5e8d3bb1ea51",
    "net.py": "fdd83ee8e7a90b2f87b733e94334842d66a77ea106e105dbfcdcc6bb5066b7f6",
}


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """'Install' the example: its sources and a dist-info from its pyproject.toml."""
    yield from install_example(EXAMPLE, tmp_path / "site", monkeypatch)


def test_network_is_unedited_imports_no_deqbench_and_the_adapter_is_short():
    for name, sha in PINNED.items():
        path = SRC / "ownloop_net" / name
        assert hashlib.sha256(path.read_bytes()).hexdigest() == sha, f"{path} was edited"
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.split(".")[0] == "deqbench" for n in names), path
    lines = (SRC / "deqbench_ownloop" / "__init__.py").read_text().splitlines()
    code = [ln for ln in lines if ln.strip() and not ln.strip().startswith("#")]
    assert len(code) <= 30, len(code)


def test_own_loop_is_measured_as_the_network_ran_it(plugin):
    torch.manual_seed(0)
    m = deqbench.models.create("ownloop_conv", in_shape=(1, 8, 8), num_outputs=10)
    x = torch.rand(4, 1, 8, 8)
    m.train()
    m(x).square().sum().backward()
    st, info = m.last_solve_stats(), m.net.info
    # every evaluation of the map inside the network's loop is one f-evaluation; the JFB step
    # after it is not an iteration
    assert st.nstep == info["steps"] == st.rel_trace.shape[0]
    torch.testing.assert_close(st.rel_trace, info["residuals"], rtol=1e-4, atol=1e-6)
    # converged is deqbench's judgement of the returned iterate against the network's tol
    assert st.tol == m.net.tol and st.converged == bool(st.rel_residual.max() < st.tol)
    # the same in evaluation (the whole forward under no_grad)
    m.eval()
    with torch.no_grad():
        m(x)
    assert m.last_solve_stats().nstep == m.net.info["steps"]


def test_native_model_holds_the_networks_map(plugin):
    torch.manual_seed(0)
    m = deqbench.models.create("ownloop_conv_native", in_shape=(1, 8, 8), num_outputs=10)
    cell_params = {id(p) for p in m.deq.cell.parameters()}
    assert cell_params == {id(p) for p in m.net.block.parameters()}
    z = torch.rand(2, 16, 8, 8)
    u = m.inject(torch.rand(2, 1, 8, 8))
    torch.testing.assert_close(m.deq.cell(z, u), m.net.block(z, u))


SUITE = """\
schema: 1
name: ownloop
device: cpu
threads: 1
seeds: [0]
data: {name: digits, train_subset: 64, test_subset: 32}
defaults:
  model: {name: ownloop_conv}
  train: {epochs: 1, batch_size: 32, lr: 2.0e-3}
matrix:
  case:
    - {model: {name: ownloop_conv}}
    - {model: {name: ownloop_conv_native}}
    - {model: {name: ownloop_conv_native}, solver: {name: broyden, max_iter: 40, tol: 1.0e-3}, backward: jfb}
analyses: [metrics, solver_stats]
output: results
"""


def test_validate_and_run(plugin, tmp_path):
    p = write_suite(tmp_path, SUITE)
    r = CliRunner().invoke(app, ["validate", str(p)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["run", str(p), "--no-progress", "--no-plots"])
    assert r.exit_code in (0, 1), r.output
    (run_dir,) = (tmp_path / "results" / "ownloop").iterdir()
    df = deqbench.load_results(run_dir)
    runner = df[df.analysis == "runner"]
    # every cell trains; a cell whose solves miss tolerance is flagged (deqbench judges the
    # network's own loop like its own solvers), never an error
    assert set(runner.status) <= {"ok", "flagged"}, runner[["cell_id", "status", "note"]]
    own = df[df.model == "ownloop_conv"]
    assert set(own.solver) == {"own:picard"} and set(own.backward) == {"own:jfb"}
    nstep = own[own.metric == "forward_nstep"]
    assert len(nstep) and (nstep.value >= 1).all() and (nstep.value <= 40).all()
