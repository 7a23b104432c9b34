"""Running a check script of the Triton kernels in a subprocess (the ``tests/test_fused*.py``
files): on ``cpu`` under Triton's interpreter (``TRITON_INTERPRET=1`` must be set before Triton
is imported, hence the subprocess), on ``cuda`` compiled; the fused kernels switched on. The
script prints a JSON summary as its last line, which is returned."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest

#: a kernel with what deqbench's kernels use, run under the interpreter: a loop whose bound is a
#: runtime argument. Some Triton versions' CPU interpreter cannot run it (torch 2.11's Triton:
#: "only 0-dimensional arrays can be converted to Python scalars"), which is no fault of the
#: kernels: there the interpreter checks are skipped (the gpu tests run the compiled kernels)
PROBE = """
import torch, triton, triton.language as tl

@triton.jit
def k(x_ptr, out_ptr, L, BLOCK: tl.constexpr):
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(0, L, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + idx, mask=idx < L, other=0.0)
    tl.store(out_ptr + tl.arange(0, BLOCK), acc)

x = torch.arange(10, dtype=torch.float32)
out = torch.empty(4)
k[(1,)](x, out, 10, BLOCK=4)
assert float(out.sum()) == 45.0, out
"""


@functools.cache
def interpreter_problem() -> str | None:
    """None when this Triton's CPU interpreter runs the probe kernel, else why not."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300
    )
    if proc.returncode == 0:
        return None
    last = (proc.stderr.strip().splitlines() or ["?"])[-1]
    return f"this Triton's CPU interpreter cannot run a runtime-bounded loop ({last[:160]})"


def run_checks(script: str, dev: str, *args: str) -> dict:
    if dev == "cpu" and (why := interpreter_problem()) is not None:
        pytest.skip(why)
    interpret = "1" if dev == "cpu" else "0"
    env = {**os.environ, "TRITON_INTERPRET": interpret, "DEQBENCH_FUSED": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", script, dev, *args],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
