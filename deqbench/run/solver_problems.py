"""The small test problems solvers are checked on: a 0.5-contraction (or the test cell a
structured solver's model family registers), forward and adjoint (:func:`_problem`), and the
check of a solver's return value (:func:`_check_result`).
"""

from __future__ import annotations

from typing import Any

#: batch and width of the solver checks' test problems
BATCH, WIDTH = 2, 6


def _contraction_cell() -> Any:
    """z -> 0.5 tanh(W z) + u with ||W|| = 1: a 0.5-contraction."""
    import torch
    from torch import nn

    class Contraction(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            g = torch.Generator().manual_seed(0)
            w = torch.randn(WIDTH, WIDTH, generator=g, dtype=torch.float64)
            self.W = nn.Parameter(w / torch.linalg.matrix_norm(w, ord=2))

        def forward(self, z: Any, u: Any) -> Any:
            return 0.5 * torch.tanh(z @ self.W.T) + u

    return Contraction()


def _structure_cell(structure: type) -> Any:
    """The test cell of ``structure`` (width WIDTH) that a model family registered in
    :data:`~deqbench.core.contracts.EXAMPLE_CELLS` (the monDEQ's for MonotoneCell), or None."""
    from ..core.contracts import EXAMPLE_CELLS
    from ..core.registry import models

    if structure not in EXAMPLE_CELLS:
        models.names()  # the built-in model modules register the test cells of their structures
    make = EXAMPLE_CELLS.get(structure)
    return make(WIDTH) if make is not None else None


def _problem(cell: Any, adjoint: bool) -> tuple[Any, Any]:
    """(f, z0): a CellMap (forward) or an AdjointMap at an approximate fixed point (adjoint)."""
    import torch

    from ..core.backward import AdjointMap
    from ..core.deq import CellMap

    g = torch.Generator().manual_seed(1)
    u = torch.rand(BATCH, WIDTH, generator=g, dtype=torch.float64) + 0.5
    if not adjoint:
        return CellMap(cell, u), torch.zeros_like(u)
    with torch.no_grad():
        z = torch.zeros_like(u)
        for _ in range(60):
            z = cell(z, u)
    # plain autograd, not torch.func.vjp: torch.func imports torch._dynamo (2-4 s) into the
    # process that checks the suite (the coordinator of a run, which never needs it)
    z_in = z.detach().requires_grad_(True)
    with torch.enable_grad():
        out = cell(z_in, u)
    grad = torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64)

    def adj(w: Any) -> Any:
        (vjp,) = torch.autograd.grad(out, z_in, w, retain_graph=True)
        return vjp + grad

    return AdjointMap(adj, cell, z, u, grad), grad.clone()


def _check_result(res: Any, z0: Any, max_iter: int) -> tuple[str, str] | None:
    """(clause, message) of the first broken clause of a solver's return value, or None."""
    import torch

    from ..solvers.base import STATUSES, SolverStats

    if not isinstance(res, tuple | list) or len(res) != 2:
        what = type(res).__name__ + (f" of {len(res)}" if isinstance(res, tuple | list) else "")
        return "solver.returns", f"returned a {what}, not (z, SolverStats)"
    z, st = res
    if not isinstance(z, torch.Tensor) or z.shape != z0.shape:
        got = tuple(z.shape) if isinstance(z, torch.Tensor) else type(z).__name__
        return "solver.returns", f"z is {got}, not a tensor shaped like z0 {tuple(z0.shape)}"
    if not isinstance(st, SolverStats):
        return (
            "solver.returns",
            f"the second value is a {type(st).__name__}, not deqbench.solvers.base.SolverStats",
        )
    B = z0.shape[0]
    if isinstance(st.nstep, bool) or not isinstance(st.nstep, int) or not 1 <= st.nstep <= max_iter:
        return "solver.stats", f"nstep {st.nstep!r} is not an int in [1, max_iter={max_iter}]"
    for k in ("abs_residual", "rel_residual"):
        v = getattr(st, k)
        if not isinstance(v, torch.Tensor) or tuple(v.shape) != (B,):
            got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            return "solver.stats", f"{k} is {got}, not a ({B},) tensor (one per sample)"
    for k in ("abs_trace", "rel_trace"):
        v = getattr(st, k)
        ok = isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape[1] == B
        if not ok:
            got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            return "solver.stats", f"{k} is {got}, not a (T, {B}) tensor (one row per iterate)"
        if v.shape[0] > st.nstep:
            return "solver.stats", f"{k} has {v.shape[0]} rows for nstep {st.nstep} (T <= nstep)"
    if st.status not in STATUSES:
        return "solver.stats", f"status {st.status!r} is not one of {', '.join(STATUSES)}"
    if bool(st.converged) != (st.status == "converged"):
        return "solver.stats", f"converged={st.converged!r} but status={st.status!r}"
    return None
