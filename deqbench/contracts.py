"""Public face of :mod:`deqbench.core.contracts` (the plugin contracts): plugins, scripts and the
docs import ``deqbench.contracts``; the code lives in ``deqbench/core/contracts.py``."""

from .core.contracts import (  # noqa: F401 - re-exported
    CLAUSES,
    CONTRACTS,
    AdjointMap,
    AnalysisPlugin,
    Cell,
    DatasetLoader,
    EquilibriumModel,
    ForwardMap,
    Init,
    ModelFactory,
    MonotoneCell,
    OwnSolverModel,
    Solver,
    SpectralQuantities,
    SplittingOps,
    Wrapper,
    cell_weights,
    clause,
    injection_parameters,
    missing_members,
    reference_markdown,
    structure_of,
)
