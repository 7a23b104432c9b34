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


def declare_defaults(
    *,
    solver: str | dict[str, Any] | None = None,
    backward: str | dict[str, Any] | None = None,
    init: str | dict[str, Any] | None = None,
    solvers: Sequence[str] | None = None,
    backward_modes: Sequence[str] | None = None,
) -> Any:
    """Decorator declaring a model factory's default ``solver``, ``backward`` and ``init``
    (each a registered name or ``{name, **fields}`` as in a suite's ``defaults``). The suite
    schema validates them like a suite's own values, so a bad declaration is an error naming
    the model.

    ``solvers``: the solvers (forward and adjoint) the model supports or needs; ``()`` for a
    model that computes its own equilibrium. ``backward_modes``: the backward modes that apply
    (of ift, unrolled, jfb, phantom). Unset: no restriction beyond the cells' structure."""
    decl: dict[str, Any] = {}
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
    """Whether model ``name`` declares ``solvers=()``: the suite's solver does not reach it."""
    return compatibility(name)["solvers"] == []


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
    decl = defaults(name)
    if decl.get("solver") or decl.get("backward"):
        from ..core import deq
        from ..run.specs import to_dataclass

        if deq.is_deq(model):
            deq.configure(
                model,
                to_dataclass("solver", decl["solver"]) if "solver" in decl else None,
                to_dataclass("backward", decl["backward"]) if "backward" in decl else None,
            )
    return model
