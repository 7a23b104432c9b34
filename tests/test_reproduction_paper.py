"""The committed paper-scale reports (plots/reproduction_paper/<paper>/, made on a GPU by
``deqbench reproduce PAPER --scale paper``) are what today's code concludes from their committed
runs: each report folder is copied, its ``results.csv.gz`` unpacked, and ``deqbench reproduce
--resume`` (which reuses a finished run, running nothing) must rewrite the same verdicts,
measured values and reasons. A change to a checker or an extractor that would change a
committed verdict fails here until the report is rewritten (the same command) and committed."""

from __future__ import annotations

import csv
import gzip
import io
import shutil
from pathlib import Path

import pytest

from deqbench.reproduce.run import RunOptions, reproduce

ROOT = Path(__file__).resolve().parents[1] / "plots" / "reproduction_paper"
PAPERS = sorted(p.name for p in ROOT.iterdir() if (p / "reproduction.csv").is_file())


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def test_there_are_committed_paper_reports() -> None:
    assert len(PAPERS) >= 2, PAPERS  # at least two papers at paper scale


@pytest.mark.slow  # re-judges committed paper-scale runs: about 15 s for the kGLM report
@pytest.mark.parametrize("paper", PAPERS)
def test_committed_paper_report_is_what_the_code_concludes(paper: str, tmp_path: Path) -> None:
    out = tmp_path / paper
    shutil.copytree(ROOT / paper, out)
    for gz in out.glob("runs/*/*/results.csv.gz"):
        gz.with_suffix("").write_bytes(gzip.decompress(gz.read_bytes()))
    committed = _rows(out / "reproduction.csv")
    log = io.StringIO()
    reproduce(
        scale="paper",
        claim_ids=[r["claim_id"] for r in committed],
        out=out,
        options=RunOptions(judge_only=True),
        log=log,
    )
    assert "started" not in log.getvalue() and "resumed" not in log.getvalue(), log.getvalue()
    again = _rows(out / "reproduction.csv")
    keys = ("claim_id", "verdict", "measured", "reason", "data", "paper_value")
    assert [{k: r[k] for k in keys} for r in again] == [{k: r[k] for k in keys} for r in committed]
