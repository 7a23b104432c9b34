"""The backward-mode contract: :class:`BackwardMode`, and how a DEQ layer finds its mode.

A backward mode decides how a :class:`deqbench.deq.DEQLayer` attaches gradients to its
equilibrium: given the layer, the injection ``u`` and the initial state ``z0`` (grad enabled), its
:meth:`BackwardMode.apply` returns z (the layer's output) wired into autograd its own way. The
built-ins (``ift``, ``unrolled``, ``jfb``, ``phantom``, ``reversible``, ``shine``) and third-party
modes (entry-point group ``deqbench.backward``) are registered the same way and reached through
one dispatch (:func:`mode_of`), so a plugin's mode runs in every suite and joins the ``backward``
analysis' comparison.

A mode declares, as class attributes:

* ``forward``: the registered forward solver it needs (``reversible`` runs its own coupled
  iteration, ``shine`` reuses Broyden's inverse estimate), or None for any; a cell whose solver
  differs is a :class:`~deqbench.errors.ConfigError` when the suite is validated and when the
  layer is configured;
* ``Options``: a pydantic model of its own options (``BackwardConfig.options``, in a suite the
  extra keys of the ``backward`` section), or None;
* ``adjoint_solver``: whether it solves an adjoint system with ``BackwardConfig.solver`` (then
  ``options`` are that solver's options, as for ``ift``);
* ``solves_forward``: whether its forward is a solve to the solver's tolerance (False for
  ``unrolled``: K fixed steps), so that a forward that missed it flags the measurement;
* ``checks_backward``: whether ``last_backward_stats`` hold a solve with a tolerance to meet
  (``ift``'s adjoint, ``reversible``'s reconstruction), flagged likewise;
* ``fields``: the :class:`~deqbench.deq.BackwardConfig` fields it reads (documentation).

Modes may also set ``layer.last_backward_info`` (a dict of floats: SHINE's fallback share,
RevDEQ's reconstruction error), which the ``backward`` analysis writes as rows.

Example (a damped JFB: one relaxed step from z*, as a plugin would write it):
    >>> import torch
    >>> from deqbench.backward import BackwardMode
    >>> class DampedJFB(BackwardMode):
    ...     name = "damped_jfb"
    ...     def apply(self, layer, u, z0):
    ...         z, _ = layer.solve(u, z0)
    ...         z = z.detach()
    ...         return 0.5 * z + 0.5 * layer.f(z, u)
    >>> DampedJFB().label(None)
    'damped_jfb'
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ValidationError

from ..core.errors import ConfigError

# Described, not imported (the core imports this module: no import circle): ``layer`` is a
# deqbench.deq.DEQLayer (deqbench.core.backward.Layer), ``cfg`` a BackwardConfig, ``forward`` a
# SolverConfig, tensors torch Tensors.
Layer = Any
Tensor = Any
BackwardConfig = Any
SolverConfig = Any


class BackwardMode:
    """A backward mode (subclass it; register the class with ``@backward_modes.register(name)``
    or an entry point of the group ``deqbench.backward``). See the module docstring."""

    name: ClassVar[str] = ""
    #: the forward solver this mode needs (a registered name), None: any
    forward: ClassVar[str | None] = None
    #: the forward solver's options this mode needs (set when a comparison picks its forward)
    forward_options: ClassVar[dict[str, Any]] = {}
    #: pydantic model of the mode's options (``BackwardConfig.options``), None: no own options
    Options: ClassVar[type[BaseModel] | None] = None
    #: solves an adjoint system with ``BackwardConfig.solver`` (``options`` are its options)
    adjoint_solver: ClassVar[bool] = False
    #: the forward is a solve to the forward solver's tolerance
    solves_forward: ClassVar[bool] = True
    #: ``last_backward_stats`` hold a solve whose tolerance the backward must meet
    checks_backward: ClassVar[bool] = False
    #: the BackwardConfig fields the mode reads
    fields: ClassVar[tuple[str, ...]] = ()
    #: what to do when ``checks_backward`` flags the backward (one clause, for the note)
    backward_hint: ClassVar[str] = ""

    def apply(self, layer: Layer, u: Tensor, z0: Tensor) -> Tensor:
        """z for injection ``u`` from ``z0``, differentiable the mode's way (grad enabled).
        Record the forward stats on ``layer.last_forward_stats`` (``layer.solve`` does) and set
        ``layer.last_backward_stats`` (None when the backward solves nothing)."""
        raise NotImplementedError

    def evaluate(self, layer: Layer, u: Tensor, z0: Tensor) -> Tensor | None:
        """The layer's output without grad (evaluation), or None: the forward solve
        (``layer.solve``). ``unrolled`` returns its K-step network."""
        return None

    def label(self, cfg: BackwardConfig | None, forward: SolverConfig | None = None) -> str:
        """The variant name of this mode with ``cfg`` (and forward ``forward``) in a
        comparison, e.g. ``ift-tol=1e-06``, ``phantom-k=5-tau=0.5``."""
        return self.name

    def options(self, cfg: BackwardConfig) -> Any:
        """``cfg.options`` validated with :attr:`Options` (None without an Options model)."""
        if self.Options is None:
            return None
        key = (type(self), _frozen(cfg.options))
        hit = _OPTIONS_CACHE.get(key)
        if hit is None:
            try:
                hit = self.Options.model_validate(dict(cfg.options))
            except ValidationError as exc:
                raise ConfigError(
                    f"backward: {'; '.join(option_problems(self, cfg.options))}"
                ) from exc
            if len(_OPTIONS_CACHE) > 256:
                _OPTIONS_CACHE.clear()
            _OPTIONS_CACHE[key] = hit
        return hit


_OPTIONS_CACHE: dict[Any, Any] = {}
_INSTANCES: dict[Any, BackwardMode] = {}


def _frozen(d: Any) -> Any:
    if isinstance(d, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in d.items()))
    if isinstance(d, list | tuple):
        return tuple(_frozen(v) for v in d)
    return d


def as_mode(obj: Any, name: str = "") -> BackwardMode:
    """A mode instance from what the registry holds (a :class:`BackwardMode` subclass or
    instance); anything else is a PluginError naming the entry."""
    from ..core.errors import PluginError

    if isinstance(obj, BackwardMode):
        return obj
    if isinstance(obj, type) and issubclass(obj, BackwardMode):
        inst = _INSTANCES.get(obj)
        if inst is None:
            inst = _INSTANCES[obj] = obj()
        return inst
    raise PluginError(
        f"backward mode '{name}' is {obj!r}, not a deqbench.backward.BackwardMode subclass"
    )


def mode_of(name: str) -> BackwardMode:
    """The registered backward mode ``name`` (an instance; unknown: UnknownNameError)."""
    from ..core.registry import backward_modes

    return as_mode(backward_modes.get(name), name)


def option_problems(mode: BackwardMode, options: dict[str, Any]) -> list[str]:
    """One line per option of ``options`` the mode's :attr:`~BackwardMode.Options` rejects
    (unknown keys too); empty when fine or when the mode has no Options model."""
    if mode.Options is None:
        return []
    known = list(mode.Options.model_fields)
    out = []
    for k in options:
        if k not in known:
            import difflib

            close = difflib.get_close_matches(k, known, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            out.append(
                f"{k}: unknown option of backward mode '{mode.name}'{hint}; it takes: "
                f"{', '.join(known) or 'nothing'}"
            )
    try:
        mode.Options.model_validate({k: v for k, v in options.items() if k in known})
    except ValidationError as exc:
        for e in exc.errors(include_url=False):
            key = ".".join(str(p) for p in e["loc"])
            msg = str(e["ctx"]["error"]) if e["type"] == "value_error" else e["msg"]
            out.append(f"{key or mode.name}: {msg}, got {e.get('input')!r}")
    return out


def forward_problem(mode: BackwardMode, solver: str) -> str:
    """Why forward solver ``solver`` cannot serve ``mode`` (one line), or ""."""
    if mode.forward is None or mode.forward == solver:
        return ""
    return (
        f"backward mode '{mode.name}' needs the forward solver '{mode.forward}', not "
        f"'{solver}': set solver: {{name: {mode.forward}}}"
    )


def check_pair(solver: SolverConfig, backward: BackwardConfig) -> None:
    """ConfigError when the backward mode needs another forward solver than ``solver``."""
    why = forward_problem(mode_of(backward.name), solver.name)
    if why:
        raise ConfigError(why)
