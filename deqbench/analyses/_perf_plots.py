"""Plots of the performance analyses (``backward``, ``solver_overhead``), registered with
:mod:`deqbench.plots` when the analysis modules are imported."""

from __future__ import annotations

from typing import Any


def plot_memory_vs_iterations(series: Any) -> Any | None:
    """Activation (and, where measured, peak) memory against forward iterations, per cell and
    mode: IFT flat, unrolled linear."""
    from .. import plots

    if series is None or len(series) == 0:
        return None
    has_peak = "peak_mib" in series and series["peak_mib"].notna().any()
    fig = plots.new_figure(5.0, 3.6, ncols=2 if has_peak else 1)
    labels = plots.short_labels(sorted(set(series["cell_id"])))
    cols = [("activation_mib", "activation memory (MiB)")]
    if has_peak:
        cols.append(("peak_mib", "peak memory (MiB)"))
    for ax, (col, ylabel) in zip(fig.axes, cols):
        for (cell, mode, step), g in series.groupby(["cell_id", "mode", "step"]):
            g = g.sort_values("iterations")
            ax.plot(
                g["iterations"],
                g[col],
                marker="o",
                ls="-" if mode == "unrolled" else "--",
                label=f"{labels.get(cell, cell)} {mode} (step {step})",
            )
        ax.set_xlabel("forward iterations N (unrolled K = N)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    fig.axes[0].legend(fontsize=7)
    return fig


def plot_accuracy_vs_time(df: Any) -> Any | None:
    """Gradient relative error against training-step time, one point per backward variant."""
    from .. import plots

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
    fig = plots.new_figure(6.0, 4.0)
    ax = fig.axes[0]
    labels = plots.short_labels(sorted(set(w["cell_id"])))
    for cell, g in w.groupby("cell_id"):
        ax.scatter(
            g["step_ms_median"], g["grad_rel_error"].clip(lower=1e-16), label=labels.get(cell, cell)
        )
        for r in g.itertuples():
            ax.annotate(r.variant, (r.step_ms_median, max(r.grad_rel_error, 1e-16)), fontsize=6)
    ax.set_xlabel("training step (ms, median)")
    ax.set_ylabel("gradient relative error vs float64 IFT")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def _backward_plots(df: Any, run_dir: Any) -> dict[str, Any]:
    from .. import plots

    out = {}
    fig = plot_memory_vs_iterations(plots.read_series(run_dir, "backward_memory"))
    if fig is not None:
        out["backward_memory"] = fig
    fig = plot_accuracy_vs_time(df)
    if fig is not None:
        out["backward_accuracy"] = fig
    return out


def _solver_overhead_plots(df: Any, run_dir: Any) -> dict[str, Any]:
    """Bar chart: median time to tolerance per solver, one panel per (cell, tol)."""
    from .. import plots

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


def _register() -> None:
    from .. import plots

    plots.register("backward")(_backward_plots)
    plots.register("solver_overhead")(_solver_overhead_plots)


_register()
