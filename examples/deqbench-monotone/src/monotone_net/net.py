"""A fully connected monotone operator equilibrium network, written from the equations of
Winston & Kolter, "Monotone operator equilibrium networks" (NeurIPS 2020), the way research code
usually is: it imports only torch, keeps the input injection inside the layer module, gives the
layer its own ``forward(x, *z)`` signature and brings its own solver and backward pass.

Model (paper section 3): ``z* = relu(W z* + U x + b)`` with

    W = (1 - m) I - A^T A + B - B^T,

so that ``I - W = m I + A^T A - (B - B^T) >= m I``: the operator ``I - W`` is strongly
monotone and the equilibrium exists and is unique for every A, B.

Forward (paper section 4, Peaceman-Rachford splitting), with ``V = (I + alpha (I - W))^-1``::

    u_half = 2 z - u;  z_half = V (u_half + alpha (U x + b));  u = 2 z_half - u_half;
    z = relu(u)

Backward (paper section 4.2): at z*, with D = relu'(W z* + U x + b) (0/1), the gradient
``w = (I - (D W)^T)^-1 g`` is ``w = W^T d + g`` where ``d = D (W^T d + g)``: the same
splitting problem with W^T, V^T and the projection D.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class MonotoneLinear(nn.Module):
    """The linear part of the layer, injection included: ``forward(x, *z) = (U x + W z,)``."""

    def __init__(self, in_dim: int, width: int, m: float = 1.0) -> None:
        super().__init__()
        self.U = nn.Linear(in_dim, width)
        self.A = nn.Linear(width, width, bias=False)
        self.B = nn.Linear(width, width, bias=False)
        self.m = m
        self._V: Tensor | None = None

    def W(self) -> Tensor:
        eye = torch.eye(self.A.weight.shape[0], dtype=self.A.weight.dtype)
        A, B = self.A.weight, self.B.weight
        return (1 - self.m) * eye.to(A.device) - A.T @ A + B - B.T

    def x_injection(self, x: Tensor) -> tuple[Tensor, ...]:
        return (self.U(x),)

    def multiply(self, *z: Tensor) -> tuple[Tensor, ...]:
        return (z[0] @ self.W().T,)

    def multiply_transpose(self, *g: Tensor) -> tuple[Tensor, ...]:
        return (g[0] @ self.W(),)

    def forward(self, x: Tensor, *z: Tensor) -> tuple[Tensor, ...]:
        return (self.U(x) + self.multiply(*z)[0],)

    def init_inverse(self, alpha: float) -> None:
        """Precompute V = (I + alpha (I - W))^-1 for the current weights."""
        W = self.W().detach()
        eye = torch.eye(W.shape[0], dtype=W.dtype, device=W.device)
        self._V = torch.linalg.inv(eye + alpha * (eye - W))

    def inverse(self, *z: Tensor) -> tuple[Tensor, ...]:
        return (z[0] @ self._V.T,)

    def inverse_transpose(self, *g: Tensor) -> tuple[Tensor, ...]:
        return (g[0] @ self._V,)


class ReLU(nn.Module):
    """The proximal operator (projection onto z >= 0) and its 0/1 derivative."""

    def forward(self, *z: Tensor) -> tuple[Tensor, ...]:
        return tuple(torch.relu(zi) for zi in z)

    def derivative(self, *z: Tensor) -> tuple[Tensor, ...]:
        return tuple((zi > 0).to(zi.dtype) for zi in z)


def _splitting(mult, inv, prox, c: Tensor, alpha: float, tol: float, max_iter: int):
    """Peaceman-Rachford for z = prox(M z + c); stops on the relative change of z."""
    z = torch.zeros_like(c)
    u = torch.zeros_like(c)
    it, err = 0, float("inf")
    while it < max_iter and err >= tol:
        u_half = 2 * z - u
        z_half = inv(u_half + alpha * c)
        u = 2 * z_half - u_half
        z_new = prox(u)
        err = float((z_new - z).norm() / (z_new.norm() + 1e-9))
        z, it = z_new, it + 1
    return z, it, err


class PeacemanRachford(nn.Module):
    """Solves the layer with Peaceman-Rachford splitting; backward by the same splitting."""

    def __init__(self, linear: MonotoneLinear, nonlin: ReLU, alpha: float = 1.0,
                 tol: float = 1e-4, max_iter: int = 300) -> None:  # fmt: skip
        super().__init__()
        self.linear, self.nonlin = linear, nonlin
        self.alpha, self.tol, self.max_iter = alpha, tol, max_iter
        self.stats: dict[str, float] = {}

    def forward(self, x: Tensor) -> Tensor:
        lin, alpha = self.linear, self.alpha
        with torch.no_grad():
            lin.init_inverse(alpha)
            c = lin.x_injection(x)[0]
            zs, it, err = _splitting(lambda v: lin.multiply(v)[0], lambda v: lin.inverse(v)[0],
                                     lambda v: self.nonlin(v)[0], c, alpha, self.tol,
                                     self.max_iter)  # fmt: skip
            D = self.nonlin.derivative(*lin(x, zs))[0]
        self.stats = {"forward_iters": it, "forward_err": err}
        z = self.nonlin(*lin(x, zs))[0]  # one step with gradient at z*
        if z.requires_grad:

            def hook(g: Tensor) -> Tensor:
                with torch.no_grad():
                    d, it, err = _splitting(lambda v: lin.multiply_transpose(v)[0],
                                            lambda v: lin.inverse_transpose(v)[0],
                                            lambda v: D * v, g, alpha, self.tol,
                                            self.max_iter)  # fmt: skip
                    self.stats.update(backward_iters=it, backward_err=err)
                    return lin.multiply_transpose(d)[0] + g

            z.register_hook(hook)
        return z


class MonotoneFcNet(nn.Module):
    """x -> monotone layer -> linear head (the paper's MNIST FC model: width 87, m = 1)."""

    def __init__(self, in_dim: int = 784, width: int = 87, num_classes: int = 10,
                 m: float = 1.0, alpha: float = 1.0, tol: float = 1e-4) -> None:  # fmt: skip
        super().__init__()
        self.linear = MonotoneLinear(in_dim, width, m)
        self.nonlin = ReLU()
        self.solver = PeacemanRachford(self.linear, self.nonlin, alpha, tol)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.solver(x.flatten(1)))
