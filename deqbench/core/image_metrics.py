"""Image-quality metrics of a regression whose targets are images: PSNR and SSIM per sample.

A regression task whose targets are image-shaped, ``(N, C, H, W)`` or ``(N, H, W)`` (a
denoiser, an inverse problem), is scored with them beside its MSE by every evaluation pass
(:func:`deqbench.core.evaluation.evaluate`; the ``metrics`` analysis writes the rows ``psnr``
in dB and ``ssim``). ``data_range`` is the span of the pixel values, ``L`` (1 for images in
[0, 1], the default; a dataset with another range says so in its ``meta["data_range"]``).

* PSNR: ``10 log10(L^2 / MSE)`` per sample, the MSE over the sample's values.
* SSIM (Wang, Bovik, Sheikh and Simoncelli, "Image quality assessment: from error visibility
  to structural similarity", 2004): local means, variances and covariance under an 11x11
  Gaussian window of standard deviation 1.5 (smaller on images under 11 pixels a side: the
  largest odd size that fits, the deviation scaled with it), ``C1 = (0.01 L)^2``,
  ``C2 = (0.03 L)^2``, the SSIM map averaged over the valid positions and the channels.

Example:
    >>> import torch
    >>> from deqbench.core.image_metrics import psnr, ssim
    >>> target = torch.full((2, 1, 8, 8), 0.1)
    >>> psnr(torch.zeros_like(target), target)          # MSE 0.01: 20 dB
    tensor([20., 20.])
    >>> ssim(target, target)
    tensor([1., 1.])
"""

from __future__ import annotations

import torch
from torch import Tensor

#: the Gaussian window of SSIM: size and standard deviation (Wang et al. 2004)
SSIM_WINDOW, SSIM_SIGMA = 11, 1.5
SSIM_K1, SSIM_K2 = 0.01, 0.03


def is_image(target: Tensor) -> bool:
    """Whether a batch of regression targets is image-shaped: ``(N, H, W)`` or more dims."""
    return target.dim() >= 3


def psnr(pred: Tensor, target: Tensor, data_range: float = 1.0) -> Tensor:
    """Per-sample PSNR in dB, ``(N,)`` (inf where the sample is reproduced exactly)."""
    pred = pred.reshape(target.shape).to(torch.float64)
    mse = (pred - target.to(torch.float64)).pow(2).reshape(target.shape[0], -1).mean(dim=1)
    return (10 * torch.log10(data_range**2 / mse)).to(target.dtype)


def _as_nchw(x: Tensor) -> Tensor:
    if x.dim() == 3:
        return x.unsqueeze(1)
    return x.reshape(x.shape[0], -1, x.shape[-2], x.shape[-1])


def _window(size: int, sigma: float, like: Tensor) -> Tensor:
    t = torch.arange(size, dtype=like.dtype, device=like.device) - (size - 1) / 2
    g = torch.exp(-(t**2) / (2 * sigma**2))
    g = g / g.sum()
    return torch.outer(g, g)


def ssim(pred: Tensor, target: Tensor, data_range: float = 1.0) -> Tensor:
    """Per-sample SSIM, ``(N,)``, of image-shaped ``target`` (``pred`` reshaped to it)."""
    x = _as_nchw(pred.reshape(target.shape).to(torch.float64))
    y = _as_nchw(target.to(torch.float64))
    n, c, h, w = y.shape
    size = min(SSIM_WINDOW, h, w)
    size -= 1 - size % 2  # odd
    sigma = SSIM_SIGMA * size / SSIM_WINDOW
    k = _window(size, sigma, y).expand(c, 1, size, size)

    def blur(t: Tensor) -> Tensor:
        return torch.nn.functional.conv2d(t, k, groups=c)

    mx, my = blur(x), blur(y)
    vx, vy = blur(x * x) - mx**2, blur(y * y) - my**2
    cov = blur(x * y) - mx * my
    c1, c2 = (SSIM_K1 * data_range) ** 2, (SSIM_K2 * data_range) ** 2
    smap = ((2 * mx * my + c1) * (2 * cov + c2)) / ((mx**2 + my**2 + c1) * (vx + vy + c2))
    return smap.reshape(n, -1).mean(dim=1).to(target.dtype)


def image_sums(pred: Tensor, target: Tensor, data_range: float = 1.0) -> dict[str, float]:
    """``{"psnr", "ssim"}`` summed over the batch (an evaluation divides by the sample count);
    a PSNR of inf (a sample reproduced exactly) is counted as inf."""
    with torch.no_grad():
        p = psnr(pred, target, data_range)
        s = ssim(pred, target, data_range)
    return {"psnr": float(p.double().sum()), "ssim": float(s.double().sum())}


__all__ = ["SSIM_SIGMA", "SSIM_WINDOW", "image_sums", "is_image", "psnr", "ssim"]
