"""mkdocs hooks of the deqbench site (registered in mkdocs.yml ``hooks:``).

* ``on_files``: adds the committed figures under ``plots/`` (repository root) that the pages
  link to the site as they are, so a page links ``plots/<run>/plots/<name>.png`` as if it lay
  under ``docs/``. Nothing is run or plotted at build time.
* ``on_page_content``: drops the Sphinx roles (``:func:`` ...) of the docstrings that
  mkdocstrings renders, leaving their code spans; a marker left unexpanded is a warning.
* ``on_page_markdown``: expands the markers ``<!-- deqbench:KIND ARGS -->`` of a page with text
  generated from the code and the committed files:

  ``cli``                      the command reference, from the Typer app (its click command)
  ``analysis NAME``            an analysis' module docstring and its ``Params`` table
  ``analyses-covered``         fails the build (a warning, strict) if a built-in analysis has no
                               ``analysis`` marker on the page; renders the index table
  ``suite-keys``               the top-level keys of a suite file (the pydantic schema)
  ``fields [MODULE:]CLASS``    the fields of a dataclass or pydantic model (name, type, default,
                               its docstring's Attributes and the fields' comments); without
                               MODULE, the class is found wherever the package defines it
  ``registry KIND``            the built-in models (with declared defaults), backward modes, solvers (with
                               options) or inits, from the registries
  ``datasets``                 the datasets a suite's ``data:`` names, with their options
  ``api MODULE [NAME ...]``    mkdocstrings blocks (``::: path``) for the given NAMEs of MODULE
                               (default: its ``__all__``, else its public functions and
                               classes), each at the module that defines it, under its public
                               name: the page survives modules moving behind it; ``NAME+`` also
                               shows the members that have no docstring
  ``solver-api``               mkdocstrings blocks of every built-in solver function, under
                               its registry name
  ``solver-options``           the options table of every built-in solver (option, what it
                               takes, default, description), from its pydantic options model
                               (``deqbench.solvers.base.options_markdown``)
  ``where NAME [DIR]``         "`NAME` in `deqbench.pkg.module`": the module (under DIR, if
                               given) that defines NAME at top level, found by parsing the live
                               tree (ambiguous or missing: a warning)
  ``families``                 the built-in analyses grouped by the package that defines them,
                               with each package's CLI verb and plot module where it has one
  ``layout``                   the package's modules and subpackages with their first docstring
                               sentence (the live tree, for the architecture page)

Every generator reads code by import or the repository's files; a problem is logged as a
warning, which ``mkdocs build --strict`` turns into a failed build.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import logging
import re
import typing
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File

log = logging.getLogger("mkdocs.hooks.deqbench")

REPO = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"<!--\s*deqbench:([\w-]+)\s*(.*?)\s*-->")


# --------------------------------------------------------------------------------------- files


_FIGURE_LINK = re.compile(r"\]\((?:\.\./)*(plots/[^)\s]+\.(?:png|svg|jpg))\)")


def on_files(files: Any, config: Any) -> Any:
    """Add the committed figures under plots/ that the pages link (served at site/plots/...)."""
    docs = Path(config["docs_dir"])
    linked = {m for page in docs.rglob("*.md") for m in _FIGURE_LINK.findall(page.read_text())}
    for uri in sorted(linked):
        if (REPO / uri).is_file() and files.get_file_from_path(uri) is None:
            files.append(
                File(
                    uri,
                    src_dir=str(REPO),
                    dest_dir=config["site_dir"],
                    use_directory_urls=config["use_directory_urls"],
                )
            )
    return files  # a link to a figure that is not committed stays broken: a strict-build warning


# ------------------------------------------------------------------------------------- markers


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    src = page.file.src_uri
    state: dict[str, Any] = {
        "analyses": [
            m.group(2).split()[0] for m in MARKER.finditer(markdown) if m.group(1) == "analysis"
        ],
        "shown_modules": set(),  # a module docstring covering several analyses is shown once
    }

    def expand(m: re.Match[str]) -> str:
        kind, arg = m.group(1), m.group(2)
        generator = GENERATORS.get(kind)
        if generator is None:
            log.warning("%s: unknown marker deqbench:%s", src, kind)
            return ""
        try:
            return generator(arg, state)
        except Exception as exc:  # a broken generator must fail the strict build, visibly
            log.warning(
                "%s: <!-- deqbench:%s %s -->: %s: %s", src, kind, arg, type(exc).__name__, exc
            )
            return f"*(not generated: {kind} {arg})*"

    return MARKER.sub(expand, markdown)


_HTML_ROLE = re.compile(r":(?:func|mod|class|data|meth|attr|obj|exc):<code>~?")


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    """Sphinx roles in the docstrings mkdocstrings renders (``:func:`x``` -> ``x``); a marker
    left unexpanded is an error."""
    if "<!-- deqbench:" in html:
        log.warning("%s: a <!-- deqbench:... --> marker was not expanded", page.file.src_uri)
    return _HTML_ROLE.sub("<code>", html)


# ----------------------------------------------------------------------------------- helpers


def _cell(text: Any) -> str:
    """One markdown table cell: one line, pipes escaped."""
    s = "" if text is None else str(text)
    s = " ".join(s.split())
    # pipes inside code spans do not split a Python-Markdown table row; outside them, escape
    parts = re.split(r"(`+[^`]*?`+)", s)
    return "".join(p if p.startswith("`") else p.replace("|", "\\|") for p in parts)


def _table(header: list[str], rows: list[list[Any]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_cell(c) for c in r) + " |" for r in rows]
    return "\n".join(out) + "\n"


def _code(text: str) -> str:
    return "`` " + text + " ``" if "`" in text else "`" + text + "`"


_ROLE = re.compile(r":(?:func|mod|class|data|meth|attr|obj|exc):`~?([^`]+)`")
_BULLET = re.compile(r"^\s*(?:[*-]|\d+\.)\s")


def docstring_markdown(doc: str) -> str:
    """A Google/reST-flavoured module docstring as markdown: ``::`` blocks and ``>>>`` examples
    become fenced code, Sphinx roles become code spans, lists get the blank line they need."""
    lines = inspect.cleandoc(doc).splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        # a literal block: "text::" then an indented block
        if stripped.endswith("::") and not stripped.startswith(">>>"):
            lang = "yaml" if "yaml" in stripped.lower() else "python"
            head = line.rstrip()[:-1]  # "Example::" -> "Example:"
            if head.strip() != ":":
                out.append(head)
            i += 1
            block: list[str] = []
            while i < len(lines) and (not lines[i].strip() or lines[i].startswith(" ")):
                block.append(lines[i])
                i += 1
            while block and not block[-1].strip():
                block.pop()
            while block and not block[0].strip():
                block.pop(0)
            out += ["", f"```{lang}", *inspect.cleandoc("\n".join(block)).splitlines(), "```", ""]
            continue
        # a doctest: >>> lines, their ... continuations and output, up to a blank line
        if stripped.startswith(">>>"):
            indent = len(line) - len(line.lstrip())
            block = []
            while i < len(lines) and lines[i].strip():
                block.append(lines[i][indent:] if len(lines[i]) >= indent else lines[i].strip())
                i += 1
            if out and out[-1].strip():
                out.append("")
            out += ["```pycon", *block, "```", ""]
            continue
        if (
            _BULLET.match(line)
            and out
            and out[-1].strip()
            and not _BULLET.match(out[-1])
            and not out[-1].startswith(" ")
        ):
            out.append("")
        out.append(line)
        i += 1
    text = "\n".join(out)
    return _ROLE.sub(lambda m: "`" + m.group(1) + "`", text).strip() + "\n"


# ------------------------------------------------------------------------------------- the CLI


def _cli_app() -> Any:
    """The Typer app (or click command) of the ``deqbench`` console script: ``deqbench.cli.app``
    where it is, else whatever the console-script entry point points at."""
    try:
        from deqbench.cli import app  # type: ignore[attr-defined]

        return app
    except ImportError:
        return _cli_app_from_entry_point()


def _cli_app_from_entry_point() -> Any:
    """The Typer app (or click command) behind the ``deqbench`` console script."""
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="console_scripts") if e.name == "deqbench"]
    obj = ep.load()
    import typer

    def is_cli(v: Any) -> bool:  # a Typer app, or a click command (Typer may vendor click)
        return isinstance(v, typer.Typer) or (
            callable(getattr(v, "get_usage", None)) and hasattr(v, "params")
        )

    if is_cli(obj):
        return obj
    module = importlib.import_module(obj.__module__)
    found = [v for v in vars(module).values() if is_cli(v)]
    if not found:
        raise LookupError(
            f"no Typer app or click command in {obj.__module__} (entry point {ep.value})"
        )
    return getattr(module, "app", found[0])


def _help_rows(cmd: Any, ctx: Any) -> list[list[str]]:
    """(argument or option with its metavar, help with default and range) per parameter, as
    click's own help formatting gives them (``Parameter.get_help_record``)."""
    rows = []
    for p in cmd.get_params(ctx):
        rec = p.get_help_record(ctx)
        if rec is None or getattr(p, "hidden", False):
            continue
        names, help_ = rec
        if getattr(p, "param_type_name", "") == "argument":
            names = names.split(" ", 1)[0].upper()
        rows.append([_code(names), help_])
    return rows


def _usage(cmd: Any, ctx: Any) -> str:
    # some Typer versions write arguments as {name}: show them as NAME, as the help does
    return re.sub(r"\{(\w+)\}", lambda m: m.group(1).upper(), cmd.get_usage(ctx))


def _epilog(text: str) -> str:
    epi = inspect.cleandoc(text).replace("\\[", "[")  # rich's escape of a literal [ in help
    m = re.match(r"(?s)Examples?:\s*(.*)", epi)
    return "Example:\n\n```bash\n" + m.group(1).strip() + "\n```\n" if m else epi + "\n"


def cli_markdown() -> str:
    import typer

    app = _cli_app()  # typer's get_command gives the click command (Typer may vendor click)
    root = typer.main.get_command(app) if isinstance(app, typer.Typer) else app
    ctx = root.context_class(root, info_name="deqbench")
    parts = []
    if root.help:
        parts.append(inspect.cleandoc(root.help) + "\n")
    parts.append("```text\n" + _usage(root, ctx) + "\n```\n")
    rows = _help_rows(root, ctx)
    if rows:
        parts.append(_table(["option", "what"], rows))
    if root.epilog:
        parts.append(_epilog(root.epilog))
    commands = [(n, root.get_command(ctx, n)) for n in root.list_commands(ctx)]
    commands = [(n, c) for n, c in commands if c is not None and not getattr(c, "hidden", False)]
    parts.append(
        _table(
            ["command", "what"],
            [
                [f"[`deqbench {n}`](#deqbench-{n})", c.get_short_help_str(limit=150)]
                for n, c in commands
            ],
        )
    )
    for name, cmd in commands:
        sub = cmd.context_class(cmd, info_name=name, parent=ctx)
        parts.append(f"## `deqbench {name}` {{ #deqbench-{name} }}\n")
        if cmd.help:
            parts.append(_help_text(inspect.cleandoc(cmd.help)) + "\n")
        parts.append("```text\n" + _usage(cmd, sub) + "\n```\n")
        rows = _help_rows(cmd, sub)
        if rows:
            parts.append(_table(["argument / option", "what"], rows))
        if cmd.epilog:
            parts.append(_epilog(cmd.epilog))
    return "\n".join(parts)


def _help_text(text: str) -> str:
    """Click/Typer help as markdown paragraphs (``\\b`` no-rewrap markers dropped)."""
    return "\n".join(line for line in text.splitlines() if line.strip() != "\b")


# ---------------------------------------------------------------------------------- analyses


def _type_name(t: Any) -> str:
    """A readable annotation: ``int | None``, ``list[ModeSpec]``, ``'train' | 'test'``."""
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(_type_name(a) for a in args)}]" if args else name
    if t is type(None):
        return "None"
    if t is typing.Any:
        return "any"
    return (
        t.__name__ if isinstance(t, type) else re.sub(r"\b(typing|collections\.abc)\.", "", str(t))
    )


def _constraint(m: Any) -> str:
    for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
        if getattr(m, attr, None) is not None and type(m).__name__.lower() == attr:
            return f"{sym} {getattr(m, attr)}"
    if type(m).__name__ == "MinLen":
        return f"at least {m.min_length} item{'s' if m.min_length != 1 else ''}"
    if type(m).__name__ == "MaxLen":
        return f"at most {m.max_length} items"
    return str(m)


def _default_text(v: Any) -> str:
    import yaml
    from pydantic import BaseModel

    def plain(x: Any) -> Any:
        if isinstance(x, BaseModel):
            return x.model_dump(exclude_defaults=True)
        if isinstance(x, (list, tuple)):
            return [plain(y) for y in x]
        if isinstance(x, dict):
            return {k: plain(y) for k, y in x.items()}
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return dataclasses.asdict(x)
        return x

    try:
        return (
            yaml.safe_dump(plain(v), default_flow_style=True, width=10_000)
            .strip()
            .removesuffix("\n...")
            .strip()
        )
    except Exception:
        return repr(v)


def pydantic_rows(model: Any) -> list[list[str]]:
    from pydantic_core import PydanticUndefined

    rows = []
    for name, f in model.model_fields.items():
        key = f.alias or name
        if f.default_factory is not None:
            default = _default_text(f.default_factory())
        elif f.default is PydanticUndefined:
            default = "required"
        else:
            default = _default_text(f.default)
        constraints = [_constraint(m) for m in f.metadata]
        notes = "; ".join(filter(None, [f.description or "", ", ".join(constraints)]))
        rows.append(
            [
                _code(key),
                _code(_type_name(f.annotation)),
                _code(default) if default != "required" else "*required*",
                notes.replace("*", "\\*"),
            ]
        )
    return rows


def analysis_markdown(name: str, shown_modules: set[str]) -> str:
    import deqbench

    cls = deqbench.analyses.get(name)
    module = importlib.import_module(cls.__module__)
    version = getattr(cls, "version", "?")
    parts = [
        f"Registered as `{name}` (class `{cls.__qualname__}`, version {version}, "
        f"module `{cls.__module__}`).\n"
    ]
    if module.__doc__ and module.__name__ not in shown_modules:
        shown_modules.add(module.__name__)
        parts.append(docstring_markdown(module.__doc__))
    elif cls.__doc__:
        parts.append(docstring_markdown(cls.__doc__))
    params = getattr(cls, "Params", None)
    if params is not None and getattr(params, "model_fields", None):
        parts.append(
            f"**Parameters** (suite: `analyses: [{{{name}: {{KEY: VALUE}}}}]`; "
            "unknown keys are errors):\n"
        )
        parts.append(_table(["key", "type", "default", "notes"], pydantic_rows(params)))
    else:
        parts.append("**Parameters:** none.\n")
    return "\n".join(parts)


def analyses_index(names_on_page: list[str]) -> str:
    """The index table of the built-in analyses; an error if one has no section on the page."""
    import deqbench

    reg = deqbench.analyses
    builtin = [n for n in reg.names() if str(reg.origin(n)).startswith("built")]
    missing = sorted(set(builtin) - set(names_on_page))
    if missing:
        raise LookupError(f"built-in analyses without an 'analysis' marker: {', '.join(missing)}")
    rows = []
    for n in builtin:
        cls = reg.get(n)
        first = (cls.__doc__ or "").strip().split("\n\n")[0]
        rows.append([f"[`{n}`](#{n})", first, _code(cls.__module__)])
    return _table(["analysis", "measures", "module"], rows)


# ------------------------------------------------------------------------------------- suites


def suite_keys_markdown() -> str:
    """The top-level keys of a suite file, from the pydantic model the loader validates with
    (found through ``deqbench.load_suite``'s module, wherever it lives)."""
    from pydantic import BaseModel

    import deqbench

    module = importlib.import_module(deqbench.load_suite.__module__)
    models = {
        n: v
        for n, v in vars(module).items()
        if isinstance(v, type)
        and issubclass(v, BaseModel)
        and "name" in getattr(v, "model_fields", {})
    }
    suite = next((v for n, v in models.items() if "matrix" in v.model_fields), None)
    if suite is None:
        raise LookupError(f"no suite schema with a 'matrix' field in {module.__name__}")
    parts = [_table(["key", "type", "default", "notes"], pydantic_rows(suite))]
    coll = next((v for n, v in models.items() if "suites" in v.model_fields), None)
    if coll is not None:
        parts.append("\nA *collection* file has these keys instead:\n")
        parts.append(_table(["key", "type", "default", "notes"], pydantic_rows(coll)))
    return "\n".join(parts)


def _locate(mod: str, attr: str) -> Any:
    """``mod.attr``; if the module moved (or ``mod`` is empty), ``attr`` from the one module of
    the package that defines it at top level."""
    if mod:
        try:
            return getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError):
            pass
    found = _definitions(attr)
    if len(found) != 1:
        raise LookupError(f"{attr}: not in {mod}; defined in {found or 'no module'} of deqbench/")
    return getattr(importlib.import_module(found[0]), attr)


def _field_notes(cls: Any) -> dict[str, str]:
    """What the class says about each field: its docstring's ``Attributes:`` entries
    (``a, b: text`` documents both) and the trailing ``# comments`` of the field lines."""
    notes: dict[str, str] = {}
    doc = inspect.cleandoc(cls.__doc__ or "")
    m = re.search(r"(?ms)^Attributes:\n(.*?)(?=^\S|\Z)", doc)
    if m:
        for entry in re.split(r"(?m)^    (?=\w[\w, ]*:)", m.group(1)):
            names, sep, text = entry.partition(":")
            if sep:
                for n in names.split(","):
                    notes[n.strip()] = " ".join(text.split())
    try:
        src = inspect.getsource(cls)
    except (OSError, TypeError):
        return notes
    for k, v in re.findall(r"(?m)^\s+(\w+)\s*:[^#\n]*#\s*(.+)$", src):
        notes.setdefault(k, v.strip())
    return notes


def fields_markdown(arg: str) -> str:
    mod, _, attr = arg.rpartition(":")  # "module:Class", or "Class" wherever it is defined
    obj = _locate(mod, attr)
    if hasattr(obj, "model_fields"):
        return _table(["key", "type", "default", "notes"], pydantic_rows(obj))
    hints = typing.get_type_hints(obj)
    notes = _field_notes(obj)
    rows = []
    for f in dataclasses.fields(obj):
        if f.name.startswith("_"):
            continue
        if f.default is not dataclasses.MISSING:
            d = _code(_default_text(f.default))
        elif f.default_factory is not dataclasses.MISSING:
            d = _code(_default_text(f.default_factory()))
        else:
            d = "*required*"
        rows.append(
            [_code(f.name), _code(_type_name(hints.get(f.name, f.type))), d, notes.get(f.name, "")]
        )
    return _table(["key", "type", "default", "notes"], rows)


# ------------------------------------------------------------------------------------- layout


def _first_sentence(path: Path) -> str:
    try:
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    except (SyntaxError, OSError):
        return ""
    para = " ".join(doc.strip().split("\n\n")[0].split())
    m = re.match(r"(.+?(?<!\bal)\.)(\s+[A-Z`*(]|$)", para)
    text = m.group(1) if m else para
    if len(text) > 220:
        text = text[:217].rsplit(" ", 1)[0] + " ..."
    return _ROLE.sub(lambda x: "`" + x.group(1) + "`", text)


def layout_markdown() -> str:
    """The package's subpackages and modules as found in the tree, with their first docstring
    sentence: stays true however the modules are regrouped."""
    pkg = REPO / "deqbench"
    rows = []
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(REPO)
        if any(part.startswith((".", "_")) and part != "__init__.py" for part in rel.parts[1:]):
            continue  # private modules and caches
        if path.name == "__init__.py":
            rows.append([f"**`{'.'.join(rel.parts[:-1])}`**", _first_sentence(path)])
        else:
            rows.append([_code(".".join(rel.with_suffix("").parts)), _first_sentence(path)])
    return _table(["module", "what (its docstring's first sentence)"], rows)


# ----------------------------------------------------------------------------------- registries


def _first_line(doc: str | None) -> str:
    para = (inspect.cleandoc(doc or "")).split("\n\n")[0]
    para = " ".join(re.split(r"(?m)^\s*(?:Args|Returns|Example|Examples):", para)[0].split())
    return _ROLE.sub(lambda x: "`" + x.group(1) + "`", para)


def _signature_params(fn: Any, skip: tuple[str, ...] = ()) -> str:
    out = []
    for p in inspect.signature(fn).parameters.values():
        if p.name in skip or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        out.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return ", ".join(out)


def registry_markdown(kind: str) -> str:
    import deqbench

    reg = getattr(deqbench, kind)
    names = [n for n in reg.names() if str(reg.origin(n)).startswith("built")]
    rows = []
    for n in names:
        fn = reg.get(n)
        if kind == "models":
            kwargs = _signature_params(fn, ("in_shape", "num_outputs"))
            declared = reg.defaults(n) if hasattr(reg, "defaults") else {}
            shown = "<br>".join(f"{k}: `{_default_text(v)}`" for k, v in declared.items())
            rows.append([_code(n), _code(kwargs) if kwargs else "", shown, _first_line(fn.__doc__)])
        elif kind == "solvers":
            module = importlib.import_module(fn.__module__)
            opts = getattr(fn, "OPTIONS", None) or getattr(module, "OPTIONS", None) or ()
            opts_text = ", ".join(_code(o) for o in sorted(opts))
            rows.append([_code(n), opts_text, _first_line(fn.__doc__)])
        elif kind == "inits":
            params = _signature_params(fn, ("model", "seed"))
            rows.append([_code(n), _code(params) if params else "", _first_line(fn.__doc__)])
        elif kind == "backward":
            from deqbench.backward import as_mode

            mode = as_mode(fn, n)
            keys = [f for f in mode.fields if f != "options"]
            keys += sorted(mode.Options.model_fields) if mode.Options is not None else []
            opts_text = ", ".join(_code(o) for o in keys)
            if mode.adjoint_solver:
                opts_text += " and the adjoint solver's options"
            need = _code(mode.forward) if mode.forward else "any"
            what = _first_line(type(mode).__doc__).replace("``", "`")
            rows.append([_code(n), need, opts_text, what])
        else:
            raise ValueError(f"unknown registry kind {kind!r} (models, solvers, inits, backward)")
    header = {
        "models": ["model", "factory kwargs", "declared defaults", "what"],
        "solvers": ["solver", "options", "what"],
        "inits": ["init", "params", "what"],
        "backward": ["backward mode", "forward solver", "fields and options", "what"],
    }[kind]
    return _table(header, rows)


def datasets_markdown() -> str:
    rows = []
    from deqbench.core.registry import datasets

    for n, fn in _locate("deqbench.data.base", "DATASETS").items():
        if not str(datasets.origin(n)).startswith("built"):  # an installed plugin's
            continue
        params = _signature_params(fn)
        rows.append([_code(n), _code(params) if params else "", _first_line(fn.__doc__)])
    return _table(["dataset", "options", "what"], rows)


# ------------------------------------------------------------------------------------------ api


def _public_names(module: Any) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n in dir(module) if not n.startswith("_")]
    out = []
    for n in names:
        try:
            obj = getattr(module, n)
        except AttributeError:
            continue
        fn = getattr(obj, "__func__", obj)
        if inspect.ismodule(obj) or not (inspect.isclass(fn) or inspect.isroutine(fn)):
            continue
        if not str(getattr(fn, "__module__", "")).startswith("deqbench"):
            continue
        out.append(n)
    return out


def api_markdown(arg: str) -> str:
    modname, *names = arg.split()
    module = importlib.import_module(modname)
    names = names or _public_names(module)
    if not names:
        raise LookupError(f"{modname}: no public functions or classes found")
    # the module docstring through the same converter as the analyses' (doctests fenced), not
    # through griffe: a module docstring is prose about the family, not an API entry
    parts = [docstring_markdown(module.__doc__)] if module.__doc__ else []
    for n in names:
        # NAME+ : also the members without a docstring (a base class's hooks)
        n, undocumented = n.rstrip("+"), n.endswith("+")
        obj = getattr(module, n)
        fn = getattr(obj, "__func__", obj)  # a registry's bound method: document the method
        target = f"{fn.__module__}.{fn.__qualname__}"
        parts.append(
            f'::: {target}\n    options:\n      heading: "{modname}.{n}"\n      toc_label: "{n}"\n'
            + ("      show_if_no_docstring: true\n" if undocumented else "")
        )
    return "\n".join(parts)


def solver_api_markdown() -> str:
    import deqbench

    reg = deqbench.solvers
    parts = []
    for n in reg.names():
        if not str(reg.origin(n)).startswith("built"):
            continue
        fn = reg.get(n)
        parts.append(
            f"::: {fn.__module__}.{fn.__qualname__}\n    options:\n"
            f'      heading: "{n}"\n      toc_label: "{n}"\n'
        )
    return "\n".join(parts)


def _definitions(name: str, under: str = "deqbench") -> list[str]:
    """Dotted modules under ``under`` (a path from the repository root) that define ``name`` at
    top level (class, function or assignment; imports do not count)."""
    found = []
    for path in sorted((REPO / under).rglob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, OSError):
            continue
        for node in tree.body:
            names: list[str] = []
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                names = [node.name]
            elif isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names = [node.target.id]
            if name in names:
                rel = path.relative_to(REPO).with_suffix("")
                parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
                found.append(".".join(parts))
                break
    return found


def where_markdown(arg: str) -> str:
    name, *under = arg.split()
    found = _definitions(name, under[0] if under else "deqbench")
    if len(found) != 1:
        raise LookupError(
            f"{name} is defined in {len(found)} modules ({', '.join(found) or 'none'}); give a folder"
        )
    return f"`{name}` in `{found[0]}`"


def families_markdown() -> str:
    import deqbench

    reg = deqbench.analyses
    by_pkg: dict[str, list[str]] = {}
    for n in reg.names():
        if not str(reg.origin(n)).startswith("built"):
            continue
        mod = importlib.import_module(reg.get(n).__module__)
        file = Path(mod.__file__ or "")
        pkg = mod.__name__ if file.name == "__init__.py" else mod.__name__.rpartition(".")[0]
        by_pkg.setdefault(pkg, []).append(n)
    rows = []
    for pkg, names in sorted(by_pkg.items()):
        folder = REPO.joinpath(*pkg.split("."))
        extras = [f"`{p.stem}`" for p in sorted(folder.glob("*.py")) if p.stem in ("cli", "plots")]
        init = folder / "__init__.py"
        rows.append(
            [
                f"`{pkg}`",
                ", ".join(f"[`{n}`](analyses.md#{n})" for n in names),
                ", ".join(extras),
                _first_sentence(init) if init.exists() else "",
            ]
        )
    return _table(["package", "analyses", "also", "what"], rows)


#: marker kind -> fn(argument string, per-page state) -> markdown
GENERATORS: dict[str, Any] = {
    "cli": lambda arg, st: cli_markdown(),
    "analysis": lambda arg, st: analysis_markdown(arg, st["shown_modules"]),
    "analyses-covered": lambda arg, st: analyses_index(st["analyses"]),
    "suite-keys": lambda arg, st: suite_keys_markdown(),
    "fields": lambda arg, st: fields_markdown(arg),
    "registry": lambda arg, st: registry_markdown(arg),
    "datasets": lambda arg, st: datasets_markdown(),
    "api": lambda arg, st: api_markdown(arg),
    "solver-api": lambda arg, st: solver_api_markdown(),
    "solver-options": lambda arg, st: _locate("deqbench.solvers.base", "options_markdown")(),
    "where": lambda arg, st: where_markdown(arg),
    "families": lambda arg, st: families_markdown(),
    "layout": lambda arg, st: layout_markdown(),
}
