"""The DEQ core: the layer and its backward modes (``deq``, ``backward``), the registries,
the plugin contracts, errors, regularisers and the runtime section. Solvers, models and inits
are the public packages ``deqbench.solvers``, ``deqbench.models`` and ``deqbench.inits``.
"""
