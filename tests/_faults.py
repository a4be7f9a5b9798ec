"""Storages that fail on purpose, shared by the tests of more than one module."""

from __future__ import annotations

import errno
import threading
from pathlib import Path

from asyncckpt.storage import LocalStorage


class StuckCommit(LocalStorage):
    """The fsync of ``root`` fails once step 2 is renamed into place (with an OSError,
    or a KeyboardInterrupt), and so does taking it back out of sight."""

    def __init__(self, root: Path, interrupt: bool = False):
        self.root, self.interrupt = root, interrupt

    def fsync_dir(self, path: Path) -> None:
        if Path(path) == self.root and (self.root / "step_000000002").exists():
            if self.interrupt:
                raise KeyboardInterrupt
            raise OSError(errno.EIO, "fsync failed")
        super().fsync_dir(path)

    def rename(self, src: Path, dst: Path) -> None:
        if ".deleting-" in Path(dst).name:
            raise OSError(errno.EROFS, "read-only now")
        super().rename(src, dst)


class GatedCommit(LocalStorage):
    """Every directory fsync (a save's commit among them) waits until ``gate`` is set, for
    ``wait_s`` at most: a save that stays in flight for as long as a test needs."""

    def __init__(self, wait_s: float = 30.0):
        self.gate, self.wait_s = threading.Event(), wait_s

    def fsync_dir(self, path: Path) -> None:
        self.gate.wait(self.wait_s)
        super().fsync_dir(path)
