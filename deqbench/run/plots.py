"""Plots: functions DataFrame -> matplotlib ``Figure`` (no pyplot; Agg canvas), and a registry.

Built-in figures: forward/backward iterations per epoch (``solver_iterations``), residual traces
(``residual_traces``, from ``series/solver_trace__*.csv``) and training curves
(``training_curves``). ``deqbench run`` writes every registered plot into the run's ``plots/``;
``deqbench plot RUN_DIR`` regenerates them.

Style for many cells (shared helpers for every figure): :func:`cell_groups` splits the cells into
rows of panels (one row up to :data:`GROUP_ABOVE` cells, else one per model with several cells
plus "other models"); :func:`cell_styles` gives each cell of a row a unique (colour, line style)
from a categorical palette (colour = solver, line style = backward mode where that identifies
the cells); :func:`group_legend` puts the row's legend right of its panels with labels that
drop the id parts all the row's cells share (written in the legend title, never truncated) and
end in ``[flagged]`` (or the cell's other non-ok status, :func:`cell_tags`) in red;
:func:`notes_legend` explains the marks below the panels; :func:`unhide_duplicates` widens
identical lines drawn underneath; :data:`UNCONVERGED` (x) marks a point whose solves missed
tolerance.

Analyses declare their figures (``Analysis.plot``, registered here under the analysis's name
when a run's plots are drawn); other figures register with the decorator. Either gets the
results DataFrame and the run directory and returns named figures (an empty dict when it has
nothing to draw). The public face of this module is :mod:`deqbench.plots`::

    from deqbench import plots

    @plots.register("landscape")
    def landscape_plots(df, run_dir):
        fig = plots.new_figure()
        ...
        return {"landscape": fig}

Example:
    >>> import deqbench
    >>> from deqbench.run.plots import iterations_per_epoch, save_figure
    >>> fig = iterations_per_epoch(deqbench.load_results("results/smoke/<run_id>"))  # doctest: +SKIP
    >>> save_figure(fig, "iterations.png")                                        # doctest: +SKIP

**Where it lives.** This module holds the plot registry, the drawing of a run's plots
(:func:`write_plots`) and the process pool that draws them side by side (:class:`PlotPool`); it
re-exports the style (:mod:`.plot_style`) and the run report's figures (:mod:`.run_figures`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .plot_style import (
    FLAG_COLOR,
    GROUP_ABOVE,
    LEGEND_ROWS,
    LINESTYLES,
    MARKERS,
    PALETTE,
    UNCONVERGED,
    CellGroup,
    cell_colors,
    cell_groups,
    cell_meta,
    cell_styles,
    cell_tags,
    flagged_cells,
    group_legend,
    legend,
    legend_ncols,
    lines,
    new_figure,
    new_grid,
    notes_legend,
    row_height,
    save_figure,
    shared_parts,
    short_labels,
    tag_notes,
    unhide_duplicates,
)
from .run_figures import (
    iterations_per_epoch,
    read_series,
    residual_traces,
    training_curves,
)

__all__ = [
    "CellGroup",
    "FLAG_COLOR",
    "GROUP_ABOVE",
    "LEGEND_ROWS",
    "LINESTYLES",
    "MARKERS",
    "PALETTE",
    "PLOT_PROCESSES_ENV",
    "PlotFn",
    "PlotPool",
    "UNCONVERGED",
    "cell_colors",
    "cell_groups",
    "cell_meta",
    "cell_styles",
    "cell_tags",
    "flagged_cells",
    "get",
    "group_legend",
    "iterations_per_epoch",
    "legend",
    "legend_ncols",
    "lines",
    "names",
    "new_figure",
    "new_grid",
    "notes_legend",
    "plot_processes",
    "read_series",
    "register",
    "residual_traces",
    "row_height",
    "save_figure",
    "shared_parts",
    "short_labels",
    "tag_notes",
    "training_curves",
    "unhide_duplicates",
    "write_plots",
]

PlotFn = Callable[[Any, Path], dict[str, Any]]
_REGISTRY: dict[str, PlotFn] = {}


def register(name: str) -> Callable[[PlotFn], PlotFn]:
    """Register ``fn(results_df, run_dir) -> {figure_name: Figure}`` under ``name``."""

    def deco(fn: PlotFn) -> PlotFn:
        _REGISTRY[name] = fn
        return fn

    return deco


def names() -> list[str]:
    """The registered plot functions and the analyses (loaded ones) that declare figures."""
    from ..core.registry import analyses

    declared = set()
    for n in analyses.names():
        obj = analyses.entry(n).obj
        if obj is not None and callable(getattr(obj, "draws", None)) and obj.draws():
            declared.add(n)
    return sorted(set(_REGISTRY) | declared)


def get(name: str) -> PlotFn:
    if name not in _REGISTRY:
        from ..core.registry import analyses

        cls = analyses.get(name) if name in analyses else None
        if cls is not None and callable(getattr(cls, "draws", None)) and cls.draws():
            return cls.plot
    return _REGISTRY[name]


@register("solver_stats")
def _solver_plots(df: Any, run_dir: Path) -> dict[str, Any]:
    out = {}
    fig = iterations_per_epoch(df)
    if fig is not None:
        out["solver_iterations"] = fig
    fig = residual_traces(read_series(run_dir, "solver_trace"), df)
    if fig is not None:
        out["residual_traces"] = fig
    return out


@register("metrics")
def _metric_plots(df: Any, run_dir: Path) -> dict[str, Any]:
    fig = training_curves(df)
    return {"training_curves": fig} if fig is not None else {}


def _import_analyses(used: set[str], errors: list[str]) -> None:
    """Import the analyses a run used, so their modules' ``@plots.register`` functions exist,
    and register the figures each declares (``Analysis.plot``) under its name."""
    from ..core.registry import analyses

    for name in sorted(used):
        if name in analyses:
            try:
                cls = analyses.get(name)
            except Exception as exc:
                errors.append(f"plots: analysis '{name}' cannot be imported: {exc}")
                continue
            if callable(getattr(cls, "draws", None)) and cls.draws() and name not in _REGISTRY:
                _REGISTRY[name] = cls.plot


def _draw_one(name: str, df: Any, run_dir: Path, paths: list[Path], errors: list[str]) -> None:
    """Draw the figures of plot function ``name`` into ``run_dir/plots`` (one failing plot
    leaves an error line and never stops the others)."""
    try:
        figs = get(name)(df, run_dir)
        for fname, fig in figs.items():
            paths.append(save_figure(fig, run_dir / "plots" / f"{fname}.png"))
    except Exception as exc:
        errors.append(f"plot '{name}' failed: {type(exc).__name__}: {exc}")


def write_plots(
    run_dir: str | Path, df: Any = None, pool: PlotPool | None = None, meanwhile: Any = None
) -> tuple[list[Path], list[str]]:
    """Run every registered plot function on the run; save ``plots/<name>.png``.

    Returns (written paths, error lines), in the order of :func:`names` whichever process drew
    them. One failing plot does not stop the others. ``pool``: a started :class:`PlotPool`
    draws the figures in its processes (any it cannot, here); ``meanwhile``: called here while
    they draw (the runner's post-run reports).
    """
    from .results import load_results

    run_dir = Path(run_dir)
    if df is None:
        df = load_results(run_dir)
    errors: list[str] = []
    _import_analyses(set(df["analysis"]), errors)
    jobs = pool.submit(names(), df, run_dir) if pool is not None else {}
    if meanwhile is not None:
        meanwhile()
    paths: list[Path] = []
    for name in names():
        done = PlotPool.result(jobs[name]) if name in jobs else None
        if done is None:  # no pool, the pool broke, or its processes do not know this plot
            _draw_one(name, df, run_dir, paths, errors)
        else:
            pool.drawn += 1  # type: ignore[union-attr]  # jobs come from the pool
            paths += done[0]
            errors += done[1]
    return paths, errors


# -- drawing in parallel -------------------------------------------------------------------------
#: processes of a :class:`PlotPool` (``0`` draws in the coordinator, one figure after another)
PLOT_PROCESSES_ENV = "DEQBENCH_PLOT_PROCESSES"


def plot_processes(cpus: int | None = None) -> int:
    """How many processes :class:`PlotPool` starts: ``DEQBENCH_PLOT_PROCESSES`` if set, else
    up to 4 where the machine has cores to spare while cells run (a quarter of them), else 0.

    >>> plot_processes(2), plot_processes(16), plot_processes(64)  # doctest: +SKIP
    (0, 4, 4)
    """
    raw = os.environ.get(PLOT_PROCESSES_ENV, "").strip()
    if raw:
        try:
            return max(0, int(raw))
        except ValueError:
            return 0
    cpus = cpus if cpus is not None else (os.cpu_count() or 1)
    n = min(4, cpus // 4)
    return n if n >= 2 else 0


def _pool_init(analyses: list[str], modules: list[str]) -> None:
    """A :class:`PlotPool` process's start: what drawing needs, imported before any figure.
    Ctrl-C (sent to the whole process group) is the coordinator's to handle."""
    import importlib
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import matplotlib.backends.backend_agg  # noqa: F401
    import matplotlib.figure  # noqa: F401

    _import_analyses(set(analyses), [])
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - its plots are drawn by the coordinator instead
            pass


def _pool_ready() -> int:
    return os.getpid()


def _pool_draw(name: str, df: Any, run_dir: str) -> tuple[list[str], list[str]] | None:
    try:
        get(name)
    except KeyError:  # e.g. registered by a module only the coordinator imported
        return None
    paths: list[Path] = []
    errors: list[str] = []
    _draw_one(name, df, Path(run_dir), paths, errors)
    return [str(p) for p in paths], errors


class PlotPool:
    """Processes that draw a run's figures side by side at its end (matplotlib holds the GIL
    while it renders: threads would draw one after another). Started while the cells run
    elsewhere (a remote executor), so that their imports are paid before the last result;
    :func:`write_plots` hands each plot function to one of them and collects the figures in
    :func:`names` order. A plot function they do not know (registered by a module only the
    coordinator imported) or a pool that broke is drawn by the coordinator instead, so the
    figures and error lines are the same as without a pool.
    """

    def __init__(self, analyses: Any, processes: int, modules: Sequence[str] = ()) -> None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        self.processes = processes
        #: plot functions whose figures its processes drew (the rest: the coordinator)
        self.drawn = 0
        self._ex = ProcessPoolExecutor(
            processes,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_pool_init,
            initargs=(sorted(analyses), list(modules)),
        )
        # one job per process now: the pool spawns its processes on demand
        self._ready = [self._ex.submit(_pool_ready) for _ in range(processes)]

    def submit(self, plot_names: list[str], df: Any, run_dir: Path) -> dict[str, Any]:
        try:
            return {n: self._ex.submit(_pool_draw, n, df, str(run_dir)) for n in plot_names}
        except Exception:  # noqa: BLE001 - a broken pool: the coordinator draws
            return {}

    @staticmethod
    def result(job: Any) -> tuple[list[Path], list[str]] | None:
        try:
            done = job.result()
        except Exception:  # noqa: BLE001 - the process died or the job did not pickle
            return None
        if done is None:
            return None
        return [Path(p) for p in done[0]], list(done[1])

    def pids(self) -> set[int]:
        """The processes' ids, once the first has started (for tests)."""
        for f in self._ready:
            f.result()
        return set(getattr(self._ex, "_processes", None) or {})

    def close(self) -> None:
        """Stop the processes now (a figure still being drawn after an interrupt included)."""
        procs = list((getattr(self._ex, "_processes", None) or {}).values())
        self._ex.shutdown(wait=False, cancel_futures=True)
        for proc in procs:
            try:
                proc.terminate()
            except Exception:  # noqa: BLE001 - already gone
                pass
