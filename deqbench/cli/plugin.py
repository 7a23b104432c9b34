"""``deqbench new-plugin NAME``: write a ready plugin package (:mod:`deqbench.run.scaffold`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

EXAMPLE = (
    "Example: deqbench new-plugin deqbench-mydeq\n\n"
    "Then: pip install -e deqbench-mydeq && pytest deqbench-mydeq"
)


def new_plugin(
    name: Annotated[
        str, typer.Argument(help="Distribution name of the plugin, e.g. deqbench-mydeq.")
    ],
    out: Annotated[
        Path, typer.Option("--out", help="Folder to write NAME/ into (default: here).")
    ] = Path("."),
) -> None:
    """Write a plugin package NAME/: pyproject.toml with entry points, a model and a solver
    written to the contracts (deqbench.contracts), and a test that runs deqbench validate and
    a one-cell suite. It passes right after pip install -e NAME."""
    from . import handle_errors

    with handle_errors():
        from ..run.scaffold import plugin_names, write_plugin

        root = write_plugin(name, out)
        n = plugin_names(name)
        print(f"wrote {root}: model {n['model']}, solver {n['solver']}")
        print(f"next: pip install -e {root} && pytest {root}")


def register(app: typer.Typer) -> None:
    """Add the ``new-plugin`` command to the deqbench Typer app."""
    app.command("new-plugin", epilog=EXAMPLE)(new_plugin)
