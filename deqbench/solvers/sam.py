"""Sequential averaging (SAM) with a feature prior: OptEq's R-dagger (papers/003 section 5.2).

    z_k = beta_k S_k(z_{k-1}) + (1 - beta_k) T(z_{k-1}),    beta_k = lambda_k = rho / k^c,
    S_k(z) = (1 - eta lambda_k) z - eta grad R(z)           (prior_step "grad"),
    S_k(z) = prox_{eta R}((1 - eta lambda_k) z)             (prior_step "prox"),

with T the cell map and R the prior (:mod:`deqbench.core.regularizers`). As beta_k -> 0 the iterates
approach argmin R over Fix(T) (papers/003 Theorem 5: eta = 1 / (2 L), rho + 2c < 1, T
nonexpansive, e.g. an OptEq layer with ||W|| <= 1). When Fix(T) is a single point SAM converges
to it, more slowly than plain iteration; when it is not, plain iteration stops at a point that
depends on z0 while SAM selects the prior's minimiser.

Stopping: the canonical residual ||T(z) - z|| / ||T(z)|| measures membership in Fix(T), not the
selection, so by default SAM returns the **last** iterate and ``min_iter`` (default 0) keeps it
from stopping on the residual too early; use ``tol=0`` to run ``max_iter`` steps.

A solver may define ``unroll(f, z0, k, **options) -> (z_k, abs_trace, rel_trace)``: the
differentiable k-step iteration the ``unrolled`` backward mode uses instead of plain iteration
(papers/003 Eq. 12: training through the K-th SAM iterate).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..core.registry import solvers
from .base import (
    COMMON_OPTIONS,
    CommonOptions,
    SolverStats,
    Tracker,
    check_budget,
    check_options,
    check_output,
    option_error,
    residuals,
)

OPTIONS = COMMON_OPTIONS | {
    "prior",
    "rho",
    "c",
    "eta",
    "lam_scale",
    "prior_step",
    "min_iter",
    "polish",
}


class _Schedule:
    """Parsed SAM options: the prior and the beta_k / lambda_k / eta schedule."""

    def __init__(self, options: dict[str, Any]) -> None:
        from ..core.regularizers import get_regularizer

        prior = options.get("prior", "l2")
        if prior is None:
            raise option_error(
                "sam",
                "needs a prior: option 'prior' naming a regularizer "
                "(l2, l1, incay, decorrelation, hsic) or a dict with its name",
            )
        try:
            reg = get_regularizer(prior)
        except Exception as exc:
            raise option_error("sam", f"prior: {exc}") from None
        assert reg is not None
        self.prior = reg
        self.rho = float(options.get("rho", 0.5))
        self.c = float(options.get("c", 0.2))
        if not 0 < self.rho <= 1:
            raise option_error("sam", f"rho must be in (0, 1], got {self.rho}")
        if not self.c > 0:
            raise option_error("sam", f"c must be > 0, got {self.c}")
        eta = options.get("eta")
        if eta is None:
            L = self.prior.lipschitz
            eta = 1.0 / (2.0 * L) if L else 0.5
        self.eta = float(eta)
        if not self.eta > 0:
            raise option_error("sam", f"eta must be > 0, got {self.eta}")
        self.lam_scale = float(options.get("lam_scale", 1.0))
        mode = options.get("prior_step", "auto")
        if mode not in ("auto", "grad", "prox"):
            raise option_error("sam", f"prior_step must be auto|grad|prox, got {mode!r}")
        if mode == "prox" and not self.prior.has_prox:
            raise option_error("sam", f"prior '{self.prior.name}' has no closed-form prox")
        self.prox = mode == "prox" or (mode == "auto" and self.prior.has_prox)
        self.min_iter = int(options.get("min_iter", 0))
        self.polish = int(options.get("polish", 0))
        if self.min_iter < 0 or self.polish < 0:
            raise option_error("sam", "min_iter and polish must be >= 0")

    def beta(self, k: int) -> float:
        return self.rho / k**self.c

    def step(self, z: Tensor, tz: Tensor, k: int) -> Tensor:
        """z_k from z = z_{k-1} and tz = T(z_{k-1})."""
        b = self.beta(k)
        lam = self.lam_scale * b
        shrink = 1.0 - self.eta * lam
        if self.prox:
            s = self.prior.prox(shrink * z, self.eta)
        else:
            s = shrink * z - self.eta * self.prior.grad(z)
        return b * s + (1.0 - b) * tz


@solvers.register("sam")
@torch.no_grad()
def sam(
    f: Callable[[Tensor], Tensor],
    z0: Tensor,
    *,
    max_iter: int = 200,
    tol: float = 1e-4,
    stop_mode: str = "rel",
    **options,
) -> tuple[Tensor, SolverStats]:
    """SAM iteration selecting argmin R over Fix(f) (papers/003 Eq. 11, Theorem 5).

    Args:
        f: the map T, batched (B, ...) -> (B, ...).
        z0: initial iterate.
        max_iter: maximum number of T-evaluations.
        tol: stop when the batch max canonical residual of T is below ``tol`` (after
            ``min_iter`` steps); 0 runs ``max_iter`` steps.
        stop_mode: "rel" or "abs".
        prior: the regulariser R (name or dict, e.g. ``{name: l1, weight: 1}``); default "l2".
        rho, c: beta_k = lambda_k = rho / k^c (defaults 0.5, 0.2: rho + 2c = 0.9 < 1, as Theorem 5 wants).
        eta: step of S (default 1 / (2 L) with L the prior's gradient Lipschitz constant, 0.5
            when unknown).
        lam_scale: lambda_k = lam_scale * beta_k (default 1, as in Theorem 5).
        prior_step: "auto" (prox when closed form), "grad" (the paper's S) or "prox".
        min_iter: do not stop on the residual before this many steps.
        polish: make the last ``polish`` of the ``max_iter`` steps plain iterations z = T(z)
            (beta = 0). SAM's distance to Fix(T) decays only like beta_k; a few plain steps from
            a SAM iterate whose selection has converged land on Fix(T) near the selected point
            (T nonexpansive: they never move away from it).
        returns: "last" (default: the selection needs the last iterate) or "lowest".
        check_every, protect_thres: as for the other solvers.

    Returns:
        (z, SolverStats); the residual reported is that of T at the returned iterate.

    Example:
        >>> import torch
        >>> P = torch.tensor([[1.0, 0.0], [0.0, 0.0]])      # Fix(T) = {(a, 1)}: a free
        >>> T = lambda z: z @ P + torch.tensor([0.0, 1.0])
        >>> z, st = sam(T, torch.tensor([[3.0, 0.0]]), max_iter=3000, tol=0, prior="l2", polish=5)
        >>> [round(v, 4) for v in z[0].tolist()]             # the minimum-norm fixed point
        [0.0, 1.0]
    """
    check_options("sam", options, OPTIONS)
    check_budget("sam", max_iter, tol, stop_mode)
    options = dict(options)
    options.setdefault("returns", "last")
    common = CommonOptions.parse("sam", options)
    sch = _Schedule(options)

    tracker = Tracker("sam", z0, max_iter=max_iter, tol=tol, stop_mode=stop_mode, common=common)
    z = z0
    nstep = 0
    while True:
        tz = f(z)
        nstep += 1
        if nstep == 1:
            check_output("sam", z, tz)
        tracker.record(z, tz, tz - z)
        stop = tracker.stop()
        if tracker.status == "diverged" or nstep >= max_iter:
            break
        if stop and nstep >= sch.min_iter:
            break
        z = tz if nstep > max_iter - 1 - sch.polish else sch.step(z, tz, nstep)
    return tracker.finish(
        nstep,
        {
            "prior": sch.prior.name,
            "rho": sch.rho,
            "c": sch.c,
            "eta": sch.eta,
            "beta_last": sch.beta(max(nstep - 1, 1)),
        },
    )


def unroll(
    f: Callable[[Tensor], Tensor], z0: Tensor, k: int, **options
) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """k differentiable SAM steps from z0 (papers/003 Eq. 12): returns z_k and the canonical
    (abs, rel) residuals of T at z_0 ... z_{k-1} (one (B,) tensor per step, detached)."""
    opts = {key: v for key, v in options.items() if key not in COMMON_OPTIONS}
    check_options("sam", opts, OPTIONS)
    sch = _Schedule(opts)
    z = z0
    abs_tr: list[Tensor] = []
    rel_tr: list[Tensor] = []
    for step in range(1, int(k) + 1):
        tz = f(z)
        a, r = residuals(tz.detach(), z.detach())
        abs_tr.append(a)
        rel_tr.append(r)
        z = tz if step > int(k) - sch.polish else sch.step(z, tz, step)
    return z, abs_tr, rel_tr


sam.unroll = unroll  # type: ignore[attr-defined]
