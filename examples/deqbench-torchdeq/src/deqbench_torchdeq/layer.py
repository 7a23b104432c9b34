"""A deqbench DEQ layer whose forward and backward are TorchDEQ's (``get_deq``).

:class:`TorchDEQLayer` is a :class:`deqbench.deq.DEQLayer` (same cell, same ``SolverConfig`` /
``BackwardConfig``, same ``last_forward_stats`` / ``last_backward_stats``), so every deqbench
analysis measures it like a native layer; only the equilibrium computation is TorchDEQ's:

* backward ``ift``: TorchDEQ's ``IFTGrad`` (``torch.autograd.Function``, one tracked f step and
  the adjoint solved with ``b_solver``); ``jfb``: ``grad=1``; ``phantom``: ``grad=k, tau``;
  ``unrolled`` does not exist in TorchDEQ (ConfigError);
* forward and adjoint solvers: ``anderson``, ``broyden``, ``fixed_point`` or their
  ``torchdeq_*`` names, options as for the adapters in :mod:`deqbench_torchdeq.solvers`;
* every key is passed to ``get_deq`` explicitly (``f_stop_mode``/``b_stop_mode``, ``f_tol``/
  ``b_tol``, ...) and read back from the built module: TorchDEQ silently ignores misspelt keys
  (a known TorchDEQ limitation), so a mismatch raises instead of running with TorchDEQ's defaults;
* f-evaluations are counted by wrapping f (forward solve, tracked gradient steps) and the
  adjoint map inside TorchDEQ's solver registry (backward VJPs).

:func:`wrap` converts a built deqbench model in place (parameters shared).

Example:
    >>> import deqbench, torch
    >>> from deqbench_torchdeq import wrap
    >>> model = wrap(deqbench.models.create("fc_deq_tiny"))                  # doctest: +SKIP
    >>> model(torch.randn(4, 64)).sum().backward()                             # doctest: +SKIP
    >>> model.deq.last_backward_stats.solver                                   # doctest: +SKIP
    'torchdeq_fixed_point'
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import Tensor, nn

from deqbench.core import verdict
from deqbench.deq import BackwardConfig, DEQLayer, SolverConfig, deq_layers
from deqbench.errors import ConfigError

from .solvers import ADAPTER_OPTIONS, PASSED, RETURNED, stats_from_info

#: deqbench or adapter solver name -> TorchDEQ key
SOLVER_KEYS = {
    "anderson": "anderson",
    "torchdeq_anderson": "anderson",
    "broyden": "broyden",
    "torchdeq_broyden": "broyden",
    "fixed_point": "fixed_point_iter",
    "torchdeq_fixed_point": "fixed_point_iter",
}
ADAPTER_NAME = {
    "anderson": "torchdeq_anderson",
    "broyden": "torchdeq_broyden",
    "fixed_point_iter": "torchdeq_fixed_point",
}


class CountedSolver:
    """A TorchDEQ solver that counts the calls of the map it is given (registered in TorchDEQ's
    solver registry, so ``get_deq`` can use it as ``f_solver``/``b_solver``)."""

    def __init__(self, key: str, options: dict[str, Any]) -> None:
        from torchdeq.solver import get_solver

        self.key = key
        self.options = dict(options)
        self.fn = get_solver(key)
        self.calls = 0
        self.info: Any = None

    def __call__(self, func, x0, max_iter=50, tol=1e-3, stop_mode="abs", indexing=None, **kw):
        self.calls = 0

        def fc(z):
            self.calls += 1
            return func(z)

        out = self.fn(
            fc,
            x0,
            max_iter=max_iter,
            tol=tol,
            stop_mode=stop_mode,
            indexing=indexing,
            **{**kw, **self.options},
        )
        self.info = out[2]
        return out


_REGISTERED: dict[str, CountedSolver] = {}


def counted(key: str, options: dict[str, Any]) -> tuple[str, CountedSolver]:
    """Register (once) a counting TorchDEQ solver for (key, options); returns (name, solver)."""
    from torchdeq.solver import register_solver

    name = f"deqbench_counted:{key}:{json.dumps(options, sort_keys=True, default=str)}"
    if name not in _REGISTERED:
        _REGISTERED[name] = CountedSolver(key, options)
        register_solver(name, _REGISTERED[name])
    return name, _REGISTERED[name]


def _solver_key(role: str, name: str, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    if name not in SOLVER_KEYS:
        raise ConfigError(
            f"torchdeq_deq: {role} solver '{name}' has no TorchDEQ counterpart; use one of "
            f"{', '.join(sorted(SOLVER_KEYS))}"
        )
    key = SOLVER_KEYS[name]
    allowed = PASSED[key] | ADAPTER_OPTIONS
    bad = sorted(set(options) - allowed)
    if bad:
        raise ConfigError(
            f"torchdeq_deq: {role} solver '{name}': unknown option '{bad[0]}'; "
            f"options: {', '.join(sorted(allowed))}"
        )
    return key, {k: v for k, v in options.items() if k not in ADAPTER_OPTIONS}


class TorchDEQLayer(DEQLayer):
    """DEQ layer computed by TorchDEQ's ``get_deq`` (see the module docstring).

    Args:
        cell: ``nn.Module`` with ``forward(z, u)``.
        solver, backward: deqbench configs, mapped onto TorchDEQ's keys.
        core: TorchDEQ core, ``sliced`` (its default) or ``indexing``.
    """

    def __init__(
        self,
        cell: nn.Module,
        solver: SolverConfig | None = None,
        backward: BackwardConfig | None = None,
        core: str = "sliced",
    ) -> None:
        super().__init__(cell, solver, backward)
        if core not in ("sliced", "indexing"):
            raise ConfigError(f"torchdeq_deq: core must be 'sliced' or 'indexing', got {core!r}")
        self.core = core
        self._td: Any = None
        self._td_key: str | None = None

    # TorchDEQ's module holds closures: it is rebuilt after pickling or deep-copying (both go
    # through __getstate__), never copied.
    def __getstate__(self) -> dict[str, Any]:
        state = dict(super().__getstate__())
        for k in ("_td", "_td_key", "_f_counter", "_b_counter"):
            state[k] = None
        return state

    def settings(self) -> dict[str, Any]:
        """The keyword arguments passed to ``torchdeq.get_deq`` for the current configs."""
        s, b = self.solver_cfg, self.backward_cfg
        fkey, fopts = _solver_key("forward", s.name, dict(s.options))
        if b.name == "unrolled":
            raise ConfigError(
                "torchdeq_deq: TorchDEQ has no 'unrolled' backward; use ift, jfb or phantom"
            )
        kw: dict[str, Any] = {
            "core": self.core,
            "f_max_iter": int(s.max_iter),
            "eval_f_max_iter": int(s.max_iter),
            "f_tol": float(s.tol),
            "f_stop_mode": s.stop_mode,
            "ift": b.name == "ift",
            "hook_ift": False,
            "grad": 1 if b.name in ("ift", "jfb") else max(1, int(b.k)),
            "tau": float(b.tau) if b.name == "phantom" else 1.0,
            "n_states": 1,
        }
        kw["f_solver"], self._f_counter = counted(fkey, fopts)
        if b.name == "ift":
            bkey, bopts = _solver_key("adjoint", b.solver, dict(b.options))
            kw.update(b_max_iter=int(b.max_iter), b_tol=float(b.tol), b_stop_mode=b.stop_mode)
            kw["b_solver"], self._b_counter = counted(bkey, bopts)
            self._b_key = bkey
        else:
            kw.update(
                b_solver=kw["f_solver"],
                b_max_iter=int(b.max_iter),
                b_tol=float(b.tol),
                b_stop_mode=b.stop_mode,
            )
            self._b_counter, self._b_key = None, None
        self._f_key = fkey
        return kw

    def torchdeq_module(self) -> Any:
        """The TorchDEQ module for the current configs (built on first use, checked)."""
        from torchdeq import get_deq

        kw = self.settings()
        key = json.dumps(kw, sort_keys=True, default=str)
        if self._td is None or self._td_key != key:
            td = get_deq(**kw)
            # TorchDEQ ignores unknown keys silently: check what it actually uses.
            want = {
                "f_max_iter": kw["f_max_iter"],
                "f_tol": kw["f_tol"],
                "f_stop_mode": kw["f_stop_mode"],
                "b_max_iter": kw["b_max_iter"],
                "b_tol": kw["b_tol"],
                "b_stop_mode": kw["b_stop_mode"],
            }
            got = {k: getattr(td, k, None) for k in want}
            if got != want:
                raise ConfigError(f"torchdeq_deq: TorchDEQ built {got}, expected {want}")
            # a plain attribute, not a registered submodule: TorchDEQ's module holds closures
            # (not picklable) and has no parameters or buffers
            object.__setattr__(self, "_td", td)
            self._td_key = key
        return self._td

    def solve(self, u: Tensor, z0: Tensor, cfg: SolverConfig | None = None):
        """Forward solve with the TorchDEQ adapter of the configured solver (no grad)."""
        from . import solvers as adapters

        cfg = cfg or self.solver_cfg
        key, opts = _solver_key("forward", cfg.name, dict(cfg.options))
        fn = getattr(adapters, ADAPTER_NAME[key])
        with torch.no_grad():
            z, stats = fn(
                lambda z_: self.cell(z_, u),
                z0,
                max_iter=cfg.max_iter,
                tol=cfg.tol,
                stop_mode=cfg.stop_mode,
                **opts,
            )
        self._checked("forward", stats, z, u, cfg)
        self.last_forward_stats = stats
        return z, stats

    def _checked(self, kind: str, stats: Any, z: Tensor | None, u: Tensor | None, cfg: Any,
                 ledger: Any = None) -> None:  # fmt: skip
        """deqbench's own check of a TorchDEQ solve (``deqbench.core.verdict``): the claim
        against the reported residual, the residual recomputed where the runner verifies, and
        the solve recorded in the runner's ledger."""
        name = cfg.name if kind == "forward" else cfg.solver
        verdict.check_claim(stats, cfg.tol, cfg.stop_mode, f"torchdeq:{name}")
        if kind == "forward" and z is not None and u is not None and verdict.verifying():
            with torch.no_grad():
                verdict.recheck(stats, self.cell(z, u), z)
        verdict.record(kind, stats, cfg.max_iter, ledger)

    def forward(self, u: Tensor, z0: Tensor | None = None) -> Tensor:
        if z0 is None:
            z0 = torch.zeros_like(u)
        needs_grad = torch.is_grad_enabled() and (
            u.requires_grad or any(p.requires_grad for p in self.cell.parameters())
        )
        td = self.torchdeq_module()
        counts = {"solve": 0, "grad": 0, "backward": 0}
        phase = {"forward": True}

        def func(z: Tensor) -> Tensor:
            if not phase["forward"]:
                counts["backward"] += 1
            elif torch.is_grad_enabled():
                counts["grad"] += 1
            else:
                counts["solve"] += 1
            return self.cell(z, u)

        td.train(needs_grad)
        writer = self._on_backward if needs_grad and self.backward_cfg.name == "ift" else None
        z_out, info = td(func, z0, backward_writer=writer)
        phase["forward"] = False
        s = self.solver_cfg
        self.last_forward_stats = stats_from_info(
            ADAPTER_NAME[self._f_key],
            self._f_key,
            info,
            counts["solve"],
            s.tol,
            s.stop_mode,
            s.max_iter,
            extra={"returned": RETURNED[self._f_key]},
        )
        self._checked("forward", self.last_forward_stats, z_out[-1].detach(), u.detach(), s)
        self._ledger = verdict.current()  # the backward may run in another thread (CUDA)
        self.last_backward_stats = None
        self.f_evals_grad = counts["grad"]
        self._counts = counts
        self.vjp_bwd = 0
        return z_out[-1]

    def _on_backward(self, info: Any) -> None:
        b = self.backward_cfg
        c = self._b_counter
        nvjp = c.calls if c is not None else 0
        self.last_backward_stats = stats_from_info(
            ADAPTER_NAME[self._b_key],
            self._b_key,
            info,
            nvjp,
            b.tol,
            b.stop_mode,
            b.max_iter,
        )
        self.vjp_bwd = nvjp + 1  # the adjoint solve's VJPs and the final one through f
        self._checked("adjoint", self.last_backward_stats, None, None, b,
                      getattr(self, "_ledger", None))  # fmt: skip

    def extra_repr(self) -> str:
        return "torchdeq " + super().extra_repr() + f", core={self.core}"


def wrap(model: nn.Module, core: str = "sliced") -> nn.Module:
    """Replace every DEQLayer of ``model`` by a :class:`TorchDEQLayer` around the same cell
    (parameters shared; configs copied). Returns ``model``."""
    targets = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, DEQLayer) and not isinstance(child, TorchDEQLayer):
                targets.append((parent, name, child))
    if not targets and not any(True for _ in deq_layers(model)):
        raise ConfigError(f"torchdeq_deq: {type(model).__name__} has no DEQ layer to wrap")
    for parent, name, child in targets:
        layer = TorchDEQLayer(child.cell, child.solver_cfg, child.backward_cfg, core=core)
        setattr(parent, name, layer)
    return model
