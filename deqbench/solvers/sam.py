"""Sequential averaging (SAM) with a feature prior: OptEq's R-dagger (Xie et al. 2023 section 5.2).

    z_k = beta_k S_k(z_{k-1}) + (1 - beta_k) T(z_{k-1}),    beta_k = lambda_k = rho / k^c,
    S_k(z) = (1 - eta lambda_k) z - eta grad R(z)           (prior_step "grad"),
    S_k(z) = prox_{eta R}((1 - eta lambda_k) z)             (prior_step "prox"),

with T the cell map and R the prior (:mod:`deqbench.solvers.regularizers`). As beta_k -> 0 the iterates
approach argmin R over Fix(T) (Xie et al. 2023 Theorem 5: eta = 1 / (2 L), rho + 2c < 1, T
nonexpansive, e.g. an OptEq layer with ||W|| <= 1). When Fix(T) is a single point SAM converges
to it, more slowly than plain iteration; when it is not, plain iteration stops at a point that
depends on z0 while SAM selects the prior's minimiser.

Stopping: the canonical residual ||T(z) - z|| / ||T(z)|| measures membership in Fix(T), not the
selection, so by default SAM returns the **last** iterate and ``min_iter`` (default 0) keeps it
from stopping on the residual too early; use ``tol=0`` to run ``max_iter`` steps.

A solver may define ``unroll(f, z0, k, **options) -> (z_k, abs_trace, rel_trace)``: the
differentiable k-step iteration the ``unrolled`` backward mode uses instead of plain iteration
(Xie et al. 2023 Eq. 12: training through the K-th SAM iterate).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from annotated_types import Gt
from pydantic import Field, field_validator, model_validator
from torch import Tensor

from ..core.registry import solvers
from .base import (
    COMMON_OPTIONS,
    CommonOptions,
    SolverStats,
    Tracker,
    check_output,
    parse_options,
    residuals,
    solver,
)


def _prior(spec: Any) -> Any:
    from .regularizers import get_regularizer

    return get_regularizer(spec)


class SamOptions(CommonOptions):
    returns: Literal["lowest", "last"] = Field(
        "last", description="'last' (the selection needs the last iterate) or 'lowest'."
    )
    prior: Any = Field(
        "l2",
        description="the regulariser R: a name (l2, l1, incay, decorrelation, hsic) or a dict "
        "with its name and parameters, e.g. {name: l1, weight: 1}.",
    )
    rho: float = Field(0.5, gt=0, le=1, description="beta_k = lambda_k = rho / k^c.")
    c: float = Field(0.2, gt=0, description="the schedule's exponent (rho + 2c < 1: Theorem 5).")
    eta: Annotated[float, Gt(0)] | None = Field(
        None,
        description="step of S (None: 1 / (2 L) with L the prior's gradient Lipschitz "
        "constant, 0.5 when unknown).",
    )
    lam_scale: float = Field(1.0, description="lambda_k = lam_scale * beta_k.")
    prior_step: Literal["auto", "grad", "prox"] = Field(
        "auto", description="'auto' (prox when closed form), 'grad' (the paper's S) or 'prox'."
    )
    min_iter: int = Field(
        0, ge=0, description="do not stop on the residual before this many steps."
    )
    polish: int = Field(
        0,
        ge=0,
        description="make the last polish of the max_iter steps plain iterations z = T(z) "
        "(beta = 0): they land on Fix(T) near the selected point.",
    )

    @field_validator("prior", mode="plain")
    @classmethod
    def _known_prior(cls, v: Any) -> Any:
        if v is None:
            raise ValueError(
                "SAM needs a prior: a regularizer's name (l2, l1, incay, decorrelation, hsic) "
                "or a dict with its name"
            )
        try:
            _prior(v)
        except Exception as exc:
            raise ValueError(str(exc)) from None
        return v

    @model_validator(mode="after")
    def _prox_exists(self) -> SamOptions:
        if self.prior_step == "prox" and not _prior(self.prior).has_prox:
            raise ValueError(f"prior '{_prior(self.prior).name}' has no closed-form prox")
        return self


class _Schedule:
    """The prior and the beta_k / lambda_k / eta schedule of validated SAM options."""

    def __init__(self, opts: SamOptions) -> None:
        reg = _prior(opts.prior)
        assert reg is not None
        self.prior = reg
        self.rho, self.c = opts.rho, opts.c
        eta = opts.eta
        if eta is None:
            L = self.prior.lipschitz
            eta = 1.0 / (2.0 * L) if L else 0.5
        self.eta = float(eta)
        self.lam_scale = opts.lam_scale
        mode = opts.prior_step
        self.prox = mode == "prox" or (mode == "auto" and self.prior.has_prox)
        self.min_iter, self.polish = opts.min_iter, opts.polish

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


def unroll(
    f: Callable[[Tensor], Tensor], z0: Tensor, k: int, **options
) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """k differentiable SAM steps from z0 (Xie et al. 2023 Eq. 12): returns z_k and the canonical
    (abs, rel) residuals of T at z_0 ... z_{k-1} (one (B,) tensor per step, detached)."""
    opts = {key: v for key, v in options.items() if key not in COMMON_OPTIONS}
    sch = _Schedule(parse_options("sam", SamOptions, opts))
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


@solvers.register("sam")
@solver(SamOptions, unroll=unroll, tags={"rate": "sublinear"})
def sam(
    f: Callable[[Tensor], Tensor],
    z0: Tensor,
    opts: SamOptions,
    *,
    max_iter: int = 200,
    tol: float = 1e-4,
    stop_mode: str = "rel",
) -> tuple[Tensor, SolverStats]:
    """SAM iteration selecting argmin R over Fix(f) (Xie et al. 2023 Eq. 11, Theorem 5).

    f is the map T; ``max_iter`` bounds its evaluations; the solve stops when the batch max
    canonical residual of T is below ``tol`` (after ``min_iter`` steps; ``tol=0`` runs
    ``max_iter`` steps). SAM's distance to Fix(T) decays only like beta_k; a few plain steps
    (``polish``) from a SAM iterate whose selection has converged land on Fix(T) near the
    selected point (T nonexpansive: they never move away from it). Options:
    :class:`SamOptions`.

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
    sch = _Schedule(opts)

    tracker = Tracker("sam", z0, max_iter=max_iter, tol=tol, stop_mode=stop_mode, common=opts)
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
