"""``device: auto``: each cell placed on the GPU or on CPU cores by a measured rule
(:mod:`deqbench.run.placement`), the Dask executor's mixed pool, and the device each task ran on
in ``timeline.csv``. The CPU tests inject timings; the ``gpu`` tests run on CUDA."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from deqbench import load_results, load_suite, run_suite
from deqbench.run import placement
from deqbench.run.placement import Pool, choose, place_cells, signature
from tests.conftest import TINY_SUITE, write_suite

#: two cells that differ in what a step costs (width) and one that differs only in the LR
AUTO_SUITE = (
    TINY_SUITE.replace("name: tiny", "name: auto")
    .replace("device: cpu", "device: auto")
    .replace(
        "  backward: [ift, unrolled]\n",
        "  case:\n"
        "    - {id: narrow, model.width: 8}\n"
        "    - {id: narrow_lr, model.width: 8, train.lr: 1.0e-2}\n"
        "    - {id: wide, model.width: 16}\n",
    )
)

#: the measured H200 host of docs/benchmarks.md (training steps/s at batch 64)
PCDEQ_L = (243.0, 178.0)  # one GPU cell alone, one single-thread CPU process
PCDEQ_SC = (92.0, 0.8)


def _key_rows(df: pd.DataFrame) -> pd.DataFrame:
    """Results without run id, timings and per-process start-up rows, in a canonical order."""
    df = df[df.analysis != "process"].drop(columns=["run_id"]).copy()
    df.loc[df.unit == "s", "value"] = math.nan
    keys = ["cell_id", "seed", "analysis", "variant", "metric", "step", "repeat"]
    return df.sort_values(keys).reset_index(drop=True)


def _timeline_devices(run_dir: Path) -> dict[str, str]:
    with open(run_dir / "timeline.csv", newline="") as fh:
        return {r["cell_id"]: r["device"] for r in csv.DictReader(fh)}


# -- the decision, with injected timings -----------------------------------------------------


def test_choose_compares_when_the_runs_tasks_end_on_each_side():
    host = Pool(gpus=1, cpu_workers=15, cpu_threads=1)
    assert choose(*PCDEQ_L, host, tasks=15)[0] == "cpu"  # 178 in 1 round > 243 in 15
    assert choose(*PCDEQ_SC, host, tasks=15)[0] == "cuda"  # 0.8 in 1 round <= 92 in 15
    # a run of one task: the faster device, however many CPU workers stand idle
    dev, why = choose(*PCDEQ_L, host, tasks=1)
    assert dev == "cuda" and why == (
        "1 task(s): CPU 178 steps/s / 1 round(s) of 15 workers = 178 <= GPU 243 steps/s / 1 "
        "round(s) of 1 = 243"
    )
    # rounds on the GPUs: 3 tasks on 2 GPUs take two rounds (243 / 2 < 178), 2 tasks one
    two = Pool(gpus=2, cpu_workers=15)
    assert choose(*PCDEQ_L, two, tasks=3)[0] == "cpu"
    assert choose(*PCDEQ_L, two, tasks=2)[0] == "cuda"
    # rounds on the CPU workers: 15 tasks fill 15 of them once (90 > 100 / 2 on 8 GPUs), the
    # 16th makes a second round (90 / 2 <= 100 / 2)
    eight = Pool(gpus=8, cpu_workers=15)
    assert choose(100.0, 90.0, eight, tasks=15)[0] == "cpu"
    assert choose(100.0, 90.0, eight, tasks=16)[0] == "cuda"
    # many tasks: the pools' throughput (steps/s x workers)
    assert choose(*PCDEQ_L, Pool(gpus=1, cpu_workers=1), tasks=30)[0] == "cuda"  # 178 < 243
    assert choose(*PCDEQ_L, Pool(gpus=2, cpu_workers=2), tasks=30)[0] == "cuda"
    dev, why = choose(100.0, 50.0, Pool(gpus=1, cpu_workers=2), tasks=2)
    assert dev == "cuda" and why.endswith("= 50 <= GPU 100 steps/s / 2 round(s) of 1 = 50")
    assert choose(100.0, 50.1, Pool(gpus=1, cpu_workers=2), tasks=2)[0] == "cpu"
    assert choose(1.0, 1e6, Pool(gpus=1, cpu_workers=0), tasks=1) == (
        "cuda",
        "no CPU worker beside the GPU workers",
    )
    assert choose(1.0, 1e6, host, tasks=0) == ("cuda", "no training tasks")
    assert choose(None, 1e6, host, tasks=1) == ("cuda", "not calibrated")
    assert choose(10.0, None, host, tasks=1) == ("cuda", "not calibrated")


def _rates(width_rates: dict[int, tuple[float, float]], calls: list[tuple[str, str]]):
    def measure(cell, suite, device, threads):
        calls.append((cell.id, device))
        gpu, cpu = width_rates[cell.model["width"]]
        return gpu if device == "cuda" else cpu

    return measure


def test_place_cells_measures_each_signature_once_and_follows_the_rule(tmp_path):
    suite = load_suite(write_suite(tmp_path, AUTO_SUITE))
    cells = {c.id: c for c in suite.cells}
    assert signature(cells["narrow"], suite) == signature(cells["narrow_lr"], suite)
    assert signature(cells["narrow"], suite) != signature(cells["wide"], suite)
    calls: list[tuple[str, str]] = []
    measure = _rates({8: PCDEQ_L, 16: PCDEQ_SC}, calls)
    pool = Pool(gpus=1, cpu_workers=15, cpu_threads=1)
    placed, record, notes = place_cells(suite, pool, gpu=True, measure=measure)
    assert placed == {"narrow": "cpu", "narrow_lr": "cpu", "wide": "cuda"}
    assert sorted(calls) == sorted(
        [("narrow", "cuda"), ("narrow", "cpu"), ("wide", "cuda"), ("wide", "cpu")]
    )
    assert record is not None and record["cells"] == placed and record["rule"] == placement.RULE
    sig = record["signatures"][signature(cells["narrow"], suite)]
    assert (sig["gpu_steps_s"], sig["cpu_steps_s"], sig["device"]) == (*PCDEQ_L, "cpu")
    assert record["tasks"] == 3  # the run's training tasks: 3 cells x 1 seed
    assert notes == [
        "device auto: 2 of 3 cells on cpu (15 CPU workers of 1 thread(s)), 1 on cuda "
        "(2 signatures calibrated)"
    ]
    # the same timings, one process: every cell on the GPU
    one = place_cells(suite, Pool(gpus=1, cpu_workers=1), gpu=True, measure=measure)[0]
    assert set(one.values()) == {"cuda"}


def test_place_cells_counts_the_runs_tasks_not_one_signatures(tmp_path):
    """A grid of cells that each have their own signature (one task each) is placed by the
    whole run's rounds: five 1-task signatures on one GPU take five rounds there, one on the
    CPU workers, so they go to the CPU; the seeds count as tasks too."""
    widths = {8: PCDEQ_L, 10: PCDEQ_L, 12: PCDEQ_L, 14: PCDEQ_L, 16: PCDEQ_L}
    case = "".join(f"    - {{id: w{w}, model.width: {w}}}\n" for w in widths)
    grid = load_suite(write_suite(tmp_path, AUTO_SUITE, "g.yaml", {
        "    - {id: narrow, model.width: 8}\n    - {id: narrow_lr, model.width: 8, train.lr: "
        "1.0e-2}\n    - {id: wide, model.width: 16}\n": case}))  # fmt: skip
    assert len(grid.cells) == 5 and len({signature(c, grid) for c in grid.cells}) == 5
    calls: list[tuple[str, str]] = []
    host = Pool(gpus=1, cpu_workers=15)
    placed, record, _ = place_cells(grid, host, gpu=True, measure=_rates(widths, calls))
    assert set(placed.values()) == {"cpu"} and record["tasks"] == 5  # 178 > 243 / 5
    # one cell: one task goes to the faster GPU, three seeds on 2 GPUs to the CPU workers
    one = load_suite(write_suite(tmp_path, AUTO_SUITE, "o.yaml"), overrides=["select=[wide]"])
    rates = _rates({16: PCDEQ_L}, [])
    two = Pool(gpus=2, cpu_workers=15)
    assert place_cells(one, two, gpu=True, measure=rates)[0] == {"wide": "cuda"}
    three = load_suite(write_suite(tmp_path, AUTO_SUITE, "t.yaml"), overrides=["select=[wide]"],
                       seeds=[0, 1, 2])  # fmt: skip
    placed, record, _ = place_cells(three, two, gpu=True, measure=rates)
    assert placed == {"wide": "cpu"} and record["tasks"] == 3  # 178 > 243 / 2


def test_place_cells_edge_cases(tmp_path):
    suite = load_suite(write_suite(tmp_path, AUTO_SUITE))

    def fails(cell, suite, device, threads):
        if device == "cpu":
            raise RuntimeError("no kernel")
        return 1.0

    placed, record, _ = place_cells(suite, Pool(cpu_workers=8), gpu=True, measure=fails)
    assert set(placed.values()) == {"cuda"}
    assert "cpu: RuntimeError: no kernel" in next(iter(record["signatures"].values()))["reason"]
    # a cell without training steps is not calibrated: the GPU
    untrained = load_suite(write_suite(tmp_path, AUTO_SUITE, "u.yaml", {"epochs: 1": "epochs: 0"}))
    calls: list[tuple[str, str]] = []
    measure = _rates({8: PCDEQ_L, 16: PCDEQ_L}, calls)
    placed = place_cells(untrained, Pool(cpu_workers=15), gpu=True, measure=measure)[0]
    assert set(placed.values()) == {"cuda"} and calls == []
    # no GPU: every cell on cpu, nothing measured, one note
    placed, record, notes = place_cells(suite, Pool(cpu_workers=15), gpu=False, measure=measure)
    assert set(placed.values()) == {"cpu"} and calls == []
    assert notes == ["device auto: no GPU visible, every cell on cpu"]
    # an explicit device is every cell's, without a record
    cpu = load_suite(write_suite(tmp_path, AUTO_SUITE, "c.yaml", {"device: auto": "device: cpu"}))
    assert place_cells(cpu, Pool(), gpu=True, measure=measure)[:2] == (
        {c.id: "cpu" for c in cpu.cells},
        None,
    )
    # a cluster of yours (no pool): the workers resolve auto themselves
    placed, record, _ = place_cells(suite, None, gpu=True, fallback="cuda", measure=measure)
    assert set(placed.values()) == {"cuda"} and record is None and calls == []


def test_a_resume_reads_the_recorded_placement_back(tmp_path):
    suite = load_suite(write_suite(tmp_path, AUTO_SUITE))
    calls: list[tuple[str, str]] = []
    measure = _rates({8: PCDEQ_L, 16: PCDEQ_SC}, calls)
    first = place_cells(suite, Pool(cpu_workers=15), gpu=True, measure=measure)
    calls.clear()

    def never(*a):
        raise AssertionError("measured again")

    again = place_cells(suite, Pool(cpu_workers=1), gpu=True, measure=never, recorded=first[1])
    assert again[0] == first[0]
    # a resumed run made before placements existed keeps its device
    legacy = place_cells(suite, Pool(cpu_workers=15), gpu=True, measure=never, resumed=True,
                         fallback="cuda")  # fmt: skip
    assert set(legacy[0].values()) == {"cuda"}


def test_measure_steps_times_training_steps_and_keeps_the_process_state(tmp_path):
    suite = load_suite(write_suite(tmp_path, AUTO_SUITE))
    threads = torch.get_num_threads()
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    rate = placement.measure_steps(suite.cells[0], suite, "cpu", 1, warmup=1, steps=3)
    assert rate is not None and 1.0 < rate < 1e5  # steps/s of a width-8 DEQ on one thread
    assert torch.get_num_threads() == threads and torch.equal(torch.get_rng_state(), rng)
    # a deadline cuts the timed steps short: still a rate
    assert placement.measure_steps(suite.cells[0], suite, "cpu", 1, steps=1000, deadline=0.05)


# -- a run ----------------------------------------------------------------------------------


def test_auto_without_a_gpu_runs_the_cells_as_device_cpu_does(tmp_path, monkeypatch):
    monkeypatch.setattr(placement, "gpu_visible", lambda: False)
    auto = load_suite(write_suite(tmp_path, AUTO_SUITE), overrides=["select=[narrow_lr, wide]"])
    cpu = load_suite(write_suite(tmp_path, AUTO_SUITE, "c.yaml", {"device: auto": "device: cpu"}),
                     overrides=["select=[narrow_lr, wide]"])  # fmt: skip
    a = run_suite(auto, progress=False, plots=False)
    b = run_suite(cpu, progress=False, plots=False)
    pd.testing.assert_frame_equal(_key_rows(load_results(a.run_dir)),
                                  _key_rows(load_results(b.run_dir)))  # fmt: skip
    meta = json.loads((a.run_dir / "run.json").read_text())
    assert meta["placement"]["cells"] == {"narrow_lr": "cpu", "wide": "cpu"}
    assert _timeline_devices(a.run_dir) == meta["placement"]["cells"]
    assert _timeline_devices(b.run_dir) == meta["placement"]["cells"]
    assert "no GPU visible, every cell on cpu" in (a.run_dir / "log.txt").read_text()


def test_a_run_places_by_the_measured_rule_and_a_resume_keeps_it(tmp_path, monkeypatch):
    """Injected timings on a machine "with a GPU" put every cell on cpu (the inline executor's
    one process, the CPU faster here): the tasks run where placed; a resume measures nothing."""
    monkeypatch.setattr(placement, "gpu_visible", lambda: True)
    calls: list[tuple[str, str]] = []
    monkeypatch.setattr(placement, "measure_steps", _rates({8: (10.0, 20.0), 16: (10.0, 30.0)},
                                                           calls))  # fmt: skip
    suite = load_suite(write_suite(tmp_path, AUTO_SUITE), overrides=["select=narrow*"])
    run = run_suite(suite, progress=False, plots=False)
    meta = json.loads((run.run_dir / "run.json").read_text())
    assert run.exit_code == 0 and sorted(calls) == [("narrow", "cpu"), ("narrow", "cuda")]
    assert meta["placement"]["pool"] == {"gpus": 1, "cpu_workers": 1, "cpu_threads": 1}
    assert meta["placement"]["cells"] == {"narrow": "cpu", "narrow_lr": "cpu"}
    assert _timeline_devices(run.run_dir) == meta["placement"]["cells"]
    calls.clear()
    again = run_suite(suite, resume=run.run_dir, progress=False, plots=False)
    assert again.exit_code == 0 and calls == []
    assert "placement read back from run.json" in (run.run_dir / "log.txt").read_text()


def test_a_bad_device_is_one_line_and_exit_2(tmp_path):
    path = write_suite(tmp_path, AUTO_SUITE, replace={"device: auto": "device: gpu"})
    proc = subprocess.run(
        [sys.executable, "-m", "deqbench", "validate", str(path)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[1],
    )
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if "device" in ln]
    assert (
        len(lines) == 1
        and "device must be cuda_if_available, auto, cpu, cuda or cuda:N" in lines[0]
    )
    assert load_suite(write_suite(tmp_path, AUTO_SUITE, "ok.yaml")).device == "auto"


# -- the Dask executor's mixed pool ----------------------------------------------------------


def test_dask_dispatch_gives_each_kind_its_own_slots(tmp_path):
    pytest.importorskip("distributed")
    from deqbench.run.executors.dask import _Dispatch, slot_of
    from deqbench.run.executors.dask_cluster import CPU_SLOT, GPU_SLOT
    from deqbench.run.task import Task

    suite = load_suite(write_suite(tmp_path, AUTO_SUITE), seeds=[0, 1, 2])
    devices = {"narrow": "cpu", "narrow_lr": "cpu", "wide": "cuda"}
    tasks = [Task(suite, c, s, devices[c.id]) for c in suite.cells for s in suite.seeds]

    class Client:
        def __init__(self):
            self.asked = []

        def submit(self, fn, task, *, key, **kw):
            self.asked.append((task.device, kw.get("resources")))
            return type("Future", (), {"key": key})()

    d, client = _Dispatch(tasks), Client()
    d.fill(client, {GPU_SLOT: 1, CPU_SLOT: 4}, 0, [])
    # the queue's head is not enough: the GPU cell behind the CPU cells goes too
    assert sorted(client.asked, key=str) == sorted(
        [("cpu", {CPU_SLOT: 1})] * 4 + [("cuda", {GPU_SLOT: 1})], key=str
    )
    assert sum(slot_of(t) == GPU_SLOT for _, t, _, _ in d.inflight.values()) == 1
    d.fill(client, {GPU_SLOT: 1, CPU_SLOT: 4}, 0, [])  # full: nothing more
    assert len(client.asked) == 5
    # one int: the old policy, no resources asked
    d2, c2 = _Dispatch(tasks), Client()
    d2.fill(c2, 3, 0, [])
    assert len(c2.asked) == 3 and {r for _, r in c2.asked} == {None}


def test_dask_pool_leaves_the_gpu_workers_their_cores(monkeypatch):
    pytest.importorskip("distributed")
    from deqbench.run.executors import dask_cluster
    from deqbench.run.executors.dask import DaskExecutor

    monkeypatch.setattr(dask_cluster, "gpu_ids", lambda device: ["0"])
    monkeypatch.setattr(dask_cluster.os, "cpu_count", lambda: 16)

    class S:
        threads = None

    ex = DaskExecutor()
    # 16 cores - 2 GPU workers (max_per_gpu) - the coordinator
    assert ex.placement_pool(S()) == Pool(gpus=1, cpu_workers=13, cpu_threads=1)
    S.threads = 2
    assert ex.placement_pool(S()) == Pool(gpus=1, cpu_workers=6, cpu_threads=2)
    assert DaskExecutor(workers=4).placement_pool(S()) == Pool(1, 5, 2)
    assert DaskExecutor(scheduler="tcp://127.0.0.1:1").placement_pool(S()) is None


def test_dask_cpu_workers_join_a_gpu_cluster_with_their_own_slot(monkeypatch):
    pytest.importorskip("distributed")
    from deqbench.run.executors import dask_cluster
    from deqbench.run.executors.dask import DaskExecutor
    from deqbench.run.executors.dask_cluster import CPU_SLOT, GPU_SLOT, THREADS_ENV

    monkeypatch.setattr(dask_cluster, "gpu_ids", lambda device: ["0"])
    ex = DaskExecutor()
    specs, layout = ex.worker_specs("cuda", None)
    assert [s["options"]["resources"] for s in specs.values()] == [{GPU_SLOT: 1}]
    assert ex.add_cpu_workers(3, 1) == 0  # no local cluster yet

    class Cluster:  # what add_cpu_workers touches of a SpecCluster
        worker_spec: dict = {}
        loop = type("Loop", (), {"add_callback": lambda self, fn: None})()

        def _correct_state(self):
            pass

    ex.cluster = Cluster()
    assert ex.add_cpu_workers(3, 2) == 3 and ex.add_cpu_workers(3, 2) == 0  # once
    cpu = {k: v for k, v in ex._specs.items() if k.startswith("deqbench-cpu-")}
    assert sorted(cpu) == ["deqbench-cpu-0", "deqbench-cpu-1", "deqbench-cpu-2"]
    assert set(cpu) <= set(Cluster.worker_spec)
    for spec in cpu.values():
        opts = spec["options"]
        assert opts["resources"] == {CPU_SLOT: 1} and opts["nthreads"] == 1
        assert opts["env"][THREADS_ENV] == "2" and "CUDA_VISIBLE_DEVICES" not in opts["env"]
    assert ex.layout["cpu_workers"] == 3 and ex.uses_local_cores
    assert len(ex._gpu_specs()) == 1

    class Client:  # two CPU workers and the GPU worker joined
        def scheduler_info(self):
            ws = [{CPU_SLOT: 1}, {CPU_SLOT: 1}, {GPU_SLOT: 1}]
            return {"workers": {i: {"resources": r, "nthreads": 1} for i, r in enumerate(ws)}}

    ex.client = Client()
    assert ex.slots_by_kind() == {GPU_SLOT: 1, CPU_SLOT: 2}
    ex.client = None  # none joined yet: one each, the scheduler holds the cells meanwhile
    assert ex.slots_by_kind() == {GPU_SLOT: 1, CPU_SLOT: 1}


# -- on CUDA ---------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_auto_run_records_each_task_on_its_chosen_device(tmp_path):
    """Measured calibration on CUDA (inline): each task ran where run.json placed it."""
    suite = load_suite(write_suite(tmp_path, AUTO_SUITE, replace={
        "    - {id: narrow_lr, model.width: 8, train.lr: 1.0e-2}\n": ""}))  # fmt: skip
    run = run_suite(suite, progress=False, plots=False)
    meta = json.loads((run.run_dir / "run.json").read_text())
    placed = meta["placement"]["cells"]
    assert run.exit_code == 0 and set(placed) == {"narrow", "wide"}
    assert set(placed.values()) <= {"cpu", "cuda"}
    for sig in meta["placement"]["signatures"].values():
        assert sig["gpu_steps_s"] > 0 and sig["cpu_steps_s"] > 0
    assert _timeline_devices(run.run_dir) == placed


@pytest.mark.gpu
def test_gpu_dask_mixed_pool_runs_each_cell_where_placed(tmp_path, monkeypatch):
    """Injected timings put one cell on cpu and one on cuda; the local Dask cluster adds CPU
    workers beside its GPU worker and each cell runs on its kind."""
    pytest.importorskip("distributed")
    from deqbench.run.executors import open_executor

    calls: list[tuple[str, str]] = []
    # narrow far faster on a CPU core, wide on the GPU, whatever the host's GPU count
    monkeypatch.setattr(placement, "measure_steps", _rates({8: (10.0, 178.0), 16: PCDEQ_SC},
                                                           calls))  # fmt: skip
    suite = load_suite(write_suite(tmp_path, AUTO_SUITE, replace={
        "    - {id: narrow_lr, model.width: 8, train.lr: 1.0e-2}\n": ""}), seeds=[0, 1])  # fmt: skip
    with open_executor("dask", suite=suite) as ex:
        run = run_suite(suite, executor=ex, progress=False, plots=False)
    meta = json.loads((run.run_dir / "run.json").read_text())
    assert run.exit_code == 0 and meta["placement"]["cells"] == {"narrow": "cpu", "wide": "cuda"}
    assert meta["executor"]["cpu_workers"] >= 1
    with open(run.run_dir / "timeline.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 4
    for r in rows:
        assert r["device"] == meta["placement"]["cells"][r["cell_id"]]
        assert r["worker"].startswith("deqbench-cpu-") == (r["device"] == "cpu")
    cpu = load_suite(write_suite(tmp_path, AUTO_SUITE, "c.yaml", {
        "device: auto": "device: cpu",
        "    - {id: narrow_lr, model.width: 8, train.lr: 1.0e-2}\n": ""}), seeds=[0, 1])  # fmt: skip
    ref = load_results(run_suite(cpu, progress=False, plots=False).run_dir)
    got = load_results(run.run_dir)
    pd.testing.assert_frame_equal(_key_rows(got[got.cell_id == "narrow"]),
                                  _key_rows(ref[ref.cell_id == "narrow"]))  # fmt: skip
