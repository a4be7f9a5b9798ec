"""Loading a committed checkpoint into a state tree: match keys, read boxes, restore.

Each target tensor names the box it wants (the whole tensor, or a DTensor's or
declared shard's box), and the reader fetches exactly that from whichever saved
chunks intersect it: the world size or layout it was saved with does not matter.
"""

from __future__ import annotations

import ast
import bisect
import contextlib
import contextvars
import copy
import dataclasses
import fnmatch
import functools
import logging
import math
import operator
import os
import re
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from ._gc import gc_paused
from .errors import (
    CheckpointConfigError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    StateMismatchError,
    few,
    retold,
)
from .manifest import MANIFEST_NAME, Manifest, TensorEntry
from .reader import (
    copy_into,
    load_tensors,
    narrow_to_box,
    out_of_range,
    read_manifest,
    went,
)
from .storage import LocalStorage, ReadStorage
from .tree import (
    ARRAY_NODES,
    Box,
    FlatState,
    _group_size,
    escape_key,
    excluded_here,
    flatten,
    is_copied,
    iter_array_nodes,
    join_path,
    loads_fresh,
    restore_into,
    takes_whole_state,
    unescape_path,
    unflatten,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardMetadata:
    """How a plain tensor is sharded by hand: the global shape and this rank's offsets.

    Pass ``shards={"model/w": ShardMetadata(global_shape=(1024, 512), offsets=(512, 0))}``
    to ``save_async`` and ``load``; the local tensor's shape gives the box's lengths.
    """

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        # (checked where it is written: a trial's ShardMetadata((-4,), (0, 0)) was made
        # without a word, and refused only by the save it was passed to)
        gs = _whole_numbers(self.global_shape, "ShardMetadata's global_shape")
        offs = _whole_numbers(self.offsets, "ShardMetadata's offsets")
        if len(gs) != len(offs):
            raise CheckpointConfigError(
                f"ShardMetadata(global_shape={list(gs)}, offsets={list(offs)}): give one "
                "offset per dimension of the global shape")
        if any(v < 0 for v in (*gs, *offs)):
            raise CheckpointConfigError(
                f"ShardMetadata(global_shape={list(gs)}, offsets={list(offs)}): sizes and "
                "offsets are never negative")
        object.__setattr__(self, "global_shape", gs)
        object.__setattr__(self, "offsets", offs)


# Set while a fallback load matches an older step only to learn what it would fill
# (_Rollback._filled_by): what that match finds is said by the load of that step, if any.
_QUIET: contextvars.ContextVar[bool] = contextvars.ContextVar("asyncckpt_quiet", default=False)
# Set by a transport's receive, whose caller (torchft's Manager) hands the tree to the
# objects' load_state_dict as its protocol says: state_dict() copies are what it loads.
COPIES_EXPECTED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "asyncckpt_copies_expected", default=False)


def _say(msg: str, *args: Any) -> None:
    """A warning about the load being matched (not said in a trial match: see _QUIET)."""
    if not _QUIET.get():
        log.warning(msg, *args)


def apply_shards(flat: FlatState, shards: Mapping[str, ShardMetadata] | None) -> None:
    """Record the declared boxes of hand-sharded tensors (keys are leaf paths)."""
    for path, meta in (shards or {}).items():
        key = flat.refs.get(path)
        if key is None:
            raise CheckpointConfigError(f"shards names {path!r}, which is no tensor of the state")
        local = flat.tensors[key]
        if not isinstance(meta, ShardMetadata):
            raise CheckpointConfigError(
                f"shards[{path!r}] is {meta!r:.80}: pass asyncckpt.ShardMetadata("
                "global_shape=..., offsets=...)")
        gs, offs = meta.global_shape, meta.offsets  # (whole numbers: its __post_init__)
        lens = tuple(local.shape)
        for name, values in (("global_shape", gs), ("offsets", offs)):
            if len(values) != local.dim():
                raise CheckpointConfigError(
                    f"shards[{path!r}].{name} is {list(values)}: {len(values)} "
                    f"number{'s' if len(values) != 1 else ''} for a {local.dim()}-dimensional "
                    f"local tensor of shape {list(lens)}; give one per dimension")
        if any(
                o < 0 or o + n > g for o, n, g in zip(offs, lens, gs, strict=True)):
            raise CheckpointConfigError(
                f"shards[{path!r}]: a local tensor of shape {list(lens)} at offsets {list(offs)} "
                f"does not fit in global shape {list(gs)}")
        flat.boxes[key] = (gs, (offs, lens))


def _whole_numbers(values: Any, what: str) -> tuple[int, ...]:
    """``values`` as a tuple of ints (numpy ints too); CheckpointConfigError otherwise."""
    try:
        if isinstance(values, (str, bytes)) or any(isinstance(v, bool) for v in values):
            raise TypeError
        return tuple(operator.index(v) for v in values)
    except TypeError:
        raise CheckpointConfigError(f"{what} is {values!r}: use a tuple of whole numbers, "
                                    "one per dimension of the tensor") from None


def check_threads(threads: int | None) -> None:
    """Reject a ``threads=`` argument a load cannot use."""
    if threads is not None and (type(threads) is not int or threads < 1):
        raise CheckpointConfigError(f"threads={threads!r}: use a whole number of 1 or more, or "
                                    "None for the default")


def check_fallback(fallback: bool, step: int | None, verify: bool) -> None:
    """Refuse ``fallback=True`` beside the arguments it would silently override."""
    if fallback and step is not None:
        raise CheckpointConfigError(
            f"fallback=True picks the newest intact step, step={step!r} one step: pass one "
            "of them")
    if fallback and not verify:
        raise CheckpointConfigError(
            "fallback=True verifies every step it reads, to know which is intact: drop "
            "verify=False")


def load_from(step_dir: Path, state: Any, storage: ReadStorage, *, strict: bool = True,
              ignore_unexpected: bool = False, verify: bool = True,
              shards: Mapping[str, ShardMetadata] | None = None,
              threads: int | None = None, step: int | None = None,
              manifest: Manifest | None = None,
              before_read: Callable[[FlatState], None] | None = None,
              progress: Callable[[int, int], None] | None = None,
              exclude: tuple[str, ...] = (), shown: Path | None = None,
              key_map: KeyMap | None = None, cast: bool = False,
              rename_hint: RenameHint | None = None) -> Any:
    """Load the checkpoint in ``step_dir``; see :meth:`AsyncCheckpointer.load`.

    ``step``, when given, is the step the caller asked for: a step directory of another
    step (one copied to a name of the user's choosing, e.g. ``best/``) is refused.
    ``manifest``, when given, is the step's manifest as the caller already parsed it
    from ``storage`` (it is not read again). ``before_read``, when given and ``state``
    is, is called with the flattened target once keys are matched and before any byte
    is read: its ``loaded_in_place`` holds the paths the load is about to fill.
    ``shown``: what errors and the log call the source, when not ``step_dir`` (a file).
    ``cast``: a target tensor of another dtype (see :func:`castable`) gets the saved
    values cast, through a temporary, rather than a mismatch error. A target path the
    checkpoint lacks is not missing when its tensor is tied to (is) one the checkpoint
    fills (an LM's output embedding, tied to its input one).
    """
    # A load makes several small objects per tensor (the parsed manifest, the flattened
    # target, the read plan): with the collector on, the full collections they set off
    # took a third of a 100,000-tensor load. Paused for the whole load, and resumed only
    # once _load_from has returned and those objects are freed, so that resuming sets
    # off no collection of them either (freeing them takes back what they counted).
    started = time.perf_counter()
    read: list[int] = []
    before = _identity(step_dir, storage)
    try:
        with gc_paused():
            out = _load_from(step_dir, state, storage, strict=strict,
                             ignore_unexpected=ignore_unexpected, verify=verify, shards=shards,
                             threads=threads, step=step, manifest=manifest,
                             before_read=before_read, read=read, progress=progress,
                             exclude=exclude, shown=shown, key_map=key_map, cast=cast,
                             rename_hint=rename_hint)
    except CheckpointCorruptError as exc:
        # A step removed and saved anew while it was read (a rollback's
        # discard_steps_after and the save after it, in another process) reads as a
        # checksum mismatch: no damage, and nothing to fall back past or mark.
        now = _identity(step_dir, storage)
        if before is not None and now != before:
            held = ("; the targets loaded in place may hold part of it until then"
                    if state is not None else "")
            what = ("deleted while it was being read (by retention or another process)"
                    if now == (0, 0) else "replaced while it was being read (removed and "
                    "saved again, by a rollback in another process)")
            raise went(CheckpointNotFoundError(
                f"{step_dir} was {what}: load it again{held} ({exc})")) from exc
        raise
    seconds = time.perf_counter() - started
    gb = sum(read) / 1e9
    log.info("loaded %s %s: %.3f GB of saved chunks in %.3fs (%.2f GB/s)%s",
             shown or step_dir, "in place" if state is not None else "as a new tree", gb, seconds,
             gb / seconds if seconds > 0 else 0.0, "" if verify else ", checksums not checked")
    return out


LATEST_TRIES = 3
"""Loads of "the latest step" (outside a group, without fallback): another process's
retention or rollback may take the step read meanwhile; the newer latest is loaded."""


def _identity(step_dir: Path, storage: ReadStorage) -> tuple[int, int] | None:
    """(device, inode) of a local step directory, to tell it was replaced; None where
    there is none to compare (another storage, or it is gone)."""
    if not isinstance(storage, LocalStorage):
        return None
    try:
        st = os.stat(step_dir)
    except OSError:
        return (0, 0)  # (gone: differs from any directory there was)
    return st.st_dev, st.st_ino


def _load_from(step_dir: Path, state: Any, storage: ReadStorage, *, strict: bool,
               verify: bool, shards: Mapping[str, ShardMetadata] | None,
               threads: int | None, step: int | None = None,
               manifest: Manifest | None = None,
               before_read: Callable[[FlatState], None] | None = None,
               read: list[int] | None = None,
               progress: Callable[[int, int], None] | None = None,
               ignore_unexpected: bool = False, exclude: tuple[str, ...] = (),
               shown: Path | None = None, key_map: KeyMap | None = None,
               cast: bool = False,
               rename_hint: RenameHint | None = None) -> Any:
    label = step_dir if shown is None else shown
    if manifest is None:
        manifest = read_manifest(step_dir, storage)
    if step is not None and manifest.step != step:
        raise CheckpointNotFoundError(
            f"{step_dir} holds the checkpoint of step {manifest.step}, not of step {step}; "
            "drop the step, or pass the directory that holds the step directories")
    if state is None:
        manifest = selected(manifest, key_map, exclude)
        _refuse_absent(manifest, label)
        loaded = load_tensors(step_dir, manifest, dict.fromkeys(manifest.tensors), storage,
                              verify=verify, threads=threads, read=read, progress=progress)
        return unflatten(manifest.skeleton, loaded)
    target = flatten(state, target=True, exclude=exclude)
    manifest = selected_for(manifest, key_map, exclude, target)
    apply_shards(target, _without_excluded_shards(shards, target))
    # The usual load in place: the target is the very tree that was saved (the same
    # skeleton, so the same paths naming the same keys), and what the checkpoint holds
    # by path is what the target's flattening found; otherwise it is read off the
    # checkpoint's skeleton (~1 us a tensor: 0.1 s of a load of 100,000).
    same_tree = manifest.skeleton == target.skeleton
    saved = target.refs if same_tree else saved_paths(manifest)
    spans: dict[int, _Span | None] = {}
    casts: set[str] | None = set() if cast else None
    dests, boxes, regions = _match(manifest, saved, target, strict, label, spans,
                                   ignore_unexpected=ignore_unexpected, same_tree=same_tree,
                                   casts=casts, rename_hint=rename_hint)
    if before_read is not None:
        before_read(target)
    # numpy targets whose tensor is a contiguous copy (negative strides), by that tensor
    copies = {id(target.tensors[k]): a for k, a in target.arrays.items() if is_copied(a)}
    staged = _sharing_memory(dests, copies, spans)
    unsaid: list[list[str]] = []  # sharing told once the values are read (see below)
    if staged:
        # (saved tensors of one content, their checksums say, into one target: no matter
        # which wins; a trial's untied model saved and loaded into a tied one was warned)
        # by the view they share (tied pairs: an embedding's, a position table's...)
        for group in _by_view(staged, dests):
            one_view = len({_view_of(t) for k in group for t in dests[k]}) == 1  # (tied)
            sums = {bool(c.checksums) for k in group for c in manifest.tensors[k].chunks}
            alike = sums == {True} and one_view and len(
                {_content(manifest.tensors[k]) for k in group}) == 1
            if one_view and not alike and True not in sums:
                unsaid.append(group)  # (no checksums, a safetensors file's: once read)
            else:
                _say_shared(label, group, alike, one_view)
    # Read into a temporary, then copied into each target: targets sharing memory, and a
    # cast key's several (tied) targets, each cast from the saved values. A cast key's
    # one target is read into as usual: the reader casts each piece as it comes.
    through = set(staged)
    if casts:
        through |= {k for k in casts if len(dests.get(k, ())) > 1}
    loaded = load_tensors(step_dir, manifest,
                          {k: v[0] if v and k not in through and k not in regions else None
                           for k, v in dests.items()},
                          storage, verify=verify, boxes=boxes, threads=threads, read=read,
                          progress=progress,
                          casts=casts - through - regions.keys() if casts else frozenset())
    for group in unsaid:  # (a file's tied weights written twice: the same bytes, mostly)
        first = loaded[group[0]]
        _say_shared(label, group, all(
            loaded[k].dtype == first.dtype and loaded[k].shape == first.shape
            and torch.equal(loaded[k].view(-1).view(torch.uint8),
                            first.view(-1).view(torch.uint8)) for k in group[1:]))
    for key, tensors in dests.items():  # in checkpoint order
        if len(tensors) < 2 and not copies and key not in through:
            continue  # the usual target: filled by the read itself
        try:
            if key in regions:  # targets wanting different parts of it: each gets its own
                for t, box in zip(tensors, regions[key], strict=True):
                    copy_into(t, loaded[key] if box is None else narrow_to_box(loaded[key], box),
                              key)
            else:  # extra targets: saved once (tied), loaded into untied targets
                for t in tensors if key in through else tensors[1:]:
                    copy_into(t, loaded[key], key)
            for t in tensors:  # (numpy arrays filled through a copy get it written back)
                arr = copies.get(id(t))
                if arr is not None:
                    np.copyto(arr, t.numpy())
        except (RuntimeError, ValueError) as exc:  # a target torch or numpy cannot write
            raise StateMismatchError(
                f"loading {label}: copying saved tensor {key!r} into its target failed: "
                f"{exc}; targets loaded before it hold the checkpoint's values",
                mismatched=[key]) from exc
    target.skip_extra = ignore_unexpected or not strict
    return restore_into(state, manifest.skeleton, loaded, "", target)


def _by_view(staged: list[str], dests: Mapping[str, list[torch.Tensor]]) -> list[list[str]]:
    """``staged`` in groups of the keys whose targets are one view (one tied tensor); a key
    whose targets overlap others otherwise, in one group of the rest."""
    groups: dict[Any, list[str]] = {}
    for k in staged:
        views = {_view_of(t) for t in dests[k]}
        groups.setdefault(next(iter(views)) if len(views) == 1 else None, []).append(k)
    rest = groups.pop(None, [])
    out = [g for g in groups.values() if len(g) > 1]
    rest += [k for g in groups.values() if len(g) == 1 for k in g]
    return out + ([rest] if rest else [])


def _say_shared(label: Path, staged: list[str], alike: bool, one_view: bool = True) -> None:
    # (a trial's untied file into a tied model: which one won, and how to choose, untold;
    # named where the targets are one view, whose last copy is all of it)
    (log.info if alike else log.warning)(
        "loading %s: the target tensors of saved tensors %s share memory; each is "
        "read into a temporary and copied in checkpoint order, so the last one wins%s",
        label, few(staged), " (they hold the same values)" if alike else (
            f" ({staged[-1]!r}, whose values differ from the others'): to keep another, "
            "leave the rest out with key_map= returning None for them") if one_view
        else " where they overlap")


def load_reusing(step_dir: Path, reuse: Any, storage: ReadStorage, *,
                 manifest: Manifest | None = None, verify: bool = True,
                 threads: int | None = None, exclude: tuple[str, ...] = (),
                 key_map: KeyMap | None = None) -> Any:
    """The checkpoint as a fresh tree (as ``load_from`` with no state), whose tensors are
    those of ``reuse`` wherever ``reuse`` holds one at the same path with the same shape
    and dtype, filled in place, and new tensors elsewhere (what torchft's transports do
    with their ``state_dict`` callable). Nothing else of ``reuse`` is changed: no
    load_state_dict is called, no dict updated, and mismatches are no error. Tensors
    sharing memory, read-only ones and shards (DTensors) are not reused.

    As torchft's transports, the writes leave autograd's version counters alone: its
    Manager receives on its own thread while the training thread may be computing a step
    (which a healing replica throws away), and a bumped counter would fail that step's
    backward instead. ``exclude``: parts of the checkpoint left out (not read, not
    returned), and ``key_map``, as for ``load_from``.
    """
    started = time.perf_counter()
    read: list[int] = []
    with gc_paused():
        if manifest is None:
            manifest = read_manifest(step_dir, storage)
        manifest = selected(manifest, key_map, exclude)
        _refuse_absent(manifest, step_dir)
        target = flatten(reuse, target=True)
        chosen: dict[str, list[torch.Tensor]] = {}
        spans: dict[int, _Span | None] = {}
        writable = _WritableMemory()
        for path, key in saved_paths(manifest).items():
            tkey = target.refs.get(path)
            if tkey is None or key in chosen or tkey in target.boxes or tkey in target.arrays:
                continue
            t, entry = target.tensors[tkey], manifest.tensors[key]
            if t.shape != entry.shape or t.dtype != entry.dtype:
                continue
            if _unfillable(t, writable, spans) is None:
                chosen[key] = [t]
        for key in _sharing_memory(chosen, {}, spans):
            del chosen[key]  # (one memory, two keys: each gets tensors of its own)
        loaded = load_tensors(step_dir, manifest,
                              {k: chosen[k][0] if k in chosen else None
                               for k in manifest.tensors},
                              storage, verify=verify, threads=threads, read=read,
                              bump_versions=False)
        out = unflatten(manifest.skeleton, loaded)
    seconds = time.perf_counter() - started
    log.info("loaded %s into %d of its %d tensors in place, the rest new: %.3f GB in %.3fs",
             step_dir, len(chosen), len(manifest.tensors), sum(read) / 1e9, seconds)
    return out


def load_newest_intact(root: Path, state: Any, storage: ReadStorage, *, strict: bool = True,
                       ignore_unexpected: bool = False,
                       shards: Mapping[str, ShardMetadata] | None = None,
                       threads: int | None = None, agree: Agreement | None = None,
                       progress: Callable[[int, int], None] | None = None,
                       exclude: tuple[str, ...] = (), key_map: KeyMap | None = None,
                       cast: bool = False, damaged: list[tuple[int, str]] | None = None
                       ) -> Any:
    """Load the newest committed step that verifies, newest first.

    ``damaged``, when given, gets the steps tried and found corrupt (on any rank of a
    group), newest first, each with what was found.

    ``agree`` (a group's): each step's verdict is the group's, so that every rank ends
    on the same step even when only one rank's boxes are damaged. ``progress``: as for
    ``load_from``, for each step tried (it starts again from 0 at an older step).

    Raises CheckpointCorruptError listing every step that failed when none is intact.
    """
    if agree is None:
        return _newest_intact(root, state, storage, strict, shards, threads, None, progress,
                              ignore_unexpected, exclude=exclude, key_map=key_map, cast=cast,
                              damaged=damaged)
    # Whatever ends this rank's load without a verdict of the group (no step to try, a
    # listing that fails, every step damaged here while another rank has more) is told
    # to the others at the attempt they wait on: they stop with it instead of timing out.
    told = _Told(agree)
    try:
        return _newest_intact(root, state, storage, strict, shards, threads, told, progress,
                              ignore_unexpected, exclude=exclude, key_map=key_map, cast=cast,
                              damaged=damaged)
    except BaseException as exc:
        if not told.done:
            with contextlib.suppress(Exception):
                agree(told.attempt, None, f"{type(exc).__name__}: {exc}", failed=True)
        raise


class _Told:
    """An Agreement that remembers the attempt a rank owes a verdict for, and whether
    the exception now raised already came from (or was told to) the group."""

    def __init__(self, agree: Agreement) -> None:
        self.agree, self.attempt, self.done = agree, 0, False

    @property
    def rank(self) -> int:
        return self.agree.rank

    def __call__(self, attempt: int, step: int | None, problem: str | None,
                 failed: bool = False, gone: bool = False,
                 maybe_intact: bool = False) -> list[Finding]:
        self.attempt, self.done = attempt, True
        others = self.agree(attempt, step, problem, failed, gone, maybe_intact)
        self.attempt, self.done = attempt + 1, False
        return others


# How many times a fallback load lists the steps again when the ones it listed were
# deleted (by a saver's keep_last) while it read them and newer ones were committed.
_RELISTS = 3


def _newest_intact(root: Path, state: Any, storage: ReadStorage, strict: bool,
                   shards: Mapping[str, ShardMetadata] | None, threads: int | None,
                   agree: Agreement | None,
                   progress: Callable[[int, int], None] | None = None,
                   ignore_unexpected: bool = False, relists: int = _RELISTS,
                   earlier: list[str] | None = None, *, exclude: tuple[str, ...] = (),
                   key_map: KeyMap | None = None, cast: bool = False,
                   damaged: list[tuple[int, str]] | None = None) -> Any:
    from . import commit

    if MANIFEST_NAME in commit.list_root(root, storage):
        # A step directory: nothing to fall back to. A save's temporary directory (or a
        # step being deleted) is refused, as a load without fallback refuses it.
        commit.resolve_step_dir(root, None, storage)
        return load_from(root, state, storage, strict=strict, verify=True, shards=shards,
                         threads=threads, progress=progress,
                         ignore_unexpected=ignore_unexpected, exclude=exclude,
                         key_map=key_map, cast=cast)
    steps = commit.committed_steps(root, storage)
    if not steps:
        # raises, saying why; or finds the step a listing raced with a commit missed
        _, latest = commit.resolve_step_dir(root, None, storage)
        steps = commit.committed_steps(root, storage) or ([] if latest is None else [latest])
    failures: list[str] = list(earlier or [])
    deleted = False  # a step listed was gone by the time it was read
    newest_first = steps[::-1]
    # With strict=False an older step may lack tensors a newer one has: what a failed
    # attempt wrote into those must not stay behind as part of the older step's load.
    undo = (_Rollback(root, state, storage, shards, commit.step_dir_name, exclude, key_map,
                      cast)
            if state is not None and not strict and len(steps) > 1 else None)
    for attempt, step in enumerate(newest_first):
        step_dir = root / commit.step_dir_name(step)
        problem: CheckpointError | None = None
        hook = None if undo is None else undo.hook(newest_first[attempt + 1:])
        try:
            result = load_from(step_dir, state, storage, strict=strict, verify=True,
                               shards=shards, threads=threads, before_read=hook,
                               progress=progress, ignore_unexpected=ignore_unexpected,
                               exclude=exclude, key_map=key_map, cast=cast)
        except (CheckpointCorruptError, CheckpointNotFoundError) as exc:
            problem = exc  # damaged, or deleted by retention while it was read
        except CheckpointError as exc:
            # (anything else no fallback answers: load_newest_intact tells the other
            # ranks) Said alone, it would hide why an older step was tried at all, and
            # that the targets hold what the failed steps put there.
            if not failures:
                raise
            raise _after_failures(exc, failures, state) from exc
        try:
            others = [] if agree is None else agree(
                attempt, step, None if problem is None else str(problem),
                gone=isinstance(problem, CheckpointNotFoundError),
                maybe_intact=isinstance(problem, CheckpointCorruptError)
                and problem.maybe_intact)
        except CheckpointError as exc:  # another rank failed: this one read in place already
            if state is None:
                raise
            raise _noted(exc, f"; this rank's targets were loaded in place from step {step}"
                              f"{' and newer steps' if failures else ''} and may hold its "
                              "data: load again before using them") from exc
        if problem is None and not others:
            if undo is not None:
                undo.finish(step)
            return result
        if undo is not None:
            undo.failed(step)
        # A step gone, here or on another rank (deleted while read; on a network
        # filesystem, not yet visible there), is no damage: nothing to mark or keep.
        # (nor what may be no damage: an EIO of an outage, a tensor too large for this
        # machine), on this rank or another (a review: rank 1's EIO had rank 0 mark it)
        corrupt = isinstance(problem, CheckpointCorruptError) and not problem.maybe_intact
        bad = [(o.rank, o.problem) for o in others if not o.gone and not o.maybe_intact]
        if damaged is not None and (corrupt or bad):
            if agree is None:  # (alone: the finding is this process's, no rank to name)
                damaged.append((step, str(problem)))
            else:  # a group's: each rank's finding under its rank, this one's too
                if corrupt:
                    bad.append((agree.rank, str(problem)))
                damaged.append((step, "; ".join(f"rank {r}: {p}" for r, p in sorted(bad))))
        if problem is not None:
            gone = isinstance(problem, CheckpointNotFoundError)
            deleted = deleted or gone
            log.warning("step %d under %s is %s (%s); trying an older step", step, root,
                        "gone" if gone else "corrupt", problem)
            failures.append(f"step {step}: {problem}")
        # (each rank's finding logged once in the job, by rank 0: every rank logging every
        # other's made ranks x ranks lines)
        if others and agree is not None and agree.rank != 0:
            log.warning("step %d under %s: %d other rank(s) could not load it (rank 0 logs "
                        "why); every rank tries an older step", step, root, len(others))
        for r, what, *_ in others:
            if agree is not None and agree.rank == 0:
                log.warning("step %d under %s: rank %d could not load it (%s); every rank "
                            "tries an older step", step, root, r, what)
            failures.append(f"step {step} on rank {r}: {what}")
    if agree is None and relists > 0 and deleted:
        # Retention of another process deleted what was listed, as it committed newer
        # steps: those are the ones to load. (A group's ranks would each list anew: they
        # keep to the steps they agreed on.)
        newer = [s for s in commit.committed_steps(root, storage) if s > newest_first[0]]
        if newer:
            log.warning("steps under %s were deleted while read, and step(s) %s committed "
                        "meanwhile: trying those", root, newer)
            return _newest_intact(root, state, storage, strict, shards, threads, None,
                                  progress, ignore_unexpected, relists - 1, failures,
                                  exclude=exclude, key_map=key_map, cast=cast,
                                  damaged=damaged)
    raise CheckpointCorruptError(f"no intact checkpoint under {root}: " + "; ".join(failures),
                                 path=str(root))


def _after_failures(exc: CheckpointError, failures: list[str], state: Any) -> CheckpointError:
    """``exc`` (of an older step a fallback load tried), saying which newer steps failed
    first and, for a load in place, that the targets may hold their bytes."""
    text = " (this older step was tried because newer ones failed: " + "; ".join(failures)
    if state is not None:
        text += ("; the targets were loaded in place and may hold parts of those steps: "
                 "load again before using them")
    return _noted(exc, text + ")")


def _noted(exc: CheckpointError, text: str) -> CheckpointError:
    """``exc`` with ``text`` added to its message (its type and fields kept)."""
    return retold(exc, f"{exc}{text}")


class _Rollback:
    """Puts back, after a fallback load with ``strict=False``, what failed attempts
    wrote into target tensors that the step finally loaded has no values for.

    Before each attempt it copies the targets the attempt is about to fill that the
    next older step (the next readable one) would not fill: only those can be left
    holding a failed step's bytes, and they are usually few or none (a tensor added in
    a newer step). A target written by two failed attempts in a row that the step
    loaded lacks has no copy of its own value left: that is an error naming it.
    """

    def __init__(self, root: Path, state: Any, storage: ReadStorage,
                 shards: Mapping[str, ShardMetadata] | None,
                 step_dir_name: Callable[[int], str], exclude: tuple[str, ...] = (),
                 key_map: KeyMap | None = None, cast: bool = False):
        self.root, self.state, self.storage, self.shards = root, state, storage, shards
        self.step_dir_name, self.exclude, self.key_map = step_dir_name, exclude, key_map
        self.cast = cast
        self.kept: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # path: (target, copy)
        self.spoilt: dict[str, int] = {}  # path: the failed step whose bytes it holds
        self.filling: set[str] = set()  # the paths the current attempt fills

    def hook(self, older: list[int]) -> Callable[[FlatState], None]:
        def before_read(target: FlatState) -> None:
            self.filling = set(target.loaded_in_place)
            covered = self._filled_by(older)
            for path in self.filling:
                if path in self.kept or path in self.spoilt or (
                        covered is None or path in covered):
                    continue
                key = target.refs[path]
                arr = target.arrays.get(key)
                if arr is not None and is_copied(arr):
                    continue  # written back into its array only when a load succeeds
                t = target.tensors[key]
                self.kept[path] = (t, t.detach().clone())
        return before_read

    def _filled_by(self, older: list[int]) -> set[str] | None:
        """The paths the next older step that can be matched would fill; None: no such
        step can be loaded (the fallback fails, nothing needs putting back)."""
        for step in older:
            step_dir = self.root / self.step_dir_name(step)
            with gc_paused():
                target = flatten(self.state, target=True, exclude=self.exclude)
            token = _QUIET.set(True)
            try:
                manifest = selected_for(read_manifest(step_dir, self.storage),
                                        self.key_map, self.exclude, target)
            except CheckpointError:
                continue  # its attempt fails too: the next older one decides
            finally:
                _QUIET.reset(token)
            saved = saved_paths(manifest)
            with gc_paused():
                apply_shards(target, _without_excluded_shards(self.shards, target))
                token = _QUIET.set(True)
                try:
                    _match(manifest, saved, target, False, step_dir,
                           casts=set() if self.cast else None)
                except StateMismatchError:
                    return None  # its attempt raises this and the load stops there
                finally:
                    _QUIET.reset(token)
            return target.loaded_in_place
        return None

    def failed(self, step: int) -> None:
        for path in self.filling:
            if path not in self.kept:
                self.spoilt[path] = step  # (the last attempt to fill it)

    def finish(self, step: int) -> None:
        with torch.no_grad():
            for path, (t, copy) in self.kept.items():
                if path not in self.filling:
                    t.copy_(copy)
        left = {p: s for p, s in self.spoilt.items() if p not in self.filling}
        if left:
            raise CheckpointCorruptError(
                f"loading {self.root} with fallback=True and strict=False: step {step} "
                f"loaded, but the targets {few(sorted(left))} hold what the failed attempts "
                f"at steps {sorted(set(left.values()))} read into them and step {step} has "
                "no values for them; their own values are lost: set them again",
                path=str(self.root))


class Finding(NamedTuple):
    """Another rank's verdict on a step it could not load (see Agreement): what it found,
    and whether the step was gone there (not found: deleted, or not yet visible on that
    rank's view of a network filesystem) rather than damaged, or may be intact (an EIO
    of a network mount's outage, a tensor too large for that rank's memory: the load
    goes past the step, and nothing marks it)."""

    rank: int
    problem: str
    gone: bool = False
    maybe_intact: bool = False


class Agreement(Protocol):
    """A group's verdict on one step of a fallback load (see dist.FallbackAgreement)."""

    @property
    def rank(self) -> int: ...  # this rank

    def __call__(self, attempt: int, step: int | None, problem: str | None,
                 failed: bool = False, gone: bool = False,
                 maybe_intact: bool = False) -> list[Finding]: ...


# --- exclude=: parts of the state a load leaves alone, on both sides ------------------------

_GLOB = re.compile(r"[*?\[]")  # (what makes an exclude= path a shell pattern)


def check_exclude(exclude: object) -> tuple[str, ...]:
    """``exclude`` (paths of the state, ``"dataloader"`` or ``"train/loader"``, as the
    checkpoint names them) as a tuple; CheckpointConfigError for anything else."""
    if exclude is None:
        return ()
    if isinstance(exclude, str):  # (iterated, a string would exclude its letters)
        exclude = (exclude,)
    if not isinstance(exclude, Iterable):
        raise CheckpointConfigError(f"exclude={exclude!r:.80}: pass paths of the state, e.g. "
                                    "exclude=['dataloader', 'lr_scheduler']")
    paths = []
    for p in exclude:
        if not isinstance(p, str) or not p.strip("/"):
            raise CheckpointConfigError(
                f"exclude: {p!r:.80} is no path of the state; pass str paths such as "
                "'dataloader' or 'train/loader' (the names 'asyncckpt inspect' lists)")
        paths.append(p.strip("/"))
    return tuple(dict.fromkeys(paths))


def is_excluded(path: str, exclude: tuple[str, ...]) -> bool:
    """Whether ``path`` is an excluded one or lies below one (see also excluded_here:
    a name that goes on with a ``.``, as a module's submodule's keys do)."""
    return any(path == e or path.startswith(f"{e}/") for e in exclude)


def _below(path: str, exclude: tuple[str, ...]) -> str | None:
    """An excluded path that lies strictly below ``path`` (None: none does)."""
    return next((e for e in exclude if e.startswith(f"{path}/" if path else "") and e != path),
                None)


def check_target(state: Any) -> None:
    """Refuse a target that can be no state tree: a number is a step passed where the
    state goes (``ckpt.load(9)``, which compared 9 with the checkpoint's whole tree), a
    string or path a source passed twice."""
    if isinstance(state, (bool, str, bytes, os.PathLike, int, float, np.generic)):
        if not isinstance(state, bool) and isinstance(state, (int, np.integer)):
            hint = f"to load step {int(state)}, pass step={int(state)}"
        elif isinstance(state, (str, os.PathLike)):
            hint = ("a source (a path, a peer's address) goes first, as in asyncckpt.load("
                    "source, state), or to AsyncCheckpointer(directory)")
        else:
            hint = "pass the state tree to load into (a dict of modules, tensors...) or None"
        raise CheckpointConfigError(
            f"state={state!r:.80} is no state tree to load into: {hint}")


def excluded_view(state: Any, exclude: tuple[str, ...],
                  shards: Mapping[str, ShardMetadata] | None = None
                  ) -> tuple[Any, Mapping[str, ShardMetadata] | None, Callable[[Any], Any]]:
    """``state`` checked for its ``exclude`` parts, to load into; ``shards`` without those
    of the excluded parts (the shards a save got: those are moot); and the function that
    gives what a load of it returns.

    The parts are left out where the target is flattened (``flatten(..., exclude=)``):
    not matched, not filled, not restored, their objects' load_state_dict not called.
    An excluded path must run through plain dicts and modules (a module's
    load_state_dict gets its own tensors there): a part of an optimizer's or another
    object's state loads with the whole of it, and a list's items go together."""
    check_target(state)
    if not exclude or state is None:
        return state, shards, _as_loaded
    if shards:
        shards = {p: m for p, m in shards.items() if not is_excluded(p, exclude)}
    if isinstance(state, torch.nn.Module) and not loads_fresh(state):
        return state, shards, _as_loaded  # (its keys: exclude=["head"], as load_safetensors
        # into a model is called; its flattening leaves them out)
    if not isinstance(state, dict):
        raise CheckpointConfigError(
            f"exclude= needs a state that is a plain dict (of its parts) or a module, not a "
            f"{type(state).__name__}: pass e.g. {{'model': model, 'dataloader': loader}}")

    def check(d: dict[Any, Any], path: str) -> None:
        for k, v in d.items():
            p = join_path(path, k)
            below = None if is_excluded(p, exclude) else _below(p, exclude)
            if below is None or (isinstance(v, torch.nn.Module) and not loads_fresh(v)):
                continue
            if not isinstance(v, dict):
                raise CheckpointConfigError(
                    f"exclude {below!r} lies inside {p!r}, "
                    f"{'an' if type(v).__name__[:1] in 'AEIOU' else 'a'} {type(v).__name__}: "
                    "exclude= looks into plain dicts and modules only (an optimizer's "
                    "or another object's state loads as a whole); exclude all of it, or "
                    "leave the part in (strict=False skips what the checkpoint lacks)")
            check(v, p)

    check(state, "")
    return state, shards, _as_loaded


def _as_loaded(restored: Any) -> Any:
    return restored


def selected_for(manifest: Manifest, key_map: KeyMap | None, exclude: tuple[str, ...],
                 target: FlatState) -> Manifest:
    """``selected`` for a load into ``target`` (flattened with ``exclude``): both sides
    leave out the same paths, what either found (a submodule's dotted keys are found on
    the side that holds a module: a target module and a checkpoint's plain dict of its
    keys, or the other way round, leave out the same tensors)."""
    dropped: list[str] = []
    manifest = selected(manifest, key_map, exclude, target.excluded, dropped)
    more = [p for p in dropped if p not in target.excluded]
    if more:  # (the checkpoint's module named them: the target's plain dict leaves them out)
        gone = tuple(more)
        named = set(more)
        for path in [p for p in target.refs if _under(p, named)]:
            del target.refs[path]
        target.skeleton = pruned(target.skeleton, gone, "the target", dotted=False)
        target.excluded += more
    return manifest


def selected(manifest: Manifest, key_map: KeyMap | None, exclude: tuple[str, ...],
             also: Sequence[str] = (), dropped: list[str] | None = None) -> Manifest:
    """``manifest`` as a load sees it: its tensors renamed by ``key_map``, then (by those
    names, as the target has them) without its ``exclude`` parts, nor the paths ``also``
    (what the target's flattening left out of its modules for them: ``model/head``'s
    ``model/head.weight``, left out here whatever the checkpoint's ``model`` is)."""
    return without_excluded(renamed(manifest, key_map), exclude, also, dropped)


def _with_skeleton(manifest: Manifest, skeleton: dict[str, Any]) -> Manifest:
    """``manifest`` with ``skeleton``, and only the tensors that skeleton still holds."""
    kept = {n["key"] for _, n in iter_array_nodes(skeleton)}
    return dataclasses.replace(manifest, skeleton=skeleton, pruned=True, tensors={
        k: v for k, v in manifest.tensors.items() if k in kept})


def without_excluded(manifest: Manifest, exclude: tuple[str, ...],
                     also: Sequence[str] = (), dropped: list[str] | None = None) -> Manifest:
    """``manifest`` without the ``exclude`` parts of its state, nor the paths ``also``
    (not told of when the checkpoint lacks them): not read, not matched, not restored.
    ``dropped`` receives the paths left out."""
    if not exclude:
        return manifest

    skeleton = pruned(manifest.skeleton, tuple(dict.fromkeys((*exclude, *also))),
                      "the checkpoint", dropped=dropped)
    unmatched = [e for e in exclude if not _names_a_part(manifest.skeleton, e)]
    # (a part the target holds and the checkpoint lacks is what exclude= is for, a new
    # head: not warned of, once per load and rank, on every run; a typo is)
    mine = [e for e in unmatched
            if any(a == e or a.startswith((f"{e}/", f"{e}.")) for a in also)]
    patterns = [e for e in unmatched if e not in mine and _GLOB.search(e)]
    if patterns:
        # (a fine-tuning trial's exclude=['model/*lora*'] was warned of, and the adapters
        # it meant to keep were overwritten)
        # (the outermost part each pattern names, of the checkpoint's tensors and the
        # target's own: a submodule, an optimizer as a whole; a trial's "model/blocks.?"
        # matched no tensor path, and "opt*" was told the moments inside the optimizer)
        matched: dict[str, None] = {}
        for p in [*(q for q, _ in iter_array_nodes(manifest.skeleton)), *also]:
            cuts = [i for i, ch in enumerate(p) if ch in "/."] + [len(p)]
            for i in cuts:
                if p[:i] in matched:
                    break
                if any(fnmatch.fnmatchcase(p[:i], e) for e in patterns):
                    matched[p[:i]] = None
                    break
        names = [m for m in matched if not any(
            m.startswith((f"{o}/", f"{o}.")) for o in matched if o != m)]
        raise CheckpointConfigError(
            f"exclude={list(patterns)!r}: exclude= takes paths, not patterns, and the "
            f"checkpoint of step {manifest.step} holds no path of that name"
            + (f"; the parts it would match: pass exclude={names!r}" if 0 < len(names) <= 40
               else f"; it would match {len(names)} parts, such as {few(names, 3)}: pass "
                    "them as a list (the paths 'asyncckpt inspect' lists)" if names
               else " (names as 'asyncckpt inspect' lists them)"))
    if len(mine) < len(unmatched):
        _say("exclude: the checkpoint of step %d holds nothing at %s (names as "
             "'asyncckpt inspect' lists them)", manifest.step,
             few([e for e in unmatched if e not in mine]))
    if mine:
        log.info("exclude: %s, which the target holds, is not in the checkpoint of step %d",
                 few(mine), manifest.step)
    return _with_skeleton(manifest, skeleton)


def pruned(node: dict[str, Any], exclude: tuple[str, ...], holder: str,
           path: str = "", module: bool = False, dropped: list[str] | None = None,
           dotted: bool = True) -> dict[str, Any]:
    """The skeleton ``node`` (at ``path``) without its ``exclude`` parts; through the
    state dicts of stateful objects (a module's: the target's side refuses other objects
    before this), where a submodule's name also names its keys (``head``: ``head.weight``,
    see excluded_here), not through lists."""
    t = node["t"]
    below = _below(path, exclude)
    if below is None:
        return node
    if t == "stateful":
        return {**node, "state": pruned(node["state"], exclude, holder, path,
                                        module=dotted, dropped=dropped, dotted=dotted)}
    if t == "dict":
        gone = excluded_here(path, (escape_key(k) for k, _ in node["items"]), exclude, module)
        if dropped is not None:
            dropped += [join_path(path, k) for k, _ in node["items"] if escape_key(k) in gone]
        return {**node, "items": [[k, pruned(c, exclude, holder, join_path(path, k),
                                             dropped=dropped, dotted=dotted)]
                                  for k, c in node["items"] if escape_key(k) not in gone]}
    what = {"list": "a list", "tuple": "a tuple"}.get(t, "a value")
    raise CheckpointConfigError(
        f"exclude {below!r} lies inside {path or 'the root'!r}, which {holder} holds as "
        f"{what}: exclude all of it")


def _without_excluded_shards(shards: Mapping[str, ShardMetadata] | None,
                             target: FlatState) -> Mapping[str, ShardMetadata] | None:
    """``shards`` without those of the parts the target's flattening left out (inside
    a module: ``exclude=["model/head"]`` and a shard of ``model/head.weight``)."""
    if not shards or not target.excluded:
        return shards
    named = set(target.excluded)
    return {p: m for p, m in shards.items() if not _under(p, named)}


def _under(path: str, named: set[str]) -> bool:
    """``is_excluded`` for many concrete paths: ``path`` or a dict above it is one of
    ``named`` (set lookups, not a scan of them per path)."""
    parts = path.split("/")
    return any("/".join(parts[:i]) in named for i in range(1, len(parts) + 1))


# --- key_map=: saved tensors renamed before they are matched --------------------------------

KeyMap = Callable[[str], "str | None"] | Mapping[str, str]


def check_progress(progress: object) -> None:
    """``progress=``: None or a callable of (done, total) (a trial's progress=5 failed the
    load with "'int' object is not callable")."""
    if progress is not None and not callable(progress):
        raise CheckpointConfigError(
            f"progress={progress!r:.60}: pass a function of (done, total), the bytes so far "
            "and in all, or None")


def check_key_map(key_map: object) -> None:
    if key_map is not None and not callable(key_map) and not isinstance(key_map, Mapping):
        raise CheckpointConfigError(
            f"key_map={key_map!r:.80}: pass a mapping of names or a function of a name")


def mapped_name(name: str, key_map: KeyMap) -> str | None:
    """``name`` as ``key_map`` renames it (None: left out); CheckpointConfigError for a
    function that raises or answers with something else than a str or None."""
    new: Any
    if isinstance(key_map, Mapping):
        new = key_map.get(name, name)
    else:
        try:
            new = key_map(name)
        except Exception as exc:
            raise CheckpointConfigError(f"key_map({name!r}) raised {type(exc).__name__}: "
                                        f"{exc}") from exc
    if new is not None and not isinstance(new, str):
        raise CheckpointConfigError(f"key_map gave {new!r:.80} for tensor {name!r}: a name "
                                    "(str) or None to leave it out")
    return new


def renamed(manifest: Manifest, key_map: KeyMap | None) -> Manifest:
    """``manifest`` with its tensors moved to the paths ``key_map`` gives their paths (as
    ``asyncckpt inspect`` lists them: dict keys joined by ``/``), or left out where it
    gives None. Only tensors move; dicts emptied by the moves go, dicts the new paths
    need are made. A tensor may move out of and into dicts only (of a module's or an
    optimizer's state too), not out of or into a list."""
    if key_map is None:
        return manifest
    moves = []
    seen: set[str] = set()
    by_path = key_map if isinstance(key_map, Mapping) else None
    for path, _ in iter_array_nodes(manifest.skeleton):
        old = unescape_path(path)
        seen.add(old)
        if by_path is not None and path != old:
            # a key holding '/' or '%': a mapping may name it as inspect lists it (and as
            # a mismatch's advice does), escaped, or with the key as it is
            seen.add(path)
            new = mapped_name(path, key_map) if path in by_path else mapped_name(old, key_map)
            new = old if new == path else new
        else:
            new = mapped_name(old, key_map)
        if new != old:
            if not path:
                raise CheckpointConfigError(
                    f"key_map renames the checkpoint's root to {new!r}, but the root is one "
                    "tensor, not a dict of them: load it without key_map")
            if new is not None and "" in new.split("/") and "" not in old.split("/"):
                # (a trial's "x/" made the key '' of a dict 'x', without a word; a path
                # with an empty key of its own, given to a function as it is, may keep it)
                raise CheckpointConfigError(
                    f"key_map renames tensor {old!r} to {new!r}, a path with an empty key "
                    "in it (a '/' at an end, or two together): keys are joined by '/', and "
                    "an empty key is spelt %00 (e.g. 'x/%00'), as 'asyncckpt inspect' lists "
                    "it")
            moves.append((path, old, new))
    if isinstance(key_map, Mapping):
        # (a typo, "model/head.weight " or a path without its "model/", renames nothing)
        unmatched = [k for k in key_map if k not in seen]
        if unmatched:
            _say("key_map: the checkpoint of step %d has no tensor at %s (tensor paths: "
                 "dict keys joined by '/'): %s renamed nothing",
                 manifest.step, few([repr(k) for k in unmatched], 5),
                 "that entry" if len(unmatched) == 1 else "those entries")
    if not moves:
        return manifest
    into: dict[str, str] = {}
    for _, old, new in moves:
        if new is not None and into.setdefault(new, old) != old:
            raise CheckpointConfigError(
                f"key_map maps both tensor {into[new]!r} and tensor {old!r} to {new!r}: map "
                "them to different names (or one of them to None, to leave it out)")
    skeleton = copy.deepcopy(manifest.skeleton)
    ints: dict[tuple[str, ...], set[str]] = {}  # a dict's path -> the int keys moves emptied
    nodes = [_detach(skeleton, path, old, new, ints) for path, old, new in moves]
    for (_, old, new), (node, int_in) in zip(moves, nodes, strict=True):
        if new is not None:
            _attach(skeleton, new, node, old, ints, int_in)
    return _with_skeleton(manifest, skeleton)


def _inner(node: dict[str, Any]) -> dict[str, Any]:
    """A stateful node's state (what its path names), else the node itself."""
    while node["t"] == "stateful":
        node = node["state"]
    return node


def _detach(skeleton: dict[str, Any], path: str, old: str, new: str | None,
            ints: dict[tuple[str, ...], set[str]]
            ) -> tuple[dict[str, Any], tuple[str, ...] | None]:
    """Take the node at ``path`` out of its dict, and dicts that this empties out of
    theirs (noting in ``ints`` those whose key was an int); return it, and the path (as
    text keys) of the dict it was in where its own key was an int, else None."""
    chain: list[tuple[dict[str, Any], int]] = []  # (container, index of the child in it)
    keys: list[str] = []  # the keys on the way, as text
    node = skeleton
    for seg in path.split("/"):
        node = _inner(node)
        i = (next((j for j, (k, _) in enumerate(node["items"]) if escape_key(k) == seg))
             if node["t"] == "dict" else int(seg))
        chain.append((node, i))
        keys.append(str(node["items"][i][0]) if node["t"] == "dict" else seg)
        node = node["items"][i] if node["t"] != "dict" else node["items"][i][1]
    parent, i = chain[-1]
    if parent["t"] != "dict":
        raise CheckpointConfigError(
            f"key_map renames tensor {old!r} to {new!r}, but it is an item of a "
            f"{parent['t']}: only tensors in dicts can be renamed or left out (a key_map "
            "function may return a path it does not move as it is, and "
            "ignore_unexpected=True skips what the target lacks)")
    int_in = tuple(keys[:-1]) if type(parent["items"].pop(i)[0]) is int else None
    for depth in range(len(chain) - 2, -1, -1):  # (dicts it leaves empty go too)
        container, j = chain[depth]
        child = container["items"][j][1] if container["t"] == "dict" else None
        if child is None or _inner(child)["t"] != "dict" or _inner(child)["items"]:
            break
        key = container["items"].pop(j)[0]
        if type(key) is int:  # (an optimizer's state of parameter 3: moved back, it is 3)
            ints.setdefault(tuple(keys[:depth]), set()).add(str(key))
    return node, int_in


def _attach(skeleton: dict[str, Any], new: str, node: dict[str, Any], old: str,
            ints: dict[tuple[str, ...], set[str]],
            int_in: tuple[str, ...] | None = None) -> None:
    """Put ``node`` at path ``new``, making the dicts on the way. A new key is an int
    where the dict had that int key before the moves, or holds int keys only; and the
    tensor's own key, where it was an int in the dict ``int_in``, stays an int in that dict
    or in one that holds an int key (``m/1`` to ``m/100`` in a dict of str and int keys).
    """
    # (a segment escaped as inspect lists it, and as a mismatch's advice spells it, is the
    # key it names: "a%2Fb" is the key "a/b")
    parts = ["" if seg == "%00" else seg.replace("%2F", "/").replace("%25", "%")
             for seg in new.split("/")]
    here = skeleton
    for n, part in enumerate(parts):
        here = _inner(here)
        if here["t"] != "dict":
            raise CheckpointConfigError(
                f"key_map renames tensor {old!r} to {new!r}, but "
                f"{'/'.join(parts[:n]) or 'the root'!r} is a {here['t']} in the checkpoint: "
                "tensors can be moved into dicts only")
        items = here["items"]
        child = next((c for k, c in items
                      if k == part or (type(k) is int and str(k) == part)), None)
        key: str | int = part
        if child is None and _int_text(part) and (
                part in ints.get(tuple(parts[:n]), ()) or (items and all(type(k) is int
                                                                 for k, _ in items))
                or (int_in is not None and n == len(parts) - 1 and (
                    int_in == tuple(parts[:n])
                    or not all(type(k) is str for k, _ in items)))):
            key = int(part)
        if n == len(parts) - 1:
            if child is not None:
                raise CheckpointConfigError(
                    f"key_map renames tensor {old!r} to {new!r}, which the checkpoint holds "
                    "already (another tensor or value): map them to different names")
            items.append([key, node])
        elif child is None:
            child = {"t": "dict", "items": []}
            items.append([key, child])
        here = child if child is not None else here


def _int_text(text: str) -> bool:
    """Whether ``text`` is how ``str`` writes some int."""
    try:
        return str(int(text)) == text
    except ValueError:
        return False


def _names_a_part(skeleton: dict[str, Any], path: str) -> bool:
    """Whether exclude=[path] leaves anything of ``skeleton`` out, by pruned's rule
    (excluded_here: a submodule's dotted keys in a module's state only)."""
    node: dict[str, Any] | None = skeleton
    segs = path.split("/")
    for i, seg in enumerate(segs):
        module = node is not None and node["t"] == "stateful"
        if module:
            node = node["state"]  # type: ignore[index]
        if node is None or node["t"] != "dict":
            return False
        names = [(escape_key(k), c) for k, c in node["items"]]
        if i == len(segs) - 1:
            return bool(excluded_here("/".join(segs[:i]), (n for n, _ in names), (path,),
                                      module))
        node = next((c for name, c in names if name == seg), None)
    return node is not None


def saved_paths(manifest: Manifest) -> dict[str, str]:
    """The path of every array the checkpoint holds, and the key of its tensor."""
    return {p: n["key"] for p, n in iter_array_nodes(manifest.skeleton)}


def _fits(entry: TensorEntry, target: FlatState, tkey: str, casts: set[str] | None) -> bool:
    """Whether the saved ``entry`` loads into the target's tensor ``tkey``: the same
    (global) shape, and its dtype or one ``cast=True`` casts into (never a numpy array's)."""
    dtype = target.tensors[tkey].dtype
    return entry.shape == target.global_shape(tkey) and (
        dtype == entry.dtype or (casts is not None and castable(entry.dtype, dtype)
                                 and tkey not in target.arrays))


# (missing, unexpected) -> (the caller's own hint, or ""; its general advice, given where
# no hint of the loader's fits either)
RenameHint = Callable[[list[str], list[str]], tuple[str, str]]
"""(missing, unexpected) -> a sentence saying how to rename, or "": a caller's hint."""


def _match(manifest: Manifest, saved: dict[str, str], target: FlatState, strict: bool,
           step_dir: Path, spans: dict[int, _Span | None] | None = None, *,
           ignore_unexpected: bool = False, same_tree: bool = False,
           casts: set[str] | None = None,
           rename_hint: RenameHint | None = None
           ) -> tuple[dict[str, list[torch.Tensor]], dict[str, Box],
                      dict[str, list[Box | None]]]:
    """Pair saved keys with target tensors; raise StateMismatchError on disagreement.

    Returns saved key -> target tensors to fill (empty: load fresh), the box each saved
    key is wanted in (absent: the whole tensor), and for the keys whose targets want
    different boxes (a tied weight that is a shard at one path and whole at another)
    each target's box, in the order of its target tensors: those are loaded whole.
    ``spans``, when given, receives the memory span of every target tensor to fill, by
    ``id`` (see :func:`_tensor_span`), for :func:`_sharing_memory`. ``strict=False``
    skips what either side lacks; ``ignore_unexpected`` only what the target lacks.
    ``same_tree``: the caller found the two skeletons equal (nothing to walk in them).
    """
    skip_unexpected = ignore_unexpected or not strict
    # Objects that take what the checkpoint has beyond what they hold now (optimizers
    # create state lazily), and among them those whose state is replaced as a whole
    # (optimizers, LR schedulers, and any object, a module too, that asks to be given
    # the checkpoint's state alone): what only the target holds is not missing there.
    lenient = [p for p, (obj, _) in target.statefuls.items()
               if not isinstance(obj, torch.nn.Module) or loads_fresh(obj)]
    whole = {p for p in lenient if takes_whole_state(target.statefuls[p][0])}

    def passes_through(path: str) -> bool:
        # Optimizers and similar objects create state lazily: what the checkpoint has and
        # the fresh object lacks goes to their load_state_dict as is.
        return any(_within(path, p) for p in lenient)

    def whole_state(path: str) -> bool:
        # Under an optimizer or LR scheduler (the innermost stateful holding the path),
        # whose load_state_dict takes the checkpoint's state as a whole: what only the
        # target holds is not missing (a step saved before the first optimizer step has
        # no moments; loading it in place drops them, as a fresh process has none).
        found = [p for p in target.statefuls if _within(path, p)]
        return bool(found) and takes_whole_state(target.statefuls[max(found, key=len)][0])

    _refuse_plain_state_for_dtensor_params(saved, target, lenient, step_dir)
    missing = [p for p in target.refs if p not in saved and not whole_state(p)]
    if missing:
        # a target path tied to one the checkpoint fills (one tensor at both) gets its
        # values through it: Hugging Face files hold tied embeddings so, and so does a
        # checkpoint of a model (or plain dict) that had them apart
        filled = {target.refs[p] for p in target.refs if p in saved}
        tied = [p for p in missing if target.refs[p] in filled]
        if tied:
            log.info("loading %s: %s get their values through the tensors they are tied to",
                     step_dir, few(tied))
            missing = [p for p in missing if target.refs[p] not in filled]
    if missing:
        missing = _without_untracked_counts(target, missing, step_dir)
    unexpected = [p for p in saved if p not in target.refs and not passes_through(p)]
    mismatched: list[str] = []
    told: set[str] = set()  # the paths of the mismatches told (each is told once)
    # what the tensor keys do not show: values without arrays the checkpoint lacks, and
    # dict keys whose type differs (1 vs "1" name one path, but are not one key)
    if not same_tree:
        _compare_skeletons(manifest.skeleton, target.skeleton, "", set(lenient), whole,
                           missing, mismatched, unexpected, told)
    _compare_param_groups(manifest.skeleton, target, lenient, mismatched, told, saved,
                          manifest.tensors)
    apart: list[str] = []  # (strict=False skips them: named in its warning)
    apart_saved: list[str] = []  # ... and the saved paths among them
    if (missing or unexpected) and not same_tree:
        if strict:
            _kinds_apart(manifest.skeleton, target.skeleton, missing, unexpected, mismatched,
                         told)
        else:
            # (out of missing and unexpected too: named once, and in no rename's advice;
            # the saved ones are still left unread, as unexpected ones are)
            kept_unexpected = list(unexpected)
            _kinds_apart(manifest.skeleton, target.skeleton, missing, kept_unexpected, apart,
                         set(told))
            apart_saved = [p for p in unexpected if p not in set(kept_unexpected)]
            unexpected = kept_unexpected
    readonly: list[str] = []
    overlapping: list[str] = []
    unwritable: list[str] = []
    shape_dtype = 0  # how many of the mismatches are of shape or dtype (the rest: of kind)
    grown: list[str] = []  # ... of shape alone, in the state of an object of the user's
    # a tensor target of another dtype (and the same shape) that no cast=True casts into
    other_dtype = False
    reshaped: list[str] = []  # the paths of the mismatches of shape
    # (path, saved shape) of whole targets that fit inside the saved tensor: maybe a shard
    # this rank holds, given without its shards= (a distributed trial was told exclude=)
    inside: list[tuple[str, tuple[int, ...]]] = []
    described: list[tuple[str, str]] = []  # the mismatches of shape or dtype: (path, what)
    numpy_dtype = False  # ... that is a numpy array, which cast=True does not cast
    castable_dtype = False  # ... a tensor that cast=True (not given) would cast into
    writable = _WritableMemory()
    dests: dict[str, list[torch.Tensor]] = {}
    not_held: list[str] = []
    wanted: dict[str, list[Box | None]] = {}  # by key: each target's box (None: whole)
    spans = {} if spans is None else spans
    # (a view one rank of a group serves: the tensors other ranks wrote are named, not
    # held; an error of their own, if the target wants them)
    absent = ({k for k in saved.values() if k not in manifest.tensors} if manifest.partial
              else set())
    # (this loop runs once per tensor of the checkpoint: the common case is kept cheap)
    for path, key in saved.items():
        tkey = target.refs.get(path)
        if absent and key in absent:
            if tkey is not None or passes_through(path):
                not_held.append(path)
            continue
        if tkey is None:
            if passes_through(path) or skip_unexpected:
                dests.setdefault(key, [])
            continue
        t = target.tensors[tkey]
        entry = manifest.tensors[key]
        tbox = target.boxes.get(tkey)
        same_shape = (tbox[0] if tbox is not None else t.shape) == entry.shape
        if not same_shape or t.dtype != entry.dtype:
            if casts is None or not _fits(entry, target, tkey, casts):
                if not same_shape:
                    reshaped.append(path)
                    if (tbox is None and t.dim() == len(entry.shape) and len(inside) < 4
                            and all(a <= b for a, b in zip(t.shape, entry.shape,
                                                          strict=True))
                            and (len(entry.chunks) > 1 or _group_size() > 1)):
                        inside.append((path, tuple(entry.shape)))
                elif t.dtype != entry.dtype:  # (of another shape, no cast would help)
                    # which advice helps: numpy arrays are never cast, cast=True casts
                    # within a kind only (a trial's float32 into a float64 array, and a
                    # bool into uint8, were told to pass cast=True, which then refused)
                    if tkey in target.arrays:
                        numpy_dtype = True
                    elif casts is None and castable(entry.dtype, t.dtype):
                        castable_dtype = True
                    else:
                        other_dtype = True
                arr = target.arrays.get(tkey) if target.arrays else None
                kind = t.dtype if arr is None else f"numpy {arr.dtype}"  # (as the user has it)
                what = (f"checkpoint {entry.dtype} {list(entry.shape)}, "
                        f"target {kind} {list(target.global_shape(tkey))}")
                mismatched.append(f"{path}: {what}")
                described.append((path, what))
                shape_dtype += 1
                if t.dtype == entry.dtype and len(grown) < 1:
                    grown += _grown_object(target, path)
                continue
            casts.add(key)  # read as saved, then copied into the target (cast)
        if target.arrays:
            arr = target.arrays.get(tkey)
            if arr is not None and not arr.flags.writeable:
                readonly.append(path)
                continue
        why = _unfillable(t, writable, spans)
        if why is not None:
            (unwritable if why == "unwritable" else overlapping).append(path)
            continue
        lst = dests.setdefault(key, [])
        if not lst or not any(x is t for x in lst):
            lst.append(t)
            box = tbox[1] if tbox is not None else None
            if box is not None and box == ((0,) * len(entry.shape), tuple(entry.shape)):
                box = None
            wanted.setdefault(key, []).append(box)
        target.loaded_in_place.add(path)
    if not_held:
        raise _not_held(step_dir, not_held)
    boxes = {k: b[0] for k, b in wanted.items() if b[0] is not None and len(set(b)) == 1}
    regions = {k: b for k, b in wanted.items() if len(b) > 1 and len(set(b)) > 1}
    # (the wrapper hint reads the checkpoint's extra keys even where they are skipped:
    # with ignore_unexpected, a model saved through DDP misses every key of the bare one)
    def fits(old: str, new: str) -> bool:
        """Whether saved ``old`` could load into target ``new`` (a rename's example must
        not pair an int64 [4] with a float [1]); True where either is no tensor."""
        key, tkey = saved.get(old), target.refs.get(new)
        entry = None if key is None else manifest.tensors.get(key)
        return entry is None or tkey is None or _fits(entry, target, tkey, casts)

    # (the caller's own, where it knows better: a safetensors file's names, prefixed with
    # "model." as Hugging Face's are, got three hints that disagreed)
    theirs, general = (rename_hint(missing, unexpected) if rename_hint and missing
                       and unexpected else ("", ""))
    # (a dict saved, a list wanted, or the reverse: told as such; no renaming of the first
    # parts of the paths fixes it, whose advice was state['model'] = state.pop('0'))
    roots_apart = _inner(manifest.skeleton)["t"] != _inner(target.skeleton)["t"]
    # (a wrapper's part first: it names torch.compile or DDP, and the module to load into)
    wrapped = wrapper_hint(missing, unexpected, ignoring=ignore_unexpected)
    hint = (wrapped or (f". {theirs}" if theirs else "")
            or prefix_hint(missing, unexpected)
            or (not roots_apart and head_hint(
                missing, unexpected, fits, lambda old, new: _tensors_in_str_dicts(
                    _node_at(manifest.skeleton, old)) and _tensors_in_str_dicts(
                    _node_at(target.skeleton, new))))
            or _mapping_hint(missing, unexpected, fits, saved)
            or substitution_hint(missing, unexpected, saved)
            or renamed_hint(missing, unexpected, fits)
            or (f". {general}" if general else ""))
    stateless = _stateless_optimizer_dicts(target.skeleton, unexpected) if unexpected else []
    if stateless and not skip_unexpected:  # (the hints above know nothing of it)
        hint = (f" ({few([repr(p or '<root>') for p in stateless], 3)} holds an optimizer's "
                "state_dict() with no state yet (an optimizer makes its state at its first "
                "step(), and a state dict is a copy of it): pass the optimizer itself, whose "
                "load_state_dict takes the saved state whole; ignore_unexpected=True or "
                "strict=False would leave the saved state unread)")
    elif stateless:
        _say("loading %s: the saved optimizer state under %s is not loaded: the target "
             "there is an optimizer's state_dict() with no state yet (a copy of a fresh "
             "optimizer's); pass the optimizer itself to restore it",
             step_dir, few([repr(p or "<root>") for p in stateless], 3))
    # a torch.save habit: said once the load is sure to go ahead (with strict=False's)
    copies = [] if same_tree or COPIES_EXPECTED.get() else [
        (p, kind) for p, kind in _copied_state_dicts(manifest.skeleton, target.skeleton)
        if p not in stateless]
    skipped_unexpected: list[str] = []  # (ignore_unexpected's: named where keys are missing)
    if skip_unexpected:
        for k in {saved[p] for p in unexpected + apart_saved if p in saved}:
            if not dests.get(k):
                dests.pop(k, None)
        skipped_unexpected, unexpected = unexpected, []
    skipped = None  # strict=False's warning, given once the load is sure to go ahead
    if not strict:
        if hint:  # strict=False then skips the keys on both sides: say why nothing loaded
            skipped = (f"loading {step_dir} with strict=False skips {len(missing)} target "
                       f"key(s) the checkpoint holds under other names" + hint.replace(
                           "; strict=False would load none of them", ""))
        elif missing:  # (a new layer, as meant; or a typo that silently loads nothing)
            skipped = (f"loading {step_dir} with strict=False leaves {len(missing)} target "
                       f"key(s) the checkpoint does not hold as they are: {few(missing)}")
        if skipped_unexpected and not ignore_unexpected and not hint:
            # (a trial's model with a layer removed: the saved layer was dropped without a
            # word, where the missing side was warned of) Said of keys whose parent the
            # target holds (a module, an object, a dict with tensors: the root too, a bare
            # module's); a part left out whole (the optimizer of {"model": model}, a
            # subtree of a nested state) is meant.
            # (the root only where it is an object or holds tensors of its own: a key a
            # dict target leaves out at its top is a part left out whole, review)
            nodes = set(target.statefuls)
            if any("/" not in p for p in target.refs):
                nodes.add("")
            for p in target.refs:
                parts = p.split("/")
                nodes.update("/".join(parts[:i]) for i in range(1, len(parts)))
            unread = [p for p in skipped_unexpected if p.rpartition("/")[0] in nodes]
            if unread:
                skipped = ((skipped + "; it also" if skipped else
                            f"loading {step_dir} with strict=False") +
                           f" leaves {len(unread)} saved key(s) unread, which the target "
                           f"lacks: {few(unread)}")
            left_out = [p for p in skipped_unexpected if p.rpartition("/")[0] not in nodes]
            if left_out:
                log.info("loading %s with strict=False: the parts the target leaves out are "
                         "not read (%d key(s): %s)", step_dir, len(left_out), few(left_out, 3))
        if apart:  # (a trial's tensor saved where the target held an int: silent)
            skipped = ((skipped + "; it also" if skipped else
                        f"loading {step_dir} with strict=False") +
                       f" skips {len(apart)} entr{'y' if len(apart) == 1 else 'ies'} of "
                       f"another kind than the checkpoint's, which keep the target's values: "
                       f"{few(apart)}")
        missing = []
    if missing or unexpected or mismatched or readonly or overlapping or unwritable:
        parts = []
        # what would still be in the way of a load that leaves out the paths an advice
        # names: a mismatch of kind (no path of its own here), and every path below
        blocked = len(mismatched) > len(described)
        blockers = ([p for p, _ in described] + missing + unexpected + readonly + unwritable
                    + overlapping)

        def loads_rest(names: Sequence[str]) -> bool:
            """Whether a load with exclude=``names`` would go through (a trial followed
            "to load the rest, pass exclude=..." and failed on what it left in)."""
            return not blocked and all(
                any(p == n or p.startswith(n + sep) for n in names for sep in "./")
                for p in blockers)

        if missing and manifest.partial:  # (a view a rank of a group serves of its part)
            parts.append(f"missing from the peer's view (the state of the rank that serves "
                         f"it): {few(missing)}")
            # (not a rename hint of names the view holds instead: those are its own
            # rank's; but a wrapper's part of every key, a DDP "module.", is one: a trial)
            # (but after that advice, the rename hint: a trial's layer renamed on this
            # side was told nothing of key_map=)
            hint = (hint if wrapped else
                    " (a peer serves what its own state holds; in a group, fetch each rank's "
                    "state from the same rank of a healthy replica; leave out what only this "
                    "side holds with exclude=)" + hint)
        elif missing:
            parts.append(f"missing from the checkpoint: {few(missing)}")
        if unexpected:
            parts.append(f"in the checkpoint but not in the target: {few(unexpected)}")
        if mismatched:
            label = "shape/dtype mismatch" if shape_dtype == len(mismatched) else "mismatched"
            parts.append(f"{label}: {_mismatches_text(mismatched, described)}")
            if manifest.partial and reshaped:  # (a heal: the advice below would not mend it)
                parts.append("the peer's tensors have other shapes than this side's: "
                             "build the replacement with the sender's model config (its "
                             "shapes); leaving them out, as said below, loads the rest "
                             "but leaves this side's state unlike its peers'")
            for owner in grown:  # (a replay buffer, a list of metrics: it grows)
                parts.append(f"if the state of {owner} grows or shrinks as it runs, give its "
                             "class _asyncckpt_load_fresh = True: it then gets the "
                             "checkpoint's state dict whole, in new tensors (see load)")
            # (the moments of a trained optimizer resized with its parameters cannot be
            # excluded one by one: the optimizer can, as a whole; a trial got no advice)
            apart = [p for p in reshaped[:50] if not _excludable(target, p)]
            owners = {_excludable_owner(target, p) for p in apart}
            if reshaped and not grown and len(reshaped) <= 50 and None not in owners:
                reshaped = [p for p in reshaped if p not in apart]
                # (a new head, a resized vocabulary: by the submodule where all of it is
                # new, head.bias too; the keys the target lacks with them)
                subs = {p.rpartition(".")[0] for p in reshaped}  # (a head's bias, not a rename)
                # (and a tied head the file holds once, under the embedding's name: the
                # embedding left out, the head went missing, told on the next try)
                shared = {target.refs.get(p) for p in reshaped} - {None}
                near = [m for m in missing if m.rpartition(".")[0] in subs
                        and _excludable(target, m)] if len(missing) <= 50 else []
                near += [q for q, k in target.refs.items() if k in shared and q not in saved
                         and q not in near and _excludable(target, q)] if shared else []
                names = sorted(o for o in owners if o is not None) + _condensed(
                    target, reshaped + near, saved)
                # (where something else is in the way, this alone loads nothing: a trial
                # followed it, and failed on the saved key the target lacks)
                parts.append(("to load the rest and keep the target's own values there"
                              if loads_rest(names) else
                              "to keep the target's own values there")
                             + ", pass "
                             + (f"exclude={names!r}" if len(names) <= 16 else
                                f"exclude= with those paths ({len(names)}: "
                                f"{few([repr(n) for n in names], 16)})"))
                moved = _moved(reshaped, missing, fits) if len(reshaped) <= 50 else {}
                if moved:  # (a layer inserted: the saved ones fit further on)
                    left = _condensed(target, [p for p in reshaped if p not in moved.values()]
                                      + [m for m in missing if m not in moved.values()], saved)
                    parts.append(
                        "but if layers moved (one inserted before them), the saved tensors "
                        f"fit further on: key_map={moved!r}"
                        + (f" with exclude={left!r}" if left and len(left) <= 16 else "")
                        + " loads each where it fits, the new ones keeping their values")
                # (a layer removed: the saved ones after it fit further back, the removed
                # one's left out; a trial was offered exclude= alone, which would have
                # left the trained head unloaded)
                back = (_moved(unexpected, reshaped, fits)
                        if not moved and len(unexpected) <= 50 else {})
                if back:
                    kmap: dict[str, str | None] = {**back}
                    kmap.update({t: None for t in back.values()})
                    left = _condensed(target, [p for p in reshaped if p not in back.values()],
                                      saved)
                    parts.append(
                        "but if layers moved (one removed before them), the saved tensors "
                        f"fit further back: key_map={kmap!r} (None: the removed layer's, "
                        "left out)" + (f" with exclude={left!r}" if left and len(left) <= 16
                                       else "") + " loads each where it fits")
            if inside:
                path0, shape0 = inside[0]
                parts.append(
                    f"if this {'rank' if _group_size() > 1 else 'process'} holds a part of "
                    + ("that tensor" if len(inside) == 1 else
                       f"those tensors ({few([p for p, _ in inside])})")
                    + ", sharded by hand, say which: shards={"
                    f"{path0!r}: asyncckpt.ShardMetadata(global_shape={shape0}, offsets=<where "
                    "its part starts>)} (DTensors need none)")
            if numpy_dtype:
                parts.append("numpy arrays are never cast: load into arrays of the saved "
                             "dtypes (or into tensors)")
            if castable_dtype:
                parts.append("to load into tensors of another floating (integer, complex) "
                             "dtype, pass cast=True")
            if other_dtype:
                parts.append("to load into tensors of another kind of dtype (a bool into an "
                             "integer, an integer into a float; or of one torch cannot cast "
                             "into, such as float4), load with state=None and convert")
        if readonly:  # reading into one fails (EFAULT) or crashes: refuse before any read
            parts.append(f"read-only numpy arrays: {few(readonly)}; pass writeable ones (e.g. "
                         "np.array(a), or a np.memmap opened with mode='r+')")
            mismatched += [f"{p}: read-only numpy array" for p in readonly]
        if unwritable:  # a copy into one kills the process (SIGSEGV): refuse up front
            parts.append(f"tensors over memory that cannot be written (a read-only mapping, "
                         f"such as np.load(mmap_mode='r')): {few(unwritable)}; load into "
                         "writable tensors (e.g. t.clone())")
            mismatched += [f"{p}: read-only memory" for p in unwritable]
        if overlapping:  # a copy into one raises half-way through a load: refuse up front
            parts.append(f"tensors whose elements share memory (expanded or as_strided views): "
                         f"{few(overlapping)}; load into tensors with memory of their own "
                         "(e.g. t.clone())")
            mismatched += [f"{p}: elements share memory" for p in overlapping]
        exclude_hint = functools.partial(_exclude_hint, skeleton=manifest.skeleton)
        # (where a wrapper renamed the keys, strict=False would load none of them)
        # (and where something does not match besides, neither flag would load it)
        hint = hint or (
            exclude_hint(target, saved, missing, unexpected, " (strict=False would skip the "
                          "missing and unexpected keys, but not the mismatches)")
            if mismatched and (missing or unexpected)
            else " (pass ignore_unexpected=True to load only what the target holds, or "
            "strict=False to skip missing and unexpected keys)" if unexpected and not missing
            else (parts_absent + exclude_hint(target, saved, missing, [], "")) if missing
            and unexpected and (parts_absent := _parts_absent_hint(target, unexpected))
            else exclude_hint(
                target, saved, missing, unexpected, " (strict=False would skip both: the target's "
                "keys would keep their values and the checkpoint's go unread; if names "
                "changed, map the saved ones to the new with key_map=)") if missing and unexpected
            else exclude_hint(
                target, saved, missing, [], f" (the checkpoint's {len(skipped_unexpected)} "
                f"key(s) the target lacks, {few(skipped_unexpected, 3)}, would be skipped, as "
                "the ignore_unexpected=True given asks; strict=False would also skip the "
                "missing ones, which keep their values; if names changed, map the saved ones "
                "to the new with "
                "key_map=)") if missing and skipped_unexpected
            else exclude_hint(target, saved, missing, [], " (pass strict=False to skip "
                               "missing and unexpected keys)") if missing
            else "")
        raise StateMismatchError(f"cannot load {step_dir} into the given state: "
                                 + "; ".join(parts) + hint
                                 + _all_at_once(parts, hint, loads_rest),
                                 missing=missing, unexpected=unexpected, mismatched=mismatched)
    if skipped is not None:
        _say("%s", skipped)
    if copies:
        kinds = list(dict.fromkeys(  # (in the paths' order)
            ("a " if k == "GradScaler" else "an ") + k for _, k in copies))
        _say("loading %s: %s %s (of %s), whose tensors, if any, the load fills in place, but whose "
             "settings beside them (learning rates, a scheduler's step count, a scaler's "
             "scale) it changes in "
             "the %s only: unless you pass %s to %s load_state_dict, put %s in the state "
             "(as with a model)", step_dir,
             few([repr(p or "<root>") for p, _ in copies], 3),
             "hold state_dict() copies" if len(copies) > 1 else "holds a state_dict() copy",
             " and ".join(kinds), "copies" if len(copies) > 1 else "copy",
             "those parts of the returned tree" if len(copies) > 1 else
             "that part of the returned tree", "their" if len(copies) > 1 else "its",
             "the objects themselves" if len(copies) > 1 else "the object itself")
    return dests, boxes, regions


# (the advice that leaves a part out, each a list of paths, where a mismatch error gives
# it: a submodule that is new, an optimizer to start afresh, a resized head)
_ADVISED_EXCLUDE = re.compile(r"(?:afresh, pass|own values there, pass|such as a head:|"
                              r"resized since: leave the optimizer out with|"
                              r"the target holds no [^:]*:|"
                              # (an optimizer's LR schedulers: a trial's combined advice
                              # left them out, and LambdaLR's next step() raised)
                              r"exclude its LR schedulers? too,|exclude (?:it|them) too,) "
                              r"exclude=(\[[^\]]*\])")


def _all_at_once(parts: list[str], hint: str,
                 loads_rest: Callable[[Sequence[str]], bool] = lambda names: False) -> str:
    """Where a mismatch error advises leaving out several parts, each for its own reason
    (a new block's submodule, an optimizer resized with it): the exclude= of all of them,
    last, so that the advice followed loads in one go (a trial took two tries, then three);
    "" where there is one piece of advice or none. ``loads_rest(names)``: whether the
    rest would load then (said so only where it would)."""
    found: dict[str, None] = {}
    pieces = 0
    for text in [*parts, hint]:
        for m in _ADVISED_EXCLUDE.finditer(text):
            try:
                names = ast.literal_eval(m.group(1))
            except (ValueError, SyntaxError):
                return ""
            pieces += 1
            found.update(dict.fromkeys(names))
    if pieces < 2:
        return ""
    # (a path under another one advised is left out with it)
    names = [n for n in found if not any(n.startswith(o + sep) for o in found if o != n
                                         for sep in "./")]
    rest = " and load the rest" if loads_rest(names) else ""
    return f"; to leave all of those out at once{rest}, pass exclude={names!r}"


def _parts_absent_hint(target: FlatState, unexpected: list[str]) -> str:
    """Where every unexpected key lies in a part of the state the target has not at all
    (``{"model": model}`` of a checkpoint of model and optimizer): the exclude= that leaves
    those parts out, keeping the rest strict; "" otherwise."""
    if target.skeleton.get("t") != "dict":  # (a module as the whole state: its own keys)
        return ""
    tops = list(dict.fromkeys(p.split("/", 1)[0] for p in unexpected))
    if "" in tops or any(_node_at(target.skeleton, t) is not None for t in tops):
        return ""
    names = few([repr(t) for t in tops], 4)
    return (f" (the target holds no {names}: exclude={tops!r} leaves "
            f"{'it' if len(tops) == 1 else 'them'} out, or ignore_unexpected=True every key "
            "the target lacks; the missing keys above remain: strict=False would skip them, "
            "keeping the target's values)")


def _moved(reshaped: list[str], missing: list[str],
           fits: Callable[[str, str], bool]) -> dict[str, str]:
    """Saved tensors of another shape than the target's at their path that fit a path the
    target has and the checkpoint lacks, with the same last name (``4.weight`` and
    ``6.weight``): what a layer inserted before them does to a Sequential's indices.
    A saved submodule's tensors go together, to the first target submodule that wants
    them all and they fit; {} unless every one goes somewhere."""
    def by_sub(paths: list[str]) -> dict[str, dict[str, str]]:
        groups: dict[str, dict[str, str]] = {}
        for p in paths:
            sub, _, name = p.rpartition(".")
            groups.setdefault(sub, {})[name] = p
        return groups

    # (a submodule's tensors go together, to one submodule that wants all of them: a
    # review's weight and bias went to two layers)
    out: dict[str, str] = {}
    wanted = by_sub(missing)
    taken: set[str] = set()
    for sub, names in by_sub(reshaped).items():
        to = next((t for t, have in wanted.items() if t not in taken and t != sub
                   and set(names) <= set(have) and all(fits(p, have[n]) for n, p in names.items())),
                  None)
        if to is None:
            return {}
        taken.add(to)
        out.update({p: wanted[to][n] for n, p in names.items()})
    return out


def _condensed(target: FlatState, paths: list[str], saved: Iterable[str] = ()) -> list[str]:
    """``paths`` as exclude= would name them: the keys of a module's state dict by their
    submodule (``model/head.weight`` and ``model/head.bias``: ``model/head``), where
    ``paths`` hold every key of it on both sides (the target's, and the checkpoint's in
    ``saved``): excluding it then leaves out nothing that would load. (A trial's LoRA
    factors added beside pretrained weights were told to exclude the whole layers, and
    the pretrained weights went unloaded, silently.)"""
    wanted = set(paths)
    ordered: list[str] | None = None  # (the keys of both sides, sorted: one range a prefix)
    whole: dict[str, bool] = {}  # sub -> all its keys are in paths (worked out once each)
    out: dict[str, None] = {}
    for p in paths:
        parent, _, last = p.rpartition("/")
        obj = target.statefuls.get(parent, (None, None))[0]
        if isinstance(obj, torch.nn.Module) and "." in last:
            # (the outermost submodule all of whose keys are in paths: a new block is
            # blocks.2, not its eight layers and their inner parts, as a trial was told)
            names = last.split(".")
            for k in range(1, len(names)):
                sub = ".".join(names[:k])
                sub = join_path(parent, sub) if parent else sub
                if sub not in whole:
                    if ordered is None:
                        ordered = sorted({*target.refs, *saved})
                    i = bisect.bisect_left(ordered, f"{sub}.")
                    all_in = True
                    while i < len(ordered) and ordered[i].startswith(f"{sub}."):
                        if ordered[i] not in wanted:
                            all_in = False
                            break
                        i += 1
                    whole[sub] = all_in
                if whole[sub]:
                    p = sub
                    break
        out.setdefault(p, None)
    return list(out)


def _mismatches_text(mismatched: list[str], described: list[tuple[str, str]]) -> str:
    """``few(mismatched)``, but the shape or dtype mismatches (``described``: each path
    and what differs there) that differ alike given once, with their count and a few of
    their paths: an expert's weight resized in each of 40 layers read as 320 pairs of the
    same two shapes, cut off after 8. (8 or fewer are listed one by one.)"""
    if len(mismatched) <= 8:
        return few(mismatched)
    alike: dict[str, list[str]] = {}
    for path, what in described:
        alike.setdefault(what, []).append(path)
    if len(alike) == len(described):
        return few(mismatched)
    listed = {f"{path}: {what}" for path, what in described}
    others = [m for m in mismatched if m not in listed]  # (of other kinds)
    groups = sorted(alike.items(), key=lambda kv: -len(kv[1]))
    texts = others + [f"{what} ({paths[0]})" if len(paths) == 1 else
                      f"{len(paths)} tensors of {what} ({few(paths, 3)})"
                      for what, paths in groups]
    counts = [1] * len(others) + [len(paths) for _, paths in groups]
    shown = len(texts) if len(texts) <= 8 else 4  # (each group lists three paths)
    hidden = sum(counts[shown:])
    return ", ".join(texts[:shown]) + (f" and {hidden} more mismatched tensor(s)"
                                       if hidden else "")


def _exclude_hint(target: FlatState, saved: Iterable[str], missing: list[str],
                  unexpected: list[str], otherwise: str,
                  skeleton: dict[str, Any] | None = None) -> str:
    """The exclude= that leaves ``missing`` and ``unexpected`` out on both sides (a new
    head, a dropped one) and keeps the rest strict, before ``otherwise`` (strict=False's
    advice, which would also skip a key that goes missing by mistake)."""
    paths = _by_whole_objects(target, missing + unexpected, skeleton)
    # A key inside an object's state (not a module's: an AppState, a data loader's per-rank
    # state) cannot be excluded alone, the object can (a distributed trial's resume at
    # another world size lacked dataloader/dp_rank_2, and was told of strict=False alone)
    owned: dict[str, str] = {}
    if len(paths) <= 200:
        for p in paths:
            if not _excludable(target, p) and (o := _excludable_owner(target, p)) is not None:
                owned[p] = o
        paths = list(dict.fromkeys(owned.get(p, p) for p in paths))
    names = _condensed(target, paths, saved) if len(paths) <= 200 and all(
        _excludable(target, p) for p in paths) else []
    if not names or len(names) > 16:
        return otherwise
    whole = sorted(set(owned.values()))
    objects = (f"; exclude names no key inside an object's state: "
               f"{' and '.join(repr(o) for o in whole)} "
               f"{'is' if len(whole) == 1 else 'are'} left out whole, keeping "
               f"{'its' if len(whole) == 1 else 'their'} state as it is" if whole else "")
    return (f" (a new or a dropped part, such as a head: exclude={names!r} leaves "
            f"{'it' if len(names) == 1 else 'them'} out on both sides, the rest loading "
            f"strictly{objects}){otherwise}")


def _by_whole_objects(target: FlatState, paths: list[str],
                      skeleton: dict[str, Any] | None) -> list[str]:
    """``paths``, those inside a stateful object (a GradScaler, a scheduler, a module)
    whose state one side has nothing of named by the object's path: a scaler saved
    disabled (its state dict empty) into an enabled one was told of strict=False alone,
    as its keys cannot be excluded one by one."""
    # (a module too: a new AveragedModel beside the model was told its parts first, then
    # itself, a trial's two tries)
    owners = sorted((p for p in target.statefuls if p), key=len)
    if not owners or skeleton is None:
        return paths

    def empty(node: dict[str, Any] | None) -> bool:
        if node is not None and node["t"] == "stateful":
            node = node["state"]
        return node is None or (node["t"] == "dict" and not node["items"])

    out: dict[str, None] = {}
    whole: dict[str, bool] = {}
    for p in paths:
        owner = next((o for o in owners if p.startswith(f"{o}/")), None)
        if owner is not None:
            if owner not in whole:
                whole[owner] = empty(_node_at(skeleton, owner, stateful=True)) or empty(
                    _node_at(target.skeleton, owner, stateful=True))
            if whole[owner]:
                p = owner
        out.setdefault(p, None)
    return list(out)


def _excludable_owner(target: FlatState, path: str) -> str | None:
    """The object other than a module (an optimizer) whose state holds ``path``, where
    exclude= can name it; None where there is none."""
    owner = max((o for o, (obj, _) in target.statefuls.items()
                 if o and path.startswith(f"{o}/") and not isinstance(obj, torch.nn.Module)),
                key=len, default=None)
    return owner if owner is not None and _excludable(target, owner) else None


def _excludable(target: FlatState, path: str) -> bool:
    """Whether ``exclude=[path]`` can leave the target's ``path`` out: it runs through
    dicts and modules only (see excluded_view)."""
    segs = path.split("/")
    if target.skeleton.get("t") != "dict" and not (  # (a dict of the state's parts, or a
            "" in target.statefuls and isinstance(target.statefuls[""][0], torch.nn.Module)
            and not loads_fresh(target.statefuls[""][0])):  # module)
        return False
    for i in range(len(segs)):
        head = "/".join(segs[:i])
        node = _node_at(target.skeleton, head, stateful=True)
        if node is None:
            return False
        if node["t"] == "stateful":
            obj = target.statefuls[head][0] if head in target.statefuls else None
            if not isinstance(obj, torch.nn.Module) or loads_fresh(obj):
                return False
        elif node["t"] != "dict":
            return False
    return True


def _stateless_optimizer_dicts(skeleton: dict[str, Any], unexpected: list[str]) -> list[str]:
    """The paths of target plain dicts shaped as an optimizer's state dict with empty
    ``state`` (a fresh optimizer's ``state_dict()``) under which the checkpoint holds
    tensors the target lacks: its moments, which loading into such a copy cannot keep."""
    found: list[str] = []
    looked: set[str] = set()
    for path in unexpected:
        segs = path.split("/")
        for i in range(len(segs) - 2, -1, -1):  # (the innermost first)
            head = "/".join(segs[:i])
            if segs[i] != "state" or head in looked:
                continue
            looked.add(head)
            node = _node_at(skeleton, head, lists=True)
            kids = {k: c for k, c in node["items"] if k in ("state", "param_groups")} if (
                node is not None and node["t"] == "dict") else {}
            if (len(kids) == 2 and kids["state"]["t"] == "dict" and not kids["state"]["items"]
                    and kids["param_groups"]["t"] in _SEQUENCES):
                found.append(head)
                break
    return found


def _copied_state_dicts(saved: dict[str, Any], target: dict[str, Any]
                        ) -> list[tuple[str, str]]:
    """(path, kind) of the target's plain dicts near its root shaped as an optimizer's, an
    LR scheduler's or a GradScaler's ``state_dict()`` whose values beside the tensors
    differ from the checkpoint's: a load in place changes those in the dict, a copy, and
    not in the live object (a trial's resume got its moments back, and its learning rate
    not)."""
    found: list[tuple[str, str]] = []

    def walk(node: dict[str, Any], path: str, depth: int) -> None:
        # (theirs are small dicts: a model's state dict of 50,000 keys is not made a set)
        keys = {k for k, _ in node["items"] if type(k) is str} if (
            len(node["items"]) <= 32) else set()
        kind = ("optimizer" if {"state", "param_groups"} <= keys else
                "LR scheduler" if {"last_epoch", "_step_count"} <= keys else
                "GradScaler" if {"scale", "growth_factor", "_growth_tracker"} <= keys else None)
        if kind is not None:
            part = "param_groups" if kind == "optimizer" else ""
            mine = _node_at(node, part)
            theirs = _node_at(saved, join_path(path, part) if part else path)
            if theirs is not None and mine is not None and theirs != mine and not (
                    kind == "optimizer" and _named_params(mine)):
                found.append((path, kind))
            return
        if depth < 3:  # (where state trees hold them: a model's state dict is not walked)
            for k, child in node["items"]:
                if child["t"] == "dict":
                    walk(child, join_path(path, k), depth + 1)

    if target["t"] == "dict":
        walk(target, "", 0)
    return found


def _named_params(groups: dict[str, Any]) -> bool:
    """Whether parameter groups name their parameters (DCP's get_state_dict does, by
    their names in the model), not number them as an optimizer's own state_dict() does:
    such a dict is made to be handed to set_state_dict, not taken for the optimizer."""
    for g in groups.get("items", []):
        params = _node_at(g, "params")
        if params is not None and params["t"] in _SEQUENCES and any(
                c["t"] == "str" for c in params["items"]):
            return True
    return False


def _view_of(t: torch.Tensor) -> tuple[Any, ...]:
    """Where and how a target shows its elements: two targets alike here are one view
    (tied), not overlapping views such as ``t`` and ``t.t()``."""
    return (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


def _content(entry: Any) -> tuple[Any, ...]:
    """What tells two saved tensors' values apart: dtype, shape and their chunks' boxes
    and checksums (equal checksums: the same bytes, as a load would check them)."""
    return (entry.dtype, tuple(entry.shape),
            tuple((c.offsets, c.lengths, c.checksums) for c in entry.chunks))


def _refuse_absent(manifest: Manifest, label: Path) -> None:
    """A load of the whole checkpoint: _not_held, if it is a partial view that names
    tensors it does not hold."""
    if manifest.partial:
        absent = [p for p, k in saved_paths(manifest).items() if k not in manifest.tensors]
        if absent:
            raise _not_held(label, absent)
        part = [k for k, e in manifest.tensors.items()
                if sum(math.prod(c.lengths) for c in e.chunks) != math.prod(e.shape)]
        if part:  # ("holds 4 of the 8 wanted elements" said nothing of the cause)
            raise CheckpointNotFoundError(
                f"{label} holds only part of {few(part)} (the boxes of the rank that serves "
                "it): a load with no target asks for whole tensors; pass a target whose "
                "tensors ask for the boxes it holds (DTensors, or shards=), or leave those "
                "out (exclude=)")


def _not_held(label: Path, paths: list[str]) -> CheckpointNotFoundError:
    """The paths a partial view names but does not hold: a replicated tensor (Adam's
    step counts under FSDP2, a replicated bias) is written by one rank of a group, and the
    other ranks' views hold their copies of it, unless making them failed."""
    return CheckpointNotFoundError(
        f"{label} does not hold {few(paths)}: another rank of the peer's group wrote these "
        "(a replicated tensor is written by one rank), and the peer could not offer its "
        "copies of them (its log says why); fetch them from that rank's peer, or leave them "
        "out (exclude=, or a target without them and ignore_unexpected=True)")


def _unfillable(t: torch.Tensor, writable: _WritableMemory,
                spans: dict[int, _Span | None]) -> str | None:
    """Why a load cannot read into ``t`` in place: "unwritable" (read-only memory: a
    copy into it kills the process) or "overlapping" (elements that share memory: a copy
    raises half-way); None if it can. Notes its span in ``spans``, by ``id``."""
    span = spans[id(t)] = _tensor_span(t)
    if span is not None and span[0] == "cpu" and not writable.covers(span[1], span[2]):
        return "unwritable"
    if _overlaps_itself(t):
        return "overlapping"
    return None


class _WritableMemory:
    """Which address ranges of this process can be written, from /proc/self/maps (read
    once, on first use). Where that cannot be read, every range counts as writable (a
    direct read into read-only memory still fails cleanly, with EFAULT)."""

    def __init__(self) -> None:
        self._ranges: list[tuple[int, int]] | None = None
        self._starts: list[int] = []

    def covers(self, lo: int, hi: int) -> bool:
        """Whether every byte from ``lo`` to ``hi`` (a tensor's span) is writable memory."""
        if self._ranges is None:
            self._ranges = _writable_ranges()
            self._starts = [lo for lo, _ in self._ranges]
        if not self._ranges:
            return True  # unknown: nothing to tell by
        i = bisect.bisect_right(self._starts, lo) - 1
        return i >= 0 and self._ranges[i][1] >= hi


def _writable_ranges() -> list[tuple[int, int]]:
    """The writable mappings of this process, adjacent ones merged ([] if unknown)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out: list[tuple[int, int]] = []
    for line in lines:
        fields = line.split(maxsplit=2)
        if len(fields) < 2 or fields[1][1:2] != b"w":
            continue
        a, _, b = fields[0].partition(b"-")
        lo, hi = int(a, 16), int(b, 16)
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def _overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` are one memory location.

    torch answers at once for the usual layouts (it refuses to copy into such a tensor)
    but says "too hard to tell" for others, e.g. an ``as_strided`` view with strides
    (1, 1): those are settled here, exactly for up to ``_OVERLAP_EXACT`` elements (a
    layout that large and that odd is refused: it may overlap)."""
    if t.is_contiguous():
        return False  # the usual target: every element has bytes of its own
    check = getattr(torch, "_debug_has_internal_overlap", None)
    verdict = int(check(t)) if check is not None else 2
    if verdict != 2:
        return verdict == 1
    if t.numel() <= 1:
        return False
    dims = sorted((st, n) for n, st in zip(t.shape, t.stride(), strict=True) if n > 1)
    span = 0  # the furthest element the smaller strides reach: nested, nothing meets
    for st, n in dims:
        if st <= span:
            break
        span += st * (n - 1)
    else:
        return False
    if t.numel() > _OVERLAP_EXACT:
        return True
    offsets = torch.zeros((), dtype=torch.int64)
    for st, n in dims:
        offsets = (offsets.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * st)
    flat = offsets.flatten().sort().values
    return bool((flat[1:] == flat[:-1]).any())


_OVERLAP_EXACT = 1 << 22


def castable(saved: torch.dtype, target: torch.dtype) -> bool:
    """Whether ``cast=True`` loads a tensor saved as ``saved`` into one of dtype ``target``:
    floating into floating (bf16 weights into fp32 master weights), integer into integer,
    complex into complex; never between kinds (a bool tensor, an int into a float), nor
    where this torch cannot copy one into the other (float4, which it only holds)."""
    if saved.is_floating_point or target.is_floating_point:
        kin = saved.is_floating_point and target.is_floating_point
    elif saved.is_complex or target.is_complex:
        kin = saved.is_complex and target.is_complex
    else:
        kin = torch.bool not in (saved, target)
    return kin and _torch_casts(saved, target)


@functools.cache
def _torch_casts(saved: torch.dtype, target: torch.dtype) -> bool:
    """Whether this torch copies one element of ``saved`` into ``target`` and tells what
    it put out of range (a cast it cannot do raises mid-load, the load half done)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (complex32: "experimental")
            src = torch.zeros(1, dtype=torch.uint8).view(saved) if saved.itemsize == 1 \
                else torch.zeros(1, dtype=saved)
            torch.empty(1, dtype=target).copy_(src)
            out_of_range(src, target)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def _sharing_memory(dests: Mapping[str, list[torch.Tensor]],
                    copies: Mapping[int, np.ndarray],
                    known: Mapping[int, _Span | None] | None = None) -> list[str]:
    """The saved keys whose targets share memory with another target (of any key).

    Reader threads must not fill one memory from two keys at once (each hashes what
    it wrote): such keys are loaded into temporaries and copied in order instead.
    Byte ranges that overlap are settled element by element (up to ``_OVERLAP_EXACT``
    elements a run), so interleaved views whose elements are apart (the fields of a
    numpy record array, every other row) do not count as sharing. ``known``: the spans
    of the targets, by ``id``, as :func:`_match` found them (of every target it listed).
    """
    known = known or {}
    if not copies and len(known) == sum(map(len, dests.values())) and _apart(known.values()):
        # The usual answer, found in numpy: as many spans known as targets listed, so no
        # target is listed twice (under two keys), and no two spans share a byte. (~4x
        # faster than the sweep below at 100,000 targets.)
        return []
    spans: list[tuple[str, int, int, int, torch.Tensor | np.ndarray]] = []
    for i, tensors in enumerate(dests.values()):
        for t in tensors:
            arr = copies.get(id(t)) if copies else None
            if arr is not None:
                span = _array_span(arr)
            else:
                span = known[id(t)] if id(t) in known else _tensor_span(t)
            if span is not None:
                spans.append((span[0], span[1], span[2], i, t if arr is None else arr))
    spans.sort(key=operator.itemgetter(0, 1, 2))
    shared: set[int] = set()
    group: list[tuple[int, torch.Tensor | np.ndarray]] = []
    device, end = "", 0

    def close_run() -> None:
        if len(group) > 1:  # (two targets of one key count too: the copy from one into
            shared.update(_truly_sharing(group))  # the other would read what it overwrites)

    for dev, lo, hi, k, target in spans:
        if dev != device or lo >= end:  # a new run of overlapping ranges
            close_run()
            group, device, end = [], dev, hi
        group.append((k, target))
        end = max(end, hi)
    close_run()
    return [k for i, k in enumerate(dests) if i in shared]


def _apart(spans: Iterable[_Span | None]) -> bool:
    """Whether no two of these spans (device, first byte, end byte; None: no memory)
    share a byte. False also when it cannot tell cheaply (an address past 2**62)."""
    by_device: dict[str, list[int]] = {}
    for span in spans:
        if span is None:
            continue
        dev, lo, hi = span
        got = by_device.get(dev)
        if got is None:
            got = by_device[dev] = []
        got += (lo, hi)
    for bounds in by_device.values():
        if len(bounds) <= 2:
            continue
        if max(bounds) >= 1 << 62:
            return False
        b = np.array(bounds, dtype=np.int64).reshape(-1, 2)
        b = b[np.argsort(b[:, 0], kind="stable")]
        # sorted by start: each span must start at or past the furthest end before it
        if not (b[1:, 0] >= np.maximum.accumulate(b[:-1, 1])).all():
            return False
    return True


def _truly_sharing(run: list[tuple[int, torch.Tensor | np.ndarray]]) -> set[int]:
    """Of targets whose byte ranges overlap (none overlapping itself), the keys of those
    with an element's bytes in another's; all of them past ``_OVERLAP_EXACT`` elements."""
    if sum(int(t.numel() if isinstance(t, torch.Tensor) else t.size)
           for _, t in run) > _OVERLAP_EXACT:
        return {k for k, _ in run}
    starts, ends, owners = [], [], []
    for i, (_, t) in enumerate(run):
        if isinstance(t, torch.Tensor):
            ptr, size = t.data_ptr(), t.element_size()
            dims = [(n, st * size) for n, st in zip(t.shape, t.stride(), strict=True)]
        else:
            ptr, size = t.__array_interface__["data"][0], t.itemsize
            dims = list(zip(t.shape, t.strides, strict=True))
        at: np.ndarray = np.full((), ptr, dtype=np.int64)
        for n, st in dims:
            at = at[..., None] + np.arange(n, dtype=np.int64) * st
        at = at.ravel()
        starts.append(at)
        ends.append(at + size)
        owners.append(np.full(at.shape, i, dtype=np.int64))
    lo, hi, who = np.concatenate(starts), np.concatenate(ends), np.concatenate(owners)
    order = np.argsort(lo, kind="stable")
    lo, hi, who = lo[order], hi[order], who[order]
    # Sweep by start: an element overlaps an earlier one iff it starts before the
    # furthest end so far; that end is another target's (a target's own elements are
    # apart), the one it overlaps.
    reach = np.maximum.accumulate(hi)
    at_max = np.maximum.accumulate(np.where(hi == reach, np.arange(len(hi)), 0))
    hit = np.nonzero(lo[1:] < reach[:-1])[0]
    idx = {int(i) for i in who[hit + 1]} | {int(i) for i in who[at_max[hit]]}
    return {run[i][0] for i in idx}


_Span = tuple[str, int, int]


def _tensor_span(t: torch.Tensor) -> _Span | None:
    """(device, first byte, end byte) of the memory a tensor's elements lie in; None when
    it has none."""
    if t.is_contiguous():  # the usual target: no strides to walk
        n = t.nbytes
        if not n:
            return None
        lo = t.data_ptr()
        return "cpu" if t.is_cpu else str(t.device), lo, lo + n
    if t.numel() == 0:
        return None
    lo = t.data_ptr()
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return str(t.device), lo, lo + (last + 1) * t.element_size()


def _array_span(a: np.ndarray) -> tuple[str, int, int] | None:
    """:func:`_tensor_span` of a numpy array, whose strides may be negative."""
    if a.size == 0:
        return None
    ptr = a.__array_interface__["data"][0]
    steps = [(n - 1) * s for n, s in zip(a.shape, a.strides, strict=True)]
    lo = ptr + sum(x for x in steps if x < 0)
    return "cpu", lo, ptr + sum(x for x in steps if x > 0) + a.itemsize


def _compare_skeletons(saved: dict[str, Any], want: dict[str, Any], path: str,
                       lenient: set[str], whole: set[str], missing: list[str],
                       mismatched: list[str], unexpected: list[str], told: set[str]) -> None:
    """Walk the checkpoint's and the target's skeletons together: target dict keys the
    checkpoint lacks and that hold no arrays go to ``missing`` (those holding arrays are
    there already); keys of another type go to ``mismatched``, their paths to ``told``.
    The stateful objects at ``whole`` (optimizers...) take the checkpoint's state as it
    is: not walked; those ``lenient`` take what the checkpoint holds beyond theirs: only
    what they lack is told."""
    if saved == want:  # the common case for whole subtrees (a model's): compared in C
        return
    module = False
    if want["t"] == "stateful":
        if path in whole:
            return
        want = want["state"]
        module = path not in lenient
    if saved["t"] == "stateful":
        saved = saved["state"]
    if module and saved["t"] == "dict" and want["t"] == "dict":
        # a module's load_state_dict refuses keys it lacks (e.g. an _extra_state its class
        # no longer has): say so before any read. Keys holding arrays are the refs' to tell.
        have = {escape_key(k) for k, _ in want["items"]}
        unexpected.extend(join_path(path, k) for k, c in saved["items"]
                          if escape_key(k) not in have and next(iter_array_nodes(c), None) is None)
    if saved["t"] == "dict" and want["t"] == "dict":
        by_seg = {escape_key(k): (k, c) for k, c in saved["items"]}
        for k, child in want["items"]:
            here = join_path(path, k)
            got = by_seg.get(escape_key(k))
            if got is None:
                if next(iter_array_nodes(child), None) is None:
                    missing.append(here)
            elif type(got[0]) is not type(k):
                mismatched.append(f"{here}: the checkpoint's key is {got[0]!r}, the target's "
                                  f"{k!r} (one path, but not one key: key the target's dict "
                                  f"by {type(got[0]).__name__}s as the saved one is, or load "
                                  "with state=None and convert)")
                told.add(here)
            else:
                _compare_skeletons(got[1], child, here, lenient, whole, missing, mismatched,
                                   unexpected, told)
    elif saved["t"] in _SEQUENCES and want["t"] in _SEQUENCES:
        for i, (a, b) in enumerate(zip(saved["items"], want["items"], strict=False)):
            _compare_skeletons(a, b, join_path(path, i), lenient, whole, missing,
                               mismatched, unexpected, told)
    elif want["t"] == "dict" or want["t"] in _SEQUENCES:
        # the checkpoint's value would replace the target's container, and all it holds
        mismatched.append(f"{path or '<root>'}: the checkpoint holds {_a(saved['t'])}, the "
                          f"target {_a(want['t'])}")
        told.add(path)


def _grown_object(target: FlatState, path: str) -> list[str]:
    """The object of the user's (no module, optimizer or LR scheduler: their tensors keep
    their shapes) whose state holds ``path``, in words; [] if none does."""
    owners = [p for p in target.statefuls if p == "" or path.startswith(p + "/")]
    if not owners:
        return []
    owner = max(owners, key=len)
    obj = target.statefuls[owner][0]
    if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer,
                        torch.optim.lr_scheduler.LRScheduler)):
        return []
    return [f"the {type(obj).__qualname__} at {owner or '<root>'!r}"]


def _compare_param_groups(skeleton: dict[str, Any], target: FlatState, lenient: list[str],
                          mismatched: list[str], told: set[str],
                          manifest_paths: dict[str, str] | None = None,
                          manifest_tensors: Mapping[str, Any] | None = None) -> None:
    """An optimizer's load_state_dict refuses a checkpoint with other parameter groups,
    but only after the tensors before it were loaded in place: say so before any read.
    With the saved paths and shapes, the moments of torch's optimizers are checked
    against the shapes of the parameters they go to (see _check_moment_shapes)."""
    for path in lenient:
        obj = target.statefuls[path][0]
        if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
            _warn_other_scheduler(skeleton, path, obj, bool(path) and _excludable(target, path))
        if not isinstance(obj, torch.optim.Optimizer):
            continue
        node = _node_at(skeleton, path, lists=True)
        groups = None if node is None else _node_at(node, "param_groups")
        mine = _node_at(target.skeleton, path, lists=True)
        if groups is None and node is not None and _inner(node)["t"] == "dict" and (
                path not in told) and mine is not None and (
                _node_at(mine, "param_groups") is not None):
            # (only where the target's own state dict has them: a subclass's state_dict()
            # of another layout, such as two optimizers in one, has none either side)
            # its load_state_dict raised KeyError 'param_groups' with the tensors before
            # it loaded: a trial's key_map had moved the saved optimizer's tensors here,
            # and a key_map moves tensors only
            mismatched.append(
                f"{path or '<root>'}: the checkpoint holds no optimizer state dict there (no "
                f"param_groups) for the target's {type(obj).__qualname__}; a key_map moves "
                "tensors only, and an optimizer's param_groups stay at the saved name: to "
                "load it under another name, give the optimizer the saved name in the "
                "target instead")
            told.add(path)
            continue
        if groups is None or groups["t"] not in _SEQUENCES:
            continue  # not an optimizer's state dict: its load_state_dict will say
        params = [_node_at(g, "params") for g in groups["items"]]
        saved = [len(p["items"]) if p is not None and p["t"] in _SEQUENCES else None
                 for p in params]
        # the ids its state is keyed by, in order (torch numbers them across the groups)
        ids: list[Any] | None = [c.get("v") for p in params if p is not None and p["t"] in
                                 _SEQUENCES for c in p["items"]]
        want = [len(g["params"]) for g in obj.param_groups]
        holder = _node_at(skeleton, path, stateful=True, lists=True)
        cls = holder.get("cls") if holder is not None and holder["t"] == "stateful" else None
        # (cls None: saved as a plain dict, an optimizer's state_dict() converted from a
        # torch.save file, whose class nobody knows: its groups are looked at as well)
        lacks = _settings_lacking(groups, obj, settings_only=cls is None) if (
            saved == want and cls != type(obj).__qualname__) else []
        if lacks:
            # (torch's load_state_dict takes the saved groups as they are: an SGD given
            # AdamW's loaded, and its first step() raised KeyError 'momentum' (trials))
            mismatched.append(
                f"{path or '<root>'}: the checkpoint's optimizer ({cls or 'of another kind'}"
                f"{'' if cls else ', or of another version'}) "
                f"has parameter groups without {', '.join(map(repr, lacks[:6]))}, which the "
                f"target {type(obj).__qualname__} needs (its load_state_dict would take the "
                "saved groups, and its first step() fail)" + _afresh(target, path, "optimizer"))
            told.add(path)
        elif isinstance(cls, str) and cls != type(obj).__qualname__ and saved == want:
            # (torch's load_state_dict takes another class's groups as they are: a trial's
            # AdamW state loaded into SGD silently, then its step() raised KeyError)
            _say("loading the optimizer state at %r saved by %s into a %s: its "
                 "parameter groups keep %s's settings (torch loads them as they are); "
                 "%s", path or "<root>", cls, type(obj).__qualname__, cls,
                 f"to start this optimizer afresh instead, pass exclude=[{path!r}]"
                 if path and _excludable(target, path) else "load it into a " + cls)
        if saved == want and isinstance(ids, list):
            _check_moment_shapes(manifest_paths, manifest_tensors, target.refs, path, obj, ids,
                                 mismatched, told, bool(path) and _excludable(target, path))
        if saved != want:
            # (a model grown by a layer: strict=False cannot help, leaving it out does)
            added = ("; if the saved run added groups (add_param_group), add them before "
                     "loading" if len(saved) > len(want) else "")
            fresh = added + _afresh(target, path, "optimizer",
                                    regrouped=len(saved) != len(want))
            mismatched.append(f"{path or '<root>'}: the checkpoint's optimizer has parameter "
                              f"groups of {saved} parameters, the target's {want}{fresh}")
            told.add(path)


def _afresh(target: FlatState, path: str, what: str, regrouped: bool = False) -> str:
    """The advice that leaves the object at ``path`` out of a load, to start it afresh
    (``regrouped``: an optimizer with another number of parameter groups)."""
    if path and _excludable(target, path):
        return (f"; to load the rest and start this {what} afresh, pass exclude=[{path!r}]"
                + _schedulers_of(target, path, regrouped))
    if path:  # (an item of a list: exclude= reaches into dicts and modules only)
        return (f"; to load the rest and start this {what} afresh, hold the parts in a dict "
                f"({{'model': ..., 'optim': ...}}) and leave it out with exclude=")
    return ""


def _schedulers_of(target: FlatState, path: str, regrouped: bool = False) -> str:
    """What to know of the target's LR schedulers that step the optimizer at ``path``, when
    it starts afresh: a trial followed the advice above, and the scheduler, loaded, went on
    from the saved step while the fresh optimizer kept its initial learning rates (the next
    lr 8x too low, no warning)."""
    obj = target.statefuls.get(path, (None, None))[0]
    tied = sorted(p for p, (o, _) in target.statefuls.items()
                  if p and p != path and isinstance(o, torch.optim.lr_scheduler.LRScheduler)
                  and getattr(o, "optimizer", None) is obj is not None)
    if not tied:
        return ""
    one = len(tied) == 1
    it = "it" if one else "them"
    if regrouped:  # (a re-check trial: LambdaLR's step() then raised in zip())
        return (f" (exclude its LR scheduler{'' if one else 's'} too, "
                f"exclude={[path, *tied]!r}: {it} saved one learning rate per parameter "
                f"group, for another number of groups than this optimizer's, which {it} "
                "cannot step)")
    return (f" (its LR scheduler{'' if one else 's'} at {', '.join(map(repr, tied))} would "
            "still load and go on from the saved step, while this optimizer's learning "
            f"rates start at their initial values: exclude {it} too, "
            f"exclude={[path, *tied]!r}, to restart the schedule, or set each "
            "param_group's 'lr' after the load)")


def _warn_other_scheduler(skeleton: dict[str, Any], path: str, obj: Any,
                          excludable: bool) -> None:
    """An LR scheduler's load_state_dict sets every saved attribute on it, whatever class
    saved them (a trial's OneCycleLR state went into a CosineAnnealingLR silently, which
    then carried OneCycleLR's total_steps and phases): warn, as of an optimizer's."""
    holder = _node_at(skeleton, path, stateful=True, lists=True)
    cls = holder.get("cls") if holder is not None and holder["t"] == "stateful" else None
    if isinstance(cls, str) and cls != type(obj).__qualname__:
        _say("loading the LR scheduler state at %r saved by %s into a %s: torch's "
             "load_state_dict sets %s's attributes on it as they are; %s",
             path or "<root>", cls, type(obj).__qualname__, cls,
             f"to start this scheduler afresh instead, pass exclude=[{path!r}]"
             if excludable else "load it into a " + cls)


def _settings_lacking(groups: dict[str, Any], obj: Any, *,
                      settings_only: bool = False) -> list[str]:
    """The settings the optimizer ``obj`` has in its groups that some saved group (of the
    skeleton node ``groups``) lacks: torch's load_state_dict replaces the groups with the
    saved ones (keeping only ``params``), so the optimizer would step without them.
    ``settings_only``: of its defaults alone (a plain dict saved, of no known class: keys
    an LR scheduler or a subclass added to the groups are not the optimizer's settings)."""
    # (torch keeps the target's own param_names where the saved groups lack them, and an
    # LR scheduler's initial_lr is the scheduler's, set again as it is made: no refusal)
    have = {k for g in obj.param_groups for k in g
            if k not in ("params", "param_names", "initial_lr")
            and (not settings_only or k in obj.defaults)}
    lacks: list[str] = []
    saved: list[set[str]] = []
    for g in groups["items"]:
        if g is None or g.get("t") != "dict":
            return []  # (not groups as torch saves them: its load_state_dict will say)
        saved.append({k for k, _ in g["items"] if isinstance(k, str)})
        lacks += [k for k in sorted(have - saved[-1]) if k not in lacks]
    if not lacks:
        return []
    # What the optimizer's own __setstate__ fills in (torch's optimizers set the settings
    # newer versions added): given the saved groups' keys alone, as load_state_dict does.
    try:
        probe = object.__new__(type(obj))
        probe.__setstate__({"defaults": dict(obj.defaults), "state": {},
                            "param_groups": [{**dict.fromkeys(keys), "params": []}
                                             for keys in saved]})
        filled = set.intersection(*(set(g) for g in probe.param_groups))
    except Exception:  # (an optimizer of the user's: not to be second-guessed)
        return []
    return [k for k in lacks if k not in filled]


# torch's optimizers whose every state tensor with a dimension has its parameter's shape
# (not LBFGS's flat vectors, nor Adafactor's factored rows and columns)
_PARAM_SHAPED_STATE = ("Adam", "AdamW", "SGD", "RMSprop", "Adagrad", "Adadelta", "Adamax",
                       "NAdam", "RAdam", "Rprop", "ASGD", "SparseAdam")


def _check_moment_shapes(paths: dict[str, str] | None, tensors: Mapping[str, Any] | None,
                         refs: Mapping[str, str], path: str, obj: Any, ids: list[Any],
                         mismatched: list[str], told: set[str], excludable: bool) -> None:
    """A torch optimizer whose state is made lazily takes the saved moments whole, of any
    shape: a resized parameter's (a trial's embedding grown from 50 to 60 rows) loaded, and
    the first step() raised a size mismatch. Refuse it before any read, as a stepped
    optimizer's own moments of another shape are."""
    if paths is None or tensors is None or type(obj).__name__ not in _PARAM_SHAPED_STATE \
            or type(obj).__module__.split(".")[0] != "torch":
        return
    params = [p for g in obj.param_groups for p in g["params"]]
    if len(ids) != len(params):
        return
    lazy = torch.nn.parameter.is_lazy  # (no shape yet: its module's first forward makes it)
    by_id = {str(i): p for i, p in zip(ids, params, strict=True)}
    head = f"{path}/state/" if path else "state/"
    found: list[tuple[str, str, tuple[int, ...], Any]] = []
    saved: dict[str, tuple[int, ...]] = {}  # (a parameter-shaped moment's shape, by id)
    for saved_path, key in paths.items():
        if not saved_path.startswith(head):
            continue
        pid, _, _name = saved_path[len(head):].partition("/")
        p = by_id.get(pid)
        entry = tensors.get(key)
        shape = None if entry is None else tuple(entry.shape)
        if p is None or not shape or lazy(p):
            continue
        saved.setdefault(pid, shape)
        if saved_path not in refs and tuple(p.shape) != shape:
            # (a moment the target holds is matched as any tensor, below)
            found.append((saved_path, pid, shape, p))
    if not found:
        return
    # (a trial built its optimizer over the parameters reversed: told "a parameter
    # resized since"; the saved moments fit the target's parameters in another order)
    reordered = len(saved) == len(params) and sorted(saved.values()) == sorted(
        tuple(p.shape) for p in params)
    leave = f"leave the optimizer out with exclude=[{path!r}]" if excludable else ""
    why = ("the optimizer's parameters come in another order than when it was saved: "
           "build it over them in the saved order (e.g. model.parameters())"
           + (f"; or {leave}" if leave else "")) if reordered else (
        f"a parameter resized since: {leave}" if leave else "")
    for i, (saved_path, pid, shape, p) in enumerate(found):
        advice = f" ({why})" if why and not i else ""
        mismatched.append(f"{saved_path}: checkpoint {list(shape)}, parameter {pid} of the "
                          f"target {type(obj).__name__} {list(p.shape)}{advice}")
        told.add(saved_path)


_KIND_WORDS = {"tensor": "a tensor", "ndarray": "a numpy array", "npscalar": "a numpy scalar",
               "dict": "a dict", "list": "a list", "tuple": "a tuple", "none": "None",
               "bool": "a bool", "int": "an int", "float": "a float", "str": "a str",
               "bytes": "bytes", "stateful": "an object with state_dict()"}


def _kinds_apart(saved: dict[str, Any], want: dict[str, Any], missing: list[str],
                 unexpected: list[str], mismatched: list[str], said: set[str]) -> None:
    """Paths holding an array on one side and a plain value (or container) on the other
    go from ``missing`` / ``unexpected`` to ``mismatched``, told as such: "missing" sent
    the user to strict=False, "unexpected" to ignore_unexpected=True, which then left
    the value as it was without a word."""
    told: set[str] = set()  # (``said``: the paths the mismatches told already)
    children: dict[int, dict[str, Any]] = {}  # (a dict's children by name, once each)
    for paths, there, here in ((missing, saved, want), (unexpected, want, saved)):
        for p in paths:
            if p in told or p in said:
                told.add(p)
                continue
            other = _node_at(there, p, children=children, lists=True)
            mine = _node_at(here, p, children=children, lists=True)
            if other is None or mine is None or other["t"] in ARRAY_NODES:
                continue
            ours, theirs = (mine, other) if here is want else (other, mine)
            none = (" (a load fills tensors in place: put one of the saved shape there "
                    "first, e.g. torch.zeros_like, or load with state=None)"
                    if ours["t"] == "none" and theirs["t"] in ARRAY_NODES else "")
            mismatched.append(f"{p or '<root>'}: the checkpoint holds "
                              f"{_KIND_WORDS.get(theirs['t'], '?')}"
                              f", the target {_KIND_WORDS.get(ours['t'], '?')}{none}")
            told.add(p)
    if told:  # (and what the other side holds inside it: "a" told, "a/x" is no news)
        def untold(p: str) -> bool:
            return not any(p[:i] in told for i, c in enumerate(p) if c == "/") and p not in told

        missing[:] = [p for p in missing if untold(p)]
        unexpected[:] = [p for p in unexpected if untold(p)]


def _node_at(node: dict[str, Any], path: str, *, stateful: bool = False,
             children: dict[int, dict[str, Any]] | None = None,
             lists: bool = False) -> dict[str, Any] | None:
    """The skeleton node at ``path`` under ``node`` (through stateful nodes), or None;
    with ``stateful``, a stateful node there itself rather than its state. ``children``
    keeps each dict's children by name between calls (for many paths: one pass over a
    dict's items each, not one per path)."""
    for seg in path.split("/") if path else []:
        if node["t"] == "stateful":
            node = node["state"]
        if lists and node["t"] in _SEQUENCES:  # (an item: [model, optimizer], checked as
            # in a dict by the checks that ask; not by the advice of a key_map, a dict's)
            i = int(seg) if seg.isdigit() and seg.isascii() else -1
            if not 0 <= i < len(node["items"]):
                return None
            node = node["items"][i]
            continue
        if node["t"] != "dict":
            return None
        if children is None:
            found: dict[str, Any] | None = next(
                (c for k, c in node["items"] if escape_key(k) == seg), None)
        else:
            named = children.get(id(node))
            if named is None:
                named = children[id(node)] = {}
                for k, c in node["items"]:
                    named.setdefault(escape_key(k), c)  # (the first, as the scan finds)
            found = named.get(seg)
        if found is None:
            return None
        node = found
    return node["state"] if node["t"] == "stateful" and not stateful else node


_SEQUENCES = ("list", "tuple")


def _counter_of_a_copy(target: FlatState, path: str) -> bool:
    """Whether ``path`` of a plain dict (a module's state_dict() copy, no module in the
    tree) is a batch-norm counter: a 0-dim int64 beside its layer's running statistics."""
    head = path[:-len("num_batches_tracked")]
    if head and head[-1] not in "./":
        return False
    key = target.refs.get(path)
    t = target.tensors.get(key) if key is not None else None
    return (t is not None and t.dim() == 0 and t.dtype == torch.int64
            and head + "running_mean" in target.refs and head + "running_var" in target.refs)


def _without_untracked_counts(target: FlatState, missing: list[str],
                              step_dir: Path) -> list[str]:
    """``missing`` less the ``num_batches_tracked`` counters of batch-norm layers, which
    keep their value, as ``load_state_dict`` keeps it: weights saved before the counter
    existed, or by tools that drop it (many published files), lack it."""
    kept: list[str] = []
    for p in missing:
        if p.endswith("num_batches_tracked"):
            holders = [s for s, (obj, _) in target.statefuls.items()
                       if isinstance(obj, torch.nn.Module) and _within(p, s)]
            if holders:
                s = max(holders, key=len)
                name = p[len(s) + 1:] if s else p
                sub, _, leaf = name.rpartition(".")
                try:
                    mod = target.statefuls[s][0].get_submodule(sub)
                except AttributeError:
                    mod = None
                if leaf == "num_batches_tracked" and isinstance(
                        mod, torch.nn.modules.batchnorm._NormBase):
                    kept.append(p)
                    continue
            elif _counter_of_a_copy(target, p):
                kept.append(p)
                continue
    if not kept:
        return missing
    log.info("loading %s: %s keep their values (batch-norm counters the checkpoint does "
             "not hold, as load_state_dict keeps them)", step_dir, few(kept))
    held = set(kept)
    return [p for p in missing if p not in held]


def _within(path: str, subtree: str) -> bool:
    """Whether ``path`` is ``subtree`` or under it (``""``: the root, holding all)."""
    return subtree == "" or path == subtree or path.startswith(subtree + "/")


def _a(kind: str) -> str:
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"


def _refuse_plain_state_for_dtensor_params(saved: dict[str, str], target: FlatState,
                                           lenient: list[str], step_dir: Path) -> None:
    """An optimizer of DTensor parameters (FSDP2) with no state yet would get the
    checkpoint's state as whole plain tensors, and fail at its next step() with "mixed
    torch.Tensor and DTensor": refuse before reading anything, and say what works."""
    for path in lenient:
        obj = target.statefuls[path][0]
        if not isinstance(obj, torch.optim.Optimizer) or not any(
                type(p).__name__ == "DTensor" for g in obj.param_groups for p in g["params"]):
            continue
        prefix = path + "/" if path else ""
        fresh = [p for p in saved if p.startswith(prefix) and p not in target.refs]
        if fresh:
            where = path or "<root>"
            # Saved as the object, its moments are keyed by parameter index ("state/0/...")
            # and an optimizer state dict of get_state_dict's, keyed by name, does not take
            # them (a DCP trial followed that advice into missing and unexpected keys):
            # the object with its state made first does.
            by_index = any(p[len(prefix):].split("/")[:2][-1].isdecimal()
                           for p in fresh if p[len(prefix):].startswith("state/"))
            todo = ("call get_state_dict(model, optim) once before the load (torch."
                    "distributed.checkpoint.state_dict: it makes the optimizer's state, as "
                    "DTensors), then load the objects again; and save get_state_dict(model, "
                    "optim)[1] from now on" if by_index else
                    "load its state dict instead: osd = get_state_dict(model, optim)[1] "
                    "(torch.distributed.checkpoint.state_dict), load into {'optim': osd}, "
                    "then set_state_dict(...)")
            raise StateMismatchError(
                f"cannot load {step_dir}: the optimizer at {where!r} has DTensor parameters "
                f"(FSDP2) but no state yet, so {few(fresh, 3)} would come back as whole plain "
                f"tensors; {todo} (see examples/train_fsdp.py)", mismatched=fresh)


# What wrapping a module does to its state dict's keys: each wrapper puts its own name
# before its module's keys (DDP's "module.", torch.compile's "_orig_mod."). A checkpoint
# saved through a wrapper does not load into the bare module, nor the other way round,
# and the two lists of keys alone leave the user to spot why.
_WRAPPERS = {
    "_orig_mod.": "torch.compile",
    "module.": "DistributedDataParallel / DataParallel (or AveragedModel, an EMA copy)",
    "_fsdp_wrapped_module.": "FSDP (FullyShardedDataParallel)",
    "_checkpoint_wrapped_module.": "activation checkpointing",
}


def _wrapper_names(parts: Iterable[str]) -> str:
    """Wrapper parts (``"module."``) as a regex alternation of their names."""
    return "|".join(re.escape(p[:-1]) for p in parts)


def _whole_parts(parts: Iterable[str]) -> str:
    """A regex of any of the wrapper ``parts`` standing as a whole name of a path (after
    its start, a ``/`` or a ``.``): ``module.`` but not ``submodule.``."""
    return rf"(?:^|(?<=[/.]))(?:{_wrapper_names(parts)})\."


_WRAPPER_PART = re.compile(_whole_parts(_WRAPPERS))
_WRAPPER_RUN = re.compile(rf"(?:(?:{_wrapper_names(_WRAPPERS)})\.)*")  # (several in a row)
_MAX_RENAMES_SHOWN = 3  # a hint's key_map chains at most this many replacements


def _wrapper_rename(saved: str, target: str) -> tuple[str, str] | None:
    """``(old, new)``: what turns the saved path into the target's, where they differ by
    a run of wrapper parts after a common beginning that ends at a boundary (``model/``
    + ``_orig_mod.module.`` → ``model/``), both ending with that beginning; else None.
    Anchored so, a rename cannot touch a child named ``submodule``."""
    i = 0  # (characters in common)
    while i < min(len(saved), len(target)) and saved[i] == target[i]:
        i += 1
    while i > 0 and saved[i - 1] not in "/.":  # back to a boundary
        i -= 1
    run_s = _WRAPPER_RUN.match(saved, i)
    run_t = _WRAPPER_RUN.match(target, i)
    assert run_s is not None and run_t is not None  # (a run of none matches too)
    if saved[run_s.end():] != target[run_t.end():] or run_s.group(0) == run_t.group(0):
        return None
    return saved[:run_s.end()], target[:run_t.end()]


def _prefix_key_map(renames: list[tuple[str, str]]
                    ) -> tuple[Callable[[str], str], str] | None:
    """A key_map doing ``renames`` (``(old, new)`` beginnings of paths), each only at the
    start of a path (a bare ``replace`` would also rename ``ema_model/module.`` for
    ``model/module.``), the longest first; and its code. None for more than a few."""
    if not renames or len(renames) > _MAX_RENAMES_SHOWN or (
            len(renames) > 1 and any(not old for old, _ in renames)):
        return None
    ordered = sorted(renames, key=lambda r: -len(r[0]))

    def fn(path: str) -> str:
        for old, new in ordered:
            if path.startswith(old) and (old or "/" not in path):
                return new + path[len(old):]
        return path

    if len(ordered) == 1:
        old, new = ordered[0]
        # (old "": a bare state dict's keys, its module's names, have no "/" of a tree)
        return fn, (f"key_map=lambda path: {new!r} + path if '/' not in path else path"
                    if not old else f"key_map=lambda path: path.replace({old!r}, {new!r}, 1) "
                    f"if path.startswith({old!r}) else path")
    listed = ", ".join(f"({old!r}, {new!r})" for old, new in ordered)
    return fn, ("key_map=lambda path: next((new + path[len(old):] for old, new in "
                f"[{listed}] if path.startswith(old)), path)")


def _part_key_map(drop: list[str], put: str) -> tuple[Callable[[str], str], str]:
    """A key_map that replaces the wrapper parts ``drop`` with ``put`` wherever they stand
    as a whole name (not ``submodule.``): per-layer wrappers (activation checkpointing,
    FSDP1's auto-wrap) and nested ones put them all along the paths; and its code."""
    pattern = _whole_parts(drop)
    compiled = re.compile(pattern)
    return ((lambda path: compiled.sub(put, path)),
            f"key_map=lambda path: re.sub(r'{pattern}', {put!r}, path)")


def _wrapper_key_map(pairs: list[tuple[str, str]], saved_only: list[str],
                     target_only: list[str]) -> str:
    """``key_map=...`` code that maps every pair's saved path (second) to its target path
    (first): the plainest that does, checked on them; "" where none does."""
    candidates: list[tuple[Callable[[str], str], str]] = []
    renames: list[tuple[str, str]] = []
    whole = True
    for target, saved in pairs:
        r = _wrapper_rename(saved, target)
        whole = whole and r is not None
        if r is not None and r not in renames:
            renames.append(r)
    prefixed = _prefix_key_map(renames) if whole else None
    if prefixed is not None:
        candidates.append(prefixed)
    if saved_only and not target_only:
        candidates.append(_part_key_map(saved_only, ""))
    elif len(saved_only) == 1 and len(target_only) == 1:
        candidates.append(_part_key_map(saved_only, target_only[0]))
    for fn, text in candidates:
        if all(fn(saved) == target for target, saved in pairs):
            return text
    return ""


def wrapper_hint(missing: list[str], unexpected: list[str], *,
                 ignoring: bool = False) -> str:
    """A sentence for a mismatch error when most ``missing`` paths are ``unexpected``
    ones but for a wrapper's part of the keys ("module.", "_orig_mod."): which wrapper,
    and a key_map that renames exactly that part (checked on those paths); "" otherwise.
    ``ignoring``: the load passed ignore_unexpected=True already."""
    if not missing or not unexpected:
        return ""
    bare: dict[str, str] = {}
    for u in unexpected:
        bare.setdefault(_WRAPPER_PART.sub("", u), u)
    pairs = [(m, bare[b]) for m in missing if (b := _WRAPPER_PART.sub("", m)) in bare]
    if not pairs or 2 * len(pairs) < len(missing):
        return ""
    m, u = pairs[0]

    def parts(path: str) -> list[str]:
        return [x.group(0) for x in _WRAPPER_PART.finditer(path)]

    # the parts one side has and the other has not, in any pair (each named once)
    saved_only = list(dict.fromkeys(x for t, sv in pairs for x in parts(sv)
                                    if x not in parts(t)))
    target_only = list(dict.fromkeys(x for t, sv in pairs for x in parts(t)
                                     if x not in parts(sv)))
    code = _wrapper_key_map(pairs, saved_only, target_only)
    key_map = (f", or{' (with import re)' if 're.sub(' in code else ''} pass {code}"
               if code else "")  # (the code last: it is pasted as it stands)
    if saved_only and not target_only:
        names = " and ".join(repr(x) for x in saved_only)
        who = " and ".join(_WRAPPERS[x] for x in saved_only)
        # (an AveragedModel's n_averaged: a trial's key_map, followed, met it next)
        mapped = {sv for _, sv in pairs}
        extra = [x for x in unexpected if x not in mapped and _WRAPPER_PART.sub("", x) == x]
        also = (f"; {few([repr(x) for x in extra], 3)} "
                f"{'has' if len(extra) == 1 else 'have'} no counterpart in the target"
                # (passed already: a trial was told to pass what it had passed)
                + (", which ignore_unexpected=True skips" if ignoring else
                   ": with the key_map, pass ignore_unexpected=True too")
                if extra and code else "")
        return (f"; the checkpoint's keys have {names} where the target's have none, as "
                f"{who} add{'s it' if len(saved_only) == 1 else ' them'} (checkpoint {u!r}, "
                f"target {m!r}{also}): load into the module wrapped the same way{key_map}")
    if target_only and not saved_only:
        names = " and ".join(repr(x) for x in target_only)
        who = " and ".join(_WRAPPERS[x] for x in target_only)
        return (f"; the target's keys have {names} where the checkpoint's have none, as "
                f"{who} add{'s it' if len(target_only) == 1 else ' them'} (checkpoint {u!r}, "
                f"target {m!r}): load into the unwrapped module (model._orig_mod for "
                f"torch.compile, model.module for DDP){key_map}")
    return (f"; the keys differ in what wrappers add to them (checkpoint {u!r}, target "
            f"{m!r}): load into the module wrapped as the saved one was{key_map}")


def prefix_hint(missing: list[str], unexpected: list[str]) -> str:
    """A sentence for a mismatch error when most ``missing`` paths are ``unexpected`` ones
    under one more (or one less) leading part, such as ``model/``: a model-only checkpoint
    loaded into a training state, or the other way round; "" otherwise."""
    if not missing or not unexpected:
        return ""
    counts: dict[tuple[str, str], int] = {}  # (where the prefix is, prefix) -> pairs
    example: dict[tuple[str, str], tuple[str, str]] = {}
    extra = set(unexpected)
    lacking = set(missing)
    for side, paths, others in (("saved", unexpected, lacking), ("target", missing, extra)):
        for path in paths:
            for i, c in enumerate(path):
                if c == "/" and path[i + 1:] in others:
                    k = (side, path[:i + 1])
                    counts[k] = counts.get(k, 0) + 1
                    example.setdefault(k, (path, path[i + 1:]))
    if not counts:
        return ""
    (side, prefix), n = max(counts.items(), key=lambda kv: kv[1])
    if 2 * n < len(missing):
        return ""
    longer, shorter = example[(side, prefix)]
    if side == "saved":
        return (f"; the checkpoint holds the target's keys under {prefix!r} (checkpoint "
                f"{longer!r}, target {shorter!r}): nest the target there (load "
                f"{{{prefix[:-1]!r}: target}})")
    part = "".join(f"[{p!r}]" for p in prefix[:-1].split("/"))
    return (f"; the checkpoint holds at its root what the target has under {prefix!r} "
            f"(checkpoint {shorter!r}, target {longer!r}: a model-only checkpoint?): load "
            f"into that part alone, e.g. state{part}")


def _tensors_in_str_dicts(node: dict[str, Any] | None) -> bool:
    """Whether ``node`` (a skeleton node) holds nothing but dicts with str keys down to
    its arrays: all a key_map can move (items of lists, int keys as an optimizer's state
    has, plain values and stateful objects stay where they are)."""
    if node is None:
        return False
    if node["t"] in ARRAY_NODES:
        return True
    return node["t"] == "dict" and all(
        isinstance(k, str) and _tensors_in_str_dicts(c) for k, c in node["items"])


def head_hint(missing: list[str], unexpected: list[str],
              fits: Callable[[str, str], bool] | None = None,
              movable: Callable[[str, str], bool] | None = None) -> str:
    """A sentence for a mismatch error when most ``missing`` paths are ``unexpected`` ones
    with another first part (``net/0.weight`` wanted, ``model/0.weight`` saved: the
    target's dict key differs from the trainer's), pairs that ``fits`` (shape and dtype);
    "" otherwise."""
    if not missing or not unexpected:
        return ""
    saved_heads: dict[str, set[str]] = {}  # the rest of a path -> the first parts it has
    for path in unexpected:
        head, sep, rest = path.partition("/")
        if sep:
            saved_heads.setdefault(rest, set()).add(head)
    counts: dict[tuple[str, str], int] = {}  # (saved head, target head) -> pairs
    for path in missing:
        head, sep, rest = path.partition("/")
        for old in saved_heads.get(rest, ()) if sep else ():
            if fits is None or fits(f"{old}/{rest}", path):
                counts[(old, head)] = counts.get((old, head), 0) + 1
    if not counts:
        return ""
    (old, new), n = max(counts.items(), key=lambda kv: kv[1])
    if 2 * n < len(missing):
        return ""
    # (the keys as the user writes them: paths escape '/' and '%' inside a key)
    was, now = unescape_path(old), unescape_path(new)
    others = any(not p.startswith(old + "/") for p in unexpected)
    said = (f"; the checkpoint holds under {was!r} what the target has under {now!r} ({n} of "
            f"the {len(missing)} missing keys): name that part {was!r} in the target, as in "
            f"the checkpoint (state[{was!r}] = state.pop({now!r}))"
            + (", with ignore_unexpected=True for its other parts" if others else ""))
    # A key_map gets and gives whole names: one whose new first key holds a '/' would
    # nest; and it moves tensors of str-keyed dicts only (``movable``: the two parts,
    # saved and wanted, hold nothing else).
    if "/" in now or movable is None or not movable(old, new):
        return said
    return (f"{said}, or pass key_map=lambda path: {now + '/'!r} + path[{len(was) + 1}:] if "
            f"path.startswith({was + '/'!r}) else path")


def _mapping_hint(missing: list[str], unexpected: list[str],
                  fits: Callable[[str, str], bool], saved: Iterable[str]) -> str:
    """Where every saved key the target lacks pairs with a wanted one that it fits (same
    last name, shape and dtype; the pair sharing the longest ends), the whole key_map:
    one prefix rule where a single one explains every pair (a submodule wrapped a level
    deeper: ``enc.`` to ``enc.inner.``), else every pair (a trial was given one pair at a
    time, round after round); "" otherwise."""
    if not missing or len(missing) != len(unexpected) or len(missing) > 64:
        return ""

    def common(a: str, b: str) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    def ends(a: str, b: str) -> tuple[int, int]:
        return common(a[::-1], b[::-1]), common(a, b)

    pairs: dict[str, str] = {}
    for u in unexpected:
        name = u.rpartition(".")[2]
        ranked = sorted(((ends(u, m), m) for m in missing if m.rpartition(".")[2] == name
                         and fits(u, m)), reverse=True)
        if not ranked or (len(ranked) > 1 and ranked[0][0] == ranked[1][0]):
            return ""  # (none, or two alike: a guess, which a full map would hide)
        pairs[u] = ranked[0][1]
    if len(set(pairs.values())) != len(pairs):
        return ""
    for u, m in pairs.items():  # (and the other way: no saved key fits m as well as u)
        rival = [v for v in unexpected if v != u and v.rpartition(".")[2] == m.rpartition(
            ".")[2] and fits(v, m) and ends(v, m) >= ends(u, m)]
        if rival:
            return ""
    rules = set()
    for u, m in pairs.items():
        suf = ends(u, m)[0]
        if suf < min(len(u), len(m)):  # (else one is the other with a prefix: that is the rule)
            while suf and u[-suf] not in "./":  # (whole names: the rule ends at a separator)
                suf -= 1
            suf = max(suf - 1, 0)  # (the separator in the rule: 'enc.' to 'enc.inner.')
        rules.add((u[:len(u) - suf], m[:len(m) - suf]))
    if len(rules) == 1:
        (a, b), = rules
        moving = set(unexpected)  # (the rule must rename no other saved key)
        if a and all(not p.startswith(a) or p in moving for p in saved):
            return (f"; the checkpoint holds under {a!r} what the target wants under {b!r}: "
                    f"pass key_map=lambda p: {b!r} + p[{len(a)}:] if p.startswith({a!r}) "
                    "else p; strict=False would load none of them")
    if len(pairs) > 16:
        return ""
    return (f"; each saved tensor the target lacks fits one it wants: if they were renamed, "
            f"pass key_map={pairs!r}; strict=False would load none of them")


def _substitutions(u: str, m: str) -> list[tuple[str, str]]:
    """Replacements that make saved path ``u`` wanted path ``m``, in whole parts: where a
    part was inserted (or dropped), the part before it with its separators (``model/`` to
    ``model/net.``, ``.q.`` to ``.q.base.``: a wrapper, a LoRA layer); and the changed
    part between its separators (``.attn.`` to ``.self_attn.``, ``/blocks.`` to
    ``/layers.``)."""
    seps = "/."
    pre = 0
    while pre < min(len(u), len(m)) and u[pre] == m[pre]:
        pre += 1
    suf = 0
    while suf < min(len(u), len(m)) - pre and u[len(u) - 1 - suf] == m[len(m) - 1 - suf]:
        suf += 1
    end_u, end_m = len(u) - suf, len(m) - suf
    out: list[tuple[str, str]] = []
    # the part before the change: from the separator before it (or the start)
    if pre > 0 and u[pre - 1] in seps:
        s0 = max(u.rfind("/", 0, pre - 1), u.rfind(".", 0, pre - 1))
        s0 = max(s0, 0)
        if (end_u == pre and m[end_m - 1] in seps) or (end_m == pre and u[end_u - 1] in seps):
            out.append((u[s0:end_u], m[s0:end_m]))  # (one side inserts whole parts)
    # the changed part, between the separators around it
    lo = max(u.rfind("/", 0, pre), u.rfind(".", 0, pre))
    hi = min((i for i in (u.find("/", end_u), u.find(".", end_u)) if i >= 0), default=-1)
    if lo >= 0 and hi >= 0:
        out.append((u[lo:hi + 1], m[lo:hi + 1 + len(m) - len(u)]))
    return [(a, b) for a, b in out if a and a != b and u.replace(a, b, 1) == m]


def substitution_hint(missing: list[str], unexpected: list[str],
                      saved: Iterable[str] = ()) -> str:
    """Where up to 4 text replacements (a submodule renamed or wrapped: ``/blocks.`` to
    ``/layers.``, ``model/`` to ``model/net.``, ``.q.`` to ``.q.base.``) take most saved
    paths the target lacks to paths it wants, and none elsewhere: the key_map that does
    all of it (a trial was given one pair per error, and took 10 to 52 tries); ""
    otherwise. Each replacement is kept to the paths it is for (those starting with its
    text, or with the first part they share) where it would rename others of ``saved``
    (every saved path) too, and no hint is given where even that does (a trial's pasted
    ``p.replace('model/', 'model/inner.', 1)`` renamed ``teacher_model/`` too)."""
    if not missing or not unexpected or len(unexpected) > 200_000:
        return ""
    want = set(missing)
    by_last: dict[str, list[str]] = {}
    for m in missing:
        by_last.setdefault(m[max(m.rfind("/"), m.rfind(".")) + 1:], []).append(m)
    votes: dict[tuple[str, str], int] = {}
    for u in unexpected[:64]:
        best: tuple[int, list[tuple[str, str]]] | None = None
        for m in by_last.get(u[max(u.rfind("/"), u.rfind(".")) + 1:], [])[:256]:
            found = _substitutions(u, m)
            if found:
                score = len(u) - min(len(a) for a, _ in found)  # (what the two share)
                if best is None or score > best[0]:
                    best = (score, found)
        for rule in best[1] if best is not None else ():
            votes[rule] = votes.get(rule, 0) + 1
    rules: list[tuple[str, str]] = []
    covered: set[str] = set()
    for rule, _ in sorted(votes.items(), key=lambda kv: -kv[1])[:8]:
        if len(rules) == 4 or len(covered) == len(missing):
            break
        a, b = rule
        hits = {u.replace(a, b, 1) for u in unexpected if a in u and not any(
            r[0] in u for r in rules)}
        if not hits <= want or not hits - covered:  # (a saved path moved where the target
            continue  # has none; or nothing new)
        rules.append(rule)
        covered |= hits
    if not rules or 2 * len(covered) < len(missing) or len(covered) < 2:
        return ""
    code = _scoped_substitutions(rules, unexpected, saved)
    if code is None:
        return ""
    return (f"; the checkpoint's names differ from the target's by "
            f"{' and '.join(f'{a!r} for {b!r}' for a, b in rules)} ({len(covered)} of "
            f"{len(missing)} wanted keys): pass key_map={code}")


def _scoped_substitutions(rules: list[tuple[str, str]], unexpected: list[str],
                          saved: Iterable[str]) -> str | None:
    """The code of the key_map doing ``rules`` (text ``a`` to ``b``, the first rule whose
    ``a`` a path holds) to the ``unexpected`` saved paths and to no other ``saved`` one:
    each rule kept to the paths that start with its ``a``, else with the first part that
    the unexpected paths it renames share, where it would rename others; None where even
    so it would."""
    moving = set(unexpected)
    others = [p for p in saved if p not in moving]
    scoped: list[tuple[str, str, str]] = []  # (scope, a, b): paths starting with scope
    for a, b in rules:
        hit = [u for u in unexpected if a in u and not any(r[1] in u for r in scoped)]
        if not any(a in p for p in others):
            scoped.append(("", a, b))
        elif all(u.startswith(a) for u in hit):
            scoped.append((a, a, b))
        else:
            heads = {u[:u.find("/") + 1] for u in hit}
            head = heads.pop() if len(heads) == 1 else ""
            scoped.append((head, a, b))

    def fn(p: str) -> str:
        return next((p.replace(a, b, 1) for s, a, b in scoped if p.startswith(s) and a in p),
                    p)

    if any(fn(p) != p for p in others):
        return None
    if len(scoped) > 1:
        return ("lambda p: next((p.replace(a, b, 1) for s, a, b in "
                f"{scoped!r} if p.startswith(s) and a in p), p)")
    (scope, a, b), = scoped
    if not scope:
        return f"lambda p: p.replace({a!r}, {b!r}, 1)"
    if scope == a:
        return f"lambda p: {b!r} + p[{len(a)}:] if p.startswith({a!r}) else p"
    return f"lambda p: p.replace({a!r}, {b!r}, 1) if p.startswith({scope!r}) else p"


def renamed_hint(missing: list[str], unexpected: list[str],
                 fits: Callable[[str, str], bool] | None = None) -> str:
    """A sentence for a mismatch error when, in one dict, the target wants tensors the
    checkpoint lacks and the checkpoint holds others the target lacks: renamed layers,
    which key_map maps (strict=False would load none of them); "" otherwise, or where no
    saved tensor ``fits`` (shape and dtype) a wanted one."""
    def by_parent(paths: list[str]) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for path in paths:
            out.setdefault(path.rpartition("/")[0], []).append(path)
        return out

    wanted, held = by_parent(missing), by_parent(unexpected)
    common = [d for d in wanted if d in held]
    if not common:
        return ""
    d = max(common, key=lambda k: len(wanted[k]))
    where = f"under {d + '/'!r}" if d else "at the root"
    pair = _likely_pair(held[d], wanted[d], fits=fits)
    if pair is None:
        return ""
    old, new = pair
    # (a trial mapped the model's names as told, then met its optimizer's moments, keyed
    # by the same names under optim/state/, and was told to pass strict=False)
    elsewhere = [m for m in missing if m.rpartition("/")[0] != d]
    also = (f"; {len(elsewhere)} more wanted key(s) lie elsewhere (e.g. {elsewhere[0]!r}): "
            "the key_map must rename those too" if elsewhere else "")
    return (f"; {where} the checkpoint holds {few(held[d], 4)} where the target wants "
            f"{few(wanted[d], 4)}: if those were renamed, pass key_map= to map the saved "
            f"names to the new ones (e.g. key_map={{{old!r}: {new!r}}}){also}; "
            "strict=False would load none of them")


def _likely_pair(held: list[str], wanted: list[str], most: int = 100,
                 fits: Callable[[str, str], bool] | None = None) -> tuple[str, str] | None:
    """The saved and wanted names most alike at their ends (``model.layer.0.bias`` and
    ``layer.0.bias``), for an example (the first name of each list made pairs of unrelated
    names: a file's names come sorted, a module's in its order); of those that ``fits``,
    None if none does."""
    def tail(a: str, b: str) -> int:
        n = 0
        for x, y in zip(reversed(a), reversed(b), strict=False):
            if x != y:
                break
            n += 1
        return n

    pairs = [(h, w) for h in held[:most] for w in wanted[:most] if fits is None or fits(h, w)]
    return max(pairs, key=lambda hw: tail(*hw)) if pairs else None


