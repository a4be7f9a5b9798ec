"""The background writer: one save in flight, errors kept for ``wait()``.

A save job follows the staging progress: it writes the staged prefix of the arena
while the rest is still being copied, hashes the tensors on a second thread once
staging is over, then writes the manifest and commits with one rename.

Under torch.distributed the hash thread also publishes the rank's record, and the
coordinator's merges every rank's into the manifest while the shard files are still
being written: once they are durable, only the commit is left.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import copy
import dataclasses
import errno
import functools
import inspect
import logging
import math
import os
import threading
import time
import traceback
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import xxhash

from . import commit
from ._gc import gc_paused
from .best import KeepBest, MetricMode, StepMetrics, merged_metadata, merged_metrics
from .dist import DistContext, Pulse, Replica, raise_failures, silent_ranks_advice
from .errors import (
    CheckpointClosedError,
    CheckpointConfigError,
    CheckpointError,
    CheckpointSaveError,
    CheckpointTimeoutError,
    NotPicklableError,
    seconds_text,
    with_advice,
)
from .manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    block_checksums,
    metrics_text,
    parse_manifest,
)
from .plan import WritePlan
from .reports import RecordBook, Reports
from .staging import HostArena, StagingProgress, StagingStopped
from .storage import STORAGE_CALLS, LocalStorage, Storage
from .tree import FlatState

log = logging.getLogger(__name__)

_gc_paused = gc_paused  # the transports import it from here


@dataclass(frozen=True)
class CheckpointInfo:
    """What a completed save did, with the timings worth logging.

    ``blocked_s``: time the caller was blocked in ``save_async``; ``staged_s``: from the
    call until every tensor was copied to the arena; ``durable_s``: from the call until
    the checkpoint was committed (every byte fsync'd, directory renamed).
    """

    step: int
    path: Path
    bytes: int
    blocked_s: float
    staged_s: float
    durable_s: float

    def __repr__(self) -> str:
        # (a notebook shows it: times to the millisecond, the path as text)
        return (f"CheckpointInfo(step={self.step}, path={str(self.path)!r}, "
                f"bytes={self.bytes}, blocked_s={self.blocked_s:.3f}, "
                f"staged_s={self.staged_s:.3f}, durable_s={self.durable_s:.3f})")

    @property
    def staged_gbps(self) -> float:
        return self.bytes / self.staged_s / 1e9 if self.staged_s > 0 else float("inf")

    @property
    def durable_gbps(self) -> float:
        return self.bytes / self.durable_s / 1e9 if self.durable_s > 0 else float("inf")


@dataclass(frozen=True)
class SaveProgress:
    """Where one save stands (``CheckpointFuture.progress()``), for this rank's file.

    ``phase``: "staging" (tensors are being copied into the host buffer; the writer
    follows behind), "writing" (the copy is over, the file is being written),
    "committing" (the file is written: fsync, the other ranks, the manifest, the
    rename), then "committed" or "failed".
    """

    step: int
    phase: str
    total_bytes: int  # this rank's shard file
    staged_bytes: int  # copied into the host buffer (or queued there, from a GPU)
    written_bytes: int  # written to the shard file (durable once committed)

    @property
    def fraction(self) -> float:
        """How much of the way to the commit: half for the copy, half for the write, at
        most 0.99 until committed (a trial's progress bar read 100% through a commit of
        0.6 s: the fsync and the rename are left then)."""
        if self.phase == "committed":
            return 1.0
        total = max(self.total_bytes, 1)
        return min(0.99, (self.staged_bytes + self.written_bytes) / (2 * total))


@dataclass
class Extras:
    """What a rank of a group offers peers beside its shard file: the tensors it holds
    but does not write, as they were when the save began, laid out as one more file
    (``plan``) over ``tensors`` (copies: the live ones change as training goes on)."""

    plan: WritePlan
    tensors: dict[str, torch.Tensor]
    # this save's: the live tensors to copy, and whether the copy was made (it is made
    # with the staging, before the save's own bytes: see checkpointer.fill_extras)
    live: dict[str, torch.Tensor] = field(default_factory=dict)
    filled: bool = False


@dataclass
class SaveJob:
    """Everything the background needs to finish one save. Owned by one save."""

    root: Path
    step: int
    plan: WritePlan
    arena: HostArena
    progress: StagingProgress
    flat: FlatState
    ctx: DistContext
    token: str
    storage: Storage
    keep_last: int | None
    block_bytes: int
    library_version: str
    user_metadata: dict[str, str]
    direct_io: bool
    started: float
    keep_every: int | None = None  # with keep_last: older multiples of it are kept
    # steps a fallback load of this checkpointer found damaged: not counted by keep_last
    damaged: frozenset[int] = frozenset()
    keep_best: KeepBest | None = None  # with keep_last: the best steps by a metric are kept
    known: StepMetrics | None = None  # what is known of the committed steps (files, metrics)
    metrics: dict[str, float] = field(default_factory=dict)  # save_async(metrics=...)
    metric_mode: MetricMode | None = None  # best_metric's ranking, which the save records
    metric_modes: dict[str, str] = field(default_factory=dict)  # (what it recorded)
    strict_replicas: bool = False  # ranks' differing replicas fail the save (not a warning)
    blocked_s: float = 0.0
    sync: bool = False  # mode="sync": the caller is blocked until the commit
    tmp: Path | None = None
    tag: str = ""  # names this save's Store keys: n<save number>
    # the retention of the save before this one, whose removals may still be freeing the
    # space this one needs (see _room_for)
    removals: cf.Future[None] | None = None
    # set once the write thread made room (or found it there): the hash thread's manifest
    # waits for it (a trial's exact-room disk failed at the manifest, written meanwhile)
    room: threading.Event = field(default_factory=threading.Event)
    announced: bool = False  # this rank posted "done" (its file is durable)
    rejected: bool = False  # the coordinator's verdict said the step was not committed
    committed: bool = False
    serve_to: list[Any] = field(default_factory=list)  # transports offered the staged arena
    # every rank's file fields: rank, file, bytes... (coordinator, once merged)
    records: list[dict[str, Any]] = field(default_factory=list)
    reports: Reports = field(default_factory=Reports)  # the checkpointer's, kept across saves
    in_use: commit.StepsInUse = field(default_factory=commit.StepsInUse)  # steps being loaded
    # checksums of small replicated tensors this rank holds but another writes: compared
    # with the writer's by the coordinator (dist.merge_records)
    replicas: dict[str, Replica] = field(default_factory=dict)
    pulse: Pulse | None = None  # in a group: this rank's signs of life, the others' abort
    # the write task's future, as soon as it is queued (an interrupt in the caller may
    # come before submit returns it)
    durable: cf.Future[CheckpointInfo] | None = None
    # overlap=True: the check that the tensors were left alone until wait_staged()
    handover: Handover | None = None
    # a rank of a group serving its saves: the tensors it holds but another rank writes
    # (replicated ones; Adam's step counts under FSDP2), copied as the save began, and
    # their layout as a file of their own, offered beside its shard (None: none)
    extras: Extras | None = None

    def release(self) -> None:
        """Drop the arena and the state tree once the save is over: a failed save's error,
        whose traceback holds this job, and a committed save's retention, which holds it
        until old steps are removed, must not keep gigabytes of host memory alive."""
        self.arena = None  # type: ignore[assignment]  # (never read once the save is over)
        self.flat = None  # type: ignore[assignment]

    @property
    def tmp_path(self) -> Path:
        """The temporary directory this save writes into (``tmp`` once it exists)."""
        return self.root / commit.tmp_dir_name(self.step, self.token)


class Handover:
    """With ``overlap=True`` the saved tensors are the caller's again once
    ``fut.wait_staged()`` returns; until then nothing may change them. The copy's own
    check, as it ends, cannot see a change still running then (torch counts an in-place
    change once it is complete): ``optimizer.step()`` racing the copy saved rows of both
    steps, with valid checksums. So the versions are checked once more, at whichever
    comes first: ``wait_staged()`` returning, or (no such call) the save's file being
    durable, before it is committed or served. A change counted by then came before the
    caller took the tensors back, and fails the save, whatever the timing was.

    Thread-safe; checks once, and tells every later caller the same verdict."""

    __slots__ = ("_check", "_error", "_lock")

    def __init__(self, check: Callable[[], None]) -> None:
        self._check: Callable[[], None] | None = check
        self._lock = threading.Lock()
        self._error: str | None = None

    def settle(self) -> None:
        """Check, the first time; raise CheckpointSaveError if the tensors had changed."""
        with self._lock:
            check, self._check = self._check, None  # (and the tensors it holds go)
            if check is not None:
                try:
                    check()
                except CheckpointSaveError as exc:
                    self._error = str(exc)
            error = self._error
        if error is not None:
            raise CheckpointSaveError(error)

    def drop(self) -> None:
        """The save is over (failed): nothing left to check, nor tensors to hold."""
        with self._lock:
            self._check = None


def _detached(exc: BaseException) -> BaseException:
    """A copy of ``exc`` (a save's failure, kept by its future) to raise to a caller.

    Raised as it is, the kept error would gather the frames it passes through, the
    caller's among them, and keep them for as long as the future is kept: a checkpointer
    held by such a frame (``ck`` of a retry function that returns without ``close()``)
    would then stay alive, with its lock and host buffer, until a full garbage
    collection. The copy gathers them instead, and is the caller's alone."""
    try:
        twin = copy.copy(exc)
    except Exception:  # an error type that cannot be made again from its args
        return exc
    if type(twin) is not type(exc) or twin.args != exc.args:
        return exc
    notes = getattr(exc, "__notes__", None)
    if isinstance(notes, list):  # (a shallow copy would share the list: notes the caller
        vars(twin)["__notes__"] = list(notes)  # adds would land on the kept error too)
    twin.__cause__, twin.__context__ = exc.__cause__, exc.__context__
    twin.__suppress_context__ = exc.__suppress_context__
    return twin.with_traceback(exc.__traceback__)


def wait_seconds(timeout: object, what: str) -> float | None:
    """A wait's ``timeout``: seconds >= 0 (infinity: None, no limit), or None;
    CheckpointConfigError for anything else (a trial's wait(timeout=True) said "not
    durable after Trues", and a str raised a bare TypeError)."""
    if timeout is None:
        return None
    if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
            or math.isnan(timeout) or timeout < 0):
        raise CheckpointConfigError(
            f"{what}(timeout={timeout!r:.40}): pass seconds, a number >= 0, or None to wait "
            "however long it takes")
    return None if math.isinf(timeout) else float(timeout)


class CheckpointFuture:
    """The handle of one save: poll it, wait for staging, or wait for durability.

    Thread-safe.
    """

    def __init__(self, step: int, durable: cf.Future[CheckpointInfo], staged: cf.Future[None],
                 progress: StagingProgress | None = None, total_bytes: int = 0,
                 handover: Handover | None = None):
        self.step = step
        self._durable = durable
        self._staged = staged
        self._handover = handover
        self._progress = progress
        self._total = total_bytes
        # someone asked for the outcome (wait, result, exception): in a list of its own,
        # which the checkpointer keeps where it keeps this save's failure for the next
        # wait() (a future handled and then dropped was reported again: a trial)
        self.seen = [False]
        self._pid = os.getpid()

    @property
    def observed(self) -> bool:
        """Whether the outcome was handed over (``wait``, ``result``, ``exception``): the
        checkpointer then does not report this save's failure again."""
        return self.seen[0]

    @observed.setter
    def observed(self, value: bool) -> None:
        self.seen[0] = value

    def _refuse_forked(self) -> None:
        """In a forked child, no thread will finish this save: waiting would hang."""
        if os.getpid() != self._pid and not self._durable.done():
            raise CheckpointClosedError(
                f"step {self.step} is being saved by process {self._pid}, which this process "
                f"({os.getpid()}) was forked from: it cannot be waited for, nor its outcome "
                "known, here (no thread of this process ends it)")

    def progress(self) -> SaveProgress:
        """Where the save stands now: bytes copied and written, and its phase. Does not
        block; does not mark a failure as seen (``exception()`` tells it). In a process
        forked while the save was in flight, raises CheckpointClosedError, as ``done()``
        does (its phase would never move there: a child's loop on it spun for ever)."""
        self._refuse_forked()
        return self._progress_now()

    def _progress_now(self) -> SaveProgress:
        staged = self._progress.staged if self._progress is not None else 0
        written = self._progress.written if self._progress is not None else 0
        total = self._total
        if self._durable.done():
            ok = not self._durable.cancelled() and self._durable.exception() is None
            phase = "committed" if ok else "failed"
            if ok:
                staged = written = total
        elif self._progress is not None and self._progress.failed:
            phase = "failed"
        elif written >= total and self._staged.done():
            phase = "committing"
        elif not self._staged.done():
            phase = "staging"
        else:
            phase = "writing"
        return SaveProgress(self.step, phase, total, min(staged, total), min(written, total))

    def __reduce__(self) -> Any:
        raise NotPicklableError(
            f"the CheckpointFuture of step {self.step} cannot be pickled (sent to another "
            "process): it is this process's save in flight; send fut.wait()'s CheckpointInfo "
            "(or the step) instead")

    def __repr__(self) -> str:
        # (what a notebook shows of ``fut``: the step and where its save stands, no wait;
        # in a forked child too, as it stood when the process was forked)
        p = self._progress_now()
        n = p.total_bytes
        size = (f"{n / 1e9:.3f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB" if n >= 1e6
                else f"{n / 1e3:.1f} kB" if n >= 1e3 else f"{n} B")
        where = f"{p.fraction:.0%} of {size}" if p.phase not in ("committed", "failed") else ""
        failed = ""
        if p.phase == "failed" and self._durable.done() and not self._durable.cancelled():
            exc = self._durable.exception()
            failed = f"{type(exc).__name__}" if exc is not None else ""
        return (f"<CheckpointFuture step={self.step} {p.phase}"
                + (f" {where}" if where else "") + (f": {failed}" if failed else "") + ">")

    def done(self) -> bool:
        """True once the save has committed or failed. In a process forked while it was
        in flight, raises CheckpointClosedError (no thread there ends it: a poll loop of a
        trial's child spun for ever)."""
        self._refuse_forked()
        return self._durable.done()

    def staged(self) -> bool:
        """True once every tensor has been copied to the host arena (in a process forked
        while they were being copied, CheckpointClosedError: no copy goes on there)."""
        if not self._staged.done():
            self._refuse_forked()
        return self._staged.done()

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until the tensors are copied; after that the caller may mutate them.

        Raises the staging error, or CheckpointTimeoutError. When staging stopped
        because the save had already failed (overlap=True: e.g. its directory could not
        be made), that failure is raised, as ``wait()`` would.
        """
        timeout = wait_seconds(timeout, "wait_staged")
        if not self._staged.done():
            self._refuse_forked()
        if not cf.wait([self._staged], timeout).done:
            raise CheckpointTimeoutError(
                f"step {self.step}: staging still running after {timeout}s")
        failure = self._staged.exception()  # (not result(): see _detached)
        if failure is None:
            if self._handover is not None:
                try:
                    self._handover.settle()
                except CheckpointSaveError:
                    self.observed = True  # (the writer fails the save with the same words)
                    raise
            return
        if isinstance(failure, StagingStopped):
            # Not the news: the save's own error says why (a full disk...). Report it,
            # rather than mark this save's failure as seen with no word of its cause.
            self.wait(timeout)
        elif isinstance(failure, Exception):
            # the staging's own error (a CheckpointTimeoutError is a TimeoutError too)
            self.observed = True  # the caller has seen how this save failed
        try:
            raise _detached(failure)
        finally:
            failure = None

    def wait(self, timeout: float | None = None) -> CheckpointInfo:
        """Block until the checkpoint is committed and return its info.

        Re-raises a background failure (as CheckpointSaveError, or the CheckpointError it
        was); raises CheckpointTimeoutError when ``timeout`` seconds pass first.
        """
        timeout = wait_seconds(timeout, "wait")
        self._refuse_forked()
        if not cf.wait([self._durable], timeout).done:
            raise CheckpointTimeoutError(
                f"step {self.step}: checkpoint not durable after {timeout}s (still "
                f"{self._progress_now().phase})")
        # Its failure is read, not raised by result(): raised there, the kept error would
        # gather this frame, and through it the caller's (see _detached).
        failure = self._durable.exception()
        if failure is None:
            self.observed = True
            return self._durable.result()
        if isinstance(failure, CheckpointError):
            self.observed = True
        try:
            raise _detached(failure)  # e.g. a CheckpointTimeoutError naming silent ranks
        finally:
            failure = None

    def exception(self) -> BaseException | None:
        """The failure of a finished save, or None (as done(), refused in a process
        forked while it was in flight)."""
        self._refuse_forked()
        if not self._durable.done():
            return None
        self.observed = True
        return self._durable.exception()

    result = wait

    def add_done_callback(self, fn: Callable[[CheckpointFuture], object]) -> None:
        """Call ``fn(future)`` once the save is committed or has failed: at once, on this
        thread, if it has; else on a thread of its own (not the writer's: ``fn`` may call
        ``ckpt.wait()``, which waits for work of the writer's thread: the review). An
        exception it raises is logged, not raised. It does not count as asking for the
        outcome: ``fn`` calls ``exception()`` or ``wait()`` for that (an integrator's
        progress bar polled from the training loop for want of this)."""
        if not callable(fn):
            raise CheckpointConfigError(f"add_done_callback({fn!r:.60}): pass a function of "
                                        "the future")

        def run() -> None:
            try:
                fn(self)
            except Exception:
                log.exception("step %d: the done callback %r raised", self.step, fn)

        if self._durable.done():
            run()
            return

        def call(_: object) -> None:
            threading.Thread(target=run, name=f"asyncckpt-done-{self.step}",
                             daemon=True).start()

        self._durable.add_done_callback(call)


def exiting(exc: BaseException) -> bool:
    """Whether ``exc`` is an executor's refusal of new work once the interpreter has begun
    to exit (atexit handlers run after that)."""
    if not (isinstance(exc, RuntimeError) and "cannot schedule new futures" in str(exc)):
        return False
    # (an executor of a writer that had threads says "after shutdown": Python's exit
    # hook, run before atexit handlers, shut it)
    return "interpreter shutdown" in str(exc) or bool(getattr(cf.thread, "_shutdown", False))


def started_pool(threads: int, prefix: str) -> cf.ThreadPoolExecutor:
    """A thread pool whose ``threads`` threads run already.

    A pool starts a thread in ``submit`` when it has no idle one. A Ctrl-C landing there,
    once the thread ran but before the pool recorded it, left a thread that nothing
    wakes at exit: the interpreter then waited for it for ever (the first save of a
    script interrupted in it hung). Here, an interrupted start shuts the pool down,
    which wakes such a thread too (it ends), and a save never starts a thread.
    """
    pool = cf.ThreadPoolExecutor(threads, thread_name_prefix=prefix)
    # Each task holds its thread until all have started: every submit finds no idle
    # thread and starts one.
    gate = threading.Barrier(threads + 1)
    try:
        for _ in range(threads):
            pool.submit(gate.wait, 60.0)
        gate.wait(60.0)
    except BaseException as exc:
        gate.abort()
        pool.shutdown(wait=False, cancel_futures=True)
        if exiting(exc):  # (a save from an atexit handler: submit refuses it, saying so)
            return cf.ThreadPoolExecutor(threads, thread_name_prefix=prefix)
        raise
    return pool


class BackgroundWriter:
    """Threads that run save jobs: a writer, a hasher, a stager (for overlap) and copiers.

    The copiers help the staging thread copy tensors into the arena in parallel.

    Thread-safe to submit to; the checkpointer submits one job at a time. The threads
    survive a failed job: its error goes into that job's future.
    """

    def __init__(self, copy_threads: int = 1) -> None:
        self._write = started_pool(1, "asyncckpt-write")
        self._hash = started_pool(1, "asyncckpt-hash")
        self.stager = started_pool(1, "asyncckpt-stage")
        self.copy_threads = max(1, copy_threads)
        self.copiers = started_pool(max(1, copy_threads - 1), "asyncckpt-copy")
        self._reap = started_pool(1, "asyncckpt-reap")
        self._retained: cf.Future[None] | None = None  # the last save's retention

    def submit(self, job: SaveJob) -> tuple[cf.Future[CheckpointInfo], cf.Future[None]]:
        """Queue a save; returns its durability future and its retention future."""
        # Both tasks are queued here, on the caller's thread: once the interpreter begins
        # to exit, executors refuse new work, but still finish what they were given.
        try:
            job.removals = self._retained
            hashes = self._hash.submit(_describe, job) if job.plan.items else None
            durable = job.durable = self._write.submit(self._run, job, hashes)
            # Retention runs after the future resolves, on the same thread, so the old
            # steps are out of sight before the next save writes; removing their files
            # (~0.5 s for a 3 GB step) goes to the reaper thread, so that it never delays
            # that save.
            retained: cf.Future[None] = cf.Future()
            self._write.submit(_retain, job, self._reap, retained)
            self._retained = retained
        except BaseException as exc:
            # Interrupted (Ctrl-C) with part of it queued: the tasks already queued wait
            # for a staging that never comes, and the next save's would queue behind them.
            job.progress.fail(exc)
            if exiting(exc):
                raise CheckpointSaveError(
                    f"step {job.step} cannot be saved: the interpreter is exiting (a save "
                    "from an atexit handler, or from a thread still running at exit), and "
                    "Python no longer runs the background work a save needs; save before "
                    "the program ends (at the end of the training loop, or in a finally or "
                    "with block)") from None
            raise
        return durable, retained

    def clean_up(self, remove: Callable[[], object]) -> cf.Future[None]:
        """Run ``remove`` (the directories a killed run left) on the reaper thread: the
        first save must not wait for it (a trial's first save_async after a restart was
        blocked 19 s). It counts as the last retention's removals: a save that lacks room
        waits for it (see _room_for), and retention's removals queue behind it."""
        def run() -> None:
            remove()

        fut = self._reap.submit(run)
        if self._retained is None or self._retained.done():
            self._retained = fut
        return fut

    def owns(self, thread: threading.Thread) -> bool:
        """Whether ``thread`` is one of these threads."""
        return any(thread in getattr(ex, "_threads", ())
                   for ex in (self.stager, self.copiers, self._write, self._hash, self._reap))

    def shutdown(self) -> None:
        """Stop the threads, waiting for their work; from one of them (a checkpointer
        dropped by a task of its own stager), that thread is not waited for: it ends
        with its task."""
        mine = threading.current_thread()
        for ex in (self.stager, self.copiers, self._write, self._hash, self._reap):
            ours = mine in getattr(ex, "_threads", ())
            ex.shutdown(wait=not ours)

    def _run(self, job: SaveJob, hashes: cf.Future[_Described] | None) -> CheckpointInfo:
        try:
            info = self._save(job, hashes)
            job.reports.sender.settled(True)
            # Retention (and its reaper, which may take a while or get stuck) keeps this
            # job: it must not keep the arena and the state tree too, or a next save whose
            # state grew allocates its arena beside this one. Nothing reads them from here:
            # peers are served from the memoryview the transports were handed.
            job.release()
            return info
        except BaseException as exc:
            # A rank that was stuck (a slow disk) finds, once it wakes, that the group gave
            # up and the coordinator took the temporary directory away: its own error (a
            # FileNotFoundError) would read as a storage fault of this rank.
            stopped = (job.pulse.aborted() if job.pulse is not None and not job.committed
                       and not isinstance(exc, CheckpointError) else None)
            job.progress.fail(RuntimeError("the save failed"))
            if job.handover is not None:
                job.handover.drop()
            if hashes is not None:  # it may write into the temporary directory: let it end
                with contextlib.suppress(BaseException):
                    hashes.result()
            job.reports.sender.settled(False)  # (once its record is made, if it is)
            # With overlap=True staging may still be copying: the arena is free, and this
            # future may resolve, only once it has stopped (at its next unit).
            job.progress.wait_idle()
            _abort(job, exc)
            if job.serve_to and not isinstance(exc, commit.CommittedNotDurableError):
                try:  # a step that did not commit is not served either
                    withdraw_offers(job.serve_to)
                except Exception as err:
                    log.error("rank=%d step=%d: the failed save's offer to peers could not "
                              "be withdrawn: %s: %s", job.ctx.rank, job.step,
                              type(err).__name__, err)
            job.release()
            call = _storage_call(exc) if isinstance(exc, OSError) else ""  # (frames first)
            # The future keeps this error for its caller, and the error's frames their
            # locals: views of the arena among them, which would keep it alive after
            # close() (or beside the next save's larger one). Only the frames' text stays.
            traceback.clear_frames(exc.__traceback__)
            if (isinstance(exc, CheckpointTimeoutError) and job.ctx.is_coordinator
                    and job.ctx.distributed and not job.committed):
                # (a distributed trial: the others' error said "not committed"; rank 0's,
                # the one most read, did not)
                told = with_advice(exc, silent_ranks_advice(job.step, started=True))
                raise told from told.__cause__
            if isinstance(exc, CheckpointError):
                raise
            if stopped is not None:
                raise CheckpointSaveError(
                    f"rank {job.ctx.rank}: stopped, nothing committed: {stopped} (this rank's "
                    f"own write then failed: {type(exc).__name__}: {exc})") from exc
            gone = (isinstance(exc, FileNotFoundError) and isinstance(job.storage, LocalStorage)
                    and not os.path.isdir(job.root))
            # (a rank other than 0 whose save's directory rank 0 removed as it gave the
            # save up, its Store gone with it: a trial's rank 1 was told FileNotFoundError)
            taken = (not gone and job.ctx.distributed and not job.ctx.is_coordinator
                     and isinstance(exc, FileNotFoundError) and isinstance(
                         job.storage, LocalStorage) and not os.path.isdir(job.tmp_path))
            if taken:
                raise CheckpointSaveError(
                    f"rank {job.ctx.rank}: saving step {job.step} under {job.root} failed: "
                    f"its temporary directory {job.tmp_path.name} is gone: rank 0 removes it "
                    "when it gives the save up (its error says why: a full disk, a rank that "
                    "failed), and could not tell this rank (its Store did not answer); "
                    "nothing was committed") from exc
            raise CheckpointSaveError(
                f"rank {job.ctx.rank}: saving step {job.step} under {job.root} failed"
                f"{f' in {call}' if call else ''}: {type(exc).__name__}: {exc}" + (
                    " (the checkpoint directory was deleted or moved while the step was "
                    "written: "
                    "the next save makes it again, with only its own step)" if gone
                    else _room_said(job, exc) + os_error_hint(exc, job.keep_last))) from exc

    def _save(self, job: SaveJob, hashes: cf.Future[_Described] | None) -> CheckpointInfo:
        plan, storage, ctx = job.plan, job.storage, job.ctx
        if ctx.is_coordinator and job.metric_mode is not None:
            # (what the manifest records, looked up before any room is made or byte
            # written: a best_mode given against the steps' fails the save here, before a
            # retention that would rank by it removes their best steps: a review)
            try:
                job.metric_modes = _metric_modes(job)
            except BaseException:
                job.room.set()  # (the hash thread's manifest waits for it)
                raise
        job.tmp = job.tmp_path
        storage.makedirs(job.tmp)
        raw: bytes | None = None
        if hashes is not None:
            try:
                try:
                    _room_for(job, self._reap)
                finally:
                    job.room.set()
                ready = _Counted(job, _ready(job))
                storage.write_arena(job.tmp / plan.file, job.arena.memoryview(), plan.file_bytes,
                                    ready, job.direct_io)
                if ready.reached < plan.file_bytes:  # (the bytes past it may be a last save's)
                    raise CheckpointSaveError(
                        f"step {job.step}: {type(storage).__name__}.write_arena returned "
                        f"without calling ready({plan.file_bytes}) (it got to "
                        f"{ready.reached}): its file may hold bytes not staged yet; a "
                        "storage must call ready(end) before writing below end; nothing "
                        "was committed")
                job.progress.written = plan.file_bytes
            except BaseException as exc:
                job.progress.fail(RuntimeError("write failed"))  # unblock the hasher
                hash_error = None
                try:
                    hashes.result()
                except BaseException as e:
                    hash_error = e
                # The hash thread stopped it (e.g. "rank 1 failed", or its manifest could
                # not be written): say that, not "staging failed".
                if isinstance(exc.__cause__, CheckpointError) or (
                        hash_error is not None and exc.__cause__ is hash_error):
                    raise exc.__cause__ from None
                raise
            record, raw = hashes.result()
        else:
            job.progress.wait_for(plan.file_bytes)  # nothing to write, but staging must end
            with _gc_paused():
                record = _record(job, [])
            if ctx.distributed and not ctx.is_coordinator:
                ctx.put(ctx.key(job.tag, "record", ctx.rank), record)
        if job.handover is not None:  # no wait_staged() yet: the tensors must be as saved
            job.handover.settle()
        if job.serve_to:
            _offer_arena(job, raw)
        if not ctx.distributed:
            final = self._commit(job, [record], manifest_written=raw is not None)
        elif ctx.is_coordinator:
            ctx.put(ctx.key(job.tag, "done", ctx.rank), {"rank": ctx.rank})
            job.announced = True
            _raise_failed(job, ctx.gather((job.tag, "done"),
                                          f"the shard files of step {job.step}", pulse=job.pulse))
            # (the coordinator wrote nothing, so its hash thread merged nothing)
            records = _gather_records(job, record) if raw is None else []
            _say_doing(job, f"committing step {job.step} (every rank's shard file is "
                            "written)")  # (no beats in the commit: fsyncs, the rename)
            final = self._commit(job, records, manifest_written=raw is not None)
            job.committed = True  # from here on, the save succeeded whatever the Store says
            try:
                ctx.put(ctx.key(job.tag, "verdict"), {"ok": str(final)})
            except CheckpointError as exc:
                # The step is committed; the other ranks time out with a message that
                # says it may be (they saw the "commit" decision), and retention is
                # still this rank's. Failing here would report a visible step as lost.
                log.error("rank=0 step=%d: committed to %s, but the other ranks could not be "
                          "told: %s", job.step, final, exc)
        else:
            if job.pulse is not None:
                job.pulse.watch = False  # announced: from now on the verdict decides
            ctx.put(ctx.key(job.tag, "done", ctx.rank), {"rank": ctx.rank})
            job.announced = True
            verdict = _await_verdict(job)
            ctx.saw_verdict(job.tag)
            if "committed" in verdict:  # visible, but its name may not survive a crash
                job.tmp = None
                raise CheckpointSaveError(
                    f"rank {ctx.rank}: step {job.step} is committed at {verdict['committed']} "
                    f"with this rank's file, but the coordinator reports: {verdict['error']}")
            if "ok" not in verdict:
                job.rejected = True
                why = f"rank {ctx.rank}: step {job.step} was not committed: {verdict.get('error')}"
                if verdict.get("kind") == "CheckpointTimeoutError":
                    # The coordinator timed out waiting for a rank: every rank raises the
                    # timeout, naming the silent ranks (only rank 0's did; `except
                    # CheckpointTimeoutError` and `.ranks` worked there alone).
                    timed_out = CheckpointTimeoutError(why)
                    timed_out.ranks = tuple(int(r) for r in verdict.get("ranks", ()))
                    raise timed_out
                if verdict.get("kind") == "CheckpointConfigError":  # (a review: rank 0's
                    raise CheckpointConfigError(why)  # alone was, the others' a SaveError)
                raise CheckpointSaveError(why)
            job.tmp = None
            final = Path(verdict["ok"])
        durable = time.perf_counter()
        job.committed = True
        staged_at = job.progress.finished_at or durable
        info = CheckpointInfo(step=job.step, path=final, bytes=plan.written_bytes,
                              blocked_s=durable - job.started if job.sync else job.blocked_s,
                              staged_s=staged_at - job.started,
                              durable_s=durable - job.started)
        # (one line per save at INFO, the coordinator's: a thousand ranks' would bury the
        # log; the others' at DEBUG, and every rank's timings are in its CheckpointInfo)
        # (mode="sync": blocked until keep_last's removals too, known once they are done)
        log.log(logging.INFO if ctx.is_coordinator else logging.DEBUG,
                "rank=%d step=%d committed %.3f GB to %s%s: %sstaged %.3fs, durable %.3fs "
                "(%.2f GB/s)", ctx.rank, job.step, info.bytes / 1e9, final,
                " (mode='sync')" if job.sync else "",
                "" if job.sync else f"blocked {info.blocked_s:.3f}s, ", info.staged_s,
                info.durable_s, info.durable_gbps)
        return info

    def _commit(self, job: SaveJob, records: list[dict[str, Any]], *,
                manifest_written: bool = False) -> Path:
        """Write the manifest merged from ``records`` (unless the hash thread already
        did) and commit the step."""
        assert job.tmp is not None
        if not manifest_written:
            job.storage.write_bytes(job.tmp / MANIFEST_NAME, _manifest_bytes(job, records))
        def claim() -> None:
            _claim_commit(job)  # first: a peer that gave up has taken its file away
            _check_shared(job)

        final = commit.commit(job.tmp, job.root, job.step, job.storage,
                              before_rename=claim if job.ctx.distributed
                              else lambda: _check_shared(job))
        job.tmp = None
        return final


def _claim_commit(job: SaveJob) -> None:
    """Coordinator, just before the rename: decide "commit" for every rank, unless a peer
    that gave up waiting has already decided otherwise."""
    ctx = job.ctx
    got = ctx.claim(ctx.key(job.tag, "decision"), "commit", f"the commit of step {job.step}")
    if got != "commit":
        raise CheckpointSaveError(f"rank {ctx.rank}: step {job.step} not committed: {got}")


def _await_verdict(job: SaveJob) -> dict[str, Any]:
    """A peer's wait for the coordinator's verdict. If it runs out, the peer claims the
    outcome "not committed"; should the coordinator have claimed "commit" first, only
    its rename is left, and the peer waits for that instead."""
    ctx = job.ctx
    key, what = ctx.key(job.tag, "verdict"), f"the commit of step {job.step}"
    try:
        # The timeout counts from the coordinator's last progress: its count moves while
        # it writes and at every slice of its own waits for slower ranks (each bounded
        # by timeout_s), so a coordinator silent for timeout_s died or hung; the grace
        # covers what it does without beating (merging the manifest, the commit). (It
        # was 2 * timeout_s + 30 s: 20 minutes at the default, for a dead coordinator.)
        return dict(ctx.get(key, what, timeout_s=ctx.timeout_s + _VERDICT_GRACE_S,
                            pulse=job.pulse))
    except CheckpointSaveError as exc:
        # The Store failed: its host (rank 0, often) may have died, maybe just after its
        # commit: a trial's rank 1 was told the save failed, the step committed beside it
        if not isinstance(exc, CheckpointTimeoutError) and _committed(job):
            raise CheckpointSaveError(
                f"rank {ctx.rank}: the Store failed while this rank waited for the verdict on "
                f"step {job.step}, but {job.root} holds step {job.step} committed (its "
                "manifest is there): the coordinator committed it, then died or lost the "
                "Store; it loads as any committed step (asyncckpt verify checks it). Restart "
                "the group") from exc
        raise
    except CheckpointTimeoutError as exc:
        got = ctx.claim(ctx.key(job.tag, "decision"), f"rank {ctx.rank} gave up: {exc}", what)
        if got != "commit":
            job.rejected = True  # nothing can commit the step now: take this rank's file back
            raise
    try:
        return dict(ctx.get(key, what))
    except CheckpointTimeoutError as exc:
        raise CheckpointTimeoutError(
            f"rank {ctx.rank}: the coordinator decided to commit step {job.step} but did not "
            f"confirm it within {seconds_text(ctx.timeout_s)}; it may have died mid-commit: check "
            f"whether {job.root} holds the step") from exc


def _committed(job: SaveJob) -> bool:
    """Whether ``job``'s step is there committed, as far as this rank can see."""
    try:
        return job.step in commit.committed_steps(job.root, job.storage, above=job.step - 1,
                                                  skip_denied=True)
    except (OSError, CheckpointError):
        return False


def _retain(job: SaveJob, reaper: cf.Executor, done: cf.Future[None], *,
            before: bool = False) -> None:
    """Apply keep_last after a committed save (coordinator only): hide the old steps here,
    remove their files on ``reaper``; ``done`` resolves once they are gone. A failure is
    logged, never raised: the new checkpoint is durable, and the next save tries again.
    ``before``: before the save is written, to make room (see _room_for): the steps
    there alone are counted."""
    hidden: list[tuple[int, Path]] = []
    leftovers: list[Path] = []
    marked: set[int] = set()  # steps damaged.json marks (another process's verdict, maybe)
    was_best: set[int] | None = None  # keep_best's spared at the last ranking (None: none)
    try:
        if (job.committed or before) and job.ctx.is_coordinator:
            # a load of this checkpointer keeps its step meanwhile (see StepsInUse.locked);
            # with keep_best, a record_metrics waits (see commit.ranking_lock)
            with (commit.ranking_lock(
                    job.root, job.storage, f"step {job.step}'s retention left the old steps "
                    "to the next save's", commit.RETENTION_RANKING_S)
                  if job.keep_best is not None else contextlib.nullcontext()
                  ), job.in_use.locked() as got:
                if not got:
                    log.warning("rank=0 step=%d: retention waited %.0fs for a load of this "
                                "checkpointer to pick its step (a signal handler saving "
                                "during a load?): old steps are left to the next save's "
                                "retention", job.step, commit.RETENTION_LOCK_S)
                    doomed = []
                else:
                    best = job.keep_best
                    if best is not None:  # (removed now, they were bests displaced)
                        was_best = set(best.spared_before() or ())
                    if best is not None and not before:  # (its metrics need not be read)
                        best.cache.note(job.root, job.step, job.storage, job.metrics,
                                        job.metric_modes)
                    if job.known is not None and not before:  # (nor its files' sizes)
                        job.known.note_files(job.root, job.step, job.storage)
                    listed: list[int] = []
                    doomed = job.in_use.spare(commit.doomed_steps(
                        job.root, job.keep_last, job.storage, protect=job.step,
                        keep_every=job.keep_every, spare=None if best is None else
                        functools.partial(best.spared, job.root, job.storage,
                                          leave_out=None if before else job.step),
                        damaged=job.damaged, found=marked,
                        amiss=None if job.known is None else functools.partial(
                            job.known.amiss, job.root, job.storage), listed=listed,
                        # (milestones found committed before, which it keeps: not every
                        # step, or one whose manifest went since would be deleted, where
                        # retention leaves a directory without one alone)
                        # (and on local storage: amiss can tell one that lost its files)
                        trusted=[s for s in job.known.committed() if s % job.keep_every == 0]
                        if job.known is not None and job.keep_every and isinstance(
                            job.storage, LocalStorage) else ()))
                    if job.known is not None:
                        job.known.keep_files(listed)
                    if best is not None and was_best is not None and not before:
                        # (and those best before this save, as the settings now rank: a
                        # restart that lowered keep_best removes more, and is told)
                        was_best |= best.best_without_own()
                for s in doomed:
                    if not job.ctx.may_retire(s):  # a load on another rank holds it
                        job.in_use.deferred.add(s)
                        continue
                    try:
                        hidden.append((s, commit.hide_step(job.root, s, job.storage)))
                    except OSError as exc:
                        # One step that cannot be moved (immutable, a mount point, another
                        # user's) must not keep every newer one from going: the disk fills.
                        log.warning("rank=0 step=%d: retention could not delete step %d: %s; "
                                    "the next save tries again", job.step, s, exc)
                    finally:
                        job.ctx.retired(s)
    except (OSError, CheckpointTimeoutError) as exc:
        log.warning("rank=0 step=%d: retention could not delete an old step: %s", job.step, exc)
    except BaseException as exc:
        done.set_exception(exc)
        raise
    finally:
        if job.committed and job.ctx.is_coordinator and not done.done():
            leftovers = _leftovers(job, {gone for _, gone in hidden})
            _tell_backlog(job, len(leftovers))
        if not hidden and not leftovers:
            if not done.done():
                done.set_result(None)
        else:
            try:
                reaper.submit(_reap, job, hidden, done, leftovers, marked, was_best)
            except RuntimeError:  # the interpreter is exiting: remove them here
                _reap(job, hidden, done, leftovers, marked, was_best)


# root -> the backlog of removals last warned of (see _tell_backlog)
_backlog_told: dict[str, int] = {}
BACKLOG_WARN = 3  # old steps still being removed at a save's retention: warned of from here


def _tell_backlog(job: SaveJob, behind: int) -> None:
    """Warn when the removals of old steps fall behind the saves (a preemption trial's slow
    network filesystem: 29 steps queued for removal after 40 saves, filling the disk, and
    a wait() of 28 s), once at BACKLOG_WARN steps and again each time it doubles."""
    key = str(job.root)
    told = _backlog_told.get(key, 0)
    if behind < BACKLOG_WARN:
        _backlog_told.pop(key, None)
        return
    if behind < 2 * told:
        return
    _backlog_told[key] = behind
    log.warning("rank=0 step=%d: %d old steps under %s are still being removed (.deleting- "
                "directories): the storage deletes more slowly than steps are saved, and the "
                "disk holds them until then; wait(), save() and close() wait for them. Save "
                "less often, or on a faster disk", job.step, behind, job.root)


ROOM_WAIT_S = 120.0  # the longest a save waits for the last one's removals to free room
ROOM_WAIT_GROUP_S = 10.0  # ... in a group
ROOM_STALL_S = 3.0  # ... where no room freed for this long, the others' watch ends


def _room_for(job: SaveJob, reaper: cf.Executor) -> None:
    """Make room for this step on a disk that lacks it, before it is written.

    First, wait for the removals of the last save's retention: those run on their own
    thread, so as not to delay a save, but a disk with room for keep_last + 1 steps and
    no more filled up (ENOSPC) when saves came back to back, the old step's files still
    there as the new ones were written. Then, still short, remove now what retention
    would remove of the steps there, this one left aside (the coordinator): a restart
    with a lower keep_last on a full disk failed every save, as retention runs after a
    commit; what it removes here would go after this commit all the same, and the steps
    it keeps are keep_last, should this save fail."""
    # (in a group, briefly: the other ranks wait on this one with their timeout_s, and its
    # beat moves only with progress)
    # (half the group's timeout_s at most: a trial's rank of timeout_s=10 waited its 10 s
    # and was then blamed by the others, "gave no sign of life")
    limit = ROOM_WAIT_S if not job.ctx.distributed else min(ROOM_WAIT_GROUP_S,
                                                            job.ctx.timeout_s / 2)
    removals = job.removals
    if removals is not None and not removals.done() and (
            free := _free_if_short(job)) is not None:
        log.info("rank=%d step=%d: %s: waiting for the last save's retention to remove the "
                 "old steps", job.ctx.rank, job.step, _lacking(job, free))
        cf.wait([removals], timeout=limit)
    if job.keep_last is not None and job.ctx.is_coordinator and (
            free := _free_if_short(job)) is not None:
        log.info("rank=0 step=%d: %s: removing now the steps keep_last=%d lets go of those "
                 "there", job.step, _lacking(job, free), job.keep_last)
        made: cf.Future[None] = cf.Future()
        _retain(job, reaper, made, before=True)
        cf.wait([made], timeout=limit)
    elif job.keep_last is not None and job.ctx.distributed and (
            free := _free_if_short(job)) is not None and _removable_before(job):
        # The others of a group on a shared filesystem: rank 0 removes the old steps (its
        # retention, or the removals above), which this rank cannot wait on: it watches
        # the room free, briefly (a review: rank 0 waited for room, rank 1's shard met the
        # full disk). A disk that stays full fails the write with ENOSPC, as before.
        log.info("rank=%d step=%d: %s: waiting up to %.0f s for rank 0's retention to remove "
                 "the old steps", job.ctx.rank, job.step, _lacking(job, free), limit)
        deadline = time.monotonic() + limit
        look = 0.0  # (the Store is asked once a beat's interval, not at every look)
        # (room that stops freeing: removals that failed for good, a .deleting- directory
        # left behind, would hold every save for the whole limit: review)
        last_free, freed_at = free, time.monotonic()
        while time.monotonic() < deadline and (now := _free_if_short(job)) is not None:
            if now > last_free:
                last_free, freed_at = now, time.monotonic()
            elif time.monotonic() - freed_at > ROOM_STALL_S:
                return
            # (a DCP trial: rank 0 failed at once on the full disk, and rank 1 went on
            # watching for room its whole ROOM_WAIT_GROUP_S; the write then fails with
            # the abort's reason)
            if job.progress.failed:
                return
            if job.pulse is not None and time.monotonic() >= look:
                look = time.monotonic() + job.pulse.every_s
                if job.pulse.stopped():
                    return
            time.sleep(0.05)


def _removable_before(job: SaveJob) -> bool:
    """Whether rank 0 may remove steps before this save commits: only those its retention
    lets go of among the steps there now (a restart with a lower keep_last), as it picks
    them before a save (keep_every's and keep_best's kept). Its retention of the steps
    this save lets go of runs after the commit, which this rank's write comes before (a
    trial's keep_last=1 group on a nearly full disk: each rank but 0 waited 10 s at every
    save for removals that could not come). Asked only when short of room."""
    best = job.keep_best
    try:
        # (removals in flight: the last save's retention hid its steps and is removing
        # them, which frees the room: a QA re-check's rank 1 wrote into a full disk while
        # rank 0's slow removals ran)
        if commit.deleting_dirs(job.root, job.storage):
            return True
        return bool(commit.doomed_steps(
            job.root, job.keep_last, job.storage, protect=job.step, keep_every=job.keep_every,
            spare=None if best is None else functools.partial(best.would_spare, job.root,
                                                              job.storage),
            damaged=job.damaged))
    except Exception:
        return True  # (cannot tell: watch, as before)


def _free_if_short(job: SaveJob) -> int | None:
    """The bytes free on the disk of the checkpoint where that is less than this step
    takes, with a margin; None where it has room (or that cannot be known: a root that is
    no local path)."""
    free = _free_bytes(job.root)
    return free if free is not None and free < _room_needed(job) else None


def _room_needed(job: SaveJob) -> int:
    """The room a step takes: its shard file, and its manifest with a margin (a few times
    the shard's header, which lists the same tensors; a flat 1 MiB undercounted one of
    100,000 tensors, tens of MB). In a group, the manifest is the coordinator's to write:
    another rank's part takes its file and a small margin (a trial's rank 1, whose 1.8 MB
    fitted, was held for the manifest it never writes)."""
    if job.ctx.distributed and not job.ctx.is_coordinator:
        return job.plan.file_bytes + (64 << 10)
    return job.plan.file_bytes + (1 << 20) + 4 * len(job.plan.header)


def _lacking(job: SaveJob, free: int) -> str:
    """The log's words for a disk short of room, ``free`` bytes free (as _free_if_short
    found it): the figures, margin said (an operator read 'lacks room' with more free than
    the step's file)."""
    free_mb, need_mb = _megabytes(free, _room_needed(job))
    part = ("this rank's shard file, with a margin" if job.ctx.distributed
            and not job.ctx.is_coordinator else "its shard file, and its manifest with a margin")
    return f"the disk lacks room for this step ({free_mb} free; it takes {need_mb}: {part})"


def _statvfs(root: Path) -> Any:
    """``os.statvfs`` of ``root``; None where it cannot be had (not a local path: a
    storage of its own; Windows)."""
    try:
        return os.statvfs(root)
    except (OSError, AttributeError):
        return None


def _free_bytes(root: Path) -> int | None:
    """The bytes free to this user on the disk of ``root``; None where that cannot be
    known."""
    fs = _statvfs(root)
    return None if fs is None else int(fs.f_bavail * fs.f_frsize)


def _free_inodes(root: Path) -> int | None:
    """The inodes free to this user on the filesystem of ``root``; None where that cannot
    be known (a filesystem that makes inodes as it goes says 0 of all)."""
    fs = _statvfs(root)
    return int(fs.f_favail) if getattr(fs, "f_files", 0) else None


def _leftovers(job: SaveJob, hidden: set[Path]) -> list[Path]:
    """Hidden steps whose removal failed (or ``hide_step``'s fsync did): retried by every
    retention, not only by the next checkpointer's clean-up, or a long run leaks a step's
    disk space per failure. Some may still be queued on the reaper: ``_reap`` runs after
    those removals (one thread), and takes only what is still there then."""
    try:
        names = commit.deleting_dirs(job.root, job.storage)
    except OSError as exc:
        log.warning("rank=0 step=%d: retention could not list %s for steps left half-removed: "
                    "%s", job.step, job.root, exc)
        return []
    return [job.root / n for n in names if job.root / n not in hidden
            and not commit.not_ours(job.root / n)]


def _reap(job: SaveJob, hidden: list[tuple[int, Path]], done: cf.Future[None],
          leftovers: list[Path] | None = None, marked: Collection[int] = (),
          was_best: Collection[int] | None = None) -> None:
    try:
        removed = [s for s, gone in hidden if _remove(job, gone)]
        usual = 1  # (and the bests this save displaced: ``was_best``)
        with job.in_use.lock:  # (left for a load before: see StepsInUse.deferred)
            late = job.in_use.deferred.intersection(s for s, _ in hidden)
            job.in_use.deferred.difference_update(late)
        if len([s for s in removed if s not in job.damaged and s not in marked
                and s not in late and s not in (was_best or ())]) > usual:
            # A save removes one step as a rule, and any best steps it displaced (metrics
            # recorded later may displace several). More at once are those of a run saved
            # with other settings (a restart that dropped keep_every lost its milestones,
            # or lowered keep_best), or, without a word of settings, one whose retention
            # a crash skipped: the warning says "if".
            log.warning("rank=0 step=%d: retention removed %d steps at once, %s (keep_last=%s"
                        ", keep_every=%s, keep_best=%s): if a restart changed those settings, "
                        "the steps the old ones kept are gone too (else: steps an earlier "
                        "retention could not delete, or the removals a crash skipped)",
                        job.step, len(removed), removed, job.keep_last, job.keep_every,
                        None if job.keep_best is None else job.keep_best.count)
        elif removed:
            log.info("rank=0 step=%d: retention removed steps %s", job.step, removed)
        if leftovers:
            try:
                there = set(job.storage.listdir(job.root))
            except OSError as exc:
                log.warning("rank=0 step=%d: retention could not list %s: %s", job.step,
                            job.root, exc)
                there = set()
            again = [p for p in leftovers if p.name in there and _remove(job, p)]
            if again:
                log.info("rank=0 step=%d: retention removed %s, left by an earlier removal "
                         "that failed", job.step, ", ".join(p.name for p in again))
    finally:
        if not done.done():
            done.set_result(None)


def _remove(job: SaveJob, gone: Path) -> bool:
    """Remove a hidden step; False (logged) when that fails: the next retention retries."""
    try:
        job.storage.remove_tree(gone)
        return True
    except FileNotFoundError:  # removed meanwhile (e.g. by an earlier, slower removal)
        return True
    except NotADirectoryError as exc:
        commit.left_as_not_ours(gone, exc, f"rank=0 step={job.step}: retention")
        return False
    except Exception as exc:
        log.warning("rank=0 step=%d: retention could not remove %s (the next save's retention "
                    "tries again): %s", job.step, gone, exc)
        return False


def _abort(job: SaveJob, exc: BaseException) -> None:
    """Tell the other ranks (so nobody waits out a timeout), and drop what was written."""
    ctx = job.ctx
    text = str(exc)
    # (with the advice this rank's own error gets: a full disk's room and what to do; a
    # trial's coordinator was told "rank 1: OSError: [Errno 28]" alone)
    msg = text if text.startswith("rank ") else (
        f"rank {ctx.rank}: {type(exc).__name__}: {text}" + (
            _room_said(job, exc) + os_error_hint(exc, job.keep_last)
            if isinstance(exc, OSError) else ""))
    if job.pulse is not None and not job.committed:
        job.pulse.abort(msg)  # the others stop their writes now, not when they finish
    if ctx.distributed:
        with contextlib.suppress(Exception):
            if not job.announced:
                # the record too: the coordinator's hash thread may be waiting for it
                for part in ("record", "done"):
                    ctx.put(ctx.key(job.tag, part, ctx.rank), {"rank": ctx.rank, "error": msg})
            if not ctx.is_coordinator:
                # it knows the outcome: rank 0's close() need not wait for it to read a
                # verdict (a trial's rank 0, whose write failed, waited 10 s at close)
                ctx.saw_verdict(job.tag)
            if ctx.is_coordinator:
                verdict: dict[str, Any] = {"error": msg}
                if isinstance(exc, commit.CommittedNotDurableError):  # the step is visible
                    verdict["committed"] = str(exc.final)
                if isinstance(exc, CheckpointTimeoutError):  # (raised as such everywhere)
                    verdict.update(kind="CheckpointTimeoutError",
                                   ranks=list(getattr(exc, "ranks", ()) or ()))
                elif isinstance(exc, CheckpointConfigError):  # (the settings: on every rank)
                    verdict.update(kind="CheckpointConfigError")
                ctx.put(ctx.key(job.tag, "verdict"), verdict)
    if isinstance(exc, commit.CommittedNotDurableError):
        job.tmp = None  # renamed into the step: nothing of it is this save's to remove
    if job.tmp is None:
        return
    if ctx.is_coordinator or not ctx.distributed:
        try:
            job.storage.remove_tree(job.tmp)
        except FileNotFoundError:
            pass
        except OSError as err:  # (a storage trial's failed removal was silent)
            log.warning("rank=%d step=%d: the failed save's temporary directory %s could not "
                        "be removed (%s): it is never read; the next checkpointer opened on "
                        "%s removes it, or 'asyncckpt clean' does", ctx.rank, job.step,
                        job.tmp, err, job.root)
    elif job.announced and not job.rejected:
        # This rank's file is durable and announced, and no verdict came: the coordinator
        # may still commit the step, and then the file must be in it. If it aborts
        # instead, it removes the directory; if it died, the next run's clean-up does.
        log.warning("rank=%d step=%d: left %s for the coordinator to commit or remove",
                    ctx.rank, job.step, job.tmp / job.plan.file)
    else:
        # A peer may still be writing into the shared directory: take only this rank's
        # file. The coordinator removes the directory when it aborts; only once it has
        # (its verdict is out) may this rank, late, have re-created it: then remove it if
        # that leaves it empty. (Removing it earlier, the coordinator's write, about to
        # create its file, failed with FileNotFoundError instead of naming this rank.)
        with contextlib.suppress(OSError):
            (job.tmp / job.plan.file).unlink()
        if job.rejected or _verdict_out(job):
            with contextlib.suppress(OSError):
                job.tmp.rmdir()


def _verdict_out(job: SaveJob) -> bool:
    with contextlib.suppress(Exception):
        return bool(job.ctx.store.check([job.ctx.key(job.tag, "verdict")]))
    return False


class _Counted:
    """``ready``, noting how far the file is written (the writer asks for each piece in
    order, once the pieces before it are written), and how far it was asked: ``reached``."""

    def __init__(self, job: SaveJob, ready: Callable[[int], None]) -> None:
        self.job, self.ready, self.reached = job, ready, 0

    def __call__(self, offset: int) -> None:
        # (past the file's end, as a storage writing whole padded blocks asks: nothing is
        # staged there, and a storage trial's save waited for it for good)
        offset = min(offset, self.job.plan.file_bytes)
        self.job.progress.written = self.reached
        self.ready(offset)
        self.reached = max(self.reached, offset)


def _ready(job: SaveJob) -> Callable[[int], None]:
    """What the writer calls before each piece: wait for staging to pass it; in a group,
    beat meanwhile and stop once another rank has aborted the save.

    Waiting for staging, the beat moves only when staging got further since the last
    one: a copy that hangs (a CUDA side stream behind a collective that never ends)
    leaves the count still, so the other ranks time out on this rank after
    ``timeout_s`` and say it was staging, instead of waiting for it forever."""
    pulse, progress = job.pulse, job.progress
    if pulse is None:
        return progress.wait_for
    total = job.plan.file_bytes
    said_writing = False

    def writing(offset: int) -> None:
        nonlocal said_writing
        staged = progress.staged
        what = f"writing its shard file, to byte {offset:,} of {total:,}"
        if not progress.done:  # (device copies may still be landing)
            what += f", while staging copies the rest (at byte {staged:,})"
        # The first piece it writes is said at once: beats go once a second, and a
        # trial's rank 1, dead as it wrote, was said to be "last staging: copied 4,096 of
        # 8,004,096 bytes", its beat as it began
        pulse(what, at_once=not said_writing)
        said_writing = True

    def ready(offset: int) -> None:
        while True:
            staged = progress.staged
            if staged >= offset or progress.failed:
                writing(offset)
            else:
                pulse(f"staging: copied {staged:,} of {total:,} bytes into host memory",
                      mark=staged)
            try:
                progress.wait_for(offset, timeout=pulse.every_s)
            except CheckpointTimeoutError:  # staging is slow: beat, look, wait on
                continue
            if not said_writing:
                writing(offset)
            return

    return ready


def withdraw_offers(transports: Sequence[Any], retired: str | None = None) -> None:
    """Take back what the arena is offered through (a transport's ``withdraw()``, or
    ``disallow_checkpoint()`` where it has none): peers must stop reading it before it
    changes or is released, and a save that did not commit is not served. Each transport
    may wait up to its timeout for a slow peer: together, not one after another.
    ``retired``: why nothing follows (a checkpointer that closes), for the peers' answer."""
    def stop(transport: Any) -> None:
        withdraw = getattr(transport, "withdraw", None)
        if callable(withdraw):
            if retired is None:
                withdraw()
            else:
                withdraw(retired)
        else:
            transport.disallow_checkpoint()

    if len(transports) <= 1:
        for transport in transports:
            stop(transport)
        return
    with cf.ThreadPoolExecutor(len(transports)) as pool:
        for done in [pool.submit(stop, t) for t in transports]:
            done.result()


def _offer_arena(job: SaveJob, manifest: bytes | None) -> None:
    """Serve the staged, checksummed arena to peers, before the save is even durable.

    ``manifest``: this save's, when the hash thread made one. A single process serves
    it as it is; a rank of a group serves a view of its own part (partial)."""
    from .transport.base import serve_arena

    if manifest is not None and not job.ctx.distributed:
        view = manifest  # (merging and encoding 100,000 tensors again took seconds)
    else:
        # A book of its own keeps the view's template, as the coordinator's keeps the
        # manifest's: merged again (~1.4 s at 100,000 tensors, before this rank could
        # announce its file) only when the layout changed.
        reports = job.reports
        try:
            with _gc_paused():
                view, _ = reports.served.manifest(
                    [reports.sender.sent_to(reports.served, job.ctx.rank)], step=job.step,
                    library_version=job.library_version, block_bytes=job.block_bytes,
                    user_metadata=job.user_metadata, created_unix=time.time(),
                    partial=job.ctx.distributed)
        except Exception as exc:  # serving is a bonus: it never costs the save itself
            reports.served = RecordBook()  # (whatever it held, the next save starts afresh)
            log.error("rank=%d step=%d: the view of this rank's part for peers could not be "
                      "made (not offered; the save goes on): %s: %s", job.ctx.rank, job.step,
                      type(exc).__name__, exc)
            return
    buf = job.arena.memoryview()[:job.plan.file_bytes]
    more: dict[str, Any] = {}
    if job.extras is not None and job.extras.filled:
        try:
            with _gc_paused():
                view, more = _with_extras(job, view)
        except Exception as exc:  # (served without them: loads that want them say so)
            log.error("rank=%d step=%d: the replicated tensors this rank does not write "
                      "could not be added to its view for peers (offered without them): "
                      "%s: %s", job.ctx.rank, job.step, type(exc).__name__, exc)
    for transport in job.serve_to:
        if getattr(transport, "closed", False) is True:  # shut down since serve(): stopped
            log.debug("rank=%d step=%d: not offered through %s: it was shut down",
                      job.ctx.rank, job.step, type(transport).__name__)
            continue
        try:
            transport.serve(serve_arena(job.step, view, job.plan.file, buf, more))
        except Exception as exc:  # serving is a bonus: it never costs the save itself
            log.error("rank=%d step=%d: offering the staged state to peers through %s failed "
                      "(the save goes on): %s: %s", job.ctx.rank, job.step,
                      type(transport).__name__, type(exc).__name__, exc)


def _with_extras(job: SaveJob, view: bytes) -> tuple[bytes, dict[str, Any]]:
    """``view`` with the job's extras added: their file (its header and the copies), and
    each of their tensors with its box and checksums, as a load of the view reads them."""
    from .transport.base import LiveSource, partial_manifest

    assert job.extras is not None
    plan, tensors = job.extras.plan, job.extras.tensors
    source = LiveSource(plan, tensors)
    sums = [block_checksums(source.tensor_view(it.key), job.block_bytes) for it in plan.items]
    extra = partial_manifest(job.ctx.rank, plan, job.flat, sums, step=job.step,
                             block_bytes=job.block_bytes, library_version=job.library_version)
    base = parse_manifest(view, f"the view of rank {job.ctx.rank}'s part of step {job.step}")
    both = dataclasses.replace(base, files={**base.files, **extra.files},
                               tensors={**base.tensors, **extra.tensors})
    return both.to_json(), {plan.file: source}


# What the hash thread hands the writer: this rank's record and, for a single process
# or the coordinator, the manifest's bytes, already written (and fsync'd) into the
# temporary directory.
_Described = tuple[dict[str, Any], bytes | None]

# How much longer than timeout_s without progress of the coordinator a peer waits for
# the verdict before it claims the step's outcome as "not committed".
_VERDICT_GRACE_S = 30.0


def _describe(job: SaveJob) -> _Described:
    """Checksum the staged bytes, then build this rank's record (and manifest).

    Runs on the hash thread once staging is over — hashing (~30 GB/s) would otherwise
    take a core from the copies the caller is waiting for — and still finishes long
    before the write does, so building and writing the manifest costs the save nothing.
    In a group, every other rank publishes its record here (whole, or what changed:
    reports.py), and the coordinator waits for all of them and merges the manifest while
    the shard files are still being written. The manifest lies in the temporary directory,
    which nothing reads before the rename that commits it (after every rank's ``done``).
    """
    job.progress.wait_for(job.plan.file_bytes)
    mv, bb, xxh = job.arena.memoryview(), job.block_bytes, xxhash.xxh3_64_hexdigest
    ctx = job.ctx
    # (a list per tensor: with the collector on, 100,000 of them set off full collections
    # of a process that holds the state tree, 0.8 s of a 0.16 s loop)
    with _gc_paused():
        sums = [[xxh(mv[it.offset:it.offset + it.nbytes])] if it.nbytes <= bb  # (most)
                else block_checksums(mv[it.offset:it.offset + it.nbytes], bb)
                for it in job.plan.items]
        record = _record(job, sums)
        # one process: the manifest in the same burst (a group's coordinator waits for
        # the others first, which it must not do with the collector off)
        raw = None if ctx.distributed else _manifest_bytes(job, [record])
    if ctx.distributed:
        if not ctx.is_coordinator:
            ctx.put(ctx.key(job.tag, "record", ctx.rank), record)
            return record, None
        try:  # (the coordinator's own record never goes through the Store)
            raw = _manifest_bytes(job, _gather_records(job, record))
        except BaseException as exc:
            job.progress.fail(exc)  # the step cannot commit: stop this rank's write now
            raise
    assert raw is not None
    while not job.room.wait(0.05):  # (the write thread makes room first: see _room_for)
        if job.progress.failed:
            raise RuntimeError("the save failed")  # (no manifest to write: the step is lost)
    try:
        job.storage.makedirs(job.tmp_path)  # the writer may not have made it yet
        job.storage.write_bytes(job.tmp_path / MANIFEST_NAME, raw)
    except BaseException as exc:
        job.progress.fail(exc)  # the step cannot commit: stop the shard's write now
        raise
    return record, raw


def _gather_records(job: SaveJob, mine: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's record, in rank order, ``mine`` first (coordinator); raises if a rank
    reported an error, and gives up once this save has failed anyway."""
    got = job.ctx.gather((job.tag, "record"), f"the reports of the shard files of step {job.step}",
                         cancelled=lambda: job.progress.failed, pulse=job.pulse,
                         have={job.ctx.rank: mine})
    _raise_failed(job, got)
    # (no beats while it merges them into the manifest)
    _say_doing(job, f"merging the reports of the shard files of step {job.step} into its "
                    "manifest")
    return [got[r] for r in sorted(got)]


def _say_doing(job: SaveJob, doing: str) -> None:
    """Beat at once with what the coordinator starts, work during which it does not beat
    (a peer timing out on it was told it was "waiting for the shard files" it had
    posted). Best effort: a Store that fails here fails no save whose files are written,
    and an abort posted meanwhile is the commit's claim to find."""
    if job.pulse is not None:
        with contextlib.suppress(CheckpointError):
            job.pulse(doing, at_once=True)


def _raise_failed(job: SaveJob, answers: dict[int, dict[str, Any]]) -> None:
    raise_failures(answers, f"step {job.step} aborted, nothing committed")


def _metric_modes(job: SaveJob) -> dict[str, str]:
    """What the save records of the way its checkpointer's best_metric ranks (nothing
    without best_metric, or without a best_mode given or inherited, or where the steps it
    would inherit one from cannot be listed: none is better than a wrong one)."""
    mm = job.metric_mode
    if mm is None:
        return {}
    try:
        mode = mm.for_save(job.root, job.storage, lambda: commit.committed_steps(
            job.root, job.storage, skip_denied=True))
        return {} if mode is None else {mm.metric: mode}
    except CheckpointConfigError:  # (a best_mode given against the steps': the save fails)
        raise
    except (OSError, CheckpointError) as exc:
        log.warning("rank=0 step=%d: the steps under %s could not be listed to tell which way "
                    "%r ranks (%s): the save records none", job.step, job.root, mm.metric, exc)
        return {}


def _manifest_bytes(job: SaveJob, records: list[dict[str, Any]]) -> bytes:
    """The manifest merged from every rank's record (reports.RecordBook), with the
    metrics and metadata any rank passed (``job.metrics`` and ``job.user_metadata``
    become what the manifest records)."""
    if job.ctx.distributed:
        job.metrics = merged_metrics(job.metrics, records, job.step,
                                     job.reports.metrics_warned)
        job.user_metadata = merged_metadata(job.user_metadata, records, job.step,
                                            job.reports.metadata_warned)
    job.metric_modes = _metric_modes(job)
    with _gc_paused():  # (its objects freed before resuming)
        raw, job.records = job.reports.book.manifest(
            records, step=job.step, library_version=job.library_version,
            block_bytes=job.block_bytes, user_metadata=job.user_metadata,
            created_unix=time.time(), metrics=job.metrics, metric_modes=job.metric_modes,
            strict_replicas=job.strict_replicas)
    if len(raw) > MAX_MANIFEST_BYTES:  # (no load would read it: the step is not committed)
        raise CheckpointSaveError(
            f"step {job.step}: its {MANIFEST_NAME} would take {len(raw):,} bytes, over the "
            f"{MAX_MANIFEST_BYTES:,} a load reads; the state has too many tensors (or chunks "
            "of them) for one manifest: save fewer, larger tensors; the step was not committed")
    return raw


def _check_shared(job: SaveJob) -> None:
    """Before the commit: the manifest and every rank's shard file must be in the
    temporary directory as this rank sees it. Ranks that each write to a directory of
    their own (a node-local disk under the same path) would otherwise commit a step whose
    other files are elsewhere, and report success; a single process checks that the
    directory it renames is the one it wrote."""
    tmp = job.tmp if job.tmp is not None else job.tmp_path
    if MANIFEST_NAME not in job.storage.listdir(tmp):
        raise CheckpointSaveError(
            f"step {job.step} aborted, nothing committed: its manifest is not in {tmp}; "
            "something moved or removed the directory while it was written")
    for rec in job.records:
        if rec.get("file") is None:
            continue
        path = tmp / rec["file"]
        try:
            fd = job.storage.open_read(path)
            try:
                size = job.storage.file_size(fd)
            finally:
                job.storage.close(fd)
        except FileNotFoundError:
            size = None
        if size == rec["bytes"]:
            continue
        seen = "is not there" if size is None else f"has {size} bytes, not {rec['bytes']}"
        longer = size is not None and size > rec["bytes"]
        writer = (f"{type(job.storage).__name__}.write_arena" if not job.ctx.distributed
                  else f"the write_arena of rank {rec['rank']}'s storage")
        wrote_more = (f"{writer} wrote more than it was given (it must write exactly "
                      "nbytes, not the buffer's padding), or something replaced the file "
                      "meanwhile")
        if not job.ctx.distributed or longer:  # (a longer file: no filesystem unshared)
            mine = "its" if not job.ctx.distributed else f"rank {rec['rank']}'s"
            # (a storage trial's write_arena that wrote too little was told "something
            # moved or removed it")
            why = wrote_more if longer else (
                f"{writer} wrote less than it was given (it must write exactly nbytes), or "
                "something cut it short meanwhile" if size is not None else
                f"{writer} returned without making it, or something moved or removed it "
                "meanwhile")
            raise CheckpointSaveError(
                f"step {job.step} aborted, nothing committed: {mine} shard file {path} "
                f"{seen}; " + why)
        raise CheckpointSaveError(
            f"step {job.step} aborted, nothing committed: rank {rec['rank']}'s shard file "
            f"{path} {seen} as rank {job.ctx.rank} sees it. The checkpoint directory must "
            "be on a filesystem every rank shares (e.g. NFS or Lustre), under the same "
            "path")


def _record(job: SaveJob, sums: list[list[str]]) -> dict[str, Any]:
    """This rank's record of the save: whole, or what changed (reports.RecordSender),
    and the metrics and metadata it was passed (the coordinator's own stay in the job)."""
    rec = job.reports.sender.record(
        rank=job.ctx.rank, coordinator=job.token if job.ctx.distributed else "",
        plan=job.plan, flat=job.flat, sums=sums, replicas=job.replicas,
        local=job.ctx.is_coordinator or not job.ctx.distributed)
    if job.ctx.distributed and not job.ctx.is_coordinator:
        if job.metrics:
            rec["metrics"] = metrics_text(job.metrics)
        if job.user_metadata:
            rec["metadata"] = dict(job.user_metadata)
    return rec


# (the protocol's own methods: named once, in storage.py)
def _storage_call(exc: BaseException) -> str:
    """The storage call ``exc`` came from, as ``LocalStorage.fsync_dir(/path)`` (the
    outermost, a subclass's own), or "": an EIO of an fsync names no file, and a storage's
    author could not tell which call failed."""
    tb = exc.__traceback__
    opened = None  # the path of the last caller that had one: what an fd call's fd is of
    while tb is not None:
        frame = tb.tb_frame
        owner = frame.f_locals.get("self")
        if frame.f_code.co_name in STORAGE_CALLS and owner is not None and hasattr(
                owner, "write_arena"):
            path = _first_argument(frame)
            if isinstance(path, int):  # (a trial read "file_size(None)")
                path = f"fd {path}" + (f" of {opened}" if opened else "")
            return f"{type(owner).__name__}.{frame.f_code.co_name}({path})"
        named = frame.f_locals.get("path")  # (what a caller opened is its "path")
        if isinstance(named, (str, os.PathLike)):
            opened = named
        tb = tb.tb_next
    return ""


def _first_argument(frame: FrameType) -> Any:
    """The first argument after ``self`` of ``frame``'s call (a path, or an fd), also of a
    storage written as ``def write_bytes(self, *args)`` (a trial's wrapper read
    "write_bytes(None)"); None if it has none."""
    code, names, local = frame.f_code, frame.f_code.co_varnames, frame.f_locals
    if code.co_argcount >= 2:
        return local.get(names[1])
    if code.co_flags & inspect.CO_VARARGS:
        rest = local.get(names[code.co_argcount + code.co_kwonlyargcount])
        if isinstance(rest, tuple) and rest:
            return rest[0]
    # (keyword-only, or **kwargs: the protocol's own names)
    for name in ("path", "src", "fd"):
        if name in local:
            return local[name]
    varargs = bool(code.co_flags & inspect.CO_VARARGS)
    kwargs = (local.get(names[code.co_argcount + code.co_kwonlyargcount + varargs])
              if code.co_flags & inspect.CO_VARKEYWORDS else None)
    if isinstance(kwargs, dict):
        return next((kwargs[n] for n in ("path", "src", "fd") if n in kwargs), None)
    return None


def _room_said(job: SaveJob, exc: BaseException) -> str:
    """For a full disk, the room free now and what this step takes (a trial could not
    tell its own steps from another's file filling the disk)."""
    free = _free_bytes(job.root) if isinstance(exc, OSError) and (
        exc.errno == errno.ENOSPC) else None
    if free is None:
        return ""
    free_mb, need_mb = _megabytes(free, job.plan.file_bytes)
    said = f" ({free_mb} free now; this step's file takes {need_mb}"
    if _free_inodes(job.root) == 0:
        # (a trial's full inode table read "8.4 MB free now; this step's file takes 0.0 MB";
        # then "no inode is free", the count and the fix unsaid: inodes come back as files
        # go, whatever their size, so it names the files to remove)
        said += ("; but 0 free inodes: the filesystem is out of files, not bytes (df -i): "
                 "remove files on it, old checkpoints or others, to free inodes")
    elif job.keep_last == 1:  # (no lower keep_last to advise)
        said += ("; keep_last=1 keeps one step besides the one being saved: the disk needs "
                 "room for two steps, or free space")
    return said + ")"


def _megabytes(a: int, b: int) -> tuple[str, str]:
    """``a`` and ``b`` in MB, with the digits that tell them apart (a trial read "4.2 MB
    free now; this step's file takes 4.2 MB")."""
    digits = 1
    while digits < 6 and f"{a / 1e6:.{digits}f}" == f"{b / 1e6:.{digits}f}" and a != b:
        digits += 1
    return f"{a / 1e6:.{digits}f} MB", f"{b / 1e6:.{digits}f} MB"


def os_error_hint(exc: BaseException, keep_last: int | bool | None = False) -> str:
    """Advice for an OSError of a save; ``keep_last`` that of the save's checkpointer
    (False: not known here)."""
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        # (a trial's keep_last=1, and one without keep_last, were told to lower it)
        fewer = ("free space, or keep fewer steps with keep_last= (this checkpointer keeps "
                 "every step)" if keep_last is None else
                 "free space (keep_last=1 keeps no fewer)" if keep_last == 1 else
                 "free space, or keep fewer steps with a lower keep_last=")
        deletions = (", whose deletions the next save makes before it writes where the disk "
                     "lacks room" if keep_last != 1 else "")
        return (f" (the disk is full, or out of inodes: {fewer}{deletions}: a save needs "
                "room for one step more than it keeps, as the oldest goes only after the new "
                "one is committed; earlier checkpoints are intact)")
    if isinstance(exc, OSError) and exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return " (check that the checkpoint directory is writable)"
    return ""
