"""Batched engine of the empirical NTK (:mod:`deqbench.ntk`): rows, solves, per-sample
gradients block by block, float64 contraction.

* :func:`prepare`: one batched forward solve and one batched adjoint solve for all rows of K;
  for models that call their DEQ layers from their own forward (several layers, custom
  forward), one batched solve and one adjoint solve per DEQ-layer call, in reverse call order.
* :func:`jacobian_blocks`: per-sample gradients of the one-step surrogate with
  ``torch.func.vmap(grad(...))`` over ``functional_call``, block by block over parameter tensors
  (a tensor larger than the block budget is sliced);
* :func:`contract`: ``K = sum_b G_b G_b^T`` in float64, without concatenating the blocks.

:func:`deqbench.ntk.empirical_ntk` chains them; benchmarks time them one by one.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, jacrev, vjp, vmap

from ..core.backward import (
    AdjointMap,
    forget_graph_adjoint,
    graph_adjoint,
    graph_adjoint_solve,
    param_items,
)
from ..core.deq import DEQLayer, DEQModel, deq_layers
from ..solvers.base import GraphCaptureError

__all__ = [
    "NTKState",
    "prepare",
    "jacobian_blocks",
    "contract",
    "default_block_bytes",
    "standard_deq",
]


# -- rows: which (sample, output cotangent) pairs form K -------------------------------------------


def _cotangents(output: str | int, n: int, n_out: int, like: Tensor) -> tuple[Tensor, Tensor]:
    """(sample index per row (R,), output cotangent per row (R, O))."""
    from ..core.errors import ConfigError

    dev, dt = like.device, like.dtype
    ar = torch.arange(n, device=dev)
    if isinstance(output, bool) or not isinstance(output, int | str):
        raise ConfigError(f"ntk.output must be 'sum', 'scalar', 'full' or an int, got {output!r}")
    if isinstance(output, int):
        if not -n_out <= output < n_out:
            raise ConfigError(f"ntk.output: logit index {output} out of range for {n_out} outputs")
        c = torch.zeros(n, n_out, device=dev, dtype=dt)
        c[:, output] = 1
        return ar, c
    if output == "sum":
        return ar, torch.ones(n, n_out, device=dev, dtype=dt)
    if output == "scalar":
        if n_out != 1:
            raise ConfigError(
                f"ntk.output='scalar' needs a model with one output, this one has {n_out}; "
                "use 'sum', 'full' or a logit index"
            )
        return ar, torch.ones(n, 1, device=dev, dtype=dt)
    if output == "full":
        eye = torch.eye(n_out, device=dev, dtype=dt)
        return ar.repeat_interleave(n_out), eye.repeat(n, 1)
    raise ConfigError(f"ntk.output: unknown output '{output}'; choose sum, scalar, full or an int")


def standard_deq(model: nn.Module) -> bool:
    """Whether ``model`` is ``readout(deq(inject(x)))`` with one DEQ layer (the batched path)."""
    return (
        isinstance(model, DEQModel)
        and type(model).forward is DEQModel.forward
        and len(list(deq_layers(model))) == 1
    )


# -- batched engine --------------------------------------------------------------------------------


@contextmanager
def _patched(layers: list[DEQLayer], fn: Any) -> Iterator[None]:
    """Route every call of each DEQ layer in ``layers`` to ``fn(layer, u, z0=None)``."""
    for lay in layers:
        # an instance attribute shadows the method (undone below)
        lay.forward = functools.partial(fn, lay)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for lay in layers:
            lay.__dict__.pop("forward", None)


class _Surrogate(nn.Module):
    """s(theta) for one row (module docstring). Modes:

    * ``"deq"``: ``<w, f(z*, inject(x))> + c . readout(z*)``;
    * ``"layers"`` (any model with DEQ layers): the model's own forward with the k-th DEQ-layer
      call returning the fixed z*_k and adding ``<w_k, f_k(z*_k, u_k)>``, plus ``c . model(x)``;
    * ``"explicit"``: ``c . model(x)``.
    """

    def __init__(self, model: nn.Module, mode: str) -> None:
        super().__init__()
        self.m = model
        self.mode = mode

    def forward(self, x: Tensor, z: Any, w: Any, c: Tensor) -> Tensor:
        x = x.unsqueeze(0)
        if self.mode == "deq":
            m = cast(DEQModel, self.m)  # mode "deq": a standard DEQModel
            z, w = z.unsqueeze(0), w.unsqueeze(0)
            u = m.inject(x)
            s = (w * m.deq.cell(z, u)).sum()
            return s + (c * m.readout(z).reshape(-1)).sum()
        if self.mode == "explicit":
            return (c * self.m(x).reshape(-1)).sum()
        terms: list[Tensor] = []

        def call(layer: DEQLayer, u: Tensor, z0: Tensor | None = None) -> Tensor:
            k = len(terms)
            zk = z[k].unsqueeze(0)
            terms.append((w[k].unsqueeze(0) * layer.cell(zk, u)).sum())
            return zk

        with _patched(list(deq_layers(self.m)), call):
            out = self.m(x)
        return (c * out.reshape(-1)).sum() + sum(terms)


@dataclass
class NTKState:
    """What the batched engine needs after the solves: one entry per row of K."""

    surrogate: _Surrogate
    params: dict[str, Tensor]  # surrogate parameter name -> detached tensor
    x: Tensor  # (R, ...) inputs per row
    z: Any  # (R, ...) fixed points per row, a tuple of them per DEQ-layer call, or empty
    w: Any  # adjoints, shaped like z
    c: Tensor  # (R, O) output cotangents
    rows: int
    info: dict[str, Any] = field(default_factory=dict)


def _stats_info(prefix: str, stats: list[Any]) -> dict[str, Any]:
    stats = [st for st in stats if st is not None]
    if not stats:
        return {}
    return {
        f"{prefix}_nstep": float(sum(st.nstep for st in stats)),
        f"{prefix}_rel_residual": max(st.rel_max for st in stats),
        f"{prefix}_abs_residual": max(st.abs_max for st in stats),
        f"{prefix}_converged": float(all(st.converged for st in stats)),
    }


def _configs(layer: DEQLayer, tol: float | None, max_iter: int | None) -> tuple[Any, Any]:
    fcfg, bcfg = layer.solver_cfg, layer.backward_cfg
    if tol is not None:
        fcfg, bcfg = replace(fcfg, tol=tol), replace(bcfg, tol=tol)
    if max_iter is not None:
        fcfg, bcfg = replace(fcfg, max_iter=max_iter), replace(bcfg, max_iter=max_iter)
    return fcfg, bcfg


ADJOINTS = ("auto", "solver", "direct")
# "auto" solves the adjoint directly when the per-sample Jacobians (d VJPs each) and the batched
# LU, both O(N d^3), cost less than iterating (measured on an H100: N=512, d=300 direct 11 ms vs
# 24 ms iterated; N=2048, d=300 a tie; N=512, d=990 108 ms vs ~25 ms)
DIRECT_MAX_WORK = {"cuda": 2e10, "cpu": 3e8}  # N * d^3


@dataclass
class _DirectStats:
    """The summary of a direct adjoint solve, shaped like the SolverStats fields used here."""

    rel_max: float
    abs_max: float
    converged: bool
    nstep: int = 0


def _use_direct(mode: str, z: Tensor) -> bool:
    if mode == "direct":
        return True
    if mode != "auto":
        return False
    n, d = z.shape[0], z[0].numel()
    need = n * d * d * z.element_size() * 3  # J, I - J^T and its LU
    work = DIRECT_MAX_WORK.get(z.device.type, DIRECT_MAX_WORK["cpu"])
    return n * d**3 <= work and need <= default_block_bytes(z.device)


def _adjoint_direct(
    layer: DEQLayer, z: Tensor, u: Tensor, g: Tensor, tol: float
) -> tuple[Tensor, Any]:
    """w = (I - J^T)^-1 g with the per-sample Jacobians J_i = df/dz (d x d, one vmap(jacrev))
    and one batched LU solve: exact up to rounding, no iterations (small states only)."""
    n, shape = z.shape[0], z.shape[1:]
    d = z[0].numel()
    cell = layer.cell

    def f1(zi: Tensor, ui: Tensor) -> Tensor:
        return cell(zi.view(1, *shape), ui.unsqueeze(0)).reshape(-1)

    with torch.no_grad():
        J = vmap(jacrev(f1))(z.reshape(n, d), u)  # (n, d, d), J[i] = df(z_i)/dz_i
        Jt = J.transpose(1, 2)
        eye = torch.eye(d, dtype=J.dtype, device=J.device)
        gf = g.reshape(n, d, 1)
        w = torch.linalg.solve(eye - Jt, gf)
        fw = torch.baddbmm(gf, Jt, w).reshape(n, d)  # J^T w + g: the canonical residual of w
        a = torch.linalg.vector_norm(fw - w.reshape(n, d), dim=1)
        r = a / (torch.linalg.vector_norm(fw, dim=1) + 1e-9)
        rel, ab = float(r.max()), float(a.max())
    eps = float(torch.finfo(z.dtype).eps)
    ok = math.isfinite(rel) and rel <= max(tol, 1e3 * eps)
    return w.reshape(g.shape).detach(), _DirectStats(rel, ab, ok)


def _adjoint(
    layer: DEQLayer, z: Tensor, u: Tensor, g: Tensor, bcfg: Any, mode: str = "auto"
) -> tuple[Tensor, Any]:
    """Solve w = J^T w + g (J = df/dz at z*) for the whole batch: directly (small states,
    ``mode`` "direct"/"auto") or with the layer's backward solver."""
    from .. import solvers

    if mode != "direct":  # the captured adjoint (CUDA, launch-bound states): faster than direct
        names, params = param_items(layer)
        with torch.autocast(device_type=z.device.type, enabled=False):
            ga = graph_adjoint(layer, names, params, z, u.detach(), bcfg)
            if ga is not None:
                try:
                    w, st, _ = graph_adjoint_solve(ga, z, u, g, bcfg)
                    return w.detach(), st
                except GraphCaptureError as exc:
                    forget_graph_adjoint(layer, ga, str(exc))
    if _use_direct(mode, z):
        try:
            return _adjoint_direct(layer, z, u, g, bcfg.tol)
        except RuntimeError:
            if mode == "direct":
                raise

    # J^T w by one backward pass through a graph of f built once at z* (cheaper per step than a
    # torch.func vjp closure); only the path to z is differentiated.
    with torch.enable_grad():
        zq = z.detach().requires_grad_(True)
        fq = layer.cell(zq, u)

    def step(w: Tensor) -> Tensor:
        (jt,) = torch.autograd.grad(
            fq, zq, w, retain_graph=True, allow_unused=True, materialize_grads=True
        )
        return jt + g

    # structured adjoint solvers (monDEQ splitting) read cell, z*, u and g from the map
    amap: Any = AdjointMap(step, layer.cell, z, u, g)
    w0 = g.clone() if bcfg.b_init == "grad" else torch.zeros_like(g)
    with torch.no_grad():
        w, st = solvers.get(bcfg.solver)(
            amap,
            w0,
            max_iter=bcfg.max_iter,
            tol=bcfg.tol,
            stop_mode=bcfg.stop_mode,
            **bcfg.options,
        )
    return w.detach(), st


def prepare(
    model: nn.Module,
    inputs: Tensor,
    *,
    output: str | int = "sum",
    tol: float | None = None,
    max_iter: int | None = None,
    adjoint: str = "auto",
) -> NTKState:
    """Forward solve and adjoint solve (DEQ) for all probes at once; the rows of K.

    ``adjoint``: "solver" (the layer's backward solver), "direct" (per-sample Jacobians and a
    batched LU solve of (I - J^T) w = g) or "auto" (direct when N d^3 is at most 2e10 on CUDA,
    3e8 on CPU, d the state size per sample, and the Jacobians fit the block budget; else the
    solver).

    Part of the batched engine; :func:`empirical_ntk` wraps it (benchmarks time it alone).
    """
    if adjoint not in ADJOINTS:
        from ..core.errors import ConfigError

        raise ConfigError(f"ntk.adjoint: unknown '{adjoint}'; choose from {', '.join(ADJOINTS)}")
    X = inputs
    n = X.shape[0]
    layers = list(deq_layers(model))
    if layers and not standard_deq(model):
        return _prepare_layers(model, X, output, tol, max_iter, layers, adjoint)
    mode = "deq" if layers else "explicit"
    sur = _Surrogate(model, mode)
    params = {k: p.detach() for k, p in sur.named_parameters() if p.requires_grad}
    info: dict[str, Any] = {}
    if mode == "explicit":
        with torch.no_grad():
            out = model(X[:1])
        idx, C = _cotangents(output, n, out[0].numel(), out)
        xr = X if idx.numel() == n else X[idx]
        empty = X.new_zeros(idx.numel(), 0)
        info.update(rows=int(idx.numel()), outputs=int(out[0].numel()))
        info["eps"] = float(torch.finfo(out.dtype).eps)
        return NTKState(sur, params, xr, empty, empty, C, int(idx.numel()), info)

    model = cast(DEQModel, model)  # standard_deq(model)
    layer: DEQLayer = model.deq
    fcfg, bcfg = _configs(layer, tol, max_iter)
    t = time.perf_counter()
    with torch.no_grad():
        u = model.inject(X)
        z, fst = layer.solve(u, model.z0(u), fcfg)
        out = model.readout(z)
    info["time_forward_s"] = time.perf_counter() - t
    n_out = out[0].numel()
    idx, C = _cotangents(output, n, n_out, out)
    full = idx.numel() != n
    xr, zr, ur = (X[idx], z[idx], u[idx]) if full else (X, z, u)
    t = time.perf_counter()
    with torch.no_grad():
        _, ro_vjp = vjp(model.readout, zr)  # type: ignore[misc]  # torch stub: 2- or 3-tuple
        g = ro_vjp(C.view(idx.numel(), *out.shape[1:]))[0].detach()
    w, bst = _adjoint(layer, zr, ur, g, bcfg, adjoint)
    info["time_adjoint_s"] = time.perf_counter() - t
    info.update(_stats_info("forward", [fst]))
    info.update(_stats_info("adjoint", [bst]))
    info.update(rows=int(idx.numel()), outputs=int(n_out), eps=float(torch.finfo(z.dtype).eps))
    info["F"] = out.detach()
    return NTKState(sur, params, xr, zr, w, C, int(idx.numel()), info)


def _prepare_layers(
    model: nn.Module,
    X: Tensor,
    output: str | int,
    tol: float | None,
    max_iter: int | None,
    layers: list[DEQLayer],
    adjoint: str = "auto",
) -> NTKState:
    """Rows of K for any model whose DEQ layers are called as ``layer(u, z0)`` (several layers,
    custom forward). One batched pass with every DEQ-layer call solved under no_grad and its
    output cut to a leaf; then, in reverse call order, g_k = dS/dz*_k of
    ``S = c . out + sum_{j>k} <w_j, f_j(z*_j, u_j)>`` and one batched adjoint solve for w_k."""
    n = X.shape[0]
    with torch.no_grad():
        out1 = model(X[:1])
    idx, C = _cotangents(output, n, out1[0].numel(), out1)
    xr = X if idx.numel() == n else X[idx]
    calls: list[dict[str, Any]] = []
    t = time.perf_counter()

    def call(layer: DEQLayer, u: Tensor, z0: Tensor | None = None) -> Tensor:
        fcfg, bcfg = _configs(layer, tol, max_iter)
        with torch.no_grad():
            ud = u.detach()
            z, st = layer.solve(ud, torch.zeros_like(ud) if z0 is None else z0.detach(), fcfg)
        leaf = z.detach().requires_grad_(True)
        calls.append(
            {"layer": layer, "u": u, "z": z.detach(), "leaf": leaf, "fst": st, "bcfg": bcfg}
        )
        return leaf

    with _patched(layers, call), torch.enable_grad():
        out = model(xr)
    info: dict[str, Any] = {"time_forward_s": time.perf_counter() - t}
    t = time.perf_counter()
    with torch.enable_grad():
        total = (out.reshape(out.shape[0], -1) * C).sum()
        ws: list[Tensor] = [xr] * len(calls)
        bstats = []
        for k in reversed(range(len(calls))):
            c = calls[k]
            (g,) = torch.autograd.grad(
                total, c["leaf"], retain_graph=True, allow_unused=True, materialize_grads=True
            )
            w, bst = _adjoint(c["layer"], c["z"], c["u"].detach(), g.detach(), c["bcfg"], adjoint)
            ws[k] = w
            bstats.append(bst)
            total = total + (w * c["layer"].cell(c["z"], c["u"])).sum()
    info["time_adjoint_s"] = time.perf_counter() - t
    info.update(_stats_info("forward", [c["fst"] for c in calls]))
    info.update(_stats_info("adjoint", bstats))
    info.update(
        rows=int(idx.numel()),
        outputs=int(out1[0].numel()),
        deq_calls=len(calls),
        eps=float(torch.finfo(X.dtype).eps),
    )
    sur = _Surrogate(model, "layers")
    params = {k: p.detach() for k, p in sur.named_parameters() if p.requires_grad}
    zs = tuple(c["z"] for c in calls)
    return NTKState(sur, params, xr, zs, tuple(ws), C, int(idx.numel()), info)


@dataclass
class _Slice:
    key: str
    start: int  # flat element range [start, stop) of the parameter tensor
    stop: int

    def full(self, t: Tensor) -> bool:
        return self.start == 0 and self.stop == t.numel()


def _plan_blocks(params: dict[str, Tensor], rows: int, block_bytes: int) -> list[list[_Slice]]:
    """Pack parameter tensors into blocks of at most ``block_bytes`` of per-sample gradients
    (working dtype plus its float64 copy); a tensor larger than the budget is sliced."""
    blocks: list[list[_Slice]] = []
    cur: list[_Slice] = []
    used = 0
    for key, p in params.items():
        per_el = rows * (p.element_size() + 8)
        cap = max(1, block_bytes // per_el)
        numel = p.numel()
        if numel > cap:
            if cur:
                blocks.append(cur)
                cur, used = [], 0
            for a in range(0, numel, cap):
                blocks.append([_Slice(key, a, min(numel, a + cap))])
            continue
        if used + numel * per_el > block_bytes and cur:
            blocks.append(cur)
            cur, used = [], 0
        cur.append(_Slice(key, 0, numel))
        used += numel * per_el
    if cur:
        blocks.append(cur)
    return blocks


def default_block_bytes(device: torch.device) -> int:
    """Per-block memory budget: 256 MiB on CPU; on CUDA a quarter of the free memory, between
    256 MiB and 8 GiB."""
    if device.type != "cuda":
        return 256 << 20
    free, _ = torch.cuda.mem_get_info(device)
    return int(min(8 << 30, max(256 << 20, free // 4)))


def jacobian_blocks(
    st: NTKState, *, chunk_size: int | None = None, block_bytes: int | None = None
) -> Iterator[list[Tensor]]:
    """Yield, block by block, the per-sample surrogate gradients as (R, p_t) tensors."""
    if block_bytes is None:
        block_bytes = default_block_bytes(st.x.device)
    base = st.params
    for block in _plan_blocks(base, st.rows, block_bytes):

        def s_fn(
            vals: tuple[Tensor, ...],
            x: Tensor,
            z: Tensor,
            w: Tensor,
            c: Tensor,
            block: list[_Slice] = block,
        ) -> Tensor:
            p = dict(base)
            for sl, v in zip(block, vals):
                full = base[sl.key]
                if sl.full(full):
                    p[sl.key] = v
                else:
                    flat = full.reshape(-1)
                    p[sl.key] = torch.cat([flat[: sl.start], v, flat[sl.stop :]]).view_as(full)
            return functional_call(st.surrogate, p, (x, z, w, c))

        vals = tuple(
            base[sl.key] if sl.full(base[sl.key]) else base[sl.key].reshape(-1)[sl.start : sl.stop]
            for sl in block
        )
        with torch.no_grad():  # torch.func.grad ignores the outer no_grad; this stops autograd
            gs = vmap(grad(s_fn), in_dims=(None, 0, 0, 0, 0), chunk_size=chunk_size)(
                vals, st.x, st.z, st.w, st.c
            )
        yield [g.reshape(st.rows, -1) for g in gs]
        del gs


def contract(blocks: Iterator[list[Tensor]] | list[list[Tensor]], rows: int) -> Tensor:
    """K = sum_b G_b G_b^T accumulated in float64 (no concatenation of the blocks)."""
    K: Tensor | None = None
    for block in blocks:
        for g in block:
            g64 = g.to(torch.float64)
            if K is None:
                K = torch.zeros(rows, rows, dtype=torch.float64, device=g.device)
            K.addmm_(g64, g64.T)
            del g64
    if K is None:
        raise ValueError("ntk: the model has no trainable parameters")
    return K
