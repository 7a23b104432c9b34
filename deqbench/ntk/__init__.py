"""NTK family: the empirical NTK of a DEQ (math: ``empirical``, ``engine``, ``gram``), its
analysis (``analysis``), plots and the ``deqbench ntk`` verb (``cli``).

The public names of :mod:`deqbench.ntk.empirical` are importable from here
(``deqbench.ntk.empirical_ntk``); they are imported on first use, so that the family's CLI verb
(``deqbench.ntk.cli``) imports no torch.
"""

from __future__ import annotations

from .._lazy import face

__getattr__, __dir__ = face(__name__, "deqbench.ntk.empirical")
