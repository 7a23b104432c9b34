"""Spectral norms of layers: dense exact / power iteration, convolutions by the FFT method of
Sedghi, Gupta and Long (2018), exact for circular convolution."""

from __future__ import annotations

import torch
from torch import Tensor


def dense_norm(W: Tensor) -> float:
    """Exact largest singular value of a matrix (float64)."""
    return float(torch.linalg.matrix_norm(W.detach().double(), ord=2))


def conv_norm_fft(weight: Tensor, input_size: int | tuple[int, int]) -> float:
    """Exact spectral norm of the circular convolution with ``weight`` (C_out, C_in, k, k) on an
    n x n input: max over frequencies of sigma_max of the per-frequency C_out x C_in matrix.
    For zero padding it is an upper bound."""
    if isinstance(input_size, int):
        input_size = (input_size, input_size)
    n1, n2 = input_size
    k1, k2 = weight.shape[-2:]
    n1, n2 = max(n1, k1), max(n2, k2)
    w = weight.detach().double()
    spec = torch.fft.fft2(w, s=(n1, n2))  # (C_out, C_in, n1, n2)
    mats = spec.permute(2, 3, 0, 1)
    return float(torch.linalg.matrix_norm(mats, ord=2).max())


def operator_norm(weight: Tensor, input_size: int | tuple[int, int] = 32) -> float:
    """Spectral norm of a dense (2-D) or conv (4-D) weight; other shapes are flattened."""
    if weight.dim() == 2:
        return dense_norm(weight)
    if weight.dim() == 4:
        return conv_norm_fft(weight, input_size)
    return dense_norm(weight.reshape(weight.shape[0], -1))
