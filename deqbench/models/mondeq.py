"""Monotone operator equilibrium networks (monDEQ; Winston & Kolter 2020; Nguyen 2022 ch. 2-3).

Cell: ``z = relu(W z + u)`` with ``u = U x + b`` and ``W = (1 - m) I - A^T A + B - B^T``, so
``sym(I - W) = m I + A^T A >= m I`` for every A, B: the fixed point is unique and the operator
splitting solvers (:mod:`deqbench.solvers.splitting`) converge.

* ``mondeq_fc``: dense A, B (width x width), U = Linear(in, width), linear readout.
* ``mondeq_conv``: one convolutional tier with *circular* 3x3 convs A, B (C x C); A and B are
  normalised, A = A_w/||A_w||_F and B = h B_w/||B_w||_F, with learnable scales g and h (init 1):
  ``W z = (1 - m) z - g^2 A^T A z + B z - B^T z``. (g enters squared so monotonicity holds for
  any parameter value; monotone_op_net uses g directly.) Inputs are zero-padded by one pixel and
  the prox is ReLU with the 1-pixel frame zeroed, which cancels the wrap-around of the circular
  convs. The resolvent ``(I + alpha (I - W))^-1`` is inverted per frequency with an FFT.
  Readout: interior of z -> AvgPool(4) -> Linear.

Both cells implement :class:`deqbench.solvers.splitting.MonotoneCell`. The default solver is
Peaceman-Rachford (alpha 1, rel 1e-4, max 300) with the PR splitting backward; suites may
override it. ``model.spectral_quantities()`` gives lambda_max((W + W^T)/2), ||I - W|| and the
forward-backward step bound 2m/||I - W||^2.

Example:
    >>> import deqbench, torch
    >>> m = deqbench.models.create("mondeq_fc_tiny")
    >>> logits = m(torch.rand(4, 64))                        # Peaceman-Rachford, alpha 1
    >>> m.spectral_quantities()["lambda_max_sym_W"] <= 1 - m.deq.cell.m + 1e-6
    True
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.contracts import MonotoneCell, example_cell
from ..core.deq import BackwardConfig, DEQLayer, DEQModel, SolverConfig
from ..core.registry import models
from ..solvers.splitting import SplittingOps, fb_step_bound
from . import declare_defaults
from ._common import as_image_shape, numel


def default_solver(alpha: float | str = 1.0) -> SolverConfig:
    return SolverConfig("peaceman_rachford", max_iter=300, tol=1e-4, options={"alpha": alpha})


def _margin(m: float) -> float:
    """The monotonicity margin m (I - W >= m I): must be > 0."""
    if not float(m) > 0:
        from ..core.errors import ConfigError

        raise ConfigError(
            f"monotone DEQ: the monotonicity margin m must be > 0 (W = (1 - m) I - A^T A + B - "
            f"B^T is then strongly monotone with I - W >= m I), got m={m}"
        )
    return float(m)


def default_backward(alpha: float | str = 1.0) -> BackwardConfig:
    return BackwardConfig(
        "ift", solver="peaceman_rachford", max_iter=300, tol=1e-5, options={"alpha": alpha}
    )


class MonFCCell(nn.Module):
    """relu(W z + u), W = (1 - m) I - A^T A + B - B^T (dense)."""

    def __init__(self, width: int, m: float = 1.0) -> None:
        super().__init__()
        self.m = _margin(m)
        bound = 1.0 / math.sqrt(width)  # nn.Linear's default range
        self.A = nn.Parameter(torch.empty(width, width).uniform_(-bound, bound))
        self.B = nn.Parameter(torch.empty(width, width).uniform_(-bound, bound))

    def weight(self) -> Tensor:
        n = self.A.shape[0]
        eye = torch.eye(n, dtype=self.A.dtype, device=self.A.device)
        return (1 - self.m) * eye - self.A.T @ self.A + self.B - self.B.T

    def forward(self, z: Tensor, u: Tensor) -> Tensor:
        return torch.relu(z @ self.weight().T + u)

    # -- MonotoneCell --------------------------------------------------------------------
    def prox(self, x: Tensor) -> Tensor:
        return torch.relu(x)

    def prox_mask(self, x: Tensor) -> Tensor:
        return (x > 0).to(x.dtype)

    @torch.no_grad()
    def splitting_ops(self, alpha: float | None = None) -> SplittingOps:
        W = self.weight()
        ops = SplittingOps(W=lambda x: x @ W.T, WT=lambda x: x @ W)
        if alpha is not None:
            eye = torch.eye(W.shape[0], dtype=W.dtype, device=W.device)
            Vm = torch.linalg.inv(eye + alpha * (eye - W))
            ops.V, ops.VT = (lambda x: x @ Vm.T), (lambda x: x @ Vm)
        return ops

    @torch.no_grad()
    def lipschitz(self) -> float:
        W = self.weight().double()
        return float(
            torch.linalg.matrix_norm(
                torch.eye(W.shape[0], dtype=W.dtype, device=W.device) - W, ord=2
            )
        )

    @torch.no_grad()
    def monotonicity(self) -> float:
        W = self.weight().double()
        return float(torch.linalg.eigvalsh((W + W.T) / 2).max())


@example_cell(MonotoneCell)
def example_monotone_cell(width: int) -> MonFCCell:
    """The conformance checks' MonotoneCell: dense, float64, small seeded weights (FB converges
    for alpha <= 1)."""
    cell = MonFCCell(width, m=1.0).double()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in (cell.A, cell.B):
            p.copy_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype) / math.sqrt(width))
    return cell


def _circ(x: Tensor, k: Tensor) -> Tensor:
    """Circular 'same' cross-correlation of x (B, C, N, N) with an odd kernel k (C, C, r, r)."""
    p = k.shape[-1] // 2
    return F.conv2d(F.pad(x, (p, p, p, p), mode="circular"), k)


def _adj_kernel(k: Tensor) -> Tensor:
    """Kernel of the adjoint (transpose) of the circular conv with k."""
    return k.transpose(0, 1).flip(-2, -1)


def _kernel_fft(k: Tensor, n: int) -> Tensor:
    """Per-frequency matrices K(w) (rfft2 grid: n x (n//2+1) x C_out x C_in) such that the
    circular 'same' cross-correlation y = _circ(x, k) is y(w) = K(w) x(w)."""
    r = k.shape[-1]
    p = r // 2
    grid = k.new_zeros(k.shape[0], k.shape[1], n, n)
    grid[..., :r, :r] = k.flip(-2, -1)
    grid = torch.roll(grid, shifts=(-p, -p), dims=(-2, -1))
    return torch.fft.rfft2(grid).permute(2, 3, 0, 1)


class MonConvCell(nn.Module):
    """One circular-conv tier: relu_border((1 - m) z - g^2 A^T A z + B z - B^T z + u)."""

    interior: Tensor  # buffer

    def __init__(self, channels: int, size: int, m: float = 1.0, kernel: int = 3) -> None:
        super().__init__()
        self.m = _margin(m)
        self.size = int(size)  # padded spatial size N
        conv = nn.Conv2d(channels, channels, kernel, bias=False)
        self.A_w = nn.Parameter(conv.weight.detach().clone())
        nn.init.kaiming_uniform_(conv.weight, a=math.sqrt(5))
        self.B_w = nn.Parameter(conv.weight.detach().clone())
        self.g = nn.Parameter(torch.ones(()))
        self.h = nn.Parameter(torch.ones(()))
        frame = torch.zeros(1, 1, size, size)
        frame[..., 1:-1, 1:-1] = 1.0
        self.register_buffer("interior", frame, persistent=False)

    def kernels(self) -> tuple[Tensor, Tensor]:
        A = self.A_w / self.A_w.norm()
        B = self.h * self.B_w / self.B_w.norm()
        return A, B

    def _w_apply(self, z: Tensor, A: Tensor, S: Tensor, transpose: bool) -> Tensor:
        # W z = (1 - m) z - g^2 A^T A z + S z with S = B - B^T (skew), W^T uses -S.
        AtA = _circ(_circ(z, A), _adj_kernel(A))
        Sz = _circ(z, S)
        return (1 - self.m) * z - self.g**2 * AtA + (-Sz if transpose else Sz)

    def forward(self, z: Tensor, u: Tensor) -> Tensor:
        A, B = self.kernels()
        return self.prox(self._w_apply(z, A, B - _adj_kernel(B), False) + u)

    # -- MonotoneCell --------------------------------------------------------------------
    def prox(self, x: Tensor) -> Tensor:
        return torch.relu(x) * self.interior.to(x.dtype)

    def prox_mask(self, x: Tensor) -> Tensor:
        return (x > 0).to(x.dtype) * self.interior.to(x.dtype)

    def _freq(self) -> tuple[Tensor, Tensor]:
        """(I - W)(w) per frequency and its identity; shapes (n, n//2+1, C, C)."""
        A, B = self.kernels()
        Ah, Bh = _kernel_fft(A, self.size), _kernel_fft(B, self.size)
        eye = torch.eye(A.shape[0], dtype=Ah.dtype, device=A.device)
        AhA = Ah.mH @ Ah
        return self.m * eye + self.g**2 * AhA - (Bh - Bh.mH), eye

    @torch.no_grad()
    def splitting_ops(self, alpha: float | None = None) -> SplittingOps:
        A, B = self.kernels()
        S = B - _adj_kernel(B)
        ops = SplittingOps(
            W=lambda x: self._w_apply(x, A, S, False), WT=lambda x: self._w_apply(x, A, S, True)
        )
        if alpha is not None:
            ImW, eye = self._freq()
            Vh = torch.linalg.inv(eye + alpha * ImW)  # (n, n//2+1, C, C)
            VhH = Vh.mH
            n = self.size

            def apply(x: Tensor, M: Tensor) -> Tensor:
                xh = torch.fft.rfft2(x)  # (B, C, n, n//2+1)
                yh = torch.einsum("uvij,bjuv->biuv", M, xh)
                return torch.fft.irfft2(yh, s=(n, n))

            ops.V, ops.VT = (lambda x: apply(x, Vh)), (lambda x: apply(x, VhH))
        return ops

    @torch.no_grad()
    def lipschitz(self) -> float:
        ImW, _ = self._freq()
        return float(torch.linalg.matrix_norm(ImW.to(torch.complex128), ord=2).max())

    @torch.no_grad()
    def monotonicity(self) -> float:
        ImW, eye = self._freq()
        Wh = (eye - ImW).to(torch.complex128)
        return float(torch.linalg.eigvalsh((Wh + Wh.mH) / 2).max())


class _MonDEQBase(DEQModel):
    def spectral_quantities(self) -> dict[str, float]:
        """lambda_max((W + W^T)/2) (must be <= 1 - m), ||I - W||_2, the FB step bound
        2m/||I - W||^2 and the monotonicity margin (1 - m) - lambda_max."""
        cell = cast("MonFCCell | MonConvCell", self.deq.cell)
        lam = cell.monotonicity()
        L = cell.lipschitz()
        return {
            "lambda_max_sym_W": lam,
            "lipschitz_I_minus_W": L,
            "fb_alpha_bound": fb_step_bound(cell),
            "monotonicity_gap": (1 - cell.m) - lam,
        }


class MonDEQFC(_MonDEQBase):
    def __init__(
        self,
        in_features: int,
        width: int,
        num_outputs: int,
        m: float = 1.0,
        alpha: float | str = 1.0,
    ) -> None:
        super().__init__()
        self.U = nn.Linear(in_features, width)
        self.deq = DEQLayer(MonFCCell(width, m), default_solver(alpha), default_backward(alpha))
        self.head = nn.Linear(width, num_outputs)

    def inject(self, x: Tensor) -> Tensor:
        return self.U(x.flatten(1))

    def readout(self, z: Tensor) -> Tensor:
        return self.head(z)


class MonDEQConv(_MonDEQBase):
    def __init__(
        self,
        in_shape,
        num_outputs: int,
        channels: int,
        m: float = 1.0,
        pool: int = 4,
        alpha: float | str = 1.0,
    ) -> None:
        super().__init__()
        c_in, h, w = as_image_shape(in_shape)
        if h != w:
            from ..core.errors import ConfigError

            raise ConfigError(f"mondeq_conv needs square images; got {h}x{w}")
        self.in_shape = (c_in, h, w)
        self.U = nn.Conv2d(c_in, channels, 3, padding=1)
        cell = MonConvCell(channels, h + 2, m)
        self.deq = DEQLayer(cell, default_solver(alpha), default_backward(alpha))
        k = max(1, min(pool, h))
        self.pool = nn.AvgPool2d(k)
        self.head = nn.Linear(channels * (h // k) ** 2, num_outputs)

    def inject(self, x: Tensor) -> Tensor:
        x = F.pad(x.view(x.shape[0], *self.in_shape), (1, 1, 1, 1))
        return self.U(x)

    def readout(self, z: Tensor) -> Tensor:
        return self.head(self.pool(z[..., 1:-1, 1:-1]).flatten(1))


#: Declared defaults (deqbench.models.declare_defaults): Peaceman-Rachford splitting (alpha 1)
#: forward and on the adjoint's linear system (papers: monDEQ). The monotone parameterisation
#: I - W >= m I makes the splitting converge for every alpha > 0, but not plain iteration: the
#: cell's Jacobian can have spectral radius > 1, so neither forward nor adjoint uses it.
DEFAULTS: dict[str, Any] = dict(
    solver={"name": "peaceman_rachford", "max_iter": 300, "tol": 1e-4, "alpha": 1.0},
    backward={
        "name": "ift",
        "solver": "peaceman_rachford",
        "max_iter": 300,
        "tol": 1e-5,
        "alpha": 1.0,
    },
    init="default",
)


@models.register("mondeq_fc")
@declare_defaults(**DEFAULTS)
def mondeq_fc(
    in_shape=(784,),
    num_outputs: int = 10,
    width: int = 87,
    m: float = 1.0,
    alpha: float | str = 1.0,
) -> MonDEQFC:
    """Fully connected monDEQ (MNIST width 87, m = 1); PR solver and PR backward by default."""
    return MonDEQFC(numel(in_shape), width, num_outputs, m, alpha)


@models.register("mondeq_fc_tiny")
@declare_defaults(**DEFAULTS)
def mondeq_fc_tiny(
    in_shape=(64,), num_outputs: int = 10, width: int = 16, m: float = 1.0, alpha: float | str = 1.0
) -> MonDEQFC:
    """Tiny mondeq_fc for tests (width 16)."""
    return MonDEQFC(numel(in_shape), width, num_outputs, m, alpha)


@models.register("mondeq_conv")
@declare_defaults(**DEFAULTS)
def mondeq_conv(
    in_shape=(3, 32, 32),
    num_outputs: int = 10,
    channels: int = 81,
    m: float = 1.0,
    pool: int = 4,
    alpha: float | str = 1.0,
) -> MonDEQConv:
    """Single-tier circular-conv monDEQ (CIFAR 81 channels, MNIST 54); FFT resolvent."""
    return MonDEQConv(in_shape, num_outputs, channels, m, pool, alpha)


@models.register("mondeq_conv_tiny")
@declare_defaults(**DEFAULTS)
def mondeq_conv_tiny(
    in_shape=(1, 8, 8),
    num_outputs: int = 10,
    channels: int = 6,
    m: float = 1.0,
    pool: int = 4,
    alpha: float | str = 1.0,
) -> MonDEQConv:
    """Tiny mondeq_conv for tests (6 channels)."""
    return MonDEQConv(in_shape, num_outputs, channels, m, pool, alpha)
