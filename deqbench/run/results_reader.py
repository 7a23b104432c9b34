"""Reading ``results.csv``: :func:`load_results` (a pandas DataFrame, duplicate keys refused),
the finished tasks and their runner status, and the integrity check of a run's finished tasks
against ``manifest.jsonl`` (:func:`check_finished`) that ``--resume`` relies on.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import re
import sys
from pathlib import Path
from typing import Any

from .results_writer import (
    COLUMNS,
    JOIN_KEYS,
    MANIFEST,
    RUNNER,
    _cell,
    _seed_field,
    encode_rows,
    manifest_entry,
    not_a_file,
    read_json,
    write_atomic,
)


def run_meta(run_dir: str | Path) -> dict[str, Any]:
    """A run directory's ``run.json`` as a mapping; {} where it is missing or unreadable."""
    try:
        meta = json.loads((Path(run_dir) / "run.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _csv_path(run: str | Path) -> Path:
    p = Path(run)
    return p if p.suffix == ".csv" else p / "results.csv"


def load_results(run: str | Path, *, check_keys: bool = True) -> Any:
    """The run's ``results.csv`` as a pandas DataFrame (``value`` float, ``step`` nullable int,
    text columns ``""`` where empty). A partial last line (crash mid-write) is ignored.
    A run of results schema 1 (no ``backward`` column) gets ``backward`` from the cells of the
    run directory's ``suite.yaml``, else ``""``.

    Args:
        run: a run directory or a ``results.csv`` path.
        check_keys: refuse (DataError, one line) a file where two rows share their key
            (:data:`JOIN_KEYS`): rows written twice, e.g. by two runs at once.
    """
    import pandas as pd

    from ..core.errors import ConfigError

    path = _csv_path(run)
    if not path.exists():
        raise ConfigError(f"{run}: not a run directory (no results.csv)")
    text = path.read_text(encoding="utf-8")
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
    if not text.strip():
        return pd.DataFrame({c: pd.Series(dtype="object") for c in COLUMNS})
    str_cols = [c for c in COLUMNS if c not in ("seed", "step", "repeat", "value")]
    df = pd.read_csv(
        io.StringIO(text),
        dtype={c: str for c in str_cols},
        keep_default_na=False,
        na_values={"value": [""], "step": [""], "seed": [""], "repeat": [""]},
    )
    if "backward" not in df.columns:  # results schema 1
        modes = _backward_by_cell(path.parent / "suite.yaml") if len(df) else {}
        mode_of = {c: modes.get(c) or _backward_from_id(c) for c in df["cell_id"].unique()}
        df["backward"] = df["cell_id"].map(mode_of).fillna("")
    df["value"] = pd.to_numeric(df["value"], errors="coerce").astype(float)
    for c in ("step", "seed", "repeat"):
        df[c] = pd.to_numeric(df[c], errors="coerce").astype("Int64")
    if check_keys:
        _refuse_duplicate_keys(path, df)
    return df[COLUMNS]


def _refuse_duplicate_keys(path: Path, df: Any) -> None:
    dup = df.duplicated(JOIN_KEYS, keep=False)
    if not dup.any():
        return
    from ..core.errors import DataError

    first = df[dup].iloc[0]
    tasks = df[dup].drop_duplicates(["cell_id", "seed"])
    run_dir = path.parent
    hint = (
        f"; resume the run to re-run those tasks: deqbench run {run_dir / 'suite.yaml'} "
        f"--resume {run_dir}"
        if (run_dir / "run.json").exists()
        else ""
    )
    raise DataError(
        f"{path}: {int(dup.sum())} rows of {len(tasks)} task(s) share their key "
        f"({', '.join(JOIN_KEYS)}) with another row, e.g. {first['cell_id']} seed={first['seed']} "
        f"{first['analysis']}/{first['metric']}: rows written twice (two runs writing at "
        f"once?){hint}"
    )


def _backward_from_id(cell_id: str) -> str:
    """The backward mode named by a cell id's third part (``model-solver-MODE-...``), else ""."""
    from ..core.deq import BACKWARD_MODES

    parts = str(cell_id).split("-")
    modes = set(BACKWARD_MODES)
    reg = sys.modules.get("deqbench.core.registry")
    if reg is not None and reg.backward_modes.builtins_loaded:  # plugins' modes too
        modes.update(reg.backward_modes.names())
    if len(parts) > 2 and parts[2] in modes:
        return parts[2]
    # ids that name what ran: model-unrolled<K>-..., model-sam-unrolled<K>-...
    return "unrolled" if any(re.fullmatch(r"unrolled\d+", p) for p in parts[1:3]) else ""


def _backward_by_cell(suite_yaml: Path) -> dict[str, str]:
    """cell id -> backward mode name, expanded from a run's resolved ``suite.yaml`` (for runs
    written before the ``backward`` column); ``{}`` when it is missing or no longer expands
    (e.g. a plugin model that is not installed)."""
    if not suite_yaml.exists():
        return {}
    try:
        from .. import models
        from .matrix import SECTIONS, expand, normalize_section
        from .specs import default_names, generic_fields, runtime_defaults
        from .yamlio import read_yaml  # its limits refuse a YAML bomb

        raw = read_yaml(suite_yaml)[0] or {}
        defaults = raw.get("defaults") or {}
        base = {
            s: normalize_section(s, raw.get("data") if s == "data" else defaults.get(s))
            for s in SECTIONS
        }

        def declared(name: str) -> dict[str, dict[str, Any]]:
            try:
                return models.defaults(name)
            except Exception:
                return {}

        from .labels import id_head

        out: dict[str, str] = {}
        for head in (None, id_head):  # the ids before and since they name what ran
            drafts = expand(
                base,
                raw.get("matrix"),
                {},
                generic_fields(),
                default_names(),
                declared=declared,
                suffix_defaults={"runtime": runtime_defaults()},
                id_head=head,
            )
            out.update({d.id: str(d.sections.get("backward", {}).get("name", "")) for d in drafts})
        return out
    except Exception:
        return {}


def finished_tasks(df: Any) -> set[tuple[str, int]]:
    """(cell_id, seed) pairs whose runner status row is present."""
    done = df[df["analysis"] == RUNNER]
    return {(str(c), int(s)) for c, s in zip(done["cell_id"], done["seed"])}


def drop_unfinished(run_dir: str | Path) -> set[tuple[str, int]]:
    """Rewrite ``results.csv`` without rows of unfinished tasks; return the finished tasks
    (:func:`check_finished` without its messages)."""
    return check_finished(run_dir)[0]


def _task_lines(
    path: Path,
) -> tuple[bytes, list[tuple[tuple[str, str] | None, bytes, bool]], bool]:
    """``results.csv`` as raw lines: (header line, [((cell_id, seed) or None where the line
    does not parse, line with its newline, whether it is a runner row)], whether a partial last
    line was cut off)."""
    from ..core.errors import DataError

    raw = path.read_bytes()
    lines = raw.split(b"\n")
    torn = lines[-1] != b""
    lines = lines[:-1]
    header = (_fields(lines[0]) or []) if lines else []
    if "cell_id" not in header or "seed" not in header:
        raise DataError(
            f"{path}: no results.csv header (cell_id, seed, ...) on its first line; this run "
            "directory cannot be resumed: start a new run"
        )
    ic, iseed = header.index("cell_id"), header.index("seed")
    ia = header.index("analysis") if "analysis" in header else -1
    out: list[tuple[tuple[str, str] | None, bytes, bool]] = []
    for ln in lines[1:]:
        f = (_fields(ln) or []) if ln else []
        if len(f) == len(header):
            out.append(((f[ic], f[iseed]), ln + b"\n", ia >= 0 and f[ia] == RUNNER))
        else:
            out.append((None, ln + b"\n", False))
    return lines[0] + b"\n", out, torn


def _fields(line: bytes) -> list[str] | None:
    """The CSV fields of one line, or None where it does not parse (a field over the csv
    module's size limit, 128 KiB: no deqbench row has one)."""
    try:
        return next(csv.reader([line.decode("utf-8", "replace")]), [])
    except csv.Error:
        return None


def _read_manifest(path: Path) -> dict[tuple[str, str], tuple[int, str]]:
    """(cell_id, seed) -> (rows, sha256) of each readable manifest line (the last one wins)."""
    out: dict[tuple[str, str], tuple[int, str]] = {}
    for ln in path.read_bytes().split(b"\n"):
        try:
            e = json.loads(ln)
            out[(str(e["cell_id"]), _cell(e["seed"]))] = (int(e["rows"]), str(e["sha256"]))
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError):
            continue  # a torn last line (the run stopped while appending it), or not a record
    return out


def _as_seed(s: str) -> int | None:
    try:
        return int(s)
    except ValueError:
        return None


def check_finished(run_dir: str | Path) -> tuple[set[tuple[str, int]], list[str]]:
    """Before a resume: the finished (cell_id, seed) tasks, and one line for each finished task
    that will run again because its rows are not what :data:`MANIFEST` records (rows missing,
    duplicated or changed, or rows the manifest does not know). ``results.csv`` is rewritten
    (atomically) to the rows of the finished tasks, the manifest to their records. A run
    directory without a manifest (older deqbench) is trusted as before, except that tasks with
    rows of repeated keys run again; it gets a manifest of what it holds. A run whose
    ``run.json`` records results schema 2 or later was written with a manifest: without it, its
    rows cannot be checked and the resume is refused (ConfigError, one line with the fix).
    An empty ``results.csv`` (0 bytes) is read as one with only its header: every task runs.
    A directory, FIFO or other non-file in place of ``results.csv`` or the manifest is refused
    (ConfigError) before it is read."""
    from ..core.errors import ConfigError

    run_dir = Path(run_dir)
    path = _csv_path(run_dir)
    man = run_dir / MANIFEST
    for p in (path, man):
        if (why := not_a_file(p)) is not None:
            raise ConfigError(
                f"{p} {why}, where deqbench keeps its {p.name}: move it away, or start a new "
                f"run: deqbench run {run_dir / 'suite.yaml'}"
            )
    if not path.exists():
        return set(), []
    notes: list[str] = []
    if path.stat().st_size == 0:  # as a file with only its header: nothing finished
        write_atomic(path, encode_rows([], header=True))
        notes.append("results.csv: empty (no header line): every task runs")
    if not man.exists():
        if _recorded_schema(run_dir) >= 2 and len(_task_lines(path)[1]) > 0:
            raise ConfigError(
                f"{run_dir}: {MANIFEST} is missing, so the rows of results.csv cannot be checked "
                f"(this run was written with one; results schema 2): restore {MANIFEST}, or "
                f"start a new run: deqbench run {run_dir / 'suite.yaml'}"
            )
        legacy, more = _check_legacy(run_dir, path, man)
        return legacy, notes + more
    header, lines, torn = _task_lines(path)
    entries = _read_manifest(man)
    got: dict[tuple[str, str], list[bytes]] = {}
    runner: set[tuple[str, str]] = set()
    for k, ln, is_runner in lines:
        if k is not None:
            got.setdefault(k, []).append(ln)
            if is_runner:
                runner.add(k)
    done: set[tuple[str, int]] = set()
    ok: set[tuple[str, str]] = set()
    for k in list(got) + [k for k in entries if k not in got]:
        rows = got.get(k, [])
        label = f"{k[0]} seed={k[1]}"
        if k not in entries:
            if k in runner:
                notes.append(f"{label}: its rows are not recorded in {MANIFEST}; re-running it")
            continue
        n, sha = entries[k]
        seed = _as_seed(k[1])
        if len(rows) == n and hashlib.sha256(b"".join(rows)).hexdigest() == sha:
            if k in runner and seed is not None:  # else: a task that never finished
                ok.add(k)
                done.add((k[0], seed))
        elif rows:
            why = "missing" if len(rows) < n else "duplicated" if len(rows) > n else "changed"
            notes.append(
                f"{label}: {len(rows)} rows in results.csv where {MANIFEST} records {n} "
                f"(rows {why}); dropped, re-running it"
            )
    bad = sum(k is None for k, _, _ in lines)
    if bad:
        notes.append(f"results.csv: {bad} unreadable line(s) dropped")
    kept = [ln for k, ln, _ in lines if k in ok]
    if torn or len(kept) != len(lines):
        write_atomic(path, header + b"".join(kept))
    records = [
        json.dumps({"cell_id": k[0], "seed": _seed_field(k[1]), "rows": n, "sha256": sha})
        for k, (n, sha) in entries.items()
        if k in ok
    ]
    write_atomic(man, "".join(r + "\n" for r in records))
    return done, notes


def _recorded_schema(run_dir: Path) -> int:
    """``results_schema`` of ``run_dir/run.json`` (1 where it records none or cannot be read)."""
    try:
        meta = read_json(run_dir / "run.json") if not_a_file(run_dir / "run.json") is None else {}
        schema = meta.get("results_schema", 1) if isinstance(meta, dict) else 1
        return schema if isinstance(schema, int) and not isinstance(schema, bool) else 1
    except (OSError, ValueError):
        return 1


def _check_legacy(run_dir: Path, path: Path, man: Path) -> tuple[set[tuple[str, int]], list[str]]:
    """A run directory without a manifest: finished = has its runner row (as before); tasks
    with rows of repeated keys run again. Then a manifest of the kept tasks is written."""
    df = load_results(run_dir, check_keys=False)
    done = finished_tasks(df)
    notes = []
    dup = df[df.duplicated(JOIN_KEYS, keep=False)]
    for c, s in sorted({(str(c), int(s)) for c, s in zip(dup["cell_id"], dup["seed"])}):
        if (c, s) in done:
            done.discard((c, s))
            notes.append(f"{c} seed={s}: rows duplicated in results.csv; dropped, re-running it")
    keep = [(c, int(s)) in done for c, s in zip(df["cell_id"], df["seed"])]
    kept = df[keep]
    if len(kept) != len(df) or not path.read_bytes().endswith(b"\n"):
        rows = kept.astype(object).where(kept.notna(), None).to_dict("records")
        write_atomic(path, encode_rows(rows, header=True))
    _, lines, _ = _task_lines(path)
    got: dict[tuple[str, str], list[bytes]] = {}
    for k, ln, _ in lines:
        if k is not None:
            got.setdefault(k, []).append(ln)
    records = []
    for k, rows in got.items():
        seed = _as_seed(k[1])
        if seed is not None and (k[0], seed) in done:
            data = b"".join(rows)
            records.append(json.dumps(manifest_entry(k[0], seed, data)))
    write_atomic(man, "".join(r + "\n" for r in records))
    return done, notes


def task_status(df: Any) -> Any:
    """One row per (cell_id, seed): status, wall time and note from the runner rows."""
    r = df[df["analysis"] == RUNNER]
    return r[["cell_id", "seed", "status", "value", "note"]].rename(columns={"value": "wall_time"})


#: units of timing metrics: noisy, so ``compare`` judges them only with ``timing=True`` and then
#: per cell by :func:`timing_change` (enough samples, a significant shift, beyond the factor)
