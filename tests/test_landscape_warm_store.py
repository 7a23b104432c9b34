"""Where warm-started landscapes keep their solved fixed points (``warm_store``): in host memory
only the few states a point reads are on the solve's device, the solves are bit-identical to
keeping every state on the device, and the keeper never holds more than two grid rows (plus
three points) of fixed points."""

from __future__ import annotations

import pytest
import torch

import deqbench
from deqbench import landscape as ls
from deqbench.deq import SolverConfig, configure
from deqbench.errors import ConfigError
from deqbench.landscape import warm_start as ws

torch.set_num_threads(1)

# every per-point column the warm solves determine
_COLS = [
    "alpha",
    "beta",
    "loss_raw",
    "accuracy",
    "f_nstep",
    "f_residual",
    "f_abs_residual",
    "f_converged_frac",
    "converged",
    "status",
    "init",
    "warm_frac",
    "predicted_frac",
    "warm_retried",
    "init_alpha",
    "init_beta",
]


class _Spy:
    """What a warm-start keeper holds at every layer call and after every recorded solve,
    read from its containers (not from its own counters)."""

    def __init__(self, monkeypatch) -> None:
        self.points = 0
        self.near = 0
        self.kept_on_device = 0
        pre, post = ws._WarmStart._pre, ws._WarmStart._post

        def spy_pre(keeper, *a):
            out = pre(keeper, *a)
            self.look(keeper)
            return out

        def spy_post(keeper, *a):
            post(keeper, *a)
            self.look(keeper)

        monkeypatch.setattr(ws._WarmStart, "_pre", spy_pre)
        monkeypatch.setattr(ws._WarmStart, "_post", spy_post)

    def look(self, keeper) -> None:
        self.points = max(self.points, len(keeper.store))
        near = getattr(keeper, "near", {})
        self.near = max(self.near, sum(z.nbytes for z in near.values()))
        if not getattr(keeper, "host", False):
            kept = sum(z.nbytes for d in keeper.store.values() for z, _ in d.values())
            self.kept_on_device = max(self.kept_on_device, kept)


def _conv(max_iter=30):
    torch.manual_seed(0)
    m = deqbench.models.create("conv_deq_tiny").eval()
    configure(m, SolverConfig("anderson", max_iter=max_iter, tol=1e-4))
    g = torch.Generator().manual_seed(2)
    X = torch.randn(8, 1, 8, 8, generator=g)
    y = torch.randint(0, 10, (8,), generator=g)
    return m, X, y


def test_host_store_same_solves_with_a_few_states_on_the_device(monkeypatch):
    """7 x 7 conv grid: ``host`` and ``device`` give the same
    rows bit for bit; on the device ``host`` holds at most six point states (five sources and
    the new one) where ``device`` holds two rows and three points (2 x 7 + 3 = 17)."""
    m, X, y = _conv()
    dirs = ls.resolve_directions(m, ls.random_directions(m, 2, seed=0))
    ax = ls.axis(7, -1.0, 1.0)
    state = X.shape[0] * 16 * 8 * 8 * 4  # one point's fixed points: 8 x 16 x 8 x 8 float32
    runs = {}
    for store in ("device", "host"):
        spy = _Spy(monkeypatch)
        df = ls.evaluate_grid(
            m, dirs, X, y, alphas=ax, betas=ax, warm_start="neighbour", warm_store=store
        )
        monkeypatch.undo()
        runs[store] = (df, spy)
    (dev, sd), (host, sh) = runs["device"], runs["host"]
    assert dev.attrs["warm_store"] == "device" and host.attrs["warm_store"] == "host"
    assert dev[_COLS].equals(host[_COLS])
    assert (dev["init"] == "neighbour").any() and (dev["predicted_frac"] > 0).any()
    # every fixed point kept, wherever it lives: two rows and three points
    assert sd.points == sh.points == 2 * len(ax) + 3
    assert dev.attrs["warm_kept_peak_points"] == host.attrs["warm_kept_peak_points"] == sd.points
    assert sd.kept_on_device >= (2 * len(ax) + 3) * state
    assert dev.attrs["warm_device_peak_bytes"] >= sd.kept_on_device
    # on the device with the host store: the states one point reads and its own
    assert 0 < sh.near <= 6 * state
    assert sh.kept_on_device == 0
    assert sh.near <= host.attrs["warm_device_peak_bytes"] <= 6 * state + 6 * X.shape[0]


def test_host_store_per_evaluation_batch_and_retries(monkeypatch):
    """With several evaluation batches the device copies are those of the current batch, and
    a point solved again cold (the retry) replaces its kept fixed points: same rows as the
    device store, bit for bit, on a plane where most warm points are retried."""
    torch.manual_seed(0)
    m = deqbench.models.create("fc_deq_tiny", in_shape=(4,), width=8, num_outputs=3).double()
    configure(m, SolverConfig("fixed_point", max_iter=40, tol=1e-8))
    with torch.no_grad():
        W = m.deq.cell.W.weight
        W.mul_(0.5 / torch.linalg.matrix_norm(W, 2))
    g = torch.Generator().manual_seed(1)
    X = torch.randn(32, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (32,), generator=g)
    dirs = ls.resolve_directions(m, ls.random_directions(m, 2, seed=0))
    ax = ls.axis(7, -4.0, 4.0)
    kw = dict(alphas=ax, betas=ax, warm_start="neighbour", batch_size=12)
    dev = ls.evaluate_grid(m, dirs, X, y, warm_store="device", **kw)
    spy = _Spy(monkeypatch)
    host = ls.evaluate_grid(m, dirs, X, y, warm_store="host", **kw)
    assert dev[_COLS].equals(host[_COLS])
    assert host["warm_retried"].sum() > 10
    batch_state = 12 * 8 * 8  # 12 examples x width 8, float64
    assert 0 < spy.near <= 6 * batch_state
    kept = dev.attrs["warm_kept_peak_bytes"]
    assert kept == host.attrs["warm_kept_peak_bytes"] >= (2 * 7 + 3) * 32 * 8 * 8
    assert host.attrs["warm_device_peak_bytes"] <= 6 * batch_state < kept


def test_warm_store_values():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert ls.warm_store_mode("auto", cpu) == "device"
    assert ls.warm_store_mode("auto", cuda) == "host"
    assert ls.warm_store_mode(None, cuda) == "host"
    assert (
        ls.warm_store_mode("Host", cpu) == "host" and ls.warm_store_mode("device", cuda) == "device"
    )
    with pytest.raises(ConfigError, match="warm_store"):
        ls.warm_store_mode("disk", cpu)
    m, X, y = _conv(max_iter=5)
    dirs = ls.resolve_directions(m, ls.random_directions(m, 1, seed=0))
    df = ls.evaluate_grid(m, dirs, X, y, alphas=ls.axis(3), warm_start="neighbour")
    assert df.attrs["warm_store"] == "device"  # auto, on the CPU
    off = ls.evaluate_grid(m, dirs, X, y, alphas=ls.axis(3))
    assert "warm_store" not in off.attrs  # no warm start, nothing kept


@pytest.mark.gpu
def test_host_store_on_cuda_same_solves_less_device_memory():
    """On CUDA (pinned host copies, asynchronous transfers): the same rows as the device store,
    bit for bit, and a lower peak of allocated device memory."""
    dev_ = torch.device("cuda")
    torch.manual_seed(0)
    m = deqbench.models.create("conv_deq_tiny").to(dev_).eval()
    configure(m, SolverConfig("anderson", max_iter=30, tol=1e-4))
    g = torch.Generator().manual_seed(2)
    X = torch.randn(256, 1, 8, 8, generator=g).to(dev_)
    y = torch.randint(0, 10, (256,), generator=g).to(dev_)
    dirs = ls.resolve_directions(m, ls.random_directions(m, 2, seed=0))
    ax = ls.axis(9, -1.0, 1.0)
    runs, peaks = {}, {}
    for store in ("device", "host"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        runs[store] = ls.evaluate_grid(
            m, dirs, X, y, alphas=ax, betas=ax, warm_start="neighbour", warm_store=store
        )
        peaks[store] = torch.cuda.max_memory_allocated()
    assert runs["device"][_COLS].equals(runs["host"][_COLS])
    state = 256 * 16 * 8 * 8 * 4
    assert peaks["device"] - peaks["host"] >= 10 * state  # 21 kept on the device vs <= 6
