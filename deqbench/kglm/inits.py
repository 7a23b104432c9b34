"""kGLM initialisations (Tsuchida et al. 2022 Theorem 3, appendix E).

* ``kglm_informed``: W1 = W3 = -K/lam, W2 = K/lam, V1 = -k(X~, X)/lam, V2 = k(X~, X)/lam with
  K = k(X, X) (+ white noise) from a given kernel and coordinates; lam = ||K||_2 / scale, so
  ||W1||_2 = scale (the C of the paper). Biases zero. The DEQ then computes the kGLM's MAP
  prediction exactly (at the unique fixed point when ||K/lam|| sup|A''| < 1).
* ``kglm_naive``: the default SE kernel (lengthscale 1) on a uniform grid (linspace(-2pi, 2pi)
  for sequences); sets W1 (= W3) and W2 only; V1 keeps the PyTorch default; V2 = 0 (trainable).
* ``kglm_random``: the random baseline. Dense: PyTorch default uniform weights (redrawn from
  ``seed``), biases zero, V2 = 0 and frozen (the deq-glm regression script). Conv: every filter
  N(0, std^2) with std = scale / 19 (spectral norms close to the kGLM init of the same scale).

Convolutional models (``kglm_conv_deq``): per output channel c a squared-exponential filter
g_c(p) = exp(-||p - mid||^2 / (2 l_c^2)), l_c ~ U(0, 4), on input channels 0..c, symmetrised
over channels (k + k^T)/2; lam = exact circular spectral norm (Sedghi et al.) / scale;
conv1 = -k/lam, conv2 = k/lam; the output convs get the same values (X~ = X).

Coordinates (dense models): ``coords="auto"`` uses pixel coordinates (channel, row, column)
for image inputs and a uniform grid on ``x_range`` for flat inputs; targets use the input grid
shifted by ``out_shift`` (the GP task: x_range [-2pi, 2pi], out_shift -2). Numbers may be
written with ``pi`` in YAML, e.g. ``x_range: [-2pi, 2pi]``.

Example:
    >>> import deqbench
    >>> m = deqbench.models.create("kglm_deq", in_shape=(100,), family="log2cosh")
    >>> deqbench.inits.get("kglm_informed")(m, seed=0, kernel="periodic_se",
    ...                                     x_range=["-2pi", "2pi"], out_shift=-2)
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
from torch import Tensor, nn

from ..core.errors import ConfigError
from ..core.registry import inits
from .kernels import make_kernel, sqdist

_NUM = re.compile(r"^\s*([+-]?\d*\.?\d*(?:e[+-]?\d+)?)\s*\*?\s*pi\s*$")


def parse_number(v: Any) -> float:
    """A float from a number or a string like ``"-2pi"``, ``"0.5*pi"``, ``"pi"``."""
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        m = _NUM.match(v.lower())
        if m:
            c = m.group(1)
            coef = 1.0 if c in ("", "+") else -1.0 if c == "-" else float(c)
            return coef * math.pi
        try:
            return float(v)
        except ValueError:
            pass
    raise ConfigError(f"cannot read a number from {v!r} (use e.g. 1.5, '2pi' or '-0.5*pi')")


def _models():
    from ..models.kglm import KGLMDEQ, KGLMConvDEQ

    return KGLMDEQ, KGLMConvDEQ


def _check_model(model: Any, init: str) -> str:
    dense, conv = _models()
    if isinstance(model, dense):
        return "dense"
    if isinstance(model, conv):
        return "conv"
    raise ConfigError(
        f"init '{init}' needs a kGLM model (kglm_deq, kglm_conv_deq and their _tiny variants); "
        f"got {type(model).__name__}"
    )


def coordinates(
    in_shape: tuple[int, ...],
    coords: Any = "auto",
    x_range: Any = ("-2pi", "2pi"),
    dtype: torch.dtype = torch.float64,
) -> Tensor:
    """Coordinates (n, d) of the ``n = prod(in_shape)`` input positions.

    ``coords``: ``auto`` (pixels for (C, H, W) / (H, W) inputs, else ``grid``), ``grid``
    (linspace over ``x_range``), ``pixels`` (channel, row, column indices), or an explicit list.
    """
    n = math.prod(in_shape)
    if not isinstance(coords, str):
        c = torch.as_tensor(coords, dtype=dtype)
        c = c.unsqueeze(1) if c.dim() == 1 else c
        if c.shape[0] != n:
            raise ConfigError(f"coords: {c.shape[0]} coordinates given for {n} inputs")
        return c
    if coords == "auto":
        coords = "pixels" if len(in_shape) >= 2 else "grid"
    if coords == "grid":
        lo, hi = (parse_number(v) for v in x_range)
        return torch.linspace(lo, hi, n, dtype=dtype).unsqueeze(1)
    if coords == "pixels":
        shape = tuple(in_shape) if len(in_shape) >= 2 else (int(round(math.sqrt(n))),) * 2
        if math.prod(shape) != n:
            raise ConfigError(f"coords: pixels needs an image shape; got {in_shape}")
        grids = torch.meshgrid(*[torch.arange(s, dtype=dtype) for s in shape], indexing="ij")
        c = torch.stack([g.reshape(-1) for g in grids], 1)
        # single-channel images: drop the constant channel coordinate
        return c[:, 1:] if len(shape) == 3 and shape[0] == 1 else c
    raise ConfigError(f"coords: unknown '{coords}'; use auto, grid, pixels or a list")


def kernel_weights(
    kernel: Any,
    X: Tensor,
    X_out: Tensor | None = None,
    *,
    scale: float = 1.0,
    white_noise: float = 0.0,
) -> dict[str, Any]:
    """The Theorem 3 parameters for kernel ``kernel`` on coordinates X (and outputs X_out).

    Returns a dict with ``K``, ``lam`` (= ||K||_2 / scale), ``W1`` (= W3 = -K/lam), ``W2``
    (= K/lam), and if ``X_out`` is given ``V1`` (= -k(X_out, X)/lam), ``V2`` (= k(X_out, X)/lam),
    all float64.
    """
    _check("kglm_informed", scale=scale, white_noise=white_noise)
    k = make_kernel(kernel)
    X = X.double()
    K = k(X, X)
    if white_noise:
        K = K + white_noise * torch.eye(K.shape[0], dtype=K.dtype)
    K = 0.5 * (K + K.T)
    lam = float(torch.linalg.eigvalsh(K).abs().max()) / float(scale)  # ||K||_2, K symmetric
    out: dict[str, Any] = {"K": K, "lam": lam, "W1": -K / lam, "W2": K / lam}
    if X_out is not None:
        Kx = k(X_out.double(), X)
        if white_noise:
            # exactly coinciding points (cdist's matmul path can miss exact zeros)
            Kx = Kx + white_noise * (sqdist(X_out, X) == 0).double()
        out["V1"] = -Kx / lam
        out["V2"] = Kx / lam
    return out


def _check(init: str, **values: float | None) -> None:
    """``scale`` and ``std`` must be > 0 and ``white_noise`` >= 0 (a ConfigError naming it):
    a negative scale would flip the signs of Theorem 3, zero divides by zero."""
    for name, v in values.items():
        if v is None:
            continue
        ok = float(v) >= 0 if name == "white_noise" else float(v) > 0
        if not ok:
            bound = ">= 0" if name == "white_noise" else "> 0"
            raise ConfigError(f"{init}: {name} must be {bound}, got {v}")


def _copy(lin: nn.Linear | None, value: Tensor) -> None:
    if lin is None:
        return
    with torch.no_grad():
        w = lin.weight
        if w.shape != value.shape:
            raise ConfigError(
                f"kGLM init: weight of shape {tuple(w.shape)} cannot take a kernel matrix of shape "
                f"{tuple(value.shape)}"
            )
        w.copy_(value.to(w.dtype))


def _copy_cell_weights(model: Any, p: dict[str, Any]) -> None:
    """W1 = W3 <- ``p["W1"]``, W2 <- ``p["W2"]`` of a dense kGLM model (:func:`kernel_weights`)."""
    cell = model.deq.cell
    _copy(cell.W1, p["W1"])
    _copy(cell.W3, p["W1"])
    _copy(model.W2, p["W2"])


def _zero_biases(model: Any) -> None:
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.Linear, nn.Conv2d)) and m.bias is not None:
                m.bias.zero_()


def _out_coords(model: Any, X: Tensor, out_coords: Any, out_shift: float) -> Tensor:
    n_out = model.num_outputs
    if out_coords is not None:
        Xo = torch.as_tensor(out_coords, dtype=torch.float64)
        Xo = Xo.unsqueeze(1) if Xo.dim() == 1 else Xo
    elif n_out == X.shape[0]:
        Xo = X.clone()
    else:
        raise ConfigError(f"kGLM init: {n_out} outputs but {X.shape[0]} inputs; give out_coords")
    if Xo.shape[0] != n_out:
        raise ConfigError(f"out_coords: {Xo.shape[0]} coordinates for {n_out} outputs")
    return Xo + parse_number(out_shift)


# -- convolutional ---------------------------------------------------------------------


def se_filters(
    channels: int,
    kernel_size: int,
    *,
    generator: torch.Generator | None = None,
    max_lengthscale: float = 4.0,
    squared: bool = False,
    lengthscale: float | None = None,
) -> Tensor:
    """The symmetrised SE filter bank k (C, C, ks, ks) of the kGLM conv init (float64).

    ``lengthscale`` fixes l_c for all channels (naive init); otherwise l_c ~ U(0, max) (or
    l_c^2 ~ U(0, max) with ``squared``, the wording of Tsuchida et al. 2022 appendix F).
    """
    c = channels
    if lengthscale is not None:
        ell = torch.full((c,), float(lengthscale), dtype=torch.float64)
    else:
        u = torch.rand(c, generator=generator, dtype=torch.float64) * max_lengthscale
        ell = u.sqrt() if squared else u
    ell = ell.clamp_min(1e-3)  # U(0, .) can return 0: the filter becomes a delta
    mid = (kernel_size - 1) / 2
    r = torch.arange(kernel_size, dtype=torch.float64) - mid
    d2 = r[:, None] ** 2 + r[None, :] ** 2
    g = torch.exp(-d2[None] / (2 * ell[:, None, None] ** 2))  # (C, ks, ks)
    k = torch.zeros(c, c, kernel_size, kernel_size, dtype=torch.float64)
    for i in range(c):
        k[i, : i + 1] = g[i]
    return 0.5 * (k + k.transpose(0, 1))


def _conv_informed(
    model: Any,
    *,
    seed: int,
    scale: float,
    squared: bool,
    max_lengthscale: float,
    lengthscale: float | None,
    readout: bool,
) -> float:
    from ..spectral.norms import conv_spectral_norm

    g = torch.Generator().manual_seed(int(seed))
    w = model.conv1.weight
    k = se_filters(
        w.shape[0],
        w.shape[-1],
        generator=g,
        max_lengthscale=max_lengthscale,
        squared=squared,
        lengthscale=lengthscale,
    )
    lam = conv_spectral_norm(k, model.in_shape[1:]) / float(scale)
    with torch.no_grad():
        model.conv1.weight.copy_((-k / lam).to(w.dtype))
        model.conv2.weight.copy_((k / lam).to(w.dtype))
        if readout:
            model.conv_out1.weight.copy_((-k / lam).to(w.dtype))
            model.conv_out2.weight.copy_((k / lam).to(w.dtype))
    model.kglm_info = {"init": "kglm", "lam": lam, "scale": float(scale)}
    return lam


# -- registered inits ------------------------------------------------------------------------


@inits.register("kglm_informed")
def kglm_informed(
    model: Any,
    *,
    seed: int = 0,
    kernel: Any = "se",
    coords: Any = "auto",
    x_range: Any = ("-2pi", "2pi"),
    out_coords: Any = None,
    out_shift: Any = 0.0,
    scale: float = 1.0,
    white_noise: float = 0.0,
    readout: bool = True,
    max_lengthscale: float = 4.0,
    squared_lengthscale: bool = False,
) -> None:
    """Theorem 3 initialisation from a kernel and coordinates (see module docstring).

    Args:
        kernel: kernel spec (name, ``{name, **params}`` or a list summed), dense models only.
        coords, x_range: input coordinates (see :func:`coordinates`).
        out_coords, out_shift: target coordinates (default: the input coordinates + shift).
        scale: C in lam = ||K||_2 / C, the spectral norm of W1 (conv: of conv1, circular).
        white_noise: variance added to the diagonal of K (1e-8 makes K strictly PD).
        readout: also set V1, V2 (conv: the output convs).
        max_lengthscale, squared_lengthscale: conv filter lengthscales l ~ U(0, max) (or
            l^2 ~ U(0, max)).
    """
    kind = _check_model(model, "kglm_informed")
    _check("kglm_informed", scale=scale, white_noise=white_noise)
    if kind == "conv":
        _conv_informed(
            model,
            seed=seed,
            scale=scale,
            squared=squared_lengthscale,
            max_lengthscale=max_lengthscale,
            lengthscale=None,
            readout=readout,
        )
        return
    X = coordinates(model.in_shape, coords, x_range)
    Xo = _out_coords(model, X, out_coords, out_shift) if readout else None
    p = kernel_weights(kernel, X, Xo, scale=scale, white_noise=white_noise)
    _copy_cell_weights(model, p)
    if readout:
        _copy(model.V1, p["V1"])
        _copy(model.V2, p["V2"])
    _zero_biases(model)
    model.kglm_info = {"init": "kglm_informed", "lam": p["lam"], "scale": float(scale)}


@inits.register("kglm_naive")
def kglm_naive(
    model: Any,
    *,
    seed: int = 0,
    lengthscale: float = 1.0,
    x_range: Any = ("-2pi", "2pi"),
    coords: Any = "auto",
    scale: float = 1.0,
) -> None:
    """Naive kGLM init: SE kernel (``lengthscale``) on a uniform grid over ``x_range`` (pixels
    for images); sets W1 (= W3) and W2 only; V1 keeps the default init (redrawn from ``seed``),
    V2 = 0 (trainable). Conv: fixed-lengthscale SE filters for conv1/conv2 only."""
    kind = _check_model(model, "kglm_naive")
    _check("kglm_naive", scale=scale, lengthscale=lengthscale)
    if kind == "conv":
        _conv_informed(
            model,
            seed=seed,
            scale=scale,
            squared=False,
            max_lengthscale=0.0,
            lengthscale=lengthscale,
            readout=False,
        )
        return
    X = coordinates(model.in_shape, coords, x_range)
    p = kernel_weights({"name": "se", "lengthscale": lengthscale}, X, None, scale=scale)
    _copy_cell_weights(model, p)
    torch.manual_seed(int(seed))
    model.V1.reset_parameters()
    with torch.no_grad():
        model.V2.weight.zero_()
    _zero_biases(model)
    model.kglm_info = {"init": "kglm_naive", "lam": p["lam"], "scale": float(scale)}


@inits.register("kglm_random")
def kglm_random(
    model: Any,
    *,
    seed: int = 0,
    scale: float | None = None,
    std: float | None = None,
    freeze_skip: bool = True,
) -> None:
    """Random baseline of the kGLM experiments.

    Dense: PyTorch default uniform weights redrawn from ``seed`` (or rescaled so that
    ||W1||_2 = ``scale``), biases zero, V2 = 0 (frozen unless ``freeze_skip`` is False).
    Conv: every conv ~ N(0, std^2), std = ``std`` or ``scale`` / 19 (Tsuchida et al. 2022 section 4).
    """
    kind = _check_model(model, "kglm_random")
    _check("kglm_random", scale=scale, std=std)
    gen = torch.Generator().manual_seed(int(seed))
    if kind == "conv":
        if std is None:
            std = (1.0 if scale is None else float(scale)) / 19.0
        with torch.no_grad():
            for conv in (model.conv1, model.conv2, model.conv_out1, model.conv_out2):
                w = conv.weight
                w.copy_(torch.randn(w.shape, generator=gen, dtype=torch.float64).to(w.dtype) * std)
        model.kglm_info = {"init": "random", "std": float(std)}
        return
    with torch.no_grad():
        for lin in (model.deq.cell.W1, model.deq.cell.W3, model.W2, model.V1):
            if lin is None:
                continue
            bound = 1.0 / math.sqrt(lin.weight.shape[1])  # nn.Linear default: U(-1/sqrt(fan_in), .)
            u = torch.rand(lin.weight.shape, generator=gen, dtype=torch.float64) * 2 - 1
            lin.weight.copy_((u * bound).to(lin.weight.dtype))
        if scale is not None:
            from ..spectral.norms import dense_norm

            W1 = model.deq.cell.W1.weight
            W1.mul_(float(scale) / dense_norm(W1))
        model.V2.weight.zero_()
    if freeze_skip:
        model.V2.weight.requires_grad_(False)
    _zero_biases(model)
    model.kglm_info = {"init": "random"}


# the model deqbench.testing.check_init applies each of them to (they need a kGLM model)
for _init in (kglm_informed, kglm_naive, kglm_random):
    _init.example_model = "kglm_deq_tiny"  # type: ignore[attr-defined]
