"""YAML reading with source positions, for ``FILE:LINE:COL: dotted.path: message`` errors.

PyYAML's safe loader follows YAML 1.1, where ``1e-4`` is a *string*; suites are written by
people who mean a float, so :class:`Loader` also resolves exponent floats without a dot.
:func:`read_yaml` returns the data together with a :class:`Locator` that maps a path such as
``("defaults", "solver", "max_iters")`` to the line and column of that key or value.

Example:
    >>> data, loc = read_yaml_text("a:\\n  b: 1e-4\\n", "x.yaml")
    >>> data["a"]["b"], loc.where(("a", "b"))
    (0.0001, 'x.yaml:2:6')
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from ..core.errors import ConfigError
from ..core.errors import shown as _shown

Path_ = tuple[Any, ...]


#: Limits of :func:`read_yaml`: the file size in bytes, the nesting depth, and the number of
#: nodes once aliases are expanded (a "billion laughs" alias bomb of 1 KB expands to 10**9).
#: The shipped suites have at most ~300 nodes; the limits refuse hostile files and bound the
#: time PyYAML's pure-Python parser spends on one to about a second.
MAX_YAML_BYTES = 1024 * 1024
MAX_YAML_DEPTH = 100
MAX_YAML_NODES = 20_000
#: Limit of the text a document stands for once aliases are expanded (scalars' characters):
#: 200 aliases of one 200 KB string are a 40 MB suite (every name and value may be echoed in
#: an error line), though the file is within :data:`MAX_YAML_BYTES`.
MAX_YAML_EXPANDED_BYTES = 2 * MAX_YAML_BYTES


class LimitError(yaml.composer.ComposerError):
    """A YAML document beyond :data:`MAX_YAML_DEPTH`, :data:`MAX_YAML_NODES` or
    :data:`MAX_YAML_EXPANDED_BYTES`, or with an alias inside its own anchor."""


class Loader(yaml.SafeLoader):
    """Safe loader (no Python tags) that also reads ``1e-4`` / ``5E3`` as floats (YAML 1.2
    behaviour), and refuses documents nested deeper than :data:`MAX_YAML_DEPTH`, with more than
    :data:`MAX_YAML_NODES` nodes or :data:`MAX_YAML_EXPANDED_BYTES` characters of scalars counting
    every alias as what it stands for, and recursive aliases (``a: &x [*x]``: an alias inside the
    node it names, a structure without end)."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._depth = 0
        self._nodes = 0  # nodes composed so far, an alias counted as its anchor's expansion
        self._chars = 0  # characters of the scalars composed so far, likewise
        self._sizes: dict[int, tuple[int, int]] = {}  # id(node) -> expanded (nodes, chars)

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            node = super().compose_node(parent, index)  # the anchored node, or an error
            size = self._sizes.get(id(node))
            if size is None:  # its anchor is still being composed: the alias is inside it
                raise LimitError(
                    None, None,
                    f"alias *{_shown(event.anchor, 40)} inside the node it names (a recursive "
                    "alias: a structure without end)",
                    event.start_mark,
                )  # fmt: skip
            self._count(*size, event.start_mark)
            return node
        self._depth += 1
        if self._depth > MAX_YAML_DEPTH:
            raise LimitError(
                None, None, f"nested deeper than {MAX_YAML_DEPTH} levels (the limit)",
                self.peek_event().start_mark,
            )  # fmt: skip
        before = (self._nodes, self._chars)
        self._count(1, 0, None)
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if isinstance(node, yaml.ScalarNode):
            self._count(0, len(node.value), node.start_mark)
        self._sizes[id(node)] = (self._nodes - before[0], self._chars - before[1])
        return node

    def _count(self, nodes: int, chars: int, mark: Any) -> None:
        self._nodes += nodes
        self._chars += chars
        if self._nodes > MAX_YAML_NODES or self._chars > MAX_YAML_EXPANDED_BYTES:
            mark = mark if mark is not None else self.peek_event().start_mark
            what = (
                f"more than {MAX_YAML_NODES} nodes"
                if self._nodes > MAX_YAML_NODES
                else f"more than {MAX_YAML_EXPANDED_BYTES // 2**20} MiB of text"
            )
            raise LimitError(
                None, None, f"{what} with aliases expanded (the limit; an alias bomb?)", mark
            )


Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_scalar(text: str) -> Any:
    """A command-line value as YAML would read it (``1`` int, ``1e-3`` float, ``[0, 1]`` list)."""
    try:
        return yaml.load(text, Loader=Loader)  # noqa: S506 - Loader is a SafeLoader
    except yaml.YAMLError:
        return text


def format_path(path: Sequence[Any]) -> str:
    """``("analyses", 1, "spectral")`` -> ``analyses[1].spectral`` (keys from the file cut to 80
    characters, control characters escaped: the path is echoed in error lines)."""
    out = ""
    for p in path:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            out += ("." if out else "") + _shown(p, 80)
    return out


class Locator:
    """Maps YAML paths to ``file:line:col`` (1-based). Paths set on the command line are
    reported by the option that set them (``overridden[path] = "--set a.b=1"``)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.key_marks: dict[Path_, tuple[int, int]] = {}
        self.value_marks: dict[Path_, tuple[int, int]] = {}
        self.overridden: dict[Path_, str] = {}

    def _find(self, path: Path_, prefer_key: bool) -> tuple[Path_, tuple[int, int] | None]:
        p = tuple(path)
        for n in range(len(p), 0, -1):
            if p[:n] in self.overridden:  # the whole subtree came from the command line
                return p[:n], None
        first, second = (
            (self.key_marks, self.value_marks) if prefer_key else (self.value_marks, self.key_marks)
        )
        while p:
            mark = first.get(p) or second.get(p)
            if mark is not None:
                return p, mark
            p = p[:-1]
        return p, None

    def where(self, path: Sequence[Any], prefer_key: bool = False) -> str:
        """``file:line:col`` of ``path`` (or of its closest ancestor present in the file)."""
        p, mark = self._find(tuple(path), prefer_key)
        if p in self.overridden:
            return self.overridden[p]
        if mark is None:
            return self.source
        return f"{self.source}:{mark[0]}:{mark[1]}"

    def error(self, path: Sequence[Any], message: str, prefer_key: bool = False) -> str:
        """One error line ``WHERE: dotted.path: message``."""
        dotted = format_path(path)
        head = self.where(path, prefer_key)
        if head.startswith("--") and not head.startswith("--set "):
            return f"{head}: {message}"  # a command-line option: its name says where
        return f"{head}: {dotted}: {message}" if dotted else f"{head}: {message}"

    # -- building ---------------------------------------------------------------------------
    def _walk(self, node: yaml.Node, path: Path_, dups: list[str]) -> None:
        if isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            for k, v in node.value:
                key = k.value if isinstance(k, yaml.ScalarNode) else str(k.value)
                sub = (*path, key)
                if key in seen:
                    m = k.start_mark
                    dups.append(
                        f"{self.source}:{m.line + 1}:{m.column + 1}: {format_path(sub)}: duplicate key"
                    )
                seen.add(key)
                self.key_marks[sub] = (k.start_mark.line + 1, k.start_mark.column + 1)
                self.value_marks[sub] = (v.start_mark.line + 1, v.start_mark.column + 1)
                self._walk(v, sub, dups)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                sub = (*path, i)
                self.value_marks[sub] = (item.start_mark.line + 1, item.start_mark.column + 1)
                self._walk(item, sub, dups)


def read_yaml_text(text: str, source: str) -> tuple[Any, Locator]:
    """Parse ``text``; raise :class:`ConfigError` with ``source:line:col`` on invalid YAML."""
    loc = Locator(source)
    try:
        loader = Loader(text)
    except yaml.reader.ReaderError as exc:  # a control character (NUL, ...) in the text
        line = text.count("\n", 0, exc.position) + 1
        col = exc.position - (text.rfind("\n", 0, exc.position) + 1) + 1
        char = f"#x{exc.character:04x}" if isinstance(exc.character, int) else "a character"
        raise ConfigError(
            f"{source}:{line}:{col}: invalid YAML: control character {char} is not allowed"
        ) from None
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as exc:
        m = exc.problem_mark or exc.context_mark
        where = f"{source}:{m.line + 1}:{m.column + 1}" if m is not None else source
        what = exc.problem or exc.context or "cannot parse"
        head = "YAML refused" if isinstance(exc, LimitError) else "invalid YAML"
        raise ConfigError(f"{where}: {head}: {what}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: invalid YAML: {' '.join(str(exc).split())}") from None
    finally:
        loader.dispose()
    if node is not None:
        dups: list[str] = []
        loc._walk(node, (), dups)
        if dups:
            raise ConfigError("\n".join(dups))
    return data, loc


def read_yaml(path: str | Path) -> tuple[Any, Locator]:
    """Read a YAML file; a missing or unreadable file is a one-line :class:`ConfigError`."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{path}: no such file")
    if p.is_dir():
        raise ConfigError(f"{path}: is a directory, expected a suite YAML file")
    try:
        if p.stat().st_size > MAX_YAML_BYTES:
            raise ConfigError(
                f"{path}: YAML refused: larger than {MAX_YAML_BYTES // 2**20} MiB (the limit)"
            )
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    return read_yaml_text(text, str(path))


def did_you_mean(key: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices``, or ``""``."""
    close = difflib.get_close_matches(str(key), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def pydantic_lines(
    exc: Any,
    loc: Locator,
    to_path: Callable[[tuple[Any, ...]], tuple[Any, ...]] | tuple[Any, ...],
    allowed: Callable[[tuple[Any, ...]], Iterable[str]] | Iterable[str],
) -> list[str]:
    """One located line per error of a pydantic ``ValidationError``.

    Args:
        to_path: maps an error's ``loc`` to the YAML path it came from, or a path prefix.
        allowed: the keys allowed (or a function of the location), for "did you mean".
    """
    lines: list[tuple[Any, ...] | str] = []  # a path: a union's placeholder
    unions: dict[tuple[Any, ...], list[str]] = {}  # path -> messages of a union's members
    for e in exc.errors():
        where = tuple(e["loc"])
        # a union's members add a type tag to the location (``output.int``,
        # ``output.literal['sum','scalar','full']``): one line per field, no pydantic internals
        while where and isinstance(where[-1], str) and _TYPE_TAG.match(where[-1]):
            where = where[:-1]
            e = {**e, "_union": True}
        path = to_path(where) if callable(to_path) else (*to_path, *where)
        if e.get("_union"):
            msg = _message(e)
            if path not in unions:
                unions[path] = []
                lines.append(path)  # placeholder, filled below
            unions[path].append(msg)
            continue
        if e["type"] == "extra_forbidden":
            keys = allowed(where[:-1]) if callable(allowed) else allowed
            hint = did_you_mean(str(where[-1]), keys)
            lines.append(loc.error(path, "unknown key" + hint, True))
        elif e["type"] == "missing":
            lines.append(loc.error(path, "missing required key"))
        else:
            lines.append(loc.error(path, _message(e)))
    out = []
    for item in lines:
        if isinstance(item, tuple):
            got = ""
            msgs = []
            for m in unions[item]:
                m, _, g = m.partition(" (got ")
                got = got or (f" (got {g}" if g else "")
                m = m.split(", unable to")[0]
                msgs.append(m[len("Input should be ") :] if m.startswith("Input should be ") else m)
            out.append(loc.error(item, "expected " + " or ".join(dict.fromkeys(msgs)) + got))
        else:
            out.append(item)
    return out


_TYPE_TAG = re.compile(
    r"^(int|float|str|bool|none|list\[.*\]|dict\[.*\]|literal\[.*\]|function-.*)$"
)


def _message(e: dict[str, Any]) -> str:
    """pydantic's message without its "Value error, " prefix, with the value given once."""
    msg = str(e["msg"])
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            msg = msg[len(prefix) :]
    got = e.get("input")
    if isinstance(got, str | int | float | bool) and repr(got) not in msg and str(got) not in msg:
        msg += f" (got {_shown(repr(got), 120)})"
    return msg


def apply_overrides(
    raw: dict[str, Any],
    overrides: Iterable[str],
    loc: Locator,
    named: Iterable[str] = (),
    aliases: Mapping[str, Sequence[str]] | None = None,
) -> None:
    """Apply ``KEY=VALUE`` overrides with dotted keys to ``raw`` (values parsed as YAML) and
    record them in ``loc``. ``matrix.solver.tol=[...]`` keeps the dot in the axis name; a string
    value of a ``named`` section becomes ``{name: value}`` before a key is set inside it.
    ``aliases`` maps a first key to the path it is short for (``runtime`` ->
    ``defaults.runtime``)."""
    named = set(named)
    aliases = aliases or {}
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--set {item}: expected KEY=VALUE (e.g. defaults.train.epochs=1)")
        parts: list[Any] = key.split(".")
        if parts[0] in aliases:
            parts = [*aliases[parts[0]], *parts[1:]]
        if parts[0] == "matrix" and len(parts) > 2:
            parts = ["matrix", ".".join(parts[1:])]
        cur: Any = raw
        for p in parts[:-1]:
            nxt = cur.get(p)
            if isinstance(nxt, str) and p in named:
                nxt = {"name": nxt}
            if not isinstance(nxt, dict):
                nxt = {}
            cur[p] = nxt
            cur = nxt
        cur[parts[-1]] = parse_scalar(text)
        loc.overridden[tuple(parts)] = f"--set {item}"
