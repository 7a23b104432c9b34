"""Checkers of paper 004: Nguyen Ngoc Hieu, *An analysis of applying neural tangent kernels for deep
equilibrium models*, thesis 2022 (NTK, trajectory, landscape). One checker per claim ``004-*`` of
:data:`deqbench.reproduce.claims.CLAIMS`, each threshold cited to the paper at its constant; the
shared rules, helpers and the registry are in :mod:`deqbench.reproduce.checks`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from . import (
    MIN_SEEDS,
    NOT_RUN,
    Verdict,
    _after_gate,
    _checker,
    _converged,
    _few,
    _g,
    _log_ratio,
    _med,
    _paired,
    _pct,
    _seeds,
    _verdict,
    _word,
    gated,
    pair_trend,
    seed_trend,
)

__all__ = [
    "Sweep",
    "check_pr_fb",
    "NTK_LAMBDA_FRACTION",
    "NTK_MAX_MARGIN",
    "check_ntk_lambda_min",
    "check_trajectory_init",
    "check_trajectory_init_var",
    "check_trajectory_separation",
    "check_trajectory_separation_var",
    "check_trajectory_complexity",
    "check_trajectory_complexity_var",
    "LANDSCAPE_ORDER",
    "check_landscape_repeats",
]


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
#: thesis Condition 2, eq. (3.18): lambda_0^2 >= 20 ||X||_F^2 (... + lambda_U^2), with
#: lambda_U >= ||U(0)||_2; Lemma 3.3.3 bounds lambda_0 = sigma_min(Z(0)) <= ||Z(0)||_F <=
#: ||X||_F ||U(0)||_2 / m. Both hold only when m^2 <= 1/20: a monDEQ with a larger monotonicity
#: margin m can never meet the theorem's condition (our derivation from the thesis's lemma; the
#: thesis leaves the satisfiability of Condition 2 open, Ch. 5)
NTK_MAX_MARGIN = 1.0 / math.sqrt(20.0)


@_checker("004-ntk-lambda-min")
def check_ntk_lambda_min(
    *,
    lambda_min: Sequence[Sequence[float]],
    log_loss_slope: Sequence[float],
    converged: Sequence[bool],
    predicted_slope: Sequence[float] | None = None,
    margin: float | None = None,
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
        margin: the monDEQ's monotonicity margin m. The theorem's Condition 2 cannot hold for
            m > :data:`NTK_MAX_MARGIN`: then ``not run (conditions)``, the measured direction
            shown.

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
    v = _verdict(cid, _word(ok), "; ".join(reasons), measured)
    if margin is not None and not margin <= NTK_MAX_MARGIN:
        return gated(
            v,
            f"conditions: Thm. 3.3.5's Condition 2 (3.18) with Lemma 3.3.3 needs m <= "
            f"{NTK_MAX_MARGIN:.3f}; the monDEQ has m = {margin:g}",
        )
    return v


def _small_below_standard(
    cid: str, small: Sequence[float], standard: Sequence[float], what: str, fail: str
) -> Verdict:
    """Per seed ``log(standard / small)`` of ``what`` must be positive in every seed."""
    return pair_trend(
        cid, small, standard, lambda a, b: _log_ratio(b, a),
        lambda t: f"{what}: small {_g(_med(small))} vs standard {_g(_med(standard))} "
        f"(log ratio {t.text()})",
        fail,
    )  # fmt: skip


def _censored_at_budget(
    v: Verdict,
    counts: tuple[Sequence[float], Sequence[float]],
    budgets: tuple[Sequence[float] | None, Sequence[float] | None],
    what: str,
    by_residual: Callable[[], Verdict] | None,
) -> Verdict:
    """``v`` (a verdict on f-evaluations to tolerance of two recordings) unless both counts used
    their whole budget in every seed: a count censored at the budget orders nothing, so then
    ``not run`` (reason ``censored: ...``) with the direction of ``by_residual()``, the residuals
    the two recordings reached (``v``'s direction where there are none). ``what`` names the two
    recordings in the reason."""
    if budgets[0] is None or budgets[1] is None:
        return v
    censored = all(
        float(x) >= float(n) for c, b in zip(counts, budgets) for x, n in zip(c, b or ())
    )
    if not censored:
        return v
    n = _g(_med([*budgets[0], *budgets[1]]))
    why = (
        f"censored: in every seed the median probe input of {what} used the whole budget "
        f"({n} f-evaluations) without reaching the recording tolerance, so f-evaluations to "
        "tolerance cannot order them"
    )
    if by_residual is not None:
        return gated(by_residual(), why, v.measured)
    return gated(v, why)


def _trajectory_init(
    cid: str,
    iterations: Mapping[str, Sequence[float]],
    budget: Sequence[float] | None = None,
    residual: Mapping[str, Sequence[float]] | None = None,
) -> Verdict:
    if "small" not in iterations or "standard" not in iterations:
        return _verdict(cid, NOT_RUN, "data: 'small' and 'standard' inits both needed", "")
    sm, st = iterations["small"], iterations["standard"]
    v = _small_below_standard(
        cid, sm, st, "f-evals to tol at init", "small init not faster to settle in every seed"
    )
    res = residual if residual and "small" in residual and "standard" in residual else None

    def by_residual() -> Verdict:
        assert res is not None
        return _small_below_standard(
            cid, res["small"], res["standard"],
            f"rel residual after {_g(_med(budget or [math.nan]))} f-evals at init",
            "small init's residual not below the standard init's in every seed",
        )  # fmt: skip

    return _censored_at_budget(
        v, (sm, st), (budget, budget), "both inits", by_residual if res is not None else None
    )


@_checker("004-trajectory-init")
def check_trajectory_init(
    *,
    iterations: Mapping[str, Sequence[float]],
    budget: Sequence[float] | None = None,
    residual: Mapping[str, Sequence[float]] | None = None,
) -> Verdict:
    """004-trajectory-init: small init N(0, 0.01) read as **std 0.01** settles quickly, N(0, 1)
    does not (at init, before training).

    Args:
        iterations: ``{"small": per seed, "standard": per seed}``: median over the probe inputs
            of the forward f-evaluations until the relative residual fell below the recording
            tolerance, an input that never did counting the whole budget.
        budget: per seed, the recording's f-evaluation budget (optional).
        residual: ``{"small": per seed, "standard": per seed}``: median relative residual
            the probe inputs reached (optional).

    Per seed effect ``log(standard / small)`` must be positive in every seed. Where both inits
    used the whole ``budget`` in every seed the count is censored and orders nothing: ``not
    run`` (reason ``censored: ...``), with the direction of ``log(standard / small)`` of the
    residuals they reached (both at the budget used to read as "no effect", a ``not
    reproduced`` that rested on solves that missed their tolerance).
    """
    return _trajectory_init("004-trajectory-init", iterations, budget, residual)


@_checker("004-trajectory-init-var")
def check_trajectory_init_var(
    *,
    iterations: Mapping[str, Sequence[float]],
    budget: Sequence[float] | None = None,
    residual: Mapping[str, Sequence[float]] | None = None,
) -> Verdict:
    """004-trajectory-init-var: :func:`check_trajectory_init` with N(0, 0.01) read as a
    **variance** (std 0.1), the second reading of the thesis's notation."""
    return _trajectory_init("004-trajectory-init-var", iterations, budget, residual)


def _trajectory_separation(
    cid: str,
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
    n = _paired(cid, {"init": silhouette_init, "trained": silhouette_trained})
    bad = _seeds(cid, n)
    gate = _converged(cid, "the trained model's probe solves", converged)
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
    reason = "" if t.holds else "separation does not rise in every seed"
    return _after_gate(_verdict(cid, _word(t.holds), reason, measured), gate)


@_checker("004-trajectory-separation")
def check_trajectory_separation(
    *,
    silhouette_init: Sequence[float],
    silhouette_trained: Sequence[float],
    converged: Sequence[float] | None = None,
) -> Verdict:
    """004-trajectory-separation with N(0, 0.01) read as std 0.01 (:func:`_trajectory_separation`
    has the rule)."""
    return _trajectory_separation(
        "004-trajectory-separation",
        silhouette_init=silhouette_init,
        silhouette_trained=silhouette_trained,
        converged=converged,
    )


@_checker("004-trajectory-separation-var")
def check_trajectory_separation_var(
    *,
    silhouette_init: Sequence[float],
    silhouette_trained: Sequence[float],
    converged: Sequence[float] | None = None,
) -> Verdict:
    """004-trajectory-separation with N(0, 0.01) read as a variance (std 0.1)."""
    return _trajectory_separation(
        "004-trajectory-separation-var",
        silhouette_init=silhouette_init,
        silhouette_trained=silhouette_trained,
        converged=converged,
    )


def _trajectory_complexity(
    cid: str,
    iterations_first: Sequence[float],
    iterations_last: Sequence[float],
    last_epoch: int,
    budget_first: Sequence[float] | None = None,
    budget_last: Sequence[float] | None = None,
    residual_first: Sequence[float] | None = None,
    residual_last: Sequence[float] | None = None,
) -> Verdict:
    n = _paired(cid, {"first": iterations_first, "last": iterations_last})
    bad = _seeds(cid, n)
    if bad:
        return bad
    if not last_epoch > 1:
        return _verdict(cid, NOT_RUN, "data: no recording after epoch 1", "")
    t = seed_trend([_log_ratio(b, a) for a, b in zip(iterations_first, iterations_last)])
    measured = (
        f"f-evals to tol {_g(_med(iterations_first))} (after epoch 1) -> "
        f"{_g(_med(iterations_last))} (epoch {last_epoch}); log ratio {t.text()}"
    )
    bad = _few(cid, [t], measured)
    if bad:
        return bad
    reason = "" if t.holds else f"iterations do not rise from epoch 1 to {last_epoch} in every seed"
    v = _verdict(cid, _word(t.holds), reason, measured)
    first, last = residual_first, residual_last

    def by_residual() -> Verdict:
        assert first is not None and last is not None
        return pair_trend(
            cid, first, last, lambda a, b: _log_ratio(b, a),
            lambda r: f"rel residual at the budget {_g(_med(first))} (after epoch 1) -> "
            f"{_g(_med(last))} (epoch {last_epoch}); log ratio {r.text()}",
            f"the residual does not rise from epoch 1 to {last_epoch} in every seed",
        )  # fmt: skip

    return _censored_at_budget(
        v, (iterations_first, iterations_last), (budget_first, budget_last),
        f"both recordings (after epoch 1 and at epoch {last_epoch})",
        by_residual if first is not None and last is not None else None,
    )  # fmt: skip


@_checker("004-trajectory-complexity")
def check_trajectory_complexity(
    *,
    iterations_first: Sequence[float],
    iterations_last: Sequence[float],
    last_epoch: int,
    budget_first: Sequence[float] | None = None,
    budget_last: Sequence[float] | None = None,
    residual_first: Sequence[float] | None = None,
    residual_last: Sequence[float] | None = None,
) -> Verdict:
    """004-trajectory-complexity: the dynamics grow more complex during training (N(0, 0.01)
    read as std 0.01): the probe trajectories need more f-evaluations to reach tolerance at the
    last recorded epoch than after epoch 1.

    Args:
        iterations_first: per seed, ``iterations_median`` of the probes after epoch 1.
        iterations_last: per seed, the same at the last recorded epoch.
        last_epoch: that epoch (must be > 1).
        budget_first, budget_last: per seed, the f-evaluations each recording's solve ran
            (``nstep``; optional).
        residual_first, residual_last: per seed, the median relative residual the probes
            reached in each recording (optional).

    Per seed effect ``log(last / first)``; it must be a trend. Where both recordings used their
    whole budget in every seed, the count is censored and orders nothing: ``not run`` (reason
    ``censored: ...``), with the direction of ``log(last / first)`` of the residuals they
    reached (a count at the budget twice reads as "no rise", a ``not reproduced`` that rested
    on solves that missed their tolerance).
    """
    return _trajectory_complexity(
        "004-trajectory-complexity", iterations_first, iterations_last, last_epoch,
        budget_first, budget_last, residual_first, residual_last,
    )  # fmt: skip


@_checker("004-trajectory-complexity-var")
def check_trajectory_complexity_var(
    *,
    iterations_first: Sequence[float],
    iterations_last: Sequence[float],
    last_epoch: int,
    budget_first: Sequence[float] | None = None,
    budget_last: Sequence[float] | None = None,
    residual_first: Sequence[float] | None = None,
    residual_last: Sequence[float] | None = None,
) -> Verdict:
    """004-trajectory-complexity with N(0, 0.01) read as a variance (std 0.1)."""
    return _trajectory_complexity(
        "004-trajectory-complexity-var", iterations_first, iterations_last, last_epoch,
        budget_first, budget_last, residual_first, residual_last,
    )  # fmt: skip


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
            converged (>= :data:`MIN_CONVERGED` in every seed).

    For each consecutive pair of :data:`LANDSCAPE_ORDER` the per-seed increase must be a trend.
    """
    cid = "004-landscape-repeats"
    missing = [m for m in LANDSCAPE_ORDER if m not in low_loss_area]
    if missing:
        return _verdict(cid, NOT_RUN, f"data: no landscape for {', '.join(missing)}", "")
    groups = {m: low_loss_area[m] for m in LANDSCAPE_ORDER}
    bad = _seeds(cid, _paired(cid, groups))
    gate = _converged(cid, "the DEQ at grid points", deq_converged)
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
    reason = f"area does not grow in every seed: {', '.join(flat)}" if flat else ""
    return _after_gate(
        _verdict(cid, _word(not flat), reason, measured + " (median small-loss area)"), gate
    )
