"""How plugin code failed, as one line: :func:`_raised` names the exception and the innermost
frame outside torch; :func:`_unless_interrupt` passes a signal to this process on (anything else
plugin code raised, ``sys.exit()`` too, is a broken contract).
"""

from __future__ import annotations

import os
import traceback

from .interrupts import is_interruption


def _unless_interrupt(exc: BaseException) -> None:
    """Re-raise ``exc`` when it is a signal to this process (:mod:`deqbench.run.interrupts`);
    anything else that plugin code raised (``sys.exit()`` too) is a broken contract."""
    if is_interruption(exc):
        raise exc


def _raised(exc: BaseException) -> str:
    """``raised Type: message (at file:line in fn)``, at the innermost frame outside torch."""
    text = " ".join(str(exc).split())
    where = ""
    tb = traceback.extract_tb(exc.__traceback__)
    if tb:
        import torch

        lib = os.path.dirname(torch.__file__)  # the caller's frame, not torch's internals
        fr = next((f for f in reversed(tb) if not f.filename.startswith(lib)), tb[-1])
        where = f" (at {os.path.basename(fr.filename)}:{fr.lineno} in {fr.name})"
    return f"raised {type(exc).__name__}{': ' + text if text else ''}{where}"
