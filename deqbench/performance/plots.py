"""Plots of the performance analyses (``backward``, ``solver_overhead``), registered with
:mod:`deqbench.run.plots` when the analysis modules are imported."""

from __future__ import annotations

import math
from typing import Any


def plot_memory_vs_iterations(series: Any, df: Any = None) -> Any | None:
    """Activation (and, where measured, peak) memory against forward iterations N: one colour
    per cell (:func:`deqbench.run.plots.cell_styles`), solid = unrolled K = N, dashed = IFT whose
    forward runs N iterations (flat). Identical lines are drawn widest underneath so none is
    hidden; the legend, right of the panels, lists the drawn lines."""
    from ..run import plots

    if series is None or len(series) == 0:
        return None
    has_peak = "peak_mib" in series and series["peak_mib"].notna().any()
    cols = [("activation_mib", "saved activation memory (MiB)")]
    if has_peak:
        cols.append(("peak_mib", "peak memory of a training step (MiB)"))
    fig, axs = plots.new_grid(1, len(cols), 4.6, 3.4)
    ids = sorted({str(c) for c in series["cell_id"]})
    grp = plots.cell_groups(df, ids=ids) if df is not None else [plots.CellGroup("cells", ids, {})]
    styles = {c: g.styles[c] for g in grp for c in g.ids if c in ids}
    labels = plots.short_labels(ids)
    steps = sorted(series["step"].unique())
    dup = 0
    for ax, (col, ylabel) in zip(axs[0], cols):
        for (cell, mode, step), g in series.groupby(["cell_id", "mode", "step"], sort=True):
            g = g.sort_values("iterations").dropna(subset=[col])
            if g.empty:
                continue
            st = styles[str(cell)]
            when = f", step {step}" if len(steps) > 1 else ""
            (ln,) = ax.plot(
                g["iterations"],
                g[col],
                color=st["color"],
                marker="o" if mode == "unrolled" else "s",
                ms=4,
                ls="-" if mode == "unrolled" else "--",
                label=f"{labels.get(str(cell), cell)} {mode}{when}",
            )
            ln.set_gid(str(cell))
        dup += plots.unhide_duplicates(ax)
        ax.set_xlabel("forward iterations N (unrolled: K = N)")
        ax.set_ylabel(ylabel)
        if len(cols) > 1:
            ax.set_title(ylabel.split(" (")[0], fontsize="medium")
        ax.grid(alpha=0.3)
    from matplotlib.lines import Line2D

    drawn = [ln for ln in axs[0][0].get_lines() if not ln.get_label().startswith("_")]
    handles = [
        Line2D([], [], color=ln.get_color(), ls=ln.get_linestyle(), marker=ln.get_marker(), ms=4)
        for ln in drawn
    ]
    shared = plots.shared_parts(ids)
    axs[0][-1].legend(
        handles,
        [ln.get_label() for ln in drawn],
        loc="upper left",
        bbox_to_anchor=(1.03, 1.0),
        borderaxespad=0.0,
        fontsize="x-small",
        title="cell, backward mode" + (f"\n(cell ids all: {'-'.join(shared)})" if shared else ""),
        title_fontsize="x-small",
    )
    when = f" (after epoch {steps[0]})" if len(steps) == 1 and steps[0] else ""
    fig.suptitle(f"Memory against forward iterations, one training step{when}", fontsize="medium")
    notes: list[tuple[dict[str, Any] | None, str]] = [
        ({"color": "grey", "ls": "-", "marker": "o"}, "unrolled: backpropagates through K steps"),
        ({"color": "grey", "ls": "--", "marker": "s"}, "IFT: forward runs N iterations, no grad"),
    ]
    if dup:
        notes.append((None, "identical lines: the one underneath is drawn wider"))
    plots.notes_legend(fig, notes)
    return fig


#: colour per backward mode family (a plugin's mode gets the next free colour)
MODE_COLORS = {
    "ift": "tab:blue",
    "unrolled": "tab:orange",
    "jfb": "tab:green",
    "phantom": "tab:olive",
    "reversible": "tab:purple",
    "shine": "tab:red",
}
#: marker area (points^2) of the largest memory in a figure, and the smallest drawn
SIZE_MAX, SIZE_MIN = 420.0, 18.0


def mode_family(variant: str) -> str:
    """The backward mode a variant name starts with (``shine-refine=5`` -> ``shine``; a
    wrapper's ``torchdeq_deq:ift-tol=1e-06`` -> ``ift``)."""
    return str(variant).rpartition(":")[2].split("-")[0]


def _place_labels(
    ax: Any, pts: list[tuple[float, float, str, float]], fontsize: float = 6.0
) -> None:
    """Annotate each point (x, y, text, marker radius in points) beside its marker, trying a few
    offsets from the marker's edge so that labels do not overlap one another (greedy, in display
    coordinates; approximate text boxes); a thin leader line joins each label to its marker."""
    fig = ax.figure
    dpi = fig.dpi / 72.0
    right_edge = ax.get_window_extent().x1
    placed: list[tuple[float, float, float, float]] = []
    dys = (2, -8, 9, -15, 16, -22, 23)
    order = sorted(pts, key=lambda p: (-p[1], p[0]))
    for x, y, text, radius in order:
        px, py = ax.transData.transform((x, y))
        w, h = 0.62 * fontsize * len(text) * dpi, 1.2 * fontsize * dpi
        gap = radius + 3.0  # points: from the marker's edge, not its centre
        right = (
            [(gap, dy) for dy in dys[:5]]
            + [(-gap, dy) for dy in dys[:2]]
            + [(gap, dy) for dy in dys[5:]]
        )
        left = [(-gap, dy) for dy in dys]
        # a label that would leave the axes on the right goes to the left of its marker
        cands = left if px + gap * dpi + w > right_edge else right
        best = None
        for dx, dy in cands:
            x0 = px + dx * dpi if dx > 0 else px + dx * dpi - w
            y0 = py + dy * dpi
            box = (x0, y0, x0 + w, y0 + h)
            if not any(
                box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3] for b in placed
            ):
                best = (dx, dy, box)
                break
        if best is None:
            dx, dy = cands[0]
            x0 = px + dx * dpi if dx > 0 else px + dx * dpi - w
            best = (dx, dy, (x0, py + dy * dpi, x0 + w, py + dy * dpi + h))
        dx, dy, box = best
        placed.append(box)
        ann = ax.annotate(
            text, (x, y), xytext=(dx, dy), textcoords="offset points", fontsize=fontsize,
            ha="left" if dx > 0 else "right", va="bottom",
            arrowprops={"arrowstyle": "-", "lw": 0.5, "color": "0.45", "shrinkA": 0,
                        "shrinkB": radius, "relpos": (0.0 if dx > 0 else 1.0, 0.0)},
        )  # fmt: skip
        ann.set_in_layout(False)  # placed after the layout: it must not move the axes again


def plot_accuracy_vs_time(df: Any) -> Any | None:
    """Gradient relative error (log) against backward time (log where it spans more than 20x),
    one marker per backward variant, labelled with its name and memory; the marker's area is
    proportional to the memory of a training step within its panel (the CUDA allocator's peak
    where every variant of the panel has one; else, and on CPU, where the fresh-worker RSS is
    page-granular noise at tiny sizes, the bytes autograd saves), its colour the mode family; hollow: a flagged measurement (the variant's own solves
    missed tolerance). One panel per cell (and measuring step)."""
    from matplotlib.lines import Line2D

    from ..run import plots

    metrics = ["grad_rel_error", "backward_ms_median", "peak_memory", "activation_memory"]
    d = df[(df["analysis"] == "backward") & df["metric"].isin(metrics)]
    d = d[d["variant"] != "reference"].dropna(subset=["value"])
    # the peak sizes the markers where the CUDA allocator measured it; a CPU peak (the RSS of a
    # fresh worker) is at page granularity and noise for tiny models: the saved bytes instead
    cuda = d["note"].astype(str).str.contains("cuda") if "note" in d else False
    rss = (d["metric"] == "peak_memory") & ~cuda
    d = d[~rss]
    if d.empty:
        return None
    w = d.pivot_table(
        index=["cell_id", "step", "variant"], columns="metric", values="value", aggfunc="median"
    ).reset_index()
    if "grad_rel_error" not in w or "backward_ms_median" not in w:
        return None
    w = w.dropna(subset=["grad_rel_error", "backward_ms_median"])
    if w.empty:
        return None
    flagged = set(
        map(tuple, d.loc[d["status"] == "flagged", ["cell_id", "step", "variant"]].values.tolist())
    )
    panels = sorted({(str(c), s) for c, s in zip(w["cell_id"], w["step"])}, key=str)
    steps = {s for _, s in panels}
    fig, axs = plots.new_grid(1, len(panels), 5.6, 4.4)
    labels = plots.short_labels(sorted({c for c, _ in panels}))
    families = sorted(
        {mode_family(v) for v in w["variant"]}, key=lambda f: (f not in MODE_COLORS, f)
    )
    spare = [c for c in plots.PALETTE if c not in MODE_COLORS.values()]
    colors = {f: MODE_COLORS.get(f) or spare[i % len(spare)] for i, f in enumerate(families)}
    kinds: set[str] = set()
    labelled: list[tuple[Any, list[tuple[float, float, str, float]]]] = []
    for (cell, step), ax in zip(panels, axs[0]):
        g = w[(w["cell_id"] == cell) & (w["step"] == step)]
        has_peak = "peak_memory" in g and bool(g["peak_memory"].notna().all())
        col = "peak_memory" if has_peak else "activation_memory"
        kinds.add("CUDA peak memory of a training step" if has_peak else "bytes autograd saves")
        mems = g[col].astype(float) if col in g else None
        biggest = float(mems.max()) if mems is not None and mems.notna().any() else 0.0
        pts = []
        for r in g.itertuples():
            mem = float(getattr(r, col)) if mems is not None else float("nan")
            ok = mem == mem and biggest > 0
            area = max(SIZE_MIN, SIZE_MAX * mem / biggest) if ok else SIZE_MIN
            fam = mode_family(r.variant)
            bad = (r.cell_id, r.step, r.variant) in flagged
            yv = max(float(r.grad_rel_error), 1e-16)
            ax.scatter(
                [r.backward_ms_median], [yv], s=area, c="none" if bad else colors[fam],
                edgecolors=colors[fam], linewidths=1.5, alpha=0.75, gid=f"{r.cell_id}|{r.variant}",
            )  # fmt: skip
            text = f"{r.variant} ({mem:.3g} MiB)" if ok else str(r.variant)
            pts.append((float(r.backward_ms_median), yv, text, math.sqrt(area) / 2.0))
        ax.set_yscale("log")
        xs = [p[0] for p in pts if p[0] > 0]
        log_x = bool(xs) and max(xs) / min(xs) > 20
        if log_x:
            ax.set_xscale("log")
        ax.margins(x=0.25, y=0.2)
        if not log_x:
            ax.set_xlim(left=0.0)  # a time: the linear axis starts at 0, not in the margin
        ax.set_xlabel("backward time (ms, median over repeats)")
        ax.set_ylabel("gradient relative error vs float64 reference")
        when = f", step {step}" if len(steps) > 1 else ""
        ax.set_title(f"{labels.get(cell, cell)}{when}: largest marker {biggest:.3g} MiB",
                     fontsize="small")  # fmt: skip
        ax.grid(alpha=0.3)
        labelled.append((ax, pts))
    fig.suptitle(
        "Backward modes: gradient error against backward time (lower left is better)",
        fontsize="medium",
    )
    fam_h = [Line2D([], [], ls="none", marker="o", color=colors[f]) for f in families]
    axs[0][-1].legend(
        fam_h, families, title="backward mode", loc="upper left", bbox_to_anchor=(1.03, 1.0),
        borderaxespad=0.0, fontsize="x-small", title_fontsize="x-small",
    )  # fmt: skip
    notes: list[tuple[dict[str, Any] | None, str]] = [
        (
            {"ls": "none", "marker": "o", "color": "grey", "ms": 9, "alpha": 0.6},
            f"marker area: {' / '.join(sorted(kinds))}, in proportion within each panel "
            "(MiB in brackets)",
        ),
    ]
    if flagged & set(map(tuple, w[["cell_id", "step", "variant"]].values.tolist())):
        notes.append(
            (
                {"ls": "none", "marker": "o", "mfc": "none", "mec": "black"},
                "hollow: flagged (the variant's solves missed tolerance; see results.csv note)",
            )
        )
    plots.notes_legend(fig, notes)
    fig.canvas.draw()  # the constrained layout first: labels are placed in final coordinates
    for ax, pts in labelled:
        _place_labels(ax, pts)
    return fig


def _backward_plots(df: Any, run_dir: Any) -> dict[str, Any]:
    from ..run import plots

    out = {}
    fig = plot_memory_vs_iterations(plots.read_series(run_dir, "backward_memory"), df)
    if fig is not None:
        out["backward_memory"] = fig
    fig = plot_accuracy_vs_time(df)
    if fig is not None:
        out["backward_accuracy"] = fig
    return out


def _solver_overhead_plots(df: Any, run_dir: Any) -> dict[str, Any]:
    """Bar chart: median time to tolerance per solver, one panel per (cell, tol)."""
    from ..run import plots

    d = df[(df["analysis"] == "solver_overhead") & (df["metric"] == "time_ms_median")]
    d = d.dropna(subset=["value"])
    if d.empty:
        return {}
    parts = d["variant"].str.rpartition("-tol=")
    d = d.assign(tol=parts[2], solver_label=parts[0])
    panels = sorted(
        {(c, t, s) for c, t, s in zip(d["cell_id"], d["tol"], d["step"].fillna(-1))}, key=str
    )
    fig = plots.new_figure(4.5, 3.5, ncols=len(panels))
    labels = plots.short_labels(sorted(set(d["cell_id"])))
    for ax, (cell, tol, step) in zip(fig.axes, panels):
        g = d[(d["cell_id"] == cell) & (d["tol"] == tol) & (d["step"].fillna(-1) == step)]
        g = g.groupby("solver_label")["value"].median()
        ax.bar(range(len(g)), g.values, color="tab:blue")
        ax.set_xticks(range(len(g)), g.index, rotation=45, ha="right", fontsize=8)
        ax.set_ylabel("time to tolerance (ms)")
        ax.set_title(f"{labels.get(cell, cell)} tol={tol} step={int(step)}", fontsize=9)
    return {"solver_overhead": fig}
