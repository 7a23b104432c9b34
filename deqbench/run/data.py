"""Datasets, all as in-memory tensors: digits (bundled, offline), synthetic, gp_sequence
(papers/001 section 4), and mnist / cifar10 / svhn through torchvision from a local root.

Example:
    >>> from deqbench.run.data import load_data
    >>> d = load_data("digits", split=0.8, seed=0)        # doctest: +SKIP
    >>> d.train[0].shape, d.in_shape, d.num_outputs       # doctest: +SKIP
    (torch.Size([1437, 1, 8, 8]), (1, 8, 8), 10)
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..core.errors import ConfigError, DataError


@dataclass
class DataBundle:
    """Train/test tensors and what a model factory needs to know about them."""

    name: str
    train: tuple[Tensor, Tensor]
    test: tuple[Tensor, Tensor]
    in_shape: tuple[int, ...]
    num_outputs: int
    task: str = "classification"  # or "regression"
    meta: dict[str, Any] = field(default_factory=dict)

    def to(self, device: Any = None, dtype: torch.dtype | None = None) -> DataBundle:
        def conv(t: Tensor, is_x: bool) -> Tensor:
            if dtype is not None and (is_x or self.task == "regression") and t.is_floating_point():
                t = t.to(dtype)
            return t.to(device) if device is not None else t

        return DataBundle(
            self.name,
            (conv(self.train[0], True), conv(self.train[1], False)),
            (conv(self.test[0], True), conv(self.test[1], False)),
            self.in_shape,
            self.num_outputs,
            self.task,
            self.meta,
        )


DATASETS: dict[str, Callable[..., DataBundle]] = {}


def dataset(name: str):
    def deco(fn):
        DATASETS[name] = fn
        return fn

    return deco


def load_data(name: str, **params: Any) -> DataBundle:
    """Load dataset ``name`` with its ``params`` (unknown params are a ConfigError)."""
    if name not in DATASETS:
        import difflib

        close = difflib.get_close_matches(name, list(DATASETS), n=2)
        hint = f"did you mean {', '.join(map(repr, close))}? " if close else ""
        raise ConfigError(
            f"unknown dataset '{name}'; {hint}datasets: {', '.join(sorted(DATASETS))}"
        )
    fn = DATASETS[name]
    sig = inspect.signature(fn)
    bad = [k for k in params if k not in sig.parameters]
    if bad:
        import difflib

        close = difflib.get_close_matches(bad[0], list(sig.parameters), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(
            f"data.{bad[0]}: unknown option for dataset '{name}'{hint}; options: "
            + ", ".join(sig.parameters)
        )
    return fn(**params)


def _split(
    X: Tensor, y: Tensor, split: float, seed: int
) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    if not 0 < split < 1:
        raise ConfigError(f"data.split must be in (0, 1), got {split}")
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(X.shape[0], generator=g)
    n = int(round(split * X.shape[0]))
    tr, te = perm[:n], perm[n:]
    return (X[tr], y[tr]), (X[te], y[te])


def _subset(t: tuple[Tensor, Tensor], n: int | None) -> tuple[Tensor, Tensor]:
    return t if n is None else (t[0][:n], t[1][:n])


@dataset("digits")
def digits(
    split: float = 0.8,
    seed: int = 0,
    size: int = 8,
    flatten: bool = False,
    train_subset: int | None = None,
    test_subset: int | None = None,
    target: str = "class",
) -> DataBundle:
    """scikit-learn's bundled 8x8 digits (1797 images, values / 16); ``size`` 28 upsamples
    bilinearly to MNIST shape; ``flatten`` gives 64-d vectors.

    ``target``: "class" (default; labels 0-9, classification), "onehot" (regression on one-hot
    rows, 10 outputs, trained with squared loss) or "binary" (regression on a scalar +1 for
    digits >= 5 and -1 otherwise, 1 output; the setting of papers/004 chapter 3).
    """
    from sklearn.datasets import load_digits

    if target not in ("class", "onehot", "binary"):
        raise ConfigError(f"data.target must be 'class', 'onehot' or 'binary', got {target!r}")

    d = load_digits()
    X = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    if size != 8:
        X = torch.nn.functional.interpolate(
            X, size=(size, size), mode="bilinear", align_corners=False
        )
    if flatten:
        X = X.flatten(1)
    y = torch.tensor(d.target, dtype=torch.long)
    tr, te = _split(X, y, split, seed)
    if target == "class":
        return DataBundle(
            "digits", _subset(tr, train_subset), _subset(te, test_subset), tuple(X.shape[1:]), 10
        )

    def reg(t: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        lab = t[1]
        if target == "onehot":
            return t[0], torch.nn.functional.one_hot(lab, 10).float()
        return t[0], (2.0 * (lab >= 5).float() - 1.0).unsqueeze(1)

    return DataBundle(
        "digits",
        reg(_subset(tr, train_subset)),
        reg(_subset(te, test_subset)),
        tuple(X.shape[1:]),
        10 if target == "onehot" else 1,
        "regression",
        {"target": target},
    )


@dataset("synthetic")
def synthetic(
    n_train: int = 512,
    n_test: int = 256,
    dim: int = 20,
    num_classes: int = 4,
    task: str = "classification",
    noise: float = 0.1,
    seed: int = 0,
    hidden: int = 32,
) -> DataBundle:
    """Seeded synthetic data: Gaussian inputs labelled by a random tanh teacher network
    (classification: argmax of ``num_classes`` outputs; regression: the outputs plus noise)."""
    if task not in ("classification", "regression"):
        raise ConfigError(f"data.task must be 'classification' or 'regression', got {task!r}")
    g = torch.Generator().manual_seed(seed)
    n = n_train + n_test
    X = torch.randn(n, dim, generator=g)
    W1 = torch.randn(dim, hidden, generator=g) / math.sqrt(dim)
    W2 = torch.randn(hidden, num_classes, generator=g) / math.sqrt(hidden)
    out = torch.tanh(X @ W1) @ W2
    if task == "classification":
        y = out.argmax(1)
    else:
        y = out + noise * torch.randn(out.shape, generator=g)
    return DataBundle(
        "synthetic",
        (X[:n_train], y[:n_train]),
        (X[n_train:], y[n_train:]),
        (dim,),
        num_classes,
        task,
    )


def _gp_kernel(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    d = a[:, None] - b[None, :]
    return 0.1 * np.exp(-(d**2) / 2) * np.exp(-(np.sin(d) ** 2))


@dataset("gp_sequence")
def gp_sequence(
    n_train: int = 2000,
    n_test: int = 500,
    length: int = 100,
    shift: float = -2.0,
    seed: int = 0,
) -> DataBundle:
    """The smooth sequence-to-sequence task of papers/001 section 4 (REFERENCE.md 9.2).

    Inputs: ``length`` points on linspace(-2 pi, 2 pi); targets on the same grid shifted by
    ``shift`` (papers/001: targets on [-2 pi - 2, 2 pi - 2], so shift = -2). Signal
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


# -- torchvision datasets from a local root ------------------------------------------------

_TV = {
    "mnist": ("MNIST", "MNIST/raw/train-images-idx3-ubyte", None, None),
    "cifar10": (
        "CIFAR10",
        "cifar-10-batches-py/data_batch_1",
        (0.4914, 0.4822, 0.4465),
        (0.2470, 0.2435, 0.2616),
    ),
    "svhn": ("SVHN", "train_32x32.mat", (0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970)),
}


def _torchvision(
    name: str,
    root: str | None,
    download: bool,
    train_subset: int | None,
    test_subset: int | None,
    normalize: bool,
) -> DataBundle:
    import torchvision

    cls_name, probe, mean, std = _TV[name]
    if root is None:
        raise DataError(
            f"dataset '{name}' needs data.root (a local folder); nothing is downloaded "
            "unless data.download: true"
        )
    rootp = Path(root).expanduser()
    if not download and not (rootp / probe).exists():
        raise DataError(
            f"dataset '{name}' not found under {rootp} (expected {rootp / probe}); "
            f"place the files there or pass data.download: true (needs network)"
        )
    cls = getattr(torchvision.datasets, cls_name)
    try:
        if name == "svhn":
            tr = cls(str(rootp), split="train", download=download)
            te = cls(str(rootp), split="test", download=download)
        else:
            tr = cls(str(rootp), train=True, download=download)
            te = cls(str(rootp), train=False, download=download)
    except (RuntimeError, FileNotFoundError, OSError) as exc:
        raise DataError(f"dataset '{name}' could not be read from {rootp}: {exc}") from exc

    def tensors(ds: Any, n: int | None) -> tuple[Tensor, Tensor]:
        data = ds.data
        labels = getattr(ds, "targets", None)
        if labels is None:
            labels = ds.labels
        if n is not None:
            data, labels = data[:n], labels[:n]
        x = torch.as_tensor(np.asarray(data)).float() / 255.0
        if x.dim() == 3:  # MNIST (N, H, W)
            x = x.unsqueeze(1)
        elif x.shape[-1] == 3:  # CIFAR (N, H, W, C)
            x = x.permute(0, 3, 1, 2)
        if normalize and mean is not None:
            x = (x - torch.tensor(mean).view(1, -1, 1, 1)) / torch.tensor(std).view(1, -1, 1, 1)
        return x.contiguous(), torch.as_tensor(np.asarray(labels), dtype=torch.long)

    trt, tet = tensors(tr, train_subset), tensors(te, test_subset)
    return DataBundle(name, trt, tet, tuple(trt[0].shape[1:]), 10)


@dataset("mnist")
def mnist(
    root: str | None = None,
    download: bool = False,
    train_subset: int | None = None,
    test_subset: int | None = None,
    normalize: bool = True,
) -> DataBundle:
    """MNIST from ``root`` (torchvision layout ``root/MNIST/raw``)."""
    return _torchvision("mnist", root, download, train_subset, test_subset, normalize)


@dataset("cifar10")
def cifar10(
    root: str | None = None,
    download: bool = False,
    train_subset: int | None = None,
    test_subset: int | None = None,
    normalize: bool = True,
) -> DataBundle:
    """CIFAR-10 from ``root`` (torchvision layout ``root/cifar-10-batches-py``)."""
    return _torchvision("cifar10", root, download, train_subset, test_subset, normalize)


@dataset("svhn")
def svhn(
    root: str | None = None,
    download: bool = False,
    train_subset: int | None = None,
    test_subset: int | None = None,
    normalize: bool = True,
) -> DataBundle:
    """SVHN from ``root`` (``train_32x32.mat`` / ``test_32x32.mat``)."""
    return _torchvision("svhn", root, download, train_subset, test_subset, normalize)


# -- kGLM experiments (papers/001) ----------------------------------------------------------


@dataset("digits_klr")
def digits_klr(
    split: float = 0.8,
    seed: int = 0,
    corrupt: float = 1 / 3,
    flatten: bool = False,
) -> DataBundle:
    """Binarised, corrupted digits for the KLR <-> kGLM-DEQ check (papers/001 App. G).

    Each of the 1797 sklearn 8x8 digits is binarised (x > 0). Corruption as in the deq-glm
    MNIST script (REFERENCE.md 4.6): per image, positions perm1[:m] (m = int(64 * corrupt))
    are overwritten with the negation 1 - y of *other* random positions perm2[:m]. Inputs are
    the corrupted images, targets the clean ones (regression, 64 outputs).
    """
    from sklearn.datasets import load_digits

    if not 0 <= corrupt <= 1:
        raise ConfigError(f"data.corrupt must be in [0, 1], got {corrupt}")
    clean = torch.tensor(load_digits().images > 0, dtype=torch.float32).flatten(1)
    n, d = clean.shape
    m = int(d * corrupt)
    g = torch.Generator().manual_seed(seed)
    noisy = clean.clone()
    for i in range(n):
        p1 = torch.randperm(d, generator=g)[:m]
        p2 = torch.randperm(d, generator=g)[:m]
        noisy[i, p1] = 1.0 - clean[i, p2]
    X = noisy if flatten else noisy.view(n, 1, 8, 8)
    tr, te = _split(X, clean, split, seed)
    return DataBundle(
        "digits_klr",
        tr,
        te,
        tuple(X.shape[1:]),
        d,
        "regression",
        {"corrupt": corrupt, "corrupted_pixels": m},
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


@dataset("denoise")
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
    """Image denoising (papers/001 section 4): inputs clean + N(0, noise^2), clipped to [0, 1]
    (one fixed noise tensor per split); targets the clean images (regression).

    ``source``: "smooth" (synthetic low-pass images, ``channels`` x ``size`` x ``size``) or
    "cifar10" (from the local ``root``, values in [0, 1]; when it is not there and ``fallback``
    is true, smooth images of CIFAR size 3 x 32 x 32 are used and ``meta['source']`` says so).
    """
    if source not in ("smooth", "cifar10"):
        raise ConfigError(f"data.source must be 'smooth' or 'cifar10', got {source!r}")
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
