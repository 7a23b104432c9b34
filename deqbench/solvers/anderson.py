"""Type-II Anderson acceleration with a residual-scaled regulariser.

Per sample, ring buffers hold the last m evaluations F_i = f(x_i) and residuals G_i = F_i - x_i
(x_i = F_i - G_i need not be stored). A step solves

    min_alpha ||sum_i alpha_i G_i||^2 + lam_eff ||alpha||^2   subject to  sum_i alpha_i = 1,

i.e. alpha = w / sum(w) with (G G^T + lam_eff I) w = 1, and moves to

    x_new = beta sum_i alpha_i F_i + (1 - beta) sum_i alpha_i x_i
          = sum_i alpha_i F_i - (1 - beta) sum_i alpha_i G_i.

``lam`` is relative: lam_eff = lam * max_i ||G_i||^2 per sample (+ ``lam_abs``). An absolute
lambda such as TorchDEQ's 1e-4 swamps G G^T once ||g||^2 falls below it, alpha tends to uniform
weights and Anderson degenerates into averaging the last iterates (REFERENCE.md 2.2).

The first step (one residual) is a plain fixed-point step x_1 = f(x_0). G G^T is one batched
matrix product over the buffer, the m x m systems are solved in batch on the device in float64
with ``torch.linalg.solve_ex`` (no host sync), and a sample whose solve failed or produced a
non-finite weight takes a plain step x = f(x_latest) instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..registry import solvers
from .base import (
    COMMON_OPTIONS,
    CommonOptions,
    SolverStats,
    Tracker,
    check_budget,
    check_options,
    flat,
    option_error,
)

OPTIONS = COMMON_OPTIONS | {"m", "beta", "lam", "lam_abs"}


@solvers.register("anderson")
@torch.no_grad()
def anderson(
    f: Callable[[Tensor], Tensor],
    z0: Tensor,
    *,
    max_iter: int = 50,
    tol: float = 1e-4,
    stop_mode: str = "rel",
    **options,
) -> tuple[Tensor, SolverStats]:
    """Anderson acceleration (type II) of the fixed-point iteration z = f(z).

    Args:
        f: batched map (B, ...) -> (B, ...).
        z0: initial iterate (the first measured iterate; returned if nothing beats it).
        max_iter: maximum number of f-evaluations.
        tol: stop when the batch max residual (``stop_mode``) of the returned iterates is below
            ``tol``.
        stop_mode: "rel" or "abs".
        m: history size (default 6).
        beta: mixing, 1 (default) uses the mixed images only.
        lam: regulariser relative to the residual scale, lam_eff = lam * max_i ||G_i||^2 per
            sample (default 1e-8).
        lam_abs: absolute regulariser added to lam_eff (default 0; TorchDEQ's ``lam`` is
            ``lam=0, lam_abs=1e-4``).
        returns, check_every, protect_thres: as for ``fixed_point``.

    Returns:
        (z, SolverStats); ``extra["fallbacks"]`` counts per-sample plain steps taken because a
        least-squares solve failed.

    Example:
        >>> import torch
        >>> A = torch.tensor([[0.5, 0.3], [0.0, 0.4]], dtype=torch.float64)
        >>> z, st = anderson(lambda z: z @ A.T + 1, torch.zeros(1, 2, dtype=torch.float64),
        ...                  max_iter=20, tol=1e-10)
        >>> st.status, st.nstep <= 5
        ('converged', True)
    """
    check_options("anderson", options, OPTIONS)
    check_budget("anderson", max_iter, tol, stop_mode)
    common = CommonOptions.parse("anderson", options)
    m = options.get("m", 6)
    if isinstance(m, bool) or int(m) != m or m < 1:
        raise option_error("anderson", f"m must be a positive integer, got {m!r}")
    m = int(m)
    beta = float(options.get("beta", 1.0))
    if not 0 < beta <= 2:
        raise option_error("anderson", f"beta must be in (0, 2], got {beta}")
    lam = float(options.get("lam", 1e-8))
    lam_abs = float(options.get("lam_abs", 0.0))
    if not (lam >= 0 and lam_abs >= 0):
        raise option_error("anderson", f"lam and lam_abs must be >= 0, got {lam}, {lam_abs}")

    tracker = Tracker(
        "anderson", z0, max_iter=max_iter, tol=tol, stop_mode=stop_mode, common=common
    )
    shape = z0.shape
    bsz = int(shape[0])
    x = z0
    xf = flat(z0)
    dim = xf.shape[1]
    m = min(m, max_iter)
    dev, dt = z0.device, z0.dtype
    Fb = torch.empty(bsz, m, dim, dtype=dt, device=dev)
    Gb = torch.empty(bsz, m, dim, dtype=dt, device=dev)
    # float64 for the tiny systems: G G^T in float32 is only good to ~1e-7 relative, and the
    # relative lambda sits below that.
    sdt = torch.float64 if dt in (torch.float32, torch.float16, torch.bfloat16) else dt
    ones = torch.ones(bsz, m, 1, dtype=sdt, device=dev)
    eye_ids = torch.arange(m, device=dev)
    fallbacks = torch.zeros(bsz, dtype=torch.int64, device=dev)
    nstep = 0
    while True:
        fx = f(x)
        nstep += 1
        slot = (nstep - 1) % m
        n = min(nstep, m)
        Fs, Gs = Fb[:, slot], Gb[:, slot]
        Fs.copy_(flat(fx))
        torch.sub(Fs, xf, out=Gs)
        tracker.record(x, fx, Gs)
        if tracker.stop() or nstep >= max_iter:
            break
        if n == 1:
            # plain step; f's output is not modified anywhere, so no copy is needed
            x = fx
            xf = flat(x)
            continue
        Gn, Fn = Gb[:, :n], Fb[:, :n]
        H = torch.bmm(Gn, Gn.transpose(1, 2)).to(sdt)  # (B, n, n)
        diag = H.diagonal(dim1=1, dim2=2)
        reg = diag.amax(dim=1, keepdim=True)
        reg = reg * lam + lam_abs if lam_abs else reg * lam
        diag.add_(reg)
        w, info = torch.linalg.solve_ex(H, ones[:, :n])  # (B, n, 1)
        alpha = w / w.sum(dim=1, keepdim=True)
        # singular or non-finite solve -> plain step from the newest evaluation
        bad = (info != 0) | ~torch.isfinite(alpha.sum(dim=(1, 2)))
        fallbacks += bad
        onehot = (eye_ids[:n] == slot).to(sdt).view(1, n, 1)
        alpha = torch.where(bad.view(bsz, 1, 1), onehot, alpha).to(dt).transpose(1, 2)
        if beta == 1.0:
            xn = torch.bmm(alpha, Fn)  # (B, 1, D), a fresh tensor
        else:
            xn = torch.baddbmm(torch.bmm(alpha, Fn), alpha, Gn, alpha=-(1.0 - beta))
        xf = xn.view(bsz, dim)
        x = xn.view(shape)
    return tracker.finish(nstep, {"m": m, "lam": lam, "lam_abs": lam_abs, "fallbacks": fallbacks})
