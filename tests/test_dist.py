"""The Store protocol's waits, on an in-memory HashStore (ranks as threads; one test
replaces a rank by a process of its own)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

import asyncckpt
from _faults import StuckCommit
from _ranks import all_ok, in_threads
from asyncckpt import AsyncCheckpointer, ShardMetadata
from asyncckpt.dist import DistContext, FallbackAgreement
from asyncckpt.errors import (
    CheckpointConfigError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointSaveError,
    CheckpointTimeoutError,
)
from asyncckpt.loader import Finding
from asyncckpt.manifest import ChunkTable, shard_file_name
from asyncckpt.reader import load_tensors, read_manifest
from asyncckpt.storage import LocalStorage


def _ctx(timeout_s: float = 30.0) -> DistContext:
    return DistContext(rank=0, world_size=3, store=dist.HashStore(), namespace="t",
                       timeout_s=timeout_s)


def test_gather_returns_every_ranks_value_in_rank_order() -> None:
    ctx = _ctx()
    for r in (2, 0, 1):
        ctx.put(ctx.key("s1", "record", r), {"rank": r})
    assert ctx.gather(("s1", "record"), "records") == {0: {"rank": 0}, 1: {"rank": 1},
                                                      2: {"rank": 2}}


def test_gather_timeout_names_the_silent_ranks() -> None:
    ctx = _ctx(timeout_s=1.0)
    ctx.put(ctx.key("s1", "record", 0), {"rank": 0})
    with pytest.raises(CheckpointTimeoutError, match=r"records of step 1 from rank\(s\) \[1, 2\]"):
        ctx.gather(("s1", "record"), "the records of step 1")


def test_peek_reads_a_key_or_none_and_makes_none() -> None:
    ctx = _ctx()
    assert ctx.peek("k") is None
    assert not ctx.store.check(["k"])  # (not made by the look)
    ctx.store.set("k", "v")
    assert ctx.peek("k") == b"v"
    ctx.store.add("n", 3)
    assert ctx._peek_count("n") == 3 and ctx._peek_count("m") == 0
    assert not ctx.store.check(["m"])


class _ClosesUnderfoot:
    """A Store on which every other rank's key this rank finds is gone the next moment
    (that rank closed and took its note away), and whose get and multi_get of a key not
    there fail at once, noted, where a real Store would wait its whole timeout."""

    def __init__(self, store: Any, mine: str) -> None:
        self._store = store
        self._mine = mine
        self.blocked: list[str] = []

    def check(self, keys: list[str]) -> bool:
        found = self._store.check(keys)
        for k in keys:
            if found and not k.endswith(self._mine):
                self._store.delete_key(k)
        return found  # type: ignore[no-any-return]

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        got = self._store.compare_set(key, expected, desired)
        if not key.endswith(self._mine):
            self._store.delete_key(key)
        return got  # type: ignore[no-any-return]

    def get(self, key: str) -> bytes:
        return self.multi_get([key])[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        missing = [k for k in keys if not self._store.check([k])]
        if missing:
            self.blocked += missing
            raise RuntimeError(f"would wait for {missing}")
        return self._store.multi_get(keys)  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def test_a_look_at_the_others_saves_never_waits_on_a_note_taken_away() -> None:
    """A suite run's rank 1 found rank 0's note of the save it waited in, and read it
    after rank 0 had refused the save and closed, taking its note away: the read waited
    for the note the Store's whole timeout (5 minutes on a real one)."""
    store = dist.HashStore()
    theirs = DistContext(rank=0, world_size=2, store=store, namespace="a.0", timeout_s=5,
                         directory="/runs/a")
    theirs.note_saving(7, True)
    odd = _ClosesUnderfoot(store, mine="/1")
    ctx = DistContext(rank=1, world_size=2, store=odd, namespace="b.0",  # type: ignore[arg-type]
                      timeout_s=5, directory="/runs/b")
    # the note is read in the one call that finds it, so what it said is acted on
    with pytest.raises(CheckpointConfigError, match="rank 0 is saving step 7 into '/runs/a'"):
        ctx.refuse_saving_elsewhere([0], 7)
    assert odd.blocked == []
    assert not store.check(["asyncckpt/saving/0"])  # (it went, right after)
    ctx.refuse_saving_elsewhere([0], 7)  # gone: nothing to refuse, and no wait for it
    assert odd.blocked == []


def test_a_wait_for_the_group_inside_a_save_lets_the_collector_run() -> None:
    """save_async pauses the collector, process-wide, from flattening to the end of the
    copy: over the wait for the other ranks between, which a late rank can stretch to
    timeout_s, the other threads' garbage cycles went uncollected."""
    import gc

    from asyncckpt._gc import gc_paused

    ctx = _ctx()
    key = ctx.key("s1", "go")
    seen: list[bool] = []
    waiting = threading.Event()

    def sample() -> None:
        waiting.wait(10)
        for _ in range(200):
            seen.append(gc.isenabled())
            time.sleep(0.001)
        ctx.store.set(key, "{}")

    assert gc.isenabled()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with gc_paused():
        assert not gc.isenabled()
        waiting.set()
        ctx.wait_keys({0: key}, "the go")
        assert not gc.isenabled()  # paused again for what follows the wait
    sampler.join(10)
    assert gc.isenabled()
    assert seen.count(True) > len(seen) // 2, seen  # (on while it slept between looks)
    # a wait beside another thread's pause (a burst of its own) leaves that pause on
    ctx.store.delete_key(key)
    seen.clear()
    waiting.clear()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    burst, over = threading.Event(), threading.Event()

    def other() -> None:
        with gc_paused():
            burst.set()
            over.wait(10)

    bursting = threading.Thread(target=other, daemon=True)
    bursting.start()
    assert burst.wait(10)
    waiting.set()
    ctx.wait_keys({0: key}, "the go")
    over.set()
    bursting.join(10)
    assert seen and not any(seen), seen


def test_cancelled_gather_gives_up_within_a_slice() -> None:
    ctx = _ctx(timeout_s=60.0)
    failed = threading.Event()
    threading.Timer(0.3, failed.set).start()
    t0 = time.monotonic()
    with pytest.raises(CheckpointSaveError, match=r"stopped waiting for the records.*failed"):
        ctx.gather(("s1", "record"), "the records", cancelled=failed.is_set)
    assert time.monotonic() - t0 < 5.0  # not the 60 s timeout


def test_gather_that_is_never_cancelled_still_completes() -> None:
    ctx = _ctx()
    threading.Timer(0.3, lambda: [ctx.put(ctx.key("s", "done", r), {}) for r in range(3)]).start()
    assert len(ctx.gather(("s", "done"), "dones", cancelled=lambda: False)) == 3


def test_a_wait_whose_last_slice_is_under_a_millisecond_still_ends() -> None:
    """A HashStore waits forever when asked to wait less than 1 ms; the last slice of a
    wait can be that short (a rank hung in a test instead of timing out)."""
    ctx = _ctx()
    out: list[BaseException] = []

    def wait() -> None:
        try:
            ctx.wait_keys({1: ctx.key("s1", "x", 1)}, "x", timeout_s=0.0005)
        except BaseException as exc:
            out.append(exc)

    th = threading.Thread(target=wait, daemon=True)
    th.start()
    th.join(10)
    assert len(out) == 1 and isinstance(out[0], CheckpointTimeoutError), out


def test_a_rank_waiting_on_another_beats_often_and_says_on_whom_it_waits() -> None:
    """The coordinator waiting for a stuck rank's layout is itself waited on by a third
    rank, which times out on it if its count stays put for timeout_s: it must move at
    every beat (not once a one-second slice, which with timeout_s=1 let the third rank
    name the healthy coordinator, CI of stop 39), and its beat must name the rank it waits
    for, so that the third rank's error does too."""
    from asyncckpt.dist import Pulse

    ctx = _ctx(timeout_s=1.0)
    pulse = Pulse(ctx, "s1")
    beats: list[dict[str, Any]] = []
    done = threading.Event()

    def watch() -> None:
        key = ctx.key("s1", "beat", 0)
        while not done.is_set():
            if ctx.store.check([key]):
                beat = json.loads(ctx.store.get(key))
                if not beats or beats[-1] != beat:
                    beats.append(beat)
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    ctx.store.set(ctx.key("s1", "layout", 1), "{}")  # rank 1 posted; rank 2 never does
    try:
        with pytest.raises(CheckpointTimeoutError, match=r"from rank\(s\) \[2\]"):
            ctx.wait_keys({1: ctx.key("s1", "layout", 1), 2: ctx.key("s1", "layout", 2)},
                          "the shard layouts of step 1", pulse=pulse)
    finally:
        done.set()
        watcher.join(5)
    counts = [b["n"] for b in beats]
    assert len(set(counts)) >= 4, beats  # every_s is timeout_s / 4: a beat each 0.25 s
    assert beats[-1]["doing"] == "waiting for the shard layouts of step 1 from rank(s) [2]", beats


def test_a_timeout_on_several_ranks_says_what_each_was_doing_or_that_it_never_beat() -> None:
    # (killing ranks 1 and 2 of 3 named both, but described rank 1 alone)
    from asyncckpt.dist import Pulse

    ctx = _ctx(timeout_s=1.0)
    ctx.store.set(ctx.key("s1", "beat", 1), json.dumps({"n": 1, "doing": "writing its shard"}))
    with pytest.raises(CheckpointTimeoutError) as info:
        ctx.wait_keys({1: ctx.key("s1", "done", 1), 2: ctx.key("s1", "done", 2)},
                      "the shard files of step 1", pulse=Pulse(ctx, "s1"))
    assert info.value.ranks == (1, 2)
    assert str(info.value).endswith(
        "from rank(s) [1, 2], which made no progress for the last 1s (rank 1 was last writing "
        "its shard; rank 2 gave no sign of life in this save); they may have died or hung")


def test_a_value_larger_than_a_store_message_goes_in_parts() -> None:
    """torch's TCPStore refuses a value over 8 MiB and drops the connection (a rank's
    record of ~40,000 tensors is that large): such values are posted in parts, read back
    whole, and deleted with their parts."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    ctx = DistContext(rank=0, world_size=1, store=store, namespace="t", timeout_s=30.0)
    big = {"tensors": {f"layers.{i}.weight": [i, "0123456789abcdef"] for i in range(300_000)}}
    key = ctx.key("s1", "record", 0)
    ctx.put(key, big)
    assert ctx.get(key, "the record") == big
    assert ctx.gather(("s1", "record"), "the records") == {0: big}
    parts = [f"{key}/part/{i}" for i in range(3)]
    assert store.check(parts)  # (~10 MB: three parts of at most 4 MiB)
    ctx.forget(["s1"], (), ())
    assert not any(store.check([k]) for k in [key, *parts, f"{key}/part/3"])
    ctx.put(key, {"small": 1})  # a small value is one message, as before
    assert store.get(key) == b'{"small":1}'


def test_a_save_of_many_tensors_per_rank_goes_through_the_store_in_parts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncckpt.dist as dist_mod

    monkeypatch.setattr(dist_mod, "_STORE_PART", 512)  # every record and layout in parts
    store = dist.HashStore()

    def rank(r: int) -> dict[str, Any]:
        state = {f"rank{r}": {f"t{i}": torch.full((3,), float(10 * r + i)) for i in range(40)}}
        with AsyncCheckpointer(tmp_path, mode="sync", rank=r, world_size=2, store=store,
                               timeout_s=10) as ck:
            ck.save(state, step=1)
            ck.save(state, step=2)
            got: dict[str, Any] = ck.load(step=2)
            return got

    got = in_threads(rank)
    for r in (0, 1):  # each rank loads both ranks' tensors, whole
        assert sorted(got[r]) == ["rank0", "rank1"]
        assert all(torch.equal(got[r][f"rank{w}"][f"t{i}"], torch.full((3,), 10.0 * w + i))
                   for w in (0, 1) for i in range(40))


# --- checkpointers of one group, simulated by threads sharing a HashStore ------------------


def test_the_coordinator_closes_only_once_the_others_read_the_last_verdict(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 often hosts the Store and exits right after close(): a rank still polling
    for the verdict on the last save then saw the connection reset, and reported a
    committed step as failed. The coordinator's close() waits until it was read."""
    import asyncckpt.writer as writer_mod

    store = dist.HashStore()
    seen_at: list[float] = []
    real = writer_mod._await_verdict

    def slow_reader(job: Any) -> Any:
        time.sleep(1.0)  # rank 1 polls late
        got = real(job)
        seen_at.append(time.monotonic())
        return got

    monkeypatch.setattr(writer_mod, "_await_verdict", slow_reader)

    def rank(r: int) -> float:
        ck = AsyncCheckpointer(tmp_path, rank=r, world_size=2, store=store, timeout_s=10)
        ck.save_async(_state(r), step=1).wait()
        ck.close()
        return time.monotonic()

    closed = all_ok(in_threads(rank))
    assert len(seen_at) == 1 and closed[0] >= seen_at[0]
    assert AsyncCheckpointer(tmp_path).steps() == [1]


def test_the_coordinator_whose_save_failed_closes_once_the_others_know(
        tmp_path: Path) -> None:
    """A trial: rank 0's write failed (EIO) and its close() returned at once; its process,
    which hosted the Store, exited, and the ranks still writing were told "is the process
    that hosts the Store alive?" in place of rank 0's error. It now waits for them after
    a failure too (for those not named silent), and no longer than they take."""
    from asyncckpt.storage import LocalStorage

    failed_at: dict[int, float] = {}

    class Disk(LocalStorage):
        def __init__(self, r: int) -> None:
            self.r = r

        def write_arena(self, path: Path, buf: Any, nbytes: int, ready: Any,
                        direct: bool = True) -> None:
            if self.r == 0:
                raise OSError(5, "Input/output error")
            time.sleep(1.0)  # (rank 1 writes slowly: it learns of the abort at its beat)
            ready(0)
            super().write_arena(path, buf, nbytes, ready, direct)

    store = dist.HashStore()

    def rank(r: int) -> float:
        ck = AsyncCheckpointer(tmp_path, rank=r, world_size=2, store=store, timeout_s=30,
                               storage=Disk(r))
        fut = ck.save_async({f"r{r}": torch.ones(1000)}, step=1)  # (each rank writes)
        with pytest.raises(CheckpointSaveError, match="Input/output error"):
            fut.wait()
        failed_at[r] = time.monotonic()
        ck.close()
        return time.monotonic()

    t0 = time.monotonic()
    closed = all_ok(in_threads(rank))
    assert closed[0] >= failed_at[1] - 0.05  # (rank 1 knew before rank 0 closed)
    assert closed[0] - t0 < 8.0  # (not the whole 10 s wait: rank 1 said it knew)
    assert AsyncCheckpointer(tmp_path).steps() == []


def _dir_hash(path: Path) -> str:
    return hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:12]


def _state(r: int) -> dict[str, Any]:
    return {"w": torch.arange(6, dtype=torch.float32), "step": 1}  # replicated: equal


class _ReadLog:
    """A rank's view of a shared Store that notes every key it reads or checks."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.read: list[str] = []

    def get(self, key: str) -> bytes:
        self.read.append(key)
        return self._store.get(key)  # type: ignore[no-any-return]

    def check(self, keys: list[str]) -> bool:
        self.read.extend(keys)
        return self._store.check(keys)  # type: ignore[no-any-return]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.read.extend(keys)
        return self._store.multi_get(keys)  # type: ignore[no-any-return]

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        self.read.append(key)  # (DistContext.peek reads so)
        return self._store.compare_set(key, expected, desired)  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:  # set, add, delete_key
        return getattr(self._store, name)


def _rank_of(key: str) -> int | None:
    """Whose per-rank key ``key`` is (layout, record, items, share), else None."""
    parts = key.split("/")
    for i, p in enumerate(parts[:-1]):
        if p in ("layout", "record", "done") and i + 2 == len(parts):
            return int(parts[i + 1])
        if p == "items" and i + 3 == len(parts):
            return int(parts[i + 1])
        if p == "share" and i + 3 == len(parts):
            return int(parts[i + 2])
    return None


def test_only_the_coordinator_reads_the_other_ranks_layouts(tmp_path: Path) -> None:
    """A save's barrier and a first save's choice of writers cost the Store O(world
    size), not O(world size²): a rank other than the coordinator reads only its own
    keys, the coordinator's go and its own share; the shares still spread the
    replicated tensors over the ranks, and a changed layout is shared out again."""
    world = 4
    store = dist.HashStore()
    logs = {r: _ReadLog(store) for r in range(world)}

    def rank(r: int) -> None:
        state: dict[str, Any] = {f"rep{i}": torch.full((1000 * (i + 1),), float(i))
                                 for i in range(8)}  # replicated: equal on every rank
        with AsyncCheckpointer(tmp_path, mode="sync", rank=r, world_size=world,
                               store=logs[r], timeout_s=30) as ck:
            ck.save(state, step=1)
            ck.save(state, step=2)
            state[f"extra{r}"] = torch.full((5,), float(r))  # held by this rank alone
            ck.save(state, step=3)

    all_ok(in_threads(rank, world=world))
    for r in range(1, world):
        others = [k for k in logs[r].read if _rank_of(k) not in (None, r)]
        assert others == [], (r, others[:5])
        shares = {k for k in logs[r].read if "/share/" in k}
        assert len(shares) == 2  # its first layout's, then step 3's
    assert any("/items/3/" in k for k in logs[0].read)
    # every replicated tensor written once, spread over the ranks; each extra by its rank
    manifest = read_manifest(tmp_path / "step_000000003", LocalStorage())
    mine: dict[str, list[str]] = {}
    for key, entry in manifest.tensors.items():
        assert len(entry.chunks) == 1, key
        mine.setdefault(entry.chunks[0].file, []).append(key)
    assert sorted(mine) == [shard_file_name(r) for r in range(world)]
    assert all(f"extra{r}" in mine[shard_file_name(r)] and len(mine[shard_file_name(r)]) >= 2
               for r in range(world))
    got = asyncckpt.load(tmp_path / "step_000000003")
    assert torch.equal(got["rep7"], torch.full((8000,), 7.0))
    assert torch.equal(got["extra2"], torch.full((5,), 2.0))


class _PutLog:
    """A shared Store that notes the size of every value put under a record key."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.records: dict[str, list[bytes]] = {}
        self._lock = threading.Lock()

    def set(self, key: str, value: Any) -> None:
        if "/record/" in key:
            with self._lock:
                self.records.setdefault(key, []).append(
                    value.encode() if isinstance(value, str) else bytes(value))
        self._store.set(key, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def _changing(r: int, step: int) -> dict[str, Any]:
    """Rank ``r``'s own part of the state at ``step``: new values every save, a changed
    non-tensor value from step 3 on, and on rank 1 a tensor more from step 4 on."""
    out: dict[str, Any] = {f"t{i}": torch.full((4, 5), float(100 * step + 10 * r + i))
                           for i in range(40)}
    out["lr"] = 0.1 if step < 3 else 0.05  # a non-tensor value: the skeleton changes
    if step >= 4 and r == 1:
        out["extra1"] = torch.ones(3)  # rank 1's layout changes
    return out


def _changing_tree(r: int, step: int) -> dict[str, Any]:
    return {f"r{r}": _changing(r, step), "w": torch.full((2, 3), float(step + r))}


def _save_five_steps(tmp_path: Path, world: int, store: Any,
                     serve_to: dict[int, Any] | None = None) -> None:
    """Every rank saves steps 1..5 of ``_changing_tree`` ("w" sharded by columns),
    serving peers through ``serve_to[rank]`` where given."""
    def rank(r: int) -> None:
        with AsyncCheckpointer(tmp_path, mode="async", rank=r, world_size=world,
                               store=store, timeout_s=30) as ck:
            if serve_to is not None:
                ck.serve(serve_to[r])
            for step in range(1, 6):
                ck.save_async(_changing_tree(r, step), step=step,
                              shards={"w": ShardMetadata((2, 3 * world), (0, 3 * r))}).wait()

    all_ok(in_threads(rank, world=world))


def test_ranks_report_whole_records_once_then_only_what_changed(tmp_path: Path) -> None:
    """After a committed save of the same layout, a rank's record is its checksums (and
    the skeleton's values that changed), not its layout again; the manifest and every
    value stay exact through value, skeleton and layout changes."""
    world = 3
    log = _PutLog(dist.HashStore())
    _save_five_steps(tmp_path, world, log)
    kinds: dict[int, list[str]] = {}
    sizes: dict[int, list[int]] = {}
    for values in log.records.values():  # (in the order of the saves)
        (rec,) = [json.loads(v) for v in values]  # (small: one part each)
        r = rec["rank"]
        kinds.setdefault(r, []).append(
            "whole" if "tensors" in rec else "skeleton" if "skeleton" in rec
            else "patch" if "skeleton_patch" in rec else "sums")
        sizes.setdefault(r, []).append(len(values[0]))
    # (the coordinator's own record never enters the Store)
    assert kinds == {1: ["whole", "sums", "patch", "whole", "sums"],
                     2: ["whole", "sums", "patch", "sums", "sums"]}, kinds
    assert all(sizes[r][1] * 3 < sizes[r][0] and sizes[r][2] < 2 * sizes[r][1]
               for r in range(1, world)), sizes
    for step in range(1, 6):
        got = asyncckpt.load(tmp_path / f"step_{step:09d}")
        for r in range(world):
            want = _changing(r, step)
            assert got[f"r{r}"]["lr"] == want["lr"]
            assert all(torch.equal(got[f"r{r}"][k], want[k]) for k in want if k != "lr")
            assert torch.equal(got["w"][:, 3 * r:3 * r + 3], torch.full((2, 3), float(step + r)))


class _Offers:
    """A transport that keeps what a checkpointer offers it (ckpt.serve)."""

    def __init__(self) -> None:
        self.served: list[Any] = []

    def serve(self, served: Any, *, allow: bool = True) -> None:
        self.served.append(served)

    def disallow_checkpoint(self) -> None:
        pass


def test_a_rank_of_a_group_serves_its_part_and_merges_that_view_once_per_layout(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank serves peers a view of its own shard (partial) at every save; the view
    is made whole only when the rank's layout changed, and otherwise filled in with the
    save's checksums and values: always the chunks and skeleton the step committed."""
    from asyncckpt.manifest import parse_manifest
    from asyncckpt.reports import RecordBook
    from asyncckpt.tree import flatten

    world = 2
    merges: list[bool] = []  # per merge of any book: made for a served view?
    real_merge = RecordBook._merge

    def merge(self: RecordBook, reports: Any, fids: Any, kw: dict[str, Any],
              *rest: Any) -> bytes:
        merges.append(kw["partial"])
        return real_merge(self, reports, fids, kw, *rest)

    monkeypatch.setattr(RecordBook, "_merge", merge)
    offers = {r: _Offers() for r in range(world)}
    _save_five_steps(tmp_path, world, dist.HashStore(), offers)
    # Views: each rank's first save and rank 1's changed layout. (The coordinator's
    # book merges at the same saves, and at rank 1's change.)
    assert merges.count(True) == 3 and merges.count(False) == 2, merges
    for r in range(world):
        assert [s.step for s in offers[r].served] == [1, 2, 3, 4, 5]
        for served in offers[r].served:
            view = parse_manifest(served.manifest(), "view")
            committed = read_manifest(tmp_path / f"step_{served.step:09d}", LocalStorage())
            assert view.partial and list(view.files) == [shard_file_name(r)]
            # this rank's tree (lr moved at step 3)
            assert view.skeleton == flatten(_changing_tree(r, served.step)).skeleton
            assert view.tensors, served.step
            for key, entry in view.tensors.items():
                mine = [c for c in committed.tensors[key].chunks if c.file == shard_file_name(r)]
                assert list(entry.chunks) == mine, (r, served.step, key)
            assert ("r1/extra1" in view.tensors) == (r == 1 and served.step >= 4)


@pytest.mark.parametrize("copies_fail,overlap", [(None, False), (None, True),
                                                 ("plan", False), ("copy", True)])
def test_each_rank_of_a_group_serves_the_replicated_tensors_it_does_not_write_too(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        copies_fail: str | None, overlap: bool) -> None:
    """A plain tensor at one path on every rank (Adam's step count under FSDP2) is written
    by one rank: the other's view held only its own file, so a peer healing that rank
    from it could not get the tensor. Each serving rank now copies the tensors it holds
    but does not write with the save's staging (off the caller's thread with overlap=True,
    as the rest), and offers them as a file of their own. Should their buffers or their
    copy fail, the view goes without them, and a load that wants them says so."""
    from asyncckpt import checkpointer as C
    from asyncckpt.transport import HTTPTransport

    if copies_fail == "plan":
        real = C.plan_writes

        def plan_writes(tensors: Any, file: str, meta: Any) -> Any:
            if ".replicas." in file:
                raise RuntimeError("no room")
            return real(tensors, file, meta)

        monkeypatch.setattr(C, "plan_writes", plan_writes)
    copied_on: list[threading.Thread] = []
    real_fill = C.fill_extras

    def fill_extras(extras: Any, after: Any = None) -> None:
        copied_on.append(threading.current_thread())
        if copies_fail == "copy":
            monkeypatch.setattr(C, "side_streams", lambda *a: 1 / 0)
        real_fill(extras, after)

    monkeypatch.setattr(C, "fill_extras", fill_extras)
    callers: list[threading.Thread] = []
    world = 2
    store = dist.HashStore()
    addresses: dict[int, str] = {}
    saved = threading.Barrier(world)
    done = threading.Barrier(world)
    live: dict[int, dict[str, torch.Tensor]] = {}

    def fetch_from_each() -> None:
        writer = read_manifest(tmp_path / "step_000000001", LocalStorage()).tensors[
            "count"].chunks[0].file
        other = 1 - [shard_file_name(r) for r in range(world)].index(writer)
        for r in range(world):
            mine = f"own{r}"  # (a path of this rank's alone: its own to write)
            target = {mine: torch.zeros(3), "count": torch.tensor(0.0),
                      "w": torch.zeros(2, 3)}
            box = {"w": ShardMetadata((2 * world, 3), (2 * r, 0))}
            if r == other and copies_fail:
                with pytest.raises(asyncckpt.CheckpointNotFoundError,
                                   match=r"does not hold count: another rank of the peer"):
                    asyncckpt.load(addresses[r], target, ignore_unexpected=True,
                                   timeout=10, shards=box)
                continue
            got = asyncckpt.load(addresses[r], target, ignore_unexpected=True, timeout=10,
                                 shards=box)
            assert got is target and torch.equal(target[mine], torch.full((3,), float(r)))
            assert target["count"].item() == 7.0  # as saved: the live one moved on
            assert torch.equal(target["w"], torch.full((2, 3), float(r)))
            assert live[r]["count"].item() == 8.0
            fresh = asyncckpt.load(addresses[r], timeout=10, exclude="w")  # (w: a part)
            assert fresh["count"].item() == 7.0 and set(fresh) == {"count", mine}, fresh
            with pytest.raises(asyncckpt.CheckpointNotFoundError, match=(
                    r"/v1/1 holds only part of w \(the boxes of the rank that serves it\): a "
                    r"load with no target asks for whole tensors")):
                asyncckpt.load(addresses[r], timeout=10)  # (it told of "wanted elements")
        # rank 1's state from rank 0's view: what only rank 1 holds is named as missing
        # from the view (it said "missing from the checkpoint ... pass strict=False")
        with pytest.raises(asyncckpt.StateMismatchError, match=(
                r"missing from the peer's view \(the state of the rank that serves it\): own1 "
                r".*in a group, fetch each rank's state from the same rank of a healthy "
                r"replica")):
            asyncckpt.load(addresses[0], {"own1": torch.zeros(3), "count": torch.tensor(0.0)},
                           ignore_unexpected=True, timeout=10)

    def rank(r: int) -> None:
        tr = HTTPTransport(timeout=10)
        with contextlib.ExitStack() as stack, AsyncCheckpointer(
                tmp_path, mode="async", rank=r, world_size=world, store=store,
                timeout_s=30) as ck:
            stack.callback(tr.shutdown)  # (after the checkpointer's close)
            ck.serve(tr)
            live[r] = {"w": torch.full((2, 3), float(r)), "count": torch.tensor(7.0),
                       f"own{r}": torch.full((3,), float(r))}
            fut = ck.save_async(live[r], step=1, overlap=overlap,
                                shards={"w": ShardMetadata((2 * world, 3), (2 * r, 0))})
            fut.wait_staged()
            live[r]["count"].add_(1)  # training goes on: the view keeps step 1's
            fut.wait()
            callers.append(threading.current_thread())
            addresses[r] = tr.address()
            saved.wait(30)
            try:
                if r == 0:
                    fetch_from_each()
            finally:
                done.wait(30)  # (each rank serves until the fetches are over)

    with caplog.at_level(logging.ERROR, logger="asyncckpt"):
        all_ok(in_threads(rank, world=world))
    failed = [m for m in caplog.messages if "could not be copied for its view" in m]
    assert len(failed) == (1 if copies_fail else 0), caplog.messages
    assert len(copied_on) == (0 if copies_fail == "plan" else 1)  # (one rank has extras)
    # the copy is the staging's: with overlap=True, never on the caller's thread
    assert all((t in callers) == (not overlap) for t in copied_on), (copied_on, callers)


def test_with_overlap_a_copied_replicated_tensor_changed_before_wait_staged_fails_the_save(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The serving rank that does not write a replicated tensor copies it with the
    staging: changed in place before wait_staged() (here: right after its copy), the copy
    could be torn, as any staged tensor's, and the save is refused naming it."""
    from asyncckpt import checkpointer as C
    from asyncckpt.transport import HTTPTransport

    real_fill = C.fill_extras

    def fill_extras(extras: Any, after: Any = None) -> None:
        real_fill(extras, after)
        extras.live["count"].add_(1)  # optimizer.step() too early, on this rank alone

    monkeypatch.setattr(C, "fill_extras", fill_extras)
    store = dist.HashStore()

    def rank(r: int) -> None:
        tr = HTTPTransport(timeout=10)
        with contextlib.ExitStack() as stack, AsyncCheckpointer(
                tmp_path, mode="async", rank=r, world_size=2, store=store, timeout_s=30) as ck:
            stack.callback(tr.shutdown)
            ck.serve(tr)
            fut = ck.save_async({"count": torch.tensor(7.0), f"own{r}": torch.ones(3)},
                                step=1, overlap=True)
            with pytest.raises(CheckpointSaveError, match=r"'count'.*changed in place"):
                fut.wait_staged()
                fut.wait()
            assert ck.steps() == []

    all_ok(in_threads(rank, world=2))


def _synced(root: Path, store: Any, r: int, *, world: int = 2, timeout_s: float = 10.0
            ) -> AsyncCheckpointer:
    """Rank ``r``'s checkpointer of ``root`` in a group of ``world`` thread ranks sharing
    ``store``, mode="sync" (each save returns committed)."""
    return AsyncCheckpointer(root, rank=r, world_size=world, store=store, timeout_s=timeout_s,
                             mode="sync")


def test_the_one_shot_load_takes_hand_declared_shards_from_a_root_or_a_peer(
        tmp_path: Path) -> None:
    # (asyncckpt.load had no shards=: a hand-sharded target could not be loaded with it)
    from asyncckpt.transport import HTTPTransport

    store = dist.HashStore()

    def rank(r: int) -> None:
        with _synced(tmp_path, store, r, timeout_s=30) as ck:
            ck.save({"w": torch.full((2, 3), float(r))}, step=1,
                    shards={"w": ShardMetadata((4, 3), (2 * r, 0))})

    all_ok(in_threads(rank))
    box = {"w": ShardMetadata((4, 3), (1, 0))}  # rows 1:3, across both ranks' files
    want = torch.tensor([[0.0] * 3, [1.0] * 3])
    target = {"w": torch.zeros(2, 3)}
    asyncckpt.load(tmp_path, target, shards=box)
    assert torch.equal(target["w"], want)
    with HTTPTransport(timeout=10) as tr:
        tr.serve_directory(tmp_path / "step_000000001")
        target = {"w": torch.zeros(2, 3)}
        asyncckpt.load(tr.address(), target, shards=box, timeout=10)
        assert torch.equal(target["w"], want)
    assert tr.closed  # (the block shut it down)


def test_the_one_shot_save_takes_shards_too(tmp_path: Path) -> None:
    # (asyncckpt.save had no shards=, though it is collective in a group: the box a
    # process declares reaches the save, which refuses one no other rank completes)
    with pytest.raises(asyncckpt.CheckpointConfigError, match=r"shards\['w'\]: a box of "
                       r"shape \[2, 3\] at offsets \[0, 0\] of a tensor of global shape"):
        asyncckpt.save({"w": torch.zeros(2, 3)}, tmp_path, step=1,
                       shards={"w": ShardMetadata((4, 3), (0, 0))})
    asyncckpt.save({"w": torch.ones(2, 3)}, tmp_path, step=1,
                   shards={"w": ShardMetadata((2, 3), (0, 0))})
    assert torch.equal(asyncckpt.load(tmp_path)["w"], torch.ones(2, 3))


def test_a_rank_that_declares_no_shard_beside_ranks_that_do_is_named(tmp_path: Path) -> None:
    # Rank 1 forgot shards= for w (it saves its 2 rows as the whole [2, 3] tensor... of a
    # [4, 3] tensor the others declare): "chunks overlap" named neither rank nor cause.
    store = dist.HashStore()

    def rank(r: int) -> BaseException | None:
        with _synced(tmp_path, store, r, world=3, timeout_s=30) as ck:
            shards = {} if r == 1 else {"w": ShardMetadata((4, 3), (2 * (r // 2), 0))}
            try:
                ck.save({"w": torch.full((2 if r != 1 else 4, 3), float(r))}, step=1,
                        shards=shards)
            except asyncckpt.CheckpointError as exc:
                return exc
            return None

    out = in_threads(rank, 3)
    assert all(isinstance(e, asyncckpt.CheckpointSaveError) for e in out.values()), out
    assert "tensor 'w' of shape [4, 3]: chunks overlap: the box in rank_00000.safetensors at " \
        "offsets [0, 0] (lengths [2, 3]) and the box in rank_00001.safetensors at offsets " \
        "[0, 0] (lengths [4, 3]) (rank_00001.safetensors holds the whole tensor: did its " \
        "rank pass no shards= entry for it?)" in str(out[0]), out[0]
    assert asyncckpt.AsyncCheckpointer(tmp_path).steps() == []  # nothing committed


def test_a_box_two_ranks_declare_with_different_values_is_warned_of(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Ranks 0 and 1 both declare rows 0:2 of w, with their own values: one copy is saved,
    # the other lost without a word (a replicated plain tensor was compared, a box not).
    store = dist.HashStore()

    def rank(r: int) -> None:
        with _synced(tmp_path, store, r, world=3, timeout_s=30) as ck:
            for step in (1, 2):
                values = float(r if step == 2 else r // 2)  # step 1: the copies agree
                ck.save({"w": torch.full((2, 3), values)}, step=step,
                        shards={"w": ShardMetadata((4, 3), (2 * (r // 2), 0))})

    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        all_ok(in_threads(rank, 3))
    said = [r.getMessage() for r in caplog.records if "different values" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(
        "step 2: ranks hold different values of tensor(s) 'w' (rank(s) ["), said
    assert "a box of a sharded one that several ranks declare" in said[0]


def test_a_view_for_peers_that_cannot_be_made_costs_the_save_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from asyncckpt.reports import RecordSender

    real = RecordSender.sent_to
    broken = threading.Event()

    def sent_to(self: RecordSender, book: Any, rank: int) -> dict[str, Any]:
        if broken.is_set() and rank == 1:
            raise ValueError("no view today")
        return real(self, book, rank)

    monkeypatch.setattr(RecordSender, "sent_to", sent_to)
    offers = {r: _Offers() for r in range(2)}
    store = dist.HashStore()
    saved = threading.Barrier(2)

    def rank(r: int) -> None:
        with AsyncCheckpointer(tmp_path, mode="async", rank=r, world_size=2,
                               store=store, timeout_s=30) as ck:
            ck.serve(offers[r])
            for step in (1, 2, 3):
                if r == 0:
                    (broken.set if step == 2 else broken.clear)()
                saved.wait()
                ck.save_async({f"r{r}": torch.arange(5.0) + step}, step=step).wait()

    with caplog.at_level("ERROR", logger="asyncckpt"):
        all_ok(in_threads(rank))
    assert AsyncCheckpointer(tmp_path).steps() == [1, 2, 3]  # every step committed
    assert [s.step for s in offers[0].served] == [1, 2, 3]
    assert [s.step for s in offers[1].served] == [1, 3]  # not step 2's; step 3's again
    assert "rank=1 step=2: the view of this rank's part for peers could not be made" in (
        caplog.text)
    assert torch.equal(asyncckpt.load(tmp_path / "step_000000003")["r1"], torch.arange(5.0) + 3)


def test_sixteen_ranks_save_share_out_replicas_and_load_back(tmp_path: Path) -> None:
    """A larger group through one Store: declared shards, replicated tensors spread over
    the writers, a layout that changes on some ranks between saves; every value back."""
    world = 16
    store = dist.HashStore()

    def state(r: int, step: int) -> dict[str, Any]:
        out: dict[str, Any] = {"w": torch.full((2, 3), float(100 * step + r)),
                               "step": step}
        out.update({f"rep{i}": torch.full((64 * (i + 1),), float(i + step)) for i in range(6)})
        if step == 2 and r % 3 == 0:
            out[f"only{r}"] = torch.full((4,), float(r))  # held by this rank alone
        return out

    def rank(r: int) -> None:
        with AsyncCheckpointer(tmp_path, mode="async", rank=r, world_size=world, store=store,
                               timeout_s=60, copy_threads=1) as ck:
            for step in (1, 2):
                ck.save_async(state(r, step), step=step,
                              shards={"w": ShardMetadata((2 * world, 3), (2 * r, 0))}).wait()

    all_ok(in_threads(rank, world=world, timeout=120))
    got = asyncckpt.load(tmp_path / "step_000000002")
    assert torch.equal(got["w"], torch.arange(world, dtype=torch.float32).add(200)
                       .repeat_interleave(2)[:, None].expand(2 * world, 3))
    for i in range(6):
        assert torch.equal(got[f"rep{i}"], torch.full((64 * (i + 1),), float(i + 2)))
    assert sorted(k for k in got if k.startswith("only")) == sorted(
        f"only{r}" for r in range(0, world, 3))
    assert all(torch.equal(got[f"only{r}"], torch.full((4,), float(r)))
               for r in range(0, world, 3))
    files = {c.file for e in read_manifest(tmp_path / "step_000000002",
                                           LocalStorage()).tensors.values() for c in e.chunks}
    assert len(files) == world  # every rank wrote its part
    # 16 chunks of "w": one table (format version 4), held as columns; a box of it is read
    # from the chunks it meets alone, checksums verified
    step_dir = tmp_path / "step_000000002"
    assert set(json.loads((step_dir / "manifest.json").read_bytes())["tensors"]["w"]) == {
        "dtype", "shape", "kind", "table"}
    m = read_manifest(step_dir, LocalStorage())
    assert type(m.tensors["w"].chunks) is ChunkTable and len(m.tensors["w"].chunks) == world
    read: list[int] = []
    box = ((5, 1), (15, 2))  # rows 5-19: ranks 2-9 wrote them
    out = load_tensors(step_dir, m, {"w": torch.empty(15, 2)}, LocalStorage(),
                       boxes={"w": box}, read=read)
    assert torch.equal(out["w"], got["w"][5:20, 1:3])
    assert sum(read) == 8 * 2 * 3 * 4  # whole chunks of 8 ranks (each verified), no more


def test_a_checkpointer_opened_on_one_rank_only_to_read_does_not_pair(tmp_path: Path) -> None:
    """Rank 1 opens a checkpointer of the directory to list its steps, then both ranks open
    the one they save with: the saves pair (they timed out when construction counted)."""
    store = dist.HashStore()

    def rank(r: int) -> list[int]:
        if r == 1:
            with AsyncCheckpointer(tmp_path, rank=r, world_size=2, store=store) as reader:
                assert reader.steps() == []
        with AsyncCheckpointer(tmp_path, mode="sync", rank=r, world_size=2, store=store,
                               timeout_s=5) as ck:
            ck.save(_state(r), step=1)
            return ck.steps()

    assert in_threads(rank) == {0: [1], 1: [1]}


def test_the_same_directory_spelled_differently_pairs(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "x").mkdir()
    monkeypatch.chdir(tmp_path)
    store = dist.HashStore()
    paths = {0: tmp_path / "d", 1: Path("./x/../d/")}

    def rank(r: int) -> list[int]:
        with AsyncCheckpointer(paths[r], mode="sync", rank=r, world_size=2, store=store,
                               timeout_s=5) as ck:
            ck.save(_state(r), step=1)
            return ck.steps()

    assert in_threads(rank) == {0: [1], 1: [1]}


_REPLACED_RANK = """
import sys
from datetime import timedelta
import torch
import torch.distributed as dist
import asyncckpt
port, directory, step = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
with asyncckpt.AsyncCheckpointer(directory, mode="sync", rank=1, world_size=2, store=store,
                                 timeout_s=10) as ck:
    ck.save({"r1": torch.full((3,), float(step))}, step=step)
"""


def test_a_replaced_rank_pairs_with_a_survivor_that_reopens(tmp_path: Path) -> None:
    """Rank 1's process is replaced after step 1 (a fresh process, its first
    checkpointer); rank 0 survives and reopens its checkpointer, its second: the two
    pair, because checkpointers are counted per rank in the Store, not per process."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))

    def rank_1(step: int) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-c", _REPLACED_RANK, str(store.port),
                                 str(tmp_path), str(step)])

    for step in (1, 2):  # a new process of rank 1 each time
        proc = rank_1(step)
        with AsyncCheckpointer(tmp_path, mode="sync", rank=0, world_size=2, store=store,
                               timeout_s=10) as ck:
            ck.save({"r0": torch.full((2,), float(step))}, step=step)
        assert proc.wait(60) == 0
    got = AsyncCheckpointer(tmp_path).load(step=2)
    assert got["r0"].tolist() == [2.0, 2.0] and got["r1"].tolist() == [2.0, 2.0, 2.0]


_DIES_IN_A_LOAD = """
import os, sys
from datetime import timedelta
import torch.distributed as dist
import asyncckpt, asyncckpt.checkpointer
port, directory = int(sys.argv[1]), sys.argv[2]
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
asyncckpt.checkpointer.load_from = lambda *a, **kw: os._exit(3)  # killed while it reads
asyncckpt.AsyncCheckpointer(directory, rank=1, world_size=2, store=store).load()
"""


def test_a_rank_that_died_in_a_load_holds_no_step_from_retention(tmp_path: Path) -> None:
    """Rank 1's process dies while it loads the latest step, so it never takes its hold
    back; the rank's next process does (at its first save), and the coordinator's
    keep_last retention deletes that step again instead of keeping it for ever."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))

    def save(step: int) -> list[int]:
        def rank(r: int) -> list[int]:
            with AsyncCheckpointer(tmp_path, mode="sync", rank=r, world_size=2, store=store,
                                   keep_last=1, timeout_s=10) as ck:
                ck.save(_state(r), step=step)
                return ck.steps()
        return all_ok(in_threads(rank))[0]  # type: ignore[no-any-return]

    assert save(1) == [1]
    dead = subprocess.run([sys.executable, "-c", _DIES_IN_A_LOAD, str(store.port),
                           str(tmp_path)], timeout=60)
    assert dead.returncode == 3
    assert store.add(f"asyncckpt/holds/{DistContext(0, 2, store, '', 1, str(tmp_path))._base()}"
                     "/1", 0) == 1  # the dead process's hold on step 1 is still counted
    assert save(2) == [2]  # a new process of rank 1 took it back: step 1 went


def test_ranks_saving_different_steps_are_told_at_once(tmp_path: Path) -> None:
    store = dist.HashStore()

    def rank(r: int) -> Any:
        with AsyncCheckpointer(tmp_path, mode="sync", rank=r, world_size=2, store=store,
                               timeout_s=60) as ck:
            try:
                ck.save(_state(r), step=10 + r)
            except (CheckpointConfigError, CheckpointSaveError) as exc:
                failed: BaseException = exc
            else:
                raise AssertionError("saved")
            assert AsyncCheckpointer(tmp_path).steps() == []
            # (a DCP trial: the advice was to reopen every checkpointer, where the ranks
            # had only passed different numbers: the next save of one step goes on)
            ck.save(_state(r), step=20)
            return failed

    t0 = time.monotonic()
    out = in_threads(rank)
    assert time.monotonic() - t0 < 20  # not the 60 s timeout
    for r in (0, 1):  # (a rank that reads the other's announced error raises that one)
        assert isinstance(out[r], (CheckpointConfigError, CheckpointSaveError)), out[r]
        assert "different steps (rank 0: 10, rank 1: 11)" in str(out[r])
        assert "pass every rank the same one: the next save with one step on every rank " \
               "goes on" in str(out[r])
    assert AsyncCheckpointer(tmp_path).steps() == [20]


def test_rank_0_closes_after_the_others_read_its_refusal_to_start(tmp_path: Path,
                                                                   monkeypatch) -> None:
    """(distributed trial) Rank 0 hosting the Store (mp.spawn, env://) refused a save
    (ranks' keep_last differed) and exited at once: rank 1, still reading the refusal,
    got "is the process that hosts the Store alive?". Its close() now waits until the
    others have read it, as after a committed save."""
    from asyncckpt.dist import DistContext

    store = dist.HashStore()
    waited: list[bool] = []
    real = DistContext.wait_verdict_seen

    def recorded(self: DistContext, tag: str, timeout_s: float, **kw: Any) -> bool:
        got = real(self, tag, timeout_s, **kw)
        waited.append(got)
        return got

    monkeypatch.setattr(DistContext, "wait_verdict_seen", recorded)

    def rank(r: int) -> None:
        ck = AsyncCheckpointer(tmp_path, mode="sync", rank=r, world_size=2, store=store,
                               keep_last=2 + r, timeout_s=30)
        try:
            with pytest.raises((CheckpointConfigError, CheckpointSaveError), match="keep_last"):
                ck.save(_state(r), step=1)
        finally:
            ck.close()

    all_ok(in_threads(rank))
    assert waited == [True]  # rank 0's close waited, and rank 1 had read it
    # (third review) a rank counts once a save, though it reads the refusal and then
    # announces its own failure: twice, and rank 0 stopped waiting before a third read it
    ctx = DistContext(rank=1, world_size=3, store=store, namespace="once", timeout_s=5.0)
    ctx.saw_verdict("n9")
    ctx.saw_verdict("n9")
    assert store.add(ctx.key("n9", "seen"), 0) == 1


@pytest.mark.parametrize("skips", [True, False])
def test_a_rank_the_others_gave_up_on_is_told_whether_it_skipped_or_came_late(
        tmp_path: Path, skips: bool) -> None:
    # Rank 1 missed the group's save of step 1 (beyond timeout_s). Its next call pairs
    # with that save and fails with its timeout, which did not say that rank 1 was the
    # one that skipped a save (then its later saves pair with the others' next ones).
    store = dist.HashStore()
    gave_up = threading.Event()

    def rank(r: int) -> BaseException | None:
        with AsyncCheckpointer(tmp_path, mode="sync", rank=r, world_size=2, store=store,
                               timeout_s=1) as ck:
            if r == 0:
                with pytest.raises(asyncckpt.CheckpointTimeoutError):
                    ck.save(_state(r), step=1)
                gave_up.set()
                return None
            assert gave_up.wait(30)
            try:
                ck.save(_state(r), step=2 if skips else 1)
            except (asyncckpt.CheckpointTimeoutError, CheckpointConfigError) as exc:
                return exc
            return None

    out = in_threads(rank)
    assert out[0] is None
    if skips:
        # (out of step: a CheckpointConfigError, as the ranks it tells get; a trial's
        # three ranks got three kinds of error, and one handler could not recover)
        assert isinstance(out[1], CheckpointConfigError), out
        assert str(out[1]).endswith(
            "; rank 1 was paired with the group's save of step 1, for which the others gave "
            "up waiting for it: this rank skipped that save. Every rank must call save_async "
            "the same number of times, in the same order: this rank's later saves pair with "
            "the others' next ones. To go on, every rank closes its checkpointer, waits "
            "until every rank's close() has returned (a dist.barrier()), and opens a new "
            "one"), out[1]
    else:
        assert isinstance(out[1], asyncckpt.CheckpointTimeoutError), out
        assert str(out[1]).endswith("; rank 1 came to this save after the others had given "
                                    "up waiting for it (timeout_s)"), out[1]


def test_the_ranks_that_went_on_are_told_at_once_that_a_rank_skipped_a_save(
        tmp_path: Path) -> None:
    """(a distributed trial) Rank 1 skipped the save of step 2; at step 3 it was told at
    once that it had, while rank 0 waited out timeout_s for its layout, told rank 1 'may
    have died or not called save_async' (it had called)."""
    store = dist.HashStore()
    gave_up = threading.Event()

    def rank(r: int) -> Any:
        with _synced(tmp_path, store, r, timeout_s=1) as ck:
            ck.save(_state(r), step=1)
            if r == 0:
                with pytest.raises(CheckpointTimeoutError):
                    ck.save(_state(r), step=2)
                gave_up.set()
            assert gave_up.wait(30)
            ck._ctx.timeout_s = 30.0  # (rank 0 would wait this long for rank 1's layout)
            ck.save(_state(r), step=3)

    out = in_threads(rank)
    assert isinstance(out[1], CheckpointConfigError), out
    assert "this rank skipped that save" in str(out[1])
    assert isinstance(out[0], CheckpointConfigError), out
    assert str(out[0]).startswith(
        "rank 0: rank 1 skipped the group's save of step 2 (the save the others gave up "
        "waiting for it in), so its saves pair with this group's earlier ones: its save of "
        "step 3 met that one."), out[0]
    assert AsyncCheckpointer(tmp_path).steps() == [1]


@pytest.mark.parametrize("then", ["reopen", "save_then_reopen", "discard"])
def test_the_group_saves_again_after_a_rank_skipped_its_checkpointers_first_save(
        tmp_path: Path, then: str) -> None:
    """(a distributed trial) Rank 2 skipped the save of step 2, the first of its
    checkpointer; every rank then closed its checkpointer and opened a new one, as the docs
    say: rank 2's new one was its first to save, and paired with the others' old one, so
    the save of step 4 failed on every rank (and every later one would have). Also (the
    review): the ranks first try step 3 with the checkpointers they have (told at once
    that rank 2 skipped), or the new checkpointers' first call is discard_steps_after."""
    store = dist.HashStore()
    failed = threading.Barrier(3)
    reopened = threading.Barrier(3)

    def rank(r: int) -> Any:
        ck = _synced(tmp_path, store, r, world=3, timeout_s=1)
        if r != 2:
            with pytest.raises(CheckpointTimeoutError):
                ck.save(_state(r), step=2)
        failed.wait(30)
        if then == "save_then_reopen":
            ck._ctx.timeout_s = 20.0  # (told at once, not after timeout_s)
            with pytest.raises((CheckpointConfigError, CheckpointTimeoutError,
                                CheckpointSaveError), match="rank 2"):
                ck.save(_state(r), step=3)
        ck.close()
        reopened.wait(30)
        with _synced(tmp_path, store, r, world=3, timeout_s=20) as again:
            if then == "discard":
                assert again.discard_steps_after(1) == []
            return again.save(_state(r), step=4).step

    assert in_threads(rank, world=3) == {0: 4, 1: 4, 2: 4}
    assert AsyncCheckpointer(tmp_path).steps() == [4]


def test_a_timeout_says_a_rank_is_saving_with_another_checkpointer(tmp_path: Path) -> None:
    """After step 1, rank 1 reopens its checkpointer and rank 0 does not: the saves of
    step 2 never meet, and each rank is told why (at once now: it waited timeout_s)."""
    store = dist.HashStore()

    def rank(r: int) -> None:
        ck = AsyncCheckpointer(tmp_path, mode="sync", rank=r, world_size=2, store=store,
                               timeout_s=2)
        ck.save(_state(r), step=1)
        if r == 1:
            ck.close()
            ck = AsyncCheckpointer(tmp_path, mode="sync", rank=r, world_size=2, store=store,
                                   timeout_s=2)
        with ck:
            ck.save(_state(r), step=2)

    out = in_threads(rank)
    for r, (theirs, mine) in {0: (2, 1), 1: (1, 2)}.items():
        assert isinstance(out[r], CheckpointConfigError), out[r]
        assert (f"rank {1 - r} is saving step 2 into {str(tmp_path)!r} with its "
                f"checkpointer #{theirs} of that directory, this rank with its "
                f"#{mine}") in str(out[r]), out[r]


def test_a_rank_that_saved_into_another_directory_since_is_not_called_unpaired(
        tmp_path: Path) -> None:
    """Both ranks save into A and B; rank 1 never saves A's step 2: rank 0's timeout
    must not blame the order of checkpointers (rank 1 is not ahead, just absent)."""
    store = dist.HashStore()

    def rank(r: int) -> None:
        with AsyncCheckpointer(tmp_path / "A", mode="sync", rank=r, world_size=2,
                               store=store, timeout_s=2) as a, \
                AsyncCheckpointer(tmp_path / "B", mode="sync", rank=r, world_size=2,
                                  store=store, timeout_s=2) as b:
            a.save(_state(r), step=1)
            b.save(_state(r), step=1)
            if r == 0:
                a.save(_state(r), step=2)

    out = in_threads(rank)
    assert out[1] is None
    assert isinstance(out[0], CheckpointTimeoutError), out[0]
    assert "last started saving" not in str(out[0])
    assert "not called save_async" in str(out[0])


def test_a_step_one_rank_cannot_use_is_announced_to_the_others(tmp_path: Path) -> None:
    store = dist.HashStore()

    def rank(r: int) -> None:
        with AsyncCheckpointer(tmp_path, mode="sync", rank=r, world_size=2, store=store,
                               timeout_s=60) as ck:
            ck.save(_state(r), step=5 if r == 0 else -5)

    t0 = time.monotonic()
    out = in_threads(rank)
    assert time.monotonic() - t0 < 20  # not the 60 s timeout
    assert isinstance(out[1], CheckpointConfigError), out[1]
    # (a config error of one rank: the same kind on every rank, as for ranks out of step)
    assert isinstance(out[0], CheckpointConfigError) and "step=-5" in str(out[0]), out[0]


def test_a_third_rank_is_told_of_a_failed_rank_in_the_words_rank_0_read_them(
        tmp_path: Path) -> None:
    """Rank 1 fails before the barrier; rank 2 learns it through rank 0's go, as rank 0
    said it: the failing rank named once, no second "not started" wrapped around it."""
    store = dist.HashStore()

    def rank(r: int) -> None:
        with AsyncCheckpointer(tmp_path, mode="sync", rank=r, world_size=3, store=store,
                               timeout_s=60) as ck:
            ck.save(_state(r), step=-5 if r == 1 else 5)

    t0 = time.monotonic()
    out = in_threads(rank, world=3)
    assert time.monotonic() - t0 < 20  # not the 60 s timeout
    assert isinstance(out[1], CheckpointConfigError), out[1]
    for r in (0, 2):  # (one kind of error on every rank)
        assert isinstance(out[r], CheckpointConfigError), out[r]
        assert str(out[r]).startswith("step 5 not started: rank 1 failed: rank 1: "
                                      "CheckpointConfigError: step=-5"), out[r]
        assert str(out[r]).count("not started") == 1, out[r]


def test_closing_every_rank_leaves_only_a_where_key_and_a_count_per_rank(tmp_path: Path
                                                                          ) -> None:
    store = dist.HashStore()

    def rank(r: int) -> None:
        with AsyncCheckpointer(tmp_path, rank=r, world_size=2, store=store,
                               timeout_s=30) as ck:
            for step in (1, 2, 3):
                ck.save_async(_state(r), step=step).wait()
            with pytest.raises(CheckpointExistsError):
                ck.save(_state(r), step=3)  # a failed save leaves its keys too
            ck.save({"w": torch.zeros(3), "x": torch.ones(2)}, step=4)  # a new layout
            assert len(ck._posted_digests) == 1  # the old layout's key is already gone

    out = in_threads(rank)
    assert out == {0: None, 1: None}
    assert store.num_keys() == 6, "left in the Store after close()"
    assert all(store.check([f"asyncckpt/where/{_dir_hash(tmp_path)}/{r}",
                            f"asyncckpt/sessions/{_dir_hash(tmp_path)}/{r}",
                            f"asyncckpt/last-directory/{r}"]) for r in (0, 1))


@pytest.mark.parametrize("case", ["new layout, one rank fails", "first save fails",
                                  "one rank saves once more"])
def test_keys_of_failed_saves_are_deleted_at_close_too(tmp_path: Path, case: str) -> None:
    store = dist.HashStore()

    def rank(r: int) -> None:
        with AsyncCheckpointer(tmp_path, rank=r, world_size=2, store=store,
                               timeout_s=1) as ck:
            if case == "first save fails":  # before any layout exchange went through
                with pytest.raises(CheckpointError):
                    ck.save(_state(r), step=1 + r)
                return
            ck.save(_state(r), step=1)
            if case == "one rank saves once more":
                if r == 1:  # rank 0 does not take part: it times out
                    with pytest.raises(CheckpointTimeoutError):
                        ck.save(_state(r), step=2)
                else:
                    time.sleep(2)  # and closes last
                return
            big: dict[str, Any] = {f"layer{i}": torch.zeros(4) for i in range(20)}
            if r == 0:
                big["bad"] = object()  # rank 0 fails in flatten, rank 1 posts its layout
            with pytest.raises(CheckpointError):
                ck.save(big, step=2)

    out = in_threads(rank)
    assert out == {0: None, 1: None}
    assert store.num_keys() == 6, "left in the Store after close()"
    assert all(store.check([f"asyncckpt/where/{_dir_hash(tmp_path)}/{r}",
                            f"asyncckpt/sessions/{_dir_hash(tmp_path)}/{r}"]) for r in (0, 1))


def test_retention_in_a_group_leaves_no_key_per_step_it_deletes(tmp_path: Path) -> None:
    # Asking whether a load holds a step created that step's count: one key more in the
    # job's Store with every save, for the job's life.
    store = dist.HashStore()

    def rank(r: int) -> None:
        with AsyncCheckpointer(tmp_path, rank=r, world_size=2, store=store, timeout_s=10,
                               keep_last=1, mode="sync") as ck:
            for step in range(1, 11):
                ck.save(_state(r), step=step)
            ck.wait()  # (the coordinator's deletions too; rank 1 may list before them)
            if r == 0:
                assert ck.steps() == [10]

    assert in_threads(rank) == {0: None, 1: None}
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000000010"]
    holds = [f"asyncckpt/holds/{_dir_hash(tmp_path)}/{s}" for s in (*range(1, 11), "any")]
    assert [k for k in holds if store.check([k])] == []


def test_only_the_coordinator_logs_each_save_at_info(tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    # Every rank logged its own line per save at INFO: a thousand lines per save on a
    # thousand ranks.
    store = dist.HashStore()

    runs = iter(["a", "a", "b", "b"])  # (each run saves step 1 into a directory of its own)
    lock = threading.Lock()

    def rank(r: int) -> None:
        with lock:
            where = tmp_path / next(runs)
        with AsyncCheckpointer(where, rank=r, world_size=2, store=store, timeout_s=10,
                               mode="sync") as ck:
            ck.save(_state(r), step=1)

    with caplog.at_level(logging.INFO, logger="asyncckpt.writer"):
        assert in_threads(rank) == {0: None, 1: None}
    lines = [rec for rec in caplog.records if "committed" in rec.getMessage()]
    assert [(rec.levelno, rec.getMessage()[:7]) for rec in lines] == [(logging.INFO,
                                                                       "rank=0 ")]
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="asyncckpt.writer"):
        assert in_threads(rank) == {0: None, 1: None}  # (a second checkpointer: step 1)
    assert any(rec.getMessage().startswith("rank=1 step=1 committed")
               and rec.levelno == logging.DEBUG for rec in caplog.records)


def test_metadata_passed_on_any_rank_is_recorded_the_lowest_ranks_value_first(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # (only rank 0's was kept, without a word: a pipeline's last stage could record none)
    from asyncckpt.best import merged_metadata

    store = dist.HashStore()
    passed = [{"run": "a"}, {"node": "n1", "run": "b"}, {"stage": "last", "node": "n2"}]

    def rank(r: int) -> None:
        with _synced(tmp_path, store, r, world=3, timeout_s=30) as ck:
            for step in (1, 2):
                ck.save({f"r{r}": torch.ones(2)}, step=step, metadata=passed[r])

    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        all_ok(in_threads(rank, world=3))
    for step in (1, 2):
        m = read_manifest(tmp_path / f"step_{step:09d}", LocalStorage())
        assert m.user_metadata == {"run": "a", "node": "n1", "stage": "last"}
    warned = [r.getMessage() for r in caplog.records if "different values" in r.getMessage()]
    assert len(warned) == 2, warned  # once per key, not per save
    assert any("metadata key 'run' (rank 0: 'a', rank 1: 'b')" in w for w in warned), warned
    assert any("metadata key 'node' (rank 1: 'n1', rank 2: 'n2')" in w for w in warned), warned
    with pytest.raises(CheckpointSaveError, match="rank 1's record holds the metadata key 'k'"):
        merged_metadata({}, [{"rank": 1, "metadata": {"k": 3}}], 5)


def test_a_rank_that_forgot_its_shards_is_told_so(tmp_path: Path) -> None:
    # (it was "ranks 0 and 1 disagree on tensor 'w': float32 [8, 4] vs float32 [4, 4]")
    store = dist.HashStore()

    def rank(r: int) -> str:
        with _synced(tmp_path, store, r) as ck:
            shards = {"w": ShardMetadata((8, 4), (4 * r, 0))} if r == 0 else None
            with pytest.raises(CheckpointConfigError) as ei:
                ck.save({"w": torch.ones(4, 4)}, step=1, shards=shards)
            return str(ei.value)

    for msg in in_threads(rank).values():
        assert "disagree on tensor 'w': float32 [8, 4] vs float32 [4, 4]" in msg, msg
        assert ("rank 0 saves a shard of it (a DTensor, or shards={'w': ShardMetadata(...)}), "
                "rank 1 a plain tensor, taken as the whole") in msg, msg


def test_ranks_of_different_plain_tensors_at_one_path_are_told_to_part_them(
        tmp_path: Path) -> None:
    """A distributed trial: each rank's own EMA tensor at one path, of another shape on
    one rank, was told "ranks 0 and 1 disagree on tensor 'ema': float32 [4] vs float32
    [5]", with nothing of what to do (the warning of differing values says it)."""
    store = dist.HashStore()

    def rank(r: int) -> str:
        with _synced(tmp_path, store, r) as ck:
            with pytest.raises(CheckpointConfigError) as ei:
                ck.save({"ema": torch.ones(4 + r)}, step=1)
            return str(ei.value)

    for msg in in_threads(rank).values():
        assert "disagree on tensor 'ema': float32 [4] vs float32 [5]; a plain tensor at one " \
            "path on every rank is taken as one replicated tensor: give each rank's own " \
            "value a path of its own (e.g. under the rank: f'ema_rank{rank}'), or declare " \
            "the sharding (a DTensor, or shards={'ema': ShardMetadata(...)})" in msg, msg
    # (review) one shape, two dtypes: a cast on one rank, not per-rank values
    store2 = dist.HashStore()

    def cast(r: int) -> str:
        with _synced(tmp_path / "cast", store2, r) as ck:
            with pytest.raises(CheckpointConfigError) as ei:
                ck.save({"ema": torch.ones(4, dtype=torch.bfloat16 if r else torch.float32)},
                        step=1)
            return str(ei.value)

    for msg in in_threads(cast).values():
        assert msg.endswith("float32 [4] vs bfloat16 [4]; every rank must hold it in one "
                            "dtype (a cast on one rank?)"), msg


def test_shards_declaring_two_global_shapes_are_told_what_the_shapes_are() -> None:
    # (a distributed trial: rank 0 declared ShardMetadata((4, 4), (0, 0)), rank 1
    # ShardMetadata((5, 4), (2, 0)), and was told the shapes alone, with no fix)
    from asyncckpt.dist import LocalItem, assign_writers

    def shard(dtype: str, global_shape: tuple[int, ...], row: int) -> LocalItem:
        return LocalItem("w", dtype, global_shape, ((row, 0), (2, 4)), 32)

    with pytest.raises(CheckpointConfigError) as info:
        assign_writers({0: [shard("float32", (4, 4), 0)], 1: [shard("float32", (5, 4), 2)]})
    assert str(info.value) == (
        "ranks 0 and 1 disagree on tensor 'w': float32 [4, 4] vs float32 [5, 4]; these are "
        "the global shapes the two ranks' shards declare (a DTensor's, or ShardMetadata's "
        "global_shape): every rank must declare the one shape of the whole tensor, its "
        "shard's offsets within it")
    with pytest.raises(CheckpointConfigError, match=r"float32 \[4, 4\] vs bfloat16 \[4, 4\]; "
                       r"every rank must hold it in one dtype \(a cast on one rank\?\)$"):
        assign_writers({0: [shard("float32", (4, 4), 0)], 1: [shard("bfloat16", (4, 4), 2)]})


def test_a_rank_given_by_hand_without_a_store_is_told_what_to_pass(tmp_path: Path) -> None:
    with pytest.raises(CheckpointConfigError, match=r"call torch\.distributed\."
                                                    r"init_process_group first, or pass store="):
        AsyncCheckpointer(tmp_path, rank=1, world_size=2)
    # with the default group up, that advice was wrong: rank= is what leaves it aside
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(CheckpointConfigError, match="drop rank= and world_size= to use "
                                                        "the default group"):
            AsyncCheckpointer(tmp_path, rank=1, world_size=2)
    finally:
        dist.destroy_process_group()


def test_a_rollback_in_a_group_is_the_coordinators_and_saves_go_on(tmp_path: Path) -> None:
    store = dist.HashStore()

    def rank(r: int) -> list[int]:
        with AsyncCheckpointer(tmp_path, rank=r, world_size=2, store=store, timeout_s=10,
                               mode="sync") as ck:
            for step in (1, 2, 3):
                ck.save(_state(r), step=step)
            ck.load(step=1)
            gone = ck.discard_steps_after(1)
            ck.save(_state(r), step=2)  # every rank returned once they were out of sight
            assert ck.steps() == [1, 2]
            return gone

    assert in_threads(rank) == {0: [2, 3], 1: [2, 3]}


def test_a_rollback_the_ranks_disagree_on_deletes_nothing_and_fails_on_every_rank(
        tmp_path: Path) -> None:
    # (rank 1 asked to keep step 3; rank 0's word deleted it)
    store = dist.HashStore()

    def rank(r: int) -> str:
        with _synced(tmp_path, store, r) as ck:
            for step in (1, 2, 3, 4):
                ck.save(_state(r), step=step)
            with pytest.raises(CheckpointConfigError) as ei:
                ck.discard_steps_after(2 if r == 0 else 3)
            assert ck.steps() == [1, 2, 3, 4]
            assert ck.discard_steps_after(3) == [4]  # agreed: done
            return str(ei.value)

    out = in_threads(rank)
    for r in (0, 1):
        assert "different steps (rank 0: 2, rank 1: 3); nothing was deleted" in out[r], out[r]


@pytest.mark.parametrize("caller", [0, 1])
def test_a_rollback_a_rank_does_not_join_names_the_call(tmp_path: Path, caller: int) -> None:
    """(distributed trial) A rank that never called discard_steps_after was said to "have
    not called save_async", in a wait for "the steps the ranks discard the steps after";
    and (a later trial) a rank whose coordinator never called it, waiting for its
    deletion, was told the coordinator "may have died or not called save_async"."""
    store = dist.HashStore()
    timeout_s = 2.0

    def rank(r: int) -> str:
        with _synced(tmp_path, store, r, timeout_s=timeout_s) as ck:
            ck.save(_state(r), step=1)
            if r == caller:
                with pytest.raises(CheckpointError) as ei:
                    ck.discard_steps_after(caller ^ 1)  # (1 on rank 0, 0 on rank 1)
                assert caller == 0 or isinstance(ei.value, CheckpointTimeoutError)
                return str(ei.value)
            if r == 0:
                time.sleep(2 * timeout_s + 1)  # (rank 0 never calls it, nor closes)
            return ""

    out = in_threads(rank)
    if caller == 0:
        assert "the step each rank passed to discard_steps_after from rank(s) [1]" in out[0], \
            out[0]
    assert "not called discard_steps_after (every rank must)" in out[caller], out[caller]
    if caller == 1:
        assert "save_async" not in out[1], out[1]


def test_a_rollback_the_coordinator_cannot_finish_fails_on_every_rank(tmp_path: Path) -> None:
    class Busy(LocalStorage):
        def rename(self, src: Path, dst: Path) -> None:
            if src.name == "step_000000002" and ".deleting-" in dst.name:
                raise OSError(errno.EBUSY, "Device or resource busy (injected)", str(src))
            super().rename(src, dst)

    store = dist.HashStore()

    def rank(r: int) -> str:
        with AsyncCheckpointer(tmp_path, rank=r, world_size=2, store=store, timeout_s=10,
                               mode="sync", storage=Busy() if r == 0 else LocalStorage()) as ck:
            for step in (1, 2, 3):
                ck.save(_state(r), step=step)
            with pytest.raises(CheckpointSaveError) as ei:
                ck.discard_steps_after(1)
            assert ck.steps() == [1, 2]
            return str(ei.value)

    out = in_threads(rank)
    assert "failed at step 2" in out[0] and "(deleted: [3])" in out[0], out[0]
    assert out[1].startswith("rank 1: deleting the steps after 1 ") and "[3]" in out[1], out[1]


def test_a_rank_stuck_in_its_write_is_told_the_group_gave_up_not_a_storage_error(
        tmp_path: Path) -> None:
    # Once awake, its write found the temporary directory removed by the coordinator and
    # its future said "failed: FileNotFoundError", as if its own disk were at fault.
    class Stuck(LocalStorage):
        def write_arena(self, path: Path, *args: Any, **kwargs: Any) -> None:
            time.sleep(3.0)
            super().write_arena(path, *args, **kwargs)

    store = dist.HashStore()

    def rank(r: int) -> str:
        state = {"w": torch.arange(6.0), f"only{r}": torch.ones(1000)}
        with AsyncCheckpointer(tmp_path, rank=r, world_size=2, store=store, timeout_s=1,
                               storage=Stuck() if r == 1 else LocalStorage()) as ck:
            with pytest.raises(CheckpointError) as ei:
                ck.save(state, step=1)
            return str(ei.value)

    out = in_threads(rank)
    assert "rank(s) [1]" in out[0], out[0]
    assert out[1].startswith("rank 1: stopped, nothing committed: rank 0:"), out[1]
    assert "rank(s) [1]" in out[1] and "FileNotFoundError" in out[1], out[1]
    assert not any(p.name.startswith("step_") for p in tmp_path.iterdir())


def test_a_rank_s_full_disk_is_told_to_the_others_with_its_advice(tmp_path: Path) -> None:
    """(distributed trial) Rank 1's disk filled: rank 1 was told what to do, rank 0 only
    "stopped ...: rank 1: OSError: [Errno 28]"."""
    class Full(LocalStorage):
        def write_arena(self, path: Path, *args: Any, **kwargs: Any) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

    store = dist.HashStore()

    def rank(r: int) -> str:
        with AsyncCheckpointer(tmp_path, rank=r, world_size=2, store=store, timeout_s=30,
                               storage=Full() if r == 1 else LocalStorage()) as ck:
            with pytest.raises(CheckpointError) as ei:
                ck.save({"w": torch.arange(6.0), f"only{r}": torch.ones(1000)}, step=1)
            return str(ei.value)

    out = in_threads(rank)
    for r in (0, 1):
        assert "No space left on device" in out[r] and "keep fewer steps" in out[r], out[r]
    assert "rank 1:" in out[0], out[0]


def test_prepare_in_a_group_sizes_the_arena_for_this_ranks_share(tmp_path: Path) -> None:
    """Replicated tensors are written once, spread over the ranks: prepare() must not
    allocate every rank an arena for all of them (with 8 ranks: 8x the memory)."""
    store = dist.HashStore()
    world = 4
    full = world * 2**20 * 4  # the replicated bytes, one copy

    def rank(r: int) -> tuple[int, bool, list[int]]:
        state = {f"rep{i}": torch.full((2**18,), float(i)) for i in range(world * 4)}
        state["mine"] = torch.full((2**16,), float(r))  # declared: each rank its own part
        shards = {"mine": ShardMetadata((world * 2**16,), (r * 2**16,))}
        with AsyncCheckpointer(tmp_path, rank=r, world_size=world, store=store,
                               timeout_s=30) as ck:
            ck.prepare(state, background=False, shards=shards)
            prepared = ck._arena
            assert prepared is not None
            ck.save(state, step=1, shards=shards)
            return prepared.nbytes, ck._arena is prepared, ck.steps()

    out = in_threads(rank, world=world)
    for r in range(world):
        nbytes, reused, steps = out[r]
        assert steps == [1]
        assert reused, f"rank {r}: the first save allocated again"
        # its quarter of the replicated data, the largest replicated tensor, its shard
        assert nbytes <= full // world + 2**20 + 2**18 + 2**16, (r, nbytes)
    loaded = asyncckpt.load(tmp_path)
    assert torch.equal(loaded["mine"], torch.arange(world).repeat_interleave(2**16).float())


class _LosesVerdicts:
    """A Store through which the coordinator's "ok" verdict never arrives."""

    def __init__(self) -> None:
        self.store = dist.HashStore()

    def set(self, key: str, value: str) -> None:
        if key.endswith("/verdict") and '"ok"' in value:
            raise RuntimeError("connection reset by peer")
        self.store.set(key, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def test_a_peer_gives_the_coordinators_verdict_timeout_s_of_silence_and_the_grace(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A coordinator SIGKILLed mid-write was given up on after 2 * timeout_s + 30 s of
    # silence (20.5 minutes at the default), though its count moves at every slice of its
    # own waits: timeout_s of silence, and the grace for its merge and commit, say it.
    waits: list[float | None] = []
    real_get = DistContext.get

    def get(self: DistContext, key: str, what: str, timeout_s: float | None = None,
            **kw: Any) -> Any:
        if key.endswith("/verdict"):
            waits.append(timeout_s)
        return real_get(self, key, what, timeout_s, **kw)

    monkeypatch.setattr(DistContext, "get", get)
    store = dist.HashStore()

    def rank(r: int) -> None:
        with AsyncCheckpointer(tmp_path, rank=r, world_size=2, store=store,
                               timeout_s=7.0) as ck:
            ck.save(_state(r), step=1)

    all_ok(in_threads(rank))
    assert waits == [7.0 + asyncckpt.writer._VERDICT_GRACE_S]


class _CommitWaits(LocalStorage):
    """The commit's first call (the fsync of the temporary directory, the manifest in
    it) waits until ``gate`` is set: a coordinator stuck in its commit."""

    def __init__(self) -> None:
        self.gate = threading.Event()

    def fsync_dir(self, path: Path) -> None:
        if Path(path).name.startswith(".step_") and (Path(path) / "manifest.json").exists():
            self.gate.wait(20)
        super().fsync_dir(path)


def test_a_coordinator_stuck_in_its_commit_is_named_as_committing_not_as_waiting(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # (a trial: a peer of a coordinator that died mid-commit was told it was "last waiting
    # for the shard files of step 1 from rank(s) [1]": the rank told had posted its file)
    monkeypatch.setattr(asyncckpt.writer, "_VERDICT_GRACE_S", 0.0)
    store, stuck = dist.HashStore(), _CommitWaits()

    def rank(r: int) -> Any:
        with AsyncCheckpointer(tmp_path, rank=r, world_size=2, store=store, timeout_s=1,
                               storage=stuck if r == 0 else LocalStorage()) as ck:
            fut = ck.save_async(_state(r), step=1)
            try:
                return fut.wait()
            finally:
                stuck.gate.set()  # (the peer gave up: let the coordinator's commit go on)

    out = in_threads(rank)
    assert isinstance(out[1], CheckpointTimeoutError), out[1]
    assert "rank 0 was last committing step 1" in str(out[1]), out[1]
    assert isinstance(out[0], CheckpointSaveError), out[0]  # the peer decided: not committed
    assert AsyncCheckpointer(tmp_path).steps() == []


def test_a_plain_load_in_a_group_that_finds_damage_says_to_move_every_rank(
        tmp_path: Path) -> None:
    # (a DCP trial followed "load an earlier step" on the rank that raised: the other rank
    # had loaded the newer step, and the ranks went on from different steps, told nothing)
    store = dist.HashStore()

    def save(r: int) -> None:
        with AsyncCheckpointer(tmp_path, rank=r, world_size=2, store=store,
                               timeout_s=30) as ck:
            ck.save({"w": torch.arange(1000.0)}, step=1)

    all_ok(in_threads(save))
    shard = next((tmp_path / "step_000000001").glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))

    def load(r: int) -> Any:
        with AsyncCheckpointer(tmp_path, rank=r, world_size=2, store=store,
                               timeout_s=30) as ck:
            return ck.load({"w": torch.zeros(1000)})

    out = in_threads(load)
    for r in (0, 1):
        assert isinstance(out[r], asyncckpt.CheckpointCorruptError), out[r]
        said = str(out[r])  # (not a note: a log line of str(exc) lost it)
        assert f"rank {r}: a plain load is this rank's alone" in said, said
        assert "load(..., fallback=True) on every rank" in said, said
    # (a review: marked on the rank that raised alone, best_step() differed between the
    # ranks; fallback=True, collective, is the group's verdict)
    assert not (tmp_path / "step_000000001" / "damaged.json").exists()


def test_a_pulse_whose_store_is_gone_says_the_save_stopped() -> None:
    # (a storage trial: rank 0, the Store's host, failed on a full disk and exited; rank 1
    # asked the gone Store whether the save was aborted, was told no, and waited 10 s)
    from asyncckpt.dist import Pulse

    class Gone:
        def check(self, keys: list[str]) -> bool:
            raise RuntimeError("Connection reset by peer")

    ctx = _ctx(timeout_s=5.0)
    pulse = Pulse(ctx, "s1")
    assert not pulse.stopped()
    pulse.abort("rank 0: ENOSPC")
    assert pulse.stopped()
    gone = DistContext(rank=1, world_size=2, store=Gone(), namespace="t",  # type: ignore[arg-type]
                       timeout_s=5.0)
    assert Pulse(gone, "s1").stopped()


def test_a_rank_whose_save_directory_rank_0_removed_is_told_so(tmp_path: Path) -> None:
    # (a DCP trial's rank 1, its save's directory removed by rank 0 as it gave the save
    # up, was told FileNotFoundError alone)
    store = dist.HashStore()
    made = threading.Event()

    class Made(LocalStorage):  # (rank 0's: says when it has made the save's directory)
        def makedirs(self, path: Path) -> None:
            super().makedirs(path)
            if ".tmp-" in Path(path).name:
                made.set()

    class Removed(LocalStorage):  # (rank 1's: the directory goes, as rank 0's abort takes it)
        def write_arena(self, path: Path, *args: Any, **kwargs: Any) -> None:
            assert made.wait(10)
            shutil.rmtree(Path(path).parent, ignore_errors=True)
            super().write_arena(path, *args, **kwargs)

    def rank(r: int) -> Any:
        with AsyncCheckpointer(tmp_path, rank=r, world_size=2, store=store, timeout_s=5,
                               storage=Removed() if r == 1 else Made()) as ck:
            # (rank 0 writes no file of its own: its write would race rank 1's removal)
            state = {"n": 0} if r == 0 else {"w1": torch.full((1000,), 1.0)}
            return ck.save_async(state, step=1).wait()

    out = in_threads(rank)
    assert isinstance(out[1], CheckpointSaveError), out[1]
    assert "its temporary directory .step_000000001.tmp-" in str(out[1])
    assert "is gone: rank 0 removes it when it gives the save up" in str(out[1])


def test_a_committed_step_whose_verdict_cannot_be_posted_is_no_failure_on_rank_0(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(asyncckpt.writer, "_VERDICT_GRACE_S", 0.0)
    store = _LosesVerdicts()

    def rank(r: int) -> Any:
        with AsyncCheckpointer(tmp_path, rank=r, world_size=2, store=store,
                               timeout_s=1) as ck:
            return ck.save_async(_state(r), step=5).wait()

    out = in_threads(rank)
    assert isinstance(out[0], asyncckpt.CheckpointInfo), out[0]  # it is committed
    assert out[0].path == tmp_path / "step_000000005"
    assert isinstance(out[1], CheckpointTimeoutError), out[1]
    assert "decided to commit step 5 but did not confirm it" in str(out[1])
    assert AsyncCheckpointer(tmp_path).steps() == [5]


def test_a_per_rank_tensor_under_a_shared_path_is_warned_about(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """One path on every rank is one replicated tensor, saved once: a rank whose copy
    differs (each rank's RNG state saved as a tensor at one path) loses it; say so."""
    store = dist.HashStore()

    def rank(r: int) -> None:
        rng = torch.Generator().manual_seed(r).get_state()  # (ranks are threads here)
        state = {"w": torch.ones(8), "rng": rng, "same": torch.arange(5),
                 "big": torch.full((1 << 15,), float(r))}  # 128 KiB: not compared
        with AsyncCheckpointer(tmp_path, rank=r, world_size=2, store=store,
                               timeout_s=30) as ck:
            ck.save(state, step=1)

    with caplog.at_level("WARNING", logger="asyncckpt"):
        assert in_threads(rank) == {0: None, 1: None}
    warned = [rec.getMessage() for rec in caplog.records if "different values" in
              rec.getMessage()]
    assert len(warned) == 1, caplog.text
    assert "'rng'" in warned[0] and "'same'" not in warned[0] and "'w'" not in warned[0]
    assert "RNGState()" in warned[0]


@pytest.mark.parametrize("differ", ["big", "later", "scalar"])
def test_strict_replicas_refuse_a_save_whose_ranks_differ_and_commit_nothing(
        tmp_path: Path, differ: str) -> None:
    """strict_replicas=True: a replicated value that differs between ranks (a tensor of
    any size, the second save's only; or a non-tensor value) fails the save on every
    rank, and no step becomes visible; equal replicas save as ever."""
    store = dist.HashStore()

    def rank(r: int) -> list[int]:
        with AsyncCheckpointer(tmp_path, rank=r, world_size=2, store=store, timeout_s=30,
                               strict_replicas=True) as ck:
            state: dict[str, Any] = {"w": torch.ones(8), "big": torch.zeros(1 << 16),
                                     "lr": 0.1}
            ck.save(state, step=1)  # equal everywhere
            if differ == "big":
                state["big"] = torch.full((1 << 16,), float(r))  # 256 KiB: compared too
            elif differ == "later":
                state["big"][-1] = r  # one element of the last checksum block
            else:
                state["lr"] = 0.1 * (r + 1)
            try:
                ck.save(state, step=2)
            except asyncckpt.CheckpointSaveError as exc:
                assert "strict_replicas=True" in str(exc) and "nothing committed" in str(exc)
                assert ("'lr'" if differ == "scalar" else "'big'") in str(exc), exc
                if differ != "scalar":  # (each tensor with its own ranks that differ)
                    assert re.search(r"'big' \(rank\(s\) \[[01]\]\)", str(exc)), exc
                return ck.steps()
            raise AssertionError("the save of differing replicas was committed")

    assert in_threads(rank) == {0: [1], 1: [1]}
    assert AsyncCheckpointer(tmp_path).steps() == [1]


def test_strict_replicas_compare_the_replicated_boxes_of_a_sharded_tensor(
        tmp_path: Path) -> None:
    """HSDP: a shard held by two ranks (declared by hand here: ranks 0 and 1 hold rows
    0:2, rank 2 rows 2:4) is one replica of a box; strict_replicas compares it too, at
    the first save (a whole merge) and at later ones (the coordinator's template)."""
    store = dist.HashStore()

    def rank(r: int) -> list[Any]:
        got: list[Any] = []
        with AsyncCheckpointer(tmp_path, rank=r, world_size=3, store=store, timeout_s=30,
                               strict_replicas=True) as ck:
            for step, differ in ((1, False), (2, True), (3, False)):
                local = torch.full((2, 3), float(step) + (r if differ and r < 2 else 0))
                try:
                    ck.save({"w": local}, step, shards={"w": asyncckpt.ShardMetadata(
                        (4, 3), (0 if r < 2 else 2, 0))})
                    got.append(step)
                except asyncckpt.CheckpointSaveError as exc:
                    assert "strict_replicas=True" in str(exc) and "'w'" in str(exc), exc
                    got.append("refused")
        return got

    assert in_threads(rank, 3) == {r: [1, "refused", 3] for r in range(3)}
    assert AsyncCheckpointer(tmp_path).steps() == [1, 3]
    assert torch.equal(asyncckpt.load(tmp_path)["w"], torch.full((4, 3), 3.0))


def test_strict_replicas_and_direct_io_are_bools_numpys_too(tmp_path: Path) -> None:
    with pytest.raises(asyncckpt.CheckpointConfigError, match="strict_replicas='yes'"):
        AsyncCheckpointer(tmp_path, strict_replicas="yes")  # type: ignore[arg-type]
    with pytest.raises(asyncckpt.CheckpointConfigError, match="direct_io='no'"):
        AsyncCheckpointer(tmp_path, direct_io="no")  # type: ignore[arg-type]
    # as every flag takes numpy's bools (the docs' word; a trial's direct_io=np.True_ was
    # refused with "use True or False"), kept as Python's (sent to other ranks as JSON)
    ck = AsyncCheckpointer(tmp_path, strict_replicas=np.True_,  # type: ignore[arg-type]
                           direct_io=np.False_)  # type: ignore[arg-type]
    assert ck.config.strict_replicas is True and ck.config.direct_io is False
    ck.save({"w": torch.ones(2)}, 1)
    ck.close()


def test_equal_replicas_are_not_warned_about(tmp_path: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    store = dist.HashStore()

    def rank(r: int) -> None:
        state = {f"t{i}": torch.arange(i + 3, dtype=torch.float64) for i in range(20)}
        state["conj"] = torch.tensor([1 + 2j, 3 - 1j]).conj()  # a lazy view: its bytes differ
        with AsyncCheckpointer(tmp_path, rank=r, world_size=2, store=store,
                               timeout_s=30) as ck:
            ck.save(state, step=1)
            ck.save(state, step=2)

    with caplog.at_level("WARNING", logger="asyncckpt"):
        assert in_threads(rank) == {0: None, 1: None}
    assert "different values" not in caplog.text


def test_a_rank_hashes_only_the_replicas_another_rank_writes(tmp_path: Path) -> None:
    """Each rank sends the coordinator checksums of the small replicated tensors it holds
    but does not write, to compare with the copy saved: those it writes itself are the
    copy saved (it hashed all of them, and the ranks' layout digest stood in for the
    keys it writes)."""
    store = dist.HashStore()
    sent: dict[int, list[dict[str, list[str]]]] = {0: [], 1: []}

    def rank(r: int) -> set[str]:
        state = {f"t{i}": torch.arange(i + 3, dtype=torch.float64) for i in range(10)}
        with AsyncCheckpointer(tmp_path, rank=r, world_size=2, store=store,
                               timeout_s=30) as ck:
            real = ck._replica_checksums

            def spy(flat: Any) -> dict[str, list[str]]:
                out = real(flat)
                sent[r].append(out)
                return out

            ck._replica_checksums = spy  # type: ignore[method-assign]
            for step in (1, 2):
                ck.save(state, step=step)
            assert ck._layout is not None
            return set(ck._layout[2])

    writes = in_threads(rank)
    assert writes[0] and writes[1] and not writes[0] & writes[1]
    assert writes[0] | writes[1] == {f"t{i}" for i in range(10)}
    for r in (0, 1):
        assert [set(out) for out in sent[r]] == [writes[1 - r]] * 2, (r, sent[r])


def test_a_step_committed_but_not_durable_is_reported_so_on_every_rank(tmp_path: Path) -> None:
    store = dist.HashStore()

    def rank(r: int) -> Any:
        storage = StuckCommit(tmp_path) if r == 0 else LocalStorage()
        with AsyncCheckpointer(tmp_path, rank=r, world_size=2, store=store, timeout_s=30,
                               storage=storage) as ck:
            ck.save(_state(r), step=1)
            with pytest.raises(CheckpointSaveError) as failed:
                ck.save(_state(r), step=2)
            return str(failed.value)

    out = in_threads(rank)
    for r in (0, 1):
        assert "step 2 is committed at" in out[r], out[r]
        assert "was not committed" not in out[r], out[r]
    assert AsyncCheckpointer(tmp_path).steps() == [1, 2]
    assert torch.equal(asyncckpt.load(tmp_path, step=2)["w"], _state(0)["w"])


def test_an_interrupt_in_the_commit_stays_an_interrupt(tmp_path: Path) -> None:
    from asyncckpt import commit

    tmp = tmp_path / ".step_000000002.tmp-abc"
    tmp.mkdir()
    (tmp / "manifest.json").write_text("{}")
    with pytest.raises(KeyboardInterrupt):
        commit.commit(tmp, tmp_path, 2, StuckCommit(tmp_path, interrupt=True))


# --- load(fallback=True) in a group: one verdict per step for every rank ------------------

def _save_two_sharded_steps(tmp_path: Path, store: Any) -> None:
    def rank(r: int) -> None:
        with AsyncCheckpointer(tmp_path, mode="sync", rank=r, world_size=2, store=store,
                               timeout_s=10) as ck:
            for step in (1, 2):
                w = torch.full((4,), float(10 * step + r))  # rows 4r..4r+3 of 8
                ck.save({"w": w, "step": step}, step=step,
                        shards={"w": ShardMetadata((8,), (4 * r,))})
    all_ok(in_threads(rank))


def _damage_rank1_part_of_step2(tmp_path: Path) -> None:
    step_dir = tmp_path / "step_000000002"
    m = asyncckpt.AsyncCheckpointer(tmp_path).manifest(2)
    chunk = next(c for c in m.tensors["w"].chunks if c.offsets == (4,))
    with open(step_dir / chunk.file, "r+b") as f:
        f.seek(chunk.byte_range[0])
        f.write(b"\xff\xff\xff\xff")


def test_ranks_given_a_directory_and_a_link_to_it_are_told_it_is_one(tmp_path: Path) -> None:
    """(distributed trial) rank 1's path was a symlink to rank 0's: told of two directories,
    while ck.directory on each showed the same one."""
    (tmp_path / "root").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "root")
    store = dist.HashStore()

    def rank(r: int) -> str:
        with AsyncCheckpointer(tmp_path / ("root" if r == 0 else "link"), rank=r, world_size=2,
                               store=store, timeout_s=60) as ck:
            with pytest.raises(CheckpointConfigError) as info:
                ck.save({"w": torch.full((4,), float(r))}, step=1)
            return str(info.value)

    out = all_ok(in_threads(rank, timeout=50))
    for r in (0, 1):
        assert "they are one directory here, under two names" in out[r], out[r]


def test_a_rank_that_reopened_its_checkpointer_alone_is_told_at_once(tmp_path: Path) -> None:
    """(distributed trial) Rank 1 closed and reopened its checkpointer after an error, rank
    0 kept its own: every later save waited out timeout_s on both (10 minutes at the
    default), though each rank's note in the Store told it at once."""
    store = dist.HashStore()

    def rank(r: int) -> tuple[str, float]:
        ck = AsyncCheckpointer(tmp_path, rank=r, world_size=2, store=store, timeout_s=60,
                               mode="sync")
        ck.save({"w": torch.full((4,), float(r))}, step=1)
        if r == 1:
            ck.close()
            ck = AsyncCheckpointer(tmp_path, rank=r, world_size=2, store=store, timeout_s=60,
                                   mode="sync")
        t0 = time.monotonic()
        try:
            with pytest.raises(CheckpointConfigError) as info:
                ck.save({"w": torch.full((4,), float(r))}, step=2)
            return str(info.value), time.monotonic() - t0
        finally:
            with contextlib.suppress(Exception):
                ck.close()

    out = all_ok(in_threads(rank, timeout=90))
    for r in (0, 1):
        msg, took = out[r]
        assert took < 30, out
        assert "make (and close) its checkpointers in the same order" in msg, msg
    assert not (tmp_path / "step_000000002").exists()


def test_ranks_saving_into_different_directories_are_told_at_once(tmp_path: Path) -> None:
    """A trial gave each rank a directory of its own (nodes without a shared filesystem):
    both waited out the whole timeout_s before an error named the two directories."""
    store = dist.HashStore()

    def rank(r: int) -> tuple[str, float]:
        with AsyncCheckpointer(tmp_path / f"rank{r}", rank=r, world_size=2, store=store,
                               timeout_s=60) as ck:
            t0 = time.monotonic()
            with pytest.raises(CheckpointConfigError) as info:
                ck.save({"w": torch.full((4,), float(r))}, step=1)
            return str(info.value), time.monotonic() - t0

    out = all_ok(in_threads(rank, timeout=50))
    for r in (0, 1):
        msg, took = out[r]
        assert took < 20, out
        assert f"rank {1 - r} is saving step 1 into '{tmp_path / f'rank{1 - r}'}', this rank " \
            f"into '{tmp_path / f'rank{r}'}'" in msg, msg
        assert not list((tmp_path / f"rank{r}").glob("step_*")), r
    # then saving the same step into one directory, on the same Store: the notes of the
    # failed saves do not refuse it

    def shared(r: int) -> list[int]:
        with AsyncCheckpointer(tmp_path / "shared", rank=r, world_size=2, store=store,
                               timeout_s=30) as ck:
            ck.save({"w": torch.full((4,), 1.0)}, step=1,
                    shards={"w": ShardMetadata((8,), (4 * r,))})
            return ck.steps()

    assert all_ok(in_threads(shared)) == {0: [1], 1: [1]}


@pytest.mark.parametrize("case", ["another directory", "another checkpointer"])
def test_the_coordinator_s_close_waits_for_no_rank_found_in_another_save(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """Rank 0's close() after a save it refused waits (it may host the Store) until the
    others have read why; a rank found saving into another directory, or with another
    checkpointer, never reads that save's keys: close() waited its whole wait for it
    (10 s after every such refusal, a test suite's slowest tests)."""
    import asyncckpt.checkpointer as checkpointer_mod

    monkeypatch.setattr(checkpointer_mod, "_VERDICT_SEEN_S", 40.0)
    store = dist.HashStore()

    def rank(r: int) -> tuple[str, float]:
        path = tmp_path / (f"rank{r}" if case == "another directory" else "shared")

        def open_() -> AsyncCheckpointer:
            return AsyncCheckpointer(path, rank=r, world_size=2, store=store, timeout_s=60,
                                     mode="sync")

        ck = open_()
        try:
            if case == "another checkpointer":
                ck.save({"w": torch.full((4,), 1.0)}, step=1,
                        shards={"w": ShardMetadata((8,), (4 * r,))})
                if r == 1:
                    ck.close()
                    ck = open_()
            with pytest.raises(CheckpointConfigError) as info:
                ck.save({"w": torch.full((4,), 1.0)}, step=2,
                        shards={"w": ShardMetadata((8,), (4 * r,))})
        finally:
            t0 = time.monotonic()
            ck.close()
        return str(info.value), time.monotonic() - t0

    out = all_ok(in_threads(rank, timeout=120))
    for r in (0, 1):
        msg, closing = out[r]
        assert closing < 20, (r, out)  # (40 s before: its wait for a word never posted)
        assert f"rank {1 - r} is saving step 2 into" in msg, msg
    assert not (tmp_path / "shared" / "step_000000002").exists()


def test_the_coordinator_s_close_stops_waiting_once_every_other_rank_closed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 skipped the save rank 0 gave up on, and closed its checkpointer: it reads
    nothing more, and rank 0's close() waited its whole wait (10 s) for it to read why
    the save failed."""
    import asyncckpt.checkpointer as checkpointer_mod

    monkeypatch.setattr(checkpointer_mod, "_VERDICT_SEEN_S", 40.0)
    store = dist.HashStore()
    gave_up, closed = threading.Event(), threading.Event()

    def rank(r: int) -> float:
        ck = _synced(tmp_path, store, r, timeout_s=1)
        ck._ctx.timeout_s = 30.0
        ck.save(_state(r), step=1)
        ck._ctx.timeout_s = 1.0
        if r == 1:
            assert gave_up.wait(30)
            ck.close()
            closed.set()
            return 0.0
        with pytest.raises(CheckpointTimeoutError):
            ck.save(_state(r), step=2)  # (rank 1 skips it)
        gave_up.set()
        assert closed.wait(30)
        ck._ctx.timeout_s = 40.0  # (close() waits at most this long for rank 1's word)
        t0 = time.monotonic()
        ck.close()
        return time.monotonic() - t0

    out = all_ok(in_threads(rank, timeout=120))
    assert out[0] < 20, out  # (40 s before)


def test_a_fallback_load_in_a_group_ends_on_the_same_step_on_every_rank(tmp_path: Path) -> None:
    """Only rank 1's rows of step 2 are damaged: rank 0 alone would load step 2, rank 1
    step 1, and the model would be stitched from two steps. All fall back together."""
    store = dist.HashStore()
    _save_two_sharded_steps(tmp_path, store)
    _damage_rank1_part_of_step2(tmp_path)

    def rank(r: int) -> tuple[int, list[float]]:
        w = torch.zeros(4)
        with AsyncCheckpointer(tmp_path, rank=r, world_size=2, store=store,
                               timeout_s=10) as ck:
            got = ck.load({"w": w, "step": 0}, fallback=True,
                          shards={"w": ShardMetadata((8,), (4 * r,))})
        assert got["w"] is w
        return got["step"], w.tolist()

    out = all_ok(in_threads(rank))
    assert out == {0: (1, [10.0] * 4), 1: (1, [11.0] * 4)}, out
    # rank 0 marked the step, with rank 1's finding (its own rows were intact)
    mark = json.loads((tmp_path / "step_000000002" / "damaged.json").read_text())
    assert mark["step"] == 2 and mark["problem"].startswith("rank 1: "), mark
    assert "checksum mismatch" in mark["problem"], mark
    # twice in a row pairs again (the second load's verdicts are its own)
    assert all_ok(in_threads(rank)) == out


class _LaggingView(LocalStorage):
    """A rank's view of a network filesystem that does not show step 2's files yet: its
    directory is listed, its manifest is not found."""

    def read_bytes(self, path: Path, limit: int) -> bytes:
        if path.parent.name == "step_000000002":
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path))
        return super().read_bytes(path, limit)


def test_a_step_another_rank_does_not_see_yet_is_not_marked_damaged(tmp_path: Path) -> None:
    """Rank 1 does not find step 2 (its NFS view lags): every rank falls back to step 1,
    but nothing is damaged: no damaged.json (which kept the step against keep_last and
    made ls exit 1)."""
    store = dist.HashStore()
    _save_two_sharded_steps(tmp_path, store)

    def rank(r: int) -> int:
        w = torch.zeros(4)
        with AsyncCheckpointer(tmp_path, rank=r, world_size=2, store=store, timeout_s=10,
                               storage=_LaggingView() if r == 1 else None) as ck:
            got = ck.load({"w": w, "step": 0}, fallback=True,
                          shards={"w": ShardMetadata((8,), (4 * r,))})
            assert ck._damaged == set(), (r, ck._damaged)
        return int(got["step"])

    assert all_ok(in_threads(rank)) == {0: 1, 1: 1}
    assert not (tmp_path / "step_000000002" / "damaged.json").exists()


def test_a_group_fallback_marks_each_ranks_finding_under_its_rank(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """(A trial: damaged.json named rank 1's finding "rank 1: ..." and rank 0's own with
    no rank.) Both ranks' rows of step 2 damaged: both named, in rank order."""
    store = dist.HashStore()
    _save_two_sharded_steps(tmp_path, store)
    _damage_rank1_part_of_step2(tmp_path)
    m = asyncckpt.AsyncCheckpointer(tmp_path).manifest(2)
    chunk = next(c for c in m.tensors["w"].chunks if c.offsets == (0,))
    with open(tmp_path / "step_000000002" / chunk.file, "r+b") as f:
        f.seek(chunk.byte_range[0])
        f.write(b"\xff\xff\xff\xff")

    def rank(r: int) -> int:
        with AsyncCheckpointer(tmp_path, rank=r, world_size=2, store=store,
                               timeout_s=10) as ck:
            got = ck.load({"w": torch.zeros(4), "step": 0}, fallback=True,
                          shards={"w": ShardMetadata((8,), (4 * r,))})
        return int(got["step"])

    with caplog.at_level("WARNING", logger="asyncckpt"):
        assert all_ok(in_threads(rank)) == {0: 1, 1: 1}
    problem = json.loads((tmp_path / "step_000000002" / "damaged.json").read_text())["problem"]
    assert problem.startswith("rank 0: ") and "; rank 1: " in problem, problem
    assert problem.count("checksum mismatch") == 2, problem
    # each finding logged by its rank, and the others' by rank 0 alone (every rank logged
    # every other rank's: ranks x ranks lines in a large job)
    said = caplog.text
    assert said.count("rank 1 could not load it (") == 1, said  # (by rank 0)
    assert said.count("rank 0 could not load it (") == 0, said
    assert said.count("1 other rank(s) could not load it (rank 0 logs why)") == 1, said
    assert said.count(" is corrupt (") == 2, said  # (each rank its own)


def test_a_group_fallback_load_that_fails_on_one_rank_fails_on_all(tmp_path: Path) -> None:
    store = dist.HashStore()
    _save_two_sharded_steps(tmp_path, store)

    targets: dict[int, torch.Tensor] = {}

    def rank(r: int) -> Any:
        w = torch.zeros(4, dtype=torch.float32 if r == 0 else torch.float64)  # rank 1: wrong
        targets[r] = w
        with AsyncCheckpointer(tmp_path, rank=r, world_size=2, store=store,
                               timeout_s=30) as ck:
            return ck.load({"w": w, "step": 0}, fallback=True,
                           shards={"w": ShardMetadata((8,), (4 * r,))})

    t0 = time.monotonic()
    out = in_threads(rank)
    assert isinstance(out[1], asyncckpt.StateMismatchError), out
    assert isinstance(out[0], CheckpointError) and "rank 1 failed" in str(out[0]), out
    assert time.monotonic() - t0 < 20  # told, not timed out
    # rank 0 read step 2 into its target before it was told: its error says so
    assert targets[0].tolist() == [20.0] * 4
    assert ("this rank's targets were loaded in place from step 2 and may hold its data"
            in str(out[0])), out[0]


def test_a_group_fallback_load_on_one_rank_alone_times_out_naming_the_other(
        tmp_path: Path) -> None:
    store = dist.HashStore()
    _save_two_sharded_steps(tmp_path, store)
    with AsyncCheckpointer(tmp_path, rank=0, world_size=2, store=store, timeout_s=1) as ck, \
            pytest.raises(CheckpointTimeoutError, match=r"every rank must call it") as info:
        ck.load(fallback=True)
    assert info.value.ranks == (1,)


def test_a_rank_late_to_a_group_fallback_load_fails_as_the_one_that_gave_up(
        tmp_path: Path) -> None:
    """Rank 1 comes after rank 0 gave up waiting: it finds rank 0's verdict posted, and
    must not load on its own (rank 0 raised: the group would go on split). Both then
    retry together, and their loads pair again."""
    store = dist.HashStore()
    _save_two_sharded_steps(tmp_path, store)

    def load(r: int, timeout_s: float) -> Any:
        with AsyncCheckpointer(tmp_path, rank=r, world_size=2, store=store,
                               timeout_s=timeout_s) as ck:
            return ck.load({"w": torch.zeros(4), "step": 0}, fallback=True,
                           shards={"w": ShardMetadata((8,), (4 * r,))})

    with pytest.raises(CheckpointTimeoutError):
        load(0, 1)
    t0 = time.monotonic()
    with pytest.raises(CheckpointTimeoutError, match=r"rank 0 failed: rank 0: timed out"):
        load(1, 30)
    assert time.monotonic() - t0 < 15  # told at once, not after its own timeout
    out = all_ok(in_threads(lambda r: load(r, 30)))
    assert [out[r]["step"] for r in (0, 1)] == [2, 2], out


def test_a_rank_that_gave_up_stops_the_others_waiting_for_a_third(tmp_path: Path) -> None:
    store = dist.HashStore()

    def rank(r: int) -> None:
        with AsyncCheckpointer(tmp_path, mode="sync", rank=r, world_size=3, store=store,
                               timeout_s=10) as ck:
            ck.save({"w": torch.ones(2)}, step=1)
    all_ok(in_threads(rank, world=3))

    def load(r: int) -> Any:  # rank 2 never comes; rank 1 would wait 60 s
        with AsyncCheckpointer(tmp_path, rank=r, world_size=3, store=store,
                               timeout_s=1 if r == 0 else 60) as ck:
            return ck.load(fallback=True)

    t0 = time.monotonic()
    out = in_threads(load)
    assert isinstance(out[0], CheckpointTimeoutError) and out[0].ranks == (2,), out
    assert isinstance(out[1], CheckpointTimeoutError), out
    assert "rank 0 failed" in str(out[1]) and "rank(s) [2]" in str(out[1]), out
    assert time.monotonic() - t0 < 30, "rank 1 waited for its own timeout"


def test_a_rank_with_no_step_to_try_tells_the_others_at_once(tmp_path: Path) -> None:
    store = dist.HashStore()
    _save_two_sharded_steps(tmp_path, store)

    class SeesNothing(LocalStorage):  # a node whose view of the directory is stale
        def listdir(self, path: Path) -> list[str]:
            return []

    def load(r: int) -> Any:
        with AsyncCheckpointer(tmp_path, rank=r, world_size=2, store=store, timeout_s=60,
                               storage=SeesNothing() if r == 1 else None) as ck:
            return ck.load(fallback=True)

    t0 = time.monotonic()
    out = in_threads(load)
    assert isinstance(out[1], asyncckpt.CheckpointNotFoundError), out
    assert isinstance(out[0], CheckpointError), out
    assert "rank 1 failed: CheckpointNotFoundError: no committed checkpoint" in str(out[0])
    assert time.monotonic() - t0 < 30, "rank 0 waited for its timeout"


class _Hides(LocalStorage):
    """A node whose view of the directory lacks some of its entries (not yet visible)."""

    def __init__(self, *names: str) -> None:
        super().__init__()
        self.names = set(names)

    def listdir(self, path: Path) -> list[str]:
        return [n for n in super().listdir(path) if n not in self.names]


def _fallback_loads(tmp_path: Path, store: Any, rank1_storage: LocalStorage
                    ) -> dict[int, Any]:
    """Both ranks of _save_two_sharded_steps load with fallback, rank 1 through
    ``rank1_storage``: each rank's result or exception."""
    def load(r: int) -> Any:
        with AsyncCheckpointer(tmp_path, rank=r, world_size=2, store=store, timeout_s=60,
                               storage=rank1_storage if r == 1 else None) as ck:
            return ck.load({"w": torch.zeros(4), "step": 0}, fallback=True,
                           shards={"w": ShardMetadata((8,), (4 * r,))})

    return in_threads(load)


class _EIOOn(LocalStorage):
    """An outage on one node: opening the shard files of ``step_dir`` fails with EIO."""

    def __init__(self, step_dir: str) -> None:
        super().__init__()
        self.step_dir = step_dir

    def open_read(self, path: Path) -> int:
        if path.parent.name == self.step_dir and path.name.endswith(".safetensors"):
            raise OSError(errno.EIO, "Input/output error")
        return super().open_read(path)


def test_another_rank_s_eio_in_a_group_fallback_load_marks_nothing(tmp_path: Path) -> None:
    """(a review) An EIO may be an outage, not damage: a process alone, and the rank that
    met it, marked nothing, but its verdict reached rank 0 without saying so, and rank 0
    wrote damaged.json into the intact newest step (retention, best_step() and ls then
    passed over it for good). The group still loads the older step."""
    store = dist.HashStore()
    _save_two_sharded_steps(tmp_path, store)
    out = _fallback_loads(tmp_path, store, _EIOOn("step_000000002"))
    for r in (0, 1):
        assert not isinstance(out[r], BaseException), out
        assert out[r]["step"] == 1
    assert not (tmp_path / "step_000000002" / "damaged.json").exists()
    # damage found for sure on rank 1 is still marked, by rank 0
    _damage_rank1_part_of_step2(tmp_path)
    out = _fallback_loads(tmp_path, store, LocalStorage())
    assert [out[r]["step"] for r in (0, 1)] == [1, 1], out
    assert "rank 1:" in (tmp_path / "step_000000002" / "damaged.json").read_text()


def test_a_rank_that_runs_out_of_steps_tells_a_rank_that_has_more(tmp_path: Path) -> None:
    store = dist.HashStore()
    _save_two_sharded_steps(tmp_path, store)

    _damage_rank1_part_of_step2(tmp_path)
    t0 = time.monotonic()
    out = _fallback_loads(tmp_path, store, _Hides("step_000000001"))
    assert isinstance(out[1], asyncckpt.CheckpointCorruptError), out
    assert isinstance(out[0], CheckpointError), out
    assert "rank 1 failed: CheckpointCorruptError: no intact checkpoint" in str(out[0]), out
    assert time.monotonic() - t0 < 30, "rank 0 waited for its timeout"


def test_ranks_that_see_different_steps_stop_a_group_fallback_load(tmp_path: Path) -> None:
    store = dist.HashStore()
    _save_two_sharded_steps(tmp_path, store)

    t0 = time.monotonic()
    out = _fallback_loads(tmp_path, store, _Hides("step_000000002"))
    for r in (0, 1):
        assert isinstance(out[r], CheckpointError), out
        assert "it tried step 1 where rank 0 tried step 2" in str(out[r]), out[r]
        assert "different committed steps" in str(out[r])
    assert time.monotonic() - t0 < 30, "a rank waited for its timeout"


def test_a_group_fallback_decision_is_read_by_rank_0_alone_and_stays_small(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Only rank 0 reads the ranks' verdicts; the others read its decision, which names
    a bounded number of the ranks that found the step damaged."""
    import asyncckpt.dist as dist_mod

    monkeypatch.setattr(dist_mod, "_MAX_BAD_REPORTED", 2)
    world = 4
    store = dist.HashStore()
    logs = {r: _ReadLog(store) for r in range(world)}

    def rank(r: int) -> list[tuple[int, str]]:
        ctx = DistContext(rank=r, world_size=world, store=logs[r], namespace="t",
                          timeout_s=30, directory="/d")
        agree = dist_mod.FallbackAgreement(ctx, "asyncckpt/fallback/test/1")
        return agree(0, 7, f"damaged on rank {r}")

    out = all_ok(in_threads(rank, world=world))
    note = "damaged on rank 1 (and 2 more ranks could not load this step)"
    assert out[0] == [Finding(1, note)]  # (the first two, less itself)
    assert out[3] == [Finding(0, "damaged on rank 0"), Finding(1, note)]
    for r in range(1, world):
        verdicts = [k for k in logs[r].read if k.rsplit("/", 1)[1].isdigit()]
        assert verdicts == [], (r, verdicts)


def test_a_capped_group_decision_keeps_the_damage_before_the_steps_not_found(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With more findings than the decision carries, ranks that only did not find the
    step (every rank of a node whose NFS view lags) crowded out the one that found it
    corrupt: nobody marked the step damaged."""
    import asyncckpt.dist as dist_mod

    monkeypatch.setattr(dist_mod, "_MAX_BAD_REPORTED", 2)
    verdicts = [{"step": 7, "problem": None, "failed": False, "gone": False}] + [
        {"step": 7, "problem": f"not found on rank {r}", "failed": False, "gone": True}
        for r in (1, 2, 3)] + [
        {"step": 7, "problem": "checksum mismatch", "failed": False, "gone": False}]
    decision = dist_mod._decision(verdicts, 7)
    assert [(r, g, m) for r, _, g, m in decision["bad"]] == [(4, False, False),
                                                            (1, True, False)]
    assert decision["bad"][1][1].endswith("(and 2 more ranks could not load this step)")
    # all gone: the summary entry too
    gone = dist_mod._decision(verdicts[:4], 7)["bad"]
    assert [g for _, _, g, _ in gone] == [True, True]
    # an EIO (maybe intact) after the damage, before the steps not found; a summary of
    # such findings alone marks nothing
    verdicts[1] = {"step": 7, "problem": "EIO on rank 1", "failed": False, "gone": False,
                   "maybe_intact": True}
    decision = dist_mod._decision(verdicts, 7)
    assert [(r, g, m) for r, _, g, m in decision["bad"]] == [(4, False, False),
                                                            (1, False, True)]


class _NoWait:
    """A Store that counts calls of ``wait``: a TCPStore client holds its lock for the
    whole of one, so a background wait would stall the training thread's Store calls
    (and each one that runs out logs a warning)."""

    def __init__(self) -> None:
        self._store = dist.HashStore()
        self.waits = 0

    def wait(self, *args: Any) -> None:
        self.waits += 1
        self._store.wait(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def test_waits_poll_the_store_instead_of_blocking_in_it() -> None:
    store = _NoWait()
    ctx = DistContext(rank=0, world_size=2, store=store, namespace="t", timeout_s=30)
    threading.Timer(0.3, lambda: ctx.put(ctx.key("s", "done", 1), {})).start()
    ctx.put(ctx.key("s", "done", 0), {})
    assert len(ctx.gather(("s", "done"), "dones")) == 2
    with pytest.raises(CheckpointTimeoutError):
        ctx.wait_keys({1: ctx.key("s", "never", 1)}, "x", timeout_s=1.5)
    assert store.waits == 0


class _BrokenStore:
    def __getattr__(self, name: str) -> Any:
        def fail(*args: Any) -> Any:
            raise RuntimeError("Connection reset by peer")
        return fail


def test_a_broken_store_in_a_fallback_load_is_a_load_error(tmp_path: Path) -> None:
    with AsyncCheckpointer(tmp_path, mode="sync") as ck:
        ck.save({"w": torch.ones(2)}, step=1)
    ck = AsyncCheckpointer(tmp_path, rank=1, world_size=2, store=_BrokenStore(), timeout_s=5)
    with pytest.raises(CheckpointError, match=r"the Store failed while counting this fallback "
                                              r"load.*Connection reset") as info:
        ck.load(fallback=True)
    assert not isinstance(info.value, CheckpointSaveError)
    ctx = DistContext(rank=1, world_size=2, store=_BrokenStore(), namespace="t", timeout_s=5)
    with pytest.raises(CheckpointError, match=r"posting its verdict") as info:
        FallbackAgreement(ctx, "p")(0, 1, None)  # (the agreement itself, past the count)
    assert not isinstance(info.value, CheckpointSaveError)


@pytest.mark.parametrize("world,stuck,overlap", [(2, 1, True), (2, 1, False), (2, 0, True),
                                                 (3, 2, True)])
def test_a_rank_whose_staging_hangs_is_named_after_timeout_s(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, world: int, stuck: int,
        overlap: bool) -> None:
    """One rank's copy into host memory never ends (a CUDA side stream behind a hung
    collective): its writer, waiting for staging, still beats, but makes no progress.
    The others must time out within a few timeout_s (a peer that waits for a stuck
    coordinator's verdict: within its longer wait) and name it, saying it is staging;
    a rank that waits on a stuck rank (the coordinator, with 3 ranks) is no stuck rank
    itself, and must not hold the others' waits open."""
    from asyncckpt import checkpointer

    monkeypatch.setattr(asyncckpt.writer, "_VERDICT_GRACE_S", 0.0)
    timeout_s = 1.0
    store = dist.HashStore()
    release = threading.Event()
    stuck_ptr: list[int] = []
    real_stage = checkpointer.stage

    def stage(plan: Any, tensors: Any, *a: Any, **kw: Any) -> None:
        if any(t.data_ptr() in stuck_ptr for t in tensors.values()):
            release.wait(30)
        real_stage(plan, tensors, *a, **kw)

    monkeypatch.setattr(checkpointer, "stage", stage)

    def rank(r: int) -> tuple[BaseException | None, float]:
        mine = torch.full((4096,), float(r))
        if r == stuck:
            stuck_ptr.append(mine.data_ptr())
        shards = {"mine": ShardMetadata((world * 4096,), (r * 4096,))}
        t0 = time.monotonic()
        try:
            with AsyncCheckpointer(tmp_path, rank=r, world_size=world, store=store,
                                   timeout_s=timeout_s) as ck:
                try:
                    ck.save_async({"mine": mine}, step=1, overlap=overlap,
                                  shards=shards).wait(10)
                except CheckpointError as exc:
                    return exc, time.monotonic() - t0
                return None, time.monotonic() - t0
        finally:
            if r != stuck and r == max(set(range(world)) - {stuck}):
                release.set()  # the last healthy rank is done: let the stuck one finish

    out = in_threads(rank, world=world)
    # a peer waits timeout_s of no progress for the verdict (no grace here), after its own waits
    limit = (3 if stuck else 5) * timeout_s + 2.0
    for r in range(world):
        if r == stuck:
            continue
        err, elapsed = out[r]
        assert isinstance(err, CheckpointError), (r, err)
        assert f"rank(s) [{stuck}]" in str(err) or f"rank {stuck} failed" in str(err), (r, err)
        assert "staging" in str(err), (r, err)
        assert elapsed < limit, (r, elapsed, err)
    assert isinstance(out[stuck][0], CheckpointError), out[stuck]
    assert AsyncCheckpointer(tmp_path).steps() == []


def test_a_rank_whose_staging_is_slow_but_moving_is_waited_for(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1's copy into host memory takes 2.5 * timeout_s, moving all along: it is
    slower, not stuck, and the save commits (with a timeout_s of a second, too short
    a wait used to give up on any rank it had not heard from)."""
    from asyncckpt import checkpointer

    store = dist.HashStore()
    slow_ptr: list[int] = []
    real_stage = checkpointer.stage

    def stage(plan: Any, tensors: Any, arena: Any, progress: Any, **kw: Any) -> None:
        if any(t.data_ptr() in slow_ptr for t in tensors.values()):
            for i in range(25):  # (never past the data: the writer waits for all of it)
                progress.publish(plan.body_offset + i)
                time.sleep(0.1)
        real_stage(plan, tensors, arena, progress, **kw)

    monkeypatch.setattr(checkpointer, "stage", stage)

    def rank(r: int) -> list[int]:
        mine = torch.full((4096,), float(r))
        if r == 1:
            slow_ptr.append(mine.data_ptr())
        with AsyncCheckpointer(tmp_path, rank=r, world_size=2, store=store,
                               timeout_s=1.0) as ck:
            ck.save_async({"mine": mine}, step=1,
                          shards={"mine": ShardMetadata((2 * 4096,), (r * 4096,))}).wait(20)
            return ck.steps()

    assert in_threads(rank) == {0: [1], 1: [1]}


def test_values_are_decoded_with_the_collector_paused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The coordinator decodes every rank's record in a burst (a list per tensor): with
    the collector on, that set off full collections of a process holding its state."""
    import gc

    ctx = _ctx()
    ctx.put(ctx.key("s1", "record", 1), {"rank": 1, "sums": [["0" * 16]] * 10})
    ctx.put(ctx.key("s1", "record", 2), {"rank": 2, "big": "x" * (9 << 20)})  # (in parts)
    seen: list[bool] = []
    real = json.loads

    def loads(raw: Any) -> Any:
        seen.append(gc.isenabled())
        return real(raw)

    monkeypatch.setattr(json, "loads", loads)  # (the json module that dist uses too)
    assert gc.isenabled()
    assert ctx.get(ctx.key("s1", "record", 1), "a record")["sums"][0] == ["0" * 16]
    assert len(ctx.get(ctx.key("s1", "record", 2), "a record")["big"]) == 9 << 20
    assert len(seen) == 3 and not any(seen) and gc.isenabled()


def test_dtensor_api_comes_from_the_private_module_where_torch_2_4_keeps_it(monkeypatch):
    """torch 2.4 has DTensor in torch.distributed._tensor (torch.distributed.tensor holds
    only its parallel styles there): every DTensor save failed on an ImportError."""
    import importlib
    import types

    import asyncckpt.dist as adist

    real = importlib.import_module

    def as_in_torch_2_4(name, package=None):
        if name == "torch.distributed.tensor":
            return types.ModuleType(name)  # no Shard, Replicate, DTensor...
        return real(name, package)

    adist.dtensor_module.cache_clear()
    monkeypatch.setattr(importlib, "import_module", as_in_torch_2_4)
    try:
        assert adist.dtensor_module() is real("torch.distributed._tensor")
        assert adist.dtensor_module("_utils") is real("torch.distributed._tensor._utils")
    finally:
        adist.dtensor_module.cache_clear()
    monkeypatch.undo()
    public = real("torch.distributed.tensor")  # (the public module first, where it has it)
    assert adist.dtensor_module() is (public if hasattr(public, "Shard")
                                      else real("torch.distributed._tensor"))
    adist.dtensor_module.cache_clear()


class _PaddedWrites(LocalStorage):
    """Writes the buffer whole, its padding too (a storage author's mistake)."""

    def write_arena(self, path: Path, buf: memoryview, nbytes: int, ready: Any,
                    direct: bool = True) -> None:
        ready(nbytes)
        with open(path, "wb") as f:
            f.write(buf)


def test_a_rank_whose_storage_wrote_its_padding_is_named_not_an_unshared_directory(
        tmp_path: Path) -> None:
    """(A rank's shard file longer than written was told as a directory the ranks do not
    share; the storage wrote more than it was given.)"""
    store = dist.HashStore()

    def rank(r: int) -> str:
        with AsyncCheckpointer(tmp_path, mode="sync", rank=r, world_size=2, store=store,
                               timeout_s=20, storage=_PaddedWrites() if r == 1 else None) as ck:
            with pytest.raises(asyncckpt.CheckpointError) as info:
                ck.save({"w": torch.full((4,), float(r))}, step=1,
                        shards={"w": ShardMetadata((8,), (4 * r,))})
            return str(info.value)

    said = all_ok(in_threads(rank))
    assert "rank 1's shard file" in said[0] and "the write_arena of rank 1's storage wrote " \
        "more than it was given" in said[0], said
    assert "must be on a filesystem every rank shares" not in said[0], said
    assert not list(tmp_path.glob("step_*"))


def test_a_shard_loaded_without_its_shards_is_told_of_shards(tmp_path: Path) -> None:
    """(a distributed trial) A rank's part of a tensor saved in chunks, loaded without
    shards=, was told only to exclude it: its weights would have stayed unloaded."""
    store = dist.HashStore()

    def rank(r: int) -> None:
        with _synced(tmp_path, store, r, timeout_s=30) as ck:
            ck.save({"w": torch.full((5, 6), float(r))}, step=1,
                    shards={"w": ShardMetadata((10, 6), (5 * r, 0))})

    all_ok(in_threads(rank))
    with pytest.raises(asyncckpt.StateMismatchError) as info:
        asyncckpt.load(tmp_path, {"w": torch.zeros(5, 6)})
    assert ("if this process holds a part of that tensor, sharded by hand, say which: "
            "shards={'w': asyncckpt.ShardMetadata(global_shape=(10, 6), offsets=<where its "
            "part starts>)} (DTensors need none)") in str(info.value)
    target = {"w": torch.zeros(5, 6)}
    asyncckpt.load(tmp_path, target, shards={"w": ShardMetadata((10, 6), (5, 0))})
    assert torch.equal(target["w"], torch.ones(5, 6))
    asyncckpt.save({"v": torch.ones(10, 6)}, tmp_path / "one", step=1)  # (one chunk: a
    with pytest.raises(asyncckpt.StateMismatchError) as info:  # smaller head, not a shard)
        asyncckpt.load(tmp_path / "one", {"v": torch.zeros(5, 6)})
    assert "shards=" not in str(info.value)


def test_a_coordinator_that_skipped_a_save_and_the_others_are_told_at_its_next(
        tmp_path: Path) -> None:
    """(a distributed trial) Rank 0 skipped the save of step 1: every later save cost the
    others timeout_s ("may have died or not called save_async") and rank 0 a SaveError
    blaming them; no rank was told that rank 0 was out of step, and the group never saved
    again. Now every rank raises CheckpointConfigError at the next save, and the
    documented recovery works."""
    store = dist.HashStore()
    gave_up = threading.Barrier(3)
    closed = threading.Barrier(3)

    def rank(r: int) -> Any:
        ck = _synced(tmp_path, store, r, world=3, timeout_s=1)
        ck.save(_state(r), step=0)
        if r != 0:
            with pytest.raises(CheckpointTimeoutError):
                ck.save(_state(r), step=1)
        gave_up.wait(30)
        ck._ctx.timeout_s = 30.0  # (told at once, not after timeout_s)
        with pytest.raises(CheckpointConfigError) as info:
            ck.save(_state(r), step=2)
        ck.close()
        closed.wait(30)
        with _synced(tmp_path, store, r, world=3, timeout_s=30) as again:
            return str(info.value), again.save(_state(r), step=3).step

    out = in_threads(rank, world=3)
    assert [out[r][1] for r in range(3)] == [3, 3, 3], out
    assert out[0][0].startswith("rank 0: this save of step 2 met the group's save of step "
                                "1, which the other ranks gave up waiting for this rank in")
    for r in (1, 2):
        assert (f"rank {r}: rank 0 skipped the group's save of step 1") in out[r][0], out[r]
    assert AsyncCheckpointer(tmp_path).steps() == [0, 3]


def test_a_late_coordinator_is_not_told_it_skipped_a_save_another_rank_skipped(
        tmp_path: Path) -> None:
    # (the review) Rank 1 skipped step 1 and went on; rank 0 came to step 1 after rank 1
    # had given up on step 2 waiting for it: rank 0 was told *it* skipped step 2.
    store = dist.HashStore()

    def rank(r: int) -> Any:
        out = []
        with _synced(tmp_path, store, r, timeout_s=1) as ck:
            ck.save(_state(r), step=0)
            for s in ([1, 2, 3] if r == 0 else [2, 3]):
                if r == 0 and s == 1:
                    time.sleep(3)
                try:
                    ck.save(_state(r), step=s)
                    out.append("ok")
                except asyncckpt.CheckpointError as exc:
                    out.append(str(exc))
        return out

    out = in_threads(rank)
    assert not any("this rank skipped that save" in m for m in out[0]), out[0]


def test_a_store_whose_host_is_lost_is_asked_no_more() -> None:
    """A distributed trial: once rank 0 (the Store's host) died, every later call of the
    survivors failed on its own, each printing torch's C++ stack trace of ~25 lines (5-6
    a rank), which buried asyncckpt's message."""
    from asyncckpt.dist import LosableStore

    calls: list[str] = []

    class Dying:
        def get(self, key: str) -> bytes:
            calls.append(key)
            raise torch.distributed.DistNetworkError("Connection reset by peer\nframe #0: ...")

        def set(self, key: str, value: str) -> None:
            calls.append(key)

    store = LosableStore(Dying())
    store.set("a", "1")  # (fine until it is lost)
    with pytest.raises(torch.distributed.DistNetworkError):
        store.get("b")
    with pytest.raises(torch.distributed.DistNetworkError, match=r"^Connection reset by peer$"):
        store.set("c", "1")
    assert calls == ["a", "b"]  # (not asked again: "c" raised at once)
    # an error of another kind (a key not there yet, a timeout) is no loss
    other = LosableStore(dist.HashStore())
    other.set("k", "v")
    assert other.get("k") == b"v" and other.lost is None


def test_a_gap_between_hand_declared_shards_names_the_ranks_boxes() -> None:
    """A distributed trial's last rank declared a shard a row short: the error named the
    missing rows, not whose box stopped short of them (a DTensor's error names ranks)."""
    from asyncckpt.dist import _check_coverage
    from asyncckpt.manifest import Chunk, FileEntry

    files = {f"rank_{r:05d}.safetensors": FileEntry(f"rank_{r:05d}.safetensors", 0, r, 0, "")
             for r in range(3)}
    chunks = [Chunk(f"rank_{r:05d}.safetensors", "w", (o, 0), (n, 4), (0, 0), ())
              for r, (o, n) in enumerate([(0, 4), (4, 3), (7, 2)])]
    with pytest.raises(CheckpointSaveError) as info:
        _check_coverage("w", (10, 4), chunks, files=files, ranks=[0, 1, 2])
    said = str(info.value)
    assert "no chunk holds indices 9..9 along dimension 0" in said, said
    assert ("the ranks' boxes: rank 0 at offsets [0, 0], lengths [4, 4]; rank 1 at offsets "
            "[4, 0], lengths [3, 4]; rank 2 at offsets [7, 0], lengths [2, 4]") in said, said


def test_rank_0_timed_out_on_a_rank_that_never_came_says_nothing_was_committed(
        tmp_path: Path) -> None:
    """A QA re-check: a rank dead before a save left rank 0 timed out on "the save plans"
    with nothing of the step not being committed nor what to do (the others' errors and
    rank 0's at the shard files say it)."""
    store = dist.HashStore()
    with _synced(tmp_path, store, 0, timeout_s=1.0) as ck, pytest.raises(
            asyncckpt.CheckpointTimeoutError) as info:
        ck.save({"w": torch.ones(2)}, step=1)
    said = str(info.value)
    assert "rank(s) [1]" in said and said.endswith(
        "step 1 was not started, nothing committed (the steps committed before it are "
        "intact): restart the group without the silent rank(s), or wait for them"), said
    assert info.value.ranks == (1,)


def test_a_long_wait_looks_for_refusals_every_few_slices(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A CI run: rank 0's wait for the save plans looked for a refusal the other rank had
    posted only at slices 1, 2, 4, 8, 16, 32 (seconds): it read it after 32 s, and the
    test's rank hung. The looks go on every 4th slice once past the 8th."""
    import asyncckpt.dist as dist_mod

    monkeypatch.setattr(dist_mod, "_SLICE_S", 0.02)
    ctx = _ctx(timeout_s=3.0)  # (150 slices; 7 looks take 20)
    looked: list[float] = []
    with pytest.raises(asyncckpt.CheckpointTimeoutError):
        ctx.wait_keys({1: ctx.key("s1", "never", 1)}, "a key never posted",
                      look=lambda ranks: looked.append(time.monotonic()))
    # (doubling looks at most 6 times in fewer than 64 slices: 1, 2, 4, 8, 16, 32)
    assert len(looked) >= 7, looked
