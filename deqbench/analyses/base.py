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
    from ..data.base import DataBundle


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

    @classmethod
    def skipped(cls, metric: str, why: str, **kw: Any) -> Row:
        """A row saying ``metric`` does not apply here, and ``why`` (value NaN)."""
        return cls(metric, math.nan, status="skipped", note=why, **kw)

    @classmethod
    def failed(cls, metric: str, exc: BaseException, **kw: Any) -> Row:
        """A row saying measuring ``metric`` raised ``exc`` (status ``oom`` for out-of-memory,
        else ``error``; value NaN): the run goes on and the cell is flagged."""
        text = f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300]
        oom = "out of memory" in str(exc).lower() or isinstance(exc, MemoryError)
        return cls(metric, math.nan, status="oom" if oom else "error", note=text, **kw)


def mean_max(
    metric: str, values: Iterable[float], *, step: int | None = None, note: str = "", unit: str = ""
) -> list[Row]:
    """Rows ``metric`` with variants ``mean`` and ``max`` over the finite ``values`` (a
    skipped row when none is finite), e.g. a per-layer or per-sample quantity."""
    vals = [float(v) for v in values]
    finite = [v for v in vals if math.isfinite(v)]
    if not finite:
        why = f"no finite value among {len(vals)}" if vals else "nothing to measure"
        return [Row.skipped(metric, why, variant="mean", step=step, unit=unit)]
    extra = (
        f"{len(vals) - len(finite)} of {len(vals)} non-finite, left out"
        if len(finite) < len(vals)
        else ""
    )
    text = "; ".join(t for t in (note, extra) if t)
    return [
        Row(metric, sum(finite) / len(finite), variant="mean", step=step, unit=unit, note=text),
        Row(metric, max(finite), variant="max", step=step, unit=unit, note=text),
    ]


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
        from ..core.evaluation import evaluate

        X, y = self.data.test if split == "test" else self.data.train
        if max_samples is not None:
            X, y = X[:max_samples], y[:max_samples]
        rng = float((self.data.meta or {}).get("data_range", 1.0))
        return evaluate(self.model, X, y, self.data.task, runtime=self.runtime, data_range=rng)

    @property
    def runtime(self) -> Any:
        """The cell's :class:`~deqbench.deq.Runtime` (its ``runtime`` section)."""
        from ..core.runtime import cell_runtime

        return cell_runtime(self.cell)


class Analysis:
    """Base class of analyses.

    Two ways to write one:

    * **declarative** (most analyses): override :meth:`measure` (``ctx, step -> rows``); the base
      runs it on its schedule, :attr:`every` (or a ``Params`` field ``every``): ``"epoch"``
      before training (step 0) and after every epoch; ``"end"`` before training and after the
      last epoch; never twice at one step. A ``measure`` that raises gives one
      :meth:`Row.failed` row of :attr:`metric` (the run goes on; the cell is flagged). Declare
      the figures as :meth:`plot` (``df, run_dir -> {name: Figure}``, drawn with
      :mod:`deqbench.plots`); :func:`mean_max` and :meth:`Row.skipped` make the usual rows;
    * **hooks**: override any of :meth:`before_training`, :meth:`on_step`, :meth:`on_epoch`,
      :meth:`after_training`; each returns an iterable of :class:`Row`. A hook that raises
      (``sys.exit()`` too) keeps the rows it gave, adds one failed row and ends the analysis for
      that (cell, seed); training and the other analyses go on and the cell is flagged.
    """

    name: ClassVar[str] = "analysis"
    version: ClassVar[str] = "1"
    #: whether the runner enters the training loop for this analysis when the cell trains for
    #: ``train.epochs: 0`` (the loop evaluates epoch 0 and calls ``on_epoch(0)``). False: with 0
    #: epochs nothing trains and only ``before_training``/``after_training`` run (measurements
    #: of an initialised or given model); with epochs > 0 the cell trains either way
    needs_training: ClassVar[bool] = True
    #: the schedule of :meth:`measure`: "epoch" or "end" (a ``Params`` field ``every`` wins)
    every: ClassVar[str] = "epoch"
    #: the metric of the error row when :meth:`measure` raises (default: the analysis name)
    metric: ClassVar[str] = ""
    #: the one-cell suite options ``deqbench.testing.check_analysis`` runs it on (model, data,
    #: solver, backward, init, train, params; over ``testing.DEFAULT_EXAMPLE``: fc_deq_tiny on
    #: 8x8 digits, one epoch)
    example: ClassVar[dict[str, Any]] = {}
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

    def measure(self, ctx: CellContext, step: int) -> Iterable[Row]:
        """The rows of the model's current state, tagged ``step`` (declarative analyses)."""
        return ()

    def _scheduled(self, ctx: CellContext, when: str, step: int) -> Iterable[Row]:
        if type(self).measure is Analysis.measure:
            return ()
        every = getattr(self.params, "every", None) or self.every
        if when == "epoch" and every != "epoch":
            return ()
        if when == "end" and every != "end":
            return ()
        done: set[int] = self.__dict__.setdefault("_measured_steps", set())
        if step in done:
            return ()
        done.add(step)
        return self._rows_or_error(lambda: self.measure(ctx, step), step)

    def _rows_or_error(self, rows: Callable[[], Iterable[Row]], step: int) -> list[Row]:
        """``rows()`` as a list, or one error row when it raises (failure is data; a
        :class:`~deqbench.core.errors.DeqbenchError`, a configuration mistake, propagates: the
        runner records it as the analysis's failed row and calls none of its later hooks)."""
        try:
            return list(rows())
        except Exception as exc:  # noqa: BLE001 - failure is data; the run goes on
            from ..core.errors import DeqbenchError

            if isinstance(exc, DeqbenchError):
                raise
            return [Row.failed(self.metric or self.name, exc, step=step)]

    def before_training(self, ctx: CellContext) -> Iterable[Row]:
        return self._scheduled(ctx, "start", 0)

    def on_step(self, ctx: CellContext, info: StepInfo) -> Iterable[Row]:
        return ()

    def on_epoch(self, ctx: CellContext, info: EpochInfo) -> Iterable[Row]:
        return self._scheduled(ctx, "epoch", info.epoch)

    def after_training(self, ctx: CellContext) -> Iterable[Row]:
        epochs = int((ctx.cell.get("train") or {}).get("epochs", 0) or 0)
        return self._scheduled(ctx, "end", epochs)

    @classmethod
    def plot(cls, df: Any, run_dir: Path) -> dict[str, Any]:
        """The analysis's figures, ``{figure name: Figure}`` (``df``: the run's results, every
        analysis included; an empty dict when there is nothing to draw). Override it to
        declare figures: ``deqbench run`` and ``deqbench plot`` save them as
        ``plots/<figure name>.png``."""
        return {}

    @classmethod
    def draws(cls) -> bool:
        """Whether the class declares figures (overrides :meth:`plot`)."""
        return cls.plot.__func__ is not Analysis.plot.__func__  # type: ignore[attr-defined]

    @classmethod
    def headline(cls, rows: Any) -> list[str]:
        """Lines the single-model commands (and ``deqbench run``) print after the summary table:
        the analysis's key numbers for one (cell, seed). ``rows``: this analysis's rows of that
        (cell, seed), a DataFrame in the results.csv schema. Default: none."""
        return []
