"""The local Dask cluster on GPUs: workers fork from a forkserver that imported torch
and deqbench before any CUDA call (the default on GPUs), initialise CUDA after the fork on their
own GPU, and give the inline rows. GPU only (CI has none); each run is a fresh `deqbench run`
process, as a user starts it, so the forkserver starts with the command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml
from test_dask import HAVE_DASK, SMOKE, _key_rows, _run_dir

from deqbench.run.results import load_results

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not HAVE_DASK, reason="dask[distributed] is not installed"),
]


def _run(suite: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if "MULTIPROCESSING_METHOD" not in k}
    cmd = [sys.executable, "-m", "deqbench", "run", str(suite), "--device", "cuda"]
    cmd += ["--no-plots", "--no-progress", "--out", str(out), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def test_forked_gpu_workers_give_the_inline_rows(tmp_path):
    raw = yaml.safe_load(SMOKE.read_text())
    raw["defaults"]["model"] = {"name": "fc_deq_tiny"}
    raw["matrix"] = {"solver": ["fixed_point", "anderson"], "backward": ["ift", "unrolled"]}
    raw["seeds"] = [0, 1]
    suite = tmp_path / "gpu_fc.yaml"
    suite.write_text(yaml.safe_dump(raw, sort_keys=False))
    r = _run(suite, tmp_path / "inline")
    assert r.returncode == 0, r.stderr[-3000:]
    r = _run(suite, tmp_path / "dask", "--executor", "dask", "--workers", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    d = _run_dir(tmp_path / "dask")
    meta = json.loads((d / "run.json").read_text())
    assert meta["executor"]["start_method"] == "forkserver"
    assert meta["executor"]["workers_joined"] == 2
    a, b = _key_rows(load_results(_run_dir(tmp_path / "inline"))), _key_rows(load_results(d))
    assert set(b.status) == {"ok"}
    # cuDNN/cuBLAS pick kernels per process: GPU rows agree to rounding, not bit for bit
    pd.testing.assert_frame_equal(a, b, check_exact=False, rtol=1e-4, atol=1e-7)


def test_gpu_busy_reads_the_drivers_utilisation():
    """Busy near 1 while the GPU runs kernels back to back, near 0 while it waits."""
    import time

    from deqbench.run.env import GpuBusy

    torch.cuda.init()
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    time.sleep(1.0)  # a driver sample period (at most 1 s) with the GPU idle
    meter = GpuBusy().start()
    t = time.time()
    while time.time() - t < 2.0:
        for _ in range(20):
            a = torch.tanh(a @ a)
        torch.cuda.synchronize()
    busy = meter.stop()
    assert busy is not None and busy > 0.6, busy
    meter = GpuBusy().start()
    time.sleep(2.0)
    idle = meter.stop()
    assert idle is not None and idle < 0.4, idle
