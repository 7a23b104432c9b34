"""Post-run reports (deqbench.run.reports): the runner calls every registered report on the
finished run directory without naming any; the claim summary registers itself there."""

from __future__ import annotations

import subprocess
import sys

import pytest

from deqbench.run import reports


@pytest.fixture
def scratch_reports():
    """Reports a test registers are removed afterwards."""
    before = dict(reports._REGISTRY)
    yield
    reports._REGISTRY.clear()
    reports._REGISTRY.update(before)


def test_every_report_runs_and_a_failing_one_is_an_error_line(tmp_path, scratch_reports):
    seen = []

    @reports.register("zz_count")
    def count(run_dir):
        seen.append(run_dir)
        (run_dir / "count.txt").write_text("3\n")

    @reports.register("zz_broken")
    def broken(run_dir):
        raise ValueError("no results.csv")

    errors = reports.write_reports(str(tmp_path))
    assert seen == [tmp_path]
    assert (tmp_path / "count.txt").read_text() == "3\n"
    assert errors == ["zz_broken: ValueError: no results.csv"]


def test_the_claim_summary_is_found_through_the_source_index():
    """A fresh process that imports only the report registry finds the claim summary: the index
    names its module, the registry imports it."""
    code = (
        "import sys\n"
        "from deqbench.run import reports\n"
        "assert 'deqbench.outcomes' not in sys.modules\n"
        "print(reports.names(), reports.get('outcomes').__module__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["['outcomes']", "deqbench.outcomes"]
