"""The reversible fixed-point iteration of RevDEQ (McCallum, Arora, Foster 2025; BACKWARD_LAB.md
section 1): a coupled pair (y, z), y_0 = z_0, and per step two f-evaluations

    y+ = (1 - beta) y + beta f(z),        z+ = (1 - beta) z + beta f(y+),

with the *new* y in the second half-step. Each half-step is an affine map of one state plus f of
the other, so with beta != 1 it can be undone exactly: z = (z+ - beta f(y+)) / (1 - beta), then
y = (y+ - beta f(z)) / (1 - beta). The ``reversible`` backward mode
(:mod:`deqbench.backward.reversible`) runs this solver with ``keep_state`` and backpropagates by
running the iteration backwards, so its gradient is exact for the N steps taken with memory
independent of N. Used on its own it is a plain (relaxed, alternating) fixed-point solver whose
fixed point is y = z = z*.

Implementation notes:

* f(z+), needed for the residual test of z+, is carried into the next step as f(z): N steps cost
  2N + 1 f-evaluations, so ``max_iter`` (f-evaluations) allows N = (max_iter - 1) // 2 steps.
* ``state_dtype="float64"`` (default) keeps y and z and the affine updates in float64 while f runs
  in z0's dtype (its input cast down, its output cast up), as the reference implementation
  does: every reversed half-step divides by |1 - beta| and amplifies round-off, which float64
  absorbs and float32 does not.
* ``per_sample`` (default): a sample whose residual is below ``tol`` is frozen (its y, z, f(z)
  no longer change), so each sample runs its own number of steps N_b (``extra["steps"]``) and
  the result does not depend on the rest of the batch; off, every sample runs the batch's
  steps until the batch max is below ``tol``.
* The iterate returned is the last one (``returns="last"`` by default and always with
  ``keep_state``): the reversal starts from it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from pydantic import Field, field_validator
from torch import Tensor

from ..core.registry import solvers
from .base import CommonOptions, SolverStats, Tracker, check_output, residuals, solver


class ReversibleOptions(CommonOptions):
    returns: Literal["lowest", "last"] = Field(
        "last",
        description="'last' (default): z_N, the iterate the reversal starts from; 'lowest': the "
        "lowest-residual iterate per sample (not with keep_state).",
    )
    beta: float = Field(
        0.8,
        gt=0,
        lt=2,
        description="relaxation beta in (0, 2), not 1 (the reversal divides by 1 - beta; keep "
        "it away from 1: round-off grows like 1 / |1 - beta| per reversed half-step).",
    )
    state_dtype: Literal["float64", "input"] = Field(
        "float64",
        description="dtype of the states y, z and of the affine updates: 'float64' (f still "
        "runs in z0's dtype) or 'input' (z0's dtype).",
    )
    per_sample: bool = Field(
        True,
        description="freeze each sample once its residual is below tol (per-sample step "
        "counts); false: one batch-wide step count.",
    )
    keep_state: bool = Field(
        False,
        description="return the float64 states for the reversible backward: "
        "extra['state'] = (z_N, y_N, steps per sample), in the state dtype.",
    )

    @field_validator("beta")
    @classmethod
    def _not_one(cls, v: float) -> float:
        if v == 1.0:
            raise ValueError("beta = 1 cannot be reversed (the reversal divides by 1 - beta)")
        return v


def state_dtype(opts: ReversibleOptions, dtype: torch.dtype) -> torch.dtype:
    """The dtype of the states for an f running in ``dtype``."""
    if opts.state_dtype == "float64" and dtype in (torch.float32, torch.float16, torch.bfloat16):
        return torch.float64
    return dtype


@solvers.register("reversible")
@solver(ReversibleOptions)
def reversible(
    f: Callable[[Tensor], Tensor],
    z0: Tensor,
    opts: ReversibleOptions,
    *,
    max_iter: int = 50,
    tol: float = 1e-4,
    stop_mode: str = "rel",
) -> tuple[Tensor, SolverStats]:
    """RevDEQ's reversible iteration (``beta`` relaxation, coupled states y, z).

    ``max_iter`` counts f-evaluations: N steps cost 2N + 1. ``extra["steps"]`` has the steps
    each sample took (per_sample) and ``extra["state"]``, with ``keep_state``, the float64
    (``state_dtype``) states (z_N, y_N, steps) the reversible backward mode reverses. Options:
    :class:`ReversibleOptions`.

    Example:
        >>> A = torch.tensor([[0.5, 0.3], [0.0, 0.4]], dtype=torch.float64)
        >>> z, st = reversible(lambda z: z @ A.T + 1, torch.zeros(1, 2, dtype=torch.float64),
        ...                    max_iter=200, tol=1e-10)
        >>> steps = st.extra["steps"]  # per sample
        >>> st.status, int(steps[0]) * 2 + 1 == st.nstep
        ('converged', True)
    """
    b = float(opts.beta)
    wd = z0.dtype
    sd = state_dtype(opts, wd)
    common = opts if not opts.keep_state else opts.model_copy(update={"returns": "last"})

    def F(v: Tensor) -> Tensor:
        out = f(v if sd == wd else v.to(wd))
        return out if out.dtype == sd else out.to(sd)

    z = z0.to(sd)
    y = z
    fz = F(z)
    check_output("reversible", z, fz)
    nstep = 1
    tracker = Tracker(
        "reversible", z, max_iter=max_iter, tol=tol, stop_mode=stop_mode, common=common
    )
    tracker.record(z, fz, None)
    bsz = int(z.shape[0])
    bshape = (bsz,) + (1,) * (z.dim() - 1)
    steps = torch.zeros(bsz, dtype=torch.long, device=z.device)
    sel = 1 if stop_mode == "rel" else 0
    active = ~(residuals(fz, z)[sel] < tol) if opts.per_sample else None
    while not tracker.stop() and nstep + 2 <= max_iter:
        yn = (1 - b) * y + b * fz
        fy = F(yn)
        zn = (1 - b) * z + b * fy
        fzn = F(zn)
        nstep += 2
        if active is None:
            y, z, fz = yn, zn, fzn
            steps += 1
        else:
            m = active.view(bshape)
            y, z, fz = torch.where(m, yn, y), torch.where(m, zn, z), torch.where(m, fzn, fz)
            steps += active
        tracker.record(z, fz, None)
        if active is not None:
            active = active & ~(residuals(fz, z)[sel] < tol)
    extra: dict = {"beta": b, "steps": steps, "state_dtype": str(sd).replace("torch.", "")}
    if opts.keep_state:
        extra["state"] = (z, y, steps)
    zr, stats = tracker.finish(nstep, extra)
    return (zr if zr.dtype == wd else zr.to(wd)), stats
