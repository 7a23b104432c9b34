"""``deqbench landscape``: a one-cell suite through the common runner (the options shared with
``deqbench hessian`` are in :mod:`deqbench.cli.options`). Nothing heavy is imported until the
command runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from ..cli.options import (
    Backward,
    BatchSize,
    Checkpoint,
    Data,
    Device,
    Dtype,
    Epochs,
    Lr,
    MaxIter,
    Model,
    Out,
    Progress,
    Seeds,
    Set,
    Solver,
    Split,
    Subset,
    Tol,
    run_analysis,
    set_given,
)

LANDSCAPE_HELP = (
    "Loss landscape around the trained (or loaded) parameters on filter-normalised random "
    "directions; writes series/landscape__*.csv, the directions (artifacts/) and "
    "plots/landscape_{contours,surface,curves}.png. Every point is solved with the model's "
    "forward solver (--solver, --max-iter, --tol), from the model's own start (--warm-start "
    "neighbour: from its solved neighbours' fixed points, about half the f-evaluations). "
    "Exits 1 (flagged) when the solve at the "
    "trained weights misses its tolerance; points elsewhere that miss it are counted and "
    "marked, never part of a curve or a summary."
)
LANDSCAPE_EXAMPLE = (
    "Examples:\n\n"
    "  # about 45 s on 2 CPU cores; after 5 epochs some evaluation batches need more than "
    "fc_deq_tiny's 100 Broyden steps to reach tol 1e-4, hence --max-iter 200\n\n"
    "  deqbench landscape --model fc_deq_tiny --epochs 5 --max-iter 200 --grid 21 "
    "--max-samples 256 --device cpu\n\n"
    "  deqbench landscape --model conv_deq --data cifar10 --set data.root=~/data "
    "--checkpoint ckpt.pt --grid 51 --range -1:1 --max-samples 1024\n\n"
    "  deqbench landscape --model tied_repeat --set defaults.model.repeats=11 "
    "--directions results/landscape/RUN/artifacts/landscape_directions__CELL__seed0.pt"
)


def landscape_command(
    model: Model = "fc_deq_tiny",
    data: Data = "digits",
    train_subset: Subset = None,
    checkpoint: Checkpoint = None,
    directions: Annotated[
        Path | None,
        typer.Option(
            "--directions",
            help="Directions file (from a previous run's artifacts/) to reuse the same plane.",
        ),
    ] = None,
    grid: Annotated[
        int, typer.Option("--grid", min=1, help="Points per axis (odd, at most 501).")
    ] = 51,
    range_: Annotated[
        str, typer.Option("--range", help="Coordinate range LO:HI of both axes.")
    ] = "-1:1",
    dims: Annotated[int, typer.Option("--dims", min=1, max=2, help="1-D curve or 2-D plane.")] = 2,
    split: Split = "train",
    max_samples: Annotated[
        int | None, typer.Option("--max-samples", min=1, help="Evaluation examples.")
    ] = 1024,
    batch_size: Annotated[
        int | None,
        typer.Option(
            "--batch-size", min=1, help="Evaluation batch (default: all examples at once)."
        ),
    ] = None,
    points_per_batch: Annotated[
        int | None,
        typer.Option(
            "--points-per-batch", min=1, help="Grid points per vmapped forward (explicit models)."
        ),
    ] = None,
    norm: Annotated[
        str | None,
        typer.Option(
            "--norm",
            help="filter | layer | weight | none (default filter; with --directions the file's).",
        ),
    ] = None,
    include_1d: Annotated[
        bool | None,
        typer.Option(
            "--include-1d/--ignore-1d",
            help="Perturb biases and norm layers too (default: zero direction; with "
            "--directions the file's).",
        ),
    ] = None,
    dir_seed: Annotated[int, typer.Option("--dir-seed", help="Seed of the random directions.")] = 0,
    warm_start: Annotated[
        str | None,
        typer.Option(
            "--warm-start",
            help="Initial iterate of the off-centre solves: off (default: every point cold, "
            "as the model runs), neighbour (predicted from solved neighbours' fixed points: "
            "about half the f-evaluations; follows its neighbours' branch where the cell has "
            "several fixed points), nearest or centre.",
        ),
    ] = None,
    epochs: Epochs = None,
    lr: Lr = 1e-3,
    train_batch_size: BatchSize = 64,
    solver: Solver = None,
    tol: Tol = None,
    max_iter: MaxIter = None,
    backward: Backward = None,
    dtype: Dtype = "float32",
    device: Device = None,
    seeds: Seeds = None,
    out: Out = None,
    set_: Set = None,
    progress: Progress = None,
) -> None:
    """Loss landscape around the trained (or loaded) parameters on filter-normalised random
    directions: writes series/landscape__*.csv, the directions (artifacts/) and
    plots/landscape_{contours,surface,curves}.png."""
    params: dict[str, Any] = {
        "grid": grid,
        "range": range_,
        "dims": dims,
        "split": split,
        "max_samples": max_samples,
        "seed": dir_seed,
        "progress": progress is not False,
    }
    set_given(
        params,
        batch_size=batch_size,
        points_per_batch=points_per_batch,
        directions=None if directions is None else str(directions),
        norm=norm,
        include_1d=include_1d,
        warm_start=warm_start,
    )
    run_analysis(
        "landscape",
        params,
        model=model,
        data=data,
        train_subset=train_subset,
        checkpoint=checkpoint,
        epochs=epochs,
        lr=lr,
        batch_size=train_batch_size,
        solver=solver,
        tol=tol,
        max_iter=max_iter,
        backward=backward,
        dtype=dtype,
        device=device,
        seeds=seeds,
        out=out,
        set_=set_,
        progress=progress,
    )


def register(app: typer.Typer) -> None:
    """Add the ``landscape`` command to the deqbench Typer app."""
    app.command("landscape", help=LANDSCAPE_HELP, epilog=LANDSCAPE_EXAMPLE)(landscape_command)
