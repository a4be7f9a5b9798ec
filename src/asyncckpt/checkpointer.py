"""AsyncCheckpointer: flatten -> plan -> stage (the caller waits here) -> write -> commit."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import commit
from .errors import (
    CheckpointClosedError,
    CheckpointConfigError,
    CheckpointExistsError,
    CheckpointInFlightError,
    CheckpointLockedError,
    StateMismatchError,
)
from .manifest import DEFAULT_BLOCK_BYTES, Manifest, shard_file_name
from .plan import WritePlan, layout_signature, plan_writes
from .reader import load_tensors, read_manifest
from .staging import HostArena, StagingProgress, stage
from .storage import DirectoryLock, LocalStorage, Storage
from .tree import FlatState, flatten, iter_array_nodes, restore_into, unflatten
from .writer import BackgroundWriter, CheckpointFuture, CheckpointInfo, SaveJob

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
    on_busy: str = "wait"
    """When a save is asked for while one is in flight: "wait" for it, or "error"."""
    direct_io: bool = True
    """Write shard files with O_DIRECT where the filesystem allows it."""
    block_bytes: int = DEFAULT_BLOCK_BYTES
    """Checksum granularity: one xxh3-64 per this many bytes of each tensor."""

    def __post_init__(self) -> None:
        if self.mode not in _MODES:
            raise CheckpointConfigError(f"mode={self.mode!r}: use one of {sorted(_MODES)}")
        object.__setattr__(self, "mode", _MODES[self.mode])
        if self.keep_last is not None and (type(self.keep_last) is not int or self.keep_last < 1):
            raise CheckpointConfigError(
                f"keep_last={self.keep_last!r}: use a positive int, or None to keep every "
                "checkpoint")
        if self.on_busy not in ("wait", "error"):
            raise CheckpointConfigError(f"on_busy={self.on_busy!r}: use 'wait' or 'error'")
        if self.block_bytes < 4096 or self.block_bytes % 4096:
            raise CheckpointConfigError(f"block_bytes={self.block_bytes}: use a multiple of 4096")


class AsyncCheckpointer:
    """Saves state trees without stopping training; loads them back, verified.

    Not thread-safe: call it from the training thread. One save is in flight at a
    time; its background work runs on the checkpointer's own threads.

    Example:
        >>> ckpt = AsyncCheckpointer("runs/exp1", keep_last=3)
        >>> fut = ckpt.save_async({"model": model, "optim": opt}, step=100)
        >>> ...                     # training goes on
        >>> fut.wait().durable_s
    """

    def __init__(self, directory: str | os.PathLike[str], *, mode: str = "async_pinned",
                 keep_last: int | None = None, on_busy: str = "wait", direct_io: bool = True,
                 block_bytes: int = DEFAULT_BLOCK_BYTES, storage: Storage | None = None):
        self.config = CheckpointerConfig(mode=mode, keep_last=keep_last, on_busy=on_busy,
                                         direct_io=direct_io, block_bytes=block_bytes)
        self.directory = Path(directory)
        self.storage: Storage = storage or LocalStorage()
        self.storage.makedirs(self.directory)
        self._lock = DirectoryLock(self.directory)
        self._writer: BackgroundWriter | None = None
        self._arena: HostArena | None = None
        self._plan: WritePlan | None = None
        self._arena_header_for: WritePlan | None = None  # whose header the arena holds
        self._cleaned = False
        self._pending: CheckpointFuture | None = None
        self._closed = False

    # --- saving --------------------------------------------------------------------------

    def save_async(self, state: Any, step: int, *, overlap: bool = False,
                   metadata: Mapping[str, str] | None = None) -> CheckpointFuture:
        """Stage ``state`` into the host arena and write it in the background.

        Returns once the tensors are copied (with ``overlap=True``, at once: then call
        ``fut.wait_staged()`` before mutating the tensors, e.g. before
        ``optimizer.step()``). The future completes when the checkpoint is committed.

        Raises:
            CheckpointInFlightError: a save is in flight and ``on_busy="error"``.
            CheckpointExistsError: ``step`` is already committed.
            UnsupportedLeafError: the state holds a value that cannot be saved.
        """
        started = time.perf_counter()
        self._check_open()
        if type(step) is not int or step < 0:
            raise CheckpointConfigError(f"step={step!r}: use a non-negative int")
        self._wait_for_previous()
        self._take_lock()
        if step in self.steps():
            raise CheckpointExistsError(
                f"step {step} is already committed under {self.directory}; save under a new "
                "step number")
        flat = flatten(state)
        plan = self._plan_for(flat)
        arena = self._arena_for(plan)
        progress = StagingProgress()
        job = SaveJob(
            root=self.directory, step=step, plan=plan, arena=arena, progress=progress,
            kinds=dict(flat.kinds), skeleton=flat.skeleton, storage=self.storage,
            keep_last=self.config.keep_last, block_bytes=self.config.block_bytes,
            library_version=_version(), user_metadata=dict(metadata or {}),
            direct_io=self.config.direct_io, started=started)
        writer = self._ensure_writer()
        durable = writer.submit(job)  # follows the staging progress
        staged: cf.Future[None]
        if overlap and self.config.mode != "sync":
            staged = writer.stager.submit(_stage_or_fail, plan, flat, arena, progress)
        else:
            staged = cf.Future()
            try:
                _stage_or_fail(plan, flat, arena, progress)
            except BaseException as exc:
                staged.set_exception(exc)
                with contextlib.suppress(BaseException):
                    durable.result()
                raise
            staged.set_result(None)
        job.blocked_s = time.perf_counter() - started
        fut = CheckpointFuture(step, durable, staged)
        self._pending = fut
        if self.config.mode == "sync":
            fut.wait()
        log.debug("step=%d save_async returned after %.3fs", step, job.blocked_s)
        return fut

    def save(self, state: Any, step: int, *, metadata: Mapping[str, str] | None = None
             ) -> CheckpointInfo:
        """Save synchronously: return once the checkpoint is committed."""
        return self.save_async(state, step, metadata=metadata).wait()

    def wait(self, timeout: float | None = None) -> CheckpointInfo | None:
        """Wait for the save in flight (if any); re-raise its error."""
        fut = self._pending
        if fut is None:
            return None
        info = fut.wait(timeout)
        if self._pending is fut:
            self._pending = None
        return info

    @property
    def is_pending(self) -> bool:
        """True while a save is staging or writing."""
        return self._pending is not None and not self._pending.done()

    # --- discovering and loading ---------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, oldest first."""
        return commit.committed_steps(self.directory, self.storage)

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def manifest(self, step: int | None = None) -> Manifest:
        """The manifest of ``step`` (latest when None)."""
        step_dir, _ = commit.resolve_step_dir(self.directory, step, self.storage)
        return read_manifest(step_dir, self.storage)

    def load(self, state: Any = None, *, step: int | None = None, strict: bool = True,
             verify: bool = True) -> Any:
        """Load a committed checkpoint (latest when ``step`` is None).

        With ``state``, tensors are read into the existing tensors in place (identity
        kept), stateful objects get ``load_state_dict``, and the tree is returned.
        Without it, a plain tree of fresh CPU tensors is returned.

        Raises:
            CheckpointNotFoundError: nothing committed (or no such step).
            CheckpointCorruptError: a checksum or the format does not match; names file
                and tensor. Targets loaded in place may then hold partial data.
            StateMismatchError: keys missing or unexpected (unless ``strict=False``), or
                shapes/dtypes that differ.
        """
        step_dir, _ = commit.resolve_step_dir(self.directory, step, self.storage)
        return load_from(step_dir, state, self.storage, strict=strict, verify=verify)

    # --- lifecycle -----------------------------------------------------------------------

    def close(self) -> None:
        """Wait for the save in flight, then release threads, memory and the lock."""
        if self._closed:
            return
        try:
            if self._pending is not None and not self._pending.done():
                with contextlib.suppress(Exception):
                    self._pending.wait()
        finally:
            self._closed = True
            if self._writer is not None:
                self._writer.shutdown()
                self._writer = None
            self._arena = None
            self._lock.release()

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    # --- internals -----------------------------------------------------------------------

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
        self._pending = None
        # A failure of the previous save was the previous future's to report; it does
        # not stop this save (the arena is free again either way).
        with contextlib.suppress(Exception):
            fut.wait()

    def _take_lock(self) -> None:
        if self._lock.acquire():
            if not self._cleaned:
                commit.cleanup_abandoned(self.directory, self.storage)
                self._cleaned = True
            return
        raise CheckpointLockedError(
            f"another process (pid {self._lock.holder()}) is saving into {self.directory}; "
            "use a different directory or stop the other process")

    def _plan_for(self, flat: FlatState) -> WritePlan:
        if self._plan is not None and self._plan.signature == layout_signature(flat.tensors):
            return self._plan
        self._plan = plan_writes(flat.tensors, shard_file_name(0),
                                 {"asyncckpt_format": "1"})
        return self._plan

    def _arena_for(self, plan: WritePlan) -> HostArena:
        need = plan.padded_bytes
        pinned = self.config.mode == "async_pinned"
        if self._arena is None or self._arena.nbytes < need or self._arena.pinned != (
                pinned and torch.cuda.is_available()):
            self._arena = None  # drop the old one first: never hold two at once
            self._arena = HostArena(need, pinned=pinned)
            self._arena_header_for = None
        if self._arena_header_for is not plan:
            self._arena.write_header(plan.header)
            self._arena_header_for = plan
        return self._arena

    def _ensure_writer(self) -> BackgroundWriter:
        if self._writer is None:
            self._writer = BackgroundWriter()
        return self._writer


def _stage_or_fail(plan: WritePlan, flat: FlatState, arena: HostArena,
                   progress: StagingProgress) -> None:
    try:
        stage(plan, flat.tensors, arena, progress)
    except BaseException as exc:
        progress.fail(exc)
        raise


def _version() -> str:
    from . import __version__

    return __version__


def load_from(step_dir: Path, state: Any, storage: Storage, *, strict: bool = True,
              verify: bool = True) -> Any:
    """Load the checkpoint in ``step_dir`` (see :meth:`AsyncCheckpointer.load`)."""
    manifest = read_manifest(step_dir, storage)
    saved = {p: n["key"] for p, n in iter_array_nodes(manifest.skeleton)}
    if state is None:
        loaded = load_tensors(step_dir, manifest, dict.fromkeys(manifest.tensors), storage,
                              verify=verify)
        return unflatten(manifest.skeleton, loaded)
    target = flatten(state)
    dests = _match(manifest, saved, target, strict, step_dir)
    loaded = load_tensors(step_dir, manifest, {k: v[0] if v else None for k, v in dests.items()},
                          storage, verify=verify)
    with torch.no_grad():
        for key, tensors in dests.items():
            for extra in tensors[1:]:  # saved once (tied), loaded into untied targets
                extra.copy_(loaded[key])
    return restore_into(state, manifest.skeleton, loaded, "", target)


def _match(manifest: Manifest, saved: dict[str, str], target: FlatState, strict: bool,
           step_dir: Path) -> dict[str, list[torch.Tensor]]:
    """Pair saved keys with target tensors; raise StateMismatchError on disagreement."""
    lenient = [p for p, (obj, _) in target.statefuls.items()
               if not isinstance(obj, torch.nn.Module)]

    def passes_through(path: str) -> bool:
        # Optimizers and similar objects create state lazily: what the checkpoint has and
        # the fresh object lacks goes to their load_state_dict as is.
        return any(p == "" or path == p or path.startswith(p + "/") for p in lenient)

    missing = [p for p in target.refs if p not in saved]
    unexpected = [p for p in saved if p not in target.refs and not passes_through(p)]
    mismatched = []
    dests: dict[str, list[torch.Tensor]] = {}
    for path, key in saved.items():
        if path not in target.refs:
            if passes_through(path) or not strict:
                dests.setdefault(key, [])
            continue
        t = target.tensors[target.refs[path]]
        entry = manifest.tensors[key]
        if tuple(t.shape) != entry.shape or t.dtype != entry.dtype:
            mismatched.append(f"{path}: checkpoint {entry.dtype} {list(entry.shape)}, "
                              f"target {t.dtype} {list(t.shape)}")
            continue
        lst = dests.setdefault(key, [])
        if not any(x is t for x in lst):
            lst.append(t)
    if not strict:
        unexpected_skipped = {saved[p] for p in unexpected}
        for k in unexpected_skipped:
            if not dests.get(k):
                dests.pop(k, None)
        missing, unexpected = [], []
    if missing or unexpected or mismatched:
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {_few(missing)}")
        if unexpected:
            parts.append(f"in the checkpoint but not in the target: {_few(unexpected)}")
        if mismatched:
            parts.append(f"shape/dtype mismatch: {_few(mismatched)}")
        hint = " (pass strict=False to skip missing and unexpected keys)" if (
            missing or unexpected) else ""
        raise StateMismatchError(f"cannot load {step_dir} into the given state: "
                                 + "; ".join(parts) + hint,
                                 missing=missing, unexpected=unexpected, mismatched=mismatched)
    return dests


def _few(items: list[str], n: int = 8) -> str:
    more = f" and {len(items) - n} more" if len(items) > n else ""
    return ", ".join(items[:n]) + more
