"""Extractors of paper 002: Gabor et al., *Positive Concave Deep Equilibrium Models*, ICML 2024
(pcDEQ). One extractor per claim ``002-*``: a run directory's rows -> the keyword arguments of its
checker in :mod:`deqbench.reproduce.checks.p002_pcdeq`; the shared readers and the registry are in
:mod:`deqbench.reproduce.extract`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
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
    suite_raw,
)

__all__ = [
    "PAPER_EPOCH_STEPS",
    "paper_epochs",
    "mnist_accuracy",
    "svhn_accuracy",
    "cifar10_accuracy",
    "iterations",
    "backward_iterations",
    "lipschitz",
    "unconstrained",
    "any_norm_convergence",
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


def _table_accuracy(df: Any) -> dict[str, list[float]]:
    """Final ``family_stats`` ``test_accuracy`` (else ``metrics`` test accuracy) per seed of each
    constrained pcDEQ cell, keyed by its table name (``pcDEQ-1-L-Tanh``, sigmoid: pcDEQ-2)."""
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
    return acc


@_extractor("002-mnist-accuracy")
def mnist_accuracy(df: Any, run_dir: Path, scale: str) -> Extracted:
    """Final test accuracy per seed of each constrained pcDEQ cell, keyed by its Table 1 name;
    ``paper_data`` when the run's dataset is ``mnist``."""
    acc = _table_accuracy(df)
    return Extracted({"accuracy": acc, "scale": scale, "paper_data": data_name(run_dir) == "mnist"})


def _on(dataset: str, table: str) -> Any:
    def fn(df: Any, run_dir: Path, scale: str) -> Extracted:
        if data_name(run_dir) != dataset:
            return _missing(f"the run is not on {dataset} ({table} is)")
        acc = {k: v for k, v in _table_accuracy(df).items() if ":" not in k}
        return Extracted({"accuracy": acc, "scale": scale, "paper_data": True})

    return fn


@_extractor("002-svhn-accuracy")
def svhn_accuracy(df: Any, run_dir: Path, scale: str) -> Extracted:
    """Final test accuracy per seed of each constrained SC / MC pcDEQ cell of a run on ``svhn``,
    keyed by its Table 2 name (a run on other data: missing)."""
    return _on("svhn", "Table 2")(df, run_dir, scale)  # type: ignore[no-any-return]


@_extractor("002-cifar10-accuracy")
def cifar10_accuracy(df: Any, run_dir: Path, scale: str) -> Extracted:
    """As :func:`svhn_accuracy` for a run on ``cifar10`` (Table 3; the augmented MC* models are
    not told apart from MC here)."""
    return _on("cifar10", "Table 3")(df, run_dir, scale)  # type: ignore[no-any-return]


#: paper 002 App. C: batch 64 over MNIST's 60,000 training images, 938 optimizer steps an epoch;
#: Figs. 3 and 8 draw one point per such epoch (40 in all)
PAPER_EPOCH_STEPS = 938


def paper_epochs(values: Sequence[float], steps: Sequence[float]) -> list[float]:
    """A per-epoch curve of a run read on the paper's epochs: the run's epochs (``steps[i]``
    optimizer steps each) grouped into consecutive windows of :data:`PAPER_EPOCH_STEPS` steps,
    each the step-weighted mean of the epochs ending in it; a last window with fewer than half
    the paper's steps is dropped. On MNIST at batch 64 an epoch is one window (the curve is
    unchanged); on a smaller stand-in (mnist5k: 63 steps an epoch) about 15 epochs make one,
    so that "the first epoch" is the paper's first 938 steps, not our first 63.

    Example:
        >>> paper_epochs([4.0] * 15 + [6.0] * 15, [63] * 30)  # 945 steps a window
        [4.0, 6.0]
        >>> paper_epochs([5.0, 7.0], [938, 938])
        [5.0, 7.0]
    """
    sums: dict[int, float] = {}
    count: dict[int, float] = {}
    done = 0.0
    for v, n in zip(values, steps):
        if not n > 0:
            continue
        w = int(done // PAPER_EPOCH_STEPS)
        sums[w] = sums.get(w, 0.0) + float(v) * n
        count[w] = count.get(w, 0.0) + n
        done += n
    return [sums[w] / count[w] for w in sorted(sums) if count[w] >= PAPER_EPOCH_STEPS / 2]


def _pcdeq_iterations(
    df: Any, nonneg: bool, metric: str = "forward_nstep"
) -> dict[str, list[list[float]]]:
    """``"ARCH:activation"`` -> per seed, mean iterations (``metric``, the mean over layers)
    per paper epoch (:func:`paper_epochs`; per run epoch where the run logged no step counts)."""
    seeds = seeds_of(df)
    out = {}
    for c, arch, act, _ in (x for x in _pcdeq_cells(df) if x[3] == nonneg):
        cell = df[df["cell_id"] == c]
        vals = _curves(_rows(cell, "family_stats", metric, ""), seeds, min_step=1)
        steps = _curves(_rows(cell, "family_stats", "steps", ""), seeds, min_step=1)
        out[f"{arch}:{act}"] = [
            paper_epochs(v, n) if len(n) == len(v) and n else v for v, n in zip(vals, steps)
        ]
    return out


def _too_short(curves: dict[str, list[list[float]]]) -> Extracted | None:
    """Missing (with why) when no curve spans two of the paper's epochs: the rise over the
    paper's first epoch cannot be read from a shorter run."""
    if any(len(c) >= 2 for cs in curves.values() for c in cs):
        return None
    return _missing(
        f"the run spans fewer than two of the paper's epochs ({PAPER_EPOCH_STEPS} steps): "
        "no rise over the paper's first epoch to read"
    )


@_extractor("002-iterations")
def iterations(df: Any, run_dir: Path, scale: str) -> Extracted:
    """Per ``"ARCH:activation"`` (``"SC:tanh"``), per seed, the mean forward iterations per
    paper epoch (``family_stats`` ``forward_nstep``, variant "" = mean over layers, epochs >= 1,
    :func:`paper_epochs`) of the constrained pcDEQ cells."""
    it = _pcdeq_iterations(df, nonneg=True)
    if not it:
        return _missing("no family_stats forward_nstep of a constrained pcDEQ cell")
    if short := _too_short(it):
        return short
    return Extracted(
        {"forward_iterations": it, "scale": scale, "paper_data": data_name(run_dir) == "mnist"}
    )


@_extractor("002-backward-iterations")
def backward_iterations(df: Any, run_dir: Path, scale: str) -> Extracted:
    """Per ``"ARCH:activation"``, per seed, the per-epoch mean backward iterations
    (``family_stats`` ``backward_nstep``, variant "" = mean over layers, epochs >= 1) of the
    constrained pcDEQ cells."""
    it = _pcdeq_iterations(df, nonneg=True, metric="backward_nstep")
    if not it or not any(any(c) for cs in it.values() for c in cs):
        return _missing("no family_stats backward_nstep of a constrained pcDEQ cell")
    if short := _too_short(it):
        return short
    return Extracted({"backward_iterations": it})


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
    if short := _too_short(pc):
        return short
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


def _epoch_solves(df: Any, cell: str, seed: int) -> list[tuple[float, float, float]]:
    """Per training epoch (>= 1) of one cell and seed: (sigma_max over the epoch, converged
    share, mean forward iterations), from ``family_stats``. sigma_max over the epoch is the
    smaller of its values at the epoch's start (end of the previous epoch, 0 = init) and end,
    taking the largest over the layers (variant ``max``, else ``layer0``); the converged share
    is ``1 - forward_not_converged / (steps x layers)``."""
    d = _rows(df[(df["cell_id"] == cell) & (df["seed"] == seed)], "family_stats")
    d = d[d["step"].notna()]

    def per_epoch(metric: str, variants: tuple[str, ...]) -> dict[int, float]:
        for v in variants:
            g = d[(d["metric"] == metric) & (d["variant"] == v)]
            if len(g):
                return {int(k): float(x) for k, x in zip(g["step"], g["value"])}
        return {}

    sig = per_epoch("sigma_max", ("max", "layer0", ""))
    fail = per_epoch("forward_not_converged", ("",))
    steps = per_epoch("steps", ("",))
    its = per_epoch("forward_nstep", ("",))
    lay = d[d["metric"] == "layers"]["value"]
    layers = float(lay.max()) if len(lay) else 1.0
    out = []
    for e in sorted(k for k in its if k >= 1):
        s = min(sig.get(e - 1, math.nan), sig.get(e, math.nan))
        n = steps.get(e, math.nan) * max(layers, 1.0)
        conv = 1.0 - fail.get(e, math.nan) / n if n > 0 else math.nan
        out.append((s, conv, its[e]))
    return out


@_extractor("002-any-norm-convergence")
def any_norm_convergence(df: Any, run_dir: Path, scale: str) -> Extracted:
    """Per ``"ARCH:activation"`` of the constrained pcDEQ cells (``pcdeq``) and of the
    unconstrained controls (``control``), per seed, per training epoch an
    :class:`~deqbench.reproduce.checks.p002_pcdeq.EpochSolves` (:func:`_epoch_solves`); ``tol``
    the suite's forward solver tolerance (for the implied rate)."""
    from ..checks.p002_pcdeq import EpochSolves

    seeds = seeds_of(df)
    pc: dict[str, list[list[EpochSolves]]] = {}
    ctl: dict[str, list[list[EpochSolves]]] = {}
    for c, arch, act, nonneg in _pcdeq_cells(df):
        curves = [[EpochSolves(*e) for e in _epoch_solves(df, c, s)] for s in seeds]
        (pc if nonneg else ctl)[f"{arch}:{act}"] = curves
    if not any(any(c) for cs in pc.values() for c in cs):
        return _missing("no family_stats per-epoch solves of a constrained pcDEQ cell")
    kw: dict[str, Any] = {"pcdeq": pc, "control": ctl}
    defaults = suite_raw(run_dir).get("defaults")
    solver = defaults.get("solver") if isinstance(defaults, dict) else None
    if isinstance(solver, dict) and "tol" in solver:
        kw["tol"] = float(solver["tol"])
    return Extracted(kw)
