"""Every reproduction suite carries a ``paper:`` block (the paper, the settings it states, our
deviations), and every setting of the block outside its deviations holds in the loaded suite:
in every expanded cell, or in the cells an entry names. The block reaches ``run.json`` and the
resolved ``suite.yaml`` of a run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from deqbench.core.errors import ConfigError
from deqbench.run.paper import FREE_DEVIATIONS, paper_mismatches
from deqbench.run.runner import run_suite
from deqbench.run.suite import load_suite, suite_from_dict

SUITES = Path(__file__).resolve().parents[1] / "suites"
#: the suites ``deqbench reproduce`` runs: paper scale, CPU scale and the two the CPU
#: reproduction uses directly
REPRODUCTION = sorted(
    [
        *SUITES.glob("paper/*.yaml"),
        *SUITES.glob("repro/*_cpu.yaml"),
        SUITES / "kglm_klr.yaml",
        SUITES / "kglm_init_cost.yaml",
    ]
)


def _id(p: Path) -> str:
    return str(p.relative_to(SUITES))


@pytest.mark.parametrize("path", REPRODUCTION, ids=_id)
def test_suite_holds_the_settings_of_its_paper_block(path: Path) -> None:
    suite = load_suite(path, device="cpu")
    assert suite.paper, f"{_id(path)} has no paper: block"
    block = suite.paper
    assert block["cite"] and block["where"]
    for key in block["deviations"]:
        assert key in block["settings"] or key in FREE_DEVIATIONS, key
    assert paper_mismatches(suite) == []
    assert suite.resolved["paper"] == block  # the resolved suite.yaml carries it


def test_a_drifted_value_is_reported(tmp_path: Path) -> None:
    src = SUITES / "repro" / "pcdeq_cpu.yaml"
    text = src.read_text()
    assert "tol: 1.0e-4, stop: batch_fro}\n  backward" in text
    copy = tmp_path / "pcdeq_cpu.yaml"
    copy.write_text(text.replace("tol: 1.0e-4, stop", "tol: 1.0e-3, stop", 1))
    got = paper_mismatches(load_suite(copy, device="cpu"))
    assert got and all(line.startswith("solver.tol: cell ") for line in got)
    assert "has 0.001, the paper states 0.0001" in got[0]
    # an override drifts one cell group only (the scoped LR of the sigmoid cell)
    drifted = paper_mismatches(load_suite(src, device="cpu", overrides=["seeds=[0]"]))
    assert drifted == []


def _raw(paper: dict, tmp: Path) -> dict:
    return {
        "schema": 1,
        "name": "blk",
        "device": "cpu",
        "threads": 1,
        "seeds": [0],
        "data": {"name": "synthetic", "n_train": 24, "n_test": 8, "dim": 5, "num_classes": 3},
        "defaults": {
            "model": {"name": "fc_deq_tiny"},
            "solver": {"name": "fixed_point", "max_iter": 20, "tol": 1.0e-4},
            "train": {"epochs": 1, "batch_size": 8, "optimizer": "adam", "lr": 1.0e-3},
        },
        "matrix": {"train.lr": [1.0e-3, 2.0e-3]},
        "analyses": ["metrics"],
        "output": str(tmp),
        "paper": paper,
    }


BLOCK = {
    "cite": "Someone, Other: A Paper (2024)",
    "where": "Section 5",
    "budget": {"steps": 100, "batch_size": 8, "lr_milestone_steps": [75]},
    "settings": {
        "train.optimizer": "adam",
        "solver.tol": 1.0e-4,
        "solver.stop": "batch_fro",
        "train.lr": [{"cells": "lr=0.001", "value": 1.0e-3}, {"cells": "lr=0.002", "value": 2e-3}],
        "model.width": 32,  # not set by the suite: the factory's default
    },
    "deviations": {"solver.stop": "not implemented here", "data": "synthetic"},
}


def test_scoped_entries_factory_defaults_and_deviations(tmp_path: Path) -> None:
    suite = suite_from_dict(_raw(BLOCK, tmp_path))
    assert paper_mismatches(suite) == []
    bad = json.loads(json.dumps(BLOCK))
    bad["settings"]["train.lr"][1]["value"] = 3e-3
    bad["settings"]["model.width"] = 16
    del bad["deviations"]["solver.stop"]
    got = paper_mismatches(suite_from_dict(_raw(bad, tmp_path)))
    assert any(g.startswith("train.lr: cell ") and "lr=0.002" in g for g in got), got
    assert not any(g.startswith("train.lr") and "lr=0.001" in g for g in got)
    assert any(g.startswith("model.width:") and "has 32" in g for g in got), got
    assert any(g.startswith("solver.stop:") and "no such setting" in g for g in got), got
    bad["settings"]["train.lr"] = {"cells": "nowhere", "value": 1e-3}
    got = paper_mismatches(suite_from_dict(_raw(bad, tmp_path)))
    assert any("match no cell" in g for g in got), got


@pytest.mark.parametrize(
    "change, message",
    [
        ({"deviations": {"colour": "why"}}, "names no settings key"),
        ({"cite": "see /work/Gabor et al. 2024.txt"}, "not a path"),
        ({"settings": {"lr": 0.1}}, "expected SECTION.KEY"),
        ({"settings": {"train.lr": {"cells": "", "value": 1}}}, "at least 1 character"),
        ({"budget": {"note": "no length"}}, "give steps"),
        ({"extra": 1}, "unknown key"),
    ],
)
def test_malformed_blocks_are_refused(change: dict, message: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        suite_from_dict(_raw({**BLOCK, **change}, tmp_path))
    assert "paper" in str(err.value)


def test_run_directory_carries_the_block(tmp_path: Path) -> None:
    raw = _raw(BLOCK, tmp_path)
    raw["matrix"] = None
    suite = suite_from_dict(raw)
    summary = run_suite(suite, tmp_path, progress=False, plots=False, command=["test"])
    meta = json.loads((summary.run_dir / "run.json").read_text())
    assert meta["paper"] == suite.paper and meta["paper"]["budget"]["steps"] == 100
    resolved = yaml.safe_load((summary.run_dir / "suite.yaml").read_text())
    assert resolved["paper"]["settings"]["solver.tol"] == 1.0e-4
