"""A deqbench cell from a method of a network: :func:`cell_from_method`, :class:`MethodCell`
(see :mod:`deqbench.adapters`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..core.errors import ConfigError
from .own_loop import _first_tensor, _resolve

__all__ = ["MethodCell", "cell_from_method"]


# -- a deqbench cell from a method of a network --------------------------------------------------


def _module_path(net: nn.Module, module: nn.Module) -> str:
    for n, m in net.named_modules():
        if m is module and n:
            return n
    raise ConfigError(
        f"cell_from_method: {type(module).__name__} is not a submodule of {type(net).__name__}"
    )


class MethodCell(nn.Module):
    """A deqbench cell ``forward(z, u) = fn(z, u)`` over a method of a whole network, holding as
    submodules only the network's submodules the map uses (shared, not copied: training the cell
    trains the network). Built by :func:`cell_from_method`. The network itself is kept outside
    the module tree (not in ``parameters()`` nor ``state_dict()``)."""

    # plain attributes, set through __dict__ (not submodules), declared for type checkers
    _net: nn.Module
    _fn: str | Callable[..., Any]
    _injection: tuple[str, ...]

    def __init__(
        self,
        net: nn.Module,
        fn: str | Callable[[Tensor, Tensor], Any],
        uses: dict[str, nn.Module],
        injection: Sequence[str] = (),
        check: bool = True,
        label: str = "",
    ) -> None:
        super().__init__()
        self.__dict__["_net"] = net
        self.__dict__["_fn"] = fn
        self.__dict__["_checked"] = not check
        self.__dict__["_injection"] = tuple(injection)
        self.label = label
        for n, m in uses.items():
            self.add_module(n, m)

    def forward(self, z: Tensor, u: Tensor) -> Tensor:
        if not self.__dict__["_checked"] and not _tracing():
            self.__dict__["_checked"] = True
            return self._checked_call(z, u)
        fn = self._fn
        if isinstance(fn, str):  # resolved on each call: copies of the model call their own net
            fn = _resolve(self._net, fn, "cell_from_method")[1]
        out = _first_tensor(fn(z, u))
        if out is None:
            raise ConfigError(f"cell_from_method: {self.label} returned no tensor")
        return out

    def _checked_call(self, z: Tensor, u: Tensor) -> Tensor:
        """The first call: the network's submodules with parameters or buffers that the method
        calls must be held by the cell (else its parameters() misses part of the map)."""
        held = {id(m) for m in self.modules()}
        missed: list[str] = []
        handles = []
        for n, m in self._net.named_modules():
            if not n or id(m) in held:
                continue
            own = any(True for _ in m.parameters(recurse=False)) or any(
                True for _ in m.buffers(recurse=False)
            )
            if own or any(True for _ in m.parameters()):
                handles.append(m.register_forward_pre_hook(
                    lambda mod, a, n=n: missed.append(n)  # type: ignore[misc]
                ))  # fmt: skip
        try:
            out = self.forward(z, u)
        finally:
            for h in handles:
                h.remove()
        top = sorted({n for n in missed if not any(n.startswith(o + ".") for o in missed)})
        if top:
            self.__dict__["_checked"] = False
            raise ConfigError(
                f"cell_from_method: {self.label} calls {', '.join(top)} of "
                f"{type(self._net).__name__}, which the cell does not hold: add "
                f"{', '.join(repr(t) for t in top)} to uses= (the cell's parameters are the map's)"
            )
        return out

    def injection_parameters(self) -> list[nn.Parameter]:
        """The parameters of the submodules named ``injection`` (not cell weights)."""
        return [p for n in self._injection for p in getattr(self, n).parameters()]

    def extra_repr(self) -> str:
        return self.label


def _tracing() -> bool:
    compiling = getattr(torch.compiler, "is_compiling", None)
    if compiling is not None and compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def cell_from_method(
    net: nn.Module,
    method: str | Callable[..., Any] | nn.Module,
    *,
    uses: Sequence[str | nn.Module] | None = None,
    injection: Sequence[str | nn.Module] = (),
    check: bool = True,
) -> MethodCell:
    """A deqbench cell (``forward(z, u)`` keeping z's shape) from a method of ``net``, for a
    :class:`deqbench.deq.DEQLayer`.

    Args:
        net: the whole network.
        method: the map ``F(z, u)``: the dotted name of a method or submodule of ``net``, a
            bound method or a submodule of it, or any callable ``(z, u) -> Tensor`` (e.g. a
            lambda fixing further arguments of a method).
        uses: the submodules of ``net`` (dotted names or the modules) the map reads its
            parameters and buffers from; the cell holds exactly these (shared with ``net``), so
            ``cell.parameters()`` are the map's, which deqbench's backward modes differentiate,
            inits rescale and analyses measure. Default: the submodule ``method`` is (or whose
            method it is); required otherwise.
        injection: those of ``uses`` whose parameters are injection, not cell weights
            (``injection_parameters()``, :func:`deqbench.contracts.cell_weights`).
        check: on the first call, raise a ConfigError naming any submodule of ``net`` with
            parameters or buffers that the method calls but the cell does not hold. (Parameters
            the method reads from ``net`` itself, not from a submodule, cannot be held: move
            them into a submodule.)

    The cell is named after its submodules' paths in ``net`` (dots become ``_``).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> class Net(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.stem, self.conv, self.head = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2)
        ...     def f(self, z, x):                       # the map the network's own loop iterates
        ...         return torch.tanh(self.conv(z) + x)
        >>> net = Net()
        >>> cell = cell_from_method(net, "f", uses=["conv"])
        >>> sorted(n for n, _ in cell.named_parameters())
        ['conv.bias', 'conv.weight']
        >>> z, u = torch.zeros(2, 4), torch.randn(2, 4)
        >>> torch.equal(cell(z, u), net.f(z, u))
        True
    """
    label = ""
    owner: Any = None
    if isinstance(method, str):
        owner, fn, last = _resolve(net, method, "cell_from_method")
        label = f"{type(net).__name__}.{method}"
        if isinstance(fn, nn.Module):
            owner = fn
    elif isinstance(method, nn.Module):
        fn, owner = method, method
        label = f"{type(net).__name__}.{_module_path(net, method)}"
    elif callable(method):
        fn = method
        owner = getattr(method, "__self__", None)
        label = getattr(method, "__qualname__", type(method).__name__)
        if isinstance(owner, nn.Module) and hasattr(method, "__name__"):
            base = "" if owner is net else _module_path(net, owner) + "."
            method = base + method.__name__  # a bound method of net: by name (copies work)
            label = f"{type(net).__name__}.{method}"
    else:
        raise ConfigError(f"cell_from_method: method must be a name, a submodule or a callable, "
                          f"got {type(method).__name__}")  # fmt: skip
    if not callable(fn):
        raise ConfigError(f"cell_from_method: {label} is a {type(fn).__name__}, not callable")
    target: str | Callable[..., Any] = method if isinstance(method, str) else fn
    if isinstance(method, nn.Module):
        target = _module_path(net, method)
    if uses is None:
        if not isinstance(owner, nn.Module) or owner is net:
            raise ConfigError(
                f"cell_from_method: {label} is a method of the whole network: name the "
                "submodules it uses (uses=['conv1', 'norm1', ...]) so that the cell holds only "
                "the map's parameters"
            )
        uses = [owner]
    held: dict[str, nn.Module] = {}
    for u_ in uses:
        if isinstance(u_, nn.Module):
            path, mod = _module_path(net, u_), u_
        elif isinstance(u_, str):
            _, mod, _ = _resolve(net, u_, "cell_from_method: uses")
            path = u_
            if not isinstance(mod, nn.Module):
                raise ConfigError(
                    f"cell_from_method: uses names '{u_}', a {type(mod).__name__}, not a "
                    "submodule (a parameter of the network itself cannot be held by the cell: "
                    "move it into a submodule)"
                )
        else:
            raise ConfigError(f"cell_from_method: uses takes names or submodules, got {u_!r}")
        key = path.replace(".", "_")
        if key in held and held[key] is not mod:
            raise ConfigError(f"cell_from_method: two submodules would be named '{key}'")
        held[key] = mod
    inj = []
    for i_ in injection:
        mod = i_ if isinstance(i_, nn.Module) else _resolve(net, i_, "cell_from_method")[1]
        found = next((k for k, m in held.items() if m is mod), None)
        if found is None:
            raise ConfigError(f"cell_from_method: injection {i_!r} is not among uses")
        inj.append(found)
    return MethodCell(net, target, held, inj, check, label)
