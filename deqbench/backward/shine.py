"""``shine``: SHaring the INverse Estimate (Ramzi et al., ICLR 2022; BACKWARD_LAB.md section 2).

The forward is Broyden's method (the forward solver must be ``broyden``) on g(z) = f(z) - z, which
builds a low-rank estimate of the inverse Jacobian of g, H = -I + sum_j u_j v_j^T ~ J_g^{-1}
(per sample). SHINE keeps its pairs (the solver's ``keep_inverse``; on the eager path: a layer
running ``shine`` never takes the captured CUDA-graph path for its training solves) and replaces
the adjoint solve (I - J^T) w = g of the implicit gradient by

    w = -H^T g = g - sum_j v_j (u_j . g)        (no f-evaluation, no VJP)

then one VJP through f at z* with w as the cotangent gives the gradients of u and theta.

Options (``BackwardConfig.options``; in a suite the extra keys of ``backward``):

* ``fallback`` (default true) with ``fallback_threshold`` 1.8: per sample, where
  ||w|| > 1.8 ||g|| the estimate is not trusted and w = g (the Jacobian-free gradient) instead;
  ``last_backward_info["fallback_fraction"]`` is the share of samples that fell back;
* ``refine_steps`` K (default 0): K Broyden steps on the adjoint residual r(w) = J^T w + g - w
  from the SHINE w (one VJP each, plus one for the first residual), started from the forward's
  estimate transposed, H^T (``refine_init="transpose"``; "identity": from -I, i.e. the forward's
  estimate not shared); they stop early at the backward ``tol`` (``stop_mode``), and
  ``last_backward_stats`` records them. With K large this converges to the IFT gradient.

Plain SHINE is an approximation with no equality target: H is accurate only along the directions
the forward explored. Its quality depends on the forward converging (``forward_rel_residual``).

Example:
    >>> import torch, deqbench
    >>> from deqbench.deq import BackwardConfig, SolverConfig, configure
    >>> m = deqbench.models.create("fc_deq_tiny")
    >>> configure(m, SolverConfig("broyden", max_iter=50, tol=1e-6), BackwardConfig("shine"))
    >>> m(torch.randn(4, 64)).sum().backward()
    >>> 0.0 <= m.deq.last_backward_info["fallback_fraction"] <= 1.0
    True
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from ..core.backward import f_graph, param_items
from ..core.registry import backward_modes
from ..solvers.base import make_stats
from .base import BackwardMode


class ShineOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    #: per sample, use the Jacobian-free w = g where the SHINE w is too large
    fallback: bool = True
    #: the fallback's threshold: ||w|| > fallback_threshold ||g||
    fallback_threshold: float = Field(1.8, gt=0)
    #: Broyden steps on the adjoint residual after the SHINE estimate (0: none)
    refine_steps: int = Field(0, ge=0)
    #: the refinement's initial inverse: the forward's H^T ("transpose") or -I ("identity")
    refine_init: Literal["transpose", "identity"] = "transpose"


def inverse_pairs(raw: Tensor | None, batch: int, dim: int) -> tuple[Tensor, Tensor]:
    """(U, V), each (B, m, D), from the rows Broyden hands out with ``keep_inverse``
    ((B, nc, 2m, cd) as [u_0, v_0, u_1, v_1, ...]; None: no pair yet, m = 0). Non-finite
    entries (an update lost to overflow) are zeroed, as the reference implementation does."""
    if raw is None or raw.shape[2] == 0:
        empty = torch.zeros(batch, 0, dim)
        return empty, empty
    b, nc, r, cd = raw.shape
    rows = raw.permute(0, 2, 1, 3).reshape(b, r, nc * cd)
    rows = torch.nan_to_num(rows, nan=0.0, posinf=0.0, neginf=0.0)
    return rows[:, 0::2], rows[:, 1::2]


def matvec(U: Tensor, V: Tensor, q: Tensor) -> Tensor:
    """H q = -q + sum_j u_j (v_j . q), per sample (q: (B, D))."""
    if U.shape[1] == 0:
        return -q
    return -q + torch.einsum("bm,bmd->bd", torch.einsum("bmd,bd->bm", V, q), U)


def rmatvec(U: Tensor, V: Tensor, q: Tensor) -> Tensor:
    """H^T q = -q + sum_j v_j (u_j . q), per sample."""
    return matvec(V, U, q)


def shine_adjoint(
    g: Tensor, U: Tensor, V: Tensor, fallback: bool = True, threshold: float = 1.8
) -> tuple[Tensor, Tensor]:
    """(w, fell_back): the SHINE adjoint w = -H^T g for cotangents ``g`` (B, D) and the
    inverse estimate's pairs (U, V); with ``fallback``, w = g exactly for each sample where
    ||w|| > threshold ||g|| (``fell_back``, a (B,) bool tensor, marks them)."""
    w = -rmatvec(U.to(g.dtype), V.to(g.dtype), g)
    if not fallback:
        return w, torch.zeros(g.shape[0], dtype=torch.bool, device=g.device)
    nw = torch.linalg.vector_norm(w, dim=1)
    ng = torch.linalg.vector_norm(g, dim=1)
    bad = ~(nw <= threshold * ng)  # also a non-finite w
    return torch.where(bad.unsqueeze(1), g, w), bad


def broyden_refine(
    adj: Any,
    w: Tensor,
    U: Tensor,
    V: Tensor,
    steps: int,
    tol: float,
    stop_mode: str = "rel",
) -> tuple[Tensor, Any]:
    """Broyden's (good) method on r(w) = adj(w) - w, adj(w) = J^T w + g (one VJP per call),
    from ``w`` with the initial inverse estimate -I + sum_j u_j v_j^T of (U, V): at most
    ``steps`` updates, stopping when the batch max residual (canonical, ``stop_mode``) is below
    ``tol``. Returns (the lowest-residual w per sample, SolverStats with nstep = adj calls)."""
    from ..solvers.base import residuals

    tiny = torch.finfo(w.dtype).eps ** 0.5
    aw = adj(w)
    r = aw - w
    a, rel = residuals(aw, w)
    abs_tr, rel_tr = [a], [rel]
    res = rel if stop_mode == "rel" else a
    best_w, best_a, best_r, best = w, a, rel, res
    nstep = 1
    Us, Vs = U, V
    for _ in range(steps):
        if bool((best < tol).all()):
            break
        p = -matvec(Us, Vs, r)
        wn = w + p
        awn = adj(wn)
        nstep += 1
        rn = awn - wn
        t = rn - r
        Bt = matvec(Us, Vs, t)
        v = rmatvec(Us, Vs, p)  # B^T s with s = p
        den = (p * Bt).sum(1)
        ok = torch.isfinite(den) & (den.abs() > tiny * (p.norm(dim=1) * Bt.norm(dim=1)))
        inv = torch.where(ok, 1.0 / torch.where(ok, den, 1.0), 0.0)
        u = (p - Bt) * inv.unsqueeze(1)
        Us = torch.cat([Us, u.unsqueeze(1)], 1)
        Vs = torch.cat([Vs, v.unsqueeze(1)], 1)
        w, r = wn, rn
        a, rel = residuals(awn, wn)
        abs_tr.append(a)
        rel_tr.append(rel)
        res = rel if stop_mode == "rel" else a
        better = res < best
        bm = better.unsqueeze(1)
        best_w = torch.where(bm, w, best_w)
        best_a, best_r = torch.where(better, a, best_a), torch.where(better, rel, best_r)
        best = torch.where(better, res, best)
    diverged = not bool(torch.isfinite(best).all())
    stats = make_stats(
        "shine_refine", nstep, abs_tr, rel_tr, best_a, best_r, tol, stop_mode, diverged
    )
    return best_w, stats


class _ShineFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, layer, z0, u, *params):  # type: ignore[override]
        cfg = layer.solver_cfg
        # the eager Broyden path hands out its pairs (the captured path cannot: cuda_graph off)
        opts = {**cfg.options, "keep_inverse": True, "cuda_graph": False}
        z, stats = layer.solve(u, z0, replace(cfg, options=opts))
        if "inverse" not in stats.extra:
            from ..core.errors import ConfigError

            raise ConfigError(
                f"backward mode 'shine' needs the forward solver 'broyden' (its inverse "
                f"estimate), got '{cfg.name}'"
            )
        raw = stats.extra.pop("inverse")
        b = z.shape[0]
        U, V = inverse_pairs(raw, b, z[0].numel())
        ctx.layer = layer
        ctx.save_for_backward(z, u, U.to(z.device), V.to(z.device), *params)
        return z

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):  # type: ignore[override]
        layer = ctx.layer
        z, u, U, V, *params = ctx.saved_tensors
        cfg = layer.backward_cfg
        opts = Shine().options(cfg)
        need_u = ctx.needs_input_grad[2]
        out, z_, u_, p_ = f_graph(layer, z, u, params, need_u)
        gf = g.detach().reshape(g.shape[0], -1)
        w, bad = shine_adjoint(gf, U, V, opts.fallback, opts.fallback_threshold)
        nvjp = 1
        layer.last_backward_stats = None
        if opts.refine_steps > 0:

            def adj(wf: Tensor) -> Tensor:
                (gz,) = torch.autograd.grad(out, z_, wf.view_as(z), retain_graph=True)
                return gz.reshape(wf.shape) + gf

            U0, V0 = (V, U) if opts.refine_init == "transpose" else (U[:, :0], V[:, :0])
            w, stats = broyden_refine(
                adj, w, U0.to(w.dtype), V0.to(w.dtype), opts.refine_steps, cfg.tol, cfg.stop_mode
            )
            nvjp += stats.nstep
            layer.last_backward_stats = stats
        inputs = ([u_] if need_u else []) + p_
        grads = list(
            torch.autograd.grad(out, inputs, w.view_as(z).to(out.dtype), allow_unused=True)
        ) if inputs else []  # fmt: skip
        layer.vjp_bwd = nvjp
        layer.last_backward_info = {
            "fallback_fraction": float(bad.float().mean()) if bad.numel() else 0.0,
            "inverse_pairs": float(U.shape[1]),
        }
        gu = grads.pop(0) if need_u else None
        return (None, None, gu, *grads)


@backward_modes.register("shine")
class Shine(BackwardMode):
    """SHINE: the adjoint from Broyden's inverse estimate (needs the forward solver
    ``broyden``); options: fallback, fallback_threshold, refine_steps, refine_init."""

    name = "shine"
    forward = "broyden"
    Options = ShineOptions
    fields: ClassVar[tuple[str, ...]] = ("tol", "stop_mode", "options")

    def apply(self, layer: Any, u: Tensor, z0: Tensor) -> Tensor:
        _, params = param_items(layer)
        layer.f_evals_grad = 0
        layer.last_backward_info = {}
        return _ShineFunction.apply(layer, z0.detach(), u, *params)

    def label(self, cfg: Any, forward: Any = None) -> str:
        if cfg is None:
            return self.name
        o = self.options(cfg)
        s = "shine"
        if o.refine_steps:
            s += f"-refine={o.refine_steps}" + ("-fromI" if o.refine_init == "identity" else "")
        if not o.fallback:
            s += "-nofallback"
        elif o.fallback_threshold != 1.8:
            s += f"-fb={o.fallback_threshold:g}"
        return s
