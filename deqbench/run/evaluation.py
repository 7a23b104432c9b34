"""Evaluation of a model on a data split: loss, accuracy or MSE, and mean DEQ forward stats. The
code lives in :mod:`deqbench.core.evaluation` (below the analysis contract, which calls it);
this module keeps the old import path."""

from ..core.evaluation import converged_share, evaluate, loss_function

__all__ = ["converged_share", "evaluate", "loss_function"]
