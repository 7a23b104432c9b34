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

Example:
    >>> import torch, deqbench
    >>> m = deqbench.models.create("opteq_tiny", in_shape=(64,), num_outputs=10, gamma=0.9)
    >>> max(m.weight_norms()) <= 0.9 + 1e-6
    True
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol, cast, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.deq import DEQLayer, DEQModel
from ..core.errors import ConfigError
from ..core.registry import models
from . import declare_defaults
from ._common import activation, as_image_shape, numel

#: monotone, 1-Lipschitz activations and their antiderivatives phi (phi' = sigma), up to a
#: constant; phi enters the convex objective G.
ANTIDERIVATIVES = {
    "relu": lambda a: 0.5 * torch.relu(a).pow(2),
    "identity": lambda a: 0.5 * a.pow(2),
    "tanh": lambda a: a.abs() + F.softplus(-2 * a.abs()) - math.log(2.0),  # log cosh a
    "sigmoid": F.softplus,
    "softsign": lambda a: a.abs() - torch.log1p(a.abs()),
    "relu6": lambda a: torch.where(a <= 6, 0.5 * torch.relu(a).pow(2), 18.0 + 6.0 * (a - 6.0)),
}

NORM_METHODS = ("auto", "exact", "power")
EXACT_MAX_ELEMENTS = 64 * 64  # "auto": exact SVD up to this many weight entries (else power)


@runtime_checkable
class ConvexObjective(Protocol):
    """Structure of a cell whose fixed point minimises a convex objective G (OptEq, one unit):
    ``objective(z, u)`` gives G per sample (B,), ``objective_grad(z, u)`` gives grad G, and
    z = cell(z, u) iff grad G(z) = 0."""

    def objective(self, z: Tensor, u: Tensor) -> Tensor: ...

    def objective_grad(self, z: Tensor, u: Tensor) -> Tensor: ...


def _normalize(x: Tensor, eps: float = 1e-12) -> Tensor:
    return x / (torch.linalg.vector_norm(x) + eps)


class _BoundedWeight(nn.Module):
    """V (raw parameter) with W = gamma V / max(1, sigma(V)) and persistent singular vectors.

    Subclasses define the operator: :meth:`apply_W` (V or W applied to a state batch),
    :meth:`apply_Wt` (its adjoint) and the shapes of the singular vectors.
    """

    V: nn.Parameter
    sv_u: Tensor
    sv_v: Tensor

    def __init__(
        self, gamma: float | None, norm_method: str, power_iters: int, power_tol: float
    ) -> None:
        super().__init__()
        if gamma is not None:
            gamma = float(gamma)
            if not gamma > 0:
                raise ConfigError(
                    f"opteq: gamma (the norm bound ||W||_2 <= gamma) must be > 0 or null (no "
                    f"bound), got {gamma}"
                )
        if norm_method not in NORM_METHODS:
            raise ConfigError(
                f"opteq: unknown norm_method '{norm_method}'; choose from {', '.join(NORM_METHODS)}"
            )
        self.gamma = gamma
        self.norm_method = norm_method
        self.power_iters = int(power_iters)
        self.power_tol = float(power_tol)
        self._seen_version: tuple[int, int, Any, Any] | None = None
        self._scale_cache: tuple[Tensor, tuple[int, int], Tensor] | None = None

    # -- operator (overridden) --------------------------------------------------------------
    def apply_W(self, z: Tensor, weight: Tensor) -> Tensor:
        raise NotImplementedError

    def apply_Wt(self, h: Tensor, weight: Tensor) -> Tensor:
        raise NotImplementedError

    def _exact_ok(self) -> bool:
        return False

    # -- norm -------------------------------------------------------------------------------
    def _use_exact(self) -> bool:
        if self.norm_method == "exact":
            return True
        return self.norm_method == "auto" and self._exact_ok()

    @torch.no_grad()
    def refresh(self, iters: int | None = None) -> None:
        """Update the singular vectors (u, v) of V: exact SVD or warm-started power iteration
        until sigma changes by less than ``power_tol`` (relative), at most ``iters`` steps."""
        V = self.V.detach()
        if self.sv_u.device != V.device or self.sv_u.dtype != V.dtype:
            self.sv_u = self.sv_u.to(V)
            self.sv_v = self.sv_v.to(V)
        if self._use_exact():
            U, _, Vh = torch.linalg.svd(V.reshape(V.shape[0], -1), full_matrices=False)
            self.sv_u.copy_(U[:, 0].reshape(self.sv_u.shape))
            self.sv_v.copy_(Vh[0].reshape(self.sv_v.shape))
        else:
            n = self.power_iters if iters is None else int(iters)
            v = self.sv_v
            if not bool(torch.isfinite(v).all()) or float(torch.linalg.vector_norm(v)) == 0:
                v = torch.randn_like(v)
            v = _normalize(v)
            sigma_old = None
            u = self.sv_u
            for _ in range(max(1, n)):
                u = _normalize(self.apply_W(v.unsqueeze(0), V)[0])
                wt = self.apply_Wt(u.unsqueeze(0), V)[0]
                sigma = float(torch.linalg.vector_norm(wt))
                v = _normalize(wt)
                if sigma_old is not None and abs(sigma - sigma_old) <= self.power_tol * max(
                    sigma, 1e-30
                ):
                    break
                sigma_old = sigma
            u = _normalize(self.apply_W(v.unsqueeze(0), V)[0])
            self.sv_u.copy_(u)
            self.sv_v.copy_(v)
        self._seen_version = self._version_key()
        self._scale_cache = None

    def _version_key(self) -> tuple[int, int, Any, Any]:
        V = self.V
        return (V._version, V.data_ptr(), V.dtype, V.device)

    @property
    def bounded(self) -> bool:
        """Whether ||W||_2 <= gamma is enforced (False for ``gamma=None``: W = V)."""
        return self.gamma is not None

    def maybe_refresh(self) -> None:
        """Refresh if V changed since the last refresh (in-place updates bump its version).
        Skipped when V is not the module's own parameter (``torch.func.functional_call``), and
        without a bound (the cell then needs no norm; :meth:`weight_norm` refreshes itself)."""
        if self.bounded:
            self._refresh_if_changed()

    def _refresh_if_changed(self, iters: int | None = None) -> None:
        if isinstance(self.V, nn.Parameter) and self._seen_version != self._version_key():
            self.refresh(iters)

    def post_step(self) -> None:
        """Called by the training loop after every optimiser step (a no-op without a bound)."""
        if self.bounded:
            self.refresh()

    @torch.no_grad()
    def set_norm(self, target: float) -> None:
        """Rescale V so that ||W||_2 = ``target`` (the paper's small initial operator norms);
        with a bound, ``target`` must not exceed gamma."""
        if not target > 0:
            raise ConfigError(f"opteq: init_norm must be > 0, got {target}")
        if self.gamma is not None and target > self.gamma:
            raise ConfigError(
                f"opteq: init_norm {target} is above the norm bound gamma {self.gamma}"
            )
        self.refresh(iters=max(200, self.power_iters))
        s = float(self.sigma())
        if s > 0:
            # with a bound, W = gamma V while ||V||_2 <= 1: ||V||_2 = target / gamma
            want = target if self.gamma is None else target / self.gamma
            self.V.mul_(want / s)
        self.refresh(iters=max(200, self.power_iters))

    def sigma(self, V: Tensor | None = None) -> Tensor:
        """sigma(V) = u^T V v: ||V||_2 at the refreshed vectors, differentiable (grad u v^T)."""
        V = self.V if V is None else V
        return (self.sv_u.unsqueeze(0) * self.apply_W(self.sv_v.unsqueeze(0), V)).sum()

    def scale(self) -> Tensor | float:
        """gamma / max(1, ||V||_2): W = scale * V (1.0 without a bound). The cell applies the
        scalar to the products with V instead of forming W, so autograd saves no per-step copy
        of W. Under no_grad (the solver's hot loop) the value is cached until V changes."""
        if self.gamma is None:
            return 1.0
        V = self.V
        if torch.is_grad_enabled() or not isinstance(V, nn.Parameter):
            return self.gamma / torch.clamp(self.sigma(V), min=1.0)
        c = self._scale_cache
        key = (V._version, V.data_ptr())
        if c is not None and c[0] is V and c[1] == key:
            return c[2]
        s = self.gamma / torch.clamp(self.sigma(V), min=1.0)
        self._scale_cache = (V, key, s)
        return s

    def weight(self) -> Tensor:
        """W = gamma V / max(1, ||V||_2); V itself without a bound."""
        if self.gamma is None:
            return self.V
        return self.scale() * self.V

    @torch.no_grad()
    def weight_norm(self) -> float:
        """||W||_2 as used by the cell (exact for SVD mode, power-iteration estimate otherwise)."""
        if self.gamma is None:
            self._refresh_if_changed(iters=max(200, self.power_iters))
            return float(self.sigma())
        self.maybe_refresh()
        s = float(self.sigma())
        return self.gamma * s / max(1.0, s)


class OptEqUnit(_BoundedWeight):
    """Fully connected unit f(z, u) = alpha W^T sigma(W z + u) + (1 - alpha) z, W (hidden x state)."""

    def __init__(
        self,
        state: int,
        hidden: int,
        alpha: float = 1.0,
        gamma: float | None = 1.0,
        act: str = "relu",
        norm_method: str = "auto",
        power_iters: int = 30,
        power_tol: float = 1e-7,
    ) -> None:
        super().__init__(gamma, norm_method, power_iters, power_tol)
        self._init_unit(state, hidden, alpha, act)
        self.refresh()

    def _init_unit(
        self,
        state: int,
        hidden: int,
        alpha: float,
        act: str,
        kernel_dims: tuple[int, ...] = (),
        spatial: tuple[int, ...] = (),
    ) -> None:
        """Checks and sets alpha/act and the widths, creates V (hidden, state, *kernel_dims)
        with nn.Linear's / nn.Conv2d's default init and seeded singular-vector buffers of
        shapes (hidden, *spatial) and (state, *spatial)."""
        _check_alpha_act(alpha, act)
        self.alpha = float(alpha)
        self.act_name = act
        self.act = activation(act)
        self.state, self.hidden = int(state), int(hidden)
        self.V = nn.Parameter(torch.empty(self.hidden, self.state, *kernel_dims))
        nn.init.kaiming_uniform_(self.V, a=math.sqrt(5))  # nn.Linear's / nn.Conv2d's default
        g = torch.Generator().manual_seed(0)
        self.register_buffer("sv_u", _normalize(torch.randn(self.hidden, *spatial, generator=g)))
        self.register_buffer("sv_v", _normalize(torch.randn(self.state, *spatial, generator=g)))

    def _exact_ok(self) -> bool:
        return self.V.numel() <= EXACT_MAX_ELEMENTS

    def sigma(self, V: Tensor | None = None) -> Tensor:
        V = self.V if V is None else V
        return torch.dot(self.sv_u, torch.mv(V, self.sv_v))

    def apply_W(self, z: Tensor, weight: Tensor) -> Tensor:
        return z @ weight.t()

    def apply_Wt(self, h: Tensor, weight: Tensor) -> Tensor:
        return h @ weight

    def _map(self, z: Tensor, u: Tensor) -> Tensor:
        """W^T sigma(W z + u) with W = s V (W = V without a bound)."""
        if self.gamma is None:
            return self.apply_Wt(self.act(self.apply_W(z, self.V) + u), self.V)
        s = self.scale()
        return s * self.apply_Wt(self.act(s * self.apply_W(z, self.V) + u), self.V)

    def pre(self, z: Tensor, u: Tensor) -> Tensor:
        """W z + u."""
        if self.gamma is None:
            return self.apply_W(z, self.V) + u
        return self.scale() * self.apply_W(z, self.V) + u

    def forward(self, z: Tensor, u: Tensor) -> Tensor:
        out = self._map(z, u)
        if self.alpha == 1.0:
            return out
        return self.alpha * out + (1.0 - self.alpha) * z

    def objective(self, z: Tensor, u: Tensor) -> Tensor:
        """G(z) = 0.5 ||z||^2 - sum phi(W z + u) per sample (B,)."""
        phi = ANTIDERIVATIVES[self.act_name]
        a = self.pre(z, u)
        return 0.5 * z.reshape(z.shape[0], -1).pow(2).sum(1) - phi(a).reshape(a.shape[0], -1).sum(1)

    def objective_grad(self, z: Tensor, u: Tensor) -> Tensor:
        """grad G(z) = z - W^T sigma(W z + u) (= (z - f(z)) / alpha)."""
        return z - self._map(z, u)

    def extra_repr(self) -> str:
        return (
            f"state={self.state}, hidden={self.hidden}, alpha={self.alpha}, gamma={self.gamma}, "
            f"act={self.act_name}, norm={'exact' if self._use_exact() else 'power'}"
        )


class OptEqConvUnit(OptEqUnit):
    """Convolutional unit: W z = conv2d(z, W) (zero padding, stride 1), W^T = conv_transpose2d
    with the same kernel (its exact adjoint). ||W||_2 is the norm of this operator on
    ``spatial`` (H, W) states, by persistent power iteration."""

    def __init__(
        self,
        state: int,
        hidden: int,
        spatial: tuple[int, int],
        kernel: int = 3,
        alpha: float = 1.0,
        gamma: float | None = 1.0,
        act: str = "relu",
        norm_method: str = "power",
        power_iters: int = 30,
        power_tol: float = 1e-7,
    ) -> None:
        _BoundedWeight.__init__(self, gamma, norm_method, power_iters, power_tol)
        if norm_method == "exact":
            raise ConfigError(
                "opteq conv: norm_method 'exact' is not available; use 'power' or 'auto'"
            )
        if kernel % 2 != 1:
            raise ConfigError(f"opteq conv: kernel must be odd (same padding), got {kernel}")
        self.kernel = int(kernel)
        self.pad = self.kernel // 2
        self.spatial = (int(spatial[0]), int(spatial[1]))
        self._init_unit(state, hidden, alpha, act, (self.kernel, self.kernel), self.spatial)
        self.refresh(iters=max(200, self.power_iters))

    def _exact_ok(self) -> bool:
        return False

    sigma = _BoundedWeight.sigma

    def apply_W(self, z: Tensor, weight: Tensor) -> Tensor:
        return F.conv2d(z, weight, padding=self.pad)

    def apply_Wt(self, h: Tensor, weight: Tensor) -> Tensor:
        return F.conv_transpose2d(h, weight, padding=self.pad)

    def extra_repr(self) -> str:
        return (
            f"state={self.state}, hidden={self.hidden}, kernel={self.kernel}, "
            f"spatial={self.spatial}, alpha={self.alpha}, gamma={self.gamma}, act={self.act_name}"
        )


def _check_alpha_act(alpha: float, act: str) -> None:
    if not 0 < float(alpha) <= 1:
        raise ConfigError(f"opteq: alpha must be in (0, 1], got {alpha}")
    if act not in ANTIDERIVATIVES:
        raise ConfigError(
            f"opteq: activation '{act}' is not a monotone 1-Lipschitz activation with a known "
            f"antiderivative; choose from {', '.join(ANTIDERIVATIVES)}"
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
    """readout(z*), z* = T(z*, inject(x)); z0 = 0.

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
    ) -> None:
        super().__init__()
        self.conv = conv
        self.state = int(state)
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
        if self.conv:
            return self.U(self.extractor(x.reshape(x.shape[0], *self.in_shape)))
        return self.U(x.flatten(1))

    def z0(self, u: Tensor) -> Tensor:
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
    )


@models.register("opteq_tiny")
@declare_defaults(**DEFAULTS)
def opteq_tiny(
    in_shape=(64,),
    num_outputs: int = 10,
    width: int = 16,
    hidden: int | None = None,
    alpha: float = 1.0,
    gamma: float | None = 0.9,
    activation: str = "relu",
    regularizer: Any = None,
    reg_step: float = 0.1,
    reg_mode: str = "auto",
    norm_method: str = "auto",
    init_norm: float | None = None,
) -> OptEqModel:
    """Tiny opteq for tests (width 16)."""
    return opteq(
        in_shape,
        num_outputs,
        width,
        hidden,
        alpha,
        gamma,
        activation,
        regularizer,
        reg_step,
        reg_mode,
        norm_method,
        init_norm,
    )


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
    )


@models.register("opteq_deep_tiny")
@declare_defaults(**DEFAULTS)
def opteq_deep_tiny(
    in_shape=(64,),
    num_outputs: int = 10,
    width: int = 16,
    depth: int = 2,
    hidden: int | list[int] | None = None,
    alpha: float = 0.8,
    gamma: float | None = 0.9,
    activation: str = "relu",
    regularizer: Any = None,
    reg_step: float = 0.1,
    reg_mode: str = "auto",
    norm_method: str = "auto",
    init_norm: float | None = None,
) -> OptEqModel:
    """Tiny opteq_deep for tests (width 16, 2 units)."""
    return opteq_deep(
        in_shape,
        num_outputs,
        width,
        depth,
        hidden,
        alpha,
        gamma,
        activation,
        regularizer,
        reg_step,
        reg_mode,
        norm_method,
        init_norm,
    )


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
    )


@models.register("opteq_conv_tiny")
@declare_defaults(**DEFAULTS)
def opteq_conv_tiny(
    in_shape=(1, 8, 8),
    num_outputs: int = 10,
    width: int = 8,
    hidden: int | None = None,
    alpha: float = 0.8,
    gamma: float | None = 0.9,
    activation: str = "relu",
    regularizer: Any = None,
    reg_step: float = 0.1,
    reg_mode: str = "auto",
    extractor: int | None = None,
    pool: int = 4,
    norm_method: str = "power",
    init_norm: float | None = None,
) -> OptEqModel:
    """Tiny opteq_conv for tests (8 channels, no extractor)."""
    return opteq_conv(
        in_shape,
        num_outputs,
        width,
        hidden,
        alpha,
        gamma,
        activation,
        regularizer,
        reg_step,
        reg_mode,
        extractor,
        pool,
        norm_method,
        init_norm,
    )


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
    )


@models.register("opteq_deep_conv_tiny")
@declare_defaults(**DEFAULTS)
def opteq_deep_conv_tiny(
    in_shape=(1, 8, 8),
    num_outputs: int = 10,
    width: int = 8,
    hidden: int | Sequence[int] | None = (4, 8),
    depth: int = 2,
    alpha: float = 0.8,
    gamma: float | None = 0.9,
    activation: str = "relu",
    regularizer: Any = None,
    reg_step: float = 0.1,
    reg_mode: str = "auto",
    extractor: int | None = None,
    pool: int = 4,
    norm_method: str = "power",
    init_norm: float | None = None,
) -> OptEqModel:
    """Tiny opteq_deep_conv for tests (8 state channels, units of 4 and 8 channels)."""
    return opteq_deep_conv(
        in_shape,
        num_outputs,
        width,
        hidden,
        depth,
        alpha,
        gamma,
        activation,
        regularizer,
        reg_step,
        reg_mode,
        extractor,
        pool,
        norm_method,
        init_norm,
    )


for _fn in (opteq, opteq_deep, opteq_conv, opteq_deep_conv):
    _fn.__doc__ = (_fn.__doc__ or "") + _COMMON_DOC
