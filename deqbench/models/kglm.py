"""kGLM DEQs (Tsuchida et al. 2022).

``kglm_deq`` is the DEQ of Theorem 3 on flattened inputs y (T = identity):

    z* = sigma(W1 z* + W2 y + W3 rho(z*) + b),     output = V1 (z* + rho(z*)) + V2 y + c,

with sigma = A' of the exponential family (gaussian -> identity, bernoulli -> logistic sigmoid,
log2cosh -> tanh) and rho = 0 by default (no W3). The hidden state lives on the input
coordinates (width = number of inputs), the output on the target coordinates (num_outputs).

``kglm_conv_deq`` is the convolutional denoiser of Tsuchida et al. 2022 appendix E:
z* = relu(conv1(z*) + conv2(y)), output relu(conv_out1(z*) + conv_out2(y)), C -> C convs,
5x5, padding 2, no bias.

Both start from the PyTorch default init (uniform, biases zero); the kGLM inits in
:mod:`deqbench.kglm.inits` set the weights from a kernel.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from ..core.deq import DEQLayer, DEQModel, SolverConfig
from ..core.errors import ConfigError
from ..core.registry import models
from . import declare_defaults
from ._common import activation as get_activation
from ._common import as_image_shape, numel, variant

#: exponential family -> (activation sigma = A', sup |A''|)
FAMILIES: dict[str, tuple[str, float]] = {
    "gaussian": ("identity", 1.0),
    "bernoulli": ("sigmoid", 0.25),
    "log2cosh": ("tanh", 1.0),
}
_SUP_DERIV = {
    "identity": 1.0,
    "sigmoid": 0.25,
    "tanh": 1.0,
    "relu": 1.0,
    "softsign": 1.0,
    "relu6": 1.0,
}


def _resolve_activation(family: str | None, activation: str | None) -> str:
    if activation is not None:
        return activation
    if family is None:
        return "tanh"
    if family not in FAMILIES:
        raise ConfigError(f"kglm: unknown family '{family}'; choose from {', '.join(FAMILIES)}")
    return FAMILIES[family][0]


class KGLMCell(nn.Module):
    """f(z, u) = sigma(W1 z + W3 rho(z) + u), u = W2 y + b the injection."""

    def __init__(self, width: int, act: str = "tanh", rho: str | None = None) -> None:
        super().__init__()
        self.W1 = nn.Linear(width, width, bias=False)
        self.W3 = nn.Linear(width, width, bias=False) if rho else None
        self.act_name = act
        self.act = get_activation(act)
        self.rho_name = rho
        self.rho = get_activation(rho) if rho else None
        #: sup |sigma'| (sup |A''|), for the contraction bound of Assumption 2
        self.sup_act_deriv = _SUP_DERIV.get(act, float("nan"))

    def forward(self, z: Tensor, u: Tensor) -> Tensor:
        pre = self.W1(z) + u
        if self.W3 is not None and self.rho is not None:
            pre = pre + self.W3(self.rho(z))
        return self.act(pre)

    def lipschitz_bound(self) -> float:
        """sup|sigma'| * ||W1|| (+ ||W3|| sup|rho'|), an upper bound of the cell's Lipschitz
        constant in z (the quantity of Assumption 2 with rho = 0)."""
        from ..spectral.norms import dense_norm

        s = dense_norm(self.W1.weight)
        if self.W3 is not None:
            s += dense_norm(self.W3.weight) * _SUP_DERIV.get(self.rho_name or "", float("nan"))
        return self.sup_act_deriv * s


class _SkipReadoutDEQ(DEQModel):
    """A DEQ whose readout also sees the input y: :meth:`inject` stores y (``_x``) and
    :meth:`forward` passes it on to ``readout(z, y)``."""

    _x: Tensor | None

    def _as_input(self, x: Tensor) -> Tensor:
        """The batch ``x`` in the model's input layout (y)."""
        raise NotImplementedError

    def _readout_input(self, x: Tensor | None) -> Tensor:
        """y of ``x``, or of the last :meth:`inject` when ``x`` is None."""
        y = self._as_input(x) if x is not None else self._x
        if y is None:
            raise RuntimeError("kglm readout needs the input y: call inject(x) first or pass x")
        return y

    def readout(self, z: Tensor, x: Tensor | None = None) -> Tensor:
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        u = self.inject(x)
        y = self._x
        z = self.deq(u, self.z0(u))
        return self.readout(z, y)


class KGLMDEQ(_SkipReadoutDEQ):
    """kGLM DEQ (Theorem 3) with readout V1 (z + rho(z)) + V2 y (+ bias).

    Attributes:
        W2: injection Linear (inputs -> hidden), bias ``b``.
        V1: readout Linear (hidden -> outputs), bias ``c``.
        V2: bias-free skip Linear (inputs -> outputs).
        in_shape: shape of one input sample; inputs are flattened.
    """

    def __init__(
        self,
        in_shape,
        num_outputs: int,
        act: str = "tanh",
        rho: str | None = None,
        bias: bool = True,
        output_act: str | None = None,
    ) -> None:
        super().__init__()
        self.in_shape = tuple(int(s) for s in in_shape)
        self.output_act = get_activation(output_act) if output_act else None
        n = numel(self.in_shape)
        self.width = n
        self.num_outputs = int(num_outputs)
        self.W2 = nn.Linear(n, n, bias=bias)
        self.deq = DEQLayer(KGLMCell(n, act, rho), SolverConfig("fixed_point", 50, 1e-4))
        self.V1 = nn.Linear(n, self.num_outputs, bias=bias)
        self.V2 = nn.Linear(n, self.num_outputs, bias=False)
        for lin in (self.W2, self.V1):
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        self._x: Tensor | None = None

    def _as_input(self, x: Tensor) -> Tensor:
        return x.flatten(1)

    def inject(self, x: Tensor) -> Tensor:
        y = self._as_input(x)
        self._x = y
        return self.W2(y)

    def readout(self, z: Tensor, x: Tensor | None = None) -> Tensor:
        """V1 (z + rho(z)) + V2 y (through ``output_act`` where given); ``x`` defaults to the
        input of the last :meth:`inject`."""
        y = self._readout_input(x)
        cell: KGLMCell = self.deq.cell  # type: ignore[assignment]
        h = z + cell.rho(z) if cell.rho is not None else z
        out = self.V1(h) + self.V2(y)
        return self.output_act(out) if self.output_act is not None else out


class KGLMConvCell(nn.Module):
    """f(z, u) = act(conv1(z) + u), u = conv2(y)."""

    def __init__(
        self, channels: int, kernel: int = 5, act: str = "relu", padding_mode: Any = "zeros"
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(
            channels, channels, kernel, padding=kernel // 2, bias=False, padding_mode=padding_mode
        )
        self.act_name = act
        self.act = get_activation(act)

    def forward(self, z: Tensor, u: Tensor) -> Tensor:
        return self.act(self.conv1(z) + u)


class KGLMConvDEQ(_SkipReadoutDEQ):
    """Convolutional kGLM denoiser (Tsuchida et al. 2022 App. E): output act(conv_out1(z*) + conv_out2(y))."""

    def __init__(
        self,
        in_shape,
        kernel: int = 5,
        act: str = "relu",
        padding_mode: Any = "zeros",
        output_act: str | None = "relu",
    ) -> None:
        super().__init__()
        c, h, w = as_image_shape(in_shape)
        self.in_shape = (c, h, w)
        p = kernel // 2
        self.conv2 = nn.Conv2d(c, c, kernel, padding=p, bias=False, padding_mode=padding_mode)
        self.deq = DEQLayer(
            KGLMConvCell(c, kernel, act, padding_mode), SolverConfig("fixed_point", 50, 1e-2)
        )
        self.conv_out1 = nn.Conv2d(c, c, kernel, padding=p, bias=False, padding_mode=padding_mode)
        self.conv_out2 = nn.Conv2d(c, c, kernel, padding=p, bias=False, padding_mode=padding_mode)
        self.output_act = get_activation(output_act) if output_act else None
        self._x: Tensor | None = None

    @property
    def conv1(self) -> nn.Conv2d:
        return self.deq.cell.conv1  # type: ignore[return-value]

    def _as_input(self, x: Tensor) -> Tensor:
        return x.view(x.shape[0], *self.in_shape)

    def inject(self, x: Tensor) -> Tensor:
        y = self._as_input(x)
        self._x = y
        return self.conv2(y)

    def readout(self, z: Tensor, x: Tensor | None = None) -> Tensor:
        y = self._readout_input(x)
        out = self.conv_out1(z) + self.conv_out2(y)
        return self.output_act(out) if self.output_act is not None else out


#: Declared defaults (deqbench.models.declare_defaults). The kGLM init (Theorem 3) gives
#: W1 = -K/lam with ||W1||_2 = scale (1 by default): the cell's Jacobian has eigenvalues down to
#: -1, where plain iteration stalls or oscillates, and training can push them past -1 (the
#: naive and random inits start there). Anderson (m = 5) on the forward and the adjoint. The
#: papers' suites set plain iteration explicitly where they reproduce it.
DEFAULTS: dict[str, Any] = dict(
    solver={"name": "anderson", "max_iter": 100, "tol": 1e-4, "m": 5},
    backward={"name": "ift", "solver": "anderson", "max_iter": 100, "tol": 1e-5},
    init="kglm_informed",
)


@models.register("kglm_deq")
@declare_defaults(**DEFAULTS)
def kglm_deq(
    in_shape=(100,),
    num_outputs: int | None = None,
    family: str | None = None,
    activation: str | None = None,
    rho: str | None = None,
    bias: bool = True,
    output_activation: str | None = None,
) -> KGLMDEQ:
    """kGLM DEQ of Theorem 3 (Tsuchida et al. 2022): z = sigma(W1 z + W2 y + W3 rho(z) + b), output
    V1 (z + rho(z)) + V2 y + c; width = number of inputs.

    Args:
        in_shape: shape of one input sample (flattened; images use their pixel coordinates).
        num_outputs: number of target coordinates (default: same as inputs).
        family: gaussian (identity) | bernoulli (sigmoid) | log2cosh (tanh, the default).
        activation: overrides the family's sigma = A' (e.g. relu).
        rho: optional activation for rho (adds W3); None (the Gaussian-prior case) by default.
        bias: hidden and readout biases (zero at init).
        output_activation: applied to the output (e.g. ``sigmoid``: the Bernoulli mean, the
            greyscale prediction App. G trains with the squared loss); None: the linear output
            (logits for ``bernoulli``).
    """
    n_out = numel(in_shape) if num_outputs is None else int(num_outputs)
    act = _resolve_activation(family, activation)
    return KGLMDEQ(in_shape, n_out, act, rho, bias, output_activation)


@models.register("kglm_deq_tiny")
@variant(kglm_deq, in_shape=(16,))
def kglm_deq_tiny():
    """Tiny kglm_deq for tests (its width is the input size; default 16 inputs)."""


@models.register("kglm_conv_deq")
@declare_defaults(**DEFAULTS)
def kglm_conv_deq(
    in_shape=(3, 32, 32),
    num_outputs: int | None = None,
    kernel: int = 5,
    activation: str = "relu",
    padding_mode: Any = "zeros",
    output_activation: str | None = "relu",
) -> KGLMConvDEQ:
    """Convolutional kGLM denoiser (Tsuchida et al. 2022 App. E): z = relu(conv1(z) + conv2(y)), output
    relu(conv_out1(z) + conv_out2(y)); C -> C convs (C = input channels), ``kernel`` x ``kernel``,
    same padding, no bias. ``num_outputs`` is ignored (the output is an image like the input)."""
    return KGLMConvDEQ(in_shape, kernel, activation, padding_mode, output_activation)


@models.register("kglm_conv_deq_tiny")
@variant(kglm_conv_deq, in_shape=(2, 8, 8), kernel=3)
def kglm_conv_deq_tiny():
    """Tiny kglm_conv_deq for tests (3x3 kernels; default 2 x 8 x 8 inputs)."""
