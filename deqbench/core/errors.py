"""Domain exceptions. The CLI maps every DeqbenchError to exit code 2 with one red line."""

from __future__ import annotations


class DeqbenchError(Exception):
    """Base class of all errors deqbench reports to users (one line, no traceback)."""


class ConfigError(DeqbenchError):
    """A suite or option is invalid. The message starts with FILE:LINE:COL or a dotted path."""


class UnknownNameError(DeqbenchError, KeyError):
    """A registry name does not exist."""

    def __str__(self) -> str:  # KeyError would add quotes
        return str(self.args[0]) if self.args else ""


class PluginError(DeqbenchError):
    """A third-party plugin failed to import or two plugins claim one name."""


class DataError(DeqbenchError):
    """A dataset is missing or malformed."""


class DeviceError(DeqbenchError):
    """A requested device is unavailable."""
