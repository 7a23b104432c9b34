"""Datasets: bundled digits, synthetic, gp_sequence, and the torchvision loaders on tiny files
written in the real on-disk formats."""

from __future__ import annotations

import pickle
import struct

import numpy as np
import pytest
import torch

from deqbench.errors import ConfigError, DataError
from deqbench.run.data import load_data


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
    assert np.allclose(np.array(d.meta["t_out"]), t_in - 2.0)  # papers/001: [-2pi-2, 2pi-2]
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


def _write_idx(path, arr: np.ndarray, magic: int) -> None:
    with open(path, "wb") as fh:
        fh.write(struct.pack(">I", magic))
        for s in arr.shape:
            fh.write(struct.pack(">I", s))
        fh.write(arr.astype(np.uint8).tobytes())


def test_mnist_real_format(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 12), ("t10k", 5)):
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)), 2051)
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", rng.integers(0, 10, (n,)), 2049)
    d = load_data("mnist", root=str(tmp_path), normalize=False)
    assert d.train[0].shape == (12, 1, 28, 28) and d.test[0].shape == (5, 1, 28, 28)
    img = np.fromfile(raw / "train-images-idx3-ubyte", dtype=np.uint8)[16:].reshape(12, 28, 28)
    assert torch.allclose(d.train[0][:, 0], torch.tensor(img, dtype=torch.float32) / 255)


def test_cifar10_real_format(tmp_path, monkeypatch):
    import torchvision

    base = tmp_path / "cifar-10-batches-py"
    base.mkdir()
    rng = np.random.default_rng(1)
    for name, n in [(f"data_batch_{i}", 3) for i in range(1, 6)] + [("test_batch", 4)]:
        with open(base / name, "wb") as fh:
            pickle.dump(
                {
                    "data": rng.integers(0, 256, (n, 3072)).astype(np.uint8),
                    "labels": rng.integers(0, 10, n).tolist(),
                },
                fh,
            )
    with open(base / "batches.meta", "wb") as fh:
        pickle.dump({"label_names": [f"c{i}" for i in range(10)]}, fh)
    # the tiny files cannot match the official md5 sums; everything else is the real reader
    monkeypatch.setattr(torchvision.datasets.CIFAR10, "_check_integrity", lambda self: True)
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda *a, **k: True)
    d = load_data("cifar10", root=str(tmp_path), normalize=False)
    assert d.train[0].shape == (15, 3, 32, 32) and d.test[0].shape == (4, 3, 32, 32)


def test_svhn_real_format(tmp_path, monkeypatch):
    import scipy.io
    import torchvision

    rng = np.random.default_rng(2)
    for split, n in (("train", 6), ("test", 3)):
        scipy.io.savemat(
            tmp_path / f"{split}_32x32.mat",
            {
                "X": rng.integers(0, 256, (32, 32, 3, n)).astype(np.uint8),
                "y": rng.integers(1, 11, (n, 1)).astype(np.uint8),
            },
        )
    monkeypatch.setattr(torchvision.datasets.SVHN, "_check_integrity", lambda self: True)
    d = load_data("svhn", root=str(tmp_path))
    assert d.train[0].shape == (6, 3, 32, 32) and d.test[0].shape == (3, 3, 32, 32)
    assert int(d.train[1].max()) <= 9  # torchvision maps label 10 to 0


def test_missing_dataset_is_one_clear_line(tmp_path):
    with pytest.raises(DataError) as ei:
        load_data("cifar10", root=str(tmp_path / "nowhere"))
    msg = str(ei.value)
    assert "not found under" in msg and "download" in msg and "\n" not in msg
    with pytest.raises(DataError, match="needs data.root"):
        load_data("mnist")
