"""Public face of :mod:`deqbench.core.errors` (the error types): plugins, scripts and the docs
import ``deqbench.errors``; the code lives in ``deqbench/core/errors.py``."""

from .core.errors import (  # noqa: F401 - re-exported
    ConfigError,
    DataError,
    DeqbenchError,
    DeviceError,
    PluginError,
    UnknownNameError,
)
