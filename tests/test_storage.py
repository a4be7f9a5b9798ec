"""LocalStorage details that the save path relies on."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

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
