"""Solver contract: ``solve(f, z0, *, max_iter, tol, stop_mode="rel", **options) -> (z, SolverStats)``.

Conventions:

* batched over dim 0; each sample's state is flattened (all non-batch dims);
* canonical residual per sample: ``abs_i = ||f(z)_i - z_i||``, ``rel_i = abs_i / (||f(z)_i|| + 1e-9)``;
* ``max_iter`` bounds the number of f-evaluations and ``nstep`` counts every f-evaluation made;
* stop when the batch max of the chosen residual (``stop_mode`` rel or abs) of the returned
  iterates is below ``tol`` (the default stop rule; the option ``stop`` of a solver built on
  :class:`Tracker` picks another reduction over the batch: :data:`STOP_RULES`, :func:`rule_value`);
* the returned iterate is the lowest-residual iterate *x* whose residual was measured
  (``returns="lowest"``, the default, chosen per sample) or the last measured iterate
  (``returns="last"``); its residual is exactly the reported one (no extra evaluation is made,
  the residual of x was measured with the counted evaluation f(x));
* a non-finite residual or an abs residual blow-up (``protect_thres`` times the first) stops the
  solver with ``status="diverged"``; nothing is raised.

**Writing a solver.** :func:`solver` declares one: a pydantic options model (subclass of
:class:`CommonOptions`, or :class:`GraphOptions` for CUDA-graph support; fields with defaults,
constraints such as ``Field(gt=0)`` and a ``description``) and a body
``impl(f, z0, opts, *, max_iter, tol, stop_mode)`` that receives the validated options object
and checks nothing itself. The decorated function is the contract above; it validates each
distinct option dict once (a suite validates its cells' options when it is built, a call
through a small cache keyed by the frozen values, so a solve in a training loop does no
validation after the first) and raises :class:`SolverOptionError` naming the solver and the
option. The docs' options tables are generated from the models (:func:`options_markdown`)::

    class Options(CommonOptions):
        omega: float = Field(0.9, gt=0, lt=2, description="relaxation factor")

    @solver(Options)
    def picard(f, z0, opts, *, max_iter=50, tol=1e-4, stop_mode="rel"):
        tracker = Tracker("picard", z0, max_iter=max_iter, tol=tol, stop_mode=stop_mode,
                          common=opts)
        z, nstep = z0, 0
        while True:
            fz = f(z)
            nstep += 1
            tracker.record(z, fz, None)
            if tracker.stop() or nstep >= max_iter:
                return tracker.finish(nstep, {"omega": opts.omega})
            z = (1 - opts.omega) * z + opts.omega * fz

**Recording statistics: Tracker.** The one way a solver records what it did:
``Tracker.record(x, f(x), f(x) - x or None)`` for each measured iterate, ``Tracker.stop()``
after it (converged, diverged, stagnated; ``check_every`` and ``protect_thres`` applied), and
``Tracker.finish(nstep, extra)``, which returns the iterate to return (``returns``: the lowest
residual per sample or the last) and its :class:`SolverStats`. :func:`make_stats` is
``finish``'s last step; call it directly only to wrap a solve someone else ran (an adapter of
an external solver that hands over its residuals). The tracker keeps per-sample traces in a
preallocated buffer, the per-sample lowest iterate and the stop decisions. It never
synchronises with the GPU in the hot loop: each step's batch summaries are copied
asynchronously to pinned host memory and read one step late (the GPU is then busy with the next
step), with an exact read only when the residual trend predicts convergence at the current
step, so the f-evaluation count is not inflated.

**CUDA graphs.** A solver declared with ``@solver(Options, cuda_graph=True)`` (``Options``
subclassing :class:`GraphOptions`; built-ins: ``fixed_point``, ``anderson``, ``broyden``;
:func:`supports_graph` tells) takes the option ``cuda_graph``: ``False`` (default) runs
eagerly; ``True`` runs one or a few eager steps, then *captures* the solver step (f and the
tracker's :meth:`Tracker.device_record`, all on static buffers) in a CUDA graph and replays it,
one launch per replay instead of one per kernel (for launch- or host-bound cells); ``"cache"``
also keeps the captured graph (and its buffers) for later solves with the same f object,
shapes and options and replays it from the first step (valid only while f reads the same
tensors at the same addresses). ``graph_steps`` (``"auto"`` or 1-16) is the number of steps per
captured graph: the host reads the residuals once per replay, so up to ``graph_steps - 1``
steps past convergence may be made (``extra["nstep_to_tol"]``). f must be capturable (no host
syncs, fixed shapes); otherwise :class:`GraphCaptureError` is raised. On CPU the static step
runs eagerly (the same iterates). The DEQ layer uses ``cuda_graph="cache"`` by itself on CUDA
(``Runtime.cuda_graph="auto"``) for states of at most ``graph_numel`` elements (declared with
``@solver(..., graph_numel=N)``; default :data:`AUTO_NUMEL`); a solver's body implements the
static path with :func:`graph_mode`, :func:`graph_steps`, :func:`graph_state` and
:func:`graph_loop`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import types
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeVar, Union, cast, get_args, get_origin

import torch
from annotated_types import Ge, Gt, Le
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError
from torch import Tensor

from ..core.errors import ConfigError
from . import fused

EPS = 1e-9
STATUSES = ("converged", "max_iter", "diverged", "stagnated")
#: the stop rules (option ``stop``): the reduction over the batch that decides convergence,
#: independent of ``stop_mode`` (which per-sample residual, rel or abs):
#:
#: * ``sample_max`` (default): the largest per-sample residual of the returned iterates < tol;
#: * ``batch_fro``: one ratio over the whole batch, ``||f(z) - z||_F / ||f(z)||_F`` (Frobenius
#:   norms over every sample's elements; for plain iteration z_{k+1} = f(z_k) this is the
#:   successive-difference form ``||z_{k+1} - z_k||_F / ||z_{k+1}||_F``) under ``stop_mode``
#:   rel, ``||f(z) - z||_F`` (the Frobenius norm of the whole batch's residual, i.e. the 2-norm
#:   of the per-sample abs residuals) under abs;
#: * ``batch_mean``: the mean over samples of the per-sample residual < tol.
STOP_RULES = ("sample_max", "batch_fro", "batch_mean")
DEFAULT_STOP = "sample_max"


class SolverOptionError(ConfigError, ValueError):
    """An invalid solver option or option value (a ConfigError that is also a ValueError)."""


class GraphCaptureError(RuntimeError):
    """f could not be captured in a CUDA graph (host syncs, changing shapes, ...)."""


def supports_graph(solver: Any) -> bool:
    """Whether a registered solver function takes the ``cuda_graph`` option."""
    return bool(getattr(solver, "supports_cuda_graph", False))


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
    def stop_residual(self) -> float:
        """The returned iterates' residual under the stop rule (the value tested against
        ``tol``: the batch max, the batch Frobenius ratio or the batch mean; one host read)."""
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


def check_stop(stop: Any) -> str:
    """``stop`` if it is a stop rule (:data:`STOP_RULES`), else a SolverOptionError."""
    if stop not in STOP_RULES:
        raise SolverOptionError(f"stop must be one of {', '.join(STOP_RULES)}, got {stop!r}")
    return str(stop)


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


def positive_int(solver: str, name: str, value: Any) -> int:
    """``value`` as an int, or a SolverOptionError unless it is a positive integer (not a bool)."""
    if isinstance(value, bool) or int(value) != value or value < 1:
        raise option_error(solver, f"{name} must be a positive integer, got {value!r}")
    return int(value)


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


def check_budget(solver: str, max_iter: int, tol: float, stop_mode: str) -> None:
    check_stop_mode(stop_mode)
    positive_int(solver, "max_iter", max_iter)
    if not (tol >= 0):  # also rejects NaN
        raise option_error(solver, f"tol must be >= 0, got {tol!r}")


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


class Tracker:
    """Residual bookkeeping shared by the solvers.

    Per step the solver calls :meth:`record` with the iterate x, f(x) and f(x) - x (or None),
    then :meth:`stop`; at the end :meth:`finish` returns the chosen iterate and the stats.

    ``f`` must return a new tensor each call (not a buffer it overwrites later): earlier
    iterates are held by reference.

    Device work per step: two norms and a few (B,)-sized kernels writing into one preallocated
    (max_iter, 4, B) buffer: abs, rel, the running per-sample lowest residual (fmin) and
    ``res - lowest`` (<= 0 everywhere iff every sample improved), then one reduction to four
    scalars and one 16-byte asynchronous copy to pinned memory. The lowest iterate is tracked by
    reference: a step where every sample improved (the usual case) costs no copy of the state;
    otherwise one masked select is made once the host knows it is needed. The returned
    residuals are gathered from the trace at the end.

    Host reads (``check_every=None``, the default): on CPU every step (free); on CUDA the summary
    of step k-1 is read while step k runs, plus an exact read of step k when the residual trend
    predicts convergence there (within ``NEAR`` times tol), so stopping is exact in practice
    without stalling the GPU every step. ``check_every=k`` instead reads exactly every k steps
    and never in between (up to k-1 extra f-evaluations at the end).

    Stop rules (``common.stop``, :data:`STOP_RULES`): under ``sample_max`` (the default) the
    summary's third entry is the batch max of the running lowest residual, as described above.
    Under ``batch_fro`` or ``batch_mean`` it is instead the batch value of the rule over the
    returned iterates (the per-sample lowest, or the last), reduced on the device into the same
    preallocated summary (``batch_fro`` under rel also keeps, per sample, ``||f(x)||`` and the
    abs residual of the returned iterate in a (2, B) buffer); the host tests that entry
    against tol, so stopping, the trend prediction and ``converged`` follow the rule with no
    extra host read. The fused record kernels compute the ``sample_max`` summary only: under
    another rule the torch code serves the step (the same iterates, a few more small kernels).
    """

    #: exact read when the predicted residual is within this factor of tol. On the recorded
    #: residual traces of the benchmark cells (fc1024 and conv64, three solvers, rel 1e-4 and
    #: 1e-6) 2 gives no step past convergence and 1-5 exact reads per solve where 10 gave 2-13
    #: (each one a GPU bubble: the next chunk waits for the host)
    NEAR = 2.0
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
        static: bool = False,
    ) -> None:
        if not z0.is_floating_point():
            raise option_error(solver, f"z0 must be a floating-point tensor, got {z0.dtype}")
        self.solver = solver
        self.shape = z0.shape
        self.B = int(z0.shape[0])
        self.tol = float(tol)
        self.stop_mode = stop_mode
        self.sel = 1 if stop_mode == "rel" else 0
        self.lowest = common.returns == "lowest"
        self.check_every = common.check_every
        self.protect = common.protect_thres
        self.rule = getattr(common, "stop", DEFAULT_STOP)
        self.batch_rule = self.rule != DEFAULT_STOP
        #: batch_fro under rel: (abs, ||f(x)||) per sample of the returned iterate
        self.keep_norm = self.rule == "batch_fro" and stop_mode == "rel"
        self.fro: Tensor | None = None
        self.stagnation = stagnation
        dev = z0.device
        self.cuda = dev.type == "cuda"
        rdtype = z0.dtype  # real floating point (checked above)
        n = int(max_iter)
        self.events: list[Any] = [None] * n
        # events are recorded on this stream (looked up once: it costs ~10 us per call)
        self.stream = torch.cuda.current_stream(dev) if self.cuda else None
        if not static:  # else enable_device_mode brings (cached) static buffers
            # rows: abs, rel, running lowest (stop mode), res - lowest
            self.trace = torch.empty(n, 4, self.B, dtype=rdtype, device=dev)
            self.dstats = torch.empty(n, 4, dtype=rdtype, device=dev)  # unused entries never read
            self.hstats = (
                torch.empty(n, 4, dtype=rdtype, pin_memory=True) if self.cuda else self.dstats
            )
            if self.keep_norm:
                self.fro = torch.empty(2, self.B, dtype=rdtype, device=dev)
        self.n, self.rdtype = n, rdtype
        self.bshape = (self.B,) + (1,) * (len(self.shape) - 1)
        self.k = 0  # steps recorded
        self.read = 0  # steps whose summary the host has consumed
        self.best_z: Tensor | None = None
        self.pending: deque[tuple[int, Tensor]] = deque()
        self.cur_hist: list[float] = []  # host: batch max residual (stop mode) per step
        self.best_hist: list[float] = []  # host: batch max of the per-sample lowest residual
        self.abs0: float | None = None
        self.status: str | None = None
        self.exact_reads = 0
        self.device_mode = False
        self.last_allbetter = True  # host: whether every sample improved at the last read step
        self.bounds: list[int] = []  # step counts after each host-visible chunk (events there)
        self.conv_at: int | None = None  # f-evaluations up to the first iterate below tol
        self._inf: Tensor | None = None  # fused eager record: see inf_row, eager_part
        self._prepared: tuple[int, Tensor, Tensor, Tensor] | None = None  # _prepare_finish
        self._part: Tensor | None = None

    # -- per step ---------------------------------------------------------------------------
    def record(
        self,
        z: Tensor,
        fz: Tensor,
        d: Tensor | None,
        *,
        slots: tuple[Tensor, Tensor, int, int] | None = None,
    ) -> None:
        """Record iterate ``z`` with ``fz = f(z)`` and ``d = fz - z`` (None: computed here).

        ``slots``: (F, G, m, cd), ring buffers of shape (B, nc, m, cd) that get f(x) and
        f(x) - x at slot ``k % m`` (k: steps recorded before this one; Anderson; ``d`` is then
        ignored). On CUDA the trace row and the batch summary come from the fused kernels of
        :mod:`deqbench.solvers.fused` (two launches, the ring writes included; ``d``, which must
        equal f(x) - x, is recomputed in registers instead of read)."""
        k = self.k
        if k == 0:
            check_output(self.solver, z, fz)
        ring = () if slots is None else slots[:2]
        if not self.batch_rule and z.shape == fz.shape and fused.usable(z, fz, self.trace, *ring):
            fused.record_eager(self, z, fz, k, slots=slots, eps=EPS)
            if self.lowest and k > 0:
                self.pending.append((k, z))
            else:
                self.best_z = z
            self._host_copy(k, self.dstats[k])
            return
        if slots is not None:
            F, G, m, cd = slots
            slot = k % m
            F[:, :, slot].copy_(fz.reshape(self.B, -1, cd))
            d = torch.sub(F[:, :, slot], z.reshape(self.B, -1, cd), out=G[:, :, slot])
        tr = self.trace[k]
        batch_norm(fz - z if d is None else d, out=tr[0])
        if self.keep_norm:
            nrm = batch_norm(fz)
            torch.div(tr[0], nrm + EPS, out=tr[1])
        else:
            nrm = None
            torch.div(tr[0], batch_norm(fz).add_(EPS), out=tr[1])
        st = self.dstats[k]
        better = None  # every sample's returned iterate is this one
        if not self.lowest:
            self.best_z = z
            torch.amax(tr[:2], dim=1, out=st[:2])
        elif k == 0:
            self.best_z = z
            tr[2].copy_(tr[self.sel])
            torch.amax(tr[:3], dim=1, out=st[:3])
        else:
            res = tr[self.sel]
            if self.keep_norm:
                better = res <= self.trace[k - 1, 2]  # as fmin's choice below (NaN never)
            torch.fmin(res, self.trace[k - 1, 2], out=tr[2])  # NaN never becomes the lowest
            torch.sub(res, tr[2], out=tr[3])
            torch.amax(tr, dim=1, out=st)
            self.pending.append((k, z))
        if self.batch_rule:
            self._rule_summary(tr, st, nrm, better)
        self._host_copy(k, st)

    def _rule_summary(
        self, row: Tensor, st: Tensor, nrm: Tensor | None, better: Tensor | None
    ) -> None:
        """Under a batch stop rule, ``st[2]`` = the rule's batch value over the returned
        iterates (row 2, the running lowest, or the stop-mode row for ``returns="last"``; the
        kept (abs, ||f(x)||) of the returned iterates for ``batch_fro`` under rel), on the
        device. ``better``: where this step's iterate is the returned one (None: everywhere)."""
        ret = row[2] if self.lowest else row[self.sel]
        if self.rule == "batch_mean":
            torch.mean(ret, 0, out=st[2])
        elif not self.keep_norm:  # batch_fro under abs: ||abs||_2 of the returned iterates
            torch.linalg.vector_norm(ret, out=st[2])
        else:
            fro, a = cast(Tensor, self.fro), row[0]
            assert nrm is not None
            if better is None:
                fro[0].copy_(a)
                fro[1].copy_(nrm)
            else:
                torch.where(better, a, fro[0], out=fro[0])
                torch.where(better, nrm, fro[1], out=fro[1])
            nn = torch.linalg.vector_norm(fro, dim=1)
            torch.div(nn[0], nn[1] + EPS, out=st[2])

    def _host_copy(self, k: int, st: Tensor) -> None:
        """Step k's summary to pinned host memory (asynchronously on CUDA) and its event."""
        if self.cuda:
            self.hstats[k].copy_(st, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
            self.events[k] = ev
        self.k = k + 1
        self.bounds.append(self.k)

    def check_fused(self, rules: tuple[str, ...]) -> None:
        """Refuse (SolverOptionError, one line) a fused record path that honours only
        ``rules`` when this tracker's stop rule is another (:func:`fused.check_stop_rule`)."""
        if self.rule not in rules:
            raise option_error(
                self.solver,
                f"stop rule {self.rule!r} is not supported by the fused record kernels "
                f"(solvers.fused: {', '.join(rules)} only)",
            )

    @property
    def inf_row(self) -> Tensor:
        """(B,) of +inf: the running lowest before the first step (fused eager record)."""
        if self._inf is None:
            self._inf = torch.full((self.B,), math.inf, dtype=self.rdtype, device=self.trace.device)
        return self._inf

    def eager_part(self, S: int) -> Tensor:
        """Scratch for the fused eager record's partial sums of a state split in S programs."""
        if self._part is None or self._part.numel() < self.B * S * 2:
            self._part = torch.empty(self.B * S * 2, dtype=self.rdtype, device=self.trace.device)
        return self._part

    # -- device mode (CUDA graphs) ----------------------------------------------------------
    def enable_device_mode(
        self, z0: Tensor, bufs: dict[str, Tensor] | None = None
    ) -> dict[str, Tensor]:
        """Keep the lowest iterate in a static buffer and every per-step value in static device
        tensors, so :meth:`device_record` can be captured in a CUDA graph.

        ``bufs`` (from an earlier solve of the same shapes, for a cached graph) is reset and
        reused; the buffers are returned. A tracker made with ``static=True`` allocates no
        buffers of its own and must call this before its first step.
        """
        dev, rdtype, n = z0.device, self.rdtype, self.n
        if bufs is None:
            dstats = torch.empty(n, 4, dtype=rdtype, device=dev)
            bufs = {
                "trace": torch.empty(n, 4, self.B, dtype=rdtype, device=dev),
                "dstats": dstats,
                "hstats": torch.empty(n, 4, dtype=rdtype, pin_memory=True) if self.cuda else dstats,
                "row": torch.empty(4, self.B, dtype=rdtype, device=dev),
                "st": torch.zeros(GRAPH_STEPS_MAX, 4, dtype=rdtype, device=dev),
                "low": torch.empty(self.B, dtype=rdtype, device=dev),
                "k": torch.empty(1, dtype=torch.long, device=dev),
                "nf": torch.empty(self.B, dtype=rdtype, device=dev),
                "best": torch.empty_like(z0, memory_format=torch.contiguous_format),
                # the fused kernels' partial sums and per-sample decisions (split states)
                "part": torch.empty(
                    self.B * fused.splits(z0[0].numel()) * 2, dtype=rdtype, device=dev
                ),
                "flag": torch.empty(self.B, dtype=torch.int32, device=dev),
            }
        if self.keep_norm and "fro" not in bufs:
            bufs["fro"] = torch.empty(2, self.B, dtype=rdtype, device=dev)
        bufs["low"].fill_(math.inf)
        bufs["k"].zero_()
        bufs["best"].copy_(z0)
        self.device_mode = True
        self.trace, self.dstats, self.hstats = bufs["trace"], bufs["dstats"], bufs["hstats"]
        self.dev_row, self.dev_st, self.dev_low = bufs["row"], bufs["st"], bufs["low"]
        self.dev_k, self.dev_nf, self.best_z = bufs["k"], bufs["nf"], bufs["best"]
        self.dev_part, self.dev_flag = bufs["part"], bufs["flag"]
        self.fro = bufs.get("fro")
        self.dev_j = 0  # row of dev_st the next device_record writes (the step in its chunk)
        return bufs

    def device_record(
        self,
        z: Tensor,
        fz: Tensor,
        d: Tensor | None,
        *,
        copy_to: Tensor | None = None,
        slots: tuple[Tensor, Tensor, int, int] | None = None,
    ) -> None:
        """:meth:`record` with static buffers only (capturable); call :meth:`commit` after.

        ``copy_to``: afterwards write f(x) there (may be x itself: the fixed-point update);
        ``slots``: (F, G, m, cd), ring buffers of shape (B, nc, m, cd) that get f(x) and
        f(x) - x at slot ``k % m`` (k: steps recorded before this one; Anderson). On CUDA the
        fused kernels of :mod:`deqbench.solvers.fused` do all of it in two launches (``d``,
        which must equal f(x) - x, is then recomputed in registers instead of read).
        """
        if fused.tracker_usable(self, z, fz, slots):
            fused.record(self, z, fz, copy_to=copy_to, slots=slots, eps=EPS)
            return
        if slots is not None:
            F, G, m, cd = slots
            slot = self.dev_k.remainder(m)
            fzv = fz.reshape(self.B, -1, 1, cd)
            F.index_copy_(2, slot, fzv)
            d = fzv - z.reshape(self.B, -1, 1, cd)
            G.index_copy_(2, slot, d)
        row, best, st = self.dev_row, self.best_z, self.dev_st[self.dev_j]
        assert best is not None
        batch_norm(fz - z if d is None else d, out=row[0])
        batch_norm(fz, out=self.dev_nf)
        if self.keep_norm:  # dev_nf stays ||f(x)||
            torch.div(row[0], self.dev_nf + EPS, out=row[1])
        else:
            torch.div(row[0], self.dev_nf.add_(EPS), out=row[1])
        better = None
        if self.lowest:
            res = row[self.sel]
            better = res <= self.dev_low
            torch.where(better.view(self.bshape), z, best, out=best)
            torch.fmin(res, self.dev_low, out=row[2])
            self.dev_low.copy_(row[2])
            torch.sub(res, row[2], out=row[3])
            torch.amax(row, dim=1, out=st)
        else:
            best.copy_(z)
            torch.amax(row[:2], dim=1, out=st[:2])
        if self.batch_rule:  # at the first step better is all True (the lowest starts at inf)
            self._rule_summary(row, st, self.dev_nf, better)
        self.trace.index_copy_(0, self.dev_k, row.unsqueeze(0))
        self.dev_k.add_(1)
        if copy_to is not None:
            copy_to.copy_(fz)

    def commit(self, steps: int = 1) -> None:
        """Host side of ``steps`` steps made by :meth:`device_record` (eagerly or by one graph
        replay): one asynchronous copy of their summaries and one event."""
        k = self.k
        if self.cuda:
            self.hstats[k : k + steps].copy_(self.dev_st[:steps], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
            self.events[k + steps - 1] = ev
        else:
            self.dstats[k : k + steps].copy_(self.dev_st[:steps])
        self.k = k + steps
        self.bounds.append(self.k)

    def stop(self) -> bool:
        """Whether to stop after the step just recorded (converged, diverged or stagnated)."""
        k = self.k
        prev = self.bounds[-2] if len(self.bounds) > 1 else 0  # the chunk before the last
        if self.check_every is not None:
            if k // self.check_every > prev // self.check_every:
                self._consume(k)
            else:
                while len(self.pending) > self.MAX_PENDING:
                    self._resolve(self.pending[0][0], False)
        elif not self.cuda:
            self._consume(k)
        else:
            # the chunk before the last (none after the first chunk, which is not waited for:
            # with nothing read yet there is no trend to predict from) while the last one keeps
            # the GPU busy, and the last one too where the trend predicts convergence in it
            self._consume(prev)
            if self.status is None and self.best_hist and self._near(k - self.read):
                self.exact_reads += 1
                if self.device_mode:  # likely the last step: finish's copies queue behind it
                    self._prepare_finish()
                self._consume(k)
        return self.status is not None

    def _near(self, ahead: int = 1) -> bool:
        """Whether the residual trend predicts convergence within the ``ahead`` steps the host
        has not read yet (a replayed graph makes several)."""
        h = self.best_hist
        ratio = h[-1] / h[-2] if len(h) > 1 and h[-2] > 0 else 1.0
        return h[-1] * min(ratio, 1.0) ** max(1, ahead) < self.NEAR * self.tol

    def _resolve(self, j: int, allbetter: bool) -> None:
        """Make the pending iterate of step j (the oldest) the returned one where it is lowest.

        A sample takes it when its residual is <= the running lowest before step j (ties take
        the newer iterate, NaN never), i.e. when it equals the running lowest after step j.
        """
        _, z = self.pending.popleft()
        if allbetter:
            self.best_z = z
        else:
            tr = self.trace[j]
            take = (tr[self.sel] == tr[2]).view(self.bshape)
            assert self.best_z is not None  # step 0 set it
            self.best_z = torch.where(take, z, self.best_z)

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
            else:  # under a batch stop rule row 2 holds its value in either mode
                best, allbetter = (row[2] if self.lowest or self.batch_rule else cur), True
            self.cur_hist.append(cur)
            self.best_hist.append(best)
            self.last_allbetter = allbetter
            if self.pending and self.pending[0][0] == j:
                self._resolve(j, allbetter)
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
                self.conv_at = j + 1
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
    def _prepare_finish(self) -> None:
        """Queue what :meth:`finish` copies out of the static buffers (the trace, the lowest
        iterate, the all-improved ``lowest_steps``) behind the steps recorded so far, before
        the host waits for them: if no step follows, finish uses these and launches nothing
        after the GPU went idle."""
        k = self.k
        best = cast(Tensor, self.best_z)
        steps = torch.full((self.B,), k - 1, dtype=torch.long, device=best.device)
        self._prepared = (k, self.trace[:k].clone(), best.clone(), steps)

    def finish(self, nstep: int, extra: dict[str, Any] | None = None) -> tuple[Tensor, SolverStats]:
        """Read what is left (one sync), pick the returned iterates and build the stats.

        Everything the host needs (converged, lowest step) comes from the step summaries it
        already read, so no further synchronisation is needed in the usual case.
        """
        k = self.k
        trace = self.trace[:k]
        z = self.best_z
        last_steps = None
        if self._prepared is not None and self._prepared[0] == k:
            _, trace, z, last_steps = self._prepared
        elif self.device_mode:  # static buffers, reused by the next solve of a cached graph;
            # copied before the host waits for the last step (the copies queue behind it)
            trace, z = trace.clone(), cast(Tensor, z).clone()
        self._consume(self.k)
        while self.pending:
            self._resolve(self.pending[0][0], False)
        if not self.device_mode:  # reading may have resolved pending iterates
            z = self.best_z
        assert z is not None, "finish() before record()"
        dev = trace.device
        if self.lowest and not self.last_allbetter:
            # the step each sample's returned iterate comes from: the last that matched the
            # running lowest (exactly the masks used above)
            steps = torch.arange(k, device=dev).unsqueeze(1)
            lowest_steps = torch.where(trace[:, self.sel] == trace[:, 2], steps, 0).amax(0)
            best = trace[:, :2].gather(0, lowest_steps.view(1, 1, self.B).expand(1, 2, self.B))[0]
            lowest_step = int(lowest_steps.max())
        else:  # every sample's returned iterate is the last one
            lowest_steps = (
                last_steps
                if last_steps is not None
                else torch.full((self.B,), k - 1, dtype=torch.long, device=dev)
            )
            best = trace[k - 1, :2]
            lowest_step = k - 1
        top = self.best_hist[-1]  # the returned residuals under the stop rule (stop mode)
        info = {"returned": "x", "lowest_steps": lowest_steps, "host_reads_exact": self.exact_reads}
        if self.conv_at is not None and self.conv_at < k:
            info["nstep_to_tol"] = self.conv_at  # steps past it came from checking per chunk
        info.update(extra or {})
        stats = make_stats(
            self.solver,
            nstep,
            trace[:, 0],
            trace[:, 1],
            best[0],
            best[1],
            self.tol,
            self.stop_mode,
            diverged=self.status == "diverged",
            lowest_step=lowest_step,
            stagnated=self.status == "stagnated",
            extra=info,
            converged=math.isfinite(top) and top < self.tol,
            stop=self.rule,
            fz_norm=None if self.fro is None else self.fro[1].clone(),
        )
        if self.device_mode and self.cuda:
            stats.path = "graph"
        if z.shape != self.shape:
            z = z.reshape(self.shape)
        return z, stats


#: captured solver steps kept by ``cuda_graph="cache"``: key -> (graph, static state), most
#: recently used last
_GRAPH_CACHE: dict[tuple, tuple[Any, dict[str, Any]]] = {}
GRAPH_CACHE_SIZE = 32
#: most steps captured in one graph (``graph_steps``)
GRAPH_STEPS_MAX = 16
#: ``graph_steps="auto"``: states of at most this many elements get AUTO_STEPS steps per graph
#: (launch-bound: one host round trip per chunk instead of per step), larger ones one
AUTO_NUMEL = 1 << 21
AUTO_STEPS = 2
#: the DEQ layer's automatic graph path takes states of at most ``solver.graph_numel``
#: elements (default AUTO_NUMEL); a solver whose step is host-bound on large cells too
#: (Anderson on conv64: ~25 small kernels and a batched solve per step) raises it to this
LARGE_NUMEL = 1 << 24
#: bytes of static buffers the cached graphs may hold together (oldest dropped first)
GRAPH_CACHE_BYTES = 4 << 30
_GRAPH_BYTES: dict[tuple, int] = {}


def graph_numel(solver: Any) -> int:
    """The largest state (elements) the DEQ layer's automatic graph path captures for a solver."""
    return int(getattr(solver, "graph_numel", AUTO_NUMEL))


def _nbytes(obj: Any) -> int:
    if isinstance(obj, Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    return 0


def _cache_graph(key: tuple, graph: Any, state: dict[str, Any]) -> None:
    """Keep a captured graph and its static buffers, dropping the oldest entries beyond
    GRAPH_CACHE_SIZE entries or GRAPH_CACHE_BYTES bytes."""
    size = _nbytes(state)
    while _GRAPH_CACHE and (
        len(_GRAPH_CACHE) >= GRAPH_CACHE_SIZE
        or sum(_GRAPH_BYTES.values()) + size > GRAPH_CACHE_BYTES
    ):
        old = next(iter(_GRAPH_CACHE))
        _GRAPH_CACHE.pop(old)
        _GRAPH_BYTES.pop(old, None)
    _GRAPH_CACHE[key] = (graph, state)
    _GRAPH_BYTES[key] = size


@contextlib.contextmanager
def forbid_sync() -> Iterator[None]:
    """CUDA operations that synchronise with the host raise inside (``torch.cuda``'s sync debug
    mode): a step that runs clean here can be captured. Probing this way avoids a capture that
    fails halfway, which leaves the CUDA generator in capture state (later random ops raise
    "Offset increment outside graph capture")."""
    prev = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():  # "a prototype feature" on every run (no warnings)
        warnings.filterwarnings("ignore", message="Synchronization debug mode")
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(prev)


def clear_graph_cache() -> None:
    """Drop every cached CUDA graph (and the memory its static buffers hold)."""
    _GRAPH_CACHE.clear()
    _GRAPH_BYTES.clear()


def drop_graphs(fs: list[Any]) -> None:
    """Drop the cached graphs captured for any of the maps ``fs`` (keys hold f itself)."""
    if not fs:
        return
    ids = {id(f) for f in fs}
    for key in [k for k in _GRAPH_CACHE if len(k) > 1 and id(k[1]) in ids]:
        del _GRAPH_CACHE[key]
        _GRAPH_BYTES.pop(key, None)


def graph_mode(opts: GraphOptions) -> str | None:
    """The ``cuda_graph`` option as a mode: None (off), "capture" (True) or "cache"."""
    v = opts.cuda_graph
    return None if not v else "capture" if v is True else "cache"


def graph_steps(opts: GraphOptions, z0: Tensor) -> int:
    """Steps per replayed graph (``graph_steps``; "auto": AUTO_STEPS for states of at most
    AUTO_NUMEL elements, else 1)."""
    v = opts.graph_steps
    if v == "auto":
        return AUTO_STEPS if z0.numel() <= AUTO_NUMEL else 1
    return int(v)


def graph_state(mode: str | None, key: tuple) -> tuple[Any, dict[str, Any]]:
    """(the cached graphs by phase or None, static state dict to fill or reuse) for a solve."""
    if mode == "cache" and key in _GRAPH_CACHE:
        hit = _GRAPH_CACHE.pop(key)
        _GRAPH_CACHE[key] = hit  # most recently used
        return hit
    return None, {}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def graph_loop(
    solver: str,
    tracker: Tracker,
    body: Callable[..., None],
    max_iter: int,
    *,
    mode: str = "capture",
    key: tuple | None = None,
    graph: dict[int, Any] | None = None,
    state: dict[str, Any] | None = None,
    warmup: int = 1,
    steps: int = 1,
    phase: Callable[[int], int] | None = None,
) -> int:
    """Run ``body`` (one solver step on static buffers, ending in ``tracker.device_record``)
    ``warmup`` times eagerly, then capture ``steps`` of it in one CUDA graph and replay it
    until the tracker stops or ``max_iter`` steps were made (the last ``< steps`` steps run
    eagerly on the same buffers, so ``max_iter`` is never exceeded). Returns the number of
    steps (f-evaluations) made.

    The host reads the residual summaries once per replay, so up to ``steps - 1`` steps past
    the first converged iterate can be made (counted in ``nstep``; ``extra["nstep_to_tol"]``
    says where the tolerance was first met). The eager steps are real steps (they also let
    cuDNN/cuBLAS pick their algorithms before capture, on a side stream as CUDA graphs
    require). f is called ``steps`` times more during capture, without evaluating anything.
    Each replay costs one launch instead of one per kernel, but capturing and instantiating
    costs about a millisecond or more per solve; ``mode="cache"`` keeps the graph (and
    ``state``, its static buffers) under ``key`` and replays it from the first step in later
    solves, which is valid only while f and every tensor it reads are the same objects at the
    same addresses (the usual static-input CUDA-graph pattern).

    ``phase``: the steps differ by phase (Broyden reads only the memory rows that can be in
    use by then): ``phase(n)`` (n: steps made before a chunk) is passed to
    ``body``, and one graph is captured per phase when first reached (sharing one memory pool).
    """
    nstep = 0
    graphs: dict[int, Any] = graph if graph is not None else {}  # phase -> captured graph

    def ph(n: int) -> int:
        return phase(n) if phase is not None else 0

    def run(p: int) -> None:
        if phase is None:
            body()
        else:
            body(p)

    def eager_step(probe: bool = False) -> bool:
        nonlocal nstep
        tracker.dev_j = 0
        p = ph(nstep)
        if probe:
            try:
                with forbid_sync():
                    run(p)
            except RuntimeError as exc:
                raise GraphCaptureError(
                    f"solver '{solver}': f synchronises with the host ({_first_line(exc)}), so "
                    "it cannot be captured in a CUDA graph"
                ) from exc
        else:
            run(p)
        nstep += 1
        tracker.commit(1)
        return tracker.stop() or nstep >= max_iter

    def capture(p: int) -> Any:
        g = torch.cuda.CUDAGraph()
        pool = next(iter(graphs.values())).pool() if graphs else None
        try:
            with torch.cuda.graph(g, pool=pool):
                for j in range(steps):
                    tracker.dev_j = j
                    run(p)
        except Exception as exc:
            raise GraphCaptureError(
                f"solver '{solver}': f could not be captured in a CUDA graph "
                f"({type(exc).__name__}: {_first_line(exc)}); f "
                "must not synchronise with the host or change shapes"
            ) from exc
        graphs[p] = g
        return g

    if not tracker.cuda:  # no graphs on CPU: the same static body, eagerly (tests use this)
        while not eager_step():
            pass
        return nstep
    if not graphs:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        done = False
        main, tracker.stream = tracker.stream, side  # the warm-up's events on its stream
        with torch.cuda.stream(side):
            for _ in range(warmup):
                if eager_step(probe=True):
                    done = True
                    break
        tracker.stream = main
        torch.cuda.current_stream().wait_stream(side)
        if done or nstep + steps > max_iter:
            while not done:
                done = eager_step()
            return nstep
        capture(ph(nstep))
        if mode == "cache" and key is not None:
            _cache_graph(key, graphs, state if state is not None else {})
    while nstep + steps <= max_iter:
        p = ph(nstep)
        g = graphs.get(p)
        if g is None:  # a later phase, first reached: captured now, kept with the others
            g = capture(p)
        g.replay()
        nstep += steps
        tracker.commit(steps)
        if tracker.stop():
            return nstep
    if nstep < max_iter:
        while not eager_step():
            pass
    return nstep


# -- declaring a solver: its options model and the decorator -------------------------------------


class SolverOptions(BaseModel):
    """Base of a solver's options model: unknown options are errors, values are checked
    strictly (no bool for a number, no string for a number, an integer option takes no float)
    and the validated object is frozen (one object serves every solve with the same options).

    Subclass :class:`CommonOptions` (or :class:`GraphOptions`) for a solver built on
    :class:`Tracker`; subclass this for one that takes none of them.
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class CommonOptions(SolverOptions):
    """The options every solver built on :class:`Tracker` takes (its bookkeeping reads them)."""

    returns: Literal["lowest", "last"] = Field(
        "lowest",
        description="'lowest': per sample, the iterate x with the lowest measured residual; "
        "'last': the last measured iterate. The reported residual is that of x.",
    )
    check_every: Annotated[int, Gt(0)] | None = Field(
        None,
        description="read the convergence test on the host exactly every k f-evaluations "
        "(None: every step on CPU; on CUDA one step late without stalling the GPU, exactly "
        "near convergence).",
    )
    protect_thres: float = Field(
        1e6,
        gt=1,
        description="stop as diverged when the batch max abs residual exceeds this factor times "
        "the first one (non-finite residuals always stop as diverged).",
    )
    stop: Literal["sample_max", "batch_fro", "batch_mean"] = Field(
        "sample_max",
        description="stop rule, the reduction over the batch that decides convergence (with "
        "stop_mode rel or abs per sample): 'sample_max': the largest per-sample residual < tol; "
        "'batch_fro': one batch-wide ratio ||f(z) - z||_F / ||f(z)||_F (rel; abs: "
        "||f(z) - z||_F) < tol; 'batch_mean': the mean per-sample residual < tol.",
    )


class GraphOptions(CommonOptions):
    """:class:`CommonOptions` plus the CUDA-graph options (``@solver(..., cuda_graph=True)``)."""

    cuda_graph: StrictBool | Literal["cache"] | None = Field(
        False,
        description="True: capture the solver step (f and the bookkeeping, on static buffers) "
        "in a CUDA graph after one eager step and replay it; 'cache': also keep the graph for "
        "later solves with the same f object, shapes and options. f must be capturable (no host "
        "syncs, fixed shapes). On CPU the static step runs eagerly. See deqbench.solvers.base.",
    )
    graph_steps: Literal["auto"] | Annotated[int, Ge(1), Le(GRAPH_STEPS_MAX)] = Field(
        "auto",
        description="steps per captured graph ('auto': 2 for states of at most 2M elements, "
        "else 1); the host reads the residuals once per replay, so up to graph_steps - 1 steps "
        "past convergence may be made (extra['nstep_to_tol']).",
    )


#: options every built-in solver built on :class:`Tracker` accepts
COMMON_OPTIONS = frozenset(CommonOptions.model_fields)

_Opts = TypeVar("_Opts", bound=SolverOptions)
#: distinct option dicts validated per solver before its cache is cleared
OPTIONS_CACHE_SIZE = 256


def _bound_text(meta: Any, integer: bool) -> str:
    lo = hi = None
    lo_in = hi_in = False
    for m in meta:
        for attr, incl, upper in (("gt", False, False), ("ge", True, False),
                                  ("lt", False, True), ("le", True, True)):  # fmt: skip
            v = getattr(m, attr, None)
            if v is None or type(m).__name__.lower() != attr:
                continue
            if upper:
                hi, hi_in = v, incl
            else:
                lo, lo_in = v, incl
    if integer and hi is None and lo is not None and (lo == 0 and not lo_in or lo == 1 and lo_in):
        return "a positive integer"
    what = "an integer" if integer else "a number"
    if lo is not None and hi is not None:
        return f"{what} in {'[' if lo_in else '('}{lo}, {hi}{']' if hi_in else ')'}"
    if lo is not None:
        return f"{what} {'>=' if lo_in else '>'} {lo}"
    if hi is not None:
        return f"{what} {'<=' if hi_in else '<'} {hi}"
    return what


def _domain_parts(tp: Any, meta: tuple[Any, ...] = ()) -> list[str]:
    origin = get_origin(tp)
    if origin is Annotated:
        base, *more = get_args(tp)
        return _domain_parts(base, (*meta, *more))
    if origin in (Union, types.UnionType):
        return [p for a in get_args(tp) for p in _domain_parts(a, meta)]
    if origin is Literal:
        return [repr(a) for a in get_args(tp)]
    if tp is type(None):
        return ["None"]
    if tp is bool:
        return ["False", "True"]
    if tp in (int, float):
        return [_bound_text(meta, tp is int)]
    if tp is str:
        return ["a string"]
    if tp is dict or origin is dict:
        return ["a mapping"]
    return [] if tp is Any else [getattr(tp, "__name__", str(tp))]


def option_domain(options: type[SolverOptions], name: str) -> str:
    """What option ``name`` of an options model takes, in words (errors and the docs' tables):
    ``'lowest' or 'last'``, ``a number in (0, 1]``, ``'auto' or an integer in [1, 16]``."""
    f = options.model_fields[name]
    parts = _domain_parts(f.annotation, tuple(f.metadata))
    if not parts:
        return "any value"
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " or " + parts[-1]


def option_problems(options: type[SolverOptions], given: dict[str, Any]) -> list[tuple[str, str]]:
    """``(option, problem)`` for each option of ``given`` whose value ``options`` rejects
    (``("tau", "must be a number in (0, 1], got 0.0")``; option '' for a problem of several
    together); unknown names are left to :func:`check_options`. Suites report these at build
    time (``defaults.solver.tau: must be ...``), a direct call raises the first."""
    try:
        options.model_validate({k: v for k, v in given.items() if k in options.model_fields})
    except ValidationError as exc:
        out: list[tuple[str, str]] = []
        for e in exc.errors(include_url=False):
            key = str(e["loc"][0]) if e["loc"] else ""
            if any(k == key for k, _ in out):  # a union reports each member: one line
                continue
            if e["type"] == "value_error":
                msg = str(e["ctx"]["error"])
            elif key in options.model_fields:
                msg = f"must be {option_domain(options, key)}, got {given[key]!r}"
            else:
                msg = e["msg"]
            out.append((key, msg))
        return out
    return []


def problem_text(key: str, problem: str) -> str:
    """One line for an :func:`option_problems` entry: ``tau must be ...``, ``prior: ...``."""
    if not key:
        return problem
    return f"{key} {problem}" if problem.startswith("must be") else f"{key}: {problem}"


def _freeze(v: Any) -> Any:
    """A hashable key of an option value (its type included: True, 1 and 1.0 are equal keys)."""
    if isinstance(v, dict):
        return (dict, tuple(sorted((str(k), _freeze(x)) for k, x in v.items())))
    if isinstance(v, (list, tuple)):
        return (type(v), tuple(_freeze(x) for x in v))
    hash(v)  # TypeError: not cached
    return (type(v), v)


def stop_problem(solver: str, fields: Any, value: Any) -> str | None:
    """Why a solver whose options are ``fields`` cannot take ``stop=value``, else None: an
    unknown rule, or a rule other than ``sample_max`` for a solver that does not declare the
    option ``stop`` (it stops on the batch max, the default rule, and says nothing else)."""
    if value not in STOP_RULES:
        return f"stop must be one of {', '.join(STOP_RULES)}, got {value!r}"
    if "stop" in fields or value == DEFAULT_STOP:
        return None
    return (
        f"stop rule {value!r} is not supported by solver '{solver}' (it stops on the batch max "
        "of the per-sample residual: stop 'sample_max' only)"
    )


def parse_options(solver: str, options: type[_Opts], given: dict[str, Any]) -> _Opts:
    """The validated options object, or a SolverOptionError naming the solver and the option
    (an unknown one with "did you mean"). A model without the option ``stop`` takes
    ``stop="sample_max"`` (its rule, dropped here) and refuses another (:func:`stop_problem`)."""
    if "stop" in given and "stop" not in options.model_fields:
        msg = stop_problem(solver, options.model_fields, given["stop"])
        if msg is not None:
            raise SolverOptionError(
                msg if msg.startswith("stop rule") else f"solver '{solver}': {msg}"
            )
        given = {k: v for k, v in given.items() if k != "stop"}
    check_options(solver, given, set(options.model_fields))
    problems = option_problems(options, given)
    if problems:
        raise option_error(solver, problem_text(*problems[0]))
    return options.model_validate(given)


def solver(
    options: type[SolverOptions],
    *,
    name: str | None = None,
    cuda_graph: bool = False,
    graph_numel: int | None = None,
    needs_structure: Any = False,
    solves_tangent: bool = False,
    unroll: Callable[..., Any] | None = None,
) -> Callable[
    [Callable[..., tuple[Tensor, SolverStats]]], Callable[..., tuple[Tensor, SolverStats]]
]:
    """Declare a solver: ``impl(f, z0, opts, *, max_iter, tol, stop_mode)`` becomes the contract
    ``solve(f, z0, *, max_iter, tol, stop_mode="rel", **options) -> (z, SolverStats)``.

    The returned function validates ``**options`` with the pydantic model ``options`` once per
    distinct option dict (a small cache keyed by the frozen values: a solve in a training loop
    does no validation after the first), checks ``max_iter``, ``tol`` and ``stop_mode``, and
    calls ``impl`` under ``torch.no_grad`` with the validated object ``opts``; ``impl`` checks
    nothing itself. ``max_iter`` and ``tol`` default to ``impl``'s own defaults.

    Declared on the returned function (what suites, the docs and the DEQ layer read):
    ``Options`` (the model), ``OPTIONS`` (its field names), ``supports_cuda_graph``
    (``cuda_graph=True``: ``options`` must subclass :class:`GraphOptions`), ``graph_numel``
    (the largest state the DEQ layer's automatic graph path captures; default
    :data:`AUTO_NUMEL`), ``needs_structure``, ``solves_tangent`` and ``unroll`` (see
    :class:`deqbench.contracts.Solver`).

    Example:
        >>> from pydantic import Field
        >>> class HalfOptions(CommonOptions):
        ...     omega: float = Field(0.5, gt=0, lt=2, description="relaxation")
        >>> @solver(HalfOptions)
        ... def half(f, z0, opts, *, max_iter=50, tol=1e-4, stop_mode="rel"):
        ...     tracker = Tracker("half", z0, max_iter=max_iter, tol=tol, stop_mode=stop_mode,
        ...                       common=opts)
        ...     z, nstep = z0, 0
        ...     while True:
        ...         fz = f(z)
        ...         nstep += 1
        ...         tracker.record(z, fz, None)
        ...         if tracker.stop() or nstep >= max_iter:
        ...             return tracker.finish(nstep, {"omega": opts.omega})
        ...         z = (1 - opts.omega) * z + opts.omega * fz
        >>> z, st = half(lambda z: 0.5 * z + 1, torch.zeros(2, 3), tol=1e-6)
        >>> st.status, half.OPTIONS == {"omega", "returns", "check_every", "protect_thres", "stop"}
        ('converged', True)
        >>> half(lambda z: z, torch.zeros(2, 3), omega=2)
        Traceback (most recent call last):
        ...
        deqbench.solvers.base.SolverOptionError: solver 'half': omega must be a number in (0, 2), got 2
    """
    if cuda_graph and not issubclass(options, GraphOptions):
        raise TypeError("@solver(cuda_graph=True) needs an options model subclassing GraphOptions")

    def wrap(impl: Callable[..., tuple[Tensor, SolverStats]]) -> Callable[..., Any]:
        sname = name or impl.__name__
        params = inspect.signature(impl).parameters
        max_iter_default = params["max_iter"].default if "max_iter" in params else 50
        tol_default = params["tol"].default if "tol" in params else 1e-4
        cache: dict[Any, Any] = {}
        default = options()

        def solve(
            f: Callable[[Tensor], Tensor],
            z0: Tensor,
            *,
            max_iter: int = max_iter_default,
            tol: float = tol_default,
            stop_mode: str = "rel",
            **kw: Any,
        ) -> tuple[Tensor, SolverStats]:
            opts: SolverOptions | None
            if not kw:
                opts = default
            else:
                # the key holds each value's type: True, 1 and 1.0 are equal dict keys
                key: Any = tuple([(k, v.__class__, v) for k, v in kw.items()])
                try:
                    opts = cache.get(key)
                except TypeError:  # a dict or list value (sam's prior): frozen
                    try:
                        key = tuple([(k, _freeze(v)) for k, v in kw.items()])
                        opts = cache.get(key)
                    except TypeError:  # not hashable even frozen: validated every call
                        key, opts = None, None
                if opts is None:
                    opts = parse_options(sname, options, kw)
                    if key is not None:
                        if len(cache) >= OPTIONS_CACHE_SIZE:
                            cache.clear()
                        cache[key] = opts
            check_budget(sname, max_iter, tol, stop_mode)
            with torch.no_grad():
                return impl(f, z0, opts, max_iter=max_iter, tol=tol, stop_mode=stop_mode)

        functools.update_wrapper(solve, impl)
        P = inspect.Parameter
        solve.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [
                P("f", P.POSITIONAL_OR_KEYWORD, annotation="Callable[[Tensor], Tensor]"),
                P("z0", P.POSITIONAL_OR_KEYWORD, annotation="Tensor"),
                P("max_iter", P.KEYWORD_ONLY, default=max_iter_default, annotation="int"),
                P("tol", P.KEYWORD_ONLY, default=tol_default, annotation="float"),
                P("stop_mode", P.KEYWORD_ONLY, default="rel", annotation="str"),
                P("options", P.VAR_KEYWORD, annotation="Any"),
            ],
            return_annotation="tuple[Tensor, SolverStats]",
        )
        s: Any = solve
        s.Options = options
        s.OPTIONS = frozenset(options.model_fields)
        s.supports_cuda_graph = bool(cuda_graph)
        if graph_numel is not None:
            s.graph_numel = int(graph_numel)
        if needs_structure:
            s.needs_structure = needs_structure
        if solves_tangent:
            s.solves_tangent = True
        if unroll is not None:
            s.unroll = unroll
        return solve

    return wrap


def solver_options_model(fn: Any) -> type[SolverOptions] | None:
    """The options model a solver declares with :func:`solver` (``fn.Options``), else None."""
    m = getattr(fn, "Options", None)
    return m if isinstance(m, type) and issubclass(m, SolverOptions) else None


def options_markdown(names: list[str] | None = None) -> str:
    """The options tables of the registered solvers (``names``: default every built-in that
    declares an options model), one ``#### name`` section each: option, what it takes, default,
    description. The docs' ``<!-- deqbench:solver-options -->`` marker renders this."""
    from ..core.registry import solvers as registry

    if names is None:
        names = [n for n in registry.names() if str(registry.origin(n)).startswith("built")]
    parts = []
    for n in names:
        fn = registry.get(n)
        model = solver_options_model(fn)
        if model is None:
            continue
        graph = " Supports CUDA graphs (`cuda_graph`)." if supports_graph(fn) else ""
        rows = ["| option | takes | default | what |", "|---|---|---|---|"]
        for key, f in model.model_fields.items():
            cells = [
                f"`{key}`",
                option_domain(model, key),
                f"`{f.default!r}`",
                " ".join((f.description or "").split()),
            ]
            rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        parts.append(f"#### `{n}`\n\n`{model.__name__}`.{graph}\n\n" + "\n".join(rows) + "\n")
    return "\n".join(parts)
