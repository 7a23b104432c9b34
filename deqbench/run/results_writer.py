"""The ``results.csv`` schema (:data:`COLUMNS`, statuses, join keys) and its crash-safe writer:
atomic file writes, ``manifest.jsonl`` entries, :class:`ResultsWriter` (one ``write`` + ``fsync``
per finished task) and the run directory it writes into (:func:`new_run_dir`).
"""

from __future__ import annotations

import csv
import errno
import hashlib
import io
import json
import math
import os
import shutil
import stat
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
