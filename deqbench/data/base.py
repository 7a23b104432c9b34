"""Datasets: :class:`DataBundle`, the :func:`dataset` decorator, :func:`load_data`, the
:data:`DATASETS` mapping and the split helpers every loader shares.

Datasets live in the registry ``deqbench.core.registry.datasets`` (kind ``datasets``): the
built-ins register with ``@dataset("name", shape=fn)`` in the modules of this package
(:mod:`deqbench.data.small`, :mod:`deqbench.data.images`, :mod:`deqbench.data.kglm`), plugins
through the entry-point group ``deqbench.datasets`` (the contract:
:class:`deqbench.contracts.DatasetLoader`). :data:`DATASETS` is that registry seen
as a dict ``name -> loader`` (for older callers).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..core.errors import ConfigError, PluginError
from ..core.registry import datasets

#: a dataset's declared shape: ``shape(params) -> (in_shape, num_outputs)``, ``params`` the
#: loader's defaults updated with the suite's ``data`` keys
ShapeFn = Callable[[dict[str, Any]], tuple[tuple[int, ...], int]]
#: a dataset's cheap check that its data can load, without loading it: ``probe(params)`` (the
#: same ``params`` as ``shape``) raises a DataError that names the fix (the files it looked for
#: and where, the package to install) or a ConfigError for a param the loader would refuse
ProbeFn = Callable[[dict[str, Any]], None]


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

    def tiled(self, n_train: int, n_test: int) -> DataBundle:
        """This bundle with its training set repeated to at least ``n_train`` examples (timed
        training steps then lie in one epoch: no evaluation pass between them) and its test set
        cut to ``n_test`` examples."""
        X, y = self.train
        reps = max(1, -(-n_train // X.shape[0]))
        Xt, yt = self.test
        return DataBundle(
            self.name,
            (X.repeat(reps, *([1] * (X.dim() - 1))), y.repeat(reps)),
            (Xt[:n_test], yt[:n_test]),
            self.in_shape,
            self.num_outputs,
            self.task,
            self.meta,
        )


class _DatasetMap(MutableMapping[str, Callable[..., DataBundle]]):
    """The dataset registry as a dict ``name -> loader``: reading imports a plugin's loader,
    setting adds a loader at run time (``datasets.add``), deleting removes it."""

    def __getitem__(self, name: str) -> Callable[..., DataBundle]:
        if name not in datasets:
            raise KeyError(name)
        return datasets.get(name)

    def __setitem__(self, name: str, fn: Callable[..., DataBundle]) -> None:
        datasets.add(name, fn)

    def __delitem__(self, name: str) -> None:
        if name not in datasets:
            raise KeyError(name)
        datasets.remove(name)

    def __contains__(self, name: object) -> bool:
        return name in datasets

    def __iter__(self) -> Iterator[str]:
        return iter(datasets.names())

    def __len__(self) -> int:
        return len(datasets.names())


#: every dataset, built-in and plugin, by name (a view of ``deqbench.core.registry.datasets``)
DATASETS: MutableMapping[str, Callable[..., DataBundle]] = _DatasetMap()


def dataset(
    name: str, *, shape: ShapeFn | None = None, probe: ProbeFn | None = None
) -> Callable[[Callable[..., DataBundle]], Callable[..., DataBundle]]:
    """Decorator registering a built-in dataset loader under ``name``; ``shape`` declares
    (in_shape, num_outputs) from the params, so that ``deqbench validate`` need not load it;
    ``probe`` checks cheaply that the data can load (:data:`ProbeFn`), what validate and run do
    instead of loading it."""
    attrs = {k: v for k, v in (("shape", shape), ("probe", probe)) if v is not None}
    register = datasets.register  # the source index reads the literal names at the call sites
    return register(name, **attrs)


def loader_params(fn: Callable[..., Any], params: dict[str, Any]) -> dict[str, Any]:
    """The params a loader's ``shape`` and ``probe`` get: ``fn``'s defaults updated with
    ``params`` (the suite's ``data`` keys)."""
    try:
        full = {
            k: v.default
            for k, v in inspect.signature(fn).parameters.items()
            if v.default is not inspect.Parameter.empty
        }
    except (TypeError, ValueError):
        full = {}
    full.update(params)
    return full


def declared_shape(
    fn: Callable[..., Any], params: dict[str, Any]
) -> tuple[tuple[int, ...], int] | None:
    """``fn.shape(p)`` with ``p`` the loader's defaults updated with ``params``, checked to be
    (a tuple of ints, an int); None when the loader declares no shape. Raises what the shape
    function raises, and TypeError for a malformed result."""
    shape_fn = getattr(fn, "shape", None)
    if shape_fn is None:
        return None
    out = shape_fn(loader_params(fn, params))
    if not (isinstance(out, tuple | list) and len(out) == 2):
        raise TypeError(f"shape(params) returned {out!r}, not (in_shape, num_outputs)")
    in_shape, num_outputs = out
    if not (
        isinstance(in_shape, tuple | list)
        and all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in in_shape)
        and isinstance(num_outputs, int)
        and not isinstance(num_outputs, bool)
        and num_outputs > 0
    ):
        raise TypeError(
            f"shape(params) returned {out!r}: in_shape must be a tuple of positive ints and "
            "num_outputs a positive int"
        )
    return tuple(in_shape), int(num_outputs)


def bundle_problem(d: Any) -> str | None:
    """Why a loader's return value is not a usable :class:`DataBundle` (None when it is)."""
    if not isinstance(d, DataBundle):
        return f"returned a {type(d).__name__}, not a deqbench.data.base.DataBundle"
    for split in ("train", "test"):
        pair = getattr(d, split)
        if not (
            isinstance(pair, tuple | list)
            and len(pair) == 2
            and all(isinstance(t, Tensor) for t in pair)
        ):
            return f"DataBundle.{split} is not a pair of tensors (x, y)"
    shape = d.in_shape
    if not (isinstance(shape, tuple | list) and all(isinstance(n, int) for n in shape)):
        return f"DataBundle.in_shape is {shape!r}, not a tuple of ints"
    if isinstance(d.num_outputs, bool) or not isinstance(d.num_outputs, int) or d.num_outputs < 1:
        return f"DataBundle.num_outputs is {d.num_outputs!r}, not a positive int"
    if d.task not in ("classification", "regression"):
        return f"DataBundle.task is {d.task!r}, not 'classification' or 'regression'"
    return None


def load_data(name: str, **params: Any) -> DataBundle:
    """Load dataset ``name`` with its ``params`` (an unknown name or param is a ConfigError; a
    plugin loader that does not return a :class:`DataBundle` is a PluginError)."""
    if name not in datasets:
        raise ConfigError(str(datasets.unknown(name)))
    fn = datasets.get(name)
    try:
        sig: inspect.Signature | None = inspect.signature(fn)
    except (TypeError, ValueError):
        sig = None
    if sig is not None and not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        bad = [k for k in params if k not in sig.parameters]
        if bad:
            import difflib

            close = difflib.get_close_matches(bad[0], list(sig.parameters), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(
                f"data.{bad[0]}: unknown option for dataset '{name}'{hint}; options: "
                + ", ".join(sig.parameters)
            )
    out = fn(**params)
    problem = bundle_problem(out)
    if problem is not None:
        origin = datasets.origin(name)
        who = "built-in" if origin == "built-in" else f"plugin {origin}"
        raise PluginError(f"{who}: dataset '{name}': [dataset.load] {problem}")
    return out


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
