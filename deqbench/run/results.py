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
"""

from __future__ import annotations

import csv
import errno
import functools
import hashlib
import io
import json
import math
import os
import re
import shutil
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

COLUMNS = [
    "run_id",
    "cell_id",
    "model",
    "solver",
    "backward",
    "init",
    "seed",
    "analysis",
    "variant",
    "metric",
    "step",
    "repeat",
    "value",
    "unit",
    "status",
    "note",
]
#: ``flagged``: the measurement finished but its own quality checks failed (solves that missed
#: tolerance in more than 1% of the training batches, failed gates, a reference that did not
#: converge, estimates flagged unreliable); never counted as ``ok``, the reason is in ``note``.
FLAGGED = "flagged"
STATUSES = ("ok", FLAGGED, "diverged", "nan", "oom", "error", "skipped")
RUNNER = "runner"  # analysis name of the per-task status row
#: analysis name of the rows ``forward_unconverged_batches`` / ``adjoint_unconverged_batches``
#: (share of training batches whose solve missed tolerance; flagged above 1%)
CONVERGENCE = "convergence"
#: version of the ``results.csv`` columns, recorded in ``run.json`` as ``results_schema``.
#: 1 (no key in run.json): no ``backward`` column; 2: ``backward`` after ``solver``.
#: :func:`load_results` reads both; ``--resume`` continues only runs of this version.
RESULTS_SCHEMA = 2
JOIN_KEYS = ["cell_id", "seed", "analysis", "variant", "metric", "step", "repeat"]


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, float):
        return "" if math.isnan(v) else repr(v)  # repr: full precision, round-trips
    return " ".join(str(v).split()) if isinstance(v, str) else str(v)


def encode_rows(rows: Iterable[dict[str, Any]], header: bool = False) -> bytes:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    if header:
        w.writerow(COLUMNS)
    for r in rows:
        w.writerow([_cell(r.get(c)) for c in COLUMNS])
    return buf.getvalue().encode("utf-8")


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write ``path`` through a temp file + fsync + ``os.replace`` (never half-written)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data.encode("utf-8") if isinstance(data, str) else data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:  # e.g. disk full: no half-written temp file left behind
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_json(path: Path, obj: Any) -> None:
    """``obj`` as indented JSON, atomically (:func:`write_atomic`). On a full disk (no room for
    the temp file) the file is rewritten in place, compact, where that fits in the room it has
    now (its bytes or the blocks it holds; else without the informational ``timelines`` and
    ``executor``): a run that stops on a full disk still records why, not ``running``."""
    try:
        write_atomic(path, json.dumps(obj, indent=2, default=str) + "\n")
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or not _rewrite_in_place(path, obj):
            raise


def _rewrite_in_place(path: Path, obj: Any) -> bool:
    """Overwrite ``path`` with compact JSON of ``obj`` (or of ``obj`` without ``timelines`` and
    ``executor``) where it fits in the space the file holds; False where it does not or the
    write fails."""
    try:
        if not_a_file(path) is not None or not Path(path).exists():
            return False
        st = os.stat(path)
        room = max(st.st_size, getattr(st, "st_blocks", 0) * 512)
        small = {k: v for k, v in obj.items() if k not in ("timelines", "executor")}
        for candidate in (obj, small) if isinstance(obj, dict) else (obj,):
            data = (json.dumps(candidate, default=str, separators=(",", ":")) + "\n").encode()
            if len(data) <= room:
                with open(path, "r+b") as fh:
                    fh.write(data)
                    fh.truncate()
                    fh.flush()
                    os.fsync(fh.fileno())
                return True
    except OSError:
        pass
    return False


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


#: per-task manifest of ``results.csv``, one JSON line per finished task, appended (one
#: ``write`` + ``fsync``) *before* the task's rows:
#: ``{"cell_id": ..., "seed": 0, "rows": 40, "sha256": "<hex of the task's encoded CSV lines>"}``.
#: A torn last line is ignored; a task recorded here but without its rows (the run stopped in
#: between) is simply unfinished. Run directories without it (older deqbench) resume as before.
MANIFEST = "manifest.jsonl"


def _append_bytes(path: Path, data: bytes) -> None:
    """Append ``data`` to ``path`` with ``os.write`` calls and one ``fsync``."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)


def _seed_field(seed: str) -> int | str:
    """A seed as the manifest records it: an int where the CSV text is one."""
    try:
        return int(seed)
    except ValueError:
        return seed


def manifest_entry(cell_id: Any, seed: Any, data: bytes) -> dict[str, Any]:
    """The manifest record of one task whose rows encode (:func:`encode_rows`) to ``data``."""
    return {
        "cell_id": _cell(cell_id),
        "seed": _seed_field(_cell(seed)),
        "rows": data.count(b"\n"),
        "sha256": hashlib.sha256(data).hexdigest(),
    }


def _encode_lines(rows: Iterable[dict[str, Any]]) -> list[tuple[tuple[str, str], bytes]]:
    """((cell_id, seed) as written, encoded line) of each row."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    out = []
    for r in rows:
        buf.seek(0)
        buf.truncate()
        w.writerow([_cell(r.get(c)) for c in COLUMNS])
        out.append(((_cell(r.get("cell_id")), _cell(r.get("seed"))), buf.getvalue().encode()))
    return out


class ResultsWriter:
    """Appends rows to ``results.csv``; one ``os.write`` + ``fsync`` per call. A new
    ``results.csv`` gets an empty :data:`MANIFEST` beside it; where the manifest exists, each
    call first appends the record of every (cell_id, seed) task its rows belong to (their
    count and checksum so far, when a task is appended in several calls)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / "results.csv"
        self.manifest = Path(run_dir) / MANIFEST
        self._tasks: dict[tuple[str, str], tuple[int, Any]] = {}  # rows, sha256 so far
        if not self.path.exists():
            write_atomic(self.path, encode_rows([], header=True))
            if not self.manifest.exists():
                write_atomic(self.manifest, b"")

    def append(self, rows: Iterable[dict[str, Any]]) -> None:
        lines = _encode_lines(rows)
        if not lines:
            return
        if self.manifest.exists():
            for key, line in lines:
                n, h = self._tasks.get(key) or (0, hashlib.sha256())
                h.update(line)
                self._tasks[key] = (n + 1, h)
            records = []
            for key in dict.fromkeys(k for k, _ in lines):
                n, h = self._tasks[key]
                rec = {"cell_id": key[0], "seed": _seed_field(key[1])}
                records.append(json.dumps({**rec, "rows": n, "sha256": h.hexdigest()}) + "\n")
            _append_bytes(self.manifest, "".join(records).encode("utf-8"))
        _append_bytes(self.path, b"".join(line for _, line in lines))


def new_run_dir(
    output: str | Path,
    suite: str,
    files: Callable[[str], Mapping[str, str | bytes]] | None = None,
) -> Path:
    """``output/<suite>/<YYYYmmdd-HHMMSS>[-N]``, created.

    With ``files`` (the run id, i.e. the directory's name -> {file name: contents}, e.g.
    ``run.json`` and ``suite.yaml``) the directory appears with all of them in it: they are
    written (fsynced) into a hidden staging directory ``.new-*`` that is then renamed into
    place, so a crash leaves no run directory or a whole one.
    """
    base = Path(output) / suite_folder(suite)
    base.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    staging = Path(tempfile.mkdtemp(prefix=".new-", dir=base)) if files is not None else None
    try:
        for i in range(1000):
            d = base / (stamp if i == 0 else f"{stamp}-{i}")
            try:
                if staging is None:
                    d.mkdir()
                    return d
                if d.exists():  # a rename would replace an empty directory
                    continue
                assert files is not None
                for name, data in files(d.name).items():
                    write_atomic(staging / name, data)
                os.rename(staging, d)
                staging = None
                _fsync_dir(base)
                return d
            except FileExistsError:
                continue
            except OSError as exc:  # a non-empty directory took the name meanwhile
                if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                    continue
                raise
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    raise RuntimeError(f"cannot create a run directory under {base}")


def suite_folder(suite: str) -> str:
    """``suite`` when it names one folder inside the results folder; else a one-line
    :class:`~deqbench.errors.ConfigError` (``..`` or a path would put the run directory
    outside ``--out``, ``.`` would drop the suite's level)."""
    from ..core.errors import ConfigError

    seps = {os.sep, os.altsep or os.sep, "/"}
    if not suite.strip(".") or any(c in suite for c in seps) or "\0" in suite:
        raise ConfigError(
            f"suite name {suite[:80]!r} is not a folder name of its own: the run directory "
            "would not be OUTPUT/NAME/RUN_ID (use letters, digits, _ . -)"
        )
    return suite


def _fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (where directories can be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. Windows
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


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
    str_cols = [
        "run_id",
        "cell_id",
        "model",
        "solver",
        "backward",
        "init",
        "analysis",
        "variant",
        "metric",
        "unit",
        "status",
        "note",
    ]
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


def not_a_file(path: Path) -> str | None:
    """Why ``path`` cannot be read or written as a file (``is a directory``, ``is a FIFO``,
    ...), or None: a regular file (or a link to one) or nothing there. Checked before opening:
    a FIFO would block the read."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot be read ({exc.strerror or type(exc).__name__})"
    if stat.S_ISREG(mode):
        return None
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"))  # fmt: skip
    return (
        "is " + next((k for test, k in kinds if test(mode)), "not a regular file") + ", not a file"
    )


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
TIMING_UNITS = ("s", "ms")
#: ``compare``'s default tolerance for deterministic metrics: a row is changed where
#: ``|b - a| > ATOL + RTOL * max(|a|, |b|)``. Values are written at full precision (``repr``), so
#: a rerun of the same code on the same machine gives the same numbers; 1e-6 (about 8 float32
#: ulps) only absorbs a reordered float32 sum. ``--rtol`` loosens it (runs of other machines).
RTOL = 1e-6
#: absolute slack beside :data:`RTOL`, for values near 0 (a residual of 0 vs 1e-15)
ATOL = 1e-12
#: significance level of the per-cell timing test (two-sided Mann-Whitney U); a cell is judged
#: only where its sample counts can reach it at all (5 vs 5 samples or more: 2/C(10, 5) < 0.01)
ALPHA = 0.01


def is_timing(unit: Any) -> bool:
    """A time (``s``, ``ms``) or a rate per second (``samples/s``)."""
    u = "" if unit is None else str(unit)
    return u in TIMING_UNITS or u.endswith("/s")


def values_differ(a: Any, b: Any, rtol: float = RTOL, atol: float = ATOL) -> Any:
    """Elementwise: ``|b - a| > atol + rtol * max(|a|, |b|)`` (symmetric in a and b); NaN vs NaN
    and inf vs the same inf are equal, NaN vs a number differs. Returns a bool array."""
    import numpy as np

    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    na, nb = np.isnan(a), np.isnan(b)
    with np.errstate(invalid="ignore", over="ignore"):
        same = (a == b) | (np.abs(b - a) <= atol + rtol * np.maximum(np.abs(a), np.abs(b)))
    return np.where(na | nb, na != nb, ~same)


def _rel_diff(a: Any, b: Any) -> Any:
    """``|b - a| / max(|a|, |b|)`` (0 where equal, inf where one side is NaN): ranks rows."""
    import numpy as np

    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    with np.errstate(invalid="ignore", divide="ignore"):
        r = np.abs(b - a) / np.maximum(np.abs(a), np.abs(b))
    r = np.where((a == b) | (np.isnan(a) & np.isnan(b)), 0.0, r)
    return np.where(np.isnan(r), np.inf, r)


@functools.lru_cache(maxsize=256)
def _u_counts(m: int, n: int) -> tuple[int, ...]:
    """How many of the C(m+n, m) orderings of m + n distinct values give the Mann-Whitney
    statistic U = 0, 1, ..., m*n: the coefficients of the Gaussian binomial coefficient
    [m+n choose m]_q = prod_{i=1..m} (1 - q^(n+i)) / (1 - q^i), in exact integers."""
    p = [1]
    for i in range(1, m + 1):
        up = n + i
        q = p + [0] * up
        for k in range(len(q) - 1, up - 1, -1):  # times (1 - q^up)
            q[k] -= p[k - up]
        for k in range(i, len(q)):  # divided by (1 - q^i): exact, the top i terms end at 0
            q[k] += q[k - i]
        p = q[: len(q) - i]
    return tuple(p)


def min_p_value(m: int, n: int) -> float:
    """The smallest two-sided p the exact Mann-Whitney U test can give for m vs n samples."""
    return min(1.0, 2.0 / math.comb(m + n, m)) if m and n else 1.0


def mann_whitney_p(x: Any, y: Any) -> float:
    """Two-sided p-value of the Mann-Whitney U test (do x and y come from one distribution?):
    exact for up to 60 samples in all without ties; else the normal approximation with the tie
    and continuity corrections. NaN is dropped; 1.0 when a side is empty or all values equal."""
    import numpy as np

    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    x, y = x[~np.isnan(x)], y[~np.isnan(y)]
    m, n = len(x), len(y)
    if not m or not n:
        return 1.0
    u = float((x[:, None] > y[None, :]).sum() + 0.5 * (x[:, None] == y[None, :]).sum())
    pooled = np.concatenate([x, y])
    _, ties = np.unique(pooled, return_counts=True)
    if m + n <= 60 and (ties == 1).all():
        counts = _u_counts(min(m, n), max(m, n))
        k = int(round(u))
        low, high = sum(counts[: k + 1]), sum(counts[k:])
        return min(1.0, 2.0 * min(low, high) / math.comb(m + n, m))
    big = m + n
    var = m * n / 12.0 * ((big + 1) - float((ties**3 - ties).sum()) / (big * (big - 1)))
    if var <= 0:
        return 1.0
    z = max(0.0, abs(u - m * n / 2.0) - 0.5) / math.sqrt(var)
    return math.erfc(z / math.sqrt(2.0))


def timing_change(
    xa: Any, xb: Any, factor: float, *, alpha: float = ALPHA, min_samples: int = 3
) -> tuple[bool | None, float, float]:
    """Per-cell timing rule: (changed, ratio of medians B/A, p). ``changed`` is None where the
    samples cannot decide: fewer than ``min_samples`` a side, or too few for the exact test to
    reach ``alpha`` (:func:`min_p_value`; 5 vs 5 for 0.01). Else True where the ratio of the
    medians is beyond ``factor`` either way *and* the Mann-Whitney U test rejects one
    distribution at ``alpha``: noise between repeats is neither a shift nor beyond the factor."""
    import numpy as np

    xa = np.asarray(xa, dtype=float)
    xb = np.asarray(xb, dtype=float)
    xa, xb = xa[~np.isnan(xa)], xb[~np.isnan(xb)]
    ma = float(np.median(xa)) if len(xa) else math.nan
    mb = float(np.median(xb)) if len(xb) else math.nan
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = 1.0 if ma == mb else float(np.float64(mb) / np.float64(ma))
    if min(len(xa), len(xb)) < min_samples or min_p_value(len(xa), len(xb)) > alpha:
        return None, ratio, math.nan
    p = mann_whitney_p(xa, xb)
    beyond = ratio > factor or ratio < 1.0 / factor
    return bool(beyond and p < alpha), ratio, p


def min_samples_for(alpha: float, min_samples: int = 3) -> int:
    """The fewest samples a side (equal sides) that can show a change at ``alpha``."""
    n = max(1, min_samples)
    while min_p_value(n, n) > alpha:
        n += 1
    return n


CHANGE_COLUMNS = ["kind", "cell_id", "analysis", "metric", "variant", "location", "a", "b", "ratio",
                  "rows", "detail"]  # fmt: skip


def compare(
    a: Any,
    b: Any,
    factor: float = 1.1,
    *,
    timing: bool = False,
    min_samples: int = 3,
    rtol: float = RTOL,
    atol: float = ATOL,
    alpha: float = ALPHA,
) -> tuple[Any, Any]:
    """:func:`compare_cells` without the per-cell list: ``(summary, joined)``."""
    summary, joined, _ = compare_cells(
        a, b, factor, timing=timing, min_samples=min_samples, rtol=rtol, atol=atol, alpha=alpha
    )
    return summary, joined


def compare_cells(
    a: Any,
    b: Any,
    factor: float = 1.1,
    *,
    timing: bool = False,
    min_samples: int = 3,
    rtol: float = RTOL,
    atol: float = ATOL,
    alpha: float = ALPHA,
) -> tuple[Any, Any, Any]:
    """Join two runs on :data:`JOIN_KEYS` and find what changed, per cell and metric.

    Rows that are ``ok`` or ``flagged`` take part (a flagged measurement is still a number);
    failed rows (error, nan, ...) do not. The change rule (``changes``, one row per item):

    * ``value``: a deterministic metric (every unit that is not a timing, :func:`is_timing`:
      iteration counts, converged shares, accuracies, losses, residuals) whose matched rows
      differ beyond ``|b - a| > atol + rtol * max(|a|, |b|)`` in any row of the cell (NaN vs
      NaN equal, NaN vs a number changed); one item per (cell, analysis, metric, variant) with
      the most changed row (``location``: its seed and step), its A, B, B/A and ``rows`` changed.
    * ``timing``: only with ``timing``; per (cell, analysis, metric, variant, step), seeds x
      repeats of each run pooled: :func:`timing_change` (ratio of the medians beyond ``factor``
      and a two-sided Mann-Whitney U test at ``alpha``); series with too few samples are
      counted in the summary's ``check``, never changed.
    * ``status``: a (cell, seed) task in both runs whose runner status differs (ok -> flagged).
    * ``rows``: deterministic rows that only one run has, in a task both ran with the same
      status (another number of epochs, a metric no longer written).

    Cells or tasks only one run has are not changes: see :func:`task_differences`.

    Returns:
        (summary, joined, changes): ``summary`` per (analysis, metric, variant): unit, n
        (matched pairs), only_a, only_b, median_a, median_b (over the matched pairs), ratio
        (median of the paired ratios b/a, for reading; not the change rule), cells (cells
        compared), cells_changed, changed (any cell changed), flagged (matched pairs flagged in
        A or B), timing, check (the rule's verdict in words); ``joined`` the row-level outer
        join with ``value_a``, ``value_b``, ``status_a``, ``status_b``, ``ratio``, ``differs``
        and ``side`` (``both``, ``a`` or ``b``); ``changes`` with :data:`CHANGE_COLUMNS`.
    """
    import numpy as np
    import pandas as pd

    cols = [*JOIN_KEYS, "value", "status", "unit"]
    kept = ["ok", FLAGGED]
    ja = a[a["status"].isin(kept)][cols].copy()
    jb = b[b["status"].isin(kept)][cols].copy()
    for d in (ja, jb):
        d["step"] = d["step"].astype("Int64").astype(str)
    joined = ja.merge(jb, on=JOIN_KEYS, how="outer", suffixes=("_a", "_b"), indicator="side")
    joined["side"] = (
        joined["side"].astype(str).map({"both": "both", "left_only": "a", "right_only": "b"})
    )
    joined["unit"] = joined["unit_a"].where(joined["unit_a"].notna(), joined["unit_b"]).fillna("")
    joined = joined.drop(columns=["unit_a", "unit_b"])
    va, vb = joined["value_a"].to_numpy(float), joined["value_b"].to_numpy(float)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where((va == 0) & (vb == 0), 1.0, vb / va)
    joined["ratio"] = ratio
    timed = joined["unit"].map(is_timing).astype(bool).to_numpy()
    both = (joined["side"] == "both").to_numpy()
    joined["differs"] = both & ~timed & values_differ(va, vb, rtol, atol)

    changes: list[dict[str, Any]] = _status_changes(a, b)
    same_status = _tasks_with_same_status(a, b)
    rows = []
    groups = joined.groupby(["analysis", "metric", "variant"], sort=True, dropna=False)
    for (an, metric, variant), g in groups:
        m = g[g["side"] == "both"]
        r = m["ratio"].replace([np.inf, -np.inf], np.nan).dropna()
        med = float(r.median()) if len(r) else math.nan
        unit = next((u for u in g["unit"] if u), "")
        key = {"analysis": an, "metric": metric, "variant": variant}
        if is_timing(unit):
            found, check = _timing_cells(g, key, factor, timing, alpha, min_samples)
            cells = len({c for c, _ in found}) if timing else 0
            cells_changed = len({c["cell_id"] for _, c in found if c is not None})
            changes += [c for _, c in found if c is not None]
        else:
            found_v = _value_cells(g, key)
            found_r = _row_cells(g, key, same_status)
            changes += found_v + found_r
            cells = int(m["cell_id"].nunique())
            cells_changed = len({c["cell_id"] for c in found_v + found_r})
            check = (
                f"in {cells_changed}/{max(cells, cells_changed)} cells (rtol {rtol:g})"
                if cells_changed
                else ""
            )
        rows.append(
            {
                **key,
                "unit": unit,
                "n": len(m),
                "only_a": int((g["side"] == "a").sum()),
                "only_b": int((g["side"] == "b").sum()),
                "median_a": float(m["value_a"].median()) if len(m) else math.nan,
                "median_b": float(m["value_b"].median()) if len(m) else math.nan,
                "ratio": med,
                "cells": cells,
                "cells_changed": cells_changed,
                "changed": bool(cells_changed),
                "flagged": int(((m["status_a"] == FLAGGED) | (m["status_b"] == FLAGGED)).sum()),
                "timing": is_timing(unit),
                "check": check,
            }
        )
    columns = ["analysis", "metric", "variant", "unit", "n", "only_a", "only_b", "median_a"]
    columns += ["median_b", "ratio", "cells", "cells_changed", "changed", "flagged", "timing"]
    columns += ["check"]
    kinds = {"status": 0, "value": 1, "rows": 2, "timing": 3}
    out = pd.DataFrame(changes, columns=CHANGE_COLUMNS)
    if len(out):
        order = out["kind"].map(kinds)
        out = (
            out.assign(_k=order)
            .sort_values(
                ["cell_id", "_k", "analysis", "metric", "variant", "location"], kind="stable"
            )
            .drop(columns="_k")
            .reset_index(drop=True)
        )
    return pd.DataFrame(rows, columns=columns), joined, out


def _where(seed: Any, step: Any) -> str:
    """``seed=0 step=2`` (the parts that are set) of a joined row."""
    import pandas as pd

    parts = []
    if seed is not None and not pd.isna(seed):
        parts.append(f"seed={int(seed)}")
    if step is not None and str(step) not in ("", "<NA>", "nan"):
        parts.append(f"step={step}")
    return " ".join(parts)


def _value_cells(g: Any, key: dict[str, Any]) -> list[dict[str, Any]]:
    """One ``value`` change per cell of a deterministic metric whose matched rows differ."""
    out = []
    m = g[g["side"] == "both"]
    for cell, c in m.groupby("cell_id", sort=True):
        bad = c[c["differs"]]
        if bad.empty:
            continue
        worst = bad.iloc[int(_rel_diff(bad["value_a"], bad["value_b"]).argmax())]
        va, vb = float(worst["value_a"]), float(worst["value_b"])
        diff = vb - va
        out.append(
            {
                "kind": "value",
                "cell_id": cell,
                **key,
                "location": _where(worst["seed"], worst["step"]),
                "a": va,
                "b": vb,
                "ratio": float(worst["ratio"]),
                "rows": f"{len(bad)}/{len(c)}",
                "detail": f"B-A {diff:+.4g}" if math.isfinite(diff) else "",
            }
        )
    return out


def _row_cells(
    g: Any, key: dict[str, Any], same_status: set[tuple[str, int]]
) -> list[dict[str, Any]]:
    """One ``rows`` change per (cell, seed) where deterministic rows are in only one run, in a
    task both runs finished with one status (else the status change says it)."""
    out: list[dict[str, Any]] = []
    lone = g[g["side"] != "both"]
    if lone.empty:
        return out
    for (cell, seed), c in lone.groupby(["cell_id", "seed"], sort=True, dropna=False):
        if (str(cell), _int(seed)) not in same_status:
            continue
        parts = []
        for side, name in (("a", "A"), ("b", "B")):
            s = c[c["side"] == side]
            if len(s):
                steps = sorted({str(x) for x in s["step"] if str(x) not in ("<NA>", "")})
                at = f" (step {', '.join(steps[:6])}{', ...' if len(steps) > 6 else ''})"
                parts.append(f"{len(s)} row{'s' * (len(s) != 1)} only in {name}"
                             + (at if steps else ""))  # fmt: skip
        out.append(
            {
                "kind": "rows",
                "cell_id": cell,
                **key,
                "location": f"seed={seed}",
                "a": math.nan,
                "b": math.nan,
                "ratio": math.nan,
                "rows": f"{len(c)}",
                "detail": "; ".join(parts),
            }
        )
    return out


def _timing_cells(
    g: Any, key: dict[str, Any], factor: float, timing: bool, alpha: float, min_samples: int
) -> tuple[list[tuple[str, dict[str, Any] | None]], str]:
    """Per (cell, step) series of one timing metric, seeds x repeats of each run pooled:
    :func:`timing_change`. Returns ([(cell, change or None) per judged series], check)."""
    if not timing:
        return [], "timing: not judged (--timing)"
    judged: list[tuple[str, dict[str, Any] | None]] = []
    few = few_beyond = 0
    for (cell, step), s in g.groupby(["cell_id", "step"], sort=True, dropna=False):
        xa, xb = s["value_a"].dropna().to_numpy(float), s["value_b"].dropna().to_numpy(float)
        if not len(xa) or not len(xb):
            continue
        changed, ratio, p = timing_change(xa, xb, factor, alpha=alpha, min_samples=min_samples)
        if changed is None:
            few += 1
            few_beyond += ratio > factor or ratio < 1.0 / factor
            continue
        item = None
        if changed:
            import numpy as np

            item = {
                "kind": "timing",
                "cell_id": cell,
                **key,
                "location": _where(None, step),
                "a": float(np.median(xa)),
                "b": float(np.median(xb)),
                "ratio": ratio,
                "rows": f"{len(xa)} vs {len(xb)}",
                "detail": f"ratio of medians, Mann-Whitney p={p:.2g}",
            }
        judged.append((str(cell), item))
    need = min_samples_for(alpha, min_samples)
    n_changed = sum(c is not None for _, c in judged)
    parts = []
    if judged:
        parts.append(f"changed in {n_changed}/{len(judged)} series")
    if few:
        parts.append(
            f"{few} series with too few samples (< {need} a side), not judged"
            + (f", {few_beyond} of them beyond x{factor:g}" if few_beyond else "")
        )
    return judged, "timing: " + "; ".join(parts or ["nothing to judge"])


def _int(v: Any) -> int:
    """A seed as int (-1 where missing)."""
    try:
        return int(v)
    except (TypeError, ValueError):
        return -1


def _runner_rows(df: Any) -> Any:
    return df[(df["analysis"] == RUNNER) & (df["metric"] == "wall_time")]


def _tasks_with_same_status(a: Any, b: Any) -> set[tuple[str, int]]:
    ra, rb = _runner_rows(a), _runner_rows(b)
    sa = {(str(c), int(s)): st for c, s, st in zip(ra["cell_id"], ra["seed"], ra["status"])}
    sb = {(str(c), int(s)): st for c, s, st in zip(rb["cell_id"], rb["seed"], rb["status"])}
    return {k for k in sa.keys() & sb.keys() if sa[k] == sb[k]}


def _status_changes(a: Any, b: Any) -> list[dict[str, Any]]:
    """A ``status`` change per (cell, seed) task in both runs whose runner status differs."""
    ra, rb = _runner_rows(a), _runner_rows(b)
    sa = {(str(c), int(s)): (st, n) for c, s, st, n in
          zip(ra["cell_id"], ra["seed"], ra["status"], ra["note"])}  # fmt: skip
    sb = {(str(c), int(s)): (st, n) for c, s, st, n in
          zip(rb["cell_id"], rb["seed"], rb["status"], rb["note"])}  # fmt: skip
    out = []
    for k in sorted(sa.keys() & sb.keys()):
        (st_a, note_a), (st_b, note_b) = sa[k], sb[k]
        if st_a == st_b:
            continue
        note = note_b if st_b != "ok" else note_a
        out.append(
            {
                "kind": "status",
                "cell_id": k[0],
                "analysis": RUNNER,
                "metric": "status",
                "variant": "",
                "location": f"seed={k[1]}",
                "a": st_a,
                "b": st_b,
                "ratio": math.nan,
                "rows": "",
                "detail": (note or "")[:160],
            }
        )
    return out


def task_differences(a: Any, b: Any) -> dict[str, Any]:
    """What only one run has: ``cells_a`` / ``cells_b`` (cell ids only in A / only in B, sorted;
    a renamed cell shows on both sides, no mapping is guessed), ``tasks_a`` / ``tasks_b``
    ((cell, seed) finished in one run only, of cells both have) and ``cells`` (the number of
    cells in both)."""
    ca, cb = set(map(str, a["cell_id"])), set(map(str, b["cell_id"]))
    common = ca & cb
    ta = {t for t in finished_tasks(a) if t[0] in common}
    tb = {t for t in finished_tasks(b) if t[0] in common}
    return {
        "cells_a": sorted(ca - cb),
        "cells_b": sorted(cb - ca),
        "tasks_a": sorted(ta - tb),
        "tasks_b": sorted(tb - ta),
        "cells": len(common),
    }


#: ``run.json`` fields the compare header names where the two runs differ: (label, dotted key)
ENV_FIELDS = (
    ("deqbench", "versions.deqbench"),
    ("torch", "versions.torch"),
    ("CUDA", "versions.cuda"),
    ("device", "device"),
    ("device name", "device_name"),
    ("GPUs", "gpus"),
    ("dtype", "dtype"),
    ("threads", "flags.threads"),
    ("TF32 matmul", "flags.tf32_matmul"),
)


def _get(meta: dict[str, Any], dotted: str) -> Any:
    node: Any = meta
    for k in dotted.split("."):
        if not isinstance(node, dict) or k not in node:
            return None
        node = node[k]
    return node


def _commit_text(meta: dict[str, Any]) -> str:
    git = meta.get("git") or {}
    commit = git.get("commit")
    if not commit:
        return "unknown"
    return str(commit)[:10] + (" (dirty)" if git.get("dirty") else "")


def run_environment(meta: dict[str, Any]) -> str:
    """One line about a run from its ``run.json``: commit (dirty), torch, device, dtype, threads
    (the parts it records)."""
    parts = []
    if _get(meta, "git.commit"):
        parts.append(f"commit {_commit_text(meta)}")
    if _get(meta, "versions.torch"):
        parts.append(f"torch {_get(meta, 'versions.torch')}")
    if meta.get("device"):
        name = meta.get("device_name")
        parts.append(f"{meta['device']} ({name})" if name else str(meta["device"]))
    if meta.get("dtype"):
        parts.append(str(meta["dtype"]))
    threads = _get(meta, "flags.threads")
    if threads is not None:
        parts.append(f"{threads} thread{'s' * (threads != 1)}")
    if not meta:
        return "no run.json"
    return ", ".join(parts) or "no environment in run.json"


def environment_differences(meta_a: dict[str, Any], meta_b: dict[str, Any]) -> list[str]:
    """What differs between two runs' ``run.json``: the commit (and dirty tree), versions,
    device, GPU names, dtype, threads; each as ``torch 2.3.0 vs 2.4.0``. A run without
    ``run.json`` gives one line saying so; the same commit with edits on both sides says that
    the edits may differ."""
    if not meta_a or not meta_b:
        missing = " and ".join(s for s, m in (("A", meta_a), ("B", meta_b)) if not m)
        return [f"{missing}: no run.json, environment unknown"]
    out = []
    ga, gb = meta_a.get("git") or {}, meta_b.get("git") or {}
    if ga.get("commit") != gb.get("commit") or ga.get("dirty") != gb.get("dirty"):
        out.append(f"commit {_commit_text(meta_a)} vs {_commit_text(meta_b)}")
    elif ga.get("dirty") and gb.get("dirty"):
        out.append(f"commit {_commit_text(meta_a)} on both sides: uncommitted edits may differ")
    for label, key in ENV_FIELDS:
        va, vb = _get(meta_a, key), _get(meta_b, key)
        if va != vb:
            sa = ", ".join(map(str, va)) if isinstance(va, list) else str(va)
            sb = ", ".join(map(str, vb)) if isinstance(vb, list) else str(vb)
            out.append(f"{label} {sa or '-'} vs {sb or '-'}")
    return out


def _flat(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings -> dotted keys; a list of one-key mappings (``analyses``) by those keys."""
    if isinstance(obj, list) and obj and all(isinstance(x, dict) and len(x) == 1 for x in obj):
        obj = {k: v for x in obj for k, v in x.items()}
    if not isinstance(obj, dict):
        return {prefix: obj}
    out: dict[str, Any] = {}
    for k, v in obj.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _run_meta(run: str | Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(run.json or {}, resolved suite.yaml or None) of a run directory (or of a results.csv's)."""
    d = _csv_path(run).parent
    meta = read_json(d / "run.json") if (d / "run.json").exists() else {}
    suite = None
    if (d / "suite.yaml").exists():
        from .yamlio import read_yaml  # its limits refuse a YAML bomb

        suite = read_yaml(d / "suite.yaml")[0] or {}
    return meta, suite


def suite_differences(suite_a: dict[str, Any], suite_b: dict[str, Any]) -> list[str]:
    """Dotted keys where two resolved suites differ (not ``output``, ``description``), each
    with both values where they are short: ``defaults.train.epochs (2 vs 1)``."""
    fa, fb = _flat(suite_a), _flat(suite_b)
    out = []
    for k in sorted(set(fa) | set(fb)):
        if k.split(".")[0] in ("output", "description") or fa.get(k) == fb.get(k):
            continue
        va = repr(fa[k]) if k in fa else "unset"
        vb = repr(fb[k]) if k in fb else "unset"
        out.append(f"{k} ({va} vs {vb})" if len(va) + len(vb) <= 40 else k)
    return out


def check_comparable(
    run_a: str | Path, run_b: str | Path, a: Any, b: Any, force: bool = False
) -> list[str]:
    """Refuse (ConfigError) runs of differently named suites or without a common cell unless
    ``force``; return warning lines (at most one): the suite settings that differ where the two
    runs' suite hashes do, or the difference ``force`` overrode."""
    from ..core.errors import ConfigError

    (ma, sa), (mb, sb) = _run_meta(run_a), _run_meta(run_b)
    name_a = ma.get("suite") or (sa or {}).get("name")
    name_b = mb.get("suite") or (sb or {}).get("name")
    refusals = []
    if name_a and name_b and name_a != name_b:
        refusals.append(f"runs of different suites ({name_a!r} vs {name_b!r})")
    cells_a, cells_b = set(a["cell_id"]), set(b["cell_id"])
    if cells_a and cells_b and not cells_a & cells_b:
        refusals.append(
            f"no cell in common (A: {len(cells_a)}, e.g. {min(cells_a)}; "
            f"B: {len(cells_b)}, e.g. {min(cells_b)})"
        )
    if refusals and not force:
        raise ConfigError(
            f"{run_a} vs {run_b}: {'; '.join(refusals)}; --force compares them anyway"
        )
    keys = suite_differences(sa, sb) if sa is not None and sb is not None else []
    ha, hb = ma.get("suite_hash"), mb.get("suite_hash")
    if refusals:
        return ["compared anyway (--force): " + "; ".join(refusals)]
    if (ha and hb and ha != hb) or ((not ha or not hb) and keys):
        what = ", ".join(keys[:8]) + (f" (+{len(keys) - 8} more)" if len(keys) > 8 else "")
        if not keys:
            what = "suite.yaml files agree; the resolved cells differ (another deqbench version?)"
        hashes = f" (suite hash {ha} vs {hb})" if ha and hb else ""
        return [f"B ran the suite with other settings than A{hashes}: {what}"]
    return []


def match_counts(a: Any, b: Any, joined: Any) -> dict[str, dict[str, int]]:
    """Per side: rows ``compared`` (ok or flagged), ``matched`` (with a partner in the other run),
    ``unmatched``, ``skipped`` (analyses that do not apply) and ``failed`` (error, nan, oom,
    diverged rows), neither compared."""
    out = {}
    for side, df in (("a", a), ("b", b)):
        compared = int(df["status"].isin(["ok", FLAGGED]).sum())
        matched = int((joined["side"] == "both").sum())
        out[side] = {
            "compared": compared,
            "matched": matched,
            "unmatched": int((joined["side"] == side).sum()),
            "skipped": int((df["status"] == "skipped").sum()),
            "failed": len(df) - compared - int((df["status"] == "skipped").sum()),
        }
    return out
