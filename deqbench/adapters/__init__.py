"""Adapter helpers: bring a third-party equilibrium network to deqbench in a few lines.

Two ways to adapt a network that computes its equilibrium with its own code:

* keep its own fixed-point loop and let deqbench *measure* it: :class:`OwnLoop` (or the context
  manager :func:`track_loop` inside a model of your own) intercepts every call of the map during
  a forward and turns them into a full :class:`~deqbench.solvers.base.SolverStats` (f-evaluations,
  per-sample residual traces, the returned iterate's residual, converged/status), reported through
  the own-solver hook ``last_solve_stats()`` (:class:`deqbench.contracts.OwnSolverModel`);
* let deqbench *solve* it: :func:`cell_from_method` makes a deqbench cell ``f(z, u)`` from one
  method (or submodule) of the network, holding only the map's submodules as its parameters,
  for a :class:`deqbench.deq.DEQLayer` (every solver and backward mode then applies).

**What** :class:`OwnLoop` **measures.** For each call of the map ``F(X, *args)`` (``X``: its
first positional argument, a tensor or a dict / tuple / dataclass of tensors; ``z``: the state
``state=`` reads from it, :mod:`deqbench.core.trees`; the output of the same form, or for a
tensor ``X`` a tuple whose first element is the next iterate, its state shaped like ``z``): the
per-sample ``abs = ||F(z) - z||`` and ``rel = abs / ||F(z)||``
(:func:`deqbench.solvers.base.residuals`) *of the call's input* ``z``. The calls that are
iterations of the loop (below) give ``nstep`` and the traces (row ``t``: the residual of the
``t``-th iterate the loop evaluated the map at). ``abs_residual``/``rel_residual``, hence
``converged`` (every sample finite and below ``tol`` in ``stop_mode``) and ``status``
(``converged``; ``diverged`` when a residual of the loop is not finite or its batch max abs
residual rose above :data:`~deqbench.adapters.own_loop.DIVERGE_FACTOR` times the first
iterate's, as a built-in solver's blow-up; ``stagnated`` when the loop stopped before
``max_iter`` without converging; else ``max_iter``) are those of the iterate the loop
*returned*, ``z_ret``, which is:

* with ``loop=`` (the network's method or submodule that runs the loop): its return value,
  read by ``returned=`` (default: the value, else its first element, whose state has the
  iterates' shape; one that cannot be read is an :class:`OwnLoopError`, [model.own_loop]). Its
  residual is that of the first map call whose input is
  ``z_ret`` (same storage, or equal values: the last iteration's input, or the input of the step
  a Jacobian-free backward applies after the loop); when no call evaluated the map at ``z_ret``
  (a loop that returns ``F(z)`` or a damped update and makes no step after it), the map is
  evaluated once more at ``z_ret`` under no_grad, with the arguments of the last iteration:
  counted in ``extra["check_evals"]``, not in ``nstep``;
* without it: the input of the first map call after the last iteration (the step with gradient
  of a Jacobian-free backward is applied to the returned iterate), else the input of the last
  iteration.

``extra["returned"]`` says which it was; ``extra["max_iter"]`` is the loop's cap,
``extra["map_calls"]`` every call of the map in the forward, ``extra["calls_after_loop"]``
(with ``loop=``) those after the loop. With ``stop=`` (the library's own stop rule) the
library's verdict is ``extra["own_converged"]``; ``converged`` follows the run's rule
(:func:`deqbench.core.own_solves.judged_under`). ``adjoint=``:class:`OwnBackward` measures the
network's own adjoint solve too (:mod:`.own_backward`). The residual of ``z_ret`` may
differ from what the network's own stopping test measured (e.g. a loop that tests ``z`` and
returns ``F(z)``): deqbench judges the iterate that is returned.

The map (and ``loop``) is intercepted for the forward only: a submodule through forward hooks,
a method through a wrapper set on the instance, which sees calls made as ``self.f(...)`` (not
``type(self).f(self, ...)``). With ``loop``, the stats describe its last run in the forward.

**Which calls are iterations** (the rest, e.g. the Jacobian-free step with gradient, are not
counted in ``nstep``):

* ``loop="find_fixed_point"``: the calls made inside that method (or submodule) of the network,
  in any grad mode; exact, in training and evaluation alike (preferred);
* ``after=k``: all calls of the forward but the last ``k`` (a JFB step: ``after=1``);
* neither (default): the calls made with gradient disabled (a loop under ``torch.no_grad()``
  followed by a step with gradient). Under an enclosing ``no_grad`` (evaluation) every call has
  gradient disabled, so the step after the loop counts as one more iteration there: give
  ``loop`` or ``after`` for the same count in training and evaluation.

Example (a network with its own loop under no_grad and a Jacobian-free step with gradient):
    >>> import torch
    >>> from torch import nn
    >>> class Net(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.stem, self.lin, self.tol = nn.Linear(3, 4), nn.Linear(4, 4), 1e-6
    ...     def f(self, z, x):                         # the map
    ...         return torch.tanh(0.5 * self.lin(z) + x)
    ...     def forward(self, x):
    ...         u, z = self.stem(x), torch.zeros(x.shape[0], 4)
    ...         with torch.no_grad():
    ...             for _ in range(100):
    ...                 z_new = self.f(z, u)
    ...                 if ((z_new - z).norm(dim=1) <= self.tol * z_new.norm(dim=1)).all():
    ...                     break
    ...                 z = z_new
    ...         return self.f(z, u)                    # one step with gradient (JFB)
    >>> _ = torch.manual_seed(0)
    >>> model = OwnLoop(Net(), map="f", tol="tol", after=1, solver_name="picard")
    >>> st = model(torch.randn(2, 3)).sum().backward() or model.last_solve_stats()
    >>> st.converged, st.nstep == st.rel_trace.shape[0], st.extra["returned"]
    (True, True, 'input of the call after the loop')
    >>> cell = cell_from_method(model.net, "f", uses=["lin"])   # or let deqbench solve it
    >>> sorted(n for n, _ in cell.named_parameters())
    ['lin.bias', 'lin.weight']
"""

from .method_cell import MethodCell, cell_from_method
from .own_backward import AdjointRecord, OwnBackward
from .own_loop import LoopRecord, OwnLoop, OwnLoopError, track_loop

__all__ = [
    "AdjointRecord",
    "LoopRecord",
    "MethodCell",
    "OwnBackward",
    "OwnLoop",
    "OwnLoopError",
    "cell_from_method",
    "track_loop",
]
