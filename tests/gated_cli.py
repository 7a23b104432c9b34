"""The ``deqbench`` command line with one test analysis registered, for subprocess tests of
locks, signals and concurrency: ``python tests/gated_cli.py run SUITE ...``.

``test_gate`` blocks every task of seed >= 1 before training until the file named by
``$DEQBENCH_TEST_GATE`` exists (unset: never blocks), so a test knows that the run is alive
and between tasks. With ``$DEQBENCH_TEST_GO=PATH`` and ``$DEQBENCH_TEST_FORK=N``, the process
imports everything, forks N children and runs the command itself; each child waits for the
file PATH, appends its words to the command line and runs that (the children race from the
same point without paying the imports again), with its stderr in ``PATH.<i>.err``, its PID in
``PATH.<i>.pid`` and its exit code in ``PATH.<i>.rc``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from deqbench.analyses.base import Analysis, Row


class Gate(Analysis):
    name = "test_gate"
    needs_training = False

    def before_training(self, ctx):
        gate = os.environ.get("DEQBENCH_TEST_GATE")
        if gate and ctx.seed >= 1:
            while not os.path.exists(gate):
                time.sleep(0.01)
        yield Row("gate", 1.0)


def register() -> None:
    from deqbench.core.registry import analyses

    if "test_gate" not in analyses:
        analyses.add("test_gate", Gate)


def main() -> None:
    register()
    import deqbench.run.executors  # noqa: F401 - imported before the start line
    import deqbench.run.runner  # noqa: F401
    import deqbench.run.suite  # noqa: F401
    from deqbench.cli import app

    argv = sys.argv[1:]
    go = os.environ.get("DEQBENCH_TEST_GO")
    for i in range(int(os.environ.get("DEQBENCH_TEST_FORK") or 0) if go else 0):
        if os.fork() == 0:
            _child(app, argv, Path(go), i)
    sys.argv = ["deqbench", *argv]
    app(argv, prog_name="deqbench")


def _child(app, argv: list[str], go: Path, i: int) -> None:
    """Wait for ``go``, run the command with its words appended, record stderr and exit code."""
    code = 1
    try:
        Path(f"{go}.{i}.pid").write_text(str(os.getpid()))
        err = os.open(f"{go}.{i}.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(err, 2)
        while not go.exists():
            time.sleep(0.005)
        argv = argv + go.read_text().split()
        sys.argv = ["deqbench", *argv]
        app(argv, prog_name="deqbench")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.stderr.flush()
        Path(f"{go}.{i}.rc.tmp").write_text(str(code))
        os.replace(f"{go}.{i}.rc.tmp", f"{go}.{i}.rc")
        os._exit(code)


if __name__ == "__main__":
    main()
