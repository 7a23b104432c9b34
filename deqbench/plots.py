"""Plots: functions DataFrame -> matplotlib ``Figure`` (no pyplot; Agg canvas), and a registry.

Built-in figures: forward/backward iterations per epoch (``solver_iterations``), residual traces
(``residual_traces``, from ``series/solver_trace__*.csv``) and training curves
(``training_curves``). ``deqbench run`` writes every registered plot into the run's ``plots/``;
``deqbench plot RUN_DIR`` regenerates them.

Analyses add their own with the decorator; the function gets the results DataFrame and the run
directory and returns named figures (an empty dict when it has nothing to draw)::

    from deqbench import plots

    @plots.register("landscape")
    def landscape_plots(df, run_dir):
        fig = plots.new_figure()
        ...
        return {"landscape": fig}

Example:
    >>> import deqbench
    >>> from deqbench.plots import iterations_per_epoch, save_figure
    >>> fig = iterations_per_epoch(deqbench.load_results("results/smoke/<run_id>"))  # doctest: +SKIP
    >>> save_figure(fig, "iterations.png")                                        # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

PlotFn = Callable[[Any, Path], dict[str, Any]]
_REGISTRY: dict[str, PlotFn] = {}


def register(name: str) -> Callable[[PlotFn], PlotFn]:
    """Register ``fn(results_df, run_dir) -> {figure_name: Figure}`` under ``name``."""

    def deco(fn: PlotFn) -> PlotFn:
        _REGISTRY[name] = fn
        return fn

    return deco


def names() -> list[str]:
    return sorted(_REGISTRY)


def get(name: str) -> PlotFn:
    return _REGISTRY[name]


def new_figure(width: float = 7.0, height: float = 4.0, ncols: int = 1) -> Any:
    """A ``Figure`` with an Agg canvas and ``ncols`` axes side by side (``fig.axes``)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * ncols if ncols > 1 else width, height), layout="constrained")
    FigureCanvasAgg(fig)
    fig.subplots(1, ncols, squeeze=False)
    return fig


def save_figure(fig: Any, path: str | Path, dpi: int = 120) -> Path:
    """Save ``fig`` as PNG (atomic replace)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not isinstance(fig.canvas, FigureCanvasAgg):
        FigureCanvasAgg(fig)
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=dpi)
    tmp.replace(path)
    return path


def short_labels(cell_ids: Any) -> dict[str, str]:
    """Cell id -> label without the id parts every cell shares (``fc_deq_tiny-anderson-ift``,
    ``fc_deq_tiny-broyden-ift`` -> ``anderson``, ``broyden``). Parts split at ``-`` not followed
    by a digit, so ``tol=1e-06`` stays whole."""
    import re

    ids = sorted({str(c) for c in cell_ids})
    parts = {c: re.split(r"-(?![0-9])", c) for c in ids}
    common = set.intersection(*(set(p) for p in parts.values())) if len(ids) > 1 else set()
    out = {}
    for c in ids:
        label = "-".join(p for p in parts[c] if p not in common) or c
        out[c] = label if len(label) <= 48 else label[:45] + "..."
    return out


def cell_colors(cell_ids: Any) -> dict[str, Any]:
    """A fixed colour per cell id (tab20, or a continuous map beyond 20 cells), so one cell has
    the same colour in every panel."""
    from matplotlib import colormaps

    ids = sorted({str(c) for c in cell_ids})
    if len(ids) <= 10:
        cmap, n = colormaps["tab10"], 10
    elif len(ids) <= 20:
        cmap, n = colormaps["tab20"], 20
    else:
        cmap, n = colormaps["turbo"], len(ids)
    return {c: cmap(i / max(n - 1, 1)) if n > 20 else cmap(i) for i, c in enumerate(ids)}


def _lines(
    ax: Any,
    df: Any,
    x: str,
    title: str,
    ylabel: str,
    logy: bool = False,
    by: str = "cell_id",
    all_ids: Any = None,
) -> bool:
    """One line per ``by`` group (median over seeds, min-max band). False if ``df`` is empty."""
    from matplotlib.ticker import MaxNLocator

    if df.empty:
        return False
    ids = df[by].unique() if all_ids is None else all_ids
    labels, colors = short_labels(ids), cell_colors(ids)
    for key, g in df.groupby(by, sort=True):
        agg = g.groupby(x)["value"].agg(["median", "min", "max"]).sort_index()
        xs = agg.index.to_numpy(dtype=float)
        (line,) = ax.plot(
            xs,
            agg["median"].to_numpy(float),
            marker="o",
            ms=3,
            label=labels[str(key)],
            color=colors[str(key)],
        )
        if g["seed"].nunique() > 1:
            ax.fill_between(
                xs,
                agg["min"].to_numpy(float),
                agg["max"].to_numpy(float),
                color=line.get_color(),
                alpha=0.12,
            )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(title)
    ax.set_xlabel(x)
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    return True


def _legend(fig: Any, ax: Any) -> None:
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside right upper", fontsize="x-small")


def iterations_per_epoch(df: Any) -> Any | None:
    """Forward and backward f-evaluations per epoch (training batches, mean), one line per cell."""
    d = df[(df["analysis"] == "solver_stats") & (df["variant"] == "train") & (df["status"] == "ok")]
    d = d[d["step"].notna()].assign(epoch=lambda t: t["step"].astype(int))
    fw, bw = d[d["metric"] == "forward_nstep"], d[d["metric"] == "backward_nstep"]
    if fw.empty and bw.empty:
        return None
    fig = new_figure(5.5, 4.0, ncols=2 if not bw.empty else 1)
    ids = d["cell_id"].unique()
    _lines(fig.axes[0], fw, "epoch", "forward solver", "f-evaluations per batch", all_ids=ids)
    if not bw.empty:
        _lines(
            fig.axes[1],
            bw,
            "epoch",
            "backward (adjoint) solver",
            "f-evaluations per batch",
            all_ids=ids,
        )
    _legend(fig, fig.axes[0])
    return fig


def training_curves(df: Any) -> Any | None:
    """Train/test loss and test accuracy (or MSE) per epoch, one line per cell."""
    d = df[(df["analysis"] == "metrics") & (df["status"] == "ok") & df["step"].notna()]
    if d.empty:
        return None
    d = d.assign(epoch=d["step"].astype(int))
    second = "accuracy" if (d["metric"] == "accuracy").any() else "mse"
    fig = new_figure(4.5, 4.0, ncols=3)
    ids = d["cell_id"].unique()
    for ax, metric, variant in zip(fig.axes, ("loss", "loss", second), ("train", "test", "test")):
        sel = d[(d.metric == metric) & (d.variant == variant)]
        _lines(ax, sel, "epoch", f"{variant} {metric}", metric, all_ids=ids)
    _legend(fig, fig.axes[0])
    return fig


def residual_traces(traces: Any) -> Any | None:
    """Max relative residual per forward iteration (median over seeds), at init (dashed) and
    after training (solid). ``traces``: concatenated ``solver_trace`` series with a ``cell_id``
    and ``seed`` column."""
    if traces is None or traces.empty:
        return None
    fig = new_figure(7.0, 4.5)
    ax = fig.axes[0]
    labels = short_labels(traces["cell_id"].unique())
    colors = cell_colors(traces["cell_id"].unique())
    for cell, g in traces[traces["layer"] == 0].groupby("cell_id", sort=True):
        label: str | None = labels[str(cell)]
        for phase, style in (("final", "-"), ("init", "--")):
            p = g[g["phase"] == phase]
            if p.empty:
                continue
            med = p.groupby("iteration")["rel_max"].median()
            ax.plot(med.index, med.to_numpy(float), style, color=colors[str(cell)], label=label)
            label = None  # one legend entry per cell
    ax.set_yscale("log")
    ax.set_xlabel("forward iteration (f-evaluations)")
    ax.set_ylabel("max relative residual over the batch")
    ax.set_title("residual traces (solid: trained, dashed: init)")
    ax.grid(True, alpha=0.3)
    _legend(fig, ax)
    return fig


def read_series(run_dir: str | Path, name: str) -> Any:
    """All ``series/<name>__<cell>__seed<N>.csv`` of a run, concatenated with cell_id and seed,
    in natural order of the file names (``repeats=6`` before ``repeats=11``)."""
    import re

    import pandas as pd

    def natural(p: Path) -> list[Any]:
        return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)]

    frames = []
    for p in sorted((Path(run_dir) / "series").glob(f"{name}__*__seed*.csv"), key=natural):
        stem = p.stem[len(name) + 2 :]
        cell, _, seed = stem.rpartition("__seed")
        f = pd.read_csv(p)
        f.insert(0, "seed", int(seed))
        f.insert(0, "cell_id", cell)
        frames.append(f)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


@register("solver_stats")
def _solver_plots(df: Any, run_dir: Path) -> dict[str, Any]:
    out = {}
    fig = iterations_per_epoch(df)
    if fig is not None:
        out["solver_iterations"] = fig
    fig = residual_traces(read_series(run_dir, "solver_trace"))
    if fig is not None:
        out["residual_traces"] = fig
    return out


@register("metrics")
def _metric_plots(df: Any, run_dir: Path) -> dict[str, Any]:
    fig = training_curves(df)
    return {"training_curves": fig} if fig is not None else {}


def _import_analyses(used: set[str], errors: list[str]) -> None:
    """Import the analyses a run used, so their modules' ``@plots.register`` functions exist."""
    from .registry import analyses

    for name in sorted(used):
        if name in analyses:
            try:
                analyses.get(name)
            except Exception as exc:
                errors.append(f"plots: analysis '{name}' cannot be imported: {exc}")


def write_plots(run_dir: str | Path, df: Any = None) -> tuple[list[Path], list[str]]:
    """Run every registered plot function on the run; save ``plots/<name>.png``.

    Returns (written paths, error lines). One failing plot does not stop the others.
    """
    from .results import load_results

    run_dir = Path(run_dir)
    if df is None:
        df = load_results(run_dir)
    paths: list[Path] = []
    errors: list[str] = []
    _import_analyses(set(df["analysis"]), errors)
    for name in names():
        try:
            figs = _REGISTRY[name](df, run_dir)
            for fname, fig in figs.items():
                paths.append(save_figure(fig, run_dir / "plots" / f"{fname}.png"))
        except Exception as exc:
            errors.append(f"plot '{name}' failed: {type(exc).__name__}: {exc}")
    return paths, errors
