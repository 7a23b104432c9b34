"""``deqbench new-plugin NAME``: write a ready plugin package (:mod:`deqbench.run.scaffold`)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated

import typer

# the backslash before [test] keeps rich (Typer's help) from reading it as a markup tag
EXAMPLE = (
    "Example: deqbench new-plugin deqbench-mydeq\n\n"
    "Then: pip install -e 'deqbench-mydeq\\[test]' && python -m pytest deqbench-mydeq"
)


def next_steps(root: Path) -> str:
    """The shell line that installs the package at ``root`` with its ``test`` extra (pytest)
    and runs its test with the interpreter pip installed into (``python -m pytest``: a bare
    ``pytest`` may be another environment's)."""
    extra, pkg = shlex.quote(f"{root}[test]"), shlex.quote(str(root))
    return f"pip install -e {extra} && python -m pytest {pkg}"


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
    a one-cell suite. It passes right after pip install -e 'NAME\\[test]' (the test extra
    brings pytest) with python -m pytest NAME (the interpreter pip installed into runs it)."""
    from . import handle_errors

    with handle_errors():
        from ..run.scaffold import plugin_names, write_plugin

        root = write_plugin(name, out)
        n = plugin_names(name)
        print(f"wrote {root}: model {n['model']}, solver {n['solver']}")
        print(f"next: {next_steps(root)}")


def register(app: typer.Typer) -> None:
    """Add the ``new-plugin`` command to the deqbench Typer app."""
    app.command("new-plugin", epilog=EXAMPLE)(new_plugin)
