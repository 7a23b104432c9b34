"""The eager solvers' fused bookkeeping (``Tracker.record`` through ``fused.record_eager``, the
Anderson ring writes, new Gram row, weights and mix) against dense float64 math and against the
torch code it replaces: whole eager solves with
the fused kernels on and off agree in f-evaluations, status, traces, returned iterates and the
step each one comes from, on a contraction and on a non-normal map whose residuals rise before
they fall (so samples disagree on which iterate is their lowest). CPU: under Triton's
interpreter in a subprocess; GPU: the same checks on CUDA in ``gpu``-marked tests."""

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
    from deqbench.solvers import fused, get

    dev, split = sys.argv[1], sys.argv[2] == "split"
    if split:  # every state below is split over programs of 8 elements (three launches)
        fused.SPLIT_MIN, fused.CHUNK = 8, 8
    out = {}
    torch.manual_seed(0)
    # Anderson's row, weights (persistent G G^T) and mix kernels against dense float64 math
    fused.ANDERSON_PIECE = 4  # several pieces per chunk (partial products summed)
    g = torch.Generator().manual_seed(3)
    B, nc, m, cd, it = 3, 2, 5, 7, 4  # 4 evaluations: slots 0-3 in use, the newest is 3
    Gb = torch.randn(B, nc, m, cd, generator=g, dtype=torch.float64)
    Fb = torch.randn(B, nc, m, cd, generator=g, dtype=torch.float64)
    Gb[:, :, it:] = float("nan")  # never written: must not be read
    Fb[:, :, it:] = float("nan")
    Gf = Gb[:, :, :it].permute(0, 2, 1, 3).reshape(B, it, nc * cd)
    full = Gf @ Gf.transpose(1, 2)
    H = torch.zeros(B, m, m, dtype=torch.float64)
    H[:, : it - 1, : it - 1] = full[:, : it - 1, : it - 1]  # the older entries, as kept
    Gd, Fd, H = Gb.to(dev), Fb.to(dev), H.to(dev)
    M = 8
    rows = torch.empty(B * nc * fused.anderson_pieces(cd) * M, dtype=torch.float64, device=dev)
    alpha = torch.empty(B, m, dtype=torch.float64, device=dev)
    fb = torch.zeros(B, dtype=torch.int64, device=dev)
    lam = 1e-3
    fused.anderson_row(Gd, rows, it, m)
    fused.anderson_weights(H, alpha, fb, it, m, lam, 0.0, rows=rows)
    assert torch.allclose(H[:, :it, :it].cpu(), full, rtol=1e-12), "persistent G G^T"
    assert not H[:, it:].any() and not H[:, :, it:].any()
    Hr = full + lam * full.diagonal(dim1=1, dim2=2).amax(1)[:, None, None] * torch.eye(it)
    w = torch.linalg.solve(Hr, torch.ones(B, it, 1, dtype=torch.float64))[..., 0]
    want = w / w.sum(1, keepdim=True)
    assert torch.allclose(alpha[:, :it].cpu(), want, rtol=1e-9), (alpha, want)
    assert fb.tolist() == [0] * B
    for beta in (1.0, 0.7):
        x = torch.empty(B, nc * cd, dtype=torch.float64, device=dev)
        fused.anderson_mix(Fd, Gd, alpha, x, it, m, beta)
        a = alpha[:, :it].cpu()
        ref = torch.einsum("bi,bcid->bcd", a, Fb[:, :, :it] - (1 - beta) * Gb[:, :, :it])
        assert torch.allclose(x.cpu(), ref.reshape(B, -1), rtol=1e-12, atol=1e-12), beta
    fused.ANDERSON_PIECE = 1 << 13

    # an inf in f(x) (abs residual inf, rel residual inf / inf = NaN): the batch summary's rel
    # and (res - lowest) rows are NaN as torch's amax gives, so the step is not taken as one
    # where every sample improved, and the solve ends diverged (one sample's residual)
    from deqbench.solvers.base import CommonOptions, Tracker
    z0 = torch.randn(3, 24, dtype=torch.float64).to(dev)
    z1 = torch.randn(3, 24, dtype=torch.float64).to(dev)
    f0, f1 = z0 + 1.0, z1 + 1e-9
    f1[0, 3] = float("inf")
    for returns in ("lowest", "last"):
        got = {}
        for on in (True, False):
            fused.ENABLED = on
            t = Tracker("t", z0, max_iter=10, tol=1e-3, stop_mode="rel",
                        common=CommonOptions(returns=returns))
            t.record(z0, f0, None)
            t.stop()
            t.record(z1, f1, None)
            t.stop()
            z, st = t.finish(2)
            got[on] = (st.status, st.converged, st.extra["lowest_steps"].tolist(), z)
        fused.ENABLED = True
        assert got[True][:3] == got[False][:3], (returns, got[True][:3], got[False][:3])
        assert torch.equal(got[True][3], got[False][3]) and got[True][0] == "diverged"
    B, D = 5, 24
    # non-normal 2x2 blocks [[0.8, 2.5], [0, 0.8]]: ||A^k|| rises before it decays
    A = torch.zeros(D, D, dtype=torch.float64)
    for i in range(0, D, 2):
        A[i, i] = A[i + 1, i + 1] = 0.8
        A[i, i + 1] = 2.5
    W = torch.randn(D, D, dtype=torch.float64)
    W = 0.8 * W / torch.linalg.matrix_norm(W, 2)
    for dt in (torch.float32, torch.float64):
        u = torch.randn(B, D, dtype=dt)
        u[::2, 1::2] = 0  # samples 0, 2, 4: no component A's off-diagonal amplifies
        u = u.to(dev)
        cases = {
            "contraction": (lambda z, W=W.to(dt).to(dev), u=u: torch.tanh(z @ W.T + u)),
            "non-normal": (lambda z, A=A.to(dt).to(dev), u=u: z @ A.T + u),
        }
        for cname, f in cases.items():
            for name in ("fixed_point", "anderson", "broyden"):
                if cname == "non-normal" and name != "fixed_point":
                    continue  # the rise-then-fall trace is fixed-point iteration's
                for returns in ("lowest", "last"):
                    res = {}
                    for on in (True, False):
                        fused.ENABLED = on
                        z0 = torch.zeros(B, D, dtype=dt, device=dev)
                        mode = "abs" if cname == "non-normal" else "rel"
                        # non-normal: stopped while some samples' residuals still rise
                        n = 4 if cname == "non-normal" else 40
                        res[on] = get(name)(f, z0, max_iter=n, tol=1e-6, returns=returns,
                                            stop_mode=mode)
                    fused.ENABLED = True
                    (z1, s1), (z0, s0) = res[True], res[False]
                    tag = f"{cname}/{name}/{returns}/{dt}"
                    l1, l0 = s1.extra["lowest_steps"], s0.extra["lowest_steps"]
                    if dt == torch.float32 and name == "anderson":
                        # float32 rounding (sum orders of the products and the mix) grows to
                        # ~1e-3 of the residual near 1e-6: the first half agrees closely
                        assert abs(s1.nstep - s0.nstep) <= 2 and s1.status == s0.status, tag
                        h = min(s1.nstep, s0.nstep) // 2
                        assert torch.allclose(s1.rel_trace[:h], s0.rel_trace[:h], rtol=1e-4)
                        assert torch.allclose(z1, z0, rtol=1e-3, atol=1e-4), tag
                        out[tag] = s1.nstep
                        continue
                    # Anderson: a Gauss-Jordan kernel vs LU (solve_ex) on a regularised system
                    # whose condition grows to ~1e8 near convergence
                    tol = 1e-5 if dt == torch.float32 else (1e-6 if name == "anderson" else 1e-12)
                    assert (s1.nstep, s1.status) == (s0.nstep, s0.status), (tag, s1, s0)
                    for a, b in ((s1.rel_trace, s0.rel_trace), (s1.abs_trace, s0.abs_trace)):
                        err = float(((a - b).abs() / b.abs().clamp_min(1e-30)).max())
                        assert err <= tol, (tag, err)
                    assert torch.allclose(z1, z0, rtol=tol, atol=tol), tag
                    assert torch.equal(l1, l0) and s1.lowest_step == s0.lowest_step, tag
                    if cname == "non-normal" and returns == "lowest":
                        # the case must exercise the per-sample lowest iterate
                        r = s1.abs_trace
                        assert bool((r[1:] > r[:-1]).any()), "no residual rises"
                        assert len(set(l1.tolist())) > 1, "every sample's lowest at one step"
                    out[tag] = s1.nstep
    print(json.dumps(out))
    """
)


@pytest.mark.slow  # Triton interpreter: about 30 s each on 2 cores
@pytest.mark.parametrize("split", [False, True], ids=["per-sample", "split"])
def test_fused_eager_solves_match_torch_code_on_cpu_interpreter(split):
    steps = run_checks(CHECKS, "cpu", "split" if split else "whole")
    assert len(steps) == 16 and all(n > 1 for n in steps.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("split", [False, True], ids=["per-sample", "split"])
def test_fused_eager_solves_match_torch_code_on_cuda(split):
    steps = run_checks(CHECKS, "cuda", "split" if split else "whole")
    assert len(steps) == 16
