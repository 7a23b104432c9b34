"""Hostile inputs: each file of tests/hostile/ is one case, run in process through the
command line (Typer's CliRunner); each gives its documented exit code, one ``error:`` line that
says what is wrong (no traceback) and writes no run directory. tests/hostile/README.md lists them.
"""

from __future__ import annotations

import importlib
import os
import pathlib
import re
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deqbench.cli import app

HOSTILE = Path(__file__).resolve().parent / "hostile"

#: suite files run with ``deqbench run``: file -> (exit code, a substring of the one error line)
SUITES = {
    "seeds_duplicate.yaml": (2, "seeds: seed 0 listed twice"),
    "seed_huge.yaml": (2, "seeds[0]: Input should be less than or equal to 9223372036854775807"),
    "seed_negative.yaml": (2, "seeds[0]: Input should be greater than or equal to 0"),
    "epochs_bool.yaml": (2, "defaults.train.epochs: Input should be a valid integer (got True)"),
    "lr_string.yaml": (2, "defaults.train.lr: Input should be a valid number (got '0.02')"),
    "lr_inf.yaml": (2, "defaults.train.lr: Input should be a finite number"),
    "tol_nan.yaml": (2, "defaults.solver.tol: Input should be a finite number"),
    "noise_nan.yaml": (2, "data.noise: expected a finite number (got nan)"),
    "split_out_of_range.yaml": (2, "data.split: the train fraction must be in (0, 1) (got 1.5)"),
    "train_subset_zero.yaml": (2, "data.train_subset: must be at least 1"),
    "data_seed_bool.yaml": (2, "data.seed: expected an integer (got True)"),
    "model_width_string.yaml": (2, "defaults.model.width: expected an integer (got '8')"),
    "tf32_string.yaml": (2, "tf32: Input should be a valid boolean"),
    "epochs_huge.yaml": (2, "epochs is over the cap of 100000 (caps: false"),
    "matrix_3000x3000.yaml": (2, "9000000 cells x 1 seed = 9000000 tasks, over the cap of 10000"),
    "alias_bomb.yaml": (2, "YAML refused: more than 20000 nodes with aliases expanded"),
    "deep_nesting.yaml": (2, "YAML refused: nested deeper than 100 levels"),
    "python_tag.yaml": (2, "could not determine a constructor for the tag"),
    "output_is_file.yaml": (2, "output_is_file.yaml is an existing file"),
    "output_proc.yaml": (2, "output: /proc/deqbench-results is under /proc"),
    "checkpoint_suite.yaml": (2, "checkpoint: refused"),
    "directions_suite.yaml": (2, "directions: refused"),
    "binary.bin": (2, "binary.bin: cannot read: 'utf-8' codec can't decode"),
    "name_dotdot.yaml": (2, "name: '..' is not a folder name of its own"),
    "name_dot.yaml": (2, "name: '.' is not a folder name of its own"),
    "alias_recursive_list.yaml": (2, ":4:18: YAML refused: alias *a inside the node it names"),
    "alias_recursive_map.yaml": (2, ":9:6: YAML refused: alias *d inside the node it names"),
    "alias_text_bomb.yaml": (2, "YAML refused: more than 2 MiB of text with aliases expanded"),
    "nul_byte.yaml": (2, "nul_byte.yaml:3:11: invalid YAML: control character #x0000"),
    "control_chars.yaml": (2, r"unknown model 'fc\x1b]0;pwned\x07\x1b[2J\nerror: forged line'"),
    "long_name.yaml": (2, "unknown model 'xxxxxxxxxx"),
}

#: a file put into an otherwise empty run directory under the given name, then ``plot`` and
#: ``compare``: file -> (name in the run directory, substring of the error line)
RUN_FILES = {
    "results_nonutf8.csv": ("results.csv", "not UTF-8 text (byte 0xff"),
    "results_no_header.csv": ("results.csv", "not a deqbench results file: no header line"),
    "results_extra_columns.csv": ("results.csv", "results.csv:2: 19 fields where the header has"),
    "binary.bin": ("results.csv", "not UTF-8 text (byte 0x8b at offset 0)"),
    "run_json_corrupt.json": ("run.json", "corrupt run.json: not valid JSON (Unterminated"),
    "run_json_empty.json": ("run.json", "corrupt run.json: not valid JSON"),
    "suite_tagged.yaml": ("suite.yaml", "could not determine a constructor for the tag"),
}

#: files used by the cases below them (checkpoints, a plugin, the read-only folder)
OTHERS = {"checkpoint_pickled.pt", "plugin_sys_exit.py", "output_readonly.yaml", "README.md",
          "grid_huge.yaml", "set_defaults_overridden.yaml"}  # fmt: skip


def invoke(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args])


def one_error(result, code: int, message: str) -> str:
    """The single ``error:`` line of ``result``, checked against ``code`` and ``message``."""
    out = result.output
    assert result.exit_code == code, out
    assert (
        "Traceback" not in out
        and result.exception is None
        or isinstance(result.exception, SystemExit)
    ), out
    errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, out
    assert message in errors[0], out
    return errors[0]


@pytest.fixture
def work(tmp_path, monkeypatch):
    """The current folder for a case: suites write (nothing) under ./results."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def case_file(name: str, where: Path) -> Path:
    """The corpus file ``name`` copied to ``where`` (``@HOSTILE@`` -> the corpus folder)."""
    src = HOSTILE / name
    dst = where / name
    if src.suffix == ".yaml":
        dst.write_text(src.read_text().replace("@HOSTILE@", str(HOSTILE)))
    else:
        dst.write_bytes(src.read_bytes())
    return dst


def test_every_corpus_file_is_a_case_and_listed_in_the_readme():
    files = {p.name for p in HOSTILE.iterdir()}
    assert files == set(SUITES) | set(RUN_FILES) | OTHERS
    readme = (HOSTILE / "README.md").read_text()
    for name in files - {"README.md"}:
        assert name in readme, name


@pytest.mark.parametrize("name", sorted(SUITES))
def test_hostile_suite_one_line_exit_2_nothing_written(work, name):
    code, message = SUITES[name]
    path = case_file(name, work)
    t0 = time.process_time()  # CPU time: a shared machine's wall clock bounds nothing
    r = invoke("run", path, "--no-check")
    elapsed = time.process_time() - t0
    line = one_error(r, code, message)
    # nothing from the file acts on the terminal (ESC, BEL, CR...) and no echo is unbounded
    assert not re.search("[\x00-\x09\x0b-\x1f\x7f]", r.output), repr(r.output)
    assert len(line) < 600, len(line)
    assert "weights_only=False" not in r.output
    assert not (work / "results").exists(), line
    assert not (HOSTILE / "results").exists()
    assert "deqbench-hostile-payload" not in r.output
    if name == "alias_bomb.yaml":
        assert elapsed < 10.0, elapsed  # refused, not a hang (it ran for minutes); no timing target
    if name in ("deep_nesting.yaml", "matrix_3000x3000.yaml"):
        assert elapsed < 10.0, elapsed


def test_the_alias_bomb_is_refused_in_well_under_a_second():
    from deqbench.core.errors import ConfigError
    from deqbench.run.yamlio import read_yaml

    t0 = time.process_time()
    with pytest.raises(ConfigError, match="YAML refused: more than 20000 nodes"):
        read_yaml(HOSTILE / "alias_bomb.yaml")
    assert time.process_time() - t0 < 0.5


def test_too_many_nodes_refused_and_aliases_within_the_limit_still_load(tmp_path):
    from deqbench.core.errors import ConfigError
    from deqbench.run.yamlio import MAX_YAML_NODES, read_yaml_text

    many = "x:\n" + "".join("- 0\n" for _ in range(MAX_YAML_NODES + 1))
    with pytest.raises(ConfigError, match="more than 20000 nodes"):
        read_yaml_text(many, "many.yaml")
    data, loc = read_yaml_text("a: &x [1, 2]\nb: *x\nc: {<<: {q: 1}, r: 2}\n", "ok.yaml")
    assert data == {"a": [1, 2], "b": [1, 2], "c": {"q": 1, "r": 2}}
    assert loc.where(("b", 1)) == "ok.yaml:1:11"  # an alias points at its anchor's nodes
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * (1024 * 1024) + "\n")
    with pytest.raises(ConfigError, match="larger than 1 MiB"):
        from deqbench.run.yamlio import read_yaml

        read_yaml(big)


def test_caps_false_lifts_the_epochs_and_task_caps(work):
    from deqbench.core.errors import ConfigError
    from deqbench.run.suite import load_suite

    path = case_file("epochs_huge.yaml", work)
    suite = load_suite(path, overrides=["caps=false"])
    assert suite.cells[0].train["epochs"] == 10**12
    assert suite.resolved["caps"] is False  # kept in the run's suite.yaml, so resume agrees
    seeds = "[" + ", ".join(map(str, range(10_001))) + "]"  # 1 cell x 10001 seeds
    text = (HOSTILE / "output_readonly.yaml").read_text()
    (work / "m.yaml").write_text(text.replace("seeds: [0]", f"seeds: {seeds}"))
    with pytest.raises(ConfigError, match="1 cell x 10001 seeds = 10001 tasks, over the cap"):
        load_suite(work / "m.yaml")
    assert len(load_suite(work / "m.yaml", overrides=["caps=false"]).seeds) == 10_001


def test_output_on_a_read_only_file_system_is_one_line_and_nothing_written(work, monkeypatch):
    path = case_file("output_readonly.yaml", work)

    def refuse(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(pathlib.Path, "mkdir", refuse)
    r = invoke("run", path, "--no-check")
    one_error(r, 2, "cannot create the results folder")
    monkeypatch.undo()
    assert not (work / "results").exists()


@pytest.mark.parametrize("name", sorted(RUN_FILES))
def test_plot_and_compare_on_a_corrupt_run_one_line_exit_2(tmp_path, name):
    from deqbench.run.results import COLUMNS

    target, message = RUN_FILES[name]
    good = tmp_path / "good"
    bad = tmp_path / "bad"
    for d in (good, bad):
        d.mkdir()
        (d / "results.csv").write_text(",".join(COLUMNS) + "\n")
        (d / "run.json").write_text("{}")
    (bad / target).write_bytes((HOSTILE / name).read_bytes())
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    one_error(invoke("plot", bad), 2, message)
    one_error(invoke("compare", good, bad), 2, message)
    one_error(invoke("compare", bad, good, "--reference"), 2, message)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_plot_and_compare_on_a_binary_file_one_line(tmp_path):
    blob = case_file("binary.bin", tmp_path)
    one_error(invoke("plot", blob), 2, "not a run directory")
    one_error(invoke("compare", blob, blob), 2, "not a run directory")


@pytest.mark.parametrize(
    ("command", "option"),
    [("landscape", "--checkpoint"), ("hessian", "--checkpoint"), ("landscape", "--directions")],
)
def test_a_pickled_checkpoint_is_refused_before_the_run_directory(work, command, option):
    args = [command, option, HOSTILE / "checkpoint_pickled.pt", "--device", "cpu"]
    args += ["--data", "digits", "--train-subset", "32", "--out", work / "results"]
    if command == "landscape":
        args += ["--grid", "3"]
    r = invoke(*args)
    line = one_error(r, 2, f"{option} ")
    assert "refused" in line and "weights_only=True" in line and "for safety" in line
    assert "weights_only=False" not in r.output
    assert "deqbench hostile payload" not in r.output
    assert not (work / "results").exists()


def test_a_pickled_checkpoint_at_run_time_gives_the_same_safe_message(tmp_path):
    import torch

    from deqbench.core.errors import ConfigError
    from deqbench.landscape.analysis import load_checkpoint
    from deqbench.landscape.directions import load_directions

    model = torch.nn.Linear(2, 2)
    for call in (
        lambda: load_checkpoint(model, HOSTILE / "checkpoint_pickled.pt"),
        lambda: load_directions(HOSTILE / "checkpoint_pickled.pt"),
    ):
        with pytest.raises(ConfigError) as ei:
            call()
        msg = str(ei.value)
        assert "\n" not in msg and "refused" in msg and "weights_only=False" not in msg
    good = tmp_path / "w.pt"
    torch.save(model.state_dict(), good)
    load_checkpoint(model, good)  # a state dict still loads


# -- plugins --------------------------------------------------------------------------------


def _dist_info(root: Path, name: str, groups: dict[str, dict[str, str]]) -> None:
    d = root / f"{name.replace('-', '_')}-1.0.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    lines = []
    for group, eps in groups.items():
        lines += [f"[{group}]", *(f"{k} = {v}" for k, v in eps.items()), ""]
    (d / "entry_points.txt").write_text("\n".join(lines))


@pytest.fixture
def exiting_plugin(tmp_path, monkeypatch):
    """A plugin model whose import calls sys.exit(3), beside a plugin model that works."""
    from deqbench.core.registry import REGISTRIES

    monkeypatch.delenv("DEQBENCH_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "hostileplug_exit.py").write_bytes((HOSTILE / "plugin_sys_exit.py").read_bytes())
    (tmp_path / "hostileplug_ok.py").write_text(
        "from deqbench.models.fc import fc_deq_tiny as fine\n"
    )
    _dist_info(tmp_path, "hostileplug-exit", {"deqbench.models": {"exiting": "hostileplug_exit:f"}})
    _dist_info(
        tmp_path, "hostileplug-ok", {"deqbench.models": {"fine_plugin": "hostileplug_ok:fine"}}
    )
    importlib.invalidate_caches()
    for r in REGISTRIES.values():
        r.reset_plugins()
    yield tmp_path
    for r in REGISTRIES.values():
        r.reset_plugins()
    for mod in [m for m in sys.modules if m.startswith("hostileplug")]:
        del sys.modules[mod]


def test_a_plugin_calling_sys_exit_is_caught_and_named(exiting_plugin):
    import deqbench
    from deqbench.errors import PluginError

    with pytest.raises(
        PluginError, match=r"hostileplug-exit 1.0 failed to import model 'exiting'.*SystemExit: 3"
    ):
        deqbench.models.get("exiting")
    assert callable(deqbench.models.get("fine_plugin"))  # the others keep working
    assert callable(deqbench.models.get("fc_deq_tiny"))


def test_ls_check_marks_broken_plugins(exiting_plugin):
    r = invoke("ls", "models", "--check")
    assert r.exit_code == 1, r.output
    lines = r.output.splitlines()
    (bad,) = [ln for ln in lines if ln.split()[1:2] == ["exiting"]]
    assert "BROKEN:" in bad and "SystemExit: 3" in bad
    (ok,) = [ln for ln in lines if ln.split()[1:2] == ["fine_plugin"]]
    assert "BROKEN" not in ok
    r = invoke("ls", "models")  # without --check nothing is imported
    assert r.exit_code == 0 and "BROKEN" not in r.output


def test_a_suite_naming_the_exiting_plugin_is_one_line(exiting_plugin, work):
    path = case_file("output_readonly.yaml", work)
    text = path.read_text().replace("fc_deq_tiny, width: 8", "exiting")
    path.write_text(text)
    one_error(invoke("validate", path), 2, "plugin hostileplug-exit 1.0 failed to import model")


# -- run directories on --resume -------------------------------------------------------------


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished run of one tiny task (copied by :func:`run_copy` for each case)."""
    from deqbench.run.runner import run_suite
    from deqbench.run.suite import load_suite

    root = tmp_path_factory.mktemp("finished")
    path = case_file("output_readonly.yaml", root)
    return run_suite(load_suite(path), out=root / "results", progress=False, plots=False).run_dir


@pytest.fixture
def run_copy(finished_run, tmp_path):
    import shutil

    d = tmp_path / "run"
    shutil.copytree(finished_run, d)
    return d


def resume(run_dir: Path):
    return invoke(
        "run", run_dir / "suite.yaml", "--resume", run_dir, "--no-check", "--no-plots",
        "--no-progress",
    )  # fmt: skip


def unblocked(call, fifo: Path, timeout: float = 20.0):
    """``call()`` in a thread; if it is still blocked on ``fifo`` after ``timeout`` seconds (a
    read that waits for a writer), open the FIFO for writing to release it and fail."""
    import threading

    out: list = []
    t = threading.Thread(target=lambda: out.append(call()), daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        for _ in range(3):  # a writer that closes at once: the reader sees end of file
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
            t.join(2)
        pytest.fail(f"blocked on the FIFO {fifo.name} for {timeout:g} s")
    return out[0]


def test_resume_without_the_manifest_is_refused_and_nothing_changes(run_copy):
    from deqbench.run.results import MANIFEST

    (run_copy / MANIFEST).unlink()
    before = (run_copy / "results.csv").read_bytes()
    line = one_error(resume(run_copy), 2, f"{MANIFEST} is missing, so the rows of results.csv")
    assert f"deqbench run {run_copy / 'suite.yaml'}" in line
    assert (run_copy / "results.csv").read_bytes() == before
    assert not (run_copy / MANIFEST).exists() and not (run_copy / "run.lock").exists()


@pytest.mark.parametrize("kind", ["directory", "fifo"])
@pytest.mark.parametrize("name", ["manifest.jsonl", "run.lock"])
def test_a_directory_or_fifo_in_place_of_a_run_file_is_one_line(run_copy, name, kind):
    target = run_copy / name
    target.unlink(missing_ok=True)
    if kind == "directory":
        target.mkdir()
    else:
        os.mkfifo(target)
    what = "a directory" if kind == "directory" else "a FIFO (named pipe)"
    line = one_error(unblocked(lambda: resume(run_copy), target), 2, f"{name} is {what}")
    assert "cannot write the run directory" not in line


def test_a_lock_naming_a_20_digit_pid_is_stale_and_taken_over(run_copy):
    import json
    import socket

    lock = {"pid": 12345678901234567890, "host": socket.gethostname(), "started": "x"}
    (run_copy / "run.lock").write_text(json.dumps(lock))
    r = resume(run_copy)
    assert r.exit_code == 0 and r.exception is None, r.output
    assert "took over the stale lock of PID 12345678901234567890" in r.output
    assert not (run_copy / "run.lock").exists()


def test_a_results_field_over_the_csv_size_limit_reruns_its_task(run_copy):
    import csv

    from deqbench.run.results import COLUMNS, check_finished

    path = run_copy / "results.csv"
    header, first, *rest = path.read_text().splitlines(keepends=True)
    row = next(csv.reader([first]))
    row[COLUMNS.index("note")] = "n" * (200 * 1024)  # over csv's 128 KiB field limit
    path.write_text(header + ",".join(f'"{v}"' for v in row) + "\n" + "".join(rest))
    done, notes = check_finished(run_copy)
    assert done == set()  # its task's rows no longer match the manifest: it runs again
    assert any("unreadable line" in n for n in notes), notes


def test_a_manifest_row_count_of_1e400_is_not_a_record(run_copy):
    from deqbench.run.results import MANIFEST, check_finished

    (run_copy / MANIFEST).write_text(
        '{"cell_id": "c", "seed": 0, "rows": 1e400, "sha256": "0"}\n'
        + (run_copy / MANIFEST).read_text()
    )
    done, notes = check_finished(run_copy)
    assert len(done) == 1 and not notes


def test_an_empty_results_csv_is_read_as_one_with_only_its_header(run_copy, tmp_path):
    import shutil

    from deqbench.run.results import COLUMNS, check_finished

    other = tmp_path / "header_only"
    shutil.copytree(run_copy, other)
    (run_copy / "results.csv").write_bytes(b"")
    (other / "results.csv").write_text(",".join(COLUMNS) + "\n")
    assert check_finished(run_copy)[0] == check_finished(other)[0] == set()
    assert (run_copy / "results.csv").read_text() == ",".join(COLUMNS) + "\n"


def test_a_full_disk_leaves_run_json_interrupted_with_the_reason(work, monkeypatch):
    import errno
    import json

    from deqbench.run import results as res

    path = case_file("output_readonly.yaml", work)
    path.write_text(path.read_text().replace("seeds: [0]", "seeds: [0, 1]"))
    write, atomic, full = os.write, res.write_atomic, []

    def no_space():
        full.append(True)
        raise OSError(errno.ENOSPC, "No space left on device")

    def write_full(fd, data):  # the second task's append finds the disk full, and so on
        if full or (os.fstat(fd).st_ino in _inodes(work) and _rows(work) > 1):
            no_space()
        return write(fd, data)

    def atomic_full(p, data):  # no room for a temp file either
        if full:
            no_space()
        return atomic(p, data)

    monkeypatch.setattr(os, "write", write_full)
    monkeypatch.setattr(res, "write_atomic", atomic_full)
    r = invoke("run", path, "--no-progress", "--no-plots", "--no-check")
    monkeypatch.undo()
    assert r.exit_code == 2, r.output
    assert len([ln for ln in r.output.splitlines() if "No space left" in ln]) == 1, r.output
    (d,) = (work / "results" / "hostile").iterdir()
    meta = json.loads((d / "run.json").read_text())
    assert meta["status"] == "interrupted" and "No space left" in meta["cause"]
    assert not list(d.glob(".*.tmp*"))  # no temp file left behind


def _inodes(work: Path) -> set[int]:
    return {p.stat().st_ino for p in work.glob("results/hostile/*/results.csv")}


def _rows(work: Path) -> int:
    return sum(len(p.read_bytes().splitlines()) for p in work.glob("results/hostile/*/results.csv"))


# -- other commands --------------------------------------------------------------------------


def test_reproduce_out_an_existing_file_is_one_line(work):
    (work / "report").write_text("not a folder")
    one_error(invoke("reproduce", "001", "--out", work / "report"), 2, "is an existing file")
    assert (work / "report").read_text() == "not a folder"


@pytest.fixture
def no_grid_sweep(monkeypatch):
    """A grid that gets as far as its evaluation fails at once (without the cap, the lists over
    10**10 points took all the memory)."""
    from deqbench.landscape import surface

    def refuse(*args, **kwargs):
        raise RuntimeError("the grid was evaluated")

    monkeypatch.setattr(surface, "evaluate_grid", refuse)


def test_landscape_grid_over_the_cap_is_one_line_and_nothing_written(work, no_grid_sweep):
    r = invoke("landscape", "--grid", "100001", "--data", "digits", "--train-subset", "32",
               "--epochs", "1", "--device", "cpu", "--out", work / "results")  # fmt: skip
    one_error(r, 2, "grid must be at most 501 points per axis")
    assert not (work / "results").exists()
    path = case_file("grid_huge.yaml", work)
    for command in ("validate", "run"):
        r = invoke(command, path, *(["--no-check"] if command == "run" else []))
        one_error(r, 2, "landscape.grid: grid must be at most 501 points per axis")
    assert not (work / "results").exists()


def test_a_fifo_as_checkpoint_does_not_block_validation(work):
    fifo = work / "weights.pt"
    os.mkfifo(fifo)
    path = case_file("checkpoint_suite.yaml", work)
    path.write_text(path.read_text().replace(str(HOSTILE / "checkpoint_pickled.pt"), str(fifo)))
    r = unblocked(lambda: invoke("validate", path), fifo)
    one_error(r, 2, "weights.pt is a FIFO (named pipe), not a file")


# -- --set across cells ----------------------------------------------------------------------


def test_set_defaults_that_cells_override_warns_in_one_line_naming_them(work):
    path = case_file("set_defaults_overridden.yaml", work)
    r = invoke("validate", path, "--set", "defaults.train.epochs=1")
    assert r.exit_code == 0, r.output
    (line,) = [ln for ln in r.output.splitlines() if ln.startswith("warning:")]
    assert "--set defaults.train.epochs=1: 2 of 3 cells set train.epochs themselves" in line
    assert "fc_deq_tiny-fixed_point-ift-epochs=3_lr=0.01, fc_deq_tiny-anderson-ift-epochs=4" in line
    assert "--set all.train.epochs=1 forces it on every cell" in line
    r = invoke("validate", path, "--set", "all.train.epochs=1")
    assert r.exit_code == 0 and "warning:" not in r.output, r.output


def test_set_all_forces_a_value_on_every_cell_and_the_run_directory_records_it(work):
    from deqbench.run.suite import load_suite, suite_from_dict

    path = case_file("set_defaults_overridden.yaml", work)
    suite = load_suite(path, overrides=["all.train.epochs=1"])
    assert [c.train["epochs"] for c in suite.cells] == [1, 1, 1] and not suite.notes
    assert suite.cells[0].train["lr"] == 1.0e-2  # the rest of the case stays
    assert "epochs=1" in suite.cells[0].id  # the id names what runs
    again = suite_from_dict(suite.resolved)  # the run directory's suite.yaml: same cells
    assert again.hash == suite.hash
    # an axis over the key has the one value; a named section's values get it too
    text = path.read_text().split("matrix:")[0] + (
        "matrix: {train.epochs: [3, 4], solver: [anderson, {name: broyden, tol: 0.1}]}\n"
        "analyses: [metrics]\n"
    )
    path.write_text(text)
    suite = load_suite(path, overrides=["all.train.epochs=5", "all.solver.tol=0.01"])
    assert [(c.train["epochs"], c.solver["tol"]) for c in suite.cells] == [(5, 0.01)] * 2
    one_error(invoke("validate", path, "--set", "all.epochs=1"), 2, "expected all.SECTION.KEY")


def test_the_help_example_of_set_does_what_it_says():
    from deqbench.run.suite import load_suite

    r = invoke("--help")
    (item,) = re.findall(r"--set (\S+epochs=1)", r.output)
    suite = load_suite(Path(__file__).resolve().parents[1] / "suites" / "smoke.yaml",
                       overrides=[item])  # fmt: skip
    assert {c.train["epochs"] for c in suite.cells} == {1}, item
