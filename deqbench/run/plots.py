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
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
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
    tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}.png")  # a plot pool's processes too
    fig.savefig(tmp, dpi=dpi)
    tmp.replace(path)
    return path


# -- style for many cells ---------------------------------------------------------------------
#: categorical palette (matplotlib's tab10): neighbours never blend as on a continuous map
PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)
#: line styles combined with the palette: (colour, line style) pairs are unique for 80 cells
LINESTYLES: tuple[Any, ...] = (
    "-",
    "--",
    ":",
    "-.",
    (0, (5, 1)),
    (0, (1, 1)),
    (0, (3, 1, 1, 1, 1, 1)),
    (0, (8, 2, 2, 2)),
)
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
#: colour of the ``[flagged]`` legend text
FLAG_COLOR = "#c00000"
#: the mark of a point whose solves missed tolerance
UNCONVERGED = {"marker": "x", "color": "black", "ms": 7, "mew": 1.5, "ls": "none", "zorder": 5}
#: up to this many cells share one row of panels; beyond, rows by model
GROUP_ABOVE = 8
_USABLE = ("ok", "flagged")  # row statuses drawn (flagged cells are marked in the legend)


def _split_id(cell_id: str) -> list[str]:
    import re

    return re.split(r"-(?![0-9])", cell_id)


def shared_parts(cell_ids: Any) -> list[str]:
    """The id parts all of several cells have (none for a single cell), in id order."""
    ids = sorted({str(c) for c in cell_ids})
    if len(ids) < 2:
        return []
    parts = [_split_id(c) for c in ids]
    common = set.intersection(*(set(p) for p in parts))
    return [p for p in parts[0] if p in common]


def short_labels(cell_ids: Any) -> dict[str, str]:
    """Cell id -> label without the id parts every cell shares (``fc_deq_tiny-anderson-ift``,
    ``fc_deq_tiny-broyden-ift`` -> ``anderson``, ``broyden``). Parts split at ``-`` not followed
    by a digit, so ``tol=1e-06`` stays whole. Never truncated; the figures write the dropped
    parts (:func:`shared_parts`) in the legend title."""
    ids = sorted({str(c) for c in cell_ids})
    common = set(shared_parts(ids))
    return {c: "-".join(p for p in _split_id(c) if p not in common) or c for c in ids}


def cell_styles(
    cell_ids: Any,
    solver: dict[str, Any] | None = None,
    backward: dict[str, Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """A style (``color``, ``linestyle``, ``marker``) per cell id; no two cells share
    (colour, line style) up to 80 cells.

    With ``solver`` and ``backward`` (cell id -> name), where both vary and no two cells have
    the same pair: colour = solver, line style and marker = backward mode (``ift`` solid).
    Otherwise, in sorted id order: the 10 palette colours with the first line style, then the
    next line style.
    """
    ids = sorted({str(c) for c in cell_ids})
    if solver is not None and backward is not None and len(ids) > 1:
        s = [str(solver.get(c, "")) for c in ids]
        b = [str(backward.get(c, "")) for c in ids]
        sv = sorted(set(s))
        bv = sorted(set(b), key=lambda v: (v != "ift", v))
        if (
            len(set(zip(s, b))) == len(ids)
            and 1 < len(sv) <= len(PALETTE)
            and 1 < len(bv) <= len(LINESTYLES)
        ):
            return {
                c: {
                    "color": PALETTE[sv.index(si)],
                    "linestyle": LINESTYLES[bv.index(bi)],
                    "marker": MARKERS[bv.index(bi) % len(MARKERS)],
                }
                for c, si, bi in zip(ids, s, b)
            }
    n = len(PALETTE)
    return {
        c: {
            "color": PALETTE[i % n],
            "linestyle": LINESTYLES[(i // n) % len(LINESTYLES)],
            "marker": MARKERS[(i // n) % len(MARKERS)],
        }
        for i, c in enumerate(ids)
    }


def cell_colors(cell_ids: Any) -> dict[str, Any]:
    """The colour of each cell in :func:`cell_styles` (categorical palette)."""
    return {c: s["color"] for c, s in cell_styles(cell_ids).items()}


def cell_meta(df: Any) -> dict[str, dict[str, str]]:
    """cell id -> {model, solver, backward} from a results DataFrame (runs without a
    ``backward`` column: ``unrolled`` when the id has that part)."""
    out: dict[str, dict[str, str]] = {}
    if df is None or len(df) == 0 or "cell_id" not in df:
        return out
    cols = [c for c in ("model", "solver", "backward") if c in df]
    first = df.drop_duplicates("cell_id")
    for rec in first[["cell_id", *cols]].to_dict("records"):
        c = str(rec.pop("cell_id"))
        m = {k: str(v) for k, v in rec.items() if str(v) not in ("", "nan", "None")}
        parts = _split_id(c)
        m.setdefault("model", parts[0])
        m.setdefault("backward", "unrolled" if "unrolled" in parts else "")
        out[c] = m
    return out


class CellGroup:
    """The cells of one row of panels: ``title``, ``ids``, ``labels`` (the id parts not shared
    within the row), ``shared`` parts and a ``styles`` entry per cell."""

    def __init__(self, title: str, ids: list[str], meta: dict[str, dict[str, str]]) -> None:
        self.title, self.ids = title, sorted(ids)
        self.labels = short_labels(self.ids)
        self.shared = shared_parts(self.ids)
        self.styles = cell_styles(
            self.ids,
            {c: meta.get(c, {}).get("solver", "") for c in self.ids},
            {c: meta.get(c, {}).get("backward", "") for c in self.ids},
        )

    def legend_title(self) -> str:
        rest = [p for p in self.shared if p != self.title]
        return self.title + (f"\n(all: {'-'.join(rest)})" if rest else "")


def cell_groups(df: Any, ids: Any = None) -> list[CellGroup]:
    """Rows of panels for the cells of ``df`` (plus ``ids``): one row up to
    :data:`GROUP_ABOVE` cells; beyond, a row per model with two or more cells (the five
    largest) and a row of the other models. A cell has the same row, label and style in every
    figure of a run."""
    meta = cell_meta(df)
    for c in ids if ids is not None else ():
        meta.setdefault(str(c), {"model": _split_id(str(c))[0], "backward": ""})
    all_ids = sorted(meta)
    if not all_ids:
        return []
    models: dict[str, list[str]] = {}
    for c in all_ids:
        models.setdefault(meta[c]["model"], []).append(c)
    if len(all_ids) <= GROUP_ABOVE or len(models) == 1:
        return [CellGroup(next(iter(models)) if len(models) == 1 else "cells", all_ids, meta)]
    big = sorted((m for m, cs in models.items() if len(cs) > 1), key=lambda m: -len(models[m]))
    big = sorted(big[:5])
    rest = [c for m, cs in models.items() if m not in big for c in cs]
    groups = [CellGroup(m, models[m], meta) for m in big]
    if rest:
        groups.append(CellGroup("other models" if big else "cells", rest, meta))
    return groups


def cell_tags(df: Any) -> dict[str, str]:
    """cell id -> legend tag for the cells whose runner row is not ``ok``: the status
    (``flagged``, ``diverged``, ``nan``, ``oom``, ``error``, ...), with ``k/n seeds`` where only
    some seeds have it."""
    if df is None or len(df) == 0 or "status" not in df:
        return {}
    r = df[df["analysis"] == "runner"]
    out = {}
    for cell, g in r.groupby("cell_id"):
        bad = g[g["status"] != "ok"]
        if bad.empty:
            continue
        st = bad["status"].value_counts().index[0]
        n, k = g["seed"].nunique(), bad[bad["status"] == st]["seed"].nunique()
        out[str(cell)] = st if k == n else f"{st} {k}/{n} seeds"
    return out


def tag_notes(tags: dict[str, str], cells: Any) -> list[tuple[dict[str, Any] | None, str]]:
    """Notes explaining the legend tags of the drawn ``cells``."""
    used = {tags[c].split()[0] for c in cells if c in tags}
    notes: list[tuple[dict[str, Any] | None, str]] = []
    if "flagged" in used:
        notes.append((None, "[flagged]: the run flagged the cell (reason: results.csv note)"))
    other = sorted(used - {"flagged"})
    if other:
        notes.append(
            (
                None,
                " / ".join(f"[{t}]" for t in other)
                + ": the run's status for the cell; points after it stopped are missing",
            )
        )
    return notes


def flagged_cells(df: Any) -> dict[str, str]:
    """cell id -> note, for the cells whose runner row (any seed) has status ``flagged``."""
    if df is None or len(df) == 0 or "status" not in df:
        return {}
    f = df[(df["analysis"] == "runner") & (df["status"] == "flagged")]
    return {str(c): str(n) for c, n in zip(f["cell_id"], f["note"].fillna(""))}


def group_legend(
    ax: Any,
    group: CellGroup,
    cells: Any,
    tags: dict[str, str],
    inside: bool = False,
    markers: bool = True,
) -> Any:
    """A legend of the ``cells`` of ``group``: right of ``ax`` (``inside``: in ``ax``, whose
    axis is turned off), titled with the group and the id parts its cells share; the label of
    a cell with a tag (:func:`cell_tags`: ``[flagged]``, ``[diverged]``, ...) ends in it, in
    red; ``markers=False`` for lines drawn without."""
    from matplotlib.lines import Line2D

    handles, labels = [], []
    for c in sorted(set(cells)):
        st = group.styles[c] if markers else dict(group.styles[c], marker=None)
        handles.append(Line2D([], [], lw=1.5, ms=4, **st))
        labels.append(group.labels[c] + (f" [{tags[c]}]" if c in tags else ""))
    if not handles:
        return None
    if inside:
        ax.set_axis_off()
    leg = ax.legend(
        handles,
        labels,
        title=group.legend_title(),
        loc="upper left",
        bbox_to_anchor=(0.0, 1.0) if inside else (1.03, 1.0),
        borderaxespad=0.0,
        fontsize="x-small",
        title_fontsize="x-small",
        alignment="left",
        ncols=legend_ncols(len(handles)),
    )
    for t in leg.get_texts():
        if t.get_text().endswith("]") and " [" in t.get_text():
            t.set_color(FLAG_COLOR)
    return leg


def notes_legend(fig: Any, notes: list[tuple[dict[str, Any] | None, str]]) -> Any:
    """What the marks mean, below the panels: (Line2D keywords, or None for text only; text)."""
    from matplotlib.lines import Line2D

    if not notes:
        return None
    handles = [Line2D([], [], **(st or {"ls": "none", "marker": "none"})) for st, _ in notes]
    return fig.legend(
        handles,
        [t for _, t in notes],
        loc="outside lower left",
        fontsize="x-small",
        frameon=False,
        handlelength=1.5,
    )


def unhide_duplicates(ax: Any) -> int:
    """Lines with identical data drawn over each other: widen the ones underneath so each
    stays visible as a band of its colour. Returns how many lines were widened."""
    import numpy as np

    seen: list[list[Any]] = []
    for ln in ax.get_lines():
        if ln.get_label().startswith("_") or len(ln.get_xdata()) == 0:
            continue
        x, y = np.asarray(ln.get_xdata(), float), np.asarray(ln.get_ydata(), float)
        for grp in seen:
            x0 = np.asarray(grp[0].get_xdata(), float)
            y0 = np.asarray(grp[0].get_ydata(), float)
            if len(x0) == len(x) and np.allclose(x0, x) and np.allclose(y0, y, rtol=1e-9):
                grp.append(ln)
                break
        else:
            seen.append([ln])
    n = 0
    for grp in seen:
        m = len(grp)
        for j, ln in enumerate(grp):
            ln.set_linewidth(ln.get_linewidth() + 2.0 * (m - 1 - j))
            ln.set_markersize(ln.get_markersize() + 1.5 * (m - 1 - j))
            ln.set_zorder(2 + 0.01 * j)
        n += m - 1
    return n


#: legend entries per legend column before a legend gets another column
LEGEND_ROWS = 24


def legend_ncols(n: int) -> int:
    """Columns of a legend of ``n`` entries (:data:`LEGEND_ROWS` entries a column)."""
    return max(1, -(-n // LEGEND_ROWS))


def row_height(n_entries: int, height: float) -> float:
    """Height (inches) of a row of panels whose legend lists ``n_entries`` cells: at least
    ``height``, and tall enough for the whole legend (a legend is never cut)."""
    lines = -(-n_entries // legend_ncols(n_entries)) + 2  # + the title lines
    return max(height, 0.165 * lines + 0.3)


def new_grid(
    nrows: int,
    ncols: int,
    width: float,
    height: float,
    heights: list[float] | None = None,
    **kw: Any,
) -> tuple[Any, Any]:
    """A ``Figure`` (Agg canvas, constrained layout) and its ``nrows`` x ``ncols`` axes array;
    ``width``/``height`` per panel (``heights``: one per row, e.g. from :func:`row_height`);
    ``kw`` go to ``Figure.subplots`` (``sharey=...``)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    heights = heights or [height] * nrows
    fig = Figure(figsize=(width * ncols + 2.5, sum(heights) + 1.2), layout="constrained")
    FigureCanvasAgg(fig)
    kw.setdefault("gridspec_kw", {})["height_ratios"] = heights
    return fig, fig.subplots(nrows, ncols, squeeze=False, **kw)


def _agg(g: Any, x: str) -> Any:
    return g.groupby(x)["value"].agg(["median", "min", "max"]).sort_index()


def _draw(
    ax: Any,
    agg: Any,
    style: dict[str, Any],
    label: str,
    gid: str,
    band: bool,
    hollow: Any = (),
    join_hollow: bool = True,
) -> Any:
    """The median line of ``agg`` (index x; median, min, max) and, with ``band``, the min..max
    band. Points at x in ``hollow`` get a hollow marker; with ``join_hollow=False`` the line
    leaves them out (they are a different measurement)."""
    hollow = [x for x in hollow if x in agg.index]
    a = agg if join_hollow else agg.drop(index=hollow)
    (line,) = ax.plot(
        a.index.to_numpy(float), a["median"].to_numpy(float), ms=3.5, lw=1.5, label=label, **style
    )
    line.set_gid(gid)
    if band and len(a) > 1:
        ax.fill_between(
            a.index.to_numpy(float),
            a["min"].to_numpy(float),
            a["max"].to_numpy(float),
            color=style["color"],
            alpha=0.12,
            lw=0,
        )
    if hollow:
        h = agg.loc[hollow]
        (pt,) = ax.plot(
            h.index.to_numpy(float),
            h["median"].to_numpy(float),
            ls="none",
            marker=style["marker"],
            ms=6,
            mfc="white",
            mec=style["color"],
            mew=1.3,
            zorder=4,
            label="_hollow",
        )
        pt.set_gid(gid)
        if band:
            ax.vlines(h.index, h["min"], h["max"], color=style["color"], alpha=0.35, lw=2)
    return line


def _log_if_wide(ax: Any, ratio: float = 20.0) -> None:
    """Log y axis (plain tick labels) where the drawn medians span more than ``ratio``."""
    import numpy as np
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

    ys = [
        np.asarray(ln.get_ydata(), float)
        for ln in ax.get_lines()
        if len(ln.get_ydata()) and ln.get_label() != "_unconverged"
    ]
    if not ys:
        return
    y = np.concatenate(ys)
    y = y[np.isfinite(y) & (y > 0)]
    if len(y) and y.max() / y.min() > ratio:
        ax.set_yscale("log")
        if y.max() / y.min() < 1e3:  # few decades: label 1, 2, 5 x 10^k as plain numbers
            ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
            ax.yaxis.set_minor_formatter(NullFormatter())


def _seeds_text(d: Any) -> str:
    n = d["seed"].nunique() if len(d) else 0
    return f"line: median over {n} seeds, band: min..max" if n > 1 else "one seed"


def lines(
    ax: Any,
    df: Any,
    x: str,
    title: str,
    ylabel: str,
    logy: bool = False,
    by: str = "cell_id",
    all_ids: Any = None,
) -> bool:
    """One line per ``by`` group (median over seeds, min-max band), styled by
    :func:`cell_styles`. False if ``df`` is empty."""
    from matplotlib.ticker import MaxNLocator

    if df.empty:
        return False
    ids = [str(c) for c in (df[by].unique() if all_ids is None else all_ids)]
    labels, styles = short_labels(ids), cell_styles(ids)
    for key, g in df.groupby(by, sort=True):
        _draw(ax, _agg(g, x), styles[str(key)], labels[str(key)], str(key), g["seed"].nunique() > 1)
    unhide_duplicates(ax)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(title)
    ax.set_xlabel(x)
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    return True


def legend(fig: Any, ax: Any) -> None:
    """The cells of ``ax`` in a figure legend right of the panels, titled with the id parts
    all its cells share."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        gids = {h.get_gid() for h in handles if h.get_gid()}
        shared = shared_parts(gids)
        fig.legend(
            handles,
            labels,
            loc="outside right upper",
            fontsize="x-small",
            title=f"all: {'-'.join(shared)}" if shared else None,
            title_fontsize="x-small",
        )


def _epoch_rows(df: Any, analysis: str) -> Any:
    d = df[(df["analysis"] == analysis) & df["status"].isin(_USABLE) & df["step"].notna()]
    return d.assign(epoch=d["step"].astype(int))


def _min_by(d: Any, metric: str) -> dict[tuple[str, int], float]:
    s = d[d["metric"] == metric].groupby(["cell_id", "epoch"])["value"].min()
    return {(str(c), int(e)): float(v) for (c, e), v in s.items()}


def iterations_per_epoch(df: Any) -> Any | None:
    """Forward and backward (adjoint) f-evaluations per training batch and epoch (mean over
    the epoch's batches; median over seeds), one row of panels per group of cells
    (:func:`cell_groups`). Epoch 0 (an evaluation pass before training) is hollow; an
    ``unrolled`` cell's points are its K plain steps (no solve, no x); x: a solve in that epoch
    missed tolerance; flagged cells are marked in the legend."""
    d = _epoch_rows(df, "solver_stats")
    d = d[d["variant"] == "train"]
    fw, bw = d[d["metric"] == "forward_nstep"], d[d["metric"] == "backward_nstep"]
    if fw.empty and bw.empty:
        return None
    drawn = set(fw["cell_id"]) | set(bw["cell_id"])
    groups = [g for g in cell_groups(df) if drawn & set(g.ids)]
    meta, tags = cell_meta(df), cell_tags(df)
    conv = {
        "forward": _min_by(d, "forward_converged"),
        "backward": _min_by(d, "backward_converged"),
    }
    panels = [("forward", fw)] + ([("backward", bw)] if not bw.empty else [])
    heights = [row_height(len(drawn & set(g.ids)), 2.9) for g in groups]
    fig, axs = new_grid(len(groups), len(panels), 4.6, 2.9, heights)
    seen = {"unrolled": False, "bad": False, "dup": 0, "epoch0": False}
    all_cells: set[str] = set()
    for r, grp in enumerate(groups):
        row_cells = set()
        for ax, (kind, sel) in zip(axs[r], panels):
            for cell in grp.ids:
                g = sel[sel["cell_id"] == cell]
                if g.empty:
                    continue
                row_cells.add(cell)
                unrolled = kind == "forward" and meta.get(cell, {}).get("backward") == "unrolled"
                agg = _agg(g, "epoch")
                seen["epoch0"] |= 0 in agg.index
                seen["unrolled"] |= unrolled and len(agg) > 1
                _draw(
                    ax,
                    agg,
                    grp.styles[cell],
                    grp.labels[cell],
                    cell,
                    g["seed"].nunique() > 1,
                    hollow=[0],
                )
                bad = [
                    e
                    for e in agg.index
                    if conv[kind].get((cell, int(e)), 1.0) < 1.0 and not unrolled
                ]
                if bad:
                    seen["bad"] = True
                    (m,) = ax.plot(bad, agg.loc[bad, "median"], label="_unconverged", **UNCONVERGED)
                    m.set_gid(cell)
            seen["dup"] += unhide_duplicates(ax)
            _log_if_wide(ax)
            what = "forward solve" if kind == "forward" else "backward (adjoint) solve"
            ax.set_title(f"{grp.title}: {what}", fontsize="medium")
            ax.set_xlabel("epoch")
            ax.set_ylabel("f-evaluations per batch")
            ax.grid(True, alpha=0.3)
            ax.xaxis.set_major_locator(_int_locator())
        _same_x(axs[r])
        group_legend(axs[r][-1], grp, row_cells, tags)
        all_cells |= row_cells
    fig.suptitle(
        "Solver f-evaluations per training batch (mean over the epoch's batches); "
        + _seeds_text(d),
        fontsize="medium",
    )
    notes: list[tuple[dict[str, Any] | None, str]] = []
    if seen["epoch0"]:
        notes.append(
            (
                {"ls": "none", "marker": "o", "mfc": "white", "mec": "black"},
                "epoch 0: evaluation pass over the training set before training (forward only)",
            )
        )
    if seen["unrolled"]:
        notes.append(
            (
                None,
                "unrolled cells: the K plain steps they train and evaluate with (not a solve)",
            )
        )
    if seen["bad"]:
        notes.append((UNCONVERGED, "solves of that epoch missed tolerance (converged share < 1; "
                      "epoch 0, before training, is reported only and flags no cell)"))  # fmt: skip
    if seen["dup"]:
        notes.append((None, "identical lines: the one underneath is drawn wider"))
    notes_legend(fig, notes + tag_notes(tags, all_cells))
    return fig


def _same_x(axes: Any) -> None:
    """One x range (the union of the drawn epochs, padded) for the panels of a row."""
    import numpy as np

    xs = [np.asarray(ln.get_xdata(), float) for ax in axes for ln in ax.get_lines()]
    xs = [x for x in xs if len(x)]
    if xs:
        lo, hi = float(min(x.min() for x in xs)), float(max(x.max() for x in xs))
        for ax in axes:
            ax.set_xlim(lo - 0.15 * max(hi - lo, 1), hi + 0.15 * max(hi - lo, 1))


def _int_locator() -> Any:
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True)


#: task -> (loss axis label, second metric, its axis label, scale)
_TASKS = {
    "classification": ("cross-entropy (nats)", "accuracy", "accuracy (%)", 100.0),
    "regression": ("MSE (mean over elements)", None, None, 1.0),
    "other": ("loss", None, None, 1.0),
}


def training_curves(df: Any) -> Any | None:
    """Train and test loss per epoch, and test accuracy, one row of panels per group of cells
    and task: cross-entropy (classification) and MSE (regression: the loss is the MSE, so the
    ``mse`` rows are not drawn again) never share an axis. Train: mean over the epoch's
    training batches; epoch 0 (hollow): an evaluation pass before training."""
    d = _epoch_rows(df, "metrics")
    if d.empty:
        return None
    task = {}
    for cell, g in d.groupby("cell_id"):
        m = set(g["metric"])
        task[str(cell)] = (
            "classification" if "accuracy" in m else "regression" if "mse" in m else "other"
        )
    meta_groups = [g for g in cell_groups(df) if set(g.ids) & set(task)]
    rows = [
        (grp, t, [c for c in grp.ids if task.get(c) == t])
        for grp in meta_groups
        for t in _TASKS
        if any(task.get(c) == t for c in grp.ids)
    ]
    tags = cell_tags(df)
    fig, axs = new_grid(len(rows), 3, 3.9, 2.8, [row_height(len(c), 2.8) for _, _, c in rows])
    dup = 0
    for r, (grp, t, cells) in enumerate(rows):
        ylab, second, ylab2, scale = _TASKS[t]
        name = {"classification": "cross-entropy", "regression": "MSE", "other": "loss"}[t]
        panels: list[tuple[str, str, str, str | None]] = [
            ("loss", "train", f"train {name}", ylab),
            ("loss", "test", f"test {name}", ylab),
        ]
        if second:
            panels.append((second, "test", f"test {second}", ylab2))
        for ax, (metric, variant, title, ylabel) in zip(axs[r], panels):
            sel = d[(d["metric"] == metric) & (d["variant"] == variant)]
            for cell in cells:
                g = sel[sel["cell_id"] == cell]
                if g.empty:
                    continue
                agg = _agg(g, "epoch") * (scale if metric == second else 1.0)
                _draw(
                    ax,
                    agg,
                    grp.styles[cell],
                    grp.labels[cell],
                    cell,
                    g["seed"].nunique() > 1,
                    hollow=[0] if variant == "train" else (),
                )
            dup += unhide_duplicates(ax)
            _log_if_wide(ax, 1e3)
            ax.set_title(f"{grp.title}: {title}", fontsize="medium")
            ax.set_xlabel("epoch")
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
            ax.xaxis.set_major_locator(_int_locator())
        _same_x(axs[r][: len(panels)])
        if second is None:
            group_legend(axs[r][2], grp, cells, tags, inside=True)
        else:
            group_legend(axs[r][2], grp, cells, tags)
    fig.suptitle("Training curves; " + _seeds_text(d), fontsize="medium")
    notes: list[tuple[dict[str, Any] | None, str]] = [
        (
            {"ls": "none", "marker": "o", "mfc": "white", "mec": "black"},
            "train, epoch 0: evaluation pass before training; later epochs: mean over the "
            "epoch's training batches (train mode); test: evaluation pass at the end of the "
            "epoch (epoch 0: before training)",
        )
    ]
    if dup:
        notes.append((None, "identical lines: the one underneath is drawn wider"))
    notes_legend(fig, notes + tag_notes(tags, [c for _, _, cs in rows for c in cs]))
    return fig


def _skewed(ax: Any, ratio: float = 8.0) -> bool:
    """The longest line of ``ax`` is ``ratio`` times the median line length or more (a
    200-iteration trace would squeeze the others into the left edge: log x)."""
    import numpy as np

    n = [len(ln.get_xdata()) for ln in ax.get_lines() if not ln.get_label().startswith("_")]
    return len(n) > 1 and max(n) >= ratio * float(np.median(n))


def residual_traces(traces: Any, df: Any = None) -> Any | None:
    """Max relative residual per forward iteration of the first DEQ layer on the traced test
    inputs (median over seeds), at init and after training side by side, one row per group
    of cells. ``traces``: concatenated ``solver_trace`` series with ``cell_id`` and ``seed``;
    ``df`` (the results, optional): groups, styles, flags and the x at a trace's end where the
    test-set forward solves missed tolerance then."""
    if traces is None or traces.empty:
        return None
    t = traces[traces["layer"] == 0] if "layer" in traces else traces
    groups = [g for g in cell_groups(df, ids=t["cell_id"].unique()) if set(g.ids) & set(t.cell_id)]
    tags = cell_tags(df)
    missed: dict[tuple[str, str], bool] = {}
    if df is not None and len(df):
        s = df[
            (df["analysis"] == "solver_stats")
            & (df["metric"] == "forward_converged")
            & df["status"].isin(_USABLE)
        ]
        s = s[s["variant"] == "test"]
        init = s[s["step"] == 0].groupby("cell_id")["value"].min()
        last = s.groupby("cell_id")["step"].transform("max")
        final = s[(s["step"] == last) & (last > 0)].groupby("cell_id")["value"].min()
        missed |= {(str(c), "init"): v < 1 for c, v in init.items()}
        missed |= {(str(c), "final"): v < 1 for c, v in final.items()}
    phases = [("init", "at init"), ("final", "after training")]
    heights = [row_height(len(set(g.ids) & set(t["cell_id"])), 3.0) for g in groups]
    fig, axs = new_grid(len(groups), 2, 4.6, 3.0, heights, sharey=True)
    any_bad = False
    dup = 0
    all_cells: set[str] = set()
    for r, grp in enumerate(groups):
        cells = set()
        for ax, (phase, what) in zip(axs[r], phases):
            for cell in grp.ids:
                p = t[(t["cell_id"] == cell) & (t["phase"] == phase)]
                if p.empty:
                    continue
                cells.add(cell)
                med = p.groupby("iteration")["rel_max"].median()
                st = dict(grp.styles[cell], marker=None)
                (ln,) = ax.plot(
                    med.index, med.to_numpy(float), lw=1.3, label=grp.labels[cell], **st
                )
                ln.set_gid(cell)
                if missed.get((cell, phase)):
                    any_bad = True
                    (m,) = ax.plot(
                        [med.index[-1]], [med.iloc[-1]], label="_unconverged", **UNCONVERGED
                    )
                    m.set_gid(cell)
            dup += unhide_duplicates(ax)
            ax.set_yscale("log")
            ax.set_title(f"{grp.title}: {what}", fontsize="medium")
            ax.set_xlabel("forward iteration (f-evaluations)")
            ax.set_ylabel("max relative residual")
            ax.yaxis.set_tick_params(labelleft=True)
            ax.grid(True, alpha=0.3)
        if any(_skewed(ax) for ax in axs[r]):
            for ax in axs[r]:
                ax.set_xscale("log")
        group_legend(axs[r][-1], grp, cells, tags, markers=False)
        all_cells |= cells
    fig.suptitle(
        "Forward residual per iteration, first DEQ layer: max over the traced test inputs "
        "(median over seeds)",
        fontsize="medium",
    )
    notes: list[tuple[dict[str, Any] | None, str]] = []
    if any_bad:
        notes.append(
            (
                UNCONVERGED,
                "at a trace's end: the forward solves of the evaluation pass over the whole test "
                "set (not only the traced inputs) missed tolerance at init / after the last epoch",
            )
        )
    if dup:
        notes.append((None, "identical lines: the one underneath is drawn wider"))
    notes_legend(fig, notes + tag_notes(tags, all_cells))
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
