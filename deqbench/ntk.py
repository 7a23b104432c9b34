"""Empirical neural tangent kernel (NTK) of DEQs and explicit networks, and its spectrum.

``K_ij = <dF(x_i)/dtheta, dF(x_j)/dtheta>`` over *all* trainable parameters, for a scalar output
``F`` chosen from the model's outputs (``output``):

* ``"sum"`` (default): the sum over the output units (for a classifier, the sum of the logits);
* an ``int`` k: output unit (logit) k;
* ``"scalar"``: the model has one output;
* ``"full"``: every output unit separately; K is then (N*O) x (N*O), rows ordered sample-major
  (row ``i*O + o``). This is the kernel that governs squared-loss gradient descent on O-dim
  targets.

For a DEQ ``F(x) = c . readout(z*)``, ``z* = f(z*, inject(x))``, the per-sample gradient is
``(df/dtheta)^T w + d readout/dtheta`` with the adjoint ``w = J^T w + d F/dz*`` (J = df/dz at z*),
so K equals the NTK of the one-step surrogate (REFERENCE.md section 8.1)::

    s_i(theta) = <w_i, f(z*_i, inject(x_i; theta); theta)> + c_i . readout(z*_i; theta)

with z* and w held fixed. The default ``method="batched"`` therefore does one batched forward
solve and one batched adjoint solve for all probes, then per-sample gradients of ``s`` with
``torch.func.vmap(grad(...))``, block by block over parameter tensors (a tensor too large for
the block budget is sliced), accumulating ``K += G_b G_b^T`` in float64 so the full N x P
Jacobian never exists. ``method="naive"`` loops over probes and differentiates the model
itself (its configured backward mode); ``method="gram"`` never forms a Jacobian and uses the
closed-form Gram expression of ``fc_deq``-type models (``z = act(W z + U x + b)``, linear head).
Models without DEQ layers (MLP, ``tied_repeat``) get the plain per-sample NTK.

Numerics (REFERENCE.md section 8.3): TF32 is switched off inside (and restored), K is
accumulated and diagonalised in float64, and :func:`ntk_summary` reports a rounding-noise floor
``c * eps * N * lambda_max`` next to lambda_min; a lambda_min below it is reported as unresolved
(NaN, condition = inf), never as a (possibly negative) number.

Example:
    >>> import torch, deqbench
    >>> from deqbench.ntk import empirical_ntk, ntk_summary
    >>> model = deqbench.models.create("fc_deq_tiny", in_shape=(64,)).double()
    >>> X = torch.randn(16, 64, dtype=torch.float64)
    >>> K = empirical_ntk(model, X, output="sum")          # (16, 16) float64
    >>> s = ntk_summary(K)                                  # doctest: +SKIP
    >>> s["lambda_min"], s["condition"], s["resolved"]     # doctest: +SKIP
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vjp, vmap

from .deq import DEQLayer, DEQModel, deq_layers

METHODS = ("batched", "naive", "gram")
OUTPUT_KINDS = ("sum", "scalar", "full")

__all__ = ["empirical_ntk", "ntk_summary", "METHODS", "OUTPUT_KINDS"]


# -- public API --------------------------------------------------------------------------------


def empirical_ntk(
    model: nn.Module,
    inputs: Tensor,
    *,
    output: str | int = "sum",
    chunk_size: int | None = None,
    method: str = "batched",
    tol: float | None = None,
    max_iter: int | None = None,
    block_bytes: int | None = None,
    return_info: bool = False,
) -> Tensor | tuple[Tensor, dict[str, Any]]:
    """Empirical NTK of ``model`` on the probe batch ``inputs``.

    Args:
        model: a DEQ (:class:`~deqbench.deq.DEQModel` with one equilibrium layer) or any
            ``nn.Module`` mapping a batch to (B, O) outputs without cross-sample operations
            (the model is put in eval mode during the computation, so BatchNorm uses its running
            statistics; the mode is restored).
        inputs: (N, ...) probe inputs, on the model's device and dtype.
        output: ``"sum"`` | ``int`` logit index | ``"scalar"`` | ``"full"`` (module docstring).
        chunk_size: ``vmap`` chunk size for the per-sample gradients (None: all rows at once).
        method: ``"batched"`` (default), ``"naive"`` (one backward per probe through the model,
            a reference) or ``"gram"`` (closed form; ``fc_deq``-type models only).
        tol: forward and adjoint solver tolerance for DEQs (None: the model's configured ones).
            In float64 use <= 1e-8: the lambda_min error is about tol * cond / (1 - L).
        max_iter: forward and adjoint iteration budget (None: the model's configured ones).
        block_bytes: memory budget of one per-sample gradient block (float64 copy included);
            default 256 MiB on CPU, a quarter of the free memory (<= 8 GiB) on CUDA.
        return_info: also return a dict with solver statistics, timings, row layout and
            ``eps`` (the machine epsilon of the per-sample gradients, for :func:`ntk_summary`).

    Returns:
        K, an (R, R) float64 tensor on the inputs' device (R = N, or N*O for ``"full"``);
        with ``return_info``, ``(K, info)``.

    Example:
        >>> K = empirical_ntk(model, X, output=3, method="batched")   # doctest: +SKIP
    """
    if method not in METHODS:
        from .errors import ConfigError

        raise ConfigError(
            f"ntk.method: unknown method '{method}'; choose from {', '.join(METHODS)}"
        )
    t0 = time.perf_counter()
    with _numerics(), _eval_mode(model):
        if method == "naive":
            K, info = _naive(model, inputs, output, tol, max_iter)
        elif method == "gram":
            K, info = _gram(model, inputs, output, tol, max_iter)
        else:
            st = prepare(model, inputs, output=output, tol=tol, max_iter=max_iter)
            try:
                K = contract(
                    jacobian_blocks(st, chunk_size=chunk_size, block_bytes=block_bytes), st.rows
                )
                info = st.info
            except RuntimeError as exc:
                # A custom-forward model whose forward has side effects that torch.func cannot
                # trace (e.g. reading data_ptr() of a parameter): per-probe reference instead.
                if st.surrogate.mode != "layers" or "out of memory" in str(exc).lower():
                    raise
                import warnings

                why = f"{type(exc).__name__}: {exc}"
                warnings.warn(
                    f"ntk: batched engine failed on {type(model).__name__} ({why}); "
                    "using method='naive'",
                    RuntimeWarning,
                    stacklevel=2,
                )
                K, info = _naive(model, inputs, output, tol, max_iter)
                info["fallback"] = f"naive ({why[:160]})"
    info["method"] = method
    info["time_s"] = time.perf_counter() - t0
    return (K, info) if return_info else K


def ntk_summary(K: Tensor, *, eps: float | None = None, c: float = 1.0) -> dict[str, Any]:
    """Spectrum summary of an NTK matrix, computed in float64 on ``(K + K^T)/2``.

    Args:
        K: (N, N) kernel matrix.
        eps: machine epsilon of the arithmetic that produced K's entries (default float64's;
            pass ``torch.finfo(torch.float32).eps`` for float32 per-sample gradients, or use
            ``info["eps"]`` from :func:`empirical_ntk`).
        c: safety constant of the noise floor.

    Returns:
        dict with ``lambda_min`` (NaN when unresolved), ``lambda_max``, ``condition``
        (lambda_max / lambda_min; inf when unresolved), ``trace``, ``trace_per_n``,
        ``noise_floor`` (``c * eps * N * lambda_max``), ``resolved`` (lambda_min > floor) and ``n``.

    Example:
        >>> ntk_summary(torch.eye(3))["condition"]
        1.0
    """
    K64 = K.detach().to(torch.float64)
    K64 = 0.5 * (K64 + K64.T)
    n = int(K64.shape[0])
    if n == 0:
        raise ValueError("ntk_summary: empty kernel")
    with _numerics():
        ev = torch.linalg.eigvalsh(K64)
    lmin, lmax = float(ev[0]), float(ev[-1])
    eps = float(torch.finfo(torch.float64).eps) if eps is None else float(eps)
    floor = c * eps * n * max(abs(lmax), 0.0)
    finite = math.isfinite(lmin) and math.isfinite(lmax)
    resolved = finite and lmin > floor
    trace = float(torch.diagonal(K64).sum())
    return {
        "lambda_min": lmin if resolved else math.nan,
        "lambda_max": lmax,
        "condition": lmax / lmin if resolved else math.inf,
        "trace": trace,
        "trace_per_n": trace / n,
        "noise_floor": floor,
        "resolved": bool(resolved),
        "n": n,
    }


# -- numerics guards ----------------------------------------------------------------------------


@contextmanager
def _numerics() -> Iterator[None]:
    """TF32 off (matmul and cuDNN) and 'highest' float32 matmul precision; restored after."""
    prev = (
        torch.get_float32_matmul_precision(),
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
    )
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(prev[0])
        torch.backends.cuda.matmul.allow_tf32 = prev[1]
        torch.backends.cudnn.allow_tf32 = prev[2]


@contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)


@contextmanager
def _tolerances(layers: list[DEQLayer], tol: float | None, max_iter: int | None) -> Iterator[None]:
    """Temporarily override the forward/adjoint tolerance and budget of ``layers``."""
    saved = [(lay.solver_cfg, lay.backward_cfg) for lay in layers]
    try:
        for lay in layers:
            s, b = lay.solver_cfg, lay.backward_cfg
            if tol is not None:
                s, b = replace(s, tol=tol), replace(b, tol=tol)
            if max_iter is not None:
                s, b = replace(s, max_iter=max_iter), replace(b, max_iter=max_iter)
            lay.solver_cfg, lay.backward_cfg = s, b
        yield
    finally:
        for lay, (s, b) in zip(layers, saved):
            lay.solver_cfg, lay.backward_cfg = s, b


# -- rows: which (sample, output cotangent) pairs form K -------------------------------------------


def _cotangents(output: str | int, n: int, n_out: int, like: Tensor) -> tuple[Tensor, Tensor]:
    """(sample index per row (R,), output cotangent per row (R, O))."""
    from .errors import ConfigError

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
        lay.forward = functools.partial(fn, lay)  # instance attribute shadows the method
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
            z, w = z.unsqueeze(0), w.unsqueeze(0)
            u = self.m.inject(x)
            s = (w * self.m.deq.cell(z, u)).sum()
            return s + (c * self.m.readout(z).reshape(-1)).sum()
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


def _adjoint(layer: DEQLayer, z: Tensor, u: Tensor, g: Tensor, bcfg: Any) -> tuple[Tensor, Any]:
    """Solve w = J^T w + g (J = df/dz at z*) for the whole batch with the backward solver."""
    from . import solvers

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

    try:  # structured adjoint solvers (monDEQ splitting) read cell, z*, u and g from the map
        from .backward import AdjointMap

        amap: Any = AdjointMap(step, layer.cell, z, u, g)
    except ImportError:  # pragma: no cover
        amap = step
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
) -> NTKState:
    """Forward solve and adjoint solve (DEQ) for all probes at once; the rows of K.

    Part of the batched engine; :func:`empirical_ntk` wraps it (benchmarks time it alone).
    """
    X = inputs
    n = X.shape[0]
    layers = list(deq_layers(model))
    if layers and not standard_deq(model):
        return _prepare_layers(model, X, output, tol, max_iter, layers)
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
        _, ro_vjp = vjp(model.readout, zr)
        g = ro_vjp(C.view(idx.numel(), *out.shape[1:]))[0].detach()
    w, bst = _adjoint(layer, zr, ur, g, bcfg)
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
            w, bst = _adjoint(c["layer"], c["z"], c["u"].detach(), g.detach(), c["bcfg"])
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


# -- naive reference -------------------------------------------------------------------------------


def _naive(
    model: nn.Module, X: Tensor, output: str | int, tol: float | None, max_iter: int | None
) -> tuple[Tensor, dict[str, Any]]:
    """One forward and one backward per probe through the model (its configured backward)."""
    params = [p for p in model.parameters() if p.requires_grad]
    n = X.shape[0]
    rows: list[Tensor] = []
    with _tolerances(list(deq_layers(model)), tol, max_iter), torch.enable_grad():
        idx = C = None
        for i in range(n):
            out = model(X[i : i + 1]).reshape(-1)
            if C is None:
                idx, C = _cotangents(output, n, out.numel(), out)
            sel = (idx == i).nonzero().flatten().tolist()
            for k, r in enumerate(sel):
                F = (out * C[r]).sum()
                gs = torch.autograd.grad(
                    F, params, retain_graph=k < len(sel) - 1, allow_unused=True
                )
                rows.append(
                    torch.cat(
                        [
                            (g if g is not None else torch.zeros_like(p))
                            .reshape(-1)
                            .to(torch.float64)
                            for g, p in zip(gs, params)
                        ]
                    )
                )
    J = torch.stack(rows)
    info = {"rows": len(rows), "eps": float(torch.finfo(X.dtype).eps)}
    return J @ J.T, info


# -- gram fast path --------------------------------------------------------------------------------


def _gram(
    model: nn.Module, X: Tensor, output: str | int, tol: float | None, max_iter: int | None
) -> tuple[Tensor, dict[str, Any]]:
    """Closed-form K from N x N Gram matrices (no Jacobian formed), REFERENCE.md section 8.1.

    With D = act'(a) * w (a the pre-activation, w the adjoint), Z, X, C the stacked fixed
    points, inputs and output cotangents of the rows:

    * fc_deq (z = act(W z + U x + b)): K = (D D^T) o (Z Z^T + X X^T + 1) + (C C^T) o (Z Z^T + 1);
    * mondeq_fc (W = (1-m) I - A^T A + B - B^T): the W term is replaced by the A and B terms,
      from dF/dA = -(A z) d^T - (A d) z^T and dF/dB = d z^T - z d^T.
    """
    from .errors import ConfigError
    from .models.fc import FCCell

    try:
        from .models.mondeq import MonFCCell
    except ImportError:  # pragma: no cover
        MonFCCell = ()  # type: ignore[assignment,misc]
    cell = getattr(getattr(model, "deq", None), "cell", None)
    U, head = getattr(model, "U", None), getattr(model, "head", None)
    ok = (
        standard_deq(model)
        and isinstance(cell, FCCell | MonFCCell)
        and isinstance(U, nn.Linear)
        and isinstance(head, nn.Linear)
    )
    if not ok:
        raise ConfigError(
            f"ntk.method='gram' supports fc_deq and mondeq_fc models (dense cell, linear "
            f"injection and head); {type(model).__name__} is not one; use method='batched'"
        )
    st = prepare(model, X, output=output, tol=tol, max_iter=max_iter)
    f64 = torch.float64

    def on(p: Tensor | None) -> bool:
        return p is not None and p.requires_grad

    with torch.no_grad():
        u = model.inject(st.x)
        z, w = st.z.to(f64), st.w.to(f64)
        ZZ = z @ z.T
        if isinstance(cell, FCCell):
            a = cell.W(st.z) + u
            dact = torch.func.jvp(cell.act, (a,), (torch.ones_like(a),))[1]
        else:
            a = st.z @ cell.weight().T + u
            dact = cell.prox_mask(a)
        D = dact.to(f64) * w
        DD = D @ D.T
        x = st.x.flatten(1).to(f64)
        c = st.c.to(f64)
        inner = torch.zeros_like(ZZ)
        if on(U.weight):
            inner += x @ x.T
        if on(U.bias):
            inner += 1.0
        K = torch.zeros_like(ZZ)
        if isinstance(cell, FCCell):
            if on(cell.W.weight):
                inner += ZZ
            if on(cell.W.bias):
                inner += 1.0
        else:
            DZ = D @ z.T  # (i, j) -> d_i . z_j
            if on(cell.A):
                A = cell.A.to(f64)
                P, Q = z @ A.T, D @ A.T  # rows A z_i, A d_i
                K += (P @ P.T) * DD + (P @ Q.T) * DZ + (Q @ P.T) * DZ.T + (Q @ Q.T) * ZZ
            if on(cell.B):
                K += 2.0 * (DD * ZZ - DZ * DZ.T)
        K += DD * inner
        outer = torch.zeros_like(ZZ)
        if on(head.weight):
            outer += ZZ
        if on(head.bias):
            outer += 1.0
        K += (c @ c.T) * outer
    return K, st.info
