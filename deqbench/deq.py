"""Public face of :mod:`deqbench.core.deq` (the DEQ layer, its configs and runtime): plugins,
scripts and the docs import ``deqbench.deq``; the code lives in ``deqbench/core/deq.py``."""

from .core.deq import (  # noqa: F401 - re-exported
    AMP_MODES,
    BACKWARD_MODES,
    GRAPH_MODES,
    MAX_CAPTURES,
    STATIC_MAPS,
    BackwardConfig,
    CellMap,
    DEQLayer,
    DEQModel,
    Runtime,
    SolverConfig,
    configure,
    deq_layers,
    direct_solves,
    is_deq,
    last_stats,
    set_runtime,
)
