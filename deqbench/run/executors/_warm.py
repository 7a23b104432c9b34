"""Imported once by the multiprocessing forkserver of a local Dask cluster (the default on
GPUs, or wherever Dask's ``distributed.worker.multiprocessing-method`` is ``forkserver``: see
:mod:`._forkserver`), so that workers forked from it start, and restart after a crash, with
torch, the datasets and the registries already imported. Must not touch CUDA: workers choose
their GPU after the fork."""

from __future__ import annotations

import torch  # noqa: F401

from ...core.registry import analyses, datasets, inits, models, solvers
from .. import task, train  # noqa: F401

for _r in (models, solvers, inits, analyses, datasets):
    _r.names()
# torch imports torch._dynamo lazily when the first optimiser is built (seconds).
torch.optim.Adam([torch.zeros(1, requires_grad=True)])
# Not scikit-learn (the digits data set only, 1-3 s): a worker that needs it imports it then.
