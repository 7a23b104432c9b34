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
    plateau: bool = False  # unconverged, and the last quarter of the steps gained < 2x
    stop: str = "sample_max"  # the stop rule the solve was judged under
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
            plateau=not stats.converged and plateaued(stats),
            stop=str(getattr(stats, "stop", "sample_max")),
            own_converged=stats.extra.get("own_converged"),
            own_rule=str(stats.extra.get("own_rule", "")),
        )
    )


def plateaued(stats: SolverStats) -> bool:
    """Whether the residual under the stop rule (stop mode; the batch max by default) gained
    less than 2x over the last quarter of a solve's recorded steps (at least 8): more steps
    will not reach the tolerance (a precision floor, a cycle). Read only for solves that missed
    (one host read)."""
    tr = stats.rel_trace if stats.stop_mode == "rel" else stats.abs_trace
    if tr.dim() == 0 or tr.numel() == 0 or tr.shape[0] < 8:
        return False
    stop = getattr(stats, "stop", "sample_max")
    if stop == "sample_max":
        t = tr.reshape(tr.shape[0], -1).amax(dim=1).double()
    else:
        from ..solvers.base import rule_value

        ab, rl = stats.abs_trace, stats.rel_trace
        t = rule_value(ab.reshape(ab.shape[0], -1), rl.reshape(rl.shape[0], -1), stop,
                       stats.stop_mode).double()  # fmt: skip
    k = (3 * t.shape[0]) // 4
    early, late = float(t[:k].min()), float(t[k:].min())
    return math.isfinite(early) and math.isfinite(late) and late > 0.5 * early
