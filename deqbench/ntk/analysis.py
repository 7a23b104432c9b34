"""Analysis ``ntk``: the empirical NTK's lambda_min over training, beside the training loss.

A fixed, seeded, deduplicated probe set of ``n`` inputs is drawn once (from the train split by
default) and saved with the run (``series/ntk_probes__...csv``). The NTK on it
(:func:`deqbench.ntk.empirical_ntk`) is computed before training and every ``every`` epochs
(or steps, ``per: step``); each evaluation gives rows ``lambda_min``, ``lambda_max``,
``condition``, ``trace``, ``noise_floor``, ``resolved`` and ``loss_at_eval`` (the loss on the
whole train split at the same parameters), and a line of ``series/ntk__...csv``.

Status: a K singular to working precision (duplicated probes, N > P, cond beyond 1/eps) is
data, not a failure: lambda_min is reported near 0 beside its noise floor, ``resolved`` 0, the
note says so (series column ``spectrum``: resolved | singular | non-finite). An evaluation
whose NTK solves missed their tolerance, whose K is non-finite or whose lambda_min lies below
the solves' own error (residual x lambda_max) is ``flagged``: its K rows carry status
"flagged" and a one-line cause and fix (series column ``flag``), so the run exits 1.

Linear-convergence check (Nguyen 2022 sections 2.6 and 3): for full-batch gradient descent
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
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..analyses.base import Analysis, CellContext, EpochInfo, Row, StepInfo
from ..core.registry import analyses
from ..run import plots

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

    judges_own_solves = True  # see Analysis.judges_own_solves
    name = "ntk"
    #: the cell deqbench.testing.check_analysis runs it on (over testing.DEFAULT_EXAMPLE)
    example: ClassVar[dict[str, Any]] = {"params": {"n": 16}}
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

    params: Params  # narrowed for type checkers

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

    @classmethod
    def headline(cls, rows: Any) -> list[str]:
        """lambda_min at the first and last evaluation, and whether the loss decayed as fast as
        the NTK bound guarantees."""
        s = rows[rows["variant"] == "summary"].set_index("metric")
        if "lambda_min_final" not in s.index:
            return []

        def val(metric: str) -> float:
            return float(s.loc[metric, "value"]) if metric in s.index else float("nan")

        line = (
            f"lambda_min {val('lambda_min_init'):.3g} (first) -> {val('lambda_min_final'):.3g} "
            f"(last)"
        )
        fit, pred = val("log_loss_slope_fit"), val("pred_log_loss_slope_mean")
        if fit == fit and pred == pred and pred >= 0:
            line += (
                f"; log-loss slope {fit:.3g} per step; the NTK guarantees no decay (its bound "
                f"averages {pred:+.3g} per step: 2 lr lambda_max / R >= 2 at some evaluations, the "
                "step is too large for the top eigenvalue)"
            )
        elif fit == fit and pred == pred:
            held = "matched" if fit <= pred else "did not match"
            line += (
                f"; log-loss slope {fit:.3g} per step vs guaranteed {pred:.3g}: the decay {held} "
                "the guarantee"
            )
        elif fit == fit:
            line += f"; log-loss slope {fit:.3g} per step (no decay guaranteed at this step size)"
        return [line]

    def after_training(self, ctx: CellContext) -> Iterable[Row]:
        def row(metric: str, value: float, recs: list[dict[str, Any]], note: str = "") -> Row:
            """A summary row: flagged (with the first cause) if a record it uses was flagged."""
            flags = [r["flag"] for r in recs if r.get("flag")]
            if flags:
                bad = "error" if not math.isfinite(value) else "flagged"
                return Row(metric, value, variant="summary", status=bad, note=flags[0])
            return Row(metric, value, variant="summary", note=note)

        # lambda_min is never NaN unless K was non-finite; flagged evaluations are left out
        recs = [r for r in self._records if math.isfinite(r["lambda_min"]) and not r.get("flag")]
        if recs:
            yield row("lambda_min_min", min(r["lambda_min"] for r in recs), [])
        if self._records:
            first, last = self._records[0], self._records[-1]
            yield row("lambda_min_final", last["lambda_min"], [last])
            yield row("lambda_min_init", first["lambda_min"], [first])
            fit = _fit_slope(self._records)
            yield row("log_loss_slope_fit", fit, [], note="least squares over all evaluations")
            pred = [r for r in self._records if math.isfinite(r["pred_log_loss_slope"])]
            yield row(
                "pred_log_loss_slope_mean",
                sum(r["pred_log_loss_slope"] for r in pred) / len(pred) if pred else math.nan,
                pred,
                note=self._note,
            )

    # -- one evaluation --------------------------------------------------------------------------
    def _evaluate(self, ctx: CellContext, step: int, epoch: int) -> list[Row]:
        from .empirical import empirical_ntk, ntk_summary

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
            from ..core.errors import DeqbenchError

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
        pred, why = self._predicted(
            ctx, s["lambda_min"], s["lambda_max"], info, resolved=s["resolved"]
        )
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
            "loss_at_eval": loss,
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
        # the solves' error reaches lambda_min at about residual * lambda_max
        rec["solver_floor"] = max(res) * s["lambda_max"] if res else math.nan
        rec["spectrum"] = s["status"]  # resolved | singular | non-finite
        if self._records:
            prev = self._records[-1]
            ds = step - prev["step"]
            if ds > 0 and math.isfinite(rec["log_loss"]) and math.isfinite(prev["log_loss"]):
                rec["log_loss_slope"] = (rec["log_loss"] - prev["log_loss"]) / ds
        flag = self._flag(info, s, rec)
        rec["flag"] = flag
        self._records.append(rec)
        self._write(ctx)
        notes = [flag] if flag else []
        if s["status"] == "singular":
            notes.append(s["note"])
        if "fallback" in info:
            notes.append(f"batched engine failed, {info['fallback']}")
        note = "; ".join(notes)
        at = epoch if p.per == "epoch" else step  # rows use epochs like `metrics`; series both

        def row(metric: str, value: float, note: str = "", **kw: Any) -> Row:
            """A row of K's measurement: flagged with the evaluation (error if no value)."""
            if not flag:
                return Row(metric, value, step=at, note=note, **kw)
            bad = "error" if not math.isfinite(value) else "flagged"
            return Row(metric, value, step=at, status=bad, note=note or flag, **kw)

        out = [row("lambda_min", s["lambda_min"], note)]
        for k in ("lambda_max", "condition", "trace", "noise_floor", "resolved"):
            out.append(row(k, rec[k]))
        out.append(Row("loss_at_eval", loss, step=at))
        if flag:
            out.append(row("pred_log_loss_slope", pred))
        else:
            out.append(Row("pred_log_loss_slope", pred, step=at, note=why))
        out.append(Row("time", elapsed, step=at, unit="s"))
        for k in ("forward_rel_residual", "adjoint_rel_residual"):
            if k in rec:
                out.append(row(k, rec[k]))
        return out

    def _flag(self, info: dict[str, Any], s: dict[str, Any], rec: dict[str, Any]) -> str:
        """One line (cause and fix) when this evaluation's own checks failed, else "". The text
        carries no per-evaluation numbers, so that repeated causes read as one line in the
        run's summary (the residuals are rows and series columns of their own)."""
        f32 = float(info.get("eps", 0.0)) > 1e-10
        prec = " or use --dtype float64" if f32 else ""
        if rec["converged"] == 0.0:
            which = [k for k in ("forward", "adjoint") if info.get(f"{k}_converged", 1.0) != 1.0]
            tol, budget = info.get("tol"), info.get("max_iter")
            tol_s = f"tol {tol:.3g}" if isinstance(tol, float) else "the model's tolerance"
            within = f" within {budget} iterations" if budget else ""
            return (
                f"NTK {' and '.join(which)} solve{'s' if len(which) > 1 else ''} missed "
                f"{tol_s}{within}: raise --ntk-max-iter "
                f"(ntk.max_iter) or loosen --tol (ntk.tol){prec}"
            )
        if s["status"] == "non-finite":
            return f"{s['note']}: check the NTK solves' residuals{prec}"
        if s["resolved"] and rec["solver_floor"] > s["lambda_min"]:
            return (
                "lambda_min is below the NTK solves' error (residual x lambda_max): lower "
                f"--tol (ntk.tol){prec}"
            )
        return ""

    def _predicted(
        self,
        ctx: CellContext,
        lmin: float,
        lmax: float,
        info: dict[str, Any],
        resolved: bool = True,
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
        if not resolved:
            return pred, "K singular to working precision: no decay guaranteed (lambda_min ~ 0)"
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

    @classmethod
    def plot(cls, df: Any, run_dir: Any) -> dict[str, Any]:
        """The figures (``deqbench.plots``): :func:`ntk_plots`."""
        return ntk_plots(df, run_dir)


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


def _numeric_col(df: Any, name: str) -> Any:
    """Column ``name`` of ``df`` as numbers (None where ``df`` has none)."""
    import pandas as pd

    return pd.to_numeric(df[name], errors="coerce") if name in df else None


def _singular_mask(df: Any) -> Any:
    """Evaluations whose K is singular to working precision (lambda_min <= noise floor)."""
    res = _numeric_col(df, "resolved")
    if res is not None:
        return res == 0
    lm, fl = _numeric_col(df, "lambda_min"), _numeric_col(df, "noise_floor")
    return (lm <= fl) if fl is not None else lm != lm


def _flagged_mask(df: Any) -> Any:
    """Evaluations whose own checks failed (``flag`` column non-empty)."""
    if "flag" not in df:
        return (df["step"] != df["step"]).to_numpy()
    flag = df["flag"]
    return (flag.notna() & (flag.astype(str) != "")).to_numpy()


def _legend_entries(
    handles: list[Any],
    labels: list[str],
    any_singular: bool,
    any_flagged: bool,
    floor_on: bool,
    measured: bool,
    bound: bool,
) -> None:
    """Append to ``handles``/``labels`` the legend of :func:`plot_ntk`'s markers and lines,
    only those drawn."""
    from matplotlib.lines import Line2D

    gray = "0.3"
    handles.append(Line2D([], [], color=gray, marker="o", ms=4))
    labels.append("lambda_min(K) (top)")
    if any_singular:
        handles.append(Line2D([], [], color=gray, marker="v", ms=6, mfc="none", ls=""))
        labels.append("K singular to working precision: lambda_min <= noise floor")
    if any_flagged:
        handles.append(Line2D([], [], color="red", marker="x", ms=7, ls=""))
        labels.append("flagged: NTK solves missed their tolerance (not part of the line)")
    if floor_on:
        handles.append(Line2D([], [], color=gray, ls=":", lw=1))
        labels.append("noise floor of lambda_min")
    if measured:
        handles.append(Line2D([], [], color=gray, marker="o", ls=""))
        labels.append("loss decay rate measured between evaluations (bottom)")
    if bound:
        handles.append(Line2D([], [], color=gray, ls="--"))
        labels.append(
            "rate guaranteed by the NTK: -2 log max|1 - 2 lr lambda / N| over lambda_min and "
            "lambda_max (bottom)"
        )


def plot_ntk(series: Any, title: str = "") -> Any:
    """Figure of ``ntk`` series: lambda_min (with its noise floor), the training loss and the
    per-step decay rate of the loss, ``-d log(loss)/d step``, measured between evaluations
    (markers; on a symlog axis, so that intervals where the loss rose show below 0) beside the
    rate the NTK spectrum guarantees for linearised full-batch GD,
    ``-2 log max|1 - 2 lr lambda / N|`` over lambda_min and lambda_max (dashed; a lower bound on
    the measured rate, below 0 where no decay is guaranteed).

    An evaluation whose K is singular to working precision is drawn as an open down-triangle
    at its noise floor (lambda_min <= floor); the floor itself (dotted) is drawn only when it
    is within three decades of lambda_min, else the axis label gives its largest value. The
    legend (below the panels) lists only what is drawn.

    Args:
        series: DataFrame with columns step, lambda_min, noise_floor, loss_at_eval, log_loss_slope,
            pred_log_loss_slope and optionally resolved (as in ``series/ntk__*.csv``); several
            cells/seeds may be passed with ``cell_id`` / ``seed`` columns
            (:func:`deqbench.run.plots.read_series`).
        title: figure title.

    Returns:
        matplotlib Figure (no pyplot).
    """
    import math

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    fig = Figure(figsize=(7.5, 9.0), layout="constrained")
    FigureCanvasAgg(fig)
    ax1, ax2, ax3 = fig.subplots(3, 1, sharex=True)
    keys = [k for k in ("cell_id", "seed") if k in series.columns]
    groups = list(series.groupby(keys)) if keys else [("", series)]

    # the resolved lambda_min values and the noise floors: whether the floor is on-scale
    lam_vals = [
        float(v)
        for _, df in groups
        for v in _numeric_col(df, "lambda_min")[~_singular_mask(df)]
        if v == v and v > 0
    ]
    floors = [
        float(v)
        for _, df in groups
        if "noise_floor" in df
        for v in _numeric_col(df, "noise_floor")
        if v == v and v > 0
    ]

    any_singular = any(bool(_singular_mask(df).any()) for _, df in groups)
    any_flagged = False
    floor_on = bool(floors) and (any_singular or not lam_vals or max(floors) * 1e3 >= min(lam_vals))
    handles: list[Any] = []
    labels: list[str] = []
    rates: list[float] = []
    measured = bound = False
    for i, (label, df) in enumerate(groups):
        df = df.sort_values("step")
        col = f"C{i % 10}"
        if isinstance(label, tuple):
            label = " ".join(f"seed {v}" if k == "seed" else str(v) for k, v in zip(keys, label))
        steps, lam = df["step"], _numeric_col(df, "lambda_min")
        sing = _singular_mask(df).to_numpy()
        bad = _flagged_mask(df)
        any_flagged |= bool(bad.any())
        ax1.plot(steps[~sing & ~bad], lam[~sing & ~bad], "o-", color=col, ms=4)
        if bad.any():
            ax1.plot(steps[bad], lam[bad], "x", color="red", ms=7)
        sing = sing & ~bad
        if sing.any():
            ax1.plot(
                steps[sing], _numeric_col(df, "noise_floor")[sing], "v", color=col, ms=6, mfc="none"
            )
        if floor_on and "noise_floor" in df:
            ax1.plot(steps, _numeric_col(df, "noise_floor"), ":", color=col, lw=1)
        ax2.plot(steps, df["loss_at_eval"], "s-", color=col, ms=3)
        if label != "":
            handles.append(Line2D([], [], color=col, marker="o", ms=4))
            labels.append(str(label))
        for name, style in (("log_loss_slope", "o"), ("pred_log_loss_slope", "--")):
            v = _numeric_col(df, name)
            if v is None:
                continue
            ok = v.notna() & (v.abs() != math.inf)
            if ok.any():
                ax3.plot(steps[ok], -v[ok], style, color=col, ms=4)
                rates += [abs(float(x)) for x in v[ok] if x != 0]
                measured |= name == "log_loss_slope"
                bound |= name == "pred_log_loss_slope"
    _legend_entries(handles, labels, any_singular, any_flagged, floor_on, measured, bound)
    ax1.set_yscale("log")
    ylab = "lambda_min(K)"
    if floors and not floor_on:
        ylab += f"\n(noise floor <= {max(floors):.1e}, off-scale)"
    ax1.set_ylabel(ylab)
    ax2.set_yscale("log")
    ax2.set_ylabel("loss on the train split\nat the evaluated parameters")
    if rates:
        _symlog_decades(ax3, rates, FixedLocator, FuncFormatter, NullLocator)
    ax3.axhline(0.0, color="0.5", lw=0.8)
    ax3.set_ylabel("loss decay rate per step\n-d log(loss)/d step (< 0: loss rose)")
    ax3.set_xlabel("step")
    fig.legend(handles, labels, loc="outside lower center", fontsize=7, ncols=1, frameon=False)
    for ax in (ax1, ax2, ax3):
        ax.grid(True, alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=9)
    return fig


def _symlog_decades(ax: Any, rates: list[float], fixed: Any, func: Any, null: Any) -> None:
    """Symlog y axis over the rates with a tick at every decade (every other one past six),
    at least three decades above the linear range, and no crowded ticks next to 0."""
    import math

    top = math.ceil(math.log10(max(rates)))
    low = math.floor(math.log10(min(rates)))
    low = min(low, top - 3)
    lt = 10.0**low
    ax.set_yscale("symlog", linthresh=lt, linscale=0.5)
    step = 1 if top - low <= 6 else 2
    pos = [10.0**k for k in range(top, low, -step)]
    ticks = sorted([-t for t in pos] + [0.0] + pos)

    def fmt(v: float, _: Any) -> str:
        if v == 0:
            return "0"
        k = round(math.log10(abs(v)))
        return ("-" if v < 0 else "") + f"$10^{{{k}}}$"

    ax.yaxis.set_major_locator(fixed(ticks))
    ax.yaxis.set_major_formatter(func(fmt))
    ax.yaxis.set_minor_locator(null())


def ntk_plots(df: Any, run_dir: Any) -> dict[str, Any]:
    """``plots/ntk.png`` of a run: :func:`plot_ntk` over every cell and seed's ntk series."""
    series = plots.read_series(run_dir, SERIES)
    if series.empty:
        return {}
    return {"ntk": plot_ntk(series, title="NTK lambda_min and training loss")}
