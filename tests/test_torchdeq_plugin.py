"""The TorchDEQ plugin (examples/deqbench-torchdeq), found through real entry-point metadata:
adapters against deqbench's own solvers on the same fixed point, f-evaluation counting, the
TorchDEQ IFT layer against deqbench's IFT, and the side-by-side ``backward`` analysis.
Skipped when torchdeq is not installed (it is not a dependency of deqbench)."""

from __future__ import annotations

import copy
import importlib
import io
import math
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchdeq")

import deqbench  # noqa: E402
from deqbench.core.registry import REGISTRIES  # noqa: E402
from deqbench.deq import BackwardConfig, SolverConfig, configure  # noqa: E402
from deqbench.errors import ConfigError  # noqa: E402
from deqbench.solvers.base import SolverOptionError, residuals  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = ROOT / "examples" / "deqbench-torchdeq"
NAMES = ("torchdeq_anderson", "torchdeq_broyden", "torchdeq_fixed_point")


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    """'Install' the plugin: its sources on sys.path and a dist-info from its pyproject.toml."""
    import tomllib

    site = tmp_path_factory.mktemp("site")
    proj = tomllib.loads((PLUGIN / "pyproject.toml").read_text())["project"]
    d = site / f"deqbench_torchdeq-{proj['version']}.dist-info"
    d.mkdir()
    (d / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {proj['name']}\nVersion: {proj['version']}\n"
    )
    lines = []
    for group, eps in proj["entry-points"].items():
        lines += [f"[{group}]", *[f"{k} = {v}" for k, v in eps.items()], ""]
    (d / "entry_points.txt").write_text("\n".join(lines))
    mp = pytest.MonkeyPatch()
    mp.delenv("DEQBENCH_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    mp.syspath_prepend(str(site))
    mp.syspath_prepend(str(PLUGIN / "src"))
    importlib.invalidate_caches()
    for r in REGISTRIES.values():
        r.reset_plugins()
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
    mp.undo()
    for r in REGISTRIES.values():
        r.reset_plugins()
    for mod in [m for m in sys.modules if m.startswith("deqbench_torchdeq")]:
        del sys.modules[mod]


def _fc_cell(width=32, n_in=16, batch=12, norm=0.9, seed=0):
    """f(z) = tanh(W z + U x + b), ||W||_2 = norm (a small bare cell)."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(width, width, generator=g)
    W *= norm / torch.linalg.matrix_norm(W, ord=2)
    u = torch.randn(batch, n_in, generator=g) @ (torch.randn(n_in, width, generator=g) / n_in**0.5)
    u += 0.1 * torch.randn(width, generator=g)
    return (lambda z: torch.tanh(z @ W.T + u)), torch.zeros(batch, width)


def test_registered_through_entry_points(plugin):
    for n in NAMES:
        assert n in deqbench.solvers.names()
        assert deqbench.solvers.origin(n) == "deqbench-torchdeq 0.1.0"
    assert deqbench.models.origin("torchdeq_deq") == "deqbench-torchdeq 0.1.0"
    # the side-by-side suite names the plugin's solvers and wrapper: it validates with the plugin
    suite = deqbench.load_suite(ROOT / "suites" / "vs_torchdeq.yaml", device="cpu")
    assert suite.cells


@pytest.mark.parametrize(
    "ours,theirs",
    [
        ("fixed_point", "torchdeq_fixed_point"),
        ("anderson", "torchdeq_anderson"),
        ("broyden", "torchdeq_broyden"),
    ],
)
def test_adapters_reach_the_same_fixed_point(plugin, ours, theirs):
    f, z0 = _fc_cell()
    z_ref, st_ref = deqbench.solvers.get(ours)(f, z0, max_iter=100, tol=1e-6)
    calls = [0]

    def fc(z):
        calls[0] += 1
        return f(z)

    z, st = deqbench.solvers.get(theirs)(fc, z0, max_iter=100, tol=1e-6)
    assert st.status == "converged" and st.solver == theirs
    assert st.nstep == calls[0] - 1  # f counted by wrapping; the residual check is not counted
    a, r = residuals(f(z), z)
    assert torch.allclose(st.rel_residual, r) and st.rel_max < 1e-6
    assert float((z - z_ref).norm() / z_ref.norm()) < 1e-5
    assert st.rel_trace.shape[1] == z0.shape[0] and float(st.rel_trace.max()) < 1e7  # no sentinel
    assert st.extra["library"] == "torchdeq" and st.extra["residual_source"] == "recomputed"
    if ours == "fixed_point":  # plain iteration, same stop rule: same count
        assert st.nstep == st_ref.nstep
    # timed without the check: nothing extra is evaluated, TorchDEQ's own lowest residual is kept
    calls[0] = 0
    _, st2 = deqbench.solvers.get(theirs)(fc, z0, max_iter=100, tol=1e-6, check_returned=False)
    assert st2.nstep == calls[0] and st2.extra["residual_source"] == "torchdeq_lowest"


def test_adapter_options_stop_mode_and_errors(plugin):
    f, z0 = _fc_cell()
    solve = deqbench.solvers.get("torchdeq_anderson")
    with pytest.raises(SolverOptionError, match="unknown option 'tol_abs'"):
        solve(f, z0, max_iter=50, tol=1e-4, tol_abs=1.0)  # TorchDEQ itself would swallow it
    _, st = solve(f, z0, max_iter=50, tol=1e-3, stop_mode="abs", m=3, lam=1e-6)
    assert st.stop_mode == "abs" and st.abs_max < 1e-3
    _, st = solve(f, z0, max_iter=4, tol=1e-12)
    assert st.status == "max_iter" and st.nstep == 4 and not st.converged


def test_torchdeq_layer_matches_deqbench_ift_and_pickles(plugin):
    torch.manual_seed(0)
    native = deqbench.models.create("fc_deq_tiny", in_shape=(16,), num_outputs=3, width=12)
    torch.manual_seed(0)
    td = deqbench.models.create(
        "torchdeq_deq", base="fc_deq_tiny", in_shape=(16,), num_outputs=3, width=12
    )
    assert all(torch.equal(p, q) for p, q in zip(native.parameters(), td.parameters()))
    native, td = native.double(), td.double()
    s = SolverConfig("anderson", 100, 1e-10)
    b = BackwardConfig("ift", solver="anderson", max_iter=100, tol=1e-10)
    configure(native, s, b)
    configure(td, s, b)
    x = torch.randn(5, 16, dtype=torch.float64)
    g1 = torch.autograd.grad(native(x).square().sum(), list(native.parameters()))
    g2 = torch.autograd.grad(td(x).square().sum(), list(td.parameters()))
    for a, c in zip(g1, g2):
        assert torch.allclose(a, c, rtol=1e-7, atol=1e-10)
    layer = td.deq
    assert layer.last_forward_stats.solver == "torchdeq_anderson"
    assert layer.last_forward_stats.converged and layer.f_evals_grad == 1
    assert layer.last_backward_stats.solver == "torchdeq_anderson"
    assert (
        layer.last_backward_stats.nstep > 0 and layer.vjp_bwd == layer.last_backward_stats.nstep + 1
    )
    # TorchDEQ's module is rebuilt, never pickled or copied
    buf = io.BytesIO()
    torch.save(td, buf)
    clone = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    assert torch.allclose(clone(x), td(x))
    assert copy.deepcopy(td).deq._td is None
    configure(td, backward=BackwardConfig("unrolled", k=3))
    with pytest.raises(ConfigError, match="no 'unrolled'"):
        td(x).sum().backward()
    configure(td, SolverConfig("splitting"), BackwardConfig("ift"))
    with pytest.raises(ConfigError, match="no TorchDEQ counterpart"):
        td(x)


def test_backward_analysis_side_by_side_with_wrapper(plugin):
    from deqbench.analyses.base import CellContext
    from deqbench.data.base import DataBundle

    torch.manual_seed(0)
    X, y = torch.randn(24, 16), torch.randint(0, 3, (24,))
    data = DataBundle("toy", (X, y), (X[:8], y[:8]), (16,), 3)
    model = deqbench.models.create("fc_deq_tiny", in_shape=(16,), num_outputs=3, width=12)
    configure(
        model, SolverConfig("anderson", 60, 1e-6), BackwardConfig("ift", max_iter=60, tol=1e-6)
    )
    cell = {"model": {"name": "fc_deq_tiny"}, "train": {"epochs": 0, "batch_size": 8}}
    ctx = CellContext(model, data, torch.device("cpu"), torch.float32, 0, "c", cell)
    a = deqbench.analyses.get("backward")(
        {
            "modes": [
                {"name": "ift"},
                {"name": "ift", "wrapper": "torchdeq_deq"},
                {"name": "unrolled", "k": 5, "wrapper": "torchdeq_deq"},
            ],
            "repeats": 1,
            "warmup": 0,
            "memory": False,
            "memory_series": [],
            "ref_tol": 1e-10,
            "at": ["init"],
        }
    )
    rows = list(a.before_training(ctx))
    err = {r.variant: r.value for r in rows if r.metric == "grad_rel_error"}
    assert err["ift-tol=1e-06"] < 1e-3 and err["torchdeq_deq:ift-tol=1e-06"] < 1e-3
    (skip,) = [r for r in rows if r.variant == "torchdeq_deq:unrolled-k=5"]
    assert skip.status == "skipped" and "unrolled" in skip.note
    assert type(model.deq).__name__ == "DEQLayer"  # the cell's model was not converted


def test_solver_overhead_analysis_with_torchdeq_solvers(plugin):
    from deqbench.analyses.base import CellContext
    from deqbench.data.base import DataBundle

    torch.manual_seed(0)
    X, y = torch.randn(24, 16), torch.randint(0, 3, (24,))
    data = DataBundle("toy", (X, y), (X[:8], y[:8]), (16,), 3)
    model = deqbench.models.create("fc_deq_tiny", in_shape=(16,), num_outputs=3, width=12)
    deqbench.inits.get("spectral")(model, seed=0, target=0.5)  # contractive: both converge
    cell = {"model": {"name": "fc_deq_tiny"}, "train": {"epochs": 0, "batch_size": 8}}
    ctx = CellContext(model, data, torch.device("cpu"), torch.float32, 0, "c", cell)
    a = deqbench.analyses.get("solver_overhead")(
        {
            "solvers": ["anderson", "torchdeq_anderson"],
            "tols": [1e-4],
            "max_iter": 100,
            "repeats": 2,
            "warmup": 0,
            "f_repeats": 2,
            "f_loop": 2,
            "memory": False,
            "at": ["init"],
        }
    )
    rows = list(a.before_training(ctx))
    for label, origin in (("anderson", "built-in"), ("torchdeq_anderson", "deqbench-torchdeq")):
        v = f"{label}-tol=0.0001"
        by = {
            m: [r for r in rows if r.metric == m and r.variant == v]
            for m in {r.metric for r in rows}
        }
        assert by["converged"][0].value == 1.0, by["converged"][0].note
        assert by["rel_residual"][0].value < 1e-4
        fe = [r.value for r in by["f_evals"]]
        assert len(fe) == 2 and fe[0] == fe[1] > 0  # counted by wrapping f, for both solvers
        ov = [r.value for r in by["overhead"]] + [by["overhead_median"][0].value]
        assert all(math.isfinite(o) and o > 0 for o in ov), ov
        assert origin in by["overhead_median"][0].note
