"""Shared pieces of the model families: activations, shape helpers, factory conventions, variants.

Factory convention: every registered model factory accepts ``in_shape`` (the shape of one
input sample, e.g. ``(1, 8, 8)`` or ``(64,)``) and ``num_outputs`` (classes or regression
outputs); the runner fills both from the dataset. DEQ factories also accept ``solver`` and
``backward`` (``SolverConfig``/``BackwardConfig``) which the runner sets via
:func:`deqbench.deq.configure`.
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Callable
from typing import Any

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


def variant(base: Callable[..., Any], /, **overrides: Any) -> Callable[[Callable[[], Any]], Any]:
    """Decorator making a registered model variant out of ``base`` with other defaults (a variant
    is its base's creator with a few settings changed). The decorated function holds only the
    variant's docstring; the variant has ``base``'s signature with ``overrides`` as its defaults
    (what the suite schema, ``deqbench ls -v``, ``validate`` and the docs read), its annotations,
    and the defaults ``base`` declares (:func:`deqbench.models.declare_defaults`; a
    ``declare_defaults`` above ``@variant`` replaces them). Register it with a literal name, as the
    source index reads it (:mod:`deqbench.core.index`)::

        @models.register("opteq_tiny")
        @variant(opteq, width=16)
        def opteq_tiny():
            '''Tiny opteq for tests (width 16).'''
    """
    sig = inspect.signature(base)
    unknown = sorted(set(overrides) - set(sig.parameters))
    if unknown:
        raise TypeError(f"variant of {base.__name__}: it has no parameter {', '.join(unknown)}")
    params = [
        p.replace(default=overrides[p.name]) if p.name in overrides else p
        for p in sig.parameters.values()
    ]
    signature = sig.replace(parameters=params)

    def deco(stub: Callable[[], Any]) -> Any:
        if inspect.signature(stub).parameters:
            raise TypeError(f"variant {stub.__name__}: takes its parameters from {base.__name__}")

        def factory(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return base(*bound.args, **bound.kwargs)

        for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
            setattr(factory, attr, getattr(stub, attr))
        factory.__signature__ = signature  # type: ignore[attr-defined]
        factory.__annotations__ = dict(base.__annotations__)
        factory.__wrapped__ = base  # type: ignore[attr-defined]  # its annotations resolve there
        from . import DEFAULTS_ATTR

        if hasattr(base, DEFAULTS_ATTR):
            setattr(factory, DEFAULTS_ATTR, copy.deepcopy(getattr(base, DEFAULTS_ATTR)))
        return factory

    return deco
