"""Outcome checks of the pcDEQ suites (papers/002; REFERENCE.md 9.4): pcdeq (CPU: L and MC in
one run), pcdeq_gpu (L, SC, MC)."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

from . import OUTCOMES, curve, final, fmt_curve, outcome, rows_of, spearman, task_status

# -- pcDEQ (papers/002; REFERENCE.md 9.4) -------------------------------------------------------

PCDEQ_MAX_ITERS = 30.0  # "small": far below max_iter 200 (REFERENCE.md 9.4: up to ~20 for relu6)
TRACK_RHO = 0.5
#: minimum final test accuracy per pcDEQ suite (digits): a number, or model name -> bar with
#: "" the default (the CPU suite's MC cells train 4 short epochs on a subset: a lower bar)
PCDEQ_MIN_ACCURACY: dict[str, float | dict[str, float]] = {
    "pcdeq": {"": 0.9, "pcdeq_mc": 0.8},
    "pcdeq_gpu": 0.95,
    "pcdeq_conv": 0.8,  # run directories of the former MC-only suite (now part of pcdeq)
}


def _accuracy_bar(df: Any, cell: str, min_accuracy: float | Mapping[str, float]) -> float:
    """The accuracy bar of one cell: ``min_accuracy`` itself, or its entry for the cell's model
    (results column ``model``), else its "" entry."""
    if not isinstance(min_accuracy, Mapping):
        return float(min_accuracy)
    default = float(min_accuracy.get("", 0.9))
    if "model" not in df:
        return default
    names = df.loc[df["cell_id"] == cell, "model"].dropna().unique()
    return float(min_accuracy.get(str(names[0]), default)) if len(names) else default


def check_pcdeq(df: Any, min_accuracy: float | Mapping[str, float] = 0.9) -> Any:
    """pcDEQ: no divergence or max_iter; iterations small and tracking sigma_max; W >= 0;
    accuracy (bar ``min_accuracy``, or per model name: see :data:`PCDEQ_MIN_ACCURACY`). Cells
    of any pcDEQ architecture may share one run (per-layer checks adapt to the layer count).
    The unconstrained controls are reported as ``info``."""
    import pandas as pd

    fs = rows_of(df, "family_stats")
    rows: list[dict[str, Any]] = []
    if fs.empty:
        return pd.DataFrame(
            [
                outcome(
                    "family_stats rows present",
                    False,
                    detail="the suite must run the family_stats analysis",
                )
            ]
        )
    flags = fs[fs["metric"] == "nonneg_constraint"].groupby("cell_id")["value"].max()
    for cell in sorted(fs["cell_id"].unique()):
        nonneg = bool(flags.get(cell, 1.0) >= 0.5)
        ok, why = task_status(df, cell)
        d = fs[fs["cell_id"] == cell]
        fw = curve(fs, cell, "forward_nstep").loc[lambda s: s.index >= 1]
        bw = curve(fs, cell, "backward_nstep").loc[lambda s: s.index >= 1]
        nc_f = float(d[d["metric"] == "forward_not_converged"]["value"].sum())
        nc_b = float(d[d["metric"] == "backward_not_converged"]["value"].sum())
        div = float(d[d["metric"] == "forward_diverged"]["value"].sum())
        acc = final(curve(fs, cell, "test_accuracy"))
        sig = curve(fs, cell, "sigma_max", "max")
        fails = f"forward not converged {nc_f:.0f} (diverged {div:.0f}), backward {nc_b:.0f}"
        if not nonneg:
            rows.append(
                outcome(
                    "control: solver failures",
                    "info",
                    nc_f + nc_b,
                    "",
                    f"{fails}; task {'ok' if ok else why}",
                    cell,
                )
            )
            rows.append(
                outcome(
                    "control: forward iterations per epoch",
                    "info",
                    float(fw.max()) if len(fw) else math.nan,
                    "",
                    f"{fmt_curve(fw)}; sigma_max {fmt_curve(sig)}",
                    cell,
                )
            )
            rows.append(outcome("control: test accuracy", "info", acc, "", "", cell))
            continue
        rows.append(
            outcome(
                "no divergence or max_iter (forward and backward)",
                ok and nc_f == 0 and nc_b == 0,
                nc_f + nc_b,
                "0 failed solves",
                fails + ("" if ok else f"; task {why}"),
                cell,
            )
        )
        mx = float(fw.max()) if len(fw) else math.nan
        rows.append(
            outcome(
                "forward iterations stay small",
                bool(len(fw)) and mx <= PCDEQ_MAX_ITERS,
                mx,
                f"<= {PCDEQ_MAX_ITERS:g} per layer solve (max_iter 200)",
                f"forward {fmt_curve(fw)}; backward {fmt_curve(bw)}",
                cell,
            )
        )
        rhos, parts = [], []
        layers = sorted(
            v for v in d[d["metric"] == "sigma_max"]["variant"].unique() if v.startswith("layer")
        )
        for lay in layers:
            it = curve(fs, cell, "forward_nstep", lay if len(layers) > 1 else "")
            it = it.loc[lambda s: s.index >= 1]
            sg = curve(fs, cell, "sigma_max", lay)
            flat = len(it) > 0 and float(it.max() - it.min()) < 1.0
            rho = spearman(it, sg)
            rhos.append(1.0 if flat else rho)
            parts.append(
                f"{lay}: rho={rho:.2f}"
                + (" (iterations flat within 1)" if flat else "")
                + f", sigma_max {fmt_curve(sg.loc[lambda s: s.index >= 1])}"
            )
        good = [r for r in rhos if not math.isnan(r)]
        rows.append(
            outcome(
                "iterations grow with sigma_max (Spearman over epochs)",
                bool(good) and min(good) >= TRACK_RHO if rhos else None,
                min(good) if good else math.nan,
                f"rho >= {TRACK_RHO} per layer, or flat",
                "; ".join(parts),
                cell,
            )
        )
        wmin = d[d["metric"] == "weight_min"]["value"]
        rows.append(
            outcome(
                "weights stay nonnegative",
                bool(len(wmin)) and float(wmin.min()) >= 0,
                float(wmin.min()) if len(wmin) else math.nan,
                ">= 0",
                "min entry of W over layers and epochs",
                cell,
            )
        )
        bar = _accuracy_bar(df, cell, min_accuracy)
        rows.append(
            outcome(
                "test accuracy",
                None if math.isnan(acc) else acc >= bar,
                acc,
                f">= {bar:g}",
                "final epoch",
                cell,
            )
        )
    return pd.DataFrame(rows)


for _name, _acc in PCDEQ_MIN_ACCURACY.items():
    OUTCOMES[_name] = functools.partial(check_pcdeq, min_accuracy=_acc)
