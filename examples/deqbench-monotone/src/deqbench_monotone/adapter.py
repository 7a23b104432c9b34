"""Registers the standalone monotone_net (unchanged) with deqbench through the documented
hooks only (deqbench.contracts): a Cell that is also a MonotoneCell, a DEQModel, the model's
spectral quantities and declared defaults; and the upstream network as it is, a wrapped model
that computes its own equilibrium and reports its solves (OwnSolverModel, ``own_solver``)."""

from __future__ import annotations

import math

import torch
from monotone_net import MonotoneFcNet
from torch import nn

from deqbench.contracts import SplittingOps
from deqbench.deq import DEQLayer, DEQModel
from deqbench.models import declare_defaults


class MonotoneCell(nn.Module):
    """f(z, u) = relu(W z + u) over upstream's MonotoneLinear (which also holds U)."""

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.linear, self.m = linear, linear.m

    def forward(self, z, u):
        return torch.relu(self.linear.multiply(z)[0] + u)

    def injection_parameters(self):  # U lives in the cell module but is not a cell weight
        return list(self.linear.U.parameters())

    @torch.no_grad()
    def lipschitz_bound(self):  # relu is 1-Lipschitz, so ||W|| bounds the cell in z
        return float(torch.linalg.matrix_norm(self.linear.W().double(), ord=2))

    def prox(self, x):
        return torch.relu(x)

    def prox_mask(self, x):
        return (x > 0).to(x.dtype)

    def splitting_ops(self, alpha=None):
        lin = self.linear
        ops = SplittingOps(lambda x: lin.multiply(x)[0], lambda x: lin.multiply_transpose(x)[0])
        if alpha is not None:
            lin.init_inverse(alpha)
            ops.V, ops.VT = (lambda x: lin.inverse(x)[0]), (lambda x: lin.inverse_transpose(x)[0])
        return ops

    @torch.no_grad()
    def lipschitz(self):
        W = self.linear.W().double()
        eye = torch.eye(W.shape[0], dtype=W.dtype, device=W.device)
        return float(torch.linalg.matrix_norm(eye - W, ord=2))

    @torch.no_grad()
    def monotonicity(self):
        W = self.linear.W().double()
        return float(torch.linalg.eigvalsh((W + W.T) / 2).max())


class MonotoneDEQ(DEQModel):
    """upstream's network with its equilibrium solved by deqbench: inject = U x, readout = head."""

    def __init__(self, net: MonotoneFcNet) -> None:
        super().__init__()
        self.net, self.deq = net, DEQLayer(MonotoneCell(net.linear))

    def inject(self, x):
        return self.net.linear.x_injection(x.flatten(1))[0]

    def readout(self, z):
        return self.net.head(z)

    def spectral_quantities(self):
        cell = self.deq.cell
        lam, L = cell.monotonicity(), cell.lipschitz()
        return {
            "lambda_max_sym_W": lam,
            "lipschitz_I_minus_W": L,
            "fb_alpha_bound": 2 * cell.m / L**2,
        }


PR = {"name": "peaceman_rachford", "max_iter": 300, "tol": 1e-4, "alpha": 1.0}


@declare_defaults(solver=PR, backward={**PR, "name": "ift", "solver": "peaceman_rachford"})
def monotone_fc(in_shape=(784,), num_outputs=10, width=87, m=1.0):
    """upstream's MonotoneFcNet, solved and differentiated by deqbench (any solver applies)."""
    return MonotoneDEQ(MonotoneFcNet(math.prod(in_shape), width, num_outputs, m))


class MonotoneFcNative(MonotoneFcNet):
    """upstream's network as it is, reporting its own solves (deqbench.contracts.OwnSolverModel)."""

    solver_name, backward_name = "peaceman_rachford", "ift"

    def last_solve_stats(self, kind="forward"):  # upstream's iterations and relative change of z
        s, pr = self.solver.stats, self.solver
        if f"{kind}_iters" in s:
            return {"nstep": s[f"{kind}_iters"], "rel_residual": s[f"{kind}_err"],
                    "tol": pr.tol, "max_iter": pr.max_iter}  # fmt: skip

    def last_backward_solve_stats(self):
        return self.last_solve_stats("backward")


@declare_defaults(own_solver="peaceman_rachford", own_backward="ift")
def monotone_fc_native(in_shape=(784,), num_outputs=10, width=87, m=1.0, tol=1e-4):
    """upstream's MonotoneFcNet as it is: its own Peaceman-Rachford forward and backward."""
    return MonotoneFcNative(math.prod(in_shape), width, num_outputs, m, tol=tol)
