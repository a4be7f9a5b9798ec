"""A full or failing disk: the save fails loudly and cleanly, nothing earlier is harmed.

(a) An injected storage layer fails one operation — the shard write after K pieces,
    the manifest write, a file fsync, a directory fsync, the commit rename, the mkdir
    of the temporary directory — with ENOSPC or EIO. The future raises
    CheckpointSaveError naming the step (and saying the disk is full for ENOSPC), the
    previous checkpoint still loads bit-exact, the temporary directory is gone, and the
    next save works once the fault is cleared.
(b) A real 8 MiB tmpfs (needs root; skipped with the reason when it cannot be
    mounted) is filled to several levels so that a save hits a real ENOSPC in its
    shard file or its manifest; then space is freed and saving works again. tmpfs
    accepts O_DIRECT since Linux 6.6, so on older kernels only this also runs the
    buffered fallback (tests/test_storage.py emulates a filesystem that refuses it).
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncckpt
import asyncckpt.storage as storage_mod
from asyncckpt import CheckpointSaveError
from asyncckpt.storage import LocalStorage

from ._crash_worker import TMP_OR_DELETING, same_tree, state_for


class FaultyStorage(LocalStorage):
    """LocalStorage that fails one operation with an OSError while ``fault`` is set.

    ``fault = (op, errno, k)``: for "write_arena", fail before piece ``k`` (pieces
    before it are really written); for "write_bytes", write half the data, then fail;
    otherwise fail the ``k``-th call of ``op`` (1-based) from when the fault was set.
    """

    def __init__(self) -> None:
        self.fault: tuple[str, int, int] | None = None
        self.calls: dict[str, int] = {}
        self.raised = 0

    def arm(self, op: str, err: int, k: int = 1) -> None:
        self.fault, self.calls, self.raised = (op, err, k), {}, 0

    def _err(self, op: str) -> OSError:
        assert self.fault is not None
        self.raised += 1
        return OSError(self.fault[1], f"{os.strerror(self.fault[1])} (injected in {op})")

    def _hit(self, op: str) -> bool:
        if self.fault is None or self.fault[0] != op:
            return False
        self.calls[op] = self.calls.get(op, 0) + 1
        return self.calls[op] == self.fault[2]

    def write_arena(self, path: Path, buf: memoryview, nbytes: int,
                    ready: Callable[[int], None], direct: bool = True) -> None:
        def ready_or_fail(end: int) -> None:
            if self._hit("write_arena"):
                raise self._err("write_arena")
            ready(end)

        super().write_arena(path, buf, nbytes, ready_or_fail, direct)

    def write_bytes(self, path: Path, data: bytes) -> None:
        if self._hit("write_bytes"):
            with open(path, "wb") as f:
                f.write(data[:len(data) // 2])
            raise self._err("write_bytes")
        super().write_bytes(path, data)

    def makedirs(self, path: Path) -> None:
        if TMP_OR_DELETING.match(path.name) and self._hit("makedirs"):
            raise self._err("makedirs")
        super().makedirs(path)

    def fsync_dir(self, path: Path) -> None:
        if self._hit("fsync_dir"):
            raise self._err("fsync_dir")
        super().fsync_dir(path)

    def rename(self, src: Path, dst: Path) -> None:
        if self._hit("rename"):
            raise self._err("rename")
        super().rename(src, dst)


def leftovers(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith(".step_"))


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Write shard files in 4 KiB pieces, so that a failure can land between pieces."""
    monkeypatch.setattr(storage_mod, "PIECE_BYTES", 4096)


def check_failed_save(root: Path, ckpt: asyncckpt.AsyncCheckpointer, exc: BaseException,
                      step: int, err: int, committed: list[int]) -> None:
    msg = str(exc)
    assert isinstance(exc, CheckpointSaveError), repr(exc)
    assert f"step {step}" in msg, msg
    if err == errno.ENOSPC:
        assert "disk is full" in msg, msg
    cause = exc.__cause__
    assert isinstance(cause, OSError) and cause.errno == err, repr(cause)
    assert ckpt.steps() == committed, "a failed save changed what is committed"
    for s in committed:
        assert same_tree(ckpt.load(step=s), state_for(s)) is None
    assert leftovers(root) == [], "the failed save left its temporary directory"


FAULTS = [
    ("write_arena", errno.ENOSPC, 1),  # before the first piece
    ("write_arena", errno.ENOSPC, 3),  # two pieces of the shard on disk
    ("write_arena", errno.EIO, 7),     # the last piece
    ("write_bytes", errno.ENOSPC, 1),  # half the manifest on disk
    ("write_bytes", errno.EIO, 1),
    ("makedirs", errno.ENOSPC, 1),     # the temporary directory itself
    ("fsync_dir", errno.EIO, 1),       # the temporary directory, before the commit rename
    ("rename", errno.EIO, 1),          # the commit rename
    ("rename", errno.ENOSPC, 1),
]


@pytest.mark.parametrize(("op", "err", "k"), FAULTS,
                         ids=[f"{op}-{errno.errorcode[e]}-{k}" for op, e, k in FAULTS])
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_injected_failure_is_clean(tmp_path: Path, small_pieces: None, op: str, err: int,
                                   k: int, mode: str, figures: Any) -> None:
    storage = FaultyStorage()
    ckpt = asyncckpt.AsyncCheckpointer(tmp_path, mode=mode, keep_last=2, storage=storage)
    ckpt.save(state_for(1), 1)
    storage.arm(op, err, k)
    with pytest.raises(CheckpointSaveError) as ei:
        ckpt.save_async(state_for(2), 2).wait(120)
    assert storage.raised == 1, "the fault was never injected"
    check_failed_save(tmp_path, ckpt, ei.value, 2, err, [1])
    storage.fault = None  # space is back: the same checkpointer saves, the step can be retried
    ckpt.save(state_for(2), 2)
    ckpt.save(state_for(3), 3)
    ckpt.wait()
    assert ckpt.steps() == [2, 3]
    for s in (2, 3):
        assert same_tree(ckpt.load(step=s), state_for(s)) is None
    ckpt.close()
    assert leftovers(tmp_path) == []
    figures.add("io_faults_injected", 1)


def test_failed_file_fsync_is_clean(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    figures: Any) -> None:
    """fsync of the shard file reports EIO (the kernel lost the write): the save fails."""
    ckpt = asyncckpt.AsyncCheckpointer(tmp_path, mode="async", keep_last=2)
    ckpt.save(state_for(1), 1)
    real = os.fsync
    failed = []

    def fsync(fd: int) -> None:
        if not failed:
            failed.append(fd)
            raise OSError(errno.EIO, "Input/output error (injected in fsync)")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(CheckpointSaveError) as ei:
        ckpt.save(state_for(2), 2)
    monkeypatch.setattr(os, "fsync", real)
    assert failed
    check_failed_save(tmp_path, ckpt, ei.value, 2, errno.EIO, [1])
    ckpt.save(state_for(2), 2)
    assert ckpt.steps() == [1, 2]
    ckpt.close()
    figures.add("io_faults_injected", 1)


def test_failed_save_is_never_visible(tmp_path: Path) -> None:
    storage = FaultyStorage()
    ckpt = asyncckpt.AsyncCheckpointer(tmp_path, mode="async", keep_last=2, storage=storage)
    ckpt.save(state_for(1), 1)
    storage.arm("fsync_dir", errno.EIO, 2)  # the second: the root, right after the rename
    with pytest.raises(CheckpointSaveError):
        ckpt.save(state_for(2), 2)
    assert storage.raised == 1
    assert ckpt.steps() == [1], "the save was reported failed, yet step 2 is committed"
    ckpt.close()


def test_failing_retention_does_not_fail_the_save(tmp_path: Path) -> None:
    """Deleting an old step fails (EIO on its rename): the new step is committed and its
    future succeeds; the next save's retention catches up."""
    storage = FaultyStorage()
    ckpt = asyncckpt.AsyncCheckpointer(tmp_path, mode="async", keep_last=1, storage=storage)
    ckpt.save(state_for(1), 1)
    storage.arm("rename", errno.EIO, 2)  # the commit rename works, the retention one fails
    info = ckpt.save(state_for(2), 2)
    assert info.step == 2
    with contextlib.suppress(CheckpointSaveError):
        ckpt.wait()  # a retention failure may be reported here; the step is committed anyway
    assert 2 in ckpt.steps()
    assert same_tree(ckpt.load(step=2), state_for(2)) is None
    storage.fault = None
    ckpt.save(state_for(3), 3)
    ckpt.wait()
    assert ckpt.steps() == [3]
    ckpt.close()


# --- (b) a real, small, full filesystem ---------------------------------------------------------

@pytest.fixture
def tiny_fs(short_tmp: Path) -> Iterator[Path]:
    mnt = short_tmp / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount an 8 MiB tmpfs here ({r.stderr.strip() or r.returncode}); "
                    "the injected ENOSPC cases cover the save logic")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def big_state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 1024, generator=g), "step": step}  # 1 MiB


def test_real_enospc_on_a_full_tmpfs(tiny_fs: Path, figures: Any) -> None:
    root = tiny_fs / "ckpt"
    filler = tiny_fs / "filler"
    ckpt = asyncckpt.AsyncCheckpointer(root, mode="async", keep_last=2)
    ckpt.save(big_state(1), 1)
    ckpt.save(big_state(2), 2)
    ckpt.wait()
    shard = (root / "step_000000002" / "rank_00000.safetensors").stat().st_size
    page = 4096
    need = -(-shard // page) * page
    failures = 0
    step = 3
    # free space left for the save: none, a bit, all but the last page of the shard, the
    # shard but not the manifest, and plenty
    for room in (0, 64 * 1024, need - page, need, need + 4 * page, 3 * need):
        before = ckpt.steps()
        want_free = min(free_bytes(tiny_fs), room)
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            size = max(0, free_bytes(tiny_fs) - want_free)
            if size:
                os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)
        free_at_start = free_bytes(tiny_fs)
        try:
            ckpt.save(big_state(step), step)
        except CheckpointSaveError as exc:
            failures += 1
            check = str(exc)
            assert f"step {step}" in check and "disk is full" in check, check
            assert ckpt.steps() == before
            for s in before:
                assert same_tree(ckpt.load(step=s), big_state(s)) is None
            assert leftovers(root) == []
            assert free_bytes(tiny_fs) >= free_at_start, "the failed save kept its space"
        else:
            ckpt.wait()
            assert same_tree(ckpt.load(step=step), big_state(step)) is None
            step += 1
        filler.unlink()
    assert failures >= 2, "the filesystem never filled up"
    # space is back: saving works again and retention keeps two
    ckpt.save(big_state(step), step)
    ckpt.wait()
    assert ckpt.steps()[-1] == step and len(ckpt.steps()) == 2
    assert same_tree(ckpt.load(step=step), big_state(step)) is None
    ckpt.close()
    assert leftovers(root) == []
    figures.add("real_enospc_failures", failures)
