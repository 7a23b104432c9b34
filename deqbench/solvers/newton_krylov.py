"""Jacobian-free Newton-Krylov (JFNK) root finding on g(z) = f(z) - z.

Newton's step s solves (J - I) s = -g(z), J = df/dz at z, inexactly: restarted GMRES(m) stops
once ||g + (J - I) s|| <= eta ||g|| (the forcing term eta). Only products J v are needed:

* ``jvp="forward"``: forward-mode AD, ``torch.func.jvp(f, (z,), (v,))`` (one JVP each);
* ``jvp="fd"``: a forward difference (f(z + h v) - f(z)) / h with
  h = sqrt(eps) (1 + ||z||) / ||v|| per sample (one f-evaluation each);
* ``jvp="affine"``: f is affine (f(z) = A z + c), so A v = f(v) - c exactly; c = f(0) costs one
  f-evaluation, or is read from the map (the IFT adjoint map ``w -> J^T w + g`` of
  :class:`deqbench.core.backward.AdjointMap` exposes ``g``, the tangent map ``v -> J v + c`` of a
  double backward, ``TangentMap``, exposes ``c``): the adjoint system is linear, so GMRES
  solves it directly with the adjoint's own products (VJPs), each one call of the map;
* ``jvp="auto"`` (default): "affine" for those two maps, else "forward", falling back to "fd"
  when f does not support forward-mode AD (the reason is in ``extra["jvp_fallback"]``).

Forcing (Eisenstat and Walker 1996, choice 2): eta_0 = ``eta0``,
eta_k = gamma (||g_k|| / ||g_{k-1}||)^alpha, kept >= gamma eta_{k-1}^alpha when that exceeds
0.1, capped at ``eta_max``, and never below 0.5 tau / ||g_k|| (tau the absolute residual the
stop rule asks for, so the last step is not over-solved). For an affine map eta_k is
0.5 tau / ||g_k|| directly (one linear solve). ``forcing`` = a number keeps eta constant.

Globalisation: backtracking on ||g|| (Eisenstat-Walker's inexact-Newton condition)
||g(z + lam s)|| <= (1 - c1 lam (1 - rho)) ||g(z)||, rho = the inner residual ratio GMRES
reached, lam halved or set by a safeguarded quadratic model of ||g||^2, within [0.1, 0.5] of
the previous lam. A sample whose line search fails takes its best trial if that lowered ||g||,
and otherwise stalls (it is frozen, and the solve ends ``stagnated`` once every unconverged
sample stalled); a map with no root thus ends with a non-converged status, never a hang.

Per-sample convergence: each sample has its own Newton iteration, forcing term, GMRES
residual and step length; samples already below ``tol`` (``stop_mode`` residual) take no steps.
f is still evaluated on the whole batch (it may couple samples through its closure).

Counting and budget: ``nstep`` counts f-evaluations (line-search trials, finite-difference and
affine products included: each is a call of f); ``SolverStats.njvp`` counts forward-mode JVPs.
``max_iter`` bounds nstep + njvp (a JVP costs about one to two f-evaluations), unless
``max_jvp`` is given, which then bounds the JVPs and leaves ``max_iter`` to the f-evaluations.
One f-evaluation is measured per Newton step (the accepted trial), so the traces have one row
per Newton step plus the initial one. GMRES reads its small Hessenberg column on the host once
per product (one synchronisation per product on CUDA).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Annotated, Any, Literal

import numpy as np
import torch
from annotated_types import Gt, Lt
from pydantic import Field
from torch import Tensor

from ..core.registry import solvers
from .base import (
    EPS,
    CommonOptions,
    SolverStats,
    Tracker,
    check_output,
    option_error,
    solver,
)


class NewtonKrylovOptions(CommonOptions):
    """``check_every`` is accepted; the host reads every step anyway (GMRES syncs)."""

    jvp: Literal["auto", "forward", "fd", "affine"] = Field(
        "auto", description="how products J v are made; see the module docstring."
    )
    restart: int = Field(20, gt=0, description="GMRES restart length m.")
    max_restarts: int = Field(
        2, ge=0, description="GMRES restarts per Newton step (2: at most 3 cycles)."
    )
    forcing: Literal["ew"] | Annotated[float, Gt(0), Lt(1)] = Field(
        "ew", description="'ew' (Eisenstat-Walker choice 2) or a constant eta."
    )
    eta0: float = Field(0.5, gt=0, le=1, description="Eisenstat-Walker: the first forcing term.")
    eta_max: float = Field(0.9, gt=0, le=1, description="Eisenstat-Walker: cap of eta.")
    ew_gamma: float = Field(0.9, gt=0, le=1, description="Eisenstat-Walker gamma.")
    ew_alpha: float = Field(2.0, ge=1, le=2, description="Eisenstat-Walker alpha.")
    line_search: bool = Field(True, description="backtracking on ||g||; off: full Newton steps.")
    ls_max_trials: int = Field(
        8, gt=0, description="trials per Newton step, each one f-evaluation."
    )
    ls_c1: float = Field(1e-4, ge=0, lt=1, description="sufficient-decrease constant.")
    max_jvp: Annotated[int, Gt(0)] | None = Field(
        None, description="separate cap on JVPs (None: max_iter bounds f-evals + JVPs)."
    )
    fd_eps: Annotated[float, Gt(0)] | None = Field(
        None,
        description="relative step of the finite-difference product (None: sqrt(machine eps) "
        "of z0's dtype).",
    )


JVP_MODES = ("auto", "forward", "fd", "affine")


class _Budget:
    """f-evaluations and JVPs made, and what is left of the budget."""

    def __init__(self, max_iter: int, max_jvp: int | None) -> None:
        self.max_iter, self.max_jvp = max_iter, max_jvp
        self.nf = 0
        self.njvp = 0

    def can(self, f_evals: int = 0, jvps: int = 0) -> bool:
        """Whether ``f_evals`` more f-evaluations and ``jvps`` more JVPs fit."""
        if self.max_jvp is None:
            return self.nf + self.njvp + f_evals + jvps <= self.max_iter
        return self.nf + f_evals <= self.max_iter and self.njvp + jvps <= self.max_jvp


class _Operator:
    """v -> (J - I) v at the current iterate z, for the chosen product.

    Mode "auto" tries forward-mode AD on the first product and falls back to finite
    differences for good if f does not support it (``fallback`` holds the reason).
    """

    def __init__(self, f, shape, mode: str, budget: _Budget, fd_eps: float, const) -> None:
        self.f, self.shape, self.mode, self.budget = f, shape, mode, budget
        self.fd_eps = fd_eps
        self.const = const  # affine: f(0) (B, D)
        self.z: Tensor | None = None  # (B, D)
        self.fz: Tensor | None = None
        self.fallback: str | None = None

    def cost(self) -> tuple[int, int]:
        """(f-evaluations, JVPs) one product costs (at most)."""
        return (0, 1) if self.mode in ("forward", "auto") else (1, 0)

    def at(self, z: Tensor, fz: Tensor) -> None:
        self.z, self.fz = z, fz

    def _jvp(self, z: Tensor, v: Tensor) -> Tensor:
        with warnings.catch_warnings():  # torch.func's first use warns about torch.jit.script
            warnings.filterwarnings(
                "ignore", message=".*torch.jit.script.*", category=FutureWarning
            )
            return torch.func.jvp(self.f, (z.view(self.shape),), (v.view(self.shape),))[1]

    def __call__(self, v: Tensor) -> Tensor:
        B = v.shape[0]
        z, fz = self.z, self.fz
        assert z is not None and fz is not None
        if self.mode == "auto":
            try:
                jv = self._jvp(z, v)
                self.mode = "forward"
            except (RuntimeError, NotImplementedError, TypeError) as exc:
                self.fallback = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
                self.mode = "fd"
            else:
                self.budget.njvp += 1
                return jv.reshape(B, -1) - v
        if self.mode == "forward":
            self.budget.njvp += 1
            jv = self._jvp(z, v).reshape(B, -1)
        elif self.mode == "affine":
            self.budget.nf += 1
            jv = self.f(v.view(self.shape)).reshape(B, -1) - self.const
        else:  # forward difference, per-sample step
            self.budget.nf += 1
            vn = torch.linalg.vector_norm(v, dim=1)
            zn = torch.linalg.vector_norm(z, dim=1)
            h = self.fd_eps * (1.0 + zn) / torch.where(vn > 0, vn, 1.0)
            jv = (self.f((z + h[:, None] * v).view(self.shape)).reshape(B, -1) - fz) / h[:, None]
        return jv - v


def _gmres(
    op: _Operator,
    b: Tensor,
    active: np.ndarray,
    target: np.ndarray,
    m: int,
    cycles: int,
    reserve: tuple[int, int],
) -> tuple[Tensor, np.ndarray, int, int]:
    """Restarted GMRES(m) from x = 0 for A x = b (A = ``op``), batched, per sample.

    Sample i iterates while ``active[i]`` and its residual exceeds ``target[i]``. Arnoldi uses
    classical Gram-Schmidt twice (two batched products per pass); the Hessenberg columns go to
    the host (float64), where Givens rotations give each sample's residual norm after every
    product. ``reserve`` (f-evals, JVPs) is kept free of the budget for the caller.

    Returns (x, residual norm per sample (host), products made, cycles run).
    """
    B, D = b.shape
    dev, dt = b.device, b.dtype
    budget = op.budget
    fc, jc = op.cost()
    x = torch.zeros_like(b)
    bnorm = torch.linalg.vector_norm(b, dim=1).double().cpu().numpy()
    rnorm = bnorm.copy()
    r = b
    products = ran = 0
    for cycle in range(cycles):
        if cycle > 0:
            if not budget.can(fc + reserve[0], jc + reserve[1]):
                break
            r = b - op(x)
            products += 1
            rnorm = torch.linalg.vector_norm(r, dim=1).double().cpu().numpy()
        need = active & (rnorm > target)
        if not need.any():
            break
        ran += 1
        V = torch.zeros(B, m + 1, D, dtype=dt, device=dev)
        scale = np.where(need & (rnorm > 0), 1.0 / np.where(rnorm > 0, rnorm, 1.0), 0.0)
        V[:, 0] = r * torch.as_tensor(scale, dtype=dt, device=dev)[:, None]
        H = np.zeros((B, m + 1, m))
        cs, sn = np.zeros((B, m)), np.zeros((B, m))
        s = np.zeros((B, m + 1))
        s[:, 0] = np.where(need, rnorm, 0.0)
        k = np.zeros(B, dtype=np.int64)  # columns each sample uses
        running = need.copy()
        for j in range(m):
            if not budget.can(fc + reserve[0], jc + reserve[1]):
                break
            w = op(V[:, j])
            products += 1
            Vj = V[:, : j + 1]
            w0 = torch.linalg.vector_norm(w, dim=1)
            h = torch.bmm(Vj, w.unsqueeze(2)).squeeze(2)  # CGS2: two passes
            w = w - torch.bmm(h.unsqueeze(1), Vj).squeeze(1)
            h2 = torch.bmm(Vj, w.unsqueeze(2)).squeeze(2)
            w = w - torch.bmm(h2.unsqueeze(1), Vj).squeeze(1)
            hn = torch.linalg.vector_norm(w, dim=1)
            # lucky breakdown: the new direction is lost in rounding (exact solution reached)
            alive = hn > 100 * torch.finfo(dt).eps * w0
            V[:, j + 1] = torch.where(alive[:, None], w / torch.where(alive, hn, 1.0)[:, None], 0)
            hcol = torch.cat([(h + h2), torch.where(alive, hn, 0.0)[:, None]], 1)
            col = hcol.double().cpu().numpy()  # one host read per product
            col[~running] = 0.0
            for i in range(j):  # previous rotations, vectorised over the batch
                a, c = col[:, i].copy(), col[:, i + 1].copy()
                col[:, i] = cs[:, i] * a + sn[:, i] * c
                col[:, i + 1] = -sn[:, i] * a + cs[:, i] * c
            a, c = col[:, j], col[:, j + 1]
            rr = np.hypot(a, c)
            ok = rr > 0
            cs[:, j] = np.where(ok, a / np.where(ok, rr, 1.0), 1.0)
            sn[:, j] = np.where(ok, c / np.where(ok, rr, 1.0), 0.0)
            col[:, j], col[:, j + 1] = rr, 0.0
            H[:, : j + 2, j] = col[:, : j + 2]
            sj = s[:, j].copy()
            s[:, j + 1] = np.where(running, -sn[:, j] * sj, s[:, j + 1])
            s[:, j] = np.where(running, cs[:, j] * sj, sj)
            k = np.where(running, j + 1, k)
            rnorm = np.where(running, np.abs(s[:, j + 1]), rnorm)
            running &= (rnorm > target) & alive.cpu().numpy()
            if not running.any():
                break
        # y = R^-1 s per sample over its k columns (R upper triangular), zero beyond k: one
        # batched solve with R padded by the identity; a sample whose R is singular (an
        # operator singular on the Krylov space) takes least squares instead
        cols = np.arange(m)
        used = cols[None, :] < k[:, None]  # (B, m)
        R = np.where(used[:, :, None] & used[:, None, :], H[:, :m, :m], 0.0)
        R[:, cols, cols] = np.where(used, R[:, cols, cols], 1.0)
        rhs = np.where(used, s[:, :m], 0.0)
        d = np.abs(R[:, cols, cols])
        singular = (d <= 1e-14 * np.maximum(d.max(1, keepdims=True), 1e-300)).any(1)
        Y = np.zeros((B, m))
        ok = ~singular
        if ok.any():
            Y[ok] = np.linalg.solve(R[ok], rhs[ok][:, :, None])[:, :, 0]
        for i in np.nonzero(singular & (k > 0))[0].tolist():
            ki = int(k[i])
            Y[i, :ki] = np.linalg.lstsq(H[i, :ki, :ki], s[i, :ki], rcond=None)[0]
        if (k > 0).any():
            Yt = torch.as_tensor(Y, dtype=dt, device=dev)
            x = x + torch.bmm(Yt.unsqueeze(1), V[:, :m]).squeeze(1)
    return x, rnorm, products, ran


def _known_constant(f: Any, shape: torch.Size) -> Tensor | None:
    """The constant c of a map known to be affine, f(v) = A v + c: the IFT adjoint map
    (``AdjointMap.g``) and the tangent map of a double backward (``TangentMap.c``)."""
    from ..core import backward

    for cls, attr in (("AdjointMap", "g"), ("TangentMap", "c")):
        kind = getattr(backward, cls, None)
        if kind is not None and isinstance(f, kind):
            c = getattr(f, attr, None)
            if isinstance(c, Tensor) and c.shape == shape:
                return c
    return None


def _host(t: Tensor) -> np.ndarray:
    return t.double().cpu().numpy()


def _product_operator(
    f: Callable[[Tensor], Tensor], z0: Tensor, mode: str, budget: _Budget, fd_eps: float
) -> _Operator:
    """The product (J - I) v for ``mode``: ``auto`` becomes ``affine`` where the map's constant
    is known; ``affine`` evaluates f(0) for it when not (``op.const`` stays None when the
    budget has no room for f(0))."""
    shape, B = z0.shape, int(z0.shape[0])
    const = _known_constant(f, shape)
    if mode == "auto" and const is not None:
        mode = "affine"
    if mode == "affine" and const is None and budget.can(1):
        const = f(torch.zeros_like(z0)).reshape(B, -1)
        budget.nf += 1
    if const is not None:
        const = const.reshape(B, -1).to(z0.dtype)
    return _Operator(f, shape, mode, budget, fd_eps, const)


def _forcing_terms(
    opts: NewtonKrylovOptions,
    eta: np.ndarray,
    gn: np.ndarray,
    fn: np.ndarray,
    gn_prev: np.ndarray,
    eta_prev: np.ndarray,
    newton: int,
    affine: bool,
    tol: float,
    stop_mode: str,
    dt: torch.dtype,
) -> np.ndarray:
    """GMRES's relative tolerance per sample for the next Newton step: half the residual the
    stop rule asks for on an affine map, Eisenstat-Walker's choice 2 (safeguarded) with
    ``forcing="ew"``, else the constant ``eta``; never below 10 machine epsilons."""
    eta0, eta_max, gamma, alpha = opts.eta0, opts.eta_max, opts.ew_gamma, opts.ew_alpha
    # absolute residual the stop rule asks for (rel: at the current ||f(z)||)
    tau = tol * (fn + EPS) if stop_mode == "rel" else np.full(gn.shape[0], tol)
    floor = 0.5 * tau / np.maximum(gn, 1e-300)
    if affine:
        eta = np.minimum(eta_max, floor)
    elif opts.forcing == "ew":
        if newton > 0:
            e = gamma * (gn / np.maximum(gn_prev, 1e-300)) ** alpha
            sg = gamma * eta_prev**alpha
            e = np.where(sg > 0.1, np.maximum(e, sg), e)
            eta = np.minimum(eta_max, np.maximum(e, floor))
        else:
            eta = np.minimum(eta_max, np.maximum(eta0, floor))
    return np.maximum(eta, 10 * torch.finfo(dt).eps)


def _line_search(
    f: Callable[[Tensor], Tensor],
    z: Tensor,
    fz: Tensor,
    g: Tensor,
    gn: np.ndarray,
    s: Tensor,
    active: np.ndarray,
    rho: np.ndarray,
    budget: _Budget,
    opts: NewtonKrylovOptions,
    shape: torch.Size,
) -> tuple[Tensor, Tensor, Tensor, np.ndarray, int]:
    """Backtracking on ||g|| along the Newton step ``s``, per sample (Armijo with the inexact
    step's ``rho``; a safeguarded quadratic model picks the next step length). Returns the
    best trial per sample (z, f(z), g, ||g||; the current point where none lowered ||g||) and
    the backtracks made. ``z``, ``fz``, ``g`` and ``s`` are (B, D); f takes ``shape``."""
    line_search, trials, c1 = opts.line_search, opts.ls_max_trials, opts.ls_c1
    B, dt, dev = z.shape[0], z.dtype, z.device
    backtracks = 0
    lam = np.where(active, 1.0, 0.0)
    best_z, best_fz, best_g, best_gn = z, fz, g, gn.copy()
    pending = active.copy()
    for _ in range(trials if line_search else 1):
        lt = torch.as_tensor(lam, dtype=dt, device=dev)[:, None]
        zt = z + lt * s
        ft = f(zt.view(shape)).reshape(B, -1)
        budget.nf += 1
        gt = ft - zt
        gnt = _host(torch.linalg.vector_norm(gt, dim=1))
        better = pending & (gnt < best_gn)  # NaN never better
        if better.any():
            bt = torch.as_tensor(better, device=dev)[:, None]
            best_z = torch.where(bt, zt, best_z)
            best_fz = torch.where(bt, ft, best_fz)
            best_g = torch.where(bt, gt, best_g)
            best_gn = np.where(better, gnt, best_gn)
        accept = pending & (gnt <= (1 - c1 * lam * (1 - rho)) * gn)
        pending &= ~accept
        if not line_search or not pending.any() or not budget.can(1):
            break
        backtracks += 1
        # safeguarded quadratic model of ||g(z + lam s)||^2 with slope -2 ||g||^2
        g2, t2 = gn**2, np.where(np.isfinite(gnt), gnt**2, np.inf)
        with np.errstate(all="ignore"):
            q = g2 * lam**2 / (t2 - g2 + 2 * g2 * lam)
        q = np.where(np.isfinite(q), q, 0.5 * lam)
        lam = np.where(pending, np.clip(q, 0.1 * lam, 0.5 * lam), lam)
    return best_z, best_fz, best_g, best_gn, backtracks


@solvers.register("newton_krylov")
@solver(NewtonKrylovOptions)
def newton_krylov(
    f: Callable[[Tensor], Tensor],
    z0: Tensor,
    opts: NewtonKrylovOptions,
    *,
    max_iter: int = 200,
    tol: float = 1e-4,
    stop_mode: str = "rel",
) -> tuple[Tensor, SolverStats]:
    """Jacobian-free Newton-Krylov on g(z) = f(z) - z (GMRES(m), Eisenstat-Walker, line search).

    ``max_iter`` is the budget of f-evaluations plus JVPs (see ``max_jvp``). Options:
    :class:`NewtonKrylovOptions`.

    Returns:
        (z, SolverStats); ``njvp`` counts JVPs, ``extra`` has ``newton_steps``,
        ``matvecs`` (GMRES products), ``gmres_cycles``, ``backtracks``, ``jvp_mode``,
        ``stalled`` (per-sample bool) and ``eta`` (last forcing terms).

    Example:
        >>> import torch
        >>> f = lambda z: -2.0 * torch.tanh(z) + 1.0   # plain iteration oscillates here
        >>> z, st = newton_krylov(f, torch.zeros(3, 1, dtype=torch.float64), tol=1e-10)
        >>> st.status, st.nstep < 20
        ('converged', True)
    """
    name = "newton_krylov"
    m, restarts, forcing = opts.restart, opts.max_restarts, opts.forcing
    if not z0.is_floating_point():
        raise option_error(name, f"z0 must be a floating-point tensor, got {z0.dtype}")
    fd_eps = opts.fd_eps if opts.fd_eps is not None else torch.finfo(z0.dtype).eps ** 0.5

    tracker = Tracker(name, z0, max_iter=max_iter, tol=tol, stop_mode=stop_mode, common=opts)
    shape, B = z0.shape, int(z0.shape[0])
    dt, dev = z0.dtype, z0.device
    budget = _Budget(max_iter, opts.max_jvp)
    extra: dict[str, Any] = {}

    z = z0.reshape(B, -1)
    fz = f(z0)
    budget.nf += 1
    check_output(name, z0, fz)
    fz = fz.reshape(B, -1)
    g = fz - z
    tracker.record(z.view(shape), fz.view(shape), g.view(shape))
    done = False

    op = _product_operator(f, z0, opts.jvp, budget, fd_eps)
    affine = op.mode == "affine"
    if affine and op.const is None:
        done = True  # no budget left for f(0)

    gn = _host(torch.linalg.vector_norm(g, dim=1))
    fn = _host(torch.linalg.vector_norm(fz, dim=1))
    eta = np.full(B, forcing if forcing != "ew" else opts.eta0)
    eta_prev = eta.copy()
    gn_prev = gn.copy()
    stalled = np.zeros(B, dtype=bool)
    newton = cycles_run = products = backtracks = 0
    done = done or tracker.stop() or not budget.can(1)
    while not done:
        res = gn / (fn + EPS) if stop_mode == "rel" else gn
        active = ~(res < tol) & ~stalled & np.isfinite(gn)
        if not active.any():
            if (stalled & ~(res < tol)).any():
                tracker.status = "stagnated"
            break
        eta = _forcing_terms(
            opts, eta, gn, fn, gn_prev, eta_prev, newton, affine, tol, stop_mode, dt
        )
        # Newton step: (J - I) s = -g, inexactly
        op.at(z, fz)
        s, rho_abs, nprod, ncyc = _gmres(
            op, -g, active, eta * gn, m, int(restarts) + 1, reserve=(1, 0)
        )
        products += nprod
        cycles_run += ncyc
        if nprod == 0 or not budget.can(1):
            break  # the budget is spent
        newton += 1
        rho = np.clip(rho_abs / np.maximum(gn, 1e-300), 0.0, 1.0)
        best_z, best_fz, best_g, best_gn, nback = _line_search(
            f, z, fz, g, gn, s, active, rho, budget, opts, shape
        )
        backtracks += nback
        # a failed line search keeps the best trial if it lowered ||g||; otherwise the sample
        # stalls (frozen)
        moved = active & (best_gn < gn)
        stalled |= active & ~moved
        gn_prev, eta_prev = gn, eta
        z, fz, g, gn = best_z, best_fz, best_g, best_gn
        fn = _host(torch.linalg.vector_norm(fz, dim=1))
        tracker.record(z.view(shape), fz.view(shape), g.view(shape))
        if tracker.stop() or not budget.can(1):
            break
    if op.fallback is not None:
        extra["jvp_fallback"] = op.fallback
    extra.update(
        {
            "jvp_mode": op.mode,
            "newton_steps": newton,
            "matvecs": products,
            "gmres_cycles": cycles_run,
            "backtracks": backtracks,
            "stalled": torch.as_tensor(stalled, device=dev),
            "eta": torch.as_tensor(eta, device=dev),
            "f_evals": budget.nf,
        }
    )
    zr, stats = tracker.finish(budget.nf, extra)
    stats.njvp = budget.njvp
    return zr, stats
