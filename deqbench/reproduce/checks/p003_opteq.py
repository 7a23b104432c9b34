"""Checkers of paper 003: Xie et al., *Optimization Induced Equilibrium Networks*, IEEE TPAMI
(OptEq). One checker per claim ``003-*`` of :data:`deqbench.reproduce.claims.CLAIMS`, each
threshold cited to the paper at its constant; the shared rules, helpers and the registry are in
:mod:`deqbench.reproduce.checks`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from . import (
    MIN_SEEDS,
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
    gated,
    pair_trend,
    seed_trend,
)

__all__ = [
    "RESIDUAL_FLOOR",
    "check_residual_vs_k",
    "check_accuracy_vs_k",
    "TABLE8_PAIRS",
    "TABLE8_SPEEDUP",
    "SPEEDUP_FACTOR",
    "check_unrolled_speed",
    "MUCH_LESS",
    "MEMORY_K",
    "check_ift_memory",
    "TABLE8_IFT_THRESHOLDS",
    "check_ift_threshold",
    "check_unrolled_vs_ift_accuracy",
    "ALPHA_LOW",
    "ALPHA_HIGH",
    "ALPHA_MISSING",
    "check_alpha",
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
#: Table 8's inference-time ratio IFT / unrolled at each pair: 16.3 s / 3.9 s and 15.6 s / 2.2 s
TABLE8_SPEEDUP: dict[float, float] = {1e-3: 16.3 / 3.9, 1e-2: 15.6 / 2.2}
#: how far our ratio may fall short of Table 8's and still match it: within a factor 2 (a GTX
#: 1070 against today's cards, other kernels; our stated tolerance, the paper gives none)
SPEEDUP_FACTOR = 2.0


@_checker("003-unrolled-speed")
def check_unrolled_speed(
    *,
    unrolled: Mapping[int, Sequence[float]],
    ift: Mapping[float, Sequence[float]],
    device: str = "cuda",
) -> Verdict:
    """003-unrolled-speed: unrolled inference faster than IFT at a comparable residual, by the
    paper's ratio within :data:`SPEEDUP_FACTOR`.

    Args:
        unrolled: K -> per-seed inference time (seconds, same batches for every method).
        ift: IFT threshold -> per-seed inference time.
        device: where the timings were taken (``"cuda"``, ``"cpu"``): Table 8 times a GPU, so
            CPU timings are ``not run`` (reason ``scale``), their direction shown.

    Compared at Table 8's pairs (:data:`TABLE8_PAIRS`) that were measured: per seed
    ``log(t_ift / t_unrolled) - log(TABLE8_SPEEDUP / SPEEDUP_FACTOR)`` must be positive in
    every seed at each pair.
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
        need = TABLE8_SPEEDUP[thd] / SPEEDUP_FACTOR
        t = seed_trend([_log_ratio(i, u) - math.log(need) for u, i in zip(unrolled[k], ti)])
        trends.append(t)
        if not t.holds:
            slow.append(f"K={k} vs thd {thd:g}")
        ratios = ", ".join(_g(i / u) if u > 0 else "nan" for u, i in zip(unrolled[k], ti))
        parts.append(
            f"K={k} {_g(_med(unrolled[k]))} s vs IFT thd {thd:g} {_g(_med(ti))} s: IFT/unrolled "
            f"{ratios}x (paper {TABLE8_SPEEDUP[thd]:.1f}x, needed >= {need:.2f}x)"
        )
    bad = _few(cid, trends, "; ".join(parts))
    if bad:
        return bad
    reason = (
        f"unrolled not faster by the paper's ratio / {SPEEDUP_FACTOR:g} in every seed: "
        f"{', '.join(slow)}" if slow else ""
    )  # fmt: skip
    v = _verdict(cid, _word(not slow), reason, "; ".join(parts))
    if not str(device).startswith("cuda"):
        return gated(v, f"scale: timed on {device}; Table 8 times a GPU (GTX 1070)")
    return v


def _has(d: Mapping[float, Sequence[float]], key: float) -> bool:
    return any(math.isclose(k, key, rel_tol=1e-9) for k in d)


def _get(d: Mapping[float, Sequence[float]], key: float) -> Sequence[float]:
    return next(v for k, v in d.items() if math.isclose(k, key, rel_tol=1e-9))


#: "much less memory" (Section 7.4; Section 5.3: unrolling "consumes much memory during
#: training", it stores every one of its K iterates): IFT's training-step activation memory at
#: most this fraction of unrolling's at K = 20, the K that Table 8 compares at a comparable
#: residual (our reading of "much": at least a factor 2; the paper gives no number)
MUCH_LESS = 0.5
#: the unrolled K the memory claim compares IFT with (Table 8's pair for thd 1e-3)
MEMORY_K = 20


@_checker("003-ift-memory")
def check_ift_memory(
    *, unrolled: Mapping[int, Sequence[float]], ift: Mapping[float, Sequence[float]]
) -> Verdict:
    """003-ift-memory: IFT training uses much less memory than unrolled training.

    Args:
        unrolled: K -> per-seed peak memory (bytes) of one training step.
        ift: IFT threshold -> per-seed peak memory of one training step.

    Per seed effect = log(K=20 memory / largest IFT memory) - log(1 / :data:`MUCH_LESS`): IFT
    must use at most half of unrolling's memory at K = 20 in every seed.
    """
    cid = "003-ift-memory"
    if MEMORY_K not in unrolled or not ift:
        return _verdict(cid, NOT_RUN, f"data: unrolled K={MEMORY_K} and IFT memory needed", "")
    groups = {f"K={k}": v for k, v in unrolled.items()} | {f"thd={t:g}": v for t, v in ift.items()}
    bad = _seeds(cid, _paired(cid, groups))
    if bad:
        return bad
    n = len(next(iter(groups.values())))
    k20 = unrolled[MEMORY_K]
    worst = [max(float(v[i]) for v in ift.values()) for i in range(n)]
    eff = [_log_ratio(float(k20[i]), worst[i]) + math.log(MUCH_LESS) for i in range(n)]
    t = seed_trend(eff)
    mib = 2.0**20
    ratio = ", ".join(_g(w / float(u)) if float(u) > 0 else "nan" for w, u in zip(worst, k20))
    measured = (
        ", ".join(f"K={k}: {_med(v) / mib:.2f} MiB" for k, v in sorted(unrolled.items()))
        + "; "
        + ", ".join(f"IFT thd {k:g}: {_med(v) / mib:.2f} MiB" for k, v in sorted(ift.items()))
        + f"; IFT / K={MEMORY_K}: {ratio} (needed <= {MUCH_LESS:g})"
    )
    bad = _few(cid, [t], measured)
    if bad:
        return bad
    reason = (
        "" if t.holds else f"IFT memory not <= {MUCH_LESS:g}x unrolled K={MEMORY_K} in every seed"
    )
    return _verdict(cid, _word(t.holds), reason, measured)


#: Table 8's IFT thresholds: (tight, loose); 87.63% at 1e-3 vs 85.95% at 1e-2
TABLE8_IFT_THRESHOLDS = (1e-3, 1e-2)


@_checker("003-ift-threshold")
def check_ift_threshold(*, ift: Mapping[float, Sequence[float]]) -> Verdict:
    """003-ift-threshold: a loose residual threshold hurts IFT (Table 8: 87.63% at thd 1e-3,
    85.95% at 1e-2).

    Args:
        ift: IFT threshold -> per-seed final test accuracy (fraction).

    Per seed effect = accuracy(thd 1e-3) - accuracy(thd 1e-2); it must be a trend.
    """
    cid = "003-ift-threshold"
    tight, loose = TABLE8_IFT_THRESHOLDS
    if not (_has(ift, tight) and _has(ift, loose)):
        return _verdict(cid, NOT_RUN, "data: needs IFT at thd 1e-3 and 1e-2 (Table 8)", "")
    a, b = _get(ift, tight), _get(ift, loose)
    return pair_trend(
        cid, a, b, lambda x, y: x - y,
        lambda t: f"IFT thd 1e-3: {100 * _med(a):.2f}%, thd 1e-2: {100 * _med(b):.2f}%; "
        f"difference {t.text()}",
        "IFT at thd 1e-3 not above thd 1e-2 in every seed",
    )  # fmt: skip


@_checker("003-unrolled-vs-ift-accuracy")
def check_unrolled_vs_ift_accuracy(
    *, unrolled: Mapping[int, Sequence[float]], ift: Mapping[float, Sequence[float]]
) -> Verdict:
    """003-unrolled-vs-ift-accuracy: at a comparable residual unrolling reaches at least IFT's
    accuracy (Table 8: K=20 87.71% vs thd 1e-3 87.63%; K=10 87.28% vs thd 1e-2 85.95%).

    Args:
        unrolled: K -> per-seed final test accuracy of unrolled training.
        ift: IFT threshold -> per-seed final test accuracy.

    At each pair of :data:`TABLE8_PAIRS` measured, per seed ``acc(K) - acc(thd)`` must be
    >= 0 (a tie counts: "at least") in every one of >= 3 seeds.
    """
    cid = "003-unrolled-vs-ift-accuracy"
    pairs = [(thd, k) for thd, k in TABLE8_PAIRS.items() if k in unrolled and _has(ift, thd)]
    if not pairs:
        return _verdict(
            cid, NOT_RUN, "data: needs K=20 with IFT thd 1e-3 or K=10 with thd 1e-2 (Table 8)", ""
        )
    parts, below = [], []
    for thd, k in pairs:
        u, i = unrolled[k], _get(ift, thd)
        bad = _seeds(cid, _paired(cid, {f"K={k}": u, f"thd={thd:g}": i}))
        if bad:
            return bad
        diff = [float(a) - float(b) for a, b in zip(u, i)]
        good = [d for d in diff if math.isfinite(d)]
        if len(good) < MIN_SEEDS:
            return _verdict(cid, NOT_RUN, f"seeds: only {len(good)} seeds with finite values "
                            f"< {MIN_SEEDS}", "")  # fmt: skip
        if not all(d >= 0 for d in good):
            below.append(f"K={k} vs thd {thd:g}")
        parts.append(
            f"K={k} {100 * _med(u):.2f}% vs IFT thd {thd:g} {100 * _med(i):.2f}% "
            f"(per seed {', '.join(f'{100 * d:+.2f}' for d in diff)} points)"
        )
    reason = f"unrolled below IFT in some seed: {', '.join(below)}" if below else ""
    return _verdict(cid, _word(not below), reason, "; ".join(parts))


#: Table 5's alpha groups: the poor (0.01, 0.1: 56.8-75.0%) and the good (0.4, 0.8, 1.0: mostly
#: 85-88%; "setting alpha > 0.4 is a safe choice", Section 7.2)
ALPHA_LOW = 0.1
ALPHA_HIGH = 0.4
#: why Table 5 is not measured
ALPHA_MISSING = "no suite: needs an alpha sweep of the deep OptEq (Table 5)"


@_checker("003-alpha")
def check_alpha(
    *, accuracy: Mapping[float, Sequence[float]] | None = None, scale: str = "cpu"
) -> Verdict:
    """003-alpha: alpha >= 0.4 trains to a higher accuracy than alpha <= 0.1 (Table 5).

    Args:
        accuracy: alpha -> per-seed final test accuracy (fraction); None: not measured
            (``not run``, :data:`ALPHA_MISSING`).
        scale: ``"cpu"`` or ``"paper"`` (the step budget is the runner's gate).

    Per seed effect = mean accuracy over alpha >= :data:`ALPHA_HIGH` - mean over alpha <=
    :data:`ALPHA_LOW`; it must be a trend. Both groups must be measured.
    """
    cid = "003-alpha"
    if accuracy is None:
        return _verdict(cid, NOT_RUN, ALPHA_MISSING, "not measured")
    lo = [a for a in sorted(accuracy) if a <= ALPHA_LOW]
    hi = [a for a in sorted(accuracy) if a >= ALPHA_HIGH]
    if not lo or not hi:
        return _verdict(
            cid, NOT_RUN, "data: needs alpha <= 0.1 and alpha >= 0.4 (Table 5)",
            ", ".join(f"{a:g}" for a in sorted(accuracy)),
        )  # fmt: skip
    n = _paired(cid, {f"{a:g}": accuracy[a] for a in lo + hi})
    bad = _seeds(cid, n)
    if bad:
        return bad

    def mean(alphas: Sequence[float], i: int) -> float:
        return sum(float(accuracy[a][i]) for a in alphas) / len(alphas)

    t = seed_trend([mean(hi, i) - mean(lo, i) for i in range(n)])
    measured = (
        ", ".join(f"alpha {a:g}: {100 * _med(accuracy[a]):.2f}%" for a in lo + hi)
        + f"; mean(alpha >= {ALPHA_HIGH:g}) - mean(alpha <= {ALPHA_LOW:g}): {t.text()}"
    )
    bad = _few(cid, [t], measured)
    if bad:
        return bad
    reason = "" if t.holds else "alpha >= 0.4 not above alpha <= 0.1 in every seed"
    return _verdict(cid, _word(t.holds), reason, measured)
