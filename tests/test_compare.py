"""``deqbench compare``: refusals (other suite, no common cell) and ``--force``, one warning for
other settings, matched/unmatched counts, a CSV only with ``--csv``; the per-cell change rule
(deterministic metrics beyond rtol in any cell, status changes, timings by a Mann-Whitney U test
and the factor), the header of run differences, cells only one run has; the CI reference check
(``compare --reference``, :func:`deqbench.run.reference.check_against_reference`).

Run directories are written by hand (results.csv, run.json, suite.yaml): no training."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import yaml
from typer.testing import CliRunner

from deqbench.cli import app
from deqbench.run.reference import check_against_reference
from deqbench.run.results import (
    compare,
    compare_cells,
    encode_rows,
    load_results,
    mann_whitney_p,
    timing_change,
    values_differ,
    write_atomic,
    write_json,
)

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


def _run(d: Path, rows, name="tiny", suite_hash="h1", meta=None, **suite_changes) -> Path:
    d.mkdir(parents=True)
    write_atomic(d / "results.csv", encode_rows(rows, header=True))
    write_json(
        d / "run.json",
        {"run_id": d.name, "suite": name, "suite_hash": suite_hash, **(meta or {})},
    )
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


def test_timing_noise_needs_timing_and_enough_samples(tmp_path):
    # wall_time 0.83 in one sample: noise, not a change, with or without --timing
    a = _run(tmp_path / "a", _rows())
    rows_b = _rows()
    rows_b[-1]["value"] = 0.83
    b = _run(tmp_path / "b", rows_b)
    r, out, _ = invoke("compare", a, b, "--fail-on-change")
    assert r.exit_code == 0, r.output
    assert "timing: not judged" in out
    r, out, _ = invoke("compare", a, b, "--fail-on-change", "--timing")
    assert r.exit_code == 0 and "too few samples (< 5 a side)" in out, r.output
    assert "1 of them beyond x1.1" in out  # 1 vs 0.83: beyond the factor, but one sample

    def timed(values):
        return [
            _row(seed=s, analysis="runner", metric="wall_time", step=None, value=v, unit="ms")
            for s, v in enumerate(values)
        ]

    base = timed([1.0, 1.1, 0.9, 1.05, 0.95])
    overlap = timed([0.8, 1.0, 0.7, 1.2, 0.75])  # median ratio 0.8, not a significant shift
    apart = timed([0.5, 0.55, 0.45, 0.52, 0.48])  # every sample below: p = 2/252
    s, _ = compare(_df(base), _df(overlap), timing=True)
    assert s.ratio.item() < 1 / 1.1 and not s.changed.item() and "0/1 series" in s.check.item()
    s, _ = compare(_df(base), _df(apart), timing=False)
    assert not s.changed.item() and s.timing.item()
    s, _ = compare(_df(base), _df(apart), timing=True)
    assert s.changed.item() and "changed in 1/1 series" in s.check.item()
    s, _ = compare(_df(base), _df(apart), 2.5, timing=True)  # significant, within the factor
    assert not s.changed.item()
    c = _run(tmp_path / "c", base)
    d = _run(tmp_path / "d", apart)
    assert invoke("compare", c, d, "--fail-on-change")[0].exit_code == 0
    r, out, _ = invoke("compare", c, d, "--fail-on-change", "--timing")
    assert r.exit_code == 1 and "CHANGED" in out and "Mann-Whitney p=0.0079" in out, r.output


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


# --- the per-cell change rule ---------------------------------------------------------------


def _solver_rows(cells=("c1", "c2", "c3"), seeds=(0, 1), steps=(0, 1), nstep=20.0, status="ok"):
    """Per cell and seed: forward_nstep (f-evals), a loss and a runner row."""
    rows = []
    for c in cells:
        for s in seeds:
            for k in steps:
                rows.append(_row(cell=c, seed=s, step=k, analysis="solver_stats",
                                 metric="forward_nstep", value=nstep + k, unit="f-evals"))  # fmt: skip
                rows.append(_row(cell=c, seed=s, step=k, value=2.0 - 0.5 * k))
            rows.append(_row(cell=c, seed=s, analysis="runner", metric="wall_time", step=None,
                             value=1.0 + 0.1 * s, unit="s", status=status))  # fmt: skip
    return rows


def test_a_change_in_one_cell_is_changed_and_fails(tmp_path):
    rows_b = _solver_rows()
    hit = next(r for r in rows_b if r["cell_id"] == "c2" and r["metric"] == "forward_nstep"
               and r["seed"] == 1 and r["step"] == 1)  # fmt: skip
    hit["value"] *= 100
    a, b = _run(tmp_path / "a", _solver_rows()), _run(tmp_path / "b", rows_b)
    summary, _, changes = compare_cells(load_results(a), load_results(b))
    fw = summary.set_index("metric").loc["forward_nstep"]
    assert fw.ratio == 1.0  # the median of the paired ratios hides it ...
    assert fw.changed and fw.cells_changed == 1 and fw.cells == 3  # ... the per-cell rule not
    assert len(changes) == 1, changes
    ch = changes.iloc[0]
    assert (ch.kind, ch.cell_id, ch.metric, ch.location) == (
        "value",
        "c2",
        "forward_nstep",
        "seed=1 step=1",
    )
    assert (ch.a, ch.b, ch.ratio, ch.rows) == (21.0, 2100.0, 100.0, "1/4")
    r, out, _ = invoke("compare", a, b, "--fail-on-change")
    assert r.exit_code == 1, r.output
    lines = [ln for ln in out.splitlines() if "CHANGED" in ln and "forward_nstep" in ln]
    assert any("c2" in ln and "2100" in ln and "100" in ln for ln in lines), out
    assert not any(" c1 " in ln or " c3 " in ln for ln in lines), out
    assert invoke("compare", a, b)[0].exit_code == 0  # listed, but exit 1 only when asked


def test_unchanged_runs_exit_0_and_the_tolerance(tmp_path):
    a = _run(tmp_path / "a", _solver_rows())
    b = _run(tmp_path / "b", _solver_rows())
    r, out, _ = invoke("compare", a, b, "--fail-on-change")
    assert r.exit_code == 0 and "no change" in out and "CHANGED" not in out, r.output
    # rounding in the last digits is within the default rtol 1e-6; 1e-5 relative is not
    rows = _solver_rows()
    for row in rows:
        if row["metric"] == "loss":
            row["value"] *= 1 + 1e-9
    c = _run(tmp_path / "c", rows)
    assert invoke("compare", a, c, "--fail-on-change")[0].exit_code == 0
    rows = _solver_rows()
    rows[1]["value"] *= 1 + 1e-5  # one loss
    d = _run(tmp_path / "d", rows)
    r, out, _ = invoke("compare", a, d, "--fail-on-change")
    assert r.exit_code == 1 and "loss" in out, r.output
    r, out, _ = invoke("compare", a, d, "--fail-on-change", "--rtol", "1e-4")
    assert r.exit_code == 0 and "rtol 0.0001" in out, r.output


def test_values_differ_nan_and_near_zero():
    import numpy as np

    nan = float("nan")
    got = values_differ([nan, nan, 1.0, 0.0, 0.0, 1.0, np.inf], [nan, 1.0, nan, 1e-13, 1e-9,
                                                                 1.0 + 1e-7, np.inf])  # fmt: skip
    assert list(got) == [False, True, True, False, True, False, False]
    assert values_differ(1.0, 1.01, rtol=0.02).item() is False


def test_a_status_change_is_changed(tmp_path):
    rows_b = _solver_rows()
    runner = next(r for r in rows_b if r["analysis"] == "runner" and r["cell_id"] == "c3")
    runner["status"], runner["note"] = "flagged", "forward solve missed tolerance"
    a, b = _run(tmp_path / "a", _solver_rows()), _run(tmp_path / "b", rows_b)
    _, _, changes = compare_cells(load_results(a), load_results(b))
    st = changes[changes.kind == "status"]
    assert len(st) == 1 and (st.cell_id.item(), st.location.item()) == ("c3", "seed=0")
    assert (st.a.item(), st.b.item()) == ("ok", "flagged")
    r, out, _ = invoke("compare", a, b, "--fail-on-change")
    assert r.exit_code == 1 and "flagged" in out and "missed tolerance" in out, r.output


def test_rows_only_in_one_run_of_a_common_task_are_changed(tmp_path):
    a = _run(tmp_path / "a", _solver_rows(steps=(0, 1)))
    b = _run(tmp_path / "b", _solver_rows(steps=(0, 1, 2)))  # one epoch more
    _, _, changes = compare_cells(load_results(a), load_results(b))
    assert set(changes.kind) == {"rows"} and len(changes) == 12  # 3 cells x 2 seeds x 2 metrics
    assert "1 row only in B (step 2)" in changes.detail.iloc[0]
    assert invoke("compare", a, b, "--fail-on-change")[0].exit_code == 1


def _timing_rows(cells, rng, scale=1.0, repeats=8):
    return [
        _row(
            cell=c,
            seed=0,
            analysis="perf",
            metric="forward_time",
            step=None,
            repeat=k,
            value=scale * float(rng.lognormal(0.0, 0.1)),
            unit="ms",
        )  # fmt: skip
        for c in cells
        for k in range(repeats)
    ] + [_row(cell=c, analysis="runner", metric="wall_time", step=None, unit="s") for c in cells]


def test_timing_repeats_same_distribution_not_changed_3x_slower_is(tmp_path):
    import numpy as np

    cells = [f"c{i}" for i in range(6)]
    rng = np.random.default_rng(0)
    base = _timing_rows(cells, rng)
    same = _timing_rows(cells, rng)  # fresh draws from the same distribution
    slower = _timing_rows(cells, rng, scale=3.0)
    a, b, c = (_run(tmp_path / n, rows) for n, rows in (("a", base), ("b", same), ("c", slower)))
    s, _, ch = compare_cells(load_results(a), load_results(b), timing=True)
    assert ch.empty and "changed in 0/6 series" in s.set_index("metric").check["forward_time"]
    s, _, ch = compare_cells(load_results(a), load_results(c), timing=True)
    assert list(ch.kind) == ["timing"] * 6 and sorted(ch.cell_id) == cells
    assert (ch.ratio > 2.5).all() and ch.rows.eq("8 vs 8").all()
    assert invoke("compare", a, b, "--timing", "--fail-on-change")[0].exit_code == 0
    r, out, _ = invoke("compare", a, c, "--timing", "--fail-on-change")
    assert r.exit_code == 1 and "forward_time" in out and "Mann-Whitney" in out, r.output
    # one repeat a side: never CHANGED, however large the ratio
    one_a = _run(tmp_path / "d", _timing_rows(cells, rng, repeats=1))
    one_b = _run(tmp_path / "e", _timing_rows(cells, rng, scale=3.0, repeats=1))
    s, _, ch = compare_cells(load_results(one_a), load_results(one_b), timing=True)
    assert (
        ch.empty and "6 series with too few samples" in s.set_index("metric").check["forward_time"]
    )


def test_mann_whitney_and_timing_change():
    assert mann_whitney_p([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]) == pytest.approx(2 / 252)
    assert mann_whitney_p([1, 2, 3], [1, 2, 3]) == 1.0
    # 3 vs 3 can never reach p < 0.01: not judged, even 3x apart
    assert timing_change([1, 1.1, 0.9], [3, 3.3, 2.7], 1.1)[0] is None
    changed, ratio, p = timing_change([1, 1.1, 0.9, 1.05, 0.95], [3, 3.3, 2.7, 3.1, 2.9], 1.1)
    assert changed is True and ratio == pytest.approx(3.0) and p < 0.01


# --- header, cells only one run has ---------------------------------------------------------


def _meta(commit="a" * 40, dirty=False, torch="2.4.0", device="cpu", name="Xeon", dtype="float32"):
    return {
        "git": {"commit": commit, "dirty": dirty},
        "versions": {"deqbench": "0.1.0", "torch": torch},
        "device": device,
        "device_name": name,
        "gpus": [],
        "dtype": dtype,
        "flags": {"threads": 1},
    }


def test_header_names_what_differs(tmp_path):
    a = _run(tmp_path / "a", _rows(), meta=_meta())
    b = _run(tmp_path / "b", _rows(), meta=_meta(commit="b" * 40, dirty=True, torch="2.5.1"))
    r, out, _ = invoke("compare", a, b)
    assert r.exit_code == 0, r.output
    differ = [ln for ln in out.splitlines() if ln.startswith("differ:")]
    assert f"differ: commit {'a' * 10} vs {'b' * 10} (dirty)" in differ, out
    assert "differ: torch 2.5.1" not in differ and "differ: torch 2.4.0 vs 2.5.1" in differ
    assert len(differ) == 2, out
    assert out.splitlines()[0].startswith(f"A: {a}: commit {'a' * 10}, torch 2.4.0, cpu (Xeon)")
    c = _run(
        tmp_path / "c", _rows(), meta=_meta(device="cuda", name="NVIDIA H100", dtype="float64")
    )
    out = invoke("compare", a, c)[1]
    assert "differ: device cpu vs cuda" in out and "differ: device name Xeon vs NVIDIA H100" in out
    assert "differ: dtype float32 vs float64" in out and "commit" not in out.split("differ:", 1)[1]
    d = _run(tmp_path / "d", _rows(), meta=_meta())
    out = invoke("compare", a, d)[1]
    assert "differ:" not in out and "same commit, versions, device, dtype" in out
    e = _run(tmp_path / "e", _rows(), suite_hash="h2", meta=_meta(), defaults__train__epochs=2)
    out = invoke("compare", a, e)[1]
    assert "differ: suite: B ran the suite with other settings" in out and "epochs (1 vs 2)" in out


def test_cells_only_in_one_run_are_listed(tmp_path):
    old, new = "fc_deq_tiny-fixed_point-unrolled-lr=0.02", "fc_deq_tiny-unrolled5-lr=0.02"
    a = _run(tmp_path / "a", _solver_rows(cells=("c1", old)))
    b = _run(tmp_path / "b", _solver_rows(cells=("c1", new)))
    r, out, _ = invoke("compare", a, b, "--fail-on-change")
    assert r.exit_code == 0, r.output  # listed, not compared: no change
    lines = out.splitlines()
    ia = next(i for i, ln in enumerate(lines) if ln.startswith("cells only in A (1; 1 in both)"))
    ib = next(i for i, ln in enumerate(lines) if ln.startswith("cells only in B (1; 1 in both)"))
    assert lines[ia + 1] == f"  {old}" and lines[ib + 1] == f"  {new}", out
    c = _run(tmp_path / "c", _solver_rows(cells=("c1", old), seeds=(0,)))
    out = invoke("compare", a, c)[1]
    assert f"tasks only in A (2): c1 seed 1; {old} seed 1" in out, out


# --- the reference check (CI) ---------------------------------------------------------------


def _ref_rows(cells=("c1", "c2"), seeds=(0, 1), nstep=30.0, residual=1e-4, accuracy=0.5,
              converged=1.0, loss=1.2, wall=1.0, status="ok"):  # fmt: skip
    rows = []
    for c in cells:
        for s in seeds:
            for k in (0, 1):
                for an, metric, v, unit in (
                    ("solver_stats", "forward_nstep", nstep, "f-evals"),
                    ("solver_stats", "forward_rel_residual", residual, ""),
                    ("solver_stats", "forward_converged", converged, ""),
                    ("metrics", "accuracy", accuracy, "fraction"),
                    ("metrics", "loss", loss, ""),
                ):
                    row = _row(cell=c, seed=s, step=k, analysis=an, metric=metric, value=v,
                               unit=unit)  # fmt: skip
                    row["variant"] = "test"
                    rows.append(row)
            rows.append(_row(cell=c, seed=s, analysis="runner", metric="wall_time", step=None,
                             value=wall, unit="s", status=status))  # fmt: skip
    return rows


def _edit(rows, cell, seed, metric, value, step=1):
    for r in rows:
        if (r["cell_id"], r["seed"], r["metric"], r["step"]) == (cell, seed, metric, step):
            r["value"] = value
    return rows


def test_reference_check_passes_rounding_and_ignores_timings(tmp_path):
    ref = _run(tmp_path / "ref", _ref_rows())
    assert check_against_reference(ref, _run(tmp_path / "same", _ref_rows())) == []
    rows = _ref_rows(residual=1.07e-4, loss=1.2 * (1 + 3e-3), wall=3.0)  # other CPU, 3x slower
    _edit(rows, "c1", 0, "forward_nstep", 31.0)  # one iteration more
    _edit(rows, "c2", 1, "forward_nstep", 28.0)  # two fewer
    _edit(rows, "c2", 0, "accuracy", 0.5 + 2 / 96)  # two test samples
    _edit(rows, "c1", 1, "forward_rel_residual", 2.5e-4)  # one solver step fewer
    _edit(rows, "c2", 1, "forward_rel_residual", 5e-7, step=0)  # vs 1e-4: a factor 200 ...
    fresh = _run(tmp_path / "fresh", rows)
    got = check_against_reference(ref, fresh)
    assert len(got) == 1 and "c2 solver_stats forward_rel_residual" in got[0], got  # ... caught
    rows_ref = _edit(_ref_rows(), "c2", 1, "forward_rel_residual", 1e-8, step=0)
    ref = _run(tmp_path / "ref2", rows_ref)  # 1e-8 vs 5e-7: both at the float32 floor
    assert check_against_reference(ref, fresh) == []
    r, out, _ = invoke("compare", ref, fresh, "--reference")
    assert r.exit_code == 0 and "matches the reference" in out and "mismatch" not in out, out


def test_reference_check_catches_missing_task_status_and_behaviour(tmp_path):
    ref = _run(tmp_path / "ref", _ref_rows())
    # a missing task
    rows = [r for r in _ref_rows() if not (r["cell_id"] == "c2" and r["seed"] == 1)]
    got = check_against_reference(ref, _run(tmp_path / "missing", rows))
    assert got == ["missing task (in the reference only): c2 seed 1"], got
    # a status change
    rows = _ref_rows()
    runner = next(r for r in rows if r["analysis"] == "runner" and r["cell_id"] == "c1")
    runner["status"], runner["note"] = "flagged", "forward solve missed rel tol"
    got = check_against_reference(ref, _run(tmp_path / "status", rows))
    assert got == [
        "status: c1 seed=0: ok in the reference, flagged in the fresh run "
        "(forward solve missed rel tol)"
    ], got
    # a 30% change in an iteration count (30 -> 39: beyond 2 evaluations and 20%)
    rows = _edit(_ref_rows(), "c2", 0, "forward_nstep", 39.0)
    got = check_against_reference(ref, _run(tmp_path / "nstep", rows))
    assert len(got) == 1 and got[0].startswith("value: c2 solver_stats forward_nstep (test): "
                                               "1/4 rows"), got  # fmt: skip
    assert "seed=0 step=1: 30 in the reference, 39 in the fresh run" in got[0]
    # the smoke run's change: residual x57, converged 1 -> 0, everything else equal
    rows = _edit(_ref_rows(), "c1", 1, "forward_rel_residual", 57e-4)
    _edit(rows, "c1", 1, "forward_converged", 0.0)
    got = check_against_reference(ref, _run(tmp_path / "smoke", rows))
    assert [g.split(":")[1].strip() for g in got] == [
        "c1 solver_stats forward_converged (test)",
        "c1 solver_stats forward_rel_residual (test)",
    ], got
    # a changed learning rate: losses 10% lower, accuracy +0.1
    fresh = _run(tmp_path / "lr", _ref_rows(loss=1.08, accuracy=0.6))
    got = check_against_reference(ref, fresh)
    assert len(got) == 4 and all(g.startswith("value: ") for g in got), got
    r, out, _ = invoke("compare", ref, fresh, "--reference")
    assert r.exit_code == 1, r.output
    mismatch = [ln for ln in out.splitlines() if ln.startswith("mismatch: ")]
    assert mismatch == [f"mismatch: {g}" for g in got], out
    assert "does not match the reference" in out
    r, _, err = invoke("compare", ref, fresh, "--reference", "--rtol", "0.1")
    assert r.exit_code == 2 and "--rtol" in err, err


def test_reference_check_other_suite_and_renamed_cells(tmp_path):
    ref = _run(tmp_path / "ref", _ref_rows(cells=("c1", "fc-fixed_point-unrolled")))
    fresh = _run(tmp_path / "fresh", _ref_rows(cells=("c1", "fc-unrolled5")), suite_hash="h2",
                 defaults__train__epochs=2, threads=2, device="auto")  # fmt: skip
    got = check_against_reference(ref, fresh)
    assert got == [
        "suite settings differ (reference vs fresh): defaults.train.epochs (1 vs 2)",
        "missing task (in the reference only): fc-fixed_point-unrolled seed 0,1",
        "extra task (in the fresh run only): fc-unrolled5 seed 0,1",
    ], got
