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
of them flags the cell, with a note of at most two short sentences: what missed (how many, by
how much, in which stop mode, under which stop rule where it is not the default
``sample_max``), then the one fix that fits the cause, the device and the solver: the rule the
solves stopped on (their cap, the solver's or the model's own test, a blow-up), read with the
rate of their traces (:func:`deqbench.core.verdict.solve_trend`): raise ``max_iter`` only where
the solver reached it and its residual still fell; TF32 advice only on CUDA.
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
#: a fix that would need more than this many times max_iter is "a faster solver", not "more steps"
RAISE_LIMIT = 20
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
    diverged: int = 0  # missed solves that blew up (non-finite, or far above their start)
    device: str = ""  # the device type the solves ran on ("cuda": TF32 advice applies)
    to_tol: list[float] = field(default_factory=list)  # at the cap, still falling: steps needed
    power: float = float("nan")  # the largest k^-p exponent read from a sublinear trace
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
        elif rec.status == "diverged":
            self.diverged += 1
        elif rec.max_iter is not None and rec.nstep >= rec.max_iter or rec.status == "max_iter":
            self.at_cap += 1
            self.plateau += rec.plateau
            if not rec.plateau and rec.to_tol == rec.to_tol:
                self.to_tol.append(rec.to_tol)
            if rec.power == rec.power and not self.power >= rec.power:
                self.power = rec.power
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

    def _cause(self) -> str:
        """What most missed solves stopped on: claim | diverged | cap | own_rule."""
        counts = {
            "claim": len(self.claims),
            "diverged": self.diverged,
            "cap": self.at_cap,
            "own_rule": sum(self.own_stop.values()),
        }
        return max(counts, key=lambda k: counts[k])  # ties: the order above

    def _fix(self) -> str:
        """The one fix (a sentence) that fits what the missed solves stopped on."""
        key = "solver" if self.kind == "forward" else "backward"
        others = [x for x in ("anderson", "broyden", "fixed_point") if x != self.solver][:2]
        alt = (
            f"try {key}.solver: {others[0]}"
            if self.kind == "adjoint"
            else f"try solver {others[0]}"
        )
        if self.amp == "bf16" and self.tol < BF16_TOL:
            return (f"bf16's relative residual floor is about 4e-3: set {key}.tol >= "
                    f"{BF16_TOL:g} or runtime.amp: none")  # fmt: skip
        cause = self._cause()
        own = self.solver.startswith("own")
        who = "The model's own loop" if own else f"Solver {self.solver}".rstrip()
        steps = f"{min(self.steps, default=0)}-{max(self.steps, default=0)}"
        cap = f" of {self.max_iter}" if self.max_iter else ""
        if cause == "claim":
            return f"The solver's own convergence test is wrong: {alt} or fix the solver"
        if cause == "diverged":
            fix = (
                "damp its update or constrain the model" if own else f"{alt} or constrain the model"
            )
            return f"{who} diverged (its residual blew up): {fix}"
        if cause == "own_rule":
            if own:
                return (f"The model's own loop stopped on its own test after {steps}{cap} steps, "
                        f"above tol: tighten that test (the model's tolerance)")  # fmt: skip
            why = ", ".join(sorted(self.own_stop))
            return (f"{who} stopped by its own rule ({why}) after {steps}{cap} steps: {alt}, "
                    f"or loosen {key}.tol")  # fmt: skip
        raise_cap = f"raise {'its iteration cap' if own else f'{key}.max_iter'}"
        if self.at_cap and self.plateau == self.at_cap:
            if self.worst >= 1e-2:
                why = f"a cycle, or no contraction: {alt} or constrain the model"
            elif self.device == "cuda":
                why = f"a precision floor: set tf32: false or loosen {key}.tol"
            else:
                why = f"a precision floor: loosen {key}.tol or use float64"
            return (
                f"The residual stopped falling before the cap, so more steps will not help ({why})"
            )
        need = max(self.to_tol, default=math.nan)
        rate = f" as k^-{self.power:.2g}" if self.power == self.power else ""
        if need == need and self.max_iter and need > RAISE_LIMIT * self.max_iter:
            steps_needed = "more than 1e9" if not need < 1e9 else f"about {_round_up(need)}"
            pace = rate.strip() or "at its rate"
            return (f"Falling {pace}, the residual needs {steps_needed} steps to reach tol: "
                    f"{'loosen the tolerance' if own else f'{alt} or loosen {key}.tol'}")  # fmt: skip
        target = f" to about {_round_up(need)}" if need == need else ""
        where = " in the model's parameters" if own else ""
        used = f"all {self.max_iter} steps used" if self.max_iter else "its cap reached"
        return f"{raise_cap[0].upper()}{raise_cap[1:]}{target}{where} ({used}, the residual still falling{rate})"

    def note(self) -> str:
        """At most two sentences: what missed, by how much (in the stop mode tested); the fix."""
        what = PHASE_WORDS.get(self.phase, self.phase)
        rule = rule_text(self.stop)
        worst = f"worst {self.stop_mode} residual{rule} {self.worst:.3g}"
        head = (f"{self.kind} solve missed {self.stop_mode} tol {self.tol:g}{rule} in "
                f"{self.missed} of {self.batches} {what} ({100 * self.share:.1f}%")  # fmt: skip
        claim = f"; {self.claims[0]}" if self.claims else ""
        if self.own_rule:  # the library's own verdict, beside deqbench's
            claim += (f"; under its own rule ({self.own_rule}) the library called "
                      f"{self.own_said} of them converged")  # fmt: skip
        if not self.flagged:
            limit = (f" <= {100 * MISSED_SHARE:g}%, not flagged" if self.phase in FLAGGING
                     else ", reported only")  # fmt: skip
            return f"{head}{limit}; {worst}{claim})"
        return f"{head}; {worst}{claim}). {self._fix()}"


def _round_up(n: float) -> str:
    """A step count rounded up to two significant digits (``1234.5`` -> ``1300``)."""
    n = math.ceil(n)
    if n < 100:
        return str(n)
    scale = 10 ** (len(str(n)) - 2)
    return str(-(-n // scale) * scale)


def rule_note(stop: str) -> str:
    """The note of a tally row that met its tolerance under a stop rule other than the default
    (``stop rule batch_fro``; '' for ``sample_max``): the summary shows which rule judged."""
    return "" if stop in ("", "sample_max") else f"stop rule {stop}"


@dataclass
class Tallies:
    """The tallies of a task, by (kind, phase)."""

    amp: str = "none"
    device: str = ""  # the device type the task runs on (for the fix hints)
    by_key: dict[tuple[str, str], SolveTally] = field(default_factory=dict)
    #: the model normalises with BatchNorm and train.precise_bn is off (for the eval hint)
    batchnorm: bool = False

    def get(self, kind: str, phase: str) -> SolveTally:
        key = (kind, phase)
        if key not in self.by_key:
            self.by_key[key] = SolveTally(kind, phase, amp=self.amp, device=self.device)
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
        """One note per kind of solve (forward, adjoint) whose tallies flag the cell (at most
        two sentences: what missed in each phase, the fix of the phase that missed most), then
        :meth:`hints`."""
        out = []
        for kind in dict.fromkeys(t.kind for t in self):
            flagged = [t for t in self if t.kind == kind and t.flagged]
            if len(flagged) == 1:
                out.append(flagged[0].note())
            elif flagged:
                out.append(_merged(flagged))
        return out + self.hints()

    def hints(self) -> list[str]:
        """Causes the tallies point to (a cause-and-fix line each)."""
        out = []
        ev, tr = self.by_key.get(("forward", "eval")), self.by_key.get(("forward", "train"))
        if ev is not None and ev.flagged and self.batchnorm and (tr is None or not tr.flagged):
            out.append(
                "evaluation solves missed, training solves did not: BatchNorm's running "
                "statistics still weigh their initial values. Set train.precise_bn: true"
            )
        return out


def _merged(tallies: list[SolveTally]) -> str:
    """The note of several flagged tallies of one kind: what missed in each phase, then the fix
    of the one with most missed solves."""
    first = tallies[0]
    rule = rule_text(first.stop)
    parts = ", ".join(f"{t.missed} of {t.batches} {PHASE_WORDS.get(t.phase, t.phase)}"
                      for t in tallies)  # fmt: skip
    worst = max((t.worst for t in tallies), key=lambda w: (w != w, w))  # NaN is the worst
    main = max(tallies, key=lambda t: t.missed)
    claim = next((f"; {t.claims[0]}" for t in tallies if t.claims), "")
    own = [t for t in tallies if t.own_rule]
    if own:  # the library's own verdict, beside deqbench's
        claim += (f"; under its own rule ({own[0].own_rule}) the library called "
                  f"{sum(t.own_said for t in own)} of them converged")  # fmt: skip
    return (f"{first.kind} solve missed {first.stop_mode} tol {first.tol:g}{rule} in {parts} "
            f"(worst {first.stop_mode} residual{rule} {worst:.3g}{claim}). {main._fix()}")  # fmt: skip
