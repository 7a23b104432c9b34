"""Suite schema, FILE:LINE:COL errors, overrides, matrix expansion and cell ids."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import TINY_SUITE, write_suite

import deqbench
from deqbench.errors import ConfigError
from deqbench.run.matrix import expand
from deqbench.run.suite import load_suite, one_cell_suite, suite_from_dict


def _error(path: Path, **kw) -> str:
    with pytest.raises(ConfigError) as exc:
        load_suite(path, **kw)
    return str(exc.value)


def test_tiny_suite_expands_with_stable_ids(tiny_suite):
    s = load_suite(tiny_suite)
    assert [c.id for c in s.cells] == [
        "fc_deq_tiny-fixed_point-ift",
        "fc_deq_tiny-unrolled5",  # K plain steps: the solver does not run
    ]
    assert load_suite(tiny_suite).hash == s.hash
    c = s.cells[1]
    assert c.model == {"name": "fc_deq_tiny", "width": 8}
    assert c.backward["name"] == "unrolled" and c.backward["max_iter"] == 15
    sc, bc = c.solver_config(), c.backward_config()
    assert (sc.name, sc.max_iter, sc.tol, sc.options) == ("fixed_point", 15, 1e-3, {})
    assert (bc.name, bc.k) == ("unrolled", 5)
    assert c.train_config().epochs == 1 and c.train_config().batch_size == 32
    assert s.device == "cpu" and s.seeds == [0] and s.threads == 1


def test_resolved_suite_round_trips_to_the_same_hash(tmp_path, tiny_suite):
    s = load_suite(
        tiny_suite, overrides=["defaults.train.epochs=3", "matrix.solver.tol=[1e-2, 1e-4]"]
    )
    again = write_suite(tmp_path, s.to_yaml(), name="resolved.yaml")
    s2 = load_suite(again)
    assert s2.hash == s.hash
    assert [c.id for c in s2.cells] == [c.id for c in s.cells]
    assert all(c.train["epochs"] == 3 for c in s2.cells)


def test_matrix_dotted_keys_name_change_and_varying_params():
    base = {
        "model": {"name": "conv_deq_tiny", "channels": 8},
        "solver": {"name": "anderson", "m": 5, "tol": 1e-3},
        "backward": {"name": "ift"},
    }
    matrix = {
        "model": ["conv_deq_tiny", {"name": "fc_deq_tiny", "width": 4}],
        "solver": ["anderson", {"name": "fixed_point"}],
        "backward": ["ift", {"name": "phantom", "k": 3, "tau": 0.5}],
        "solver.tol": [1e-2, 1e-6],
    }
    gen = {"solver": {"name", "max_iter", "tol", "stop_mode"}, "model": {"name"}}
    drafts = expand(base, matrix, {}, gen)
    ids = [d.id for d in drafts]
    assert len(ids) == 16 and len(set(ids)) == 16
    assert ids[0] == "conv_deq_tiny-anderson-ift-tol=0.01"
    assert "fc_deq_tiny-fixed_point-phantom-width=4-k=3-tau=0.5-tol=1e-06" in ids
    by_id = {d.id: d for d in drafts}
    fc = by_id["fc_deq_tiny-fixed_point-ift-width=4-tol=0.01"].sections
    # the name changed: conv's `channels` and anderson's `m` are dropped, `tol` (generic) kept
    assert fc["model"] == {"name": "fc_deq_tiny", "width": 4}
    assert fc["solver"] == {"name": "fixed_point", "tol": 0.01}
    assert by_id["conv_deq_tiny-anderson-ift-tol=0.01"].sections["solver"]["m"] == 5
    src = by_id[ids[0]].src
    assert src["solver"]["tol"] == ("matrix", "solver.tol", 0)
    assert src["model"]["channels"] == ("model", "channels")


def test_a_case_id_names_the_cell_and_the_other_axes_follow():
    """A case ``id`` replaces the generated id (no model-solver-backward head); crossed axes
    still add what varies along them (their names for model/solver/backward), runtime keys the
    case sets are named by its id, runtime keys set elsewhere still end the id."""
    base = {"model": {"name": "fc_deq_tiny"}, "solver": {"name": "anderson"}}
    matrix = {
        "model": ["fc_deq_tiny", "conv_deq_tiny"],
        "case": [
            {"id": "float32", "runtime.amp": "none"},
            {"id": "bf16-tol=0.01", "runtime": {"amp": "bf16"}, "solver.tol": 1e-2},
        ],
        "backward": [{"name": "unrolled", "k": 5}, {"name": "ift", "tol": 1e-3}],
        "runtime.compile": ["aot_eager"],
    }
    suffix = {"runtime": {"amp": "none", "compile": "none"}}
    ids = [d.id for d in expand(base, matrix, {}, suffix_defaults=suffix)]
    assert ids == [
        "fc_deq_tiny-float32-unrolled-k=5-compile=aot_eager",
        "fc_deq_tiny-float32-ift-tol=0.001-compile=aot_eager",
        "fc_deq_tiny-bf16-tol=0.01-unrolled-k=5-compile=aot_eager",
        "fc_deq_tiny-bf16-tol=0.01-ift-tol=0.001-compile=aot_eager",
        "conv_deq_tiny-float32-unrolled-k=5-compile=aot_eager",
        "conv_deq_tiny-float32-ift-tol=0.001-compile=aot_eager",
        "conv_deq_tiny-bf16-tol=0.01-unrolled-k=5-compile=aot_eager",
        "conv_deq_tiny-bf16-tol=0.01-ift-tol=0.001-compile=aot_eager",
    ]
    # without ids the same grid keeps its generated head
    plain = {**matrix, "case": [{k: v for k, v in c.items() if k != "id"} for c in matrix["case"]]}
    first = expand(base, plain, {}, suffix_defaults=suffix)[0].id
    assert first.startswith("fc_deq_tiny-anderson-unrolled")


@pytest.mark.parametrize(
    ("case_ids", "message"),
    [
        (["a", "a"], "case id 'a' is also the id of case 0"),
        (["a", "has space"], "expected a non-empty id of letters"),
        (["a", ""], "expected a non-empty id of letters"),
        (["a", 3], "expected a non-empty id of letters"),
    ],
)
def test_a_case_id_is_a_unique_id(tmp_path, case_ids, message):
    cases = ", ".join(
        f"{{id: {i!r}, model: {{name: fc_deq_tiny, width: {8 * (n + 1)}}}}}"
        for n, i in enumerate(case_ids)
    )
    p = tmp_path / "s.yaml"
    p.write_text(
        "schema: 1\nname: s\ndevice: cpu\ndata: {name: synthetic}\n"
        f"defaults: {{model: fc_deq_tiny}}\nmatrix:\n  case: [{cases}]\nanalyses: [metrics]\n"
    )
    with pytest.raises(ConfigError, match=message) as e:
        load_suite(p)
    assert "matrix.case[1].id" in str(e.value) or ":6:" in str(e.value)


def test_case_axis_zips_sections_and_crosses_other_axes():
    base = {"model": {"name": "fc_deq_tiny"}, "solver": {"name": "anderson", "tol": 1e-3}}
    matrix = {
        "case": [
            {"model": "pcdeq_l_tiny", "data": {"flatten": True}, "solver.tol": 1e-4},
            {"id": "mon", "model": {"name": "mondeq_fc_tiny"}, "solver": "peaceman_rachford"},
        ],
        "backward": ["ift", "unrolled"],
    }
    drafts = expand(base, matrix, {}, {"solver": {"name", "tol"}})
    ids = [d.id for d in drafts]
    assert ids == [
        "pcdeq_l_tiny-anderson-ift-flatten=true-tol=0.0001",
        "pcdeq_l_tiny-anderson-unrolled-flatten=true-tol=0.0001",
        "mon-ift",  # the case's id replaces the generated id; the crossed axis names its value
        "mon-unrolled",
    ]
    first = drafts[0].sections
    assert first["data"] == {"flatten": True} and first["solver"] == {
        "name": "anderson",
        "tol": 1e-4,
    }
    assert drafts[2].sections["solver"] == {"name": "peaceman_rachford", "tol": 1e-3}
    assert drafts[2].src["model"]["name"] == ("matrix", "case", 1, "model", "name")


def test_case_axis_errors_point_at_the_key(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text(
        "schema: 1\nname: s\ndevice: cpu\ndata: {name: digits}\nmatrix:\n  case:\n"
        "    - {modle: fc_deq_tiny}\n"
    )
    msg = _error(p)
    assert re.match(r".*s\.yaml:7:\d+: matrix\.case\[0\]\.modle: unknown case key", msg)
    assert "did you mean 'model'" in msg


def test_yaml_exponent_floats_and_seed_int(tmp_path):
    p = write_suite(
        tmp_path,
        TINY_SUITE,
        replace={"tol: 1.0e-3}\n  backward": "tol: 1e-3}\n  backward", "seeds: [0]": "seeds: 4"},
    )
    s = load_suite(p)
    assert s.cells[0].solver["tol"] == 1e-3 and s.seeds == [4]


def test_one_cell_suite_runs_the_same_checks():
    s = one_cell_suite(
        "probe", model="fc_deq_tiny", analyses=["metrics"], train={"epochs": 0}, device="cpu"
    )
    assert len(s.cells) == 1 and s.cells[0].id == "fc_deq_tiny-broyden-ift"  # declared solver
    with pytest.raises(
        ConfigError, match=r"^<probe options>: defaults.model.name: unknown model 'fc_deq_tny'"
    ):
        one_cell_suite("probe", model="fc_deq_tny", analyses=["metrics"], device="cpu")


LINE = re.compile(r"^\S+\.yaml:\d+:\d+: \S+: .+$")


@pytest.mark.parametrize(
    ("old", "new", "where", "message"),
    [
        ("seeds: [0]", "seedz: [0]", ":5:1: seedz:", "unknown key (did you mean 'seeds'?)"),
        (
            "max_iter: 15, tol: 1.0e-3}\n  backward",
            "max_iters: 15, tol: 1.0e-3}\n  backward",
            ":9:31: defaults.solver.max_iters:",
            "unknown key (did you mean 'max_iter'?)",
        ),
        ("epochs: 1", "epochs: one", ":11:19: defaults.train.epochs:", "valid integer"),
        (
            "epochs: 1",
            "epoch: 1",
            ":11:11: defaults.train.epoch:",
            "unknown key (did you mean 'epochs'?)",
        ),
        (
            "fc_deq_tiny, width",
            "fc_deq_tiyn, width",
            ":8:17: defaults.model.name:",
            "unknown model 'fc_deq_tiyn'; did you mean 'fc_deq_tiny'",
        ),
        (
            "width: 8",
            "widht: 8",
            ":8:30: defaults.model.widht:",
            "unknown key (did you mean 'width'?)",
        ),
        (
            "{name: fixed_point, max_iter: 15",
            "{name: fixed_piont, max_iter: 15",
            ":9:18: defaults.solver.name:",
            "unknown solver 'fixed_piont'; did you mean 'fixed_point'",
        ),
        (
            "[ift, unrolled]",
            "[ift, unroled]",
            ":13:19: matrix.backward[1]:",
            "unknown backward mode 'unroled' (did you mean 'unrolled'?)",
        ),
        (
            "analyses: [metrics, solver_stats]",
            "analyses: [metrics, solver_stat]",
            ":14:21: analyses[1]:",
            "unknown analysis 'solver_stat'; did you mean 'solver_stats'",
        ),
        (
            "analyses: [metrics, solver_stats]",
            "analyses: [metrics, {solver_stats: {trace_sample: 2}}]",
            ":14:37: analyses[1].solver_stats.trace_sample:",
            "(did you mean 'trace_samples'?)",
        ),
        (
            "  train:",
            "  init: {name: spectrl}\n  train:",
            ":11:16: defaults.init.name:",
            "unknown init 'spectrl'; did you mean 'spectral'",
        ),
        (
            "  train:",
            "  init: {name: spectral, targt: 2}\n  train:",
            ":11:26: defaults.init.targt:",
            "(did you mean 'target'?)",
        ),
        (
            "digits, train",
            "digit, train",
            ":6:14: data.name:",
            "unknown dataset 'digit'; did you mean 'digits'",
        ),
        (
            "{name: fc_deq_tiny, width: 8}",
            "{name: fc_deq_tiny, in_shape: [64]}",
            ":8:30: defaults.model.in_shape:",
            "filled in from the dataset",
        ),
        ("matrix:\n  backward: [ift, unrolled]", "matrix: {}", ":12:9: matrix:", "empty matrix"),
        ("backward: [ift, unrolled]", "backward: []", ":13:13: matrix.backward:", "empty list"),
        (
            "backward: [ift, unrolled]",
            "solvr: [anderson]",
            ":13:3: matrix.solvr:",
            "(did you mean 'solver'?)",
        ),
    ],
)
def test_bad_suites_give_one_line_with_location(tmp_path, old, new, where, message):
    p = write_suite(tmp_path, TINY_SUITE, replace={old: new})
    err = _error(p)
    assert len(err.splitlines()) == 1, err
    assert LINE.match(err), err
    assert where in err and message in err, err
    assert err.startswith(str(p))


def test_missing_file_and_invalid_yaml(tmp_path):
    assert _error(tmp_path / "nope.yaml") == f"{tmp_path / 'nope.yaml'}: no such file"
    p = write_suite(tmp_path, TINY_SUITE, replace={"seeds: [0]": "seeds: [0"})
    err = _error(p)
    assert (
        re.match(rf"^{re.escape(str(p))}:\d+:\d+: invalid YAML: ", err)
        and len(err.splitlines()) == 1
    )
    p = write_suite(tmp_path, TINY_SUITE + "seeds: [1]\n")
    assert _error(p) == f"{p}:16:1: seeds: duplicate key"


def test_cuda_without_gpu_is_a_config_error(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    p = write_suite(tmp_path, TINY_SUITE, replace={"device: cpu": "device: cuda"})
    err = _error(p)
    assert err.startswith(f"{p}:3:9: device: CUDA is not available") and len(err.splitlines()) == 1
    err = _error(write_suite(tmp_path), device="cuda:1")
    assert err.startswith("--device cuda:1: CUDA is not available")


def test_overrides_and_their_error_locations(tiny_suite):
    s = load_suite(
        tiny_suite,
        overrides=[
            "defaults.train.epochs=2",
            "seeds=[3, 4]",
            "defaults.solver.tol=1e-5",
            "matrix.model.width=[4, 6]",
        ],
        seeds=None,
    )
    assert s.seeds == [3, 4] and {c.train["epochs"] for c in s.cells} == {2}
    assert {c.solver["tol"] for c in s.cells} == {1e-5}
    assert [c.id for c in s.cells][:2] == [
        "fc_deq_tiny-fixed_point-ift-width=4",
        "fc_deq_tiny-fixed_point-ift-width=6",
    ]
    assert load_suite(tiny_suite, seeds=[7, 8], output="elsewhere").seeds == [7, 8]
    err = _error(tiny_suite, overrides=["defaults.train.epochs=x"])
    assert err.startswith(
        "--set defaults.train.epochs=x: defaults.train.epochs: Input should be a valid integer"
    )
    err = _error(tiny_suite, overrides=["defaults.solver.tool=1"])
    assert err.startswith(
        "--set defaults.solver.tool=1: defaults.solver.tool: unknown key (did you mean 'tol'?)"
    )
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_suite(tiny_suite, overrides=["defaults.train.epochs"])


def test_several_errors_are_all_reported_in_file_order(tmp_path):
    p = write_suite(
        tmp_path,
        TINY_SUITE,
        replace={
            "width: 8": "widht: 8",
            "epochs: 1": "epochs: -1",
            "digits, train": "digts, train",
        },
    )
    lines = _error(p).splitlines()
    assert [ln.split(": ")[1] for ln in lines] == [
        "data.name",
        "defaults.model.widht",
        "defaults.train.epochs",
    ]


def test_suite_from_dict_and_analysis_params_kept():
    raw = {
        "name": "d",
        "device": "cpu",
        "data": "digits",
        "defaults": {"model": "fc_deq_tiny"},
        "analyses": [{"solver_stats": {"trace_samples": 4}}, "metrics"],
    }
    s = suite_from_dict(raw)
    assert s.analyses == [("solver_stats", {"trace_samples": 4}), ("metrics", {})]
    # an unset init comes from the model's declaration
    assert s.cells[0].data == {"name": "digits"}
    assert s.cells[0].init == deqbench.models.defaults("fc_deq_tiny")["init"]


def test_select_keeps_the_matching_cells_and_round_trips(tmp_path, tiny_suite):
    """``select`` (here through ``--set``) keeps only the cells whose id matches a pattern, says
    so in the notes, and a pattern matching nothing is an error naming the cells there are."""
    s = load_suite(tiny_suite, overrides=["select=*unrolled*"])
    assert [c.id for c in s.cells] == ["fc_deq_tiny-unrolled5"]
    assert any("1 of 2 cells" in n for n in s.notes)
    assert s.hash != load_suite(tiny_suite).hash  # a part of the grid is another run
    again = tmp_path / "again.yaml"
    again.write_text(s.to_yaml())
    assert [c.id for c in load_suite(again).cells] == ["fc_deq_tiny-unrolled5"]
    both = load_suite(tiny_suite, overrides=["select=[fc_deq_tiny-fixed_point-ift, *5]"])
    assert len(both.cells) == 2
    msg = _error(tiny_suite, overrides=["select=nothing-*"])
    assert "'nothing-*' matches no cell" in msg and "fc_deq_tiny-fixed_point-ift" in msg
