"""The built-in figures compared with the data they draw: many cells stay distinguishable,
legends list exactly the drawn cells (untruncated, outside the axes), solves that missed
tolerance are marked, an unrolled cell's epoch-0 solver pass is not joined to its K-step
training points, MSE and cross-entropy never share an axis, flagged cells are marked."""

from __future__ import annotations

import matplotlib.colors as mcolors
import pandas as pd
import pytest

from deqbench.run import plots
from deqbench.run.results import COLUMNS

SOLVERS = ("anderson", "broyden", "fixed_point")
LONG = "lr=0.02_batch_size=32"


def _row(cell: str, seed: int, analysis: str, variant: str, metric: str, step, value, **kw):
    model, solver, backward = cell.split("-")[:3]
    r = dict.fromkeys(COLUMNS, "")
    r.update(
        run_id="r",
        cell_id=cell,
        model=model,
        solver=solver,
        backward=backward,
        init="default",
        seed=seed,
        analysis=analysis,
        variant=variant,
        metric=metric,
        step=step,
        repeat=0,
        value=float(value),
        status="ok",
    )
    r.update(kw)
    return r


def _cells() -> list[str]:
    """24 cells: two families of 3 solvers x {ift, unrolled} with a long shared suffix, and
    12 single-cell models (one of them a denoiser)."""
    cells = [
        f"{m}-{s}-{b}-{LONG}" for m in ("fc", "conv") for s in SOLVERS for b in ("ift", "unrolled")
    ]
    cells += [f"model{i:02d}_tiny-fixed_point-ift-epochs=1" for i in range(11)]
    cells += ["denoiser_tiny-anderson-ift-denoise-epochs=1"]
    return cells


def _results(cells=None, unconverged=(), flagged=(), epochs=(0, 1, 2), diverged=()) -> pd.DataFrame:
    rows = []
    for i, cell in enumerate(cells or _cells()):
        unrolled = "-unrolled" in cell
        regression = cell.startswith("denoiser")
        for seed in (0, 1):
            for e in epochs:
                fw = 5.0 if unrolled and e >= 1 else 30.0 - 3 * e + i
                rows.append(_row(cell, seed, "solver_stats", "train", "forward_nstep", e, fw))
                conv = 0.0 if unrolled and e >= 1 else 1.0
                conv = 0.5 if (cell, e, "forward") in unconverged else conv
                rows.append(_row(cell, seed, "solver_stats", "train", "forward_converged", e, conv))
                if e >= 1 and not unrolled:
                    rows.append(_row(cell, seed, "solver_stats", "train", "backward_nstep", e, 12))
                    bconv = 0.75 if (cell, e, "backward") in unconverged else 1.0
                    rows.append(
                        _row(cell, seed, "solver_stats", "train", "backward_converged", e, bconv)
                    )
                for variant in ("train", "test"):
                    rows.append(_row(cell, seed, "metrics", variant, "loss", e, 2.0 - 0.1 * e))
                    second = "mse" if regression else "accuracy"
                    rows.append(_row(cell, seed, "metrics", variant, second, e, 0.1 + 0.2 * e))
            status = "flagged" if cell in flagged else "ok"
            status = "diverged" if (cell, seed) in diverged else status
            note = "forward solver did not converge" if cell in flagged else ""
            rows.append(
                _row(cell, seed, "runner", "", "wall_time", "", 1.0, status=status, note=note)
            )
    return pd.DataFrame(rows, columns=COLUMNS)


def _cell_lines(ax):
    """The lines of ``ax`` that draw a cell (not its marks): label -> Line2D."""
    return [ln for ln in ax.get_lines() if not ln.get_label().startswith("_")]


def _ax(fig, title: str):
    (ax,) = [a for a in fig.axes if a.get_title() == title]
    return ax


def _legend_texts(ax) -> list[str]:
    leg = ax.get_legend()
    return [] if leg is None else [t.get_text() for t in leg.get_texts()]


def _rows_of(fig):
    """The figure's panel rows (lists of axes), from its grid."""
    rows: dict[int, list] = {}
    for ax in fig.axes:
        rows.setdefault(ax.get_subplotspec().rowspan.start, []).append(ax)
    return [rows[k] for k in sorted(rows)]


def test_many_cells_get_categorical_unique_styles_and_full_legends():
    df = _results()
    fig = plots.iterations_per_epoch(df)
    fig.canvas.draw()
    tab10 = {mcolors.to_hex(c) for c in mcolors.TABLEAU_COLORS.values()}
    all_labels = []
    for row in _rows_of(fig):
        drawn = {ln.get_label() for ax in row for ln in _cell_lines(ax)}
        legend = {t.removesuffix(" [flagged]") for ax in row for t in _legend_texts(ax)}
        assert drawn == legend and drawn  # legend entries == drawn lines, per row
        all_labels += sorted(legend)
        for ax in row:
            styles = [
                (mcolors.to_hex(ln.get_color()), str(ln.get_linestyle())) for ln in _cell_lines(ax)
            ]
            assert len(styles) == len(set(styles)), styles  # no two cells alike
            assert {c for c, _ in styles} <= tab10  # a categorical palette, no colour map
        legend_ax = row[-1]
        leg = legend_ax.get_legend()
        # outside the axes, right of them
        assert leg.get_window_extent().x0 >= legend_ax.get_window_extent().x1
    assert not any(t.endswith("...") for t in all_labels)
    # the shared suffix is dropped from labels and written in the legend title
    assert "anderson-ift" in all_labels
    assert any(LONG in ax.get_legend().get_title().get_text() for ax in fig.axes if ax.get_legend())
    # every cell with solver rows is drawn once per panel kind (forward: all 24)
    fw = [ln for row in _rows_of(fig) for ln in _cell_lines(row[0])]
    assert sorted(ln.get_gid() for ln in fw) == sorted(_cells())


def test_cell_styles_unique_up_to_80_cells():
    ids = [f"m-s{i:03d}" for i in range(80)]
    st = plots.cell_styles(ids)
    assert len({(s["color"], str(s["linestyle"])) for s in st.values()}) == 80


def test_unrolled_cells_epoch0_is_joined_to_their_k_steps():
    """An unrolled cell trains and evaluates with its K plain steps: its epoch-0 pass
    is the same computation as the training points and sits on their line, hollow."""
    df = _results()
    fig = plots.iterations_per_epoch(df)
    cell = f"fc-anderson-unrolled-{LONG}"
    forward = _ax(fig, "fc: forward solve")
    (line,) = [ln for ln in _cell_lines(forward) if ln.get_gid() == cell]
    assert list(line.get_xdata()) == [0.0, 1.0, 2.0]
    (pt,) = [
        ln for ln in forward.get_lines() if ln.get_gid() == cell and ln.get_label() == "_hollow"
    ]
    assert list(pt.get_xdata()) == [0.0] and pt.get_linestyle() == "None"
    assert pt.get_markerfacecolor() in ("white", (1.0, 1.0, 1.0, 1.0))
    ift = f"fc-anderson-ift-{LONG}"
    (line,) = [ln for ln in _cell_lines(forward) if ln.get_gid() == ift]
    assert list(line.get_xdata()) == [0.0, 1.0, 2.0]
    # K plain steps are not solves: no unconverged mark on the unrolled points
    marks = [ln for ln in forward.get_lines() if ln.get_label() == "_unconverged"]
    assert not [m for m in marks if m.get_gid() == cell]
    texts = [t.get_text() for leg in fig.legends for t in leg.get_texts()]
    assert any("K plain steps they train and evaluate with" in t for t in texts)


def test_solves_that_missed_tolerance_are_marked():
    fc_ift = f"fc-broyden-ift-{LONG}"
    df = _results(unconverged={(fc_ift, 1, "forward"), (fc_ift, 2, "backward")})
    fig = plots.iterations_per_epoch(df)
    fw_ax, bw_ax = _ax(fig, "fc: forward solve"), _ax(fig, "fc: backward (adjoint) solve")
    for ax, epoch in ((fw_ax, 1.0), (bw_ax, 2.0)):
        marks = [ln for ln in ax.get_lines() if ln.get_label() == "_unconverged"]
        assert [(m.get_gid(), list(m.get_xdata())) for m in marks] == [(fc_ift, [epoch])]
        (line,) = [ln for ln in _cell_lines(ax) if ln.get_gid() == fc_ift]
        y = dict(zip(line.get_xdata(), line.get_ydata()))
        assert marks[0].get_ydata()[0] == y[epoch]  # on the point, not elsewhere
    texts = [t.get_text() for leg in fig.legends for t in leg.get_texts()]
    assert any("missed tolerance" in t for t in texts)
    # none without such a solve
    fig = plots.iterations_per_epoch(_results(cells=[fc_ift, f"fc-anderson-ift-{LONG}"]))
    assert not [ln for ax in fig.axes for ln in ax.get_lines() if ln.get_label() == "_unconverged"]
    assert not any(
        "missed tolerance" in t.get_text() for leg in fig.legends for t in leg.get_texts()
    )


def test_identical_lines_are_not_hidden():
    # a plugin suite: the solvers differ, the adjoint solver (and its counts) does not
    cells = [f"sine-{s}-ift" for s in ("anderson", "relaxed_picard", "broyden")]
    fig = plots.iterations_per_epoch(_results(cells=cells))
    bw = fig.axes[1]
    widths = [ln.get_linewidth() for ln in _cell_lines(bw)]
    assert len(widths) == 3 and widths[0] > widths[1] > widths[2]  # all 12 f-evals


def test_training_curves_split_by_task_and_label_units():
    df = _results()
    fig = plots.training_curves(df)
    units = {"cross-entropy (nats)", "MSE (mean over elements)", "accuracy (%)"}
    for ax in fig.axes:
        if not ax.axison:
            continue
        assert ax.get_xlabel() == "epoch" and ax.get_ylabel() in units
        cells = {ln.get_gid() for ln in _cell_lines(ax)}
        regression = {c for c in cells if c.startswith("denoiser")}
        assert not regression or regression == cells  # MSE never with cross-entropy
        if ax.get_ylabel().startswith("MSE"):
            assert regression == cells
    titles = [ax.get_title() for ax in fig.axes if ax.axison]
    assert len(titles) == len(set(titles))
    acc = [ax for ax in fig.axes if ax.get_ylabel() == "accuracy (%)"][0]
    assert max(ln.get_ydata().max() for ln in _cell_lines(acc)) == pytest.approx(50.0)
    # regression only (the ntk run): loss and mse are one quantity, drawn once per variant
    reg = _results(cells=["denoiser_tiny-anderson-ift-denoise-epochs=1"])
    fig = plots.training_curves(reg)
    titles = [ax.get_title() for ax in fig.axes if ax.axison]
    assert titles == ["denoiser_tiny: train MSE", "denoiser_tiny: test MSE"]
    leg_texts = [t for ax in fig.axes for t in _legend_texts(ax)]
    assert leg_texts == ["denoiser_tiny-anderson-ift-denoise-epochs=1"]


def test_flagged_cells_are_marked_in_the_legend():
    cells = [f"fc-{s}-ift-{LONG}" for s in SOLVERS]
    df = _results(cells=cells, flagged={cells[1]}, diverged={(cells[2], 1)})
    for fig in (plots.iterations_per_epoch(df), plots.training_curves(df)):
        texts = [t for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
        tagged = [t for t in texts if t.get_text().endswith("]")]
        assert [t.get_text() for t in tagged] == [
            "broyden [flagged]",
            "fixed_point [diverged 1/2 seeds]",
        ]
        assert {mcolors.to_hex(t.get_color()) for t in tagged} == {plots.FLAG_COLOR.lower()}
        notes = [t.get_text() for leg in fig.legends for t in leg.get_texts()]
        assert any(n.startswith("[flagged]") for n in notes)
        assert any(n.startswith("[diverged]") for n in notes)


def test_residual_traces_side_by_side_legend_clear_of_title_and_unconverged_end_marked():
    cells = [f"fc-{s}-ift-{LONG}" for s in SOLVERS]
    traces = pd.concat(
        pd.DataFrame(
            {
                "cell_id": c,
                "seed": 0,
                "phase": ["init"] * 3 + ["final"] * 3,
                "layer": 0,
                "iteration": [1, 2, 3] * 2,
                "rel_max": [1.0, 0.1, 0.01 * (i + 1), 1.0, 0.2, 0.02],
            }
        )
        for i, c in enumerate(cells)
    )
    df = _results(cells=cells)
    df = pd.concat(
        [
            df,
            pd.DataFrame(
                [
                    _row(c, 0, "solver_stats", "test", "forward_converged", e, v)
                    for c in cells
                    for e, v in ((0, 1.0), (2, 0.0 if c == cells[0] else 1.0))
                ]
            ),
        ]
    )
    fig = plots.residual_traces(traces, df)
    fig.canvas.draw()
    init_ax, final_ax = fig.axes
    assert "init" in init_ax.get_title() and "after training" in final_ax.get_title()
    assert final_ax.get_xlabel() and final_ax.get_ylabel() == "max relative residual"
    leg = final_ax.get_legend()
    assert leg.get_window_extent().x0 >= final_ax.get_window_extent().x1
    assert not leg.get_window_extent().overlaps(final_ax.title.get_window_extent())
    assert sorted(_legend_texts(final_ax)) == sorted(ln.get_label() for ln in _cell_lines(final_ax))
    marks = [
        (ln.get_gid(), ax)
        for ax in fig.axes
        for ln in ax.get_lines()
        if ln.get_label() == "_unconverged"
    ]
    assert marks == [(cells[0], final_ax)]


def test_backward_memory_lines_of_cells_with_equal_memory_stay_visible():
    from deqbench.performance.plots import plot_memory_vs_iterations

    cells = ["sine-anderson-ift", "sine-relaxed_picard-ift"]
    series = pd.DataFrame(
        [
            {
                "cell_id": c,
                "seed": 0,
                "step": 1,
                "mode": mode,
                "iterations": n,
                "activation_mib": 1.0 + (n if mode == "unrolled" else 0),
            }
            for c in cells
            for mode in ("ift", "unrolled")
            for n in (2, 4, 8)
        ]
    )
    fig = plot_memory_vs_iterations(series)
    ax = fig.axes[0]
    lines = _cell_lines(ax)
    assert sorted(_legend_texts(ax)) == sorted(ln.get_label() for ln in lines)
    assert len(lines) == 4
    for mode in ("ift", "unrolled"):
        a, b = [ln for ln in lines if ln.get_label().endswith(mode)]
        assert a.get_color() != b.get_color()
        assert a.get_linewidth() != b.get_linewidth()  # the one underneath is wider
