"""deqbench.performance.measure: timing bookkeeping, f-evaluation counting, memory plumbing (no timing
assertions: only counts, layouts and deterministic memory quantities are checked)."""

from __future__ import annotations

import math

import pytest
import torch

import deqbench
from deqbench.deq import BackwardConfig, configure
from deqbench.performance.measure import (
    MIB,
    CountingMap,
    Memory,
    Timing,
    cpu_peak_rss,
    flags,
    gpu_peak_memory,
    numeric_flags,
    saved_tensor_bytes,
    set_threads,
    solver_time_to_tol,
    time_fn,
    time_phases,
)


@pytest.fixture(autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def test_timing_summary_and_rows():
    t = Timing([0.010, 0.012, 0.011, 0.030, 0.011], threads=1, warmup=2)
    assert t.median == pytest.approx(0.011)
    assert t.q1 == pytest.approx(0.011) and t.q3 == pytest.approx(0.012)
    assert t.iqr == pytest.approx(0.001)
    assert t.spread == pytest.approx(0.001 / 0.011)
    assert not t.noisy
    rows = t.rows("eval_ms", variant="v", step=3)
    per_repeat = [r for r in rows if r.metric == "eval_ms"]
    assert [r.repeat for r in per_repeat] == [0, 1, 2, 3, 4]
    assert per_repeat[3].value == pytest.approx(30.0) and per_repeat[3].unit == "ms"
    names = [r.metric for r in rows if r.metric != "eval_ms"]
    assert names == ["eval_ms_median", "eval_ms_iqr", "eval_ms_spread"]  # no CPU times given
    cpu = Timing([0.01, 0.02], cpu_times=[0.004, 0.006]).rows("t")
    assert [r.metric for r in cpu][-1] == "t_cpu_median" and cpu[-1].value == pytest.approx(5.0)
    assert all(r.variant == "v" and r.step == 3 and r.status == "ok" for r in rows)
    assert all(r.note == "" for r in rows)

    noisy = Timing([1.0, 2.0, 3.0, 4.0])
    assert noisy.noisy
    med = [r for r in noisy.rows("x") if r.metric == "x_median"][0]
    assert "noisy" in med.note and "> 10%" in med.note


def test_time_fn_and_phases_store_every_repeat():
    calls = []

    def step(mark):
        calls.append("a")
        mark("forward")
        calls.append("b")
        return len(calls)

    out = time_phases(step, ("forward", "backward"), repeats=4, warmup=2)
    assert set(out) == {"forward", "backward", "total"}
    assert len(calls) == 2 * (4 + 2)
    for t in out.values():
        assert len(t.times) == 4 and len(t.cpu_times) == 4
        assert t.method == "perf_counter" and t.threads == 1 and t.warmup == 2
        assert all(x >= 0 for x in t.times)
    # the step's return value of every timed repeat is kept (counts measured in the same repeat)
    assert out["total"].results == [6, 8, 10, 12]
    for f, b, tot in zip(out["forward"].times, out["backward"].times, out["total"].times):
        assert f + b == pytest.approx(tot, abs=1e-6)
    with pytest.raises(ValueError, match="marked"):
        time_phases(lambda mark: None, ("forward", "backward"), repeats=1, warmup=0)

    setups = []
    t = time_fn(lambda: 7, repeats=3, warmup=1, setup=lambda: setups.append(1))
    assert t.results == [7, 7, 7] and len(setups) == 4


def test_threads_and_flags_restored():
    assert set_threads(1) == 1
    before = flags()
    with numeric_flags(tf32=True) as f:
        assert f["tf32_matmul"] and f["tf32_cudnn"]
    assert flags() == before


def test_counting_map_counts_and_forwards_attributes():
    class F:
        u = "injection"

        def __call__(self, z):
            return z + 1

    f = CountingMap(F())
    f(torch.zeros(2))
    f(torch.zeros(2))
    assert f.n == 2 and f.u == "injection"


def test_solver_time_to_tol_counts_in_the_same_repeat():
    fp = deqbench.solvers.get("fixed_point")

    def f(z):
        return 0.5 * torch.tanh(z) + 1.0

    z0 = torch.zeros(4, 8)
    st = solver_time_to_tol(fp, f, z0, max_iter=100, tol=1e-6, repeats=3, warmup=1, t_f=1e-3)
    assert len(st.timing.times) == 3 and len(st.nfe) == 3
    assert st.nfe == [st.stats.nstep] * 3  # the wrapper's count is the solver's own count
    assert st.rel_residual < 1e-6 and st.abs_residual < 1e-5
    assert st.t_f == pytest.approx(1e-3)
    assert st.overheads == [t / (n * 1e-3) for t, n in zip(st.timing.times, st.nfe)]

    seen = {}

    def fake(f, z0, *, max_iter, tol, stop_mode="rel", **options):
        seen.update(options)
        return fp(f, z0, max_iter=max_iter, tol=tol, stop_mode=stop_mode)

    fake.OPTIONS = {"check_returned"}
    solver_time_to_tol(fake, f, z0, max_iter=50, tol=1e-4, repeats=1, warmup=0, t_f=1.0)
    assert seen == {"check_returned": False}  # timed without the adapter's extra check


def test_saved_tensor_bytes_ift_flat_unrolled_linear():
    torch.manual_seed(0)
    model = deqbench.models.create("fc_deq_tiny", in_shape=(12,), num_outputs=3, width=16)
    x = torch.randn(8, 12)

    def saved(k, mode):
        configure(model, backward=BackwardConfig(mode, k=k))
        return saved_tensor_bytes(lambda: model(x).sum())[0]

    un = [saved(k, "unrolled") for k in (2, 4, 8)]
    ift = [saved(k, "ift") for k in (2, 4, 8)]
    assert ift[0] == ift[1] == ift[2] > 0
    assert un[0] < un[1] < un[2]
    assert un[2] - un[1] == 2 * (un[1] - un[0])  # linear in K


class AllocStep:
    """Allocates and fills 32 MiB (picklable: a module-level class)."""

    def __call__(self):
        return torch.ones(8 * 2**20).sum()


def test_cpu_peak_rss_in_fresh_worker():
    mem = cpu_peak_rss(AllocStep(), warmup=1, threads=1, timeout=300)
    assert mem.method == "rss_fresh_worker", mem.note
    assert mem.peak_mib >= 30, mem
    assert mem.baseline_bytes > 0
    row = mem.row("peak_memory", variant="v")
    assert row.unit == "MiB" and row.status == "ok" and "rss_fresh_worker" in row.note
    skipped = Memory(math.nan, note="off").row("peak_memory")
    assert skipped.status == "skipped" and math.isnan(skipped.value)


@pytest.mark.gpu
def test_gpu_peak_memory_counts_the_step_only():
    dev = torch.device("cuda")
    keep = torch.ones(4 * 2**20, device=dev)  # in the baseline, not the peak
    mem = gpu_peak_memory(lambda: torch.ones(8 * 2**20, device=dev).sum(), dev)
    assert mem.method == "cuda_max_memory_allocated"
    assert 32 * MIB <= mem.peak_bytes < 40 * MIB
    del keep


@pytest.mark.slow  # several seconds on 2 cores: out of the fast lane
def test_cpu_peak_rss_of_a_train_step_counts_its_gradients():
    """The step's own .grad (8 MiB here, everything else tiny) is in its peak, not in the
    baseline: gradients left by the warm-up step must not be freed inside the measured step."""
    from deqbench.performance._perf import TrainStep

    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 2048, bias=False)  # weight and its gradient: 8 MiB each
    x, y = torch.randn(1, 1024), torch.randn(1, 2048)
    step = TrainStep(model, x, y, "regression", {"optimizer": "sgd", "momentum": 0.0})
    step()
    assert all(p.grad is None for p in model.parameters())  # nothing held between steps
    mem = cpu_peak_rss(step, warmup=1, threads=1, timeout=300)
    assert mem.method == "rss_fresh_worker", mem.note
    assert 7.5 <= mem.peak_mib < 20, mem  # before the fix: ~0 (grads in the baseline)


class _LambdaNet(torch.nn.Module):
    """A model holding a lambda (cannot be pickled), allocating 32 MiB in its forward."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)
        self.act = lambda t: torch.tanh(t)

    def forward(self, x):
        big = torch.ones(8 * 2**20, dtype=x.dtype, device=x.device)
        return self.act(self.lin(x)) + 0 * big.sum()


def test_throughput_measures_the_peak_memory_of_a_model_that_cannot_be_pickled():
    from deqbench.performance.throughput import measure_throughput, throughput_rows

    torch.manual_seed(0)
    model = _LambdaNet()
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    res = measure_throughput(model, x, y, task="regression", repeats=1, warmup=1,
                             train={"optimizer": "sgd"})  # fmt: skip
    for kind in ("eval", "train"):
        mem = res[f"{kind}_memory"]
        assert mem.method == "rss_in_process", mem
        assert math.isfinite(mem.peak_bytes) and mem.peak_mib >= 30, mem
        assert "cannot be pickled" in mem.note and "in this process" in mem.note
    rows = {r.metric: r for r in throughput_rows(res, 4)}
    row = rows["eval_peak_memory"]
    assert row.status == "ok" and math.isfinite(row.value)
    assert "rss_in_process" in row.note and "cannot be pickled" in row.note


class _PerBatchBuffer(torch.nn.Module):
    """Keeps per-batch state in a buffer shaped by the batch (as some solvers do), plus a
    running statistic of a fixed shape and a buffer it registers on its first forward."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.register_buffer("state", torch.zeros(5, 3))
        self.register_buffer("running", torch.zeros(3))

    def forward(self, x):
        self.state = x.detach().clone()  # a new shape for a new batch size
        self.running.add_(1.0)
        if not hasattr(self, "lazy"):
            self.register_buffer("lazy", torch.ones(1))
        return self.lin(x)


def test_preserved_restores_buffers_that_change_shape_per_batch():
    from deqbench.performance._perf import preserved

    model = _PerBatchBuffer()
    state = model.state.clone()
    with preserved(model):
        model(torch.randn(2, 3))
        assert model.state.shape == (2, 3)
    assert model.state.shape == (5, 3) and torch.equal(model.state, state)
    assert torch.equal(model.running, torch.zeros(3))
    assert "lazy" not in dict(model.named_buffers())
    assert sorted(n for n, _ in model.named_buffers()) == ["running", "state"]
    model(torch.randn(7, 3))  # the model still runs, at another batch size
