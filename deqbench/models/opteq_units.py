"""OptEq's unit layers: f(z, x) = alpha W^T sigma(W z + U x + b) + (1 - alpha) z with
||W||_2 <= gamma held by a bilinear form on persistent singular vectors (:class:`_BoundedWeight`),
dense (:class:`OptEqUnit`) and 3x3 convolutional (:class:`OptEqConvUnit`), the activations with
their antiderivatives (:data:`ANTIDERIVATIVES`) and the convex objective a unit minimises
(:class:`ConvexObjective`). :mod:`deqbench.models.opteq` composes them into cells and models.
"""

from __future__ import annotations

import math
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.errors import ConfigError
from ._common import activation

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

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        """A loaded state (a checkpoint) holds V with the singular vectors refreshed for it:
        taken as current, so the next forward does not refresh again (a model trained on
        from a checkpoint then computes what the model that saved it would)."""
        super()._load_from_state_dict(*args, **kwargs)
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
