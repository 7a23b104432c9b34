"""What interrupts deqbench, and what is only an exception of plugin code.

Only a signal to deqbench's own process (SIGINT from Ctrl-C, SIGTERM) interrupts a command: it
arrives as :class:`Interrupted`. A ``SystemExit`` (``sys.exit()``), ``KeyboardInterrupt`` or
``GeneratorExit`` that plugin code raises (a dataset loader, a model's factory or forward, a
solver, an analysis) is that code's failure, recorded like any other exception: it neither ends
the process nor counts as the user's Ctrl-C.

To tell the two apart, a real SIGINT must never arrive as a plain ``KeyboardInterrupt``:
:func:`marked_signals` replaces Python's default SIGINT handler by one that raises
:class:`Interrupted`, and the runner's own handlers raise it too (or record the signal). Handlers
that keep that promise carry ``marks_signals = True`` (:func:`marking`). Where another handler is
in place (an embedding application's), a plain ``KeyboardInterrupt`` on the main thread is taken
for Ctrl-C, as before; off the main thread, where Python never delivers a signal, it is always
code's own.

A training step holds a signal until it ends (:func:`held_signals`): the loop writes its
checkpoint at that step boundary, then raises :class:`Interrupted`. ``--stop-after`` sets this
process's deadline (:func:`stop_after`, :func:`deadline`), at which the runner's tasks stop at
their next step boundary (:mod:`deqbench.run.checkpoints`).

Example:
    >>> from deqbench.run.interrupts import is_interruption, marked_signals
    >>> with marked_signals():
    ...     is_interruption(KeyboardInterrupt())
    False
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = [
    "Interrupted",
    "deadline",
    "fault_line",
    "held_signals",
    "holds",
    "is_interruption",
    "marked_signals",
    "marking",
    "plugin_fault",
    "stop_after",
]


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM to this process. A KeyboardInterrupt, so whatever handles Ctrl-C (the
    executors, the CLI) handles SIGTERM alike; ``exit_code`` is 128 + the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def marking(handler: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a signal handler as one under which a real SIGINT never surfaces as a plain
    ``KeyboardInterrupt`` (it raises :class:`Interrupted` or records the signal)."""
    handler.marks_signals = True  # type: ignore[attr-defined]
    return handler


@marking
def _raise_interrupted(signum: int, frame: Any) -> None:
    if holds(signum):
        return
    raise Interrupted(signum)


class _Held:
    """The state of :func:`held_signals`: whether a block holds signals, and the one that came."""

    def __init__(self) -> None:
        self.active = False
        self.signum: int | None = None

    def take(self) -> int | None:
        signum, self.signum = self.signum, None
        return signum


_HELD = _Held()


@contextmanager
def held_signals(before_raise: Callable[[], Any] | None = None) -> Iterator[None]:
    """Inside, on the main thread: the first SIGINT/SIGTERM that reaches one of deqbench's
    marking handlers is held, so that the block (a training step) ends whole; at its end
    ``before_raise()`` runs (e.g. writes a checkpoint) and :class:`Interrupted` is raised. A
    block left by an exception raises :class:`Interrupted` instead of it, without
    ``before_raise`` (its state is not whole). A second signal inside the block raises at once.
    Elsewhere (other threads, where no signal arrives, or inside another such block) it holds
    nothing."""
    if _HELD.active or threading.current_thread() is not threading.main_thread():
        yield
        return
    _HELD.active, _HELD.signum = True, None
    try:
        yield
    except BaseException as exc:
        _HELD.active = False
        signum = _HELD.take()
        if signum is not None and not isinstance(exc, Interrupted):
            raise Interrupted(signum) from exc
        raise
    _HELD.active = False
    signum = _HELD.take()
    if signum is not None:
        if before_raise is not None:
            before_raise()
        raise Interrupted(signum)


def holds(signum: int) -> bool:
    """For a marking signal handler: True when ``signum`` was held for a :func:`held_signals`
    block (the handler returns), False when it must raise now."""
    if (
        _HELD.active
        and _HELD.signum is None
        and threading.current_thread() is threading.main_thread()
    ):
        _HELD.signum = signum
        return True
    return False


_DEADLINE: list[float | None] = [None]


@contextmanager
def stop_after(seconds: float | None) -> Iterator[None]:
    """Inside, this process's runs stop their tasks ``seconds`` from now (``--stop-after``):
    a training task writes its checkpoint at the next step boundary past that time and ends
    unfinished, tasks not started yet do not start (:func:`deadline`). None: no deadline."""
    old = _DEADLINE[0]
    if seconds is not None:
        import time

        _DEADLINE[0] = time.time() + float(seconds)
    try:
        yield
    finally:
        _DEADLINE[0] = old


def deadline() -> float | None:
    """The epoch time at which this process's runs stop their tasks (:func:`stop_after`), or
    None."""
    return _DEADLINE[0]


def _marked() -> bool:
    """Whether this process's SIGINT handler is a marking one (:func:`marking`)."""
    try:
        return bool(getattr(signal.getsignal(signal.SIGINT), "marks_signals", False))
    except (ValueError, OSError):  # pragma: no cover - no signal support
        return False


@contextmanager
def marked_signals() -> Iterator[None]:
    """Inside, on the main thread where SIGINT has Python's default handler: a SIGINT raises
    :class:`Interrupted` (the previous handler comes back afterwards). Elsewhere a no-op."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    old = signal.signal(signal.SIGINT, _raise_interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def is_interruption(exc: BaseException) -> bool:
    """Whether ``exc`` means a signal to this process: :class:`Interrupted`, or a plain
    ``KeyboardInterrupt`` on the main thread where no marking handler is in place (it may be
    Ctrl-C there). Everything else (``SystemExit``, ``GeneratorExit``, a ``KeyboardInterrupt``
    that code raised) is an exception of the code that raised it."""
    if isinstance(exc, Interrupted):
        return True
    if not isinstance(exc, KeyboardInterrupt):
        return False
    if threading.current_thread() is not threading.main_thread():
        return False
    return not _marked()


def plugin_fault(exc: BaseException) -> str:
    """``Type: message`` of ``exc``; for one that is not an ``Exception``, with what plugin code
    did: ``SystemExit: 3 (plugin code called sys.exit(3))``, ``KeyboardInterrupt (raised by
    plugin code, no signal to deqbench)``."""
    text = " ".join(str(exc).split())
    head = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    if isinstance(exc, Exception):
        return head
    if isinstance(exc, SystemExit):
        code = "" if exc.code is None else repr(exc.code)
        return f"{head} (plugin code called sys.exit({code}))"
    if isinstance(exc, KeyboardInterrupt):
        return f"{head} (raised by plugin code, no signal to deqbench)"
    return f"{head} (raised by plugin code)"


def fault_line(exc: BaseException) -> str:
    """:func:`plugin_fault` with where it was raised: the innermost frame of the traceback
    (``at plug.py:12 in forward``)."""
    import os
    import traceback

    tb = traceback.extract_tb(exc.__traceback__)
    where = (
        f" at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno} in {tb[-1].name}" if tb else ""
    )
    return plugin_fault(exc) + where
