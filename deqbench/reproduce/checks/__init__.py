"""Checkers of the claim table: measured values in, a verdict out.

Each checker encodes one claim of :data:`deqbench.reproduce.claims.CLAIMS` in the paper's
direction, with thresholds taken from the paper (cited at each constant), never from our own
measurements. It takes plain measured values (per-seed numbers, small dicts; each docstring
says exactly what) and returns a :class:`Verdict`: exactly one of ``reproduced``, ``not
reproduced``, ``not run``, a separate ``reason`` and the ``measured`` value as text beside the
paper's. Extracting the values from run directories is the runner's job, not this module's.

Shared rules:

* A trend counts as reproduced only when every one of >= 3 seeds goes the paper's way by more
  than the claim's ``min_effect`` (cited where it is defined): :func:`seed_trend` (one rule for
  every checker). A mixed-sign set is ``not reproduced``; a larger effect can never flip it.
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

#: a trend needs at least this many seeds
MIN_SEEDS = 3
#: the share of solves behind a claim that must reach their tolerance ("the
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
    #: where the measured effect points, whatever the verdict: ``"with the paper"``,
    #: ``"against the paper"``, or ``""`` when nothing was measured (a ``not run`` for a gate,
    #: e.g. convergence or the step budget, keeps the direction of what was measured)
    direction: str = ""

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {self.verdict!r}")
        if self.verdict == NOT_RUN and not self.reason:
            raise ValueError("a 'not run' verdict needs a reason")


WITH_PAPER = "with the paper"
AGAINST_PAPER = "against the paper"


def _verdict(claim_id: str, word: VerdictWord, reason: str, measured: str) -> Verdict:
    direction = {REPRODUCED: WITH_PAPER, NOT_REPRODUCED: AGAINST_PAPER}.get(word, "")
    return Verdict(claim_id, word, reason, measured, claim(claim_id).paper_value, direction)


def gated(v: Verdict, reason: str, measured: str = "") -> Verdict:
    """``not run`` for ``reason`` (a gate: convergence, the step budget, ...), keeping what was
    measured and the direction it went, so a reader sees both ("converged 0% < 95%; measured:
    with the paper"). A verdict already ``not run`` gets ``reason`` in front of its own.

    Example:
        >>> v = Verdict("002-lipschitz", "reproduced", "", "tanh: 80%", "", WITH_PAPER)
        >>> g = gated(v, "scale: 320 of 37520 paper steps")
        >>> g.verdict, g.direction, g.reason
        ('not run', 'with the paper', 'scale: 320 of 37520 paper steps; measured direction: with the paper')
    """
    if v.verdict == NOT_RUN:
        why = f"{reason}; {v.reason}" if v.reason else reason
    else:
        why = f"{reason}; measured direction: {v.direction}"
    text = f"{v.measured} [{measured}]" if measured else v.measured
    return Verdict(v.claim_id, NOT_RUN, why, text, v.paper_value, v.direction)


def _after_gate(v: Verdict, gate: Verdict | None) -> Verdict:
    """``v`` unless a gate (e.g. :func:`_converged`'s ``not run``) closed: then :func:`gated`."""
    return v if gate is None else gated(v, gate.reason, gate.measured)


# -- the shared trend rule -----------------------------------------------------------------------


@dataclass(frozen=True)
class Trend:
    """Per-seed effects in the paper's direction (positive agrees with the paper).

    ``holds``: at least :data:`MIN_SEEDS` finite effects, and **every one of them** is above
    ``min_effect`` (and above 0). A larger effect in one seed can never flip the verdict: the
    rule looks at each seed's sign and size against the threshold, not at their spread.
    """

    n: int
    median: float
    spread: float
    min_effect: float
    holds: bool
    dropped: int = 0
    #: the finite per-seed effects, in seed order
    effects: tuple[float, ...] = ()

    @property
    def enough_seeds(self) -> bool:
        return self.n >= MIN_SEEDS

    @property
    def agreeing(self) -> int:
        """How many seeds' effects are above ``min_effect`` (and 0)."""
        return sum(e > max(self.min_effect, 0.0) for e in self.effects)

    def text(self, unit: str = "") -> str:
        each = ", ".join(f"{e:+.3g}" for e in self.effects)
        s = f"{self.agreeing} of {self.n} seeds > {_g(self.min_effect)}{unit} ({each}{unit}"
        if self.dropped:
            s += f"; {self.dropped} non-finite dropped"
        return s + ")"


def seed_trend(effects: Sequence[float], min_effect: float = 0.0) -> Trend:
    """The shared trend rule: every seed must go the paper's way by more than ``min_effect``.

    Args:
        effects: one effect per seed, signed so that a positive value goes the paper's way
            (e.g. ``log(random_mse / informed_mse)``). Non-finite values (failed seeds) are
            dropped and counted.
        min_effect: the smallest effect that counts, in the effect's unit (0: any effect in the
            paper's direction; each checker cites where its threshold comes from).

    Returns:
        A :class:`Trend`; ``holds`` is True only when >= :data:`MIN_SEEDS` seeds remain and
        each of their effects is > max(0, ``min_effect``). A mixed-sign set does not hold; with
        fewer than :data:`MIN_SEEDS` seeds the checkers answer ``not run``. The median and the
        sample standard deviation are kept for the report's text only: they decide nothing
        (so +10.3, +153.9, +6.6 holds: every seed agrees; under the former rule "median above
        the spread" the large seed inflated the spread and flipped the verdict).

    Example:
        >>> seed_trend([10.3, 153.9, 6.6], min_effect=1.0).holds
        True
        >>> seed_trend([10.3, -2.0, 6.6]).holds
        False
    """
    vals = [float(e) for e in effects]
    good = tuple(e for e in vals if math.isfinite(e))
    n = len(good)
    if n == 0:
        return Trend(0, math.nan, math.nan, min_effect, False, len(vals))
    med = statistics.median(good)
    sd = statistics.stdev(good) if n >= 2 else math.nan
    floor = max(float(min_effect), 0.0)
    holds = n >= MIN_SEEDS and all(e > floor for e in good)
    return Trend(n, med, sd, min_effect, holds, len(vals) - n, good)


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
            f"seeds: {n} {what} < {MIN_SEEDS} (a trend needs every one of >= {MIN_SEEDS} seeds)",
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


def pair_trend(
    claim_id: str,
    a: Sequence[float],
    b: Sequence[float],
    effect: Callable[[float, float], float],
    describe: Callable[[Trend], str],
    fail: str,
    min_effect: float = 0.0,
) -> Verdict:
    """A claim on two per-seed lists paired by position: ``not run`` below :data:`MIN_SEEDS`
    seeds, else the per-seed ``effect(a_i, b_i)`` judged by :func:`seed_trend`; ``describe``
    writes the measured text from the trend, ``fail`` is the reason when it does not hold."""
    bad = _seeds(claim_id, _paired(claim_id, {"a": a, "b": b}))
    if bad:
        return bad
    t = seed_trend([effect(float(x), float(y)) for x, y in zip(a, b)], min_effect)
    measured = describe(t)
    bad = _few(claim_id, [t], measured)
    if bad:
        return bad
    return _verdict(claim_id, _word(t.holds), "" if t.holds else fail, measured)


# -- the per-paper modules -----------------------------------------------------------------------


load_papers(__name__, __path__, globals())  # each pNNN_*.py registers its checkers
