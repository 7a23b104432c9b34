"""What ``deqbench compare`` prints (the header, the per-metric table, the row counts, the
CHANGED cells) and what its ``--csv`` writes. Nothing heavy is imported until it runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def print_comparison(
    run_a: Path,
    run_b: Path,
    a: Any,
    b: Any,
    warnings: list[str],
    summary: Any,
    changes: Any,
    counts: dict[str, Any],
    tol: float,
    factor: float,
    timing: bool,
) -> None:
    """What ``deqbench compare`` prints: the warnings, the header (what differs between the
    runs), the tasks only one run has, the per-metric table, the row counts and the CHANGED
    cells (or that nothing changed)."""
    from ..run.console import (
        cell_lines,
        changes_table,
        compare_header,
        compare_table,
        err_console,
        out_console,
    )
    from ..run.results import _run_meta, task_differences

    for w in warnings:
        err_console().print(f"warning: {w}", markup=False)
    (meta_a, _), (meta_b, _) = _run_meta(run_a), _run_meta(run_b)
    for line in compare_header(run_a, run_b, meta_a, meta_b, [f"suite: {w}" for w in warnings]):
        print(line)
    for line in cell_lines(task_differences(a, b)):
        print(line)
    con = out_console()
    con.print(
        compare_table(
            summary,
            f"B: {run_b} vs A: {run_a} (per metric; changes judged per cell: "
            f"rtol {tol:g}"
            + (f", timing x{factor:g} and p < 0.01)" if timing
               else "; timing metrics judged only with --timing)"),
        )
    )  # fmt: skip
    ca, cb = counts["a"], counts["b"]
    print(
        f"rows: {ca['matched']} matched pairs; unmatched, left out of the ratios: "
        f"A {ca['unmatched']} of {ca['compared']}, B {cb['unmatched']} of {cb['compared']}"
        + (f"; failed, not compared: A {ca['failed']}, B {cb['failed']}"
           if ca["failed"] or cb["failed"] else "")
        + (f"; skipped (analysis does not apply): A {ca['skipped']}, B {cb['skipped']}"
           if ca["skipped"] or cb["skipped"] else "")
    )  # fmt: skip
    n_cells = changes["cell_id"].nunique()
    if len(changes):
        con.print(
            changes_table(
                changes,
                f"CHANGED: {len(changes)} item{'s' * (len(changes) != 1)} in {n_cells} "
                f"cell{'s' * (n_cells != 1)} (A, B: the most changed row; rows: changed "
                "of compared)",
            )
        )
    else:
        print(
            f"no change: every deterministic row within rtol {tol:g}, the same statuses"
            + (", no timing beyond the rule" if timing else "")
        )


def write_comparison_csv(csv: Path, summary: Any, changes: Any) -> None:
    """``compare --csv``: the per-metric table to ``csv``, the CHANGED list to its -cells.csv
    sibling."""
    summary.to_csv(csv, index=False)
    cells_csv = csv.with_name(f"{csv.stem}-cells{csv.suffix or '.csv'}")
    changes.to_csv(cells_csv, index=False)
    print(f"wrote {csv}")
    print(f"wrote {cells_csv}")
