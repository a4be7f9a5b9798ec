"""Process-group transport: a healthy worker sends its live state over torch.distributed.

The same interface as :class:`~asyncckpt.transport.http.HTTPTransport`, over point to
point ``send``/``recv`` of a process group (gloo, or NCCL with ``device`` on the GPU).
Both sides call in: the healthy rank's ``send_checkpoint`` and the recovering rank's
``recv_checkpoint`` meet, and both return once the transfer is over. Everything runs
on the calling thread, on the group passed in: give the transport a group of its own
(``dist.new_group(backend="gloo")``), never the training group, whose collectives would
interleave with these messages.

Wire protocol (every message is one tensor; ranks are ranks of the group):

1. receiver -> sender: a request, 8 int64 words
   ``[MAGIC, VERSION, REQUEST, wanted_step, 0, 0, 0, 0]``;
2. sender -> receiver: a reply, 8 int64 words
   ``[MAGIC, VERSION, OFFER, step, manifest_bytes, file_bytes, segments, 0]``, or
   ``[MAGIC, VERSION, NOT_FOUND, step_on_offer, 0, 0, 0, 0]`` when the steps differ
   (then nothing else follows and both sides stay in step);
3. the manifest (JSON, the format of ``manifest.json``) as ``manifest_bytes`` uint8;
4. the shard file (the safetensors layout of a committed checkpoint) in ``segments``
   uint8 messages: its header, then each non-empty tensor in file order, sent straight
   from the tensor's memory.

The receiver refuses sizes above its limits before it allocates anything, derives the
segment sizes from the validated manifest (they must tile the file exactly), receives
the file into one buffer and loads it through the ordinary loader: checksums are
verified, ``into=`` loads in place. Nothing is unpickled.

Timeouts: every wait is bounded by the call's ``timeout`` (``Work.wait(timeout)``); the
group's own timeout (``init_process_group``/``new_group(timeout=...)``) bounds the
backend underneath. After a timeout or a protocol error the pair of ranks may be out of
step (gloo closes the connection after a timed-out receive): recreate the group before
using it again, as torchft does on every reconfiguration.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from ..errors import (
    CheckpointClosedError,
    CheckpointConfigError,
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    CheckpointTransportError,
)
from ..manifest import (
    DEFAULT_BLOCK_BYTES,
    MANIFEST_NAME,
    MAX_HEADER_BYTES,
    MAX_MANIFEST_BYTES,
    Manifest,
    check_block_bytes,
    parse_manifest,
)
from ..reader import tensor_bytes
from .base import CheckpointTransport, LiveSource, serve_state

log = logging.getLogger(__name__)

__all__ = ["PGTransport"]

MAGIC = 0x61636B70745F7067  # "ackpt_pg"
VERSION = 1
REQUEST, OFFER, NOT_FOUND = 1, 2, 3
HEADER_WORDS = 8
DEFAULT_MAX_FILE_BYTES = 1 << 40
_TAG = 0x6163  # one tag for every message: gloo keeps per-pair, per-tag order


def _seconds(t: timedelta | float) -> float:
    return t.total_seconds() if isinstance(t, timedelta) else float(t)


class PGTransport(CheckpointTransport[Any]):
    """Send and receive checkpoints over a torch.distributed process group.

    Thread-safe in the sense that one transfer runs at a time (a second call waits for
    the first); transfers run on the caller's thread. Ranks (``dst_ranks``,
    ``src_rank``) are ranks *of the group* passed in.

    Args:
        pg: the process group to use: a ``ProcessGroup`` (e.g. from
            ``dist.new_group(backend="gloo")``) or anything with the same
            ``send``/``recv``/``rank``/``size`` methods (torchft's process groups).
            None means the default group; a dedicated group is strongly preferred.
        timeout: the default for calls given no timeout, and how long
            ``disallow_checkpoint`` waits for a send running on another thread.
        device: where messages live: CPU for gloo, the rank's GPU for NCCL. None picks
            the current CUDA device for an NCCL group and the CPU otherwise.
        block_bytes: checksum granularity of the manifests this side sends.
        max_manifest_bytes: the largest manifest a peer may announce.
        max_file_bytes: the largest shard file a peer may announce.
    """

    def __init__(self, pg: Any, timeout: timedelta | float = 60.0, *,
                 device: torch.device | str | None = None,
                 block_bytes: int = DEFAULT_BLOCK_BYTES,
                 max_manifest_bytes: int = MAX_MANIFEST_BYTES,
                 max_file_bytes: int = DEFAULT_MAX_FILE_BYTES):
        if pg is None:
            import torch.distributed as dist

            if not dist.is_available() or not dist.is_initialized():
                raise CheckpointConfigError(
                    "PGTransport(pg=None) needs torch.distributed to be initialized; or pass "
                    "a process group")
            pg = dist.group.WORLD
        for method in ("send", "recv", "rank"):
            if not callable(getattr(pg, method, None)):
                raise CheckpointConfigError(
                    f"pg={pg!r} has no {method}() method: pass a torch.distributed process group")
        if max_manifest_bytes < 1 or max_file_bytes < 0:
            raise CheckpointConfigError(
                f"max_manifest_bytes={max_manifest_bytes}, max_file_bytes={max_file_bytes}: "
                "use positive limits")
        self.pg = pg
        self.timeout_s = _seconds(timeout)
        self.device = _resolve_device(pg, device)
        check_block_bytes(block_bytes)
        self.block_bytes = block_bytes
        self.max_manifest_bytes = max_manifest_bytes
        self.max_file_bytes = max_file_bytes
        self._lock = threading.Lock()  # one transfer at a time on the group
        self._cond = threading.Condition()
        self._sending = 0
        self._cuts: set[threading.Event] = set()  # one per send in progress
        self._closed = False

    # --- the interface --------------------------------------------------------------------

    def metadata(self) -> str:
        """``pg:<rank in the group>`` (``pg:?`` while the group cannot say: torchft asks
        before it configures its group). Informational: peers are named by rank."""
        try:
            return f"pg:{int(self.pg.rank())}"
        except Exception:
            return "pg:?"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any,
                        timeout: timedelta | float | None = None) -> None:
        """Send ``state_dict`` at ``step`` to each rank of ``dst_ranks``, one after another.

        Returns once every destination has received it (or was told the step it asked
        for is not this one: that is logged, not raised). The tensors are sent from
        their own memory, so they must not change until this returns. Raises
        CheckpointTimeoutError when a destination does not take part in time, and
        CheckpointTransportError when the group fails.
        """
        from .. import __version__

        self._check_open()
        deadline = time.monotonic() + (self.timeout_s if timeout is None else _seconds(timeout))
        me = self.pg.rank()
        if me in dst_ranks:
            raise CheckpointConfigError(f"dst_ranks={dst_ranks} includes this rank ({me})")
        with self._cond:  # counted from the start: disallow_checkpoint waits for it
            self._sending += 1
        served = None
        try:
            served = serve_state(step, state_dict, block_bytes=self.block_bytes,
                                 library_version=__version__)
            (source,) = served.files.values()
            if not isinstance(source, LiveSource):
                raise AssertionError("serve_state serves a LiveSource")
            cut = served.cancelled  # set by disallow_checkpoint to cut this send off
            with self._cond:
                self._cuts.add(cut)
            manifest = served.manifest()  # checksums every tensor once, here
            segments = _send_segments(source)
            self._acquire(deadline, "send")
            try:
                for dst in dst_ranks:
                    self._send_to(dst, step, manifest, source, segments, deadline, cut)
            finally:
                self._lock.release()
        finally:
            with self._cond:
                if served is not None:
                    self._cuts.discard(served.cancelled)
                self._sending -= 1
                self._cond.notify_all()
            if served is not None:
                served.close()

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int,
                        timeout: timedelta | float | None = None, *, into: Any = None,
                        strict: bool = True) -> Any:
        """Receive ``step`` from rank ``src_rank`` of the group (``metadata`` is its
        ``metadata()``, used in messages only).

        Returns a plain tree of fresh CPU tensors, or with ``into=`` loads into that state
        in place (tensor identity kept, resharding as ``load`` does) and returns it.

        Raises:
            CheckpointNotFoundError: the peer sends another step.
            CheckpointCorruptError: the manifest or a checksum does not match.
            CheckpointTimeoutError: the peer did not answer in time.
            CheckpointTransportError: the peer broke the protocol or the group failed.
        """
        from ..loader import load_from

        self._check_open()
        deadline = time.monotonic() + (self.timeout_s if timeout is None else _seconds(timeout))
        where = f"peer rank {src_rank} ({metadata})"
        self._acquire(deadline, "receive")
        try:
            raw, name, host = self._recv_from(src_rank, step, deadline, where)
        finally:
            self._lock.release()
        # (``host`` owns the memory the storage's view points into: it lives until we return)
        storage = _MemoryStorage(raw, {name: tensor_bytes(host)} if name is not None else {})
        return load_from(Path(f"pg-rank-{src_rank}-step-{step}"), into, storage, strict=strict)

    def disallow_checkpoint(self) -> None:
        """Sends finish before ``send_checkpoint`` returns, so there is nothing to stop;
        a send running on another thread may finish within the timeout, then it is cut
        off before its next segment (its peer's receive fails) and waited for."""
        with self._cond:
            if self._cond.wait_for(lambda: self._sending == 0, self.timeout_s):
                return
            log.warning("disallow_checkpoint: cutting off a send still running after %.0fs",
                        self.timeout_s)
            for cut in self._cuts:
                cut.set()
            self._cond.wait_for(lambda: self._sending == 0)

    def shutdown(self, wait: bool = True) -> None:
        """Refuse later transfers. The group belongs to the caller and is left as it is."""
        self._closed = True

    # --- sending --------------------------------------------------------------------------

    def _send_to(self, dst: int, step: int, manifest: bytes, source: LiveSource,
                 segments: list[tuple[int, Callable[[], torch.Tensor]]],
                 deadline: float, cut: threading.Event) -> None:
        req = self._recv_words(dst, deadline, f"the request of rank {dst}")
        if req[:3] != [MAGIC, VERSION, REQUEST]:
            raise CheckpointTransportError(
                f"rank {dst} sent {req} instead of an asyncckpt request: is it running "
                "recv_checkpoint on the same group, with the same asyncckpt version?")
        if req[3] != step:
            self._send_words(dst, [MAGIC, VERSION, NOT_FOUND, step, 0, 0, 0, 0], deadline,
                             f"the refusal to rank {dst}")
            log.warning("rank %d asked for step %d; this rank sends step %d: refused", dst,
                        req[3], step)
            return
        file_bytes = source.size if source.plan.items else 0
        nseg = len(segments) if file_bytes else 0
        self._send_words(dst, [MAGIC, VERSION, OFFER, step, len(manifest), file_bytes, nseg, 0],
                         deadline, f"the offer to rank {dst}")
        raw = torch.frombuffer(bytearray(manifest), dtype=torch.uint8)
        self._send(raw, dst, deadline, f"the manifest of step {step} to rank {dst}")
        for i, (nbytes, get) in enumerate(segments[:nseg]):
            if cut.is_set():
                raise CheckpointTransportError(
                    f"step {step}: the send to rank {dst} was cut off by disallow_checkpoint "
                    f"after {i} of {nseg} segments; rank {dst}'s receive fails")
            t = get()
            if t.numel() != nbytes:
                raise AssertionError(f"segment {i}: {t.numel()} bytes, planned {nbytes}")
            self._send(t, dst, deadline, f"segment {i} of step {step} to rank {dst}")

    # --- receiving ------------------------------------------------------------------------

    def _recv_from(self, src: int, step: int, deadline: float, where: str
                   ) -> tuple[bytes, str | None, torch.Tensor]:
        self._send_words(src, [MAGIC, VERSION, REQUEST, step, 0, 0, 0, 0], deadline,
                         f"the request for step {step} to {where}")
        h = self._recv_words(src, deadline, f"the answer of {where}")
        if h[:2] != [MAGIC, VERSION]:
            raise CheckpointTransportError(
                f"{where} answered {h}, not an asyncckpt offer: is it running send_checkpoint "
                "on the same group, with the same asyncckpt version?")
        kind, have, mlen, flen, nseg = h[2:7]
        if kind == NOT_FOUND:
            raise CheckpointNotFoundError(f"{where} sends step {have}, not step {step}")
        if kind != OFFER or have != step:
            raise CheckpointTransportError(
                f"{where} broke the protocol: answered {h} to a request for step {step}; "
                "recreate the process group before using it again")
        if not 0 < mlen <= self.max_manifest_bytes:
            raise CheckpointTransportError(
                f"{where} announced a manifest of {mlen} bytes (limit "
                f"{self.max_manifest_bytes}); refused before allocating it. Recreate the "
                "process group before using it again")
        if not 0 <= flen <= self.max_file_bytes:
            raise CheckpointTransportError(
                f"{where} announced a shard file of {flen} bytes (limit {self.max_file_bytes}, "
                "max_file_bytes=); refused before allocating it. Recreate the process group "
                "before using it again")
        raw_t = torch.empty(mlen, dtype=torch.uint8, device=self.device)
        self._recv(raw_t, src, deadline, f"the manifest of step {step} from {where}")
        raw = bytes(raw_t.cpu().numpy())
        manifest = parse_manifest(raw, f"{where}: manifest of step {step}")
        if manifest.step != step:
            raise CheckpointCorruptError(
                f"{where}: the manifest is of step {manifest.step}, the offer of step {step}")
        name, segs = _recv_segments(manifest, flen, where)
        if len(segs) != nseg:
            raise CheckpointCorruptError(
                f"{where}: announced {nseg} segments, its manifest implies {len(segs)}")
        cuda = self.device.type == "cuda"
        buf = torch.empty(flen, dtype=torch.uint8, device=self.device)
        for i, (lo, hi) in enumerate(segs):
            self._recv(buf[lo:hi], src, deadline, f"segment {i} of step {step} from {where}")
        if cuda:  # the loader reads (and verifies) host memory
            host = torch.empty(flen, dtype=torch.uint8, pin_memory=True)
            host.copy_(buf)
            del buf
        else:
            host = buf
        return raw, name, host

    # --- messages -------------------------------------------------------------------------

    def _send_words(self, peer: int, words: list[int], deadline: float, what: str) -> None:
        self._send(torch.tensor(words, dtype=torch.int64, device=self.device), peer, deadline,
                   what)

    def _recv_words(self, peer: int, deadline: float, what: str) -> list[int]:
        t = torch.zeros(HEADER_WORDS, dtype=torch.int64, device=self.device)
        self._recv(t, peer, deadline, what)
        return [int(x) for x in t.cpu().tolist()]

    def _send(self, t: torch.Tensor, peer: int, deadline: float, what: str) -> None:
        if t.device != self.device:
            t = t.to(self.device)
        self._wait(lambda: self.pg.send([t], peer, _TAG), deadline, f"sending {what}")

    def _recv(self, t: torch.Tensor, peer: int, deadline: float, what: str) -> None:
        self._wait(lambda: self.pg.recv([t], peer, _TAG), deadline, f"receiving {what}")

    def _wait(self, start: Callable[[], Any], deadline: float, what: str) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise CheckpointTimeoutError(f"ran out of time before {what}")
        t0 = time.monotonic()
        try:
            work = start()
            ok = work.wait(timedelta(seconds=max(left, 0.001)))
        except Exception as exc:
            text = str(exc)
            if "timed out" in text.lower() or time.monotonic() - t0 >= left * 0.95:
                raise CheckpointTimeoutError(
                    f"{what}: no answer within {left:.1f}s (the peer is not taking part, or is "
                    "stuck); recreate the process group before using it again") from exc
            raise CheckpointTransportError(
                f"{what} failed: {text}; recreate the process group before using it again"
                ) from exc
        if ok is False:
            raise CheckpointTimeoutError(f"{what}: no answer within {left:.1f}s")

    def _acquire(self, deadline: float, what: str) -> None:
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise CheckpointTimeoutError(
                f"cannot {what}: another transfer on this transport is still running")

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointClosedError("this PGTransport was shut down")


def _resolve_device(pg: Any, device: torch.device | str | None) -> torch.device:
    if device is None:
        backend = ""
        try:
            import torch.distributed as dist

            backend = str(dist.get_backend(pg))
        except Exception:  # not a registered group (e.g. torchft's): ask it
            for attr in ("getBackendName", "name"):
                fn = getattr(pg, attr, None)
                if callable(fn):
                    with contextlib.suppress(Exception):
                        backend += " " + str(fn())
        if "nccl" not in backend.lower():
            return torch.device("cpu")
        device = "cuda"
    d = torch.device(device)
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise CheckpointConfigError(f"device={device!r}, but CUDA is not available")
        index: int | None = d.index  # None for a bare "cuda" (the stubs say int)
        if index is None:
            d = torch.device("cuda", torch.cuda.current_device())
    elif d.type != "cpu":
        raise CheckpointConfigError(f"device={device!r}: use the CPU (gloo) or a CUDA device")
    return d


def _send_segments(source: LiveSource) -> list[tuple[int, Callable[[], torch.Tensor]]]:
    """The messages that carry the shard file: its header, then each non-empty tensor
    in file order, as uint8 tensors over the bytes that were checksummed (no copy for
    contiguous CPU tensors)."""
    plan = source.plan
    header = bytearray(plan.header)
    segs: list[tuple[int, Callable[[], torch.Tensor]]] = [
        (len(header), lambda: torch.frombuffer(header, dtype=torch.uint8))]

    def tensor(key: str) -> Callable[[], torch.Tensor]:
        return lambda: torch.frombuffer(source.tensor_view(key), dtype=torch.uint8)

    segs.extend((it.nbytes, tensor(it.key)) for it in plan.items if it.nbytes)
    return segs


def _recv_segments(manifest: Manifest, flen: int, where: str
                   ) -> tuple[str | None, list[tuple[int, int]]]:
    """The file's name and the byte ranges of its messages, as the sender cuts them."""
    def bad(what: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{where}: the manifest of step {manifest.step} {what}")

    if not manifest.files:
        if flen:
            raise bad(f"lists no file, but {flen} file bytes were announced")
        return None, []
    if len(manifest.files) != 1:
        raise bad(f"lists {len(manifest.files)} files; a peer sends one")
    ((name, entry),) = manifest.files.items()
    if entry.bytes != flen:
        raise bad(f"says {name} is {entry.bytes} bytes, {flen} were announced")
    ranges = sorted(c.byte_range for t in manifest.tensors.values() for c in t.chunks
                    if c.file == name and c.nbytes)
    body = ranges[0][0] if ranges else flen
    if not 8 < body <= 8 + MAX_HEADER_BYTES:
        raise bad(f"puts the first tensor at byte {body}")
    segs = [(0, body)]
    pos = body
    for lo, hi in ranges:
        if lo != pos:
            raise bad(f"has a gap or overlap at byte {pos} of {name}")
        segs.append((lo, hi))
        pos = hi
    if pos != flen:
        raise bad(f"leaves bytes {pos}..{flen} of {name} undescribed")
    return name, segs


class _MemoryStorage:
    """ReadStorage over a received manifest and file held in memory. Thread-safe."""

    def __init__(self, manifest: bytes, files: dict[str, memoryview]):
        self._manifest = manifest
        self._names = list(files)
        self._views = list(files.values())

    def listdir(self, path: Path) -> list[str]:
        return [MANIFEST_NAME, *self._names]

    def read_bytes(self, path: Path, limit: int) -> bytes:
        if path.name != MANIFEST_NAME:
            raise FileNotFoundError(str(path))
        if len(self._manifest) > limit:
            raise ValueError(f"the manifest is {len(self._manifest)} bytes (limit {limit})")
        return self._manifest

    def open_read(self, path: Path) -> int:
        if path.name not in self._names:
            raise FileNotFoundError(str(path))
        return self._names.index(path.name)

    def close(self, fd: int) -> None:
        pass

    def file_size(self, fd: int) -> int:
        return len(self._views[fd])

    def pread_into(self, fd: int, views: Sequence[memoryview], offset: int) -> int:
        src = self._views[fd]
        got = 0
        for v in views:
            n = max(0, min(len(v), len(src) - offset))
            v[:n] = src[offset:offset + n]
            offset += n
            got += n
            if n < len(v):
                break
        return got
