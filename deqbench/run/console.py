"""Terminal output of the CLI: consoles, the run summary, compare tables, ``ls`` and ``info``.

Results go to stdout, diagnostics to stderr. Importing this module imports nothing heavy
(rich and the library are imported inside the functions).
"""

from __future__ import annotations

import re
import sys
from typing import Any

KINDS = ("models", "solvers", "inits", "analyses", "kernels", "datasets", "backward", "plots")


def err_console() -> Any:
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


def out_console() -> Any:
    from rich.console import Console

    return Console(highlight=False, width=None if sys.stdout.isatty() else 200)


def esc(text: Any) -> str:
    """Escape rich markup in user-provided text (``matrix.backward[1]``, lists in notes) and
    write its control characters other than newlines as escapes (``\\x1b``: an ESC sequence
    from a suite must not act on the terminal)."""
    from rich.markup import escape

    from ..core.errors import shown

    text = str(text)
    return escape("\n".join(shown(line, len(line)) for line in text.split("\n")))


#: the stop rule a tally row's note names (:func:`deqbench.run.solves.rule_note`, and the
#: notes of missed solves: ``... tol 1e-4 (stop rule batch_fro) ...``)
RULE = re.compile(r"stop rule (\w+)")


def print_summary(df: Any) -> None:
    """One table row per cell: tasks ok (and flagged/failed), last-epoch test accuracy and test
    MSE (separate columns, each shown when some cell has it), forward/backward f-evaluations per
    training batch (last epoch; each shown when some cell has it), the share of training
    batches whose forward / adjoint solve converged (worst seed; "-" where the forward is not a
    solve or no adjoint ran; when the test-set evaluation solves after epoch 1 missed
    tolerance, their converged share in brackets; the stop rule that judged them after the
    share, e.g. ``100% (batch_fro)``, where it is not the default ``sample_max``), median wall
    time in seconds; then one line of totals."""
    from rich.table import Table

    from .results import CONVERGENCE, FLAGGED, RUNNER

    if df.empty:
        return
    t = Table(title="deqbench results (median over seeds)")
    has = {
        m: bool(((df.analysis == "metrics") & (df.metric == m)).any()) for m in ("accuracy", "mse")
    }
    cols = ["cell", "status"]
    cols += ["test acc"] if has["accuracy"] else []
    cols += ["test MSE"] if has["mse"] else []
    # f-evaluations per training batch: shown when some cell ran the solver_stats analysis (the
    # one-cell suites of `deqbench landscape` / `hessian` / `ntk` do not)
    labels = {"forward_nstep": "fwd f-evals/batch", "backward_nstep": "bwd f-evals/batch"}
    nsteps = [m for m in labels if ((df.analysis == "solver_stats") & (df.metric == m)).any()]
    cols += [labels[m] for m in nsteps]
    cols += ["converged train fwd/bwd, eval", "wall s"]
    for col in cols:
        t.add_column(col, overflow="fold")

    def last(g: Any, analysis: str, metric: str, variant: str) -> str:
        sel = (g.analysis == analysis) & (g.metric == metric) & (g.variant == variant)
        d = g[sel & g.step.notna()]
        if d.empty:
            return ""
        return f"{d[d.step == d.step.max()].value.median():.4g}"

    def converged(g: Any, kind: str, variant: str = "train") -> str:
        d = g[(g.analysis == CONVERGENCE) & (g.metric == f"{kind}_unconverged_batches")]
        d = d[d.variant.fillna("train") == variant]
        if d.empty:
            return "-"
        share = 1 - d.value.max()  # worst seed; rounded down, so 100% means every batch
        text = "100%" if share >= 1 else f"{int(share * 1000) / 10:.1f}%"
        rules = sorted({m for n in d.note.fillna("") for m in RULE.findall(str(n))})
        text += f" ({'+'.join(rules)})" if rules else ""
        return f"[yellow]{text}[/yellow]" if (d.status == FLAGGED).any() else text

    counts: dict[str, int] = {}
    for cell, g in df.groupby("cell_id", sort=False):
        r = g[(g.analysis == RUNNER) & (g.metric == "wall_time")]
        for st in r.status:
            counts[st] = counts.get(st, 0) + 1
        ok = f"ok {int((r.status == 'ok').sum())}/{len(r)}"
        bad = sorted(set(r.status) - {"ok"})
        if bad:
            ok = " ".join(f"[yellow]{b}[/yellow]" if b == FLAGGED else f"[red]{b}[/red]"
                          for b in bad) + f" {int((r.status != 'ok').sum())}/{len(r)}"  # fmt: skip
        metrics = [last(g, "metrics", m, "test") for m in ("accuracy", "mse") if has[m]]
        evals = [last(g, "solver_stats", m, "train") for m in nsteps]
        # training batches fwd/bwd, then the evaluation passes after training started
        conv = f"{converged(g, 'forward')}/{converged(g, 'adjoint')}"
        ev = converged(g, "forward", "eval")
        conv += f" eval {ev}" if ev != "-" else ""
        t.add_row(esc(cell), ok, *metrics, *evals, conv, f"{r.value.median():.2f}")
    out_console().print(t)
    total = sum(counts.values())
    parts = [f"{counts.get('ok', 0)} ok"]
    if counts.get(FLAGGED):
        parts.append(f"[yellow]{counts[FLAGGED]} flagged[/yellow]")
    failed = total - counts.get("ok", 0) - counts.get(FLAGGED, 0)
    if failed:
        parts.append(f"[red]{failed} failed[/red]")
    out_console().print(f"{total} tasks: " + ", ".join(parts))


def print_headlines(df: Any, analyses: Any) -> None:
    """After the summary: each analysis's headline (:meth:`Analysis.headline`) per (cell, seed),
    for the analyses of the suite that define one."""
    from ..core.registry import analyses as registry

    if df.empty:
        return
    con = out_console()
    for name in dict.fromkeys(a for a, _ in analyses):
        try:
            cls = registry.get(name)
        except Exception:
            continue
        rows = df[df["analysis"] == name]
        for (cell, seed), g in rows.groupby(["cell_id", "seed"], sort=False):
            for line in cls.headline(g):
                con.print(f"[bold]{esc(name)}[/bold] {esc(cell)} seed={seed}: {esc(line)}")


def compare_table(summary: Any, title: str) -> Any:
    """A rich Table of :func:`deqbench.run.results.compare`'s summary: matched pairs and rows only
    one run has, medians, the median of the paired ratios B/A (for reading), and a status:
    CHANGED where the per-cell rule found a change in some cell (how many, in ``check``),
    flagged pairs, the timing verdict."""
    from rich.table import Table

    t = Table(title=esc(title))
    cols = ("analysis", "metric", "variant", "pairs", "only A", "only B", "median A", "median B",
            "B/A (median of pairs)", "status")  # fmt: skip
    for col in cols:
        t.add_column(col, overflow="fold")
    for r in summary.itertuples():
        flagged = getattr(r, "flagged", 0)
        status = [
            "[red]CHANGED[/red]" if r.changed else "",
            f"[yellow]flagged {flagged}/{r.n}[/yellow]" if flagged else "",
            f"[dim]{esc(r.check)}[/dim]" if getattr(r, "check", "") else "",
        ]
        t.add_row(
            esc(r.analysis), esc(r.metric), esc(r.variant), str(r.n),
            str(getattr(r, "only_a", 0)), str(getattr(r, "only_b", 0)),
            f"{r.median_a:.4g}", f"{r.median_b:.4g}", f"{r.ratio:.4g}",
            " ".join(x for x in status if x),
        )  # fmt: skip
    return t


def _num(v: Any) -> str:
    if isinstance(v, str):
        return v
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    return "" if f != f else f"{f:.4g}"  # NaN: empty


def changes_table(changes: Any, title: str) -> Any:
    """A rich Table of :func:`deqbench.run.results.compare_cells`'s ``changes``: one line per
    CHANGED (cell, metric) -- the most changed row's A, B and B/A (``location``: its seed and
    step; ``rows``: changed of compared) -- per timing series, per task status."""
    from rich.table import Table

    t = Table(title=esc(title))
    for col in ("", "cell", "seed, step", "analysis", "metric", "variant", "A", "B", "B/A",
                "rows", "detail"):  # fmt: skip
        t.add_column(col, overflow="fold")
    for r in changes.itertuples():
        t.add_row(
            "[red]CHANGED[/red]", esc(r.cell_id), esc(r.location), esc(r.analysis),
            esc(r.metric), esc(r.variant), esc(_num(r.a)), esc(_num(r.b)),
            esc(_num(r.ratio)), esc(r.rows), esc(r.detail),
        )  # fmt: skip
    return t


def compare_header(run_a: Any, run_b: Any, meta_a: dict[str, Any], meta_b: dict[str, Any],
                   suite_lines: list[str] | None = None) -> list[str]:  # fmt: skip
    """The lines above ``deqbench compare``'s tables: each run's commit, torch, device, dtype
    and threads (``run.json``), then ``differ: ...`` naming what differs between the two runs
    (commit and dirty tree, versions, device and GPU names, dtype, threads; the suite settings
    from ``suite_lines``, when given), or that none of these does."""
    from .results import environment_differences, run_environment

    lines = [f"A: {run_a}: {run_environment(meta_a)}", f"B: {run_b}: {run_environment(meta_b)}"]
    diffs = environment_differences(meta_a, meta_b) + (suite_lines or [])
    if diffs:
        lines += [f"differ: {d}" for d in diffs]
    else:
        same = "same commit, versions, device, dtype, threads"
        lines.append(same + (" and suite settings" if suite_lines is not None else ""))
    return lines


def cell_lines(diff: dict[str, Any], limit: int = 40) -> list[str]:
    """Cells (and tasks of common cells) only one run has, one id a line, sorted, so that a
    renamed cell shows as a pair; at most ``limit`` ids a side."""
    lines = []
    total = diff["cells"]
    for side, other in (("a", "B"), ("b", "A")):
        ids = diff[f"cells_{side}"]
        if ids:
            lines.append(
                f"cells only in {side.upper()} ({len(ids)}; {total} in both), not compared "
                f"(renamed, added or dropped; not in {other}):"
            )
            lines += [f"  {c}" for c in ids[:limit]]
            if len(ids) > limit:
                lines.append(f"  ... +{len(ids) - limit} more")
    for side in ("a", "b"):
        tasks = diff[f"tasks_{side}"]
        if tasks:
            by: dict[str, list[int]] = {}
            for c, seed in tasks:
                by.setdefault(c, []).append(seed)
            text = "; ".join(f"{c} seed {','.join(map(str, s))}" for c, s in sorted(by.items()))
            lines.append(f"tasks only in {side.upper()} ({len(tasks)}): {text}")
    return lines


def print_collection(summaries: list[Any], total: int) -> None:
    """One line per suite of a collection run: run directory, tasks failed, and the verdicts of
    the paper claims it measures (``summary.csv``, when it measures any): reproduced / not
    reproduced / not run."""
    import csv

    from rich.table import Table

    table = Table(title=f"{len(summaries)} of {total} suites run", title_justify="left")
    for col in ("suite", "tasks failed", "claims: reproduced / not / not run", "run directory"):
        table.add_column(col)
    for sm in summaries:
        held = "-"
        path = sm.run_dir / "summary.csv"
        if path.exists():
            with open(path, newline="", encoding="utf-8") as fh:
                rows = list(csv.DictReader(fh))
            n = [sum(r.get("verdict") == v for r in rows)
                 for v in ("reproduced", "not reproduced", "not run")]  # fmt: skip
            held = " / ".join(map(str, n))
        failed = f"{len(sm.failed)}" + (" (interrupted)" if sm.interrupted else "")
        table.add_row(esc(sm.run_dir.parent.name), failed, held, esc(sm.run_dir))
    out_console().print(table)


def declared_text(name: str) -> str:
    """A model's declared defaults in one line: ``solver=anderson(max_iter=100, tol=0.0001, m=5)
    backward=ift(solver=anderson, ...) init=default``, then the solvers and backward modes it
    declares it supports, if any (empty when it declares nothing)."""
    from .. import models

    parts = []
    for section, d in models.defaults(name).items():
        rest = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                         for k, v in d.items() if k != "name")  # fmt: skip
        parts.append(f"{section}={d['name']}" + (f"({rest})" if rest else ""))
    for key, names in models.compatibility(name).items():  # declared solvers / backward modes
        if names is not None:
            parts.append(f"{key}=[{', '.join(names)}]")
    return " ".join(parts)


def list_names(kind: str | None, pattern: str | None, verbose: bool = False) -> list[str]:
    """``deqbench ls`` lines: ``KIND  NAME  ORIGIN`` (origin: built-in or plugin distribution
    and version); with ``verbose``, models also show their declared defaults. Plugin import
    problems are printed on stderr.

    The built-in names come from the source index (:mod:`deqbench.core.index`) and the plugins'
    from their entry points, so nothing is imported (no torch) unless ``verbose``; a registry
    this process has already loaded is listed as loaded (names added at run time too)."""
    import fnmatch

    from ..core.errors import UnknownNameError
    from ..core.index import builtin_names, static_registries
    from ..core.registry import REGISTRIES

    kinds = list(KINDS)
    if kind is not None:
        k = {"analysis": "analyses", "backward_modes": "backward"}.get(kind, kind)
        k = k if k in KINDS else f"{k}s"
        if k not in KINDS:
            from .yamlio import did_you_mean  # imports yaml: only for the error

            hint = did_you_mean(kind, KINDS)
            raise UnknownNameError(f"unknown kind '{kind}'{hint}; kinds: {', '.join(KINDS)}")
        kinds = [k]
    if verbose and "models" in kinds:
        REGISTRIES["models"].names()  # -v reads the models' declarations: import them (torch)
    index = builtin_names()
    static = static_registries(kinds, index)
    rows: list[tuple[str, str, str]] = []
    for k in kinds:
        reg = _loaded_registry(k, REGISTRIES) or static.get(k)
        if reg is not None:
            rows += [(k, n, reg.origin(n)) for n in reg.names(pattern)]
            for e in reg.plugin_errors:
                err_console().print(f"[yellow]warning:[/yellow] {esc(e)}", markup=True)
            continue
        names = set(index[k]) | set(_loaded_names(k))
        rows += [
            (k, n, "built-in")
            for n in sorted(names)
            if not pattern or fnmatch.fnmatchcase(n, pattern) or pattern in n
        ]
    w1 = max((len(r[0]) for r in rows), default=0)
    w2 = max((len(r[1]) for r in rows), default=0)
    w3 = max((len(r[2]) for r in rows), default=0) if verbose else 0
    return [
        f"{k:<{w1}}  {n:<{w2}}  {o:<{w3}}"
        + (f"  {declared_text(n)}" if verbose and k == "models" else "")
        for k, n, o in rows
    ]


def _loaded_registry(kind: str, registries: dict[str, Any]) -> Any:
    """The registry of ``kind`` when this process has already loaded its built-ins (a registry
    defined outside :mod:`deqbench.core.registry`, the kernels': once its module is imported),
    else None: ``ls`` lists it as it is."""
    from ..core.registry import PUBLISHED

    reg = registries[kind] if kind in registries else PUBLISHED.get(kind)
    return reg if reg is not None and reg.builtins_loaded else None


def _loaded_names(kind: str) -> list[str]:
    """Datasets and plots registered in this process so far (beside the indexed built-ins;
    nothing is imported)."""
    if kind == "datasets":
        mod = sys.modules.get("deqbench.data.base")
        return list(getattr(mod, "DATASETS", {}))
    mod = sys.modules.get("deqbench.run.plots")
    return list(mod.names()) if mod is not None else []


def info_lines(device: str | None, as_json: bool = False) -> list[str]:
    """``deqbench info``: versions, device, flags, git commit, plugins (and broken plugins)."""
    import json

    from ..core.errors import DeviceError
    from ..core.registry import REGISTRIES
    from .env import check_device, collect

    if device and (msg := check_device(device)):
        raise DeviceError(f"--device {device}: {msg}")
    meta = collect(device or "auto", command=[])
    meta.pop("command", None)
    errors = []
    for reg in REGISTRIES.values():
        reg.names()
        errors += reg.plugin_errors
    meta["plugin_errors"] = errors
    if as_json:
        return [json.dumps(meta, indent=2, default=str)]
    v = meta["versions"]
    lines = [f"{k + ':':<12}{v[k] if v.get(k) is not None else '-'}" for k in v]
    git = meta["git"]
    lines += [
        f"{'device:':<12}{meta['device']} ({meta['device_name']})",
        f"{'gpus:':<12}{', '.join(meta['gpus']) or '-'}",
        f"{'flags:':<12}" + " ".join(f"{k}={x}" for k, x in meta["flags"].items()),
        f"{'git:':<12}{git['commit'] or '-'}{' (dirty)' if git.get('dirty') else ''}",
        f"{'plugins:':<12}" + ("" if meta["plugins"] else "none"),
    ]
    lines += [f"  {p['name']} {p['version']}: {', '.join(p['provides'])}" for p in meta["plugins"]]
    lines += [f"  broken: {e}" for e in errors]
    return lines
