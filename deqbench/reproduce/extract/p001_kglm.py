"""Extractors of paper 001: Tsuchida et al., *Declarative nets that are equilibrium models*, ICLR
2022 (kGLM-initialised DEQs). One extractor per claim ``001-*``: a run directory's rows -> the
keyword arguments of its checker in :mod:`deqbench.reproduce.checks.p001_kglm`; the shared readers
and the registry are in :mod:`deqbench.reproduce.extract`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import (
    FAILED,
    Extracted,
    _cells,
    _converged_share,
    _extractor,
    _first,
    _missing,
    _per_seed,
    _rows,
    _task_status,
    data_name,
    seeds_of,
    suite_raw,
)

__all__ = [
    "klr_equivalence",
    "gp_informed_init",
    "gp_naive_init",
    "klr_finetune",
    "hsi_denoise",
    "denoise",
    "init_cost",
]


@_extractor("001-klr-equivalence")
def klr_equivalence(df: Any, run_dir: Path, scale: str) -> Extracted:
    """``klr_agreement`` rows of the informed (``kglm_informed``) and random cells, float64
    where measured (else float32). ``klr_agreement`` counts disagreeing pixels and those at ties
    by ``|p_KLR - 1/2| < 1e-6``, not each pixel's distance: disagreements away from ties enter as
    distance 1e-6 (a lower bound, beyond the checker's 1e-7); disagreements at ties cannot be
    judged against 1e-7 (missing measurement) unless others already decide the verdict."""
    k = df[df["analysis"] == "klr_agreement"]
    informed = _cells(k, init="kglm_informed")
    if not informed:
        return _missing("no klr_agreement rows of a kglm_informed cell")
    dt = "float64" if (k["variant"] == "float64").any() else "float32"

    def val(cell: str, metric: str) -> float:
        d = _rows(k[k["cell_id"] == cell], "klr_agreement", metric, dt)
        return float(d["value"].max()) if len(d) else math.nan

    cell = informed[0]
    pixels, dis, ties = (val(cell, m) for m in ("pixels", "disagreeing_pixels",
                                                  "disagreeing_pixels_at_ties"))  # fmt: skip
    if not all(math.isfinite(x) for x in (pixels, dis, ties)):
        return _missing("klr_agreement pixels / disagreeing_pixels(_at_ties) not measured")
    off = int(dis - ties)
    if ties > 0 and off == 0:
        return _missing(
            f"{int(ties)} disagreeing pixels within 1e-6 of a tie: klr_agreement does not emit "
            "|p_KLR - 1/2| per disagreeing pixel (the checker's tie tolerance is 1e-7)"
        )
    max_iter = (suite_raw(run_dir).get("defaults") or {}).get("solver", {}) or {}
    cap = float(max_iter.get("max_iter", math.inf)) if isinstance(max_iter, dict) else math.inf
    nstep = val(cell, "deq_nstep")
    statuses = set(k[k["cell_id"] == cell]["status"])
    conv = df[(df["cell_id"] == cell) & (df["analysis"] == "convergence")]["value"]
    converged = (
        statuses <= {"ok"}
        and (not len(conv) or float(conv.max()) == 0.0)
        and (not math.isfinite(nstep) or nstep < cap)
    )
    random = _cells(k, init="kglm_random")
    rnd = val(random[0], "disagreeing_pixels") if random else math.nan
    return Extracted(
        {
            "pixels": int(pixels),
            "tie_distances": [1e-6] * off + [0.0] * int(ties),
            "converged": bool(converged),
            "random_disagreeing": int(rnd) if math.isfinite(rnd) else None,
        },
        notes=(f"dtype {dt}",),
    )


def _scheme(init: str) -> str:
    return {"kglm_informed": "informed", "kglm_random": "random", "kglm_naive": "naive"}.get(
        init, init
    )


def _mse_by_epoch(df: Any, cell: str, seeds: Sequence[int]) -> dict[int, list[float]]:
    d = _rows(df[df["cell_id"] == cell], "metrics", "mse", "test")
    d = d[d["step"].notna()]
    out: dict[int, list[float]] = {}
    for e in sorted(int(x) for x in d["step"].unique()):
        out[e] = _per_seed(d[d["step"] == e], seeds)
    return out


@_extractor("001-gp-informed-init")
def gp_informed_init(df: Any, run_dir: Path, scale: str) -> Extracted:
    """``metrics`` test ``mse`` per epoch of the informed and random cells; the informed model's
    converged share per seed over the epochs the checker judges (``0 .. GP_EARLY_EPOCH``): mean
    of ``solver_stats`` ``forward_converged`` (variants train and test) at those epochs, else the
    runner's ``forward_unconverged_batches``. The share over later epochs, whose numbers the
    checker does not use, goes into the notes."""
    from ..checks.p001_kglm import GP_EARLY_EPOCH

    seeds = seeds_of(df)
    cells = {_scheme(_first(df, c, "init")): c for c in df["cell_id"].unique()}
    if "informed" not in cells or "random" not in cells:
        return _missing("needs an informed (kglm_informed) and a random (kglm_random) cell")
    inf, rnd = (_mse_by_epoch(df, cells[s], seeds) for s in ("informed", "random"))
    if not inf or not rnd:
        return _missing("no metrics test mse per epoch")
    st = _rows(df[df["cell_id"] == cells["informed"]], "solver_stats", "forward_converged")
    st = st[st["variant"].isin(["train", "test"])]
    notes: list[str] = []
    if len(st):
        judged = st[st["step"].notna() & (st["step"] <= GP_EARLY_EPOCH)]
        conv = _per_seed(judged if len(judged) else st, seeds, "mean")
        later = st[st["step"] > GP_EARLY_EPOCH]
        if len(later):
            share = _per_seed(later, seeds, "mean")
            notes.append(
                f"informed solves converged at epochs {GP_EARLY_EPOCH + 1}-"
                f"{int(later['step'].max())} (not judged): " + ", ".join(f"{x:.0%}" for x in share)
            )
    else:
        conv = [_converged_share(df, cells["informed"], s) for s in seeds]
    return Extracted(
        {"informed": inf, "random": rnd, "informed_converged": conv}, notes=tuple(notes)
    )


@_extractor("001-gp-naive-init")
def gp_naive_init(df: Any, run_dir: Path, scale: str) -> Extracted:
    """Per seed ``metrics`` test ``mse`` at epoch 0 of the naive (``kglm_naive``) and random
    (``kglm_random``) cells; the naive model's converged share at epoch 0 (``solver_stats``
    ``forward_converged``, variants train and test, else the runner's convergence rows)."""
    seeds = seeds_of(df)
    cells = {_scheme(_first(df, c, "init")): c for c in df["cell_id"].unique()}
    if "naive" not in cells or "random" not in cells:
        return _missing("needs a naive-GLM (kglm_naive) and a random (kglm_random) cell")
    nv, rd = (_mse_by_epoch(df, cells[s], seeds) for s in ("naive", "random"))
    if 0 not in nv or 0 not in rd:
        return _missing("no metrics test mse at epoch 0 of the naive and random cells")
    st = _rows(df[df["cell_id"] == cells["naive"]], "solver_stats", "forward_converged")
    st = st[st["variant"].isin(["train", "test"]) & (st["step"] == 0)]
    conv = (
        _per_seed(st, seeds, "mean")
        if len(st)
        else [_converged_share(df, cells["naive"], s) for s in seeds]
    )
    kw: dict[str, Any] = {"naive": nv[0], "random": rd[0]}
    if all(math.isfinite(c) for c in conv):
        kw["naive_converged"] = conv
    return Extracted(kw)


@_extractor("001-klr-finetune")
def klr_finetune(df: Any, run_dir: Path, scale: str) -> Extracted:
    """Per seed the last ``metrics`` test ``mse`` of the kernel-initialised (``kglm_informed``)
    and random (``kglm_random``) cells of a run that trained (last epoch >= 1) on binarised,
    corrupted images (``digits_klr``: the kglm_klr_finetune suites)."""
    if data_name(run_dir) != "digits_klr":
        return _missing("a run of the kernel DEQ trained on binarised, corrupted images")
    seeds = seeds_of(df)
    cells = {_scheme(_first(df, c, "init")): c for c in df["cell_id"].unique()}
    if "informed" not in cells or "random" not in cells:
        return _missing("needs a kernel-initialised (kglm_informed) and a random cell")
    kg, rd = (_mse_by_epoch(df, cells[s], seeds) for s in ("informed", "random"))
    if not kg or not rd or max(kg) < 1 or max(rd) < 1:
        return _missing("no test mse after training (the kglm_klr suite trains 0 epochs)")
    kw: dict[str, Any] = {"kernel": kg[max(kg)], "random": rd[max(rd)], "scale": scale}
    conv = [
        min(_converged_share(df, cells["informed"], s), _converged_share(df, cells["random"], s))
        for s in seeds
    ]
    if not all(math.isnan(c) for c in conv):
        kw["converged"] = conv
    return Extracted(kw)


@_extractor("001-hsi-denoise")
def hsi_denoise(df: Any, run_dir: Path, scale: str) -> Extracted:
    """Nothing to read: no dataset loads App. F's hyperspectral road images (the claim is
    listed with ``suite=None``; its checker names what is missing)."""
    return _missing("no dataset loads App. F's hyperspectral road images (HSI Road)")


@_extractor("001-denoise")
def denoise(df: Any, run_dir: Path, scale: str) -> Extracted:
    """Per scheme (``kglm_informed`` -> kglm, ``kglm_random`` -> random) and epoch, per seed the
    best ``metrics`` test ``mse`` over the grid of scales (finite values of tasks that did not
    fail); failed runs per seed = grid points whose task failed or whose last test MSE is not
    finite; converged = the runner's forward convergence share at the best final grid point."""
    seeds = seeds_of(df)
    groups: dict[str, list[str]] = {"kglm": [], "random": []}
    for c in df["cell_id"].unique():
        sch = {"kglm_informed": "kglm", "kglm_random": "random"}.get(_first(df, c, "init"))
        if sch:
            groups[sch].append(c)
    if not groups["kglm"] or not groups["random"]:
        return _missing("needs kglm_informed and kglm_random cells")
    best: dict[str, dict[int, list[float]]] = {}
    failed: dict[str, list[int]] = {}
    converged: dict[str, list[float]] = {}
    for scheme, cells in groups.items():
        per_cell = {c: _mse_by_epoch(df, c, seeds) for c in cells}
        epochs = sorted({e for m in per_cell.values() for e in m})
        fails = []
        conv = []
        for i, s in enumerate(seeds):
            bad = 0
            best_cell, best_v = None, math.inf
            for c, m in per_cell.items():
                last = m[max(m)][i] if m else math.nan
                if _task_status(df, c, s) in FAILED or not math.isfinite(last):
                    bad += 1
                elif last < best_v:
                    best_cell, best_v = c, last
            fails.append(bad)
            conv.append(_converged_share(df, best_cell, s) if best_cell else math.nan)
        failed[scheme] = fails
        converged[scheme] = conv
        best[scheme] = {}
        for e in epochs:
            vals = []
            for i, s in enumerate(seeds):
                ok = [
                    m[e][i]
                    for c, m in per_cell.items()
                    if e in m and math.isfinite(m[e][i]) and _task_status(df, c, s) not in FAILED
                ]
                vals.append(min(ok) if ok else math.nan)
            best[scheme][e] = vals
    kw: dict[str, Any] = {"best_mse": best, "failed": failed}
    if all(math.isfinite(v) for vs in converged.values() for v in vs):
        kw["converged"] = converged
    return Extracted(kw)


@_extractor("001-init-cost")
def init_cost(df: Any, run_dir: Path, scale: str) -> Extracted:
    """``kglm_init_cost`` ``init_time`` rows (one per repeat; step = width or channels) of the
    first seed: variants ``fc/kglm``, ``fc/random``, ``conv/kglm``."""
    d = _rows(df, "kglm_init_cost", "init_time")
    if d.empty:
        return _missing("no kglm_init_cost init_time rows")
    d = d[d["seed"] == min(seeds_of(d))]

    def table(variant: str) -> dict[int, list[float]]:
        g = d[d["variant"] == variant].sort_values("repeat")
        return {int(k): [float(x) for x in v["value"]] for k, v in g.groupby(g["step"].astype(int))}

    return Extracted(
        {
            "fc_kglm": table("fc/kglm"),
            "fc_random": table("fc/random"),
            "conv_kglm": table("conv/kglm"),
        }
    )
