"""Solver contract: ``solve(f, z0, *, max_iter, tol, stop_mode="rel", **options) -> (z, SolverStats)``.

Conventions:

* batched over dim 0; each sample's state is flattened (all non-batch dims);
* canonical residual per sample: ``abs_i = ||f(z)_i - z_i||``, ``rel_i = abs_i / (||f(z)_i|| + 1e-9)``;
* ``max_iter`` bounds the number of f-evaluations and ``nstep`` counts every f-evaluation made;
* stop when the batch max of the chosen residual (``stop_mode`` rel or abs) of the returned
  iterates is below ``tol`` (the default stop rule; the option ``stop`` of a solver built on
  :class:`Tracker` picks another reduction over the batch: :data:`STOP_RULES`, :func:`rule_value`);
* the returned iterate is the lowest-residual iterate *x* whose residual was measured
  (``returns="lowest"``, the default, chosen per sample) or the last measured iterate
  (``returns="last"``); its residual is exactly the reported one (no extra evaluation is made,
  the residual of x was measured with the counted evaluation f(x));
* a non-finite residual or an abs residual blow-up (``protect_thres`` times the first) stops the
  solver with ``status="diverged"``; nothing is raised.

**Writing a solver.** :func:`solver` declares one: a pydantic options model (subclass of
:class:`CommonOptions`, or :class:`GraphOptions` for CUDA-graph support; fields with defaults,
constraints such as ``Field(gt=0)`` and a ``description``) and a body
``impl(f, z0, opts, *, max_iter, tol, stop_mode)`` that receives the validated options object
and checks nothing itself. The decorated function is the contract above; it validates each
distinct option dict once (a suite validates its cells' options when it is built, a call
through a small cache keyed by the frozen values, so a solve in a training loop does no
validation after the first) and raises :class:`SolverOptionError` naming the solver and the
option. The docs' options tables are generated from the models (:func:`options_markdown`)::

    class Options(CommonOptions):
        omega: float = Field(0.9, gt=0, lt=2, description="relaxation factor")

    @solver(Options)
    def picard(f, z0, opts, *, max_iter=50, tol=1e-4, stop_mode="rel"):
        tracker = Tracker("picard", z0, max_iter=max_iter, tol=tol, stop_mode=stop_mode,
                          common=opts)
        z, nstep = z0, 0
        while True:
            fz = f(z)
            nstep += 1
            tracker.record(z, fz, None)
            if tracker.stop() or nstep >= max_iter:
                return tracker.finish(nstep, {"omega": opts.omega})
            z = (1 - opts.omega) * z + opts.omega * fz

**Recording statistics: Tracker.** The one way a solver records what it did:
``Tracker.record(x, f(x), f(x) - x or None)`` for each measured iterate, ``Tracker.stop()``
after it (converged, diverged, stagnated; ``check_every`` and ``protect_thres`` applied), and
``Tracker.finish(nstep, extra)``, which returns the iterate to return (``returns``: the lowest
residual per sample or the last) and its :class:`SolverStats`. :func:`make_stats` is
``finish``'s last step; call it directly only to wrap a solve someone else ran (an adapter of
an external solver that hands over its residuals). The tracker keeps per-sample traces in a
preallocated buffer, the per-sample lowest iterate and the stop decisions. It never
synchronises with the GPU in the hot loop: each step's batch summaries are copied
asynchronously to pinned host memory and read one step late (the GPU is then busy with the next
step), with an exact read only when the residual trend predicts convergence at the current
step, so the f-evaluation count is not inflated.

**CUDA graphs.** A solver declared with ``@solver(Options, cuda_graph=True)`` (``Options``
subclassing :class:`GraphOptions`; built-ins: ``fixed_point``, ``anderson``, ``broyden``;
:func:`supports_graph` tells) takes the option ``cuda_graph``: ``False`` (default) runs
eagerly; ``True`` runs one or a few eager steps, then *captures* the solver step (f and the
tracker's :meth:`Tracker.device_record`, all on static buffers) in a CUDA graph and replays it,
one launch per replay instead of one per kernel (for launch- or host-bound cells); ``"cache"``
also keeps the captured graph (and its buffers) for later solves with the same f object,
shapes and options and replays it from the first step (valid only while f reads the same
tensors at the same addresses). ``graph_steps`` (``"auto"`` or 1-16) is the number of steps per
captured graph: the host reads the residuals once per replay, so up to ``graph_steps - 1``
steps past convergence may be made (``extra["nstep_to_tol"]``). f must be capturable (no host
syncs, fixed shapes); otherwise :class:`GraphCaptureError` is raised. On CPU the static step
runs eagerly (the same iterates). The DEQ layer uses ``cuda_graph="cache"`` by itself on CUDA
(``Runtime.cuda_graph="auto"``) for states of at most ``graph_numel`` elements (declared with
``@solver(..., graph_numel=N)``; default :data:`AUTO_NUMEL`); a solver's body implements the
static path with :func:`graph_mode`, :func:`graph_steps`, :func:`graph_state` and
:func:`graph_loop`.

**Where it lives.** This module declares solvers (:func:`solver`) and re-exports the names
solvers import from their one-topic homes: :mod:`.options` (options models and their
validation), :mod:`.stats` (:class:`SolverStats`, residuals, stop rules), :mod:`.tracker`
(:class:`Tracker`) and :mod:`.graphs` (the CUDA-graph cache and loop).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..core.tags import SolverTags, as_tags, solver_tags
from .graphs import (
    _GRAPH_CACHE,  # noqa: F401  (read by tests)
    AUTO_NUMEL,
    AUTO_STEPS,
    GRAPH_CACHE_BYTES,
    GRAPH_CACHE_SIZE,
    LARGE_NUMEL,
    LOOP_STEPS_LABEL,
    GraphCaptureError,
    clear_graph_cache,
    drop_graphs,
    forbid_sync,
    graph_loop,
    graph_mode,
    graph_numel,
    graph_state,
    graph_steps,
    loop_supported,
    steps_label,
)
from .options import (
    COMMON_OPTIONS,
    DEFAULT_STOP,
    GRAPH_STEPS_MAX,
    STOP_RULES,
    CommonOptions,
    GraphOptions,
    SolverOptionError,
    SolverOptions,
    _freeze,
    check_budget,
    check_options,
    check_stop,
    check_stop_mode,
    option_domain,
    option_error,
    option_problems,
    parse_options,
    positive_int,
    problem_text,
    stop_problem,
)
from .stats import (
    EPS,
    STATUSES,
    SolverStats,
    batch_norm,
    check_output,
    chunking,
    flat,
    make_stats,
    residuals,
    rule_value,
)
from .tracker import Tracker

__all__ = [
    "AUTO_NUMEL",
    "AUTO_STEPS",
    "COMMON_OPTIONS",
    "CommonOptions",
    "DEFAULT_STOP",
    "EPS",
    "GRAPH_CACHE_BYTES",
    "GRAPH_CACHE_SIZE",
    "GRAPH_STEPS_MAX",
    "GraphCaptureError",
    "GraphOptions",
    "LARGE_NUMEL",
    "LOOP_STEPS_LABEL",
    "STATUSES",
    "STOP_RULES",
    "SolverOptionError",
    "SolverOptions",
    "SolverStats",
    "SolverTags",
    "Tracker",
    "batch_norm",
    "check_budget",
    "check_options",
    "check_output",
    "check_stop",
    "check_stop_mode",
    "chunking",
    "clear_graph_cache",
    "drop_graphs",
    "flat",
    "forbid_sync",
    "graph_loop",
    "graph_mode",
    "graph_numel",
    "graph_state",
    "graph_steps",
    "loop_supported",
    "make_stats",
    "option_domain",
    "option_error",
    "option_problems",
    "options_markdown",
    "parse_options",
    "positive_int",
    "problem_text",
    "residuals",
    "rule_value",
    "solver",
    "steps_label",
    "solver_tags",
    "solver_options_model",
    "stop_problem",
    "supports_graph",
]

#: distinct option dicts validated per solver before its cache is cleared
OPTIONS_CACHE_SIZE = 256


def supports_graph(solver: Any) -> bool:
    """Whether a registered solver function takes the ``cuda_graph`` option."""
    return bool(getattr(solver, "supports_cuda_graph", False))


def _contract_signature(max_iter: int, tol: float) -> inspect.Signature:
    """The signature of a declared solver (:func:`solver`): the solver contract's, with the
    implementation's default ``max_iter`` and ``tol``."""
    P = inspect.Parameter
    return inspect.Signature(
        [
            P("f", P.POSITIONAL_OR_KEYWORD, annotation="Callable[[Tensor], Tensor]"),
            P("z0", P.POSITIONAL_OR_KEYWORD, annotation="Tensor"),
            P("max_iter", P.KEYWORD_ONLY, default=max_iter, annotation="int"),
            P("tol", P.KEYWORD_ONLY, default=tol, annotation="float"),
            P("stop_mode", P.KEYWORD_ONLY, default="rel", annotation="str"),
            P("options", P.VAR_KEYWORD, annotation="Any"),
        ],
        return_annotation="tuple[Tensor, SolverStats]",
    )


def solver(
    options: type[SolverOptions],
    *,
    name: str | None = None,
    cuda_graph: bool = False,
    graph_numel: int | None = None,
    needs_structure: Any = False,
    solves_tangent: bool = False,
    unroll: Callable[..., Any] | None = None,
    tags: SolverTags | dict[str, Any] | None = None,
) -> Callable[
    [Callable[..., tuple[Tensor, SolverStats]]], Callable[..., tuple[Tensor, SolverStats]]
]:
    """Declare a solver: ``impl(f, z0, opts, *, max_iter, tol, stop_mode)`` becomes the contract
    ``solve(f, z0, *, max_iter, tol, stop_mode="rel", **options) -> (z, SolverStats)``.

    The returned function validates ``**options`` with the pydantic model ``options`` once per
    distinct option dict (a small cache keyed by the frozen values: a solve in a training loop
    does no validation after the first), checks ``max_iter``, ``tol`` and ``stop_mode``, and
    calls ``impl`` under ``torch.no_grad`` with the validated object ``opts``; ``impl`` checks
    nothing itself. ``max_iter`` and ``tol`` default to ``impl``'s own defaults.

    Declared on the returned function (what suites, the docs and the DEQ layer read):
    ``Options`` (the model), ``OPTIONS`` (its field names), ``supports_cuda_graph``
    (``cuda_graph=True``: ``options`` must subclass :class:`GraphOptions`), ``graph_numel``
    (the largest state the DEQ layer's automatic graph path captures; default
    :data:`AUTO_NUMEL`), ``needs_structure``, ``solves_tangent``, ``unroll`` (see
    :class:`deqbench.contracts.Solver`) and ``tags`` (a :class:`~deqbench.core.tags.SolverTags`
    or a dict of its fields, e.g. ``tags={"rate": "sublinear"}``: what the diagnosis of missed
    solves and the registry-driven tests read; default: the defaults).

    Example:
        >>> from pydantic import Field
        >>> class HalfOptions(CommonOptions):
        ...     omega: float = Field(0.5, gt=0, lt=2, description="relaxation")
        >>> @solver(HalfOptions)
        ... def half(f, z0, opts, *, max_iter=50, tol=1e-4, stop_mode="rel"):
        ...     tracker = Tracker("half", z0, max_iter=max_iter, tol=tol, stop_mode=stop_mode,
        ...                       common=opts)
        ...     z, nstep = z0, 0
        ...     while True:
        ...         fz = f(z)
        ...         nstep += 1
        ...         tracker.record(z, fz, None)
        ...         if tracker.stop() or nstep >= max_iter:
        ...             return tracker.finish(nstep, {"omega": opts.omega})
        ...         z = (1 - opts.omega) * z + opts.omega * fz
        >>> z, st = half(lambda z: 0.5 * z + 1, torch.zeros(2, 3), tol=1e-6)
        >>> st.status, half.OPTIONS == {"omega", "returns", "check_every", "protect_thres", "stop"}
        ('converged', True)
        >>> half(lambda z: z, torch.zeros(2, 3), omega=2)
        Traceback (most recent call last):
        ...
        deqbench.solvers.options.SolverOptionError: solver 'half': omega must be a number in (0, 2), got 2
    """
    if cuda_graph and not issubclass(options, GraphOptions):
        raise TypeError("@solver(cuda_graph=True) needs an options model subclassing GraphOptions")
    declared = as_tags(tags)

    def wrap(impl: Callable[..., tuple[Tensor, SolverStats]]) -> Callable[..., Any]:
        sname = name or impl.__name__
        params = inspect.signature(impl).parameters
        max_iter_default = params["max_iter"].default if "max_iter" in params else 50
        tol_default = params["tol"].default if "tol" in params else 1e-4
        cache: dict[Any, Any] = {}
        default = options()

        def solve(
            f: Callable[[Tensor], Tensor],
            z0: Tensor,
            *,
            max_iter: int = max_iter_default,
            tol: float = tol_default,
            stop_mode: str = "rel",
            **kw: Any,
        ) -> tuple[Tensor, SolverStats]:
            opts: SolverOptions | None
            if not kw:
                opts = default
            else:
                # the key holds each value's type: True, 1 and 1.0 are equal dict keys
                key: Any = tuple([(k, v.__class__, v) for k, v in kw.items()])
                try:
                    opts = cache.get(key)
                except TypeError:  # a dict or list value (sam's prior): frozen
                    try:
                        key = tuple([(k, _freeze(v)) for k, v in kw.items()])
                        opts = cache.get(key)
                    except TypeError:  # not hashable even frozen: validated every call
                        key, opts = None, None
                if opts is None:
                    opts = parse_options(sname, options, kw)
                    if key is not None:
                        if len(cache) >= OPTIONS_CACHE_SIZE:
                            cache.clear()
                        cache[key] = opts
            check_budget(sname, max_iter, tol, stop_mode)
            # errstate: the CPU tracker's numpy arithmetic meets NaN/inf residuals silently,
            # as torch's does (entered once a solve, not once a step)
            with np.errstate(all="ignore"):
                if not torch.is_grad_enabled():  # a DEQ layer's solves: no_grad already
                    return impl(f, z0, opts, max_iter=max_iter, tol=tol, stop_mode=stop_mode)
                with torch.no_grad():
                    return impl(f, z0, opts, max_iter=max_iter, tol=tol, stop_mode=stop_mode)

        functools.update_wrapper(solve, impl)
        solve.__signature__ = _contract_signature(max_iter_default, tol_default)  # type: ignore[attr-defined]
        s: Any = solve
        s.Options = options
        s.OPTIONS = frozenset(options.model_fields)
        s.supports_cuda_graph = bool(cuda_graph)
        if graph_numel is not None:
            s.graph_numel = int(graph_numel)
        if needs_structure:
            s.needs_structure = needs_structure
        if solves_tangent:
            s.solves_tangent = True
        if unroll is not None:
            s.unroll = unroll
        s.tags = declared
        return solve

    return wrap


def solver_options_model(fn: Any) -> type[SolverOptions] | None:
    """The options model a solver declares with :func:`solver` (``fn.Options``), else None."""
    m = getattr(fn, "Options", None)
    return m if isinstance(m, type) and issubclass(m, SolverOptions) else None


def options_markdown(names: list[str] | None = None) -> str:
    """The options tables of the registered solvers (``names``: default every built-in that
    declares an options model), one ``#### name`` section each: option, what it takes, default,
    description. The docs' ``<!-- deqbench:solver-options -->`` marker renders this."""
    from ..core.registry import solvers as registry

    if names is None:
        names = [n for n in registry.names() if str(registry.origin(n)).startswith("built")]
    parts = []
    for n in names:
        fn = registry.get(n)
        model = solver_options_model(fn)
        if model is None:
            continue
        graph = " Supports CUDA graphs (`cuda_graph`)." if supports_graph(fn) else ""
        rows = ["| option | takes | default | what |", "|---|---|---|---|"]
        for key, f in model.model_fields.items():
            cells = [
                f"`{key}`",
                option_domain(model, key),
                f"`{f.default!r}`",
                " ".join((f.description or "").split()),
            ]
            rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        parts.append(f"#### `{n}`\n\n`{model.__name__}`.{graph}\n\n" + "\n".join(rows) + "\n")
    return "\n".join(parts)
