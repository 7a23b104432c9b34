"""deqbench: benchmarking and analysis of deep equilibrium models (DEQs) on PyTorch.

Public API::

    import deqbench
    deqbench.models.create("conv_deq_tiny")
    deqbench.solvers.get("anderson")(f, z0, max_iter=50, tol=1e-4)
    deqbench.inits.get("spectral")(model, seed=0, target=0.9)
    deqbench.backward.names()                     # backward modes: ift, ..., reversible, shine
    deqbench.datasets.names()                                      # built-in and plugin datasets
    suite = deqbench.load_suite("suites/smoke.yaml"); deqbench.run_suite(suite, out="results/")
    deqbench.load_results("results/smoke/<run_id>")
    deqbench.spectral.conv_spectral_norm(conv.weight, (32, 32))     # exact, circular (Sedghi)
    deqbench.spectral.jacobian_spectral_radius(cell, z_star, x)
    deqbench.kernels.make_kernel("periodic_se"); deqbench.klr.fit_klr(K, y, lam)

Importing deqbench does not import torch; the registries load their built-ins on first use.
"""

from __future__ import annotations

from typing import Any

from . import analyses, backward, inits, models, solvers

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "models",
    "solvers",
    "inits",
    "analyses",
    "backward",
    "datasets",
    "load_suite",
    "load_suites",
    "run_suite",
    "load_results",
    "spectral",
    "kernels",
    "klr",
    "landscape",
    "hessian",
    "ntk",
]

_LAZY = {
    "datasets": ("deqbench.core.registry", "datasets"),
    "load_suite": ("deqbench.run.suite", "load_suite"),
    "load_suites": ("deqbench.run.suite", "load_suites"),
    "run_suite": ("deqbench.run.runner", "run_suite"),
    "load_results": ("deqbench.run.results", "load_results"),
}


#: submodules with public plain functions, imported on first attribute access (they import torch)
_SUBMODULES = ("spectral", "kernels", "klr", "landscape", "hessian", "ntk")


def __getattr__(name: str) -> Any:
    import importlib

    if name in _LAZY:
        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    if name in _SUBMODULES:
        return importlib.import_module(f"deqbench.{name}")
    raise AttributeError(f"module 'deqbench' has no attribute '{name}'")
