"""Reader: sub-box reads (the resharding path) read only covering blocks and verify them."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import asyncckpt
from _forks import in_forked_child
from _manifests import long_entries
from _ranks import all_ok, in_threads
from _wrapped import Wrapped
from asyncckpt import commit
from asyncckpt.errors import CheckpointCorruptError
from asyncckpt.loader import load_from, load_newest_intact
from asyncckpt.manifest import seal
from asyncckpt.plan import box_byte_span, plan_reads, row_major_strides
from asyncckpt.reader import _read_item, read_manifest, verify_checkpoint
from asyncckpt.storage import LocalStorage


class CountingStorage(LocalStorage):
    def __init__(self) -> None:
        self.read = 0

    def pread_into(self, fd: int, views, offset: int) -> int:  # type: ignore[no-untyped-def]
        n = super().pread_into(fd, views, offset)
        self.read += n
        return n


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    root = tmp_path_factory.mktemp("reader")
    x = torch.randn(37, 53, 11).to(torch.bfloat16)
    with asyncckpt.AsyncCheckpointer(root, block_bytes=4096) as ckpt:
        ckpt.save({"x": x}, step=1)
    return root / "step_000000001", x


def read_box(step_dir: Path, box: tuple[tuple[int, ...], tuple[int, ...]],
             storage: LocalStorage, dtype: torch.dtype) -> torch.Tensor:
    man = read_manifest(step_dir, storage)
    dst = torch.empty(box[1], dtype=dtype)
    fd = storage.open_read(step_dir / "rank_00000.safetensors")
    try:
        for it in plan_reads(man, {"x": box}):
            _read_item(fd, step_dir / it.chunk.file, it, dst, storage, True, man.block_bytes)
    finally:
        storage.close(fd)
    return dst


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_sub_box_reads_bit_exact(saved: tuple[Path, torch.Tensor], data: st.DataObject) -> None:
    step_dir, x = saved
    offs = tuple(data.draw(st.integers(0, s - 1)) for s in x.shape)
    lens = tuple(data.draw(st.integers(1, s - o)) for o, s in zip(offs, x.shape, strict=True))
    got = read_box(step_dir, (offs, lens), LocalStorage(), x.dtype)
    ref = x[tuple(slice(o, o + n) for o, n in zip(offs, lens, strict=True))]
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16))


def test_sub_box_reads_only_covering_blocks(saved: tuple[Path, torch.Tensor]) -> None:
    step_dir, x = saved
    storage = CountingStorage()
    read_box(step_dir, ((0, 0, 0), (2, 53, 11)), storage, x.dtype)  # two rows of 37
    row = 53 * 11 * 2
    assert storage.read <= -(-2 * row // 4096) * 4096  # the blocks that hold two rows
    assert storage.read < x.numel() * 2 // 4


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    """Rows of ~3 checksum blocks: column slices skip whole blocks between rows."""
    root = tmp_path_factory.mktemp("wide")
    x = torch.randn(5, 7, 3000)
    with asyncckpt.AsyncCheckpointer(root, block_bytes=4096) as ckpt:
        ckpt.save({"x": x}, step=1)
    return root / "step_000000001", x


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_sub_box_of_wide_rows_reads_bit_exact(wide: tuple[Path, torch.Tensor],
                                                  data: st.DataObject) -> None:
    step_dir, x = wide
    offs = tuple(data.draw(st.integers(0, s - 1)) for s in x.shape)
    lens = tuple(data.draw(st.integers(1, s - o)) for o, s in zip(offs, x.shape, strict=True))
    if data.draw(st.booleans()):  # often a narrow column slice: the sparse path
        lens = (*lens[:2], min(lens[2], data.draw(st.integers(1, 900))))
    got = read_box(step_dir, (offs, lens), LocalStorage(), x.dtype)
    ref = x[tuple(slice(o, o + n) for o, n in zip(offs, lens, strict=True))]
    assert torch.equal(got, ref)


def test_a_column_slice_of_wide_rows_reads_only_the_blocks_it_touches(tmp_path: Path) -> None:
    """Shard(1) of rows longer than a block: the span from the box's first element to its
    last read (and allocated) 3.25x its share of a [4, 4M] fp32 tensor."""
    x = torch.arange(4 * 64 * 1024, dtype=torch.float32).view(4, 64 * 1024)  # 256 KiB rows
    with asyncckpt.AsyncCheckpointer(tmp_path, block_bytes=4096) as ckpt:
        ckpt.save({"x": x}, step=1)
    storage = CountingStorage()
    got = read_box(tmp_path / "step_000000001", ((0, 1024), (4, 16 * 1024)), storage, x.dtype)
    assert torch.equal(got, x[:, 1024:17 * 1024])
    assert storage.read == 4 * 64 * 1024  # each row's 64 KiB part is 16 whole blocks


def test_a_bad_block_is_caught_even_in_a_partial_read(tmp_path: Path) -> None:
    x = torch.arange(64 * 1024, dtype=torch.float32).view(64, 1024)
    with asyncckpt.AsyncCheckpointer(tmp_path, block_bytes=4096) as ckpt:
        ckpt.save({"x": x}, step=1)
        man = ckpt.manifest(1)
    step_dir = tmp_path / "step_000000001"
    shard = step_dir / "rank_00000.safetensors"
    start = man.tensors["x"].chunks[0].byte_range[0]
    with open(shard, "r+b") as f:  # damage row 10 (block 2 of the tensor)
        f.seek(start + 10 * 4096 + 5)
        f.write(b"\xff")
    assert torch.equal(read_box(step_dir, ((0, 0), (8, 1024)), LocalStorage(), x.dtype), x[:8])
    with pytest.raises(CheckpointCorruptError, match="block 10"):
        read_box(step_dir, ((9, 0), (3, 1024)), LocalStorage(), x.dtype)


def test_a_checksum_mismatch_names_the_block_s_bytes_with_their_end(tmp_path: Path) -> None:
    """(a crash trial) "bytes 1052700..": the range had no end. It ends where the block
    does, exclusive as the other byte ranges said; a tensor's last block with the tensor."""
    state = {"a": torch.arange(2500.0), "b": torch.arange(2500.0)}  # (10,000 bytes each)
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="sync", block_bytes=4096) as ckpt:
        ckpt.save(state, step=1)
    step_dir = tmp_path / commit.step_dir_name(1)
    manifest = read_manifest(step_dir, LocalStorage())
    a, b = manifest.tensors["a"].chunks[0], manifest.tensors["b"].chunks[0]
    with open(step_dir / a.file, "r+b") as f:
        for pos in (a.byte_range[0] + 4096 + 5, b.byte_range[1] - 1):  # a's block 1, b's last
            f.seek(pos)
            byte = f.read(1)[0]
            f.seek(pos)
            f.write(bytes([byte ^ 0x40]))
    lo = a.byte_range[0] + 4096
    want_a = f"'a' (block 1, bytes {lo}..{lo + 4096})"
    want_b = f"'b' (block 2, bytes {b.byte_range[0] + 8192}..{b.byte_range[1]})"
    report = verify_checkpoint(step_dir, LocalStorage())
    assert want_a in report.problems[0] and want_b in report.problems[1], report.problems
    with pytest.raises(CheckpointCorruptError) as info:
        load_from(step_dir, {k: torch.zeros_like(v) for k, v in state.items()}, LocalStorage())
    assert want_a in str(info.value) or want_b in str(info.value), info.value


def test_box_byte_span_matches_the_row_major_layout() -> None:
    shape = (4, 5, 6)
    strides = row_major_strides(shape)
    assert strides == (30, 6, 1)
    lo, hi = box_byte_span((0, 0, 0), shape, ((1, 2, 3), (2, 1, 2)), 2)
    assert lo == (1 * 30 + 2 * 6 + 3) * 2
    assert hi == ((2 * 30 + 2 * 6 + 4) + 1) * 2
    assert box_byte_span((0,), (5,), ((1,), (0,)), 4) == (0, 0)


def test_a_partial_view_cannot_make_a_load_allocate_a_forged_shape(tmp_path: Path) -> None:
    # A peer's partial view covers only its own boxes, so the tensor's shape is not bounded
    # by the file: the coverage check must refuse it before anything is allocated.
    from asyncckpt.errors import CheckpointNotFoundError

    asyncckpt.save({"x": torch.arange(1024, dtype=torch.float32)}, tmp_path)
    path = tmp_path / "step_000000000" / "manifest.json"
    raw = path.read_bytes()
    doc = long_entries(json.loads(raw[:re.search(rb',"digest"', raw).start()] + b"}"))
    doc["partial"] = True
    doc["tensors"]["x"]["shape"] = [2**40]  # 4 TB of float32 if it were allocated
    path.write_bytes(seal(json.dumps(doc, separators=(",", ":")).encode()))
    with pytest.raises(CheckpointNotFoundError, match="holds only part of x"):
        load_from(tmp_path / "step_000000000", None, PeerViewStorage())  # (no target)
    with pytest.raises(CheckpointNotFoundError, match="wanted elements"):  # (a target's box)
        load_from(tmp_path / "step_000000000", {"x": torch.zeros(2048)}, PeerViewStorage(),
                  shards={"x": asyncckpt.ShardMetadata((2**40,), (0,))})


def test_coverage_counts_whole_items_and_pieces_alike() -> None:
    # _check_covered takes an item that fills its whole destination without counting
    # its elements: a key so filled must still be refused when another item adds to it,
    # and pieces must still add up to the whole.
    from asyncckpt.errors import CheckpointNotFoundError
    from asyncckpt.manifest import Chunk
    from asyncckpt.plan import ReadItem
    from asyncckpt.reader import _check_covered

    ch = Chunk("f", "k", (0, 0), (4, 3), (0, 48), ("0" * 16,))
    whole = ((0, 0), (4, 3))
    top, bottom = ((0, 0), (2, 3)), ((2, 0), (2, 3))
    here = Path("peer-step-1")
    _check_covered([ReadItem("a", ch, whole, whole)], {"a": (4, 3)}, here)
    _check_covered([ReadItem("a", ch, top, whole), ReadItem("a", ch, bottom, whole)],
                   {"a": (4, 3)}, here)
    refused = [
        ([ReadItem("a", ch, top, whole)], "6 of the 12"),  # half of it
        ([], "0 of the 12"),  # none of it
        ([ReadItem("a", ch, whole, whole), ReadItem("a", ch, top, whole)], "18 of the 12"),
        ([ReadItem("a", ch, whole, whole), ReadItem("a", ch, whole, whole)], "24 of the 12"),
        ([ReadItem("b", ch, whole, whole)], "0 of the 12"),  # another key's
    ]
    for items, says in refused:
        with pytest.raises(CheckpointNotFoundError, match=says):
            _check_covered(items, {"a": (4, 3)}, here)
    # a whole item of a box other than the one wanted counts by its elements
    with pytest.raises(CheckpointNotFoundError, match=r"^peer-step-1: the checkpoint holds 6 "
                       r"of the 12"):  # (named: a peer's URL once the fetch retells it)
        _check_covered([ReadItem("a", ch, top, top)], {"a": (4, 3)}, here)


class PeerViewStorage(LocalStorage):
    """Files read as a peer's view, which may be partial."""

    peer_view = True


class VectoredStorage(LocalStorage):
    """Counts reads and the views each one fills; can cut multi-view reads short."""

    def __init__(self, short: bool = False) -> None:
        self.calls: list[int] = []
        self.short = short

    def pread_into(self, fd: int, views, offset: int) -> int:  # type: ignore[no-untyped-def]
        self.calls.append(len(views))
        if self.short and len(views) > 1:
            return super().pread_into(fd, views[:1], offset)  # as at a file's end
        return super().pread_into(fd, views, offset)


def small_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {f"t{i:03d}": torch.randn(100 + i, generator=g) for i in range(120)}


def test_runs_of_small_tensors_are_read_with_one_vectored_read(tmp_path: Path) -> None:
    from asyncckpt.loader import load_from

    state = small_state()
    asyncckpt.save(state, tmp_path)
    step_dir = tmp_path / "step_000000000"
    # Every third tensor left out: the reads must skip (or read past) the gaps.
    want = {k: torch.zeros_like(v) for i, (k, v) in enumerate(state.items()) if i % 3}
    storage = VectoredStorage()
    load_from(step_dir, want, storage, strict=False)
    for k, t in want.items():
        assert torch.equal(t, state[k]), k
    reads = [n for n in storage.calls if n > 1]
    assert reads and len(storage.calls) < len(want) // 4  # batched, not one read each


def test_a_bad_byte_inside_a_vectored_read_names_its_tensor(tmp_path: Path) -> None:
    state = small_state()
    with asyncckpt.AsyncCheckpointer(tmp_path) as ckpt:
        ckpt.save(state, step=1)
        man = ckpt.manifest(1)
    shard = tmp_path / "step_000000001" / "rank_00000.safetensors"
    start = man.tensors["t057"].chunks[0].byte_range[0]
    with open(shard, "r+b") as f:
        f.seek(start + 17)
        f.write(b"\x7f")
    with pytest.raises(CheckpointCorruptError, match="'t057'"):
        asyncckpt.load(tmp_path, {k: torch.zeros_like(v) for k, v in state.items()})


def test_a_bad_block_of_a_tensor_of_several_blocks_inside_a_vectored_read(tmp_path: Path) -> None:
    """Tensors of one checksum block are checked on a short path; one of several blocks
    still has each block checked, and the error names the tensor and the block."""
    from asyncckpt.loader import load_from

    g = torch.Generator().manual_seed(5)
    # 3 blocks of 4 KiB each (then 1, then 2): small enough to be read as one run
    state = {f"t{i}": torch.randn(n, generator=g) for i, n in enumerate((3072, 512, 2048))}
    with asyncckpt.AsyncCheckpointer(tmp_path, block_bytes=4096) as ckpt:
        ckpt.save(state, step=1)
        man = ckpt.manifest(1)
    assert [len(man.tensors[k].chunks[0].checksums) for k in state] == [3, 1, 2]
    step_dir = tmp_path / "step_000000001"
    storage = VectoredStorage()
    want = {k: torch.zeros_like(v) for k, v in state.items()}
    load_from(step_dir, want, storage)
    assert all(torch.equal(want[k], v) for k, v in state.items())
    assert max(storage.calls) == 3  # the three read as one run
    start = man.tensors["t0"].chunks[0].byte_range[0]
    with open(step_dir / "rank_00000.safetensors", "r+b") as f:
        f.seek(start + 4096 + 5)  # in t0's second block
        byte = f.read(1)[0]
        f.seek(start + 4096 + 5)
        f.write(bytes([byte ^ 0x40]))
    with pytest.raises(CheckpointCorruptError, match=r"'t0' \(block 1,"):
        load_from(step_dir, {k: torch.zeros_like(v) for k, v in state.items()},
                  VectoredStorage())


def test_a_short_vectored_read_falls_back_to_reading_each_tensor(tmp_path: Path) -> None:
    from asyncckpt.loader import load_from

    state = small_state()
    asyncckpt.save(state, tmp_path)
    want = {k: torch.zeros_like(v) for k, v in state.items()}
    storage = VectoredStorage(short=True)
    load_from(tmp_path / "step_000000000", want, storage)
    assert any(n > 1 for n in storage.calls)  # it tried, was cut short, and recovered
    for k, t in want.items():
        assert torch.equal(t, state[k]), k


def _vma_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping that holds ``addr`` in /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_large_fresh_tensors_are_advised_huge_pages() -> None:
    from asyncckpt._memory import HUGE_PAGE
    from asyncckpt.reader import fresh_tensor

    t = fresh_tensor((3, 5 << 20), torch.float16)  # 30 MiB
    inner = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    assert "hg" in _vma_flags(inner)
    assert t.shape == (3, 5 << 20) and t.dtype == torch.float16 and t.is_contiguous()


def test_fresh_loads_of_large_tensors_are_ordinary_independent_tensors(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    state = {
        "bf16": torch.randn(1025, 2049, generator=g).to(torch.bfloat16),  # > 4 MiB, odd size
        "c64": torch.randn(700, 1001, dtype=torch.complex64, generator=g),
        "flags": torch.rand(5 << 20, generator=g) > 0.5,
        "small": torch.arange(7, dtype=torch.int16),
    }
    asyncckpt.save(state, tmp_path / "ck")
    a = asyncckpt.load(tmp_path / "ck")
    b = asyncckpt.load(tmp_path / "ck")
    for k, v in state.items():
        assert a[k].dtype == v.dtype and a[k].shape == v.shape
        assert torch.equal(a[k], v), k
    a["bf16"].zero_()  # each load owns its memory
    assert torch.equal(b["bf16"], state["bf16"])
    a["c64"].resize_(10)  # and it is a plain resizable tensor
    assert a["c64"].numel() == 10


def test_one_load_advises_a_bounded_number_of_tensors(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncckpt._memory as memory
    import asyncckpt.reader as reader

    # Counted at the call: the flags of a mapping would also show an earlier advice of
    # memory that the allocator hands out again.
    calls: list[tuple[int, int]] = []
    real = memory.madvise

    def advise(addr: int, n: int, advice: int) -> int:
        if advice != memory.MADV_HUGEPAGE:  # (the save's host buffer is faulted in too)
            return int(real(addr, n, advice))
        calls.append((addr, n))
        return 0

    monkeypatch.setattr(memory, "madvise", advise)
    monkeypatch.setattr(reader, "_MAX_ADVISED", 2)
    state = {f"t{i}": torch.full((3 << 20,), i, dtype=torch.int16) for i in range(3)}  # 6 MiB
    state["small"] = torch.ones(100)
    asyncckpt.save(state, tmp_path / "ck")
    got = asyncckpt.load(tmp_path / "ck")
    assert len(calls) == 2
    for addr, n in calls:  # whole huge pages inside one of the tensors
        assert addr % memory.HUGE_PAGE == 0 and n % memory.HUGE_PAGE == 0 and n > 0
        assert any(t.data_ptr() <= addr and addr + n <= t.data_ptr() + t.numel() * 2
                   for k, t in got.items() if k != "small")
    assert all(torch.equal(got[k], v) for k, v in state.items())


class ThreadRecordingStorage(LocalStorage):
    def __init__(self) -> None:
        self.threads: set[int] = set()

    def pread_into(self, fd: int, views, offset: int) -> int:  # type: ignore[no-untyped-def]
        self.threads.add(threading.get_ident())
        return super().pread_into(fd, views, offset)


@pytest.mark.parametrize("threads", [1, 3])
def test_a_load_reads_with_the_threads_asked_for(tmp_path: Path, threads: int) -> None:
    state = {f"t{i}": torch.full((1 << 18,), float(i)) for i in range(12)}
    storage = ThreadRecordingStorage()
    with asyncckpt.AsyncCheckpointer(tmp_path, storage=storage) as ckpt:
        ckpt.save(state, step=1)
        storage.threads.clear()
        got = ckpt.load(threads=threads)
    assert len(storage.threads) == threads
    assert all(torch.equal(got[k], v) for k, v in state.items())


@pytest.mark.parametrize(("numel", "want"), [(1 << 10, 1), (1 << 16, 2)])
def test_a_local_load_of_small_tensors_reads_on_one_thread(tmp_path: Path, numel: int,
                                                           want: int) -> None:
    """Tensors of a few KiB are Python's work more than memory's: with no ``threads``
    asked for, a local load reads them on one thread (two would only take turns with
    the GIL); larger ones are read by two."""
    state = {f"t{i}": torch.full((numel,), float(i)) for i in range(64)}
    storage = ThreadRecordingStorage()
    with asyncckpt.AsyncCheckpointer(tmp_path, storage=storage) as ckpt:
        ckpt.save(state, step=1)
        storage.threads.clear()
        got = ckpt.load()
    assert len(storage.threads) == min(want, os.cpu_count() or 1)
    assert all(torch.equal(got[k], v) for k, v in state.items())


def test_the_collector_is_paused_over_a_load_and_resumed_after(tmp_path: Path) -> None:
    """A load makes small objects per tensor (manifest, plan): no collection runs over
    them, on any thread of the load, and the collector is back on once it returns,
    whether it succeeded or failed."""
    import gc

    seen: list[bool] = []

    class Recording(LocalStorage):
        def pread_into(self, fd: int, views, offset: int) -> int:  # type: ignore[no-untyped-def]
            seen.append(gc.isenabled())
            return super().pread_into(fd, views, offset)

    state = {f"t{i}": torch.full((1 << 16,), float(i)) for i in range(8)}
    assert gc.isenabled()
    with asyncckpt.AsyncCheckpointer(tmp_path, storage=Recording()) as ckpt:
        ckpt.save(state, step=1)
        got = ckpt.load()
        assert seen and not any(seen) and gc.isenabled()
        assert all(torch.equal(got[k], v) for k, v in state.items())
        shard = next(tmp_path.glob("step_*/rank_*.safetensors"))
        with open(shard, "r+b") as f:  # a bad byte in the last tensor
            f.seek(-3, os.SEEK_END)
            b = f.read(1)
            f.seek(-3, os.SEEK_END)
            f.write(bytes([b[0] ^ 0xFF]))
        with pytest.raises(CheckpointCorruptError):
            ckpt.load(state)
        assert gc.isenabled()


def test_loads_of_any_size_share_one_set_of_reader_threads(tmp_path: Path) -> None:
    """A pool per thread count kept them all: loads of 2..9 tensors with threads=8 left
    1+2+...+7 idle reader threads behind."""
    def readers() -> int:
        return sum(t.name.startswith("asyncckpt-read") for t in threading.enumerate())

    for n in range(2, 10):
        asyncckpt.save({f"t{i}": torch.ones(1 << 12) for i in range(n)}, tmp_path / str(n))
    before = readers()
    for n in range(2, 10):
        got = asyncckpt.load(tmp_path / str(n), threads=8)
        assert len(got) == n and all(torch.equal(t, torch.ones(1 << 12)) for t in got.values())
    assert readers() <= max(before, 7)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX")
def test_a_child_forked_after_a_load_loads_too(tmp_path: Path) -> None:
    """A training process that resumed (a load with reader threads) and then forks
    workers: a worker's own load waited forever for reader threads the fork left behind."""
    state = {f"t{i}": torch.full((1 << 12,), float(i)) for i in range(8)}
    asyncckpt.save(state, tmp_path / "c")
    asyncckpt.load(tmp_path / "c", threads=4)  # the reader threads, in this process

    def child() -> int:
        got = asyncckpt.load(tmp_path / "c", threads=4)
        return 0 if all(torch.equal(got[k], v) for k, v in state.items()) else 2

    assert in_forked_child(child) == 0


def test_a_failing_group_stops_the_other_readers(tmp_path: Path) -> None:
    """One reader thread met a corrupt tensor: the others went on to read their whole
    share (a peer's fetch reported a corrupt first range only after the last one)."""
    state = {f"t{i:02d}": torch.full((1 << 19,), float(i)) for i in range(24)}  # 2 MiB each
    with asyncckpt.AsyncCheckpointer(tmp_path) as ckpt:
        ckpt.save(state, step=1)
        man = ckpt.manifest(1)
    step_dir = tmp_path / "step_000000001"
    chunk = man.tensors["t00"].chunks[0]  # the first item of the first group
    with open(step_dir / chunk.file, "r+b") as f:
        f.seek(chunk.byte_range[0] + 7)
        f.write(b"\xff")

    class Slow(CountingStorage):
        def pread_into(self, fd: int, views, offset: int) -> int:  # type: ignore[no-untyped-def]
            time.sleep(0.02)
            return super().pread_into(fd, views, offset)

    storage = Slow()
    with pytest.raises(CheckpointCorruptError, match="t00"):
        load_from(step_dir, None, storage, threads=2)
    assert storage.read < 6 * (1 << 21)  # the other group: one or two of its 12 tensors


@pytest.mark.usefixtures("ctrl_c")
def test_a_ctrl_c_in_the_wait_for_the_readers_is_raised_once_they_stopped(
        tmp_path: Path) -> None:
    """A review's Ctrl-C while a load into the caller's tensors waited for its reader
    threads raised at once, the threads still writing into those tensors."""
    state = {f"t{i:02d}": torch.full((1 << 16,), float(i)) for i in range(8)}
    with asyncckpt.AsyncCheckpointer(tmp_path) as ckpt:
        ckpt.save(state, step=1)
    main = threading.main_thread()
    release = threading.Event()
    reads: list[str] = []

    class Stalling(CountingStorage):  # the other thread's first read stalls
        def pread_into(self, fd: int, views, offset: int) -> int:  # type: ignore[no-untyped-def]
            if threading.current_thread() is not main and not release.is_set():
                assert release.wait(10)
            n = super().pread_into(fd, views, offset)
            reads.append("main" if threading.current_thread() is main else "helper")
            return n

    target = {k: torch.zeros_like(t) for k, t in state.items()}
    assert main.ident is not None
    threading.Timer(0.3, signal.pthread_kill, (main.ident, signal.SIGINT)).start()
    threading.Timer(0.6, release.set).start()
    with pytest.raises(KeyboardInterrupt):
        load_from(tmp_path / "step_000000001", target, Stalling(), threads=2)
    reads.append("raised")
    time.sleep(0.3)
    assert "helper" in reads and reads[-1] == "raised", reads  # (it stopped, after a read)
    assert reads.count("helper") == 1  # stopped at its next piece


@pytest.mark.parametrize("bad", [0, -2, 1.5, "4"])
def test_a_bad_threads_argument_is_refused_before_reading(tmp_path: Path, bad: object) -> None:
    asyncckpt.save({"x": torch.ones(3)}, tmp_path / "ck")
    with pytest.raises(asyncckpt.CheckpointConfigError, match="threads="):
        asyncckpt.load(tmp_path / "ck", threads=bad)  # type: ignore[arg-type]


# --- damaged or forged checkpoints: refused as corrupt, and fallback passes them ------------

SHARD = "rank_00000.safetensors"
HUGE = 2 ** 59  # more than any address space holds: no allocator can give it


def _reseal(step_dir: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite ``step_dir``'s manifest with ``edit`` and seal it again, as a forger would."""
    path = step_dir / "manifest.json"
    raw = path.read_bytes()
    doc = long_entries(json.loads(raw[:re.search(rb',"digest"', raw).start()] + b"}"))  # type: ignore[union-attr]
    edit(doc)
    path.write_bytes(seal(json.dumps(doc, separators=(",", ":")).encode()))


def _two_steps(root: Path) -> None:
    asyncckpt.save({"x": torch.arange(8, dtype=torch.float32)}, root, step=1)
    asyncckpt.save({"x": torch.arange(8, dtype=torch.float32) + 1}, root, step=2)


def _claim_huge_tensor(step_dir: Path) -> int:
    """Add a tensor of HUGE bytes past the end of the shard (as its size); returns the
    size the shard really has."""
    size = (step_dir / SHARD).stat().st_size

    def edit(doc: dict[str, Any]) -> None:
        doc["checksum"]["block_bytes"] = HUGE  # one checksum for the whole claimed tensor
        doc["files"][SHARD]["bytes"] = size + HUGE
        doc["tensors"]["big"] = {"dtype": "uint8", "shape": [HUGE], "kind": "torch", "chunks": [
            {"file": SHARD, "key": "big", "offsets": [0], "lengths": [HUGE],
             "byte_range": [size, size + HUGE], "checksums": ["0" * 16]}]}
        doc["skeleton"]["items"].append(["big", {"t": "tensor", "key": "big"}])

    _reseal(step_dir, edit)
    return size


class SparseStorage(LocalStorage):
    """Gives one file the size ``claimed``, as a sparse file of that size would have."""

    def __init__(self, path: Path, claimed: int) -> None:
        self.path, self.claimed = path, claimed
        self.fds: set[int] = set()

    def open_read(self, path: Path) -> int:
        fd = super().open_read(path)
        (self.fds.add if path == self.path else self.fds.discard)(fd)
        return fd

    def file_size(self, fd: int) -> int:
        return self.claimed if fd in self.fds else super().file_size(fd)


def test_a_size_no_memory_can_hold_is_a_corrupt_error_naming_the_tensor(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncckpt.reader as reader

    _two_steps(tmp_path)
    step_dir = tmp_path / "step_000000002"
    size = _claim_huge_tensor(step_dir)
    storage = SparseStorage(step_dir / SHARD, size + HUGE)
    # (the header is left as it was, which the load refuses first: as if forged to agree)
    monkeypatch.setattr(reader, "_header_problems", lambda *args, **kwargs: [])
    with pytest.raises(CheckpointCorruptError, match=f"tensor 'big' claims {HUGE} bytes, more "
                       "than this machine's memory could ever hold: the checkpoint is likely "
                       "damaged") as info:
        load_from(step_dir, None, storage)
    assert info.value.key == "big" and info.value.path == str(step_dir / SHARD)
    got = load_newest_intact(tmp_path, None, storage)
    assert torch.equal(got["x"], torch.arange(8, dtype=torch.float32))


def test_running_out_of_memory_on_an_intact_checkpoint_is_no_corruption(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A size the machine could hold that fails to allocate is memory, not damage: it
    # must not make fallback skip an intact step, nor verify call it corrupt.
    import asyncckpt.reader as reader

    _two_steps(tmp_path)

    def no_memory(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory (simulated)")

    monkeypatch.setattr(reader, "fresh_tensor", no_memory)
    for fallback in (False, True):
        with pytest.raises(asyncckpt.CheckpointError, match="could not be allocated "
                           r"\(out of memory\?\)") as info:
            asyncckpt.load(tmp_path, fallback=fallback)
        assert not isinstance(info.value, CheckpointCorruptError)


@pytest.mark.parametrize("error", [TimeoutError("timed out"), OSError(errno.ESTALE, "stale"),
                                   OSError(errno.EMFILE, "too many open files")])
def test_an_error_of_the_moment_is_raised_as_it_is_not_as_damage(
        tmp_path: Path, error: OSError) -> None:
    # A timeout, a stale NFS handle, no descriptors left: the data may be intact, so the
    # error propagates, and neither a load nor a fallback skips the step for it.
    _two_steps(tmp_path)

    class Failing(LocalStorage):
        def read_bytes(self, path: Path, limit: int) -> bytes:
            if path.parent.name == "step_000000002":
                raise error
            return super().read_bytes(path, limit)

        def listdir(self, path: Path) -> list[str]:
            if Path(path).name == "step_000000002" and self.listing:
                raise error
            return super().listdir(path)

    storage = Failing()
    storage.listing = False  # type: ignore[attr-defined]
    for call in (lambda: load_from(tmp_path / "step_000000002", None, storage),
                 lambda: load_newest_intact(tmp_path, None, storage)):
        with pytest.raises(type(error)) as info:
            call()
        assert info.value is error
    storage.listing = True  # type: ignore[attr-defined]  # not taken for "no such step"
    with pytest.raises(type(error)):
        commit.committed_steps(tmp_path, storage)


def test_a_load_refuses_a_header_that_disagrees_with_a_resealed_manifest(
        tmp_path: Path) -> None:
    """(security review) A shard's header rewritten to list a decoy over the bytes of 'w',
    the manifest re-sealed with the new header's checksum (xxh3 has no key): load gave the
    manifest's tensors, verify said corrupt, and safetensors tools saw the decoy."""
    import struct

    import xxhash

    asyncckpt.save({"w": torch.arange(8.0)}, tmp_path, step=1)
    asyncckpt.load(tmp_path)  # (a load's verdict is kept while both files stay as they are)
    step_dir = tmp_path / "step_000000001"
    raw = (step_dir / SHARD).read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header["decoy"] = header.pop("w")
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (n - len(text))  # (the same length: the body stays where it was)
    assert len(text) == n
    (step_dir / SHARD).write_bytes(raw[:8] + text + raw[8 + n:])

    def edit(doc: dict[str, Any]) -> None:
        doc["files"][SHARD]["header_checksum"] = xxhash.xxh3_64_hexdigest(raw[:8] + text)

    _reseal(step_dir, edit)
    for state in (None, {"w": torch.zeros(8)}):
        with pytest.raises(CheckpointCorruptError, match=r"header entry of tensor 'w' is null.*"
                           r"\(and 1 more\): the file's header and the manifest disagree"):
            asyncckpt.load(tmp_path, state)
    report = verify_checkpoint(step_dir, LocalStorage())
    assert any("its header lists 1 tensor(s) the manifest does not: 'decoy'" in p
               for p in report.problems), report.problems


def test_a_header_that_disagrees_with_the_manifest_is_keyed_by_its_tensor(
        tmp_path: Path) -> None:
    """(adversary trial) The dtype of 'c' edited in a re-sealed manifest (bf16 -> fp16,
    the same size): the error's ``key`` named 'a', the file's first tensor."""
    asyncckpt.save({"a": torch.ones(4), "b": torch.ones(4),
                    "c": torch.ones(3, dtype=torch.bfloat16)}, tmp_path, step=1)

    def edit(doc: dict[str, Any]) -> None:
        doc["tensors"]["c"]["dtype"] = "float16"

    _reseal(tmp_path / "step_000000001", edit)
    with pytest.raises(CheckpointCorruptError, match="header entry of tensor 'c'") as info:
        asyncckpt.load(tmp_path)
    assert info.value.key == "c"


def test_verify_reads_no_tensor_of_a_file_of_another_size(tmp_path: Path) -> None:
    # The file's size is checked first: the tensors of a file that failed it are not
    # allocated at their claimed sizes (which no file backs).
    _two_steps(tmp_path)
    step_dir = tmp_path / "step_000000002"
    size = _claim_huge_tensor(step_dir)
    report = verify_checkpoint(step_dir, LocalStorage())
    assert not report.ok and report.tensors == 0
    assert any(f"is {size} bytes but the manifest says {size + HUGE}" in p
               for p in report.problems), report.problems
    assert f"{step_dir / SHARD}: its 2 tensors were not read, as the file is damaged " \
           "(see above)" in report.problems
    assert not any("could ever hold" in p or "could not be allocated" in p
               for p in report.problems), report.problems


def test_a_checkpoint_of_format_version_1_still_loads(tmp_path: Path) -> None:
    """Checkpoints written before the short entries (format version 2) hold only long
    ones: they load, in place and fresh, and verify, as they did."""
    import dataclasses

    state = {"w": torch.randn(3, 5), "e": torch.empty(0, 2, dtype=torch.float16),
             "n": torch.arange(6, dtype=torch.int16).numpy(), "x": 1.5}
    asyncckpt.save(state, tmp_path, step=4)
    step_dir = tmp_path / "step_000000004"
    path = step_dir / "manifest.json"
    manifest = read_manifest(step_dir, LocalStorage())
    path.write_bytes(dataclasses.replace(manifest, format_version=1).to_json())
    doc = json.loads(path.read_bytes())
    assert doc["format_version"] == 1
    assert all(isinstance(t, dict) for t in doc["tensors"].values())  # long entries only
    assert read_manifest(step_dir, LocalStorage()).tensors == manifest.tensors
    fresh = asyncckpt.load(tmp_path)
    assert torch.equal(fresh["w"], state["w"]) and fresh["e"].shape == (0, 2)
    assert (fresh["n"] == state["n"]).all() and fresh["x"] == 1.5
    target = {"w": torch.zeros(3, 5), "e": torch.empty(0, 2, dtype=torch.float16),
              "n": torch.zeros(6, dtype=torch.int16).numpy(), "x": 0.0}
    w = target["w"]
    asyncckpt.load(tmp_path, target)
    assert target["w"] is w and torch.equal(w, state["w"]) and target["x"] == 1.5
    assert verify_checkpoint(step_dir, LocalStorage()).ok


def test_a_manifest_marked_partial_on_disk_is_corrupt(tmp_path: Path) -> None:
    # Only a peer's view may be partial: on disk it would make a load say the source
    # "does not have the box" (not found), and fallback would stop there.
    _two_steps(tmp_path)
    step_dir = tmp_path / "step_000000002"
    body = (step_dir / SHARD).read_bytes()

    def edit(doc: dict[str, Any]) -> None:  # keep only the first half of x
        doc["partial"] = True
        ch = doc["tensors"]["x"]["chunks"][0]
        lo = ch["byte_range"][0]
        ch.update(lengths=[4], byte_range=[lo, lo + 16],
                  checksums=[xxhash.xxh3_64_hexdigest(body[lo:lo + 16])])

    _reseal(step_dir, edit)
    with pytest.raises(CheckpointCorruptError, match="the manifest is marked partial"):
        asyncckpt.load(tmp_path)
    assert torch.equal(asyncckpt.load(tmp_path, fallback=True)["x"],
                       torch.arange(8, dtype=torch.float32))
    assert not verify_checkpoint(step_dir, LocalStorage()).ok


def _flip_last_byte(ckpt: asyncckpt.AsyncCheckpointer, step: int, key: str) -> None:
    """Damage the last byte of tensor ``key`` in ``step``'s shard."""
    end = ckpt.manifest(step).tensors[key].chunks[0].byte_range[1]
    with open(ckpt.directory / commit.step_dir_name(step) / SHARD, "r+b") as f:
        f.seek(end - 1)
        last = f.read(1)[0]
        f.seek(end - 1)
        f.write(bytes([last ^ 0xFF]))


def test_fallback_with_strict_false_puts_back_what_a_failed_step_wrote(
        tmp_path: Path) -> None:
    # Step 2 has "x", step 1 has not: reading step 2 fills x (its last byte damaged)
    # before the checksum fails; the load then falls back to step 1, whose strict=False
    # load leaves x alone. x must come out as it went in, not as step 2's bytes.
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="sync") as ck:
        ck.save({"a": torch.ones(4)}, step=1)
        ck.save({"a": torch.full((4,), 2.0), "x": torch.full((1000,), 5.0)}, step=2)
        _flip_last_byte(ck, 2, "x")
    x = torch.arange(1000.0)
    target = {"a": torch.zeros(4), "x": x}
    out = asyncckpt.load(tmp_path, target, fallback=True, strict=False)
    assert out["x"] is x and torch.equal(x, torch.arange(1000.0))
    assert torch.equal(out["a"], torch.ones(4))


def test_fallback_with_strict_false_names_targets_it_cannot_put_back(
        tmp_path: Path) -> None:
    # Steps 3 and 2 both have x and both are damaged; step 1 has no x. x was copied
    # neither before step 3 (step 2 fills it) nor before step 2 (step 3 had filled it):
    # its own value is gone, which the load must say rather than leave step 2's bytes.
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="sync") as ck:
        ck.save({"a": torch.ones(4)}, step=1)
        for step in (2, 3):
            ck.save({"a": torch.full((4,), 2.0), "x": torch.full((8,), float(step))},
                    step=step)
            _flip_last_byte(ck, step, "x")
    with pytest.raises(CheckpointCorruptError,
                       match=r"step 1 loaded, but the targets x hold what the failed "
                             r"attempts at steps \[2\] read into them"):
        asyncckpt.load(tmp_path, {"a": torch.zeros(4), "x": torch.zeros(8)}, fallback=True,
                       strict=False)


def test_a_manifest_of_another_step_is_corrupt(tmp_path: Path) -> None:
    _two_steps(tmp_path)
    step1, step2 = tmp_path / "step_000000001", tmp_path / "step_000000002"
    shutil.rmtree(step2)
    shutil.copytree(step1, step2)  # step 2's directory now holds step 1
    with pytest.raises(CheckpointCorruptError, match="is the manifest of step 1, but its "
                       "directory is that of step 2") as info:
        asyncckpt.load(tmp_path)
    assert info.value.path == str(step2 / "manifest.json")
    assert torch.equal(asyncckpt.load(tmp_path, fallback=True)["x"],
                       torch.arange(8, dtype=torch.float32))
    shutil.copytree(step1, tmp_path / "best")  # a copy under a name of its own is fine
    assert torch.equal(asyncckpt.load(tmp_path / "best")["x"],
                       torch.arange(8, dtype=torch.float32))


class EIOStorage(LocalStorage):
    """Fails one kind of read of the files under ``bad`` with EIO, as a failing disk does."""

    def __init__(self, bad: Path, what: str) -> None:
        self.bad, self.what = bad, what
        self.fds: set[int] = set()

    def _eio(self) -> OSError:
        return OSError(errno.EIO, "Input/output error")

    def read_bytes(self, path: Path, limit: int) -> bytes:
        if self.what == "manifest" and path.parent == self.bad:
            raise self._eio()
        return super().read_bytes(path, limit)

    def open_read(self, path: Path) -> int:
        fd = super().open_read(path)
        (self.fds.add if path.parent == self.bad else self.fds.discard)(fd)
        return fd

    def file_size(self, fd: int) -> int:
        if self.what == "size" and fd in self.fds:
            raise self._eio()
        return super().file_size(fd)

    def pread_into(self, fd: int, views, offset: int) -> int:  # type: ignore[no-untyped-def]
        if self.what == "header" and fd in self.fds and offset == 0:
            raise self._eio()
        return super().pread_into(fd, views, offset)


@pytest.mark.parametrize("what", ["manifest", "size", "header"])
def test_a_read_error_is_a_corrupt_error_naming_the_file(tmp_path: Path, what: str) -> None:
    _two_steps(tmp_path)
    step_dir = tmp_path / "step_000000002"
    storage = EIOStorage(step_dir, what)
    name = "manifest.json" if what == "manifest" else SHARD
    with pytest.raises(CheckpointCorruptError, match="Input/output error") as info:
        load_from(step_dir, None, storage)
    assert info.value.path == str(step_dir / name)
    got = load_newest_intact(tmp_path, None, storage)
    assert torch.equal(got["x"], torch.arange(8, dtype=torch.float32))
    if what != "manifest":
        assert any("Input/output error" in p for p in verify_checkpoint(step_dir, storage).problems)


def test_an_eio_is_passed_over_but_marks_no_step(tmp_path: Path) -> None:
    """(storage trial) An NFS soft mount's outage read as EIO on every step: each was marked
    damaged, and once the outage passed the next save's retention deleted them, intact.
    A fallback goes past such a step, and a plain load raises, but neither marks it."""
    outage = [True]

    class Outage(LocalStorage):
        def pread_into(self, fd: int, views, offset: int) -> int:  # type: ignore[no-untyped-def]
            if outage[0]:
                raise OSError(errno.EIO, "Input/output error")
            return super().pread_into(fd, views, offset)

    storage = Outage()
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="sync", keep_last=3,
                                     storage=storage) as ck:
        for s in (1, 2, 3):
            outage[0] = False
            ck.save({"x": torch.full((8,), float(s))}, step=s)
        outage[0] = True
        with pytest.raises(CheckpointCorruptError, match="Input/output error"):
            ck.load(step=3)
        with pytest.raises(CheckpointCorruptError):
            ck.load({"x": torch.zeros(8)}, fallback=True)
        assert not list(tmp_path.glob("step_*/damaged.json"))
        outage[0] = False
        ck.save({"x": torch.full((8,), 4.0)}, step=4)
        assert ck.steps() == [2, 3, 4]  # (keep_last=3 of intact steps: none taken for damaged)


class HeaderCheckFails(LocalStorage):
    """Fails only verify's read of the file headers (its own pass), with ``code``."""

    def __init__(self, code: int) -> None:
        self.code = code

    def pread_into(self, fd: int, views, offset: int) -> int:  # type: ignore[no-untyped-def]
        caller = sys._getframe(1)  # (read_full, called by _check_header)
        outer = caller.f_back
        if "_check_header" in (caller.f_code.co_name, outer and outer.f_code.co_name):
            raise OSError(self.code, os.strerror(self.code))
        return super().pread_into(fd, views, offset)


def test_verify_raises_an_error_of_the_moment_in_the_header_check(tmp_path: Path) -> None:
    """Out of memory while checking a header says nothing of the file: it is raised, not
    listed as damage (verify's verdict is 'corrupt'); EIO is still listed."""
    _two_steps(tmp_path)
    step_dir = tmp_path / "step_000000002"
    with pytest.raises(OSError) as info:
        verify_checkpoint(step_dir, HeaderCheckFails(errno.ENOMEM))
    assert info.value.errno == errno.ENOMEM
    problems = verify_checkpoint(step_dir, HeaderCheckFails(errno.EIO)).problems
    assert problems == [f"{step_dir / SHARD} cannot be read (Input/output error): the "
                        "checkpoint is damaged or unreadable"], problems


@pytest.mark.parametrize("how", ["directory", "symlink_loop", "fifo"])
def test_a_manifest_that_is_no_readable_file_is_corrupt(tmp_path: Path, how: str) -> None:
    _two_steps(tmp_path)
    manifest = tmp_path / "step_000000002" / "manifest.json"
    manifest.unlink()
    if how == "directory":
        manifest.mkdir()
    elif how == "symlink_loop":
        manifest.symlink_to(manifest)
    else:
        os.mkfifo(manifest)
    with pytest.raises(CheckpointCorruptError) as info:
        unblocked(manifest, lambda: asyncckpt.load(tmp_path))
    assert info.value.path == str(manifest)
    got = unblocked(manifest, lambda: asyncckpt.load(tmp_path, fallback=True))
    assert torch.equal(got["x"], torch.arange(8, dtype=torch.float32))


def unblocked(fifo: Path, fn: Callable[[], Any], seconds: float = 10.0) -> Any:
    """``fn()``; fails the test if it is still blocked after ``seconds`` (first opening
    ``fifo`` for writing, which lets a reader blocked in its open go on)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(seconds)
        pytest.fail(f"blocked for {seconds}s on the FIFO {fifo}")
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_a_fifo_for_a_shard_file_is_refused_without_blocking(tmp_path: Path) -> None:
    _two_steps(tmp_path)
    step_dir = tmp_path / "step_000000002"
    shard = step_dir / SHARD
    shard.unlink()
    os.mkfifo(shard)
    with pytest.raises(CheckpointCorruptError, match="is not a regular file") as info:
        unblocked(shard, lambda: asyncckpt.load(tmp_path))
    assert info.value.path == str(shard)
    got = unblocked(shard, lambda: asyncckpt.load(tmp_path, fallback=True))
    assert torch.equal(got["x"], torch.arange(8, dtype=torch.float32))
    report = unblocked(shard, lambda: verify_checkpoint(step_dir, LocalStorage()))
    assert any(f"{shard} is not a regular file" in p for p in report.problems), report.problems


class _HidesTheStep(LocalStorage):
    """Opening a shard file first takes the step away, as retention does (``hide``) or
    only that file (damage)."""

    def __init__(self, how: str) -> None:
        self.how = how

    def open_read(self, path: Path) -> int:
        if Path(path).name.startswith("rank_"):
            step_dir = Path(path).parent
            if self.how == "hide":
                step_dir.rename(step_dir.parent / f".{step_dir.name}.deleting-x")
            else:
                Path(path).unlink()
        return super().open_read(path)


@pytest.mark.parametrize("how,error", [("hide", asyncckpt.CheckpointNotFoundError),
                                       ("file", CheckpointCorruptError)])
def test_a_step_deleted_while_read_is_not_reported_as_damage(
        tmp_path: Path, how: str, error: type[Exception]) -> None:
    ck = asyncckpt.AsyncCheckpointer(tmp_path)
    ck.save({"w": torch.arange(10.0)}, step=1)
    ck.close()
    with pytest.raises(error) as info:
        load_from(tmp_path / commit.step_dir_name(1), None, _HidesTheStep(how))
    if how == "hide":
        assert "deleted while it was being read" in str(info.value)
        assert not isinstance(info.value, CheckpointCorruptError)


def test_a_fallback_load_whose_steps_retention_deleted_loads_the_newer_one(
        tmp_path: Path) -> None:
    # Another process's keep_last=1: it committed step 2 and deleted step 1, the one this
    # load listed, as it read it. Not "no intact checkpoint": step 2 is there, and intact.
    newer = tmp_path / "newer"
    asyncckpt.save({"w": torch.full((4,), 2.0)}, newer, step=2)
    root = tmp_path / "root"
    asyncckpt.save({"w": torch.full((4,), 1.0)}, root, step=1)

    class Retention(LocalStorage):
        def open_read(self, path: Path) -> int:
            p = Path(path)
            if p.name.startswith("rank_") and p.parent.name == commit.step_dir_name(1):
                shutil.copytree(newer / commit.step_dir_name(2), root / commit.step_dir_name(2))
                p.parent.rename(root / ".step_000000001.deleting-x")
            return super().open_read(path)

    with asyncckpt.AsyncCheckpointer(root, storage=Retention()) as ck:
        target = {"w": torch.zeros(4)}
        ck.load(target, fallback=True)
    assert target["w"].tolist() == [2.0] * 4


def test_verify_of_a_step_deleted_meanwhile_says_so_rather_than_corrupt(tmp_path: Path) -> None:
    ck = asyncckpt.AsyncCheckpointer(tmp_path)
    ck.save({"w": torch.arange(10.0)}, step=1)
    ck.close()
    with pytest.raises(asyncckpt.CheckpointNotFoundError, match="deleted while"):
        verify_checkpoint(tmp_path / commit.step_dir_name(1), _HidesTheStep("hide"))




def test_a_destination_without_memory_of_its_own_is_filled_by_copy(tmp_path: Path) -> None:
    """Flattening refuses wrapper subclasses as targets; one that reaches the reader anyway
    must not be read into at its data pointer, 0 (EFAULT, blamed on a read-only mapping)."""
    from asyncckpt.reader import load_tensors

    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(4))
    asyncckpt.save({"x": x}, tmp_path)
    step_dir = tmp_path / "step_000000000"
    storage = LocalStorage()
    dst = Wrapped(torch.zeros(5, 7))
    assert dst.data_ptr() == 0
    load_tensors(step_dir, read_manifest(step_dir, storage), {"x": dst}, storage)
    assert torch.equal(dst.inner, x)  # type: ignore[attr-defined]


# --- a load opens only the files it reads ---------------------------------------------------

class OpenCounting(LocalStorage):
    """Counts the opens of each file, by name."""

    def __init__(self) -> None:
        self.opened: dict[str, int] = {}

    def open_read(self, path: Path) -> int:
        self.opened[Path(path).name] = self.opened.get(Path(path).name, 0) + 1
        return super().open_read(path)


ROWS = torch.arange(24, dtype=torch.float32).reshape(8, 3)


def _saved_by_two_ranks(root: Path) -> Path:
    """``w`` of ROWS, rows 0..3 saved by rank 0 and rows 4..7 by rank 1 (one file each):
    two checkpointers in threads of this process, paired by a HashStore."""
    import torch.distributed as dist

    store = dist.HashStore()

    def rank(r: int) -> None:
        with asyncckpt.AsyncCheckpointer(root, mode="sync", rank=r, world_size=2,
                                         store=store, timeout_s=30) as ck:
            ck.save({"w": ROWS[4 * r:4 * r + 4].clone()}, 1, shards={
                "w": asyncckpt.ShardMetadata(global_shape=(8, 3), offsets=(4 * r, 0))})

    all_ok(in_threads(rank))
    return root / commit.step_dir_name(1)


def test_verify_reads_through_a_buffer_of_its_own(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # verify allocated each tensor whole: a tensor sharded over many ranks (larger than
    # one machine's memory) could not be verified, and was even reported damaged. Then
    # each chunk: allocating (and faulting in) memory of every tensor's size for bytes
    # that are dropped. Now a buffer per thread, whatever the tensors' sizes.
    import asyncckpt.reader as readermod

    step_dir = _saved_by_two_ranks(tmp_path)
    real = readermod.fresh_tensor
    sizes: list[tuple[int, ...]] = []

    def recording(shape: tuple[int, ...], dtype: torch.dtype, **kw: Any) -> torch.Tensor:
        sizes.append(tuple(shape))
        return real(shape, dtype, **kw)

    monkeypatch.setattr(readermod, "fresh_tensor", recording)
    monkeypatch.setattr(readermod, "_VERIFY_PIECE", 20)  # each chunk (48 bytes) in 3 reads
    report = verify_checkpoint(step_dir, LocalStorage())
    assert report.ok and report.tensors == 1 and report.bytes == 8 * 3 * 4, report.problems
    assert sizes == []
    # and a damaged byte in the last piece of the second chunk is still found, naming
    # the tensor
    manifest = read_manifest(step_dir, LocalStorage())
    ch = manifest.tensors["w"].chunks[1]
    with open(step_dir / ch.file, "r+b") as f:
        f.seek(ch.byte_range[1] - 1)
        last = f.read(1)[0]
        f.seek(ch.byte_range[1] - 1)
        f.write(bytes([last ^ 1]))
    problems = verify_checkpoint(step_dir, LocalStorage()).problems
    assert len(problems) == 1 and "checksum mismatch in tensor 'w'" in problems[0], problems


@pytest.mark.parametrize("threads", [1, 2, 3, 7])
def test_verify_on_threads_reports_what_one_thread_does_with_its_progress(
        tmp_path: Path, threads: int) -> None:
    """Damage in several tensors, checked on any number of threads: the same
    problems in the manifest's order, each tensor once, and progress that counts every
    byte checked, ending at the total."""
    state = {f"t{i}": torch.arange(300.0 * (i + 1)) for i in range(12)}
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="sync", block_bytes=4096) as ckpt:
        ckpt.save(state, step=0)
    step_dir = tmp_path / commit.step_dir_name(0)
    manifest = read_manifest(step_dir, LocalStorage())
    for key, at in (("t9", 0), ("t2", -1), ("t9", -1), ("t5", 4096)):  # t9 twice
        ch = manifest.tensors[key].chunks[0]
        pos = ch.byte_range[0] + at if at >= 0 else ch.byte_range[1] + at
        with open(step_dir / ch.file, "r+b") as f:
            f.seek(pos)
            b = f.read(1)[0]
            f.seek(pos)
            f.write(bytes([b ^ 0x40]))
    seen: list[tuple[int, int]] = []
    report = verify_checkpoint(step_dir, LocalStorage(), threads=threads,
                               progress=lambda done, total: seen.append((done, total)))
    assert [p.split("checksum mismatch in tensor ")[1][:4] for p in report.problems] == [
        "'t2'", "'t5'", "'t9'"], report.problems
    assert "(block 1," in report.problems[1] and "(block 0," in report.problems[2]
    assert report.tensors == 9
    assert report.bytes == sum(t.nbytes for k, t in state.items() if k not in ("t2", "t5", "t9"))
    total = sum(t.nbytes for t in state.values())
    assert seen and all(t == total for _, t in seen)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen) and seen[-1][0] == total


@pytest.mark.parametrize("threads", [1, 2])
def test_verify_raises_what_is_no_damage_from_any_reading_thread(tmp_path: Path,
                                                                 threads: int) -> None:
    """No permission to read a file part way (as a changed ACL on a parallel filesystem
    gives) says nothing of the checkpoint: verify raises it, from whichever thread read
    that part, rather than report damage."""
    from asyncckpt.errors import CheckpointPermissionError

    state = {f"t{i}": torch.arange(300_000.0) + i for i in range(8)}  # 1.2 MB each
    asyncckpt.save(state, tmp_path, step=1)
    step_dir = tmp_path / "step_000000001"
    last = read_manifest(step_dir, LocalStorage()).tensors["t7"].chunks[0].byte_range

    class Forbidden(LocalStorage):
        def pread_into(self, fd: int, views, offset: int) -> int:  # type: ignore[no-untyped-def]
            if offset >= last[0]:  # the last tensor: the second thread's part
                raise OSError(errno.EACCES, os.strerror(errno.EACCES))
            return super().pread_into(fd, views, offset)

    with pytest.raises(CheckpointPermissionError, match="t7"):
        verify_checkpoint(step_dir, Forbidden(), threads=threads)
    assert verify_checkpoint(step_dir, LocalStorage(), threads=threads).ok


def _progress_log() -> tuple[list[tuple[int, int]], Callable[[int, int], None]]:
    seen: list[tuple[int, int]] = []
    return seen, lambda done, total: seen.append((done, total))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_load_reports_its_progress_to_the_total(tmp_path: Path, threads: int) -> None:
    state = {f"t{i}": torch.arange(1000.0 * (i + 1)) for i in range(9)}
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="sync") as ckpt:
        ckpt.save(state, step=1)
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        seen, progress = _progress_log()
        ckpt.load(target, threads=threads, progress=progress)
    total = sum(t.nbytes for t in state.values())
    assert seen and {t for _, t in seen} == {total}
    assert [d for d, _ in seen] == sorted(d for d, _ in seen) and seen[-1][0] == total
    assert all(torch.equal(target[k], v) for k, v in state.items())
    seen, progress = _progress_log()  # fresh, through the module function
    assert torch.equal(asyncckpt.load(tmp_path, progress=progress)["t8"], state["t8"])
    assert seen[-1] == (total, total)


def test_a_resharding_load_reports_progress_to_its_total(tmp_path: Path) -> None:
    step_dir = _saved_by_two_ranks(tmp_path)
    seen, progress = _progress_log()
    target = {"w": torch.zeros(4, 3)}
    load_from(step_dir, target, LocalStorage(), progress=progress,
              shards={"w": asyncckpt.ShardMetadata(global_shape=(8, 3), offsets=(2, 0))})
    assert torch.equal(target["w"], ROWS[2:6])  # rows of both ranks' chunks
    assert seen and seen[-1][0] == seen[-1][1] == 2 * 4 * 3 * 4  # the two chunks read from


def test_a_fallback_load_reports_progress_for_each_step_it_tries(tmp_path: Path) -> None:
    n = 640_000  # 2.5 MB each: read one by one, not as one batch
    for step in (1, 2):
        asyncckpt.save({k: torch.full((n,), float(step)) for k in "abc"}, tmp_path, step=step)
    step_dir = tmp_path / "step_000000002"
    c = read_manifest(step_dir, LocalStorage()).tensors["c"].chunks[0]
    with open(step_dir / SHARD, "r+b") as f:  # damage step 2's last tensor: back to step 1
        f.seek(c.byte_range[1] - 1)
        b = f.read(1)[0]
        f.seek(c.byte_range[1] - 1)
        f.write(bytes([b ^ 1]))
    seen, progress = _progress_log()
    got = asyncckpt.load(tmp_path, fallback=True, threads=1, progress=progress)
    assert torch.equal(got["c"], torch.full((n,), 1.0))
    each = 4 * n
    assert seen == [(each, 3 * each), (2 * each, 3 * each),  # step 2, up to its damage
                    (each, 3 * each), (2 * each, 3 * each), (3 * each, 3 * each)], seen


def _load_rows(step_dir: Path, first: int, storage: LocalStorage) -> torch.Tensor:
    target = {"w": torch.zeros(4, 3)}
    load_from(step_dir, target, storage,
              shards={"w": asyncckpt.ShardMetadata(global_shape=(8, 3), offsets=(first, 0))})
    return target["w"]


def test_a_load_opens_only_the_files_holding_its_box(tmp_path: Path) -> None:
    """Every rank opened and read the header of every file holding any part of a tensor
    it loads (world x world opens for a sharded model), and so failed on a damaged file
    it does not need."""
    step_dir = _saved_by_two_ranks(tmp_path)
    assert {c.file for c in read_manifest(step_dir, LocalStorage()).tensors["w"].chunks} == {
        "rank_00000.safetensors", "rank_00001.safetensors"}
    storage = OpenCounting()
    assert torch.equal(_load_rows(step_dir, 0, storage), ROWS[:4])
    assert "rank_00001.safetensors" not in storage.opened, storage.opened
    assert storage.opened.get("rank_00000.safetensors", 0) >= 1, storage.opened
    # the file this load does not need is damaged: the load goes on, verify tells
    other = step_dir / "rank_00001.safetensors"
    with open(other, "r+b") as f:
        f.truncate(other.stat().st_size - 5)
    assert torch.equal(_load_rows(step_dir, 0, LocalStorage()), ROWS[:4])
    with pytest.raises(CheckpointCorruptError, match=r"rank_00001\.safetensors"):
        _load_rows(step_dir, 4, LocalStorage())
    report = verify_checkpoint(step_dir, LocalStorage())
    assert not report.ok and any("rank_00001.safetensors" in p for p in report.problems)
    other.unlink()
    assert torch.equal(_load_rows(step_dir, 0, LocalStorage()), ROWS[:4])
    assert any("rank_00001.safetensors is missing" in p
               for p in verify_checkpoint(step_dir, LocalStorage()).problems)


def test_a_truncated_shard_names_the_tensors_past_its_end(tmp_path: Path) -> None:
    state = {"a": torch.ones(1000), "b": torch.arange(5000.0), "c": torch.zeros(3000)}
    asyncckpt.save(state, tmp_path / "ck")
    step_dir = next((tmp_path / "ck").glob("step_*"))
    m = read_manifest(step_dir, LocalStorage())
    (shard,) = m.files
    ends = {k: t.chunks[0].byte_range for k, t in m.tensors.items()}
    last = max(ends, key=lambda k: ends[k][1])
    with open(step_dir / shard, "r+b") as f:  # cut into the last tensor's bytes only
        f.truncate(ends[last][1] - 8)
    with pytest.raises(CheckpointCorruptError, match=rf"truncated or replaced; tensor\(s\) "
                                                     rf"'{last}' lie past its end") as info:
        asyncckpt.load(tmp_path / "ck", {k: torch.empty_like(v) for k, v in state.items()})
    assert info.value.key == last and info.value.path == str(step_dir / shard)


def test_a_shard_with_bytes_appended_is_not_said_to_be_truncated(tmp_path: Path) -> None:
    # (an adversary trial: "truncated or replaced" of a file grown by junk at its end)
    asyncckpt.save({"a": torch.ones(10)}, tmp_path, step=1)
    (shard,) = (tmp_path / "step_000000001").glob("*.safetensors")
    with open(shard, "ab") as f:
        f.write(b"junk")
    with pytest.raises(CheckpointCorruptError, match=r"written to past its end \(bytes "
                                                     r"appended\), or replaced; load another "
                                                     r"step; asyncckpt\.load\(\.\.\., "
                                                     r"fallback=True\) loads the newest"):
        asyncckpt.load(tmp_path)


def test_a_reusing_load_fills_only_targets_it_may_and_returns_the_checkpoints_tree(
        tmp_path: Path) -> None:
    from asyncckpt.loader import load_reusing

    g = torch.Generator().manual_seed(3)
    saved = {"a": torch.randn(4, generator=g), "b": torch.randn(4, generator=g),
             "c": torch.randn(2, 3, generator=g), "d": torch.randn(5, generator=g), "n": 7}
    asyncckpt.save(saved, tmp_path, step=1)
    shared = torch.zeros(4)
    param = torch.zeros(5, requires_grad=True)
    loss = (param * param).sum()  # a step in flight, which saved the parameter
    mine = {"a": shared, "b": shared,  # one memory for two saved keys: neither reused
            "c": torch.zeros(3, 2),  # another shape
            "d": param.detach(), "n": 0, "x": torch.zeros(1)}
    out = load_reusing(tmp_path / "step_000000001", mine, LocalStorage())
    loss.backward()  # (torchft receives while a step runs: its backward must not fail)
    assert list(out) == ["a", "b", "c", "d", "n"] and out["n"] == 7
    for k in "abcd":
        assert torch.equal(out[k], saved[k]), k
    assert out["d"] is mine["d"]  # filled in place
    assert out["a"] is not shared and out["b"] is not shared and not shared.any()
    assert out["c"] is not mine["c"] and not mine["c"].any()
    assert mine["n"] == 0 and torch.equal(mine["x"], torch.zeros(1))  # nothing else touched


def test_a_reusing_load_leaves_excluded_parts_out(tmp_path: Path) -> None:
    from asyncckpt.loader import load_reusing

    saved = {"model": {"w": torch.arange(4.0)}, "optim": {"m": torch.ones(3)}, "n": 2}
    asyncckpt.save(saved, tmp_path, step=1)
    mine = {"model": {"w": torch.zeros(4)}, "optim": {"m": torch.zeros(3)}}
    out = load_reusing(tmp_path / "step_000000001", mine, LocalStorage(), exclude=("optim",))
    assert set(out) == {"model", "n"} and out["model"]["w"] is mine["model"]["w"]
    assert torch.equal(mine["model"]["w"], torch.arange(4.0))
    assert not mine["optim"]["m"].any()


@pytest.mark.parametrize("cast", [False, True])
def test_large_boxes_go_through_the_temporary_a_slab_at_a_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cast: bool) -> None:
    # A resharding (or cast) read went through one temporary the size of its whole box:
    # a GB-sized shard needed a GB more. Now in slabs of rows of at most _BOX_PIECE.
    import asyncckpt.reader as rd
    from asyncckpt import ShardMetadata

    monkeypatch.setattr(rd, "_BOX_PIECE", 1000)  # (with blocks of 4 KiB: 16 KiB pieces)
    spans: list[int] = []
    real = rd._read_box_part

    def recording(*a: Any, **kw: Any) -> None:
        spans.append(a[8] - a[7])  # hi - lo
        real(*a, **kw)

    monkeypatch.setattr(rd, "_read_box_part", recording)
    g = torch.Generator().manual_seed(11)
    w = torch.randn(400, 300, generator=g)
    with asyncckpt.AsyncCheckpointer(tmp_path, block_bytes=4096) as ck:
        ck.save({"w": w.to(torch.bfloat16) if cast else w}, 1)
        target = {"w": torch.zeros(250, 120)}
        ck.load(target, shards={"w": ShardMetadata((400, 300), (100, 60))}, cast=cast)
    want = (w.to(torch.bfloat16).float() if cast else w)[100:350, 60:180]
    assert torch.equal(target["w"], want)
    size = 2 if cast else 4
    rows = 4 * 4096 // (120 * size)  # of the box's 250, per slab
    assert len(spans) == -(-250 // rows) and max(spans) <= rows * 300 * size


def test_a_cast_read_still_verifies_every_byte(tmp_path: Path) -> None:
    asyncckpt.save({"w": torch.arange(1000.0).to(torch.bfloat16)}, tmp_path, step=1)
    shard = tmp_path / "step_000000001" / "rank_00000.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-3] ^= 0x40
    shard.write_bytes(bytes(raw))
    target = {"w": torch.zeros(1000)}
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch in tensor 'w'"):
        asyncckpt.load(tmp_path, target, cast=True)


def test_boxes_with_a_leading_1_or_one_long_row_are_split_too(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncckpt.reader as rd
    from asyncckpt import ShardMetadata

    monkeypatch.setattr(rd, "_BOX_PIECE", 1000)  # (with blocks of 4 KiB: 16 KiB pieces)
    spans: list[int] = []
    real = rd._read_box_part

    def recording(*a: Any, **kw: Any) -> None:
        spans.append(a[8] - a[7])
        real(*a, **kw)

    monkeypatch.setattr(rd, "_read_box_part", recording)
    g = torch.Generator().manual_seed(12)
    cube = torch.randn(2, 60, 400, generator=g)  # a box (1, 50, 400): 80 KB, leading 1
    row = torch.randn(3, 30000, generator=g)  # a box (1, 20000): one row of 80 KB
    with asyncckpt.AsyncCheckpointer(tmp_path, block_bytes=4096) as ck:
        ck.save({"cube": cube, "row": row}, 1)
        target = {"cube": torch.zeros(1, 50, 400, dtype=torch.float64),
                  "row": torch.zeros(1, 20000)}
        ck.load(target, cast=True, shards={"cube": ShardMetadata((2, 60, 400), (1, 5, 0)),
                                           "row": ShardMetadata((3, 30000), (2, 7000))})
    assert torch.equal(target["cube"], cube[1:2, 5:55].double())
    assert torch.equal(target["row"], row[2:3, 7000:27000])
    assert len(spans) >= 10 and max(spans) <= 4 * 4096 + 400 * 4


@pytest.mark.parametrize("how", ["checkpoint", "safetensors"])
def test_a_0_dim_tensor_is_cast(tmp_path: Path, how: str) -> None:
    from safetensors.torch import save_file

    v = torch.tensor(2.6592, dtype=torch.bfloat16)  # CLIP's logit_scale, as published
    target = {"scale": torch.tensor(0.0)}
    if how == "checkpoint":
        asyncckpt.save({"scale": v}, tmp_path, step=1)
        asyncckpt.load(tmp_path, target, cast=True)
    else:
        save_file({"scale": v}, str(tmp_path / "f.safetensors"))
        asyncckpt.load_safetensors(tmp_path / "f.safetensors", target)
    assert target["scale"].dtype == torch.float32 and target["scale"].item() == v.item()


def test_verify_makes_each_chunk_of_a_table_once(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """verify walked every chunk of the checkpoint once per file: with a table, that made
    files x chunks Chunk objects (64 ranks x 300 tensors: 1.8 s rather than 0.4)."""
    from asyncckpt import manifest as manifest_module

    world = 6
    monkeypatch.setattr(manifest_module, "TABLE_MIN_CHUNKS", 2)
    store = torch.distributed.HashStore()

    def rank(r: int) -> None:
        with asyncckpt.AsyncCheckpointer(tmp_path, mode="sync", rank=r, world_size=world,
                                         store=store, timeout_s=60) as ck:
            ck.save({f"w{i}": torch.full((2, 3), float(r + i)) for i in range(4)}, step=1,
                    shards={f"w{i}": asyncckpt.ShardMetadata((2 * world, 3), (2 * r, 0))
                            for i in range(4)})

    all_ok(in_threads(rank, world=world))
    made = [0]
    real = manifest_module.ChunkTable._made

    def counting(self: Any, which: Any) -> Any:
        for ch in real(self, which):
            made[0] += 1
            yield ch

    monkeypatch.setattr(manifest_module.ChunkTable, "_made", counting)
    report = verify_checkpoint(tmp_path / "step_000000001", LocalStorage())
    assert report.ok and report.tensors == 4
    assert made[0] == 4 * world  # each chunk once (not once per file)


class _ShortReads(LocalStorage):
    """A network storage's reads: at most 1,000 bytes a call (honestly counted)."""

    def pread_into(self, fd: int, views: Any, offset: int) -> int:
        return os.preadv(fd, [views[0][:1000]], offset)


def test_short_reads_of_a_storage_are_read_through_and_are_no_damage(tmp_path: Path) -> None:
    """A trial's storage returned 1,000 of the header's 4,096 bytes: fallback loads called
    both intact steps corrupt, and marked them damaged for good."""
    states = {s: {"w": torch.arange(3000.0) + s, "b": torch.ones(7, dtype=torch.int8)}
              for s in (1, 2)}
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="sync") as ck:
        for s, state in states.items():
            ck.save(state, s)
    ck = asyncckpt.AsyncCheckpointer(tmp_path, storage=_ShortReads())
    for got in (ck.load(), ck.load(fallback=True), ck.load(step=1)):
        step = 1 if torch.equal(got["w"], states[1]["w"]) else 2
        assert all(torch.equal(got[k], v) for k, v in states[step].items())
    assert not list(tmp_path.glob("step_*/damaged.json"))
    report = verify_checkpoint(tmp_path / "step_000000002", _ShortReads())
    assert report.ok, report.problems


class _CloseFails(LocalStorage):
    def close(self, fd: int) -> None:
        super().close(fd)
        raise OSError(errno.EIO, "close: Input/output error (injected)")


def test_a_close_that_fails_after_a_good_read_is_logged_not_raised(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """(A trial: a load whose bytes were all read and checked failed with a bare OSError
    from the storage's close, no CheckpointError.)"""
    state = {"w": torch.arange(100.0), "v": torch.ones(3)}
    asyncckpt.save(state, tmp_path, step=1)
    for verify in (True, False):
        got = asyncckpt.AsyncCheckpointer(tmp_path, storage=_CloseFails()).load(verify=verify)
        assert all(torch.equal(got[k], v) for k, v in state.items())
    assert "closing a checkpoint file after reading it failed (OSError: [Errno 5]" in caplog.text
    assert verify_checkpoint(tmp_path / "step_000000001", _CloseFails()).ok


def test_a_step_retired_before_its_manifest_is_read_is_told_deleted_while_read(
        tmp_path: Path) -> None:
    """A QA re-check's reader beside a keep_last=1 saver was told, 1 load in ~25,000,
    "step_N has no manifest.json: not a committed checkpoint" of a step retention removed
    as it was read."""
    import asyncckpt
    from asyncckpt.reader import read_manifest
    from asyncckpt.storage import LocalStorage

    asyncckpt.save({"w": torch.ones(2)}, tmp_path, step=1)
    step_dir = tmp_path / "step_000000001"

    class Retiring(LocalStorage):
        def read_bytes(self, path: Path, limit: int) -> bytes:
            step_dir.rename(tmp_path / ".step_000000001.deleting-0123456789ab")
            return super().read_bytes(path, limit)

    with pytest.raises(asyncckpt.CheckpointNotFoundError, match="was deleted while it was "
                       "being read"):
        read_manifest(step_dir, Retiring())
