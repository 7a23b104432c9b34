"""Every paper-scale suite (suites/paper/*.yaml) runs end to end at a tiny size on CPU
through ``deqbench reproduce --scale paper``, so that the suites and their claim extraction cannot
rot between GPU runs: the suite validates, every task of it finishes, and each claim the suite
measures gets one of the three verdicts with the run directory and a data column that says what
the run read."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import pytest

from deqbench.reproduce.claims import CLAIMS
from deqbench.reproduce.run import PAPER_SUITES, RunOptions, reproduce, suite_file, suites_dir

PAPER = suites_dir() / "paper"

#: per paper-suite file: --set overrides that shrink it to seconds on CPU (same code path)
TINY: dict[str, list[str]] = {
    "pcdeq": ["data.train_subset=32", "data.test_subset=16", "defaults.train.epochs=1"],
    "kglm_init_cost": [
        "analyses=[{kglm_init_cost: {fc_widths: [8, 16], conv_channels: [1, 2], conv_size: 8, "
        "repeats: 3}}]",
    ],
    "kglm_klr_finetune": [
        "data.source=digits",
        "defaults.train.max_steps=4",
        "defaults.train.epochs=2",
        "defaults.train.eval_batch_size=64",
    ],
    "kglm_klr": [
        "analyses=[{klr_agreement: {dtypes: [float64], split: all, newton_steps: 5, "
        "max_images: 4}}]",
    ],
    "kglm_smooth": ["data.n_train=32", "data.n_test=8", "defaults.train.epochs=2"],
    "kglm_denoise": [
        "data.n_train=16",
        "data.n_test=8",
        "defaults.train.epochs=1",
        "select=*kglm_informed-scale=1,*kglm_random-std=0.1",
    ],
    "trajectory": [
        "data.train_subset=32",
        "data.test_subset=16",
        "defaults.train.epochs=1",
        "defaults.model.channels=8",
        "defaults.model.inner=8",
        "analyses=[metrics, {trajectory: {n: 4, split: test, epochs: [0, 1], solver: anderson, "
        "max_iter: 20, tol: 1.0e-3, max_states: 4}}]",
    ],
    "landscape": [
        "data.train_subset=32",
        "data.test_subset=16",
        "defaults.train.epochs=1",
        "matrix.model=[{name: conv_deq, channels: 8, inner: 8}, "
        "{name: tied_repeat, repeats: 6, channels: 8, inner: 8}]",
        "analyses=[{landscape: {grid: 3, range: [-1, 1], split: train, max_samples: 8, seed: 0, "
        "norm: filter, include_1d: false}}]",
    ],
    "opteq": [
        "data.train_subset=32",
        "data.test_subset=16",
        "defaults.train.epochs=1",
        "data.size=16",
        "defaults.model.width=8",
        "defaults.model.extractor=8",
        "defaults.model.hidden=[4, 4, 4, 4, 4]",
        "defaults.solver.max_iter=10",
        "defaults.backward.max_iter=10",
        "matrix.backward=[{name: unrolled, k: 5}, {name: ift, tol: 1.0e-2}]",
        "analyses=[{unroll_compare: {timing_batches: 1, repeats: 1, warmup: 0, sam_prior: l2, "
        "memory_cpu: false}}, metrics]",
    ],
}


def test_every_paper_suite_has_a_tiny_size_and_claims() -> None:
    files = sorted(p.stem for p in PAPER.glob("*.yaml"))
    assert files == sorted(TINY), "add a TINY entry for each new suites/paper/ file"
    served = {suite_file(c.suite, "paper") for c in CLAIMS if c.suite}
    for stem in files:
        assert PAPER / f"{stem}.yaml" in served, f"no claim is measured by suites/paper/{stem}.yaml"
    for target in PAPER_SUITES.values():
        assert (suites_dir() / target).is_file()


#: above about 10 s on 2 cores even at the tiny size: left out of the fast lane
SLOW = {"pcdeq"}


@pytest.mark.parametrize(
    "stem", [pytest.param(s, marks=pytest.mark.slow) if s in SLOW else s for s in sorted(TINY)]
)
@pytest.mark.slow  # several seconds on 2 cores: out of the fast lane
def test_paper_suite_runs_tiny_on_cpu(stem: str, tmp_path: Path) -> None:
    target = PAPER / f"{stem}.yaml"
    claims = [c.id for c in CLAIMS if c.suite and suite_file(c.suite, "paper") == target]
    opts = RunOptions(overrides=("device=cpu", "seeds=[0]", "threads=1", *TINY[stem]))
    log = io.StringIO()
    out = reproduce(scale="paper", claim_ids=claims, out=tmp_path / "rep", options=opts, log=log)
    # exit 0 (ok) or 1 (flagged: a tiny model's solves may miss their tolerance; that is data);
    # never a failed suite or a failed task
    text = log.getvalue()
    assert f"suite {stem} finished" in text and ("(exit 0)" in text or "(exit 1)" in text), text
    rows = list(csv.DictReader(open(out / "reproduction.csv", encoding="utf-8")))
    assert [r["claim_id"] for r in rows] == claims
    for r in rows:
        assert r["verdict"] in ("reproduced", "not reproduced", "not run"), r
        assert r["run_dir"], r
        assert r["scale"] == "paper"
        # one seed: every trend claim says so rather than judging (absolute claims: the data)
        if r["verdict"] == "not run":
            assert r["reason"], r
        if stem == "kglm_denoise":
            assert "stand in for CIFAR-10" in r["data"], r
        elif stem == "kglm_klr_finetune":  # the tiny size swaps mnist5k for the 8x8 digits
            assert "stands in" in r["data"], r
        elif stem not in ("kglm_smooth", "kglm_init_cost"):  # their own data / none
            assert "mnist5k" in r["data"] and (
                "stand-in" in r["data"] or "stands in" in r["data"]
            ), r
    run_dirs = {r["run_dir"] for r in rows}
    assert len(run_dirs) == 1
    import json

    meta = json.loads((out / next(iter(run_dirs)) / "run.json").read_text())
    assert meta["status"] == "complete" and meta["tasks_failed"] == 0, meta
