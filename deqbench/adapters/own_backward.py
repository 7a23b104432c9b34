"""A network's own backward (adjoint) solve, measured: :class:`OwnBackward`, the option
``OwnLoop(adjoint=OwnBackward(...))``.

An implicit backward solves, for the gradient ``g`` arriving at the equilibrium ``z*``, the
adjoint fixed point ``w = J^T w + g`` (``J`` the Jacobian of the map at ``z*``) and passes
``w`` on instead of ``g``. Libraries (and the DEQ chapter of Kolter, Duvenaud & Johnson, "Deep
Implicit Layers", 2020) do it with a gradient hook on the output of a map call after the loop
that runs the solve, each iteration a vector-Jacobian product (VJP) through a second map call
at a detached copy of ``z*``. deqbench hooks every map call with gradient the loop's forward
makes (the hooks are registered at the call, so they run before the library's):

* the call whose outgoing gradient differs from its incoming one is where the library solved:
  ``g`` is what arrived there, ``w`` what left;
* every gradient that passes through another map call's output meanwhile is one VJP of the
  solve (``nstep``); where that call's state input is a leaf tensor, the VJP's result
  ``J^T v`` is read too, and the trace row is the residual of ``v``: ``J^T v + g - v``;
* the residual of ``w`` is recomputed by deqbench: one more evaluation of the map where the
  library linearised it (the input of the call its VJPs went through, else ``z*``) and one
  VJP (``extra["check_evals"]``), ``abs = ||J^T w + g - w||``, ``rel = abs /
  ||J^T w + g||`` per sample, judged against the library's tolerance under the run's stop
  rule (the library's own rule, ``stop``, gives ``extra["own_converged"]`` beside it).

A backward that passes the gradient on unchanged (Jacobian-free) has no adjoint solve: no
stats. The stats are reported by ``OwnLoop.last_backward_solve_stats()`` and recorded as the
cell's ``adjoint`` solves.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..core import own_solves, trees
from ..core.errors import ConfigError
from ..solvers.base import SolverStats, check_stop, make_stats, residuals, rule_value

__all__ = ["AdjointRecord", "OwnBackward"]


@dataclass
class OwnBackward:
    """What the library's own backward solve stops on: ``tol`` (a number or the dotted name
    of the network's attribute holding it), ``max_iter`` (the same; None: unknown),
    ``stop_mode`` (rel | abs) and ``stop`` (its stop rule, :data:`deqbench.solvers.base.
    STOP_RULES`; None: not declared)."""

    tol: float | str
    max_iter: int | str | None = None
    stop_mode: str = "rel"
    stop: str | None = None

    def __post_init__(self) -> None:
        if self.stop_mode not in ("rel", "abs"):
            raise ConfigError(f"OwnBackward: stop_mode must be 'rel' or 'abs', got "
                              f"{self.stop_mode!r}")  # fmt: skip
        if self.stop is not None:
            check_stop(self.stop)

    def record(self, net: nn.Module, fn: Any, state: Any, name: str) -> AdjointRecord:
        """A record for one forward of ``net`` (``fn`` its map, ``state`` the selector)."""

        def value(v: Any) -> Any:
            return functools.reduce(getattr, v.split("."), net) if isinstance(v, str) else v

        mi = value(self.max_iter)
        return AdjointRecord(fn, state, float(value(self.tol)), None if mi is None else int(mi),
                             self.stop_mode, self.stop, name)  # fmt: skip


class AdjointRecord:
    """The hooks and the result (:attr:`stats`) of the adjoint solve of one forward."""

    def __init__(
        self,
        fn: Any,
        state: Any,
        tol: float,
        max_iter: int | None,
        stop_mode: str,
        own_stop: str | None,
        name: str,
    ) -> None:
        self.fn, self.state = fn, state
        self.tol, self.max_iter, self.stop_mode = tol, max_iter, stop_mode
        self.own_stop, self.name = own_stop, name
        self.judge = own_solves.run_rule()
        self.stats: SolverStats | None = None
        self._calls: list[tuple[Any, Tensor, tuple, dict]] = []
        self._active: int | None = None
        self._g: Tensor | None = None
        self._last_v: Tensor | None = None
        self._vjp_call: int | None = None
        self._vjps = 0
        self._abs: list[Tensor] = []
        self._rel: list[Tensor] = []

    def attach(self, tree: Any, z: Tensor, fz: Tensor, args: tuple, kwargs: dict) -> None:
        """Hook a map call with gradient (``z``: its state input, ``fz``: its state output)."""
        if fz.grad_fn is None:
            return
        if not any(t is z for t in trees.leaves(tree)):
            raise ConfigError(
                f"OwnBackward: the state of the map's iterate is not one tensor of it "
                f"({trees.describe(tree)}): give state= (e.g. state='est.0') to measure the "
                "adjoint solve"
            )
        k = len(self._calls)
        self._calls.append((tree, z, args, kwargs))
        fz.register_hook(functools.partial(self._incoming, k))
        fz.grad_fn.register_prehook(functools.partial(self._outgoing, k, fz.output_nr))
        if z.requires_grad and z.is_leaf:
            z.register_hook(self._jtv)

    def _incoming(self, k: int, g: Tensor) -> None:
        if self._active is None:  # a gradient reaches a map call's output: a solve may start
            self._active, self._g = k, g.detach()
            self._vjps, self._abs, self._rel, self._last_v = 0, [], [], None
            self._vjp_call = None

    def _outgoing(self, k: int, nr: int, grads: tuple) -> None:
        w = grads[nr] if nr < len(grads) else None
        if k != self._active:
            if self._active is not None and w is not None:  # a VJP of the solve
                self._vjps += 1
                self._last_v, self._vjp_call = w.detach(), k
            return
        g, self._active = self._g, None
        if w is None or g is None or w is g or torch.equal(w, g):
            return  # the gradient passed unchanged: no adjoint solve here
        # J^T w where the library linearised the map: the call its VJPs went through
        self._finish(k if self._vjp_call is None else self._vjp_call, g, w.detach())

    def _jtv(self, jtv: Tensor) -> None:
        v, g = self._last_v, self._g
        if self._active is None or v is None or g is None or jtv.shape != v.shape:
            return
        a, r = residuals(jtv.detach() + g, v)
        self._abs.append(a)
        self._rel.append(r)
        self._last_v = None

    def _finish(self, k: int, g: Tensor, w: Tensor) -> None:
        tree, z, args, kwargs = self._calls[k]
        with torch.enable_grad():
            zv = z.detach().requires_grad_()
            out = self.fn(trees.replace_leaf(tree, z, zv), *args, **kwargs)
            if isinstance(out, Tensor) or (self.state is None and isinstance(tree, Tensor)):
                fz = out if isinstance(out, Tensor) else out[0]
            else:
                fz = trees.read(out, self.state)
            (jtw,) = torch.autograd.grad(fz, zv, w)
        ra, rr = residuals(jtw.detach() + g, w)
        extra: dict[str, Any] = {"vjps": self._vjps, "check_evals": 1}
        if self.max_iter is not None:
            extra["max_iter"] = self.max_iter
        if self.own_stop is not None:
            res = float(rule_value(ra, rr, self.own_stop, self.stop_mode))
            extra.update(own_rule=self.own_stop, own_residual=res,
                         own_converged=bool(res < self.tol))  # fmt: skip
        n = self._vjps
        self.stats = make_stats(
            self.name,
            n,
            self._abs if len(self._abs) == n else [],
            self._rel if len(self._rel) == n else [],
            ra,
            rr,
            self.tol,
            self.stop_mode,
            diverged=False,
            stagnated=self.max_iter is not None and n < self.max_iter,
            extra=extra,
            stop=self.judge,
        )
