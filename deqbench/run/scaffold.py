"""``deqbench new-plugin NAME``: write a ready plugin package.

The package has a ``pyproject.toml`` with the ``deqbench.models`` and ``deqbench.solvers``
entry points, a model and a solver written to the contracts (:mod:`deqbench.contracts`), and
tests that run deqbench's conformance checks (:mod:`deqbench.testing`), ``deqbench validate``
and a one-cell suite. It passes right after
``pip install -e 'NAME[test]'`` (its ``test`` extra brings pytest), run by
``python -m pytest`` (the interpreter pip installed into, not another environment's ``pytest``)::

    deqbench new-plugin deqbench-mydeq
    pip install -e 'deqbench-mydeq[test]'
    python -m pytest deqbench-mydeq

Names: the distribution is NAME, the import package NAME with ``-`` -> ``_``, the model
``<short>_deq`` and the solver ``<short>_picard`` (``<short>``: the package without a leading
``deqbench_``).

Example:
    >>> from deqbench.run.scaffold import plugin_names
    >>> plugin_names("deqbench-mydeq")["model"], plugin_names("deqbench-mydeq")["solver"]
    ('mydeq_deq', 'mydeq_picard')
"""

from __future__ import annotations

import re
from pathlib import Path

from ..core.errors import ConfigError

PYPROJECT = """\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "{dist}"
version = "0.1.0"
description = "A deqbench plugin: the {model} model and the {solver} solver"
requires-python = ">=3.11"
dependencies = ["deqbench>={deqbench_version}", "torch"]

[project.optional-dependencies]
test = ["pytest"]

# deqbench discovers plugins through these entry-point groups (deqbench.contracts).
[project.entry-points."deqbench.models"]
{model} = "{pkg}.models:{model}"

[project.entry-points."deqbench.solvers"]
{solver} = "{pkg}.solvers:{solver}"

[tool.setuptools.packages.find]
where = ["src"]

[tool.pytest.ini_options]
testpaths = ["tests"]
"""

INIT = '''\
"""{dist}: a deqbench plugin (model {model}, solver {solver})."""

__version__ = "0.1.0"
'''

MODELS = '''\
"""Model {model}: z = tanh(W z + u) / 2 with u = U x, a linear readout.

Written to deqbench's contracts (deqbench.contracts; docs/plugins.md of deqbench):

* the factory takes ``in_shape`` and ``num_outputs`` (filled in from the dataset) and its own
  params [ModelFactory], and declares the solver, backward mode and init it converges with;
* the model subclasses DEQModel: ``inject`` outside the solve, ``self.deq = DEQLayer(cell)``,
  ``readout`` [EquilibriumModel], so every deqbench solver, backward mode and analysis applies;
* the cell is a pure function of (z, u) and its own weights [Cell];
* ``spectral_quantities`` reports a family quantity per epoch [SpectralQuantities].

||J|| <= ||W|| / 2, so with the default init (||W|| about 1) the cell is a contraction.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from deqbench.deq import DEQLayer, DEQModel
from deqbench.models import declare_defaults


class Cell(nn.Module):
    """f(z, u) = tanh(W z + u) / 2; keeps z's shape."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.W = nn.Linear(width, width, bias=False)

    def forward(self, z: Tensor, u: Tensor) -> Tensor:
        return 0.5 * torch.tanh(self.W(z) + u)


class Model(DEQModel):
    """readout(deq(inject(x)))."""

    def __init__(self, in_features: int, width: int, num_outputs: int) -> None:
        super().__init__()
        self.U = nn.Linear(in_features, width)  # the injection lives outside the cell
        self.deq = DEQLayer(Cell(width))
        self.head = nn.Linear(width, num_outputs)

    def inject(self, x: Tensor) -> Tensor:
        return self.U(x.flatten(1))

    def readout(self, z: Tensor) -> Tensor:
        return self.head(z)

    @torch.no_grad()
    def spectral_quantities(self) -> dict[str, float]:
        """||W||_2 / 2: an upper bound of the cell's Lipschitz constant in z."""
        w = self.deq.cell.W.weight.double()
        return {{"cell_lipschitz_bound": 0.5 * float(torch.linalg.matrix_norm(w, ord=2))}}


@declare_defaults(
    solver={{"name": "{solver}", "max_iter": 100, "tol": 1e-4, "omega": 0.9}},
    backward={{"name": "ift", "solver": "{solver}", "max_iter": 100, "tol": 1e-5}},
    init="default",
)
def {model}(in_shape=(64,), num_outputs: int = 10, width: int = 32) -> Model:
    """The {model} model (``width``: size of z)."""
    return Model(math.prod(in_shape), width, num_outputs)
'''

SOLVERS = '''\
"""Solver {solver}: over-relaxed Picard iteration z <- (1 - omega) z + omega f(z).

Written to deqbench's solver contract (deqbench.contracts.Solver) with
``deqbench.solvers.base.solver``: the options are a pydantic model, validated once per distinct
option dict (an unknown option or a bad value is a ConfigError naming it, and suites are checked
against the model before anything runs); ``Tracker`` records the statistics (a trace row per
measured iterate, the lowest-residual iterate, divergence) and builds the SolverStats.
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import Field
from torch import Tensor

from deqbench.solvers.base import CommonOptions, SolverStats, Tracker, solver


class Options(CommonOptions):
    """The options (plus returns, check_every, protect_thres, which Tracker reads)."""

    omega: float = Field(0.9, gt=0, lt=2, description="relaxation factor")


@solver(Options)
def {solver}(
    f: Callable[[Tensor], Tensor],
    z0: Tensor,
    opts: Options,
    *,
    max_iter: int = 50,
    tol: float = 1e-4,
    stop_mode: str = "rel",
) -> tuple[Tensor, SolverStats]:
    """Over-relaxed Picard iteration (called as solve(f, z0, *, max_iter, tol, stop_mode,
    **options))."""
    tracker = Tracker(
        "{solver}", z0, max_iter=max_iter, tol=tol, stop_mode=stop_mode, common=opts
    )
    z, nstep = z0, 0
    while True:
        fz = f(z)  # one f-evaluation: it measures the residual of z
        nstep += 1
        tracker.record(z, fz, None)
        if tracker.stop() or nstep >= max_iter:  # converged, diverged or out of budget
            return tracker.finish(nstep, {{"omega": opts.omega}})
        z = (1 - opts.omega) * z + opts.omega * fz  # a new tensor: the tracker keeps z
'''

SUITE = """\
# A one-cell suite: the plugin's model with its declared solver and backward mode.
schema: 1
name: {short}_check
device: cpu
threads: 1
seeds: [0]
data: {{name: digits, flatten: true, train_subset: 64, test_subset: 32}}
defaults:
  model: {{name: {model}, width: 16}}
  train: {{epochs: 1, batch_size: 32}}
analyses: [metrics, solver_stats, family_stats]
output: results
"""

TEST = '''\
"""The plugin is registered, conforms to deqbench's contracts (deqbench.testing: the clauses
`deqbench validate` checks, and more), passes `deqbench validate` and runs a one-cell suite."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

import deqbench
from deqbench.cli import app
from deqbench.testing import check_model, check_solver

SUITE = Path(__file__).with_name("suite.yaml")


def test_registered_through_entry_points():
    assert deqbench.models.origin("{model}") == "{dist} 0.1.0"
    assert deqbench.solvers.origin("{solver}") == "{dist} 0.1.0"


def test_solver_conforms():
    check_solver("{solver}", options={{"omega": 0.9}})


def test_model_conforms():
    check_model("{model}", params={{"width": 16}})


def test_validate():
    r = CliRunner().invoke(app, ["validate", str(SUITE)])
    assert r.exit_code == 0, r.output
    assert "{model}-{solver}-ift" in r.output


def test_one_cell_suite(tmp_path):
    r = CliRunner().invoke(
        app, ["run", str(SUITE), "--out", str(tmp_path), "--no-progress", "--no-plots"]
    )
    assert r.exit_code == 0, r.output
    (run_dir,) = (tmp_path / "{short}_check").iterdir()
    df = deqbench.load_results(run_dir)
    assert set(df[df.analysis == "runner"].status) == {{"ok"}}
    assert "cell_lipschitz_bound" in set(df.metric)
'''

README = """\
# {dist}

A deqbench plugin written by `deqbench new-plugin`: model `{model}` and solver `{solver}`,
registered through entry points (see `pyproject.toml`), written to deqbench's contracts
(`deqbench.contracts`; the "Writing a plugin" guide, `docs/plugins.md` of deqbench).

```bash
pip install -e '.[test]'                 # the test extra brings pytest
python -m pytest                         # conformance, validate, a one-cell suite
deqbench ls models {short}               # {model}  {dist} 0.1.0
deqbench validate tests/suite.yaml       # the contract checks
```

Replace the cell in `src/{pkg}/models.py` by yours and keep the factory's signature.
Wrapping a network whose forward runs its own fixed-point loop instead? Register the network
itself (`declare_defaults(own_solver="...")`) and give it `last_solve_stats()`
(`deqbench.contracts.OwnSolverModel`), so that its solves are measured and checked.
"""

FILES = {
    "pyproject.toml": PYPROJECT,
    "README.md": README,
    "src/{pkg}/__init__.py": INIT,
    "src/{pkg}/models.py": MODELS,
    "src/{pkg}/solvers.py": SOLVERS,
    "tests/suite.yaml": SUITE,
    "tests/test_plugin.py": TEST,
}


def plugin_names(name: str) -> dict[str, str]:
    """The distribution, package, short, model and solver names for ``name``."""
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", name):
        raise ConfigError(
            f"new-plugin: {name!r} is not a distribution name (letters, digits, - and _, "
            "starting with a letter), e.g. deqbench-mydeq"
        )
    pkg = re.sub(r"[-_]+", "_", name).lower()
    short = pkg.removeprefix("deqbench_") or pkg
    return {
        "dist": name,
        "pkg": pkg,
        "short": short,
        "model": f"{short}_deq",
        "solver": f"{short}_picard",
    }


def write_plugin(name: str, out: str | Path = ".") -> Path:
    """Write the plugin package ``out/name``; returns its folder. Refuses a non-empty one."""
    from .. import __version__

    names = plugin_names(name)
    root = Path(out) / name
    if root.exists() and any(root.iterdir()):
        raise ConfigError(f"new-plugin: {root} exists and is not empty")
    values = {**names, "deqbench_version": __version__}
    for rel, template in FILES.items():
        path = root / rel.format(**values)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(template.format(**values), encoding="utf-8")
    return root


# -- the "Writing a plugin" guide (docs/plugins.md) ---------------------------------------------

#: the name of the plugin the guide's worked example shows
GUIDE_NAME = "deqbench-mydeq"
_BLOCK = re.compile(r"(<!-- BEGIN generated: (\S+) -->\n)(.*?)(<!-- END generated: \2 -->)", re.S)


def _generated(key: str) -> str:
    from ..core.contracts import reference_markdown

    if key == "reference":
        return reference_markdown()
    values = {**plugin_names(GUIDE_NAME), "deqbench_version": "0.1.0"}
    for rel, template in FILES.items():
        if rel.format(**values).endswith(key):
            lang = {"toml": "toml", "yaml": "yaml", "py": "python"}[key.rsplit(".", 1)[-1]]
            return f"```{lang}\n{template.format(**values)}```\n"
    raise KeyError(key)


def update_guide(text: str) -> str:
    """``text`` (docs/plugins.md) with every ``<!-- BEGIN generated: KEY -->`` block rewritten:
    KEY ``reference`` from :mod:`deqbench.contracts`, a file name from the scaffold of
    :data:`GUIDE_NAME`. Regenerate with ``python -m deqbench.run.scaffold docs/plugins.md``."""
    return _BLOCK.sub(lambda m: m.group(1) + _generated(m.group(2)) + m.group(4), text)


if __name__ == "__main__":  # python -m deqbench.run.scaffold docs/plugins.md
    import sys

    for arg in sys.argv[1:]:
        p = Path(arg)
        p.write_text(update_guide(p.read_text(encoding="utf-8")), encoding="utf-8")
