"""A fused GroupNorm (Triton) with its pre-op: GroupNorm(relu(a + b)), GroupNorm(a + b),
GroupNorm(relu(a)) or GroupNorm(a) in one kernel.

The conv DEQ cell (:class:`deqbench.models.conv.ResNetCell`) is three GroupNorms, each after
an addition and/or a ReLU; in PyTorch every one of them is a statistics kernel, an apply kernel
and one or two elementwise kernels (plus casts under bf16), all memory-bound and together more
expensive than the convolutions on an H100. :func:`group_norm_act` reads the inputs once (twice
for a large slab) and writes the normalised output once, in the dtype asked for.

Kernel: one program per (sample, group). In contiguous NCHW memory the group's slab
(C/G channels x prod(spatial)) is one contiguous run of ``L = C/G * prod(spatial)`` elements.

* ``L <= FIT_MAX`` (16384; the conv64 cell: 8 x 1024 = 8192): the slab is loaded once into
  registers (a block of the next power of two), the pre-op applied in float32, the mean taken,
  then the variance as the mean of the squared deviations from it (two passes over registers,
  no cancellation), and the normalised, affine output stored.
* larger slabs: a loop over blocks of ``LOOP_BLOCK`` elements. Pass 1 computes each block's
  mean and sum of squared deviations (two passes over its registers) and merges them into the
  running (count, mean, M2) with Chan's parallel formula (numerically as safe as the two-pass
  variance); pass 2 reads the inputs again and writes the output (two passes over memory).

Arithmetic and statistics are float32 whatever the input dtypes (float32, bfloat16, float16;
``a`` and ``b`` may differ); the variance is the biased one (as GroupNorm); the affine weight and
bias are per channel, optional. The ReLU propagates NaN (as torch's does).

Where it runs: CUDA tensors with Triton importable, or CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1`` set before Triton is imported: tests); not with ``DEQBENCH_FUSED=0``,
not for float64 (that stays on the exact torch path), not for tensors inside a torch.func
transform or carrying forward-mode tangents. See :func:`usable`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..core.triton_env import ENABLED_BY_ENV, kernel_device, tl, triton
from ..core.triton_env import INTERPRET as INTERPRET  # re-exported (tests read it here)

#: switch the fused kernels off (``DEQBENCH_FUSED=0``, or set this) to compare with torch code
ENABLED = ENABLED_BY_ENV
#: a (sample, group) slab of at most this many elements is held in registers (one read);
#: larger ones are looped over in blocks of LOOP_BLOCK (two reads)
FIT_MAX = 1 << 14
LOOP_BLOCK = 1 << 12
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _wrapped(t: Tensor, dual: bool) -> bool:
    """A tensor of a torch.func transform (vmap, jvp, grad), or carrying a forward-mode tangent
    (looked for only inside a ``dual_level``: ``dual``)."""
    try:
        if torch._C._functorch.is_functorch_wrapped_tensor(t):
            return True
    except AttributeError:  # pragma: no cover - older torch
        pass
    return dual and torch.autograd.forward_ad.unpack_dual(t).tangent is not None


def usable(*ts: Tensor) -> bool:
    """Whether :func:`group_norm_act` can run on these (same-device) tensors: CUDA (or CPU under
    the interpreter), Triton importable, ``DEQBENCH_FUSED`` != "0", contiguous, float32,
    bfloat16 or float16 (dtypes may differ), plain tensors (no torch.func wrapper or tangent)."""
    if not ENABLED or not ts:
        return False
    dev = ts[0].device
    if not kernel_device(dev):
        return False
    dual = getattr(torch.autograd.forward_ad, "_current_level", 0) >= 0
    return all(
        t.device == dev and t.dtype in DTYPES and t.is_contiguous() and not _wrapped(t, dual)
        for t in ts
    )


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


if triton is not None:

    @triton.jit
    def _pre(a_ptr, b_ptr, off, msk, HAS_B: tl.constexpr, RELU: tl.constexpr):
        """The pre-op in float32 on elements ``off`` (masked lanes: 0)."""
        v = tl.load(a_ptr + off, mask=msk, other=0.0).to(tl.float32)
        if HAS_B:
            v += tl.load(b_ptr + off, mask=msk, other=0.0).to(tl.float32)
        if RELU:  # NaN stays NaN (NaN < 0 is false), as torch's relu
            v = tl.where(v < 0.0, 0.0, v)
        return v

    @triton.jit
    def _affine(y, w_ptr, bias_ptr, c, msk, HAS_W: tl.constexpr, HAS_BIAS: tl.constexpr):
        if HAS_W:
            y = y * tl.load(w_ptr + c, mask=msk, other=1.0).to(tl.float32)
        if HAS_BIAS:
            y = y + tl.load(bias_ptr + c, mask=msk, other=0.0).to(tl.float32)
        return y

    @triton.jit
    def _gn_fit_kernel(
        a_ptr, b_ptr, w_ptr, bias_ptr, out_ptr, G, Cg, S, L, eps,
        HAS_B: tl.constexpr, RELU: tl.constexpr, HAS_W: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        """One program per (sample, group): the slab (L <= BLOCK elements) in registers."""
        pid = tl.program_id(0)
        g = pid % G
        base = pid.to(tl.int64) * L  # (n * G + g) * L: the slab is contiguous
        idx = tl.arange(0, BLOCK)
        msk = idx < L
        v = _pre(a_ptr + base, b_ptr + base, idx, msk, HAS_B, RELU)
        mean = tl.sum(v, axis=0) / L
        d = tl.where(msk, v - mean, 0.0)
        var = tl.sum(d * d, axis=0) / L
        rstd = 1.0 / tl.sqrt(var + eps)
        y = _affine(d * rstd, w_ptr, bias_ptr, g * Cg + idx // S, msk, HAS_W, HAS_BIAS)
        tl.store(out_ptr + base + idx, y.to(out_ptr.dtype.element_ty), mask=msk)

    @triton.jit
    def _gn_loop_kernel(
        a_ptr, b_ptr, w_ptr, bias_ptr, out_ptr, G, Cg, S, L, eps,
        HAS_B: tl.constexpr, RELU: tl.constexpr, HAS_W: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        """One program per (sample, group), the slab in blocks: statistics (Chan's merge of the
        blocks' mean and M2), then the output (the inputs read again)."""
        pid = tl.program_id(0)
        g = pid % G
        base = pid.to(tl.int64) * L
        count = tl.zeros([], dtype=tl.float32)
        mean = tl.zeros([], dtype=tl.float32)
        m2 = tl.zeros([], dtype=tl.float32)
        for lo in range(0, L, BLOCK):
            idx = lo + tl.arange(0, BLOCK)
            msk = idx < L
            v = _pre(a_ptr + base, b_ptr + base, idx, msk, HAS_B, RELU)
            nb = tl.minimum(L - lo, BLOCK).to(tl.float32)
            mb = tl.sum(v, axis=0) / nb
            d = tl.where(msk, v - mb, 0.0)
            m2b = tl.sum(d * d, axis=0)
            n = count + nb
            delta = mb - mean
            mean = mean + delta * (nb / n)
            m2 = m2 + m2b + delta * delta * (count * nb / n)
            count = n
        rstd = 1.0 / tl.sqrt(m2 / L + eps)
        for lo in range(0, L, BLOCK):
            idx = lo + tl.arange(0, BLOCK)
            msk = idx < L
            v = _pre(a_ptr + base, b_ptr + base, idx, msk, HAS_B, RELU)
            y = _affine((v - mean) * rstd, w_ptr, bias_ptr, g * Cg + idx // S, msk, HAS_W,
                        HAS_BIAS)  # fmt: skip
            tl.store(out_ptr + base + idx, y.to(out_ptr.dtype.element_ty), mask=msk)


def group_norm_act(
    a: Tensor,
    b: Tensor | None = None,
    *,
    relu_first: bool,
    norm: nn.GroupNorm,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """``norm(pre)`` in one kernel, pre = relu(a + b) (``relu_first``, b given), a + b (not
    ``relu_first``), relu(a) (b None, ``relu_first``) or a.

    a, b: (N, C, *spatial), same shape, same device, any of float32/bfloat16/float16 (may
    differ); float32 arithmetic and statistics; ``norm``'s groups, eps and (optional) affine
    weight and bias; output in ``out_dtype`` (default a's dtype). Check :func:`usable` first.
    """
    if triton is None:  # pragma: no cover - depends on the torch build
        raise RuntimeError("group_norm_act needs Triton")
    if a.dim() < 2:
        raise ValueError(f"group_norm_act: expected (N, C, *spatial), got {tuple(a.shape)}")
    N, C = a.shape[0], a.shape[1]
    G = norm.num_groups
    if C != norm.num_channels or C % G:
        raise ValueError(f"group_norm_act: {C} channels for {norm}")
    if b is not None and (b.shape != a.shape or b.device != a.device):
        raise ValueError(f"group_norm_act: b {tuple(b.shape)} for a {tuple(a.shape)}")
    a = a.contiguous()
    b = b.contiguous() if b is not None else None
    out = torch.empty(a.shape, dtype=out_dtype or a.dtype, device=a.device)
    if out.numel() == 0:
        return out
    S = math.prod(a.shape[2:])
    Cg = C // G
    L = Cg * S
    w, bias = norm.weight, norm.bias
    args = (
        a, a if b is None else b, a if w is None else w,
        a if bias is None else bias, out, G, Cg, S, L, float(norm.eps),
    )  # fmt: skip
    flags = dict(HAS_B=b is not None, RELU=bool(relu_first), HAS_W=w is not None,
                 HAS_BIAS=bias is not None)  # fmt: skip
    if L <= FIT_MAX:
        block = max(16, _pow2(L))
        _gn_fit_kernel[(N * G,)](*args, **flags, BLOCK=block,
                                 num_warps=max(4, min(16, block // 1024)))  # fmt: skip
    else:
        block = max(16, min(_pow2(LOOP_BLOCK), _pow2(L)))
        _gn_loop_kernel[(N * G,)](*args, **flags, BLOCK=block, num_warps=8)
    return out
