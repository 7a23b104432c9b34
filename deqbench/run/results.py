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
    A run of results schema 1 (no ``backward`` column) gets ``backward`` from the cells of the
    run directory's ``suite.yaml``, else ``""``.

    Args:
        run: a run directory or a ``results.csv`` path.
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
    return df[COLUMNS]


def _backward_from_id(cell_id: str) -> str:
    """The backward mode named by a cell id's third part (``model-solver-MODE-...``), else ""."""
    from ..core.deq import BACKWARD_MODES

    parts = str(cell_id).split("-")
    return parts[2] if len(parts) > 2 and parts[2] in BACKWARD_MODES else ""


def _backward_by_cell(suite_yaml: Path) -> dict[str, str]:
    """cell id -> backward mode name, expanded from a run's resolved ``suite.yaml`` (for runs
    written before the ``backward`` column); ``{}`` when it is missing or no longer expands
    (e.g. a plugin model that is not installed)."""
    if not suite_yaml.exists():
        return {}
    try:
        import yaml

        from .. import models
        from .matrix import SECTIONS, expand, normalize_section
        from .specs import default_names, generic_fields, runtime_defaults

        raw = yaml.safe_load(suite_yaml.read_text(encoding="utf-8")) or {}
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

        drafts = expand(
            base,
            raw.get("matrix"),
            {},
            generic_fields(),
            default_names(),
            declared=declared,
            suffix_defaults={"runtime": runtime_defaults()},
        )
        return {d.id: str(d.sections.get("backward", {}).get("name", "")) for d in drafts}
    except Exception:
        return {}


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


#: units of timing metrics: noisy, so ``compare`` checks them only with ``timing=True`` and then
#: only where the two runs' IQRs over repeats/seeds do not overlap
TIMING_UNITS = ("s", "ms")


def is_timing(unit: Any) -> bool:
    """A time (``s``, ``ms``) or a rate per second (``samples/s``)."""
    u = "" if unit is None else str(unit)
    return u in TIMING_UNITS or u.endswith("/s")


def compare(
    a: Any, b: Any, factor: float = 1.1, *, timing: bool = False, min_samples: int = 3
) -> tuple[Any, Any]:
    """Join two runs on :data:`JOIN_KEYS`; per (analysis, metric, variant) the median over the
    matched pairs of the ratio b/a.

    Rows that are ``ok`` or ``flagged`` take part (a flagged measurement is still a number, shown
    as such); failed rows (error, nan, ...) do not. Rows without a partner in the other run (a
    step, cell, seed or repeat only one run has) are counted per metric, never silently dropped.

    A metric is ``changed`` when its ratio is beyond ``factor`` either way, except timing metrics
    (:func:`is_timing`): never ``changed`` unless ``timing``, and then only where, in more than
    half of the (cell, step) series measured at least ``min_samples`` times (seeds x repeats) in
    each run, the two runs' interquartile ranges do not overlap, in the ratio's direction.

    Returns:
        (summary, joined): ``summary`` has columns analysis, metric, variant, unit, n (matched
        pairs), only_a, only_b (rows without a partner), median_a, median_b (over the matched
        pairs), ratio (median of the paired ratios b/a; not median_b / median_a), changed,
        flagged (matched pairs flagged in A or B), timing, check (why a timing metric is or is
        not ``changed``); ``joined`` is the row-level outer join with ``value_a``, ``value_b``,
        ``status_a``, ``status_b``, ``ratio`` and ``side`` (``both``, ``a`` or ``b``).
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
    rows = []
    groups = joined.groupby(["analysis", "metric", "variant"], sort=True, dropna=False)
    for (an, metric, variant), g in groups:
        m = g[g["side"] == "both"]
        r = m["ratio"].replace([np.inf, -np.inf], np.nan).dropna()
        med = float(r.median()) if len(r) else math.nan
        beyond = bool(len(r)) and (med > factor or med < 1.0 / factor)
        unit = next((u for u in g["unit"] if u), "")
        check = ""
        changed = beyond
        if is_timing(unit):
            check, apart = _timing_check(g, med, min_samples)
            changed = timing and beyond and apart
            if not timing:
                check = "timing: not judged (--timing)"
        rows.append(
            {
                "analysis": an,
                "metric": metric,
                "variant": variant,
                "unit": unit,
                "n": len(m),
                "only_a": int((g["side"] == "a").sum()),
                "only_b": int((g["side"] == "b").sum()),
                "median_a": float(m["value_a"].median()) if len(m) else math.nan,
                "median_b": float(m["value_b"].median()) if len(m) else math.nan,
                "ratio": med,
                "changed": changed,
                "flagged": int(((m["status_a"] == FLAGGED) | (m["status_b"] == FLAGGED)).sum()),
                "timing": is_timing(unit),
                "check": check,
            }
        )
    columns = ["analysis", "metric", "variant", "unit", "n", "only_a", "only_b", "median_a"]
    columns += ["median_b", "ratio", "changed", "flagged", "timing", "check"]
    return pd.DataFrame(rows, columns=columns), joined


def _timing_check(g: Any, ratio: float, min_samples: int) -> tuple[str, bool]:
    """Per (cell, step) series of one timing metric: do the IQRs over seeds x repeats of A and B
    lie apart, in the direction of ``ratio``? True where more than half of the judged series do."""
    import numpy as np

    judged = apart = 0
    up = ratio > 1
    for _, s in g.groupby(["cell_id", "step"], sort=False, dropna=False):
        xa, xb = s["value_a"].dropna().to_numpy(float), s["value_b"].dropna().to_numpy(float)
        if len(xa) < min_samples or len(xb) < min_samples:
            continue
        judged += 1
        a25, a75 = np.percentile(xa, [25, 75])
        b25, b75 = np.percentile(xb, [25, 75])
        apart += bool(b25 > a75) if up else bool(b75 < a25)
    if not judged:
        return f"timing: < {min_samples} samples a side", False
    if math.isnan(ratio):
        return "timing: no ratio", False
    word = "apart" if 2 * apart > judged else "overlap"
    return f"timing: IQRs {word} in {apart}/{judged} series", 2 * apart > judged


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
        import yaml

        suite = yaml.safe_load((d / "suite.yaml").read_text(encoding="utf-8")) or {}
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
