"""Matrix expansion: defaults x matrix axes -> cells, with readable, stable cell ids.

A matrix axis is a section (``model``, ``init``, ``solver``, ``backward``, ``train``, ``data``)
whose values are merged over the defaults, or a dotted key (``solver.tol``,
``model.activation``) whose values set one field, or ``case``: a list of mappings that each set
several sections or keys together (zipped, not crossed; an optional ``id`` names the case), e.g.
``case: [{model: pcdeq_l, data: {flatten: true}}, {model: pcdeq_mc, data: {size: 28}}]``. A string value of a named section means
``{name: value}``. When an axis changes a section's ``name``, the defaults' name-specific params
of that section (a model factory's kwargs, a solver's options) are dropped; the generic fields
(``max_iter``, ``tol``, ...) are kept.

Cell ids are ``<model>-<solver>-<backward>`` plus, for every axis, the params that vary along it
(``conv_deq_tiny-anderson-phantom-k=5``), plus the cell's ``runtime`` settings that differ from
their defaults, wherever they were set (``...-k=5-amp=bf16``; a runtime axis adds nothing else,
so a cell with the default runtime keeps the id it had before runtime existed). They depend only
on the suite, so they are stable across runs. Every key of a cell remembers the YAML path it
came from (``src``), so later checks can point at the line that set it.

Example:
    >>> cells = expand({"model": {"name": "m"}, "solver": {"name": "fp"}, "backward": {"name": "ift"}},
    ...                {"solver.tol": [0.1, 0.01]}, {})
    >>> [c.id for c in cells]
    ['m-fp-ift-tol=0.1', 'm-fp-ift-tol=0.01']
"""

from __future__ import annotations

import copy
import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

SECTIONS = ("model", "init", "solver", "backward", "train", "data", "runtime")
CASE = "case"  # axis whose values set several sections at once (zipped, not crossed)
NAMED = ("model", "init", "solver", "backward", "data")
ID_BASE = ("model", "solver", "backward")
#: sections whose non-default values end the cell id (``-amp=bf16``) instead of axis parts
ID_SUFFIX = ("runtime",)
#: (section, key) -> what YAML 1.1's booleans mean there (an unquoted ``off`` reads as false)
BOOL_WORDS = {("runtime", "cuda_graph"): {False: "off", True: "auto"}}
_MISSING = object()

#: Caps checked before anything runs (a suite's ``caps: false``, or ``--set caps=false`` on any
#: command, lifts the first two): training epochs of a cell, and tasks (cells x seeds) of a
#: suite; seeds are integers in [0, MAX_SEED].
MAX_EPOCHS = 100_000
MAX_TASKS = 10_000
MAX_SEED = 2**63 - 1


@dataclass
class Draft:
    """An expanded cell before validation: section dicts and where each key came from."""

    id: str
    sections: dict[str, dict[str, Any]]
    src: dict[str, dict[str, tuple[Any, ...]]]  # section -> key -> YAML path
    block: dict[str, tuple[Any, ...]] = field(default_factory=dict)  # section -> YAML path


def fmt_value(v: Any) -> str:
    """Short text of a param value for cell ids."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, list | tuple):
        return "_".join(fmt_value(x) for x in v)
    if isinstance(v, dict):
        return "_".join(f"{k}={fmt_value(x)}" for k, x in v.items())
    if v is None:
        return "none"
    return str(v)


def _clean(part: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=+-]", "_", part)


def normalize_section(section: str, value: Any) -> Any:
    """A string means ``{name: value}`` for named sections; None means ``{}``."""
    if value is None:
        return {}
    if isinstance(value, str) and section in NAMED:
        return {"name": value}
    return value


def check_matrix(matrix: dict[str, list[Any]] | None, loc: Any) -> list[str]:
    """Error lines for unknown axes, empty lists and values that are not a name or a mapping
    (``loc``: a :class:`~deqbench.run.yamlio.Locator`)."""
    from .yamlio import did_you_mean

    if matrix is None:
        return []
    if not matrix:
        msg = "empty matrix: no cells (give an axis, or remove `matrix` for a single cell)"
        return [loc.error(("matrix",), msg)]
    errors = []
    for key, values in matrix.items():
        section, dot, sub = key.partition(".")
        if key == CASE:
            errors += _check_cases(values, loc)
            continue
        if section not in SECTIONS or (dot and (not sub or "." in sub)):
            hint = did_you_mean(section, SECTIONS)
            msg = f"unknown matrix axis (use a section {', '.join(SECTIONS)} or SECTION.KEY){hint}"
            errors.append(loc.error(("matrix", key), msg, True))
        elif not values:
            errors.append(loc.error(("matrix", key), "empty list: the matrix would have no cells"))
        elif not dot:
            what = "a name or a mapping" if section in NAMED else "a mapping"
            for i, v in enumerate(values):
                if not isinstance(normalize_section(section, v), dict):
                    errors.append(loc.error(("matrix", key, i), f"expected {what}"))
    return errors


def count_cells(matrix: dict[str, list[Any]] | None) -> int:
    """Cells of the matrix (the product of its axes' lengths, ``case`` one axis), without
    expanding it."""
    n = 1
    for values in (matrix or {}).values():
        n *= len(values) if isinstance(values, list) else 1
    return n


def check_size(matrix: dict[str, list[Any]] | None, seeds: int, loc: Any, caps: bool) -> list[str]:
    """An error line where cells x seeds exceeds :data:`MAX_TASKS` (unless ``caps`` is off)."""
    if not caps:
        return []
    cells = count_cells(matrix)
    if cells * seeds <= MAX_TASKS:
        return []
    what = f"{cells} cell{'s' * (cells != 1)} x {seeds} seed{'s' * (seeds != 1)} = {cells * seeds} tasks"
    return [
        loc.error(
            ("matrix",) if matrix else ("seeds",),
            f"{what}, over the cap of {MAX_TASKS} tasks (caps: false in the suite, or --set "
            "caps=false, lifts it)",
            True,
        )
    ]


def _check_cases(values: Any, loc: Any) -> list[str]:
    from .yamlio import did_you_mean

    if not isinstance(values, list) or not values:
        return [loc.error(("matrix", CASE), "expected a non-empty list of mappings")]
    errors = []
    ids: dict[str, int] = {}
    for i, case in enumerate(values):
        if not isinstance(case, dict):
            errors.append(loc.error(("matrix", CASE, i), "expected a mapping of sections"))
            continue
        for key, v in case.items():
            section, dot, sub = str(key).partition(".")
            if key == "id":
                errors += _check_case_id(v, i, ids, loc)
                continue
            if section not in SECTIONS or (dot and not sub):
                hint = did_you_mean(section, SECTIONS)
                msg = f"unknown case key (use a section {', '.join(SECTIONS)}, SECTION.KEY or id){hint}"
                errors.append(loc.error(("matrix", CASE, i, key), msg, True))
            elif not dot and not isinstance(normalize_section(section, v), dict):
                errors.append(loc.error(("matrix", CASE, i, key), "expected a name or a mapping"))
    return errors


def _check_case_id(v: Any, i: int, ids: dict[str, int], loc: Any) -> list[str]:
    """A case ``id`` names its cells: a non-empty string of id characters, given once."""
    where = ("matrix", CASE, i, "id")
    if not isinstance(v, str) or not v or _clean(v) != v:
        return [
            loc.error(
                where,
                "expected a non-empty id of letters, digits and _ . = + - (it names the cell)",
            )
        ]
    if v in ids:
        return [
            loc.error(
                where,
                f"case id {v!r} is also the id of case {ids[v]}: ids name cells, give each its own",
            )
        ]
    ids[v] = i
    return []


def _case_parts(values: list[dict[str, Any]]) -> list[list[tuple[str, Any]]]:
    """Id parts of case values: the case's ``id``, else the values that vary across cases."""
    out = []
    for case in values:
        if "id" in case:
            out.append([("", case["id"])])
            continue
        parts = []
        for key, v in case.items():
            section, _, sub = key.partition(".")
            if section in ID_BASE and not sub:
                continue  # already in the id head
            if section in ID_SUFFIX:
                continue  # the id's suffix shows it (non-default values only)
            if sub:
                parts.append((sub, v))
            else:
                nv = normalize_section(section, v)
                parts.append(("", nv["name"] if "name" in nv else fmt_value(nv)))
        out.append(parts)
    return out


def _axis_names(section: str, sub: str | None, values: list[Any]) -> list[list[tuple[str, Any]]]:
    """Per axis value, its ``name`` where names vary along an axis of a :data:`ID_BASE` section:
    what the generated head shows, needed where a case ``id`` replaces the head."""
    if sub is not None or section not in ID_BASE:
        return [[] for _ in values]
    names = [v.get("name", _MISSING) for v in values]
    varies = len({repr(n) for n in names}) > 1
    return [[("", n)] if varies and n is not _MISSING else [] for n in names]


def _case_runtime_keys(case: dict[str, Any]) -> set[str]:
    """The :data:`ID_SUFFIX` keys a case sets itself (``runtime.amp`` or ``runtime: {...}``)."""
    out: set[str] = set()
    for key, v in case.items():
        section, _, sub = str(key).partition(".")
        if section in ID_SUFFIX:
            out |= {sub} if sub else set(normalize_section(section, v) or {})
    return out


def _axis_parts(section: str, sub: str | None, values: list[Any]) -> list[list[tuple[str, Any]]]:
    """Per axis value, the (key, value) pairs that vary along the axis (for the cell id)."""
    if section in ID_SUFFIX:
        return [[] for _ in values]  # the id's suffix shows it (non-default values only)
    if sub is not None:
        varies = len({repr(v) for v in values}) > 1
        return [[(sub, v)] if varies else [] for v in values]
    keys: list[str] = []
    for v in values:
        keys += [k for k in v if k not in keys]
    varying = [k for k in keys if len({repr(v.get(k, _MISSING)) for v in values}) > 1]
    out = []
    for v in values:
        parts = []
        for k in varying:
            if k not in v or (k == "name" and section in ID_BASE):
                continue
            parts.append(("", v[k]) if k == "name" else (k, v[k]))
        out.append(parts)
    return out


def _apply(
    sections: dict[str, dict[str, Any]],
    src: dict[str, dict[str, tuple[Any, ...]]],
    block: dict[str, tuple[Any, ...]],
    generic: dict[str, set[str]],
    section: str,
    field_key: str | None,
    value: Any,
    raw: Any,
    path: tuple[Any, ...],
) -> None:
    """Merge one axis value into a cell's sections, recording where each key came from."""
    cur = sections.setdefault(section, {})
    if field_key is not None:
        cur[field_key] = copy.deepcopy(value)
        src[section][field_key] = path
        return
    if "name" in value and value["name"] != cur.get("name"):
        keep = generic.get(section, set())
        for k in [k for k in cur if k not in keep and k != "name"]:
            del cur[k]
            src[section].pop(k, None)
    cur.update(copy.deepcopy(value))
    for k in value:
        src[section][k] = path if isinstance(raw, str) else (*path, k)
    block[section] = path


def id_suffix(
    sections: dict[str, dict[str, Any]],
    suffix_defaults: dict[str, dict[str, Any]],
    skip: set[str] | frozenset[str] = frozenset(),
) -> list[str]:
    """Id parts of the :data:`ID_SUFFIX` sections: ``key=value`` for every key whose value
    differs from ``suffix_defaults[section]`` (section -> key -> default), in the defaults'
    order, then any other key in the cell's order; not the keys in ``skip`` (those a case
    with an ``id`` sets: its id names them)."""
    parts = []
    for section in ID_SUFFIX:
        cur = sections.get(section) or {}
        if not isinstance(cur, dict):
            continue
        defaults = suffix_defaults.get(section, {})
        keys = [k for k in defaults if k in cur] + [k for k in cur if k not in defaults]
        for k in keys:
            if k in skip:
                continue
            v = cur[k]
            if k in defaults and v == defaults[k] and type(v) is type(defaults[k]):
                continue
            parts.append(_clean(f"{k}={fmt_value(v)}"))
    return parts


def fill_declared(
    sections: dict[str, dict[str, Any]],
    decl: dict[str, dict[str, Any]],
    generic: dict[str, set[str]],
) -> None:
    """Fill the keys a cell leaves unset from a model's declared defaults (in place). Where the
    cell names another solver/mode/init than the declared one, only the declared generic fields
    carry over (not the declared one's own options)."""
    for section, values in decl.items():
        cur = sections.setdefault(section, {})
        # a backward's extra options belong to its adjoint solver
        ident = ("name", "solver") if section == "backward" else ("name",)
        same = all(cur.get(k, values.get(k)) == values.get(k) for k in ident)
        keep = generic.get(section, set())
        for k, v in values.items():
            if k not in cur and (same or k in keep):
                cur[k] = copy.deepcopy(v)


def expand(
    base: dict[str, dict[str, Any]],
    matrix: dict[str, list[Any]] | None,
    base_src: dict[str, tuple[Any, ...]],
    generic: dict[str, set[str]] | None = None,
    default_names: dict[str, str] | None = None,
    declared: Callable[[str], dict[str, dict[str, Any]]] | None = None,
    suffix_defaults: dict[str, dict[str, Any]] | None = None,
    id_head: Callable[[list[str], dict[str, Any]], list[str]] | None = None,
) -> list[Draft]:
    """Cartesian product of the matrix axes over ``base`` (section -> dict).

    Args:
        base: the default sections (already normalized dicts).
        matrix: axis key -> list of values (validated: known sections, non-empty lists).
        base_src: section -> YAML path of its defaults block (``("defaults", "solver")``).
        generic: section -> field names kept when an axis changes the section's name.
        default_names: section -> the name a cell gets when no default or axis sets one.
        declared: model name -> the defaults that model declares (section -> dict; see
            :func:`deqbench.models.declare_defaults`); they fill what the suite leaves unset,
            before ``default_names``.
        suffix_defaults: section -> key -> default of the :data:`ID_SUFFIX` sections
            (``runtime``): the keys a cell sets to another value end its id.
        id_head: (``[model, solver, backward]``, the cell's sections) -> the id's first parts
            (:func:`deqbench.run.labels.id_head`: names what ran); default: unchanged.

    Returns:
        One :class:`Draft` per cell, in product order (first axis slowest).
    """
    generic = generic or {}
    default_names = default_names or {}
    suffix_defaults = suffix_defaults or {}
    axes = list((matrix or {}).items())
    # Axis values, normalized; and the id parts each value contributes.
    norm: list[tuple[str, str | None, list[Any]]] = []
    for key, values in axes:
        section, _, sub = key.partition(".")
        if key == CASE:
            norm.append((CASE, None, list(values)))
            continue
        vals = values if sub else [normalize_section(section, v) for v in values]
        norm.append((section, sub or None, vals))
    parts_by_axis = [
        _case_parts(vals) if s == CASE else _axis_parts(s, sub, vals) for s, sub, vals in norm
    ]
    names_by_axis = [_axis_names(s, sub, vals) for s, sub, vals in norm]
    short_count: dict[str, int] = {}
    for parts in parts_by_axis:
        for k in {k for p in parts for k, _ in p if k}:
            short_count[k] = short_count.get(k, 0) + 1

    drafts: list[Draft] = []
    seen: dict[str, int] = {}
    for combo in itertools.product(*[range(len(v)) for _, _, v in norm]):
        sections = copy.deepcopy(base)
        src: dict[str, dict[str, tuple[Any, ...]]] = {
            s: {k: (*base_src.get(s, (s,)), k) for k in sections.get(s, {})} for s in SECTIONS
        }
        block = {s: base_src.get(s, (s,)) for s in SECTIONS}
        id_parts: list[str] = []
        # a case's ``id`` replaces the generated id: no model-solver-backward head, and the
        # other axes of those sections name their value instead
        named_case = next(
            (
                norm[ax][2][idx]
                for ax, idx in enumerate(combo)
                if norm[ax][0] == CASE and "id" in norm[ax][2][idx]
            ),
            None,
        )

        for ax, idx in enumerate(combo):
            key = axes[ax][0]
            section, field_key, vals = norm[ax]
            value = vals[idx]
            if section == CASE:
                for ck, cv in value.items():
                    if ck == "id":
                        continue
                    csec, _, csub = ck.partition(".")
                    nv = cv if csub else normalize_section(csec, cv)
                    _apply(
                        sections,
                        src,
                        block,
                        generic,
                        csec,
                        csub or None,
                        nv,
                        cv,
                        ("matrix", key, idx, ck),
                    )
            else:
                _apply(
                    sections,
                    src,
                    block,
                    generic,
                    section,
                    field_key,
                    value,
                    axes[ax][1][idx],
                    ("matrix", key, idx),
                )
            named = names_by_axis[ax][idx] if named_case is not None else []
            for k, v in named + parts_by_axis[ax][idx]:
                label = k if not k or short_count.get(k, 0) <= 1 else f"{section}.{k}"
                id_parts.append(_clean(f"{label}={fmt_value(v)}" if label else fmt_value(v)))
        for (sec, k), words in BOOL_WORDS.items():
            cur = sections.get(sec)
            if isinstance(cur, dict) and isinstance(cur.get(k), bool):
                cur[k] = words[cur[k]]
        mname = sections.get("model", {}).get("name")
        if declared is not None and isinstance(mname, str):
            fill_declared(sections, declared(mname), generic)
        head = [
            _clean(fmt_value(sections.get(s, {}).get("name", default_names.get(s, "none"))))
            for s in ID_BASE
        ]
        if id_head is not None:
            head = [_clean(h) for h in id_head(head, sections)]
        if named_case is not None:
            skip = _case_runtime_keys(named_case)
            cid = "-".join(id_parts + id_suffix(sections, suffix_defaults, skip))
        else:
            cid = "-".join(head + id_parts + id_suffix(sections, suffix_defaults))
        n = seen.get(cid, 0) + 1
        seen[cid] = n
        if n > 1:
            cid = f"{cid}-{n}"
        drafts.append(Draft(cid, sections, src, block))
    return drafts
