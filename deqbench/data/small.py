"""The small built-in datasets that load offline with no files: scikit-learn's bundled 8x8
``digits`` and seeded ``synthetic`` data from a random teacher network. Each registers with
``@dataset(name, shape=..., probe=...)`` (:mod:`deqbench.data.base`): its shape declared from the
params, so ``deqbench validate`` need not load the data.

Example:
    >>> from deqbench.data.base import load_data
    >>> d = load_data("digits", split=0.8, seed=0)        # doctest: +SKIP
    >>> d.train[0].shape, d.in_shape, d.num_outputs       # doctest: +SKIP
    (torch.Size([1437, 1, 8, 8]), (1, 8, 8), 10)
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..core.errors import ConfigError, DataError
from .base import DataBundle, _check_split, _split, _subset, dataset


def _digits_shape(p: dict[str, Any]) -> tuple[tuple[int, ...], int]:
    s = int(p["size"])
    shape = (s * s,) if p["flatten"] else (1, s, s)
    return shape, 1 if p["target"] == "binary" else 10


def _needs_sklearn(name: str) -> None:
    """DataError with the fix when scikit-learn (which ships the digits) is not installed."""
    from importlib.util import find_spec

    try:
        spec = find_spec("sklearn")
    except (ImportError, ValueError):  # a broken entry in sys.modules
        spec = None
    if spec is None:
        raise DataError(
            f"dataset '{name}' needs scikit-learn (its package ships the digits): pip install "
            "scikit-learn (a dependency of deqbench: reinstall it)"
        )


def _check_target(target: Any) -> None:
    if target not in ("class", "onehot", "binary"):
        raise ConfigError(f"data.target must be 'class', 'onehot' or 'binary', got {target!r}")


def _probe_digits(p: dict[str, Any]) -> None:
    """digits can load: valid params, scikit-learn installed (the data is never read)."""
    _check_target(p["target"])
    _check_split(p["split"])
    _needs_sklearn("digits")


@dataset("digits", shape=_digits_shape, probe=_probe_digits)
def digits(
    split: float = 0.8,
    seed: int = 0,
    size: int = 8,
    flatten: bool = False,
    train_subset: int | None = None,
    test_subset: int | None = None,
    target: str = "class",
) -> DataBundle:
    """scikit-learn's bundled 8x8 digits (1797 images, values / 16); ``size`` 28 upsamples
    bilinearly to MNIST shape; ``flatten`` gives 64-d vectors.

    ``target``: "class" (default; labels 0-9, classification), "onehot" (regression on one-hot
    rows, 10 outputs, trained with squared loss) or "binary" (regression on a scalar +1 for
    digits >= 5 and -1 otherwise, 1 output; the setting of Nguyen 2022, chapter 3).
    """
    from sklearn.datasets import load_digits

    _check_target(target)

    d = load_digits()
    X = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    if size != 8:
        X = torch.nn.functional.interpolate(
            X, size=(size, size), mode="bilinear", align_corners=False
        )
    if flatten:
        X = X.flatten(1)
    y = torch.tensor(d.target, dtype=torch.long)
    tr, te = _split(X, y, split, seed)
    if target == "class":
        return DataBundle(
            "digits", _subset(tr, train_subset), _subset(te, test_subset), tuple(X.shape[1:]), 10
        )

    def reg(t: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        lab = t[1]
        if target == "onehot":
            return t[0], torch.nn.functional.one_hot(lab, 10).float()
        return t[0], (2.0 * (lab >= 5).float() - 1.0).unsqueeze(1)

    return DataBundle(
        "digits",
        reg(_subset(tr, train_subset)),
        reg(_subset(te, test_subset)),
        tuple(X.shape[1:]),
        10 if target == "onehot" else 1,
        "regression",
        {"target": target},
    )


def _check_task(task: Any) -> None:
    if task not in ("classification", "regression"):
        raise ConfigError(f"data.task must be 'classification' or 'regression', got {task!r}")


@dataset(
    "synthetic",
    shape=lambda p: ((int(p["dim"]),), int(p["num_classes"])),
    probe=lambda p: _check_task(p["task"]),
)
def synthetic(
    n_train: int = 512,
    n_test: int = 256,
    dim: int = 20,
    num_classes: int = 4,
    task: str = "classification",
    noise: float = 0.1,
    seed: int = 0,
    hidden: int = 32,
) -> DataBundle:
    """Seeded synthetic data: Gaussian inputs labelled by a random tanh teacher network
    (classification: argmax of ``num_classes`` outputs; regression: the outputs plus noise)."""
    _check_task(task)
    g = torch.Generator().manual_seed(seed)
    n = n_train + n_test
    X = torch.randn(n, dim, generator=g)
    W1 = torch.randn(dim, hidden, generator=g) / math.sqrt(dim)
    W2 = torch.randn(hidden, num_classes, generator=g) / math.sqrt(hidden)
    out = torch.tanh(X @ W1) @ W2
    if task == "classification":
        y = out.argmax(1)
    else:
        y = out + noise * torch.randn(out.shape, generator=g)
    return DataBundle(
        "synthetic",
        (X[:n_train], y[:n_train]),
        (X[n_train:], y[n_train:]),
        (dim,),
        num_classes,
        task,
    )
