"""The Dask executor (``deqbench run --executor dask``): a local cluster gives the inline rows,
resumes, survives a worker that dies mid-cell, joins a scheduler given by address; the CLI's
errors. CPU and loopback (127.0.0.1) only.

Workers fork from a warm forkserver here (Dask's ``multiprocessing-method: forkserver``; torch
is imported once per test session instead of once per worker and restart); the default spawn
path runs in the ``slow`` subprocess test.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import uuid
from pathlib import Path

import pandas as pd
import pytest
from conftest import TINY_SUITE, write_suite
from typer.testing import CliRunner

from deqbench.cli import app
from deqbench.results import RUNNER, load_results

try:
    import distributed  # noqa: F401

    HAVE_DASK = True
except ImportError:  # pragma: no cover
    HAVE_DASK = False

needs_dask = pytest.mark.skipif(
    not HAVE_DASK, reason="dask[distributed] is not installed (pip install 'deqbench[dask]')"
)

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "suites" / "smoke.yaml"
HELPERS = Path(__file__).resolve().parent / "dask_helpers.py"
FLAGS = ["--no-plots", "--no-progress"]
KEYS = ["cell_id", "seed", "analysis", "variant", "metric", "step", "repeat"]


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def _run_dir(out: Path) -> Path:
    (d,) = [p for p in out.glob("*/*") if (p / "run.json").exists()]
    return d


def _key_rows(df: pd.DataFrame) -> pd.DataFrame:
    """Results without run id and timings (unit s), in a canonical order."""
    df = df.drop(columns=["run_id"]).copy()
    df.loc[df.unit == "s", "value"] = math.nan
    return df.sort_values(KEYS).reset_index(drop=True)


def _series(run_dir: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted((run_dir / "series").iterdir())}


@pytest.fixture(scope="module")
def fast_workers():
    """Local workers fork from a forkserver that imported torch and deqbench once."""
    if not HAVE_DASK:
        pytest.skip("dask[distributed] is not installed")
    import dask

    from deqbench.executors.dask import _warm_forkserver

    with dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"}):
        _warm_forkserver()
        yield


@pytest.fixture(scope="module")
def smoke_fc(tmp_path_factory) -> Path:
    """The smoke suite (its data, defaults, analyses, seeds) reduced to fc_deq_tiny x 3 solvers
    x 2 backward modes: 12 tasks of a fraction of a second each."""
    import yaml

    raw = yaml.safe_load(SMOKE.read_text())
    raw["defaults"]["model"] = {"name": "fc_deq_tiny"}
    raw["matrix"] = {
        "solver": ["fixed_point", "anderson", "broyden"],
        "backward": ["ift", "unrolled"],
    }
    raw["seeds"] = [0, 1]
    path = tmp_path_factory.mktemp("suite") / "smoke_fc.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def inline_smoke_fc(tmp_path_factory, smoke_fc) -> Path:
    out = tmp_path_factory.mktemp("inline")
    r = invoke("run", smoke_fc, *FLAGS, "--out", out)
    assert r.exit_code == 0, r.output
    return _run_dir(out)


# -- CLI errors (no cluster) ------------------------------------------------------------------


def test_missing_dask_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    p = write_suite(tmp_path)
    monkeypatch.setitem(sys.modules, "distributed", None)  # import distributed -> ImportError
    r = invoke("run", p, "--executor", "dask", "--no-progress")
    assert r.exit_code == 2
    assert "deqbench[dask]" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "results").exists()


def test_options_that_do_not_fit_exit_2(tmp_path):
    p = write_suite(tmp_path)
    r = invoke("run", p, "--scheduler", "tcp://127.0.0.1:1")
    assert r.exit_code == 2 and "--scheduler needs --executor dask" in r.output
    r = invoke("run", p, "--workers", "2")
    assert r.exit_code == 2 and "--workers needs --executor dask" in r.output
    r = invoke("run", p, "--executor", "ray")
    assert r.exit_code == 2 and "unknown executor" in r.output
    if HAVE_DASK:
        r = invoke("run", p, "--executor", "dask", "--workers", "2", "--scheduler", "tcp://x:1")
        assert r.exit_code == 2 and "drop --workers" in r.output
        r = invoke("run", p, "--executor", "dask", "--workers", "0")
        assert r.exit_code == 2 and "at least 1" in r.output
    assert not (tmp_path / "results").exists()


@needs_dask
def test_unreachable_scheduler_is_a_config_error():
    from deqbench.errors import ConfigError
    from deqbench.executors.dask import DaskExecutor

    with pytest.raises(ConfigError, match="cannot reach the Dask scheduler"):
        DaskExecutor(scheduler="tcp://127.0.0.1:9", connect_timeout=0.5).start()


@needs_dask
def test_gpu_layout_pins_one_worker_per_gpu(monkeypatch):
    import torch

    from deqbench.executors import dask as dx

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    specs, layout = dx.DaskExecutor().worker_specs("cuda", None)
    envs = [s["options"]["env"] for s in specs.values()]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "1"]
    assert [e[dx.PINNED_ENV] for e in envs] == ["0", "1"] and layout["gpus"] == ["0", "1"]
    assert all(s["options"]["nthreads"] == 1 for s in specs.values())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert dx.gpu_ids("cuda") == ["3", "5"] and dx.gpu_ids("cuda:1") == ["5"]
    specs, layout = dx.DaskExecutor(workers=3).worker_specs("cuda", 2)
    assert layout["gpus"] == ["3", "5", "3"] and layout["torch_threads"] == 2
    specs, layout = dx.DaskExecutor(workers=3).worker_specs("cpu", None)
    assert layout["gpus"] == [] and len(specs) == 3
    assert all("CUDA_VISIBLE_DEVICES" not in s["options"]["env"] for s in specs.values())
    # a pinned worker runs cuda:N on its own GPU; device auto is resolved on the worker
    seen = []
    monkeypatch.setattr(dx, "run_task", lambda t: seen.append(t.device))
    monkeypatch.setenv(dx.PINNED_ENV, "5")
    suite = type("S", (), {"device": "cuda:1", "threads": 1})()
    dx.run_cell(dx.Task(suite, None, 0, "cuda:1"))
    suite.device = "auto"
    dx.run_cell(dx.Task(suite, None, 0, "cuda"))
    assert seen == ["cuda", "cuda" if torch.cuda.is_available() else "cpu"]


# -- local cluster ----------------------------------------------------------------------------


@needs_dask
def test_local_workers_do_not_get_dask_malloc_trim_threshold(monkeypatch):
    """Dask's nanny exports MALLOC_TRIM_THRESHOLD_=65536 to spawned workers, which made PyTorch
    cells several times slower there; the local cluster unsets it (spawned, not forked workers)."""
    import os

    import dask

    from deqbench.executors.dask import DaskExecutor

    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    with dask.config.set({"distributed.worker.multiprocessing-method": "spawn"}):
        ex = DaskExecutor(workers=1).start("cpu", 1)
        try:
            env = ex.client.run(lambda: dict(os.environ))
        finally:
            ex.close()
    (worker_env,) = env.values()
    assert "MALLOC_TRIM_THRESHOLD_" not in worker_env
    assert worker_env["OMP_NUM_THREADS"] == "1"  # the worker specs' own variables still arrive


@needs_dask
def test_local_cluster_gives_inline_rows_and_resumes(
    tmp_path, fast_workers, smoke_fc, inline_smoke_fc
):
    r = invoke("run", smoke_fc, *FLAGS, "--out", tmp_path, "--executor", "dask", "--workers", "2")
    assert r.exit_code == 0, r.output
    d = _run_dir(tmp_path)
    inline = load_results(inline_smoke_fc)
    got = load_results(d)
    assert len(got[got.analysis == RUNNER]) == 12
    pd.testing.assert_frame_equal(_key_rows(got), _key_rows(inline))
    assert _series(d) == _series(inline_smoke_fc)
    meta = json.loads((d / "run.json").read_text())
    assert meta["status"] == "complete" and meta["executor"]["workers"] == 2
    assert meta["executor"]["kind"] == "dask" and meta["executor"]["threads_at_start"] == 2

    # crash: keep 5 finished tasks plus half of a sixth; --resume runs the other 7 on Dask
    df = got.sort_values(["cell_id", "seed"], kind="stable")
    tasks = list(dict.fromkeys(zip(df.cell_id, df.seed)))
    keep, partial = set(tasks[:5]), tasks[5]
    lines = (d / "results.csv").read_text().splitlines(keepends=True)
    kept = [lines[0]]
    for line, c, s, a in zip(lines[1:], got.cell_id, got.seed, got.analysis):
        if (c, s) in keep or ((c, s) == partial and a != RUNNER):
            kept.append(line)
    (d / "results.csv").write_text("".join(kept))
    r = invoke("run", smoke_fc, *FLAGS, "--resume", d, "--executor", "dask", "--workers", "2")
    assert r.exit_code == 0, r.output
    resumed = load_results(d)
    assert not resumed.duplicated(KEYS).any()
    pd.testing.assert_frame_equal(_key_rows(resumed), _key_rows(inline))
    meta = json.loads((d / "run.json").read_text())
    assert meta["resumed"][0]["skipped_tasks"] == 5 and meta["status"] == "complete"


@needs_dask
def test_worker_killed_mid_cell_is_retried_once_then_recorded(tmp_path, fast_workers):
    import dask_helpers  # noqa: F401  (registers test_die here too: the suite is checked here)

    from deqbench.executors.dask import DaskExecutor
    from deqbench.runner import run_suite
    from deqbench.suite import load_suite

    tag = uuid.uuid4().hex[:8]
    once, always = f"{tag}once", f"{tag}always"
    models = (
        f"[{{name: test_die, key: {once}}}, {{name: test_die, key: {always}, always: true}}, "
        "{name: fc_deq_tiny, width: 8}, {name: fc_deq_tiny, width: 6}]"
    )
    p = write_suite(
        tmp_path, replace={"matrix:\n  backward: [ift, unrolled]": f"matrix:\n  model: {models}"}
    )
    suite = load_suite(p)
    try:
        with DaskExecutor(workers=2, preload=[str(HELPERS)]) as ex:
            summary = run_suite(suite, executor=ex, progress=False, plots=False)
        runner = load_results(summary.run_dir).query("analysis == @RUNNER")
        assert len(runner) == 4 and not runner.duplicated(["cell_id", "seed"]).any()
        status = dict(zip(runner.cell_id, runner.status))
        notes = dict(zip(runner.cell_id, runner.note))
        (died,) = [c for c in status if f"key={always}" in c]
        assert status[died] == "error", notes[died]
        assert "worker died" in notes[died] and "KilledWorker" in notes[died]
        assert all(s == "ok" for c, s in status.items() if c != died), notes
        assert summary.exit_code == 1 and [f[0] for f in summary.failed] == [died]
        # `always`: the first attempt and one retry, both died; `once`: died, then ran
        assert len(dask_helpers.marker(always).read_text().splitlines()) == 2
        assert len(dask_helpers.marker(once).read_text().splitlines()) == 2
        log = (summary.run_dir / "log.txt").read_text()
        assert log.count("KilledWorker") == 1
    finally:
        for k in (once, always):
            dask_helpers.marker(k).unlink(missing_ok=True)


@needs_dask
def test_freed_worker_has_its_next_cell_before_a_result_is_handed_over(
    tmp_path, fast_workers, smoke_fc
):
    """One cell per worker in flight, but a worker never waits for the coordinator to write a
    result: when the first result is handed over, the next cell is already submitted."""
    from deqbench.executors.dask import DaskExecutor
    from deqbench.suite import load_suite
    from deqbench.task import Task

    suite = load_suite(smoke_fc, device="cpu")
    tasks = [Task(suite, c, 0, "cpu", "r", str(tmp_path)) for c in suite.cells[:3]]
    with DaskExecutor(workers=1) as ex:
        ex.start("cpu", suite.threads)
        results = ex.run(tasks)
        first = next(results)
        keys = [str(k) for k in ex.client.futures if str(k).startswith("deqbench_cell-")]
        assert any(k.endswith("-1-0") for k in keys), keys  # task 1, first attempt
        assert not any(k.endswith("-2-0") for k in keys), keys  # never two per worker
        rest = list(results)
    assert [r.cell_id for r in [first, *rest]] == [t.cell.id for t in tasks]
    assert all(r.status == "ok" for r in [first, *rest])


@needs_dask
def test_scheduler_address_joins_a_running_cluster(tmp_path, fast_workers):
    from distributed import LocalCluster

    p = write_suite(tmp_path, replace={"seeds: [0]": "seeds: [0, 1]"})
    r = invoke("run", p, "--no-plots", "--no-progress", "--out", tmp_path / "inline")
    assert r.exit_code == 0, r.output
    with LocalCluster(
        n_workers=2,
        threads_per_worker=1,
        processes=True,
        host="127.0.0.1",
        scheduler_port=0,
        dashboard_address="127.0.0.1:0",
    ) as cluster:
        address = cluster.scheduler_address
        r = invoke(
            "run", p, "--no-plots", "--no-progress", "--out", tmp_path / "dask",
            "--executor", "dask", "--scheduler", address,
        )  # fmt: skip
        assert r.exit_code == 0, r.output
        assert len(cluster.scheduler.workers) == 2  # the cluster is still up: not ours to close
    got = load_results(_run_dir(tmp_path / "dask"))
    want = load_results(_run_dir(tmp_path / "inline"))
    assert len(got[got.analysis == RUNNER]) == 4
    pd.testing.assert_frame_equal(_key_rows(got), _key_rows(want))
    meta = json.loads((_run_dir(tmp_path / "dask") / "run.json").read_text())
    assert meta["executor"]["scheduler"] == address


@needs_dask
@pytest.mark.slow
def test_cli_subprocess_with_spawned_workers(tmp_path):
    """The default worker start (spawn: each worker imports torch) through the console entry
    point, as a user runs it, with one worker (about 15-30 s on 2 cores)."""
    p = write_suite(tmp_path, TINY_SUITE, replace={"seeds: [0]": "seeds: [0, 1]"})
    cmd = [sys.executable, "-m", "deqbench", "run", str(p), "--no-plots", "--no-progress"]
    res = subprocess.run(
        [*cmd, "--out", str(tmp_path / "dask"), "--executor", "dask", "--workers", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    r = invoke("run", p, "--no-plots", "--no-progress", "--out", tmp_path / "inline")
    assert r.exit_code == 0, r.output
    got = load_results(_run_dir(tmp_path / "dask"))
    want = load_results(_run_dir(tmp_path / "inline"))
    pd.testing.assert_frame_equal(_key_rows(got), _key_rows(want))
