"""A solve's verdict: did one DEQ solve converge? Convergence is verified, not believed: the
check of every DEQ solve. (A paper claim's verdict, reproduced or not, is another thing:
:mod:`deqbench.reproduce.verdicts`.)

A solver returns ``SolverStats.converged``; deqbench does not take it on trust. After every
solve of a DEQ layer (forward and IFT adjoint), :func:`check_claim` tests the solver's reported
residual, in the stop mode and under the stop rule it was asked for (``stop``: the batch max,
the batch Frobenius ratio or the batch mean, :data:`deqbench.solvers.base.STOP_RULES`), against
the tolerance; inside
:func:`verify_solves` the layer also re-evaluates f once at the returned iterate and tests the
recomputed residual (:func:`recheck`). A solve whose claim fails either test gets
``converged = False`` (``extra["solver_converged"]`` keeps what the solver said) and a note
(``extra["claim"]``) such as ``solver 'x' reported converged, rel residual 0.0126 > tol 1e-06``.

Inside :func:`solve_ledger`, every checked solve is also appended to the ledger as a
:class:`SolveRecord`: the runner opens one per phase (training batches, evaluation passes,
analyses' probes) and turns the records into converged fractions, status and notes.

Example:
    >>> import torch
    >>> from deqbench.core.verdict import solve_ledger
    >>> from deqbench.deq import DEQLayer, SolverConfig
    >>> layer = DEQLayer(torch.nn.Linear(4, 4), SolverConfig("anderson", tol=1e-5))  # doctest: +SKIP
    >>> with solve_ledger() as ledger:                                # doctest: +SKIP
    ...     layer.solve(torch.randn(2, 4), torch.zeros(2, 4))
    >>> ledger.records[0].converged                                   # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .tags import solver_tags

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

    from ..solvers.base import SolverStats

#: a recomputed residual up to this multiple of the tolerance agrees with a solver's claim: one
#: re-evaluation of f at the same iterate moves a residual near tol by rounding only (fused vs
#: torch kernels, bf16 autocast: well under 2x); a solver that stopped early or misreports is
#: off by orders of magnitude
VERIFY_SLACK = 2.0


@dataclass
class SolveRecord:
    """One batch solve as the runner judged it."""

    kind: str  # forward | adjoint
    converged: bool  # the runner's verdict (claim checked, residual verified where recomputed)
    solver_converged: bool  # what the solver said
    residual: float  # under the stop rule, in stop_mode: recomputed where verified, else reported
    stop_mode: str
    tol: float
    status: str  # the solver's own status: converged | max_iter | diverged | stagnated
    solver: str
    nstep: int
    max_iter: int | None = None
    verified: bool = False  # residual recomputed by one f-evaluation
    claim: str = ""  # why the solver's claim was not accepted
    plateau: bool = False  # unconverged, and the last quarter fell far slower than its rate
    stop: str = "sample_max"  # the stop rule the solve was judged under
    #: unconverged: the f-evaluations in all that the trace's rate needs to reach tol (inf: it
    #: stopped falling; NaN: too short a trace to tell)
    to_tol: float = math.nan
    rate: str = "linear"  # the rate the solver declares (deqbench.core.tags), or "linear"
    power: float = math.nan  # read as sublinear: the residual falls as k^-power
    #: a model's own loop: the library's verdict under its own stop rule (None: not declared)
    own_converged: bool | None = None
    own_rule: str = ""


@dataclass
class SolveLedger:
    """The :class:`SolveRecord` of every checked solve made while the ledger is open."""

    records: list[SolveRecord] = field(default_factory=list)


_LEDGER: contextvars.ContextVar[SolveLedger | None] = contextvars.ContextVar(
    "deqbench_solve_ledger", default=None
)
_VERIFY: contextvars.ContextVar[bool] = contextvars.ContextVar("deqbench_verify", default=False)


@contextlib.contextmanager
def solve_ledger() -> Iterator[SolveLedger]:
    """Record every DEQ solve made inside the block (a nested ledger's records reach the
    enclosing one too when it closes)."""
    parent = _LEDGER.get()
    ledger = SolveLedger()
    token = _LEDGER.set(ledger)
    try:
        yield ledger
    finally:
        _LEDGER.reset(token)
        if parent is not None:
            parent.records.extend(ledger.records)


@contextlib.contextmanager
def paused_ledger() -> Iterator[None]:
    """Solves inside the block are not recorded (a probe that judges its own solves)."""
    token = _LEDGER.set(None)
    try:
        yield
    finally:
        _LEDGER.reset(token)


@contextlib.contextmanager
def verify_solves(on: bool = True) -> Iterator[None]:
    """Inside the block, every forward solve of a DEQ layer recomputes the residual of its
    returned iterate with one more f-evaluation (not counted in ``nstep``)."""
    token = _VERIFY.set(on)
    try:
        yield
    finally:
        _VERIFY.reset(token)


def verifying() -> bool:
    return _VERIFY.get()


def stop_residual(stats: SolverStats) -> float:
    """The returned iterate's residual in the stop mode the solve used, reduced over the batch
    by its stop rule (``stats.stop``; the batch max by default)."""
    v = getattr(stats, "stop_residual", None)  # a stats object of another kind: the batch max
    if v is None:
        r = stats.residual
        return float(r.max()) if r.numel() else math.nan
    return float(v)


def rule_text(stop: str) -> str:
    """`` (stop rule batch_fro)`` for a stop rule other than the default, else ''."""
    return "" if stop in ("", "sample_max") else f" (stop rule {stop})"


def _reject(stats: SolverStats, what: str, value: float) -> None:
    stats.extra["solver_converged"] = True
    name = stats.extra.get("registered") or stats.solver or "?"
    stats.extra["claim"] = (
        f"solver '{name}' reported converged, {what} {stats.stop_mode} residual"
        f"{rule_text(stats.stop)} {value:.3g} > tol {stats.tol:g}"
    )
    stats.converged = False


def check_claim(
    stats: SolverStats, tol: float, stop_mode: str, name: str = "", stop: str | None = None
) -> None:
    """Test a solve's claimed convergence against its own reported residual (in place).
    ``name``: the solver's registered name (for notes; default ``stats.solver``); ``stop``:
    the declared stop rule (None: the one the stats carry)."""
    stats.tol, stats.stop_mode = float(tol), stop_mode
    if stop is not None:
        stats.stop = stop
    if name:
        stats.extra["registered"] = name
    if stats.converged:
        res = stats.extra["stop_residual"] = stop_residual(stats)  # one host read, kept
        if not res <= tol:  # NaN fails too
            _reject(stats, "its own", res)


def recheck(stats: SolverStats, fz: Tensor, z: Tensor) -> float:
    """Test a solve against the residual recomputed from ``fz = f(z)`` at its returned iterate
    (in place). Returns the recomputed residual in the stop mode under the stop rule."""
    from ..solvers.base import batch_norm, residuals, rule_value

    fz = fz.to(z.dtype)
    a, r = residuals(fz, z)
    nrm = batch_norm(fz) if stats.stop == "batch_fro" else None
    res = float(rule_value(a, r, stats.stop, stats.stop_mode, nrm)) if a.numel() else math.nan
    stats.extra["verified_residual"] = res
    if stats.converged and not res <= VERIFY_SLACK * stats.tol:
        _reject(stats, "recomputed", res)
    return res


def current() -> SolveLedger | None:
    """The open ledger (None outside :func:`solve_ledger`). A solve that may finish in another
    thread (an IFT adjoint solve runs in autograd's device threads on CUDA, where the caller's
    context variables are not set) takes the ledger at forward time and passes it to
    :func:`record`."""
    return _LEDGER.get()


def record(
    kind: str,
    stats: SolverStats,
    max_iter: int | None = None,
    ledger: SolveLedger | None = None,
) -> None:
    """Append a checked solve to ``ledger`` (default: the open one; no-op without one)."""
    ledger = ledger if ledger is not None else _LEDGER.get()
    if ledger is None:
        return
    verified = "verified_residual" in stats.extra
    if verified:
        res = stats.extra["verified_residual"]
    else:  # the value check_claim read, if it read one
        res = stats.extra.get("stop_residual", math.nan)
        res = stop_residual(stats) if res != res else res
    trend = Trend()
    rate = "linear"
    if not stats.converged:
        rate = solver_tags(str(stats.extra.get("registered") or stats.solver)).rate
        trend = solve_trend(stats, rate)
    ledger.records.append(
        SolveRecord(
            kind=kind,
            converged=bool(stats.converged),
            solver_converged=bool(stats.extra.get("solver_converged", stats.converged)),
            residual=float(res),
            stop_mode=stats.stop_mode,
            tol=float(stats.tol),
            status=str(stats.status),
            solver=str(stats.extra.get("registered") or stats.solver),
            nstep=int(stats.nstep),
            max_iter=max_iter,
            verified=verified,
            claim=str(stats.extra.get("claim", "")),
            plateau=trend.plateau,
            stop=str(getattr(stats, "stop", "sample_max")),
            to_tol=trend.to_tol,
            rate=rate,
            power=trend.power,
            own_converged=stats.extra.get("own_converged"),
            own_rule=str(stats.extra.get("own_rule", "")),
        )
    )


#: a solve whose last quarter gained (in log residual) less than this share of what its rate over
#: the steps before predicts has stalled: more steps will not reach the tolerance
STALL_SHARE = 0.25
#: a last quarter that gained less than this (log residual, about 1%) made no progress
MIN_GAIN = 0.01


@dataclass
class Trend:
    """Where an unconverged solve's residual was heading (:func:`solve_trend`)."""

    plateau: bool = False  # the residual stopped falling at its rate: more steps will not help
    to_tol: float = math.nan  # f-evaluations in all its current rate needs to reach tol
    power: float = math.nan  # sublinear: the residual falls as k^-power (NaN: geometric)


def _rule_trace(stats: SolverStats) -> Tensor | None:
    """The trace reduced over the batch by the stop rule (stop mode), float64, or None."""
    tr = stats.rel_trace if stats.stop_mode == "rel" else stats.abs_trace
    if tr.dim() == 0 or tr.numel() == 0:
        return None
    stop = getattr(stats, "stop", "sample_max")
    if stop == "sample_max":
        return tr.reshape(tr.shape[0], -1).amax(dim=1).double()
    from ..solvers.base import rule_value

    ab, rl = stats.abs_trace, stats.rel_trace
    return rule_value(ab.reshape(ab.shape[0], -1), rl.reshape(rl.shape[0], -1), stop,
                      stats.stop_mode).double()  # fmt: skip


def solve_trend(stats: SolverStats, rate: str = "linear") -> Trend:
    """Read the rate of an unconverged solve from its trace (at least 8 steps; one host read).

    With ``m_k`` the lowest residual up to step ``k`` (stop rule, stop mode), ``K`` steps and
    ``b = 3K/4``, the gain of the last quarter, ``g = ln(m_b / m_K)``, is compared with what the
    steps before it predict, read two ways: geometric (a constant factor per step:
    ``ln(m_1 / m_b) (K - b) / (b - 1)``) and as a power of the step (``m_k ~ k^-p``, e.g. a
    Halpern iteration's ``1/k``: ``p ln(K / b)`` with ``p = ln(m_1 / m_b) / ln b``). A last
    quarter that gained under :data:`STALL_SHARE` of both predictions, or under
    :data:`MIN_GAIN`, is a plateau (a precision floor, a cycle, no contraction): more steps
    will not help. Otherwise ``to_tol`` extrapolates the last quarter's own rate to the
    tolerance: ``K + ln(m_K / tol) / (g / (K - b))`` steps where the geometric reading holds and
    the solver does not declare ``rate="sublinear"`` (:class:`deqbench.core.tags.SolverTags`),
    else ``K (m_K / tol)^(1/p)`` with ``p = g / ln(K / b)``."""
    import torch

    t = _rule_trace(stats)
    if t is None or t.shape[0] < 8:
        return Trend()
    m = torch.cummin(t, dim=0).values
    n = int(m.shape[0])
    b = (3 * n) // 4
    m1, mb, mk = float(m[0]), float(m[b - 1]), float(m[n - 1])
    if not (math.isfinite(m1) and math.isfinite(mk) and mk > 0):
        return Trend()
    ref, late = math.log(m1 / mb), math.log(mb / mk)
    geometric = late >= max(MIN_GAIN, STALL_SHARE * ref * (n - b) / max(b - 1, 1))
    powerlike = late >= max(MIN_GAIN, STALL_SHARE * ref * math.log(n / b) / math.log(b))
    if not (geometric or powerlike):
        return Trend(True, math.inf)
    gap = math.log(mk / stats.tol) if stats.tol > 0 else math.inf
    if geometric and rate != "sublinear":
        return Trend(False, n + max(gap, 0.0) / (late / (n - b)))
    p = late / math.log(n / b)
    power = max(gap, 0.0) / p
    return Trend(False, n * math.exp(power) if power < 50 else math.inf, p)


def plateaued(stats: SolverStats, rate: str = "linear") -> bool:
    """Whether an unconverged solve's residual stopped falling at its rate
    (:func:`solve_trend`): more steps will not reach the tolerance."""
    return solve_trend(stats, rate).plateau
