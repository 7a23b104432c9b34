"""Triton for the fused kernels (``deqbench.solvers.fused``, ``deqbench.models.fused_norm``):
the import, the switches read from the environment, and where the kernels can run.

Triton ships with the CUDA builds of torch; without it (``triton`` is None) every fused kernel
falls back to torch code. ``DEQBENCH_FUSED=0`` switches the kernels off (each kernel module
keeps its own ``ENABLED``, set from it, that tests toggle); ``TRITON_INTERPRET=1``, set before
Triton is imported, runs them on CPU tensors under Triton's interpreter (tests).
"""

from __future__ import annotations

import os

import torch

try:  # Triton ships with the CUDA builds of torch; anything else falls back to torch code
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the torch build
    triton = None
    tl = None

#: the fused kernels are on unless ``DEQBENCH_FUSED=0`` (compare with the torch code)
ENABLED_BY_ENV = os.environ.get("DEQBENCH_FUSED", "1") != "0"
#: Triton's interpreter runs the kernels on CPU tensors (tests)
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernel_device(device: torch.device) -> bool:
    """Whether Triton kernels can run on ``device``: CUDA, or the CPU under the interpreter."""
    return triton is not None and (device.type == "cuda" or (INTERPRET and device.type == "cpu"))
