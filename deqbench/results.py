"""Results on disk: the ``results.csv`` schema, a crash-safe writer, the loader, compare.

``results.csv`` is tidy long format, one row per measured scalar, columns :data:`COLUMNS`.
Each finished (cell, seed) task is appended with a single ``write`` + ``fsync`` and ends with the
runner's status row (analysis ``runner``, metric ``wall_time``), so a ``kill -9`` at any moment
leaves a readable file that holds every finished task completely; :func:`finished_tasks` reads
those markers for ``--resume``.

Example:
    >>> import deqbench
    >>> df = deqbench.load_results("results/smoke/20250101-120000")   # doctest: +SKIP
    >>> df[df.metric == "forward_nstep"].groupby("solver").value.median()   # doctest: +SKIP
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

COLUMNS = [
    "run_id",
    "cell_id",
    "model",
    "solver",
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
    with open(tmp, "wb") as fh:
        fh.write(data.encode("utf-8") if isinstance(data, str) else data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def write_json(path: Path, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=2, default=str) + "\n")


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


class ResultsWriter:
    """Appends rows to ``results.csv``; one ``os.write`` + ``fsync`` per call."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / "results.csv"
        if not self.path.exists():
            write_atomic(self.path, encode_rows([], header=True))

    def append(self, rows: Iterable[dict[str, Any]]) -> None:
        data = encode_rows(rows)
        if not data:
            return
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)


def new_run_dir(output: str | Path, suite: str) -> Path:
    """``output/<suite>/<YYYYmmdd-HHMMSS>[-N]``, created."""
    base = Path(output) / suite
    base.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for i in range(1000):
        d = base / (stamp if i == 0 else f"{stamp}-{i}")
        try:
            d.mkdir()
            return d
        except FileExistsError:
            continue
    raise RuntimeError(f"cannot create a run directory under {base}")


def _csv_path(run: str | Path) -> Path:
    p = Path(run)
    return p if p.suffix == ".csv" else p / "results.csv"


def load_results(run: str | Path) -> Any:
    """The run's ``results.csv`` as a pandas DataFrame (``value`` float, ``step`` nullable int,
    text columns ``""`` where empty). A partial last line (crash mid-write) is ignored.

    Args:
        run: a run directory or a ``results.csv`` path.
    """
    import pandas as pd

    from .errors import ConfigError

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
    df["value"] = pd.to_numeric(df["value"], errors="coerce").astype(float)
    for c in ("step", "seed", "repeat"):
        df[c] = pd.to_numeric(df[c], errors="coerce").astype("Int64")
    return df[COLUMNS]


def finished_tasks(df: Any) -> set[tuple[str, int]]:
    """(cell_id, seed) pairs whose runner status row is present."""
    done = df[df["analysis"] == RUNNER]
    return {(str(c), int(s)) for c, s in zip(done["cell_id"], done["seed"])}


def drop_unfinished(run_dir: str | Path) -> set[tuple[str, int]]:
    """Rewrite ``results.csv`` without rows of unfinished tasks; return the finished tasks."""
    path = _csv_path(run_dir)
    if not path.exists():
        return set()
    df = load_results(run_dir)
    done = finished_tasks(df)
    keep = [(c, int(s)) in done for c, s in zip(df["cell_id"], df["seed"])]
    kept = df[keep]
    if len(kept) != len(df) or not path.read_text().endswith("\n"):
        rows = kept.astype(object).where(kept.notna(), None).to_dict("records")
        write_atomic(path, encode_rows(rows, header=True))
    return done


def task_status(df: Any) -> Any:
    """One row per (cell_id, seed): status, wall time and note from the runner rows."""
    r = df[df["analysis"] == RUNNER]
    return r[["cell_id", "seed", "status", "value", "note"]].rename(columns={"value": "wall_time"})


def compare(a: Any, b: Any, factor: float = 1.1) -> tuple[Any, Any]:
    """Join two runs on :data:`JOIN_KEYS`; per (analysis, metric, variant) the median ratio b/a.

    Rows that are ``ok`` or ``flagged`` take part (a flagged measurement is still a number, shown
    as such); failed rows (error, nan, ...) do not.

    Returns:
        (summary, joined): ``summary`` has columns analysis, metric, variant, n, median_a,
        median_b, ratio, changed (ratio beyond ``factor`` either way), flagged (joined rows
        flagged in A or B); ``joined`` is the row-level join with ``value_a``, ``value_b``,
        ``status_a``, ``status_b`` and ``ratio``.
    """
    import numpy as np
    import pandas as pd

    cols = [*JOIN_KEYS, "value", "status"]
    kept = ["ok", FLAGGED]
    ja = a[a["status"].isin(kept)][cols]
    jb = b[b["status"].isin(kept)][cols]
    for d in (ja, jb):
        d["step"] = d["step"].astype("Int64").astype(str)
    joined = ja.merge(jb, on=JOIN_KEYS, suffixes=("_a", "_b"))
    va, vb = joined["value_a"].to_numpy(float), joined["value_b"].to_numpy(float)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where((va == 0) & (vb == 0), 1.0, vb / va)
    joined["ratio"] = ratio
    rows = []
    for (an, metric, variant), g in joined.groupby(["analysis", "metric", "variant"], sort=True):
        r = g["ratio"].replace([np.inf, -np.inf], np.nan).dropna()
        med = float(r.median()) if len(r) else math.nan
        changed = bool(len(r)) and (med > factor or med < 1.0 / factor)
        rows.append(
            {
                "analysis": an,
                "metric": metric,
                "variant": variant,
                "n": len(g),
                "median_a": float(g["value_a"].median()),
                "median_b": float(g["value_b"].median()),
                "ratio": med,
                "changed": changed,
                "flagged": int(((g["status_a"] == FLAGGED) | (g["status_b"] == FLAGGED)).sum()),
            }
        )
    columns = ["analysis", "metric", "variant", "n", "median_a", "median_b", "ratio", "changed"]
    return pd.DataFrame(rows, columns=[*columns, "flagged"]), joined
