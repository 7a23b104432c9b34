"""Backward modes: how a DEQ layer is differentiated. Built-ins live in this package's modules,
one per mode (``ift``, ``unrolled``, ``jfb``, ``phantom``, ``reversible``, ``shine``); plugins come
from the entry-point group ``deqbench.backward``. The contract is :class:`BackwardMode`
(:mod:`deqbench.backward.base`).

This package doubles as the public registry facade: ``deqbench.backward.names()``,
``.get(name)``, ``.origin(name)``, ``.register(name)``, ``.add(name, cls)``; ``mode(name)`` is
the mode instance a layer dispatches to.

Example:
    >>> import deqbench
    >>> {"ift", "reversible", "shine"} <= set(deqbench.backward.names())
    True
    >>> deqbench.backward.mode("shine").forward
    'broyden'
"""

from ..core.registry import backward_modes as registry
from .base import BackwardMode, as_mode, check_pair, forward_problem, mode_of, option_problems

register = registry.register
names = registry.names
get = registry.get
origin = registry.origin
entry = registry.entry
add = registry.add
remove = registry.remove
mode = mode_of

__all__ = [
    "BackwardMode",
    "add",
    "as_mode",
    "check_pair",
    "entry",
    "forward_problem",
    "get",
    "mode",
    "mode_of",
    "names",
    "option_problems",
    "origin",
    "register",
    "registry",
    "remove",
]
