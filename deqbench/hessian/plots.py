"""Figure of the Hessian analysis: its SLQ density series (``plots.read_series(run_dir,
"hessian_density")``) -> matplotlib ``Figure`` (Agg), one line per cell and seed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..landscape.plots import _groups, _new


def _hvp_method(g: Any) -> str:
    """How a cell's HVPs were taken: the series' ``backend`` and ``fd_fallback`` columns."""
    backend = str(g["backend"].iloc[0]) if "backend" in g and len(g) else ""
    fallback = "fd_fallback" in g and len(g) and bool(g["fd_fallback"].iloc[0])
    if fallback:
        return "finite-difference fallback"
    return {"fd": "finite differences", "autograd": "autograd", "pyhessian": "pyhessian"}.get(
        backend, backend
    )


def hessian_density(series: Any, eigs: Any = None, unreliable: Any = ()) -> Any:
    """SLQ eigenvalue density (Gaussian-smoothed, log scale) per cell; dashed lines at the top
    eigenvalues when ``eigs`` (rows with cell_id, seed, eigenvalue) is given. Cells in
    ``unreliable`` ((cell_id, seed) pairs whose estimates are flagged, e.g. a forward solve that
    missed its tolerance) are not drawn (their values can be arbitrary) but named in a note.
    How the HVPs were taken (autograd, finite differences, or the finite-difference fallback
    after the backend failed its gates) is in the title, and per cell in the legend when the
    cells differ."""
    fig = _new(7.0, 4.2)
    ax = fig.subplots()
    skipped = []
    groups = _groups(series)
    methods = {lbl: _hvp_method(g) for lbl, g in groups}
    drawn_methods = []
    for label, g in groups:
        if "cell_id" in g and (g["cell_id"].iloc[0], int(g["seed"].iloc[0])) in set(unreliable):
            skipped.append(label)
            continue
        drawn_methods.append(methods[label])
        (line,) = ax.plot(
            g["lambda"], np.maximum(g["density"].to_numpy(float), 1e-12), label=label or None
        )
        if eigs is not None and "cell_id" in g:
            e = eigs[
                (eigs["cell_id"] == g["cell_id"].iloc[0]) & (eigs["seed"] == g["seed"].iloc[0])
            ]
            for v in e["eigenvalue"].to_numpy(float)[:1]:
                ax.axvline(v, color=line.get_color(), ls="--", lw=0.8)
    distinct = list(dict.fromkeys(m for m in drawn_methods if m))
    if len(distinct) > 1:  # say it per cell
        for ln in ax.get_lines():
            lbl = ln.get_label()
            if lbl in methods and methods[lbl]:
                ln.set_label(f"{lbl} [{methods[lbl]}]")
    ax.set_yscale("log")
    ax.set_ylim(bottom=1e-6)
    ax.set_xlabel("eigenvalue of the loss Hessian")
    ax.set_ylabel("density (SLQ)")
    how = f"SLQ on {distinct[0]} HVPs" if len(distinct) == 1 else "SLQ"
    sub = "dashed: top eigenvalue"
    if "finite-difference fallback" in distinct:
        if len(distinct) == 1:
            how = "SLQ on finite-difference HVPs"
        sub = "finite-difference fallback: the autograd HVPs failed their gates; " + sub
    ax.set_title(f"Hessian eigenvalue density ({how})\n{sub}", fontsize="medium")
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
    if len(skipped) < len(groups) and any(lbl for lbl, _ in groups):
        ax.legend(fontsize="x-small")
    return fig
