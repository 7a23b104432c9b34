"""Shared timing helpers (DESIGN.md "Measuring"); memory helpers
live in :mod:`deqbench.performance.memory` and are re-exported here.

* :func:`time_fn` / :func:`time_phases` warm up, then time every repeat: CUDA events on a GPU,
  ``perf_counter`` (plus thread CPU time) on the CPU, where the thread count must be set
  explicitly (:func:`set_threads`) and is recorded. Every repeat is kept in a :class:`Timing`;
  the summary is the median and the IQR, and a spread (IQR / median) above 10% is flagged.
* :func:`solver_time_to_tol` times one solver to tolerance with the f-evaluations counted by
  wrapping ``f`` (:class:`CountingMap`) in the same repeat; :func:`f_time` is t_f, the per-call
  time of f in a plain no-grad loop z <- f(z) at the same batch (no bookkeeping), so that
  overhead = time / (f-evals x t_f) is 1 for a solver whose bookkeeping is free.
* :func:`numeric_flags` sets TF32 (off for reference numbers) and :func:`flag_rows` records
  threads, TF32 and cudnn.benchmark next to the measurements.

Example:
    >>> import torch
    >>> from deqbench.performance.measure import set_threads, time_fn
    >>> set_threads(1)
    1
    >>> t = time_fn(lambda: torch.randn(64, 64) @ torch.randn(64, 64), repeats=5, warmup=1)
    >>> len(t.times), t.method
    (5, 'perf_counter')
    >>> rows = t.rows("matmul_ms")      # one row per repeat + median, IQR, spread
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..analyses.base import Row
from ..run.task import preserved_numerics as preserved_numerics  # re-exported

#: a repeat spread (IQR / median) above this is flagged as noisy
SPREAD_FLAG = 0.10


# -- environment -------------------------------------------------------------------------------


def set_threads(n: int | None = None) -> int:
    """Set torch's intra-op thread count (when ``n`` is given) and return the one in effect.

    CPU timings without an explicit thread count are meaningless on a shared machine
    (oversubscription made runs 10-100x slower)."""
    if n is not None:
        torch.set_num_threads(int(n))
    return torch.get_num_threads()


def is_cuda(device: Any) -> bool:
    return torch.device(device).type == "cuda"


def sync(device: Any) -> None:
    """Wait for the device (no-op on CPU)."""
    if is_cuda(device):
        torch.cuda.synchronize(torch.device(device))


@contextlib.contextmanager
def numeric_flags(
    tf32: bool = False, cudnn_benchmark: bool | None = None
) -> Iterator[dict[str, Any]]:
    """Set TF32 (matmul and cuDNN) and optionally ``cudnn.benchmark`` for the block, then
    restore them (:func:`preserved_numerics`). Reference numbers keep TF32 off. Yields the flags
    in effect."""
    with preserved_numerics():
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        if cudnn_benchmark is not None:
            torch.backends.cudnn.benchmark = cudnn_benchmark
        yield flags()


def flags() -> dict[str, Any]:
    """The numeric flags that change timings (recorded with every measurement)."""
    return {
        "threads": torch.get_num_threads(),
        "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
        "tf32_cudnn": bool(torch.backends.cudnn.allow_tf32),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
    }


def flag_rows(device: Any, variant: str = "", step: int | None = None) -> list[Row]:
    """Rows recording threads, TF32 and cudnn.benchmark (and the device type)."""
    f = flags()
    rows = [Row("threads", f["threads"], variant=variant, step=step, unit="threads")]
    if is_cuda(device):
        rows += [
            Row(k, float(f[k]), variant=variant, step=step)
            for k in ("tf32_matmul", "tf32_cudnn", "cudnn_benchmark")
        ]
    return rows


# -- timing ------------------------------------------------------------------------------------


def quantile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default); NaN for no values."""
    s = sorted(xs)
    if not s:
        return math.nan
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass
class Timing:
    """Every timed repeat of one measurement (seconds) and its summary.

    Attributes:
        times: wall (or CUDA event) seconds per repeat.
        cpu_times: thread CPU seconds per repeat (CPU timing only).
        method: "cuda_events" or "perf_counter".
        threads: torch intra-op threads during the measurement.
        warmup: untimed calls made first.
        results: what the timed callable returned in each repeat (e.g. the f-evaluations of the
            same repeat).
    """

    times: list[float]
    cpu_times: list[float] = field(default_factory=list)
    method: str = "perf_counter"
    threads: int = 1
    warmup: int = 0
    results: list[Any] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.times) if self.times else math.nan

    @property
    def q1(self) -> float:
        return quantile(self.times, 0.25)

    @property
    def q3(self) -> float:
        return quantile(self.times, 0.75)

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1

    @property
    def spread(self) -> float:
        """IQR / median (0 for a single repeat)."""
        m = self.median
        return self.iqr / m if m and m > 0 else math.nan

    @property
    def noisy(self) -> bool:
        return bool(self.spread > SPREAD_FLAG)

    def summary(self) -> dict[str, float]:
        return {
            "median": self.median,
            "q1": self.q1,
            "q3": self.q3,
            "iqr": self.iqr,
            "spread": self.spread,
            "repeats": float(len(self.times)),
        }

    def rows(
        self,
        metric: str,
        *,
        variant: str = "",
        step: int | None = None,
        unit: str = "ms",
        scale: float = 1e3,
    ) -> list[Row]:
        """One row per repeat (``repeat`` = index), then ``<metric>_median``, ``_iqr`` and
        ``_spread`` (IQR / median; the median row's note says when the spread exceeds 10%), and
        on the CPU ``<metric>_cpu_median`` (thread CPU time)."""
        out = [
            Row(metric, t * scale, variant=variant, step=step, repeat=i, unit=unit)
            for i, t in enumerate(self.times)
        ]
        note = (
            f"noisy: IQR/median {self.spread:.0%} > {SPREAD_FLAG:.0%} over {len(self.times)} "
            "repeats"
            if self.noisy
            else ""
        )
        out.append(
            Row(
                f"{metric}_median",
                self.median * scale,
                variant=variant,
                step=step,
                unit=unit,
                note=note,
            )
        )
        out.append(Row(f"{metric}_iqr", self.iqr * scale, variant=variant, step=step, unit=unit))
        out.append(
            Row(
                f"{metric}_spread",
                self.spread,
                variant=variant,
                step=step,
                unit="fraction",
                note=note,
            )
        )
        if self.cpu_times:
            cpu = statistics.median(self.cpu_times) * scale
            out.append(
                Row(
                    f"{metric}_cpu_median",
                    cpu,
                    variant=variant,
                    step=step,
                    unit=unit,
                    note="thread CPU time",
                )
            )
        return out


def time_fn(
    fn: Callable[[], Any],
    *,
    device: Any = "cpu",
    repeats: int = 5,
    warmup: int = 2,
    setup: Callable[[], Any] | None = None,
) -> Timing:
    """Time ``fn()``: ``warmup`` untimed calls, then ``repeats`` timed ones.

    On CUDA each repeat is bracketed by CUDA events (the device is synchronised before the first
    and after each repeat); on the CPU by ``perf_counter`` and ``thread_time``. ``setup()`` runs
    before each call, untimed. ``fn``'s return values are kept in ``Timing.results``.
    """
    phases = time_phases(
        lambda mark: fn(), ("call",), device=device, repeats=repeats, warmup=warmup, setup=setup
    )
    return phases["total"]


def time_phases(
    step: Callable[[Callable[[str], None]], Any],
    phases: Sequence[str],
    *,
    device: Any = "cpu",
    repeats: int = 5,
    warmup: int = 2,
    setup: Callable[[], Any] | None = None,
) -> dict[str, Timing]:
    """Time consecutive phases of one step, e.g. forward and backward of a training step.

    ``step(mark)`` calls ``mark(name)`` at the end of each phase except the last, in the order of
    ``phases`` (the last phase ends when ``step`` returns). Returns one :class:`Timing` per phase
    plus ``"total"``; the step's return values are in every Timing's ``results``.

    Example:
        >>> def step(mark):
        ...     y = torch.randn(32, 32) @ torch.randn(32, 32)
        ...     mark("forward")
        ...     return float(y.sum())
        >>> t = time_phases(step, ("forward", "rest"), repeats=3, warmup=1)
        >>> sorted(t)
        ['forward', 'rest', 'total']
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    names = list(phases)
    if "total" in names or len(set(names)) != len(names):
        raise ValueError(f"time_phases: phase names must be distinct and not 'total', got {names}")
    cuda = is_cuda(device)
    threads = torch.get_num_threads()
    for _ in range(max(0, warmup)):
        if setup is not None:
            setup()
        step(lambda name: None)
    sync(device)
    per: dict[str, list[float]] = {n: [] for n in [*names, "total"]}
    cpu_per: dict[str, list[float]] = {n: [] for n in [*names, "total"]}
    results: list[Any] = []
    for _ in range(repeats):
        if setup is not None:
            setup()
            sync(device)
        marks: list[tuple[str, Any, float]] = []

        def now() -> tuple[Any, float]:
            if cuda:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                return ev, time.thread_time()
            return time.perf_counter(), time.thread_time()

        def mark(name: str, marks: list[tuple[str, Any, float]] = marks) -> None:
            t, c = now()
            marks.append((name, t, c))

        start, cstart = now()
        out = step(mark)
        end, cend = now()
        if cuda:
            end.synchronize()
        results.append(out)
        seen = [m[0] for m in marks]
        expect = names[:-1]
        if seen != expect:
            raise ValueError(f"time_phases: step marked {seen}, expected {expect}")
        points = [(start, cstart)] + [(t, c) for _, t, c in marks] + [(end, cend)]
        for i, n in enumerate(names):
            per[n].append(_elapsed(points[i][0], points[i + 1][0], cuda))
            cpu_per[n].append(points[i + 1][1] - points[i][1])
        per["total"].append(_elapsed(start, end, cuda))
        cpu_per["total"].append(cend - cstart)
    method = "cuda_events" if cuda else "perf_counter"
    return {
        n: Timing(per[n], [] if cuda else cpu_per[n], method, threads, warmup, results) for n in per
    }


def _elapsed(a: Any, b: Any, cuda: bool) -> float:
    return a.elapsed_time(b) / 1e3 if cuda else b - a


# -- f-evaluations and solver time to tolerance ------------------------------------------------


class CountingMap:
    """``f`` with a call counter (``n``): how deqbench counts f-evaluations for every solver,
    its own and third-party ones alike. Attribute access falls through to ``f`` (solvers that
    need a family's structure reach ``cell``/``u`` through it)."""

    def __init__(self, f: Callable[[Tensor], Tensor]) -> None:
        self.f = f
        self.n = 0

    def __call__(self, z: Tensor) -> Tensor:
        self.n += 1
        return self.f(z)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["f"], name)


def f_time(
    f: Callable[[Tensor], Tensor], z: Tensor, *, repeats: int = 5, warmup: int = 2, loop: int = 10
) -> Timing:
    """t_f: per-call time of f in a plain no-grad loop z <- f(z) from ``z`` (``loop`` calls per
    repeat, divided by ``loop``): what a solver with free bookkeeping would pay per f-evaluation.
    Same definition as ``benchmarks/solvers.py``."""
    loop = max(1, int(loop))

    def plain() -> None:
        w = z
        for _ in range(loop):
            w = f(w)

    with torch.no_grad():
        t = time_fn(plain, device=z.device, repeats=repeats, warmup=warmup)
    t.times = [x / loop for x in t.times]
    t.cpu_times = [x / loop for x in t.cpu_times]
    return t


def solver_options_declared(solve: Any) -> set[str] | None:
    """The options a solver declares (``OPTIONS`` on the function or its module), else None."""
    from ..run.specs import solver_options

    return solver_options(solve)


@dataclass
class SolverTiming:
    """Time to tolerance of one solver on one (f, z0, tol), every repeat kept.

    ``nfe`` holds the f-evaluations counted in each timed repeat; ``stats`` is the SolverStats of
    the last repeat; ``rel_residual``/``abs_residual`` are the batch max of the canonical residual
    of the returned iterate, recomputed by deqbench with one uncounted, untimed evaluation (the
    same check for every solver, whatever it reports itself).
    """

    timing: Timing
    nfe: list[int]
    stats: Any
    rel_residual: float
    abs_residual: float
    rel_residual_mean: float
    t_f: float = math.nan

    @property
    def overheads(self) -> list[float]:
        """time / (f-evals x t_f) per repeat."""
        return [
            t / (n * self.t_f) if n and self.t_f > 0 else math.nan
            for t, n in zip(self.timing.times, self.nfe)
        ]

    @property
    def overhead(self) -> float:
        ov = [o for o in self.overheads if not math.isnan(o)]
        return statistics.median(ov) if ov else math.nan


def solver_time_to_tol(
    solve: Callable[..., Any],
    f: Callable[[Tensor], Tensor],
    z0: Tensor,
    *,
    max_iter: int,
    tol: float,
    stop_mode: str = "rel",
    options: dict[str, Any] | None = None,
    repeats: int = 5,
    warmup: int = 2,
    t_f: float | None = None,
) -> SolverTiming:
    """Time ``solve(f, z0, max_iter=, tol=, stop_mode=, **options)`` to tolerance.

    f-evaluations are counted by wrapping ``f`` in every repeat (the count of the same repeat is
    stored next to its time). A solver that declares the option ``check_returned`` (the
    TorchDEQ adapters) is timed with it off, so no solver pays for an extra check evaluation;
    the residual of the returned iterate is then recomputed here, untimed, for every solver.
    ``t_f`` (seconds) defaults to :func:`f_time` at ``z0``.

    Example:
        >>> import deqbench
        >>> st = solver_time_to_tol(deqbench.solvers.get("fixed_point"), lambda z: 0.5 * z + 1,
        ...                         torch.zeros(4, 8), max_iter=100, tol=1e-6, repeats=3)
        >>> st.nfe[0], st.rel_residual < 1e-6
        (20, True)
    """
    from ..solvers.base import residuals

    opts = dict(options or {})
    declared = solver_options_declared(solve)
    if declared is not None and "check_returned" in declared:
        opts.setdefault("check_returned", False)
    counters: list[CountingMap] = []
    out: dict[str, Any] = {}

    def setup() -> None:
        counters.append(CountingMap(f))

    def run() -> int:
        fc = counters[-1]
        with torch.no_grad():
            z, stats = solve(fc, z0, max_iter=max_iter, tol=tol, stop_mode=stop_mode, **opts)
        out["z"], out["stats"] = z, stats
        return fc.n

    timing = time_fn(run, device=z0.device, repeats=repeats, warmup=warmup, setup=setup)
    with torch.no_grad():
        z = out["z"]
        a, r = residuals(f(z), z)
    if t_f is None:
        t_f = f_time(f, z0).median
    return SolverTiming(
        timing,
        [int(n) for n in timing.results],
        out["stats"],
        float(r.max()),
        float(a.max()),
        float(r.mean()),
        float(t_f),
    )


# -- memory (deqbench.performance.memory, re-exported) -----------------------------------------------------

from .memory import (  # noqa: E402
    MIB,
    Memory,
    cpu_peak_rss,
    gpu_peak_memory,
    param_count,
    peak_memory,
    saved_tensor_bytes,
)

__all__ = [
    "SPREAD_FLAG",
    "MIB",
    "set_threads",
    "is_cuda",
    "sync",
    "numeric_flags",
    "preserved_numerics",
    "flags",
    "flag_rows",
    "Timing",
    "time_fn",
    "time_phases",
    "CountingMap",
    "f_time",
    "solver_options_declared",
    "SolverTiming",
    "solver_time_to_tol",
    "Memory",
    "gpu_peak_memory",
    "cpu_peak_rss",
    "peak_memory",
    "saved_tensor_bytes",
    "param_count",
]
