"""Path independence: whether a model's fixed point, output and prediction depend on where the
forward solve starts.

Each sample of ``samples`` (equal-sized batches of a seeded permutation of ``split``) is solved
from every start of ``starts``, the first one the reference:

* ``zeros``: z0 = 0;
* ``noise``: z0 ~ ``noise_scale`` * N(0, 1) per state entry (an absolute scale; drawn with a
  generator seeded by the task's seed, batch after batch, the same draw on every device:
  :func:`noise_draw`);
* ``previous``: z0 = the previous batch's z* from the reference start (batch 0 takes the last
  batch's; batches are equal-sized, so shapes match; needs two batches or more).

The model runs forward in eval mode, under no_grad, with its DEQ layer ``layer`` solving from
the given start with the cell's own solver, tolerance, stop mode and budget (the rest of the
model, injection and readout included, as it is). A solve is *converged* for a sample when
that sample's residual (the stop mode's) is below the tolerance; a sample that some start left
unconverged is counted (``unconverged``) and left out of every fraction and spread, never
silently used. For each converged sample and start s: ``z_distance`` = ||z*_s - z*_ref|| /
||z*_ref|| (flattened state), ``output_distance`` the same for the model's outputs (logits),
and whether the prediction (argmax; classification) differs from the reference's. The sample
has the *same fixed point* from s when ``z_distance <= same_tol`` (default 100 x the solves'
tolerance: two approximations of one fixed point, each with relative residual below tol, can be
about tol / (1 - L) apart, L the map's contraction factor near z*; distinct fixed points are
typically O(1) apart, so the histograms of the figure show whether a distance is solve error or
another fixed point).

Rows (``step`` 0 before training, = epochs after; variant: a start, or ``all`` over the
non-reference starts together, a sample's distance then being its largest):

* ``same_fixed_point``: fraction of the converged samples whose z* from the start(s) is within
  ``same_tol`` of the reference's (``all``: from every start);
* ``z_distance_median`` / ``z_distance_max``, ``output_distance_median`` / ``_max`` over
  samples (relative);
* ``prediction_changed`` (classification): fraction of the converged samples whose prediction
  differs from the reference's (``all``: for some start);
* ``depends_on_z0`` (variant ``all``): 1 when some converged sample's prediction (regression:
  output, beyond ``same_tol``) differs between starts, else 0; its note names the model and says
  how many samples change, so the run's headline says it;
* ``unconverged`` (variant a start): fraction of samples whose solve from that start missed
  tolerance; ``unconverged`` ``all``: fraction left out, ``flagged`` above 1% (the fractions
  then rest on fewer samples);
* ``samples``, ``noise_scale``, ``same_tol``, ``tol`` (the solves' tolerance).

Series ``path_independence``: per step, batch, sample and start: ``converged``, ``residual``,
``z_distance``, ``output_distance``, ``prediction``, ``prediction_changed``. Figure
``path_independence.png`` (:func:`deqbench.convergence.plots.path_independence_figure`).

Example (the plain functions, without the runner):
    >>> import torch, deqbench
    >>> from deqbench.convergence.path_independence import path_table, summarize
    >>> model = deqbench.models.create("fc_deq_tiny")
    >>> table = path_table(model, torch.randn(32, 64), batch_size=16)
    >>> s = summarize(table, same_tol=1e-2)
    >>> sorted(s["same"]), s["samples"]
    (['all', 'noise', 'previous'], 32)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field, field_validator
from torch import Tensor, nn

from ..analyses.base import CellContext, Row
from ..core.deq import DEQLayer
from ..core.registry import analyses
from ._common import (
    ConvergenceParams,
    PhasedAnalysis,
    batches_of,
    model_name,
    pick_layer,
    replaced_forward,
    start_of,
)

SERIES = "path_independence"
Start = Literal["zeros", "noise", "previous"]
STARTS: tuple[Start, ...] = ("zeros", "noise", "previous")
EPS = 1e-12  # in relative distances: a reference exactly 0 makes any other z* "different"
#: default same_tol = SAME_FACTOR x the solves' tolerance: two approximations of one fixed point,
#: each with relative residual <= tol, can be up to about tol / (1 - L) apart (L: the map's
#: contraction factor near z*), 100 x tol for L = 0.99; distinct fixed points are usually O(1)
#: apart (the bistable test's: 0.6-2)
SAME_FACTOR = 100.0
#: share of samples left out (unconverged from some start) above which the rows are flagged
MISSED_SHARE = 0.01


def _flat(t: Tensor) -> Tensor:
    return t.detach().reshape(t.shape[0], -1).double().cpu()


def _rel(a: Tensor, ref: Tensor) -> np.ndarray:
    return (torch.linalg.vector_norm(a - ref, dim=1)
            / (torch.linalg.vector_norm(ref, dim=1) + EPS)).numpy()  # fmt: skip


def noise_draw(gen: torch.Generator, like: Tensor, scale: float) -> Tensor:
    """The ``noise`` start of one batch: ``scale * torch.randn(like.shape, generator=gen)``
    (float32 on the CPU, so every device gets the same draw) in ``like``'s dtype and device;
    :func:`path_table` draws batch after batch from ``torch.Generator().manual_seed(seed)``."""
    draw = torch.randn(like.shape, generator=gen, dtype=torch.float32)
    return scale * draw.to(device=like.device, dtype=like.dtype)


def path_table(
    model: nn.Module,
    X: Tensor,
    y: Tensor | None = None,
    *,
    starts: Sequence[str] = STARTS,
    noise_scale: float = 1.0,
    batch_size: int = 128,
    seed: int = 0,
    layer: int = 0,
    classification: bool = True,
) -> Any:
    """Solve every sample of ``X`` from every start (see the module docstring); a DataFrame,
    one row per (sample, start): batch, sample, start, converged, residual, z_distance,
    output_distance, prediction, prediction_changed. ``X`` is cut into equal batches of
    ``batch_size`` (a remainder is left out); ``y`` is not used (kept for symmetry with the
    other plain functions)."""
    import pandas as pd

    from ..core.runtime import autocast

    dl, why = pick_layer(model, layer)
    if dl is None:
        raise ValueError(f"path_independence: {why}")
    starts = list(starts)
    if not starts or starts[0] == "previous":
        raise ValueError("path_independence: the first start (the reference) cannot be 'previous'")
    bs = min(int(batch_size), int(X.shape[0]))
    nb = int(X.shape[0]) // bs
    if "previous" in starts and nb < 2:
        raise ValueError(f"path_independence: start 'previous' needs 2 batches or more, got {nb}")
    gen = torch.Generator().manual_seed(int(seed))
    rt = dl.runtime

    def run(x: Tensor, make: Any) -> tuple[Tensor, Any, Tensor]:
        box: dict[str, Any] = {}

        def hook(u: Tensor, z0: Tensor | None = None) -> Tensor:
            if "z" in box:  # the layer called again in the same forward: as it is
                return DEQLayer.forward(dl, u, z0)
            u, base = start_of(dl, u, z0)
            z, st = dl.solve(u, make(base))
            box["z"], box["stats"] = z, st
            return z

        with replaced_forward(dl, hook), torch.no_grad(), autocast(rt, x.device):
            out = model(x)
        if "z" not in box:
            raise RuntimeError("path_independence: the model's forward did not call its DEQ layer")
        return box["z"], box["stats"], out

    was = model.training
    model.eval()
    refs: list[Tensor] = []
    res: dict[tuple[int, str], tuple[Tensor, Any, Tensor]] = {}
    try:
        for s in starts:
            for b in range(nb):
                x = X[b * bs : (b + 1) * bs]
                if s == "zeros":
                    make: Any = torch.zeros_like
                elif s == "noise":

                    def make(base: Tensor) -> Tensor:  # one draw per batch, in batch order
                        return noise_draw(gen, base, noise_scale)
                elif s == "previous":
                    prev = refs[(b - 1) % nb]

                    def make(base: Tensor, prev: Tensor = prev) -> Tensor:
                        return prev.to(base.dtype).reshape(base.shape).clone()
                else:
                    raise ValueError(
                        f"path_independence: unknown start {s!r} ({', '.join(STARTS)})"
                    )
                res[(b, s)] = run(x, make)
                if s == starts[0]:
                    refs.append(res[(b, s)][0].detach())
    finally:
        model.train(was)
    frames = []
    for b in range(nb):
        zr, _, outr = res[(b, starts[0])]
        zr_f, or_f = _flat(zr), _flat(outr)
        pred_r = outr.detach().argmax(1).cpu() if classification else None
        for s in starts:
            z, st, out = res[(b, s)]
            resid = st.residual.detach().double().cpu().numpy()
            pred = out.detach().argmax(1).cpu() if classification else None
            frames.append(
                pd.DataFrame(
                    {
                        "batch": b,
                        "sample": np.arange(b * bs, (b + 1) * bs),
                        "start": s,
                        "converged": resid < float(st.tol),
                        "residual": resid,
                        "z_distance": _rel(_flat(z), zr_f),
                        "output_distance": _rel(_flat(out), or_f),
                        "prediction": pred.numpy() if pred is not None else np.nan,
                        "prediction_changed": (pred != pred_r).numpy()
                        if pred is not None and pred_r is not None
                        else np.nan,
                    }
                )
            )
    table = pd.concat(frames, ignore_index=True)
    table.attrs.update(starts=starts, tol=float(dl.solver_cfg.tol), solver=dl.solver_cfg.name)
    return table


def summarize(table: Any, same_tol: float) -> dict[str, Any]:
    """Fractions and spreads of a :func:`path_table` (see the module docstring): a dict with
    ``samples``, ``valid`` (converged from every start), ``unconverged`` (start -> fraction),
    and per non-reference start and ``all``: ``same``, ``z_median``, ``z_max``,
    ``out_median``, ``out_max``, ``changed`` (None without predictions)."""
    starts = list(table.attrs.get("starts") or dict.fromkeys(table["start"]))
    ref, others = starts[0], starts[1:]
    wide = table.pivot(index="sample", columns="start")
    n = int(wide.shape[0])
    conv = wide["converged"].astype(bool)
    ok = conv.all(axis=1)
    v = wide[ok]
    out: dict[str, Any] = {
        "samples": n,
        "valid": int(ok.sum()),
        "reference": ref,
        "unconverged": {s: float((~conv[s]).mean()) for s in starts},
        "excluded": float((~ok).mean()) if n else math.nan,
    }
    keys = ("same", "z_median", "z_max", "out_median", "out_max", "changed")
    for k in keys:
        out[k] = {}
    has_pred = table["prediction_changed"].notna().all()
    groups = {s: [s] for s in others}
    if others:
        groups["all"] = others
    for name, ss in groups.items():
        z = v["z_distance"][ss].max(axis=1).to_numpy(float)
        o = v["output_distance"][ss].max(axis=1).to_numpy(float)
        empty = z.size == 0
        out["same"][name] = float((z <= same_tol).mean()) if not empty else math.nan
        out["z_median"][name] = float(statistics.median(z)) if not empty else math.nan
        out["z_max"][name] = float(z.max()) if not empty else math.nan
        out["out_median"][name] = float(statistics.median(o)) if not empty else math.nan
        out["out_max"][name] = float(o.max()) if not empty else math.nan
        if has_pred and not empty:
            ch = v["prediction_changed"][ss].astype(bool).any(axis=1).to_numpy()
            out["changed"][name] = float(ch.mean())
        else:
            out["changed"][name] = None
    return out


@analyses.register("path_independence")
class PathIndependence(PhasedAnalysis):
    """Whether the fixed point, outputs and predictions depend on the solve's start (zeros,
    noise, the previous batch's z*): fractions of samples and spreads."""

    name = "path_independence"
    version = "1"
    metric = "same_fixed_point"
    example = {"params": {"samples": 32, "batch_size": 16}}

    class Params(ConvergenceParams):
        starts: list[Start] = Field(
            default_factory=lambda: list(STARTS),
            min_length=2,
            description="z0 of the solves; the first is the reference (not 'previous')",
        )
        noise_scale: float = Field(1.0, gt=0, description="std of the 'noise' start (absolute)")
        same_tol: float | None = Field(
            None,
            gt=0,
            description="same fixed point: ||z_s - z_ref|| / ||z_ref|| <= same_tol (null: 100 "
            "times the cell's solver tolerance)",
        )
        samples: int = Field(512, ge=1, description="samples solved (at most the split)")
        batch_size: int = Field(128, ge=1, description="samples per forward")

        @field_validator("starts")
        @classmethod
        def _starts(cls, v: list[str]) -> list[str]:
            if v[0] == "previous":
                raise ValueError("the first start is the reference: 'zeros' or 'noise'")
            if len(set(v)) != len(v):
                raise ValueError(f"a start listed twice: {v}")
            return v

    params: Params  # narrowed for type checkers

    def _measure(self, ctx: CellContext, step: int):
        import pandas as pd

        from ..performance._perf import preserved

        p = self.params
        layer, why = pick_layer(ctx.model, p.layer)
        if layer is None:
            yield Row.skipped(self.metric, why, step=step)
            return
        if layer.backward_cfg.name == "unrolled":
            why = "backward unrolled: the model evaluates K steps from z0, not a fixed point"
            yield Row.skipped(self.metric, why, step=step)
            return
        bs = min(p.batch_size, p.samples)
        data, note = batches_of(ctx, p.split, bs, max(1, p.samples // bs))
        starts = list(p.starts)
        if "previous" in starts and len(data) < 2:
            starts.remove("previous")
            yield Row.skipped(self.metric, "start 'previous' needs 2 batches or more",
                              variant="previous", step=step)  # fmt: skip
        if len(starts) < 2:
            return
        X = torch.cat([x for x, _ in data])
        with preserved(ctx.model):
            table = path_table(ctx.model, X, starts=starts, noise_scale=p.noise_scale,
                               batch_size=len(data[0][0]), seed=ctx.seed, layer=p.layer,
                               classification=ctx.task == "classification")  # fmt: skip
        self._series.append(table.assign(step=step))
        ctx.write_series(SERIES, pd.concat(self._series, ignore_index=True))
        same_tol = p.same_tol if p.same_tol is not None else SAME_FACTOR * table.attrs["tol"]
        summary = summarize(table, same_tol)
        yield from self._rows(summary, table, ctx, step, note, same_tol)

    def _rows(
        self, s: dict[str, Any], table: Any, ctx: CellContext, step: int, note: str, same_tol: float
    ):
        p = self.params
        ref, n, valid = s["reference"], s["samples"], s["valid"]
        over = f"over {valid} of {n} samples converged from every start" + (
            "" if valid == n else f" ({n - valid} left out)"
        )
        for v, frac in s["same"].items():
            yield Row("same_fixed_point", frac, variant=v, step=step, unit="fraction",
                      note=f"within {same_tol:g} of the {ref} start's z*; {over}")  # fmt: skip
        for metric, key in (("z_distance", "z"), ("output_distance", "out")):
            for v in s["same"]:
                yield Row(f"{metric}_median", s[f"{key}_median"][v], variant=v, step=step,
                          unit="relative")  # fmt: skip
                yield Row(f"{metric}_max", s[f"{key}_max"][v], variant=v, step=step,
                          unit="relative")  # fmt: skip
        classification = ctx.task == "classification"
        if classification:
            for v, frac in s["changed"].items():
                yield Row("prediction_changed", frac, variant=v, step=step, unit="fraction",
                          note=f"argmax differs from the {ref} start's; {over}")  # fmt: skip
        yield self._verdict(s, ctx, step, classification, same_tol)
        for st, frac in s["unconverged"].items():
            yield Row("unconverged", frac, variant=st, step=step, unit="fraction")
        flag = s["excluded"] > MISSED_SHARE
        yield Row("unconverged", s["excluded"], variant="all", step=step, unit="fraction",
                  status="flagged" if flag else "ok",
                  note=(f"{n - valid} of {n} samples missed tol {table.attrs['tol']:g} from some "
                        "start and are left out of the fractions; raise max_iter or check the "
                        "solver") if n > valid else "")  # fmt: skip
        yield Row("samples", n, step=step, unit="samples", note=note)
        yield Row("noise_scale", p.noise_scale, step=step, note="std of the noise start")
        yield Row("same_tol", same_tol, step=step, unit="relative",
                  note="" if p.same_tol is not None else f"{SAME_FACTOR:g} x tol")  # fmt: skip
        yield Row("tol", table.attrs["tol"], step=step,
                  note=f"the cell's solver {table.attrs['solver']}")  # fmt: skip

    def _verdict(
        self, s: dict[str, Any], ctx: CellContext, step: int, classification: bool, same_tol: float
    ) -> Row:
        p = self.params
        model, ref, valid = model_name(ctx), s["reference"], s["valid"]
        if not s["same"] or valid == 0:
            return Row.skipped("depends_on_z0", "no sample converged from every start",
                               variant="all", step=step)  # fmt: skip
        starts = ", ".join(
            (f"noise {p.noise_scale:g}" if st == "noise" else st) for st in [ref, *s["same"]]
            if st != "all"
        )  # fmt: skip
        same = s["same"]["all"]
        if classification:
            k = round(s["changed"]["all"] * valid)
            depends = k > 0
            what = f"{k} of {valid} samples change prediction across starts ({starts})"
        else:
            depends = s["out_max"]["all"] > same_tol
            what = f"outputs differ by up to {s['out_max']['all']:.3g} (relative) across starts ({starts})"
        head = "predictions depend on z0" if depends else "predictions do not depend on z0"
        note = (f"model {model}: {head}: {what}; same fixed point for {same:.1%} "
                f"(within {same_tol:g})")  # fmt: skip
        return Row("depends_on_z0", float(depends), variant="all", step=step, note=note)

    @classmethod
    def plot(cls, df: Any, run_dir: Any) -> dict[str, Any]:
        from .plots import path_independence_figure

        fig = path_independence_figure(df, run_dir)
        return {} if fig is None else {"path_independence": fig}

    @classmethod
    def headline(cls, rows: Any) -> list[str]:
        """The verdict row's note (it names the model), at the last step measured."""
        d = rows[(rows["metric"] == "depends_on_z0") & (rows["status"] == "ok")]
        if d.empty:
            return []
        return [str(d[d["step"] == d["step"].max()]["note"].iloc[0])]
