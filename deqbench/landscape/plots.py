"""Figures of the landscape and Hessian analyses: DataFrame -> matplotlib ``Figure`` (Agg).

Inputs are the analyses' series (``plots.read_series(run_dir, "landscape")`` and
``"hessian_density"``), with ``cell_id`` and ``seed`` columns when several are concatenated.
Landscape contours, surfaces and curves are drawn from the converged points only (``loss``; it is
NaN where a DEQ's forward solver missed its tolerance): a contour or surface has a hole there and a
curve breaks. The unconverged points (``converged`` false) are drawn on top as red crosses at their
measured loss (``loss_raw``), so they are visible but never part of a curve. Where the series has
``f_converged_frac`` (share of examples whose solve reached the tolerance), a cross's size grows
with the share that did not, so a point where 4% of examples missed the tolerance is a small mark
and one where most did is a large one. An unconverged centre (the trained weights: the analysis
flags its rows) is named in the panel. Where convergence was not measured (no deqbench DEQ layer)
the caption says so.

Example:
    >>> from deqbench.run.plots import read_series, save_figure
    >>> from deqbench.landscape.plots import landscape_contours
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


def _unconverged(g: Any) -> Any:
    """Boolean Series: points whose solve was measured and missed the tolerance (``converged``
    is True / False where measured, empty where not)."""
    if "converged" not in g:
        return g["alpha"].notna() & False
    c = g["converged"]
    return c.notna() & ~c.fillna(True).astype(bool)


def _measured(series: Any) -> bool:
    return "converged" in series and bool(series["converged"].notna().any())


def _loss_label(series: Any) -> str:
    if "accuracy" in series:
        return "loss (cross-entropy)"
    if "mse" in series:
        return "loss (MSE)"
    return "loss"


def _caption(series: Any, at_loss: bool = True) -> str:
    if not _measured(series):
        return "solver convergence not measured (no deqbench DEQ layer)"
    return "converged points only; red x: solver not converged" + (
        ", at its measured loss" if at_loss else ""
    )


def _centre_flag(ax: Any, g: Any, three_d: bool = False) -> None:
    sel = g["alpha"] == 0.0
    if "beta" in g and g["beta"].notna().any():
        sel &= g["beta"] == 0.0
    c = g[sel]
    if len(c) and bool(_unconverged(c).iloc[0]):
        text = "centre (trained weights) not converged: flagged"
        box = dict(facecolor="white", alpha=0.85, edgecolor="firebrick", linewidth=0.5)
        kw = dict(fontsize="x-small", color="firebrick", va="top", bbox=box, zorder=5)
        if three_d:
            ax.text2D(0.02, 0.98, text, transform=ax.transAxes, **kw)
        else:
            ax.text(0.02, 0.98, text, transform=ax.transAxes, **kw)


def _grid(g: Any, col: str) -> tuple[Any, Any, Any]:
    piv = g.pivot_table(index="beta", columns="alpha", values=col, aggfunc="first", dropna=False)
    return piv.columns.to_numpy(float), piv.index.to_numpy(float), piv.to_numpy(float)


def _levels(series: Any) -> Any:
    vals = series["loss"].to_numpy(float)
    vals = vals[np.isfinite(vals)]
    if vals.size == 0:
        return None
    lo = float(vals.min())
    hi = float(np.quantile(vals, 0.95))
    if not hi > lo:
        hi = lo + max(abs(lo), 1.0) * 1e-3
    return np.linspace(lo, hi, 21)


def _mark_unconverged(ax: Any, g: Any) -> bool:
    bad = g[_unconverged(g)]
    if bad.empty:
        return False
    ys = bad["beta"] if "beta" in bad and bad["beta"].notna().any() else bad["loss_raw"]
    size: Any = 14
    label = "solver not converged"
    if "f_converged_frac" in bad and bad["f_converged_frac"].notna().any():
        missed = (1.0 - bad["f_converged_frac"].astype(float).fillna(0.0)).clip(0.0, 1.0)
        size = 8.0 + 40.0 * missed.to_numpy()
        label = "solver not converged (size: share of examples that missed)"
    ax.scatter(
        bad["alpha"], ys, marker="x", color="red", s=size, linewidths=0.6, alpha=0.8, label=label
    )
    return True


def _panel_title(label: str, g: Any) -> str:
    bad = int(_unconverged(g).sum())
    if not _measured(g):
        return label
    tail = f"{bad} of {len(g)} points not converged"
    return f"{label}\n{tail}" if label else tail


def landscape_contour(g: Any, ax: Any, levels: Any = None, title: str = "") -> Any:
    """Filled contour of one 2-D grid's converged points on ``ax`` (holes where the solver did
    not converge), unconverged points marked. Returns the mappable."""
    x, y, z = _grid(g, "loss")
    zm = np.ma.masked_invalid(z)
    cs = None
    if zm.count() >= 4:
        cs = ax.contourf(x, y, zm, levels=levels, cmap="viridis", extend="max")
        ax.contour(x, y, zm, levels=levels, colors="k", linewidths=0.3)
    ax.plot([0], [0], marker="*", color="white", markeredgecolor="k", ms=9, label="trained weights")
    _mark_unconverged(ax, g)
    _centre_flag(ax, g)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), fontsize="x-small", frameon=False)
    ax.set_xlabel("alpha (along d1)")
    ax.set_ylabel("beta (along d2)")
    ax.set_xlim(float(np.min(x)), float(np.max(x)))
    ax.set_ylim(float(np.min(y)), float(np.max(y)))
    ax.set_aspect("equal")
    ax.set_title(title, fontsize="small")
    return cs


def landscape_contours(series: Any) -> Any:
    """One contour panel per cell (and seed), with shared levels so panels compare."""
    groups = _groups(series)
    n = len(groups)
    ncols = min(n, 4)
    nrows = math.ceil(n / ncols)
    fig = _new(max(3.6 * ncols + 0.8, 6.5), 4.0 * nrows + 0.5)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    levels = _levels(series)
    cs = None
    for ax, (label, g) in zip(axes, groups):
        cs = landscape_contour(g, ax, levels, _panel_title(label, g)) or cs
    for ax in axes[n:]:
        ax.set_visible(False)
    if cs is not None:
        fig.colorbar(cs, ax=list(axes[:n]), shrink=0.8, label=_loss_label(series), format="%.3g")
    fig.suptitle(
        "loss landscape on filter-normalised directions d1, d2\n("
        + _caption(series, at_loss=False)
        + ")",
        fontsize="medium",
    )
    return fig


def landscape_surfaces(series: Any) -> Any:
    """3-D loss surface of the converged points per cell (holes where the solver did not
    converge); unconverged points as red crosses at their measured loss."""
    groups = _groups(series)
    n = len(groups)
    ncols = min(n, 4)
    nrows = math.ceil(n / ncols)
    fig = _new(max(4.6 * ncols, 6.5), 4.4 * nrows + 0.8)
    zlabel = _loss_label(series)
    for i, (label, g) in enumerate(groups):
        ax = fig.add_subplot(nrows, ncols, i + 1, projection="3d")
        x, y, z = _grid(g, "loss")
        X, Y = np.meshgrid(x, y)
        if np.isfinite(z).any():
            ax.plot_surface(
                X, Y, np.ma.masked_invalid(z), cmap="viridis", linewidth=0, antialiased=True
            )
        bad = g[_unconverged(g)]
        if not bad.empty:
            ax.scatter(
                bad["alpha"], bad["beta"], bad["loss_raw"], marker="x", color="red", s=10,
                label="not converged",
            )  # fmt: skip
            ax.legend(loc="upper right", fontsize="x-small")
        _centre_flag(ax, g, three_d=True)
        from matplotlib.ticker import MaxNLocator

        for axis_ in (ax.xaxis, ax.yaxis, ax.zaxis):
            axis_.set_major_locator(MaxNLocator(5))
        ax.tick_params(labelsize="x-small")
        ax.set_xlabel("alpha (d1)", fontsize="small")
        ax.set_ylabel("beta (d2)", fontsize="small")
        ax.set_zlabel(zlabel, fontsize="small", labelpad=4)
        ax.set_box_aspect(None, zoom=0.82)  # room for the z label
        ax.set_title(_panel_title(label, g), fontsize="small")
    fig.suptitle(
        "loss surface on filter-normalised directions d1, d2\n(" + _caption(series) + ")",
        fontsize="small",
    )
    return fig


def landscape_curves(series: Any) -> Any:
    """1-D slices through the centre: loss along d1 (beta = 0) and along d2 (alpha = 0), one line
    per cell through its converged points only (the line breaks where the solver did not
    converge); unconverged points are red crosses at their measured loss."""
    two_d = "beta" in series and series["beta"].notna().any()
    fig = _new(10.0 if two_d else 5.5, 4.4)
    axes = fig.subplots(1, 2 if two_d else 1, squeeze=False).ravel()
    marked = False
    for label, g in _groups(series):
        cuts = [("alpha", g[g["beta"] == 0.0] if two_d else g)]
        if two_d:
            cuts.append(("beta", g[g["alpha"] == 0.0]))
        for ax, (coord, c) in zip(axes, cuts):
            c = c.sort_values(coord)
            # ``loss`` is NaN at unconverged points: the line breaks there
            ax.plot(c[coord], c["loss"], marker="o", ms=2, label=label or None)
            bad = c[_unconverged(c)]
            if not bad.empty:
                ax.scatter(
                    bad[coord], bad["loss_raw"], marker="x", color="red", s=16, zorder=3,
                    label=None if marked else "not converged (measured loss)",
                )  # fmt: skip
                marked = True
    for ax, coord in zip(axes, ["alpha (along d1, beta = 0)", "beta (along d2, alpha = 0)"]):
        ax.set_xlabel(coord)
        ax.set_ylabel(_loss_label(series))
        ax.grid(True, alpha=0.3)
    if any(lbl for lbl, _ in _groups(series)) or marked:
        axes[0].legend(fontsize="x-small")
    fig.suptitle("1-D slices through the trained weights (" + _caption(series) + ")",
                 fontsize="medium")  # fmt: skip
    return fig
