"""Options and the one-cell runner shared by the analysis verbs (``deqbench landscape``,
``deqbench hessian``): each builds a one-cell suite from its options
(:func:`deqbench.run.suite.one_cell_suite`, via :func:`deqbench.cli.run_one_cell`) with the
analyses ``metrics`` and its own, and runs it through the same runner as ``deqbench run`` (one
code path). With ``--checkpoint`` the model is loaded (``torch.load(weights_only=True)``) instead
of trained (``--epochs`` defaults to 0 then). Nothing heavy is imported until a command runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

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
Device = Annotated[
    str | None, typer.Option("--device", help="cuda_if_available | cpu | cuda | cuda:N.")
]
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


def set_given(target: dict[str, Any], **values: Any) -> dict[str, Any]:
    """Add the ``values`` that are not None to ``target`` (in order); return ``target``."""
    target.update({k: v for k, v in values.items() if v is not None})
    return target


def run_analysis(
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
    from . import run_one_cell

    if checkpoint is not None:
        params["checkpoint"] = str(checkpoint)
    if epochs is None:
        epochs = 0 if checkpoint is not None else 2
    solver_spec = None
    if solver is not None or tol is not None or max_iter is not None:
        # unset fields (the solver's name included) come from the model's declared defaults
        solver_spec = set_given({}, name=solver, tol=tol, max_iter=max_iter)
    run_one_cell(
        name,
        model=model,
        analyses=["metrics", {name: params}],
        device=device,
        seeds=seeds,
        out=out,
        set_=set_,
        progress=progress,
        data=set_given({"name": data}, train_subset=train_subset),
        train={"epochs": epochs, "lr": lr, "batch_size": batch_size},
        dtype=dtype,
        solver=solver_spec,
        backward=backward,
    )
