"""Pausing Python's cyclic garbage collector around bursts of small objects."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Building or parsing a manifest makes many small objects in a burst, which sets off
    full collections of the whole process (0.1-0.6 s seen with a large state tree alive,
    holding the GIL the training thread needs). They are pointless here: nothing of ours
    forms cycles, and reference counting still frees everything at once."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
