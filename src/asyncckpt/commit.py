"""Atomic commit, discovery of committed steps, cleanup and retention.

Layout under a checkpoint root::

    step_000000100/                  committed: has manifest.json, visible to readers
    .step_000000200.tmp-<id>/        being written, or abandoned by a crash: never read
    .step_000000050.deleting-<id>/   being removed by retention: never read

A step directory becomes visible in one atomic rename, after every file in it and
the directory itself have been fsync'd.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import json
import logging
import os
import re
import shlex
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal, SupportsIndex, TypeAlias

from .errors import (
    CheckpointConfigError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointPermissionError,
    CheckpointSaveError,
    CheckpointTimeoutError,
    few,
)
from .manifest import MANIFEST_NAME, is_shard_file_name
from .storage import DirectoryLock, LocalStorage, ReadStorage, Storage, is_transient

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_([0-9]{9,})$")
_TMP_DIR = re.compile(r"^\.step_[0-9]+\.(tmp|deleting)-[0-9a-f]+$")


def step_dir_name(step: int) -> str:
    return f"step_{step:09d}"


def step_of_dir_name(name: str) -> int | None:
    """The step whose directory ``name`` is, or None for any other name.

    Only the name a commit gives counts: ``step_0000000003`` is not step 3's directory
    (``step_000000003`` is), and reading it as step 3 would resolve to another directory.
    """
    m = _STEP_DIR.match(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if name == step_dir_name(step) else None


def is_step_dir_name(name: str) -> bool:
    """Whether ``name`` is one a step directory gets: committed, being written, or
    being deleted."""
    return _STEP_DIR.match(name) is not None or _TMP_DIR.match(name) is not None


def temp_dir_kind(name: str) -> str | None:
    """``"tmp"`` for a save's uncommitted directory, ``"deleting"`` for a step being
    removed, None for any other name."""
    m = _TMP_DIR.match(name)
    return m.group(1) if m else None


def new_token() -> str:
    """A fresh token naming one save's temporary directory."""
    return uuid.uuid4().hex[:12]


def tmp_dir_name(step: int, token: str) -> str:
    return f".step_{step:09d}.tmp-{token}"


def list_root(root: Path, storage: ReadStorage) -> list[str]:
    """The names in ``root``; CheckpointNotFoundError when it is a file or cannot be
    reached (a symbolic link loop), CheckpointPermissionError when it may not be listed."""
    try:
        return storage.listdir(root)
    except NotADirectoryError:
        # (root itself, or a directory above it: "DIR/file/sub is a file" said of sub)
        above = next((p for p in root.parents if p.is_file()), None)
        if above is not None and not root.is_file():
            raise CheckpointNotFoundError(
                f"no checkpoint directory at {root}: {above}, on its path, is a file; check "
                "the path") from None
        raise CheckpointNotFoundError(
            f"{root} is a file, not a checkpoint directory: pass the directory that holds "
            f"the step_* directories (or one of them){foreign_hint(root)}") from None
    except PermissionError as exc:
        raise CheckpointPermissionError(
            f"the checkpoint directory {root} cannot be listed: {exc.strerror or exc}; give "
            "this user read access to it (or run as one that has it)", path=str(root)
        ) from None
    except OSError as exc:
        if is_transient(exc):
            raise
        raise CheckpointNotFoundError(
            f"the checkpoint directory {root} cannot be listed: {exc.strerror or exc}; "
            "check the path (a symbolic link loop? a damaged filesystem?)") from exc


def committed_steps(root: Path, storage: ReadStorage,
                    unlistable: list[tuple[str, str]] | None = None,
                    no_manifest: list[str] | None = None, *,
                    skip_denied: bool = False, above: int | None = None,
                    trusted: Collection[int] = ()) -> list[int]:
    """Committed steps under ``root``, oldest first (a step counts once its manifest is there);
    with ``above``, only the directories of later steps are looked into; nor are those of
    the ``trusted`` steps (found committed before: retention's, which looked into every
    milestone kept at every save, ~20 µs each here, a metadata round trip each on NFS).

    A step directory that this user may not list raises CheckpointPermissionError (it
    may hold the newest step: a resume must not take an older one unknowingly), unless
    ``skip_denied`` or ``unlistable`` is given; one that cannot be listed for another
    lasting reason (a symlink loop, EIO) is left out (logged). ``unlistable``, when
    given, receives each one's name and why. ``no_manifest``, when given, receives the
    names of step directories without a manifest (never committed here: a copy or a
    hand edit).
    """
    for tries_left in range(_RELISTS_AFTER_RETIRED, -1, -1):
        steps = []
        retired: list[str] = []
        bare: list[str] = []  # (this pass's: a listing taken again finds them again)
        cannot: list[tuple[str, str]] = []
        for name in list_root(root, storage):
            step = step_of_dir_name(name)
            if step is not None and step in trusted and (above is None or step > above):
                steps.append(step)
                continue
            if step is not None and (above is None or step > above) and _is_committed(
                    root, name, storage, cannot, bare,
                    denied="skip" if skip_denied or unlistable is not None else "raise",
                    retired=retired, quiet=True):
                steps.append(step)
        # Step directories retired (by a save's keep_last) between the listing and the
        # look into them: the listing is old, and may lack the steps committed since (a
        # trial's steps() said [] beside a trainer that always kept 2): list again.
        # None at all may be such a listing too, taken across a save's commit and its
        # retention's removal of the step before (two renames, neither seen): once more.
        empty = not steps and not cannot and above is None
        if not (retired or (empty and tries_left == _RELISTS_AFTER_RETIRED)) or tries_left == 0:
            break
    if no_manifest is not None:  # (in order: an ops trial's cron logs diffed noisily)
        no_manifest += sorted(bare, key=lambda n: (step_of_dir_name(n) or 0, n))
    for name, why in cannot:  # (once, of the last listing)
        # A symlink loop, EIO (or, for a save, no permission): one entry that cannot be
        # listed must not make every save of the root fail; the others are still there.
        log.warning("skipping %s: it cannot be listed (%s), so it counts as no committed "
                    "step", root / name, why)
    if unlistable is not None:
        unlistable += cannot
    return sorted(steps)


_RELISTS_AFTER_RETIRED = 3  # committed_steps lists again at most this many times


_OnError = Literal["skip", "raise"]  # what _is_committed does with a step it cannot list


def _is_committed(root: Path, name: str, storage: ReadStorage,
                  unlistable: list[tuple[str, str]] | None = None,
                  no_manifest: list[str] | None = None, *, denied: _OnError = "skip",
                  damaged: _OnError = "skip", retired: list[str] | None = None,
                  quiet: bool = False) -> bool:
    """Whether the step directory ``name`` holds its manifest (see committed_steps).

    A directory that cannot be listed counts as not committed (logged), or raises:
    ``denied="raise"`` for no permission (CheckpointPermissionError), ``damaged="raise"``
    for any other lasting reason (CheckpointCorruptError). One that is gone by now
    (retention renamed it away since the root was listed) is not committed either,
    without a word (``retired``, when given, gets its name). ``quiet``: log nothing (a
    listing that may be taken again)."""
    try:
        if MANIFEST_NAME in storage.listdir(root / name):
            return True
        # Gone since the root was listed (LocalStorage lists a missing directory as
        # empty), or read as retention removed its files after renaming it away: a
        # step retired, not one without manifest (a trial's ls beside a trainer said
        # "without manifest.json", 1 run in 150).
        if not still_there(root, name, storage):
            if retired is not None:
                retired.append(name)
            return False
        if no_manifest is not None:
            no_manifest.append(name)
    except NotADirectoryError:  # a stray file named like a step is no checkpoint
        pass
    except CheckpointError:
        raise
    except OSError as exc:
        if is_transient(exc):  # (a stale handle, no descriptors left...: not this entry's)
            raise
        if isinstance(exc, FileNotFoundError) and not still_there(root, name, storage):
            if retired is not None:  # retired since the root was listed (no dangling link)
                retired.append(name)
            return False
        why = exc.strerror or str(exc)
        if isinstance(exc, PermissionError) and denied == "raise":
            raise CheckpointPermissionError(
                f"{root / name} cannot be listed: {why}; it may hold a committed step, so "
                "which steps are committed is unknown: give this user read access to it "
                "(or move it out of the checkpoint directory)", path=str(root / name)
            ) from None
        if damaged == "raise" and not isinstance(exc, PermissionError):
            raise CheckpointCorruptError(
                f"{root / name} cannot be listed ({why}): that step is damaged or "
                "unreadable; name another step, or load with fallback=True to take the "
                "newest intact one", path=str(root / name)) from exc
        # A symlink loop, EIO (or, for a save, no permission): one entry that cannot be
        # listed must not make every save of the root fail; the others are still there.
        if not quiet:
            log.warning("skipping %s: it cannot be listed (%s), so it counts as no "
                        "committed step", root / name, why)
        if unlistable is not None:
            unlistable.append((name, why))
    return False


def files_amiss(step_dir: Path, sizes: Mapping[str, int],
                listed: Mapping[str, int] | None = None, *, sure: bool = False) -> list[str]:
    """The files (name -> size, as the manifest has them) that are missing or not of
    their sizes, in words, one stat each (what a load of the step would refuse first;
    ``verify`` checks every byte): what ``ls`` shows DAMAGED, and ``best_step()`` and
    retention pass over.

    ``listed``: the sizes of the regular files a listing of ``step_dir`` just stat'ed
    (``ls`` lists every step for its disk usage); a file found there is not stat'ed again,
    the others (a link, a FIFO, one not listed) are, as before. ``sure``: only what is
    certainly amiss (missing, or of another size); a stat that fails otherwise (ESTALE,
    EIO, EACCES: a network mount's hiccup, a permission) tells nothing of the file, and
    retention must not take an intact step for a damaged one on its word (a review's
    ESTALE had every step but the newest deleted)."""
    amiss = []
    for name, want in sizes.items():
        try:
            size = listed[name] if listed and name in listed else os.stat(step_dir / name).st_size
        except (FileNotFoundError, NotADirectoryError):
            amiss.append(f"{name} is missing")
            continue
        except OSError as exc:
            if not sure:
                amiss.append(f"{name} cannot be read ({exc.strerror or exc})")
            continue
        if size != want:
            amiss.append(f"{name} is {size} bytes, not {want}")
    return amiss


def still_there(root: Path, name: str, storage: ReadStorage) -> bool:
    """Whether the entry ``name`` of ``root`` is there now (one stat; a listing of the
    root where the storage is not local)."""
    if isinstance(storage, LocalStorage):
        return os.path.lexists(root / name)
    try:
        return name in storage.listdir(root)
    except OSError:
        return True  # (unknown: as it was listed)


def _newest_committed(root: Path, names: list[str], storage: ReadStorage,
                      above: int = -1, *, for_load: bool = False) -> int | None:
    """The newest committed step above ``above`` among the entries ``names`` of ``root``:
    step directories are looked into newest first, and only until one is committed.

    ``for_load``: a step directory that cannot be listed raises (see ``_is_committed``)
    rather than let an older step be taken for the newest."""
    how: _OnError = "raise" if for_load else "skip"
    bare: list[str] = []  # newer step directories without a manifest, seen on the way
    found = None
    for step in sorted((s for s in map(step_of_dir_name, names) if s is not None and s > above),
                       reverse=True):
        if _is_committed(root, step_dir_name(step), storage, no_manifest=bare if for_load else None,
                         denied=how, damaged=how):
            found = step
            break
    if bare:
        _warn_bare(root, bare, found)
    return found


_warned_bare: set[Path] = set()  # (a training loop asks for the latest step often)


def _warn_bare(root: Path, names: list[str], taken: int | None) -> None:
    """A load skips a step directory newer than the step it takes because it has no
    manifest: no commit leaves one (the rename is atomic), so it is damage or a copy
    cut short, and the user resumes from an older step than they think."""
    new = [n for n in names if root / n not in _warned_bare]
    if not new:
        return
    _warned_bare.update(root / n for n in new)
    log.warning("%s: %s %s no %s, so %s no committed step (a copy cut short, or a hand "
                "edit?): taking %s", root, ", ".join(new), "has" if len(new) == 1 else "have",
                MANIFEST_NAME, "it is" if len(new) == 1 else "they are",
                "nothing" if taken is None else f"step {taken}, the newest committed one")


def check_new_step(root: Path, step: int, storage: ReadStorage, *, retention: bool) -> Path:
    """The directory a save of ``step`` commits to; CheckpointExistsError when ``step`` is
    committed already or older than a committed step (``retention``: keep_last is on),
    or when its directory is in the way.

    The root is listed once; of the step directories only those above ``step`` are
    looked into, newest first, until one is committed (usually there is none): what a
    save costs its caller does not grow with the steps kept.
    """
    names = list_root(root, storage)
    final = root / step_dir_name(step)
    if final.name in names:
        _refuse_taken(final, step, storage)
    if _newest_committed(root, names, storage, above=step) is not None:
        later = [s for s in committed_steps(root, storage, skip_denied=True) if s > step]
        raise CheckpointExistsError(
            f"step {step} is older than step(s) {later[:5]} already committed under "
            f"{root}: a load would take step {later[-1]}"
            + (", and keep_last would remove the new steps before it" if retention else "")
            + ". If the later steps belong to a run you rolled back, delete them with "
            f"ckpt.discard_steps_after({step}) (or save into a new directory); if you are "
            "bringing old checkpoints in, save them oldest step first (sorted by step, not "
            f"by file name): remove the newer ones converted already the same way, or start "
            "again in a new directory")
    return final


def abandoned_dirs(root: Path, storage: ReadStorage) -> list[str]:
    return sorted(n for n in storage.listdir(root) if _TMP_DIR.match(n))


def cleanup_abandoned(root: Path, storage: Storage,
                      names: Sequence[str] | None = None) -> list[str]:
    """Remove temporary and half-deleted directories (``names``, by default all those
    there); call only while holding the lock."""
    removed = []
    for name in abandoned_dirs(root, storage) if names is None else names:
        if not_ours(root / name) and names is None:
            continue
        try:
            storage.remove_tree(root / name)
            removed.append(name)
        except NotADirectoryError as exc:
            left_as_not_ours(root / name, exc, "cleaning up")
        except OSError as exc:
            log.warning("could not remove abandoned %s: %s", root / name, exc)
    if removed:
        log.info("removed %d abandoned checkpoint directories under %s: %s", len(removed), root,
                 ", ".join(removed))
    return removed


# Entries named like a save's temporary or hidden directory that are not directories (no
# save made them, and remove_tree leaves them): told once per process, not at every save
# (a storage trial's file warned at each of them)
_NOT_OURS: set[Path] = set()
_NOT_OURS_LOCK = threading.Lock()
if hasattr(os, "register_at_fork"):  # (a child forked while another thread held it)
    os.register_at_fork(after_in_child=lambda: globals().update(
        _NOT_OURS_LOCK=threading.Lock()))


def not_ours(path: Path) -> bool:
    """Whether ``path`` was found not to be a directory a save made (left_as_not_ours)."""
    with _NOT_OURS_LOCK:
        return path in _NOT_OURS


def left_as_not_ours(path: Path, exc: OSError, who: str) -> None:
    """Leave ``path`` (remove_tree's NotADirectoryError) and say so, once per process."""
    with _NOT_OURS_LOCK:
        told = path in _NOT_OURS
        _NOT_OURS.add(path)
    if not told:
        log.warning("%s: leaving %s as it is: %s; remove it by hand (not retried)", who, path,
                    exc.strerror or exc)


_TORCH_SAVE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".tar")


def foreign_hint(path: Path, names: Sequence[str] | None = None) -> str:
    """What to do with a checkpoint of another format at ``path`` ("" for none known): a
    PyTorch DCP directory (``.metadata`` beside ``*.distcp`` files), or a torch.save file."""
    if names is not None and ".metadata" in names:
        return ("; it holds a PyTorch DCP checkpoint (.metadata, *.distcp), which asyncckpt "
                "does not read: load it with torch.distributed.checkpoint, then save the "
                "state with asyncckpt")
    if names is None and path.suffix in _TORCH_SAVE_SUFFIXES:
        return (f"; a torch.save file ({path.suffix})? load it with torch.load(path, "
                "weights_only=True), then save the state with asyncckpt.save")
    if names is not None and MANIFEST_NAME not in names:
        # (each kind there: a trial's folder of old .pt files and a safetensors file was
        # told of the safetensors file alone)
        plain = sorted(n for n in names if n.endswith(".safetensors"))
        saved = sorted(n for n in names if Path(n).suffix in _TORCH_SAVE_SUFFIXES)
        told = ([f"plain safetensors files ({few(plain, 3)}; Hugging Face weights?), which "
                 "asyncckpt.load_safetensors(path, state) loads"] if plain else []) + (
            [f"torch.save files ({few(saved, 3)})? load one with torch.load(file, "
             "weights_only=True), then save the state with asyncckpt.save"] if saved else [])
        if told:
            return "; it holds " + "; and ".join(told)
    return ""


def nested_hint(root: Path, names: Sequence[str], storage: ReadStorage) -> str:
    """For a root without committed steps: its subdirectories that are checkpoint roots
    themselves ("" for none), as a per-step layout leaves them (``ckpt/step_10`` used as
    the root of step 10's save, DCP's habit: a resume from ``ckpt`` started afresh)."""
    found = []
    looked = 0
    local = isinstance(storage, LocalStorage)
    for name in sorted(n for n in names if not n.startswith(".") and step_of_dir_name(n)
                       is None):
        if looked == _NESTED_LOOKS:
            break
        if not os.path.isdir(root / name) if local else "." in name[1:]:
            continue  # (a file: no look, and none of the budget; files have suffixes)
        looked += 1
        try:  # a root's listing holds step_* directories, the newest with a manifest
            inner = sorted((n for n in storage.listdir(root / name)
                            if step_of_dir_name(n) is not None), reverse=True)
            if any(MANIFEST_NAME in storage.listdir(root / name / n) for n in inner[:4]):
                found.append(name)
        except (OSError, CheckpointError):  # a file, not listable: not a root
            continue
    if not found:
        return ""
    one = len(found) == 1
    return (f"; {few([str(root / n) for n in found], 3)} "
            f"{'is a checkpoint root of its own' if one else 'are checkpoint roots of their own'}"
            f": to load from {'it' if one else 'one'}, pass it as the "
            "directory (a checkpointer's directory is the root of its step_* directories)")


# The most subdirectories nested_hint looks into (each listed once, and up to 4 step
# directories in each: a parent of many runs costs a few listings, on an error's path)
_NESTED_LOOKS = 8


# What a step may be given as (as_step takes it): an int, a NumPy integer, a 0-dim integer
# tensor (a training loop's counter); in type hints, what has __index__.
StepLike: TypeAlias = int | SupportsIndex


def as_step(step: object, *, latest: bool = False) -> int:
    """``step`` as a Python int: an ``int``, a NumPy integer or a 0-dim integer tensor (a
    training loop's counter), non-negative; anything else (``bool``, a float, a string)
    raises CheckpointConfigError saying what to pass. ``latest`` says None is taken by
    the caller (the latest step), for the message."""
    n: object = None
    if type(step) is int:
        n = step
    elif type(step).__module__ == "numpy" and getattr(step, "ndim", None) == 0 \
            and getattr(getattr(step, "dtype", None), "kind", "") in ("i", "u"):
        n = int(step)  # type: ignore[call-overload]
    elif type(step).__module__.startswith("torch") and hasattr(step, "is_floating_point"):
        import torch

        if isinstance(step, torch.Tensor) and step.dim() == 0 and not step.is_complex() \
                and not step.is_floating_point() and step.dtype is not torch.bool:
            n = int(step.item())
    if type(n) is not int or n < 0:
        raise CheckpointConfigError(
            f"step={step!r}: use a non-negative int (a NumPy integer or a 0-dim integer "
            "tensor is taken too)" + (", or None for the latest" if latest else ""))
    if n > MAX_STEP:
        # (a counter gone wrong, or a timestamp: once saved, every later step below it
        # would be refused as older until discard_steps_after)
        raise CheckpointConfigError(
            f"step={n}: steps go up to 2**63-1 (an int64, as peers and other readers take "
            "them); number the steps of a run from 0")
    return n


MAX_STEP = (1 << 63) - 1  # the largest step: an int64


def check_step(step: object) -> int | None:
    """``step`` to load as an int, or None (the latest); refuses what is no step number."""
    return None if step is None else as_step(step, latest=True)


# Pauses between listings of a root that showed no committed step but a save's or a
# retention's temporary directory (see resolve_step_dir)
_RELIST_PAUSES_S = (0.005, 0.02, 0.05)


def resolve_step_dir(root: Path, step: int | None, storage: ReadStorage, *,
                     uncommitted_ok: bool = False) -> tuple[Path, int | None]:
    """The directory of ``step`` (latest when None), or ``root`` itself if it is a step dir.

    Raises CheckpointNotFoundError listing what was found instead, and for a save's
    temporary directory or a step being deleted unless ``uncommitted_ok`` (the CLI
    inspects those, with a warning).
    """
    step = check_step(step)
    names = list_root(root, storage)
    if MANIFEST_NAME in names:
        kind = temp_dir_kind(root.name)
        if kind is not None and not uncommitted_ok:
            what = ("the temporary directory of a save that did not commit (still being "
                    "written, or abandoned by a crash)" if kind == "tmp" else
                    "a step being removed by retention (or whose removal failed)")
            raise CheckpointNotFoundError(
                f"{root} is {what}: loads read committed steps only; 'asyncckpt ls "
                f"{root.parent}' lists them ('asyncckpt verify {root}' checks this one)")
        named = step_of_dir_name(root.name)
        if step is not None and named is not None and named != step:
            raise CheckpointNotFoundError(
                f"{root} is the checkpoint of step {named}, not of step {step}; pass "
                "its parent directory to choose among steps")
        return root, None
    if not root.is_dir():
        raise CheckpointNotFoundError(f"no checkpoint directory at {root}")
    # Only the step directories needed are looked into (each listing is a round trip on
    # a network filesystem): the one asked for, or the newest until one is committed.
    if step is None:
        newest = _newest_committed(root, names, storage, for_load=True)
        for i, pause in enumerate(_RELIST_PAUSES_S):
            # A listing taken while a save committed and its retention hid the step before
            # (two renames) may hold neither step: readdir is no snapshot. A trial's
            # reader of a keep_last=1 run was told "no committed checkpoint" 1 time in ~600;
            # then, listed again only where a temporary directory showed, 1 in ~30,000
            # (the listing can miss that one too): a root that shows none is listed again
            # once whatever it held.
            if newest is not None or (i and not any(_TMP_DIR.match(n) for n in names)):
                break
            time.sleep(pause)
            names = list_root(root, storage)
            newest = _newest_committed(root, names, storage, for_load=True)
        if newest is None:
            refuse_a_step_dir_without_manifest(root, names)
            junk = abandoned_dirs(root, storage)
            extra = f" ({len(junk)} incomplete ones ignored: {', '.join(junk[:3])})" if junk else ""
            raise CheckpointNotFoundError(
                f"no committed checkpoint under {root}{extra}{foreign_hint(root, names)}"
                f"{nested_hint(root, names, storage) if not extra else ''}")
        step = newest
    elif step_dir_name(step) not in names or not _is_committed(
            root, step_dir_name(step), storage, denied="raise", damaged="raise"):
        steps = committed_steps(root, storage, skip_denied=True)
        if not steps:
            refuse_a_step_dir_without_manifest(root, names)
        have = (", ".join(map(str, steps[-10:])) or "none") + (
            f"; and {len(steps) - 10} older" if len(steps) > 10 else "")
        # (there now, not only when listed: a step retention hid meanwhile is no step, not
        # one "without its manifest", which a CLI trial's export beside a trainer was told)
        lost = (f"; {step_dir_name(step)} is there without its {MANIFEST_NAME} (the manifest "
                "lost, or a copy cut short): no load reads it"
                if step_dir_name(step) in names and still_there(root, step_dir_name(step),
                                                                 storage) else "")
        # (a CLI trial's verify --step of a step ls had listed a moment before, beside a
        # trainer, was told to "check the path")
        gone = ("; older than the latest: if it was saved, retention (a saver's "
                "keep_last) may have removed it since" if not lost and steps
                and step < steps[-1] else "")
        raise (StepWithoutManifestError if lost else CheckpointNotFoundError)(
            f"no committed checkpoint for step {step} under {root} (committed steps: {have})"
            f"{lost}{gone}")
    return root / step_dir_name(step), step


class StepWithoutManifestError(CheckpointNotFoundError):
    """A step directory without its manifest: no load reads it (a checkpoint that lost its
    manifest, or a copy cut short). The command line counts it as damage (exit 1), as
    ``ls`` does the same directory under its root."""


def refuse_a_step_dir_without_manifest(root: Path, names: list[str]) -> None:
    """A step directory that lost its manifest (or never got one) would otherwise be
    taken for an empty root: "no committed checkpoint under step_000000002" sends the
    user looking in the wrong place."""
    if any(is_step_dir_name(n) for n in names):  # it holds steps: a root
        return
    named = is_step_dir_name(root.name)
    shards = any(is_shard_file_name(n) for n in names)
    if not (named or shards):
        return
    why = " and ".join(w for w, yes in (("is named like a step directory", named),
                                         ("holds rank files", shards)) if yes)
    # (a save's temporary directory, or a step being deleted, is no damage: ls of the
    # root lists it as incomplete, exit 0)
    raise (CheckpointNotFoundError if temp_dir_kind(root.name) else StepWithoutManifestError)(
        f"{root} {why} but has no {MANIFEST_NAME}: that step is uncommitted (its save did "
        f"not finish) or damaged, and no load reads it; 'asyncckpt ls {root.parent}' lists "
        "the committed steps")


class CommittedNotDurableError(CheckpointSaveError):
    """The step's directory was renamed into place, but its name may not survive a crash
    and could not be taken back: the step is visible, the save is reported failed."""

    def __init__(self, message: str, final: Path):
        super().__init__(message)
        self.final = final

    def __reduce__(self) -> tuple[object, ...]:  # (copied: a future raises a copy)
        return (type(self), (self.args[0], self.final), self.__dict__)


def check_step_free(root: Path, step: int, storage: ReadStorage) -> Path:
    """The directory ``step`` would be committed to; CheckpointExistsError when something
    is there already: the step committed, or a directory without a manifest (which a
    rename would silently replace if it were empty)."""
    final = root / step_dir_name(step)
    if final.name in storage.listdir(root):
        _refuse_taken(final, step, storage)
    return final


def _refuse_taken(final: Path, step: int, storage: ReadStorage) -> None:
    a_file = False
    try:
        names = storage.listdir(final)
    except NotADirectoryError:
        names, a_file = [], True
    if a_file:  # (told it "holds no manifest.json": a trial)
        raise CheckpointExistsError(
            f"{final} is in the way of step {step}'s commit: it is a file, not a step "
            "directory; move or delete it, or save under a new step number")
    if MANIFEST_NAME in names and DAMAGED_NAME in names:
        # (a resume whose fallback loaded an older step saves the damaged one's step again)
        raise CheckpointExistsError(
            f"step {step} is already committed at {final}, and a fallback load found it "
            f"damaged ({DAMAGED_NAME}): to save it anew, first remove it and the steps after "
            "the one that load took: ckpt.discard_steps_after(<that step>)")
    if MANIFEST_NAME in names:
        # (not "delete that directory": with later steps kept, a save of it is refused
        # again as older than them, and the step was lost for nothing: a trial)
        raise CheckpointExistsError(
            f"step {step} is already committed at {final}; save under a new step number, or, "
            "to save it anew (a rollback to before it), first remove it and any later step "
            f"with ckpt.discard_steps_after({step - 1}) (AsyncCheckpointer(root) for the "
            "one-shot asyncckpt.save)" if step > 0 else
            f"step {step} is already committed at {final}; save under a new step number, or "
            "into a new directory")
    raise CheckpointExistsError(
        f"{final} is in the way of step {step}'s commit: it holds no {MANIFEST_NAME}, so it "
        "is no committed step (a copy cut short or a hand edit?); move or delete it "
        f"(asyncckpt clean {shlex.quote(str(final.parent))} --without-manifest removes every "
        "such directory), or save under a new step number")


def commit(tmp: Path, root: Path, step: int, storage: Storage,
           before_rename: Callable[[], None] | None = None) -> Path:
    """Make ``tmp`` (fully written and fsync'd) visible as the step's directory.

    ``before_rename`` runs just before the commit point; raising there aborts it."""
    final = check_step_free(root, step, storage)
    storage.fsync_dir(tmp)
    if before_rename is not None:
        before_rename()
    # COMMIT POINT: after this rename the checkpoint is visible; before it, it never was.
    try:
        storage.rename(tmp, final)
    except OSError:
        # A rename may fail after it was done (NFS: a reply lost, the retry finds its source
        # gone, ENOENT; or EIO, ESTALE): a storage trial's save raised with its step
        # committed, listed and loadable, its name never fsync'd. Done: go on, as if it had
        # returned; not done: it failed.
        if not _renamed(tmp, final, storage):
            raise
        log.warning("step %d: the rename that commits it (%s -> %s) raised, but it was "
                    "done: going on with the commit", step, tmp.name, final.name)
    try:
        storage.fsync_dir(root)
    except BaseException as exc:
        # The rename may not survive a crash, and the caller is told the save failed: so
        # it must not stay visible either. Take it out of sight again, then remove it.
        gone = root / f".step_{step:09d}.deleting-{uuid.uuid4().hex[:12]}"
        try:
            storage.rename(final, gone)
        except OSError as stuck:
            if not isinstance(exc, Exception):  # (an interrupt stays one)
                raise exc from None
            # Then the failure must not pass for "nothing was saved": the step is there.
            raise CommittedNotDurableError(
                f"step {step} is committed at {final}, but making its name durable in {root} "
                f"failed ({type(exc).__name__}: {exc}), so a crash may lose it, and taking "
                f"it back failed too ({type(stuck).__name__}: {stuck}). Its files are "
                "durable and verified; check the filesystem, and save a later step",
                final) from exc
        with contextlib.suppress(OSError):  # out of sight: the next clean-up removes it
            storage.remove_tree(gone)
        raise
    return final


def _renamed(tmp: Path, final: Path, storage: Storage) -> bool:
    """Whether the rename of ``tmp`` to ``final`` was done though it raised: ``tmp`` is gone
    and ``final`` holds the manifest (a question a failing filesystem may not answer:
    then no)."""
    try:
        return (not still_there(tmp.parent, tmp.name, storage)
                and MANIFEST_NAME in storage.listdir(final))
    except OSError:
        return False


DAMAGED_NAME = "damaged.json"
"""Beside a step's manifest: a load of the checkpointer that owns the directory (a
fallback past the step, or a load of it that raised) found the step damaged (its problem,
and when). Retention and ``ls`` read it, so the
verdict outlives the process; a step saved anew, or removed, takes it with it."""

_MAX_PROBLEM_CHARS = 2000  # of the problem a damaged.json keeps (a group's can be long)


def mark_damaged(root: Path, step: int, problem: str, storage: Storage) -> str | None:
    """Write step ``step``'s damaged.json (kept if there already); None once it is on
    disk, else why it could not be written (the verdict is then this process's alone)."""
    body = json.dumps({"step": step, "found_unix": time.time(),
                       "problem": problem[:_MAX_PROBLEM_CHARS]}, indent=1).encode()
    path = root / step_dir_name(step) / DAMAGED_NAME
    elsewhere = led_elsewhere(root, step, storage)
    if elsewhere is not None:
        return elsewhere
    try:
        storage.write_bytes(path, body)
    except FileExistsError:
        pass  # (found damaged before: the first finding stays)
    except OSError as exc:
        # A write cut short (a full disk) left a file that is no mark, yet would read as
        # one, "damaged.json is not a JSON object", where the warning says none was
        # written. The file was made here (O_EXCL: it was not there before): it goes.
        if isinstance(storage, LocalStorage):  # (another storage's files are its own)
            with contextlib.suppress(OSError):
                if os.stat(path).st_size < len(body):
                    os.unlink(path)
        return exc.strerror or str(exc)
    return None


def led_elsewhere(root: Path, step: int, storage: ReadStorage) -> str | None:
    """Why nothing may be written into step ``step``'s directory under ``root``: it leads
    out of the root, or to another of its directories (a link); None where it is its own.
    (A security review: a downloaded root's step linked to a directory elsewhere, and a
    fallback load wrote its mark there; an adversary trial: a step linked to another step
    of the root, marked that one, which retention then removed though it was intact.)"""
    if not isinstance(storage, LocalStorage):
        return None
    real, inside = os.path.realpath(root / step_dir_name(step)), os.path.realpath(root)
    if real == os.path.join(inside, step_dir_name(step)):
        return None
    where = "out of " if os.path.commonpath([real, inside]) != inside else "elsewhere in "
    return f"its directory leads {where}{root} (a link to {real}): nothing is written there"


# The lock file retention and record_metrics take around what they do (see ranking_lock)
RANKING_LOCK_NAME = ".asyncckpt.ranking"
RANKING_LOCK_S = 30.0  # how long a record_metrics waits for the lock at most
# ... and a retention: then it leaves the old steps to the next save's (an evaluator
# stopped inside a record, SIGSTOP or a debugger, held every save 30 s: a QA trial)
RETENTION_RANKING_S = 2.0


@contextlib.contextmanager
def ranking_lock(root: Path, storage: ReadStorage, what: str,
                 timeout_s: float = RANKING_LOCK_S) -> Iterator[bool]:
    """An flock on ``root``'s ``.asyncckpt.ranking``, held by a retention while it ranks
    and hides steps, and by ``record_metrics`` while it writes a step's metrics (in this
    process or another: an evaluator beside the trainer): a record then either counts
    for the ranking, or finds its step gone, never lands on a step about to go (a trial
    recorded the best step 1 ms before retention deleted it). Yields whether it is held:
    not where the storage is not local, or the file cannot be opened (a root this user
    may not write: nothing is recorded there either); CheckpointTimeoutError after
    ``timeout_s`` (``what`` waited)."""
    fd = -1
    if isinstance(storage, LocalStorage):
        for flags in (os.O_RDWR | os.O_CREAT, os.O_RDONLY):  # (another user's file: read)
            with contextlib.suppress(OSError):
                fd = os.open(root / RANKING_LOCK_NAME, flags | getattr(os, "O_CLOEXEC", 0),
                             0o666)
                break
    if fd < 0:
        yield False
        return
    try:
        deadline = time.monotonic() + timeout_s
        held = True
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise CheckpointTimeoutError(
                        f"{what}: {root / RANKING_LOCK_NAME} stayed locked for "
                        f"{timeout_s:g}s (another process's retention or record_metrics, "
                        "stopped or stuck?)") from None
                time.sleep(0.005)
            except OSError:  # (a filesystem without flock: ENOLCK; as no lock file)
                held = False
                break
        try:
            yield held
        finally:
            # (unlocked, not only closed: a process forked meanwhile shares the open file,
            # and would hold the lock until it exits: a review)
            if held:
                with contextlib.suppress(OSError):
                    fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def read_damaged_mark(step_dir: Path, storage: ReadStorage) -> dict[str, object] | None:
    """What a step's damaged.json says (None: there is none); one that cannot be read or
    parsed still marks the step, with its problem in words."""
    try:
        raw = storage.read_bytes(step_dir / DAMAGED_NAME, 64 * 1024)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return {"problem": f"{DAMAGED_NAME} cannot be read ({exc.strerror or exc})"}
    except (ValueError, CheckpointError) as exc:  # over the limit; a directory, a FIFO
        return {"problem": f"{DAMAGED_NAME} cannot be read ({exc})"}
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        return {"problem": f"{DAMAGED_NAME} is not a JSON object"}
    return doc


def iso_time(unix: float) -> str:
    """ISO 8601 UTC time of ``unix``, or the raw number where no date can show it."""
    try:
        return datetime.fromtimestamp(unix, tz=timezone.utc).isoformat(timespec="seconds")
    except (ValueError, OverflowError, OSError):
        return str(unix)


def mark_text(mark: Mapping[str, object]) -> str:
    """A damaged.json's verdict (see read_damaged_mark), in words."""
    when = mark.get("found_unix")
    at = f" at {iso_time(when)}" if isinstance(when, (int, float)) else ""
    return f"a load found it damaged{at} ({DAMAGED_NAME}: {mark.get('problem')})"


def warn_if_marked(step_dir: Path, storage: ReadStorage, verify: bool = True) -> None:
    """Before a plain load of ``step_dir``: warn where a load found it damaged before
    (its damaged.json). A distributed trial's group loaded a step a fallback had marked:
    the rank whose part was intact loaded it without a word, the others failed."""
    try:
        mark = read_damaged_mark(step_dir, storage)
    except Exception:  # (a warning's look: never in the load's way)
        return
    if mark is None:
        return
    if str(mark.get("problem", "")).startswith(f"{DAMAGED_NAME} cannot be read"):
        # (a step directory this user may not search is no mark, QA; a mark there that
        # cannot be read is one, as retention counts it: review)
        try:
            there = DAMAGED_NAME in storage.listdir(step_dir)
        except Exception:
            there = False
        if not there:
            return
    log.warning("%s is marked damaged: %.400s; it is loaded as asked, %s (in a group, a "
                "rank whose part is intact loads it while the others fail): load(..., "
                "fallback=True) takes the newest intact step, on every rank", step_dir,
                mark_text(mark),
                "every checksum checked" if verify else "its checksums NOT checked (verify=False)")


def damaged_marks(root: Path, steps: Sequence[int], storage: ReadStorage) -> set[int]:
    """The steps of ``steps`` whose directory holds a damaged.json (one listing each)."""
    out = set()
    for s in steps:
        try:
            if DAMAGED_NAME in storage.listdir(root / step_dir_name(s)):
                out.add(s)
        except OSError:
            continue  # (gone meanwhile, or unlistable: no verdict read)
    return out


def doomed_steps(root: Path, keep_last: int | None, storage: ReadStorage,
                 protect: int | None = None, keep_every: int | None = None,
                 spare: Callable[[list[int], Collection[int]], Collection[int]] | None = None,
                 damaged: Collection[int] = (), found: set[int] | None = None,
                 amiss: Callable[[int], bool] | None = None,
                 listed: list[int] | None = None,
                 trusted: Collection[int] = ()) -> list[int]:
    """The committed steps that retention deletes: all but the newest ``keep_last``
    (never ``protect``, nor a multiple of ``keep_every``, nor one that ``spare`` picks
    of all the committed steps, told which are damaged: keep_best's), oldest first.
    Damaged steps (a fallback load found them corrupt: ``damaged``, and those marked so
    on disk, which ``found`` gets) are not counted among the newest: they go once older
    than every step kept, so that a damaged step never takes the place of an intact one.
    So do the steps ``amiss`` says have a file missing or cut short (no load has marked
    them yet: a stat tells), among the newest and, of the old, those ``spare`` picks (the
    others go or stay whatever their files: not looked at). ``listed`` receives the
    committed steps; ``trusted``: steps known committed (see committed_steps)."""
    if keep_last is None:
        return []
    steps = committed_steps(root, storage, skip_denied=True, trusted=trusted)
    if listed is not None:
        listed[:] = steps
    kept: list[int] = []
    marked: set[int] = set()
    for s in reversed(steps):  # newest first: the marks looked for only as far as needed
        if s in damaged:
            continue
        if damaged_marks(root, [s], storage) or (amiss is not None and s != protect
                                                 and amiss(s)):
            marked.add(s)
            continue
        kept.append(s)
        if len(kept) == keep_last:
            break
    floor = kept[-1] if kept else None  # the oldest step kept
    old = [s for s in steps if floor is not None and s < floor]
    # the marks of the old steps: of all, for keep_best's ranking; else of those that go
    # only (a milestone stays, marked or not: its directory is not looked into)
    looked_at = old if spare is not None else [
        s for s in old if s != protect and (keep_every is None or s % keep_every)]
    bad = marked | damaged_marks(root, looked_at, storage) if looked_at else marked
    # (keep_best ranks the intact steps: a damaged best one held a place that an intact
    # step then lost)
    spared = spare(steps, bad | set(damaged)) if spare is not None and old else ()
    looked: set[int] = set()
    while amiss is not None and spare is not None and old:  # (a few rounds at most)
        new = {s for s in spared if s not in looked and s < (floor or 0)
               and s not in bad and s not in damaged}
        if not new:
            break
        looked |= new
        cut = {s for s in new if amiss(s)}
        if not cut:
            break
        bad |= cut
        spared = spare(steps, bad | set(damaged))
    if found is not None:  # (of the steps that go: those a save's warning leaves out)
        found |= bad
    return [s for s in old
            if s != protect and (keep_every is None or s % keep_every) and s not in spared]


# How long retention (or a rollback) waits for a load of the same checkpointer to pick
# its step: not for ever, as a signal handler that saves and closes the checkpointer while
# the load it interrupted holds the lock would wait for that retention on the very thread
# that holds it.
RETENTION_LOCK_S = 5.0


class StepsInUse:
    """The steps a checkpointer is loading, which its retention must leave alone.

    Thread-safe: loads ``hold`` a step (None: every step, for a load that may fall back
    to older ones) while retention picks and hides steps under ``lock``.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._held: collections.Counter[int | None] = collections.Counter()
        # steps a retention left for a load (here, or on another rank), which a later one
        # removes beside its own: not the "several steps at once" of changed settings
        self.deferred: set[int] = set()

    @contextlib.contextmanager
    def locked(self) -> Iterator[bool]:
        """``lock``, for retention and rollbacks: waited for ``RETENTION_LOCK_S`` at most.
        Yields whether it was taken (and is held until the block ends)."""
        got = self.lock.acquire(timeout=RETENTION_LOCK_S)
        try:
            yield got
        finally:
            if got:
                self.lock.release()

    def hold(self, step: int | None) -> None:
        """Call with ``lock`` held, right after resolving the step."""
        self._held[step] += 1

    def release(self, step: int | None) -> None:
        with self.lock:
            self._held[step] -= 1
            if not self._held[step]:
                del self._held[step]

    def spare(self, doomed: list[int]) -> list[int]:
        """The steps of ``doomed`` that no load holds (call with ``lock`` held); the others
        are noted as ``deferred``."""
        free = [] if None in self._held else [s for s in doomed if s not in self._held]
        self.deferred.update(set(doomed) - set(free))
        return free


def hide_step(root: Path, step: int, storage: Storage) -> Path:
    """Rename a committed step out of sight (durably); return where it now lies, for the
    caller to remove. Readers and ``steps()`` no longer see it; a crash before the
    removal leaves a ``.deleting-`` directory that the next checkpointer removes."""
    gone = root / f".step_{step:09d}.deleting-{uuid.uuid4().hex[:12]}"
    storage.rename(root / step_dir_name(step), gone)
    storage.fsync_dir(root)
    return gone


def deleting_dirs(root: Path, storage: ReadStorage) -> list[str]:
    """The ``.deleting-`` directories under ``root``: steps hidden by retention whose
    removal is still to come, or failed. (``.tmp-`` ones are left out: a save may be
    writing one.)"""
    return [n for n in abandoned_dirs(root, storage) if ".deleting-" in n]


def is_checkpoint_root(d: Path) -> bool:
    """A (local) directory saves go to: it holds the lock file of a checkpointer or a
    committed step."""
    try:
        if (d / DirectoryLock.NAME).exists():
            return True
        return any(step_of_dir_name(name) is not None
                   and (d / name / MANIFEST_NAME).is_file() for name in os.listdir(d))
    except OSError:
        return False


def has_rank_files(d: Path) -> bool:
    try:
        return any(is_shard_file_name(n) for n in os.listdir(d))
    except OSError:
        return False


def _is_step_dir(d: Path) -> bool:
    """Whether ``d``, named like a step directory, is one: the name alone is no evidence
    (``hf/step_000000001/`` may be any export's folder), a manifest or shard files in it,
    or a checkpoint root around it, are."""
    try:
        if (d / MANIFEST_NAME).exists() or has_rank_files(d):
            return True
    except OSError:
        return True  # (it cannot be looked into: refusing is the safe side)
    return is_checkpoint_root(d.parent)


def _holds_a_step(d: Path) -> bool:
    """A step directory under another name (copied, or passed as is): a manifest beside
    shard files."""
    try:
        return (d / MANIFEST_NAME).is_file() and has_rank_files(d)
    except OSError:
        return False


def step_dir_around(path: Path) -> Path | None:
    """The step directory that the (local, resolved) ``path`` is or lies inside, if any:
    what is written there changes a committed step, and goes when retention removes it."""
    for d in (path, *path.parents):
        if _holds_a_step(d) or (is_step_dir_name(d.name) and _is_step_dir(d)):
            return d
    return None
