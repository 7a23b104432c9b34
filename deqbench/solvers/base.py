"""Solver contract: ``solve(f, z0, *, max_iter, tol, stop_mode="rel", **options) -> (z, SolverStats)``.

Conventions (REFERENCE.md section 1):

* batched over dim 0; each sample's state is flattened (all non-batch dims);
* canonical residual per sample: ``abs_i = ||f(z)_i - z_i||``, ``rel_i = abs_i / (||f(z)_i|| + 1e-9)``;
* ``max_iter`` bounds the number of f-evaluations and ``nstep`` counts every f-evaluation made;
* stop when the batch max of the chosen residual (``stop_mode`` rel or abs) of the returned
  iterates is below ``tol``;
* the returned iterate is the lowest-residual iterate *x* whose residual was measured
  (``returns="lowest"``, the default, chosen per sample) or the last measured iterate
  (``returns="last"``); its residual is exactly the reported one (no extra evaluation is made,
  the residual of x was measured with the counted evaluation f(x));
* a non-finite residual or an abs residual blow-up (``protect_thres`` times the first) stops the
  solver with ``status="diverged"``; nothing is raised.

The shared bookkeeping lives in :class:`Tracker`: per-sample traces in a preallocated buffer,
per-sample lowest iterate, and the stop decisions. It never synchronises with the GPU in the hot
loop: each step's batch summaries are copied asynchronously to pinned host memory and read one
step late (the GPU is then busy with the next step), with an exact read only when the residual
trend predicts convergence at the current step, so the f-evaluation count is not inflated.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..errors import ConfigError

EPS = 1e-9
STATUSES = ("converged", "max_iter", "diverged", "stagnated")

#: options every built-in solver accepts
COMMON_OPTIONS = {"returns", "check_every", "protect_thres"}


class SolverOptionError(ConfigError, ValueError):
    """An invalid solver option or option value (a ConfigError that is also a ValueError)."""


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
        lowest_step: index into the traces of the returned iterate (the latest over the batch;
            ``extra["lowest_steps"]`` has it per sample).
        solver, tol, stop_mode: what was asked for.
        extra: solver-specific diagnostics (``returned`` is "x": the iterate, not f(x)).

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
    """(B, ...) -> (B, D) view (a copy only if ``z`` is not viewable)."""
    return z.reshape(z.shape[0], -1)


def residuals(fz: Tensor, z: Tensor) -> tuple[Tensor, Tensor]:
    """Per-sample canonical (abs, rel) residuals of iterate ``z`` with ``fz = f(z)``; shapes (B,)."""
    d = flat(fz - z)
    a = torch.linalg.vector_norm(d, dim=1)
    r = a / (torch.linalg.vector_norm(flat(fz), dim=1) + EPS)
    return a, r


def check_stop_mode(stop_mode: str) -> None:
    if stop_mode not in ("rel", "abs"):
        raise SolverOptionError(f"stop_mode must be 'rel' or 'abs', got {stop_mode!r}")


def check_options(solver: str, options: dict[str, Any], allowed: set[str]) -> None:
    """Reject unknown solver options (TorchDEQ silently accepts typos; we do not)."""
    unknown = set(options) - allowed
    if unknown:
        import difflib

        bad = sorted(unknown)[0]
        close = difflib.get_close_matches(bad, sorted(allowed), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise SolverOptionError(
            f"solver '{solver}': unknown option '{bad}'{hint}; options: {', '.join(sorted(allowed))}"
        )


def option_error(solver: str, msg: str) -> SolverOptionError:
    return SolverOptionError(f"solver '{solver}': {msg}")


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
) -> SolverStats:
    """Assemble SolverStats (one host sync here, at the end of the solve).

    ``abs_tr``/``rel_tr`` are lists of (B,) tensors or (T, B) tensors.
    """
    if isinstance(abs_tr, Tensor):
        abs_trace, rel_trace = abs_tr, rel_tr  # type: ignore[assignment]
    else:
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


@dataclass
class CommonOptions:
    """Options shared by the built-in solvers, validated."""

    returns: str = "lowest"
    check_every: int | None = None
    protect_thres: float = 1e6

    @classmethod
    def parse(cls, solver: str, options: dict[str, Any]) -> CommonOptions:
        returns = options.get("returns", "lowest")
        if returns not in ("lowest", "last"):
            raise option_error(solver, f"returns must be 'lowest' or 'last', got {returns!r}")
        ce = options.get("check_every", None)
        if ce is not None:
            if isinstance(ce, bool) or int(ce) != ce or int(ce) < 1:
                raise option_error(solver, f"check_every must be a positive integer, got {ce!r}")
            ce = int(ce)
        protect = float(options.get("protect_thres", 1e6))
        if not protect > 1:
            raise option_error(solver, f"protect_thres must be > 1, got {protect}")
        return cls(returns=returns, check_every=ce, protect_thres=protect)


def check_budget(solver: str, max_iter: int, tol: float, stop_mode: str) -> None:
    check_stop_mode(stop_mode)
    if isinstance(max_iter, bool) or int(max_iter) != max_iter or max_iter < 1:
        raise option_error(solver, f"max_iter must be a positive integer, got {max_iter!r}")
    if not (tol >= 0):  # also rejects NaN
        raise option_error(solver, f"tol must be >= 0, got {tol!r}")


class Tracker:
    """Residual bookkeeping shared by the solvers.

    Per step the solver calls :meth:`record` with the iterate x, f(x) and f(x) - x (the caller
    often has the difference already), then :meth:`stop`; at the end :meth:`finish` returns the
    chosen iterate and the stats.

    Device work per step: two norms, a handful of (B,)-sized kernels and one 16-byte
    asynchronous copy to pinned memory. The lowest iterate is tracked by reference: a step where
    every sample improved (the usual case) costs no copy of the state; otherwise a masked select
    is made once the host knows it is needed.

    Host reads (``check_every=None``, the default): on CPU every step (free); on CUDA the summary
    of step k-1 is read while step k runs, plus an exact read of step k when the residual trend
    predicts convergence there (``NEAR`` times tol). ``check_every=k`` instead reads exactly every
    k steps and never in between (up to k-1 extra f-evaluations at the end).
    """

    NEAR = 10.0  # exact read when the predicted residual is within this factor of tol
    MAX_PENDING = 2  # unresolved lowest-iterate candidates held before a forced masked select

    def __init__(
        self,
        solver: str,
        z0: Tensor,
        *,
        max_iter: int,
        tol: float,
        stop_mode: str,
        common: CommonOptions,
        stagnation: tuple[int, float, float] | None = None,
    ) -> None:
        self.solver = solver
        self.shape = z0.shape
        self.B = int(z0.shape[0])
        self.tol = float(tol)
        self.stop_mode = stop_mode
        self.sel = 1 if stop_mode == "rel" else 0
        self.lowest = common.returns == "lowest"
        self.check_every = common.check_every
        self.protect = common.protect_thres
        self.stagnation = stagnation
        dev = z0.device
        self.cuda = dev.type == "cuda"
        rdtype = (
            torch.empty(0, dtype=z0.dtype).real.dtype
            if z0.is_floating_point() or z0.is_complex()
            else torch.float32
        )
        n = int(max_iter)
        self.trace = torch.empty(n, 2, self.B, dtype=rdtype, device=dev)
        self.dstats = torch.zeros(n, 4, dtype=rdtype, device=dev)
        if self.cuda:
            self.hstats = torch.empty(n, 4, dtype=rdtype, pin_memory=True)
            self.events: list[Any] = [None] * n
        else:
            self.hstats = self.dstats
        self.bshape = (self.B,) + (1,) * (len(self.shape) - 1)
        self.k = 0  # steps recorded
        self.read = 0  # steps whose summary the host has consumed
        self.best_ar: Tensor | None = None  # (2, B) abs/rel of the chosen iterates
        self.best_z: Tensor | None = None
        self.pending: deque[tuple[int, Tensor, Tensor]] = deque()
        self.cur_hist: list[float] = []  # host: batch max residual (stop mode) per step
        self.best_hist: list[float] = []  # host: batch max of the per-sample lowest residual
        self.abs0: float | None = None
        self.status: str | None = None
        self.exact_reads = 0

    # -- per step ---------------------------------------------------------------------------
    def record(self, z: Tensor, fz: Tensor, d: Tensor) -> None:
        """Record iterate ``z`` with ``fz = f(z)`` and ``d = fz - z`` (any shapes (B, ...))."""
        k = self.k
        tr = self.trace[k]
        torch.linalg.vector_norm(flat(d), dim=1, out=tr[0])
        nf = torch.linalg.vector_norm(flat(fz), dim=1).add_(EPS)
        torch.div(tr[0], nf, out=tr[1])
        st = self.dstats[k]
        if self.best_ar is None or not self.lowest:
            self.best_ar = tr
            self.best_z = z
            torch.amax(tr, dim=1, out=st[:2])
        else:
            res = tr[self.sel]
            better = res <= self.best_ar[self.sel]  # ties take the newer iterate; NaN never
            self.best_ar = torch.where(better, tr, self.best_ar)
            bsel = self.best_ar[self.sel]
            # [cur abs, cur rel, max lowest, max(res - lowest) <= 0 iff every sample improved]
            torch.amax(torch.stack((tr[0], tr[1], bsel, res - bsel)), dim=1, out=st)
            self.pending.append((k, z, better))
        if self.cuda:
            self.hstats[k].copy_(st, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            self.events[k] = ev
        self.k = k + 1

    def stop(self) -> bool:
        """Whether to stop after the step just recorded (converged, diverged or stagnated)."""
        k = self.k
        if self.check_every is not None:
            if k % self.check_every == 0:
                self._consume(k)
            else:
                while len(self.pending) > self.MAX_PENDING:
                    self._resolve_blind()
        elif not self.cuda or k == 1:
            self._consume(k)
        else:
            self._consume(k - 1)  # finished or about to: step k-1 keeps the GPU busy meanwhile
            if self.status is None and self._near():
                self.exact_reads += 1
                self._consume(k)
        return self.status is not None

    def _near(self) -> bool:
        h = self.best_hist
        if not h:
            return True
        ratio = h[-1] / h[-2] if len(h) > 1 and h[-2] > 0 else 1.0
        return h[-1] * min(ratio, 1.0) < self.NEAR * self.tol

    def _resolve_blind(self) -> None:
        _, z, better = self.pending.popleft()
        self.best_z = torch.where(better.view(self.bshape), z, self.best_z)

    def _consume(self, upto: int) -> None:
        if upto <= self.read:
            return
        if self.cuda:
            self.events[upto - 1].synchronize()
        rows = self.hstats[self.read : upto].tolist()
        for j, row in zip(range(self.read, upto), rows):
            cur_abs = row[0]
            cur = row[self.sel]
            if self.lowest and j > 0:
                best, allbetter = row[2], row[3] <= 0
            else:
                best, allbetter = cur, True
            self.cur_hist.append(cur)
            self.best_hist.append(best)
            if self.pending and self.pending[0][0] == j:
                _, z, better = self.pending.popleft()
                if allbetter:
                    self.best_z = z
                else:
                    self.best_z = torch.where(better.view(self.bshape), z, self.best_z)
            if self.status is not None:
                continue
            if j == 0:
                self.abs0 = cur_abs
            if not (math.isfinite(cur_abs) and math.isfinite(cur)):
                self.status = "diverged"
            elif self.abs0 and cur_abs > self.protect * self.abs0:
                self.status = "diverged"
            elif best < self.tol:
                self.status = "converged"
            elif self.stagnation is not None and self._stagnated(best):
                self.status = "stagnated"
        self.read = upto

    def _stagnated(self, best: float) -> bool:
        window, ratio, factor = self.stagnation  # type: ignore[misc]
        h = self.cur_hist
        if len(h) <= window or best >= factor * self.tol:
            return False
        recent = h[-window:]
        lo = min(recent)
        return lo > 0 and max(recent) / lo < ratio

    # -- end --------------------------------------------------------------------------------
    def finish(self, nstep: int, extra: dict[str, Any] | None = None) -> tuple[Tensor, SolverStats]:
        """Read what is left (one sync), pick the returned iterates and build the stats."""
        self._consume(self.k)
        while self.pending:
            self._resolve_blind()
        assert self.best_ar is not None and self.best_z is not None, "finish() before record()"
        k = self.k
        trace = self.trace[:k]
        best_abs = self.best_ar[0].clone()
        best_rel = self.best_ar[1].clone()
        res_tr = trace[:, self.sel]
        best = best_rel if self.sel else best_abs
        steps = torch.arange(k, device=trace.device).unsqueeze(1)
        lowest_steps = torch.where(res_tr == best, steps, -1).amax(0) if k else best.long()
        info = {"returned": "x", "lowest_steps": lowest_steps, "host_reads_exact": self.exact_reads}
        info.update(extra or {})
        stats = make_stats(
            self.solver,
            nstep,
            trace[:, 0].contiguous(),
            trace[:, 1].contiguous(),
            best_abs,
            best_rel,
            self.tol,
            self.stop_mode,
            diverged=self.status == "diverged",
            lowest_step=int(lowest_steps.max()) if k else -1,
            stagnated=self.status == "stagnated",
            extra=info,
        )
        z = self.best_z
        if z.shape != self.shape:
            z = z.reshape(self.shape)
        return z, stats
