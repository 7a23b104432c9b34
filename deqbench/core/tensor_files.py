"""Reading tensor files safely: :func:`load_tensors` loads a file saved with ``torch.save``
(a checkpoint, landscape directions) with ``torch.load(weights_only=True)``, tensors and plain
containers only, and turns any refusal into a one-line :class:`ConfigError`. The suite checks
read a named file once with it before anything runs; the families load theirs with it.

Example:
    >>> from deqbench.core.tensor_files import load_tensors
    >>> load_tensors("missing.pt", "checkpoint")
    Traceback (most recent call last):
    ...
    deqbench.core.errors.ConfigError: checkpoint: file not found: missing.pt
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .errors import ConfigError


def load_tensors(path: str | Path, label: str, map_location: Any = "cpu") -> Any:
    """``torch.load(path, weights_only=True)``: tensors, state dicts and plain containers only,
    never pickled code. A missing, unreadable or refused file is a one-line
    :class:`ConfigError` starting with ``label`` (``checkpoint``, ``landscape.directions``);
    it does not pass on torch's advice to load with ``weights_only=False``.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"{label}: file not found: {p}")
    if not p.is_file():  # checked before opening: a FIFO would block the read
        kind = "a directory" if p.is_dir() else "a FIFO (named pipe)" if p.is_fifo() else (
            "not a regular file")  # fmt: skip
        raise ConfigError(
            f"{label}: {p} is {kind}, not a file: expected a file saved with torch.save"
        )
    try:
        return torch.load(p, map_location=map_location, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is a config problem
        text = str(exc)
        if "Weights only load failed" not in text and "WeightsUnpickler" not in text:
            first = " ".join(text.split())[:200]
            raise ConfigError(
                f"{label}: cannot read {p} as a torch.save file ({type(exc).__name__}: {first})"
            ) from None
        import re

        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
        what = f"Python objects beyond tensors ({found.group(1)})" if found else (
            "something other than tensors")  # fmt: skip
        raise ConfigError(
            f"{label}: refused {p}: it holds {what}; deqbench loads only tensors and state "
            "dicts (torch.load with weights_only=True), never pickled code, for safety: save "
            "the weights with torch.save(model.state_dict(), path)"
        ) from None
