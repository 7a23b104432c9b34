"""Time to tolerance: per solver, wall-clock and f-evaluations against the relative residual, for
the forward solve and the IFT adjoint solve, every solver on the same model and batches.

For ``batches`` equal-sized batches of the ``split`` (a seeded permutation), the model runs
forward in eval mode with its DEQ layer ``layer`` replaced for that call: each solver of
``solvers`` solves ``z = f(z, u)`` from the model's own start ``z0`` with ``tol`` = the smallest of
``tols`` and ``max_iter`` (stop mode ``rel``), every solver from the same (u, z0). The
fixed point returned with the lowest batch-max residual goes on through the rest of the model
to the loss; its gradient ``g = dL/dz*`` gives the adjoint system ``w = J^T w + g`` (J = df/dz at
that z*, the same system for every solver; start ``g`` or zeros as the cell's ``backward.b_init``
says), which each solver then solves the same way. What is measured is a solver, not the
cell's training configuration: a cell that trains with ``jfb`` or ``unrolled`` gets the adjoint
that IFT would solve.

**The time axis.** Each f-evaluation (a call of the map outside a ``torch.func`` transform) is
timestamped when it returns: ``time.perf_counter`` on the CPU, a CUDA event recorded on the
stream (no host synchronisation added) on the GPU, read after the solve. The k-th timestamp is
the wall-clock from the start of the solve to the end of f-evaluation k, solver bookkeeping
before it included; that f-evaluation measured the residual of trace row k (for every built-in
generic solver the trace has one row per f-evaluation). The solve runs on the eager path (no
CUDA graph, whatever the layer's runtime says), so the GPU times are those of an eager solve.
Timestamping costs about 1 us per f-evaluation on the CPU and a few us (one event) on CUDA. A
solver that never calls the map (monDEQ's splitting solvers apply resolvents; its steps are its
``nstep``) or replays a CUDA graph has no time axis: its ``time_to_tol`` rows are ``skipped``
with the counts in the note (its f-evaluation rows and the whole solve's time stay); a solver
whose trace rows do not match its ``nstep`` gets its ``reached`` rows skipped too. No time axis
is invented. A solver that needs a structure the model lacks (``peaceman_rachford`` on a model
without a monotone cell) gets one ``skipped`` row per pass saying so; the others run.

**Reached.** A tolerance is reached at the first f-evaluation after which the solver's own stop
rule holds: the batch max over samples of each sample's lowest relative residual so far is below
it (``returns: last``: of the current residual). This is the count a solve with that tolerance
stops at (:class:`~deqbench.solvers.base.SolverStats` ``nstep``; tests/test_time_to_tolerance.py
checks it per batch). A tolerance not reached within ``max_iter`` in every batch is recorded as
not reached, never interpolated.

Rows (``step`` 0 before training, = epochs after; variant ``<solver>-<pass>-tol=<tol>``, pass
``forward`` or ``adjoint``):

* ``reached``: the fraction of batches that reached the tolerance (the note counts them);
* where every batch reached it: ``time_to_tol_ms_median``, ``_q1``, ``_q3`` (over batches) and
  ``nfev_to_tol_median``, ``_min``, ``_max`` (f-evaluations); else both ``skipped``, with the
  number of batches that did not reach it and their solver statuses in the note;

per solver and pass (variant ``<solver>-<pass>``): ``solve_time_ms_median`` (the whole solve
call, to the smallest tolerance or the budget), ``nstep_median``, ``converged`` (fraction of
batches whose solve reached the smallest tolerance); and ``batch_size``, ``batches``,
``max_iter``, ``threads``. Series ``time_to_tolerance``: per solver, pass, batch and
f-evaluation, ``time_ms``, ``rel_max`` (batch max of the current residual) and ``rel_criterion``
(the stop rule's batch max). Figure ``time_to_tolerance.png``
(:func:`deqbench.convergence.plots.time_to_tolerance_figure`).

Example (the plain functions, without the runner):
    >>> import torch, deqbench
    >>> from deqbench.convergence.time_to_tolerance import first_reach, timed_solve
    >>> ts = timed_solve(deqbench.solvers.get("fixed_point"), lambda z: 0.5 * z + 1,
    ...                  torch.zeros(4, 8), max_iter=100, tol=1e-6)
    >>> first_reach(ts.stats, [1e-2, 1e-6]), ts.stats.nstep, len(ts.times)
    ([7, 20], 20, 20)
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field, field_validator
from torch import Tensor

from ..analyses.base import CellContext, Row
from ..core.deq import DEQLayer
from ..core.registry import analyses
from ._common import (
    ConvergenceParams,
    PhasedAnalysis,
    batches_of,
    pick_layer,
    quantile,
    replaced_forward,
    start_of,
)

SERIES = "time_to_tolerance"
PASSES = ("forward", "adjoint")
SolverSpec = str | dict[str, Any]


def _wrapped(z: Tensor) -> bool:
    """Whether ``z`` is a torch.func tensor (f called inside a solver's JVP: not an f-eval)."""
    try:
        return bool(torch._C._functorch.is_functorch_wrapped_tensor(z))
    except AttributeError:  # pragma: no cover - older torch
        return False


def _stamp(cuda: bool) -> Any:
    if cuda:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return time.perf_counter()


class TimedMap:
    """``f`` with a timestamp when each f-evaluation returns (``marks``). Attribute access falls
    through to ``f``, so a solver that reads a family's structure (``cell``, ``u``, ``g``)
    reaches it."""

    def __init__(self, f: Callable[[Tensor], Tensor], cuda: bool) -> None:
        self.f, self.cuda = f, cuda
        self.marks: list[Any] = []

    def __call__(self, z: Tensor) -> Tensor:
        out = self.f(z)
        if not _wrapped(z):
            self.marks.append(_stamp(self.cuda))
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["f"], name)


@dataclass
class TimedSolve:
    """One solve with a timestamp per f-evaluation.

    Attributes:
        stats: the solver's SolverStats.
        times: seconds from the start of the solve to the end of each f-evaluation (one per
            call of the map outside a torch.func transform).
        total: seconds of the whole solve call.
        z: the returned iterate.
        lowest: whether the solver returns (and stops on) the per-sample lowest residual.
    """

    stats: Any
    times: list[float]
    total: float
    z: Tensor
    lowest: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def counted(self) -> bool:
        """Whether the trace has one row per f-evaluation (f-evaluations to a tolerance)."""
        return int(self.stats.rel_trace.shape[0]) == int(self.stats.nstep)

    @property
    def aligned(self) -> bool:
        """Whether trace rows, f-evaluations and timestamps correspond one to one (times to a
        tolerance). Not so for a structured solver that never calls the map (monDEQ
        splitting: its steps are resolvent applications) or a replayed CUDA graph."""
        return self.counted and len(self.times) == int(self.stats.nstep)


def timed_solve(
    solve: Callable[..., Any],
    f: Callable[[Tensor], Tensor],
    z0: Tensor,
    *,
    max_iter: int,
    tol: float,
    options: dict[str, Any] | None = None,
) -> TimedSolve:
    """``solve(f, z0, max_iter=, tol=, stop_mode="rel", **options)`` with every f-evaluation
    timestamped (see the module docstring). A solver that declares ``check_returned`` (the
    TorchDEQ adapters) runs with it off, so no uncounted check is timed."""
    from ..performance.measure import solver_options_declared

    opts = dict(options or {})
    if "check_returned" in (solver_options_declared(solve) or set()):
        opts.setdefault("check_returned", False)
    cuda = z0.device.type == "cuda"
    tm = TimedMap(f, cuda)
    if cuda:
        torch.cuda.synchronize(z0.device)
    start = _stamp(cuda)
    with torch.no_grad():
        z, stats = solve(tm, z0.clone(), max_iter=max_iter, tol=tol, stop_mode="rel", **opts)
    end = _stamp(cuda)
    if cuda:
        end.synchronize()
        times = [start.elapsed_time(e) / 1e3 for e in tm.marks]
        total = start.elapsed_time(end) / 1e3
    else:
        times = [m - start for m in tm.marks]
        total = end - start
    return TimedSolve(stats, times, total, z, opts.get("returns", "lowest") == "lowest")


def criterion(stats: Any, lowest: bool = True) -> np.ndarray:
    """Per trace row, the value the solvers' stop rule compares with tol: the batch max of each
    sample's lowest relative residual so far (``lowest``), else of the current one."""
    rel = stats.rel_trace.detach().double().cpu().numpy()
    if rel.shape[0] == 0:
        return np.zeros(0)
    if lowest:
        rel = np.fmin.accumulate(rel, axis=0)  # NaN never becomes the lowest, as in the Tracker
    return rel.max(axis=1)  # a NaN sample keeps the batch above every tol


def first_reach(stats: Any, tols: Sequence[float], lowest: bool = True) -> list[int | None]:
    """f-evaluations until the stop rule first held for each of ``tols`` (None: never in this
    solve). Needs a trace with one row per f-evaluation (None everywhere otherwise)."""
    crit = criterion(stats, lowest)
    if crit.shape[0] != int(stats.nstep):
        return [None] * len(tols)
    out: list[int | None] = []
    for tol in tols:
        hit = np.nonzero(crit < tol)[0]
        out.append(int(hit[0]) + 1 if hit.size else None)
    return out


def solver_entry(spec: SolverSpec) -> tuple[str, str, dict[str, Any]]:
    """(label, registered name, options) of a ``solvers`` entry: a name or {name, label?, **opts}."""
    from ..performance.solver_overhead import solver_entry as entry

    return entry(spec)


@dataclass
class BatchSolves:
    """The solves of one batch: ``(label, pass) -> TimedSolve``; ``unavailable``: label -> why
    the solver cannot solve this model (a structured solver on a model without the structure)."""

    solves: dict[tuple[str, str], TimedSolve] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)

    def run(self, label: str, kind: str, solve: Callable[[], TimedSolve]) -> TimedSolve | None:
        """``solve()`` as (label, kind), or None when the solver needs a structure the model
        lacks (a ConfigError that is not an option error: the reason is kept; an unknown or
        bad option still stops the task)."""
        from ..core.errors import ConfigError
        from ..solvers.base import SolverOptionError

        if label in self.unavailable:
            return None
        try:
            ts = self.solves[(label, kind)] = solve()
        except SolverOptionError:
            raise
        except ConfigError as exc:
            self.unavailable[label] = " ".join(str(exc).split())
            return None
        return ts


def solve_batch(
    model: torch.nn.Module,
    layer: DEQLayer,
    x: Tensor,
    y: Tensor,
    *,
    solvers: Sequence[SolverSpec],
    tol: float,
    max_iter: int,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    passes: Sequence[str] = PASSES,
) -> BatchSolves:
    """Every solver on one batch, forward and adjoint (see the module docstring). The model is
    run as it is (put it in eval mode first)."""
    from .. import solvers as registry
    from ..core.backward import AdjointMap
    from ..core.runtime import autocast, for_loss

    specs = [solver_entry(s) for s in solvers]
    kw: dict[str, Any] = {"max_iter": max_iter, "tol": tol}
    out = BatchSolves()
    box: dict[str, Tensor] = {}

    def hook(u: Tensor, z0: Tensor | None = None) -> Tensor:
        if "z" in box:  # the layer called again in the same forward: as it is
            return DEQLayer.forward(layer, u, z0)
        u, z0 = start_of(layer, u, z0)
        best, best_res = None, math.inf
        with torch.no_grad(), torch.autocast(device_type=u.device.type, enabled=False):
            f = layer.cell_map(u)
            for label, name, opts in specs:
                fn = registry.get(name)
                ts = out.run(label, "forward", partial(timed_solve, fn, f, z0, **kw, options=opts))
                if ts is None:
                    continue
                res = ts.stats.rel_max
                if best is None or (math.isfinite(res) and res < best_res):
                    best, best_res = ts.z, res
        if best is None:
            raise RuntimeError("no solver of the list can solve this model: "
                               + "; ".join(out.unavailable.values()))  # fmt: skip
        box["u"], box["z"] = u.detach(), best.detach().clone().requires_grad_(True)
        return box["z"]

    rt = layer.runtime
    with replaced_forward(layer, hook), torch.enable_grad():
        with autocast(rt, x.device):
            output = model(x)
        if "z" not in box:
            raise RuntimeError("the model's forward did not call its DEQ layer")
        loss = loss_fn(for_loss(output, rt), y) if "adjoint" in passes else None
    if loss is None:
        return out
    (g,) = torch.autograd.grad(loss, box["z"])
    u, z = box["u"], box["z"].detach()
    with torch.enable_grad():
        z_ = z.clone().requires_grad_(True)
        fz = layer.f(z_, u).to(z_.dtype)
    gd = g.detach()

    def adj_fn(w: Tensor) -> Tensor:
        return torch.autograd.grad(fz, z_, w, retain_graph=True)[0] + gd

    amap = AdjointMap(adj_fn, layer.cell, z, u, gd)
    w0 = gd.clone() if layer.backward_cfg.b_init == "grad" else torch.zeros_like(gd)
    with torch.autocast(device_type=z.device.type, enabled=False):
        for label, name, opts in specs:
            fn = registry.get(name)
            out.run(label, "adjoint", partial(timed_solve, fn, amap, w0, **kw, options=opts))
    return out


def _label(spec: SolverSpec) -> str:
    return solver_entry(spec)[0]


def _whole(d: Any, name: str, kind: str) -> str:
    """``name (whole solve T ms)`` where every batch's solve converged to the smallest tol."""
    w = d[d["variant"] == f"{name}-{kind}"].set_index("metric")["value"]
    if w.get("converged") == 1.0:
        return f"{name} (whole solve {w.get('solve_time_ms_median'):.3g} ms)"
    return name


@analyses.register("time_to_tolerance")
class TimeToTolerance(PhasedAnalysis):
    """Per solver, wall-clock and f-evaluations to each relative-residual tolerance, forward and
    adjoint, on the same model and batches (median and spread over batches)."""

    name = "time_to_tolerance"
    version = "1"
    metric = "time_to_tol_ms_median"
    example = {"params": {"batches": 2, "batch_size": 16, "tols": [1e-2, 1e-4], "max_iter": 40}}

    class Params(ConvergenceParams):
        solvers: list[SolverSpec] = Field(
            default_factory=lambda: list[SolverSpec](["fixed_point", "anderson", "broyden"]),
            min_length=1,
            description="registered solver names or {name, label, **options}; each solves "
            "forward and adjoint from the same start",
        )
        tols: list[float] = Field(
            default_factory=lambda: [1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6],
            min_length=1,
            description="relative-residual levels; the solves run to the smallest",
        )
        max_iter: int = Field(100, ge=1, description="f-evaluation budget of every solve")
        batch_size: int | None = Field(
            None, ge=1, description="samples per batch (null: train.batch_size)"
        )
        batches: int = Field(4, ge=1, description="batches measured (the spread is over them)")
        warmup: int = Field(1, ge=0, description="untimed passes over the first batch first")
        passes: list[Literal["forward", "adjoint"]] = Field(
            default_factory=lambda: list[Literal["forward", "adjoint"]](["forward", "adjoint"]),
            min_length=1,
            description="the solves measured: forward z = f(z, u), IFT adjoint w = J^T w + g",
        )
        threads: int | None = Field(
            None, ge=1, description="torch threads while measuring (null: the suite's)"
        )
        tf32: bool = Field(False, description="TF32 matmul/cuDNN while measuring")

        @field_validator("solvers")
        @classmethod
        def _registered(cls, v: list[SolverSpec]) -> list[SolverSpec]:
            from ..core.registry import solvers as registry

            labels = []
            for spec in v:
                if isinstance(spec, dict) and "name" not in spec:
                    raise ValueError(f"{spec}: an entry needs name (name, label?, **options)")
                label, name, _ = solver_entry(spec)
                if name not in registry:
                    raise ValueError(str(registry.unknown(name)))
                labels.append(label)
            dup = sorted({lab for lab in labels if labels.count(lab) > 1})
            if dup:
                raise ValueError(f"solver label {dup[0]!r} twice: give each entry its own label")
            return v

        @field_validator("tols")
        @classmethod
        def _positive(cls, v: list[float]) -> list[float]:
            if any(not (t > 0) for t in v):
                raise ValueError("tolerances must be > 0")
            return sorted(set(v), reverse=True)

    params: Params  # narrowed for type checkers

    def _measure(self, ctx: CellContext, step: int):
        from ..core.evaluation import loss_function
        from ..performance._perf import measuring, preserved
        from ..performance.measure import flag_rows

        p = self.params
        layer, why = pick_layer(ctx.model, p.layer)
        if layer is None:
            yield Row.skipped(self.metric, why, step=step)
            return
        bs = p.batch_size or int((ctx.cell.get("train") or {}).get("batch_size", 64))
        data, note = batches_of(ctx, p.split, bs, p.batches)
        if not data:
            yield Row.skipped(self.metric, f"no batch: {note}", step=step)
            return
        loss_fn = ctx.loss_fn or loss_function(ctx.task)
        tol = min(p.tols)
        runs: list[BatchSolves] = []
        batch = partial(solve_batch, ctx.model, layer, solvers=p.solvers, tol=tol,
                        max_iter=p.max_iter, loss_fn=loss_fn, passes=p.passes)  # fmt: skip
        with preserved(ctx.model), measuring(p):  # type: ignore[arg-type]
            ctx.model.eval()
            for _ in range(p.warmup):
                batch(*data[0])
            for x, y in data:
                runs.append(batch(x, y))
            flags = flag_rows(ctx.device, step=step)
        self._write_series(ctx, step, runs)
        for spec in p.solvers:
            label = _label(spec)
            for kind in p.passes:
                unavailable = runs[0].unavailable.get(label)
                if unavailable is not None:
                    yield Row.skipped("solve_time_ms_median", unavailable,
                                      variant=f"{label}-{kind}", step=step)  # fmt: skip
                    continue
                yield from self._rows([r.solves[(label, kind)] for r in runs], label, kind, step)
        yield Row("batch_size", len(data[0][0]), step=step, unit="samples", note=note)
        yield Row("batches", len(data), step=step)
        clock = "CUDA events" if ctx.device.type == "cuda" else "perf_counter"
        yield Row("max_iter", p.max_iter, step=step, unit="f-evals",
                  note=f"eager solves, stop mode rel, timestamps by {clock}")  # fmt: skip
        yield from flags

    def _rows(self, solves: list[TimedSolve], label: str, kind: str, step: int):
        p = self.params
        n = len(solves)
        v = f"{label}-{kind}"
        reach = [first_reach(s.stats, p.tols, s.lowest) for s in solves]
        uncounted = next((s for s in solves if not s.counted), None)
        untimed = next((s for s in solves if not s.aligned), None)
        for i, tol in enumerate(p.tols):
            vt = f"{v}-tol={tol:g}"
            hits = [r[i] for r in reach]
            k = sum(h is not None for h in hits)
            if uncounted is not None:
                why = (f"the solver's trace has {uncounted.stats.rel_trace.shape[0]} rows for "
                       f"nstep={uncounted.stats.nstep}: no step count per tolerance")  # fmt: skip
                yield Row.skipped("reached", why, variant=vt, step=step)
                continue
            yield Row("reached", k / n, variant=vt, step=step, unit="fraction",
                      note=f"{k} of {n} batches")  # fmt: skip
            if k < n:
                statuses = sorted({s.stats.status for s, h in zip(solves, hits) if h is None})
                why = (
                    f"not reached by {n - k} of {n} batches within max_iter={p.max_iter} "
                    f"(solver status {', '.join(statuses)})"
                )
                yield Row.skipped("nfev_to_tol_median", why, variant=vt, step=step)
                yield Row.skipped("time_to_tol_ms_median", why, variant=vt, step=step)
                continue
            nf = [float(h) for h in hits if h is not None]
            yield Row("nfev_to_tol_median", statistics.median(nf), variant=vt, step=step,
                      unit="f-evals")  # fmt: skip
            yield Row("nfev_to_tol_min", min(nf), variant=vt, step=step, unit="f-evals")
            yield Row("nfev_to_tol_max", max(nf), variant=vt, step=step, unit="f-evals")
            if untimed is not None:
                why = (f"no time axis: {len(untimed.times)} timed calls of the map for "
                       f"nstep={untimed.stats.nstep} (a structured solver that does not call "
                       "it, or a replayed CUDA graph); see solve_time_ms_median")  # fmt: skip
                yield Row.skipped("time_to_tol_ms_median", why, variant=vt, step=step)
                continue
            tm = [s.times[int(h) - 1] * 1e3 for s, h in zip(solves, hits) if h is not None]
            for m, val in (("median", statistics.median(tm)), ("q1", quantile(tm, 0.25)),
                           ("q3", quantile(tm, 0.75))):  # fmt: skip
                yield Row(f"time_to_tol_ms_{m}", val, variant=vt, step=step, unit="ms")
        statuses = sorted({s.stats.status for s in solves})
        yield Row("solve_time_ms_median", statistics.median(s.total * 1e3 for s in solves),
                  variant=v, step=step, unit="ms", note=f"solver status {', '.join(statuses)}")  # fmt: skip
        yield Row("nstep_median", statistics.median(float(s.stats.nstep) for s in solves),
                  variant=v, step=step, unit="f-evals")  # fmt: skip
        conv = sum(bool(s.stats.converged) for s in solves)
        yield Row("converged", conv / n, variant=v, step=step, unit="fraction",
                  note=f"{conv} of {n} batches reached tol {min(p.tols):g}")  # fmt: skip

    def _write_series(self, ctx: CellContext, step: int, runs: list[BatchSolves]) -> None:
        import pandas as pd

        for b, run in enumerate(runs):
            for (label, kind), s in run.solves.items():
                rel = s.stats.rel_trace.detach().double().cpu().numpy()
                T = rel.shape[0]
                times = s.times[:T] if s.aligned else [math.nan] * T
                self._series.append(
                    pd.DataFrame(
                        {
                            "step": step,
                            "solver": label,
                            "pass": kind,
                            "batch": b,
                            "fev": np.arange(1, T + 1),
                            "time_ms": np.asarray(times, dtype=float) * 1e3,
                            "rel_max": rel.max(axis=1) if T else [],
                            "rel_criterion": criterion(s.stats, s.lowest),
                        }
                    )
                )
        if self._series:
            ctx.write_series(SERIES, pd.concat(self._series, ignore_index=True))

    @classmethod
    def plot(cls, df: Any, run_dir: Any) -> dict[str, Any]:
        from .plots import time_to_tolerance_figure

        fig = time_to_tolerance_figure(df, run_dir)
        return {} if fig is None else {"time_to_tolerance": fig}

    @classmethod
    def headline(cls, rows: Any) -> list[str]:
        """Per pass, at the smallest tolerance some solver reached in every batch (with a time
        axis): the solvers by median time, then those that did not reach it, had no time axis
        or could not solve the model."""
        d = rows[rows["step"] == rows["step"].max()]
        d = d.assign(variant=d["variant"].fillna("").astype(str))
        lines = []
        for kind in PASSES:
            sep = f"-{kind}-tol="
            t = d[(d["metric"] == "time_to_tol_ms_median") & (d["status"] == "ok")
                  & d["variant"].str.contains(sep, regex=False)]  # fmt: skip
            if t.empty:
                continue
            t = t.assign(solver=t["variant"].str.split(sep).str[0],
                         tol=t["variant"].str.split(sep).str[1].astype(float))  # fmt: skip
            tol = float(t["tol"].min())
            at = t[t["tol"] == tol].sort_values("value")
            text = ", ".join(f"{s} {v:.3g} ms" for s, v in zip(at["solver"], at["value"]))
            reached = d[(d["metric"] == "reached") & (d["variant"].str.endswith(f"{sep}{tol:g}"))]
            others = {
                str(v).split(sep)[0]: val for v, val in zip(reached["variant"], reached["value"])
            }
            missed = [s for s, val in others.items() if not val == 1.0]
            untimed = [s for s, val in others.items() if val == 1.0 and s not in set(at["solver"])]
            na = [str(v).rsplit("-", 1)[0] for v, st in zip(d["variant"], d["status"])
                  if v.endswith(f"-{kind}") and st == "skipped"]  # fmt: skip
            grid = d.loc[d["metric"] == "reached", "variant"].str.split("-tol=").str[1]
            smallest = float(grid.astype(float).min())

            if tol == smallest:  # the whole solve stopped there: its time is the time to it
                untimed = [_whole(d, s, kind) for s in untimed]
            for what, names in (("not reached", missed), ("no time axis", untimed),
                                ("not applicable", na)):  # fmt: skip
                if names:
                    text += f"; {what}: {', '.join(names)}"
            lines.append(f"{kind} to rel {tol:g} (median over batches): {text}")
        return lines
