"""The residual bookkeeping every solver shares: :class:`Tracker` records each measured
iterate, decides when to stop (converged, diverged, stagnated, under the stop rule) without
stalling the GPU, and returns the iterate to return with its :class:`SolverStats`.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, cast

import numpy as np
import torch
from torch import Tensor

from ..core.triton_env import kernel_device
from . import fused
from .options import DEFAULT_STOP, GRAPH_STEPS_MAX, CommonOptions, option_error
from .stats import EPS, NUMPY_DTYPES, SolverStats, batch_norm, check_output, make_stats

#: run the CPU bookkeeping in numpy (Tracker.host); tests switch it off to compare with the
#: torch code, which stays the reference (and runs on CUDA, under Triton's interpreter and for
#: other dtypes)
HOST_ENABLED = True


#: the row maxima of the host path (numpy's ufunc reduction, without ndarray.max's wrapper)
_amax = np.maximum.reduce


# One class (over 400 lines): the eager record/stop path and the device mode of the CUDA-graph
# path (enable_device_mode, device_record, commit) share one set of per-solve buffers (the trace,
# the lowest iterate, the pinned host copies) and one stop/finish logic that reads both; split
# into mixins, each half would still read and write the other's attributes. Its device mode runs
# on CUDA only (tests marked gpu).
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

    On the CPU (float32/float64, eager; ``host``) the buffers are numpy arrays with torch
    tensors over the same memory: a step's two norms and the stop rule's batch reductions are
    torch calls writing into them, the per-sample arithmetic and the summary are numpy, and the
    step is read as it is recorded (:meth:`stop` returns its status). The values are bitwise the
    torch code's (IEEE element-wise arithmetic, torch's reductions); four torch calls a step
    instead of about twenty. :data:`HOST_ENABLED` switches it off.
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
        #: CPU, eager: the (B,)-sized bookkeeping of a step runs in numpy on the same buffers
        #: (a numpy call costs a fraction of a torch op's dispatch; see _record_host)
        self.host = (
            HOST_ENABLED
            and not self.cuda
            and not static
            and rdtype in NUMPY_DTYPES
            and not kernel_device(dev)
        )
        if self.host:
            self._host_buffers(n, NUMPY_DTYPES[rdtype])
        elif not static:  # else enable_device_mode brings (cached) static buffers
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

    def _host_buffers(self, n: int, dtype: Any) -> None:
        """The CPU buffers as numpy arrays with torch tensors over the same memory: the trace
        and the summaries (as the torch code's), the two norms of a step, the kept pair and its
        norms (``batch_fro`` under rel); the torch reductions write into them (``out=``), the
        numpy code reads them, and neither converts per step."""
        B = self.B
        self._tn = np.empty((n, 4, B), dtype)
        self._dn = np.empty((n, 4), dtype)
        self.trace = torch.from_numpy(self._tn)
        self.dstats = self.hstats = torch.from_numpy(self._dn)
        self._eps = dtype(EPS)  # EPS as torch adds it to a tensor of this dtype
        self._an = np.empty((2, B), dtype)  # a step's abs residual and ||f(x)||
        self._an_t = (torch.from_numpy(self._an[0]), torch.from_numpy(self._an[1]))
        if self.keep_norm:
            self._fn = np.empty((2, B), dtype)
            self.fro = torch.from_numpy(self._fn)
            self._nn = np.empty(2, dtype)  # the kept pair's batch norms
            self._nn_t = torch.from_numpy(self._nn)

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
        if self.host and slots is None:
            self._record_host(k, z, fz, d)
            return
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
        if self.host:
            self._record_host(k, z, fz, d)
            return
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

    def _record_host(self, k: int, z: Tensor, fz: Tensor, d: Tensor | None) -> None:
        """:meth:`record` on the CPU: the two norms in torch, the rest of the step in numpy on
        views of the trace, the summary and the kept norms. The element-wise arithmetic (the
        relative residual, the running lowest, ``res - lowest``, the maxima) is IEEE in both
        libraries and the batch reductions of the stop rules stay torch's, so every value is
        bitwise the one the torch code writes; about a quarter of its host time."""
        a_t, n_t = self._an_t
        d = fz - z if d is None else d
        if d.dim() == 2 and fz.dim() == 2:  # batch_norm's one call, without its checks
            torch.linalg.vector_norm(d, dim=1, out=a_t)
            torch.linalg.vector_norm(fz, dim=1, out=n_t)
        else:
            batch_norm(d, out=a_t)
            batch_norm(fz, out=n_t)
        a, nrm = self._an
        row, st = self._tn[k], self._dn[k]
        # NaN/inf residuals are read by the stop test: no numpy warnings (the declared solvers
        # run under np.errstate(all="ignore"), solvers.base.solver)
        row[0] = a
        np.divide(a, nrm + self._eps, out=row[1])
        better = None
        if not self.lowest:
            self.best_z = z
            _amax(row[:2], 1, out=st[:2])
        elif k == 0:
            self.best_z = z
            row[2] = row[self.sel]
            _amax(row[:3], 1, out=st[:3])
        else:
            res, prev = row[self.sel], self._tn[k - 1, 2]
            if self.keep_norm:
                better = res <= prev  # as fmin's choice below (NaN never)
            np.fmin(res, prev, out=row[2])  # NaN never becomes the lowest
            np.subtract(res, row[2], out=row[3])
            _amax(row, 1, out=st)
        if self.batch_rule:
            self._rule_summary_host(k, st, better)
        if self.check_every is None:  # the CPU reads every step: now, with no queue
            self._read_host(k, z, st.tolist())
            return
        if self.lowest and k > 0:
            self.pending.append((k, z))
        self.k = k + 1
        self.bounds.append(self.k)

    def _read_host(self, k: int, z: Tensor, row: list[float]) -> None:
        """What :meth:`stop` reads of step k (:meth:`_consume`), read as the step is recorded
        on the host path: the step's iterate becomes the returned one where it is lowest
        (:meth:`_resolve`) and the stop test runs on the step's summary ``row``."""
        cur_abs, cur = row[0], row[self.sel]
        if self.lowest and k > 0:
            best, allbetter = row[2], row[3] <= 0
            self._take_lowest(k, z, allbetter)
        else:  # under a batch stop rule row 2 holds its value in either mode
            best, allbetter = (row[2] if self.lowest or self.batch_rule else cur), True
        self.cur_hist.append(cur)
        self.best_hist.append(best)
        self.last_allbetter = allbetter
        self.k = self.read = k + 1
        self.bounds.append(self.k)
        if self.status is None:
            self._judge(k, cur_abs, cur, best)

    def _rule_summary_host(self, k: int, st: Any, better: Any) -> None:
        """:meth:`_rule_summary` of :meth:`_record_host`: the same values, the batch
        reductions in torch (their summation order), the selections in numpy."""
        if not self.keep_norm:
            ret = self.trace[k, 2 if self.lowest else self.sel]
            if self.rule == "batch_mean":
                st[2] = float(torch.mean(ret))
            else:  # batch_fro under abs: ||abs||_2 of the returned iterates
                st[2] = float(torch.linalg.vector_norm(ret))
            return
        if better is None:  # (abs, ||f(x)||) of this step's iterates, kept for every sample
            self._fn[...] = self._an
        else:
            np.copyto(self._fn, self._an, where=better)
        torch.linalg.vector_norm(cast(Tensor, self.fro), dim=1, out=self._nn_t)
        n0, n1 = self._nn  # scalars of the trace's dtype: the division in it
        st[2] = n0 / (n1 + self._eps)

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
                # the device loop's stop test (device_judge): stop flag, first abs residual,
                # the loop predicate, and the step count read back at the end
                "halt": torch.zeros((), dtype=torch.bool, device=dev),
                "abs0": torch.zeros((), dtype=torch.float64, device=dev),
                "go": torch.zeros((), dtype=torch.bool, device=dev),
                "k_host": torch.zeros(1, dtype=torch.long, pin_memory=self.cuda),
            }
        if self.keep_norm and "fro" not in bufs:
            bufs["fro"] = torch.empty(2, self.B, dtype=rdtype, device=dev)
        bufs["low"].fill_(math.inf)
        bufs["k"].zero_()
        bufs["halt"].zero_()
        bufs["best"].copy_(z0)
        self.device_mode = True
        self.trace, self.dstats, self.hstats = bufs["trace"], bufs["dstats"], bufs["hstats"]
        self.dev_row, self.dev_st, self.dev_low = bufs["row"], bufs["st"], bufs["low"]
        self.dev_k, self.dev_nf, self.best_z = bufs["k"], bufs["nf"], bufs["best"]
        self.dev_part, self.dev_flag = bufs["part"], bufs["flag"]
        self.fro = bufs.get("fro")
        self.dev_halt, self.dev_abs0, self.dev_go = bufs["halt"], bufs["abs0"], bufs["go"]
        self.k_host = bufs["k_host"]
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

    # -- the device loop (graph_steps="loop"): the stop test on the device ------------------
    def device_judge(self) -> None:
        """The stop test of the step :meth:`device_record` just made, on the device (capturable):
        its summary is kept in ``dstats`` at its step, and ``dev_halt`` is set where the host's
        test (:meth:`_judge`) would stop there: a non-finite or blown-up residual, the stop
        rule's value below tol, or stagnation. The comparisons are made in float64 with the
        host's constants, so the device stops at the step the host would."""
        st = self.dev_st[self.dev_j]
        k = self.dev_k  # steps made, this one included
        self.dstats.index_copy_(0, k - 1, st.unsqueeze(0))
        s = st.double()
        cur_abs, cur = s[0], s[self.sel]
        best = s[2] if self.lowest or self.batch_rule else cur
        first = k[0] == 1
        torch.where(first, cur_abs, self.dev_abs0, out=self.dev_abs0)
        a0 = self.dev_abs0
        bad = ~(torch.isfinite(cur_abs) & torch.isfinite(cur))
        bad |= (a0 != 0) & (cur_abs > self.protect * a0)
        halt = bad | (best < self.tol)
        if self.stagnation is not None:
            window, ratio, factor = self.stagnation
            idx = (k - window + torch.arange(window, device=k.device)).clamp_(min=0)
            recent = self.dstats.index_select(0, idx)[:, self.sel].double()
            lo, hi = recent.amin(), recent.amax()
            halt |= (k[0] > window) & (best < factor * self.tol) & (lo > 0) & (hi < ratio * lo)
        self.dev_halt |= halt

    def device_go(self, limit: int) -> Tensor:
        """The device loop's predicate (capturable): no stop yet and fewer than ``limit``
        steps made; written into one static boolean."""
        torch.logical_and(~self.dev_halt, self.dev_k[0] < limit, out=self.dev_go)
        return self.dev_go

    def device_loop_read(self, start: int) -> int:
        """After a replay of the device loop: copy the summaries of the steps it made (from
        step ``start`` on) and the step count to pinned memory, wait once, and make them the
        steps the host has recorded. Returns the steps made in all."""
        n = self.n
        if self.cuda:
            self.hstats[start:n].copy_(self.dstats[start:n], non_blocking=True)
            self.k_host.copy_(self.dev_k, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
            ev.synchronize()
            k = int(self.k_host[0])
            if k > start:
                self.events[k - 1] = ev
        else:
            k = int(self.dev_k[0])
        if k > self.k:
            self.k = k
            self.bounds.append(k)
        self._consume(k)
        return k

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
        if self.host and self.check_every is None:  # read as it was recorded
            return self.status is not None
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
        self._take_lowest(j, z, allbetter)

    def _take_lowest(self, j: int, z: Tensor, allbetter: bool) -> None:
        """Step j's iterate ``z`` becomes the returned one for every sample where it is lowest."""
        if allbetter:
            self.best_z = z
            return
        if self.host:
            take = torch.from_numpy(self._tn[j, self.sel] == self._tn[j, 2]).view(self.bshape)
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
        rows = (self._dn if self.host else self.hstats)[self.read : upto].tolist()
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
            if self.status is None:
                self._judge(j, cur_abs, cur, best)
        self.read = upto

    def _judge(self, j: int, cur_abs: float, cur: float, best: float) -> None:
        """The stop test of step j: diverged, converged, stagnated or on."""
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

    def _stagnated(self, best: float) -> bool:
        window, ratio, factor = self.stagnation  # type: ignore[misc]
        h = self.cur_hist
        if len(h) <= window or best >= factor * self.tol:
            return False
        recent = h[-window:]
        lo = min(recent)
        return lo > 0 and max(recent) / lo < ratio

    # -- end --------------------------------------------------------------------------------
    def _returned_host(self, k: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, int]:
        """:meth:`finish`'s tensors on the host path, as the torch code builds them, from the
        numpy buffers: the (abs, rel) traces, the returned iterates' (abs, rel), the step each
        sample's returned iterate comes from and the latest of them."""
        tk, B = self._tn[:k], self.B
        if self.lowest and not self.last_allbetter:
            match = tk[:, self.sel] == tk[:, 2]  # the last step matching the running lowest
            steps = np.where(match, np.arange(k)[:, None], 0).max(0)
            best = tk[steps, :2, np.arange(B)]  # (B, 2)
            lowest_step = int(steps.max())
            best_abs, best_rel = torch.from_numpy(best[:, 0]), torch.from_numpy(best[:, 1])
        else:  # every sample's returned iterate is the last one
            steps = np.full(B, k - 1, dtype=np.int64)
            lowest_step = k - 1
            best_abs, best_rel = torch.from_numpy(tk[k - 1, 0]), torch.from_numpy(tk[k - 1, 1])
        return (torch.from_numpy(tk[:, 0]), torch.from_numpy(tk[:, 1]), best_abs, best_rel,
                torch.from_numpy(steps), lowest_step)  # fmt: skip

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
        if self.host:
            abs_tr, rel_tr, best_abs, best_rel, lowest_steps, lowest_step = self._returned_host(k)
        elif self.lowest and not self.last_allbetter:
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
        if not self.host:
            abs_tr, rel_tr, best_abs, best_rel = trace[:, 0], trace[:, 1], best[0], best[1]
        top = self.best_hist[-1]  # the returned residuals under the stop rule (stop mode)
        info = {"returned": "x", "lowest_steps": lowest_steps, "host_reads_exact": self.exact_reads}
        if self.conv_at is not None and self.conv_at < k:
            info["nstep_to_tol"] = self.conv_at  # steps past it came from checking per chunk
        info.update(extra or {})
        stats = make_stats(
            self.solver,
            nstep,
            abs_tr,
            rel_tr,
            best_abs,
            best_rel,
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
