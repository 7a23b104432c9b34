"""``deqbench compare``: refusals (other suite, no common cell) and ``--force``, one warning for
other settings, matched/unmatched counts, a CSV only with ``--csv``, the timing noise rule.

Run directories are written by hand (results.csv, run.json, suite.yaml): no training."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import yaml
from typer.testing import CliRunner

from deqbench.cli import app
from deqbench.run.results import compare, encode_rows, load_results, write_atomic, write_json

SUITE = {
    "schema": 1,
    "name": "tiny",
    "description": "",
    "device": "cpu",
    "seeds": [0],
    "defaults": {"model": {"name": "fc_deq_tiny", "width": 8}, "train": {"epochs": 1}},
    "matrix": {"backward": ["ift"]},
    "analyses": [{"metrics": {}}],
    "output": "results",
}


def _row(cell="c1", seed=0, metric="loss", value=1.0, analysis="metrics", step=0, repeat=0,
         unit="", status="ok"):  # fmt: skip
    return {"run_id": "r", "cell_id": cell, "model": "fc", "solver": "fp", "init": "default",
            "seed": seed, "analysis": analysis, "variant": "train", "metric": metric,
            "step": step, "repeat": repeat, "value": value, "unit": unit, "status": status,
            "note": ""}  # fmt: skip


def _run(d: Path, rows, name="tiny", suite_hash="h1", **suite_changes) -> Path:
    d.mkdir(parents=True)
    write_atomic(d / "results.csv", encode_rows(rows, header=True))
    write_json(d / "run.json", {"run_id": d.name, "suite": name, "suite_hash": suite_hash})
    suite = yaml.safe_load(yaml.safe_dump(SUITE))
    suite["name"] = name
    for dotted, v in suite_changes.items():
        *path, last = dotted.split("__")
        node = suite
        for k in path:
            node = node[k]
        node[last] = v
    (d / "suite.yaml").write_text(yaml.safe_dump(suite, sort_keys=False))
    return d


def _rows(cells=("c1",), steps=(0,), loss=1.0, seeds=(0,)):
    return [
        _row(cell=c, seed=s, step=k, value=loss) for c in cells for s in seeds for k in steps
    ] + [
        _row(cell=c, seed=s, analysis="runner", metric="wall_time", step=None, value=1.0, unit="s")
        for c in cells
        for s in seeds
    ]


def invoke(*args):
    r = CliRunner().invoke(app, [str(a) for a in args])
    return r, r.stdout, r.stderr


def test_refuses_runs_of_different_suites_unless_forced(tmp_path):
    a = _run(tmp_path / "a", _rows())
    b = _run(tmp_path / "b", _rows(), name="other", suite_hash="h2")
    r, out, err = invoke("compare", a, b)
    assert r.exit_code == 2, r.output
    assert "different suites ('tiny' vs 'other')" in err and "--force" in err
    r, out, err = invoke("compare", a, b, "--force")
    assert r.exit_code == 0, r.output
    warnings = [ln for ln in err.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and "'tiny' vs 'other'" in warnings[0], err
    assert "loss" in out


def test_refuses_runs_without_a_common_cell(tmp_path):
    a = _run(tmp_path / "a", _rows(cells=("c1",)))
    b = _run(tmp_path / "b", _rows(cells=("c2",)))
    r, _, err = invoke("compare", a, b)
    assert r.exit_code == 2 and "no cell in common" in err and "c1" in err and "c2" in err, err
    r, _, err = invoke("compare", a, b, "--force")  # forced, but still nothing to pair
    assert r.exit_code == 2 and "share no" in err, err


def test_other_settings_give_one_warning_naming_the_keys(tmp_path):
    a = _run(tmp_path / "a", _rows())
    b = _run(
        tmp_path / "b", _rows(), suite_hash="h2", defaults__train__epochs=2, output="elsewhere"
    )
    r, _, err = invoke("compare", a, b)
    assert r.exit_code == 0, r.output
    warnings = [ln for ln in err.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1, err
    assert "defaults.train.epochs (1 vs 2)" in warnings[0] and "output" not in warnings[0]
    # the same hash (wording, output folder): no warning
    c = _run(tmp_path / "c", _rows(), output="elsewhere")
    r, _, err = invoke("compare", a, c)
    assert r.exit_code == 0 and "warning" not in err, err


def test_unmatched_rows_are_counted_per_side_and_metric(tmp_path):
    a = _run(tmp_path / "a", _rows(steps=(0,)))
    b = _run(tmp_path / "b", _rows(steps=(0, 1)))  # 2 epochs vs 1
    summary, joined = compare(load_results(a), load_results(b))
    s = summary.set_index("metric")
    assert (s.loc["loss", "n"], s.loc["loss", "only_a"], s.loc["loss", "only_b"]) == (1, 0, 1)
    assert (joined.side == "b").sum() == 1
    r, out, _ = invoke("compare", a, b)
    assert r.exit_code == 0, r.output
    assert "rows: 2 matched pairs; unmatched, left out of the ratios: A 0 of 2, B 1 of 3" in out
    assert "only A" in out and "only B" in out


def test_csv_only_where_asked(tmp_path):
    a = _run(tmp_path / "a", _rows())
    b = _run(tmp_path / "b", _rows(loss=2.0))
    before = sorted(p.name for p in b.iterdir())
    r, out, _ = invoke("compare", a, b)
    assert r.exit_code == 0 and "wrote" not in out
    assert sorted(p.name for p in b.iterdir()) == before
    r, out, _ = invoke("compare", a, b, "--csv", tmp_path / "cmp.csv")
    assert r.exit_code == 0 and f"wrote {tmp_path / 'cmp.csv'}" in out
    cmp = pd.read_csv(tmp_path / "cmp.csv", keep_default_na=False).set_index("metric")
    assert cmp.loc["loss", "ratio"] == 2.0 and bool(cmp.loc["loss", "changed"])
    assert "B/A (median of pairs)" in out  # the ratio column says what it is


def test_timing_noise_needs_timing_and_apart_iqrs(tmp_path):
    # wall_time 0.83 in one sample: noise, not a change, with or without --timing
    a = _run(tmp_path / "a", _rows())
    rows_b = _rows()
    rows_b[-1]["value"] = 0.83
    b = _run(tmp_path / "b", rows_b)
    r, out, _ = invoke("compare", a, b, "--fail-on-change")
    assert r.exit_code == 0, r.output
    assert "timing: not judged" in out
    r, out, _ = invoke("compare", a, b, "--fail-on-change", "--timing")
    assert r.exit_code == 0 and "timing: < 3 samples a side" in out, r.output

    def timed(values):
        return [
            _row(seed=s, analysis="runner", metric="wall_time", step=None, value=v, unit="ms")
            for s, v in enumerate(values)
        ]

    base = timed([1.0, 1.1, 0.9, 1.05, 0.95])
    overlap = timed([0.8, 1.0, 0.7, 1.2, 0.75])  # median ratio ~0.8, IQRs overlap
    apart = timed([0.5, 0.55, 0.45, 0.52, 0.48])  # IQRs apart
    s, _ = compare(_df(base), _df(overlap), timing=True)
    assert s.ratio.item() < 1 / 1.1 and not s.changed.item() and "overlap" in s.check.item()
    s, _ = compare(_df(base), _df(apart), timing=False)
    assert not s.changed.item() and s.timing.item()
    s, _ = compare(_df(base), _df(apart), timing=True)
    assert s.changed.item() and "apart in 1/1" in s.check.item()
    c = _run(tmp_path / "c", base)
    d = _run(tmp_path / "d", apart)
    assert invoke("compare", c, d, "--fail-on-change")[0].exit_code == 0
    r, out, _ = invoke("compare", c, d, "--fail-on-change", "--timing")
    assert r.exit_code == 1 and "CHANGED" in out, r.output


def _df(rows):
    df = pd.DataFrame(rows)
    for c in ("step", "seed", "repeat"):
        df[c] = pd.to_numeric(df[c], errors="coerce").astype("Int64")
    return df


def test_flagged_rows_are_compared_and_shown(tmp_path):
    a = _run(tmp_path / "a", _rows())
    rows_b = _rows()
    rows_b[0]["status"] = "flagged"
    rows_b[1]["status"] = "error"
    b = _run(tmp_path / "b", rows_b)
    r, out, _ = invoke("compare", a, b)
    assert r.exit_code == 0, r.output
    assert "flagged 1/1" in out
    assert "failed, not compared: A 0, B 1" in out


@pytest.mark.parametrize("missing", ["run.json", "suite.yaml"])
def test_runs_without_metadata_still_compare(tmp_path, missing):
    a = _run(tmp_path / "a", _rows())
    b = _run(tmp_path / "b", _rows(), name="other", suite_hash="h2")
    (a / missing).unlink()
    (b / missing).unlink()
    r, _, err = invoke("compare", a, b)
    # the name is still known from the file left
    assert r.exit_code == 2 and "different suites" in err, err
