"""Per-section schemas of a cell and the checks that resolve names against the registries.

Sections: ``model``/``init``/``data`` are ``{name, **params}`` (params checked against the
factory's signature); ``solver`` is :class:`~deqbench.deq.SolverConfig`'s fields plus solver
options (names checked against the solver's ``OPTIONS`` where it declares them, values against
its pydantic ``Options`` model: :func:`deqbench.solvers.base.solver`); ``backward`` is
:class:`~deqbench.deq.BackwardConfig`'s fields plus adjoint solver options; ``train`` is
:class:`~deqbench.run.train.TrainConfig` (unknown keys forbidden); ``runtime`` is
:class:`~deqbench.deq.Runtime` (unknown keys forbidden; a ``compile`` backend name is checked
against ``torch._dynamo.list_backends``). The schemas are generated from those dataclasses so
defaults live in one place.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import sys
import types
from collections.abc import Callable, Iterable
from functools import lru_cache
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictInt,
    ValidationError,
    create_model,
)

from ..core.errors import ConfigError, DeqbenchError
from .matrix import MAX_EPOCHS, MAX_SEED, SECTIONS, Draft
from .yamlio import Locator, did_you_mean, pydantic_lines

RESERVED_MODEL_KWARGS = ("in_shape", "num_outputs")


#: a finite float that accepts an int, never a bool or a string
StrictFloat = Annotated[float, Strict(), Field(allow_inf_nan=False)]


def strict_type(tp: Any) -> Any:
    """``tp`` with its ``int``/``float``/``bool`` parts made strict (no ``true`` for 1, no
    ``'0.02'`` for 0.02) and floats finite, through ``Annotated``, unions and lists."""
    if tp is bool:
        return StrictBool
    if tp is int:
        return StrictInt
    if tp is float:
        return StrictFloat
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        return Annotated[(strict_type(args[0]), *tp.__metadata__)]  # type: ignore[valid-type]
    if origin in (Union, types.UnionType):
        return Union[tuple(strict_type(a) for a in args)]  # noqa: UP007
    if origin is list and len(args) == 1:
        return list[strict_type(args[0])]  # type: ignore[misc]
    return tp


def _from_dataclass(
    name: str, dc: type, extra: Literal["allow", "forbid"], override: dict[str, Any]
) -> type[BaseModel]:
    hints = get_type_hints(dc)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(dc):
        if f.name == "options":
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = ...
        fields[f.name] = (strict_type(override.get(f.name, hints[f.name])), default)
    return create_model(name, __config__=ConfigDict(extra=extra), **fields)  # type: ignore[call-overload,no-any-return]


@lru_cache(maxsize=1)
def specs() -> dict[str, type[BaseModel]]:
    """Section -> pydantic model."""
    from ..core.deq import AMP_MODES, GRAPH_MODES, BackwardConfig, Runtime, SolverConfig
    from .train import TrainConfig

    pos = Annotated[int, Field(gt=0)]
    nonneg = Annotated[int, Field(ge=0)]
    posf = Annotated[float, Field(gt=0)]
    stop = Literal["rel", "abs"]
    allow = ConfigDict(extra="allow")
    return {
        "model": create_model("ModelSpec", __config__=allow, name=(str, ...)),
        "init": create_model("InitSpec", __config__=allow, name=(str, "default")),
        "data": create_model("DataSpec", __config__=allow, name=(str, ...)),
        "solver": _from_dataclass(
            "SolverSpec", SolverConfig, "allow", {"max_iter": pos, "tol": posf, "stop_mode": stop}
        ),
        "backward": _from_dataclass(
            "BackwardSpec",
            BackwardConfig,
            "allow",
            {
                "max_iter": pos,
                "tol": posf,
                "stop_mode": stop,
                "k": pos,
                "refine": nonneg,
                "tau": Annotated[float, Field(gt=0, le=1)],
                "b_init": Literal["grad", "zeros"],
                "second_order": Literal["implicit", "refine"],
            },
        ),
        "train": _from_dataclass(
            "TrainSpec",
            TrainConfig,
            "forbid",
            {
                "epochs": nonneg,
                "batch_size": pos,
                "eval_batch_size": pos,
                "optimizer": Literal["adam", "adamw", "sgd"],
                "schedule": Literal["step", "multistep", "cosine", "none"] | None,
                "lr": Annotated[float, Field(ge=0)],
                "max_steps": pos | None,
                "lr_milestone_steps": list[pos],
                "grad_clip": posf | None,
                "step_size": pos,
            },
        ),
        "runtime": _from_dataclass(
            "RuntimeSpec",
            Runtime,
            "forbid",
            {
                # YAML 1.1 reads an unquoted off/on as false/true
                "cuda_graph": Annotated[
                    Literal[GRAPH_MODES],  # type: ignore[valid-type]
                    BeforeValidator(lambda v: {False: "off", True: "auto"}.get(v, v)),
                ],
                "amp": Literal[AMP_MODES],  # type: ignore[valid-type]
                "compile": Annotated[bool | str, BeforeValidator(_compile_value)],
                "compile_mode": Literal[COMPILE_MODES] | None,  # type: ignore[valid-type]
            },
        ),
    }


def _compile_value(v: Any) -> Any:
    if isinstance(v, bool) or (isinstance(v, str) and v):
        return v
    raise ValueError(f"expected true, false or a torch.compile backend name (got {v!r})")


#: ``torch.compile``'s modes (``runtime.compile_mode``)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def runtime_defaults() -> dict[str, Any]:
    """The ``runtime`` section's defaults (key -> value), e.g. ``amp: none``."""
    return {k: f.default for k, f in specs()["runtime"].model_fields.items()}


def compile_backends() -> list[str]:
    """The ``torch.compile`` backends this torch knows (``runtime.compile``)."""
    import torch._dynamo

    return sorted(torch._dynamo.list_backends(exclude_tags=()))


def default_names() -> dict[str, str]:
    """Section -> the name used when a suite sets none (``solver: anderson``, ``backward: ift``)."""
    out = {}
    for s, m in specs().items():
        f = m.model_fields.get("name")
        if f is not None and isinstance(f.default, str):
            out[s] = f.default
    return out


def generic_fields() -> dict[str, set[str]]:
    """Section -> declared fields, kept when a matrix axis changes the section's name."""
    return {s: set(m.model_fields) for s, m in specs().items()}


def solver_options(fn: Any) -> set[str] | None:
    """The options a solver declares (``fn.OPTIONS`` or its module's ``OPTIONS``), else None."""
    opts = getattr(fn, "OPTIONS", None)
    if opts is None:
        opts = getattr(sys.modules.get(getattr(fn, "__module__", ""), None), "OPTIONS", None)
    return set(opts) if opts is not None else None


def _check_solver_values(ck: _Checker, section: str, fn: Any, params: dict[str, Any]) -> None:
    """The values of a solver's options, checked once here with the pydantic options model it
    declares (:func:`deqbench.solvers.base.solver`), so a suite fails before anything runs."""
    from ..solvers.base import option_problems, solver_options_model

    model = solver_options_model(fn) if fn is not None else None
    if model is not None:
        for key, msg in option_problems(model, params):
            ck.add(section, key or None, msg)


def _check_stop(
    ck: _Checker, section: str, fn: Any, name: str, params: dict[str, Any], opts: set[str]
) -> dict[str, Any]:
    """The stop rule (solver option ``stop``) of a solver that does not declare it: a solver
    declared with :func:`deqbench.solvers.base.solver` takes ``sample_max`` (its own rule) and
    refuses another; a plugin solver that lists its options refuses any (it stops by its own
    rule). Returns ``params`` without ``stop`` for the unknown-key check."""
    if "stop" not in params or "stop" in opts:
        return params
    from ..solvers.base import STOP_RULES, solver_options_model, stop_problem

    if solver_options_model(fn) is not None:
        msg = stop_problem(name, opts, params["stop"])
    else:
        msg = (
            f"solver '{name}' does not take a stop rule (it stops by its own rule); the rules "
            f"{', '.join(STOP_RULES)} are honoured by the solvers built on deqbench's Tracker"
        )
    if msg is not None:
        ck.add(section, "stop", msg)
    return {k: v for k, v in params.items() if k != "stop"}


class _Checker:
    """Collects error lines for one cell; paths resolve through the draft's provenance."""

    def __init__(self, draft: Draft, loc: Locator, errors: list[str]) -> None:
        self.d, self.loc, self.errors = draft, loc, errors

    def path(self, section: str, key: Any = None, rest: tuple[Any, ...] = ()) -> tuple[Any, ...]:
        src = self.d.src.get(section, {})
        if key is not None and key in src:
            return (*src[key], *rest)
        return self.d.block.get(section, (section,))

    def add(self, section: str, key: Any, msg: str, prefer_key: bool = False) -> None:
        self.errors.append(self.loc.error(self.path(section, key), msg, prefer_key))

    def lookup(self, section: str, key: str, registry: Any, name: str) -> Any:
        try:
            if name not in registry:
                self.add(section, key, str(registry.unknown(name)))
                return None
            return registry.get(name)
        except DeqbenchError as exc:
            self.add(section, key, str(exc))
            return None

    def kwargs(
        self,
        section: str,
        fn: Callable[..., Any] | None,
        params: dict[str, Any],
        what: str,
        skip: tuple[str, ...] = (),
        allowed: Iterable[str] | None = None,
    ) -> None:
        if fn is None:
            return
        if allowed is None:
            try:
                sig = inspect.signature(fn)
            except (TypeError, ValueError):
                return
            if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
                return
            allowed = [n for n in sig.parameters if n not in skip]
        names = sorted(set(allowed) - set(RESERVED_MODEL_KWARGS if section == "model" else ()))
        generic = sorted(specs()[section].model_fields)
        for k in params:
            if section == "model" and k in RESERVED_MODEL_KWARGS:
                self.add(section, k, "is filled in from the dataset; remove it", True)
            elif k not in names:
                hint = did_you_mean(k, names + generic)
                self.add(
                    section,
                    k,
                    f"unknown key{hint}; {what} accepts: "
                    f"{', '.join(names + [g for g in generic if g != 'name']) or 'nothing'}",
                    True,
                )


def _kind(tp: Any) -> tuple[str | None, bool]:
    """(``"bool"``, ``"int"``, ``"float"`` or None, whether None is allowed) of an annotation."""
    if get_origin(tp) is Annotated:
        tp = get_args(tp)[0]
    args = set(get_args(tp)) if get_origin(tp) in (Union, types.UnionType) else {tp}
    optional = type(None) in args
    args.discard(type(None))
    if args == {bool}:
        return "bool", optional
    if args == {int}:
        return "int", optional
    if args and args <= {int, float}:
        return "float", optional
    return None, optional


def value_problem(kind: str | None, value: Any, optional: bool = True) -> str | None:
    """Why ``value`` is not a strict ``kind`` (no bool for a number, no string for either; a
    float finite), or None."""
    if kind is None or (value is None and optional):
        return None
    if kind == "bool":
        return None if isinstance(value, bool) else "expected true or false"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "expected an integer" if kind == "int" else "expected a number"
    if kind == "int" and not isinstance(value, int):
        return "expected an integer"
    if isinstance(value, float) and not math.isfinite(value):
        return "expected a finite number"
    return None


def _hints(fn: Any) -> dict[str, Any]:
    """The resolved annotations of a factory's parameters, or {} where they cannot be read."""
    try:
        target = fn.__init__ if inspect.isclass(fn) else fn
        return dict(get_type_hints(target))
    except Exception:  # noqa: BLE001 - a plugin's annotations may not resolve; skip the check
        return {}


#: Data keys that many datasets take, bounded wherever a dataset takes them:
#: key -> (kind, allowed, message). ``None`` is allowed only for the subsets (all examples).
DATA_KEYS: dict[str, tuple[str, Callable[[Any], bool], str]] = {
    "split": ("float", lambda v: 0 < v < 1, "the train fraction must be in (0, 1)"),
    "train_subset": ("int", lambda v: v >= 1, "must be at least 1 (or null: every example)"),
    "test_subset": ("int", lambda v: v >= 1, "must be at least 1 (or null: every example)"),
    "seed": ("int", lambda v: 0 <= v <= MAX_SEED, "must be in [0, 2**63)"),
    "noise": ("float", lambda v: v >= 0, "must be >= 0"),
}


def _check_values(ck: _Checker, section: str, fn: Any, params: dict[str, Any]) -> None:
    """Strict types of the params a factory annotates (int, float, bool); the bounds of
    :data:`DATA_KEYS` for a dataset."""
    hints = _hints(fn) if fn is not None else {}
    for k, v in params.items():
        kind, optional = _kind(hints[k]) if k in hints else (None, True)
        if section == "data" and k in DATA_KEYS:
            kind, ok, msg = DATA_KEYS[k]
            optional = k.endswith("_subset")
            problem = value_problem(kind, v, optional)
            if problem is None and v is not None and not ok(v):
                problem = msg
        else:
            problem = value_problem(kind, v, optional)
        if problem:
            ck.add(section, k, f"{problem} (got {v!r})")


def check_cell(
    draft: Draft, loc: Locator, errors: list[str], dtype: str = "float32", caps: bool = True
):
    """Validate one expanded cell; append error lines; return its validated sections
    (``{section: mapping}`` for every section, from which :mod:`deqbench.run.suite` builds the
    :class:`~deqbench.run.suite.Cell`), or None when it has errors. ``dtype``: the suite's
    (``runtime.amp: bf16`` needs float32); ``caps``: refuse more than
    :data:`~deqbench.run.matrix.MAX_EPOCHS` epochs."""
    from ..core.registry import backward_modes, datasets, inits, models, solvers

    ck = _Checker(draft, loc, errors)
    n0 = len(errors)
    values: dict[str, dict[str, Any]] = {}
    extras: dict[str, dict[str, Any]] = {}
    for s in SECTIONS:
        raw = draft.sections.get(s, {})
        if s in ("model", "data") and "name" not in raw:
            where = "data" if s == "data" else "defaults.model"
            ck.add(s, None, f"no {s} name: set {where} or a matrix axis '{s}'")
            continue
        try:
            m = specs()[s].model_validate(raw)
        except ValidationError as exc:
            fields = list(specs()[s].model_fields)

            def to_path(w: tuple[Any, ...], s: str = s) -> tuple[Any, ...]:
                known = w[0] in draft.src.get(s, {})
                return ck.path(s, w[0], w[1:]) if known else (*ck.path(s), *w)

            errors += pydantic_lines(exc, loc, to_path, fields)
            continue
        extras[s] = dict(m.model_extra or {})
        values[s] = {**m.model_dump(exclude=set(extras[s])), **extras[s]}

    if "train" in values and caps and values["train"]["epochs"] > MAX_EPOCHS:
        ck.add(
            "train",
            "epochs",
            f"{values['train']['epochs']} epochs is over the cap of {MAX_EPOCHS} (caps: false "
            "in the suite, or --set caps=false, lifts it)",
        )
    if "train" in values:
        from .train import schedule_problem

        tr = values["train"]
        if why := schedule_problem(tr["schedule"], tr["lr_milestone_steps"]):
            ck.add("train", "lr_milestone_steps", why.removeprefix("train.lr_milestone_steps "))
    if "model" in values:
        name = values["model"]["name"]
        fn = ck.lookup("model", "name", models, name)
        ck.kwargs("model", fn, extras["model"], f"model '{name}'")
        _check_values(ck, "model", fn, extras["model"])
    if "init" in values:
        name = values["init"]["name"]
        fn = ck.lookup("init", "name", inits, name)
        ck.kwargs("init", fn, extras["init"], f"init '{name}'", skip=("model", "seed"))
        _check_values(ck, "init", fn, extras["init"])
    if "solver" in values:
        name = values["solver"]["name"]
        fn = ck.lookup("solver", "name", solvers, name)
        if fn is not None and (opts := solver_options(fn)) is not None:
            params = _check_stop(ck, "solver", fn, name, extras["solver"], opts)
            ck.kwargs("solver", fn, params, f"solver '{name}'", allowed=opts)
        _check_solver_values(ck, "solver", fn, extras["solver"])
        _check_values(ck, "solver", fn, extras["solver"])
    if "backward" in values:
        bw = values["backward"]
        mode = None
        if bw["name"] not in backward_modes:
            known = backward_modes.names()
            ck.add(
                "backward",
                "name",
                f"unknown backward mode '{bw['name']}'"
                + did_you_mean(bw["name"], known)
                + f"; modes: {', '.join(known)} (deqbench ls backward)",
            )
        else:
            mode = ck.lookup("backward", "name", backward_modes, bw["name"])
        if mode is not None:
            from ..backward.base import as_mode, forward_problem, option_problems

            try:
                mode = as_mode(mode, bw["name"])
            except DeqbenchError as exc:
                ck.add("backward", "name", str(exc))
                mode = None
        fn = ck.lookup("backward", "solver", solvers, bw["solver"])
        if mode is not None and mode.Options is not None and not mode.adjoint_solver:
            # the extra keys are the mode's own options (shine: refine_steps, ...)
            for line in option_problems(mode, extras["backward"]):
                key, _, msg = line.partition(": ")
                ck.add("backward", key if key in extras["backward"] else None, msg, True)
        else:  # the adjoint solver's options (ift; modes without options of their own)
            if fn is not None and (opts := solver_options(fn)) is not None:
                what = f"adjoint solver '{bw['solver']}'"
                params = _check_stop(ck, "backward", fn, bw["solver"], extras["backward"], opts)
                ck.kwargs("backward", fn, params, what, allowed=opts)
            _check_solver_values(ck, "backward", fn, extras["backward"])
        if mode is not None and "solver" in values:
            why = forward_problem(mode, values["solver"]["name"])
            if why:
                ck.add("backward", "name", why)
    if "data" in values:
        name = values["data"]["name"]
        if name not in datasets:
            ck.add("data", "name", str(datasets.unknown(name)))
        else:
            try:
                fn = datasets.get(name)
            except DeqbenchError:  # a plugin that fails to import: [dataset.import], reported
                fn = None  # by the contract checks (deqbench.run.plugin_checks)
            ck.kwargs("data", fn, extras["data"], f"dataset '{name}'")
            _check_values(ck, "data", fn, extras["data"])
    if "runtime" in values:
        _check_runtime(ck, values["runtime"], dtype)
    if len(errors) > n0:
        return None
    return {s: values[s] for s in SECTIONS}


def _check_runtime(ck: _Checker, rt: dict[str, Any], dtype: str) -> None:
    """What the ``runtime`` schema cannot say alone: a known compile backend, a compile mode
    only with compile, bf16 autocast only over float32."""
    backend = rt["compile"]
    if isinstance(backend, str):
        names = compile_backends()
        if backend not in names:
            ck.add(
                "runtime",
                "compile",
                f"unknown torch.compile backend '{backend}'{did_you_mean(backend, names)}; "
                "use true (inductor), false or one of: "
                + ", ".join(n for n in names if "TESTING" not in n and "minifier" not in n),
            )
    if rt["compile_mode"] is not None and rt["compile"] is False:
        ck.add(
            "runtime",
            "compile_mode",
            "is a torch.compile mode: set runtime.compile too (true or a backend)",
        )
    if rt["amp"] != "none" and dtype != "float32":
        ck.add(
            "runtime",
            "amp",
            f"{rt['amp']} autocast needs dtype float32 (the suite's dtype is {dtype}): "
            "set dtype: float32 or runtime.amp: none",
        )


def check_analyses(
    entries: list[Any], loc: Locator
) -> tuple[list[tuple[str, dict[str, Any]]], list[str]]:
    """Resolve ``analyses:`` entries (``name`` or ``{name: {params}}``); validate their Params."""
    from ..core.registry import analyses as registry

    out: list[tuple[str, dict[str, Any]]] = []
    errors: list[str] = []
    for i, e in enumerate(entries):
        path: tuple[Any, ...] = ("analyses", i)
        params: Any
        if isinstance(e, str):
            name, params = e, {}
        elif isinstance(e, dict) and len(e) == 1:
            name, params = next(iter(e.items()))
            path = (*path, name)
            params = {} if params is None else params
            if not isinstance(params, dict):
                errors.append(loc.error(path, "analysis params must be a mapping"))
                continue
        else:
            errors.append(loc.error(path, "expected an analysis name or {name: {params}}"))
            continue
        if any(n == name for n, _ in out):
            errors.append(loc.error(path, f"analysis '{name}' listed twice"))
            continue
        try:
            if name not in registry:
                errors.append(loc.error(path, str(registry.unknown(name))))
                continue
            cls = registry.get(name)
        except DeqbenchError as exc:
            errors.append(loc.error(path, str(exc)))
            continue
        P = getattr(cls, "Params", None)
        if P is not None:
            bad = []
            for k, v in params.items():
                if k in P.model_fields:
                    kind, optional = _kind(P.model_fields[k].annotation)
                    if problem := value_problem(kind, v, optional):
                        bad.append(loc.error((*path, k), f"{problem} (got {v!r})"))
            if bad:
                errors += bad
                continue
            try:
                P.model_validate(params)
            except ValidationError as exc:
                errors += pydantic_lines(exc, loc, path, list(P.model_fields))
                continue
        bad = [
            loc.error((*path, k), problem)
            for k in WEIGHT_FILES
            if isinstance(params.get(k), str)
            and params[k]
            and (problem := weights_file_problem(params[k]))
        ]
        if bad:
            errors += bad
            continue
        out.append((name, dict(params)))
    return out, errors


#: Analysis params naming a file that is loaded with ``torch.load(weights_only=True)``
#: (``landscape``/``hessian`` ``checkpoint``, ``landscape`` ``directions``): checked, and a
#: pickled one refused, before anything runs.
WEIGHT_FILES = ("checkpoint", "directions")


def weights_file_problem(path: str) -> str | None:
    """Why the file at ``path`` cannot be loaded with ``torch.load(weights_only=True)``, or
    None (the file is read once here, on the CPU)."""
    from ..core.tensor_files import load_tensors

    try:
        load_tensors(path, "x")
    except ConfigError as exc:
        return str(exc).removeprefix("x: ")
    return None
