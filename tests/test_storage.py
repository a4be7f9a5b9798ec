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
