"""Tests of the built-in solvers (CPU, small, float64 unless stated), against dense references:
(I - A)^-1 b for linear maps, recomputed residuals, counted f-evaluations.

The solvers under test come from the registry, not from a list kept here: every built-in
solver is tested, a new one included, filtered only by what it declares (``needs_structure``,
``supports_cuda_graph``, its tags such as ``rate="sublinear"``, the chunked layout of its
module)."""

from __future__ import annotations

import functools
import importlib

import pytest
import torch

import deqbench
from deqbench.contracts import structure_of
from deqbench.core.registry import BUILTIN
from deqbench.core.tags import SolverTags, solver_tags
from deqbench.errors import ConfigError
from deqbench.solvers.base import residuals, supports_graph

N, B = 32, 4


def get(name):
    return deqbench.solvers.get(name)


#: every built-in solver (plugins are off in the tests: conftest)
BUILTINS = [n for n in deqbench.solvers.names() if deqbench.solvers.origin(n) == BUILTIN]
#: those that take any map; a solver with ``needs_structure`` only runs on a map whose ``cell``
#: has that structure (a ConfigError for the plain callables here: test_mondeq.py tests them)
GENERIC = [n for n in BUILTINS if structure_of(get(n)) is None]


def root_finders(names):
    """Those of ``names`` held to a tight tol on a contraction: all but the solvers that declare
    a sublinear rate (e.g. sam: its distance to Fix(T) decays only like beta_k -> 0)."""
    return [n for n in names if solver_tags(get(n)).rate != "sublinear"]


ROOT_FINDERS = root_finders(GENERIC)


def test_the_solvers_held_to_a_tight_tol_are_chosen_by_their_declared_tags():
    """A solver declares its rate on itself (no list here to edit): a sublinear one, declared
    with @solver(tags=...) or as a plain function's attribute, is held to progress only."""
    from test_hints import halpern  # @solver(..., tags={"rate": "sublinear"})

    def plain(f, z0, *, max_iter=50, tol=1e-4, stop_mode="rel"):
        return z0, None

    plain.tags = SolverTags(rate="sublinear")
    assert solver_tags(halpern).rate == "sublinear" and solver_tags(get("sam")).rate == "sublinear"
    assert solver_tags(get("anderson")) == SolverTags()  # nothing declared: the defaults
    deqbench.solvers.add("t_halpern_tagged", halpern)
    deqbench.solvers.add("t_plain_tagged", plain)
    try:
        names = ["anderson", "sam", "t_halpern_tagged", "t_plain_tagged"]
        assert root_finders(names) == ["anderson"]
        assert solver_tags("t_plain_tagged").rate == "sublinear"  # by registered name
    finally:
        deqbench.solvers.remove("t_halpern_tagged")
        deqbench.solvers.remove("t_plain_tagged")
    assert "sam" not in ROOT_FINDERS and "anderson" in ROOT_FINDERS
    with pytest.raises(ValueError, match="rate"):
        SolverTags(rate="quadratic")


#: solvers whose module lays each sample's vector out in chunks (base.chunking) on CUDA
CHUNKED = [n for n in BUILTINS if hasattr(importlib.import_module(get(n).__module__), "chunking")]


def f_calls(st):
    """The calls of f a solve makes: its f-evaluations and its forward-mode JVPs (each one call
    of f under torch.func.jvp; counted apart in ``njvp``, 0 for solvers that make none)."""
    return st.nstep + st.njvp


def symmetric(n=N, norm=0.9, seed=0, dtype=torch.float64):
    """A = Q diag(linspace(-norm, norm)) Q^T: ||A||_2 = norm, spectrum spread over [-norm, norm]."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    lam = torch.linspace(-norm, norm, n, dtype=torch.float64)
    a = (q * lam) @ q.T
    b = torch.randn(B, n, generator=g, dtype=torch.float64)
    return a.to(dtype), b.to(dtype)


class Counted:
    """Wraps f and counts calls."""

    def __init__(self, f):
        self.f = f
        self.calls = 0

    def __call__(self, z):
        self.calls += 1
        return self.f(z)


def tanh_cell(dtype=torch.float64):
    a, b = symmetric(dtype=dtype)
    return lambda z: torch.tanh(z @ a.T + b), torch.zeros_like(b)


# -- convergence and accuracy -------------------------------------------------------------------
@functools.cache
def tanh_solve(name, dtype):
    """(f, z, stats) of ``name`` on the tanh cell, solved once per test session."""
    f, z0 = tanh_cell(dtype)
    z, st = get(name)(f, z0, max_iter=300, tol=1e-6)
    return f, z, st


@pytest.mark.parametrize("name", ROOT_FINDERS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_tanh_reaches_tol(dtype, name):
    f, z, st = tanh_solve(name, dtype)
    assert st.converged and st.status == "converged", (name, st.status)
    _, r = residuals(f(z), z)
    assert float(r.max()) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_tanh_accelerated_beat_fixed_point(dtype):
    counts = {n: tanh_solve(n, dtype)[2].nstep for n in ("fixed_point", "anderson", "broyden")}
    assert counts["anderson"] < counts["fixed_point"], counts
    assert counts["broyden"] < counts["fixed_point"], counts


@pytest.mark.parametrize("name", ROOT_FINDERS)
def test_linear_matches_dense_solve(name):
    a, b = symmetric(norm=0.7)
    zstar = torch.linalg.solve(torch.eye(N, dtype=torch.float64) - a, b.T).T
    z, st = get(name)(lambda z: z @ a.T + b, torch.zeros_like(b), max_iter=300, tol=1e-13)
    assert st.converged, (name, st.status, st.rel_max)
    assert torch.allclose(z, zstar, rtol=0, atol=1e-8), (name, float((z - zstar).abs().max()))


@pytest.mark.parametrize("name", ROOT_FINDERS)
def test_any_state_shape_and_batch_independence(name):
    """(B, C, H, W) states; each sample's answer does not depend on the rest of the batch."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(2 * 3 * 3, 2 * 3 * 3, generator=g, dtype=torch.float64)
    w *= 0.8 / torch.linalg.matrix_norm(w, 2)
    x = torch.randn(5, 2, 3, 3, generator=g, dtype=torch.float64)

    def f(z):
        return torch.tanh((z.reshape(z.shape[0], -1) @ w.T).reshape(z.shape) + x[: z.shape[0]])

    z, st = get(name)(f, torch.zeros_like(x), max_iter=200, tol=1e-10)
    assert z.shape == x.shape and st.converged
    assert st.abs_trace.shape[1] == 5
    z1, _ = get(name)(f, torch.zeros_like(x[:1]), max_iter=200, tol=1e-10)
    assert torch.allclose(z[:1], z1, atol=1e-8)


# -- counting, traces, returned residual ---------------------------------------------------------
#: solver-specific option sets; every other generic solver runs with its defaults
OWN_OPTION_SETS = [
    ("fixed_point", {}),
    ("fixed_point", {"tau": 0.7, "check_every": 3}),
    ("fixed_point", {"returns": "last"}),
    ("fixed_point", {"cuda_graph": True}),  # the static graph step, run eagerly on CPU
    ("anderson", {}),
    ("anderson", {"m": 3, "beta": 0.8, "check_every": 2}),
    ("anderson", {"returns": "last", "lam": 0.0, "lam_abs": 1e-10}),
    ("anderson", {"cuda_graph": True, "beta": 0.9}),
    ("broyden", {}),
    ("broyden", {"memory": 3}),
    ("broyden", {"memory": 3, "on_full": "ring", "returns": "last"}),
    ("broyden", {"line_search": True}),
]
OPTION_SETS = OWN_OPTION_SETS + [
    (n, {}) for n in GENERIC if n not in {s for s, _ in OWN_OPTION_SETS}
]


#: solvers some of whose f-evaluations measure no residual (one trace row per measured one)
PARTLY_MEASURED = {"reversible": "a step's first half, f(y), measures no residual: 2N + 1 evals"}
#: solvers that return the last iterate unless told otherwise
LAST_BY_DEFAULT = {"reversible": "the reversal starts from z_N"}


@pytest.mark.parametrize("name,opts", OPTION_SETS)
def test_counts_traces_and_returned_residual(name, opts):
    f, z0 = tanh_cell()
    fc = Counted(f)
    z, st = get(name)(fc, z0, max_iter=60, tol=1e-8, **opts)
    assert f_calls(st) == fc.calls
    # one trace row per measured residual; without a line search every f-eval measures one
    assert st.abs_trace.shape == st.rel_trace.shape
    assert st.abs_trace.shape[1] == B
    if not opts.get("line_search") and name not in PARTLY_MEASURED:
        assert st.abs_trace.shape[0] == st.nstep
    else:
        assert 1 <= st.abs_trace.shape[0] <= st.nstep
    # the reported residual is that of the returned iterate
    a, r = residuals(f(z), z)
    torch.testing.assert_close(st.abs_residual, a, rtol=1e-12, atol=0)
    torch.testing.assert_close(st.rel_residual, r, rtol=1e-12, atol=0)
    if opts.get("returns", "last" if name in LAST_BY_DEFAULT else "lowest") == "last":
        torch.testing.assert_close(st.rel_residual, st.rel_trace[-1], rtol=0, atol=0)
    else:  # lowest per sample
        torch.testing.assert_close(st.rel_residual, st.rel_trace.min(0).values, rtol=0, atol=0)
    assert st.converged == bool((st.rel_residual < 1e-8).all())
    assert st.extra["returned"] == "x"
    if "check_every" in opts and st.nstep < 60:
        assert st.nstep % opts["check_every"] == 0


LOWEST_EXCLUDE = {
    "sam": "returns the last iterate by default (the selection needs it)",
    "reversible": "returns the last iterate by default (the reversal starts from it)",
    "newton_krylov": "re-measures a stalled sample's frozen z0: returns z0 with lowest_step 1",
}


@pytest.mark.parametrize("name", [n for n in GENERIC if n not in LOWEST_EXCLUDE])
def test_lowest_is_initialised_to_z0(name):
    """||f(z) - z|| = ||1 + 0.1 |z - z0|||: no iterate can beat z0, so z0 itself is returned."""
    z0 = torch.randn(B, N, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    z, st = get(name)(
        lambda z: z + 1 + 0.1 * (z - z0).abs(), z0, max_iter=5, tol=1e-12, stop_mode="abs"
    )
    assert not st.converged
    assert torch.equal(z, z0)
    assert st.lowest_step == 0


# -- failure modes: nothing raises ----------------------------------------------------------------
@pytest.mark.parametrize("name", GENERIC)
@pytest.mark.parametrize("stop_mode", ["abs", "rel"])
def test_no_fixed_point_stops_within_max_iter(name, stop_mode):
    fc = Counted(lambda z: z + 1)
    z, st = get(name)(
        fc, torch.zeros(B, N, dtype=torch.float64), max_iter=25, tol=1e-6, stop_mode=stop_mode
    )
    assert fc.calls == f_calls(st) <= 25
    assert not st.converged and st.status in ("max_iter", "stagnated", "diverged")
    assert torch.isfinite(z).all()


def test_fixed_point_divergence_detected():
    b = torch.ones(B, N, dtype=torch.float64)
    for stop_mode in ("rel", "abs"):
        fc = Counted(lambda z: 3 * z + b)
        z, st = get("fixed_point")(
            fc, torch.zeros_like(b), max_iter=200, tol=1e-6, stop_mode=stop_mode
        )
        assert st.status == "diverged" and not st.converged
        assert fc.calls == st.nstep < 40  # the abs residual passed protect_thres (1e6) x the first
        if stop_mode == "abs":  # (the rel residual ||2z+b||/||3z+b|| decreases towards 2/3)
            assert torch.equal(z, torch.zeros_like(b))  # the lowest iterate is z0


NON_FINITE_EXCLUDE = {
    "newton_krylov": "its line search rejects non-finite trials: ends stagnated, not diverged",
}


@pytest.mark.parametrize("name", [n for n in GENERIC if n not in NON_FINITE_EXCLUDE])
def test_non_finite_stops_as_diverged(name):
    def f(z):  # no fixed point; NaN once |z| > 0.5
        return torch.where(z.abs() > 0.5, torch.full_like(z, float("nan")), z + 0.1)

    z, st = get(name)(f, torch.zeros(B, N, dtype=torch.float64), max_iter=50, tol=1e-6)
    assert st.status == "diverged" and st.nstep < 50
    assert torch.isfinite(z).all()


def test_anderson_singular_solve_falls_back():
    """G G^T is rank one for f(z) = z + 1; without regularisation every solve is singular."""
    z, st = get("anderson")(
        lambda z: z + 1, torch.zeros(B, N, dtype=torch.float64), max_iter=10, tol=1e-6, lam=0.0
    )
    assert int(st.extra["fallbacks"].sum()) > 0
    assert torch.isfinite(z).all() and st.nstep == 10


def test_fixed_point_damping():
    """f(z) = -0.9 z + b oscillates; tau = 0.5 contracts by 0.05 per step instead of 0.9."""
    b = torch.ones(B, N, dtype=torch.float64)
    _, plain = get("fixed_point")(
        lambda z: -0.9 * z + b, torch.zeros_like(b), max_iter=500, tol=1e-10
    )
    z, damped = get("fixed_point")(
        lambda z: -0.9 * z + b, torch.zeros_like(b), max_iter=500, tol=1e-10, tau=0.5
    )
    assert plain.converged and damped.converged
    assert damped.nstep < plain.nstep / 5
    torch.testing.assert_close(z, b / 1.9)


def test_broyden_stagnation():
    """A residual stuck just above tol (below 3 tol, flat over 30 steps) stops as stagnated."""
    c = torch.full((B, N), 0.01, dtype=torch.float64)  # ||f(z) - z|| = 0.0566 for every z
    fc = Counted(lambda z: z + c)
    z, st = get("broyden")(fc, torch.zeros_like(c), max_iter=200, tol=0.04, stop_mode="abs")
    assert st.status == "stagnated" and fc.calls == st.nstep <= 32
    _, st2 = get("broyden")(
        fc, torch.zeros_like(c), max_iter=200, tol=0.04, stop_mode="abs", stagnation=False
    )
    assert st2.status == "max_iter" and st2.nstep == 200


# -- options ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", BUILTINS)
def test_unknown_option_is_a_config_error(name):
    f, z0 = tanh_cell()
    with pytest.raises(ConfigError, match="unknown option 'retruns'.*did you mean 'returns'"):
        get(name)(f, z0, max_iter=5, tol=1e-3, retruns="last")


#: bad values of the options every built-in solver takes (base.COMMON_OPTIONS) and of stop_mode
COMMON_BAD = [{"returns": "best"}, {"check_every": 0}, {"protect_thres": 1.0}]
COMMON_BAD += [{"stop_mode": "relative"}]


@pytest.mark.parametrize(
    "name,opts",
    [
        ("fixed_point", {"tau": 0.0}),
        ("fixed_point", {"returns": "best"}),
        ("anderson", {"m": 0}),
        ("anderson", {"check_every": 0}),
        ("broyden", {"memory": 0}),
        ("broyden", {"on_full": "drop"}),
        ("broyden", {"stop_mode": "relative"}),
    ]
    + [(n, o) for n in GENERIC for o in COMMON_BAD],
)
def test_bad_option_values(name, opts):
    f, z0 = tanh_cell()
    with pytest.raises(ConfigError):
        get(name)(f, z0, max_iter=5, tol=1e-3, **opts)


def test_bad_option_value_names_solver_option_and_domain():
    f, z0 = tanh_cell()
    with pytest.raises(
        ConfigError, match=r"solver 'anderson': m must be a positive integer, got 0"
    ):
        get("anderson")(f, z0, max_iter=5, tol=1e-3, m=0)
    with pytest.raises(
        ConfigError, match=r"fixed_point': tau must be a number in \(0, 1\], got 0.0"
    ):
        get("fixed_point")(f, z0, max_iter=5, tol=1e-3, tau=0.0)


@pytest.mark.parametrize("name", BUILTINS)
def test_options_declared_and_validated_once(name, monkeypatch):
    """Every built-in declares a pydantic options model (deqbench.solvers.base.solver); a call
    validates a given option dict once (cached), never again inside later solves."""
    from deqbench.solvers import base

    fn = get(name)
    model = base.solver_options_model(fn)
    assert model is not None and fn.OPTIONS == set(model.model_fields)
    assert base.COMMON_OPTIONS <= fn.OPTIONS or name in ("forward_backward", "peaceman_rachford")
    calls = []
    real = base.parse_options
    monkeypatch.setattr(base, "parse_options", lambda *a: calls.append(a) or real(*a))
    if structure_of(fn) is not None:  # a structured solver rejects a plain map after validation
        for _ in range(3):
            with pytest.raises(ConfigError, match="needs a model with a monotone"):
                fn(lambda z: z, torch.zeros(2, 3), max_iter=3, tol=1e-3, protect_thres=1234.5)
    else:
        for _ in range(3):
            fn(lambda z: 0.5 * z, torch.zeros(2, 3), max_iter=3, tol=1e-3, protect_thres=1234.5)
    assert len(calls) == 1


def test_options_tables_cover_every_solver_and_option():
    """The docs' options tables (<!-- deqbench:solver-options -->) are generated from the
    models: every built-in solver has a section, every option a row with its description."""
    from deqbench.solvers.base import option_domain, options_markdown, solver_options_model

    text = options_markdown()
    for name in BUILTINS:
        model = solver_options_model(get(name))
        section = text.split(f"#### `{name}`\n", 1)[1].split("####", 1)[0]
        for key, field in model.model_fields.items():
            (row,) = [r for r in section.splitlines() if r.startswith(f"| `{key}` |")]
            assert option_domain(model, key) in row and field.description, (name, key)


def test_suite_checks_solver_option_values_when_built(tmp_path):
    from deqbench.run.suite import load_suite

    p = tmp_path / "s.yaml"
    p.write_text(
        "schema: 1\nname: t\ndevice: cpu\nseeds: [0]\n"
        "data: {name: digits, flatten: true, train_subset: 64, test_subset: 32}\n"
        "defaults:\n  model: {name: fc_deq_tiny}\n  solver: {name: anderson, m: 0}\n"
        "  backward: {name: ift, solver: broyden, on_full: drop}\n"
        "  train: {epochs: 1, batch_size: 32}\nanalyses: [metrics]\n"
    )
    with pytest.raises(ConfigError) as exc:
        load_suite(p)
    assert "defaults.solver.m: must be a positive integer, got 0" in str(exc.value)
    assert "defaults.backward.on_full: must be 'restart' or 'ring', got 'drop'" in str(exc.value)


def test_reference_counts_small_conv_like():
    """A relative regularisation lambda keeps Anderson well below fixed point at tight tol."""
    f, z0 = tanh_cell()
    _, fp = get("fixed_point")(f, z0, max_iter=300, tol=1e-10)
    _, an = get("anderson")(f, z0, max_iter=300, tol=1e-10)
    _, an_abs = get("anderson")(f, z0, max_iter=300, tol=1e-10, lam=0.0, lam_abs=1e-4)
    assert an.converged and an.nstep < 0.7 * fp.nstep
    # an absolute lambda of 1e-4 degrades Anderson once ||g||^2 falls below it
    assert an_abs.nstep > an.nstep


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ROOT_FINDERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_matches_cpu(dtype, name):
    f, z0 = tanh_cell(dtype)
    a, b = symmetric(dtype=dtype)
    ac, bc = a.cuda(), b.cuda()

    def fc(z):
        return torch.tanh(z @ ac.T + bc)

    # the reversible solver keeps its states in float64 (its reversal needs them) and reports
    # the residual of that state, which it hands to its backward with keep_state
    opts = {"keep_state": True} if name == "reversible" else {}
    z, st = get(name)(f, z0, max_iter=300, tol=1e-6, **opts)
    zc, stc = get(name)(fc, z0.cuda(), max_iter=300, tol=1e-6, **opts)
    assert stc.converged and abs(stc.nstep - st.nstep) <= 1
    assert torch.allclose(zc.cpu(), z, atol=1e-4)
    if opts:
        zs = stc.extra["state"][0]
        _, r = residuals(fc(zs.to(dtype)).to(zs.dtype), zs)
    else:
        _, r = residuals(fc(zc), zc)
    torch.testing.assert_close(stc.rel_residual, r)


@pytest.mark.parametrize("name", CHUNKED)
def test_chunked_layout_matches(name, monkeypatch):
    """The CUDA layout (each sample's vector as c chunks for the batched products) on CPU."""
    f, z0 = tanh_cell()
    z_ref, st_ref = get(name)(f, z0, max_iter=100, tol=1e-10)
    mod = importlib.import_module(get(name).__module__)
    monkeypatch.setattr(mod, "chunking", lambda bsz, dim, device: (4, dim // 4))
    for opts in ({}, {"cuda_graph": True}) if supports_graph(get(name)) else ({},):
        z, st = get(name)(f, z0, max_iter=100, tol=1e-10, **opts)
        assert st.converged and abs(st.nstep - st_ref.nstep) <= 1
        torch.testing.assert_close(z, z_ref, rtol=0, atol=1e-9)


def _dense_broyden_iterates(A, b, x0, memory, steps):
    """Broyden's first method with a dense inverse-Jacobian estimate per sample, restarting
    from B = -I (then updated with the step that was just taken) when ``memory`` updates are
    stored: the points f is evaluated at."""
    n = x0.shape[1]
    out = []
    for x in x0:
        B = -torch.eye(n, dtype=x.dtype)
        g = A @ x + b - x
        dx = -B @ g
        pts, k = [x.clone()], 0
        for _ in range(steps):
            xn = x + dx
            pts.append(xn.clone())
            gn = A @ xn + b - xn
            if k >= memory:
                B, k = -torch.eye(n, dtype=x.dtype), 0
            dg = gn - g
            v = B.T @ dx
            B = B + torch.outer((dx - B @ dg) / (v @ dg), v)
            k += 1
            x, g, dx = xn, gn, -B @ gn
        out.append(torch.stack(pts))
    return torch.stack(out, 1)  # (steps + 1, batch, n)


@pytest.mark.parametrize(
    "memory,line_search", [(2, False), (3, False), (5, False), (3, True), (5, True)]
)
def test_broyden_iterates_match_dense_broyden_through_restarts(memory, line_search):
    """Every point f is evaluated at equals a dense Broyden's, before and after restarts (the
    first update after a restart used the old matrix's step shortcuts: wrong from there on).
    With line search, cases where every full step decreases ||g|| enough (no backtracking,
    which the reference does not model)."""
    g = torch.Generator().manual_seed(1)
    n = 12
    M = torch.randn(n, n, generator=g, dtype=torch.float64)
    A = 0.5 * (M + M.T)
    A *= 0.9 / torch.linalg.matrix_norm(A, 2)
    b = torch.randn(n, generator=g, dtype=torch.float64)
    x0 = torch.zeros(2, n, dtype=torch.float64)
    seen = []

    def f(z):
        seen.append(z.detach().clone())
        return z @ A.T + b

    steps = 3 * memory + 2
    opts = {"memory": memory, "stagnation": False, "line_search": line_search}
    deqbench.solvers.get("broyden")(f, x0, max_iter=steps + 1, tol=1e-30, **opts)
    ref = _dense_broyden_iterates(A, b, x0, memory, steps)
    got = torch.stack(seen)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("name", GENERIC)
def test_bad_map_or_start_is_a_solver_error_naming_the_solver(name):
    from deqbench.solvers.base import SolverOptionError

    solve = deqbench.solvers.get(name)
    with pytest.raises(
        SolverOptionError, match=rf"solver '{name}': f maps .* \(2, 4\) to .* \(2, 3\)"
    ):
        solve(lambda z: z[:, :3], torch.zeros(2, 4), max_iter=5, tol=1e-3)
    with pytest.raises(SolverOptionError, match=rf"solver '{name}': z0 must be a floating-point"):
        solve(lambda z: z, torch.zeros(2, 4, dtype=torch.long), max_iter=5, tol=1e-3)
