"""Loss landscape: filter normalisation, name-keyed reusable directions, exact centre, bit-exact
restoration, unconverged points marked, the analysis and the CLI through the runner."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

import deqbench
from deqbench import landscape as ls
from deqbench.deq import SolverConfig, configure
from deqbench.errors import ConfigError

torch.set_num_threads(1)


def _fc_deq(max_iter=100, tol=1e-10, scale=0.5):
    torch.manual_seed(0)
    m = deqbench.models.create("fc_deq_tiny", in_shape=(4,), width=8, num_outputs=3).double()
    configure(m, SolverConfig("fixed_point", max_iter=max_iter, tol=tol))
    with torch.no_grad():
        W = m.deq.cell.W.weight
        W.mul_(scale / torch.linalg.matrix_norm(W, 2))
    return m


def _data(n=32, d=4, k=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=torch.float64), torch.randint(
        0, k, (n,), generator=g
    )


def _snapshot(m):
    return {k: v.detach().clone() for k, v in m.state_dict(keep_vars=True).items()}


def test_filter_normalisation_and_zero_biases():
    torch.manual_seed(0)
    m = deqbench.models.create("conv_deq_tiny").double()
    dirs = ls.random_directions(m, 2, seed=3)
    weights = dict(m.named_parameters())
    seen_conv = seen_1d = 0
    for d in dirs.normalized:
        for name, w in weights.items():
            if w.dim() <= 1:
                assert torch.count_nonzero(d[name]) == 0, name  # biases / norm layers: zero
                seen_1d += 1
            else:
                dn = d[name].reshape(w.shape[0], -1).norm(dim=1)
                wn = w.detach().reshape(w.shape[0], -1).norm(dim=1)
                torch.testing.assert_close(dn, wn, rtol=1e-8, atol=1e-12)
                seen_conv += w.dim() == 4
    assert seen_conv > 0 and seen_1d > 0
    inc = ls.random_directions(m, 1, seed=3, include_1d=True).normalized[0]
    for name, w in weights.items():
        if w.dim() <= 1:
            assert torch.equal(inc[name], w.detach())  # Li et al. without biasbn: d = w
    with pytest.raises(ConfigError, match="unknown normalisation"):
        ls.random_directions(m, 1, norm="filters")


class _Reordered(nn.Module):
    """Same parameter names and shapes as a 2-layer MLP, registered in the opposite order."""

    def __init__(self):
        super().__init__()
        self.b = nn.Linear(6, 3)
        self.a = nn.Linear(4, 6)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class _Ordered(_Reordered):
    def __init__(self):
        nn.Module.__init__(self)
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 3)


def test_directions_keyed_by_name_and_reusable(tmp_path):
    torch.manual_seed(0)
    m1, m2 = _Ordered().double(), _Reordered().double()
    m2.load_state_dict(m1.state_dict())
    assert [n for n, _ in m1.named_parameters()] != [n for n, _ in m2.named_parameters()]
    d1, d2 = ls.random_directions(m1, 2, seed=7), ls.random_directions(m2, 2, seed=7)
    for a, b in zip(d1.raw, d2.raw):
        assert all(torch.equal(a[k], b[k]) for k in a)  # the draw depends on the name only
    path = ls.save_directions(d1, tmp_path / "plane.pt")
    loaded = ls.load_directions(path)
    assert loaded.meta["seed"] == 7 and loaded.meta["norm"] == "filter"
    r1, r2 = ls.resolve_directions(m1, d1), ls.resolve_directions(m2, loaded)
    for a, b in zip(r1, r2):
        assert all(torch.equal(a[k], b[k]) for k in a)
    X, y = _data()
    ax = ls.axis(3)
    g1 = ls.evaluate_grid(m1, r1, X, y, alphas=ax, betas=ax)
    g2 = ls.evaluate_grid(m2, r2, X, y, alphas=ax, betas=ax)
    pd.testing.assert_frame_equal(g1, g2)
    # A different model: names must match.
    other = nn.Sequential(nn.Linear(4, 3)).double()
    with pytest.raises(ConfigError, match="keyed by name"):
        ls.resolve_directions(other, loaded)
    with pytest.raises(ConfigError, match="not found"):
        ls.load_directions(tmp_path / "missing.pt")


def test_centre_is_unperturbed_loss_and_parameters_restored():
    m = _fc_deq()
    m.train()
    X, y = _data()
    before = _snapshot(m)
    dirs = ls.resolve_directions(m, ls.random_directions(m, 2, seed=0))
    ax = ls.axis(5)
    assert ax[2] == 0.0 and len(ax) == 5
    df = ls.evaluate_grid(m, dirs, X, y, alphas=ax, betas=ax, batch_size=16)
    after = _snapshot(m)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)  # bit-exact
    assert m.training  # mode restored
    centre = df[(df.alpha == 0.0) & (df.beta == 0.0)].iloc[0]
    m.eval()
    with torch.no_grad():
        direct = (
            sum(
                float(nn.functional.cross_entropy(m(X[i : i + 16]), y[i : i + 16]).double()) * 16
                for i in (0, 16)
            )
            / 32
        )
    assert centre["loss"] == direct
    from deqbench.core.evaluation import evaluate

    assert math.isclose(centre["loss"], evaluate(m, X, y, "classification")["loss"], rel_tol=1e-12)
    assert len(df) == 25 and df["converged"].all()
    assert (df["f_nstep"] > 0).all() and (df["f_residual"] < 1e-10).all()
    assert df["w_spec_norm"].notna().all()
    assert df.loc[(df.alpha == 0) & (df.beta == 0), "w_spec_norm"].iloc[0] == pytest.approx(
        0.5, rel=1e-9
    )
    s = ls.summarize(df)
    assert s["loss_center"] == direct and s["nonconverged_points"] == 0


def test_vmap_path_matches_loop_for_explicit_model():
    torch.manual_seed(0)
    m = deqbench.models.create(
        "tied_repeat_tiny", cell="fc", in_shape=(4,), num_outputs=3, repeats=3
    ).double()
    X, y = _data()
    before = _snapshot(m)
    dirs = ls.resolve_directions(m, ls.random_directions(m, 2, seed=1))
    ax = ls.axis(3, -0.5, 0.5)
    loop = ls.evaluate_grid(m, dirs, X, y, alphas=ax, betas=ax, points_per_batch=1)
    vm = ls.evaluate_grid(m, dirs, X, y, alphas=ax, betas=ax, points_per_batch=4)
    assert vm.attrs["vmap"] and not loop.attrs["vmap"]
    torch.testing.assert_close(
        torch.tensor(vm["loss"].values), torch.tensor(loop["loss"].values), rtol=1e-12, atol=0
    )
    assert (vm["accuracy"] == loop["accuracy"]).all()
    assert all(torch.equal(before[k], v) for k, v in _snapshot(m).items())
    assert vm["f_nstep"].isna().all() and (vm["status"] == "ok").all()


def test_nonconverged_points_are_marked_not_averaged():
    m = _fc_deq(max_iter=4, tol=1e-12, scale=0.9)
    X, y = _data()
    dirs = ls.resolve_directions(m, ls.random_directions(m, 1, seed=0))
    df = ls.evaluate_grid(m, dirs, X, y, alphas=ls.axis(3))
    assert "beta" not in df
    assert (~df["converged"].astype(bool)).all() and (df["status"] == "max_iter").all()
    assert df["loss"].isna().all() and df["loss_raw"].notna().all()
    s = ls.summarize(df)
    assert s["nonconverged_points"] == 3 and "loss_max" not in s and "mean_loss_increase" not in s
    assert "mean_loss_increase_all" not in s  # never averaged in by default
    assert "forward solver did not converge at the trained weights" in ls.centre_note(df)
    # raw=True: the *_all forms use every point at its measured loss, relative to the centre's
    s = ls.summarize(df, raw=True)
    centre = float(df.loc[df.alpha == 0.0, "loss_raw"].iloc[0])
    inc = df["loss_raw"] - centre
    assert s["mean_loss_increase_all"] == pytest.approx(float(inc.mean()), rel=1e-12)
    assert s["low_loss_area_frac_all"] == pytest.approx(float((inc <= 0.5).mean()), rel=1e-12)
    assert 0.0 <= s["converged_examples_frac_mean"] < 1.0
    from deqbench.landscape import plots as pa

    fig = pa.landscape_curves(df)
    assert any(len(c.get_offsets()) == 3 for ax in fig.axes for c in ax.collections)  # red crosses


def _edge_unconverged_grid(grid=7):
    """A contractive centre (||W|| = 0.5, converged) whose far points (||W|| > 1) miss the
    tolerance within the budget."""
    m = _fc_deq(max_iter=40, tol=1e-8, scale=0.5)
    X, y = _data()
    dirs = ls.resolve_directions(m, ls.random_directions(m, 2, seed=0))
    ax = ls.axis(grid, -4.0, 4.0)
    return m, ls.evaluate_grid(m, dirs, X, y, alphas=ax, betas=ax)


def test_offcentre_nonconverged_points_are_data_not_statistics():
    _, df = _edge_unconverged_grid()
    bad = ~df["converged"].astype(bool)
    good = df[~bad]
    assert 0 < bad.sum() < len(df) - 1  # some off-centre points missed the tolerance
    centre = df[(df.alpha == 0.0) & (df.beta == 0.0)].iloc[0]
    assert bool(centre["converged"])
    s = ls.summarize(df, level=0.5)
    inc = good["loss"] - centre["loss_raw"]
    assert s["nonconverged_points"] == bad.sum()
    assert s["mean_loss_increase"] == pytest.approx(float(inc.mean()), rel=1e-12)
    assert s["low_loss_area_frac"] == pytest.approx(float((inc <= 0.5).mean()), rel=1e-12)
    assert s["loss_max"] == pytest.approx(float(good["loss"].max()), rel=1e-12)
    assert s["converged_frac"] == pytest.approx(len(good) / len(df))
    assert ls.centre_note(df) == ""  # off-centre misses are not a failure
    raw = df.loc[bad, "loss_raw"]
    assert raw.notna().all() and s["loss_max"] != pytest.approx(float(df["loss_raw"].max()))

    # the curves: the line runs through the converged points only (it breaks at the others,
    # NaN), and the red crosses sit exactly on the unconverged points at their measured loss
    from deqbench.landscape import plots as pa

    fig = pa.landscape_curves(df)
    for axis_, (coord, cut) in zip(
        fig.axes, [("alpha", df[df.beta == 0.0]), ("beta", df[df.alpha == 0.0])]
    ):
        cut = cut.sort_values(coord)
        (line,) = axis_.get_lines()
        ydata = line.get_ydata().astype(float)
        conv = cut["converged"].astype(bool).to_numpy()
        assert np.isnan(ydata[~conv]).all() and np.isfinite(ydata[conv]).all()
        xs = sorted(tuple(o) for c in axis_.collections for o in c.get_offsets())
        want = sorted(zip(cut.loc[~conv, coord], cut.loc[~conv, "loss_raw"]))
        assert np.allclose(xs, want) if want else not xs
    cuts = pd.concat([df[df.beta == 0.0], df[df.alpha == 0.0]])
    assert (~cuts["converged"].astype(bool)).any()  # the curves do have points to leave out
    # the surface and contours draw without error and carry a title beyond the cell id
    for fig in (pa.landscape_surfaces(df), pa.landscape_contours(df)):
        assert "filter-normalised" in fig.get_suptitle()
    surf = pa.landscape_surfaces(df)
    assert surf.axes[0].get_zlabel() == "loss (cross-entropy)"


def test_starved_centre_flags_the_rows(tmp_path):
    from deqbench.analyses.base import CellContext
    from deqbench.data.base import DataBundle
    from deqbench.landscape.analysis import Landscape

    m = _fc_deq(max_iter=2, tol=1e-6, scale=0.9)  # two f-evals cannot reach 1e-6
    X, y = _data(48)
    data = DataBundle("toy", (X, y), (X[:8], y[:8]), (4,), 3)
    ctx = CellContext(m, data, torch.device("cpu"), torch.float64, 0, "cell", {}, tmp_path)
    rows = list(Landscape({"grid": 3, "max_samples": 32, "progress": False}).after_training(ctx))
    value_rows = [r for r in rows if not r.metric.startswith("seconds")]
    assert value_rows and all(r.status == "flagged" for r in value_rows)
    note = value_rows[0].note
    assert "\n" not in note and "did not converge at the trained weights" in note
    assert "> 1e-06" in note and "--max-iter" in note
    # the same model with a budget that converges at the centre: ok
    m2 = _fc_deq(max_iter=200, tol=1e-6, scale=0.9)
    ctx.model = m2
    rows = list(Landscape({"grid": 3, "max_samples": 32, "progress": False}).after_training(ctx))
    assert all(r.status == "ok" for r in rows)


def test_convergence_not_measured_is_nan_not_zero(tmp_path):
    from deqbench.analyses.base import CellContext
    from deqbench.data.base import DataBundle
    from deqbench.landscape.analysis import Landscape

    m = _Ordered().double()  # no DEQ layer: nothing reports a solve
    X, y = _data(16)
    df = ls.evaluate_grid(m, ls.resolve_directions(m, ls.random_directions(m, 1)), X, y,
                          alphas=ls.axis(3))  # fmt: skip
    assert df["converged"].isna().all() and df["loss"].notna().all()
    s = ls.summarize(df)
    assert math.isnan(s["nonconverged_points"]) and "mean_loss_increase" in s
    data = DataBundle("toy", (X, y), (X[:8], y[:8]), (4,), 3)
    ctx = CellContext(m, data, torch.device("cpu"), torch.float64, 0, "c", {}, tmp_path)
    rows = {r.metric: r for r in Landscape({"grid": 3, "progress": False}).after_training(ctx)}
    r = rows["nonconverged_points"]
    assert math.isnan(r.value) and r.status == "skipped" and "not measured" in r.note
    assert rows["loss_center"].status == "ok"
    from deqbench.landscape import plots as pa

    assert "not measured" in pa.landscape_curves(df).get_suptitle()


def test_warm_start_same_fixed_point_for_a_contraction():
    m = _fc_deq(max_iter=200, tol=1e-10, scale=0.5)
    X, y = _data()
    dirs = ls.resolve_directions(m, ls.random_directions(m, 2, seed=0))
    ax = ls.axis(3, -0.3, 0.3)
    cold = ls.evaluate_grid(m, dirs, X, y, alphas=ax, betas=ax, warm_start="off")
    warm = ls.evaluate_grid(m, dirs, X, y, alphas=ax, betas=ax, warm_start=True, batch_size=16)
    assert warm.attrs["warm_start"] == "centre" and cold.attrs["warm_start"] == "off"
    assert (cold["init"] == "model").all()
    assert (warm["init"] == "centre").sum() == 8 and ls.centre_row(warm)["init"] == "model"
    assert warm["converged"].all() and cold["converged"].all()
    np.testing.assert_allclose(warm["loss"], cold["loss"], rtol=1e-8)  # unique fixed point
    assert warm["f_nstep"].sum() < cold["f_nstep"].sum()
    assert ls.centre_row(warm)["loss"] == pytest.approx(ls.centre_row(cold)["loss"], rel=1e-12)
    # the evaluation budget override is applied during the evaluation only
    starved = ls.evaluate_grid(m, dirs, X, y, alphas=ax, betas=ax, max_iter=2)
    assert (starved["f_nstep"] <= 2).all() and not starved["converged"].astype(bool).any()
    assert all(layer.solver_cfg.max_iter == 200 for layer in deqbench.deq.deq_layers(m))


def test_landscape_analysis_hook_and_directions_file(tmp_path):
    from deqbench.analyses.base import CellContext
    from deqbench.data.base import DataBundle
    from deqbench.landscape.analysis import Landscape

    m = _fc_deq()
    X, y = _data(48)
    data = DataBundle("toy", (X, y), (X[:8], y[:8]), (4,), 3)
    ctx = CellContext(m, data, torch.device("cpu"), torch.float64, 0, "cell", {}, tmp_path)
    rows = list(Landscape({"grid": 3, "max_samples": 32, "progress": False}).after_training(ctx))
    got = {r.metric: r.value for r in rows}
    assert got["points"] == 9 and got["nonconverged_points"] == 0 and "loss_center" in got
    series = tmp_path / "series" / "landscape__cell__seed0.csv"
    dfile = tmp_path / "artifacts" / "landscape_directions__cell__seed0.pt"
    assert series.exists() and dfile.exists()
    first = pd.read_csv(series)
    list(
        Landscape(
            {"grid": 3, "max_samples": 32, "directions": str(dfile), "seed": 99, "progress": False}
        ).after_training(ctx)
    )
    pd.testing.assert_frame_equal(first, pd.read_csv(series))
    with pytest.raises(ValueError, match="odd"):
        Landscape({"grid": 4})
    with pytest.raises(ConfigError, match="odd"):
        ls.landscape(m, X, y, grid=4)  # the library call too: theta* must be a grid point

    # an explicit norm / include_1d overrides the file's own settings (and the note says so)
    orig = ls.load_directions(dfile)
    explicit = Landscape(
        {"grid": 3, "max_samples": 32, "directions": str(dfile), "progress": False,
         "norm": "layer", "include_1d": True}
    )  # fmt: skip
    rows = list(explicit.after_training(ctx))
    assert "norm=layer ignore=none" in next(r.note for r in rows if r.metric == "loss_center")
    other = pd.read_csv(series)
    assert not other["loss"].equals(first["loss"])
    want = ls.resolve_directions(m, orig, norm="layer", include_1d=True)
    got_default = ls.resolve_directions(m, orig)
    assert any(not torch.equal(want[0][n], got_default[0][n]) for n in want[0])
    saved = ls.load_directions(dfile)  # the run's artifact records what was used
    assert saved.meta["norm"] == "layer" and saved.meta["include_1d"] is True
    with pytest.raises(ValueError, match="renormalize: true"):
        Landscape({"directions": str(dfile), "renormalize": False, "norm": "layer"})

    # a missing or mismatched directions file fails before training, not after it
    with pytest.raises(ConfigError, match="not found"):
        list(Landscape({"directions": str(tmp_path / "nope.pt")}).before_training(ctx))
    wide = deqbench.models.create("fc_deq_tiny", in_shape=(4,), width=9, num_outputs=3).double()
    wctx = CellContext(wide, data, torch.device("cpu"), torch.float64, 0, "w", {}, tmp_path)
    with pytest.raises(ConfigError, match="shape of"):
        list(Landscape({"directions": str(dfile)}).before_training(wctx))


def test_landscape_command_through_runner(tmp_path):
    from typer.testing import CliRunner

    from deqbench.cli import app

    res = CliRunner().invoke(app, ["landscape", "--help"])
    assert res.exit_code == 0 and "deqbench landscape" in res.output
    ckpt = tmp_path / "ckpt.pt"
    torch.manual_seed(0)
    net = deqbench.models.create("fc_deq_tiny", in_shape=(1, 8, 8), num_outputs=10, width=8)
    torch.save(net.state_dict(), ckpt)
    args = [
        "landscape",
        "--model",
        "fc_deq_tiny",
        "--set",
        "defaults.model.width=8",
        "--checkpoint",
        str(ckpt),
        "--grid",
        "3",
        "--max-samples",
        "32",
        "--train-subset",
        "64",
        "--device",
        "cpu",
        "--out",
        str(tmp_path),
        "--no-progress",
        "--solver",
        "fixed_point",
        "--max-iter",
        "30",
        "--tol",
        "1e-4",
        "--set",
        "threads=1",
    ]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    run = next((tmp_path / "landscape").iterdir())
    df = deqbench.load_results(run)
    lrows = df[df.analysis == "landscape"]
    assert set(lrows.metric) >= {"loss_center", "points", "nonconverged_points", "seconds"}
    assert list((run / "series").glob("landscape__*.csv"))
    assert (run / "plots" / "landscape_contours.png").exists() and (
        run / "plots" / "landscape_curves.png"
    ).exists()
    # the loaded checkpoint is the centre
    from deqbench.data.base import load_data

    centre = float(lrows[lrows.metric == "loss_center"].value.iloc[0])
    configure(net, SolverConfig("fixed_point", max_iter=30, tol=1e-4))
    X, y = load_data("digits", train_subset=64).train
    net.eval()
    with torch.no_grad():
        expect = float(nn.functional.cross_entropy(net(X[:32]), y[:32]))
    assert centre == pytest.approx(expect, rel=1e-5)

    # a starved budget: the centre misses its tolerance -> flagged rows, exit 1, one-line cause
    starved = [*args[: args.index("--max-iter") + 1], "2", *args[args.index("--max-iter") + 2 :]]
    starved[starved.index("--out") + 1] = str(tmp_path / "starved")
    res = CliRunner().invoke(app, starved)
    assert res.exit_code != 0, res.output
    assert "did not converge at the trained weights" in res.output
    run = next((tmp_path / "starved" / "landscape").iterdir())
    lrows = deqbench.load_results(run).query("analysis == 'landscape'")
    assert (lrows[~lrows.metric.str.startswith("seconds")].status == "flagged").all()


def test_library_call_takes_the_directions_settings_unless_given(tmp_path):
    m = _fc_deq()
    X, y = _data(16)
    df0, dirs = ls.landscape(m, X, y, grid=3, dims=1, norm="filter")
    path = ls.save_directions(dirs, tmp_path / "d.pt")
    same, _ = ls.landscape(m, X, y, grid=3, dims=1, directions=path)
    pd.testing.assert_frame_equal(same.drop(columns="seconds", errors="ignore"),
                                  df0.drop(columns="seconds", errors="ignore"))  # fmt: skip
    other, _ = ls.landscape(m, X, y, grid=3, dims=1, directions=path, include_1d=True)
    assert not other["loss"].equals(df0["loss"])
    with pytest.raises(ConfigError, match="renormalize=True"):
        ls.landscape(m, X, y, grid=3, dims=1, directions=path, norm="layer", renormalize=False)


# -- warm starts from solved neighbours ---------------------------------------------


def _is_neighbour(p, q):
    return p != q and max(abs(p[0] - q[0]), abs(p[1] - q[1])) == 1


@pytest.mark.parametrize(
    ("na", "nb", "start"), [(7, 7, (3, 3)), (5, 4, (0, 3)), (6, 1, (2, 0)), (1, 5, (0, 1))]
)
def test_visit_order_has_the_neighbour_property(na, nb, start):
    order = ls.visit_order(na, nb, start)
    points = [pt for pt, _ in order]
    assert sorted(points) == sorted((i, j) for i in range(na) for j in range(nb))
    assert order[0] == (start, [])
    seen = {}
    for v, (pt, src) in enumerate(order):
        if v:
            assert src, pt  # every point but the start has a solved neighbour
            assert src[0][0] == pt[0] or src[0][1] == pt[1]  # the first is an axis neighbour
        for q in src:
            assert q in seen and _is_neighbour(pt, q), (pt, q)
        for combo in ls.warm_candidates(pt, start, src):
            assert all(q in seen and max(abs(q[0] - pt[0]), abs(q[1] - pt[1])) <= 2
                       for q, _ in combo)  # fmt: skip
            assert sum(w for _, w in combo) == pytest.approx(1.0)  # predictors are affine
        seen[pt] = v
    # the fixed points kept at once: at most three rows (the start row waits for the rows below)
    last = {}
    for v, (pt, src) in enumerate(order):
        for combo in ls.warm_candidates(pt, start, src):
            for q, _ in combo:
                last[q] = v
    alive = max(sum(1 for q, u in last.items() if seen[q] <= v <= u) for v in range(len(order)))
    assert alive <= 3 * na


def test_warm_start_values():
    from deqbench.landscape.analysis import Landscape

    assert Landscape.Params().warm_start == "off"  # the default: every point as the model runs
    for given, want in [(True, "centre"), (False, "off"), ("neighbor", "neighbour"),
                        ("center", "centre"), ("nearest", "nearest"), ("off", "off")]:  # fmt: skip
        assert Landscape.Params(warm_start=given).warm_start == want
        assert ls.warm_start_mode(given) == want
    with pytest.raises(ValueError, match="warm_start"):
        Landscape.Params(warm_start="neighbours")
    with pytest.raises(ConfigError, match="warm_start"):
        ls.warm_start_mode("ring")


def _rel(a, b):
    return float(((a - b).abs() / b.abs()).max())


@pytest.mark.parametrize("mode", ["neighbour", "nearest"])
def test_neighbour_warm_start_equals_cold_for_a_contraction(mode):
    """A contractive cell (||W|| <= 0.8 over the plane) has one fixed point: warm-started points
    land on the cold ones to within what the tolerance allows (|dz| <= tol |f| / (1 - L) per
    example), every point converges, and with fewer f-evaluations."""
    m = _fc_deq(max_iter=300, tol=1e-10, scale=0.5)
    X, y = _data(24)
    dirs = ls.resolve_directions(m, ls.random_directions(m, 2, seed=0))
    ax = ls.axis(9, -0.8, 0.8)
    cold = ls.evaluate_grid(m, dirs, X, y, alphas=ax, betas=ax, warm_start="off")
    warm = ls.evaluate_grid(m, dirs, X, y, alphas=ax, betas=ax, warm_start=mode, batch_size=16)
    assert (cold["w_spec_norm"] < 0.9).all()
    assert warm.attrs["warm_start"] == mode and cold.attrs["warm_start"] == "off"
    assert cold["converged"].all() and warm["converged"].all()
    assert _rel(warm["loss"], cold["loss"]) <= 1e-8
    assert (warm["accuracy"] == cold["accuracy"]).all()
    # the centre is solved cold (here in two evaluation batches: its own stop per batch)
    assert ls.centre_row(warm)["loss"] == pytest.approx(ls.centre_row(cold)["loss"], rel=1e-9)
    assert ls.centre_row(warm)["init"] == "model" and (warm["init"] == mode).sum() == len(warm) - 1
    assert (warm["warm_frac"] == 1.0).sum() == len(warm) - 1
    assert (warm["predicted_frac"] > 0).any() == (mode == "neighbour")
    assert warm["f_nstep"].sum() < cold["f_nstep"].sum()
    assert (warm["f_nstep"] <= cold["f_nstep"]).mean() > 0.9
    # where a point starts from: an already solved grid neighbour
    nb = warm.dropna(subset=["init_alpha"])
    step = ax[1] - ax[0]
    assert len(nb) == len(warm) - 1
    assert ((nb["init_alpha"] - nb["alpha"]).abs().max() <= step + 1e-12) and (
        (nb["init_beta"] - nb["beta"]).abs().max() <= step + 1e-12
    )


def test_neighbour_warm_start_conv_cell_and_1d_slice():
    """The same on a conv cell (4-D states, GroupNorm) in float64 and on a 1-D slice of
    directions that perturb biases and norm layers too (include_1d)."""
    torch.manual_seed(0)
    m = deqbench.models.create("conv_deq_tiny").double().eval()
    configure(m, SolverConfig("anderson", max_iter=100, tol=1e-9))
    g = torch.Generator().manual_seed(2)
    X = torch.randn(6, 1, 8, 8, generator=g, dtype=torch.float64)
    y = torch.randint(0, 10, (6,), generator=g)
    dirs = ls.resolve_directions(m, ls.random_directions(m, 2, seed=0))
    ax = ls.axis(5, -0.2, 0.2)
    cold = ls.evaluate_grid(m, dirs, X, y, alphas=ax, betas=ax, warm_start="off")
    warm = ls.evaluate_grid(m, dirs, X, y, alphas=ax, betas=ax, warm_start="neighbour")
    assert warm.attrs["warm_start"] == "neighbour"
    assert cold["converged"].all()
    assert warm["converged"].all()  # every cold-converged point converges warm
    assert _rel(warm["loss"], cold["loss"]) <= 1e-6
    assert warm["f_nstep"].sum() < cold["f_nstep"].sum()
    d1 = ls.resolve_directions(m, ls.random_directions(m, 1, seed=1, include_1d=True))
    assert any(torch.count_nonzero(d1[0][n]) for n, p in m.named_parameters() if p.dim() == 1)
    ax1 = ls.axis(7, -0.3, 0.3)
    cold1 = ls.evaluate_grid(m, d1, X, y, alphas=ax1, warm_start="off")
    warm1 = ls.evaluate_grid(m, d1, X, y, alphas=ax1, warm_start="neighbour")
    assert "beta" not in warm1 and "init_beta" not in warm1
    assert cold1["converged"].all() and warm1["converged"].all()
    assert _rel(warm1["loss"], cold1["loss"]) <= 1e-6
    assert warm1["f_nstep"].sum() < cold1["f_nstep"].sum()
    # every point starts from the one next to it toward the centre
    nb = warm1.dropna(subset=["init_alpha"]).set_index("alpha")["init_alpha"]
    assert len(nb) == 6 and all(abs(src) < abs(a) for a, src in nb.items())


def test_example_unconverged_at_the_neighbour_starts_cold(monkeypatch):
    """Per example: an example whose neighbour did not converge for it starts from the model's
    own initial state; the others from the neighbour's fixed point."""
    X, y = _data(32)
    for max_iter in range(2, 60):  # a budget at which the centre converges for some examples
        m = _fc_deq(max_iter=max_iter, tol=1e-8, scale=0.95)
        m.eval()
        with torch.no_grad():
            m(X)
        frac = m.deq.last_forward_stats.converged_frac
        if 0.2 < frac < 0.8:
            break
    else:
        pytest.fail("no budget with a partly converged centre")
    layer = m.deq
    calls = []
    solve = layer.solve

    def spy(u, z0, cfg=None):
        z, st = solve(u, z0, cfg)
        calls.append((z0.clone(), z.clone(), (st.residual < st.tol).clone()))
        return z, st

    monkeypatch.setattr(layer, "solve", spy, raising=False)
    dirs = ls.resolve_directions(m, ls.random_directions(m, 1, seed=0))
    ax = ls.axis(3, -0.01, 0.01)
    df = ls.evaluate_grid(
        m, dirs, X, y, alphas=ax, spec_norm=False, warm_retry=False, warm_start="neighbour"
    )
    assert len(calls) == 3  # centre, then +h and -h, each from the centre
    z0c, zc, okc = calls[0]
    assert torch.count_nonzero(z0c) == 0  # fc_deq_tiny starts from zeros
    assert 0 < int(okc.sum()) < len(okc)
    for z0, _, _ in calls[1:]:
        assert torch.equal(z0[okc], zc[okc])  # converged at the centre: its fixed point
        assert torch.count_nonzero(z0[~okc]) == 0  # not converged there: cold
    off = df[df.alpha != 0.0]
    assert (off["init"] == "partial").all()
    assert off["warm_frac"].tolist() == pytest.approx([float(okc.double().mean())] * 2)
    assert ls.centre_row(df)["init"] == "model"


def test_warm_point_that_misses_the_tolerance_is_solved_again_cold():
    """A non-contractive plane (far points miss the tolerance in the budget): every point that
    converges cold converges warm, because a warm-started miss is re-solved from the model's
    own start (f_nstep then counts both solves); without the retry it is left as it is."""
    m = _fc_deq(max_iter=40, tol=1e-8, scale=0.5)
    X, y = _data()
    dirs = ls.resolve_directions(m, ls.random_directions(m, 2, seed=0))
    ax = ls.axis(7, -4.0, 4.0)
    cold = ls.evaluate_grid(m, dirs, X, y, alphas=ax, betas=ax, warm_start="off")
    warm = ls.evaluate_grid(m, dirs, X, y, alphas=ax, betas=ax)
    raw = ls.evaluate_grid(m, dirs, X, y, alphas=ax, betas=ax, warm_retry=False)
    c, w = cold["converged"].astype(bool), warm["converged"].astype(bool)
    assert 0 < c.sum() < len(c) and not (c & ~w).any()
    again = warm["warm_retried"].astype(bool)
    assert not raw["warm_retried"].astype(bool).any()
    assert (again == (~raw["converged"].astype(bool) & (raw["warm_frac"] > 0))).all()
    if again.any():  # the retried rows are the cold solves, with both solves' f-evaluations
        r = warm[again]
        assert (r["init"] == "model").all() and (r["warm_frac"] == 0).all()
        np.testing.assert_allclose(r["loss_raw"], cold.loss_raw[again], rtol=1e-12)
        np.testing.assert_allclose(
            r["f_nstep"], cold.f_nstep[again] + raw.f_nstep[again], rtol=1e-12
        )
    both = c & w
    assert _rel(warm.loss[both], cold.loss[both]) <= 1e-6
