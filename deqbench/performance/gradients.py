"""Gradient vectors of a training step, their accuracy, and the float64 IFT reference.

The reference gradient is the same training step in float64 with the implicit
gradient, forward and adjoint solved to a tight tolerance (1e-12) by robust methods chosen
independently of the model's or suite's solver settings, on a copy of the model whose DEQ layers
(of any implementation, e.g. a plugin's) are :class:`ReferenceLayer` around the same cells: the
adjoint (I - J^T) w = g is a dense direct solve per sample when the state is small (Anderson
otherwise), the forward falls back to the model's own solver and a dense Newton polish. Both
residuals are measured afresh against the true maps; ``info["converged"]`` is False (with a
one-line ``info["note"]``) when either misses the tolerance, and then the reference must not be the
basis of an accuracy figure.

Accuracy is the cosine and the relative error ||g - g_ref|| / ||g_ref|| over all trainable
parameters, matched by name. ``task`` is "classification" / "regression" (the training loss) or
a callable ``loss(output, target)``; :class:`CellModel` with :class:`InnerProductLoss` gives the
bare-cell setting (loss <R, z*> for a fixed R).

Example:
    >>> import deqbench, torch
    >>> from deqbench.performance.gradients import reference_gradient, grad_vector, gradient_accuracy
    >>> model = deqbench.models.create("fc_deq_tiny")
    >>> x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    >>> g_ref, info = reference_gradient(model, x, y)
    >>> cos, err = gradient_accuracy(grad_vector(model, x, y, names=g_ref.names), g_ref)
    >>> cos > 0.99, err < 1e-3, info["converged"], info["adjoint_method"]
    (True, True, True, 'dense')
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn

from ..core.deq import (
    BackwardConfig,
    CellMap,
    DEQLayer,
    DEQModel,
    SolverConfig,
    deq_layers,
    last_stats,
)
from ..solvers.base import residuals
from ._perf import loss_for, preserved


class CellModel(DEQModel):
    """A bare cell ``f(z, x)`` as a DEQ model: ``inject`` and ``readout`` are the identity, so
    the output is z* itself (the solver benchmarks' bare cells; train with
    :class:`InnerProductLoss`). ``state_shape`` is the per-sample shape of z when it differs
    from x's (z0 = 0)."""

    def __init__(
        self,
        cell: nn.Module,
        solver: SolverConfig | None = None,
        backward: BackwardConfig | None = None,
        state_shape: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        self.deq = DEQLayer(cell, solver, backward)
        self.state_shape = tuple(state_shape) if state_shape is not None else None

    def inject(self, x: Tensor) -> Tensor:
        return x

    def z0(self, u: Tensor) -> Tensor:
        if self.state_shape is None:
            return torch.zeros_like(u)
        return u.new_zeros((u.shape[0], *self.state_shape))

    def readout(self, z: Tensor) -> Tensor:
        return z


class InnerProductLoss:
    """loss(z, R) = <R, z> summed over the batch: the fixed-direction loss of the bare-cell benchmarks
    (picklable, for peak memory in a fresh worker)."""

    def __call__(self, out: Tensor, target: Tensor) -> Tensor:
        return (out * target).sum()


@dataclass
class GradVector:
    """Flattened parameter gradients, in the order of ``names`` (float64, on the CPU)."""

    vec: Tensor
    names: list[str]


def _param_dict(model: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def grad_vector(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    task: Any = "classification",
    names: Sequence[str] | None = None,
) -> GradVector:
    """Gradients of the training loss on (x, y) w.r.t. the trainable parameters (train mode,
    buffers restored), flattened in the order of ``names`` (default: the model's own); a
    parameter without gradient contributes zeros."""
    params = _param_dict(model)
    names = list(names) if names is not None else list(params)
    missing = [n for n in names if n not in params]
    if missing:
        raise ValueError(f"grad_vector: the model has no parameter {missing[0]!r}")
    with preserved(model):
        model.train()
        with torch.enable_grad():
            loss = loss_for(task)(model(x), y)
            plist = [params[n] for n in names]
            grads = torch.autograd.grad(loss, plist, allow_unused=True)
    parts = [
        (g if g is not None else torch.zeros_like(p)).detach().reshape(-1).double().cpu()
        for g, p in zip(grads, plist)
    ]
    return GradVector(torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64), names)


def gradient_accuracy(g: GradVector | Tensor, g_ref: GradVector | Tensor) -> tuple[float, float]:
    """(cosine, relative error ||g - g_ref|| / ||g_ref||) of two gradient vectors."""
    a = (g.vec if isinstance(g, GradVector) else g).double().reshape(-1)
    b = (g_ref.vec if isinstance(g_ref, GradVector) else g_ref).double().reshape(-1)
    nb = float(torch.linalg.vector_norm(b))
    na = float(torch.linalg.vector_norm(a))
    cos = float(a @ b) / (na * nb) if na > 0 and nb > 0 else math.nan
    err = float(torch.linalg.vector_norm(a - b)) / nb if nb > 0 else math.nan
    return cos, err


def _swap_layers(model: nn.Module, make: Any) -> nn.Module:
    """A deep copy of ``model`` with every DEQ layer (any DEQLayer subclass, e.g. a plugin's)
    replaced by ``make(copied_layer)``."""
    ref = copy.deepcopy(model)
    targets = [
        (parent, name, child)
        for parent in ref.modules()
        for name, child in parent.named_children()
        if isinstance(child, DEQLayer)
    ]
    for parent, name, child in targets:
        setattr(parent, name, make(child))
    return ref


def native_copy(model: nn.Module, solver: SolverConfig, backward: BackwardConfig) -> nn.Module:
    """A deep copy of ``model`` whose DEQ layers (any DEQLayer subclass, e.g. a plugin's) are
    plain deqbench DEQLayers around the copied cells, configured with ``solver``/``backward``."""
    return _swap_layers(model, lambda c: DEQLayer(c.cell, replace(solver), replace(backward)))


# -- the reference gradient ----------------------------------------------------------------------

#: per-sample state size (numel) up to which the reference solves densely by default
DENSE_MAX = 128
#: the dense Jacobians of one batch (B d^2 float64 numbers) may take at most this many bytes
DENSE_BYTES = 256 * 2**20
#: at most this many (damped) Newton steps polish a forward that the iterative solvers left short
NEWTON_STEPS = 30


@dataclass
class ReferenceSettings:
    """How the reference solves (see :func:`reference_gradient`).

    Attributes:
        solver: forward solver tried first (then the layer's own forward solver, a dense
            Newton polish when the state is small, and Broyden).
        adjoint: "auto" (dense direct solve when the per-sample state has at most ``dense_max``
            entries, else Anderson; then the layer's own adjoint solver unless plain iteration),
            "dense", or a registered solver name.
        tol: relative residual (canonical, per sample, batch max) both solves must reach.
        max_iter: budget of each iterative solve (f-evaluations or adjoint steps).
        dense_max: per-sample state size up to which "auto" solves the adjoint densely first
            (and the forward may take Newton steps); a larger state is solved densely only as
            the last resort, when Anderson missed ``tol`` and its Jacobians fit in
            ``DENSE_BYTES``. 0: never dense.
        options: options of ``solver``.
    """

    solver: str = "anderson"
    adjoint: str = "auto"
    tol: float = 1e-12
    max_iter: int = 1000
    dense_max: int = DENSE_MAX
    options: dict[str, Any] = field(default_factory=dict)


def _dense_ok(z: Tensor, dense_max: float) -> bool:
    b, d = z.shape[0], z[0].numel() if z.shape[0] else 0
    return b > 0 and 0 < d <= dense_max and b * d * d * 8 <= DENSE_BYTES


def _vjp(out: Tensor, z_: Tensor, w: Tensor, batched: bool = False) -> Tensor:
    (r,) = torch.autograd.grad(
        out, z_, w, retain_graph=True, allow_unused=True, is_grads_batched=batched
    )
    if r is None:
        return torch.zeros(w.shape, dtype=z_.dtype, device=z_.device)
    return r


def batched_jacobian(out: Tensor, z_: Tensor, chunk: int = 128) -> Tensor:
    """Per-sample Jacobians ``J[b, k, l] = d out[b, k] / d z[b, l]`` (B, d, d) of the retained
    graph ``out = f(z_)``: row k of every sample at once is the VJP with e_k in each sample.
    Exact when samples do not interact; callers check their solves against the true map."""
    b, d = z_.shape[0], z_[0].numel()
    rows = []
    for k0 in range(0, d, chunk):
        n = min(d, k0 + chunk) - k0
        e = z_.new_zeros(n, b, d)
        i = torch.arange(n, device=z_.device)
        e[i, :, k0 + i] = 1.0
        e = e.view(n, *z_.shape)
        try:
            r = _vjp(out, z_, e, batched=True)
        except Exception:  # an op without a batching rule: one VJP per row
            r = torch.stack([_vjp(out, z_, ek) for ek in e])
        rows.append(r.reshape(n, b, d))
    return torch.cat(rows).permute(1, 0, 2)


@contextlib.contextmanager
def _one_thread(t: Tensor) -> Iterator[None]:
    """Batched dense factorizations on the CPU run on one thread: with several, batched LU
    (B > 1, d >= 256; torch 2.14 / oneMKL 2024.2) hangs after "Parameter 6 was incorrect on
    entry to DLASWP"."""
    if t.device.type != "cpu":
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _finite_max(r: Tensor) -> float:
    return float(r.max()) if r.numel() and bool(torch.isfinite(r).all()) else math.inf


def _newton(cell: nn.Module, u: Tensor, z: Tensor, tol: float, steps: int) -> tuple[Tensor, int]:
    """Damped Newton on z - f(z) = 0 with dense per-sample Jacobians, per-sample step halving
    (a sample takes the longest step of 1, 1/2, ... 1/128 that lowers its residual). Returns
    (z, f-evaluations)."""
    b, d = z.shape[0], z[0].numel()
    eye = torch.eye(d, dtype=z.dtype, device=z.device)
    shape = (b,) + (1,) * (z.dim() - 1)
    nf = 0
    for _ in range(steps):
        with torch.enable_grad():
            z_ = z.detach().requires_grad_()
            fz = cell(z_, u)
        nf += 1
        a, r = residuals(fz.detach(), z)
        pending = ~(r < tol)
        if not bool(pending.any()):
            break
        jac = batched_jacobian(fz, z_)
        try:
            with _one_thread(jac):
                dz = torch.linalg.solve(eye - jac, (fz.detach() - z).reshape(b, d, 1))
            dz = dz.reshape(z.shape)
        except RuntimeError:  # singular I - J
            break
        if not bool(torch.isfinite(dz).all()):
            break
        step = torch.ones(shape, dtype=z.dtype, device=z.device)
        znew, moved = z.clone(), False
        for _ls in range(8):
            cand = z + step * dz
            with torch.no_grad():
                ac, _ = residuals(cell(cand, u), cand)
            nf += 1
            good = pending & torch.isfinite(ac) & (ac < a)
            if bool(good.any()):
                znew[good] = cand[good]
                moved = True
            pending = pending & ~good
            if not bool(pending.any()):
                break
            step = step * 0.5
        if not moved:
            break
        z = znew
    return z, nf


def _reference_forward(layer: ReferenceLayer, u: Tensor, z0: Tensor) -> tuple[Tensor, Any]:
    """z* to ``tol``: ``solver`` from z0, then the layer's own forward solver from z0, then a
    dense Newton polish (small states) and Broyden from the best iterate, until one reaches
    ``tol``. Each result is judged by its residual measured afresh (one f-evaluation), not by
    what the solver reported; the returned stats carry the residual of the returned z*."""
    from .. import solvers
    from ..core.errors import DeqbenchError
    from ..solvers.base import make_stats

    s, own = layer.ref, layer.solver_cfg
    f = CellMap(layer.cell, u)
    attempts: list[tuple[str, dict[str, Any], bool]] = [(s.solver, dict(s.options), False)]
    if own.name != s.solver:
        attempts.append((own.name, dict(own.options), False))
    if _dense_ok(z0, s.dense_max):
        attempts.append(("newton", {}, True))
    if "broyden" not in (s.solver, own.name):
        attempts.append(("broyden", {}, True))
    used: list[str] = []
    best, best_a, best_r, nstep = z0, None, math.inf, 0
    with torch.no_grad():
        for name, opts, polish in attempts:
            start = best if polish else z0
            try:
                if name == "newton":
                    z, nf = _newton(layer.cell, u, start, s.tol, min(NEWTON_STEPS, s.max_iter))
                else:
                    z, st = solvers.get(name)(
                        f, start, max_iter=s.max_iter, tol=s.tol, stop_mode="rel", **opts
                    )
                    nf = st.nstep
            except DeqbenchError:  # e.g. a structured solver this cell does not support
                continue
            used.append(name)
            a, r = residuals(f(z), z)
            nstep += nf + 1
            if _finite_max(r) < best_r or best_a is None:
                best, best_a, best_r = z, (a, r), _finite_max(r)
            if best_r < s.tol:
                break
    if best_a is None:
        with torch.no_grad():
            best_a = residuals(f(best), best)
        nstep += 1
    a, r = best_a
    diverged = math.isinf(_finite_max(a))
    stats = make_stats("+".join(used), nstep, [a], [r], a, r, s.tol, "rel", diverged)
    return best, stats


def _reference_adjoint(
    s: ReferenceSettings,
    cell: nn.Module,
    out: Tensor,
    z_: Tensor,
    u: Tensor,
    g: Tensor,
    own: BackwardConfig | None = None,
) -> tuple[Tensor, Any]:
    """w = J^T w + g (J = df/dz at z*, from the retained graph ``out = f(z_)``) to ``tol``.

    Attempts, until one reaches ``tol``: a dense LU solve of (I - J^T) w = g per sample (two
    refinement steps against the true VJP) when the state is small (``dense_max``, "auto") or
    asked for ("dense"); Anderson (or the named solver); the layer's own adjoint solver ``own``
    unless it is plain iteration (e.g. monDEQ splitting); last, for "auto", the dense solve of a
    state too large for ``dense_max`` whose Jacobians fit in memory. Iterative attempts start
    from the best ``w`` so far; each is judged by its residual measured afresh with the true VJP
    (which the returned stats carry)."""
    from .. import solvers
    from ..core.backward import AdjointMap
    from ..core.errors import DeqbenchError
    from ..solvers.base import make_stats

    def adj(w: Tensor) -> Tensor:
        return _vjp(out, z_, w) + g

    b, d = z_.shape[0], z_[0].numel()

    def dense_solve() -> tuple[Tensor | None, int]:
        jac = batched_jacobian(out, z_)
        eye = torch.eye(d, dtype=jac.dtype, device=jac.device)
        try:
            with _one_thread(jac):
                lu = torch.linalg.lu_factor(eye - jac.transpose(1, 2))

            def lu_solve(rhs: Tensor) -> Tensor:
                with _one_thread(rhs):
                    return torch.linalg.lu_solve(*lu, rhs.reshape(b, d, 1)).reshape(g.shape)

            w = lu_solve(g)
            for _ in range(2):  # iterative refinement against the true map
                fw = adj(w)
                if _finite_max(residuals(fw, w)[1]) < s.tol:
                    break
                w = w + lu_solve(fw - w)
        except RuntimeError:  # singular I - J^T
            return None, d
        return (w if bool(torch.isfinite(w).all()) else None), d + 2

    auto = s.adjoint == "auto"
    fits = s.dense_max > 0 and _dense_ok(z_, math.inf)
    small = fits and (not auto or _dense_ok(z_, s.dense_max))
    attempts: list[tuple[str, dict[str, Any]]] = []
    if s.adjoint in ("auto", "dense"):
        attempts += [("dense", {})] if small else []
        attempts.append(("anderson", {}))
    else:
        attempts.append((s.adjoint, {}))
    if own is not None and own.solver not in ("fixed_point", attempts[-1][0]):
        attempts.append((own.solver, dict(own.options)))  # e.g. monDEQ's splitting
    if auto and fits and not small:
        attempts.append(("dense", {}))
    amap = AdjointMap(adj, cell, z_.detach(), u.detach(), g)
    used: list[str] = []
    best, best_res, best_r, nstep = g.clone(), None, math.inf, 0
    for name, opts in attempts:
        if name == "dense":
            w, nf = dense_solve()
        else:
            try:
                w, st = solvers.get(name)(
                    amap, best, max_iter=s.max_iter, tol=s.tol, stop_mode="rel", **opts
                )
            except DeqbenchError:
                continue
            nf = st.nstep
        used.append(name)
        nstep += nf
        if w is None:
            continue
        res = residuals(adj(w), w)
        nstep += 1
        if _finite_max(res[1]) < best_r or best_res is None:
            best, best_res, best_r = w, res, _finite_max(res[1])
        if best_r < s.tol:
            break
    if best_res is None:
        best_res = residuals(adj(best), best)
        nstep += 1
    a, r = best_res
    diverged = math.isinf(_finite_max(a))
    stats = make_stats("+".join(used), nstep, [a], [r], a, r, s.tol, "rel", diverged)
    return best, stats


class _ReferenceFunction(torch.autograd.Function):
    """z* with the reference adjoint as its backward (first order only)."""

    @staticmethod
    def forward(ctx, layer, z, u, *params):  # type: ignore[override]
        ctx.layer = layer
        ctx.save_for_backward(z, u, *params)
        return z.clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):  # type: ignore[override]
        from torch.func import functional_call

        from ..core.backward import param_items

        layer: ReferenceLayer = ctx.layer
        z, u, *params = ctx.saved_tensors
        names, _ = param_items(layer)
        need_u = ctx.needs_input_grad[2]
        with torch.enable_grad():
            z_ = z.detach().requires_grad_()
            u_ = u.detach().requires_grad_(need_u)
            p_ = [p.detach().requires_grad_() for p in params]
            out = functional_call(layer.cell, dict(zip(names, p_)), (z_, u_))
            w, stats = _reference_adjoint(
                layer.ref, layer.cell, out, z_, u, g.detach(), layer.backward_cfg
            )
            layer.last_backward_stats = stats
            inputs = ([u_] if need_u else []) + p_
            gs = list(torch.autograd.grad(out, inputs, w, allow_unused=True)) if inputs else []
        gu = gs.pop(0) if need_u else None
        return (None, None, gu, *gs)


class ReferenceLayer(DEQLayer):
    """A DEQ layer that solves as the reference does (:class:`ReferenceSettings`): forward and
    adjoint to ``tol`` by robust methods, whatever the layer's configured solvers (its own
    forward solver and, unless plain iteration, its adjoint solver are fallbacks). First-order
    gradients only."""

    def __init__(
        self,
        cell: nn.Module,
        settings: ReferenceSettings,
        own: SolverConfig | None = None,
        own_backward: BackwardConfig | None = None,
    ) -> None:
        super().__init__(
            cell,
            replace(own) if own is not None else SolverConfig(settings.solver),
            replace(own_backward) if own_backward is not None else None,
        )
        self.ref = settings

    def solve(self, u: Tensor, z0: Tensor, cfg: SolverConfig | None = None) -> tuple[Tensor, Any]:
        z, stats = _reference_forward(self, u, z0)
        self.last_forward_stats = stats
        return z, stats

    def forward(self, u: Tensor, z0: Tensor | None = None) -> Tensor:
        from ..core.backward import param_items

        if z0 is None:
            z0 = torch.zeros_like(u)
        z, _ = self.solve(u, z0)
        self.last_backward_stats = None
        _, params = param_items(self)
        if not torch.is_grad_enabled() or not (u.requires_grad or params):
            return z
        return _ReferenceFunction.apply(self, z, u, *params)


def reference_copy(model: nn.Module, settings: ReferenceSettings) -> nn.Module:
    """A deep copy of ``model`` whose DEQ layers (any DEQLayer subclass) are
    :class:`ReferenceLayer` around the copied cells (their configured forward solver kept as
    a fallback)."""
    return _swap_layers(
        model, lambda c: ReferenceLayer(c.cell, settings, c.solver_cfg, c.backward_cfg)
    )


def reference_gradient(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    task: Any = "classification",
    *,
    solver: str = "anderson",
    tol: float = 1e-12,
    max_iter: int = 1000,
    adjoint_solver: str = "auto",
    options: dict[str, Any] | None = None,
    dense_max: int = DENSE_MAX,
) -> tuple[GradVector, dict[str, Any]]:
    """The reference gradient: the same training step in float64 with the implicit gradient,
    forward and adjoint solved to ``tol`` (rel) independently of the model's configured
    solvers (:class:`ReferenceLayer`). The adjoint is a dense direct solve of
    (I - J^T) w = g per sample when the state has at most ``dense_max`` entries
    (``adjoint_solver="auto"``, the default), else Anderson; the forward is ``solver``, then the
    model's own solver, then a dense Newton polish (small states) or Broyden.

    Returns (gradient, info) where info has the achieved ``forward_rel_residual``,
    ``backward_rel_residual`` (measured afresh against the true maps), ``forward_nstep``,
    ``backward_nstep``, ``forward_method``, ``adjoint_method``, ``converged`` (both residuals
    below ``tol``), ``note`` (one line, empty when converged) and ``time_s``. A reference that
    did not converge must not be the basis of an accuracy figure."""
    settings = ReferenceSettings(
        solver, adjoint_solver, float(tol), int(max_iter), int(dense_max), dict(options or {})
    )
    ref = reference_copy(model, settings).double()
    x64 = x.double() if x.is_floating_point() else x
    y64 = y.double() if y.is_floating_point() else y
    t0 = time.perf_counter()
    g = grad_vector(ref, x64, y64, task)
    info: dict[str, Any] = {"time_s": time.perf_counter() - t0, **last_stats(ref)}
    layers = list(deq_layers(ref))
    fw = [la.last_forward_stats for la in layers if la.last_forward_stats is not None]
    bw = [la.last_backward_stats for la in layers if la.last_backward_stats is not None]
    info["forward_method"] = ",".join(sorted({s.solver for s in fw}))
    info["adjoint_method"] = ",".join(sorted({s.solver for s in bw}))
    info["note"] = reference_note(info, tol) if layers else ""  # explicit: exact backprop
    info["converged"] = not info["note"]
    return g, info


def reference_note(info: dict[str, Any], tol: float) -> str:
    """One line saying why a reference (info of :func:`reference_gradient`) did not converge,
    with the fix; empty when both its forward and adjoint residuals are below ``tol``."""
    fr = info.get("forward_rel_residual", math.nan)
    br = info.get("backward_rel_residual", math.nan)
    if "forward_rel_residual" not in info:
        return "gradient reference: no DEQ forward solve ran"
    if not fr < tol:
        return (
            f"gradient reference forward did not converge (rel {fr:.2e} > {tol:g}, "
            f"{info.get('forward_method', '')}): raise ref_max_iter or loosen ref_tol"
        )
    if "backward_rel_residual" not in info:
        return "gradient reference: the loss does not reach the DEQ state (no adjoint solved)"
    if not br < tol:
        return (
            f"gradient reference adjoint did not converge (rel {br:.2e} > {tol:g}, "
            f"{info.get('adjoint_method', '')}): use ref_adjoint_solver auto (dense or "
            "Anderson) or raise ref_max_iter"
        )
    return ""
