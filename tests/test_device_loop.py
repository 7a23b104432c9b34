"""The device loop (``graph_steps="loop"``): the whole solve as one CUDA graph whose loop and stop
test run on the device. On the CPU the same static body and the device stop test
(``Tracker.device_judge``) run eagerly beside the host's test: they must stop at the same step
with the same iterate as one step per replay (``graph_steps=1``, the host reading every step),
under every stop rule, on divergence, on a blown-up residual and on stagnation."""

from __future__ import annotations

import pytest
import torch

from deqbench.solvers import get
from deqbench.solvers import graphs as graphs_mod
from deqbench.solvers.base import LOOP_STEPS_LABEL, graph_steps, loop_supported
from deqbench.solvers.options import GraphOptions

B, N = 6, 20
SOLVERS = ["fixed_point", "anderson", "broyden"]


def tanh_cell(scale: float = 0.15):
    g = torch.Generator().manual_seed(0)
    W = torch.randn(N, N, generator=g, dtype=torch.float64) * scale
    b = torch.randn(B, N, generator=g, dtype=torch.float64)
    return (lambda z: torch.tanh(z @ W.T + b)), torch.zeros(B, N, dtype=torch.float64)


def both(name, f, z0, **kw):
    """(graph_steps=1, graph_steps="loop") results of one solve."""
    out = []
    for steps in (1, "loop"):
        out.append(get(name)(f, z0, cuda_graph=True, graph_steps=steps, **kw))
    return out


def assert_same(a, b):
    (za, sa), (zb, sb) = a, b
    assert sb.extra["graph_steps"] == LOOP_STEPS_LABEL
    assert (sa.nstep, sa.status, sa.converged) == (sb.nstep, sb.status, sb.converged)
    assert torch.equal(za, zb)
    assert torch.equal(sa.rel_trace, sb.rel_trace)


@pytest.mark.parametrize("name", SOLVERS)
@pytest.mark.parametrize("stop", ["sample_max", "batch_fro", "batch_mean"])
@pytest.mark.parametrize("returns", ["lowest", "last"])
def test_loop_stops_where_the_host_does(name, stop, returns):
    f, z0 = tanh_cell()
    a, b = both(name, f, z0, max_iter=60, tol=1e-9, stop=stop, returns=returns)
    assert a[1].status == "converged" and 5 < a[1].nstep < 60
    assert_same(a, b)


@pytest.mark.parametrize("stop_mode", ["abs", "rel"])
def test_loop_budget_and_divergence(stop_mode):
    f, z0 = tanh_cell()
    a, b = both("fixed_point", f, z0, max_iter=7, tol=1e-12, stop_mode=stop_mode)
    assert a[1].status == "max_iter" and a[1].nstep == 7
    assert_same(a, b)
    # a blow-up: the abs residual passes protect_thres x the first one before it overflows
    a, b = both("fixed_point", lambda z: 3 * z + 1, z0 + 1, max_iter=200, tol=1e-9)
    assert a[1].status == "diverged" and a[1].nstep < 30
    assert_same(a, b)
    a, b = both(
        "fixed_point", lambda z: 3 * z + 1, z0 + 1, max_iter=200, tol=1e-9, protect_thres=10.0
    )
    assert a[1].status == "diverged" and a[1].nstep <= 4
    assert_same(a, b)
    # a NaN at the third evaluation
    calls = []

    def nan_at_3(z):
        calls.append(1)
        return z * 0.5 + (float("nan") if len(calls) == 3 else 1.0)

    runs = []
    for steps in (1, "loop"):
        calls.clear()
        runs.append(get("fixed_point")(nan_at_3, z0, max_iter=50, tol=1e-9, cuda_graph=True,
                                       graph_steps=steps))  # fmt: skip
    assert runs[0][1].status == "diverged" and runs[0][1].nstep == 3
    assert (runs[1][1].status, runs[1][1].nstep) == ("diverged", 3)


def test_loop_stagnation():
    """Broyden's stagnation test (window 30) is judged on the device as on the host."""
    c = torch.full((B, N), 0.01, dtype=torch.float64)
    f = lambda z: z + c  # noqa: E731 - ||f(z) - z|| = 0.0566 for every z
    a, b = both("broyden", f, torch.zeros_like(c), max_iter=200, tol=0.04, stop_mode="abs")
    assert a[1].status == "stagnated" and a[1].nstep <= 32
    assert_same(a, b)


def test_device_judge_halts_with_the_host(monkeypatch):
    """At every step of a solve the device flag equals the host's verdict (stopped or not)."""
    f, z0 = tanh_cell(0.3)
    seen = []
    orig = graphs_mod.Tracker.device_judge

    def spy(self):
        orig(self)
        seen.append(bool(self.dev_halt))

    monkeypatch.setattr(graphs_mod.Tracker, "device_judge", spy)
    _, st = get("anderson")(f, z0, max_iter=80, tol=1e-10, cuda_graph=True, graph_steps="loop")
    assert st.status == "converged"
    assert seen == [False] * (st.nstep - 1) + [True]


def test_graph_steps_loop_option():
    z0 = torch.zeros(2, 3)
    assert graph_steps(GraphOptions(graph_steps="loop"), z0) == graphs_mod.LOOP
    assert graph_steps(GraphOptions(), z0) == graphs_mod.AUTO_STEPS  # auto: chunks by default
    with pytest.raises(ValueError):
        GraphOptions(graph_steps="loops")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", SOLVERS)
def test_loop_on_cuda_matches_one_step_replays(name):
    """On CUDA with conditional nodes: one launch, the same steps and iterate as graph_steps=1;
    without them (torch or CUDA too old) "loop" falls back to the chunked path and says so."""
    g = torch.Generator().manual_seed(0)
    W = (torch.randn(64, 64, generator=g) * 0.02).cuda()
    b = torch.randn(32, 64, generator=g).cuda()
    f = lambda z: torch.tanh(z @ W.T + b)  # noqa: E731
    z0 = torch.zeros(32, 64, device="cuda")
    a, c = both(name, f, z0, max_iter=60, tol=1e-5)
    if not loop_supported():
        assert c[1].extra["graph_steps"] != LOOP_STEPS_LABEL
        pytest.skip(f"no CUDA graph conditional nodes in torch {torch.__version__}")
    assert c[1].path == "graph"
    assert_same(a, c)
