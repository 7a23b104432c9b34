"""The fused GroupNorm kernel (deqbench/models/fused_norm.py) against torch's group_norm of the
same pre-op in float64, and ResNetCell's fused path against its torch path. CPU: the kernels
run under Triton's interpreter in a subprocess (``TRITON_INTERPRET=1`` must be set before Triton
is imported); GPU: the same checks on CUDA in ``gpu``-marked tests. Timing is not tested."""

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
    import torch.nn.functional as F
    from torch import nn
    from deqbench.models import fused_norm
    from deqbench.models.conv import ResNetCell

    dev = sys.argv[1]
    loop = sys.argv[2] == "loop"
    if loop:  # every slab below is looped over in blocks of 32 (several blocks and a tail)
        fused_norm.FIT_MAX, fused_norm.LOOP_BLOCK = 16, 32
    out = {"kernel": 0, "cell": 0}
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16

    def norm_of(C, G, affine, g):
        m = nn.GroupNorm(G, C, affine=affine).to(dev)
        if affine:
            with torch.no_grad():
                m.weight.copy_(torch.randn(C, generator=g))
                m.bias.copy_(torch.randn(C, generator=g))
        return m

    def reference(a, b, relu_first, m):
        pre = a.double() if b is None else a.double() + b.double()
        if relu_first:
            pre = pre.relu()
        w = None if m.weight is None else m.weight.detach().double()
        bb = None if m.bias is None else m.bias.detach().double()
        return F.group_norm(pre, m.num_groups, w, bb, m.eps)

    def check(a, b, relu_first, m, out_dtype, tol, what):
        assert fused_norm.usable(a, *(() if b is None else (b,))), what
        y = fused_norm.group_norm_act(a, b, relu_first=relu_first, norm=m, out_dtype=out_dtype)
        assert y.dtype == out_dtype and y.shape == a.shape, what
        ref = reference(a, b, relu_first, m)
        err = float(((y.double() - ref).abs() / ref.abs().clamp_min(1.0)).max())
        assert err < tol, (what, err)
        out["kernel"] += 1

    # 1. the kernel: dtype mixes, pre-ops, affine or not; odd sizes (C = 12 in 4 groups,
    # spatial 5 x 7: slab 105) and a 1-d spatial shape (slab 3 x 10)
    g = torch.Generator().manual_seed(0)
    combos = [  # (a, b, out, tolerance relative to max(1, |ref|))
        (f32, f32, f32, 1e-5), (bf16, f32, f32, 1e-5), (bf16, bf16, bf16, 1e-2),
        (f16, f32, f16, 2e-3),
    ]
    shapes = [((3, 12, 5, 7), 4), ((2, 6, 10), 2)]
    for shape, G in shapes:
        for at, bt, ot, tol in combos:
            for relu_first in (True, False):
                for with_b in (True, False):
                    for affine in (True, False):
                        m = norm_of(shape[1], G, affine, g)
                        a = torch.randn(shape, generator=g).to(dev, at)
                        b = torch.randn(shape, generator=g).to(dev, bt) if with_b else None
                        what = (shape, str(at), str(bt), relu_first, with_b, affine)
                        check(a, b, relu_first, m, ot, tol, what)
            if shape[-1] == 10:
                break  # the 1-d shape: float32 only

    # 2. a large common offset (mean 1e3, std 1): a one-pass E[x^2] - E[x]^2 in float32 would
    # lose most of the variance (errors ~1e-1); mean then squared deviations keep it. ~1e-4
    # remains from rounding a + b to float32 at 1e3 (torch's float32 group_norm: the same)
    m = norm_of(12, 4, True, g)
    a = (1e3 + torch.randn(3, 12, 5, 7, generator=g)).to(dev)
    b = torch.randn(3, 12, 5, 7, generator=g).to(dev)
    check(a, b, False, m, f32, 1e-3, "offset")

    # 3. NaN propagates through the ReLU (as torch's): its (sample, group) slab is NaN, no other
    a = torch.randn(2, 12, 5, 7, generator=g).to(dev)
    a[1, 4, 2, 3] = float("nan")  # sample 1, group 1 (channels 3..5)
    y = fused_norm.group_norm_act(a, relu_first=True, norm=m, out_dtype=f32)
    assert torch.isnan(y[1, 3:6]).all() and torch.isfinite(y[0]).all()
    assert torch.isfinite(y[1, :3]).all() and torch.isfinite(y[1, 6:]).all()

    # 4. not usable: float64, non-contiguous, switched off
    a = torch.randn(2, 12, 5, 7, device=dev)
    assert not fused_norm.usable(a.double()) and not fused_norm.usable(a.transpose(2, 3))
    fused_norm.ENABLED = False
    assert not fused_norm.usable(a)
    fused_norm.ENABLED = True

    # 5. ResNetCell: fused (no_grad) against the torch path (DEQBENCH_FUSED off)
    calls = [0]
    gna = fused_norm.group_norm_act

    def counted(*args, **kw):
        calls[0] += 1
        return gna(*args, **kw)

    fused_norm.group_norm_act = counted

    def both(cell, z, x, amp=None):
        res = []
        for on in (False, True):
            fused_norm.ENABLED = on
            calls[0] = 0
            with torch.autocast(dev, dtype=amp or torch.bfloat16, enabled=amp is not None):
                res.append((cell(z, x), calls[0]))
        fused_norm.ENABLED = True
        (ref, n0), (got, n1) = res
        assert n0 == 0
        return ref, got, n1

    torch.manual_seed(0)
    cell = ResNetCell(8, 12, groups=4).to(dev)  # norm1: 12 channels in 4 groups
    for mod in cell.modules():  # larger weights than the default 0.01 init: a nontrivial map
        if isinstance(mod, nn.Conv2d):
            nn.init.normal_(mod.weight, 0.0, 0.3)
        if isinstance(mod, nn.GroupNorm):
            nn.init.normal_(mod.weight, 1.0, 0.2)
            nn.init.normal_(mod.bias, 0.0, 0.2)
    z = torch.randn(2, 8, 5, 7, device=dev)
    x = torch.randn(2, 8, 5, 7, device=dev)

    with torch.no_grad():  # float32
        ref, got, n = both(cell, z, x)
        assert n == 3 and got.dtype == f32, (n, got.dtype)
        err = float((got - ref).abs().max())
        assert err < 1e-5 * max(1.0, float(ref.abs().max())), err
        out["cell"] += 1
        # bf16 autocast: the fused path's output is float32 (the last norm reads z in float32)
        ref, got, n = both(cell, z, x, amp=bf16)
        assert n == 3 and got.dtype == f32 and ref.dtype == f32, (n, got.dtype, ref.dtype)
        exact = cell(z, x)  # float32
        # bf16 rounding of the activations: max error relative to the output scale, and the
        # rms error (the outputs are of unit variance); the torch bf16 path is the same map in
        # torch code (convolutions and the first two norms' outputs in bf16, float32 output)
        scale = float(exact.abs().max())
        rms = lambda t: float((t - exact).pow(2).mean().sqrt())
        err = float((got - exact).abs().max()) / scale
        assert err < 1e-2 and rms(got) < 1e-2, (err, rms(got))
        # (their bf16 roundings fall on slightly different values, so the two differ by about
        # as much as each differs from the float32 cell)
        assert float((got - ref).abs().max()) / scale < 1.5e-2
        assert rms(ref) < 1e-2, rms(ref)
        out["bf16_err"] = err
        out["cell"] += 1
        # plain autocast (lowp_norms False) and float64 stay on the torch code
        cell.lowp_norms = False
        ref, got, n = both(cell, z, x, amp=bf16)
        assert n == 0 and torch.equal(ref, got)
        cell.lowp_norms = True
        c64 = ResNetCell(8, 12, groups=4).to(dev).double()
        ref, got, n = both(c64, z.double(), x.double())
        assert n == 0 and torch.equal(ref, got)
        # inside torch.func.jvp (wrapped tensors): the torch code
        v = torch.randn_like(z)
        calls[0] = 0
        _, jv = torch.func.jvp(lambda t: cell(t, x), (z,), (v,))
        assert calls[0] == 0 and jv.abs().max() > 0
        out["cell"] += 1

    # grad enabled: never fused, the torch result exactly, with a graph
    zg = z.clone().requires_grad_()
    for amp in (None, bf16):
        ref, got, n = both(cell, zg, x, amp=amp)
        assert n == 0 and got.grad_fn is not None and torch.equal(ref, got)
    out["cell"] += 1
    fused_norm.group_norm_act = gna
    print(json.dumps(out))
    """
)


EXPECTED = {"kernel": 4 * 8 + 8 + 1, "cell": 4}


@pytest.mark.slow  # Triton interpreter: 7-11 s each on 2 cores
@pytest.mark.parametrize("mode", ["fit", "loop"])
def test_fused_norm_matches_torch_on_cpu_interpreter(mode):
    res = run_checks(CHECKS, "cpu", mode)
    assert res.pop("bf16_err") < 1e-2 and res == EXPECTED


def test_fused_norm_is_off_on_cpu_without_the_interpreter():
    from deqbench.models import fused_norm
    from deqbench.models.conv import ResNetCell

    z = torch.randn(2, 8, 4, 4)
    if fused_norm.INTERPRET:
        pytest.skip("this process runs under the interpreter")
    assert not fused_norm.usable(z)
    cell = ResNetCell(8, 8, groups=4)
    with torch.no_grad():
        out = cell(z, z)
    assert torch.equal(out, cell.norm3((z + cell.norm2(z + cell.conv2(
        cell.norm1(cell.conv1(z).relu())))).relu()))  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["fit", "loop"])
def test_fused_norm_matches_torch_on_cuda(mode):
    res = run_checks(CHECKS, "cuda", mode)
    assert res.pop("bf16_err") < 1e-2 and res == EXPECTED
