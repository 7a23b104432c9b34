"""Analysis ``trajectory``: the path of the forward iterates z^[i] (Nguyen 2022 section 4.1).

A fixed probe set (default 256 examples, balanced by class, seeded) is solved at chosen epochs
(default: at init, after epoch 1 and at the end) with every point at which the solver evaluates
f recorded: the iterate z^[i] and the per-example relative residual of eq. 4.2,
``||f(z^[i]) - z^[i]|| / ||f(z^[i])||`` (for ``newton_krylov`` its line-search trials and
finite-difference probes count as such points; calls of f inside a JVP do not). The solve is the cell's own forward solver (or the one
given), run through the model's own forward so any DEQ model works (``layer`` picks the DEQ
layer of a multi-layer model); a structured solver that never calls f records nothing and is an
error.

PCA is fitted per cell and seed on all of that cell's recorded states across epochs (float64):
``pca: exact`` accumulates the covariance in float64 over chunks and takes its exact
eigendecomposition (state dimension <= ``exact_max_dim``); ``lowrank`` runs a randomized block
subspace iteration on the covariance (10 vectors, 8 passes, float64, chunked) and states its
error, the largest relative eigen-residual ``||C v - lambda v|| / lambda`` of the two components,
in the ``pca_error`` row (``auto``: exact up to ``exact_max_dim``). A lowrank error above 1e-3 is
``flagged``.

Memory: every f-evaluation's per-example residual is kept (T x n floats); states are kept for at
most ``max_states`` iterations per solve: the first ``max_states // 2`` always, later ones thinned
to an even stride that doubles whenever the cap is reached (so the kept tail spans the whole
solve), plus the returned fixed point. Held: n x D x (max_states + 1) float32 per recorded epoch
(256 x 1024 x 33 x 4 B = 35 MB for the tiny conv cell).

Rows (analysis ``trajectory``; ``step`` = epoch of the recording):

* ``cell_weight_std`` (before training): the measured std of the cell's weight tensors (the
  init scale the plots and the outcome checks read);
* per recording: ``iterations_median`` / ``iterations_mean`` (per-example f-evaluations until
  the relative residual first fell below ``tol``; examples that never did count the solve's
  length), ``converged_frac``, ``rel_residual_final_median``, ``nstep``, ``tol``, and
  ``silhouette`` of the returned fixed points by class, variant ``pca2`` (in the PCA plane)
  and ``full`` (in the state space);
* once: ``explained_variance_ratio`` (variants ``pc1``, ``pc2``), ``pca_error``, ``states``,
  ``state_dim``.

Series: ``trajectory`` (epoch, example, label, iteration, pc1, pc2; iteration -1 is the returned
fixed point) and ``trajectory_residual`` (epoch, example, label, iteration, rel_residual).
Suite-level plots (:mod:`deqbench.trajectory.plots`): ``trajectory_residuals``
(Fig. 4.1), ``trajectory_pca`` (Fig. 4.2) and ``trajectory_epochs`` (Fig. 4.3), the cells side
by side.

Example (suite YAML)::

    analyses:
      - trajectory: {n: 256, epochs: [0, 1, -1], max_states: 32}

Plain functions: :func:`balanced_probes`, :func:`record_solve`, :func:`pca`,
:func:`silhouette`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from ..analyses.base import Analysis, CellContext, EpochInfo, Row
from ..core.deq import CellMap, SolverConfig, deq_layers
from ..core.registry import analyses
from ..solvers.base import residuals

SERIES = "trajectory"
RESIDUAL_SERIES = "trajectory_residual"
LOWRANK_FLAG = 1e-3


def balanced_probes(y: Any, n: int, seed: int) -> Tensor:
    """Indices of ``n`` examples balanced by class (labels ``y``), seeded: classes take turns in
    a seeded order of their members; a class that runs out leaves its turns to the others.

    Example:
        >>> import torch
        >>> idx = balanced_probes(torch.tensor([0, 0, 0, 1, 1, 2]), 3, seed=0)
        >>> sorted(torch.tensor([0, 0, 0, 1, 1, 2])[idx].tolist())
        [0, 1, 2]
    """
    y = torch.as_tensor(y).cpu()
    g = torch.Generator().manual_seed(int(seed))
    perm = torch.randperm(len(y), generator=g)
    classes = sorted(set(y.tolist()))
    members = {c: [int(i) for i in perm if int(y[i]) == c] for c in classes}
    out: list[int] = []
    depth = 0
    while len(out) < min(n, len(y)):
        for c in classes:
            if depth < len(members[c]) and len(out) < n:
                out.append(members[c][depth])
        depth += 1
    return torch.tensor(out, dtype=torch.long)


class _Thinned:
    """At most ``cap`` (index, state) pairs: the first ``cap // 2`` indices always, then every
    ``stride``-th later one, the stride doubling each time the tail overflows."""

    def __init__(self, cap: int) -> None:
        self.head_n = max(1, cap // 2)
        self.tail_cap = max(1, cap - self.head_n)
        self.head: list[tuple[int, Tensor]] = []
        self.tail: list[tuple[int, Tensor]] = []
        self.stride = 1

    def add(self, i: int, z: Any) -> None:
        """Offer iteration ``i``; ``z`` is a thunk giving the state (called only if kept)."""
        if i < self.head_n:
            self.head.append((i, z()))
            return
        if (i - self.head_n) % self.stride:
            return
        self.tail.append((i, z()))
        if len(self.tail) > self.tail_cap:
            self.tail = self.tail[::2]
            self.stride *= 2

    def items(self) -> list[tuple[int, Tensor]]:
        return self.head + self.tail


@dataclass
class Recording:
    """One recorded solve of the probe set.

    Attributes:
        residual: (T, n) relative residual at every f-evaluation (eq. 4.2).
        iterations: f-evaluation indices (from 0) of the kept states.
        states: (K, n, D) float32 kept iterates.
        final: (n, D) float32 returned fixed point.
        nstep, converged, status: the solver's stats.
    """

    residual: np.ndarray
    iterations: list[int]
    states: np.ndarray
    final: np.ndarray
    nstep: int
    converged: bool
    status: str
    tol: float
    extra: dict[str, Any] = field(default_factory=dict)


class _RecordingMap(CellMap):
    """CellMap that keeps what every evaluation saw (iterate, per-example residual)."""

    __slots__ = ("thin", "res", "calls")

    def __init__(self, cell: Any, u: Tensor, cap: int) -> None:
        super().__init__(cell, u)
        self.thin = _Thinned(cap)
        self.res: list[Tensor] = []
        self.calls = 0

    def __call__(self, z: Tensor) -> Tensor:
        fz = self.cell(z, self.u)
        if not _wrapped(z):  # not a call inside a torch.func transform (a solver's JVP)
            _, rel = residuals(fz, z)
            self.res.append(rel.detach().double().cpu())
            zc = z.detach()
            self.thin.add(self.calls, lambda: zc.reshape(zc.shape[0], -1).float().cpu().clone())
            self.calls += 1
        return fz


def _wrapped(z: Tensor) -> bool:
    try:
        return bool(torch._C._functorch.is_functorch_wrapped_tensor(z))
    except AttributeError:  # pragma: no cover - older torch
        return False


def record_solve(
    model: Any,
    x: Tensor,
    *,
    layer: int = 0,
    solver: SolverConfig | None = None,
    max_states: int = 32,
) -> Recording:
    """Run ``model`` on ``x`` (eval mode, no grad) and record the forward solve of its DEQ layer
    ``layer`` (solver: ``solver`` or the layer's own).

    Example:
        >>> import torch, deqbench
        >>> m = deqbench.models.create("conv_deq_tiny")
        >>> rec = record_solve(m, torch.randn(4, 1, 8, 8), max_states=8)
        >>> rec.residual.shape[1], rec.states.shape[1:] == (4, 16 * 8 * 8)
        (4, True)
    """
    from .. import solvers

    layers = list(deq_layers(model))
    if not layers:
        raise ValueError("trajectory: the model has no DEQ layer")
    if not 0 <= layer < len(layers):
        raise ValueError(f"trajectory: layer {layer} out of range (the model has {len(layers)})")
    dl = layers[layer]
    cfg = solver or dl.solver_cfg
    box: dict[str, Any] = {}

    def patched(u: Tensor, z0: Tensor, cfg_: SolverConfig | None = None) -> Any:
        fmap = _RecordingMap(dl.cell, u, max_states)
        with torch.no_grad():
            z, stats = solvers.get(cfg.name)(fmap, z0, max_iter=cfg.max_iter, tol=cfg.tol,
                                             stop_mode=cfg.stop_mode, **cfg.options)  # fmt: skip
        dl.last_forward_stats = stats
        if "map" not in box:  # the first solve of this layer in the forward
            box["map"], box["z"], box["stats"] = fmap, z, stats
        return z, stats

    was = model.training
    model.eval()
    # an instance attribute shadows the method for this forward only
    dl.solve = patched  # type: ignore[method-assign,assignment]
    try:
        with torch.no_grad():
            model(x)
    finally:
        del dl.solve
        model.train(was)
    fmap, stats = box.get("map"), box.get("stats")
    if fmap is None or not fmap.res:
        name = cfg.name
        raise ValueError(
            f"trajectory: solver '{name}' did not evaluate the cell map (a structured solver); "
            "record with a generic solver, e.g. trajectory: {solver: anderson}"
        )
    kept = fmap.thin.items()
    z = box["z"]
    assert stats is not None  # set with map
    return Recording(
        residual=torch.stack(fmap.res).numpy(),
        iterations=[i for i, _ in kept],
        states=torch.stack([s for _, s in kept]).numpy(),
        final=z.detach().reshape(z.shape[0], -1).float().cpu().numpy(),
        nstep=int(stats.nstep),
        converged=bool(stats.converged),
        status=str(stats.status),
        tol=float(cfg.tol),
    )


# -- PCA ---------------------------------------------------------------------------------------


@dataclass
class PCA:
    """Top-k principal directions. ``project(X)`` gives coordinates (N, k)."""

    mean: np.ndarray  # (D,)
    components: np.ndarray  # (k, D), orthonormal rows
    variance: np.ndarray  # (k,) variance along each component
    total_variance: float
    method: str
    error: float  # lowrank: max relative eigen-residual; exact: 0

    @property
    def explained_ratio(self) -> np.ndarray:
        return self.variance / self.total_variance if self.total_variance > 0 else self.variance

    def project(self, X: np.ndarray) -> np.ndarray:
        return (np.asarray(X, dtype=np.float64) - self.mean) @ self.components.T


def _chunks(blocks: list[np.ndarray], size: int = 8192) -> Iterable[np.ndarray]:
    for b in blocks:
        for i in range(0, b.shape[0], size):
            yield np.asarray(b[i : i + size], dtype=np.float64)


def pca(
    blocks: np.ndarray | list[np.ndarray], k: int = 2, method: str = "exact", seed: int = 0
) -> PCA:
    """PCA of the rows of ``blocks`` (one (N, D) array or a list of row blocks), in float64.

    ``exact``: covariance accumulated over chunks, exact symmetric eigendecomposition.
    ``lowrank``: randomized block subspace iteration (k + 8 vectors, 8 passes over the data),
    Rayleigh-Ritz; ``error`` is max_j ||C v_j - lambda_j v_j|| / lambda_j (one more pass).
    Components are signed so that their largest-magnitude entry is positive.

    Example:
        >>> import numpy as np
        >>> X = np.random.default_rng(0).normal(size=(200, 5)) * [5, 2, 1, 1, 1]
        >>> p = pca(X)
        >>> bool(np.allclose(abs(p.components[0]), abs(np.linalg.svd(X - X.mean(0))[2][0])))
        True
    """
    blocks = [blocks] if isinstance(blocks, np.ndarray) else list(blocks)
    N = sum(b.shape[0] for b in blocks)
    D = blocks[0].shape[1]
    if N < 2:
        raise ValueError("pca: need at least 2 rows")
    mean = sum(c.sum(0) for c in _chunks(blocks)) / N
    total = sum(float(((c - mean) ** 2).sum()) for c in _chunks(blocks)) / N

    def cov_times(V: np.ndarray) -> np.ndarray:
        out = np.zeros_like(V)
        for c in _chunks(blocks):
            cc = c - mean
            out += cc.T @ (cc @ V)
        return out / N

    if method == "exact":
        C = np.zeros((D, D))
        for c in _chunks(blocks):
            cc = c - mean
            C += cc.T @ cc
        C /= N
        lam, vec = np.linalg.eigh(C)
        order = np.argsort(lam)[::-1][:k]
        comps, var, err = vec[:, order].T, lam[order], 0.0
    elif method == "lowrank":
        q = min(D, k + 8)
        V = np.random.default_rng(seed).standard_normal((D, q))
        V, _ = np.linalg.qr(V)
        for _ in range(8):
            V, _ = np.linalg.qr(cov_times(V))
        CV = cov_times(V)
        lam, w = np.linalg.eigh(V.T @ CV)
        order = np.argsort(lam)[::-1][:k]
        comps = (V @ w[:, order]).T
        var = lam[order]
        R = cov_times(comps.T) - comps.T * var
        err = float(max(np.linalg.norm(R[:, j]) / max(var[j], 1e-300) for j in range(len(var))))
    else:
        raise ValueError(f"pca: method must be 'exact' or 'lowrank', got {method!r}")
    signs = np.sign(comps[np.arange(len(comps)), np.abs(comps).argmax(1)])
    comps = comps * np.where(signs == 0, 1.0, signs)[:, None]
    return PCA(mean, comps, np.maximum(var, 0.0), total, method, err)


def silhouette(X: np.ndarray, labels: np.ndarray) -> float:
    """Mean silhouette coefficient (euclidean) of points ``X`` (N, d) by ``labels``; a point
    alone in its class scores 0. NaN with fewer than two classes.

    Example:
        >>> import numpy as np
        >>> silhouette(np.array([[0.0], [0.1], [5.0], [5.1]]), np.array([0, 0, 1, 1])) > 0.9
        True
    """
    X = np.asarray(X, dtype=np.float64)
    labels = np.asarray(labels)
    classes = np.unique(labels)
    if len(classes) < 2:
        return math.nan
    sq = (X**2).sum(1)
    d = np.sqrt(np.maximum(sq[:, None] + sq[None, :] - 2 * X @ X.T, 0.0))
    s = np.zeros(len(X))
    mean_to = np.stack([d[:, labels == c].mean(1) for c in classes], 1)  # (N, C)
    counts = np.array([(labels == c).sum() for c in classes])
    own = np.searchsorted(classes, labels)
    n_own = counts[own]
    a = np.where(n_own > 1, mean_to[np.arange(len(X)), own] * n_own / np.maximum(n_own - 1, 1), 0)
    other = mean_to.copy()
    other[np.arange(len(X)), own] = np.inf
    b = other.min(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        s = np.where(n_own > 1, (b - a) / np.maximum(a, b), 0.0)
    return float(np.nan_to_num(s).mean())


def iterations_to_tol(residual: np.ndarray, tol: float) -> tuple[np.ndarray, np.ndarray]:
    """Per example: f-evaluations until the residual first fell below ``tol`` (1-based), or
    the solve's length if it never did; and whether it did."""
    below = residual < tol
    hit = below.any(0)
    first = np.where(hit, below.argmax(0) + 1, residual.shape[0])
    return first, hit  # type: ignore[return-value]  # 2-d residual: any(0) is an array


# -- the analysis ------------------------------------------------------------------------------


@analyses.register("trajectory")
class Trajectory(Analysis):
    """Forward iterates of a fixed probe set at chosen epochs: per-iteration residuals, PCA
    trajectories and class separation of the fixed points (Nguyen 2022 section 4.1)."""

    judges_own_solves = True  # see Analysis.judges_own_solves
    name = "trajectory"
    version = "1"

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        n: int = Field(256, ge=2, description="probe examples (balanced by class)")
        split: Literal["train", "test"] = "test"
        probe_seed: int | None = Field(
            None, description="probe selection seed (default: cell seed)"
        )
        epochs: list[int] = Field(
            default_factory=lambda: [0, 1, -1],
            description="epochs to record (0 = at init, -1 = the last epoch)",
        )
        layer: int = Field(0, ge=0, description="DEQ layer of a multi-layer model")
        solver: str | None = Field(None, description="recording solver (default: the cell's)")
        max_iter: int | None = Field(None, ge=1, description="recording budget (default: cell's)")
        tol: float | None = Field(None, gt=0, description="recording tolerance (default: cell's)")
        max_states: int = Field(32, ge=2, description="iterates kept per solve (then thinned)")
        pca: Literal["auto", "exact", "lowrank"] = "auto"
        exact_max_dim: int = Field(4096, ge=1, description="auto: exact PCA up to this dim")

    params: Params  # narrowed for type checkers

    def __init__(self, params: Any = None) -> None:
        super().__init__(params)
        self._recs: dict[int, Recording] = {}
        self._last_epoch: int | None = None
        self._probes: tuple[Tensor, Tensor] | None = None

    def _probe(self, ctx: CellContext) -> tuple[Tensor, Tensor]:
        if self._probes is None:
            X, y = ctx.data.test if self.params.split == "test" else ctx.data.train
            if ctx.task != "classification":
                raise ValueError(
                    "trajectory: needs a classification task (classes colour the plots)"
                )
            seed = ctx.seed if self.params.probe_seed is None else self.params.probe_seed
            idx = balanced_probes(y.cpu(), self.params.n, seed).to(X.device)
            self._probes = (X[idx], y[idx])
        return self._probes

    def _solver_cfg(self, ctx: CellContext) -> SolverConfig | None:
        p = self.params
        if p.solver is None and p.max_iter is None and p.tol is None:
            return None
        layers = list(deq_layers(ctx.model))
        base = layers[min(p.layer, len(layers) - 1)].solver_cfg if layers else SolverConfig()
        same = p.solver is None or p.solver == base.name
        return SolverConfig(
            name=p.solver or base.name,
            max_iter=p.max_iter or base.max_iter,
            tol=p.tol or base.tol,
            stop_mode=base.stop_mode,
            options=dict(base.options) if same else {},
        )

    def _record(self, ctx: CellContext, epoch: int) -> None:
        x, _ = self._probe(ctx)
        self._recs[epoch] = record_solve(
            ctx.model,
            x,
            layer=self.params.layer,
            solver=self._solver_cfg(ctx),
            max_states=self.params.max_states,
        )

    def before_training(self, ctx: CellContext) -> Iterable[Row]:
        from ..inits.basic import cell_weights

        self._recs, self._last_epoch, self._probes = {}, None, None
        ws = [p.detach().double().reshape(-1) for p in cell_weights(ctx.model)]
        if ws:
            std = float(torch.cat(ws).std())
            yield Row("cell_weight_std", std, note="std of the cell's weight tensors at init")

    def on_epoch(self, ctx: CellContext, info: EpochInfo) -> Iterable[Row]:
        self._last_epoch = info.epoch
        if info.epoch in self.params.epochs:
            self._record(ctx, info.epoch)
        return ()

    def after_training(self, ctx: CellContext) -> Iterable[Row]:
        import pandas as pd

        last = self._last_epoch
        if -1 in self.params.epochs and (last is None or last not in self._recs):
            last = 0 if last is None else last
            self._record(ctx, last)
        if not self._recs:
            return
        epochs = sorted(self._recs)
        recs = [self._recs[e] for e in epochs]
        labels = self._probe(ctx)[1].cpu().numpy()
        n, D = recs[0].final.shape
        blocks = [r.states.reshape(-1, D) for r in recs] + [r.final for r in recs]
        method = self.params.pca
        if method == "auto":
            method = "exact" if D <= self.params.exact_max_dim else "lowrank"
        p = pca(blocks, 2, method, seed=ctx.seed)
        ratio = p.explained_ratio
        yield Row("explained_variance_ratio", ratio[0], variant="pc1", note=f"pca {method}")
        if len(ratio) > 1:
            yield Row("explained_variance_ratio", ratio[1], variant="pc2", note=f"pca {method}")
        flag = method == "lowrank" and not p.error <= LOWRANK_FLAG
        yield Row(
            "pca_error",
            p.error,
            note=(
                f"lowrank PCA eigen-residual {p.error:.2g} > {LOWRANK_FLAG:g}: use pca: exact "
                "(raise exact_max_dim)"
                if flag
                else ("exact eigendecomposition" if method == "exact" else "max rel eigen-residual")
            ),
            status="flagged" if flag else "ok",
        )
        yield Row("states", sum(b.shape[0] for b in blocks))
        yield Row("state_dim", D)
        traj, resid = [], []
        ex = np.arange(n)
        for e, r in zip(epochs, recs):
            its, hit = iterations_to_tol(r.residual, r.tol)
            yield Row("iterations_median", float(np.median(its)), step=e, unit="f-evals")
            yield Row("iterations_mean", float(its.mean()), step=e, unit="f-evals")
            yield Row("converged_frac", float(hit.mean()), step=e)
            yield Row("rel_residual_final_median", float(np.median(r.residual[-1])), step=e)
            yield Row("nstep", r.nstep, step=e, unit="f-evals", note=r.status)
            yield Row("tol", r.tol, step=e)
            fin = p.project(r.final)
            yield Row("silhouette", silhouette(fin, labels), variant="pca2", step=e)
            yield Row("silhouette", silhouette(r.final, labels), variant="full", step=e)
            for i, s in [*zip(r.iterations, r.states), (-1, r.final)]:
                c = p.project(s)
                traj.append(pd.DataFrame({"epoch": e, "example": ex, "label": labels,
                                          "iteration": i, "pc1": c[:, 0].astype(np.float32),
                                          "pc2": c[:, 1].astype(np.float32)}))  # fmt: skip
            T = r.residual.shape[0]
            resid.append(pd.DataFrame({"epoch": e, "example": np.tile(ex, T),
                                       "label": np.tile(labels, T),
                                       "iteration": np.repeat(np.arange(T), n),
                                       "rel_residual": r.residual.reshape(-1).astype(np.float32)}))  # fmt: skip
        ctx.write_series(SERIES, pd.concat(traj, ignore_index=True))
        ctx.write_series(RESIDUAL_SERIES, pd.concat(resid, ignore_index=True))
        self._recs = {}

    @classmethod
    def plot(cls, df: Any, run_dir: Any) -> dict[str, Any]:
        """The figures (``deqbench.plots``): :func:`trajectory_figures`."""
        return _trajectory_plots.trajectory_figures(df, run_dir)


from . import plots as _trajectory_plots  # noqa: E402  (the figures of Trajectory.plot)
