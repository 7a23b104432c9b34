"""A network's own fixed-point loop, measured: :func:`track_loop`, :class:`LoopRecord`,
:class:`OwnLoop` (see :mod:`deqbench.adapters` for what is measured)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from ..core import own_solves, trees
from ..core.errors import ConfigError
from ..solvers.base import SolverStats, check_stop, make_stats, residuals, rule_value
from .own_backward import AdjointRecord, OwnBackward

__all__ = ["DIVERGE_FACTOR", "LoopRecord", "OwnLoop", "OwnLoopError", "track_loop"]

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
    """A number, or the attribute of ``net`` a string names (a dotted path; read at each
    forward)."""
    if isinstance(value, str):
        return _resolve(net, value, f"track_loop: {what}")[1]
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


class OwnLoopError(ConfigError):
    """A network's own loop that deqbench cannot read (its map's iterate, the value the loop
    returned): one line, starting with the clause ``[model.own_loop]``."""

    clause = "model.own_loop"

    def __init__(self, message: str) -> None:
        super().__init__(f"[{self.clause}] {message}")


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
        *,
        state: str | Callable[[Any], Any] | None = None,
        returned: str | Callable[[Any], Any] | None = None,
        stop: str | None = None,
        net: nn.Module | None = None,
        adjoint: AdjointRecord | None = None,
    ) -> None:
        if stop_mode not in ("rel", "abs"):
            raise ConfigError(f"track_loop: stop_mode must be 'rel' or 'abs', got {stop_mode!r}")
        if after is not None and (isinstance(after, bool) or int(after) != after or after < 0):
            raise ConfigError(f"track_loop: after must be an integer >= 0, got {after!r}")
        if loop and after is not None:
            raise ConfigError("track_loop: give loop or after, not both")
        if returned is not None and not loop:
            raise ConfigError("track_loop: returned= reads the return value of loop=: give loop")
        if stop is not None:
            check_stop(stop)
        self.tol, self.max_iter, self.stop_mode = float(tol), max_iter, stop_mode
        self.rule = "loop" if loop else ("after" if after is not None else "no_grad")
        self.after = int(after or 0)
        self.name = name
        self.own_stop = stop  # the rule the library's own loop stops on (None: not declared)
        self.judge = own_solves.run_rule()  # the rule deqbench judges it under: the run's
        try:
            self.state = trees.selector(state, "state")
            self.returned = trees.selector(returned, "returned")
        except TypeError as exc:
            raise ConfigError(f"track_loop: {exc}") from exc
        self.net, self.adjoint = net, adjoint
        self.stats: SolverStats | None = None
        self._fn: Callable[..., Any] | None = None  # the map, for a check evaluation
        self._purity = own_solves.probing_purity()
        self._calls_seen = 0
        self._reset()

    def _reset(self) -> None:
        self.abs: list[Tensor] = []
        self.rel: list[Tensor] = []
        self.grad: list[bool] = []
        self.in_loop: list[bool] = []
        self._kept: dict[int, tuple[Any, Tensor, tuple, dict]] = {}
        self._last_iter = -1
        self._depth = 0
        self._loop_out: Any = None
        self._ret_tree: Any = None
        self._loop_ran = False

    def read_state(self, tree: Any, what: str) -> Tensor:
        """The state tensor of an iterate (``state=``), or an :class:`OwnLoopError` naming
        what was got."""
        try:
            return trees.read(tree, self.state)
        except (LookupError, ValueError, TypeError, AttributeError) as exc:
            hint = "" if self.state is not None else " (give state=, e.g. state='est.0')"
            raise OwnLoopError(
                f"track_loop: cannot read the state of {what} of the map {self.name} from "
                f"{trees.describe(tree)}: {exc}{hint}"
            ) from None

    # the interception callbacks
    def _enter_loop(self, args: tuple, kwargs: dict) -> None:
        if self._depth == 0:  # a new run of the loop: the stats describe the last one
            self._reset()
        self._depth += 1

    def _exit_loop(self, args: tuple, kwargs: dict, out: Any) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0:  # read the iterate it returned now: an error points at the loop
            self._loop_out, self._loop_ran = out, True
            self._ret_tree = self._returned_tree(self._last_iter) if self._last_iter >= 0 else None

    def _before_call(self, args: tuple, kwargs: dict) -> None:
        """The purity probe: the buffers before the second iteration's call."""
        self._calls_seen += 1
        if self._purity is None or self.net is None or self._calls_seen != 2:
            return
        self._buffers = {n: b.detach().clone() for n, b in self.net.named_buffers()}

    def _check_buffers(self) -> None:
        before = self.__dict__.pop("_buffers", None)
        if before is None or self._purity is None or self.net is None:
            return
        after = dict(self.net.named_buffers())
        for n, b in before.items():
            if n in after and _buffer_changed(b, after[n]):
                self._purity.append(n)
                if after[n].shape == b.shape:
                    after[n].data.copy_(b)  # put back

    def _call(self, args: tuple, kwargs: dict, out: Any) -> None:
        self._check_buffers()
        tree = args[0] if args else next(iter(kwargs.values()), None)
        z = self.read_state(tree, "the input")
        fz = (_first_tensor(out) if isinstance(tree, Tensor) and self.state is None
              else self.read_state(out, "the output"))  # fmt: skip
        if fz is None:
            raise OwnLoopError(
                f"track_loop: the map {self.name} returned {trees.describe(out)} for z of shape "
                f"{tuple(z.shape)}: it must return the next iterate, shaped like z"
            )
        if fz.shape != z.shape:
            raise OwnLoopError(
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
        if grad and fz.requires_grad and self.adjoint is not None:
            self.adjoint.attach(tree, z, fz, args[1:], kwargs)
        if self.rule != "loop":
            return
        # the iterate the loop returns is matched against the last iteration's input and the
        # inputs after it: keep those (references only: no copy)
        self._kept[i] = (tree, z.detach(), args[1:], kwargs)
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

    def _returned_tree(self, last: int) -> Any:
        """The iterate the loop returned, in the form the map takes (``returned=``; default:
        the return value, else its first element, when its state has the iterates' shape)."""
        out, like = self._loop_out, self._kept[last][1] if last in self._kept else None
        if self.returned is not None:
            try:
                tree = self.returned(out)
            except (LookupError, TypeError, AttributeError, ValueError) as exc:
                raise OwnLoopError(f"track_loop: returned= cannot read the value the loop "
                                   f"returned, {trees.describe(out)}: {exc}") from None  # fmt: skip
            self.read_state(tree, "the iterate the loop returned")
            return tree
        for cand in (out, out[0] if isinstance(out, tuple | list) and out else None):
            try:
                z = trees.read(cand, self.state)
            except (LookupError, ValueError, TypeError, AttributeError):
                continue
            if like is None or z.shape == like.shape:
                return cand
        raise OwnLoopError(
            f"track_loop: the loop returned {trees.describe(out)}, from which no iterate shaped "
            f"like the map's could be read{'' if self.state else ' (state: all its tensors)'}: "
            "give returned= (a dotted path or a callable, e.g. returned='0' for the first "
            "element)"
        )

    def _finish(self) -> None:
        iters = self._iterations()
        self.stats = None
        if not iters:
            return
        last = iters[-1]
        n = len(self.abs)
        check_evals = 0
        extra: dict[str, Any] = {"map_calls": n, "iterations": self.rule}
        if self.rule == "loop":
            if not self._loop_ran:
                raise OwnLoopError(f"track_loop: the map {self.name} was called inside the loop "
                                   "but the loop did not return")  # fmt: skip
            tree = self._ret_tree
            z_ret = self.read_state(tree, "the iterate the loop returned")
            extra["calls_after_loop"] = n - 1 - last
            cands = [k for k in sorted(self._kept) if k >= last]
            j = next((k for k in cands if _same(self._kept[k][1], z_ret, storage=True)),
                     next((k for k in cands if _same(self._kept[k][1], z_ret)), None))  # fmt: skip
            if j is not None:
                ra, rr = self.abs[j], self.rel[j]
                returned = _how(j, last)
            else:  # evaluate the map once more at the returned iterate
                _, _, args, kwargs = self._kept[last]
                with torch.no_grad():
                    out = self._fn(tree, *args, **kwargs) if self._fn is not None else None
                    fz = (_first_tensor(out) if isinstance(tree, Tensor) and self.state is None
                          else self.read_state(out, "the output"))  # fmt: skip
                    if fz is None or fz.shape != z_ret.shape:
                        raise OwnLoopError(
                            f"track_loop: the map {self.name} does not keep the shape of the "
                            "iterate the loop returned"
                        )
                    ra, rr = residuals(fz.detach(), z_ret.detach())
                check_evals, returned = 1, "loop output (one check evaluation)"
        else:
            j = last + 1 if last + 1 < n else last  # the call after the loop, if any
            ra, rr = self.abs[j], self.rel[j]
            returned = _how(j, last)
        abs_tr = torch.stack([self.abs[i] for i in iters])
        rel_tr = torch.stack([self.rel[i] for i in iters])
        nstep = len(iters)
        extra["returned"] = returned
        if check_evals:
            extra["check_evals"] = check_evals
        if self.max_iter is not None:
            extra["max_iter"] = int(self.max_iter)
        if self.own_stop is not None:  # the library's own verdict, under its own rule
            res = float(rule_value(ra, rr, self.own_stop, self.stop_mode))
            extra.update(own_rule=self.own_stop, own_residual=res,
                         own_converged=bool(res < self.tol))  # fmt: skip
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
            stop=self.judge,
        )
        self._kept.clear()


def _buffer_changed(a: Tensor, b: Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return True
    if a.is_floating_point() or a.is_complex():
        return not bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return not torch.equal(a, b)


def _blew_up(abs_tr: Tensor, returned: Tensor) -> bool:
    """Whether a loop diverged: a residual not finite, or the batch max abs residual of an
    iterate (or of the returned one) above :data:`DIVERGE_FACTOR` times the first's."""
    peaks = torch.cat([abs_tr.reshape(abs_tr.shape[0], -1).amax(dim=1), returned.max().reshape(1)])
    if not bool(torch.isfinite(peaks).all()) or not bool(torch.isfinite(abs_tr).all()):
        return True
    return bool((peaks > DIVERGE_FACTOR * peaks[0]).any()) and float(peaks[0]) > 0


def _same(a: Tensor, b: Tensor, storage: bool = False) -> bool:
    """Whether ``a`` and ``b`` are the same iterate: same storage, or (unless ``storage``)
    equal values."""
    if a.shape != b.shape:
        return False
    if a.data_ptr() == b.data_ptr() and a.stride() == b.stride():
        return True
    return not storage and bool(torch.equal(a, b.detach().to(a.dtype)))


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
    state: str | Callable[[Any], Any] | None = None,
    returned: str | Callable[[Any], Any] | None = None,
    stop: str | None = None,
    adjoint: OwnBackward | None = None,
    backward_name: str = "own",
) -> Iterator[LoopRecord]:
    """Measure ``net``'s own fixed-point loop during the block: yields a :class:`LoopRecord`
    whose ``stats`` (a :class:`SolverStats`) is set when the block ends.

    Args:
        net: the network (its code is not changed; hooks or an instance wrapper are installed
            for the block only).
        map: dotted name of the submodule or method of ``net`` that is the map ``F(z, *args)``
            (z its first positional argument: a tensor, or a dict / tuple / dataclass of
            tensors; its output of the same form, or, for a tensor z, a tuple whose first
            element is the next z).
        tol: the tolerance the loop's stopping test uses, or the name (dotted path) of
            ``net``'s attribute holding it.
        max_iter: the loop's cap (or an attribute name); None: unknown (a loop that stops short
            of convergence is then reported ``max_iter``, not ``stagnated``).
        stop_mode: "rel" or "abs": the residual ``converged`` is judged on.
        loop: dotted name of ``net``'s method or submodule that runs the loop: the map calls
            inside it are the iterations, those after it are not (a Jacobian-free step, the
            step with gradient of an implicit backward: ``extra["calls_after_loop"]``), and
            its return value gives the returned iterate.
        after: without ``loop``: the number of map calls the forward makes after its loop (a
            Jacobian-free step: 1); unset: the iterations are the calls without gradient.
        name: the ``solver`` field of the stats.
        state: which tensor of an iterate the loop converges (the residual's ``z``): a dotted
            path (``"est.0"``: ``X["est"][0]``) or a callable; default: the iterate when it is
            a tensor, else all its tensors (:mod:`deqbench.core.trees`).
        returned: with ``loop``: the iterate the loop returned, read from its return value
            (a dotted path or a callable; ``"0"``: the first element of a returned tuple), in
            the form the map takes; default: the return value, else its first element, when
            its state is shaped like the iterates'. A return value it cannot read raises an
            :class:`OwnLoopError` ([model.own_loop]) naming what it got.
        stop: the stop rule the library's own test uses (``sample_max`` | ``batch_fro`` |
            ``batch_mean``, :data:`deqbench.solvers.base.STOP_RULES`): its verdict is kept in
            ``extra["own_converged"]`` beside deqbench's, which follows the run's rule
            (:func:`deqbench.core.own_solves.judged_under`; ``sample_max`` by default).
        adjoint: measure the library's own backward solve too (:class:`OwnBackward`:
            ``rec.adjoint.stats``, set during the backward), named ``backward_name``.

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
                     loop is not None, after, name, state=state, returned=returned, stop=stop,
                     net=net)  # fmt: skip
    _, fn, _ = _resolve(net, map, "track_loop: map")
    rec._fn = fn
    if adjoint is not None:
        rec.adjoint = adjoint.record(net, fn, rec.state, backward_name)
    with contextlib.ExitStack() as stack:
        if loop is not None:
            stack.enter_context(_intercept(net, loop, "track_loop: loop", rec._enter_loop,
                                           rec._exit_loop))  # fmt: skip
        stack.enter_context(_intercept(net, map, "track_loop: map", rec._before_call, rec._call))
        yield rec
    rec._finish()


class OwnLoop(nn.Module):
    """``net`` as it is, reporting the solves of its own fixed-point loop
    (:class:`deqbench.contracts.OwnSolverModel`): ``forward`` calls ``net``'s forward under
    :func:`track_loop`; :meth:`last_solve_stats` returns the last forward's stats, and with
    ``adjoint=`` (:class:`OwnBackward`) :meth:`last_backward_solve_stats` the last backward's.

    Arguments as :func:`track_loop`; ``solver_name``/``backward_name`` name the loop and the
    backward the network runs (the cells' ``solver=own:<solver_name>`` columns; declare the
    same on the factory: ``declare_defaults(own_solver=..., own_backward=...)``, where a
    ``{param}`` template names it after a parameter of the factory). ``net``'s parameters are
    this module's (``net.`` prefixed in its state dict).

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
        >>> st.nstep, st.converged, st.extra["returned"], st.extra["calls_after_loop"]
        (100, True, 'input of the call after the loop', 1)
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
        state: str | Callable[[Any], Any] | None = None,
        returned: str | Callable[[Any], Any] | None = None,
        stop: str | None = None,
        adjoint: OwnBackward | None = None,
        solver_name: str | None = None,
        backward_name: str | None = None,
    ) -> None:
        super().__init__()
        self.net = net
        self.map, self.loop, self.after = map, loop, after
        self.tol, self.max_iter, self.stop_mode = tol, max_iter, stop_mode
        self.solver_name, self.backward_name = solver_name, backward_name
        self.__dict__.update(state=state, returned=returned, stop=stop, adjoint=adjoint)
        for path, what in ((map, "map"), (loop, "loop")):
            if path is not None:
                _resolve(net, path, f"OwnLoop: {what}")
        if adjoint is not None and not isinstance(adjoint, OwnBackward):
            raise ConfigError(f"OwnLoop: adjoint must be an OwnBackward, got {adjoint!r}")
        self.__dict__["_last_stats"] = None
        self.__dict__["_last_adjoint"] = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.__dict__["_last_stats"] = None
        self.__dict__["_last_adjoint"] = None
        with track_loop(
            self.net,
            self.map,
            tol=self.tol,
            max_iter=self.max_iter,
            stop_mode=self.stop_mode,
            loop=self.loop,
            after=self.after,
            name=self.solver_name or "own",
            state=self.__dict__["state"],
            returned=self.__dict__["returned"],
            stop=self.__dict__["stop"],
            adjoint=self.__dict__["adjoint"],
            backward_name=self.backward_name or "own",
        ) as rec:
            out = self.net(*args, **kwargs)
        self.__dict__["_last_stats"] = rec.stats
        self.__dict__["_last_adjoint"] = rec.adjoint
        return out

    def last_solve_stats(self) -> SolverStats | None:
        """The solve of the last forward (None: none ran)."""
        return self.__dict__.get("_last_stats")

    def last_backward_solve_stats(self) -> SolverStats | None:
        """The library's own adjoint solve in the last backward (None: not measured, or no
        backward since the last forward; see :class:`OwnBackward`)."""
        rec: AdjointRecord | None = self.__dict__.get("_last_adjoint")
        return None if rec is None else rec.stats

    def extra_repr(self) -> str:
        return f"map={self.map}, loop={self.loop}, tol={self.tol}, max_iter={self.max_iter}"
