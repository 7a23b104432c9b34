"""Reproductions that test the source papers' own claims.

* :mod:`.claims`: the claim table (:data:`CLAIMS`, one :class:`Claim` per claim of papers
  001-004: where in the paper, the paper's value, the suite, the checker, the scale) and
  :data:`DIFFERS_FROM_OURS` (where our earlier expectations differ from the papers).
* :mod:`.checks`: one checker per claim, plain measured values in, a :class:`Verdict` out
  (``reproduced`` / ``not reproduced`` / ``not run``, a reason, the measured value beside the
  paper's), and the shared trend rule :func:`seed_trend` (median of >= 3 seeds, beyond the seed
  spread).

Pure Python, no torch: extracting the measured values from run directories and the
``deqbench reproduce`` command build on these.

Example:
    >>> from deqbench.reproduce import CHECKERS, CLAIMS
    >>> all(c.check in CHECKERS for c in CLAIMS)
    True
"""

from __future__ import annotations

from .checks import CHECKERS, VERDICTS, Trend, Verdict, seed_trend
from .checks.p004_ntk import Sweep
from .claims import CLAIMS, DIFFERS_FROM_OURS, PAPERS, Claim, claim, claims_of

__all__ = [
    "CHECKERS",
    "CLAIMS",
    "DIFFERS_FROM_OURS",
    "PAPERS",
    "VERDICTS",
    "Claim",
    "Sweep",
    "Trend",
    "Verdict",
    "claim",
    "claims_of",
    "seed_trend",
]
