"""LocalStorage details that the save path relies on."""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

import pytest

from asyncckpt.errors import CheckpointCorruptError
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
    assert DirectoryLock(tmp_path).acquire()


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
