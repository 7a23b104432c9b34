"""kGLM analyses (Tsuchida et al. 2022).

* ``klr_agreement`` (no training): on binarised, corrupted digits (dataset ``digits_klr``),
  every image is its own kernel logistic regression problem over its pixel coordinates. KLR is
  solved by Newton/IRLS (:func:`deqbench.klr.fit_klr`, independent of the DEQ code) and compared
  with the model's p = sigmoid(output) per pixel, in each of ``dtypes``. Rows (variant = dtype):
  ``disagreeing_images``, ``disagreeing_pixels`` (binarised at 0.5), ``disagreeing_pixels_at_ties``
  (|p_KLR - 1/2| < 1e-6), ``max_abs_dp``, ``mean_abs_dp``, ``deq_nstep``, ``deq_rel_residual``,
  ``images``, ``pixels``; variant ``klr``: ``newton_steps``, ``last_step_norm``, ``lambda``.
  Series ``klr_agreement``: per image and dtype, disagreeing pixels and max |dp|.
* ``kglm_init_cost`` (no training): wall time of the kGLM init vs the random init of a fully
  connected layer pair (W, V: n x n) and of a C -> C 5x5 conv pair on 32 x 32 inputs
  (Tsuchida et al. 2022 figure 8). Rows ``init_time`` (variant ``fc/kglm``, ``fc/random``, ``conv/kglm``,
  ``conv/random``; step = width or channels; one row per repeat) and ``init_time_median``.

Plots (registered with :mod:`deqbench.run.plots`): ``kglm_smooth`` (figure 5: log test MSE per
epoch, min/mean/max over seeds, per init; forward/backward iterations), ``kglm_denoise``
(figure 6: test MSE vs the average spectral norm of the convolutions, per epoch, kGLM vs random,
failed runs on the top border), ``kglm_init_cost`` (figure 8). The same hook writes
``kglm_denoise_table.csv`` (table 1 analogue) into the run directory; the verdicts of Tsuchida et al.'s
claims are in ``summary.csv`` (:mod:`deqbench.outcomes`).

Example (plain functions):
    >>> import deqbench, torch
    >>> from deqbench.data.base import load_data
    >>> from deqbench.kglm.analysis import klr_agreement
    >>> d = load_data("digits_klr")
    >>> m = deqbench.models.create("kglm_deq", in_shape=d.in_shape, family="bernoulli").double()
    >>> deqbench.inits.get("kglm_informed")(m, seed=0, kernel=["se", {"name": "white"}], scale=0.5)
    >>> summary, per_image = klr_agreement(m, d.test[0][:50])   # doctest: +SKIP
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn

from ..analyses.base import Analysis, CellContext, Row
from ..core.deq import deq_layers
from ..core.registry import analyses

DEFAULT_KLR_KERNEL: list[Any] = [
    {"name": "se", "lengthscale": 1.0},
    {"name": "white", "variance": 1e-8},
]
TIE = 1e-6

# -- KLR agreement ---------------------------------------------------------------------------


#: bytes the KLR reference's Newton step may hold at once (its images are fitted in chunks)
KLR_CHUNK_BYTES = 1 << 30


def klr_agreement(
    model: nn.Module,
    Y: Tensor,
    *,
    kernel: Any = None,
    lambda_factor: float = 2.0,
    newton_steps: int = 10,
    dtypes: Iterable[str] = ("float64",),
    coords: Any = "auto",
) -> tuple[dict[str, dict[str, float]], Any]:
    """Compare a kGLM DEQ with KLR on every image (row) of ``Y``.

    Args:
        model: a kglm_deq model (Bernoulli family) whose output are logits on the pixels.
        Y: (B, ...) binary images (the corrupted inputs); each is one KLR problem.
        kernel: kernel spec of the KLR reference (default SE lengthscale 1 + white 1e-8).
        lambda_factor: lam = lambda_factor * ||K||_2 (Tsuchida et al. 2022 App. G: 2).
        newton_steps: Newton/IRLS steps (stops early at ||d alpha|| = 0).
        dtypes: precisions in which the DEQ is evaluated (KLR always runs in float64).
        coords: pixel coordinates (see :func:`deqbench.kglm.inits.coordinates`).

    Returns:
        (summary per dtype plus ``"klr"``, per-image DataFrame).
    """
    import pandas as pd

    from .inits import coordinates
    from .kernels import make_kernel
    from .klr import fit_klr

    in_shape = getattr(model, "in_shape", tuple(Y.shape[1:]))
    X = coordinates(in_shape, coords)
    K = make_kernel(DEFAULT_KLR_KERNEL if kernel is None else kernel)(X, X)
    lam = lambda_factor * float(torch.linalg.matrix_norm(K, ord=2))
    Yf = Y.detach().double().cpu().flatten(1)
    # a Newton step holds a (rows, n, n) matrix and its Cholesky factor: chunks of images keep
    # it to about KLR_CHUNK_BYTES (784 pixels: 5,000 images at once would need 49 GB)
    chunk = max(1, KLR_CHUNK_BYTES // (2 * K.shape[0] ** 2 * K.element_size()))
    fits = [fit_klr(K, Yc, lam, steps=newton_steps, tol=0.0) for Yc in Yf.split(chunk)]
    p_klr = torch.cat([r.p for r in fits])
    summary: dict[str, dict[str, float]] = {
        "klr": {
            "newton_steps": max(r.steps for r in fits),
            "last_step_norm": max(r.step_norms[-1] for r in fits),
            "lambda": lam,
        }
    }
    frames = []
    device = next(model.parameters()).device
    for dt in dtypes:
        dtype = getattr(torch, dt)
        m = copy.deepcopy(model).to(dtype=dtype)
        m.eval()
        for layer in deq_layers(m):  # a tolerance below the dtype's resolution never stops
            cfg = layer.solver_cfg
            if cfg.stop_mode == "rel":
                cfg.tol = max(cfg.tol, 10 * torch.finfo(dtype).eps)
        with torch.no_grad():
            logits = m(Y.to(device=device, dtype=dtype))
        p = torch.sigmoid(logits).double().cpu().flatten(1)
        st = getattr(m, "last_forward_stats", None)
        dp = (p - p_klr).abs()
        dis = (p > 0.5) != (p_klr > 0.5)
        ties = dis & ((p_klr - 0.5).abs() < TIE)
        per_img = dis.sum(1)
        summary[dt] = {
            "images": Yf.shape[0],
            "pixels": Yf.numel(),
            "disagreeing_images": int((per_img > 0).sum()),
            "disagreeing_pixels": int(dis.sum()),
            "disagreeing_pixels_at_ties": int(ties.sum()),
            "max_abs_dp": float(dp.max()),
            "mean_abs_dp": float(dp.mean()),
            "deq_nstep": float(st.nstep) if st is not None else math.nan,
            "deq_rel_residual": st.rel_max if st is not None else math.nan,
        }
        frames.append(
            pd.DataFrame(
                {
                    "image": range(Yf.shape[0]),
                    "dtype": dt,
                    "disagreeing_pixels": per_img.numpy(),
                    "max_abs_dp": dp.max(1).values.numpy(),
                }
            )
        )
    return summary, pd.concat(frames, ignore_index=True)


@analyses.register("klr_agreement")
class KLRAgreement(Analysis):
    """kGLM DEQ vs kernel logistic regression (Newton/IRLS) per image and pixel."""

    name = "klr_agreement"
    #: the cell deqbench.testing.check_analysis runs it on (over testing.DEFAULT_EXAMPLE)
    example: ClassVar[dict[str, Any]] = {
        "model": {"name": "kglm_deq_tiny", "family": "bernoulli"},
        "data": {"name": "digits_klr", "split": 0.5},
        "init": {
            "name": "kglm_informed",
            "kernel": [{"name": "se", "lengthscale": 1.0}],
            "scale": 0.5,
        },
        "train": {"epochs": 0},
        "params": {"dtypes": ["float64"], "newton_steps": 5, "max_images": 4},
    }
    version = "1"
    needs_training = False
    params: Params  # narrowed for type checkers

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        kernel: Any = Field(default_factory=lambda: list(DEFAULT_KLR_KERNEL))
        lambda_factor: float = Field(2.0, gt=0)
        newton_steps: int = Field(10, ge=1)
        dtypes: list[Literal["float32", "float64"]] = Field(
            default_factory=lambda: list[Literal["float32", "float64"]](["float32", "float64"])
        )
        split: Literal["test", "train", "all"] = "all"
        max_images: int | None = Field(None, ge=1)

    def before_training(self, ctx: CellContext) -> Iterable[Row]:
        p = self.params
        parts = {
            "test": [ctx.data.test[0]],
            "train": [ctx.data.train[0]],
            "all": [ctx.data.train[0], ctx.data.test[0]],
        }[p.split]
        Y = torch.cat(parts)
        if p.max_images:
            Y = Y[: p.max_images]
        summary, per_image = klr_agreement(
            ctx.model,
            Y,
            kernel=p.kernel,
            lambda_factor=p.lambda_factor,
            newton_steps=p.newton_steps,
            dtypes=p.dtypes,
        )
        ctx.write_series("klr_agreement", per_image)
        rows = []
        for variant, vals in summary.items():
            for k, v in vals.items():
                unit = "f-evals" if k == "deq_nstep" else ""
                rows.append(Row(k, v, variant=variant, unit=unit))
        return rows


# -- initialisation cost -----------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_inits(
    random_init: Any, kglm_init: Any, *, repeats: int, device: torch.device
) -> dict[str, list[float]]:
    """Seconds per call of each init, ``repeats`` times after one warm-up round."""
    out: dict[str, list[float]] = {"random": [], "kglm": []}
    for _ in range(repeats + 1):  # first round is a warm-up
        for scheme, init in (("random", random_init), ("kglm", kglm_init)):
            _sync(device)
            t = time.perf_counter()
            init()
            _sync(device)
            out[scheme].append(time.perf_counter() - t)
    return {k: v[1:] for k, v in out.items()}


def init_cost_fc(
    width: int, *, repeats: int = 10, device: Any = "cpu", dtype: torch.dtype = torch.float32
) -> dict[str, list[float]]:
    """Seconds per init of an n x n hidden (W) and readout (V) weight pair: a random Gaussian
    init (entries N(0, 1/n), the paper's baseline: "random Gaussian initialisation", Tsuchida
    et al. 2022, App. F) vs the kGLM init (SE kernel on a grid, lam = ||K||_2, W = -K/lam,
    V = K/lam)."""
    from .inits import kernel_weights

    device = torch.device(device)
    W = torch.empty(width, width, device=device, dtype=dtype)
    V = torch.empty(width, width, device=device, dtype=dtype)
    x = torch.linspace(-2 * math.pi, 2 * math.pi, width, dtype=torch.float64).unsqueeze(1)

    std = 1.0 / math.sqrt(width)

    def random_init() -> None:
        with torch.no_grad():
            W.normal_(0.0, std)
            V.normal_(0.0, std)

    def kglm_init() -> None:
        p = kernel_weights("se", x, None)
        with torch.no_grad():
            W.copy_(p["W1"])
            V.copy_(p["W2"])

    return _time_inits(random_init, kglm_init, repeats=repeats, device=device)


def init_cost_conv(
    channels: int,
    *,
    size: int = 32,
    kernel_size: int = 5,
    repeats: int = 10,
    device: Any = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict[str, list[float]]:
    """Seconds per init of a C -> C conv pair (conv1, conv2): N(0, std^2) vs the kGLM init (SE
    filter bank, Sedghi spectral norm on size x size, scaling)."""
    from ..spectral.norms import conv_spectral_norm
    from .inits import se_filters

    device = torch.device(device)
    shape = (channels, channels, kernel_size, kernel_size)
    w1 = torch.empty(shape, device=device, dtype=dtype)
    w2 = torch.empty(shape, device=device, dtype=dtype)
    g = torch.Generator().manual_seed(0)

    def random_init() -> None:
        with torch.no_grad():
            w1.normal_(0.0, 0.05)
            w2.normal_(0.0, 0.05)

    def kglm_init() -> None:
        k = se_filters(channels, kernel_size, generator=g).to(device)
        lam = conv_spectral_norm(k, (size, size))
        with torch.no_grad():
            w1.copy_(-k / lam)
            w2.copy_(k / lam)

    return _time_inits(random_init, kglm_init, repeats=repeats, device=device)


@analyses.register("kglm_init_cost")
class KGLMInitCost(Analysis):
    """Initialisation cost, kGLM vs random, for fully connected and conv layers (figure 8)."""

    name = "kglm_init_cost"
    #: the cell deqbench.testing.check_analysis runs it on (over testing.DEFAULT_EXAMPLE)
    example: ClassVar[dict[str, Any]] = {
        "train": {"epochs": 0},
        "params": {"fc_widths": [8, 16], "conv_channels": [1, 2], "conv_size": 8, "repeats": 1},
    }
    version = "1"
    needs_training = False
    params: Params  # narrowed for type checkers

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        fc_widths: list[int] = Field(default_factory=lambda: [50, 250, 450, 650, 850])
        conv_channels: list[int] = Field(default_factory=lambda: [1, 8, 16, 32, 63])
        conv_size: int = Field(32, ge=1)
        kernel_size: int = Field(5, ge=1)
        repeats: int = Field(5, ge=1)

    def before_training(self, ctx: CellContext) -> Iterable[Row]:
        p = self.params
        rows: list[Row] = []
        jobs = [
            (
                "fc",
                n,
                lambda n=n: init_cost_fc(n, repeats=p.repeats, device=ctx.device, dtype=ctx.dtype),
            )
            for n in p.fc_widths
        ]
        jobs += [
            (
                "conv",
                c,
                lambda c=c: init_cost_conv(
                    c,
                    size=p.conv_size,
                    kernel_size=p.kernel_size,
                    repeats=p.repeats,
                    device=ctx.device,
                    dtype=ctx.dtype,
                ),
            )
            for c in p.conv_channels
        ]
        for layer, size, fn in jobs:
            for scheme, times in fn().items():
                v = f"{layer}/{scheme}"
                for i, t in enumerate(times):
                    rows.append(Row("init_time", t, variant=v, step=size, repeat=i, unit="s"))
                rows.append(
                    Row(
                        "init_time_median",
                        float(torch.tensor(times).median()),
                        variant=v,
                        step=size,
                        unit="s",
                    )
                )
        return rows


# -- plots, tables -----------------------------------------------------------------------------


def _kglm_scheme(init: str) -> str:
    return {"kglm_informed": "informed", "kglm_naive": "naive", "kglm_random": "random"}.get(
        init, init
    )


def _metric(df: Any, analysis: str, metric: str, variant: str | None = None) -> Any:
    d = df[(df["analysis"] == analysis) & (df["metric"] == metric)]
    if variant is not None:
        d = d[d["variant"] == variant]
    return d


def smooth_table(df: Any) -> Any:
    """Test MSE of the GP task per (init scheme, epoch): mean/min/max of log MSE over seeds."""
    import numpy as np

    d = _metric(df, "metrics", "mse", "test")
    d = d[
        d["model"].astype(str).str.startswith("kglm_deq")
        & d["init"].isin(["kglm_informed", "kglm_naive", "kglm_random"])
        & d["step"].notna()
    ]
    if d.empty:
        return d
    d = d.assign(
        scheme=d["init"].map(_kglm_scheme),
        epoch=d["step"].astype(int),
        log_mse=np.log(d["value"].astype(float)),
    )
    return (
        d.groupby(["scheme", "epoch"])["log_mse"].agg(["mean", "min", "max", "count"]).reset_index()
    )


def smooth_figure(df: Any) -> Any | None:
    """Figure 5 analogue: log test MSE per epoch (mean, min-max band over seeds) per init, and
    the forward/backward iterations per epoch."""
    from ..run.plots import new_figure

    t = smooth_table(df)
    if t.empty:
        return None
    it = _metric(df, "solver_stats", "forward_nstep", "train")
    itb = _metric(df, "solver_stats", "backward_nstep", "train")
    fig = new_figure(5.0, 4.0, ncols=2)
    ax = fig.axes[0]
    colors = {"informed": "tab:blue", "naive": "tab:green", "random": "tab:red"}
    for scheme, g in t.groupby("scheme"):
        c = colors.get(scheme)
        ax.plot(g["epoch"], g["mean"], color=c, label=scheme)
        ax.fill_between(g["epoch"], g["min"], g["max"], color=c, alpha=0.2)
    ax.set_xlabel("epoch")
    ax.set_ylabel("log test MSE (mean, min-max over seeds)")
    ax.set_title("GP sequence task")
    ax.legend()
    ax.grid(True, alpha=0.3)
    ax = fig.axes[1]
    for d, style in ((it, "-"), (itb, "--")):
        d = d[d["init"].isin(["kglm_informed", "kglm_naive", "kglm_random"]) & d["step"].notna()]
        for init, g in d.groupby("init"):
            s = _kglm_scheme(init)
            m = g.groupby(g["step"].astype(int))["value"].mean()
            ax.plot(
                m.index,
                m.values,
                style,
                color=colors.get(s),
                label=f"{s} ({'forward' if style == '-' else 'backward'})",
            )
    ax.set_xlabel("epoch")
    ax.set_ylabel("solver iterations per batch")
    ax.set_title("forward (solid) / backward (dashed)")
    ax.legend(fontsize="x-small")
    ax.grid(True, alpha=0.3)
    return fig


def denoise_points(df: Any) -> Any:
    """Per (cell, seed, epoch) of the conv denoiser: scheme, average spectral norm of the convs
    (analysis ``spectral``, variant ``mean``) and test MSE (NaN when the run had failed by then).
    """
    import pandas as pd

    # the kGLM-vs-random study: conv denoisers under a kGLM scheme (a default-init denoiser, as
    # in the smoke suite, is not part of it)
    base = df[
        df["model"].astype(str).str.startswith("kglm_conv_deq")
        & df["init"].astype(str).isin(["kglm_informed", "kglm_naive", "kglm_random"])
    ]
    if base.empty:
        return pd.DataFrame()
    sn = _metric(base, "spectral", "sigma_max", "mean")
    mse = _metric(base, "metrics", "mse", "test")
    runs = base[["cell_id", "seed", "init"]].drop_duplicates()
    epochs = sorted({int(s) for s in pd.concat([sn["step"], mse["step"]]).dropna()})
    rows = []
    sn_idx = {
        (r.cell_id, r.seed, int(r.step)): float(r.value)
        for r in sn.itertuples()
        if r.step == r.step
    }
    mse_idx = {
        (r.cell_id, r.seed, int(r.step)): float(r.value)
        for r in mse.itertuples()
        if r.step == r.step
    }
    for r in runs.itertuples():
        init_sn = sn_idx.get((r.cell_id, r.seed, 0), math.nan)
        last_sn = init_sn
        for e in epochs:
            s = sn_idx.get((r.cell_id, r.seed, e), math.nan)
            last_sn = s if math.isfinite(s) else last_sn
            v = mse_idx.get((r.cell_id, r.seed, e), math.nan)
            rows.append(
                {
                    "cell_id": r.cell_id,
                    "seed": r.seed,
                    "scheme": _kglm_scheme(r.init),
                    "epoch": e,
                    "spectral_norm": s if math.isfinite(s) else last_sn,
                    "init_spectral_norm": init_sn,
                    "test_mse": v,
                    "failed": not math.isfinite(v),
                }
            )
    return pd.DataFrame(rows)


def denoise_table(df: Any) -> Any:
    """Table 1 analogue per (scheme, epoch): the best cell (lowest mean log test MSE over seeds,
    with NaN/inf replaced by the maximum first, as Tsuchida et al. 2022 does), its mean and std of log MSE,
    its average spectral norm at init, and the number of failed runs over the whole grid."""
    import numpy as np
    import pandas as pd

    p = denoise_points(df)
    if p.empty:
        return p
    out = []
    for (scheme, epoch), g in p.groupby(["scheme", "epoch"]):
        logm = np.log(g["test_mse"].astype(float).where(g["test_mse"] > 0))
        finite = logm[np.isfinite(logm)]
        fill = float(finite.max()) if len(finite) else math.nan
        g = g.assign(log_mse=logm.where(np.isfinite(logm), fill))
        per_cell = g.groupby("cell_id").agg(
            mean=("log_mse", "mean"), std=("log_mse", "std"), sn=("init_spectral_norm", "mean")
        )
        best = per_cell["mean"].idxmin() if per_cell["mean"].notna().any() else None
        out.append(
            {
                "scheme": scheme,
                "epoch": int(epoch),
                "best_cell": best,
                "best_init_spectral_norm": per_cell.loc[best, "sn"] if best else math.nan,
                "mean_log_mse": per_cell.loc[best, "mean"] if best else math.nan,
                "std_log_mse": per_cell.loc[best, "std"] if best else math.nan,
                "best_mse": float(np.exp(per_cell.loc[best, "mean"])) if best else math.nan,
                "failed": int(g["failed"].sum()),
                "runs": len(g),
            }
        )
    return pd.DataFrame(out)


def denoise_figure(df: Any) -> Any | None:
    """Figure 6 analogue: test MSE against the average spectral norm of the four convolutions,
    one panel per epoch; kGLM (blue) vs random (red); failed runs drawn on the top border."""
    import numpy as np

    from ..run.plots import new_figure

    p = denoise_points(df)
    if p.empty or not np.isfinite(p["spectral_norm"].astype(float)).any():
        return None  # no spectral-norm rows (a suite without the spectral analysis)
    epochs = sorted(p["epoch"].unique())
    fig = new_figure(3.2, 3.0, ncols=len(epochs))
    ok = p["test_mse"][np.isfinite(p["test_mse"])]
    top = float(ok.quantile(0.9)) * 1.5 if len(ok) else 1.0
    colors = {"informed": "tab:blue", "random": "tab:red", "naive": "tab:green"}
    for ax, e in zip(fig.axes, epochs):
        g = p[p["epoch"] == e]
        for scheme, h in g.groupby("scheme"):
            good = h[~h["failed"]]
            bad = h[h["failed"]]
            c = colors.get(scheme, None)
            ax.scatter(
                good["spectral_norm"],
                good["test_mse"].clip(upper=top),
                s=10,
                color=c,
                label="kGLM" if scheme == "informed" else scheme,
            )
            if not bad.empty:
                ax.scatter(
                    bad["spectral_norm"].fillna(bad["init_spectral_norm"]),
                    np.full(len(bad), top),
                    marker="^",
                    s=14,
                    color=c,
                )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_ylim(top=top * 1.05)
        ax.set_title(f"epoch {e}")
        ax.set_xlabel("average spectral norm")
        ax.grid(True, alpha=0.3)
    fig.axes[0].set_ylabel("test MSE")
    fig.axes[0].legend(fontsize="x-small")
    return fig


def init_cost_figure(df: Any) -> Any | None:
    """Figure 8 analogue: median init time vs width (fc) and channels (conv)."""
    from ..run.plots import new_figure

    d = _metric(df, "kglm_init_cost", "init_time_median")
    if d.empty:
        return None
    fig = new_figure(4.0, 3.5, ncols=2)
    for ax, layer, xl in ((fig.axes[0], "fc", "width"), (fig.axes[1], "conv", "# channels")):
        for scheme, c in (("kglm", "tab:blue"), ("random", "tab:red")):
            g = d[d["variant"] == f"{layer}/{scheme}"].sort_values("step")
            m = g.groupby("step")["value"].median()
            ax.plot(m.index, m.values, marker="o", color=c, label=scheme)
        ax.set_yscale("log")
        ax.set_xlabel(xl)
        ax.set_ylabel("init time (s)")
        ax.set_title("fully connected" if layer == "fc" else "convolutional")
        ax.legend()
        ax.grid(True, alpha=0.3)
    return fig


def _register_plots() -> None:
    from ..run import plots

    @plots.register("kglm")
    def _kglm_plots(df: Any, run_dir: Path) -> dict[str, Any]:
        figs: dict[str, Any] = {}
        for name, fn in (
            ("kglm_smooth", smooth_figure),
            ("kglm_denoise", denoise_figure),
            ("kglm_init_cost", init_cost_figure),
        ):
            fig = fn(df)
            if fig is not None:
                figs[name] = fig
        tab = denoise_table(df)
        if not tab.empty:
            tab.to_csv(Path(run_dir) / "kglm_denoise_table.csv", index=False)
        return figs


_register_plots()
