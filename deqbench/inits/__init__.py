"""Registered inits. Built-ins live in this package's modules; plugins come from entry points.

This package doubles as the public registry facade: `deqbench.inits.names()`, `.get(name)`,
`.origin(name)`, `.register(name)`.
"""

from ..core.registry import inits as registry

register = registry.register
names = registry.names
get = registry.get
create = registry.create
origin = registry.origin
entry = registry.entry
add = registry.add
remove = registry.remove
