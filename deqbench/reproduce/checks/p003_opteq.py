"""Checkers of paper 003: Xie et al., *Optimization Induced Equilibrium Networks*, IEEE TPAMI
(OptEq). One checker per claim ``003-*`` of :data:`deqbench.reproduce.claims.CLAIMS`, each
threshold cited to the paper at its constant; the shared rules, helpers and the registry are in
:mod:`deqbench.reproduce.checks`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from . import (
    NOT_RUN,
    Verdict,
    _checker,
    _few,
    _g,
    _log_ratio,
    _med,
    _paired,
    _seeds,
    _verdict,
    _word,
    seed_trend,
)

__all__ = [
    "RESIDUAL_FLOOR",
    "check_residual_vs_k",
    "check_accuracy_vs_k",
    "TABLE8_PAIRS",
    "check_unrolled_speed",
    "check_ift_memory",
]


#: residuals at or below this are at float32 resolution and count as equal (a numerical floor,
#: below every residual of paper 003 Table 8, the smallest being 1.20e-5)
RESIDUAL_FLOOR = 1e-6


@_checker("003-residual-vs-k")
def check_residual_vs_k(*, residual: Mapping[int, Sequence[float]]) -> Verdict:
    """003-residual-vs-k: the relative residual ||z - T(z)|| / ||z|| falls with K (Table 8).

    Args:
        residual: K -> per-seed relative residual on the test set after unrolled training.

    For each consecutive pair K < K', the per-seed ``log10(r_K / r_K')`` must be a trend, except
    where both medians are at or below :data:`RESIDUAL_FLOOR`.
    """
    cid = "003-residual-vs-k"
    ks = sorted(residual)
    if len(ks) < 2:
        return _verdict(cid, NOT_RUN, "data: fewer than two K measured", "")
    bad = _seeds(cid, _paired(cid, {str(k): residual[k] for k in ks}))
    if bad:
        return bad
    med = {k: _med(float(x) for x in residual[k]) for k in ks}
    measured = ", ".join(f"K={k}: {med[k]:.2e}" for k in ks)
    falls, trends = [], []
    for a, b in zip(ks, ks[1:]):
        if med[a] <= RESIDUAL_FLOOR and med[b] <= RESIDUAL_FLOOR:
            continue
        t = seed_trend([_log_ratio(x, y) / math.log(10) for x, y in zip(residual[a], residual[b])])
        trends.append(t)
        if not t.holds:
            falls.append(f"K={a}->{b}")
    bad = _few(cid, trends, measured)
    if bad:
        return bad
    reason = f"residual does not fall in every seed at {', '.join(falls)}" if falls else ""
    return _verdict(cid, _word(not falls), reason, measured + " (median over seeds)")


@_checker("003-accuracy-vs-k")
def check_accuracy_vs_k(*, accuracy: Mapping[int, Sequence[float]]) -> Verdict:
    """003-accuracy-vs-k: test accuracy rises with K (Table 8: 83.52% at K=5 -> 87.83% at K=40).

    Args:
        accuracy: K -> per-seed final test accuracy (fraction) of unrolled training.

    Per seed effect = accuracy(largest K) - accuracy(smallest K); it must be a trend.
    """
    cid = "003-accuracy-vs-k"
    ks = sorted(accuracy)
    if len(ks) < 2:
        return _verdict(cid, NOT_RUN, "data: fewer than two K measured", "")
    bad = _seeds(cid, _paired(cid, {str(k): accuracy[k] for k in ks}))
    if bad:
        return bad
    lo, hi = ks[0], ks[-1]
    t = seed_trend([float(b) - float(a) for a, b in zip(accuracy[lo], accuracy[hi])])
    measured = (
        ", ".join(f"K={k}: {100 * _med(accuracy[k]):.2f}%" for k in ks)
        + f"; K={hi} - K={lo}: {t.text()}"
    )
    bad = _few(cid, [t], measured)
    if bad:
        return bad
    reason = "" if t.holds else f"accuracy at K={hi} not above K={lo} in every seed"
    return _verdict(cid, _word(t.holds), reason, measured)


#: Table 8's pairs at a comparable relative residual: IFT threshold -> unrolled K
#: (thd 1e-3: 7.33e-4 vs K=20: 4.81e-4; thd 1e-2: 9.52e-3 vs K=10: 4.88e-3)
TABLE8_PAIRS: dict[float, int] = {1e-3: 20, 1e-2: 10}


@_checker("003-unrolled-speed")
def check_unrolled_speed(
    *, unrolled: Mapping[int, Sequence[float]], ift: Mapping[float, Sequence[float]]
) -> Verdict:
    """003-unrolled-speed: unrolled inference faster than IFT at a comparable residual.

    Args:
        unrolled: K -> per-seed inference time (seconds, same batches for every method).
        ift: IFT threshold -> per-seed inference time.

    Compared at Table 8's pairs (:data:`TABLE8_PAIRS`) that were measured: per seed
    ``log(t_ift / t_unrolled)`` must be a trend at each.
    """
    cid = "003-unrolled-speed"
    pairs = [(thd, k) for thd, k in TABLE8_PAIRS.items() if k in unrolled and _has(ift, thd)]
    if not pairs:
        return _verdict(
            cid, NOT_RUN, "data: needs K=20 with IFT thd 1e-3 or K=10 with thd 1e-2 (Table 8)", ""
        )
    n = min(min(len(unrolled[k]), len(_get(ift, thd))) for thd, k in pairs)
    bad = _seeds(cid, n)
    if bad:
        return bad
    parts, slow, trends = [], [], []
    for thd, k in pairs:
        ti = _get(ift, thd)
        t = seed_trend([_log_ratio(i, u) for u, i in zip(unrolled[k], ti)])
        trends.append(t)
        if not t.holds:
            slow.append(f"K={k} vs thd {thd:g}")
        parts.append(f"K={k} {_g(_med(unrolled[k]))} s vs IFT thd {thd:g} {_g(_med(ti))} s")
    bad = _few(cid, trends, "; ".join(parts))
    if bad:
        return bad
    reason = f"unrolled not faster: {', '.join(slow)}" if slow else ""
    return _verdict(cid, _word(not slow), reason, "; ".join(parts))


def _has(d: Mapping[float, Sequence[float]], key: float) -> bool:
    return any(math.isclose(k, key, rel_tol=1e-9) for k in d)


def _get(d: Mapping[float, Sequence[float]], key: float) -> Sequence[float]:
    return next(v for k, v in d.items() if math.isclose(k, key, rel_tol=1e-9))


@_checker("003-ift-memory")
def check_ift_memory(
    *, unrolled: Mapping[int, Sequence[float]], ift: Mapping[float, Sequence[float]]
) -> Verdict:
    """003-ift-memory: IFT training uses less memory than unrolled training.

    Args:
        unrolled: K -> per-seed peak memory (bytes) of one training step.
        ift: IFT threshold -> per-seed peak memory of one training step.

    Per seed effect = log(smallest unrolled memory / largest IFT memory): IFT must be below every
    K measured (the paper compares IFT with K = 5 ... 40); it must be a trend.
    """
    cid = "003-ift-memory"
    if not unrolled or not ift:
        return _verdict(cid, NOT_RUN, "data: unrolled and IFT memory both needed", "")
    groups = {f"K={k}": v for k, v in unrolled.items()} | {f"thd={t:g}": v for t, v in ift.items()}
    bad = _seeds(cid, _paired(cid, groups))
    if bad:
        return bad
    n = len(next(iter(groups.values())))
    eff = [
        _log_ratio(
            min(float(v[i]) for v in unrolled.values()), max(float(v[i]) for v in ift.values())
        )
        for i in range(n)
    ]
    t = seed_trend(eff)
    mib = 2.0**20
    measured = (
        ", ".join(f"K={k}: {_med(v) / mib:.2f} MiB" for k, v in sorted(unrolled.items()))
        + "; "
        + ", ".join(f"IFT thd {k:g}: {_med(v) / mib:.2f} MiB" for k, v in sorted(ift.items()))
    )
    bad = _few(cid, [t], measured)
    if bad:
        return bad
    reason = "" if t.holds else "IFT memory not below every unrolled K in every seed"
    return _verdict(cid, _word(t.holds), reason, measured)
