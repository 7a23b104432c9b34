"""The suites' ``runtime`` section: schema (defaults, matrix, case, ``--set``), errors,
cell ids, bf16 autocast in training and in the throughput analysis, torch.compile backends that
need no C++ compiler, and the flag of a bf16 cell whose solves cannot meet its tolerance. CPU."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import TINY_SUITE, write_suite
from typer.testing import CliRunner

import deqbench
from deqbench.cli import app
from deqbench.deq import Runtime, configure, set_runtime
from deqbench.errors import ConfigError
from deqbench.run.runner import run_suite
from deqbench.run.suite import one_cell_suite

ROOT = Path(__file__).resolve().parents[1]

#: TINY_SUITE's ids (the unrolled cell named by its K; before:
#: fc_deq_tiny-fixed_point-unrolled) and its hash as computed before the runtime section existed
#: (commit bd7afd7)
TINY_IDS = ["fc_deq_tiny-fixed_point-ift", "fc_deq_tiny-unrolled5"]
TINY_HASH = "3bbbd0a936ef52e0"  # 885c3f23cec79efe with the unrolled cell's old id

#: one tiny cell that trains in well under a second (forward and adjoint at bf16's tolerance)
BF16_SUITE = TINY_SUITE.replace(
    "matrix:\n  backward: [ift, unrolled]\n",
    "matrix:\n  runtime.amp: [none, bf16]\n",
).replace("tol: 1.0e-3}", "tol: 1.0e-2}")


def _load(tmp_path: Path, text: str = TINY_SUITE, **kw):
    return deqbench.load_suite(write_suite(tmp_path, text), **kw)


def test_default_runtime_keeps_ids_and_hash(tmp_path):
    s = _load(tmp_path)
    assert [c.id for c in s.cells] == TINY_IDS
    assert s.hash == TINY_HASH  # --resume of runs made before the runtime section
    assert all(c.runtime_config() == Runtime() and not c.runtime_changes() for c in s.cells)
    assert "runtime" not in s.resolved["defaults"]
    # the default runtime spelled out changes nothing either
    s2 = _load(tmp_path, TINY_SUITE.replace("  train:", "  runtime: {amp: none}\n  train:"))
    assert [c.id for c in s2.cells] == TINY_IDS and s2.hash == TINY_HASH


def test_runtime_in_defaults_matrix_and_case(tmp_path):
    text = TINY_SUITE.replace(
        "  train:", "  runtime: {cuda_graph: off}\n  train:"
    ).replace(  # YAML 1.1 reads off as false
        "matrix:\n  backward: [ift, unrolled]\n",
        "matrix:\n  runtime.amp: [none, bf16]\n  case:\n    - {backward: ift}\n"
        "    - {backward: ift, runtime: {compile: eager}}\n",
    )
    s = _load(tmp_path, text)
    assert [c.id for c in s.cells] == [
        "fc_deq_tiny-fixed_point-ift-cuda_graph=off",
        "fc_deq_tiny-fixed_point-ift-cuda_graph=off-compile=eager",
        "fc_deq_tiny-fixed_point-ift-cuda_graph=off-amp=bf16",
        "fc_deq_tiny-fixed_point-ift-cuda_graph=off-amp=bf16-compile=eager",
    ]
    rts = [c.runtime_config() for c in s.cells]
    assert [r.amp for r in rts] == ["none", "none", "bf16", "bf16"]
    assert [r.compile for r in rts] == [False, "eager", False, "eager"]
    assert {r.cuda_graph for r in rts} == {"off"}
    # the resolved suite round-trips to the same cells and hash (--resume)
    again = tmp_path / "again"
    again.mkdir()
    (again / "suite.yaml").write_text(s.to_yaml())
    s2 = deqbench.load_suite(again / "suite.yaml")
    assert [c.id for c in s2.cells] == [c.id for c in s.cells] and s2.hash == s.hash


def test_set_runtime_on_run_validate_and_one_cell_commands(tmp_path):
    s = _load(tmp_path, overrides=["runtime.amp=bf16"])
    assert [c.id for c in s.cells] == [i + "-amp=bf16" for i in TINY_IDS]
    assert s.resolved["defaults"]["runtime"] == {"amp": "bf16"}
    s = _load(tmp_path, overrides=["defaults.runtime.compile=aot_eager"])
    assert {c.runtime["compile"] for c in s.cells} == {"aot_eager"}
    s = _load(tmp_path, overrides=["matrix.runtime.amp=[none, bf16]"])
    assert [c.id for c in s.cells] == [TINY_IDS[0], TINY_IDS[0] + "-amp=bf16",
                                       TINY_IDS[1], TINY_IDS[1] + "-amp=bf16"]  # fmt: skip
    # landscape / hessian / ntk build a one-cell suite with their --set overrides
    one = one_cell_suite("landscape", model="fc_deq_tiny", analyses=["metrics"], device="cpu",
                         overrides=["runtime.amp=bf16"])  # fmt: skip
    assert one.cells[0].id == "fc_deq_tiny-broyden-ift-amp=bf16"
    r = CliRunner().invoke(
        app, ["validate", str(tmp_path / "suite.yaml"), "--set", "runtime.amp=bf16"]
    )
    assert r.exit_code == 0 and "fc_deq_tiny-fixed_point-ift-amp=bf16" in r.output, r.output


@pytest.mark.parametrize(
    ("change", "overrides", "where", "message"),
    [
        ({"runtime": "{amp: fp16}"}, [], ":11:",
         "defaults.runtime.amp: Input should be 'none' or 'bf16' (got 'fp16')"),
        ({"runtime": "{amps: bf16}"}, [], ":11:",
         "defaults.runtime.amps: unknown key (did you mean 'amp'?)"),
        ({"runtime": "{cuda_graph: always}"}, [], ":11:",
         "defaults.runtime.cuda_graph: Input should be 'auto' or 'off'"),
        ({"runtime": "{compile: aot_eagr}"}, [], ":11:",
         "defaults.runtime.compile: unknown torch.compile backend 'aot_eagr' "
         "(did you mean 'aot_eager'?)"),
        ({"runtime": "{compile: 1}"}, [], ":11:",
         "defaults.runtime.compile: expected true, false or a torch.compile backend name (got 1)"),
        ({"runtime": "{compile_mode: max-autotune}"}, [], ":11:",
         "defaults.runtime.compile_mode: is a torch.compile mode: set runtime.compile too"),
        ({"runtime": "{compile: true, compile_mode: fast}"}, [], ":11:",
         "defaults.runtime.compile_mode: Input should be 'default'"),
        ({"runtime": "bf16"}, [], ":11:", "defaults.runtime: expected a mapping"),
        ({}, ["runtime.amp=fp16"], "--set runtime.amp=fp16: ",
         "defaults.runtime.amp: Input should be 'none' or 'bf16'"),
        ({}, ["runtime.foo=1"], "--set runtime.foo=1: ", "defaults.runtime.foo: unknown key"),
        ({}, ["matrix.runtime.amp=[none, bf61]"], "--set matrix.runtime.amp=[none, bf61]: ",
         "matrix.runtime.amp[1]: Input should be 'none' or 'bf16'"),
        ({"dtype": "float64"}, ["runtime.amp=bf16"], "--set runtime.amp=bf16: ",
         "defaults.runtime.amp: bf16 autocast needs dtype float32"),
        ({"top": "runtime: {amp: bf16}"}, [], ":16:1: ",
         "runtime: is a cell section: put it under defaults"),
    ],
)  # fmt: skip
def test_bad_runtime_names_the_key(tmp_path, change, overrides, where, message):
    text = TINY_SUITE
    if "runtime" in change:
        text = text.replace("  train:", f"  runtime: {change['runtime']}\n  train:")
    if "dtype" in change:
        text = text.replace("threads: 1", "threads: 1\ndtype: float64")
    if "top" in change:
        text = text + change["top"] + "\n"
    with pytest.raises(ConfigError) as exc:
        _load(tmp_path, text, overrides=overrides)
    line = str(exc.value)
    assert len(line.splitlines()) == 1, line
    assert where in line and message in line, line


def _tiny(seed: int = 0):
    from deqbench.data.base import load_data

    data = load_data("digits", train_subset=64, test_subset=32)
    torch.manual_seed(seed)
    model = deqbench.models.create("fc_deq_tiny", in_shape=data.in_shape, num_outputs=10, width=8)
    configure(
        model,
        deqbench.deq.SolverConfig("anderson", 30, 1e-2),
        deqbench.deq.BackwardConfig("ift", solver="anderson", max_iter=30, tol=1e-2),
    )
    return model, data


def test_bf16_training_autocasts_the_forward_and_keeps_float32_state():
    from deqbench.run.train import TrainConfig, train

    model, data = _tiny()
    set_runtime(model, Runtime(amp="bf16"))
    seen: set[torch.dtype] = set()
    model.head.register_forward_hook(lambda m, i, o: seen.add(o.dtype))
    res = train(model, data, TrainConfig(epochs=1, batch_size=32))
    assert res.status == "ok" and seen == {torch.bfloat16}
    assert all(math.isfinite(h["train_loss"]) for h in res.history)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not res.forward.flagged and not res.adjoint.flagged


def test_bf16_cells_run_and_their_rows_say_so(tmp_path):
    suite = deqbench.load_suite(
        write_suite(tmp_path, BF16_SUITE),
        overrides=["analyses=[metrics, solver_stats, "
                   "{throughput: {repeats: 2, warmup: 0, memory: false}}]"],
    )  # fmt: skip
    summary = run_suite(suite, progress=False, plots=False)
    df = deqbench.load_results(summary.run_dir)
    runner = df[df.analysis == "runner"].set_index("cell_id")
    f32, bf16 = TINY_IDS[0], TINY_IDS[0] + "-amp=bf16"
    assert list(runner.index) == [f32, bf16]
    assert set(runner.status) == {"ok"}, runner.note.tolist()
    loss = df[(df.analysis == "metrics") & (df.metric == "loss")]
    assert loss.value.map(math.isfinite).all()
    nstep = df[df.metric.isin(["forward_nstep", "eval_forward_nstep", "train_forward_nstep"])]
    for cell, amp in ((f32, "amp=none"), (bf16, "amp=bf16")):
        notes = set(nstep[nstep.cell_id == cell].note)
        assert notes == {f"path=eager, {amp}"}, notes
    # the timings stand beside the solves' counts and final residuals, bf16 as float32
    tp = df[(df.analysis == "throughput") & (df.cell_id == bf16)].set_index("metric")
    for m in ("eval_ms_median", "eval_forward_nstep", "eval_forward_rel_residual",
              "eval_forward_converged", "train_ms_median", "train_forward_rel_residual",
              "train_backward_rel_residual", "train_backward_converged"):  # fmt: skip
        assert m in tp.index, m
    assert 0 < float(tp.loc["eval_forward_rel_residual", "value"]) < 1e-2


def test_throughput_runs_under_the_cells_autocast():
    from deqbench.performance.throughput import measure_throughput

    model, data = _tiny()
    x, y = data.train[0][:16], data.train[1][:16]
    seen: set[torch.dtype] = set()
    model.head.register_forward_hook(lambda m, i, o: seen.add(o.dtype))
    res = measure_throughput(model, x, y, repeats=1, warmup=0, memory=False)
    assert seen == {torch.float32} and res["runtime"] == Runtime()
    seen.clear()
    set_runtime(model, Runtime(amp="bf16"))  # as the runner does; the analysis passes it too
    res = measure_throughput(model, x, y, repeats=1, warmup=0, memory=False)
    assert seen == {torch.bfloat16} and res["runtime"].amp == "bf16"
    assert res["eval_stats"]["forward_converged"] == 1.0
    assert "backward_rel_residual" in res["train_stats"]


def test_bf16_cell_that_cannot_meet_its_tolerance_is_flagged(tmp_path):
    text = BF16_SUITE.replace("runtime.amp: [none, bf16]", "runtime.amp: [bf16]").replace(
        "solver: {name: fixed_point, max_iter: 15, tol: 1.0e-2}",
        "solver: {name: anderson, max_iter: 15, tol: 1.0e-7}",
    )
    summary = run_suite(deqbench.load_suite(write_suite(tmp_path, text)), progress=False,
                        plots=False)  # fmt: skip
    df = deqbench.load_results(summary.run_dir)
    runner = df[df.analysis == "runner"].iloc[0]
    assert runner.cell_id.endswith("-amp=bf16") and runner.status == "flagged"
    assert "forward solve missed rel tol 1e-07" in runner.note
    assert "bf16's relative residual floor" in runner.note  # the fix is a looser tolerance
    conv = df[(df.analysis == "convergence") & (df.metric == "forward_unconverged_batches")
              & (df.variant == "train")]  # fmt: skip
    assert conv.status.tolist() == ["flagged"] and conv.value.tolist() == [1.0]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_backends_train_to_the_same_losses(backend):
    from deqbench.run.train import TrainConfig, train

    cfg = TrainConfig(epochs=1, batch_size=32)
    histories = []
    paths = []
    for rt in (Runtime(), Runtime(compile=backend)):
        model, data = _tiny()
        set_runtime(model, rt)
        histories.append(train(model, data, cfg).history)
        paths.append(model.deq.last_forward_stats.path)
    assert paths == ["eager", "compiled"]
    a, b = ([h[k] for h in hist for k in sorted(h) if "loss" in k] for hist in histories)
    if backend == "eager":
        assert a == b
    else:
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6)


def test_bf16_suite_loads_on_cpu():
    s = deqbench.load_suite(ROOT / "suites" / "bf16.yaml", device="cpu")
    assert [c.id for c in s.cells] == [
        "conv_deq-float32",
        "conv_deq-bf16-tol=0.01",
        "fc_deq-float32",
        "fc_deq-bf16-tol=0.01",
    ]
    for c in s.cells:
        bf16 = c.runtime["amp"] == "bf16"
        assert (c.solver["tol"] == 1e-2) == bf16 and (c.backward["tol"] == 1e-2) == bf16
    assert "throughput" in dict(s.analyses)


def test_git_info_names_the_commit_a_copied_tree_came_from(monkeypatch):
    """A tree copied to a GPU host without its git history: DEQBENCH_SOURCE_COMMIT names the
    commit it was copied from; git's own (stale) answer is kept beside it."""
    from deqbench.run.env import SOURCE_COMMIT_ENV, git_info

    monkeypatch.delenv(SOURCE_COMMIT_ENV, raising=False)
    plain = git_info()
    assert "source" not in plain
    monkeypatch.setenv(SOURCE_COMMIT_ENV, "0123456789abcdef")
    g = git_info()
    assert g["commit"] == "0123456789abcdef" and g["dirty"] is False
    assert g["source"] == SOURCE_COMMIT_ENV
    if plain["commit"] is not None:
        assert g["git_reported"].startswith(plain["commit"])
