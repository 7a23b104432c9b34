"""Results on disk: the ``results.csv`` schema, a crash-safe writer, the loader, compare.

``results.csv`` is tidy long format, one row per measured scalar, columns :data:`COLUMNS`.
Each finished (cell, seed) task is appended with a single ``write`` + ``fsync`` and ends with the
runner's status row (analysis ``runner``, metric ``wall_time``), so a ``kill -9`` at any moment
leaves a readable file that holds every finished task completely; :func:`finished_tasks` reads
those markers. Before a task's rows are appended, ``manifest.jsonl`` gets one line for it (its row
count and the sha256 of its encoded rows, :data:`MANIFEST`); ``--resume`` checks every finished
task against it (:func:`check_finished`) and re-runs a task whose rows are missing, duplicated or
changed.

Example:
    >>> import deqbench
    >>> df = deqbench.load_results("results/smoke/20250101-120000")   # doctest: +SKIP
    >>> df[df.metric == "forward_nstep"].groupby("solver").value.median()   # doctest: +SKIP

**Where it lives.** This module re-exports the names of its one-topic homes:
:mod:`.results_writer` (schema and writer), :mod:`.results_reader` (loader and integrity
checks), :mod:`.comparison` (statistical compare) and :mod:`.run_diffs` (environment and suite
differences).
"""

from __future__ import annotations

from .comparison import (
    ALPHA,
    ATOL,
    CHANGE_COLUMNS,
    RTOL,
    TIMING_UNITS,
    compare,
    compare_cells,
    is_timing,
    mann_whitney_p,
    match_counts,
    min_p_value,
    min_samples_for,
    task_differences,
    timing_change,
    values_differ,
)
from .results_reader import (
    _task_lines,  # noqa: F401  (read by the runner)
    check_finished,
    drop_unfinished,
    finished_tasks,
    load_results,
    task_status,
)
from .results_writer import (
    COLUMNS,
    CONVERGENCE,
    FLAGGED,
    JOIN_KEYS,
    MANIFEST,
    RESULTS_SCHEMA,
    RUNNER,
    STATUSES,
    ResultsWriter,
    encode_rows,
    manifest_entry,
    new_run_dir,
    not_a_file,
    read_json,
    suite_folder,
    write_atomic,
    write_json,
)
from .run_diffs import (
    ENV_FIELDS,
    _run_meta,  # noqa: F401  (read by the CLI)
    check_comparable,
    environment_differences,
    run_environment,
    suite_differences,
)

__all__ = [
    "ALPHA",
    "ATOL",
    "CHANGE_COLUMNS",
    "COLUMNS",
    "CONVERGENCE",
    "ENV_FIELDS",
    "FLAGGED",
    "JOIN_KEYS",
    "MANIFEST",
    "RESULTS_SCHEMA",
    "RTOL",
    "RUNNER",
    "ResultsWriter",
    "STATUSES",
    "TIMING_UNITS",
    "check_comparable",
    "check_finished",
    "compare",
    "compare_cells",
    "drop_unfinished",
    "encode_rows",
    "environment_differences",
    "finished_tasks",
    "is_timing",
    "load_results",
    "manifest_entry",
    "mann_whitney_p",
    "match_counts",
    "min_p_value",
    "min_samples_for",
    "new_run_dir",
    "not_a_file",
    "read_json",
    "run_environment",
    "suite_differences",
    "suite_folder",
    "task_differences",
    "task_status",
    "timing_change",
    "values_differ",
    "write_atomic",
    "write_json",
]
