"""Registered analyses. The built-ins live in their family's package (listed in
:data:`BUILTINS`, imported on first use); plugins come from entry points. The base class and the
per-cell context every analysis gets are in :mod:`deqbench.analyses.base`.

This package doubles as the public registry facade: `deqbench.analyses.names()`, `.get(name)`,
`.origin(name)`, `.register(name)`.
"""

from ..core.registry import analyses as registry

#: the modules whose ``@register`` decorators add the built-in analyses, one family per package
BUILTINS = (
    "deqbench.training.metrics",
    "deqbench.training.family_stats",
    "deqbench.performance.throughput",
    "deqbench.performance.backward",
    "deqbench.performance.solver_overhead",
    "deqbench.performance.solver_stats",
    "deqbench.performance.unroll_compare",
    "deqbench.trajectory.analysis",
    "deqbench.splitting.analysis",
    "deqbench.spectral.analysis",
    "deqbench.kglm.analysis",
    "deqbench.landscape.analysis",
    "deqbench.hessian.analysis",
    "deqbench.ntk.analysis",
)

register = registry.register
names = registry.names
get = registry.get
create = registry.create
origin = registry.origin
entry = registry.entry
add = registry.add
remove = registry.remove
