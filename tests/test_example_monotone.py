"""examples/deqbench-monotone: a standalone monotone DEQ written the way third-party code is
(imports only torch, injection inside the layer module, forward(x, *z), its own solver and
backward) and an adapter of <= 80 lines using the documented hooks only. Through the adapter
every solver and backward mode applies, deqbench's Peaceman-Rachford matches the built-in
mondeq_fc_tiny exactly, and the upstream network runs as a wrapped model."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from conftest import install_example, write_suite
from typer.testing import CliRunner

import deqbench
from deqbench.cli import app
from deqbench.deq import BackwardConfig, SolverConfig, configure

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "deqbench-monotone"
SRC = EXAMPLE / "src"


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """'Install' the example: its sources and a dist-info from its pyproject.toml."""
    yield from install_example(EXAMPLE, tmp_path / "site", monkeypatch)


def test_standalone_module_imports_nothing_from_deqbench_and_adapter_is_short():
    for path in (SRC / "monotone_net").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.split(".")[0] == "deqbench" for n in names), path
    lines = (SRC / "deqbench_monotone" / "adapter.py").read_text().splitlines()
    code = [ln for ln in lines if ln.strip() and not ln.strip().startswith("#")]
    assert len(code) <= 80, len(code)


def _same_weights(adapted, builtin):
    lin = adapted.net.linear
    cell = builtin.deq.cell
    with torch.no_grad():
        lin.A.weight.copy_(cell.A)
        lin.B.weight.copy_(cell.B)
        lin.U.load_state_dict(builtin.U.state_dict())
        adapted.net.head.load_state_dict(builtin.head.state_dict())


def test_matches_builtin_mondeq_and_upstream(plugin):
    torch.manual_seed(0)
    builtin = deqbench.models.create("mondeq_fc_tiny", in_shape=(64,), num_outputs=10).double()
    adapted = deqbench.models.create("monotone_fc", in_shape=(64,), num_outputs=10, width=16)
    adapted = adapted.double()
    _same_weights(adapted, builtin)
    x = torch.rand(6, 64, dtype=torch.float64)
    # deqbench's Peaceman-Rachford on the adapted cell = on the built-in cell, bit for bit
    pr = SolverConfig("peaceman_rachford", max_iter=300, tol=1e-4, options={"alpha": 1.0})
    configure(builtin, pr)
    configure(adapted, pr)
    assert torch.equal(adapted(x), builtin(x))
    assert adapted.deq.last_forward_stats.nstep == builtin.deq.last_forward_stats.nstep
    sq_a, sq_b = adapted.spectral_quantities(), builtin.spectral_quantities()
    for k in sq_a:
        assert sq_a[k] == pytest.approx(sq_b[k], rel=1e-9)
    # upstream's own forward and backward (its solver, its gradient hook) = deqbench's IFT
    tight = SolverConfig("peaceman_rachford", max_iter=500, tol=1e-11, options={"alpha": 1.0})
    configure(adapted, tight, BackwardConfig("ift", solver="anderson", max_iter=200, tol=1e-11))
    adapted.net.solver.tol = 1e-11
    adapted.net.solver.max_iter = 500
    y_dq = adapted(x)
    (g_dq,) = torch.autograd.grad(y_dq.square().sum(), [adapted.net.linear.A.weight])
    y_up = adapted.net(x)
    (g_up,) = torch.autograd.grad(y_up.square().sum(), [adapted.net.linear.A.weight])
    torch.testing.assert_close(y_dq, y_up, rtol=1e-8, atol=1e-9)
    torch.testing.assert_close(g_dq, g_up, rtol=1e-6, atol=1e-8)


def test_injection_parameters_are_not_cell_weights(plugin):
    """The upstream injection U sits in the cell module; the cell declares it, so inits,
    spectral layers, landscape norms and cell_parameters leave it out."""
    import math

    from deqbench import spectral as sp
    from deqbench.inits.basic import cell_weights
    from deqbench.landscape import _spec_weights

    m = deqbench.models.create("monotone_fc", in_shape=(64,), num_outputs=10, width=8)
    lin = m.net.linear
    own = {id(lin.A.weight), id(lin.B.weight)}
    assert {id(p) for p in cell_weights(m)} == own
    assert {id(p) for p in m.cell_parameters()} == own
    assert [n for n, _ in sp.layers(m.deq.cell)] == ["linear.A", "linear.B"]
    assert _spec_weights(m) == ["net.linear.A.weight", "net.linear.B.weight"]
    before = lin.U.weight.detach().clone()
    deqbench.inits.get("normal")(m, seed=0, std=0.5)
    assert torch.equal(lin.U.weight, before)
    bound, note = sp.lipschitz_upper_bound(m.deq.cell)
    assert note == "cell.lipschitz_bound()" and math.isfinite(bound)
    # a cell without layers or its own bound: "not available", not an empty product of 1.0
    bound, note = sp.lipschitz_upper_bound(deqbench.models.create("mondeq_fc_tiny").deq.cell)
    assert math.isnan(bound) and note.startswith("not available")


SUITE = """\
schema: 1
name: monotone
device: cpu
threads: 1
seeds: [0]
data: {name: digits, flatten: true, train_subset: 64, test_subset: 32}
defaults:
  model: {name: monotone_fc, width: 16}
  train: {epochs: 1, batch_size: 32}
matrix:
  case:
    - {model: {name: monotone_fc, width: 16}}
    - {model: {name: monotone_fc, width: 16}, solver: {name: anderson, max_iter: 60}, backward: {name: unrolled, k: 5}}
    - {model: {name: monotone_fc, width: 16}, solver: {name: forward_backward, alpha: auto}, backward: jfb}
    - {model: {name: monotone_fc_native, width: 16}}
analyses: [metrics, family_stats]
output: results
"""


def test_validate_and_run_every_solver_and_the_wrapped_model(plugin, tmp_path):
    p = write_suite(tmp_path, SUITE)
    r = CliRunner().invoke(app, ["validate", str(p)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["run", str(p), "--no-progress", "--no-plots"])
    assert r.exit_code == 0, r.output
    (run_dir,) = (tmp_path / "results" / "monotone").iterdir()
    df = deqbench.load_results(run_dir)
    assert set(df[df.analysis == "runner"].status) == {"ok"}
    # the native model computes its own equilibrium and reports it (last_solve_stats): the
    # columns say what solved it, and its own iterations are measured
    native = df[df.model == "monotone_fc_native"]
    assert len(set(native.cell_id)) == 1
    assert set(native.solver) == {"own:peaceman_rachford"} and set(native.backward) == {"own:ift"}
    assert not set(df[df.model == "monotone_fc"].solver) & {"n/a", "not measured"}
    conv = native[native.metric == "test_forward_converged"]
    assert len(conv) and (conv.value == 1).all()
    fam = df[(df.analysis == "family_stats") & (df.metric == "lambda_max_sym_W")]
    assert (fam.value <= 1e-6).all()  # m = 1: lambda_max((W + W^T) / 2) <= 0
