"""Loss-landscape slices around trained parameters (Li et al. 2018; REFERENCE.md section 6).

``L(theta* + a d1 + b d2)`` on a grid, with seeded Gaussian directions keyed by parameter name and
normalised against the weights (filter normalisation by default: every slice along dim 0 of a
direction -- a conv output channel, a Linear row -- is scaled to the norm of the same slice of the
weights). Parameters with dim <= 1 (biases, norm layers) get a zero direction unless
``include_1d`` (then, as in Li et al., the direction is a copy of the weights). Buffers are never
perturbed; the model is evaluated in ``eval()`` through ``torch.func.functional_call``, so its
parameters are never written and stay bit-exact.

At every grid point: the loss, the accuracy (classification) or MSE (regression) and, for DEQs,
the forward f-evaluations, the final residual and whether the solver converged. Points where it
did not converge keep their measured loss in ``loss_raw`` while ``loss`` is NaN, so nothing
unconverged is ever averaged in silently.

Example:
    >>> import torch, deqbench
    >>> from deqbench.landscape import random_directions, resolve_directions, evaluate_grid, axis
    >>> model = deqbench.models.create("fc_deq_tiny", in_shape=(4,), num_outputs=3)
    >>> X, y = torch.randn(64, 4), torch.randint(0, 3, (64,))
    >>> dirs = random_directions(model, 2, seed=0)            # filter-normalised, biases zero
    >>> df = evaluate_grid(model, resolve_directions(model, dirs), X, y,
    ...                    alphas=axis(5), betas=axis(5))     # doctest: +SKIP
    >>> df.columns.tolist()[:4]                               # doctest: +SKIP
    ['alpha', 'beta', 'loss', 'loss_raw']
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.func import functional_call

from .deq import deq_layers, is_deq
from .directions import (  # re-exported: the landscape API in one place
    FORMAT,
    NORMS,
    Directions,
    _weights,
    filter_normalize,
    load_directions,
    normalize_direction,
    random_directions,
    resolve_directions,
    save_directions,
)
from .errors import ConfigError

__all__ = [
    "NORMS",
    "FORMAT",
    "Directions",
    "filter_normalize",
    "normalize_direction",
    "random_directions",
    "save_directions",
    "load_directions",
    "resolve_directions",
    "axis",
    "parse_range",
    "evaluate_grid",
    "landscape",
    "summarize",
]

# -- grid evaluation --------------------------------------------------------------------------


def axis(n: int = 51, lo: float = -1.0, hi: float = 1.0) -> list[float]:
    """``linspace(lo, hi, n)`` with an exact 0 when the range is symmetric and ``n`` odd."""
    if n < 1:
        raise ConfigError(f"landscape.grid must be >= 1, got {n}")
    pts = np.linspace(lo, hi, n)
    if n % 2 == 1 and math.isclose(lo, -hi):
        pts[n // 2] = 0.0
    return [round(float(p), 12) + 0.0 for p in pts]


def parse_range(text: str | Sequence[float]) -> tuple[float, float]:
    """``"-1:1"`` (or a pair) -> (-1.0, 1.0)."""
    if isinstance(text, str):
        parts = text.split(":")
        if len(parts) != 2:
            raise ConfigError(f"landscape.range: expected LO:HI, got {text!r}")
        try:
            lo, hi = float(parts[0]), float(parts[1])
        except ValueError as exc:
            raise ConfigError(f"landscape.range: expected LO:HI numbers, got {text!r}") from exc
    else:
        lo, hi = (float(v) for v in text)
    if not lo < hi:
        raise ConfigError(f"landscape.range: LO must be below HI, got {lo}:{hi}")
    return lo, hi


def _loss_fn(task: str) -> Callable[[Tensor, Tensor], Tensor]:
    return nn.functional.cross_entropy if task == "classification" else nn.functional.mse_loss


def _point_params(base, dirs, coords) -> dict[str, Tensor]:
    out = {}
    for n, w in base.items():
        p = w
        for d, c in zip(dirs, coords):
            if c != 0.0:
                p = p + c * d[n]
        out[n] = p
    return out


def _spec_weights(model: nn.Module) -> list[str]:
    """Names of 2-D cell weights of the DEQ layers (their spectral norm is logged per point)."""
    ids = {id(p) for layer in deq_layers(model) for p in layer.cell.parameters() if p.dim() == 2}
    return [n for n, p in model.named_parameters() if id(p) in ids]


_STATUS_RANK = {"ok": 0, "converged": 0, "stagnated": 1, "max_iter": 2, "diverged": 3, "nan": 4}


class _PointAcc:
    def __init__(self, device) -> None:
        self.loss = torch.zeros((), dtype=torch.float64, device=device)
        self.correct = torch.zeros((), dtype=torch.float64, device=device)
        self.n = 0
        self.nsteps: list[float] = []
        self.rel: list[float] = []
        self.abs: list[float] = []
        self.converged = True
        self.frac: list[tuple[float, int]] = []  # (converged fraction, batch size)
        self.status = "ok"

    def add_deq(self, model: nn.Module) -> None:
        stats = [
            layer.last_forward_stats
            for layer in deq_layers(model)
            if layer.last_forward_stats is not None
        ]
        if not stats:
            return
        self.nsteps.append(float(sum(s.nstep for s in stats)))
        self.rel.append(max(s.rel_max for s in stats))
        self.abs.append(max(s.abs_max for s in stats))
        self.frac.append((min(s.converged_frac for s in stats), int(stats[0].residual.numel())))
        for s in stats:
            self.converged = self.converged and bool(s.converged)
            st = s.status if s.status in _STATUS_RANK else "max_iter"
            if _STATUS_RANK[st] > _STATUS_RANK[self.status]:
                self.status = st


def _row(a, b, acc: _PointAcc, task: str, dim: int, spec: float, deq: bool) -> dict[str, Any]:
    n = max(acc.n, 1)
    loss = float(acc.loss) / n
    if deq:
        status = (
            "converged" if acc.converged else (acc.status if acc.status != "ok" else "max_iter")
        )
    else:
        status = "ok"
    if not math.isfinite(loss) and status in ("ok", "converged"):
        status = "nan"
    ok = math.isfinite(loss) and (acc.converged or not deq)
    row: dict[str, Any] = {"alpha": a}
    if dim >= 2:
        row["beta"] = b
    row["loss"] = loss if ok else math.nan
    row["loss_raw"] = loss
    if task == "classification":
        row["accuracy"] = float(acc.correct) / n
    else:
        row["mse"] = loss
    row["converged"] = bool(ok)
    row["status"] = status
    row["f_nstep"] = sum(acc.nsteps) / len(acc.nsteps) if acc.nsteps else math.nan
    row["f_residual"] = max(acc.rel) if acc.rel else math.nan
    row["f_abs_residual"] = max(acc.abs) if acc.abs else math.nan
    nb = sum(b for _, b in acc.frac)
    row["f_converged_frac"] = sum(f * b for f, b in acc.frac) / nb if nb else math.nan
    row["w_spec_norm"] = spec
    return row


def evaluate_grid(
    model: nn.Module,
    directions: Sequence[dict[str, Tensor]],
    X: Tensor,
    y: Tensor,
    *,
    alphas: Sequence[float],
    betas: Sequence[float] | None = None,
    task: str = "classification",
    batch_size: int | None = None,
    points_per_batch: int | None = None,
    spec_norm: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> Any:
    """Evaluate ``L(theta* + a d1 + b d2)`` on the grid ``alphas x betas``.

    Args:
        model: the trained model (its parameters are the centre; they are never written).
        directions: one or two ``{name: tensor}`` from :func:`resolve_directions`.
        X, y: the fixed evaluation examples (already on the model's device).
        alphas, betas: grid coordinates; ``betas`` None for a 1-D slice.
        task: ``classification`` (cross-entropy + accuracy) or ``regression`` (MSE).
        batch_size: evaluation batch (None: all examples in one forward).
        points_per_batch: grid points per forward through ``torch.func.vmap`` over stacked
            parameter sets (explicit models only: a DEQ solver's data-dependent stopping is not
            vmappable). None picks 8 on CUDA for models without convolutions and 1 otherwise
            (measured on an H100: vmap was 3x slower than one point per forward for a conv
            ``tied_repeat``); 1 disables vmap. When vmap fails for a model the evaluation falls
            back to one point per forward (``df.attrs["note"]`` says why).
        spec_norm: log the largest spectral norm of the DEQ cells' 2-D weights per point.
        progress: ``progress(done, total)`` after every point (or chunk).

    Returns:
        DataFrame, one row per point: alpha, (beta), loss (NaN where the solver did not
        converge or the loss is not finite), loss_raw, accuracy or mse, converged, status
        (ok | converged | max_iter | stagnated | diverged | nan), f_nstep (forward f-evals per
        evaluation batch, summed over DEQ layers), f_residual (max relative residual),
        f_abs_residual, f_converged_frac (fraction of examples whose residual is below the
        tolerance; the point counts as converged only when all are, the solvers' batch-max
        rule), w_spec_norm. ``df.attrs`` holds the timing and the vmap decision.
    """
    import pandas as pd

    dim = len(directions)
    if dim not in (1, 2):
        raise ConfigError(f"landscape: need 1 or 2 directions, got {dim}")
    if dim == 2 and betas is None:
        raise ConfigError("landscape: two directions need betas")
    betas_ = [0.0] if dim == 1 else list(betas or [0.0])
    coords = [(float(a), float(b)) for b in betas_ for a in alphas]
    total = len(coords)
    deq = is_deq(model)
    n = X.shape[0]
    bs = n if not batch_size else min(int(batch_size), n)
    loss_fn = _loss_fn(task)
    device = X.device
    if points_per_batch is None:
        # vmap batching pays on CUDA for small dense models; with convolutions (batched weights
        # become grouped convs) it was 3x slower than one point per forward on an H100, and on
        # the CPU it never helped.
        has_conv = any(isinstance(mod, nn.modules.conv._ConvNd) for mod in model.modules())
        points_per_batch = 8 if device.type == "cuda" and not has_conv else 1
    ppb = 1 if deq else max(1, int(points_per_batch))
    spec_names = _spec_weights(model) if spec_norm and deq else []
    base = _weights(model)
    dirs = list(directions)

    def spec_of(params: dict[str, Tensor]) -> float:
        if not spec_names:
            return math.nan
        return max(float(torch.linalg.matrix_norm(params[nm].double(), ord=2)) for nm in spec_names)

    def one_point(a: float, b: float) -> dict[str, Any]:
        params = _point_params(base, dirs, (a, b)[:dim])
        acc = _PointAcc(device)
        for i in range(0, n, bs):
            xb, yb = X[i : i + bs], y[i : i + bs]
            out = functional_call(model, params, (xb,))
            m = xb.shape[0]
            acc.loss += loss_fn(out, yb).double() * m
            if task == "classification":
                acc.correct += (out.argmax(1) == yb).sum().double()
            acc.n += m
            if deq:
                acc.add_deq(model)
        return _row(a, b, acc, task, dim, spec_of(params), deq)

    def chunk_vmap(chunk: list[tuple[float, float]]) -> list[dict[str, Any]]:
        cs = torch.tensor(chunk, dtype=torch.float64)
        stacked = {}
        for nm, w in base.items():
            p = w.unsqueeze(0).expand(len(chunk), *w.shape)
            for k, d in enumerate(dirs):
                c = cs[:, k].to(device=w.device, dtype=w.dtype).view(-1, *([1] * w.dim()))
                p = p + c * d[nm]
            stacked[nm] = p

        def f(p, xb, yb):
            out = functional_call(model, p, (xb,))
            loss = loss_fn(out, yb)
            if task == "classification":
                return loss, (out.argmax(1) == yb).sum()
            return loss, loss.new_zeros(())

        vf = torch.func.vmap(f, in_dims=(0, None, None))
        loss_sum = torch.zeros(len(chunk), dtype=torch.float64, device=device)
        corr = torch.zeros(len(chunk), dtype=torch.float64, device=device)
        for i in range(0, n, bs):
            xb, yb = X[i : i + bs], y[i : i + bs]
            lo, co = vf(stacked, xb, yb)
            loss_sum += lo.double() * xb.shape[0]
            corr += co.double()
        rows = []
        ls, cr = loss_sum.cpu().tolist(), corr.cpu().tolist()
        for j, (a, b) in enumerate(chunk):
            acc = _PointAcc(device)
            acc.loss, acc.correct, acc.n = (
                torch.tensor(ls[j], dtype=torch.float64),
                torch.tensor(cr[j], dtype=torch.float64),
                n,
            )
            rows.append(_row(a, b, acc, task, dim, math.nan, False))
        return rows

    was_training = model.training
    model.eval()
    rows: list[dict[str, Any]] = []
    vmap_used, vmap_note = False, ""
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            # The centre is evaluated on its own through the plain path, so it is exactly the
            # unperturbed model's loss whatever the batching of the other points.
            centre = (0.0, 0.0)
            done = 0
            if centre in coords:
                rows.append(one_point(*centre))
                done = 1
                if progress is not None:
                    progress(done, total)
            rest = [c for c in coords if c != centre]
            i = 0
            if ppb > 1:
                try:
                    first = rest[:ppb]
                    rows.extend(chunk_vmap(first))
                    vmap_used = True
                    i = len(first)
                    done += len(first)
                    if progress is not None:
                        progress(done, total)
                except Exception as exc:  # noqa: BLE001 - any functorch failure -> plain path
                    vmap_note = f"vmap unavailable ({type(exc).__name__}: {str(exc)[:120]}); one point per forward"
            while i < len(rest):
                if vmap_used:
                    chunk = rest[i : i + ppb]
                    rows.extend(chunk_vmap(chunk))
                    i += len(chunk)
                    done += len(chunk)
                else:
                    rows.append(one_point(*rest[i]))
                    i += 1
                    done += 1
                if progress is not None:
                    progress(done, total)
    finally:
        model.train(was_training)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    df = pd.DataFrame(rows)
    keys = ["beta", "alpha"] if dim >= 2 else ["alpha"]
    df = df.sort_values(keys, kind="stable").reset_index(drop=True)
    df.attrs.update(
        {
            "seconds": seconds,
            "points": total,
            "vmap": vmap_used,
            "points_per_batch": ppb if vmap_used else 1,
            "note": vmap_note,
            "examples": n,
            "batch_size": bs,
        }
    )
    return df


def landscape(
    model: nn.Module,
    X: Tensor,
    y: Tensor,
    *,
    task: str = "classification",
    grid: int = 51,
    range_: tuple[float, float] = (-1.0, 1.0),
    dims: int = 2,
    seed: int = 0,
    norm: str | None = None,
    include_1d: bool | None = None,
    directions: Directions | str | Path | None = None,
    renormalize: bool = True,
    **kwargs: Any,
) -> tuple[Any, Directions]:
    """Directions plus grid in one call: returns (DataFrame, Directions).

    ``directions`` may be a :class:`Directions` or a file from :func:`save_directions`; else
    ``dims`` new ones are drawn with ``seed``. ``norm`` / ``include_1d``: for new directions
    (default ``filter`` / False); with given ones the stored settings unless these are given
    (they then renormalise the raw draw, so they need ``renormalize``). Other keyword
    arguments go to :func:`evaluate_grid`.

    Example:
        >>> df, dirs = landscape(model, X, y, grid=21)      # doctest: +SKIP
    """
    if isinstance(directions, (str, Path)):
        directions = load_directions(directions)
    explicit = {k: v for k, v in (("norm", norm), ("include_1d", include_1d)) if v is not None}
    if directions is None:
        directions = random_directions(
            model, dims, seed=seed, norm=norm or "filter", include_1d=bool(include_1d)
        )
        explicit = {}
    if directions.ndim < dims:
        raise ConfigError(
            f"landscape: {dims} dimensions need {dims} directions, the file has {directions.ndim}"
        )
    resolved = resolve_directions(model, directions, renormalize=renormalize, **explicit)[:dims]
    if grid % 2 == 0:
        raise ConfigError(
            f"landscape.grid must be odd so that the trained parameters are a grid point, "
            f"got {grid}"
        )
    ax = axis(grid, *range_)
    df = evaluate_grid(
        model, resolved, X, y, alphas=ax, betas=ax if dims == 2 else None, task=task, **kwargs
    )
    return df, directions


def summarize(df: Any, level: float = 0.5) -> dict[str, float]:
    """Scalar summaries of a grid; unconverged points are counted, never averaged in.

    ``low_loss_area_frac``: fraction of converged points whose loss is within ``level`` of the
    centre loss (the "small-loss neighbourhood" of papers/004 section 4.2.1). When some points
    did not converge, ``mean_loss_increase_all`` and ``low_loss_area_frac_all`` give the same
    over every point at its measured loss (``loss_raw``: the loss of the solver's returned
    iterate), and ``converged_examples_frac_mean`` the mean share of examples whose solve
    reached the tolerance; so a DEQ whose solver misses the tolerance for a few examples at
    most points can still be compared with explicit networks, knowingly.
    """
    centre = df[(df["alpha"] == 0.0) & ((df["beta"] == 0.0) if "beta" in df else True)]
    out: dict[str, float] = {"points": float(len(df))}
    good = df[df["converged"].astype(bool)]
    out["nonconverged_points"] = float(len(df) - len(good))
    if len(centre):
        c = centre.iloc[0]
        out["loss_center"] = float(c["loss_raw"])
        if "accuracy" in df:
            out["accuracy_center"] = float(c["accuracy"])
        if "mse" in df:
            out["mse_center"] = float(c["mse"])
        if math.isfinite(float(c["f_nstep"])):
            out["f_nstep_center"] = float(c["f_nstep"])
        base = float(c["loss_raw"])
        if len(good):
            inc = good["loss"] - base
            out["mean_loss_increase"] = float(inc.mean())
            out["low_loss_area_frac"] = float((inc <= level).sum()) / float(len(df))
        if len(good) < len(df):
            raw = df["loss_raw"].astype(float) - base
            out["mean_loss_increase_all"] = float(raw.mean())
            out["low_loss_area_frac_all"] = float((raw <= level).sum()) / float(len(df))
            if "f_converged_frac" in df and df["f_converged_frac"].notna().any():
                out["converged_examples_frac_mean"] = float(df["f_converged_frac"].mean())
    if len(good):
        out["loss_max"] = float(good["loss"].max())
    if df["f_nstep"].notna().any():
        out["f_nstep_max"] = float(df["f_nstep"].max())
        out["f_residual_max"] = float(df["f_residual"].max())
    if df["w_spec_norm"].notna().any():
        out["w_spec_norm_max"] = float(df["w_spec_norm"].max())
        out["w_spec_norm_above_1_frac"] = float((df["w_spec_norm"] > 1).mean())
    return out
