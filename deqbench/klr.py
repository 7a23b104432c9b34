"""Public face of :mod:`deqbench.kglm.klr` (kernel logistic regression of the KGLM family):
plugins, scripts and the docs import ``deqbench.klr``; the code lives in
``deqbench/kglm/klr.py``."""

from .kglm.klr import (  # noqa: F401 - re-exported
    KLRResult,
    fit_klr,
    klr_objective,
)
