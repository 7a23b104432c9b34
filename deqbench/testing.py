"""Conformance checks for the parts of deqbench, built-in or plugin (as scikit-learn's
``check_estimator``): one call per registered name, raising :class:`ConformanceError` (an
``AssertionError``, so pytest shows it as a failure) with one line per broken clause.

* :func:`check_solver`: the clauses ``deqbench validate`` checks ([solver.signature],
  [solver.returns], [solver.stats], [solver.progress], [solver.structure]; forward and as
  adjoint solver), plus [solver.options]: an unknown option is a deqbench ``ConfigError``.
* :func:`check_model`: validate's model clauses on a batch of 2 (factory, cell, forward,
  declaration, own-solver statistics), each declared init applied, plus [model.backward]: a loss
  on its output backpropagates to finite gradients, some nonzero.
* :func:`check_init`: [init.call] on a model, plus [init.seeded]: the same seed gives the same
  weights, every weight finite.
* :func:`check_analysis`: the analysis runs on one tiny cell through the runner (the same path
  as ``deqbench run``): [analysis.params], [analysis.runs], [analysis.rows], [analysis.plot].
* :func:`check_dataset`: [dataset.bundle] (splits, shapes, labels) and [dataset.shape]: the
  shape ``validate`` derives without loading equals the loaded one.
* :func:`check_backward`: a backward mode ([backward.class], [backward.options],
  [backward.forward], [backward.grad], [backward.descent], [backward.eval]) on a small
  contractive DEQ in float64.

:func:`conformance_names` lists what the project's own tests check: every registered name, the
``_tiny`` variant of a model that has one.

Example (a plugin's tests)::

    from deqbench.testing import check_model, check_solver

    def test_my_solver():
        check_solver("my_picard")

    def test_my_model():
        check_model("my_deq", solver="my_picard")
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = [
    "ConformanceError",
    "check_analysis",
    "check_backward",
    "check_dataset",
    "check_init",
    "check_model",
    "check_solver",
    "conformance_names",
    "example_context",
]

#: clauses the conformance kit checks beyond ``deqbench validate``'s (deqbench.contracts.CLAUSES)
EXTRA_CLAUSES: dict[str, str] = {
    "solver.options": "an unknown option raises deqbench's ConfigError naming it, before any "
    "f-evaluation",
    "model.backward": "a loss on model(x) backpropagates: every gradient finite, at least one "
    "nonzero",
    "init.seeded": "init(model, seed=s) twice gives the same weights; every weight finite",
    "analysis.params": "the class has a name, a string version and a pydantic Params that "
    "forbids unknown keys",
    "analysis.runs": "on its example cell (Analysis.example) the task finishes ok through the "
    "runner",
    "analysis.rows": "it writes at least one row; statuses are results statuses; a row with "
    "status ok and no finite value says why in its note",
    "analysis.plot": "a plot registered under its name draws from its rows",
    "dataset.bundle": "load_data returns a DataBundle: non-empty train and test splits, x of "
    "in_shape, labels in [0, num_outputs) (classification) or targets of num_outputs values",
    "dataset.shape": "the (in_shape, num_outputs) the loader declares (loader.shape(params), "
    "what validate uses without loading) equals the loaded data's",
    "backward.class": "the registered object is a deqbench.backward.BackwardMode subclass (or "
    "instance) with a name",
    "backward.options": "a mode with an Options model rejects an unknown option with a "
    "ConfigError naming it (BackwardConfig)",
    "backward.forward": "the forward solver the mode declares is registered, and a layer "
    "configured with another forward solver is a ConfigError",
    "backward.grad": "on a 0.5-contractive fc DEQ layer (float64) a loss <R, z> backpropagates "
    "through the mode to finite gradients of the injection and of every cell parameter, some "
    "nonzero, and the forward stats are set",
    "backward.descent": "that gradient is a descent direction: its cosine with the implicit "
    "(IFT) gradient is positive",
    "backward.eval": "without grad the layer returns a finite state of z's shape",
}

#: the cell an analysis is checked on unless its class sets ``example`` (a dict of one-cell
#: suite options: model, data, solver, backward, init, train, params)
DEFAULT_EXAMPLE: dict[str, Any] = {
    "model": "fc_deq_tiny",
    "data": {"name": "digits", "train_subset": 64, "test_subset": 32},
    "train": {"epochs": 1, "batch_size": 32},
}


class ConformanceError(AssertionError):
    """Broken clauses of one registered name; ``lines`` holds one line per violation."""

    def __init__(self, lines: list[str]) -> None:
        self.lines = list(lines)
        super().__init__("\n".join(self.lines))


def _raise(lines: list[str]) -> None:
    if lines:
        raise ConformanceError(lines)


def _who(kind: str, name: str) -> str:
    from .core.registry import registry

    try:
        origin = registry({"analysis": "analyses"}.get(kind, kind)).origin(name)
    except Exception:  # noqa: BLE001 - an unknown name is reported by the check itself
        origin = "?"
    return f"{origin if origin == 'built-in' else 'plugin ' + origin}: {kind} '{name}'"


@contextmanager
def _quiet_threads() -> Iterator[None]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# -- solvers -----------------------------------------------------------------------------------


def check_solver(name: str, *, options: dict[str, Any] | None = None) -> None:
    """Check solver ``name`` (with ``options``, e.g. those your suites use) forward and as an
    adjoint solver on deqbench's test problems; raise :class:`ConformanceError` if a clause
    breaks. Takes well under a second."""
    import torch

    from .core.errors import ConfigError
    from .core.registry import solvers
    from .run.plugin_checks import ContractChecks

    fn = solvers.get(name)
    checks = ContractChecks()
    with _quiet_threads():
        for adjoint in (False, True):
            checks.solver(name, dict(options or {}), adjoint=adjoint)
    lines = [v.line() for v in checks.violations]
    calls = 0

    def f(z: Any) -> Any:
        nonlocal calls
        calls += 1
        return 0.5 * z + 1.0

    z0 = torch.zeros(2, 3, dtype=torch.float64)
    try:
        fn(f, z0, max_iter=5, tol=1e-3, stop_mode="rel", no_such_option_xyz=1)
        lines.append(
            f"{_who('solver', name)}: [solver.options] accepted the unknown option "
            "no_such_option_xyz (suites with a typo would run with the default)"
        )
    except ConfigError as exc:
        if "no_such_option_xyz" not in str(exc):
            lines.append(
                f"{_who('solver', name)}: [solver.options] the ConfigError for an unknown option "
                f"does not name it: {exc}"
            )
        elif calls:
            lines.append(
                f"{_who('solver', name)}: [solver.options] evaluated f {calls} times before "
                "rejecting an unknown option"
            )
    except Exception as exc:  # noqa: BLE001 - reported as a violation
        lines.append(
            f"{_who('solver', name)}: [solver.options] an unknown option raised "
            f"{type(exc).__name__}: {exc} (declare an options model: deqbench.solvers.base.solver)"
        )
    _raise(lines)


# -- models ------------------------------------------------------------------------------------


def _factory_shape(name: str) -> tuple[tuple[int, ...], int]:
    """(in_shape, num_outputs) from the factory's defaults: num_outputs None (sequence or image
    to image models) means one output per input value."""
    import inspect

    from .core.registry import models

    ps = inspect.signature(models.get(name)).parameters
    shape = ps["in_shape"].default if "in_shape" in ps else (64,)
    if shape is inspect.Parameter.empty:
        shape = (64,)
    n = ps["num_outputs"].default if "num_outputs" in ps else 10
    if n is inspect.Parameter.empty:
        n = 10
    return tuple(int(s) for s in shape), int(n) if n is not None else math.prod(shape)


def _cell_suite(
    *,
    model: str | dict[str, Any],
    data: str | dict[str, Any] = "synthetic",
    analyses: list[Any] | None = None,
    solver: str | dict[str, Any] | None = None,
    backward: str | dict[str, Any] | None = None,
    init: str | dict[str, Any] | None = None,
    train: dict[str, Any] | None = None,
    dtype: str = "float32",
) -> Any:
    from .run.suite import one_cell_suite

    return one_cell_suite(
        "conformance",
        model=model,
        analyses=analyses or [],
        data=data,
        solver=solver,
        backward=backward,
        init=init,
        train=train,
        device="cpu",
        dtype=dtype,
    )


def check_model(
    name: str,
    *,
    params: dict[str, Any] | None = None,
    in_shape: tuple[int, ...] | None = None,
    num_outputs: int | None = None,
    solver: str | dict[str, Any] | None = None,
    backward: str | dict[str, Any] | None = None,
    init: str | dict[str, Any] | None = None,
) -> None:
    """Check model ``name`` built with ``params`` for inputs of ``in_shape`` (default: the
    factory's defaults) under its declared solver, backward mode and init (or the ones given);
    raise :class:`ConformanceError` if a clause breaks."""
    from .core.registry import models
    from .run.plugin_checks import ContractChecks

    models.get(name)  # an unknown name: UnknownNameError with close matches
    shape, n_out = _factory_shape(name)
    shape = tuple(in_shape) if in_shape is not None else shape
    n_out = int(num_outputs) if num_outputs is not None else n_out
    spec: dict[str, Any] = {"name": name, **(params or {})}
    suite = _cell_suite(model=spec, solver=solver, backward=backward, init=init)
    checks = ContractChecks()
    with _quiet_threads():
        for c in suite.cells:
            checks.solver(c.solver["name"], c.solver_config().options, adjoint=False)
            if c.backward.get("name") == "ift":
                b = c.backward_config()
                checks.solver(b.solver, b.options, adjoint=True)
        checks.model(list(suite.cells), (shape, n_out), "float64")
    lines = [v.line() for v in checks.violations]
    if not lines:
        lines += _backward_lines(name, suite.cells[0], shape, n_out, params or {})
    _raise(lines)


def _backward_lines(
    name: str, cell: Any, shape: tuple[int, ...], n_out: int, params: dict[str, Any]
) -> list[str]:
    """[model.backward]: one loss backpropagated through the model under the cell's solver and
    backward mode (float64, batch 2)."""
    import torch

    from .core import deq
    from .core.registry import inits, models

    who = _who("model", name)
    with _quiet_threads(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = models.create(name, in_shape=shape, num_outputs=n_out, **params).double()
        iname, iparams = cell.init_params()
        with torch.no_grad():
            inits.get(iname)(model, seed=0, **iparams)
        if deq.is_deq(model):
            deq.configure(model, cell.solver_config(), cell.backward_config())
        model.train()
        x = torch.rand(2, *shape, dtype=torch.float64)
        try:
            out = model(x)
            loss = (out.double() ** 2).mean()
            loss.backward()
        except Exception as exc:  # noqa: BLE001 - reported as a violation
            from .run.plugin_checks import _raised

            return [f"{who}: [model.backward] backward of a loss on model(x): {_raised(exc)}"]
    grads = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
    bad = [n for n, g in grads if not bool(torch.isfinite(g).all())]
    if bad:
        return [f"{who}: [model.backward] non-finite gradients of {', '.join(bad[:5])}"]
    if not any(bool(g.abs().max() > 0) for _, g in grads):
        return [f"{who}: [model.backward] no parameter got a nonzero gradient"]
    return []


# -- inits -------------------------------------------------------------------------------------


def check_init(
    name: str,
    *,
    model: str | None = None,
    params: dict[str, Any] | None = None,
    model_params: dict[str, Any] | None = None,
) -> None:
    """Check init ``name`` (with ``params``) on ``model`` (default: the init's
    ``example_model`` attribute, else ``fc_deq_tiny``): validate's [init.call] and
    [init.seeded]; raise :class:`ConformanceError` if a clause breaks."""
    import torch

    from .core.registry import inits, models
    from .run.plugin_checks import ContractChecks

    fn = inits.get(name)
    model = model or getattr(fn, "example_model", None) or "fc_deq_tiny"
    shape, n_out = _factory_shape(model)
    suite = _cell_suite(
        model={"name": model, **(model_params or {})}, init={"name": name, **(params or {})}
    )
    checks = ContractChecks()
    with _quiet_threads():
        checks.model(list(suite.cells), (shape, n_out), "float64")
    lines = [v.line() for v in checks.violations if v.kind == "init"]
    if lines:
        _raise(lines)
    who = _who("init", name)

    def weights(seed: int, global_seed: int) -> dict[str, Any]:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            m = models.create(model, in_shape=shape, num_outputs=n_out, **(model_params or {}))
            torch.manual_seed(global_seed)  # the init must not depend on the global RNG
            with torch.no_grad():
                fn(m, seed=seed, **(params or {}))
        return {k: v.detach().clone() for k, v in m.state_dict().items()}

    with _quiet_threads():
        a, b = weights(0, 1234), weights(0, 4321)
    changed = [k for k in a if not torch.equal(a[k], b[k])]
    if changed:
        lines.append(
            f"{who}: [init.seeded] seed 0 twice gave different {', '.join(changed[:4])} (draw "
            "from a torch.Generator seeded with `seed`, not the global RNG)"
        )
    bad = [k for k, v in a.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        lines.append(f"{who}: [init.seeded] non-finite values in {', '.join(bad[:4])}")
    _raise(lines)


# -- analyses ----------------------------------------------------------------------------------


def analysis_example(name: str) -> dict[str, Any]:
    """The one-cell suite options :func:`check_analysis` runs analysis ``name`` on: its class's
    ``example`` over :data:`DEFAULT_EXAMPLE`."""
    from .core.registry import analyses

    cls = analyses.get(name)
    out = {**DEFAULT_EXAMPLE, **dict(getattr(cls, "example", None) or {})}
    return out


def check_analysis(
    name: str,
    *,
    params: dict[str, Any] | None = None,
    out: str | Path | None = None,
    **example: Any,
) -> None:
    """Run analysis ``name`` (with ``params``) on its example cell (:func:`analysis_example`,
    overridden by ``example``: model, data, solver, backward, init, train) through the runner,
    into ``out`` (default: a temporary folder), and check its rows and plot; raise
    :class:`ConformanceError` if a clause breaks. Seconds on CPU for the built-ins."""
    import pydantic

    from .core.registry import analyses

    who = _who("analysis", name)
    cls = analyses.get(name)
    lines: list[str] = []
    p = getattr(cls, "Params", None)
    if not isinstance(getattr(cls, "version", None), str):
        lines.append(f"{who}: [analysis.params] version is not a string")
    if not (isinstance(p, type) and issubclass(p, pydantic.BaseModel)):
        lines.append(f"{who}: [analysis.params] Params is not a pydantic model")
    else:
        try:
            p(no_such_param_xyz=1)
            lines.append(f"{who}: [analysis.params] Params accepts unknown keys (extra='forbid')")
        except pydantic.ValidationError:
            pass
    _raise(lines)
    opts = {**analysis_example(name), **example}
    aparams = {**dict(opts.pop("params", None) or {}), **(params or {})}
    spec: Any = {name: aparams} if aparams else name
    if out is None:
        with tempfile.TemporaryDirectory(prefix="deqbench-conformance-") as tmp:
            _raise(_run_analysis(name, spec, opts, Path(tmp)))
    else:
        _raise(_run_analysis(name, spec, opts, Path(out)))


def _run_analysis(name: str, spec: Any, opts: dict[str, Any], out: Path) -> list[str]:
    import math as _m

    from .run import plots as plot_registry
    from .run.results import RUNNER, STATUSES, load_results
    from .run.runner import run_suite

    who = _who("analysis", name)
    suite = _cell_suite(analyses=[spec], **opts)
    summary = run_suite(suite, out, progress=False, plots=False, command=["deqbench.testing"])
    df = load_results(summary.run_dir)
    lines: list[str] = []
    runner = df[df.analysis == RUNNER]
    bad = runner[runner.status != "ok"]
    if len(bad):
        notes = "; ".join(str(n) for n in bad.note.fillna("")[:2])
        lines.append(
            f"{who}: [analysis.runs] on {suite.cells[0].id}: task status "
            f"{', '.join(sorted(set(bad.status)))}: {notes}"
        )
    rows = df[df.analysis == name]
    if not len(rows):
        lines.append(f"{who}: [analysis.rows] wrote no row on {suite.cells[0].id}")
        return lines
    odd = sorted(set(rows.status) - set(STATUSES))
    if odd:
        lines.append(f"{who}: [analysis.rows] statuses {odd} are not among {', '.join(STATUSES)}")
    errs = rows[rows.status == "error"]
    if len(errs):
        lines.append(
            f"{who}: [analysis.runs] {len(errs)} error rows, e.g. {errs.metric.iloc[0]}: "
            f"{errs.note.iloc[0]}"
        )
    ok = rows[rows.status == "ok"]
    notes = ok.note.fillna("").astype(str).str.strip()
    nonfinite = [
        m
        for m, v, n in zip(ok.metric, ok.value, notes, strict=True)
        if not _m.isfinite(float(v)) and not n
    ]
    if nonfinite:
        lines.append(
            f"{who}: [analysis.rows] status ok with a non-finite value and no note: "
            f"{', '.join(sorted(set(nonfinite))[:4])} (say why it has no value in the note, or "
            "give the row another status)"
        )
    if name in plot_registry.names():
        try:
            figs = plot_registry.get(name)(df, summary.run_dir)
        except Exception as exc:  # noqa: BLE001 - reported as a violation
            lines.append(f"{who}: [analysis.plot] raised {type(exc).__name__}: {exc}")
        else:
            import matplotlib.pyplot as plt

            if not figs:
                lines.append(f"{who}: [analysis.plot] drew no figure from its rows")
            for fig in figs.values():
                plt.close(fig)
    return lines


def example_context(
    model: str = "fc_deq_tiny",
    data: str | dict[str, Any] | None = None,
    *,
    seed: int = 0,
    dtype: str = "float32",
    **cell: Any,
) -> Any:
    """A :class:`~deqbench.analyses.base.CellContext` for calling an analysis's hooks by hand in
    a test: the model built and initialised as the runner does, the data loaded, on CPU.
    ``cell``: solver, backward, init, train as in a suite's ``defaults``."""
    import torch

    from .analyses.base import CellContext
    from .core import deq
    from .core.registry import inits, models
    from .data.base import load_data

    data = data if data is not None else DEFAULT_EXAMPLE["data"]
    suite = _cell_suite(model=model, data=data, dtype=dtype, **cell)
    c = suite.cells[0]
    dname, dparams = c.data_params()
    bundle = load_data(dname, **dparams).to(dtype=getattr(torch, dtype))
    mname, mparams = c.model_params()
    from .run.task import seed_everything

    seed_everything(seed)
    m = models.create(
        mname, in_shape=tuple(bundle.in_shape), num_outputs=bundle.num_outputs, **mparams
    ).to(dtype=getattr(torch, dtype))
    iname, iparams = c.init_params()
    with torch.no_grad():
        inits.get(iname)(m, seed=seed, **iparams)
    if deq.is_deq(m):
        deq.configure(m, c.solver_config(), c.backward_config())
    deq.set_runtime(m, c.runtime_config())
    return CellContext(
        model=m,
        data=bundle,
        device=torch.device("cpu"),
        dtype=getattr(torch, dtype),
        seed=seed,
        cell_id=c.id,
        cell=c.as_dict(),
    )


# -- datasets ----------------------------------------------------------------------------------


def check_dataset(name: str, **params: Any) -> None:
    """Load dataset ``name`` with ``params`` (the loader's own keyword parameters, e.g.
    ``check_dataset("blobs", dim=16)``) and check the bundle and the shape ``validate`` derives
    without loading; raise :class:`ConformanceError` if a clause breaks. Classification labels
    must be 1-d long tensors in range; regression targets finite floating point, of
    ``num_outputs`` values per sample (flat, or image-shaped ``(N, C, H, W)``)."""
    import torch

    from .core.errors import PluginError
    from .core.registry import datasets
    from .data.base import declared_shape, load_data

    who = _who("dataset", name)
    try:
        d = load_data(name, **params)
    except PluginError as exc:  # an import error, or [dataset.load]: not a DataBundle
        raise ConformanceError([str(exc)]) from exc
    lines: list[str] = []
    shape = tuple(d.in_shape)
    for split in ("train", "test"):
        x, y = getattr(d, split)
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
            lines.append(f"{who}: [dataset.bundle] {split} is not a pair of tensors")
            continue
        if len(x) == 0 or len(x) != len(y):
            lines.append(f"{who}: [dataset.bundle] {split}: {len(x)} inputs, {len(y)} targets")
        if tuple(x.shape[1:]) != shape:
            lines.append(
                f"{who}: [dataset.bundle] {split} x is {tuple(x.shape)}, in_shape says {shape}"
            )
        if not x.is_floating_point() or not bool(torch.isfinite(x).all()):
            lines.append(f"{who}: [dataset.bundle] {split} x is not finite floating point")
        if d.task == "classification":
            if y.dtype != torch.long or y.dim() != 1:
                lines.append(
                    f"{who}: [dataset.bundle] {split} labels are {y.dtype} {tuple(y.shape)}, "
                    "not a 1-d long tensor"
                )
            elif len(y) and not (0 <= int(y.min()) and int(y.max()) < d.num_outputs):
                lines.append(
                    f"{who}: [dataset.bundle] {split} labels span [{int(y.min())}, "
                    f"{int(y.max())}], outside [0, num_outputs={d.num_outputs})"
                )
        else:
            if not y.is_floating_point() or not bool(torch.isfinite(y).all()):
                what = y.dtype if not y.is_floating_point() else "not finite"
                lines.append(
                    f"{who}: [dataset.bundle] {split} regression targets are {what}: they must "
                    "be finite floating point (the squared loss, PSNR and SSIM read them)"
                )
            if y.dim() < 1 or len(y) == 0 or y[0].numel() != d.num_outputs:
                lines.append(
                    f"{who}: [dataset.bundle] {split} targets have "
                    f"{y[0].numel() if len(y) else 0} values, num_outputs says {d.num_outputs}"
                )
    try:
        derived = declared_shape(datasets.get(name), params)
    except Exception as exc:  # noqa: BLE001 - reported as the clause it breaks
        derived = None
        lines.append(
            f"{who}: [dataset.declared] shape({params}) raised {type(exc).__name__}: {exc}"
        )
    if derived is not None and derived != (shape, d.num_outputs):
        lines.append(
            f"{who}: [dataset.shape] the declared shape(params) = {derived}, the loaded data "
            f"has {(shape, d.num_outputs)}"
        )
    _raise(lines)


# -- backward modes ----------------------------------------------------------------------------


def check_backward(
    name: str,
    *,
    options: dict[str, Any] | None = None,
    forward: dict[str, Any] | None = None,
    backward: dict[str, Any] | None = None,
) -> None:
    """Check backward mode ``name`` (with its ``options``; ``forward``: the forward solver's
    ``{name, max_iter, tol, **options}``, default the mode's declared forward or Anderson;
    ``backward``: other :class:`~deqbench.deq.BackwardConfig` fields, e.g. ``k``) on an fc DEQ
    whose cell is a 0.5-contraction, in float64; raise :class:`ConformanceError` if a clause
    breaks. Well under a second for the built-ins."""
    import torch

    from .backward.base import BackwardMode, as_mode
    from .core.deq import BackwardConfig, SolverConfig, configure
    from .core.errors import ConfigError, DeqbenchError
    from .core.registry import backward_modes, models, solvers

    who = _who("backward", name)
    obj = backward_modes.get(name)
    try:
        mode = as_mode(obj, name)
    except DeqbenchError as exc:
        _raise([f"{who}: [backward.class] {exc}"])
    lines: list[str] = []
    if not isinstance(mode, BackwardMode) or not getattr(mode, "name", ""):
        lines.append(f"{who}: [backward.class] no name (set the class attribute name)")
    if mode.Options is not None:
        try:
            BackwardConfig(name, options={"no_such_option_xyz": 1})
            lines.append(
                f"{who}: [backward.options] accepted the unknown option no_such_option_xyz"
            )
        except ConfigError as exc:
            if "no_such_option_xyz" not in str(exc):
                lines.append(
                    f"{who}: [backward.options] the ConfigError for an unknown option does not "
                    f"name it: {exc}"
                )
    if mode.forward is not None and mode.forward not in solvers:
        lines.append(
            f"{who}: [backward.forward] declares the unknown forward solver '{mode.forward}'"
        )
    _raise(lines)
    fwd = dict(forward or {})
    fname = fwd.pop("name", mode.forward or "anderson")
    scfg = SolverConfig(
        fname, int(fwd.pop("max_iter", 100)), float(fwd.pop("tol", 1e-8)), "rel", fwd
    )
    bcfg = BackwardConfig(name, **dict(backward or {}), options=dict(options or {}))
    with _quiet_threads(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = models.create("fc_deq_tiny", in_shape=(12,), num_outputs=3, width=8).double()
        with torch.no_grad():  # a 0.5-contraction (tanh of W z + u): every mode converges
            for p in model.deq.cell.parameters():
                if p.dim() == 2 and p.shape[0] == p.shape[1]:
                    p.mul_(0.5 / torch.linalg.matrix_norm(p, 2))
        if mode.forward is not None and mode.forward != "anderson":
            try:
                configure(model, SolverConfig("anderson"), bcfg)
                lines.append(
                    f"{who}: [backward.forward] a layer with the forward solver anderson was "
                    f"configured, but the mode declares it needs '{mode.forward}'"
                )
            except ConfigError:
                pass
        layer = model.deq
        with torch.no_grad():
            u = model.inject(torch.rand(3, 12, dtype=torch.float64))
        u.requires_grad_()
        R = torch.randn(u.shape, dtype=torch.float64)
        cell_params = [p for p in layer.cell.parameters() if p.requires_grad]
        grads = []
        for cfg in (bcfg, BackwardConfig("ift", solver="anderson", max_iter=200, tol=1e-12)):
            s = scfg if cfg is bcfg else SolverConfig("anderson", 200, 1e-12)
            try:
                configure(model, s, cfg)
                model.train()
                loss = (layer(u) * R).sum()  # a fixed direction: no readout in between
                gs = torch.autograd.grad(loss, [u, *cell_params], allow_unused=True)
            except Exception as exc:  # noqa: BLE001 - reported as a violation
                from .run.plugin_checks import _raised

                _raise([f"{who}: [backward.grad] backward of a loss: {_raised(exc)}"])
            grads.append(gs)
            if cfg is bcfg and layer.last_forward_stats is None:
                lines.append(f"{who}: [backward.grad] no forward stats (layer.last_forward_stats)")
        mine, ref = grads
        if any(g is None for g in mine):
            lines.append(f"{who}: [backward.grad] the input or a cell parameter got no gradient")
        elif not all(bool(torch.isfinite(g).all()) for g in mine):
            lines.append(f"{who}: [backward.grad] a gradient is not finite")
        elif not any(bool(g.abs().max() > 0) for g in mine):
            lines.append(f"{who}: [backward.grad] every gradient is zero")
        else:
            a = torch.cat([g.reshape(-1) for g in mine])
            b = torch.cat([g.reshape(-1) for g in ref])
            cos = float(a @ b) / float(a.norm() * b.norm() + 1e-300)
            if not cos > 0:
                lines.append(
                    f"{who}: [backward.descent] cosine with the IFT gradient {cos:.3g} <= 0"
                )
        configure(model, scfg, bcfg)
        with torch.no_grad():
            z = layer(u.detach())
        if z.shape != u.shape or not bool(torch.isfinite(z).all()):
            lines.append(
                f"{who}: [backward.eval] without grad: shape {tuple(z.shape)} or not finite"
            )
    _raise(lines)


# -- what the project's tests check ------------------------------------------------------------


def conformance_names(kind: str, *, builtin_only: bool = False) -> list[str]:
    """Registered names of ``kind`` (models, solvers, inits, analyses, datasets, backward) to check: a
    model's ``_tiny`` variant stands in for it where one is registered."""
    from .core.registry import BUILTIN, registry

    reg = registry(kind)
    names = [n for n in reg.names() if not builtin_only or reg.origin(n) == BUILTIN]
    if kind == "models":
        names = [n for n in names if f"{n}_tiny" not in names]
    return names
