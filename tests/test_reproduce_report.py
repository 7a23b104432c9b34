"""The docs' reproduction table is the committed CPU report, verbatim, and the report
covers every claim of the table with one of the three verdicts."""

from __future__ import annotations

import csv
from pathlib import Path

from deqbench.reproduce.checks import VERDICTS
from deqbench.reproduce.claims import CLAIMS
from deqbench.reproduce.run import REPORT_COLUMNS

ROOT = Path(__file__).resolve().parent.parent
REPORT = ROOT / "plots" / "reproduction_cpu"


def test_docs_table_is_the_committed_report():
    body = (REPORT / "reproduction.md").read_text().split("\n", 1)[1].strip()
    docs = (ROOT / "docs" / "reproductions.md").read_text()
    begin, end = "<!-- reproduction:begin -->\n", "\n<!-- reproduction:end -->"
    assert docs[docs.index(begin) + len(begin) : docs.index(end)].strip() == body


def test_the_committed_report_has_every_claim_with_a_verdict():
    with open(REPORT / "reproduction.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0]) == list(REPORT_COLUMNS)
    assert sorted(r["claim_id"] for r in rows) == sorted(c.id for c in CLAIMS)
    for r in rows:
        assert r["verdict"] in VERDICTS and r["paper_value"], r["claim_id"]
        assert r["scale"] == "cpu"
        if r["verdict"] == "not run":
            assert r["reason"], r["claim_id"]


def test_docs_carry_each_committed_paper_report():
    docs = (ROOT / "docs" / "reproductions.md").read_text()
    papers = sorted(p.name for p in (ROOT / "plots" / "reproduction_paper").iterdir() if p.is_dir())
    assert papers
    for paper in papers:
        md = ROOT / "plots" / "reproduction_paper" / paper / "reproduction.md"
        body = md.read_text().split("\n", 1)[1].strip()
        begin = f"<!-- reproduction-paper-{paper}:begin -->\n"
        end = f"\n<!-- reproduction-paper-{paper}:end -->"
        assert docs[docs.index(begin) + len(begin) : docs.index(end)].strip() == body, paper


def test_a_part_of_a_grid_and_its_sharing_are_named(tmp_path):
    """A run of a part of a suite's grid (``select``) is named as such in the report's suite
    table, and so is how its tasks shared the machine."""
    from deqbench.reproduce.run import _cells_run, _sharing
    from deqbench.reproduce.verdicts import selected

    (tmp_path / "suite.yaml").write_text("name: x\nselect: [pcdeq_l-*]\n")
    assert selected(tmp_path) == ["pcdeq_l-*"]
    assert _cells_run(tmp_path, {"cells": ["a", "b"]}) == "2 cells (select pcdeq_l-*)"
    (tmp_path / "suite.yaml").write_text("name: x\n")
    assert selected(tmp_path) == [] and _cells_run(tmp_path, {"cells": ["a"]}) == "1 cell"
    gpu = {"kind": "dask", "workers_joined": 16, "gpus": ["0"] * 16}
    assert _sharing({"executor": gpu}) == "dask: 16 workers on 1 GPU"
    cpu = {"kind": "dask", "workers": 15, "gpus": [], "torch_threads": 1}
    assert _sharing({"executor": cpu}) == "dask: 15 workers x 1 thread(s) (CPU)"
    assert _sharing({}) == "inline"
    # a resumed run whose calls asked for different worker counts: each call's is said, since
    # the executor recorded is the last call's
    start = ["deqbench", "reproduce", "002", "--executor", "dask", "--workers", "16"]
    meta = {"executor": {"kind": "dask", "workers_joined": 2, "gpus": ["0", "1"]},
            "command": start, "resumed": [{"command": start + ["--resume"]},
                                          {"command": start[:-2] + ["--resume"]}]}  # fmt: skip
    assert _sharing(meta) == ("dask: 2 workers on 2 GPUs in the last call, over 3 calls "
                              "(--resume); --workers per call: 16, 16, default")  # fmt: skip
    meta["resumed"] = [{"command": ["deqbench", "--workers=16", "--resume"]}]
    assert _sharing(meta) == "dask: 2 workers on 2 GPUs, over 2 calls (--resume)"
    # the last --workers is the one the CLI takes; a call without a recorded command is "?"
    meta["resumed"] = [{"command": start + ["--workers", "4", "--workers", "16"]}, {"at": "x"}]
    assert _sharing(meta).endswith("; --workers per call: 16, 16, ?")


def test_readme_quotes_each_committed_reports_counts():
    """The README's result rows quote each committed report's counts (plots/regenerate.py
    rewrites them): a report regenerated without its row would fail here."""
    import re

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text(encoding="utf-8")
    pattern = r"\d+ claims: \d+ reproduced, \d+ not reproduced, \d+ not run"
    reports = [root / "plots" / "reproduction_cpu" / "reproduction.md"]
    reports += sorted((root / "plots" / "reproduction_paper").glob("*/reproduction.md"))
    for md in reports:
        counts = re.search(pattern, md.read_text(encoding="utf-8"))
        assert counts is not None, md
        link = str(md.relative_to(root))
        rows = [ln for ln in readme.splitlines() if link in ln and " claims: " in ln]
        assert rows, f"README links no row to {link}"
        assert all(counts.group(0) in ln for ln in rows), (link, counts.group(0))
