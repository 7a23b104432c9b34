"""The ``deqbench`` command line (Typer). Parses options, calls the library, maps errors to exit
codes; no logic of its own. Nothing heavy is imported at module level: ``deqbench --help`` does
not import torch.

Exit codes: 0 ok; 1 finished but some cell failed; 2 usage, config or unknown-name error (one
red line per problem on stderr, no traceback; also a run directory locked by another run, a
run stopped by an error writing it, e.g. disk full, or memory exhausted while PyTorch loads,
e.g. under a low ``ulimit -v``: :func:`main`); 130 interrupted by SIGINT, 143 by SIGTERM
(finished cells are on disk).

This package holds the app and the generic verbs (``run``, ``ls``, ``plot``, ``compare``, ...).
A command that measures something (``landscape``, ``hessian``, ``ntk``) lives in its family's
package, ``deqbench/<family>/cli.py``, with a ``register(app)`` function (found by
:func:`_register_subcommands`); it builds a one-cell suite from its options and hands it to the
same runner::

    def landscape_command(model: str = "fc_deq_tiny", device: Device = None, ...) -> None:
        run_one_cell("landscape", model=model, analyses=[{"landscape": {...}}], device=device, ...)

    def register(app: typer.Typer) -> None:
        app.command("landscape", epilog="Example: deqbench landscape")(landscape_command)
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer

from ..run.console import KINDS, err_console, esc
from .memory import _memory_exhausted, _out_of_memory_line
from .run_files import _load_run, _reference_check, check_run_files

app = typer.Typer(
    name="deqbench",
    help="Benchmark and analyse deep equilibrium models: YAML suites in, tidy CSV and plots out.",
    epilog="Example: deqbench run suites/smoke.yaml --set all.train.epochs=1",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        from .. import __version__  # deqbench/__init__ imports no torch

        print(f"deqbench {__version__}")
        raise typer.Exit(0)


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """Benchmark and analyse deep equilibrium models: YAML suites in, tidy CSV and plots out."""


DeviceOpt = Annotated[
    str | None,
    typer.Option(
        "--device", help="cuda_if_available | auto | cpu | cuda | cuda:N (overrides the suite)."
    ),
]
SeedsOpt = Annotated[
    str | None, typer.Option("--seeds", help="Seeds, e.g. 0,1,2 or 0-4 (overrides the suite).")
]
OutOpt = Annotated[
    Path | None, typer.Option("--out", help="Results root (overrides the suite's output).")
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        help="Override a suite field: KEY=VALUE with a dotted key, e.g. defaults.train.epochs=1 "
        "(the default: cells that set it keep theirs) or all.train.epochs=1 (every cell) "
        "(repeatable).",
    ),
]
StopAfterOpt = Annotated[
    float | None,
    typer.Option(
        "--stop-after",
        min=0,
        help="Stop after this many seconds: each running task stops at its next training step, "
        "writing its checkpoint, no further task starts; exit 75 and --resume continues (e.g. "
        "--stop-after 540 inside a 10-minute limit).",
    ),
]
ProgressOpt = Annotated[
    bool | None,
    typer.Option(
        "--progress/--no-progress",
        help="Progress bar on stderr (default: on when stderr is a terminal).",
    ),
]


def fail(message: str, code: int = 2) -> None:
    """Print ``message`` (one red line per line) on stderr and exit with ``code``."""
    con = err_console()
    for line in str(message).splitlines() or ["error"]:
        con.print(f"[red]error:[/red] {esc(line)}", markup=True)
    raise typer.Exit(code)


def _warn_notes(suites: Sequence[Any]) -> None:
    """The suites' load warnings (``Suite.notes``), one ``warning:`` line each on stderr."""
    for line in dict.fromkeys(n for s in suites for n in s.notes):
        err_console().print(f"[yellow]warning:[/yellow] {esc(line)}", markup=True)


@contextmanager
def handle_errors() -> Iterator[None]:
    """DeqbenchError -> exit 2 with its lines; a signal (SIGINT, SIGTERM) -> exit 130 / 143.
    A ``SystemExit``, ``KeyboardInterrupt`` or ``GeneratorExit`` that plugin code raised and
    nothing below recorded (:mod:`deqbench.run.interrupts`) -> exit 2 and one line naming it,
    never the plugin's exit code or an "interrupted"."""
    from ..core.errors import DeqbenchError
    from ..run.interrupts import fault_line, is_interruption, marked_signals

    try:
        with marked_signals():  # Ctrl-C arrives as Interrupted: a plain KeyboardInterrupt is code's
            try:
                yield
            except (KeyboardInterrupt, SystemExit, GeneratorExit) as exc:
                if is_interruption(exc):  # judged while the marking handler is in place
                    raise
                fail(f"stopped: {fault_line(exc)}", 2)
    except DeqbenchError as exc:
        fail(str(exc), 2)
    except KeyboardInterrupt as exc:
        err_console().print("[yellow]interrupted[/yellow]", markup=True)
        raise typer.Exit(getattr(exc, "exit_code", 130)) from None


def parse_seeds(
    text: str | None, overrides: Sequence[str] = (), caps: bool = True
) -> list[int] | None:
    """``"0,1,2"`` / ``"0-4"`` -> list of ints. More seeds than the task cap
    (:data:`~deqbench.run.matrix.MAX_TASKS`) are refused before the list is built, unless the
    caps are lifted: ``caps`` False (the suite file's own ``caps: false``, :func:`file_caps`),
    or ``overrides`` (``--set``) with ``caps=false``; the last ``caps=`` override wins over
    the file, as it does in the suite."""
    from ..core.errors import ConfigError
    from ..run.matrix import MAX_TASKS
    from ..run.yamlio import parse_scalar

    if text is None:
        return None
    for k, _, v in (o.partition("=") for o in overrides):
        if k.strip() == "caps":
            caps = parse_scalar(v.strip()) is not False
    parts: list[tuple[int, int]] = []
    try:
        for part in text.replace(" ", "").split(","):
            lo, dash, hi = part.partition("-")
            parts.append((int(lo), int(hi)) if dash and lo else (int(part), int(part)))
    except ValueError:
        raise ConfigError(f"--seeds {text}: expected integers like 0,1,2 or 0-4") from None
    count = sum(max(0, hi - lo + 1) for lo, hi in parts)
    if caps and count > MAX_TASKS:
        raise ConfigError(
            f"--seeds {text}: {count} seeds, over the cap of {MAX_TASKS} tasks "
            "(caps: false in the suite, or --set caps=false, lifts it)"
        )
    seeds = [s for lo, hi in parts for s in range(lo, hi + 1)]
    if not seeds:
        raise ConfigError(f"--seeds {text}: no seeds")
    return seeds


def file_caps(path: Path) -> bool:
    """Whether the caps hold for the suite file ``path`` as written: False where it says
    ``caps: false``; for a collection file, where every member does (a member that keeps them
    refuses more seeds than the task cap anyway). True where a file does not read: the loaders
    report that. Read with the limited YAML loader, like every suite."""
    from ..core.errors import ConfigError
    from ..run.yamlio import read_yaml

    def own(raw: Any) -> bool:
        return not (isinstance(raw, dict) and raw.get("caps") is False)

    try:
        raw, _ = read_yaml(path)
        if isinstance(raw, dict) and "suites" in raw:
            members = raw["suites"]
            if not isinstance(members, list) or not members:
                return True
            return any(own(read_yaml(Path(path).parent / str(m))[0]) for m in members)
        return own(raw)
    except ConfigError:
        return True


def _seeds_for(path: Path, seeds: str | None, overrides: Sequence[str]) -> list[int] | None:
    """``--seeds`` of a command that reads the suite file ``path`` (its ``caps`` count)."""
    return parse_seeds(seeds, overrides, file_caps(path) if seeds is not None else True)


def execute(
    suite: Any,
    *,
    resume: Path | None = None,
    progress: bool | None = None,
    plots: bool = True,
    out: Path | None = None,
    executor: Any = None,
    summaries: list[Any] | None = None,
) -> int:
    """Run ``suite`` through the runner, print the summary; return the exit code (the
    :class:`~deqbench.run.runner.RunSummary` is appended to ``summaries`` when given)."""
    from ..run.console import print_headlines, print_summary
    from ..run.runner import run_suite, signals_held

    if resume is None:  # an unwritable results folder: one line, before the run directory
        from ..run.suite import make_output_root

        make_output_root(out if out is not None else suite.output, suite.name)
    summary = run_suite(
        suite,
        out,
        resume=resume,
        progress=progress,
        plots=plots,
        command=sys.argv,
        executor=executor,
    )
    if summaries is not None:
        summaries.append(summary)
    from ..run.results import load_results

    with signals_held():  # the run has ended: its status and exit code stand
        df = summary.results if summary.results is not None else load_results(summary.run_dir)
        print_summary(df)
        print_headlines(df, suite.analyses)
        con = err_console()
        for cell, seed, status, note in summary.failed:
            con.print(f"[red]{status}[/red] {esc(f'{cell} seed={seed}: {note}')}", markup=True)
        again = f"deqbench run {summary.run_dir / 'suite.yaml'} --resume {summary.run_dir}"
        if summary.cause:
            con.print(
                f"[red]error:[/red] {esc(f'stopped: {summary.cause}; finished cells are on disk')}"
                f"; resume with: {esc(again)}",
                markup=True,
            )
        elif summary.interrupted:
            import signal

            from ..run.checkpoints import FOLDER

            n = len(list((summary.run_dir / FOLDER).glob("*.pt")))
            kept = (
                f" ({n} task{'s' * (n != 1)} continue{'s' * (n == 1)} from a checkpoint)"
                if n
                else ""
            )
            if summary.signal is None and summary.stopped:
                for cell, seed, note in summary.stopped:
                    con.print(f"[yellow]unfinished[/yellow] {esc(f'{cell} seed={seed}: {note}')}",
                              markup=True)  # fmt: skip
                n = len(summary.stopped)
                how = f" by --stop-after: {n} task{'s' * (n != 1)} unfinished"
            else:
                how = f" ({signal.Signals(summary.signal).name})" if summary.signal else ""
            con.print(f"[yellow]interrupted{how}[/yellow]{kept}; resume with: {esc(again)}",
                      markup=True)  # fmt: skip
        print(f"run directory: {summary.run_dir}")
    return summary.exit_code


def _option_paths(model: Any, analyses: Sequence[Any], sections: dict[str, Any]) -> dict:
    """Suite paths -> the command-line option that set them, for one-line errors that name
    the option (``--grid 4: grid must be odd ...``): every analysis parameter comes from the
    option of the same name (``points_per_batch`` <- ``--points-per-batch``)."""

    def opt(key: str, value: Any) -> str:
        return f"--{str(key).replace('_', '-')} {value}"

    paths: dict[tuple[Any, ...], str] = {}
    for i, a in enumerate(analyses):
        if isinstance(a, dict):
            for name, params in a.items():
                for k, v in (params or {}).items():
                    paths[("analyses", i, name, k)] = opt(k, v)
    if isinstance(model, str):
        paths[("defaults", "model")] = opt("model", model)
    data = sections.get("data")
    if isinstance(data, dict) and "name" in data:
        paths[("data", "name")] = opt("data", data["name"])
    dtype = sections.get("dtype")
    if dtype:
        paths[("dtype",)] = opt("dtype", dtype)
    return paths


def run_one_cell(
    name: str,
    *,
    model: str | dict[str, Any],
    analyses: Sequence[Any],
    device: str | None = None,
    seeds: str | None = None,
    out: Path | None = None,
    set_: Sequence[str] | None = None,
    progress: bool | None = None,
    **sections: Any,
) -> None:
    """Build a one-cell suite from options (:func:`deqbench.run.suite.one_cell_suite`) and run it;
    exits with the run's code. For commands like ``landscape``, ``hessian``, ``ntk``."""
    with handle_errors():
        from ..run.suite import one_cell_suite

        suite = one_cell_suite(
            name,
            model=model,
            analyses=analyses,
            device=device or "cuda_if_available",
            seeds=parse_seeds(seeds, set_ or ()) or [0],
            output=str(out) if out else "results",
            overrides=set_ or (),
            flags=_option_paths(model, analyses, sections),
            **{k: v for k, v in sections.items() if v is not None},
        )
        code = execute(suite, progress=progress)
    raise typer.Exit(code)


@app.command(
    epilog="Example: deqbench run suites/smoke.yaml --device cpu --seeds 0 --set all.train.epochs=1"
)
def run(
    suite: Annotated[Path, typer.Argument(help="Suite YAML file.")],
    device: DeviceOpt = None,
    seeds: SeedsOpt = None,
    out: OutOpt = None,
    set_: SetOpt = None,
    resume: Annotated[
        Path | None,
        typer.Option("--resume", help="Continue this run directory: finished cells are skipped."),
    ] = None,
    progress: ProgressOpt = None,
    plots: Annotated[
        bool, typer.Option("--plots/--no-plots", help="Write plots/ at the end.")
    ] = True,
    executor: Annotated[
        str,
        typer.Option(
            "--executor",
            help="inline: cells one by one in this process; dask: each cell x seed is one Dask "
            "task (needs the extra deqbench\\[dask]).",
        ),
    ] = "inline",
    scheduler: Annotated[
        str | None,
        typer.Option(
            "--scheduler",
            help="With --executor dask: join this running Dask scheduler (tcp://HOST:8786) "
            "instead of starting a local cluster.",
        ),
    ] = None,
    workers: Annotated[
        int | None,
        typer.Option(
            "--workers",
            help="With --executor dask: local worker processes (default: one per visible GPU, "
            "or cpu_count/threads on CPU).",
        ),
    ] = None,
    check: Annotated[
        bool,
        typer.Option(
            "--check/--no-check",
            help="Check the contracts of the suite's models and solvers on CPU, and that its "
            "data can load (files, packages; not with --scheduler: the workers read it), before "
            "starting (as deqbench validate does).",
        ),
    ] = True,
    stop_after: StopAfterOpt = None,
) -> None:
    """Run a suite: every cell x seed, into results/SUITE/RUN_ID/.

    A collection file (one with a list under suites:) runs its suites one after another, each
    into its own run directory; the exit code is the worst of theirs. Exit codes: 0 every cell
    ok, 1 some cell failed or flagged, 2 bad input (or the run directory is locked by another
    run, or writing it failed, e.g. disk full, or memory ran out while PyTorch loaded), 75
    stopped by --stop-after with cells unfinished, 130 interrupted (SIGINT), 143 (SIGTERM): each
    resumable with --resume, a training cell from its checkpoint.
    Only those signals interrupt: a plugin's sys.exit() or KeyboardInterrupt is its cell's error
    (or its analysis's failed row), and the run goes on."""
    with handle_errors(), ExitStack() as stack:
        from ..core.errors import ConfigError
        from ..run.executors import prestart
        from ..run.interrupts import stop_after as deadline
        from ..run.suite import load_suites

        stack.enter_context(deadline(stop_after))  # the command's deadline, every part's

        # a local Dask cluster starts (and its workers warm up) while the suite is validated
        early = prestart(executor, scheduler=scheduler, workers=workers, path=suite,
                         device=device, overrides=set_ or ())  # fmt: skip
        if early is not None:
            stack.callback(early.close)
        suites = load_suites(
            suite,
            overrides=set_ or (),
            device=device,
            seeds=_seeds_for(suite, seeds, set_ or ()),
            output=str(out) if out else None,
        )
        _warn_notes(suites)
        if resume is not None and len(suites) > 1:
            raise ConfigError(
                f"--resume continues one suite's run directory; {suite} is a collection of "
                f"{len(suites)} suites: resume a part with its own file, e.g. deqbench run "
                "RUN_DIR/suite.yaml --resume RUN_DIR"
            )
        if check:
            from ..run.plugin_checks import check_suites

            check_suites(suites, data=scheduler is None)
        from ..run.executors import open_executor

        summaries: list[Any] = []  # RunSummary of each part
        code = 0
        for i, s in enumerate(suites):
            if len(suites) > 1:
                err_console().print(f"[bold]{i + 1}/{len(suites)}[/bold] suite {esc(s.name)}")
            with open_executor(executor, scheduler=scheduler, workers=workers, suite=s,
                               started=early if i == 0 else None) as ex:  # fmt: skip
                c = execute(
                    s,
                    resume=resume,
                    progress=progress,
                    plots=plots,
                    executor=ex,
                    summaries=summaries,
                )
            code = max(code, c)
            if summaries and summaries[-1].interrupted:  # the later parts do not start
                break
        if len(suites) > 1:
            from ..run.console import print_collection

            print_collection(summaries, len(suites))
    raise typer.Exit(code)


@app.command(epilog="Example: deqbench validate suites/smoke.yaml --set defaults.solver.tol=1e-6")
def validate(
    suite: Annotated[Path, typer.Argument(help="Suite YAML file.")],
    device: DeviceOpt = None,
    seeds: SeedsOpt = None,
    set_: SetOpt = None,
) -> None:
    """Check a suite without running it: the schema, then the contracts of every model, init
    and solver it names (on CPU: each factory called and run on a batch of 2, each solver on a
    small test problem; deqbench/run/plugin_checks.py) and that its data can load (files,
    packages, a plugin's shapes); list its cells."""
    with handle_errors():
        from ..run.suite import format_cells, load_suites

        suites = load_suites(
            suite, overrides=set_ or (), device=device, seeds=_seeds_for(suite, seeds, set_ or ())
        )
        _warn_notes(suites)
        from ..run.plugin_checks import check_suites  # imports torch: after the schema checks

        check_suites(suites)
        for s in suites:
            n = len(s.cells)
            name = suite if s.source == str(suite) else f"{suite} > {s.source}"
            print(
                f"{name}: ok: {n} cell{'s' * (n != 1)} x {len(s.seeds)} seed"
                f"{'s' * (len(s.seeds) != 1)} = {n * len(s.seeds)} tasks; device {s.device}; "
                f"analyses: {', '.join(a for a, _ in s.analyses) or 'none'}"
            )
            for line in format_cells(s):
                print(line)


@app.command("ls", epilog="Example: deqbench ls models 'conv*'")
def ls(
    kind: Annotated[
        str | None, typer.Argument(help=f"One of {', '.join(KINDS)} (default: all).")
    ] = None,
    pattern: Annotated[
        str | None, typer.Argument(help="Glob or substring filter on names.")
    ] = None,
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose", "-v", help="Models: also their declared solver, backward and init."
        ),
    ] = False,
    check: Annotated[
        bool,
        typer.Option(
            "--check",
            help="Import every plugin listed and mark the ones that fail (BROKEN: why); exit 1 "
            "if any does.",
        ),
    ] = False,
) -> None:
    """List registered names and where they come from (built-in or plugin distribution)."""
    broken: dict[tuple[str, str], str] = {}
    with handle_errors():
        from ..run.console import list_names

        lines = list_names(kind, pattern, verbose)
        if check:
            broken = _broken_plugins({ln.split()[0] for ln in lines if ln.strip()}, pattern)
        for line in lines:
            parts = line.split()
            why = broken.get((parts[0], parts[1])) if len(parts) > 1 else None
            print(line.rstrip() + (f"  BROKEN: {why}" if why else ""))
    if broken:
        raise typer.Exit(1)


def _broken_plugins(kinds: set[str], pattern: str | None) -> dict[tuple[str, str], str]:
    """(kind, name) -> import error of every plugin of ``kinds`` that fails to import."""
    from ..core.registry import REGISTRIES

    out: dict[tuple[str, str], str] = {}
    for k in sorted(kinds):
        reg = REGISTRIES.get(k)
        if k == "kernels":
            from ..kglm.kernels import kernels as reg
        if reg is not None:
            out.update({(k, n): why for n, why in reg.broken(pattern).items()})
    return out


@app.command(
    epilog="Example: deqbench info --json   # on a GPU machine: deqbench info --device cuda"
)
def info(
    device: DeviceOpt = None,
    json_: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Versions, device, CUDA, numeric flags and installed plugins."""
    with handle_errors():
        from ..run.console import info_lines

        for line in info_lines(device, as_json=json_):
            print(line)


@app.command(epilog="Example: deqbench plot results/smoke/20250101-120000")
def plot(run_dir: Annotated[Path, typer.Argument(help="A run directory.")]) -> None:
    """Regenerate the plots of a run into RUN_DIR/plots/."""
    with handle_errors():
        from ..run.plots import write_plots

        paths, errors = write_plots(run_dir, _load_run(run_dir))
        for p in paths:
            print(p)
        for e in errors:
            err_console().print(f"[red]error:[/red] {esc(e)}", markup=True)
        if not paths and not errors:
            err_console().print("nothing to plot in this run", markup=False)
    if errors:
        raise typer.Exit(1)


@app.command(
    epilog="Example: deqbench compare results/smoke/RUN_A results/smoke/RUN_B --fail-on-change "
    "--rtol 1e-4; CI against a committed run: deqbench compare plots/smoke "
    "results/smoke/RUN --reference"
)
def compare(
    run_a: Annotated[Path, typer.Argument(help="Baseline run directory.")],
    run_b: Annotated[Path, typer.Argument(help="Run directory to compare against the baseline.")],
    factor: Annotated[
        float,
        typer.Option(
            "--factor",
            min=1.0,
            help="Timing metrics (with --timing): a cell is CHANGED where the ratio of the "
            "medians B/A is beyond this factor either way and the Mann-Whitney U test on its "
            "samples (seeds x repeats) gives p < 0.01.",
        ),
    ] = 1.1,
    rtol: Annotated[
        float | None,
        typer.Option(
            "--rtol",
            min=0.0,
            help="Deterministic metrics (every unit but s, ms, per second): a cell is CHANGED "
            "where some row has |B-A| > rtol * max(|A|, |B|) + 1e-12 (NaN vs NaN equal). "
            "Default 1e-6 (a rerun on the same machine); loosen it for runs of other machines, "
            "e.g. 1e-3.",
        ),
    ] = None,
    csv: Annotated[
        Path | None,
        typer.Option(
            "--csv",
            help="Also write the per-metric table to this CSV file, and the CHANGED list to "
            "its -cells.csv sibling.",
        ),
    ] = None,
    fail_on_change: Annotated[
        bool,
        typer.Option("--fail-on-change", help="Exit 1 when something is CHANGED (in any cell)."),
    ] = False,
    timing: Annotated[
        bool,
        typer.Option(
            "--timing",
            help="Also judge timing metrics, per cell (see --factor); a cell with too few "
            "samples to reach p < 0.01 (5 a side) is reported as not judged, never CHANGED.",
        ),
    ] = False,
    reference: Annotated[
        bool,
        typer.Option(
            "--reference",
            help="CI check of RUN_B against the reference run RUN_A with tolerances for "
            "another CPU (deqbench.run.reference): same tasks, same statuses, iteration "
            "counts, converged shares, accuracies, losses and residuals within tolerance, no "
            "timings. Prints each mismatch on one line; exit 1 on any.",
        ),
    ] = False,
    force: Annotated[
        bool,
        typer.Option(
            "--force", help="Compare runs of differently named suites or without a common cell."
        ),
    ] = False,
) -> None:
    """Compare two runs of one suite, cell by cell: rows are joined on (cell_id, seed,
    analysis, variant, metric, step, repeat).

    CHANGED, per cell and metric: a deterministic metric (iteration counts, converged shares,
    accuracies, losses, residuals) whose value differs beyond --rtol in any row; with --timing,
    a timing whose cell's samples moved beyond --factor with p < 0.01; a (cell, seed) whose
    status differs (ok -> flagged); rows only one run has in a task both ran. The header names
    what differs between the runs (commit, dirty tree, torch, device, dtype, threads, suite
    settings); cells only one run has (renamed ids) are listed, not compared. The table per
    metric shows the median of the paired ratios B/A, for reading only.

    --reference checks RUN_B against a committed reference run RUN_A instead (for CI)."""
    with handle_errors():
        from ..core.errors import ConfigError
        from ..run.results import RTOL, check_comparable

        for run in (run_a, run_b):
            check_run_files(run)
        if reference:
            unused = [o for o, v in (("--csv", csv), ("--timing", timing), ("--rtol", rtol),
                                     ("--fail-on-change", fail_on_change)) if v]  # fmt: skip
            if unused:
                raise ConfigError(
                    f"--reference has its own tolerances and always fails on a mismatch: "
                    f"{', '.join(unused)} do not apply"
                )
            code = _reference_check(run_a, run_b)
            raise typer.Exit(code)
        from ..run.results import compare_cells, match_counts
        from .comparison import print_comparison, write_comparison_csv

        tol = RTOL if rtol is None else rtol
        a, b = _load_run(run_a), _load_run(run_b)
        warnings = check_comparable(run_a, run_b, a, b, force)
        summary, joined, changes = compare_cells(a, b, factor, timing=timing, rtol=tol)
        counts = match_counts(a, b, joined)
        if not counts["a"]["matched"]:
            raise ConfigError(
                f"{run_a} and {run_b} share no (cell_id, seed, analysis, variant, metric, step, "
                f"repeat) rows ({counts['a']['compared']} vs {counts['b']['compared']} ok/flagged)"
            )
        print_comparison(
            run_a, run_b, a, b, warnings, summary, changes, counts, tol, factor, timing
        )
        if csv is not None:
            write_comparison_csv(csv, summary, changes)
    raise typer.Exit(1 if (fail_on_change and len(changes)) else 0)


def _register_subcommands() -> None:
    """Add the verbs that live beside their feature: every ``deqbench/<family>/cli.py`` (e.g.
    ``deqbench/ntk/cli.py``) and every module of this package that defines ``register(app)``
    (e.g. ``deqbench/cli/plugin.py``). They must not import torch at module level, nor may
    their family's ``__init__``."""
    import importlib
    import pkgutil
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent  # the deqbench package
    names = [
        f"deqbench.{d.name}.cli"
        for d in sorted(root.iterdir(), key=lambda d: d.name)
        if d.is_dir() and d.name != "cli" and (d / "cli.py").is_file()
    ]
    names += [
        f"{__name__}.{m.name}" for m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name)
    ]
    for name in names:
        register = getattr(importlib.import_module(name), "register", None)
        if register is not None:
            register(app)


def _reflow(text: str | None) -> str | None:
    """Join the lines of each paragraph (blank lines separate paragraphs): the terminal wraps
    help text to its own width, so the docstrings' source line breaks would break lines
    mid-sentence at 80 columns."""
    if not text:
        return text
    import inspect

    paras = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(" ".join(line.strip() for line in p.splitlines()) for p in paras)


def _reflow_help() -> None:
    for cmd in app.registered_commands:
        if cmd.help:
            cmd.help = _reflow(cmd.help)
        elif cmd.callback is not None and cmd.callback.__doc__:
            cmd.callback.__doc__ = _reflow(cmd.callback.__doc__)


_register_subcommands()
_reflow_help()


def main() -> None:
    """Console-script entry point (``deqbench`` and ``python -m deqbench``). Memory exhausted
    while the heavy libraries load (``ulimit -v`` too low for PyTorch: MemoryError, or an
    ImportError "failed to map segment") is one line on stderr and exit code 2, not a
    traceback.

    A command that ended (its exit code decided) leaves the process at once: the interpreter's
    teardown after torch, pandas, matplotlib and Dask are loaded (finalisers, the collection of
    the whole heap) took 1.5 s, on every run. Every file a command writes is complete by then
    (written atomically, closed); stdout and stderr are flushed first. ``DEQBENCH_SLOW_EXIT=1``
    keeps the normal exit."""
    try:
        app()
    except SystemExit as exc:
        _exit_now(exc.code)
        raise
    except (MemoryError, ImportError, OSError) as exc:
        if not _memory_exhausted(exc):
            raise
        try:
            line = _out_of_memory_line(exc)
        except MemoryError:
            line = "out of memory while loading PyTorch: raise `ulimit -v` or free memory"
        sys.stderr.write(f"error: {line}\n")
        raise SystemExit(2) from None


def _exit_now(code: Any) -> None:
    """``os._exit`` with ``code`` (an int or None) after flushing stdout and stderr; returns
    (the caller raises as usual) for other codes or with ``DEQBENCH_SLOW_EXIT`` set."""
    import os

    slow = os.environ.get("DEQBENCH_SLOW_EXIT", "").strip().lower()
    if slow not in ("", "0", "false", "no", "off") or not (code is None or isinstance(code, int)):
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed pipe: nothing more to say
            pass
    try:  # what C code buffered in stdio (a library's printf)
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except Exception:  # noqa: BLE001 - no libc to ask: nothing buffered there
        pass
    os._exit(code or 0)
