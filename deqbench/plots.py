"""Drawing deqbench figures: the one public module for analyses' plots (built-in and plugin).

An analysis declares its figures as a ``plot`` classmethod (:class:`deqbench.analyses.base.Analysis`);
a figure that belongs to no analysis registers with :func:`register`. Both get the run's results
DataFrame and the run directory and return ``{figure name: Figure}``; ``deqbench run`` and
``deqbench plot RUN_DIR`` save each as ``plots/<figure name>.png``.

Helpers, so a figure looks like every other deqbench figure:

* :func:`new_figure` (``width, height, ncols``): a Figure on the Agg canvas with ``ncols`` axes;
* :func:`lines` (``ax, df, x, title, ylabel``): one line per cell (median over seeds, min-max
  band), each cell its own (colour, line style), duplicates unhidden;
* :func:`legend` (``fig, ax``): the cells of ``ax`` right of the panels, titled with the id
  parts all of them share;
* :func:`read_series` (``run_dir, name``): the per-cell curves an analysis wrote with
  ``ctx.write_series``; :func:`save_figure`; the many-cell style helpers :func:`cell_groups`,
  :func:`cell_styles`, :func:`group_legend`, :func:`notes_legend`, :func:`flagged_cells`.

Example (an analysis's figure)::

    from deqbench import plots

    class WeightNorm(Analysis):
        ...
        @classmethod
        def plot(cls, df, run_dir):
            d = df[(df.analysis == "weight_norm") & (df.status == "ok")]
            if d.empty:
                return {}
            fig = plots.new_figure()
            plots.lines(fig.axes[0], d.assign(epoch=d.step), "epoch", "weight norm", "||theta||")
            plots.legend(fig, fig.axes[0])
            return {"weight_norm": fig}
"""

from __future__ import annotations

from .run.plots import (
    PALETTE,
    UNCONVERGED,
    cell_groups,
    cell_styles,
    flagged_cells,
    get,
    group_legend,
    legend,
    lines,
    names,
    new_figure,
    notes_legend,
    read_series,
    register,
    save_figure,
    short_labels,
)

__all__ = [
    "PALETTE",
    "UNCONVERGED",
    "cell_groups",
    "cell_styles",
    "flagged_cells",
    "get",
    "group_legend",
    "legend",
    "lines",
    "names",
    "new_figure",
    "notes_legend",
    "read_series",
    "register",
    "save_figure",
    "short_labels",
]
