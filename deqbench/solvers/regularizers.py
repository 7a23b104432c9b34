"""Feature regularisers R(z) of OptEq (Xie et al. 2023 sections 5.1, 5.2 and 7.2), beside the SAM
solver whose option ``prior`` names one; the OptEq models import them from here.

A regulariser acts on a batch of states ``z`` (B, ...) and is used two ways:

* **R-dagger** (section 5.2): the prior of the SAM solver (``deqbench.solvers.get("sam")``,
  option ``prior``), which selects argmin R over the fixed-point set;
* **R-star** (section 5.1, Theorem 4): an architecture change, z = T(T_R(z), x) with
  T_R = prox_{step R} (L1, L2: closed form) or T_R = I - step grad R (the others); the OptEq
  models take it as the parameter ``regularizer``.

Built-ins (Table 2 and section 7.2):

========================  ==================================================  ===========
name                      R                                                   T_R
========================  ==================================================  ===========
``l2``                    0.5 ||z||^2 per sample                              z / (1 + s)
``l1``                    ||z||_1 per sample                                  soft threshold
``incay``                 2 / (||z||^2 + 2 eps) per sample                    gradient step
``decorrelation``         0.5 ||D Z Z^T D - I||_F^2, Z = states as columns     gradient step
``hsic``                  sum_{i<j} HSIC(Z_i,:, Z_j,:), Gaussian kernels       gradient step
========================  ==================================================  ===========

Every regulariser has a ``weight`` (the lambda of Xie et al. 2023 Table 3): R = weight * R_0.
``decorrelation`` and ``hsic`` couple the samples of a batch (``batch = True``): Z is the
(m x B) matrix whose columns are the flattened states of the batch. Gradients are closed form
(plain tensor operations), so T_R is differentiable by autograd and by ``torch.func`` (the IFT
backward).

Example:
    >>> import torch
    >>> from deqbench.solvers.regularizers import get_regularizer
    >>> r = get_regularizer("l1", weight=0.5)
    >>> r.prox(torch.tensor([[1.0, -0.2]]), 1.0)
    tensor([[0.5000, -0.0000]])
"""

from __future__ import annotations

import difflib
from typing import Any, ClassVar

import torch
from torch import Tensor

from ..core.errors import ConfigError

__all__ = [
    "REGULARIZERS",
    "Regularizer",
    "L2",
    "L1",
    "Incay",
    "Decorrelation",
    "HSIC",
    "get_regularizer",
    "names",
]


def _flat(z: Tensor) -> Tensor:
    return z.reshape(z.shape[0], -1)


class Regularizer:
    """Base class. Subclasses define :meth:`value` and :meth:`grad` (closed form), and
    :meth:`prox` when it has a closed form.

    Attributes:
        name: registry key.
        batch: True if R couples the samples of a batch (needs B >= 2 to be meaningful).
        has_prox: True if :meth:`prox` is closed form.
        lipschitz: Lipschitz constant of grad R (None when unknown or nonsmooth); SAM uses
            eta = 1 / (2 L) by default (Xie et al. 2023 Theorem 5).
    """

    name: ClassVar[str] = "regularizer"
    batch: ClassVar[bool] = False
    has_prox: ClassVar[bool] = False

    def __init__(self, weight: float = 1.0) -> None:
        weight = float(weight)
        if not weight >= 0:
            raise ConfigError(f"regularizer '{self.name}': weight must be >= 0, got {weight}")
        self.weight = weight

    @property
    def lipschitz(self) -> float | None:
        return None

    def value(self, z: Tensor) -> Tensor:
        """R(z) for the whole batch (a scalar; separable regularisers sum over samples)."""
        raise NotImplementedError

    def grad(self, z: Tensor) -> Tensor:
        """grad_z R(z), shaped like ``z`` (a subgradient for nonsmooth R)."""
        raise NotImplementedError

    def prox(self, z: Tensor, step: float) -> Tensor:
        """prox_{step R}(z) (closed form only; see :attr:`has_prox`)."""
        raise NotImplementedError(f"regularizer '{self.name}' has no closed-form prox")

    def step(self, z: Tensor, step: float, mode: str = "auto") -> Tensor:
        """T_R(z): the prox (``mode`` prox, or auto when closed form) or a gradient step."""
        if mode not in ("auto", "prox", "grad"):
            raise ConfigError(f"regularizer step mode must be auto|prox|grad, got {mode!r}")
        if mode == "prox" or (mode == "auto" and self.has_prox):
            return self.prox(z, step)
        return z - step * self.grad(z)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(weight={self.weight})"


class L2(Regularizer):
    """R(z) = weight * 0.5 ||z||^2 per sample; prox z / (1 + step weight) (feature decay)."""

    name = "l2"
    has_prox = True

    @property
    def lipschitz(self) -> float | None:
        return self.weight

    def value(self, z: Tensor) -> Tensor:
        return 0.5 * self.weight * z.pow(2).sum()

    def grad(self, z: Tensor) -> Tensor:
        return self.weight * z

    def prox(self, z: Tensor, step: float) -> Tensor:
        return z / (1.0 + step * self.weight)


class L1(Regularizer):
    """R(z) = weight * ||z||_1 per sample; prox: soft threshold at step * weight (sparsity)."""

    name = "l1"
    has_prox = True

    def value(self, z: Tensor) -> Tensor:
        return self.weight * z.abs().sum()

    def grad(self, z: Tensor) -> Tensor:
        return self.weight * torch.sign(z)

    def prox(self, z: Tensor, step: float) -> Tensor:
        t = step * self.weight
        return torch.sign(z) * torch.clamp(z.abs() - t, min=0.0)


class Incay(Regularizer):
    """R(z) = weight * 2 / (||z||^2 + 2 eps) per sample (feature incay: the gradient step
    *expands* z by the factor 1 + 4 step weight / (||z||^2 + 2 eps)^2; Xie et al. 2023 Table 2 prints
    the factor with a minus sign, which would shrink z, contradicting "feature expansion")."""

    name = "incay"

    def __init__(self, weight: float = 1.0, eps: float = 1.0) -> None:
        super().__init__(weight)
        self.eps = float(eps)
        if not self.eps > 0:
            raise ConfigError(f"regularizer 'incay': eps must be > 0, got {eps}")

    def _den(self, z: Tensor) -> Tensor:
        return _flat(z).pow(2).sum(1) + 2 * self.eps

    def value(self, z: Tensor) -> Tensor:
        return self.weight * (2.0 / self._den(z)).sum()

    def grad(self, z: Tensor) -> Tensor:
        den = self._den(z).view(-1, *([1] * (z.dim() - 1)))
        return -4.0 * self.weight * z / den.pow(2)


class Decorrelation(Regularizer):
    """F_Dz(Z) = weight * 0.5 ||D Z Z^T D - I||_F^2 (Xie et al. 2023 Eq. 13), Z (m x B) the batch of
    flattened states as columns, D = diag(1 / ||Z_i,:||): the squared off-diagonal cosine
    similarities between feature dimensions (over the batch)."""

    name = "decorrelation"
    batch = True

    def __init__(self, weight: float = 1.0, eps: float = 1e-8) -> None:
        super().__init__(weight)
        self.eps = float(eps)

    def _parts(self, z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        Z = _flat(z).t()  # (m, B)
        n = torch.linalg.vector_norm(Z, dim=1, keepdim=True) + self.eps
        Y = Z / n
        C = Y @ Y.t()
        return Y, C, n

    def value(self, z: Tensor) -> Tensor:
        _, C, _ = self._parts(z)
        eye = torch.eye(C.shape[0], dtype=C.dtype, device=C.device)
        return 0.5 * self.weight * (C - eye).pow(2).sum()

    def grad(self, z: Tensor) -> Tensor:
        Y, C, n = self._parts(z)
        eye = torch.eye(C.shape[0], dtype=C.dtype, device=C.device)
        G = 2.0 * (C - eye) @ Y  # dR/dY
        # Y_i = Z_i / ||Z_i||: project out the radial part of each row.
        gZ = (G - (G * Y).sum(1, keepdim=True) * Y) / n
        return (self.weight * gZ.t()).reshape(z.shape)


class HSIC(Regularizer):
    """sum_{i<j} HSIC(Z_i,:, Z_j,:) (Xie et al. 2023 section 7.2.1) with the biased estimator
    HSIC(X, Y) = tr(K_X H K_Y H) / (B - 1)^2, Gaussian kernels k(a, b) = exp(-(a-b)^2 / (2 s^2)).

    Z (m x B) holds the flattened states as columns, so each of the m feature dimensions is a
    random variable observed over the batch. With K~_i = H K_i H,
    sum_{i<j} <K~_i, K~_j> = 0.5 (||sum_i K~_i||^2 - sum_i ||K~_i||^2), computed in O(m B^2).
    The bandwidth ``sigma`` (None: each feature's batch standard deviation, clamped below by
    ``min_sigma``) depends on z in the default case, and :meth:`grad` differentiates through it
    (so it is the gradient of :meth:`value`). Non-convex: SAM's guarantee does not apply.
    """

    name = "hsic"
    batch = True

    def __init__(self, weight: float = 1.0, sigma: float | None = None, min_sigma: float = 1e-3):
        super().__init__(weight)
        self.sigma = None if sigma is None else float(sigma)
        self.min_sigma = float(min_sigma)

    def _kernels(self, z: Tensor) -> tuple[Tensor, Tensor, Tensor, int]:
        Z = _flat(z).t()  # (m, B)
        B = Z.shape[1]
        if self.sigma is None:  # the batch variance (differentiable; no 1/std at var = 0)
            s2 = Z.var(dim=1, keepdim=True).clamp_min(self.min_sigma**2).unsqueeze(-1)
        else:
            s2 = torch.full((Z.shape[0], 1, 1), self.sigma**2, dtype=Z.dtype, device=Z.device)
        # s2: (m, 1, 1)
        diff = Z.unsqueeze(2) - Z.unsqueeze(1)  # (m, B, B): a_p - a_q
        K = torch.exp(-diff.pow(2) / (2 * s2))
        return K, diff, s2, B

    @staticmethod
    def _center(K: Tensor) -> Tensor:
        return (
            K - K.mean(-1, keepdim=True) - K.mean(-2, keepdim=True) + K.mean((-1, -2), keepdim=True)
        )

    def value(self, z: Tensor) -> Tensor:
        K, _, _, B = self._kernels(z)
        if B < 2:
            return z.new_zeros(())
        Kc = self._center(K)
        S = Kc.sum(0)
        tot = S.pow(2).sum() - Kc.pow(2).sum()
        return self.weight * 0.5 * tot / (B - 1) ** 2

    def grad(self, z: Tensor) -> Tensor:
        K, diff, s2, B = self._kernels(z)
        if B < 2:
            return torch.zeros_like(z)
        Kc = self._center(K)
        S = Kc.sum(0, keepdim=True)
        M = self._center(S - Kc) / (B - 1) ** 2  # dR/dK_i (symmetric)
        MK = M * K
        # dR/da_p = -(2 / s^2) sum_q (M o K)[p, q] (a_p - a_q)   (s held fixed)
        g = -(2.0 / s2.squeeze(-1)) * (MK * diff).sum(-1)  # (m, B)
        if self.sigma is None:
            # + dR/ds^2 * ds^2/da_p with s^2 the unbiased batch variance of feature i (zero where
            # it is clamped at min_sigma): dK/ds^2 = K d^2 / (2 s^4), ds^2/da_p = 2 (a_p - mean)
            # / (B - 1)
            Z = _flat(z).t()
            var = Z.var(dim=1, keepdim=True)  # (m, 1)
            c = (MK * diff.pow(2)).sum((-1, -2)).unsqueeze(-1) / (2.0 * var.pow(2))
            free = var > self.min_sigma**2
            g = g + torch.where(free, c * 2.0 * (Z - Z.mean(1, keepdim=True)) / (B - 1), 0.0)
        return (self.weight * g.t()).reshape(z.shape)


REGULARIZERS: dict[str, type[Regularizer]] = {
    cls.name: cls for cls in (L2, L1, Incay, Decorrelation, HSIC)
}


def names() -> list[str]:
    return sorted(REGULARIZERS)


def get_regularizer(
    spec: str | dict[str, Any] | Regularizer | None, **params: Any
) -> Regularizer | None:
    """A regulariser from a name (``"l1"``), a dict (``{"name": "l1", "weight": 0.15}``) or an
    instance; ``None`` gives None. Unknown names and parameters are a ConfigError.

    Example:
        >>> get_regularizer({"name": "hsic", "weight": 0.1})
        HSIC(weight=0.1)
    """
    if spec is None:
        return None
    if isinstance(spec, Regularizer):
        return spec
    if isinstance(spec, dict):
        spec = dict(spec)
        if "name" not in spec:
            raise ConfigError(
                f"regularizer: missing 'name' in {spec}; choose from {', '.join(names())}"
            )
        name = str(spec.pop("name"))
        params = {**spec, **params}
    else:
        name = str(spec)
    if name not in REGULARIZERS:
        close = difflib.get_close_matches(name, names(), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"unknown regularizer '{name}'{hint}; choose from {', '.join(names())}")
    cls = REGULARIZERS[name]
    try:
        return cls(**params)
    except TypeError as exc:
        import inspect

        allowed = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
        raise ConfigError(
            f"regularizer '{name}': bad parameters {sorted(params)} ({exc}); allowed: {', '.join(allowed)}"
        ) from None
