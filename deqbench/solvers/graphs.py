"""CUDA graphs for solvers: the cache of captured solver steps (``cuda_graph="cache"``), the
``cuda_graph`` and ``graph_steps`` options read as a mode and a step count, and
:func:`graph_loop`, which runs a solver step eagerly, captures it and replays it until the
:class:`~deqbench.solvers.tracker.Tracker` stops.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from .options import GraphOptions
from .tracker import Tracker


class GraphCaptureError(RuntimeError):
    """f could not be captured in a CUDA graph (host syncs, changing shapes, ...)."""


#: captured solver steps kept by ``cuda_graph="cache"``: key -> (graph, static state), most
#: recently used last
_GRAPH_CACHE: dict[tuple, tuple[Any, dict[str, Any]]] = {}
GRAPH_CACHE_SIZE = 32
#: ``graph_steps="auto"``: states of at most this many elements get AUTO_STEPS steps per graph
#: (launch-bound: one host round trip per chunk instead of per step), larger ones one
AUTO_NUMEL = 1 << 21
AUTO_STEPS = 2
#: ``graph_steps="loop"`` as :func:`graph_steps` returns it: the whole solve in one graph, a
#: loop on the device (CUDA graph conditional nodes) whose stop test runs there too
LOOP = 0
#: how the solver stats say :data:`LOOP` (``extra["graph_steps"]``)
LOOP_STEPS_LABEL = "loop"
#: ``graph_steps="auto"`` takes the device loop (:data:`LOOP`) where :func:`loop_supported`
AUTO_LOOP = False
#: the DEQ layer's automatic graph path takes states of at most ``solver.graph_numel``
#: elements (default AUTO_NUMEL); a solver whose step is host-bound on large cells too
#: (Anderson on conv64: ~25 small kernels and a batched solve per step) raises it to this
LARGE_NUMEL = 1 << 24
#: bytes of static buffers the cached graphs may hold together (oldest dropped first)
GRAPH_CACHE_BYTES = 4 << 30
_GRAPH_BYTES: dict[tuple, int] = {}


def graph_numel(solver: Any) -> int:
    """The largest state (elements) the DEQ layer's automatic graph path captures for a solver."""
    return int(getattr(solver, "graph_numel", AUTO_NUMEL))


def _nbytes(obj: Any) -> int:
    if isinstance(obj, Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    return 0


def _cache_graph(key: tuple, graph: Any, state: dict[str, Any]) -> None:
    """Keep a captured graph and its static buffers, dropping the oldest entries beyond
    GRAPH_CACHE_SIZE entries or GRAPH_CACHE_BYTES bytes."""
    size = _nbytes(state)
    while _GRAPH_CACHE and (
        len(_GRAPH_CACHE) >= GRAPH_CACHE_SIZE
        or sum(_GRAPH_BYTES.values()) + size > GRAPH_CACHE_BYTES
    ):
        old = next(iter(_GRAPH_CACHE))
        _GRAPH_CACHE.pop(old)
        _GRAPH_BYTES.pop(old, None)
    _GRAPH_CACHE[key] = (graph, state)
    _GRAPH_BYTES[key] = size


@contextlib.contextmanager
def forbid_sync() -> Iterator[None]:
    """CUDA operations that synchronise with the host raise inside (``torch.cuda``'s sync debug
    mode): a step that runs clean here can be captured. Probing this way avoids a capture that
    fails halfway, which leaves the CUDA generator in capture state (later random ops raise
    "Offset increment outside graph capture")."""
    prev = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():  # "a prototype feature" on every run (no warnings)
        warnings.filterwarnings("ignore", message="Synchronization debug mode")
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(prev)


def clear_graph_cache() -> None:
    """Drop every cached CUDA graph (and the memory its static buffers hold)."""
    _GRAPH_CACHE.clear()
    _GRAPH_BYTES.clear()


def drop_graphs(fs: list[Any]) -> None:
    """Drop the cached graphs captured for any of the maps ``fs`` (keys hold f itself)."""
    if not fs:
        return
    ids = {id(f) for f in fs}
    for key in [k for k in _GRAPH_CACHE if len(k) > 1 and id(k[1]) in ids]:
        del _GRAPH_CACHE[key]
        _GRAPH_BYTES.pop(key, None)


def graph_mode(opts: GraphOptions) -> str | None:
    """The ``cuda_graph`` option as a mode: None (off), "capture" (True) or "cache"."""
    v = opts.cuda_graph
    return None if not v else "capture" if v is True else "cache"


def loop_supported() -> bool:
    """Whether this torch can capture a loop on the device (CUDA graph conditional nodes:
    ``CUDAGraph.begin_capture_to_while_node``, CUDA >= 12.4)."""
    if not hasattr(torch.cuda.CUDAGraph, "begin_capture_to_while_node"):
        return False
    try:
        major, minor = (int(x) for x in str(torch.version.cuda).split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (12, 4)


def graph_steps(opts: GraphOptions, z0: Tensor) -> int:
    """Steps per replayed graph (``graph_steps``; "auto": AUTO_STEPS for states of at most
    AUTO_NUMEL elements, else 1; "loop": :data:`LOOP`, the whole solve in one graph where
    :func:`loop_supported`, else "auto"'s)."""
    v = opts.graph_steps
    if v == "loop":
        if loop_supported() or z0.device.type != "cuda":
            return LOOP
        v = "auto"
    if v == "auto":
        if AUTO_LOOP and z0.device.type == "cuda" and loop_supported():
            return LOOP
        return AUTO_STEPS if z0.numel() <= AUTO_NUMEL else 1
    return int(v)


def steps_label(steps: int) -> int | str:
    """:func:`graph_steps`'s value as the solver stats say it (``"loop"`` for :data:`LOOP`)."""
    return LOOP_STEPS_LABEL if steps == LOOP else steps


def graph_state(mode: str | None, key: tuple) -> tuple[Any, dict[str, Any]]:
    """(the cached graphs by phase or None, static state dict to fill or reuse) for a solve."""
    if mode == "cache" and key in _GRAPH_CACHE:
        hit = _GRAPH_CACHE.pop(key)
        _GRAPH_CACHE[key] = hit  # most recently used
        return hit
    return None, {}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def graph_loop(
    solver: str,
    tracker: Tracker,
    body: Callable[..., None],
    max_iter: int,
    *,
    mode: str = "capture",
    key: tuple | None = None,
    graph: dict[int, Any] | None = None,
    state: dict[str, Any] | None = None,
    warmup: int = 1,
    steps: int = 1,
    phase: Callable[[int], int] | None = None,
) -> int:
    """Run ``body`` (one solver step on static buffers, ending in ``tracker.device_record``)
    ``warmup`` times eagerly, then capture ``steps`` of it in one CUDA graph and replay it
    until the tracker stops or ``max_iter`` steps were made (the last ``< steps`` steps run
    eagerly on the same buffers, so ``max_iter`` is never exceeded). Returns the number of
    steps (f-evaluations) made.

    The host reads the residual summaries once per replay, so up to ``steps - 1`` steps past
    the first converged iterate can be made (counted in ``nstep``; ``extra["nstep_to_tol"]``
    says where the tolerance was first met). The eager steps are real steps (they also let
    cuDNN/cuBLAS pick their algorithms before capture, on a side stream as CUDA graphs
    require). f is called ``steps`` times more during capture, without evaluating anything.
    Each replay costs one launch instead of one per kernel, but capturing and instantiating
    costs about a millisecond or more per solve; ``mode="cache"`` keeps the graph (and
    ``state``, its static buffers) under ``key`` and replays it from the first step in later
    solves, which is valid only while f and every tensor it reads are the same objects at the
    same addresses (the usual static-input CUDA-graph pattern).

    ``phase``: the steps differ by phase (Broyden reads only the memory rows that can be in
    use by then): ``phase(n)`` (n: steps made before a chunk) is passed to
    ``body``, and one graph is captured per phase when first reached (sharing one memory pool).
    """
    nstep = 0
    graphs: dict[Any, Any] = graph if graph is not None else {}  # phase (or "loop") -> graph

    def ph(n: int) -> int:
        return phase(n) if phase is not None else 0

    loop = steps == LOOP  # the device loop: the stop test on the device after every step

    def run(p: int) -> None:
        if phase is None:
            body()
        else:
            body(p)
        if loop:
            tracker.device_judge()

    def eager_step(probe: bool = False) -> bool:
        nonlocal nstep
        tracker.dev_j = 0
        p = ph(nstep)
        if probe:
            try:
                with forbid_sync():
                    run(p)
            except RuntimeError as exc:
                raise GraphCaptureError(
                    f"solver '{solver}': f synchronises with the host ({_first_line(exc)}), so "
                    "it cannot be captured in a CUDA graph"
                ) from exc
        else:
            run(p)
        nstep += 1
        tracker.commit(1)
        return tracker.stop() or nstep >= max_iter

    def capture(p: int) -> Any:
        g = torch.cuda.CUDAGraph()
        pool = next(iter(graphs.values())).pool() if graphs else None
        try:
            with torch.cuda.graph(g, pool=pool):
                for j in range(steps):
                    tracker.dev_j = j
                    run(p)
        except Exception as exc:
            raise GraphCaptureError(
                f"solver '{solver}': f could not be captured in a CUDA graph "
                f"({type(exc).__name__}: {_first_line(exc)}); f "
                "must not synchronise with the host or change shapes"
            ) from exc
        graphs[p] = g
        return g

    if not tracker.cuda:  # no graphs on CPU: the same static body, eagerly (tests use this)
        while not eager_step():
            pass
        return nstep
    if not graphs:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        done = False
        main, tracker.stream = tracker.stream, side  # the warm-up's events on its stream
        with torch.cuda.stream(side):
            for _ in range(warmup):
                if eager_step(probe=True):
                    done = True
                    break
        tracker.stream = main
        torch.cuda.current_stream().wait_stream(side)
        if done or nstep + steps > max_iter:
            while not done:
                done = eager_step()
            return nstep
        if loop:
            graphs["loop"] = _capture_loop(solver, tracker, run, ph, max_iter)
        else:
            capture(ph(nstep))
        if mode == "cache" and key is not None:
            _cache_graph(key, graphs, state if state is not None else {})
    if loop:  # one launch; the host reads every step's summary after it, once
        graphs["loop"].replay()
        nstep = tracker.device_loop_read(nstep)
        if tracker.status is None and nstep < max_iter:  # the host would go on: eagerly
            while not eager_step():
                pass
        return nstep
    while nstep + steps <= max_iter:
        p = ph(nstep)
        g = graphs.get(p)
        if g is None:  # a later phase, first reached: captured now, kept with the others
            g = capture(p)
        g.replay()
        nstep += steps
        tracker.commit(steps)
        if tracker.stop():
            return nstep
    if nstep < max_iter:
        while not eager_step():
            pass
    return nstep


def _segments(ph: Callable[[int], int], max_iter: int) -> list[tuple[int, int]]:
    """(phase, first step of the next phase) for the steps 0..max_iter-1, in order."""
    segs: list[tuple[int, int]] = []
    for n in range(max_iter):
        p = ph(n)
        if segs and segs[-1][0] == p:
            segs[-1] = (p, n + 1)
        else:
            segs.append((p, n + 1))
    return segs


def _capture_loop(
    solver: str,
    tracker: Tracker,
    run: Callable[[int], None],
    ph: Callable[[int], int],
    max_iter: int,
) -> Any:
    """The solve as one CUDA graph whose loop and stop test run on the device
    (``graph_steps="loop"``): a while node per phase of the solver, whose body is one step and
    the device's stop test (``run``) and whose predicate is :meth:`Tracker.device_go`. The
    steps made and the stop are the eager path's (the device tests what the host would, in
    float64); the host judges the summaries again after the replay."""
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            cg = torch.cuda.CUDAGraph.get_currently_capturing_graph()
            for p, end in _segments(ph, max_iter):
                cg.begin_capture_to_while_node(tracker.device_go(end))
                try:
                    tracker.dev_j = 0
                    run(p)
                    cg.set_conditional_handle_for_current_node(tracker.device_go(end))
                finally:
                    cg.end_capture_to_conditional_node()
    except Exception as exc:
        raise GraphCaptureError(
            f"solver '{solver}': the solve could not be captured as a loop on the device "
            f"({type(exc).__name__}: {_first_line(exc)})"
        ) from exc
    return g
