"""Process-group transport: a healthy worker sends its live state over torch.distributed.

The same interface as :class:`~asyncckpt.transport.http.HTTPTransport`, over point to
point ``send``/``recv`` of a process group (gloo, or NCCL with ``device`` on the GPU).
Both sides call in: the healthy rank's ``send_checkpoint`` and the recovering rank's
``recv_checkpoint`` meet, and both return once the transfer is over. Everything runs
on the calling thread, on the group passed in: give the transport a group of its own
(``dist.new_group(backend="gloo")``), never the training group, whose collectives would
interleave with these messages.

Wire protocol, version 3 (every message is one tensor; ranks are ranks of the group; a
send completes only once its receiver has posted a receive of the same size, so each
side must know what the other sends next: hence the READY words):

1. receiver -> sender: a request, 8 int64 words
   ``[MAGIC, VERSION, REQUEST, wanted_step, max_manifest_bytes, max_file_bytes, 0, 0]``
   (the receiver's limits, >= 1; a 0 reads as not stated): a sender whose step is over them
   answers with an error saying so;
2. sender -> receiver: a reply, 8 int64 words
   ``[MAGIC, VERSION, OFFER, step, manifest_bytes, file_bytes, segments, 0]``, or
   ``[MAGIC, VERSION, NOT_FOUND, step_on_offer, 0, 0, 0, 0]`` when the steps differ, or
   an error (below) when the sender failed before it could offer: then nothing else
   follows and both sides stay in step;
3. receiver -> sender: ``[MAGIC, VERSION, READY, step, 0, 0, 0, 0]`` once it has checked
   the sizes and allocated the manifest's buffer, or an error (it refuses: then nothing
   else follows);
4. the manifest (JSON, the format of ``manifest.json``) as ``manifest_bytes`` uint8;
5. receiver -> sender: ``[MAGIC, VERSION, READY, step, 1, 0, 0, 0]`` once it has
   validated the manifest and allocated the file's buffer, or an error (as in 3);
6. the shard file (the safetensors layout of a committed checkpoint) in ``segments``
   uint8 messages, cut by :func:`_segments` from the file's pieces (its header, then
   each non-empty tensor in file order): runs of small adjacent pieces are gathered into
   one message of at most ``GATHER_BYTES``, a larger tensor goes from its own memory in
   slices of at most ``SLICE_BYTES``. A control word
   ``[MAGIC, VERSION, MORE, step, first, stop, 0, 0]`` precedes segments
   ``first..stop-1``, a batch of about ``CONTROL_BYTES`` (:func:`_batches`); in its
   place a sender that was cut off sends an error. A sender cut off in the middle of a
   batch sends the rest of the batch as zeros (no tensor is read once it is cut);
7. ``[MAGIC, VERSION, DONE, step, segments, 0, 0, 0]`` once the file is whole, or an
   error in its place (a sender cut off during the last batch).

An error is ``[MAGIC, VERSION, ERROR, step, reason_bytes, 0, 0, 0]``, then (when
``reason_bytes`` > 0) that many uint8 of UTF-8 text, at most ``MAX_REASON_BYTES``.
A peer of another protocol version is answered with the error header alone.

The receiver refuses sizes above its limits before it allocates anything, derives the
segments from the validated manifest (its pieces must tile the file exactly), receives
the file into one buffer, verifies every checksum in that buffer, and only then loads
it through the ordinary loader (``into=`` loads in place): a transfer that fails leaves
the targets as they were. Nothing is unpickled.

Timeouts: every wait is bounded by the call's ``timeout`` (``Work.wait(timeout)``); the
group's own timeout (``init_process_group``/``new_group(timeout=...)``) bounds the
backend underneath. A sender posts a receive for every destination's request at once
and serves the destinations one at a time, in the order their requests arrive (polled:
``Work.is_completed()``, or for gloo the bytes landing in the posted buffer): it waits
for requests up to ``timeout`` from the call's start, and each destination's transfer,
from its turn on, has a ``timeout`` of its own. So a destination that never asks fails
alone, at the timeout, and holds up none of the others; a receiver's ``timeout`` must
cover the transfers to the destinations served before it. (A group whose works cannot
be polled, such as some of torchft's, is waited on in the order of ``dst_ranks``.)
After a timeout or a protocol error the pair of ranks may be out of step (gloo closes
the connection after a timed-out receive): recreate the group before using it again,
as torchft does on every reconfiguration.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import math
import operator
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import xxhash

from ..commit import StepLike, as_step
from ..errors import (
    CheckpointClosedError,
    CheckpointConfigError,
    CheckpointCorruptError,
    CheckpointTimeoutError,
    CheckpointTransportError,
    check_flags,
    seconds_text,
)
from ..manifest import (
    DEFAULT_BLOCK_BYTES,
    MANIFEST_NAME,
    MAX_HEADER_BYTES,
    MAX_MANIFEST_BYTES,
    Chunk,
    Manifest,
    block_checksums,
    check_block_bytes,
    parse_manifest,
)
from ..reader import tensor_bytes
from .base import (
    PEER_MAX_MANIFEST_BYTES,
    CheckpointTransport,
    LiveSource,
    StepNotOffered,
    check_state_dict_fn,
    seconds,
    serve_state,
    uncopied_hint,
)

if TYPE_CHECKING:
    from ..loader import KeyMap

log = logging.getLogger(__name__)

__all__ = ["PGTransport"]

MAGIC = 0x61636B70745F7067  # "ackpt_pg"
VERSION = 3  # 2: errors, control words, gathered segments; 3: READY words, DONE
REQUEST, OFFER, NOT_FOUND, ERROR, MORE, READY, DONE = 1, 2, 3, 4, 5, 6, 7
HEADER_WORDS = 8
MAX_WORD = (1 << 63) - 1  # every number on the wire is an int64 word
DEFAULT_MAX_FILE_BYTES = 1 << 40
MAX_REASON_BYTES = 1024  # an error's text: enough to say why, bounded for the receiver
GATHER_BYTES = 1 << 20  # a gloo message costs ~0.3 ms: runs of smaller pieces go as one
SLICE_BYTES = 64 << 20  # a larger tensor goes in slices of at most this (no copy)
CONTROL_BYTES = 64 << 20  # a control word every ~this: how late a cut-off is told
_VERIFY_BYTES = 16 << 20  # a received file is verified in tasks of about this (2 threads)
_TAG = 0x6163  # one tag for every message: gloo keeps per-pair, per-tag order
_POLL_FIRST_S = 0.001  # a sender waiting for requests looks again after this,
_POLL_MAX_S = 0.02  # doubling up to this
_STUCK = ("the peer is not taking part, is stuck, or died (gloo tells of a peer killed in "
          "the middle of a transfer only at the timeout)")
_BUSY = ("the peer is not taking part, is stuck, or is still serving other ranks: a sender "
         "serves its destinations one at a time, so this rank's timeout must also cover the "
         "transfers to the ranks served before it")

_Segment = tuple[int, int, int, int]  # file bytes [lo, hi), made of pieces [first, stop)


# The longest single wait handed to the backend: gloo adds a wait's timeout to the clock
# in int64 nanoseconds, so one near threading.TIMEOUT_MAX overflows and ends at once.
_MAX_WAIT_S = 30 * 86400.0


def _timeout(t: timedelta | float) -> float:
    """A timeout in seconds, > 0 (inf, or timedelta.max, waits as long as a wait can:
    ``_MAX_WAIT_S``, 30 days)."""
    value = seconds(t)
    if math.isnan(value) or value <= 0:
        raise CheckpointConfigError(f"timeout={t!r}: pass a positive number of seconds or "
                                    "timedelta (inf waits as long as a wait can)")
    return value


def _left(deadline: float) -> float:
    """Seconds left until ``deadline`` (>= 0), at most what a wait accepts
    (``threading.TIMEOUT_MAX``: a longer one raises OverflowError)."""
    return min(max(0.0, deadline - time.monotonic()), threading.TIMEOUT_MAX)


def _check_word(value: Any, label: str, lo: int) -> int:
    """An int in ``lo..MAX_WORD`` (it goes on the wire as an int64 word)."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise CheckpointConfigError(f"{label}={value!r}: pass an int")
    v = operator.index(value)
    if not lo <= v <= MAX_WORD:
        raise CheckpointConfigError(f"{label}={v}: use an int in {lo}..2**63-1")
    return v


class PGTransport(CheckpointTransport[Any]):
    """Send and receive checkpoints over a torch.distributed process group.

    Thread-safe in the sense that one transfer runs at a time (a second call waits for
    the first); transfers run on the caller's thread. Ranks (``dst_ranks``,
    ``src_rank``) are ranks *of the group* passed in, checked before any message.

    Args:
        pg: the process group to use: a ``ProcessGroup`` (e.g. from
            ``dist.new_group(backend="gloo")``) or anything with the same
            ``send``/``recv``/``rank``/``size`` methods (torchft's process groups).
            None means the default group; a dedicated group is strongly preferred (on
            the default group, a warning is logged).
        timeout: the default for calls given no timeout, and how long
            ``disallow_checkpoint`` waits for a send running on another thread.
        device: where messages live: CPU for gloo, the rank's GPU for NCCL. None picks
            the current CUDA device for an NCCL group and the CPU otherwise.
        block_bytes: checksum granularity of the manifests this side sends.
        max_manifest_bytes: the largest manifest a peer may announce (256 MiB by
            default: a manifest grows up to ~25x in memory while parsed; at most 1 GiB,
            the largest manifest any load reads).
        max_file_bytes: the largest shard file a peer may announce.
    """

    def __init__(self, pg: Any, timeout: timedelta | float = 60.0, *,
                 device: torch.device | str | None = None,
                 block_bytes: int = DEFAULT_BLOCK_BYTES,
                 max_manifest_bytes: int = PEER_MAX_MANIFEST_BYTES,
                 max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
                 state_dict: Callable[[], Any] | None = None):
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
        if _is_default_group(pg):
            log.warning(
                "PGTransport on the default process group (pg=None or group.WORLD): its "
                "collectives interleave with this transport's messages if anything runs "
                "on another thread. Pass a group of its own (dist.new_group(backend=\"gloo\")), "
                "or call send_checkpoint/recv_checkpoint only from the training thread, "
                "between collectives")
        # (>= 1: a limit of 0 would go on the wire as "not stated")
        max_manifest_bytes = _check_word(max_manifest_bytes, "max_manifest_bytes", 1)
        max_file_bytes = _check_word(max_file_bytes, "max_file_bytes", 1)
        self.pg = pg
        self.timeout_s = _timeout(timeout)
        self.device = _resolve_device(pg, device)
        check_block_bytes(block_bytes)
        self.block_bytes = block_bytes
        # (a load reads no manifest above MAX_MANIFEST_BYTES: one would be sent in vain)
        self.max_manifest_bytes = min(max_manifest_bytes, MAX_MANIFEST_BYTES)
        self.max_file_bytes = max_file_bytes
        self._state_dict = check_state_dict_fn(state_dict)
        self._lock = threading.Lock()  # one transfer at a time on the group
        self._cond = threading.Condition()
        self._sending = 0
        self._reading = 0  # sends in a stretch that reads the live tensors
        self._cuts: set[threading.Event] = set()  # one per send in progress
        self._closed = False
        self._cut_by = "disallow_checkpoint"  # what cut the sends off: said in their errors

    # --- the interface --------------------------------------------------------------------

    def metadata(self) -> str:
        """``pg:<rank in the group>`` (``pg:?`` while the group cannot say: torchft asks
        before it configures its group). Informational: peers are named by rank."""
        try:
            return f"pg:{_group_rank(self.pg)}"
        except Exception:
            return "pg:?"

    def send_checkpoint(self, dst_ranks: list[int], step: StepLike, state_dict: Any,
                        timeout: timedelta | float | None = None) -> None:
        """Send ``state_dict`` at ``step`` to each rank of ``dst_ranks``, one at a time, in
        the order their requests arrive.

        Returns once every destination has received it (or was told the step it asked
        for is not this one: that is logged, not raised). The tensors are sent from
        their own memory (small ones from copies made here), so they must not change
        until this returns. When the state
        cannot be served (an unsupported leaf, a cut-off), each destination's request is
        answered with the reason, so that its receive fails at once rather than at its
        timeout, and then the error is raised here. A destination that refuses the
        offer (it cannot allocate the buffers, or rejects the manifest) says so: the
        others are still served, then its reason is raised.

        ``timeout`` bounds the wait for the destinations' requests, from this call's
        start; each destination's transfer then has a ``timeout`` of its own from its
        turn on. A destination that does not ask in time fails alone (the others are
        served as they ask), with a CheckpointTimeoutError raised once all were served.
        A group whose works have no usable ``is_completed()`` (some of torchft's) is
        waited on in the order of ``dst_ranks`` instead.

        Raises:
            CheckpointConfigError: a rank of ``dst_ranks`` is not another rank of the
                group, or is named twice, or ``step`` is not an int in 0..2**63-1
                (checked before any message).
            CheckpointTimeoutError: a destination does not take part in time.
            CheckpointTransportError: the group fails, a destination refused, or the
                send was cut off.
        """
        from .. import __version__

        self._check_open()
        step = as_step(step)  # (at most 2**63-1: a word on the wire)
        budget = self.timeout_s if timeout is None else _timeout(timeout)
        deadline = time.monotonic() + budget  # for the requests: from the call's start
        dsts = self._check_peers(dst_ranks, f"dst_ranks={dst_ranks!r}")
        cut = threading.Event()  # set by disallow_checkpoint to cut this send off
        with self._cond:  # counted from the start: disallow_checkpoint waits for it
            self._sending += 1
            self._cuts.add(cut)
        served = None
        try:
            try:
                served = serve_state(step, state_dict, block_bytes=self.block_bytes,
                                     library_version=__version__)
                (source,) = served.files.values()
                if not isinstance(source, LiveSource):
                    raise AssertionError("serve_state serves a LiveSource")
                with self._cond:  # stops its checksumming too
                    self._cuts.add(served.cancelled)
                    if cut.is_set():
                        served.cancelled.set()
                if not self._begin_reading(cut):
                    raise CheckpointTransportError(
                        f"step {step}: the send was cut off by {self._cut_by} before it "
                        "began")
                try:
                    manifest = served.manifest()  # checksums every tensor once, here
                finally:
                    self._end_reading()
                pieces, view = _send_pieces(source)
                segments = _segments(pieces)
            except Exception as exc:
                self._tell_failure(dsts, step, exc, budget, deadline)
                raise
            self._acquire(deadline, f"send step {step} to ranks {dsts}")
            try:
                cut_off: str | None = None
                failed: Exception | None = None
                # one destination's failure is no reason to drop the others
                for dst, request in self._requests(dsts, step, budget, deadline):
                    try:
                        if isinstance(request, Exception):
                            raise request
                        # (its own budget: the ranks served before it took theirs)
                        cut_off = self._send_to(dst, step, request, manifest, pieces, view,
                                                segments, time.monotonic() + budget,
                                                cut) or cut_off
                    except Exception as exc:
                        log.warning("step %d: sending to rank %d failed: %s", step, dst, exc)
                        failed = failed or exc
            finally:
                self._lock.release()
            served.tell_changed()  # (a receiver may fail its checksums: the loop is amiss)
            if failed is not None:
                raise failed
            if cut_off is not None:
                raise CheckpointTransportError(f"step {step}: {cut_off}")
        finally:
            with self._cond:
                self._cuts.discard(cut)
                if served is not None:
                    self._cuts.discard(served.cancelled)
                self._sending -= 1
                self._cond.notify_all()
            if served is not None:
                served.close()

    def recv_checkpoint(self, src_rank: int, metadata: str, step: StepLike,
                        timeout: timedelta | float | None = None, *, into: Any = None,
                        strict: bool = True, ignore_unexpected: bool = False,
                        exclude: str | Iterable[str] | None = None,
                        key_map: KeyMap | None = None, cast: bool = False) -> Any:
        """Receive ``step`` from rank ``src_rank`` of the group (``metadata`` is its
        ``metadata()``, used in messages only).

        Returns a plain tree of fresh CPU tensors, or with ``into=`` loads into that state
        in place (tensor identity kept, resharding as ``load`` does) and returns it.
        ``strict`` and ``ignore_unexpected`` as for ``AsyncCheckpointer.load`` (the
        whole step is still sent: a group's sender sends what it has); so is
        ``exclude=["optim"]`` (those parts are not loaded, and in ``into`` left as they are).

        Every checksum is verified against the received bytes before anything is
        loaded: a receive that fails leaves ``into`` as it was, never a mix of two steps.

        Raises:
            CheckpointConfigError: ``src_rank`` is not another rank of the group, or
                ``step`` is not an int in 0..2**63-1 (checked before any message).
            StepNotOffered: the peer sends another step (a CheckpointNotFoundError whose
                ``offered`` is that step, as HTTPTransport's).
            CheckpointCorruptError: the manifest or a checksum does not match (damaged
                in transit: receive again).
            CheckpointTimeoutError: the peer did not answer in time.
            CheckpointTransportError: the peer could not send (its reason is quoted),
                broke the protocol, or the group failed; or this rank cannot allocate
                the buffers (the peer is told).
        """
        from ..loader import (
            COPIES_EXPECTED,
            check_exclude,
            check_key_map,
            excluded_view,
            load_from,
            load_reusing,
        )

        self._check_open()
        step = as_step(step)  # (at most 2**63-1: a word on the wire)
        check_flags(strict=strict, ignore_unexpected=ignore_unexpected, cast=cast)
        parts = check_exclude(exclude)
        check_key_map(key_map)
        total = self.timeout_s if timeout is None else _timeout(timeout)
        deadline = time.monotonic() + total
        (src,) = self._check_peers([src_rank], f"src_rank={src_rank!r}")
        _check_metadata(metadata, src)
        where = f"peer rank {src} ({metadata})"
        self._acquire(deadline, f"receive step {step} from {where}")
        try:
            raw, manifest, name, host = self._recv_from(src, step, deadline, where)
        except CheckpointTimeoutError as exc:
            # (a trial's 0.05 s receive of 160 MB was told "no answer within 0.00083s
            # (the peer is not taking part, or is stuck)": what was left, not its timeout)
            raise CheckpointTimeoutError(
                f"{exc}; the receive of step {step} ran out of its timeout of "
                f"{seconds_text(total)}: if the peer was sending, it died (a process "
                "killed mid-transfer is seen only at the timeout), or the timeout is too "
                "short for this state's size over this group (pass a larger one)") from exc
        finally:
            self._lock.release()
        step_dir = Path(f"pg-rank-{src}-step-{step}")
        view = tensor_bytes(host) if name is not None else memoryview(b"")
        if name is not None:  # all of it, before a single target is touched
            _verify_file(manifest, name, view, step_dir, where)
        # (``host`` owns the memory the storage's view points into: it lives until we return)
        storage = _MemoryStorage(raw, {name: view} if name is not None else {})
        copies = COPIES_EXPECTED.set(True)  # (its caller hands them to load_state_dict)
        try:
            if into is None and self._state_dict is not None:  # (torchft's Manager: none)
                return load_reusing(step_dir, self._state_dict(), storage, manifest=manifest,
                                    verify=False, exclude=parts, key_map=key_map)
            target, _, finish = excluded_view(into, parts)
            return finish(load_from(step_dir, target, storage, strict=strict, verify=False,
                                    manifest=manifest, ignore_unexpected=ignore_unexpected,
                                    exclude=parts, key_map=key_map, cast=cast))
        finally:
            COPIES_EXPECTED.reset(copies)

    def disallow_checkpoint(self) -> None:
        """Sends finish before ``send_checkpoint`` returns, so there is nothing to stop;
        a send running on another thread may finish within the timeout, then it is cut
        off: it finishes the segment in flight (at most ``SLICE_BYTES``), sends the rest
        of its batch as zeros, tells its receiver, whose call fails at once, and reads no
        tensor any more once this returns. (A cut send that waits for a request, or is
        telling its receivers, reads no tensor: it is not waited for.)

        The wait for the segment in flight is bounded by the timeout too: a receiver
        that takes no more bytes cannot hold this call forever. Past it, an error is
        logged and this returns although that segment may still be read (its receiver's
        checksums reject what changes meanwhile)."""
        grace = min(self.timeout_s, threading.TIMEOUT_MAX)
        with self._cond:
            if self._cond.wait_for(lambda: self._sending == 0, grace):
                return
            log.warning("disallow_checkpoint: cutting off a send still running after %s",
                        seconds_text(grace))
            self._cut_off("disallow_checkpoint", grace)

    def _cut_off(self, who: str, grace: float | None) -> None:
        """Cut off every send (call with ``self._cond`` held); unless ``grace`` is None,
        wait up to ``grace`` seconds until none reads the live tensors."""
        self._cut_by = who
        for cut in self._cuts:
            cut.set()
        if grace is not None and not self._cond.wait_for(lambda: self._reading == 0, grace):
            log.error("%s: a send still reads the live tensors %s after it was cut off "
                      "(checksumming them before its offer, or sending a segment its receiver "
                      "takes no more of); returning anyway: they may be read while the state "
                      "changes, and the receiver's checksums will reject what changed", who,
                      seconds_text(grace))

    def _begin_reading(self, cut: threading.Event) -> bool:
        """Enter a stretch that reads the live tensors, unless the send was cut off."""
        with self._cond:
            if cut.is_set():
                return False
            self._reading += 1
            return True

    def _end_reading(self) -> None:
        with self._cond:
            self._reading -= 1
            self._cond.notify_all()

    def shutdown(self, wait: bool = True) -> None:
        """Refuse later transfers and cut off the sends in progress, or waiting for their
        turn, as ``disallow_checkpoint`` does (their receivers are told, and fail at
        once). With ``wait``, return once none of them reads the live tensors any more
        (at most the timeout: past it, an error is logged). Receives in progress run to
        their end or timeout. The group belongs to the caller and is left as it is."""
        with self._cond:
            self._closed = True
            self._cut_off("shutdown", min(self.timeout_s, threading.TIMEOUT_MAX) if wait
                          else None)

    # --- sending --------------------------------------------------------------------------

    def _send_to(self, dst: int, step: int, request: list[int], manifest: bytes,
                 pieces: list[tuple[int, int]], view: Callable[[int], memoryview],
                 segments: list[_Segment], deadline: float,
                 cut: threading.Event) -> str | None:
        """Serve one destination, whose ``request`` is in; returns why it was cut off
        (once it was told), or None."""
        wanted, max_manifest, max_file = self._check_request(dst, step, request, deadline)
        if wanted != step:
            self._send_words(dst, [MAGIC, VERSION, NOT_FOUND, step, 0, 0, 0, 0], deadline,
                             f"the refusal to rank {dst}")
            log.warning("rank %d asked for step %d; this rank sends step %d: refused", dst,
                        wanted, step)
            return None
        if cut.is_set():
            reason = f"the send to rank {dst} was cut off by {self._cut_by} before its offer"
            self._send_error(dst, step, reason, deadline)
            return reason
        file_bytes = pieces[-1][1] if pieces else 0
        if (max_manifest and len(manifest) > max_manifest) or (max_file and
                                                               file_bytes > max_file):
            # Offered anyway, the receiver would refuse it and this rank would wait out
            # its timeout sending what nobody reads.
            reason = (f"step {step} is a manifest of {len(manifest)} bytes and a shard file of "
                      f"{file_bytes} bytes; rank {dst} takes at most {max_manifest} and "
                      f"{max_file} (its PGTransport's max_manifest_bytes=, max_file_bytes=)")
            self._send_error(dst, step, reason, deadline)
            raise CheckpointTransportError(f"not sent to rank {dst}: {reason}")
        self._send_words(dst, [MAGIC, VERSION, OFFER, step, len(manifest), file_bytes,
                               len(segments), 0], deadline, f"the offer to rank {dst}")
        self._await_ready(dst, step, 0, deadline, "offer")
        raw = torch.frombuffer(bytearray(manifest), dtype=torch.uint8)
        self._send(raw, dst, deadline, f"the manifest of step {step} to rank {dst}")
        self._await_ready(dst, step, 1, deadline, "manifest")
        sent = 0  # segments sent from the tensors
        zeros: torch.Tensor | None = None  # what goes in their place once cut off
        for first, stop in _batches(segments):
            # (the receiver expects whole batches: a cut is told at the next control word)
            if cut.is_set():
                break
            self._send_words(dst, [MAGIC, VERSION, MORE, step, first, stop, 0, 0],
                             deadline, f"the control word before segment {first} of step "
                             f"{step} to rank {dst}")
            for i in range(first, stop):
                what = f"segment {i} of step {step} to rank {dst}"
                if self._begin_reading(cut):  # checked before every segment
                    try:
                        self._send(_segment_tensor(segments[i], pieces, view), dst, deadline,
                                   what)
                        sent += 1
                    finally:
                        self._end_reading()
                    continue
                if zeros is None:  # cut off within the batch: its rest reads no tensor
                    zeros = torch.zeros(max(hi - lo for lo, hi, _, _ in segments[i:stop]),
                                        dtype=torch.uint8)
                lo, hi = segments[i][:2]
                self._send(zeros[:hi - lo], dst, deadline, what + " (zeros: cut off)")
        if sent < len(segments):
            reason = (f"the send to rank {dst} was cut off by {self._cut_by} after "
                      f"{sent} of {len(segments)} segments")
            self._send_error(dst, step, reason, deadline)
            return reason
        self._send_words(dst, [MAGIC, VERSION, DONE, step, len(segments), 0, 0, 0], deadline,
                         f"the end of step {step} to rank {dst}")
        return None

    def _await_ready(self, dst: int, step: int, stage: int, deadline: float,
                     after: str) -> None:
        """Wait for rank ``dst``'s READY word after the offer (stage 0) or the manifest
        (stage 1); raise its reason when it refuses instead (the pair stays in step)."""
        w = self._recv_words(dst, deadline, f"the answer of rank {dst} to the {after} of "
                             f"step {step}")
        if w[:3] == [MAGIC, VERSION, ERROR]:
            reason = self._error_text(dst, w, deadline, f"rank {dst}")
            raise CheckpointTransportError(
                f"rank {dst} refused step {step} after the {after}: {reason}")
        if w != [MAGIC, VERSION, READY, step, stage, 0, 0, 0]:
            raise CheckpointTransportError(
                f"rank {dst} broke the protocol: answered {w} to the {after} of step {step}; "
                "recreate the process group before using it again")

    def _requests(self, dsts: list[int], step: int, budget: float, deadline: float
                  ) -> Iterator[tuple[int, list[int] | Exception]]:
        """Each destination's request, in the order they arrive: ``(rank, its words)``,
        or ``(rank, the error in its place)``.

        A receive is posted for every destination at once, then polled (see
        :func:`_arrived`; every 1 ms doubling to 20 ms) until ``deadline``; a
        request that has arrived is still yielded after it (the caller took that long
        serving the others). Destinations that never ask get a CheckpointTimeoutError;
        their receives are then waited on for a moment, so that the backend ends them
        (gloo: rather than let a request that comes later land in a buffer nobody
        reads). Works that cannot be polled are waited on in the order of ``dsts``."""
        posted: dict[int, tuple[torch.Tensor, Any]] = {}
        for dst in dsts:
            t = torch.zeros(HEADER_WORDS, dtype=torch.int64, device=self.device)
            try:
                posted[dst] = (t, self.pg.recv([t], dst, _TAG))
            except Exception as exc:
                yield dst, CheckpointTransportError(
                    f"receiving the request of rank {dst} for step {step} failed: {exc}; "
                    "recreate the process group before using it again")
        poll = all(_can_poll(work) for _, work in posted.values())
        pause = _POLL_FIRST_S
        while posted:
            dst = next(iter(posted))  # in order, for works that cannot be polled
            if poll:
                ready = next((d for d, (t, work) in posted.items() if _arrived(t, work)),
                             None)
                if ready is None and time.monotonic() < deadline:
                    time.sleep(min(pause, _left(deadline)))
                    pause = min(2 * pause, _POLL_MAX_S)
                    continue
                if ready is None:  # out of time: these never asked
                    for late, (t, work) in list(posted.items()):
                        del posted[late]
                        yield late, self._never_asked(late, step, t, work, budget)
                    return
                dst = ready
            t, work = posted.pop(dst)
            if poll:  # it has arrived: its wait returns at once
                until = time.monotonic() + budget
            else:  # until the deadline, or a moment past it (it may have come meanwhile)
                until = max(deadline, time.monotonic() + min(budget, 1.0))
            try:
                self._wait_posted(work, until, f"receiving the request of rank {dst} for step "
                                  f"{step}")
            except CheckpointTimeoutError as exc:
                yield dst, self._asked_nothing(dst, step, budget, exc)
                continue
            except Exception as exc:
                yield dst, exc
                continue
            pause = _POLL_FIRST_S
            yield dst, [int(x) for x in t.cpu().tolist()]

    def _never_asked(self, dst: int, step: int, t: torch.Tensor, work: Any,
                     budget: float) -> list[int] | Exception:
        """A destination that did not ask in time: its receive is waited on for a
        moment (it may have come just now), which lets the backend end it."""
        try:
            ok = work.wait(timedelta(seconds=0.001))
        except Exception as exc:
            return self._asked_nothing(dst, step, budget, exc)
        if ok is False:
            return self._asked_nothing(dst, step, budget, None)
        return [int(x) for x in t.cpu().tolist()]

    @staticmethod
    def _asked_nothing(dst: int, step: int, budget: float,
                       cause: Exception | None) -> CheckpointTimeoutError:
        err = CheckpointTimeoutError(
            f"rank {dst} did not ask for step {step} within {seconds_text(budget)}: is it calling "
            "recv_checkpoint on this group? (recreate the process group before using it "
            "again)")
        err.ranks = (dst,)  # (as a group's timeouts name theirs)
        err.__cause__ = cause
        return err

    def _check_request(self, dst: int, step: int, req: list[int],
                       deadline: float) -> tuple[int, int, int]:
        """The step rank ``dst`` asks for in its request ``req`` (received), and its
        limits on the manifest's and the file's sizes (0: not stated). A peer of another
        protocol version gets an error header, which its own version check rejects at
        once."""
        if req[0] == MAGIC and req[2] == REQUEST and req[1] != VERSION:
            self._send_words(dst, [MAGIC, VERSION, ERROR, step, 0, 0, 0, 0], deadline,
                             f"the version error to rank {dst}")
            raise CheckpointTransportError(
                f"rank {dst} asked for step {req[3]} in version {req[1]} of the asyncckpt "
                f"process-group protocol, this rank speaks version {VERSION}: run the same "
                "asyncckpt version on every rank")
        if req[:3] != [MAGIC, VERSION, REQUEST]:
            raise CheckpointTransportError(
                f"rank {dst} sent {req} instead of an asyncckpt request (this rank sends "
                f"step {step}): is it running "
                "recv_checkpoint on the same group, with the same asyncckpt version?")
        return req[3], max(0, req[4]), max(0, req[5])

    def _send_error(self, dst: int, step: int, reason: str, deadline: float) -> None:
        """Tell ``dst`` why nothing (more) comes: its receive fails at once, quoting
        ``reason`` (cut to MAX_REASON_BYTES), and the pair stays in step."""
        text = reason.encode("utf-8", "replace")[:MAX_REASON_BYTES]
        text = text.decode("utf-8", "ignore").encode("utf-8")  # no character cut in two
        self._send_words(dst, [MAGIC, VERSION, ERROR, step, len(text), 0, 0, 0], deadline,
                         f"the error of step {step} to rank {dst}")
        if text:
            self._send(torch.frombuffer(bytearray(text), dtype=torch.uint8), dst, deadline,
                       f"the error text of step {step} to rank {dst}")

    def _tell_failure(self, dsts: list[int], step: int, exc: Exception, budget: float,
                      deadline: float) -> None:
        """The state could not be served: answer each destination's request with the
        reason, in the order the requests arrive, so that its receive fails now rather
        than at its timeout. Best effort (the caller raises ``exc`` whatever happens
        here)."""
        if not dsts or not self._lock.acquire(timeout=_left(deadline)):
            return
        try:
            for dst, request in self._requests(dsts, step, budget, deadline):
                try:
                    if isinstance(request, Exception):
                        raise request
                    until = time.monotonic() + budget
                    self._check_request(dst, step, request, until)
                    self._send_error(dst, step, f"{type(exc).__name__}: {exc}", until)
                except Exception as told:
                    log.warning("step %d could not be served (%s), and rank %d could not be "
                                "told: %s", step, exc, dst, told)
        finally:
            self._lock.release()

    # --- receiving ------------------------------------------------------------------------

    def _recv_from(self, src: int, step: int, deadline: float, where: str
                   ) -> tuple[bytes, Manifest, str | None, torch.Tensor]:
        """The manifest's bytes, the manifest, the file's name and the file's bytes in
        host memory (not verified yet)."""
        self._send_words(src, [MAGIC, VERSION, REQUEST, step, self.max_manifest_bytes,
                               self.max_file_bytes, 0, 0], deadline,
                         f"the request for step {step} to {where}")
        h = self._recv_words(src, deadline, f"the answer to the request for step {step} of "
                             f"{where}", stuck=_BUSY)
        _check_words(h, f"{where} (asked for step {step})", "offer")
        kind, have, mlen, flen, nseg = h[2:7]
        if kind == NOT_FOUND:
            raise StepNotOffered(f"{where} sends step {have}, not step {step}", have)
        if kind == ERROR:
            raise self._peer_error(src, h, deadline, where, step)
        if kind != OFFER or have != step:
            raise CheckpointTransportError(
                f"{where} broke the protocol: answered {h} to a request for step {step}; "
                "recreate the process group before using it again")
        # From the offer on, the sender waits for this rank's READY: a failure here is
        # told (the sender stops, both stay in step), never left to its timeout.
        try:
            if not 0 < mlen <= self.max_manifest_bytes:
                raise CheckpointTransportError(
                    f"{where} announced a manifest of {mlen} bytes (limit "
                    f"{self.max_manifest_bytes}, max_manifest_bytes=) for step {step}; "
                    "refused before allocating it")
            if not 0 <= flen <= self.max_file_bytes:
                raise CheckpointTransportError(
                    f"{where} announced a shard file of {flen} bytes (limit "
                    f"{self.max_file_bytes}, max_file_bytes=) for step {step}; refused before "
                    "allocating it")
            raw_t = self._alloc(mlen, "the manifest", step, where)
        except Exception as exc:
            self._refuse(src, step, exc, deadline, where)
            raise
        self._send_words(src, [MAGIC, VERSION, READY, step, 0, 0, 0, 0], deadline,
                         f"the ready word for the manifest of step {step} to {where}")
        self._recv(raw_t, src, deadline, f"the manifest of step {step} from {where}")
        cuda = self.device.type == "cuda"
        try:
            raw = bytes(raw_t.cpu().numpy())
            del raw_t
            manifest = parse_manifest(raw, f"{where}: manifest of step {step}")
            if manifest.step != step:
                raise CheckpointCorruptError(
                    f"{where}: the manifest is of step {manifest.step}, the offer of step "
                    f"{step}")
            name, pieces = _recv_pieces(manifest, flen, where)
            segs = _segments(pieces)
            if len(segs) != nseg:
                raise CheckpointCorruptError(
                    f"{where}: announced {nseg} segments for step {step}, its manifest implies "
                    f"{len(segs)}")
            buf = self._alloc(flen, "the shard file", step, where)
            # (the loader reads and verifies host memory: for CUDA, a pinned copy)
            host = self._alloc(flen, "the shard file", step, where, pin=True) if cuda else buf
        except Exception as exc:
            self._refuse(src, step, exc, deadline, where)
            raise
        self._send_words(src, [MAGIC, VERSION, READY, step, 1, 0, 0, 0], deadline,
                         f"the ready word for the file of step {step} to {where}")
        for first, stop in _batches(segs):
            w = self._recv_words(src, deadline, f"the control word before segment {first} of "
                                 f"step {step} from {where}")
            self._expect(w, [MAGIC, VERSION, MORE, step, first, stop, 0, 0], src, deadline,
                         where, step, f"before segment {first}")
            for i in range(first, stop):
                lo, hi = segs[i][:2]
                self._recv(buf[lo:hi], src, deadline, f"segment {i} of step {step} from {where}")
        w = self._recv_words(src, deadline, f"the end of step {step} from {where}")
        self._expect(w, [MAGIC, VERSION, DONE, step, nseg, 0, 0, 0], src, deadline, where,
                     step, "after the last segment")
        if cuda:
            host.copy_(buf)
            del buf
        return raw, manifest, name, host

    def _expect(self, w: list[int], want: list[int], src: int, deadline: float, where: str,
                step: int, when: str) -> None:
        """A control word must be ``want``; the sender's error is raised as such."""
        _check_words(w, f"{where} (step {step})", "control word")
        if w[2] == ERROR:
            raise self._peer_error(src, w, deadline, where, step)
        if w != want:
            raise CheckpointTransportError(
                f"{where} broke the protocol: sent {w} {when} of step {step}; recreate the "
                "process group before using it again")

    def _alloc(self, n: int, what: str, step: int, where: str, *,
               pin: bool = False) -> torch.Tensor:
        """``n`` bytes for ``what``; running out of memory is a CheckpointTransportError
        naming the peer, the step and the size."""
        try:
            if pin:
                return torch.empty(n, dtype=torch.uint8, pin_memory=True)
            return torch.empty(n, dtype=torch.uint8, device=self.device)
        except (MemoryError, RuntimeError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            place = "pinned host memory" if pin else str(self.device)
            raise CheckpointTransportError(
                f"cannot receive step {step} from {where}: allocating {n} bytes of {place} "
                f"for {what} failed ({type(exc).__name__}: {str(exc)[:200]})") from exc

    def _refuse(self, src: int, step: int, exc: Exception, deadline: float,
                where: str) -> None:
        """Tell the sender, which waits for a READY word, why this rank will not take
        step ``step``. Best effort: the caller raises ``exc`` whatever happens here."""
        try:
            self._send_error(src, step, f"{type(exc).__name__}: {exc}", deadline)
        except Exception as told:
            log.warning("step %d from %s: refused (%s), and the sender could not be told: %s",
                        step, where, exc, told)

    def _peer_error(self, src: int, words: list[int], deadline: float, where: str,
                    step: int) -> CheckpointTransportError:
        """The error a peer sent instead of an offer or a control word, with its reason
        and the step the peer was sending (``words[3]``)."""
        reason = self._error_text(src, words, deadline, f"{where} (step {step})")
        theirs = words[3]
        asked = "" if theirs == step else f" (this rank asked for step {step})"
        return CheckpointTransportError(
            f"{where} could not send step {theirs}{asked}: {reason}")

    def _error_text(self, peer: int, words: list[int], deadline: float, where: str) -> str:
        """Receive the text of the error ``words`` announces (printable characters only);
        raise when its length is over MAX_REASON_BYTES (the pair is then out of step)."""
        n = words[4]
        if not 0 <= n <= MAX_REASON_BYTES:
            raise CheckpointTransportError(
                f"{where} announced an error text of {n} bytes (limit {MAX_REASON_BYTES}); "
                "refused before allocating it. Recreate the process group before using it "
                "again")
        if not n:
            return "(no reason given)"
        t = torch.empty(n, dtype=torch.uint8, device=self.device)
        self._recv(t, peer, deadline, f"the error text of {where}")
        text = bytes(t.cpu().numpy()).decode("utf-8", "replace")
        return "".join(c if c.isprintable() else " " for c in text)

    # --- messages -------------------------------------------------------------------------

    def _send_words(self, peer: int, words: list[int], deadline: float, what: str) -> None:
        self._send(torch.tensor(words, dtype=torch.int64, device=self.device), peer, deadline,
                   what)

    def _recv_words(self, peer: int, deadline: float, what: str, *,
                    stuck: str = _STUCK) -> list[int]:
        t = torch.zeros(HEADER_WORDS, dtype=torch.int64, device=self.device)
        self._recv(t, peer, deadline, what, stuck=stuck)
        return [int(x) for x in t.cpu().tolist()]

    def _send(self, t: torch.Tensor, peer: int, deadline: float, what: str) -> None:
        if t.device != self.device:
            t = t.to(self.device)
        self._wait(lambda: self.pg.send([t], peer, _TAG), deadline, f"sending {what}")

    def _recv(self, t: torch.Tensor, peer: int, deadline: float, what: str, *,
              stuck: str = _STUCK) -> None:
        self._wait(lambda: self.pg.recv([t], peer, _TAG), deadline, f"receiving {what}",
                   stuck=stuck)

    def _wait_posted(self, work: Any, deadline: float, what: str) -> None:
        self._wait(lambda: work, deadline, what)

    def _wait(self, start: Callable[[], Any], deadline: float, what: str, *,
              stuck: str = _STUCK) -> None:
        """Start a work (``start()``: a send, a receive, or one posted before) and wait
        for it until ``deadline``; ``stuck`` says why a timeout may have happened."""
        left = min(deadline - time.monotonic(), _MAX_WAIT_S)
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
                    f"{what}: no answer within {seconds_text(left)} ({stuck}); recreate the "
                    "process group before using it again") from exc
            closed = ("closed by peer" in text.lower() or "connection reset" in text.lower())
            raise CheckpointTransportError(
                f"{what} failed: {text}; recreate the process group before using it again"
                + ("; the peer may be alive: one that timed out waiting for this rank (a "
                   "send_checkpoint whose destination asked too late) closes the pair too"
                   if closed else "")) from exc
        if ok is False:
            raise CheckpointTimeoutError(f"{what}: no answer within {seconds_text(left)} ({stuck})")

    def _acquire(self, deadline: float, what: str) -> None:
        if not self._lock.acquire(timeout=_left(deadline)):
            raise CheckpointTimeoutError(
                f"cannot {what}: another transfer on this transport is still running (one "
                "transfer at a time)")

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointClosedError("this PGTransport was shut down")

    def _check_peers(self, ranks: Any, label: str) -> list[int]:
        """Each rank must be another rank of the group, named once. Checked before any
        message: the backend does not check (gloo crashes the process on a rank past the
        group's size, waits out the group's timeout on a negative one, and a rank named
        twice would wait for a second request that never comes)."""
        try:
            given = list(ranks)
        except TypeError:
            raise CheckpointConfigError(f"{label}: pass a list of ranks") from None
        me = _group_rank(self.pg)
        size = _group_size(self.pg)
        group = ("this group" if size is None else
                 f"this group of {size} rank{'' if size == 1 else 's'}")
        seen: set[int] = set()
        for r in given:
            if isinstance(r, bool) or not hasattr(r, "__index__"):
                raise CheckpointConfigError(f"{label}: {r!r} is not a rank (an int) of {group}")
            rank = operator.index(r)
            if rank < 0 or (size is not None and rank >= size):
                span = "" if size is None else f" (0..{size - 1})"
                raise CheckpointConfigError(
                    f"{label}: rank {rank} is not a rank of {group}{span}; ranks are ranks "
                    "of the group passed to PGTransport")
            if rank == me:
                raise CheckpointConfigError(
                    f"{label}: rank {rank} is this rank; name another rank of {group}")
            if rank in seen:
                raise CheckpointConfigError(
                    f"{label}: rank {rank} is named twice; name each destination once")
            seen.add(rank)
        return [operator.index(r) for r in given]


def _is_default_group(pg: Any) -> bool:
    """Whether ``pg`` is torch.distributed's default group (``group.WORLD``)."""
    try:
        import torch.distributed as dist

        return bool(dist.is_available() and dist.is_initialized() and pg is dist.group.WORLD)
    except Exception:
        return False


def _can_poll(work: Any) -> bool:
    """Whether ``work.is_completed()`` tells when the work is done. torch's own works
    (gloo, NCCL) do, and so does any object with an ``is_completed`` of its own; a
    Python subclass of torch's Work that does not define it (torchft's _BabyWork)
    inherits a flag nothing sets: it would never say True."""
    if not callable(getattr(work, "is_completed", None)):
        return False
    try:
        import torch.distributed as dist

        base: Any = dist.Work
    except Exception:  # a build without torch.distributed
        return True
    if type(work) is base or not isinstance(work, base):
        return True
    return type(work).is_completed is not base.is_completed


def _arrived(t: torch.Tensor, work: Any) -> bool:
    """Whether the request that ``work`` receives into ``t`` (zeros until then) has come,
    or is coming: its wait then returns at once. ``work.is_completed()`` says so where
    the backend can tell (NCCL; True when it raises: the wait then says what failed).
    Gloo's receives cannot tell (False until waited on, torch 2.13), but write straight
    into ``t`` as the bytes come, and no request is all zeros."""
    try:
        if work.is_completed():
            return True
    except Exception:
        return True
    return t.device.type == "cpu" and bool(t.any())


def _check_metadata(metadata: object, src: int) -> None:
    """``metadata`` is no HTTP peer's address (refused), nor another rank's (logged):
    a receive handed either would otherwise go on and quote it."""
    said = str(metadata)
    if said.startswith(("http://", "https://")):
        raise CheckpointConfigError(
            f"metadata={said!r} is an HTTP peer's address, and this is a PGTransport "
            f"(receiving from rank {src} of its group): receive it with an HTTPTransport, "
            "or pass the metadata() of the peer's PGTransport")
    match = re.fullmatch(r"pg:(\d+)", said)
    if match is not None and int(match[1]) != src:
        # (info, not a warning: torchft asks for metadata() before it configures the
        # group anew, so a rank that moved as a replica joined gives its former rank)
        log.info("receiving from rank %d with metadata %r, which rank %s gave: if that "
                 "is no group configured anew since, pass the metadata() of the rank you "
                 "receive from", src, said, match[1])


def _group_rank(pg: Any) -> int:
    """This process's rank in ``pg``. torchft's reconfigurable groups (ProcessGroupGloo,
    ProcessGroupNCCL: wrappers) answer ``rank()`` with the 0 their base class was made
    with, on every rank: the group each wraps, its ``parent`` once configured, knows."""
    for _ in range(8):  # (a wrapper of a wrapper...)
        try:
            parent = getattr(pg, "parent", None)
        except Exception:  # torchft's asserts before configure(): no group to ask yet
            parent = None
        if parent is None or parent is pg or not callable(getattr(parent, "rank", None)):
            break
        pg = parent
    return int(pg.rank())


def _group_size(pg: Any) -> int | None:
    """The group's size, or None where it cannot say (no size(), or not configured)."""
    size = getattr(pg, "size", None)
    if not callable(size):
        return None
    try:
        return int(size())
    except Exception:
        return None


def _check_words(words: list[int], where: str, what: str) -> None:
    if words[0] != MAGIC:
        raise CheckpointTransportError(
            f"{where} answered {words}, not an asyncckpt {what}: is it running send_checkpoint "
            "on the same group, with the same asyncckpt version?")
    if words[1] != VERSION:
        raise CheckpointTransportError(
            f"{where} speaks version {words[1]} of the asyncckpt process-group protocol, this "
            f"rank version {VERSION}: run the same asyncckpt version on every rank, then "
            "recreate the process group")


def _verify_file(manifest: Manifest, name: str, view: memoryview, step_dir: Path,
                 where: str) -> None:
    """Check the received file against every checksum of its manifest (the header's
    and each chunk's blocks), all before anything is loaded: a damaged transfer must
    leave the targets untouched (the loader, which verifies as it copies, would leave
    them a mix of two steps). The loader then loads without verifying again."""
    path = step_dir / name
    entry = manifest.files[name]
    header = view[:entry.header_bytes]
    if len(header) != entry.header_bytes or (
            xxhash.xxh3_64_hexdigest(header) != entry.header_checksum):
        raise CheckpointCorruptError(
            f"{path}: the safetensors header sent by {where} does not match the manifest's "
            f"checksum: damaged in transit; nothing was loaded: receive step "
            f"{manifest.step} again", path=str(path))
    bb = manifest.block_bytes
    span = max(1, _VERIFY_BYTES // bb)  # blocks per task
    tasks = [(key, c, b, min(b + span, len(c.checksums)))
             for key, t in manifest.tensors.items() for c in t.chunks if c.file == name
             for b in range(0, len(c.checksums), span)]

    def bad_block(task: tuple[str, Chunk, int, int]) -> int | None:
        _, c, b0, b1 = task
        lo = c.byte_range[0] + b0 * bb
        hi = min(c.byte_range[0] + b1 * bb, c.byte_range[1])
        got = block_checksums(view[lo:hi], bb)
        want = c.checksums[b0:b1]
        if tuple(got) == want:
            return None
        return b0 + next((i for i, (x, y) in enumerate(zip(got, want, strict=False))
                          if x != y), min(len(got), len(want)))

    total = sum(c.nbytes for t in manifest.tensors.values() for c in t.chunks if c.file == name)
    threads = min(2, os.cpu_count() or 1, len(tasks))  # as many as the loader reads with
    if threads > 1 and total >= _VERIFY_BYTES:
        with cf.ThreadPoolExecutor(threads, thread_name_prefix="asyncckpt-pg-verify") as pool:
            found = list(pool.map(bad_block, tasks))
    else:
        found = [bad_block(task) for task in tasks]
    for (key, c, _, _), bad in zip(tasks, found, strict=True):
        if bad is not None:
            lo = c.byte_range[0] + bad * bb  # (the block's bytes, end exclusive, as a load's)
            hi = max(lo, min(lo + bb, c.byte_range[1]))
            raise CheckpointCorruptError(
                f"{path}: checksum mismatch in tensor {key!r} (block {bad}, bytes "
                f"{lo}..{hi}) of step {manifest.step} sent by {where}: "
                "damaged in transit, or changed by the sender while it sent it (its "
                "tensors must stay as they are until send_checkpoint returns: "
                f"{uncopied_hint()}); nothing was loaded: receive it again (retry the "
                "transfer)", path=str(path), key=key)


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


def _segments(pieces: Sequence[tuple[int, int]]) -> list[_Segment]:
    """Cut the file into messages, the same on both sides (the sender from its plan, the
    receiver from the manifest). ``pieces`` tile the file: its header, then each
    non-empty tensor. A run of adjacent pieces below GATHER_BYTES goes as one message of
    at most GATHER_BYTES (gathered by the sender: one message per small tensor costs far
    more than the copy); a larger piece goes alone, in slices of at most SLICE_BYTES."""
    segs: list[_Segment] = []
    run = -1  # the first piece of the run being gathered
    for i, (lo, hi) in enumerate(pieces):
        big = hi - lo >= GATHER_BYTES
        if run >= 0 and (big or hi - pieces[run][0] > GATHER_BYTES):
            segs.append((pieces[run][0], lo, run, i))
            run = -1
        if big:
            segs.extend((a, min(a + SLICE_BYTES, hi), i, i + 1)
                        for a in range(lo, hi, SLICE_BYTES))
        elif run < 0:
            run = i
    if run >= 0:
        segs.append((pieces[run][0], pieces[-1][1], run, len(pieces)))
    return segs


def _batches(segments: Sequence[_Segment]) -> list[tuple[int, int]]:
    """The segments ``first..stop-1`` that each control word announces: batches of at
    most CONTROL_BYTES (a segment is at most SLICE_BYTES <= CONTROL_BYTES), so a send
    that is cut off reads at most that much more."""
    out: list[tuple[int, int]] = []
    first = acc = 0
    for i, (lo, hi, _, _) in enumerate(segments):
        if acc and acc + (hi - lo) > CONTROL_BYTES:
            out.append((first, i))
            first, acc = i, 0
        acc += hi - lo
    if first < len(segments):
        out.append((first, len(segments)))
    return out


def _send_pieces(source: LiveSource
                 ) -> tuple[list[tuple[int, int]], Callable[[int], memoryview]]:
    """The file's pieces (its header, then each non-empty tensor in file order; none for
    a state without tensors) and the bytes of piece ``i``: the tensor's own memory, the
    bytes that were checksummed (no copy for contiguous CPU tensors)."""
    plan = source.plan
    if not plan.items:
        return [], lambda i: memoryview(b"")
    header = memoryview(bytearray(plan.header))  # writable: torch.frombuffer wants it so
    items = [it for it in plan.items if it.nbytes]
    pieces = [(0, len(header))] + [(it.offset, it.end) for it in items]

    def view(i: int) -> memoryview:
        return header if i == 0 else source.tensor_view(items[i - 1].key)

    return pieces, view


def _segment_tensor(seg: _Segment, pieces: list[tuple[int, int]],
                    view: Callable[[int], memoryview]) -> torch.Tensor:
    """One segment's bytes: a slice of one piece's own memory, or a run of small pieces
    gathered into a new buffer."""
    lo, hi, first, stop = seg
    views = [view(j) for j in range(first, stop)]
    for j, v in zip(range(first, stop), views, strict=True):
        if len(v) != pieces[j][1] - pieces[j][0]:
            raise AssertionError(f"piece {j}: {len(v)} bytes, planned "
                                 f"{pieces[j][1] - pieces[j][0]}")
    if stop - first == 1:
        base = pieces[first][0]
        return torch.frombuffer(views[0][lo - base:hi - base], dtype=torch.uint8)
    buf = bytearray(hi - lo)
    for j, v in zip(range(first, stop), views, strict=True):
        buf[pieces[j][0] - lo:pieces[j][1] - lo] = v
    return torch.frombuffer(buf, dtype=torch.uint8)


def _recv_pieces(manifest: Manifest, flen: int, where: str
                 ) -> tuple[str | None, list[tuple[int, int]]]:
    """The file's name and its pieces (header, then each non-empty tensor), which must
    tile it exactly."""
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
    pieces = [(0, body)]
    pos = body
    for lo, hi in ranges:
        if lo != pos:
            raise bad(f"has a gap or overlap at byte {pos} of {name}")
        pieces.append((lo, hi))
        pos = hi
    if pos != flen:
        raise bad(f"leaves bytes {pos}..{flen} of {name} undescribed")
    return name, pieces


class _MemoryStorage:
    """ReadStorage over a received manifest and file held in memory. Thread-safe."""

    peer_view = True
    """A peer sends the boxes it holds: a manifest marked partial is read as such."""

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
