"""The fused bookkeeping kernels (deqbench/solvers/fused.py) against the torch code they replace
and against independent references (norms computed directly, a dense float64 solve of the
Anderson system). CPU: the kernels run under Triton's interpreter in a subprocess
(``TRITON_INTERPRET=1`` must be set before Triton is imported); GPU: the same checks on CUDA in
``gpu``-marked tests."""

from __future__ import annotations

import textwrap

import pytest
import torch
from kernel_checks import run_checks

triton = pytest.importorskip("triton")

#: the checks, run as a script (CPU under the interpreter, or CUDA in-process)
CHECKS = textwrap.dedent(
    r"""
    import json, math, sys
    import torch
    import deqbench
    from deqbench.solvers import fused
    from deqbench.solvers.base import CommonOptions, Tracker, clear_graph_cache

    dev = sys.argv[1]
    split = sys.argv[2] == "split"
    if split:  # every state below is split over programs of 8 elements (three launches)
        fused.SPLIT_MIN, fused.CHUNK = 8, 8
    assert (fused.splits(15) == 2) == split and (fused.splits(24) == 3) == split
    out = {}

    def tracker(z0, returns="lowest", stop_mode="rel"):
        t = Tracker("t", z0, max_iter=8, tol=1e-6, stop_mode=stop_mode,
                    common=CommonOptions(returns=returns))
        t.enable_device_mode(z0)
        return t

    # 1. one record step against directly computed norms, lowest mask, slots, summary, counter
    for dt in (torch.float32, torch.float64):
        for returns in ("lowest", "last"):
            for stop_mode in ("rel", "abs"):
                g = torch.Generator().manual_seed(0)
                B, nc, cd, m = 6, 3, 5, 4
                z = torch.randn(B, nc * cd, generator=g, dtype=dt).to(dev)
                fz = torch.randn(B, nc * cd, generator=g, dtype=dt).to(dev)
                t = tracker(z, returns, stop_mode)
                assert fused.tracker_usable(t, z, fz), "fused path not taken"
                a = torch.linalg.vector_norm(fz - z, dim=1)
                r = a / (torch.linalg.vector_norm(fz, dim=1) + 1e-9)
                res = r if stop_mode == "rel" else a
                low0 = res * torch.tensor([0.5, 2.0] * (B // 2), dtype=dt, device=dev)
                t.dev_low.copy_(low0)  # every other sample improves
                t.dev_k.fill_(5)  # slot 5 % 4 = 1
                best0 = torch.full_like(z, 7.0)
                t.best_z.copy_(best0)
                F = torch.zeros(B, nc, m, cd, dtype=dt, device=dev)
                G = torch.zeros_like(F)
                t.dev_j = 2
                out_z = z.clone()
                fused.record(t, out_z, fz, copy_to=out_z, slots=(F, G, m, cd))
                tol = 1e-6 if dt == torch.float32 else 1e-13
                row = t.trace[5]
                assert torch.allclose(row[0], a, rtol=tol, atol=0), "abs"
                assert torch.allclose(row[1], r, rtol=tol, atol=0), "rel"
                st = t.dev_st[2]
                if returns == "lowest":
                    better = res <= low0
                    assert 0 < int(better.sum()) < B, "the case must mix improving and not"
                    low = torch.where(better, res, low0)
                    assert torch.allclose(row[2], low, rtol=tol) and torch.equal(t.dev_low, row[2])
                    assert torch.allclose(row[3], res - low, rtol=tol, atol=tol)
                    want = torch.where(better[:, None], z, best0)
                    assert torch.equal(t.best_z, want), "lowest iterate"
                    assert torch.equal(st, row.amax(1)), "summary"
                else:
                    assert torch.equal(t.best_z, z)
                    assert torch.equal(st[:2], row[:2].amax(1))
                assert torch.equal(out_z, fz), "copy_to"
                assert torch.equal(F[:, :, 1], fz.view(B, nc, cd)), "F slot"
                assert torch.equal(G[:, :, 1], (fz - z).view(B, nc, cd)), "G slot"
                others = [0, 2, 3]
                assert not F[:, :, others].any() and not G[:, :, others].any()
                assert int(t.dev_k) == 6, "step counter"

    # 2. a NaN sample: the summary is NaN (amax propagates it), the sample never the lowest
    z = torch.zeros(4, 8, dtype=torch.float32, device=dev)
    fz = torch.ones_like(z)
    fz[2, 3] = float("nan")
    t = tracker(z)
    fused.record(t, z, fz)
    st = t.dev_st[0]
    assert math.isnan(float(st[0])) and math.isnan(float(st[1])), st
    assert math.isinf(float(t.dev_low[2])) and float(t.dev_low[0]) < 1.1

    # 3. Anderson weights against a dense float64 solve, unused slots, fallback
    g = torch.Generator().manual_seed(1)
    B, nc, m, cd = 5, 2, 6, 7
    Gb = torch.randn(B, nc, m, cd, generator=g).to(dev)
    used = 4  # slots written so far (k = 4 evaluations): slots 4, 5 unused (zero)
    Gb[:, :, used:] = 0
    Gb[3] = float("nan")  # sample 3: a failed solve -> one-hot on the newest slot (3)
    Hc = torch.bmm(Gb.view(B * nc, m, cd), Gb.view(B * nc, m, cd).transpose(1, 2))
    alpha = torch.empty(B, m, device=dev)
    fb = torch.zeros(B, dtype=torch.int64, device=dev)
    k = torch.tensor([used], device=dev)
    lam, lam_abs = 1e-3, 1e-6
    fused.anderson_weights(Hc, alpha, fb, k, m, lam, lam_abs)
    H = Hc.view(B, nc, m, m).double().sum(1)[:, :used, :used]
    reg = H.diagonal(dim1=1, dim2=2).amax(1) * lam + lam_abs
    H = H + reg[:, None, None] * torch.eye(used, dtype=torch.float64, device=dev)
    w = torch.linalg.solve(H, torch.ones(B, used, 1, dtype=torch.float64, device=dev))[..., 0]
    want = (w / w.sum(1, keepdim=True)).float()
    ok = [0, 1, 2, 4]
    err = float((alpha[ok, :used] - want[ok]).abs().max())
    assert err < 1e-5, err
    assert float(alpha[ok, used:].abs().max()) < 1e-12, "unused slots get no weight"
    assert torch.equal(alpha[3].cpu(), torch.eye(m)[used - 1]), alpha[3]
    assert fb.tolist() == [0, 0, 0, 1, 0], fb

    # 4. whole solves: fused on vs off (the torch code), every solver and return mode
    torch.manual_seed(0)
    for dt in (torch.float64,) if split else (torch.float32, torch.float64):
        A = (torch.randn(24, 24, dtype=dt) * 0.08).to(dev)  # ||A|| < 1: a contraction
        b = torch.randn(6, 24, dtype=dt).to(dev)
        f = lambda z: torch.tanh(z @ A.T + b)
        for name in ("fixed_point", "anderson", "broyden"):
            for returns in ("lowest", "last"):
                res = []
                for on in (False, True):
                    fused.ENABLED = on
                    clear_graph_cache()  # a cached graph would replay the other variant
                    z, s = deqbench.solvers.get(name)(
                        f, torch.zeros(6, 24, dtype=dt, device=dev), max_iter=40, tol=1e-5,
                        returns=returns, cuda_graph="cache")
                    res.append((z, s))
                fused.ENABLED = True
                (z0, s0), (z1, s1) = res
                assert s0.status == s1.status, (name, s0.status, s1.status)
                if dt == torch.float64:  # same iterates up to rounding: same decisions
                    assert s0.nstep == s1.nstep, (name, s0.nstep, s1.nstep)
                    assert torch.allclose(s0.rel_trace, s1.rel_trace, rtol=1e-9, atol=1e-12)
                    assert torch.allclose(z0, z1, rtol=1e-9, atol=1e-9), name
                else:  # float32 rounding may move the step where tol is first met by one or two
                    assert abs(s0.nstep - s1.nstep) <= 2, (name, s0.nstep, s1.nstep)
                    n = min(s0.nstep, s1.nstep) // 2
                    assert torch.allclose(s0.rel_trace[:n], s1.rel_trace[:n], rtol=1e-3), name
                    assert torch.allclose(z0, z1, rtol=1e-3, atol=1e-4), name
                out[f"{name}/{returns}/{dt}"] = s1.nstep
    print(json.dumps(out))
    """
)


@pytest.mark.slow  # Triton interpreter: 20-30 s each on 2 cores
@pytest.mark.parametrize("split", [False, True], ids=["per-sample", "split"])
def test_fused_kernels_match_references_on_cpu_interpreter(split):
    steps = run_checks(CHECKS, "cpu", "split" if split else "whole")
    assert len(steps) == (6 if split else 12) and all(n > 1 for n in steps.values())


def test_fused_kernels_are_off_on_cpu_without_the_interpreter():
    from deqbench.solvers import fused

    z = torch.zeros(4, 8)
    assert fused.INTERPRET or not fused.usable(z)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("split", [False, True], ids=["per-sample", "split"])
def test_fused_kernels_match_references_on_cuda(split):
    steps = run_checks(CHECKS, "cuda", "split" if split else "whole")
    assert len(steps) == (6 if split else 12)
