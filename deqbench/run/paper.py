"""A suite's ``paper:`` block: the paper a suite reproduces, the settings the paper states and
where the suite deviates from them, in a form a program reads.

::

    paper:
      cite: "Gabor, Piotrowski, Cavalcante: Positive Concave Deep Equilibrium Models (ICML 2024)"
      where: "Section 5; App. B, C"
      budget: {steps: 37520, batch_size: 64, lr_milestone_steps: [28140],
               note: "40 epochs of 938 steps, LR x0.1 after epoch 30"}
      settings:                     # dotted key -> the value the paper states
        train.optimizer: adamw
        solver.tol: 1.0e-4
        train.lr:                   # a value per group of cells: ``cells`` is a substring
          - {cells: pcdeq_l, value: 1.0e-3}     # of the cell ids the entry applies to
          - {cells: pcdeq_sc, value: 7.0e-4}
      deviations:                   # a settings key or a free name -> why we differ
        data: "mnist5k stands in for MNIST"

``budget`` is the paper's training budget (``steps`` in optimiser steps, or ``epochs`` where
the paper gives no batch size); omitted when the paper trains nothing. A ``settings`` key is
``SECTION.KEY[.KEY...]`` into a cell (``model``, ``init``, ``solver``, ``backward``, ``train``,
``data``, ``runtime``) or a top-level suite key (``seeds``, ``dtype``). A ``deviations`` key
names a settings key (that entry is then not checked) or one of :data:`FREE_DEVIATIONS`.
Papers are cited by authors, title, year and section, never by a file path.

:func:`paper_mismatches` compares every checked entry with the loaded suite: the value in
every expanded cell (or in the cells an entry names); a model/init/dataset key the suite does
not set is read from the factory's default.

Example:
    >>> from deqbench.run.paper import PaperBlock
    >>> PaperBlock.model_validate({"cite": "A, B: T (2024)", "where": "Section 5",
    ...     "settings": {"train.lr": 0.001}, "deviations": {"data": "a subset"}}).settings
    {'train.lr': 0.001}
"""

from __future__ import annotations

import inspect
import math
import re
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

#: the cell sections a settings key can start with
CELL_SECTIONS = ("model", "init", "solver", "backward", "train", "data", "runtime")
#: the top-level suite keys a settings key can be
TOP_KEYS = ("seeds", "dtype")
#: deviation keys that name no single setting
FREE_DEVIATIONS = (
    "data",
    "budget",
    "seeds",
    "model",
    "init",
    "solver",
    "backward",
    "train",
    "schedule",
    "analysis",
    "probes",
    "timing",
    "metric",
)

Positive = Annotated[StrictInt, Field(gt=0)]
_PATHLIKE = re.compile(r"(^|[\s(])(\.{0,2}/|papers/)|\.(txt|pdf|md)\b")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PaperBudget(_Strict):
    """The paper's training budget."""

    steps: Positive | None = None  # optimiser steps of the paper's whole training
    epochs: Positive | None = None  # where the paper gives no batch size (so no step count)
    batch_size: Positive | None = None
    lr_milestone_steps: list[Positive] = Field(default_factory=list)
    note: str = ""

    @model_validator(mode="after")
    def _some_length(self) -> PaperBudget:
        if self.steps is None and self.epochs is None:
            raise ValueError("give steps (optimiser steps) or epochs; omit budget if none")
        return self


class ScopedSetting(_Strict):
    """A setting's value in the cells whose id contains ``cells``."""

    cells: str = Field(min_length=1)
    value: Any


class PaperBlock(_Strict):
    """A suite's ``paper:`` block (see the module docstring)."""

    cite: str = Field(min_length=1)
    where: str = Field(min_length=1)
    budget: PaperBudget | None = None
    settings: dict[str, Any] = Field(default_factory=dict)
    deviations: dict[str, str] = Field(default_factory=dict)

    @field_validator("cite", "where")
    @classmethod
    def _no_path(cls, v: str) -> str:
        if _PATHLIKE.search(v):
            raise ValueError(
                f"cite the paper by authors, title, year and section, not a path: {v!r}"
            )
        return v

    @field_validator("settings")
    @classmethod
    def _settings(cls, v: dict[str, Any]) -> dict[str, Any]:
        for key, value in v.items():
            head = key.split(".")[0]
            if not (head in TOP_KEYS and key == head) and not (
                head in CELL_SECTIONS and len(key.split(".")) >= 2 and all(key.split("."))
            ):
                raise ValueError(
                    f"settings key {key!r}: expected SECTION.KEY (SECTION one of "
                    f"{', '.join(CELL_SECTIONS)}) or one of {', '.join(TOP_KEYS)}"
                )
            for entry in _scoped(value) or ():
                ScopedSetting.model_validate(entry)
        return v

    @model_validator(mode="after")
    def _deviation_keys(self) -> PaperBlock:
        for key, why in self.deviations.items():
            if key not in self.settings and key not in FREE_DEVIATIONS:
                raise ValueError(
                    f"deviations key {key!r} names no settings key and is not one of "
                    f"{', '.join(FREE_DEVIATIONS)}"
                )
            if not why.strip():
                raise ValueError(f"deviations key {key!r}: say why we differ")
        return self


def _scoped(value: Any) -> list[dict[str, Any]] | None:
    """The scoped entries of a settings value (``{cells, value}`` or a list of them), else None."""
    if isinstance(value, dict) and "cells" in value:
        return [value]
    if (
        isinstance(value, list)
        and value
        and all(isinstance(e, dict) and "cells" in e for e in value)
    ):
        return list(value)
    return None


def same(a: Any, b: Any) -> bool:
    """Whether a suite value ``a`` is the paper's ``b`` (numbers to 1e-9 relative; lists and
    tuples alike; no bool for a number)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


_MISSING = object()


def _factory_default(section: str, name: str, key: str) -> Any:
    """The default of ``key`` in the signature of the ``section`` factory ``name``, if any."""
    from ..core.registry import datasets, inits, models

    registry = {"model": models, "init": inits, "data": datasets}.get(section)
    if registry is None or name not in registry:
        return _MISSING
    try:
        fn = registry.get(name)
        p = inspect.signature(fn).parameters.get(key)
    except (TypeError, ValueError):
        return _MISSING
    if p is None or p.default is inspect.Parameter.empty:
        return _MISSING
    return p.default


def cell_value(cell: Any, key: str) -> Any:
    """The value of the dotted ``key`` in ``cell`` (the factory's default where a model, init
    or dataset key is not set), or :data:`_MISSING`."""
    head, *rest = key.split(".")
    node: Any = getattr(cell, head)
    for i, part in enumerate(rest):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list | tuple) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif i == 0 and len(rest) == 1 and isinstance(node, dict):
            return _factory_default(head, str(node.get("name", "")), part)
        else:
            return _MISSING
    return node


def checked_settings(block: dict[str, Any]) -> dict[str, Any]:
    """The settings entries :func:`paper_mismatches` compares (those not under deviations)."""
    dev = block.get("deviations") or {}
    return {k: v for k, v in (block.get("settings") or {}).items() if k not in dev}


def paper_mismatches(suite: Any) -> list[str]:
    """One line per setting of the suite's ``paper:`` block (outside its deviations) that
    the loaded suite does not hold: ``KEY: cell ID has X, the paper states Y``. [] when the
    suite has no block or every setting holds."""
    block = suite.paper
    if not block:
        return []
    out: list[str] = []
    for key, value in checked_settings(block).items():
        if key in TOP_KEYS:
            got = suite.resolved.get(key, _MISSING)
            if got is _MISSING or not same(got, value):
                out.append(f"{key}: the suite has {_show(got)}, the paper states {value!r}")
            continue
        entries = _scoped(value) or [{"cells": "", "value": value}]
        for entry in entries:
            cells = [c for c in suite.cells if entry["cells"] in c.id]
            if not cells:
                out.append(f"{key}: cells {entry['cells']!r} match no cell of the suite")
            for c in cells:
                got = cell_value(c, key)
                if got is _MISSING or not same(got, entry["value"]):
                    out.append(
                        f"{key}: cell {c.id} has {_show(got)}, the paper states {entry['value']!r}"
                    )
    return out


def _show(v: Any) -> str:
    return "no such setting" if v is _MISSING else repr(v)
