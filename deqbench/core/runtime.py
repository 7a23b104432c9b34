"""A cell's ``runtime`` section at run time: which :class:`~deqbench.deq.Runtime` a cell or a
model has, the autocast around a model forward and its loss, and what ran (for result notes).

The suite's ``runtime`` section (``cuda_graph``, ``amp``, ``compile``, ``compile_mode``) is given
to every DEQ layer of the cell's model (:func:`deqbench.deq.set_runtime`); training, evaluation
and the performance analyses run the whole model forward and the loss under
:meth:`Runtime.autocast <deqbench.deq.Runtime.autocast>` (bf16), with the loss in float32.
Parameters and optimiser state stay in the suite's dtype.

Example:
    >>> from deqbench.core.runtime import cell_runtime, runtime_note
    >>> rt = cell_runtime({"runtime": {"amp": "bf16"}})
    >>> rt.amp, runtime_note(None, rt)
    ('bf16', 'amp=bf16')
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from .deq import Runtime, deq_layers


def cell_runtime(cell: Mapping[str, Any] | None) -> Runtime:
    """The :class:`Runtime` of a resolved cell dict (``ctx.cell``; no ``runtime``: default)."""
    return Runtime(**((cell or {}).get("runtime") or {}))


def model_runtime(model: Any) -> Runtime:
    """The runtime of the model's first DEQ layer (:func:`deqbench.deq.set_runtime` gives them
    all the same one), else the default."""
    for layer in deq_layers(model):
        return layer.runtime
    return Runtime()


def forward_paths(model: Any) -> str:
    """How the last forward solves of the model's DEQ layers ran: ``eager``, ``graph`` or
    ``compiled`` (``+``-joined when layers differ); "" without a forward solve."""
    paths = [
        str(getattr(s, "path", "eager"))
        for layer in deq_layers(model)
        if (s := layer.last_forward_stats) is not None
    ]
    return "+".join(sorted(set(paths)))


def runtime_note(paths: Any, runtime: Runtime) -> str:
    """``path=graph, amp=bf16`` (``paths``: a :func:`forward_paths` string, a set of them, a
    model, or None for none)."""
    if paths is not None and not isinstance(paths, str | set | frozenset | list | tuple):
        paths = forward_paths(paths)
    if isinstance(paths, set | frozenset | list | tuple):
        paths = "+".join(sorted({q for p in paths if p for q in str(p).split("+")}))
    parts = [f"path={paths}"] if paths else []
    parts.append(f"amp={runtime.amp}")
    if runtime.backend is not None:
        parts.append(f"compile={runtime.backend}")
    return ", ".join(parts)


def autocast(runtime: Runtime | None, device: Any) -> contextlib.AbstractContextManager:
    """The autocast of ``runtime.amp`` around a whole model forward (a null context for
    ``None`` or ``amp: none``): :meth:`Runtime.autocast <deqbench.deq.Runtime.autocast>`, whose
    weight cache is off, since forward solves that a DEQ layer captures as CUDA graphs inside
    the block must not read cast weights that the cache frees when the block ends."""
    if runtime is None:
        return contextlib.nullcontext()
    return runtime.autocast(device)


def for_loss(out: Any, runtime: Runtime | None) -> Any:
    """The model output as the loss takes it: float32 under bf16 autocast (``.float()``),
    unchanged otherwise (a float64 run stays float64)."""
    if runtime is None or runtime.amp == "none" or not hasattr(out, "float"):
        return out
    return out.float()
