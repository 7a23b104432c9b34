"""Statistical comparison of two runs' results: deterministic metrics within a tolerance
(:data:`RTOL`, :data:`ATOL`), timings by a per-cell Mann-Whitney U test (:func:`timing_change`),
task status changes and the per-side match counts that ``deqbench compare`` reports.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from .results_reader import (
    finished_tasks,
)
from .results_writer import (
    FLAGGED,
    JOIN_KEYS,
    RUNNER,
)

TIMING_UNITS = ("s", "ms")
#: ``compare``'s default tolerance for deterministic metrics: a row is changed where
#: ``|b - a| > ATOL + RTOL * max(|a|, |b|)``. Values are written at full precision (``repr``), so
#: a rerun of the same code on the same machine gives the same numbers; 1e-6 (about 8 float32
#: ulps) only absorbs a reordered float32 sum. ``--rtol`` loosens it (runs of other machines).
RTOL = 1e-6
#: absolute slack beside :data:`RTOL`, for values near 0 (a residual of 0 vs 1e-15)
ATOL = 1e-12
#: significance level of the per-cell timing test (two-sided Mann-Whitney U); a cell is judged
#: only where its sample counts can reach it at all (5 vs 5 samples or more: 2/C(10, 5) < 0.01)
ALPHA = 0.01


def is_timing(unit: Any) -> bool:
    """A time (``s``, ``ms``) or a rate per second (``samples/s``)."""
    u = "" if unit is None else str(unit)
    return u in TIMING_UNITS or u.endswith("/s")


def values_differ(a: Any, b: Any, rtol: float = RTOL, atol: float = ATOL) -> Any:
    """Elementwise: ``|b - a| > atol + rtol * max(|a|, |b|)`` (symmetric in a and b); NaN vs NaN
    and inf vs the same inf are equal, NaN vs a number differs. Returns a bool array."""
    import numpy as np

    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    na, nb = np.isnan(a), np.isnan(b)
    with np.errstate(invalid="ignore", over="ignore"):
        same = (a == b) | (np.abs(b - a) <= atol + rtol * np.maximum(np.abs(a), np.abs(b)))
    return np.where(na | nb, na != nb, ~same)


def _rel_diff(a: Any, b: Any) -> Any:
    """``|b - a| / max(|a|, |b|)`` (0 where equal, inf where one side is NaN): ranks rows."""
    import numpy as np

    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    with np.errstate(invalid="ignore", divide="ignore"):
        r = np.abs(b - a) / np.maximum(np.abs(a), np.abs(b))
    r = np.where((a == b) | (np.isnan(a) & np.isnan(b)), 0.0, r)
    return np.where(np.isnan(r), np.inf, r)


@functools.lru_cache(maxsize=256)
def _u_counts(m: int, n: int) -> tuple[int, ...]:
    """How many of the C(m+n, m) orderings of m + n distinct values give the Mann-Whitney
    statistic U = 0, 1, ..., m*n: the coefficients of the Gaussian binomial coefficient
    [m+n choose m]_q = prod_{i=1..m} (1 - q^(n+i)) / (1 - q^i), in exact integers."""
    p = [1]
    for i in range(1, m + 1):
        up = n + i
        q = p + [0] * up
        for k in range(len(q) - 1, up - 1, -1):  # times (1 - q^up)
            q[k] -= p[k - up]
        for k in range(i, len(q)):  # divided by (1 - q^i): exact, the top i terms end at 0
            q[k] += q[k - i]
        p = q[: len(q) - i]
    return tuple(p)


def min_p_value(m: int, n: int) -> float:
    """The smallest two-sided p the exact Mann-Whitney U test can give for m vs n samples."""
    return min(1.0, 2.0 / math.comb(m + n, m)) if m and n else 1.0


def mann_whitney_p(x: Any, y: Any) -> float:
    """Two-sided p-value of the Mann-Whitney U test (do x and y come from one distribution?):
    exact for up to 60 samples in all without ties; else the normal approximation with the tie
    and continuity corrections. NaN is dropped; 1.0 when a side is empty or all values equal."""
    import numpy as np

    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    x, y = x[~np.isnan(x)], y[~np.isnan(y)]
    m, n = len(x), len(y)
    if not m or not n:
        return 1.0
    u = float((x[:, None] > y[None, :]).sum() + 0.5 * (x[:, None] == y[None, :]).sum())
    pooled = np.concatenate([x, y])
    _, ties = np.unique(pooled, return_counts=True)
    if m + n <= 60 and (ties == 1).all():
        counts = _u_counts(min(m, n), max(m, n))
        k = int(round(u))
        low, high = sum(counts[: k + 1]), sum(counts[k:])
        return min(1.0, 2.0 * min(low, high) / math.comb(m + n, m))
    big = m + n
    var = m * n / 12.0 * ((big + 1) - float((ties**3 - ties).sum()) / (big * (big - 1)))
    if var <= 0:
        return 1.0
    z = max(0.0, abs(u - m * n / 2.0) - 0.5) / math.sqrt(var)
    return math.erfc(z / math.sqrt(2.0))


def timing_change(
    xa: Any, xb: Any, factor: float, *, alpha: float = ALPHA, min_samples: int = 3
) -> tuple[bool | None, float, float]:
    """Per-cell timing rule: (changed, ratio of medians B/A, p). ``changed`` is None where the
    samples cannot decide: fewer than ``min_samples`` a side, or too few for the exact test to
    reach ``alpha`` (:func:`min_p_value`; 5 vs 5 for 0.01). Else True where the ratio of the
    medians is beyond ``factor`` either way *and* the Mann-Whitney U test rejects one
    distribution at ``alpha``: noise between repeats is neither a shift nor beyond the factor."""
    import numpy as np

    xa = np.asarray(xa, dtype=float)
    xb = np.asarray(xb, dtype=float)
    xa, xb = xa[~np.isnan(xa)], xb[~np.isnan(xb)]
    ma = float(np.median(xa)) if len(xa) else math.nan
    mb = float(np.median(xb)) if len(xb) else math.nan
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = 1.0 if ma == mb else float(np.float64(mb) / np.float64(ma))
    if min(len(xa), len(xb)) < min_samples or min_p_value(len(xa), len(xb)) > alpha:
        return None, ratio, math.nan
    p = mann_whitney_p(xa, xb)
    beyond = ratio > factor or ratio < 1.0 / factor
    return bool(beyond and p < alpha), ratio, p


def min_samples_for(alpha: float, min_samples: int = 3) -> int:
    """The fewest samples a side (equal sides) that can show a change at ``alpha``."""
    n = max(1, min_samples)
    while min_p_value(n, n) > alpha:
        n += 1
    return n


CHANGE_COLUMNS = ["kind", "cell_id", "analysis", "metric", "variant", "location", "a", "b", "ratio",
                  "rows", "detail"]  # fmt: skip


def compare(
    a: Any,
    b: Any,
    factor: float = 1.1,
    *,
    timing: bool = False,
    min_samples: int = 3,
    rtol: float = RTOL,
    atol: float = ATOL,
    alpha: float = ALPHA,
) -> tuple[Any, Any]:
    """:func:`compare_cells` without the per-cell list: ``(summary, joined)``."""
    summary, joined, _ = compare_cells(
        a, b, factor, timing=timing, min_samples=min_samples, rtol=rtol, atol=atol, alpha=alpha
    )
    return summary, joined


def _join_rows(a: Any, b: Any, rtol: float, atol: float) -> Any:
    """The row-level outer join of two runs' ``ok`` and ``flagged`` rows on :data:`JOIN_KEYS`
    (``joined`` of :func:`compare_cells`)."""
    import numpy as np

    cols = [*JOIN_KEYS, "value", "status", "unit"]
    kept = ["ok", FLAGGED]
    ja = a[a["status"].isin(kept)][cols].copy()
    jb = b[b["status"].isin(kept)][cols].copy()
    for d in (ja, jb):
        d["step"] = d["step"].astype("Int64").astype(str)
    joined = ja.merge(jb, on=JOIN_KEYS, how="outer", suffixes=("_a", "_b"), indicator="side")
    joined["side"] = (
        joined["side"].astype(str).map({"both": "both", "left_only": "a", "right_only": "b"})
    )
    joined["unit"] = joined["unit_a"].where(joined["unit_a"].notna(), joined["unit_b"]).fillna("")
    joined = joined.drop(columns=["unit_a", "unit_b"])
    va, vb = joined["value_a"].to_numpy(float), joined["value_b"].to_numpy(float)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where((va == 0) & (vb == 0), 1.0, vb / va)
    joined["ratio"] = ratio
    timed = joined["unit"].map(is_timing).astype(bool).to_numpy()
    both = (joined["side"] == "both").to_numpy()
    joined["differs"] = both & ~timed & values_differ(va, vb, rtol, atol)
    return joined


def compare_cells(
    a: Any,
    b: Any,
    factor: float = 1.1,
    *,
    timing: bool = False,
    min_samples: int = 3,
    rtol: float = RTOL,
    atol: float = ATOL,
    alpha: float = ALPHA,
) -> tuple[Any, Any, Any]:
    """Join two runs on :data:`JOIN_KEYS` and find what changed, per cell and metric.

    Rows that are ``ok`` or ``flagged`` take part (a flagged measurement is still a number);
    failed rows (error, nan, ...) do not. The change rule (``changes``, one row per item):

    * ``value``: a deterministic metric (every unit that is not a timing, :func:`is_timing`:
      iteration counts, converged shares, accuracies, losses, residuals) whose matched rows
      differ beyond ``|b - a| > atol + rtol * max(|a|, |b|)`` in any row of the cell (NaN vs
      NaN equal, NaN vs a number changed); one item per (cell, analysis, metric, variant) with
      the most changed row (``location``: its seed and step), its A, B, B/A and ``rows`` changed.
    * ``timing``: only with ``timing``; per (cell, analysis, metric, variant, step), seeds x
      repeats of each run pooled: :func:`timing_change` (ratio of the medians beyond ``factor``
      and a two-sided Mann-Whitney U test at ``alpha``); series with too few samples are
      counted in the summary's ``check``, never changed.
    * ``status``: a (cell, seed) task in both runs whose runner status differs (ok -> flagged).
    * ``rows``: deterministic rows that only one run has, in a task both ran with the same
      status (another number of epochs, a metric no longer written).

    Cells or tasks only one run has are not changes: see :func:`task_differences`.

    Returns:
        (summary, joined, changes): ``summary`` per (analysis, metric, variant): unit, n
        (matched pairs), only_a, only_b, median_a, median_b (over the matched pairs), ratio
        (median of the paired ratios b/a, for reading; not the change rule), cells (cells
        compared), cells_changed, changed (any cell changed), flagged (matched pairs flagged in
        A or B), timing, check (the rule's verdict in words); ``joined`` the row-level outer
        join with ``value_a``, ``value_b``, ``status_a``, ``status_b``, ``ratio``, ``differs``
        and ``side`` (``both``, ``a`` or ``b``); ``changes`` with :data:`CHANGE_COLUMNS`.
    """
    import numpy as np
    import pandas as pd

    joined = _join_rows(a, b, rtol, atol)
    changes: list[dict[str, Any]] = _status_changes(a, b)
    same_status = _tasks_with_same_status(a, b)
    rows = []
    groups = joined.groupby(["analysis", "metric", "variant"], sort=True, dropna=False)
    for (an, metric, variant), g in groups:
        m = g[g["side"] == "both"]
        r = m["ratio"].replace([np.inf, -np.inf], np.nan).dropna()
        med = float(r.median()) if len(r) else math.nan
        unit = next((u for u in g["unit"] if u), "")
        key = {"analysis": an, "metric": metric, "variant": variant}
        if is_timing(unit):
            found, check = _timing_cells(g, key, factor, timing, alpha, min_samples)
            cells = len({c for c, _ in found}) if timing else 0
            cells_changed = len({c["cell_id"] for _, c in found if c is not None})
            changes += [c for _, c in found if c is not None]
        else:
            found_v = _value_cells(g, key)
            found_r = _row_cells(g, key, same_status)
            changes += found_v + found_r
            cells = int(m["cell_id"].nunique())
            cells_changed = len({c["cell_id"] for c in found_v + found_r})
            check = (
                f"in {cells_changed}/{max(cells, cells_changed)} cells (rtol {rtol:g})"
                if cells_changed
                else ""
            )
        rows.append(
            {
                **key,
                "unit": unit,
                "n": len(m),
                "only_a": int((g["side"] == "a").sum()),
                "only_b": int((g["side"] == "b").sum()),
                "median_a": float(m["value_a"].median()) if len(m) else math.nan,
                "median_b": float(m["value_b"].median()) if len(m) else math.nan,
                "ratio": med,
                "cells": cells,
                "cells_changed": cells_changed,
                "changed": bool(cells_changed),
                "flagged": int(((m["status_a"] == FLAGGED) | (m["status_b"] == FLAGGED)).sum()),
                "timing": is_timing(unit),
                "check": check,
            }
        )
    columns = ["analysis", "metric", "variant", "unit", "n", "only_a", "only_b", "median_a"]
    columns += ["median_b", "ratio", "cells", "cells_changed", "changed", "flagged", "timing"]
    columns += ["check"]
    kinds = {"status": 0, "value": 1, "rows": 2, "timing": 3}
    out = pd.DataFrame(changes, columns=CHANGE_COLUMNS)
    if len(out):
        order = out["kind"].map(kinds)
        out = (
            out.assign(_k=order)
            .sort_values(
                ["cell_id", "_k", "analysis", "metric", "variant", "location"], kind="stable"
            )
            .drop(columns="_k")
            .reset_index(drop=True)
        )
    return pd.DataFrame(rows, columns=columns), joined, out


def _where(seed: Any, step: Any) -> str:
    """``seed=0 step=2`` (the parts that are set) of a joined row."""
    import pandas as pd

    parts = []
    if seed is not None and not pd.isna(seed):
        parts.append(f"seed={int(seed)}")
    if step is not None and str(step) not in ("", "<NA>", "nan"):
        parts.append(f"step={step}")
    return " ".join(parts)


def _value_cells(g: Any, key: dict[str, Any]) -> list[dict[str, Any]]:
    """One ``value`` change per cell of a deterministic metric whose matched rows differ."""
    out = []
    m = g[g["side"] == "both"]
    for cell, c in m.groupby("cell_id", sort=True):
        bad = c[c["differs"]]
        if bad.empty:
            continue
        worst = bad.iloc[int(_rel_diff(bad["value_a"], bad["value_b"]).argmax())]
        va, vb = float(worst["value_a"]), float(worst["value_b"])
        diff = vb - va
        out.append(
            {
                "kind": "value",
                "cell_id": cell,
                **key,
                "location": _where(worst["seed"], worst["step"]),
                "a": va,
                "b": vb,
                "ratio": float(worst["ratio"]),
                "rows": f"{len(bad)}/{len(c)}",
                "detail": f"B-A {diff:+.4g}" if math.isfinite(diff) else "",
            }
        )
    return out


def _row_cells(
    g: Any, key: dict[str, Any], same_status: set[tuple[str, int]]
) -> list[dict[str, Any]]:
    """One ``rows`` change per (cell, seed) where deterministic rows are in only one run, in a
    task both runs finished with one status (else the status change says it)."""
    out: list[dict[str, Any]] = []
    lone = g[g["side"] != "both"]
    if lone.empty:
        return out
    for (cell, seed), c in lone.groupby(["cell_id", "seed"], sort=True, dropna=False):
        if (str(cell), _int(seed)) not in same_status:
            continue
        parts = []
        for side, name in (("a", "A"), ("b", "B")):
            s = c[c["side"] == side]
            if len(s):
                steps = sorted({str(x) for x in s["step"] if str(x) not in ("<NA>", "")})
                at = f" (step {', '.join(steps[:6])}{', ...' if len(steps) > 6 else ''})"
                parts.append(f"{len(s)} row{'s' * (len(s) != 1)} only in {name}"
                             + (at if steps else ""))  # fmt: skip
        out.append(
            {
                "kind": "rows",
                "cell_id": cell,
                **key,
                "location": f"seed={seed}",
                "a": math.nan,
                "b": math.nan,
                "ratio": math.nan,
                "rows": f"{len(c)}",
                "detail": "; ".join(parts),
            }
        )
    return out


def _timing_cells(
    g: Any, key: dict[str, Any], factor: float, timing: bool, alpha: float, min_samples: int
) -> tuple[list[tuple[str, dict[str, Any] | None]], str]:
    """Per (cell, step) series of one timing metric, seeds x repeats of each run pooled:
    :func:`timing_change`. Returns ([(cell, change or None) per judged series], check)."""
    if not timing:
        return [], "timing: not judged (--timing)"
    judged: list[tuple[str, dict[str, Any] | None]] = []
    few = few_beyond = 0
    for (cell, step), s in g.groupby(["cell_id", "step"], sort=True, dropna=False):
        xa, xb = s["value_a"].dropna().to_numpy(float), s["value_b"].dropna().to_numpy(float)
        if not len(xa) or not len(xb):
            continue
        changed, ratio, p = timing_change(xa, xb, factor, alpha=alpha, min_samples=min_samples)
        if changed is None:
            few += 1
            few_beyond += ratio > factor or ratio < 1.0 / factor
            continue
        item = None
        if changed:
            import numpy as np

            item = {
                "kind": "timing",
                "cell_id": cell,
                **key,
                "location": _where(None, step),
                "a": float(np.median(xa)),
                "b": float(np.median(xb)),
                "ratio": ratio,
                "rows": f"{len(xa)} vs {len(xb)}",
                "detail": f"ratio of medians, Mann-Whitney p={p:.2g}",
            }
        judged.append((str(cell), item))
    need = min_samples_for(alpha, min_samples)
    n_changed = sum(c is not None for _, c in judged)
    parts = []
    if judged:
        parts.append(f"changed in {n_changed}/{len(judged)} series")
    if few:
        parts.append(
            f"{few} series with too few samples (< {need} a side), not judged"
            + (f", {few_beyond} of them beyond x{factor:g}" if few_beyond else "")
        )
    return judged, "timing: " + "; ".join(parts or ["nothing to judge"])


def _int(v: Any) -> int:
    """A seed as int (-1 where missing)."""
    try:
        return int(v)
    except (TypeError, ValueError):
        return -1


def _runner_rows(df: Any) -> Any:
    return df[(df["analysis"] == RUNNER) & (df["metric"] == "wall_time")]


def _tasks_with_same_status(a: Any, b: Any) -> set[tuple[str, int]]:
    ra, rb = _runner_rows(a), _runner_rows(b)
    sa = {(str(c), int(s)): st for c, s, st in zip(ra["cell_id"], ra["seed"], ra["status"])}
    sb = {(str(c), int(s)): st for c, s, st in zip(rb["cell_id"], rb["seed"], rb["status"])}
    return {k for k in sa.keys() & sb.keys() if sa[k] == sb[k]}


def _status_changes(a: Any, b: Any) -> list[dict[str, Any]]:
    """A ``status`` change per (cell, seed) task in both runs whose runner status differs."""
    ra, rb = _runner_rows(a), _runner_rows(b)
    sa = {(str(c), int(s)): (st, n) for c, s, st, n in
          zip(ra["cell_id"], ra["seed"], ra["status"], ra["note"])}  # fmt: skip
    sb = {(str(c), int(s)): (st, n) for c, s, st, n in
          zip(rb["cell_id"], rb["seed"], rb["status"], rb["note"])}  # fmt: skip
    out = []
    for k in sorted(sa.keys() & sb.keys()):
        (st_a, note_a), (st_b, note_b) = sa[k], sb[k]
        if st_a == st_b:
            continue
        note = note_b if st_b != "ok" else note_a
        out.append(
            {
                "kind": "status",
                "cell_id": k[0],
                "analysis": RUNNER,
                "metric": "status",
                "variant": "",
                "location": f"seed={k[1]}",
                "a": st_a,
                "b": st_b,
                "ratio": math.nan,
                "rows": "",
                "detail": (note or "")[:160],
            }
        )
    return out


def task_differences(a: Any, b: Any) -> dict[str, Any]:
    """What only one run has: ``cells_a`` / ``cells_b`` (cell ids only in A / only in B, sorted;
    a renamed cell shows on both sides, no mapping is guessed), ``tasks_a`` / ``tasks_b``
    ((cell, seed) finished in one run only, of cells both have) and ``cells`` (the number of
    cells in both)."""
    ca, cb = set(map(str, a["cell_id"])), set(map(str, b["cell_id"]))
    common = ca & cb
    ta = {t for t in finished_tasks(a) if t[0] in common}
    tb = {t for t in finished_tasks(b) if t[0] in common}
    return {
        "cells_a": sorted(ca - cb),
        "cells_b": sorted(cb - ca),
        "tasks_a": sorted(ta - tb),
        "tasks_b": sorted(tb - ta),
        "cells": len(common),
    }


#: ``run.json`` fields the compare header names where the two runs differ: (label, dotted key)


def match_counts(a: Any, b: Any, joined: Any) -> dict[str, dict[str, int]]:
    """Per side: rows ``compared`` (ok or flagged), ``matched`` (with a partner in the other run),
    ``unmatched``, ``skipped`` (analyses that do not apply) and ``failed`` (error, nan, oom,
    diverged rows), neither compared."""
    out = {}
    for side, df in (("a", a), ("b", b)):
        compared = int(df["status"].isin(["ok", FLAGGED]).sum())
        matched = int((joined["side"] == "both").sum())
        out[side] = {
            "compared": compared,
            "matched": matched,
            "unmatched": int((joined["side"] == side).sum()),
            "skipped": int((df["status"] == "skipped").sum()),
            "failed": len(df) - compared - int((df["status"] == "skipped").sum()),
        }
    return out
