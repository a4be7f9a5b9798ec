"""The background writer: what a rank of a group leaves behind when its save fails
(writer._abort), and the collector paused over the hash thread's bursts."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import xxhash

import asyncckpt
from asyncckpt.dist import DistContext
from asyncckpt.plan import plan_writes
from asyncckpt.staging import StagingProgress
from asyncckpt.storage import LocalStorage
from asyncckpt.tree import flatten
from asyncckpt.writer import SaveJob, _abort


def _peer_job(root: Path, store: Any, *, announced: bool, rejected: bool) -> SaveJob:
    flat = flatten({"w": torch.ones(4)})
    plan = plan_writes(flat.tensors, "rank_00001.safetensors")
    ctx = DistContext(rank=1, world_size=2, store=store, namespace="t", timeout_s=5)
    job = SaveJob(root=root, step=3, plan=plan, arena=None,  # type: ignore[arg-type]
                  progress=StagingProgress(), flat=flat, ctx=ctx, token="abc",
                  storage=LocalStorage(), keep_last=None, block_bytes=1 << 22,
                  library_version="test", user_metadata={}, direct_io=False,
                  started=time.perf_counter(), tag="s3.1", announced=announced,
                  rejected=rejected)
    job.tmp = job.tmp_path
    job.tmp.mkdir(parents=True)
    (job.tmp / plan.file).write_bytes(b"shard")
    return job


@pytest.mark.parametrize(("announced", "rejected", "verdict", "kept", "dir_kept"), [
    # durable, announced, no verdict heard: the coordinator may commit
    (True, False, False, True, True),
    # the coordinator's verdict said no: take the file out, and the directory
    (True, True, False, False, False),
    # failed before its file was durable: the file goes; the directory is the
    # coordinator's to remove (it may be about to create its own file in it)...
    (False, False, False, False, True),
    # ...unless the coordinator has aborted already (this rank re-created it, late)
    (False, False, True, False, False),
])
def test_peer_abort_keeps_an_announced_file_until_a_verdict(
        tmp_path: Path, announced: bool, rejected: bool, verdict: bool, kept: bool,
        dir_kept: bool) -> None:
    store = dist.HashStore()
    job = _peer_job(tmp_path, store, announced=announced, rejected=rejected)
    if verdict:
        store.set(job.ctx.key("s3.1", "verdict"), json.dumps({"error": "rank 0 gave up"}))
    shard = job.tmp_path / job.plan.file
    _abort(job, TimeoutError("no verdict"))
    assert shard.exists() == kept
    assert job.tmp_path.exists() == dir_kept
    if not announced:  # the failure is posted where the coordinator waits for it
        for part in ("record", "done"):
            got = json.loads(store.get(job.ctx.key("s3.1", part, 1)))
            assert "no verdict" in got["error"], (part, got)


def test_the_checksums_and_the_manifest_of_a_save_are_made_with_the_collector_paused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hash thread makes a list per tensor, then the record and the manifest: with the
    collector on, the allocations set off full collections of a process that holds the
    whole state tree (0.8 s of a 100,000-tensor save)."""
    import gc

    from asyncckpt import writer

    seen: list[bool] = []
    real_hash, real_manifest = xxhash.xxh3_64_hexdigest, writer._manifest_bytes

    def hashing(data: Any) -> str:
        seen.append(gc.isenabled())
        return real_hash(data)

    def manifest(job: Any, records: Any) -> bytes:
        seen.append(gc.isenabled())
        return real_manifest(job, records)

    monkeypatch.setattr(xxhash, "xxh3_64_hexdigest", hashing)
    monkeypatch.setattr(writer, "_manifest_bytes", manifest)
    assert gc.isenabled()
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async") as ck:
        ck.save_async({f"t{i}": torch.full((3,), float(i)) for i in range(50)}, step=1).wait()
    assert len(seen) >= 51 and not any(seen)  # every tensor's checksum, and the manifest
    assert gc.isenabled()


def test_a_future_raises_a_copy_of_every_library_error_with_its_fields() -> None:
    """A future raises a copy of the failure it keeps (see writer._detached): one that
    could not be copied was raised itself, gathering its callers' frames."""
    import inspect

    from asyncckpt import commit, errors
    from asyncckpt.writer import _detached

    kinds: list[BaseException] = [
        c("msg") for c in vars(errors).values()
        if inspect.isclass(c) and issubclass(c, errors.CheckpointError)]
    kinds.append(commit.CommittedNotDurableError("msg", Path("/ck/step_000000001")))
    for exc in kinds:
        exc.add_note("a note")
        cause = ValueError("why")
        exc.__cause__ = cause
        twin = _detached(exc)
        assert twin is not exc and type(twin) is type(exc), type(exc).__name__
        assert str(twin) == str(exc) and twin.__cause__ is cause
        assert twin.__notes__ == ["a note"] and vars(twin) == vars(exc)
        twin.add_note("the caller's")  # the copy's notes are its own
        assert exc.__notes__ == ["a note"]


class _Quota(LocalStorage):
    """A disk of ``quota`` bytes (what the root's files take counts) whose removals are
    slow, as a large step's are: the shard write fails with ENOSPC past the quota."""

    def __init__(self, root: Path, quota: int) -> None:
        self.root, self.quota = root, quota

    def used(self) -> int:
        return sum(p.stat().st_size for p in self.root.rglob("*") if p.is_file())

    def write_arena(self, path: Path, buf: memoryview, nbytes: int, ready: Any,
                    direct_io: bool) -> None:
        if self.used() + nbytes > self.quota:
            import errno
            import os
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        super().write_arena(path, buf, nbytes, ready, direct_io)

    def write_bytes(self, path: Path, data: bytes) -> None:  # (the manifest: it counts too)
        if path.name == "manifest.json" and self.used() + len(data) > self.quota:
            import errno
            import os
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        super().write_bytes(path, data)

    def remove_tree(self, path: Path) -> None:
        time.sleep(0.3)
        super().remove_tree(path)


def test_back_to_back_saves_wait_for_the_old_steps_removal_when_the_disk_lacks_room(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk with room for keep_last + 1 steps filled up when async saves came back to
    back: the next save wrote while the last one's retention still removed the oldest."""
    import os
    from types import SimpleNamespace

    import asyncckpt.writer as writer_module

    step_bytes = 512 * 1024 * 4
    storage = _Quota(tmp_path, quota=3 * step_bytes + (1 << 20))

    def statvfs(path: Any) -> Any:
        return SimpleNamespace(f_bavail=max(0, storage.quota - storage.used()), f_frsize=1)

    monkeypatch.setattr(writer_module.os, "statvfs", statvfs)
    assert os.statvfs is statvfs  # (the module's os is os: undone by monkeypatch)
    ckpt = asyncckpt.AsyncCheckpointer(tmp_path, mode="async", keep_last=2, storage=storage)
    try:
        for s in range(1, 7):
            ckpt.save_async({"w": torch.full((512 * 1024,), float(s))}, step=s).wait()
    finally:
        ckpt.close()
    assert ckpt.steps() == [5, 6]
    assert ckpt.load(step=6)["w"][0].item() == 6.0


def test_a_lower_keep_last_makes_room_on_a_full_disk_before_the_save_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A trial filled a disk with keep_last=3, then restarted with keep_last=1, as the
    ENOSPC error advises: every save still failed, for retention runs after a commit."""
    import logging
    from types import SimpleNamespace

    import asyncckpt.writer as writer_module

    step_bytes = 512 * 1024 * 4
    storage = _Quota(tmp_path, quota=3 * step_bytes + (1 << 20))
    monkeypatch.setattr(writer_module.os, "statvfs", lambda path: SimpleNamespace(
        f_bavail=max(0, storage.quota - storage.used()), f_frsize=1))
    with asyncckpt.AsyncCheckpointer(tmp_path, keep_last=3, storage=storage) as ckpt:
        for s in (1, 2, 3):
            ckpt.save({"w": torch.full((512 * 1024,), float(s))}, step=s)
        with pytest.raises(asyncckpt.CheckpointSaveError, match="the disk is full"):
            ckpt.save({"w": torch.full((512 * 1024,), 4.0)}, step=4)  # (keeps 3: no room)
        assert ckpt.steps() == [1, 2, 3]
    with caplog.at_level(logging.INFO, logger="asyncckpt"), asyncckpt.AsyncCheckpointer(
            tmp_path, keep_last=1, mode="async", storage=storage) as ckpt:
        ckpt.save_async({"w": torch.full((512 * 1024,), 4.0)}, step=4)
        ckpt.wait()  # (and its retention: the future resolves at the commit, before it)
        assert ckpt.steps() == [4]
    assert "removing now the steps keep_last=1 lets go of" in caplog.text
    assert asyncckpt.load(tmp_path)["w"][0].item() == 4.0


class _CountedListings(LocalStorage):
    """Counts the listings and reads of step directories' insides."""

    def __init__(self) -> None:
        self.looks = 0

    def listdir(self, path: Path) -> list[str]:
        if path.name.startswith("step_"):
            self.looks += 1
        return super().listdir(path)


def test_retention_does_not_look_into_every_milestone_at_every_save(tmp_path: Path) -> None:
    """A soak trial with keep_every: each save's retention opened and listed every kept
    milestone twice (its manifest, its damaged.json), ~20 µs each, growing for ever."""
    storage = _CountedListings()
    looks = []
    with asyncckpt.AsyncCheckpointer(tmp_path, keep_last=2, keep_every=2,
                                     storage=storage) as ckpt:
        for s in range(1, 41):
            before = storage.looks
            ckpt.save({"w": torch.full((4,), float(s))}, step=s)
            looks.append(storage.looks - before)
        assert ckpt.steps() == [*range(2, 39, 2), 39, 40]
    assert max(looks[-10:]) <= max(looks[5:15]) and max(looks[-10:]) < 10, looks


def test_the_manifest_waits_for_the_room_the_shard_waits_for(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second trial's disk had room for keep_last + 1 steps, manifests included: the
    shard waited for the last retention's removals, but the manifest, which the hash
    thread writes meanwhile, did not (29 of 100 saves failed)."""

    import asyncckpt.writer as writer_module

    asyncckpt.save({"w": torch.zeros(512 * 1024)}, tmp_path / "probe", step=1)
    probe = tmp_path / "probe" / "step_000000001"
    shard, manifest = (sum(p.stat().st_size for p in probe.glob("*.safetensors")),
                       (probe / "manifest.json").stat().st_size)
    root = tmp_path / "ck"
    storage = _Quota(root, quota=3 * (shard + manifest) + 64)  # keep_last + 1 steps (+ lock)
    def free_if_short(job: object) -> int | None:  # (the exact need)
        free = storage.quota - storage.used()
        return free if free < shard + manifest else None

    monkeypatch.setattr(writer_module, "_free_if_short", free_if_short)
    with asyncckpt.AsyncCheckpointer(root, mode="async", keep_last=2,
                                     storage=storage) as ckpt:
        for s in range(1, 7):
            ckpt.save_async({"w": torch.full((512 * 1024,), float(s))}, step=s).wait()
        ckpt.wait()
        assert ckpt.steps() == [5, 6]


def test_a_rank_other_than_0_waits_briefly_for_the_room_rank_0_s_retention_makes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """(review) In a group on a shared filesystem only rank 0 waited for room: rank 1's
    shard met the full disk while rank 0's removals ran. The others watch the room free,
    for ROOM_WAIT_GROUP_S at most; the manifest's margin grows with the tensors listed."""
    from types import SimpleNamespace

    import asyncckpt.writer as writer_module

    for s in (1, 2, 3):  # (a restart with keep_last=2: rank 0 removes step 1 first)
        asyncckpt.save({"w": torch.ones(2)}, tmp_path, step=s)
    free = [0]
    monkeypatch.setattr(writer_module, "_free_bytes", lambda root: free[0])
    plan = SimpleNamespace(file_bytes=10 << 20, header=b" " * (1 << 20))
    need = (10 << 20) + (64 << 10)  # (the manifest is rank 0's: no margin for it here)
    aborted: list[str | None] = [None]
    job = SimpleNamespace(ctx=SimpleNamespace(distributed=True, is_coordinator=False, rank=1,
                                              timeout_s=60.0),
                          keep_last=2, removals=None, root=tmp_path, plan=plan, step=7,
                          keep_every=None, keep_best=None, damaged=set(),
                          storage=LocalStorage(), progress=SimpleNamespace(failed=False),
                          pulse=SimpleNamespace(stopped=lambda: aborted[0] is not None,
                                                every_s=0.05))
    free[0] = need - 1
    assert writer_module._free_if_short(job) == need - 1  # type: ignore[arg-type]
    threading.Timer(0.3, lambda: free.__setitem__(0, need)).start()
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, logger="asyncckpt"):
        writer_module._room_for(job, None)  # type: ignore[arg-type]
    assert 0.25 < time.monotonic() - t0 < 5.0  # (returned once rank 0 made room)
    # the figures, margin said: "lacks room" alone read as wrong beside free > file size
    assert "the disk lacks room for this step (10.55129 MB free; it takes 10.55130 MB: " \
        "this rank's shard file, with a margin): waiting up to 10 s" in caplog.text
    # rank 0's (coordinator's) need counts the manifest, with a margin that grows with
    # the tensors listed
    job.ctx.is_coordinator = True
    assert writer_module._room_needed(job) == (10 << 20) + (1 << 20) + 4 * (1 << 20)
    job.ctx.is_coordinator = False
    # a disk that stays full: back after the limit, to fail the write with ENOSPC
    free[0] = 0
    monkeypatch.setattr(writer_module, "ROOM_WAIT_GROUP_S", 0.3)
    t0 = time.monotonic()
    writer_module._room_for(job, None)  # type: ignore[arg-type]
    assert 0.25 < time.monotonic() - t0 < 5.0
    # (a DCP trial) another rank gave the save up (its write met the full disk): back at
    # once, to fail with the reason it posted, not after ROOM_WAIT_GROUP_S
    monkeypatch.setattr(writer_module, "ROOM_WAIT_GROUP_S", 10.0)
    threading.Timer(0.2, lambda: aborted.__setitem__(0, "rank 0 failed: ENOSPC")).start()
    t0 = time.monotonic()
    writer_module._room_for(job, None)  # type: ignore[arg-type]
    assert 0.15 < time.monotonic() - t0 < 5.0
    # a timeout_s of 10 s or less: half of it at most (a trial's rank waited its 10 s,
    # and the others blamed it: "gave no sign of life")
    aborted[0] = None
    job.ctx.timeout_s = 0.6
    t0 = time.monotonic()
    writer_module._room_for(job, None)  # type: ignore[arg-type]
    assert 0.25 < time.monotonic() - t0 < 0.5
    job.ctx.timeout_s = 60.0
    # no more steps than keep_last keeps: rank 0 removes none before this save commits
    # (a trial's keep_last=1 group: every rank but 0 waited 10 s at every save)
    job.keep_last = 3
    t0 = time.monotonic()
    writer_module._room_for(job, None)  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 0.2
    # ... but where the last save's removals are still running (hidden steps that still
    # fill the disk: a QA re-check's rank 1 met ENOSPC beside rank 0's slow removals)
    hidden = tmp_path / ".step_000000000.deleting-0123456789ab"
    hidden.mkdir()
    monkeypatch.setattr(writer_module, "ROOM_WAIT_GROUP_S", 0.3)
    t0 = time.monotonic()
    writer_module._room_for(job, None)  # type: ignore[arg-type]
    assert 0.25 < time.monotonic() - t0 < 5.0
    # ... and only while room frees: one left behind for good (a removal that failed)
    # holds no save for the whole limit (review)
    monkeypatch.setattr(writer_module, "ROOM_WAIT_GROUP_S", 10.0)
    monkeypatch.setattr(writer_module, "ROOM_STALL_S", 0.3)
    t0 = time.monotonic()
    writer_module._room_for(job, None)  # type: ignore[arg-type]
    assert 0.25 < time.monotonic() - t0 < 3.0
    monkeypatch.setattr(writer_module, "ROOM_WAIT_GROUP_S", 0.3)
    hidden.rmdir()
    # ... nor where keep_every keeps the one beyond keep_last (the review: counting the
    # steps alone, every save of such a group still waited)
    job.keep_last, job.keep_every = 2, 1
    t0 = time.monotonic()
    writer_module._room_for(job, None)  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 0.2
    job.keep_every = None
    # without keep_last nothing will free room: no wait at all
    job.keep_last = None
    t0 = time.monotonic()
    writer_module._room_for(job, None)  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 0.2


def test_a_step_whose_manifest_went_is_left_alone_though_this_checkpointer_saved_it(
        tmp_path: Path) -> None:
    """(a second disk trial) retention trusted every step it had found committed, and
    deleted one whose manifest was removed by hand since; a directory without one is left
    as it is (api.md)."""
    with asyncckpt.AsyncCheckpointer(tmp_path, keep_last=2, keep_every=10) as ckpt:
        for s in range(0, 6):
            ckpt.save({"w": torch.full((4,), float(s))}, step=s)
        (tmp_path / "step_000000005" / "manifest.json").unlink()
        for s in (6, 7):
            ckpt.save({"w": torch.full((4,), float(s))}, step=s)
        assert ckpt.steps() == [0, 6, 7]
    assert (tmp_path / "step_000000005").is_dir()


def test_a_full_disk_s_error_says_the_room_free_and_the_room_needed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """(a disk trial could not tell its own steps from another's file filling the disk)"""
    from types import SimpleNamespace

    import asyncckpt.writer as writer_module

    storage = _Quota(tmp_path, quota=1 << 20)
    monkeypatch.setattr(writer_module.os, "statvfs", lambda path: SimpleNamespace(
        f_bavail=1_500_000, f_frsize=1))
    with asyncckpt.AsyncCheckpointer(tmp_path, storage=storage) as ckpt, pytest.raises(
            asyncckpt.CheckpointSaveError, match=r"No space left on device.* \(1\.5 MB free "
                                                  r"now; this step's file takes 4\.2 MB\)"):
        ckpt.save({"w": torch.zeros(1 << 20)}, step=1)


def test_a_rank_whose_store_fails_after_the_commit_is_told_the_step_is_there(
        tmp_path: Path) -> None:
    """(distributed trial) Rank 0, which hosted the Store, died right after renaming step 2
    into place: rank 1 was told its save failed ("is the process that hosts the Store
    alive?"), while step 2 loads. It is told the step is committed."""
    from types import SimpleNamespace

    import asyncckpt.writer as writer_module
    from asyncckpt.storage import LocalStorage

    asyncckpt.save({"w": torch.ones(2)}, tmp_path, step=2)

    def get(key: str, what: str, **kw: Any) -> Any:
        raise asyncckpt.CheckpointSaveError("rank 1: coordination through the Store failed "
                                            "while waiting for the commit of step 2")

    ctx = SimpleNamespace(rank=1, timeout_s=5.0, key=lambda *a: "/".join(map(str, a)), get=get)
    job = SimpleNamespace(ctx=ctx, tag="n2", step=2, root=tmp_path, storage=LocalStorage(),
                          pulse=None)
    with pytest.raises(asyncckpt.CheckpointSaveError,
                       match=r"holds step 2 committed \(its manifest is there\)"):
        writer_module._await_verdict(job)  # type: ignore[arg-type]
    job.step = 3  # (not there: the Store's error as it was)
    with pytest.raises(asyncckpt.CheckpointSaveError, match="coordination through the Store"):
        writer_module._await_verdict(job)  # type: ignore[arg-type]


def test_removals_falling_behind_the_saves_are_warned_of(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """(preemption trial) Deletions slower than saves queued up without a word: 29 old
    steps waited for removal after 40 saves, and then a wait() took 28 s."""
    import logging

    import asyncckpt.writer as writer_module
    from asyncckpt.storage import LocalStorage

    class SlowRemoval(LocalStorage):
        gate = threading.Event()

        def remove_tree(self, path: Path) -> None:
            self.gate.wait(30)
            super().remove_tree(path)

    storage = SlowRemoval()
    with caplog.at_level(logging.WARNING, logger="asyncckpt"), asyncckpt.AsyncCheckpointer(
            tmp_path, mode="async", keep_last=1, storage=storage) as ckpt:
        for s in range(1, 7):
            ckpt.save_async({"w": torch.full((4,), float(s))}, step=s).wait()
        told = [r.getMessage() for r in caplog.records if "still being removed" in r.getMessage()]
        assert told and f"old steps under {tmp_path}" in told[0], caplog.text
        assert len(told) == 1  # (again only once it doubles)
        storage.gate.set()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".step")) == []
    assert writer_module.BACKLOG_WARN == 3


def test_a_full_disk_s_figures_differ_where_they_do(monkeypatch: pytest.MonkeyPatch) -> None:
    """(second operations trial) "4.2 MB free now; this step's file takes 4.2 MB", and the
    advice of a lower keep_last at keep_last=1."""
    import errno
    from types import SimpleNamespace

    import asyncckpt.writer as writer_module

    monkeypatch.setattr(writer_module, "_free_bytes", lambda root: 4_190_000)
    full = OSError(errno.ENOSPC, "No space left on device")
    job = SimpleNamespace(root=Path("/x"), plan=SimpleNamespace(file_bytes=4_200_000),
                          keep_last=3)
    said = writer_module._room_said(job, full)  # type: ignore[arg-type]
    assert said == " (4.19 MB free now; this step's file takes 4.20 MB)", said
    job.keep_last = 1
    said = writer_module._room_said(job, full)  # type: ignore[arg-type]
    assert "keep_last=1 keeps one step besides the one being saved" in said, said


def test_a_full_disk_s_advice_fits_the_checkpointer_s_keep_last(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """(a crash trial) keep_last=1, and a checkpointer without keep_last, were told to keep
    fewer steps with a lower keep_last=; a full inode table read "8.4 MB free now; this
    step's file takes 0.0 MB"."""
    import errno
    from types import SimpleNamespace

    import asyncckpt.writer as writer_module

    assert writer_module._free_inodes(Path("/nonexistent/x")) is None
    full = OSError(errno.ENOSPC, "No space left on device")
    assert "a lower keep_last=" in writer_module.os_error_hint(full, 3)
    assert "a lower keep_last=" in writer_module.os_error_hint(full)  # (not known)
    none = writer_module.os_error_hint(full, None)
    assert "keep_last= (this checkpointer keeps every step)" in none
    one = writer_module.os_error_hint(full, 1)
    assert "lower" not in one and "free space (keep_last=1 keeps no fewer)" in one
    monkeypatch.setattr(writer_module, "_free_bytes", lambda root: 8_400_000)
    job = SimpleNamespace(root=Path("/x"), plan=SimpleNamespace(file_bytes=4_000),
                          keep_last=3)
    monkeypatch.setattr(writer_module, "_free_inodes", lambda root: 0)
    said = writer_module._room_said(job, full)  # type: ignore[arg-type]
    assert said.endswith("; but 0 free inodes: the filesystem is out of files, not bytes "
                         "(df -i): remove files on it, old checkpoints or others, to free "
                         "inodes)"), said
    monkeypatch.setattr(writer_module, "_free_inodes", lambda root: 5)  # (bytes, then)
    assert "inode" not in writer_module._room_said(job, full)  # type: ignore[arg-type]


def test_a_save_out_of_inodes_says_so_and_what_to_remove(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """(a crash trial) A save that met ENOSPC on a filesystem out of inodes, bytes free,
    named the bytes free alone and advised freeing space: it names the free inodes, and
    that files (old checkpoints) are what to remove."""
    import errno
    import os
    from types import SimpleNamespace

    import asyncckpt.writer as writer_module

    class _NoInode(LocalStorage):
        def write_arena(self, path: Path, buf: memoryview, nbytes: int, ready: Any,
                        direct_io: bool) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    def statvfs(path: Any) -> Any:  # (8 GiB free, and not one inode)
        return SimpleNamespace(f_bavail=8 << 20, f_frsize=1024, f_files=1000, f_favail=0)

    monkeypatch.setattr(writer_module.os, "statvfs", statvfs)
    with (asyncckpt.AsyncCheckpointer(tmp_path, mode="sync", storage=_NoInode()) as ckpt,
          pytest.raises(asyncckpt.CheckpointSaveError) as info):
        ckpt.save({"w": torch.ones(4)}, step=1)
    said = str(info.value)
    assert "MB free now" in said and "0 free inodes" in said, said
    assert "remove files on it, old checkpoints or others, to free inodes" in said, said


def test_the_storage_call_named_is_found_by_its_argument_in_every_signature() -> None:
    """(review) A storage method taking its path positionally, as *args, by keyword or in
    **kwargs (locals of its own besides) is named with it, not None."""
    import sys

    from asyncckpt.writer import _first_argument

    def plain(self: Any, path: str) -> Any:
        return sys._getframe()

    def star(self: Any, *args: Any, **kw: Any) -> Any:
        spare = 1  # noqa: F841  (a local of its own, after the arguments)
        return sys._getframe()

    def keywords(self: Any, **kw: Any) -> Any:
        one, two = 1, 2  # noqa: F841
        return sys._getframe()

    assert _first_argument(plain(None, "/a")) == "/a"
    assert _first_argument(star(None, "/b")) == "/b"
    assert _first_argument(star(None, path="/c")) == "/c"
    assert _first_argument(keywords(None, fd=7)) == 7


def test_a_rank_says_at_once_that_it_writes_once_staging_lets_it() -> None:
    """Beats go once a second: a trial's rank 1, dead as it wrote its 8 MB shard (its
    staging done within its first beat's second), was said by rank 0's timeout to be
    "last staging: copied 4,096 of 8,004,096 bytes into host memory"."""
    from types import SimpleNamespace

    from asyncckpt.dist import Pulse
    from asyncckpt.writer import _ready

    ctx = DistContext(rank=1, world_size=2, store=dist.HashStore(), namespace="t",
                      timeout_s=30.0)
    progress = StagingProgress()
    progress.publish(4096)
    job = SimpleNamespace(pulse=Pulse(ctx, "s1"), progress=progress,
                          plan=SimpleNamespace(file_bytes=8_004_096))
    ready = _ready(job)  # type: ignore[arg-type]

    def said() -> str:
        return str(json.loads(ctx.store.get(ctx.key("s1", "beat", 1)))["doing"])

    waiting = threading.Thread(target=ready, args=(8_004_096,), daemon=True)
    waiting.start()
    deadline = time.monotonic() + 10
    while not ctx.store.check([ctx.key("s1", "beat", 1)]) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert said() == "staging: copied 4,096 of 8,004,096 bytes into host memory"
    progress.finish(8_004_096)  # within the beat's second
    waiting.join(10)
    assert not waiting.is_alive()
    assert said() == "writing its shard file, to byte 8,004,096 of 8,004,096"
    ready(4096)  # later pieces beat once a second, as before
    assert said() == "writing its shard file, to byte 8,004,096 of 8,004,096"
