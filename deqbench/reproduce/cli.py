"""``deqbench reproduce``: test the source papers' claims and write a reproduction report.

Registered by :func:`deqbench.cli._register_subcommands`; nothing heavy is imported until the
command runs (``deqbench --help`` imports no torch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

EXAMPLE = (
    "Example: deqbench reproduce pcdeq opteq --scale cpu --out results/reproduction/cpu\n\n"
    "One claim: deqbench reproduce --claims 001-init-cost. All claims at CPU scale (about "
    "3 minutes on 2 cores): deqbench reproduce --scale cpu. Paper scale on one GPU, "
    "8 small cells at a time: deqbench reproduce pcdeq --scale paper --executor dask --workers 8"
)


def reproduce_command(
    papers: Annotated[
        list[str] | None,
        typer.Argument(
            help="Papers to reproduce, by name or number: kglm (001), pcdeq (002), opteq (003), "
            "thesis or ntk (004); default: all."
        ),
    ] = None,
    scale: Annotated[
        str,
        typer.Option(
            "--scale",
            help="cpu: suites/repro/*_cpu.yaml (3 seeds, mnist5k/digits/synthetic data, small "
            "models; absolute numbers not compared); paper: suites/paper/*.yaml (the papers' "
            "architectures, widths, epochs; a GPU).",
        ),
    ] = "cpu",
    data_root: Annotated[
        Path | None,
        typer.Option(
            "--data-root",
            help="Root of the torchvision datasets (passed as data.root; sets DEQBENCH_DATA_ROOT).",
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Report folder (default results/reproduction/<timestamp>/)."),
    ] = None,
    claims: Annotated[
        str | None,
        typer.Option(
            "--claims",
            help="Only these claim ids, comma-separated (e.g. kglm-init-cost, or by the "
            "paper's number 001-init-cost).",
        ),
    ] = None,
    overrides: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            help="Override a field of every suite: KEY=VALUE with a dotted key, e.g. "
            "device=cpu (repeatable; the report's scale column is unchanged, so say it).",
        ),
    ] = None,
    executor: Annotated[
        str,
        typer.Option(
            "--executor",
            help="inline, or dask: each suite's cells x seeds as Dask tasks (deqbench\\[dask]).",
        ),
    ] = "inline",
    scheduler: Annotated[
        str | None,
        typer.Option("--scheduler", help="With --executor dask: a running scheduler's address."),
    ] = None,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume",
            help="Continue the --out folder's earlier runs: finished suites are reused, "
            "interrupted ones resumed, missing ones run; the report is rewritten.",
        ),
    ] = False,
    judge_only: Annotated[
        bool,
        typer.Option(
            "--judge-only",
            help="Judge the --out folder's runs as they are and rewrite the report; nothing is "
            "started or resumed. A stopped run (--stop-after) is judged on its finished tasks, "
            "the others named in each claim's reason (exit 1: not the whole grid).",
        ),
    ] = False,
    workers: Annotated[
        int | None,
        typer.Option(
            "--workers",
            help="With --executor dask: local worker processes (several per GPU run several "
            "small cells at once).",
        ),
    ] = None,
    stop_after: Annotated[
        float | None,
        typer.Option(
            "--stop-after",
            min=0,
            help="Stop after this many seconds: the running cells stop at their next training "
            "step, writing their checkpoints, no further cell or suite starts; exit 75, the "
            "report marks the unfinished suites' claims not run, and --resume continues.",
        ),
    ] = None,
) -> None:
    """Run the suites behind the papers' claims, check each claim in the paper's direction and
    write reproduction.csv and reproduction.md (verdicts: reproduced, not reproduced, not run).

    Each needed suite runs once (claims sharing a suite share its run); progress is one line
    per suite on stderr. Exit 0 when every suite ran to its end, 1 when a suite failed (its
    claims are not run), 2 for bad input or a folder another reproduce holds, 130/143 when
    interrupted (the report marks the unfinished suites' claims not run; resume with --resume),
    75 when --stop-after stopped a suite with cells unfinished (likewise; a training cell
    continues from its checkpoint).
    Several runs of one suite in the --out folder, each a part of its grid (--set select=...),
    are judged together (a cell measured again: its latest run).
    Flagged cells are measurements: the checkers judge their convergence."""
    from ..cli import handle_errors

    code = 0
    with handle_errors():
        if out is not None:  # an existing file, /proc, a read-only folder: one line, up front
            from ..core.errors import ConfigError
            from ..run.suite import output_problem

            if (why := output_problem(str(out.parent), out.name)) is not None:
                raise ConfigError(f"--out {out}: {why}")
        from ..run.interrupts import stop_after as deadline
        from .run import RunOptions, reproduce_run

        ids = [c.strip() for c in (claims or "").split(",") if c.strip()]
        if judge_only:
            from ..core.errors import ConfigError

            if out is None or not out.is_dir():
                raise ConfigError("--judge-only judges a report folder's runs: name an existing "
                                  "folder with --out DIR")  # fmt: skip
            if overrides or resume or stop_after is not None or executor != "inline" or workers:
                raise ConfigError("--judge-only runs nothing: drop --set, --resume, --stop-after, "
                                  "--executor and --workers")  # fmt: skip
        opts = RunOptions(tuple(overrides or ()), executor, scheduler, workers, resume,
                          judge_only)  # fmt: skip
        with deadline(stop_after):  # every suite's tasks stop then
            folder, code = reproduce_run(papers or (), scale=scale, claim_ids=ids, out=out,
                                         data_root=data_root, options=opts)  # fmt: skip
        print(f"report: {folder / 'reproduction.md'}")
    if code:
        raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    """Add the ``reproduce`` command to the deqbench Typer app."""
    app.command("reproduce", epilog=EXAMPLE)(reproduce_command)
