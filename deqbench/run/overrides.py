"""``--set`` across cells: ``all.SECTION.KEY=VALUE`` forces a value on every cell, and a
``defaults.SECTION.KEY=VALUE`` that some cells override is named in one warning line.

``--set defaults.train.epochs=1`` changes the suite's default, which a cell that sets
``train.epochs`` itself (a matrix axis, a ``case`` entry) keeps overriding, as in the file.
``--set all.train.epochs=1`` sets the default *and* the key in every matrix value that sets
it (a ``case`` entry, a ``train`` axis value, a ``train.epochs`` axis, which then has the one
value), so every cell runs with it; the rewritten suite is what the run directory's
``suite.yaml`` records, and cell ids name the forced value where they named the old one.

Example:
    >>> raw = {"defaults": {"train": {"epochs": 5}},
    ...        "matrix": {"case": [{"model": "a", "train": {"epochs": 3}}, {"model": "b"}]}}
    >>> force_on_every_cell(raw, "all.train.epochs=1", None)
    >>> raw["defaults"]["train"], raw["matrix"]["case"][0]["train"]
    ({'epochs': 1}, {'epochs': 1})
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..core.errors import ConfigError
from ..core.errors import shown as _shown
from .matrix import CASE, NAMED, SECTIONS
from .yamlio import Locator, parse_scalar

__all__ = ["FORCE", "force_on_every_cell", "is_forced", "overridden_defaults"]

#: first key of an override that forces a value on every cell
FORCE = "all"


def is_forced(item: str) -> bool:
    """True for ``all.SECTION.KEY=VALUE``."""
    return item.partition("=")[0].strip().split(".")[0] == FORCE


def _sets(value: Any, sub: Sequence[str], named: bool) -> bool:
    """Whether a matrix value of a section would decide ``sub`` over the default: it sets the
    key, or it names the section's entry (a solver, a model...), which may drop the default's
    own keys."""
    if isinstance(value, dict):
        return sub[0] in value or (named and "name" in value)
    return named and isinstance(value, str)


def _with(value: Any, sub: Sequence[str], new: Any, named: bool) -> Any:
    """A section value (a name or a mapping) with ``sub`` set to ``new``; other values as they
    are (validation reports them)."""
    if isinstance(value, str) and named:
        value = {"name": value}
    if not isinstance(value, dict):
        return value
    out = copy.deepcopy(value)
    cur = out
    for k in sub[:-1]:
        if not isinstance(cur.get(k), dict):
            cur[k] = {}
        cur = cur[k]
    cur[sub[-1]] = copy.deepcopy(new)
    return out


def force_on_every_cell(raw: dict[str, Any], item: str, loc: Locator | None) -> None:
    """Apply ``all.SECTION.KEY=VALUE`` to ``raw`` (in place): the default (``defaults.SECTION``,
    or ``data``) and every matrix value that sets the key, or the section by name, get it.

    Raises:
        ConfigError: not ``all.SECTION.KEY=VALUE`` with a known section.
    """
    key, sep, text = item.partition("=")
    parts = key.strip().split(".")
    if not sep or len(parts) < 3 or parts[1] not in SECTIONS or not all(parts[2:]):
        raise ConfigError(
            f"--set {_shown(item, 80)}: expected all.SECTION.KEY=VALUE (forces the value on every "
            f"cell, e.g. all.train.epochs=1) with SECTION one of {', '.join(SECTIONS)}"
        )
    section, sub = parts[1], parts[2:]
    value = parse_scalar(text)
    named = section in NAMED
    label = f"--set {item}"
    where: tuple[Any, ...] = ("data",) if section == "data" else ("defaults", section)
    parent: Any = raw
    for k in where[:-1]:
        if not isinstance(parent.get(k), dict):
            parent[k] = {}
        parent = parent[k]
    parent[where[-1]] = _with(parent.get(where[-1]) or {}, sub, value, named)
    marks = [(*where, *sub)]
    matrix = raw.get("matrix")
    dotted = ".".join(sub)
    if isinstance(matrix, dict):
        for axis, values in list(matrix.items()):
            if not isinstance(values, list):
                continue
            if axis == CASE:
                for i, case in enumerate(values):
                    if not isinstance(case, dict):
                        continue
                    for ck in list(case):
                        csec, dot, csub = str(ck).partition(".")
                        if csec != section:
                            continue
                        if not dot:
                            if _sets(case[ck], sub, named):
                                case[ck] = _with(case[ck], sub, value, named)
                                marks.append(("matrix", CASE, i, ck, *sub))
                        elif csub == dotted:
                            case[ck] = copy.deepcopy(value)
                            marks.append(("matrix", CASE, i, ck))
                        elif dotted.startswith(csub + "."):
                            case[ck] = _with(case[ck], sub[len(csub.split(".")) :], value, False)
                            marks.append(("matrix", CASE, i, ck))
                continue
            asec, dot, asub = axis.partition(".")
            if asec != section:
                continue
            if not dot:
                matrix[axis] = [
                    _with(v, sub, value, named) if _sets(v, sub, named) else v for v in values
                ]
            elif asub == dotted:  # an axis over the forced key: it has the one value now
                matrix[axis] = [copy.deepcopy(value)]
            elif dotted.startswith(asub + "."):
                rest = sub[len(asub.split(".")) :]
                matrix[axis] = [_with(v, rest, value, False) for v in values]
            else:
                continue
            marks.append(("matrix", axis))
    if loc is not None:
        for m in marks:
            loc.overridden[m] = label


def overridden_defaults(
    overrides: Iterable[str],
    drafts: Sequence[Any],
    aliases: Mapping[str, Sequence[str]],
    limit: int = 8,
) -> list[str]:
    """One warning line per ``defaults.SECTION.KEY=VALUE`` override (``aliases`` applied, e.g.
    ``runtime.amp``) that some cells do not take, because a matrix value sets the key (or
    changes the section's name, which drops the key): the cells, at most ``limit`` named, and
    the ``all.`` override that would force it. ``drafts``: the expanded cells
    (:class:`~deqbench.run.matrix.Draft`, whose ``src`` says where each key came from)."""
    lines = []
    for item in overrides:
        if is_forced(item):
            continue
        key = item.partition("=")[0].strip()
        parts = key.split(".")
        if parts[0] in aliases:
            parts = [*aliases[parts[0]], *parts[1:]]
        if len(parts) < 3 or parts[0] != "defaults" or parts[1] not in SECTIONS:
            continue
        section, field_key = parts[1], parts[2]
        cells = [
            d.id
            for d in drafts
            if tuple((d.src.get(section) or {}).get(field_key) or ())[:1] != ("defaults",)
        ]
        if not cells:
            continue
        names = ", ".join(cells[:limit]) + (
            f", ... +{len(cells) - limit} more" if len(cells) > limit else ""
        )
        forced = ".".join([FORCE, *parts[1:]]) + "=" + item.partition("=")[2]
        lines.append(
            f"--set {_shown(item, 80)}: {len(cells)} of {len(drafts)} cells set "
            f"{section}.{field_key} themselves and keep their value ({names}); "
            f"--set {_shown(forced, 80)} forces it on every cell"
        )
    return lines
