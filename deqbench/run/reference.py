"""Reference check for CI: does a fresh run of a suite reproduce a committed reference run?

``deqbench compare REF FRESH --reference`` (exit 1 on a mismatch) and
:func:`check_against_reference` behind it. Unlike ``deqbench compare`` (bit-for-bit by
default), the tolerances here allow for another CPU: other BLAS kernels and thread counts
round differently, which moves an iteration count by a step or two, a residual by some
percent, an accuracy by a sample or two. They do not allow for a change of behaviour (another
``max_iter``, learning rate or number of epochs), which moves these numbers further or changes
which tasks and rows exist. Timings are never compared.

Example:
    >>> from deqbench.run.reference import check_against_reference
    >>> for line in check_against_reference("plots/smoke", "results/smoke/RUN"):  # doctest: +SKIP
    ...     print(line)
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .results import (
    FLAGGED,
    JOIN_KEYS,
    RUNNER,
    _run_meta,
    finished_tasks,
    is_timing,
    load_results,
    suite_differences,
)

#: analyses whose rows are checked (deterministic metrics of training and of the solver)
ANALYSES = ("metrics", "solver_stats")

# Why these tolerances: measured on suites/smoke.yaml (24 cells x 2 seeds, 96 test samples) with
# one code snapshot run twice, on 1 thread with AVX2 kernels and on 2 threads with SSE4.2 kernels
# (ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2; what another CPU changes): no
# status and no converged share moved; mean f-evaluations per batch moved by at most 0.5,
# accuracies by at most 0.031 (3 samples), losses by at most 1.8%, residuals by up to a factor
# 6.5 (solves that end at max_iter unconverged, where the Broyden/Anderson history amplifies
# rounding). A learning rate 20% lower (a changed default) moved training losses by 7-11%,
# accuracies by up to 0.10, counts by up to 23% (100 -> 77), residuals by up to a factor 970 and
# converged shares 0 -> 1, in 14 of the 18 cells it reached. Each bound sits above the first set
# and below most of the second; the checks together caught the change in most affected cells.
# A second machine (Intel Xeon, torch 2.11.0 vs the reference's AMD EPYC, torch 2.14.1; the
# 20-cell smoke suite) moved one count by 17% (conv Broyden cell, final-test
# adjoint, 24 -> 28 f-evals) and nothing else beyond these bounds: counts get 20%.

#: f-evaluation counts (``*_nstep``, ``*_nstep_max``, unit f-evals): within ``ATOL_COUNTS``
#: evaluations or ``RTOL_COUNTS`` of the larger count, whichever is looser (a changed
#: ``max_iter`` or a solve that now fails to converge moves them by far more)
RTOL_COUNTS = 0.2
ATOL_COUNTS = 2.0
#: accuracies (fractions): within 0.05, about 5 of the smoke suite's 96 test samples
ATOL_ACCURACY = 0.05
#: converged shares (``*_converged``, ``*_unconverged_batches``): within 0.5, one batch of 2
#: flipping; 1 vs 0 (every batch vs none) is a mismatch
ATOL_CONVERGED = 0.5
#: residuals (``*_residual``): ``|b - a| <= RTOL_RESIDUAL * max(|a|, |b|)`` (0.9: within a
#: factor 10), or both below ``ATOL_RESIDUAL`` (the float32 floor)
RTOL_RESIDUAL = 0.9
ATOL_RESIDUAL = 1e-6
#: losses, MSE and any other deterministic metric: within 5% of the larger value
RTOL_LOSS = 0.05
#: suite keys that may differ between the reference and the fresh run: where and how it runs,
#: not what it computes (the tolerances absorb their rounding)
RUNTIME_KEYS = ("threads", "device", "output", "description")


def metric_kind(metric: str, unit: str = "") -> str:
    """``count``, ``accuracy``, ``converged``, ``residual`` or ``loss`` (every other metric):
    which tolerance of :func:`check_against_reference` a metric gets."""
    m = str(metric)
    if unit == "f-evals" or m.endswith("_nstep") or m.endswith("_nstep_max"):
        return "count"
    if "converged" in m:
        return "converged"
    if "accuracy" in m:
        return "accuracy"
    if "residual" in m:
        return "residual"
    return "loss"


def tolerances_text(
    *,
    rtol_counts: float = RTOL_COUNTS,
    atol_counts: float = ATOL_COUNTS,
    atol_accuracy: float = ATOL_ACCURACY,
    atol_converged: float = ATOL_CONVERGED,
    rtol_residual: float = RTOL_RESIDUAL,
    atol_residual: float = ATOL_RESIDUAL,
    rtol_loss: float = RTOL_LOSS,
) -> str:
    """The tolerances in one line, for the CLI's verdict."""
    return (
        f"counts +-max({atol_counts:g}, {rtol_counts:.0%}), accuracy +-{atol_accuracy:g}, "
        f"converged share +-{atol_converged:g}, residuals {rtol_residual:.0%} of the larger "
        f"(or both < {atol_residual:g}), losses {rtol_loss:.0%}; timings not compared"
    )


def _within(kind: str, a: float, b: float, tol: dict[str, float]) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if a == b:
        return True
    d, big = abs(b - a), max(abs(a), abs(b))
    if kind == "count":
        return d <= max(tol["atol_counts"], tol["rtol_counts"] * big)
    if kind == "accuracy":
        return d <= tol["atol_accuracy"]
    if kind == "converged":
        return d <= tol["atol_converged"]
    if kind == "residual":
        return big <= tol["atol_residual"] or d <= tol["rtol_residual"] * big
    return d <= tol["rtol_loss"] * big + 1e-12


def _bound(kind: str, tol: dict[str, float]) -> str:
    return {
        "count": f"+-max({tol['atol_counts']:g}, {tol['rtol_counts']:.0%})",
        "accuracy": f"+-{tol['atol_accuracy']:g}",
        "converged": f"+-{tol['atol_converged']:g}",
        "residual": f"{tol['rtol_residual']:.0%} of the larger",
        "loss": f"{tol['rtol_loss']:.0%}",
    }[kind]


def _tasks_text(tasks: list[tuple[str, int]]) -> list[str]:
    """``CELL seed 0,1`` per cell."""
    by: dict[str, list[int]] = {}
    for c, s in sorted(tasks):
        by.setdefault(c, []).append(s)
    return [f"{c} seed {','.join(map(str, s))}" for c, s in by.items()]


def _statuses(df: Any) -> dict[tuple[str, int], tuple[str, str]]:
    r = df[(df["analysis"] == RUNNER) & (df["metric"] == "wall_time")]
    return {
        (str(c), int(s)): (str(st), str(n))
        for c, s, st, n in zip(r["cell_id"], r["seed"], r["status"], r["note"])
    }


def _suite_mismatches(reference_run_dir: str | Path, fresh_run_dir: str | Path) -> list[str]:
    """Another suite name, or other resolved settings than :data:`RUNTIME_KEYS` (one line)."""
    out: list[str] = []
    (mr, sr), (mf, sf) = _run_meta(reference_run_dir), _run_meta(fresh_run_dir)
    name_r = mr.get("suite") or (sr or {}).get("name")
    name_f = mf.get("suite") or (sf or {}).get("name")
    if name_r and name_f and name_r != name_f:
        out.append(f"suite: {name_r!r} in the reference, {name_f!r} in the fresh run")
    elif sr is not None and sf is not None:
        keys = [k for k in suite_differences(sr, sf) if k.split(".")[0].split(" ")[0]
                not in RUNTIME_KEYS]  # fmt: skip
        if keys:
            out.append("suite settings differ (reference vs fresh): " + ", ".join(keys))
    return out


def check_against_reference(
    reference_run_dir: str | Path,
    fresh_run_dir: str | Path,
    *,
    rtol_counts: float = RTOL_COUNTS,
    atol_counts: float = ATOL_COUNTS,
    atol_accuracy: float = ATOL_ACCURACY,
    atol_converged: float = ATOL_CONVERGED,
    rtol_residual: float = RTOL_RESIDUAL,
    atol_residual: float = ATOL_RESIDUAL,
    rtol_loss: float = RTOL_LOSS,
    analyses: tuple[str, ...] = ANALYSES,
) -> list[str]:
    """Where a fresh run of a suite does not reproduce a reference run; ``[]`` when it does.

    One human-readable line per mismatch:

    * the suite: another suite name, or other resolved settings (``suite.yaml`` keys except
      :data:`RUNTIME_KEYS`): the reference must be made again when the suite changes;
    * the tasks: the set of finished (cell_id, seed) must be the same (a renamed cell is a
      missing and an extra task);
    * the status of each task (the ``runner`` row, ``ok``/``flagged``/...): exactly equal;
    * per task of equal status, the rows of ``analyses`` (default ``metrics`` and
      ``solver_stats``) except timings: the same rows (JOIN_KEYS), the same row statuses, and
      values within these tolerances (NaN only matches NaN), one line per (cell, analysis,
      metric, variant) naming the worst row:

      - f-evaluation counts (``*_nstep``, ``*_nstep_max``): ``|b - a| <= max(atol_counts,
        rtol_counts * max(a, b))``, default 2 evaluations or 20%;
      - accuracies: ``|b - a| <= atol_accuracy``, default 0.05 (5 of 96 test samples);
      - converged shares (``*_converged``, ``*_unconverged_batches``): ``|b - a| <=
        atol_converged``, default 0.5 (one batch of 2; 1 vs 0 fails);
      - residuals: ``|b - a| <= rtol_residual * max(|a|, |b|)`` (default 0.9: a factor 10),
        or both ``<= atol_residual`` (default 1e-6);
      - losses, MSE and other metrics: ``|b - a| <= rtol_loss * max(|a|, |b|)``, default 5%.

    Timings (:func:`~deqbench.run.results.is_timing`) are never compared.
    """
    tol = {
        "rtol_counts": rtol_counts,
        "atol_counts": atol_counts,
        "atol_accuracy": atol_accuracy,
        "atol_converged": atol_converged,
        "rtol_residual": rtol_residual,
        "atol_residual": atol_residual,
        "rtol_loss": rtol_loss,
    }
    ref, new = load_results(reference_run_dir), load_results(fresh_run_dir)
    out = _suite_mismatches(reference_run_dir, fresh_run_dir)

    tr, tf = finished_tasks(ref), finished_tasks(new)
    out += [f"missing task (in the reference only): {t}" for t in _tasks_text(sorted(tr - tf))]
    out += [f"extra task (in the fresh run only): {t}" for t in _tasks_text(sorted(tf - tr))]

    st_r, st_f = _statuses(ref), _statuses(new)
    same: set[tuple[str, int]] = set()
    for key in sorted(tr & tf):
        (a, note_a), (b, note_b) = st_r[key], st_f[key]
        if a == b:
            same.add(key)
            continue
        note = note_b if b != "ok" else note_a
        out.append(
            f"status: {key[0]} seed={key[1]}: {a} in the reference, {b} in the fresh run"
            + (f" ({note[:200]})" if note else "")
        )

    def rows(df: Any) -> Any:
        d = df[df["analysis"].isin(analyses) & ~df["unit"].map(is_timing).astype(bool)]
        keep = [(str(c), int(s)) in same for c, s in zip(d["cell_id"], d["seed"])]
        d = d[keep][[*JOIN_KEYS, "value", "unit", "status"]].copy()
        d["step"] = d["step"].astype("Int64").astype(str)
        return d

    j = rows(ref).merge(rows(new), on=JOIN_KEYS, how="outer", suffixes=("_r", "_f"), indicator=True)
    if j.empty:
        return out
    j["unit"] = j["unit_r"].where(j["unit_r"].notna(), j["unit_f"]).fillna("")
    for (cell, an, metric, variant), g in j.groupby(
        ["cell_id", "analysis", "metric", "variant"], sort=True
    ):
        what = f"{cell} {an} {metric}" + (f" ({variant})" if variant else "")
        lone_r = g[g["_merge"] == "left_only"]
        lone_f = g[g["_merge"] == "right_only"]
        if len(lone_r) or len(lone_f):
            parts = [
                f"{len(x)} row{'s' * (len(x) != 1)} only in the {side} ("
                + ", ".join(_where(r.seed, r.step) for r in x.head(4).itertuples())
                + (", ..." if len(x) > 4 else "")
                + ")"
                for x, side in ((lone_r, "reference"), (lone_f, "fresh run"))
                if len(x)
            ]
            out.append(f"rows: {what}: " + "; ".join(parts))
        both = g[g["_merge"] == "both"]
        status_diff = both[both["status_r"] != both["status_f"]]
        if len(status_diff):
            r = status_diff.iloc[0]
            out.append(
                f"row status: {what}: {len(status_diff)}/{len(both)} rows, e.g. "
                f"{_where(r['seed'], r['step'])}: {r['status_r']} in the reference, "
                f"{r['status_f']} in the fresh run"
            )
        vals = both[both["status_r"].isin(["ok", FLAGGED]) & (both["status_r"] == both["status_f"])]
        kind = metric_kind(metric, next((u for u in g["unit"] if u), ""))
        bad = []
        for r in vals.itertuples():
            vr, vf = float(r.value_r), float(r.value_f)
            if not _within(kind, vr, vf, tol):
                big = max(abs(vr), abs(vf))
                d = abs(vf - vr) / big if big > 0 else math.inf
                bad.append((d if not math.isnan(d) else math.inf, r, vr, vf))
        if bad:
            _, r, vr, vf = max(bad, key=lambda x: x[0])
            out.append(
                f"value: {what}: {len(bad)}/{len(vals)} rows beyond {_bound(kind, tol)}, worst "
                f"{_where(r.seed, r.step)}: {vr:.6g} in the reference, {vf:.6g} in the fresh run"
            )
    return out


def _where(seed: Any, step: Any) -> str:
    s = str(step)
    return f"seed={seed}" + (f" step={s}" if s not in ("", "<NA>", "nan", "None") else "")
