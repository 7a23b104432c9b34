"""Seeded loss-landscape directions keyed by parameter name (Li et al. 2018).

Each (axis, parameter name) pair has its own seeded generator (float64 draw on the CPU), so a
parameter's direction depends on the seed and its name only. Normalisation against the weights:
``filter`` (each slice along dim 0 -- a conv output channel, a Linear row -- scaled to the norm of
the same slice of the weights; the default), ``layer``, ``weight`` or ``none``. Parameters with
dim <= 1 (biases, norm layers) get a zero direction unless ``include_1d`` (then, as in Li et al.,
a copy of the weights). Directions are saved with the raw draw and reloaded with
``torch.load(weights_only=True)``; :func:`resolve_directions` matches them to a model by name and
by default renormalises the raw draw against that model's weights (Li et al.'s semantics).

Example:
    >>> dirs = random_directions(model, 2, seed=0)                 # doctest: +SKIP
    >>> save_directions(dirs, "plane.pt")                          # doctest: +SKIP
    >>> d1, d2 = resolve_directions(other_model, load_directions("plane.pt"))  # doctest: +SKIP
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from ..core.errors import ConfigError
from ..core.tensor_files import load_tensors

NORMS = ("filter", "layer", "weight", "none")
FORMAT = "deqbench.directions"


@dataclass
class Directions:
    """Seeded directions keyed by parameter name.

    Attributes:
        raw: one ``{name: tensor}`` per axis, the raw N(0, 1) draw (float64, CPU).
        normalized: the same after normalisation against the weights they were made for.
        meta: seed, norm, include_1d, names and shapes, per-axis seeds.
    """

    raw: list[dict[str, Tensor]]
    normalized: list[dict[str, Tensor]]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def ndim(self) -> int:
        return len(self.raw)

    @property
    def names(self) -> list[str]:
        return list(self.raw[0]) if self.raw else []


def _name_seed(seed: int, axis_index: int, name: str) -> int:
    # One stream per (seed, axis, parameter name): a parameter's draw depends on its name only,
    # not on the order or the presence of other parameters.
    ss = np.random.SeedSequence(
        [int(seed) & 0xFFFFFFFF, int(axis_index), zlib.crc32(name.encode())]
    )
    return int(ss.generate_state(1, dtype=np.uint64)[0] & 0x7FFF_FFFF_FFFF_FFFF)


def filter_normalize(d: Tensor, w: Tensor, eps: float = 1e-10) -> Tensor:
    """Scale every slice ``d[i]`` along dim 0 to ``||w[i]||`` (Li et al.'s filter normalisation)."""
    dn = torch.linalg.vector_norm(d.reshape(d.shape[0], -1), dim=1)
    wn = torch.linalg.vector_norm(w.reshape(w.shape[0], -1), dim=1)
    scale = wn / (dn + eps)
    return d * scale.view(-1, *([1] * (d.dim() - 1)))


def normalize_direction(
    d: dict[str, Tensor],
    weights: dict[str, Tensor],
    norm: str = "filter",
    include_1d: bool = False,
) -> dict[str, Tensor]:
    """Normalise a raw direction against ``weights`` (both keyed by parameter name).

    Args:
        d: raw direction.
        weights: the parameters it is for; the result has their dtype and device.
        norm: ``filter`` (per slice along dim 0), ``layer`` (whole tensor), ``weight``
            (elementwise ``d * w``) or ``none``.
        include_1d: give parameters with dim <= 1 a direction equal to the weights (Li et al.'s
            behaviour without ``biasbn``) instead of zero.
    """
    if norm not in NORMS:
        raise ConfigError(
            f"landscape.norm: unknown normalisation '{norm}'; choose from {', '.join(NORMS)}"
        )
    out: dict[str, Tensor] = {}
    for name, w in weights.items():
        w = w.detach()
        if w.dim() <= 1:
            out[name] = w.clone() if include_1d else torch.zeros_like(w)
            continue
        di = d[name].to(device=w.device, dtype=w.dtype)
        if norm == "filter":
            di = filter_normalize(di, w)
        elif norm == "layer":
            di = di * (torch.linalg.vector_norm(w) / (torch.linalg.vector_norm(di) + 1e-10))
        elif norm == "weight":
            di = di * w
        out[name] = di
    return out


def _weights(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.detach() for n, p in model.named_parameters()}


def random_directions(
    model: nn.Module,
    n: int = 2,
    *,
    seed: int = 0,
    norm: str = "filter",
    include_1d: bool = False,
) -> Directions:
    """``n`` seeded Gaussian directions for ``model``'s parameters, normalised against them.

    Each (axis, parameter name) pair has its own seeded ``torch.Generator``, and the draw is made
    in float64 on the CPU, so the same seed gives the same directions on any device and dtype
    and for any model with the same parameter names and shapes.

    Example:
        >>> dirs = random_directions(model, 2, seed=0, norm="filter")   # doctest: +SKIP
        >>> save_directions(dirs, "plane.pt")                           # doctest: +SKIP
    """
    if norm not in NORMS:
        raise ConfigError(
            f"landscape.norm: unknown normalisation '{norm}'; choose from {', '.join(NORMS)}"
        )
    weights = _weights(model)
    raw: list[dict[str, Tensor]] = []
    for i in range(int(n)):
        d = {}
        for name, w in weights.items():
            g = torch.Generator().manual_seed(_name_seed(seed, i, name))
            d[name] = torch.randn(tuple(w.shape), generator=g, dtype=torch.float64)
        raw.append(d)
    normalized = [normalize_direction(d, weights, norm, include_1d) for d in raw]
    meta = {
        "seed": int(seed),
        "norm": norm,
        "include_1d": bool(include_1d),
        "ignore": "" if include_1d else "biasbn",
        "names": list(weights),
        "shapes": [list(w.shape) for w in weights.values()],
        "perturbs": "parameters",
        "renormalized_per_model": True,
    }
    return Directions(raw, normalized, meta)


def save_directions(dirs: Directions, path: str | Path) -> Path:
    """Save directions (raw and normalised, keyed by name) with ``torch.save``; reload them with
    :func:`load_directions` (``weights_only=True``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": FORMAT,
        "version": 1,
        "meta": dict(dirs.meta),
        "raw": [{k: v.detach().cpu() for k, v in d.items()} for d in dirs.raw],
        "normalized": [{k: v.detach().cpu() for k, v in d.items()} for d in dirs.normalized],
    }
    torch.save(payload, path)
    return path


def load_directions(path: str | Path) -> Directions:
    """Load directions saved by :func:`save_directions` (``torch.load(weights_only=True)``)."""
    path = Path(path)
    obj = load_tensors(path, "landscape.directions")
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise ConfigError(f"landscape.directions: {path} is not a deqbench directions file")
    return Directions(list(obj["raw"]), list(obj["normalized"]), dict(obj.get("meta", {})))


def resolve_directions(
    model: nn.Module,
    dirs: Directions,
    *,
    renormalize: bool = True,
    norm: str | None = None,
    include_1d: bool | None = None,
) -> list[dict[str, Tensor]]:
    """Directions ready for :func:`evaluate_grid`: matched to ``model``'s parameters by name,
    on its device and dtype.

    With ``renormalize`` (the default, Li et al.'s semantics) the stored raw draw is normalised
    against ``model``'s own weights, so two checkpoints or two models are compared on the same
    random plane, each measured in its own filter norms; otherwise the stored normalised
    directions are used as they are. ``norm`` / ``include_1d`` (default: the stored settings)
    choose that normalisation, so they need ``renormalize``.
    """
    if not renormalize and (norm is not None or include_1d is not None):
        raise ConfigError(
            "landscape: norm/include_1d with given directions take effect by renormalising "
            "their raw draw: drop them or pass renormalize=True"
        )
    weights = _weights(model)
    have = set(dirs.names)
    missing = [n for n in weights if n not in have]
    extra = [n for n in dirs.names if n not in weights]
    if missing or extra:
        msg = []
        if missing:
            msg.append(f"no direction for parameter(s) {', '.join(missing[:4])}")
        if extra:
            msg.append(f"direction(s) for unknown parameter(s) {', '.join(extra[:4])}")
        raise ConfigError(
            "landscape.directions: " + "; ".join(msg) + " (directions are keyed by name)"
        )
    for n, w in weights.items():
        if tuple(dirs.raw[0][n].shape) != tuple(w.shape):
            raise ConfigError(
                f"landscape.directions: shape of '{n}' is {tuple(dirs.raw[0][n].shape)}, "
                f"the model's is {tuple(w.shape)}"
            )
    if renormalize:
        nm = norm if norm is not None else dirs.meta.get("norm", "filter")
        inc = include_1d if include_1d is not None else bool(dirs.meta.get("include_1d", False))
        return [normalize_direction(d, weights, nm, inc) for d in dirs.raw]
    return [
        {n: d[n].to(device=w.device, dtype=w.dtype) for n, w in weights.items()}
        for d in dirs.normalized
    ]
