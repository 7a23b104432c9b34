"""Registered inits. The generic built-ins live in this package (:mod:`deqbench.inits.basic`), a
family's own inits in its package (the kGLM inits in :mod:`deqbench.kglm.inits`), found in the
source by :func:`builtin_modules` and imported on first use; plugins come from entry points.

This package doubles as the public registry facade: `deqbench.inits.names()`, `.get(name)`,
`.origin(name)`, `.register(name)`.
"""

from ..core.registry import inits as registry


def builtin_modules() -> list[str]:
    """The modules whose ``@register`` decorators add the built-in inits, found in the source by
    :mod:`deqbench.core.index` (an init in a new module of any package is registered with no
    list to edit)."""
    from ..core.index import modules

    return modules("inits")


register = registry.register
names = registry.names
get = registry.get
create = registry.create
origin = registry.origin
entry = registry.entry
add = registry.add
remove = registry.remove
