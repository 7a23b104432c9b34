"""The masked step's stop test in Triton kernels (``deqbench.run.captured_kernels``) against the
torch masked step it replaces: the same counts, stops, flags and iterates, residuals within
rounding, for every stop rule, rel and abs, float32 and float64, states split over several
programs, a NaN and the budget. CPU: under Triton's interpreter in a subprocess; GPU: compiled,
in a ``gpu``-marked test."""

from __future__ import annotations

import textwrap

import pytest
import torch
from kernel_checks import run_checks

pytest.importorskip("triton")

CHECKS = textwrap.dedent(
    r"""
    import json, sys
    import torch
    from deqbench.run import captured_kernels as ck
    from deqbench.run.captured_step import MaskedSolve

    dev = sys.argv[1]
    ck.ENABLED = True
    checked = converged = 0

    def pair(shape, dt, rule, mode, tol, max_iter, make):
        out = []
        for fused in (False, True):
            ck.ENABLED = fused
            fn = make()
            z = torch.zeros(shape, dtype=dt, device=dev)
            s = MaskedSolve(z, tol, mode, rule, max_iter, protect=1e6)
            assert (s.fused is not None) == fused
            s.reset()
            trail = []
            extra = 2  # steps after the stop: nothing may move
            for _ in range(max_iter + extra):
                s.step(fn)
                trail.append((int(s.nstep), bool(s.halt), bool(s.conv), bool(s.div)))
                extra -= trail[-1][1]
                if extra == 0:
                    break
            out.append((s, z, trail))
        return out

    g = torch.Generator().manual_seed(0)
    for dt, rtol in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
        for shape in ((5, 3, 7), (2, ck.CHUNK + 37)):  # the second: two programs a sample
            c = torch.rand(shape, generator=g, dtype=torch.float64).to(dev, dt) + 0.5
            rates = torch.linspace(0.3, 0.8, shape[0], dtype=torch.float64).to(dev, dt)
            rates = rates.view(-1, *([1] * (len(shape) - 1)))
            fn = lambda v: rates * v + c  # contractions at several rates
            same = lambda: fn
            for rule in ("sample_max", "batch_mean", "batch_fro"):
                for mode in ("rel", "abs"):
                    (s0, z0, t0), (s1, z1, t1) = pair(shape, dt, rule, mode, 1e-2, 30, same)
                    assert t0 == t1, (dt, shape, rule, mode, t0, t1)
                    assert t0[-1][1] and t0[-1][0] > 3, (dt, shape, rule, mode, t0[-1])
                    converged += t0[-1][2]
                    assert torch.equal(z0, z1)
                    for a, b in ((s0.abs_r, s1.abs_r), (s0.rel_r, s1.rel_r),
                                 (s0.value, s1.value), (s0.abs0, s1.abs0)):
                        torch.testing.assert_close(a, b, rtol=rtol, atol=0)
                    checked += 1
            # the budget: never converges (tol 0), stops at max_iter with its iterate kept
            (s0, z0, t0), (s1, z1, t1) = pair(shape, dt, "batch_fro", "rel", 0.0, 6, same)
            assert t0 == t1 and t0[-1] == (6, True, False, False) and torch.equal(z0, z1)

            def nan_at_3():  # a NaN at the third evaluation: diverged there, its input kept
                calls = [0]

                def f(v):
                    calls[0] += 1
                    return fn(v) * float("nan") if calls[0] == 3 else fn(v)

                return f

            (s0, z0, t0), (s1, z1, t1) = pair(shape, dt, "sample_max", "rel", 1e-12, 10, nan_at_3)
            assert t0 == t1 and t0[-1] == (3, True, False, True), (t0, t1)
            assert torch.equal(z0, z1) and torch.isfinite(z1).all()
            checked += 2
    assert converged >= 12, converged  # most stop on the rule, the others on the budget
    print(json.dumps({"checked": checked}))
    """
)


@pytest.mark.slow  # Triton interpreter
def test_fused_masked_step_matches_the_torch_step_on_cpu_interpreter():
    assert run_checks(CHECKS, "cpu") == {"checked": 32}


def test_fused_masked_step_is_on_where_triton_runs(monkeypatch):
    """On by default with the other fused kernels (``DEQBENCH_FUSED``); a CPU state without
    Triton's interpreter takes the torch step; switched off, a CUDA state does too."""
    from deqbench.core import triton_env
    from deqbench.run import captured_kernels
    from deqbench.run.captured_step import MaskedSolve

    assert captured_kernels.ENABLED == triton_env.ENABLED_BY_ENV
    s = MaskedSolve(torch.zeros(2, 3), 1e-3, "rel", "batch_fro", 5, protect=1e6)
    assert (s.fused is not None) == (captured_kernels.ENABLED and triton_env.INTERPRET)
    cuda = torch.cuda.is_available()
    x = torch.zeros(2, 3, device="cuda" if cuda else "cpu")
    monkeypatch.setattr(captured_kernels, "ENABLED", True)
    assert captured_kernels.usable(x, "batch_fro", "rel") == (cuda or triton_env.INTERPRET)
    monkeypatch.setattr(captured_kernels, "ENABLED", False)
    assert not captured_kernels.usable(x, "batch_fro", "rel")
    monkeypatch.setattr(captured_kernels, "ENABLED", True)
    assert not captured_kernels.usable(x, "batch_fro", "max_norm")  # no such stop mode


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_masked_step_matches_the_torch_step_on_cuda():
    assert run_checks(CHECKS, "cuda") == {"checked": 32}


def test_run_json_records_whether_the_fused_kernels_run_on_the_device(monkeypatch):
    """``flags.fused_kernels``: on where the switch is on and Triton runs on the run's device
    (CUDA, or the CPU under the interpreter); off with ``DEQBENCH_FUSED=0``'s switch."""
    from deqbench.core import triton_env
    from deqbench.run.env import flags

    assert flags("cpu")["fused_kernels"] == (triton_env.ENABLED_BY_ENV and triton_env.INTERPRET)
    assert flags("cuda")["fused_kernels"] == triton_env.ENABLED_BY_ENV
    assert flags("no-such-device")["fused_kernels"] is False
    monkeypatch.setattr(triton_env, "ENABLED_BY_ENV", False)
    assert flags("cuda")["fused_kernels"] is False
