"""The transport interface torchft's Manager drives, and what a transport serves.

A healthy worker serves one checkpoint at a time: its manifest and the bytes of its
shard file(s), laid out exactly as on disk. The bytes come from wherever they already
are — the staged arena of the latest save, the live tensors (torchft's contract: they
stay unchanged until ``disallow_checkpoint`` returns), or committed files — so serving
adds no copy.
"""

from __future__ import annotations

import abc
import bisect
import concurrent.futures as cf
import errno
import itertools
import logging
import os
import select
import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Generic, TypeVar, cast

import torch
import xxhash

from .._gc import gc_paused
from ..commit import StepLike, as_step
from ..errors import (
    CheckpointConfigError,
    CheckpointNotFoundError,
    CheckpointTransportError,
    add_note,
    few,
    seconds_text,
)
from ..manifest import MANIFEST_NAME, Manifest, block_checksums
from ..plan import WritePlan, layout_signature, plan_writes
from ..reader import _check_file as check_file
from ..reader import read_manifest, tensor_bytes
from ..storage import LocalStorage, open_regular
from ..tree import FlatState, changed_in_place, flatten, version_counters

T = TypeVar("T")
log = logging.getLogger(__name__)

_PIECE = 8 * 1024 * 1024
_GATHER = 1024 * 1024  # small pieces (a state's many small tensors) go out in one sendmsg
_IOV_MAX = 512
_HASH_THREADS = 4  # at most, for the checksums of live tensors
_HASH_SPAN = 256 * 1024 * 1024  # bytes a hash thread takes at least
# serve_state copies tensors of at most SNAPSHOT_MAX_BYTES bytes when they are offered, up to
# _SNAPSHOT_BUDGET bytes in all: buffers a forward pass updates (BatchNorm's running
# statistics, without a version bump) are served as they were at the offer
SNAPSHOT_MAX_BYTES = 64 * 1024
_SNAPSHOT_BUDGET = 64 * 1024 * 1024

__all__ = ["CheckpointTransport", "FileSource", "Served", "serve_arena", "serve_directory",
           "serve_state"]



PEER_MAX_MANIFEST_BYTES = 256 << 20
"""The largest manifest a receive accepts from a peer by default (``max_manifest_bytes``):
JSON grows up to ~25x once parsed, and a peer chooses what it sends (~60 MB holds 100k
tensors)."""

def check_state_dict_fn(fn: object) -> Callable[[], Any] | None:
    """A transport's ``state_dict`` argument: None, or a callable that returns the state a
    receive without ``into=`` fills in place where it matches (torchft's convention)."""
    if fn is not None and not callable(fn):
        raise CheckpointConfigError(
            f"state_dict={fn!r:.60}: pass a callable that returns the state to receive into "
            "(e.g. lambda: {\"model\": model.state_dict()}), or None")
    if fn is None:
        return None
    given = cast(Callable[[], Any], fn)

    def call() -> Any:
        try:
            return given()
        except Exception as exc:  # (its own error, told whose call it came from: a trial
            # got a bare ZeroDivisionError out of recv_checkpoint)
            add_note(exc, f"raised by the state_dict= callable given to the transport "
                          f"({getattr(given, '__qualname__', type(given).__name__)}), which "
                          "a receive without into= calls for the state to fill")
            raise

    return call


def seconds(t: timedelta | float, label: str = "timeout") -> float:
    """A timeout in seconds, from seconds or a timedelta; CheckpointConfigError for
    anything else (a str, a bool). Bounds (and nan) are the caller's to check."""
    if isinstance(t, timedelta):
        return t.total_seconds()
    try:
        if isinstance(t, (bool, str, bytes)):
            raise TypeError
        return float(t)
    except (TypeError, ValueError):
        raise CheckpointConfigError(
            f"{label}={t!r}: pass seconds (a number) or a timedelta") from None

class CheckpointTransport(abc.ABC, Generic[T]):
    """Moves a live checkpoint from a healthy worker to a recovering one.

    The interface of torchft's ``CheckpointTransport``: its Manager calls
    ``send_checkpoint`` on a healthy worker and ``recv_checkpoint`` on the recovering
    one, exchanging ``metadata()`` through its own store.
    """

    @abc.abstractmethod
    def metadata(self) -> str:
        """What a peer needs to fetch from this transport (e.g. its address)."""

    @abc.abstractmethod
    def send_checkpoint(self, dst_ranks: list[int], step: StepLike, state_dict: T,
                        timeout: timedelta) -> None:
        """Offer ``state_dict`` at ``step`` to ``dst_ranks``; may return before they fetch it."""

    @abc.abstractmethod
    def recv_checkpoint(self, src_rank: int, metadata: str, step: StepLike,
                        timeout: timedelta) -> T:
        """Fetch the checkpoint of ``step`` from the peer described by ``metadata``."""

    def disallow_checkpoint(self) -> None:
        """Stop serving; once this returns the served tensors may change."""

    def shutdown(self, wait: bool = True) -> None:
        """Release sockets and threads."""

    def __enter__(self: _Transport) -> _Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        """``with HTTPTransport(...) as tr:`` shuts it down at the end of the block."""
        self.shutdown()


_Transport = TypeVar("_Transport", bound=CheckpointTransport[Any])


class StepNotOffered(CheckpointNotFoundError):
    """A peer's answer that the step asked for is not the one it serves: ``offered`` is
    the step it serves now. A fetch of "the step on offer" (``asyncckpt.load`` with no
    step) that meets it, the peer having moved on to its next save, fetches that one."""

    def __init__(self, message: str, offered: int) -> None:
        super().__init__(message)
        self.offered = offered


class FileSource(abc.ABC):
    """Random access to the bytes of one served file."""

    size: int

    @abc.abstractmethod
    def read(self, offset: int, n: int) -> memoryview:
        """``n`` bytes from ``offset`` (the caller keeps the range inside the file)."""

    def pieces(self, offset: int, n: int) -> Iterator[memoryview]:
        """The same bytes as views to send one after another (no gathering copy)."""
        for pos in range(offset, offset + n, _PIECE):
            yield self.read(pos, min(_PIECE, offset + n - pos))

    def send(self, sock: socket.socket, offset: int, n: int) -> None:
        """Send ``n`` bytes from ``offset`` on ``sock``, straight from where they are.

        In pieces of at most 8 MiB: the socket's timeout bounds each ``sendall`` as a
        whole, so a slow but live client is not cut off in the middle of a large range.
        """
        send_pieces(sock, self.pieces(offset, n))

    def close(self) -> None:  # noqa: B027 - an optional hook; most sources hold nothing
        """Release what the source holds."""


def send_pieces(sock: socket.socket, pieces: Iterator[memoryview]) -> None:
    """``sendall`` of each piece in turn; runs of small pieces are gathered into one
    ``sendmsg`` (one system call, still no copy in user space)."""
    batch: list[memoryview] = []
    size = 0
    for p in pieces:
        if not len(p):
            continue
        if len(p) >= _GATHER and not batch:
            sock.sendall(p)
            continue
        batch.append(p)
        size += len(p)
        if size >= _GATHER or len(batch) >= _IOV_MAX:
            _sendmsg_all(sock, batch)
            batch, size = [], 0
    if batch:
        _sendmsg_all(sock, batch)


def _sendmsg_all(sock: socket.socket, bufs: list[memoryview]) -> None:
    while len(bufs) > 1:
        sent = sock.sendmsg(bufs)
        k = 0
        while k < len(bufs) and sent >= len(bufs[k]):
            sent -= len(bufs[k])
            k += 1
        bufs = bufs[k:]
        if sent:
            bufs[0] = bufs[0][sent:]
    if bufs:
        sock.sendall(bufs[0])


class BufferSource(FileSource):
    """A file already laid out in memory: the staged arena."""

    def __init__(self, buf: memoryview):
        self._buf = buf
        self.size = len(buf)

    def read(self, offset: int, n: int) -> memoryview:
        return self._buf[offset:offset + n]


class DiskSource(FileSource):
    """A committed shard file, read with pread and sent with sendfile (from the page
    cache to the socket, never through user space)."""

    def __init__(self, path: Path):
        # a FIFO would block the open: open_regular refuses anything but a plain file
        self._file = open(path, "rb", buffering=0,  # noqa: SIM115 - closed by close()
                          opener=lambda p, _: open_regular(p))
        self.size = os.fstat(self._file.fileno()).st_size

    def read(self, offset: int, n: int) -> memoryview:
        data = os.pread(self._file.fileno(), n, offset)
        if len(data) < n:  # (a short response would leave the client waiting for the rest)
            raise EOFError(f"{self._file.name} ended {n - len(data)} bytes early")
        return memoryview(data)

    def send(self, sock: socket.socket, offset: int, n: int) -> None:
        """``os.sendfile`` with explicit offsets: the file is shared by every handler
        thread, so nothing here may use its position (``socket.sendfile`` falls back to
        seek and read, racing with other threads, where the filesystem has no sendfile).
        Without sendfile the bytes are sent with pread instead; the socket's timeout bounds
        each wait for it to take more. A file shorter than its size fails the send."""
        fd, out = self._file.fileno(), sock.fileno()
        timeout = sock.gettimeout()
        sent = 0
        while sent < n:
            try:
                k = os.sendfile(out, fd, offset + sent, min(n - sent, _SENDFILE_MAX))
            except BlockingIOError:  # a socket with a timeout is non-blocking underneath
                _wait_writable(sock, timeout)
                continue
            except OSError as exc:
                if sent == 0 and exc.errno in _NO_SENDFILE:
                    send_pieces(sock, self.pieces(offset, n))
                    return
                raise
            if k == 0:
                raise EOFError(f"{self._file.name} ended {n - sent} bytes early")
            sent += k

    def fileno(self) -> int:
        return self._file.fileno()

    def close(self) -> None:
        self._file.close()


_SENDFILE_MAX = 1 << 30  # bytes one os.sendfile call is asked for (Linux caps it near 2 GiB)
# os.sendfile's errors where it cannot work on this file or socket (not a failed transfer)
_NO_SENDFILE = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOTSOCK}


def _wait_writable(sock: socket.socket, timeout: float | None) -> None:
    """Wait until ``sock`` takes more bytes; TimeoutError after ``timeout`` seconds."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLOUT)
    if not poller.poll(None if timeout is None else max(0, int(timeout * 1000))):
        raise TimeoutError(f"the peer took no bytes for {seconds_text(timeout)}")


class LiveSource(FileSource):
    """A shard file made of a header and live tensors, never materialized."""

    def __init__(self, plan: WritePlan, tensors: dict[str, torch.Tensor],
                 copied: dict[str, memoryview] | None = None, ready: Sequence[Any] = ()):
        """``copied``: the bytes of tensors copied already, which are served instead;
        ``ready``: CUDA events to wait for before a tensor on a device is read (those
        made on another thread's stream)."""
        self.plan = plan
        self.size = plan.file_bytes
        self._header = memoryview(plan.header)
        self._starts = [it.offset for it in plan.items]
        self._bytes: dict[str, memoryview] = dict(copied or {})
        self._tensors = tensors
        self._ready = list(ready)
        self._lock = threading.Lock()
        # key -> the storage of a tensor served from its own memory, and where that was:
        # held, it stays allocated when the tensor is given another (``p.data = x``,
        # ``set_``), and a storage resized meanwhile is told (a review: gloo was handed
        # freed memory, and the sending process died of the EFAULT)
        self._held: dict[str, tuple[Any, int]] = {}

    def tensor_view(self, key: str) -> memoryview:
        with self._lock:
            mv = self._view(key)
            held = self._held.get(key)
        if held is not None and held[0].data_ptr() != held[1]:
            raise CheckpointTransportError(
                f"tensor {key!r} was resized in place while it was being sent: its memory "
                "moved, and what was offered is gone; offer the state again once nothing "
                "changes it (not until send_checkpoint returns)")
        return mv

    def views(self, stop: threading.Event | None = None) -> list[memoryview]:
        """Every planned tensor's bytes, in the plan's order (one lock for all of them);
        ``_Stopped`` once ``stop`` is set (checked before each tensor: one on an
        accelerator is copied here)."""
        with self._lock:
            out = []
            for it in self.plan.items:
                if stop is not None and stop.is_set():
                    raise _Stopped
                out.append(self._view(it.key))
            return out

    def _view(self, key: str) -> memoryview:
        mv = self._bytes.get(key)
        if mv is None:
            t = self._tensors[key]
            if t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg():
                while self._ready:  # (the offer's copies, made on its thread's stream)
                    self._ready.pop().synchronize()
                t = t.detach().resolve_conj().resolve_neg().contiguous().cpu()
                self._tensors[key] = t  # keep the copy alive while it is served
            elif t.numel():
                storage = t.untyped_storage()
                self._held[key] = (storage, storage.data_ptr())
            mv = self._bytes[key] = tensor_bytes(t)
        return mv

    def keys_in(self, offset: int, n: int) -> list[str]:
        """The keys of the tensors whose bytes meet ``n`` bytes at ``offset``."""
        i = max(0, bisect.bisect_right(self._starts, offset) - 1)
        j = bisect.bisect_left(self._starts, offset + n)
        return [it.key for it in self.plan.items[i:j] if it.end > offset]

    def pieces(self, offset: int, n: int) -> Iterator[memoryview]:
        """The header's and tensors' own memory, sliced: nothing is copied."""
        pos, end = offset, offset + n
        if pos < len(self._header):
            k = min(end, len(self._header)) - pos
            yield self._header[pos:pos + k]
            pos += k
        i = max(0, bisect.bisect_right(self._starts, pos) - 1)
        while pos < end and i < len(self.plan.items):
            it = self.plan.items[i]
            if it.end > pos:
                lo = pos - it.offset
                k = min(end, it.end) - pos
                view = self.tensor_view(it.key)
                for j in range(lo, lo + k, _PIECE):
                    yield view[j:min(lo + k, j + _PIECE)]
                pos += k
            i += 1

    def read(self, offset: int, n: int) -> memoryview:
        return memoryview(b"".join(self.pieces(offset, n)))


def uncopied_hint() -> str:
    """What changes a live tensor that an offer did not copy, and the way out: for
    messages of changed tensors. (Not naming one of them: the first may be a weight that
    an optimizer.step() changed, whose copy is no way out.)"""
    return (f"a forward pass that updates a buffer send_checkpoint does not copy (one of "
            f"more than {SNAPSHOT_MAX_BYTES // 1024} KiB, or a small one past its first "
            f"{_SNAPSHOT_BUDGET >> 20} MiB of copies)? offer a copy of it in its place: "
            "sd['queue'] = sd['queue'].clone(), where sd is the state given to "
            "send_checkpoint")


def changed_while_served(step: int, keys: Sequence[str]) -> str:
    """The sender's warning of live tensors that changed in place while a transfer read
    them (after the offer's checksums)."""
    return (f"step {step}: tensor(s) {few([repr(k) for k in keys], 3)} changed in place "
            "while they were served: a receiver that read them after the change fails its "
            "checksums, at every try, until the state is offered again; leave them as they "
            "are until disallow_checkpoint() returns (over a process group: until "
            f"send_checkpoint returns) ({uncopied_hint()})")


class StateChanged(CheckpointTransportError):
    """Live tensors offered with ``send_checkpoint`` changed in place before a receiver
    asked for them: the offer is refused (its receivers are told why)."""

    def __init__(self, step: int, keys: Sequence[str]):
        super().__init__(
            f"step {step}: the sender changed tensor(s) {few([repr(k) for k in keys], 3)} "
            "in place after send_checkpoint offered them (an optimizer.step() before "
            f"disallow_checkpoint()? or {uncopied_hint()}): the offer is refused, as "
            "what it would serve is no longer that step's state; the sender must leave its "
            "tensors unchanged until disallow_checkpoint() returns (over a process group: "
            "until send_checkpoint returns), and offer again")
        self.step, self.keys = step, list(keys)


class _Stopped(Exception):
    """Work on a served state stopped: its offer was cut off."""


@dataclass
class Served:
    """One checkpoint being served: its step, manifest and files.

    ``cancelled`` is set by a transport that cuts its transfers off (after
    ``disallow_checkpoint``'s grace time): work still reading the served memory, such as
    checksumming live tensors, stops at its next tensor.
    """

    step: int
    manifest: Callable[[], bytes]
    files: dict[str, FileSource]
    cancelled: threading.Event = field(default_factory=threading.Event)
    origin: str = ""  # who offers it, in words: a transport holds one offer at a time
    # live tensors: the keys of those (of the keys given, or all) that torch has seen
    # change in place since the offer
    changed: Callable[[Iterable[str] | None], list[str]] | None = None
    told_changed: bool = False  # (the sender's warning of them is given once an offer)
    # how long a disallow waits for this offer's transfers at most (send_checkpoint's
    # timeout; None: the transport's own)
    drain_s: float | None = None
    _telling: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def tell_changed(self, keys: Iterable[str] | None = None) -> None:
        """Warn, once an offer, of live tensors changed in place since it was made: call
        after a transfer read them (``keys``: those it read; from any thread: a
        receiver's ranges end together)."""
        if self.changed is None:
            return
        with self._telling:
            if self.told_changed:
                return
            moved = self.changed(keys)
            if moved:
                self.told_changed = True
                log.warning("%s", changed_while_served(self.step, moved))

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def serve_arena(step: int, manifest: Manifest | bytes, file: str, buf: memoryview,
                more: Mapping[str, FileSource] | None = None) -> Served:
    """Serve a staged arena: the file body already sits in memory, checksummed.
    ``manifest``: what describes it, or that manifest's bytes; ``more``: other files it
    names (a rank's copies of the tensors it holds but does not write)."""
    raw = manifest if isinstance(manifest, bytes) else manifest.to_json()
    return Served(step, lambda: raw, {file: BufferSource(buf), **(more or {})},
                  origin="a checkpointer's saves (ckpt.serve)")


def serve_directory(step_dir: Path) -> Served:
    """Serve a committed checkpoint from disk (a step directory, or a root: its latest
    step): its files are there, of their sizes, with their headers
    (CheckpointCorruptError, as a load or verify would say, if not)."""
    from ..commit import resolve_step_dir

    # (a root, or a path that is not there, got "has no manifest.json: not a committed
    # checkpoint", where the CLI takes a root: a trial)
    step_dir, _ = resolve_step_dir(step_dir, None, LocalStorage())
    # Each file is opened once, and what is served is what was checked: the manifest's
    # bytes as parsed, each shard file through the descriptor whose size and header were
    # (a review swapped a symlink in between a check and a second open by path, and the
    # server served a file from outside the checkpoint, 2 times in 300).
    pinned = _Pinned(step_dir / MANIFEST_NAME)
    manifest = read_manifest(step_dir, pinned)
    raw = pinned.raw
    sources: dict[str, DiskSource] = {}
    try:
        for name in manifest.files:
            try:
                src = sources[name] = DiskSource(step_dir / name)
            except OSError:  # (missing, not a file...: the error a load would give)
                check_file(step_dir, manifest, name, LocalStorage())
                raise
            pinned.fds[step_dir / name] = src.fileno()
            check_file(step_dir, manifest, name, pinned)
    except BaseException:
        for src in sources.values():
            src.close()
        raise
    return Served(manifest.step, lambda: raw, dict(sources))


class _Pinned(LocalStorage):
    """The local files of one step as first read or opened: the manifest's bytes kept
    (``raw``), and reads of a shard file through the descriptor opened for serving
    (``fds``: a duplicate of it, which the check closes)."""

    def __init__(self, manifest: Path) -> None:
        super().__init__()
        self.manifest = manifest
        self.raw = b""
        self.fds: dict[Path, int] = {}

    def read_bytes(self, path: Path, limit: int) -> bytes:
        data = super().read_bytes(path, limit)
        if path == self.manifest:
            self.raw = data
        return data

    def open_read(self, path: Path) -> int:
        fd = self.fds.get(path)
        return super().open_read(path) if fd is None else os.dup(fd)


_plans_lock = threading.Lock()
_last_plan: list[WritePlan] = []  # the plan of the last live state served (plans are immutable)


def _live_plan(tensors: Mapping[str, torch.Tensor]) -> WritePlan:
    """The file layout of a live state: the last one again when the state's layout (keys,
    dtypes, shapes) is unchanged, as from one step to the next. Laying out and encoding
    the header of 4,000 tensors took ~15 ms of a ~30 ms send_checkpoint; comparing the
    layout takes ~1 ms."""
    signature = layout_signature(tensors)
    with _plans_lock:
        if _last_plan and _last_plan[0].signature == signature:
            return _last_plan[0]
    plan = plan_writes(tensors, "rank_00000.safetensors", {"asyncckpt_format": "1"})
    with _plans_lock:
        _last_plan[:] = [plan]
    return plan


def partial_manifest(rank: int, plan: WritePlan, flat: FlatState,
                     sums: Sequence[Sequence[str]], *, step: int, block_bytes: int,
                     library_version: str) -> Manifest:
    """The manifest of one file that ``plan`` lays out, as rank ``rank`` would report it
    (``sums``: each item's block checksums), marked partial: what a peer is served of a
    live state (``serve_state``), or of a rank's copies of others' tensors."""
    from ..dist import merge_records
    from ..reports import frame_of, full_record

    record = full_record(frame_of(rank, plan, flat), sums, flat.skeleton, {})
    return merge_records([record], step=step, library_version=library_version,
                         block_bytes=block_bytes, user_metadata={}, created_unix=0.0,
                         partial=True)


_live_book: dict[int, Any] = {}  # block_bytes: (RecordSender, RecordBook), of the last
_books_lock = threading.Lock()


def live_manifest(plan: WritePlan, flat: FlatState, sums: list[list[str]], *, step: int,
                  block_bytes: int, library_version: str) -> bytes:
    """``partial_manifest(0, ...)``'s bytes, through a record book kept for the process:
    a live state served again with the same layout and block size (the next step's)
    fills the last manifest's text with its checksums and skeleton instead of building
    it anew (~35 of ~45 ms at 4,000 tensors)."""
    from ..reports import RecordBook, RecordSender

    with _books_lock:
        if block_bytes not in _live_book:  # (a book's frames count blocks of one size)
            _live_book.clear()
            _live_book[block_bytes] = (RecordSender(), RecordBook())
        sender, book = _live_book[block_bytes]
        record = sender.record(rank=0, coordinator="live", plan=plan, flat=flat, sums=sums,
                               replicas={}, local=True)
        try:
            raw: bytes
            raw, _ = book.manifest([record], step=step, library_version=library_version,
                                   block_bytes=block_bytes, user_metadata={}, created_unix=0.0,
                                   partial=True)
        except BaseException:
            sender.settled(False)
            raise
        sender.settled(True)
        return raw


@dataclass
class Snapshot:
    """What ``snapshot_small`` copied: ``copied``, the bytes of CPU tensors (one buffer);
    ``copies``, tensors copied on their own devices, ready once the CUDA events of
    ``ready`` have happened (recorded on the offering thread's streams, which a reader
    thread's do not follow: torchft offers on a side stream); ``changed``, the keys of
    those torch saw change while they were copied."""

    copied: dict[str, memoryview]
    copies: dict[str, torch.Tensor]
    ready: list[Any]
    changed: list[str]


def snapshot_small(tensors: Mapping[str, torch.Tensor]) -> Snapshot:
    """Copies of the tensors of at most ``SNAPSHOT_MAX_BYTES`` bytes, in order until one
    would pass ``_SNAPSHOT_BUDGET`` bytes in all (the rest are served from their own
    memory); a change torch sees while they are copied (a forward pass running
    alongside) is told: the copies may then mix values from before and during it.

    A forward pass changes some buffers in place while an offer is served (torchft
    offers the state as its next step's forward begins): BatchNorm's running statistics
    without a version bump (the receiver's checksums then failed), others with one (the
    offer was refused). Such buffers are small; a model's large tensors change only in
    ``optimizer.step()``, after ``disallow_checkpoint()``. (~1 us a tensor, most of it
    the byte view the served state makes of each tensor anyway; a clone took ~1.4 more.)"""
    keys: list[str] = []
    views: list[memoryview] = []
    copies: dict[str, torch.Tensor] = {}
    small: list[tuple[str, torch.Tensor]] = []
    left = _SNAPSHOT_BUDGET
    for key, t in tensors.items():
        n = t.nbytes
        if n > SNAPSHOT_MAX_BYTES:
            continue
        if n > left:
            break
        small.append((key, t))
        left -= n
    # (read before any is copied: a change from here to the end of the copies may leave
    # them a mix; an inference tensor has no version counter)
    by_key = dict(small)
    versions = version_counters(by_key)
    for key, t in small:
        if t.is_cpu and t.is_contiguous() and not (t.is_conj() or t.is_neg()):
            keys.append(key)
            views.append(tensor_bytes(t))
        elif not t.is_meta:
            with torch.no_grad():
                copies[key] = t.detach().resolve_conj().resolve_neg().clone(
                    memory_format=torch.contiguous_format)
    ready = []
    for device in {c.device for c in copies.values() if c.is_cuda}:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(device))
        ready.append(event)
    # (writable: the process-group transport hands the bytes to torch.frombuffer)
    joined = memoryview(bytearray().join(views))
    changed = changed_in_place(by_key, versions)
    copied = {}
    at = 0
    for key, v in zip(keys, views, strict=True):
        copied[key] = joined[at:at + len(v)]
        at += len(v)
    return Snapshot(copied, copies, ready, changed)


def serve_state(step: int, state: Any, *, block_bytes: int, library_version: str) -> Served:
    """Serve live tensors: small ones are copied when offered (``snapshot_small``), the
    rest served from their own memory; checksums are computed on the first manifest
    request (off the training thread)."""
    step = as_step(step)  # (it names the step in URLs and the manifest)
    with gc_paused():  # thousands of small objects: no full collection mid-way (~0.1 s)
        flat = flatten(state)
        plan = _live_plan(flat.tensors)
        snap = snapshot_small(flat.tensors)
        torn = snap.changed
        if torn:  # (the sender's log: its loop offers while its state changes)
            log.warning(
                "step %d: send_checkpoint copied the state's small tensors while something "
                "changed them (%s): a forward pass running alongside the offer (torchft's "
                "async quorum?); what is served may mix values from before and during it "
                "(and a mix is not always seen: no warning is no proof): for an exact "
                "state, offer before the forward pass begins (torchft: "
                "Manager(use_async_quorum=False))", step, few([repr(k) for k in torn], 3))
        # The rest are served live: the version counters of those tell a change in place
        # before the first request (as save_async(overlap=True) watches them: a DTensor's
        # own counter, not its local shard's; not 0-dim ones past the copies' budget: a
        # forward pass bumps BatchNorm's num_batches_tracked, and the step counters move
        # with the parameters, which tell)
        offered = {k: flat.wrappers.get(k, t) for k, t in flat.tensors.items()
                   if t.dim() and k not in snap.copied and k not in snap.copies}
        versions = version_counters(offered)
    source = LiveSource(plan, {**flat.tensors, **snap.copies}, snap.copied, snap.ready)
    lock = threading.Lock()
    cache: list[bytes] = []
    cancelled = threading.Event()
    refused: list[StateChanged] = []

    def checksums() -> list[list[str]]:
        """Every item's block checksums: a recovering peer waits for them before its
        transfer starts. Each thread hashes at least _HASH_SPAN bytes: the threads of a
        state of many small tensors would only take turns at the GIL between them (16,000
        tensors: 2 threads took longer than 1)."""
        def cut_off() -> CheckpointTransportError:  # disallowed: the tensors may change now
            return CheckpointTransportError(
                f"step {step}: serving was cut off while checksumming the live state")

        try:
            views = source.views(cancelled)
        except _Stopped:
            raise cut_off() from None
        bb, xxh = block_bytes, xxhash.xxh3_64_hexdigest
        total = sum(map(len, views))
        n = max(1, min(_HASH_THREADS, os.cpu_count() or 1, len(views), total // _HASH_SPAN))
        cuts = [0]
        acc = 0
        for i, v in enumerate(views):  # n runs of about equal bytes
            acc += len(v)
            if len(cuts) < n and acc * n >= total * len(cuts):
                cuts.append(i + 1)
        cuts.append(len(views))

        def run(lo: int, hi: int) -> list[list[str]]:
            out = []
            for v in views[lo:hi]:
                if cancelled.is_set():
                    raise cut_off()
                out.append([xxh(v)] if len(v) <= bb else block_checksums(v, bb))
            return out

        spans = [(a, b) for a, b in itertools.pairwise(cuts) if b > a]
        if len(spans) <= 1:
            return run(0, len(views))
        with cf.ThreadPoolExecutor(len(spans) - 1, thread_name_prefix="asyncckpt-hash") as ex:
            rest = [ex.submit(run, a, b) for a, b in spans[1:]]
            out = run(*spans[0])
            for f in rest:
                out += f.result()
        return out

    def manifest() -> bytes:
        with lock:
            if refused:
                raise refused[0]
            if not cache:
                with gc_paused():  # (a list per tensor, then the manifest's text)
                    sums = checksums()
                    # Hashed as they are now, not as they were offered: a change since the
                    # offer (an optimizer.step() before disallow_checkpoint) would be served
                    # as the step's state, its checksums agreeing. The version counters tell
                    # what torch saw change in place; a change after this shows as a
                    # checksum mismatch at the receiver.
                    changed = changed_in_place(offered, versions)
                    if changed:
                        refused.append(StateChanged(step, changed))
                        log.warning("%s", refused[0])  # (the sender's log: its loop is amiss)
                        raise refused[0]
                    cache.append(live_manifest(plan, flat, sums, step=step,
                                               block_bytes=block_bytes,
                                               library_version=library_version))
            return cache[0]

    # (checked after each range a receiver read: that range's tensors, ~0.3 us each)
    return Served(step, manifest, {plan.file: source}, cancelled, origin="send_checkpoint",
                  changed=lambda keys: changed_in_place(offered, versions, keys))
