"""Figures of the landscape and Hessian analyses: DataFrame -> matplotlib ``Figure`` (Agg).

Inputs are the analyses' series (``plots.read_series(run_dir, "landscape")`` and
``"hessian_density"``), with ``cell_id`` and ``seed`` columns when several are concatenated.
Surfaces and curves show the measured loss (``loss_raw``) everywhere, and points where a DEQ's
forward solver did not converge (``converged`` false; their ``loss`` is NaN in the CSV and in the
summaries) are marked with red crosses on top, so they are visible but never silently mixed in.
Where the series has ``f_converged_frac`` (share of examples whose solve reached the tolerance),
a cross's size grows with the share that did not, so a point where 4% of examples missed the
tolerance is a small mark and one where most did is a large one.

Example:
    >>> from deqbench.plots import read_series, save_figure
    >>> from deqbench.plots_analysis import landscape_contours
    >>> fig = landscape_contours(read_series("results/landscape/<run_id>", "landscape"))  # doctest: +SKIP
    >>> save_figure(fig, "contours.png")                                                   # doctest: +SKIP
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

MAX_PANELS = 12


def _new(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _groups(series: Any) -> list[tuple[str, Any]]:
    """(label, frame) per cell and seed (one panel each)."""
    if "cell_id" not in series:
        return [("", series)]
    out = []
    for (cell, seed), g in series.groupby(["cell_id", "seed"], sort=False):
        nseeds = series[series["cell_id"] == cell]["seed"].nunique()
        out.append((f"{cell}" + (f" seed={seed}" if nseeds > 1 else ""), g))
    return out[:MAX_PANELS]


def _grid(g: Any, col: str) -> tuple[Any, Any, Any]:
    piv = g.pivot_table(index="beta", columns="alpha", values=col, aggfunc="first", dropna=False)
    return piv.columns.to_numpy(float), piv.index.to_numpy(float), piv.to_numpy(float)


def _levels(series: Any) -> Any:
    vals = series["loss_raw"].to_numpy(float)
    vals = vals[np.isfinite(vals)]
    if vals.size == 0:
        return None
    lo = float(vals.min())
    hi = float(np.quantile(vals, 0.95))
    if not hi > lo:
        hi = lo + max(abs(lo), 1.0) * 1e-3
    return np.linspace(lo, hi, 21)


def _mark_unconverged(ax: Any, g: Any) -> bool:
    bad = g[~g["converged"].astype(bool)]
    if bad.empty:
        return False
    ys = bad["beta"] if "beta" in bad and bad["beta"].notna().any() else bad["loss_raw"]
    size: Any = 14
    label = "not converged"
    if "f_converged_frac" in bad and bad["f_converged_frac"].notna().any():
        missed = (1.0 - bad["f_converged_frac"].astype(float).fillna(0.0)).clip(0.0, 1.0)
        size = 2.0 + 40.0 * missed.to_numpy()
        label = "not converged (size: share of examples)"
    ax.scatter(
        bad["alpha"], ys, marker="x", color="red", s=size, linewidths=0.6, alpha=0.8, label=label
    )
    return True


def landscape_contour(g: Any, ax: Any, levels: Any = None, title: str = "") -> Any:
    """Filled contour of one 2-D grid on ``ax``; unconverged points marked. Returns the mappable."""
    x, y, z = _grid(g, "loss_raw")
    zm = np.ma.masked_invalid(z)
    cs = None
    if zm.count() >= 4:
        cs = ax.contourf(x, y, zm, levels=levels, cmap="viridis", extend="max")
        ax.contour(x, y, zm, levels=levels, colors="k", linewidths=0.3)
    ax.plot([0], [0], marker="*", color="white", markeredgecolor="k", ms=9)
    if _mark_unconverged(ax, g):
        ax.legend(loc="upper right", fontsize="x-small")
    ax.set_xlabel("alpha (d1)")
    ax.set_ylabel("beta (d2)")
    ax.set_aspect("equal")
    ax.set_title(title, fontsize="small")
    return cs


def landscape_contours(series: Any) -> Any:
    """One contour panel per cell (and seed), with shared levels so panels compare."""
    groups = _groups(series)
    n = len(groups)
    ncols = min(n, 4)
    nrows = math.ceil(n / ncols)
    fig = _new(max(3.6 * ncols + 0.8, 6.5), 3.4 * nrows + 0.3)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    levels = _levels(series)
    cs = None
    for ax, (label, g) in zip(axes, groups):
        cs = landscape_contour(g, ax, levels, label) or cs
    for ax in axes[n:]:
        ax.set_visible(False)
    if cs is not None:
        fig.colorbar(cs, ax=list(axes[:n]), shrink=0.8, label="loss")
    fig.suptitle(
        "loss landscape (filter-normalised directions; x: solver not converged)", fontsize="medium"
    )
    return fig


def landscape_surfaces(series: Any) -> Any:
    """3-D loss surface per cell; unconverged points as red crosses at their measured loss."""
    groups = _groups(series)
    n = len(groups)
    ncols = min(n, 4)
    nrows = math.ceil(n / ncols)
    fig = _new(3.8 * ncols, 3.4 * nrows)
    for i, (label, g) in enumerate(groups):
        ax = fig.add_subplot(nrows, ncols, i + 1, projection="3d")
        x, y, z = _grid(g, "loss_raw")
        X, Y = np.meshgrid(x, y)
        ax.plot_surface(
            X, Y, np.ma.masked_invalid(z), cmap="viridis", linewidth=0, antialiased=True
        )
        bad = g[~g["converged"].astype(bool)]
        if not bad.empty:
            ax.scatter(bad["alpha"], bad["beta"], bad["loss_raw"], marker="x", color="red", s=10)
        ax.set_xlabel("alpha")
        ax.set_ylabel("beta")
        ax.set_zlabel("loss")
        ax.set_title(label, fontsize="small")
    return fig


def landscape_curves(series: Any) -> Any:
    """1-D slices through the centre: loss along d1 (beta = 0) and along d2 (alpha = 0), one line
    per cell; unconverged points marked with red crosses."""
    two_d = "beta" in series and series["beta"].notna().any()
    fig = _new(10.0 if two_d else 5.5, 4.0)
    axes = fig.subplots(1, 2 if two_d else 1, squeeze=False).ravel()
    for label, g in _groups(series):
        cuts = [("alpha", g[g["beta"] == 0.0] if two_d else g)]
        if two_d:
            cuts.append(("beta", g[g["alpha"] == 0.0]))
        for ax, (coord, c) in zip(axes, cuts):
            c = c.sort_values(coord)
            ax.plot(c[coord], c["loss_raw"], marker="o", ms=2, label=label or None)
            bad = c[~c["converged"].astype(bool)]
            if not bad.empty:
                ax.scatter(bad[coord], bad["loss_raw"], marker="x", color="red", s=16, zorder=3)
    for ax, coord in zip(axes, ["alpha (d1, beta = 0)", "beta (d2, alpha = 0)"]):
        ax.set_xlabel(coord)
        ax.set_ylabel("loss")
        ax.grid(True, alpha=0.3)
    if any(lbl for lbl, _ in _groups(series)):
        axes[0].legend(fontsize="x-small")
    fig.suptitle(
        "1-D slices (red x: solver not converged, not part of the curve)", fontsize="medium"
    )
    return fig


def hessian_density(series: Any, eigs: Any = None, unreliable: Any = ()) -> Any:
    """SLQ eigenvalue density (Gaussian-smoothed, log scale) per cell; dashed lines at the top
    eigenvalues when ``eigs`` (rows with cell_id, seed, eigenvalue) is given. Cells in
    ``unreliable`` ((cell_id, seed) pairs whose estimates are flagged, e.g. a forward solve that
    missed its tolerance) are not drawn (their values can be arbitrary) but named in a note."""
    fig = _new(7.0, 4.2)
    ax = fig.subplots()
    skipped = []
    for label, g in _groups(series):
        if "cell_id" in g and (g["cell_id"].iloc[0], int(g["seed"].iloc[0])) in set(unreliable):
            skipped.append(label)
            continue
        (line,) = ax.plot(
            g["lambda"], np.maximum(g["density"].to_numpy(float), 1e-12), label=label or None
        )
        if eigs is not None and "cell_id" in g:
            e = eigs[
                (eigs["cell_id"] == g["cell_id"].iloc[0]) & (eigs["seed"] == g["seed"].iloc[0])
            ]
            for v in e["eigenvalue"].to_numpy(float)[:1]:
                ax.axvline(v, color=line.get_color(), ls="--", lw=0.8)
    ax.set_yscale("log")
    ax.set_ylim(bottom=1e-6)
    ax.set_xlabel("eigenvalue of the loss Hessian")
    ax.set_ylabel("density (SLQ)")
    ax.set_title("Hessian eigenvalue density (dashed: top eigenvalue)", fontsize="medium")
    ax.grid(True, alpha=0.3)
    if skipped:
        ax.text(
            0.01,
            0.98,
            "not drawn (estimates flagged unreliable):\n" + "\n".join(skipped),
            transform=ax.transAxes,
            fontsize="x-small",
            color="firebrick",
            va="top",
        )
    if len(skipped) < len(_groups(series)) and any(lbl for lbl, _ in _groups(series)):
        ax.legend(fontsize="x-small")
    return fig
