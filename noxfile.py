"""nox sessions: ``tests``, ``lint``, ``typecheck``, ``docs`` (the defaults: what ``nox`` runs,
the README's test command, which CI runs) and ``smoke``.

pip install nox && nox
"""

from __future__ import annotations

import shutil
from pathlib import Path

import nox

nox.options.sessions = ["tests", "lint", "typecheck", "docs"]
nox.options.error_on_missing_interpreters = True

PYTHON = "3.11"
TORCH = ("torch==2.14.1", "torchvision==0.29.1")
DOCS = (
    "mkdocs==1.6.1",
    "mkdocs-material==9.8.2",
    "mkdocstrings[python]==1.0.8",
    "mkdocstrings-python==2.0.11",
    "ruff==0.17.6",  # mkdocstrings formats the separate signatures with it
)


def _install(session: nox.Session, extras: str = "test") -> None:
    session.install(*TORCH)
    session.install("-e", f".[{extras}]")


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The test suite on CPU (GPU tests deselected), then the docstring examples of the package
    (so that documented outputs stay true). Extra args go to pytest. Installs the ``dask`` extra
    so that tests/test_dask.py runs (it skips without Dask)."""
    _install(session, "test,dask")
    session.run("pytest", "-m", "not gpu", *session.posargs)
    session.run("pytest", "--doctest-modules", "deqbench", "-q", "-p", "no:cacheprovider")
    _new_plugin(session)


def _new_plugin(session: nox.Session) -> None:
    """The package `deqbench new-plugin` writes, installed into a temporary folder (no build
    isolation, no dependencies: offline and in seconds), passes its own test."""
    tmp = Path(session.create_tmp()) / "new-plugin"
    shutil.rmtree(tmp, ignore_errors=True)
    session.run("deqbench", "new-plugin", "deqbench-ci-plugin", "--out", str(tmp))
    session.install("setuptools>=70.1")  # builds the plugin without build isolation
    site = tmp / "site"
    pkg = tmp / "deqbench-ci-plugin"
    session.install("--no-build-isolation", "--no-deps", "--target", str(site), str(pkg))
    env = {"PYTHONPATH": str(site), "DEQBENCH_DISABLE_PLUGIN_AUTOLOAD": "0"}
    session.run("pytest", "-q", "-p", "no:cacheprovider", str(pkg), env=env)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check."""
    session.install("ruff==0.17.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy on the package (clean: CI runs it)."""
    _install(session)
    session.install("mypy==2.4.1", "types-PyYAML")
    session.run("mypy", "deqbench/")


@nox.session(python=PYTHON)
def figures(session: nox.Session) -> None:
    """Regenerate the committed CPU runs and README figures under plots/ from the current code
    (a clean tree: their run.json records the commit). ``nox -s figures -- smoke`` for one."""
    _install(session)
    session.run("python", "plots/regenerate.py", *session.posargs)


@nox.session(python=PYTHON)
def smoke(session: nox.Session) -> None:
    """The smoke suite through the installed console script."""
    _install(session)
    out = Path(session.create_tmp()) / "results"
    session.run("deqbench", "run", "suites/smoke.yaml", "--out", str(out))


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """The documentation site (mkdocs.yml, docs/) with warnings as errors. The CLI page and the
    generated tables come from the installed package; the figures are the committed plots/ (nothing
    is run). Extra args go to mkdocs build; the site is written to the session's tmp folder."""
    _install(session)
    session.install(*DOCS)
    site = Path(session.create_tmp()) / "site"
    session.run("mkdocs", "build", "--strict", "--site-dir", str(site), *session.posargs)
