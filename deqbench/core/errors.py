"""Domain exceptions. The CLI maps every DeqbenchError to exit code 2 with one red line."""

from __future__ import annotations

import re
from typing import Any

#: characters that would act on a terminal or split an error line: C0/C1 controls (ESC, CR,
#: LF, BEL, ...), DEL, the line/paragraph separators and the bidirectional overrides
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def shown(value: Any, limit: int = 120) -> str:
    r"""``value`` as text fit for one error line: cut to ``limit`` characters (``...`` and how
    many more), control characters written as escapes (``\x1b``, ``\n``). For names and
    values from files or the command line echoed in messages.

    Example:
        >>> shown("fc\x1b[2J\nerror: x")
        'fc\\x1b[2J\\nerror: x'
        >>> shown("x" * 200, 10)
        'xxxxxxxxxx... (+190 characters)'
    """
    text = value if isinstance(value, str) else str(value)
    if len(text) > limit:
        text = f"{text[:limit]}... (+{len(text) - limit} characters)"
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


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
