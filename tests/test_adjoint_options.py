"""benchmarks/adjoint_options.py: its float64 reference and exact-at-an-iterate gradients are
right (finite differences through a tightly solved forward, a dense adjoint solve), and its rows
tell an accurate backward from an approximate one (no timing asserted)."""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _module():
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("adjoint_options", BENCH / "adjoint_options.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _fixed_point64(module, x, z0, tol=1e-14, max_iter=20000):
    """z* = f(z*, x) by plain iteration in float64 (independent of deqbench's solvers)."""
    z = z0
    for _ in range(max_iter):
        zn = module(z, x)
        if float((zn - z).norm()) <= tol * float(zn.norm()):
            return zn
        z = zn
    raise AssertionError("plain iteration did not converge")


def _loss64(module, cell, R):
    with torch.no_grad():
        z = _fixed_point64(module, cell.x.double(), cell.z0.double())
        return float((R.double() * z).sum())


def _params64(cell, names, prefix="deq.cell."):
    mod = copy.deepcopy(cell.module).double()
    own = dict(mod.named_parameters())
    return mod, [own[n.removeprefix(prefix)] for n in names]


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_reference_matches_finite_differences_of_a_tight_forward_on_a_tiny_fc_cell():
    ao = _module()
    cell = ao.cellmod.fc_cell(4, 2, 2, seed=3)
    model, _ = ao.cell_model(cell, 100)
    R = ao.loss_direction(cell)
    g_ref, info = ao.reference(model, cell, R, adjoint="anderson")  # iterative, not dense
    assert info["converged"] and info["adjoint_method"] == "anderson"
    mod, params = _params64(cell, g_ref.names)
    h, fd = 1e-6, []
    for p in params:
        flat = p.data.view(-1)
        for i in range(flat.numel()):
            old = float(flat[i])
            flat[i] = old + h
            up = _loss64(mod, cell, R)
            flat[i] = old - h
            down = _loss64(mod, cell, R)
            flat[i] = old
            fd.append((up - down) / (2 * h))
    fd_vec = torch.tensor(fd, dtype=torch.float64)
    assert fd_vec.numel() == g_ref.vec.numel() == 4 * 4 + 4 * 2 + 4
    assert _rel(g_ref.vec, fd_vec) < 1e-6
    dense, dinfo = ao.reference(model, cell, R, adjoint="dense")
    assert dinfo["adjoint_method"] == "dense" and _rel(g_ref.vec, dense.vec) < 1e-10


def test_reference_and_exact_at_agree_with_directional_differences_on_a_tiny_conv_cell():
    ao = _module()
    cell = ao.cellmod.conv_cell(8, 8, 4, 2, seed=1)
    model, _ = ao.cell_model(cell, 100)
    R = ao.loss_direction(cell)
    g_ref, info = ao.reference(model, cell, R, adjoint="anderson")
    assert info["converged"]
    mod, params = _params64(cell, g_ref.names)
    gen = torch.Generator().manual_seed(0)
    h = 1e-6
    for _ in range(2):
        # each tensor's direction at its own scale (the conv weights are ~0.01, the norms' ~1):
        # the loss is curved like 1 / |W|^2 in the conv weights
        vs = [
            torch.randn(p.shape, generator=gen, dtype=torch.float64)
            * max(float(p.detach().abs().mean()), 0.1)
            for p in params
        ]
        with torch.no_grad():
            for p, v in zip(params, vs):
                p.add_(h * v)
            up = _loss64(mod, cell, R)
            for p, v in zip(params, vs):
                p.sub_(2 * h * v)
            down = _loss64(mod, cell, R)
            for p, v in zip(params, vs):
                p.add_(h * v)
        fd = (up - down) / (2 * h)
        exact = float(g_ref.vec @ torch.cat([v.reshape(-1) for v in vs]))
        assert abs(fd - exact) < 1e-6 * abs(exact)
    # the exact gradient at a given iterate, at the true fixed point, is the reference itself
    with torch.no_grad():
        x = cell.x.double()
        zs = _fixed_point64(mod, x, cell.z0.double())
    g_at, res = ao.exact_at(cell.module, cell.x, R, zs, g_ref.names)
    assert res < 1e-11 and _rel(g_at.vec, g_ref.vec) < 1e-9
    # ... and away from it (an iterate short of z*) it is another gradient
    with torch.no_grad():
        z3 = mod(mod(mod(cell.z0.double(), x), x), x)
    g3, _ = ao.exact_at(cell.module, cell.x, R, z3, g_ref.names)
    assert _rel(g3.vec, g_ref.vec) > 1e-4


def test_rows_tell_the_accurate_backward_from_the_approximate_one_on_a_tiny_fc_cell():
    ao = _module()
    args = argparse.Namespace(repeats=1, warmup=0, max_iter=100, quick=True)
    picked = [c for c in ao.choices(100) if c.key in ("unrolled30", "baseline", "jfb")]
    out = ao.run_cell(ao.cellmod.fc_cell(16, 8, 4), picked, args)
    assert out["reference"]["converged"]
    rows = {r["choice"]: r for r in out["rows"]}
    assert set(rows) == {"unrolled30", "baseline", "jfb"}
    base, jfb = rows["baseline"], rows["jfb"]
    assert rows["unrolled30"]["ratio_unrolled30"] == pytest.approx(1.0)
    assert base["backward_vjps"] == base["backward_nstep"] + 1 and jfb["backward_vjps"] == 1
    assert base["grad_rel_error"] < 1e-4 and not base["adjoint_missed_tol"]
    assert base["backward_own_error"] < 1e-5
    assert jfb["backward_own_error"] > 100 * base["backward_own_error"]
    assert jfb["grad_rel_error"] > 100 * base["grad_rel_error"]
    text = ao.table({"env": ao.environment(torch.device("cpu"), args), "cells": [out]})
    assert "| JFB (one VJP) |" in text and f"torch {torch.__version__}" in text


@pytest.mark.slow
def test_quick_cpu_run_writes_the_table_and_json(tmp_path, capsys):
    ao = _module()
    path = tmp_path / "ao.json"
    assert ao.main(["--device", "cpu", "--quick", "--choices", "baseline", "jfb",
                    "--json", str(path)]) == 0  # fmt: skip
    res = json.loads(path.read_text())
    assert [c["cell"] for c in res["cells"]] == ["conv", "fc"]
    for c in res["cells"]:
        assert c["reference"]["converged"]
        rows = {r["choice"]: r for r in c["rows"]}
        assert rows["baseline"]["backward_own_error"] < 1e-4
        assert rows["jfb"]["grad_rel_error"] > 10 * rows["baseline"]["grad_rel_error"]
    fc = {r["choice"]: r for r in res["cells"][1]["rows"]}
    assert fc["baseline"]["grad_rel_error"] < 1e-4
    out = capsys.readouterr().out
    assert out.count("| choice | step ms") == 2 and "torch " + torch.__version__ in out
