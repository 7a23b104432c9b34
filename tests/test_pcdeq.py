"""pcDEQ: nonnegativity by projection, unique fixed point, plain iteration beyond ||W|| = 1,
architectures (paper parameter counts), sigma_max, and the family_stats analysis (the
projection keeps W >= 0 while training; the paper's claims are judged by deqbench.reproduce)."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

import deqbench
from deqbench.deq import CellMap
from deqbench.errors import ConfigError
from deqbench.spectral import conv_norm_fft, dense_norm

torch.set_num_threads(1)

ACTS = ["tanh", "softsign", "relu6", "sigmoid"]


def _set_weight(cell, W: torch.Tensor) -> None:
    """Set a pcDEQ cell's weight-normed W exactly (v = W, g = row norms)."""
    with torch.no_grad():
        cell.v.copy_(W)
        cell.g.copy_(torch.linalg.vector_norm(W.flatten(1), dim=1))


def _solve(cell, u, z0, tol=1e-12, max_iter=500):
    return deqbench.solvers.get("fixed_point")(CellMap(cell, u), z0, max_iter=max_iter, tol=tol)


@pytest.mark.parametrize("name", ["pcdeq_l_tiny", "pcdeq_mc_tiny"])
def test_weights_stay_nonnegative_after_training_steps(name):
    from deqbench.data.base import load_data
    from deqbench.run.train import TrainConfig, train

    data = load_data("digits", train_subset=96, test_subset=32)
    cfg = TrainConfig(epochs=1, batch_size=32, optimizer="sgd", lr=0.5, eval_before=False)
    for nonneg in (True, False):
        torch.manual_seed(0)
        model = deqbench.models.create(name, activation="softsign", nonneg=nonneg)
        res = train(model, data, cfg)
        assert res.status == "ok"
        wmin = min(float(layer.cell.weight().detach().min()) for layer in model.pc_layers())
        if nonneg:
            for layer in model.pc_layers():
                assert float(layer.cell.v.detach().min()) >= 0
                assert float(layer.cell.g.detach().min()) >= 0
            assert wmin >= 0
            assert model.spectral_quantities()["weight_min"] >= 0
        else:  # the control: the same steps do make entries negative (so the test has teeth)
            assert wmin < 0


@pytest.mark.parametrize("act", ACTS)
def test_unique_fixed_point_from_different_starts(act):
    torch.manual_seed(1)
    model = deqbench.models.create("pcdeq_l_tiny", activation=act).double().eval()
    cell = model.deq.cell
    W = torch.rand(16, 16, dtype=torch.float64)
    _set_weight(cell, 3.0 * W / dense_norm(W))  # ||W|| = 3 > 1
    assert cell.sigma_max() == pytest.approx(3.0)
    with torch.no_grad():
        u = model.inject(torch.rand(6, 64, dtype=torch.float64))
    assert float(u.min()) >= 0
    starts = [torch.zeros_like(u), 5 * torch.rand_like(u), torch.full_like(u, 10.0)]
    sols = []
    for z0 in starts:
        z, st = _solve(cell, u, z0)
        assert st.converged, (act, st.status, st.rel_max)
        sols.append(z)
    for z in sols[1:]:
        assert torch.allclose(z, sols[0], atol=1e-6)
    # conv layer too
    conv = deqbench.models.create("pcdeq_sc_tiny", activation=act).double().eval()
    ccell = conv.deq.cell
    K = torch.rand(ccell.v.shape, dtype=torch.float64)
    _set_weight(ccell, 2.0 * K / dense_norm(K.sum(dim=(2, 3))))
    with torch.no_grad():
        cu = conv.inject(torch.rand(3, 1, 8, 8, dtype=torch.float64))
    za, sa = _solve(ccell, cu, torch.zeros_like(cu))
    zb, sb = _solve(ccell, cu, 4 * torch.rand_like(cu))
    assert sa.converged and sb.converged
    assert torch.allclose(za, zb, atol=1e-6)


def test_plain_iteration_converges_beyond_norm_one_where_tanh_deq_does_not():
    torch.manual_seed(2)
    pc = deqbench.models.create("pcdeq_l_tiny", activation="tanh").double().eval()
    W = torch.rand(16, 16, dtype=torch.float64)
    W = 5.0 * W / dense_norm(W)
    _set_weight(pc.deq.cell, W)
    x = torch.rand(8, 64, dtype=torch.float64)
    with torch.no_grad():
        u = pc.inject(x)
    z, st = _solve(pc.deq.cell, u, torch.zeros_like(u), tol=1e-4, max_iter=200)
    assert st.status == "converged" and st.nstep < 200
    # a generic tanh DEQ with a weight of the same norm (sign flipped, so not >= 0) oscillates
    generic = deqbench.models.create("fc_deq_tiny", width=16).double().eval()
    with torch.no_grad():
        generic.deq.cell.W.weight.copy_(-W)
        ug = generic.inject(x)
    assert dense_norm(generic.deq.cell.W.weight) == pytest.approx(5.0)
    zg, sg = _solve(generic.deq.cell, ug, torch.zeros_like(ug), tol=1e-4, max_iter=200)
    assert not sg.converged and sg.status in ("max_iter", "diverged")


def test_architectures_defaults_and_validation():
    counts = {"pcdeq_l": 70_410, "pcdeq_sc": 69_136, "pcdeq_mc": 41_278}  # paper: 70K, 69K, 41K
    for name, n in counts.items():
        model = deqbench.models.create(name)
        assert sum(p.numel() for p in model.parameters()) == n
        assert model.deq.solver_cfg.name == "fixed_point"
        assert (model.deq.solver_cfg.max_iter, model.deq.solver_cfg.tol) == (200, 1e-4)
        assert model.deq.backward_cfg.solver == "fixed_point"
    assert deqbench.models.create("pcdeq_l_tiny", activation="sigmoid").variant == 2
    assert deqbench.models.create("pcdeq_l_tiny", variant=1).activation == "tanh"
    with pytest.raises(ConfigError, match="pcDEQ-2 needs activation"):
        deqbench.models.create("pcdeq_l_tiny", variant=2, activation="tanh")
    with pytest.raises(ConfigError, match="variant must be 1 or 2"):
        deqbench.models.create("pcdeq_l_tiny", variant=3)
    for name in ("pcdeq_l", "pcdeq_sc", "pcdeq_mc"):
        assert f"{name}_tiny" in deqbench.models.names()
    # MC: forward == readout(deq(inject)); resize inside the model == upsampled data
    torch.manual_seed(3)
    mc = deqbench.models.create("pcdeq_mc_tiny", in_shape=(1, 8, 8), resize=12).eval()
    ref = deqbench.models.create("pcdeq_mc_tiny", in_shape=(1, 12, 12)).eval()
    ref.load_state_dict(mc.state_dict())
    x = torch.rand(4, 1, 8, 8)
    up = torch.nn.functional.interpolate(x, size=(12, 12), mode="bilinear", align_corners=False)
    with torch.no_grad():
        out = mc(x)
        assert torch.allclose(out, ref(up), atol=1e-6)
        u = mc.inject(x)
        assert torch.allclose(mc.readout(mc.deq(u)), out, atol=1e-6)
    assert len(mc.pc_layers()) == 3


def test_sigma_max_of_nonnegative_conv_is_summed_taps():
    torch.manual_seed(4)
    cell = deqbench.models.create("pcdeq_sc_tiny").deq.cell
    K = torch.rand(cell.v.shape)
    _set_weight(cell, K)
    exact_circular = conv_norm_fft(cell.weight(), 8)
    assert cell.sigma_max() == pytest.approx(exact_circular, rel=1e-6)
    with torch.no_grad():
        cell.v[0, 0, 0, 0] = -1.0  # negative tap: falls back to the circular FFT norm
    assert cell.sigma_max() == pytest.approx(conv_norm_fft(cell.weight(), 8), rel=1e-9)


def test_family_stats_rows_and_projection_while_training():
    from deqbench.analyses.base import CellContext
    from deqbench.data.base import load_data
    from deqbench.run.train import TrainConfig, train
    from deqbench.training.family_stats import FamilyStats

    data = load_data("digits", train_subset=128, test_subset=64)
    records = []
    for cid, nonneg in (("pc", True), ("ctrl", False)):
        torch.manual_seed(0)
        model = deqbench.models.create("pcdeq_mc_tiny", activation="sigmoid", nonneg=nonneg)
        ctx = CellContext(model, data, "cpu", torch.float32, 0, cid, {})
        fs = FamilyStats()
        rows = list(fs.before_training(ctx))

        def emit(_a, produced, rows=rows):
            rows.extend(produced)

        res = train(
            model,
            data,
            TrainConfig(epochs=3, batch_size=64, lr=3e-3),
            ctx=ctx,
            callbacks=[fs],
            emit=emit,
        )
        assert res.status == "ok"
        records += [
            {
                "cell_id": cid,
                "seed": 0,
                "analysis": "family_stats",
                "variant": r.variant,
                "metric": r.metric,
                "step": r.step,
                "value": r.value,
                "status": r.status,
                "note": r.note,
            }
            for r in rows
        ]
        records.append(
            {
                "cell_id": cid,
                "seed": 0,
                "analysis": "runner",
                "variant": "",
                "metric": "wall_time",
                "step": None,
                "value": 1.0,
                "status": "ok",
                "note": "",
            }
        )
    df = pd.DataFrame(records)
    pc = df[(df.cell_id == "pc")]
    got = set(zip(pc.metric, pc.variant))
    for key in [
        ("sigma_max", "layer0"),
        ("sigma_max", "layer2"),
        ("sigma_max", "max"),
        ("forward_nstep", ""),
        ("forward_nstep", "layer1"),
        ("backward_nstep", "layer2"),
        ("test_accuracy", ""),
        ("nonneg_constraint", ""),
        ("weight_min", ""),
    ]:
        assert key in got, key
    assert set(pc[pc.metric == "forward_nstep"].step.dropna().astype(int)) == {1, 2, 3}
    # mechanisms, not paper claims: the projection keeps W >= 0 in every epoch (the control's
    # W goes negative), and no solve of the pcDEQ failed
    flag = df[df.metric == "nonneg_constraint"].groupby("cell_id")["value"].max()
    assert flag["pc"] == 1.0 and flag["ctrl"] == 0.0
    wmin = df[df.metric == "weight_min"].groupby("cell_id")["value"].min()
    assert wmin["pc"] >= 0.0 and wmin["ctrl"] < 0.0
    for metric in ("forward_not_converged", "forward_diverged", "backward_not_converged"):
        assert pc[pc.metric == metric]["value"].sum() == 0, metric
