"""Iterates of any shape: a tensor, or a pytree (dict / tuple / list / dataclass) of tensors, as
a library's own fixed-point loop passes it from one call of its map to the next.

A *selector* reads the state (one tensor) from such an iterate: a callable ``tree -> Tensor``,
or a dotted path of keys, indices and attribute names (``"est.0"``: ``tree["est"][0]``). Without
one, the state is the iterate itself when it is a tensor, its only tensor leaf when it has one,
else all its tensor leaves flattened per sample and concatenated, shape ``(B, D)`` (leaves
sharing the batch dimension).

Example:
    >>> import torch
    >>> X = {"est": (torch.ones(2, 3), torch.zeros(2, 3)), "cost": None}
    >>> tuple(read(X, selector("est.0")).shape), tuple(read(X, None).shape)
    ((2, 3), (2, 6))
    >>> describe((X, {"psnr": []}))
    'tuple(dict(est=tuple(Tensor(2, 3), Tensor(2, 3)), cost=None), dict(psnr=list[0]))'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

Selector = Callable[[Any], Any]


def leaves(tree: Any) -> list[Tensor]:
    """The tensors of ``tree`` in order (dict values in insertion order, sequence items,
    dataclass fields); other leaves (None, numbers, strings) are skipped."""
    if isinstance(tree, Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in leaves(v)]
    if isinstance(tree, tuple | list):
        return [t for v in tree for t in leaves(v)]
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        return [t for f in dataclasses.fields(tree) for t in leaves(getattr(tree, f.name))]
    return []


def replace_leaf(tree: Any, old: Tensor, new: Tensor) -> Any:
    """A copy of ``tree`` (its containers rebuilt) with the leaf that *is* ``old`` replaced."""
    if tree is old:
        return new
    if isinstance(tree, dict):
        return {k: replace_leaf(v, old, new) for k, v in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a namedtuple
        return type(tree)(*(replace_leaf(v, old, new) for v in tree))
    if isinstance(tree, tuple | list):
        return type(tree)(replace_leaf(v, old, new) for v in tree)
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        return dataclasses.replace(
            tree,
            **{
                f.name: replace_leaf(getattr(tree, f.name), old, new)
                for f in dataclasses.fields(tree)
                if f.init
            },  # fmt: skip
        )
    return tree


def describe(value: Any, limit: int = 160) -> str:
    """A short structural description of ``value`` (types, keys, tensor shapes)."""

    def d(v: Any, depth: int) -> str:
        if isinstance(v, Tensor):
            return f"Tensor({', '.join(map(str, v.shape))})"
        if v is None or isinstance(v, bool | int | float | str):
            return repr(v) if v is None or isinstance(v, bool) else type(v).__name__
        if depth > 3:
            return type(v).__name__
        if isinstance(v, dict):
            return f"dict({', '.join(f'{k}={d(x, depth + 1)}' for k, x in v.items())})"
        if isinstance(v, tuple | list):
            if isinstance(v, list) and not any(isinstance(x, Tensor) for x in leaves(v)):
                return f"list[{len(v)}]"
            return f"{type(v).__name__}({', '.join(d(x, depth + 1) for x in v)})"
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            inner = ", ".join(
                f"{f.name}={d(getattr(v, f.name), depth + 1)}" for f in dataclasses.fields(v)
            )
            return f"{type(v).__name__}({inner})"
        return type(v).__name__

    s = d(value, 0)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def selector(sel: str | Selector | None, what: str = "state") -> Selector | None:
    """A callable reading a part of a tree: ``sel`` itself when callable, a getter of the
    dotted path ``sel`` (keys of dicts, integer indices of sequences, attributes otherwise),
    or None for None."""
    if sel is None or callable(sel):
        return sel
    if not isinstance(sel, str) or not sel:
        raise TypeError(f"{what}= must be a dotted path or a callable, got {sel!r}")
    parts = sel.split(".")

    def get(tree: Any) -> Any:
        v = tree
        for p in parts:
            if isinstance(v, dict):
                v = v[p]
            elif isinstance(v, tuple | list):
                v = v[int(p)]
            else:
                v = getattr(v, p)
        return v

    get.__qualname__ = f"{what}={sel!r}"
    return get


def read(tree: Any, sel: Selector | None) -> Tensor:
    """The state of ``tree`` (see the module docstring); raises LookupError, ValueError,
    TypeError or AttributeError when it cannot be read."""
    if sel is not None:
        v = sel(tree)
        if not isinstance(v, Tensor):
            raise TypeError(f"the selector gave a {type(v).__name__}, not a tensor")
        return v
    ts = leaves(tree)
    if not ts:
        raise TypeError(f"no tensor in {describe(tree)}")
    if len(ts) == 1:
        return ts[0]
    b = ts[0].shape[0] if ts[0].dim() else None
    if b is None or any(t.dim() == 0 or t.shape[0] != b for t in ts):
        raise ValueError(f"the tensors of {describe(tree)} do not share a batch dimension")
    return torch.cat([t.reshape(b, -1) for t in ts], dim=1)
