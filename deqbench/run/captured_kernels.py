"""The masked step's stop test in three Triton kernels (captured training steps).

A masked fixed-point step of :class:`~deqbench.run.captured_step.MaskedSolve` in torch is f
plus about two dozen kernels of bookkeeping: f(z) - z, the two per-sample norms, the stop
rule's value, a dozen one-element kernels for the counts and flags, and the select of the next
iterate. Profiled on an H200 (``pcdeq_sc``, 82 channels at batch 64; docs: Benchmarks, captured
steps) they take about as long as the cell's own kernels. Here the same test in three launches:

1. :func:`_partials` (B x P programs): per sample and chunk of ``CHUNK`` elements, the partial
   sums of (f(z) - z)^2 and f(z)^2 (written, not added atomically: the sums are the same at
   every replay);
2. :func:`_decide` (one program): per sample the abs and rel residual, the stop rule's value
   over the batch, and the masked solve's state update exactly as the torch step orders it
   (first residual, divergence, convergence, the count, the stop, the kept residuals, the
   flags), and whether the step keeps f(z) as the next iterate;
3. :func:`_select` (B x P programs): z <- f(z) where the step keeps it.

The decisions are the torch step's; the norms differ from torch's by rounding only (another
sum order), so a solve whose residual lands within rounding of its tolerance may stop one step
apart. On by default wherever Triton runs (CUDA); ``DEQBENCH_FUSED=0`` (every fused kernel) or
:data:`ENABLED` switches it off, to compare with the torch step. ``run.json`` records the
switch (``flags.fused_kernels``). Tests run the kernels on the CPU under Triton's interpreter
against the torch step, and compiled in ``gpu`` tests.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..core.triton_env import ENABLED_BY_ENV, kernel_device, tl, triton
from ..solvers.stats import EPS

#: switch the kernels off (``DEQBENCH_FUSED=0``, or set this before the solves are made)
ENABLED = ENABLED_BY_ENV
#: elements of a sample one program of the per-sample kernels covers
CHUNK = 1 << 13
BLOCK = 1024
#: the stop rules the kernels compute (``solvers.stats.rule_value``)
RULES = {"sample_max": 0, "batch_mean": 1, "batch_fro": 2}
DTYPES = (torch.float32, torch.float64)


def usable(state: Tensor, rule: str, stop_mode: str) -> bool:
    """Whether the kernels can run the masked steps of a solve on ``state`` under ``rule``."""
    return (
        ENABLED
        and kernel_device(state.device)
        and state.dtype in DTYPES
        and state.dim() >= 1
        and state.is_contiguous()
        and rule in RULES
        and stop_mode in ("rel", "abs")
        and state.shape[0] <= 4096
    )


if triton is not None:

    @triton.jit
    def _partials(z_ptr, fz_ptr, sa_ptr, sn_ptr, D, P, CH: tl.constexpr, BLK: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        p = tl.program_id(1).to(tl.int64)
        acc_a = tl.zeros([BLK], dtype=z_ptr.dtype.element_ty)
        acc_n = tl.zeros([BLK], dtype=z_ptr.dtype.element_ty)
        for off in range(0, CH, BLK):
            idx = p * CH + off + tl.arange(0, BLK)
            m = idx < D
            zv = tl.load(z_ptr + b * D + idx, mask=m, other=0.0)
            fv = tl.load(fz_ptr + b * D + idx, mask=m, other=0.0)
            d = fv - zv
            acc_a += d * d
            acc_n += fv * fv
        tl.store(sa_ptr + b * P + p, tl.sum(acc_a, 0))
        tl.store(sn_ptr + b * P + p, tl.sum(acc_n, 0))

    @triton.jit
    def _decide(
        sa_ptr, sn_ptr, consts_ptr, halt_ptr, nstep_ptr, abs0_ptr, abs_r_ptr, rel_r_ptr,
        value_ptr, conv_ptr, div_ptr, keep_ptr, P, B, max_iter,
        RULE: tl.constexpr, REL: tl.constexpr, BB: tl.constexpr,
    ):  # fmt: skip
        offs = tl.arange(0, BB)
        mb = offs < B
        a2 = tl.zeros([BB], dtype=sa_ptr.dtype.element_ty)
        n2 = tl.zeros([BB], dtype=sa_ptr.dtype.element_ty)
        for p in range(0, P):
            a2 += tl.load(sa_ptr + offs * P + p, mask=mb, other=0.0)
            n2 += tl.load(sn_ptr + offs * P + p, mask=mb, other=0.0)
        tol = tl.load(consts_ptr)
        protect = tl.load(consts_ptr + 1)
        eps = tl.load(consts_ptr + 2)
        a = tl.sqrt(a2)
        n = tl.sqrt(n2)
        r = a / (n + eps)
        if REL:
            res = r
        else:
            res = a
        if RULE == 0:
            value = tl.max(tl.where(mb, res, -float("inf")), 0)
        elif RULE == 1:
            value = tl.sum(tl.where(mb, res, 0.0), 0) / B
        else:
            num = tl.sqrt(tl.sum(tl.where(mb, a * a, 0.0), 0))
            if REL:
                value = num / (tl.sqrt(tl.sum(tl.where(mb, n * n, 0.0), 0)) + eps)
            else:
                value = num
        amax = tl.max(tl.where(mb, a, -float("inf")), 0)
        bad_a = (a != a) | (tl.abs(a) == float("inf"))
        bad_r = (r != r) | (tl.abs(r) == float("inf"))
        finite = tl.sum(tl.where(mb & (bad_a | bad_r), 1, 0), 0) == 0
        # the torch step's order: first residual, divergence, convergence, count, stop
        halt = tl.load(halt_ptr) != 0
        nstep = tl.load(nstep_ptr)
        active = halt == 0
        abs0 = tl.load(abs0_ptr)
        abs0 = tl.where(nstep == 0, amax, abs0)
        tl.store(abs0_ptr, abs0)
        div_now = (finite == 0) | ((abs0 != 0) & (amax > protect * abs0))
        conv_now = (div_now == 0) & (value < tol)
        nstep = nstep + tl.where(active, 1, 0)
        tl.store(nstep_ptr, nstep)
        stop_now = active & (div_now | conv_now | (nstep >= max_iter))
        if active:
            tl.store(abs_r_ptr + offs, a, mask=mb)
            tl.store(rel_r_ptr + offs, r, mask=mb)
            tl.store(value_ptr, value)
        conv = (tl.load(conv_ptr) != 0) | (active & conv_now)
        div = (tl.load(div_ptr) != 0) | (active & div_now)
        tl.store(conv_ptr, conv)
        tl.store(div_ptr, div)
        tl.store(keep_ptr, tl.where(active & (stop_now == 0), 1, 0))
        tl.store(halt_ptr, halt | stop_now)

    @triton.jit
    def _select(z_ptr, fz_ptr, keep_ptr, D, CH: tl.constexpr, BLK: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        p = tl.program_id(1).to(tl.int64)
        if tl.load(keep_ptr) != 0:
            for off in range(0, CH, BLK):
                idx = p * CH + off + tl.arange(0, BLK)
                m = idx < D
                tl.store(z_ptr + b * D + idx, tl.load(fz_ptr + b * D + idx, mask=m), mask=m)


class FusedTest:
    """The static buffers of one solve's fused masked steps (made with the solve, so that a
    captured graph holds their addresses)."""

    def __init__(self, state: Tensor, tol: float, protect: float, rule: str, stop_mode: str):
        B = state.shape[0]
        self.D = state[0].numel()
        self.P = -(-self.D // CHUNK)
        dt, dev = state.dtype, state.device
        self.sa = torch.zeros(B, self.P, dtype=dt, device=dev)
        self.sn = torch.zeros(B, self.P, dtype=dt, device=dev)
        self.keep = torch.zeros(1, dtype=torch.int32, device=dev)
        self.consts = torch.tensor([tol, protect, EPS], dtype=dt, device=dev)
        self.rule, self.rel = RULES[rule], stop_mode == "rel"
        self.BB = max(16, 1 << max(0, (B - 1).bit_length()))

    def step(self, s: Any, fz: Tensor) -> None:
        """One masked step of solve ``s`` (a MaskedSolve) given f at its state."""
        z = s.z
        fz = fz if fz.is_contiguous() else fz.contiguous()
        B = z.shape[0]
        _partials[(B, self.P)](z, fz, self.sa, self.sn, self.D, self.P, CH=CHUNK, BLK=BLOCK)
        _decide[(1,)](
            self.sa, self.sn, self.consts, s.halt, s.nstep, s.abs0, s.abs_r, s.rel_r, s.value,
            s.conv, s.div, self.keep, self.P, B, s.max_iter,
            RULE=self.rule, REL=self.rel, BB=self.BB,
        )  # fmt: skip
        _select[(B, self.P)](z, fz, self.keep, self.D, CH=CHUNK, BLK=BLOCK)
