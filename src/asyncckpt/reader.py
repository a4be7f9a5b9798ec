"""Reading checkpoints: manifests, tensors straight into their targets, verification.

Reads go straight into the destination tensor's memory when the saved chunk is the
whole destination (the common, same-layout case); otherwise through a temporary
tensor from which the intersecting box is copied. Each piece is hashed right after
it is read, while it is still in cache, and compared with the manifest's checksums.
Nothing here unpickles or executes anything from the file.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import functools
import itertools
import json
import logging
import math
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
import xxhash

from . import _memory
from ._gc import gc_paused
from ._pool import KeptThreads, kept_threads, run_beside
from .commit import step_of_dir_name
from .errors import (
    CheckpointConfigError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointPermissionError,
    with_advice,
)
from .manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    BlockHasher,
    Chunk,
    Manifest,
    ManifestSummary,
    TensorEntry,
    block_checksums,
    decode_header,
    parse_manifest,
    parse_manifest_summary,
    st_dtype_and_shape,
)
from .plan import (
    Box,
    ReadItem,
    box_byte_span,
    plan_reads,
    row_major_strides,
)
from .storage import LocalStorage, ReadStorage, is_transient
from .tree import dtype_name

log = logging.getLogger(__name__)

# Reads go in pieces this large; each is hashed right after it lands, while it is still in
# the cache: a hot 3 GiB load took 224 ms with 2 MiB pieces and 246 ms with 8 MiB ones.
_PIECE = 2 * 1024 * 1024
# The most of a box a read goes through a temporary at once (plus the checksum blocks at
# its two ends, which each piece reads and verifies whole)
_BOX_PIECE = 64 * 1024 * 1024
_MAX_IOV = 1024  # Linux's IOV_MAX
_MAX_GAP = 1 << 20  # padding read into scratch rather than starting a new read


def read_manifest(step_dir: Path, storage: ReadStorage) -> Manifest:
    """Read and validate ``step_dir/manifest.json``.

    A manifest marked partial (the view of some boxes that a peer serves) is refused
    unless ``storage`` serves such views (``peer_view``): a committed checkpoint is
    whole. A step directory's manifest must be of the step its name says; a storage
    with ``check_manifest(manifest)`` checks the manifest further (raising if it refuses
    it).
    """
    path, raw = _manifest_bytes(step_dir, storage)
    with gc_paused():
        manifest = parse_manifest(raw, str(path))
    _check_read(step_dir, path, storage, manifest.step, manifest.partial)
    check = getattr(storage, "check_manifest", None)
    if check is not None:  # (a peer's: the manifest must be of the step asked for)
        check(manifest)
    return manifest


def read_manifest_summary(step_dir: Path, storage: ReadStorage) -> ManifestSummary:
    """What ``asyncckpt ls`` shows of a step: :func:`read_manifest`'s checks but of the
    tensor entries (counted, not parsed one by one; the manifest's digest still is)."""
    path, raw = _manifest_bytes(step_dir, storage)
    with gc_paused():  # (json.loads of 100,000 entries: 0.2 s paused, 0.45 s with it)
        summary = parse_manifest_summary(raw, str(path))
    _check_read(step_dir, path, storage, summary.step, summary.partial)
    return dataclasses.replace(summary, manifest_bytes=len(raw))


def _manifest_bytes(step_dir: Path, storage: ReadStorage) -> tuple[Path, bytes]:
    path = step_dir / MANIFEST_NAME
    try:
        return path, storage.read_bytes(path, MAX_MANIFEST_BYTES)
    except CheckpointError:
        raise  # already says what is missing (e.g. a peer that serves another step)
    except FileNotFoundError:
        # (the directory gone with it: retired by a saver's keep_last as it was read, which
        # a QA re-check's reader was told, 1 load in ~25,000, as "has no manifest.json")
        try:
            gone = step_dir.name not in storage.listdir(step_dir.parent)
        except Exception:
            gone = False
        if gone:
            raise deleted_while_read(step_dir) from None
        raise CheckpointNotFoundError(f"{step_dir} has no {MANIFEST_NAME}: not a committed "
                                      "checkpoint") from None
    except ValueError as exc:
        raise CheckpointCorruptError(str(exc), path=str(path)) from exc
    except OSError as exc:  # a directory, a symlink loop, no permission, EIO
        raise _damaged(path, exc) from exc


def _check_read(step_dir: Path, path: Path, storage: ReadStorage, step: int,
                partial: bool) -> None:
    if partial and not getattr(storage, "peer_view", False):
        raise CheckpointCorruptError(
            f"{path}: the manifest is marked partial (as a peer's view of some boxes is, and "
            "a committed checkpoint never): it is corrupt; load another step",
            path=str(path))
    named = step_of_dir_name(step_dir.name)
    if named is not None and named != step:
        raise CheckpointCorruptError(
            f"{path} is the manifest of step {step}, but its directory is that of "
            f"step {named}: it was copied from another step or rewritten; load an earlier "
            "step", path=str(path))


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (which it does not keep
    alive: the caller holds the tensor while it uses the view)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    view: memoryview = _memory_view(t.data_ptr(), n, _PYBUF_WRITE)
    return view


# A memoryview over raw memory. (ctypes' (c_char * n).from_address made a new array type
# for each size: ~10 µs a tensor, 40 ms of a 4,000-tensor load.)
_memory_view = ctypes.pythonapi.PyMemoryView_FromMemory
_memory_view.restype = ctypes.py_object
_memory_view.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int]
_PYBUF_WRITE = 0x200


def copy_into(dst: torch.Tensor, src: torch.Tensor, key: str | None = None) -> None:
    """``dst.copy_(src)`` for any target a user may pass: autograd off (a view of a
    parameter takes its new values in place), and inference mode on for an inference
    tensor (which refuses in-place writes outside it). Reader threads do not inherit the
    caller's modes, so each copy sets them. A copy that casts (``cast=True``) to a dtype
    of a narrower range warns, naming ``key``, of the values beyond it: torch makes them
    inf (floats) or wraps them around (integers) without a word."""
    with torch.inference_mode(dst.is_inference()), torch.no_grad():
        dst.copy_(src)
        if dst.dtype != src.dtype:
            beyond = out_of_range(src, dst.dtype)
            if beyond:
                log.warning("loading %s with cast=True: %d of its %s values are beyond the "
                            "range of %s and %s", key or "a tensor", beyond,
                            dtype_name(src.dtype), dtype_name(dst.dtype),
                            "became inf or NaN (or its largest value, where the cast "
                            "saturates)" if dst.dtype.is_floating_point else
                            "have a part that became inf" if dst.dtype.is_complex else
                            "wrapped around")


@functools.cache
def _holds_inf(dtype: torch.dtype) -> bool:
    """Whether a float dtype holds infinity (float8_e4m3fn and the fnuz ones do not)."""
    try:
        return bool(torch.tensor(float("inf")).to(dtype).float().isinf())
    except (RuntimeError, NotImplementedError):
        return True  # (no cast to tell: nothing said of it)


def out_of_range(src: torch.Tensor, dtype: torch.dtype) -> int:
    """How many values of ``src`` a cast to ``dtype`` changes for lying beyond its range:
    finite ones beyond it, and infinities where ``dtype`` has none (float8_e4m3fn
    saturates them, or makes them NaN); 0 when its range holds all of ``src.dtype``'s,
    or either is no real float or integer dtype."""
    if src.is_complex() and dtype.is_complex:  # (each part as a float of half the width)
        part = {torch.complex128: torch.float64, torch.complex64: torch.float32,
                torch.complex32: torch.float16}.get(dtype)
        if part is None:
            return 0
        try:
            parts = torch.view_as_real(src)
        except RuntimeError:  # (no real view of this dtype on this build)
            return 0
        top = torch.finfo(part).max
        if torch.finfo(parts.dtype).max <= top:
            return 0
        return int(((parts.abs() > top) & parts.isfinite()).any(-1).sum())
    floats = src.is_floating_point(), dtype.is_floating_point
    if src.is_complex() or dtype.is_complex or src.dtype == torch.bool or dtype == torch.bool:
        return 0
    if all(floats):
        top = torch.finfo(dtype).max
        # (a format without infinities, float8_e4m3fn's, saturates or NaNs them: changed)
        lost = int(src.isinf().sum()) if _holds_inf(src.dtype) and not _holds_inf(
            dtype) else 0
        if torch.finfo(src.dtype).max <= top or src.numel() == 0:
            return lost
        # One pass without temporaries first: where the extremes are finite and in range,
        # nothing is beyond (a trial's fp32 -> bf16 load took 17x a plain cast, and 3x the
        # tensor's memory, counting with abs(), isfinite() and a mask)
        lo, hi = (float(x) for x in torch.aminmax(src))
        if math.isfinite(lo) and math.isfinite(hi) and max(-lo, hi) <= top:
            return lost
        return lost + int((src.abs() > top).logical_and_(src.isfinite()).sum())
    if not any(floats):
        have, want = torch.iinfo(src.dtype), torch.iinfo(dtype)
        # Only the bounds inside src's own range are compared: a bound beyond it would be
        # converted to src's dtype, and wrap (int8's -128 as uint8 is 128).
        below = have.min < want.min
        above = have.max > want.max
        if have.min == 0 and src.dtype != torch.uint8 and above:
            # torch compares no wider unsigned dtype: as the signed dtype of its width, the
            # values past that one's top read negative (want.max is below it: a dtype
            # that fits none of them, or src would be no wider)
            signed = {2: torch.int16, 4: torch.int32, 8: torch.int64}[src.element_size()]
            as_signed = src.view(signed)
            return int(((as_signed < 0) | (as_signed > want.max)).sum())
        if below and above:
            return int(((src < want.min) | (src > want.max)).sum())
        if below:
            return int((src < want.min).sum())
        if above:
            return int((src > want.max).sum())
        return 0
    return 0


def load_tensors(step_dir: Path, manifest: Manifest, dests: Mapping[str, torch.Tensor | None],
                 storage: ReadStorage, *, verify: bool = True, threads: int | None = None,
                 boxes: Mapping[str, Box] | None = None, read: list[int] | None = None,
                 progress: Callable[[int, int], None] | None = None,
                 bump_versions: bool = True,
                 casts: Set[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Load the tensors named in ``dests`` into the given tensors (or new CPU ones for None).

    ``boxes`` gives, for sharded destinations, the box of the global tensor each one
    holds; the others get the whole tensor. ``read``, when given, receives the size of
    the saved chunks the load reads from (of which a resharding load reads only its
    boxes). ``progress(done, total)``, when given, is called from the reading threads
    after each tensor or run of tensors read, in bytes of those chunks. Returns key ->
    loaded tensor. A given destination must have the box's shape and the saved dtype,
    but for the keys in ``casts``, whose destination has another dtype the caller chose
    to cast to (loader.castable): it is filled in place and returned as is (a cast one
    through a temporary of one piece at a time).
    Raises CheckpointCorruptError naming the file and tensor on any mismatch.
    """
    boxes = boxes or {}
    items = plan_reads(manifest, {k: boxes.get(k) for k in dests})
    # Every file this load reads must exist, have its manifest size and its header: only
    # then are fresh tensors allocated, so a forged manifest cannot make us allocate more
    # than the files really hold. Only those it reads: a rank wanting one box of a
    # tensor sharded over every rank's file opens the few files holding that box, not
    # every file (world x world opens), and a damaged file it does not need is no error
    # of its load (verify_checkpoint checks every file).
    check_files(step_dir, manifest, sorted({it.chunk.file for it in items}), storage)
    return _load_checked(step_dir, manifest, dests, storage, verify=verify, threads=threads,
                         boxes=boxes, items=items, read=read, progress=progress,
                         bump_versions=bump_versions, casts=casts)


def _load_checked(step_dir: Path, manifest: Manifest, dests: Mapping[str, torch.Tensor | None],
                  storage: ReadStorage, *, verify: bool, threads: int | None,
                  boxes: Mapping[str, Box], items: list[ReadItem] | None = None,
                  read: list[int] | None = None,
                  progress: Callable[[int, int], None] | None = None,
                  bump_versions: bool = True,
                  casts: Set[str] = frozenset()) -> dict[str, torch.Tensor]:
    """load_tensors once the files it reads are known to be whole (``items``: the read
    plan, where the caller made it already). ``bump_versions=False``: the given tensors'
    autograd version counters are left as they were (see loader.load_reusing). ``casts``:
    as for load_tensors."""
    shapes = {k: boxes[k][1] if k in boxes else manifest.tensors[k].shape for k in dests}
    if items is None:
        items = plan_reads(manifest, {k: boxes.get(k) for k in dests})
    _check_covered(items, shapes, step_dir)  # before allocating: a partial view bounds nothing
    out: dict[str, torch.Tensor] = {}
    fresh: dict[str, tuple[int, int]] = {}  # the tensors allocated here: (pointer, bytes)
    advise = _MAX_ADVISED  # each advice may split a mapping: keep the count of them bounded
    tensors = manifest.tensors
    for key, dst in dests.items():  # (once per tensor: a fresh load of 100,000 allocates
        if dst is None:             # as many, so no context manager or path per tensor)
            entry = tensors[key]
            try:
                dst = fresh_tensor(shapes[key], entry.dtype, advise=advise > 0)
            except (RuntimeError, MemoryError) as exc:
                where = step_dir / entry.chunks[0].file if entry.chunks else step_dir
                raise _allocation_error(where, key, math.prod(shapes[key]) * entry.dtype.itemsize
                                        ) from exc
            nbytes = dst.nbytes
            fresh[key] = (dst.data_ptr(), nbytes)
            advise -= nbytes >= _HUGE_MIN_BYTES
        out[key] = dst
    total = sum(it.chunk.nbytes for it in items)
    if read is not None:
        read.append(total)
    n = _reader_threads(threads, len(items))
    if threads is None and total < len(items) * _SMALL_ITEM and isinstance(storage, LocalStorage):
        # Many small tensors (a few KiB each): reading them is Python's work more than the
        # disk's or memory's, and two threads only take turns with the GIL (a load of
        # 100,000 tensors of 16 KiB took 15% longer with two).
        n = 1
    advance = None if progress is None else _advancing(progress, total)
    try:
        # (several groups: one that fails stops the others at their next item)
        _in_groups(lambda g, stop: _read_group(step_dir, manifest, g, out, storage, verify,
                                               stop, advance, fresh, casts),
                   _split(items, n, total), threading.Event() if n > 1 else None, storage)
    finally:
        # Reads straight into a given tensor's memory are in-place writes autograd does
        # not see: bump their version counters as copy_ would, so a graph that saved one
        # for backward fails loudly instead of computing a gradient from the new values.
        if bump_versions:
            _bump_versions([t for t in dests.values()
                            if t is not None and not t.is_inference()])
    return out


def _reader_threads(threads: int | None, items: int) -> int:
    """How many threads read ``items`` items: ``threads``, else up to 2 (one on one CPU),
    never more than the items, at least one."""
    return max(1, min(threads or min(2, os.cpu_count() or 1), items))


# Below this many bytes a tensor, on average, a local load reads with one thread.
_SMALL_ITEM = 64 * 1024


def _bump_versions(tensors: list[torch.Tensor]) -> None:
    if not tensors:
        return
    try:
        torch.autograd.graph.increment_version(tensors)
    except (TypeError, RuntimeError):
        # torch < 2.6 takes one tensor at a time (and raises RuntimeError, "expect a
        # Tensor as input", for a list); any other cause is raised again below
        for t in tensors:
            torch.autograd.graph.increment_version(t)


# Fresh tensors at least this large have their memory marked for transparent huge pages.
_HUGE_MIN_BYTES = 4 << 20
# Advising part of a mapping splits it in up to three, and a process may hold at most
# vm.max_map_count (65,530 by default) mappings: one load advises this many tensors at most.
_MAX_ADVISED = 4096


@contextlib.contextmanager
def _allocating(where: Path, key: str, nbytes: int) -> Iterator[None]:
    """A failed allocation of a size the manifest claims, as :func:`_allocation_error`."""
    try:
        yield
    except (RuntimeError, MemoryError) as exc:
        raise _allocation_error(where, key, nbytes) from exc


def _allocation_error(where: Path, key: str, nbytes: int) -> CheckpointError:
    """What a failed allocation of ``nbytes`` for tensor ``key`` is: out of memory, or (a
    size no machine like this one could hold) CheckpointCorruptError: sizes are checked
    against the files, but a sparse file or a peer can claim any."""
    if nbytes <= _physical_memory():  # a size this machine could hold: out of memory
        return CheckpointError(
            f"{where}: tensor {key!r} needs {nbytes} bytes, which could not be allocated "
            "(out of memory?): free memory, or load into an existing state")
    # (maybe intact: no load marks the step damaged for it, a review's 200 GB embedding
    # read on a 128 GB node)
    return CheckpointCorruptError(
        f"{where}: tensor {key!r} claims {nbytes} bytes, more than this machine's memory "
        "could ever hold: the checkpoint is likely damaged (load another step), or was made "
        "on a machine with more memory (load it there)", path=str(where), key=key,
        maybe_intact=True)


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 1 << 62


def fresh_tensor(shape: tuple[int, ...], dtype: torch.dtype, *, advise: bool = True
                 ) -> torch.Tensor:
    """An uninitialised CPU tensor for a load to fill: ``torch.empty`` plus a hint.

    Before anything touches a large one, its whole 2 MiB-aligned interior is advised
    MADV_HUGEPAGE, so the reads that fill it fault in 2 MiB pages rather than 4 KiB ones
    (on the 2-core VM a fresh 3 GiB load spent most of its time faulting). The tensor
    is an ordinary one in every other way: resizable, shareable, freed as usual.
    """
    t = torch.empty(shape, dtype=dtype)
    nbytes = t.numel() * t.element_size()
    if advise and _memory.madvise is not None and nbytes >= _HUGE_MIN_BYTES:
        addr = t.data_ptr()
        huge = _memory.HUGE_PAGE
        start = -(-addr // huge) * huge
        end = (addr + nbytes) // huge * huge
        if end > start:
            _memory.madvise(start, end - start, _memory.MADV_HUGEPAGE)  # (else plain pages)
    return t


# One pool for every load of the process: it starts a thread only when none is idle, so
# it holds as many as the most loads have ever read at once (one pool per thread count
# kept a pool for each count asked: 120 idle threads after loads of 1..16 tensors).
_MAX_READ_THREADS = 64


def _read_pool() -> KeptThreads:
    """Reader threads kept for the process's later loads (starting them costs ~5 ms).

    A load of ``n`` groups submits ``n - 1`` calls; beyond the pool's size they queue
    (each load also reads a group on its own thread, so it always makes progress)."""
    return kept_threads("asyncckpt-read", _MAX_READ_THREADS)


def _check_covered(items: list[ReadItem], shapes: Mapping[str, tuple[int, ...]],
                   step_dir: Path) -> None:
    """Every wanted element must come from some saved chunk: a partial source (a peer's
    view) that lacks part of a wanted box is an error, never uninitialised memory."""
    got: dict[str, int] = {}
    whole: set[str] = set()  # the keys one item fills all of (the plan's usual item)
    for it in items:
        box = it.box
        if box is it.dst_box and box[1] == shapes.get(it.key) and it.key not in whole:
            whole.add(it.key)
        else:
            got[it.key] = got.get(it.key, 0) + math.prod(box[1])
    for key, shape in shapes.items():
        if key in whole and key not in got:
            continue
        want = math.prod(shape)
        have = got.get(key, 0) + (want if key in whole else 0)
        if have != want:
            raise CheckpointNotFoundError(
                f"{step_dir}: the checkpoint holds {have} of the {want} wanted elements "
                f"of tensor {key!r}: the source (e.g. a peer serving only its own shards) "
                "does not have the box this process needs")


class _Chunked(Protocol):
    """Something read from one saved chunk (a load's ReadItem, a verify's item)."""

    @property
    def chunk(self) -> Chunk: ...


_C = TypeVar("_C", bound=_Chunked)
_R = TypeVar("_R")


def _split(items: list[_C], n: int, total: int) -> list[list[_C]]:
    """Cut the (sorted) items, of ``total`` bytes, into ``n`` runs of about equal bytes,
    each sequential."""
    if n == 1:
        return [items]
    total = total or 1
    groups: list[list[_C]] = [[] for _ in range(n)]
    acc = 0
    for it in items:
        g = min(n - 1, acc * n // total)
        groups[g].append(it)
        acc += it.chunk.nbytes
    return [g for g in groups if g] or [[]]


def _in_groups(read: Callable[[list[_C], threading.Event | None], _R], groups: list[list[_C]],
               stop: threading.Event | None, storage: ReadStorage | None = None) -> list[_R]:
    """``read(group, stop)`` for every group: the first on this thread, the others on kept
    reader threads. Returns their results, in order, once every thread is done (never
    leaving one writing into memory the caller is about to use, not even on a Ctrl-C:
    it sets ``stop``, interrupts a peer's ``storage``, and is raised once they ended);
    raises the first group's error, else the first other's."""
    if len(groups) == 1:
        return [read(groups[0], stop)]
    event = stop if stop is not None else threading.Event()

    def stopped() -> None:
        event.set()
        interrupt = getattr(storage, "interrupt", None)
        if interrupt is not None:  # (threads blocked on a stalled peer end now)
            with contextlib.suppress(Exception):
                interrupt()

    return run_beside(_read_pool(), functools.partial(read, groups[0], event),
                      [functools.partial(read, g, event) for g in groups[1:]], stopped)


def _advancing(progress: Callable[[int, int], None], total: int) -> Callable[[int], None]:
    """A thread-safe counter that calls ``progress(done, total)`` as bytes are read."""
    lock = threading.Lock()
    done = [0]

    def advance(nbytes: int) -> None:
        with lock:
            done[0] += nbytes
            progress(done[0], total)

    return advance


def _read_group(step_dir: Path, manifest: Manifest, items: list[ReadItem],
                out: Mapping[str, torch.Tensor], storage: ReadStorage, verify: bool,
                stop: threading.Event | None = None,
                advance: Callable[[int], None] | None = None,
                fresh: Mapping[str, tuple[int, int]] | None = None,
                casts: Set[str] = frozenset()) -> None:
    """Read ``items`` in order. With ``stop`` (groups read in parallel): a failure sets
    it, and a group that sees it set ends before its next item or piece (a corrupt
    first range of a peer's fetch is reported at once, not after every other range, or
    the rest of a multi-GB tensor, came in). ``fresh``: the destinations the load
    allocated, (pointer, bytes) by key (see :func:`_direct_views`). ``casts``: the keys
    whose destination has another dtype than the saved one (read, then cast)."""
    fds: dict[str, int] = {}
    unfinished = False  # failed, or stopped: its files are aborted, not closed
    views = _direct_views(items, out, fresh)
    if casts:  # (their bytes are not the destination's: never read straight into it)
        views = [None if it.key in casts else v for it, v in zip(items, views, strict=True)]
    try:
        i = 0
        while i < len(items):
            if stop is not None and stop.is_set():
                unfinished = True
                return  # another group failed: its error is the one raised
            it = items[i]
            fd = fds.get(it.chunk.file)
            if fd is None:  # checked by load_tensors already: just open it
                fd = fds[it.chunk.file] = _open(step_dir / it.chunk.file, storage)
            j = _batch_end(items, views, i)
            try:
                if j - i > 1:
                    _read_batch(fd, step_dir / it.chunk.file, items[i:j], views[i:j],
                                out, storage, verify, manifest.block_bytes)
                else:
                    _read_item(fd, step_dir / it.chunk.file, it, out[it.key], storage, verify,
                               manifest.block_bytes, stop, views[i],
                               manifest.tensors[it.key].dtype if it.key in casts else None)
            except _Stopped:
                unfinished = True
                return  # another group failed: its error is the one raised
            except CheckpointError:
                raise
            except OSError as exc:  # EIO from a failing disk, a file cut short by hand...
                raise _damaged(step_dir / it.chunk.file, exc, it.key) from exc
            if advance is not None:
                advance(sum(it.chunk.nbytes for it in items[i:max(j, i + 1)]))
            i = max(j, i + 1)
    except BaseException as exc:
        unfinished = True
        if stop is not None:
            if stop.is_set() and isinstance(exc, Exception):
                return  # an effect of another group's failure (its reads were cut off)
            stop.set()
            interrupt = getattr(storage, "interrupt", None)
            if interrupt is not None:  # a peer's: reads blocked on a stalled peer end now
                with contextlib.suppress(Exception):
                    interrupt()
        raise
    finally:
        for fd in fds.values():
            if unfinished:
                _abort(storage, fd)
            else:
                _close(storage, fd)


class _Stopped(Exception):
    """Another group of the load failed: this one ends before its next piece."""


def _close(storage: ReadStorage, fd: int) -> None:
    """Close ``fd`` after a read that went well. An OSError of the close itself (a storage
    of a network filesystem's EIO) says nothing of bytes already read and checked: it is
    logged, not raised (a trial's load of an intact step failed with a bare OSError)."""
    try:
        storage.close(fd)
    except CheckpointError:  # (a peer storage's own word: not the close's OSError)
        raise
    except OSError as exc:
        log.warning("closing a checkpoint file after reading it failed (%s: %s); what was "
                    "read is checked by its checksums", type(exc).__name__, exc)


def _abort(storage: ReadStorage, fd: int) -> None:
    """Close ``fd`` after a failed read, through the storage's ``abort`` where it has one
    (a peer's drops the rest of its stream rather than read it to its end: a peer that
    just sent bad bytes may stall). Never raises: the failure is the error to report."""
    try:
        getattr(storage, "abort", storage.close)(fd)
    except Exception:
        log.debug("closing a file after a failed read failed too", exc_info=True)


def _direct_view(it: ReadItem, dst: torch.Tensor, memory: tuple[int, int] | None = None
                 ) -> memoryview | None:
    """``dst``'s memory when the saved chunk is the whole destination and ``dst`` can take
    the bytes as they are (the item is read straight into it), else None. ``memory``:
    (pointer, bytes) of a destination the load allocated itself (``fresh_tensor``: plain
    memory, nothing to ask torch about it).

    That is ``it.whole_chunk and it.whole_dst and plain_memory(dst, empty_ok=True)``, then
    ``tensor_bytes(dst)``, spelled out: it runs once per item of every load, and the calls
    cost ~4% of a load of 100,000 small tensors. A change to plain_memory goes here too.
    """
    box = it.box
    if box != it.dst_box or box != (it.chunk.offsets, it.chunk.lengths):
        return None
    if memory is None:
        if not (dst.is_cpu and dst.is_contiguous()) or dst.is_conj() or dst.is_neg():
            return None
        n = dst.numel() * dst.element_size()
        ptr = dst.data_ptr() if n else 0
    else:
        ptr, n = memory
    if not n:
        return memoryview(bytearray(0))
    return _memory_view(ptr, n, _PYBUF_WRITE) if ptr else None


def _direct_views(items: list[ReadItem], out: Mapping[str, torch.Tensor],
                  fresh: Mapping[str, tuple[int, int]] | None = None
                  ) -> list[memoryview | None]:
    """:func:`_direct_view` of each item: found once, before the reads. ``fresh`` holds
    (pointer, bytes) of the destinations the load allocated, by key."""
    known = (fresh or {}).get
    return [_direct_view(it, out[it.key], known(it.key)) for it in items]


def _batch_end(items: list[ReadItem], views: list[memoryview | None], i: int) -> int:
    """The end of the run of small direct items from ``i`` on that lie back to back (up
    to small gaps) in one file: one vectored read of at most _PIECE bytes fills them."""
    first = items[i].chunk
    end = first.byte_range[1]
    size = end - first.byte_range[0]
    if size >= _PIECE or views[i] is None:
        return i + 1
    j = i + 1
    stop = min(len(items), i + _MAX_IOV // 2)
    while j < stop and views[j] is not None:
        ch = items[j].chunk
        lo, hi = ch.byte_range
        gap = lo - end
        if ch.file != first.file or not 0 <= gap <= _MAX_GAP or size + gap + hi - lo > _PIECE:
            break
        end = hi
        size += gap + hi - lo
        j += 1
    return j


def read_full(storage: ReadStorage, fd: int, view: memoryview, offset: int) -> int:
    """Read ``len(view)`` bytes at ``offset`` into ``view``, through short reads (a network
    storage's, or a signal's), up to the end of the file; return how many were read."""
    pos = 0
    while pos < len(view):
        got = storage.pread_into(fd, [view[pos:]], offset + pos)
        if got <= 0:
            break
        pos += got
    return pos


def _read_batch(fd: int, path: Path, items: list[ReadItem], dsts: list[memoryview | None],
                out: Mapping[str, torch.Tensor], storage: ReadStorage, verify: bool,
                block_bytes: int) -> None:
    """Read a run of whole chunks straight into their tensors' memory (``dsts``) with one
    vectored read."""
    views: list[memoryview] = []
    pos = start = items[0].chunk.byte_range[0]
    for it, mv in zip(items, dsts, strict=True):
        lo, hi = it.chunk.byte_range
        if lo != pos:
            views.append(memoryview(bytearray(lo - pos)))  # alignment padding between tensors
        views.append(mv)  # type: ignore[arg-type]  # (_batch_end takes direct items only)
        pos = hi
    if storage.pread_into(fd, views, start) != pos - start:
        # A short read (the end of a truncated file, or a signal): item by item, which
        # names the tensor that is missing.
        for it, mv in zip(items, dsts, strict=True):
            _read_item(fd, path, it, out[it.key], storage, verify, block_bytes, None, mv)
        return
    if verify:
        digest = xxhash.xxh3_64_hexdigest
        for it, mv in zip(items, dsts, strict=True):
            sums = it.chunk.checksums
            if len(sums) == 1 and len(mv) <= block_bytes and digest(mv) == sums[0]:  # type: ignore[arg-type]
                continue  # (the common case, checked inline: one block, intact)
            _check_sums(path, it.key, it.chunk, 0, block_checksums(mv, block_bytes),  # type: ignore[arg-type]
                        block_bytes)


def _damaged(path: Path, exc: OSError, key: str | None = None) -> CheckpointError:
    """A lasting error reading ``path`` (EIO, a directory, a symlink loop) as damage; no
    permission as CheckpointPermissionError (the bytes may be intact: nothing to fall back
    past); an error of the moment (see ``is_transient``) is re-raised as it is."""
    if is_transient(exc):
        raise exc
    what = f"{path}" if key is None else f"{path} (tensor {key!r})"
    if exc.errno == errno.EFAULT:  # the kernel could not write where it was told to
        return CheckpointConfigError(
            f"reading {what} into its target failed: {exc.strerror or exc}; the target's "
            "memory cannot be written (a tensor over a read-only mapping?): load into "
            "writable tensors; the checkpoint is not at fault")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return CheckpointPermissionError(
            f"{what} cannot be read: {exc.strerror or exc}; the checkpoint may be intact: give "
            "this user read access (or run as one that has it), then try again", path=str(path))
    # An EIO is a bad sector, or a network mount's outage (an NFS soft mount's timeout):
    # a load goes past the step, but marks nothing (a storage trial's outage marked every
    # step, and the next save's retention deleted them, intact, once it had passed)
    return CheckpointCorruptError(f"{what} cannot be read ({exc.strerror or exc}): the "
                                  "checkpoint is damaged or unreadable", path=str(path), key=key,
                                  maybe_intact=exc.errno == errno.EIO)


def damage_is_certain(exc: BaseException) -> bool:
    """Whether a failed read of a step's manifest (or files) proves the step damaged: a
    corrupt manifest or file, or none there. Not an error of the moment (ESTALE, EMFILE,
    ENOMEM), an EIO (a bad sector, or a network mount's outage), a permission, nor a
    checkpoint newer than this reader: those say nothing of its bytes, and what removes
    steps (retention) or passes over them must take such a step for intact."""
    if isinstance(exc, CheckpointCorruptError):
        return not exc.maybe_intact
    return isinstance(exc, CheckpointNotFoundError)


def _open(path: Path, storage: ReadStorage) -> int:
    try:
        return storage.open_read(path)
    except FileNotFoundError:
        if _gone(path.parent, storage):
            raise deleted_while_read(path.parent) from None
        raise CheckpointCorruptError(f"{path} is missing: the checkpoint is damaged",
                                     path=str(path)) from None
    except CheckpointError:
        raise
    except OSError as exc:  # a directory, a symlink loop, no permission, EIO
        raise _damaged(path, exc) from exc


def deleted_while_read(step_dir: Path) -> CheckpointNotFoundError:
    """The error of a step that went while it was read: retired by a newer save's
    keep_last (or removed by another process), which is no damage."""
    return went(CheckpointNotFoundError(
        f"{step_dir} was deleted while it was being read (the keep_last retention of a newer "
        "save, or another process): use a step that is still committed ('asyncckpt ls' "
        "lists them)"))


def went(exc: CheckpointNotFoundError) -> CheckpointNotFoundError:
    """``exc``, marked as the error of a step that went (or was replaced) while it was
    read: a load of the latest step tries the new latest (see loader.LATEST_TRIES)."""
    exc._went_while_read = True
    return exc


OUTPACED = ("the latest step went while it was read {tries} times in a row: a saver's "
            "keep_last here removes each step sooner than this load reads it; load when that "
            "saver is done or saves less often, keep more steps there (keep_last=2, "
            "keep_every), or pass step= of a step it keeps")


def outpaced(exc: CheckpointNotFoundError, tries: int) -> CheckpointError | None:
    """The error of the last of ``tries`` loads of the latest step, each of which found
    its step gone (a trial's reader beside a keep_last=1 saver was told only of the last
    one); None where ``exc`` is another error."""
    if tries < 2 or not exc._went_while_read:
        return None
    return with_advice(exc, OUTPACED.format(tries=tries))


def _gone(step_dir: Path, storage: ReadStorage) -> bool:
    """Whether the whole step has vanished (its manifest too, not just one shard file)."""
    try:
        return MANIFEST_NAME not in storage.listdir(step_dir)
    except Exception:
        return False


def chunks_by_file(manifest: Manifest) -> dict[str, list[tuple[str, TensorEntry, Chunk]]]:
    """The manifest's chunks by the file holding them, each with its tensor's key and
    entry."""
    return _by_file((key, entry, entry.chunks) for key, entry in manifest.tensors.items())


def check_files(step_dir: Path, manifest: Manifest, names: Iterable[str],
                storage: ReadStorage, problems: list[str] | None = None) -> None:
    """What a load checks of each file it reads before it allocates anything: its size,
    and its safetensors header against the manifest (_check_file); no tensor byte is
    read. Raises the first file's CheckpointCorruptError, or, given ``problems``, notes
    each file's there and goes on (``asyncckpt inspect``)."""
    names = list(names)
    by_file = chunks_by_file(manifest) if names else {}
    for name in names:
        try:
            _check_file(step_dir, manifest, name, storage, by_file.get(name, []))
        except CheckpointCorruptError as exc:
            if problems is None:
                raise
            problems.append(str(exc))


def _by_file(entries: Iterable[tuple[str, TensorEntry, Iterable[Chunk]]]
             ) -> dict[str, list[tuple[str, TensorEntry, Chunk]]]:
    by_file: dict[str, list[tuple[str, TensorEntry, Chunk]]] = {}
    for key, entry, chunks in entries:
        for ch in chunks:
            by_file.setdefault(ch.file, []).append((key, entry, ch))
    return by_file


# (the files whose header a load found as their manifest says, as they were then: a hot
# load of the same checkpoint again skips the comparison, ~8 ms at 4,000 tensors; any
# change to either file changes its ctime)
_headers_seen: dict[tuple[Any, ...], None] = {}


def _header_seen_key(step_dir: Path, path: Path, fd: int, storage: ReadStorage,
                     checksum: str, pruned: bool) -> tuple[Any, ...] | None:
    """What identifies a shard file and its manifest as they are now (local files only;
    None where that cannot be told)."""
    if not isinstance(storage, LocalStorage) or pruned:  # (a view checks some entries only)
        return None
    try:
        a, b = os.fstat(fd), os.stat(step_dir / MANIFEST_NAME)
    except (OSError, TypeError, ValueError):
        return None
    return (str(path), checksum, *(
        (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) for st in (a, b)))


def _check_file(step_dir: Path, manifest: Manifest, name: str, storage: ReadStorage,
                chunks: list[tuple[str, TensorEntry, Chunk]] | None = None) -> None:
    """The file exists, has the manifest's size, and its header has the manifest's checksum;
    with ``chunks`` (the manifest's chunks in it), the header lists those, as the manifest
    says, and nothing else: a manifest re-sealed over a rewritten header (the checksum has
    no key) loaded while any safetensors tool saw other tensors (a security review)."""
    path = step_dir / name
    entry = manifest.files[name]
    fd = _open(path, storage)
    try:
        try:
            size = storage.file_size(fd)
            if size != entry.bytes:
                cut = sorted({k for k, t in manifest.tensors.items() for c in t.chunks
                              if c.file == name and c.byte_range[1] > size})
                lost = ""
                if cut:
                    more = f" and {len(cut) - 5} more" if len(cut) > 5 else ""
                    lost = (f"; tensor(s) {', '.join(map(repr, cut[:5]))}{more} lie past its "
                            "end")
                how = ("truncated or replaced" if size < entry.bytes
                       else "written to past its end (bytes appended), or replaced")
                raise CheckpointCorruptError(
                    f"{path} is {size} bytes but the manifest says {entry.bytes}: the file was "
                    f"{how}{lost}; load another step", path=str(path),
                    key=cut[0] if cut else None)
            header = bytearray(entry.header_bytes)  # parse_manifest bounds it
            got = read_full(storage, fd, memoryview(header), 0)
        except CheckpointError:
            raise
        except OSError as exc:  # EIO from a failing disk
            raise _damaged(path, exc) from exc
        if got != len(header) or xxhash.xxh3_64_hexdigest(header) != entry.header_checksum:
            raise CheckpointCorruptError(
                f"{path}: its safetensors header does not match the manifest's checksum: the "
                "file is corrupt or belongs to another checkpoint; load another step",
                path=str(path))
        seen = _header_seen_key(step_dir, path, fd, storage, entry.header_checksum,
                                manifest.pruned)
        if (chunks is not None and not manifest.from_headers
                and (seen is None or seen not in _headers_seen)):
            with gc_paused():  # (100,000 entries: the collector doubled the time)
                parsed, body = decode_header(bytes(header), str(path))
                problems = _header_problems(path, parsed, body, chunks,
                                            every=not manifest.pruned)
                del parsed
            if not problems and seen is not None:
                if len(_headers_seen) >= 1024:
                    _headers_seen.pop(next(iter(_headers_seen)))
                _headers_seen[seen] = None
            if problems:
                raise CheckpointCorruptError(
                    problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1
                                   else "") + ": the file's header and the manifest disagree "
                    "(damaged, or forged: a safetensors tool would read other tensors than "
                    "a load)", path=str(path), key=problems.first_key)
    except BaseException:
        _abort(storage, fd)
        raise
    _close(storage, fd)


def _read_item(fd: int, path: Path, it: ReadItem, dst: torch.Tensor, storage: ReadStorage,
               verify: bool, block_bytes: int, stop: threading.Event | None = None,
               mv: memoryview | None = None, saved: torch.dtype | None = None) -> None:
    """Read one item into ``dst``; ``_Stopped`` once ``stop`` is set (checked between
    pieces). ``mv``: :func:`_direct_view` of the item, where the caller found it already.
    ``saved``: the saved dtype, when ``dst`` has another (its values are cast)."""
    chunk = it.chunk
    if mv is None and saved is None:
        mv = _direct_view(it, dst)
    if mv is not None:
        # The common case: the saved chunk is the whole destination. Read straight into it.
        _read_range(fd, storage, path, it.key, mv, chunk, 0, verify, block_bytes, stop)
        return
    # Resharding (or a non-contiguous or device destination): read only the checksum blocks
    # that cover the wanted box, verify them, and copy the box out of them.
    dtype = dst.dtype if saved is None else saved
    itemsize = dtype.itemsize
    lens = it.box[1]
    if 0 in lens:
        return  # an empty box: nothing to read
    # (a piece reads and verifies whole blocks: with blocks as large as the piece, pieces
    # would read their blocks again and again)
    piece = max(_BOX_PIECE, 4 * block_bytes)
    if math.prod(lens) * itemsize > piece and any(n > 1 for n in lens):
        # A large box goes through the temporary a slab at a time: a GB-sized shard of one
        # tensor (or a cast one) must not need a GB of memory more. Slabs of the first
        # dimension that is not 1; where one index of it is still too large (a row
        # longer than the piece), each index is split again along the next.
        d = next(i for i, n in enumerate(lens) if n > 1)
        step = max(1, piece // (math.prod(lens[d + 1:]) * itemsize))
        offsets, lengths = it.box
        for a in range(0, lens[d], step):
            slab = ((*offsets[:d], offsets[d] + a, *offsets[d + 1:]),
                    (*lengths[:d], min(step, lens[d] - a), *lengths[d + 1:]))
            _read_item(fd, path, it._replace(box=slab), dst, storage, verify, block_bytes,
                       stop, None, saved)
        return
    tgt = narrow_to_box(dst, it.box, it.dst_box[0])
    runs = _sparse_runs(chunk, it.box, itemsize, block_bytes)
    if runs is None:  # the box's span touches (nearly) every block in it: read the span
        lo, hi = box_byte_span(chunk.offsets, chunk.lengths, it.box, itemsize)
        _read_box_part(fd, storage, path, it.key, chunk, verify, block_bytes, lo, hi,
                       it.box[1], tgt, dst.is_cuda, stop, dtype)
        return
    # Rows longer than a block with wide gaps between them (a column slice of wide
    # rows): read and verify only the blocks each row's part touches.
    d, run_shape, starts = runs
    for index, start in starts:
        part = tgt[index] if d else tgt
        _read_box_part(fd, storage, path, it.key, chunk, verify, block_bytes, start,
                       start + math.prod(run_shape) * itemsize, run_shape, part, dst.is_cuda,
                       stop, dtype)


def narrow_to_box(t: torch.Tensor, box: Box, origin: tuple[int, ...] | None = None
                  ) -> torch.Tensor:
    """The view of ``t`` (whose first element is at ``origin`` in global coordinates, the
    zero point by default) that ``box`` covers."""
    for d, (o, n) in enumerate(zip(*box, strict=True)):
        t = t.narrow(d, o - (origin[d] if origin is not None else 0), n)
    return t


def _read_box_part(fd: int, storage: ReadStorage, path: Path, key: str, chunk: Chunk,
                   verify: bool, block_bytes: int, lo: int, hi: int, shape: tuple[int, ...],
                   tgt: torch.Tensor, pinned: bool, stop: threading.Event | None,
                   dtype: torch.dtype) -> None:
    """Read the blocks of ``chunk`` covering its bytes ``lo..hi``, verify them, and copy
    the elements there (a box of ``shape`` starting at ``lo``, in the chunk's row-major
    layout, saved as ``dtype``; ``tgt`` may have another: the copy casts) into ``tgt``."""
    first_block = lo // block_bytes
    b0 = first_block * block_bytes
    b1 = min(-(-hi // block_bytes) * block_bytes, chunk.nbytes)
    with _allocating(path, key, b1 - b0):
        buf = torch.empty(b1 - b0, dtype=torch.uint8, pin_memory=pinned)
    _read_range(fd, storage, path, key, tensor_bytes(buf), chunk, first_block, verify,
                block_bytes, stop)
    typed = buf if dtype == torch.uint8 else buf.view(dtype)
    strides = row_major_strides(chunk.lengths)[len(chunk.lengths) - len(shape):]
    copy_into(tgt, typed.as_strided(shape, strides, (lo - b0) // dtype.itemsize), key)


def _sparse_runs(chunk: Chunk, box: Box, itemsize: int, block_bytes: int
                 ) -> tuple[int, tuple[int, ...], list[tuple[tuple[int, ...], int]]] | None:
    """Where the gaps between the box's contiguous parts hold whole blocks: the first dim
    ``d`` of the parts, their shape, and each part's index in the box's leading ``d``
    dims with its first byte in the chunk. None when reading the box's whole span costs
    (nearly) nothing more."""
    lens, clens = box[1], chunk.lengths
    # dims from ``d`` on: the box covers them whole but for ``d`` itself, so each part is
    # contiguous in the chunk; the parts are laid out by the leading dims
    d = len(lens) - 1
    while d > 0 and lens[d] == clens[d]:
        d -= 1
    if d <= 0:
        return None  # one contiguous run (or a 0-dim tensor's one element)
    strides = row_major_strides(clens)
    run = lens[d] * strides[d] * itemsize
    gap = strides[d - 1] * itemsize - run
    if gap < 2 * block_bytes:  # no gap holds a whole block to skip (with margin)
        return None
    rel = [o - c for o, c in zip(box[0], chunk.offsets, strict=True)]
    base = sum(r * s for r, s in zip(rel, strides, strict=True)) * itemsize
    starts = []
    for index in itertools.product(*(range(n) for n in lens[:d])):
        starts.append((index, base + sum(i * strides[k] for k, i in enumerate(index)) * itemsize))
    return d, tuple(lens[d:]), starts


def _read_range(fd: int, storage: ReadStorage, path: Path, key: str, mv: memoryview, chunk: Chunk,
                first_block: int, verify: bool, block_bytes: int,
                stop: threading.Event | None = None) -> None:
    """Read ``len(mv)`` bytes of ``chunk`` from block ``first_block`` on, hashing as it goes;
    ``_Stopped`` once ``stop`` is set (checked before every piece)."""
    n = len(mv)
    start = first_block * block_bytes
    hasher = BlockHasher(n, block_bytes) if verify else None
    pos = 0
    while pos < n:
        if stop is not None and stop.is_set():
            raise _Stopped
        k = min(_PIECE, n - pos)
        got = storage.pread_into(fd, [mv[pos:pos + k]], chunk.byte_range[0] + start + pos)
        if got <= 0:
            raise CheckpointCorruptError(f"{path}: unexpected end of file in tensor {key!r}",
                                         path=str(path), key=key)
        if hasher is not None:
            hasher.update(mv[pos:pos + got])
        pos += got
    if hasher is None:
        return
    _check_sums(path, key, chunk, first_block, hasher.finish(), block_bytes)


def _check_sums(path: Path, key: str, chunk: Chunk, first_block: int, sums: list[str],
                block_bytes: int) -> None:
    got_sums = tuple(sums)
    want = chunk.checksums[first_block:first_block + len(got_sums)]
    if got_sums != want:
        bad = first_block + next(
            (i for i, (a, b) in enumerate(zip(got_sums, want, strict=False)) if a != b),
            len(want))
        # (the block's bytes in the file, end exclusive as the other ranges said: a trial
        # read "bytes 1052700..", with no end; the last block ends with the chunk)
        lo = chunk.byte_range[0] + bad * block_bytes
        hi = max(lo, min(lo + block_bytes, chunk.byte_range[1]))
        raise CheckpointCorruptError(
            f"{path}: checksum mismatch in tensor {key!r} (block {bad}, bytes {lo}..{hi}): "
            "the checkpoint is corrupt; load another step", path=str(path), key=key)


@dataclass
class VerifyReport:
    """The verdict of :func:`verify_checkpoint`: problems found, and what was checked."""

    path: Path
    step: int | None
    """The manifest's step; None when the manifest itself cannot be read."""
    tensors: int = 0
    """The tensors checked and found intact."""
    bytes: int = 0
    problems: list[str] = field(default_factory=list)
    listed: int | None = None
    """The tensors the manifest lists; None when it cannot be read (none was checked)."""
    unchecked: int = 0
    """Of those, the tensors not read, as a file of theirs is missing or damaged: neither
    intact nor corrupt as far as this report can tell."""

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_checkpoint(step_dir: Path, storage: ReadStorage, *, threads: int | None = None,
                      progress: Callable[[int, int], None] | None = None) -> VerifyReport:
    """Check every file header against the manifest and every checksum; collect all problems.

    The tensors' bytes are read through a small buffer per thread (never allocated by the
    manifest's sizes), each file front to back, ``threads`` (default: as a load) files or
    parts of one at a time. ``progress(done, total)`` is called with the bytes checked so
    far, from the reading threads, after every piece read."""
    try:
        manifest = read_manifest(step_dir, storage)
    except CheckpointCorruptError as exc:
        return VerifyReport(step_dir, None, problems=[str(exc)])
    report = VerifyReport(step_dir, manifest.step, listed=len(manifest.tensors))
    damaged: set[str] = set()
    # (each tensor's chunks made once: a sharded one's are a ChunkTable, which makes them
    # at every walk; and walking them all once per file was files x chunks)
    entries = [(key, entry, tuple(entry.chunks)) for key, entry in manifest.tensors.items()]
    by_file = _by_file(entries)  # (the chunks made once: a table makes them anew)
    for name in manifest.files:  # each file once: size and header checksum, then entries
        try:
            _close(storage, _open(step_dir / name, storage))
        except CheckpointCorruptError as exc:  # missing or unreadable: say so once
            report.problems.append(str(exc))
            damaged.add(name)
            continue
        try:
            _check_file(step_dir, manifest, name, storage)
        except CheckpointCorruptError as exc:
            report.problems.append(str(exc))
            damaged.add(name)
        report.problems.extend(_check_header(step_dir / name, by_file.get(name, []),
                                             storage))
    unread: dict[str, int] = {}
    work: list[_VerifyItem] = []
    for i, (key, _, chunks) in enumerate(entries):
        bad = next((c.file for c in chunks if c.file in damaged), None)
        if bad is not None:
            # The manifest's sizes are not those of the file there: never read by them.
            unread[bad] = unread.get(bad, 0) + 1
            continue
        work += [_VerifyItem(i, n, key, ch) for n, ch in enumerate(chunks)]
    work.sort(key=lambda w: (w.chunk.file, w.chunk.byte_range[0]))  # each file front to back
    found = _verify_chunks(step_dir, manifest.block_bytes, work, storage, threads, progress)
    for i, (_, entry, chunks) in enumerate(entries):  # in the manifest's order, as before
        if i in found:
            report.problems.append(found[i])
        elif any(c.file in damaged for c in chunks):
            continue
        else:
            report.tensors += 1
            report.bytes += entry.nbytes
    report.unchecked = sum(unread.values())
    for name, n in unread.items():
        report.problems.append(f"{step_dir / name}: its {n} tensor"
                               f"{'s were' if n != 1 else ' was'} not read, as the file is "
                               "damaged (see above)")
    return report


@dataclass
class _VerifyItem:
    """One chunk for verify to read: of the manifest's ``i``-th tensor, its ``n``-th."""

    i: int
    n: int
    key: str
    chunk: Chunk


# What verify reads at once, per thread, into a buffer it keeps (the manifest's sizes never
# decide what it allocates): the size of a load's pieces.
_VERIFY_PIECE = _PIECE


def _verify_chunks(step_dir: Path, block_bytes: int, work: list[_VerifyItem],
                   storage: ReadStorage, threads: int | None,
                   progress: Callable[[int, int], None] | None) -> dict[int, str]:
    """Read and check ``work`` (sorted by file and offset) on up to ``threads`` threads:
    the problem of each tensor that has one (its first chunk's that fails), by index.
    Errors other than damage (no permission, an error of the moment) are raised."""
    total = sum(w.chunk.nbytes for w in work)
    n = _reader_threads(threads, len(work))
    advance = None if progress is None else _advancing(progress, total)
    found = itertools.chain.from_iterable(_in_groups(
        lambda g, stop: _verify_group(step_dir, block_bytes, g, storage, advance, stop),
        _split(work, n, total), threading.Event()))
    out: dict[int, str] = {}
    for i, _, msg in sorted(found, key=lambda x: (x[0], x[1])):
        out.setdefault(i, msg)
    return out


def _verify_group(step_dir: Path, block_bytes: int, group: list[_VerifyItem],
                  storage: ReadStorage, advance: Callable[[int], None] | None,
                  stop: threading.Event | None) -> list[tuple[int, int, str]]:
    found: list[tuple[int, int, str]] = []
    fds: dict[str, int] = {}
    buf = memoryview(bytearray(_VERIFY_PIECE if group else 0))
    try:
        for w in group:
            if stop is not None and stop.is_set():
                break  # another group raised: its error is the one to report
            path = step_dir / w.chunk.file
            try:
                fd = fds.get(w.chunk.file)
                if fd is None:
                    fd = fds[w.chunk.file] = _open(path, storage)
                _verify_chunk(fd, path, w, buf, block_bytes, storage, advance)
            except CheckpointCorruptError as exc:
                found.append((w.i, w.n, str(exc)))
    except BaseException:
        if stop is not None:
            stop.set()
        raise
    finally:
        for fd in fds.values():
            _close(storage, fd)
    return found


def _verify_chunk(fd: int, path: Path, w: _VerifyItem, buf: memoryview, block_bytes: int,
                  storage: ReadStorage, advance: Callable[[int], None] | None) -> None:
    lo, hi = w.chunk.byte_range
    hasher = BlockHasher(hi - lo, block_bytes)
    pos = lo
    while pos < hi:
        k = min(len(buf), hi - pos)
        try:
            got = storage.pread_into(fd, [buf[:k]], pos)
        except OSError as exc:  # EIO from a failing disk...
            raise _damaged(path, exc, w.key) from exc
        if got <= 0:
            raise CheckpointCorruptError(f"{path}: unexpected end of file in tensor {w.key!r}",
                                         path=str(path), key=w.key)
        hasher.update(buf[:got])
        pos += got
        if advance is not None:
            advance(got)
    _check_sums(path, w.key, w.chunk, 0, hasher.finish(), block_bytes)


def _check_header(path: Path, chunks: list[tuple[str, TensorEntry, Chunk]],
                  storage: ReadStorage) -> list[str]:
    """The entries of the file's safetensors header against ``chunks``, the manifest's
    chunks in the file (with their tensor's key and entry)."""
    try:
        fd = _open(path, storage)
    except CheckpointCorruptError as exc:  # missing, or cannot be opened
        return [str(exc)]
    try:
        prefix = bytearray(min(storage.file_size(fd), 1 << 20))
        del prefix[read_full(storage, fd, memoryview(prefix), 0):]
        try:
            header, body = decode_header(bytes(prefix), str(path))
        except CheckpointCorruptError:
            if len(prefix) < 8:  # (its length alone takes 8 bytes)
                return [f"{path}: the file is {len(prefix)} bytes long, too short for a "
                        "safetensors header (emptied or cut short)"]
            n = int.from_bytes(prefix[:8], "little")
            if 8 + n > storage.file_size(fd):
                return [f"{path}: its header claims {n} bytes, more than the whole file"]
            if 8 + n > len(prefix) and n < (100 << 20):
                big = bytearray(8 + n)
                del big[read_full(storage, fd, memoryview(big), 0):]
                header, body = decode_header(bytes(big), str(path))
            else:
                raise
    except CheckpointCorruptError as exc:
        return [str(exc)]
    except CheckpointError:
        raise
    except OSError as exc:  # damage is a problem to list; a transient error is raised
        err = _damaged(path, exc)
        if not isinstance(err, CheckpointCorruptError):
            raise err from exc
        return [str(err)]
    finally:
        _close(storage, fd)
    # (the header's checksum is _check_file's; here: entries vs the manifest)
    return _header_problems(path, header, body, chunks)


class _Problems(list[str]):
    """Problems in words, and the tensor path of the first that has one (an error's key)."""

    first_key: str | None = None


def _header_problems(path: Path, header: dict[str, Any], body: int,
                     chunks: list[tuple[str, TensorEntry, Chunk]],
                     every: bool = True) -> _Problems:
    """Where the entries of a file's safetensors header differ from the manifest's chunks
    in the file: each chunk's entry as the manifest implies it, and (``every``: the
    chunks are all the file's) no other entry."""
    problems = _Problems()
    for key, entry, ch in chunks:
        h = header.get(ch.key)
        st, shape = st_dtype_and_shape(entry.dtype, ch.lengths, ch.nbytes)
        lo, hi = ch.byte_range
        # (field by field, no dict built: one per chunk cost ~2 µs, 0.2 s at 100,000)
        if (type(h) is dict and len(h) == 3 and h.get("dtype") == st
                and h.get("shape") == shape and h.get("data_offsets") == [lo - body, hi - body]):
            continue
        want = {"dtype": st, "shape": shape, "data_offsets": [lo - body, hi - body]}
        if h != want:
            if not problems:  # (the error's key: the tensor named first, not the file's first)
                problems.first_key = key
            problems.append(f"{path}: header entry of tensor {key!r} is "
                            f"{json.dumps(h)[:200]}, manifest implies {json.dumps(want)}")
    listed = {ch.key for _, _, ch in chunks} if every else set()
    extra = [k for k in header if k != "__metadata__" and k not in listed] if every else []
    if extra:
        problems.append(f"{path}: its header lists {len(extra)} tensor(s) the manifest "
                        f"does not: {', '.join(repr(k[:100]) for k in extra[:3])}")
    return problems
