"""Convergence of the forward and adjoint solves as a user sees it.

* :mod:`deqbench.convergence.time_to_tolerance` (analysis ``time_to_tolerance``): per solver,
  wall-clock and f-evaluations against the relative residual, forward and IFT adjoint, every
  solver on the same model and batches; which solver reaches a tolerance first.
* :mod:`deqbench.convergence.path_independence` (analysis ``path_independence``): whether the
  fixed point, the output and the prediction of a model depend on where the solve starts
  (zeros, Gaussian noise of a stated scale, the previous batch's z*).

Both are built-in analyses usable from any suite (``analyses: [time_to_tolerance,
path_independence]``); their figures are drawn by :mod:`deqbench.convergence.plots`.
"""
