"""Fused bookkeeping kernels (Triton) for the solvers' static steps (the CUDA-graph path).

On a small, launch-bound cell a captured solver step is dominated by its bookkeeping: the
residual norms, the per-sample lowest iterate, the trace row, the batch summary for the host
and the ring-buffer writes are ~13 small kernels per step in plain torch, each costing a few
microseconds even inside a CUDA graph, against ~50 us for f itself on the fc1024 cell. The
kernels here do the same arithmetic in fewer launches:

* :func:`record` (two kernels; three for states of more than SPLIT_MIN elements a sample,
  split over several programs each): one program per sample computes ``||f(x) - x||`` and
  ``||f(x)||``, the relative residual, the running lowest residual and the trace row, copies x
  into the lowest-iterate buffer where it improved, and optionally writes f(x) into the iterate
  (fixed point) or f(x) and f(x) - x into Anderson's ring slot; one program reduces the row to
  the batch summary the host reads and advances the step counter.
* :func:`anderson_weights` (one kernel): the regularised m x m least-squares system per sample,
  solved in float64 by Gauss-Jordan elimination (the matrix is symmetric positive definite), the
  normalised weights, and the one-hot fallback for a sample whose solve is not finite.
* :func:`broyden_update` (three kernels): Broyden's static step without a line search (the
  update from the last evaluation and the next point), ~60 small torch kernels a step
  otherwise: the pieces' partial products of the pair buffer's rows with g+ and dx, then per
  sample the coefficients and decisions from them (skip count, pair count, restart count),
  then per (sample, piece) B g+, the new pair [u, v], the next step dx and x + dx.

They replace the torch code of :meth:`~deqbench.solvers.base.Tracker.device_record` and
Anderson's static step exactly up to rounding (sum order of the norms); the torch code stays
the reference and runs wherever these do not (CPU, no Triton, ``DEQBENCH_FUSED=0``, a Broyden
line search, a stop rule other than ``sample_max``: the record kernels reduce the batch to its
max only, and :func:`record` / :func:`record_eager` refuse a tracker under another rule,
:func:`check_stop_rule`). Tests run
them on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``) against the torch code, and
on the GPU machine in ``gpu``-marked tests.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..core.triton_env import ENABLED_BY_ENV, kernel_device, tl, triton
from ..core.triton_env import INTERPRET as INTERPRET  # re-exported (tests read it here)

#: switch the fused kernels off (``DEQBENCH_FUSED=0``, or set this) to compare with torch code
ENABLED = ENABLED_BY_ENV
#: a sample's state longer than this is split over several programs of CHUNK elements (three
#: launches: partial sums, per-sample decisions, copies) so that large states (conv64: 128
#: samples of 65536) keep every SM streaming; shorter ones take one program per sample (two)
SPLIT_MIN = 1 << 14
CHUNK = 1 << 13
#: Broyden: a chunk of the pair buffer longer than this is split over several programs, each
#: reading its piece of every row in one load (one row at a time streamed at 3.0-3.8
#: TB/s on an H200 with 8 warps and the row loop unrolled 4 times, against 2.2-3.4 for 2-D
#: tiles of rows x columns; ``benchmarks/broyden_kernel_probe.py``)
BROYDEN_PIECE = 1 << 12
#: warps per program of the Broyden kernels, and rows per unrolled iteration of their loops
BROYDEN_WARPS = 8
BROYDEN_UNROLL = 4
DTYPES = (torch.float32, torch.float64)


def splits(numel: int) -> int:
    """Programs per sample for a per-sample state of ``numel`` elements."""
    return 1 if numel <= SPLIT_MIN else -(-numel // CHUNK)


def usable(*ts: Tensor) -> bool:
    """Whether the fused kernels can run on these (same-device, same-dtype) tensors."""
    if not ENABLED:
        return False
    t = ts[0]
    if not kernel_device(t.device) or t.dtype not in DTYPES or t.dim() == 0:
        return False
    return all(x.is_contiguous() and x.dtype == t.dtype and x.device == t.device for x in ts)


#: the stop rules the record kernels honour (their batch summary is the batch max)
STOP_RULES = ("sample_max",)


def check_stop_rule(tracker: Any) -> None:
    """A SolverOptionError (one line, naming the rule, the solver and this path) unless the
    record kernels honour the tracker's stop rule (``solvers.base.STOP_RULES``; these compute
    ``sample_max`` only: the tracker runs its torch code under another rule). The tracker
    raises it (:meth:`~deqbench.solvers.base.Tracker.check_fused`)."""
    tracker.check_fused(STOP_RULES)


def tracker_usable(
    tracker: Any, z: Tensor, fz: Tensor, slots: tuple[Tensor, Tensor, int, int] | None = None
) -> bool:
    """Whether :func:`record` can serve this tracker's :meth:`device_record` for (z, f(z))
    (and the ring buffers ``slots``): not under a stop rule the kernels do not honour."""
    ring = () if slots is None else slots[:2]
    return (
        tracker.device_mode
        and not getattr(tracker, "batch_rule", False)
        and z.shape == fz.shape
        and tracker.best_z is not None
        and usable(z, fz, tracker.best_z, tracker.trace, *ring)
    )


def _block(n: int, lo: int = 128, hi: int = 2048) -> int:
    return max(lo, min(hi, 1 << max(0, (int(n) - 1).bit_length())))


if triton is not None:

    @triton.jit
    def _steps(k_ptr, kh, HOSTK: tl.constexpr):
        """The step counter: the device counter at ``k_ptr`` (captured steps), or the host's
        ``kh`` (``HOSTK``: the eager path)."""
        if HOSTK:
            return kh
        else:
            return tl.load(k_ptr)

    @triton.jit
    def _sums(z_ptr, fz_ptr, F_ptr, G_ptr, i, lo, n, D, m, cd, slot, SLOTS: tl.constexpr,
              BLOCK: tl.constexpr):  # fmt: skip
        """Sums of (f(x) - x)^2 and f(x)^2 over elements [lo, lo + n) of sample i, writing f(x)
        and f(x) - x to the ring buffers (B, nc, m, cd) at ``slot`` (``SLOTS``) on the way."""
        base = i * D
        acc_d = tl.zeros([BLOCK], dtype=z_ptr.dtype.element_ty)
        acc_f = tl.zeros_like(acc_d)
        nc = D // cd
        for off in range(0, n, BLOCK):
            idx = lo + off + tl.arange(0, BLOCK)
            msk = (idx < D) & (off + tl.arange(0, BLOCK) < n)
            x = tl.load(z_ptr + base + idx, mask=msk, other=0.0)
            fx = tl.load(fz_ptr + base + idx, mask=msk, other=0.0)
            d = fx - x
            acc_d += d * d
            acc_f += fx * fx
            if SLOTS:  # chunk c = idx // cd, element idx % cd
                c = idx // cd
                o = ((i * nc + c) * m + slot) * cd + (idx - c * cd)
                tl.store(F_ptr + o, fx, mask=msk)
                tl.store(G_ptr + o, d, mask=msk)
        return tl.sum(acc_d, axis=0), tl.sum(acc_f, axis=0)

    @triton.jit
    def _copies(z_ptr, fz_ptr, best_ptr, out_ptr, i, lo, n, D, better, LOWEST: tl.constexpr,
                COPY: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        """Elements [lo, lo + n) of sample i: x into the lowest-iterate buffer (where
        ``better``, or always unless ``LOWEST``), then f(x) into ``out`` (``COPY``; out may
        be x itself: read before written)."""
        base = i * D
        # as a block (Triton's interpreter cannot combine a scalar mask with a block one)
        take = (tl.zeros([BLOCK], dtype=tl.int32) + better.to(tl.int32)) != 0
        for off in range(0, n, BLOCK):
            idx = lo + off + tl.arange(0, BLOCK)
            msk = (idx < D) & (off + tl.arange(0, BLOCK) < n)
            x = tl.load(z_ptr + base + idx, mask=msk)
            if LOWEST:
                tl.store(best_ptr + base + idx, x, mask=msk & take)
            else:
                tl.store(best_ptr + base + idx, x, mask=msk)
            if COPY:
                tl.store(out_ptr + base + idx, tl.load(fz_ptr + base + idx, mask=msk), mask=msk)

    @triton.jit(do_not_specialize=["kh"])  # a new value must not recompile
    def _record_kernel(
        z_ptr, fz_ptr, best_ptr, out_ptr, F_ptr, G_ptr, trace_ptr, low_ptr, k_ptr, kh, D, B, m,
        cd, eps, SEL: tl.constexpr, LOWEST: tl.constexpr, COPY: tl.constexpr,
        SLOTS: tl.constexpr, HOSTK: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """One program per sample: residuals, lowest-residual decision, trace row, copies.

        ``HOSTK`` (the eager tracker): the step is ``kh``, the running lowest is read from
        ``low_ptr`` (the previous trace row) and not written back, no lowest-iterate copy."""
        i = tl.program_id(0).to(tl.int64)
        k = _steps(k_ptr, kh, HOSTK)
        sd, sf = _sums(z_ptr, fz_ptr, F_ptr, G_ptr, i, 0, D, D, m, cd, k % m, SLOTS, BLOCK)
        a = tl.sqrt(sd)
        r = a / (tl.sqrt(sf) + eps)
        row = trace_ptr + k * 4 * B + i
        tl.store(row, a)
        tl.store(row + B, r)
        better = a == a  # unused without LOWEST
        if LOWEST:
            res = r if SEL == 1 else a
            lo = tl.load(low_ptr + i)
            better = res <= lo  # NaN never
            new = tl.where(better, res, lo)
            if not HOSTK:
                tl.store(low_ptr + i, new)
            tl.store(row + 2 * B, new)
            tl.store(row + 3 * B, res - new)
        if not HOSTK:  # second pass over the sample (from L2 on small cells)
            _copies(z_ptr, fz_ptr, best_ptr, out_ptr, i, 0, D, D, better, LOWEST, COPY, BLOCK)

    @triton.jit(do_not_specialize=["kh"])  # a new value must not recompile
    def _partial_kernel(
        z_ptr, fz_ptr, F_ptr, G_ptr, part_ptr, k_ptr, kh, D, m, cd, CH,
        SLOTS: tl.constexpr, HOSTK: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """Programs (sample, chunk of CH elements): the partial sums of a split sample."""
        i = tl.program_id(0).to(tl.int64)
        sp = tl.program_id(1)
        slot = _steps(k_ptr, kh, HOSTK) % m
        lo = sp.to(tl.int64) * CH
        sd, sf = _sums(z_ptr, fz_ptr, F_ptr, G_ptr, i, lo, CH, D, m, cd, slot, SLOTS, BLOCK)
        p = part_ptr + (i * tl.num_programs(1) + sp) * 2
        tl.store(p, sd)
        tl.store(p + 1, sf)

    @triton.jit(do_not_specialize=["kh", "j"])  # a new value must not recompile
    def _decide_kernel(
        part_ptr, trace_ptr, low_ptr, flag_ptr, st_ptr, k_ptr, kh, B, S, j, eps,
        SEL: tl.constexpr, LOWEST: tl.constexpr, HOSTK: tl.constexpr, BLOCK: tl.constexpr,
        SP: tl.constexpr,
    ):  # fmt: skip
        """Per sample: the residuals from the partial sums, the lowest-residual decision (flag),
        the trace row; then the batch summary and the step counter (one program). ``HOSTK``:
        as in ``_record_kernel`` (no flag, no counter)."""
        k = _steps(k_ptr, kh, HOSTK)
        row = trace_ptr + k * 4 * B
        cols = tl.arange(0, SP)
        dt = trace_ptr.dtype.element_ty
        m0 = tl.full([BLOCK], float("-inf"), dtype=dt)
        m1, m2, m3 = m0, m0, m0
        nan = tl.zeros([BLOCK], dtype=tl.int32)
        nan1, nan3 = nan, nan
        for off in range(0, B, BLOCK):
            ids = off + tl.arange(0, BLOCK)
            ok = ids < B
            pm = ok[:, None] & (cols[None, :] < S)
            pp = part_ptr + (ids[:, None].to(tl.int64) * S + cols[None, :]) * 2
            a = tl.sqrt(tl.sum(tl.load(pp, mask=pm, other=0.0), axis=1))
            r = a / (tl.sqrt(tl.sum(tl.load(pp + 1, mask=pm, other=0.0), axis=1)) + eps)
            tl.store(row + ids, a, mask=ok)
            tl.store(row + B + ids, r, mask=ok)
            nan += ((a != a) & ok).to(tl.int32)
            nan1 += ((r != r) & ok).to(tl.int32)  # inf / inf: r NaN where a is not
            m0 = tl.maximum(m0, tl.where(ok & (a == a), a, float("-inf")))
            m1 = tl.maximum(m1, tl.where(ok & (r == r), r, float("-inf")))
            if LOWEST:
                res = r if SEL == 1 else a
                lo = tl.load(low_ptr + ids, mask=ok, other=0.0)
                better = res <= lo
                new = tl.where(better, res, lo)
                if not HOSTK:
                    tl.store(low_ptr + ids, new, mask=ok)
                    tl.store(flag_ptr + ids, better.to(tl.int32), mask=ok)
                tl.store(row + 2 * B + ids, new, mask=ok)
                tl.store(row + 3 * B + ids, res - new, mask=ok)
                m2 = tl.maximum(m2, tl.where(ok, new, float("-inf")))
                d3 = res - new
                nan3 += ((d3 != d3) & ok).to(tl.int32)
                m3 = tl.maximum(m3, tl.where(ok & (d3 == d3), d3, float("-inf")))
        # a NaN in a row makes its summary NaN, as amax gives (per row, as _summary_kernel)
        isnan = tl.sum(nan, axis=0) > 0
        tl.store(st_ptr + j * 4, tl.where(isnan, float("nan"), tl.max(m0, axis=0)))
        isnan1 = tl.sum(nan1, axis=0) > 0
        tl.store(st_ptr + j * 4 + 1, tl.where(isnan1, float("nan"), tl.max(m1, axis=0)))
        if LOWEST:
            tl.store(st_ptr + j * 4 + 2, tl.max(m2, axis=0))
            isnan3 = tl.sum(nan3, axis=0) > 0
            tl.store(st_ptr + j * 4 + 3, tl.where(isnan3, float("nan"), tl.max(m3, axis=0)))
        if not HOSTK:
            tl.store(k_ptr, k + 1)

    @triton.jit
    def _copy_kernel(
        z_ptr, fz_ptr, best_ptr, out_ptr, flag_ptr, D, CH,
        LOWEST: tl.constexpr, COPY: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """Programs (sample, chunk): the copies of a split sample, by its decision flag."""
        i = tl.program_id(0).to(tl.int64)
        lo = tl.program_id(1).to(tl.int64) * CH
        better = tl.load(flag_ptr + i) != 0
        _copies(z_ptr, fz_ptr, best_ptr, out_ptr, i, lo, CH, D, better, LOWEST, COPY, BLOCK)

    @triton.jit(do_not_specialize=["kh", "j"])  # a new value must not recompile
    def _summary_kernel(trace_ptr, st_ptr, k_ptr, kh, B, j, ROWS: tl.constexpr,
                        HOSTK: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        k = _steps(k_ptr, kh, HOSTK)
        for q in tl.static_range(ROWS):
            row = trace_ptr + k * 4 * B + q * B
            mx = tl.full([BLOCK], float("-inf"), dtype=trace_ptr.dtype.element_ty)
            nan = tl.zeros([BLOCK], dtype=tl.int32)
            for off in range(0, B, BLOCK):
                idx = off + tl.arange(0, BLOCK)
                v = tl.load(row + idx, mask=idx < B, other=float("-inf"))
                nan += (v != v).to(tl.int32)
                mx = tl.maximum(mx, tl.where(v != v, float("-inf"), v))
            top = tl.max(mx, axis=0)
            top = tl.where(tl.sum(nan, axis=0) > 0, float("nan"), top)  # amax propagates NaN
            tl.store(st_ptr + j * 4 + q, top)
        if not HOSTK:
            tl.store(k_ptr, k + 1)

    @triton.jit(do_not_specialize=["kh"])  # a new value must not recompile
    def _anderson_weights_kernel(
        H_ptr, alpha_ptr, fb_ptr, k_ptr, row_ptr, kh, nc, m, lam, lam_abs, M: tl.constexpr,
        HOSTK: tl.constexpr, ROW: tl.constexpr,
    ):  # fmt: skip
        """One program per sample. ``ROW``: H is the persistent float64 G G^T (B, m, m), whose
        row and column of the newest slot are first set from the partial products row_ptr
        (B, nc, M) of :func:`anderson_row` (and stored); else H holds the chunks' partial Gram
        matrices (B * nc, m, m), summed here."""
        i = tl.program_id(0).to(tl.int64)
        it = _steps(k_ptr, kh, HOSTK)  # evaluations made, this step's included
        slot = (it - 1) % m
        r = tl.arange(0, M)
        eye = r[:, None] == r[None, :]
        inside = (r[:, None] < m) & (r[None, :] < m)
        if ROW:
            new = tl.zeros([M], dtype=tl.float64)
            for q in range(nc):  # the pieces' partial products with the newest slot
                new += tl.load(row_ptr + (i * nc + q) * M + r).to(tl.float64)
            p = H_ptr + i * m * m + r[:, None] * m + r[None, :]
            H = tl.load(p, mask=inside, other=0.0)
            H = tl.where(r[:, None] == slot, new[None, :], H)
            H = tl.where(r[None, :] == slot, new[:, None], H)
            tl.store(p, H, mask=inside)
        else:
            H = tl.zeros([M, M], dtype=tl.float64)
            for q in range(nc):  # the chunks' partial Gram matrices
                p = H_ptr + (i * nc + q) * m * m + r[:, None] * m + r[None, :]
                H += tl.load(p, mask=inside, other=0.0).to(tl.float64)
        dg = tl.sum(tl.where(eye, H, 0.0), axis=1)
        reg = tl.max(tl.where(r < m, dg, float("-inf")), axis=0) * lam + lam_abs
        add = tl.where(r >= it, 1e30, reg)  # slots not written yet: weight ~ 0
        add = tl.where(r >= m, 1.0, add)  # padding: identity rows
        H += tl.where(eye, add[:, None], 0.0)
        b = tl.where(r < m, 1.0, 0.0).to(tl.float64)
        for p in tl.static_range(M):  # Gauss-Jordan, no pivoting (H is SPD)
            prow = tl.sum(tl.where(r[:, None] == p, H, 0.0), axis=0)
            piv = tl.sum(tl.where(r == p, prow, 0.0), axis=0)
            pb = tl.sum(tl.where(r == p, b, 0.0), axis=0)
            col = tl.sum(tl.where(r[None, :] == p, H, 0.0), axis=1)
            fac = tl.where(r == p, 0.0, col / piv)
            H -= fac[:, None] * prow[None, :]
            b -= fac * pb
        w = b / tl.sum(tl.where(eye, H, 0.0), axis=1)
        w = tl.where(r < m, w, 0.0)
        alpha = w / tl.sum(w, axis=0)
        s = tl.sum(tl.where(r < m, alpha, 0.0), axis=0)
        bad = (s != s) | (tl.abs(s) == float("inf"))
        alpha = tl.where(bad, tl.where(r == slot, 1.0, 0.0), alpha)
        tl.store(alpha_ptr + i * m + r, alpha.to(alpha_ptr.dtype.element_ty), mask=r < m)
        if bad:
            tl.store(fb_ptr + i, tl.load(fb_ptr + i) + 1)

    @triton.jit(do_not_specialize=["kh"])
    def _anderson_row_kernel(
        G_ptr, row_ptr, k_ptr, kh, m, cd, L, HOSTK: tl.constexpr, M: tl.constexpr,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        """Programs (sample chunk, piece of L elements) over the ring buffer G (B * nc, m, cd):
        partial products of the slots in use with the newest one into row_ptr (B * nc, K, M)."""
        bc = tl.program_id(0).to(tl.int64)
        p = tl.program_id(1).to(tl.int64)
        it = _steps(k_ptr, kh, HOSTK)
        s = (it - 1) % m
        n = tl.minimum(it, m)
        r = tl.arange(0, M)
        rm = r < n
        base = bc * m * cd
        lo = p * L
        acc = tl.zeros([M], dtype=G_ptr.dtype.element_ty)
        for off in range(0, L, BLOCK):
            kk = lo + off + tl.arange(0, BLOCK)
            km = (kk < cd) & (off + tl.arange(0, BLOCK) < L)
            g = tl.load(G_ptr + base + s * cd + kk, mask=km, other=0.0)
            t = tl.load(G_ptr + base + r[:, None] * cd + kk[None, :],
                        mask=rm[:, None] & km[None, :], other=0.0)  # fmt: skip
            acc += tl.sum(t * g[None, :], axis=1)
        tl.store(row_ptr + (bc * tl.num_programs(1) + p) * M + r, acc)

    @triton.jit(do_not_specialize=["kh"])
    def _anderson_mix_kernel(
        F_ptr, G_ptr, alpha_ptr, x_ptr, k_ptr, kh, nc, m, cd, L, g_hi, g_lo,
        HOSTK: tl.constexpr, DAMP: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """Programs (sample chunk, piece): x = sum_i alpha_i F_i (+ g sum_i alpha_i G_i,
        ``DAMP``) over the slots in use, written into x (B * nc, cd). Triton passes float
        scalars as float32, so g comes as g_hi + g_lo (two float32s, ~48 bits)."""
        bc = tl.program_id(0).to(tl.int64)
        p = tl.program_id(1).to(tl.int64)
        it = _steps(k_ptr, kh, HOSTK)
        n = tl.minimum(it, m)
        b = bc // nc
        base = bc * m * cd
        lo = p * L
        dt = F_ptr.dtype.element_ty
        g = (tl.zeros([BLOCK], dtype=dt) + g_hi) + g_lo  # in dt: the two parts add exactly
        for off in range(0, L, BLOCK):
            kk = lo + off + tl.arange(0, BLOCK)
            km = (kk < cd) & (off + tl.arange(0, BLOCK) < L)
            acc = tl.zeros([BLOCK], dtype=dt)
            for i in range(n):
                a = tl.load(alpha_ptr + b * m + i)
                acc += a * tl.load(F_ptr + base + i * cd + kk, mask=km, other=0.0)
                if DAMP:
                    acc += (g * a) * tl.load(G_ptr + base + i * cd + kk, mask=km, other=0.0)
            tl.store(x_ptr + bc * cd + kk, acc, mask=km)

    @triton.jit
    def _broyden_products_kernel(
        A_ptr, gx_ptr, part_ptr, cnt_ptr, snap_ptr, R, rp, cd, L, K,
        RESTART: tl.constexpr, BLOCK: tl.constexpr, UNROLL: tl.constexpr,
    ):  # fmt: skip
        """Programs (sample, piece of a chunk), one row at a time: the piece's products of rows
        r < rp of the pair buffer A (B, nc, R, cd) with g+ (row 0) and dx (row 1), and dx . gx
        (``RESTART``), into part (B, nc K, R + 1, 2); program (0, 0) snapshots the counters
        [it, npairs, nrestarts]. Each row is one contiguous load of the piece (BLOCK >= L)."""
        b = tl.program_id(0).to(tl.int64)
        p = tl.program_id(1).to(tl.int64)
        S = tl.num_programs(1)
        c = p // K
        lo = (p - c * K) * L
        ch = b * (S // K) + c  # (sample, chunk)
        base = ch * R * cd
        j = tl.arange(0, BLOCK)
        k = lo + j
        km = (j < L) & (k < cd)
        g = tl.load(A_ptr + base + k, mask=km, other=0.0)
        dx = tl.load(A_ptr + base + cd + k, mask=km, other=0.0)
        q = part_ptr + (b * S + p) * (R + 1) * 2
        for r in tl.range(0, rp, loop_unroll_factor=UNROLL):
            t = tl.load(A_ptr + base + r * cd + k, mask=km, other=0.0)
            tl.store(q + r * 2, tl.sum(t * g, axis=0))
            tl.store(q + r * 2 + 1, tl.sum(t * dx, axis=0))
        if RESTART:
            tl.store(
                q + R * 2, tl.sum(dx * tl.load(gx_ptr + ch * cd + k, mask=km, other=0.0), axis=0)
            )
        if (b == 0) & (p == 0):
            i = tl.arange(0, 4)
            tl.store(snap_ptr + i, tl.load(cnt_ptr + i, mask=i < 3), mask=i < 3)

    @triton.jit
    def _broyden_coef_kernel(
        part_ptr, snap_ptr, cnt_ptr, skip_ptr, coef_ptr, R, rp, S, cap, tiny,
        RESTART: tl.constexpr, RP: tl.constexpr,
    ):  # fmt: skip
        """One program per sample: its coefficients and decisions from the partial products
        (the rows' weights in B g+ and in v, then 1 / den, the step's scale a, and on a restart
        ri and ce) into coef (B, 2 R + 4); counts skipped updates and advances the counters."""
        b = tl.program_id(0).to(tl.int64)
        dt = coef_ptr.dtype.element_ty
        it = tl.load(snap_ptr)
        npairs = tl.load(snap_ptr + 1)
        upd = it >= 2  # whether an update is made (counted)
        if RESTART:
            rs = npairs >= cap  # B = -I again, then this step's update of it
            eff = tl.where(rs, 0, npairs)
        else:
            rs = npairs < 0
            eff = tl.minimum(npairs, cap)
        # -- the sample's products: P[r, 1] (rows . dx), P[r + 1, 0], P[r - 1, 1], dx . gx ----
        rr = tl.arange(0, RP)
        Pd = tl.zeros([RP], dtype=dt)
        Pn = tl.zeros([RP], dtype=dt)
        Pp = tl.zeros([RP], dtype=dt)
        Px = tl.zeros([RP], dtype=dt)
        for j in range(S):
            q = part_ptr + (b * S + j) * (R + 1) * 2
            Pd += tl.load(q + rr * 2 + 1, mask=rr < rp, other=0.0)
            Pn += tl.load(q + (rr + 1) * 2, mask=rr + 1 < rp, other=0.0)
            Pp += tl.load(q + (rr - 1) * 2 + 1, mask=(rr >= 1) & (rr - 1 < rp), other=0.0)
            if RESTART:
                Px += tl.load(q + R * 2 + rr, mask=rr < 1, other=0.0)
        # coefficients of rows r: B g+ = -g+ + sum_j (v_j.g+) u_j, v = -dx + sum_j (u_j.dx) v_j
        # over the pairs in use (zero for the others: they still meet their rows, as in bmm)
        use0 = (rr >= 2) & (rr % 2 == 0) & (rr < rp) & ((rr - 2) // 2 < eff)
        use1 = (rr >= 3) & (rr % 2 == 1) & (rr < rp) & ((rr - 3) // 2 < eff)
        c0 = tl.where(rr == 0, -1.0, tl.where(use0, Pn, 0.0)).to(dt)
        c1 = tl.where(rr == 1, -1.0, tl.where(use1, Pp, 0.0)).to(dt)
        e = tl.sum(c0 * Pd, axis=0)  # dx . B g+ (= v . g+)
        dd = tl.sum(tl.where(rr == 1, Pd, 0.0), axis=0)  # dx . dx
        den = e + dd  # v . dg with r = -dx
        ref = dd
        if RESTART:  # r = -g: v . dg = e + dx . gx
            dxg = tl.sum(Px, axis=0)
            den = tl.where(rs, e + dxg, den)
            ref = tl.where(rs, tl.abs(dxg), dd)
        inv = 1.0 / den
        ok = (inv == inv) & (tl.abs(inv) != float("inf")) & (tl.abs(den) > tiny * (tl.abs(e) + ref))
        inv = tl.where(ok, inv, 0.0)
        # next dx = -q+: -B g+ (dx.dx) / den when updated, -B g+ when skipped, -B g+ - u e on a
        # restart; u = (dx + r - B g+) / den
        a = tl.where(ok, -dd * inv, -1.0)
        ri = inv * 0.0
        ce = ri
        if RESTART:
            a = tl.where(rs, -1.0, a)
            ri = tl.where(rs, inv, 0.0)
            ce = tl.where(rs, -e, 0.0)
        tl.store(skip_ptr + b, tl.load(skip_ptr + b) + tl.where(upd & (ok == 0), 1, 0))
        if b == 0:  # the counters (the other programs read the snapshot)
            tl.store(cnt_ptr, it + 1)  # the evaluation that follows (was a torch add_)
            if RESTART:
                tl.store(cnt_ptr + 2, tl.load(snap_ptr + 2) + tl.where(rs & upd, 1, 0))
                tl.store(cnt_ptr + 1, tl.where(upd, tl.where(rs, 1, npairs + 1), npairs))
            else:
                tl.store(cnt_ptr + 1, tl.where(upd, npairs + 1, npairs))
        cb = coef_ptr + b * (2 * R + 4)
        tl.store(cb + rr, c0, mask=rr < rp)
        tl.store(cb + R + rr, c1, mask=rr < rp)
        tl.store(cb + 2 * R, (-inv).to(dt))
        tl.store(cb + 2 * R + 1, a.to(dt))
        tl.store(cb + 2 * R + 2, ri.to(dt))
        tl.store(cb + 2 * R + 3, ce.to(dt))

    @triton.jit
    def _broyden_update_kernel(
        A_ptr, x_ptr, gx_ptr, snap_ptr, coef_ptr, R, rp, cd, L, K, cap,
        RESTART: tl.constexpr, BLOCK: tl.constexpr, UNROLL: tl.constexpr,
    ):  # fmt: skip
        """Programs (sample, piece of a chunk), one row at a time with the sample's coefficients
        (``_broyden_coef_kernel``): over the piece B g+, v, u, the next dx, x + dx and gx = g+."""
        b = tl.program_id(0).to(tl.int64)
        p = tl.program_id(1).to(tl.int64)
        S = tl.num_programs(1)
        c = p // K
        lo = (p - c * K) * L
        ch = b * (S // K) + c
        base = ch * R * cd
        dt = A_ptr.dtype.element_ty
        npairs = tl.load(snap_ptr + 1)
        if RESTART:
            slot = tl.where(npairs >= cap, 0, npairs)
        else:
            slot = npairs % cap
        cb = coef_ptr + b * (2 * R + 4)
        ninv = tl.load(cb + 2 * R)
        a = tl.load(cb + 2 * R + 1)
        j = tl.arange(0, BLOCK)
        k = lo + j
        km = (j < L) & (k < cd)
        bg = tl.zeros([BLOCK], dtype=dt)
        v = tl.zeros([BLOCK], dtype=dt)
        # every row read before the new pair's rows are written (a ring slot may be one of them)
        for r in tl.range(0, rp, loop_unroll_factor=UNROLL):
            t = tl.load(A_ptr + base + r * cd + k, mask=km, other=0.0)
            bg += tl.load(cb + r) * t
            v += tl.load(cb + R + r) * t
        u = bg * ninv
        dxn = bg * a
        if RESTART:
            ri = tl.load(cb + 2 * R + 2)
            ce = tl.load(cb + 2 * R + 3)
            dx = tl.load(A_ptr + base + cd + k, mask=km, other=0.0)
            gxo = tl.load(gx_ptr + ch * cd + k, mask=km, other=0.0)
            u = u + dx * ri
            u = u - gxo * ri
            dxn = dxn + u * ce
            tl.store(gx_ptr + ch * cd + k, tl.load(A_ptr + base + k, mask=km), mask=km)
        su = base + (2 + 2 * slot) * cd
        tl.store(A_ptr + su + k, u, mask=km)
        tl.store(A_ptr + su + cd + k, v, mask=km)
        tl.store(A_ptr + base + cd + k, dxn, mask=km)
        x = tl.load(x_ptr + ch * cd + k, mask=km)
        tl.store(x_ptr + ch * cd + k, x + dxn, mask=km)


def record(
    tracker: Any,
    z: Tensor,
    fz: Tensor,
    *,
    copy_to: Tensor | None = None,
    slots: tuple[Tensor, Tensor, int, int] | None = None,
    eps: float = 1e-9,
) -> None:
    """The fused :meth:`Tracker.device_record` (two launches; three for a split state);
    ``eps`` as in the relative residual (``solvers.base.EPS``).

    ``copy_to``: write f(x) there after x was read (the fixed-point update); ``slots``: (F, G,
    m, cd) ring buffers of shape (B, nc, m, cd) that get f(x) and f(x) - x at slot ``k % m``
    (k: the tracker's step counter before this step). A tracker under a stop rule other than
    ``sample_max`` is refused (:func:`check_stop_rule`).
    """
    if tracker.batch_rule:
        tracker.check_fused(STOP_RULES)
    B = tracker.B
    D = z.numel() // B
    F = G = z
    m = cd = 1
    if slots is not None:
        F, G, m, cd = slots
    out = copy_to if copy_to is not None else z
    S = splits(D)
    if S > 1:
        part, flag = tracker.dev_part, tracker.dev_flag
        assert part is not None and part.numel() >= B * S * 2, "tracker buffers for another D"
        blk = _block(CHUNK, hi=4096)
        _partial_kernel[(B, S)](
            z, fz, F, G, part, tracker.dev_k, 0, D, m, cd, CHUNK,
            SLOTS=slots is not None, HOSTK=False, BLOCK=blk,
        )  # fmt: skip
        _decide_kernel[(1,)](
            part, tracker.trace, tracker.dev_low, flag, tracker.dev_st, tracker.dev_k, 0, B, S,
            tracker.dev_j, eps, SEL=tracker.sel, LOWEST=tracker.lowest, HOSTK=False, BLOCK=128,
            SP=max(2, 1 << (S - 1).bit_length()),
        )  # fmt: skip
        _copy_kernel[(B, S)](
            z, fz, tracker.best_z, out, flag, D, CHUNK,
            LOWEST=tracker.lowest, COPY=copy_to is not None, BLOCK=blk,
        )  # fmt: skip
        return
    _record_kernel[(B,)](
        z, fz, tracker.best_z, out, F, G, tracker.trace, tracker.dev_low, tracker.dev_k, 0, D, B,
        m, cd, eps, SEL=tracker.sel, LOWEST=tracker.lowest, COPY=copy_to is not None,
        SLOTS=slots is not None, HOSTK=False, BLOCK=_block(D, hi=4096),
        num_warps=8 if D >= 8192 else 4,
    )  # fmt: skip
    _summary_kernel[(1,)](
        tracker.trace, tracker.dev_st, tracker.dev_k, 0, B, tracker.dev_j,
        ROWS=4 if tracker.lowest else 2, HOSTK=False, BLOCK=_block(B, 128, 1024),
    )  # fmt: skip


def record_eager(
    tracker: Any,
    z: Tensor,
    fz: Tensor,
    k: int,
    *,
    slots: tuple[Tensor, Tensor, int, int] | None = None,
    eps: float = 1e-9,
) -> None:
    """The eager :meth:`Tracker.record` of step ``k`` (a host int) in two launches (three for
    a split state): the trace row ``tracker.trace[k]`` (abs, rel, running lowest read from row
    k - 1, residual minus lowest) and the batch summary ``tracker.dstats[k]``; the eager
    tracker keeps its lowest iterate by reference, so nothing is copied. ``slots``: as in
    :func:`record`, at slot ``k % m``. A tracker under a stop rule other than ``sample_max`` is
    refused (:func:`check_stop_rule`)."""
    if tracker.batch_rule:
        tracker.check_fused(STOP_RULES)
    B = tracker.B
    D = z.numel() // B
    F = G = z
    m = cd = 1
    if slots is not None:
        F, G, m, cd = slots
    trace = tracker.trace
    low = trace[k - 1, 2] if k > 0 else tracker.inf_row
    S = splits(D)
    if S > 1:
        part = tracker.eager_part(S)
        _partial_kernel[(B, S)](
            z, fz, F, G, part, part, k, D, m, cd, CHUNK,
            SLOTS=slots is not None, HOSTK=True, BLOCK=_block(CHUNK, hi=4096),
        )  # fmt: skip
        _decide_kernel[(1,)](
            part, trace, low, part, tracker.dstats, part, k, B, S, k, eps, SEL=tracker.sel,
            LOWEST=tracker.lowest, HOSTK=True, BLOCK=128, SP=max(2, 1 << (S - 1).bit_length()),
        )  # fmt: skip
        return
    _record_kernel[(B,)](
        z, fz, z, z, F, G, trace, low, low, k, D, B, m, cd, eps, SEL=tracker.sel,
        LOWEST=tracker.lowest, COPY=False, SLOTS=slots is not None, HOSTK=True,
        BLOCK=_block(D, hi=4096), num_warps=8 if D >= 8192 else 4,
    )  # fmt: skip
    _summary_kernel[(1,)](
        trace, tracker.dstats, low, k, B, k, ROWS=4 if tracker.lowest else 2, HOSTK=True,
        BLOCK=_block(B, 128, 1024),
    )  # fmt: skip


def _slots_pow2(m: int) -> int:
    return max(2, 1 << max(0, (m - 1).bit_length()))


#: elements of a chunk one program of :func:`anderson_row` / :func:`anderson_mix` covers
ANDERSON_PIECE = 1 << 13


def anderson_weights(H: Tensor, alpha: Tensor, fallbacks: Tensor, k: Tensor | int, m: int,
                     lam: float, lam_abs: float, rows: Tensor | None = None) -> None:  # fmt: skip
    """alpha (B, m) from the chunks' Gram matrices H (B * nc, m, m) of the ring buffer G, with
    the step counter ``k`` (evaluations made, this one included: a device tensor, or a host
    int on the eager path); counts fallbacks. With ``rows`` (the partial products of
    :func:`anderson_row`), H is instead the persistent float64 G G^T (B, m, m), whose newest
    row and column are set from them first."""
    B = alpha.shape[0]
    M = _slots_pow2(m)
    host = isinstance(k, int)
    kp = fallbacks if host else k
    kh = k if host else 0
    row = rows is not None
    nc = rows.numel() // (B * M) if rows is not None else H.shape[0] // B
    _anderson_weights_kernel[(B,)](
        H, alpha, fallbacks, kp, rows if rows is not None else H, kh, nc, m, lam, lam_abs,
        M=M, HOSTK=host, ROW=row,
    )  # fmt: skip


def anderson_pieces(cd: int) -> int:
    """Programs per chunk of length ``cd`` in :func:`anderson_row` and :func:`anderson_mix`."""
    return -(-cd // ANDERSON_PIECE)


def anderson_row(G: Tensor, rows: Tensor, k: Tensor | int, m: int) -> None:
    """The products of the newest slot ``(k - 1) % m`` of the ring buffer G (B, nc, m, cd) with
    every slot in use, partial per chunk and piece, into ``rows`` (B * nc * pieces * M,
    M = m rounded up to a power of two) for :func:`anderson_weights`."""
    B, nc, _, cd = G.shape
    K = anderson_pieces(cd)
    M = _slots_pow2(m)
    L = -(-cd // K)
    host = isinstance(k, int)
    _anderson_row_kernel[(B * nc, K)](
        G, rows, rows if host else k, k if host else 0, m, cd, L, HOSTK=host, M=M,
        BLOCK=max(16, min(_block(L, 16, 1024), 4096 // M)),
    )  # fmt: skip


def anderson_mix(F: Tensor, G: Tensor, alpha: Tensor, x: Tensor, k: Tensor | int, m: int,
                 beta: float) -> None:  # fmt: skip
    """x = sum_i alpha_i (F_i - (1 - beta) G_i) over the slots in use of the ring buffers
    F, G (B, nc, m, cd) with the weights alpha (B, m), written into x (B * nc * cd elements)."""
    B, nc, _, cd = F.shape
    K = anderson_pieces(cd)
    L = -(-cd // K)
    host = isinstance(k, int)
    g = beta - 1.0
    g_hi = float(torch.tensor(g, dtype=torch.float32))
    _anderson_mix_kernel[(B * nc, K)](
        F, G, alpha, x, alpha if host else k, k if host else 0, nc, m, cd, L, g_hi, g - g_hi,
        HOSTK=host, DAMP=beta != 1.0, BLOCK=_block(L, 128, 1024),
    )  # fmt: skip


def broyden_pieces(cd: int) -> int:
    """Programs per chunk of length ``cd`` in :func:`broyden_update`. (Splitting fc1024's
    1024-element chunks further, into 4 programs per sample, measured no faster on an H100:
    update + products 29 + 21 us per step against 26 + 20.)"""
    return -(-cd // BROYDEN_PIECE)


def broyden_buffers(A: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Scratch for :func:`broyden_update` on the pair buffer A (B, nc, R, cd): the partial
    products (B, nc * pieces, R + 1, 2), the counter snapshot (4,) and the per-sample
    coefficients (B, 2 R + 4)."""
    B, nc, R, cd = A.shape
    K = broyden_pieces(cd)
    part = torch.empty(B, nc * K, R + 1, 2, dtype=A.dtype, device=A.device)
    coef = torch.empty(B, 2 * R + 4, dtype=A.dtype, device=A.device)
    return part, torch.zeros(4, dtype=torch.int64, device=A.device), coef


def broyden_update(
    A: Tensor,
    x: Tensor,
    gx: Tensor | None,
    cnt: Tensor,
    skipped: Tensor,
    scratch: tuple[Tensor, Tensor, Tensor],
    pb: int,
    cap: int,
    tiny: float,
) -> None:
    """Broyden's static step without a line search (``_static_steps``' torch update followed
    by ``gx = g``) in three launches (the rows' products, each sample's coefficients, the
    rows' combinations), on the first 2 + 2 ``pb`` rows of the pair buffer
    A = [g+, dx, u_0, v_0, ...] (B, nc, R, cd).

    Writes the new pair [u, v] into the rows of its slot (also when no update is made), the
    next step into A's row 1, x (B, nc, cd) += that step, and with ``gx`` (the restart rule:
    g at the point the last step came from, (B, nc, cd)) gx = g+; counts skipped updates per
    sample in ``skipped`` (B,) and advances npairs and nrestarts in ``cnt`` = [it, npairs,
    nrestarts, ...] (int64, read on the device only), and counts the evaluation that follows
    in ``cnt[0]``. ``scratch``: :func:`broyden_buffers`.
    Without ``gx`` the pairs form a ring of ``cap`` slots.
    """
    B, nc, R, cd = A.shape
    part, snap, coef = scratch
    K = broyden_pieces(cd)
    L = -(-cd // K)
    rp = 2 + 2 * pb
    RP = max(2, 1 << (rp - 1).bit_length())
    restart = gx is not None
    g_x = gx if gx is not None else A  # not read without the restart rule
    grid = (B, nc * K)
    assert part.shape[1] == nc * K and part.shape[2] == R + 1, "scratch for another layout"
    nw = BROYDEN_WARPS
    blk = max(16, 1 << max(0, (L - 1).bit_length()))
    _broyden_products_kernel[grid](
        A, g_x, part, cnt, snap, R, rp, cd, L, K,
        RESTART=restart, BLOCK=blk, UNROLL=BROYDEN_UNROLL, num_warps=nw,
    )  # fmt: skip
    _broyden_coef_kernel[(B,)](
        part, snap, cnt, skipped, coef, R, rp, nc * K, cap, tiny, RESTART=restart, RP=RP
    )
    _broyden_update_kernel[grid](
        A, x, g_x, snap, coef, R, rp, cd, L, K, cap,
        RESTART=restart, BLOCK=blk, UNROLL=BROYDEN_UNROLL, num_warps=nw,
    )  # fmt: skip
