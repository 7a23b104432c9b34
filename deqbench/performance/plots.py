"""Plots of the performance analyses (``backward``, ``solver_overhead``), registered with
:mod:`deqbench.run.plots` when the analysis modules are imported."""

from __future__ import annotations

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


def plot_accuracy_vs_time(df: Any) -> Any | None:
    """Gradient relative error against training-step time: colour = cell, marker = backward
    variant; hollow = a flagged measurement (the variant's own solves missed tolerance)."""
    from matplotlib.lines import Line2D

    from ..run import plots

    d = df[(df["analysis"] == "backward") & df["metric"].isin(["grad_rel_error", "step_ms_median"])]
    d = d[d["variant"] != "reference"].dropna(subset=["value"])
    if d.empty:
        return None
    w = (
        d.pivot_table(
            index=["cell_id", "step", "variant"], columns="metric", values="value", aggfunc="median"
        )
        .dropna()
        .reset_index()
    )
    if w.empty or "grad_rel_error" not in w:
        return None
    flagged = set(
        map(tuple, d.loc[d["status"] == "flagged", ["cell_id", "step", "variant"]].values.tolist())
    )
    fig, axs = plots.new_grid(1, 1, 6.0, 4.0)
    ax = axs[0][0]
    ids = sorted({str(c) for c in w["cell_id"]})
    styles = plots.cell_styles(ids)
    labels = plots.short_labels(ids)
    variants = sorted(set(w["variant"]))
    by_marker = len(variants) <= len(plots.MARKERS)
    marker = {v: plots.MARKERS[i % len(plots.MARKERS)] for i, v in enumerate(variants)}
    for r in w.itertuples():
        col = styles[str(r.cell_id)]["color"]
        bad = (r.cell_id, r.step, r.variant) in flagged
        ax.plot(
            [r.step_ms_median],
            [max(r.grad_rel_error, 1e-16)],
            ls="none",
            marker=marker[r.variant] if by_marker else "o",
            ms=7,
            mec=col,
            mfc="none" if bad else col,
            mew=1.5,
            label="_point",
            gid=f"{r.cell_id}|{r.variant}",
        )
        if not by_marker:
            ax.annotate(r.variant, (r.step_ms_median, max(r.grad_rel_error, 1e-16)), fontsize=6)
    ax.set_xlabel("training step time (ms, median over repeats)")
    ax.set_ylabel("gradient relative error vs float64 reference")
    ax.set_yscale("log")
    ax.set_title("Gradient accuracy against cost, per backward variant", fontsize="medium")
    ax.grid(alpha=0.3)
    shared = plots.shared_parts(ids)
    cell_h = [Line2D([], [], ls="none", marker="o", color=styles[c]["color"]) for c in ids]
    ax.legend(
        cell_h,
        [labels[c] for c in ids],
        title="cell" + (f" (all: {'-'.join(shared)})" if shared else ""),
        loc="upper left",
        bbox_to_anchor=(1.03, 1.0),
        borderaxespad=0.0,
        fontsize="x-small",
        title_fontsize="x-small",
    )
    notes: list[tuple[dict[str, Any] | None, str]] = []
    if by_marker:
        notes.append((None, "marker = backward variant:"))
        notes += [({"ls": "none", "marker": marker[v], "color": "black"}, v) for v in variants]
    if flagged & set(map(tuple, w[["cell_id", "step", "variant"]].values.tolist())):
        notes.append(
            (
                {"ls": "none", "marker": "o", "mfc": "none", "mec": "black"},
                "hollow: flagged (the variant's solves missed tolerance; see results.csv note)",
            )
        )
    plots.notes_legend(fig, notes)
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
