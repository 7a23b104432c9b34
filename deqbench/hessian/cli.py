"""``deqbench hessian``: a one-cell suite through the common runner (the options shared with
``deqbench landscape`` are in :mod:`deqbench.cli.options`). Nothing heavy is imported until the
command runs.
"""

from __future__ import annotations

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

HESSIAN_HELP = (
    "Hessian of the training loss at the trained (or loaded) parameters: top eigenvalues, trace "
    "and SLQ density, after the gates (gradient check, HVP vs finite differences, symmetry), "
    "with the agreement of the --compare backends; writes series/hessian_density__*.csv and "
    "plots/hessian_density.png."
)

HESSIAN_EXAMPLE = (
    "Examples:\n\n"
    "  deqbench hessian --model fc_deq_tiny --epochs 5 --dtype float64 --device cpu\n\n"
    "  deqbench hessian --model conv_deq_tiny --checkpoint ckpt.pt --backend autograd "
    "--compare pyhessian,fd --samples 512 --top-k 3 --trace-se 0.02"
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
    set_given(params, batch_size=batch_size, tol=hessian_tol, refine=refine)
    run_analysis(
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
    """Add the ``hessian`` command to the deqbench Typer app."""
    app.command("hessian", help=HESSIAN_HELP, epilog=HESSIAN_EXAMPLE)(hessian_command)
