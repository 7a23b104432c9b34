"""Registered analyses. The built-ins live in their family's package (found in the source by
:func:`builtin_modules`, imported on first use); plugins come from entry points. The base class and the
per-cell context every analysis gets are in :mod:`deqbench.analyses.base`.

This package doubles as the public registry facade: `deqbench.analyses.names()`, `.get(name)`,
`.origin(name)`, `.register(name)`.
"""

from ..core.registry import analyses as registry


def builtin_modules() -> list[str]:
    """The modules whose ``@register`` decorators add the built-in analyses, one family per
    package: found in the source by :mod:`deqbench.core.index` (an analysis in a new file of any
    family package is registered with no list to edit)."""
    from ..core.index import modules

    return modules("analyses")


register = registry.register
names = registry.names
get = registry.get
create = registry.create
origin = registry.origin
entry = registry.entry
add = registry.add
remove = registry.remove
