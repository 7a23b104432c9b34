"""``deqbench landscape`` and ``deqbench hessian``: one-cell suites through the common runner.

Each command builds a one-cell suite from its options (:func:`deqbench.suite.one_cell_suite`,
via :func:`deqbench.cli.run_one_cell`) with the analyses ``metrics`` and ``landscape`` /
``hessian`` and runs it through the same runner as ``deqbench run`` (one code path). With
``--checkpoint`` the model is loaded (``torch.load(weights_only=True)``) instead of trained
(``--epochs`` defaults to 0 then). Nothing heavy is imported until a command runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

LANDSCAPE_HELP = (
    "Loss landscape around the trained (or loaded) parameters on filter-normalised random "
    "directions; writes series/landscape__*.csv, the directions (artifacts/) and "
    "plots/landscape_{contours,surface,curves}.png. Every point is solved with the model's "
    "forward solver (--solver, --max-iter, --tol). Exits 1 (flagged) when the solve at the "
    "trained weights misses its tolerance; points elsewhere that miss it are counted and "
    "marked, never part of a curve or a summary."
)
HESSIAN_HELP = (
    "Hessian of the training loss at the trained (or loaded) parameters: top eigenvalues, trace "
    "and SLQ density, after the gates (gradient check, HVP vs finite differences, symmetry), "
    "with the agreement of the --compare backends; writes series/hessian_density__*.csv and "
    "plots/hessian_density.png."
)

LANDSCAPE_EXAMPLE = (
    "Examples:\n\n"
    "  deqbench landscape --model fc_deq_tiny --epochs 5 --grid 21 --device cpu\n\n"
    "  deqbench landscape --model conv_deq --data cifar10 --set data.root=~/data "
    "--checkpoint ckpt.pt --grid 51 --range -1:1 --max-samples 1024\n\n"
    "  deqbench landscape --model tied_repeat --set defaults.model.repeats=11 "
    "--directions results/landscape/RUN/artifacts/landscape_directions__CELL__seed0.pt"
)

HESSIAN_EXAMPLE = (
    "Examples:\n\n"
    "  deqbench hessian --model fc_deq_tiny --epochs 5 --dtype float64 --device cpu\n\n"
    "  deqbench hessian --model conv_deq_tiny --checkpoint ckpt.pt --backend autograd "
    "--compare pyhessian,fd --samples 512 --top-k 3 --trace-se 0.02"
)

Model = Annotated[str, typer.Option("--model", help="Registered model (deqbench ls models).")]
Data = Annotated[
    str, typer.Option("--data", help="Dataset (digits, synthetic, mnist, cifar10, ...).")
]
Subset = Annotated[
    int | None, typer.Option("--train-subset", min=1, help="Training examples to keep.")
]
Checkpoint = Annotated[
    Path | None,
    typer.Option(
        "--checkpoint", help="State dict to load (weights_only=True) instead of training."
    ),
]
Epochs = Annotated[
    int | None,
    typer.Option("--epochs", min=0, help="Training epochs (default 2; 0 with --checkpoint)."),
]
Lr = Annotated[float, typer.Option("--lr", help="Learning rate (Adam).")]
BatchSize = Annotated[int, typer.Option("--train-batch-size", min=1, help="Training batch size.")]
Solver = Annotated[
    str | None, typer.Option("--solver", help="Forward solver (default: the suite default).")
]
Tol = Annotated[float | None, typer.Option("--tol", help="Forward solver tolerance (relative).")]
MaxIter = Annotated[int | None, typer.Option("--max-iter", min=1, help="Forward solver budget.")]
Backward = Annotated[
    str | None, typer.Option("--backward", help="Backward mode: ift | unrolled | jfb | phantom.")
]
Dtype = Annotated[
    str,
    typer.Option(
        "--dtype",
        help="float32 | float64. float64 by default for hessian and ntk (second derivatives and "
        "eigenvalues need it), float32 elsewhere.",
    ),
]
Device = Annotated[str | None, typer.Option("--device", help="auto | cpu | cuda | cuda:N.")]
Seeds = Annotated[str | None, typer.Option("--seeds", help="Run seeds, e.g. 0,1,2 or 0-4.")]
Out = Annotated[Path | None, typer.Option("--out", help="Results root (default results/).")]
Set = Annotated[
    list[str] | None,
    typer.Option("--set", help="Override a suite field: KEY=VALUE with a dotted key (repeatable)."),
]
Progress = Annotated[
    bool | None, typer.Option("--progress/--no-progress", help="Progress bars on stderr.")
]
Split = Annotated[str, typer.Option("--split", help="train | test.")]


def _set_given(target: dict[str, Any], **values: Any) -> dict[str, Any]:
    """Add the ``values`` that are not None to ``target`` (in order); return ``target``."""
    target.update({k: v for k, v in values.items() if v is not None})
    return target


def _run_analysis(
    name: str,
    params: dict[str, Any],
    *,
    model: str,
    data: str,
    train_subset: int | None,
    checkpoint: Path | None,
    epochs: int | None,
    lr: float,
    batch_size: int,
    solver: str | None,
    tol: float | None,
    max_iter: int | None,
    backward: str | None,
    dtype: str,
    device: str | None,
    seeds: str | None,
    out: Path | None,
    set_: list[str] | None,
    progress: bool | None,
) -> None:
    """Run the one-cell suite with the analyses ``metrics`` and ``{name: params}``, built from
    the options shared by ``landscape`` and ``hessian``."""
    from .cli import run_one_cell

    if checkpoint is not None:
        params["checkpoint"] = str(checkpoint)
    if epochs is None:
        epochs = 0 if checkpoint is not None else 2
    solver_spec = None
    if solver is not None or tol is not None or max_iter is not None:
        # unset fields (the solver's name included) come from the model's declared defaults
        solver_spec = _set_given({}, name=solver, tol=tol, max_iter=max_iter)
    run_one_cell(
        name,
        model=model,
        analyses=["metrics", {name: params}],
        device=device,
        seeds=seeds,
        out=out,
        set_=set_,
        progress=progress,
        data=_set_given({"name": data}, train_subset=train_subset),
        train={"epochs": epochs, "lr": lr, "batch_size": batch_size},
        dtype=dtype,
        solver=solver_spec,
        backward=backward,
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
    grid: Annotated[int, typer.Option("--grid", min=1, help="Points per axis (odd).")] = 51,
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
    _set_given(
        params,
        batch_size=batch_size,
        points_per_batch=points_per_batch,
        directions=None if directions is None else str(directions),
        norm=norm,
        include_1d=include_1d,
    )
    _run_analysis(
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


def hessian_command(
    model: Model = "fc_deq_tiny",
    data: Data = "digits",
    train_subset: Subset = None,
    checkpoint: Checkpoint = None,
    backend: Annotated[
        str, typer.Option("--backend", help="autograd | fd | pyhessian.")
    ] = "autograd",
    compare: Annotated[
        str,
        typer.Option(
            "--compare",
            help="Other backends to report agreement with, comma-separated ('' for none).",
        ),
    ] = "pyhessian",
    split: Split = "train",
    samples: Annotated[
        int, typer.Option("--samples", min=1, help="Examples in the loss (seeded subset).")
    ] = 512,
    batch_size: Annotated[
        int | None,
        typer.Option("--batch-size", min=1, help="HVP batch (default: all samples at once)."),
    ] = None,
    params_: Annotated[
        str, typer.Option("--params", help="all | cell (the DEQ cell's parameters only).")
    ] = "all",
    method: Annotated[str, typer.Option("--method", help="lanczos | power.")] = "lanczos",
    top_k: Annotated[int, typer.Option("--top-k", min=1, help="Top eigenvalues (Lanczos).")] = 3,
    eig_tol: Annotated[
        float, typer.Option("--eig-tol", help="Relative Ritz-residual tolerance.")
    ] = 1e-4,
    trace_se: Annotated[
        float, typer.Option("--trace-se", help="Stop Hutchinson at this relative standard error.")
    ] = 0.02,
    max_probes: Annotated[
        int, typer.Option("--max-probes", min=2, help="Most Hutchinson probes.")
    ] = 300,
    density: Annotated[
        bool, typer.Option("--density/--no-density", help="SLQ eigenvalue density.")
    ] = True,
    slq_steps: Annotated[
        int, typer.Option("--slq-steps", min=2, help="Lanczos steps per SLQ probe.")
    ] = 64,
    slq_probes: Annotated[int, typer.Option("--slq-probes", min=1, help="SLQ probes.")] = 3,
    hessian_tol: Annotated[
        float | None,
        typer.Option(
            "--hessian-tol",
            help="DEQ solver tolerance during the analysis (default 1e-6 float32, 1e-12 float64).",
        ),
    ] = None,
    refine: Annotated[
        int | None,
        typer.Option(
            "--refine",
            min=0,
            help="Least differentiable adjoint steps of an IFT double backward with "
            "backward.second_order=refine (default 300); the default, implicit, needs none.",
        ),
    ] = None,
    dir_seed: Annotated[
        int, typer.Option("--probe-seed", help="Seed of the probes and the data subset.")
    ] = 0,
    epochs: Epochs = None,
    lr: Lr = 1e-3,
    train_batch_size: BatchSize = 64,
    solver: Solver = None,
    tol: Tol = None,
    max_iter: MaxIter = None,
    backward: Backward = None,
    dtype: Dtype = "float64",
    device: Device = None,
    seeds: Seeds = None,
    out: Out = None,
    set_: Set = None,
    progress: Progress = None,
) -> None:
    """Hessian of the training loss at the trained (or loaded) parameters: top eigenvalues,
    trace and SLQ density, after the gates (gradient check, HVP vs finite differences,
    symmetry); the agreement with the --compare backends is reported. Writes
    series/hessian_density__*.csv and plots/hessian_density.png."""
    params: dict[str, Any] = {
        "backend": backend,
        "compare": [c.strip() for c in compare.split(",") if c.strip()],
        "split": split,
        "samples": samples,
        "params": params_,
        "method": method,
        "top_k": 1 if method == "power" else top_k,
        "eig_tol": eig_tol,
        "trace_rel_se": trace_se,
        "trace_max_samples": max_probes,
        "density": density,
        "slq_steps": slq_steps,
        "slq_probes": slq_probes,
        "seed": dir_seed,
    }
    _set_given(params, batch_size=batch_size, tol=hessian_tol, refine=refine)
    _run_analysis(
        "hessian",
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
    """Add the ``landscape`` and ``hessian`` commands to the deqbench Typer app."""
    app.command("landscape", help=LANDSCAPE_HELP, epilog=LANDSCAPE_EXAMPLE)(landscape_command)
    app.command("hessian", help=HESSIAN_HELP, epilog=HESSIAN_EXAMPLE)(hessian_command)
