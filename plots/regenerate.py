"""Regenerate the committed CPU runs and README figures under plots/ from the current code.

    nox -s figures                      # every committed CPU run (smoke, trajectory, ntk, ...)
    nox -s figures -- smoke             # one of them
    python plots/regenerate.py smoke    # the same, in an environment with deqbench installed

Refuses a dirty tree (``--allow-dirty`` to try things out): a committed run's ``run.json``
records the commit it was made from, and that commit must be what made it. After a rebase or a
change of behaviour, run it and commit the result with the code; CI re-runs the smoke suite
and compares it with ``plots/smoke`` (tests/test_reference_run.py), so a change that moves its
statuses or numbers fails until the figure is regenerated. GPU runs (plots/gpu, plots/h100) come
from the benchmark scripts on the device and name their commit and card in their own README.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: where targets are written before they replace the committed ones: every target runs on the
#: clean tree, and only after the last one are the results moved into plots/ (a target written
#: into the tree first would make the next one's run.json say "dirty")
STAGE = ROOT

#: name -> (suite, what to keep under plots/, how): "run" keeps the whole run directory
#: (results.csv, run.json, suite.yaml, series, plots), "png" copies one figure of the run
TARGETS = {
    "smoke": ("suites/smoke.yaml", "plots/smoke", "run", None),
    "trajectory": ("suites/trajectory.yaml", "plots/trajectory_cpu", "run-noseries", None),
    "ntk": ("suites/ntk.yaml", "plots/ntk_cpu.png", "png", "ntk.png"),
    # every backward mode side by side, about 4 minutes on one thread
    "backward": ("suites/backward.yaml", "plots/backward_cpu", "run", None),
    # time_to_tolerance.png and path_independence.png, about 30 s on 2 cores
    "convergence": ("suites/convergence.yaml", "plots/convergence_cpu", "run", None),
    # the CPU reproduction report (deqbench reproduce --scale cpu, about 6 minutes on 2 cores):
    # the report and, per suite run, run.json / suite.yaml / summary.csv; docs/reproductions.md
    # carries the report's table verbatim (tests/test_reproduce_report.py): paste it after this
    "reproduction_cpu": ("", "plots/reproduction_cpu", "reproduce", None),
    # the paper-scale reports re-judged from their committed runs by today's checkers (no run:
    # the GPU runs stay as they are; each report says the commit that judged it)
    "reproduction_paper": ("", "plots/reproduction_paper", "rejudge", None),
}


def _dirty() -> bool:
    out = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    return out.returncode != 0 or bool(out.stdout.strip())


def _reproduce(target: str) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report"
        cmd = [sys.executable, "-m", "deqbench", "reproduce", "--scale", "cpu", "--out", str(out)]
        print("+", " ".join(cmd), flush=True)
        rc = subprocess.run(cmd, cwd=ROOT, check=False).returncode
        if not (out / "reproduction.csv").is_file():
            print(f"reproduction_cpu: no report made (exit {rc})", file=sys.stderr)
            return rc or 1
        dest = STAGE / target
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        for f in ("reproduction.csv", "reproduction.md"):
            shutil.copy2(out / f, dest / f)
        for run in sorted(out.glob("runs/*/*/run.json")):
            d = dest / run.parent.relative_to(out)
            d.mkdir(parents=True)
            for f in ("run.json", "suite.yaml", "summary.csv"):
                if (run.parent / f).is_file():
                    shutil.copy2(run.parent / f, d / f)
        print(f"reproduction_cpu: {target} regenerated (deqbench reproduce exit {rc})")
        return 0


def _rejudge(target: str) -> int:
    """Each ``plots/reproduction_paper/<paper>/`` report rewritten from its committed runs:
    the folder copied, its ``results.csv.gz`` unpacked, ``deqbench reproduce --judge-only`` over the
    paper's claims whose paper-scale suite has a committed run (or has no suite: those are
    ``not run``), and the new report copied back. Nothing is run."""
    import gzip

    from deqbench.reproduce.run import rejudgeable_claims

    rc = 0
    for folder in sorted((ROOT / target).iterdir()):
        if not (folder / "reproduction.csv").is_file():
            continue
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / folder.name
            shutil.copytree(folder, out)
            for gz in out.glob("runs/*/*/results.csv.gz"):
                gz.with_suffix("").write_bytes(gzip.decompress(gz.read_bytes()))
            ids = rejudgeable_claims(folder.name, out)
            cmd = [sys.executable, "-m", "deqbench", "reproduce", "--scale", "paper",
                   "--judge-only", "--out", str(out), "--claims", ",".join(ids)]  # fmt: skip
            print("+", " ".join(cmd), flush=True)
            code = subprocess.run(cmd, cwd=ROOT, check=False).returncode
            if code not in (0, 1):
                print(f"{folder.name}: reproduce exit {code}", file=sys.stderr)
                rc = rc or code
                continue
            dest = STAGE / target / folder.name
            if dest != folder:  # staged: the committed runs go along unchanged
                shutil.rmtree(dest, ignore_errors=True)
                shutil.copytree(folder, dest)
            for f in ("reproduction.csv", "reproduction.md"):
                shutil.copy2(out / f, dest / f)
            print(f"{target}/{folder.name}: re-judged (deqbench reproduce exit {code})")
    return rc


def regenerate(name: str) -> int:
    suite, target, how, png = TARGETS[name]
    if how == "reproduce":
        return _reproduce(target)
    if how == "rejudge":
        return _rejudge(target)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "deqbench",
            "run",
            str(ROOT / suite),
            "--out",
            tmp,
            "--no-progress",
        ]
        print("+", " ".join(cmd), flush=True)
        rc = subprocess.run(cmd, cwd=ROOT, check=False).returncode
        runs = sorted(Path(tmp).glob("*/*/run.json"))
        if not runs:
            print(f"{name}: no run directory made (exit {rc})", file=sys.stderr)
            return rc or 1
        run = runs[-1].parent
        dest = STAGE / target
        dest.parent.mkdir(parents=True, exist_ok=True)
        if how == "png":
            shutil.copy2(run / "plots" / str(png), dest)
        else:
            keep = {}
            if (ROOT / target).is_dir():  # hand-written notes beside the run stay
                keep = {p.name: p.read_bytes() for p in (ROOT / target).glob("README.md")}
            shutil.rmtree(dest, ignore_errors=True)
            shutil.copytree(run, dest)
            if how == "run-noseries":
                shutil.rmtree(dest / "series", ignore_errors=True)
            for fname, data in keep.items():
                (dest / fname).write_bytes(data)
        print(f"{name}: {target} regenerated (deqbench run exit {rc})")
        return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help=f"of {', '.join(TARGETS)} (default: all)")
    ap.add_argument("--allow-dirty", action="store_true", help="run on uncommitted changes")
    args = ap.parse_args(argv)
    if _dirty() and not args.allow_dirty:
        print(
            "error: the tree has uncommitted changes; commit first (a committed run records "
            "its commit), or pass --allow-dirty to try it out",
            file=sys.stderr,
        )
        return 2
    unknown = [n for n in args.names if n not in TARGETS]
    if unknown:
        print(f"error: unknown {unknown}; choose from {', '.join(TARGETS)}", file=sys.stderr)
        return 2
    global STAGE
    rc = 0
    names = args.names or list(TARGETS)
    with tempfile.TemporaryDirectory() as stage:
        STAGE = Path(stage)
        for name in names:
            rc = regenerate(name) or rc
        for name in names:  # only now into the tree
            target = TARGETS[name][1]
            src, dst = STAGE / target, ROOT / target
            if not src.exists():
                continue
            if dst.is_dir():
                shutil.rmtree(dst)
            elif dst.exists():
                dst.unlink()
            shutil.move(str(src), str(dst))
        STAGE = ROOT
    if {"reproduction_cpu", "reproduction_paper"} & set(names):
        paste_reports()
    return rc


#: the docs page that carries the committed reproduction reports verbatim
#: (tests/test_reproduce_report.py checks it)
REPORT_PAGE = ROOT / "docs" / "reproductions.md"


def paste_reports() -> None:
    """Each committed report's body (its ``reproduction.md`` without the title line) pasted into
    :data:`REPORT_PAGE` between its markers: ``reproduction`` for the CPU report,
    ``reproduction-paper-<paper>`` for each paper-scale one."""
    page = REPORT_PAGE.read_text(encoding="utf-8")
    reports = {"reproduction": ROOT / "plots" / "reproduction_cpu" / "reproduction.md"}
    for folder in sorted((ROOT / "plots" / "reproduction_paper").iterdir()):
        if (folder / "reproduction.md").is_file():
            reports[f"reproduction-paper-{folder.name}"] = folder / "reproduction.md"
    for marker, md in reports.items():
        begin, end = f"<!-- {marker}:begin -->\n", f"\n<!-- {marker}:end -->"
        if begin not in page or end not in page:
            print(f"docs: no {marker} markers in {REPORT_PAGE.name}", file=sys.stderr)
            continue
        body = md.read_text(encoding="utf-8").split("\n", 1)[1].strip()
        a, b = page.index(begin) + len(begin), page.index(end)
        page = page[:a] + body + page[b:]
    REPORT_PAGE.write_text(page, encoding="utf-8")
    print(f"docs: {REPORT_PAGE.relative_to(ROOT)} carries the regenerated reports")
    _headline_numbers(reports["reproduction"])
    _paper_counts()


def _headline_numbers(md: Path) -> None:
    """The CPU report's counts and suite seconds, where the README and the reproduction page
    quote them ("31 claims: 3 reproduced, ...", "N s of suite runs"): rewritten from the report
    (tests/test_docs_run.py checks that they agree)."""
    import re

    text = md.read_text(encoding="utf-8")
    counts = re.search(r"\d+ claims: \d+ reproduced, \d+ not reproduced, \d+ not run", text)
    total = re.search(r"([\d.]+) s in total", text)
    if counts is None or total is None:
        return
    seconds = f"{float(total.group(1)):g} s of suite runs"
    for page in (ROOT / "README.md", REPORT_PAGE):
        before = page.read_text(encoding="utf-8")
        after = re.sub(r"\b[\d.]+ s of suite runs", seconds, before)
        if page.name == "README.md":
            after = "\n".join(
                re.sub(
                    r"\d+ claims: \d+ reproduced, \d+ not reproduced, \d+ not run",
                    counts.group(0),
                    line,
                )
                if "deqbench reproduce --scale cpu" in line
                else line
                for line in after.split("\n")
            ) + ("" if not after.endswith("\n") else "")
        if after != before:
            page.write_text(after, encoding="utf-8")
            print(f"docs: {page.relative_to(ROOT)}: the CPU report's numbers")


def _paper_counts() -> None:
    """Each paper-scale report's counts ("8 claims: 4 reproduced, ...") in the README row that
    links it (tests/test_docs_run.py checks that they agree)."""
    import re

    readme = ROOT / "README.md"
    before = readme.read_text(encoding="utf-8")
    lines = before.split("\n")
    pattern = r"\d+ claims: \d+ reproduced, \d+ not reproduced, \d+ not run"
    for folder in sorted((ROOT / "plots" / "reproduction_paper").iterdir()):
        md = folder / "reproduction.md"
        if not md.is_file():
            continue
        counts = re.search(pattern, md.read_text(encoding="utf-8"))
        link = f"plots/reproduction_paper/{folder.name}/reproduction.md"
        if counts is None:
            continue
        lines = [re.sub(pattern, counts.group(0), ln) if link in ln else ln for ln in lines]
    after = "\n".join(lines)
    if after != before:
        readme.write_text(after, encoding="utf-8")
        print("docs: README.md: the paper-scale reports' counts")


if __name__ == "__main__":
    sys.exit(main())
