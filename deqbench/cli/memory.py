"""Memory exhausted while the heavy libraries load (``ulimit -v`` too low for PyTorch): whether
an exception means it (:func:`_memory_exhausted`) and the one line :func:`deqbench.cli.main`
prints instead of a traceback (:func:`_out_of_memory_line`).
"""

from __future__ import annotations

#: messages of a failed import or library load that mean "out of (address-space) memory"
_OOM_TEXTS = ("failed to map segment", "cannot allocate memory", "out of memory", "bad_alloc")


def _memory_exhausted(exc: BaseException) -> bool:
    """A MemoryError, or an import/load error whose cause is memory (``libtorch_cpu.so: failed
    to map segment from shared object`` under ``ulimit -v``), here or in its chain."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, MemoryError):
            return True
        if isinstance(e, (ImportError, OSError)):
            if getattr(e, "errno", None) == 12 or any(t in str(e).lower() for t in _OOM_TEXTS):
                return True
        e = e.__cause__ or e.__context__
    return False


def _out_of_memory_line(exc: BaseException) -> str:
    """The one line for :func:`main`: what was loading, the address-space limit, the fix."""
    import re
    import traceback

    text = " ".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    what = "PyTorch" if re.search(r"[\\/]torch[\\/]|libtorch", text) else "its libraries"
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        unlimited = soft == resource.RLIM_INFINITY
    except (ImportError, OSError, ValueError):  # not POSIX
        soft, unlimited = 0, True
    if unlimited:
        return (
            f"out of memory while loading {what} (no address-space limit): free memory or run "
            "on a machine with more"
        )
    return (
        f"out of memory while loading {what} (address-space limit {soft / 2**30:.1f} GiB, "
        f"ulimit -v {soft // 1024}): raise `ulimit -v` or remove it (`ulimit -v unlimited`); "
        "importing PyTorch maps a few GiB of address space, CUDA far more"
    )
