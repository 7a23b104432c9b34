"""Figures of the convergence analyses, drawn from their rows and series.

* ``time_to_tolerance.png`` (:func:`time_to_tolerance_figure`): per cell two rows of panels,
  forward and adjoint side by side; top, the relative residual (the stop rule's batch max)
  against the wall-clock since the solve started, bottom against f-evaluations. Thin lines: each
  batch; markers: the median over batches at each tolerance reached by every batch, bars the
  IQR (time) or min-max (f-evaluations). The curve furthest left at a height reaches that
  tolerance first.
* ``path_independence.png`` (:func:`path_independence_figure`): per cell, histograms of the
  per-sample relative distance of z* and of the outputs from each start to the reference
  start's (the dashed line: ``same_tol``), and bars of the fractions (same fixed point,
  prediction changed, unconverged) per start.

One seed is drawn (the lowest) at the last step measured; the titles name the model, the device
(from ``run.json``), the batch and the solve tolerance.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..run import plots
from ._common import device_words, run_info

TTT = "time_to_tolerance"
PI = "path_independence"
FLOOR = 1e-16  # distances of exactly 0 are drawn here on the log axes


def _dtype(run_dir: Any) -> str:
    dt = run_info(run_dir).get("dtype")
    return f", {dt}" if dt else ""


def _grid(
    rows: int, cols: int, w: float, h: float, width_ratios: list[float] | None = None
) -> tuple[Any, Any]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    width = w * (sum(width_ratios) if width_ratios else cols) + 0.4
    fig = Figure(figsize=(width, h * rows + 0.9), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(rows, cols, squeeze=False, width_ratios=width_ratios)


def _one(d: Any, cell: str) -> Any:
    """The rows of ``cell`` at its lowest seed and last step."""
    g = d[d["cell_id"] == cell]
    g = g[g["seed"] == g["seed"].min()]
    return g[g["step"] == g["step"].max()]


def _value(g: Any, metric: str, variant: str = "") -> float:
    r = g[(g["metric"] == metric) & (g["variant"].fillna("") == variant)]
    return float(r["value"].iloc[0]) if len(r) else float("nan")


def _series(run_dir: Any, name: str, cell: str, seed: Any, step: Any) -> Any:
    s = plots.read_series(run_dir, name) if run_dir is not None else None
    if s is None or s.empty:
        return None
    s = s[(s["cell_id"] == cell) & (s["seed"] == seed) & (s["step"] == step)]
    return s if len(s) else None


# -- time to tolerance -----------------------------------------------------------------------


def _levels(g: Any, label: str, kind: str) -> Any:
    """Per tolerance of (solver, pass): tol, time median/q1/q3, nfev median/min/max (NaN where
    not reached), sorted by tol, loosest first."""
    import pandas as pd

    pre = f"{label}-{kind}-tol="
    r = g[g["variant"].fillna("").str.startswith(pre)]
    out = []
    for v, h in r.groupby("variant"):
        vals = {m: float(x) for m, x, st in zip(h["metric"], h["value"], h["status"]) if st == "ok"}
        out.append({"tol": float(str(v)[len(pre) :]),
                    **{k: vals.get(k, np.nan) for k in (
                        "time_to_tol_ms_median", "time_to_tol_ms_q1", "time_to_tol_ms_q3",
                        "nfev_to_tol_median", "nfev_to_tol_min", "nfev_to_tol_max")}})  # fmt: skip
    return pd.DataFrame(out).sort_values("tol", ascending=False) if out else pd.DataFrame()


def _solvers(g: Any) -> list[str]:
    """Solver labels in row order."""
    v = g.loc[g["metric"] == "solve_time_ms_median", "variant"].astype(str)
    return list(dict.fromkeys(s.rsplit("-", 1)[0] for s in v))


def _draw_solver(at: Any, an: Any, g: Any, series: Any, label: str, kind: str, color: Any) -> str:
    """One solver's curves on the time (``at``) and f-evaluation (``an``) panels of a pass;
    returns what the legend says of it beyond its name ("" when nothing)."""
    whole = g[g["variant"] == f"{label}-{kind}"]
    if (whole["status"] == "skipped").any():  # the solver cannot solve this model
        return "not applicable to this model"
    lv = _levels(g, label, kind)
    if series is not None:
        s = series[(series["solver"] == label) & (series["pass"] == kind)]
        for _, b in s.groupby("batch"):
            y = np.maximum(b["rel_criterion"].to_numpy(float), FLOOR)
            if b["time_ms"].notna().any():
                at.plot(b["time_ms"], y, color=color, lw=0.7, alpha=0.35)
            an.plot(b["fev"], y, color=color, lw=0.7, alpha=0.35)
    reached = lv[lv["nfev_to_tol_median"].notna()] if len(lv) else lv
    timed = reached[reached["time_to_tol_ms_median"].notna()] if len(reached) else reached
    say = ""
    if len(timed):
        t = timed["time_to_tol_ms_median"]
        at.errorbar(t, timed["tol"], xerr=[t - timed["time_to_tol_ms_q1"],
                    timed["time_to_tol_ms_q3"] - t], fmt="o-", color=color, ms=4,
                    capsize=2)  # fmt: skip
    elif len(reached):
        say = "no per-step time axis"
        if _value(whole, "converged", f"{label}-{kind}") == 1.0:
            # a solver that never calls the map: the whole solve, which stopped at the
            # smallest tolerance in every batch, is the one time there is
            t = _value(whole, "solve_time_ms_median", f"{label}-{kind}")
            at.plot([t], [reached["tol"].min()], "x", color=color, ms=8, mew=2)
            say += "; x: whole solve"
    if len(reached):
        n = reached["nfev_to_tol_median"]
        an.errorbar(n, reached["tol"], xerr=[n - reached["nfev_to_tol_min"],
                    reached["nfev_to_tol_max"] - n], fmt="o-", color=color, ms=4,
                    capsize=2)  # fmt: skip
    return say


def time_to_tolerance_figure(df: Any, run_dir: Any) -> Any | None:
    """The figure described in the module docstring (None without rows to draw)."""
    from matplotlib.lines import Line2D

    d = df[df["analysis"] == TTT]
    d = d.assign(variant=d["variant"].fillna("").astype(str))
    cells = [c for c in dict.fromkeys(d["cell_id"]) if (_one(d, c)["metric"] == "reached").any()]
    if not cells:
        return None
    kinds = [k for k in ("forward", "adjoint") if d["variant"].str.contains(f"-{k}-tol=").any()]
    fig, axes = _grid(2 * len(cells), len(kinds) + 1, 5.0, 3.3,
                      width_ratios=[1.0] * len(kinds) + [0.55])  # fmt: skip
    short = plots.short_labels(cells)
    labels = list(dict.fromkeys(lab for c in cells for lab in _solvers(_one(d, c))))
    colors = {lab: plots.PALETTE[k % len(plots.PALETTE)] for k, lab in enumerate(labels)}
    models = []
    for i, cell in enumerate(cells):
        g = _one(d, cell)
        seed, step = g["seed"].iloc[0], g["step"].iloc[0]
        model = str(g["model"].iloc[0]) if "model" in g else cell
        models.append(model)
        series = _series(run_dir, TTT, cell, seed, step)
        said: dict[str, dict[str, str]] = {}
        for j, kind in enumerate(kinds):
            at, an = axes[2 * i][j], axes[2 * i + 1][j]
            for label in _solvers(g):
                say = _draw_solver(at, an, g, series, label, kind, colors[label])
                said.setdefault(label, {})[kind] = say
            what = "forward z = f(z, u)" if kind == "forward" else "adjoint w = J^T w + g at z*"
            for ax, xl in ((at, "wall-clock since the solve started (ms)"),
                           (an, "f-evaluations")):  # fmt: skip
                ax.set_yscale("log")
                ax.set_xlabel(xl)
                ax.set_ylabel("rel. residual (batch max, lowest so far)")
                ax.grid(True, which="major", alpha=0.3)
            at.set_xscale("log")
            at.set_title(f"{short[cell]}: {what}", fontsize="small")
            an.set_title(f"{short[cell]}: {what}, per f-evaluation", fontsize="small")
        # one legend per cell, in the column right of its panels (nothing drawn is hidden)
        handles, texts = [], []
        for label, by_kind in said.items():
            notes = list(dict.fromkeys(v for v in by_kind.values() if v))
            handles.append(Line2D([], [], color=colors[label], marker="o", ms=4,
                                  alpha=0.4 if "not applicable" in "".join(notes) else 1.0))  # fmt: skip
            texts.append(label + (f"\n({'; '.join(notes)})" if notes else ""))
        for r in (2 * i, 2 * i + 1):
            axes[r][-1].axis("off")
        axes[2 * i][-1].legend(handles, texts, loc="upper left", fontsize="x-small",
                               title=f"{short[cell]}: solver", title_fontsize="x-small")  # fmt: skip
    g0 = _one(d, cells[0])
    bs, nb = _value(g0, "batch_size"), _value(g0, "batches")
    fig.suptitle(
        f"Time to tolerance: {', '.join(dict.fromkeys(models))} on {device_words(run_dir)}"
        f"{_dtype(run_dir)}; batches of {bs:.0f}, median over {nb:.0f} batches\n(markers: "
        "median at each tolerance every batch reached, none where some batch did not; bars: IQR "
        "of time, min-max of f-evaluations; thin lines: each batch)",
        fontsize="medium",
    )
    return fig


# -- path independence -----------------------------------------------------------------------


def path_independence_figure(df: Any, run_dir: Any) -> Any | None:
    """The figure described in the module docstring (None without rows to draw)."""
    d = df[(df["analysis"] == PI)]
    d = d.assign(variant=d["variant"].fillna("").astype(str))
    cells = [c for c in dict.fromkeys(d["cell_id"])
             if (_one(d, c)["metric"] == "same_fixed_point").any()]  # fmt: skip
    if not cells:
        return None
    fig, axes = _grid(len(cells), 3, 4.6, 3.4)
    short = plots.short_labels(cells)
    models, ns = [], set()
    for i, cell in enumerate(cells):
        g = _one(d, cell)
        seed, step = g["seed"].iloc[0], g["step"].iloc[0]
        models.append(str(g["model"].iloc[0]) if "model" in g else cell)
        same_tol = _value(g, "same_tol")
        ns.add(int(_value(g, "samples")))
        s = _series(run_dir, PI, cell, seed, step)
        starts = list(dict.fromkeys(s["start"])) if s is not None else []
        others = starts[1:]
        ax_z, ax_o, ax_b = axes[i]
        if s is not None:
            valid = s.groupby("sample")["converged"].transform("all").astype(bool)
            v = s[valid]
            for k, st in enumerate(others):
                color = plots.PALETTE[k % len(plots.PALETTE)]
                e = v[v["start"] == st]
                for ax, col in ((ax_z, "z_distance"), (ax_o, "output_distance")):
                    x = np.maximum(e[col].to_numpy(float), FLOOR)
                    if x.size:
                        lo, hi = np.log10(min(x.min(), same_tol)), np.log10(max(x.max(), 1.0))
                        bins = np.logspace(lo - 0.1, hi + 0.1, 40)
                        ax.hist(x, bins=bins, color=color, alpha=0.5, log=True,
                                label=f"{st} vs {starts[0]}")  # fmt: skip
        for ax, what in ((ax_z, "z*"), (ax_o, "outputs (logits)")):
            ax.axvline(same_tol, color="black", ls="--", lw=1, label=f"same_tol {same_tol:g}")
            ax.set_xscale("log")
            ax.set_xlabel(f"||{'z' if ax is ax_z else 'y'}_s - ref|| / ||ref|| per sample "
                          f"(0 at {FLOOR:g})")  # fmt: skip
            ax.set_ylabel("samples (log)")
            ax.set_title(f"{short[cell]} (solve tol {_value(g, 'tol'):g}): distance of {what}",
                         fontsize="small")  # fmt: skip
            ax.legend(fontsize="x-small")
            ax.grid(True, alpha=0.25)
        groups = [v for v in dict.fromkeys(g.loc[g["metric"] == "same_fixed_point", "variant"])]
        bars = (("same_fixed_point", "same fixed point"), ("prediction_changed",
                "prediction changed"), ("unconverged", "unconverged (of all)"))  # fmt: skip
        xs = np.arange(len(groups))
        for k, (metric, label) in enumerate(bars):
            vals = [100 * _value(g, metric, gr) for gr in groups]
            if all(np.isnan(vals)):
                continue
            rects = ax_b.bar(xs + (k - 1) * 0.27, np.nan_to_num(vals), 0.27, label=label,
                             color=plots.PALETTE[k])  # fmt: skip
            ax_b.bar_label(rects, fmt="%.1f", fontsize="xx-small")
        ax_b.set_xticks(xs, [f"{gr} vs {starts[0] if starts else 'ref'}" for gr in groups],
                        fontsize="x-small")  # fmt: skip
        ax_b.set_ylabel("% of samples")
        ax_b.set_ylim(0, 135)
        verdict = g.loc[g["metric"] == "depends_on_z0", "note"]
        parts = str(verdict.iloc[0]).split("; ")[0].split(": ", 2) if len(verdict) else []
        text = parts[1] + (f":\n{parts[2]}" if len(parts) > 2 else "") if len(parts) > 1 else ""
        ax_b.set_title(f"{short[cell]}: {text}", fontsize="x-small")
        ax_b.legend(fontsize="x-small", loc="upper center", ncols=3)
    fig.suptitle(
        f"Path independence: {', '.join(dict.fromkeys(models))} on {device_words(run_dir)}; "
        f"{'/'.join(str(n) for n in sorted(ns))} samples, each solved from every start to the "
        f"cell's tolerance; {_dtype(run_dir).lstrip(', ')}",
        fontsize="medium",
    )
    return fig
