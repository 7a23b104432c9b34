"""The DEQ layer: a cell f(z, u), a forward solver and a backward mode.

A DEQ model holds one or more :class:`DEQLayer` modules. Each layer solves ``z* = f(z*, u)`` with
a registered solver and differentiates with a registered backward mode (:mod:`deqbench.backward`:
``ift``, ``unrolled``, ``jfb``, ``phantom``, ``reversible``, ``shine`` or a plugin's), dispatched
through the registry. The last forward/backward :class:`SolverStats` are kept on the layer so
analyses can read them (and ``last_backward_info``, a dict of floats some modes report).

Example:
    >>> import torch, deqbench
    >>> from deqbench.deq import DEQLayer, SolverConfig, BackwardConfig
    >>> cell = deqbench.models.get("fc_deq_tiny")().deq.cell          # doctest: +SKIP
    >>> layer = DEQLayer(cell, SolverConfig("anderson", max_iter=50, tol=1e-6))  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from ..solvers.base import SolverStats
from . import backward as bw
from . import own_solves, verdict
from .backward import DirectSolver
from .config import (  # noqa: F401 - re-exported (deqbench.deq)
    AMP_MODES,
    BACKWARD_MODES,
    GRAPH_MODES,
    BackwardConfig,
    Runtime,
    SolverConfig,
)
from .registry import solvers as solver_registry
from .weights import cell_weights


class CellMap:
    """The map ``z -> cell(z, u)`` handed to forward solvers.

    Generic solvers just call it. It exposes ``cell`` and ``u`` so that solvers needing a
    family's structure (e.g. monDEQ operator splitting, which reads the monotone-operator
    interface of the cell) can reach it. ``fn`` (default: ``cell``) is what is called, e.g. the
    compiled cell; ``runtime`` adds autocast (the output is cast back to the iterate's dtype).
    """

    __slots__ = ("cell", "u", "fn", "runtime")

    def __init__(
        self,
        cell: nn.Module,
        u: Tensor,
        fn: Any = None,
        runtime: Runtime | None = None,
    ) -> None:
        self.cell = cell
        self.u = u
        self.fn = cell if fn is None else fn
        self.runtime = runtime

    def __call__(self, z: Tensor) -> Tensor:
        rt = self.runtime
        if rt is None or rt.amp == "none":
            return self.fn(z, self.u)
        with rt.autocast(z.device):
            out = self.fn(z, self.u)
        return out if out.dtype == z.dtype else out.to(z.dtype)


class DEQLayer(nn.Module):
    """Equilibrium layer around ``cell`` (an ``nn.Module`` with ``forward(z, u)``).

    The layer's forward returns z* for injection ``u``. In training (grad enabled) the
    configured backward mode attaches gradients; under ``no_grad`` it only solves.
    """

    # set through __dict__ in __init__ (not submodules), declared for type checkers
    _compiled: Any
    _static_maps: dict[tuple, CellMap]
    _no_graph: dict[tuple, str]

    def __init__(
        self,
        cell: nn.Module,
        solver: SolverConfig | None = None,
        backward: BackwardConfig | None = None,
    ) -> None:
        super().__init__()
        self.cell = cell
        self.solver_cfg = solver or SolverConfig()
        self.backward_cfg = backward or BackwardConfig()
        self.last_forward_stats: SolverStats | None = None
        self.last_backward_stats: SolverStats | None = None
        self.last_backward_info: dict[str, float] = {}
        self.f_evals_grad = 0
        self.vjp_bwd = 0
        self.runtime = Runtime()
        # not submodules (no state_dict entries): the compiled cell, the static maps of the
        # CUDA-graph path (key -> CellMap over a static copy of u) and keys that failed capture
        self.__dict__["_compiled"] = None
        self.__dict__["_static_maps"] = {}
        self.__dict__["_no_graph"] = {}
        if backward is not None:
            from ..backward.base import check_pair

            check_pair(self.solver_cfg, self.backward_cfg)

    def configure(
        self, solver: SolverConfig | None = None, backward: BackwardConfig | None = None
    ) -> None:
        """Set the forward solver and/or the backward mode (a copy of each; the mode validated
        against the registry and its options, and against the forward solver it needs:
        ConfigError)."""
        from ..backward.base import check_pair

        s = replace(solver) if solver is not None else self.solver_cfg
        b = replace(backward) if backward is not None else self.backward_cfg
        if solver is not None or backward is not None:
            check_pair(s, b)
        self.solver_cfg, self.backward_cfg = s, b

    def set_runtime(self, runtime: Runtime) -> None:
        """Use ``runtime`` from now on (drops the compiled cell and the captured graphs)."""
        self.runtime = runtime
        self.reset_runtime_caches()

    def reset_runtime_caches(self) -> None:
        """Forget the compiled cell and this layer's captured solves (e.g. after moving the
        model to another device or replacing its parameters' storage)."""
        from ..solvers.base import drop_graphs

        drop_graphs(list(self._static_maps.values()))
        drop_graphs([ga.map for ga in self.__dict__.get("_graph_adjoints", {}).values()])
        self.__dict__["_compiled"] = None
        self._static_maps.clear()
        self._no_graph.clear()
        self.__dict__.pop("_captures", None)
        self.__dict__.pop("_graph_adjoints", None)
        self.__dict__.pop("_no_graph_adjoint", None)

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles leave the runtime caches behind (CUDA graphs cannot be copied)."""
        state = super().__getstate__()
        state = dict(state)
        state.update(_compiled=None, _static_maps={}, _no_graph={})
        state.pop("_graph_adjoints", None)
        state.pop("_no_graph_adjoint", None)
        return state

    def cell_fn(self) -> Any:
        """What is called as f(z, u): the cell, or the compiled cell under ``runtime.compile``."""
        backend = self.runtime.backend
        if backend is None:
            return self.cell
        if self._compiled is None:
            self.__dict__["_compiled"] = torch.compile(
                self.cell, backend=backend, mode=self.runtime.compile_mode, dynamic=False
            )
        return self._compiled

    def f(self, z: Tensor, u: Tensor) -> Tensor:
        """The cell map f(z, u) (compiled and under autocast as ``runtime`` says; the output
        in z's dtype)."""
        rt = self.runtime
        if rt.amp == "none" and rt.backend is None:
            return self.cell(z, u)
        return CellMap(self.cell, u, self.cell_fn(), rt)(z)

    def cell_map(self, u: Tensor) -> CellMap:
        """The map z -> f(z, u) a forward solver gets (eager path)."""
        return CellMap(self.cell, u, self.cell_fn(), self.runtime)

    def solve(
        self, u: Tensor, z0: Tensor, cfg: SolverConfig | None = None
    ) -> tuple[Tensor, SolverStats]:
        """Forward solve under no_grad; records ``last_forward_stats``.

        On CUDA with ``runtime.cuda_graph == "auto"`` and a solver that supports it, the solve
        is captured once per static key and replayed (``stats.path == "graph"``)."""
        cfg = cfg or self.solver_cfg
        fn = solver_registry.get(cfg.name)
        u, z0 = self.state_dtype(u), self.state_dtype(z0)
        # The solver's own arithmetic (history, least squares, residuals) never runs under an
        # enclosing autocast; the cell map turns ``runtime.amp`` on for each f-evaluation.
        with _solve_context(u.device.type):
            z, stats = self._solve(fn, cfg, u, z0)
            # convergence is verified, not believed (deqbench.core.verdict)
            verdict.check_claim(stats, cfg.tol, cfg.stop_mode, cfg.name, cfg.options.get("stop"))
            if verdict.verifying():
                verdict.recheck(stats, self.f(z, u), z)
        verdict.record("forward", stats, cfg.max_iter)
        self.__dict__["last_forward_stats"] = (
            stats  # a plain attribute (Module.__setattr__ is slow)
        )
        return z, stats

    def _solve(self, fn: Any, cfg: SolverConfig, u: Tensor, z0: Tensor) -> tuple[Tensor, Any]:
        from ..solvers.base import GraphCaptureError

        kw = dict(max_iter=cfg.max_iter, tol=cfg.tol, stop_mode=cfg.stop_mode)
        eager_path = "compiled" if self.runtime.backend is not None else "eager"
        key = self._graph_key(cfg, fn, u, z0)
        if key is not None:
            f = self._static_maps.get(key)
            if f is None:
                if len(self._static_maps) >= STATIC_MAPS:  # oldest first
                    from ..solvers.base import drop_graphs

                    old = self._static_maps.pop(next(iter(self._static_maps)))
                    drop_graphs([old])
                f = CellMap(self.cell, u.detach().clone(), self.cell_fn(), self.runtime)
                self._static_maps[key] = f
            else:
                f.u.copy_(u)
            try:
                z, stats = fn(f, z0, **kw, **cfg.options, cuda_graph="cache")
                stats.path = "graph"
                return z, stats
            except GraphCaptureError as exc:
                self._static_maps.pop(key, None)
                self._no_graph[key[:-1]] = str(exc)
        z, stats = fn(self.cell_map(u), z0, **kw, **cfg.options)
        stats.path = eager_path
        return z, stats

    def graph_allowed(self, solver: Any, options: dict[str, Any], state: Tensor) -> bool:
        """Whether a solve of ``state`` with ``solver`` (a registered solver function) may take
        the CUDA-graph path, forward or IFT adjoint: ``runtime.cuda_graph`` is "auto", the state
        is on CUDA and launch- or host-bound (at most ``graph_numel(solver)`` elements: 2M by
        default, a larger state gains nothing (fixed point on conv64); Anderson and Broyden 16M), the user did not set the solver's own ``cuda_graph``, the cell declares no
        Python-level state (``cuda_graph_safe``), the solver supports graphs and no capture is
        under way."""
        from ..solvers.base import graph_numel, supports_graph

        return not (
            self.runtime.cuda_graph != "auto"
            or state.device.type != "cuda"
            or state.numel() > graph_numel(solver)
            or "cuda_graph" in options
            or not getattr(self.cell, "cuda_graph_safe", True)
            or not supports_graph(solver)
            or torch.cuda.is_current_stream_capturing()
        )

    def storage_key(self) -> tuple:
        """What a captured graph of the cell depends on besides shapes: train/eval mode, the
        runtime and the storage of the cell's parameters and buffers (a replay reads them at
        their addresses; in-place updates are seen, new storage needs a new capture)."""
        # a plain walk over the module tree (parameters() and buffers() build names and memo
        # sets: several times slower, and this runs before every captured solve)
        ptrs: list[int] = []
        stack: list[nn.Module] = [self.cell]
        while stack:
            m = stack.pop()
            ptrs.extend(t.data_ptr() for t in m._parameters.values() if t is not None)
            ptrs.append(-1)  # parameters and buffers apart
            ptrs.extend(t.data_ptr() for t in m._buffers.values() if t is not None)
            stack.extend(c for c in m._modules.values() if c is not None)
        return (self.cell.training, self.runtime, tuple(ptrs))

    def _graph_key(self, cfg: SolverConfig, fn: Any, u: Tensor, z0: Tensor) -> tuple | None:
        """The static key of a graph-path solve, or None for the eager path."""
        if not self.graph_allowed(fn, cfg.options, z0) or torch.is_grad_enabled():
            return None
        base = (cfg.name, tuple(u.shape), u.dtype, u.stride(), u.device, tuple(z0.shape),
                z0.dtype) + self.storage_key()  # fmt: skip
        if base in self._no_graph:
            return None
        if base not in self._static_maps:
            # Parameters substituted per call (functional_call in landscapes, finite-difference
            # Hessians) change the key every time: capturing each would cost more than it saves.
            if not all(isinstance(t, nn.Parameter) for t in self.cell.parameters()):
                return None
            n = self.__dict__["_captures"] = self.__dict__.get("_captures", 0) + 1
            if n > MAX_CAPTURES:  # keys keep changing: stay eager
                return None
        return base + (torch.is_autocast_enabled(),)

    def state_dtype(self, t: Tensor) -> Tensor:
        """Under ``runtime.amp`` the injection and iterate stay in the parameters' dtype
        (float32) although the model's forward runs under autocast (a bf16 ``inject`` output
        would make the solver's state, residuals and history bf16)."""
        if self.runtime.amp == "none" or t.dtype not in (torch.bfloat16, torch.float16):
            return t
        p = next(self.cell.parameters(), None)
        return t.to(p.dtype if p is not None and p.is_floating_point() else torch.float32)

    def forward(self, u: Tensor, z0: Tensor | None = None) -> Tensor:
        u = self.state_dtype(u)
        if z0 is not None:
            z0 = self.state_dtype(z0)
        if z0 is None:
            z0 = torch.zeros_like(u)
        needs_grad = torch.is_grad_enabled() and (
            u.requires_grad or any(p.requires_grad for p in self.cell.parameters())
        )
        if not needs_grad:
            self.last_backward_stats = None
            # a mode may define its own evaluation (unrolled: the K-step network it was trained
            # as; its fixed point is another model, and analyses that need z* call solve())
            from ..backward.base import mode_of

            with torch.no_grad():
                z = mode_of(self.backward_cfg.name).evaluate(self, u, z0)
            if z is None:
                z, _ = self.solve(u, z0)
            return z
        return bw.apply(self, u, z0)

    def extra_repr(self) -> str:
        s, b = self.solver_cfg, self.backward_cfg
        return f"solver={s.name}(max_iter={s.max_iter}, tol={s.tol}), backward={b.name}"


def _solve_context(device_type: str) -> contextlib.AbstractContextManager:
    """No gradients and autocast off on ``device_type`` (only what is not so already: a
    forward solve in training runs inside the IFT Function's forward, under no_grad, and
    entering each context costs a few microseconds per solve)."""
    if torch.is_autocast_enabled(device_type):
        return _no_grad_no_autocast(device_type)
    return torch.no_grad() if torch.is_grad_enabled() else contextlib.nullcontext()


@contextlib.contextmanager
def _no_grad_no_autocast(device_type: str) -> Iterator[None]:
    with torch.no_grad(), torch.autocast(device_type=device_type, enabled=False):
        yield


#: static maps (hence captured solves) kept per layer
STATIC_MAPS = 8
#: captures per layer after which its solves stay eager (static keys that keep changing)
MAX_CAPTURES = 256


def set_runtime(model: nn.Module, runtime: Runtime) -> None:
    """Give every DEQ layer of ``model`` the same :class:`Runtime`."""
    for layer in deq_layers(model):
        layer.set_runtime(runtime)


def deq_layers(model: nn.Module) -> Iterator[DEQLayer]:
    """Every DEQLayer inside ``model`` (including ``model`` itself)."""
    for m in model.modules():
        if isinstance(m, DEQLayer):
            yield m


@contextlib.contextmanager
def direct_solves(model: nn.Module) -> Iterator[list[DirectSolver]]:
    """Within the block, the IFT adjoint and tangent solves of ``model``'s DEQ layers are
    direct (per-sample LU, cached per point; :class:`DirectSolver`) where the state is small
    and samples do not interact, else the layers' own solvers. Yields the solvers (their
    ``off`` says why one was not used)."""
    layers = list(deq_layers(model))
    made = [DirectSolver() for _ in layers]
    for layer, ds in zip(layers, made):
        layer.__dict__["direct_solver"] = ds  # a plain attribute (read through __dict__)
    try:
        yield made
    finally:
        for layer in layers:
            layer.__dict__.pop("direct_solver", None)


def is_deq(model: nn.Module) -> bool:
    return any(True for _ in deq_layers(model))


def configure(
    model: nn.Module, solver: SolverConfig | None = None, backward: BackwardConfig | None = None
) -> None:
    """Set the solver and backward mode of every DEQ layer of ``model``."""
    for layer in deq_layers(model):
        layer.configure(solver, backward)


def own_solver(model: nn.Module) -> str | None:
    """The ``solver`` column of a model that runs its own fixed-point loop and reports it
    (``last_solve_stats()``, :class:`deqbench.contracts.OwnSolverModel`): ``own:<solver_name>``
    (``own`` when unnamed); None for a model that does not report its own solves or has DEQ
    layers (those report through their layers)."""
    if not own_solves.has_hook(model) or is_deq(model):
        return None
    return own_solves.labels(model)[0]


def own_backward(model: nn.Module) -> str | None:
    """The ``backward`` column of such a model: ``own:<backward_name>`` (``own`` unnamed), or
    None as for :func:`own_solver`."""
    if not own_solves.has_hook(model) or is_deq(model):
        return None
    return own_solves.labels(model)[1]


def own_solve_stats(model: nn.Module) -> tuple[SolverStats | None, SolverStats | None]:
    """(forward, backward) :class:`SolverStats` of the last solves a model without DEQ layers
    ran itself and reported (``last_solve_stats()`` / ``last_backward_solve_stats()``,
    validated; each None when not reported). A hook that returns something else than None, a
    ``SolverStats`` or a dict with ``nstep``, ``tol`` and a residual raises a PluginError
    naming the model and the hook."""
    if own_solver(model) is None:
        return None, None
    return own_solves.read(model, *own_solves.labels(model))


def reports_solves(model: nn.Module) -> bool:
    """Whether :func:`last_stats` can report solves of ``model``: it has DEQ layers or reports
    its own solves (:func:`own_solver`)."""
    return is_deq(model) or own_solves.has_hook(model)


def watch_own_solves(model: nn.Module) -> bool:
    """Record every solve of a model that reports its own solves (:func:`own_solver`) in the
    open solve ledger (:mod:`deqbench.core.verdict`), as DEQ layers record theirs: a forward
    hook reads ``last_solve_stats()`` after each forward and, when the output needs a gradient,
    ``last_backward_solve_stats()`` after the backward pass. :func:`deqbench.models.create`
    calls it. Returns whether the model is watched."""
    if not isinstance(model, nn.Module) or own_solver(model) is None:
        return False
    return own_solves.watch(model)


def last_stats(model: nn.Module, layers: list[DEQLayer] | None = None) -> dict[str, float]:
    """Forward/backward f-evaluations and residuals of the last pass, summed over DEQ layers
    (counts) and maxed (residuals); for a model without DEQ layers that runs its own solver,
    what it reports (:func:`own_solve_stats`), under the same keys. Empty dict for other models
    (and before any solve). ``layers``: ``model``'s DEQ layers where the caller has them."""
    out: dict[str, float] = {}
    layers = list(deq_layers(model)) if layers is None else layers
    if layers:
        fw = [ly.last_forward_stats for ly in layers if ly.last_forward_stats is not None]
        bw = [ly.last_backward_stats for ly in layers if ly.last_backward_stats is not None]
    elif own_solves.has_hook(model):
        f, b = own_solves.read(model, *own_solves.labels(model))
        fw, bw = [f] if f is not None else [], [b] if b is not None else []
    else:
        return out
    if fw:
        out["forward_nstep"] = float(sum(s.nstep for s in fw))
        out["forward_rel_residual"] = max(s.rel_max for s in fw)
        out["forward_abs_residual"] = max(s.abs_max for s in fw)
        out["forward_converged"] = float(all(s.converged for s in fw))
        out["forward_diverged"] = float(any(s.status == "diverged" for s in fw))
        njvp = sum(getattr(s, "njvp", 0) for s in fw)
        if njvp:  # Jacobian-vector products (newton_krylov), counted apart from f-evaluations
            out["forward_njvp"] = float(njvp)
    if bw:
        out["backward_nstep"] = float(sum(s.nstep for s in bw))
        out["backward_rel_residual"] = max(s.rel_max for s in bw)
        out["backward_abs_residual"] = max(s.abs_max for s in bw)
        out["backward_converged"] = float(all(s.converged for s in bw))
    return out


@dataclass(frozen=True)
class ChainStage:
    """One equilibrium of a model seen as a chain (:meth:`DEQModel.chain`): from the previous
    stage's output h (the model's input for the first), u = ``inject(h)``, z* = the fixed point
    of ``layer`` from ``z0(u)``, and the stage's output ``finish(z*)`` (z* itself where None)."""

    inject: Callable[[Tensor], Tensor]
    layer: DEQLayer
    z0: Callable[[Tensor], Tensor]
    finish: Callable[[Tensor], Tensor] | None = None


def chain_problem(model: nn.Module) -> str | None:
    """Why ``model`` cannot be taken apart along :meth:`DEQModel.chain` (not a DEQModel, no DEQ
    layer, or a chain that does not name its DEQ layers, each once, in order), or None."""
    layers = list(deq_layers(model))
    if not isinstance(model, DEQModel) or not layers:
        return "the model is not a DEQModel with inject/readout/z0"
    chained = [st.layer for st in model.chain()[0]]
    if len(chained) != len(layers) or any(a is not b for a, b in zip(chained, layers)):
        return (f"the model has {len(layers)} DEQ layers and its chain() names "
                f"{len(chained)} of them (a model with several overrides DEQModel.chain)")  # fmt: skip
    return None


class DEQModel(nn.Module):
    """Base class of DEQ models: ``readout(deq(inject(x), z0(u)))``.

    Subclasses set ``self.deq = DEQLayer(cell)`` and implement :meth:`inject` and
    :meth:`readout`; :meth:`z0` defaults to zeros shaped like ``u``. Models with several
    equilibrium layers override :meth:`forward` and hold several DEQLayers.
    """

    deq: DEQLayer

    def inject(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def readout(self, z: Tensor) -> Tensor:
        raise NotImplementedError

    def z0(self, u: Tensor) -> Tensor:
        return torch.zeros_like(u)

    @property
    def cell(self) -> nn.Module:
        return self.deq.cell

    def cell_parameters(self) -> list[nn.Parameter]:
        """The cells' own parameters (without those a cell declares as injection)."""
        return [p for layer in deq_layers(self) for _, p in cell_weights(layer.cell)]

    def chain(self) -> tuple[list[ChainStage], Callable[[Tensor], Tensor]]:
        """The model as a chain of equilibria and a head: ``forward(x)`` computes, stage after
        stage, h = finish(z*(inject(h))) from h = x, then ``head(h)``, with the same operations
        in the same order (captured training steps take a step apart along it). One stage here
        (inject, the DEQ layer, z0; the head is :meth:`readout`); a model with several DEQ
        layers overrides it, else it cannot take captured steps."""
        return [ChainStage(self.inject, self.deq, self.z0)], self.readout

    def equilibrium(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(z*, u) for input x under no_grad."""
        with torch.no_grad():
            u = self.inject(x)
            z, _ = self.deq.solve(u, self.z0(u))
        return z, u

    def forward(self, x: Tensor) -> Tensor:
        u = self.inject(x)
        z = self.deq(u, self.z0(u))
        return self.readout(z)

    @property
    def last_forward_stats(self) -> SolverStats | None:
        return self.deq.last_forward_stats

    @property
    def last_backward_stats(self) -> SolverStats | None:
        return self.deq.last_backward_stats
