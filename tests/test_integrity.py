"""Run directories that cannot be corrupted: one writer per run directory
(``run.lock``), the manifest check on ``--resume``, duplicate keys refused by ``load_results``,
SIGINT/SIGTERM, and a full disk while appending. Subprocesses only for locks, signals and
concurrency (tests/gated_cli.py)."""

from __future__ import annotations

import csv
import errno
import io
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
from conftest import TINY_SUITE, write_suite
from gated_cli import register as register_gate
from typer.testing import CliRunner

from deqbench.analyses.base import Analysis, Row
from deqbench.cli import app
from deqbench.core.errors import DataError
from deqbench.core.registry import analyses
from deqbench.errors import ConfigError
from deqbench.run import results as res
from deqbench.run import results_writer, runner
from deqbench.run.lock import RunLock, RunLocked
from deqbench.run.results import JOIN_KEYS, RUNNER, load_results
from deqbench.run.runner import run_suite
from deqbench.run.suite import load_suite

HERE = Path(__file__).resolve().parent


class _Kill(Analysis):
    """Sends $TEST_KILL_SIGNAL to this process (once) before training seed 1."""

    name = "test_kill"
    needs_training = False

    def before_training(self, ctx):
        signum = os.environ.get("TEST_KILL_SIGNAL")
        if signum and ctx.seed == 1:
            del os.environ["TEST_KILL_SIGNAL"]
            os.kill(os.getpid(), int(signum))
            time.sleep(1)  # the handler runs at once; today's default would end here
        yield Row("kill", 1.0)


@pytest.fixture(autouse=True, scope="module")
def _test_plugins():
    register_gate()
    analyses.add("test_kill", _Kill)
    yield
    analyses.remove("test_kill")
    analyses.remove("test_gate")


class _TestSignal(Exception):
    """What a signal raises where deqbench installs no handler of its own (today's code): a
    plain failure instead of the test process dying or pytest stopping."""


@pytest.fixture
def guard_signals():
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def handler(signum, frame):
        raise _TestSignal(signal.Signals(signum).name)

    for s in old:
        signal.signal(s, handler)
    yield
    for s, h in old.items():
        signal.signal(s, h)


def _suite(tmp_path: Path, seeds: str = "[0, 1, 2]", analyses: str = "[metrics]") -> Path:
    """One cell, synthetic data (no sklearn), one epoch: well under a second per task."""
    return write_suite(
        tmp_path,
        TINY_SUITE,
        replace={
            "seeds: [0]": f"seeds: {seeds}",
            "data: {name: digits, train_subset: 64, test_subset: 32}": (
                "data: {name: synthetic, n_train: 64, n_test: 32, dim: 8}"
            ),
            "matrix:\n  backward: [ift, unrolled]\n": "",
            "[metrics, solver_stats]": analyses,
        },
    )


def _key_rows(df: pd.DataFrame) -> pd.DataFrame:
    """Results without run id, timings and per-process start-up rows, in a canonical order."""
    df = df[df.analysis != "process"].drop(columns=["run_id"]).copy()
    df.loc[df.unit == "s", "value"] = math.nan
    return df.sort_values(JOIN_KEYS).reset_index(drop=True)


def _snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _meta(d: Path) -> dict:
    return json.loads((d / "run.json").read_text())


# -- one writer per run directory -------------------------------------------------------------


def test_a_second_writer_is_refused_naming_the_holder_and_a_dead_ones_lock_is_taken_over(
    tmp_path, capsys
):
    p = _suite(tmp_path, seeds="[0, 1]")
    d = run_suite(load_suite(p), progress=False, plots=False).run_dir
    assert not (d / "run.lock").exists()  # released at the end
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from deqbench.run.lock import RunLock; "
         "RunLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(120)", str(d)],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        lock = json.loads((d / "run.lock").read_text())
        assert lock["pid"] == holder.pid and lock["host"] == socket.gethostname()
        before = _snapshot(d)
        with pytest.raises(RunLocked) as err:
            run_suite(load_suite(p), resume=d, progress=False, plots=False)
        msg = str(err.value)
        assert "\n" not in msg and f"PID {holder.pid} on host {socket.gethostname()}" in msg
        assert f"started {lock['started']}" in msg
        r = CliRunner().invoke(app, ["run", str(p), "--resume", str(d), "--no-check"])
        assert r.exit_code == 2 and f"PID {holder.pid}" in r.output, r.output
        assert _snapshot(d) == before  # nothing written by the refused writers
    finally:
        holder.kill()  # SIGKILL: its lock file stays behind, stale
        holder.wait()
    assert json.loads((d / "run.lock").read_text())["pid"] == holder.pid
    capsys.readouterr()
    again = run_suite(load_suite(p), resume=d, progress=False, plots=False)
    err_lines = [ln for ln in capsys.readouterr().err.splitlines() if "stale lock" in ln]
    assert len(err_lines) == 1 and f"PID {holder.pid}" in err_lines[0], err_lines
    assert again.exit_code == 0 and again.skipped == 2 and not (d / "run.lock").exists()
    assert "stale lock" in (d / "log.txt").read_text()


def test_a_lock_of_another_host_is_reported_and_never_taken_over(tmp_path):
    p = _suite(tmp_path, seeds="[0]")
    d = run_suite(load_suite(p), progress=False, plots=False).run_dir
    text = json.dumps({"pid": _dead_pid(), "host": "elsewhere.example", "started": "T0"})
    (d / "run.lock").write_text(text)
    before = _snapshot(d)
    with pytest.raises(RunLocked, match="another host.*elsewhere.example.*never taken over"):
        run_suite(load_suite(p), resume=d, progress=False, plots=False)
    assert _snapshot(d) == before


def test_racing_takers_of_a_stale_lock_leave_one_writer(tmp_path):
    (tmp_path / "run.lock").write_text(
        json.dumps({"pid": _dead_pid(), "host": socket.gethostname(), "started": "T0"})
    )
    n = 6
    barrier = threading.Barrier(n)
    won, refused = [], []

    def take():
        lock = RunLock(tmp_path)
        barrier.wait()
        try:
            won.append(lock.acquire())
        except RunLocked as exc:
            refused.append(str(exc))

    threads = [threading.Thread(target=take) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(refused) == n - 1, (won, refused)
    assert "stale lock" in won[0].note
    assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
    won[0].release()
    assert not (tmp_path / "run.lock").exists()


@pytest.mark.slow  # several seconds on 2 cores: out of the fast lane
def test_a_run_and_two_resumes_started_together_leave_one_writer_and_sigterm_exits_143(
    tmp_path,
):
    """A run plus two ``--resume`` of it (processes forked from one that imported everything,
    the two released at once): the resumes are refused (exit 2, one line naming the holder,
    nothing written); SIGTERM after the first task stops the run (exit 143, run.json
    interrupted, resume command printed); the resumed run equals an uninterrupted one."""
    p = _suite(tmp_path, seeds="[0, 1, 2]", analyses="[metrics, test_gate]")
    go = tmp_path / "go"
    env = {
        **os.environ,
        "DEQBENCH_TEST_GATE": str(tmp_path / "gate-never"),
        "DEQBENCH_TEST_GO": str(go),
        "DEQBENCH_TEST_FORK": "2",
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, str(HERE / "gated_cli.py"), "run", str(p), "--no-progress",
           "--no-plots", "--no-check"]  # fmt: skip
    run = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rc = [Path(f"{go}.{i}.rc") for i in range(2)]
    try:
        deadline = time.time() + 240
        run_dir = None
        while time.time() < deadline and run.poll() is None:
            found = list((tmp_path / "results").glob("tiny/*/results.csv"))
            if found and b"," + RUNNER.encode() + b"," in found[0].read_bytes():
                run_dir = found[0].parent  # seed 0 finished; the run waits before seed 1
                break
            time.sleep(0.02)
        assert run_dir is not None, run.communicate(timeout=60)[1][-3000:]
        before = _snapshot(run_dir)
        go.write_text(f"--resume {run_dir}")
        while time.time() < deadline and not all(f.exists() for f in rc):
            time.sleep(0.02)
        for i, f in enumerate(rc):
            err = Path(f"{go}.{i}.err").read_text()
            assert f.exists() and f.read_text() == "2", err[-3000:]
            lines = [ln for ln in err.splitlines() if ln.strip()]
            assert len(lines) == 1, err
            assert "another deqbench run is writing" in lines[0]
            assert f"PID {run.pid} on host {socket.gethostname()}, started" in lines[0]
        assert _snapshot(run_dir) == before
        run.send_signal(signal.SIGTERM)
        out, err = run.communicate(timeout=120)
    finally:
        for pid_file in tmp_path.glob("go.*.pid"):
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 143, err[-3000:]
    assert "SIGTERM" in err and f"--resume {run_dir}" in err
    meta = _meta(run_dir)
    assert meta["status"] == "interrupted" and meta["cause"] == "SIGTERM"
    assert meta["exit_code"] == 143 and meta["tasks_finished"] == 1
    assert not (run_dir / "run.lock").exists()
    again = run_suite(load_suite(p), resume=run_dir, progress=False, plots=False)
    assert again.exit_code == 0 and again.skipped == 1 and again.tasks == 2
    meta = _meta(run_dir)
    assert meta["status"] == "complete" and len(meta["resumed"]) == 1
    resumed = load_results(run_dir)
    full = load_results(
        run_suite(load_suite(p), out=tmp_path / "full", progress=False, plots=False).run_dir
    )
    assert (resumed.analysis == RUNNER).sum() == 3
    pd.testing.assert_frame_equal(_key_rows(resumed), _key_rows(full))


# -- integrity on resume ----------------------------------------------------------------------


def _lines_by_seed(path: Path) -> tuple[bytes, dict[int, list[bytes]]]:
    lines = path.read_bytes().splitlines(keepends=True)
    header = next(csv.reader([lines[0].decode()]))
    i = header.index("seed")
    out: dict[int, list[bytes]] = {}
    for ln in lines[1:]:
        out.setdefault(int(next(csv.reader([ln.decode()]))[i]), []).append(ln)
    return lines[0], out


def test_resume_reruns_tasks_whose_rows_are_duplicated_missing_or_changed(tmp_path, capsys):
    p = _suite(tmp_path, seeds="[0, 1, 2, 3]")
    d = run_suite(load_suite(p), progress=False, plots=False).run_dir
    reference = _key_rows(load_results(d))
    header, rows = _lines_by_seed(d / "results.csv")
    # seed 0 appended twice; one row of seed 1 deleted; a value of seed 2 changed
    rows[0] = rows[0] + rows[0]
    rows[1] = [ln for ln in rows[1] if b"," + RUNNER.encode() + b"," in ln or ln != rows[1][0]]
    fields = next(csv.reader([rows[2][0].decode()]))
    fields[res.COLUMNS.index("value")] = "12345.0"
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow(fields)
    rows[2][0] = buf.getvalue().encode()
    (d / "results.csv").write_bytes(header + b"".join(b"".join(rows[s]) for s in (0, 1, 2, 3)))
    with pytest.raises(DataError, match="share their key") as err:
        load_results(d)
    assert "\n" not in str(err.value) and "--resume" in str(err.value)
    capsys.readouterr()
    again = run_suite(load_suite(p), resume=d, progress=False, plots=False)
    notes = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("note: resume:")]
    assert len(notes) == 3, notes
    for seed, why in ((0, "duplicated"), (1, "missing"), (2, "changed")):
        assert any(f"seed={seed}:" in n and f"(rows {why})" in n for n in notes), (seed, notes)
    assert again.exit_code == 0 and again.skipped == 1 and again.tasks == 3
    assert len(_meta(d)["resumed"][-1]["rerun"]) == 3
    after = load_results(d)
    assert not after.duplicated(JOIN_KEYS).any()
    pd.testing.assert_frame_equal(_key_rows(after), reference)
    # the manifest now records the re-run tasks: a second resume trusts everything
    capsys.readouterr()
    last = run_suite(load_suite(p), resume=d, progress=False, plots=False)
    assert last.skipped == 4 and last.tasks == 0 and "resume:" not in capsys.readouterr().err


def test_a_run_directory_without_manifest_resumes_as_before_only_without_run_json_schema(
    tmp_path, capsys
):
    p = _suite(tmp_path, seeds="[0, 1]")
    d = run_suite(load_suite(p), progress=False, plots=False).run_dir
    (d / res.MANIFEST).unlink()
    header, rows = _lines_by_seed(d / "results.csv")
    rows[1] = rows[1][:-1]  # seed 1 lost its runner row: unfinished, runs again (silently)
    (d / "results.csv").write_bytes(header + b"".join(rows[0] + rows[1]))
    # run.json records results schema 2, written with a manifest: without it, refused
    with pytest.raises(ConfigError, match="manifest.jsonl is missing"):
        run_suite(load_suite(p), resume=d, progress=False, plots=False)
    # a run directory of an older deqbench (no results_schema: the lines of results.csv
    # cannot be checked) is read as before by check_finished
    meta = _meta(d)
    del meta["results_schema"]
    (d / "run.json").write_text(json.dumps(meta))
    done, notes = res.check_finished(d)
    assert done == {(load_suite(p).cells[0].id, 0)} and not notes
    # it has a manifest now, of every finished task
    recorded = [json.loads(ln) for ln in (d / res.MANIFEST).read_text().splitlines()]
    assert sorted(e["seed"] for e in recorded) == [0]


# -- signals ----------------------------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_sigint_and_sigterm_stop_the_run_cleanly(tmp_path, monkeypatch, guard_signals, signum):
    p = _suite(tmp_path, seeds="[0, 1, 2]", analyses="[metrics, test_kill]")
    monkeypatch.setenv("TEST_KILL_SIGNAL", str(int(signum)))
    summary = run_suite(load_suite(p), progress=False, plots=False)
    assert summary.interrupted and summary.exit_code == 128 + signum
    d = summary.run_dir
    meta = _meta(d)
    assert meta["status"] == "interrupted" and meta["cause"] == signal.Signals(signum).name
    assert meta["exit_code"] == 128 + signum and meta["tasks_finished"] == 1
    assert not (d / "run.lock").exists()
    again = run_suite(load_suite(p), resume=d, progress=False, plots=False)
    assert again.exit_code == 0 and _meta(d)["status"] == "complete" and "cause" not in _meta(d)


def test_a_signal_after_the_last_task_leaves_the_run_complete(
    tmp_path, monkeypatch, guard_signals, capsys
):
    p = _suite(tmp_path, seeds="[0, 1]")
    append, status, sent = res.ResultsWriter.append, res.task_status, []

    def append_then_signal(self, rows, **kw):
        rows = list(rows)
        append(self, rows, **kw)
        if rows and rows[0]["seed"] == 1:  # while the last task is written
            sent.append("append")
            os.kill(os.getpid(), signal.SIGTERM)

    def status_then_signal(df):
        sent.append("status")
        os.kill(os.getpid(), signal.SIGINT)
        return status(df)

    def plots_then_signal(run_dir, df):
        sent.append("plots")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)
        return []

    monkeypatch.setattr(res.ResultsWriter, "append", append_then_signal)
    monkeypatch.setattr(res, "task_status", status_then_signal)
    monkeypatch.setattr(runner, "_plots", plots_then_signal)
    summary = run_suite(load_suite(p), progress=False, plots=True)
    assert sent == ["append", "status", "plots"]
    assert not summary.interrupted and summary.exit_code == 0
    meta = _meta(summary.run_dir)
    assert meta["status"] == "complete" and meta["exit_code"] == 0 and meta["tasks_finished"] == 2
    assert "after the last task finished" in capsys.readouterr().err


# -- disk full --------------------------------------------------------------------------------


def test_disk_full_while_appending_leaves_a_resumable_interrupted_run(tmp_path, monkeypatch):
    p = _suite(tmp_path, seeds="[0, 1, 2]")
    write, calls = os.write, []

    def full(fd, data):  # the second append to results.csv finds the disk full
        csvs = {q.stat().st_ino for q in (tmp_path / "results").glob("tiny/*/results.csv")}
        if os.fstat(fd).st_ino in csvs:
            calls.append(fd)
            if len(calls) == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
        return write(fd, data)

    monkeypatch.setattr(os, "write", full)
    r = CliRunner().invoke(app, ["run", str(p), "--no-progress", "--no-plots", "--no-check"])
    monkeypatch.setattr(os, "write", write)
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.stderr.splitlines() if "No space left on device" in ln]
    assert len(lines) == 1 and "--resume" in lines[0], r.stderr
    d = next((tmp_path / "results" / "tiny").iterdir())
    meta = _meta(d)
    assert meta["status"] == "interrupted" and "No space left on device" in meta["cause"]
    assert meta["tasks_finished"] == 1 and not (d / "run.lock").exists()
    again = run_suite(load_suite(p), resume=d, progress=False, plots=False)
    assert again.exit_code == 0 and again.skipped == 1 and again.tasks == 2
    full_run = run_suite(load_suite(p), out=tmp_path / "full", progress=False, plots=False)
    pd.testing.assert_frame_equal(
        _key_rows(load_results(d)), _key_rows(load_results(full_run.run_dir))
    )


def test_a_resume_reads_under_the_lock_and_releases_it_when_refused(tmp_path, monkeypatch):
    p = _suite(tmp_path, seeds="[0]")
    d = run_suite(load_suite(p), progress=False, plots=False).run_dir
    other = write_suite(tmp_path, TINY_SUITE, name="other.yaml")
    read, locked = res.read_json, []

    def read_json(path):
        locked.append((d / "run.lock").exists())
        return read(path)

    monkeypatch.setattr(res, "read_json", read_json)
    with pytest.raises(ConfigError, match="made from a different suite"):
        run_suite(load_suite(other), resume=d, progress=False, plots=False)
    assert locked == [True] and not (d / "run.lock").exists()


def test_resume_of_a_corrupt_run_json_is_one_line_and_writes_nothing(tmp_path):
    p = _suite(tmp_path, seeds="[0]")
    d = run_suite(load_suite(p), progress=False, plots=False).run_dir
    for text in (b"", b'{"run_id": ', b"[1, 2]", b"\xff\xfe"):
        (d / "run.json").write_bytes(text)
        before = _snapshot(d)
        r = CliRunner().invoke(app, ["run", str(p), "--resume", str(d), "--no-check"])
        assert r.exit_code == 2 and "corrupt run.json" in r.output, (text, r.output)
        assert len([ln for ln in r.output.splitlines() if ln.strip()]) == 1, r.output
        assert _snapshot(d) == before


# -- leftovers: seeds range cap, limited YAML in _run_meta, run.json with the directory, plots --


def test_a_seeds_range_over_the_task_cap_is_refused_before_it_is_built(tmp_path):
    from deqbench.cli import parse_seeds

    p = _suite(tmp_path, seeds="[0]")
    r = CliRunner().invoke(app, ["run", str(p), "--seeds", "0-20000", "--no-check"])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--seeds 0-20000: 20001 seeds, over the cap of 10000" in lines[0]
    assert not (tmp_path / "results").exists()
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match="10000000001 seeds, over the cap"):
        parse_seeds("0-10000000000")
    with pytest.raises(ConfigError, match="over the cap"):
        parse_seeds("0-10000000000", ["caps=true"])
    assert time.perf_counter() - t0 < 0.5
    assert parse_seeds("5, 0-2") == [5, 0, 1, 2]
    assert len(parse_seeds("0-10000", ["caps=false"]) or []) == 10_001


def test_the_suites_own_caps_false_lifts_the_seeds_range_cap(tmp_path):
    """`caps: false` in the suite file lifts the --seeds cap as --set caps=false does (before,
    only the override did: the range was refused before the file was read); --set caps=true
    puts it back; a collection lifts it where every member does."""
    p = _suite(tmp_path, seeds="[0]")
    p.write_text("caps: false\n" + p.read_text())
    r = CliRunner().invoke(app, ["validate", str(p), "--seeds", "0-10000"])
    assert r.exit_code == 0, r.output
    assert "1 cell x 10001 seeds = 10001 tasks" in r.output
    r = CliRunner().invoke(app, ["validate", str(p), "--seeds", "0-10000", "--set", "caps=true"])
    assert r.exit_code == 2 and "--seeds 0-10000: 10001 seeds, over the cap" in r.output
    (tmp_path / "capped").mkdir()
    capped = _suite(tmp_path / "capped", seeds="[0]")
    coll = tmp_path / "coll.yaml"
    for members, code in (([p, p], 0), ([p, capped], 2)):
        names = ", ".join(str(m.relative_to(tmp_path)) for m in members)
        coll.write_text(f"schema: 1\nname: coll\nsuites: [{names}]\n")
        r = CliRunner().invoke(app, ["validate", str(coll), "--seeds", "0-10000"])
        assert r.exit_code == code, r.output
    assert "over the cap" in r.output
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("name", ["alias_bomb.yaml", "deep_nesting.yaml"])
def test_run_meta_reads_suite_yaml_with_the_limited_loader(tmp_path, name):
    hostile = Path(__file__).resolve().parent / "hostile" / name
    (tmp_path / "run.json").write_text("{}")
    (tmp_path / "suite.yaml").write_bytes(hostile.read_bytes())
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match="YAML refused"):
        res._run_meta(tmp_path)
    assert time.perf_counter() - t0 < 1


class _Killed(BaseException):
    """Stands for a SIGKILL: nothing after it runs."""


def test_a_run_killed_as_its_directory_appears_leaves_run_json_and_resumes(tmp_path, monkeypatch):
    p = _suite(tmp_path, seeds="[0, 1]")

    def killed(self):
        raise _Killed

    monkeypatch.setattr(RunLock, "acquire", killed)  # the first thing after the directory
    with pytest.raises(_Killed):
        run_suite(load_suite(p), progress=False, plots=False)
    monkeypatch.undo()
    (d,) = (tmp_path / "results" / "tiny").iterdir()  # no staging directory left either
    assert sorted(q.name for q in d.iterdir()) == ["run.json", "suite.yaml"]
    meta = _meta(d)
    assert meta["status"] == "running" and meta["run_id"] == d.name
    assert meta["tasks_total"] == 2 and meta["suite_hash"] == load_suite(p).hash
    assert load_suite(d / "suite.yaml").hash == load_suite(p).hash
    again = run_suite(load_suite(p), resume=d, progress=False, plots=False)
    assert again.exit_code == 0 and again.tasks == 2 and _meta(d)["status"] == "complete"


def test_a_run_directory_that_cannot_be_written_whole_does_not_appear(tmp_path, monkeypatch):
    p = _suite(tmp_path, seeds="[0]")
    write = res.write_atomic

    def full(path, data):
        if Path(path).name == "suite.yaml":
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(path, data)

    monkeypatch.setattr(results_writer, "write_atomic", full)  # new_run_dir writes with it
    with pytest.raises(ConfigError, match="cannot write the run directory: OSError"):
        run_suite(load_suite(p), progress=False, plots=False)
    assert list((tmp_path / "results" / "tiny").iterdir()) == []
    monkeypatch.undo()
    a = run_suite(load_suite(p), progress=False, plots=False).run_dir
    b = run_suite(load_suite(p), progress=False, plots=False).run_dir  # same second: "-1"
    assert a != b and _meta(a)["run_id"] == a.name and _meta(b)["run_id"] == b.name


def test_plots_that_cannot_be_written_are_one_stderr_line_each_and_keep_the_exit_code(
    tmp_path, monkeypatch
):
    from deqbench.run import plots

    p = _suite(tmp_path, seeds="[0]")

    def full(fig, path, dpi=120):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(plots, "save_figure", full)
    r = CliRunner().invoke(app, ["run", str(p), "--no-progress", "--no-check"])
    assert r.exit_code == 0, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("plots: ")]
    assert lines, r.stderr
    assert all(" not written: OSError: " in ln and "No space left" in ln for ln in lines), lines
    d = next((tmp_path / "results" / "tiny").iterdir())
    assert _meta(d)["status"] == "complete" and _meta(d)["exit_code"] == 0
    assert "No space left on device" in (d / "log.txt").read_text()
