"""results.csv: exact columns, full precision, crash safety, resume bookkeeping, compare."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from deqbench.errors import ConfigError
from deqbench.run.results import (
    COLUMNS,
    RUNNER,
    ResultsWriter,
    compare,
    drop_unfinished,
    finished_tasks,
    load_results,
    new_run_dir,
)


def _row(cell="c", seed=0, metric="m", value=1.0, analysis="a", step=None, status="ok", note=""):
    return {
        "run_id": "r",
        "cell_id": cell,
        "model": "fc",
        "solver": "fp",
        "init": "default",
        "seed": seed,
        "analysis": analysis,
        "variant": "",
        "metric": metric,
        "step": step,
        "repeat": 0,
        "value": value,
        "unit": "",
        "status": status,
        "note": note,
    }


def _done(cell="c", seed=0, status="ok"):
    return _row(cell, seed, "wall_time", 0.5, RUNNER, status=status)


def test_writer_columns_precision_and_missing_values(tmp_path):
    w = ResultsWriter(tmp_path)
    x = 1 / 3
    w.append(
        [_row(value=x, step=2, note='a, "quoted"\nnote'), _row(metric="n", value=math.nan), _done()]
    )
    text = (tmp_path / "results.csv").read_text()
    assert text.splitlines()[0] == ",".join(COLUMNS)
    assert "0.3333333333333333" in text and "-1" not in text
    df = load_results(tmp_path)
    assert list(df.columns) == COLUMNS and len(df) == 3
    assert df.value[0] == x and math.isnan(df.value[1])
    assert df.step[0] == 2 and pd.isna(df.step[1])
    assert df.note[0] == 'a, "quoted" note' and df.note[1] == "" and df.variant[0] == ""
    assert finished_tasks(df) == {("c", 0)}


def test_partial_last_line_is_ignored_and_unfinished_tasks_dropped(tmp_path):
    w = ResultsWriter(tmp_path)
    w.append([_row("a"), _done("a")])
    w.append([_row("b", 1)])  # task b/1 never finished
    with open(tmp_path / "results.csv", "a") as fh:
        fh.write("r,b,fc,fp,default,1,a,,m,,0,0.12")  # a write cut by kill -9
    df = load_results(tmp_path)
    assert len(df) == 3
    assert drop_unfinished(tmp_path) == {("a", 0)}
    df = load_results(tmp_path)
    assert list(df.cell_id) == ["a", "a"]
    assert (tmp_path / "results.csv").read_text().endswith("\n")


def test_load_results_errors_and_run_dirs(tmp_path):
    with pytest.raises(ConfigError, match="not a run directory"):
        load_results(tmp_path / "missing")
    a = new_run_dir(tmp_path, "s")
    b = new_run_dir(tmp_path, "s")
    assert a != b and a.parent == b.parent == tmp_path / "s"


def test_compare_median_ratio_and_flags():
    base = [
        _row("c", s, m, v, step=1)
        for s in (0, 1)
        for m, v in (("acc", 0.5), ("nstep", 10.0), ("z", 0.0))
    ]
    a = pd.DataFrame(base)
    b = a.copy()
    b.loc[b.metric == "nstep", "value"] = [12.0, 13.0]
    b.loc[b.metric == "acc", "value"] = [0.52, 0.5]
    summary, joined = compare(a, b, factor=1.1)
    s = summary.set_index("metric")
    assert s.loc["nstep", "ratio"] == pytest.approx(1.25) and s.loc["nstep", "changed"]
    # a deterministic metric is changed where any row differs beyond rtol, whatever the median
    assert s.loc["acc", "ratio"] == pytest.approx(1.02) and s.loc["acc", "changed"]
    assert (
        s.loc["acc", "cells_changed"] == 1 and s.loc["acc", "check"] == "in 1/1 cells (rtol 1e-06)"
    )
    assert s.loc["z", "ratio"] == 1.0 and s.loc["z", "n"] == 2 and not s.loc["z", "changed"]
    assert len(joined) == 6
    summary, _ = compare(a, b, factor=1.5)  # the factor is for timings only
    assert summary.changed.sum() == 2
    summary, _ = compare(a, b, rtol=0.25)  # 12 and 13 vs 10: within 25% of the larger
    assert not summary.changed.any()
