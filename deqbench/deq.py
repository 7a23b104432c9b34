"""The DEQ layer: a cell f(z, u), a forward solver and a backward mode.

A DEQ model holds one or more :class:`DEQLayer` modules. Each layer solves ``z* = f(z*, u)`` with
a registered solver and differentiates with one of the modes in :mod:`deqbench.backward`
(``ift``, ``unrolled``, ``jfb``, ``phantom``). The last forward/backward :class:`SolverStats`
are kept on the layer so analyses can read them.

Example:
    >>> import torch, deqbench
    >>> from deqbench.deq import DEQLayer, SolverConfig, BackwardConfig
    >>> cell = deqbench.models.get("fc_deq_tiny")().deq.cell          # doctest: +SKIP
    >>> layer = DEQLayer(cell, SolverConfig("anderson", max_iter=50, tol=1e-6))  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn

from .solvers.base import SolverStats

BACKWARD_MODES = ("ift", "unrolled", "jfb", "phantom")


@dataclass
class SolverConfig:
    """Forward solver: registered name, budget, tolerance and solver-specific options."""

    name: str = "anderson"
    max_iter: int = 50
    tol: float = 1e-4
    stop_mode: str = "rel"
    options: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class BackwardConfig:
    """Backward mode.

    Attributes:
        name: ift | unrolled | jfb | phantom.
        solver: adjoint solver for ``ift`` (default: fixed_point).
        max_iter, tol, stop_mode: adjoint budget and tolerance (``ift``).
        k: steps for ``unrolled`` (K, from z0) and ``phantom`` (from z*). ``unrolled``
            backpropagates through K steps of plain iteration z <- f(z) (or through the
            forward solver's own ``unroll`` when it defines one, e.g. SAM), whatever the
            forward solver; its reported residual is ||z_K - z_{K-1}||, that of z_{K-1} (no
            extra f-evaluation).
        tau: damping of ``phantom`` steps.
        b_init: adjoint initial guess, "grad" (saves one VJP) or "zeros".
        second_order: how a double backward (Hessian-vector products) differentiates the
            adjoint: "implicit" (default; exact, one more linear solve with JVPs) or "refine"
            (``refine`` differentiable adjoint steps from the converged adjoint; the error decays
            as rho(J)^refine).
        refine: steps for ``second_order="refine"``.
        options: adjoint solver options.
    """

    name: str = "ift"
    solver: str = "fixed_point"
    max_iter: int = 50
    tol: float = 1e-6
    stop_mode: str = "rel"
    k: int = 5
    tau: float = 1.0
    b_init: str = "grad"
    second_order: str = "implicit"
    refine: int = 100
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Bad values are a ConfigError here (the suite schema checks the same for suites): a
        typo in ``second_order`` silently took the refine path (an HVP 61% off), ``b_init``
        "gard" meant "zeros", ``k = 0`` became 1."""
        from .errors import ConfigError

        choices = {
            "b_init": ("grad", "zeros"),
            "second_order": ("implicit", "refine"),
            "stop_mode": ("rel", "abs"),
        }
        bad = [
            f"{k} must be one of {', '.join(v)}, got {getattr(self, k)!r}"
            for k, v in choices.items()
            if getattr(self, k) not in v
        ]
        if self.name not in BACKWARD_MODES:
            bad.insert(
                0, f"unknown backward mode {self.name!r}; modes: {', '.join(BACKWARD_MODES)}"
            )
        for k, lo in (("k", 1), ("max_iter", 1), ("refine", 0)):
            v = getattr(self, k)
            if isinstance(v, bool) or int(v) != v or v < lo:
                bad.append(f"{k} must be an integer >= {lo}, got {v!r}")
        if not 0 < float(self.tau) <= 1:
            bad.append(f"tau must be in (0, 1], got {self.tau!r}")
        if not float(self.tol) >= 0:
            bad.append(f"tol must be >= 0, got {self.tol!r}")
        if bad:
            raise ConfigError("backward: " + "; ".join(bad))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class CellMap:
    """The map ``z -> cell(z, u)`` handed to forward solvers.

    Generic solvers just call it. It exposes ``cell`` and ``u`` so that solvers needing a
    family's structure (e.g. monDEQ operator splitting, which reads the monotone-operator
    interface of the cell) can reach it.
    """

    __slots__ = ("cell", "u")

    def __init__(self, cell: nn.Module, u: Tensor) -> None:
        self.cell = cell
        self.u = u

    def __call__(self, z: Tensor) -> Tensor:
        return self.cell(z, self.u)


class DEQLayer(nn.Module):
    """Equilibrium layer around ``cell`` (an ``nn.Module`` with ``forward(z, u)``).

    The layer's forward returns z* for injection ``u``. In training (grad enabled) the
    configured backward mode attaches gradients; under ``no_grad`` it only solves.
    """

    def __init__(
        self,
        cell: nn.Module,
        solver: SolverConfig | None = None,
        backward: BackwardConfig | None = None,
    ) -> None:
        super().__init__()
        self.cell = cell
        self.solver_cfg = solver or SolverConfig()
        self.backward_cfg = backward or BackwardConfig()
        self.last_forward_stats: SolverStats | None = None
        self.last_backward_stats: SolverStats | None = None
        self.f_evals_grad = 0
        self.vjp_bwd = 0

    def configure(
        self, solver: SolverConfig | None = None, backward: BackwardConfig | None = None
    ) -> None:
        if solver is not None:
            self.solver_cfg = replace(solver)
        if backward is not None:
            if backward.name not in BACKWARD_MODES:
                from .errors import ConfigError

                raise ConfigError(
                    f"unknown backward mode '{backward.name}'; choose from {', '.join(BACKWARD_MODES)}"
                )
            self.backward_cfg = replace(backward)

    def f(self, z: Tensor, u: Tensor) -> Tensor:
        """The cell map f(z, u)."""
        return self.cell(z, u)

    def solve(
        self, u: Tensor, z0: Tensor, cfg: SolverConfig | None = None
    ) -> tuple[Tensor, SolverStats]:
        """Forward solve under no_grad; records ``last_forward_stats``."""
        from . import solvers

        cfg = cfg or self.solver_cfg
        fn = solvers.get(cfg.name)
        with torch.no_grad():
            z, stats = fn(
                CellMap(self.cell, u),
                z0,
                max_iter=cfg.max_iter,
                tol=cfg.tol,
                stop_mode=cfg.stop_mode,
                **cfg.options,
            )
        self.last_forward_stats = stats
        return z, stats

    def forward(self, u: Tensor, z0: Tensor | None = None) -> Tensor:
        from . import backward as bw

        if z0 is None:
            z0 = torch.zeros_like(u)
        needs_grad = torch.is_grad_enabled() and (
            u.requires_grad or any(p.requires_grad for p in self.cell.parameters())
        )
        if not needs_grad:
            z, _ = self.solve(u, z0)
            self.last_backward_stats = None
            return z
        return bw.apply(self, u, z0)

    def extra_repr(self) -> str:
        s, b = self.solver_cfg, self.backward_cfg
        return f"solver={s.name}(max_iter={s.max_iter}, tol={s.tol}), backward={b.name}"


def deq_layers(model: nn.Module) -> Iterator[DEQLayer]:
    """Every DEQLayer inside ``model`` (including ``model`` itself)."""
    for m in model.modules():
        if isinstance(m, DEQLayer):
            yield m


def is_deq(model: nn.Module) -> bool:
    return any(True for _ in deq_layers(model))


def configure(
    model: nn.Module, solver: SolverConfig | None = None, backward: BackwardConfig | None = None
) -> None:
    """Set the solver and backward mode of every DEQ layer of ``model``."""
    for layer in deq_layers(model):
        layer.configure(solver, backward)


def last_stats(model: nn.Module) -> dict[str, float]:
    """Forward/backward f-evaluations and residuals of the last pass, summed over DEQ layers
    (counts) and maxed (residuals). Empty dict for models without DEQ layers."""
    out: dict[str, float] = {}
    layers = list(deq_layers(model))
    if not layers:
        return out
    fw = [layer.last_forward_stats for layer in layers if layer.last_forward_stats is not None]
    bw = [layer.last_backward_stats for layer in layers if layer.last_backward_stats is not None]
    if fw:
        out["forward_nstep"] = float(sum(s.nstep for s in fw))
        out["forward_rel_residual"] = max(s.rel_max for s in fw)
        out["forward_abs_residual"] = max(s.abs_max for s in fw)
        out["forward_converged"] = float(all(s.converged for s in fw))
        out["forward_diverged"] = float(any(s.status == "diverged" for s in fw))
        njvp = sum(getattr(s, "njvp", 0) for s in fw)
        if njvp:  # Jacobian-vector products (newton_krylov), counted apart from f-evaluations
            out["forward_njvp"] = float(njvp)
    if bw:
        out["backward_nstep"] = float(sum(s.nstep for s in bw))
        out["backward_rel_residual"] = max(s.rel_max for s in bw)
        out["backward_abs_residual"] = max(s.abs_max for s in bw)
        out["backward_converged"] = float(all(s.converged for s in bw))
    return out


class DEQModel(nn.Module):
    """Base class of DEQ models: ``readout(deq(inject(x), z0(u)))``.

    Subclasses set ``self.deq = DEQLayer(cell)`` and implement :meth:`inject` and
    :meth:`readout`; :meth:`z0` defaults to zeros shaped like ``u``. Models with several
    equilibrium layers override :meth:`forward` and hold several DEQLayers.
    """

    deq: DEQLayer

    def inject(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def readout(self, z: Tensor) -> Tensor:
        raise NotImplementedError

    def z0(self, u: Tensor) -> Tensor:
        return torch.zeros_like(u)

    @property
    def cell(self) -> nn.Module:
        return self.deq.cell

    def cell_parameters(self) -> list[nn.Parameter]:
        """The cells' own parameters (without those a cell declares as injection)."""
        from .contracts import cell_weights

        return [p for layer in deq_layers(self) for _, p in cell_weights(layer.cell)]

    def equilibrium(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(z*, u) for input x under no_grad."""
        with torch.no_grad():
            u = self.inject(x)
            z, _ = self.deq.solve(u, self.z0(u))
        return z, u

    def forward(self, x: Tensor) -> Tensor:
        u = self.inject(x)
        z = self.deq(u, self.z0(u))
        return self.readout(z)

    @property
    def last_forward_stats(self) -> SolverStats | None:
        return self.deq.last_forward_stats

    @property
    def last_backward_stats(self) -> SolverStats | None:
        return self.deq.last_backward_stats
