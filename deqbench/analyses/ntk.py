"""Analysis ``ntk``: the empirical NTK's lambda_min over training, beside the training loss.

A fixed, seeded, deduplicated probe set of ``n`` inputs is drawn once (from the train split by
default) and saved with the run (``series/ntk_probes__...csv``). The NTK on it
(:func:`deqbench.ntk.empirical_ntk`) is computed before training and every ``every`` epochs
(or steps, ``per: step``); each evaluation gives rows ``lambda_min``, ``lambda_max``,
``condition``, ``trace``, ``noise_floor``, ``resolved`` and ``train_loss`` (the loss on the
whole train split at the same parameters), and a line of ``series/ntk__...csv``.

Linear-convergence check (papers/004 sections 2.6 and 3): for full-batch gradient descent
(``optimizer: sgd``, ``momentum: 0``, no weight decay) on the mean squared loss over R = N*O
target entries, with the probes equal to the whole train split and the kernel of every output
(``output: full``, or a one-output model), the linearised dynamics are
``r_{k+1} = (I - 2 eta K / R) r_k``, so the loss falls at least as fast as the slope

    pred_log_loss_slope = 2 log max(|1 - 2 eta lambda_min / R|, |1 - 2 eta lambda_max / R|)

per step: ``2 log(1 - 2 eta lambda_min / R)`` while eta (lambda_min + lambda_max) <= R, and no
decay at all (a value >= 0, the note says so) once 2 eta lambda_max / R >= 2.

The series holds it next to the measured slope of log(loss) between evaluations
(``log_loss_slope``); :func:`plot_ntk` draws both. Outside that setting the predicted slope is
NaN and the note says why.

Example (suite YAML)::

    analyses:
      - ntk: {n: 64, every: 10, output: full}

Plain functions: :func:`select_probes`, :func:`predicted_log_loss_slope`, :func:`plot_ntk`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .. import plots
from ..registry import analyses
from .base import Analysis, CellContext, EpochInfo, Row, StepInfo

SERIES = "ntk"
PROBES = "ntk_probes"


def select_probes(X: Any, n: int, seed: int) -> Any:
    """Indices of ``n`` distinct rows of ``X`` in a seeded random order (exact duplicates are
    skipped: they make K singular). Returns a LongTensor of at most ``n`` indices."""
    import torch

    N = X.shape[0]
    g = torch.Generator().manual_seed(int(seed))
    perm = torch.randperm(N, generator=g)
    cand = perm[: min(N, max(4 * n, n + 64))]
    flat = X[cand.to(X.device)].reshape(len(cand), -1).cpu()
    _, inv = torch.unique(flat, dim=0, return_inverse=True)
    seen: set[int] = set()
    keep: list[int] = []
    for pos, k in enumerate(inv.tolist()):
        if k not in seen:
            seen.add(k)
            keep.append(pos)
        if len(keep) == n:
            break
    return cand[keep]


def predicted_log_loss_slope(
    lambda_min: float, lr: float, entries: int, lambda_max: float | None = None
) -> float:
    """Per-step slope of log(MSE loss) that the NTK spectrum guarantees for linearised full-batch
    GD: every eigen-direction of the residual shrinks by |1 - 2 lr lambda / entries| per step, so
    the bound is ``2 log max(|1 - q_min|, |1 - q_max|)`` with q = 2 lr lambda / entries. It is
    ``2 log(1 - q_min)`` only while lr (lambda_min + lambda_max) <= entries; a value >= 0 means
    no decay is guaranteed (the step is too large for the top eigenvalue). Without
    ``lambda_max`` the lambda_min form is returned (a bound only under that step-size
    condition). NaN if undefined.

    Example:
        >>> round(predicted_log_loss_slope(1.0, 0.1, 10), 6)             # 2 log(0.98)
        -0.040405
        >>> predicted_log_loss_slope(1.0, 0.1, 10, lambda_max=150.0) > 0   # step too large
        True
    """
    q = 2.0 * lr * lambda_min / entries
    if not (math.isfinite(q) and q >= 0):
        return math.nan
    worst = abs(1.0 - q)
    if lambda_max is not None:
        qmax = 2.0 * lr * lambda_max / entries
        if not math.isfinite(qmax):
            return math.nan
        worst = max(worst, abs(1.0 - qmax))
    if worst == 0.0:
        return -math.inf
    return 2.0 * math.log(worst)


@analyses.register("ntk")
class NTK(Analysis):
    """Empirical NTK spectrum (lambda_min, lambda_max, condition, trace, noise floor) on a fixed
    probe set, before and during training, beside the training loss."""

    name = "ntk"
    version = "1"

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        n: int = Field(64, ge=1, description="number of probes (capped at the split size)")
        split: Literal["train", "test"] = "train"
        probe_seed: int | None = Field(
            None, description="probe selection seed (default: cell seed)"
        )
        every: int = Field(1, ge=1, description="evaluate every k epochs (or steps)")
        per: Literal["epoch", "step"] = "epoch"
        output: int | Literal["sum", "scalar", "full"] = "sum"
        method: Literal["batched", "naive", "gram"] = "batched"
        tol: float | None = Field(
            None,
            gt=0,
            description="NTK forward/adjoint tolerance (default 1e-10 in float64, 1e-6 in float32)",
        )
        max_iter: int | None = Field(
            None, ge=1, description="NTK solve budget (default: max(1000, the model's))"
        )
        adjoint: Literal["auto", "solver", "direct"] = Field(
            "auto", description="adjoint solve: direct LU for small states (auto) or the solver"
        )
        chunk_size: int | None = Field(None, ge=1)
        noise_c: float = Field(1.0, gt=0, description="constant of the noise floor c*eps*N*lmax")

    def __init__(self, params: Any = None) -> None:
        super().__init__(params)
        self._X: Any = None
        self._step = 0
        self._done: set[int] = set()
        self._records: list[dict[str, Any]] = []
        self._note = ""

    # -- hooks ---------------------------------------------------------------------------------
    def before_training(self, ctx: CellContext) -> Iterable[Row]:
        import pandas as pd

        p = self.params
        X, y = ctx.data.train if p.split == "train" else ctx.data.test
        seed = ctx.seed if p.probe_seed is None else p.probe_seed
        idx = select_probes(X, p.n, seed)
        self._X = X[idx.to(X.device)]
        self._full_split = p.split == "train" and len(idx) == X.shape[0]
        yp = y[idx.to(y.device)].detach().cpu()
        xf = self._X.detach().reshape(len(idx), -1).cpu().double().numpy()
        df = pd.DataFrame(xf, columns=[f"x{j}" for j in range(xf.shape[1])])
        df.insert(0, "index", idx.tolist())
        df.insert(0, "probe", range(len(idx)))
        df.insert(2, "split", p.split)
        yv = yp.reshape(len(idx), -1).double().numpy()
        for j in range(yv.shape[1]):
            df.insert(3 + j, f"y{j}" if yv.shape[1] > 1 else "y", yv[:, j])
        ctx.write_series(PROBES, df)
        self._step = 0
        self._done = set()
        self._records = []
        return self._evaluate(ctx, 0, 0)

    def on_step(self, ctx: CellContext, info: StepInfo) -> Iterable[Row]:
        self._step = info.step
        if self.params.per == "step" and info.step % self.params.every == 0:
            return self._evaluate(ctx, info.step, info.epoch)
        return ()

    def on_epoch(self, ctx: CellContext, info: EpochInfo) -> Iterable[Row]:
        p = self.params
        if p.per == "epoch" and info.epoch > 0 and info.epoch % p.every == 0:
            return self._evaluate(ctx, self._step, info.epoch)
        return ()

    def after_training(self, ctx: CellContext) -> Iterable[Row]:
        recs = [r for r in self._records if math.isfinite(r["lambda_min"])]
        if recs:
            yield Row("lambda_min_min", min(r["lambda_min"] for r in recs), variant="summary")
        if self._records:
            last = self._records[-1]
            yield Row("lambda_min_final", last["lambda_min"], variant="summary")
            yield Row("lambda_min_init", self._records[0]["lambda_min"], variant="summary")
            fit = _fit_slope(self._records)
            yield Row(
                "log_loss_slope_fit",
                fit,
                variant="summary",
                note="least squares over all evaluations",
            )
            pred = [r["pred_log_loss_slope"] for r in self._records]
            pred = [v for v in pred if math.isfinite(v)]
            yield Row(
                "pred_log_loss_slope_mean",
                sum(pred) / len(pred) if pred else math.nan,
                variant="summary",
                note=self._note,
            )

    # -- one evaluation --------------------------------------------------------------------------
    def _evaluate(self, ctx: CellContext, step: int, epoch: int) -> list[Row]:
        from ..ntk import empirical_ntk, ntk_summary

        if step in self._done or self._X is None:
            return []
        self._done.add(step)
        p = self.params
        t0 = time.perf_counter()
        try:
            K, info = empirical_ntk(
                ctx.model,
                self._X,
                output=p.output,
                method=p.method,
                chunk_size=p.chunk_size,
                adjoint=p.adjoint,
                tol=p.tol,  # None: tight by default (ntk_budget), lambda_min error ~ tol * cond
                max_iter=p.max_iter,
                return_info=True,
            )
        except Exception as exc:  # noqa: BLE001 - reported as a row, training goes on
            from ..errors import DeqbenchError

            if isinstance(exc, DeqbenchError):
                raise
            if "out of memory" in str(exc).lower():
                return [Row("lambda_min", math.nan, step=step, status="oom", note=str(exc)[:200])]
            return [
                Row(
                    "lambda_min",
                    math.nan,
                    step=step,
                    status="error",
                    note=f"{type(exc).__name__}: {exc}"[:200],
                )
            ]
        s = ntk_summary(K, eps=info.get("eps"), c=p.noise_c)
        elapsed = time.perf_counter() - t0
        loss = float(ctx.evaluate("train")["loss"])
        rows_k = int(K.shape[0])
        pred, why = self._predicted(ctx, s["lambda_min"], s["lambda_max"], info)
        self._note = why
        rec: dict[str, Any] = {
            "step": step,
            "epoch": epoch,
            **{
                k: s[k]
                for k in (
                    "lambda_min",
                    "lambda_max",
                    "condition",
                    "trace",
                    "trace_per_n",
                    "noise_floor",
                )
            },
            "resolved": float(s["resolved"]),
            "n": rows_k,
            "train_loss": loss,
            "log_loss": math.log(loss) if loss > 0 else math.nan,
            "pred_log_loss_slope": pred,
            "log_loss_slope": math.nan,
            "time_s": elapsed,
            **{
                k: float(info[k])
                for k in (
                    "forward_nstep",
                    "forward_rel_residual",
                    "adjoint_nstep",
                    "adjoint_rel_residual",
                )
                if k in info
            },
        }
        conv = [info[k] for k in ("forward_converged", "adjoint_converged") if k in info]
        res = [info[k] for k in ("forward_rel_residual", "adjoint_rel_residual") if k in info]
        rec["converged"] = float(all(c == 1.0 for c in conv)) if conv else math.nan
        # the solves' error reaches lambda_min at about residual * lambda_max (REFERENCE 8.3)
        rec["solver_floor"] = max(res) * s["lambda_max"] if res else math.nan
        if self._records:
            prev = self._records[-1]
            ds = step - prev["step"]
            if ds > 0 and math.isfinite(rec["log_loss"]) and math.isfinite(prev["log_loss"]):
                rec["log_loss_slope"] = (rec["log_loss"] - prev["log_loss"]) / ds
        self._records.append(rec)
        self._write(ctx)
        notes = [] if s["resolved"] else [f"unresolved: below noise floor {s['noise_floor']:.3g}"]
        if rec["converged"] == 0.0:
            notes.append(f"NTK solves not converged (rel residual {max(res):.3g})")
        elif s["resolved"] and rec["solver_floor"] > s["lambda_min"]:
            notes.append(f"solver-limited: residual * lambda_max = {rec['solver_floor']:.3g}")
        if "fallback" in info:
            notes.append(f"batched engine failed, {info['fallback']}")
        note = "; ".join(notes)
        at = epoch if p.per == "epoch" else step  # rows use epochs like `metrics`; series both
        out = [Row("lambda_min", s["lambda_min"], step=at, note=note)]
        for k in ("lambda_max", "condition", "trace", "noise_floor", "resolved"):
            out.append(Row(k, rec[k], step=at))
        out.append(Row("train_loss", loss, step=at))
        out.append(Row("pred_log_loss_slope", pred, step=at, note=why))
        out.append(Row("time", elapsed, step=at, unit="s"))
        for k in ("forward_rel_residual", "adjoint_rel_residual"):
            if k in rec:
                out.append(Row(k, rec[k], step=at))
        return out

    def _predicted(
        self, ctx: CellContext, lmin: float, lmax: float, info: dict[str, Any]
    ) -> tuple[float, str]:
        """Predicted log-loss slope, or NaN and the reason it does not apply."""
        opt = ctx.optimizer
        if ctx.task != "regression":
            return math.nan, "needs a regression task (squared loss)"
        if opt is None or not opt.param_groups:
            return math.nan, "no optimizer yet"
        g = opt.param_groups[0]
        import torch

        if not isinstance(opt, torch.optim.SGD) or g.get("momentum", 0) or g.get("weight_decay", 0):
            return math.nan, "needs plain gradient descent (sgd, momentum 0, no weight decay)"
        if not self._full_split:
            return math.nan, "probes must be the whole train split"
        train_cfg = (ctx.cell or {}).get("train") if isinstance(ctx.cell, dict) else None
        if isinstance(train_cfg, dict) and train_cfg.get("full_batch") is False:
            return math.nan, "needs train.full_batch: true"
        n_out = int(info.get("outputs", 1))
        if n_out > 1 and self.params.output != "full":
            return math.nan, "needs output: full for a model with several outputs"
        entries = int(self._X.shape[0]) * n_out
        lr = float(g["lr"])
        pred = predicted_log_loss_slope(lmin, lr, entries, lambda_max=lmax)
        if math.isfinite(pred) and pred >= 0:
            return pred, (
                f"no decay guaranteed: 2 lr lambda_max / N = {2 * lr * lmax / entries:.3g} >= 2 "
                "(the step is too large for the top eigenvalue)"
            )
        if lr * (lmin + lmax) > entries:
            return pred, "lambda_max limits the guarantee: lr (lambda_min + lambda_max) > N"
        return pred, ""

    def _write(self, ctx: CellContext) -> None:
        import pandas as pd

        ctx.write_series(SERIES, pd.DataFrame(self._records))


def _fit_slope(records: list[dict[str, Any]]) -> float:
    pts = [(r["step"], r["log_loss"]) for r in records if math.isfinite(r["log_loss"])]
    if len(pts) < 2:
        return math.nan
    n = len(pts)
    mx = sum(p[0] for p in pts) / n
    my = sum(p[1] for p in pts) / n
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    if sxx == 0:
        return math.nan
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx


def plot_ntk(series: Any, title: str = "") -> Any:
    """Figure of ``ntk`` series: lambda_min (with its noise floor), the training loss and the
    per-step decay rate of the loss, ``-d log(loss)/d step``, measured between evaluations
    (markers; on a symlog axis, so that intervals where the loss rose show below 0) beside the
    rate the NTK spectrum guarantees for linearised full-batch GD,
    ``-2 log max|1 - 2 lr lambda / N|`` over lambda_min and lambda_max (dashed).

    Args:
        series: DataFrame with columns step, lambda_min, noise_floor, train_loss, log_loss_slope,
            pred_log_loss_slope (as in ``series/ntk__*.csv``); several cells/seeds may be passed
            with ``cell_id`` / ``seed`` columns (:func:`deqbench.plots.read_series`).
        title: figure title.

    Returns:
        matplotlib Figure (no pyplot).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 8.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax1, ax2, ax3 = fig.subplots(3, 1, sharex=True)
    keys = [k for k in ("cell_id", "seed") if k in series.columns]
    groups = list(series.groupby(keys)) if keys else [("", series)]
    rates: list[float] = []
    for i, (label, df) in enumerate(groups):
        df = df.sort_values("step")
        col = f"C{i % 10}"
        if isinstance(label, tuple):
            label = " ".join(f"seed {v}" if k == "seed" else str(v) for k, v in zip(keys, label))
        lab = str(label) if label != "" else None
        ax1.plot(df["step"], df["lambda_min"], "o-", color=col, ms=4, label=lab)
        if "noise_floor" in df and (df["noise_floor"] > 0).any():
            ax1.plot(df["step"], df["noise_floor"], ":", color=col, lw=1)
        ax2.plot(df["step"], df["train_loss"], "s-", color=col, ms=3, label=lab)
        for name, style in (("log_loss_slope", "o"), ("pred_log_loss_slope", "--")):
            if name in df and df[name].notna().any():
                ax3.plot(df["step"], -df[name], style, color=col, ms=4)
                rates += [abs(float(v)) for v in df[name] if v == v and v != 0]
    ax1.set_yscale("log")
    ax1.set_ylabel("lambda_min(K)\n(dotted: noise floor)")
    ax1.legend(fontsize=7, loc="best")
    ax2.set_yscale("log")
    ax2.set_ylabel("train loss")
    # symlog: a rise of the loss (negative rate) stays visible instead of dropping off a log axis
    ax3.set_yscale("symlog", linthresh=min(rates) if rates else 1e-6)
    ax3.axhline(0.0, color="0.5", lw=0.8)
    ax3.set_ylabel("loss decay rate per step\n-d log(loss)/d step (< 0: loss rose)")
    ax3.set_xlabel("step")
    from matplotlib.lines import Line2D

    ax3.legend(
        [Line2D([], [], color="0.3", marker="o", ls=""), Line2D([], [], color="0.3", ls="--")],
        [
            "measured between evaluations",
            "guaranteed by the NTK: -2 log max|1 - 2 lr lambda / N|, lambda_min and lambda_max",
        ],
        fontsize=7,
        loc="best",
    )
    for ax in (ax1, ax2, ax3):
        ax.grid(True, alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=9)
    return fig


@plots.register("ntk")
def ntk_plots(df: Any, run_dir: Any) -> dict[str, Any]:
    """``plots/ntk.png`` of a run: :func:`plot_ntk` over every cell and seed's ntk series."""
    series = plots.read_series(run_dir, SERIES)
    if series.empty:
        return {}
    return {"ntk": plot_ntk(series, title="NTK lambda_min and training loss")}
