"""deqbench.adapters: measuring a network's own fixed-point loop (track_loop, OwnLoop)
and making a deqbench cell from a method of a whole network (cell_from_method), each against an
independent reference."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import deqbench
from deqbench.adapters import OwnLoop, cell_from_method, track_loop
from deqbench.core import own_solves
from deqbench.core.errors import ConfigError
from deqbench.deq import BackwardConfig, DEQLayer, DEQModel, SolverConfig, own_solve_stats
from deqbench.models import declare_defaults
from deqbench.run.plugin_checks import check_all


class LoopNet(nn.Module):
    """A third-party network: stem -> its own damped Picard loop on ``f`` (under no_grad) ->
    one step with gradient (Jacobian-free backward) -> head. Records what its loop saw, by hand,
    for reference."""

    def __init__(self, d=5, n=6, k=3, max_iter=60, tol=1e-5, damping=1.0, scale=0.5):
        super().__init__()
        self.stem, self.lin, self.head = nn.Linear(d, n), nn.Linear(n, n), nn.Linear(n, k)
        self.max_iter, self.tol, self.damping, self.scale = max_iter, tol, damping, scale
        self.n = n
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []  # (z, f(z)) per loop call

    def f(self, z, x):
        return torch.tanh(self.scale * self.lin(z) + x)

    @torch.no_grad()
    def solve(self, x):
        self.seen = []
        z = torch.zeros(x.shape[0], self.n, dtype=x.dtype)
        for _ in range(self.max_iter):
            fz = self.f(z, x)
            self.seen.append((z.clone(), fz.clone()))
            d = (fz - z).norm(dim=1) / fz.norm(dim=1)
            if bool((d < self.tol).all()):
                break
            z = (1 - self.damping) * z + self.damping * fz
        return z

    def forward(self, x):
        u = self.stem(x)
        z = self.solve(u)
        return self.head(self.f(z.detach(), u))


def _by_hand(seen, tol):
    """The reference: traces of every iterate the loop evaluated, the returned one's residual."""
    rows = [deqbench.solvers.base.residuals(fz, z) for z, fz in seen]
    abs_tr = torch.stack([a for a, _ in rows])
    rel_tr = torch.stack([r for _, r in rows])
    return abs_tr, rel_tr


@pytest.mark.parametrize("rule", [{"loop": "solve"}, {"after": 1}, {}])
def test_stats_equal_those_computed_by_hand(rule):
    torch.manual_seed(0)
    net = LoopNet().double()
    model = OwnLoop(net, map="f", tol="tol", max_iter="max_iter", solver_name="picard", **rule)
    x = torch.randn(3, 5, dtype=torch.float64)
    model(x).sum().backward()  # with gradient: the JFB step is not an iteration in any rule
    st = model.last_solve_stats()
    abs_tr, rel_tr = _by_hand(net.seen, net.tol)
    assert st.nstep == len(net.seen) < net.max_iter
    torch.testing.assert_close(st.abs_trace, abs_tr)
    torch.testing.assert_close(st.rel_trace, rel_tr)
    # the loop breaks on z with f(z) close: it returns z, the last iterate it evaluated
    torch.testing.assert_close(st.rel_residual, rel_tr[-1])
    torch.testing.assert_close(st.abs_residual, abs_tr[-1])
    assert st.converged and st.status == "converged" and bool((rel_tr[-1] < net.tol).all())
    assert st.tol == net.tol and st.stop_mode == "rel" and st.extra["max_iter"] == net.max_iter
    assert st.extra["map_calls"] == st.nstep + 1
    assert st.lowest_step in (-1, st.nstep - 1)


def test_a_loop_that_does_not_converge_is_reported_max_iter():
    torch.manual_seed(0)
    net = LoopNet(max_iter=4, tol=1e-12).double()
    model = OwnLoop(net, map="f", tol="tol", max_iter="max_iter", loop="solve")
    x = torch.randn(2, 5, dtype=torch.float64)
    with torch.no_grad():
        model(x)
    st = model.last_solve_stats()
    abs_tr, rel_tr = _by_hand(net.seen, net.tol)
    assert st.nstep == 4 and tuple(st.rel_trace.shape) == (4, 2)
    torch.testing.assert_close(st.rel_trace, rel_tr)
    assert not st.converged and st.status == "max_iter"
    # the loop updated z after its last test: the returned iterate is z_4 = f(z_3), which the JFB
    # step evaluates; its residual is not the last trace row
    with torch.no_grad():
        u, z_ret = net.stem(x), net.seen[-1][1]
        a, r = deqbench.solvers.base.residuals(net.f(z_ret, u), z_ret)
    assert st.extra["returned"] == "input of the call after the loop"
    torch.testing.assert_close(st.rel_residual, r)
    torch.testing.assert_close(st.abs_residual, a)
    assert not torch.equal(st.rel_residual, rel_tr[-1])


def test_the_count_rules_in_training_and_evaluation():
    torch.manual_seed(0)
    net = LoopNet().double()
    x = torch.randn(2, 5, dtype=torch.float64)
    counts = {}
    for rule in ({"loop": "solve"}, {"after": 1}, {}):
        model = OwnLoop(net, map="f", tol="tol", **rule)
        model(x)
        with torch.no_grad():
            model(x)
        key = next(iter(rule), "no_grad")
        counts[key] = (model.last_solve_stats().nstep, len(net.seen))
    n = len(net.seen)
    assert counts["loop"] == (n, n) and counts["after"] == (n, n)
    # without gradient anywhere, the default rule counts the step after the loop too
    assert counts["no_grad"] == (n + 1, n)


def test_a_loop_returning_an_iterate_no_call_evaluated_gets_one_check_evaluation():
    class Returns(LoopNet):
        @torch.no_grad()
        def solve(self, x):
            z = torch.zeros(x.shape[0], self.n, dtype=x.dtype)
            for _ in range(self.max_iter):
                z = self.f(z, x)
            return 0.5 * z  # evaluated nowhere

        def forward(self, x):
            return self.head(self.solve(self.stem(x)))

    torch.manual_seed(0)
    net = Returns(max_iter=7).double()
    model = OwnLoop(net, map="f", tol=1e-3, max_iter=7, loop="solve")
    x = torch.randn(2, 5, dtype=torch.float64)
    with torch.no_grad():
        model(x)
        st = model.last_solve_stats()
        u = net.stem(x)
        z_ret = net.solve(u)
        a, r = deqbench.solvers.base.residuals(net.f(z_ret, u), z_ret)
    assert st.nstep == 7 and st.extra["check_evals"] == 1
    torch.testing.assert_close(st.rel_residual, r)
    torch.testing.assert_close(st.abs_residual, a)
    assert not st.converged and st.status == "max_iter"


def test_the_stats_reach_deqbench_through_the_own_solver_hook(tmp_path):
    torch.manual_seed(0)
    model = OwnLoop(LoopNet(), map="f", tol="tol", max_iter="max_iter", loop="solve",
                    solver_name="picard", backward_name="jfb")  # fmt: skip
    assert model.last_solve_stats() is None
    model(torch.randn(2, 5))
    fw, bw = own_solve_stats(model)
    assert fw is not None and bw is None and fw.solver == "own:picard" and fw.converged
    assert own_solves.labels(model) == ("own:picard", "own:jfb")
    assert set(n for n, _ in model.named_parameters()) == {
        f"net.{m}.{p}" for m in ("stem", "lin", "head") for p in ("weight", "bias")
    }
    # a registered model built on it passes validate's checks
    import math

    @declare_defaults(own_solver="picard", own_backward="jfb")
    def own_loop_net(in_shape=(64,), num_outputs=10):
        net = LoopNet(d=math.prod(in_shape), k=num_outputs)
        return OwnLoop(net, map="f", tol="tol", max_iter="max_iter", loop="solve",
                       solver_name="picard", backward_name="jfb")  # fmt: skip

    from conftest import write_suite

    deqbench.models.add("own_loop_net", own_loop_net)
    try:
        p = write_suite(
            tmp_path,
            "schema: 1\nname: own\ndevice: cpu\nseeds: [0]\n"
            "data: {name: digits, flatten: true, train_subset: 32, test_subset: 16}\n"
            "defaults:\n  model: {name: own_loop_net}\n  train: {epochs: 1, batch_size: 16}\n"
            "analyses: [metrics]\noutput: results\n",
        )
        assert [v.line() for v in check_all([deqbench.load_suite(p)])] == []
    finally:
        deqbench.models.remove("own_loop_net")


def test_bad_names_and_maps_are_config_errors():
    net = LoopNet()
    with pytest.raises(ConfigError, match="has no attribute 'g'"):
        OwnLoop(net, map="g", tol=1e-3)
    with pytest.raises(ConfigError, match="loop or after, not both"):
        OwnLoop(net, map="f", tol=1e-3, loop="solve", after=1)(torch.randn(2, 5))
    with pytest.raises(ConfigError, match="keeps z's shape"):
        with track_loop(net, "head", tol=1e-3):
            net.head(torch.randn(2, 6))
    # the network is left as it was: no hooks, no wrappers
    assert "f" not in vars(net) and not net.head._forward_hooks


# -- cell_from_method ---------------------------------------------------------------------------


class Whole(nn.Module):
    """A network whose map is a method using two of its submodules (and not the others)."""

    def __init__(self, d=3, n=4, k=2):
        super().__init__()
        self.stem, self.head = nn.Linear(d, n), nn.Linear(n, k)
        self.body = nn.ModuleDict({"a": nn.Linear(n, n), "b": nn.Linear(n, n, bias=False)})
        self.scale = 0.4

    def f(self, z, u):
        return torch.tanh(self.scale * self.body["b"](torch.tanh(self.body["a"](z))) + u)


class Adapted(DEQModel):
    def __init__(self, net: Whole):
        super().__init__()
        self.net = net
        self.deq = DEQLayer(cell_from_method(net, "f", uses=["body.a", "body.b"]))

    def inject(self, x):
        return self.net.stem(x)

    def readout(self, z):
        return self.net.head(z)


def test_a_cell_from_a_method_gives_the_method_and_holds_only_the_maps_parameters():
    torch.manual_seed(0)
    net = Whole()
    cell = cell_from_method(net, "f", uses=["body.a", "body.b"])
    z, u = torch.randn(3, 4), torch.randn(3, 4)
    assert torch.equal(cell(z, u), net.f(z, u))
    names = sorted(n for n, _ in cell.named_parameters())
    assert names == ["body_a.bias", "body_a.weight", "body_b.weight"]
    assert all(p is q for p, q in zip(cell.body_a.parameters(), net.body["a"].parameters()))
    assert "stem.weight" not in cell.state_dict() and not hasattr(cell, "stem")
    # a bound method, and a module given as the map
    assert torch.equal(cell_from_method(net, net.f, uses=[net.body["a"], net.body["b"]])(z, u),
                       net.f(z, u))  # fmt: skip
    sub = cell_from_method(net, net.body["a"], check=False)
    assert sorted(n for n, _ in sub.named_parameters()) == ["body_a.bias", "body_a.weight"]


def test_a_method_calling_a_submodule_the_cell_does_not_hold_is_an_error():
    net = Whole()
    with pytest.raises(ConfigError, match="name the submodules it uses"):
        cell_from_method(net, "f")
    cell = cell_from_method(net, "f", uses=["body.a"])
    with pytest.raises(ConfigError, match=r"calls body\.b of Whole.*add 'body\.b' to uses="):
        cell(torch.randn(2, 4), torch.randn(2, 4))


def test_injection_parameters_are_not_cell_weights():
    from deqbench.contracts import cell_weights

    net = Whole()
    cell = cell_from_method(net, "f", uses=["body.a", "body.b"], injection=["body.a"])
    assert sorted(n for n, _ in cell_weights(cell)) == ["body_b.weight"]


def test_gradients_through_a_deq_layer_on_the_cell_match_a_long_unroll():
    torch.manual_seed(0)
    model = Adapted(Whole()).double()
    deqbench.deq.configure(
        model,
        SolverConfig("anderson", max_iter=200, tol=1e-12),
        BackwardConfig("ift", solver="anderson", max_iter=200, tol=1e-12),
    )
    x = torch.randn(3, 3, dtype=torch.float64)
    model(x).pow(2).sum().backward()
    cell_params = [p for _, p in model.deq.cell.named_parameters()]
    got = [p.grad.clone() for p in cell_params]

    # reference: the plain network, its fixed point by a long unroll with gradient
    ref = copy.deepcopy(model.net)
    u = ref.stem(x)
    z = torch.zeros_like(u)
    for _ in range(300):
        z = ref.f(z, u)
    ref.head(z).pow(2).sum().backward()
    want = [ref.body["a"].weight.grad, ref.body["a"].bias.grad, ref.body["b"].weight.grad]
    names = [n for n, _ in model.deq.cell.named_parameters()]
    assert names == ["body_a.weight", "body_a.bias", "body_b.weight"]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-7, atol=1e-9)
    # and a finite difference of the loss in one weight
    eps, (i, j) = 1e-6, (1, 2)

    def loss():
        with torch.no_grad():
            return float(model(x).pow(2).sum())

    w = model.net.body["b"].weight
    with torch.no_grad():
        w[i, j] += eps
    lp = loss()
    with torch.no_grad():
        w[i, j] -= 2 * eps
    lm = loss()
    with torch.no_grad():
        w[i, j] += eps
    assert abs((lp - lm) / (2 * eps) - float(got[2][i, j])) < 1e-6


def test_a_copy_of_the_model_calls_its_own_network():
    torch.manual_seed(0)
    model = Adapted(Whole())
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.net.body["b"].weight.zero_()
    z, u = torch.randn(2, 4), torch.randn(2, 4)
    assert torch.allclose(twin.deq.cell(z, u), torch.tanh(u))
    assert not torch.allclose(model.deq.cell(z, u), torch.tanh(u))
