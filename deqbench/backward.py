"""Backward modes of a DEQ layer: ``ift``, ``unrolled``, ``jfb``, ``phantom``.

``ift`` is a custom ``autograd.Function`` whose forward solves under no_grad and saves z*; its
backward solves the adjoint ``w = J^T w + g`` (J = df/dz at z*) with a registered solver and
returns ``(df/du)^T w`` and ``(df/dtheta)^T w``. The partials are taken with ``torch.func.vjp``
at (z*, u, theta) as independent primals, so when a double backward is requested
(``create_graph=True``, e.g. Hessian-vector products) z*'s dependence on theta routes back through
this same Function and the second derivatives are exact (up to the adjoint tolerance and
``refine`` differentiable adjoint steps). Hook-based IFT silently gets them wrong
(REFERENCE.md section 3.3).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.func import functional_call, vjp

from .solvers.base import make_stats, residuals

if TYPE_CHECKING:
    from .deq import DEQLayer


def _param_items(layer: DEQLayer) -> tuple[list[str], list[Tensor]]:
    names, params = [], []
    for n, p in layer.cell.named_parameters():
        if p.requires_grad:
            names.append(n)
            params.append(p)
    return names, params


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


class _ImplicitFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, layer, z0, u, *params):  # type: ignore[override]
        z, _ = layer.solve(u, z0)
        ctx.layer = layer
        ctx.save_for_backward(z, u, *params)
        return z

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        from . import solvers

        layer: DEQLayer = ctx.layer
        z, u, *params = ctx.saved_tensors
        names, _ = _param_items(layer)
        cell = layer.cell
        cfg = layer.backward_cfg

        create_graph = torch.is_grad_enabled()
        nvjp = 0
        if create_graph:
            # Double backward requested: partials by torch.func at (z*, u, theta) as independent
            # primals, so z*'s dependence on theta routes back through this Function.
            def fz(z_, u_, *p_):
                return functional_call(cell, dict(zip(names, p_)), (z_, u_))

            _, vjp_fn = vjp(fz, z, u, *params)
        else:
            # First order: one retained graph of f at (z*, u) with plain autograd (cheaper per
            # VJP than torch.func and avoids importing torch._dynamo on the first backward).
            with torch.enable_grad():
                z_ = z.detach().requires_grad_()
                u_ = u.detach().requires_grad_(u.requires_grad)
                # f at the saved parameters, not the cell's attributes: under
                # torch.func.functional_call the forward ran with substituted tensors that the
                # module no longer holds when this backward runs.
                p_ = [p.detach().requires_grad_() for p in params]
                fz_out = functional_call(cell, dict(zip(names, p_)), (z_, u_))
            inputs = [z_] + ([u_] if u.requires_grad else []) + p_

            def vjp_fn(w: Tensor) -> tuple[Tensor | None, ...]:
                gs = torch.autograd.grad(fz_out, inputs, w, retain_graph=True, allow_unused=True)
                gz, rest = gs[0], list(gs[1:])
                gu = rest.pop(0) if u.requires_grad else None
                gz = torch.zeros_like(w) if gz is None else gz
                return (gz, gu, *rest)

        def adj(w: Tensor) -> Tensor:
            return vjp_fn(w)[0] + g

        with torch.no_grad():
            gd = g.detach()

            def adj_fn(w: Tensor) -> Tensor:
                return vjp_fn(w)[0].detach() + gd

            adj_ng = AdjointMap(adj_fn, cell, z, u, gd)
            w0 = gd.clone() if cfg.b_init == "grad" else torch.zeros_like(gd)
            w, stats = solvers.get(cfg.solver)(
                adj_ng,
                w0,
                max_iter=cfg.max_iter,
                tol=cfg.tol,
                stop_mode=cfg.stop_mode,
                **cfg.options,
            )
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
        layer.last_backward_stats = stats
        layer.vjp_bwd = nvjp
        return (None, None, grads[1], *grads[2:])


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

        from . import solvers

        layer: DEQLayer = ctx.layer
        w, z, u, *params = ctx.saved_tensors
        names, _ = _param_items(layer)
        cell = layer.cell
        cfg = layer.backward_cfg
        with torch.no_grad():
            pd = {n: p.detach() for n, p in zip(names, params)}
            ud = u.detach()
            zd = z.detach()

            def jvp_fn(v_: Tensor) -> Tensor:
                return jvp(lambda zz: functional_call(cell, pd, (zz, ud)), (zd,), (v_,))[1]

            cd = c.detach()
            # The tangent map v -> J v + c carries no family structure: a solver that needs one
            # (``needs_structure``, e.g. monDEQ splitting) is replaced by Anderson here.
            solve = solvers.get(cfg.solver)
            opts = cfg.options
            if getattr(solve, "needs_structure", False):
                solve, opts = solvers.get("anderson"), {}
            v, _ = solve(
                lambda v_: jvp_fn(v_) + cd,
                cd.clone(),
                max_iter=cfg.max_iter,
                tol=cfg.tol,
                stop_mode=cfg.stop_mode,
                **opts,
            )
        with torch.enable_grad():
            z_ = z.detach().requires_grad_()
            u_ = u.detach().requires_grad_()
            p_ = [p.detach().requires_grad_() for p in params]
            _, jv = jvp(
                lambda zz: functional_call(cell, dict(zip(names, p_)), (zz, u_)), (z_,), (v,)
            )
            grads = torch.autograd.grad((w.detach() * jv).sum(), [z_, u_, *p_], allow_unused=True)
        return (None, None, v, *grads)


def _ift(layer: DEQLayer, u: Tensor, z0: Tensor) -> Tensor:
    _, params = _param_items(layer)
    layer.f_evals_grad = 0
    return _ImplicitFunction.apply(layer, z0.detach(), u, *params)


def _unrolled(layer: DEQLayer, u: Tensor, z0: Tensor) -> Tensor:
    k = max(1, int(layer.backward_cfg.k))
    from . import solvers

    # A forward solver may define its own differentiable k-step iteration (e.g. SAM, papers/003
    # Eq. 12); otherwise unroll plain iteration.
    unroll = getattr(solvers.get(layer.solver_cfg.name), "unroll", None)
    if unroll is not None:
        z, abs_tr, rel_tr = unroll(lambda z_: layer.cell(z_, u), z0, k, **layer.solver_cfg.options)
    else:
        z = z0
        prev = z
        abs_tr, rel_tr = [], []
        for _ in range(k):
            prev = z
            z = layer.cell(z, u)
            a, r = residuals(z.detach(), prev.detach())
            abs_tr.append(a)
            rel_tr.append(r)
    # The residual of the last iterate is that of z_{K-1} (f(z_{K-1}) = z_K is what we return).
    cfg = layer.solver_cfg
    layer.last_forward_stats = make_stats(
        "unrolled",
        k,
        abs_tr,
        rel_tr,
        abs_tr[-1],
        rel_tr[-1],
        cfg.tol,
        cfg.stop_mode,
        diverged=not bool(torch.isfinite(z.detach()).all()),
        lowest_step=k - 1,
    )
    layer.last_backward_stats = None
    layer.f_evals_grad = k
    return z


def _phantom(layer: DEQLayer, u: Tensor, z0: Tensor, k: int, tau: float) -> Tensor:
    zs, _ = layer.solve(u, z0)
    z = zs.detach()
    for _ in range(k):
        fz = layer.cell(z, u)
        z = fz if tau == 1.0 else tau * fz + (1 - tau) * z
    layer.last_backward_stats = None
    layer.f_evals_grad = k
    return z


def apply(layer: DEQLayer, u: Tensor, z0: Tensor) -> Tensor:
    """Run ``layer``'s forward with its configured backward mode (grad enabled)."""
    cfg = layer.backward_cfg
    if cfg.name == "ift":
        return _ift(layer, u, z0)
    if cfg.name == "unrolled":
        return _unrolled(layer, u, z0)
    if cfg.name == "jfb":
        return _phantom(layer, u, z0, 1, 1.0)
    if cfg.name == "phantom":
        return _phantom(layer, u, z0, max(1, int(cfg.k)), float(cfg.tau))
    raise ValueError(f"unknown backward mode {cfg.name!r}")
