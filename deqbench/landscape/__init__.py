"""Loss-landscape family: surfaces and curves around the trained weights (math: ``surface``,
``directions``), its analysis (``analysis``), plots (``plots``) and the ``deqbench landscape`` verb
(``cli``).

The public names of :mod:`deqbench.landscape.surface` are importable from here
(``deqbench.landscape.landscape``); they are imported on first use, so that the family's CLI verb
(``deqbench.landscape.cli``) imports no torch.
"""

from __future__ import annotations

from .._lazy import face

__getattr__, __dir__ = face(__name__, "deqbench.landscape.surface")
