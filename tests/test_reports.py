"""Post-run reports (deqbench.run.reports): the runner calls every registered report on the
finished run directory without naming any; the claim summary registers itself there."""

from __future__ import annotations

from deqbench.run import reports


def test_every_report_runs_and_a_failing_one_is_an_error_line(tmp_path):
    seen = []

    @reports.register("zz_count")
    def count(run_dir):
        seen.append(run_dir)
        (run_dir / "count.txt").write_text("3\n")

    @reports.register("zz_broken")
    def broken(run_dir):
        raise ValueError("no results.csv")

    try:
        errors = reports.write_reports(str(tmp_path))
    finally:
        reports.registry.remove("zz_count")
        reports.registry.remove("zz_broken")
    assert seen == [tmp_path]
    assert (tmp_path / "count.txt").read_text() == "3\n"
    # the claim summary ran too: no claim measures this folder's suite, so no summary.csv
    assert errors == ["zz_broken: ValueError: no results.csv"]
    assert not (tmp_path / "summary.csv").exists()


def test_the_claim_summary_is_found_through_the_source_index():
    """The index names the module that registers the claim summary (nothing imported), and the
    registry loads it from there."""
    from deqbench.outcomes import summarize

    assert reports.builtin_modules() == ["deqbench.outcomes"]
    assert reports.get("outcomes") is summarize
