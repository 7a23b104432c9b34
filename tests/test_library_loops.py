"""A library's own loop measured as it is (deqbench.adapters.OwnLoop): iterates of any shape
(a dict of tensors, read with ``state=``), a returned value that cannot be read (a one-line
[model.own_loop] error), the calls after the loop identified by the adapter, the purity clause
on own-loop maps, the library's own adjoint solve (OwnBackward), and the library's stop rule
beside the run's."""

from __future__ import annotations

import pytest
import torch
from conftest import write_suite
from torch import nn

import deqbench
from deqbench.adapters import OwnBackward, OwnLoop, OwnLoopError, track_loop
from deqbench.core import own_solves, verdict
from deqbench.models import declare_defaults
from deqbench.run.labels import cell_labels
from deqbench.run.plugin_checks import check_all
from deqbench.run.solves import SolveTally
from deqbench.solvers.base import residuals


class DictLoop(nn.Module):
    """A library-style loop: the iterate is a dict ``{"est": (x, aux), "it": k}``, the loop
    returns ``(X, metrics)``, stops on the batch mean of its relative step, and applies the
    map twice after it (a step with gradient and a second one at a detached copy)."""

    def __init__(self, d=5, tol=1e-4, max_iter=60, contraction=0.6):
        super().__init__()
        self.lin, self.tol, self.max_iter, self.c = nn.Linear(d, d), tol, max_iter, contraction
        self.register_buffer("calls", torch.zeros(()))
        self.count_calls = False

    def step(self, X, y):
        if self.count_calls:
            self.calls += 1
        x = torch.tanh(self.c * self.lin(X["est"][0]) + y)
        return {"est": (x, 2 * x), "it": X["it"] + 1}

    def loop(self, y, rule="batch_mean"):
        X, seen = {"est": (torch.zeros_like(y), y), "it": 0}, []
        for _ in range(self.max_iter):
            X_new = self.step(X, y)
            x0, x1 = X["est"][0], X_new["est"][0]
            r = (x1 - x0).norm(dim=1) / (x1.norm(dim=1) + 1e-6)
            seen.append(r)
            X = X_new
            stat = r.mean() if rule == "batch_mean" else r.max()
            if stat < self.tol:
                break
        return X, {"residual": seen}

    def forward(self, y):
        y = y.flatten(1)
        with torch.no_grad():
            X, _ = self.loop(y)
        x = self.step(X, y)["est"][0]
        x0 = x.detach().requires_grad_()
        self.step({"est": (x0,), "it": 0}, y)
        return x


def test_a_dict_iterate_loop_is_measured_with_a_state_selector():
    torch.manual_seed(0)
    net = DictLoop()
    m = OwnLoop(net, map="step", loop="loop", state="est.0", tol="tol", max_iter="max_iter")
    y = torch.randn(4, 5)
    m(y)
    st = m.last_solve_stats()
    X, metrics = net.loop(y)
    # every call inside the loop is an iteration; the two calls after it are identified
    assert st.nstep == len(metrics["residual"]) == st.rel_trace.shape[0]
    assert st.extra["calls_after_loop"] == 2 and st.extra["map_calls"] == st.nstep + 2
    # row t is the residual of the t-th input; the returned X is the input of the call after
    assert st.extra["returned"] == "input of the call after the loop"
    x = X["est"][0]
    _, rel = residuals(net.step(X, y)["est"][0], x)
    torch.testing.assert_close(st.rel_residual, rel)
    # a callable selector reads the same
    m2 = OwnLoop(net, map="step", loop="loop", state=lambda X: X["est"][0], tol="tol")
    m2(y)
    torch.testing.assert_close(m2.last_solve_stats().rel_residual, rel)


class Unreadable(DictLoop):
    def loop(self, y, rule="batch_mean"):
        X, metrics = super().loop(y, rule)
        return {"x_hat": X["est"][0].flatten(1)[:, :2]}, metrics  # not the iterate's form


def test_a_returned_value_that_cannot_be_read_is_a_one_line_error_naming_it():
    m = OwnLoop(Unreadable(), map="step", loop="loop", state="est.0", tol="tol")
    with pytest.raises(OwnLoopError) as e:
        m(torch.randn(2, 5))
    msg = str(e.value)
    assert msg.startswith("[model.own_loop] ") and "\n" not in msg
    assert "tuple(dict(x_hat=Tensor(2, 2)), dict(residual=list(" in msg
    assert "returned=" in msg
    # a returned= selector that reads the returned tuple's first element works on DictLoop
    m = OwnLoop(DictLoop(), map="step", loop="loop", state="est.0", returned="0", tol="tol")
    m(torch.randn(2, 5))
    assert m.last_solve_stats().extra["returned"] == "input of the call after the loop"


@declare_defaults(own_solver="picard", own_backward="ift", init="default")
def counting_own_loop(in_shape=(5,), num_outputs=5):
    net = DictLoop(d=int(torch.tensor(in_shape).prod()))
    net.count_calls = True  # the map changes a buffer at every call
    return OwnLoop(net, map="step", loop="loop", state="est.0", tol="tol",
                   solver_name="picard", backward_name="ift")  # fmt: skip


SUITE = """\
schema: 1
name: own
device: cpu
seeds: [0]
threads: 1
data: {name: digits, train_subset: 32, test_subset: 16}
defaults:
  model: {name: MODEL}
analyses: [metrics]
output: results
"""


def test_a_buffer_changing_own_loop_map_breaks_the_purity_clause(tmp_path):
    deqbench.models.add("counting_own_loop", counting_own_loop)
    try:
        p = write_suite(tmp_path, SUITE, replace={"MODEL": "counting_own_loop"})
        found = check_all([deqbench.load_suite(p)], data=False)
    finally:
        deqbench.models.remove("counting_own_loop")
    pure = [v for v in found if v.clause == "model.cell_pure"]
    assert len(pure) == 1, [v.line() for v in found]
    assert "a call of its own loop's map" in pure[0].message
    assert "net (DictLoop) changes its buffer(s) calls" in pure[0].message


class HookIFT(nn.Module):
    """The implicit backward of the DEQ tutorial (Kolter, Duvenaud & Johnson 2020): a loop
    under no_grad, a step with gradient, and a gradient hook solving w = J^T w + g by plain
    iteration, stopping on its own (loose) test after at most ``adj_iter`` VJPs."""

    def __init__(self, d=6, adj_iter=3, adj_tol=1e-9):
        super().__init__()
        self.lin, self.tol, self.adj_iter, self.adj_tol = nn.Linear(d, d), 1e-8, adj_iter, adj_tol
        self.vjps = 0

    def f(self, z, x):
        return torch.tanh(0.7 * self.lin(z) + x)

    @torch.no_grad()
    def solve(self, x):
        z = torch.zeros_like(x)
        for _ in range(200):
            z = self.f(z, x)
        return z

    def forward(self, x):
        z = self.f(self.solve(x), x)
        z0 = z.detach().requires_grad_()
        f0 = self.f(z0, x)

        def hook(g):
            w = g
            for _ in range(self.adj_iter):
                self.vjps += 1
                w_new = torch.autograd.grad(f0, z0, w, retain_graph=True)[0] + g
                done = (w_new - w).norm() < self.adj_tol * w_new.norm()
                w = w_new
                if done:
                    break
            return w

        if z.requires_grad:
            z.register_hook(hook)
        return z


def test_an_own_adjoint_that_stops_early_is_measured_and_judged():
    torch.manual_seed(0)
    net = HookIFT(adj_iter=3)
    m = OwnLoop(net, map="f", loop="solve", tol="tol",
                adjoint=OwnBackward(tol=1e-6, max_iter=50))  # fmt: skip
    x = torch.randn(4, 6)
    m(x).square().sum().backward()
    bst = m.last_backward_solve_stats()
    assert bst is not None and bst.nstep == net.vjps == 3 == bst.extra["vjps"]
    # deqbench recomputes the residual of w = J^T w + g: three steps of a 0.7-contraction
    # are far from 1e-6
    assert not bst.converged and bst.status == "stagnated"
    assert float(bst.rel_residual.max()) > 1e-3
    assert bst.rel_trace.shape == (3, 4)  # one row per VJP: the residual of its input
    # the same network solving to tolerance is converged, with an exact residual
    net2 = HookIFT(adj_iter=200, adj_tol=1e-9)
    net2.load_state_dict(net.state_dict())
    m2 = OwnLoop(net2, map="f", loop="solve", tol="tol", adjoint=OwnBackward(tol=1e-6))
    m2(x).square().sum().backward()
    b2 = m2.last_backward_solve_stats()
    assert b2.converged and b2.nstep == net2.vjps and float(b2.rel_residual.max()) < 1e-6
    # the forward's stats are unchanged by the measurement of the backward
    assert m.last_solve_stats().nstep == 200


def test_a_jacobian_free_backward_reports_no_adjoint_solve():
    m = OwnLoop(HookIFT(adj_iter=0), map="f", loop="solve", tol="tol",
                adjoint=OwnBackward(tol=1e-6))  # fmt: skip
    m(torch.randn(2, 6)).sum().backward()
    assert m.last_backward_solve_stats() is None


def test_the_run_rule_judges_and_the_library_rule_is_shown_beside_it():
    torch.manual_seed(1)
    # one sample converges slowly: the batch mean is met long before the batch max
    net = DictLoop(tol=1e-3, max_iter=200, contraction=0.9)
    m = OwnLoop(net, map="step", loop="loop", state="est.0", tol="tol", max_iter="max_iter",
                stop="batch_mean")  # fmt: skip
    y = torch.randn(16, 5) * torch.linspace(0.1, 3, 16)[:, None]
    with own_solves.judged_under(None), verdict.solve_ledger() as ledger:  # the default rule
        m(y)
        st = m.last_solve_stats()
        verdict.record("forward", st, st.extra.get("max_iter"))
    assert st.stop == "sample_max" and st.extra["own_rule"] == "batch_mean"
    assert st.extra["own_converged"] and not st.converged, st.rel_residual
    tally = SolveTally("forward", "train")
    tally.add_record(ledger.records[0])
    assert "under its own rule (batch_mean) the library called 1 of them converged" in (
        tally.note()
    )
    with own_solves.judged_under("batch_mean"):  # the run declares the library's rule
        m(y)
    st = m.last_solve_stats()
    assert st.stop == "batch_mean" and st.converged and st.extra["own_converged"]


def test_track_loop_gives_the_same_as_ownloop():
    net = DictLoop()
    y = torch.randn(3, 5)
    with track_loop(net, "step", loop="loop", state="est.0", tol=1e-4) as rec:
        net(y)
    assert rec.stats.extra["calls_after_loop"] == 2


@declare_defaults(own_solver="{loop}", own_backward="jfb", init="default")
def picked_loop(in_shape=(5,), num_outputs=5, loop="plain"):
    net = DictLoop(d=int(torch.tensor(in_shape).prod()), contraction=0.3)
    return OwnLoop(net, map="step", loop="loop", state="est.0", tol="tol",
                   solver_name=loop, backward_name="jfb")  # fmt: skip


def test_a_factory_option_names_the_loop_per_cell(tmp_path):
    deqbench.models.add("picked_loop", picked_loop)
    try:
        text = SUITE.replace("analyses:", "matrix:\n  model.loop: [plain, anderson]\nanalyses:")
        p = write_suite(tmp_path, text, replace={"MODEL": "picked_loop"})
        suite = deqbench.load_suite(p)
        found = check_all([suite], data=False)
        labels = [cell_labels(c.as_dict()) for c in suite.cells]
    finally:
        deqbench.models.remove("picked_loop")
    assert labels == [("own:plain", "own:jfb"), ("own:anderson", "own:jfb")]
    assert all("own_plain" in c.id or "own_anderson" in c.id for c in suite.cells)
    # the built models agree with their cells' names: no [model.solve_stats]
    assert not [v for v in found if v.clause == "model.solve_stats"], [v.line() for v in found]


def test_a_merged_flag_note_keeps_the_librarys_own_verdict():
    """A cell flagged in several phases gets one merged note per kind; the library's own
    verdict (under its own stop rule) stays in it, beside deqbench's."""
    from deqbench.run.solves import Tallies

    tallies = Tallies()
    for phase, said in (("train", 16), ("eval", 2)):
        t = tallies.get("forward", phase)
        t.batches, t.missed, t.worst, t.tol = 16, 16, 7e-4, 1e-4
        t.solver, t.own_rule, t.own_said = "own:plain", "batch_mean", said
    (note,) = tallies.flags()
    assert "in 16 of 16 training batches, 16 of 16" in note
    assert "under its own rule (batch_mean) the library called 18 of them converged" in note
