"""Shared by the backward-lab tests (test_backward_modes, test_revdeq, test_shine): one torch
thread and a fixed seed per test, the tanh cell of BACKWARD_LAB.md section 4 and the dense IFT
adjoint (the independent reference of the RevDEQ and SHINE gradients)."""

from __future__ import annotations

import pytest
import torch
from torch import nn


@pytest.fixture(autouse=True)
def one_thread_seeded():
    """Autouse in every module that imports it."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)  # every random batch below is the same in every run
    yield
    torch.set_num_threads(old)


class TanhCell(nn.Module):
    """f(z, x) = tanh(W z + U x + b), ||W||_2 = ``scale`` (BACKWARD_LAB.md section 4); ``W``
    given: used as it is (no W drawn)."""

    def __init__(self, d: int = 8, scale: float = 0.5, seed: int = 0, dtype=torch.float64, W=None):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        if W is None:
            W = torch.randn(d, d, generator=g, dtype=dtype)
            W = W * scale / torch.linalg.matrix_norm(W, 2)
        self.W = nn.Parameter(W)
        self.U = nn.Parameter(torch.randn(d, d, generator=g, dtype=dtype) / d**0.5)
        self.b = nn.Parameter(0.1 * torch.randn(d, generator=g, dtype=dtype))

    def forward(self, z, x):
        return torch.tanh(z @ self.W.T + x @ self.U.T + self.b)


def dense_ift_adjoint(cell, x, zbar):
    """(z*, w): z* by plain iteration to 1e-15, then per sample the dense Jacobian J and
    w = solve((I - J)^T, zbar) (checked to 1e-12)."""
    z = torch.zeros_like(x)
    with torch.no_grad():
        for _ in range(5000):
            z_new = cell(z, x)
            if float((z_new - z).norm()) <= 1e-15:
                break
            z = z_new
    ws = []
    for i in range(x.shape[0]):
        J = torch.autograd.functional.jacobian(lambda v, i=i: cell(v[None], x[i : i + 1])[0], z[i])
        A = (torch.eye(J.shape[0], dtype=J.dtype) - J).T
        w = torch.linalg.solve(A, zbar[i])
        assert float((A @ w - zbar[i]).norm()) <= 1e-12
        ws.append(w)
    return z, torch.stack(ws)
