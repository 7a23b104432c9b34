"""Loss-landscape slices around trained parameters (Li et al. 2018).

``L(theta* + a d1 + b d2)`` on a grid, with seeded Gaussian directions keyed by parameter name and
normalised against the weights (filter normalisation by default: every slice along dim 0 of a
direction -- a conv output channel, a Linear row -- is scaled to the norm of the same slice of the
weights). Parameters with dim <= 1 (biases, norm layers) get a zero direction unless
``include_1d`` (then, as in Li et al., the direction is a copy of the weights). Buffers are never
perturbed; the model is evaluated in ``eval()`` through ``torch.func.functional_call``, so its
parameters are never written and stay bit-exact.

At every grid point: the loss, the accuracy (classification) or MSE (regression) and, for DEQs,
the forward f-evaluations, the final residual and whether the solver converged (every example's
residual below the tolerance, the solvers' batch-max rule). Points where it did not converge keep
their measured loss in ``loss_raw`` while ``loss`` is NaN: they are data (counted, drawn as
marks) but never part of a curve or a summary statistic. For a model without deqbench DEQ layers
(an explicit network, or a DEQ whose solver deqbench does not see) convergence is not measured:
``converged`` is empty and ``nonconverged_points`` NaN, never a silent 0.

**Forward solves.** Every point is solved as the model solves itself: the DEQ layers' own forward
solver settings (the model's declared defaults, or what the suite / command set with
``--solver``, ``--max-iter``, ``--tol``), from the model's own initial state, unless ``max_iter`` /
``tol`` are given for the evaluation. The centre (the trained weights) is therefore exactly the
model's loss, and it is the quality check of the whole slice (the analysis flags the rows when it
did not converge). No larger budget is applied by default: off-centre points that miss the
tolerance are data, not a failure, and for ``fc_deq_tiny`` after 5 epochs a larger budget bought
little (Anderson at 300 instead of 100 f-evaluations: 49 instead of 65 of 121 points unconverged,
at twice the time; the misses are a few examples per point, 0.3-2%, on which Anderson stalls).

**Warm starts** (``warm_start``; only the initial iterate changes, never the tolerance, the
budget or the stop rule, so where the fixed point is unique -- a contractive or monotone cell --
a point's loss is the one a cold start gives, to within what the tolerance allows):

* ``neighbour``: the grid is swept outward from the centre (:func:`visit_order`: the
  centre row from the centre column outward, then the rows above it, then those below it), so
  every point has solved grid neighbours. Each layer call of a point starts, per example, from
  the first of these that converged for that example (:func:`warm_candidates`): a first-order
  prediction from the fixed points of the neighbours in the same row and the row nearer the
  centre (``A + (A - A2)/2 + (B - C)/2``, ``A + B - C``, ``2A - A2``), else a neighbour's fixed
  point as it is, else -- no neighbour converged for that example -- the model's own initial
  state. A solved point's fixed points are kept only until the last point that reads them is
  solved: at most two rows and three points (``(2 x grid + 3) x examples x state``, e.g. 105 x
  48 MiB = 4.9 GiB for ``conv_deq`` at 51 x 51 and 256 examples in float32). Where they live is
  ``warm_store``: on an accelerator (``auto``) in host memory, pinned, with on the device only
  the states of the at most five neighbours the point being solved reads and its own (0.28 GiB
  there), copied exactly, so the solves are those of ``warm_store="device"`` bit for bit.
* ``nearest``: the same sweep, starting from a neighbour's fixed point as it is (no prediction).
* ``centre`` (``True``, the earlier boolean): every point from the centre's fixed point.
* ``off`` (``False``, the default): every point from the model's own initial state, as the model
  is run: a model with several fixed points computes that function, which a warm start need
  not follow.

Measured on 2 CPU cores (``benchmarks/landscape.py --warm --quick --grid 21``: ``conv_deq_tiny``
at initialisation, 32 examples, Anderson tol 1e-4): 17.3 f-evaluations per point instead of 27.3
cold (0.63x; ``nearest`` 0.76x, grid step 0.1), 0.60x the time, every point converged both ways,
largest relative loss difference 2e-5. The earlier ``centre`` start did not pay (``fc_deq_tiny``,
11 x 11 on [-1, 1], 1024 examples: 80 vs 80 Anderson f-evaluations per point, 63 vs 61 Broyden
with more misses), because far points are far from the centre. Where a cell has several fixed
points the warm start follows the branch of its neighbours (continuity from the trained model's
own solve at the centre), which a cold start need not: on ``fc_deq_tiny`` after 5 epochs (the
``deqbench landscape`` help example, the cell's spectral norm above 1 over the whole plane) warm
and cold losses differ by more than 1e-4 at 118 of 441 points, by up to 0.9% where both met the
tolerance, and by 0.5% in float64 at tol 1e-9 (several fixed points, not a tolerance effect);
there it took 29.9 instead of 41.6 Broyden f-evaluations per point and 438 instead of 432 points
converged. A warm-started point that misses the tolerance is solved again from the model's own
start (``warm_retry``; column ``warm_retried``, ``f_nstep`` counts both solves: 6 of the 441
points above), so every point that converges cold converges warm.
``warm_start="off"`` gives the cold landscape; ``benchmarks/landscape.py
--warm`` lists every point where the two differ. ``f_nstep`` counts the f-evaluations from the
start actually used; the columns ``init`` (``model``, ``neighbour``, ``nearest``, ``centre`` or
``partial``), ``warm_frac`` (share of examples x layer calls that started warm),
``predicted_frac`` (of which from a prediction) and ``init_alpha`` / ``init_beta`` (the nearest
source point) say which. A layer call whose stored state does not match the shape, dtype or
device of the call's own initial state, or that reports no solve (an unrolled layer, whose
initial state is part of the network), starts as the model starts it.

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

The warm starts of the grid's solves (visit order, candidates, the layer hooks) are in
:mod:`deqbench.landscape.warm_start`, the directions in :mod:`deqbench.landscape.directions`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from ..core.errors import ConfigError
from .directions import (  # noqa: F401  (re-exported: the landscape API in one place)
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
from .grid import (  # noqa: F401  (re-exported: the landscape API in one place)
    _STATUS_RANK,
    _Grid,
    _loss_fn,
    _point_params,
    _PointAcc,
    _row,
    _spec_weights,
)
from .warm_start import (
    WARM_STARTS as WARM_STARTS,  # re-exported: the warm-start modes the analysis checks
)
from .warm_start import (
    WARM_STORES as WARM_STORES,  # re-exported: where the warm starts keep fixed points
)
from .warm_start import (  # noqa: F401  (re-exported: the landscape API in one place)
    Combo,
    Index,
    _nearest_zero,
    _WarmStart,
    visit_order,
    warm_candidates,
    warm_start_mode,
    warm_store_mode,
)

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
    "centre_row",
    "centre_note",
    "converged_mask",
    "convergence_measured",
]

# -- grid evaluation --------------------------------------------------------------------------


#: The most points per grid axis (``grid``; 501 x 501 = 251,001 points, each a forward over the
#: evaluation examples: days of solves already). Beyond it the sweep's bookkeeping alone (the
#: visit order, Python lists over every point) would take minutes and gigabytes before the
#: first solve.
MAX_GRID = 501


def axis(n: int = 51, lo: float = -1.0, hi: float = 1.0) -> list[float]:
    """``linspace(lo, hi, n)`` with an exact 0 when the range is symmetric and ``n`` odd."""
    if n < 1:
        raise ConfigError(f"landscape.grid must be >= 1, got {n}")
    if n > MAX_GRID:
        raise ConfigError(f"landscape.grid must be at most {MAX_GRID} points per axis, got {n}")
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


def converged_mask(df: Any) -> Any:
    """Boolean Series: True where a point's solve was measured and did not converge.

    (``converged`` is True / False where measured and empty where convergence is unknown; an
    unknown point is not known to be unconverged.)"""
    if "converged" not in df:
        return df.index.to_series(index=df.index).astype(bool) & False
    c = df["converged"]
    return c.notna() & ~c.fillna(True).astype(bool)


def convergence_measured(df: Any) -> bool:
    """Whether any point of the grid reported a solve (``converged`` not empty)."""
    return "converged" in df and bool(df["converged"].notna().any())


def _points_per_batch(model: nn.Module, device: torch.device, asked: int | None) -> int:
    """Grid points per vmapped forward of an explicit model (``asked``; None: the default)."""
    if asked is None:
        # vmap batching pays on CUDA for small dense models; with convolutions (batched weights
        # become grouped convs) it was 3x slower than one point per forward on an H100, and on
        # the CPU it never helped.
        has_conv = any(isinstance(mod, nn.modules.conv._ConvNd) for mod in model.modules())
        asked = 8 if device.type == "cuda" and not has_conv else 1
    return max(1, int(asked))


@contextlib.contextmanager
def _evaluating(
    model: nn.Module, layers: Sequence[Any], max_iter: int | None, tol: float | None
) -> Iterator[None]:
    """The model in eval mode without gradients, its DEQ layers with the forward budget
    ``max_iter`` / ``tol`` where given; its mode and the layers' settings restored after."""
    was_training = model.training
    model.eval()
    saved_cfg = [layer.solver_cfg for layer in layers]
    if max_iter is not None or tol is not None:
        budget: dict[str, Any] = {
            k: v for k, v in (("max_iter", max_iter), ("tol", tol)) if v is not None
        }
        for layer in layers:
            layer.solver_cfg = dataclasses.replace(layer.solver_cfg, **budget)
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)
        for layer, cfg in zip(layers, saved_cfg):
            layer.solver_cfg = cfg


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
    warm_start: bool | str = "off",
    warm_retry: bool = True,
    warm_store: str = "auto",
    max_iter: int | None = None,
    tol: float | None = None,
) -> Any:
    """Evaluate ``L(theta* + a d1 + b d2)`` on the grid ``alphas x betas``.

    The centre is solved first, from the model's own initial state. With ``warm_start``
    ``neighbour`` (the default) the other points follow :func:`visit_order` and each starts, per
    example, from the fixed point of an already solved grid neighbour that converged for that
    example; ``centre`` starts them from the centre's; ``off`` solves every point from the
    model's own initial state (module docstring: the stop rule is the same, when the result is
    the same point and what it selects when it need not).

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
        warm_start: ``off`` (default), ``neighbour``, ``nearest``, ``centre`` (needs the
            centre on the grid); ``True`` / ``False`` mean ``centre`` / ``off`` (:func:`warm_start_mode`).
            Ignored for models without DEQ layers (``df.attrs["warm_start"]`` is then ``off``).
        warm_retry: solve a warm-started point that missed the tolerance again from the model's
            own initial state (its row is then that solve's, ``warm_retried`` True, ``f_nstep``
            the f-evaluations of both), so no point converges cold but not warm.
        warm_store: where the warm starts keep the solved points' fixed points: ``device`` (on
            the device of the solve), ``host`` (in host memory, pinned for CUDA: on the device
            only the few the point being solved reads, copied exactly, so the solves are the
            same), ``auto`` (the default: ``host`` on an accelerator, ``device`` on the CPU).
        max_iter, tol: forward budget / tolerance of the DEQ layers during the evaluation
            (None: the layers' own settings; they are restored afterwards).

    Returns:
        DataFrame, one row per point: alpha, (beta), loss (NaN where the solver did not
        converge or the loss is not finite), loss_raw, accuracy or mse, converged (empty when
        no DEQ solve was seen: not measured), status (ok | converged | max_iter | stagnated |
        diverged | nan), init (model: every example from the model's own initial state;
        neighbour / centre: every example from a stored fixed point; partial: some), warm_frac
        (share of examples x DEQ layer calls started from a stored fixed point), init_alpha /
        init_beta (the nearest source point; NaN when none), warm_retried, f_nstep (forward f-evals per evaluation batch, summed over DEQ layers), f_residual (max
        relative residual), f_abs_residual, f_converged_frac (fraction of examples whose
        residual is below the tolerance; the point counts as converged only when all are, the
        solvers' batch-max rule), f_tol, w_spec_norm. ``df.attrs`` holds the timing, the vmap
        decision and ``warm_start`` (the mode used); with a warm start also
        ``warm_store`` and what the warm starts held at most (``warm_kept_peak_points``,
        ``warm_kept_peak_bytes``, ``warm_device_peak_bytes``: :class:`_WarmStart`).
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
    grid = _Grid(
        model,
        directions,
        X,
        y,
        alphas=alphas,
        betas=betas_,
        task=task,
        batch_size=batch_size,
        spec_norm=spec_norm,
        warm_start=warm_start,
        warm_retry=warm_retry,
        warm_store=warm_store,
    )
    ppb = 1 if grid.deq else _points_per_batch(model, grid.device, points_per_batch)
    t0 = time.perf_counter()
    with _evaluating(model, grid.layers, max_iter, tol), grid.warm or contextlib.nullcontext():
        rows, vmap_used, vmap_note = grid.sweep(coords, ppb, progress)
    if grid.device.type == "cuda":
        torch.cuda.synchronize(grid.device)
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
            "warm_start": grid.mode,
            "examples": grid.n,
            "batch_size": grid.bs,
        }
    )
    if grid.warm is not None:
        df.attrs.update(grid.warm.memory())
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
    explicit: dict[str, Any] = {
        k: v for k, v in (("norm", norm), ("include_1d", include_1d)) if v is not None
    }
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


def centre_row(df: Any) -> Any:
    """The grid's centre (alpha = beta = 0) as a Series, or None when it is not a grid point."""
    sel = df["alpha"] == 0.0
    if "beta" in df:
        sel &= df["beta"] == 0.0
    c = df[sel]
    return c.iloc[0] if len(c) else None


def summarize(df: Any, level: float = 0.5, raw: bool = False) -> dict[str, float]:
    """Scalar summaries of a grid; unconverged points are counted, never averaged in.

    ``nonconverged_points``: points whose solve missed the tolerance (NaN when convergence was
    not measured: no deqbench DEQ layer reported a solve). ``low_loss_area_frac``: fraction of
    the converged points whose loss is within ``level`` of the centre loss (the "small-loss
    neighbourhood" of Nguyen 2022 section 4.2.1); ``mean_loss_increase`` and ``loss_max`` over
    the same points; ``converged_frac`` the converged share of the grid.

    ``raw=True`` adds, when some points did not converge, ``mean_loss_increase_all`` and
    ``low_loss_area_frac_all`` over every point at its measured loss (``loss_raw``: the loss
    of the solver's returned iterate) and ``converged_examples_frac_mean`` (the mean share of
    examples whose solve reached the tolerance): an explicit, knowing comparison of a DEQ whose
    solver misses the tolerance for a few examples with explicit networks; the analysis does not
    report them.
    """
    out: dict[str, float] = {"points": float(len(df))}
    bad = converged_mask(df)
    measured = convergence_measured(df)
    good = df[~bad & df["loss"].notna()] if "loss" in df else df.iloc[:0]
    out["nonconverged_points"] = float(bad.sum()) if measured else math.nan
    if measured:
        out["converged_frac"] = float((~bad).sum()) / max(len(df), 1)
    c = centre_row(df)
    if c is not None:
        out["loss_center"] = float(c["loss_raw"])
        if "accuracy" in df:
            out["accuracy_center"] = float(c["accuracy"])
        if "mse" in df:
            out["mse_center"] = float(c["mse"])
        if math.isfinite(float(c["f_nstep"])):
            out["f_nstep_center"] = float(c["f_nstep"])
        if math.isfinite(float(c.get("f_residual", math.nan))):
            out["f_residual_center"] = float(c["f_residual"])
        base = float(c["loss_raw"])
        if len(good):
            inc = good["loss"].astype(float) - base
            out["mean_loss_increase"] = float(inc.mean())
            out["low_loss_area_frac"] = float((inc <= level).sum()) / float(len(good))
        if raw and bad.any():
            rawinc = df["loss_raw"].astype(float) - base
            out["mean_loss_increase_all"] = float(rawinc.mean())
            out["low_loss_area_frac_all"] = float((rawinc <= level).sum()) / float(len(df))
            if "f_converged_frac" in df and df["f_converged_frac"].notna().any():
                out["converged_examples_frac_mean"] = float(df["f_converged_frac"].mean())
    if len(good):
        out["loss_max"] = float(good["loss"].max())
    if df["f_nstep"].notna().any():
        out["f_nstep_max"] = float(df["f_nstep"].max())
        if len(good) and good["f_nstep"].notna().any():
            out["f_nstep_mean_converged"] = float(good["f_nstep"].mean())
        out["f_residual_max"] = float(df["f_residual"].max())
    if df["w_spec_norm"].notna().any():
        out["w_spec_norm_max"] = float(df["w_spec_norm"].max())
        out["w_spec_norm_above_1_frac"] = float((df["w_spec_norm"] > 1).mean())
    return out


def centre_note(df: Any) -> str:
    """One line (cause and fix) when the centre, the trained weights, is not a trustworthy
    measurement: its solve missed the tolerance or its loss is not finite; empty otherwise."""
    c = centre_row(df)
    if c is None:
        return "the trained weights are not a grid point: use an odd --grid and a range around 0"
    loss = float(c["loss_raw"])
    conv = c.get("converged")
    if conv is not None and conv == conv and not bool(conv):
        rel, tol = float(c.get("f_residual", math.nan)), float(c.get("f_tol", math.nan))
        frac = float(c.get("f_converged_frac", math.nan))
        nstep = float(c.get("f_nstep", math.nan))
        status = str(c.get("status", "max_iter"))
        where = f"rel {rel:.2e} > {tol:.0e}" if math.isfinite(tol) else f"rel {rel:.2e}"
        if math.isfinite(frac):
            where += f", {1 - frac:.1%} of examples"
        if math.isfinite(nstep):
            where += f", {nstep:.0f} f-evals"
        other = "try another --solver (solver.name in a suite), e.g. broyden, or --dtype float64"
        fix = {
            "diverged": other,
            "stagnated": other,
            "nan": "check the training (non-finite state) or use --dtype float64",
        }.get(status, "raise --max-iter (solver.max_iter in a suite) or use --dtype float64")
        return f"forward solver did not converge at the trained weights ({status}: {where}): {fix}"
    if not math.isfinite(loss):
        return "the loss at the trained weights is not finite: check the training or the checkpoint"
    return ""
