"""Run metadata: versions, device, git commit, numeric flags, plugin distributions.

``collect(device)`` is what ``run.json`` records and ``deqbench info`` prints.

Example:
    >>> from deqbench.run.env import collect
    >>> info = collect("cpu")                     # doctest: +SKIP
    >>> info["versions"]["torch"], info["flags"]["threads"]   # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import os
import platform
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

PLUGIN_GROUPS = ("deqbench.models", "deqbench.solvers", "deqbench.inits", "deqbench.analyses")


#: device values that mean "the GPU where one is visible, else the CPU" for a whole suite
#: (``auto`` then also places each cell on the GPU or on CPU cores: deqbench.run.placement)
DEFAULT_DEVICE = "cuda_if_available"
GPU_IF_VISIBLE = (DEFAULT_DEVICE, "auto")


def check_device(requested: str) -> str | None:
    """Why ``requested`` cannot be used here, or None."""
    if requested in (*GPU_IF_VISIBLE, "cpu"):
        return None
    import torch

    if requested == "mps":
        ok = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
        return (
            None
            if ok
            else "MPS is not available on this machine; use device: cpu, cuda_if_available or auto"
        )
    m = re.fullmatch(r"cuda(?::(\d+))?", requested)
    if m is None:
        return f"unknown device {requested!r}; use cuda_if_available, auto, cpu, cuda or cuda:N"
    if not torch.cuda.is_available():
        why = "torch is built without CUDA" if torch.version.cuda is None else "no GPU is visible"
        return f"CUDA is not available on this machine ({why}); use device: cpu, cuda_if_available or auto"
    n = torch.cuda.device_count()
    if m.group(1) is not None and int(m.group(1)) >= n:
        return f"{requested} does not exist: {n} GPU(s) visible (cuda:0..cuda:{n - 1})"
    return None


def resolve_device(requested: str, *, quick: bool = False) -> str:
    """``cuda_if_available`` and ``auto`` -> ``cuda`` when a GPU is visible, else ``cpu``;
    others unchanged (``auto``'s per-cell placement is :mod:`deqbench.run.placement`'s).
    ``quick``: answer from the driver (:func:`visible_gpu_count`) without importing torch where
    it can (a guess: torch may still find CUDA unusable), as a Dask cluster started before the
    suite is validated does."""
    if requested not in GPU_IF_VISIBLE:
        return requested
    if quick:
        n = visible_gpu_count(torch_fallback=False)
        if n is not None:
            return "cuda" if n > 0 else "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


_NVML: list[Any] = []  # the initialised library, once per process


def _nvml() -> Any:
    """The NVIDIA driver's management library (NVML, through ctypes), initialised once per
    process; OSError without it."""
    if not _NVML:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        if lib.nvmlInit_v2() != 0:
            raise OSError("nvmlInit failed")
        _NVML.append(lib)
    return _NVML[0]


def _nvml_device_count() -> int | None:
    """The GPUs the NVIDIA driver reports (NVML through ctypes, a few ms), or None without the
    driver's library."""
    try:
        n = ctypes.c_uint(0)
        ok = _nvml().nvmlDeviceGetCount_v2(ctypes.byref(n)) == 0
    except (OSError, AttributeError):
        return None
    return int(n.value) if ok else None


class _Value(ctypes.Union):
    _fields_ = [("d", ctypes.c_double), ("ui", ctypes.c_uint), ("ull", ctypes.c_ulonglong)]


class _Sample(ctypes.Structure):
    _fields_ = [("timeStamp", ctypes.c_ulonglong), ("sampleValue", _Value)]


#: NVML_GPU_UTILIZATION_SAMPLES: the percent of time a kernel ran, one sample per driver period
_UTIL_SAMPLES = 1


def _util_samples(lib: Any, handle: Any, since: int) -> list[tuple[int, float]]:
    vtype, count = ctypes.c_int(0), ctypes.c_uint(0)
    since_c = ctypes.c_ulonglong(since)
    get = lib.nvmlDeviceGetSamples
    if get(handle, _UTIL_SAMPLES, since_c, ctypes.byref(vtype), ctypes.byref(count), None) != 0:
        return []
    buf = (_Sample * max(1, count.value))()
    if get(handle, _UTIL_SAMPLES, since_c, ctypes.byref(vtype), ctypes.byref(count), buf) != 0:
        return []
    return [(int(x.timeStamp), float(x.sampleValue.ui)) for x in buf[: count.value]]


class GpuBusy:
    """The fraction of time this process's CUDA device ran a kernel (any process's) between
    :meth:`start` and :meth:`stop`: the driver's utilisation samples (NVML, through ctypes; no
    sampling thread), averaged. A second process on the GPU can only use the rest: what the
    Dask executor's grouping of short cells reads. The first sample after :meth:`start` covers a
    period that began before it and is left out when later ones exist; a window shorter than
    the driver's sample period (1/6 to 1 s) reads the newest sample. ``stop()`` is None only
    where nothing can be read: no NVML, a MIG or unknown device, no sample at all."""

    def __init__(self) -> None:
        self._handle: Any = None
        self._since = 0

    def start(self) -> GpuBusy:
        try:
            import torch

            lib = _nvml()
            uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
            handle = ctypes.c_void_p()
            key = (uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}").encode()
            if lib.nvmlDeviceGetHandleByUUID(key, ctypes.byref(handle)) != 0:
                return self
            seen = _util_samples(lib, handle, 0)
            self._since = max((t for t, _ in seen), default=0)
            self._handle = handle
        except Exception:  # noqa: BLE001 - no NVML, no CUDA: not measured
            self._handle = None
        return self

    def stop(self) -> float | None:
        if self._handle is None:
            return None
        try:
            lib = _nvml()
            got = sorted(_util_samples(lib, self._handle, self._since))
            vals = [v for t, v in got if t > self._since][1:]  # the first straddles start()
            if not vals:  # a window shorter than the driver's sample period
                latest = sorted(_util_samples(lib, self._handle, 0))
                vals = [latest[-1][1]] if latest else []
        except Exception:  # noqa: BLE001
            return None
        return sum(vals) / len(vals) / 100.0 if vals else None


def visible_gpu_count(*, torch_fallback: bool = True) -> int | None:
    """``torch.cuda.device_count()`` without importing torch (4 s on a GPU host) where the answer
    is plain: the driver's GPU count (NVML), narrowed by ``CUDA_VISIBLE_DEVICES`` as CUDA does
    reads it (torch's own parser: entries read like strtoul, a repeated ordinal empties the set,
    counted up to the first ordinal the driver lacks). Anything else (UUIDs, MIG, no NVML) asks
    torch, or returns None when ``torch_fallback`` is False."""
    physical = _nvml_device_count()
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if physical is not None:
        if env is None:
            return physical
        if not env.startswith(("GPU-", "MIG-")):  # UUIDs: only CUDA itself can map them
            ordinals: list[int] = []
            for item in env.split(","):
                # each entry read like strtoul ("1gpu2" is 1); no leading number ends the list
                m = re.match(r"[+-]?\d+", item.strip())
                k = int(m.group()) if m else -1
                if k in ordinals:
                    return 0  # a repeated ordinal makes the set empty
                if k < 0:
                    break
                ordinals.append(k)
            # counted up to the first ordinal the driver does not have
            return next((i for i, k in enumerate(ordinals) if k >= physical), len(ordinals))
    if not torch_fallback:
        return None
    import torch

    return int(torch.cuda.device_count())


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def driver_version() -> str | None:
    """NVIDIA driver version (nvidia-smi), or None."""
    out = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return out.splitlines()[0].strip() if out else None


#: names the commit of a source tree copied without its git history (e.g. to a GPU host that
#: receives the working tree but an older ``.git``): ``git_info`` records it as the commit, and
#: what git itself said beside it
SOURCE_COMMIT_ENV = "DEQBENCH_SOURCE_COMMIT"


def git_info() -> dict[str, Any]:
    """Commit and dirty flag of the deqbench source tree (None outside a git checkout). Where
    ``DEQBENCH_SOURCE_COMMIT`` names the commit the tree was copied from, that commit is
    recorded (clean) and git's own answer kept as ``git_reported``."""
    here = Path(__file__).resolve().parent
    commit = _run(["git", "rev-parse", "HEAD"], here)
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], here)
    given = os.environ.get(SOURCE_COMMIT_ENV, "").strip()
    if given:
        seen = None if commit is None else commit + ("+dirty" if status else "")
        return {"commit": given, "dirty": False, "source": SOURCE_COMMIT_ENV, "git_reported": seen}
    if commit is None:
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": bool(status)}


def plugin_distributions() -> list[dict[str, Any]]:
    """Installed distributions that provide deqbench entry points, with what they provide."""
    found: dict[str, dict[str, Any]] = {}
    for group in PLUGIN_GROUPS:
        try:
            eps = metadata.entry_points(group=group)
        except Exception:  # pragma: no cover - broken metadata
            continue
        for ep in eps:
            dist = getattr(ep, "dist", None)
            name = dist.metadata["Name"] if dist is not None else "unknown"
            rec = found.setdefault(
                name, {"name": name, "version": dist.version if dist else None, "provides": []}
            )
            rec["provides"].append(f"{group.split('.')[1][:-1]}:{ep.name}")
    return sorted(found.values(), key=lambda r: r["name"])


def flags(device: str = "cpu") -> dict[str, Any]:
    """Numeric flags that change results or timings on ``device`` (``fused_kernels``: whether
    deqbench's Triton kernels run there, switched on and with Triton able to run on it,
    :mod:`deqbench.core.triton_env`; they sum in another order than torch, so results differ by
    rounding)."""
    import torch

    from ..core.triton_env import ENABLED_BY_ENV, kernel_device

    try:
        fused = ENABLED_BY_ENV and kernel_device(torch.device(device))
    except (RuntimeError, ValueError):  # a device name torch does not know: no kernels there
        fused = False
    return {
        "fused_kernels": bool(fused),
        "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
        "tf32_cudnn": bool(torch.backends.cudnn.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "deterministic_algorithms": bool(torch.are_deterministic_algorithms_enabled()),
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
    }


def versions() -> dict[str, Any]:
    import numpy
    import torch

    from .. import __version__

    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "deqbench": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "cuda": torch.version.cuda,
        "cudnn": cudnn,
        "driver": driver_version() if torch.cuda.is_available() else None,
    }


def collect(device: str = "auto", command: list[str] | None = None) -> dict[str, Any]:
    """Everything ``run.json`` records about the environment."""
    import torch

    dev = resolve_device(device)
    return {
        "versions": versions(),
        "device": dev,
        "device_name": device_name(dev),
        "cuda_available": torch.cuda.is_available(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "flags": flags(dev),
        "git": git_info(),
        "plugins": plugin_distributions(),
        "command": command if command is not None else list(sys.argv),
    }
