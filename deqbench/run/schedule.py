"""Longest tasks first: the order in which a distributed executor hands out its tasks.

A run's wall time on several workers ends with a tail: the last tasks finish while the other
workers idle. Handing out the longest tasks first (LPT) keeps that tail at most about one short
task long. The cost of a task is estimated:

* **measured**, where a task of the same cell (another seed) has finished, in this run or in the
  run a ``--resume`` continues: the mean of their ``wall_time``;
* otherwise **static**, from the cell's configuration (:func:`static_cost`: epochs times the
  forward and backward iteration budgets), scaled into seconds by the median ratio of measured
  to static cost over the cells measured so far.

Seeds are handed out seed-major (every cell's first seed, then every cell's second seed, ...),
so that the later seeds, which make up the tail, are ordered by measured costs. Equal estimates
keep the suite's order. Only the order of submission changes: ``results.csv`` is written in the
suite's order at the end of the run (:func:`deqbench.run.runner.canonical_order`), so rows do
not depend on which task finished first.

Example:
    >>> from deqbench.run.schedule import CostModel
    >>> m = CostModel()
    >>> m.observe("a", 1, 4.0)
    >>> m.estimate("a", 1)  # measured: the mean wall_time of the cell's finished seeds
    4.0
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["CostModel", "static_cost", "lpt_order", "known_costs"]


def _iters(section: dict[str, Any]) -> float:
    for key in ("max_iter", "k", "steps"):
        v = section.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool) and v > 0:
            return float(v)
    return 1.0


def static_cost(cell: Any) -> float:
    """A unitless cost proxy of one task of ``cell``: (epochs + 1) x (forward max_iter +
    backward max_iter). Only its order matters (it is scaled by measured tasks)."""
    train = getattr(cell, "train", {}) or {}
    epochs = train.get("epochs", 1)
    epochs = float(epochs) if isinstance(epochs, int | float) else 1.0
    fwd = _iters(getattr(cell, "solver", {}) or {})
    bwd = _iters(getattr(cell, "backward", {}) or {})
    return (max(0.0, epochs) + 1.0) * (fwd + bwd)


class CostModel:
    """Estimated seconds of a task (see the module docstring)."""

    def __init__(self, static: dict[str, float] | None = None) -> None:
        self.static = dict(static or {})  # cell id -> static cost
        self.walls: dict[str, list[float]] = {}  # cell id -> measured wall times

    def observe(self, cell_id: str, static: float, wall: float) -> None:
        """A finished task of ``cell_id`` took ``wall`` s (timed statuses only)."""
        self.static.setdefault(cell_id, static)
        if wall > 0:
            self.walls.setdefault(cell_id, []).append(float(wall))

    def _scale(self) -> float | None:
        ratios = [
            statistics.fmean(w) / self.static[c]
            for c, w in self.walls.items()
            if self.static.get(c, 0) > 0
        ]
        return statistics.median(ratios) if ratios else None

    def estimate(self, cell_id: str, static: float, scale: float | None = None) -> float:
        """Seconds if the cell was measured; else the static cost scaled by what was measured
        (the static cost itself while nothing was). ``scale``: a precomputed :meth:`scale`."""
        if self.walls.get(cell_id):
            return statistics.fmean(self.walls[cell_id])
        scale = self.scale() if scale is None else scale
        return static * scale if scale > 0 else static

    def scale(self) -> float:
        """Seconds per unit of static cost (median over the measured cells; 0: none yet)."""
        s = self._scale()
        return s if s is not None else 0.0


def lpt_order(keys: Sequence[tuple[str, int, float]], model: CostModel) -> list[int]:
    """Indexes of ``keys`` ((cell id, seed rank, static cost) per task) in submission order:
    by seed rank (seed-major), then by decreasing estimate; ties keep the given order."""
    scale = model.scale()
    est = [model.estimate(c, s, scale) for c, _, s in keys]
    return sorted(range(len(keys)), key=lambda i: (keys[i][1], -est[i], i))


def known_costs(run_dir: str | Path | None) -> dict[str, list[float]]:
    """Cell id -> ``wall_time`` of the finished tasks already in ``run_dir`` (a resumed run);
    empty without one. Timed statuses only (ok, flagged)."""
    if not run_dir or not (Path(run_dir) / "results.csv").exists():
        return {}
    try:
        from .results import FLAGGED, RUNNER, load_results

        df = load_results(run_dir, check_keys=False)
        w = df[(df.analysis == RUNNER) & (df.metric == "wall_time")]
        w = w[w.status.isin(["ok", FLAGGED])]
        out: dict[str, list[float]] = {}
        for c, v in zip(w.cell_id, w.value):
            if v == v and v > 0:
                out.setdefault(str(c), []).append(float(v))
        return out
    except Exception:  # an estimate is never worth a failed run
        return {}
