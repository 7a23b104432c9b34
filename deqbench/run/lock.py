"""One writer per run directory: ``RUN_DIR/run.lock``.

A run (new or ``--resume``) holds the lock from before it writes anything until it ends, on
every exit path. The lock file is JSON naming its holder::

    {"pid": 4242, "host": "node7", "started": "2025-01-01T12:00:00", "command": ["deqbench", ...]}

It is created whole and exclusively (written to a private temp file, then hard-linked to
``run.lock``, which fails if the name exists; ``O_CREAT | O_EXCL`` where the file system has no
hard links), and the holder keeps an exclusive ``flock`` on it while the run lives. A second
writer is refused with :class:`RunLocked` (one line naming the holder; the CLI exits 2). A lock
left by a process that died on this host (no ``flock`` held, PID not alive) is taken over with
a note; a lock written on another host is reported and never taken over (its PID means nothing
here): delete ``run.lock`` by hand once that run is gone.

Example:
    >>> with RunLock("results/smoke/20250101-120000") as lock:   # doctest: +SKIP
    ...     ...  # write the run directory; lock.note says whether a stale lock was taken over
"""

from __future__ import annotations

import json
import os
import socket
import stat
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.errors import DeqbenchError

try:  # POSIX; elsewhere the PID check alone decides
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCK_NAME", "RunLock", "RunLocked", "Holder"]

LOCK_NAME = "run.lock"
#: how long to wait for a concurrent take-over or a half-created lock to settle (seconds)
SETTLE_S = 2.0


class RunLocked(DeqbenchError):
    """Another process writes (or wrote, on another host) this run directory."""


@dataclass(frozen=True)
class Holder:
    """Who holds a lock, as its file says."""

    pid: int | None
    host: str
    started: str

    def describe(self) -> str:
        return f"PID {self.pid if self.pid is not None else '?'} on host {self.host or '?'}, " \
               f"started {self.started or '?'}"  # fmt: skip


def _host() -> str:
    return socket.gethostname()


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: beyond any PID (20 digits)
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    except OSError:
        return False
    return True


def _try_flock(fd: int) -> bool:
    """True when this process now holds an exclusive flock on ``fd`` (or flock is missing)."""
    if fcntl is None:  # pragma: no cover
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:  # a file system without flock: the PID check decides
        return True
    return True


def _parse(text: str) -> Holder | None:
    try:
        obj = json.loads(text)
        pid = obj.get("pid")
        return Holder(
            int(pid) if pid is not None else None,
            str(obj.get("host") or ""),
            str(obj.get("started") or ""),
        )
    except (ValueError, TypeError, AttributeError):
        return None


def read_holder(run_dir: str | Path) -> Holder | None:
    """The holder named by ``run_dir/run.lock`` (None: no lock file, or unreadable)."""
    try:
        return _parse((Path(run_dir) / LOCK_NAME).read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return None


class RunLock:
    """The exclusive lock of one run directory; a context manager (:meth:`acquire` /
    :meth:`release`). ``note`` is a one-line message when a stale lock was taken over."""

    def __init__(self, run_dir: str | Path, command: list[str] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self.command = command
        self.fd: int | None = None
        self.note: str | None = None
        self.holder: Holder | None = None

    # -- acquiring -------------------------------------------------------------------------
    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def acquire(self) -> RunLock:
        """Take the lock or raise :class:`RunLocked` naming the holder."""
        if self.fd is not None:
            return self
        deadline = time.monotonic() + SETTLE_S
        while True:
            if self._create():
                return self
            verdict = self._inspect()
            if verdict == "retry":
                if time.monotonic() > deadline:
                    raise RunLocked(self._held_message(read_holder(self.run_dir), settling=True))
                time.sleep(0.02)
                continue
            if verdict == "created":
                return self

    def _content(self) -> bytes:
        self.holder = Holder(os.getpid(), _host(), time.strftime("%Y-%m-%dT%H:%M:%S"))
        obj = {
            "pid": self.holder.pid,
            "host": self.holder.host,
            "started": self.holder.started,
            "command": self.command,
        }
        return (json.dumps(obj) + "\n").encode("utf-8")

    def _create(self, replace: bool = False) -> bool:
        """Create ``run.lock`` whole, flocked by this process; False if the name exists.
        ``replace``: put it in place of the (stale) file there now, atomically (``rename``)."""
        tmp = self.run_dir / f".{LOCK_NAME}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
        placed = no_links = False
        try:
            _try_flock(fd)  # a fresh inode: nobody else can hold it
            _write_all(fd, self._content())
            os.fsync(fd)
            if replace:
                os.replace(tmp, self.path)
                placed = True
            else:
                try:
                    os.link(tmp, self.path)
                    placed = True
                except FileExistsError:
                    pass
                except OSError:  # no hard links on this file system
                    no_links = True
        finally:
            if not (placed and replace):
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
            if not placed:
                os.close(fd)
        if placed:
            self.fd = fd
            return True
        return self._create_excl() if no_links else False

    def _create_excl(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
        except FileExistsError:
            return False
        _try_flock(fd)
        _write_all(fd, self._content())
        os.fsync(fd)
        self.fd = fd
        return True

    def _inspect(self) -> str:
        """Look at an existing lock: raise RunLocked (held), or take over a stale one
        (``created``), or ``retry`` (it vanished, is being created or taken over). A directory,
        FIFO or other non-file under the lock's name is refused (RunLocked, one line) before it
        is opened: a FIFO would block the read."""
        try:
            mode = os.stat(self.path).st_mode
        except FileNotFoundError:
            return "retry"
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else (
                "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "not a regular file")  # fmt: skip
            raise RunLocked(
                f"{self.path} is {kind}, not deqbench's lock file, so this run directory cannot "
                "be locked: if no deqbench run is writing it, remove it and run again"
            )
        try:
            fd = os.open(self.path, os.O_RDWR | getattr(os, "O_NONBLOCK", 0))
        except FileNotFoundError:
            return "retry"
        try:
            free = _try_flock(fd)
            holder = _parse(_read_all(fd).decode("utf-8", errors="replace"))
            if not _same_file(fd, self.path):
                return "retry"  # released or taken over meanwhile
            here = _host()
            if holder is not None and holder.host not in ("", here):
                raise RunLocked(
                    f"{self.run_dir}: locked by a deqbench run on another host "
                    f"({holder.describe()}); a lock of another host is never taken over: if "
                    f"that run has ended, delete {self.path} and run again"
                )
            own = holder is not None and holder.pid == os.getpid()
            dead = (
                holder is not None
                and holder.pid is not None
                and not own
                and (not _pid_alive(holder.pid))
            )
            if not free:
                if own:
                    raise RunLocked(self._held_message(holder, ", this very process"))
                if dead or holder is None:  # a take-over (or a creation) is under way
                    return "retry"
                raise RunLocked(self._held_message(holder))
            if holder is None:
                if time.time() - os.fstat(fd).st_mtime < SETTLE_S:
                    return "retry"  # being written (file systems without hard links)
            elif not (dead or own):
                raise RunLocked(
                    self._held_message(holder).replace(
                        "; wait for it",
                        "; it holds no flock on "
                        f"the file: if no deqbench runs there, delete {self.path}; else wait for it",
                    )
                )
            # stale: ours to take over. We hold its flock, so a rival taker waits on it and
            # then finds our file under the name, which never disappears meanwhile.
            what = holder.describe() if holder is not None else "an unreadable lock file"
            self._create(replace=True)
            self.note = (
                f"{self.run_dir}: took over the stale lock of {what}; that process is no longer "
                "running"
            )
            return "created"
        finally:
            os.close(fd)

    def _held_message(self, holder: Holder | None, extra: str = "", settling: bool = False) -> str:
        who = holder.describe() if holder is not None else "a process whose lock file is unreadable"
        tail = (
            "; wait for it to end or stop it (Ctrl-C or kill PID: its finished tasks stay on "
            "disk), then resume"
        )
        if settling:
            tail = f"; the lock did not settle within {SETTLE_S:g} s: if no deqbench runs there, " \
                   f"delete {self.path}"  # fmt: skip
        return f"{self.run_dir}: another deqbench run is writing this run directory ({who}{extra}){tail}"

    # -- releasing -------------------------------------------------------------------------
    def release(self) -> None:
        """Remove ``run.lock`` (if it is still ours) and drop the flock. Idempotent."""
        fd, self.fd = self.fd, None
        if fd is None:
            return
        try:
            if _same_file(fd, self.path):
                os.unlink(self.path)
        except OSError:
            pass
        finally:
            os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _read_all(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks)
