"""Fast start: ``deqbench ls``, ``--help`` and ``validate`` of a missing or malformed
file answer without importing torch. ``ls`` reads the built-in names from the source index
(:mod:`deqbench.core.index`), which must list exactly what the registries load."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import TINY_SUITE, write_suite

from deqbench.core import index

ROOT = Path(__file__).resolve().parents[1]
#: what the fast commands must not import
HEAVY = ("torch", "torchvision", "numpy", "pandas", "matplotlib", "scipy", "sklearn")

#: every (kind, name, origin) the registries hold once every built-in module is imported
RUNTIME_ROWS = """
import json
from deqbench.core.registry import REGISTRIES
from deqbench.kglm.kernels import kernels
from deqbench.data.base import DATASETS
from deqbench.run import plots

rows = []
for kind, reg in [*REGISTRIES.items(), ("kernels", kernels)]:
    rows += [(kind, n, reg.origin(n)) for n in reg.names()]
rows += [("datasets", n, "built-in") for n in DATASETS]
rows += [("plots", n, "built-in") for n in plots.names()]  # the analyses' modules are imported
print(json.dumps(rows))
"""


@pytest.fixture(scope="module")
def runtime_rows() -> set[tuple[str, str, str]]:
    """The registries' rows, from a fresh interpreter (no names other tests added)."""
    out = subprocess.run(
        [sys.executable, "-c", RUNTIME_ROWS], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    return {tuple(r) for r in json.loads(out.stdout)}  # type: ignore[misc]


def index_rows(ix: index.Index) -> set[tuple[str, str, str]]:
    """The rows ``deqbench ls`` builds from the index ``ix`` (plugins from entry points)."""
    names = ix.names()
    rows = set()
    for kind, reg in index.static_registries(index.KINDS, names).items():
        rows |= {(kind, n, reg.origin(n)) for n in reg.names()}
    for kind in ("datasets", "plots"):
        rows |= {(kind, n, "built-in") for n in names[kind]}
    return rows


def differences(
    found: set[tuple[str, str, str]], loaded: set[tuple[str, str, str]], ix: index.Index
) -> list[str]:
    """One line per row the index and the registries disagree on, saying why it may be."""
    lines = []
    for kind, name, origin in sorted(loaded - found):
        lines.append(
            f"{kind} '{name}' ({origin}) is registered when the modules load, but the source "
            "index (deqbench/core/index.py) does not see it: register built-ins with a literal "
            f'name, e.g. @{kind}.register("{name}"), on a receiver the scanner knows (see its '
            "docstring)"
        )
    for kind, name, origin in sorted(found - loaded):
        where = ", ".join(ix.where(kind, name)) or "no file"
        lines.append(
            f"{kind} '{name}' ({origin}) is in the source index (found in {where}) but not "
            "registered when the registries load: is its module imported by its registry "
            "(models, solvers, inits: in their package; analyses: any module of deqbench)?"
        )
    lines += [f"a registration the index cannot read: {d}" for d in ix.dynamic()]
    return lines


@pytest.mark.parametrize("cache", ["committed", "none"])
def test_the_index_lists_exactly_what_the_registries_load(runtime_rows, cache):
    ix = index.scan(cache=index.CACHE if cache == "committed" else None)
    if cache == "none":  # the pure ast path: every file parsed
        assert len(ix.parsed) == len(ix.files) == len(index.source_files())
    problems = differences(index_rows(ix), runtime_rows, ix)
    assert not problems, "\n".join(problems)
    assert {k for k, _, _ in runtime_rows} == set(index.KINDS)


def test_a_mismatch_is_a_clear_message():
    ix = index.scan()
    found = index_rows(ix)
    loaded = (found - {("solvers", "anderson", "built-in")}) | {("models", "magic", "built-in")}
    lines = differences(found, loaded, ix)
    assert any("models 'magic'" in ln and "does not see it" in ln for ln in lines), lines
    assert any(
        "solvers 'anderson'" in ln and "solvers/anderson.py" in ln and "not registered" in ln
        for ln in lines
    ), lines


def test_the_scanner_reads_every_registering_form():
    src = textwrap.dedent(
        """
        from ..core.registry import solvers as s, analyses
        from deqbench.models import register as reg_model
        import deqbench

        @s.register("one")
        def one(): ...

        @analyses.register()
        class Weights:
            name = "weight_norm"

        @s.register(name="two")
        def two(): ...

        def _later():
            from ..run import plots
            plots.register("late_plot")(print)

        @reg_model("m1")
        def m1(): ...

        deqbench.inits.register("i1")(print)
        NAME = "x"
        s.register(NAME)(print)
        register("not_a_registry")  # an unknown bare function
        IMAGE_DATASETS = {"d1": 1, "d2": 2}
        """
    )
    found = index.scan_source(src, "solvers/extra.py")
    assert found.names == {
        "solvers": ["one", "two"],
        "analyses": ["weight_norm"],
        "plots": ["late_plot"],
        "models": ["m1"],
        "inits": ["i1"],
        "datasets": ["d1", "d2"],
    }
    assert found.dynamic == ["25: s.register(NAME)"]
    plots_module = "def register(name): ...\n@register('own')\ndef f(): ...\n"
    assert index.scan_source(plots_module, "run/plots.py").names == {"plots": ["own"]}
    data = "from ..data.base import dataset\n@dataset('ds')\ndef ds(): ...\n"
    assert index.scan_source(data, "data/extra.py").names == {"datasets": ["ds"]}
    assert index.scan_source("x = 1  # registers nothing\n", "a.py").names == {}


def test_a_new_builtin_file_is_found_without_rewriting_the_cache(tmp_path):
    """Adding a built-in is one new file: the cache is only a shortcut, never a list."""
    root = tmp_path / "deqbench"
    shutil.copytree(index.ROOT, root, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    cache = root / "_index.json"
    index.write_cache(root, cache)
    before = index.scan(root, cache)
    assert before.parsed == [] and before.names() == index.scan(root, None).names()

    (root / "solvers" / "my_solver.py").write_text(
        'from ..core.registry import solvers\n\n\n@solvers.register("my_solver")\n'
        "def my_solver(f, z0, **kw):\n    return z0\n"
    )
    fc = root / "models" / "fc.py"
    fc.write_text(fc.read_text() + '\n\n@models.register("fc_extra")\ndef fc_extra(): ...\n')
    (root / "kglm" / "kernels.py").unlink()
    after = index.scan(root, cache)
    assert sorted(after.parsed) == ["models/fc.py", "solvers/my_solver.py"]
    names = after.names()
    assert names["solvers"] == sorted([*before.names()["solvers"], "my_solver"])
    assert names["models"] == sorted([*before.names()["models"], "fc_extra"])
    assert names["kernels"] == []
    assert after.where("solvers", "my_solver") == ["solvers/my_solver.py"]


def test_a_cache_of_another_scanner_or_unreadable_is_ignored(tmp_path):
    bad = tmp_path / "_index.json"
    bad.write_text("{not json")
    assert index.read_cache(bad) == {}
    other = json.loads(index.CACHE.read_text())
    other["scanner"] = "0" * 40
    bad.write_text(json.dumps(other))
    assert index.read_cache(bad) == {}
    assert index.read_cache(tmp_path / "missing.json") == {}


# -- the commands, in fresh interpreters ---------------------------------------------------------


def probe(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> tuple[int, list[str], str, str]:
    """Run ``python -m deqbench ARGS`` in a fresh interpreter (``env``: added to the
    environment): its exit code, the heavy modules it imported, stdout, stderr."""
    report = tmp_path / "modules.json"
    code = (
        "import json, runpy, sys\n"
        f"report, heavy = {str(report)!r}, {list(HEAVY)!r}\n"
        "sys.argv = ['deqbench', *sys.argv[1:]]\n"
        "code = 0\n"
        "try:\n"
        "    runpy.run_module('deqbench', run_name='__main__', alter_sys=True)\n"
        "except SystemExit as exc:\n"
        "    code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)\n"
        "loaded = sorted({m.split('.')[0] for m in sys.modules} & set(heavy))\n"
        "open(report, 'w').write(json.dumps([code, loaded]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=tmp_path,
        # the normal exit: this wrapper reads sys.modules after the command's SystemExit
        env={**os.environ, "DEQBENCH_SLOW_EXIT": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    rc, loaded = json.loads(report.read_text())
    return rc, loaded, out.stdout, out.stderr


def test_ls_imports_no_torch_and_lists_what_the_registries_load(tmp_path, runtime_rows):
    rc, loaded, stdout, stderr = probe(tmp_path, "ls")
    assert rc == 0 and loaded == [], (loaded, stderr)
    rows = {tuple(ln.split(maxsplit=2)) for ln in stdout.splitlines() if ln.strip()}
    assert rows == runtime_rows
    rc, loaded, stdout, _ = probe(tmp_path, "ls", "models", "fc_*")
    assert rc == 0 and loaded == []
    assert [ln.split()[:2] for ln in stdout.splitlines()] == [
        ["models", "fc_deq"],
        ["models", "fc_deq_tiny"],
    ]


@pytest.mark.parametrize("args", [["--help"], ["ls", "--help"], ["ls", "plots"]])
def test_help_imports_no_torch(tmp_path, args):
    rc, loaded, stdout, stderr = probe(tmp_path, *args)
    assert rc == 0 and loaded == [], (loaded, stderr)
    assert stdout.strip()


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", "no such file"),
        ("syntax", "invalid YAML:"),
        ("unknown key", ":6:1: bogus: unknown key"),
    ],
)
def test_validate_of_a_bad_file_fails_before_torch(tmp_path, case, message):
    if case == "missing":
        path = tmp_path / "missing.yaml"
    else:
        old, new = {"syntax": ("seeds: [0]", "seeds: [0"), "unknown key": ("seeds: [0]", "seeds: [0]\nbogus: 1")}[case]  # fmt: skip
        path = write_suite(tmp_path, TINY_SUITE, replace={old: new})
    rc, loaded, stdout, stderr = probe(tmp_path, "validate", str(path))
    assert rc == 2 and loaded == [], (loaded, stderr)
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}") and message in lines[0]
    assert "Traceback" not in stderr and not stdout


def test_ls_lists_plugins_from_their_metadata_without_importing_them(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "lsplug.py").write_text("raise SystemExit('lsplug was imported')\n")
    info = site / "lsplug-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lsplug\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[deqbench.models]\nplug_model = lsplug:f\nfc_deq = lsplug:f\n\n"
        "[deqbench.kernels]\nplug_kernel = lsplug:k\n"
    )
    env = {"PYTHONPATH": str(site), "DEQBENCH_DISABLE_PLUGIN_AUTOLOAD": "0"}
    rc, loaded, stdout, stderr = probe(tmp_path, "ls", env=env)
    assert rc == 0 and loaded == [], (loaded, stderr)
    rows = [ln.split(maxsplit=2) for ln in stdout.splitlines()]
    assert ["models", "plug_model", "lsplug 1.0"] in rows
    assert ["kernels", "plug_kernel", "lsplug 1.0"] in rows
    assert ["models", "fc_deq", "built-in"] in rows  # a plugin cannot shadow a built-in
    assert "tries to register model 'fc_deq', which is a built-in name" in stderr
    rc, _, stdout, _ = probe(tmp_path, "ls", "models", "--check", env=env)
    assert rc == 1 and "lsplug was imported" in stdout  # --check imports it: BROKEN


def test_commands_exit_at_once_with_their_code_and_all_their_output(tmp_path):
    """``deqbench`` leaves by ``os._exit`` once a command's exit code is decided (the
    interpreter's teardown skipped): the code and every line already printed must arrive, on a
    pipe and in a file; ``DEQBENCH_SLOW_EXIT=1`` gives the same through the normal exit."""
    for slow in ("", "1"):
        env = {**os.environ, "DEQBENCH_SLOW_EXIT": slow}
        out = subprocess.run(
            [sys.executable, "-m", "deqbench", "ls", "solvers"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert "anderson" in out.stdout and "broyden" in out.stdout
        with open(tmp_path / "ls.txt", "w") as fh:  # a file: block-buffered stdout
            rc = subprocess.run(
                [sys.executable, "-m", "deqbench", "ls", "solvers"],
                cwd=tmp_path, env=env, stdout=fh, timeout=300,
            ).returncode  # fmt: skip
        assert rc == 0 and (tmp_path / "ls.txt").read_text() == out.stdout
        bad = subprocess.run(
            [sys.executable, "-m", "deqbench", "validate", "missing.yaml"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert bad.returncode == 2 and "missing.yaml: no such file" in bad.stderr


@pytest.mark.parametrize("compiles", [False, True])
def test_deterministic_flag_without_inductor_only_where_nothing_compiles(compiles):
    """A Dask coordinator (``compiles=False``) sets the deterministic-algorithms flag without
    importing TorchInductor (2-4 s, torch._dynamo with it); a process that runs cells sets
    Inductor's ``deterministic`` too (a compiled cell must see it); restoring afterwards
    (``preserved_numerics``) does not import Inductor either where it was not loaded."""
    code = (
        "import sys, torch\n"
        "from deqbench.run.task import set_deterministic_algorithms\n"
        "from deqbench.performance.measure import preserved_numerics\n"
        "with preserved_numerics():\n"
        f"    set_deterministic_algorithms(True, warn_only=True, compiles={compiles})\n"
        "    on = torch.are_deterministic_algorithms_enabled()\n"
        "    loaded = 'torch._inductor.config' in sys.modules\n"
        "    ind = sys.modules['torch._inductor.config'].deterministic if loaded else None\n"
        "print(on, loaded, ind, torch.are_deterministic_algorithms_enabled())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    want = "True True True False" if compiles else "True False None False"
    assert out.stdout.split() == want.split(), out.stderr
