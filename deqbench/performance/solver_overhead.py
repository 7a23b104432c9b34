"""Solver overhead: time to tolerance, f-evaluations, t_f and overhead per solver and tolerance.

For the cell's DEQ layer and one seeded batch (u = inject(x) in eval mode, z0 = model.z0(u)),
every solver in ``solvers`` (built-in or registered by a plugin, e.g. ``torchdeq_anderson``)
solves z = f(z, u) to every tolerance in ``tols``, on the same batch with the same budget.
Rows (variant ``<solver label>-tol=<tol>``; ``step`` 0 = before training, = epochs after):

* ``time_ms`` per timed repeat + ``time_ms_median`` / ``_iqr`` / ``_spread`` (flagged > 10%);
* ``f_evals`` per repeat, counted by wrapping f (the same count for every solver, deqbench's
  or a plugin's), in the same repeat as its time;
* ``t_f_ms``: per-call time of f in a plain no-grad loop z <- f(z) at this batch (what a solver
  with free bookkeeping pays per f-evaluation); ``overhead`` = time / (f-evals x t_f) per
  repeat and ``overhead_median``; on the CPU also thread CPU times;
* ``rel_residual`` / ``abs_residual`` (batch max) and ``rel_residual_mean`` of the returned
  iterate, recomputed here with one uncounted, untimed evaluation for every solver alike;
  ``converged`` (1 if ``rel_residual`` < tol) and the solver's own ``status`` in the note;
* ``peak_memory`` (MiB) of one solve in its own pass (GPU; CPU only with ``memory_cpu``).

The plain functions are in :mod:`deqbench.performance.measure` (:func:`~deqbench.performance.measure.solver_time_to_tol`,
:func:`~deqbench.performance.measure.f_time`); :func:`solver_overhead_table` runs the grid on any f.

Example:
    >>> import torch
    >>> from deqbench.performance.solver_overhead import solver_overhead_table
    >>> df = solver_overhead_table(lambda z: 0.5 * torch.tanh(z) + 1, torch.zeros(8, 16),
    ...                            solvers=["fixed_point", "anderson"], tols=[1e-4], repeats=2)
    >>> sorted(df["solver"]), bool((df["rel_residual"] < 1e-4).all())
    (['anderson', 'fixed_point'], True)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from pydantic import Field, field_validator
from torch import Tensor

from ..analyses.base import CellContext, Row
from ..core.deq import CellMap, deq_layers
from ..core.registry import analyses
from ._perf import (
    PerfAnalysis,
    PerfParams,
    batch_size,
    measuring,
    phase_step,
    pick_batch,
    preserved,
)
from .measure import Memory, f_time, flag_rows, peak_memory, solver_time_to_tol

SolverSpec = str | dict[str, Any]


def solver_entry(spec: SolverSpec) -> tuple[str, str, dict[str, Any]]:
    """(label, registered name, options) of a ``solvers`` entry: a name, or ``{name, label?,
    **options}``."""
    if isinstance(spec, str):
        return spec, spec, {}
    d = dict(spec)
    name = d.pop("name")
    label = d.pop("label", None) or name
    return str(label), str(name), d


class SolveStep:
    """One no-grad solve of ``cell(z, u)`` from z0 with a registered solver (picklable, for
    peak memory in its own pass)."""

    def __init__(
        self,
        solver: str,
        cell: torch.nn.Module,
        u: Tensor,
        z0: Tensor,
        max_iter: int,
        tol: float,
        stop_mode: str,
        options: dict[str, Any],
    ) -> None:
        self.solver, self.cell, self.u, self.z0 = solver, cell, u, z0
        self.kw = {"max_iter": max_iter, "tol": tol, "stop_mode": stop_mode, **options}

    def __call__(self) -> Any:
        from .. import solvers
        from .measure import solver_options_declared

        fn = solvers.get(self.solver)
        kw = dict(self.kw)
        if "check_returned" in (solver_options_declared(fn) or set()):
            kw.setdefault("check_returned", False)
        with torch.no_grad():
            return fn(CellMap(self.cell, self.u), self.z0, **kw)


def solver_overhead_table(
    f: Callable[[Tensor], Tensor],
    z0: Tensor,
    *,
    solvers: Sequence[SolverSpec] = ("fixed_point", "anderson", "broyden"),
    tols: Sequence[float] = (1e-4, 1e-6),
    max_iter: int = 100,
    stop_mode: str = "rel",
    repeats: int = 5,
    warmup: int = 2,
    f_repeats: int = 5,
    f_loop: int = 10,
) -> Any:
    """Time to tolerance of every solver x tolerance on ``f`` from ``z0`` (no memory).

    Returns a DataFrame, one row per (solver, tol): solver, name, tol, time_ms (median), iqr_ms,
    spread, f_evals (median), t_f_ms, overhead, rel_residual, abs_residual, status, times_ms (all
    repeats)."""
    import pandas as pd

    from .. import solvers as registry

    t_f = f_time(f, z0, repeats=f_repeats, loop=f_loop).median
    out = []
    for spec in solvers:
        label, name, opts = solver_entry(spec)
        for tol in tols:
            st = solver_time_to_tol(
                registry.get(name),
                f,
                z0,
                max_iter=max_iter,
                tol=tol,
                stop_mode=stop_mode,
                options=opts,
                repeats=repeats,
                warmup=warmup,
                t_f=t_f,
            )
            t = st.timing
            out.append(
                {
                    "solver": label,
                    "name": name,
                    "tol": tol,
                    "time_ms": t.median * 1e3,
                    "iqr_ms": t.iqr * 1e3,
                    "spread": t.spread,
                    "f_evals": float(sorted(st.nfe)[len(st.nfe) // 2]),
                    "t_f_ms": t_f * 1e3,
                    "overhead": st.overhead,
                    "rel_residual": st.rel_residual,
                    "abs_residual": st.abs_residual,
                    "status": st.stats.status,
                    "times_ms": [x * 1e3 for x in t.times],
                }
            )
    return pd.DataFrame(out)


@analyses.register("solver_overhead")
class SolverOverhead(PerfAnalysis):
    """Time to tolerance and overhead of each solver on the cell's DEQ (see module docstring)."""

    judges_own_solves = True  # see Analysis.judges_own_solves
    name = "solver_overhead"
    version = "1"
    needs_training = False

    class Params(PerfParams):
        #: registered solver names or {name, label, **options}
        solvers: list[SolverSpec] = Field(
            default_factory=lambda: list[SolverSpec](["fixed_point", "anderson", "broyden"]),
            min_length=1,
        )
        tols: list[float] = Field(default_factory=lambda: [1e-4, 1e-6], min_length=1)
        max_iter: int = Field(100, ge=1)
        stop_mode: str = Field("rel", pattern="^(rel|abs)$")
        #: t_f: repeats of a plain no-grad loop of f_loop calls z <- f(z) (per-call median)
        f_repeats: int = Field(5, ge=1)
        f_loop: int = Field(10, ge=1)
        #: a worker process per solver x tol is slow on CPU: off by default there
        memory_cpu: bool = False

        @field_validator("solvers")
        @classmethod
        def _registered(cls, v: list[SolverSpec]) -> list[SolverSpec]:
            """Solver names are checked with the suite, before anything runs."""
            from ..core.registry import solvers as registry

            for spec in v:
                if isinstance(spec, dict) and "name" not in spec:
                    raise ValueError(f"{spec}: an entry needs name (name, label?, **options)")
                name = solver_entry(spec)[1]
                if name not in registry:
                    raise ValueError(str(registry.unknown(name)))
            return v

    params: Params  # narrowed for type checkers

    def _measure(self, ctx: CellContext, phase: str):
        from .. import solvers as registry

        p = self.params
        step = phase_step(ctx, phase)
        layers = list(deq_layers(ctx.model))
        if len(layers) != 1:
            yield Row(
                "time_ms_median",
                math.nan,
                step=step,
                status="skipped",
                note=f"solver_overhead needs exactly one DEQ layer, the model has {len(layers)}",
            )
            return
        layer = layers[0]
        bs = batch_size(p, ctx)
        x, _, note = pick_batch(ctx, bs, p.split)
        with preserved(ctx.model), measuring(p):
            ctx.model.eval()
            with torch.no_grad():
                u = ctx.model.inject(x)
                z0 = ctx.model.z0(u) if hasattr(ctx.model, "z0") else torch.zeros_like(u)
            f = CellMap(layer.cell, u)
            tf = f_time(f, z0, repeats=p.f_repeats, warmup=p.warmup, loop=p.f_loop)
            yield from tf.rows("t_f_ms", step=step)
            for spec in p.solvers:
                label, name, opts = solver_entry(spec)
                origin = registry.origin(name)
                for tol in p.tols:
                    v = f"{label}-tol={tol:g}"
                    try:
                        st = solver_time_to_tol(
                            registry.get(name),
                            f,
                            z0,
                            max_iter=p.max_iter,
                            tol=tol,
                            stop_mode=p.stop_mode,
                            options=opts,
                            repeats=p.repeats,
                            warmup=p.warmup,
                            t_f=tf.median,
                        )
                    except torch.cuda.OutOfMemoryError as exc:
                        torch.cuda.empty_cache()
                        yield Row(
                            "time_ms_median",
                            math.nan,
                            variant=v,
                            step=step,
                            status="oom",
                            note=str(exc).splitlines()[0],
                        )
                        continue
                    yield from st.timing.rows("time_ms", variant=v, step=step)
                    for i, n in enumerate(st.nfe):
                        yield Row("f_evals", n, variant=v, step=step, repeat=i, unit="f-evals")
                    for i, o in enumerate(st.overheads):
                        yield Row("overhead", o, variant=v, step=step, repeat=i, unit="x")
                    yield Row(
                        "overhead_median",
                        st.overhead,
                        variant=v,
                        step=step,
                        unit="x",
                        note=f"t_f {tf.median * 1e3:.4g} ms; {origin}",
                    )
                    yield Row("rel_residual", st.rel_residual, variant=v, step=step)
                    yield Row("abs_residual", st.abs_residual, variant=v, step=step)
                    yield Row("rel_residual_mean", st.rel_residual_mean, variant=v, step=step)
                    yield Row(
                        "converged",
                        float(
                            st.rel_residual < tol if p.stop_mode == "rel" else st.abs_residual < tol
                        ),
                        variant=v,
                        step=step,
                        note=f"solver status {st.stats.status}",
                    )
                    if p.memory:
                        mem = self._memory(name, layer.cell, u, z0, tol, opts, ctx.device)
                        yield mem.row("peak_memory", variant=v, step=step)
            yield Row("batch_size", bs, step=step, unit="samples", note=note)
            yield from flag_rows(ctx.device, step=step)

    def _memory(
        self,
        name: str,
        cell: Any,
        u: Tensor,
        z0: Tensor,
        tol: float,
        opts: dict[str, Any],
        device: Any,
    ) -> Memory:
        p = self.params
        step = SolveStep(name, cell, u, z0, p.max_iter, tol, p.stop_mode, opts)
        try:
            return peak_memory(step, device, cpu=p.memory_cpu)
        except torch.cuda.OutOfMemoryError as exc:
            torch.cuda.empty_cache()
            return Memory(math.nan, note=f"oom: {str(exc).splitlines()[0]}")

    @classmethod
    def plot(cls, df: Any, run_dir: Any) -> dict[str, Any]:
        """The figures (``deqbench.plots``)."""
        return _perf_plots._solver_overhead_plots(df, run_dir)


from . import plots as _perf_plots  # noqa: E402  (the figures of SolverOverhead.plot)
