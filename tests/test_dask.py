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
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pandas as pd
import pytest
from conftest import TINY_SUITE, write_suite
from typer.testing import CliRunner

from deqbench.cli import app
from deqbench.run.results import RUNNER, load_results
from deqbench.run.task import PROCESS

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
    """Results without run id, timings (unit s) and the per-process start-up rows (one set per
    worker process), in a canonical order."""
    df = df[df.analysis != PROCESS].drop(columns=["run_id"]).copy()
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

    from deqbench.run.executors._forkserver import use_method

    with dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"}):
        use_method("forkserver")
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
    from deqbench.run.executors.dask import DaskExecutor

    with pytest.raises(ConfigError, match="cannot reach the Dask scheduler"):
        DaskExecutor(scheduler="tcp://127.0.0.1:9", connect_timeout=0.5).start()


@needs_dask
def test_gpu_layout_pins_one_worker_per_gpu(monkeypatch):
    import torch

    from deqbench.run import env
    from deqbench.run.executors import dask as dx
    from deqbench.run.executors import dask_cell

    monkeypatch.setattr(env, "_nvml_device_count", lambda: None)  # torch's count, patched
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
    monkeypatch.setattr(dask_cell, "run_task", lambda t: seen.append(t.device))  # its home
    monkeypatch.setenv(dx.PINNED_ENV, "5")
    suite = type("S", (), {"device": "cuda:1", "threads": 1})()
    dx.run_cell(dx.Task(suite, None, 0, "cuda:1"))
    suite.device = "auto"
    dx.run_cell(dx.Task(suite, None, 0, "cuda"))
    assert seen == ["cuda", "cuda" if torch.cuda.is_available() else "cpu"]


# -- local cluster ----------------------------------------------------------------------------


@needs_dask
@pytest.mark.slow  # several seconds on 2 cores: out of the fast lane
def test_local_workers_do_not_get_dask_malloc_trim_threshold(monkeypatch):
    """Dask's nanny exports MALLOC_TRIM_THRESHOLD_=65536 to spawned workers, which made PyTorch
    cells several times slower there; the local cluster unsets it (spawned, not forked workers)."""
    import os

    import dask

    from deqbench.run.executors.dask import DaskExecutor

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
@pytest.mark.slow
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
    assert meta["executor"]["kind"] == "dask" and meta["executor"]["threads_joined"] == 2
    # deqbench run closes its cluster in the background from the last result on, so the
    # closing overlaps the plots and checks instead of following them
    tl = meta["timelines"][-1]
    assert tl["phases"]["tasks_end"] <= tl["cluster"]["released"] <= tl["phases"]["plots_start"]
    # every worker warmed up at start: one warmup_time row per worker process, on its first cell
    warm = got[(got.analysis == PROCESS) & (got.metric == "warmup_time")]
    assert len(warm) == 2 and (warm.value > 0).all(), warm

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
@pytest.mark.slow  # 7-15 s on a shared 2-core machine
def test_worker_killed_mid_cell_is_retried_once_then_recorded(tmp_path, fast_workers):
    import dask_helpers  # noqa: F401  (registers test_die here too: the suite is checked here)

    from deqbench.run.executors.dask import DaskExecutor
    from deqbench.run.runner import run_suite
    from deqbench.run.suite import load_suite

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
        assert all(s in ("ok", "flagged") for c, s in status.items() if c != died), notes
        assert summary.exit_code == 1
        assert [f[0] for f in summary.failed if f[2] == "error"] == [died]
        # `always`: the first attempt and one retry, both died; `once`: died, then ran
        assert len(dask_helpers.marker(always).read_text().splitlines()) == 2
        assert len(dask_helpers.marker(once).read_text().splitlines()) == 2
        log = (summary.run_dir / "log.txt").read_text()
        # one line per resubmission (cell, seed, worker, cause), then the `error` record
        resubmitted = [ln for ln in log.splitlines() if "submitted again" in ln]
        assert len(resubmitted) == 2, log
        for key in (once, always):
            (line,) = [ln for ln in resubmitted if f"key={key}" in ln]
            assert "seed=0: worker tcp://127.0.0.1:" in line and "died" in line, line
            assert "(KilledWorker); submitted again (attempt 2 of 2)" in line, line
        assert log.count("KilledWorker") == 3
    finally:
        for k in (once, always):
            dask_helpers.marker(k).unlink(missing_ok=True)


@needs_dask
@pytest.mark.slow  # several seconds on 2 cores: out of the fast lane
def test_freed_worker_has_its_next_cell_before_a_result_is_handed_over(
    tmp_path, fast_workers, smoke_fc
):
    """One cell per worker in flight, but a worker never waits for the coordinator to write a
    result: when the first result is handed over, the next cell is already submitted."""
    from deqbench.run.executors.dask import DaskExecutor
    from deqbench.run.suite import load_suite
    from deqbench.run.task import Task

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


@needs_dask
def test_short_cells_add_a_worker_on_gpus_with_room(monkeypatch):
    """Grouping: first cells (one per worker) shorter than short_task add a worker on every GPU
    whose free memory holds one more; long cells, little remaining work or --workers add none."""
    import torch

    from deqbench.run import env
    from deqbench.run.executors import dask as dx

    monkeypatch.setattr(env, "_nvml_device_count", lambda: None)  # torch's count, patched
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    gib = 1 << 30
    mem = {"a": {"peak": gib, "free": 60 * gib, "total": 80 * gib},
           "b": {"peak": gib, "free": 3 * gib, "total": 80 * gib}}  # fmt: skip
    pinned = {"a": "0", "b": "1"}

    class Client:
        def run(self, fn):
            return mem if fn is dx.gpu_memory else pinned

    class Loop:
        calls: list = []

        def add_callback(self, fn):
            self.calls.append(fn)

    def executor(**kw):
        ex = dx.DaskExecutor(**kw)
        specs, ex.layout = ex.worker_specs("cuda", None)
        ex.cluster = type("C", (), {"worker_spec": dict(specs), "loop": Loop()})()
        ex.cluster._correct_state = lambda: None
        ex.client = Client()
        return ex

    ex = executor()
    assert ex.layout["torch_threads"] == max(1, (__import__("os").cpu_count() or 1) // 4)
    assert ex.add_gpu_workers([2.0, 2.5], remaining=100) == ["0"]  # GPU 1 has no room
    (new,) = set(ex.cluster.worker_spec) - {"deqbench-0", "deqbench-1"}
    env = ex.cluster.worker_spec[new]["options"]["env"]
    assert env["CUDA_VISIBLE_DEVICES"] == env[dx.PINNED_ENV] == "0"
    assert ex.layout["workers"] == 3 and ex.layout["grouping"]["added"] == ["0"]
    assert len(Loop.calls) == 1
    assert executor().add_gpu_workers([30.0, 31.0], remaining=100) == []  # long cells
    assert executor().add_gpu_workers([2.0, 2.0], remaining=10) == []  # nearly done
    # the 4x H100 Dask case per worker: a short median but a flagged cell among the first
    # (1.9 s median, 8 s tail): the mean, not the median, estimates the remaining work
    assert executor().add_gpu_workers([1.9, 1.9, 8.0], remaining=20) == ["0"]
    assert executor().add_gpu_workers([1.9, 1.9], remaining=20) == []  # 19 s per worker
    assert executor(max_per_gpu=1).add_gpu_workers([2.0, 2.0], remaining=100) == []
    # GPUs kept busy by one worker each: a second process would only take turns with it
    ex = executor()
    assert ex.add_gpu_workers([2.0, 2.0], remaining=100, busy=[0.95, 0.7]) == []
    assert ex.layout["grouping"] == {"median_first_cell_s": 2.0, "gpu_busy": 0.825, "added": []}
    ex = executor()
    assert ex.add_gpu_workers([2.0, 2.0], remaining=100, busy=[0.3, 0.4]) == ["0"]
    assert ex.layout["grouping"]["gpu_busy"] == 0.35
    ex = executor(workers=2)  # a layout the user chose stays
    assert ex.add_gpu_workers([2.0, 2.0], remaining=100) == []
    ex.cluster = ex.client = None  # nothing to close


@pytest.mark.parametrize(
    "visible, want",
    [(None, 4), ("2,0", 2), ("1,7,0", 1), ("0,0", 0), ("1,2,1", 0), ("-1", 0), ("", 0),
     ("3,x,1", 1), ("1gpu2,2", 2), (" 2 , 3", 2), ("GPU-8f2c,1", None), ("MIG-1", None)],
)  # fmt: skip
def test_visible_gpu_count_without_torch_follows_cuda_visible_devices(monkeypatch, visible, want):
    """The driver's count narrowed by CUDA_VISIBLE_DEVICES as torch's parser reads it (strtoul
    entries, a repeated ordinal empties the set, up to the first ordinal the driver lacks);
    UUIDs are CUDA's to map (None without the torch fallback)."""
    from deqbench.run import env

    monkeypatch.setattr(env, "_nvml_device_count", lambda: 4)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert env.visible_gpu_count(torch_fallback=False) == want
    quick = env.resolve_device("auto", quick=True)
    if want is not None:
        assert quick == ("cuda" if want else "cpu")
    monkeypatch.setattr(env, "_nvml_device_count", lambda: None)  # no driver library
    assert env.visible_gpu_count(torch_fallback=False) is None


def test_prestart_only_for_a_local_dask_cluster(tmp_path):
    from deqbench.run.executors import prestart

    p = write_suite(tmp_path)
    assert prestart("inline", path=p) is None
    assert prestart("dask", scheduler="tcp://127.0.0.1:1", path=p) is None
    coll = tmp_path / "coll.yaml"
    coll.write_text(f"suites: [{p.name}]\n")
    assert prestart("dask", path=coll) is None
    assert prestart("dask", path=tmp_path / "missing.yaml") is None


@needs_dask
def test_open_executor_uses_a_prestarted_cluster_only_when_it_fits(tmp_path, monkeypatch):
    from deqbench.run.executors import dask as dx
    from deqbench.run.executors import open_executor
    from deqbench.run.suite import load_suite

    suite = load_suite(write_suite(tmp_path), device="cpu")
    started: list = []
    monkeypatch.setattr(dx.DaskExecutor, "start", lambda self, *a, **k: started.append(a))

    class Early:
        closed = 0

        def close(self):
            self.closed += 1

    fits = Early()
    fits.started_for = ("cpu", suite.threads)
    with open_executor("dask", suite=suite, started=fits) as ex:
        assert ex is fits and not started
    assert fits.closed == 1
    wrong = Early()
    wrong.started_for = ("cuda", suite.threads)
    with open_executor("dask", suite=suite, started=wrong) as ex:
        assert ex is not wrong and wrong.closed == 1 and started == [("cpu", suite.threads)]


def _stop(proc: subprocess.Popen) -> None:
    """Stop a process this test started in its own session (and its children: a nanny's
    worker) by its process group id."""
    import os
    import signal

    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)


@needs_dask
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_dask_cli_cluster_survives_a_worker_killed_mid_cell(tmp_path):
    """Beyond one host, through Dask's own command-line entry points: `dask scheduler` and two
    `dask worker` processes on 127.0.0.1 (with deqbench's worker preload), `deqbench run
    --scheduler`, one worker killed (SIGKILL) while it builds a cell: the scheduler retries the
    cell elsewhere and every row comes back exactly once (about 30-60 s on 2 cores)."""
    import os
    import signal
    import threading
    import time

    import dask_helpers

    from deqbench.run.task import PROCESS

    key = f"{uuid.uuid4().hex[:8]}kill"
    p = write_suite(
        tmp_path,
        replace={
            "matrix:\n  backward: [ift, unrolled]": "matrix:\n  model: "
            f"[{{name: test_slow, key: {key}}}, {{name: fc_deq_tiny, width: 6}}]",
            "seeds: [0]": "seeds: [0, 1]",
        },
    )
    sched_file = tmp_path / "scheduler.json"
    env = {**os.environ, "DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES": "1"}
    dask_cli = [sys.executable, "-m", "dask"]
    procs: list[subprocess.Popen] = []
    log = open(tmp_path / "cluster.log", "w")  # noqa: SIM115 - closed in finally
    try:
        procs.append(subprocess.Popen(
            [*dask_cli, "scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
             "--scheduler-file", str(sched_file)],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        ))  # fmt: skip
        for i in range(2):
            procs.append(subprocess.Popen(
                [*dask_cli, "worker", "--scheduler-file", str(sched_file), "--host", "127.0.0.1",
                 "--nworkers", "1", "--nthreads", "1", "--no-dashboard", "--name", f"w{i}",
                 "--preload", "deqbench.run.executors.worker", "--preload", str(HELPERS)],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            ))  # fmt: skip
        from distributed import Client

        deadline = time.monotonic() + 60
        while not sched_file.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        address = json.loads(sched_file.read_text())["address"]
        with Client(address, timeout=30, set_as_default=False) as c:
            c.wait_for_workers(2, timeout=90)

        result: dict = {}
        runner = threading.Thread(target=lambda: result.update(r=invoke(
            "run", p, *FLAGS, "--out", tmp_path / "dask", "--executor", "dask",
            "--scheduler", address,
        )))  # fmt: skip
        runner.start()
        marker = dask_helpers.marker(key)

        def in_workers() -> list[int]:
            lines = marker.read_text().splitlines() if marker.exists() else []
            return [int(x.split()[0]) for x in lines if x.endswith(" 1")]

        while not in_workers() and time.monotonic() < deadline + 60:
            time.sleep(0.1)
        time.sleep(0.5)  # inside the cell's 30 s build
        pid = in_workers()[0]
        assert pid not in (os.getpid(), *(q.pid for q in procs))  # a worker, not a nanny
        os.kill(pid, signal.SIGKILL)
        runner.join(timeout=120)
        assert not runner.is_alive()
        r = result["r"]
        assert r.exit_code in (0, 1), r.output  # 1: tiny cells flagged (adjoint tolerance)
        df = load_results(_run_dir(tmp_path / "dask"))
        runner_rows = df[df.analysis == RUNNER]
        assert len(runner_rows) == 4 and not runner_rows.duplicated(["cell_id", "seed"]).any()
        assert set(runner_rows.status) <= {"ok", "flagged"}, runner_rows.note.tolist()
        assert not df[df.analysis != PROCESS].duplicated(KEYS).any()
        pids = in_workers()
        assert pids[0] == pid and len(pids) == 3  # killed attempt, its retry, the other seed
        # the scheduler reran the cell by itself; its remove-worker event is one log line
        run_log = (_run_dir(tmp_path / "dask") / "log.txt").read_text()
        (line,) = [ln for ln in run_log.splitlines() if "remove-worker" in ln]
        assert f"key={key}" in line and "seed=" in line and "died running this cell" in line
    finally:
        for proc in reversed(procs):
            _stop(proc)
        log.close()
        dask_helpers.marker(key).unlink(missing_ok=True)


@needs_dask
def test_start_method_is_the_users_else_forkserver_on_gpus(monkeypatch):
    """Dask's multiprocessing-method where the user set it (config, environment, or
    dask.config.set to other than Dask's default), else forkserver on GPUs and spawn on CPU."""
    import dask

    from deqbench.run.executors import _forkserver as fs

    monkeypatch.delenv("DASK_DISTRIBUTED__WORKER__MULTIPROCESSING_METHOD", raising=False)
    started: list[int] = []
    monkeypatch.setattr(fs, "start_forkserver", lambda: started.append(1))
    with dask.config.set({fs.METHOD_KEY: "spawn"}):  # Dask's default
        assert (fs.start_method(gpu=True), fs.start_method(gpu=False)) == ("forkserver", "spawn")
        fs.use_method("forkserver")
        assert started == [1] and dask.config.get(fs.METHOD_KEY) == "forkserver"
    with dask.config.set({fs.METHOD_KEY: "forkserver"}):
        assert fs.start_method(gpu=False) == "forkserver"
    monkeypatch.setenv("DASK_DISTRIBUTED__WORKER__MULTIPROCESSING_METHOD", "spawn")
    assert fs.start_method(gpu=True) == "spawn"


@needs_dask
def test_prestart_on_a_gpu_starts_the_forkserver_before_distributed_and_torch():
    """`deqbench run --executor dask` on a GPU starts the forkserver before the coordinator
    imports distributed or torch (the server imports them for the workers meanwhile)."""
    code = (
        "import sys\n"
        "from deqbench.run import env\n"
        "from deqbench.run.executors import _forkserver as fs, prestart\n"
        "seen = []\n"
        "fs.start_forkserver = lambda: seen.append(('distributed' in sys.modules, "
        "'torch' in sys.modules))\n"
        "env.resolve_device = lambda *a, **k: 'cuda'\n"
        "prestart('dask', path=sys.argv[1])\n"
        "print(seen)\n"
    )
    env = {k: v for k, v in os.environ.items() if "MULTIPROCESSING_METHOD" not in k}
    out = subprocess.run(
        [sys.executable, "-c", code, str(SMOKE)], capture_output=True, text=True, env=env,
        timeout=300,
    )  # fmt: skip
    assert out.stdout.strip() == "[(False, False)]", out.stderr[-2000:]


def test_gpu_busy_is_not_measured_without_a_gpu():
    """The grouping's GPU busy fraction comes from NVML for the process's CUDA device; without
    one (CI) it is None, never a made-up number."""
    import torch

    from deqbench.run.env import GpuBusy

    if torch.cuda.is_available():
        pytest.skip("has a GPU: tests/test_gpu_dask.py measures it")
    assert GpuBusy().start().stop() is None
