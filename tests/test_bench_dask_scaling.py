"""benchmarks/dask_scaling.py: the row comparison that decides "same results" (no timing)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pandas as pd

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "dask_scaling.py"
COLS = ["run_id", "cell_id", "model", "solver", "init", "seed", "analysis", "variant", "metric",
        "step", "repeat", "value", "unit", "status", "note"]  # fmt: skip


def _module():
    spec = importlib.util.spec_from_file_location("dask_scaling", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(tmp: Path, name: str, rows: list[tuple]) -> str:
    d = tmp / name
    d.mkdir()
    recs = [
        ["r", cell, "m", "s", "i", seed, "metrics", "test", metric, 0, 0, value, unit, "ok", ""]
        for cell, seed, metric, value, unit in rows
    ]
    pd.DataFrame(recs, columns=COLS).to_csv(d / "results.csv", index=False)
    return str(d)


def test_compare_ignores_timings_flags_value_and_key_differences(tmp_path):
    ds = _module()
    base = [("a", 0, "loss", 1.0, ""), ("a", 0, "wall", 3.0, "s"), ("b", 0, "loss", math.nan, "")]
    a = _run(tmp_path, "a", base)
    same = _run(
        tmp_path, "same", [(c, s, m, v * (2 if u == "s" else 1), u) for c, s, m, v, u in base]
    )
    r = ds.compare(a, same, rtol=1e-4)
    assert r["rows"] == 2 and r["rows_over_rtol"] == 0 and r["max_rel_diff"] == 0.0  # NaN == NaN

    off = _run(tmp_path, "off", [("a", 0, "loss", 1.001, ""), ("b", 0, "loss", math.nan, "")])
    r = ds.compare(a, off, rtol=1e-4)
    assert r["rows_over_rtol"] == 1 and abs(r["max_rel_diff"] - 0.001 / 1.001) < 1e-12
    assert r["worst_row"][0] == "a"

    nan_vs_value = _run(tmp_path, "nv", [("a", 0, "loss", 1.0, ""), ("b", 0, "loss", 2.0, "")])
    assert ds.compare(a, nan_vs_value, rtol=1e-4)["rows_over_rtol"] == 1

    missing = _run(tmp_path, "missing", [("a", 0, "loss", 1.0, "")])
    r = ds.compare(a, missing, rtol=1e-4)
    assert r["only_in_first"] == 1 and r["only_in_second"] == 0
