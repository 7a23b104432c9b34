"""Adapter helpers: bring a third-party equilibrium network to deqbench in a few lines.

Two ways to adapt a network that computes its equilibrium with its own code:

* keep its own fixed-point loop and let deqbench *measure* it: :class:`OwnLoop` (or the context
  manager :func:`track_loop` inside a model of your own) intercepts every call of the map during
  a forward and turns them into a full :class:`~deqbench.solvers.base.SolverStats` (f-evaluations,
  per-sample residual traces, the returned iterate's residual, converged/status), reported through
  the own-solver hook ``last_solve_stats()`` (:class:`deqbench.contracts.OwnSolverModel`);
* let deqbench *solve* it: :func:`cell_from_method` makes a deqbench cell ``f(z, u)`` from one
  method (or submodule) of the network, holding only the map's submodules as its parameters,
  for a :class:`deqbench.deq.DEQLayer` (every solver and backward mode then applies).

**What** :class:`OwnLoop` **measures.** For each call of the map ``F(z, *args)`` (``z``: its
first positional argument; its output, or the first element of a returned tuple, must be shaped
like ``z``): the per-sample ``abs = ||F(z) - z||`` and ``rel = abs / ||F(z)||``
(:func:`deqbench.solvers.base.residuals`) *of the call's input* ``z``. The calls that are
iterations of the loop (below) give ``nstep`` and the traces (row ``t``: the residual of the
``t``-th iterate the loop evaluated the map at). ``abs_residual``/``rel_residual``, hence
``converged`` (every sample finite and below ``tol`` in ``stop_mode``) and ``status``
(``converged``; ``diverged`` when a residual of the loop is not finite or its batch max abs
residual rose above :data:`DIVERGE_FACTOR` times the first iterate's, as a built-in solver's
blow-up; ``stagnated`` when the loop stopped before ``max_iter`` without converging: on its own
test; else ``max_iter``) are those of the iterate the loop
*returned*, ``z_ret``, which is:

* with ``loop=`` (the network's method or submodule that runs the loop): its return value
  (the first tensor of it). Its residual is that of the first map call whose input is
  ``z_ret`` (same storage, or equal values: the last iteration's input, or the input of the step
  a Jacobian-free backward applies after the loop); when no call evaluated the map at ``z_ret``
  (a loop that returns ``F(z)`` or a damped update and makes no step after it), the map is
  evaluated once more at ``z_ret`` under no_grad, with the arguments of the last iteration:
  counted in ``extra["check_evals"]``, not in ``nstep``;
* without it: the input of the first map call after the last iteration (the step with gradient
  of a Jacobian-free backward is applied to the returned iterate), else the input of the last
  iteration.

``extra["returned"]`` says which it was; ``extra["max_iter"]`` is the loop's cap,
``extra["map_calls"]`` every call of the map in the forward. The residual of ``z_ret`` may
differ from what the network's own stopping test measured (e.g. a loop that tests ``z`` and
returns ``F(z)``): deqbench judges the iterate that is returned.

The map (and ``loop``) is intercepted for the forward only: a submodule through forward hooks,
a method through a wrapper set on the instance, which sees calls made as ``self.f(...)`` (not
``type(self).f(self, ...)``). With ``loop``, the stats describe its last run in the forward.

**Which calls are iterations** (the rest, e.g. the Jacobian-free step with gradient, are not
counted in ``nstep``):

* ``loop="find_fixed_point"``: the calls made inside that method (or submodule) of the network,
  in any grad mode; exact, in training and evaluation alike (preferred);
* ``after=k``: all calls of the forward but the last ``k`` (a JFB step: ``after=1``);
* neither (default): the calls made with gradient disabled (a loop under ``torch.no_grad()``
  followed by a step with gradient). Under an enclosing ``no_grad`` (evaluation) every call has
  gradient disabled, so the step after the loop counts as one more iteration there: give
  ``loop`` or ``after`` for the same count in training and evaluation.

Example (a network with its own loop under no_grad and a Jacobian-free step with gradient):
    >>> import torch
    >>> from torch import nn
    >>> class Net(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.stem, self.lin, self.tol = nn.Linear(3, 4), nn.Linear(4, 4), 1e-6
    ...     def f(self, z, x):                         # the map
    ...         return torch.tanh(0.5 * self.lin(z) + x)
    ...     def forward(self, x):
    ...         u, z = self.stem(x), torch.zeros(x.shape[0], 4)
    ...         with torch.no_grad():
    ...             for _ in range(100):
    ...                 z_new = self.f(z, u)
    ...                 if ((z_new - z).norm(dim=1) <= self.tol * z_new.norm(dim=1)).all():
    ...                     break
    ...                 z = z_new
    ...         return self.f(z, u)                    # one step with gradient (JFB)
    >>> _ = torch.manual_seed(0)
    >>> model = OwnLoop(Net(), map="f", tol="tol", after=1, solver_name="picard")
    >>> st = model(torch.randn(2, 3)).sum().backward() or model.last_solve_stats()
    >>> st.converged, st.nstep == st.rel_trace.shape[0], st.extra["returned"]
    (True, True, 'input of the call after the loop')
    >>> cell = cell_from_method(model.net, "f", uses=["lin"])   # or let deqbench solve it
    >>> sorted(n for n, _ in cell.named_parameters())
    ['lin.bias', 'lin.weight']
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .core.errors import ConfigError
from .solvers.base import SolverStats, make_stats, residuals

__all__ = ["LoopRecord", "MethodCell", "OwnLoop", "cell_from_method", "track_loop"]

#: an own loop whose batch max abs residual rises above this factor times the first iterate's
#: (or is not finite) has diverged (a built-in solver stops there: ``protect_thres``)
DIVERGE_FACTOR = 100.0


# -- resolving what the user names --------------------------------------------------------------


def _resolve(net: nn.Module, path: str, what: str) -> tuple[Any, Any, str]:
    """(owner, attribute, name) of the dotted ``path`` of ``net``."""
    owner: Any = net
    *head, last = path.split(".")
    try:
        for part in head:
            owner = getattr(owner, part)
        obj = getattr(owner, last)
    except AttributeError as exc:
        raise ConfigError(
            f"{what}: {type(net).__name__} has no attribute '{path}' ({exc})"
        ) from exc
    return owner, obj, last


def _first_tensor(value: Any) -> Tensor | None:
    if isinstance(value, Tensor):
        return value
    if isinstance(value, tuple | list) and value and isinstance(value[0], Tensor):
        return value[0]
    return None


def _setting(net: nn.Module, value: Any, what: str) -> Any:
    """A number, or the attribute of ``net`` a string names (read at each forward)."""
    if isinstance(value, str):
        if not hasattr(net, value):
            raise ConfigError(f"track_loop: {what}='{value}' but {type(net).__name__} has no "
                              f"attribute '{value}'")  # fmt: skip
        return getattr(net, value)
    return value


@contextlib.contextmanager
def _intercept(
    net: nn.Module,
    path: str,
    what: str,
    before: Callable[[tuple, dict], None] | None,
    after: Callable[[tuple, dict, Any], None],
) -> Iterator[None]:
    """Within the block, ``before(args, kwargs)`` / ``after(args, kwargs, output)`` run around
    every call of ``net.<path>`` (a submodule: forward hooks; a method: a wrapper set on the
    instance and removed afterwards). The network's code is not changed."""
    owner, obj, name = _resolve(net, path, what)
    if isinstance(obj, nn.Module):
        handles = []
        if before is not None:
            handles.append(
                obj.register_forward_pre_hook(
                    lambda m, a, k: before(a, k),
                    with_kwargs=True,  # type: ignore[func-returns-value]
                )
            )
        handles.append(
            obj.register_forward_hook(lambda m, a, k, o: after(a, k, o), with_kwargs=True)  # type: ignore[func-returns-value]
        )
        try:
            yield
        finally:
            for h in handles:
                h.remove()
        return
    if not callable(obj):
        raise ConfigError(f"{what}: {type(net).__name__}.{path} is a {type(obj).__name__}, "
                          "not a submodule or a method")  # fmt: skip
    had = name in vars(owner)
    old = vars(owner).get(name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if before is not None:
            before(args, kwargs)
        out = obj(*args, **kwargs)
        after(args, kwargs, out)
        return out

    object.__setattr__(owner, name, wrapper)
    try:
        yield
    finally:
        if had:
            object.__setattr__(owner, name, old)
        else:
            object.__delattr__(owner, name)


# -- measuring a model's own loop ---------------------------------------------------------------


class LoopRecord:
    """What :func:`track_loop` saw of one forward: every call of the map, and after the block
    the :class:`SolverStats` of the loop (:attr:`stats`; None when the map was not called as an
    iteration). See the module docstring for what is measured."""

    def __init__(
        self,
        tol: float,
        max_iter: int | None,
        stop_mode: str,
        loop: bool,
        after: int | None,
        name: str,
    ) -> None:
        if stop_mode not in ("rel", "abs"):
            raise ConfigError(f"track_loop: stop_mode must be 'rel' or 'abs', got {stop_mode!r}")
        if after is not None and (isinstance(after, bool) or int(after) != after or after < 0):
            raise ConfigError(f"track_loop: after must be an integer >= 0, got {after!r}")
        if loop and after is not None:
            raise ConfigError("track_loop: give loop or after, not both")
        self.tol, self.max_iter, self.stop_mode = float(tol), max_iter, stop_mode
        self.rule = "loop" if loop else ("after" if after is not None else "no_grad")
        self.after = int(after or 0)
        self.name = name
        self.stats: SolverStats | None = None
        self._fn: Callable[..., Any] | None = None  # the map, for a check evaluation
        self._reset()

    def _reset(self) -> None:
        self.abs: list[Tensor] = []
        self.rel: list[Tensor] = []
        self.grad: list[bool] = []
        self.in_loop: list[bool] = []
        self._kept: dict[int, tuple[Tensor, tuple, dict]] = {}
        self._last_iter = -1
        self._depth = 0
        self._loop_out: Tensor | None = None

    # the interception callbacks
    def _enter_loop(self, args: tuple, kwargs: dict) -> None:
        if self._depth == 0:  # a new run of the loop: the stats describe the last one
            self._reset()
        self._depth += 1

    def _exit_loop(self, args: tuple, kwargs: dict, out: Any) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0:
            self._loop_out = _first_tensor(out)

    def _call(self, args: tuple, kwargs: dict, out: Any) -> None:
        z = args[0] if args else next((v for v in kwargs.values() if isinstance(v, Tensor)), None)
        fz = _first_tensor(out)
        if not isinstance(z, Tensor) or fz is None:
            raise ConfigError(
                f"track_loop: the map {self.name} must be called as F(z, ...) with z a tensor "
                f"and return a tensor shaped like z (got {type(z).__name__} -> "
                f"{type(out).__name__})"
            )
        if fz.shape != z.shape:
            raise ConfigError(
                f"track_loop: the map {self.name} returned shape {tuple(fz.shape)} for z of "
                f"shape {tuple(z.shape)}: the map of a fixed-point loop keeps z's shape"
            )
        i = len(self.abs)
        with torch.no_grad():
            a, r = residuals(fz.detach(), z.detach())
        self.abs.append(a)
        self.rel.append(r)
        grad = torch.is_grad_enabled()
        self.grad.append(grad)
        self.in_loop.append(self._depth > 0)
        if self.rule != "loop":
            return
        # the iterate the loop returns is matched against the last iteration's input and the
        # inputs after it: keep those (references only: no copy)
        self._kept[i] = (z.detach(), args[1:], kwargs)
        if self._depth > 0:
            self._last_iter = i
        keep = {i, self._last_iter, self._last_iter + 1}
        for j in [j for j in self._kept if j not in keep]:
            del self._kept[j]

    # the result
    def _iterations(self) -> list[int]:
        n = len(self.abs)
        if self.rule == "after":
            return list(range(max(0, n - self.after)))
        if self.rule == "loop":
            return [i for i in range(n) if self.in_loop[i]]
        return [i for i in range(n) if not self.grad[i]]

    def _finish(self) -> None:
        iters = self._iterations()
        self.stats = None
        if not iters:
            return
        last = iters[-1]
        n = len(self.abs)
        check_evals = 0
        if self.rule == "loop":
            z_ret = self._loop_out
            j = None
            if z_ret is not None:
                for k in sorted(self._kept):
                    if k >= last and _same(self._kept[k][0], z_ret):
                        j = k
                        break
            if j is not None:
                ra, rr = self.abs[j], self.rel[j]
                returned = _how(j, last)
            elif z_ret is not None and self._fn is not None and last in self._kept:
                _, args, kwargs = self._kept[last]
                with torch.no_grad():
                    fz = _first_tensor(self._fn(z_ret, *args, **kwargs))
                    if fz is None or fz.shape != z_ret.shape:
                        raise ConfigError(
                            f"track_loop: the map {self.name} does not keep the shape of the "
                            "iterate the loop returned"
                        )
                    ra, rr = residuals(fz.detach(), z_ret.detach())
                check_evals, returned = 1, "loop output (one check evaluation)"
            else:  # the loop returned no tensor: the last iterate it evaluated
                j = last
                ra, rr, returned = self.abs[last], self.rel[last], "input of the last iteration"
        else:
            j = last + 1 if last + 1 < n else last  # the call after the loop, if any
            ra, rr = self.abs[j], self.rel[j]
            returned = _how(j, last)
        abs_tr = torch.stack([self.abs[i] for i in iters])
        rel_tr = torch.stack([self.rel[i] for i in iters])
        nstep = len(iters)
        extra: dict[str, Any] = {"map_calls": n, "returned": returned, "iterations": self.rule}
        if check_evals:
            extra["check_evals"] = check_evals
        if self.max_iter is not None:
            extra["max_iter"] = int(self.max_iter)
        lowest = iters.index(j) if j is not None and j in iters else -1
        self.stats = make_stats(
            self.name,
            nstep,
            abs_tr,
            rel_tr,
            ra,
            rr,
            self.tol,
            self.stop_mode,
            diverged=_blew_up(abs_tr, ra),
            lowest_step=lowest,
            stagnated=self.max_iter is not None and nstep < int(self.max_iter),
            extra=extra,
        )
        self._kept.clear()


def _blew_up(abs_tr: Tensor, returned: Tensor) -> bool:
    """Whether a loop diverged: a residual not finite, or the batch max abs residual of an
    iterate (or of the returned one) above :data:`DIVERGE_FACTOR` times the first's."""
    peaks = torch.cat([abs_tr.reshape(abs_tr.shape[0], -1).amax(dim=1), returned.max().reshape(1)])
    if not bool(torch.isfinite(peaks).all()) or not bool(torch.isfinite(abs_tr).all()):
        return True
    return bool((peaks > DIVERGE_FACTOR * peaks[0]).any()) and float(peaks[0]) > 0


def _same(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same iterate: same storage, or equal values."""
    if a.shape != b.shape:
        return False
    if a.data_ptr() == b.data_ptr() and a.stride() == b.stride():
        return True
    return bool(torch.equal(a, b.detach().to(a.dtype)))


def _how(j: int, last: int) -> str:
    return "input of the last iteration" if j == last else "input of the call after the loop"


@contextlib.contextmanager
def track_loop(
    net: nn.Module,
    map: str,
    *,
    tol: float | str,
    max_iter: int | str | None = None,
    stop_mode: str = "rel",
    loop: str | None = None,
    after: int | None = None,
    name: str = "own",
) -> Iterator[LoopRecord]:
    """Measure ``net``'s own fixed-point loop during the block: yields a :class:`LoopRecord`
    whose ``stats`` (a :class:`SolverStats`) is set when the block ends.

    Args:
        net: the network (its code is not changed; hooks or an instance wrapper are installed
            for the block only).
        map: dotted name of the submodule or method of ``net`` that is the map ``F(z, *args)``
            (z its first positional argument, its output shaped like z).
        tol: the tolerance the loop's stopping test uses, or the name of ``net``'s attribute
            holding it.
        max_iter: the loop's cap (or an attribute name); None: unknown (a loop that stops short
            of convergence is then reported ``max_iter``, not ``stagnated``).
        stop_mode: "rel" or "abs": the residual ``converged`` is judged on.
        loop: dotted name of ``net``'s method or submodule that runs the loop: the map calls
            inside it are the iterations and its return value the returned iterate.
        after: without ``loop``: the number of map calls the forward makes after its loop (a
            Jacobian-free step: 1); unset: the iterations are the calls without gradient.
        name: the ``solver`` field of the stats.

    Example:
        >>> import torch
        >>> block = torch.nn.Linear(3, 3)
        >>> net = torch.nn.Module(); net.block = block
        >>> with track_loop(net, "block", tol=1e-4, max_iter=5) as rec, torch.no_grad():
        ...     z = torch.zeros(2, 3)
        ...     for _ in range(5):
        ...         z = net.block(z)
        >>> rec.stats.nstep, tuple(rec.stats.rel_trace.shape)
        (5, (5, 2))
    """
    tol_v = _setting(net, tol, "tol")
    max_v = _setting(net, max_iter, "max_iter")
    rec = LoopRecord(float(tol_v), None if max_v is None else int(max_v), stop_mode,
                     loop is not None, after, name)  # fmt: skip
    _, fn, _ = _resolve(net, map, "track_loop: map")
    rec._fn = fn
    with contextlib.ExitStack() as stack:
        if loop is not None:
            stack.enter_context(_intercept(net, loop, "track_loop: loop", rec._enter_loop,
                                           rec._exit_loop))  # fmt: skip
        stack.enter_context(_intercept(net, map, "track_loop: map", None, rec._call))
        yield rec
    rec._finish()


class OwnLoop(nn.Module):
    """``net`` as it is, reporting the solves of its own fixed-point loop
    (:class:`deqbench.contracts.OwnSolverModel`): ``forward`` calls ``net``'s forward under
    :func:`track_loop`; :meth:`last_solve_stats` returns the last forward's stats.

    Arguments as :func:`track_loop`; ``solver_name``/``backward_name`` name the loop and the
    backward the network runs (the cells' ``solver=own:<solver_name>`` columns; declare the
    same on the factory: ``declare_defaults(own_solver=..., own_backward=...)``). ``net``'s
    parameters are this module's (``net.`` prefixed in its state dict).

    Example:
        >>> import torch
        >>> class Net(torch.nn.Module):     # a loop method, then one step with gradient
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.lin, self.tol, self.max_iter = torch.nn.Linear(4, 4), 1e-6, 100
        ...     def f(self, z, x):
        ...         return torch.tanh(0.5 * self.lin(z) + x)
        ...     @torch.no_grad()
        ...     def solve(self, x):
        ...         z = torch.zeros_like(x)
        ...         for _ in range(self.max_iter):
        ...             z = self.f(z, x)
        ...         return z
        ...     def forward(self, x):
        ...         return self.f(self.solve(x), x)
        >>> model = OwnLoop(Net(), map="f", loop="solve", tol="tol", max_iter="max_iter",
        ...                 solver_name="picard", backward_name="jfb")
        >>> with torch.no_grad():                # the same count with or without gradient
        ...     _ = model(torch.randn(2, 4))
        >>> st = model.last_solve_stats()
        >>> st.nstep, st.converged, st.extra["returned"]
        (100, True, 'input of the call after the loop')
    """

    def __init__(
        self,
        net: nn.Module,
        map: str,
        *,
        tol: float | str,
        max_iter: int | str | None = None,
        stop_mode: str = "rel",
        loop: str | None = None,
        after: int | None = None,
        solver_name: str | None = None,
        backward_name: str | None = None,
    ) -> None:
        super().__init__()
        self.net = net
        self.map, self.loop, self.after = map, loop, after
        self.tol, self.max_iter, self.stop_mode = tol, max_iter, stop_mode
        self.solver_name, self.backward_name = solver_name, backward_name
        for path, what in ((map, "map"), (loop, "loop")):
            if path is not None:
                _resolve(net, path, f"OwnLoop: {what}")
        self.__dict__["_last_stats"] = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.__dict__["_last_stats"] = None
        with track_loop(
            self.net,
            self.map,
            tol=self.tol,
            max_iter=self.max_iter,
            stop_mode=self.stop_mode,
            loop=self.loop,
            after=self.after,
            name=self.solver_name or "own",
        ) as rec:
            out = self.net(*args, **kwargs)
        self.__dict__["_last_stats"] = rec.stats
        return out

    def last_solve_stats(self) -> SolverStats | None:
        """The solve of the last forward (None: none ran)."""
        return self.__dict__.get("_last_stats")

    def extra_repr(self) -> str:
        return f"map={self.map}, loop={self.loop}, tol={self.tol}, max_iter={self.max_iter}"


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
