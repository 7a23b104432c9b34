"""PSNR and SSIM of image-regression outputs: known pairs, and the rows an evaluation writes."""

from __future__ import annotations

import math

import torch
from torch import nn

from deqbench.core.evaluation import evaluate
from deqbench.core.image_metrics import psnr, ssim
from deqbench.training.metrics import metric_rows


def test_psnr_of_a_known_pair():
    target = torch.full((2, 1, 8, 8), 0.1)
    assert torch.allclose(psnr(torch.zeros_like(target), target), torch.tensor([20.0, 20.0]))
    # MSE 0.25 ** 2 on a 0-255 scale: 10 log10(255^2 / 0.0625)
    t255 = torch.full((1, 3, 4, 4), 100.0)
    expect = 10 * math.log10(255.0**2 / 0.0625)
    assert math.isclose(float(psnr(t255 + 0.25, t255, data_range=255.0)), expect, rel_tol=1e-6)
    assert math.isinf(float(psnr(target, target)[0]))


def test_ssim_of_known_pairs():
    x = torch.rand(3, 2, 16, 16, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(ssim(x, x), torch.ones(3), atol=1e-6)
    # constant images a and b: SSIM = (2ab + C1) / (a^2 + b^2 + C1), C1 = (0.01 L)^2
    a, b = torch.full((1, 1, 12, 12), 0.0), torch.full((1, 1, 12, 12), 0.1)
    expect = (0 + 1e-4) / (0.01 + 1e-4)
    assert math.isclose(float(ssim(a, b)), expect, rel_tol=1e-6)
    # 8x8 images (under the 11x11 window): a smaller window, still 1 for identical images
    # and lower for a noisy copy
    y = torch.rand(2, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    noisy = y + 0.2 * torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(2))
    assert torch.allclose(ssim(y, y), torch.ones(2), atol=1e-6)
    assert (ssim(noisy, y) < 0.9).all()


class _Denoiser(nn.Module):
    """Removes half of a constant noise of 0.2."""

    def forward(self, x):
        return x - 0.1


def test_an_evaluation_of_image_targets_reports_psnr_and_ssim():
    y = torch.rand(6, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    x = y + 0.2  # noise 0.2 everywhere: the model's error is 0.1, MSE 0.01, PSNR 20 dB
    res = evaluate(_Denoiser(), x, y, "regression", batch_size=4)
    assert math.isclose(res["mse"], 0.01, rel_tol=1e-5)
    assert math.isclose(res["psnr"], 20.0, rel_tol=1e-5)
    assert 0 < res["ssim"] <= 1
    rows = {r.metric: r for r in metric_rows(res, "test", step=1)}
    assert rows["psnr"].unit == "dB" and math.isclose(rows["psnr"].value, 20.0, rel_tol=1e-5)
    assert "ssim" in rows
    # flat targets: no image metrics
    flat = evaluate(nn.Identity(), x.flatten(1), y.flatten(1), "regression")
    assert "psnr" not in flat and "ssim" not in flat
