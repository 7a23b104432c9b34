"""Outcome checks of the reproduction suites: did the expected behaviour hold?

A checker reads a run's results DataFrame (``results.csv``) and returns one row per expected
behaviour: ``suite, check, cell_id, held, value, expected, detail``, where ``held`` is ``yes``,
``no``, ``n/a`` (nothing measured to decide) or ``info`` (reported, no expectation). Checkers are
registered per suite name in :data:`OUTCOMES`; :func:`summarize` runs the one of a run's suite
and writes ``summary.csv`` into the run directory. The built-in checkers live in this package's
modules (``pcdeq``, ``mondeq``, ...), imported on first use; a new module here registers itself.

Example:
    >>> from deqbench.outcomes import summarize
    >>> summary = summarize("results/pcdeq/<run_id>")          # doctest: +SKIP
    >>> summary[["check", "held", "detail"]]                    # doctest: +SKIP

Registering a checker for another suite (plain function, no other contract)::

    from deqbench.outcomes import OUTCOMES, outcome
    def check_my_suite(df):
        return pandas.DataFrame([outcome("accuracy >= 0.9", acc >= 0.9, acc, ">= 0.9")])
    OUTCOMES["my_suite"] = check_my_suite
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

COLUMNS = ["suite", "check", "cell_id", "held", "value", "expected", "detail"]

#: suite name -> fn(results DataFrame) -> DataFrame of outcome rows (see :func:`outcome`)
OUTCOMES: dict[str, Callable[[Any], Any]] = {}


def register(*suite_names: str) -> Callable[[Callable[[Any], Any]], Callable[[Any], Any]]:
    """Decorator: ``OUTCOMES[name] = fn`` for each suite name."""

    def deco(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        for n in suite_names:
            OUTCOMES[n] = fn
        return fn

    return deco


def outcome(
    check: str,
    held: bool | str | None,
    value: float = math.nan,
    expected: str = "",
    detail: str = "",
    cell_id: str = "",
) -> dict[str, Any]:
    """One outcome row. ``held``: True/False -> yes/no; None -> n/a; a string is kept."""
    if held is None:
        h = "n/a"
    elif isinstance(held, str):
        h = held
    else:
        h = "yes" if held else "no"
    return {
        "check": check,
        "cell_id": cell_id,
        "held": h,
        "value": float(value),
        "expected": expected,
        "detail": detail,
    }


def suite_name(run_dir: str | Path) -> str:
    """The suite a run came from: run.json ``suite``, else suite.yaml ``name``, else the parent
    folder name (``results/<suite>/<run_id>``)."""
    run_dir = Path(run_dir)
    meta = run_dir / "run.json"
    if meta.exists():
        try:
            name = json.loads(meta.read_text()).get("suite")
            if name:
                return str(name)
        except (OSError, ValueError):
            pass
    sy = run_dir / "suite.yaml"
    if sy.exists():
        import yaml

        try:
            name = (yaml.safe_load(sy.read_text()) or {}).get("name")
            if name:
                return str(name)
        except (OSError, yaml.YAMLError):
            pass
    return run_dir.parent.name


def check(df: Any, suite: str) -> Any:
    """Run the checker of ``suite`` on a results DataFrame; empty frame if none is registered."""
    import pandas as pd

    load_builtin()
    fn = OUTCOMES.get(suite)
    if fn is None:
        return pd.DataFrame(columns=COLUMNS)
    out = fn(df)
    out = pd.DataFrame(out) if not isinstance(out, pd.DataFrame) else out.copy()
    out.insert(0, "suite", suite)
    for c in COLUMNS:
        if c not in out:
            out[c] = "" if c not in ("value",) else math.nan
    return out[COLUMNS]


def summarize(run_dir: str | Path, suite: str | None = None, write: bool = True) -> Any:
    """Outcome rows of a finished run; writes ``RUN_DIR/summary.csv`` when a checker exists.

    Args:
        run_dir: the run directory (with results.csv).
        suite: the checker to use (default: the run's suite, see :func:`suite_name`).
        write: write ``summary.csv``.
    """
    import pandas as pd

    run_dir = Path(run_dir)
    try:
        from ..run.results import load_results

        df = load_results(run_dir)
    except Exception:  # results module absent or a partial file: read the CSV directly
        df = pd.read_csv(run_dir / "results.csv")
    name = suite or suite_name(run_dir)
    out = check(df, name)
    if write and not out.empty:
        tmp = run_dir / ".summary.csv.tmp"
        out.to_csv(tmp, index=False)
        tmp.replace(run_dir / "summary.csv")
    return out


_LOADED = False


def load_builtin() -> None:
    """Import every module of this package once (each registers its checkers)."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    import importlib
    import pkgutil

    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")


# -- helpers for checkers ----------------------------------------------------------------------------------


def rows_of(df: Any, analysis: str) -> Any:
    d = df[(df["analysis"] == analysis) & (df["status"] == "ok")]
    return d.assign(variant=d["variant"].fillna("").astype(str))


def curve(d: Any, cell: str, metric: str, variant: str = "") -> Any:
    """Per-epoch median over seeds of ``metric``/``variant`` of one cell (a Series by epoch)."""
    g = d[(d["cell_id"] == cell) & (d["metric"] == metric) & (d["variant"] == variant)]
    g = g[g["step"].notna()]
    return g.groupby(g["step"].astype(int))["value"].median().sort_index()


def spearman(a: Any, b: Any) -> float:
    j = a.to_frame("a").join(b.to_frame("b"), how="inner").dropna()
    if len(j) < 3 or j["a"].nunique() < 2 or j["b"].nunique() < 2:
        return math.nan
    return float(j["a"].rank().corr(j["b"].rank()))


def task_status(df: Any, cell: str) -> tuple[bool, str]:
    r = df[(df["cell_id"] == cell) & (df["analysis"] == "runner") & (df["metric"] == "wall_time")]
    bad = r[r["status"] != "ok"]
    if bad.empty:
        return True, ""
    first = bad.iloc[0]
    return False, f"seed {first['seed']}: {first['status']} {first['note']}"


def final(series: Any) -> float:
    return float(series.iloc[-1]) if len(series) else math.nan


def fmt_curve(series: Any) -> str:
    if not len(series):
        return "none"
    return f"{series.iloc[0]:.3g} (epoch {series.index[0]}) -> {series.iloc[-1]:.3g} (epoch {series.index[-1]})"
