"""Outcome checks of the monDEQ suites (REFERENCE.md 9.6): mondeq, mondeq_gpu."""

from __future__ import annotations

import math
from typing import Any

from . import curve, final, outcome, register, rows_of, task_status

# -- monDEQ (Winston & Kolter 2020; REFERENCE.md 9.6) -------------------------------------------

MONDEQ_MIN_ACCURACY = 0.9

_Sweep = dict[float, tuple[float, bool]]  # alpha -> (iterations, converged)


def _fmt_sweep(t: _Sweep) -> str:
    return ", ".join(
        f"{a:g}: {n:.0f}{'' if c else ' (failed)'}" for a, (n, c) in sorted(t.items(), reverse=True)
    )


def _all_converged(check: str, t: _Sweep, cell: str) -> dict[str, Any]:
    """Outcome row: every alpha of ``t`` converged (value: number of failures)."""
    return outcome(
        check,
        all(c for _, c in t.values()),
        sum(not c for _, c in t.values()),
        "0 failures",
        _fmt_sweep(t),
        cell,
    )


@register("mondeq", "mondeq_gpu")
def check_mondeq(df: Any) -> Any:
    """monDEQ: monotonicity held every epoch; PR converges for every alpha with an interior
    optimum; FB fails above its step bound, converges and is slower than PR below it."""
    import pandas as pd

    sw = rows_of(df, "splitting_sweep")
    fs = rows_of(df, "family_stats")
    rows: list[dict[str, Any]] = []
    cells = sorted(set(sw["cell_id"]) | set(fs["cell_id"]))
    if not cells:
        return pd.DataFrame(
            [
                outcome(
                    "splitting_sweep rows present",
                    False,
                    detail="the suite must run splitting_sweep",
                )
            ]
        )
    for cell in cells:
        ok, why = task_status(df, cell)
        if not ok:
            rows.append(outcome("cell finished", False, detail=why, cell_id=cell))
        fc = fs[fs["cell_id"] == cell]
        gap = fc[fc["metric"] == "monotonicity_gap"]["value"]
        lip = fc[fc["metric"] == "lipschitz_I_minus_W"]["value"]
        lam = fc[fc["metric"] == "lambda_max_sym_W"]["value"]
        if len(gap):
            tol = 1e-5 * max(1.0, float(lip.max()) if len(lip) else 1.0)  # float32 round-off
            rows.append(
                outcome(
                    "monotone every epoch: lambda_max((W+W^T)/2) <= 1-m",
                    float(gap.min()) >= -tol,
                    float(lam.max()),
                    f"gap (1-m) - lambda_max >= -{tol:.1g}",
                    f"min gap {float(gap.min()):.3g} over {len(gap)} measurements",
                    cell,
                )
            )
        acc = final(curve(fs, cell, "test_accuracy"))
        if not math.isnan(acc):
            rows.append(
                outcome(
                    "test accuracy",
                    acc >= MONDEQ_MIN_ACCURACY,
                    acc,
                    f">= {MONDEQ_MIN_ACCURACY}",
                    "final epoch",
                    cell,
                )
            )
        s = sw[sw["cell_id"] == cell]
        if s.empty:
            continue
        bound = float(s[s["metric"] == "fb_alpha_bound"]["value"].median())
        tab: dict[str, _Sweep] = {}
        it = s[s["metric"] == "forward_nstep"]
        cv = s[s["metric"] == "converged"].groupby("variant")["value"].min()
        for v, g in it.groupby("variant"):
            method, _, a = v.partition("/alpha=")
            tab.setdefault(method, {})[float(a)] = (
                float(g["value"].max()),
                bool(cv.get(v, 0.0) >= 0.5),
            )
        pr, fb = tab.get("peaceman_rachford", {}), tab.get("forward_backward", {})
        table = f"FB [{_fmt_sweep(fb)}]; PR [{_fmt_sweep(pr)}]; FB bound 2m/||I-W||^2 = {bound:.3g}"
        rows.append(outcome("sweep table (iterations by alpha)", "info", bound, "", table, cell))
        if pr:
            rows.append(_all_converged("PR converges for every alpha", pr, cell))
            conv = {a: n for a, (n, c) in pr.items() if c}
            if len(conv) >= 3:
                best = min(conv, key=lambda a: conv[a])
                lo, hi = min(pr), max(pr)
                interior = (
                    lo < best < hi
                    and conv[best] < conv.get(lo, math.inf)
                    and conv[best] < conv.get(hi, math.inf)
                )
                rows.append(
                    outcome(
                        "PR has an interior optimum in alpha",
                        interior,
                        best,
                        f"argmin strictly inside ({lo:g}, {hi:g})",
                        _fmt_sweep(pr),
                        cell,
                    )
                )
        if fb:
            above = {a: v for a, v in fb.items() if a > bound}
            below = {a: v for a, v in fb.items() if a < bound}
            if above:
                amax = max(above)
                rows.append(
                    outcome(
                        "FB fails above its step bound (at the largest alpha)",
                        not above[amax][1],
                        amax,
                        f"no convergence at alpha {amax:g} > {bound:.3g}",
                        f"above the bound: {_fmt_sweep(above)} (the bound is sufficient, not necessary)",
                        cell,
                    )
                )
            if below:
                rows.append(_all_converged("FB converges below its step bound", below, cell))
                both = [a for a in below if below[a][1] and pr.get(a, (0, False))[1]]
                slower = [a for a in both if below[a][0] > pr[a][0]]
                rows.append(
                    outcome(
                        "FB slower than PR below its bound",
                        bool(both) and len(slower) == len(both),
                        len(slower),
                        f"FB > PR iterations at every alpha < {bound:.3g}",
                        ", ".join(
                            f"{a:g}: {below[a][0]:.0f} vs {pr[a][0]:.0f}"
                            for a in sorted(both, reverse=True)
                        ),
                        cell,
                    )
                )
    return pd.DataFrame(rows)
