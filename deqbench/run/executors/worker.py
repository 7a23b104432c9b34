"""Preload for Dask workers you start yourself: ``dask worker tcp://SCHEDULER:8786 --preload
deqbench.run.executors.worker`` warms the worker up at start (imports, CUDA context, first kernels;
reported on the first cell's ``process`` rows, never in its ``wall_time``), like the local
cluster's workers. ``DEQBENCH_WARMUP`` (``off`` | ``DTYPE`` | ``DEVICE:DTYPE``, default
``auto:float32``) chooses it; see :mod:`deqbench.run.executors._worker`."""

from __future__ import annotations

from ._worker import WARMUP_ENV, dask_setup, warm_up_worker

__all__ = ["WARMUP_ENV", "dask_setup", "warm_up_worker"]
