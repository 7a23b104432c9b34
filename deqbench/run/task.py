"""One (cell, seed) task: build, initialise, train with the analyses as callbacks, measure.

:func:`run_task` is a plain top-level function of a picklable :class:`Task`, so any executor
(inline, a process pool, Dask) can run it. It never writes ``results.csv``: it returns its rows
and series in a :class:`TaskResult` and the coordinator (:mod:`deqbench.run.runner`) writes them.
Failures never escape: NaN/inf and divergence (from :func:`deqbench.run.train.train`), CUDA
out-of-memory and any exception of building or training the model become the task's status
(``nan | diverged | oom | error``) with the reason in ``note``; rows measured before the failure
are kept. An analysis hook that raises gives that analysis one failed row (``error``/``oom``,
its note naming the hook) and no further calls; training and the other analyses go on and the
task is ``flagged``, naming the analysis. A ``SystemExit``, ``KeyboardInterrupt`` or
``GeneratorExit`` of plugin code counts like any exception (:mod:`deqbench.run.interrupts`);
only a signal to this process (:class:`~deqbench.run.interrupts.Interrupted`) propagates.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..analyses.base import CellContext, Row
from .checkpoints import (
    Suspended,
    TaskCheckpoint,
    checkpoint_path,
    dumps_linked,
    loads_linked,
    task_fingerprint,
)
from .interrupts import is_interruption, marked_signals, plugin_fault
from .results import CONVERGENCE, FLAGGED, RUNNER
from .solves import Tallies, rule_note

if TYPE_CHECKING:  # pragma: no cover
    from .suite import Cell, Suite


@dataclass
class Task:
    """Everything one (cell, seed) needs; picklable."""

    suite: Suite
    cell: Cell
    seed: int
    device: str  # resolved: cpu | cuda | cuda:1 ...
    run_id: str = ""
    run_dir: str | None = None
    #: the ``--stop-after`` deadline (epoch seconds): the task stops at the first step boundary
    #: past it, its checkpoint written, and returns :data:`SUSPENDED` (it does not start when
    #: the deadline has passed)
    stop_at: float | None = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.cell.id, self.seed)

    def row_base(self) -> dict[str, Any]:
        """The columns that say which run, cell and seed a result row belongs to."""
        from .labels import cell_labels

        cell = self.cell
        solver, backward = cell_labels(cell.as_dict())
        return {
            "run_id": self.run_id,
            "cell_id": cell.id,
            "model": cell.model["name"],
            "solver": solver,
            "backward": backward,
            "init": cell.init["name"],
            "seed": self.seed,
        }


@dataclass
class TaskResult:
    cell_id: str
    seed: int
    rows: list[dict[str, Any]]
    status: str = "ok"
    note: str = ""
    traceback: str | None = None
    wall_time: float = 0.0
    series: dict[str, str] = field(default_factory=dict)  # file name -> CSV text
    #: where and when it ran (epoch seconds): ``start``/``end`` of :func:`run_task`, ``worker``
    #: (``host:pid``, or the Dask worker's name), ``pid``; the coordinator adds ``submitted``,
    #: ``received`` and ``attempts`` (:mod:`deqbench.run.timeline` reads them)
    timing: dict[str, Any] = field(default_factory=dict)
    #: lines for the run's log and stderr (a checkpoint used, ignored or not written)
    notes: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return self.status != "ok"


#: the status of a task that the ``--stop-after`` deadline stopped before it finished: no rows;
#: the runner writes nothing for it and ``--resume`` runs it again (from its checkpoint)
SUSPENDED = "suspended"


class Listener(Protocol):
    """Progress callbacks an executor may call (all optional for distributed executors)."""

    def task_started(self, task: Task) -> None: ...

    def epoch(self, task: Task, epoch: int) -> None: ...


class _TaskContext(CellContext):
    """Collects series in memory; the coordinator writes them under ``series/``."""

    def write_series(self, name: str, df: Any) -> Path | None:
        fname = f"{name}__{self.cell_id}__seed{self.seed}.csv"
        self.extra.setdefault("_series", {})[fname] = df.to_csv(index=False)
        return Path(self.run_dir) / "series" / fname if self.run_dir is not None else None


#: the hooks of an analysis that the runner calls
HOOKS = ("before_training", "on_step", "on_epoch", "after_training")


class _Guarded:
    """An analysis whose hooks never raise: a hook that raises (whatever it raises, but a signal
    to this process) gives the rows it produced before, one failed row (status ``error``, or
    ``oom``; value NaN; the note names the hook) and ends the analysis for the task: its later
    hooks are not called. An analysis that cannot be created (its import or its constructor
    raised) gives its failed row at its first hook. Other attributes are the analysis's."""

    def __init__(self, name: str, params: Any) -> None:
        from ..core.registry import analyses

        self._name, self._analysis = name, None
        self._pending: list[Row] = []
        self.failed = False
        try:
            self._analysis = analyses.get(name)(params)
        except BaseException as exc:  # noqa: BLE001 - an analysis's failure is its own
            self._fail(exc, "creating the analysis", None)

    def __getattr__(self, attr: str) -> Any:
        if attr in HOOKS:
            return lambda ctx, *info: self._call(attr, ctx, *info)
        if attr.startswith("_") or self._analysis is None:
            raise AttributeError(attr)
        return getattr(self._analysis, attr)

    def _fail(self, exc: BaseException, where: str, step: int | None) -> None:
        if is_interruption(exc):
            raise exc
        self.failed = True
        metric = getattr(self._analysis, "metric", "") or self._name
        row = Row.failed(metric, exc, step=step)
        row.note = " ".join(f"{plugin_fault(exc)} in {where}; its later hooks not run".split())
        row.note = row.note[:500]
        self._pending.append(row)
        if row.status == "oom":
            _empty_cuda_cache()

    def _call(self, hook: str, ctx: Any, *info: Any) -> list[Row]:
        rows, self._pending = self._pending, []
        if self.failed:
            return rows
        step = getattr(info[0], "epoch", None) if info else None
        try:
            for r in getattr(self._analysis, hook)(ctx, *info) or ():
                rows.append(r if isinstance(r, Row) else Row(**r))
        except BaseException as exc:  # noqa: BLE001 - an analysis's failure is its own
            where = f"{hook} at epoch {step}" if step is not None else hook
            if info and hasattr(info[0], "step"):
                where += f" step {info[0].step}"
            self._fail(exc, where, step)
            rows, self._pending = rows + self._pending, []
        return rows


def _empty_cuda_cache() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


_DATA_CACHE: dict[str, Any] = {}


def _load_data(cell: Cell) -> tuple[Any, float | None]:
    """Datasets are loaded once per process (on CPU, default dtype) and shared by its tasks.
    Returns the data and the load time in seconds (None when it came from the cache)."""
    from ..data.base import load_data

    name, params = cell.data_params()
    key = json.dumps([name, params], sort_keys=True, default=str)
    took = None
    if key not in _DATA_CACHE:
        t = time.perf_counter()
        _DATA_CACHE[key] = load_data(name, **params)
        took = time.perf_counter() - t
    return _DATA_CACHE[key], took


#: analysis name of the per-process start-up rows (``warmup_time``, ``data_load_time``)
PROCESS = "process"
#: analysis name of the per-task training budget rows: ``optimizer_steps`` (the optimiser steps
#: the task took, 0 when it did not train) and ``steps_per_epoch`` (batches per pass over the
#: training set), so that a run directory says each cell's step budget
TRAINING = "training"
#: device/dtype this process warmed up on -> the warm-up's seconds until a task reports them
_WARMUP: dict[tuple[str, str], float | None] = {}


def warm_up(device: str, dtype: Any) -> float | None:
    """Pay the one-off costs of a process before its first timed task: imports and the
    registries' built-ins, the device context (CUDA context, cuBLAS/cuDNN handles), the first
    kernels of a DEQ forward/IFT backward (the first re-entrant ``autograd.grad`` costs extra) and
    an evaluation pass. Returns the seconds it took, or None when this process already warmed
    up on ``device``/``dtype``. The global RNG state is restored afterwards."""
    import torch

    key = (str(device), str(dtype))
    if key in _WARMUP:
        return None
    _WARMUP[key] = None
    t = time.perf_counter()
    from ..core.registry import analyses, inits, models, solvers
    from . import results  # noqa: F401  (imports are part of the start-up)

    for reg in (models, solvers, inits, analyses):
        reg.names()
    rng = torch.get_rng_state()
    try:
        model = models.create("fc_deq_tiny", in_shape=(8,), num_outputs=3)
        model = model.to(device=device, dtype=dtype)
        x = torch.randn(4, 8, device=device, dtype=dtype, generator=None)
        opt = torch.optim.Adam(model.parameters())  # the first optimizer imports torch._dynamo
        model(x).square().sum().backward()
        opt.step()
        with torch.no_grad():
            model.eval()
            model(x)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
    finally:
        torch.set_rng_state(rng)
    _WARMUP[key] = took = time.perf_counter() - t
    return took


def take_warmup_time(device: str, dtype: Any) -> float | None:
    """The seconds of this process's warm-up on ``device``/``dtype``, once: for the
    ``warmup_time`` row of its first task (also when the warm-up ran before any task, at a Dask
    worker's start); None afterwards."""
    key = (str(device), str(dtype))
    took = _WARMUP.get(key)
    if took is not None:
        _WARMUP[key] = None  # reported; the key stays: this process is warm
    return took


def set_deterministic_algorithms(on: bool, *, warn_only: bool, compiles: bool = True) -> None:
    """``torch.use_deterministic_algorithms(on, warn_only=...)``, whose only other effect is
    TorchInductor's ``deterministic`` setting, for which it imports ``torch._inductor`` (and
    ``torch._dynamo`` with it: 2-4 s). ``compiles=False`` (a process that runs no cell, e.g. the
    coordinator of a Dask run) and any process where Inductor is not loaded yet while ``on`` is
    False set the global flag alone: no compiled code can see the difference there."""
    import sys

    import torch

    if "torch._inductor.config" in sys.modules or (compiles and on):
        torch.use_deterministic_algorithms(on, warn_only=warn_only)
    else:
        torch._C._set_deterministic_algorithms(on, warn_only=warn_only)


@contextlib.contextmanager
def preserved_numerics() -> Iterator[None]:
    """Restore, after the block, the process-wide settings a run or a measurement may change:
    TF32 (matmul, cuDNN), ``cudnn.benchmark`` / ``.deterministic``, deterministic algorithms,
    torch threads and ``CUBLAS_WORKSPACE_CONFIG`` (so that one suite's flags do not carry over
    into the next run of the process, e.g. the parts of a collection)."""
    import torch

    saved = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.get_num_threads(),
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    )
    try:
        yield
    finally:
        (
            torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32,
            torch.backends.cudnn.benchmark,
            torch.backends.cudnn.deterministic,
        ) = saved[:4]
        # restoring: where Inductor is not loaded nothing compiled ran, the global flag suffices
        set_deterministic_algorithms(saved[4], warn_only=saved[5], compiles=False)
        if torch.get_num_threads() != saved[6]:
            torch.set_num_threads(saved[6])
        if saved[7] is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = saved[7]


def apply_numeric_flags(suite: Any, *, compiles: bool = True) -> None:
    """Set the suite's torch numeric flags: ``tf32`` (matmul and cuDNN TF32),
    ``cudnn_benchmark`` and ``deterministic`` (``torch.use_deterministic_algorithms`` with
    ``warn_only``, ``cudnn.deterministic``, and cuBLAS's deterministic workspace
    ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` unless the environment sets one; it takes effect where
    cuBLAS was not used yet in the process, so set it for the whole run). Unset flags stay at
    PyTorch's defaults (matmul TF32 off, cuDNN TF32 on, benchmark off, nondeterministic
    algorithms allowed). ``run.json`` records the flags in effect. ``compiles=False``: this
    process runs no cell (:func:`set_deterministic_algorithms`)."""
    flags = suite.numeric_flags() if hasattr(suite, "numeric_flags") else {}
    if not flags:
        return
    import torch

    if "tf32" in flags:
        torch.backends.cuda.matmul.allow_tf32 = flags["tf32"]
        torch.backends.cudnn.allow_tf32 = flags["tf32"]
    if "cudnn_benchmark" in flags:
        torch.backends.cudnn.benchmark = flags["cudnn_benchmark"]
    if "deterministic" in flags:
        on = flags["deterministic"]
        if on:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        set_deterministic_algorithms(on, warn_only=True, compiles=compiles)
        torch.backends.cudnn.deterministic = on


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices)."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def run_task(task: Task, listener: Listener | None = None) -> TaskResult:
    """Run one (cell, seed) and return its rows (with the runner status row last)."""
    from ..core.own_solves import judged_under

    # a model's own loop is judged under the run's stop rule (the cell's solver.stop)
    if task.stop_at is not None and time.time() >= task.stop_at:
        now = time.time()
        note = "not started: the --stop-after deadline had passed"
        timing = {"start": now, "end": now, "pid": os.getpid(), "worker": _where()}
        return TaskResult(task.cell.id, task.seed, [], SUSPENDED, note, timing=timing)
    stop = task.cell.solver.get("stop") if isinstance(task.cell.solver, dict) else None
    with marked_signals(), judged_under(stop if isinstance(stop, str) else None):
        return _run_task(task, listener)


class _TaskRows:
    """The rows of one task: the task's base columns, each analysis's registered name, and the
    stage the task is at (for the note of a ``SystemExit`` & co. of plugin code)."""

    def __init__(self, base: dict[str, Any]) -> None:
        self.base = base
        self.rows: list[dict[str, Any]] = []
        self.names: dict[int, str] = {}
        self.stage = ""

    def add(self, analysis: str, r: Row) -> None:
        self.rows.append({**self.base, "analysis": analysis, "variant": r.variant,
                          "metric": r.metric, "step": r.step, "repeat": r.repeat,
                          "value": r.value, "unit": r.unit, "status": r.status,
                          "note": r.note})  # fmt: skip

    def emit(self, analysis: Any, produced: Any) -> None:
        for r in produced or ():
            self.add(self.names[id(analysis)], r if isinstance(r, Row) else Row(**r))


def _run_task(task: Task, listener: Listener | None) -> TaskResult:
    import torch

    started = time.time()
    t0 = time.perf_counter()
    cell, suite = task.cell, task.suite
    out = _TaskRows(task.row_base())
    status, note, tb = "ok", "", None
    ctx: CellContext | None = None
    tallies = Tallies()  # every DEQ solve of the task, by kind and phase
    ckpt: TaskCheckpoint | None = None
    before = 0.0  # seconds the task ran before its checkpoint (a resumed task)

    if listener is not None:
        listener.task_started(task)
    try:
        if suite.threads:
            torch.set_num_threads(suite.threads)
        apply_numeric_flags(suite)
        dtype = getattr(torch, suite.dtype)
        cpu_data = _process_start_up(task, dtype, out)
        t0 = time.perf_counter()
        seed_everything(task.seed)
        data = cpu_data.to(task.device, dtype)
        model, mname, runtime = _build_model(task, data, dtype, out)
        instances = []
        for name, params in suite.analyses:
            instances.append(_Guarded(name, params))
            out.names[id(instances[-1])] = name  # rows carry the registered name
        out.stage = f"running model {_named('models', mname)}"
        ctx = _TaskContext(
            model,
            data,
            torch.device(task.device),
            dtype,
            task.seed,
            cell.id,
            cell.as_dict(),
            Path(task.run_dir) if task.run_dir else None,
        )
        tallies.amp, tallies.device = runtime.amp, torch.device(task.device).type
        tallies.batchnorm = not cell.train_config().precise_bn and any(
            isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()
        )

        def probe(phase: str, a: Any, hook: Any) -> None:
            """Run an analysis hook outside training; its solves count as ``phase``."""
            with tallies.counting(phase, a):
                out.emit(a, hook(ctx))

        ckpt = _checkpoint(
            task, ctx, instances, tallies, out, lambda: before + time.perf_counter() - t0
        )
        loaded = ckpt.load() if ckpt is not None else None
        if loaded is not None:
            before = float(loaded["wall"])
            ckpt.notes.append(f"continued from its checkpoint at step {loaded['step']}")  # type: ignore[union-attr]
        else:  # a resumed task has these rows (and their solves) in its checkpoint
            for a in instances:
                probe("init", a, a.before_training)
        status, note = _train_phase(
            task, model, data, ctx, instances, runtime, tallies, out, listener, mname, ckpt
        )
        out.stage = f"running model {_named('models', mname)}"
        if status == "ok":
            for a in instances:
                probe("probe", a, a.after_training)
        _add_convergence_rows(tallies, out)
    except Suspended as exc:
        timing = {"start": started, "end": time.time(), "pid": os.getpid(), "worker": _where()}
        wall = before + time.perf_counter() - t0
        notes = ckpt.notes if ckpt is not None else []
        return TaskResult(
            cell.id, task.seed, [], SUSPENDED, str(exc), None, wall, {}, timing, notes
        )
    except torch.cuda.OutOfMemoryError as exc:
        status, note, tb = "oom", _one_line(exc), traceback.format_exc()
        torch.cuda.empty_cache()
    except BaseException as exc:  # noqa: BLE001 - sys.exit() & co. of plugin code too
        if is_interruption(exc):
            raise
        status, tb = "error", traceback.format_exc()
        note = (
            _one_line(exc)
            if isinstance(exc, Exception)
            else f"{plugin_fault(exc)} while {out.stage}"
        )
    if status == "ok":
        # why the measurement is not trustworthy (status "flagged")
        flags = _untrustworthy(tallies, out.rows)
        if flags:
            status, note = FLAGGED, "; ".join(dict.fromkeys(flags))
    wall = before + time.perf_counter() - t0
    out.add(RUNNER, Row("wall_time", wall, unit="s", status=status, note=note))
    series = ctx.extra.get("_series", {}) if ctx is not None else {}
    timing = {"start": started, "end": time.time(), "pid": os.getpid(), "worker": _where(),
              "device": task.device}  # fmt: skip
    notes = ckpt.notes if ckpt is not None else []
    return TaskResult(cell.id, task.seed, out.rows, status, note, tb, wall, series, timing, notes)


def _checkpoint(
    task: Task,
    ctx: CellContext,
    instances: list[Any],
    tallies: Tallies,
    out: _TaskRows,
    wall: Any,
) -> TaskCheckpoint | None:
    """The task's :class:`~deqbench.run.checkpoints.TaskCheckpoint` (None: nothing to write to
    and no deadline), its part of the state (rows, analyses, tallies, series, wall time so far)
    captured and restored with the live model, context and data linked."""
    cfg = task.cell.train_config()
    every = cfg.checkpoint_every
    path = None
    if task.run_dir is not None and every is not None and every > 0:
        path = checkpoint_path(task.run_dir, task.cell.id, task.seed)
    if path is None and task.stop_at is None:
        return None
    suite = task.suite
    settings = {"dtype": suite.dtype, "analyses": suite.analyses, **suite.numeric_flags()}
    fingerprint = task_fingerprint(
        task.cell.as_dict(), task.cell.id, task.seed, settings, task.device
    )
    ckpt = TaskCheckpoint(path, every, fingerprint, task.stop_at)

    def live() -> dict[str, Any]:
        model, data = ctx.model, ctx.data
        objs: dict[str, Any] = {"ctx": ctx, "data": data, "train": data.train, "test": data.test}
        objs.update({"optimizer": ctx.optimizer, "loss_fn": ctx.loss_fn})
        for split in ("train", "test"):
            for i, t in enumerate(getattr(data, split)):
                objs[f"{split}:{i}"] = t
        objs.update({f"module:{k}": m for k, m in model.named_modules()})  # "" is the model
        objs.update({f"param:{k}": p for k, p in model.named_parameters()})
        objs.update({f"buffer:{k}": b for k, b in model.named_buffers()})
        return {k: v for k, v in objs.items() if v is not None}

    def capture() -> bytes:
        # the start-up rows stay those of the process that finishes the task
        state = {
            "rows": [r for r in out.rows if r["analysis"] != PROCESS],
            "analyses": [a.__dict__ for a in instances],
            "tallies": tallies.__dict__,
            "extra": ctx.extra,
        }
        return dumps_linked(state, live())

    def restore(blob: bytes) -> None:
        state = loads_linked(blob, live())
        out.rows[:] = [r for r in out.rows if r["analysis"] == PROCESS] + state["rows"]
        for a, saved in zip(instances, state["analyses"]):
            a.__dict__.update(saved)
        tallies.__dict__.update(state["tallies"])
        ctx.extra.clear()
        ctx.extra.update(state["extra"])

    ckpt.capture, ckpt.restore, ckpt.wall = capture, restore, wall
    return ckpt


def _process_start_up(task: Task, dtype: Any, out: _TaskRows) -> Any:
    """Warm the device up and load the cell's dataset (CPU). One-off start-up (per process) and
    data loading (per process and dataset) are recorded on their own rows and kept out of the
    task's wall_time."""
    warm_up(task.device, dtype)
    warm = take_warmup_time(task.device, dtype)
    if warm is not None:
        out.add(
            PROCESS,
            Row("warmup_time", warm, unit="s", note="once per process; not in wall_time"),
        )
    out.stage = f"loading dataset {_named('datasets', task.cell.data_params()[0])}"
    cpu_data, load_time = _load_data(task.cell)
    if load_time is not None:
        out.add(PROCESS, Row("data_load_time", load_time, unit="s",
                             note="once per process and dataset; not in wall_time"))  # fmt: skip
    return cpu_data


def cell_model(
    cell: Any, data: Any, device: Any, dtype: Any, seed: int,
    stage: Callable[[str], None] | None = None,
) -> tuple[Any, Any]:  # fmt: skip
    """The cell's model created on ``device``, initialised with ``seed`` and set up (solver,
    backward, runtime): (model, the cell's runtime config). ``stage`` hears what is being done
    (a task's failure names it)."""
    from ..core import deq
    from ..core.registry import inits, models

    say = stage or (lambda _: None)
    mname, mparams = cell.model_params()
    say(f"building model {_named('models', mname)}")
    model = models.create(mname, in_shape=data.in_shape, num_outputs=data.num_outputs, **mparams)
    model = model.to(device=device, dtype=dtype)
    iname, iparams = cell.init_params()
    say(f"initialising model {_named('models', mname)} with {_named('inits', iname)}")
    inits.get(iname)(model, seed=seed, **iparams)
    say(f"setting up model {_named('models', mname)}")
    if deq.is_deq(model):
        deq.configure(model, cell.solver_config(), cell.backward_config())
    runtime = cell.runtime_config()
    deq.set_runtime(model, runtime)  # every DEQ layer: compile, autocast, CUDA graphs
    return model, runtime


def _build_model(task: Task, data: Any, dtype: Any, out: _TaskRows) -> tuple[Any, str, Any]:
    """Create, initialise and set up the cell's model on the task's device; returns the model,
    its registered name and the cell's runtime config."""
    from ..core import deq
    from ..models import solver_columns

    mname, mparams = task.cell.model_params()
    model, runtime = cell_model(
        task.cell, data, task.device, dtype, task.seed, lambda text: setattr(out, "stage", text)
    )
    deq.watch_own_solves(model)  # a model that reports its own solves: each one is recorded
    own = solver_columns(mname, model, mparams)
    if own is not None:
        # a model that computes its own equilibrium: the suite's solver and backward mode do
        # not reach it; the columns say what solved it (own:<name>, from its
        # last_solve_stats() hook) or that nothing was measured ("not measured")
        out.base.update(solver=own[0], backward=own[1])
        for r in out.rows:
            r.update(solver=own[0], backward=own[1])
    return model, mname, runtime


def _train_phase(
    task: Task,
    model: Any,
    data: Any,
    ctx: CellContext,
    instances: list[Any],
    runtime: Any,
    tallies: Tallies,
    out: _TaskRows,
    listener: Listener | None,
    mname: str,
    ckpt: TaskCheckpoint | None = None,
) -> tuple[str, str]:
    """Train the model with the analyses as callbacks (unless no epoch and no analysis needs
    training) and record its step counts; returns the training's status and note."""
    from ..core import deq
    from .train import train

    cell = task.cell
    cfg = cell.train_config()
    if not (cfg.epochs > 0 or any(getattr(a, "needs_training", True) for a in instances)):
        out.add(TRAINING, Row("optimizer_steps", 0, unit="steps", note="no training (epochs 0)"))
        return "ok", ""

    def progress(epoch: int, step: int) -> None:
        if listener is not None:
            listener.epoch(task, epoch)

    out.stage = f"training model {_named('models', mname)}" + (
        f" with solver {_named('solvers', cell.solver['name'])}" if deq.is_deq(model) else ""
    )
    res = train(
        model,
        data,
        cfg,
        ctx=ctx,
        callbacks=instances,
        emit=out.emit,
        seed=task.seed,
        progress=progress,
        runtime=runtime,
        tallies=tallies,
        checkpoint=ckpt,
    )
    out.add(
        TRAINING,
        Row(
            "optimizer_steps",
            res.steps,
            unit="steps",
            note="" if res.status == "ok" else f"training stopped: {res.status}",
        ),
    )
    out.add(TRAINING, Row("steps_per_epoch", res.steps_per_epoch, unit="steps"))
    return res.status, res.note


def _add_convergence_rows(tallies: Tallies, out: _TaskRows) -> None:
    """The share of each phase's solves that missed tolerance (train, eval and probes flag the
    cell above 1%; init is reported only)."""
    for tally in tallies:
        if tally.batches:
            out.add(CONVERGENCE, Row(f"{tally.kind}_unconverged_batches", tally.share,
                                     variant=tally.phase, unit="fraction",
                                     status=FLAGGED if tally.flagged else "ok",
                                     note=tally.note() if tally.missed
                                     else rule_note(tally.stop)))  # fmt: skip


def _untrustworthy(tallies: Tallies, rows: list[dict[str, Any]]) -> list[str]:
    """Why a task that ran to the end is not trustworthy: the missed solves (one note per kind
    of solve, its phases merged, then the hints), the analyses' flagged rows, and any analysis
    measurement that failed outright (error, oom, nan: the cell's training is intact but the
    measurement missing, so never "ok")."""
    flags = tallies.flags()
    flags += [
        f"{r['analysis']}: {r['note']}"
        for r in rows
        if r["status"] == FLAGGED and r["analysis"] != CONVERGENCE
    ]
    flags += [
        f"{r['analysis']}: {r['metric']} not measured ({r['status']}"
        + (f": {r['note']})" if r["note"] else ")")
        for r in rows
        if r["status"] in ("error", "oom", "nan", "diverged") and r["analysis"] != PROCESS
    ]
    return flags


def _named(kind: str, name: str) -> str:
    """``'name'``, with the distribution of a plugin: ``'name' (plugin my-deq 0.1.0)``."""
    from ..core.registry import registry

    try:
        origin = registry(kind).origin(name)
    except Exception:  # noqa: BLE001 - an unknown name: the name alone
        origin = "built-in"
    return f"'{name}'" if origin in ("built-in", "runtime") else f"'{name}' (plugin {origin})"


def _where() -> str:
    """``host:pid`` of this process (a Dask worker's ``run_cell`` names its worker instead)."""
    import socket

    return f"{socket.gethostname()}:{os.getpid()}"
