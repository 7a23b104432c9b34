"""Names by content: no tracker, session, round or phase numbers and no pointers to files outside
the repository (the papers' folder, the old reference notes) in the package, docs, benchmarks,
suites, tests, examples, committed results or file names. Papers are cited by authors and year
(docs/papers.md); a result is named by its topic.

The patterns are built from pieces so that this file does not match itself."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("deqbench", "docs", "benchmarks", "suites", "tests", "examples", "plots", "README.md")

_WORDS = "|".join(("iss" + "ue", "sess" + "ion", "rou" + "nd", "pha" + "se"))
#: a tracker, session, round or phase number, a paper by its folder number, the old notes file
TEXT = re.compile(
    rf"\b({_WORDS}) ?#?[0-9]+\b|" + "pap" + r"ers/00[0-9]|" + "REFER" + r"ENCE\.md",
    re.IGNORECASE,
)
#: a file or folder named by a tracker, session, round or phase number
PATH = re.compile(rf"({_WORDS})_?[0-9]", re.IGNORECASE)

#: committed run data under plots/: values a run wrote (its command, ids, paths), not prose
RUN_DATA = re.compile(
    r"(^|/)(results\.csv(\.gz)?|run\.json|timeline\.csv)$"
    r"|/series/[^/]+\.csv$"
)


def _tracked() -> list[str]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--", *SCANNED],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [p for p in out.decode().split("\0") if p]


def _text(path: Path) -> str | None:
    """The file's text, None for a binary file (NUL bytes or not UTF-8) or one not on disk."""
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    if b"\0" in raw[:8192]:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def find_mentions(paths: list[str], root: Path = ROOT) -> list[str]:
    """``path:line: text`` of every match of :data:`TEXT` in the text files of ``paths``."""
    hits = []
    for rel in paths:
        if rel.startswith("plots/") and RUN_DATA.search(rel):
            continue
        text = _text(root / rel)
        if text is None:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if TEXT.search(line):
                hits.append(f"{rel}:{n}: {line.strip()[:160]}")
    return hits


def test_no_tracker_numbers_or_outside_pointers_in_text():
    hits = find_mentions(_tracked())
    assert not hits, "name by topic or cite by authors:\n" + "\n".join(hits)


def test_no_tracked_path_is_named_by_a_number_of_the_tracker():
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True).stdout
    bad = [p for p in out.decode().split("\0") if p and PATH.search(p)]
    assert not bad, "name by topic:\n" + "\n".join(bad)


def test_the_patterns_catch_what_they_are_for(tmp_path):
    w = "iss" + "ue"
    bad = {
        "a.py": f'"""Broyden on the graph path ({w} 31)."""\n',
        "b.md": f"the shared trend rule of {w} #26\n",
        "c.md": "see " + "pap" + "ers/002 section 4\n",
        "d.md": "(" + "REFER" + "ENCE.md 3.2)\n",
        "e.md": "the second " + "pha" + "se 2 of the run\n",
    }
    good = {"f.md": "a tissue 31 and a roundup 3; the two phases; papers/ and REFERENCE\n"}
    for name, text in {**bad, **good}.items():
        (tmp_path / name).write_text(text)
    hits = find_mentions(sorted({**bad, **good}), tmp_path)
    assert sorted(h.split(":")[0] for h in hits) == sorted(bad)
    assert PATH.search("benchmarks/" + w + "17_gpu.sh") and PATH.search("plots/" + "rou" + "nd3/")
    assert not PATH.search("plots/gpu/broyden_floor/solvers_run1.csv")
