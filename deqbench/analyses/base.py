"""The analysis contract.

An analysis is a registered class with a ``name``, a ``version``, a pydantic ``Params`` model
(unknown keys forbidden) and four hooks that the runner calls around the training of one cell.
Each hook returns (or yields) :class:`Row` objects; the runner adds the run/cell columns and
writes them to ``results.csv``. Long curves go to ``ctx.write_series(name, dataframe)``.

Example (a plugin analysis)::

    from deqbench.analyses.base import Analysis, Row

    class WeightNorm(Analysis):
        name = "weight_norm"
        version = "1"

        def on_epoch(self, ctx, info):
            total = sum(float(p.norm()) ** 2 for p in ctx.model.parameters()) ** 0.5
            yield Row("weight_norm", total, step=info.epoch)

Register it with ``@deqbench.analyses.register("weight_norm")`` or the entry point group
``deqbench.analyses``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:  # pragma: no cover
    from ..run.data import DataBundle


@dataclass
class Row:
    """One measured scalar. ``step`` is the epoch or step it belongs to (None if not stepwise)."""

    metric: str
    value: float
    variant: str = ""
    step: int | None = None
    repeat: int = 0
    unit: str = ""
    status: str = "ok"
    note: str = ""

    def __post_init__(self) -> None:
        try:
            self.value = float(self.value)
        except (TypeError, ValueError):
            self.value = math.nan


@dataclass
class StepInfo:
    """Passed to ``on_step`` after each optimiser step."""

    epoch: int
    step: int  # global step, from 1
    loss: float
    deq: dict[str, float] = field(default_factory=dict)  # deq.last_stats(model)
    batch: Any = None  # (x, y) on device


@dataclass
class EpochInfo:
    """Passed to ``on_epoch`` after each epoch (epoch 0 = before any training, if evaluated)."""

    epoch: int
    train: dict[str, float] = field(default_factory=dict)  # mean loss and DEQ stats over the epoch
    test: dict[str, float] = field(default_factory=dict)  # evaluate(model, test split)


@dataclass
class CellContext:
    """Everything an analysis can reach for one (cell, seed)."""

    model: Any
    data: DataBundle
    device: Any
    dtype: Any
    seed: int
    cell_id: str
    cell: dict[str, Any]  # the resolved cell config (model, solver, backward, init, train, ...)
    run_dir: Path | None = None
    optimizer: Any = None
    loss_fn: Callable[..., Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def task(self) -> str:
        return self.data.task

    def series_path(self, name: str) -> Path | None:
        if self.run_dir is None:
            return None
        d = Path(self.run_dir) / "series"
        d.mkdir(parents=True, exist_ok=True)
        return d / f"{name}__{self.cell_id}__seed{self.seed}.csv"

    def write_series(self, name: str, df: Any) -> Path | None:
        """Write a per-cell curve/grid as CSV under ``series/`` (atomic replace)."""
        p = self.series_path(name)
        if p is None:
            return None
        tmp = p.with_suffix(".tmp")
        df.to_csv(tmp, index=False)
        tmp.replace(p)
        return p

    def evaluate(self, split: str = "test", max_samples: int | None = None) -> dict[str, float]:
        from ..run.evaluation import evaluate

        X, y = self.data.test if split == "test" else self.data.train
        if max_samples is not None:
            X, y = X[:max_samples], y[:max_samples]
        return evaluate(self.model, X, y, self.data.task, runtime=self.runtime)

    @property
    def runtime(self) -> Any:
        """The cell's :class:`~deqbench.deq.Runtime` (its ``runtime`` section)."""
        from ..core.runtime import cell_runtime

        return cell_runtime(self.cell)


class Analysis:
    """Base class of analyses. Override any hook; each returns an iterable of :class:`Row`."""

    name: ClassVar[str] = "analysis"
    version: ClassVar[str] = "1"
    #: set False for analyses that only measure after training and want no training epochs
    needs_training: ClassVar[bool] = True
    #: the runner counts every DEQ solve an analysis hook makes as a probe solve and flags the
    #: cell when more than 1% miss tolerance (deqbench.run.solves). Set True where the analysis
    #: makes solves that are not meant to converge (fixed budgets timed, traces run to
    #: max_iter, sweeps into divergence) and judges the ones its numbers rest on itself,
    #: flagging its own rows (landscape grid points, Hessian gates, NTK and gradient references)
    judges_own_solves: ClassVar[bool] = False

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

    def __init__(self, params: BaseModel | dict[str, Any] | None = None) -> None:
        if params is None:
            params = {}
        if isinstance(params, dict):
            params = self.Params(**params)
        self.params = params

    def before_training(self, ctx: CellContext) -> Iterable[Row]:
        return ()

    def on_step(self, ctx: CellContext, info: StepInfo) -> Iterable[Row]:
        return ()

    def on_epoch(self, ctx: CellContext, info: EpochInfo) -> Iterable[Row]:
        return ()

    def after_training(self, ctx: CellContext) -> Iterable[Row]:
        return ()

    @classmethod
    def headline(cls, rows: Any) -> list[str]:
        """Lines the single-model commands (and ``deqbench run``) print after the summary table:
        the analysis's key numbers for one (cell, seed). ``rows``: this analysis's rows of that
        (cell, seed), a DataFrame in the results.csv schema. Default: none."""
        return []
