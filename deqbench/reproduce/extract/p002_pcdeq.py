"""Extractors of paper 002: Gabor et al., *Positive Concave Deep Equilibrium Models*, ICML 2024
(pcDEQ). One extractor per claim ``002-*``: a run directory's rows -> the keyword arguments of its
checker in :mod:`deqbench.reproduce.checks.p002_pcdeq`; the shared readers and the registry are in
:mod:`deqbench.reproduce.extract`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import (
    MEASURED,
    Extracted,
    _activation,
    _curve_last,
    _curves,
    _extractor,
    _first,
    _missing,
    _rows,
    data_name,
    seeds_of,
)

__all__ = [
    "mnist_accuracy",
    "iterations",
    "lipschitz",
    "unconstrained",
]


_ARCH = {"pcdeq_l": "L", "pcdeq_sc": "SC", "pcdeq_mc": "MC"}


def _pcdeq_cells(df: Any) -> list[tuple[str, str, str, bool]]:
    """(cell, architecture L/SC/MC, activation, constrained) of every pcDEQ cell."""
    fs = df[df["analysis"] == "family_stats"]
    out = []
    for c in sorted(fs["cell_id"].unique()):
        model = _first(df, c, "model")
        arch = next((a for m, a in _ARCH.items() if model.startswith(m)), "")
        act = _activation(c)
        if not arch or not act:
            continue
        flag = fs[(fs["cell_id"] == c) & (fs["metric"] == "nonneg_constraint")]["value"]
        nonneg = bool(float(flag.max()) >= 0.5) if len(flag) else "nonneg=false" not in c
        out.append((c, arch, act, nonneg))
    return out


@_extractor("002-mnist-accuracy")
def mnist_accuracy(df: Any, run_dir: Path, scale: str) -> Extracted:
    """Final ``family_stats`` ``test_accuracy`` (else ``metrics`` test accuracy) per seed of each
    constrained pcDEQ cell, keyed by its Table 1 name (``pcDEQ-1-L-Tanh``, sigmoid: pcDEQ-2);
    ``paper_data`` when the run's dataset is ``mnist``."""
    seeds = seeds_of(df)
    acc: dict[str, list[float]] = {}
    for c, arch, act, nonneg in _pcdeq_cells(df):
        if not nonneg:
            continue
        d = _rows(df[df["cell_id"] == c], "family_stats", "test_accuracy")
        if d.empty:
            d = _rows(df[df["cell_id"] == c], "metrics", "accuracy", "test")
        d = d[d["step"].notna()]
        last = [_curve_last(d, s) for s in seeds]
        n = 2 if act == "sigmoid" else 1
        pretty = "ReLU6" if act == "relu6" else act.capitalize()
        acc[f"pcDEQ-{n}-{arch}-{pretty}"] = last
    return Extracted({"accuracy": acc, "scale": scale, "paper_data": data_name(run_dir) == "mnist"})


def _pcdeq_iterations(df: Any, nonneg: bool) -> dict[str, list[list[float]]]:
    """``"ARCH:activation"`` -> per seed, per-epoch mean forward iterations (epochs >= 1)."""
    seeds = seeds_of(df)
    out = {}
    for c, arch, act, _ in (x for x in _pcdeq_cells(df) if x[3] == nonneg):
        d = _rows(df[df["cell_id"] == c], "family_stats", "forward_nstep", "")
        out[f"{arch}:{act}"] = _curves(d, seeds, min_step=1)
    return out


@_extractor("002-iterations")
def iterations(df: Any, run_dir: Path, scale: str) -> Extracted:
    """Per ``"ARCH:activation"`` (``"SC:tanh"``), per seed, the per-epoch mean forward
    iterations (``family_stats`` ``forward_nstep``, variant "" = mean over layers, epochs >= 1)
    of the constrained pcDEQ cells."""
    it = _pcdeq_iterations(df, nonneg=True)
    if not it:
        return _missing("no family_stats forward_nstep of a constrained pcDEQ cell")
    return Extracted(
        {"forward_iterations": it, "scale": scale, "paper_data": data_name(run_dir) == "mnist"}
    )


@_extractor("002-lipschitz")
def lipschitz(df: Any, run_dir: Path, scale: str) -> Extracted:
    """Per activation, per seed, the per-epoch sigma_max(W) (epochs >= 1) of the constrained
    linear (L) pcDEQ cells: ``family_stats`` ``sigma_max`` (layer0), else the ``spectral``
    analysis's family quantity ``sigma_max/layer0``."""
    seeds = seeds_of(df)
    out: dict[str, list[list[float]]] = {}
    for c, arch, act, nonneg in _pcdeq_cells(df):
        if arch != "L" or not nonneg:
            continue
        d = _rows(df[df["cell_id"] == c], "family_stats", "sigma_max")
        d = d[d["variant"].isin(["layer0", ""])]
        out[act] = _curves(d, seeds, min_step=1)
    if not out:  # kglm_pcdeq_sigma: spectral analysis, no family_stats
        sp = df[(df["analysis"] == "spectral") & df["status"].isin(MEASURED)]
        for c in sorted(sp["cell_id"].unique()):
            a = _activation(c)
            if not a or not _first(df, c, "model").startswith("pcdeq_l"):
                continue
            d = sp[(sp["cell_id"] == c) & sp["metric"].isin(["sigma_max/layer0"])]
            if d.empty:
                d = sp[(sp["cell_id"] == c) & (sp["metric"] == "sigma_max")]
                d = d[d["variant"].isin(["sigma_max/layer0", "layer0"])]
            out[a] = _curves(d, seeds, min_step=1)
    if not out or not any(any(c) for cs in out.values() for c in cs):
        return _missing("no sigma_max per epoch of a constrained linear pcDEQ layer")
    return Extracted({"sigma_max": out})


@_extractor("002-unconstrained")
def unconstrained(df: Any, run_dir: Path, scale: str) -> Extracted:
    """Per architecture (L, SC, MC) with both cells, per seed, the per-epoch forward iterations
    of the tanh pcDEQ and of its unconstrained tanh control (``nonneg: false``)."""
    pc, ctl = _pcdeq_iterations(df, nonneg=True), _pcdeq_iterations(df, nonneg=False)
    archs = [k.split(":")[0] for k in ctl if k.endswith(":tanh") and k in pc]
    if not archs:
        return _missing(
            "needs a constrained tanh pcDEQ and its unconstrained control (nonneg false)"
        )
    return Extracted(
        {
            "pcdeq_iterations": {a: pc[f"{a}:tanh"] for a in archs},
            "control_iterations": {a: ctl[f"{a}:tanh"] for a in archs},
        }
    )
