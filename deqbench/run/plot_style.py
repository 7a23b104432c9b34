"""Figure style for deqbench plots: a ``Figure`` on an Agg canvas (:func:`new_figure`,
:func:`new_grid`, :func:`save_figure`), and the style for many cells that every figure shares:
rows of panels (:func:`cell_groups`), a unique (colour, line style) per cell
(:func:`cell_styles`), legends whose labels drop the shared id parts (:func:`group_legend`,
:func:`notes_legend`), status tags and the line drawing helpers (:func:`lines`, :func:`legend`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


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
