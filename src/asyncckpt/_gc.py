"""Pausing Python's cyclic garbage collector around bursts of small objects."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.RLock()  # reentrant: a signal handler may pause on a thread holding it
_depth = 0  # pauses in progress, on any thread
_resume = False  # whether the collector was enabled when the first of them began


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Building or parsing a manifest makes many small objects in a burst, which sets off
    full collections of the whole process (0.1-0.6 s seen with a large state tree alive,
    holding the GIL the training thread needs). They are pointless here: nothing of ours
    forms cycles, and reference counting still frees everything at once.

    Pauses on several threads nest: the collector is enabled again when the last one
    ends, and only if it was enabled when the first began (a ``gc.disable()`` of the
    caller's made before then stays in force)."""
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                gc.enable()
