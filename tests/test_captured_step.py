"""Captured training steps (``train.capture``): the step as parts whose solves stop on the device.

On the CPU the parts run eagerly: the losses, the solver counts and the parameters must equal
the eager training path's bit for bit in float64 (the masked solves stop at the eager solver's
step, with its iterate); on CUDA the captured graphs must agree with the eager path within
float32 rounding. Unsupported cells are a ConfigError naming why."""

from __future__ import annotations

import math

import pytest
import torch

from deqbench.core.errors import ConfigError
from deqbench.data.base import load_data
from deqbench.run.captured_step import MaskedSolve, capture_problem
from deqbench.run.suite import one_cell_suite
from deqbench.run.train import train

SOLVER = {"name": "fixed_point", "max_iter": 60, "tol": 1e-6, "stop": "batch_fro"}
BACKWARD = {"name": "ift", "solver": "fixed_point", "max_iter": 60, "tol": 1e-6}


def build(model, device="cpu", dtype=torch.float64, solver=SOLVER, backward=BACKWARD, **train_kw):
    from deqbench.core import deq
    from deqbench.core.registry import inits, models
    from deqbench.run.task import seed_everything

    suite = one_cell_suite(
        "captured", model=model, analyses=[], data={"name": "digits", "split": 0.8, "seed": 0},
        solver=solver, backward=backward, device=device,
        train={"epochs": 1, "batch_size": 32, "optimizer": "adamw", "lr": 3e-3,
               "weight_decay": 0.01, "eval_before": False, **train_kw},
    )  # fmt: skip
    cell = suite.cells[0]
    data = load_data("digits", split=0.8, seed=0)
    seed_everything(0)
    mname, mparams = cell.model_params()
    m = models.create(mname, in_shape=data.in_shape, num_outputs=data.num_outputs, **mparams)
    m = m.to(device=device, dtype=dtype)
    inits.get(cell.init_params()[0])(m, seed=0)
    deq.configure(m, cell.solver_config(), cell.backward_config())
    return m, cell.train_config(), data.to(torch.device(device), dtype)


class Steps:
    def __init__(self):
        self.rows = []

    def on_step(self, ctx, info):
        self.rows.append(dict(info.deq, loss=info.loss))

    def on_epoch(self, ctx, info):
        return None


def fit(capture, model, steps=12, **kw):
    m, cfg, data = build(model, **kw)
    cfg.capture, cfg.max_steps = capture, steps
    rec = Steps()
    res = train(m, data, cfg, callbacks=[rec], seed=0)
    return res, rec.rows, m


@pytest.mark.parametrize(
    "model",
    [
        {"name": "pcdeq_l", "width": 24},
        {"name": "fc_deq", "width": 24},
        {"name": "pcdeq_sc", "channels": 4},  # a stage's finish and the head apart
        {"name": "pcdeq_mc", "channels": [4, 6, 8]},  # three DEQ layers in a chain
    ],
)
def test_captured_steps_equal_the_eager_path_on_cpu(model):
    r0, s0, m0 = fit(False, model)
    r1, s1, m1 = fit(True, model)
    assert r0.status == r1.status == "ok" and len(s0) == len(s1) == 12
    keys = ("loss", "forward_nstep", "backward_nstep", "forward_converged", "backward_converged")
    for a, b in zip(s0, s1):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
        assert a["forward_rel_residual"] == pytest.approx(b["forward_rel_residual"], rel=1e-9)
    assert all(s["forward_nstep"] > 2 for s in s1)
    for p, q in zip(m0.parameters(), m1.parameters()):
        assert torch.equal(p, q)
    for p, q in zip(m0.buffers(), m1.buffers()):  # BatchNorm's running statistics too
        assert torch.equal(p, q)
    layers = 3 if model["name"] == "pcdeq_mc" else 1  # a solve a layer a step in the ledger
    assert r1.forward.batches == r0.forward.batches == 12 * layers
    assert r1.adjoint.batches == r0.adjoint.batches == 12 * layers
    assert r1.forward.missed == r0.forward.missed == r1.adjoint.missed == r0.adjoint.missed == 0


def test_partial_last_batch_takes_its_own_captured_parts():
    """1,438 training images at batch 96: every epoch ends with a batch of 94, whose step has
    its own static buffers; two epochs equal the eager path bit for bit."""
    model = {"name": "pcdeq_l", "width": 16}
    r0, s0, m0 = fit(False, model, steps=18, batch_size=96, epochs=2)
    r1, s1, m1 = fit(True, model, steps=18, batch_size=96, epochs=2)
    assert r0.status == r1.status == "ok" and len(s1) == 18 and r1.steps_per_epoch == 15
    assert [a["loss"] for a in s0] == [b["loss"] for b in s1]
    for p, q in zip(m0.parameters(), m1.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("capture", [False, True])
def test_a_diverged_forward_stops_training_without_an_update(capture):
    """A NaN forward solve at the first step: training stops there, as on the eager path, and
    no parameter changes (the captured step reads the forward's verdict before its backward)."""
    m, cfg, data = build({"name": "pcdeq_l", "width": 24})
    with torch.no_grad():
        next(m.deq.cell.parameters()).fill_(float("nan"))
    before = [p.detach().clone() for p in m.parameters()]
    cfg.capture, cfg.max_steps = capture, 3
    res = train(m, data, cfg, seed=0)
    assert res.status == "nan" and res.steps == 0
    assert "forward solver produced a non-finite residual" in res.note
    assert all(torch.allclose(p, q, equal_nan=True, rtol=0, atol=0)
               for p, q in zip(before, m.parameters()))  # fmt: skip


def test_a_diverged_middle_stage_stops_training_as_the_eager_path_does():
    """MC: a NaN in the second stage's cell. Both paths solve every stage, stop before the
    backward with the same status and note, and change no parameter; the BatchNorm statistics
    up to the last equilibrium moved alike (the eager path also ran the readout's forward, the
    last stage's finish among it; the captured step stops before it)."""
    runs = []
    for capture in (False, True):
        m, cfg, data = build({"name": "pcdeq_mc", "channels": [4, 6, 8]})
        with torch.no_grad():
            next(m.stages[1].deq.cell.parameters()).fill_(float("nan"))
        before = [p.detach().clone() for p in m.parameters()]
        cfg.capture, cfg.max_steps = capture, 3
        res = train(m, data, cfg, seed=0)
        assert res.steps == 0 and res.status in ("nan", "diverged"), (res.status, res.note)
        assert all(torch.allclose(p, q, equal_nan=True, rtol=0, atol=0)
                   for p, q in zip(before, m.parameters()))  # fmt: skip
        assert all(ly.last_forward_stats is not None for ly in m.pc_layers())  # all solved
        runs.append((res, m))
    (r0, m0), (r1, m1) = runs
    assert (r0.status, r0.note) == (r1.status, r1.note)
    after = {n for n, _ in m0.named_buffers() if n.startswith("stages.2.bn_out")}
    b1 = dict(m1.named_buffers())
    for n, p in m0.named_buffers():
        if n not in after:
            assert torch.allclose(p, b1[n], equal_nan=True, rtol=0, atol=0), n


class _Replay:
    """A stand-in for a CUDA graph on the CPU: recorded, not run; ``replay`` runs the part."""

    def __init__(self, fn):
        self.fn = fn

    def replay(self):
        self.fn()

    def pool(self):
        return None


@pytest.mark.parametrize(
    "fails, nth, lr_drop",
    [
        ("middle", 1, None),  # at the first captured step: the injection's BatchNorm ran
        ("update", 1, None),  # the same, the head's BatchNorm ran too
        ("update", 2, [3]),  # captured again after the LR drop at step 3, both ran again
    ],
)
def test_a_capture_failing_midway_reruns_the_step_from_its_buffers(fails, nth, lr_drop,
                                                                    monkeypatch):  # fmt: skip
    """The captured path's parts as stand-in graphs on the CPU, and the nth capture of one part
    failing after BatchNorm layers ran in the parts replayed before it in that step. The step
    starts again on the eager parts from the buffers it started with: parameters and BatchNorm
    statistics equal the eager path's bit for bit (not moved twice), and the failure is a
    warning."""
    from deqbench.run import captured_step as cs

    init = cs.CapturedStep.__init__
    seen = []

    def on_a_device(self, *a, **kw):  # the step's CUDA branch, its graphs the stand-ins
        init(self, *a, **kw)
        self.cuda = True

    def record(self, fn):
        if getattr(fn, "__name__", "") == f"_{fails}":  # the bound part, not a lambda
            seen.append(fn)
            if len(seen) == nth:
                raise RuntimeError("operation not permitted when stream is capturing")
        return _Replay(fn)

    monkeypatch.setattr(cs.CapturedStep, "__init__", on_a_device)
    monkeypatch.setattr(cs.CapturedStep, "_record", record)
    model, kw = {"name": "pcdeq_sc", "channels": 4}, {}
    if lr_drop:
        kw = {"lr_milestone_steps": lr_drop, "gamma": 0.1}
    r0, s0, m0 = fit(False, model, steps=5, **kw)
    with pytest.warns(RuntimeWarning, match="eager parts from now on"):
        r1, s1, m1 = fit(True, model, steps=5, **kw)
    assert len(seen) == nth
    assert r0.status == r1.status == "ok" and [a["loss"] for a in s0] == [b["loss"] for b in s1]
    for p, q in zip(m0.parameters(), m1.parameters()):
        assert torch.equal(p, q)
    for (n, p), q in zip(m0.named_buffers(), m1.buffers()):
        assert torch.equal(p, q), n
    start = dict(build(model)[0].named_buffers())  # the statistics moved in training
    assert all(not torch.equal(start[n], p) for n, p in m1.named_buffers() if "running" in n)


def test_a_solve_as_long_as_the_last_stops_at_the_end_of_its_first_chunk(monkeypatch):
    """The chunk plan on the captured path (stand-in graphs on the CPU): a solve that takes as
    many steps as at the last step runs exactly those masked steps (its first chunk, no step
    past its stop); a shorter one runs to the end of its first chunk, a longer one past its
    stop by less than one later chunk."""
    from deqbench.run import captured_step as cs

    init, solve, masked = cs.CapturedStep.__init__, cs.CapturedStep._solve, cs.MaskedSolve.step
    made, solves = [0], []

    def on_a_device(self, *a, **kw):
        init(self, *a, **kw)
        self.cuda = True

    def counted(self, fn):
        made[0] += 1
        masked(self, fn)

    def logged(self, kind, k, s, fn, tail):
        made[0], last = 0, self.last_count.get((kind, k))
        row = solve(self, kind, k, s, fn, tail)
        solves.append((last, int(row[1]), made[0]))
        return row

    monkeypatch.setattr(cs.CapturedStep, "__init__", on_a_device)
    monkeypatch.setattr(cs.CapturedStep, "_record", lambda self, fn: _Replay(fn))
    monkeypatch.setattr(cs.MaskedSolve, "step", counted)
    monkeypatch.setattr(cs.CapturedStep, "_solve", logged)
    r, _, _ = fit(True, {"name": "pcdeq_sc", "channels": 4}, steps=12)
    assert r.status == "ok"
    repeats = [(n, m) for last, n, m in solves if last == n]
    assert len(repeats) >= 5 and any(n not in (2, 4, 8, 16, 32, 64) for n, _ in repeats)
    assert all(m == n for n, m in repeats), repeats
    for last, n, m in solves:
        if last is not None:
            first, more = cs.plan(last)
            assert m == (first if n <= first else n + -(n - first) % more), (last, n, m)


def test_captured_step_records_read_no_residual_tensor(monkeypatch):
    """The step's records (the solves' residual maxima in ``last_stats``) come from the
    summary the step read, not from the per-sample tensors: on a GPU such a read would wait for
    the gradient and optimiser parts queued after the solves. They equal the maxima of the
    tensors, every layer's forward and adjoint, abs and rel."""
    from deqbench.core.deq import deq_layers
    from deqbench.solvers import stats

    reads, seen = [0], []
    batch_max = stats.batch_max

    def counted(t):
        reads[0] += 1
        return batch_max(t)

    class Reads(Steps):
        def on_step(self, ctx, info):
            n = reads[0]
            for layer in deq_layers(m):
                for st in (layer.last_forward_stats, layer.last_backward_stats):
                    assert st.maxima == (batch_max(st.abs_residual), batch_max(st.rel_residual))
            seen.append((n, info.deq["forward_rel_residual"]))

    monkeypatch.setattr(stats, "batch_max", counted)
    m, cfg, data = build({"name": "pcdeq_mc", "channels": [4, 6, 8]})
    cfg.capture, cfg.max_steps = True, 4
    assert train(m, data, cfg, callbacks=[Reads()], seed=0).status == "ok"
    assert len(seen) == 4 and all(n == 0 and 0 < r < 1e-6 for n, r in seen), seen


def test_a_model_whose_chain_misses_a_layer_is_named():
    from deqbench.core.deq import DEQModel

    m, cfg, data = build({"name": "pcdeq_mc", "channels": [4, 6, 8]})
    assert capture_problem(m, cfg) is None
    m.chain = lambda: DEQModel.chain(m)  # the one-layer default: 1 of the 3 DEQ layers
    assert "3 DEQ layers and its chain() names 1" in capture_problem(m, cfg)


def test_masked_solve_stops_where_the_budget_ends():
    z = torch.zeros(4, 3, dtype=torch.float64)
    s = MaskedSolve(z, tol=1e-30, stop_mode="rel", rule="sample_max", max_iter=5, protect=1e6)
    s.reset()
    s.steps(lambda v: 0.5 * v + 1.0, 9)  # 9 masked steps, 5 counted: the 5th iterate stays
    assert int(s.nstep) == 5 and bool(s.halt) and not bool(s.conv)
    assert torch.allclose(z, torch.full_like(z, 2 - 2 * 0.5**4))  # x_4 of x <- x/2 + 1 from 0


def test_unsupported_cells_are_named():
    m, cfg, data = build({"name": "pcdeq_l", "width": 8}, solver={**SOLVER, "name": "anderson"})
    assert "anderson" in capture_problem(m, cfg)
    cfg.capture, cfg.max_steps = True, 1
    with pytest.raises(ConfigError, match="train.capture: not for this cell: forward solver"):
        train(m, data, cfg, seed=0)


GPU_MODELS = [
    {"name": "pcdeq_l", "width": 48},
    {"name": "pcdeq_sc", "channels": 8},
    {"name": "pcdeq_mc", "channels": [8, 12, 16]},
]


def same_steps(s0, s1, layers):
    """The eager and captured solves make the same steps, but for a solve whose residual lands
    within rounding of its tolerance (the norms summed in another order): at most a step
    apart a layer, in few steps."""
    apart = [abs(a["forward_nstep"] - b["forward_nstep"]) for a, b in zip(s0, s1)]
    assert max(apart) <= layers and sum(x > 0 for x in apart) <= len(s0) // 8, apart


def fit_on_cuda(model, dtype, solver, backward, steps, monkeypatch):
    """Eager then captured training on CUDA: cuDNN deterministic (a run repeats bit for bit);
    the eager solves replay one step per graph (``graph_steps: 1``), so that they stop where
    the captured ones do (the default chunks of 2 make up to a step past the stop)."""
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    kw = {"device": "cuda", "dtype": dtype, "batch_size": 96, "epochs": 3}
    one = {"solver": {**solver, "graph_steps": 1}, "backward": {**backward, "graph_steps": 1}}
    # batch 96 of 1,438 images: each epoch's 15th step is a partial batch of 94
    r0, s0, m0 = fit(False, model, steps=steps, **one, **kw)
    r1, s1, m1 = fit(True, model, steps=steps, solver=solver, backward=backward, **kw)
    assert r0.status == r1.status == "ok" and len(s0) == len(s1) == steps
    _, _, data = build(model, device="cuda", dtype=dtype)
    m0.eval(), m1.eval()
    with torch.no_grad():  # the models' outputs on the data (Adam moves a parameter whose
        X = data.test[0][:128]  # gradient is near zero by about the LR: not the raw parameters)
        return s0, s1, m0(X).softmax(1), m1(X).softmax(1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model", GPU_MODELS)
def test_captured_steps_on_cuda_match_the_eager_path_in_float64(model, monkeypatch):
    """CUDA graphs and the fused stop test against the eager path in float64 at a tight
    tolerance (1e-10), 16 steps: the same counts (but for a solve within rounding of its
    tolerance), losses and outputs within 1e-4. Measured on
    an H200: losses within 6e-6, outputs within 2e-6 (the solves' iterates agree to their
    tolerance, and Adam's first steps move a parameter whose gradient is near its eps by up to
    lr / eps = 3e5 times that gradient's difference)."""
    tight = {"tol": 1e-10, "max_iter": 400}
    s0, s1, o0, o1 = fit_on_cuda(model, torch.float64, {**SOLVER, **tight},
                                 {**BACKWARD, **tight}, 16, monkeypatch)  # fmt: skip
    same_steps(s0, s1, 3 if model["name"] == "pcdeq_mc" else 1)
    for a, b in zip(s0, s1):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-4), (a["loss"], b["loss"])
    torch.testing.assert_close(o1, o0, rtol=0, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model", GPU_MODELS)
def test_captured_steps_on_cuda_match_the_eager_path(model, monkeypatch):
    """In float32 at the suites' settings, 32 steps: the same counts, every step's loss within
    2e-3, and the one-layer cells' outputs within 2e-2 (measured on an H200: within 0.004-0.005).
    MC's float32 outputs are not compared: its three layers carry float32's rounding through
    32 Adam steps to outputs 0.021 from the float64 run's on the eager path itself and 0.025-0.031
    between the two paths (cuDNN's TF32 off; 0.075 with it on); the float64 test above holds
    it to 1e-4."""
    layers = 3 if model["name"] == "pcdeq_mc" else 1
    if layers > 1:
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    s0, s1, o0, o1 = fit_on_cuda(model, torch.float32, SOLVER, BACKWARD, 32, monkeypatch)
    same_steps(s0, s1, layers)
    for a, b in zip(s0, s1):
        assert math.isclose(a["loss"], b["loss"], rel_tol=2e-3, abs_tol=1e-4)
    if layers == 1:
        torch.testing.assert_close(o1, o0, rtol=0, atol=2e-2)
