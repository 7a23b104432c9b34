"""ImplicitConvNet: stem -> implicit block z* = F(z*, x) -> head.

F(z, x) = tanh(scale GroupNorm(conv2(h)) + x), h = relu(GroupNorm(conv1(z) + x)): an
MDEQ-style block; the stem and the head carry BatchNorm (outside the map, so
that one forward updates their running statistics once, not once per iteration).

The forward finds z* with its own loop under torch.no_grad(), then applies F once with
gradient (Jacobian-free backward). ``self.info`` keeps what the last loop did.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F


class ImplicitBlock(nn.Module):
    """The map F(z, x); keeps z's shape."""

    def __init__(self, channels: int, groups: int = 4, scale: float = 0.5) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(groups, channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(groups, channels)
        self.scale = scale

    def forward(self, z: Tensor, x: Tensor) -> Tensor:
        h = F.relu(self.norm1(self.conv1(z) + x))
        return torch.tanh(self.scale * self.norm2(self.conv2(h)) + x)


class ImplicitConvNet(nn.Module):
    """Classifier with an implicit conv block.

    Args:
        in_channels: input channels.
        channels: width of the implicit block.
        num_classes: outputs.
        max_iter: the loop's budget of map evaluations.
        tol: stop when ||F(z) - z|| / ||F(z)|| (per sample, max over the batch) is below it.
        damping: z <- (1 - damping) z + damping F(z).
    """

    def __init__(
        self,
        in_channels: int = 1,
        channels: int = 16,
        num_classes: int = 10,
        max_iter: int = 40,
        tol: float = 1e-3,
        damping: float = 0.7,
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
        )
        self.block = ImplicitBlock(channels)
        self.head = nn.Sequential(
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(channels, num_classes),
        )
        self.max_iter = max_iter
        self.tol = tol
        self.damping = damping
        self.info: dict = {}

    @torch.no_grad()
    def find_fixed_point(self, x: Tensor) -> Tensor:
        """Damped Picard iteration from z = 0; records steps and residuals in ``self.info``."""
        z = torch.zeros_like(x)
        residuals = []
        for _ in range(self.max_iter):
            fz = self.block(z, x)
            diff = (fz - z).flatten(1).norm(dim=1)
            rel = diff / fz.flatten(1).norm(dim=1).clamp_min(1e-12)
            residuals.append(rel)
            if float(rel.max()) < self.tol:
                z = fz
                break
            z = (1 - self.damping) * z + self.damping * fz
        self.info = {
            "steps": len(residuals),
            "residuals": torch.stack(residuals),  # (steps, batch) relative residuals
            "converged": bool(residuals[-1].max() < self.tol),
        }
        return z

    def forward(self, x: Tensor) -> Tensor:
        u = self.stem(x)
        z = self.find_fixed_point(u)
        z = self.block(z.detach(), u)  # Jacobian-free backward: one step with gradient
        return self.head(z)
