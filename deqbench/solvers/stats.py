"""Solver statistics: :class:`SolverStats` (what a solve reports), the canonical per-sample
residuals, the stop-rule reduction over the batch (:func:`rule_value`), :func:`make_stats` and
the small per-sample tensor helpers the solvers share.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
from torch import Tensor

from .options import DEFAULT_STOP, check_stop, option_error

EPS = 1e-9
_max_reduce = np.maximum.reduce
STATUSES = ("converged", "max_iter", "diverged", "stagnated")


@dataclass
class SolverStats:
    """What a solve did. Tensors are on the solver's device; floats are batch summaries.

    Attributes:
        nstep: f-evaluations made (counted).
        abs_residual: (B,) per-sample abs residual of the returned iterate.
        rel_residual: (B,) per-sample rel residual of the returned iterate.
        abs_trace: (T, B) per-sample abs residual of every measured iterate, one row per f-eval
            that measured a residual (no sentinel, no padding).
        rel_trace: (T, B) same, relative.
        converged: whether the returned iterates meet the stop rule ``stop`` (default: the
            batch max residual in ``stop_mode`` below ``tol``; :attr:`stop_residual`).
        status: one of converged | max_iter | diverged | stagnated.
        lowest_step: index into the traces of the returned iterate (the latest over the batch;
            ``extra["lowest_steps"]`` has it per sample).
        solver, tol, stop_mode, stop: what was asked for (``stop``: the stop rule,
            :data:`STOP_RULES`).
        extra: solver-specific diagnostics (``returned`` is "x": the iterate, not f(x)).
        njvp: Jacobian-vector products made (forward-mode AD), counted apart from ``nstep``
            (0 for solvers that make none; ``newton_krylov``).
        path: how the solve ran: "eager", "graph" (replayed CUDA graph) or "compiled" (the
            cell compiled with torch.compile, run eagerly by the solver). Set by the DEQ layer
            (:attr:`deqbench.deq.Runtime.cuda_graph`); a direct call with ``cuda_graph`` set
            reports "graph".
        fz_norm: (B,) per-sample ``||f(x)||`` of the returned iterate where the tracker kept it
            (``stop="batch_fro"`` with ``stop_mode="rel"``), else None.
        maxima: (max abs, max rel) over the batch of ``abs_residual`` and ``rel_residual``
            where the solver read them already (a captured training step's solves, in the
            summary it reads once): :attr:`abs_max` and :attr:`rel_max` return them without a
            device read, which on a GPU would wait for the work queued after the solve. None:
            read from the tensors. Code that replaces the residual tensors must clear it.

    Example:
        >>> import torch, deqbench
        >>> z, st = deqbench.solvers.get("fixed_point")(lambda z: 0.5 * z + 1, torch.zeros(2, 3),
        ...                                            max_iter=100, tol=1e-6)
        >>> st.converged, st.status
        (True, 'converged')
    """

    nstep: int
    abs_residual: Tensor
    rel_residual: Tensor
    abs_trace: Tensor
    rel_trace: Tensor
    converged: bool
    status: str
    lowest_step: int = -1
    solver: str = ""
    tol: float = float("nan")
    stop_mode: str = "rel"
    extra: dict[str, Any] = field(default_factory=dict)
    njvp: int = 0
    path: str = "eager"
    stop: str = DEFAULT_STOP
    fz_norm: Tensor | None = None
    maxima: tuple[float, float] | None = None

    @property
    def abs_max(self) -> float:
        return self.maxima[0] if self.maxima is not None else batch_max(self.abs_residual)

    @property
    def abs_mean(self) -> float:
        return float(self.abs_residual.mean()) if self.abs_residual.numel() else float("nan")

    @property
    def rel_max(self) -> float:
        return self.maxima[1] if self.maxima is not None else batch_max(self.rel_residual)

    @property
    def rel_mean(self) -> float:
        return float(self.rel_residual.mean()) if self.rel_residual.numel() else float("nan")

    @property
    def residual(self) -> Tensor:
        """Per-sample residual in the stop mode."""
        return self.rel_residual if self.stop_mode == "rel" else self.abs_residual

    @property
    def stop_residual(self) -> float:
        """The returned iterates' residual under the stop rule (the value tested against
        ``tol``: the batch max, the batch Frobenius ratio or the batch mean; one host read)."""
        if self.stop == "sample_max":  # the max: read without two torch calls on the CPU
            return batch_max(self.residual)
        v = rule_value(self.abs_residual, self.rel_residual, self.stop, self.stop_mode,
                       self.fz_norm)  # fmt: skip
        return float(v) if self.abs_residual.numel() else float("nan")

    @property
    def converged_frac(self) -> float:
        r = self.residual
        return float((r < self.tol).double().mean()) if r.numel() else float("nan")

    def summary(self) -> dict[str, float]:
        """Scalar summary for result rows."""
        return {
            "nstep": float(self.nstep),
            "njvp": float(self.njvp),
            "abs_residual_max": self.abs_max,
            "abs_residual_mean": self.abs_mean,
            "rel_residual_max": self.rel_max,
            "rel_residual_mean": self.rel_mean,
            "converged": float(self.converged),
            "converged_frac": self.converged_frac,
        }


#: CPU float dtypes read and kept through numpy (:func:`batch_max`, the tracker's host path),
#: with their numpy dtypes
NUMPY_DTYPES: dict[torch.dtype, Any] = {torch.float32: np.float32, torch.float64: np.float64}


def batch_max(t: Tensor) -> float:
    """``float(t.max())`` (NaN for an empty tensor). A CPU float tensor is read through numpy
    (the same value: a maximum is exact and NaN propagates in both), a fraction of the two
    torch calls' host time; the solver stats read a few per training step."""
    if not t.numel():
        return float("nan")
    if t.device.type == "cpu" and t.dtype in NUMPY_DTYPES and not t.requires_grad:
        return float(_max_reduce(t.numpy(), axis=None))
    return float(t.max())


def flat(z: Tensor) -> Tensor:
    """(B, ...) -> (B, D) view (a copy only if ``z`` is not viewable)."""
    return z.reshape(z.shape[0], -1)


def residuals(fz: Tensor, z: Tensor) -> tuple[Tensor, Tensor]:
    """Per-sample canonical (abs, rel) residuals of iterate ``z`` with ``fz = f(z)``; shapes (B,)."""
    d = flat(fz - z)
    a = torch.linalg.vector_norm(d, dim=1)
    r = a / (torch.linalg.vector_norm(flat(fz), dim=1) + EPS)
    return a, r


def rule_value(
    abs_r: Tensor, rel_r: Tensor, stop: str, stop_mode: str, fz_norm: Tensor | None = None
) -> Tensor:
    """The residual under stop rule ``stop`` from per-sample residuals (reduced over the last
    dim: (B,) -> scalar, (T, B) -> (T,)). ``sample_max``: the max of the ``stop_mode``
    residual; ``batch_mean``: its mean; ``batch_fro``: ``||abs||_2`` (abs) or
    ``||abs||_2 / (||fz_norm||_2 + EPS)`` (rel) with ``fz_norm`` the per-sample ``||f(x)||``;
    without ``fz_norm`` it is recovered as ``abs / rel - EPS`` (0 where the residual is 0, whose
    norm then counts as 0: the ratio can only come out larger)."""
    res = rel_r if stop_mode == "rel" else abs_r
    if stop == "sample_max":
        return res.amax(-1)
    if stop == "batch_mean":
        return res.mean(-1)
    if stop != "batch_fro":
        check_stop(stop)
    num = torch.linalg.vector_norm(abs_r, dim=-1)
    if stop_mode != "rel":
        return num
    if fz_norm is None:
        fz_norm = torch.where(rel_r > 0, abs_r / rel_r - EPS, torch.zeros_like(abs_r)).clamp_min(0)
    return num / (torch.linalg.vector_norm(fz_norm, dim=-1) + EPS)


def make_stats(
    solver: str,
    nstep: int,
    abs_tr: list[Tensor] | Tensor,
    rel_tr: list[Tensor] | Tensor,
    best_abs: Tensor,
    best_rel: Tensor,
    tol: float,
    stop_mode: str,
    diverged: bool,
    lowest_step: int = -1,
    stagnated: bool = False,
    extra: dict[str, Any] | None = None,
    converged: bool | None = None,
    stop: str = DEFAULT_STOP,
    fz_norm: Tensor | None = None,
) -> SolverStats:
    """Assemble SolverStats (one host sync here unless ``converged`` is given).

    ``abs_tr``/``rel_tr`` are lists of (B,) tensors or (T, B) tensors. ``converged``: whether
    every returned residual is finite and the stop rule ``stop`` (:func:`rule_value`) holds,
    if the caller knows it already; ``fz_norm``: the per-sample ``||f(x)||`` of the returned
    iterates (``batch_fro`` under rel).
    """
    if isinstance(abs_tr, Tensor):  # rel_tr is of the same kind as abs_tr
        abs_trace, rel_trace = abs_tr, cast(Tensor, rel_tr)
    else:
        abs_trace = torch.stack(abs_tr) if abs_tr else best_abs.new_zeros(0, best_abs.shape[0])
        rel_tr = cast(list[Tensor], rel_tr)
        rel_trace = torch.stack(rel_tr) if rel_tr else best_rel.new_zeros(0, best_rel.shape[0])
    finite = True
    if converged is None:
        r = best_rel if stop_mode == "rel" else best_abs
        finite = bool(torch.isfinite(r).all())
        if stop == DEFAULT_STOP:
            converged = finite and bool((r < tol).all())
        else:
            v = rule_value(best_abs, best_rel, stop, stop_mode, fz_norm)
            converged = finite and r.numel() > 0 and bool(v < tol)
    if converged:
        status = "converged"
    elif diverged or not finite:
        status = "diverged"
    elif stagnated:
        status = "stagnated"
    else:
        status = "max_iter"
    return SolverStats(
        nstep=int(nstep),
        abs_residual=best_abs,
        rel_residual=best_rel,
        abs_trace=abs_trace,
        rel_trace=rel_trace,
        converged=converged,
        status=status,
        lowest_step=int(lowest_step),
        solver=solver,
        tol=float(tol),
        stop_mode=stop_mode,
        extra=extra or {},
        stop=stop,
        fz_norm=fz_norm,
    )


def check_output(solver: str, z: Tensor, fz: Tensor) -> None:
    """f must map an iterate to a tensor of the same shape (checked on the first call)."""
    if fz.shape != z.shape:
        raise option_error(
            solver,
            f"f maps an iterate of shape {tuple(z.shape)} to shape {tuple(fz.shape)}; a "
            "fixed-point map must keep the shape",
        )


def batch_norm(x: Tensor, out: Tensor | None = None) -> Tensor:
    """Per-sample 2-norm over all non-batch dims of ``x`` (B, ...) without reshaping copies."""
    if x.dim() == 1:
        return torch.abs(x, out=out) if out is not None else x.abs()
    try:  # one reduced dim where the layout allows it: 10x faster on CPU than several
        v = x.view(x.shape[0], -1)
    except RuntimeError:
        return torch.linalg.vector_norm(x, dim=tuple(range(1, x.dim())), out=out)
    return torch.linalg.vector_norm(v, dim=1, out=out)


def chunking(bsz: int, dim: int, device: torch.device) -> tuple[int, int]:
    """Split a per-sample dimension D = c * d for batched products over long vectors.

    cuBLAS runs a batched (n x D) @ (D x k) product with tiny n, k and a huge D on about one
    block per sample, far below memory bandwidth (about 0.23 ms per step for the Anderson Gram
    on the conv64 cell). Viewing each sample's vectors as c chunks of length d gives B * c small
    products, which stream at bandwidth, and the c partial results are summed. CPU: no split.
    """
    if device.type != "cuda" or dim <= 4096:
        return 1, dim
    dmax = max(512, min(4096, bsz * dim // 1024))  # aim at >= ~1024 products in the batch
    for d in range(dmax, 511, -1):
        if dim % d == 0:
            return dim // d, d
    return 1, dim
