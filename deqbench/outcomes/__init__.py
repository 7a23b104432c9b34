"""``summary.csv`` of a run: the verdicts of the source papers' claims that the run's suite measures.

:func:`summarize` is the post-run report ``outcomes`` (:mod:`deqbench.run.reports`: the runner
calls it after every run without naming this package); it judges each claim of
:data:`deqbench.reproduce.claims.CLAIMS` that this run's suite measures with the same code as
``deqbench reproduce`` (:func:`deqbench.reproduce.verdicts.verdict_for`: the claim's extractor reads
the run directory, its checker states the paper's claim in the paper's direction) and writes the
rows into ``RUN_DIR/summary.csv`` with the report's columns
(:data:`deqbench.reproduce.verdicts.REPORT_COLUMNS`: claim_id, paper, where, claim, paper_value,
measured, data, scale, verdict, reason, run_dir). ``verdict`` is ``reproduced``, ``not
reproduced`` or ``not run`` (``reason`` says why). A run of a suite that no claim uses gets no
``summary.csv``.

Which claims: those whose ``suite`` names this run's suite once both names lose a leading
``paper_`` / ``repro_`` and a trailing ``_cpu`` / ``_gpu`` / ``_paper`` (a ``pcdeq``,
``pcdeq_cpu`` or ``pcdeq_gpu`` run serves the claims of suite ``pcdeq`` and ``pcdeq_gpu``), and
those whose suite :data:`deqbench.reproduce.verdicts.CPU_SUITES` (or ``PAPER_SUITES``) maps to a file
of this suite (the pcDEQ runs log sigma_max per epoch, so they also serve ``002-lipschitz`` of
suite ``kglm_pcdeq_sigma``).

Scale (:func:`run_scale`): ``paper`` when the suite name ends in ``_gpu`` or ``_paper`` (or
starts with ``paper_``) or its file lies in a ``paper/`` folder (``suites/paper/``, the files ``deqbench reproduce --scale
paper`` runs), else ``cpu``. The suite decides, not the device: the small CPU suite run on a GPU
is still judged at ``cpu`` scale. At ``cpu`` scale the absolute claims (the paper's own numbers)
are ``not run`` with reason ``scale``.

Example:
    >>> from deqbench.outcomes import claims_for
    >>> [c.id for c in claims_for("pcdeq_cpu")][:4]
    ['002-mnist-accuracy', '002-iterations', '002-lipschitz', '002-unconstrained']
    >>> from deqbench.outcomes import summarize
    >>> summarize("results/pcdeq/<run_id>")[["claim_id", "verdict", "reason"]]  # doctest: +SKIP
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..run import reports
from ..run.results_reader import run_meta

if TYPE_CHECKING:
    from ..reproduce.claims import Claim

__all__ = ["base_suite", "claims_for", "run_scale", "suite_name", "summarize"]

_PREFIXES = ("paper_", "repro_")
_SUFFIXES = ("_cpu", "_gpu", "_paper")
_PAPER_SUFFIXES = ("_gpu", "_paper")


def base_suite(name: str) -> str:
    """``name`` without a leading ``paper_`` / ``repro_`` and a trailing ``_cpu`` / ``_gpu`` /
    ``_paper`` (``"pcdeq_gpu"`` -> ``"pcdeq"``)."""
    for p in _PREFIXES:
        if name.startswith(p) and len(name) > len(p):
            name = name[len(p) :]
            break
    for s in _SUFFIXES:
        if name.endswith(s) and len(name) > len(s):
            name = name[: -len(s)]
            break
    return name


def claims_for(suite: str) -> list[Claim]:
    """The claims (in :data:`~deqbench.reproduce.claims.CLAIMS` order) that a run of ``suite``
    measures (see the module docstring)."""
    from ..reproduce import verdicts as run
    from ..reproduce.claims import CLAIMS

    maps: list[dict[str, str]] = [run.CPU_SUITES, run.PAPER_SUITES]
    base = base_suite(suite)
    out = []
    for c in CLAIMS:
        if c.suite is None:
            continue
        names = [c.suite] + [Path(m[c.suite]).stem for m in maps if c.suite in m]
        if any(base_suite(n) == base for n in names):
            out.append(c)
    return out


def _suite_yaml(run_dir: Path) -> dict[str, Any]:
    p = run_dir / "suite.yaml"
    if not p.is_file():
        return {}
    from ..run.yamlio import read_yaml

    try:
        raw, _ = read_yaml(p)
    except Exception:  # ConfigError: unreadable or invalid YAML
        return {}
    return raw if isinstance(raw, dict) else {}


def suite_name(run_dir: str | Path) -> str:
    """The suite a run came from: run.json ``suite``, else suite.yaml ``name``, else the parent
    folder name (``results/<suite>/<run_id>``)."""
    run_dir = Path(run_dir)
    name = run_meta(run_dir).get("suite") or _suite_yaml(run_dir).get("name")
    return str(name) if name else run_dir.parent.name


def _suite_file(run_dir: Path, name: str) -> Path:
    """The suite file the run was made from (run.json ``suite_source``), else ``<name>.yaml``."""
    src = run_meta(run_dir).get("suite_source")
    if isinstance(src, str) and src and not src.startswith("<"):
        return Path(src)
    return Path(f"{name}.yaml")


def run_scale(suite: str, file: str | Path | None = None) -> str:
    """``"paper"`` for a suite named ``*_gpu`` / ``*_paper`` / ``paper_*`` or a file under a
    ``paper/`` folder, else ``"cpu"``."""
    stems = [suite] + ([Path(file).stem] if file is not None else [])
    if any(s.endswith(_PAPER_SUFFIXES) or s.startswith("paper_") for s in stems):
        return "paper"
    if file is not None and Path(file).parent.name == "paper":
        return "paper"
    return "cpu"


@reports.register("outcomes")
def summarize(
    run_dir: str | Path,
    *,
    write: bool = True,
    suite: str | None = None,
    scale: str | None = None,
) -> Any:
    """The claim verdicts of a finished run as a DataFrame (``REPORT_COLUMNS``); writes
    ``RUN_DIR/summary.csv`` (atomically) when at least one claim applies.

    Args:
        run_dir: the run directory (results.csv, run.json, suite.yaml, series/).
        write: write ``summary.csv``.
        suite: judge as a run of this suite (default: the run's, see :func:`suite_name`).
        scale: ``"cpu"`` or ``"paper"`` (default: :func:`run_scale` of the run's suite).
    """
    if scale not in (None, "cpu", "paper"):
        raise ValueError(f"scale must be 'cpu' or 'paper', got {scale!r}")
    run_dir = Path(run_dir)
    name = suite or suite_name(run_dir)
    claims = claims_for(name)
    import pandas as pd

    from ..reproduce.verdicts import REPORT_COLUMNS

    if not claims:
        return pd.DataFrame(columns=list(REPORT_COLUMNS))
    from ..reproduce.verdicts import (
        SuiteRun,
        report_row,
        run_epochs,
        run_steps,
        solver_text,
        steps_text,
        verdict_for,
    )

    file = _suite_file(run_dir, name)
    scale = scale or run_scale(name, file)
    sr = SuiteRun(file=Path(file.name), run_dir=run_dir)
    rows = []
    steps, epochs = run_steps(run_dir), run_epochs(run_dir)
    for c in claims:
        v, data = verdict_for(c, scale, sr)
        row = report_row(
            c, v, data, scale, run_dir.name, steps_text(c, steps, epochs), solver_text(sr)
        )
        rows.append([row[k] for k in REPORT_COLUMNS])
    out = pd.DataFrame(rows, columns=list(REPORT_COLUMNS))
    if write:
        tmp = run_dir / f".summary.csv.{os.getpid()}.tmp"
        try:
            out.to_csv(tmp, index=False)
            tmp.replace(run_dir / "summary.csv")
        finally:
            tmp.unlink(missing_ok=True)
    return out
