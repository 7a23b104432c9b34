"""Path independence against constructed cases: a contraction (one fixed point: every
start lands on it, 100%) and a per-coordinate bistable map z -> tanh(3 z) + u (two attracting
fixed points per coordinate; the start decides the basin), whose fixed points, basins, fractions
and spreads are computed here independently (bisection, iteration to rounding level, the
monotone map's basin rule) and compared with the plain functions and the analysis's rows."""

from __future__ import annotations

import math
import statistics

import pandas as pd
import pytest
import torch
from torch import nn

from deqbench.analyses.base import CellContext
from deqbench.convergence._common import batches_of
from deqbench.convergence.path_independence import noise_draw, path_table, summarize
from deqbench.core.config import SolverConfig
from deqbench.core.deq import DEQLayer, DEQModel
from deqbench.core.registry import analyses
from deqbench.data.base import DataBundle

D, C = 3, 3  # state size, classes
TOL = 1e-11  # the solves' relative-residual tolerance (float64)


class MapCell(nn.Module):
    def __init__(self, kind: str, W: torch.Tensor | None = None) -> None:
        super().__init__()
        self.kind = kind
        self.register_buffer("W", W if W is not None else torch.zeros(D, D, dtype=torch.float64))

    def forward(self, z, u):
        if self.kind == "bistable":  # per coordinate: two stable fixed points near +-0.995
            return torch.tanh(3 * z) + u
        return 0.5 * torch.tanh(z @ self.W.T) + u  # ||W|| <= 1: a contraction (factor 0.5)


class MapDEQ(DEQModel):
    def __init__(self, kind: str, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        W = torch.randn(D, D, generator=g, dtype=torch.float64)
        W /= torch.linalg.matrix_norm(W, 2)
        self.deq = DEQLayer(MapCell(kind, W), SolverConfig("fixed_point", max_iter=2000, tol=TOL))
        self.register_buffer("R", torch.randn(D, C, generator=g, dtype=torch.float64))
        self.scale = 0.05 if kind == "bistable" else 1.0

    def inject(self, x):
        return self.scale * x

    def readout(self, z):
        return z @ self.R


def inputs(n: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return 2 * torch.rand(n, D, generator=g, dtype=torch.float64) - 1


# -- the bistable map, independently -------------------------------------------------------------


def _unstable(c: float) -> float:
    """The middle (repelling) root of tanh(3z) + c - z in [-0.5, 0.5], by bisection."""
    lo, hi = -0.5, 0.5  # h(lo) < 0 < h(hi) for |c| <= 0.05; the only root there
    for _ in range(200):
        mid = (lo + hi) / 2
        if math.tanh(3 * mid) + c - mid < 0:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _stable(c: float, sign: float) -> float:
    z = sign
    for _ in range(200):  # contraction factor ~0.03 near +-0.995: rounding level long before
        z = math.tanh(3 * z) + c
    return z


def bistable_fixed_point(c: torch.Tensor, z0: torch.Tensor) -> torch.Tensor:
    """Where plain iteration of the monotone map from z0 ends, per coordinate: the upper stable
    fixed point when z0 is above the repelling one, else the lower."""
    out = torch.empty_like(c)
    for i, (ci, zi) in enumerate(zip(c.flatten().tolist(), z0.flatten().tolist())):
        up = zi > _unstable(ci)
        out.view(-1)[i] = _stable(ci, 1.0 if up else -1.0)
    return out


def expected(model: MapDEQ, X: torch.Tensor, starts: dict[str, list[torch.Tensor]], bs: int):
    """Per start, the fixed points and outputs of every sample (batch order), computed above."""
    c = model.scale * X
    nb = X.shape[0] // bs
    z = {}
    ref = [bistable_fixed_point(c[b * bs : (b + 1) * bs], starts["zeros"][b]) for b in range(nb)]
    z["zeros"] = torch.cat(ref)
    if "noise" in starts:
        z["noise"] = torch.cat([bistable_fixed_point(c[b * bs : (b + 1) * bs], starts["noise"][b])
                                for b in range(nb)])  # fmt: skip
    z["previous"] = torch.cat([bistable_fixed_point(c[b * bs : (b + 1) * bs], ref[(b - 1) % nb])
                               for b in range(nb)])  # fmt: skip
    return z, {k: v @ model.R for k, v in z.items()}


def rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(a - b, dim=1) / torch.linalg.vector_norm(b, dim=1)


def check_against(s: dict, z: dict, out: dict, same_tol: float) -> None:
    others = [k for k in z if k != "zeros"]
    dz = {k: rel(z[k], z["zeros"]) for k in others}
    do = {k: rel(out[k], out["zeros"]) for k in others}
    ch = {k: out[k].argmax(1) != out["zeros"].argmax(1) for k in others}
    dz["all"] = torch.stack([dz[k] for k in others]).max(0).values
    do["all"] = torch.stack([do[k] for k in others]).max(0).values
    ch["all"] = torch.stack([ch[k] for k in others]).any(0)
    for k in [*others, "all"]:
        assert s["same"][k] == pytest.approx(float((dz[k] <= same_tol).double().mean()), abs=0)
        assert s["z_max"][k] == pytest.approx(float(dz[k].max()), rel=1e-8, abs=1e-9)
        med = statistics.median(dz[k].tolist())
        assert s["z_median"][k] == pytest.approx(med, rel=1e-8, abs=1e-9)
        assert s["out_max"][k] == pytest.approx(float(do[k].max()), rel=1e-8, abs=1e-9)
        assert s["changed"][k] == pytest.approx(float(ch[k].double().mean()), abs=0)


def test_bistable_map_fraction_and_spread_as_computed_independently():
    model = MapDEQ("bistable")
    X = inputs(64)
    bs, scale, seed = 16, 0.1, 7
    table = path_table(model, X, starts=["zeros", "noise", "previous"], noise_scale=scale,
                       batch_size=bs, seed=seed)  # fmt: skip
    assert bool(table["converged"].all())
    gen = torch.Generator().manual_seed(seed)
    like = torch.zeros(bs, D, dtype=torch.float64)
    noise = [noise_draw(gen, like, scale) for _ in range(4)]
    zeros = [torch.zeros(bs, D, dtype=torch.float64)] * 4
    z, out = expected(model, X, {"zeros": zeros, "noise": noise}, bs)
    s = summarize(table, same_tol=1e-6)
    assert s["samples"] == s["valid"] == 64
    check_against(s, z, out, 1e-6)
    # the case is what it claims: some samples keep their fixed point, some do not
    assert 0.05 < s["same"]["noise"] < 0.95 and 0 < s["same"]["all"] < s["same"]["noise"]
    assert s["z_max"]["all"] > 0.5  # another basin: far, not within tolerance
    assert 0 < s["changed"]["all"] < 1
    # and a z* within tolerance of the analytic one (so distances 0 really are "same")
    zs = torch.tensor(table[table.start == "noise"].sort_values("sample")["z_distance"].values)
    assert bool((zs[(rel(z["noise"], z["zeros"]) == 0)] < 1e-9).all())


def test_contraction_is_path_independent():
    model = MapDEQ("contraction")
    X = inputs(48)
    table = path_table(model, X, starts=["zeros", "noise", "previous"], noise_scale=3.0,
                       batch_size=16, seed=0)  # fmt: skip
    s = summarize(table, same_tol=1e-6)
    assert s["valid"] == 48
    assert s["same"] == {"noise": 1.0, "previous": 1.0, "all": 1.0}
    assert s["changed"]["all"] == 0.0
    assert s["z_max"]["all"] < 1e-9 and s["out_max"]["all"] < 1e-9
    assert s["z_max"]["noise"] > 0  # the solves did start elsewhere


def _ctx(model: MapDEQ, X: torch.Tensor, y: torch.Tensor, name: str) -> CellContext:
    data = DataBundle(name, (X, y), (X, y), (D,), C)
    cell = {"model": {"name": name}, "train": {"epochs": 0, "batch_size": 16}}
    return CellContext(model, data, torch.device("cpu"), torch.float64, 0, name, cell)


def test_analysis_rows_on_the_bistable_map_and_the_contraction():
    X = inputs(64)
    y = torch.zeros(64, dtype=torch.long)
    cls = analyses.get("path_independence")
    params = {"samples": 64, "batch_size": 16, "noise_scale": 0.1, "same_tol": 1e-6}
    # the bistable map: rows against the independent computation, on the analysis's batches
    model = MapDEQ("bistable")
    ctx = _ctx(model, X, y, "bistable_map")
    rows = {(r.metric, r.variant): r for r in cls(params).after_training(ctx)}
    data, _ = batches_of(ctx, "test", 16, 4)
    Xp = torch.cat([x for x, _ in data])
    gen = torch.Generator().manual_seed(ctx.seed)
    noise = [noise_draw(gen, torch.zeros(16, D, dtype=torch.float64), 0.1) for _ in range(4)]
    zeros = [torch.zeros(16, D, dtype=torch.float64)] * 4
    z, out = expected(model, Xp, {"zeros": zeros, "noise": noise}, 16)
    s = {k: {} for k in ("same", "z_max", "z_median", "out_max", "changed")}
    for (metric, variant), r in rows.items():
        key = {"same_fixed_point": "same", "z_distance_max": "z_max", "output_distance_max":
               "out_max", "prediction_changed": "changed"}.get(metric)  # fmt: skip
        if key:
            s[key][variant] = r.value
    s["z_median"] = {k: rows[("z_distance_median", k)].value for k in s["same"]}
    check_against(s, z, out, 1e-6)
    verdict = rows[("depends_on_z0", "all")]
    assert verdict.value == 1.0 and verdict.note.startswith("model bistable_map: predictions "
                                                            "depend on z0")  # fmt: skip
    assert rows[("unconverged", "all")].value == 0.0 and rows[("samples", "")].value == 64
    assert cls.headline(pd.DataFrame([{**vars(r), "step": r.step} for r in rows.values()])) == [
        verdict.note
    ]
    # the contraction: 100%, nothing depends on z0
    ctx = _ctx(MapDEQ("contraction"), X, y, "contraction_map")
    rows = {
        (r.metric, r.variant): r for r in cls({**params, "noise_scale": 3.0}).after_training(ctx)
    }
    for v in ("noise", "previous", "all"):
        assert rows[("same_fixed_point", v)].value == 1.0
        assert rows[("prediction_changed", v)].value == 0.0
    assert rows[("depends_on_z0", "all")].value == 0.0
    assert "contraction_map: predictions do not depend on z0" in rows[("depends_on_z0", "all")].note


def test_unconverged_samples_are_counted_and_left_out():
    """A budget too small for some samples: they are counted, left out of the fractions, and
    the row is flagged (never silently used)."""
    model = MapDEQ("bistable")
    model.deq.configure(SolverConfig("fixed_point", max_iter=12, tol=TOL))
    X = inputs(64)
    y = torch.zeros(64, dtype=torch.long)
    rows = analyses.get("path_independence")(
        {"samples": 64, "batch_size": 16, "noise_scale": 0.1, "same_tol": 1e-6}
    ).after_training(_ctx(model, X, y, "bistable_map"))
    rows = {(r.metric, r.variant): r for r in rows}
    left = rows[("unconverged", "all")]
    assert 0 < left.value < 1 and left.status == "flagged" and "left out" in left.note
    n_valid = round((1 - left.value) * 64)
    assert f"over {n_valid} of 64 samples" in rows[("same_fixed_point", "all")].note
