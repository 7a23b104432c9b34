"""Hessian-vector products of a training loss and spectral estimators.

:class:`HVPOperator` gives ``v -> H v`` for ``L(theta) = loss_fn(model(X), y)`` (mean over one
batch, or the size-weighted mean over several) at the model's current parameters, on flat
vectors, through one of three backends:

* ``autograd``: Pearlmutter's trick, ``autograd.grad(g, theta, v)`` with ``g`` built by
  ``autograd.grad(..., create_graph=True)`` through ``torch.func.functional_call`` on detached
  copies of the parameters (never ``.backward()`` into ``.grad``). Exact for explicit nets and for
  deqbench's double-differentiable IFT; silently wrong for hook-based IFT, which the gates catch.
* ``fd``: central finite difference of the exact first-order gradient,
  ``(g(theta + h v) - g(theta - h v)) / 2h``; right for any DEQ whose gradient is right.
* ``pyhessian``: PyPI ``pyhessian`` 0.1's HVP (``loss.backward(create_graph=True)`` then
  ``autograd.grad``), called with an explicit ``cuda=`` flag from the device, ``zero_grad`` before
  and after, its ``create_graph`` reference-cycle warning suppressed locally, and never its
  ``density()`` (it calls the removed ``torch.eig``).

Estimators (:mod:`deqbench.hessian.estimators`, re-exported here) work on any operator (anything with
``__call__(v)``, ``dim``, ``dtype``, ``device``):
:func:`lanczos` (top-k algebraic eigenvalues and lambda_min, stopping on the Ritz residual),
:func:`power_iteration`, :func:`hutchinson_trace` (seeded Rademacher probes, running standard
error, stops at a target SE) and :func:`slq` (stochastic Lanczos quadrature density).
:func:`run_gates` checks a backend before any number is reported: the gradient against a finite
difference of the loss, the HVP against the FD-HVP (:func:`hvp_vs_fd`: a vector whose FD step
crossed a kink of the loss is retaken with smaller steps), and the symmetry ``u.Hv`` vs ``v.Hu``;
the DEQ solves made meanwhile (forward, IFT adjoint, tangent of the double backward) are
recorded per kind (:meth:`HVPOperator.residuals`).

Example:
    >>> import torch, deqbench
    >>> from deqbench.hessian import HVPOperator, lanczos, hutchinson_trace
    >>> model = deqbench.models.create("fc_deq_tiny", in_shape=(4,), width=8, num_outputs=3)
    >>> X, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    >>> with HVPOperator(model, torch.nn.functional.cross_entropy, (X, y)) as H:  # doctest: +SKIP
    ...     top = lanczos(H, k=3, tol=1e-6)
    ...     tr = hutchinson_trace(H, rel_target_se=0.02)
    >>> top.eigenvalues, tr.trace, tr.se                                         # doctest: +SKIP
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from ..core.errors import ConfigError, DeqbenchError
from .estimators import (  # re-exported: deqbench.hessian.lanczos etc.
    DensityResult,
    EigenResult,
    TraceResult,
    _gen,
    _randn,
    density,
    eigenvalues,
    hutchinson_trace,
    lanczos,
    power_iteration,
    slq,
    trace,
)

BACKENDS = ("autograd", "fd", "pyhessian")
#: the DEQ solves an HVP makes: forward, IFT adjoint, and the adjoint's tangent (double backward)
SOLVE_KINDS = ("forward", "backward", "tangent")


# -- operator ---------------------------------------------------------------------------------


class HVPOperator:
    """``v -> H v`` for the loss of ``model`` on fixed data, on flat parameter vectors.

    Args:
        model: the model; its parameters are the expansion point. They are never written
            (``pyhessian`` fills and then clears their ``.grad``).
        loss_fn: ``loss_fn(outputs, targets)`` with mean reduction.
        data: one batch ``(X, y)`` or a list of batches (size-weighted mean loss).
        params: parameter names to take the Hessian over (default: all that require grad);
            the others are held fixed.
        backend: ``autograd`` | ``fd`` | ``pyhessian``.
        fd_eps: FD step for a unit vector (default ``eps_dtype ** (1/3)`` times
            ``max(1, rms(theta))``).
        eval_mode: evaluate the model in ``eval()`` (pyhessian forces it); restored on close.
        cache_graph: keep the gradient graph between products (one batch only).

    Use as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[[Tensor, Tensor], Tensor],
        data: tuple[Tensor, Tensor] | Sequence[tuple[Tensor, Tensor]],
        *,
        params: Sequence[str] | None = None,
        backend: str = "autograd",
        fd_eps: float | None = None,
        eval_mode: bool = True,
        cache_graph: bool = True,
    ) -> None:
        if backend not in BACKENDS:
            raise ConfigError(
                f"hessian.backend: unknown backend '{backend}'; choose from {', '.join(BACKENDS)}"
            )
        self.model = model
        self.loss_fn = loss_fn
        self.backend = backend
        if isinstance(data, tuple) and len(data) == 2 and isinstance(data[0], Tensor):
            self.batches = [data]
        else:
            self.batches = list(data)  # type: ignore[arg-type]
        if not self.batches:
            raise ConfigError("hessian: no data")
        self._weights = [float(b[0].shape[0]) for b in self.batches]
        total = sum(self._weights)
        self._weights = [w / total for w in self._weights]
        named = dict(model.named_parameters())
        if params is None:
            params = [n for n, p in named.items() if p.requires_grad]
        unknown = [n for n in params if n not in named]
        if unknown:
            raise ConfigError(f"hessian.params: unknown parameter(s) {', '.join(unknown[:4])}")
        self.names = list(params)
        self.shapes = [named[n].shape for n in self.names]
        self.numels = [named[n].numel() for n in self.names]
        self.dim = int(sum(self.numels))
        p0 = named[self.names[0]]
        self.dtype, self.device = p0.dtype, p0.device
        self.theta = torch.cat([named[n].detach().reshape(-1) for n in self.names])
        self.n_hvp = 0
        self.n_grad = 0
        self.seconds = 0.0
        self.deq_log: list[dict[str, float]] = []
        # solver stats already on the layers (the last training step's) are not this operator's
        self._last: dict[tuple[int, str], Any] = self._layer_stats()
        self._was_training = model.training
        self._closed = False
        if eval_mode:
            model.eval()
        self.fd_eps = fd_eps
        if backend == "fd" and fd_eps is None:
            rms = float(self.theta.norm()) / math.sqrt(max(self.dim, 1))
            self.fd_eps = torch.finfo(self.dtype).eps ** (1.0 / 3.0) * max(1.0, rms)
        self._graph: tuple[list[Tensor], tuple[Tensor, ...]] | None = None
        self._cache = cache_graph and len(self.batches) == 1
        self._ph: Any = None
        self._rg: dict[str, bool] = {}
        if backend == "pyhessian":
            self._init_pyhessian()

    # flat <-> per-parameter
    def unflatten(self, v: Tensor) -> list[Tensor]:
        return [c.view(s) for c, s in zip(torch.split(v, self.numels), self.shapes)]

    @staticmethod
    def flatten(ts: Sequence[Tensor | None], like: list[Tensor]) -> Tensor:
        return torch.cat(
            [(t if t is not None else torch.zeros_like(p)).reshape(-1) for t, p in zip(ts, like)]
        )

    def _layer_stats(self) -> dict[tuple[int, str], Any]:
        """The last solver stats of each DEQ layer, by (layer index, kind)."""
        from ..core.deq import deq_layers

        return {
            (i, kind): getattr(layer, f"last_{kind}_stats", None)
            for i, layer in enumerate(deq_layers(self.model))
            for kind in SOLVE_KINDS
        }

    def _log_deq(self) -> None:
        """Record the DEQ solves (forward, adjoint, tangent of a double backward) made since the
        last call: residual and convergence per kind (gate d). Stats already on the layers when
        the operator was made (the last training step's) are not its own."""
        for (i, kind), st in self._layer_stats().items():
            if st is not None and st is not self._last.get((i, kind)) and st.solver != "unrolled":
                self._last[(i, kind)] = st
                self.deq_log.append(
                    {
                        f"{kind}_rel_residual": st.rel_max,
                        f"{kind}_abs_residual": st.abs_max,
                        f"{kind}_converged": float(st.converged),
                        f"{kind}_nstep": float(st.nstep),
                    }
                )

    def _loss_at(self, leaves: list[Tensor], batch: tuple[Tensor, Tensor]) -> Tensor:
        out = functional_call(self.model, dict(zip(self.names, leaves)), (batch[0],))
        loss = self.loss_fn(out, batch[1])
        self._log_deq()
        return loss

    def loss(self, theta: Tensor | None = None) -> float:
        """The loss at ``theta`` (flat; default the expansion point)."""
        th = self.theta if theta is None else theta
        with torch.no_grad():
            leaves = self.unflatten(th)
            return float(
                sum(
                    w * self._loss_at(leaves, b).double()
                    for w, b in zip(self._weights, self.batches)
                )
            )

    def gradient(self, theta: Tensor | None = None) -> Tensor:
        """The exact first-order gradient at ``theta`` (flat), through the model's backward."""
        th = self.theta if theta is None else theta
        leaves = [t.detach().requires_grad_(True) for t in self.unflatten(th)]
        g = torch.zeros_like(self.theta)
        with torch.enable_grad():
            for w, b in zip(self._weights, self.batches):
                gs = torch.autograd.grad(self._loss_at(leaves, b), leaves, allow_unused=True)
                self._log_deq()
                g += w * self.flatten(gs, leaves)
        self.n_grad += 1
        return g

    def _autograd_hvp(self, v: Tensor) -> Tensor:
        vs = self.unflatten(v)
        if self._cache:
            if self._graph is None:
                leaves = [t.detach().requires_grad_(True) for t in self.unflatten(self.theta)]
                with torch.enable_grad():
                    g = torch.autograd.grad(
                        self._loss_at(leaves, self.batches[0]), leaves, create_graph=True
                    )
                self._graph = (leaves, g)
                self._log_deq()
            leaves, g = self._graph
            hv = torch.autograd.grad(g, leaves, vs, retain_graph=True, allow_unused=True)
            return self.flatten(hv, leaves)
        out = torch.zeros_like(self.theta)
        for w, b in zip(self._weights, self.batches):
            leaves = [t.detach().requires_grad_(True) for t in self.unflatten(self.theta)]
            with torch.enable_grad():
                g = torch.autograd.grad(self._loss_at(leaves, b), leaves, create_graph=True)
                hv = torch.autograd.grad(g, leaves, vs, allow_unused=True)
            out += w * self.flatten(hv, leaves)
        return out

    def _fd_hvp(self, v: Tensor) -> Tensor:
        nv = float(v.norm())
        if nv == 0.0:
            return torch.zeros_like(v)
        h = float(self.fd_eps or 0.0) / nv
        gp = self.gradient(self.theta + h * v)
        gm = self.gradient(self.theta - h * v)
        return (gp - gm) / (2 * h)

    # pyhessian backend
    def _init_pyhessian(self) -> None:
        from pyhessian import hessian as PyHessian  # the package rebinds the name to the class

        keep = set(self.names)
        for n, p in self.model.named_parameters():
            self._rg[n] = p.requires_grad
            p.requires_grad_(n in keep)
        self.model.zero_grad(set_to_none=True)
        cuda = self.device.type == "cuda"
        kwargs: dict[str, Any] = {"cuda": cuda}
        if len(self.batches) == 1:
            kwargs["data"] = self.batches[0]
        else:
            kwargs["dataloader"] = self.batches
        try:
            with self._pyhessian_ctx():
                self._ph = PyHessian(self.model, self.loss_fn, **kwargs)
        except Exception:
            self.close()
            raise
        self._log_deq()
        bad = [n for n, g in zip(self.names, self._ph.gradsH) if not isinstance(g, Tensor)]
        if bad and len(self.batches) == 1:  # (the dataloader path fills gradsH per product)
            self.close()
            raise DeqbenchError(
                f"hessian: pyhessian needs a gradient for every parameter; none for {', '.join(bad[:4])} "
                "(restrict hessian.params to the parameters the loss uses)"
            )

    def _pyhessian_ctx(self):
        import contextlib

        stack = contextlib.ExitStack()
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message=r".*create_graph=True.*", category=UserWarning)
        if self.device.type == "cuda":
            stack.enter_context(torch.cuda.device(self.device))
        return stack

    def _pyhessian_hvp(self, v: Tensor) -> Tensor:
        from pyhessian.utils import hessian_vector_product

        vs = self.unflatten(v)
        with self._pyhessian_ctx():
            if len(self.batches) == 1:
                hv = hessian_vector_product(self._ph.gradsH, self._ph.params, vs)
            else:
                _, hv = self._ph.dataloader_hv_product(vs)
                self.model.zero_grad(set_to_none=True)
        return self.flatten(hv, vs)

    # public
    def __call__(self, v: Tensor) -> Tensor:
        return self.matvec(v)

    def matvec(self, v: Tensor) -> Tensor:
        """``H v`` for a flat vector ``v`` (dim ``self.dim``)."""
        if self._closed:
            raise DeqbenchError("hessian: HVPOperator used after close()")
        v = v.to(device=self.device, dtype=self.dtype)
        t0 = time.perf_counter()
        if self.backend == "autograd":
            out = self._autograd_hvp(v)
        elif self.backend == "fd":
            out = self._fd_hvp(v)
        else:
            out = self._pyhessian_hvp(v)
        out = out.detach()
        self._log_deq()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds += time.perf_counter() - t0
        self.n_hvp += 1
        return out

    @property
    def seconds_per_hvp(self) -> float:
        return self.seconds / self.n_hvp if self.n_hvp else math.nan

    def residuals(self) -> dict[str, float]:
        """Over the DEQ solves made while evaluating (empty if no DEQ), per kind (forward,
        backward = the IFT adjoint, tangent = the adjoint's derivative in a double backward):
        the largest relative residual (``*_rel_residual_max``, inf when one was not finite) and
        whether every solve reached its tolerance (``*_all_converged``, 1 or 0)."""
        out: dict[str, float] = {}
        for st in self.deq_log:
            for kind in SOLVE_KINDS:
                k = f"{kind}_rel_residual"
                if k in st:
                    v = st[k] if math.isfinite(st[k]) else math.inf
                    out[k + "_max"] = max(out.get(k + "_max", 0.0), v)
                c = f"{kind}_converged"
                if c in st:
                    out[f"{kind}_all_converged"] = min(out.get(f"{kind}_all_converged", 1.0), st[c])
        return out

    def close(self) -> None:
        """Release graphs, clear ``.grad`` (pyhessian), restore requires_grad and train mode."""
        if self._closed:
            return
        self._graph = None
        if self.backend == "pyhessian":
            self._ph = None
            self.model.zero_grad(set_to_none=True)
            for n, p in self.model.named_parameters():
                if n in self._rg:
                    p.requires_grad_(self._rg[n])
        self.model.train(self._was_training)
        self._closed = True

    def __enter__(self) -> HVPOperator:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def dense_hessian(op: Any) -> Tensor:
    """The dense Hessian by ``dim`` products with unit vectors (small problems only)."""
    cols = [
        op(torch.nn.functional.one_hot(torch.tensor(i), op.dim).to(op.dtype)) for i in range(op.dim)
    ]
    return torch.stack(cols, 1)


__all__ = [
    "BACKENDS",
    "HVPOperator",
    "dense_hessian",
    "EigenResult",
    "TraceResult",
    "DensityResult",
    "lanczos",
    "power_iteration",
    "eigenvalues",
    "hutchinson_trace",
    "trace",
    "slq",
    "density",
    "gradient_check",
    "hvp_agreement",
    "hvp_vs_fd",
    "symmetry_error",
    "loss_label",
    "GateReport",
    "gate_thresholds",
    "run_gates",
]

# -- gates ------------------------------------------------------------------------------------


def gradient_check(op: HVPOperator, n: int = 3, *, seed: int = 0, h: float | None = None) -> float:
    """Largest ``|FD(L, v) - g.v| / (||g|| ||v||)`` over ``n`` random unit ``v``, with a central
    difference of the loss itself (independent of the model's backward). Flags JFB gradients."""
    g = _gen(seed + 101)
    grad = op.gradient()
    gn = float(grad.norm())
    if h is None:
        h = 1e-4 if op.dtype == torch.float64 else 1e-2
    worst = 0.0
    for _ in range(n):
        v = _randn(op, g)
        v = v / v.norm()
        fd = (op.loss(op.theta + h * v) - op.loss(op.theta - h * v)) / (2 * h)
        worst = max(worst, abs(fd - float(torch.dot(grad, v))) / max(gn, 1e-30))
    return worst


def hvp_agreement(op_a: Any, op_b: Any, n: int = 3, *, seed: int = 0) -> float:
    """Largest ``||H_a v - H_b v|| / ||H_b v||`` over ``n`` random vectors."""
    g = _gen(seed + 202)
    worst = 0.0
    for _ in range(n):
        v = _randn(op_a, g)
        a, b = op_a(v), op_b(v.to(device=op_b.device, dtype=op_b.dtype))
        worst = max(worst, float((a - b.to(a.dtype)).norm()) / max(float(b.norm()), 1e-300))
    return worst


#: smaller FD steps (factors of ``fd_eps``) tried on a vector where the backend and the FD-HVP
#: disagree: a kink of the loss (ReLU) within the step makes one FD-HVP arbitrarily wrong, and a
#: step that does not reach the kink gives the right one (float32 leaves little room: rounding)
FD_RETRY_STEPS = {torch.float64: (0.25, 1 / 16, 1 / 64), torch.float32: (0.5, 0.25)}


def _rel_err(a: Tensor, op_b: Any, v: Tensor) -> float:
    b = op_b(v.to(device=op_b.device, dtype=op_b.dtype))
    return float((a - b.to(a.dtype)).norm()) / max(float(b.norm()), 1e-300)


def hvp_vs_fd(
    op: Any, fd_op: HVPOperator, n: int = 3, *, seed: int = 0, threshold: float = 0.0
) -> tuple[float, int]:
    """Gate (b): largest ``||H v - FD(v)|| / ||FD(v)||`` over ``n`` random vectors (those of
    :func:`hvp_agreement`), and how many vectors needed a smaller FD step. Where a vector's
    error exceeds ``threshold`` the FD-HVP is retaken with the steps of ``FD_RETRY_STEPS`` and
    the smallest error counts: the FD reference is only as good as its step, and a loss with
    kinks (ReLU cells: monDEQ, OptEq) crossed within the step gives an FD-HVP that is off by
    the jump over the step, which a smaller step avoids. A wrong backend HVP agrees with no step."""
    g = _gen(seed + 202)
    worst, retried = 0.0, 0
    base = fd_op.fd_eps
    for _ in range(n):
        v = _randn(op, g)
        a = op(v)
        e = _rel_err(a, fd_op, v)
        if not e <= threshold and base:
            retried += 1
            try:
                for fac in FD_RETRY_STEPS.get(fd_op.dtype, (0.5,)):
                    fd_op.fd_eps = base * fac
                    e = min(e, _rel_err(a, fd_op, v))
                    if e <= threshold:
                        break
            finally:
                fd_op.fd_eps = base
        worst = max(worst, e)
    return worst, retried


def symmetry_error(op: Any, n: int = 3, *, seed: int = 0) -> float:
    """Largest ``|u.Hv - v.Hu| / ((||u|| ||Hv|| + ||v|| ||Hu||) / 2)`` over ``n`` random pairs."""
    g = _gen(seed + 303)
    worst = 0.0
    for _ in range(n):
        u, v = _randn(op, g), _randn(op, g)
        hu, hv = op(u), op(v)
        num = abs(float(torch.dot(u, hv)) - float(torch.dot(v, hu)))
        den = 0.5 * (float(u.norm() * hv.norm()) + float(v.norm() * hu.norm()))
        worst = max(worst, num / max(den, 1e-300))
    return worst


def loss_label(model: nn.Module) -> str:
    """What the model's backward differentiates (gate e): the fixed-point loss or a surrogate."""
    from ..core.deq import deq_layers

    modes = {layer.backward_cfg.name for layer in deq_layers(model)}
    if not modes:
        return "explicit loss"
    labels = {
        "ift": "fixed-point loss (IFT)",
        "unrolled": "unrolled-K loss",
        "jfb": "JFB surrogate",
        "phantom": "phantom-gradient surrogate",
    }
    return "; ".join(labels.get(m, m) for m in sorted(modes))


@dataclass
class GateReport:
    """Checks before a Hessian number is reported.

    grad_check: gradient vs central FD of the loss (gate a); hvp_vs_fd: backend HVP vs FD-HVP
    (gate b); symmetry: u.Hv vs v.Hu (gate c); residuals: largest DEQ residuals seen (gate d);
    loss_label: what is differentiated (gate e).
    """

    backend: str
    grad_check: float
    hvp_vs_fd: float
    symmetry: float
    thresholds: dict[str, float]
    passed: dict[str, bool]
    loss_label: str
    residuals: dict[str, float] = field(default_factory=dict)
    fd_retries: int = 0

    @property
    def ok(self) -> bool:
        return all(self.passed.values())

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        return d


def gate_thresholds(dtype: torch.dtype) -> dict[str, float]:
    """Refusal thresholds: HVP vs FD 1e-6 (float64) / 1e-3 (float32)."""
    if dtype == torch.float64:
        return {"grad_check": 1e-5, "hvp_vs_fd": 1e-6, "symmetry": 1e-8}
    return {"grad_check": 5e-2, "hvp_vs_fd": 1e-3, "symmetry": 1e-4}


def run_gates(
    op: HVPOperator, fd_op: HVPOperator | None = None, *, n: int = 3, seed: int = 0
) -> GateReport:
    """Run gates (a)-(e) for ``op``; ``fd_op`` is the FD operator on the same model and data
    (built and closed here when not given). For ``op.backend == 'fd'`` gate (b) is trivially 0."""
    own = fd_op is None and op.backend != "fd"
    if own:
        fd_op = HVPOperator(op.model, op.loss_fn, op.batches, params=op.names, backend="fd")
    th = gate_thresholds(op.dtype)
    retries = 0
    try:
        grad = gradient_check(op, n, seed=seed)
        hvp = 0.0
        if op.backend != "fd":
            assert fd_op is not None
            hvp, retries = hvp_vs_fd(op, fd_op, n, seed=seed, threshold=th["hvp_vs_fd"])
        sym = symmetry_error(op, n, seed=seed)
        res = dict(op.residuals())
        if fd_op is not None:
            for k, v in fd_op.residuals().items():
                res[k] = (
                    max(res.get(k, v), v) if not k.endswith("converged") else min(res.get(k, v), v)
                )
    finally:
        if own and fd_op is not None:
            fd_op.close()
    vals = {"grad_check": grad, "hvp_vs_fd": hvp, "symmetry": sym}
    passed = {k: bool(math.isfinite(v) and v <= th[k]) for k, v in vals.items()}
    return GateReport(op.backend, grad, hvp, sym, th, passed, loss_label(op.model), res, retries)
