"""nox sessions: ``tests``, ``lint``, ``typecheck``, ``docs`` (the defaults: what ``nox`` runs,
the README's test command, which CI runs), ``figures`` and ``smoke``.

pip install nox && nox

Every session that needs torch (all but ``lint``) runs in one shared virtualenv,
``.nox/_torch``, made on first use and reused while its requirements (below, and pyproject.toml)
stay the same: torch is installed once per checkout instead of once per session. ``lint`` has
its own small nox-made virtualenv. ``nox -s tests`` runs the whole test suite (the fast lane is
``pytest -m "not slow and not gpu"``, see docs/contributing.md).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import nox

nox.options.sessions = ["tests", "lint", "typecheck", "docs"]
nox.options.error_on_missing_interpreters = True

PYTHON = "3.11"
TORCH = ("torch==2.14.1", "torchvision==0.29.1")
TYPECHECK = ("mypy==2.4.1", "types-PyYAML")
DOCS = (
    "mkdocs==1.6.1",
    "mkdocs-material==9.8.2",
    "mkdocstrings[python]==1.0.8",
    "mkdocstrings-python==2.0.11",
    "ruff==0.17.6",  # mkdocstrings formats the separate signatures with it
)
#: tests/test_torchdeq_plugin.py compares the example plugin against TorchDEQ (from PyPI; the
#: plugin itself is put on sys.path by the test)
TORCHDEQ = ("torchdeq==0.1.0",)
#: tests/test_example_deepinv.py runs DeepInverse's DEQ through examples/deqbench-deepinv (from
#: PyPI; its dependencies leave torch as pinned above)
DEEPINV = ("deepinv==0.5.0",)
EXTRAS = "test,dask"
SHARED = Path(__file__).resolve().parent / ".nox" / "_torch"


class _Env:
    """The shared virtualenv: ``run`` a command from its bin folder, ``install`` into it."""

    def __init__(self, session: nox.Session) -> None:
        self.session = session
        self.bin = SHARED / ("Scripts" if os.name == "nt" else "bin")

    def run(self, cmd: str, *args: str, env: dict[str, str] | None = None) -> None:
        path = f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}"
        full = {"PATH": path, "VIRTUAL_ENV": str(SHARED), **(env or {})}
        exe = shutil.which(cmd, path=str(self.bin)) or cmd
        self.session.run(exe, *args, env=full, external=True)

    def install(self, *args: str) -> None:
        self.run("python", "-m", "pip", "install", *args)


def _shared(session: nox.Session) -> _Env:
    """The shared torch virtualenv, made (Python 3.11) and filled on first use; refilled when
    the requirements or pyproject.toml change. Delete ``.nox/_torch`` to make it afresh."""
    env = _Env(session)
    reqs = [*TORCH, f"-e .[{EXTRAS}]", *TYPECHECK, *DOCS, *TORCHDEQ, *DEEPINV]
    pyproject = (Path(__file__).resolve().parent / "pyproject.toml").read_bytes()
    key = hashlib.sha256("\n".join(reqs).encode() + pyproject).hexdigest()
    stamp = SHARED / "deqbench-requirements.sha256"
    if not (env.bin / "python").exists() and not (env.bin / "python.exe").exists():
        python = shutil.which(f"python{PYTHON}")
        if python is None:
            session.error(f"python{PYTHON} not found: the shared virtualenv needs it")
        session.run(python, "-m", "venv", str(SHARED), external=True)
    if not stamp.exists() or stamp.read_text() != key:
        env.install("--upgrade", "pip")
        env.install(*TORCH)
        env.install("-e", f".[{EXTRAS}]", *TYPECHECK, *DOCS, *TORCHDEQ, *DEEPINV)
        stamp.write_text(key)
    return env


@nox.session(venv_backend="none")
def tests(session: nox.Session) -> None:
    """The test suite on CPU (GPU tests deselected; slow ones included), then the docstring
    examples of the package (so that documented outputs stay true). Extra args go to pytest
    (``nox -s tests -- -m "not slow and not gpu"``: the fast lane). The ``dask`` extra, TorchDEQ
    and DeepInverse are installed, so that tests/test_dask.py, tests/test_torchdeq_plugin.py and
    tests/test_example_deepinv.py run."""
    env = _shared(session)
    env.run("python", "-m", "pytest", "-m", "not gpu", *session.posargs)
    env.run(
        "python", "-m", "pytest", "--doctest-modules", "deqbench", "-q", "-p", "no:cacheprovider"
    )
    _new_plugin(env)


def _new_plugin(env: _Env) -> None:
    """The package `deqbench new-plugin` writes, installed into a temporary folder (no build
    isolation, no dependencies: offline and in seconds), passes its own test."""
    tmp = Path(env.session.create_tmp()) / "new-plugin"
    shutil.rmtree(tmp, ignore_errors=True)
    env.run("deqbench", "new-plugin", "deqbench-ci-plugin", "--out", str(tmp))
    env.install("setuptools>=70.1")  # builds the plugin without build isolation
    site = tmp / "site"
    pkg = tmp / "deqbench-ci-plugin"
    env.install("--no-build-isolation", "--no-deps", "--target", str(site), str(pkg))
    extra = {"PYTHONPATH": str(site), "DEQBENCH_DISABLE_PLUGIN_AUTOLOAD": "0"}
    env.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", str(pkg), env=extra)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check."""
    session.install("ruff==0.17.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(venv_backend="none")
def typecheck(session: nox.Session) -> None:
    """mypy on the package (clean: CI runs it), in the shared torch virtualenv."""
    _shared(session).run("mypy", "deqbench/")


@nox.session(venv_backend="none")
def figures(session: nox.Session) -> None:
    """Regenerate the committed CPU runs and README figures under plots/ from the current code
    (a clean tree: their run.json records the commit). ``nox -s figures -- smoke`` for one."""
    _shared(session).run("python", "plots/regenerate.py", *session.posargs)


@nox.session(venv_backend="none")
def smoke(session: nox.Session) -> None:
    """The smoke suite through the installed console script."""
    env = _shared(session)
    out = Path(session.create_tmp()) / "results"
    env.run("deqbench", "run", "suites/smoke.yaml", "--out", str(out))


@nox.session(venv_backend="none")
def docs(session: nox.Session) -> None:
    """The documentation site (mkdocs.yml, docs/) with warnings as errors. The CLI page and the
    generated tables come from the installed package; the figures are the committed plots/ (nothing
    is run). Extra args go to mkdocs build; the site is written to the session's tmp folder."""
    env = _shared(session)
    site = Path(session.create_tmp()) / "site"
    env.run("mkdocs", "build", "--strict", "--site-dir", str(site), *session.posargs)
