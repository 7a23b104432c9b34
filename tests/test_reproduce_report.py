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
