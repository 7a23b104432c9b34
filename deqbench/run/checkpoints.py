"""Mid-task checkpoints: a training task longer than one call continues where it stopped.

A task of a run directory trains with a :class:`TaskCheckpoint` (made by
:mod:`deqbench.run.task`). At a step boundary of the training loop (after an optimiser step and
its hooks, or after an epoch's evaluation) it writes
``<run_dir>/checkpoints/<cell_id>-seed<N>.pt`` (temp file + ``os.replace``, like the rest of the
run directory) when ``train.checkpoint_every`` seconds of training passed since the last one, when
a SIGINT/SIGTERM came during the step (:func:`deqbench.run.interrupts.held_signals`), and when the
``--stop-after`` deadline passed (the task then ends unfinished: :class:`Suspended`). The file
holds everything the rest of the task depends on: the model's, optimiser's and LR scheduler's
states, the RNG states (torch CPU and CUDA, NumPy, Python, the data order's generator and the
epoch's batch order), the loop's counters and epoch sums, the history, and the task's rows,
solve tallies and analyses so far (pickled with the live model, context and data linked, not
copied). ``--resume`` continues an unfinished task from it: the finished task's rows are those of
an uninterrupted run (bitwise, but for timings). The coordinator deletes it once the task's rows
are written.

A checkpoint that does not load (corrupt, another format, or made for another task: another
cell, seed, suite settings, dtype, device type or deqbench version, see
:func:`task_fingerprint`) is never used: the task runs from scratch and says so in one note. A
task whose state cannot be pickled (e.g. an analysis holding a lambda) trains without
checkpoints, with one note.
"""

from __future__ import annotations

import io
import pickle
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: the checkpoint file's layout version
FORMAT = 1
#: the run directory's folder of checkpoints
FOLDER = "checkpoints"


class Suspended(Exception):
    """A task stopped at a step boundary because the ``--stop-after`` deadline passed; its
    message says where (and whether a checkpoint holds its state)."""


def checkpoint_path(run_dir: str | Path, cell_id: str, seed: int) -> Path:
    """``<run_dir>/checkpoints/<cell_id>-seed<N>.pt``."""
    return Path(run_dir) / FOLDER / f"{cell_id}-seed{seed}.pt"


def remove_checkpoint(run_dir: str | Path, cell_id: str, seed: int) -> None:
    """Delete a task's checkpoint (its rows are written); nothing when there is none."""
    try:
        checkpoint_path(run_dir, cell_id, seed).unlink()
    except OSError:
        pass


def rng_states() -> dict[str, Any]:
    """The global RNG states: torch CPU, torch CUDA (every device, where CUDA is initialised),
    NumPy and Python."""
    import numpy as np
    import torch

    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return {
        "torch": torch.get_rng_state(),
        "cuda": cuda,
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore what :func:`rng_states` returned."""
    import numpy as np
    import torch

    torch.set_rng_state(states["torch"])
    if states.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    np.random.set_state(states["numpy"])
    random.setstate(states["python"])


def dumps_linked(obj: Any, live: dict[str, Any]) -> bytes:
    """Pickle ``obj`` with the objects of ``live`` (name -> object: the model, its parameters,
    the context ...) stored by name, so that :func:`loads_linked` links them to the live
    objects of the resumed task instead of copies."""
    ids = {id(v): k for k, v in live.items()}

    class _Pickler(pickle.Pickler):
        def persistent_id(self, o: Any) -> str | None:
            return ids.get(id(o))

    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def loads_linked(data: bytes, live: dict[str, Any]) -> Any:
    """Unpickle what :func:`dumps_linked` wrote, its named objects taken from ``live``."""

    class _Unpickler(pickle.Unpickler):
        def persistent_load(self, pid: Any) -> Any:
            if pid not in live:
                raise pickle.UnpicklingError(f"the checkpoint links to '{pid}', which is not here")
            return live[pid]

    return _Unpickler(io.BytesIO(data)).load()


class TaskCheckpoint:
    """One task's checkpoint: where it goes, how often, and what the task adds to it.

    Args:
        path: the file (None: no run directory; nothing is written, a deadline still stops).
        every: seconds of training between periodic checkpoints (None or <= 0: none; a held
            signal or the deadline still writes one where ``path`` is set).
        fingerprint: the task's identity (:func:`task_fingerprint`), checked on load.
        stop_at: the ``--stop-after`` deadline (epoch seconds) or None.

    ``capture()`` (set by the task) returns its own state as bytes (rows, analyses, tallies);
    ``restore(bytes)`` puts it back; ``wall()``: the task's seconds so far (the resumed task's
    ``wall_time`` adds them). ``notes``: lines for the run's log (a checkpoint ignored or
    not written, a resume).
    """

    def __init__(
        self,
        path: Path | None,
        every: float | None,
        fingerprint: str,
        stop_at: float | None = None,
    ) -> None:
        self.path, self.fingerprint, self.stop_at = path, fingerprint, stop_at
        self.every = every if every is not None and every > 0 else None
        self.loaded: dict[str, Any] | None = None
        self.capture: Callable[[], bytes] | None = None
        self.restore: Callable[[bytes], None] | None = None
        self.wall: Callable[[], float] | None = None  # the task's seconds so far
        self.notes: list[str] = []
        self.off: str | None = None  # why no checkpoint can be written
        self.saved_step: int | None = None  # the step of the last checkpoint written
        self._last = time.monotonic()

    @property
    def writes(self) -> bool:
        """Whether a checkpoint can be written."""
        return self.path is not None and self.off is None

    def due(self) -> bool:
        """A periodic checkpoint is due (``every`` seconds since the last one, or the start)."""
        return (
            self.writes and self.every is not None and time.monotonic() - self._last >= self.every
        )

    def deadline_passed(self) -> bool:
        return self.stop_at is not None and time.time() >= self.stop_at

    def load(self) -> dict[str, Any] | None:
        """The checkpoint to continue from, or None (none, or one that is not used: a note
        says why and the task runs from scratch)."""
        if self.path is None or not self.path.exists():
            return None
        import torch

        why = ""
        try:
            with open(self.path, "rb") as fh:
                state = torch.load(fh, map_location="cpu", weights_only=False)
        except Exception as exc:  # noqa: BLE001 - a torn or foreign file is not used
            state, why = (
                None,
                f"unreadable ({type(exc).__name__}: {' '.join(str(exc).split())[:120]})",
            )
        if state is not None:
            if not isinstance(state, dict) or state.get("format") != FORMAT:
                why = "another checkpoint format"
            elif state.get("fingerprint") != self.fingerprint:
                why = "made for another task (cell, seed or suite settings differ)"
        if why:
            self.notes.append(
                f"checkpoint {self.path.name} ignored: {why}; the task runs from scratch "
                "(the file is replaced by its next checkpoint)"
            )
            return None
        self.loaded = state
        return state

    def save(self, train_state: dict[str, Any], step: int) -> bool:
        """Write the checkpoint (the training loop's state, and the task's ``capture()``);
        True when written. A state that cannot be pickled turns checkpoints off for the task,
        an error writing the file (disk full) skips this one; each with a note."""
        if not self.writes:
            return False
        import torch

        assert self.path is not None
        try:
            payload = {
                "format": FORMAT,
                "fingerprint": self.fingerprint,
                "step": step,
                "wall": self.wall() if self.wall is not None else 0.0,
                "train": train_state,
                "task": self.capture() if self.capture is not None else None,
            }
            buf = io.BytesIO()
            torch.save(payload, buf)
        except Exception as exc:  # noqa: BLE001 - e.g. an analysis's state that cannot be pickled
            self.off = f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"
            self.notes.append(
                f"checkpoints off for this task: its state cannot be saved ({self.off})"
            )
            return False
        from .results_writer import write_atomic

        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, buf.getvalue())
        except OSError as exc:
            self.notes.append(f"checkpoint at step {step} not written: {type(exc).__name__}: {exc}")
            return False
        self._last = time.monotonic()
        self.saved_step = step
        return True

    def resume_task(self) -> None:
        """Give the task its saved part back (after the training loop restored its own)."""
        if self.loaded is not None and self.restore is not None and self.loaded.get("task"):
            self.restore(self.loaded["task"])


def task_fingerprint(
    cell: dict[str, Any], cell_id: str, seed: int, suite: dict[str, Any], device: str
) -> str:
    """The identity a checkpoint is checked against: the cell's settings (all but
    ``train.checkpoint_every``), its id and seed, the suite settings that change what a task
    computes (``suite``: dtype, analyses, numeric flags), the device type and deqbench's
    version."""
    import hashlib
    import json

    from .. import __version__

    cell = {k: dict(v) if isinstance(v, dict) else v for k, v in cell.items()}
    if isinstance(cell.get("train"), dict):
        cell["train"].pop("checkpoint_every", None)
    body = {
        "cell": cell,
        "id": cell_id,
        "seed": seed,
        "suite": suite,
        "device": device.split(":")[0],
        "version": __version__,
    }
    text = json.dumps(body, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
