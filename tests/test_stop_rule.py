"""Stop rules (solver option ``stop``): the reduction over the batch that decides convergence.

``sample_max`` (default) keeps today's iterates and stats; ``batch_fro`` and ``batch_mean`` stop
earlier on a batch with one slow sample and are judged (solver, verdict, tallies) under their
rule; solvers and paths that cannot honour a rule refuse it in one line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from deqbench import solvers
from deqbench.core.verdict import check_claim, recheck, solve_ledger, verify_solves
from deqbench.deq import DEQLayer, SolverConfig
from deqbench.errors import ConfigError
from deqbench.run.console import RULE
from deqbench.run.runner import stop_rules
from deqbench.run.solves import SolveTally, rule_note
from deqbench.run.suite import suite_from_dict
from deqbench.solvers import fused
from deqbench.solvers.base import STOP_RULES, SolverOptionError, Tracker
from deqbench.solvers.fixed_point import FixedPointOptions

DT = torch.float64
GRAPH_SOLVERS = ("fixed_point", "anderson", "broyden")


def _slow_batch(B: int = 8, D: int = 5, slow: float = 0.95, fast: float = 0.2, seed: int = 0):
    """f(z)_i = A_i z_i + b_i with ||A_i||_2 = c_i (a scaled orthogonal matrix: every step
    shrinks the error by exactly c_i) and unit-norm fixed points; sample 3 is slow (c = slow)."""
    g = torch.Generator().manual_seed(seed)
    Q = torch.linalg.qr(torch.randn(B, D, D, generator=g, dtype=DT))[0]
    c = torch.full((B,), fast, dtype=DT)
    c[3] = slow
    A = Q * c[:, None, None]
    zs = torch.randn(B, D, generator=g, dtype=DT)
    zs = zs / zs.norm(dim=1, keepdim=True)
    b = zs - torch.einsum("bij,bj->bi", A, zs)  # z* = A z* + b

    def f(z: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bij,bj->bi", A, z) + b

    return f, torch.zeros(B, D, dtype=DT)


def _same(a, b) -> None:
    za, sa = a
    zb, sb = b
    assert torch.equal(za, zb)
    assert (sa.nstep, sa.converged, sa.status, sa.lowest_step) == (
        sb.nstep,
        sb.converged,
        sb.status,
        sb.lowest_step,
    )
    for k in ("abs_residual", "rel_residual", "abs_trace", "rel_trace"):
        assert torch.equal(getattr(sa, k), getattr(sb, k)), k


@pytest.mark.parametrize("name", GRAPH_SOLVERS)
@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("returns", ["lowest", "last"])
def test_sample_max_is_the_default_with_identical_iterates(name, graph, returns):
    f, z0 = _slow_batch()
    kw = dict(max_iter=300, tol=1e-6, returns=returns, cuda_graph=graph)
    default = solvers.get(name)(f, z0, **kw)
    explicit = solvers.get(name)(f, z0, stop="sample_max", **kw)
    _same(default, explicit)
    assert default[1].stop == explicit[1].stop == "sample_max"
    # under sample_max, stop_residual is the batch max of the per-sample residual
    assert explicit[1].stop_residual == float(explicit[1].rel_residual.max())


def test_sample_max_stops_at_the_first_iterate_whose_largest_residual_is_below_tol():
    """Independent of the tracker: plain iteration by hand, the first z_k whose max per-sample
    relative residual is below tol; fixed_point makes k + 1 evaluations and returns z_k."""
    f, z0 = _slow_batch()
    tol = 1e-6
    z, k = z0, 0
    while True:
        fz = f(z)
        rel = (fz - z).norm(dim=1) / (fz.norm(dim=1) + 1e-9)
        if rel.max() < tol:
            break
        z, k = fz, k + 1
    zr, st = solvers.get("fixed_point")(f, z0, max_iter=500, tol=tol, stop="sample_max")
    assert st.nstep == k + 1 and st.converged
    assert torch.equal(zr, z)


@pytest.mark.parametrize("rule", ["batch_fro", "batch_mean"])
def test_batch_rules_stop_before_sample_max_on_one_slow_sample(rule):
    f, z0 = _slow_batch()
    tol = 1e-6
    _, ref = solvers.get("fixed_point")(f, z0, max_iter=500, tol=tol)
    _, st = solvers.get("fixed_point")(f, z0, max_iter=500, tol=tol, stop=rule)
    assert st.stop == rule and st.converged and st.status == "converged"
    assert st.stop_residual < tol
    # the slow sample has not met tol: sample_max would not call this converged ...
    assert float(st.rel_residual.max()) > tol
    # ... and it needs many more steps (each step shrinks the slow sample by 0.95 only)
    assert ref.converged and ref.nstep >= st.nstep + 10
    # sample_max with the batch rule's budget misses
    _, cut = solvers.get("fixed_point")(f, z0, max_iter=st.nstep, tol=tol)
    assert not cut.converged and cut.status == "max_iter"


@pytest.mark.parametrize("name", ["anderson", "broyden", "newton_krylov", "sam", "reversible"])
@pytest.mark.parametrize("rule", ["batch_fro", "batch_mean"])
def test_other_solvers_honour_batch_rules_through_the_tracker(name, rule):
    f, z0 = _slow_batch(slow=0.9)
    tol = 1e-6
    _, ref = solvers.get(name)(f, z0, max_iter=400, tol=tol)
    _, st = solvers.get(name)(f, z0, max_iter=400, tol=tol, stop=rule)
    assert st.stop == rule
    assert st.nstep <= ref.nstep
    if st.converged:
        assert st.stop_residual < tol


@pytest.mark.parametrize("stop_mode", ["rel", "abs"])
@pytest.mark.parametrize("returns", ["lowest", "last"])
def test_batch_fro_equals_a_dense_frobenius_computation(stop_mode, returns):
    f, z0 = _slow_batch()
    tol = 1e-6
    z, st = solvers.get("fixed_point")(
        f, z0, max_iter=500, tol=tol, stop_mode=stop_mode, stop="batch_fro", returns=returns
    )
    fz = f(z)
    num = torch.linalg.matrix_norm(fz - z)  # Frobenius over the whole batch
    dense = num / (torch.linalg.matrix_norm(fz) + 1e-9) if stop_mode == "rel" else num
    assert st.stop_residual == pytest.approx(float(dense), rel=1e-10)
    assert st.converged and float(dense) < tol
    # the paper's successive-difference form: plain iteration stops at the first k with
    # ||z_{k+1} - z_k||_F / ||z_{k+1}||_F < tol (k + 1 evaluations, z_k returned)
    if stop_mode == "rel":
        zk, k = z0, 0
        while True:
            z1 = f(zk)
            if torch.linalg.matrix_norm(z1 - zk) / (torch.linalg.matrix_norm(z1) + 1e-9) < tol:
                break
            zk, k = z1, k + 1
        assert st.nstep == k + 1
        assert torch.equal(z, zk)


def test_batch_mean_is_the_mean_of_the_per_sample_residual():
    f, z0 = _slow_batch()
    z, st = solvers.get("fixed_point")(f, z0, max_iter=500, tol=1e-6, stop="batch_mean")
    fz = f(z)
    rel = (fz - z).norm(dim=1) / (fz.norm(dim=1) + 1e-9)
    assert st.stop_residual == pytest.approx(float(rel.mean()), rel=1e-10)


@pytest.mark.parametrize("name", GRAPH_SOLVERS)
@pytest.mark.parametrize("rule", STOP_RULES)
def test_static_path_makes_the_eager_iterates_under_each_rule_on_cpu(name, rule):
    f, z0 = _slow_batch(slow=0.9)
    kw = dict(max_iter=300, tol=1e-6, stop=rule)
    _same(solvers.get(name)(f, z0, **kw), solvers.get(name)(f, z0, cuda_graph=True, **kw))


def test_unknown_rule_is_an_error():
    f, z0 = _slow_batch()
    for name in ("fixed_point", "anderson", "broyden"):
        with pytest.raises(SolverOptionError, match="stop must be .*got 'batch_max'"):
            solvers.get(name)(f, z0, stop="batch_max")


def test_a_solver_without_the_option_refuses_a_batch_rule_and_takes_sample_max():
    f, z0 = _slow_batch()
    fb = solvers.get("forward_backward")
    with pytest.raises(SolverOptionError) as exc:
        fb(f, z0, stop="batch_fro")
    msg = str(exc.value)
    assert "'batch_fro'" in msg and "'forward_backward'" in msg and "\n" not in msg
    # sample_max is its own rule: accepted (the call fails later for another reason: f is
    # not a monotone-operator cell)
    with pytest.raises(ConfigError, match="monotone"):
        fb(f, z0, stop="sample_max")


def test_the_fused_record_kernels_refuse_a_batch_rule():
    z0 = torch.zeros(4, 3)
    tr = Tracker(
        "fixed_point", z0, max_iter=5, tol=1e-3, stop_mode="rel",
        common=FixedPointOptions(stop="batch_mean"),
    )  # fmt: skip
    assert not fused.tracker_usable(tr, z0, z0)
    with pytest.raises(SolverOptionError, match="'batch_mean'.*fused") as exc:
        fused.record(tr, z0, z0)
    assert "\n" not in str(exc.value)
    with pytest.raises(SolverOptionError, match="'batch_mean'.*fused"):
        fused.record_eager(tr, z0, z0, 0)
    ok = Tracker("fixed_point", z0, max_iter=5, tol=1e-3, stop_mode="rel",
                 common=FixedPointOptions())  # fmt: skip
    fused.check_stop_rule(ok)  # sample_max: the kernels' own rule


def test_the_verdict_judges_under_the_declared_rule():
    f, z0 = _slow_batch()
    tol = 1e-6
    z, st = solvers.get("fixed_point")(f, z0, max_iter=500, tol=tol, stop="batch_mean")
    check_claim(st, tol, "rel", "fixed_point")
    recheck(st, f(z), z)
    assert st.converged and "claim" not in st.extra
    assert st.extra["verified_residual"] == pytest.approx(st.stop_residual, rel=1e-10)
    # declared sample_max: the same solve is rejected (its slow sample is above tol)
    _, st2 = solvers.get("fixed_point")(f, z0, max_iter=500, tol=tol, stop="batch_mean")
    check_claim(st2, tol, "rel", "fixed_point", stop="sample_max")
    assert not st2.converged and "reported converged" in st2.extra["claim"]


class _Cell(nn.Module):
    """z -> A_i z + u with a slow sample (the layer's cell: f(z, u))."""

    def __init__(self) -> None:
        super().__init__()
        self.f, _ = _slow_batch()

    def forward(self, z, u):
        return self.f(z) + u


@pytest.mark.parametrize("rule", ["batch_fro", "batch_mean"])
def test_a_layer_solve_is_verified_recorded_and_tallied_under_its_rule(rule):
    cell = _Cell()
    u, z0 = torch.zeros(8, 5, dtype=DT), torch.zeros(8, 5, dtype=DT)
    # the rule's own budget: enough for it, not for sample_max
    budget = solvers.get("fixed_point")(cell.f, z0, max_iter=500, tol=1e-6, stop=rule)[1].nstep
    led_rec = []
    for stop in ("sample_max", rule):
        cfg = SolverConfig("fixed_point", max_iter=budget, tol=1e-6, options={"stop": stop})
        layer = DEQLayer(cell, cfg)
        with solve_ledger() as led, verify_solves():
            layer.solve(u, z0)
        led_rec.append(led.records[0])
    plain, ruled = led_rec
    assert plain.stop == "sample_max" and not plain.converged  # the slow sample misses
    assert ruled.stop == rule and ruled.converged and ruled.verified and ruled.residual < 1e-6
    tally = SolveTally("forward")
    tally.add_record(ruled)
    tally.add_record(plain)
    tally.stop = rule
    assert f"stop rule {rule}" in tally.note()
    # the summary reads the rule from the tally rows' notes (missed or not)
    assert RULE.findall(tally.note()) == [rule, rule] and RULE.findall(rule_note(rule)) == [rule]
    assert rule_note("sample_max") == ""


def test_suite_solver_block_takes_stop_and_checks_it():
    raw = {
        "name": "d",
        "device": "cpu",
        "data": "digits",
        "defaults": {"model": "fc_deq_tiny", "solver": {"name": "anderson", "stop": "batch_fro"}},
        "analyses": ["metrics"],
    }
    s = suite_from_dict(raw)
    assert s.cells[0].solver["stop"] == "batch_fro"
    assert s.cells[0].solver_config().options["stop"] == "batch_fro"
    # run.json's record of what judged each cell
    assert stop_rules(s.cells) == {
        s.cells[0].id: {"tol": s.cells[0].solver["tol"], "stop_mode": "rel", "stop": "batch_fro"}
    }
    raw["defaults"]["solver"]["stop"] = "batch_max"
    with pytest.raises(ConfigError, match="stop"):
        suite_from_dict(raw)
    # a solver without the option: its own rule is accepted, another refused before any run
    raw["defaults"] = {
        "model": "mondeq_fc",
        "solver": {"name": "forward_backward", "stop": "sample_max"},
        "backward": "ift",
    }
    suite_from_dict(raw)
    raw["defaults"]["solver"]["stop"] = "batch_mean"
    with pytest.raises(ConfigError, match="'batch_mean' is not supported by solver 'forward_"):
        suite_from_dict(raw)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", GRAPH_SOLVERS)
@pytest.mark.parametrize("rule", STOP_RULES)
def test_graph_path_makes_the_eager_iterates_under_each_rule_on_cuda(name, rule):
    g = torch.Generator(device="cuda").manual_seed(0)
    B, D = 8, 64
    Q = torch.linalg.qr(torch.randn(B, D, D, generator=g, device="cuda"))[0]
    c = torch.full((B,), 0.2, device="cuda")
    c[3] = 0.9
    A = Q * c[:, None, None]
    b = torch.randn(B, D, generator=g, device="cuda")

    def f(z):
        return torch.einsum("bij,bj->bi", A, z) + b

    z0 = torch.zeros(B, D, device="cuda")
    kw = dict(max_iter=200, tol=1e-5, stop=rule, graph_steps=1, check_every=1)
    ze, se = solvers.get(name)(f, z0, **kw)
    zg, sg = solvers.get(name)(f, z0, cuda_graph=True, **kw)
    assert sg.path == "graph" and se.path == "eager"
    assert sg.stop == se.stop == rule and se.converged and sg.converged
    assert sg.stop_residual < 1e-5 and se.stop_residual < 1e-5
    # the same iteration (float32 rounding, e.g. Anderson's static ring, may move the crossing
    # by a step)
    assert abs(sg.nstep - se.nstep) <= 1
    torch.testing.assert_close(zg, ze, rtol=1e-3, atol=1e-4)


def test_solver_stats_notes_a_non_default_rule_on_its_converged_rows():
    from deqbench import models
    from deqbench.core import deq
    from deqbench.deq import BackwardConfig
    from deqbench.performance.solver_stats import stop_rule_notes

    model = models.create("fc_deq_tiny")
    assert stop_rule_notes(model) == {}  # the default rule: no note
    deq.configure(model, SolverConfig(options={"stop": "batch_fro"}), BackwardConfig())
    assert stop_rule_notes(model) == {"forward_converged": "stop rule batch_fro"}
