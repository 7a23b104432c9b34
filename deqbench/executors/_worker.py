"""Preloaded by every worker of the local Dask cluster.

Ctrl-C sends SIGINT to the whole process group, workers included; the coordinator handles it
(finished cells are on disk, the rest is cancelled and the cluster closed), so the workers
ignore it instead of dying with tracebacks of their own.
"""

from __future__ import annotations

import signal
from typing import Any


def dask_setup(worker: Any) -> None:
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread (in-process workers): leave it
        pass
