"""Contract checks of datasets: each dataset's (in_shape, num_outputs) from the shape its loader
declares or, where it declares none, by loading it (:func:`dataset_shape`), and what keeps it
from loading (:func:`data_problems`: a built-in's probe, a plugin's loader called once).
"""

from __future__ import annotations

from typing import Any

from ..core.errors import ConfigError, PluginError
from .interrupts import plugin_fault
from .plugin_faults import _raised, _unless_interrupt


def dataset_shape(
    name: str, params: dict[str, Any]
) -> tuple[tuple[tuple[int, ...], int] | None, tuple[str, str] | None]:
    """``((in_shape, num_outputs), None)`` of dataset ``name`` with ``params``: from the shape
    its loader declares (``loader.shape(params)``), else by loading it; ``(None, (clause,
    message))`` when the dataset breaks its contract (:class:`deqbench.contracts.DatasetLoader`);
    ``(None, None)`` for an unknown name (the schema reports it)."""

    from ..core.registry import datasets
    from ..data.base import declared_shape

    if name not in datasets:
        return None, None
    try:
        fn = datasets.get(name)
    except PluginError as exc:
        return None, ("dataset.import", datasets.entry(name).error or str(exc))
    except KeyboardInterrupt as exc:  # the import raised it: the registry passes it on
        _unless_interrupt(exc)
        return None, ("dataset.import", plugin_fault(exc))
    if not callable(fn):
        return None, ("dataset.import", f"names a {type(fn).__name__}, not a callable")
    try:
        shape = declared_shape(fn, params)
    except BaseException as exc:  # noqa: BLE001 - sys.exit() & co. of plugin code too
        _unless_interrupt(exc)
        return None, ("dataset.declared", f"shape({params}) {_raised(exc)}")
    if shape is not None:
        return shape, None
    return _loaded(name, fn, params, None)


def _loaded(
    name: str, fn: Any, params: dict[str, Any], declared: tuple[tuple[int, ...], int] | None
) -> tuple[tuple[tuple[int, ...], int] | None, tuple[str, str] | None]:
    """``((in_shape, num_outputs), None)`` of the bundle ``fn(**params)`` returns, or ``(None,
    (clause, message))``: the loader fails [dataset.load], its bundle is malformed or its x are
    not shaped ``(N, *in_shape)`` [dataset.load], or ``declared`` (the shape the loader
    declares) is not the bundle's [dataset.declared]."""
    import torch

    from ..data.base import bundle_problem

    call = f"{name}({', '.join(f'{k}={v!r}' for k, v in params.items())})"
    try:
        with torch.random.fork_rng(devices=[]):
            d = fn(**params)
    except ConfigError as exc:
        return None, ("dataset.load", f"{call}: {exc}")
    except BaseException as exc:  # noqa: BLE001 - sys.exit() & co. of plugin code too
        _unless_interrupt(exc)
        return None, ("dataset.load", f"{call} {_raised(exc)}")
    problem = bundle_problem(d)
    if problem is not None:
        return None, ("dataset.load", f"{call} {problem}")
    shape = (tuple(d.in_shape), int(d.num_outputs))
    for split in ("train", "test"):
        x, y = getattr(d, split)
        if tuple(x.shape[1:]) != shape[0] or x.dim() == 0:
            return None, (
                "dataset.load",
                f"{call}: its {split} x has shape {tuple(x.shape)}, not (N, *in_shape) for "
                f"in_shape={shape[0]}",
            )
        if len(x) != len(y):
            return None, (
                "dataset.load",
                f"{call}: its {split} split has {len(x)} inputs and {len(y)} targets",
            )
    if declared is not None and shape != declared:
        return None, (
            "dataset.declared",
            f"shape(params) declares in_shape={declared[0]}, num_outputs={declared[1]} (what "
            f"the models are built and checked with) but {call} loads in_shape={shape[0]}, "
            f"num_outputs={shape[1]}",
        )
    return shape, None


def data_problems(name: str, params: dict[str, Any]) -> tuple[str, str] | None:
    """What keeps dataset ``name`` from loading with ``params``, as ``(clause, message)``, or
    None; after :func:`dataset_shape` found its shape. A loader with a probe (``@dataset(name,
    probe=...)``: every built-in) is probed, not loaded: a DataError or ConfigError it raises
    is ``("", message)`` for a built-in (the message says the fix), [dataset.load] for a
    plugin. Any other loader that declares its shape is called once (:func:`_loaded`, checked
    against that shape); one that declares none was loaded by :func:`dataset_shape`."""
    from ..core.errors import DataError
    from ..core.registry import datasets
    from ..data.base import declared_shape, loader_params

    fn = datasets.get(name)  # imported already by dataset_shape
    probe = getattr(fn, "probe", None)
    if probe is None:
        declared = declared_shape(fn, params)
        return None if declared is None else _loaded(name, fn, params, declared)[1]
    try:
        probe(loader_params(fn, params))
    except (DataError, ConfigError) as exc:
        if datasets.origin(name) == "built-in":
            return "", str(exc)
        return "dataset.load", f"probe({params}): {exc}"
    except BaseException as exc:  # noqa: BLE001 - sys.exit() & co. of plugin code too
        _unless_interrupt(exc)
        return "dataset.load", f"probe({params}) {_raised(exc)}"
    return None


def data_shape(name: str, params: dict[str, Any]) -> tuple[tuple[int, ...], int] | None:
    """(in_shape, num_outputs) of dataset ``name`` with ``params`` (:func:`dataset_shape`); None
    when it cannot be had."""
    return dataset_shape(name, params)[0]
