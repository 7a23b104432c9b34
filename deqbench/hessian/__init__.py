"""Hessian family: curvature of the loss (math: ``spectrum``, ``estimators``), its analysis
(``analysis``), plots (``plots``) and the ``deqbench hessian`` verb (``cli``).

The public names of :mod:`deqbench.hessian.spectrum` are importable from here
(``deqbench.hessian.HVPOperator``); they are imported on first use, so that the family's CLI verb
(``deqbench.hessian.cli``) imports no torch.
"""

from __future__ import annotations

from .._lazy import face

__getattr__, __dir__ = face(__name__, "deqbench.hessian.spectrum")
