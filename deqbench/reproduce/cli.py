"""``deqbench reproduce``: test the source papers' claims and write a reproduction report.

Registered by :func:`deqbench.cli._register_subcommands`; nothing heavy is imported until the
command runs (``deqbench --help`` imports no torch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

EXAMPLE = (
    "Example: deqbench reproduce 002 003 --scale cpu --out results/reproduction/cpu\n\n"
    "One claim: deqbench reproduce --claims 001-init-cost. All claims at CPU scale (about "
    "15 minutes on 2 cores): deqbench reproduce --scale cpu"
)


def reproduce_command(
    papers: Annotated[
        list[str] | None,
        typer.Argument(help="Papers to reproduce: 001 002 003 004 (default: all)."),
    ] = None,
    scale: Annotated[
        str,
        typer.Option(
            "--scale",
            help="cpu: suites/repro/*_cpu.yaml (3 seeds, mnist5k/digits/synthetic data, small "
            "models; absolute numbers not compared); paper: the *_gpu.yaml suites.",
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
            "--claims", help="Only these claim ids, comma-separated (e.g. 001-init-cost)."
        ),
    ] = None,
) -> None:
    """Run the suites behind the papers' claims, check each claim in the paper's direction and
    write reproduction.csv and reproduction.md (verdicts: reproduced, not reproduced, not run).

    Each needed suite runs once (claims sharing a suite share its run); progress is one line
    per suite on stderr. A suite that fails or is flagged still yields verdicts."""
    from ..cli import handle_errors

    with handle_errors():
        from .run import reproduce

        ids = [c.strip() for c in (claims or "").split(",") if c.strip()]
        folder = reproduce(papers or (), scale=scale, claim_ids=ids, out=out, data_root=data_root)
        print(f"report: {folder / 'reproduction.md'}")


def register(app: typer.Typer) -> None:
    """Add the ``reproduce`` command to the deqbench Typer app."""
    app.command("reproduce", epilog=EXAMPLE)(reproduce_command)
