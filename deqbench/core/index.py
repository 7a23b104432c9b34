"""The built-in names of every kind, read from the package's source (``deqbench ls`` imports no
torch, so that it starts fast).

The built-ins register themselves with literal calls in their own modules
(``@models.register("fc_deq")``, ``@analyses.register("landscape")``, ``@kernels.register("se")``,
``@plots.register("ntk")``, ``plots.register("backward")(fn)``, ``@dataset("digits")``). This
module finds those calls with :mod:`ast`, without importing the modules: each ``*.py`` file of the
package is parsed and every call ``R.register("name")`` (or ``R.register(name="name")``) is
recorded, the kind named by its receiver ``R``, resolved through the file's imports (relative
ones too; at module level or inside functions):

* ``models``, ``solvers``, ``inits``, ``analyses`` of :mod:`deqbench.core.registry` and the facade
  packages ``deqbench.models`` (...), whose ``register`` may also be imported and called bare;
* a registry that a module of the package defines at its top level under the name of its kind
  (the kernels' ``kernels``, wherever its family keeps it);
* the module :mod:`deqbench.run.plots` (``plots.register``; its own ``register`` inside it);
* the module :mod:`deqbench.run.reports` (``reports.register``): post-run reports, kind
  ``reports``, which ``deqbench ls`` does not list; the runner imports their modules by name;
* ``backward_modes`` of :mod:`deqbench.core.registry` (or ``registry`` of the facade
  :mod:`deqbench.backward`): backward modes, kind ``backward``;
* ``datasets`` of :mod:`deqbench.core.registry`, the decorator ``dataset`` of
  :mod:`deqbench.data.base`, and the string keys of a module-level
  dict literal whose name ends in ``DATASETS`` (``IMAGE_DATASETS = {"mnist": mnist, ...}``).

A receiver not resolved through imports counts by its own name (``plots``, ``models``, ...). A
``register()`` without a name on a function or class takes its ``name`` class attribute or its
own name, as :meth:`Registry.register` does.

**Cache.** ``deqbench/_index.json`` (committed, shipped as package data) maps each file's path to
the SHA-1 of its bytes and the names found in it. :func:`builtin_names` hashes every file and
parses only those whose hash differs (a new built-in module is found without touching the
cache: the cache only saves time, never decides what exists). The cache also records the hash of
this scanner; a cache written by another version of it is ignored as a whole. Rewrite it with
``python -m deqbench.core.index`` (``--check``: exit 1 when it is stale).

``tests/test_fast_start.py`` checks that the index gives exactly the names the registries load.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: the kinds ``deqbench ls`` lists, in its order
KINDS = ("models", "solvers", "inits", "analyses", "kernels", "datasets", "backward", "plots")
#: kinds with a :class:`~deqbench.core.registry.Registry` (and an entry-point group)
REGISTRY_KINDS = ("models", "solvers", "inits", "analyses", "kernels", "datasets", "backward")

PACKAGE = "deqbench"
#: the package's source folder
ROOT = Path(__file__).resolve().parent.parent
#: the committed cache (package data)
CACHE = ROOT / "_index.json"

#: dotted objects whose ``.register(name)`` registers a built-in of a kind
RECEIVERS: dict[str, str] = {
    **{f"{PACKAGE}.core.registry.{k}": k for k in REGISTRY_KINDS[:4]},
    **{f"{PACKAGE}.{k}": k for k in REGISTRY_KINDS[:4]},  # the facade packages
    **{f"{PACKAGE}.{k}.registry": k for k in REGISTRY_KINDS[:4]},  # what the facades import
    f"{PACKAGE}.run.plots": "plots",
    f"{PACKAGE}.run.reports": "reports",
    f"{PACKAGE}.core.registry.datasets": "datasets",
    f"{PACKAGE}.core.registry.backward_modes": "backward",
    f"{PACKAGE}.backward": "backward",  # the facade package (its ``register``)
    f"{PACKAGE}.backward.registry": "backward",  # what the facade imports
}
#: dotted functions whose call ``f(name)`` registers a built-in of a kind
FUNCTIONS: dict[str, str] = {
    **{f"{r}.register": k for r, k in RECEIVERS.items()},
    f"{PACKAGE}.data.base.dataset": "datasets",
    f"{PACKAGE}.data.dataset": "datasets",
}
#: a module-level dict literal whose name ends so holds datasets (its string keys)
DATASET_DICT_SUFFIX = "DATASETS"
#: a file without a call ``register(``/``dataset(`` (any receiver), an import ``register as``
#: or a ``...DATASETS`` name registers nothing the scanner reads: it is not parsed
_WORDS = re.compile(rb"\b(register|dataset)\s*\(|\b(register|dataset)\s+as\b|DATASETS\b")


def _sha1(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


def scanner_hash() -> str:
    """SHA-1 of this module's source: a cache written by another scanner is not reused."""
    return _sha1(Path(__file__).read_bytes())


@dataclass
class FileNames:
    """What one source file registers: kind -> names, and the calls the scanner cannot read."""

    names: dict[str, list[str]] = field(default_factory=dict)
    dynamic: list[str] = field(default_factory=list)  # "LINE: code" of a non-literal name

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.names:
            out["names"] = {k: sorted(v) for k, v in sorted(self.names.items())}
        if self.dynamic:
            out["dynamic"] = list(self.dynamic)
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> FileNames:
        names = {str(k): [str(n) for n in v] for k, v in dict(obj.get("names", {})).items()}
        return cls(names=names, dynamic=[str(d) for d in obj.get("dynamic", [])])


def module_name(rel: str) -> str:
    """``run/plots.py`` -> ``deqbench.run.plots``; ``models/__init__.py`` -> ``deqbench.models``."""
    parts = [PACKAGE, *Path(rel).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` of a Name/Attribute chain (None for anything else)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def _bindings(
    tree: ast.Module, imports: list[ast.Import | ast.ImportFrom], module: str, is_pkg: bool
) -> dict[str, str]:
    """Local name -> the dotted object it names: every import of the file (``imports``: at any
    depth; relative ones resolved) and the module's own top-level definitions."""
    package = module if is_pkg else module.rpartition(".")[0]
    out: dict[str, str] = {}
    for node in tree.body:  # own top-level names (run/plots.py's ``register``, kernels' registry)
        targets: list[ast.expr] = []
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            out[node.name] = f"{module}.{node.name}"
        elif isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        for t in targets:
            if isinstance(t, ast.Name):
                out[t.id] = f"{module}.{t.id}"
    for node in imports:
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    out[a.asname] = a.name
                else:
                    head = a.name.split(".")[0]
                    out[head] = head
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                if node.level > 1:
                    base = base[: -(node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for a in node.names:
                if a.name != "*":
                    out[a.asname or a.name] = f"{source}.{a.name}"
    return out


def _resolve(name: str, bindings: dict[str, str]) -> str:
    head, _, rest = name.partition(".")
    full = bindings.get(head, head)
    return f"{full}.{rest}" if rest else full


def _kind_of_receiver(node: ast.AST, bindings: dict[str, str]) -> str | None:
    dotted = _dotted(node)
    if dotted is None:
        return None
    full = _resolve(dotted, bindings)
    kind = RECEIVERS.get(full)
    if kind is None and full.startswith(f"{PACKAGE}.") and full.count(".") >= 2:
        attr = full.rpartition(".")[2]  # a module's registry named by its kind
        kind = attr if attr in REGISTRY_KINDS else None
    if kind is None and dotted.split(".")[0] not in bindings:
        kind = dotted.rpartition(".")[2] if dotted.rpartition(".")[2] in KINDS else None
    return kind


def _kind_of_call(call: ast.Call, bindings: dict[str, str]) -> str | None:
    """The kind a call registers into (``R.register(...)`` or a bare registering function)."""
    f = call.func
    if isinstance(f, ast.Attribute) and f.attr == "register":
        return _kind_of_receiver(f.value, bindings)
    dotted = _dotted(f)
    if dotted is not None:
        return FUNCTIONS.get(_resolve(dotted, bindings))
    return None


def _literal_name(call: ast.Call) -> str | None:
    """The name argument of a registering call when it is a string literal."""
    args = [*call.args[:1], *(k.value for k in call.keywords if k.arg == "name")]
    if len(args) == 1 and isinstance(args[0], ast.Constant) and isinstance(args[0].value, str):
        return args[0].value
    return None


def _own_name(node: ast.AST) -> str | None:
    """What an argument-less ``register()`` calls a function or class: its ``name`` class
    attribute (a string literal), else its own name."""
    if isinstance(node, ast.ClassDef):
        for stmt in node.body:
            if (
                isinstance(stmt, ast.Assign | ast.AnnAssign)
                and any(
                    isinstance(t, ast.Name) and t.id == "name"
                    for t in (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target])
                )
                and isinstance(stmt.value, ast.Constant)
                and isinstance(stmt.value.value, str)
            ):
                return stmt.value.value
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return node.name
    return None


def scan_source(source: str | bytes, rel: str) -> FileNames:
    """The names file ``rel`` (path inside the package) registers, from its ``source``."""
    data = source.encode() if isinstance(source, str) else source
    if not _WORDS.search(data):  # no registering call can be in it
        return FileNames()
    module = module_name(rel)
    tree = ast.parse(source, filename=rel)
    imports: list[ast.Import | ast.ImportFrom] = []
    calls: list[ast.Call] = []
    decorated: dict[int, str] = {}  # id(call) -> the decorated def's own name
    draws: set[int] = set()  # id(call) of decorators of classes that define `plot`
    for node in ast.walk(tree):  # one pass (walking dominates the time)
        if isinstance(node, ast.Call):
            calls.append(node)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            imports.append(node)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            own = _own_name(node)
            plots_here = isinstance(node, ast.ClassDef) and any(
                isinstance(b, ast.FunctionDef) and b.name == "plot" for b in node.body
            )
            for d in node.decorator_list:
                if isinstance(d, ast.Call) and not d.args and not d.keywords and own:
                    decorated[id(d)] = own
                if plots_here and isinstance(d, ast.Call):
                    draws.add(id(d))
    bindings = _bindings(tree, imports, module, Path(rel).name == "__init__.py")
    found = FileNames()

    def add(kind: str, name: str) -> None:
        names = found.names.setdefault(kind, [])
        if name not in names:
            names.append(name)

    for call in calls:
        kind = _kind_of_call(call, bindings)
        if kind is None:
            continue
        name = _literal_name(call)
        if name is None and id(call) in decorated:
            name = decorated[id(call)]
        if name is not None:
            add(kind, name)
            if kind == "analyses" and id(call) in draws:  # an analysis declaring its figures
                add("plots", name)
        else:
            found.dynamic.append(f"{call.lineno}: {ast.unparse(call)}")
    for stmt in tree.body:  # module level: DATASETS = {"name": fn}, DATASETS["name"] = fn
        if not isinstance(stmt, ast.Assign | ast.AnnAssign):
            continue
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        if isinstance(stmt.value, ast.Dict) and any(
            isinstance(t, ast.Name) and t.id.endswith(DATASET_DICT_SUFFIX) for t in targets
        ):
            for key in stmt.value.keys:
                if isinstance(key, ast.Constant) and isinstance(key.value, str):
                    add("datasets", key.value)
        for t in targets:
            if (
                isinstance(t, ast.Subscript)
                and isinstance(t.value, ast.Name)
                and t.value.id.endswith(DATASET_DICT_SUFFIX)
                and isinstance(t.slice, ast.Constant)
                and isinstance(t.slice.value, str)
            ):
                add("datasets", t.slice.value)
    return found


def source_files(root: Path = ROOT) -> list[Path]:
    """Every ``*.py`` file of the package folder ``root``, sorted."""
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def read_cache(path: Path = CACHE) -> dict[str, tuple[str, FileNames]]:
    """rel path -> (sha1, names) from the cache file (empty when missing, unreadable or written
    by another scanner)."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(obj, dict) or obj.get("scanner") != scanner_hash():
            return {}
        return {
            str(rel): (str(entry["sha1"]), FileNames.from_json(entry))
            for rel, entry in dict(obj["files"]).items()
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


@dataclass
class Index:
    """The scan of a package tree: per file what it registers, and how many files were parsed."""

    files: dict[str, tuple[str, FileNames]]
    parsed: list[str] = field(default_factory=list)  # files read with ast (not from the cache)

    def names(self) -> dict[str, list[str]]:
        """kind -> sorted built-in names (every kind of :data:`KINDS`)."""
        out: dict[str, set[str]] = {k: set() for k in KINDS}
        for _, found in self.files.values():
            for kind, names in found.names.items():
                out.setdefault(kind, set()).update(names)
        return {k: sorted(v) for k, v in out.items()}

    def where(self, kind: str, name: str) -> list[str]:
        """The files that register ``name`` as a ``kind``."""
        return sorted(rel for rel, (_, f) in self.files.items() if name in f.names.get(kind, []))

    def dynamic(self) -> list[str]:
        """``FILE:LINE: code`` of each registering call whose name is not a literal."""
        return [f"{rel}:{d}" for rel, (_, f) in sorted(self.files.items()) for d in f.dynamic]

    def to_json(self) -> dict[str, Any]:
        return {
            "scanner": scanner_hash(),
            "files": {
                rel: {"sha1": sha, **found.to_json()}
                for rel, (sha, found) in sorted(self.files.items())
            },
        }


def scan(root: Path = ROOT, cache: Path | None = CACHE) -> Index:
    """Index the package tree ``root``: files whose SHA-1 matches the ``cache`` (None: no cache)
    reuse its names; the others are parsed."""
    cached = read_cache(cache) if cache is not None else {}
    files: dict[str, tuple[str, FileNames]] = {}
    parsed: list[str] = []
    for path in source_files(root):
        rel = path.relative_to(root).as_posix()
        data = path.read_bytes()
        sha = _sha1(data)
        hit = cached.get(rel)
        if hit is not None and hit[0] == sha:
            files[rel] = hit
            continue
        try:
            found = scan_source(data, rel)
        except SyntaxError as exc:  # the import reports it; the index lists nothing of it
            found = FileNames(dynamic=[f"{exc.lineno}: syntax error: {exc.msg}"])
        files[rel] = (sha, found)
        parsed.append(rel)
    return Index(files, parsed)


def modules(kind: str, root: Path = ROOT, cache: Path | None = CACHE) -> list[str]:
    """The dotted modules of the package that register built-ins of ``kind`` (nothing
    imported): how the analyses registry finds the family packages' analyses."""
    index = scan(root, cache)
    return sorted(module_name(rel) for rel, (_, f) in index.files.items() if f.names.get(kind))


def builtin_names(root: Path = ROOT, cache: Path | None = CACHE) -> dict[str, list[str]]:
    """kind -> sorted built-in names of every kind of :data:`KINDS` (nothing imported)."""
    return scan(root, cache).names()


def write_cache(root: Path = ROOT, path: Path = CACHE) -> Index:
    """Scan ``root`` afresh and write the cache file ``path``."""
    index = scan(root, cache=None)
    text = json.dumps(index.to_json(), indent=1, sort_keys=True) + "\n"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    return index


def static_registries(
    kinds: Iterable[str], names: dict[str, list[str]] | None = None
) -> dict[str, Any]:
    """kind -> a :class:`~deqbench.core.registry.Registry` of each registry kind in ``kinds``
    whose built-ins are the indexed names (none imported) and whose plugins come from the
    entry points as usual (:meth:`Registry.from_names`)."""
    import os
    from importlib import metadata

    from .registry import Registry

    names = builtin_names() if names is None else names
    every = None  # the entry points of every distribution, read once for all the groups
    if os.environ.get("DEQBENCH_DISABLE_PLUGIN_AUTOLOAD", "") in ("", "0"):
        try:
            every = metadata.entry_points()
        except Exception:  # each registry reads its own group and reports the error
            every = None
    return {
        k: Registry.from_names(
            k, names.get(k, ()), every.select(group=f"deqbench.{k}") if every is not None else None
        )
        for k in kinds
        if k in REGISTRY_KINDS
    }


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m deqbench.core.index [--check]``: rewrite ``deqbench/_index.json``; with
    ``--check``, only say whether it is current (exit 1 when stale)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args != ["--check"]:
        print("usage: python -m deqbench.core.index [--check]", file=sys.stderr)
        return 2
    if args == ["--check"]:
        index = scan()
        gone = sorted(set(read_cache()) - set(index.files))
        if index.parsed or gone:
            stale = index.parsed + gone
            print(f"{CACHE}: stale for {len(stale)} files: {', '.join(stale[:5])}")
            print("rewrite it: python -m deqbench.core.index")
            return 1
        print(f"{CACHE}: current ({len(index.files)} files)")
        return 0
    index = write_cache()
    counts = ", ".join(f"{len(v)} {k}" for k, v in index.names().items())
    print(f"wrote {CACHE}: {len(index.files)} files; {counts}")
    for d in index.dynamic():
        print(f"warning: a registration the index cannot read: {d}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
