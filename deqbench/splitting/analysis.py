"""Forward-backward vs Peaceman-Rachford step sweep on a trained monDEQ.

After training, on ``samples`` test inputs: forward iterations of FB and PR to ``tol`` for each
alpha, beside the FB step bound 2m/||I - W||^2 and lambda_max((W + W^T)/2). Expected: PR
converges for every alpha with an interior optimum; FB fails above its bound (the bound is
sufficient, not necessary) and is slower than PR below it.

Rows (analysis ``splitting_sweep``, after training; variant ``<solver>/alpha=<a>``):
``forward_nstep`` (iterations), ``converged`` (0/1), ``rel_residual`` (max over the batch), and,
with variant ``""``: ``fb_alpha_bound``, ``lipschitz_I_minus_W``, ``lambda_max_sym_W``,
``monotonicity_gap``. Series ``splitting_sweep`` holds the table.

Example (the plain function):
    >>> import deqbench, torch
    >>> from deqbench.splitting.analysis import splitting_sweep
    >>> model = deqbench.models.create("mondeq_fc_tiny")
    >>> table, info = splitting_sweep(model, torch.rand(16, 64))
    >>> sorted(info)                                                   # doctest: +SKIP
    ['fb_alpha_bound', 'lambda_max_sym_W', 'lipschitz_I_minus_W', 'monotonicity_gap']
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, Literal, cast

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn

from ..analyses.base import Analysis, CellContext, Row
from ..core.registry import analyses

ALPHAS = (1.0, 0.5, 0.25, 0.125, 0.0625)
METHODS = ("forward_backward", "peaceman_rachford")


def splitting_sweep(
    model: nn.Module,
    x: Tensor,
    *,
    alphas: Sequence[float] = ALPHAS,
    methods: Sequence[str] = METHODS,
    tol: float = 1e-5,
    max_iter: int = 300,
    residual: str = "canonical",
    float64: bool = True,
) -> tuple[Any, dict[str, float]]:
    """Iterations of each splitting method and step on the monDEQ ``model`` at input ``x``.

    Args:
        model: a monDEQ (its ``deq.cell`` implements the MonotoneCell protocol).
        x: a batch of inputs.
        alphas, methods: the grid.
        tol, max_iter: stopping rule (relative residual, batch max).
        residual: "canonical" (||f(z) - z|| / ||f(z)||) or "splitting" (successive difference).
        float64: run on a float64 copy of the model (the reference measurement does).

    Returns:
        (DataFrame with columns method, alpha, nstep, converged, status, rel_residual,
        rel_residual_mean, seconds; dict of the operator quantities: fb_alpha_bound,
        lipschitz_I_minus_W, lambda_max_sym_W, monotonicity_gap).
    """
    import pandas as pd

    from .. import solvers
    from ..core.deq import CellMap, DEQModel
    from ..solvers.splitting import fb_step_bound, monotone_cell

    if float64:
        model = copy.deepcopy(model).double()
        x = x.double()
    model = cast(DEQModel, model)  # a monDEQ
    was = model.training
    model.eval()
    cell = monotone_cell(CellMap(model.deq.cell, x), methods[0])
    with torch.no_grad():
        u = model.inject(x)
        recs = []
        for method in methods:
            fn = solvers.get(method)
            for a in alphas:
                t0 = time.perf_counter()
                _, st = fn(
                    CellMap(cast(nn.Module, cell), u),
                    torch.zeros_like(u),
                    max_iter=max_iter,
                    tol=tol,
                    alpha=float(a),
                    residual=residual,
                )
                recs.append(
                    {
                        "method": method,
                        "alpha": float(a),
                        "nstep": st.nstep,
                        "converged": bool(st.converged),
                        "status": st.status,
                        "rel_residual": st.rel_max,
                        "rel_residual_mean": st.rel_mean,
                        "seconds": time.perf_counter() - t0,
                    }
                )
    model.train(was)
    lam = cell.monotonicity()
    info = {
        "fb_alpha_bound": fb_step_bound(cell),
        "lipschitz_I_minus_W": cell.lipschitz(),
        "lambda_max_sym_W": lam,
        "monotonicity_gap": (1 - cell.m) - lam,
    }
    return pd.DataFrame(recs), info


@analyses.register("splitting_sweep")
class SplittingSweep(Analysis):
    """FB vs PR forward iterations over the step alpha after training (monDEQ)."""

    judges_own_solves = True  # see Analysis.judges_own_solves
    name = "splitting_sweep"
    #: the cell deqbench.testing.check_analysis runs it on (over testing.DEFAULT_EXAMPLE)
    example: ClassVar[dict[str, Any]] = {
        "model": "mondeq_fc_tiny",
        "params": {"alphas": [1.0, 0.5], "samples": 16},
    }
    version = "1"
    needs_training = False

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        alphas: list[float] = Field(default_factory=lambda: list(ALPHAS), min_length=1)
        tol: float = Field(1e-5, gt=0)
        max_iter: int = Field(300, ge=1)
        samples: int = Field(400, ge=1)
        residual: Literal["canonical", "splitting"] = "canonical"
        float64: bool = True

    params: Params  # narrowed for type checkers

    def after_training(self, ctx: CellContext) -> Iterable[Row]:
        from ..solvers.splitting import MonotoneCell

        p = self.params
        cell = getattr(getattr(ctx.model, "deq", None), "cell", None)
        if not isinstance(cell, MonotoneCell):
            yield Row(
                "forward_nstep",
                float("nan"),
                status="skipped",
                note="not a monotone-operator DEQ (splitting solvers need monDEQ)",
            )
            return
        x = ctx.data.test[0][: p.samples]
        table, info = splitting_sweep(
            ctx.model,
            x,
            alphas=p.alphas,
            tol=p.tol,
            max_iter=p.max_iter,
            residual=p.residual,
            float64=p.float64,
        )
        ctx.write_series("splitting_sweep", table.assign(**info))
        for r in table.itertuples():
            variant = f"{r.method}/alpha={r.alpha:g}"
            note = f"{r.status}; tol {p.tol:g}, {p.residual} residual, batch {len(x)}"
            yield Row("forward_nstep", r.nstep, variant=variant, unit="iterations", note=note)
            yield Row("converged", float(r.converged), variant=variant)
            yield Row("rel_residual", r.rel_residual, variant=variant)
        for k, v in info.items():
            yield Row(k, v)

    @classmethod
    def plot(cls, df: Any, run_dir: Any) -> dict[str, Any]:
        """The figures (``deqbench.plots``): :func:`_sweep_plots`."""
        return _sweep_plots(df)


def sweep_plot(df: Any) -> Any | None:
    """Iterations vs alpha (log2 axis) for FB and PR, failures drawn at max_iter with a cross,
    the FB step bound as a vertical line; one line per (cell, method)."""
    from ..run.plots import cell_colors, new_figure, short_labels

    d = df[(df["analysis"] == "splitting_sweep") & (df["status"] == "ok")]
    it = d[d.metric == "forward_nstep"]
    if it.empty:
        return None
    conv = d[d.metric == "converged"].set_index(["cell_id", "seed", "variant"])["value"]
    fig = new_figure(6.0, 4.0)
    ax = fig.axes[0]
    ids = it["cell_id"].unique()
    labels, colors = short_labels(ids), cell_colors(ids)
    parts = it["variant"].str.extract(r"^(?P<method>[^/]+)/alpha=(?P<alpha>.+)$")
    it = it.assign(method=parts["method"], alpha=parts["alpha"].astype(float))
    for (cid, method), g in it.groupby(["cell_id", "method"]):
        agg = g.groupby("alpha")["value"].median().sort_index()
        style = "-" if method == "peaceman_rachford" else "--"
        short = "PR" if method == "peaceman_rachford" else "FB"
        label = f"{short} {labels[str(cid)]}" if len(ids) > 1 else short
        ax.plot(
            agg.index,
            agg.to_numpy(float),
            style,
            marker="o",
            ms=4,
            color=colors[str(cid)] if len(ids) > 1 else None,
            label=label,
        )
        bad = [
            (r.alpha, r.value)
            for r in g.itertuples()
            if conv.get((r.cell_id, r.seed, r.variant), 1.0) < 0.5
        ]
        if bad:
            ax.scatter(*zip(*bad), marker="x", s=60, color="red", zorder=3)
    bound = d[d.metric == "fb_alpha_bound"]["value"]
    if not bound.empty:
        b = float(bound.median())
        ax.axvline(b, color="grey", ls=":", label=f"FB bound 2m/||I-W||^2 = {b:.3g}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("alpha")
    ax.set_ylabel("forward iterations to tol")
    ax.set_title("monDEQ splitting: FB vs PR (x = not converged)", fontsize="medium")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="x-small")
    return fig


def _sweep_plots(df: Any) -> dict[str, Any]:
    fig = sweep_plot(df)
    return {"splitting_sweep": fig} if fig is not None else {}
