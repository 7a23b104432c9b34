"""The configs of a DEQ layer: its forward solver (:class:`SolverConfig`), its backward mode
(:class:`BackwardConfig`) and how its cell runs (:class:`Runtime`). A leaf module (torch and
:mod:`deqbench.core.errors` at import; a BackwardConfig checks its mode against the registry of
backward modes when it is made): :mod:`deqbench.core.deq` and :mod:`deqbench.core.backward` both
read these types; import them from ``deqbench.deq``.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

#: the built-in backward modes (:mod:`deqbench.backward`; the registry ``backward_modes`` also
#: holds plugins' modes, entry-point group ``deqbench.backward``)
BACKWARD_MODES = ("ift", "unrolled", "jfb", "phantom", "reversible", "shine")


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
        name: a registered backward mode (``deqbench ls backward``): ift | unrolled | jfb |
            phantom | reversible | shine, or a plugin's. ``reversible`` needs the forward solver
            ``reversible``, ``shine`` the forward solver ``broyden``
            (:attr:`deqbench.backward.BackwardMode.forward`; checked when a layer is configured).
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
        options: adjoint solver options (``ift``), or the mode's own options for a mode that
            declares them (``shine``: fallback, fallback_threshold, refine_steps, refine_init;
            ``reversible``: reversal_tol), validated here.
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
        from .registry import backward_modes  # its built-ins import torch: only here

        if self.name not in backward_modes:
            bad.insert(0, str(backward_modes.unknown(self.name)))
        else:
            from ..backward.base import mode_of, option_problems

            bad += option_problems(mode_of(self.name), self.options)
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


def to_dataclass(section: str, d: dict[str, Any]) -> Any:
    """A validated ``solver``/``backward`` dict -> SolverConfig/BackwardConfig (extras -> options)."""
    dc: Any = SolverConfig if section == "solver" else BackwardConfig
    names = {f.name for f in fields(dc)} - {"options"}
    return dc(
        **{k: v for k, v in d.items() if k in names},
        options={k: v for k, v in d.items() if k not in names},
    )


AMP_MODES = ("none", "bf16")
GRAPH_MODES = ("auto", "off")


@dataclass(frozen=True)
class Runtime:
    """How a DEQ layer's cell runs (the suite's ``runtime`` section).

    Attributes:
        cuda_graph: "auto" (default): on CUDA, forward solves and IFT adjoint solves of
            launch-bound cells (states of at most 2M elements: fc1024 at batch 512 is 0.5M;
            Anderson and Broyden up to 16M: conv64 at batch 128 is 8.4M, where fixed point
            stays eager, a graph gaining it nothing) with a
            solver that supports it (fixed_point, anderson, broyden) are captured as a CUDA
            graph on first use for each
            (batch shape, dtype, parameter storage, train/eval mode) and replayed afterwards; a
            cell that cannot be captured (host syncs, shapes that change) falls back to eager
            once and is remembered. ``SolverStats.path`` says which path ran. "off": eager.
            A cell whose forward keeps Python-level state (caches keyed on parameter versions,
            counters) must set the class attribute ``cuda_graph_safe = False`` (OptEq does):
            a replayed graph re-runs kernels, not Python.
            A solver's own ``cuda_graph`` option, where set, wins.
        amp: "none" (default) or "bf16": the cell (and, in training, the whole model forward)
            runs under bfloat16 autocast, while the solver's iterate, residuals, Anderson
            history and stopping test stay in the state dtype (float32). bf16's relative
            residual floor is about 4e-3: use a tolerance of 1e-2 or looser.
        compile: False (default), True (``torch.compile`` with the inductor backend) or a
            backend name ("eager", "aot_eager", "inductor", ...): the cell is compiled once per
            layer; parameters stay the module's.
        compile_mode: ``torch.compile``'s ``mode`` (None, "default", "reduce-overhead",
            "max-autotune", ...).
    """

    cuda_graph: str = "auto"
    amp: str = "none"
    compile: bool | str = False
    compile_mode: str | None = None

    def __post_init__(self) -> None:
        from .errors import ConfigError

        if self.cuda_graph not in GRAPH_MODES:
            raise ConfigError(
                f"runtime.cuda_graph must be one of {', '.join(GRAPH_MODES)}, got {self.cuda_graph!r}"
            )
        if self.amp not in AMP_MODES:
            raise ConfigError(
                f"runtime.amp must be one of {', '.join(AMP_MODES)}, got {self.amp!r}"
            )
        if not isinstance(self.compile, (bool, str)) or self.compile == "":
            raise ConfigError(
                f"runtime.compile must be true, false or a torch.compile backend name, got "
                f"{self.compile!r}"
            )

    @property
    def backend(self) -> str | None:
        """The torch.compile backend, or None when not compiling."""
        if self.compile is False:
            return None
        return "inductor" if self.compile is True else str(self.compile)

    def autocast(self, device: torch.device | str) -> contextlib.AbstractContextManager:
        """The autocast context of ``amp`` on ``device`` (a null context for "none")."""
        if self.amp == "none":
            return contextlib.nullcontext()
        dev = torch.device(device).type
        # no weight cache: a CUDA graph captured inside would read cast weights that the cache
        # frees when the block ends (an illegal memory access at a later replay)
        return torch.autocast(device_type=dev, dtype=torch.bfloat16, cache_enabled=False)
