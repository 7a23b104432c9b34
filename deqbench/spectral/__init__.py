"""Spectral family: spectral norms of convolutions and Jacobians (math: ``norms``) and the
``spectral`` analysis (``analysis``, with its plots).

The public names of :mod:`deqbench.spectral.norms` are importable from here
(``deqbench.spectral.conv_spectral_norm``); they are imported on first use, so that importing
the package imports no torch.
"""

from __future__ import annotations

from .._lazy import face

__getattr__, __dir__ = face(__name__, "deqbench.spectral.norms")
