"""Covariance kernels for the kGLM initialisation (Tsuchida et al. 2022): squared exponential, periodic,
periodic-times-SE (the GP sequence task's kernel) and white noise, with sums and products.

Kernels are pluggable: built-ins register with ``@kernels.register("name")``; third-party
packages add names through the entry-point group ``deqbench.kernels`` (value
``package.module:factory``), with the same rules as the other registries (no shadowing of
built-ins, ambiguity errors, ``DEQBENCH_DISABLE_PLUGIN_AUTOLOAD``). A factory takes keyword
hyperparameters and returns a :class:`Kernel`: a callable ``k(A, B) -> (n, m)`` on coordinate
tensors ``A`` (n, d) and ``B`` (m, d) (1-D tensors are treated as d = 1).

A kernel spec (suite YAML, init params) is a name, a dict ``{name: ..., **hyperparameters}``,
or a list of specs, which are summed.

Example:
    >>> import torch
    >>> from deqbench.kernels import make_kernel
    >>> k = make_kernel([{"name": "se", "lengthscale": 1.0}, {"name": "white", "variance": 1e-8}])
    >>> x = torch.linspace(0, 1, 5, dtype=torch.float64)
    >>> K = k(x, x)                        # (5, 5), strictly positive definite
    >>> bool(torch.linalg.eigvalsh(K).min() > 0)
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..core.errors import ConfigError
from ..core.registry import Registry, publish


class _KernelRegistry(Registry[Callable[..., "Kernel"]]):
    """Registry whose built-ins live in this module (not a package of modules): they are
    loaded once it is imported."""

    def _load_builtins(self) -> None:
        self._builtins_loaded = True

    @property
    def builtins_loaded(self) -> bool:
        return True


kernels: Registry[Callable[..., Kernel]] = publish(_KernelRegistry("kernels", "deqbench.kernels"))


def _coords(a: Tensor) -> Tensor:
    a = torch.as_tensor(a)
    if not a.is_floating_point():
        a = a.double()
    return a.unsqueeze(1) if a.dim() == 1 else a


def sqdist(a: Tensor, b: Tensor) -> Tensor:
    """Squared Euclidean distances (n, m) between coordinate rows (exact, no cancellation)."""
    a, b = _coords(a), _coords(b)
    return ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)


class Kernel:
    """A covariance function ``k(A, B) -> (n, m)``; supports ``k1 + k2`` and ``k1 * k2``."""

    name = "kernel"

    def __call__(self, a: Tensor, b: Tensor) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def __add__(self, other: Kernel) -> Kernel:
        return SumKernel([self, other])

    def __mul__(self, other: Kernel) -> Kernel:
        return ProductKernel([self, other])

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v:g}" for k, v in vars(self).items() if isinstance(v, float))
        return f"{self.name}({params})"


class SumKernel(Kernel):
    name = "sum"

    def __init__(self, parts: list[Kernel]) -> None:
        self.parts = parts

    def __call__(self, a: Tensor, b: Tensor) -> Tensor:
        out = self.parts[0](a, b)
        for k in self.parts[1:]:
            out = out + k(a, b)
        return out

    def __repr__(self) -> str:
        return " + ".join(map(repr, self.parts))


class ProductKernel(Kernel):
    name = "product"

    def __init__(self, parts: list[Kernel]) -> None:
        self.parts = parts

    def __call__(self, a: Tensor, b: Tensor) -> Tensor:
        out = self.parts[0](a, b)
        for k in self.parts[1:]:
            out = out * k(a, b)
        return out

    def __repr__(self) -> str:
        return " * ".join(map(repr, self.parts))


class SquaredExponential(Kernel):
    """variance * exp(-||a - b||^2 / (2 lengthscale^2))."""

    name = "se"

    def __init__(self, lengthscale: float = 1.0, variance: float = 1.0) -> None:
        if lengthscale <= 0:
            raise ConfigError(f"kernel se: lengthscale must be > 0, got {lengthscale}")
        self.lengthscale = float(lengthscale)
        self.variance = float(variance)

    def __call__(self, a: Tensor, b: Tensor) -> Tensor:
        return self.variance * torch.exp(-sqdist(a, b) / (2 * self.lengthscale**2))


class Periodic(Kernel):
    """variance * exp(-2 sin^2(pi ||a - b|| / period) / lengthscale^2) (MacKay's periodic kernel).

    With period = pi and lengthscale = sqrt(2) this is exp(-sin^2 ||a - b||), the periodic factor
    of the GP sequence task (Tsuchida et al. 2022 section 4)."""

    name = "periodic"

    def __init__(
        self, period: float = math.pi, lengthscale: float = math.sqrt(2.0), variance: float = 1.0
    ) -> None:
        if period <= 0 or lengthscale <= 0:
            raise ConfigError("kernel periodic: period and lengthscale must be > 0")
        self.period = float(period)
        self.lengthscale = float(lengthscale)
        self.variance = float(variance)

    def __call__(self, a: Tensor, b: Tensor) -> Tensor:
        d = sqdist(a, b).sqrt()
        s = torch.sin(math.pi * d / self.period)
        return self.variance * torch.exp(-2 * s**2 / self.lengthscale**2)


class White(Kernel):
    """variance * 1[a == b] (white noise: ``variance * I`` on k(X, X); makes K strictly PD)."""

    name = "white"

    def __init__(self, variance: float = 1e-8) -> None:
        self.variance = float(variance)

    def __call__(self, a: Tensor, b: Tensor) -> Tensor:
        d = sqdist(a, b)
        return self.variance * (d == 0).to(d.dtype)


@kernels.register("se")
def se(lengthscale: float = 1.0, variance: float = 1.0) -> Kernel:
    """Squared exponential ``variance * exp(-d^2 / (2 lengthscale^2))``."""
    return SquaredExponential(lengthscale, variance)


@kernels.register("periodic")
def periodic(
    period: float = math.pi, lengthscale: float = math.sqrt(2.0), variance: float = 1.0
) -> Kernel:
    """Periodic ``variance * exp(-2 sin^2(pi d / period) / lengthscale^2)``."""
    return Periodic(period, lengthscale, variance)


@kernels.register("periodic_se")
def periodic_se(
    lengthscale: float = 1.0,
    period: float = math.pi,
    periodic_lengthscale: float = math.sqrt(2.0),
    variance: float = 0.1,
) -> Kernel:
    """Periodic times SE. The defaults give the GP sequence task's kernel
    ``0.1 exp(-d^2/2) exp(-sin^2 d)`` (Tsuchida et al. 2022 section 4)."""
    return ProductKernel(
        [SquaredExponential(lengthscale, variance), Periodic(period, periodic_lengthscale, 1.0)]
    )


@kernels.register("white")
def white(variance: float = 1e-8) -> Kernel:
    """White noise ``variance * 1[a == b]``."""
    return White(variance)


def make_kernel(spec: Any) -> Kernel:
    """A :class:`Kernel` from a spec: a Kernel, a name, ``{name: ..., **params}``, or a list
    of specs (summed).

    Raises:
        ConfigError: unknown hyperparameter; UnknownNameError: unknown kernel name.
    """
    if isinstance(spec, Kernel):
        return spec
    if isinstance(spec, str):
        return kernels.create(spec)
    if isinstance(spec, dict):
        params = dict(spec)
        name = params.pop("name", None)
        if name is None:
            raise ConfigError(f"kernel spec {spec!r} needs a 'name'")
        try:
            return kernels.create(name, **params)
        except TypeError as exc:
            raise ConfigError(f"kernel '{name}': {exc}") from exc
    if isinstance(spec, (list, tuple)):
        if not spec:
            raise ConfigError("empty kernel list")
        parts = [make_kernel(s) for s in spec]
        return parts[0] if len(parts) == 1 else SumKernel(parts)
    raise ConfigError(f"cannot build a kernel from {spec!r}")
