"""Convolutional residual DEQ (Nguyen 2022 eq. 4.1; the implicit-layers tutorial block).

Cell: f(z, x) = GN3(ReLU(z + GN2(x + conv2(GN1(ReLU(conv1(z))))))), 3x3 convs without bias,
weights N(0, 0.01^2), GroupNorm with 8 groups. Model: conv stem + BatchNorm -> DEQ -> BatchNorm ->
average pool -> linear head.

Under a bfloat16 (or float16) autocast (``runtime.amp: bf16``) the cell runs end to end in that
dtype: plain autocast runs the convolutions in bf16 but puts every GroupNorm in float32, so the
norms, additions and the casts between them (all memory-bound) cost more than the convolutions
they sit between. Here the activations stay in bf16, the first two GroupNorms take bf16 input
with their statistics accumulated in float32 (PyTorch's kernels do), and the last one adds the
float32 iterate z and runs in float32, so the output is rounded at float32 (an all-bf16 output
put the fixed-point residual floor near 4e-3 and cost an extra iteration at rel 1e-2).
``lowp_norms = False`` gives plain autocast instead.

What runs where (``ResNetCell.forward``):

* grad mode off (the forward solve, which runs under ``no_grad``), tensors on CUDA (or on CPU
  under Triton's interpreter), float32/bfloat16/float16 (not float64), ``DEQBENCH_FUSED`` != "0",
  not under ``torch.compile`` nor inside a torch.func transform: the fused path. Each GroupNorm
  with the additions and ReLU before it is one Triton kernel
  (:func:`deqbench.models.fused_norm.group_norm_act`, float32 statistics), the convolutions
  stay cuDNN. Without autocast everything is in z's dtype. Under a 16-bit autocast (with
  ``lowp_norms``) the convolutions and the first two GroupNorm outputs are 16-bit, x is added in
  its own dtype, and the last GroupNorm adds the float32 z and writes float32 directly, so the
  cell's output is rounded at float32, not bf16 (an all-bf16 output put the fixed-point residual
  floor near 4e-3).
* otherwise (grad enabled, float64, CPU without the interpreter, ``DEQBENCH_FUSED=0``, plain
  autocast with ``lowp_norms = False``): the torch code (the bf16 path above, or plain torch).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.deq import DEQLayer, DEQModel
from ..core.registry import models
from . import declare_defaults, fused_norm
from ._common import as_image_shape


def _groups(c: int, groups: int) -> int:
    g = min(groups, c)
    while c % g:
        g -= 1
    return g


def _lowp_dtype(t: Tensor) -> torch.dtype | None:
    """The autocast dtype on ``t``'s device when it is a 16-bit float (else None)."""
    dev = t.device.type
    if not torch.is_autocast_enabled(dev):
        return None
    dt = torch.get_autocast_dtype(dev)
    return dt if dt in (torch.bfloat16, torch.float16) else None


class ResNetCell(nn.Module):
    """f(z, x) = GN3(relu(z + GN2(x + conv2(GN1(relu(conv1(z)))))));

    under a 16-bit autocast end to end in that dtype (``lowp_norms``, see the module docstring).
    With grad mode off and the fused kernels usable (CUDA, not float64, ``DEQBENCH_FUSED`` !=
    "0"), each GroupNorm and the pre-ops before it are one Triton kernel (:meth:`_forward_fused`);
    under a 16-bit autocast that path returns float32 (the last norm reads z in float32).
    """

    #: under a 16-bit autocast: GroupNorms on 16-bit activations (False: plain autocast, which
    #: runs them in float32)
    lowp_norms = True

    def __init__(self, channels: int, inner: int, groups: int = 8, kernel: int = 3) -> None:
        super().__init__()
        p = kernel // 2
        self.conv1 = nn.Conv2d(channels, inner, kernel, padding=p, bias=False)
        self.conv2 = nn.Conv2d(inner, channels, kernel, padding=p, bias=False)
        self.norm1 = nn.GroupNorm(_groups(inner, groups), inner)
        self.norm2 = nn.GroupNorm(_groups(channels, groups), channels)
        self.norm3 = nn.GroupNorm(_groups(channels, groups), channels)
        nn.init.normal_(self.conv1.weight, 0.0, 0.01)
        nn.init.normal_(self.conv2.weight, 0.0, 0.01)

    def forward(self, z: Tensor, x: Tensor) -> Tensor:
        dt = _lowp_dtype(z) if self.lowp_norms else None
        if not torch.is_grad_enabled() and self._fused_ok(z, x, dt):
            return self._forward_fused(z, x, dt)
        if dt is not None:
            return self._forward_lowp(z, x, dt)
        y = self.norm1(self.conv1(z).relu_())
        return self.norm3((z + self.norm2(x + self.conv2(y))).relu_())

    def _fused_ok(self, z: Tensor, x: Tensor, dt: torch.dtype | None) -> bool:
        """Whether :meth:`_forward_fused` serves this call (grad mode checked by the caller)."""
        if torch.compiler.is_compiling() or z.dim() != 4 or x.shape != z.shape:
            return False
        if dt is None and torch.is_autocast_enabled(z.device.type):
            return False  # plain autocast (lowp_norms False, or not a 16-bit dtype): torch
        return fused_norm.usable(z, x, *self.parameters())

    def _forward_fused(self, z: Tensor, x: Tensor, dt: torch.dtype | None) -> Tensor:
        """The cell with one Triton kernel per GroupNorm and its pre-ops (no autograd graph).

        ``dt`` None: convolutions, activations and output in z's dtype. A 16-bit ``dt`` (the
        autocast dtype): convolutions and the first two norms' outputs in ``dt``, x added in its
        own dtype, z added in its own dtype (not rounded to ``dt``) and the output in z's dtype.
        """
        gna = fused_norm.group_norm_act
        if dt is None:  # output dtypes as torch's type promotion gives them
            c1 = self.conv1(z)
            y = gna(c1, relu_first=True, norm=self.norm1, out_dtype=c1.dtype)
            c2 = self.conv2(y)
            ht = torch.promote_types(c2.dtype, x.dtype)
            h = gna(c2, x, relu_first=False, norm=self.norm2, out_dtype=ht)
            return gna(
                h, z, relu_first=True, norm=self.norm3, out_dtype=torch.promote_types(ht, z.dtype)
            )

        def conv(m: nn.Conv2d, t: Tensor) -> Tensor:
            return F.conv2d(t, m.weight.to(dt), None, m.stride, m.padding, m.dilation, m.groups)

        with torch.autocast(z.device.type, enabled=False):
            y = gna(conv(self.conv1, z.to(dt)), relu_first=True, norm=self.norm1, out_dtype=dt)
            h = gna(conv(self.conv2, y), x, relu_first=False, norm=self.norm2, out_dtype=dt)
            return gna(h, z, relu_first=True, norm=self.norm3, out_dtype=z.dtype)

    def _forward_lowp(self, z: Tensor, x: Tensor, dt: torch.dtype) -> Tensor:
        """The same map with the convolutions and the first two GroupNorms in ``dt`` (their
        statistics in float32) and the last one from the float32 z, in float32: the map of
        :meth:`_forward_fused` in torch code (the grad-enabled evaluations, e.g. the
        backward's VJPs, see the same map as the forward solve)."""

        def conv(m: nn.Conv2d, t: Tensor) -> Tensor:
            return F.conv2d(t, m.weight.to(dt), None, m.stride, m.padding, m.dilation, m.groups)

        def norm(m: nn.GroupNorm, t: Tensor) -> Tensor:
            w = None if m.weight is None else m.weight.to(dt)
            b = None if m.bias is None else m.bias.to(dt)
            return F.group_norm(t, m.num_groups, w, b, m.eps)

        with torch.autocast(z.device.type, enabled=False):
            y = norm(self.norm1, conv(self.conv1, z.to(dt)).relu_())
            # as the fused kernels: x added in its own dtype, that norm computed there and
            # rounded to dt; the last from the float32 z
            n2, n3 = self.norm2, self.norm3
            h = conv(self.conv2, y) + x
            h = F.group_norm(h, n2.num_groups, n2.weight, n2.bias, n2.eps).to(dt)
            return F.group_norm((h + z).relu_(), n3.num_groups, n3.weight, n3.bias, n3.eps)


class ConvDEQ(DEQModel):
    def __init__(
        self, in_shape, num_outputs: int, channels: int, inner: int, groups: int = 8, pool: int = 4
    ) -> None:
        super().__init__()
        c_in, h, w = as_image_shape(in_shape)
        self.in_shape = (c_in, h, w)
        self.stem = nn.Sequential(
            nn.Conv2d(c_in, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)
        )
        self.deq = DEQLayer(ResNetCell(channels, inner, groups))
        self.post = nn.BatchNorm2d(channels)
        self.pool = nn.AdaptiveAvgPool2d(min(pool, h, w))
        k = min(pool, h, w)
        self.head = nn.Linear(channels * k * k, num_outputs)

    def inject(self, x: Tensor) -> Tensor:
        return self.stem(x.view(x.shape[0], *self.in_shape))

    def readout(self, z: Tensor) -> Tensor:
        return self.head(self.pool(self.post(z)).flatten(1))


#: Declared defaults (deqbench.models.declare_defaults). The residual conv cell's Jacobian is
#: unconstrained (its spectral radius exceeds 1 early in training: plain iteration hit max_iter
#: on most adjoints), so Anderson (m = 5) on the forward and on the adjoint,
#: with budgets that leave room for the stiffer cells later in training.
DEFAULTS: dict[str, Any] = dict(
    solver={"name": "anderson", "max_iter": 100, "tol": 1e-3, "m": 5},
    backward={"name": "ift", "solver": "anderson", "max_iter": 100, "tol": 1e-4},
    init="default",
)


@models.register("conv_deq")
@declare_defaults(**DEFAULTS)
def conv_deq(
    in_shape=(3, 32, 32),
    num_outputs: int = 10,
    channels: int = 48,
    inner: int = 64,
    groups: int = 8,
    pool: int = 4,
) -> ConvDEQ:
    """The tutorial ResNet DEQ (48 channels, inner 64 by default)."""
    return ConvDEQ(in_shape, num_outputs, channels, inner, groups, pool)


@models.register("conv_deq_tiny")
@declare_defaults(**DEFAULTS)
def conv_deq_tiny(
    in_shape=(1, 8, 8),
    num_outputs: int = 10,
    channels: int = 16,
    inner: int = 32,
    groups: int = 4,
    pool: int = 4,
) -> ConvDEQ:
    """Tiny conv_deq for tests (16 channels, inner 32)."""
    return ConvDEQ(in_shape, num_outputs, channels, inner, groups, pool)
