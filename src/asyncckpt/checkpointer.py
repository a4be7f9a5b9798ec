"""AsyncCheckpointer: flatten -> plan -> stage (the caller waits here) -> write -> commit."""

from __future__ import annotations

import concurrent.futures as cf
import concurrent.futures.thread as cf_thread
import contextlib
import errno
import functools
import json
import logging
import math
import os
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from . import commit
from ._gc import gc_paused
from .best import (
    MODE_WORDS,
    KeepBest,
    MetricMode,
    NotDurableYet,
    Ranking,
    StepMetrics,
    check_ranking,
    checked_metrics,
    read_later_metrics,
    sweep_later_tmp,
    write_later_metrics,
)
from .best import MODES as BEST_MODES
from .commit import StepLike
from .dist import (
    DistContext,
    LocalItem,
    Pulse,
    Replica,
    assign_writers,
    decode_share,
    encode_share,
    layout_digest,
    layout_id,
    outside_ranks,
    raise_failures,
    resolve_context,
    silent_ranks_advice,
)
from .errors import (
    CheckpointClosedError,
    CheckpointConfigError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointInFlightError,
    CheckpointLockedError,
    CheckpointNotFoundError,
    CheckpointPermissionError,
    CheckpointSaveError,
    CheckpointTimeoutError,
    NotPicklableError,
    add_note,
    add_note_of,
    check_flags,
    retold,
    seconds_text,
    with_advice,
)
from .loader import (
    LATEST_TRIES,
    KeyMap,
    ShardMetadata,
    apply_shards,
    check_exclude,
    check_fallback,
    check_key_map,
    check_progress,
    check_threads,
    excluded_view,
    load_from,
    load_newest_intact,
)
from .manifest import (
    DEFAULT_BLOCK_BYTES,
    Manifest,
    align_up,
    block_checksums,
    check_block_bytes,
    shard_file_name,
)
from .plan import WritePlan, layout_signature, plain_memory, plan_writes
from .reader import outpaced, read_manifest, read_manifest_summary, tensor_bytes
from .reports import Reports
from .staging import (
    HostArena,
    StagingProgress,
    StagingStopped,
    caller_streams,
    side_streams,
    stage,
)
from .storage import STORAGE_CALLS, DirectoryLock, LocalStorage, Storage
from .tree import FlatState, changed_in_place, dtype_name, flatten
from .tree import version_counters as _versions  # (a test stands in for it here)
from .writer import (
    BackgroundWriter,
    CheckpointFuture,
    CheckpointInfo,
    Extras,
    Handover,
    SaveJob,
    os_error_hint,
    wait_seconds,
    withdraw_offers,
)

# (stored as its text, read back as str: numpy's numbers and 0-dim tensors too)
MetadataValue = str | int | float | bool | np.bool_ | np.integer[Any] | np.floating[Any] \
    | torch.Tensor

_CALLING_SAVE = threading.local()  # .on: save_async is called by save() on this thread

# What a warning of the steps a fallback load passed over says to do
FALLBACK_REMEDY = "ckpt.discard_steps_after(<the step loaded>)"
# What a warning of a step a plain load found damaged says to do (nothing was loaded: the
# fallback's "discard_steps_after(<the step loaded>)" would name no step, and a user who
# put the step before the damaged one there deleted the intact steps after it)
PLAIN_LOAD_REMEDY = ("load(..., fallback=True) loads the newest intact step; "
                     "discard_steps_after(s) removes every step after s, intact or not")

# what a rank out of step with its group is told to do (every rank is told at one save)
_REOPEN_ADVICE = (". To go on, every rank closes its checkpointer, waits until every "
                  "rank's close() has returned (a dist.barrier()), and opens a new one")

log = logging.getLogger(__name__)

_MODES = {"sync": "sync", "disabled": "sync", "async": "async",
          "async_pinned": "async_pinned", "async_with_pinned_mem": "async_pinned"}


@dataclass(frozen=True, kw_only=True)
class CheckpointerConfig:
    """How an AsyncCheckpointer saves. Validated when built (CheckpointConfigError)."""

    mode: str = "async_pinned"
    """"sync", "async" or "async_pinned" (aliases: "disabled", "async_with_pinned_mem")."""
    keep_last: int | None = None
    """Keep only the newest N committed steps; None keeps everything."""
    keep_every: int | None = None
    """With keep_last: older steps that are multiples of this are kept too (milestones)."""
    keep_best: int | None = None
    """With keep_last: the N steps whose ``best_metric`` (recorded by
    ``save_async(metrics=...)``) is best are kept too."""
    best_metric: str | None = None
    """The metric that ranks steps, for keep_best and ``best_step()``."""
    best_mode: str | None = None
    """"min" (a loss: less is better) or "max" (an accuracy); None: as the newest step
    under the directory that recorded one says (with ``best_metric``, each save records
    the mode given, or so inherited), else "min" (not recorded: a default is no choice)."""
    on_busy: str = "wait"
    """When a save is asked for while one is in flight: "wait" for it, or "error"."""
    direct_io: bool = True
    """Write shard files with O_DIRECT where the filesystem allows it."""
    block_bytes: int = DEFAULT_BLOCK_BYTES
    """Checksum granularity: one xxh3-64 per this many bytes of each tensor."""
    timeout_s: float = 600.0
    """How long any cross-rank wait may take before it fails naming the silent ranks."""
    strict_replicas: bool = False
    """In a group: refuse to commit a save whose ranks hold different values at one path
    (a replicated tensor of any size or device, or a non-tensor value) rather than
    warn and keep one; every rank hashes the replicas it does not write, on the
    caller's thread."""
    copy_threads: int | None = None
    """Threads that copy CPU tensors into the arena (and fault in a new one); None: see
    default_copy_threads()."""

    def __post_init__(self) -> None:
        if not isinstance(self.mode, str) or self.mode not in _MODES:
            raise CheckpointConfigError(f"mode={self.mode!r}: use one of {sorted(_MODES)}")
        object.__setattr__(self, "mode", _MODES[self.mode])
        for name in ("keep_last", "keep_every", "keep_best"):  # (numpy's ints too, as steps)
            value = getattr(self, name)
            if isinstance(value, np.integer):
                object.__setattr__(self, name, int(value))
        if self.keep_last is not None and (type(self.keep_last) is not int or self.keep_last < 1):
            raise CheckpointConfigError(
                f"keep_last={self.keep_last!r}: use a positive int, or None to keep every "
                "checkpoint")
        if self.keep_every is not None and (type(self.keep_every) is not int
                                            or self.keep_every < 1):
            raise CheckpointConfigError(
                f"keep_every={self.keep_every!r}: use a positive int (steps that are its "
                "multiples outlive keep_last), or None")
        if self.keep_every is not None and self.keep_last is None:
            raise CheckpointConfigError(
                f"keep_every={self.keep_every} spares steps from the keep_last retention, "
                "which is off (keep_last=None keeps every step): pass keep_last too")
        check_ranking(self.best_metric, self.best_mode, unset=True)
        if self.keep_best is not None:
            if type(self.keep_best) is not int or self.keep_best < 1:
                raise CheckpointConfigError(
                    f"keep_best={self.keep_best!r}: use a positive int (the steps with the "
                    "best metric that outlive keep_last), or None")
            if self.best_metric is None:
                raise CheckpointConfigError(
                    f"keep_best={self.keep_best} needs best_metric: the name of the metric "
                    "that saves record (save_async(..., metrics={'val_loss': loss})), e.g. "
                    "best_metric='val_loss'")
            if self.keep_last is None:
                raise CheckpointConfigError(
                    f"keep_best={self.keep_best} spares steps from the keep_last retention, "
                    "which is off (keep_last=None keeps every step): pass keep_last too "
                    "(keep_last=1 keeps the newest step to resume from)")
        if not isinstance(self.on_busy, str) or self.on_busy not in ("wait", "error"):
            raise CheckpointConfigError(f"on_busy={self.on_busy!r}: use 'wait' or 'error'")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) \
                or not 0 < self.timeout_s < math.inf:
            raise CheckpointConfigError(f"timeout_s={self.timeout_s!r}: use a positive, finite "
                                        "number of seconds (a day is 86400)")
        # ("no" would read as True; numpy's bools are kept as Python's: the settings go
        # to the other ranks as JSON)
        check_flags(strict_replicas=self.strict_replicas, direct_io=self.direct_io)
        object.__setattr__(self, "strict_replicas", bool(self.strict_replicas))
        object.__setattr__(self, "direct_io", bool(self.direct_io))
        if self.copy_threads is None:
            object.__setattr__(self, "copy_threads", default_copy_threads())
        elif type(self.copy_threads) is not int or self.copy_threads < 1:
            raise CheckpointConfigError(
                f"copy_threads={self.copy_threads!r}: use a positive int, or None for the default")
        check_block_bytes(self.block_bytes)


def checked_directory(path: object, name: str) -> Path:
    """``path`` as a Path; an empty one (an unset variable's "", which would mean the
    current directory) or one of another type is refused, naming the argument."""
    if not isinstance(path, (str, os.PathLike)) or isinstance(os.fspath(path), bytes):
        raise CheckpointConfigError(f"{name}={path!r}: pass a path (a str or os.PathLike)")
    if os.fspath(path) == "":
        raise CheckpointConfigError(f"{name}='': pass a path ('.' for the current directory)")
    return Path(path)


def _warn_fsdp_optimizers(flat: FlatState, rank: int) -> None:
    """An FSDP2 model's optimizer saved as the object: its state dict keys the moments by
    parameter index, which a resume into a fresh optimizer cannot load (the load refuses:
    they would come back whole and plain). A trial saved it so and found out at resume."""
    found = [p or "<root>" for p, (obj, _) in flat.statefuls.items()
             if isinstance(obj, torch.optim.Optimizer) and any(
                 type(x).__name__ == "DTensor" for g in obj.param_groups for x in g["params"])]
    if found and rank == 0:
        log.warning("saving the optimizer object at %s of a model with DTensor parameters "
                    "(FSDP2): its state is keyed by parameter index, and a resume into a fresh "
                    "optimizer cannot load it; save get_state_dict(model, optim)[1] "
                    "(torch.distributed.checkpoint.state_dict) instead, and load it back with "
                    "set_state_dict (see examples/train_fsdp.py)", ", ".join(map(repr, found)))


def _refuse_a_step_as_root(directory: Path) -> None:
    """A step directory (``CheckpointInfo.path``, what ``ls`` prints) passed as the
    directory to save into: the new steps would lie inside a committed one, where no
    listing finds them and its removal by retention takes them along."""
    step_dir = commit.step_dir_around(directory)
    if step_dir is None:
        return
    where = (f"is a step directory of the checkpoint {step_dir.parent}" if step_dir == directory
             else f"is inside the step directory {step_dir} of a checkpoint")
    raise CheckpointConfigError(
        f"{directory} {where}: saving there would hide the new "
        "steps inside a committed one, and retention would delete them with it; pass the "
        f"checkpoint root (e.g. {step_dir.parent}) or a directory of its own")


def _symlink_loop(path: Path) -> str | None:
    """Why ``path`` cannot be reached, when a symbolic link loop is the reason (makedirs
    then reports it as "exists"); None otherwise."""
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return str(exc.strerror or exc)
    return None


def default_copy_threads() -> int:
    """The CPUs this process may run on, shared among the ranks of this machine (the
    ``LOCAL_WORLD_SIZE`` that torchrun sets), at most 4 and at least 1.

    Ranks that copy with more threads than the machine has cores take turns on them:
    two ranks on two cores staged in ~1.5x the time with two threads each than with one.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        local = 1
    return max(1, min(4, cpus // max(1, local)))


MISSED_SHOWN = 20  # unwaited failures told one by one on the error that reports them

# The host buffer: one that must grow is made 1/16 larger than needed, in whole 2 MiB
# pages; one more than twice (and 64 MiB over) what this many saves in a row needed is
# made anew at their size (a state that shrank for good: its memory back; not one that
# only alternates, nor a passing dip, which would fault a new one in at each save).
_ARENA_GRAIN = 2 << 20
_ARENA_SHRINK_AFTER = 3


def _far_too_large(have: int, need: int) -> bool:
    return have > 2 * need and have - need > (64 << 20)



def _address_space_note() -> str:
    """For a host buffer that could not be allocated: the address space limit, if this
    process has one (a memory trial's ulimit -v refused a save with memory to spare:
    threads' malloc arenas take address space, not memory)."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, OSError, ValueError, AttributeError):
        return ""
    if soft == resource.RLIM_INFINITY:
        return ""
    return (f". This process's address space is limited to {soft / 1e9:.2f} GB (ulimit -v), "
            "which counts what threads reserve, not only memory in use: raise the limit, or "
            "set MALLOC_ARENA_MAX=2 in the environment (fewer malloc arenas)")


def _checked_storage(storage: Any) -> Storage:
    """``storage=``, checked for the calls saves and loads make (a trial's "local" and
    object() failed the first save with an AttributeError)."""
    if storage is None:
        return LocalStorage()
    lacking = [name for name in STORAGE_CALLS if not callable(getattr(storage, name, None))]
    if lacking:
        raise CheckpointConfigError(
            f"storage={storage!r:.60} is no Storage: it lacks {', '.join(lacking[:4])}"
            f"{'...' if len(lacking) > 4 else ''}; pass None for the local filesystem, or an "
            "instance of a subclass of asyncckpt.storage.LocalStorage")
    return cast(Storage, storage)


# What fsync of a directory fails with where the storage lost what it was given (any other
# error: a filesystem that does not do it, or refuses it, nothing lost)
_FSYNC_FAILED = frozenset({errno.EIO, errno.ENOSPC, errno.EDQUOT})


def _silent_ranks(exc: BaseException) -> set[int]:
    """The ranks other than 0 a failed save's error names as silent (dead or hung: a
    timeout's ``ranks``), which will read no verdict."""
    if not isinstance(exc, CheckpointTimeoutError):  # (a user's error may have ranks)
        return set()
    try:
        return {int(r) for r in getattr(exc, "ranks", ()) or ()} - {0}
    except Exception:
        return set()


class AsyncCheckpointer:
    """Saves state trees without stopping training; loads them back, verified.

    Not thread-safe: call it from the training thread. One save is in flight at a
    time; its background work runs on the checkpointer's own threads. Under
    torch.distributed, ``save_async`` and ``save`` are collective: call them on every
    rank of the group, the same number of times, with the same step. The ranks'
    checkpointers of one directory pair up by the order of their first saves (open one
    on a single rank to load or list steps at will). Loading is not collective, except
    ``load(fallback=True)`` in a group, whose ranks agree on the step.

    Example:
        >>> ckpt = AsyncCheckpointer("runs/exp1", keep_last=3)
        >>> fut = ckpt.save_async({"model": model, "optim": opt}, step=100)
        >>> ...                     # training goes on
        >>> fut.wait().durable_s
    """

    def __init__(self, directory: str | os.PathLike[str], *, mode: str = "async_pinned",
                 keep_last: int | None = None, on_busy: str = "wait", direct_io: bool = True,
                 block_bytes: int = DEFAULT_BLOCK_BYTES, timeout_s: float = 600.0,
                 process_group: Any = None, rank: int | None = None,
                 world_size: int | None = None, store: Any = None,
                 storage: Storage | None = None, copy_threads: int | None = None,
                 keep_every: int | None = None, keep_best: int | None = None,
                 best_metric: str | None = None, best_mode: str | None = None,
                 strict_replicas: bool = False):
        self._pid = os.getpid()
        self.config = CheckpointerConfig(mode=mode, keep_last=keep_last,
                                         keep_every=keep_every, keep_best=keep_best,
                                         best_metric=best_metric, best_mode=best_mode,
                                         strict_replicas=strict_replicas, on_busy=on_busy,
                                         direct_io=direct_io, block_bytes=block_bytes,
                                         timeout_s=timeout_s, copy_threads=copy_threads)
        if self.config.mode == "async_pinned" and not torch.cuda.is_available():
            # (as documented, but a trial found only host_buffer_pinned to tell it)
            log.info("mode=%r without CUDA: the saves stage into ordinary (pageable) host "
                     "memory, as mode='async' does", mode)
        given = os.path.abspath(checked_directory(directory, "directory"))
        self.storage: Storage = _checked_storage(storage)
        # The directory is pinned now, as the lock is taken on it: a relative path read
        # again after an os.chdir, or a symlink pointed elsewhere during a save, split the
        # save between two directories (and the commit renamed the half with the manifest).
        self.directory = Path(os.path.realpath(given) if isinstance(self.storage, LocalStorage)
                              else given)
        # (a checkpointer made before init_process_group saves as one process: a trial's
        # rank 1 committed its own state as the whole job's step, and rank 0 was told
        # "another process" held the lock)
        self._before_group = (process_group is None and rank is None and world_size is None
                              and store is None and not _group_up())
        self._ctx: DistContext = resolve_context(
            # (not realpath: nodes may resolve one shared alias to different mounts)
            given, process_group=process_group, rank=rank,
            world_size=world_size, store=store, timeout_s=timeout_s)
        if self._ctx.distributed:
            self._ctx.note_opened()
        self._lock = DirectoryLock(self.directory)
        self._lock.made_at = _caller_site()
        self._lock.owner = weakref.ref(self)
        self._metrics = StepMetrics()  # each committed step's, read once (best_step)
        cfg = self.config
        # which way best_metric ranks: recorded by each save, for readers without it
        self._metric_mode = None if cfg.best_metric is None else MetricMode(
            cfg.best_metric, cfg.best_mode, self._metrics)
        self._keep_best = None if cfg.keep_best is None or self._metric_mode is None else (
            KeepBest(cfg.keep_best, self._metric_mode))
        self._writer: BackgroundWriter | None = None
        self._arena: HostArena | None = None
        self._small_saves = 0  # saves in a row that needed far less than the arena holds
        self._told_foreign = False  # steps() warned of another format's checkpoint here
        # load() warned of this save in flight (weak: no future is kept for it)
        self._told_in_flight: weakref.ref[CheckpointFuture] | None = None
        self._small_need = 0  # ... and the most one of them needed
        self._plan: WritePlan | None = None
        self._arena_header_for: WritePlan | None = None  # whose header the arena holds
        self._cleaned = False
        self._cleaning: cf.Future[None] | None = None  # (see _cleanup)
        self._pending: CheckpointFuture | None = None
        self._last_said: tuple[int, str] | None = None  # (step, outcome) wait() handed over
        self._refused_tag: str | None = None  # the last save the coordinator refused to start
        self._refused_outside = 0  # how many ranks it found in another save (not to wait for)
        self._closed = False
        self._record_lock = threading.Lock()  # (record_metrics: one at a time here)
        self._other_modes: dict[str, MetricMode] = {}  # (best_step of other metrics)
        self._told_infinite = False  # (_warn_if_first_for_ever)
        self._transports: list[Any] = []
        self._seq = 0
        self._preparing: cf.Future[Any] | None = None
        # prepare() met an optimizer without its state yet (the allocation hint says so)
        self._prepared_stateless = False
        self._prev_tag: str | None = None
        self._failed_tags: list[str] = []  # saves that failed before the layout exchange
        self._in_use = commit.StepsInUse()  # steps being loaded: retention leaves them
        self._reports = Reports()  # what the coordinator holds of each rank's records
        # a failed save nobody waited on: (its future, its error), raised by wait()
        # (the seen flag of the future whose failure nobody asked for, and that failure)
        self._missed: tuple[list[bool], CheckpointSaveError] | None = None
        self._retention: cf.Future[None] | None = None
        self._damaged: set[int] = set()  # steps a fallback load found damaged
        self._looked_at_optimizers = False  # (at the first save: see _warn_fsdp_optimizers)
        self._discards = 0  # discard_steps_after calls: collective, as saves are
        # (the group's layout id, this rank's digest in it, the keys this rank writes)
        self._layout: tuple[str, str, set[str]] | None = None
        self._digests: tuple[str, ...] = ()  # coordinator: every rank's, in self._layout
        self._shared: set[str] = set()  # coordinator: the layouts whose shares it posted
        self._my_digest: str | None = None
        self._my_order: list[str] = []  # the keys of self._my_digest's layout, in order
        self._my_sig: tuple[Any, ...] | None = None  # what self._my_digest was made from
        self._posted_digests: set[str] = set()  # every layout this rank posted
        self._probed: tuple[Any, list[str]] | None = None  # (for _layout) replicas to hash
        self._extras: Extras | None = None  # (serving in a group) copies of others' tensors
        # Names the temporary directory the ranks share: the coordinator's, which the
        # others learn in each save's layout exchange.
        self._nonce = commit.new_token()
        self._calling = threading.Lock()  # held while save_async, prepare or close runs
        self._caller = ("?", "?")  # which of them, on which thread

    @property
    def rank(self) -> int:
        return self._ctx.rank

    @property
    def world_size(self) -> int:
        return self._ctx.world_size

    @property
    def host_buffer_bytes(self) -> int:
        """Bytes of the host buffer saves stage into (0 before the first save or
        ``prepare()``, and after ``close()``): kept and reused, made anew when the state
        outgrows it (1/16 to spare) or shrinks for good. For memory budgets and logs."""
        arena = self._arena
        return 0 if arena is None else arena.nbytes

    @property
    def host_buffer_pinned(self) -> bool:
        """Whether that buffer is pinned (page-locked) memory: only with mode
        "async_pinned" and CUDA present; without CUDA it is ordinary memory."""
        arena = self._arena
        return arena is not None and arena.pinned

    def release_host_buffer(self) -> int:
        """Free the host buffer saves stage into, and return its bytes (0: none held); the
        next save (or ``prepare()``) allocates it again, as the first save did.

        For a root that saves rarely (the best model, an EMA copy): its buffer, of the
        state's size, is otherwise held from one save to the next. Waits for the save in
        flight to be written and a background ``prepare()`` to end (a failure stays for
        ``wait()``), then withdraws what ``serve()`` offers from the buffer (a peer
        fetching it is told the step is no longer served). Pinned memory goes back to
        torch's cache of pinned memory, which the next pinned save takes from. After
        ``close()``, which frees it, 0.

        Example:
            >>> best.save(state, step, metrics={"val_loss": loss})
            >>> best.release_host_buffer()
        """
        self._refuse_forked("release_host_buffer")
        if self._closed:
            return 0
        with self._one_call("release_host_buffer"):
            self._check_open()
            pending, preparing = self._pending, self._preparing
            if pending is not None:  # (not pending.wait(): its error stays uncollected)
                cf.wait([pending._durable])
            if preparing is not None:
                cf.wait([preparing])
            arena = self._arena
            if arena is None and self._extras is None:
                return 0
            # (peers stop reading it first, and are told at once: a QA trial's waited out
            # their timeout for it)
            self._stop_serving(retired="its checkpointer released the host buffer it "
                                       "served from (release_host_buffer): its next save "
                                       "offers again")
            self._arena = self._extras = None
            self._arena_header_for = None
            self._small_saves = self._small_need = 0
            return 0 if arena is None else arena.nbytes

    # --- saving --------------------------------------------------------------------------

    def save_async(self, state: Any, step: StepLike, *, overlap: bool = False,
                   metadata: Mapping[str, MetadataValue] | None = None,
                   shards: Mapping[str, ShardMetadata] | None = None,
                   metrics: Mapping[str, Any] | None = None) -> CheckpointFuture:
        """Stage ``state`` into the host arena and write it in the background.

        Returns once the tensors are copied (with ``overlap=True``, at once: then call
        ``fut.wait_staged()`` before mutating the tensors, e.g. before
        ``optimizer.step()``). The future completes when the checkpoint is committed —
        under torch.distributed, when every rank's part is. ``shards`` declares the
        global shape and offsets of tensors sharded by hand (DTensors need nothing).
        ``metrics`` (names to numbers, e.g. ``{"val_loss": 2.31}``) are recorded in the
        manifest, for ``keep_best`` and ``best_step()``; in a group, any rank may pass
        them (the last stage of a pipeline knows the loss), and where several pass a
        name, the lowest rank's value is recorded (differing values are warned of).

        Raises:
            CheckpointInFlightError: a save is in flight and ``on_busy="error"``.
            CheckpointExistsError: ``step`` is already committed, or a later step is.
            UnsupportedLeafError: the state holds a value that cannot be saved.
        """
        check_flags(overlap=overlap)
        self._refuse_forked("save_async")
        # (named as the caller called it: a thread refused beside a save() was told that
        # "its save_async()" ran, which the trainer never called)
        called = "save" if getattr(_CALLING_SAVE, "on", False) else "save_async"
        _CALLING_SAVE.on = False  # (a signal handler's call inside this one is its own)
        with self._one_call(called), contextlib.ExitStack() as paused:
            return self._save_async(state, step, overlap=overlap, metadata=metadata,
                                    shards=shards, metrics=metrics, paused=paused)

    def _refuse_before_group(self, what: str) -> None:
        """CheckpointConfigError for a checkpointer made before init_process_group, now
        that a group of several ranks is up: as one process, each rank's would take the
        lock as rank 0 and save its state alone."""
        if self._before_group and _group_up():
            import torch.distributed as dist

            if dist.get_world_size() > 1:
                raise CheckpointConfigError(
                    f"{what}(): this AsyncCheckpointer of {self.directory} was made before "
                    f"torch.distributed.init_process_group, as one process: its saves would "
                    f"hold this rank's state alone (of {dist.get_world_size()} ranks). Make "
                    "it after init_process_group (or, for a checkpointer of this process "
                    "alone, pass rank=0, world_size=1)")

    @contextlib.contextmanager
    def _one_call(self, what: str) -> Iterator[None]:
        """Refuse a call that would start while save_async, prepare or close runs: from a
        signal handler interrupting it, or from another thread. Until save_async returns,
        its save is not yet the one in flight: a second one would stage into the same
        arena while the first is written from it (a step committed with wrong bytes), or,
        waiting for it, deadlock the handler that interrupted its staging."""
        if not self._calling.acquire(blocking=False):
            busy = self._caller
            raise CheckpointInFlightError(
                f"{what}() of the checkpointer of {self.directory} was called while its "
                f"{busy[0]}() is still running on thread {busy[1]!r}: a checkpointer takes "
                "one call at a time. From a signal handler, set a flag and save from the "
                "training loop; from several threads, save from one")
        self._caller = (what, threading.current_thread().name)
        try:
            yield
        finally:
            self._caller = ("?", "?")
            self._calling.release()

    def _save_async(self, state: Any, step: StepLike, *, overlap: bool,
                    metadata: Mapping[str, MetadataValue] | None,
                    shards: Mapping[str, ShardMetadata] | None,
                    metrics: Mapping[str, Any] | None,
                    paused: contextlib.ExitStack) -> CheckpointFuture:
        started = time.perf_counter()
        self._check_open()
        ctx = self._ctx
        self._refuse_before_group("save_async")
        if ctx.distributed:
            ctx.join()  # the first save pairs this checkpointer with the other ranks'
        self._seq += 1  # counted on every rank alike: saves are collective
        tag = f"n{self._seq}"
        had_lock = True
        try:
            step = commit.as_step(step)
            user_metadata = _checked_metadata(metadata)
            recorded = checked_metrics(metrics)
            # (inside: a rank still busy with its last save, on_busy="error", must tell the
            # others, who would otherwise wait out their timeout for it)
            # (done too, where its future was not asked since: a trial's guard,
            # latest_step() != step, ran while it was in flight, then a validation pass
            # let it commit; a save() waited for is a step saved before)
            pending = self._pending
            same_in_flight = (pending is not None and pending.step == step
                              and not (pending.done() and pending.observed))
            self._wait_for_previous()
            if ctx.is_coordinator:
                had_lock = self._lock.held
                self._take_lock()
            try:
                commit.check_new_step(self.directory, step, self.storage,  # (before any write)
                                      retention=self.config.keep_last is not None)
            except CheckpointExistsError as exc:
                # (a researcher trial saved a step, validated it, then saved it again with
                # metrics=: refused, and the metrics were lost without a word; keep_best
                # then kept nothing of its best step)
                committed = commit.still_there(self.directory, commit.step_dir_name(step),
                                               self.storage)
                lost = "" if not recorded else (
                    f"; its metrics ({', '.join(f'{k}={v:g}' for k, v in recorded.items())}) "
                    "were NOT recorded by this save" + (
                        ": record_metrics(step, metrics) adds them to the committed step"
                        if committed else ""))
                if not same_in_flight or self._last_said != (step, "committed"):
                    if lost:
                        raise retold(exc, f"{exc}{lost}") from None
                    raise
                # (a preemption trial's guard, latest_step() != step, ran while this very
                # step's save was in flight: the final save raised, and its advice,
                # discard_steps_after, would have deleted the step just committed)
                raise CheckpointExistsError(
                    f"step {step} is already committed at "
                    f"{self.directory / commit.step_dir_name(step)} by this checkpointer's "
                    "own previous save of it (in flight, or not waited for, when this call "
                    "came): it is saved"
                    + (lost or ", nothing to do") + ". latest_step() counts a step once its "
                    "save commits: before it, check is_pending or call wait()") from None
            if self._metric_mode is not None and not ctx.distributed:
                # (a best_mode given against the steps' refused here, before anything is
                # staged or written: once per checkpointer, then known; a group's
                # coordinator refuses at the start of its write, for every rank)
                self._metric_mode.for_save(self.directory, self.storage, lambda: (
                    commit.committed_steps(self.directory, self.storage, skip_denied=True)))
            self._warn_if_first_for_ever(step, recorded)
            # Flattening, the layout exchange, planning and staging make thousands of
            # small objects; with a large state alive, the collections they set off took
            # 0.2 s of a 0.5 s save (2 ranks). Paused from here until the copy is done:
            # not over the wait for the previous save above, nor (mode="sync") the write.
            paused.enter_context(gc_paused(settle=True))
            flat = flatten(state)
            apply_shards(flat, shards)
            if shards and not ctx.distributed:
                _refuse_partial_shards(flat, shards)
            if not self._looked_at_optimizers:
                self._looked_at_optimizers = True
                _warn_fsdp_optimizers(flat, ctx.rank)
            mine = self._my_keys(step, tag, flat)
            tensors = {k: t for k, t in flat.tensors.items() if k in mine}
            replicas = self._replica_checksums(flat) if ctx.distributed else {}
            self._stop_serving()  # before the arena's header or bytes change
            extras = self._extras_for(flat, mine) if ctx.distributed and (
                self._transports) else None
            if self._preparing is not None:  # an arena being allocated ahead of time
                preparing, self._preparing = self._preparing, None
                cf.wait([preparing])
                failed = preparing.exception()
                if failed is not None:  # (its future told whoever asked it)
                    # Not this save's failure: it allocates for its own layout below.
                    log.warning("rank=%d step=%d: the prepare() before this save failed "
                                "(%s: %s); this save allocates its own host buffer",
                                ctx.rank, step, type(failed).__name__, failed)
            plan = self._plan_for(tensors)
            allocating = time.perf_counter()
            arena = self._arena_for(plan, save=True)  # may fail: e.g. out of (pinned) memory
            _hint_prepare(ctx.rank, step, plan, time.perf_counter() - allocating,
                          self._prepared_stateless)
        except BaseException as exc:
            if ctx.is_coordinator and not had_lock and self._lock.held and (
                    self._pending is None or self._pending.done()):
                # The first save, refused before anything was written (a step older than
                # the directory's): the lock goes, or a checkpointer a notebook's last
                # traceback keeps alive would refuse the corrected cell's new one.
                self._lock.release()
            # Up to here the other ranks wait on this one: tell them, or they time out.
            self._announce_failure(tag, exc, step if type(step) is int else None)
            if tag != self._prev_tag:  # not reached the layout exchange: not forgotten there
                self._failed_tags.append(tag)
            raise
        progress = StagingProgress()
        self._damaged.discard(step)  # (not committed now: saved anew, it is intact)
        job = SaveJob(
            root=self.directory, step=step, plan=plan, arena=arena, progress=progress,
            flat=flat, ctx=ctx,
            # ranks share one temporary directory per step, named by the run's nonce
            token=self._nonce if ctx.distributed else commit.new_token(),
            storage=self.storage, keep_last=self.config.keep_last,
            keep_every=self.config.keep_every, block_bytes=self.config.block_bytes,
            damaged=frozenset(self._damaged),
            library_version=_version(),
            user_metadata=user_metadata, direct_io=self.config.direct_io,
            metrics=recorded, keep_best=self._keep_best, known=self._metrics,
            metric_mode=self._metric_mode,
            strict_replicas=self.config.strict_replicas,
            started=started, tag=tag, in_use=self._in_use, replicas=replicas,
            reports=self._reports, sync=self.config.mode == "sync",
            pulse=Pulse(ctx, tag) if ctx.distributed else None)
        job.serve_to = list(self._transports)
        job.extras = extras
        writer = self._ensure_writer()
        staged: cf.Future[None] | None = None
        try:
            durable, self._retention = writer.submit(job)  # follows the staging progress
            if overlap and self.config.mode != "sync":
                # (what is copied, the extras too, must not change until wait_staged())
                watched = tensors if extras is None else {**tensors, **extras.live}
                # (a DTensor's own counter: an in-place op on it leaves its local
                # tensor's as it was, and a trial's FSDP2 saves committed changed values)
                counted = {k: flat.wrappers.get(k, t) for k, t in watched.items()} if (
                    flat.wrappers) else watched
                if flat.aliases:  # (a review: a change through a tied alias went unseen)
                    counted = {**counted, **flat.aliases}
                versions = _versions(counted)
                check = functools.partial(_check_unchanged, step, counted, versions)
                # (set before staging is queued: the writer reads it once staging is done)
                job.handover = Handover(functools.partial(
                    _check_unchanged, step, counted, versions, handover=True))
                # (the caller's streams, taken here: the stager thread has its own)
                staged = writer.stager.submit(_stage_or_fail, plan, tensors, arena, progress,
                                              writer, stoppable=True, check=check,
                                              after=caller_streams(watched), extras=extras)
            else:
                staged = cf.Future()
                try:
                    _stage_or_fail(plan, tensors, arena, progress, writer, extras=extras)
                except BaseException as exc:
                    progress.fail(exc)  # (interrupted before staging began: tell the writer)
                    staged.set_exception(exc)
                    with contextlib.suppress(BaseException):
                        durable.result()
                    raise
                staged.set_result(None)
            job.blocked_s = time.perf_counter() - started
            fut = CheckpointFuture(step, durable, staged, progress, plan.written_bytes,
                                   job.handover)
            self._pending = fut
        except BaseException as exc:
            # From writer.submit on, the writer follows this save: an interrupt (Ctrl-C)
            # before staging began must fail its progress (or the writer waits forever),
            # and the save stays pending, so that the next one waits for the writer to
            # let go of the arena. The caller sees the interrupt: the future's failure
            # is not reported again.
            if staged is None:
                progress.fail(exc)
                staged = cf.Future()
                staged.set_exception(exc)
            # (an interrupt in submit, or as it returned: its write task, if queued, is
            # the job's; none queued, nothing follows this save)
            queued = job.durable
            if queued is not None and (self._pending is None
                                       or self._pending._durable is not queued):
                self._pending = CheckpointFuture(step, queued, staged, progress,
                                                 plan.written_bytes)
                self._pending.observed = True
            raise
        paused.close()
        if self.config.mode == "sync":
            info = fut.wait()
            self._retention_done()  # keep_last's removals too: sync means done
            if info is not None:  # (the caller's whole wait, those removals with it: a
                # trial's slow deletes took 0.5 s that blocked_s, measured at the commit,
                # left out)
                object.__setattr__(info, "blocked_s", time.perf_counter() - started)
        log.debug("rank=%d step=%d save_async returned after %.3fs", ctx.rank, step,
                  time.perf_counter() - started)
        return fut

    def prepare(self, state: Any, *, background: bool = True,
                shards: Mapping[str, ShardMetadata] | None = None) -> cf.Future[Any]:
        """Allocate the host arena for ``state``'s layout now, not in the first save.

        Allocating and faulting in gigabytes of host memory is the one cost the first
        save has over later ones; call this at start-up (it runs on a background thread
        by default) so that the first save only copies. Like a save, it takes the
        directory's lock (rank 0): another process saving there is told at start-up.
        Not collective: in a group, the arena is sized for this rank's estimated share
        of replicated data (its replicas split the writing; a plain tensor counts as
        held by every rank), and a first save that needs more allocates again (as when
        plain tensors are held by only some ranks, e.g. pipeline stages).
        """
        check_flags(background=background)
        self._refuse_forked("prepare")
        with self._one_call("prepare"):
            return self._prepare(state, background=background, shards=shards)

    def _prepare(self, state: Any, *, background: bool,
                 shards: Mapping[str, ShardMetadata] | None) -> cf.Future[Any]:
        self._check_open()
        self._refuse_before_group("prepare")
        if self._ctx.is_coordinator:
            # (a second trainer on this directory learns it here, at start-up, rather than
            # at its first save, an hour of training later)
            self._take_lock()
        flat = flatten(state)  # on this thread: state_dict() calls stay here
        apply_shards(flat, shards)
        # (a perf trial's prepare() at start-up, its AdamW not stepped yet, sized a 96 MiB
        # buffer; the first save after the step made one of 308 MiB, 0.5 s blocked)
        stateless = [p or "<root>" for p, (obj, _) in flat.statefuls.items()
                     if isinstance(obj, torch.optim.Optimizer) and _will_make_state(obj)]
        if stateless:
            log.warning("prepare(): the optimizer at %s has no state yet (it makes it at its "
                        "first step): the host buffer is sized without it, and the first "
                        "save after that step allocates again; call prepare() after the "
                        "first optimizer.step()", ", ".join(map(repr, stateless[:3])))
        self._prepared_stateless = bool(stateless)
        pending = self._pending
        if pending is not None and not pending.done() and self.config.on_busy == "error":
            raise CheckpointInFlightError(
                f"step {pending.step} is still being saved to {self.directory}; wait() for it "
                "before prepare(), or use on_busy='wait'")
        if self._ctx.distributed:
            plan = None
            need = _share_estimate(flat, self._ctx.world_size)
        else:
            plan = self._plan_for(flat.tensors)
            need = plan.padded_bytes
        writer = self._ensure_writer()

        def allocate() -> None:
            # The save in flight still writes (and then offers) the arena: a new layout's
            # header must not land in it before that save is durable.
            if pending is not None:  # (not pending.wait(): its error stays uncollected)
                cf.wait([pending._durable])
            if self._arena_changes(need, plan):  # else peers may go on reading the arena
                self._stop_serving()
            if plan is None:
                self._arena_of(need)
            else:
                self._arena_for(plan)

        if background:  # (after an earlier prepare(): the stager runs one task at a time)
            self._preparing = writer.stager.submit(allocate)
        else:
            if self._preparing is not None:  # an earlier prepare() may be allocating now
                cf.wait([self._preparing])
            done: cf.Future[Any] = cf.Future()
            try:
                allocate()
            except BaseException as exc:
                done.set_exception(exc)  # (a pending one would hold the next save for ever)
                self._preparing = done
                raise
            done.set_result(None)
            self._preparing = done
        return self._preparing

    def serve(self, transport: Any) -> None:
        """Serve every later save to peers through ``transport`` (e.g. an HTTPTransport).

        Each save's staged arena — the shard file's bytes — is offered once the file is
        written and its bytes checksummed (before the commit), with no copy, until the
        next save starts staging. In a group, the tensors this rank holds but another
        writes (replicated ones) are copied as the save begins and offered beside it.

        Raises:
            CheckpointConfigError: ``transport`` cannot serve a staged arena (only
                HTTPTransport can; a PGTransport sends on request, with send_checkpoint).
        """
        self._refuse_forked("serve")
        self._check_open()
        if not callable(getattr(transport, "serve", None)):
            raise CheckpointConfigError(
                f"{type(transport).__name__} cannot serve saves (it has no serve()): use an "
                "HTTPTransport, or call the transport's send_checkpoint() when a peer asks")
        if getattr(transport, "closed", False) is True:
            raise CheckpointClosedError(
                f"serve(): this {type(transport).__name__} was shut down; make a new one")
        if not any(t is transport for t in self._transports):  # (twice: served once)
            self._transports.append(transport)

    def save(self, state: Any, step: StepLike, *,
             metadata: Mapping[str, MetadataValue] | None = None,
             shards: Mapping[str, ShardMetadata] | None = None,
             metrics: Mapping[str, Any] | None = None) -> CheckpointInfo:
        """Save synchronously: return once the checkpoint is committed and the old steps
        ``keep_last`` lets go are removed, as in mode="sync" (arguments as for
        ``save_async``)."""
        _CALLING_SAVE.on = True
        try:
            fut = self.save_async(state, step, metadata=metadata, shards=shards,
                                  metrics=metrics)
        finally:
            _CALLING_SAVE.on = False
        info = fut.wait()
        self._retention_done()  # (this save's: none since)
        return info

    def _retention_done(self) -> None:
        """Wait for the last save's keep_last removals (a save that returns only once
        they are done: save(), and every save in mode="sync")."""
        retention, self._retention = self._retention, None
        if retention is not None:
            retention.result()

    def wait(self, timeout: float | None = None) -> CheckpointInfo | None:
        """Wait for the save in flight (if any) and its retention (and the removal of what
        a killed run left, which the first save starts); re-raise its error, or that of
        an earlier save whose future nobody waited on."""
        self._refuse_forked("wait")
        timeout = wait_seconds(timeout, "wait")
        fut = self._pending
        info = None
        # (one deadline for the save, its retention and the clean-up: a review's wait(t)
        # could take 3 t)
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(deadline - time.monotonic(), 0.0)

        try:
            if fut is not None:
                seen = fut.observed  # its failure was handed over already (fut.wait, save)
                try:
                    info = fut.wait(timeout)
                except CheckpointError as exc:
                    if isinstance(exc, CheckpointTimeoutError) and not fut.done():
                        raise
                    if self._pending is fut:
                        self._pending = None
                        self._last_said = (fut.step, "failed")
                    if not seen:
                        self._note_missed(exc)  # two failures: report both at once
                        raise
            # the save's retention, then the removal of what a killed run left (_cleanup)
            for attr, what, why in (
                    ("_retention", "old steps", f" ({self._retention_said()})"),
                    ("_cleaning", "the directories a killed run left", "")):
                removals = getattr(self, attr)
                if removals is None:
                    continue
                try:
                    removals.result(left())
                except cf.TimeoutError:
                    raise CheckpointTimeoutError(
                        f"{what} under {self.directory} are still being removed after "
                        f"{timeout}s{why}") from None
                setattr(self, attr, None)
            # Forgotten only now: a wait(timeout) out of time during the removals kept it
            # for the next wait() to return (a trial's poll loop got None, the step lost)
            if fut is not None and info is not None and self._pending is fut:
                self._pending = None
                self._last_said = (fut.step, "committed")
            error = self._take_missed()
            if error is not None:
                if info is not None:  # (not returned now, nor by a next wait(): said here)
                    add_note(error, f"the last save, step {info.step}, was committed")
                raise error
            return info
        finally:
            # A raised error keeps this frame (in its traceback) and so its locals; the
            # error is also kept by the future this checkpointer holds: without these,
            # the checkpointer would be in a cycle, and `del ckpt` would not release it.
            del self, fut

    def _take_missed(self) -> CheckpointSaveError | None:
        """The failure of an earlier save nobody has seen yet, once (then forgotten)."""
        missed, self._missed = self._missed, None
        if missed is None:
            return None
        seen, error = missed
        if seen[0]:  # its own caller has seen it since (and may have dropped the future)
            return None
        seen[0] = True
        return error

    def _note_missed(self, exc: BaseException) -> None:
        """Add the unseen failure of an earlier save to ``exc``, which is being raised."""
        error = self._take_missed()
        if error is not None:
            add_note_of(exc, error)  # (its notes: the failures after it)

    @property
    def is_pending(self) -> bool:
        """True while a save is staging or writing. In a process forked meanwhile,
        raises CheckpointClosedError, as wait() does (no thread there ends that save)."""
        pending = self._pending
        if pending is None or pending._durable.done():
            return False
        self._refuse_forked("is_pending")  # (in a forked child: raises)
        return True

    def __reduce__(self) -> Any:
        # (a concurrency trial's Dataset holding one, under a spawn DataLoader, was told
        # "cannot pickle '_thread.lock' object"; Python 3.14 spawns by default)
        raise NotPicklableError(
            f"an AsyncCheckpointer cannot be pickled (sent to another process: a spawn or "
            f"forkserver DataLoader worker, a multiprocessing pool): it owns threads, host "
            f"memory and the lock of {self.directory}; pass the directory instead, and "
            "open an AsyncCheckpointer (or call asyncckpt.load) in that process")

    # --- discovering and loading ---------------------------------------------------------

    def __repr__(self) -> str:
        # (what a notebook shows of ``ckpt``: no disk is read for it; a half-made one,
        # whose __init__ raised, is shown too: a debugger's view of locals asks for it)
        ctx = getattr(self, "_ctx", None)
        group = (f" rank {ctx.rank}/{ctx.world_size}"
                 if ctx is not None and ctx.distributed else "")
        pending = getattr(self, "_pending", None)
        last = getattr(self, "_last_said", None)
        if getattr(self, "_closed", True):
            state = "closed" if hasattr(self, "_closed") else "not made"
        elif pending is not None and not pending._durable.done():
            state = f"saving step {pending.step}"
        elif pending is not None:
            state = f"last save step {pending.step} {pending._progress_now().phase}"
        else:
            state = "no save yet" if last is None else f"last save step {last[0]} {last[1]}"
        config = getattr(self, "config", None)
        mode = f" mode={config.mode!r}" if config is not None else ""
        return (f"<AsyncCheckpointer {str(getattr(self, 'directory', '?'))!r}{mode}{group}: "
                f"{state}>")

    def steps(self) -> list[int]:
        """Committed steps, oldest first."""
        steps = commit.committed_steps(self.directory, self.storage)
        if not steps and not self._told_foreign and self._ctx.is_coordinator:
            self._told_foreign = True
            # (a trial pointed its checkpointer at the run's old directory: latest_step()
            # said None without a word, and the resume started from step 0)
            try:
                names = self.storage.listdir(self.directory)
            except OSError:
                names = []
            # (a checkpoint's files: DCP's .metadata beside its .distcp shards, a .pt, .pth
            # or .ckpt; not any .bin or .tar, a tokenizer's or a run's arguments)
            told = [n for n in names if n == ".metadata" or n.endswith(
                (".distcp", ".pt", ".pth", ".ckpt", ".safetensors"))]
            dcp_alone = ".metadata" in told and not any(n.endswith(".distcp") for n in told)
            foreign = commit.foreign_hint(self.directory, [
                n for n in told if not (dcp_alone and n == ".metadata")]) if told else ""
            foreign = foreign or commit.nested_hint(self.directory, names, self.storage)
            if foreign:
                log.warning("no committed asyncckpt step under %s%s; until then, a resume "
                            "that asks latest_step() starts afresh", self.directory, foreign)
        return steps

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def best_step(self, metric: str | None = None, mode: str | None = None) -> int | None:
        """The committed step whose ``metric`` (recorded by ``save_async(metrics=...)``) is
        best: the least with ``mode="min"``, the greatest with ``"max"`` (defaults: the
        checkpointer's ``best_metric`` and ``best_mode``; without a mode, the way the
        newest step that recorded one ranks ``metric``, else "min": a checkpointer saving
        with ``best_metric`` records a ``best_mode`` given). NaN ranks last; of equal values
        the newer step wins. None when no committed step recorded it (check before
        passing it on: ``load(step=None)`` loads the latest step).

        Example:
            >>> ckpt.load(model_state, step=ckpt.best_step("val_loss"))
        """
        if metric is None and self.config.best_metric is None:
            raise CheckpointConfigError(
                "best_step() needs a metric: best_step('val_loss'), or best_metric= on the "
                "checkpointer")
        if metric is not None and (not isinstance(metric, str) or not metric):
            raise CheckpointConfigError(f"best_step(metric={metric!r:.80}): name a metric that "
                                        "saves record, e.g. best_step('val_loss')")
        if mode is not None and mode not in BEST_MODES:
            raise CheckpointConfigError(f"best_step(mode={mode!r:.40}): use 'min' (a loss) or "
                                        "'max' (an accuracy)")
        name = metric if metric is not None else self.config.best_metric or ""
        steps = self.steps()
        if mode is None and self._metric_mode is not None and name == self._metric_mode.metric:
            mode = self._metric_mode.get(self.directory, self.storage, steps)
        elif mode is None and self._metric_mode is None and self.config.best_mode:
            mode = self.config.best_mode  # (best_mode without best_metric: a trial's was
            # ignored, and best_step("val_acc") named the worst step)
        elif mode is None:  # (another metric than best_metric: as its steps recorded it;
            # steps that recorded both ways warned of, once: the CLI's --best too)
            other = self._other_modes.get(name)
            if other is None:
                other = self._other_modes[name] = MetricMode(name, None, self._metrics)
            mode = other.get(self.directory, self.storage, steps)
        ranking = Ranking(name, mode)
        scores = self._metrics.scores(self.directory, self.storage, steps, ranking.metric)
        # best first, passing over the steps known damaged (a trial's deploy script took
        # a step whose damaged.json said so: a load found it corrupt) or whose files are
        # missing or cut short (ls says DAMAGED: a stat each)
        while best := ranking.best(scores, 1):
            if best[0] not in self._damaged and not self._amiss(best[0]):
                return best[0]
            del scores[best[0]]
        return None

    def recorded_best_mode(self, metric: str) -> str | None:
        """Which way ``metric`` ranks ("min" or "max") as the newest committed step that
        recorded one says (a save records its checkpointer's ``best_metric`` and
        ``best_mode``, where one was given or inherited); None where none did. What
        ``best_step(metric)`` ranks by when given no mode.

        Example:
            >>> AsyncCheckpointer("runs/exp1").recorded_best_mode("val_acc")
            'max'
        """
        if not isinstance(metric, str) or not metric:
            raise CheckpointConfigError(f"recorded_best_mode(metric={metric!r:.80}): name a "
                                        "metric that saves record, e.g. 'val_loss'")
        got = self._metrics.recorded_mode(self.directory, self.storage, self.steps(), metric)
        return None if got is None else got[0]

    def _amiss(self, step: int) -> bool:
        """Whether something is known amiss with committed ``step`` without reading its
        tensors: its damaged.json, or (on the local filesystem) files missing or not of
        their sizes, or a manifest that cannot be read (as retention sees it)."""
        return bool(commit.damaged_marks(self.directory, [step], self.storage)) or (
            self._metrics.amiss(self.directory, self.storage, step))

    def discard_steps_after(self, step: StepLike) -> list[int]:
        """Delete every committed step newer than ``step`` (and the step directories
        without a manifest there, which no load reads: a copy cut short), for a rollback: after
        ``load(state, step=step)`` (a loss spike, a bad data shard), training goes on from
        ``step``, and its saves would otherwise be refused as older than the steps kept.
        Returns the steps deleted, oldest first.

        Waits for the save in flight (its failure is left for ``wait()``), then takes the
        newest step out of sight first: a crash part-way leaves the older ones committed,
        and calling again finishes. In a group it is collective, as saves are: every rank
        calls it with the same ``step`` (else every rank raises CheckpointConfigError and
        nothing is deleted); the coordinator (rank 0) deletes, and every rank returns
        once the steps are out of sight.

        Raises:
            CheckpointInFlightError: a save is in flight and ``on_busy="error"``, or a
                load (of this checkpointer, or of another rank) is reading one of those
                steps (what was deleted before it is said).
            CheckpointSaveError: the filesystem refused (likewise).
            CheckpointClosedError: the checkpointer is closed.
        """
        self._refuse_forked("discard_steps_after")
        step = commit.as_step(step)
        with self._one_call("discard_steps_after"):
            self._check_open()
            self._refuse_before_group("discard_steps_after")
            self._wait_for_previous()
            if self._retention is not None:  # its removals end before these begin
                cf.wait([self._retention])
                self._retention = None
            ctx = self._ctx
            hidden: list[tuple[int, Path]] = []
            if not ctx.distributed:
                self._hide_steps_after(step, hidden)
            else:
                ctx.join()
                self._discards += 1  # counted on every rank alike: the call is collective
                tag = f"d{self._discards}"
                key = ctx.key(tag, "discarded")
                if ctx.is_coordinator:
                    try:
                        self._agree_on_discard(tag, step)
                        self._hide_steps_after(step, hidden)
                    except BaseException as exc:  # the others must not wait out a timeout
                        why = str(exc) if isinstance(exc, CheckpointError) else (
                            f"rank 0: {type(exc).__name__}: {exc}")
                        with contextlib.suppress(Exception):
                            ctx.put(key, {"error": why, "kind": type(exc).__name__})
                        raise
                    ctx.put(key, {"ok": [s for s, _ in hidden]})
                else:
                    ctx.put(ctx.key(tag, "asked", ctx.rank), {"step": step})
                    got = ctx.get(key, f"rank 0's deletion of the steps after {step}",
                                  2 * ctx.timeout_s,
                                  absent="not called discard_steps_after (every rank must)")
                    with contextlib.suppress(Exception):  # the last reader tidies up
                        if ctx.store.add(key + "/seen", 1) >= ctx.world_size - 1:
                            ctx.store.delete_key(key)
                            ctx.store.delete_key(key + "/seen")
                    if "error" in got:
                        if got.get("kind") == "CheckpointConfigError":
                            raise CheckpointConfigError(got["error"])
                        raise CheckpointSaveError(f"rank {ctx.rank}: {got['error']}")
                    self._damaged = {s for s in self._damaged if s <= step}
                    return sorted(got["ok"])
            self._remove_hidden(hidden)
            self._damaged = {s for s in self._damaged if s <= step}  # (gone: saved anew)
            if self._metric_mode is not None and hidden:  # (it may be inherited anew)
                self._metric_mode.forget()
            removed = sorted(s for s, _ in hidden)
            if removed:
                log.info("deleted step(s) %s under %s: training goes on from step %d",
                         removed, self.directory, step)
            return removed

    def _hide_steps_after(self, step: int, hidden: list[tuple[int, Path]]) -> None:
        """Take the committed steps after ``step`` out of sight, newest first, noting
        each in ``hidden`` with where it now lies; those are removed even if a later one
        fails here (they are out of sight: nothing else would, until a new checkpointer).
        """
        if not self.directory.is_dir():
            return  # (nothing saved there: a rollback does not create the directory)
        try:
            self._hide_each_after(step, hidden)
        except BaseException:
            self._remove_hidden(hidden)
            raise

    def _remove_hidden(self, hidden: list[tuple[int, Path]]) -> None:
        for _, gone in hidden:  # out of sight already: what fails here, clean-up retries
            try:
                self.storage.remove_tree(gone)
            except OSError as exc:
                log.warning("could not remove %s (the step is deleted from sight; the "
                            "next checkpointer's clean-up tries again): %s", gone, exc)

    def _hide_each_after(self, step: int, hidden: list[tuple[int, Path]]) -> None:
        self._take_lock()

        def so_far() -> str:
            return f" (deleted: {sorted(s for s, _ in hidden)})" if hidden else ""

        with self._in_use.locked() as got:
            if not got:
                raise CheckpointInFlightError(
                    f"cannot delete the steps after {step} under {self.directory}: a load "
                    "of this checkpointer did not let go of its steps within "
                    f"{commit.RETENTION_LOCK_S:.0f}s (called from a signal handler during a "
                    "load?); call again once it is done")
            bare: list[str] = []  # (step directories without a manifest: in the way too)
            every = commit.committed_steps(self.directory, self.storage, None, bare,
                                           skip_denied=True)
            later = [s for s in every if s > step]
            held = sorted(set(later) - set(self._in_use.spare(later)))
            if held:
                raise CheckpointInFlightError(
                    f"cannot delete step(s) {held} under {self.directory}: a load of this "
                    "checkpointer is reading them; call again once it is done")
            if later and step not in every:  # (once nothing is in the way)
                # (a perf trial's discard_steps_after(0), step 0 long gone by keep_last,
                # deleted its only step, said at INFO alone)
                kept = [s for s in every if s < step]
                log.warning("discard_steps_after(%d): step %d is not committed under %s; "
                            "deleting every step after it, %s, %s", step, step,
                            self.directory, later,
                            f"keeping {kept}" if kept else "which leaves no step at all")
            for s in reversed(later):
                if not self._ctx.may_retire(s):
                    raise CheckpointInFlightError(
                        f"cannot delete step {s} under {self.directory}: a load on another "
                        f"rank is reading it; call again once it is done{so_far()}")
                try:
                    hidden.append((s, commit.hide_step(self.directory, s, self.storage)))
                except OSError as exc:
                    raise CheckpointSaveError(
                        f"deleting the steps after {step} under {self.directory} failed at "
                        f"step {s}: {exc.strerror or exc}" + os_error_hint(exc) + so_far()
                    ) from exc
                finally:
                    self._ctx.retired(s)
            # (a copy cut short left step_400 without its manifest: the resume recipe's
            # discard_steps_after(300) kept it, and the save of step 400 was refused)
            for name in bare:
                number = commit.step_of_dir_name(name)
                if number is not None and number > step:
                    try:
                        hidden.append((number, commit.hide_step(self.directory, number,
                                                                self.storage)))
                    except OSError as exc:
                        raise CheckpointSaveError(
                            f"deleting {self.directory / name} (no manifest: no committed "
                            f"step) failed: {exc.strerror or exc}" + so_far()) from exc

    def manifest(self, step: StepLike | None = None) -> Manifest:
        """The manifest of ``step`` (latest when None)."""
        step_dir, _ = commit.resolve_step_dir(self.directory, commit.check_step(step),
                                              self.storage)
        return read_manifest(step_dir, self.storage)

    def step_metrics(self, step: StepLike | None = None) -> dict[str, float]:
        """Every metric committed ``step`` (latest when None) has: those its save recorded
        (``save_async(metrics=...)``) and those recorded after it (``record_metrics``),
        as keep_best, ``best_step()`` and ``asyncckpt ls`` count them."""
        step_dir, _ = commit.resolve_step_dir(self.directory, commit.check_step(step),
                                              self.storage)
        saved = read_manifest_summary(step_dir, self.storage).metrics
        return {**read_later_metrics(step_dir, self.storage), **saved}

    def record_metrics(self, step: StepLike, metrics: Mapping[str, Any], *,
                       created_unix: float | None = None) -> dict[str, float]:
        """Record metrics of a committed step after its save: an evaluation that ends after
        the step was saved (in this process, or an evaluator's beside the trainer).
        keep_best, ``best_step()``, ``step_metrics()`` and ``asyncckpt ls`` count them as
        the save's own. Returns every metric the step now has.

        They go into the step's ``metrics.json`` (written beside it, then renamed over the
        one before: a crash leaves the old or the new), with those recorded after the save
        before; a name recorded again replaces its value (an evaluation run again). A
        name the save itself recorded keeps its value: another one is refused. Waits for
        this checkpointer's save of ``step`` when it is in flight. On the local filesystem,
        records (from any process) and keep_best's retentions take turns (the root's
        ``.asyncckpt.ranking`` lock): a record counts for the ranking or finds its step
        gone, and two records of one step keep both; elsewhere, one process records a
        step's metrics at a time (two at once may lose one's). A step that retention
        removes meanwhile is not found: with ``keep_best``, record before the step leaves
        ``keep_last`` (the next saves' retentions rank it from then on).

        ``created_unix``: the ``manifest(step).created_unix`` of the save the metrics were
        measured on (read before loading it): a step of that number saved again since (a
        rollback, then the same step anew) is refused rather than given metrics of a
        state it does not hold.

        Raises:
            CheckpointNotFoundError: ``step`` is not committed (or was removed meanwhile,
                or saved again since ``created_unix``).
            CheckpointConfigError: a metric that is no name and number, or one the save
                recorded with another value.
            CheckpointPermissionError: this user may not write in the step's directory.
            CheckpointTimeoutError: the ranking lock stayed held for 30 s (a stuck
                retention or record elsewhere).
            CheckpointSaveError: the file could not be written (nothing changed).

        Example:
            >>> ckpt.record_metrics(1000, {"val_loss": evaluate(model)})
        """
        self._refuse_forked("record_metrics")
        self._check_open()
        step = commit.as_step(step)
        recorded = checked_metrics(metrics)
        if not recorded:
            raise CheckpointConfigError(f"record_metrics({step}, {metrics!r:.40}): pass the "
                                        "metrics to record, e.g. {'val_loss': 2.31}")
        if created_unix is not None and (isinstance(created_unix, bool) or not isinstance(
                created_unix, (int, float))):
            raise CheckpointConfigError(
                f"record_metrics(created_unix={created_unix!r:.40}): pass the number "
                f"manifest({step}).created_unix gave, or None")
        pending = self._pending
        if pending is not None and pending.step == step:  # (its outcome stays for wait())
            cf.wait([pending._durable])
        step_dir, _ = commit.resolve_step_dir(self.directory, step, self.storage)
        elsewhere = commit.led_elsewhere(self.directory, step, self.storage)
        if elsewhere is not None:
            raise CheckpointConfigError(f"step {step}: {elsewhere}")
        removed = CheckpointNotFoundError(
            f"step {step} was removed from {self.directory} (retention: keep_last, or a "
            "rollback) before its metrics were recorded; nothing was recorded: record a "
            "step's metrics while it is among those kept")
        try:
            saved = read_manifest_summary(step_dir, self.storage).metrics
        except CheckpointError:
            if not commit.still_there(self.directory, step_dir.name, self.storage):
                raise removed from None  # (not "has no manifest.json": a trial)
            raise
        clash = [k for k, v in recorded.items() if k in saved and not (
            v == saved[k] or (math.isnan(v) and math.isnan(saved[k])))]
        if clash:
            raise CheckpointConfigError(
                f"step {step}: "
                + ", ".join(f"{k}={recorded[k]:g} (its save recorded {saved[k]:g})"
                            for k in clash)
                + ": the metrics a save recorded are not rewritten; record the new value "
                f"under another name (e.g. {clash[0] + '_2'!r}); nothing was recorded")
        # (a retention here or in another process ranks and hides steps under the same
        # lock: the record counts for its ranking, or finds its step gone; and two
        # evaluators' records of one step do not lose one's: a trial)
        with self._record_lock, commit.ranking_lock(
                self.directory, self.storage,
                f"record_metrics({step}) recorded nothing") as held:
            if not commit.still_there(self.directory, step_dir.name, self.storage):
                raise removed
            if created_unix is not None:  # (under the lock: a retention's rollback waits)
                now = read_manifest_summary(step_dir, self.storage).created_unix
                if now != created_unix:  # (a trial's evaluator scored the old step 30)
                    raise CheckpointNotFoundError(
                        f"step {step} under {self.directory} was saved again since the save "
                        f"of created_unix={created_unix!r} whose metrics these are (it is "
                        f"now of created_unix={now!r}: a rollback, then this step anew); "
                        "nothing was recorded: evaluate the step as it is now")
            if held:  # (no other record is under way: what a killed one left goes)
                sweep_later_tmp(step_dir, self.storage)
            try:
                later = read_later_metrics(step_dir, self.storage)
            except CheckpointCorruptError as exc:  # (counted as none: replaced)
                log.warning("step %d: %s: replaced by the metrics recorded now", step, exc)
                later = {}
            later.update((k, v) for k, v in recorded.items() if k not in saved)
            self._warn_if_first_for_ever(step, recorded)
            try:
                write_later_metrics(step_dir, step, self.storage, later)
            except OSError as exc:
                if not commit.still_there(self.directory, step_dir.name, self.storage):
                    raise removed from exc
                if isinstance(exc, PermissionError):
                    raise CheckpointPermissionError(
                        f"step {step}: its metrics cannot be recorded: this user may not "
                        f"write in {step_dir} ({exc.strerror or exc}); record them as the "
                        "user that saves there, or make its step directories writable; "
                        "nothing was recorded", path=str(step_dir)) from exc
                if isinstance(exc, NotDurableYet):  # (after the rename: a review)
                    raise CheckpointSaveError(
                        f"step {step}: its metrics were recorded in {step_dir}, but the "
                        f"directory's fsync failed ({exc}): they may not survive a crash; "
                        "recording them again is safe") from exc
                raise CheckpointSaveError(
                    f"step {step}: its metrics could not be recorded in {step_dir} "
                    f"({type(exc).__name__}: {exc}); nothing changed") from exc
            finally:
                self._metrics.forget_later(step)
        return {**later, **saved}

    def _warn_if_first_for_ever(self, step: int, metrics: Mapping[str, float]) -> None:
        """Warn (once per checkpointer) of a ``best_metric`` value that would rank first
        for ever: +inf by the greatest, -inf by the least (a trial's broken evaluation
        gave inf accuracy, the step then best for good, unwarned)."""
        mm = self._metric_mode
        value = None if mm is None else metrics.get(mm.metric)
        if mm is None or value is None or not math.isinf(value) or self._told_infinite:
            return
        mode = mm.saving()
        if (value > 0) == (mode == "max"):
            self._told_infinite = True
            log.warning("step %d: %s=%r ranks first for ever by the %s value (best_mode=%r): "
                        "a broken evaluation? keep_best keeps that step, and best_step() "
                        "names it, until the value is recorded anew (record_metrics, for "
                        "one recorded after the save) or the step's directory is deleted "
                        "(a save's own values are not rewritten)", step, mm.metric, value,
                        MODE_WORDS[mode], mode)

    def load(self, state: Any = None, *, step: StepLike | None = None, strict: bool = True,
             verify: bool = True, shards: Mapping[str, ShardMetadata] | None = None,
             fallback: bool = False, threads: int | None = None,
             progress: Callable[[int, int], None] | None = None,
             ignore_unexpected: bool = False,
             exclude: str | Iterable[str] | None = None,
             key_map: KeyMap | None = None, cast: bool = False) -> Any:
        """Load a committed checkpoint (latest when ``step`` is None).

        With ``state``, tensors are read into the existing tensors in place (identity
        kept; a DTensor or a hand-sharded tensor gets just its box, whatever world size
        saved it), stateful objects get ``load_state_dict``, and the tree is returned.
        Without it, a plain tree of fresh, whole CPU tensors is returned. A save still in
        flight is not committed, so not seen: ``fut.wait()`` (or ``wait()``) first.

        Raises:
            CheckpointNotFoundError: nothing committed (or no such step).
            CheckpointCorruptError: a checksum or the format does not match; names file
                and tensor. Targets loaded in place may then hold partial data.
            StateMismatchError: keys missing or unexpected (unless ``strict=False``), or
                shapes/dtypes that differ.

        ``ignore_unexpected=True`` loads what the target holds and skips the rest of the
        checkpoint (the model alone, from a training checkpoint), while everything the
        target holds must still be found (``strict=False`` skips both sides).
        ``exclude=["dataloader", "lr_scheduler"]`` leaves those parts alone on both sides
        (not read, not checked, not restored; the state's own stay as they are), and keeps
        every check elsewhere: paths as ``asyncckpt inspect`` lists them, through dicts and
        modules (``"model/head"`` leaves out a module's ``head.weight`` and ``head.bias``).
        ``key_map`` renames the checkpoint's tensors before anything is matched (a layer
        renamed since, a wrapper's ``module.``): a mapping of those paths, or a function
        of one returning its new path, or None to leave that tensor out. ``cast=True``
        loads into target tensors of another floating (integer, complex) dtype, casting.

        With ``fallback=True`` (and no ``step``), a corrupt latest step is reported in the
        log and the next older committed step is tried, down to the oldest. ``threads``
        sets the reader threads (default: up to 2). ``progress(done, total)`` is called
        from the reader threads as tensors are read, in bytes of the saved chunks read
        from (for each step a fallback tries).
        """
        check_flags(strict=strict, verify=verify, fallback=fallback,
                    ignore_unexpected=ignore_unexpected, cast=cast)
        self._refuse_forked("load")
        check_threads(threads)
        step = commit.check_step(step)
        check_fallback(fallback, step, verify)
        parts = check_exclude(exclude)
        check_key_map(key_map)
        check_progress(progress)
        view, shards, finish = excluded_view(state, parts, shards)
        pending = self._pending
        told = self._told_in_flight
        if step is None and pending is not None and not pending.done() and not (
                self._closed or (told is not None and told() is pending)):
            # (documented, but a notebook trial took the step before for the one it saved;
            # once per save: an eval loop's 1,662 loads beside 5 saves logged 1,662)
            self._told_in_flight = weakref.ref(pending)
            log.warning("rank=%d: loading the latest committed step of %s while this "
                        "checkpointer's save of step %d is in flight: that save is not "
                        "committed yet, so an older step loads (ckpt.wait() first to load "
                        "it)", self._ctx.rank, self.directory, pending.step)
        # The latest step may go while it is read when another process saves here (this
        # checkpointer a reader beside it: an evaluator), by its retention or a rollback:
        # then the latest is the newer one. (A group's ranks must agree: not retried.)
        tries = LATEST_TRIES if step is None and not fallback and not self._ctx.distributed else 1
        for attempt in range(tries):
            try:
                return finish(self._load(view, step=step, strict=strict, verify=verify,
                                         shards=shards, fallback=fallback, threads=threads,
                                         progress=progress,
                                         ignore_unexpected=ignore_unexpected, exclude=parts,
                                         key_map=key_map, cast=cast))
            except CheckpointNotFoundError as exc:
                if attempt + 1 == tries:
                    err = outpaced(exc, tries)
                    if err is None:
                        raise
                    raise err from err.__cause__
                log.info("loading the latest step under %s again: %s", self.directory, exc)
            except CheckpointCorruptError as exc:
                if self._ctx.distributed and not fallback:
                    # (a DCP trial loaded an earlier step on the rank that raised: the
                    # other had loaded the newer one, and no error said so; in the
                    # message, not a note: a log line of str(exc) lost it)
                    err = with_advice(exc, f"rank {self._ctx.rank}: a plain load is this "
                                      "rank's alone (the others may have loaded this step): "
                                      "load another step on every rank, or load(..., "
                                      "fallback=True) on every rank, which brings them all "
                                      "to the newest step intact on every rank")
                    raise err from err.__cause__
                if step is None and not fallback:  # (a trial: "load an earlier step", how?)
                    err = with_advice(exc, "load(..., fallback=True) loads the newest intact "
                                      "step instead")
                    raise err from err.__cause__
                raise
        raise AssertionError("unreachable")

    def _load(self, state: Any, *, step: int | None, strict: bool, verify: bool,
              shards: Mapping[str, ShardMetadata] | None, fallback: bool,
              threads: int | None, progress: Callable[[int, int], None] | None,
              ignore_unexpected: bool, exclude: tuple[str, ...],
              key_map: KeyMap | None = None, cast: bool = False) -> Any:
        # The retention of a save in flight (keep_last) must not delete what this reads.
        held: int | None = None
        with self._in_use.lock:
            if not (fallback and step is None):  # (a fallback may read any older step)
                step_dir, held = commit.resolve_step_dir(self.directory, step, self.storage)
            self._in_use.hold(held)
        shared = False
        try:
            # ... nor that of the coordinator of the group, should this rank not be it
            shared = self._ctx.hold_step(held)
            if fallback and step is None:
                # in a group, every rank's verdict counts: all end on the same step
                agree = self._ctx.fallback_agreement() if self._ctx.distributed else None
                damaged: list[tuple[int, str]] = []
                try:
                    return load_newest_intact(
                        self.directory, state, self.storage, strict=strict,
                        ignore_unexpected=ignore_unexpected, shards=shards, threads=threads,
                        agree=agree, progress=progress, exclude=exclude, key_map=key_map,
                        cast=cast, damaged=damaged)
                finally:
                    self._note_damaged(damaged)
            if shared and held is not None:  # counted: is it still there?
                commit.resolve_step_dir(self.directory, held, self.storage)
            commit.warn_if_marked(step_dir, self.storage, verify)
            try:
                return load_from(step_dir, state, self.storage, strict=strict,
                                 ignore_unexpected=ignore_unexpected, verify=verify,
                                 shards=shards, threads=threads, step=step, progress=progress,
                                 exclude=exclude, key_map=key_map, cast=cast)
            except CheckpointCorruptError as exc:
                # marked as a fallback marks (a trial: a corrupt best step, loaded by
                # step=, stayed best_step(), and keep_best kept it over intact ones);
                # not in a group, where the ranks must agree (the others may have read
                # their parts intact: fallback=True is the collective verdict), nor for
                # what may be no damage (a tensor larger than this machine's memory)
                if held is not None and not self._ctx.distributed and not exc.maybe_intact:
                    self._note_damaged([(held, str(exc))], remedy=PLAIN_LOAD_REMEDY)
                raise
        finally:
            if shared:
                self._ctx.release_step(held)
            self._in_use.release(held)

    def _note_damaged(self, found: list[tuple[int, str]], *,
                      remedy: str = FALLBACK_REMEDY) -> None:
        """Steps a fallback load found damaged (with what was found): retention counts
        them no more among the steps it keeps (a damaged step kept while the intact one
        before it went: a trial's keep_last=2 left [20 (corrupt), 30]). The coordinator
        marks each on disk (damaged.json), so a later process's retention and ``ls`` know
        it too (a fallback that loads a newer intact step never reads the damaged one)."""
        new = sorted({s: why for s, why in found if s not in self._damaged}.items())
        if not new:
            return
        self._damaged.update(s for s, _ in new)
        note_damaged(self.directory, self.storage, new, self._lock, self._ctx.rank,
                     marks=self._ctx.is_coordinator, unmarked_means="only this checkpointer knows",
                     remedy=remedy)

    # --- lifecycle -----------------------------------------------------------------------

    def close(self, timeout: float | None = None) -> None:
        """Wait for the save in flight, then release threads, memory and the lock.

        Raises the failure of a save whose future nobody waited on (the last one, or an
        earlier one ``wait()`` has not reported yet): closing is the caller's last chance
        to learn that a step was not saved. With ``timeout``, a save (or its retention)
        still running after that many seconds raises CheckpointTimeoutError and leaves
        the checkpointer open: close() again waits on (a storage that hangs, such as a
        dead network mount, would otherwise hold close() for ever). Its thread, stuck,
        keeps the process from exiting normally: ``os._exit()`` ends it without that step.
        """
        if self._forked():
            self._closed = True  # (the parent's to close: its threads, its lock)
            return
        if self._closed:
            self._close_again(timeout)
            return
        if timeout is not None:
            self._wait_to_close(timeout)
        with self._one_call("close"):
            self._close(raise_missed=True)

    def _close_again(self, timeout: float | None) -> None:
        """close() of a closed checkpointer: nothing, but after a close() interrupted
        twice, which left its save in flight: a close() again waits for it, as close()
        says (a concurrency trial's returned at once, and the process's exit then left
        the step uncommitted), and tells its failure. Only an explicit close() waits: a
        ``with`` block left by an exception, or the collector, return at once (the second
        interrupt asked not to wait)."""
        last = self._pending
        if last is None:
            return
        with self._one_call("close"):
            if timeout is not None:
                self._wait_to_close(timeout, closed=True)
            # (forgotten only once it has ended: a Ctrl-C in this wait leaves it pending)
            failed = self._settle(last, f"closing {self.directory}: ", quiet=True)
            if self._pending is last:
                self._pending = None
            self._raise_unseen(failed, self._take_missed())

    def _retention_said(self) -> str:
        """The retention settings that apply, for a message: ``retention, keep_last=2``."""
        kept = ", ".join(f"{k}={getattr(self.config, k)}" for k in (
            "keep_last", "keep_every", "keep_best") if getattr(self.config, k) is not None)
        return (f"retention, {kept}" if kept else "no keep_* setting: steps an earlier "
                "removal left half-removed, or marked damaged")

    def _wait_to_close(self, given: float, closed: bool = False) -> None:
        timeout = wait_seconds(given, "close")
        if timeout is None:  # (infinity: as close())
            return
        deadline = time.monotonic() + timeout
        fut, retention = self._pending, self._retention
        stays = "" if closed else "the checkpointer stays open: "
        if fut is not None and not cf.wait([fut._durable], timeout).done:
            raise CheckpointTimeoutError(
                f"close(timeout={timeout}): step {fut.step} is still being saved to "
                f"{self.directory} ({fut._progress_now().phase}); {stays}"
                "close() again waits on (the steps committed before it are intact)"
                + _STUCK_EXIT)
        for removals, what in ((retention, f"old steps under {self.directory} "
                                            f"({self._retention_said()})"),
                               (self._cleaning, f"the directories a killed run left under "
                                                f"{self.directory}")):
            if removals is not None and not cf.wait(
                    [removals], max(deadline - time.monotonic(), 0.0)).done:
                raise CheckpointTimeoutError(
                    f"close(timeout={timeout}): {what} are still being removed; {stays}"
                    "close() again waits on" + _STUCK_EXIT)

    def _close(self, *, raise_missed: bool, join: bool = True) -> None:
        if self._closed:
            return
        unseen: BaseException | None = None
        last = self._pending
        interrupted = False
        try:
            if last is not None:
                # (raised below when raise_missed: logged only where nothing raises it)
                unseen = self._settle(last, f"closing {self.directory}: ",
                                      quiet=raise_missed)
                if self._ctx.distributed and self._ctx.is_coordinator and self._prev_tag:
                    # (the other ranks may still be reading its verdict from the Store,
                    # which this process may host and take down when it exits; after a
                    # failure too, of those not named silent: a trial's ranks, still
                    # writing when rank 0's write failed, were told "is the process that
                    # hosts the Store alive?" in place of rank 0's error)
                    failed = last._durable.exception()
                    silent = _silent_ranks(failed) if failed is not None else set()
                    self._ctx.wait_verdict_seen(self._prev_tag,
                                                min(self._ctx.timeout_s, _VERDICT_SEEN_S),
                                                peers=self._ctx.world_size - 1 - len(silent))
            refused = self._refused_tag
            if refused is not None and self._ctx.distributed and refused == f"n{self._seq}":
                # (the last save was refused before it started: a trial's rank 1 got "is
                # the process that hosts the Store alive?" rather than the refusal)
                self._ctx.wait_verdict_seen(
                    refused, min(self._ctx.timeout_s, _VERDICT_SEEN_S),
                    peers=self._ctx.world_size - 1 - self._refused_outside)
        except BaseException:
            interrupted = True
            raise
        finally:
            self._closed = True
            try:
                with contextlib.suppress(Exception):  # peers must not read a released arena
                    self._stop_serving(retired=(
                        f"the AsyncCheckpointer that served its saves of {self.directory} "
                        "here closed (send_checkpoint() or another checkpointer's serve() "
                        "offers again)") if self._transports else None)
                self._transports = []
                writer, self._writer = self._writer, None
                if writer is not None:
                    if interrupted and last is not None and not last._durable.done():
                        log.warning(
                            "rank=%d: closing %s was interrupted while step %d is being "
                            "written: waiting for it to end (interrupt again to stop "
                            "waiting: it goes on in the background while this process "
                            "runs, the directory locked until it ends; a process that "
                            "exits then leaves it uncommitted)", self._ctx.rank,
                            self.directory, last.step)
                    if join:  # (else threads Python may have stopped: see __del__)
                        writer.shutdown()
            finally:  # even when interrupted above (Ctrl-C): else the lock stays held,
                # and no later close() of this closed checkpointer could release it
                self._arena = self._extras = None
                self._preparing = None
                # (a save still in flight, close() interrupted twice, stays this one's:
                # is_pending and wait() see it, and wait() returns its CheckpointInfo)
                self._pending = last if last is not None and not last._durable.done() else None
                # ... but not while the save in flight (or its retention) still writes in
                # the directory (interrupted twice): a checkpointer opened on it meanwhile
                # would take its temporary directory for an abandoned one and delete it
                busy = [f for f in (last._durable if last is not None else None,
                                    self._retention, self._cleaning)
                        if f is not None and not f.done()]
                if busy:
                    self._lock.draining = (f"its save of step {last.step}" if last is not None
                                           else "its last save")
                    _release_when_done(self._lock, busy)
                else:
                    self._lock.release()
                if self._ctx.distributed:  # the Store keys of this checkpointer's saves
                    self._ctx.release([t for t in (self._prev_tag, *self._failed_tags) if t],
                                      sorted(self._posted_digests),
                                      sorted(self._shared))
        earlier = self._take_missed()
        if raise_missed:
            self._raise_unseen(unseen, earlier)

    def _raise_unseen(self, unseen: BaseException | None,
                      earlier: CheckpointSaveError | None) -> None:
        """close()'s last word: the failure of the last save, whose future nobody waited
        on (``unseen``), with that of an earlier one noted; or the earlier one alone."""
        if unseen is not None:
            error = CheckpointSaveError(
                f"closing {self.directory}: the last save, whose future nobody waited on, "
                f"failed: {unseen}")
            if earlier is not None:
                add_note_of(error, earlier)
            raise error from unseen
        if earlier is not None:
            raise earlier

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        # With an exception already on its way out, a failed save is only logged (by
        # _settle): raising here would hide the exception that ended the block.
        if self._forked():
            self._closed = True
            return
        with self._one_call("close"):
            self._close(raise_missed=exc_type is None)

    # (bound here: a collection while Python finalizes may find the module's globals gone)
    def __del__(self, _finalizing: Callable[[], bool] = sys.is_finalizing,
                _getpid: Callable[[], int] = os.getpid, _pools: Any = cf_thread,
                _current: Callable[[], threading.Thread] = threading.current_thread,
                _main: Callable[[], threading.Thread] = threading.main_thread) -> None:
        if getattr(self, "_pid", None) != _getpid():
            return  # a forked child's copy: the save in flight is the parent's to finish
        # (Python's exit has begun on the main thread once its hook shut the thread pools:
        # it then waits for their work, a save in flight among it; a later collection
        # finds that done. Another thread still running then is no exit yet: its saves
        # finish while Python joins the pools.)
        if _finalizing() or (getattr(_pools, "_shutdown", False) and _current() is _main()):
            # Collected as Python finalizes: that waited for the save in flight unless a
            # Ctrl-C cut its wait short, and then its threads end when they next run: a
            # wait for it, or a join of them, would never end (a trial's process hung).
            # Such a save is left uncommitted (the next save here removes its temporary
            # directory); a finished one is closed as ever (a failure nobody saw logged,
            # rank 0 waiting for the ranks to read its verdict), threads left alone.
            with contextlib.suppress(Exception):
                pending = self._pending
                if pending is not None and not pending.done():
                    self._left_at_exit(pending)
                else:
                    self._close(raise_missed=False, join=False)
            return
        with contextlib.suppress(Exception):
            writer, pending = self._writer, self._pending
            if (writer is not None and pending is not None and not pending.done()
                    and writer.owns(threading.current_thread())):
                # Collected by the garbage collector on a thread of its own save (a
                # cycle holding it, dropped while it saves): waiting here for that save
                # would wait for this very thread. Close once it is done, from another
                # (which keeps the object alive until then).
                threading.Thread(target=self._close, kwargs={"raise_missed": False},
                                 name="asyncckpt-close", daemon=False).start()
                return
            self._close(raise_missed=False)

    def _left_at_exit(self, pending: CheckpointFuture) -> None:
        log.warning("rank=%d: Python is exiting while step %d is being written to %s (its "
                    "wait at exit was interrupted): that step stays uncommitted; the steps "
                    "committed before it are intact", self._ctx.rank, pending.step,
                    self.directory)

    # --- internals -----------------------------------------------------------------------

    def _forked(self) -> bool:
        """Whether this process is a fork of the one that made the checkpointer (a
        DataLoader worker, a raw os.fork()): its threads and lock are not here."""
        return os.getpid() != self._pid

    def _refuse_forked(self, what: str) -> None:
        if self._forked():
            raise CheckpointClosedError(
                f"{what}{'' if what == 'is_pending' else '()'} in process {os.getpid()}: "
                f"the checkpointer of {self.directory} "
                f"belongs to process {self._pid}, which this one was forked from, and its "
                "saves run there; make a new AsyncCheckpointer in this process"
                + (f" (or read with asyncckpt.load({str(self.directory)!r}, state))"
                   if what == "load" else ""))

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointClosedError(f"checkpointer for {self.directory} is closed")

    def _wait_for_previous(self) -> None:
        fut = self._pending
        if fut is None:
            return
        if not fut.done() and self.config.on_busy == "error":
            raise CheckpointInFlightError(
                f"step {fut.step} is still being saved to {self.directory}; wait() for it first "
                "or use on_busy='wait'")
        # A failure of the previous save is its future's to report; it does not stop this
        # save (the arena is free again either way). If nobody asked that future, the
        # log says so, and the next ckpt.wait() raises it. Anything else raised while
        # waiting (a signal handler's exception, KeyboardInterrupt) propagates, and the
        # save stays pending: the next save must still wait for it.
        self._wait_and_say(fut)
        exc = self._settle(fut, "")
        self._pending = None
        self._last_said = (fut.step, "failed" if exc is not None else "committed")
        if exc is not None:  # (the message only: its traceback holds state)
            missed = self._missed
            if missed is None or missed[0][0]:
                self._missed = (fut.seen, CheckpointSaveError(
                    f"an earlier save failed and nobody waited on its future: {exc}"))
            else:  # one more: said with the first, which the next wait() or close() raises
                error = missed[1]
                notes = getattr(error, "__notes__", [])
                if len(notes) < MISSED_SHOWN:
                    add_note(error, f"step {fut.step} failed too, and nobody waited on its "
                                    f"future either: {exc}")
                else:  # (a trial's flaky disk: 2,468 notes, 670 KB, on one error)
                    n = getattr(error, "_asyncckpt_more", 0) + 1
                    setattr(error, "_asyncckpt_more", n)  # noqa: B010 (no such attribute)
                    note = (f"... and {n} more failed saves nobody waited on (the last: step "
                            f"{fut.step}: {str(exc)[:300]})")
                    if n > 1:
                        notes[-1] = note
                    else:
                        add_note(error, note)
        del fut, exc  # frames of a raised error keep their locals: no cycle through them

    def _wait_and_say(self, fut: CheckpointFuture) -> None:
        """Wait for the save in flight before the next one, saying so where it takes long:
        a storage that hung (a dead mount) held a trial's training loop here, silently,
        until the scheduler's SIGKILL (after BUSY_SAY_S, and each time the wait doubles)."""
        waited, say_at = 0.0, BUSY_SAY_S
        t0 = time.monotonic()
        while not cf.wait([fut._durable], max(say_at - waited, 0.0)).done:
            waited = time.monotonic() - t0
            if waited >= say_at:
                log.warning(
                    "rank=%d: a save into %s has waited %.0fs for the save of step %d, still "
                    "%s (a storage that hangs? a dead network mount?); until it ends, no "
                    "save starts. A process that must end anyway: close(timeout=) tells it, "
                    "and os._exit() ends it (the steps committed before are intact)",
                    self._ctx.rank, self.directory, waited, fut.step, fut._progress_now().phase)
                say_at *= 2

    @staticmethod
    def _settle(fut: CheckpointFuture, context: str, *,
                quiet: bool = False) -> BaseException | None:
        """Wait for ``fut`` without counting as its caller; log a failure nobody has
        waited on (unless ``quiet``: the caller raises it), and return it (None if it
        succeeded or its caller saw it)."""
        # Not fut.wait(): raising the failure here would add this frame, and through it
        # its callers' (the checkpointer), to the traceback the future keeps. Anything
        # raised while waiting (a signal handler's exception) propagates as it is.
        cf.wait([fut._durable])
        exc = fut._durable.exception()
        if exc is None or fut.observed:
            return None
        if not quiet:
            log.error("%sstep %d was not saved, and its future was never waited on: %s",
                      context, fut.step, exc)
        return exc

    def _agree_on_discard(self, tag: str, step: int) -> None:
        """Coordinator: every rank's step of this discard_steps_after, before anything is
        deleted (a rank that asked to keep a step saw it deleted on rank 0's word)."""
        ctx = self._ctx
        asked = ctx.gather((tag, "asked"), "the step each rank passed to discard_steps_after",
                           have={0: {"step": step}},
                           absent="not called discard_steps_after (every rank must)")
        with contextlib.suppress(Exception):
            for r in range(1, ctx.world_size):
                ctx.store.delete_key(ctx.key(tag, "asked", r))
        steps = {r: a.get("step") if isinstance(a, dict) else a for r, a in asked.items()}
        if len(set(steps.values())) > 1:
            raise CheckpointConfigError(
                "the ranks called discard_steps_after with different steps ("
                + ", ".join(f"rank {r}: {s}" for r, s in sorted(steps.items()))
                + "); nothing was deleted: every rank must pass the same step")

    def _take_lock(self) -> None:
        if not self._cleaned and isinstance(self.storage, LocalStorage):
            _refuse_a_step_as_root(self.directory)
        self._make_root()  # created by the first save, not by reading
        deadline: float | None = None
        while True:
            try:
                taken = self._lock.acquire()
            except OSError as exc:  # a read-only mount, no write permission, no inode left
                raise CheckpointSaveError(
                    f"cannot create or open the lock file {self._lock.path} of the checkpoint "
                    f"directory: {exc.strerror or exc}" + os_error_hint(exc)
                    + "; every save takes it, so that two processes never save into one "
                    "directory (loads do not need it)") from exc
            if taken:
                if not self._cleaned:
                    self._cleanup()
                return
            holder = self._lock.holder()
            other = self._lock.held_in_this_process()
            # A closed checkpointer's save in flight releases the lock from the writer's
            # thread, just after its future completes (a save right after wait() found it
            # held, or, caught mid-release, held by "another process" of this pid): wait
            # for that release a moment, then take it
            releasing = (other is None and holder == str(os.getpid())) or (
                other is not None and other.draining is not None)
            # `asyncckpt clean` (a cron job, an operator) holds it while it removes what
            # killed runs left: seconds; a trainer starting meanwhile waits for it rather
            # than fail its first save (it was told another process "is saving")
            # (or a load that marks a step damaged beside it: a moment)
            passing = None if other is not None else self._lock.passing()
            cleaning = passing in ("clean", "mark")
            # A holder that has not written its lock file yet (it takes the lock, then
            # writes what it is): a reader marking a step damaged, caught in that moment,
            # failed an evaluator trial's trainer's first save "another process (pid
            # unknown) is saving"; one that stays unwritten is of an older version
            unwritten = passing == "unwritten"
            if cleaning or releasing or unwritten:
                deadline = deadline or time.monotonic() + (
                    _CLEAN_WAIT_S if cleaning else _UNWRITTEN_WAIT_S if unwritten
                    else _DRAIN_GRACE_S)
                left = deadline - time.monotonic()
                if left > 0:
                    if other is not None:
                        other.freed.wait(left)
                    else:  # (another process's clean, or this pid's lock mid-release)
                        time.sleep(min(0.002 if releasing else 0.05 if cleaning else 0.01,
                                       left))
                    continue
            break
        if other is not None and other.draining is not None:
            raise CheckpointLockedError(
                f"a closed AsyncCheckpointer of this process is still finishing "
                f"{other.draining} in {self.directory} (its close() was interrupted): the "
                "directory is free once that save ends (its future's wait() returns); save "
                "again then")
        if other is not None:
            made = f", made at {other.made_at}," if other.made_at else ""
            raise CheckpointLockedError(
                f"another AsyncCheckpointer of this process{made} holds {self.directory}: "
                "close() it (or use it in a `with` block) before saving into that directory "
                "again (or, from asyncckpt.save() running in another thread: save from one "
                "thread). One no name reaches any more (kept by a notebook's Out[] or the "
                "last error's traceback) is this error's holder: "
                "sys.last_value.holder.close() in a notebook",
                holder=other.owner() if other.owner is not None else None)
        here = self._lock.open_here() if holder == str(os.getpid()) else None
        if here:  # (ours: not a namesake pid of another machine's or container's)
            raise CheckpointLockedError(
                f"this process (pid {holder}) holds {self.directory} through an "
                "AsyncCheckpointer made before its asyncckpt modules were loaded again "
                "(importlib.reload, IPython's autoreload), which this one cannot see: close() "
                "that one, or start a new process")
        namesake = (" (not this one, whose pid it shares: another machine's or container's)"
                    if here is False else "")
        host = self._lock.holder_host()
        on = f" on host {host}" if host is not None else ""
        if cleaning:
            what = ("`asyncckpt clean`", "removing what earlier runs left there") if (
                self._lock.holder_purpose() != "mark") else (
                "a load", "marking a step it found damaged (damaged.json)")
            raise CheckpointLockedError(
                f"{what[0]} (pid {holder}{on}{namesake}) has held {self.directory} for "
                f"{seconds_text(_CLEAN_WAIT_S)}, {what[1]}: save again once it ends, or "
                "stop it")
        raise CheckpointLockedError(
            f"another process (pid {holder}{on}{namesake}) is saving into {self.directory}; "
            "use a different directory or stop the other process")

    def _make_root(self) -> None:
        """Create the checkpoint directory; a new one is made durable in its parent, so
        that the first step committed in it cannot vanish with it in a crash."""
        if self.directory.is_dir():
            return
        new = [self.directory]  # this directory and the ancestors it creates, outermost last
        while not new[-1].parent.exists() and new[-1].parent != new[-1]:
            new.append(new[-1].parent)
        try:
            self.storage.makedirs(self.directory)
        except (FileExistsError, NotADirectoryError):  # a file where a directory must be
            loop = _symlink_loop(self.directory)
            if loop is not None:
                raise CheckpointConfigError(
                    f"cannot create the checkpoint directory {self.directory}: {loop} (a "
                    "symbolic link in the path leads back to itself); fix the link or "
                    "choose another path") from None
            raise CheckpointConfigError(
                f"cannot create the checkpoint directory {self.directory}: it, or a parent of "
                "it, is a file; choose another path (or move the file)") from None
        except OSError as exc:
            raise CheckpointSaveError(
                f"cannot create the checkpoint directory {self.directory}: "
                f"{exc.strerror or exc}" + os_error_hint(exc)) from exc
        for d in reversed(new):
            try:
                self.storage.fsync_dir(d.parent)
            except OSError as exc:
                if exc.errno not in _FSYNC_FAILED:  # some filesystems refuse it: best effort
                    continue
                # (a storage trial's EIO here was silent: steps committed in a directory
                # whose own entry a crash may lose)
                log.warning("the new checkpoint directory %s may not survive a crash: the "
                            "fsync of %s failed (%s); its steps are committed as usual, but "
                            "check the storage (an EIO is a failing disk or a lost network "
                            "mount)", self.directory, d.parent, exc.strerror or exc)
                break

    def _cleanup(self) -> None:
        """Remove what a killed run left (temporary and half-deleted steps), under the
        lock, on the reaper thread: a restart's first save does not wait for it."""
        self._cleaned = True
        try:
            names = commit.abandoned_dirs(self.directory, self.storage)
        except OSError as exc:
            log.warning("could not list %s for abandoned checkpoint directories: %s",
                        self.directory, exc)
            return
        if names:
            self._cleaning = self._ensure_writer().clean_up(functools.partial(
                commit.cleanup_abandoned, self.directory, self.storage, names))

    def _my_keys(self, step: int, tag: str, flat: FlatState) -> set[str]:
        """The tensor keys this rank writes: all of them alone; its share in a group.

        In a group, every rank posts the digest of its layout (keys, dtypes, boxes) and
        waits for the coordinator's ``go``, which the coordinator posts once it has read
        every rank's: the one barrier of a save. Only when a digest changed does the
        coordinator read the full layouts, choose the writers of replicated boxes again
        and post each rank its share; a rank reads its own share only then.
        """
        ctx = self._ctx
        if not ctx.distributed:
            return set(flat.tensors)
        # What the digest is made of, in a form that is cheap to build and compare: with
        # thousands of tensors, the items, their JSON and its hash took ~20 ms a save.
        sig = tuple((k, t.dtype, t.shape, flat.boxes.get(k)) for k, t in flat.tensors.items())
        if sig != self._my_sig or self._my_digest is None:
            items = [LocalItem(k, dtype_name(t.dtype), flat.global_shape(k),
                               flat.box(k) or (tuple(0 for _ in t.shape), tuple(t.shape)),
                               t.numel() * t.element_size())
                     for k, t in flat.tensors.items()]
            digest = layout_digest(items)
            if digest != self._my_digest:
                ctx.put(ctx.key("items", ctx.rank, digest), [i.to_json() for i in items])
                self._posted_digests.add(digest)  # (for close: the coordinator may not
                # have seen it, and then forgets it never)
                self._my_digest = digest
                self._my_order = list(flat.tensors)
            self._my_sig = sig
        digest = self._my_digest
        ctx.note_saving(step, True)
        try:
            ctx.put(ctx.key(tag, "layout", ctx.rank), {"digest": digest, "step": step,
                                                         "settings": self._group_settings()})
            previous = self._layout
            if ctx.is_coordinator:
                lid, keys = self._start_group_save(step, tag)
            else:
                go = self._await_go(step, tag)
                self._nonce, lid = go["nonce"], go["layout"]
                keys = None
                if previous is None or previous[0] != lid:
                    share = ctx.get(ctx.key("share", lid, ctx.rank),
                                    f"this rank's share of the tensors of step {step}")
                    keys = decode_share(self._my_order, share, f"step {step} not started")
        finally:  # (in the save with every rank, or out of it: waiting for none elsewhere)
            ctx.note_saving(step, False)
        if keys is not None:
            self._layout = (lid, digest, keys)
        if previous is not None and previous[1] != digest:
            self._posted_digests.discard(previous[1])  # the coordinator's to forget
        self._failed_tags.clear()
        self._prev_tag = tag
        assert self._layout is not None
        return self._layout[2]

    def _start_group_save(self, step: int, tag: str) -> tuple[str, set[str] | None]:
        """Coordinator: wait for every rank's layout, check that they agree, hand out
        the shares when the group's layout changed, post ``go``. Returns the layout id
        and this rank's keys when they changed (else None)."""
        ctx = self._ctx
        try:
            got = self._gather_layouts(step, tag)
        except CheckpointError as exc:
            # the others raise this error as it is ("said"); _announce_failure's more
            # general post (the claim holds the first) would prefix what it says again
            with contextlib.suppress(Exception):
                self._refuse_go(tag, str(exc), exc, said=True, step=step)
            raise
        digests = tuple(got[r]["digest"] for r in range(ctx.world_size))
        lid = layout_id(digests)
        previous, old_digests = self._layout, self._digests
        keys = None
        if previous is None or previous[0] != lid:
            layouts = {r: [LocalItem.from_json(v) for v in
                           ctx.get(ctx.key("items", r, digests[r]), f"rank {r}'s layout")]
                       for r in range(ctx.world_size)}
            writes = assign_writers(layouts)
            self._shared.add(lid)
            for r in range(1, ctx.world_size):
                ctx.put(ctx.key("share", lid, r), encode_share(layouts[r], writes[r]))
            keys = {key for key, _ in writes[0]}
        self._digests = digests
        # Every rank has entered this save, so all are done with the previous one (and
        # with any that failed before the barrier), and have read their last shares.
        ctx.forget([self._prev_tag, *self._failed_tags], old_digests or (), digests,
                   sorted(self._shared - {lid}))
        self._shared &= {lid}
        ctx.put(ctx.key(tag, "go"), {"nonce": self._nonce, "layout": lid})
        return lid, keys

    def _gather_layouts(self, step: int, tag: str) -> dict[int, Any]:
        """Coordinator: every rank's layout post, once each is in; raises when a rank
        failed, the ranks save different steps, or one did not come in time."""
        ctx = self._ctx
        try:
            got = ctx.gather((tag, "layout"), f"the save plans of step {step}",
                             look=lambda ranks: ctx.refuse_saving_elsewhere(ranks, step))
        except CheckpointTimeoutError as exc:
            # (not committed, as the others say, and what to do: a QA re-check's rank 0,
            # its peer dead before this save, was told neither)
            err = CheckpointTimeoutError(
                f"{exc}{ctx.why_absent(exc.ranks, self._seq)}; "
                f"{silent_ranks_advice(step, started=False)}")
            err.ranks = exc.ranks
            raise err from exc
        self._skipped_by_me(step, got)
        raise_failures(got, f"step {step} not started")
        steps = {r: got[r]["step"] for r in range(ctx.world_size)}
        if len(set(steps.values())) > 1:
            raise CheckpointConfigError(
                "the ranks called save_async with different steps ("
                + ", ".join(f"rank {r}: {s}" for r, s in steps.items())
                + "); every rank must save the same step. Where the ranks worked out "
                "the step each its own way, pass every rank the same one: the next save "
                "with one step on every rank goes on. Where a rank skipped a save (saves "
                "pair by their count on each rank), it stays out of step for every later "
                "save of these checkpointers" + _REOPEN_ADVICE + " (saves then pair "
                "again)")
        mine = self._group_settings()
        for name in mine:
            values = {r: got[r].get("settings", mine).get(name) for r in range(ctx.world_size)}
            if len({json.dumps(v) for v in values.values()}) > 1:
                raise CheckpointConfigError(
                    f"the ranks' checkpointers were made with different {name} ("
                    + ", ".join(f"rank {r}: {v!r}" for r, v in values.items())
                    + f"); step {step} was not saved: rank 0 applies retention (keep_last, "
                    "keep_every, keep_best), compares replicas and merges the checksums for "
                    "the whole group, so every rank must pass the same")
        return got

    def _skipped_by_me(self, step: int, got: Mapping[int, Any]) -> None:
        """Coordinator: CheckpointConfigError where the ranks gave up this save, of
        another step, waiting for this rank, which skipped it; the others are told at
        their next save (a trial's rank 0 skipped one: every later save cost the others
        timeout_s, and no rank was told why)."""
        ctx = self._ctx
        failed = {r: a for r, a in got.items() if isinstance(a, dict) and "error" in a}
        if not failed or len(failed) + 1 < ctx.world_size or any(
                a.get("kind") != "CheckpointTimeoutError" or ctx.rank not in a.get("ranks", ())
                # (a save of an older step: one it passed over; a newer one means another
                # rank skipped, or rank 0 came late: the review)
                or type(a.get("step")) is not int or a["step"] >= step
                for a in failed.values()):
            return
        theirs = sorted({a["step"] for a in failed.values()})
        said = ", ".join(map(str, theirs))
        self._tell_others_skipped(failed, said, step)
        raise CheckpointConfigError(
            f"rank {ctx.rank}: this save of step {step} met the group's save of step {said}, "
            "which the other ranks gave up waiting for this rank in: this rank skipped that "
            "save. Every rank must call save_async the same number of times, in the same "
            "order" + _REOPEN_ADVICE)

    def _group_settings(self) -> dict[str, Any]:
        """The settings rank 0 applies for the whole group: every rank must have its."""
        cfg = self.config
        return {"keep_last": cfg.keep_last, "keep_every": cfg.keep_every,
                "keep_best": cfg.keep_best, "best_metric": cfg.best_metric,
                "best_mode": cfg.best_mode, "strict_replicas": cfg.strict_replicas,
                "block_bytes": cfg.block_bytes}

    def _await_go(self, step: int, tag: str) -> dict[str, Any]:
        """Not the coordinator: wait for its ``go`` (or why the save cannot start)."""
        ctx = self._ctx
        what = f"the coordinator's start of step {step}"
        try:
            go = ctx.get(ctx.key(tag, "go"), what,
                         look=lambda ranks: ctx.refuse_saving_elsewhere(ranks, step))
        except CheckpointTimeoutError as exc:
            absent = ctx.unposted({r: ctx.key(tag, "layout", r)
                                   for r in range(ctx.world_size)})
            if absent:
                why = (f"the save plans of step {step} from rank(s) {absent}; they may have "
                       "died or not called save_async for this step"
                       + ctx.why_absent(absent, self._seq))
            else:
                absent = [0]
                why = f"{what} from rank 0 (the coordinator), which has every rank's layout"
            err = CheckpointTimeoutError(
                f"rank {ctx.rank}: timed out after {seconds_text(ctx.timeout_s)} waiting for {why}")
            err.ranks = tuple(absent)
            raise err from exc
        if type(go) is not dict:
            raise CheckpointSaveError(f"step {step} not started: rank 0 posted {go!r}")
        if "error" in go:
            ctx.saw_verdict(tag)  # (rank 0's close() waits for that: it may host the Store)
            why = go["error"] if go.get("said") else f"step {step} not started: {go['error']}"
            if go.get("kind") == "CheckpointTimeoutError":
                if self._tell_skipped(step, go):
                    # (out of step, as the ranks it tells are: one kind of error on every
                    # rank, which one handler can act on; a trial's ranks got three)
                    raise CheckpointConfigError(why + self._came_late(step, go)
                                                + _REOPEN_ADVICE)
                timeout = CheckpointTimeoutError(why + self._came_late(step, go))
                timeout.ranks = tuple(go.get("ranks", ()))
                raise timeout
            if go.get("kind") == "CheckpointConfigError":
                raise CheckpointConfigError(why)
            if go.get("kind") == "CheckpointInFlightError":
                # (a rank still busy with on_busy="error": every rank skips this save,
                # and every rank's `except CheckpointInFlightError` must catch it)
                raise CheckpointInFlightError(why)
            raise CheckpointSaveError(why)
        return go

    def _tell_skipped(self, step: int, go: Mapping[str, Any]) -> bool:
        """Where this rank skipped the group's save of another step (see _came_late),
        tell the ranks that went on, and return True: their next save waits for this
        rank's layout, which this rank posted for the save they gave up on (a trial's
        waited timeout_s, told that rank 2 'may have died or not called save_async', when
        rank 2 had been told at once)."""
        ctx = self._ctx
        theirs = go.get("step")
        missing = go.get("ranks", ())
        if ctx.rank not in missing or type(theirs) is not int or theirs >= step:
            return False  # (the same step: late; a newer one: not this rank that skipped)
        self._tell_others_skipped([r for r in range(ctx.world_size) if r not in missing],
                                  str(theirs), step)
        return True

    def _tell_others_skipped(self, ranks: Iterable[int], skipped: str, step: int) -> None:
        """End the waits of ``ranks`` in their save of ``step``: this rank skipped the
        group's save of step(s) ``skipped`` (see _tell_skipped, _skipped_by_me)."""
        ctx = self._ctx
        for r in ranks:
            ctx.tell_out_of_order(r, step, (
                f"rank {r}: rank {ctx.rank} skipped the group's save of step {skipped} (the "
                f"save the others gave up waiting for it in), so its saves pair with this "
                f"group's earlier ones: its save of step {step} met that one. Every rank "
                "must call save_async the same number of times, in the same order"
                + _REOPEN_ADVICE))

    def _came_late(self, step: int, go: Mapping[str, Any]) -> str:
        """What to add when this rank is one the others gave up waiting for: this call
        pairs with the group's save that timed out, which was of another step when this
        rank skipped that save (the next ones then pair with the group's saves of other
        steps, and fail too)."""
        ctx = self._ctx
        if ctx.rank not in go.get("ranks", ()):
            return ""
        theirs = go.get("step")
        if type(theirs) is not int or theirs == step:
            return (f"; rank {ctx.rank} came to this save after the others had given up "
                    "waiting for it (timeout_s)")
        return (f"; rank {ctx.rank} was paired with the group's save of step {theirs}, for "
                f"which the others gave up waiting for it: this rank skipped that save. "
                "Every rank must call save_async the same number of times, in the same "
                "order: this rank's later saves pair with the others' next ones")

    def _replica_checksums(self, flat: FlatState) -> dict[str, Replica]:
        """Checksums of the small replicated CPU tensors this rank holds but another
        writes, and of the small boxes of sharded tensors that another rank holds too and
        writes (a box two ranks declare), for the coordinator to compare with the copy
        saved (a per-rank value under a shared path would otherwise be lost without a
        word). GPU tensors are left out: hashing them would cost a device-to-host copy on
        the caller's thread. With ``strict_replicas``, every one of them, of any size, on
        any device (HSDP's replicated shards too)."""
        assert self._layout is not None
        strict = self.config.strict_replicas
        if self._probed is None or self._probed[0] is not self._layout:
            mine = self._layout[2]
            keys = [k for k, t in flat.tensors.items()
                    if k not in mine and t.numel() > 0 and (strict or (
                        t.device.type == "cpu"
                        and t.numel() * t.element_size() <= _PROBE_BYTES))]
            self._probed = (self._layout, keys if strict else keys[:_PROBE_COUNT])
        out: dict[str, Replica] = {}
        for key in self._probed[1]:
            t = flat.tensors.get(key)
            if t is None or (t.device.type != "cpu" and not strict):
                continue
            c = t.detach().resolve_conj().resolve_neg().contiguous()
            if c.device.type != "cpu":
                c = c.cpu()  # (strict_replicas: the copy on the caller's thread it costs)
            if not plain_memory(c):
                continue  # a wrapper subclass (torchao): no bytes of its own to hash
            sums = block_checksums(tensor_bytes(c), self.config.block_bytes)
            box = flat.boxes.get(key)
            out[key] = sums if _whole(flat, key) or box is None else {
                "box": list(box[1][0]), "sums": sums}
        return out

    def _announce_failure(self, tag: str, exc: BaseException, step: int | None = None
                          ) -> None:
        """Let the other ranks fail this save at once instead of timing out (with this
        rank's ``step``, and the ranks a timeout waited for: see _skipped_by_me)."""
        ctx = self._ctx
        if not ctx.distributed:
            return
        msg = f"rank {ctx.rank}: {type(exc).__name__}: {exc}"
        Pulse(ctx, tag).abort(msg)
        try:  # (an error of the user's may have a `ranks` of its own)
            ranks = [int(r) for r in getattr(exc, "ranks", ()) or ()]
        except Exception:
            ranks = []
        with contextlib.suppress(Exception):
            post = {"error": msg, "kind": type(exc).__name__, "step": step, "ranks": ranks}
            for part in ("layout", "record", "done"):
                ctx.put(ctx.key(tag, part, ctx.rank), post)
            if not ctx.is_coordinator:
                ctx.saw_verdict(tag)  # (it knows the outcome: rank 0's close() need not wait)
            if ctx.is_coordinator:
                ctx.put(ctx.key(tag, "verdict"), {"error": msg})
                # (before the barrier's go, the others wait for this; after it, nobody)
                self._refuse_go(tag, msg, exc, said=False)

    def _refuse_go(self, tag: str, why: str, exc: BaseException, *, said: bool,
                   step: int | None = None) -> None:
        """Coordinator: post, unless a go is posted already, that save ``tag`` cannot
        start, and why (``said``: the others raise ``why`` as it is; else they prefix
        it with the step). The error's kind and silent ranks go with it, and the step of
        the coordinator's save, when known (a rank that skipped it is told so)."""
        self._refused_tag = tag  # (close() waits until the others have read it)
        # (but for a rank found in another save: it never reads this one's keys, and
        # close() waited 10 s for it after a rank saving into another directory)
        self._refused_outside = len(set(outside_ranks(exc)) - {self._ctx.rank})
        self._ctx.claim(self._ctx.key(tag, "go"), json.dumps(
            {"error": why, "kind": type(exc).__name__, "said": said,
             "ranks": list(getattr(exc, "ranks", ()) or ()),
             **({} if step is None else {"step": step})}), "posting why")

    def _plan_for(self, tensors: Mapping[str, torch.Tensor]) -> WritePlan:
        if self._plan is not None and self._plan.signature == layout_signature(tensors):
            return self._plan
        self._plan = plan_writes(tensors, shard_file_name(self._ctx.rank),
                                 {"asyncckpt_format": "1"})
        return self._plan

    def _arena_for(self, plan: WritePlan, *, save: bool = False) -> HostArena:
        arena = self._arena_of(plan.padded_bytes, save=save)
        if self._arena_header_for is not plan:
            arena.write_header(plan.header)
            self._arena_header_for = plan
        return arena

    def _arena_changes(self, need: int, plan: WritePlan | None) -> bool:
        """Whether making the arena ready for ``plan`` (or ``need`` bytes) changes it."""
        return self._arena_too_small(need) or (plan is not None
                                               and self._arena_header_for is not plan)

    def _arena_too_small(self, need: int, counted: int = 0) -> bool:
        """Whether the arena must be made anew for ``need`` bytes: none yet, too small,
        pinned where it must not be (or not where it must), or (unpinned) far too large
        for the last saves (see _ARENA_SHRINK_AFTER; ``counted``: this one counted too)."""
        pinned = self.config.mode == "async_pinned" and torch.cuda.is_available()
        arena = self._arena
        return (arena is None or arena.nbytes < need or arena.pinned != pinned
                or (not arena.pinned and self._small_saves + counted >= _ARENA_SHRINK_AFTER
                    and _far_too_large(arena.nbytes, need)))

    def _arena_of(self, need: int, *, save: bool = False) -> HostArena:
        """The arena, reallocated first if it holds fewer than ``need`` bytes (with room
        to grow: a state that grew by 16 KiB a save made a new one at every save, a
        trial's), or far more than the last saves (``save``: this is one) needed: its
        memory given back. Not for pinned memory, which comes from torch's cache of it:
        that rounds sizes up to powers of two (room to grow already, and 1/16 more can
        double it) and keeps what is freed (a smaller one is pinned beside it)."""
        pinned = self.config.mode == "async_pinned"
        old = self._arena
        small = save and old is not None and _far_too_large(old.nbytes, need)
        if self._arena_too_small(need, counted=int(small)):
            grown = old is not None and old.nbytes < need and not old.pinned
            shrunk = old is not None and old.nbytes >= need
            want = max(need, self._small_need) if shrunk else need
            size = (-(-(want + want // 16) // _ARENA_GRAIN) * _ARENA_GRAIN if grown or shrunk
                    else need)
            self._arena = None  # drop the old one first: never hold two at once
            self._arena_header_for = None
            self._small_saves = self._small_need = 0
            del old
            try:
                try:
                    self._arena = HostArena(size, pinned=pinned,
                                            threads=self.config.copy_threads or 1)
                except (MemoryError, OSError, RuntimeError):
                    if size == need:
                        raise
                    # (no room for the room to grow: the size needed, then)
                    self._arena = HostArena(need, pinned=pinned,
                                            threads=self.config.copy_threads or 1)
            except (MemoryError, OSError, RuntimeError) as exc:  # mmap: OSError; pinned: Runtime
                pinned = pinned and torch.cuda.is_available()
                raise CheckpointSaveError(
                    f"rank {self._ctx.rank}: could not allocate the "
                    f"{'pinned ' if pinned else ''}host buffer of {need / 1e9:.2f} GB "
                    f"({type(exc).__name__}: {exc}) into which the saves to {self.directory} "
                    "copy the state: free host memory, or save less (a state's tensors are "
                    "copied whole: an expanded view, stride 0, takes its full size)"
                    + ("; or try mode='async' (not pinned)" if pinned else "")
                    + _address_space_note()) from exc
        elif small:
            self._small_saves += 1
            self._small_need = max(self._small_need, need)
        elif save:
            self._small_saves = self._small_need = 0
        assert self._arena is not None
        return self._arena

    def _extras_for(self, flat: FlatState, mine: set[str]) -> Extras | None:
        """A rank of a group serving its saves offers, beside its shard, copies of the
        tensors it holds but another rank writes (replicated ones, such as Adam's step
        counts under FSDP2), so that its view for peers holds its whole state as of this
        save, not only what its file holds (a peer healing this rank's replica wants them
        all). Their buffers, kept while the layout is; the copy is made with the staging
        (``fill_extras``: off the caller's thread with ``overlap=True``). Serving is a
        bonus: buffers that cannot be had are logged, and the view goes without them."""
        keys = [k for k in flat.tensors if k not in mine]
        if not keys:
            return None
        rank = self._ctx.rank
        try:
            live = {k: flat.tensors[k] for k in keys}
            kept = self._extras
            if kept is None or kept.plan.signature != layout_signature(live):
                copies = {k: torch.empty(t.shape, dtype=t.dtype) for k, t in live.items()}
                kept = Extras(plan_writes(copies, f"rank_{rank:05d}.replicas.safetensors",
                                          {"asyncckpt_format": "1"}), copies)
        except Exception as exc:
            self._extras = None
            log.error("rank=%d: the tensors this rank holds but does not write could not be "
                      "copied for its view for peers (offered without them): %s: %s", rank,
                      type(exc).__name__, exc)
            return None
        kept.live, kept.filled = live, False
        self._extras = kept
        return kept

    def _stop_serving(self, retired: str | None = None) -> None:
        """Peers must stop reading the arena before anything in it changes (the next save
        restages it) or it is released (close). The offer is withdrawn, not only
        disallowed: allowing its step again would serve whatever the arena holds by then,
        and the transport would keep the arena alive."""
        withdraw_offers(self._transports, retired)

    def _ensure_writer(self) -> BackgroundWriter:
        if self._writer is None:
            self._writer = BackgroundWriter(self.config.copy_threads or 1)
        return self._writer


# (a review: Python waits for the checkpointer's threads at exit, as the `with` block's
# close does: a thread stuck in the storage holds the process)
_STUCK_EXIT = ("; a thread stuck in the storage keeps the process from exiting normally "
               "(Python waits for it): end it with os._exit(), e.g. os._exit(143) after a "
               "SIGTERM, and the next run cleans up")


BUSY_SAY_S = 60.0  # a save waiting this long for the one in flight says so (_wait_and_say)


def _group_up() -> bool:
    """Whether torch.distributed's default process group is initialized."""
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized())


def _caller_site() -> str:
    """``file:line`` of the first frame outside this package: where the user made the
    checkpointer (a notebook cell's name, a script's line)."""
    here = os.path.dirname(__file__)
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(here):
        frame = frame.f_back
    if frame is None:
        return ""
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def _release_when_done(lock: DirectoryLock, busy: Sequence[cf.Future[Any]]) -> None:
    """Release ``lock`` once every future of ``busy`` is done (from the thread that ends
    the last; at once if all are)."""
    left = [len(busy)]
    guard = threading.Lock()

    def done(_: object) -> None:
        with guard:
            left[0] -= 1
            last = left[0] == 0
        if last:
            with contextlib.suppress(Exception):
                lock.release()

    for f in busy:
        f.add_done_callback(done)


# How long a save waits for the lock a closed checkpointer's save in flight is about to
# release (its future done, the release a callback away) before it says the directory is busy
_DRAIN_GRACE_S = 1.0
_CLEAN_WAIT_S = 30.0  # the longest a save waits for `asyncckpt clean` to release the lock
_UNWRITTEN_WAIT_S = 1.0  # ... for a holder that has not written its lock file yet

# How long the coordinator's close() waits at most for the other ranks to read the verdict
# on the last save (they poll for it every 0.1 s at most).
_VERDICT_SEEN_S = 10.0
_PROBE_BYTES = 64 << 10  # replicated tensors up to this size are compared across ranks
_PROBE_COUNT = 4096  # and at most this many


def _whole(flat: FlatState, key: str) -> bool:
    """Whether ``key`` is held whole (a plain tensor, or a DTensor replicated on every mesh
    dim): then its one saved chunk is what every rank's copy is compared with."""
    box = flat.boxes.get(key)
    return box is None or box[1][1] == box[0]


def _share_estimate(flat: FlatState, world_size: int) -> int:
    """Arena bytes for this rank's share of a group save, estimated without the others'
    layouts: a box held by n ranks (a plain tensor: all of them; a DTensor or declared
    shard: the group's size times the fraction of the tensor it is) costs 1/n of its
    bytes, plus the largest replicated box, by which the writers' balance can be off.
    Never more than the whole local state."""
    body = extra = total = 0
    for key, t in flat.tensors.items():
        nbytes = t.numel() * t.element_size()
        total += nbytes
        numel = math.prod(flat.global_shape(key))
        replicas = max(1, round(world_size * t.numel() / numel)) if numel else 1
        body += -(-nbytes // replicas)
        if replicas > 1:
            extra = max(extra, nbytes)
    # (of every local tensor: more than the share's, which alone must fit safetensors')
    header = len(plan_writes(flat.tensors, shard_file_name(0), {"asyncckpt_format": "1"},
                             sized=False).header)
    return align_up(header + min(total, body + extra))


def _check_unchanged(step: int, tensors: Mapping[str, torch.Tensor],
                     versions: Mapping[str, int], *, handover: bool = False) -> None:
    """With overlap=True, refuse a checkpoint whose tensors were changed in place while
    they were being copied: it could hold old values of some and new values of others
    (changes torch does not count cannot be seen: through ``.data``, through numpy, or
    to inference tensors; ``wait_staged()`` is the guarantee, this a safety net). Run as
    the copy ends, and again (``handover``) when the caller takes the tensors back, or
    before the commit if it never does (writer.Handover)."""
    changed = changed_in_place(tensors, versions)
    if changed:
        more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
        when = ("while save_async(overlap=True) was still copying them" if not handover
                else "after save_async(overlap=True) and before fut.wait_staged() returned "
                "(with no wait_staged() call: before the save was written), and torch counts "
                "a change only once it is complete: the copy may have read them mid-change")
        raise CheckpointSaveError(
            f"step {step} was not saved: tensor(s) {', '.join(map(repr, changed[:5]))}{more} "
            f"were changed in place {when}, so the checkpoint could mix old and new values. "
            "Call fut.wait_staged() before anything changes them: optimizer.step(), or a "
            "forward pass that updates buffers (BatchNorm in training mode)")


def _stage_or_fail(plan: WritePlan, tensors: Mapping[str, torch.Tensor], arena: HostArena,
                   progress: StagingProgress, writer: BackgroundWriter, *,
                   stoppable: bool = False, check: Callable[[], None] | None = None,
                   after: Mapping[torch.device, Any] | None = None,
                   extras: Extras | None = None) -> None:
    """Stage, and fail the save's progress if staging fails. ``stoppable`` (overlap=True,
    on the stager thread): give up as soon as the save has failed, since the next save
    may want the arena; on the caller's thread the copy just finishes. ``check`` runs
    once the copy is complete, before the writer may finish (see ``stage``). ``extras``
    (a rank serving its saves) are copied first: the view that offers them is made once
    the arena is staged, so never before they are."""
    if not progress.begin(stoppable):  # overlap=True, and the save failed before this ran
        raise StagingStopped("the save failed before its tensors were staged (see its "
                             "future)")
    try:
        if extras is not None:
            fill_extras(extras, after)
        stage(plan, tensors, arena, progress, helpers=writer.copiers,
              threads=writer.copy_threads, stoppable=stoppable, check=check, after=after)
    except BaseException as exc:
        progress.fail(exc)
        raise
    finally:
        progress.end()


def fill_extras(extras: Extras, after: Mapping[torch.device, Any] | None = None) -> None:
    """Copy the live tensors of ``extras`` into its buffers (CUDA ones on side streams
    ordered after ``after``, as ``stage`` does), and mark it filled. A copy that fails is
    logged, not raised: the view is then offered without them (serving is a bonus)."""
    extras.filled = False
    try:
        streams = side_streams(extras.live, after)
        try:
            with torch.no_grad():
                for k, t in extras.live.items():
                    src = t.detach()
                    with (torch.cuda.stream(streams[t.device]) if t.is_cuda
                          else contextlib.nullcontext()):
                        extras.tensors[k].copy_(src)
        finally:
            for stream in streams.values():
                stream.synchronize()
    except Exception as exc:
        log.error("the tensors this rank holds but does not write could not be copied for "
                  "its view for peers (%s; offered without them): %s: %s", extras.plan.file,
                  type(exc).__name__, exc)
        return
    extras.filled = True


# A save that spends this long allocating its arena says that prepare() would spare it.
_PREPARE_HINT_S = 0.25


def _will_make_state(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt`` has no state yet but will make some at its first step: it has
    parameters that take gradients, and is not a plain SGD without momentum (which never
    makes any: review)."""
    if opt.state:
        return False
    if not any(p.requires_grad for g in opt.param_groups for p in g["params"]):
        return False
    return not (type(opt) is torch.optim.SGD
                and all(not g.get("momentum") for g in opt.param_groups))


def _hint_prepare(rank: int, step: int, plan: WritePlan, seconds: float,
                  prepared_stateless: bool = False) -> None:
    if seconds >= _PREPARE_HINT_S:
        log.info("rank=%d step=%d: allocating the %.2f GB host buffer took %.2fs of this "
                 "save's blocked time (%s", rank, step, plan.padded_bytes / 1e9, seconds,
                 "the state grew since prepare(): an optimizer makes its state at its "
                 "first step, so call prepare() after that step)" if prepared_stateless else
                 "a first save, or a grown state); ckpt.prepare(state) at start-up "
                 "allocates it in the background")


def _refuse_partial_shards(flat: FlatState, shards: Mapping[str, ShardMetadata]) -> None:
    """One process saves a hand-sharded tensor whole or not at all: no other rank would
    save the rest (the commit would find it uncovered, in the background)."""
    for path in shards:
        global_shape, (offsets, lens) = flat.boxes[flat.refs[path]]
        if lens != global_shape:
            raise CheckpointConfigError(
                f"shards[{path!r}]: a box of shape {list(lens)} at offsets {list(offsets)} of "
                f"a tensor of global shape {list(global_shape)}, saved by one process (world "
                "size 1): no other rank saves the rest; save the whole tensor, or save from "
                "every rank of a group")


def _checked_metadata(metadata: object) -> dict[str, str]:
    """``metadata`` as the manifest keeps it, str to str: numbers and bools become their
    text (read back as str); anything else is refused here, naming the key, rather than
    failing the save in the background or stored as a repr."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise CheckpointConfigError(f"metadata={metadata!r:.80}: pass a mapping of str to str")
    out: dict[str, str] = {}
    for k, v in metadata.items():
        if type(k) is not str:
            raise CheckpointConfigError(f"metadata key {k!r:.80}: keys must be str")
        if (isinstance(v, (np.bool_, np.integer, np.floating))
                or (type(v) in (torch.Tensor, torch.nn.Parameter) and v.ndim == 0
                    and not v.is_complex() and v.device.type != "meta")):
            # (a trial's np.int64 epoch and 0-dim tensor step, which metrics= took, were
            # refused here: "of type bool: values must be str (or a number or bool")
            with contextlib.suppress(Exception):  # (else refused below, as it was)
                v = v.item()
        if isinstance(v, (str, bool, int, float)):
            out[k] = str(v)
        else:
            raise CheckpointConfigError(
                f"metadata[{k!r}] is of type {type(v).__name__}: values must be str (or a "
                "number or bool, stored as its text: numpy's and 0-dim tensors' too); "
                "json.dumps() it, or save it in the state")
    return out


def _version() -> str:
    from . import __version__

    return __version__


def note_damaged(directory: Path, storage: Storage, new: list[tuple[int, str]],
                 lock: DirectoryLock, rank: int, *, marks: bool, unmarked_means: str,
                 remedy: str = FALLBACK_REMEDY,
                 unmarked_here: str = "") -> None:
    """Mark the steps a fallback load found damaged (``new``: step, what was found) with
    damaged.json, and warn of them. ``marks``: False where another rank marks (this one
    only warns). The directory's owner marks: the checkpointer (or another of this
    process) that holds ``lock``, or, while none does (a resume before its first save, a
    module-level load), this process for the moment it takes it; not a reader beside a
    process that saves there (an evaluator beside its trainer)."""
    unmarked = []
    # (marked already: not taken again, nor the lock for it; an evaluator trial's reader
    # took the lock at every load that met a marked step)
    todo = [(s, why) for s, why in new
            if commit.read_damaged_mark(directory / commit.step_dir_name(s), storage) is None]
    owned = taken = False
    refused: str | None = None  # (the lock file is a link, a FIFO, unwritable)
    if marks and todo:
        owned = lock.held or lock.held_in_this_process() is not None
        if not owned:
            # (its purpose named: a trainer's first save meanwhile waits for it, as for
            # `asyncckpt clean`, rather than fail as if another process saved there)
            lock = DirectoryLock(directory, purpose="mark")
            try:
                taken = lock.acquire()
            except OSError as exc:
                refused = f"its lock file cannot be taken: {exc.strerror or exc}"
        try:
            for s, why in todo:
                failed = (commit.mark_damaged(directory, s, why, storage)
                          if owned or taken else refused or
                          f"another process (pid {lock.holder()}) saves there")
                if failed is not None:
                    unmarked.append(f"step {s}: {failed}")
        finally:
            if taken:
                lock.release()
    steps = [s for s, _ in new]
    # (a reader beside a trainer marks nothing: the trainer's retention goes on counting
    # them, which the warning said it did not: a trial)
    # (not where the lock could not be taken at all: an ops trial's read-only copy, where
    # nothing saves, was told of "the process saving there")
    # (nor where another user's lock file cannot be opened for writing, but is held: an
    # evaluator beside its trainer, run as another user, is told of the trainer: review)
    elsewhere = marks and bool(unmarked) and not owned and not taken and (
        refused is None or lock.held_by_another() is True)
    log.warning(
        "rank=%d: step(s) %s under %s failed their checks and stay on disk (for a look)%s; "
        "%s. To save a step older than them, or to remove them now: %s", rank, steps,
        directory,
        (unmarked_here or f" (rank 0 marks them, by {commit.DAMAGED_NAME})") if not marks else
        f", marked by {commit.DAMAGED_NAME}" if not unmarked else
        f"; {commit.DAMAGED_NAME} could not be written ({'; '.join(unmarked)}): "
        f"{unmarked_means}",
        "the process saving there does not know of them: its keep_last goes on counting "
        "them, and keep_best ranking them; run 'asyncckpt verify' there, or load with "
        "fallback=True in that process" if elsewhere else
        "no mark records them, so a later checkpointer's keep_last counts them until a "
        "load that can write there marks them" if marks and unmarked else
        "keep_last does not count them, and removes them once older than the steps it keeps",
        remedy)
