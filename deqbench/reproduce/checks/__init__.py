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

Layout: this package's ``__init__`` holds the shared part (:class:`Verdict`, the verdict words,
:data:`MIN_SEEDS`, :data:`MIN_CONVERGED`, :func:`seed_trend`, the private helpers every checker
uses and the :data:`CHECKERS` registry with its ``@_checker(claim_id)`` decorator); one module per
paper holds that paper's checkers and the constants they cite: ``p001_kglm``, ``p002_pcdeq``,
``p003_opteq``, ``p004_ntk``. The package imports every one of its modules (in name order) at the
end of ``__init__``, so each checker registers itself, and re-exports the names in each module's
``__all__`` here (``from deqbench.reproduce.checks import check_denoise`` works).

A new claim of a paper: add the claim to ``claims.py``, its checker to ``checks/pNNN_*.py``
(decorated with ``@_checker("NNN-...")`` and named in that module's ``__all__``), its extractor to
``extract/pNNN_*.py``. A new paper: one new module here and one in ``extract/``.

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

from .._papers import load_papers
from ..claims import claim

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


# -- the per-paper modules -----------------------------------------------------------------------


load_papers(__name__, __path__, globals())  # each pNNN_*.py registers its checkers
