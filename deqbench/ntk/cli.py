"""``deqbench ntk``: the empirical NTK's lambda_min over training, as a one-cell suite.

The command builds a one-cell suite from its options (:func:`deqbench.run.suite.one_cell_suite`)
with the analyses ``metrics`` and ``ntk`` and runs it through the same runner as
``deqbench run`` (one code path). Defaults reproduce the setting of Nguyen 2022 chapter 3 on a
small scale: full-batch gradient descent (``sgd``, momentum 0) with the squared loss on a digits
subset with scalar +-1 targets, float64, lambda_min of the NTK on the whole train split beside the
loss and the log-loss slope it predicts. Nothing heavy is imported until the command runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

EXAMPLE = (
    "Example: deqbench ntk --model fc_deq_tiny --epochs 40 --every 5 --device cpu\n\n"
    "Other settings through --set, e.g. --set data.target=onehot --output full, or "
    "--set defaults.model.width=64."
)


def ntk(
    model: Annotated[
        str, typer.Option("--model", help="Registered model (deqbench ls models).")
    ] = "fc_deq_tiny",
    data: Annotated[
        str,
        typer.Option(
            "--data", help="Dataset; digits defaults to target=binary (scalar +-1 regression)."
        ),
    ] = "digits",
    train_subset: Annotated[
        int | None, typer.Option("--train-subset", help="Training examples (digits default 128).")
    ] = None,
    n: Annotated[
        int, typer.Option("--n", min=1, help="Probe inputs (capped at the split size).")
    ] = 128,
    split: Annotated[str, typer.Option("--split", help="Probe split: train | test.")] = "train",
    every: Annotated[
        int, typer.Option("--every", min=1, help="Evaluate the NTK every k epochs (or steps).")
    ] = 5,
    per: Annotated[str, typer.Option("--per", help="epoch | step.")] = "epoch",
    output: Annotated[
        str, typer.Option("--output", help="Scalar output: sum | scalar | full | a logit index.")
    ] = "sum",
    method: Annotated[str, typer.Option("--method", help="batched | naive | gram.")] = "batched",
    tol: Annotated[
        float | None,
        typer.Option(
            "--ntk-tol",
            help="Tolerance of the NTK forward and adjoint solves (default 1e-10 in float64, "
            "1e-6 in float32); not the training solver's tolerance.",
        ),
    ] = None,
    ntk_max_iter: Annotated[
        int | None,
        typer.Option(
            "--ntk-max-iter",
            min=1,
            help="Iteration budget of the NTK forward and adjoint solves (default: max(1000, "
            "the model's)); a solve that misses --ntk-tol flags the run (exit 1).",
        ),
    ] = None,
    epochs: Annotated[
        int, typer.Option("--epochs", min=0, help="Training epochs (full batch: one step each).")
    ] = 40,
    lr: Annotated[float, typer.Option("--lr", help="Learning rate.")] = 0.05,
    optimizer: Annotated[
        str,
        typer.Option(
            "--optimizer", help="sgd (gradient descent with --momentum 0) | adam | adamw."
        ),
    ] = "sgd",
    momentum: Annotated[
        float, typer.Option("--momentum", help="SGD momentum (0: plain gradient descent).")
    ] = 0.0,
    full_batch: Annotated[
        bool,
        typer.Option(
            "--full-batch/--mini-batch", help="One step per epoch over the whole train set."
        ),
    ] = True,
    solver: Annotated[
        str | None, typer.Option("--solver", help="Forward solver (default: the model's).")
    ] = None,
    dtype: Annotated[
        str,
        typer.Option(
            "--dtype",
            help="float64 | float32. float64 by default here and in hessian (eigenvalues of K "
            "need it), float32 elsewhere.",
        ),
    ] = "float64",
    device: Annotated[
        str | None, typer.Option("--device", help="cuda_if_available | cpu | cuda | cuda:N.")
    ] = None,
    seeds: Annotated[str | None, typer.Option("--seeds", help="Seeds, e.g. 0,1,2 or 0-4.")] = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="Results root (default results/).")
    ] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set", help="Override a suite field: KEY=VALUE with a dotted key (repeatable)."
        ),
    ] = None,
    progress: Annotated[
        bool | None, typer.Option("--progress/--no-progress", help="Progress bar on stderr.")
    ] = None,
) -> None:
    """Empirical NTK lambda_min, lambda_max, condition and trace over training, beside the loss;
    writes series/ntk__*.csv and plots/ntk.png."""
    from ..cli import run_one_cell

    data_spec = _data_section(data, train_subset)
    params = _ntk_params(n, split, every, per, output, method, tol, ntk_max_iter)
    train = {
        "epochs": epochs,
        "lr": lr,
        "optimizer": optimizer,
        "momentum": momentum,
        "full_batch": full_batch,
    }
    run_one_cell(
        "ntk",
        model=model,
        analyses=["metrics", {"ntk": params}],
        device=device,
        seeds=seeds,
        out=out,
        set_=set_,
        progress=progress,
        data=data_spec,
        train=train,
        dtype=dtype,
        solver=solver,  # None: the model's (run_one_cell drops None sections)
    )


def _data_section(data: str, train_subset: int | None) -> dict[str, Any]:
    """The suite's ``data`` section: digits as scalar +-1 regression on 128 examples unless
    ``--train-subset`` says otherwise."""
    data_spec: dict[str, Any] = {"name": data}
    if data == "digits":
        data_spec.update(target="binary", train_subset=128)
    if train_subset is not None:
        data_spec["train_subset"] = train_subset
    return data_spec


def _ntk_params(
    n: int,
    split: str,
    every: int,
    per: str,
    output: str,
    method: str,
    tol: float | None,
    ntk_max_iter: int | None,
) -> dict[str, Any]:
    """The ``ntk`` analysis's parameters from the command's options (``--output`` a logit
    index: an int)."""
    out_kind: str | int = int(output) if output.lstrip("-").isdigit() else output
    params: dict[str, Any] = {
        "n": n,
        "split": split,
        "every": every,
        "per": per,
        "output": out_kind,
        "method": method,
    }
    if tol is not None:
        params["tol"] = tol
    if ntk_max_iter is not None:
        params["max_iter"] = ntk_max_iter
    return params


def register(app: typer.Typer) -> None:
    """Add the ``ntk`` command to the deqbench Typer app."""
    app.command("ntk", epilog=EXAMPLE)(ntk)
