"""transport.base: the manifest of a live state served to peers (``serve_state``)."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import pytest
import torch

from asyncckpt.manifest import block_checksums, parse_manifest
from asyncckpt.reader import tensor_bytes
from asyncckpt.transport import base
from asyncckpt.transport.base import partial_manifest, serve_state
from asyncckpt.tree import flatten

BLOCK = 1 << 12


def built_anew(step: int, state: Any) -> bytes:
    """The manifest of ``state`` made from scratch, as serve_state made it before it kept
    a record book: every tensor hashed here, the frame laid out again."""
    flat = flatten(state)
    plan = base._live_plan(flat.tensors)
    sums = [block_checksums(tensor_bytes(flat.tensors[it.key]), BLOCK) for it in plan.items]
    return partial_manifest(0, plan, flat, sums, step=step, block_bytes=BLOCK,
                            library_version="test").to_json()


def served(step: int, state: Any) -> bytes:
    return serve_state(step, state, block_bytes=BLOCK, library_version="test").manifest()


def test_a_state_served_again_gets_the_manifest_built_anew() -> None:
    """A live state offered again with its layout unchanged fills the last manifest's
    text: its checksums, step and non-tensor values must be this offer's, byte for byte."""
    torch.manual_seed(0)
    state: dict[str, Any] = {"model": {"w": torch.randn(3000), "b": torch.randn(7)},
                             "train": {"step": 1, "lr": 0.5, "name": "run"}}
    first = served(1, state)
    assert first == built_anew(1, state)
    assert served(2, state) == built_anew(2, state)  # the same values, another step
    with torch.no_grad():
        state["model"]["w"][1234] += 1.0  # one block of one tensor changes
    state["train"]["step"] = 2
    again = served(3, state)
    assert again == built_anew(3, state)
    old = parse_manifest(first, "first").tensors["model/w"].chunks[0].checksums
    new = parse_manifest(again, "again").tensors["model/w"].chunks[0].checksums
    assert [i for i, (a, b) in enumerate(zip(old, new, strict=True)) if a != b] == [
        1234 * 4 // BLOCK]
    assert parse_manifest(again, "again").skeleton != parse_manifest(first, "first").skeleton
    state["train"]["lr"] = {"groups": [0.1, 0.2]}  # the skeleton's shape changes
    assert served(4, state) == built_anew(4, state)
    other = serve_state(5, state, block_bytes=BLOCK * 2, library_version="test").manifest()
    assert parse_manifest(other, "other").block_bytes == BLOCK * 2  # another block size
    assert len(parse_manifest(other, "other").tensors["model/w"].chunks[0].checksums) == 2
    assert served(5, state) == built_anew(5, state)  # and back
    state["model"]["extra"] = torch.ones(5, dtype=torch.int64)  # the layout changes
    assert served(6, state) == built_anew(6, state)
    del state["model"]["extra"]
    assert served(7, state) == built_anew(7, state)


def hashing_threads(monkeypatch: pytest.MonkeyPatch, state: Any) -> tuple[bytes, set[int]]:
    """The served manifest of ``state``, and the threads that hashed its tensors."""
    seen: set[int] = set()
    lock = threading.Lock()
    real = base.xxhash.xxh3_64_hexdigest

    def spy(data: Any) -> str:
        with lock:
            seen.add(threading.get_ident())
        return real(data)

    monkeypatch.setattr(base.xxhash, "xxh3_64_hexdigest", spy)
    monkeypatch.setattr(base, "block_checksums",
                        lambda data, bb: [spy(data[i:i + bb]) for i in range(0, len(data), bb)])
    try:
        return served(1, state), seen
    finally:
        monkeypatch.undo()


def test_a_state_of_small_tensors_is_hashed_on_one_thread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Threads hashing a few bytes each only take turns at the GIL: below _HASH_SPAN
    bytes a thread, one hashes them all."""
    state = {f"t{i}": torch.full((100,), float(i)) for i in range(64)}
    raw, seen = hashing_threads(monkeypatch, state)
    assert len(seen) == 1
    assert raw == built_anew(1, state)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPUs for 2 hashing threads")
def test_large_states_are_hashed_on_several_threads_alike(
        monkeypatch: pytest.MonkeyPatch) -> None:
    state = {f"t{i}": torch.randn(5000 + i) for i in range(16)}
    monkeypatch.setattr(base, "_HASH_SPAN", 1)  # every tensor counts as large
    raw, seen = hashing_threads(monkeypatch, state)
    assert len(seen) >= 2
    assert raw == built_anew(1, state)


def served_tensors(srv: base.Served) -> dict[str, torch.Tensor]:
    """The tensors a receiver would get now: the served file's bytes, parsed; each
    checked against the served manifest's checksums (AssertionError naming the key)."""
    from safetensors.torch import load as st_load

    man = parse_manifest(srv.manifest(), "served")
    (name,) = srv.files
    src = srv.files[name]
    got = st_load(bytes(src.read(0, src.size)))
    for key, entry in man.tensors.items():
        sums = block_checksums(tensor_bytes(got[key].contiguous()), man.block_bytes)
        assert tuple(sums) == entry.chunks[0].checksums, f"{key}: checksums disagree"
    return got


def test_a_forward_pass_during_an_offer_changes_nothing_served() -> None:
    """(stop 47's trial, torchft flow) The healthy replica offers its state as its next
    step's forward pass begins. BatchNorm's forward changes its running statistics in
    place without a version bump: one after the manifest request failed the receiver's
    checksums, one before it was served as the offered step's. Buffers changed with a
    bump (num_batches_tracked, a spectral-norm-like vector) got the offer refused."""
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(64)
    vec = torch.randn(32)
    strided = torch.randn(8, 4).t()  # (not contiguous: copied as a tensor)
    big = torch.randn(64 * 1024)  # past SNAPSHOT_MAX_BYTES: served from its own memory
    state = {"bn": bn.state_dict(), "u": vec, "s": strided, "w": big}
    before = {"bn/" + k: v.clone() for k, v in bn.state_dict().items()}
    before |= {"u": vec.clone(), "s": strided.clone(), "w": big.clone()}

    srv = serve_state(3, state, block_bytes=BLOCK, library_version="test")
    bn(torch.randn(16, 64))  # before the first request
    vec.mul_(2.0)  # (bumps the version)
    strided.add_(1.0)
    srv.manifest()
    bn(torch.randn(16, 64))  # between the request and the transfer
    got = served_tensors(srv)
    assert not torch.equal(bn.running_mean, before["bn/running_mean"])  # (it did change)
    for key, want in before.items():
        assert torch.equal(got[key], want), key

    # the large tensors are still watched: a change with a bump refuses the offer
    srv = serve_state(4, state, block_bytes=BLOCK, library_version="test")
    big.add_(1.0)
    with pytest.raises(base.StateChanged, match="'w'"):
        srv.manifest()


def test_small_tensors_past_the_copy_budget_are_served_live(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The copies stop at the first small tensor that would pass _SNAPSHOT_BUDGET bytes:
    it and those after it are served from their own memory, and watched (refused when
    changed) as the large ones are."""
    monkeypatch.setattr(base, "_SNAPSHOT_BUDGET", 3 * 400 + 50)
    state: dict[str, torch.Tensor] = {f"t{i}": torch.full((100,), float(i)) for i in range(5)}
    state["u"] = torch.zeros(10)  # (40 bytes: would fit what is left, but comes after)
    srv = serve_state(1, state, block_bytes=BLOCK, library_version="test")
    state["t0"].add_(1.0)  # copied: served as offered
    assert torch.equal(served_tensors(srv)["t0"], torch.zeros(100))
    srv = serve_state(2, state, block_bytes=BLOCK, library_version="test")
    state["t2"].add_(1.0)  # the third fits the budget
    state["t4"].add_(1.0)  # the fifth does not: refused
    state["u"].add_(1.0)  # nor, after it, the last
    with pytest.raises(base.StateChanged, match="'t4', 'u'") as err:
        srv.manifest()
    assert err.value.keys == ["t4", "u"]


def test_the_warning_of_tensors_changed_while_served_is_given_once(
        caplog: pytest.LogCaptureFixture) -> None:
    """(stop 48's review) A receiver's ranges end together, on several server threads:
    each saw the flag unset and warned."""
    import time

    def slow(keys: Any = None) -> list[str]:
        time.sleep(0.05)
        return ["queue"]

    srv = base.Served(3, lambda: b"", {}, changed=slow)
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        threads = [threading.Thread(target=srv.tell_changed) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert caplog.text.count("changed in place while they were served") == 1, caplog.text


def test_an_offer_copying_while_the_state_changes_says_so(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """(stop 48's trial) torchft offers on its quorum thread while the forward pass runs:
    the copies could then mix a BatchNorm layer's counter from after a step with its
    running statistics from before it, a state that never was, without a word."""
    bn = torch.nn.BatchNorm1d(4)
    state = {"bn": bn.state_dict()}
    real = base.tensor_bytes

    def forward_meanwhile(t: torch.Tensor) -> memoryview:
        if t is state["bn"]["running_mean"]:  # (after the counters were read)
            bn(torch.randn(8, 4))
        return real(t)

    monkeypatch.setattr(base, "tensor_bytes", forward_meanwhile)
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        serve_state(1, state, block_bytes=BLOCK, library_version="test")
    assert ("step 1: send_checkpoint copied the state's small tensors while something "
            "changed them ('bn/num_batches_tracked')") in caplog.text
    assert "Manager(use_async_quorum=False)" in caplog.text
    caplog.clear()
    monkeypatch.setattr(base, "tensor_bytes", real)
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):  # nothing meanwhile
        serve_state(2, state, block_bytes=BLOCK, library_version="test")
    assert caplog.text == ""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_small_gpu_tensors_offered_on_a_side_stream_are_served_as_offered() -> None:
    """(stop 48's review) torchft offers on its recovery stream: the offer's copies of
    small CUDA tensors are made there, and the server thread that copies them to the host
    (on its own stream) must wait for them."""
    side = torch.cuda.Stream()
    w = torch.randn(1 << 12, device="cuda")  # (16 KiB: copied at the offer)
    want = w.clone()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # (the side stream busy for a while)
        srv = serve_state(1, {"w": w}, block_bytes=BLOCK, library_version="test")
    # (read on this thread's default stream, which does not follow the side one: the
    # copy there is still queued behind the sleep, its memory not yet written)
    got = served_tensors(srv)["w"]
    assert torch.equal(got, want.cpu())


def test_a_range_is_checked_for_changes_by_the_tensors_it_holds_alone() -> None:
    """The sender checks, after each range a receiver read, the tensors of that range
    (all of a large state's after every range cost ~0.3 ms a request on the server)."""
    big = {f"w{i}": torch.zeros(64 * 1024) for i in range(3)}  # (256 KiB each: live)
    srv = serve_state(1, big, block_bytes=BLOCK, library_version="test")
    srv.manifest()
    (src,) = srv.files.values()
    assert isinstance(src, base.LiveSource)
    items = {it.key: (it.offset, it.end) for it in src.plan.items}
    lo, hi = items["w1"]
    assert src.keys_in(lo, hi - lo) == ["w1"]
    assert src.keys_in(lo - 1, 2) == ["w0", "w1"]  # (the last byte of w0, the first of w1)
    assert src.keys_in(0, items["w0"][0]) == []  # (the header alone)
    assert src.keys_in(0, src.size) == ["w0", "w1", "w2"]
    big["w2"].add_(1.0)
    assert srv.changed is not None
    assert srv.changed(src.keys_in(lo, hi - lo)) == []
    assert srv.changed(None) == ["w2"]


def test_an_error_of_the_state_dict_callable_says_whose_call_it_was() -> None:
    """A trial: a state_dict= callable that raised came out of recv_checkpoint as a bare
    ZeroDivisionError, nothing telling that the transport had called it."""
    from asyncckpt.transport.base import check_state_dict_fn

    def my_state() -> dict[str, Any]:
        return {"x": 1 / 0}

    call = check_state_dict_fn(my_state)
    assert call is not None and check_state_dict_fn(None) is None
    with pytest.raises(ZeroDivisionError) as ei:
        call()
    notes = getattr(ei.value, "__notes__", [])
    assert any("raised by the state_dict= callable given to the transport "
               "(test_an_error_of_the_state_dict_callable_says_whose_call_it_was.<locals>."
               "my_state)" in n for n in notes), notes
    got = check_state_dict_fn(lambda: {"w": 1})
    assert got is not None and got() == {"w": 1}


def test_a_tensor_given_other_memory_while_served_is_served_from_its_old_memory() -> None:
    """(a review) A live tensor's memory was viewed, not held: ``p.data = x`` (or
    ``set_``) while it was sent freed it under the transfer, and gloo's EFAULT killed the
    sending process. The offered memory is held now, and a storage resized in place
    (its memory moved) is refused with the transport's error."""
    import gc

    w = torch.arange(1 << 16, dtype=torch.float32)
    want = w.clone()
    offer = serve_state(3, {"w": w}, block_bytes=BLOCK, library_version="test")
    src = offer.files["rank_00000.safetensors"]
    view = src.tensor_view("w")
    w.data = torch.full((1 << 16,), -1.0)  # (the old storage's last holder but the offer)
    gc.collect()
    junk = [torch.full((1 << 16,), 7.0) for _ in range(8)]  # (freed memory would be reused)
    assert bytes(view) == bytes(tensor_bytes(want)) == bytes(src.tensor_view("w"))
    del junk

    v = torch.zeros(1 << 16)
    offer = serve_state(4, {"v": v}, block_bytes=BLOCK, library_version="test")
    src = offer.files["rank_00000.safetensors"]
    src.tensor_view("v")
    v.resize_(1 << 20)  # (its storage grows: its memory moves)
    with pytest.raises(base.CheckpointTransportError, match=r"'v' was resized in place while "
                       "it was being sent"):
        src.tensor_view("v")
