"""LocalStorage details that the save path relies on."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncckpt.storage as storage_mod
from asyncckpt import AsyncCheckpointer
from asyncckpt.errors import CheckpointCorruptError
from asyncckpt.manifest import align_up
from asyncckpt.reader import verify_checkpoint
from asyncckpt.storage import LocalStorage


def test_remove_tree_tolerates_entries_removed_meanwhile(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # An aborting rank unlinks its shard file from the shared temporary directory while
    # the coordinator removes the whole directory.
    d = tmp_path / ".step_000000006.tmp-x"
    d.mkdir()
    for name in ("manifest.json", "rank_00000.safetensors", "rank_00001.safetensors"):
        (d / name).write_bytes(b"x")
    real_unlink = os.unlink
    raced: list[str] = []

    def unlink(path: str, *args: object, **kw: object) -> None:
        if not raced:  # the peer's unlinks land first, behind the caller's back
            for name in os.listdir(d):
                real_unlink(d / name)
                raced.append(name)
        real_unlink(path, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "unlink", unlink)
    LocalStorage().remove_tree(d)
    assert raced and not d.exists()


def test_remove_tree_still_reports_other_errors(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "t"
    d.mkdir()
    (d / "f").write_bytes(b"x")

    def unlink(path: str, *args: object, **kw: object) -> None:
        raise PermissionError(13, "injected", str(path))

    monkeypatch.setattr(os, "unlink", unlink)
    with pytest.raises(PermissionError):
        LocalStorage().remove_tree(d)
    assert (d / "f").exists()


def test_a_forked_child_neither_keeps_nor_releases_the_parents_lock(tmp_path: Path) -> None:
    import warnings

    from asyncckpt.storage import DirectoryLock

    lock = DirectoryLock(tmp_path)
    assert lock.acquire()
    r, w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads around
        pid = os.fork()
    if pid == 0:  # the child: it does not hold the lock, and closing changes nothing
        code = 1
        try:
            held = lock._fd is not None
            lock.release()  # what close() or __del__ of a copied checkpointer does
            mine = DirectoryLock(tmp_path).acquire()  # the parent still holds it
            code = 0 if (not held and not mine) else 2
        finally:
            os.write(w, bytes([code]))
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    assert os.read(r, 1) == b"\x00", "the child held the lock, or could take it"
    os.close(r)
    assert not DirectoryLock(tmp_path).acquire(), "the parent's lock was released by its child"
    lock.release()
    again = DirectoryLock(tmp_path)
    assert again.acquire()
    again.release()  # an fd left open fails the lock-leak checks of later tests


@pytest.mark.parametrize("how", ["open_read", "read_bytes"])
def test_a_fifo_or_directory_is_refused_without_blocking(tmp_path: Path, how: str) -> None:
    # A plain open of a FIFO blocks until a writer comes: a load, a fallback and a
    # verify of a step directory holding one would hang for ever.
    fifo = tmp_path / "rank_00000.safetensors"
    os.mkfifo(fifo)
    (tmp_path / "dir").mkdir()
    storage = LocalStorage()
    for path in (fifo, tmp_path / "dir"):
        out: dict[str, BaseException] = {}

        def run(path: Path = path, out: dict[str, BaseException] = out) -> None:
            try:
                if how == "open_read":
                    os.close(storage.open_read(path))
                else:
                    storage.read_bytes(path, 1 << 20)
            except BaseException as exc:
                out["error"] = exc

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(10)
        if t.is_alive():
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # let the blocked open go on
            t.join(10)
            pytest.fail(f"{how} of {path.name} blocked")
        err = out.get("error")
        assert isinstance(err, CheckpointCorruptError), err
        assert str(err).startswith(f"{path} is not a regular file") and err.path == str(path)


def test_regular_files_are_read_with_blocking_descriptors(tmp_path: Path) -> None:
    f = tmp_path / "manifest.json"
    f.write_bytes(b"0123456789")
    storage = LocalStorage()
    fd = storage.open_read(f)
    try:
        assert not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_NONBLOCK
        assert storage.file_size(fd) == 10
    finally:
        storage.close(fd)
    assert storage.read_bytes(f, 10) == b"0123456789"
    (tmp_path / "link").symlink_to(f)  # a symlink to a regular file is one
    assert storage.read_bytes(tmp_path / "link", 10) == b"0123456789"


def _refuse_direct_at_open(monkeypatch: pytest.MonkeyPatch) -> None:
    """Emulate ramfs (or tmpfs before Linux 6.6): an O_DIRECT open creates the file,
    then fails with EINVAL."""
    real_open = os.open

    def open_(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        if flags & os.O_DIRECT:
            os.close(real_open(path, flags & ~os.O_DIRECT, mode, dir_fd=dir_fd))
            raise OSError(errno.EINVAL, "Invalid argument", os.fsdecode(path))
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", open_)


def _refuse_direct_at_setfl(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Emulate the same filesystem's answer to fcntl(F_SETFL, O_DIRECT): EINVAL. Returns
    the descriptors it was refused for."""
    real_fcntl = fcntl.fcntl
    refused: list[int] = []

    def fcntl_(fd: int, cmd: int, arg: Any = 0) -> Any:
        if cmd == fcntl.F_SETFL and isinstance(arg, int) and arg & os.O_DIRECT:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_fcntl(fd, cmd, arg)

    monkeypatch.setattr(fcntl, "fcntl", fcntl_)
    return refused


def _save_and_load(directory: Path) -> None:
    state = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.randn(3, 7)}
    ck = AsyncCheckpointer(directory, mode="sync")
    try:
        ck.save(state, step=1)
        out = ck.load(verify=True)
    finally:
        ck.close()
    assert torch.equal(out["a"], state["a"]) and torch.equal(out["b"], state["b"])
    assert not verify_checkpoint(directory / "step_000000001", LocalStorage()).problems


def test_a_filesystem_refusing_o_direct_at_open_still_saves(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The O_DIRECT open used to create the file before EINVAL; the buffered O_EXCL retry
    # then failed with EEXIST, so every save on such a filesystem failed.
    _refuse_direct_at_open(monkeypatch)
    _refuse_direct_at_setfl(monkeypatch)
    _save_and_load(tmp_path / "ck")


def test_o_direct_refused_by_fcntl_writes_buffered(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    refused = _refuse_direct_at_setfl(monkeypatch)
    monkeypatch.setattr(storage_mod, "PIECE_BYTES", 3 * 4096)  # several pieces
    nbytes = 4 * 3 * 4096 + 123  # not a multiple of the page size
    buf = mmap.mmap(-1, align_up(nbytes))
    buf[:nbytes] = os.urandom(nbytes)
    buf[nbytes:] = b"\xff" * (len(buf) - nbytes)  # padding that must not reach the file
    asked: list[int] = []
    f = tmp_path / "rank_00000.safetensors"
    LocalStorage().write_arena(f, memoryview(buf), nbytes, asked.append, direct=True)
    assert refused, "O_DIRECT was not asked for"
    assert f.stat().st_size == nbytes
    assert f.read_bytes() == buf[:nbytes]
    assert asked[-1] == nbytes and asked == sorted(asked)
    _save_and_load(tmp_path / "ck")


def test_o_direct_is_asked_for_unless_turned_off(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    real_fcntl = fcntl.fcntl
    direct_asks: list[int] = []

    def fcntl_(fd: int, cmd: int, arg: Any = 0) -> Any:
        if cmd == fcntl.F_SETFL and isinstance(arg, int) and arg & os.O_DIRECT:
            direct_asks.append(fd)
        return real_fcntl(fd, cmd, arg)

    monkeypatch.setattr(fcntl, "fcntl", fcntl_)
    buf = mmap.mmap(-1, 4096)
    buf[:100] = b"x" * 100
    LocalStorage().write_arena(tmp_path / "d", memoryview(buf), 100, lambda end: None)
    assert len(direct_asks) == 1
    LocalStorage().write_arena(tmp_path / "b", memoryview(buf), 100, lambda end: None,
                               direct=False)
    assert len(direct_asks) == 1
    assert (tmp_path / "d").read_bytes() == (tmp_path / "b").read_bytes() == b"x" * 100


def test_the_lock_holder_is_the_first_line_of_the_lock_file(tmp_path: Path) -> None:
    """A writer that does not truncate leaves the tail of a longer pid behind its own
    (pids wrap around at pid_max: 21408 then 1102 gives "1102\\n8\\n")."""
    from asyncckpt.storage import DirectoryLock

    lock = DirectoryLock(tmp_path)
    assert lock.holder() == "unknown"  # no lock file
    lock.path.write_text("1102\n8\n")
    assert lock.holder() == "1102"
    lock.path.write_text("")
    assert lock.holder() == "unknown"


def test_a_lock_whose_directory_was_deleted_and_made_again_is_taken_anew(
        tmp_path: Path) -> None:
    """A trial: the root deleted between saves and made again by the next one kept no
    lock file, and a second process saved into it beside the first."""
    import shutil

    import asyncckpt
    from asyncckpt.storage import DirectoryLock

    root = tmp_path / "root"
    root.mkdir()
    lock = DirectoryLock(root)
    assert lock.acquire()
    shutil.rmtree(root)
    root.mkdir()
    assert lock.acquire() and (root / DirectoryLock.NAME).exists()
    assert not DirectoryLock(root).acquire()  # (held: another open file cannot take it)
    lock.release()
    # through a checkpointer's saves
    ckpt = asyncckpt.AsyncCheckpointer(tmp_path / "ck", mode="sync")
    ckpt.save({"w": torch.ones(2)}, step=1)
    shutil.rmtree(tmp_path / "ck")
    ckpt.save({"w": torch.ones(2)}, step=2)
    assert not DirectoryLock(tmp_path / "ck").acquire()
    ckpt.close()
    again = DirectoryLock(tmp_path / "ck")
    assert again.acquire()  # (released by close(): the new file's lock)
    again.release()


@pytest.mark.parametrize("planted", ["symlink", "dangling", "fifo"])
def test_a_lock_file_that_is_no_regular_file_is_refused_and_nothing_outside_is_written(
        tmp_path: Path, planted: str) -> None:
    """A trial planted .asyncckpt.lock as a link to a file of the user's: the save truncated
    it to the pid (a dangling link: created the file it named)."""
    import asyncckpt

    root = tmp_path / "root"
    root.mkdir()
    victim = tmp_path / "victim.txt"
    lock = root / ".asyncckpt.lock"
    if planted == "symlink":
        victim.write_text("precious user data")
        lock.symlink_to(victim)
    elif planted == "dangling":
        lock.symlink_to(victim)
    else:
        os.mkfifo(lock)
    with pytest.raises(asyncckpt.CheckpointSaveError,
                       match=r"lock file .* of the checkpoint directory: it is (a symbolic "
                             r"link: asyncckpt writes no lock through one|no regular file); "
                             r"remove it"):
        asyncckpt.save({"w": torch.ones(2)}, root, step=1)
    if planted == "symlink":
        assert victim.read_text() == "precious user data"
    else:
        assert not victim.exists()
    assert sorted(p.name for p in root.iterdir()) == [".asyncckpt.lock"]


def _newest_of_two_damaged(root: Path) -> None:
    """Steps 1 and 2 under ``root`` (w = 1.0, 2.0), a byte of step 2's data flipped."""
    with AsyncCheckpointer(root, mode="sync") as ckpt:
        ckpt.save({"w": torch.full((1024,), 1.0)}, step=1)
        ckpt.save({"w": torch.full((1024,), 2.0)}, step=2)
    shard = root / "step_000000002" / "rank_00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-8] ^= 0xFF
    shard.write_bytes(bytes(data))


@pytest.mark.parametrize("planted", ["symlink", "fifo"])
def test_a_fallback_load_beside_a_planted_lock_file_marks_nothing_and_ends(
        tmp_path: Path, planted: str, caplog: pytest.LogCaptureFixture) -> None:
    """(The review of the lock's O_NOFOLLOW: a fallback load that marks a damaged step
    read the lock file's "pid" through it: a FIFO hung the load for ever; a link put the
    first word of the file it named in the log.)"""
    import asyncckpt
    from asyncckpt.storage import DirectoryLock

    _newest_of_two_damaged(tmp_path)
    lock = tmp_path / DirectoryLock.NAME
    lock.unlink()
    secret = tmp_path.parent / f"{tmp_path.name}-secret.txt"
    secret.write_text("hunter2 is the password")
    if planted == "symlink":
        lock.symlink_to(secret)
    else:
        os.mkfifo(lock)
    assert DirectoryLock(tmp_path).holder() == "unknown"
    got: list[Any] = []
    reader = threading.Thread(target=lambda: got.append(
        asyncckpt.AsyncCheckpointer(tmp_path).load(fallback=True)), daemon=True)
    reader.start()
    reader.join(30)
    assert not reader.is_alive() and torch.equal(got[0]["w"], torch.full((1024,), 1.0))
    assert "its lock file cannot be taken" in caplog.text and "hunter2" not in caplog.text
    # (an ops trial's read-only copy, where nothing saves, was told of "the process saving
    # there")
    assert "the process saving there" not in caplog.text, caplog.text
    assert "no mark records them, so a later checkpointer's keep_last counts them" in \
        caplog.text, caplog.text
    assert secret.read_text() == "hunter2 is the password"


def test_a_mark_refused_by_a_lock_another_process_holds_names_that_process(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """(review) An evaluator run as another user beside its trainer cannot open the lock
    file for writing: that must not read as a copy where nothing saves."""
    import logging

    import asyncckpt
    from asyncckpt.storage import DirectoryLock

    _newest_of_two_damaged(tmp_path)
    fd = os.open(tmp_path / DirectoryLock.NAME, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (the trainer's)

        def denied(self: DirectoryLock, *a: Any, **k: Any) -> bool:
            raise PermissionError(13, "Permission denied")

        monkeypatch.setattr(DirectoryLock, "acquire", denied)
        with caplog.at_level(logging.WARNING, logger="asyncckpt"):
            assert asyncckpt.load(tmp_path, fallback=True)["w"][0].item() == 1.0
        assert "the process saving there does not know of them" in caplog.text, caplog.text
        assert DirectoryLock(tmp_path).held_by_another() is True
    finally:
        os.close(fd)
    assert DirectoryLock(tmp_path).held_by_another() is False


def test_a_fifo_named_like_a_temporary_directory_is_left_and_never_opened(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """(adversary trial) rmtree opens its top, and opening a FIFO blocks until a writer
    comes: a FIFO named like an abandoned temporary directory hung the next save's
    cleanup, and with it close() and the interpreter's exit."""
    import asyncckpt

    asyncckpt.save({"w": torch.ones(4)}, tmp_path, step=1)
    fifo = tmp_path / ".step_000000002.tmp-abc"
    os.mkfifo(fifo)
    done: list[object] = []

    def save_and_close() -> None:
        ck = asyncckpt.AsyncCheckpointer(tmp_path, mode="sync")
        ck.save({"w": torch.ones(4)}, step=3)
        ck.close()
        done.append(ck.steps())

    t = threading.Thread(target=save_and_close, daemon=True)
    with caplog.at_level("WARNING", logger="asyncckpt"):
        t.start()
        t.join(30)
        if t.is_alive():  # (let the stuck open go: a writer to the FIFO)
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            t.join(10)
            pytest.fail("the cleanup opened the FIFO")
    assert done == [[1, 3]]
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)  # left as it is
    assert "not a directory" in caplog.text


@pytest.mark.parametrize("err", [errno.EIO, errno.ESTALE, errno.ENOENT])
def test_a_commit_rename_that_raises_after_it_was_done_commits(
        tmp_path: Path, err: int, caplog: pytest.LogCaptureFixture) -> None:
    """(storage trial) NFS: a rename's reply lost, its retry finds the source gone (ENOENT),
    or EIO/ESTALE after the fact: the save raised CheckpointSaveError with its step
    committed, listed and loadable (its name never fsync'd), and a retry was refused as
    "already committed". Done is done: the commit goes on."""
    import asyncckpt

    class LateError(LocalStorage):
        def rename(self, src: Path, dst: Path) -> None:
            super().rename(src, dst)
            if ".tmp-" in Path(src).name:
                raise OSError(err, os.strerror(err), str(src))

    class EarlyError(LocalStorage):
        def rename(self, src: Path, dst: Path) -> None:
            if ".tmp-" in Path(src).name:
                raise OSError(err, os.strerror(err), str(src))
            super().rename(src, dst)

    with caplog.at_level("WARNING", logger="asyncckpt"), asyncckpt.AsyncCheckpointer(
            tmp_path, mode="sync", storage=LateError()) as ck:
        info = ck.save({"w": torch.arange(4.0)}, step=1)
        assert info.path == tmp_path / "step_000000001" and ck.steps() == [1]
    assert "raised, but it was done: going on with the commit" in caplog.text
    assert torch.equal(asyncckpt.load(tmp_path)["w"], torch.arange(4.0))
    # (a rename that failed before it was done is a failed save, as ever)
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="sync", storage=EarlyError()) as ck:
        with pytest.raises(asyncckpt.CheckpointSaveError):
            ck.save({"w": torch.arange(4.0)}, step=2)
        assert ck.steps() == [1]


def test_ready_past_the_files_end_does_not_wait_for_ever(tmp_path: Path) -> None:
    """(storage trial) A write_arena in whole padded blocks called ready() with the last
    block's end, past nbytes: nothing is ever staged there, and the save hung."""
    import asyncckpt

    class PaddedBlocks(LocalStorage):
        def write_arena(self, path: Path, buf: memoryview, nbytes: int, ready: Any,
                        direct: bool = True) -> None:
            ready(align_up(nbytes) + 4096)  # (the padded end, and more)
            super().write_arena(path, buf, nbytes, ready, direct)

    done: list[object] = []

    def save() -> None:
        with asyncckpt.AsyncCheckpointer(tmp_path, mode="async",
                                         storage=PaddedBlocks()) as ck:
            done.append(ck.save({"w": torch.arange(1000.0)}, step=1).step)

    t = threading.Thread(target=save, daemon=True)
    t.start()
    t.join(30)
    assert done == [1], "the save hung"


def test_a_lock_holder_that_lets_go_soon_is_told_apart_from_a_save(tmp_path: Path) -> None:
    """What a save and `clean` wait a moment for (one read of the lock file): a holder
    that has not written who it is yet, a load marking a step, a clean; not a save."""
    from asyncckpt.storage import DirectoryLock

    lock = DirectoryLock(tmp_path)
    assert lock.passing() == "unwritten"  # (no file: nobody wrote who it is)
    for text, said in (("", "unwritten"), ("123 host\n", None), ("123 host mark\n", "mark"),
                       ("123 host clean\n", "clean"), ("123 host other\n", None)):
        lock.path.write_text(text)
        assert lock.passing() == said, text
