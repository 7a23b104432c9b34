"""Checkers of the claim table (issue 26, part 3): measured values in, a verdict out.

Each checker encodes one claim of :data:`deqbench.reproduce.claims.CLAIMS` in the paper's
direction, with thresholds taken from the paper (cited at each constant), never from our own
measurements. It takes plain measured values (per-seed numbers, small dicts; each docstring
says exactly what) and returns a :class:`Verdict`: exactly one of ``reproduced``, ``not
reproduced``, ``not run``, a separate ``reason`` and the ``measured`` value as text beside the
paper's. Extracting the values from run directories is the runner's job, not this module's.

Shared rules (issue 26):

* A trend counts as reproduced only when it holds in the median of >= 3 seeds and exceeds the
  seed spread: :func:`seed_trend` (one rule for every checker).
* Fewer than 3 seeds: ``not run``, reason ``seeds: ...``.
* An absolute claim at scale ``cpu``: ``not run``, reason ``scale``; at paper scale on a stand-in
  dataset: ``not run``, reason ``data: ...``.
* Solves behind a claim must have converged (share of converged solves >= :data:`MIN_CONVERGED`),
  else ``not run``, reason ``convergence: ...``.

Lists of per-seed values are paired by position: element ``i`` of every list is seed ``i``.

Example:
    >>> from deqbench.reproduce.checks import check_accuracy_vs_k
    >>> v = check_accuracy_vs_k(accuracy={5: [0.83, 0.84, 0.83], 40: [0.88, 0.87, 0.88]})
    >>> v.verdict
    'reproduced'
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from .claims import claim

VerdictWord = Literal["reproduced", "not reproduced", "not run"]
REPRODUCED: VerdictWord = "reproduced"
NOT_REPRODUCED: VerdictWord = "not reproduced"
NOT_RUN: VerdictWord = "not run"
VERDICTS: tuple[VerdictWord, ...] = (REPRODUCED, NOT_REPRODUCED, NOT_RUN)

#: a trend needs at least this many seeds (issue 26)
MIN_SEEDS = 3
#: the share of solves behind a claim that must reach their tolerance (issue 26: "the
#: landscape's DEQ at >= 95% of grid points"; the same bar for every claim resting on solves)
MIN_CONVERGED = 0.95

Scale = Literal["cpu", "paper"]


@dataclass(frozen=True)
class Verdict:
    """The outcome of one checker.

    Attributes:
        claim_id: the claim checked.
        verdict: exactly one of ``"reproduced"``, ``"not reproduced"``, ``"not run"``.
        reason: why (always set for ``not run``; ``scale`` for an absolute claim at CPU scale).
        measured: the measured value(s) as text, to stand beside ``paper_value``.
        paper_value: the paper's value(s), from the claim table.
    """

    claim_id: str
    verdict: VerdictWord
    reason: str
    measured: str
    paper_value: str

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {self.verdict!r}")
        if self.verdict == NOT_RUN and not self.reason:
            raise ValueError("a 'not run' verdict needs a reason")


def _verdict(claim_id: str, word: VerdictWord, reason: str, measured: str) -> Verdict:
    return Verdict(claim_id, word, reason, measured, claim(claim_id).paper_value)


# -- the shared trend rule -----------------------------------------------------------------------


@dataclass(frozen=True)
class Trend:
    """Per-seed effects in the paper's direction (positive agrees with the paper).

    ``holds``: at least :data:`MIN_SEEDS` finite effects, and their median is > 0, > ``spread``
    (the sample standard deviation of the effects over seeds) and > ``min_effect``.
    """

    n: int
    median: float
    spread: float
    min_effect: float
    holds: bool
    dropped: int = 0

    @property
    def enough_seeds(self) -> bool:
        return self.n >= MIN_SEEDS

    def text(self, unit: str = "") -> str:
        s = f"median {_g(self.median)}{unit} (sd {_g(self.spread)}{unit}, {self.n} seeds"
        if self.dropped:
            s += f", {self.dropped} non-finite dropped"
        return s + ")"


def seed_trend(effects: Sequence[float], min_effect: float = 0.0) -> Trend:
    """The shared trend rule of issue 26.

    Args:
        effects: one effect per seed, signed so that a positive value goes the paper's way
            (e.g. ``log(random_mse / informed_mse)``). Non-finite values (failed seeds) are
            dropped and counted.
        min_effect: the smallest effect that counts, in the effect's unit (0: any; e.g. one
            iteration for iteration counts).

    Returns:
        A :class:`Trend`; ``holds`` is True only when >= 3 seeds remain and the median effect is
        positive, above the seed spread (sample standard deviation) and above ``min_effect``.
    """
    vals = [float(e) for e in effects]
    good = [e for e in vals if math.isfinite(e)]
    n = len(good)
    if n == 0:
        return Trend(0, math.nan, math.nan, min_effect, False, len(vals))
    med = statistics.median(good)
    sd = statistics.stdev(good) if n >= 2 else math.nan
    holds = n >= MIN_SEEDS and med > 0 and med > sd and med > min_effect
    return Trend(n, med, sd, min_effect, holds, len(vals) - n)


def _med(xs: Iterable[float]) -> float:
    """Median of the finite values, NaN when there is none (for the ``measured`` text)."""
    vals = [float(x) for x in xs if math.isfinite(float(x))]
    return statistics.median(vals) if vals else math.nan


def _g(x: float) -> str:
    return f"{x:.3g}" if math.isfinite(x) else str(x)


def _seeds(claim_id: str, n: int, what: str = "seeds") -> Verdict | None:
    """``not run`` when fewer than :data:`MIN_SEEDS` seeds were measured."""
    if n < MIN_SEEDS:
        return _verdict(
            claim_id,
            NOT_RUN,
            f"seeds: {n} {what} < {MIN_SEEDS} (a trend needs the median of >= {MIN_SEEDS})",
            f"{n} {what}",
        )
    return None


def _converged(claim_id: str, what: str, shares: float | Sequence[float] | None) -> Verdict | None:
    """``not run`` when the solves behind a claim did not converge (any seed below the bar)."""
    if shares is None:
        return None
    vals = [float(shares)] if isinstance(shares, (int, float)) else [float(s) for s in shares]
    if not vals:
        return None
    worst = min(vals) if all(math.isfinite(v) for v in vals) else math.nan
    if not (worst >= MIN_CONVERGED):
        return _verdict(
            claim_id,
            NOT_RUN,
            f"convergence: {what} converged in {_pct(worst)} (worst seed) < "
            f"{_pct(MIN_CONVERGED)} of solves",
            "converged " + ", ".join(_pct(v) for v in vals),
        )
    return None


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%" if math.isfinite(x) else "nan"


def _absolute(claim_id: str, scale: str, paper_data: bool) -> Verdict | None:
    """``not run`` for an absolute claim at CPU scale (reason ``scale``) or on stand-in data."""
    if scale not in ("cpu", "paper"):
        raise ValueError(f"scale must be 'cpu' or 'paper', got {scale!r}")
    if scale != "paper":
        return _verdict(claim_id, NOT_RUN, "scale", "not compared at scale cpu")
    if not paper_data:
        return _verdict(
            claim_id,
            NOT_RUN,
            "data: a stand-in dataset, not the paper's; the number is not compared",
            "not compared on stand-in data",
        )
    return None


def _paired(claim_id: str, groups: Mapping[str, Sequence[object]]) -> int:
    """The common seed count of per-seed lists paired by position (ValueError if they differ)."""
    lens = {k: len(v) for k, v in groups.items()}
    if len(set(lens.values())) > 1:
        raise ValueError(f"{claim_id}: per-seed lists differ in length: {lens}")
    return next(iter(lens.values()), 0)


def _log_ratio(a: float, b: float) -> float:
    """log(a / b), NaN unless both are positive and finite."""
    if a > 0 and b > 0 and math.isfinite(a) and math.isfinite(b):
        return math.log(a / b)
    return math.nan


def _growth(curve: Sequence[float]) -> float:
    """Growth of a per-epoch curve: mean of its last quarter minus mean of its first quarter
    (at least one epoch each), NaN for fewer than two epochs."""
    c = [float(x) for x in curve]
    if len(c) < 2:
        return math.nan
    q = max(1, len(c) // 4)
    return statistics.fmean(c[-q:]) - statistics.fmean(c[:q])


CheckFn = Callable[..., Verdict]
#: checker name -> function (the names the claim table's ``check`` column uses)
CHECKERS: dict[str, CheckFn] = {}
#: checker name -> the claim id it checks
CLAIM_OF: dict[str, str] = {}


def _checker(claim_id: str) -> Callable[[CheckFn], CheckFn]:
    def deco(fn: CheckFn) -> CheckFn:
        CHECKERS[fn.__name__] = fn
        CLAIM_OF[fn.__name__] = claim_id
        return fn

    return deco


def _word(ok: bool) -> VerdictWord:
    return REPRODUCED if ok else NOT_REPRODUCED


def _few(claim_id: str, trends: Sequence[Trend], measured: str) -> Verdict | None:
    """``not run`` when a trend kept fewer than :data:`MIN_SEEDS` finite per-seed effects."""
    short = [t for t in trends if not t.enough_seeds]
    if short:
        n = min(t.n for t in short)
        return _verdict(
            claim_id,
            NOT_RUN,
            f"seeds: only {n} seeds with finite values < {MIN_SEEDS}",
            measured,
        )
    return None


# -- 001: kGLM-initialised DEQs ------------------------------------------------------------------

#: a tie: |p_KLR - 1/2| within this. Paper 001 Table 2: the 11 disagreements have KLR posteriors
#: 0.4999999622825579 ... 0.4999999968452693, i.e. at most 3.8e-8 from 0.5; 1e-7 covers that and
#: float32's resolution at 0.5 (2^-24 = 6e-8).
KLR_TIE_TOL = 1e-7


@_checker("001-klr-equivalence")
def check_klr_equivalence(
    *,
    pixels: int,
    tie_distances: Sequence[float],
    converged: bool,
    random_disagreeing: int | None = None,
) -> Verdict:
    """001-klr-equivalence: KLR and the kGLM DEQ agree on every pixel except at ties.

    Args:
        pixels: number of pixels compared (images x pixels per image).
        tie_distances: ``|p_KLR - 1/2|`` at every pixel whose binarised KLR and DEQ predictions
            disagree (empty: full agreement).
        converged: every DEQ solve reached its tolerance.
        random_disagreeing: disagreeing pixels of the random-init DEQ control (None: not run).

    Not run when the DEQ solves did not converge, or when the random control agrees too (then the
    comparison cannot fail). No seeds: the claim is an identity (Theorem 3), not a trend.
    """
    cid = "001-klr-equivalence"
    off = [d for d in tie_distances if not (abs(float(d)) <= KLR_TIE_TOL)]
    measured = (
        f"{len(tie_distances)} of {pixels} pixels disagree, {len(off)} of them away from a tie "
        f"(|p - 1/2| > {KLR_TIE_TOL:g})"
    )
    if random_disagreeing is not None:
        measured += f"; random-init DEQ: {random_disagreeing} pixels disagree"
    if not converged:
        return _verdict(cid, NOT_RUN, "convergence: the kGLM DEQ's solves missed tol", measured)
    if random_disagreeing is not None and random_disagreeing == 0:
        return _verdict(
            cid,
            NOT_RUN,
            "control: the random-init DEQ agrees as well, so the comparison cannot fail",
            measured,
        )
    return _verdict(
        cid, _word(not off), "" if not off else "disagreements away from ties", measured
    )


#: Fig. 5(b) of paper 001 compares the schemes after 20 epochs: "faster training" is judged at
#: the measured epochs up to this one, "a better starting point" at epoch 0
GP_EARLY_EPOCH = 20


@_checker("001-gp-informed-init")
def check_gp_informed_init(
    *,
    informed: Mapping[int, Sequence[float]],
    random: Mapping[int, Sequence[float]],
    informed_converged: Sequence[float],
) -> Verdict:
    """001-gp-informed-init: informed kGLM init below random test MSE at the start and early on.

    Args:
        informed: epoch -> per-seed test MSE of the informed kGLM model (epoch 0 = at init).
        random: epoch -> per-seed test MSE of the random-init model (same seeds, same order).
        informed_converged: per seed, the share of the informed model's forward solves that
            reached their tolerance (issue 26: the informed model must reach its fixed point).

    Per epoch in ``0 .. GP_EARLY_EPOCH`` measured for both, the per-seed effect
    ``log(random / informed)`` must be a trend (:func:`seed_trend`); epoch 0 is required.
    """
    cid = "001-gp-informed-init"
    epochs = sorted(e for e in informed if e in random and e <= GP_EARLY_EPOCH)
    if 0 not in epochs:
        return _verdict(cid, NOT_RUN, "data: no epoch-0 test MSE for both schemes", "")
    n = _paired(
        cid,
        {f"informed@{e}": informed[e] for e in epochs} | {f"random@{e}": random[e] for e in epochs},
    )
    bad = _seeds(cid, n) or _converged(cid, "the informed model", informed_converged)
    if bad:
        return bad
    parts, ok, trends = [], True, list[Trend]()
    for e in epochs:
        t = seed_trend([_log_ratio(r, i) for i, r in zip(informed[e], random[e])])
        ok, trends = ok and t.holds, trends + [t]
        parts.append(
            f"epoch {e}: informed {_g(_med(informed[e]))} vs random "
            f"{_g(_med(random[e]))}, log(random/informed) {t.text()}"
        )
    bad = _few(cid, trends, "; ".join(parts))
    if bad:
        return bad
    reason = "" if ok else "informed not below random beyond the seed spread at every epoch"
    return _verdict(cid, _word(ok), reason, "; ".join(parts))


@_checker("001-denoise")
def check_denoise(
    *,
    best_mse: Mapping[str, Mapping[int, Sequence[float]]],
    failed: Mapping[str, Sequence[int]],
    converged: Mapping[str, Sequence[float]] | None = None,
) -> Verdict:
    """001-denoise: kGLM best test MSE below random at every epoch, and no more failed runs.

    Args:
        best_mse: ``{"kglm": {epoch: per-seed best test MSE over the spectral-norm grid},
            "random": {...}}`` (the best over the non-failed grid points).
        failed: ``{"kglm": per-seed number of failed runs (NaN/inf/diverged) over the grid,
            "random": ...}``.
        converged: optional ``{"kglm": per-seed share of converged forward solves at the best
            grid point, "random": ...}``.

    Paper: Fig. 6 "superior performance at all epochs"; Table 1 fewer failed runs in every row.
    Each epoch's per-seed effect ``log(random / kglm)`` must be a trend; the median over seeds
    of ``failed_random - failed_kglm`` must not be negative.
    """
    cid = "001-denoise"
    kg, rd = best_mse.get("kglm", {}), best_mse.get("random", {})
    epochs = sorted(e for e in kg if e in rd)
    if not epochs:
        return _verdict(cid, NOT_RUN, "data: no epoch measured for both schemes", "")
    n = _paired(cid, {f"kglm@{e}": kg[e] for e in epochs} | {f"random@{e}": rd[e] for e in epochs})
    bad = _seeds(cid, n)
    for scheme, shares in (converged or {}).items():
        bad = bad or _converged(cid, f"the {scheme} model at its best scale", shares)
    if bad:
        return bad
    parts, ok, trends = [], True, list[Trend]()
    for e in epochs:
        t = seed_trend([_log_ratio(r, k) for k, r in zip(kg[e], rd[e])])
        ok, trends = ok and t.holds, trends + [t]
        parts.append(
            f"epoch {e}: kGLM {_g(_med(kg[e]))} vs random "
            f"{_g(_med(rd[e]))} ({t.text()} in log ratio)"
        )
    bad = _few(cid, trends, "; ".join(parts))
    if bad:
        return bad
    fk, fr = list(failed.get("kglm", [])), list(failed.get("random", []))
    fewer = True
    if fk and fr:
        diff = _med(float(r) - float(k) for k, r in zip(fk, fr))
        fewer = diff >= 0
        parts.append(f"failed runs kGLM {fk} vs random {fr}")
    reasons = []
    if not ok:
        reasons.append("kGLM not below random beyond the seed spread at every epoch")
    if not fewer:
        reasons.append("kGLM failed more often than random")
    return _verdict(cid, _word(ok and fewer), "; ".join(reasons), "; ".join(parts))


#: paper 001 App. F: the conv kGLM initialisation "costs less than 1 second on a laptop PC"
CONV_INIT_MAX_SECONDS = 1.0


@_checker("001-init-cost")
def check_init_cost(
    *,
    fc_kglm: Mapping[int, Sequence[float]],
    fc_random: Mapping[int, Sequence[float]],
    conv_kglm: Mapping[int, Sequence[float]],
) -> Verdict:
    """001-init-cost: fc kGLM init faster than random at every width; conv kGLM init < 1 s.

    Args:
        fc_kglm: width -> per-repeat seconds of a kGLM init of a fully connected layer pair.
        fc_random: width -> per-repeat seconds of the random (Gaussian) init, same repeats.
        conv_kglm: channels -> per-repeat seconds of a kGLM init of a C -> C conv pair at 32x32.

    Repeats play the role of seeds (>= 3). fc: per width, ``log(random / kglm)`` per repeat must
    be a trend. conv: the median over repeats at every channel count must be below
    :data:`CONV_INIT_MAX_SECONDS`.
    """
    cid = "001-init-cost"
    widths = sorted(w for w in fc_kglm if w in fc_random)
    if not widths or not conv_kglm:
        return _verdict(cid, NOT_RUN, "data: fc (both schemes) and conv timings needed", "")
    n = min(min(len(fc_kglm[w]), len(fc_random[w])) for w in widths)
    n = min([n] + [len(v) for v in conv_kglm.values()])
    bad = _seeds(cid, n, "repeats")
    if bad:
        return bad
    parts, fc_ok, trends = [], True, list[Trend]()
    for w in widths:
        t = seed_trend([_log_ratio(r, k) for k, r in zip(fc_kglm[w], fc_random[w])])
        fc_ok, trends = fc_ok and t.holds, trends + [t]
        parts.append(f"fc {w}: kGLM {_g(_med(fc_kglm[w]))} s vs random {_g(_med(fc_random[w]))} s")
    bad = _few(cid, trends, "; ".join(parts))
    if bad:
        return bad
    conv_med = {c: _med(v) for c, v in sorted(conv_kglm.items())}
    conv_ok = all(m < CONV_INIT_MAX_SECONDS for m in conv_med.values())
    cmax = max(conv_med)
    parts.append(f"conv kGLM at {cmax} channels {_g(conv_med[cmax])} s")
    reasons = []
    if not fc_ok:
        reasons.append("fc kGLM init not faster than random at every width")
    if not conv_ok:
        reasons.append(f"conv kGLM init >= {CONV_INIT_MAX_SECONDS:g} s")
    return _verdict(cid, _word(fc_ok and conv_ok), "; ".join(reasons), "; ".join(parts))


# -- 002: pcDEQ ----------------------------------------------------------------------------------

#: paper 002 Table 1 (MNIST, %, averaged over five runs)
PCDEQ_MNIST_TABLE1: dict[str, float] = {
    "pcDEQ-1-L-ReLU6": 98.1,
    "pcDEQ-1-L-Tanh": 98.2,
    "pcDEQ-1-L-Softsign": 98.1,
    "pcDEQ-2-L-Sigmoid": 98.1,
    "pcDEQ-1-SC-ReLU6": 99.2,
    "pcDEQ-1-SC-Tanh": 99.2,
    "pcDEQ-1-SC-Softsign": 99.1,
    "pcDEQ-2-SC-Sigmoid": 98.9,
    "pcDEQ-1-MC-ReLU6": 99.3,
    "pcDEQ-1-MC-Tanh": 99.2,
    "pcDEQ-1-MC-Softsign": 99.2,
    "pcDEQ-2-MC-Sigmoid": 98.7,
}
#: Table 1 reports one decimal: a mean within 0.1 points below it (or within our seed spread,
#: if larger) matches the printed number
TABLE1_PRECISION = 0.1


@_checker("002-mnist-accuracy")
def check_mnist_accuracy(
    *, accuracy: Mapping[str, Sequence[float]], scale: Scale = "cpu", paper_data: bool = False
) -> Verdict:
    """002-mnist-accuracy: the Table 1 MNIST accuracies (absolute: paper scale on MNIST only).

    Args:
        accuracy: Table 1 model name (a key of :data:`PCDEQ_MNIST_TABLE1`, e.g.
            ``"pcDEQ-1-L-Tanh"``) -> per-seed final test accuracy as a fraction (0.981).
        scale: ``"cpu"`` (not run, reason ``scale``) or ``"paper"``.
        paper_data: the run used MNIST (not a stand-in).

    Per model: reproduced when the mean over seeds is at least the paper's value minus
    max(0.1 points (Table 1's precision), the seed standard deviation). Models not measured are
    named in the reason; every measured one must match.
    """
    cid = "002-mnist-accuracy"
    bad = _absolute(cid, scale, paper_data)
    if bad:
        return bad
    unknown = set(accuracy) - set(PCDEQ_MNIST_TABLE1)
    if unknown:
        raise ValueError(f"{cid}: not Table 1 models: {sorted(unknown)}")
    if not accuracy:
        return _verdict(cid, NOT_RUN, "data: no Table 1 model measured", "")
    bad = _seeds(cid, min(len(v) for v in accuracy.values()))
    if bad:
        return bad
    parts, misses = [], []
    for name, vals in accuracy.items():
        pct = [100 * float(v) for v in vals]
        mean, sd = statistics.fmean(pct), statistics.stdev(pct)
        ref = PCDEQ_MNIST_TABLE1[name]
        if not mean >= ref - max(TABLE1_PRECISION, sd):
            misses.append(name)
        parts.append(f"{name} {mean:.2f}% (sd {sd:.2f}) vs {ref}%")
    missing = sorted(set(PCDEQ_MNIST_TABLE1) - set(accuracy))
    reasons = [f"below Table 1: {', '.join(misses)}"] if misses else []
    if missing:
        reasons.append(f"not measured: {', '.join(missing)}")
    return _verdict(cid, _word(not misses), "; ".join(reasons), "; ".join(parts))


#: the smallest iteration growth that counts: one fixed-point step (an iteration count cannot
#: show less; paper 002 gives no tolerance, Fig. 3 shows flat per-epoch means)
ONE_ITERATION = 1.0
#: paper 002 Section 5.3: with sigmoid "the fixed point iteration satisfies the stopping criterion
#: with less than eight iterations" (SC model, MNIST)
SIGMOID_MAX_ITERATIONS = 8.0


@_checker("002-iterations")
def check_iterations(
    *,
    forward_iterations: Mapping[str, Sequence[Sequence[float]]],
    scale: Scale = "cpu",
    paper_data: bool = False,
) -> Verdict:
    """002-iterations: pcDEQ forward iterations do not grow during training; sigmoid < 8.

    Args:
        forward_iterations: activation (``"tanh"``, ``"softsign"``, ``"relu6"``,
            ``"sigmoid"``) -> per seed -> per-epoch mean forward iterations (epochs >= 1, the
            constrained pcDEQ cells only).
        scale, paper_data: the "< 8 for sigmoid" number is compared only at ``scale="paper"``
            on MNIST (``paper_data``); otherwise only the trend is judged.

    Growth per seed = mean of the last quarter of epochs minus mean of the first quarter. The
    claim fails for an activation when that growth is a trend (:func:`seed_trend`, at least
    :data:`ONE_ITERATION`).
    """
    cid = "002-iterations"
    if not forward_iterations:
        return _verdict(cid, NOT_RUN, "data: no iteration curves", "")
    bad = _seeds(cid, min(len(v) for v in forward_iterations.values()))
    if bad:
        return bad
    parts, grew, trends = [], [], []
    for act, curves in forward_iterations.items():
        t = seed_trend([_growth(c) for c in curves], ONE_ITERATION)
        trends.append(t)
        if t.holds:
            grew.append(act)
        first = _med(float(c[0]) for c in curves if len(c))
        last = _med(float(c[-1]) for c in curves if len(c))
        parts.append(f"{act}: {_g(first)} -> {_g(last)} (growth {t.text(' it')})")
    bad = _few(cid, trends, "; ".join(parts))
    if bad:
        return bad
    reasons = [f"iterations grow: {', '.join(grew)}"] if grew else []
    ok = not grew
    sig = forward_iterations.get("sigmoid")
    if sig and scale == "paper" and paper_data:
        peak = _med(max(float(x) for x in c) for c in sig if len(c))
        parts.append(f"sigmoid max {_g(peak)} iterations")
        if not peak < SIGMOID_MAX_ITERATIONS:
            ok = False
            reasons.append(f"sigmoid needs >= {SIGMOID_MAX_ITERATIONS:g} iterations")
    else:
        reasons.append("sigmoid < 8 not compared (scale/data)")
    return _verdict(cid, _word(ok), "; ".join(reasons), "; ".join(parts))


#: paper 002 Section 5.4: the Banach bound is informative at L = 1; "most of the training time"
#: = more than half of the epochs
LIPSCHITZ_ONE = 1.0
MOST = 0.5
LIPSCHITZ_ABOVE = ("tanh", "softsign", "sigmoid")
LIPSCHITZ_BELOW = ("relu6",)


@_checker("002-lipschitz")
def check_lipschitz(*, sigma_max: Mapping[str, Sequence[Sequence[float]]]) -> Verdict:
    """002-lipschitz: sigma_max(W) > 1 for most of training (tanh, softsign, sigmoid), < 1 for
    all of it (ReLU6), linear pcDEQ layer.

    Args:
        sigma_max: activation -> per seed -> per-epoch largest singular value of W.

    Per seed, effect for tanh/softsign/sigmoid = share of epochs with sigma_max > 1 minus 1/2;
    for ReLU6 = 1 - max over epochs. Each must be a trend. All four activations are needed.
    """
    cid = "002-lipschitz"
    missing = [a for a in LIPSCHITZ_ABOVE + LIPSCHITZ_BELOW if a not in sigma_max]
    if missing:
        return _verdict(cid, NOT_RUN, f"data: no sigma_max for {', '.join(missing)}", "")
    bad = _seeds(cid, min(len(sigma_max[a]) for a in LIPSCHITZ_ABOVE + LIPSCHITZ_BELOW))
    if bad:
        return bad
    parts, wrong, trends = [], [], []
    for act in LIPSCHITZ_ABOVE + LIPSCHITZ_BELOW:
        curves = [[float(x) for x in c] for c in sigma_max[act]]
        if act in LIPSCHITZ_ABOVE:
            eff = [sum(x > LIPSCHITZ_ONE for x in c) / len(c) - MOST if c else math.nan
                   for c in curves]  # fmt: skip
            desc = "epochs > 1"
            shown = _med(e + MOST for e in eff if math.isfinite(e))
            txt = f"{_pct(shown)} of {desc}"
        else:
            eff = [LIPSCHITZ_ONE - max(c) if c else math.nan for c in curves]
            txt = f"max {_g(_med(max(c) for c in curves if c))}"
        t = seed_trend(eff)
        trends.append(t)
        if not t.holds:
            wrong.append(act)
        peak = _med(max(c) for c in curves if c)
        parts.append(f"{act}: {txt} (peak sigma_max {_g(peak)}, {t.n} seeds)")
    bad = _few(cid, trends, "; ".join(parts))
    if bad:
        return bad
    reason = f"not as in Fig. 4: {', '.join(wrong)}" if wrong else ""
    return _verdict(cid, _word(not wrong), reason, "; ".join(parts))


@_checker("002-unconstrained")
def check_unconstrained(
    *,
    pcdeq_iterations: Sequence[Sequence[float]],
    control_iterations: Sequence[Sequence[float]],
) -> Verdict:
    """002-unconstrained: an unconstrained DEQ's iterations grow during training, a pcDEQ's not.

    Args:
        pcdeq_iterations: per seed, per-epoch mean forward iterations of the pcDEQ (tanh).
        control_iterations: the same for the control (same architecture and activation, no
            projection onto W >= 0); a solve that hit max_iter counts max_iter.

    Per seed effect = growth(control) - growth(pcDEQ) (growth as in :func:`check_iterations`);
    it must be a trend of at least :data:`ONE_ITERATION`.
    """
    cid = "002-unconstrained"
    n = _paired(cid, {"pcdeq": pcdeq_iterations, "control": control_iterations})
    bad = _seeds(cid, n)
    if bad:
        return bad
    gp = [_growth(c) for c in pcdeq_iterations]
    gc = [_growth(c) for c in control_iterations]
    t = seed_trend([c - p for p, c in zip(gp, gc)], ONE_ITERATION)
    measured = (
        f"growth over training: control {_g(_med(gc))} vs pcDEQ "
        f"{_g(_med(gp))} iterations; difference {t.text(' it')}"
    )
    bad = _few(cid, [t], measured)
    if bad:
        return bad
    reason = "" if t.holds else "the control's iterations do not grow more than the pcDEQ's"
    return _verdict(cid, _word(t.holds), reason, measured)


# -- 003: OptEq ----------------------------------------------------------------------------------

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
    reason = f"residual does not fall beyond the seed spread at {', '.join(falls)}" if falls else ""
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
    reason = "" if t.holds else f"accuracy at K={hi} not above K={lo} beyond the seed spread"
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
    reason = "" if t.holds else "IFT memory not below every unrolled K beyond the seed spread"
    return _verdict(cid, _word(t.holds), reason, measured)


# -- 004: NTK / trajectory / landscape thesis ----------------------------------------------------


@dataclass(frozen=True)
class Sweep:
    """One seed's splitting sweep on a trained monDEQ.

    Attributes:
        bound: the FB step bound 2m / ||I - W||^2.
        fb: alpha -> forward-backward reached the tolerance.
        pr: alpha -> Peaceman-Rachford reached the tolerance.
    """

    bound: float
    fb: Mapping[float, bool]
    pr: Mapping[float, bool]


@_checker("004-pr-fb")
def check_pr_fb(*, sweeps: Sequence[Sweep]) -> Verdict:
    """004-pr-fb: PR converges for every alpha; FB converges for every alpha below 2m/L^2.

    Args:
        sweeps: one :class:`Sweep` per seed.

    A sufficient condition of a theorem, so it must hold in every seed (not only the median).
    FB above its bound is not judged (the thesis claims nothing there). Not run when no alpha
    below the bound or no PR alpha was tested.
    """
    cid = "004-pr-fb"
    bad = _seeds(cid, len(sweeps))
    if bad:
        return bad
    below = [[a for a in s.fb if a < s.bound] for s in sweeps]
    if not all(below) or not all(s.pr for s in sweeps):
        return _verdict(
            cid, NOT_RUN, "data: a seed tested no FB alpha below its bound or no PR alpha", ""
        )
    pr_fail = [(i, a) for i, s in enumerate(sweeps) for a, c in s.pr.items() if not c]
    fb_fail = [(i, a) for i, s in enumerate(sweeps) for a in below[i] if not s.fb[a]]
    measured = (
        f"PR converged at {sum(len(s.pr) for s in sweeps) - len(pr_fail)} of "
        f"{sum(len(s.pr) for s in sweeps)} (seed, alpha); FB below its bound (median bound "
        f"{_g(_med(s.bound for s in sweeps))}) at "
        f"{sum(map(len, below)) - len(fb_fail)} of {sum(map(len, below))}"
    )
    reasons = []
    if pr_fail:
        reasons.append("PR failed at " + ", ".join(f"seed {i} alpha {a:g}" for i, a in pr_fail))
    if fb_fail:
        reasons.append(
            "FB failed below its bound at " + ", ".join(f"seed {i} alpha {a:g}" for i, a in fb_fail)
        )
    return _verdict(cid, _word(not reasons), "; ".join(reasons), measured)


#: thesis Section 3.3 (proof of Thm. 3.3.1, Hypothesis 2): sigma_min(Z(t)) >= lambda_0 / 2, so
#: with eq. 3.14 lambda_min(K(t)) >= lambda_0^2 / 4: the NTK's lambda_min may fall to a quarter
#: of its value at init, no further
NTK_LAMBDA_FRACTION = 0.25


@_checker("004-ntk-lambda-min")
def check_ntk_lambda_min(
    *,
    lambda_min: Sequence[Sequence[float]],
    log_loss_slope: Sequence[float],
    converged: Sequence[bool],
    predicted_slope: Sequence[float] | None = None,
) -> Verdict:
    """004-ntk-lambda-min: lambda_min of the monDEQ's NTK stays >= lambda_min(init)/4 during GD
    training, and the loss falls linearly (log-loss slope < 0, at least as steep as the
    lambda_min guarantee where that guarantee is a decay).

    Args:
        lambda_min: per seed, lambda_min(K) at each NTK evaluation, the first at init.
        log_loss_slope: per seed, the fitted slope of log(train loss) per step.
        converged: per seed, every NTK evaluation's solves met their tolerance (none flagged).
        predicted_slope: optional, per seed, the mean guaranteed slope 2 log(1 - 2 eta
            lambda_min / R) (a value >= 0: no decay guaranteed, not compared).

    Not run when a seed's solves missed their tolerance, or lambda_min at init is not positive
    (the theorem needs lambda_0 > 0).
    """
    cid = "004-ntk-lambda-min"
    n = _paired(cid, {"lambda_min": lambda_min, "slope": log_loss_slope, "conv": converged})
    bad = _seeds(cid, n)
    if bad:
        return bad
    if not all(converged):
        return _verdict(cid, NOT_RUN, "convergence: an NTK evaluation's solves missed tol", "")
    init = [float(c[0]) if len(c) else math.nan for c in lambda_min]
    if not all(x > 0 for x in init):
        return _verdict(
            cid, NOT_RUN, "condition: lambda_min(K) at init not positive (needs lambda_0 > 0)", ""
        )
    ratio = [min(float(x) for x in c) / c0 for c, c0 in zip(lambda_min, init)]
    t_lam = seed_trend([_log_ratio(r, NTK_LAMBDA_FRACTION) for r in ratio])
    t_loss = seed_trend([-float(s) for s in log_loss_slope])
    measured = (
        f"lambda_min init {_g(_med(init))}, min/init "
        f"{_g(_med(ratio))}; log-loss slope {_g(_med(log_loss_slope))}"
    )
    bad = _few(cid, [t_lam, t_loss], measured)
    if bad:
        return bad
    ok = t_lam.holds and t_loss.holds
    reasons = []
    if not t_lam.holds:
        reasons.append("lambda_min fell below a quarter of its init value")
    if not t_loss.holds:
        reasons.append("the loss does not decay linearly")
    if predicted_slope is not None:
        pairs = [(f, p) for f, p in zip(log_loss_slope, predicted_slope) if p < 0]
        if len(pairs) >= MIN_SEEDS:
            fit = _med(f for f, _ in pairs)
            pred = _med(p for _, p in pairs)
            measured += f" vs guaranteed {_g(pred)}"
            if not fit <= pred:
                ok = False
                reasons.append("the loss decays slower than the lambda_min guarantee")
    return _verdict(cid, _word(ok), "; ".join(reasons), measured)


@_checker("004-trajectory-init")
def check_trajectory_init(*, iterations: Mapping[str, Sequence[float]]) -> Verdict:
    """004-trajectory-init: small init settles quickly, N(0, 1) does not (at init, before
    training).

    Args:
        iterations: ``{"small": per seed, "standard": per seed}``: median over the probe inputs
            of the forward f-evaluations until the relative residual fell below the recording
            tolerance, an input that never did counting the whole budget.

    Per seed effect ``log(standard / small)`` must be a trend (both at the budget: no effect).
    """
    cid = "004-trajectory-init"
    if "small" not in iterations or "standard" not in iterations:
        return _verdict(cid, NOT_RUN, "data: 'small' and 'standard' inits both needed", "")
    sm, st = iterations["small"], iterations["standard"]
    bad = _seeds(cid, _paired(cid, {"small": sm, "standard": st}))
    if bad:
        return bad
    t = seed_trend([_log_ratio(b, a) for a, b in zip(sm, st)])
    measured = (
        f"f-evals to tol at init: small {_g(_med(sm))} vs standard "
        f"{_g(_med(st))} (log ratio {t.text()})"
    )
    bad = _few(cid, [t], measured)
    if bad:
        return bad
    reason = "" if t.holds else "small init not faster to settle beyond the seed spread"
    return _verdict(cid, _word(t.holds), reason, measured)


@_checker("004-trajectory-separation")
def check_trajectory_separation(
    *,
    silhouette_init: Sequence[float],
    silhouette_trained: Sequence[float],
    converged: Sequence[float] | None = None,
) -> Verdict:
    """004-trajectory-separation: class separation of the fixed points rises after the first
    epoch.

    Args:
        silhouette_init: per seed, silhouette score by class of the probe fixed points (PCA
            plane) at init.
        silhouette_trained: per seed, the same after the first epoch (Fig. 4.3's statement).
        converged: optional, per seed, the share of the trained model's probe solves that
            converged (the separation is of fixed points).

    Per seed effect = trained - init; it must be a trend.
    """
    cid = "004-trajectory-separation"
    n = _paired(cid, {"init": silhouette_init, "trained": silhouette_trained})
    bad = _seeds(cid, n) or _converged(cid, "the trained model's probe solves", converged)
    if bad:
        return bad
    t = seed_trend([float(b) - float(a) for a, b in zip(silhouette_init, silhouette_trained)])
    measured = (
        f"silhouette {_g(_med(silhouette_init))} (init) -> "
        f"{_g(_med(silhouette_trained))} (after epoch 1); rise {t.text()}"
    )
    bad = _few(cid, [t], measured)
    if bad:
        return bad
    reason = "" if t.holds else "separation does not rise beyond the seed spread"
    return _verdict(cid, _word(t.holds), reason, measured)


#: Fig. 4.4's order of the small-loss area: repeat-6 < repeat-11 < repeat-18 < DEQ
LANDSCAPE_ORDER = ("repeat-6", "repeat-11", "repeat-18", "deq")


@_checker("004-landscape-repeats")
def check_landscape_repeats(
    *, low_loss_area: Mapping[str, Sequence[float]], deq_converged: Sequence[float]
) -> Verdict:
    """004-landscape-repeats: the small-loss area grows with repetitions, the DEQ largest.

    Args:
        low_loss_area: ``{"repeat-6": per seed, "repeat-11", "repeat-18", "deq"}``: share of the
            grid whose loss is within the chosen level of the centre loss (the same level and
            plane construction for every model).
        deq_converged: per seed, the share of grid points at which the DEQ's forward solve
            converged (>= :data:`MIN_CONVERGED` in every seed, issue 26).

    For each consecutive pair of :data:`LANDSCAPE_ORDER` the per-seed increase must be a trend.
    """
    cid = "004-landscape-repeats"
    missing = [m for m in LANDSCAPE_ORDER if m not in low_loss_area]
    if missing:
        return _verdict(cid, NOT_RUN, f"data: no landscape for {', '.join(missing)}", "")
    groups = {m: low_loss_area[m] for m in LANDSCAPE_ORDER}
    bad = _seeds(cid, _paired(cid, groups)) or _converged(
        cid, "the DEQ at grid points", deq_converged
    )
    if bad:
        return bad
    measured = ", ".join(f"{m} {_pct(_med(groups[m]))}" for m in LANDSCAPE_ORDER)
    flat, trends = [], []
    for a, b in zip(LANDSCAPE_ORDER, LANDSCAPE_ORDER[1:]):
        t = seed_trend([float(y) - float(x) for x, y in zip(groups[a], groups[b])])
        trends.append(t)
        if not t.holds:
            flat.append(f"{a} -> {b}")
    bad = _few(cid, trends, measured)
    if bad:
        return bad
    reason = f"area does not grow beyond the seed spread: {', '.join(flat)}" if flat else ""
    return _verdict(cid, _word(not flat), reason, measured + " (median small-loss area)")
