"""Peak memory, always measured in its own pass (never in a timed repeat).

* GPU: ``empty_cache`` + ``reset_peak_memory_stats``, then ``max_memory_allocated`` minus the
  ``memory_allocated`` baseline (:func:`gpu_peak_memory`).
* CPU: peak RSS of a fresh worker process (``tracemalloc`` misses torch allocations): the
  worker unpickles the step, warms up (the first re-entrant ``autograd.grad`` of an IFT
  backward costs a one-time 35-50 MiB), reads ``VmRSS``, writes ``5`` to
  ``/proc/self/clear_refs`` (resets the high-water mark), runs the step once and reads
  ``VmHWM`` (:func:`cpu_peak_rss`). A step that cannot be pickled (a model holding a lambda or a
  local class) is measured in this process instead (:func:`inprocess_peak_rss`, method
  ``rss_in_process``, the note says why): free heap memory is first returned to the system
  (``malloc_trim``) so the step's allocations raise the high-water mark.
* :func:`saved_tensor_bytes`: the bytes autograd saves during a forward, device-independent
  (O(1) in the iterations for IFT, O(K) for unrolled K).

Example:
    >>> import torch
    >>> from deqbench.performance.memory import saved_tensor_bytes
    >>> w = torch.randn(64, 64, requires_grad=True)
    >>> nbytes, _ = saved_tensor_bytes(lambda: torch.tanh(torch.randn(8, 64) @ w).sum())
    >>> nbytes > 0
    True
"""

from __future__ import annotations

import gc
import io
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..analyses.base import Row

MIB = 2.0**20


@dataclass
class Memory:
    """Peak extra memory of one step above the baseline before it.

    ``method``: "cuda_max_memory_allocated", "rss_fresh_worker", "rss_in_process" (a step that
    cannot be pickled) or "unavailable" (then ``peak_bytes`` is NaN and ``note`` says why).
    """

    peak_bytes: float
    baseline_bytes: float = math.nan
    method: str = "unavailable"
    note: str = ""

    @property
    def peak_mib(self) -> float:
        return self.peak_bytes / MIB

    def row(self, metric: str, *, variant: str = "", step: int | None = None) -> Row:
        status = "ok" if math.isfinite(self.peak_bytes) else "skipped"
        note = "; ".join(x for x in (self.method, self.note) if x)
        return Row(
            metric, self.peak_mib, variant=variant, step=step, unit="MiB", status=status, note=note
        )


def gpu_peak_memory(step: Callable[[], Any], device: Any = "cuda", warmup: int = 1) -> Memory:
    """Peak ``max_memory_allocated`` above the ``memory_allocated`` baseline during one call of
    ``step()``, after ``warmup`` calls, in its own pass."""
    dev = torch.device(device)
    for _ in range(max(0, warmup)):
        step()
    gc.collect()
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    out = step()
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev)
    del out
    return Memory(float(peak - base), float(base), "cuda_max_memory_allocated")


def _status_kib(key: str) -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"{key} not in /proc/self/status")


def _reset_hwm() -> str:
    """Reset this process's ``VmHWM`` to its ``VmRSS`` ('' or why it could not be reset)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")
    except OSError as exc:
        return f"clear_refs not writable ({exc.strerror}): the high-water mark includes warm-up"
    return ""


def _trim_heap() -> None:
    """Return glibc's free heap memory to the system (no-op elsewhere), so that memory freed
    before a measurement is not reused unseen by the high-water mark."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _measure_rss(step: Callable[[], Any], warmup: int) -> tuple[int, int, str]:
    """(peak, baseline, note) of one call of ``step()`` after ``warmup`` calls, in this
    process: ``VmHWM - VmRSS`` around it, the high-water mark reset just before."""
    for _ in range(max(0, int(warmup))):
        step()
    gc.collect()
    _trim_heap()
    before = _status_kib("VmRSS")
    note = _reset_hwm()
    res = step()
    hwm = _status_kib("VmHWM")
    del res
    return hwm - before, before, note


def inprocess_peak_rss(step: Callable[[], Any], *, warmup: int = 1, why: str = "") -> Memory:
    """Peak extra RSS of one call of ``step()`` measured in this process (Linux): the route for
    a step that cannot be pickled into a fresh worker. After the warm-up, free heap memory is
    returned to the system (``malloc_trim``), ``VmRSS`` read, the high-water mark reset through
    ``/proc/self/clear_refs`` and ``VmHWM`` read after the step. Memory the process keeps in
    its allocator's free lists may still be reused unseen: the value is a lower bound of the
    fresh worker's. ``why``: the reason this route was taken (in the note)."""
    route = "measured in this process" + (f" ({why})" if why else "")
    if not os.path.exists("/proc/self/status"):
        return Memory(math.nan, note=f"no /proc (peak RSS needs Linux); {route}")
    try:
        peak, base, note = _measure_rss(step, warmup)
    except Exception as exc:  # noqa: BLE001 - reported in the note
        return Memory(
            math.nan, method="rss_in_process", note=f"{route}: {type(exc).__name__}: {exc}"
        )
    return Memory(
        float(peak), float(base), "rss_in_process", "; ".join(x for x in (route, note) if x)
    )


def _rss_worker_main() -> None:
    """Body of the fresh worker process of :func:`cpu_peak_rss` (``python -c``): reads
    ``{"warmup", "threads"}`` as a JSON first line and the pickled step from stdin, prints one
    JSON line ``{"status", "peak", "baseline", "note"}``."""
    import json
    import sys

    out: dict[str, Any] = {"status": "error", "peak": 0, "baseline": 0, "note": ""}
    try:
        header = json.loads(sys.stdin.buffer.readline())
        blob = sys.stdin.buffer.read()
        torch.set_num_threads(int(header["threads"]))
        step = torch.load(io.BytesIO(blob), weights_only=False)
        del blob
        peak, before, note = _measure_rss(step, int(header["warmup"]))
        out = {"status": "ok", "peak": peak, "baseline": before, "note": note}
    except BaseException as exc:  # report anything to the parent
        out["note"] = f"{type(exc).__name__}: {exc}"
    sys.stdout.write("\n" + json.dumps(out) + "\n")
    sys.stdout.flush()


def cpu_peak_rss(
    step: Callable[[], Any], *, warmup: int = 1, threads: int | None = None, timeout: float = 600.0
) -> Memory:
    """Peak extra RSS of one call of ``step()`` in a fresh worker process (Linux).

    ``step`` is pickled with ``torch.save`` (an instance of a module-level class holding the
    model and the batch; the worker has its own copy) and sent to a new ``python -c`` process
    (not multiprocessing: nothing of the caller's ``__main__`` is re-imported). The worker warms
    up, reads ``VmRSS``, resets the high-water mark through ``/proc/self/clear_refs``, calls
    ``step()`` once and reports ``VmHWM - VmRSS``. A ``step`` that cannot be pickled (e.g. a
    model holding a lambda) is measured in this process (:func:`inprocess_peak_rss`; the note
    says so and why). glibc's mmap threshold is fixed at
    64 KiB in the worker, so freed tensors leave the RSS instead of being recycled unseen.
    ``threads`` defaults to this process's torch thread count.
    """
    import json
    import subprocess
    import sys

    if not os.path.exists("/proc/self/status"):
        return Memory(math.nan, note="no /proc (peak RSS needs Linux)")
    buf = io.BytesIO()
    try:
        torch.save(step, buf)
    except Exception as exc:  # noqa: BLE001 - e.g. a model holding a lambda or a local class
        why = " ".join(f"{type(exc).__name__}: {exc}".split())[:120]
        return inprocess_peak_rss(
            step, warmup=warmup, why=f"the step cannot be pickled for a fresh worker: {why}"
        )
    header = json.dumps({"warmup": int(warmup), "threads": int(threads or torch.get_num_threads())})
    code = "from deqbench.performance.memory import _rss_worker_main; _rss_worker_main()"
    env = dict(os.environ)
    # the worker must import what the parent imported (plugins, tests' sys.path entries)
    env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")])
    # A fixed mmap threshold turns glibc's dynamic one off: tensors >= 64 KiB are mapped and
    # unmapped on free, so memory freed during warm-up is not silently reused from the heap
    # (which would hide the step's allocations from the high-water mark).
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code],
            input=header.encode() + b"\n" + buf.getvalue(),
            capture_output=True,
            timeout=timeout,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return Memory(
            math.nan, method="rss_fresh_worker", note=f"worker timed out after {timeout:g} s"
        )
    lines = [ln for ln in proc.stdout.decode(errors="replace").splitlines() if ln.startswith("{")]
    if not lines:
        err = " ".join(proc.stderr.decode(errors="replace").strip().splitlines()[-1:])
        return Memory(
            math.nan,
            method="rss_fresh_worker",
            note=f"worker failed (exit code {proc.returncode}): {err}",
        )
    res = json.loads(lines[-1])
    if res["status"] != "ok":
        return Memory(math.nan, method="rss_fresh_worker", note=res["note"])
    return Memory(float(res["peak"]), float(res["baseline"]), "rss_fresh_worker", res["note"])


def peak_memory(
    step: Callable[[], Any],
    device: Any,
    *,
    warmup: int = 1,
    cpu: bool = True,
    threads: int | None = None,
) -> Memory:
    """Peak extra memory of ``step()``: :func:`gpu_peak_memory` on CUDA, else (``cpu=True``)
    :func:`cpu_peak_rss` in a fresh worker; ``cpu=False`` skips the CPU measurement."""
    if torch.device(device).type == "cuda":
        return gpu_peak_memory(step, device, warmup)
    if not cpu:
        return Memory(math.nan, note="CPU peak RSS off (memory_cpu: false)")
    return cpu_peak_rss(step, warmup=warmup, threads=threads)


def saved_tensor_bytes(fn: Callable[[], Any]) -> tuple[int, Any]:
    """(bytes, fn()): total size of the distinct storages autograd saves while ``fn`` runs.

    Device-independent activation memory: a storage saved several times (a weight used by
    every unrolled step) counts once."""
    seen: dict[tuple[Any, int], int] = {}

    def pack(t: Tensor) -> Tensor:
        try:
            st = t.untyped_storage()
            seen[(t.device, st.data_ptr())] = st.nbytes()
        except Exception:  # pragma: no cover - exotic tensors
            pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return int(sum(seen.values())), out


def param_count(model: torch.nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
