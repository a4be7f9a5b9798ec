"""asyncckpt: non-blocking, atomic, verified checkpoints for PyTorch training.

Example:
    >>> import asyncckpt
    >>> ckpt = asyncckpt.AsyncCheckpointer("runs/exp1", keep_last=3)
    >>> fut = ckpt.save_async({"model": model, "optim": optimizer}, step=100)
    >>> fut.wait()  # committed: a load sees committed steps only
    >>> restored = ckpt.load({"model": model, "optim": optimizer})
"""

from __future__ import annotations

import logging as _logging
import os
import re
import time as _time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from .checkpointer import AsyncCheckpointer, CheckpointerConfig
from .checkpointer import MetadataValue as _MetadataValue
from .checkpointer import checked_directory as _checked_directory
from .commit import StepLike as _StepLike
from .commit import check_step as _check_step
from .commit import resolve_step_dir as _resolve_step_dir
from .commit import warn_if_marked as _warn_if_marked
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
    CheckpointTransportError,
    CheckpointVersionError,
    NotPicklableError,
    StateMismatchError,
    UnsupportedLeafError,
)
from .errors import check_flags as _check_flags
from .errors import with_advice as _with_advice
from .loader import LATEST_TRIES as _LATEST_TRIES
from .loader import KeyMap as _KeyMap
from .loader import ShardMetadata
from .loader import check_exclude as _check_exclude
from .loader import check_fallback as _check_fallback
from .loader import check_key_map as _check_key_map
from .loader import check_progress as _check_progress
from .loader import check_threads as _check_threads
from .loader import excluded_view as _excluded_view
from .loader import load_from as _load_from
from .manifest import is_shard_file_name as _is_shard_file_name
from .preemption import PreemptionWatch
from .reader import outpaced as _outpaced
from .safetensors_files import load_safetensors
from .storage import LocalStorage
from .storage import LocalStorage as _LocalStorage
from .tree import RNGState, Stateful, capture_rng_state, restore_rng_state
from .writer import CheckpointFuture, CheckpointInfo, SaveProgress

__version__ = "0.1.0"

__all__ = [
    "AsyncCheckpointer",
    "CheckpointClosedError",
    "CheckpointConfigError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointFuture",
    "CheckpointInFlightError",
    "CheckpointInfo",
    "CheckpointLockedError",
    "CheckpointNotFoundError",
    "CheckpointPermissionError",
    "CheckpointSaveError",
    "CheckpointTimeoutError",
    "CheckpointTransportError",
    "CheckpointVersionError",
    "CheckpointerConfig",
    "LocalStorage",
    "NotPicklableError",
    "PreemptionWatch",
    "RNGState",
    "SaveProgress",
    "ShardMetadata",
    "StateMismatchError",
    "Stateful",
    "UnsupportedLeafError",
    "__version__",
    "capture_rng_state",
    "load",
    "load_safetensors",
    "restore_rng_state",
    "save",
]


def save(state: Any, directory: str | os.PathLike[str], *, step: _StepLike = 0,
         metadata: Mapping[str, _MetadataValue] | None = None,
         metrics: Mapping[str, Any] | None = None,
         shards: Mapping[str, ShardMetadata] | None = None) -> CheckpointInfo:
    """Save ``state`` synchronously as ``step`` under ``directory``.

    A committed step is never overwritten (CheckpointExistsError), nor is a step older
    than one already there saved: pass a new ``step``, or another directory.
    ``metadata``, ``metrics`` and ``shards`` (in a group: the boxes of tensors sharded by
    hand) are as for ``AsyncCheckpointer.save_async``.

    Example:
        >>> asyncckpt.save({"model": model}, "ckpts/final")
    """
    with AsyncCheckpointer(directory, mode="sync") as ckpt:
        return ckpt.save(state, step, metadata=metadata, metrics=metrics, shards=shards)


def load(path: str | os.PathLike[str], state: Any = None, *, step: _StepLike | None = None,
         strict: bool = True, verify: bool = True, token: str | None = None,
         timeout: float = 60.0, fallback: bool = False, threads: int | None = None,
         progress: Callable[[int, int], None] | None = None,
         ignore_unexpected: bool = False,
         exclude: str | Iterable[str] | None = None,
         key_map: _KeyMap | None = None, cast: bool = False,
         shards: Mapping[str, ShardMetadata] | None = None,
         max_file_bytes: int | None = 1 << 40) -> Any:
    """Load from a checkpoint root (latest step, or ``step``), one step directory, or a
    peer's address (``http://host:port/v1``, as ``HTTPTransport.address()`` gives).
    ``max_file_bytes`` (a peer only: as HTTPTransport's): the most a file the peer lists
    may hold, and with no ``state``, all of them together; None for no limit.
    ``fallback=True`` skips corrupt steps, newest first (see AsyncCheckpointer.load).
    ``threads``: reader threads for files (default: up to 2), parallel connections for
    a peer (default 8; at most one per CPU, 2 at least). ``timeout``: seconds a fetch
    from a peer may take as a whole. ``progress(done, total)``, ``strict``,
    ``ignore_unexpected``, ``exclude``, ``key_map``, ``cast`` and ``shards`` (the boxes of
    tensors sharded by hand that this process holds): see AsyncCheckpointer.load.

    Example:
        >>> asyncckpt.load("ckpts/final", {"model": model})
        >>> asyncckpt.load("http://10.0.0.7:8123/v1", {"model": model}, token=secret)
    """
    _check_flags(strict=strict, verify=verify, fallback=fallback,
                 ignore_unexpected=ignore_unexpected, cast=cast)
    _check_threads(threads)
    _checked_directory(path, "path")
    step = _check_step(step)
    _check_fallback(fallback, step, verify)
    parts = _check_exclude(exclude)
    _check_key_map(key_map)
    _check_progress(progress)
    from .transport.http import check_max_file_bytes

    max_file_bytes = check_max_file_bytes(max_file_bytes)
    view, _, finish = _excluded_view(state, parts)
    return finish(_load_any(path, view, step, strict, verify, token, timeout, fallback,
                            threads, progress, ignore_unexpected, parts, key_map, cast, shards,
                            max_file_bytes=max_file_bytes))


def _process_rank() -> int:
    """This process's rank in a job: the default group's, else torchrun's RANK, else 0."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except (ImportError, RuntimeError, ValueError):
        pass
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _in_a_job() -> bool:
    """Whether this process is one of several ranks (the default group's, or torchrun's
    WORLD_SIZE)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_world_size()) > 1
    except (ImportError, RuntimeError, ValueError):
        pass
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


def _load_any(path: str | os.PathLike[str], state: Any, step: int | None, strict: bool,
              verify: bool, token: str | None, timeout: float, fallback: bool,
              threads: int | None, progress: Callable[[int, int], None] | None,
              ignore_unexpected: bool, exclude: tuple[str, ...],
              key_map: _KeyMap | None, cast: bool,
              shards: Mapping[str, ShardMetadata] | None = None,
              max_file_bytes: int | None = 1 << 40) -> Any:
    step = _check_step(step)  # (a NumPy integer or a 0-dim tensor as an int)
    scheme = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", str(path))
    is_peer = scheme is not None and scheme.group(1).lower() == "http"  # (RFC 3986: any case)
    if scheme is not None and not is_peer:
        raise CheckpointConfigError(
            f"{path}: a peer's address must start with http:// (as HTTPTransport.address() "
            f"gives), not {scheme.group(1)}://; a local path has no scheme")
    if scheme is None and re.match(r"(?i)https?:", str(path)) and not os.path.exists(path):
        # ("http:/host:port/v1" read as a local path: "no checkpoint directory at ...")
        raise CheckpointConfigError(
            f"{path}: not a peer's address (http://host:port/v1, as HTTPTransport.address() "
            "gives: two slashes after http:), nor a local path that exists")
    if is_peer:
        if fallback:
            raise CheckpointConfigError(
                "fallback=True picks among committed steps on disk; a peer serves one step: "
                "drop fallback to load from an address")
        from .transport.base import StepNotOffered
        from .transport.http import (
            HTTPStorage,
            fetch_connections,
            fetch_timeout,
            peer_error,
        )

        timeout = fetch_timeout(timeout)
        deadline = _time.monotonic() + timeout
        while True:
            left = max(deadline - _time.monotonic(), 0.001)
            peer = HTTPStorage(str(path), -1, token=token, timeout_s=left, deadline_s=left,
                               timeout_told=timeout, max_file_bytes=max_file_bytes,
                               max_total_bytes=max_file_bytes if state is None else None)
            try:
                peer.step = peer.current_step() if step is None else step
                return _load_from(Path(f"peer-step-{peer.step}"), state, peer, strict=strict,
                                  ignore_unexpected=ignore_unexpected, verify=verify,
                                  threads=fetch_connections(threads or 8), progress=progress,
                                  exclude=exclude, key_map=key_map, cast=cast, shards=shards)
            except StepNotOffered as exc:
                # "The step on offer" moved on while it was fetched (the peer saved again):
                # fetch the new one, whole, within what is left of the timeout.
                if step is not None or _time.monotonic() >= deadline:
                    raise peer_error(exc, state, peer) from exc.__cause__
                _logging.getLogger(__name__).info(
                    "%s moved on from step %d to step %d during the fetch: fetching step %d",
                    path, peer.step, exc.offered, exc.offered)
            except CheckpointError as exc:
                raise peer_error(exc, state, peer) from exc.__cause__
            finally:
                peer.close_all()
    if str(path).endswith(".safetensors") and os.path.isfile(path) and _is_shard_file_name(
            Path(path).name) and os.path.isfile(Path(path).parent / "manifest.json"):
        # (not "a plain safetensors file": load_safetensors sent the user back here)
        raise CheckpointNotFoundError(
            f"{path} is a shard file of the checkpoint {Path(path).parent}: load that step "
            f"directory (asyncckpt.load({str(Path(path).parent)!r}, state))")
    if str(path).endswith(".safetensors") and os.path.isfile(path):
        raise CheckpointNotFoundError(
            f"{path} is a plain safetensors file, not an asyncckpt checkpoint (a directory of "
            "step_* directories, or one of them): load it with asyncckpt.load_safetensors")
    storage = _LocalStorage()

    def mark(found: list[tuple[int, str]],
             remedy: str = "AsyncCheckpointer(root).discard_steps_after(<the step loaded>)"
             ) -> None:
        """Mark steps a load found damaged, as a checkpointer's load marks them (for
        retention, ls, best_step): by one process of a job (rank 0, as a group's
        checkpointer): the lock the mark takes for a moment must not meet the first save
        of another rank's."""
        from .checkpointer import note_damaged
        from .storage import DirectoryLock

        rank = _process_rank()
        note_damaged(Path(path), storage, sorted(dict(found).items()),
                     DirectoryLock(Path(path)), rank, marks=rank == 0,
                     unmarked_means="a later checkpointer's retention does not know",
                     remedy=remedy,
                     unmarked_here=" (not marked by this rank: rank 0 marks what its own "
                                   "load finds)")

    if fallback and step is None:
        from .loader import load_newest_intact

        found: list[tuple[int, str]] = []
        try:
            return load_newest_intact(Path(path), state, storage, strict=strict,
                                      ignore_unexpected=ignore_unexpected, threads=threads,
                                      progress=progress, exclude=exclude, key_map=key_map,
                                      cast=cast, shards=shards, damaged=found)
        finally:
            if found:
                mark(found)
    for attempt in range(_LATEST_TRIES):
        step_dir, resolved = _resolve_step_dir(Path(path), step, storage)
        _warn_if_marked(step_dir, storage, verify)
        try:
            return _load_from(step_dir, state, storage, strict=strict,
                              ignore_unexpected=ignore_unexpected, verify=verify,
                              threads=threads, step=step, progress=progress, exclude=exclude,
                              key_map=key_map, cast=cast, shards=shards)
        except CheckpointNotFoundError as exc:
            # The latest step, retired by the retention of a newer save (another process
            # trains here), or removed and saved again by a rollback, while it was read:
            # whichever is the latest now is loaded.
            if step is not None or resolved is None:
                raise
            if attempt + 1 == _LATEST_TRIES:
                err = _outpaced(exc, _LATEST_TRIES)
                if err is None:
                    raise
                raise err from err.__cause__
            _logging.getLogger(__name__).info(
                "step %d under %s could not be read (%s): loading the latest step again",
                resolved, path, exc)
        except CheckpointCorruptError as exc:
            # (a root: a step directory given is not marked; nor what may be no damage;
            # nor in a job: its processes' verdicts must agree, as a group's ranks')
            in_job = _in_a_job()
            if resolved is not None and not exc.maybe_intact and not in_job:
                from .checkpointer import PLAIN_LOAD_REMEDY

                mark([(resolved, str(exc))], remedy=PLAIN_LOAD_REMEDY)
            if in_job:
                # (a re-check trial: one rank followed the advice below, and the ranks
                # went on from different steps; a module-level load decides per process)
                err = _with_advice(exc, f"rank {_process_rank()}: asyncckpt.load is this "
                                   "process's alone, with fallback=True too: load another "
                                   "step in every process, or AsyncCheckpointer(root).load("
                                   "..., fallback=True) on every rank, which brings them all "
                                   "to one intact step")
                raise err from err.__cause__
            if step is None and resolved is not None:  # (fallback not on: see above)
                err = _with_advice(exc, "asyncckpt.load(..., fallback=True) loads the newest "
                                   "intact step instead")
                raise err from err.__cause__
            raise
    raise AssertionError("unreachable")
