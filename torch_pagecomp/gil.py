"""How often Python hands the GIL to a waiting thread while pagecomp's pipelines live.

A batch moves through three Python threads (the caller enqueues, the issuer reads its
compressed size and queues the download, the completer retires it), and each hand-off needs the
GIL. A thread that wakes from a CUDA event wait must get it back from whoever holds it; while
that holder runs Python code (a training loop's forward, a loop of ``offload`` calls) CPython
hands it over only every ``sys.getswitchinterval()`` seconds, 5 ms by default: up to 5 ms of
idle link per batch, against ~1 ms of copy for a 64 MiB batch.

:func:`hold` lowers the interval while at least one pipeline is open and puts the caller's value
back when the last one closes (:func:`release`). ``PAGECOMP_SWITCH_INTERVAL`` (seconds) sets the
value; ``0`` leaves Python's setting alone. A process that sets a lower interval itself keeps it.
"""

from __future__ import annotations

import os
import sys
import threading

DEFAULT_INTERVAL = 2e-4  # seconds: 25x below CPython's 5 ms

_lock = threading.Lock()
_holders = 0
_saved: float | None = None


def interval() -> float:
    """The interval pipelines ask for (``PAGECOMP_SWITCH_INTERVAL``, else the default); 0: none."""
    text = os.environ.get("PAGECOMP_SWITCH_INTERVAL", "")
    try:
        value = float(text) if text else DEFAULT_INTERVAL
    except ValueError:
        raise ValueError(f"PAGECOMP_SWITCH_INTERVAL must be seconds, got {text!r}") from None
    return max(0.0, value)


def hold() -> None:
    """One more open pipeline: lower the switch interval (never raise it)."""
    global _holders, _saved
    want = interval()
    with _lock:
        _holders += 1
        if want > 0 and _holders == 1:
            current = sys.getswitchinterval()
            if want < current:
                _saved = current
                sys.setswitchinterval(want)


def release() -> None:
    """One pipeline fewer: the last one puts the saved interval back (if we changed it)."""
    global _holders, _saved
    with _lock:
        if _holders == 0:
            return
        _holders -= 1
        if _holders == 0 and _saved is not None:
            sys.setswitchinterval(_saved)
            _saved = None
