"""One error tree: everything asyncckpt raises on purpose derives from CheckpointError."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np


class CheckpointError(Exception):
    """Base class of every error asyncckpt raises on purpose."""


class CheckpointConfigError(CheckpointError, ValueError):
    """An argument or option has a bad value; the message names it and the allowed values."""


class NotPicklableError(CheckpointConfigError, TypeError):
    """An object that belongs to its process (a checkpointer, a save's future) was
    pickled or copied: a TypeError, as pickle's own refusals are (helpers that test
    picklability catch that), saying what to send instead."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint (or no such step) where one was asked for."""

    _went_while_read = False  # the step went (or was replaced) as it was read (reader.went)


class CheckpointCorruptError(CheckpointError, ValueError):
    """A checkpoint's bytes or metadata do not match what was committed.

    ``path`` names the file and ``key`` the tensor (when one is known). ``maybe_intact``:
    what was found may be no damage (an EIO of a network mount's outage, a tensor larger
    than this machine's memory): a load goes past the step, but marks nothing.
    """

    def __init__(self, message: str, *, path: str | None = None, key: str | None = None,
                 maybe_intact: bool = False):
        super().__init__(message)
        self.path = path
        self.key = key
        self.maybe_intact = maybe_intact


class CheckpointPermissionError(CheckpointError, PermissionError):
    """A checkpoint file cannot be read for lack of permission: the data may well be
    intact, so this is no CheckpointCorruptError (and a fallback load does not skip it).

    ``path`` names the file.
    """

    def __init__(self, message: str, *, path: str | None = None):
        super().__init__(message)
        self.path = path

    def __str__(self) -> str:  # OSError would print its args' tuple
        return str(self.args[0])


class CheckpointVersionError(CheckpointError, ValueError):
    """A checkpoint was written in a newer format than this library reads: it is not
    corrupt (a fallback load stops here rather than skip to an older step); upgrade.

    ``path`` names the manifest.
    """

    def __init__(self, message: str, *, path: str | None = None):
        super().__init__(message)
        self.path = path


class CheckpointInFlightError(CheckpointError, RuntimeError):
    """A save was asked for while another is still in flight and ``on_busy="error"``, or
    while another call of the checkpointer (save_async, prepare, close) is still running."""


class CheckpointSaveError(CheckpointError, RuntimeError):
    """A save failed in the background; ``__cause__`` holds the original error."""


class CheckpointTransportError(CheckpointError, ConnectionError):
    """A peer refused a transfer or the connection to it broke; the message names the peer."""


class CheckpointTimeoutError(CheckpointError, TimeoutError):
    """A blocking call ran out of time; the message says what it was waiting for."""

    #: the ranks that did not answer, for a wait on other ranks
    ranks: tuple[int, ...] = ()


class CheckpointClosedError(CheckpointError, RuntimeError):
    """The checkpointer was closed, or the transport shut down."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A committed checkpoint already holds this step (or a newer one, or its directory
    exists without a manifest); or an export's target file exists."""


class CheckpointLockedError(CheckpointError, RuntimeError):
    """Another checkpointer, of this process or another, holds the directory's lock.

    ``holder``: that checkpointer when it is one of this process (None otherwise, or once
    it is gone), for a notebook where no name reaches it any more: ``err.holder.close()``.
    """

    def __init__(self, message: str, holder: Any = None) -> None:
        super().__init__(message)
        self._holder = None if holder is None else weakref.ref(holder)

    @property
    def holder(self) -> Any:
        return None if self._holder is None else self._holder()

    def __reduce__(self) -> tuple[Any, ...]:
        # (sent from a worker process, it goes without the holder: an object of that one)
        return (type(self), self.args[:1], {k: v for k, v in self.__dict__.items()
                                            if k != "_holder"})


class UnsupportedLeafError(CheckpointError, TypeError):
    """A state tree holds a value that cannot be checkpointed; the message names its path."""


class StateMismatchError(CheckpointError, KeyError):
    """The checkpoint and the target state disagree: missing, unexpected or mismatched keys."""

    def __init__(
        self,
        message: str,
        *,
        missing: list[str] | None = None,
        unexpected: list[str] | None = None,
        mismatched: list[str] | None = None,
    ):
        super().__init__(message)
        self.missing = missing or []
        self.unexpected = unexpected or []
        self.mismatched = mismatched or []

    def __str__(self) -> str:  # KeyError would print repr(message)
        return str(self.args[0])


def few(items: Sequence[str], n: int = 8) -> str:
    """``a, b, c and 5 more``: at most ``n`` of ``items``, for a message."""
    more = f" and {len(items) - n} more" if len(items) > n else ""
    return ", ".join(items[:n]) + more


def seconds_text(s: float | None) -> str:
    """A duration for a message: ``0.005s``, ``1.5s``, ``600s`` (``:g`` printed a 5 ms
    budget left as ``0.00499959s``, ``:.1f`` a 50 ms timeout as ``0.0s``)."""
    if s is None:
        return "no time limit"
    if s != s or s in (float("inf"), float("-inf")):
        return f"{s}s"
    return f"{round(s, 3) if abs(s) >= 0.001 else float(f'{s:.2g}'):g}s"


def retold(exc: CheckpointError, message: str) -> CheckpointError:
    """``exc`` told with ``message``: an error of its type, with its fields (``path``,
    ``key``, ``ranks``, ``missing``, ``offered``...) kept. Made without calling the
    type's ``__init__``, whose arguments differ from type to type (``StepNotOffered``
    takes the step offered): the fields are copied instead."""
    kind = type(exc)
    out = kind.__new__(kind, message)  # (sets args, as Exception(message) does)
    out.__dict__.update(exc.__dict__)
    out.args = (message,)
    return out


def with_advice(exc: CheckpointError, advice: str) -> CheckpointError:
    """``exc`` with ``advice`` appended to its message (not a note: ``str(exc)``, what a
    log line shows, lacks notes: a group's load advice was lost there): its fields, a
    list of its notes of its own, its traceback below the frame re-raising it, and as
    ``__cause__`` its cause, or its context where it had no cause: raise it as
    ``err = with_advice(exc, ...); raise err from err.__cause__``."""
    out = retold(exc, f"{exc}; {advice}")
    notes = getattr(exc, "__notes__", None)
    if isinstance(notes, list):
        with contextlib.suppress(AttributeError):
            setattr(out, "__notes__", list(notes))  # noqa: B010
    tb = exc.__traceback__
    out = out.with_traceback(tb.tb_next if tb is not None and tb.tb_next is not None else tb)
    out.__cause__ = exc.__cause__ if exc.__cause__ is not None or exc.__suppress_context__ \
        else exc.__context__
    return out


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``, on Python 3.10 too, which lacks it: there the note goes in
    ``exc.__notes__`` as 3.11 keeps it (PEP 678), for code and tools that read notes
    (3.10's own traceback does not print them)."""
    adder = getattr(exc, "add_note", None)
    if adder is not None:
        adder(note)
        return
    notes = getattr(exc, "__notes__", None)
    if not isinstance(notes, list):
        notes = []
    notes.append(note)
    # (an exception type with __slots__ takes no attribute: the note is lost, not the error)
    with contextlib.suppress(AttributeError):
        # (setattr: typeshed has __notes__ from 3.11 only, and a type: ignore for 3.10
        # was reported unused to users checking this package under 3.11)
        setattr(exc, "__notes__", notes)  # noqa: B010


def check_flags(**flags: object) -> None:
    """Refuse a flag argument that is not a bool (numpy's included).

    Python would read any value by its truth: a flag taken from a config file as the
    string "false" would turn ``overlap`` or ``ignore_unexpected`` on, silently.
    """
    for name, value in flags.items():
        if not isinstance(value, (bool, np.bool_)):
            raise CheckpointConfigError(f"{name}={value!r:.60}: use True or False")


def add_note_of(exc: BaseException, other: BaseException) -> None:
    """Note ``other`` on ``exc``: its message, then the notes it carries (the failures
    noted on it in turn)."""
    add_note(exc, str(other))
    for note in getattr(other, "__notes__", ()):
        add_note(exc, note)
