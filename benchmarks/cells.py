"""Benchmark cells f(z, x) for the solver benchmarks, in one place.

* ``conv``: the implicit-layers tutorial ResNet cell
  f(z, x) = GN3(relu(z + GN2(x + conv2(GN1(relu(conv1(z))))))), 3x3 no-bias convolutions with
  weights ~ N(0, 0.01^2) (std 0.01), GroupNorm with 8 groups. Full size: 64 channels (inner 64),
  32x32, batch 128 ("conv64").
* ``fc``: f(z, x) = tanh(W z + U x + b) with ||W||_2 = 0.9 (a Gaussian matrix rescaled by its
  spectral norm), U ~ N(0, 1/n_in), b ~ 0.1 N(0, 1), x ~ N(0, 1). Full size: width 1024,
  input 256, batch 512 ("fc1024").

Each builder returns a :class:`Cell`: the module, the fixed input x, z0 = 0 and ``f(z)``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
from torch import Tensor, nn


class ConvCell(nn.Module):
    def __init__(self, channels: int, inner: int, groups: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, inner, 3, padding=1, bias=False)
        self.conv2 = nn.Conv2d(inner, channels, 3, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(groups, inner)
        self.norm2 = nn.GroupNorm(groups, channels)
        self.norm3 = nn.GroupNorm(groups, channels)
        self.conv1.weight.data.normal_(0, 0.01)
        self.conv2.weight.data.normal_(0, 0.01)

    def forward(self, z: Tensor, x: Tensor) -> Tensor:
        y = self.norm1(torch.relu(self.conv1(z)))
        return self.norm3(torch.relu(z + self.norm2(x + self.conv2(y))))


class FCCell(nn.Module):
    def __init__(self, width: int, n_in: int, norm: float = 0.9) -> None:
        super().__init__()
        self.W = nn.Linear(width, width, bias=False)
        self.U = nn.Linear(n_in, width, bias=True)
        w = torch.randn(width, width)
        self.W.weight.data.copy_(w * (norm / torch.linalg.matrix_norm(w, ord=2)))
        self.U.weight.data.normal_(0, n_in**-0.5)
        self.U.bias.data.normal_(0, 1).mul_(0.1)

    def forward(self, z: Tensor, x: Tensor) -> Tensor:
        return torch.tanh(self.W(z) + self.U(x))


@dataclass
class Cell:
    name: str
    module: nn.Module
    x: Tensor
    z0: Tensor
    desc: str

    def f(self, z: Tensor) -> Tensor:
        return self.module(z, self.x)


def conv_cell(
    channels: int = 64,
    inner: int | None = None,
    size: int = 32,
    batch: int = 128,
    *,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Cell:
    """The tutorial ResNet cell (default: conv64, 64 ch, 32x32, batch 128)."""
    inner = channels if inner is None else inner
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    mod = ConvCell(channels, inner).to(device=device, dtype=dtype).eval()
    x = torch.randn(batch, channels, size, size, generator=g).to(device=device, dtype=dtype)
    z0 = torch.zeros_like(x)
    desc = f"conv {channels}ch/{inner} {size}x{size} b{batch}"
    return Cell("conv", mod, x, z0, desc)


def fc_cell(
    width: int = 1024,
    n_in: int = 256,
    batch: int = 512,
    norm: float = 0.9,
    *,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Cell:
    """The tanh FC cell (default: fc1024, width 1024, input 256, batch 512, ||W||_2 = 0.9)."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    mod = FCCell(width, n_in, norm).to(device=device, dtype=dtype).eval()
    x = torch.randn(batch, n_in, generator=g).to(device=device, dtype=dtype)
    z0 = torch.zeros(batch, width, device=device, dtype=dtype)
    desc = f"fc w{width} in{n_in} b{batch} specnorm(W) {norm}"
    return Cell("fc", mod, x, z0, desc)


def cells(quick: bool = False, device: str | torch.device = "cpu") -> list[Cell]:
    """The benchmark's cells: full size, or small ones (``quick``) for a CPU sanity run."""
    if quick:
        return [
            conv_cell(32, 32, 16, 8, device=device),
            fc_cell(256, 64, 128, device=device),
        ]
    return [conv_cell(device=device), fc_cell(device=device)]


def probe_parser() -> argparse.ArgumentParser:
    """The command line every probe script shares: ``--device`` (CUDA where there is one) and
    ``--quick`` (the small cells)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true")
    return ap


def probe_device(
    args: argparse.Namespace, cudnn_benchmark: bool = False
) -> tuple[torch.device, bool]:
    """TF32 off (matmul and cuDNN: the targets are float32), optionally cudnn.benchmark; the
    device of ``args.device`` and whether it is CUDA."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if cudnn_benchmark:
        torch.backends.cudnn.benchmark = True
    dev = torch.device(args.device)
    return dev, dev.type == "cuda"
