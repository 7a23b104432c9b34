"""Outcome checks of the trajectory suite (papers/004 section 4.1, figures 4.1-4.3).

Cells are told apart by their measured init scale (the ``cell_weight_std`` row of the
``trajectory`` analysis), not by their names: the largest is the N(0, 1) reference.

* per cell with a smaller init: it converges in fewer forward iterations at init than the
  N(0, 1) cell (median per-example f-evaluations until the relative residual fell below the
  recording tolerance; an example that never did counts the whole solve, so two solves that
  both hit the budget are equal, not "fewer");
* per cell: class separation of the fixed points in the cell's PCA plane (silhouette score by
  class of the returned fixed points of the probe set) rises from init to the last recorded epoch;
* info: iterations, converged fraction and silhouette (PCA plane and full state space) at init
  and at the end, and the final test accuracy.
"""

from __future__ import annotations

import math
from typing import Any

from . import outcome, register, rows_of, task_status


def _series(t: Any, cell: str, metric: str, variant: str = "") -> Any:
    g = t[(t["cell_id"] == cell) & (t["metric"] == metric) & (t["variant"] == variant)]
    g = g[g["step"].notna()]
    return g.groupby(g["step"].astype(int))["value"].median().sort_index()


def _scalar(t: Any, cell: str, metric: str) -> float:
    g = t[(t["cell_id"] == cell) & (t["metric"] == metric)]
    return float(g["value"].median()) if len(g) else math.nan


@register("trajectory", "trajectory_mnist")
def check_trajectory(df: Any) -> Any:
    import pandas as pd

    t = rows_of(df, "trajectory")
    flagged = df[(df["analysis"] == "trajectory") & (df["status"] == "flagged")]
    t = pd.concat([t, flagged.assign(variant=flagged["variant"].fillna("").astype(str))])
    if t.empty:
        return pd.DataFrame(
            [outcome("trajectory rows present", False, detail="the suite must run trajectory")]
        )
    cells = sorted(t["cell_id"].unique())
    std = {c: _scalar(t, c, "cell_weight_std") for c in cells}
    rows: list[dict[str, Any]] = []
    known = [c for c in cells if math.isfinite(std[c])]
    ref = max(known, key=lambda c: std[c]) if known else None

    def at_init(cell: str, metric: str, variant: str = "") -> tuple[float, int | None]:
        s = _series(t, cell, metric, variant)
        return (float(s.iloc[0]), int(s.index[0])) if len(s) else (math.nan, None)

    if ref is not None:
        it_ref, e_ref = at_init(ref, "iterations_median")
        conv_ref, _ = at_init(ref, "converged_frac")
        for c in cells:
            if c == ref or not math.isfinite(std[c]) or std[c] >= std[ref]:
                continue
            it, e = at_init(c, "iterations_median")
            conv, _ = at_init(c, "converged_frac")
            tol, _ = at_init(c, "tol")
            nstep, _ = at_init(c, "nstep")
            held = None if not (math.isfinite(it) and math.isfinite(it_ref)) else it < it_ref
            rows.append(
                outcome(
                    f"init std {std[c]:.3g} converges in fewer iterations than std {std[ref]:.3g}",
                    held,
                    it,
                    f"< {it_ref:g}",
                    f"median f-evals to rel {tol:g} at epoch {e}: {it:g} (reached by "
                    f"{100 * conv:.0f}%) vs {it_ref:g} (reached by {100 * conv_ref:.0f}%); "
                    f"solve budget {nstep:g}",
                    c,
                )
            )
    for c in cells:
        sil = _series(t, c, "silhouette", "pca2")
        ok, why = task_status(df, c)
        if len(sil) < 2:
            rows.append(outcome("class separation rises (PCA plane)", None,
                                detail="fewer than two recorded epochs", cell_id=c))  # fmt: skip
            continue
        first, last = float(sil.iloc[0]), float(sil.iloc[-1])
        full = _series(t, c, "silhouette", "full")
        note = "" if ok else f"; cell status {why.split(': ', 1)[-1].split(' ', 1)[0]}"
        rows.append(
            outcome(
                "class separation of the fixed points rises (silhouette, PCA plane)",
                last > first,
                last,
                f"> {first:.3g}",
                f"silhouette {first:.3f} (epoch {sil.index[0]}) -> {last:.3f} (epoch "
                f"{sil.index[-1]}); in the state space {float(full.iloc[0]):.3f} -> "
                f"{float(full.iloc[-1]):.3f}{note}",
                c,
            )
        )
        its = _series(t, c, "iterations_median")
        conv = _series(t, c, "converged_frac")
        acc = df[(df["cell_id"] == c) & (df["analysis"] == "metrics")
                 & (df["metric"] == "accuracy") & (df["variant"].fillna("") == "test")]  # fmt: skip
        acc_v = float(acc.sort_values("step")["value"].iloc[-1]) if len(acc) else math.nan
        rows.append(
            outcome(
                "iterations at init -> end",
                "info",
                float(its.iloc[-1]),
                "",
                f"median f-evals {float(its.iloc[0]):g} -> {float(its.iloc[-1]):g}, converged "
                f"{100 * float(conv.iloc[0]):.0f}% -> {100 * float(conv.iloc[-1]):.0f}%; "
                f"init std {std[c]:.3g}; final test accuracy {acc_v:.3f}",
                c,
            )
        )
    return pd.DataFrame(rows)
