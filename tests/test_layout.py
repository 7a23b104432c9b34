"""The package layout: layers that import one way (:data:`LAYERS`), no import circles inside
deqbench, the pinned public API, and each analysis family's analysis, plots and CLI verb in its
own folder.

The import graph is read from the source with ``ast``: every ``import`` / ``from ... import`` of a
deqbench module, at module level, inside functions *and* under ``if TYPE_CHECKING:`` (a
function-level or type-only import that only hides a circle is still a circle: the layers it
joins cannot be read, tested or type-checked apart). Relative imports are resolved;
importing ``deqbench.a.b`` also imports the package ``deqbench.a`` (its ``__init__``), unless the
importer lives inside it. Strings given to ``importlib.import_module`` (registries loading their
built-ins, the CLI finding its verbs) are not edges: they name what to load, not what a module
needs.
"""

from __future__ import annotations

import ast
import importlib
import re
from importlib import metadata
from pathlib import Path

import pytest

import deqbench

ROOT = Path(deqbench.__file__).parent

#: intra-package imports allowed to close a circle, with the reason (lazy imports of optional or
#: heavy dependencies only). Keep it as short as possible.
ALLOWED: dict[tuple[str, str], str] = {}


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for p in sorted(ROOT.rglob("*.py")):
        parts = list(p.relative_to(ROOT.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        out[".".join(parts)] = (p, is_pkg)
    return out


def import_graph() -> dict[str, dict[str, int]]:
    """``{module: {imported module: line}}`` over every module of deqbench."""
    mods = _modules()

    def known(name: str) -> str | None:  # the longest prefix that is a module
        parts = name.split(".")
        while parts:
            if ".".join(parts) in mods:
                return ".".join(parts)
            parts.pop()
        return None

    graph: dict[str, dict[str, int]] = {}
    for mod, (path, is_pkg) in mods.items():
        package = mod if is_pkg else mod.rpartition(".")[0]
        edges: dict[str, int] = {}

        def add(target: str | None, line: int, mod: str = mod, edges: dict = edges) -> None:
            if target is None or target == mod:
                return
            edges.setdefault(target, line)
            parts = target.split(".")
            for i in range(1, len(parts)):  # the packages above it run their __init__
                parent = ".".join(parts[:i])
                if parent != mod and not mod.startswith(parent + "."):
                    edges.setdefault(parent, line)

        def visit(node: ast.AST, package: str = package, add=add) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.Import):
                    for a in child.names:
                        if a.name.split(".")[0] == "deqbench":
                            add(known(a.name), child.lineno)
                elif isinstance(child, ast.ImportFrom):
                    if child.level:
                        base = package.split(".")
                        if child.level > 1:
                            base = base[: -(child.level - 1)]
                        source = ".".join(base + ([child.module] if child.module else []))
                    else:
                        source = child.module or ""
                    if source.split(".")[0] != "deqbench":
                        continue
                    for a in child.names:
                        sub = f"{source}.{a.name}"
                        add(sub if sub in mods else known(source), child.lineno)
                else:
                    visit(child)

        visit(ast.parse(path.read_text(), str(path)))
        graph[mod] = edges
    return graph


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if (v, w) in ALLOWED:
                continue
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_the_graph_sees_imports_inside_functions_and_packages():
    g = import_graph()
    # module level, relative, through a package
    assert "deqbench.core.deq" in g["deqbench.run.train"]
    assert "deqbench.core" in g["deqbench.run.train"]
    # inside a function (CellContext.evaluate imports the evaluation lazily)
    assert "deqbench.core.evaluation" in g["deqbench.analyses.base"]
    # `from .. import plots` is an import of the module deqbench.run.plots
    assert "deqbench.run.plots" in g["deqbench.ntk.analysis"]


def test_the_graph_sees_imports_under_type_checking():
    g = import_graph()
    # `if TYPE_CHECKING: from ..data.base import DataBundle` (CellContext.data's annotation)
    assert "deqbench.data.base" in g["deqbench.analyses.base"]
    # `if TYPE_CHECKING: from ..analyses.base import CellContext, ...` (AnalysisPlugin's hooks)
    assert "deqbench.analyses.base" in g["deqbench.core.contracts"]


def test_the_analysis_contract_imports_nothing_from_the_runner():
    """deqbench.analyses.base is the ground floor plugins build on: it reaches the DEQ
    core and the datasets, never deqbench.run, at module level, in a function or for types."""
    g = import_graph()
    up = sorted(m for m in g["deqbench.analyses.base"] if m.split(".")[:2] == ["deqbench", "run"])
    assert not up, up


def test_no_import_circles_in_the_package():
    g = import_graph()
    cycles = find_cycles(g)
    lines = []
    for comp in cycles:
        lines.append("circle: " + ", ".join(comp))
        for a in comp:
            for b, line in g[a].items():
                if b in comp:
                    lines.append(f"    {a} -> {b} (line {line})")
    assert not cycles, "\n".join(lines)


def test_the_allow_list_names_real_imports():
    g = import_graph()
    for a, b in ALLOWED:
        assert b in g.get(a, {}), f"stale allow-list entry {a} -> {b}"


# -- layers that point one way -------------------------------------------------------------------

#: The layers, lowest first: a module imports from its own layer or a lower one, never a higher one
#: (at module level, in a function or under ``TYPE_CHECKING``). A module's layer is that of the
#: longest entry below that names it or a package above it (``deqbench`` alone names only the
#: top-level ``__init__``); a family's CLI verb (``deqbench.<family>.cli``) sits with the CLI; a
#: package's ``__init__`` sits at the lowest layer of its modules (importing any of them runs it
#: first). docs/architecture.md shows the same table.
LAYERS: list[tuple[str, list[str]]] = [
    (
        "core",
        [
            "deqbench.core", "deqbench._lazy", "deqbench.errors", "deqbench.contracts",
            "deqbench.deq",
            # the contracts the DEQ core calls, kept beside their kind: a solver's declaration,
            # options, stats, tracker (with its fused bookkeeping kernels) and CUDA-graph loop,
            # a backward mode's base class, the analysis contract, the dataset bundle
            "deqbench.solvers.base", "deqbench.solvers.options", "deqbench.solvers.stats",
            "deqbench.solvers.tracker", "deqbench.solvers.graphs", "deqbench.solvers.fused",
            "deqbench.backward.base",
            "deqbench.analyses.base", "deqbench.data.base",
        ],
    ),
    (
        "solvers, models, data",
        [
            "deqbench.solvers", "deqbench.models", "deqbench.data", "deqbench.backward",
            "deqbench.inits", "deqbench.analyses", "deqbench.adapters",
            # the operator-norm math models and inits constrain their weights with
            "deqbench.spectral.norms",
            # the top-level package imports the registries; the rest by name on first use
            "deqbench",
        ],
    ),
    ("run", ["deqbench.run", "deqbench.plots", "deqbench.testing"]),
    (
        "families",
        [
            "deqbench.kglm", "deqbench.landscape", "deqbench.hessian", "deqbench.ntk",
            "deqbench.spectral", "deqbench.trajectory", "deqbench.performance",
            "deqbench.convergence", "deqbench.splitting", "deqbench.training",
            "deqbench.kernels", "deqbench.klr",
        ],
    ),
    # the claim summary judges runs with the reproduction's verdicts: it sits with them
    ("reproduce, cli", ["deqbench.reproduce", "deqbench.outcomes", "deqbench.cli",
                        "deqbench.__main__"]),
]  # fmt: skip

#: imports against the layers allowed, with the reason. Keep it empty.
LAYER_EXCEPTIONS: dict[tuple[str, str], str] = {}


def _own_layer(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) == 3 and parts[2] == "cli":  # a family's CLI verb
        return len(LAYERS) - 1
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix == "deqbench" and module != "deqbench":
            break
        for i, (_, prefixes) in enumerate(LAYERS):
            if prefix in prefixes:
                return i
    return None


def layer_of(modules: list[str] | dict[str, object]) -> dict[str, int | None]:
    """Each module's layer (an index of :data:`LAYERS`; None: no entry names it)."""
    out = {m: _own_layer(m) for m in modules}
    for m in modules:  # a package's __init__ runs before any of its modules
        mine = out[m]
        parts = m.split(".")
        for i in range(2, len(parts)):
            pkg = ".".join(parts[:i])
            if pkg in out and mine is not None:
                below = out[pkg]
                out[pkg] = mine if below is None else min(below, mine)
    return out


def layer_violations(graph: dict[str, dict[str, int]]) -> list[str]:
    """``a (layer) -> b (layer), line N`` for every import of a higher layer."""
    layer = layer_of(graph)
    bad = []
    for a, edges in sorted(graph.items()):
        for b, line in sorted(edges.items()):
            la, lb = layer[a], layer.get(b)
            if la is None or lb is None or lb <= la or (a, b) in LAYER_EXCEPTIONS:
                continue
            bad.append(f"{a} ({LAYERS[la][0]}) imports {b} ({LAYERS[lb][0]}), line {line}")
    return bad


def test_every_module_has_a_layer():
    layer = layer_of(import_graph())
    assert not [m for m, i in layer.items() if i is None]


def test_layers_point_one_way():
    bad = layer_violations(import_graph())
    assert not bad, "imports against the layers (core < ... < reproduce, cli):\n" + "\n".join(bad)


def test_the_layer_check_fails_on_an_upward_import():
    g = import_graph()
    g["deqbench.core.deq"] = {**g["deqbench.core.deq"], "deqbench.run.runner": 7}
    assert layer_violations(g) == [
        "deqbench.core.deq (core) imports deqbench.run.runner (run), line 7"
    ]
    layer = layer_of(g)
    assert layer["deqbench.solvers"] == 0  # the package of solvers.base (the solver contract)
    assert layer["deqbench.solvers.anderson"] == 1
    assert layer["deqbench.landscape.cli"] == len(LAYERS) - 1


def test_the_architecture_page_shows_the_same_layers():
    """docs/architecture.md's table "Layers": one row per layer, in order, naming the same
    modules (``deqbench.<family>.cli``, the pattern, aside)."""
    text = (ROOT.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in section.splitlines() if ln.startswith("| **")]
    assert [r.split("**")[1] for r in rows] == [name for name, _ in LAYERS]
    for row, (name, prefixes) in zip(rows, LAYERS, strict=True):
        shown = set(re.findall(r"`(deqbench(?:\.[\w]+)*)`", row))
        assert shown == set(prefixes), name


def test_the_layer_exceptions_name_real_imports():
    g = import_graph()
    for a, b in LAYER_EXCEPTIONS:
        assert b in g.get(a, {}), f"stale layer exception {a} -> {b}"


# -- the public API: everything else is private ----------------------------------------

PUBLIC = {
    "deqbench": [
        "__version__",
        "load_suite",
        "load_suites",
        "run_suite",
        "load_results",
        "models",
        "solvers",
        "inits",
        "analyses",
        "backward",
        "datasets",
        "spectral",
        "kernels",
        "klr",
        "landscape",
        "hessian",
        "ntk",
    ],
    "deqbench.models": ["create", "names", "get", "origin", "register", "declare_defaults"],
    "deqbench.solvers": ["get", "names", "register"],
    "deqbench.inits": ["get", "names", "register"],
    "deqbench.analyses": ["get", "names", "register"],
    "deqbench.backward": ["BackwardMode", "get", "names", "register", "origin", "mode"],
    "deqbench.analyses.base": [
        "Analysis",
        "CellContext",
        "EpochInfo",
        "Row",
        "StepInfo",
        "mean_max",
    ],
    "deqbench.plots": ["register", "new_figure", "lines", "legend", "save_figure", "read_series"],
    "deqbench.solvers.base": ["SolverStats", "make_stats", "residuals"],
    "deqbench.deq": [
        "DEQLayer",
        "DEQModel",
        "SolverConfig",
        "BackwardConfig",
        "Runtime",
        "configure",
        "set_runtime",
        "deq_layers",
        "is_deq",
        "last_stats",
        "direct_solves",
    ],
    "deqbench.contracts": ["CLAUSES", "MonotoneCell", "SplittingOps", "reference_markdown"],
    "deqbench.errors": ["DeqbenchError", "ConfigError", "PluginError", "UnknownNameError"],
    "deqbench.ntk": ["empirical_ntk", "ntk_summary"],
    "deqbench.spectral": ["conv_spectral_norm", "jacobian_spectral_radius"],
    "deqbench.klr": ["fit_klr"],
    "deqbench.kernels": ["make_kernel"],
    "deqbench.landscape": ["landscape"],
    "deqbench.hessian": ["HVPOperator", "lanczos", "hutchinson_trace"],
    "deqbench.outcomes": ["summarize", "suite_name", "claims_for", "run_scale", "base_suite"],
    "deqbench.cli": ["app", "main"],
    "deqbench.adapters": ["OwnLoop", "track_loop", "cell_from_method", "MethodCell", "LoopRecord"],
    "deqbench.testing": [
        "ConformanceError",
        "check_solver",
        "check_model",
        "check_init",
        "check_analysis",
        "check_dataset",
        "check_backward",
        "conformance_names",
        "example_context",
    ],
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_public_api_imports(module):
    mod = importlib.import_module(module)
    for name in PUBLIC[module]:
        assert getattr(mod, name) is not None, f"{module}.{name}"


def test_public_api_calls():
    import deqbench

    assert "fc_deq_tiny" in deqbench.models.names()
    assert callable(deqbench.solvers.get("anderson"))
    assert "spectral" in deqbench.inits.names()
    assert set(deqbench.__all__) == set(PUBLIC["deqbench"])


def test_entry_points():
    script = [ep for ep in metadata.entry_points(group="console_scripts") if ep.name == "deqbench"]
    assert script and script[0].value == "deqbench.cli:main"
    from deqbench import analyses, backward, inits, models, solvers

    groups = {m.registry.group for m in (models, solvers, inits, analyses, backward)}
    assert groups == {
        "deqbench.models", "deqbench.solvers", "deqbench.inits", "deqbench.analyses",
        "deqbench.backward",
    }  # fmt: skip


# -- one folder per analysis family ----------------------------------------------------------------

NOT_FAMILIES = {
    "analyses", "core", "run", "cli", "models", "solvers", "inits", "outcomes", "backward",
}  # fmt: skip


def _family(module: str) -> str:
    return module.split(".")[1]


def test_builtin_analyses_live_in_their_family_package():
    from deqbench import analyses

    for name in analyses.names():
        if not analyses.registry.entry(name).is_builtin:
            continue
        family = _family(analyses.get(name).__module__)
        assert family not in NOT_FAMILIES, f"analysis {name} lives in deqbench.{family}"


#: the run report: every training run records ``metrics`` and ``solver_stats``, and
#: :mod:`deqbench.run.plots` draws their figures (training curves, solver iterations, residual
#: traces) for every run, beside the shared plot helpers they are built from
RUN_REPORT = {"metrics", "solver_stats"}


def test_plots_live_beside_their_analysis():
    from deqbench import analyses
    from deqbench.run import plots

    analyses.names()  # loads the built-ins, which register their plots
    for name in plots.names():
        fn = plots.get(name)
        if name in RUN_REPORT:
            assert fn.__module__ == "deqbench.run.plots", name
        elif name in analyses.names() and analyses.registry.entry(name).is_builtin:
            assert _family(fn.__module__) == _family(analyses.get(name).__module__), name


@pytest.mark.parametrize("verb", ["landscape", "hessian", "ntk"])
def test_cli_verbs_live_in_their_family_package(verb):
    from deqbench.cli import app

    callbacks = {
        (c.name or c.callback.__name__): c.callback
        for c in app.registered_commands
        if c.callback is not None
    }
    assert callbacks[verb].__module__ == f"deqbench.{verb}.cli"
