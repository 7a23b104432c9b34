"""Shared pieces of the model families: activations, shape helpers, factory conventions.

Factory convention: every registered model factory accepts ``in_shape`` (the shape of one
input sample, e.g. ``(1, 8, 8)`` or ``(64,)``) and ``num_outputs`` (classes or regression
outputs); the runner fills both from the dataset. DEQ factories also accept ``solver`` and
``backward`` (``SolverConfig``/``BackwardConfig``) which the runner sets via
:func:`deqbench.deq.configure`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

ACTIVATIONS = {
    "tanh": torch.tanh,
    "relu": torch.relu,
    "sigmoid": torch.sigmoid,
    "softsign": nn.functional.softsign,
    "relu6": nn.functional.relu6,
    "identity": lambda x: x,
}


def activation(name: str):
    from ..core.errors import ConfigError

    if name not in ACTIVATIONS:
        import difflib

        close = difflib.get_close_matches(name, list(ACTIVATIONS), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(
            f"unknown activation '{name}'{hint}; choose from {', '.join(ACTIVATIONS)}"
        )
    return ACTIVATIONS[name]


def numel(shape) -> int:
    return int(math.prod(shape))


def as_image_shape(in_shape) -> tuple[int, int, int]:
    """(C, H, W) from an input shape; a flat (D,) input with square D becomes (1, s, s)."""
    shape = tuple(int(s) for s in in_shape)
    if len(shape) == 3:
        return shape  # type: ignore[return-value]
    if len(shape) == 2:
        return (1, shape[0], shape[1])
    if len(shape) == 1:
        s = int(round(math.sqrt(shape[0])))
        if s * s == shape[0]:
            return (1, s, s)
    from ..core.errors import ConfigError

    raise ConfigError(f"convolutional model needs image inputs (C, H, W); got shape {shape}")
