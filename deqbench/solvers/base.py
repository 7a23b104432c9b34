"""Solver contract: ``solve(f, z0, *, max_iter, tol, stop_mode="rel", **options) -> (z, SolverStats)``.

Conventions (REFERENCE.md section 1):

* batched over dim 0; each sample's state is flattened (all non-batch dims);
* canonical residual per sample: ``abs_i = ||f(z)_i - z_i||``, ``rel_i = abs_i / (||f(z)_i|| + 1e-9)``;
* stop when the batch max of the chosen residual (``stop_mode`` rel or abs) is below ``tol``;
* ``nstep`` counts every f-evaluation the solver makes;
* the returned iterate is the lowest-residual iterate *x* whose residual was measured
  (``returns="lowest"``, the default) or the last measured iterate (``returns="last"``); its
  residual is exactly the reported one, no extra uncounted evaluation is made;
* a non-finite value or a residual blow-up stops the solver with ``status="diverged"``; nothing
  is raised.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

EPS = 1e-9
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
        converged: whether the batch max residual (in ``stop_mode``) is below ``tol``.
        status: one of converged | max_iter | diverged | stagnated.
        lowest_step: index into the traces of the returned iterate.
        solver, tol, stop_mode: what was asked for.
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

    @property
    def abs_max(self) -> float:
        return float(self.abs_residual.max()) if self.abs_residual.numel() else float("nan")

    @property
    def abs_mean(self) -> float:
        return float(self.abs_residual.mean()) if self.abs_residual.numel() else float("nan")

    @property
    def rel_max(self) -> float:
        return float(self.rel_residual.max()) if self.rel_residual.numel() else float("nan")

    @property
    def rel_mean(self) -> float:
        return float(self.rel_residual.mean()) if self.rel_residual.numel() else float("nan")

    @property
    def residual(self) -> Tensor:
        """Per-sample residual in the stop mode."""
        return self.rel_residual if self.stop_mode == "rel" else self.abs_residual

    @property
    def converged_frac(self) -> float:
        r = self.residual
        return float((r < self.tol).double().mean()) if r.numel() else float("nan")

    def summary(self) -> dict[str, float]:
        """Scalar summary for result rows."""
        return {
            "nstep": float(self.nstep),
            "abs_residual_max": self.abs_max,
            "abs_residual_mean": self.abs_mean,
            "rel_residual_max": self.rel_max,
            "rel_residual_mean": self.rel_mean,
            "converged": float(self.converged),
            "converged_frac": self.converged_frac,
        }


def flat(z: Tensor) -> Tensor:
    """(B, ...) -> (B, D) view."""
    return z.reshape(z.shape[0], -1)


def residuals(fz: Tensor, z: Tensor) -> tuple[Tensor, Tensor]:
    """Per-sample canonical (abs, rel) residuals of iterate ``z`` with ``fz = f(z)``; shapes (B,)."""
    d = flat(fz - z)
    a = torch.linalg.vector_norm(d, dim=1)
    r = a / (torch.linalg.vector_norm(flat(fz), dim=1) + EPS)
    return a, r


def check_stop_mode(stop_mode: str) -> None:
    if stop_mode not in ("rel", "abs"):
        raise ValueError(f"stop_mode must be 'rel' or 'abs', got {stop_mode!r}")


def check_options(solver: str, options: dict[str, Any], allowed: set[str]) -> None:
    """Reject unknown solver options (TorchDEQ silently accepts typos; we do not)."""
    unknown = set(options) - allowed
    if unknown:
        import difflib

        bad = sorted(unknown)[0]
        close = difflib.get_close_matches(bad, sorted(allowed), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        from ..errors import ConfigError

        raise ConfigError(
            f"solver '{solver}': unknown option '{bad}'{hint}; options: {', '.join(sorted(allowed))}"
        )


def make_stats(
    solver: str,
    nstep: int,
    abs_tr: list[Tensor],
    rel_tr: list[Tensor],
    best_abs: Tensor,
    best_rel: Tensor,
    tol: float,
    stop_mode: str,
    diverged: bool,
    lowest_step: int = -1,
    stagnated: bool = False,
    extra: dict[str, Any] | None = None,
) -> SolverStats:
    """Assemble SolverStats (one host sync here, at the end of the solve)."""
    abs_trace = torch.stack(abs_tr) if abs_tr else best_abs.new_zeros(0, best_abs.shape[0])
    rel_trace = torch.stack(rel_tr) if rel_tr else best_rel.new_zeros(0, best_rel.shape[0])
    r = best_rel if stop_mode == "rel" else best_abs
    finite = bool(torch.isfinite(r).all())
    converged = finite and bool((r < tol).all())
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
    )
