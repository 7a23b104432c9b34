"""The run report's own figures: forward/backward iterations per epoch
(:func:`iterations_per_epoch`), training curves (:func:`training_curves`) and residual traces
(:func:`residual_traces`, from the run's ``series/solver_trace__*.csv`` read by
:func:`read_series`). :mod:`deqbench.run.plots` registers them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .plot_style import (
    _USABLE,
    UNCONVERGED,
    _agg,
    _draw,
    _log_if_wide,
    _seeds_text,
    cell_groups,
    cell_meta,
    cell_tags,
    group_legend,
    new_grid,
    notes_legend,
    row_height,
    tag_notes,
    unhide_duplicates,
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
