"""Registries of models, solvers, inits, analyses and datasets, with entry-point plugin discovery.

Built-ins register themselves with a decorator in their own module; the registry imports every
module of its built-in package on first use (so ``deqbench --help`` never imports torch).
Third-party packages add names through the entry-point groups ``deqbench.models``,
``deqbench.solvers``, ``deqbench.inits``, ``deqbench.analyses``, ``deqbench.datasets`` and
``deqbench.backward`` (backward modes; value ``package.module:attr``).

Example:
    >>> import deqbench
    >>> deqbench.models.names("fc_*")            # doctest: +SKIP
    ['fc_deq', 'fc_deq_tiny']
    >>> model = deqbench.models.create("fc_deq_tiny")   # doctest: +SKIP
"""

from __future__ import annotations

import difflib
import fnmatch
import importlib
import os
import pkgutil
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Generic, TypeVar

from .errors import PluginError, UnknownNameError, shown

T = TypeVar("T")

BUILTIN = "built-in"


@dataclass
class Entry:
    """One registered name."""

    name: str
    obj: Any = None  # loaded object (None until a plugin is loaded)
    origin: str = BUILTIN  # "built-in" or "<distribution> <version>"
    entry_point: Any = None  # importlib.metadata.EntryPoint for plugins
    error: str | None = None  # import error of a broken plugin
    claimants: list[str] = field(default_factory=list)  # distributions claiming the name

    @property
    def is_builtin(self) -> bool:
        return self.origin == BUILTIN


def _dist_label(ep: Any) -> str:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "unknown distribution"
    return f"{dist.metadata['Name']} {dist.version}"


class Registry(Generic[T]):
    """A named collection of factories of one kind.

    Args:
        kind: plural noun used in messages and ``deqbench ls KIND`` ("models", "solvers", ...).
        builtin_package: dotted package whose submodules register the built-ins.
        singular: what one entry is called in messages (default: ``kind`` without its "s").
    """

    def __init__(self, kind: str, builtin_package: str, singular: str | None = None) -> None:
        self.kind = kind
        self.singular = singular or SINGULAR.get(kind, kind[:-1])
        self.group = f"deqbench.{kind}"
        self.builtin_package = builtin_package
        self._entries: dict[str, Entry] = {}
        self._builtins_loaded = False
        self._plugins_scanned = False
        self.plugin_errors: list[str] = []

    # -- registration ---------------------------------------------------------------------
    def register(self, name: str | None = None, **attrs: Any) -> Callable[[T], T]:
        """Decorator registering a built-in factory or class under ``name``; ``attrs`` are set on
        it (a dataset's ``shape``)."""

        def deco(obj: T) -> T:
            key = name or getattr(obj, "name", None) or obj.__name__  # type: ignore[attr-defined]
            for k, v in attrs.items():
                setattr(obj, k, v)
            if key in self._entries and self._entries[key].obj is not obj:
                raise PluginError(f"{self.kind}: built-in name '{key}' registered twice")
            self._entries[key] = Entry(name=key, obj=obj)
            return obj

        return deco

    @property
    def builtins_loaded(self) -> bool:
        """Whether the built-in modules have been imported (or the built-ins given)."""
        return self._builtins_loaded

    @classmethod
    def from_names(cls, kind: str, names: Iterable[str], entry_points: Any = None) -> Registry[Any]:
        """A registry of ``kind`` whose built-ins are just ``names``, not imported (their objects
        are None), and whose plugins come from the entry points as usual (``entry_points``: the
        group's, already read; None: read on first use): ``deqbench ls`` without importing the
        built-in modules (:mod:`deqbench.core.index`)."""
        reg: Registry[Any] = cls(kind, builtin_package="")
        reg._entries = {n: Entry(name=n) for n in names}
        reg._builtins_loaded = True
        if entry_points is not None:
            reg._scan_plugins(entry_points)
        return reg

    def add(self, name: str, obj: T, origin: str = "runtime") -> None:
        """Register an object at run time (notebooks, tests). Refuses to shadow any name."""
        self._ensure()
        if name in self._entries:
            raise PluginError(
                f"{self.kind}: '{name}' already exists ({self._entries[name].origin})"
            )
        self._entries[name] = Entry(name=name, obj=obj, origin=origin)

    def remove(self, name: str) -> None:
        """Remove a name added with :meth:`add` (tests)."""
        self._entries.pop(name, None)

    # -- discovery --------------------------------------------------------------------------
    def _load_builtins(self) -> None:
        if self._builtins_loaded:
            return
        self._builtins_loaded = True
        pkg = importlib.import_module(self.builtin_package)
        find = getattr(pkg, "builtin_modules", None)  # dotted modules, where they live elsewhere
        if find is not None:
            listed = find()
            if not listed:
                raise PluginError(f"{self.kind}: no built-in module found (deqbench.core.index)")
            for name in listed:
                importlib.import_module(name)
            return
        for info in pkgutil.iter_modules(pkg.__path__):
            if not info.name.startswith("_"):
                importlib.import_module(f"{self.builtin_package}.{info.name}")

    def _scan_plugins(self, eps: Any = None) -> None:
        if self._plugins_scanned:
            return
        self._plugins_scanned = True
        if os.environ.get("DEQBENCH_DISABLE_PLUGIN_AUTOLOAD", "") not in ("", "0"):
            return
        try:
            if eps is None:
                eps = metadata.entry_points(group=self.group)
        except Exception as exc:  # pragma: no cover - broken metadata
            self.plugin_errors.append(f"reading entry points of {self.group}: {exc}")
            return
        for ep in eps:
            label = _dist_label(ep)
            existing = self._entries.get(ep.name)
            if existing is not None and existing.is_builtin:
                warnings.warn(
                    f"plugin {label} tries to register {self.singular} '{ep.name}', which is a "
                    "built-in name; the plugin's entry is skipped",
                    stacklevel=2,
                )
                continue
            if existing is not None:
                if label not in existing.claimants:
                    existing.claimants.append(label)
                continue
            self._entries[ep.name] = Entry(
                name=ep.name, origin=label, entry_point=ep, claimants=[label]
            )

    def _ensure(self) -> None:
        self._load_builtins()
        self._scan_plugins()

    # -- lookup -----------------------------------------------------------------------------
    def names(self, pattern: str | None = None) -> list[str]:
        """Sorted names, optionally filtered by a glob ``pattern`` (plugins are not imported)."""
        self._ensure()
        names = sorted(self._entries)
        if pattern:
            names = [n for n in names if fnmatch.fnmatchcase(n, pattern) or pattern in n]
        return names

    def __contains__(self, name: object) -> bool:
        self._ensure()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def unknown(self, name: str) -> UnknownNameError:
        """The error for an unknown ``name``, with close matches."""
        text = str(name)
        close = difflib.get_close_matches(text[:200], self.names(), n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        return UnknownNameError(
            f"unknown {self.singular} '{shown(text, 80)}'{hint} (see `deqbench ls {self.kind}`)"
        )

    def entry(self, name: str) -> Entry:
        self._ensure()
        if name not in self._entries:
            raise self.unknown(name)
        return self._entries[name]

    def get(self, name: str) -> T:
        """The registered object (factory, function or class) for ``name``."""
        e = self.entry(name)
        if len(e.claimants) > 1:
            raise PluginError(
                f"{self.singular} '{name}' is ambiguous: claimed by plugins "
                f"{' and '.join(e.claimants)}; uninstall one of them"
            )
        if e.obj is None:
            if e.error is None:
                try:
                    e.obj = e.entry_point.load()
                except KeyboardInterrupt:
                    raise
                except BaseException as exc:  # noqa: BLE001 - sys.exit() in a plugin too
                    e.error = f"{type(exc).__name__}: {exc}"
                    msg = f"plugin {e.origin} failed to import {self.singular} '{name}' ({e.entry_point.value}): {e.error}"
                    self.plugin_errors.append(msg)
            if e.error is not None:
                raise PluginError(
                    f"plugin {e.origin} failed to import {self.singular} '{name}': {e.error}"
                )
        return e.obj  # type: ignore[return-value]

    def broken(self, pattern: str | None = None) -> dict[str, str]:
        """Import every plugin name (matching ``pattern``); return the ones that fail to import
        (or are ambiguous), name -> error (``deqbench ls --check``)."""
        out: dict[str, str] = {}
        for name in self.names(pattern):
            if self._entries[name].is_builtin:
                continue
            try:
                self.get(name)
            except PluginError as exc:
                out[name] = str(exc)
        return out

    def create(self, name: str, /, **params: Any) -> Any:
        """Call the factory registered as ``name`` with ``params``."""
        return self.get(name)(**params)  # type: ignore[operator]

    def origin(self, name: str) -> str:
        """``"built-in"`` or ``"DISTRIBUTION VERSION"`` of the plugin that provides ``name``."""
        return self.entry(name).origin

    def reset_plugins(self) -> None:
        """Forget discovered plugins so the next lookup rescans entry points (tests)."""
        self._entries = {k: v for k, v in self._entries.items() if v.is_builtin}
        self._plugins_scanned = False
        self.plugin_errors = []


#: kinds whose one entry is not called by the kind without its "s"
SINGULAR = {"analyses": "analysis", "backward": "backward mode"}

models: Registry[Callable[..., Any]] = Registry("models", "deqbench.models")
solvers: Registry[Callable[..., Any]] = Registry("solvers", "deqbench.solvers")
inits: Registry[Callable[..., Any]] = Registry("inits", "deqbench.inits")
analyses: Registry[Any] = Registry("analyses", "deqbench.analyses")
#: dataset loaders ``fn(**params) -> DataBundle`` (:class:`deqbench.contracts.DatasetLoader`)
datasets: Registry[Callable[..., Any]] = Registry("datasets", "deqbench.data")
#: backward modes, :class:`deqbench.backward.BackwardMode` subclasses (entry-point group
#: ``deqbench.backward``; ``deqbench ls backward``)
backward_modes: Registry[Any] = Registry("backward", "deqbench.backward")

REGISTRIES: dict[str, Registry[Any]] = {
    "models": models,
    "solvers": solvers,
    "inits": inits,
    "analyses": analyses,
    "datasets": datasets,
    "backward": backward_modes,
}


#: registries a module outside this one defines (the kernels, which live with the kGLM family),
#: by kind: added by :func:`publish` when that module is imported, so that generic code
#: (``deqbench ls``) finds one that is loaded without naming its module
PUBLISHED: dict[str, Registry[Any]] = {}


def publish(reg: Registry[T]) -> Registry[T]:
    """Add ``reg`` to :data:`PUBLISHED` under its kind; returns it."""
    PUBLISHED[reg.kind] = reg
    return reg


def registry(kind: str) -> Registry[Any]:
    """The registry of ``kind`` (accepts singular or plural)."""
    key = kind if kind in REGISTRIES or kind.endswith("s") else kind + "s"
    if key not in REGISTRIES:
        close = difflib.get_close_matches(key, list(REGISTRIES), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise UnknownNameError(f"unknown kind '{kind}'{hint}; kinds: {', '.join(REGISTRIES)}")
    return REGISTRIES[key]
