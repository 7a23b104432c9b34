"""Extractors of paper 004: Nguyen Ngoc Hieu, *An analysis of applying neural tangent kernels for
deep equilibrium models*, thesis 2022 (NTK, trajectory, landscape). One extractor per claim
``004-*``: a run directory's rows -> the keyword arguments of its checker in
:mod:`deqbench.reproduce.checks.p004_ntk`; the shared readers and the registry are in
:mod:`deqbench.reproduce.extract`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import (
    MEASURED,
    Extracted,
    _at_step,
    _curve_first,
    _extractor,
    _first,
    _missing,
    _per_seed,
    _rows,
    _series_mean,
    seeds_of,
)

__all__ = [
    "pr_fb",
    "ntk_lambda_min",
    "trajectory_init",
    "trajectory_init_var",
    "trajectory_separation",
    "trajectory_separation_var",
    "trajectory_complexity",
    "trajectory_complexity_var",
    "landscape_repeats",
]


@_extractor("004-pr-fb")
def pr_fb(df: Any, run_dir: Path, scale: str) -> Extracted:
    """Per seed a :class:`~deqbench.reproduce.checks.Sweep`: ``splitting_sweep``
    ``fb_alpha_bound`` and ``converged`` per ``forward_backward/alpha=a`` and
    ``peaceman_rachford/alpha=a`` (first cell)."""
    from ..checks.p004_ntk import Sweep

    sw = _rows(df, "splitting_sweep")
    if sw.empty:
        return _missing("no splitting_sweep rows")
    sw = sw[sw["cell_id"] == sorted(sw["cell_id"].unique())[0]]
    sweeps = []
    for s in seeds_of(sw):
        d = sw[sw["seed"] == s]
        bound = d[d["metric"] == "fb_alpha_bound"]["value"]
        tab: dict[str, dict[float, bool]] = {"forward_backward": {}, "peaceman_rachford": {}}
        for _, r in d[d["metric"] == "converged"].iterrows():
            method, _, a = str(r["variant"]).partition("/alpha=")
            if method in tab and a:
                tab[method][float(a)] = bool(float(r["value"]) >= 0.5)
        sweeps.append(
            Sweep(
                float(bound.iloc[0]) if len(bound) else math.nan,
                tab["forward_backward"],
                tab["peaceman_rachford"],
            )
        )
    return Extracted({"sweeps": sweeps})


def _slope(steps: Sequence[float], values: Sequence[float]) -> float:
    """Least-squares slope of log(values) against steps (positive finite values only)."""
    pts = [(float(x), math.log(float(y))) for x, y in zip(steps, values) if float(y) > 0]
    if len(pts) < 2:
        return math.nan
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    den = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / den if den > 0 else math.nan


@_extractor("004-ntk-lambda-min", one_run=True)
def ntk_lambda_min(df: Any, run_dir: Path, scale: str) -> Extracted:
    """The monDEQ cell's ``ntk`` rows per seed: ``lambda_min`` at each evaluation (first at
    init); the slope of log(``loss_at_eval``) per step fitted over the evaluations (full-batch
    GD: one step per epoch); converged = no flagged ``ntk`` row; the predicted slope: the mean of
    the series' ``pred_log_loss_slope`` (``series/ntk__<cell>__seed<s>.csv``). ``ntk`` emits no
    fitted slope of its own as a row."""
    nt = df[df["analysis"] == "ntk"]
    cells = [
        c for c in sorted(nt["cell_id"].unique()) if _first(df, c, "model").startswith("mondeq")
    ]
    if not cells:
        return _missing("no ntk rows of a monDEQ cell (the theorem is for monDEQs)")
    d = nt[nt["cell_id"] == cells[0]]
    lam, slope, conv = [], [], []
    for s in seeds_of(df):
        g = d[d["seed"] == s]
        lm = g[(g["metric"] == "lambda_min") & g["status"].isin(MEASURED)].sort_values("step")
        ls = g[(g["metric"] == "loss_at_eval") & g["status"].isin(MEASURED)].sort_values("step")
        lam.append([float(v) for v in lm["value"]])
        slope.append(_slope(list(ls["step"].astype(float)), list(ls["value"])))
        conv.append(bool(len(g)) and not (g["status"] == "flagged").any())
    if not any(lam):
        return _missing("no ntk lambda_min rows")
    kw: dict[str, Any] = {"lambda_min": lam, "log_loss_slope": slope, "converged": conv}
    pred = [_series_mean(run_dir / "series" / f"ntk__{cells[0]}__seed{s}.csv",
                         "pred_log_loss_slope") for s in seeds_of(df)]  # fmt: skip
    if all(math.isfinite(p) for p in pred):
        kw["predicted_slope"] = pred
    margin = _model_setting(run_dir, cells[0], _first(df, cells[0], "model"), "m")
    if margin is not None:
        kw["margin"] = margin
    return Extracted(kw)


def _model_setting(run_dir: Path, cell: str, model: str, key: str) -> float | None:
    """A model setting of ``cell``: the run's ``suite.yaml`` (a case whose id is in the cell id,
    else the defaults), else the model factory's default; None when neither has it."""
    import inspect

    from ...core.registry import models
    from . import suite_raw

    raw = suite_raw(run_dir)
    found = None
    defaults: dict[str, Any] = raw["defaults"] if isinstance(raw.get("defaults"), dict) else {}
    dm: dict[str, Any] = defaults["model"] if isinstance(defaults.get("model"), dict) else {}
    if key in dm:
        found = dm[key]
    matrix: dict[str, Any] = raw["matrix"] if isinstance(raw.get("matrix"), dict) else {}
    for case in matrix.get("case") or []:
        cm = case.get("model") if isinstance(case, dict) else None
        if isinstance(cm, dict) and key in cm and str(case.get("id", "")) in cell:
            found = cm[key]
    if found is None and model in models:
        p = inspect.signature(models.get(model)).parameters.get(key)
        found = None if p is None or p.default is inspect.Parameter.empty else p.default
    try:
        return None if found is None else float(found)
    except (TypeError, ValueError):
        return None


#: the cell of each reading of the thesis's "N(0, 0.01)" (Section 4.1.1): std 0.01 (primary)
#: and variance 0.01 (std 0.1)
READINGS = {"std": "init=std0.01", "var": "init=var0.01"}


def _trajectory_cells(df: Any, reading: str) -> tuple[str | None, str | None]:
    """(standard, small): the largest measured ``cell_weight_std`` is N(0, 1); small is the cell
    of ``reading`` (:data:`READINGS`); None where the run has no such cell."""
    t = df[(df["analysis"] == "trajectory") & (df["metric"] == "cell_weight_std")]
    std = t.groupby("cell_id")["value"].median().dropna()
    if len(std) < 2:
        return None, None
    standard = str(std.idxmax())
    small = next((c for c in std.index if READINGS[reading] in c), None)
    return standard, small


def _trajectory_init(df: Any, reading: str) -> Extracted:
    standard, small = _trajectory_cells(df, reading)
    if standard is None or small is None:
        return _missing(
            f"needs the N(0, 1) trajectory cell and the {READINGS[reading]} cell "
            "(cell_weight_std rows)"
        )
    seeds = seeds_of(df)
    out: dict[str, list[float]] = {}
    res: dict[str, list[float]] = {}
    budget: list[float] = []
    for key, c in (("standard", standard), ("small", small)):
        cell = df[df["cell_id"] == c]
        first = {}
        for metric in ("iterations_median", "rel_residual_final_median", "nstep"):
            d = _rows(cell, "trajectory", metric)
            first[metric] = [_curve_first(d[d["step"].notna()], s) for s in seeds]
        out[key], res[key] = first["iterations_median"], first["rel_residual_final_median"]
        budget = budget or first["nstep"]
    kwargs: dict[str, Any] = {"iterations": out}
    if budget and all(math.isfinite(b) for b in budget):
        kwargs["budget"] = budget
    if all(math.isfinite(r) for v in res.values() for r in v):
        kwargs["residual"] = res
    return Extracted(kwargs)


@_extractor("004-trajectory-init")
def trajectory_init(df: Any, run_dir: Path, scale: str) -> Extracted:
    """Per seed ``trajectory`` ``iterations_median`` at the first recording (init) of the
    standard (largest init std) and small (``init=std0.01``) cells."""
    return _trajectory_init(df, "std")


@_extractor("004-trajectory-init-var")
def trajectory_init_var(df: Any, run_dir: Path, scale: str) -> Extracted:
    """:func:`trajectory_init` with the ``init=var0.01`` cell as the small init."""
    return _trajectory_init(df, "var")


def _trajectory_separation(df: Any, reading: str) -> Extracted:
    _, small = _trajectory_cells(df, reading)
    if small is None:
        return _missing(f"no trajectory rows of the {READINGS[reading]} cell")
    t = df[(df["analysis"] == "trajectory") & (df["cell_id"] == small)]
    t = t[t["status"].isin(MEASURED)]
    sil = t[(t["metric"] == "silhouette") & (t["variant"] == "pca2")]
    if not (sil["step"] == 1).any():
        return _missing("no trajectory silhouette (pca2) after epoch 1 (epochs must include 1)")
    seeds = seeds_of(df)
    cf = t[t["metric"] == "converged_frac"]
    return Extracted(
        {
            "silhouette_init": [_at_step(sil, s, 0) for s in seeds],
            "silhouette_trained": [_at_step(sil, s, 1) for s in seeds],
            "converged": [_at_step(cf, s, 1) for s in seeds],
        }
    )


@_extractor("004-trajectory-separation")
def trajectory_separation(df: Any, run_dir: Path, scale: str) -> Extracted:
    """Per seed ``trajectory`` ``silhouette`` (variant ``pca2``) of the ``init=std0.01`` cell at
    epoch 0 and epoch 1, and its ``converged_frac`` at epoch 1."""
    return _trajectory_separation(df, "std")


@_extractor("004-trajectory-separation-var")
def trajectory_separation_var(df: Any, run_dir: Path, scale: str) -> Extracted:
    """:func:`trajectory_separation` of the ``init=var0.01`` cell."""
    return _trajectory_separation(df, "var")


def _trajectory_complexity(df: Any, reading: str) -> Extracted:
    _, small = _trajectory_cells(df, reading)
    if small is None:
        return _missing(f"no trajectory rows of the {READINGS[reading]} cell")
    d = _rows(df[df["cell_id"] == small], "trajectory", "iterations_median")
    d = d[d["step"].notna()]
    last = int(d["step"].max()) if len(d) else -1
    if not (d["step"] == 1).any() or last <= 1:
        return _missing(
            "no trajectory recording after epoch 1 (the thesis trains 40 epochs: train more "
            "than 1 and record trajectory epochs [0, 1, -1])"
        )
    seeds = seeds_of(df)
    kwargs: dict[str, Any] = {
        "iterations_first": [_at_step(d, s, 1) for s in seeds],
        "iterations_last": [_at_step(d, s, last) for s in seeds],
        "last_epoch": last,
    }
    # the solves' lengths and the residuals they reached: a count at the budget is censored
    for metric, key in (("nstep", "budget"), ("rel_residual_final_median", "residual")):
        m = _rows(df[df["cell_id"] == small], "trajectory", metric)
        pair = {w: [_at_step(m, s, e) for s in seeds] for w, e in (("first", 1), ("last", last))}
        if all(math.isfinite(v) for vs in pair.values() for v in vs):
            kwargs.update({f"{key}_{w}": vs for w, vs in pair.items()})
    return Extracted(kwargs)


@_extractor("004-trajectory-complexity")
def trajectory_complexity(df: Any, run_dir: Path, scale: str) -> Extracted:
    """Per seed ``trajectory`` ``iterations_median`` of the ``init=std0.01`` cell after epoch 1
    and at the last recorded epoch (which must be later), with each recording's ``nstep`` (the
    budget the count can be censored at) and ``rel_residual_final_median`` where recorded."""
    return _trajectory_complexity(df, "std")


@_extractor("004-trajectory-complexity-var")
def trajectory_complexity_var(df: Any, run_dir: Path, scale: str) -> Extracted:
    """:func:`trajectory_complexity` of the ``init=var0.01`` cell."""
    return _trajectory_complexity(df, "var")


@_extractor("004-landscape-repeats")
def landscape_repeats(df: Any, run_dir: Path, scale: str) -> Extracted:
    """Per seed ``landscape`` ``low_loss_area_frac`` of the DEQ (``deq``) and of ``tied_repeat``
    cells (``repeat-N`` from ``repeats=N`` in the cell id); the DEQ's ``converged_frac``."""
    la = df[(df["analysis"] == "landscape") & df["status"].isin(MEASURED)]
    seeds = seeds_of(df)
    area: dict[str, list[float]] = {}
    deq_conv: list[float] = []
    for c in sorted(la["cell_id"].unique()):
        model = _first(df, c, "model")
        if model.startswith("tied_repeat"):
            n = re.search(r"repeats=(\d+)", c)
            if not n:
                continue
            key = f"repeat-{n.group(1)}"
        else:
            key = "deq"
            deq_conv = _per_seed(la[(la["cell_id"] == c) & (la["metric"] == "converged_frac")],
                                 seeds)  # fmt: skip
        d = la[(la["cell_id"] == c) & la["metric"].str.startswith("low_loss_area_frac")]
        area[key] = _per_seed(d, seeds)
    if not area:
        return _missing("no landscape low_loss_area_frac rows")
    return Extracted({"low_loss_area": area, "deq_converged": deq_conv})
