"""The implicit (IFT) backward of a DEQ layer and the dispatch to its backward mode.

The backward modes themselves are registered in :mod:`deqbench.backward` (one module each:
``ift``, ``unrolled``, ``jfb``, ``phantom``, ``reversible``, ``shine``, and plugins of the
entry-point group ``deqbench.backward``); :func:`apply` dispatches to the layer's mode. This
module holds the IFT machinery the ``ift`` mode runs:

``ift`` is a custom ``autograd.Function`` whose forward solves under no_grad and saves z*; its
backward solves the adjoint ``w = J^T w + g`` (J = df/dz at z*) with a registered solver and
returns ``(df/du)^T w`` and ``(df/dtheta)^T w``. The partials are taken with ``torch.func.vjp``
at (z*, u, theta) as independent primals, so when a double backward is requested
(``create_graph=True``, e.g. Hessian-vector products) z*'s dependence on theta routes back through
this same Function and the second derivatives are exact (up to the adjoint tolerance and
``refine`` differentiable adjoint steps). Hook-based IFT silently gets them wrong
(the hook's gradient does not depend on theta through z*). With ``second_order="implicit"`` the adjoint is itself a
differentiable implicit function (:class:`_AdjointFunction`): its derivative is one more linear
solve, the tangent ``v = J v + c`` (:class:`TangentMap`), with the adjoint's solver.

Structured solvers (monDEQ splitting) read the cell's weights themselves: they run with the
weights bound to the parameters the Function saved (:func:`with_params`), which under
``functional_call`` (finite-difference Hessians, landscapes) are not the module's own.
:func:`deqbench.deq.direct_solves` makes both linear solves exact per-sample LU solves, factored once per
point (small states; the Hessian analysis).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.func import functional_call, vjp

from ..solvers.base import SolverStats, make_stats, residuals
from . import verdict
from .config import BackwardConfig, Runtime, SolverConfig
from .registry import solvers as solver_registry


def _quiet_jvp_import() -> None:
    """torch.func.jvp imports torch._decomp.decompositions_for_jvp on its first call, which uses
    the deprecated torch.jit.script and prints a FutureWarning on the user's terminal in the
    middle of a run; import it here once with that warning silenced."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.jit.script.*", category=FutureWarning)
        try:
            import torch._decomp.decompositions_for_jvp  # noqa: F401
        except Exception:  # noqa: BLE001 - a private module; absent in other torch versions
            pass


_quiet_jvp_import()


class Layer(Protocol):
    """What the backward modes read and write of a DEQ layer (:class:`deqbench.deq.DEQLayer`,
    which imports this module: described here rather than imported, so that the two modules form
    no import circle)."""

    cell: nn.Module
    solver_cfg: SolverConfig
    backward_cfg: BackwardConfig
    runtime: Runtime
    last_forward_stats: SolverStats | None
    last_backward_stats: SolverStats | None
    f_evals_grad: int
    vjp_bwd: int

    def f(self, z: Tensor, u: Tensor) -> Tensor: ...

    def solve(
        self, u: Tensor, z0: Tensor, cfg: SolverConfig | None = None
    ) -> tuple[Tensor, SolverStats]: ...

    def graph_allowed(self, solver: Any, options: dict[str, Any], state: Tensor) -> bool: ...

    def storage_key(self) -> tuple: ...


def param_items(layer: Layer) -> tuple[list[str], list[Tensor]]:
    names: list[str] = []
    params: list[Tensor] = []
    for n, p in layer.cell.named_parameters():
        if p.requires_grad:
            names.append(n)
            params.append(p)
    return names, params


def f_graph(
    layer: Layer,
    z: Tensor,
    u: Tensor,
    params: Sequence[Tensor],
    need_u: bool,
    items: tuple[list[str], list[Tensor]] | None = None,
) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """f(z*, u) rebuilt with autograd for a backward: (out, z_, u_, p_) with fresh leaves z_, u_
    (requiring grad when ``need_u``) and the saved parameters p_, under the forward solve's
    autocast, out in z's dtype. f runs at the saved parameters, not the cell's attributes: under
    ``torch.func.functional_call`` the forward ran with substituted tensors that the module no
    longer holds when the backward runs. Where the saved parameters are the cell's own (a
    training step) and carry no gradient hooks, f is the cell's own call and p_ those
    parameters (the gradients asked of them are returned, not accumulated): the same graph
    without functional_call's rebinding of the module, a third of f's host time."""
    names, own = param_items(layer) if items is None else items
    with torch.enable_grad():
        z_ = z.detach().requires_grad_()
        u_ = u.detach().requires_grad_(need_u)
        if _own_parameters(own, params):
            p_ = list(params)
            with layer.runtime.autocast(z_.device):  # the f of the forward solve
                out = layer.cell(z_, u_)
        else:
            p_ = [p.detach().requires_grad_() for p in params]
            with layer.runtime.autocast(z_.device):
                out = functional_call(layer.cell, dict(zip(names, p_)), (z_, u_))
        out = out.to(z_.dtype)
    return out, z_, u_, p_


def _own_parameters(own: Sequence[Tensor], params: Sequence[Tensor]) -> bool:
    """Whether ``params`` are the tensors ``own`` themselves and none has a gradient hook
    (``register_hook``: it would also run on the partial gradients taken of them)."""
    return len(own) == len(params) and all(
        a is b and not b._backward_hooks for a, b in zip(own, params)
    )


class _Thunk(nn.Module):
    """Runs a thunk as its forward, so that functional_call binds ``cell``'s parameters for it."""

    def __init__(self, cell: nn.Module) -> None:
        super().__init__()
        self.cell = cell

    def forward(self, fn: Callable[[], Any]) -> Any:
        return fn()


def with_params(
    cell: nn.Module, names: list[str], params: list[Tensor], fn: Callable[[], Any]
) -> Any:
    """``fn()`` with the parameters ``names`` of ``cell`` bound to ``params`` (as under
    ``torch.func.functional_call``); the module's own parameters are restored afterwards."""
    return functional_call(_Thunk(cell), {f"cell.{n}": p for n, p in zip(names, params)}, (fn,))


class AdjointMap:
    """The adjoint map ``w -> J^T w + g`` (J = df/dz at z*) handed to the IFT adjoint solver.

    Generic solvers just call it. It exposes ``cell``, ``z`` (z*), ``u`` and ``g`` so that
    solvers needing a family's structure can solve the linear adjoint system their own way
    (e.g. monDEQ's splitting backward); such a solver returns the same ``w``.
    """

    __slots__ = ("fn", "cell", "z", "u", "g")

    def __init__(self, fn, cell, z: Tensor, u: Tensor, g: Tensor) -> None:
        self.fn, self.cell, self.z, self.u, self.g = fn, cell, z, u, g

    def __call__(self, w: Tensor) -> Tensor:
        return self.fn(w)


class GraphAdjoint:
    """A captured IFT adjoint: f at (z*, u, theta) recorded once as a CUDA graph with
    its autograd graph kept, so that the adjoint solver's steps (VJPs of that recording) can be
    captured and replayed too. Per backward the new z*, u and g are copied into static tensors,
    the recording is replayed (refreshing the saved activations in place) and the cached adjoint
    solve replays from its first step.

    Every capture uses ``torch.cuda.graph``'s default capture stream: the VJP kernels run on the
    stream of the recorded forward, so the solver's capture sees them on its own stream (the
    pattern of ``torch.cuda.make_graphed_callables``). Only for layers whose saved parameters
    are the cell's own (training), first-order backward, no direct solver.
    """

    def __init__(self, layer: Layer, names: list[str], params: list[Tensor], z: Tensor,
                 u: Tensor, u_grad: bool) -> None:  # fmt: skip
        self.u_grad = u_grad
        self.key: tuple = ()
        self.zs = z.detach().clone().requires_grad_()
        self.us = u.detach().clone().requires_grad_(u_grad)
        self.gs = torch.zeros_like(z)
        # The parameters' storage under version counters of their own (``.data``): the
        # optimiser's in-place updates must not invalidate the recording, whose replay reads
        # the updated values. Likewise load() writes the static inputs through ``.data``.
        self.ps = [q.data.requires_grad_() for q in params]
        self.inputs = [self.zs] + ([self.us] if u_grad else []) + self.ps
        cell, rt = layer.cell, layer.runtime

        # buffers too (e.g. BatchNorm statistics updated in place by training forwards)
        tensors = dict(zip(names, self.ps))
        tensors.update({n: b.data for n, b in cell.named_buffers()})

        def record() -> Tensor:
            with torch.enable_grad(), rt.autocast(z.device):
                out = functional_call(cell, tensors, (self.zs, self.us))
            return out.to(self.zs.dtype)

        from ..solvers.base import forbid_sync

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), forbid_sync():  # warm-up (and no host syncs) first
            torch.autograd.grad(record(), self.zs, self.gs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = record()
        zs, gs, out = self.zs, self.gs, self.out

        def adj_fn(w: Tensor) -> Tensor:
            (gz,) = torch.autograd.grad(out, zs, w, retain_graph=True)
            return gz + gs

        self.map = AdjointMap(adj_fn, cell, zs, self.us, gs)

    def load(self, z: Tensor, u: Tensor, g: Tensor) -> None:
        """Copy this backward's z*, u and g in and replay the recording of f."""
        with torch.no_grad():
            self.zs.data.copy_(z)
            self.us.data.copy_(u)
            self.gs.copy_(g)
        self.graph.replay()

    def grads(self, w: Tensor) -> tuple[Tensor | None, ...]:
        """(dz, du or None, *dtheta) of <w, f> at the loaded point, as vjp_fn returns them."""
        gs = torch.autograd.grad(self.out, self.inputs, w, retain_graph=True, allow_unused=True)
        gz, rest = gs[0], list(gs[1:])
        gu = rest.pop(0) if self.u_grad else None
        return (gz, gu, *rest)


#: captured adjoints kept per layer
GRAPH_ADJOINTS = 2


def graph_adjoint(
    layer: Layer, names: list[str], params: list[Tensor], z: Tensor, u: Tensor, cfg: Any
) -> GraphAdjoint | None:
    """The layer's captured adjoint for this backward, or None for the eager path."""
    from .. import solvers

    if not layer.graph_allowed(solvers.get(cfg.solver), cfg.options, z):
        return None
    own = [q for q in layer.cell.parameters() if q.requires_grad]
    if (
        len(own) != len(params)
        or any(a is not b for a, b in zip(own, params))
        or not all(isinstance(q, nn.Parameter) for q in own)
    ):
        return None  # parameters substituted (functional_call): no stable storage to capture
    key = (tuple(z.shape), z.dtype, z.stride(), tuple(u.shape), u.dtype, u.stride(),
           u.requires_grad) + layer.storage_key()  # fmt: skip
    cache: dict = layer.__dict__.setdefault("_graph_adjoints", {})
    failed: dict = layer.__dict__.setdefault("_no_graph_adjoint", {})
    if key in failed:
        return None
    ga = cache.get(key)
    if ga is None:
        while len(cache) >= GRAPH_ADJOINTS:
            from ..solvers.base import drop_graphs

            drop_graphs([cache.pop(next(iter(cache))).map])
        try:
            ga = GraphAdjoint(layer, names, params, z, u, u.requires_grad)
        except Exception as exc:  # noqa: BLE001 - not capturable: eager from now on
            failed[key] = f"{type(exc).__name__}: {exc}"
            return None
        ga.key = key
        cache[key] = ga
    return ga


def forget_graph_adjoint(layer: Layer, ga: GraphAdjoint, why: str) -> None:
    from ..solvers.base import drop_graphs

    drop_graphs([ga.map])
    layer.__dict__.get("_graph_adjoints", {}).pop(ga.key, None)
    layer.__dict__.setdefault("_no_graph_adjoint", {})[ga.key] = why


class TangentMap:
    """The tangent map ``v -> J v + c`` (J = df/dz at z*) of a double backward: the transpose of
    the adjoint system, solved with the adjoint's solver. It exposes ``cell``, ``z``, ``u`` and
    ``c`` (no ``g``: structured solvers tell it from an :class:`AdjointMap` by that). A solver
    that ``needs_structure`` gets it only if it declares ``solves_tangent = True`` (monDEQ
    splitting: ``v - c`` solves a forward-type splitting problem); otherwise Anderson solves
    the tangent system."""

    __slots__ = ("fn", "cell", "z", "u", "c")

    def __init__(self, fn, cell, z: Tensor, u: Tensor, c: Tensor) -> None:
        self.fn, self.cell, self.z, self.u, self.c = fn, cell, z, u, c

    def __call__(self, v: Tensor) -> Tensor:
        return self.fn(v)


#: most work n * d**3 (n samples, d the state size per sample) of a direct solve
DIRECT_MAX_WORK = {"cuda": 2e10, "cpu": 3e8}
#: most bytes of the per-sample Jacobians of a direct solve
DIRECT_MAX_BYTES = 1 << 30


class DirectSolver:
    """Exact IFT linear solves for small states: the per-sample Jacobians ``J_i = df/dz_i`` at z*
    (one ``vmap(jacrev)`` of the cell at the saved parameters) and a batched LU of ``I - J_i``,
    kept for the next solve at the same (z*, u, theta), so the adjoint ``(I - J^T) w = g`` and
    the tangent ``(I - J) v = c`` of every Hessian-vector product at one point share one
    factorisation. Every solution is checked against the true batched map (one VJP or JVP); a
    cell that couples samples, cannot be vmapped or is too large turns the solver off
    (``off`` says why) and the layer's iterative solver is used instead.

    Enabled per layer by :func:`deqbench.deq.direct_solves` (the Hessian analysis); never during training.
    """

    def __init__(self) -> None:
        self.off = ""
        self.key: tuple | None = None
        self.refs: tuple = ()
        self.lu: tuple[Tensor, Tensor] | None = None
        self.factorisations = 0
        self.solves = 0

    @staticmethod
    def _key(ts: list[Tensor]) -> tuple:
        return tuple((t.data_ptr(), t._version, tuple(t.shape), t.dtype) for t in ts)

    def factor(
        self, cell: nn.Module, names: list[str], z: Tensor, u: Tensor, params: list[Tensor]
    ) -> bool:
        from torch.func import jacrev, vmap

        key = self._key([z, u, *params])
        if key == self.key and self.lu is not None:
            return True
        n, shape = z.shape[0], z.shape[1:]
        d = z[0].numel()
        work = DIRECT_MAX_WORK.get(z.device.type, DIRECT_MAX_WORK["cpu"])
        if n * d**3 > work or n * d * d * z.element_size() * 3 > DIRECT_MAX_BYTES:
            self.off = f"state too large for a direct solve (n={n}, d={d})"
            return False
        pd = {k: p.detach() for k, p in zip(names, params)}

        def f1(zi: Tensor, ui: Tensor) -> Tensor:
            return functional_call(cell, pd, (zi.view(1, *shape), ui.unsqueeze(0))).reshape(-1)

        try:
            with torch.no_grad():
                J = vmap(jacrev(f1))(z.detach().reshape(n, d), u.detach())
                eye = torch.eye(d, dtype=J.dtype, device=J.device)
                LU, piv, info = torch.linalg.lu_factor_ex(eye - J)
        except Exception as exc:  # noqa: BLE001 - not vmappable: use the iterative solver
            self.off = f"per-sample Jacobian failed: {type(exc).__name__}"
            return False
        if bool((info != 0).any()):
            self.off = "I - J singular"
            return False
        self.key, self.refs, self.lu = key, (z, u, *params), (LU, piv)
        self.factorisations += 1
        return True

    def solve(self, rhs: Tensor, transpose: bool) -> Tensor:
        assert self.lu is not None
        LU, piv = self.lu
        n = rhs.shape[0]
        x = torch.linalg.lu_solve(LU, piv, rhs.reshape(n, -1, 1), adjoint=transpose)
        self.solves += 1
        return x.reshape(rhs.shape)


def _linear_solve(
    direct: tuple[Tensor, SolverStats] | None,
    solve: Any,
    cell: nn.Module,
    names: Any,
    params: Any,
    run: Callable[[], tuple[Tensor, SolverStats]],
) -> tuple[Tensor, SolverStats]:
    """One linear solve of the IFT (adjoint or second-order tangent): the per-sample direct
    result when there is one, else ``run()`` with the solver. A structured solver (monDEQ
    splitting) reads the cell's weights itself, so they are bound to the parameters the Function
    saved: under functional_call (Hessian FD steps, landscapes) the module no longer holds them
    when the backward runs, and the adjoint was solved for the unperturbed weights (an FD-HVP
    18-100% off)."""
    if direct is not None:
        return direct
    if getattr(solve, "needs_structure", False):
        return with_params(cell, names, list(params), run)
    return run()


def _direct(
    layer: Layer,
    names: list[str],
    z: Tensor,
    u: Tensor,
    params: Any,
    rhs: Tensor,
    true_map: Callable[[Tensor], Tensor],
    cfg: Any,
    transpose: bool,
) -> tuple[Tensor, SolverStats] | None:
    """(x, stats) of the direct solve of ``x = J^T x + rhs`` (``transpose``) or ``x = J x + rhs``
    when the layer has an enabled :class:`DirectSolver`, else None. The solution's canonical
    residual is measured with ``true_map`` (the batched map); above the tolerance the direct
    solver is turned off for this layer (samples interact) and None is returned."""
    ds: DirectSolver | None = layer.__dict__.get("direct_solver")
    if ds is None or ds.off:
        return None
    with torch.no_grad():
        if not ds.factor(layer.cell, names, z, u, list(params)):
            return None
        x = ds.solve(rhs, transpose)
        a, r = residuals(true_map(x), x)
    eps = float(torch.finfo(x.dtype).eps)
    limit = max(float(cfg.tol), 1e3 * eps)
    res = r if cfg.stop_mode == "rel" else a
    if not bool(torch.isfinite(res).all()) or float(res.max()) > limit:
        ds.off = f"direct solve residual {float(res.max()):.2e} > {limit:.0e} (samples interact?)"
        ds.lu, ds.refs, ds.key = None, (), None
        return None
    st = make_stats("direct", 1, [a], [r], a, r, limit, cfg.stop_mode, False, converged=True)
    return x, st


def _adjoint_tol(stats: SolverStats, cfg: Any) -> float:
    """The tolerance an adjoint solve is held to: the configured one, or a direct solve's own
    acceptance limit (max(tol, 1e3 eps), see :func:`_direct`)."""
    return float(stats.tol) if stats.solver == "direct" else float(cfg.tol)


class _ImplicitFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, layer, z0, u, *params):  # type: ignore[override]
        z, _ = layer.solve(u, z0)
        ctx.layer = layer
        ctx.ledger = verdict.current()  # the backward may run in another thread (CUDA)
        ctx.save_for_backward(z, u, *params)
        return z

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        layer: Layer = ctx.layer
        z, u, *params = ctx.saved_tensors
        items = param_items(layer)
        names = items[0]
        cell = layer.cell
        cfg = layer.backward_cfg

        create_graph = torch.is_grad_enabled()
        nvjp = 0
        ga = None
        if not create_graph and z.is_cuda and layer.__dict__.get("direct_solver") is None:
            ga = graph_adjoint(layer, names, list(params), z, u, cfg)
        if ga is not None:
            from ..solvers.base import GraphCaptureError

            try:
                w, stats, nvjp = graph_adjoint_solve(ga, z, u, g, cfg)
            except (GraphCaptureError, RuntimeError) as exc:  # eager from now on
                # RuntimeError: e.g. the recording's saved tensors were modified in place
                forget_graph_adjoint(layer, ga, f"{type(exc).__name__}: {exc}")
                ga = None
            if ga is not None:
                grads = ga.grads(w)
                verdict.check_claim(
                    stats,
                    _adjoint_tol(stats, cfg),
                    cfg.stop_mode,
                    cfg.solver,
                    cfg.options.get("stop"),
                )
                verdict.record("adjoint", stats, cfg.max_iter, getattr(ctx, "ledger", None))
                _record(layer, last_backward_stats=stats, vjp_bwd=nvjp + 1)
                return (None, None, grads[1], *grads[2:])
        if create_graph:
            # Double backward requested: partials by torch.func at (z*, u, theta) as independent
            # primals, so z*'s dependence on theta routes back through this Function.
            def fz(z_, u_, *p_):
                return functional_call(cell, dict(zip(names, p_)), (z_, u_))

            _, vjp_fn = vjp(fz, z, u, *params)
        else:
            # First order: one retained graph of f at (z*, u) with plain autograd (cheaper per
            # VJP than torch.func and avoids importing torch._dynamo on the first backward).
            fz_out, z_, u_, p_ = f_graph(layer, z, u, params, u.requires_grad, items)
            # the backward returns the input's and the parameters' gradients: w^T df/dz is
            # not asked for at the solution (a VJP through f's input op saved)
            inputs = ([u_] if u.requires_grad else []) + p_

            def vjp_fn(w: Tensor) -> tuple[Tensor | None, ...]:
                if not inputs:
                    return (None, None)
                gs = torch.autograd.grad(fz_out, inputs, w, retain_graph=True, allow_unused=True)
                rest = list(gs)
                gu = rest.pop(0) if u.requires_grad else None
                return (None, gu, *rest)

        def vjp_z(w: Tensor) -> Tensor:
            """w^T df/dz alone: the adjoint iteration needs no input or parameter gradients
            (asking autograd for them at every step cost a weight-gradient convolution per
            iteration); the parameters' come once, from ``vjp_fn`` at the solution."""
            if create_graph:
                return vjp_fn(w)[0]  # type: ignore[return-value]
            (gz,) = torch.autograd.grad(fz_out, [z_], w, retain_graph=True, allow_unused=True)
            return torch.zeros_like(w) if gz is None else gz

        def adj(w: Tensor) -> Tensor:
            return vjp_z(w) + g

        with torch.no_grad():
            gd = g.detach()

            def adj_fn(w: Tensor) -> Tensor:
                gz = vjp_z(w)
                return (gz.detach() if create_graph else gz) + gd

            adj_ng = AdjointMap(adj_fn, cell, z, u, gd)
            w0 = gd.clone() if cfg.b_init == "grad" else torch.zeros_like(gd)
            solve = solver_registry.get(cfg.solver)
            direct = _direct(layer, names, z, u, params, gd, adj_fn, cfg, transpose=True)

            def run() -> tuple[Tensor, SolverStats]:
                return solve(
                    adj_ng,
                    w0,
                    max_iter=cfg.max_iter,
                    tol=cfg.tol,
                    stop_mode=cfg.stop_mode,
                    **cfg.options,
                )

            w, stats = _linear_solve(direct, solve, cell, names, params, run)
        nvjp += stats.nstep
        if create_graph and cfg.second_order == "implicit":
            # w(g, z*, u, theta) is itself an implicit function (w = J^T w + g): its own
            # derivative comes from one more linear solve in _AdjointFunction.backward.
            w = _AdjointFunction.apply(layer, w.detach(), g, z, u, *params)
        elif create_graph:
            w = w.detach()
            for _ in range(cfg.refine):
                w = adj(w)
            nvjp += cfg.refine
        grads = vjp_fn(w)
        nvjp += 1
        verdict.check_claim(
            stats, _adjoint_tol(stats, cfg), cfg.stop_mode, cfg.solver, cfg.options.get("stop")
        )
        verdict.record("adjoint", stats, cfg.max_iter, getattr(ctx, "ledger", None))
        _record(layer, last_backward_stats=stats, vjp_bwd=nvjp)
        return (None, None, grads[1], *grads[2:])


def graph_adjoint_solve(
    ga: GraphAdjoint, z: Tensor, u: Tensor, g: Tensor, cfg: Any
) -> tuple[Tensor, SolverStats, int]:
    """The adjoint solve on the captured path: (w, stats, VJPs made)."""
    from .. import solvers

    ga.load(z, u, g)
    with torch.no_grad():
        w0 = ga.gs.clone() if cfg.b_init == "grad" else torch.zeros_like(ga.gs)
        w, stats = solvers.get(cfg.solver)(
            ga.map, w0, max_iter=cfg.max_iter, tol=cfg.tol, stop_mode=cfg.stop_mode,
            **cfg.options, cuda_graph="cache",
        )  # fmt: skip
    return w, stats, stats.nstep


class _AdjointFunction(torch.autograd.Function):
    """w = (I - J^T)^{-1} g as a differentiable function of (g, z*, u, theta).

    Forward returns the already converged adjoint ``w``. Backward, for a cotangent ``c`` on w,
    solves the tangent system ``v = J v + c`` (JVPs of f in z at z*) and returns ``v`` for g and
    d/d(z, u, theta) of <w, J(z, u, theta) v> (second derivatives of f at fixed w and v). This is
    the exact derivative of the adjoint, so Hessian-vector products through ``ift`` need no
    unrolled refinement steps.
    """

    @staticmethod
    def forward(ctx, layer, w, g, z, u, *params):  # type: ignore[override]
        ctx.layer = layer
        ctx.save_for_backward(w, z, u, *params)
        return w.clone()

    @staticmethod
    def backward(ctx, c):  # type: ignore[override]
        from torch.func import jvp

        from .. import solvers

        layer: Layer = ctx.layer
        w, z, u, *params = ctx.saved_tensors
        names, _ = param_items(layer)
        cell = layer.cell
        cfg = layer.backward_cfg
        with torch.no_grad():
            pd = {n: p.detach() for n, p in zip(names, params)}
            ud = u.detach()
            zd = z.detach()

            def jvp_fn(v_: Tensor) -> Tensor:
                return jvp(lambda zz: functional_call(cell, pd, (zz, ud)), (zd,), (v_,))[1]

            cd = c.detach()

            def tan_fn(v_: Tensor) -> Tensor:
                return jvp_fn(v_) + cd

            # The tangent system v = J v + c is the transpose of the adjoint's: the same solver
            # (a structured one, e.g. monDEQ splitting, through a TangentMap with the weights
            # bound to the saved parameters, if it declares ``solves_tangent``; else Anderson),
            # or the direct per-sample LU when enabled.
            solve, opts = solvers.get(cfg.solver), cfg.options
            if getattr(solve, "needs_structure", False) and not getattr(
                solve, "solves_tangent", False
            ):
                solve, opts = solvers.get("anderson"), {}
            direct = _direct(layer, names, z, u, params, cd, tan_fn, cfg, transpose=False)

            def run() -> tuple[Tensor, SolverStats]:
                return solve(
                    TangentMap(tan_fn, cell, zd, ud, cd),
                    cd.clone(),
                    max_iter=cfg.max_iter,
                    tol=cfg.tol,
                    stop_mode=cfg.stop_mode,
                    **opts,
                )

            v, st = _linear_solve(direct, solve, cell, names, params, run)
            layer.last_tangent_stats = st
        with torch.enable_grad():
            z_ = z.detach().requires_grad_()
            u_ = u.detach().requires_grad_()
            p_ = [p.detach().requires_grad_() for p in params]
            _, jv = jvp(
                lambda zz: functional_call(cell, dict(zip(names, p_)), (zz, u_)), (z_,), (v,)
            )
            grads = torch.autograd.grad((w.detach() * jv).sum(), [z_, u_, *p_], allow_unused=True)
        return (None, None, v, *grads)


def _record(layer: Layer, **values: Any) -> None:
    """Set plain attributes of ``layer`` (a DEQ layer's per-pass records) through its
    ``__dict__``: ``nn.Module.__setattr__`` checks for parameters, buffers and submodules
    first, a few microseconds a call."""
    if isinstance(layer, nn.Module):
        layer.__dict__.update(values)
    else:
        for k, v in values.items():
            setattr(layer, k, v)


def implicit(layer: Layer, u: Tensor, z0: Tensor) -> Tensor:
    """z* of ``layer`` with the IFT backward (the ``ift`` mode, :mod:`deqbench.backward.ift`)."""
    _, params = param_items(layer)
    _record(layer, f_evals_grad=0)
    return _ImplicitFunction.apply(layer, z0.detach(), u, *params)


def apply(layer: Layer, u: Tensor, z0: Tensor) -> Tensor:
    """Run ``layer``'s forward with its configured backward mode (grad enabled): the registered
    mode's :meth:`~deqbench.backward.BackwardMode.apply` (built-in or plugin, one dispatch)."""
    from ..backward.base import mode_of

    return mode_of(layer.backward_cfg.name).apply(layer, u, z0)
