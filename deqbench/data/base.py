"""The dataset registry: :class:`DataBundle`, :data:`DATASETS`, the :func:`dataset` decorator,
:func:`load_data` and the split helpers every loader shares.

The built-in datasets are registered by :mod:`deqbench.run.data` (which re-exports all of this);
import that module, not this one, to see every dataset.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..core.errors import ConfigError


@dataclass
class DataBundle:
    """Train/test tensors and what a model factory needs to know about them."""

    name: str
    train: tuple[Tensor, Tensor]
    test: tuple[Tensor, Tensor]
    in_shape: tuple[int, ...]
    num_outputs: int
    task: str = "classification"  # or "regression"
    meta: dict[str, Any] = field(default_factory=dict)

    def to(self, device: Any = None, dtype: torch.dtype | None = None) -> DataBundle:
        def conv(t: Tensor, is_x: bool) -> Tensor:
            if dtype is not None and (is_x or self.task == "regression") and t.is_floating_point():
                t = t.to(dtype)
            return t.to(device) if device is not None else t

        return DataBundle(
            self.name,
            (conv(self.train[0], True), conv(self.train[1], False)),
            (conv(self.test[0], True), conv(self.test[1], False)),
            self.in_shape,
            self.num_outputs,
            self.task,
            self.meta,
        )


DATASETS: dict[str, Callable[..., DataBundle]] = {}


def dataset(name: str):
    def deco(fn):
        DATASETS[name] = fn
        return fn

    return deco


def load_data(name: str, **params: Any) -> DataBundle:
    """Load dataset ``name`` with its ``params`` (unknown params are a ConfigError)."""
    if name not in DATASETS:
        import difflib

        close = difflib.get_close_matches(name, list(DATASETS), n=2)
        hint = f"did you mean {', '.join(map(repr, close))}? " if close else ""
        raise ConfigError(
            f"unknown dataset '{name}'; {hint}datasets: {', '.join(sorted(DATASETS))}"
        )
    fn = DATASETS[name]
    sig = inspect.signature(fn)
    bad = [k for k in params if k not in sig.parameters]
    if bad:
        import difflib

        close = difflib.get_close_matches(bad[0], list(sig.parameters), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(
            f"data.{bad[0]}: unknown option for dataset '{name}'{hint}; options: "
            + ", ".join(sig.parameters)
        )
    return fn(**params)


def _check_split(split: float) -> None:
    if not 0 < split < 1:
        raise ConfigError(f"data.split must be in (0, 1), got {split}")


def _split(
    X: Tensor, y: Tensor, split: float, seed: int
) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """A seeded random split: the first ``split`` fraction of a permutation is the train set."""
    _check_split(split)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(X.shape[0], generator=g)
    n = int(round(split * X.shape[0]))
    tr, te = perm[:n], perm[n:]
    return (X[tr], y[tr]), (X[te], y[te])


def _balanced_order(idx: Tensor, y: Tensor) -> Tensor:
    """Reorder the (already shuffled) indices ``idx`` so that every prefix is as close to the
    class proportions as it can be: element i gets the key (rank within its class + 0.5) / class
    size, and a stable sort keeps the shuffled order among equal keys."""
    lab = y[idx]
    rank = torch.empty(len(idx), dtype=torch.float64)
    for c in lab.unique():
        where = (lab == c).nonzero().flatten()
        rank[where] = (torch.arange(len(where), dtype=torch.float64) + 0.5) / len(where)
    return idx[torch.sort(rank, stable=True).indices]


def _stratified_split(
    X: Tensor, y: Tensor, split: float, seed: int
) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """A seeded stratified split: each class contributes round(split * its count) samples to the
    train set, the rest to the test set. Both sets are shuffled, then ordered so that any prefix
    (``train_subset``/``test_subset``) keeps the class balance."""
    _check_split(split)
    g = torch.Generator().manual_seed(seed)
    tr_parts, te_parts = [], []
    for c in y.unique():
        where = (y == c).nonzero().flatten()
        where = where[torch.randperm(len(where), generator=g)]
        n = int(round(split * len(where)))
        tr_parts.append(where[:n])
        te_parts.append(where[n:])
    out = []
    for parts in (tr_parts, te_parts):
        idx = torch.cat(parts)
        idx = _balanced_order(idx[torch.randperm(len(idx), generator=g)], y)
        out.append((X[idx], y[idx]))
    return out[0], out[1]


def _subset(t: tuple[Tensor, Tensor], n: int | None) -> tuple[Tensor, Tensor]:
    return t if n is None else (t[0][:n], t[1][:n])
