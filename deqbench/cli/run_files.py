"""Reading run directories for the verbs: a run directory whose files deqbench did not write is
refused with one line (:func:`check_run_files`), a run is loaded with its errors as one line
(:func:`_load_run`), and ``compare --reference`` checks a fresh run against a reference
(:func:`_reference_check`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def check_run_files(run: Path) -> None:
    """Refuse, with one line (:class:`ConfigError`), a run directory (or ``results.csv``) whose
    files deqbench did not write: ``results.csv`` not UTF-8, without its header or with rows of
    another width; ``run.json`` not a JSON object; ``suite.yaml`` not a safe YAML mapping
    within the YAML limits. Reads only; a missing file is left to the loaders."""
    import csv
    import json

    from ..core.errors import ConfigError
    from ..run.results import COLUMNS
    from ..run.yamlio import read_yaml

    p = Path(run)
    path = p if p.suffix == ".csv" else p / "results.csv"
    if not p.exists():
        raise ConfigError(f"{run}: no such run directory")
    if path.is_file():
        data = path.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"{path}: not a deqbench results file: not UTF-8 text (byte "
                f"0x{data[exc.start]:02x} at offset {exc.start})"
            ) from None
        if text and not text.endswith("\n"):
            text = text[: text.rfind("\n") + 1]  # a partial last line (crash mid-write)
        rows = csv.reader(text.splitlines())
        header = next(rows, None)
        need = {"cell_id", "seed", "analysis", "metric", "value"}
        if text.strip() and (header is None or not need <= set(header)):
            first = ",".join(header or [])[:60]
            raise ConfigError(
                f"{path}: not a deqbench results file: no header line with "
                f"{', '.join(c for c in COLUMNS if c in need)} (first line: {first!r})"
            )
        for i, row in enumerate(rows, start=2):
            if header is not None and len(row) != len(header):
                raise ConfigError(
                    f"{path}:{i}: {len(row)} fields where the header has {len(header)}: "
                    "a corrupt results file"
                )
    meta = (p if p.suffix != ".csv" else p.parent) / "run.json"
    if meta.is_file():
        try:
            obj = json.loads(meta.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            why = " ".join(str(exc).split())[:80] or "empty"
            raise ConfigError(f"{meta}: corrupt run.json: not valid JSON ({why})") from None
        if not isinstance(obj, dict):
            raise ConfigError(f"{meta}: corrupt run.json: expected a JSON object")
    suite = meta.with_name("suite.yaml")
    if suite.is_file():
        raw, _ = read_yaml(suite)
        if not isinstance(raw, dict):
            raise ConfigError(f"{suite}: corrupt suite.yaml: expected a mapping")


def _load_run(run: Path) -> Any:
    """:func:`~deqbench.run.results.load_results` after :func:`check_run_files`; a file it still
    cannot read is one line (ConfigError), not a traceback."""
    import yaml

    from ..core.errors import ConfigError
    from ..run.results import load_results

    check_run_files(run)
    try:
        return load_results(run)
    except (OSError, ValueError, KeyError, yaml.YAMLError) as exc:
        why = " ".join(str(exc).split())[:120]
        raise ConfigError(f"{run}: cannot read the run: {type(exc).__name__}: {why}") from None


def _reference_check(reference: Path, fresh: Path) -> int:
    """``compare --reference``: header, one line per mismatch, a verdict; the exit code."""
    from ..run.console import compare_header
    from ..run.reference import check_against_reference, tolerances_text
    from ..run.results import _run_meta

    (meta_r, _), (meta_f, _) = _run_meta(reference), _run_meta(fresh)
    for line in compare_header(reference, fresh, meta_r, meta_f):
        print(line)
    mismatches = check_against_reference(reference, fresh)
    for m in mismatches:
        print(f"mismatch: {m}")
    if mismatches:
        print(f"{fresh} does not match the reference {reference}: {len(mismatches)} mismatches")
        return 1
    print(f"{fresh} matches the reference {reference} ({tolerances_text()})")
    return 0
