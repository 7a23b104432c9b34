"""What a reader pastes from README.md and docs/*.md runs, and the sizes and times the docs state
are the suites' and the committed runs'.

Every ```python block runs in a fresh interpreter; every ```bash block must be cheap deqbench
commands (``--help``, ``--version``, ``ls``, ``validate``, ``info``), which run as
``python -m deqbench ...``. A block that cannot run here (a GPU, a long run, an install, a file of
a package) is a fragment: ``<!-- fragment: why -->`` on the line before its fence, or a region
between ``<!-- fragments: why -->`` and ``<!-- /fragments -->`` (docs/contributing.md, "Code
blocks in the docs"). Both run with the working directory a temporary folder that links the
repository's ``suites``, ``plots`` and ``examples``, so a block writes nothing into the tree."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN_LANGS = {"python", "bash", "sh", "shell", "console"}
CHEAP = {"--help", "-h", "--version", "ls", "validate", "info"}
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
FRAGMENT = re.compile(r"^\s*<!-- fragment: \S.*-->\s*$")
REGION_BEGIN = re.compile(r"^\s*<!-- fragments: \S.*-->\s*$")
REGION_END = re.compile(r"^\s*<!-- /fragments -->\s*$")


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    code: str
    fragment: bool


def blocks(text: str, page: str = "page.md") -> list[Block]:
    """The fenced code blocks of a markdown text, with their fragment marks."""
    lines = text.split("\n")
    out: list[Block] = []
    region = False
    i = 0
    while i < len(lines):
        ln = lines[i]
        if REGION_BEGIN.match(ln):
            region = True
        elif REGION_END.match(ln):
            region = False
        m = FENCE.match(ln)
        if m and m.group(2):
            indent, lang = m.group(1), m.group(2)
            j = i + 1
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            body = [x[len(indent) :] if x.startswith(indent) else x for x in lines[i + 1 : j]]
            marked = i > 0 and bool(FRAGMENT.match(lines[i - 1]))
            out.append(Block(page, i + 1, lang, "\n".join(body) + "\n", region or marked))
            i = j
        i += 1
    return out


def _all_blocks() -> list[Block]:
    found = []
    for p in PAGES:
        found += blocks(p.read_text(encoding="utf-8"), str(p.relative_to(ROOT)))
    return [b for b in found if b.lang in RUN_LANGS and not b.fragment]


def commands(block: Block) -> list[list[str]]:
    """The deqbench commands of a bash block, as argument lists after ``deqbench``; a line that
    is not a cheap deqbench command fails (mark the block as a fragment)."""
    cmds = []
    for raw in block.code.splitlines():
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        args = shlex.split(line)
        assert args[0] == "deqbench" and len(args) > 1 and args[1] in CHEAP, (
            f"{block.page}:{block.line}: `{line}` is not a cheap deqbench command: run it in a "
            "tiny form or mark the block <!-- fragment: why -->"
        )
        cmds.append(args[1:])
    return cmds


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("docs_run")
    for name in ("suites", "plots", "examples"):
        (d / name).symlink_to(ROOT / name)
    return d


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["COLUMNS"] = "100"
    return env


def _unique(kind: set[str]) -> list[Block]:
    seen: dict[str, Block] = {}
    for b in _all_blocks():
        if b.lang in kind:
            seen.setdefault(b.code, b)  # the same block on two pages runs once
    return list(seen.values())


PYTHON = _unique({"python"})
SHELL = _unique(RUN_LANGS - {"python"})


def _shell_commands() -> list[tuple[Block, list[str]]]:
    seen: dict[tuple[str, ...], Block] = {}
    for b in SHELL:
        try:
            found = commands(b)
        except AssertionError:  # reported by test_bash_block_is_cheap_or_a_fragment
            continue
        for args in found:
            seen.setdefault(tuple(args), b)  # the same command on two pages runs once
    return [(b, list(a)) for a, b in seen.items()]


COMMANDS = _shell_commands()


@pytest.mark.parametrize("block", PYTHON, ids=[f"{b.page}:{b.line}" for b in PYTHON])
def test_python_block_runs(block: Block, sandbox: Path):
    r = subprocess.run(
        [sys.executable, "-c", block.code],
        cwd=sandbox,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, f"{block.page}:{block.line}\n{r.stderr[-2000:]}"


@pytest.mark.parametrize("block", SHELL, ids=[f"{b.page}:{b.line}" for b in SHELL])
def test_bash_block_is_cheap_or_a_fragment(block: Block):
    assert commands(block)


@pytest.mark.parametrize(
    ("block", "args"), COMMANDS, ids=[f"{b.page}:{b.line}:{' '.join(a)}" for b, a in COMMANDS]
)
def test_bash_command_runs(block: Block, args: list[str], sandbox: Path):
    r = subprocess.run(
        [sys.executable, "-m", "deqbench", *args],
        cwd=sandbox,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    where = f"{block.page}:{block.line}: deqbench {shlex.join(args)}"
    assert r.returncode == 0, f"{where}\n{r.stderr[-2000:]}"
    assert r.stdout.strip(), where


def test_blocks_are_found_and_marks_read():
    text = (
        "```python\nprint(1)\n```\n"
        "<!-- fragment: needs a GPU -->\n```bash\ndeqbench run x.yaml\n```\n"
        "<!-- fragments: generated -->\n```python\nraise SystemExit(1)\n```\n<!-- /fragments -->\n"
        "!!! note\n    ```python\n    x = 1\n    ```\n"
        "<!-- fragment -->\n```bash\ndeqbench ls\n```\n"
    )
    got = [(b.line, b.lang, b.fragment, b.code) for b in blocks(text)]
    assert got == [
        (1, "python", False, "print(1)\n"),
        (5, "bash", True, "deqbench run x.yaml\n"),
        (9, "python", True, "raise SystemExit(1)\n"),
        (14, "python", False, "x = 1\n"),
        (18, "bash", False, "deqbench ls\n"),  # a marker needs its reason
    ]
    heavy = Block("p.md", 1, "bash", "deqbench run suites/smoke.yaml\n", False)
    with pytest.raises(AssertionError, match="not a cheap deqbench command"):
        commands(heavy)
    cheap = Block("p.md", 1, "bash", "# list\ndeqbench ls solvers   # names\n", False)
    assert commands(cheap) == [["ls", "solvers"]]


# --- sizes and times the docs state -------------------------------------------------------------


def _smoke_cells() -> int:
    import deqbench

    return len(deqbench.load_suite(ROOT / "suites" / "smoke.yaml").cells)


def test_smoke_cell_count_and_time_are_the_suites():
    n = _smoke_cells()
    texts = {p.name: p.read_text(encoding="utf-8") for p in PAGES}
    stated = [
        (page, int(m.group(1)))
        for page, t in texts.items()
        for m in re.finditer(r"(\d+) tiny cells", t)
    ]
    assert {"README.md", "getting-started.md"} <= {p for p, _ in stated}
    assert all(k == n for _, k in stated), (stated, n)
    header = "".join(
        ln
        for ln in (ROOT / "suites" / "smoke.yaml").read_text().splitlines(True)
        if ln.startswith("#")
    )
    assert f"{n} cells x 2 seeds" in header
    meta = json.loads((ROOT / "plots" / "smoke" / "run.json").read_text())
    secs = (
        datetime.fromisoformat(meta["finished"]) - datetime.fromisoformat(meta["started"])
    ).total_seconds()
    for page in ("README.md", "getting-started.md", "benchmarks.md"):
        for m in re.finditer(
            r"took (\d+) s (?:on two CPU cores|from start to finish)", texts[page]
        ):
            assert int(m.group(1)) == round(secs), (page, m.group(0), secs)
        for m in re.finditer(r"(\d+) tasks: (\d+) cells x 2 seeds", texts[page]):
            assert (int(m.group(1)), int(m.group(2))) == (2 * n, n), (page, m.group(0))


def test_smoke_header_names_the_solvers_it_runs():
    import deqbench

    suite = deqbench.load_suite(ROOT / "suites" / "smoke.yaml")
    header = " ".join(
        ln.lstrip("# ").strip()
        for ln in (ROOT / "suites" / "smoke.yaml").read_text().splitlines()
        if ln.startswith("#")
    )
    base = {
        c.solver["name"]
        for c in suite.cells
        if c.model["name"] in ("fc_deq_tiny", "conv_deq_tiny") and c.backward["name"] != "unrolled"
    }
    if "every built-in solver" in header:
        assert base == set(deqbench.solvers.names()), sorted(base)
    named = re.search(r"(\w+) solvers \(([^)]*)\)", header)
    assert named, header
    assert {s.strip() for s in named.group(2).split(",")} == base


def test_cpu_reproduction_time_is_the_committed_reports():
    from deqbench.reproduce.cli import EXAMPLE

    report = (ROOT / "plots" / "reproduction_cpu" / "reproduction.md").read_text()
    total = float(re.search(r"([\d.]+) s in total", report).group(1))
    minutes = int(re.search(r"about\s+(\d+)\s+minutes", EXAMPLE).group(1))
    assert 0.5 * minutes * 60 <= total <= 1.5 * minutes * 60, (minutes, total)
    readme = (ROOT / "README.md").read_text()
    line = next(ln for ln in readme.splitlines() if "deqbench reproduce --scale cpu" in ln)
    assert f"about {minutes} minutes" in line, line
    assert f"{total:g} s" in readme


def test_readme_first_run_excerpt_is_the_committed_run():
    """Each row of the README's excerpt of the summary table is the committed smoke run's."""
    import io

    from rich.console import Console

    import deqbench
    from deqbench.run import console as cons

    buf = io.StringIO()
    orig = cons.out_console
    cons.out_console = lambda: Console(file=buf, width=400)  # type: ignore[assignment]
    try:
        cons.print_summary(deqbench.load_results(ROOT / "plots" / "smoke"))
    finally:
        cons.out_console = orig
    table = [ln for ln in buf.getvalue().splitlines() if ln.startswith("│")]
    assert table
    readme = (ROOT / "README.md").read_text()
    excerpt = next(
        b for b in blocks(readme) if b.lang == "text" and "40 tasks: 40 ok" in b.code
    ).code
    rows = [ln for ln in excerpt.splitlines() if re.match(r"^\w+_tiny-", ln)]
    assert len(rows) >= 3
    for row in rows:
        cell, *values = re.split(r"\s{2,}", row.strip())
        prefix = cell.removesuffix("...")
        hits = [t for t in table if t.split("│")[1].strip().startswith(prefix)]
        assert len(hits) == 1, (cell, hits)
        got = [c.strip() for c in hits[0].split("│")[2:-1] if c.strip()]
        assert values == got[: len(values)], (row, got)
    totals = re.search(r"^\d+ tasks: .*$", buf.getvalue(), re.M)
    assert totals and totals.group(0) in excerpt.splitlines(), totals


def test_readme_is_short_and_its_links_exist():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme):
        if "://" in target:
            continue
        assert (ROOT / target).exists(), target
