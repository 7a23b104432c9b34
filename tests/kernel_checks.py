"""Running a check script of the Triton kernels in a subprocess (the ``tests/test_fused*.py``
files): on ``cpu`` under Triton's interpreter (``TRITON_INTERPRET=1`` must be set before Triton
is imported, hence the subprocess), on ``cuda`` compiled; the fused kernels switched on. The
script prints a JSON summary as its last line, which is returned."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def run_checks(script: str, dev: str, *args: str) -> dict:
    interpret = "1" if dev == "cpu" else "0"
    env = {**os.environ, "TRITON_INTERPRET": interpret, "DEQBENCH_FUSED": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", script, dev, *args],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
