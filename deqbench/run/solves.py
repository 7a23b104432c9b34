"""Every solve a reported number rests on is counted: the runner's tallies of DEQ solves.

The runner opens a :func:`deqbench.core.verdict.solve_ledger` around each phase of a task and
adds its records (one per batch solve of a DEQ layer, forward or IFT adjoint, each already
checked against its tolerance and, where recomputed, verified) to a :class:`SolveTally` per
(kind, phase):

* ``train``: the training batches (forward and adjoint solves);
* ``eval``: the evaluation passes after training started (test set every epoch);
* ``init``: the evaluation pass before training (epoch 0) and the analyses' probes before
  training: reported with their own converged fraction, never flagging the cell;
* ``probe``: the analyses' own solves during and after training (e.g. ``solver_stats``'s final
  test pass with gradients, spectral norms at z*).

A tally of a flagging phase whose solves missed tolerance in more than :data:`MISSED_SHARE`
of them flags the cell, with a note that says what missed, by how much, in which stop mode (and
under which stop rule where it is not the default ``sample_max``), and a fix that can work (raise ``max_iter`` only where the solver reached it).
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..core.verdict import SolveRecord, paused_ledger, rule_text, solve_ledger

#: share of a phase's solves allowed to miss the tolerance before a cell is flagged
MISSED_SHARE = 0.01
#: the tightest tolerance advised under bf16 autocast (its relative residual floor is ~4e-3)
BF16_TOL = 1e-2
#: phases whose missed solves flag the cell (``init`` is reported only)
FLAGGING = ("train", "eval", "probe")
#: what each phase's solves are, for notes
PHASE_WORDS = {
    "train": "training batches",
    "eval": "evaluation batches",
    "init": "solves before training",
    "probe": "analysis probe solves",
}


@dataclass
class SolveTally:
    """Solves of one kind (``forward`` | ``adjoint``) in one phase, and those that missed.

    ``worst`` is the largest stop-mode residual (under the stop rule ``stop``) among the solves
    that missed (NaN stays
    worst); ``at_cap`` counts missed solves that used their whole ``max_iter``, ``own_stop`` the
    solver statuses of those that stopped earlier by the solver's own rule; ``claims`` the
    solves whose ``converged`` the runner did not accept."""

    kind: str  # forward | adjoint
    phase: str = "train"
    batches: int = 0
    missed: int = 0
    worst: float = 0.0
    tol: float = float("nan")
    stop_mode: str = "rel"
    stop: str = "sample_max"  # the stop rule the solves were judged under
    solver: str = ""  # the solver that ran (for the fix hint)
    amp: str = "none"  # the runtime's autocast (bf16: the fix is a looser tolerance)
    max_iter: int | None = None
    at_cap: int = 0
    own_stop: Counter = field(default_factory=Counter)
    steps: list[int] = field(default_factory=list)  # nstep of the missed solves
    claims: list[str] = field(default_factory=list)
    verified: int = 0  # solves whose residual was recomputed
    plateau: int = 0  # missed solves at the cap whose residual had stopped falling
    own_rule: str = ""  # a model's own loop: the rule the library stops on
    own_said: int = 0  # missed solves the library's own rule called converged

    def add_record(self, rec: SolveRecord) -> None:
        self.batches += 1
        self.tol, self.stop_mode, self.solver = rec.tol, rec.stop_mode, rec.solver
        self.stop = rec.stop
        if rec.max_iter is not None:
            self.max_iter = rec.max_iter
        self.verified += rec.verified
        if rec.converged:
            return
        self.missed += 1
        if rec.own_rule:
            self.own_rule = rec.own_rule
            self.own_said += bool(rec.own_converged)
        self.steps.append(rec.nstep)
        if self.worst == self.worst and not rec.residual <= self.worst:  # NaN stays worst
            self.worst = rec.residual
        if rec.claim:
            self.claims.append(rec.claim)
        elif rec.max_iter is not None and rec.nstep >= rec.max_iter or rec.status == "max_iter":
            self.at_cap += 1
            self.plateau += rec.plateau
        else:
            self.own_stop[rec.status] += 1

    @property
    def share(self) -> float:
        return self.missed / self.batches if self.batches else math.nan

    @property
    def flagged(self) -> bool:
        return (
            self.phase in FLAGGING
            and self.batches > 0
            and self.missed > MISSED_SHARE * self.batches
        )

    def _fix(self) -> str:
        key = "solver" if self.kind == "forward" else "backward"
        others = [x for x in ("anderson", "broyden", "fixed_point") if x != self.solver][:2]
        alt = (
            f"try another solver ({key}.solver: {' or '.join(others)})"
            if self.kind == "adjoint"
            else f"try another solver (e.g. {others[0]})"
        )
        if self.amp == "bf16" and self.tol < BF16_TOL:
            return (f"bf16's relative residual floor is about 4e-3: set {key}.tol >= "
                    f"{BF16_TOL:g} or runtime.amp: none")  # fmt: skip
        if self.claims:
            return f"the solver's own convergence test is wrong: {alt} or fix the solver"
        fixes = []
        if self.solver.startswith("own"):
            return (f"the model's own solver missed ({self.missed} solves, "
                    f"{min(self.steps, default=0)}-{max(self.steps, default=0)} steps): raise "
                    "its own iteration cap or tolerance in the model's parameters")  # fmt: skip
        if self.at_cap and self.plateau == self.at_cap:
            why = (("a precision floor near the tolerance (on CUDA, TF32 convolutions and "
                    f"matmuls: set tf32: false) or a tol below what the model reaches: loosen "
                    f"{key}.tol or {alt}") if self.worst < 1e-2 else
                   (f"the iteration does not approach a fixed point (a cycle, or no "
                    f"contraction): {alt} or constrain the model"))  # fmt: skip
            fixes.append(f"the residual stopped falling well before max_iter ({self.max_iter}) "
                         f"in all {self.at_cap}, so more steps will not help: {why}")  # fmt: skip
        elif self.at_cap:
            fixes.append(f"raise {key}.max_iter (the solver used all {self.max_iter} steps in "
                         f"{self.at_cap} of them)")  # fmt: skip
        if self.own_stop:
            why = ", ".join(f"{s}" for s in sorted(self.own_stop))
            rng = f"{min(self.steps)}-{max(self.steps)}" if self.steps else "?"
            cap = f" of {self.max_iter}" if self.max_iter else ""
            fixes.append(f"{self.solver or 'the solver'} stopped by its own rule ({why}) after "
                         f"{rng}{cap} steps: {alt}, or loosen {key}.tol")  # fmt: skip
        if not fixes:
            fixes.append(alt)
        return "; ".join(fixes)

    def note(self) -> str:
        """One line: what missed, by how much (in the stop mode tested), and the fix."""
        what = PHASE_WORDS.get(self.phase, self.phase)
        share = f"{self.missed} of {self.batches} {what} ({100 * self.share:.1f}%"
        rule = rule_text(self.stop)
        worst = f"worst {self.stop_mode} residual{rule} {self.worst:.3g}"
        head = f"{self.kind} solve missed {self.stop_mode} tol {self.tol:g}{rule} in {share}"
        claim = f"; {self.claims[0]}" if self.claims else ""
        if self.own_rule:  # the library's own verdict, beside deqbench's
            claim += (f"; under its own rule ({self.own_rule}) the library called "
                      f"{self.own_said} of them converged")  # fmt: skip
        if not self.flagged:
            limit = (f" <= {100 * MISSED_SHARE:g}%, not flagged" if self.phase in FLAGGING
                     else ", reported only")  # fmt: skip
            return f"{head}{limit}; {worst}{claim})"
        return f"{head} > {100 * MISSED_SHARE:g}%; {worst}{claim}): {self._fix()}"


def rule_note(stop: str) -> str:
    """The note of a tally row that met its tolerance under a stop rule other than the default
    (``stop rule batch_fro``; '' for ``sample_max``): the summary shows which rule judged."""
    return "" if stop in ("", "sample_max") else f"stop rule {stop}"


@dataclass
class Tallies:
    """The tallies of a task, by (kind, phase)."""

    amp: str = "none"
    by_key: dict[tuple[str, str], SolveTally] = field(default_factory=dict)
    #: the model normalises with BatchNorm and train.precise_bn is off (for the eval hint)
    batchnorm: bool = False

    def get(self, kind: str, phase: str) -> SolveTally:
        key = (kind, phase)
        if key not in self.by_key:
            self.by_key[key] = SolveTally(kind, phase, amp=self.amp)
        return self.by_key[key]

    def add(self, phase: str, records: list[SolveRecord]) -> None:
        for rec in records:
            self.get(rec.kind, phase).add_record(rec)

    @contextlib.contextmanager
    def counting(self, phase: str, analysis: Any = None) -> Iterator[None]:
        """Count the DEQ solves made inside the block as ``phase``; not at all for an analysis
        that judges its own solves (``Analysis.judges_own_solves``)."""
        if getattr(analysis, "judges_own_solves", False):
            with paused_ledger():
                yield
            return
        with solve_ledger() as led:
            yield
        self.add(phase, led.records)

    def __iter__(self) -> Any:
        return iter(self.by_key.values())

    def flags(self) -> list[str]:
        """The notes of the flagged tallies, then :meth:`hints`."""
        return [t.note() for t in self if t.flagged] + self.hints()

    def hints(self) -> list[str]:
        """Causes the tallies point to (a cause-and-fix line each)."""
        out = []
        ev, tr = self.by_key.get(("forward", "eval")), self.by_key.get(("forward", "train"))
        if ev is not None and ev.flagged and self.batchnorm and (tr is None or not tr.flagged):
            out.append(
                "training solves converged but evaluation solves did not: eval mode normalises "
                "with BatchNorm running statistics, which after few steps still weigh their "
                "initial values; set train.precise_bn: true (recomputed over the training set) "
                "or train longer"
            )
        return out
