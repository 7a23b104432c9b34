"""Unrolled-K vs implicit (IFT) training of a DEQ: Xie et al. 2023 Table 8.

After training, for the cell's backward mode, measures on the test set:

* ``test_accuracy`` with the inference that matches training: K cell steps from z0 for an
  ``unrolled`` cell (the solver's own K-step iteration when it defines ``unroll``, e.g. SAM),
  the forward solver at its tolerance otherwise;
* ``rel_residual_opteq``: OptEq's relative residual ||z - T(z)|| / ||z||, whole-batch norms,
  averaged over test batches (Xie et al. 2023 section 7.4), and the canonical per-sample residual
  ``rel_residual_mean`` / ``rel_residual_max`` (||T(z) - z|| / ||T(z)||);
* ``inference_ms`` (no-grad forward of one batch), ``train_forward_ms`` and ``backprop_ms``
  (forward with grad and ``loss.backward()``): per repeat the median over the timed batches,
  every repeat stored, then ``*_median``, ``*_iqr`` and ``*_spread`` over the repeats (a spread
  above 10% is noted); ``inference_samples_per_s``; ``threads``;
* ``activation_memory``: bytes of the distinct tensors autograd saves during one training
  forward (device-independent; grows with K for unrolled training, O(1) for IFT), and
  ``peak_memory`` of one training step (forward and parameter gradients) in its own pass: on
  CUDA max_memory_allocated above the baseline, on CPU the peak RSS of a fresh worker process
  (``memory_cpu``);
* configuration rows ``gamma``, ``alpha``, ``unroll_k``, ``threshold`` and the model's
  ``weight_norm_max`` / ``contraction_bound`` when it has them (OptEq).

``tie_ift_tol`` (default on) sets an IFT cell's forward solver tolerance to its backward
tolerance before training, so one matrix axis ``backward: [{name: ift, tol: 1e-2}, ...]`` gives
the paper's single residual threshold "thd" for both passes.

:func:`unroll_table` gives one row per cell (metrics as columns), :func:`plot_unroll_compare`
draws residual and memory against K. The verdicts of Xie et al.'s claims on these rows are in the
run's ``summary.csv`` (:mod:`deqbench.outcomes`).

Example (plain functions)::

    from deqbench.performance.unroll_compare import infer, opteq_residual, saved_tensor_bytes
    z = infer(model, x, k=10)                       # K steps; k=None: the forward solver
    r = opteq_residual(model, x, z)                 # {"opteq": ..., "rel_mean": ..., ...}
    nbytes = saved_tensor_bytes(lambda: model(x).sum())
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Any, ClassVar

import torch
from pydantic import Field
from torch import Tensor

from ..analyses.base import Analysis, CellContext, Row
from ..core.deq import DEQLayer, deq_layers
from ..core.registry import analyses
from ._perf import GradStep
from .measure import Timing, is_cuda, sync
from .memory import (
    peak_memory,
    saved_tensor_bytes,  # noqa: F401  (re-exported: public name of this module)
)

# -- plain functions ------------------------------------------------------------------------


def _layer(model: Any) -> DEQLayer:
    layers = list(deq_layers(model))
    if len(layers) != 1:
        raise ValueError(
            f"unroll_compare needs a model with exactly one DEQ layer, found {len(layers)}"
        )
    return layers[0]


def unrolled_k(model: Any) -> int | None:
    """K of an ``unrolled`` backward, None for other modes."""
    cfg = _layer(model).backward_cfg
    return max(1, int(cfg.k)) if cfg.name == "unrolled" else None


def _start(model: Any, x: Tensor) -> tuple[DEQLayer, Tensor, Tensor]:
    """(layer, u, z0) for input ``x``, after refreshing the cell (if it has ``refresh``)."""
    layer = _layer(model)
    refresh = getattr(layer.cell, "refresh", None)
    if callable(refresh):
        refresh()
    u = model.inject(x)
    return layer, u, model.z0(u)


@torch.no_grad()
def equilibrium(model: Any, x: Tensor, k: int | None = None) -> tuple[Tensor, Tensor]:
    """(z, u): K cell steps from z0 (``k``) or the forward solver (``k=None``), no grad."""
    from .. import solvers

    layer, u, z0 = _start(model, x)
    if k is None:
        z, _ = layer.solve(u, z0)
        return z, u
    unroll = getattr(solvers.get(layer.solver_cfg.name), "unroll", None)
    if unroll is not None:
        z, _, _ = unroll(lambda z_: layer.cell(z_, u), z0, k, **layer.solver_cfg.options)
        return z, u
    z = z0
    for _ in range(k):
        z = layer.cell(z, u)
    return z, u


def infer(model: Any, x: Tensor, k: int | None = None) -> Tensor:
    """Equilibrium state for input ``x`` (see :func:`equilibrium`)."""
    return equilibrium(model, x, k)[0]


@torch.no_grad()
def opteq_residual(model: Any, z: Tensor, u: Tensor) -> dict[str, float]:
    """Residuals of state ``z`` under the cell map T(., u): ``opteq`` = ||z - T(z)||_F /
    ||z||_F over the batch (Xie et al. 2023), ``rel_mean``/``rel_max`` per sample canonical."""
    tz = _layer(model).cell(z, u)
    d = (tz - z).reshape(z.shape[0], -1)
    opteq = float(torch.linalg.vector_norm(d) / (torch.linalg.vector_norm(z) + 1e-12))
    per = torch.linalg.vector_norm(d, dim=1) / (
        torch.linalg.vector_norm(tz.reshape(z.shape[0], -1), dim=1) + 1e-9
    )
    return {"opteq": opteq, "rel_mean": float(per.mean()), "rel_max": float(per.max())}


@torch.no_grad()
def sam_selection(model: Any, x: Tensor, prior: str = "l2", iters: int = 400) -> list[Row]:
    """R(z) of the equilibrium that SAM (Xie et al. 2023 Eq. 11, ``prior``) selects vs plain
    iteration from z0 (``iters`` steps each; SAM's iterate is then finished with plain steps to
    the plain solution's residual): rows ``sam_prior_value`` / ``plain_prior_value`` (mean per
    sample), ``sam_rel_residual`` / ``plain_rel_residual`` (batch max) and ``sam_gap``, the mean
    distance between the two equilibria relative to ||z||. A gap at the residual level means
    Fix(T) is (locally) a single point, where no selection happens."""
    from .. import solvers
    from ..solvers.regularizers import get_regularizer

    layer, u, z0 = _start(model, x)

    def T(z: Tensor) -> Tensor:
        return layer.cell(z, u)

    zp, sp = solvers.get("fixed_point")(T, z0, max_iter=iters, tol=0)
    zs, _ = solvers.get("sam")(T, z0, max_iter=iters, tol=0, prior=prior)
    # SAM's iterate is O(beta_k) off Fix(T); finish with plain steps to the residual of the
    # plain solution, so the gap measures selection and not SAM's bias.
    zs, ss = solvers.get("fixed_point")(
        T, zs, max_iter=iters, tol=max(2.0 * sp.rel_max, 1e-6), returns="last"
    )
    reg = get_regularizer(prior)
    assert reg is not None
    b = x.shape[0]
    gap = torch.linalg.vector_norm((zs - zp).reshape(b, -1), dim=1) / (
        torch.linalg.vector_norm(zp.reshape(b, -1), dim=1) + 1e-12
    )
    return [
        Row("sam_prior_value", float(reg.value(zs)) / b, note=prior),
        Row("plain_prior_value", float(reg.value(zp)) / b, note=prior),
        Row("sam_rel_residual", ss.rel_max),
        Row("plain_rel_residual", sp.rel_max),
        Row("sam_gap", float(gap.mean())),
    ]


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


# -- the analysis ---------------------------------------------------------------------------


@analyses.register("unroll_compare")
class UnrollCompare(Analysis):
    """Unrolled-K vs IFT: accuracy, inference/backprop time, residual, memory (Xie et al. 2023 Table 8)."""

    name = "unroll_compare"
    #: the cell deqbench.testing.check_analysis runs it on (over testing.DEFAULT_EXAMPLE)
    example: ClassVar[dict[str, Any]] = {
        "params": {"timing_batches": 2, "repeats": 1, "warmup": 0, "memory_cpu": False}
    }
    version = "1"

    class Params(Analysis.Params):
        timing_batches: int = Field(10, ge=1, description="test batches timed per repeat")
        batch_size: int | None = Field(None, ge=1, description="default: the train batch size")
        repeats: int = Field(3, ge=1)
        warmup: int = Field(1, ge=0)
        tie_ift_tol: bool = True
        memory: bool = True
        memory_cpu: bool = Field(
            True, description="on CPU, peak RSS of a training step in a fresh worker process"
        )
        sam_prior: str | None = Field(
            None, description="also compare SAM with this prior (l2, l1) to plain iteration"
        )
        sam_iters: int = Field(400, ge=2)

    params: Params  # narrowed for type checkers

    def before_training(self, ctx: CellContext) -> Iterable[Row]:
        layer = _layer(ctx.model)
        bw = layer.backward_cfg
        if self.params.tie_ift_tol and bw.name == "ift":
            layer.configure(solver=replace(layer.solver_cfg, tol=float(bw.tol)))
        return ()

    def _batch_size(self, ctx: CellContext) -> int:
        if self.params.batch_size:
            return int(self.params.batch_size)
        return int((ctx.cell.get("train") or {}).get("batch_size", 64))

    def after_training(self, ctx: CellContext) -> Iterable[Row]:
        model = ctx.model
        layer = _layer(model)
        k = unrolled_k(model)
        thd = None if k is not None else float(layer.solver_cfg.tol)
        variant = f"unrolled_K={k}" if k is not None else f"{layer.backward_cfg.name}_thd={thd:g}"
        X, y = ctx.data.test
        bs = self._batch_size(ctx)
        was = model.training
        model.eval()

        def row(metric: str, value: float, unit: str = "", **kw: Any) -> Row:
            return Row(metric, value, variant=variant, unit=unit, **kw)

        # configuration
        yield row("unroll_k", k if k is not None else math.nan, note="" if k else "not unrolled")
        yield row("threshold", thd if thd is not None else math.nan,
                  note="" if thd is not None else "unrolled: no tolerance")  # fmt: skip
        for attr in ("gamma", "alpha"):
            if hasattr(model, attr):
                yield row(attr, float(getattr(model, attr)))
        if hasattr(model, "weight_norms"):
            yield row("weight_norm_max", max(model.weight_norms()))
        if hasattr(model, "contraction_bound"):
            yield row("contraction_bound", model.contraction_bound())

        yield from self._test_set_rows(ctx, k, bs, row)

        # timing: per repeat the median over the timed batches; every repeat is stored, then
        # median, IQR and spread over the repeats (Timing.rows; a spread > 10% is noted)
        nb = min(self.params.timing_batches, max(1, X.shape[0] // bs))
        batches = [(X[i * bs : (i + 1) * bs], y[i * bs : (i + 1) * bs]) for i in range(nb)]
        threads = torch.get_num_threads()
        method = "perf_counter, cuda synchronize" if is_cuda(ctx.device) else "perf_counter"
        yield from self._inference_rows(ctx, batches, k, bs, row, variant, method, threads)

        buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
        model.train()
        loss_fn = ctx.loss_fn or torch.nn.functional.cross_entropy
        yield from self._training_step_rows(ctx, batches, loss_fn, row, variant, method, threads)

        if self.params.sam_prior:
            yield from (
                Row(r.metric, r.value, variant=variant, unit=r.unit)
                for r in sam_selection(
                    model, batches[0][0], self.params.sam_prior, self.params.sam_iters
                )
            )

        if self.params.memory:
            yield from self._memory_rows(ctx, batches, loss_fn, row)
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
        model.train(was)

    def _test_set_rows(
        self, ctx: CellContext, k: int | None, bs: int, row: Callable[..., Row]
    ) -> Iterator[Row]:
        """Accuracy (classification), the residuals and the forward iterations over the whole
        test set."""
        model, layer = ctx.model, _layer(ctx.model)
        X, y = ctx.data.test
        nsteps: list[float]
        correct, n, res_opteq, rel_means, rel_max, nsteps = 0.0, 0, [], [], 0.0, []
        with torch.no_grad():
            for i in range(0, X.shape[0], bs):
                xb, yb = X[i : i + bs], y[i : i + bs]
                z, u = equilibrium(model, xb, k)
                if k is None and layer.last_forward_stats is not None:
                    nsteps.append(layer.last_forward_stats.nstep)
                out = model.readout(z)
                if ctx.task == "classification":
                    correct += float((out.argmax(1) == yb).sum())
                n += xb.shape[0]
                resid = opteq_residual(model, z, u)
                res_opteq.append(resid["opteq"])
                rel_means.append(resid["rel_mean"] * xb.shape[0])
                rel_max = max(rel_max, resid["rel_max"])
        if ctx.task == "classification":
            yield row("test_accuracy", correct / max(n, 1))
        yield row("rel_residual_opteq", sum(res_opteq) / max(len(res_opteq), 1))
        yield row("rel_residual_mean", sum(rel_means) / max(n, 1))
        yield row("rel_residual_max", rel_max)
        yield row(
            "forward_nstep", _median(nsteps) if nsteps else (k if k is not None else math.nan)
        )

    def _inference_rows(
        self,
        ctx: CellContext,
        batches: list[tuple[Tensor, Tensor]],
        k: int | None,
        bs: int,
        row: Callable[..., Row],
        variant: str,
        method: str,
        threads: int,
    ) -> Iterator[Row]:
        """Inference time per batch and samples per second, per repeat (warm-up repeats
        dropped)."""
        model, dev = ctx.model, ctx.device
        inf: list[float] = []
        for r in range(self.params.warmup + self.params.repeats):
            times = []
            for xb, _ in batches:
                sync(dev)
                t0 = time.perf_counter()
                with torch.no_grad():
                    model.readout(infer(model, xb, k))
                sync(dev)
                times.append(time.perf_counter() - t0)
            if r >= self.params.warmup:
                inf.append(_median(times))
        t_inf = Timing(inf, method=method, threads=threads, warmup=self.params.warmup)
        yield from t_inf.rows("inference_ms", variant=variant)
        for rep, med in enumerate(inf):
            yield row(
                "inference_samples_per_s", bs / med if med > 0 else math.nan, "1/s", repeat=rep
            )

    def _training_step_rows(
        self,
        ctx: CellContext,
        batches: list[tuple[Tensor, Tensor]],
        loss_fn: Callable[..., Tensor],
        row: Callable[..., Row],
        variant: str,
        method: str,
        threads: int,
    ) -> Iterator[Row]:
        """Forward and backprop time of a training step per repeat, and the backward solve's
        iterations."""
        model, layer, dev = ctx.model, _layer(ctx.model), ctx.device
        bnsteps: list[float] = []
        fwd_reps: list[float] = []
        bwd_reps: list[float] = []
        for r in range(self.params.warmup + self.params.repeats):
            fwd, bwd = [], []
            for xb, yb in batches:
                model.zero_grad(set_to_none=True)
                sync(dev)
                t0 = time.perf_counter()
                loss = loss_fn(model(xb), yb)
                sync(dev)
                t1 = time.perf_counter()
                loss.backward()
                sync(dev)
                t2 = time.perf_counter()
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
                if layer.last_backward_stats is not None:
                    bnsteps.append(layer.last_backward_stats.nstep)
            if r >= self.params.warmup:
                fwd_reps.append(_median(fwd))
                bwd_reps.append(_median(bwd))
        for metric, reps in (("train_forward_ms", fwd_reps), ("backprop_ms", bwd_reps)):
            t = Timing(reps, method=method, threads=threads, warmup=self.params.warmup)
            yield from t.rows(metric, variant=variant)
        yield row("threads", threads, "threads", note=method)
        if bnsteps:
            yield row("backward_nstep", _median(bnsteps))

    def _memory_rows(
        self,
        ctx: CellContext,
        batches: list[tuple[Tensor, Tensor]],
        loss_fn: Callable[..., Tensor],
        row: Callable[..., Row],
    ) -> Iterator[Row]:
        """Activation memory (saved tensors) and the peak memory of one training step."""
        model, dev = ctx.model, ctx.device
        xb, yb = batches[0]
        model.zero_grad(set_to_none=True)
        nbytes, loss = saved_tensor_bytes(lambda: loss_fn(model(xb), yb))
        loss.backward()
        yield row("activation_memory", nbytes, "bytes")
        # peak memory of one training step (forward + parameter gradients) in its own pass:
        # CUDA max_memory_allocated above the baseline, CPU peak RSS of a fresh worker
        model.zero_grad(set_to_none=True)
        mem = peak_memory(GradStep(model, xb, yb, ctx.task), dev, cpu=self.params.memory_cpu)
        yield row(
            "peak_memory",
            mem.peak_bytes,
            "bytes",
            status="ok" if math.isfinite(mem.peak_bytes) else "skipped",
            note="; ".join(x for x in (mem.method, mem.note) if x),
        )

    @classmethod
    def plot(cls, df: Any, run_dir: Any) -> dict[str, Any]:
        """The figures (``deqbench.plots``): :func:`_plots`."""
        return _plots(df, run_dir)


# -- the run's table -----------------------------------------------------------------------


def unroll_table(df: Any) -> Any:
    """One row per (cell, seed) of an ``unroll_compare`` run, metrics as columns (medians over
    repeats), then averaged over seeds: columns cell_id, method, gamma, unroll_k, threshold,
    test_accuracy, rel_residual_opteq, inference_ms, backprop_ms, activation_memory, ..."""
    import pandas as pd

    d = df[(df["analysis"] == "unroll_compare")]
    if "status" in d.columns:
        d = d[d["status"].fillna("ok") == "ok"]
    if d.empty:
        return pd.DataFrame()
    per_seed = d.pivot_table(
        index=["cell_id", "variant", "seed"], columns="metric", values="value", aggfunc="median"
    ).reset_index()
    num = [c for c in per_seed.columns if c not in ("cell_id", "variant", "seed")]
    tab = per_seed.groupby(["cell_id", "variant"], dropna=False)[num].mean().reset_index()
    tab = tab.rename(columns={"variant": "method"})
    sort = [c for c in ("gamma", "unroll_k", "threshold") if c in tab.columns]
    return tab.sort_values(sort, na_position="last").reset_index(drop=True)


def _plots(df: Any, run_dir: Any) -> dict[str, Any]:
    if not (df["analysis"] == "unroll_compare").any():
        return {}
    return {"unroll_compare": plot_unroll_compare(df)}


def plot_unroll_compare(df: Any) -> Any:
    """Figure: OptEq residual (log) and activation memory against K per gamma, IFT thresholds as
    dashed lines (Xie et al. 2023 Table 8 as curves)."""
    from matplotlib.figure import Figure

    tab = unroll_table(df)
    fig = Figure(figsize=(10, 4))
    ax1, ax2 = fig.subplots(1, 2)
    if tab.empty or "gamma" not in tab.columns:
        return fig
    for gamma, g in tab.groupby("gamma"):
        unr = g[g["unroll_k"].notna()].sort_values("unroll_k")
        line = ax1.semilogy(
            unr["unroll_k"], unr["rel_residual_opteq"], "o-", label=f"gamma={gamma:g}"
        )
        color = line[0].get_color()
        for _, r in g[g["unroll_k"].isna()].iterrows():
            ax1.axhline(r["rel_residual_opteq"], color=color, ls="--", lw=0.8)
        if "activation_memory" in unr:
            ax2.plot(
                unr["unroll_k"],
                unr["activation_memory"] / 2**20,
                "o-",
                color=color,
                label=f"unrolled gamma={gamma:g}",
            )
            for _, r in g[g["unroll_k"].isna()].iterrows():
                ax2.axhline(r["activation_memory"] / 2**20, color=color, ls="--", lw=0.8)
    ax1.set_xlabel("K (unrolled steps)")
    ax1.set_ylabel("relative residual ||z - T(z)|| / ||z||")
    ax1.set_title("residual vs K (dashed: IFT)")
    ax1.legend()
    ax2.set_xlabel("K")
    ax2.set_ylabel("saved activations (MiB)")
    ax2.set_title("training memory (dashed: IFT)")
    ax2.legend()
    fig.tight_layout()
    return fig
