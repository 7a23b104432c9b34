"""Public face of :mod:`deqbench.kglm.kernels` (the kernels of the KGLM family): plugins, scripts
and the docs import ``deqbench.kernels``; the code lives in ``deqbench/kglm/kernels.py``."""

from .kglm.kernels import (  # noqa: F401 - re-exported
    Kernel,
    Periodic,
    ProductKernel,
    SquaredExponential,
    SumKernel,
    White,
    kernels,
    make_kernel,
    periodic,
    periodic_se,
    se,
    sqdist,
    white,
)
