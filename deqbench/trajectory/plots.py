"""Suite-level plots of the ``trajectory`` analysis (Nguyen 2022 figures 4.1-4.3): the cells
(e.g. the N(0, 1) and the small init) side by side, each cell in its own PCA plane.

* ``trajectory_residuals`` (Fig. 4.1): relative residual per forward iteration, one line per
  probe example (coloured by class) and the median, at the first recorded epoch;
* ``trajectory_pca`` (Fig. 4.2): the trajectories z^[i] projected on the cell's first two
  principal components at the first recorded epoch, from the start (x) to the fixed point (o);
* ``trajectory_epochs`` (Fig. 4.3): the same at every recorded epoch, one row per cell.

One seed is drawn (the lowest); panel titles give the measured init scale of the cell weights,
the epoch and the silhouette score of the fixed points by class in the plane.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..run import plots

TITLE = "trajectory"


def _grid(rows: int, cols: int, w: float = 4.2, h: float = 3.8) -> tuple[Any, Any]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w * cols + 1.2, h * rows + 0.6), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(rows, cols, squeeze=False)


def _rows(df: Any) -> Any:
    d = df[(df["analysis"] == TITLE) & (df["status"].isin(["ok", "flagged"]))]
    return d.assign(variant=d["variant"].fillna("").astype(str))


def _value(d: Any, cell: str, seed: int, metric: str, variant: str = "", step: Any = None) -> float:
    g = d[(d.cell_id == cell) & (d.seed == seed) & (d.metric == metric) & (d.variant == variant)]
    if step is not None:
        g = g[g["step"] == step]
    return float(g["value"].iloc[0]) if len(g) else float("nan")


def _cells(df: Any, series: Any) -> list[tuple[str, int, str]]:
    """(cell, seed, label) per cell with series, lowest seed, ordered by init weight std
    (largest first: N(0, 1) left, as in the paper)."""
    d = _rows(df)
    ids = sorted(series["cell_id"].unique())
    short = plots.short_labels(ids)
    out = []
    for c in ids:
        seed = int(series.loc[series.cell_id == c, "seed"].min())
        std = _value(d, c, seed, "cell_weight_std")
        scale = f"weights std {std:.3g} ~ N(0, {std**2:.3g})" if np.isfinite(std) else ""
        out.append((c, seed, f"{short[c]}\n{scale}".strip(), std))
    out.sort(key=lambda t: (-t[3] if np.isfinite(t[3]) else 0.0, t[0]))
    return [(c, s, lab) for c, s, lab, _ in out]


def _class_colors(labels: Any) -> dict[Any, Any]:
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    return {lab: cmap(i % 10) for i, lab in enumerate(sorted(set(labels)))}


def _class_legend(fig: Any, colors: dict[Any, Any]) -> None:
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=c, lw=2, label=str(k)) for k, c in colors.items()]
    fig.legend(handles=handles, title="class", loc="outside right upper", fontsize="x-small")


def residual_plot(df: Any, res: Any) -> Any | None:
    """Fig. 4.1: per-example relative residual per iteration, one panel per cell."""
    if res is None or res.empty:
        return None
    cells = _cells(df, res)
    d = _rows(df)
    fig, axes = _grid(1, len(cells))
    colors = _class_colors(res["label"].unique())
    for ax, (cell, seed, label) in zip(axes[0], cells):
        g = res[(res.cell_id == cell) & (res.seed == seed)]
        epoch = int(g["epoch"].min())
        g = g[g.epoch == epoch]
        wide = g.pivot(index="iteration", columns="example", values="rel_residual").sort_index()
        lab = g.drop_duplicates("example").set_index("example")["label"]
        its = wide.index.to_numpy() + 1
        for ex in wide.columns:
            ax.plot(its, np.maximum(wide[ex].to_numpy(float), 1e-12), lw=0.5, alpha=0.35,
                    color=colors[lab[ex]])  # fmt: skip
        ax.plot(its, wide.median(axis=1).to_numpy(float), color="black", lw=2, label="median")
        tol = _value(d, cell, seed, "tol", step=epoch)
        if np.isfinite(tol):
            ax.axhline(tol, color="grey", ls="--", lw=1, label=f"tol {tol:g}")
        ax.set_yscale("log")
        ax.set_xlabel("iteration (f-evaluations)")
        ax.set_ylabel("||f(z) - z|| / ||f(z)||")
        ax.set_title(f"{label}\nepoch {epoch}, seed {seed}", fontsize="small")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="x-small", loc="lower left")
    fig.suptitle("Forward residual per probe example (one line each, coloured by class)")
    _class_legend(fig, colors)
    return fig


def _draw_paths(ax: Any, g: Any, colors: dict[Any, Any]) -> None:
    g = g.assign(order=g["iteration"].where(g["iteration"] >= 0, np.iinfo(np.int64).max))
    g = g.sort_values(["example", "order"])
    for _, e in g.groupby("example", sort=False):
        xs, ys = e["pc1"].to_numpy(float), e["pc2"].to_numpy(float)
        c = colors[e["label"].iloc[0]]
        ax.plot(xs, ys, lw=0.5, alpha=0.35, color=c)
        ax.plot(xs[-1:], ys[-1:], "o", ms=2.5, color=c)
    start = g[g["iteration"] == g["iteration"][g["iteration"] >= 0].min()]
    ax.plot(start["pc1"], start["pc2"], "x", color="black", ms=4, alpha=0.6)


def _pca_title(d: Any, cell: str, seed: int, label: str, epoch: int) -> str:
    sil = _value(d, cell, seed, "silhouette", "pca2", step=epoch)
    return f"{label}\nepoch {epoch}: silhouette of fixed points {sil:.2f}"


def _axes_labels(ax: Any, d: Any, cell: str, seed: int) -> None:
    r1 = _value(d, cell, seed, "explained_variance_ratio", "pc1")
    r2 = _value(d, cell, seed, "explained_variance_ratio", "pc2")
    ax.set_xlabel(f"PC1 ({100 * r1:.0f}% of variance)")
    ax.set_ylabel(f"PC2 ({100 * r2:.0f}%)")
    ax.grid(True, alpha=0.3)


def pca_plot(df: Any, traj: Any) -> Any | None:
    """Fig. 4.2: PCA trajectories at the first recorded epoch, one panel per cell."""
    if traj is None or traj.empty:
        return None
    cells = _cells(df, traj)
    d = _rows(df)
    fig, axes = _grid(1, len(cells))
    colors = _class_colors(traj["label"].unique())
    for ax, (cell, seed, label) in zip(axes[0], cells):
        g = traj[(traj.cell_id == cell) & (traj.seed == seed)]
        epoch = int(g["epoch"].min())
        _draw_paths(ax, g[g.epoch == epoch], colors)
        ax.set_title(_pca_title(d, cell, seed, label, epoch), fontsize="small")
        _axes_labels(ax, d, cell, seed)
    fig.suptitle("Forward trajectories z^[i] in each cell's PCA plane (x: start, o: fixed point)")
    _class_legend(fig, colors)
    return fig


def epochs_plot(df: Any, traj: Any) -> Any | None:
    """Fig. 4.3: PCA trajectories at every recorded epoch; rows = cells, columns = epochs."""
    if traj is None or traj.empty:
        return None
    cells = _cells(df, traj)
    d = _rows(df)
    epochs = sorted(int(e) for e in traj["epoch"].unique())
    fig, axes = _grid(len(cells), len(epochs), 3.6, 3.4)
    colors = _class_colors(traj["label"].unique())
    for r, (cell, seed, label) in enumerate(cells):
        g = traj[(traj.cell_id == cell) & (traj.seed == seed)]
        for c, epoch in enumerate(epochs):
            ax = axes[r][c]
            ge = g[g.epoch == epoch]
            if ge.empty:
                ax.set_axis_off()
                ax.set_title(f"{label}\nepoch {epoch}: not recorded", fontsize="x-small")
                continue
            _draw_paths(ax, ge, colors)
            ax.set_title(_pca_title(d, cell, seed, label, epoch), fontsize="x-small")
            _axes_labels(ax, d, cell, seed)
    fig.suptitle("Forward trajectories during training (one PCA plane per cell, all epochs)")
    _class_legend(fig, colors)
    return fig


def trajectory_figures(df: Any, run_dir: Path) -> dict[str, Any]:
    out = {}
    res = plots.read_series(run_dir, "trajectory_residual")
    traj = plots.read_series(run_dir, "trajectory")
    for name, fig in (
        ("trajectory_residuals", residual_plot(df, res)),
        ("trajectory_pca", pca_plot(df, traj)),
        ("trajectory_epochs", epochs_plot(df, traj)),
    ):
        if fig is not None:
            out[name] = fig
    return out
