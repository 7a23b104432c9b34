"""Where each cell of a ``device: auto`` suite runs: on the GPU or on CPU cores, measured.

Small DEQs train far above the GPU's floor (a step is a few dozen tiny kernels with the GPU idle
between their launches), so a host's CPU cores, each running one cell, can outpace its GPU. With
``device: auto`` and a visible GPU, each cell gets a **placement**, ``cuda`` or ``cpu``, by
this rule (:data:`RULE`, :func:`choose`):

* Cells are grouped by their **signature** (:func:`signature`): what sets the cost of a training
  step (model, solver, backward, runtime, data, batch size, optimiser, clipping, dtype, numeric
  flags); learning rates, epochs and the like do not count.
* Per signature, a short **calibration** (:func:`measure_steps`) builds the model as a task does
  and times :func:`deqbench.run.train.train` after ``WARMUP_STEPS`` warm-up steps, for up to
  ``TIMED_STEPS`` steps or ``DEADLINE_S`` seconds: once on the GPU, once on CPU with the threads a
  CPU-placed cell will have (one on the Dask executor's CPU workers).
* The **pools** (:class:`Pool`): a GPU is one device, one cell at a time; the CPU side is the
  CPU workers the executor runs beside the GPU workers (the inline executor: 1).
* The run's training **tasks** (its training cells x the seeds) would run in rounds on either
  side: ceil(tasks / GPUs) on the GPUs (counted as one cell at a time each), ceil(tasks / CPU
  workers) on the CPU workers. A signature goes to ``cpu`` where the run's tasks at its rates
  end strictly sooner there (one CPU cell's steps/s divided by the CPU rounds > one GPU cell's
  steps/s divided by the GPU rounds), else ``cuda``. With many tasks this approaches the pools'
  throughput (steps/s x workers); with few, idle workers count for nothing (a run of one task:
  the faster device). A cell that takes no training steps (``train.epochs: 0``), a calibration
  that fails, or an executor with no CPU worker gives ``cuda``.

Without a GPU, ``auto`` is ``cpu`` for every cell (one note). The decision is stored in
``run.json`` (``placement``: the rule, the pools, the run's training tasks, each signature's
measured steps/s, choice and reason, each cell's device) before any task starts, and a
``--resume`` reads it back, so a resumed run places its cells as the first invocation did.
Each task's ``timeline.csv`` line says the device it ran on.

Example:
    >>> from deqbench.run.placement import Pool, choose
    >>> host = Pool(gpus=1, cpu_workers=15, cpu_threads=1)
    >>> choose(243.0, 178.0, host, tasks=15)[0]  # pcdeq_l on an H200 host: a run of 15 tasks
    'cpu'
    >>> choose(243.0, 178.0, host, tasks=1)[0]   # a run of one task: the faster device
    'cuda'
    >>> choose(92.0, 0.8, host, tasks=15)[0]     # pcdeq_sc
    'cuda'
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .env import device_name

if TYPE_CHECKING:  # pragma: no cover
    from .suite import Cell, Suite

__all__ = ["Pool", "RULE", "choose", "signature", "measure_steps", "place_cells"]

#: the rule, as ``run.json`` records it
RULE = (
    "cpu where the run's training tasks (cells x seeds) at a signature's rates end sooner on the "
    "CPU workers: steps/s of one CPU cell / ceil(tasks / CPU workers) > steps/s of one GPU cell "
    "/ ceil(tasks / GPUs) (training steps timed per signature after warm-up); else cuda"
)
#: calibration: warm-up steps (not timed), then up to TIMED_STEPS steps or DEADLINE_S seconds
WARMUP_STEPS = 2
TIMED_STEPS = 8
DEADLINE_S = 3.0
#: the train: keys that change what a step costs (the rest of the signature: whole sections)
STEP_KEYS = ("batch_size", "full_batch", "optimizer", "grad_clip", "precise_bn")

#: (cell, suite, device, threads) -> training steps/s (None: could not be measured)
Measure = Callable[["Cell", "Suite", str, int], "float | None"]


@dataclass(frozen=True)
class Pool:
    """The processes an executor runs cells in: ``gpus`` GPUs and ``cpu_workers`` CPU processes
    of ``cpu_threads`` torch threads each."""

    gpus: int = 1
    cpu_workers: int = 1
    cpu_threads: int = 1


def choose(
    gpu_rate: float | None, cpu_rate: float | None, pool: Pool, tasks: int
) -> tuple[str, str]:
    """``(device, reason)`` for a signature whose training steps ran at ``gpu_rate`` steps/s on
    one GPU and ``cpu_rate`` on one CPU process of ``pool.cpu_threads`` threads, in a run of
    ``tasks`` training tasks (:data:`RULE`: the side where those tasks, in rounds over that
    side's workers, end sooner; a tie keeps the GPU)."""
    if pool.cpu_workers < 1:
        return "cuda", "no CPU worker beside the GPU workers"
    if tasks < 1:
        return "cuda", "no training tasks"
    if gpu_rate is None or cpu_rate is None or not (gpu_rate > 0 and cpu_rate >= 0):
        return "cuda", "not calibrated"
    gpus = max(pool.gpus, 1)
    gpu_rounds, cpu_rounds = math.ceil(tasks / gpus), math.ceil(tasks / pool.cpu_workers)
    gpu_side, cpu_side = gpu_rate / gpu_rounds, cpu_rate / cpu_rounds
    rel = ">" if cpu_side > gpu_side else "<="
    why = (
        f"{tasks} task(s): CPU {cpu_rate:.4g} steps/s / {cpu_rounds} round(s) of "
        f"{pool.cpu_workers} workers = {cpu_side:.4g} {rel} GPU {gpu_rate:.4g} steps/s / "
        f"{gpu_rounds} round(s) of {gpus} = {gpu_side:.4g}"
    )
    return ("cpu" if cpu_side > gpu_side else "cuda"), why


def signature(cell: Cell, suite: Suite) -> str:
    """A short hash of what sets the cost of ``cell``'s training step (module docstring)."""
    body = {
        **{s: getattr(cell, s) for s in ("model", "solver", "backward", "runtime", "data")},
        "train": {k: cell.train.get(k) for k in STEP_KEYS},
        "dtype": suite.dtype,
        "flags": suite.numeric_flags(),
    }
    text = json.dumps(body, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def trains(cell: Cell) -> bool:
    """Whether ``cell`` takes training steps (the calibration times them)."""
    return int(cell.train.get("epochs", 1) or 0) > 0 and cell.train.get("max_steps") != 0


class _Enough(Exception):
    """Raised from the progress callback: the calibration has its steps."""


@contextlib.contextmanager
def _kept_state(device: str) -> Iterator[None]:
    """Python's, NumPy's and torch's RNG states, torch threads and numeric flags as they were
    (the coordinator's own tasks follow)."""
    import random

    import numpy as np
    import torch

    from .task import preserved_numerics

    py, npy = random.getstate(), np.random.get_state()
    cuda = [torch.device(device).index or 0] if device.startswith("cuda") else []
    with preserved_numerics(), torch.random.fork_rng(devices=cuda):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)


def measure_steps(
    cell: Cell,
    suite: Suite,
    device: str,
    threads: int,
    *,
    warmup: int = WARMUP_STEPS,
    steps: int = TIMED_STEPS,
    deadline: float = DEADLINE_S,
) -> float | None:
    """Training steps/s of ``cell`` on ``device`` (``threads`` torch threads on CPU): the model
    built, initialised and configured as a task does, :func:`deqbench.run.train.train` timed
    from the end of step ``warmup`` for ``steps`` steps or until ``deadline`` seconds passed
    (the device synchronised at each step's end). Where the warm-up alone outlasts 3 x
    ``deadline``, the rate over the steps done so far (warm-up included: a lower bound of the
    device's speed). None when not one step finished. The process's RNG states, threads and
    numeric flags are kept."""
    import torch

    from ..data.base import load_data
    from .task import apply_numeric_flags, cell_model, seed_everything
    from .train import train

    cuda = device.startswith("cuda")
    with _kept_state(device):
        if not cuda:
            torch.set_num_threads(max(1, threads))
        apply_numeric_flags(suite)
        dtype = getattr(torch, suite.dtype)
        seed_everything(0)
        name, params = cell.data_params()
        cfg = cell.train_config()
        total = warmup + steps + 1  # the last step verifies its solves: never timed
        data = load_data(name, **params)
        if not cfg.full_batch:
            # at most 256 steps in one epoch (past them an epoch's short evaluation comes)
            data = data.tiled(cfg.batch_size * min(total, 256), cfg.batch_size)
        data = data.to(device, dtype)
        model, runtime = cell_model(cell, data, device, dtype, seed=0)
        cfg = dataclasses.replace(
            cfg, epochs=max(cfg.epochs, total), max_steps=total, eval_before=False
        )
        ends: list[float] = []
        start = time.perf_counter()

        def progress(epoch: int, step: int) -> None:
            if cuda:
                torch.cuda.synchronize(device)
            ends.append(time.perf_counter())
            timed = step - warmup
            if timed >= steps or (timed > 0 and ends[-1] - ends[warmup - 1] > deadline):
                raise _Enough
            if timed <= 0 and ends[-1] - start > 3 * deadline:
                raise _Enough

        with contextlib.suppress(_Enough):
            train(model, data, cfg, progress=progress, runtime=runtime)
        del model, data
        if cuda:
            torch.cuda.empty_cache()  # the coordinator's tasks (or its workers) need it
    if len(ends) > warmup >= 1:
        return (len(ends) - warmup) / (ends[-1] - ends[warmup - 1])
    return len(ends) / (ends[-1] - start) if ends else None


def _name(device: str) -> str:
    """The card or CPU model of ``device`` (``unknown`` where it cannot be read)."""
    try:
        return device_name(device)
    except Exception:  # noqa: BLE001 - a name is informational
        return "unknown"


def _safely(measure: Measure, cell: Cell, suite: Suite, device: str, threads: int) -> Any:
    """``measure(...)``, or the one-line reason it failed (a str)."""
    try:
        return measure(cell, suite, device, threads)
    except Exception as exc:  # noqa: BLE001 - the task reports the real failure
        text = " ".join(str(exc).split())[:200]
        return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def place_cells(
    suite: Suite,
    pool: Pool | None,
    *,
    gpu: bool | None = None,
    measure: Measure | None = None,
    recorded: dict[str, Any] | None = None,
    resumed: bool = False,
    fallback: str | None = None,
) -> tuple[dict[str, str], dict[str, Any] | None, list[str]]:
    """The device of each cell of ``suite``: ``({cell id: device}, record, notes)``.

    Only for ``device: auto`` (else every cell gets the suite's resolved device and the record
    is None). ``pool``: the executor's (None: it places nothing itself, e.g. a Dask cluster of
    yours, whose workers resolve ``auto`` each on their own: every cell gets ``fallback``).
    ``gpu``: whether a GPU is visible (default: ask torch). ``measure``: the calibration
    (default :func:`measure_steps`; tests inject timings). ``recorded``: the ``placement`` of the run's ``run.json`` (a resume):
    its cells keep their device and nothing is measured again; ``resumed`` without ``recorded``
    (a run made before placements existed) keeps every cell on ``fallback``, the device its
    first tasks ran on. ``record`` is what ``run.json``
    stores under ``placement``; ``notes`` are one line each for the log."""
    cells = suite.cells
    if suite.device != "auto":
        dev = suite.resolved_device()
        return {c.id: dev for c in cells}, None, []
    if recorded and isinstance(recorded.get("cells"), dict):
        kept = {c.id: str(recorded["cells"].get(c.id, fallback or "cuda")) for c in cells}
        return kept, recorded, ["device auto: placement read back from run.json"]
    if resumed:
        dev = fallback or suite.resolved_device()
        return {c.id: dev for c in cells}, None, [f"device auto: run made without a placement, "
                                                  f"every cell on {dev} as before"]  # fmt: skip
    if gpu is None:
        gpu = gpu_visible()
    if not gpu:
        on_cpu = {c.id: "cpu" for c in cells}
        record: dict[str, Any] = {"rule": RULE, "cells": dict(on_cpu)}
        return on_cpu, record, ["device auto: no GPU visible, every cell on cpu"]
    if pool is None:
        dev = fallback or "cuda"
        note = "device auto: the executor's workers resolve it each on their own (no placement)"
        return {c.id: dev for c in cells}, None, [note]
    measure = measure or measure_steps
    tasks = sum(map(trains, cells)) * len(suite.seeds)  # the run's training tasks
    sigs: dict[str, dict[str, Any]] = {}
    placed: dict[str, str] = {}
    for c in cells:
        if not trains(c):
            placed[c.id] = "cuda"
            continue
        key = signature(c, suite)
        if key not in sigs:
            g = _safely(measure, c, suite, "cuda", pool.cpu_threads)
            p = _safely(measure, c, suite, "cpu", pool.cpu_threads)
            rates = [r if isinstance(r, int | float) or r is None else None for r in (g, p)]
            dev, why = choose(rates[0], rates[1], pool, tasks)
            fails = [f"{d}: {r}" for d, r in (("cuda", g), ("cpu", p)) if isinstance(r, str)]
            sigs[key] = {
                "first_cell": c.id,
                "gpu_steps_s": rates[0],
                "cpu_steps_s": rates[1],
                "device": dev,
                "reason": "; ".join([why, *fails]),
            }
        placed[c.id] = sigs[key]["device"]
    record = {
        "rule": RULE,
        "pool": dataclasses.asdict(pool),
        "tasks": tasks,
        "device_names": {d: _name(d) for d in ("cuda", "cpu")},
        "signatures": sigs,
        "cells": placed,
    }
    n_cpu = sum(d == "cpu" for d in placed.values())
    note = (
        f"device auto: {n_cpu} of {len(cells)} cells on cpu ({pool.cpu_workers} CPU workers of "
        f"{pool.cpu_threads} thread(s)), {len(cells) - n_cpu} on cuda ({len(sigs)} signatures "
        "calibrated)"
    )
    return placed, record, [note]


def gpu_visible() -> bool:
    """Whether torch sees a GPU (``torch.cuda.is_available()``)."""
    import torch

    return bool(torch.cuda.is_available())


def executor_pool(suite: Suite, executor: Any) -> Pool | None:
    """The :class:`Pool` of ``executor`` for ``suite``: its ``placement_pool(suite)`` where it
    has one (the Dask executor), else one process that runs every cell in turn (the inline
    executor: one GPU, one CPU worker with the suite's threads or torch's default)."""
    fn = getattr(executor, "placement_pool", None)
    if callable(fn):
        return fn(suite)  # type: ignore[no-any-return]
    import torch

    return Pool(gpus=1, cpu_workers=1, cpu_threads=suite.threads or torch.get_num_threads())


def place_run(
    suite: Suite, meta: dict[str, Any], executor: Any, resumed: bool
) -> tuple[dict[str, str], list[str]]:
    """:func:`place_cells` for a run: the executor's pool, the ``placement`` a resumed run's
    ``run.json`` recorded (``meta``), and the new record stored in ``meta`` (with the seconds
    the calibration took). Returns ``({cell id: device}, notes)``."""
    if suite.device != "auto":
        placed, _, notes = place_cells(suite, None)
        return placed, notes
    t = time.perf_counter()
    gpu = gpu_visible()
    pool = executor_pool(suite, executor) if gpu else None
    placed, record, notes = place_cells(
        suite,
        pool,
        gpu=gpu,
        recorded=meta.get("placement"),
        resumed=resumed,
        fallback=str(meta.get("device") or "") or None,
    )
    if record is not None and "placement" not in meta:
        record["seconds"] = round(time.perf_counter() - t, 3)
        meta["placement"] = record
    return placed, notes
