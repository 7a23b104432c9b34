"""Spectral estimators of a symmetric linear operator given only by products ``v -> A v``.

Used for loss Hessians (:class:`deqbench.hessian.HVPOperator`, which re-exports these), but any
object with ``__call__(v)``, ``dim``, ``dtype`` and ``device`` works:

* :func:`lanczos`: top-``k`` algebraic eigenvalues and lambda_min, full reorthogonalisation,
  stopping on the Ritz residual ``|beta_m s_mi| <= tol * max|theta|``, then verified directly;
* :func:`power_iteration`: the top eigenvalue (with a shift when the dominant one is negative);
* :func:`hutchinson_trace`: seeded Rademacher probes, running standard error, stop at a target;
* :func:`slq`: stochastic Lanczos quadrature (``eigh`` on the tridiagonal) and its smoothed density.

Example:
    >>> import torch
    >>> from deqbench.hessian.estimators import lanczos, hutchinson_trace
    >>> A = torch.diag(torch.arange(1.0, 11.0, dtype=torch.float64))
    >>> class Op:
    ...     dim, dtype, device = 10, torch.float64, torch.device("cpu")
    ...     def __call__(self, v):
    ...         return A @ v
    >>> round(lanczos(Op(), k=2, tol=1e-10).eigenvalues[0], 8)
    10.0
    >>> round(hutchinson_trace(Op(), rel_target_se=0.01).trace, 6)   # diagonal: exact per probe
    55.0
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..core.errors import ConfigError


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed))


def _randn(op: Any, g: torch.Generator) -> Tensor:
    return torch.randn(op.dim, generator=g, dtype=torch.float64).to(
        device=op.device, dtype=op.dtype
    )


def _rademacher(op: Any, g: torch.Generator) -> Tensor:
    r = torch.randint(0, 2, (op.dim,), generator=g, dtype=torch.int64) * 2 - 1
    return r.to(device=op.device, dtype=op.dtype)


@dataclass
class EigenResult:
    """Eigenvalue estimates. ``eigenvalues`` descending (algebraic); ``residuals[i]`` is
    ``||H y_i - lambda_i y_i||`` for unit ``y_i`` (measured with one product each when
    ``verified``); ``converged`` says whether the Ritz-residual test passed."""

    eigenvalues: list[float]
    residuals: list[float]
    converged: bool
    n_hvp: int
    iterations: int
    method: str
    tol: float
    lambda_min: float = math.nan
    lambda_min_residual: float = math.nan
    verified: bool = False
    eigenvectors: Tensor | None = field(default=None, repr=False)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("eigenvectors", None)
        return d


def _orth(w: Tensor, Q: Tensor, j: int) -> Tensor:
    for _ in range(2):  # twice is enough (Kahan-Parlett)
        w = w - Q[:j].T @ (Q[:j] @ w)
    return w


def _tridiag(alphas: list[float], betas: list[float]) -> Tensor:
    m = len(alphas)
    T = torch.diag(torch.tensor(alphas, dtype=torch.float64))
    if m > 1:
        b = torch.tensor(betas[: m - 1], dtype=torch.float64)
        T += torch.diag(b, 1) + torch.diag(b, -1)
    return T


def _lanczos_run(
    op: Any,
    v0: Tensor,
    steps: int,
    g: torch.Generator,
    stop: Callable[[Tensor, Tensor, float], bool] | None = None,
) -> tuple[Tensor, Tensor, Tensor, int]:
    """Lanczos with full reorthogonalisation. Returns (theta, S, Q[:m], m): Ritz values of the
    m x m tridiagonal T, its eigenvectors and the Lanczos basis."""
    n = op.dim
    steps = min(int(steps), n)
    Q = torch.zeros(steps + 1, n, dtype=op.dtype, device=op.device)
    Q[0] = v0 / v0.norm()
    alphas: list[float] = []
    betas: list[float] = []
    theta = S = torch.zeros(0, dtype=torch.float64)
    m = 0
    for j in range(steps):
        w = op(Q[j])
        a = float(torch.dot(w, Q[j]))
        alphas.append(a)
        w = w - a * Q[j]
        if j > 0:
            w = w - betas[-1] * Q[j - 1]
        w = _orth(w, Q, j + 1)
        b = float(w.norm())
        m = j + 1
        theta, S = torch.linalg.eigh(_tridiag(alphas, betas))
        if stop is not None and stop(theta, S, b):
            break
        if j + 1 == steps:
            break
        scale = max(float(theta.abs().max()), 1e-300)
        if b <= 1e-10 * scale:
            # Invariant subspace: continue from a fresh random vector orthogonal to the basis.
            w = _orth(_randn(op, g), Q, j + 1)
            b_new = float(w.norm())
            betas.append(0.0)
            Q[j + 1] = w / b_new
        else:
            betas.append(b)
            Q[j + 1] = w / b
    return theta, S, Q[:m], m


def lanczos(
    op: Any,
    k: int = 1,
    *,
    max_iter: int = 100,
    tol: float = 1e-6,
    seed: int = 0,
    verify: bool = True,
    return_vectors: bool = False,
) -> EigenResult:
    """Top-``k`` algebraic eigenvalues (and lambda_min) by Lanczos with full reorthogonalisation.

    Stops when the Ritz residual estimate ``|beta_m s_mi|`` of each of the top ``k`` Ritz pairs is
    at most ``tol * max|theta|`` (or after ``max_iter`` products, or at ``dim``). With ``verify``
    the residuals are then measured directly (``k`` more products). The eigenvalue error is about
    ``residual**2 / gap``.
    """
    g = _gen(seed)
    k = max(1, min(int(k), op.dim))
    n0 = getattr(op, "n_hvp", 0)

    def stop(theta: Tensor, S: Tensor, b: float) -> bool:
        if theta.numel() < k:
            return False
        scale = max(float(theta.abs().max()), 1e-300)
        res = (b * S[-1, -k:]).abs()
        return bool((res <= tol * scale).all())

    theta, S, Q, m = _lanczos_run(op, _randn(op, g), max_iter, g, stop)
    order = torch.argsort(theta, descending=True)
    top = order[:k]
    ev = [float(theta[i]) for i in top]
    scale = max(float(theta.abs().max()), 1e-300)
    Y = S[:, top].to(device=Q.device, dtype=Q.dtype).T @ Q  # Ritz vectors, unit norm
    exact = m >= op.dim  # a full Krylov basis: the Ritz values are the eigenvalues
    if verify:
        res = [float((op(y / y.norm()) - lam * (y / y.norm())).norm()) for y, lam in zip(Y, ev)]
        converged = exact or all(r <= tol * scale for r in res)
    else:
        res = [math.nan] * len(ev)
        converged = exact or (m < min(int(max_iter), op.dim))  # stopped by the Ritz test
    lam_min = float(theta.min())
    iters = m
    return EigenResult(
        eigenvalues=ev,
        residuals=res,
        converged=bool(converged),
        n_hvp=getattr(op, "n_hvp", n0 + m) - n0,
        iterations=iters,
        method="lanczos",
        tol=tol,
        lambda_min=lam_min,
        verified=bool(verify),
        eigenvectors=Y if return_vectors else None,
    )


def _power(op: Any, v: Tensor, shift: float, max_iter: int, tol: float, scale: float):
    """Power iteration on ``H - shift I``; returns (lambda of H, residual, iterations, converged, v)."""
    lam, r, it = math.nan, math.nan, 0
    for _ in range(int(max_iter)):
        it += 1
        w = op(v) - shift * v
        mu = float(torch.dot(v, w))
        r = float((w - mu * v).norm())
        lam = mu + shift
        if r <= tol * max(abs(lam), scale):
            return lam, r, it, True, v
        nw = float(w.norm())
        if nw == 0.0:
            break
        v = w / nw
    return lam, r, it, False, v


def power_iteration(
    op: Any, *, max_iter: int = 1000, tol: float = 1e-6, seed: int = 0, algebraic: bool = True
) -> EigenResult:
    """Top eigenvalue by power iteration; stops when ``||H v - lambda v|| <= tol * |lambda|``
    with ``lambda = v.Hv`` (unit v).

    Plain power iteration finds the eigenvalue of largest magnitude, which may be negative. With
    ``algebraic`` (default) a negative result is followed by a second run on ``H - lambda I``
    (all eigenvalues shifted to >= 0), which gives the algebraic lambda_max; the first result is
    reported as ``lambda_min`` then.
    """
    g = _gen(seed)
    v = _randn(op, g)
    v = v / v.norm()
    n0 = getattr(op, "n_hvp", 0)
    lam, r, it, converged, v = _power(op, v, 0.0, max_iter, tol, 0.0)
    lam_min = math.nan
    if algebraic and lam < 0 and converged:
        lam_min = lam
        v2 = _randn(op, g)
        lam, r, it2, converged, v = _power(op, v2 / v2.norm(), lam_min, max_iter, tol, abs(lam_min))
        it += it2
    return EigenResult(
        eigenvalues=[lam],
        residuals=[r],
        converged=converged,
        n_hvp=getattr(op, "n_hvp", n0 + it) - n0,
        iterations=it,
        method="power",
        tol=tol,
        lambda_min=lam_min,
        verified=True,
        eigenvectors=v.unsqueeze(0),
    )


def eigenvalues(op: Any, k: int = 1, method: str = "lanczos", **kwargs: Any) -> EigenResult:
    """Top-``k`` eigenvalues by ``lanczos`` (default) or ``power`` (k = 1)."""
    if method == "lanczos":
        return lanczos(op, k, **kwargs)
    if method == "power":
        if k != 1:
            raise ConfigError("hessian: power iteration gives the top eigenvalue only (top_k 1)")
        return power_iteration(op, **kwargs)
    raise ConfigError(f"hessian.method: unknown method '{method}'; choose lanczos or power")


@dataclass
class TraceResult:
    """Hutchinson trace: mean of ``v.Hv`` over Rademacher probes, its standard error (sample std
    / sqrt(n)), the samples, and whether the SE target was met."""

    trace: float
    se: float
    n: int
    target_se: float
    converged: bool
    samples: list[float] = field(repr=False, default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("samples")
        return d


def hutchinson_trace(
    op: Any,
    *,
    target_se: float | None = None,
    rel_target_se: float | None = 0.01,
    min_samples: int = 10,
    max_samples: int = 1000,
    seed: int = 0,
) -> TraceResult:
    """Hutchinson's trace estimate with a standard-error stop.

    Draws seeded Rademacher probes until ``n >= min_samples`` and the standard error is at most
    ``max(target_se, rel_target_se * |mean|)`` (or ``max_samples``). The same seed gives the same
    probes, so two backends can be compared sample by sample.
    """
    g = _gen(seed)
    xs: list[float] = []
    mean, se, target = math.nan, math.inf, math.nan
    converged = False
    for _ in range(int(max_samples)):
        v = _rademacher(op, g)
        xs.append(float(torch.dot(v, op(v))))
        n = len(xs)
        mean = math.fsum(xs) / n
        if n >= 2:
            var = math.fsum((x - mean) ** 2 for x in xs) / (n - 1)
            se = math.sqrt(var / n)
        target = max(target_se or 0.0, (rel_target_se or 0.0) * abs(mean))
        if (
            n >= max(2, int(min_samples))
            and (target_se is not None or rel_target_se is not None)
            and se <= target
        ):
            converged = True
            break
    return TraceResult(mean, se, len(xs), target, converged, xs)


trace = hutchinson_trace


@dataclass
class DensityResult:
    """Stochastic Lanczos quadrature: per probe, the Ritz values (nodes) and the squared first
    components of the Ritz vectors (weights, summing to 1)."""

    nodes: list[list[float]]
    weights: list[list[float]]
    steps: int
    dim: int

    def as_frame(self) -> Any:
        import pandas as pd

        rows = [
            {"probe": p, "node": x, "weight": w}
            for p, (ns, ws) in enumerate(zip(self.nodes, self.weights))
            for x, w in zip(ns, ws)
        ]
        return pd.DataFrame(rows)

    @property
    def trace_estimate(self) -> float:
        """``dim * mean_probe(sum_i w_i theta_i)`` (the probes' Hutchinson estimate)."""
        per = [sum(w * x for x, w in zip(ns, ws)) for ns, ws in zip(self.nodes, self.weights)]
        return self.dim * sum(per) / len(per)

    def curve(
        self,
        grid: Tensor | None = None,
        *,
        sigma: float | None = None,
        sigma_rel: float = 0.01,
        n_grid: int = 400,
    ):
        """Gaussian-smoothed density on ``grid``: returns (grid, density, sigma). ``sigma``
        defaults to ``sigma_rel * (lambda_max - lambda_min)``; the density integrates to ~1."""
        allx = torch.tensor([x for ns in self.nodes for x in ns], dtype=torch.float64)
        lo, hi = float(allx.min()), float(allx.max())
        span = max(hi - lo, 1e-12 * max(abs(hi), 1.0))
        if sigma is None:
            sigma = sigma_rel * span
        if grid is None:
            grid = torch.linspace(lo - 5 * sigma, hi + 5 * sigma, n_grid, dtype=torch.float64)
        dens = torch.zeros_like(grid)
        for ns, ws in zip(self.nodes, self.weights):
            x = torch.tensor(ns, dtype=torch.float64)
            w = torch.tensor(ws, dtype=torch.float64)
            dens += (
                w[None, :] * torch.exp(-((grid[:, None] - x[None, :]) ** 2) / (2 * sigma**2))
            ).sum(1)
        dens /= len(self.nodes) * sigma * math.sqrt(2 * math.pi)
        return grid, dens, float(sigma)


def slq(op: Any, *, n_probes: int = 1, steps: int = 80, seed: int = 0) -> DensityResult:
    """Eigenvalue density by stochastic Lanczos quadrature (``eigh`` on the tridiagonal, full
    reorthogonalisation, Rademacher starts)."""
    g = _gen(seed)
    nodes, weights = [], []
    for _ in range(int(n_probes)):
        v0 = _rademacher(op, g)
        theta, S, _, _ = _lanczos_run(op, v0, steps, g)
        nodes.append(theta.tolist())
        weights.append((S[0, :] ** 2).tolist())
    return DensityResult(nodes, weights, min(int(steps), op.dim), op.dim)


density = slq
