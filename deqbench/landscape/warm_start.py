"""Warm starts of a loss-landscape grid: the order the grid's points are solved in so that each
has solved neighbours (:func:`visit_order`), the solved points' fixed points a point may start
from (:func:`warm_candidates`), and :class:`_WarmStart`, the hooks on every DEQ layer that give
each layer call its warm initial iterate and record the fixed point it returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..core.errors import ConfigError

WARM_STARTS = ("neighbour", "nearest", "centre", "off")


def warm_start_mode(value: Any) -> str:
    """``neighbour`` | ``nearest`` | ``centre`` | ``off`` from a ``warm_start`` value: ``True`` (the
    earlier boolean: the centre's fixed point), ``False`` / None (off) and the spellings
    ``neighbor`` / ``center`` / ``none`` / ``cold``."""
    if value is True:
        return "centre"
    if value is False or value is None:
        return "off"
    if isinstance(value, str):
        v = value.strip().lower()
        v = {"neighbor": "neighbour", "center": "centre", "none": "off", "cold": "off"}.get(v, v)
        if v in WARM_STARTS:
            return v
    raise ConfigError(
        f"landscape.warm_start: expected one of {', '.join(WARM_STARTS)} (or true / false), "
        f"got {value!r}"
    )


def _nearest_zero(values: Sequence[float]) -> int:
    return min(range(len(values)), key=lambda k: (abs(values[k]), k))


Index = tuple[int, int]


def visit_order(n_alpha: int, n_beta: int, start: Index) -> list[tuple[Index, list[Index]]]:
    """The order of the warm-started (``neighbour``) sweep over an ``n_alpha x n_beta`` grid of
    indices, outward from ``start``: ``[(point, sources), ...]``.

    Rows (fixed beta index) are visited outward from the start row (its own row, then the rows
    above it in turn, then the rows below it), and within a row the points outward from the start
    column (its own column, then right, then left). ``sources`` are the grid neighbours of the
    point solved before it, in the order they are tried: the point one row nearer the start row
    (same column), the point one column nearer the start column (same row), then the two
    diagonal neighbours in the nearer row (the one nearer the start column first). Every point
    but the start has at least one axis neighbour among its sources, and every source is visited
    earlier. At most two rows and three points of fixed points are needed at once: the start
    row waits for the rows below it while those above are swept, and a point of any other row
    is dropped as soon as the row after it has read it."""
    if n_alpha < 1 or n_beta < 1:
        return []
    ca, cb = start

    def outward(n: int, c: int) -> list[int]:
        return [c, *range(c + 1, n), *range(c - 1, -1, -1)]

    order: list[tuple[Index, list[Index]]] = []
    for j in outward(n_beta, cb):
        s = (j > cb) - (j < cb)
        for i in outward(n_alpha, ca):
            t = (i > ca) - (i < ca)
            src: list[Index] = []
            if s:
                src.append((i, j - s))
            if t:
                src.append((i - t, j))
            if s:
                for di in (-t, t) if t else (-1, 1):
                    if 0 <= i + di < n_alpha:
                        src.append((i + di, j - s))
            order.append(((i, j), src))
    return order


Combo = tuple[tuple[Index, float], ...]


def warm_candidates(
    point: Index, start: Index, sources: Sequence[Index], extrapolate: bool = True
) -> list[Combo]:
    """The initial iterates a point of :func:`visit_order` may start from, in the order they are
    tried per example: each a linear combination ``((index, weight), ...)`` of solved points'
    fixed points, usable for an example when every one of them converged for it.

    With ``extrapolate`` (``warm_start="neighbour"``) the first ones are first-order predictors
    from the same row ``A`` (one column nearer the start column), ``A2`` (two columns nearer),
    the nearer row ``B`` (same column) and ``C`` (its neighbour nearer the start column):
    ``A + (A - A2) / 2 + (B - C) / 2`` (the step along the row estimated from both rows),
    ``A + B - C`` (a parallelogram) and ``2 A - A2`` (along the row); then every source alone
    (``nearest``: only these)."""
    i, j = point
    t = (i > start[0]) - (i < start[0])
    s = (j > start[1]) - (j < start[1])
    out: list[Combo] = []
    if extrapolate and t:
        a = (i - t, j)
        a2 = (i - 2 * t, j) if abs(i - start[0]) >= 2 else None
        b, c = ((i, j - s), (i - t, j - s)) if s else (None, None)
        if a2 is not None and b is not None and c is not None:
            out.append(((a, 1.5), (a2, -0.5), (b, 0.5), (c, -0.5)))
        if b is not None and c is not None:
            out.append(((a, 1.0), (b, 1.0), (c, -1.0)))
        if a2 is not None:
            out.append(((a, 2.0), (a2, -1.0)))
    out.extend(((src, 1.0),) for src in sources)
    return out


WARM_STORES = ("auto", "device", "host")


def warm_store_mode(value: Any, device: torch.device) -> str:
    """``device`` | ``host`` from a ``warm_store`` value: ``auto`` (the default) is ``host`` on
    an accelerator (its memory is the scarce one) and ``device`` on the CPU (where the two are the
    same memory)."""
    v = "auto" if value is None else str(value).strip().lower()
    if v not in WARM_STORES:
        raise ConfigError(
            f"landscape.warm_store: expected one of {', '.join(WARM_STORES)}, got {value!r}"
        )
    if v == "auto":
        return "device" if device.type == "cpu" else "host"
    return v


def _nbytes(z: Tensor, m: Tensor) -> int:
    return z.nbytes + m.nbytes


class _WarmStart:
    """Hooks on every DEQ layer that give each layer call a warm initial iterate ``z0`` and
    record the fixed point it returns.

    A solved point's fixed points are stored per (evaluation batch, call order) with the
    per-example mask of the examples whose final residual met the tolerance (the solver's own
    per-sample residual in its stop mode). Before a point is solved, :meth:`start_point` names
    the initial iterates it may start from (:func:`warm_candidates`: combinations of solved
    points' fixed points), in the order they are tried: each example starts from the first of
    them whose points all converged for that example, and from the call's own initial state (as
    the model starts it) when none did. A stored state whose shape, dtype or device differs from the
    call's own initial state (or ``u`` when none is passed) is not used; a call that reports no
    solve (an unrolled layer: its ``z0`` is part of the network) is never recorded, so it always
    starts as the model starts it.

    Where the kept fixed points live (``store``): ``device``, on the device of the solve;
    ``host``, in host memory (pinned for CUDA), with only the states the point being solved
    reads (at most five source points, plus its own new one, of the current evaluation batch)
    copied to the device (``near``) -- the copies are exact, so the initial iterates, and with
    them every solve, are the same either way. The keeper counts what it holds: ``peak_kept_*``
    (every kept fixed point, wherever it lives) and ``peak_device_bytes`` (what of it is on the
    solve's device at once)."""

    def __init__(self, layers: Sequence[nn.Module], store: str = "device") -> None:
        if store not in ("device", "host"):
            raise ValueError(f"store must be 'device' or 'host', got {store!r}")
        self.layers = list(layers)
        self.host = store == "host"
        self.store: dict[Any, dict[tuple[int, int], tuple[Tensor, Tensor]]] = {}
        self.near: dict[tuple[Any, tuple[int, int]], Tensor] = {}  # device copies (host store)
        self.point: Any = None
        self.combos: list[Combo] = []
        self.record = False
        self.batch = 0
        self.calls = 0
        self.examples = 0  # examples x layer calls at this point
        self.warm: Tensor | int = 0  # of which started from stored fixed points
        self.predicted: Tensor | int = 0  # of which from a combination of several
        self.handles: list[Any] = []
        self._key = (0, 0)
        self.kept_bytes = self.near_bytes = 0
        self.peak_kept_bytes = self.peak_kept_points = self.peak_device_bytes = 0

    def __enter__(self) -> _WarmStart:
        for layer in self.layers:
            self.handles.append(layer.register_forward_pre_hook(self._pre, with_kwargs=True))
            self.handles.append(layer.register_forward_hook(self._post))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.store.clear()
        self.near.clear()
        self.kept_bytes = self.near_bytes = 0

    def memory(self) -> dict[str, Any]:
        """What the keeper held at most: ``warm_store``, ``warm_kept_peak_points`` /
        ``warm_kept_peak_bytes`` (kept fixed points, wherever they live) and
        ``warm_device_peak_bytes`` (of the solve's device)."""
        return {
            "warm_store": "host" if self.host else "device",
            "warm_kept_peak_points": self.peak_kept_points,
            "warm_kept_peak_bytes": self.peak_kept_bytes,
            "warm_device_peak_bytes": self.peak_device_bytes,
        }

    def _account(self) -> None:
        self.peak_kept_bytes = max(self.peak_kept_bytes, self.kept_bytes)
        self.peak_kept_points = max(self.peak_kept_points, len(self.store))
        on_device = self.near_bytes + (0 if self.host else self.kept_bytes)
        self.peak_device_bytes = max(self.peak_device_bytes, on_device)

    def _evict(self, keep: Any) -> None:
        """Drops the device copies ``keep(point, key)`` rejects."""
        for k in [k for k in self.near if not keep(*k)]:
            self.near_bytes -= self.near.pop(k).nbytes

    def start_point(self, point: Any, combos: Sequence[Combo], record: bool) -> None:
        """Before the point's first evaluation batch: where it may start from, whether to keep
        its fixed points for later points."""
        self.point, self.record = point, record
        self.combos = [c for c in combos if all(src in self.store for src, _ in c)]
        self.examples, self.warm, self.predicted = 0, 0, 0
        reads = {src for c in self.combos for src, _ in c}
        self._evict(lambda p, _: p in reads)

    def begin(self, batch: int) -> None:
        """Before every evaluation batch (forward) of the point."""
        self.batch, self.calls = batch, 0
        self._evict(lambda _, key: key[0] == batch)

    def drop(self, point: Any) -> None:
        for z, m in self.store.pop(point, {}).values():
            self.kept_bytes -= _nbytes(z, m)
        self._evict(lambda p, _: p != point)

    def warm_frac(self) -> tuple[float, float]:
        """Shares of the point's examples x layer calls started from stored fixed points, and
        from a combination of several (an extrapolated predictor)."""
        if not self.examples:
            return 0.0, 0.0
        return float(self.warm) / self.examples, float(self.predicted) / self.examples

    def _state(self, src: Any, key: tuple[int, int], ref: Tensor) -> Any:
        """A stored fixed point and its mask, on the device of ``ref``; None when there is none
        or it does not match ``ref`` (the mask lives on the device of the recorded solve)."""
        entry = self.store[src].get(key)
        if entry is None:
            return None
        z, m = entry
        if (z.shape, z.dtype, m.device) != (ref.shape, ref.dtype, ref.device):
            return None
        if self.host:
            zd = self.near.get((src, key))
            if zd is None:
                zd = z.to(m.device, non_blocking=True)
                self.near[(src, key)] = zd
                self.near_bytes += zd.nbytes
                self._account()
            z = zd
        return z, m

    def _combo(self, combo: Combo, key: tuple[int, int], ref: Tensor) -> Any:
        parts = []
        for src, w in combo:
            got = self._state(src, key, ref)
            if got is None:
                return None
            parts.append((*got, w))
        if len(parts) == 1 and parts[0][2] == 1.0:
            z = parts[0][0]  # as stored (never written: torch.where below makes z0)
        else:
            z = parts[0][0] * parts[0][2]
            for zk, _, w in parts[1:]:
                z.add_(zk, alpha=w)
        mask = parts[0][1]
        for _, mk, _ in parts[1:]:
            mask = mask & mk
        return z, mask

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        key = (self.batch, self.calls)
        self.calls += 1
        self._key = key
        if not args:
            return None
        own = kwargs.get("z0", args[1] if len(args) > 1 else None)
        ref = own if isinstance(own, Tensor) else args[0]
        if not isinstance(ref, Tensor) or ref.dim() == 0:
            return None
        self.examples += int(ref.shape[0])
        z0: Tensor | None = None
        left: Tensor | None = None  # examples no candidate so far covers
        shape = (-1,) + (1,) * (ref.dim() - 1)
        for combo in self.combos:
            got = self._combo(combo, key, ref)
            if got is None:
                continue
            z, m = got
            if z0 is None:  # the layer's default when the model passes none
                z0 = own if isinstance(own, Tensor) else torch.zeros_like(ref)
                left = torch.ones(ref.shape[0], dtype=torch.bool, device=ref.device)
            assert left is not None
            take = m & left
            z0 = torch.where(take.view(shape), z, z0)
            n_take = take.sum()
            self.warm = self.warm + n_take
            if len(combo) > 1:
                self.predicted = self.predicted + n_take
            left = left & ~m
            if not bool(left.any()):
                break
        if z0 is None:
            return None
        if "z0" in kwargs or len(args) < 2:
            return args, {**kwargs, "z0": z0}
        return (args[0], z0, *args[2:]), kwargs

    def _post(self, module: nn.Module, args: tuple, out: Any) -> None:
        if not self.record or not isinstance(out, Tensor) or out.dim() == 0:
            return
        stats = getattr(module, "last_forward_stats", None)
        if stats is None:  # no solve (unrolled): its initial state is part of the network
            return
        r = stats.residual
        if r.numel() == out.shape[0]:
            mask = (r < stats.tol).reshape(-1).to(out.device)
        else:
            mask = torch.full((out.shape[0],), bool(stats.converged), device=out.device)
        z = out.detach()
        kept = self.store.setdefault(self.point, {})
        old = kept.pop(self._key, None)
        if old is not None:  # solved again (the retry): its new fixed point replaces the old
            self.kept_bytes -= _nbytes(*old)
            del old  # freed before the new one is copied
        if self.host:
            cuda = z.device.type == "cuda"
            host = torch.empty(z.shape, dtype=z.dtype, device="cpu", pin_memory=cuda)
            host.copy_(z, non_blocking=cuda)
            near = self.near.pop((self.point, self._key), None)
            if near is not None:
                self.near_bytes -= near.nbytes
            # the next point is likely to start from it: a device copy stays while it reads it
            self.near[(self.point, self._key)] = near = z.clone()
            self.near_bytes += near.nbytes
            z = host
        else:
            z = z.clone()
        kept[self._key] = (z, mask)
        self.kept_bytes += _nbytes(z, mask)
        self._account()
