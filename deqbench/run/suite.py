"""Suite YAML: schema (pydantic v2), ``FILE:LINE:COL`` errors, name resolution, cells.

A suite file (DESIGN.md "Suite YAML")::

    schema: 1
    name: smoke
    device: cuda_if_available  # (the default) | auto (per cell: GPU or CPU cores,
                            # deqbench.run.placement) | cpu | cuda | cuda:1
    dtype: float32          # float32 | float64
    seeds: [0, 1]
    data: {name: digits, train_subset: 256}
    defaults:
      model: {name: conv_deq_tiny}
      init: default
      solver: {name: anderson, max_iter: 50, tol: 1.0e-4}
      backward: {name: ift, max_iter: 50, tol: 1.0e-6}
      train: {epochs: 2, batch_size: 64}
      runtime: {amp: none}  # cuda_graph, amp, compile, compile_mode (deqbench.deq.Runtime)
    matrix:                 # cartesian product -> cells; a string means {name: ...}
      solver: [fixed_point, anderson]
      backward.k: [5, 10]   # dotted keys set one field
      runtime.amp: [none, bf16]
    analyses: [metrics, solver_stats]
    output: results/

Everything is checked before anything runs: unknown keys (with "did you mean"), types, registry
names (models, solvers, inits, analyses, datasets, backward modes), model factory kwargs
(``inspect.signature``), solver options, analysis ``Params``, the ``runtime`` section, the
device. Every problem is one line ``FILE:LINE:COL: dotted.path: message``; all of them are
raised together as a :class:`~deqbench.errors.ConfigError`. ``--set runtime.KEY=VALUE`` is
short for ``--set defaults.runtime.KEY=VALUE``.

Example:
    >>> import deqbench
    >>> suite = deqbench.load_suite("suites/smoke.yaml", overrides=["defaults.train.epochs=1"])  # doctest: +SKIP
    >>> [c.id for c in suite.cells][:2]                                        # doctest: +SKIP
    ['fc_deq_tiny-fixed_point-ift', 'fc_deq_tiny-fixed_point-unrolled']
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    field_validator,
)

from ..core.errors import ConfigError
from .matrix import (
    MAX_EPOCHS,
    MAX_SEED,
    MAX_TASKS,
    NAMED,
    SECTIONS,
    check_matrix,
    check_size,
    expand,
    normalize_section,
)
from .paper import PaperBlock
from .yamlio import Locator, apply_overrides, pydantic_lines, read_yaml

__all__ = [
    "Cell",
    "Suite",
    "load_suite",
    "load_suites",
    "suite_from_dict",
    "one_cell_suite",
    "apply_overrides",
    "format_cells",
    "MAX_EPOCHS",
    "MAX_SEED",
    "MAX_TASKS",
]

#: a seed: an integer in [0, 2**63) (it names files and goes to torch.manual_seed)
Seed = Annotated[StrictInt, Field(ge=0, le=MAX_SEED)]


#: Optional top-level keys that set torch's numeric flags for the run (``None``: PyTorch's default).
NUMERIC_FLAGS = ("tf32", "cudnn_benchmark", "deterministic")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


def plain_name(name: str) -> str:
    """``name`` when it can name a folder of its own under the results folder: letters, digits,
    ``_ . -`` and not only dots (``.`` would drop the suite's folder, ``..`` climb out of the
    results folder); else ValueError (pydantic's validators turn it into a located line)."""
    if not name.strip("."):
        raise ValueError(
            f"{name!r} is not a folder name of its own (the run directory goes to "
            "OUTPUT/NAME/RUN_ID): use letters, digits, _ . - and not only dots"
        )
    return name


class Defaults(_Strict):
    model: Any = None
    init: Any = None
    solver: Any = None
    backward: Any = None
    train: Any = None
    runtime: Any = None


class SuiteFile(_Strict):
    """Top level of a suite file (sections are checked per cell, see :mod:`deqbench.run.specs`)."""

    schema_: Literal[1] = Field(1, alias="schema")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    description: str = ""
    # cuda_if_available | auto (each cell on the GPU or on CPU cores, the faster, measured) |
    # cpu | cuda | cuda:N
    device: str = "cuda_if_available"
    dtype: Literal["float32", "float64"] = "float32"
    seeds: list[Seed] = Field(default_factory=lambda: [0], min_length=1)
    threads: Annotated[StrictInt, Field(ge=1, le=4096)] | None = None
    tf32: StrictBool | None = None
    cudnn_benchmark: StrictBool | None = None
    deterministic: StrictBool | None = None
    caps: StrictBool = True  # false lifts MAX_EPOCHS and MAX_TASKS
    data: Any
    defaults: Defaults = Field(default_factory=Defaults)
    matrix: dict[str, list[Any]] | None = None
    analyses: list[Any] = Field(default_factory=list)
    output: str = "results"
    paper: PaperBlock | None = None  # the paper the suite reproduces (deqbench.run.paper)
    #: keep only the matrix cells whose id matches one of these shell patterns (``pcdeq_l-*``):
    #: a part of a grid, e.g. ``--set select=pcdeq_l-*``; recorded in the run's suite.yaml
    select: list[str] | None = None

    @field_validator("select", mode="before")
    @classmethod
    def _one_pattern(cls, v: Any) -> Any:
        # a string is comma-separated patterns; brackets are allowed (``[a*, *b]``: YAML reads
        # ``*b`` as an alias, so --set hands such a list over as text)
        if isinstance(v, str):
            return [p.strip() for p in v.strip().strip("[]").split(",") if p.strip()]
        return v

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        return plain_name(v)

    @field_validator("seeds", mode="before")
    @classmethod
    def _one_seed(cls, v: Any) -> Any:
        return [v] if isinstance(v, int) and not isinstance(v, bool) else v

    @field_validator("seeds")
    @classmethod
    def _unique_seeds(cls, v: list[int]) -> list[int]:
        twice = sorted(s for s, n in Counter(v).items() if n > 1)
        if twice:
            raise ValueError(
                f"seed {', '.join(map(str, twice))} listed twice: every seed runs once"
            )
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not re.fullmatch(r"cuda_if_available|auto|cpu|mps|cuda(:\d+)?", v):
            raise ValueError(
                f"device must be cuda_if_available, auto, cpu, cuda or cuda:N, got {v!r}"
            )
        return v


@dataclass
class Cell:
    """One configuration of the matrix. Plain dicts, picklable.

    ``model``/``init``/``data``: ``{name, **params}``; ``solver``: ``{name, max_iter, tol,
    stop_mode, **options}``; ``backward``: BackwardConfig fields plus adjoint solver options;
    ``train``: TrainConfig fields; ``runtime``: :class:`~deqbench.deq.Runtime` fields (all of
    them once validated; empty means the defaults).
    """

    id: str
    model: dict[str, Any]
    init: dict[str, Any]
    solver: dict[str, Any]
    backward: dict[str, Any]
    train: dict[str, Any]
    data: dict[str, Any]
    runtime: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {s: copy.deepcopy(getattr(self, s)) for s in SECTIONS}

    @staticmethod
    def _split(d: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        rest = dict(d)
        return rest.pop("name"), rest

    def model_params(self) -> tuple[str, dict[str, Any]]:
        return self._split(self.model)

    def init_params(self) -> tuple[str, dict[str, Any]]:
        return self._split(self.init)

    def data_params(self) -> tuple[str, dict[str, Any]]:
        return self._split(self.data)

    def solver_config(self) -> Any:
        from ..core.config import to_dataclass

        return to_dataclass("solver", self.solver)

    def backward_config(self) -> Any:
        from ..core.config import to_dataclass

        return to_dataclass("backward", self.backward)

    def train_config(self) -> Any:
        from .train import TrainConfig

        return TrainConfig(**self.train)

    def runtime_config(self) -> Any:
        """The cell's :class:`~deqbench.deq.Runtime`."""
        from ..core.deq import Runtime

        return Runtime(**self.runtime)

    def runtime_changes(self) -> dict[str, Any]:
        """The runtime keys whose values differ from the defaults (``{}``: default runtime)."""
        from .specs import runtime_defaults

        d = runtime_defaults()
        return {k: v for k, v in self.runtime.items() if k not in d or v != d[k]}


@dataclass
class Suite:
    """A validated suite: cells x seeds, analyses, device, output."""

    name: str
    cells: list[Cell]
    analyses: list[tuple[str, dict[str, Any]]]
    seeds: list[int]
    device: str  # as requested (cuda_if_available | auto | cpu | cuda[:i])
    dtype: str = "float32"
    threads: int | None = None
    description: str = ""
    output: str = "results"
    source: str = "<dict>"
    resolved: dict[str, Any] = field(default_factory=dict)
    tf32: bool | None = None  # TF32 for matmul and cuDNN; None keeps PyTorch's defaults
    cudnn_benchmark: bool | None = None  # None keeps PyTorch's default
    deterministic: bool | None = None  # deterministic algorithms (bitwise repeatable runs)
    #: warnings about how the suite was loaded (``--set defaults.X`` that cells override), one
    #: line each; the CLI prints them
    notes: list[str] = field(default_factory=list)
    #: the suite's ``paper:`` block as a dict (:class:`deqbench.run.paper.PaperBlock`), or
    #: None; not part of :attr:`hash` (it describes, it does not change what runs)
    paper: dict[str, Any] | None = None

    def numeric_flags(self) -> dict[str, bool]:
        """The torch numeric flags this suite sets (``tf32``, ``cudnn_benchmark``,
        ``deterministic``; unset ones are left at PyTorch's defaults)."""
        return {k: v for k in NUMERIC_FLAGS if (v := getattr(self, k)) is not None}

    @property
    def hash(self) -> str:
        """Hash of what the suite runs (cells, seeds, analyses, device, dtype, threads, numeric
        flags; not its
        output folder or wording): ``--resume`` checks it."""
        body = {
            "name": self.name, "seeds": self.seeds, "analyses": self.analyses, "device": self.device,
            "dtype": self.dtype, "threads": self.threads,
            "cells": [_hashed(c) for c in self.cells],
            **self.numeric_flags(),  # only when set, so older runs keep their hash
        }  # fmt: skip
        text = json.dumps(body, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def resolved_device(self) -> str:
        from .env import resolve_device

        return resolve_device(self.device)

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.resolved, sort_keys=False, default_flow_style=None)


def _hashed(cell: Cell) -> dict[str, Any]:
    """A cell as :attr:`Suite.hash` sees it: the runtime and ``train.precise_bn`` only where
    they are not the default (so that runs made before them keep their hash)."""
    d = {"id": cell.id, **cell.as_dict()}
    del d["runtime"]
    if not d["train"].get("precise_bn", False):  # a later field: only where set
        d["train"].pop("precise_bn", None)
    if not d["train"].get("lr_milestone_steps"):  # likewise
        d["train"].pop("lr_milestone_steps", None)
    if not d["train"].get("capture", False):  # a later field: only where set
        d["train"].pop("capture", None)
    d["train"].pop("checkpoint_every", None)  # how a run saves, not what it computes
    if changes := cell.runtime_changes():
        d["runtime"] = changes
    return d


#: ``--set`` keys that are short for a longer path (``runtime.amp`` -> ``defaults.runtime.amp``)
OVERRIDE_ALIASES = {"runtime": ("defaults", "runtime")}


def _set_top(raw: dict[str, Any], loc: Locator, key: str, value: Any, label: str) -> None:
    raw[key] = value
    loc.overridden[(key,)] = label


#: folders of virtual file systems, never a results folder
VIRTUAL_ROOTS = ("/proc", "/sys", "/dev")


def output_problem(output: str, suite: str) -> str | None:
    """Why runs of ``suite`` cannot go under the results folder ``output`` (an existing file on
    the way, a virtual file system, a read-only folder), or None. Writes nothing; a file system
    that refuses only when written to is caught by :func:`make_output_root`."""
    target = Path(output).expanduser() / suite
    try:
        resolved = target.resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop
        return f"cannot resolve {target}: {exc}"
    for root in VIRTUAL_ROOTS:
        if resolved == Path(root) or Path(root) in resolved.parents:
            return f"{output} is under {root}, not a place for results: choose a folder on disk"
    p = target
    while not p.exists():
        if p.parent == p:
            return None
        p = p.parent
    if not p.is_dir():
        what = "the results folder" if p == Path(output).expanduser() else "on the results path"
        return f"{p} is an existing file ({what}), not a folder"
    if not os.access(p, os.W_OK | os.X_OK):
        return f"{p} is not writable (read-only or no permission): choose another results folder"
    return None


def make_output_root(output: str | Path, suite: str) -> None:
    """Create ``output/<suite>``, where the run directory goes, or raise a one-line
    :class:`ConfigError` (nothing else written) when the file system refuses or ``suite`` is
    not one folder name (:func:`deqbench.run.results.suite_folder`)."""
    from .results import suite_folder

    base = Path(output) / suite_folder(suite)
    try:
        base.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise ConfigError(f"{output}: cannot create the results folder {base}: {why}") from None


# -- loading -------------------------------------------------------------------------------


def load_suite(
    path: str | Path,
    *,
    overrides: Sequence[str] = (),
    device: str | None = None,
    seeds: Sequence[int] | None = None,
    output: str | None = None,
) -> Suite:
    """Read, override and validate a suite file.

    Args:
        path: the YAML file.
        overrides: ``KEY=VALUE`` strings with dotted keys (``defaults.train.epochs=1``: the
            default, which cells that set the key keep overriding, named in ``Suite.notes``;
            ``all.train.epochs=1``: every cell, :mod:`deqbench.run.overrides`).
        device, seeds, output: replace the suite's fields (the CLI's ``--device`` etc.).

    Raises:
        ConfigError: every problem, one ``FILE:LINE:COL: path: message`` line each.
    """
    raw, loc = read_yaml(path)
    if isinstance(raw, dict) and "suites" in raw:
        raise ConfigError(
            f"{loc.where(('suites',), prefer_key=True)}: {path} is a collection of suites "
            "(suites: [...]): load it with load_suites(), or run it with `deqbench run`"
        )
    return _from_raw(raw, loc, overrides, device, seeds, output)


class CollectionFile(_Strict):
    """A collection of suites: ``deqbench run`` runs them one after another, each into its own
    run directory (``out/<suite>/<run_id>``), with the same overrides."""

    schema_: Literal[1] = Field(1, alias="schema")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    description: str = ""
    suites: list[str] = Field(min_length=1)

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        return plain_name(v)


def load_suites(
    path: str | Path,
    *,
    overrides: Sequence[str] = (),
    device: str | None = None,
    seeds: Sequence[int] | None = None,
    output: str | None = None,
) -> list[Suite]:
    """The suites of a file: one for a suite file; every member, in order, for a collection
    file (``suites: [a.yaml, b.yaml]``, paths relative to the collection file), each loaded by
    :func:`load_suite` with the same overrides. All members are checked before anything runs;
    their problems are raised together.

    Example:
        >>> [s.name for s in load_suites("suites/kglm.yaml")]                  # doctest: +SKIP
        ['kglm_klr', 'kglm_smooth', 'kglm_denoise', 'kglm_init_cost', 'kglm_pcdeq_sigma']
    """
    raw, loc = read_yaml(path)
    if not (isinstance(raw, dict) and "suites" in raw):
        return [_from_raw(raw, loc, overrides, device, seeds, output)]
    try:
        top = CollectionFile.model_validate(raw)
    except ValidationError as exc:
        keys = [f.alias or n for n, f in CollectionFile.model_fields.items()]
        raise ConfigError("\n".join(pydantic_lines(exc, loc, (), keys))) from None
    base = Path(path).parent
    suites: list[Suite] = []
    errors: list[str] = []
    for i, member in enumerate(top.suites):
        target = base / member
        if target.resolve() == Path(path).resolve():
            errors.append(f"{loc.where(('suites', i))}: suites[{i}]: {member} is this file")
            continue
        try:
            suites.append(
                load_suite(target, overrides=overrides, device=device, seeds=seeds, output=output)
            )
        except ConfigError as exc:
            errors.append(f"{loc.where(('suites', i))}: suites[{i}]: {member}:\n{exc}")
    if errors:
        raise ConfigError("\n".join(errors))
    return suites


def suite_from_dict(
    raw: Mapping[str, Any],
    source: str = "<dict>",
    *,
    overrides: Sequence[str] = (),
    device: str | None = None,
    seeds: Sequence[int] | None = None,
    output: str | None = None,
    flags: Mapping[tuple[Any, ...], str] | None = None,
) -> Suite:
    """Validate a suite given as a dict (same checks as :func:`load_suite`). ``flags`` maps
    paths to the command-line option that set them (``("analyses", 1, "landscape", "grid"):
    "--grid 4"``), so that an error names the option, not the path."""
    loc = Locator(source)
    loc.overridden.update(flags or {})
    return _from_raw(copy.deepcopy(dict(raw)), loc, overrides, device, seeds, output)


def one_cell_suite(
    name: str,
    *,
    model: str | dict[str, Any],
    analyses: Sequence[str | dict[str, Any]],
    data: str | dict[str, Any] = "digits",
    solver: str | dict[str, Any] | None = None,
    backward: str | dict[str, Any] | None = None,
    init: str | dict[str, Any] | None = None,
    train: dict[str, Any] | None = None,
    seeds: Sequence[int] = (0,),
    device: str = "cuda_if_available",
    dtype: str = "float32",
    output: str = "results",
    overrides: Sequence[str] = (),
    flags: Mapping[tuple[Any, ...], str] | None = None,
    threads: int | None = 1,
) -> Suite:
    """A one-cell suite from options, for commands such as ``deqbench landscape``: they build one
    and hand it to :func:`deqbench.run.runner.run_suite`, the same path as ``deqbench run``.
    ``flags``: see :func:`suite_from_dict`. ``threads``: torch CPU threads, 1 by default (the
    tiny models these commands default to run fastest on one thread; with two threads on a busy
    2-core machine the landscape example ran 12x longer in CPU time); ``--set threads=N``.

    Example:
        >>> s = one_cell_suite("landscape", model="fc_deq_tiny", analyses=["metrics"],
        ...                    train={"epochs": 1}, device="cpu")   # doctest: +SKIP
    """
    defaults = {
        "model": model,
        "init": init,
        "solver": solver,
        "backward": backward,
        "train": train,
    }
    raw = {
        "schema": 1,
        "name": name,
        "device": device,
        "dtype": dtype,
        "seeds": list(seeds),
        "data": data,
        "defaults": {k: v for k, v in defaults.items() if v is not None},
        "analyses": list(analyses),
        "output": output,
    }
    if threads is not None:
        raw["threads"] = threads
    return suite_from_dict(raw, f"<{name} options>", overrides=overrides, flags=flags)


def _top_allowed(sub: tuple[Any, ...]) -> list[str]:
    if sub[:1] == ("paper",):
        from .paper import PaperBudget

        cls: Any = PaperBudget if sub[1:2] == ("budget",) else PaperBlock
        return list(cls.model_fields)
    cls = Defaults if sub[:1] == ("defaults",) else SuiteFile
    return [f.alias or n for n, f in cls.model_fields.items()]


def _from_raw(
    raw: Any,
    loc: Locator,
    overrides: Sequence[str],
    device: str | None,
    seeds: Sequence[int] | None,
    output: str | None,
) -> Suite:
    from .specs import check_analyses, check_cell, default_names, generic_fields, runtime_defaults

    if not isinstance(raw, dict):
        raise ConfigError(f"{loc.source}: a suite is a mapping (schema, name, data, defaults, ...)")
    if "runtime" in raw:
        raise ConfigError(
            loc.error(
                ("runtime",),
                "is a cell section: put it under defaults (defaults.runtime) or make it a "
                "matrix axis (runtime.amp: [none, bf16])",
                True,
            )
        )
    from .overrides import force_on_every_cell, is_forced, overridden_defaults

    for item in overrides:  # in order: a later one wins
        if is_forced(item):
            force_on_every_cell(raw, item, loc)
        else:
            apply_overrides(raw, [item], loc, NAMED, OVERRIDE_ALIASES)
    if device is not None:
        _set_top(raw, loc, "device", device, f"--device {device}")
    if seeds is not None:
        _set_top(raw, loc, "seeds", list(seeds), "--seeds " + ",".join(map(str, seeds)))
    if output is not None:
        _set_top(raw, loc, "output", str(output), f"--out {output}")
    try:
        top = SuiteFile.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError("\n".join(pydantic_lines(exc, loc, (), _top_allowed))) from None

    errors: list[str] = []
    base: dict[str, dict[str, Any]] = {}
    base_src: dict[str, tuple[Any, ...]] = {}
    for s in SECTIONS:
        path: tuple[Any, ...] = ("data",) if s == "data" else ("defaults", s)
        value = normalize_section(s, top.data if s == "data" else getattr(top.defaults, s))
        if not isinstance(value, dict):
            what = "a name or a mapping" if s in NAMED else "a mapping"
            errors.append(loc.error(path, f"expected {what}"))
            value = {}
        base[s], base_src[s] = value, path
    matrix = top.matrix
    errors += check_matrix(matrix, loc)
    errors += check_size(matrix, len(top.seeds), loc, top.caps)
    if msg := output_problem(top.output, top.name):
        errors.append(loc.error(("output",), msg))
    if errors:
        raise ConfigError("\n".join(errors))

    analyses, errors = check_analyses(top.analyses, loc)
    from .. import models
    from .labels import id_head

    drafts = expand(
        base,
        matrix,
        base_src,
        generic_fields(),
        default_names(),
        declared=models.defaults,
        id_head=id_head,
        suffix_defaults={"runtime": runtime_defaults()},
    )
    cells: list[Cell] = []
    for d in drafts:
        sections = check_cell(d, loc, errors, top.dtype, caps=top.caps)
        if sections is not None:
            cells.append(Cell(d.id, **sections))
    n_all = len(cells)
    if top.select is not None and not errors:
        cells = _selected(cells, top.select, loc, errors)
    from .env import check_device

    dev_err = check_device(top.device)
    if dev_err:
        errors.append(loc.error(("device",), dev_err))
    if errors:
        raise ConfigError("\n".join(sorted(dict.fromkeys(errors), key=_line_of)))

    resolved = {
        "schema": 1,
        "name": top.name,
        "description": top.description,
        "device": top.device,
        "dtype": top.dtype,
        "seeds": list(top.seeds),
        "threads": top.threads,
        **{k: v for k in NUMERIC_FLAGS if (v := getattr(top, k)) is not None},
        "data": base["data"],
        "defaults": {
            s: base[s] for s in SECTIONS if s != "data" and getattr(top.defaults, s) is not None
        },
        "matrix": copy.deepcopy(matrix),
        "analyses": [{n: p} for n, p in analyses],
        "output": top.output,
    }
    if not top.caps:
        resolved["caps"] = False
    if top.select is not None:
        resolved["select"] = list(top.select)
    paper = top.paper.model_dump() if top.paper is not None else None
    if paper is not None:
        resolved["paper"] = copy.deepcopy(paper)
    if resolved["matrix"] is None:
        del resolved["matrix"]
    notes = overridden_defaults(overrides, drafts, OVERRIDE_ALIASES)
    if top.select is not None:
        notes.append(f"select {', '.join(top.select)}: {len(cells)} of {n_all} cells run")
    return Suite(top.name, cells, analyses, list(top.seeds), top.device, top.dtype, top.threads,
                 top.description, top.output, loc.source, resolved, top.tf32,
                 top.cudnn_benchmark, top.deterministic, notes, paper)  # fmt: skip


def _selected(
    cells: list[Cell], patterns: list[str], loc: Locator, errors: list[str]
) -> list[Cell]:
    """The cells whose id matches one of ``patterns`` (shell patterns, :func:`fnmatch.fnmatchcase`),
    in suite order; a pattern that matches no cell is an error naming the ids there are."""
    import fnmatch

    if not patterns:
        errors.append(loc.error(("select",), "is empty: give at least one cell id pattern"))
        return cells
    for pat in patterns:
        if not any(fnmatch.fnmatchcase(c.id, pat) for c in cells):
            ids = ", ".join(c.id for c in cells[:20]) + (", ..." if len(cells) > 20 else "")
            errors.append(loc.error(("select",), f"{pat!r} matches no cell; the cells: {ids}"))
    return [c for c in cells if any(fnmatch.fnmatchcase(c.id, p) for p in patterns)]


def _line_of(err: str) -> tuple[int, int]:
    m = re.match(r"[^:]*:(\d+):(\d+):", err)
    return (int(m.group(1)), int(m.group(2))) if m else (1 << 30, 0)


def format_cells(suite: Suite) -> list[str]:
    """One line per cell: ``id  model  solver  backward  init`` (``deqbench validate``); the
    solver and backward that compute the cell (:func:`deqbench.run.matrix.cell_labels`), and
    the suite's solver as ``reference=`` where it only serves analyses (an unrolled cell)."""
    from .labels import cell_labels

    out = []
    for c in suite.cells:
        solver, backward = cell_labels(c.as_dict())
        ref = (f" reference={c.solver['name']}"
               if backward == "unrolled" and solver != c.solver["name"] else "")  # fmt: skip
        out.append(f"{c.id}\tmodel={c.model['name']} solver={solver} backward={backward}{ref} "
                   f"init={c.init['name']} data={c.data['name']}")  # fmt: skip
    return out
