"""Registered models. Built-ins live in this package's modules; plugins come from entry points.

This package doubles as the public registry facade: `deqbench.models.names()`, `.get(name)`,
`.create(name, **params)`, `.origin(name)`, `.register(name)`, `.defaults(name)`.

**Model-declared defaults.** A model factory declares the forward solver, the backward mode
(with its adjoint solver) and the init under which the model converges in its intended use,
with :func:`declare_defaults` (built-ins and third-party plugins alike). Every field a suite or a
command leaves unset comes from this declaration (before the generic fallback of the suite
schema, e.g. ``solver: anderson``); a field the suite sets wins. When the suite picks another
solver (or backward mode, or init) than the declared one, only the declared generic fields
(``max_iter``, ``tol``, ``stop_mode``; for ``backward`` also ``solver`` and its budget) carry over,
not the declared solver's own options.

**Compatibility.** The same declaration may say which solvers the model supports (or needs)
and which backward modes apply (``solvers=[...]``, ``backward_modes=[...]``; unset: every
solver whose structure the cells implement, every mode). ``deqbench validate`` refuses cells
outside them ([model.declared], :mod:`deqbench.run.plugin_checks`). ``solvers=()`` declares a
model that computes its own equilibrium (a wrapped third-party DEQ): the suite's solver does
not reach it and is not checked against it.

**Own solvers.** ``own_solver="picard"`` (and ``own_backward="ift"``) declares such a model that
also reports its solves (``last_solve_stats()``, :class:`deqbench.contracts.OwnSolverModel`)
and names the solver (and backward) its own code runs, so that its cells are named before the
model is built (:func:`own_solver_label`): ``solver=own:picard``, ``backward=own:ift`` (``own``
where unnamed), with every solver statistic. ``solvers=()`` alone declares one that reports
nothing: ``not measured`` (:func:`solver_columns` reads the built model).

Example:
    >>> from deqbench.models import declare_defaults
    >>> @declare_defaults(solver={"name": "anderson", "max_iter": 100, "tol": 1e-4, "m": 5},
    ...                   backward={"name": "ift", "solver": "anderson", "tol": 1e-5})
    ... def my_deq(in_shape=(64,), num_outputs=10):
    ...     ...
    >>> my_deq.deqbench_defaults["solver"]["name"]
    'anderson'
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from ..core.registry import models as registry

register = registry.register
names = registry.names
get = registry.get
origin = registry.origin
entry = registry.entry
add = registry.add
remove = registry.remove

#: attribute of a model factory holding its declared defaults (section -> dict)
DEFAULTS_ATTR = "deqbench_defaults"
#: sections a model may declare
DECLARABLE = ("init", "solver", "backward")
#: compatibility a model may declare (lists of names; absent: no restriction)
COMPATIBILITY = ("solvers", "backward_modes")
#: the declaration keys naming what a model that runs its own solver runs
OWN = ("own_solver", "own_backward")


def declare_defaults(
    *,
    solver: str | dict[str, Any] | None = None,
    backward: str | dict[str, Any] | None = None,
    init: str | dict[str, Any] | None = None,
    solvers: Sequence[str] | None = None,
    backward_modes: Sequence[str] | None = None,
    own_solver: str | None = None,
    own_backward: str | None = None,
) -> Any:
    """Decorator declaring a model factory's default ``solver``, ``backward`` and ``init``
    (each a registered name or ``{name, **fields}`` as in a suite's ``defaults``). The suite
    schema validates them like a suite's own values, so a bad declaration is an error naming
    the model.

    ``solvers``: the solvers (forward and adjoint) the model supports or needs; ``()`` for a
    model that computes its own equilibrium. ``backward_modes``: the backward modes that apply
    (of ift, unrolled, jfb, phantom). Unset: no restriction beyond the cells' structure.

    ``own_solver``, ``own_backward``: the names of the solver and backward mode the model's own
    code runs, for a model that computes its own equilibrium and reports its solves
    (``last_solve_stats()``, :class:`deqbench.contracts.OwnSolverModel`; ``solvers`` and
    ``backward_modes`` default to ``()``). Its cells say ``solver=own:<own_solver>`` (see
    :func:`own_solver_label`); a ``solver_name``/``backward_name`` of the model must agree.
    A name may be a template of the factory's parameters, for a factory whose option picks the
    loop per cell: ``own_solver="{loop}"`` names cells of ``loop="anderson"``
    ``own:anderson`` (the parameter's default where the suite leaves it)."""
    decl: dict[str, Any] = {}
    for key, own in (("own_solver", own_solver), ("own_backward", own_backward)):
        if own is None:
            continue
        if not isinstance(own, str) or not own:
            raise TypeError(f"declare_defaults: {key} must be a name, got {own!r}")
        decl[key] = own
    if decl:
        if solvers:
            raise TypeError(
                "declare_defaults: a model with its own solver takes no deqbench solvers "
                f"(solvers={list(solvers)!r})"
            )
        solvers = () if solvers is None else solvers
        backward_modes = () if backward_modes is None else backward_modes
    for section, value in (("init", init), ("solver", solver), ("backward", backward)):
        if value is None:
            continue
        value = {"name": value} if isinstance(value, str) else dict(value)
        if "name" not in value:
            raise TypeError(f"declare_defaults: {section} needs a 'name'")
        decl[section] = value
    for key, names in (("solvers", solvers), ("backward_modes", backward_modes)):
        if names is None:
            continue
        if isinstance(names, str) or not all(isinstance(n, str) for n in names):
            raise TypeError(f"declare_defaults: {key} must be a list of names, got {names!r}")
        decl[key] = list(names)

    def deco(fn: Any) -> Any:
        setattr(fn, DEFAULTS_ATTR, decl)
        return fn

    return deco


def compatibility(name: str) -> dict[str, list[str] | None]:
    """The solvers and backward modes model ``name`` declares it supports (``{"solvers": [...],
    "backward_modes": [...]}``; None where it declares nothing, or the model is unknown)."""
    try:
        fn = get(name)
    except Exception:
        return {k: None for k in COMPATIBILITY}
    decl = getattr(fn, DEFAULTS_ATTR, None) or {}
    return {k: (list(decl[k]) if decl.get(k) is not None else None) for k in COMPATIBILITY}


def computes_own_equilibrium(name: str) -> bool:
    """Whether model ``name`` declares ``solvers=()`` (or ``own_solver``): the suite's solver
    does not reach it."""
    return compatibility(name)["solvers"] == []


def _own_declaration(name: str) -> dict[str, Any] | None:
    """The ``own_solver``/``own_backward`` model ``name`` declares (None: neither, or unknown)."""
    try:
        decl = getattr(get(name), DEFAULTS_ATTR, None) or {}
    except Exception:
        return None
    own = {k: decl[k] for k in OWN if k in decl}
    return own or None


def _own_named(name: str, template: Any, params: dict[str, Any] | None) -> Any:
    """A declared own name with its ``{param}`` templates filled from ``params`` over the
    factory's defaults (a template naming no parameter is left as it is)."""
    if not isinstance(template, str) or "{" not in template:
        return template
    import inspect

    values: dict[str, Any] = {}
    try:
        sig = inspect.signature(get(name))
        values = {k: p.default for k, p in sig.parameters.items() if p.default is not p.empty}
    except Exception:  # an unknown or odd factory: the suite's params only
        pass
    values.update(params or {})
    try:
        return template.format_map(values)
    except (KeyError, IndexError, ValueError):
        return template


def own_solver_label(name: str, params: dict[str, Any] | None = None) -> tuple[str, str] | None:
    """The ``solver`` and ``backward`` columns of model ``name``'s cells when it computes its
    own equilibrium, from its declaration only (the model is not built; for cell ids):

    * ``declare_defaults(own_solver=s, own_backward=b)`` (the model runs its own solver and
      reports it, :class:`deqbench.contracts.OwnSolverModel`): ``("own:s", "own:b")`` (``own``
      for a name not declared);
    * ``solvers=()`` alone (it reports nothing): ``("not measured", "not measured")``;
    * anything else (a DEQ the suite's solver reaches, an explicit network, an unknown name):
      None.

    ``deqbench validate`` checks that the built model agrees ([model.solve_stats]);
    :func:`solver_columns` gives the columns of the built model.

    Example:
        >>> @declare_defaults(own_solver="picard", own_backward="ift")
        ... def my_wrapped(in_shape=(64,), num_outputs=10): ...
        >>> add("my_wrapped", my_wrapped); own_solver_label("my_wrapped")   # doctest: +SKIP
        ('own:picard', 'own:ift')
    """
    from ..core.own_solves import NOT_MEASURED, own_label

    own = _own_declaration(name)
    if own is not None:
        return tuple(  # type: ignore[return-value]
            own_label(_own_named(name, own.get(k), params)) for k in OWN
        )
    if computes_own_equilibrium(name):
        return NOT_MEASURED, NOT_MEASURED
    return None


def solver_columns(
    name: str, model: Any, params: dict[str, Any] | None = None
) -> tuple[str, str] | None:
    """The ``solver`` and ``backward`` columns of a cell of model ``name`` (``model``: it built)
    when the suite's solver does not solve it, else None (the suite's names apply):

    * a model without DEQ layers that reports its own solves (``last_solve_stats()``):
      ``own:<solver_name>`` / ``own:<backward_name>`` (the model's attributes, else the names
      its factory declares; ``own`` where unnamed);
    * a model that computes its own equilibrium (declared ``solvers=()`` or ``own_solver``, or
      with a ``solver_name`` and no DEQ layer) and reports nothing: ``not measured`` for both;
    * a DEQ or a plain explicit network: None.

    A model whose ``solver_name`` (``backward_name``) differs from the ``own_solver``
    (``own_backward``) its factory declares (a template filled from ``params``, the model's
    parameters) is a ConfigError."""
    from ..core import deq, own_solves

    solver, backward = deq.own_solver(model), deq.own_backward(model)
    if solver is not None and backward is not None:
        declared = _own_declaration(name) or {}
        cols = {"solver": solver, "backward": backward}
        for k, attr in (("solver", own_solves.SOLVER_ATTR), ("backward", own_solves.BACKWARD_ATTR)):
            if f"own_{k}" not in declared:
                continue
            d = own_solves.own_label(_own_named(name, declared[f"own_{k}"], params))
            if getattr(model, attr, None) is None:
                cols[k] = d  # named by the declaration only
            elif cols[k] != d:
                from ..core.errors import ConfigError

                raise ConfigError(
                    f"model '{name}': {type(model).__name__}.{attr} says {cols[k]} but the "
                    f"factory declares {d} (declare_defaults(own_{k}=...)): name it once, "
                    f"or after the factory's parameter that picks it (own_{k}='{{param}}')"
                )
        return cols["solver"], cols["backward"]
    named = getattr(model, own_solves.SOLVER_ATTR, None) is not None and not deq.is_deq(model)
    if computes_own_equilibrium(name) or named:
        return own_solves.NOT_MEASURED, own_solves.NOT_MEASURED
    return None


def defaults(name: str) -> dict[str, dict[str, Any]]:
    """The defaults model ``name`` declares (section -> dict; ``{}`` when none or unknown)."""
    try:
        fn = get(name)
    except Exception:  # unknown or broken model: reported by the suite's own checks
        return {}
    decl = getattr(fn, DEFAULTS_ATTR, None) or {}
    return {s: copy.deepcopy(v) for s, v in decl.items() if s in DECLARABLE}


def create(name: str, /, **params: Any) -> Any:
    """Build model ``name``; a DEQ model gets its declared solver and backward mode.

    Example:
        >>> import deqbench
        >>> m = deqbench.models.create("fc_deq_tiny")          # doctest: +SKIP
        >>> m.deq.solver_cfg.name                                # doctest: +SKIP
        'anderson'
    """
    model = registry.create(name, **params)
    from ..core import deq

    deq.watch_own_solves(model)  # a model that reports its own solves: each one is recorded
    decl = defaults(name)
    if decl.get("solver") or decl.get("backward"):
        from ..core.config import to_dataclass

        if deq.is_deq(model):
            deq.configure(
                model,
                to_dataclass("solver", decl["solver"]) if "solver" in decl else None,
                to_dataclass("backward", decl["backward"]) if "backward" in decl else None,
            )
    return model


#: the attribute :func:`explicit_network` sets on a factory
EXPLICIT_ATTR = "__deqbench_explicit__"


def explicit_network(fn: Any) -> Any:
    """Decorator marking a model factory as an explicit network (no equilibrium: e.g. a
    weight-tied stack of K cells). Its cells name no solver and no backward mode
    (``tied_repeat_tiny``, columns ``solver=none backward=none``), whatever the suite sets."""
    setattr(fn, EXPLICIT_ATTR, True)
    return fn


def is_explicit(name: str) -> bool:
    """Whether model ``name`` is declared an explicit network (:func:`explicit_network`)."""
    try:
        fn = get(name)
    except Exception:
        return False
    return bool(getattr(fn, EXPLICIT_ATTR, False))
