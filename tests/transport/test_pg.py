"""PGTransport beyond the shared contract: the wire protocol's defences, zero-copy
sends, timeouts, and real gloo ranks (several destinations, a silent peer, a dying one).

Most tests run two "ranks" as threads of this process over a fake process group (a
mailbox with the ``send``/``recv``/``rank`` methods of a ProcessGroup), which lets them
forge or damage any message. The ``gloo_*`` tests start real gloo ranks on 127.0.0.1:
this file is also their rank program (``python test_pg.py SPEC``).
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import logging
import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncckpt.transport.pg as pgmod
from asyncckpt.errors import (
    CheckpointClosedError,
    CheckpointConfigError,
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    CheckpointTransportError,
    UnsupportedLeafError,
)
from asyncckpt.transport import PGTransport
from asyncckpt.transport.pg import MAGIC, OFFER, REQUEST, VERSION

HARD_TIMEOUT_S = 40.0
MiB = 1 << 20  # GATHER_BYTES: runs of smaller pieces are gathered into one message


# --- a fake process group --------------------------------------------------------------------

class Wire:
    """The mailboxes between fake ranks, a log of what was sent, and a tamper hook."""

    def __init__(self, tamper: Callable[[int, torch.Tensor], None] | None = None):
        self.boxes: dict[tuple[int, int], queue.Queue[torch.Tensor]] = defaultdict(queue.Queue)
        self.lock = threading.Lock()
        self.sent: list[tuple[int, int, int, int]] = []  # (src, dst, nbytes, data_ptr)
        self.tamper = tamper

    def box(self, src: int, dst: int) -> queue.Queue[torch.Tensor]:
        with self.lock:
            return self.boxes[(src, dst)]


class _Work:
    """A work that cannot be polled (as some of torchft's): only ``wait`` tells."""

    def __init__(self, fn: Callable[[float], None]):
        self.fn = fn

    def wait(self, timeout: datetime.timedelta) -> bool:
        self.fn(timeout.total_seconds())
        return True


class _PolledWork(_Work):
    """A posted receive: ``is_completed()`` once a message waits in its mailbox (then
    ``wait`` takes it at once), as gloo's works say."""

    def __init__(self, fn: Callable[[float], None], box: queue.Queue[torch.Tensor]):
        super().__init__(fn)
        self.box = box

    def is_completed(self) -> bool:
        return not self.box.empty()


class FakeGroup:
    """A process group over a Wire: messages are copied, sizes must match (as in gloo).
    Its posted receives can be polled (``is_completed``)."""

    def __init__(self, wire: Wire, rank: int, size: int = 2):
        self.wire, self._rank, self._size = wire, rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> _Work:
        (t,) = tensors
        assert t.is_contiguous()
        with self.wire.lock:
            index = len(self.wire.sent)
            self.wire.sent.append((self._rank, dst, t.numel() * t.element_size(), t.data_ptr()))
        copy = t.clone()
        if self.wire.tamper is not None:
            self.wire.tamper(index, copy)
        self.wire.box(self._rank, dst).put(copy)
        return _Work(lambda timeout: None)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> _Work:
        (t,) = tensors

        def wait(timeout: float) -> None:
            try:
                got = self.wire.box(src, self._rank).get(timeout=timeout)
            except queue.Empty:
                raise RuntimeError(f"Timed out waiting {timeout * 1000:.0f}ms for recv "
                                   "operation to complete") from None
            if got.numel() * got.element_size() != t.numel() * t.element_size():
                raise RuntimeError(f"size mismatch: sent {got.numel()}, posted {t.numel()}")
            t.copy_(got.view(t.dtype).reshape(t.shape))
        return _PolledWork(wait, self.wire.box(src, self._rank))


class UnpolledGroup(FakeGroup):
    """A FakeGroup whose works have no ``is_completed`` (as some of torchft's groups)."""

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> _Work:
        return _Work(super().recv(tensors, src, tag).fn)


def pair(wire: Wire | None = None, **kw: Any) -> tuple[PGTransport, PGTransport, Wire]:
    wire = wire or Wire()
    return (PGTransport(FakeGroup(wire, 0), 10.0, **kw),
            PGTransport(FakeGroup(wire, 1), 10.0, **kw), wire)


class Background:
    """Run ``fn`` on a thread; ``result()`` re-raises its error."""

    def __init__(self, fn: Callable[..., Any], *args: Any, **kw: Any):
        self.value: Any = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                self.value = fn(*args, **kw)
            except BaseException as exc:
                self.error = exc

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def result(self, timeout: float = 20.0) -> Any:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "still running"
        if self.error is not None:
            raise self.error
        return self.value


def small_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.arange(5, dtype=torch.int32),
            "h": torch.randn(3, 3, generator=g).to(torch.bfloat16), "n": 4}


def same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert list(a) == list(b)
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
            assert torch.equal(a[k].view(-1).view(torch.uint8) if a[k].numel() else a[k],
                               b[k].view(-1).view(torch.uint8) if b[k].numel() else b[k]), k
        else:
            assert a[k] == b[k] and type(a[k]) is type(b[k]), k


# --- round trips over the fake group ---------------------------------------------------------

def test_round_trip_sends_large_tensors_from_their_own_memory() -> None:
    a, b, wire = pair()
    state = {**small_state(), "big": torch.randn(MiB // 4 + 1)}
    sender = Background(a.send_checkpoint, [1], 5, state, 10.0)
    got = b.recv_checkpoint(0, a.metadata(), 5, 10.0)
    sender.result()
    same(got, state)
    # file order: w, b, big (4-byte elements), h. Messages of rank 0: offer, manifest, a
    # control word, then [header + w + b] gathered, big from its own memory, h alone (from
    # the copy the offer made of it: a small tensor), DONE
    ours = [(n, ptr) for src, _, n, ptr in wire.sent if src == 0]
    assert [n for n, _ in ours[3:]][1:] == [state["big"].numel() * 4, 18, 64], ours
    assert ours[4][1] == state["big"].data_ptr() and ours[5][1] != state["h"].data_ptr()
    assert a.metadata() == "pg:0" and b.metadata() == "pg:1"


def test_another_ranks_metadata_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    a, b, _ = pair()
    state = {"w": torch.arange(4.0)}
    sender = Background(a.send_checkpoint, [1], 2, state, 10.0)
    with caplog.at_level("INFO", logger="asyncckpt.transport.pg"):
        got = b.recv_checkpoint(0, "pg:3", 2, 10.0)  # (rank 3's, or a group configured since)
    sender.result()
    same(got, state)  # received all the same
    assert "receiving from rank 0 with metadata 'pg:3', which rank 3 gave" in caplog.text


def test_many_small_tensors_go_in_few_messages() -> None:
    a, b, wire = pair()
    state = {f"t{i}": torch.full((4,), float(i)) for i in range(3000)}
    sender = Background(a.send_checkpoint, [1], 2, state, 10.0)
    got = b.recv_checkpoint(0, "pg:0", 2, 10.0)
    sender.result()
    same(got, state)
    sizes = [n for src, _, n, _ in wire.sent if src == 0]
    assert len(sizes) <= 7, sizes  # offer, manifest, control word, the file in <= 3 runs, DONE
    assert max(sizes) <= MiB


def test_segments_gather_small_pieces_and_slice_large_ones(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pgmod, "GATHER_BYTES", 100)
    monkeypatch.setattr(pgmod, "SLICE_BYTES", 250)
    monkeypatch.setattr(pgmod, "CONTROL_BYTES", 300)
    sizes = [40, 30, 30, 20, 600, 10, 99, 100, 5]
    pieces, pos = [], 0
    for n in sizes:
        pieces.append((pos, pos + n))
        pos += n
    segs = pgmod._segments(pieces)
    # runs of up to 100 bytes; 600 and 100 bytes go alone, 600 in slices of 250
    assert [(lo, hi) for lo, hi, _, _ in segs] == [
        (0, 100), (100, 120), (120, 370), (370, 620), (620, 720), (720, 730), (730, 829),
        (829, 929), (929, 934)]
    assert [(f, s) for _, _, f, s in segs] == [
        (0, 3), (3, 4), (4, 5), (4, 5), (4, 5), (5, 6), (6, 7), (7, 8), (8, 9)]
    # a batch holds at most 300 bytes (a 250-byte slice goes alone after 120 bytes)
    assert pgmod._batches(segs) == [(0, 2), (2, 3), (3, 4), (4, 7), (7, 9)]
    assert pgmod._segments([]) == [] and pgmod._batches([]) == []


def test_into_loads_in_place_and_odd_tensors_survive() -> None:
    a, b, _ = pair()
    g = torch.Generator().manual_seed(1)
    state = {"t": torch.randn(4, 6, generator=g).t(), "e": torch.empty(0, 3),
             "z": torch.tensor(2.5, dtype=torch.float64), "c": torch.randn(3, 2, generator=g)[:, 1],
             "neg": torch.randn(4, generator=g, dtype=torch.complex64).conj(), 7: "seven"}
    target = {"t": torch.zeros(6, 4), "e": torch.zeros(0, 3),
              "z": torch.tensor(0.0, dtype=torch.float64), "c": torch.zeros(3),
              "neg": torch.zeros(4, dtype=torch.complex64), 7: ""}
    before = {k: v for k, v in target.items() if isinstance(v, torch.Tensor)}
    sender = Background(a.send_checkpoint, [1], 3, state, 10.0)
    out = b.recv_checkpoint(0, "pg:0", 3, 10.0, into=target)
    sender.result()
    assert out is target
    for k, t in before.items():
        assert target[k] is t, k
        assert torch.equal(t, state[k].resolve_conj()), k
    assert target[7] == "seven"


def test_the_received_manifest_is_parsed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # (a manifest of thousands of tensors takes a while to parse: the loader is handed
    # the one the receive already parsed and checked)
    import asyncckpt.reader as readermod

    parsed: list[str] = []
    real = pgmod.parse_manifest

    def counting(raw: bytes, where: str) -> Any:
        parsed.append(where)
        return real(raw, where)

    monkeypatch.setattr(pgmod, "parse_manifest", counting)
    monkeypatch.setattr(readermod, "parse_manifest", counting)
    a, b, _ = pair()
    state = small_state()
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v
              for k, v in state.items()}
    sender = Background(a.send_checkpoint, [1], 4, state, 10.0)
    out = b.recv_checkpoint(0, "pg:0", 4, 10.0, into=target)
    sender.result()
    same(out, state)
    assert len(parsed) == 1, parsed


def test_empty_states() -> None:
    for state in ({}, {"e": torch.empty(0), "s": 1}, {"nothing": None}):
        a, b, _ = pair()
        sender = Background(a.send_checkpoint, [1], 1, state, 10.0)
        got = b.recv_checkpoint(0, "pg:0", 1, 10.0)
        sender.result()
        assert list(got) == list(state)


def test_several_destinations_in_turn() -> None:
    wire = Wire()
    trs = [PGTransport(FakeGroup(wire, r, 3), 10.0) for r in range(3)]
    state = small_state()
    sender = Background(trs[0].send_checkpoint, [2, 1], 8, state, 10.0)
    recv1 = Background(trs[1].recv_checkpoint, 0, "pg:0", 8, 10.0)
    got2 = trs[2].recv_checkpoint(0, "pg:0", 8, 10.0)
    sender.result()
    same(got2, state)
    same(recv1.result(), state)


def test_wrong_step_is_refused_without_sending_the_state() -> None:
    a, b, wire = pair()
    sender = Background(a.send_checkpoint, [1], 5, small_state(), 10.0)
    with pytest.raises(CheckpointNotFoundError, match=r"sends step 5, not step 6"):
        b.recv_checkpoint(0, "pg:0", 6, 10.0)
    sender.result()  # the sender is not at fault: it returns normally
    assert [(src, n) for src, _, n, _ in wire.sent] == [(1, 64), (0, 64)]  # request, refusal


# --- defences against a broken or hostile peer -----------------------------------------------

def forge(wire: Wire, *messages: torch.Tensor) -> None:
    """Play rank 0 by hand: take the request, then send ``messages``."""
    req = wire.box(1, 0).get(timeout=10)
    assert req.tolist()[:3] == [MAGIC, VERSION, REQUEST]
    for m in messages:
        wire.box(0, 1).put(m)


def words(*w: int) -> torch.Tensor:
    return torch.tensor([*w] + [0] * (8 - len(w)), dtype=torch.int64)


def real_offer(step: int = 5) -> tuple[bytes, list[torch.Tensor]]:
    """What a real sender sends for small_state(): the manifest and the file's messages."""
    captured: list[torch.Tensor] = []
    wire = Wire(tamper=lambda i, t: captured.append(t))
    a, b, _ = pair(wire)
    sender = Background(a.send_checkpoint, [1], step, small_state(), 10.0)
    b.recv_checkpoint(0, "pg:0", step, 10.0)
    sender.result()
    ours = [t for (src, *_), t in zip(wire.sent, captured, strict=True) if src == 0]
    return bytes(ours[1].numpy()), ours[2:]  # (control words, then the file's segments)


@pytest.mark.parametrize("limit", ["manifest", "file"])
def test_announced_sizes_above_the_limits_are_refused_before_allocating(
        limit: str, monkeypatch: pytest.MonkeyPatch) -> None:
    wire = Wire()
    b = PGTransport(FakeGroup(wire, 1), 10.0, max_manifest_bytes=1 << 20,
                    max_file_bytes=1 << 30)
    huge = 1 << 50
    offer = (words(MAGIC, VERSION, OFFER, 5, huge, 100, 2) if limit == "manifest"
             else words(MAGIC, VERSION, OFFER, 5, 100, huge, 2))
    big: list[int] = []
    real_empty = torch.empty

    def watch_empty(*size: Any, **kw: Any) -> torch.Tensor:
        n = size[0] if size and isinstance(size[0], int) else 0
        big.append(n)
        return real_empty(*size, **kw)

    monkeypatch.setattr(torch, "empty", watch_empty)
    forger = Background(forge, wire, offer)
    with pytest.raises(CheckpointTransportError, match="refused before allocating"):
        b.recv_checkpoint(0, "pg:0", 5, 10.0)
    forger.result()
    assert all(n < (1 << 20) for n in big), big


def test_garbage_instead_of_an_offer() -> None:
    wire = Wire()
    b = PGTransport(FakeGroup(wire, 1), 10.0)
    forger = Background(forge, wire, words(1234, 5, 6, 7))
    with pytest.raises(CheckpointTransportError, match="not an asyncckpt offer"):
        b.recv_checkpoint(0, "pg:0", 5, 10.0)
    forger.result()


def test_an_offer_of_another_step_is_a_protocol_error() -> None:
    wire = Wire()
    b = PGTransport(FakeGroup(wire, 1), 10.0)
    forger = Background(forge, wire, words(MAGIC, VERSION, OFFER, 9, 10, 10, 1))
    with pytest.raises(CheckpointTransportError, match="broke the protocol"):
        b.recv_checkpoint(0, "pg:0", 5, 10.0)
    forger.result()


def test_a_manifest_that_is_not_json() -> None:
    wire = Wire()
    b = PGTransport(FakeGroup(wire, 1), 10.0)
    junk = torch.frombuffer(bytearray(b"{not json" * 3), dtype=torch.uint8)
    forger = Background(forge, wire, words(MAGIC, VERSION, OFFER, 5, junk.numel(), 0, 0), junk)
    with pytest.raises(CheckpointCorruptError, match="digest"):
        b.recv_checkpoint(0, "pg:0", 5, 10.0)
    forger.result()


@pytest.mark.parametrize("lie", ["file_bytes", "segments", "step"])
def test_an_offer_that_disagrees_with_its_manifest(lie: str) -> None:
    manifest, file_msgs = real_offer(step=5)
    segments = [t for t in file_msgs if t.dtype == torch.uint8]
    flen = sum(t.numel() for t in segments)
    m = torch.frombuffer(bytearray(manifest), dtype=torch.uint8)
    fields = {"step": 5, "flen": flen, "nseg": len(segments)}
    if lie == "file_bytes":
        fields["flen"] += 8
    elif lie == "segments":
        fields["nseg"] += 1
    else:
        forged = re.sub(rb'"step":\s*5', b'"step": 6', manifest, count=1)
        assert forged != manifest
        m = torch.frombuffer(bytearray(forged), dtype=torch.uint8)
    wire = Wire()
    b = PGTransport(FakeGroup(wire, 1), 10.0)
    offer = words(MAGIC, VERSION, OFFER, 5, m.numel(), fields["flen"], fields["nseg"])
    forger = Background(forge, wire, offer, m, *file_msgs)
    with pytest.raises(CheckpointCorruptError):
        b.recv_checkpoint(0, "pg:0", 5, 10.0)
    forger.result()


def test_a_byte_flipped_in_flight_is_caught_and_names_the_tensor() -> None:
    # messages: the request (0, of rank 1), then rank 0's offer (1), rank 1's READY (2),
    # the manifest (3), rank 1's READY (4), the control word (5) and the whole file
    # gathered (6): header, then w (8 KiB, float32, first), b, h. Flip a byte in the
    # middle of "w"
    def flip(index: int, t: torch.Tensor) -> None:
        if index == 6:
            t[t.numel() - 4096] ^= 0x10

    a, b, _ = pair(Wire(tamper=flip))
    sender = Background(a.send_checkpoint, [1], 5, small_state(), 10.0)
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch") as info:
        b.recv_checkpoint(0, "pg:0", 5, 10.0)
    sender.result()
    assert info.value.key == "w"


def test_a_silent_peer_times_out_within_the_timeout() -> None:
    _, b, _ = pair()
    t0 = time.monotonic()
    with pytest.raises(CheckpointTimeoutError, match="no answer") as info:
        b.recv_checkpoint(0, "pg:0", 5, datetime.timedelta(seconds=0.5))
    assert time.monotonic() - t0 < 3.0
    # (the receive's own timeout, not the rest of it a piece had left; a trial's 0.05 s
    # receive of 160 MB said "no answer within 0.00083s" and blamed the peer alone)
    # (and a peer killed mid-transfer, which gloo tells only at the timeout: a trial)
    assert "ran out of its timeout of 0.5s: if the peer was sending, it died (a process " \
           "killed mid-transfer is seen only at the timeout), or the timeout is too short " \
           "for this state's size" in str(info.value)
    a, _, _ = pair()
    t0 = time.monotonic()
    with pytest.raises(CheckpointTimeoutError):
        a.send_checkpoint([1], 5, small_state(), 0.5)
    assert time.monotonic() - t0 < 3.0


# --- lifecycle and configuration -------------------------------------------------------------

def test_disallow_waits_for_a_send_running_on_another_thread() -> None:
    a, b, _ = pair()
    sender = Background(a.send_checkpoint, [1], 5, small_state(), 10.0)
    time.sleep(0.2)  # the sender now waits for the request
    disallow = Background(a.disallow_checkpoint)
    time.sleep(0.3)
    assert disallow.thread.is_alive(), "disallow returned while the state was being sent"
    b.recv_checkpoint(0, "pg:0", 5, 10.0)
    sender.result()
    disallow.result()
    a.disallow_checkpoint()  # nothing running: returns at once


def test_disallow_cuts_off_a_send_that_outlasts_its_grace_time() -> None:
    wire = Wire()
    a = PGTransport(FakeGroup(wire, 0), 0.5)  # disallow's grace time
    b = PGTransport(FakeGroup(wire, 1), 10.0)
    state = small_state()
    sender = Background(a.send_checkpoint, [1], 5, state, 10.0)
    time.sleep(0.2)  # the sender now waits for the request
    t0 = time.monotonic()
    a.disallow_checkpoint()  # past the grace time the send is cut off; waiting for a
    assert time.monotonic() - t0 < 2.0  # request, it reads no tensor: not waited for
    assert sender.thread.is_alive()
    t0 = time.monotonic()
    receiver = Background(b.recv_checkpoint, 0, "pg:0", 5, 10.0)
    with pytest.raises(CheckpointTransportError, match="cut off by disallow_checkpoint"):
        sender.result()
    with pytest.raises(CheckpointTransportError,
                       match=r"peer rank 0 \(pg:0\) could not send step 5: the send to rank 1 "
                             "was cut off by disallow_checkpoint before its offer"):
        receiver.result()
    assert time.monotonic() - t0 < 3.0  # told at once, not at its timeout
    # the error and its text went out instead of the offer: no tensor byte did
    ours = [s for s in wire.sent if s[0] == 0]
    assert len(ours) == 2 and ours[0][2] == 64, wire.sent


def test_a_cut_in_the_middle_of_the_file_reaches_the_receiver(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pgmod, "CONTROL_BYTES", 1)  # a control word before every segment
    state = {f"t{i}": torch.randn(MiB // 4) for i in range(4)}
    wire = Wire()
    a = PGTransport(FakeGroup(wire, 0), 0.2)  # disallow's grace time
    b = PGTransport(FakeGroup(wire, 1), 10.0)

    def cut_during_segment_2(index: int, t: torch.Tensor) -> None:
        if wire.sent[index][3] == state["t1"].data_ptr():  # (t is a copy)
            Background(a.disallow_checkpoint)
            time.sleep(0.6)  # past the grace time: the cut is set before the next batch

    wire.tamper = cut_during_segment_2
    sender = Background(a.send_checkpoint, [1], 5, state, 10.0)
    t0 = time.monotonic()
    with pytest.raises(CheckpointTransportError,
                       match="could not send step 5: the send to rank 1 was cut off by "
                             "disallow_checkpoint after 3 of 5 segments"):
        b.recv_checkpoint(0, "pg:0", 5, 10.0)
    assert time.monotonic() - t0 < 5.0
    with pytest.raises(CheckpointTransportError, match="after 3 of 5 segments"):
        sender.result()
    # after the cut, no further tensor byte went out
    big = [s for s in wire.sent if s[0] == 0 and s[2] == MiB]
    assert len(big) == 2, wire.sent


def test_disallow_does_not_wait_for_a_send_that_can_read_no_tensor() -> None:
    # The state cannot be served: the send only waits to tell its receiver why. That
    # reads no tensor, so disallow_checkpoint returns after its grace time, not the
    # send's whole timeout.
    wire = Wire()
    a = PGTransport(FakeGroup(wire, 0), 0.3)  # disallow's grace time
    sender = Background(a.send_checkpoint, [1], 5, {"w": torch.ones(3), "x": _Unsupported()},
                        8.0)
    time.sleep(0.2)
    t0 = time.monotonic()
    a.disallow_checkpoint()
    assert time.monotonic() - t0 < 2.0
    b = PGTransport(FakeGroup(wire, 1), 10.0)
    with pytest.raises(CheckpointTransportError, match="could not send step 5"):
        b.recv_checkpoint(0, "pg:0", 5, 10.0)  # (and the receiver is still told)
    with pytest.raises(UnsupportedLeafError):
        sender.result()


def test_a_failing_destination_does_not_leave_the_others_unserved() -> None:
    wire = Wire()
    trs = [PGTransport(FakeGroup(wire, r, 3), 10.0) for r in range(3)]
    state = small_state()
    wire.box(1, 0).put(words(MAGIC, VERSION, 77, 5))  # rank 1 sends garbage, not a request
    sender = Background(trs[0].send_checkpoint, [1, 2], 5, state, 10.0)
    same(trs[2].recv_checkpoint(0, "pg:0", 5, 10.0), state)  # served all the same
    with pytest.raises(CheckpointTransportError, match="instead of an asyncckpt request"):
        sender.result()  # and the first failure is raised afterwards


def test_a_destination_that_never_asks_holds_up_none_of_the_others() -> None:
    wire = Wire()
    trs = [PGTransport(FakeGroup(wire, r, 3), 10.0) for r in range(3)]
    state = small_state()
    t0 = time.monotonic()
    sender = Background(trs[0].send_checkpoint, [1, 2], 5, state, 3.0)  # rank 1 never asks
    same(trs[2].recv_checkpoint(0, "pg:0", 5, 6.0), state)
    assert time.monotonic() - t0 < 1.5  # served as it asked, not after rank 1's timeout
    with pytest.raises(CheckpointTimeoutError,
                       match=r"rank 1 did not ask for step 5 within 3s: is it calling "
                             "recv_checkpoint on this group") as info:
        sender.result()  # raised once the others were served
    assert info.value.ranks == (1,)


def test_destinations_are_served_in_the_order_they_ask() -> None:
    wire = Wire()
    trs = [PGTransport(FakeGroup(wire, r, 3), 10.0) for r in range(3)]
    state = small_state()
    sender = Background(trs[0].send_checkpoint, [1, 2], 5, state, 10.0)
    same(trs[2].recv_checkpoint(0, "pg:0", 5, 5.0), state)  # rank 1 asks later
    same(trs[1].recv_checkpoint(0, "pg:0", 5, 5.0), state)
    sender.result()
    offers = [dst for src, dst, n, _ in wire.sent if src == 0 and n == 64]
    assert offers[0] == 2 and 1 in offers, wire.sent


class _InheritedWork(torch.distributed.Work):
    """As torchft's _BabyWork: a Python subclass of torch's Work that does not define
    is_completed, so it inherits a flag that nothing ever sets."""

    def __init__(self, fn: Callable[[float], None]):
        super().__init__()
        self.fn = fn

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self.fn(60.0 if timeout is None else timeout.total_seconds())
        return True


class InheritedWorkGroup(FakeGroup):
    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        return _InheritedWork(super().recv(tensors, src, tag).fn)


@pytest.mark.parametrize("group", [FakeGroup, UnpolledGroup, InheritedWorkGroup])
def test_each_destination_has_a_timeout_of_its_own_for_its_transfer(group: Any) -> None:
    # A slow link: each transfer takes ~0.8 s of the sender's 1.2 s timeout. Works that
    # cannot be polled are waited on in the order given, still each with its own budget.
    wire = Wire()
    state = {"big": torch.randn(MiB // 2)}  # its header, then one 2 MiB segment

    def slow_link(index: int, t: torch.Tensor) -> None:
        if wire.sent[index][0] == 0 and t.numel() >= MiB:
            time.sleep(0.8)

    wire.tamper = slow_link
    trs = [PGTransport(group(wire, r, 3), 10.0) for r in range(3)]
    sender = Background(trs[0].send_checkpoint, [1, 2], 5, state, 1.2)
    receivers = [Background(trs[r].recv_checkpoint, 0, "pg:0", 5, 10.0) for r in (1, 2)]
    for r in receivers:
        same(r.result(), state)
    sender.result()


def test_works_that_cannot_be_polled_are_waited_on_at_once() -> None:
    # (polling an inherited is_completed, the request would be found at the timeout only)
    assert not pgmod._can_poll(_InheritedWork(lambda t: None))
    assert not pgmod._can_poll(_Work(lambda t: None))
    assert pgmod._can_poll(_PolledWork(lambda t: None, queue.Queue()))
    wire = Wire()
    a = PGTransport(InheritedWorkGroup(wire, 0), 10.0)
    b = PGTransport(FakeGroup(wire, 1), 10.0)
    t0 = time.monotonic()
    sender = Background(a.send_checkpoint, [1], 5, small_state(), 3.0)
    same(b.recv_checkpoint(0, "pg:0", 5, 6.0), small_state())
    sender.result()
    assert time.monotonic() - t0 < 1.5


def test_a_sender_that_cannot_serve_tells_each_destination_as_it_asks() -> None:
    wire = Wire()
    trs = [PGTransport(FakeGroup(wire, r, 3), 10.0) for r in range(3)]
    t0 = time.monotonic()
    sender = Background(trs[0].send_checkpoint, [1, 2], 5, {"x": _Unsupported()}, 3.0)
    with pytest.raises(CheckpointTransportError,
                       match="could not send step 5: UnsupportedLeafError"):
        trs[2].recv_checkpoint(0, "pg:0", 5, 6.0)  # rank 1 never asks
    assert time.monotonic() - t0 < 1.5  # told at once, not after rank 1's timeout
    with pytest.raises(UnsupportedLeafError):
        sender.result()


def test_a_receiver_that_gets_no_offer_is_told_the_sender_may_be_busy() -> None:
    _, b, _ = pair()
    with pytest.raises(CheckpointTimeoutError,
                       match=r"the answer to the request for step 5 of peer rank 0 \(pg:0\): "
                             r"no answer within .*still "
                             "serving other ranks: a sender serves its destinations one at a "
                             "time, so this rank's timeout must also cover"):
        b.recv_checkpoint(0, "pg:0", 5, 0.3)


def test_a_batch_holds_at_most_control_bytes() -> None:
    # a cut-off reads at most one batch more: batches never pass CONTROL_BYTES
    sizes = [200, pgmod.CONTROL_BYTES - 300, pgmod.SLICE_BYTES, 5, pgmod.CONTROL_BYTES // 2,
             pgmod.CONTROL_BYTES // 2, 1]
    pieces, pos = [], 0
    for n in sizes:
        pieces.append((pos, pos + n))
        pos += n
    segs = pgmod._segments(pieces)
    batches = pgmod._batches(segs)
    assert [i for b in batches for i in range(*b)] == list(range(len(segs)))
    for first, stop in batches:
        assert sum(hi - lo for lo, hi, _, _ in segs[first:stop]) <= pgmod.CONTROL_BYTES


class _Unsupported:
    """A leaf asyncckpt refuses (not a tensor, number, string ...)."""


def test_a_sender_that_cannot_serve_tells_the_receiver() -> None:
    a, b, wire = pair()
    key = "k" * 5000  # the error names it: the text sent is cut to MAX_REASON_BYTES
    sender = Background(a.send_checkpoint, [1], 5, {"w": torch.ones(3), key: _Unsupported()},
                        10.0)
    t0 = time.monotonic()
    with pytest.raises(CheckpointTransportError,
                       match=r"peer rank 0 \(pg:0\) could not send step 5: "
                             "UnsupportedLeafError: .*kkkk"):
        b.recv_checkpoint(0, "pg:0", 5, 10.0)
    assert time.monotonic() - t0 < 3.0
    with pytest.raises(UnsupportedLeafError):  # the sender raises its own error
        sender.result()
    ours = [n for src, _, n, _ in wire.sent if src == 0]
    assert ours[0] == 64 and 100 < ours[1] <= pgmod.MAX_REASON_BYTES, ours
    # both sides stay in step: the next transfer works
    sender = Background(a.send_checkpoint, [1], 6, small_state(), 10.0)
    same(b.recv_checkpoint(0, "pg:0", 6, 10.0), small_state())
    sender.result()


def test_an_error_text_above_the_limit_is_refused() -> None:
    wire = Wire()
    b = PGTransport(FakeGroup(wire, 1), 10.0)
    forger = Background(forge, wire, words(MAGIC, VERSION, pgmod.ERROR, 5, 1 << 40))
    with pytest.raises(CheckpointTransportError, match="error text of 1099511627776 bytes"):
        b.recv_checkpoint(0, "pg:0", 5, 10.0)
    forger.result()


def test_a_peer_of_another_protocol_version_is_named() -> None:
    wire = Wire()
    b = PGTransport(FakeGroup(wire, 1), 10.0)
    forger = Background(forge, wire, words(MAGIC, VERSION - 1, OFFER, 5, 10, 10, 1))
    with pytest.raises(CheckpointTransportError,
                       match=f"speaks version {VERSION - 1} of the asyncckpt process-group "
                             f"protocol, this rank version {VERSION}"):
        b.recv_checkpoint(0, "pg:0", 5, 10.0)
    forger.result()
    # an older receiver's request: told with an error header (its own version check
    # fails at once), and the sender names the versions
    a = PGTransport(FakeGroup(wire, 0), 10.0)
    wire.box(1, 0).put(words(MAGIC, VERSION - 1, REQUEST, 5))
    with pytest.raises(CheckpointTransportError,
                       match=f"rank 1 asked for step 5 in version {VERSION - 1}"):
        a.send_checkpoint([1], 5, small_state(), 10.0)
    assert wire.box(0, 1).get(timeout=1).tolist()[:4] == [MAGIC, VERSION, pgmod.ERROR, 5]
    assert wire.box(0, 1).empty()


@pytest.mark.parametrize("call", [
    "send [5]", "send [-1]", "send [0]", "send [1, 1]", "send [1.0]", "send [True]", "send 1",
    "recv 5", "recv -1", "recv 0", "recv '1'"])
def test_ranks_are_checked_before_any_message(call: str) -> None:
    wire = Wire()
    a = PGTransport(FakeGroup(wire, 0), 10.0)
    side, arg = call.split(" ", 1)
    ranks = eval(arg)  # the literals above
    t0 = time.monotonic()
    with pytest.raises(CheckpointConfigError) as info:
        if side == "send":
            a.send_checkpoint(ranks, 1, small_state(), 10.0)
        else:
            a.recv_checkpoint(ranks, "pg:?", 1, 10.0)
    assert time.monotonic() - t0 < 1.0
    assert wire.sent == []
    text = str(info.value)
    assert ("dst_ranks=" if side == "send" else "src_rank=") in text, text
    if call in ("send [5]", "send [-1]", "recv 5", "recv -1"):
        assert f"rank {arg.strip('[]')} is not a rank of this group of 2 ranks (0..1)" in text
    elif call in ("send [0]", "recv 0"):
        assert "rank 0 is this rank" in text
    elif call == "send [1, 1]":
        assert "rank 1 is named twice" in text


def test_disallow_then_send_again_and_shutdown_refuses() -> None:
    a, b, _ = pair()
    a.disallow_checkpoint()
    for step in (1, 2):
        sender = Background(a.send_checkpoint, [1], step, small_state(), 10.0)
        same(b.recv_checkpoint(0, "pg:0", step, 10.0), small_state())
        sender.result()
        a.disallow_checkpoint()
    a.shutdown()
    b.shutdown()
    with pytest.raises(CheckpointClosedError):
        a.send_checkpoint([1], 3, small_state(), 1.0)
    with pytest.raises(CheckpointClosedError):
        b.recv_checkpoint(0, "pg:0", 3, 1.0)


def test_shutdown_cuts_off_the_sends_in_progress_and_waiting() -> None:
    """A send waiting for its request, and one queued behind it, are cut off by
    shutdown(): their receivers are told at once, and neither reads a tensor after."""
    a, b, _ = pair()
    state = small_state()
    first = Background(a.send_checkpoint, [1], 5, state, 10.0)
    time.sleep(0.2)  # waiting for the request
    queued = Background(a.send_checkpoint, [1], 6, state, 10.0)  # waits for the first
    time.sleep(0.2)
    a.shutdown()
    for step, sender in ((5, first), (6, queued)):
        with pytest.raises(CheckpointTransportError,
                           match=f"could not send step {step}: .* cut off by shutdown"):
            b.recv_checkpoint(0, "pg:0", step, 10.0)
        with pytest.raises(CheckpointTransportError, match="cut off by shutdown"):
            sender.result()
    with pytest.raises(CheckpointClosedError):
        a.send_checkpoint([1], 7, state, 1.0)


@pytest.mark.parametrize("timeout", [0, -5.0, datetime.timedelta(0)])
def test_a_timeout_that_is_not_positive_is_refused(timeout: Any) -> None:
    wire = Wire()
    with pytest.raises(CheckpointConfigError, match="positive"):
        PGTransport(FakeGroup(wire, 0), timeout)
    with pytest.raises(CheckpointConfigError, match="positive"):
        PGTransport(FakeGroup(wire, 0), 1.0).send_checkpoint([1], 1, {}, timeout)
    with pytest.raises(CheckpointConfigError, match="positive"):
        PGTransport(FakeGroup(wire, 1), 1.0).recv_checkpoint(0, "pg:0", 1, timeout)
    assert wire.sent == []


def test_max_manifest_bytes_is_at_most_what_a_load_reads() -> None:
    from asyncckpt.manifest import MAX_MANIFEST_BYTES

    tr = PGTransport(FakeGroup(Wire(), 0), 1.0, max_manifest_bytes=(1 << 63) - 1)
    assert tr.max_manifest_bytes == MAX_MANIFEST_BYTES  # asked of the sender: refused there


def test_configuration_errors() -> None:
    wire = Wire()
    with pytest.raises(CheckpointConfigError, match="no send"):
        PGTransport(object(), 1.0)
    with pytest.raises(CheckpointConfigError, match="rank 0 is this rank"):
        PGTransport(FakeGroup(wire, 0), 1.0).send_checkpoint([1, 0], 1, {}, 1.0)
    with pytest.raises(CheckpointConfigError):
        PGTransport(FakeGroup(wire, 0), 1.0, device="meta")
    with pytest.raises(CheckpointConfigError, match=r"state_dict=.*callable"):
        PGTransport(FakeGroup(wire, 0), 1.0, state_dict={"w": torch.ones(1)})
    for name in ("strict", "ignore_unexpected"):  # checked before any message
        with pytest.raises(CheckpointConfigError, match=f"^{name}='no'"):
            PGTransport(FakeGroup(wire, 1), 1.0).recv_checkpoint(0, "", 1, **{name: "no"})
    # an HTTP peer's metadata handed to a PGTransport (a trial's): refused, before any message
    with pytest.raises(CheckpointConfigError, match=r"metadata='http://h:1/v1' is an HTTP "
                                                    r"peer's address, and this is a PGTransport"):
        PGTransport(FakeGroup(wire, 1), 1.0).recv_checkpoint(0, "http://h:1/v1", 1)
    assert not wire.sent
    if not torch.cuda.is_available():
        with pytest.raises(CheckpointConfigError, match="CUDA is not available"):
            PGTransport(FakeGroup(wire, 0), 1.0, device="cuda")
    assert PGTransport(FakeGroup(wire, 0), 1.0).device == torch.device("cpu")


def test_the_default_group_is_used_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a default group is already set up in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with caplog.at_level("WARNING", logger="asyncckpt.transport.pg"):
            assert PGTransport(None, 1.0).pg is dist.group.WORLD
            PGTransport(dist.group.WORLD, 1.0)
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len(warnings) == 2, warnings  # once per transport
        assert "default process group" in warnings[0], warnings
        assert 'dist.new_group(backend="gloo")' in warnings[0], warnings
        assert "only from the training thread" in warnings[0], warnings
        caplog.clear()
        with caplog.at_level("WARNING", logger="asyncckpt.transport.pg"):
            PGTransport(dist.new_group(backend="gloo"), 1.0)  # a group of its own
        assert not caplog.records, caplog.text
    finally:
        dist.destroy_process_group()


class _Unconfigured(FakeGroup):
    """Like torchft's groups before their first configure(): rank() fails."""

    def rank(self) -> int:
        raise RuntimeError("not configured")

    def getBackendName(self) -> str:  # the name of the ProcessGroup method
        return "torchft-baby-nccl"


def test_metadata_and_backend_of_a_group_torch_does_not_know() -> None:
    wire = Wire()
    if torch.cuda.is_available():
        assert PGTransport(_Unconfigured(wire, 0), 1.0).device.type == "cuda"
    else:
        with pytest.raises(CheckpointConfigError, match="CUDA is not available"):
            PGTransport(_Unconfigured(wire, 0), 1.0)  # an NCCL group needs the GPU
    tr = PGTransport(_Unconfigured(wire, 0), 1.0, device="cpu")
    assert tr.metadata() == "pg:?"


class _TorchftWrapper:
    """As torchft's ProcessGroupWrapper (its ProcessGroupGloo/NCCL): rank() is the 0 its
    base class was made with, on every rank; the group it wraps, ``parent``, knows (and
    asserts until configure() made it); messages go through the wrapped group."""

    def __init__(self, inner: FakeGroup | None):
        self._pg = inner

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return self.parent.size()

    @property
    def parent(self) -> FakeGroup:
        assert self._pg is not None, "process group not initialized"
        return self._pg

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        return self.parent.send(tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        return self.parent.recv(tensors, src, tag)


@pytest.mark.parametrize("src", [0, 1])
def test_a_torchft_group_whose_rank_says_0_everywhere_recovers_both_ways(src: int) -> None:
    # Its rank() made every rank "rank 0": a recovery to or from rank 0 was refused as
    # "rank 0 is this rank" (found running torchft 0.2.0's Manager with this transport).
    wire = Wire()
    groups = [_TorchftWrapper(FakeGroup(wire, r)) for r in (0, 1)]
    tr = [PGTransport(g, 10.0, device="cpu") for g in groups]
    assert [t.metadata() for t in tr] == ["pg:0", "pg:1"]
    dst = 1 - src
    sender = Background(tr[src].send_checkpoint, [dst], 3, small_state(), 10.0)
    got = tr[dst].recv_checkpoint(src, tr[src].metadata(), 3, 10.0)
    sender.result()
    same(got, small_state())
    with pytest.raises(CheckpointConfigError, match=f"rank {dst} is this rank"):
        tr[dst].recv_checkpoint(dst, "", 3, 1.0)
    assert PGTransport(_TorchftWrapper(None), 1.0, device="cpu").metadata() == "pg:0"


def test_exported() -> None:
    import asyncckpt.transport as t

    assert {"PGTransport", "HTTPTransport", "CheckpointTransport"} <= set(t.__all__)
    assert issubclass(t.PGTransport, t.CheckpointTransport)


def test_a_file_above_max_file_bytes_is_refused() -> None:
    wire = Wire()
    a = PGTransport(FakeGroup(wire, 0), 10.0)
    b = PGTransport(FakeGroup(wire, 1), 10.0, max_file_bytes=4096)
    sender = Background(a.send_checkpoint, [1], 5, small_state(), 2.0)
    with pytest.raises(CheckpointTransportError, match=r"could not send step 5: .*rank 1 takes "
                       r"at most \d+ and 4096 .*max_file_bytes="):
        b.recv_checkpoint(0, "pg:0", 5, 10.0)
    # The sender is told in the request, so it sends nothing the receiver would refuse (on
    # a real group, that wait ran out its timeout).
    with pytest.raises(CheckpointTransportError, match=r"not sent to rank 1: .*4096"):
        sender.result()
    assert wire.box(0, 1).empty()


def test_a_receiver_that_states_no_limits_still_refuses_a_file_over_its_own() -> None:
    """A receiver that sends zeros where the limits go: the sender offers, the receiver
    refuses by itself, and tells the sender (which sends nothing more)."""
    wire = Wire()
    a = PGTransport(FakeGroup(wire, 0), 10.0)
    b = PGTransport(FakeGroup(wire, 1), 10.0, max_file_bytes=4096)
    request = b._send_words
    b._send_words = lambda peer, words, *rest: request(  # type: ignore[method-assign]
        peer, [*words[:4], 0, 0, 0, 0] if words[2] == REQUEST else words, *rest)
    sender = Background(a.send_checkpoint, [1], 5, small_state(), 2.0)
    with pytest.raises(CheckpointTransportError, match=r"announced a shard file of \d+ bytes "
                       r"\(limit 4096"):
        b.recv_checkpoint(0, "pg:0", 5, 10.0)
    with pytest.raises(CheckpointTransportError,
                       match=r"rank 1 refused step 5 after the offer: .*limit 4096"):
        sender.result()
    assert [n for src, _, n, _ in wire.sent if src == 0] == [64]  # the offer, nothing more


# --- a receive that fails leaves the targets as they were; the sender is told -------------

def test_a_damaged_transfer_leaves_the_in_place_targets_untouched() -> None:
    new = {"a": torch.full((MiB // 4,), 2.0), "b": torch.full((MiB // 4,), 2.0)}  # step 6
    target = {"a": torch.full((MiB // 4,), 1.0), "b": torch.full((MiB // 4,), 1.0)}  # step 5
    before = dict(target)

    def damage_b(index: int, t: torch.Tensor) -> None:
        if wire.sent[index][3] == new["b"].data_ptr():  # b goes from its own memory
            t[100] ^= 1

    wire = Wire(tamper=damage_b)
    a, b, _ = pair(wire)
    sender = Background(a.send_checkpoint, [1], 6, new, 10.0)
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch in tensor 'b'") as info:
        b.recv_checkpoint(0, "pg:0", 6, 10.0, into=target)
    sender.result()
    assert info.value.key == "b"
    text = str(info.value)
    assert "damaged in transit" in text and "again" in text and "earlier step" not in text
    # (the block's bytes with their end: a trial's read "bytes 1052700..")
    assert re.search(r"\(block 0, bytes (\d+)\.\.(\d+)\)", text), text
    # not a mix of two steps: "a" (sent before b) and "b" keep step 5's values
    for k, t in target.items():
        assert t is before[k] and bool((t == 1.0).all()), (k, t.unique())


def test_a_tensor_changed_while_it_is_sent_is_told_at_both_ends(
        caplog: pytest.LogCaptureFixture) -> None:
    """(stop 48's trial) A large buffer a forward pass updates while send_checkpoint sends
    it: the receiver's error said "damaged in transit" alone, and the sender said nothing."""
    state = {"w": torch.ones(8), "queue": torch.zeros(MiB // 4)}  # (past what is copied)

    def forward_pass(index: int, t: torch.Tensor) -> None:
        if wire.sent[index][0] == 0 and index == 1:  # the sender's manifest: hashed already
            state["queue"].add_(1.0)

    wire = Wire(tamper=forward_pass)
    a, b, _ = pair(wire)
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        sender = Background(a.send_checkpoint, [1], 6, state, 10.0)
        with pytest.raises(CheckpointCorruptError, match=(
                r"checksum mismatch in tensor 'queue' .*damaged in transit, or changed by the "
                r"sender while it sent it .* a forward pass that updates a buffer "
                r"send_checkpoint does not copy \(one of more than 64 KiB, or a small one "
                r"past its first 64 MiB of copies\)\? offer a copy of it in its place: "
                r"sd\['queue'\] = sd\['queue'\]\.clone\(\), where sd is the state given to "
                r"send_checkpoint\)")):
            b.recv_checkpoint(0, "pg:0", 6, 10.0)
        sender.result()
    assert "step 6: tensor(s) 'queue' changed in place while they were served" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):  # unchanged: no word
        sender = Background(a.send_checkpoint, [1], 7, state, 10.0)
        assert torch.equal(b.recv_checkpoint(0, "pg:0", 7, 10.0)["queue"], state["queue"])
        sender.result()
    assert "changed in place" not in caplog.text


def _failing_receive_buffer(monkeypatch: pytest.MonkeyPatch, min_bytes: int) -> None:
    """torch.empty of at least ``min_bytes`` on the main thread (the receiver's; the
    sender runs on another) fails as an out-of-memory allocation does."""
    real_empty = torch.empty
    main = threading.main_thread()

    def empty(*size: Any, **kw: Any) -> torch.Tensor:
        n = size[0] if size and isinstance(size[0], int) else 0
        if n >= min_bytes and threading.current_thread() is main:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: "
                               f"can't allocate memory: you tried to allocate {n} bytes")
        return real_empty(*size, **kw)

    monkeypatch.setattr(torch, "empty", empty)


def test_a_receiver_out_of_memory_tells_the_sender_and_both_stay_in_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    a, b, wire = pair()
    state = {"big": torch.ones(MiB // 2)}  # a 2 MiB file
    _failing_receive_buffer(monkeypatch, MiB)
    sender = Background(a.send_checkpoint, [1], 5, state, 10.0)
    with pytest.raises(CheckpointTransportError,
                       match=r"cannot receive step 5 from peer rank 0 \(pg:0\): allocating "
                             r"\d{7} bytes of cpu for the shard file failed"):
        b.recv_checkpoint(0, "pg:0", 5, 10.0)
    with pytest.raises(CheckpointTransportError,
                       match=r"rank 1 refused step 5 after the manifest: .*allocating"):
        sender.result()
    # the offer and the manifest went, no byte of the file
    assert next(n for src, _, n, _ in wire.sent if src == 0) == 64
    assert all(n < MiB for src, _, n, _ in wire.sent if src == 0), wire.sent
    monkeypatch.undo()
    sender = Background(a.send_checkpoint, [1], 6, state, 10.0)  # still in step
    same(b.recv_checkpoint(0, "pg:0", 6, 10.0), state)
    sender.result()


def test_a_manifest_the_receiver_rejects_is_told_to_the_sender() -> None:
    def damage_manifest(index: int, t: torch.Tensor) -> None:
        ours = [s for s, *_ in wire.sent[:index + 1]].count(0)
        if wire.sent[index][0] == 0 and ours == 2:  # rank 0's second message: the manifest
            t[t.numel() // 2] ^= 1

    wire = Wire(tamper=damage_manifest)
    a, b, _ = pair(wire)
    sender = Background(a.send_checkpoint, [1], 5, small_state(), 10.0)
    with pytest.raises(CheckpointCorruptError):
        b.recv_checkpoint(0, "pg:0", 5, 10.0)
    with pytest.raises(CheckpointTransportError,
                       match="rank 1 refused step 5 after the manifest: CheckpointCorruptError"):
        sender.result()
    assert next(n for src, _, n, _ in wire.sent if src == 0) == 64
    assert len([1 for src, *_ in wire.sent if src == 0]) == 2  # offer, manifest: no file


# --- disallow_checkpoint is bounded, and cuts between segments --------------------------------

def test_disallow_is_bounded_when_a_segment_never_goes(caplog: pytest.LogCaptureFixture) -> None:
    state = {f"t{i}": torch.randn(MiB // 4) for i in range(2)}
    wire = Wire()
    a = PGTransport(FakeGroup(wire, 0), 0.3)  # disallow's grace time
    b = PGTransport(FakeGroup(wire, 1), 10.0)
    stuck, release = threading.Event(), threading.Event()

    def stall_t0(index: int, t: torch.Tensor) -> None:
        if wire.sent[index][3] == state["t0"].data_ptr():  # its receiver takes no bytes
            stuck.set()
            release.wait(30)

    wire.tamper = stall_t0
    sender = Background(a.send_checkpoint, [1], 5, state, 20.0)
    receiver = Background(b.recv_checkpoint, 0, "pg:0", 5, 20.0)
    try:
        assert stuck.wait(10)
        disallow = Background(a.disallow_checkpoint)
        disallow.thread.join(8)  # grace 0.3 s, then at most 0.3 s for the segment
        assert not disallow.thread.is_alive(), "disallow_checkpoint waited without bound"
        disallow.result()
        assert "still reads the live tensors" in caplog.text
    finally:
        release.set()
    with pytest.raises(CheckpointTransportError, match="after 2 of 3 segments"):
        sender.result()
    with pytest.raises(CheckpointTransportError, match="after 2 of 3 segments"):
        receiver.result()


def test_a_cut_within_a_batch_reads_no_further_tensor() -> None:
    state = {f"t{i}": torch.randn(MiB // 4) for i in range(4)}  # 5 segments, one batch
    wire = Wire()
    a = PGTransport(FakeGroup(wire, 0), 0.2)  # disallow's grace time
    b = PGTransport(FakeGroup(wire, 1), 10.0)

    def cut_during_t1(index: int, t: torch.Tensor) -> None:
        if wire.sent[index][3] == state["t1"].data_ptr():
            Background(a.disallow_checkpoint)
            end = time.monotonic() + 10
            while time.monotonic() < end:  # past the grace time: the cut is set before t2
                with a._cond:
                    if any(c.is_set() for c in a._cuts):
                        return
                time.sleep(0.01)

    wire.tamper = cut_during_t1
    sender = Background(a.send_checkpoint, [1], 5, state, 10.0)
    with pytest.raises(CheckpointTransportError,
                       match="could not send step 5: the send to rank 1 was cut off by "
                             "disallow_checkpoint after 3 of 5 segments"):
        b.recv_checkpoint(0, "pg:0", 5, 10.0)
    with pytest.raises(CheckpointTransportError, match="after 3 of 5 segments"):
        sender.result()
    ptrs = {src_ptr for src, _, _, src_ptr in wire.sent if src == 0}
    assert state["t1"].data_ptr() in ptrs
    assert state["t2"].data_ptr() not in ptrs and state["t3"].data_ptr() not in ptrs


# --- arguments checked before any message ----------------------------------------------------

@pytest.mark.parametrize("kw", [{"max_file_bytes": 0}, {"max_manifest_bytes": 0},
                                {"max_file_bytes": 1 << 63}, {"max_manifest_bytes": 1 << 64},
                                {"max_file_bytes": 1.5}, {"max_file_bytes": True}])
def test_limits_that_do_not_fit_the_wire_are_refused(kw: dict[str, Any]) -> None:
    (name,) = kw
    with pytest.raises(CheckpointConfigError, match=f"{name}="):
        PGTransport(FakeGroup(Wire(), 1), 10.0, **kw)
    PGTransport(FakeGroup(Wire(), 1), 10.0, **{name: (1 << 63) - 1})


@pytest.mark.parametrize("step", [1 << 63, -1, 2.0, True, "3"])
def test_steps_that_do_not_fit_the_wire_are_refused_before_any_message(step: Any) -> None:
    wire = Wire()
    a, b = PGTransport(FakeGroup(wire, 0), 10.0), PGTransport(FakeGroup(wire, 1), 10.0)
    with pytest.raises(CheckpointConfigError, match="step="):
        a.send_checkpoint([1], step, small_state(), 1.0)
    with pytest.raises(CheckpointConfigError, match="step="):
        b.recv_checkpoint(0, "pg:0", step, 1.0)
    assert wire.sent == []


@pytest.mark.parametrize("timeout", [float("inf"), datetime.timedelta.max,
                                     datetime.timedelta(days=365_000)])
def test_an_unbounded_timeout_waits_instead_of_overflowing(timeout: Any) -> None:
    a, b, _ = pair()
    sender = Background(a.send_checkpoint, [1], (1 << 63) - 1, small_state(), timeout)
    same(b.recv_checkpoint(0, "pg:0", (1 << 63) - 1, timeout), small_state())
    sender.result()
    with pytest.raises(CheckpointConfigError, match="timeout=nan"):
        b.recv_checkpoint(0, "pg:0", 1, float("nan"))


def test_errors_name_the_step_and_the_peer() -> None:
    a, b, _ = pair()
    with a._lock, pytest.raises(  # another transfer is running
            CheckpointTimeoutError, match=r"cannot send step 5 to ranks \[1\]: another transfer"):
        a.send_checkpoint([1], 5, small_state(), 0.2)
    with b._lock, pytest.raises(CheckpointTimeoutError, match=r"cannot receive step 5 from "
                                r"peer rank 0 \(pg:0\): another transfer"):
        b.recv_checkpoint(0, "pg:0", 5, 0.2)
    # the sender's error quotes the step it was sending, not only the one asked for
    sender = Background(a.send_checkpoint, [1], 7, {"x": _Unsupported()}, 10.0)
    with pytest.raises(CheckpointTransportError,
                       match=r"could not send step 7 \(this rank asked for step 5\): "
                             "UnsupportedLeafError"):
        b.recv_checkpoint(0, "pg:0", 5, 10.0)
    with pytest.raises(UnsupportedLeafError):
        sender.result()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_state_over_a_cpu_group() -> None:
    a, b, _ = pair()
    state = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in small_state().items()}
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0
              for k, v in state.items()}
    ptrs = {k: v.data_ptr() for k, v in target.items() if isinstance(v, torch.Tensor)}
    sender = Background(a.send_checkpoint, [1], 5, state, 10.0)
    b.recv_checkpoint(0, "pg:0", 5, 10.0, into=target)
    sender.result()
    for k, p in ptrs.items():
        assert target[k].is_cuda and target[k].data_ptr() == p
        assert torch.equal(target[k], state[k])


# --- real gloo ranks -------------------------------------------------------------------------

def _import_path() -> str:
    """PYTHONPATH for the ranks: the asyncckpt under test first (a relative path in
    the caller's PYTHONPATH would not hold in the ranks' working directory)."""
    import asyncckpt

    src = str(Path(asyncckpt.__file__).resolve().parents[1])
    return os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_gloo(worker: str, world: int, run_dir: Path) -> dict[int, Any]:
    """Run ``worker`` (a function of this file) on ``world`` gloo ranks; rank -> result."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONUNBUFFERED": "1", "PYTHONPATH": _import_path()}
    procs = []
    for rank in range(world):
        spec = run_dir / f"spec_{rank}.json"
        spec.write_text(json.dumps({"rank": rank, "world": world, "port": port,
                                    "worker": worker, "out": str(run_dir)}))
        with open(run_dir / f"log_{rank}.txt", "wb") as log:
            procs.append(subprocess.Popen([sys.executable, __file__, str(spec)], stdout=log,
                                          stderr=subprocess.STDOUT, env=env,
                                          cwd=str(run_dir)))
    deadline = time.monotonic() + HARD_TIMEOUT_S
    try:
        for p in procs:
            p.wait(max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    results: dict[int, Any] = {}
    problems = []
    for rank, p in enumerate(procs):
        res = run_dir / f"result_{rank}.json"
        if res.exists():
            results[rank] = json.loads(res.read_text())
        else:
            log = (run_dir / f"log_{rank}.txt").read_text(errors="replace")[-5000:]
            problems.append(f"rank {rank} (exit {p.returncode}) left no result:\n{log}")
    assert not problems, "\n".join(problems)
    return results


def _expect(fn: Callable[[], Any], exc_type: type[BaseException]) -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        fn()
        return {"raised": None, "seconds": time.monotonic() - t0}
    except BaseException as exc:
        ok = isinstance(exc, exc_type)
        return {"raised": type(exc).__name__, "ok": ok, "message": str(exc)[:500],
                "seconds": time.monotonic() - t0,
                "trace": "" if ok else traceback.format_exc()}


def gloo_fan_out_and_silence(rank: int, tr: PGTransport, dist: Any) -> dict[str, Any]:
    """Rank 0 sends to ranks 2 and 1; then rank 2 waits for a send that never comes."""
    out: dict[str, Any] = {}
    state = small_state()
    if rank == 0:
        tr.send_checkpoint([2, 1], 4, state, datetime.timedelta(seconds=20))
    else:
        got = tr.recv_checkpoint(0, "pg:0", 4, datetime.timedelta(seconds=20))
        same(got, state)
        out["received"] = True
    if rank == 2:
        out["silence"] = _expect(
            lambda: tr.recv_checkpoint(0, "pg:0", 5, datetime.timedelta(seconds=1.5)),
            CheckpointTimeoutError)
    dist.barrier()  # on the default group: rank 0 stays alive through the silence
    return out


class _DiesAfter:
    """A group that makes this process die (as if killed) before its ``n``-th send."""

    def __init__(self, group: Any, n: int):
        self.group, self.n = group, n

    def rank(self) -> int:
        return int(self.group.rank())

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        self.n -= 1
        if self.n <= 0:
            os._exit(0)
        return self.group.send(tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        return self.group.recv(tensors, src, tag)


def gloo_sender_dies(rank: int, tr: PGTransport, dist: Any) -> dict[str, Any]:
    """Rank 0 dies after the offer and the manifest; rank 1 must fail fast, clearly."""
    state = {"big": torch.zeros(4 << 20)}
    if rank == 0:
        Path(tr.out, "result_0.json").write_text("{}")  # type: ignore[attr-defined]
        dying = PGTransport(_DiesAfter(tr.pg, 3), 20.0)
        dying.send_checkpoint([1], 4, state, 20.0)
        return {}
    return {"died": _expect(lambda: tr.recv_checkpoint(0, "pg:0", 4, 20.0),
                            CheckpointTransportError)}


def gloo_bad_ranks(rank: int, tr: PGTransport, dist: Any) -> dict[str, Any]:
    """Rank 0 names ranks that are not peers (gloo crashed on rank 5, waited out the
    group's timeout on -1); then a transfer shows that nothing was sent."""
    out: dict[str, Any] = {}
    state = small_state()
    if rank == 0:
        for case, call in [
                ("dst 5", lambda: tr.send_checkpoint([5], 1, state, 10.0)),
                ("dst -1", lambda: tr.send_checkpoint([-1], 1, state, 10.0)),
                ("dst self", lambda: tr.send_checkpoint([0], 1, state, 10.0)),
                ("dst twice", lambda: tr.send_checkpoint([1, 1], 1, state, 10.0)),
                ("src 5", lambda: tr.recv_checkpoint(5, "pg:5", 1, 10.0)),
                ("src -1", lambda: tr.recv_checkpoint(-1, "pg:-1", 1, 10.0)),
                ("src self", lambda: tr.recv_checkpoint(0, "pg:0", 1, 10.0))]:
            out[case] = _expect(call, CheckpointConfigError)
        tr.send_checkpoint([1], 2, state, 20.0)
    else:
        same(tr.recv_checkpoint(0, "pg:0", 2, 20.0), state)
        out["received"] = True
    return out


class _CutsDuring:
    """A group that starts ``disallow_checkpoint`` of ``tr`` during its ``n``-th send and
    waits until the cut is set (past the transport's grace time) before sending."""

    def __init__(self, group: Any, n: int):
        self.group, self.n = group, n
        self.tr: PGTransport | None = None

    def rank(self) -> int:
        return int(self.group.rank())

    def size(self) -> int:
        return int(self.group.size())

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        self.n -= 1
        if self.n == 0 and self.tr is not None:
            Background(self.tr.disallow_checkpoint)
            time.sleep(3 * self.tr.timeout_s)
        return self.group.send(tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        return self.group.recv(tensors, src, tag)


def gloo_failures_reach_the_receiver(rank: int, tr: PGTransport, dist: Any) -> dict[str, Any]:
    """Rank 0 cannot serve a state (an unsupported leaf), then is cut off in the middle
    of the file; rank 1's receives fail at once with rank 0's reason, not at their
    timeout, and the pair stays in step for a third transfer."""
    big = {f"t{i}": torch.full((10 << 20,), float(i)) for i in range(3)}  # 3 x 40 MiB
    if rank == 0:
        out = {"leaf": _expect(lambda: tr.send_checkpoint([1], 1, {"bad": _Unsupported()}, 20.0),
                               UnsupportedLeafError)}
        # messages: offer 1, manifest 2, control 3, header 4, t0 5: cut while t0 goes,
        # told after the first batch (at most 64 MiB: header, t0), before t1
        group = _CutsDuring(tr.pg, 5)
        cutting = PGTransport(group, 0.3)  # disallow's grace time
        group.tr = cutting
        out["cut"] = _expect(lambda: cutting.send_checkpoint([1], 2, big, 20.0),
                             CheckpointTransportError)
        tr.send_checkpoint([1], 3, small_state(), 20.0)
        return out
    out = {"leaf": _expect(lambda: tr.recv_checkpoint(0, "pg:0", 1, 20.0),
                           CheckpointTransportError),
           "cut": _expect(lambda: tr.recv_checkpoint(0, "pg:0", 2, 20.0),
                          CheckpointTransportError)}
    same(tr.recv_checkpoint(0, "pg:0", 3, 20.0), small_state())
    out["received"] = True
    return out


def gloo_a_receiver_out_of_memory(rank: int, tr: PGTransport, dist: Any) -> dict[str, Any]:
    """Rank 1 cannot allocate the file's buffer: it tells rank 0, which goes on to rank
    2 at once (it waited out its timeout on a send rank 1 never took), then serves rank
    1 again: the pair stayed in step."""
    state = {"big": torch.ones(4 << 20)}  # 16 MiB
    out: dict[str, Any] = {}
    if rank == 0:
        out["fan"] = _expect(lambda: tr.send_checkpoint([1, 2], 4, state, 20.0),
                             CheckpointTransportError)
        tr.send_checkpoint([1], 5, state, 20.0)
    elif rank == 1:
        real_empty = torch.empty

        def empty(*size: Any, **kw: Any) -> torch.Tensor:
            if size and isinstance(size[0], int) and size[0] >= 1 << 24:
                raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
            return real_empty(*size, **kw)

        torch.empty = empty  # type: ignore[assignment]
        try:
            out["oom"] = _expect(lambda: tr.recv_checkpoint(0, "pg:0", 4, 20.0),
                                 CheckpointTransportError)
        finally:
            torch.empty = real_empty
        same(tr.recv_checkpoint(0, "pg:0", 5, 20.0), state)
        out["received"] = True
    else:
        same(tr.recv_checkpoint(0, "pg:0", 4, 20.0), state)
        out["received"] = True
    dist.barrier()
    return out


def gloo_a_destination_that_never_asks(rank: int, tr: PGTransport, dist: Any
                                       ) -> dict[str, Any]:
    """Rank 0 sends to ranks 1 and 2; rank 1 never asks. Rank 2 is served as it asks
    (gloo's receives cannot be polled with is_completed: the request is seen arriving),
    and rank 0 raises the timeout naming rank 1, after serving rank 2."""
    state = small_state()
    out: dict[str, Any] = {}
    if rank == 0:
        out["send"] = _expect(lambda: tr.send_checkpoint([1, 2], 4, state, 3.0),
                              CheckpointTimeoutError)
    elif rank == 2:
        t0 = time.monotonic()
        same(tr.recv_checkpoint(0, "pg:0", 4, 20.0), state)
        out["seconds"] = time.monotonic() - t0
    dist.barrier()  # on the default group: rank 1 stays alive, silent, meanwhile
    return out


def gloo_unbounded_and_shutdown(rank: int, tr: PGTransport, dist: Any) -> dict[str, Any]:
    """An unbounded timeout on either side waits (gloo ended it at once: the longest
    wait overflowed its clock); then rank 0 shuts down while a send waits for rank 1."""
    out: dict[str, Any] = {}
    state = small_state()
    if rank == 0:
        tr.send_checkpoint([1], 3, state, datetime.timedelta.max)
        sender = threading.Thread(target=lambda: out.update(
            cut=_expect(lambda: tr.send_checkpoint([1], 4, state, 20.0),
                        CheckpointTransportError)))
        sender.start()
        time.sleep(0.5)
        tr.shutdown()
        dist.barrier()  # rank 1 asks only once shutdown() has returned
        sender.join()
    else:
        same(tr.recv_checkpoint(0, "pg:0", 3, float("inf")), state)
        out["unbounded"] = True
        dist.barrier()
        out["told"] = _expect(lambda: tr.recv_checkpoint(0, "pg:0", 4, 20.0),
                              CheckpointTransportError)
    return out


def rank_main(spec_path: str) -> None:
    import torch.distributed as dist

    spec = json.loads(Path(spec_path).read_text())
    rank = spec["rank"]
    faulthandler.dump_traceback_later(HARD_TIMEOUT_S - 5, exit=True)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank,
                            world_size=spec["world"], timeout=datetime.timedelta(seconds=30))
    tr = PGTransport(dist.new_group(backend="gloo"), 20.0)
    tr.out = spec["out"]  # type: ignore[attr-defined]
    result = globals()[spec["worker"]](rank, tr, dist)
    Path(spec["out"], f"result_{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)


def test_gloo_fan_out_and_a_silent_peer(tmp_path: Path) -> None:
    res = run_gloo("gloo_fan_out_and_silence", 3, tmp_path)
    assert res[1]["received"] and res[2]["received"]
    silence = res[2]["silence"]
    assert silence["raised"] == "CheckpointTimeoutError", silence
    assert 1.0 < silence["seconds"] < 5.0, silence


def test_gloo_a_destination_that_never_asks_holds_up_none_of_the_others(
        tmp_path: Path) -> None:
    res = run_gloo("gloo_a_destination_that_never_asks", 3, tmp_path)
    assert res[2]["seconds"] < 2.0, res  # not after rank 1's timeout of 3 s
    send = res[0]["send"]
    assert send["ok"], send
    assert "rank 1 did not ask for step 4 within 3s" in send["message"], send


def test_gloo_a_sender_that_dies_mid_transfer(tmp_path: Path) -> None:
    res = run_gloo("gloo_sender_dies", 2, tmp_path)
    died = res[1]["died"]
    assert died["raised"] == "CheckpointTransportError" and died["ok"], died
    assert died["seconds"] < 10.0, died
    assert "peer rank 0" in died["message"], died


def test_gloo_ranks_that_are_not_peers_are_refused_before_any_message(tmp_path: Path) -> None:
    res = run_gloo("gloo_bad_ranks", 2, tmp_path)
    assert res[1]["received"]
    for case, got in res[0].items():
        assert got["raised"] == "CheckpointConfigError" and got["ok"], (case, got)
        assert got["seconds"] < 1.0, (case, got)
    for case in ("dst 5", "dst -1", "src 5", "src -1"):
        rank = case.split()[1]
        assert f"rank {rank} is not a rank of this group of 2 ranks" in res[0][case]["message"]
    assert "rank 0 is this rank" in res[0]["dst self"]["message"]
    assert "rank 0 is this rank" in res[0]["src self"]["message"]
    assert "rank 1 is named twice" in res[0]["dst twice"]["message"]


def test_gloo_a_sender_that_fails_tells_the_receiver_at_once(tmp_path: Path) -> None:
    res = run_gloo("gloo_failures_reach_the_receiver", 2, tmp_path)
    sender, receiver = res[0], res[1]
    assert sender["leaf"]["ok"] and sender["cut"]["ok"], sender
    assert receiver["received"]
    leaf, cut = receiver["leaf"], receiver["cut"]
    assert leaf["ok"] and cut["ok"], receiver
    assert leaf["seconds"] < 5.0 and cut["seconds"] < 8.0, receiver  # its timeout is 20 s
    assert ("peer rank 0 (pg:0) could not send step 1: UnsupportedLeafError"
            in leaf["message"]), leaf
    assert ("could not send step 2: the send to rank 1 was cut off by disallow_checkpoint "
            "after 2 of 4 segments" in cut["message"]), cut



def test_gloo_a_receiver_that_cannot_allocate_tells_the_sender(tmp_path: Path) -> None:
    res = run_gloo("gloo_a_receiver_out_of_memory", 3, tmp_path)
    fan, oom = res[0]["fan"], res[1]["oom"]
    assert fan["ok"] and oom["ok"], res
    assert res[1]["received"] and res[2]["received"], res
    assert fan["seconds"] < 10.0, fan  # its timeout is 20 s
    assert "rank 1 refused step 4 after the manifest" in fan["message"], fan
    assert ("cannot receive step 4 from peer rank 0 (pg:0): allocating 167" in oom["message"]
            and "for the shard file failed" in oom["message"]), oom


def test_gloo_unbounded_timeouts_wait_and_shutdown_cuts_off_a_send(tmp_path: Path) -> None:
    res = run_gloo("gloo_unbounded_and_shutdown", 2, tmp_path)
    assert res[1]["unbounded"]
    for got in (res[0]["cut"], res[1]["told"]):
        assert got["raised"] == "CheckpointTransportError" and got["ok"], got
        assert "cut off by shutdown before its offer" in got["message"], got
    assert res[1]["told"]["seconds"] < 5.0, res[1]["told"]  # told, not its timeout


if __name__ == "__main__":
    rank_main(sys.argv[1])



def test_a_pair_closed_by_a_peer_that_gave_up_is_not_told_as_a_crash() -> None:
    """(a review) A destination that asked after its sender's send_checkpoint timed out
    was told gloo's "Connection closed by peer ... typically caused by a remote worker
    crashing", though the sender was alive: it had given up on this rank."""
    class _Work:
        def wait(self, timeout: Any) -> bool:
            raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1. This "
                               "is typically caused by a remote worker crashing.")

    with pytest.raises(CheckpointTransportError, match=r"the peer may be alive: one that "
                       r"timed out waiting for this rank .*closes the pair too"):
        PGTransport._wait(None, lambda: _Work(), time.monotonic() + 5,  # type: ignore[arg-type]
                          "sending the request for step 1 to peer rank 0")
    with pytest.raises(CheckpointTransportError) as info:  # (another failure: no such word)
        PGTransport._wait(None, _Broken, time.monotonic() + 5, "sending")  # type: ignore[arg-type]
    assert "the peer may be alive" not in str(info.value)


class _Broken:
    def wait(self, timeout: Any) -> bool:
        raise RuntimeError("message too long")
