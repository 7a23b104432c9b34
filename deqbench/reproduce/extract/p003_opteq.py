"""Extractors of paper 003: Xie et al., *Optimization Induced Equilibrium Networks*, IEEE TPAMI
(OptEq). One extractor per claim ``003-*``: a run directory's rows -> the keyword arguments of its
checker in :mod:`deqbench.reproduce.checks.p003_opteq`; the shared readers and the registry are in
:mod:`deqbench.reproduce.extract`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from . import (
    Extracted,
    _extractor,
    _first,
    _missing,
    _per_seed,
    _rows,
    seeds_of,
)

__all__ = [
    "residual_vs_k",
    "accuracy_vs_k",
    "unrolled_speed",
    "ift_memory",
    "ift_threshold",
    "unrolled_vs_ift_accuracy",
    "alpha",
]


def _opteq(df: Any) -> tuple[Any, dict[str, tuple[str, float]]]:
    """``unroll_compare`` rows of one gamma (0.9 if several, else the largest below 1) and
    cell -> ("unrolled", K) or ("ift", thd)."""
    u = _rows(df, "unroll_compare")
    gam = u[u["metric"] == "gamma"].groupby("cell_id")["value"].median()
    if gam.nunique() > 1:
        vals = sorted(set(gam))
        pick = (
            0.9
            if any(math.isclose(v, 0.9) for v in vals)
            else max([v for v in vals if v < 1] or vals)
        )
        keep = set(gam[[math.isclose(v, pick) for v in gam]].index)
        u = u[u["cell_id"].isin(keep)]
    kinds: dict[str, tuple[str, float]] = {}
    for c in u["cell_id"].unique():
        bw = _first(df, c, "backward")
        k = u[(u["cell_id"] == c) & (u["metric"] == "unroll_k")]["value"]
        t = u[(u["cell_id"] == c) & (u["metric"] == "threshold")]["value"]
        if bw.startswith("unrolled") and len(k) and math.isfinite(float(k.iloc[0])):
            kinds[c] = ("unrolled", float(k.iloc[0]))
        elif bw.startswith("ift") and len(t) and math.isfinite(float(t.iloc[0])):
            kinds[c] = ("ift", float(t.iloc[0]))
    return u, kinds


def _opteq_table(df: Any, metric: str, kind: str, scale_by: float = 1.0) -> dict[Any, list[float]]:
    u, kinds = _opteq(df)
    seeds = seeds_of(df)
    out: dict[Any, list[float]] = {}
    for c, (k, x) in sorted(kinds.items(), key=lambda kv: kv[1][1]):
        if k != kind:
            continue
        d = u[(u["cell_id"] == c) & (u["metric"] == metric)]
        key = int(x) if kind == "unrolled" else x
        out[key] = [v * scale_by for v in _per_seed(d, seeds)]
    return out


@_extractor("003-residual-vs-k")
def residual_vs_k(df: Any, run_dir: Path, scale: str) -> Extracted:
    """K -> per seed ``unroll_compare`` ``rel_residual_opteq`` of the unrolled cells."""
    r = _opteq_table(df, "rel_residual_opteq", "unrolled")
    return Extracted({"residual": r}) if r else _missing("no unroll_compare rel_residual_opteq")


@_extractor("003-accuracy-vs-k")
def accuracy_vs_k(df: Any, run_dir: Path, scale: str) -> Extracted:
    """K -> per seed ``unroll_compare`` ``test_accuracy`` of the unrolled cells."""
    a = _opteq_table(df, "test_accuracy", "unrolled")
    return Extracted({"accuracy": a}) if a else _missing("no unroll_compare test_accuracy")


@_extractor("003-unrolled-speed", one_run=True)
def unrolled_speed(df: Any, run_dir: Path, scale: str) -> Extracted:
    """Per seed inference seconds per batch (``unroll_compare`` ``inference_ms_median`` / 1000)
    of the unrolled cells (by K) and the IFT cells (by threshold)."""
    un = _opteq_table(df, "inference_ms_median", "unrolled", 1e-3)
    ift = _opteq_table(df, "inference_ms_median", "ift", 1e-3)
    if not un or not ift:
        return _missing("no unroll_compare inference_ms_median of unrolled and IFT cells")
    return Extracted({"unrolled": un, "ift": ift, "device": run_device(run_dir)})


def run_device(run_dir: Path) -> str:
    """The run's device from its ``run.json`` (``"cuda"``, ``"cpu"``; ``"unknown"``)."""
    from ...run.results_reader import run_meta

    return str(run_meta(run_dir).get("device") or "unknown")


def _positive(table: Mapping[Any, Sequence[float]]) -> bool:
    return bool(table) and all(math.isfinite(v) and v > 0 for vs in table.values() for v in vs)


@_extractor("003-ift-memory")
def ift_memory(df: Any, run_dir: Path, scale: str) -> Extracted:
    """Per seed memory of one training step (bytes) of the unrolled cells (by K) and the IFT
    cells (by threshold): ``unroll_compare`` ``activation_memory`` (the bytes autograd saves in
    one training forward: what unrolling multiplies by K) where it is positive in every cell and
    seed, else ``peak_memory`` (the CUDA allocator's peak, weights and optimizer state included;
    on CPU a fresh process's peak RSS)."""
    for metric in ("activation_memory", "peak_memory"):
        un = _opteq_table(df, metric, "unrolled")
        ift = _opteq_table(df, metric, "ift")
        if _positive(un) and _positive(ift):
            return Extracted({"unrolled": un, "ift": ift}, notes=(f"memory: {metric}",))
    return _missing("no positive unroll_compare peak_memory or activation_memory in every cell")


@_extractor("003-ift-threshold")
def ift_threshold(df: Any, run_dir: Path, scale: str) -> Extracted:
    """Threshold -> per seed ``unroll_compare`` ``test_accuracy`` of the IFT cells."""
    ift = _opteq_table(df, "test_accuracy", "ift")
    return Extracted({"ift": ift}) if ift else _missing("no unroll_compare test_accuracy of IFT")


@_extractor("003-unrolled-vs-ift-accuracy")
def unrolled_vs_ift_accuracy(df: Any, run_dir: Path, scale: str) -> Extracted:
    """Per seed ``unroll_compare`` ``test_accuracy`` of the unrolled cells (by K) and the IFT
    cells (by threshold)."""
    un = _opteq_table(df, "test_accuracy", "unrolled")
    ift = _opteq_table(df, "test_accuracy", "ift")
    if not un or not ift:
        return _missing("no unroll_compare test_accuracy of unrolled and IFT cells")
    return Extracted({"unrolled": un, "ift": ift})


@_extractor("003-alpha")
def alpha(df: Any, run_dir: Path, scale: str) -> Extracted:
    """Alpha (``alpha=<a>`` in the cell id) -> per seed the last ``metrics`` test accuracy; no
    suite sweeps alpha yet (the claim is listed with ``suite=None``)."""
    import re

    seeds = seeds_of(df)
    out: dict[float, list[float]] = {}
    for c in sorted(df["cell_id"].unique()):
        m = re.search(r"alpha=([0-9.eE+-]+)", str(c))
        if not m:
            continue
        d = _rows(df[df["cell_id"] == c], "metrics", "accuracy", "test")
        d = d[d["step"].notna()]
        last = d[d["step"] == d["step"].max()] if len(d) else d
        out[float(m.group(1))] = _per_seed(last, seeds)
    if len(out) < 2:
        return _missing("needs an alpha sweep (cells alpha=<a>) of the deep OptEq (Table 5)")
    return Extracted({"accuracy": out, "scale": scale})
