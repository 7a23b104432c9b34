"""Positive concave DEQs (pcDEQ; Gabor, Piotrowski & Cavalcante, ICML 2024).

Layer ``z = sigma(W z + x~)`` with W >= 0 (Linear or 3x3 Conv, no bias), weight-normalised per
output channel (``W = g v / ||v||``) and kept nonnegative by clamping both g and v at 0 after
every optimiser step (:meth:`PCCell.post_step`, called by the training loop).

* pcDEQ-1 (``variant=1``): ``x~ = softplus(x, beta=5) > 0``, sigma in relu6 | tanh | softsign.
* pcDEQ-2 (``variant=2``): ``x~ = relu(x) >= 0``, sigma = sigmoid.

Then the layer is a positive concave mapping with a unique fixed point, reached geometrically by
plain iteration for any ||W|| (Prop. 4.6). Default solver: plain fixed point from 0, rel 1e-4,
max 200 (the paper's setting); the IFT backward runs the same iteration on the adjoint.

Architectures (paper appendix B):

* ``pcdeq_l``: Flatten -> Linear(d, ch) -> BN -> [softplus|relu] -> pcDEQ -> BN -> Linear.
* ``pcdeq_sc``: Conv(in, ch, 3, p1) -> BN -> [softplus|relu] -> pcDEQ -> MaxPool(3,1,1) -> BN ->
  AvgPool(8) -> Linear.
* ``pcdeq_mc``: three stages Conv -> BN -> [softplus|relu] -> pcDEQ -> MaxPool(3,1,1) -> BN, the
  convs being (in, c1, 3, p1), (c1, c2, 3, s2, p0), (c2, c3, 3, s2, p0); AvgPool(4) -> Linear.

``nonneg=False`` gives the unconstrained control (same architecture and init, no projection).
``resize=N`` (conv models) upsamples the input bilinearly to N x N inside the model, as
``data.digits(size=N)`` does, so 8x8 digits can feed an MNIST-shaped MC net.
``model.spectral_quantities()`` gives sigma_max of each layer's W: exact for Linear; for a
nonnegative conv kernel the sigma_max of the summed taps (exact for circular convolution, an
upper bound for the zero-padded conv used here); for a kernel with negative taps (control) the
exact circular (Sedghi) norm on the layer's input size.

Example:
    >>> import deqbench, torch
    >>> m = deqbench.models.create("pcdeq_mc_tiny", activation="sigmoid")   # pcDEQ-2
    >>> logits = m(torch.rand(4, 1, 8, 8))
    >>> [layer.last_forward_stats.nstep for layer in m.pc_layers()]         # doctest: +SKIP
    [5, 4, 4]
    >>> m.spectral_quantities()["sigma_max/max"]                            # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.deq import BackwardConfig, ChainStage, DEQLayer, DEQModel, SolverConfig
from ..core.errors import ConfigError
from ..core.registry import models
from ..spectral.norms import conv_norm_fft, dense_norm
from . import declare_defaults
from ._common import activation as get_activation
from ._common import as_image_shape, numel, variant

VARIANT_ACTIVATIONS = {1: ("relu6", "tanh", "softsign"), 2: ("sigmoid",)}


def default_solver() -> SolverConfig:
    return SolverConfig("fixed_point", max_iter=200, tol=1e-4)


def default_backward() -> BackwardConfig:
    return BackwardConfig("ift", solver="fixed_point", max_iter=200, tol=1e-4, b_init="grad")


def resolve_variant(variant: int | None, activation: str | None) -> tuple[int, str]:
    """(variant, activation) with the defaults and the checks of Definition 4.3."""
    if variant is None:
        variant = 2 if activation == "sigmoid" else 1
    if variant not in VARIANT_ACTIVATIONS:
        raise ConfigError(f"model.variant: pcDEQ variant must be 1 or 2, got {variant!r}")
    allowed = VARIANT_ACTIVATIONS[variant]
    if activation is None:
        activation = allowed[0] if variant == 2 else "tanh"
    if activation not in allowed:
        raise ConfigError(
            f"model.activation: pcDEQ-{variant} needs activation in {', '.join(allowed)}, got "
            f"'{activation}' (pcDEQ-1: relu6 | tanh | softsign with softplus input; pcDEQ-2: "
            "sigmoid with relu input)"
        )
    return variant, activation


class PCCell(nn.Module):
    """sigma(W z + u), W = g v / ||v|| (per output channel), W >= 0 by projection."""

    def __init__(
        self, channels: int, act: str, conv: bool = False, size: int = 0, nonneg: bool = True
    ) -> None:
        super().__init__()
        shape = (channels, channels, 3, 3) if conv else (channels, channels)
        # Paper init: uniform[0, 1) * sqrt(1e-4) / sqrt(out + in); g = ||v|| (W = v at init).
        v = torch.rand(shape) * math.sqrt(1e-4) / math.sqrt(2 * channels)
        self.v = nn.Parameter(v)
        self.g = nn.Parameter(self._vnorm(v).flatten())
        self.conv = conv
        self.size = int(size)  # spatial size of the layer input (conv), for sigma_max
        self.act_name = act
        self.act = get_activation(act)
        self.nonneg = nonneg

    @staticmethod
    def _vnorm(v: Tensor) -> Tensor:
        dims = tuple(range(1, v.dim()))
        return torch.linalg.vector_norm(v, dim=dims, keepdim=True)

    def weight(self) -> Tensor:
        shape = (-1,) + (1,) * (self.v.dim() - 1)
        return self.g.view(shape) * self.v / self._vnorm(self.v).clamp_min(1e-12)

    def forward(self, z: Tensor, u: Tensor) -> Tensor:
        W = self.weight()
        pre = F.conv2d(z, W, padding=1) if self.conv else F.linear(z, W)
        return self.act(pre + u)

    @torch.no_grad()
    def post_step(self) -> None:
        """Projection onto nonnegative weights (clamp both weight-norm factors)."""
        if self.nonneg:
            self.v.clamp_(min=0)
            self.g.clamp_(min=0)

    @torch.no_grad()
    def sigma_max(self) -> float:
        W = self.weight()
        if not self.conv:
            return dense_norm(W)
        if bool((W >= 0).all()):
            return dense_norm(W.sum(dim=(2, 3)))
        return conv_norm_fft(W, self.size)


def _input_act(variant: int):
    if variant == 1:
        return lambda x: F.softplus(x, beta=5)
    return torch.relu


class _PCBase(DEQModel):
    variant: int
    activation: str
    nonneg: bool

    def pc_layers(self) -> list[DEQLayer]:
        return [m for m in self.modules() if isinstance(m, DEQLayer)]

    def spectral_quantities(self) -> dict[str, float]:
        """sigma_max of each pcDEQ layer's W, keyed ``sigma_max/layer<i>``, plus the max."""
        layers = self.pc_layers()
        vals = [cast(PCCell, layer.cell).sigma_max() for layer in layers]
        out = {f"sigma_max/layer{i}": v for i, v in enumerate(vals)}
        out["sigma_max/max"] = max(vals)
        with torch.no_grad():
            out["weight_min"] = min(
                float(cast(PCCell, layer.cell).weight().min()) for layer in layers
            )
        return out

    def describe(self) -> str:
        c = "pcdeq" if self.nonneg else "unconstrained control"
        return f"{type(self).__name__} variant={self.variant} activation={self.activation} ({c})"


class PCDEQLinear(_PCBase):
    def __init__(
        self,
        in_features: int,
        width: int,
        num_outputs: int,
        variant: int,
        activation: str,
        nonneg: bool = True,
    ) -> None:
        super().__init__()
        self.variant, self.activation, self.nonneg = variant, activation, nonneg
        self.lin_in = nn.Linear(in_features, width)
        self.bn_in = nn.BatchNorm1d(width)
        self.in_act = _input_act(variant)
        self.deq = DEQLayer(
            PCCell(width, activation, nonneg=nonneg), default_solver(), default_backward()
        )
        self.bn_out = nn.BatchNorm1d(width)
        self.head = nn.Linear(width, num_outputs)

    def inject(self, x: Tensor) -> Tensor:
        return self.in_act(self.bn_in(self.lin_in(x.flatten(1))))

    def readout(self, z: Tensor) -> Tensor:
        return self.head(self.bn_out(z))


class _Stage(nn.Module):
    """Conv -> BN -> [softplus|relu] -> pcDEQ -> MaxPool(3,1,1) -> BN."""

    def __init__(
        self,
        c_in: int,
        c_out: int,
        size: int,
        stride: int,
        padding: int,
        variant: int,
        activation: str,
        nonneg: bool,
    ) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=padding)
        self.bn_in = nn.BatchNorm2d(c_out)
        self.in_act = _input_act(variant)
        self.out_size = (size + 2 * padding - 3) // stride + 1
        cell = PCCell(c_out, activation, conv=True, size=self.out_size, nonneg=nonneg)
        self.deq = DEQLayer(cell, default_solver(), default_backward())
        self.pool = nn.MaxPool2d(3, 1, 1)
        self.bn_out = nn.BatchNorm2d(c_out)

    def inject(self, x: Tensor) -> Tensor:
        return self.in_act(self.bn_in(self.conv(x)))

    def finish(self, z: Tensor) -> Tensor:
        """The layers after the equilibrium: MaxPool(3,1,1) -> BN."""
        return self.bn_out(self.pool(z))

    def forward(self, x: Tensor) -> Tensor:
        u = self.inject(x)
        return self.finish(self.deq(u, torch.zeros_like(u)))


class PCDEQConv(_PCBase):
    """SC (one stage, AvgPool 8) or MC (three stages, AvgPool 4)."""

    def __init__(
        self,
        in_shape,
        num_outputs: int,
        channels,
        variant: int,
        activation: str,
        nonneg: bool = True,
        pool: int | None = None,
        resize: int | None = None,
    ) -> None:
        super().__init__()
        self.variant, self.activation, self.nonneg = variant, activation, nonneg
        c_in, h, w = as_image_shape(in_shape)
        self.in_shape = (c_in, h, w)
        self.resize = int(resize) if resize else None
        if self.resize:
            h = w = self.resize
        chans = [int(c) for c in (channels if isinstance(channels, (list, tuple)) else [channels])]
        if len(chans) not in (1, 3):
            raise ConfigError(f"model.channels: give 1 (SC) or 3 (MC) widths, got {chans}")
        stages, size, prev = [], h, c_in
        for i, c in enumerate(chans):
            stride, pad = (1, 1) if i == 0 else (2, 0)
            st = _Stage(prev, c, size, stride, pad, variant, activation, nonneg)
            if st.out_size < 1:
                raise ConfigError(f"pcdeq: input {h}x{w} is too small for {len(chans)} stages")
            stages.append(st)
            size, prev = st.out_size, c
        self.stages = nn.ModuleList(stages)
        k = max(1, min(pool or (8 if len(chans) == 1 else 4), size))
        self.avg = nn.AvgPool2d(k)
        self.head = nn.Linear(prev * (size // k) ** 2, num_outputs)

    @property
    def deq(self) -> DEQLayer:  # type: ignore[override]
        """The first pcDEQ layer (generic analyses use it; see :meth:`pc_layers` for all)."""
        return cast(_Stage, self.stages[0]).deq

    def _input(self, x: Tensor) -> Tensor:
        x = x.view(x.shape[0], *self.in_shape)
        if self.resize and x.shape[-1] != self.resize:
            # as data.digits(size=...): bilinear, align_corners=False
            x = F.interpolate(
                x, size=(self.resize, self.resize), mode="bilinear", align_corners=False
            )
        return x

    def inject(self, x: Tensor) -> Tensor:
        return cast(_Stage, self.stages[0]).inject(self._input(x))

    def _stages_and_head(self, h: Tensor, start: int) -> Tensor:
        """Stages ``start``, ``start + 1``, ... then AvgPool and the linear head."""
        for s in self.stages[start:]:
            h = s(h)
        return self._head(h)

    def chain(self) -> tuple[list[ChainStage], Callable[[Tensor], Tensor]]:
        """Every stage's equilibrium (SC: one, MC: three): the first stage's input is the
        reshaped (resized) image; each stage ends in MaxPool -> BN; the head is AvgPool and the
        linear layer (:meth:`_stages_and_head`'s operations)."""
        stages = [cast(_Stage, s) for s in self.stages]
        chain = [
            ChainStage(self.inject if i == 0 else s.inject, s.deq, torch.zeros_like, s.finish)
            for i, s in enumerate(stages)
        ]
        return chain, self._head

    def _head(self, h: Tensor) -> Tensor:
        return self.head(self.avg(h).flatten(1))

    def readout(self, z: Tensor) -> Tensor:
        """Everything after the first layer's equilibrium (the remaining stages and the head)."""
        return self._stages_and_head(cast(_Stage, self.stages[0]).finish(z), 1)

    def forward(self, x: Tensor) -> Tensor:
        return self._stages_and_head(self._input(x), 0)


def _linear(in_shape, num_outputs, width, variant, activation, nonneg) -> PCDEQLinear:
    variant, activation = resolve_variant(variant, activation)
    return PCDEQLinear(numel(in_shape), width, num_outputs, variant, activation, nonneg)


def _conv(in_shape, num_outputs, channels, variant, activation, nonneg, pool, resize) -> PCDEQConv:
    variant, activation = resolve_variant(variant, activation)
    return PCDEQConv(in_shape, num_outputs, channels, variant, activation, nonneg, pool, resize)


#: Declared defaults (deqbench.models.declare_defaults): the paper's plain iteration, rel 1e-4,
#: max 200, forward and adjoint. A positive concave map has a unique fixed point that plain
#: iteration reaches from any start (Gabor et al. 2024), and its Jacobian at that point has spectral
#: radius < 1, so plain iteration also solves the adjoint (started from the incoming gradient).
DEFAULTS: dict[str, Any] = dict(
    solver={"name": "fixed_point", "max_iter": 200, "tol": 1e-4},
    backward={"name": "ift", "solver": "fixed_point", "max_iter": 200, "tol": 1e-4},
    init="default",
)


@models.register("pcdeq_l")
@declare_defaults(**DEFAULTS)
def pcdeq_l(
    in_shape=(784,),
    num_outputs: int = 10,
    width: int = 80,
    variant: int | None = None,
    activation: str | None = None,
    nonneg: bool = True,
) -> PCDEQLinear:
    """pcDEQ-L (MNIST width 80); variant 1 (relu6|tanh|softsign) or 2 (sigmoid)."""
    return _linear(in_shape, num_outputs, width, variant, activation, nonneg)


@models.register("pcdeq_l_tiny")
@variant(pcdeq_l, in_shape=(64,), width=16)
def pcdeq_l_tiny():
    """Tiny pcdeq_l for tests (width 16)."""


@models.register("pcdeq_sc")
@declare_defaults(**DEFAULTS)
def pcdeq_sc(
    in_shape=(1, 28, 28),
    num_outputs: int = 10,
    channels: int = 82,
    variant: int | None = None,
    activation: str | None = None,
    nonneg: bool = True,
    pool: int | None = None,
    resize: int | None = None,
) -> PCDEQConv:
    """pcDEQ-SC: one conv pcDEQ layer (MNIST 82 channels; SVHN/CIFAR 125)."""
    return _conv(in_shape, num_outputs, channels, variant, activation, nonneg, pool, resize)


@models.register("pcdeq_sc_tiny")
@variant(pcdeq_sc, in_shape=(1, 8, 8), channels=8)
def pcdeq_sc_tiny():
    """Tiny pcdeq_sc for tests (8 channels)."""


@models.register("pcdeq_mc")
@declare_defaults(**DEFAULTS)
def pcdeq_mc(
    in_shape=(1, 28, 28),
    num_outputs: int = 10,
    channels=(12, 24, 48),
    variant: int | None = None,
    activation: str | None = None,
    nonneg: bool = True,
    pool: int | None = None,
    resize: int | None = None,
) -> PCDEQConv:
    """pcDEQ-MC: three conv pcDEQ layers with strided convs between (MNIST (12, 24, 48))."""
    return _conv(in_shape, num_outputs, channels, variant, activation, nonneg, pool, resize)


@models.register("pcdeq_mc_tiny")
@variant(pcdeq_mc, in_shape=(1, 8, 8), channels=(4, 6, 8))
def pcdeq_mc_tiny():
    """Tiny pcdeq_mc for tests (channels 4, 6, 8)."""
