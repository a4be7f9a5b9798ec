"""Staging: serial and parallel copies into the arena give the same bytes, in order."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import mmap
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import asyncckpt.plan as plan_mod
import asyncckpt.staging as staging
import asyncckpt.storage as storage_mod
from _wrapped import Wrapped
from asyncckpt.errors import CheckpointSaveError
from asyncckpt.manifest import align_up
from asyncckpt.plan import WritePlan, plan_writes
from asyncckpt.staging import HostArena, StagingProgress, stage
from asyncckpt.storage import LocalStorage


@pytest.fixture()
def helpers() -> Iterator[cf.ThreadPoolExecutor]:
    with cf.ThreadPoolExecutor(3) as ex:
        yield ex


@pytest.fixture(autouse=True)
def parallel_for_small_tensors(request: pytest.FixtureRequest,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests stage a few KiB in many units to exercise the parallel copy: let
    tensors of any size take it (staging leaves small ones to the calling thread)."""
    if "serial_below" not in request.keywords:
        monkeypatch.setattr(staging, "_SERIAL_BELOW", 0)


def awkward_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    big = torch.randn(50_000, generator=gen)
    wide = torch.randn(60, 70, generator=gen)
    cplx = torch.randn(300, dtype=torch.complex64, generator=gen)
    return {
        "big": big,
        "transposed": wide.t(),  # not contiguous: copied by rows
        "permuted": torch.randn(6, 7, 8, generator=gen).permute(2, 0, 1),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "conj": cplx.conj(),  # a lazy conjugate: must be resolved, not memcpy'd
        "neg": torch.randn(40, generator=gen, dtype=torch.float64)._neg_view(),
        "bf16": torch.randn(999, generator=gen).to(torch.bfloat16),
        "bool": torch.rand(333, generator=gen) > 0.5,
        "slice": big[7:3007],  # a view with an offset into another tensor's storage
    }


def fresh_plan(tensors: dict[str, torch.Tensor]) -> WritePlan:
    return plan_writes(tensors, "rank_00000.safetensors")


def arena_for(plan: WritePlan) -> HostArena:
    arena = HostArena(plan.padded_bytes, pinned=False)
    arena.write_header(plan.header)
    return arena


def assert_staged(plan: WritePlan, tensors: dict[str, torch.Tensor], arena: HostArena) -> None:
    for item in plan.items:
        got = arena.view(item)
        want = tensors[item.key].resolve_conj().resolve_neg()
        assert torch.equal(got, want), item.key


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("unit", [3000, 4096, 1 << 20])
def test_parallel_stage_copies_every_byte(threads: int, unit: int, helpers: cf.Executor,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # Units of 3000 bytes split tensors mid-element and mid-row.
    monkeypatch.setattr(plan_mod, "COPY_UNIT_BYTES", unit)
    tensors = awkward_tensors()
    plan = fresh_plan(tensors)
    arena = arena_for(plan)
    progress = StagingProgress()
    stage(plan, tensors, arena, progress, helpers=helpers, threads=threads)
    assert progress.done
    progress.wait_for(plan.file_bytes, timeout=0)
    assert_staged(plan, tensors, arena)
    if unit == 3000:  # the segments tile every item exactly
        covered: dict[int, int] = {}
        for u in plan.copy_units:
            assert sum(hi - lo for _, lo, hi in u) <= unit
            for i, lo, hi in u:
                assert covered.get(i, 0) == lo
                covered[i] = hi
        assert covered == {i: it.nbytes for i, it in enumerate(plan.items) if it.nbytes} | {
            i: 0 for i, it in enumerate(plan.items) if not it.nbytes}


def test_published_prefix_is_always_staged(helpers: cf.Executor,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer follows publish(); every byte below a published offset must be final."""
    monkeypatch.setattr(plan_mod, "COPY_UNIT_BYTES", 4096)
    monkeypatch.setattr(staging, "_PUBLISH_BYTES", 1)
    gen = torch.Generator().manual_seed(1)
    tensors = {f"t{i}": torch.randn(1000 + 37 * i, generator=gen) for i in range(40)}
    plan = fresh_plan(tensors)
    want = arena_for(plan)
    stage(plan, tensors, want, StagingProgress())
    arena = arena_for(plan)
    seen: list[int] = []

    class Checking(StagingProgress):
        def publish(self, upto: int, event: object = None) -> None:
            assert torch.equal(arena.tensor[:upto], want.tensor[:upto]), upto
            seen.append(upto)
            super().publish(upto, event)

    stage(plan, tensors, arena, Checking(), helpers=helpers, threads=2)
    assert seen == sorted(seen) and seen[0] == plan.body_offset
    assert torch.equal(arena.tensor[:plan.file_bytes], want.tensor[:plan.file_bytes])


def test_a_failing_copy_is_raised_after_every_thread_stopped(
        helpers: cf.Executor, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plan_mod, "COPY_UNIT_BYTES", 4096)
    tensors = {f"t{i}": torch.randn(2048) for i in range(20)}
    plan = fresh_plan(tensors)
    arena = arena_for(plan)
    real = staging._copy_range
    calls: list[str] = []

    def flaky(item: plan_mod.WriteItem, *args: object) -> None:
        calls.append(item.key)
        if item.key == "t5":
            raise RuntimeError("boom at t5")
        real(item, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(staging, "_copy_range", flaky)
    progress = StagingProgress()
    with pytest.raises(CheckpointSaveError, match=r"copying tensor 't5'.*boom at t5"):
        stage(plan, tensors, arena, progress, helpers=helpers, threads=3)
    assert not progress.done  # the writer must never see this save as staged
    n = len(calls)
    assert helpers.submit(lambda: None).result(timeout=5) is None  # helpers are free again
    assert len(calls) == n  # and nothing copies any more


@pytest.mark.usefixtures("ctrl_c")
def test_a_ctrl_c_while_waiting_for_the_helpers_is_raised_once_they_stopped(
        helpers: cf.Executor, monkeypatch: pytest.MonkeyPatch) -> None:
    """A review's Ctrl-C in the wait for the helpers made stage() return while a helper
    still copied into the arena: the next save's copy into it committed mixed values."""
    monkeypatch.setattr(plan_mod, "COPY_UNIT_BYTES", 4096)
    tensors = {f"t{i}": torch.randn(1024) for i in range(4)}  # one unit each
    plan = fresh_plan(tensors)
    arena = arena_for(plan)
    real = staging._copy_range
    main = threading.current_thread()
    helper_busy, release = threading.Event(), threading.Event()
    events: list[str] = []

    def copy(item: plan_mod.WriteItem, *args: object) -> None:
        if threading.current_thread() is main:
            assert helper_busy.wait(5)  # (the helper holds a unit: this thread gets the rest)
        elif not helper_busy.is_set():
            helper_busy.set()
            assert release.wait(5)
            real(item, *args)  # type: ignore[arg-type]
            events.append("helper copied")
            return
        real(item, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(staging, "_copy_range", copy)
    # A real Ctrl-C once this thread waits for the helper, which copies on after it
    threading.Timer(0.2, signal.pthread_kill, (main.ident, signal.SIGINT)).start()
    threading.Timer(0.5, release.set).start()
    progress = StagingProgress()
    with pytest.raises(KeyboardInterrupt):
        stage(plan, tensors, arena, progress, helpers=helpers, threads=2)
    events.append("raised")
    assert events == ["helper copied", "raised"]
    assert not progress.done


def test_a_ctrl_c_in_a_helpers_submission_leaves_no_copy_running(
        helpers: cf.Executor, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C after the pool queued a helper's work but before submit returned lost its
    future: the helper then copied into the arena after save_async had raised, over the
    next save's bytes (a review committed a step of the wrong values so)."""
    monkeypatch.setattr(plan_mod, "COPY_UNIT_BYTES", 4096)
    tensors = {f"t{i}": torch.randn(1024) for i in range(4)}
    plan = fresh_plan(tensors)
    copies: list[str] = []
    real = staging._copy_range

    def copy(item: plan_mod.WriteItem, *args: object) -> None:
        copies.append(item.key)
        real(item, *args)  # type: ignore[arg-type]

    gate = threading.Event()

    class Interrupted:
        def submit(self, fn: Callable[..., object], *args: object) -> object:
            helpers.submit(lambda: (gate.wait(10), fn(*args)))  # queued, then the Ctrl-C
            raise KeyboardInterrupt

    monkeypatch.setattr(staging, "_copy_range", copy)
    with pytest.raises(KeyboardInterrupt):
        stage(plan, tensors, arena_for(plan), StagingProgress(), helpers=Interrupted(),
              threads=2)
    gate.set()
    helpers.shutdown(wait=True)  # (the queued work had its turn)
    assert copies == []


@pytest.mark.parametrize("threads", [1, 2])
def test_check_runs_before_the_last_bytes_are_published(
        threads: int, helpers: cf.Executor, monkeypatch: pytest.MonkeyPatch) -> None:
    """check() (overlap's net for tensors changed while staged) fails the save before the
    writer can have every byte: a review found the whole file published before it ran."""
    monkeypatch.setattr(plan_mod, "COPY_UNIT_BYTES", 4096)
    monkeypatch.setattr(staging, "_PUBLISH_BYTES", 1)
    tensors = {f"t{i}": torch.randn(1024) for i in range(6)}
    plan = fresh_plan(tensors)
    progress = StagingProgress()
    published: list[int] = []
    real_publish = progress.publish

    def publish(upto: int, event: object = None) -> None:
        published.append(upto)
        real_publish(upto, event)

    monkeypatch.setattr(progress, "publish", publish)
    at_check: list[int] = []
    stage(plan, tensors, arena_for(plan), progress, helpers=helpers, threads=threads,
          check=lambda: at_check.append(max(published)))
    # (how far the writer got before depends on the threads' turns; never to the end)
    assert published and at_check and at_check[0] < plan.file_bytes, (
        published, at_check, plan.file_bytes)
    assert progress.done


@pytest.mark.parametrize("copy_threads", [1, 3])
def test_checkpointer_round_trips_with_any_copy_threads(tmp_path: object, copy_threads: int,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncckpt

    monkeypatch.setattr(plan_mod, "COPY_UNIT_BYTES", 8192)
    state = awkward_tensors()
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async",  # type: ignore[arg-type]
                                     copy_threads=copy_threads) as ckpt:
        ckpt.save_async(state, step=1).wait()
        back = ckpt.load(step=1)
    for k, t in state.items():
        assert torch.equal(back[k], t.resolve_conj().resolve_neg()), k


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2"])
def test_copy_threads_must_be_a_positive_int(tmp_path: object, bad: object) -> None:
    import asyncckpt

    with pytest.raises(asyncckpt.CheckpointConfigError, match="copy_threads"):
        asyncckpt.AsyncCheckpointer(tmp_path, copy_threads=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(("cpus", "local", "want"), [
    (2, None, 2), (2, "2", 1), (16, "8", 2), (64, "2", 4), (3, "8", 1), (2, "junk", 2)])
def test_the_default_copy_threads_share_the_cpus_among_the_ranks_of_a_machine(
        tmp_path: object, monkeypatch: pytest.MonkeyPatch, cpus: int, local: str | None,
        want: int) -> None:
    import os

    import asyncckpt

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    if local is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    with asyncckpt.AsyncCheckpointer(tmp_path) as ckpt:  # type: ignore[arg-type]
        assert ckpt.config.copy_threads == want
    with asyncckpt.AsyncCheckpointer(tmp_path, copy_threads=3) as ckpt:  # type: ignore[arg-type]
        assert ckpt.config.copy_threads == 3  # an explicit count is kept


@pytest.mark.parametrize("copy_threads", [1, 3])
@pytest.mark.parametrize("overlap", [False, True])
def test_a_failing_copy_names_its_tensor_to_the_caller(
        tmp_path: object, monkeypatch: pytest.MonkeyPatch, copy_threads: int,
        overlap: bool) -> None:
    import asyncckpt

    real = HostArena.view

    def view(self: HostArena, item: plan_mod.WriteItem) -> torch.Tensor:
        if item.key == "bad":
            raise RuntimeError("device lost (simulated)")
        return real(self, item)

    monkeypatch.setattr(HostArena, "view", view)
    state = {"ok": torch.ones(64, 64).t(), "bad": torch.ones(64, 64).t()}  # copied by view
    with asyncckpt.AsyncCheckpointer(tmp_path, copy_threads=copy_threads) as ckpt:
        with pytest.raises(CheckpointSaveError,
                           match=r"copying tensor 'bad'.*device lost \(simulated\)"):
            ckpt.save_async(state, step=1, overlap=overlap).wait(30)
        assert ckpt.steps() == []


class FakeEvent:
    """A CUDA event stand-in: records who synchronized it; ``gate`` holds that call."""

    def __init__(self, name: str, calls: list[str], gate: threading.Event | None = None):
        self.name, self.calls, self.gate = name, calls, gate

    def synchronize(self) -> None:
        self.calls.append(self.name)
        if self.gate is not None:
            assert self.gate.wait(30), "the test never opened the gate"


def test_wait_for_synchronizes_the_event_that_covers_the_offset() -> None:
    # Events come at the end of an item every >= 32 MiB, the writer asks for piece ends:
    # the event past a piece end is the one that says its bytes have landed.
    mib = 1 << 20
    calls: list[str] = []
    progress = StagingProgress()
    progress.publish(4096)
    for off in (40, 80, 120):
        progress.publish(off * mib, FakeEvent(f"e{off}", calls))
    progress.wait_for(32 * mib)
    assert calls == ["e40"]
    progress.wait_for(64 * mib)
    assert calls == ["e40", "e80"]
    progress.wait_for(80 * mib)  # exactly at an event: that one already covers it
    assert calls == ["e40", "e80"]
    progress.wait_for(96 * mib)
    assert calls == ["e40", "e80", "e120"]
    progress.finish(130 * mib)
    progress.wait_for(130 * mib)
    assert calls == ["e40", "e80", "e120"]


def test_a_second_waiter_does_not_pass_an_event_still_landing() -> None:
    # The hasher waits beside the writer: it must not find the event taken by the other
    # waiter and go on before the copies behind it have landed.
    calls: list[str] = []
    gate = threading.Event()
    progress = StagingProgress()
    progress.publish(1000, FakeEvent("e", calls, gate))
    changed = threading.Condition()
    returned: list[str] = []

    def waiter(name: str) -> None:
        progress.wait_for(1000)
        with changed:
            returned.append(name)
            changed.notify_all()

    a = threading.Thread(target=waiter, args=("a",))
    a.start()
    b = threading.Thread(target=waiter, args=("b",))
    try:
        with changed:
            assert changed.wait_for(lambda: calls == ["e"], 30)
        b.start()
        with changed:  # b either synchronizes the event too, or (wrongly) returns
            assert changed.wait_for(lambda: len(calls) == 2 or bool(returned), 30)
        assert returned == [], "a waiter went on while the event was still landing"
    finally:
        gate.set()
        a.join(30)
        if b.ident is not None:  # started
            b.join(30)
    assert sorted(returned) == ["a", "b"]


def test_the_writer_writes_only_landed_bytes(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # Emulated asynchronous device-to-host copies: each lands in the arena only when an
    # event recorded after it is synchronized, as with CUDA streams. Events fall at item
    # ends, which are not piece ends.
    monkeypatch.setattr(storage_mod, "PIECE_BYTES", 3 * 4096)
    body, sizes = 4096, [5000, 7000, 11000, 6000, 9000]
    nbytes = body + sum(sizes)
    arena = mmap.mmap(-1, align_up(nbytes))
    queued: list[tuple[int, int]] = []  # (offset, size) of copies not landed yet
    calls: list[str] = []

    class Landing(FakeEvent):
        def __init__(self, upto: int):
            super().__init__(str(upto), calls)
            self.upto = upto

        def synchronize(self) -> None:
            super().synchronize()
            for off, n in [c for c in queued if c[0] + c[1] <= self.upto]:
                arena[off:off + n] = b"\xaa" * n
                queued.remove((off, n))

    progress = StagingProgress()
    progress.publish(body)
    off = body
    for n in sizes:  # every copy enqueued and its event published; none has landed
        queued.append((off, n))
        off += n
        progress.publish(off, Landing(off))
    f = tmp_path / "shard"
    LocalStorage().write_arena(f, memoryview(arena), nbytes, progress.wait_for)
    data = f.read_bytes()
    assert len(data) == nbytes
    assert data[body:] == b"\xaa" * (nbytes - body), "a piece was written before it landed"


class _FakeStream:
    def __init__(self, device: torch.device | None = None, name: str = "side"):
        self.device, self.name, self.waited = device, name, []  # type: ignore[var-annotated]

    def wait_stream(self, other: _FakeStream) -> None:
        self.waited.append(other)


class _OnDevice:
    """Stands for a CUDA tensor where only its device is asked."""

    is_cuda = True

    def __init__(self, device: str):
        self.device = torch.device(device)


def test_side_streams_follow_the_callers_stream_of_each_device(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """overlap=True stages on another thread: each device's side stream must be made on
    that device and wait for the stream the *caller* was on (current streams are per
    thread), not for the staging thread's own."""
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _FakeStream(device))
    current = {torch.device("cuda:0"): _FakeStream(None, "stager's own 0"),
               torch.device("cuda:1"): _FakeStream(None, "stager's own 1")}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: current[torch.device(d)])
    callers = {torch.device("cuda:1"): _FakeStream(None, "caller's 1")}
    tensors = {"a": _OnDevice("cuda:1"), "b": _OnDevice("cuda:0"), "c": _OnDevice("cuda:1")}
    got = staging.side_streams(tensors, callers)  # type: ignore[arg-type]
    assert {str(d): s.device for d, s in got.items()} == {
        "cuda:0": torch.device("cuda:0"), "cuda:1": torch.device("cuda:1")}
    assert [w.name for w in got[torch.device("cuda:1")].waited] == ["caller's 1"]
    assert [w.name for w in got[torch.device("cuda:0")].waited] == ["stager's own 0"]
    assert staging.side_streams({"x": torch.ones(2)}, None) == {}  # CPU: none


def test_an_overlapped_save_takes_the_callers_streams_on_the_callers_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncckpt
    import asyncckpt.checkpointer as ck_mod

    threads = []

    def spy(tensors: object) -> dict[torch.device, object]:
        threads.append(threading.current_thread().name)
        return {}

    monkeypatch.setattr(ck_mod, "caller_streams", spy)
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async") as ckpt:
        ckpt.save_async({"w": torch.ones(8)}, 1, overlap=True).wait()
    assert threads == [threading.current_thread().name]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_overlap_stages_after_the_kernels_queued_on_the_callers_stream(
        tmp_path: Path) -> None:
    """The caller updates its tensors on a stream of its own, behind a long kernel, then
    saves with overlap=True: the copy must wait for that update (it waited for the
    stager thread's default stream, and saved the values from before)."""
    import asyncckpt

    x = torch.zeros(4 << 20, device="cuda")
    mine = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async_pinned") as ckpt:
        ckpt.save({"x": x}, 1)  # the arena exists; it holds zeros
        with torch.cuda.stream(mine):
            torch.cuda._sleep(500_000_000)  # type: ignore[no-untyped-call]
            x.fill_(7.0)
            fut = ckpt.save_async({"x": x}, 2, overlap=True)
        fut.wait()
        assert torch.equal(ckpt.load(step=2)["x"], torch.full((4 << 20,), 7.0))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_tensors_on_another_device_than_the_current_one_land_before_written(
        tmp_path: Path) -> None:
    import asyncckpt

    torch.cuda.set_device(0)
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async_pinned") as ckpt:
        for step in (1, 2):  # step 2 restages over step 1's arena: stale bytes differ
            state = {f"t{i}": torch.full((4 << 20,), float(step * 10 + i), device=f"cuda:{i % 2}")
                     for i in range(6)}
            with torch.cuda.device(1):
                torch.cuda._sleep(500_000_000)  # type: ignore[no-untyped-call]
            for overlap in (False, True):
                ckpt.save_async(state, step=2 * step + overlap, overlap=overlap).wait()
                out = ckpt.load(step=2 * step + overlap)
                assert all(torch.equal(out[k], state[k].cpu()) for k in state)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_copies_land_before_their_pieces_are_written(tmp_path: Path) -> None:
    # Queued GPU work delays the side stream's copies; pieces must not be written early.
    import asyncckpt

    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async_pinned") as ckpt:
        for step in (1, 2):  # step 2 restages over step 1's arena: stale bytes differ
            state = {f"t{i}": torch.full((5 << 20,), float(step * 10 + i), device="cuda")
                     for i in range(8)}  # 8 x 20 MiB
            torch.cuda._sleep(1_000_000_000)  # type: ignore[no-untyped-call]
            ckpt.save_async(state, step=step).wait()
            out = ckpt.load(step=step)
            assert all(torch.equal(out[k], state[k].cpu()) for k in state)




@pytest.mark.parametrize("threads", [1, 3])
def test_a_tensor_without_memory_of_its_own_is_copied_not_memcpyd_from_address_0(
        threads: int, helpers: cf.Executor, monkeypatch: pytest.MonkeyPatch) -> None:
    """Flattening refuses wrapper subclasses; staging must not crash the process on one
    that reaches it anyway (a memcpy from its data pointer, 0, did)."""
    import ctypes

    real = ctypes.memmove

    def memmove(dst: int, src: int, n: int) -> int:
        if src == 0:  # what would have been a segfault
            raise AssertionError("memmove from address 0")
        return real(dst, src, n)  # type: ignore[no-any-return]

    monkeypatch.setattr(ctypes, "memmove", memmove)
    monkeypatch.setattr(plan_mod, "COPY_UNIT_BYTES", 3000)  # the wrapper in several units
    values = torch.randn(40, 30, generator=torch.Generator().manual_seed(2))
    tensors = {"plain": values + 1, "wrapped": Wrapped(values)}
    assert tensors["wrapped"].data_ptr() == 0
    plan = fresh_plan(tensors)
    arena = arena_for(plan)
    stage(plan, tensors, arena, StagingProgress(), helpers=helpers, threads=threads)
    for item in plan.items:
        want = values if item.key == "wrapped" else values + 1
        assert torch.equal(arena.view(item), want), item.key


@pytest.mark.serial_below
@pytest.mark.parametrize(("numel", "want"), [(1 << 10, 1), (1 << 15, 2)])
def test_small_tensors_are_staged_by_the_calling_thread_alone(
        helpers: cf.Executor, monkeypatch: pytest.MonkeyPatch, numel: int, want: int) -> None:
    """Tensors of a few KiB are copied faster by one thread than by two taking turns with
    the GIL; larger ones are copied in parallel."""
    monkeypatch.setattr(plan_mod, "COPY_UNIT_BYTES", 1 << 16)
    tensors = {f"t{i}": torch.full((numel,), float(i)) for i in range(64)}
    plan = fresh_plan(tensors)
    arena = arena_for(plan)
    copiers: set[int] = set()
    real = staging._copy_range
    # Where two threads copy, each waits at its first piece for the other: on a loaded
    # machine the caller could otherwise copy every piece before the helper starts.
    both = threading.Barrier(2, timeout=10)

    def recording(*args: object) -> None:
        if want == 2 and threading.get_ident() not in copiers:
            copiers.add(threading.get_ident())
            with contextlib.suppress(threading.BrokenBarrierError):
                both.wait()
        copiers.add(threading.get_ident())
        real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(staging, "_copy_range", recording)
    serial = staging._copy_serial

    def recording_serial(*args: object) -> None:
        copiers.add(threading.get_ident())
        serial(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(staging, "_copy_serial", recording_serial)
    stage(plan, tensors, arena, StagingProgress(), helpers=helpers, threads=2)
    assert_staged(plan, tensors, arena)
    assert len(copiers) == want and (want == 2 or copiers == {threading.get_ident()})


def test_an_arena_is_faulted_in_when_made_by_as_many_threads_as_asked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The first save of a large state spends most of its blocked time faulting in its
    arena: the kernel zeroes each page, which threads do side by side."""
    import asyncckpt._memory as memory

    real = memory.madvise
    assert real is not None
    calls: list[tuple[int, int, int, int]] = []
    lock = threading.Lock()
    both = threading.Barrier(2, timeout=10)  # the two parts really run at once

    def advise(addr: int, n: int, advice: int) -> int:
        if advice == memory.MADV_POPULATE_WRITE:
            with lock:
                calls.append((addr, n, advice, threading.get_ident()))
            both.wait()
        return int(real(addr, n, advice))

    monkeypatch.setattr(memory, "madvise", advise)
    nbytes = (9 << 20) + 4096  # 4.5 huge pages and a page: the parts are whole huge pages
    arena = HostArena(nbytes, pinned=False, threads=2)
    base = arena.tensor.data_ptr()
    parts = sorted((addr - base, addr - base + n) for addr, n, _, _ in calls)
    assert parts == [(0, 6 << 20), (6 << 20, nbytes)]
    assert len({ident for *_, ident in calls}) == 2
    # resident now, before anything touched it: mincore says so for every page
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pages = -(-nbytes // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(base), ctypes.c_size_t(nbytes), vec) == 0
    assert all(v & 1 for v in vec)


def test_an_arena_that_cannot_be_faulted_in_ahead_still_works(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel before 5.14 refuses MADV_POPULATE_WRITE: the pages then fault at first
    touch, and staging fills the arena as always."""
    import asyncckpt._memory as memory

    real = memory.madvise
    assert real is not None
    monkeypatch.setattr(memory, "madvise", lambda addr, n, advice: -1 if advice ==
                        memory.MADV_POPULATE_WRITE else real(addr, n, advice))
    assert memory.populate(0, 4 << 20, 2) is False
    tensors = {"a": torch.arange(1 << 20, dtype=torch.float32), "b": torch.ones(3, 5)}
    plan = fresh_plan(tensors)
    arena = HostArena(plan.padded_bytes, pinned=False, threads=2)
    arena.write_header(plan.header)
    stage(plan, tensors, arena, StagingProgress())
    assert_staged(plan, tensors, arena)


def test_a_transposed_tensor_is_copied_whole_by_the_unit_that_holds_its_start() -> None:
    """A trial's 24 MiB .t() views staged 4-10x slower than one copy_ each: slabs of rows
    of a transposed tensor are strided gathers that miss torch's blocked transpose. Such
    a tensor is copied whole by the unit holding its first byte, the others copy none."""
    from asyncckpt.plan import WriteItem

    base = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48)
    src = base.t()  # (48, 64), strides (1, 48)
    item = WriteItem("w", torch.float32, (48, 64), 0, src.numel() * 4)
    arena = HostArena(item.nbytes, pinned=False)
    arena.tensor.zero_()
    staging._copy_rows(item, src, arena, item.nbytes // 2, item.nbytes)  # (a later unit)
    assert not arena.tensor.any()
    staging._copy_rows(item, src, arena, 0, 256)  # (the first unit: all of it)
    assert torch.equal(arena.view(item), src)
    # rows that are contiguous slabs (a view of every other column) still go by rows
    arena.tensor.zero_()
    rows = torch.arange(48 * 128, dtype=torch.float32).reshape(48, 128)[:, ::2]
    staging._copy_rows(item, rows, arena, 0, 256)
    assert torch.equal(arena.view(item)[:1], rows[:1]) and not arena.view(item)[1:].any()
    # a 1-D strided view (every other element) goes by elements (review: max() of no
    # strides raised, and the save failed)
    flat = torch.arange(2 * 3072, dtype=torch.float32)[::2]
    one = WriteItem("v", torch.float32, (3072,), 0, 3072 * 4)
    arena.tensor.zero_()
    staging._copy_rows(one, flat, arena, 4096, one.nbytes)
    staging._copy_rows(one, flat, arena, 0, 4096)
    assert torch.equal(arena.view(one), flat)


def test_a_1d_strided_tensor_across_copy_units_saves(tmp_path: Path) -> None:
    """(review) A 1-D view of every other element, split across copy units, failed its
    save: max() of the strides of no dimension."""
    import asyncckpt

    state = {"a": torch.ones(1 << 20), "b": torch.arange(1 << 23, dtype=torch.float32)[::2]}
    with asyncckpt.AsyncCheckpointer(tmp_path, copy_threads=2) as ck:
        ck.save(state, step=1)
        got = ck.load(step=1)
    assert torch.equal(got["b"], state["b"]) and torch.equal(got["a"], state["a"])
