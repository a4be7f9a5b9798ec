"""Pausing Python's cyclic garbage collector around bursts of small objects."""

from __future__ import annotations

import contextlib
import gc
import os
import sysconfig
import threading
from collections.abc import Iterator

_lock = threading.RLock()  # reentrant: a signal handler may pause on a thread holding it
_depth = 0  # pauses in progress, on any thread
_resume = False  # whether the collector was enabled when the first of them began
_settle = False  # a pause in progress asked for its objects to be settled (gc_paused)
# (where freeze and unfreeze walk the whole heap, stopping the world: free-threaded builds)
_CAN_SETTLE = not sysconfig.get_config_var("Py_GIL_DISABLED")
_held: dict[int, int] = {}  # pauses in progress by thread: a forked child keeps its own


@contextlib.contextmanager
def gc_paused(settle: bool = False) -> Iterator[None]:
    """Building or parsing a manifest makes many small objects in a burst, which sets off
    full collections of the whole process (0.1-0.6 s seen with a large state tree alive,
    holding the GIL the training thread needs). They are pointless here: nothing of ours
    forms cycles, and reference counting still frees everything at once.

    Pauses on several threads nest: the collector is enabled again when the last one
    ends, and only if it was enabled when the first began (a ``gc.disable()`` of the
    caller's made before then stays in force). ``settle``: the pause's objects that live
    on are taken for long-lived then (see below), not collected young."""
    global _depth, _resume, _settle
    me = threading.get_ident()
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            if settle and _resume and _CAN_SETTLE and gc.get_freeze_count() == 0:
                # the caller's young objects first, collected young as they would be
                # (their garbage must not be settled with the pause's objects: it would
                # wait for a full collection); a few hundred objects at most, as a rule
                gc.collect(1)
            gc.disable()
        _depth += 1
        _settle = _settle or (settle and _CAN_SETTLE)  # (for the last pause to end)
        _held[me] = _held.get(me, 0) + 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            _held[me] -= 1
            if not _held[me]:
                del _held[me]
            if _depth == 0 and _resume:
                if _settle and gc.get_freeze_count() == 0:
                    # The objects made meanwhile that live on (a save's tree and plan,
                    # kept until it is written) go to the oldest generation at once, as
                    # the collections that would move them there, one traversal each,
                    # would: freeze and unfreeze move lists, and reset the count whose
                    # excess had the first allocation after this collect them (20,000
                    # tensors: 20-30 ms of the caller's right after each save, 130 ms
                    # at times). The caller's young objects were collected as the pause
                    # began. Not where the caller froze objects of its own (gc.freeze
                    # before a fork): unfreeze would thaw those too.
                    gc.freeze()
                    gc.unfreeze()
                gc.enable()
            if _depth == 0:
                _settle = False


@contextlib.contextmanager
def gc_resumed(own: bool = False) -> Iterator[None]:
    """Inside a pause, let the collector run over a call into the user's code (a
    ``load_state_dict`` may make cycles of its own): it is enabled meanwhile if it was
    when the pauses began, and paused again afterwards if any pause is still on.
    ``own``: only where this thread holds a pause (a wait inside its own, not one
    beside another thread's burst)."""
    with _lock:
        enable = (_depth > 0 and _resume and not gc.isenabled()
                  and (not own or threading.get_ident() in _held))
        if enable:
            gc.enable()
    try:
        yield
    finally:
        if enable:
            with _lock:
                if _depth > 0:
                    gc.disable()


def _after_fork_in_child() -> None:
    """Only the forking thread lives on in a child: the pauses of the others never end
    there, and would leave its collector disabled for good. Keep the forking thread's
    own (they end as usual), and enable the collector now if there are none."""
    global _lock, _depth
    _lock = threading.RLock()  # the parent's is held by the fork (see below)
    inherited = _depth
    me = threading.get_ident()
    mine = _held.get(me, 0)
    _held.clear()
    if mine:
        _held[me] = mine
    _depth = mine
    if inherited and not mine and _resume:
        gc.enable()


if hasattr(os, "register_at_fork"):
    # Holding the lock across the fork, the child sees the count and the collector's
    # state agree (not a pause caught between gc.disable() and its count).
    os.register_at_fork(before=lambda: _lock.acquire(), after_in_parent=lambda: _lock.release(),
                        after_in_child=_after_fork_in_child)
