"""Analysis ``landscape``: a filter-normalised loss-landscape slice after training.

After training (or on a checkpoint, ``checkpoint: FILE``), the loss, accuracy (or MSE) and, for
DEQs, the forward f-evaluations, final residual and convergence are evaluated on a grid
``theta* + a d1 (+ b d2)`` (:mod:`deqbench.landscape`; its docstring says how the forward solves
are set up). Writes ``series/landscape__...csv`` (one row per point; unconverged points have
``loss`` NaN, ``loss_raw`` the measured value and ``converged`` false), saves the directions to
``artifacts/landscape_directions__...pt`` (reuse them with ``directions: FILE`` to compare
checkpoints or models on the same plane) and yields summary rows: ``loss_center``,
``accuracy_center``, ``nonconverged_points``, ``converged_frac``, ``low_loss_area_frac``,
``mean_loss_increase``, ``loss_max`` (the last three over converged points only),
``f_nstep_max``, ``w_spec_norm_max``, ``seconds``, ``seconds_per_point``.

**Warm starts.** By default (``warm_start: off``) every point is solved as the model runs, from
its own initial state: a model with several fixed points computes that function. With
``warm_start: neighbour`` (about half the f-evaluations) the grid is swept outward from the
centre row by row, and every point's forward solve starts, per example, from a first-order
prediction built from the fixed points of already solved neighbouring points that converged
for that example (the model's own initial state for an example none converged for): only the
initial iterate changes, the tolerance, budget and stop rule are the model's, so where the cell
has one fixed point the loss is the one a cold start gives, at fewer f-evaluations; where it has
several it follows the branch of its neighbours (:mod:`deqbench.landscape`: how, what was
measured). ``nearest`` starts from a neighbour's fixed point as it is, ``centre`` from the
centre's, ``off`` solves every point cold (the model's own initial state). A warm-started point that misses the tolerance is solved again cold (``f_nstep``
counts both), so every point that converges cold converges warm. The series' ``init``,
``warm_frac`` and ``warm_retried`` columns say which start each point used.

**Status.** The centre (the trained weights) is the measurement's quality check: when its forward
solve missed the tolerance (or its loss is not finite) every summary row is ``flagged`` with a
one-line cause and fix in ``note`` (the run then exits 1). Points away from the centre that do not
converge are data, not a failure: counted in ``nonconverged_points``, marked in the plots, left
out of every curve and statistic. For a model without deqbench DEQ layers convergence is not
measured: ``nonconverged_points`` is NaN with status ``skipped`` and a note saying so.

Example (suite YAML)::

    analyses:
      - landscape: {grid: 51, range: [-1, 1], split: train, max_samples: 1024, seed: 0}
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..analyses.base import Analysis, CellContext, Row
from ..core.registry import analyses
from ..run import plots

SERIES = "landscape"
NOT_MEASURED = (
    "convergence not measured: no deqbench DEQ layer reported a forward solve (an explicit "
    "network, or a DEQ whose solver deqbench does not see)"
)


def load_checkpoint(model: Any, path: str | Path, device: Any = None) -> None:
    """Load a state dict (or ``{"state_dict"|"model": state_dict}``) with
    ``torch.load(weights_only=True)`` into ``model`` (strict)."""
    from ..core.errors import ConfigError
    from ..core.tensor_files import load_tensors

    p = Path(path).expanduser()
    obj = load_tensors(p, "checkpoint", device or "cpu")
    if isinstance(obj, dict):
        for key in ("state_dict", "model", "model_state_dict"):
            if isinstance(obj.get(key), dict):
                obj = obj[key]
                break
    try:
        model.load_state_dict(obj, strict=True)
    except (RuntimeError, TypeError, AttributeError) as exc:
        first = " ".join(str(exc).split())[:300]
        raise ConfigError(f"checkpoint: {p} does not fit the model: {first}") from exc


def eval_split(ctx: CellContext, split: str, max_samples: int | None) -> tuple[Any, Any]:
    X, y = ctx.data.train if split == "train" else ctx.data.test
    if max_samples is not None:
        X, y = X[:max_samples], y[:max_samples]
    return X, y


class _Bar:
    """Progress with ETA on stderr when it is a terminal; silent otherwise.

    Standalone it is a rich bar. Under another live display (the runner's bar, which redirects
    stderr through rich's ``FileProxy``) a second live bar would garble the terminal, so it
    prints a short line every 10% instead, which rich shows above the runner's bar.
    """

    def __init__(self, total: int, description: str, enabled: bool) -> None:
        self.bar = None
        self.lines = False
        self.description, self.total = description, total
        self.t0 = time.perf_counter()
        self.next_line = 0.1
        if not (enabled and sys.stderr.isatty()):
            return
        if type(sys.stderr).__name__ == "FileProxy":
            self.lines = True
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        self.bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=True,
        )
        self.task = self.bar.add_task(description, total=total)

    def __enter__(self) -> _Bar:
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.stop()

    def __call__(self, done: int, total: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=done)
        elif self.lines and done >= self.next_line * total:
            el = time.perf_counter() - self.t0
            eta = el * (total - done) / max(done, 1)
            print(
                f"{self.description}: {done}/{total} points, ETA {eta:.0f} s",
                file=sys.stderr,
                flush=True,
            )
            self.next_line = math.floor(10 * done / total) / 10 + 0.1


@analyses.register("landscape")
class Landscape(Analysis):
    """Loss-landscape slice (Li et al. 2018) around the trained parameters."""

    judges_own_solves = True  # see Analysis.judges_own_solves
    name = "landscape"
    #: the cell deqbench.testing.check_analysis runs it on (over testing.DEFAULT_EXAMPLE)
    example: ClassVar[dict[str, Any]] = {
        "params": {"grid": 5, "max_samples": 64, "progress": False}
    }
    version = "2"  # 2: warm starts from solved neighbours by default

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        grid: int = Field(51, ge=1, description="points per axis (odd: the centre is a point)")
        range: tuple[float, float] = (-1.0, 1.0)
        dims: Literal[1, 2] = 2
        split: Literal["train", "test"] = "train"
        max_samples: int | None = Field(1024, ge=1)
        batch_size: int | None = Field(None, ge=1, description="eval batch (default: all at once)")
        points_per_batch: int | None = Field(
            None, ge=1, description="grid points per vmapped forward"
        )
        seed: int = 0
        norm: Literal["filter", "layer", "weight", "none"] = "filter"
        include_1d: bool = False
        directions: str | None = None
        renormalize: bool = True
        checkpoint: str | None = None
        spec_norm: bool = True
        level: float = Field(0.5, gt=0, description="loss increase that bounds the low-loss area")
        progress: bool = True
        warm_start: Literal["neighbour", "nearest", "centre", "off"] = Field(
            "off",
            description="initial iterate of the off-centre DEQ solves: neighbour (predicted "
            "from solved grid neighbours' fixed points, per example), nearest (a neighbour's "
            "fixed point as is), centre (the centre's) or off (the model's own); true / false "
            "mean centre / off",
        )
        max_iter: int | None = Field(
            None, ge=1, description="forward budget during the evaluation (default: the cell's)"
        )
        tol: float | None = Field(
            None, gt=0, description="forward tolerance during the evaluation (default: the cell's)"
        )

        @field_validator("warm_start", mode="before")
        @classmethod
        def _warm(cls, v: Any) -> Any:
            from ..core.errors import ConfigError
            from .surface import WARM_STARTS, warm_start_mode

            try:
                return warm_start_mode(v)
            except ConfigError:
                raise ValueError(
                    f"expected one of {', '.join(WARM_STARTS)} (or true / false)"
                ) from None

        @field_validator("range", mode="before")
        @classmethod
        def _range(cls, v: Any) -> Any:
            if isinstance(v, str):
                from .surface import parse_range

                return parse_range(v)
            return v

        @model_validator(mode="after")
        def _explicit_norm_needs_renormalize(self) -> Landscape.Params:
            given = [k for k in ("norm", "include_1d") if k in self.model_fields_set]
            if self.directions and not self.renormalize and given:
                raise ValueError(
                    f"{' and '.join(given)} with a directions file take effect by renormalising "
                    "its raw draw: drop them or set renormalize: true"
                )
            return self

        @field_validator("grid")
        @classmethod
        def _odd(cls, v: int) -> int:
            from .surface import MAX_GRID

            if v > MAX_GRID:
                raise ValueError(
                    f"grid must be at most {MAX_GRID} points per axis ({MAX_GRID**2:,} points), "
                    f"got {v}"
                )
            if v % 2 == 0:
                raise ValueError(
                    f"grid must be odd so that the trained parameters are a grid point, got {v}"
                )
            return v

    params: Params  # narrowed for type checkers

    @classmethod
    def headline(cls, rows: Any) -> list[str]:
        """Converged share, loss at the centre, and the flatness measures."""
        v = {m: g for m, g in rows.groupby("metric")}

        def val(metric: str) -> float:
            g = v.get(metric)
            return float(g["value"].iloc[0]) if g is not None and len(g) else float("nan")

        if "loss_center" not in v:
            return []
        line = f"centre loss {val('loss_center'):.4g}"
        if "accuracy_center" in v:
            line += f" (accuracy {val('accuracy_center'):.3g})"
        if (
            "points" in v
            and "nonconverged_points" in v
            and val("nonconverged_points") == val("nonconverged_points")
        ):
            n, bad = int(val("points")), int(val("nonconverged_points"))
            line += f"; {n - bad} of {n} points converged ({100 * (n - bad) / n:.0f}%)"
        if "mean_loss_increase" in v:
            line += f"; mean loss increase {val('mean_loss_increase'):.3g}"
        low = v.get("low_loss_area_frac")
        if low is not None and len(low):
            line += f", low-loss area {float(low['value'].iloc[0]):.0%} ({low['variant'].iloc[0]})"
        if "mean_loss_increase" in v or low is not None:
            line += " over the converged points"
        return [line]

    def before_training(self, ctx: CellContext) -> Iterable[Row]:
        if self.params.checkpoint:
            load_checkpoint(ctx.model, self.params.checkpoint, ctx.device)
        if self.params.directions:  # a missing or mismatched file fails now, not after training
            self._file_directions(ctx)
        return ()

    def _explicit(self) -> dict[str, Any]:
        """``norm`` / ``include_1d`` when given explicitly: with a directions file they override
        the file's own settings (else the file's are used)."""
        p = self.params
        return {k: getattr(p, k) for k in ("norm", "include_1d") if k in p.model_fields_set}

    def _file_directions(self, ctx: CellContext) -> Any:
        from ..core.errors import ConfigError
        from . import surface as ls

        p = self.params
        cached = getattr(self, "_dirs", None)
        if cached is not None:
            return cached
        assert p.directions is not None  # called with a directions file only
        dirs = ls.load_directions(p.directions)
        if dirs.ndim < p.dims:
            raise ConfigError(
                f"landscape.directions: {p.dims} dims need {p.dims} directions; "
                f"{p.directions} has {dirs.ndim}"
            )
        ls.resolve_directions(ctx.model, dirs, renormalize=p.renormalize, **self._explicit())
        self._dirs = dirs
        return dirs

    def after_training(self, ctx: CellContext) -> Iterable[Row]:
        from . import surface as ls

        p = self.params
        X, y = eval_split(ctx, p.split, p.max_samples)
        explicit = self._explicit() if p.directions else {}
        if p.directions:
            dirs = self._file_directions(ctx)
        else:
            dirs = ls.random_directions(
                ctx.model, p.dims, seed=p.seed, norm=p.norm, include_1d=p.include_1d
            )
        resolved = ls.resolve_directions(ctx.model, dirs, renormalize=p.renormalize, **explicit)
        if explicit:  # the saved artifact records the normalisation actually used
            dirs = dataclasses.replace(
                dirs,
                normalized=[{n: t.detach().double().cpu() for n, t in d.items()} for d in resolved],
                meta={**dirs.meta, **explicit},
            )
        resolved = resolved[: p.dims]
        ax = ls.axis(p.grid, *p.range)
        total = len(ax) ** p.dims
        with _Bar(total, f"landscape {ctx.cell_id}", p.progress) as bar:
            df = ls.evaluate_grid(
                ctx.model,
                resolved,
                X,
                y,
                alphas=ax,
                betas=ax if p.dims == 2 else None,
                task=ctx.task,
                batch_size=p.batch_size,
                points_per_batch=p.points_per_batch,
                spec_norm=p.spec_norm,
                progress=bar,
                warm_start=p.warm_start,
                max_iter=p.max_iter,
                tol=p.tol,
            )
        ctx.write_series(SERIES, df)
        if ctx.run_dir is not None:
            path = (
                Path(ctx.run_dir)
                / "artifacts"
                / f"landscape_directions__{ctx.cell_id}__seed{ctx.seed}.pt"
            )
            ls.save_directions(dirs, path)
        meta = dirs.meta  # with an explicit norm / include_1d: the ones used (above)
        note = f"norm={meta.get('norm')} ignore={'none' if meta.get('include_1d') else 'biasbn'} seed={meta.get('seed')}"
        if df.attrs.get("note"):
            note += "; " + df.attrs["note"]
        if df.attrs.get("warm_start", "off") != "off":
            note += f"; warm start: {df.attrs['warm_start']}"
        summary = ls.summarize(df, p.level)
        flag = ls.centre_note(df)
        measured = ls.convergence_measured(df)
        for metric, value in summary.items():
            variant = f"level={p.level:g}" if metric.startswith("low_loss_area_frac") else ""
            if flag:
                yield Row(metric, value, variant=variant, status="flagged", note=flag)
            elif metric == "nonconverged_points" and not measured:
                yield Row(metric, value, status="skipped", note=NOT_MEASURED)
            else:
                yield Row(metric, value, variant=variant, unit="", note=note)
        secs = float(df.attrs.get("seconds", math.nan))
        yield Row("seconds", secs, unit="s", note=f"vmap={df.attrs.get('vmap')} examples={len(X)}")
        yield Row("seconds_per_point", secs / max(len(df), 1), unit="s")

    @classmethod
    def plot(cls, df: Any, run_dir: Any) -> dict[str, Any]:
        """The figures (``deqbench.plots``): :func:`landscape_plots`."""
        return landscape_plots(df, run_dir)


# -- plots ------------------------------------------------------------------------------------


def landscape_plots(df: Any, run_dir: Path) -> dict[str, Any]:
    """``plots/landscape_contours.png``, ``landscape_surface.png`` and ``landscape_curves.png``
    from every cell's landscape series."""
    from . import plots as pa

    series = plots.read_series(run_dir, SERIES)
    if series.empty:
        return {}
    out: dict[str, Any] = {}
    if "beta" in series and series["beta"].notna().any():
        out["landscape_contours"] = pa.landscape_contours(series)
        out["landscape_surface"] = pa.landscape_surfaces(series)
    out["landscape_curves"] = pa.landscape_curves(series)
    return out
