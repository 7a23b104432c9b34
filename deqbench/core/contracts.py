"""The plugin contracts: what deqbench asks of a model, solver, init, analysis or dataset.

Every contract is a :class:`typing.Protocol`; its docstring is the reference, the way pytest
documents its hookspecs. Built-ins and plugins follow the same contracts, and
``deqbench validate`` (and ``deqbench run``, before it starts) checks them for every model and
solver a suite names (:mod:`deqbench.run.plugin_checks`). A check that fails prints one line naming
the distribution, the entry point and the clause, e.g.::

    plugin my-deq 0.1.0: solver 'my_solver' (my_deq.solvers:my_solver): [solver.returns]
    returned a Tensor, not (z, SolverStats)

The clauses (:data:`CLAUSES`) are written in brackets in the docstrings below.
``docs/plugins.md`` renders this module (:func:`reference_markdown`) after a worked example.

A plugin is an installed distribution declaring entry points in the groups ``deqbench.models``
(:class:`ModelFactory`), ``deqbench.solvers`` (:class:`Solver`), ``deqbench.inits``
(:class:`Init`), ``deqbench.analyses`` (:class:`AnalysisPlugin`), ``deqbench.datasets``
(:class:`DatasetLoader`) and ``deqbench.backward`` (:class:`BackwardModePlugin`).
``deqbench new-plugin NAME`` writes a package that follows them.

Example:
    >>> import deqbench, torch
    >>> from deqbench.contracts import Solver, MonotoneCell
    >>> isinstance(deqbench.solvers.get("anderson"), Solver)
    True
    >>> isinstance(deqbench.models.create("mondeq_fc_tiny").deq.cell, MonotoneCell)
    True
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from torch import Tensor, nn

from .weights import cell_weights, injection_parameters  # noqa: F401 - re-exported

if TYPE_CHECKING:  # pragma: no cover
    from ..analyses.base import CellContext, EpochInfo, Row, StepInfo
    from ..data.base import DataBundle
    from ..solvers.base import SolverStats
    from .deq import DEQLayer

#: Clause id -> the rule, one line. ``deqbench validate`` cites the id of what it found broken.
CLAUSES: dict[str, str] = {
    "model.import": "the entry point imports and names a callable",
    "model.factory": "fn(in_shape=..., num_outputs=..., **params) accepts in_shape and "
    "num_outputs as keywords and returns an nn.Module",
    "model.forward": "model(x) on a batch of 2 inputs of in_shape returns a tensor of 2 rows of "
    "num_outputs values each",
    "model.cell": "each DEQLayer's cell is an nn.Module whose forward(z, u) keeps z's shape",
    "model.cell_pure": "an f-evaluation (the cell's forward under no_grad, in training mode) "
    "changes no buffer of the model (e.g. no BatchNorm running statistics inside the cell)",
    "model.own_loop": "a model's own loop measured by deqbench (deqbench.adapters.OwnLoop): "
    "its map's iterate and the value its loop returns can be read (state=, returned=)",
    "model.declared": "the model's declaration (declare_defaults) admits the cell's solver and "
    "backward mode",
    "model.solve_stats": "a model without DEQ layers that has last_solve_stats() returns, after "
    "its forward, a SolverStats or a dict with nstep, tol and rel_residual or abs_residual",
    "solver.import": "the entry point imports and names a callable",
    "solver.signature": "solve(f, z0, *, max_iter, tol, stop_mode='rel', **options)",
    "solver.returns": "returns a 2-tuple (z, SolverStats) with z shaped like z0",
    "solver.stats": "SolverStats: int nstep in [1, max_iter]; abs/rel residual (B,); abs/rel "
    "trace (T, B) with T <= nstep; status in converged|max_iter|diverged|stagnated, "
    "converged == (status == 'converged')",
    "solver.progress": "with default options, on a 0.5-contraction (or deqbench's monotone "
    "cell), returns within 100 f-evaluations an iterate whose residual is below half that of z0",
    "solver.structure": "a solver with needs_structure runs on deqbench's own monotone cell "
    "(forward and adjoint)",
    "structure.cell": "a solver with needs_structure only runs on models whose every cell "
    "implements its structure (e.g. MonotoneCell)",
    "init.call": "init(model, *, seed, **params) modifies the model in place and returns None",
    "dataset.import": "the entry point imports and names a callable",
    "dataset.load": "loader(**params) returns a deqbench.data.base.DataBundle: train and test "
    "(x, y) tensor pairs, in_shape a tuple of ints, num_outputs a positive int, task "
    "classification or regression",
    "dataset.declared": "a declared loader.shape(params) returns (in_shape, num_outputs): a "
    "tuple of positive ints and a positive int",
}


def clause(cid: str) -> str:
    """``[cid]`` (the clause must exist in :data:`CLAUSES`)."""
    if cid not in CLAUSES:
        raise KeyError(cid)
    return f"[{cid}]"


# -- models ----------------------------------------------------------------------------------


@runtime_checkable
class ModelFactory(Protocol):
    """A registered model: the callable an entry point of ``deqbench.models`` names.

    ``fn(in_shape, num_outputs, **params) -> nn.Module`` [model.factory]. The runner fills
    ``in_shape`` (one sample's shape, e.g. ``(1, 8, 8)`` or ``(64,)``) and ``num_outputs``
    (classes, or regression outputs) from the dataset; a suite may not set them. Every other
    keyword is a model parameter a suite may set (``model: {name: my_deq, width: 32}``): the
    schema checks them against the signature, so name them (``**kwargs`` disables the check).

    The model it returns is either

    * a DEQ (:class:`EquilibriumModel`): it holds :class:`deqbench.deq.DEQLayer` modules, the
      runner configures their solver and backward mode from the suite, and every solver,
      backward mode and analysis applies; or
    * any other ``nn.Module`` (an explicit network, or a *wrapped* model whose equilibrium is
      computed by third-party code): it trains and is measured by the analyses that only need
      ``model(x)``; the suite's solver and backward mode do not reach it. A wrapped model that
      runs its own fixed-point loop reports each solve through ``last_solve_stats()``
      (:class:`OwnSolverModel`), so that its convergence is measured and checked like a DEQ
      layer's; without it, its cells say ``solver=not measured``.

    Optional attributes of the factory:

    * ``deqbench_defaults``: set by :func:`deqbench.models.declare_defaults` (the forward solver,
      backward mode and init under which the model converges; the solvers it supports and the
      backward modes that apply; for a model that runs its own solver, ``solvers=()`` or the
      names ``own_solver``/``own_backward``). Fields a suite leaves unset come from it
      [model.declared].
    * ``wraps = True``: it is also a :class:`Wrapper`.

    What deqbench assumes of the model, and no more: ``model(x)`` on a batch ``(B, *in_shape)``
    returns ``(B, num_outputs)`` or, for a regression whose targets are image-shaped, a tensor
    shaped like the targets (``(B, C, H, W)``, ``C H W = num_outputs``: the squared loss, PSNR
    and SSIM compare them); the model survives ``copy.deepcopy`` (analyses measure copies:
    ``throughput``'s train step, gradient references). It need not pickle (a model holding
    lambdas is measured in process where a fresh worker would need a pickle, the row's note
    saying so), and its buffers may change shape between batches (a measurement restores them
    as they were, re-registered when their shape changed).

    Checked by ``deqbench validate``: the factory is called with ``in_shape``/``num_outputs`` and
    the suite's params [model.factory], the model runs a forward pass on a batch of 2 on CPU
    [model.forward], its cells keep z's shape [model.cell] and their f-evaluations change no
    buffer [model.cell_pure] (each cell is called on its layer's (u, z0) before it solves).

    Example:
        >>> import math
        >>> from deqbench.models import declare_defaults
        >>> @declare_defaults(solver={"name": "anderson", "max_iter": 50, "tol": 1e-4},
        ...                   backward={"name": "ift", "solver": "anderson", "tol": 1e-5})
        ... def my_deq(in_shape=(64,), num_outputs=10, width=32):
        ...     ...   # return MyDEQ(math.prod(in_shape), width, num_outputs)
    """

    def __call__(self, *, in_shape: tuple[int, ...], num_outputs: int, **params: Any) -> nn.Module:
        """Build the model (on CPU, default dtype; the runner moves and casts it)."""
        ...


@runtime_checkable
class Cell(Protocol):
    """The map of a DEQ layer: ``z_next = cell(z, u)`` (an ``nn.Module``) [model.cell].

    ``forward(z, u)`` returns a tensor of z's shape; ``u`` is the injection (what
    :meth:`EquilibriumModel.inject` returned). It must be a pure function of (z, u) and its
    parameters: solvers call it many times, backward modes differentiate it with
    ``torch.func`` (parameters bound by ``functional_call``), so no in-place updates of its
    parameters or buffers inside ``forward`` [model.cell_pure]: e.g. no BatchNorm in training
    mode inside the map (its running statistics would move on every f-evaluation; use
    GroupNorm/LayerNorm, or keep BatchNorm outside the cell). A cell over a method of a
    third-party network: :func:`deqbench.adapters.cell_from_method`.

    The cell's parameters are "the cell weights": the ``normal``/``small``/``spectral`` inits
    rescale its weight tensors, ``spectral`` and ``landscape`` report their norms, the IFT
    backward differentiates them. A cell that also holds the injection layer (common in
    third-party code) says which parameters those are with ``injection_parameters()``.

    Optional methods:

    * ``injection_parameters() -> list[nn.Parameter]``: the parameters of the cell module that
      belong to the injection ``u = U x`` rather than to the map in z (default: none).
    * ``lipschitz_bound() -> float``: an upper bound of the cell's Lipschitz constant in z
      (the ``spectral`` analysis uses it instead of the product of layer norms).
    """

    def forward(self, z: Tensor, u: Tensor) -> Tensor: ...

    def parameters(self, recurse: bool = True) -> Iterable[nn.Parameter]: ...


@runtime_checkable
class EquilibriumModel(Protocol):
    """A DEQ model: ``readout(deq(inject(x), z0(u)))``. Subclass :class:`deqbench.deq.DEQModel`.

    * ``deq``: a :class:`deqbench.deq.DEQLayer` around a :class:`Cell`, set in ``__init__``
      (``self.deq = DEQLayer(MyCell(width))``). Models with several equilibrium layers hold
      several DEQLayers and override ``forward``; every DEQLayer gets the suite's solver.
    * ``inject(x) -> u``: the input injection, outside the solve (computed once per batch).
    * ``readout(z) -> y``: from the equilibrium to the outputs (``(B, num_outputs)``, or the
      targets' image shape ``(B, C, H, W)`` for an image regression).
    * ``z0(u) -> z``: the initial iterate (default zeros like ``u``).
    * ``spectral_quantities()`` (optional, :class:`SpectralQuantities`).

    The layer solves under ``no_grad`` with the configured solver and records
    ``last_forward_stats`` (and ``last_backward_stats`` for ``ift``), which the analyses read.
    """

    deq: DEQLayer

    def inject(self, x: Tensor) -> Tensor: ...

    def readout(self, z: Tensor) -> Tensor: ...

    def z0(self, u: Tensor) -> Tensor: ...


@runtime_checkable
class OwnSolverModel(Protocol):
    """A model without DEQ layers whose forward runs its own fixed-point loop (a wrapped
    third-party DEQ), reporting what that loop did. Optional, but without it deqbench cannot see
    the model's solves: its cells say ``solver=not measured`` and ``solver_stats`` is skipped.

    * ``last_solve_stats() -> SolverStats | dict | None``: the forward solve of the last
      ``model(x)`` [model.solve_stats]. Either a :class:`deqbench.solvers.base.SolverStats`
      (e.g. from :func:`deqbench.solvers.base.make_stats`, with ``tol`` and ``stop_mode`` set)
      or a plain dict, so the plugin need not import deqbench:

      * ``nstep`` (required): iterations (f-evaluations) the loop made;
      * ``tol`` (required): the tolerance its stopping test used;
      * ``rel_residual`` and/or ``abs_residual`` (at least one): the residual of the iterate the
        loop returned, a float (batch max) or a (B,) tensor; deqbench's residual is
        ``||f(z) - z||`` (rel: divided by ``||f(z)||``), else say what the loop measures in
        your docs;
      * optional: ``stop_mode`` ("rel" or "abs": which residual its test used; default rel if
        given), ``converged`` (default: that residual is below ``tol``), ``status``
        (converged, max_iter, diverged, stagnated), ``max_iter`` (its own cap), ``rel_trace``
        / ``abs_trace`` (the residual after each iteration, (T,) or (T, B)), ``njvp``,
        ``extra``.

      Unknown keys, a missing required key or a bad value are an error naming the model and
      the hook. The claimed ``converged`` is checked against the reported residual and
      ``tol``. None means no solve ran.
    * ``last_backward_solve_stats() -> SolverStats | dict | None`` (optional): the backward
      (adjoint) solve the model ran itself in the last backward pass, the same way; reset it
      to None at each forward, so that a forward without gradient reports none.
    * ``solver_name`` (optional class attribute): the cells' ``solver`` column says
      ``own:<solver_name>`` (``own`` without it); ``backward_name``: the ``backward`` column
      says ``own:<backward_name>`` (``own`` without it). Declare the same names on the factory
      (``declare_defaults(own_solver=..., own_backward=...)``) so that cells are named before
      the model is built.

    :class:`deqbench.adapters.OwnLoop` adds the hook to a network without touching its code:
    it intercepts the map its loop calls and reports every f-evaluation, the residual traces
    and the returned iterate's residual (and, with ``adjoint=``, the network's own adjoint
    solve). Its map's iterate (a tensor, or a dict / tuple / dataclass of tensors: ``state=``)
    and the value its loop returns (``returned=``) can be read [model.own_loop]; a call of its
    map changes no buffer of the model [model.cell_pure] (checked on its second iteration).

    Each solve is read after every forward (and own backward) and counts like a DEQ layer's:
    training, evaluation and the analyses' passes report its f-evaluations and residuals
    (``solver_stats``), and a cell whose solves miss their tolerance is flagged. A model with
    DEQ layers reports through them; the hook is not read.

    Example:
        >>> import torch
        >>> class Net(torch.nn.Module):
        ...     solver_name = "picard"
        ...     def __init__(self, width=8, max_iter=100, tol=1e-4):
        ...         super().__init__()
        ...         self.W, self.max_iter, self.tol = torch.nn.Linear(width, width), max_iter, tol
        ...         self.stats = None
        ...     def forward(self, x):
        ...         z, trace = torch.zeros_like(x), []
        ...         with torch.no_grad():
        ...             for k in range(1, self.max_iter + 1):
        ...                 fz = torch.tanh(self.W(z) + x)
        ...                 trace.append(float((fz - z).norm() / fz.norm()))  # z's residual
        ...                 if trace[-1] < self.tol:
        ...                     break
        ...                 z = fz
        ...         self.stats = {"nstep": k, "rel_residual": trace[-1], "tol": self.tol,
        ...                       "max_iter": self.max_iter, "rel_trace": trace}
        ...         return torch.tanh(self.W(z) + x)   # one step with gradient
        ...     def last_solve_stats(self):
        ...         return self.stats
    """

    def last_solve_stats(self) -> SolverStats | dict[str, Any] | None:
        """The last forward solve: a SolverStats, a dict (nstep, tol, rel_residual and/or
        abs_residual; optional keys above) or None when none ran."""
        ...


@runtime_checkable
class SpectralQuantities(Protocol):
    """A model (or cell) with family-specific spectral quantities.

    ``spectral_quantities() -> dict[str, float]``: the ``family_stats`` analysis writes every
    key per epoch and ``spectral`` after training; a key ``metric/variant`` is split into
    metric and variant (``"sigma_max/layer0"``). Called under no_grad on the trained model,
    on the run's device; keep it cheap (it runs once per epoch). monDEQ gives
    ``lambda_max_sym_W``, ``lipschitz_I_minus_W``, ``fb_alpha_bound``, ``monotonicity_gap``;
    pcDEQ ``sigma_max/layer<i>``. A value that cannot be formed is NaN, never a placeholder
    such as 0 or 1.
    """

    def spectral_quantities(self) -> dict[str, float]: ...


@runtime_checkable
class Wrapper(Protocol):
    """A model factory that also converts an already built model: ``fn(wrap=model)`` returns
    ``model`` whose DEQ layers run on another implementation, parameters shared, and
    ``fn.wraps = True``.

    The ``backward`` analysis uses it to compare implementations on the same trained cell
    (``modes: [{name: ift, wrapper: torchdeq_deq}]``; ``examples/deqbench-torchdeq``).
    Without ``wraps`` the analysis skips the mode with a note.
    """

    wraps: bool

    def __call__(self, *, wrap: nn.Module, **params: Any) -> nn.Module: ...


# -- solvers ---------------------------------------------------------------------------------


@runtime_checkable
class ForwardMap(Protocol):
    """What a solver receives as ``f`` in a forward solve (:class:`deqbench.deq.CellMap`).

    ``f(z)`` is ``cell(z, u)``; ``f.cell`` is the layer's cell (the solver may read its
    structure, e.g. :class:`MonotoneCell`) and ``f.u`` the injection. Generic solvers only
    call it.
    """

    cell: nn.Module
    u: Tensor

    def __call__(self, z: Tensor) -> Tensor: ...


@runtime_checkable
class AdjointMap(Protocol):
    """What the IFT backward hands the adjoint solver (:class:`deqbench.core.backward.AdjointMap`).

    ``f(w) = J^T w + g`` with J = d cell / dz at ``f.z`` (z*), so the fixed point is the
    adjoint ``w = (I - J^T)^-1 g``; also ``f.cell``, ``f.u``, ``f.g``. The forward solver
    contract is reused unchanged: any registered solver can be the adjoint solver
    (``backward: {name: ift, solver: anderson}``). A structured solver may solve the linear
    system its own way but returns the same ``w``. For a double backward (Hessians) the tangent
    system ``v = J v + c`` is handed over as a plain callable, without ``cell``: a solver with
    ``needs_structure`` is replaced by Anderson there.
    """

    cell: nn.Module
    z: Tensor
    u: Tensor
    g: Tensor

    def __call__(self, w: Tensor) -> Tensor: ...


@runtime_checkable
class Solver(Protocol):
    """A fixed-point solver: the callable an entry point of ``deqbench.solvers`` names.

    ``solve(f, z0, *, max_iter, tol, stop_mode="rel", **options) -> (z, SolverStats)``
    [solver.signature].

    Args:
        f: the map (:class:`ForwardMap` in a forward solve, :class:`AdjointMap` as an adjoint
            solver, or a plain callable), batched over dim 0: ``(B, ...) -> (B, ...)``.
            ``f`` must be evaluated only on iterates; each call is one f-evaluation.
        z0: the initial iterate (B, ...). Called under ``torch.no_grad``.
        max_iter: the most f-evaluations allowed.
        tol, stop_mode: stop when the batch max of the residual of the returned iterate is
            below ``tol``; ``stop_mode`` "rel" (``||f(z) - z|| / ||f(z)||`` per sample) or "abs"
            (``||f(z) - z||``). Norms over every non-batch dim; divide by ``||f(z)|| + 1e-9``.
        **options: the solver's own options from the suite (``solver: {name: s, m: 5}``).
            Declare them as a pydantic model with ``@deqbench.solvers.base.solver(Options)``:
            suites are checked against it before anything runs, unknown options are an error
            naming them [solver.options], and the solver gets the validated ``opts`` (a plain
            function may instead reject unknown ones with ``check_options`` and declare an
            ``OPTIONS`` set of names).

    Returns:
        ``(z, stats)`` [solver.returns]: z shaped like z0 (the iterate whose residual was
        measured, not one step past it) and a :class:`deqbench.solvers.base.SolverStats`
        [solver.stats] with

        * ``nstep``: every f-evaluation made, ``1 <= nstep <= max_iter``;
        * ``abs_residual``, ``rel_residual``: (B,) residuals of the returned z;
        * ``abs_trace``, ``rel_trace``: (T, B), one row per measured iterate (T <= nstep, no
          sentinel rows, no padding);
        * ``status``: "converged", "max_iter", "diverged" (non-finite or blown-up residual:
          return, never raise) or "stagnated"; ``converged`` is ``status == "converged"``;
        * ``solver``, ``tol``, ``stop_mode``: what was asked; ``lowest_step``: the trace row of z.

        A :class:`deqbench.solvers.base.Tracker` records each measured iterate
        (``record(z, fz)``), applies the stop rule (``stop()``) and builds the stats
        (``finish(nstep)``); :func:`deqbench.solvers.base.make_stats` builds them from lists of
        (B,) residuals for a solve someone else ran.

    Optional attributes:

    * ``Options`` (set by ``@solver``): the pydantic options model; ``OPTIONS``: the set of
      option names (also accepted as a module-level ``OPTIONS``);
    * ``supports_cuda_graph`` (``@solver(Options, cuda_graph=True)``): the solver can replay
      one captured CUDA-graph step (options ``cuda_graph``, ``graph_steps``).
    * ``needs_structure``: True when the solver reads the monotone structure of ``f.cell``
      (:class:`MonotoneCell`), or a runtime-checkable Protocol class the cell must implement
      [structure.cell]; such a solver must accept both a :class:`ForwardMap` and an
      :class:`AdjointMap` [solver.structure].
    * ``unroll(f, z0, k, **options) -> (z, abs_trace, rel_trace)``: a differentiable k-step
      iteration that the ``unrolled`` backward mode uses instead of plain iteration.
    * ``tags`` (``@solver(Options, tags={"rate": "sublinear"})``): a
      :class:`deqbench.core.tags.SolverTags` (or a dict of its fields): ``rate`` is
      "superlinear", "linear" (default) or "sublinear" (the residual falls as a power of the
      step, e.g. Halpern's 1/k). The diagnosis of a solve that missed its tolerance reads its
      trace at that rate, and the project's registry-driven tests hold a sublinear solver to
      progress, not to a tight tolerance.

    Checked by ``deqbench validate`` on a small contraction (forward and adjoint maps): the
    return value and stats above, and that it makes progress [solver.progress].
    """

    def __call__(
        self,
        f: Callable[[Tensor], Tensor],
        z0: Tensor,
        *,
        max_iter: int,
        tol: float,
        stop_mode: str = "rel",
        **options: Any,
    ) -> tuple[Tensor, SolverStats]: ...


# -- structured cells: the monotone splitting protocol ---------------------------------------


@dataclass
class SplittingOps:
    """Linear operators of a monotone cell, prepared once per solve (weights fixed).

    Attributes:
        W, WT: x -> W x and x -> W^T x.
        V, VT: x -> (I + alpha (I - W))^-1 x and its transpose (None when alpha is None).
    """

    W: Callable[[Tensor], Tensor]
    WT: Callable[[Tensor], Tensor]
    V: Callable[[Tensor], Tensor] | None = None
    VT: Callable[[Tensor], Tensor] | None = None


@runtime_checkable
class MonotoneCell(Protocol):
    """A cell ``f(z, u) = prox(W z + u)`` with ``sym(I - W) >= m I``: what the splitting solvers
    ``forward_backward`` and ``peaceman_rachford`` (``needs_structure = True``) need
    [structure.cell]. Winston & Kolter 2020; deqbench's ``mondeq_*`` cells implement it.

    ``prox`` is the projection onto a closed convex set whose derivative ``prox_mask`` is 0/1
    (ReLU; ReLU with a zeroed border frame for circular convolutions). The cell's own
    ``forward(z, u)`` must equal ``prox(W z + u)``: generic solvers and every backward mode use
    ``forward``, the splitting solvers use the methods below, and both must agree.

    Attributes:
        m: the monotonicity margin (``I - W >= m I``, m > 0).
    """

    m: float

    def prox(self, x: Tensor) -> Tensor:
        """The proximal operator (projection), elementwise; same shape as x."""
        ...

    def prox_mask(self, x: Tensor) -> Tensor:
        """d prox / dx at x as a 0/1 tensor of x's shape (the adjoint's projection D)."""
        ...

    def splitting_ops(self, alpha: float | None = None) -> SplittingOps:
        """W, W^T and, for alpha not None, the resolvent V = (I + alpha (I - W))^-1 and V^T,
        built once from the current weights (under no_grad; Peaceman-Rachford calls it with its
        alpha, forward-backward with None)."""
        ...

    def lipschitz(self) -> float:
        """||I - W||_2 (for the forward-backward step bound 2m / ||I - W||^2)."""
        ...

    def monotonicity(self) -> float:
        """lambda_max((W + W^T) / 2); at most 1 - m."""
        ...


# -- inits and analyses ----------------------------------------------------------------------


@runtime_checkable
class Init(Protocol):
    """An initialisation: the callable an entry point of ``deqbench.inits`` names.

    ``init(model, *, seed, **params) -> None`` [init.call]: changes the model's parameters in
    place (under no_grad), deterministically from ``seed``, after the factory built it and
    before the solver is configured. Other keywords are suite params (``init: {name: spectral,
    target: 0.9}``), checked against the signature. Built-ins touch only the cells' weights
    (``deqbench.inits.basic.cell_weights``), leaving the cells' ``injection_parameters()``
    alone.
    """

    def __call__(self, model: nn.Module, *, seed: int, **params: Any) -> None: ...


@runtime_checkable
class AnalysisPlugin(Protocol):
    """An analysis: the class an entry point of ``deqbench.analyses`` names. Subclass
    :class:`deqbench.analyses.base.Analysis`.

    * ``name``, ``version``: the registered name and a version written with the results.
    * ``Params``: a pydantic model (``extra="forbid"``); the suite's ``analyses: [{name:
      {...}}]`` is validated against it before anything runs; the instance gets ``params``.
    * ``needs_training``: False for analyses that need no training loop when the cell trains
      for 0 epochs (they measure a given or initialised model).
    * either ``measure(ctx, step)``, which the base class runs on its schedule (``every``:
      "epoch" = before training and after each epoch, "end" = before and after training; a
      ``Params`` field ``every`` overrides the class's), turning an exception into an error
      row; or hooks, each returning (or yielding) :class:`deqbench.analyses.base.Row`:
      ``before_training(ctx)``, ``on_step(ctx, info)``, ``on_epoch(ctx, info)``,
      ``after_training(ctx)``; ``ctx`` is a :class:`deqbench.analyses.base.CellContext` (model,
      data, device, dtype, seed, the resolved cell).
    * ``plot(df, run_dir)`` (classmethod, optional): the figures, ``{name: Figure}``, drawn
      with :mod:`deqbench.plots`; ``example`` (optional): the tiny cell
      ``deqbench.testing.check_analysis`` runs it on.
    * a measurement that could not be made is a Row with ``status="skipped"`` (or "error") and a
      note, never a 0: NaN is "not measured"; one whose own quality checks failed has
      ``status="flagged"`` and a one-line note (cause and fix).
    """

    name: ClassVar[str]
    version: ClassVar[str]
    needs_training: ClassVar[bool]

    def before_training(self, ctx: CellContext) -> Iterable[Row]: ...

    def on_step(self, ctx: CellContext, info: StepInfo) -> Iterable[Row]: ...

    def on_epoch(self, ctx: CellContext, info: EpochInfo) -> Iterable[Row]: ...

    def after_training(self, ctx: CellContext) -> Iterable[Row]: ...


# -- datasets --------------------------------------------------------------------------------


@runtime_checkable
class DatasetLoader(Protocol):
    """A dataset: the callable an entry point of ``deqbench.datasets`` names.

    ``loader(**params) -> DataBundle`` [dataset.load]. Every parameter is a keyword with a
    default; a suite sets them beside the name (``data: {name: blobs, dim: 16}``) and the schema
    checks the keys against the signature (and annotated int, float and bool values) before
    anything runs. It returns a :class:`deqbench.data.base.DataBundle` on CPU:

    * ``train``, ``test``: pairs ``(x, y)`` of tensors; ``x`` floating point, shaped
      ``(N, *in_shape)``; ``y`` long class labels in ``[0, num_outputs)`` (the default
      ``task="classification"``) or finite floating-point targets of ``num_outputs`` values
      each (``task="regression"``, trained with squared loss), flat ``(N, num_outputs)`` or
      image-shaped ``(N, C, H, W)`` with ``C H W = num_outputs`` (a denoiser, an inverse
      problem: the model returns that shape, and evaluations add PSNR and SSIM, the pixel
      range ``meta["data_range"]``, default 1);
    * ``in_shape`` (one sample's shape, e.g. ``(1, 8, 8)`` or ``(64,)``) and ``num_outputs``:
      what the runner hands the model factory (:class:`ModelFactory`);
    * ``name``; ``meta``: a dict written with the results.

    The same params give the same data (seed it from a ``seed`` param); the runner casts and
    moves the tensors and caches the bundle per process.

    Optional attribute ``shape``: ``loader.shape(params) -> (in_shape, num_outputs)``, where
    ``params`` is the loader's defaults updated with the suite's keys [dataset.declared]: the
    shape ``deqbench validate`` builds and checks the suite's models with, before any data is
    loaded. ``deqbench.testing.check_dataset`` checks that the declared shape is the loaded one.

    Optional attribute ``probe``: ``loader.probe(params)`` (the same ``params``) checks cheaply,
    without loading the data, that it can load: it raises ``deqbench.errors.DataError`` naming
    the fix (the files it looked for and where, the package to install) or ``ConfigError`` for
    a param the loader would refuse [dataset.load]. Give one when loading is slow (large files).

    Checked by ``deqbench validate`` and by ``deqbench run`` before it writes anything: the
    entry point imports [dataset.import]; the declared shape [dataset.declared]; then the probe,
    or else the loader is called once per distinct params and its bundle checked: x shaped
    ``(N, *in_shape)`` [dataset.load], (in_shape, num_outputs) the declared shape
    [dataset.declared]. Labels in range, and regression targets finite floating point of
    ``num_outputs`` values, are checked by ``deqbench.testing.check_dataset``.

    Example:
        >>> import torch
        >>> from deqbench.data.base import DataBundle
        >>> def blobs(n_train: int = 256, n_test: int = 64, dim: int = 8, seed: int = 0):
        ...     g = torch.Generator().manual_seed(seed)
        ...     x = torch.randn(n_train + n_test, dim, generator=g)
        ...     y = (x.sum(1) > 0).long()
        ...     tr, te = (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])
        ...     return DataBundle("blobs", tr, te, in_shape=(dim,), num_outputs=2)
        >>> blobs.shape = lambda p: ((p["dim"],), 2)
    """

    def __call__(self, **params: Any) -> DataBundle:
        """Load the data (on CPU)."""
        ...


# -- backward modes --------------------------------------------------------------------------


@runtime_checkable
class BackwardModePlugin(Protocol):
    """A backward mode: the class an entry point of ``deqbench.backward`` names. Subclass
    :class:`deqbench.backward.BackwardMode`; deqbench instantiates it once (no arguments).

    * ``apply(layer, u, z0) -> z``: the DEQ layer's output for the injection ``u`` from the
      initial state ``z0``, with grad enabled, wired into autograd the mode's way: solve with
      ``layer.solve(u, z0)`` (under no_grad; it records ``layer.last_forward_stats`` and checks
      the solver's claim), evaluate the cell with ``layer.f(z, u)`` where gradients should flow,
      or write a ``torch.autograd.Function`` whose backward uses the layer's ``cell``. Set
      ``layer.last_backward_stats`` (a ``SolverStats`` of the backward's own solve, or None) and
      optionally ``layer.last_backward_info`` (floats the ``backward`` analysis writes as rows).
    * ``name``: the registered name; ``label(cfg, forward)``: its variant name in a comparison
      (default: the name).
    * ``forward`` (optional): the registered forward solver it needs; a suite or layer with
      another one is a ConfigError naming it. ``Options`` (optional): a pydantic model of its
      options, which a suite sets as extra keys of ``backward`` (``backward: {name: my_mode,
      my_option: 3}``) and a comparison as ``options``. ``evaluate(layer, u, z0)`` (optional): the
      output without grad (default None: the forward solve).

    A mode joins the ``backward`` analysis like a built-in (``modes: [{name: my_mode}]``: its
    gradient error against the float64 reference, descent check, time, memory, accuracy after
    training) and is checked by ``deqbench.testing.check_backward``.

    Example:
        >>> from deqbench.backward import BackwardMode
        >>> class DampedJFB(BackwardMode):
        ...     name = "damped_jfb"
        ...     def apply(self, layer, u, z0):
        ...         z, _ = layer.solve(u, z0)
        ...         z = z.detach()
        ...         layer.last_backward_stats = None
        ...         return 0.5 * z + 0.5 * layer.f(z, u)
        >>> isinstance(DampedJFB(), BackwardModePlugin)
        True
    """

    name: ClassVar[str]

    def apply(self, layer: DEQLayer, u: Tensor, z0: Tensor) -> Tensor: ...

    def label(self, cfg: Any, forward: Any = None) -> str: ...


#: The contracts in the order the reference renders them.
CONTRACTS: tuple[type, ...] = (
    ModelFactory,
    EquilibriumModel,
    Cell,
    OwnSolverModel,
    SpectralQuantities,
    Wrapper,
    Solver,
    ForwardMap,
    AdjointMap,
    MonotoneCell,
    Init,
    AnalysisPlugin,
    DatasetLoader,
    BackwardModePlugin,
)


def structure_of(solver: Any) -> type | None:
    """The Protocol a structured solver needs of the cell (``needs_structure``: True means
    :class:`MonotoneCell`), or None for a generic solver."""
    need = getattr(solver, "needs_structure", False)
    if isinstance(need, type):
        return need
    return MonotoneCell if need else None


#: a test cell for each structure a solver may need (:func:`structure_of`), as
#: ``make(width) -> cell``: the conformance checks run a structured solver on it. The model
#: family that implements the structure registers one with :func:`example_cell` (the monDEQ's
#: dense cell for :class:`MonotoneCell`), so the checks name no model.
EXAMPLE_CELLS: dict[type, Callable[[int], Any]] = {}


def example_cell(structure: type) -> Callable[[Callable[[int], Any]], Callable[[int], Any]]:
    """Decorator registering ``make(width) -> cell`` as the test cell of ``structure``."""

    def deco(make: Callable[[int], Any]) -> Callable[[int], Any]:
        EXAMPLE_CELLS[structure] = make
        return make

    return deco


def missing_members(obj: Any, protocol: type) -> list[str]:
    """The members of ``protocol`` that ``obj`` lacks (empty when it implements it)."""
    names = [
        n
        for n in getattr(protocol, "__protocol_attrs__", None) or _protocol_attrs(protocol)
        if not n.startswith("_")
    ]
    return sorted(n for n in names if not hasattr(obj, n))


def _protocol_attrs(protocol: type) -> Sequence[str]:
    out = set(getattr(protocol, "__annotations__", {}))
    out |= {n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")}
    return sorted(out)


def _doc(obj: Any) -> str:
    """A docstring as Markdown (reST roles and double backticks become code spans)."""
    text = inspect.cleandoc(obj.__doc__ or "")
    text = re.sub(r":(?:class|func|meth|mod|data):`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def _sig(fn: Any) -> str:
    sig = str(inspect.signature(fn)).replace("'", "")
    return sig.replace("(self, ", "(").replace("(self)", "()")


def reference_markdown() -> str:
    """The contracts as Markdown (``docs/plugins.md``'s "Reference" part): each Protocol's
    signature and docstring, then the clause table."""
    out = ["## Reference (generated from `deqbench/core/contracts.py`)", ""]
    for proto in CONTRACTS:
        out += [f"### `{proto.__name__}`", ""]
        call = vars(proto).get("__call__")
        if call is not None:
            out += ["```python", f"{proto.__name__}.__call__{_sig(call)}", "```", ""]
        out += [_doc(proto), ""]
        methods = [
            (n, v)
            for n, v in vars(proto).items()
            if callable(v) and not n.startswith("_") and v.__doc__
        ]
        for n, v in methods:
            out += [f"* `{n}{_sig(v)}`: {' '.join(_doc(v).split())}"]
        if methods:
            out.append("")
    out += ["### Clauses checked by `deqbench validate`", "", "| clause | rule |", "|---|---|"]
    out += [f"| `{k}` | {v} |" for k, v in CLAUSES.items()]
    out.append("")
    return "\n".join(out)
