"""OptEq: optimisation-induced equilibrium networks (Xie et al. 2023).

Unit layer (Eq. 6):  f(z, x) = alpha W^T sigma(W z + U x + b) + (1 - alpha) z,
with sigma monotone and 1-Lipschitz and ||W||_2 <= gamma enforced by the parameterisation
W = gamma V / max(1, ||V||_2) (a hard bound, unlike a learnable-scale spectral norm; the
default, gamma 0.9). ``gamma: null`` drops the bound: W is the raw parameter V, as the paper
defines the layer (the paper bounds no norm; its section 7.4 asks instead for small initial
operator norms, ``init_norm``: each ||W_l||_2 scaled to that value at construction).
For gamma <= 1 and alpha = 1 the fixed point minimises the convex
G(z) = 0.5 ||z||^2 - sum phi(W z + U x + b), phi' = sigma (Theorem 1), and
f(z) = z - alpha grad G(z): the damped iteration is gradient descent on G.

Deep OptEq (Eqs. 5-6, Lemma 3): T = f_L o ... o f_1, all units sharing the injected x; the model
has **one** fixed point z = T(z), of the composition, not a chain of equilibria. With a feature
regulariser R-star (section 5.1, Theorem 4) the cell is z = T(T_R(z)), T_R = prox_{s R} or
I - s grad R (:mod:`deqbench.solvers.regularizers`).

The norm ||V||_2 is held as a bilinear form sigma(V) = u^T V v with persistent singular vectors
(u, v) (buffers): exact top singular vectors (SVD) for small dense layers, persistent power
iteration for large ones and for convolutions (where W^T is the transposed convolution and the
power iteration runs on the actual zero-padded operator at the state's spatial size). The vectors
are refreshed after every optimiser step (``post_step``) and whenever the model's forward sees
changed weights, so sigma(V) equals ||V||_2 (exactly, or to the power-iteration tolerance) and
its gradient u v^T is the gradient of the top singular value. Each cell evaluation then costs
one extra bilinear form, not an SVD.

Registered: ``opteq`` (one FC unit), ``opteq_deep`` (FC composition), ``opteq_conv`` and
``opteq_deep_conv`` (3x3 convolutions), each with a ``*_tiny`` variant.

The unit layers and the bounded weight are in :mod:`deqbench.models.opteq_units`.

Example:
    >>> import torch, deqbench
    >>> m = deqbench.models.create("opteq_tiny", in_shape=(64,), num_outputs=10, gamma=0.9)
    >>> max(m.weight_norms()) <= 0.9 + 1e-6
    True
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn

from ..core.deq import DEQLayer, DEQModel
from ..core.errors import ConfigError
from ..core.registry import models
from . import declare_defaults
from ._common import as_image_shape, numel, variant
from .opteq_units import (  # noqa: F401  (re-exported: the unit layers' public names)
    ANTIDERIVATIVES,
    EXACT_MAX_ELEMENTS,
    NORM_METHODS,
    ConvexObjective,
    OptEqConvUnit,
    OptEqUnit,
)


class OptEqCell(nn.Module):
    """T(z, u) = f_L o ... o f_1 (T_R(z)), u = [U_1 x + b_1, ..., U_L x + b_L] split along dim 1.

    Exposes :class:`ConvexObjective` (``objective``/``objective_grad``) for a single unit without
    a regulariser.
    """

    #: the units keep Python-level state (a cached scale, power-iteration vectors refreshed
    #: when V changes): a captured CUDA graph would replay stale values, so the DEQ layer's
    #: solves stay eager (deqbench.deq.Runtime.cuda_graph)
    cuda_graph_safe = False

    def __init__(
        self,
        units: Sequence[OptEqUnit],
        regularizer: Any = None,
        reg_step: float = 0.1,
        reg_mode: str = "auto",
    ) -> None:
        super().__init__()
        from ..solvers.regularizers import get_regularizer

        self.units = nn.ModuleList(units)
        self.splits = [u.hidden for u in units]
        self.regularizer = get_regularizer(regularizer)
        self.reg_step = float(reg_step)
        if reg_mode not in ("auto", "prox", "grad"):
            raise ConfigError(f"opteq: reg_mode must be auto|prox|grad, got {reg_mode!r}")
        if reg_mode == "prox" and self.regularizer is not None and not self.regularizer.has_prox:
            raise ConfigError(
                f"opteq: regularizer '{self.regularizer.name}' has no closed-form prox; "
                "use reg_mode 'grad' or 'auto'"
            )
        self.reg_mode = reg_mode

    def forward(self, z: Tensor, u: Tensor) -> Tensor:
        if self.regularizer is not None:
            z = self.regularizer.step(z, self.reg_step, self.reg_mode)
        us = torch.split(u, self.splits, dim=1) if len(self.units) > 1 else (u,)
        for unit, ui in zip(self.units, us):
            z = unit(z, ui)
        return z

    def refresh(self) -> None:
        for unit in self.units:
            cast(OptEqUnit, unit).maybe_refresh()

    def _single(self) -> OptEqUnit:
        if len(self.units) != 1 or self.regularizer is not None:
            raise NotImplementedError(
                "the convex objective G is defined for one OptEq unit without a regulariser "
                "(deep OptEq: Xie et al. 2023 Theorem 2 adds a permutation term)"
            )
        return cast(OptEqUnit, self.units[0])

    def objective(self, z: Tensor, u: Tensor) -> Tensor:
        return self._single().objective(z, u)

    def objective_grad(self, z: Tensor, u: Tensor) -> Tensor:
        return self._single().objective_grad(z, u)

    def extra_repr(self) -> str:
        r = "none" if self.regularizer is None else f"{self.regularizer!r}, step={self.reg_step}"
        return f"depth={len(self.units)}, regularizer={r}"


class OptEqModel(DEQModel):
    """readout(z*), z* = T(z*, inject(x)); the iteration starts at z0 = 0, or with
    ``z0="input"`` at the (extracted) input features g(x), as the paper's Algorithm 1 (line 2:
    z0 = x = g(x0)), which needs as many feature channels (FC: input features) as state ones.

    FC: inject = Linear(d, sum n_l) on the flattened input, readout = Linear(m, outputs).
    Conv: inject = 3x3 conv (C_in -> sum n_l) of the input (after an optional conv+BN+ReLU
    extractor g), readout = average pool to ``pool`` x ``pool`` and a linear head.
    """

    def __init__(
        self,
        *,
        in_shape,
        num_outputs: int,
        conv: bool,
        state: int,
        hidden: Sequence[int],
        alpha: float,
        gamma: float | None,
        activation: str,
        regularizer: Any,
        reg_step: float,
        reg_mode: str,
        norm_method: str,
        extractor: int | None = None,
        pool: int = 4,
        kernel: int = 3,
        init_norm: float | None = None,
        z0: str = "zero",
    ) -> None:
        super().__init__()
        self.conv = conv
        self.state = int(state)
        if z0 not in Z0_MODES:
            raise ConfigError(f"opteq: z0 must be one of {', '.join(Z0_MODES)}, got {z0!r}")
        self.z0_mode = z0
        self._z0_from: tuple[Any, Tensor] | None = None
        hidden = [int(h) for h in hidden]
        if not hidden or min(hidden) < 1 or self.state < 1:
            raise ConfigError(f"opteq: widths must be positive, got state={state}, hidden={hidden}")
        if conv:
            c_in, h, w = as_image_shape(in_shape)
            self.in_shape: tuple[int, ...] = (c_in, h, w)
            self.spatial = (h, w)
            if extractor:
                self.extractor: nn.Module = nn.Sequential(
                    nn.Conv2d(c_in, extractor, 3, padding=1, bias=False),
                    nn.BatchNorm2d(extractor),
                    nn.ReLU(),
                )
                c_x = int(extractor)
            else:
                self.extractor = nn.Identity()
                c_x = c_in
            self.U: nn.Module = nn.Conv2d(c_x, sum(hidden), kernel, padding=kernel // 2)
            units: list[OptEqUnit] = [
                OptEqConvUnit(
                    self.state,
                    n,
                    (h, w),
                    kernel,
                    alpha,
                    gamma,
                    activation,
                    "power" if norm_method == "auto" else norm_method,
                )
                for n in hidden
            ]
            k = min(pool, h, w)
            self.pool: nn.Module = nn.AdaptiveAvgPool2d(k)
            self.head = nn.Linear(self.state * k * k, num_outputs)
        else:
            self.in_shape = tuple(int(s) for s in in_shape)
            self.extractor = nn.Identity()
            self.U = nn.Linear(numel(in_shape), sum(hidden))
            units = [
                OptEqUnit(self.state, n, alpha, gamma, activation, norm_method) for n in hidden
            ]
            self.pool = nn.Identity()
            self.head = nn.Linear(self.state, num_outputs)
        if z0 == "input":
            feats = c_x if conv else numel(in_shape)
            if feats != self.state:
                raise ConfigError(
                    f"opteq: z0 'input' starts the iteration at the input features g(x), "
                    f"{feats} {'channels' if conv else 'features'}, which must equal the state "
                    f"width {self.state}"
                )
        if init_norm is not None:
            for unit in units:
                unit.set_norm(float(init_norm))
        self.deq = DEQLayer(OptEqCell(units, regularizer, reg_step, reg_mode))
        #: the norm bound (inf: none, W = V)
        self.gamma = math.inf if gamma is None else float(gamma)
        self.alpha = float(alpha)
        self.init_norm = init_norm

    @property
    def units(self) -> list[OptEqUnit]:
        cell = cast(OptEqCell, self.deq.cell)
        return cast("list[OptEqUnit]", list(cell.units))  # a ModuleList of OptEqUnits

    def inject(self, x: Tensor) -> Tensor:
        gx = self.extractor(x.reshape(x.shape[0], *self.in_shape)) if self.conv else x.flatten(1)
        u = self.U(gx)
        if self.z0_mode == "input":  # z0(u) of this u starts at g(x) (Algorithm 1, line 2)
            self._z0_from = (weakref.ref(u), gx)
        return u

    def z0(self, u: Tensor) -> Tensor:
        if self.z0_mode == "input":
            ref, gx = self._z0_from if self._z0_from is not None else (None, None)
            if ref is None or gx is None or ref() is not u:
                raise RuntimeError(
                    "opteq with z0 'input': z0(u) starts at the features of the inject(x) that "
                    "made u; call inject(x) first"
                )
            return gx
        if self.conv:
            return u.new_zeros(u.shape[0], self.state, *u.shape[2:])
        return u.new_zeros(u.shape[0], self.state)

    def readout(self, z: Tensor) -> Tensor:
        return self.head(self.pool(z).flatten(1))

    def forward(self, x: Tensor) -> Tensor:
        cast(OptEqCell, self.deq.cell).refresh()
        return super().forward(x)

    def equilibrium(self, x: Tensor) -> tuple[Tensor, Tensor]:
        cast(OptEqCell, self.deq.cell).refresh()
        return super().equilibrium(x)

    def weight_norms(self) -> list[float]:
        """||W_l||_2 of every unit (each <= gamma by construction, where there is a bound)."""
        return [unit.weight_norm() for unit in self.units]

    def contraction_bound(self) -> float:
        """Upper bound on the Lipschitz constant of T (without regulariser): prod over units of
        max(|1 - alpha|, |1 - alpha + alpha ||W_l||^2|) for 1-Lipschitz monotone sigma
        (the unit's Jacobian is (1 - alpha) I + alpha W^T D W with 0 <= D <= I)."""
        b = 1.0
        for unit in self.units:
            s2 = unit.weight_norm() ** 2
            b *= max(abs(1 - unit.alpha), abs(1 - unit.alpha + unit.alpha * s2))
        return b


def _hidden(hidden, width: int, depth: int) -> list[int]:
    if hidden is None:
        return [int(width)] * int(depth)
    if isinstance(hidden, int):
        return [int(hidden)] * int(depth)
    h = [int(x) for x in hidden]
    if len(h) != int(depth):
        raise ConfigError(f"opteq: hidden has {len(h)} entries but depth is {depth}")
    return h


_COMMON_DOC = """
    Args:
        in_shape, num_outputs: filled by the runner from the dataset.
        width: state dimension m (channels for conv models).
        hidden: hidden width n_l of each unit (int or list; default ``width``).
        alpha: skip weight in (0, 1] (Xie et al. 2023 use 0.8; 1 is the plain OptEq layer).
        gamma: norm bound ||W_l||_2 <= gamma (gamma <= 1: convex objective; < 1: contraction);
            null: no bound, W_l is the raw parameter (the paper's layer).
        init_norm: rescale each W_l at construction to ||W_l||_2 = init_norm (Xie et al. 2023
            section 7.4: small initial operator norms); null keeps the default init's norms.
        z0: where the iteration starts: ``zero``, or ``input``: the (extracted) input features
            g(x), as the paper's Algorithm 1 (line 2, z0 = x = g(x0)); needs as many feature
            channels (FC: input features) as the state width.
        activation: relu | tanh | sigmoid | softsign | relu6 | identity.
        regularizer: R-star feature regulariser inside the layer (name or dict, e.g.
            ``{name: l1, weight: 0.15}``), None for none.
        reg_step: the step s of T_R = prox_{s R} or I - s grad R.
        reg_mode: auto (prox when closed form) | prox | grad.
        norm_method: auto | exact | power (how ||V||_2 is computed).
"""


#: Declared defaults (deqbench.models.declare_defaults). ||W_l||_2 <= gamma < 1 makes each
#: unit a contraction (Lipschitz <= alpha gamma^2 + 1 - alpha < 1) and so the deep composition:
#: plain iteration converges on the forward and on the adjoint (J^T has the same bound). The
#: rate is slow near gamma = 1 (about 0.85 per step at alpha = 0.8, gamma = 0.9), hence the
#: budget of 200.
#: where the iteration starts: zeros, or the (extracted) input features (the paper's Algorithm 1)
Z0_MODES = ("zero", "input")

DEFAULTS: dict[str, Any] = dict(
    solver={"name": "fixed_point", "max_iter": 200, "tol": 1e-4},
    backward={"name": "ift", "solver": "fixed_point", "max_iter": 200, "tol": 1e-5},
    init="default",
)


@models.register("opteq")
@declare_defaults(**DEFAULTS)
def opteq(
    in_shape=(64,),
    num_outputs: int = 10,
    width: int = 128,
    hidden: int | None = None,
    alpha: float = 1.0,
    gamma: float | None = 0.9,
    activation: str = "relu",
    regularizer: Any = None,
    reg_step: float = 0.1,
    reg_mode: str = "auto",
    norm_method: str = "auto",
    init_norm: float | None = None,
    z0: str = "zero",
) -> OptEqModel:
    """One fully connected OptEq unit: z = alpha W^T sigma(W z + U x + b) + (1 - alpha) z."""
    return OptEqModel(
        in_shape=in_shape,
        num_outputs=num_outputs,
        conv=False,
        state=width,
        hidden=_hidden(hidden, width, 1),
        alpha=alpha,
        gamma=gamma,
        activation=activation,
        regularizer=regularizer,
        reg_step=reg_step,
        reg_mode=reg_mode,
        norm_method=norm_method,
        init_norm=init_norm,
        z0=z0,
    )


@models.register("opteq_tiny")
@variant(opteq, width=16)
def opteq_tiny():
    """Tiny opteq for tests (width 16)."""


@models.register("opteq_deep")
@declare_defaults(**DEFAULTS)
def opteq_deep(
    in_shape=(64,),
    num_outputs: int = 10,
    width: int = 64,
    depth: int = 3,
    hidden: int | list[int] | None = None,
    alpha: float = 0.8,
    gamma: float | None = 0.9,
    activation: str = "relu",
    regularizer: Any = None,
    reg_step: float = 0.1,
    reg_mode: str = "auto",
    norm_method: str = "auto",
    init_norm: float | None = None,
    z0: str = "zero",
) -> OptEqModel:
    """Deep FC OptEq: one fixed point of the composition of ``depth`` units (Xie et al. 2023 Lemma 3)."""
    return OptEqModel(
        in_shape=in_shape,
        num_outputs=num_outputs,
        conv=False,
        state=width,
        hidden=_hidden(hidden, width, depth),
        alpha=alpha,
        gamma=gamma,
        activation=activation,
        regularizer=regularizer,
        reg_step=reg_step,
        reg_mode=reg_mode,
        norm_method=norm_method,
        init_norm=init_norm,
        z0=z0,
    )


@models.register("opteq_deep_tiny")
@variant(opteq_deep, width=16, depth=2)
def opteq_deep_tiny():
    """Tiny opteq_deep for tests (width 16, 2 units)."""


@models.register("opteq_conv")
@declare_defaults(**DEFAULTS)
def opteq_conv(
    in_shape=(1, 8, 8),
    num_outputs: int = 10,
    width: int = 32,
    hidden: int | None = None,
    alpha: float = 0.8,
    gamma: float | None = 0.9,
    activation: str = "relu",
    regularizer: Any = None,
    reg_step: float = 0.1,
    reg_mode: str = "auto",
    extractor: int | None = 32,
    pool: int = 4,
    norm_method: str = "power",
    init_norm: float | None = None,
    z0: str = "zero",
) -> OptEqModel:
    """One convolutional OptEq unit (3x3, ``width`` state channels); ``extractor`` channels of a
    conv+BN+ReLU feature extractor g (None/0: inject the raw image)."""
    return OptEqModel(
        in_shape=in_shape,
        num_outputs=num_outputs,
        conv=True,
        state=width,
        hidden=_hidden(hidden, width, 1),
        alpha=alpha,
        gamma=gamma,
        activation=activation,
        regularizer=regularizer,
        reg_step=reg_step,
        reg_mode=reg_mode,
        norm_method=norm_method,
        extractor=extractor,
        pool=pool,
        init_norm=init_norm,
        z0=z0,
    )


@models.register("opteq_conv_tiny")
@variant(opteq_conv, width=8, extractor=None)
def opteq_conv_tiny():
    """Tiny opteq_conv for tests (8 channels, no extractor)."""


@models.register("opteq_deep_conv")
@declare_defaults(**DEFAULTS)
def opteq_deep_conv(
    in_shape=(3, 32, 32),
    num_outputs: int = 10,
    width: int = 32,
    hidden: int | Sequence[int] | None = (16, 32, 64, 128, 128),
    depth: int = 5,
    alpha: float = 0.8,
    gamma: float | None = 0.9,
    activation: str = "relu",
    regularizer: Any = None,
    reg_step: float = 0.1,
    reg_mode: str = "auto",
    extractor: int | None = 32,
    pool: int = 4,
    norm_method: str = "power",
    init_norm: float | None = None,
    z0: str = "zero",
) -> OptEqModel:
    """Deep convolutional OptEq: 5 units of 3x3 convs with hidden channels 16, 32, 64, 128, 128
    (Xie et al. 2023 section 7.1) around a ``width``-channel state (the state width of the paper's
    model is not given in the paper: ours, unverified)."""
    return OptEqModel(
        in_shape=in_shape,
        num_outputs=num_outputs,
        conv=True,
        state=width,
        hidden=_hidden(hidden, width, depth),
        alpha=alpha,
        gamma=gamma,
        activation=activation,
        regularizer=regularizer,
        reg_step=reg_step,
        reg_mode=reg_mode,
        norm_method=norm_method,
        extractor=extractor,
        pool=pool,
        init_norm=init_norm,
        z0=z0,
    )


@models.register("opteq_deep_conv_tiny")
@variant(opteq_deep_conv, in_shape=(1, 8, 8), width=8, hidden=(4, 8), depth=2, extractor=None)
def opteq_deep_conv_tiny():
    """Tiny opteq_deep_conv for tests (8 state channels, units of 4 and 8 channels)."""


for _fn in (opteq, opteq_deep, opteq_conv, opteq_deep_conv):
    _fn.__doc__ = (_fn.__doc__ or "") + _COMMON_DOC
