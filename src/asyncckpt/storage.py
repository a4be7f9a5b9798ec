"""Where the bytes go: the local filesystem.

Shard files are written with O_DIRECT from the aligned arena in 32 MiB pieces: the
page cache is bypassed (no dirty-page pile-up, no double copy) and the disk runs at
its sequential speed. Filesystems that refuse O_DIRECT (ramfs, tmpfs before Linux 6.6,
some FUSE and network filesystems) get buffered writes with periodic fdatasync instead.

``Storage`` is the extension point: tests inject failing layers through it, and
object stores can implement it later.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import shutil
import socket
import stat
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from .errors import CheckpointCorruptError
from .manifest import align_up

log = logging.getLogger(__name__)

# Fewer, larger writes leave more of the CPU to the staging copies that run beside them:
# durable/O_DIRECT limit went from 1.31x to 1.15x (medians of 6 A/B saves, 3 GB) over 8 MiB.
PIECE_BYTES = 32 * 1024 * 1024
_BUFFERED_SYNC_BYTES = 512 * 1024 * 1024
_O_DIRECT = getattr(os, "O_DIRECT", 0)


class ReadStorage(Protocol):
    """What loading needs: a manifest and ranged reads. Implementations must be thread-safe.

    Local files implement it, and so does a peer's HTTP server (transport/http.py). A
    storage that serves a peer's view sets ``peer_view = True``: only its manifests may be
    partial (hold some boxes of their tensors). A storage may also have ``abort(fd)``,
    which the reader calls instead of ``close`` after a failed read: a peer's drops what
    is still in flight rather than reading it to its end; and ``check_manifest(manifest)``,
    called once the manifest is parsed, which raises to refuse it (a peer's: one of
    another step than the one asked for).
    """

    def listdir(self, path: Path) -> list[str]: ...

    def read_bytes(self, path: Path, limit: int) -> bytes: ...

    def open_read(self, path: Path) -> int: ...

    def close(self, fd: int) -> None: ...

    def file_size(self, fd: int) -> int: ...

    def pread_into(self, fd: int, views: Sequence[memoryview], offset: int) -> int: ...


class Storage(ReadStorage, Protocol):
    """Filesystem operations the checkpointer needs. Implementations must be thread-safe."""

    def makedirs(self, path: Path) -> None: ...

    def write_arena(self, path: Path, buf: memoryview, nbytes: int,
                    ready: Callable[[int], None], direct: bool = True) -> None: ...

    def write_bytes(self, path: Path, data: bytes) -> None: ...

    def fsync_dir(self, path: Path) -> None: ...

    def rename(self, src: Path, dst: Path) -> None: ...

    def remove_tree(self, path: Path) -> None: ...


# The calls of a Storage, in the protocols' order: what a storage= must have, and what a
# traceback's frame is looked for by (writer._storage_call).
STORAGE_CALLS: tuple[str, ...] = tuple(n for c in (Storage, ReadStorage) for n in vars(c)
                                       if not n.startswith("_"))


class LocalStorage:
    """The local filesystem. Thread-safe (every method works on its own descriptors)."""

    def makedirs(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)

    def write_arena(self, path: Path, buf: memoryview, nbytes: int,
                    ready: Callable[[int], None], direct: bool = True) -> None:
        """Write ``buf[:nbytes]`` to a new file and fsync it.

        ``buf`` must be page aligned and at least ``align_up(nbytes)`` long. Each piece
        is written once ``ready(end)`` returns, i.e. once staging has got past it.
        """
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        # Open buffered, then ask for O_DIRECT: a filesystem that refuses O_DIRECT at open
        # (ramfs, tmpfs before Linux 6.6, some FUSE) creates the file first, and a buffered
        # retry of an O_EXCL open would then find it there (EEXIST) and fail every save.
        fd = os.open(path, flags, 0o644)
        try:
            using_direct = direct and bool(_O_DIRECT) and _set_direct(fd, path)
            padded = align_up(nbytes) if using_direct else nbytes
            since_sync = 0
            for off in range(0, padded, PIECE_BYTES):
                end = min(off + PIECE_BYTES, padded)
                ready(min(end, nbytes))
                if using_direct:
                    try:
                        _pwrite_all(fd, buf[off:end], off)
                        continue
                    except OSError as exc:  # some filesystems accept O_DIRECT opens only
                        if exc.errno != errno.EINVAL:
                            raise
                        log.info("O_DIRECT write refused on %s; using buffered writes", path)
                        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)
                        using_direct = False
                        end = min(end, nbytes)
                _pwrite_all(fd, buf[off:end], off)
                since_sync += end - off
                if since_sync >= _BUFFERED_SYNC_BYTES:  # keep dirty pages from piling up
                    os.fdatasync(fd)
                    since_sync = 0
            if padded != nbytes or os.fstat(fd).st_size != nbytes:
                os.ftruncate(fd, nbytes)
            os.fsync(fd)
        finally:
            os.close(fd)

    def write_bytes(self, path: Path, data: bytes) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0),
                     0o644)
        try:
            _pwrite_all(fd, memoryview(data), 0)
            os.fsync(fd)
        finally:
            os.close(fd)

    def fsync_dir(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def rename(self, src: Path, dst: Path) -> None:
        os.rename(src, dst)

    def remove_tree(self, path: Path) -> None:
        """Remove ``path`` and what it holds; entries that vanish meanwhile are fine.

        In a group, a rank that aborts takes its own shard file out of the shared
        temporary directory while the coordinator removes the whole of it. A symbolic
        link (a step directory a user linked in) loses the link only: what it points to
        is not ours to delete, and rmtree refuses links.
        """
        if path.is_symlink():
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            return
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(mode):
            # (rmtree opens its top, and opening a FIFO blocks until a writer comes: a
            # FIFO named like a temporary directory hung close() for good; not ours)
            raise NotADirectoryError(errno.ENOTDIR, "not a directory, so not one a save "
                                     "made: left as it is", str(path))

        def gone_is_fine(func: Any, p: str, exc: BaseException) -> None:
            if not isinstance(exc, FileNotFoundError):
                raise exc

        if sys.version_info >= (3, 12):
            shutil.rmtree(path, onexc=gone_is_fine)
        else:
            shutil.rmtree(path, onerror=lambda f, p, info: gone_is_fine(f, p, info[1]))

    def listdir(self, path: Path) -> list[str]:
        try:
            return os.listdir(path)
        except FileNotFoundError:
            return []

    def read_bytes(self, path: Path, limit: int) -> bytes:
        with open(path, "rb", opener=lambda p, _: open_regular(p)) as f:
            size = os.fstat(f.fileno()).st_size
            if size > limit:  # asked before reading: nothing is allocated for a forged file
                raise ValueError(f"{path} is {size} bytes, larger than {limit}")
            data = f.read(size + 1)
        if len(data) > limit:
            raise ValueError(f"{path} is larger than {limit} bytes")
        return data

    def open_read(self, path: Path) -> int:
        return open_regular(path)

    def close(self, fd: int) -> None:
        os.close(fd)

    def file_size(self, fd: int) -> int:
        return os.fstat(fd).st_size

    def pread_into(self, fd: int, views: Sequence[memoryview], offset: int) -> int:
        return os.preadv(fd, views, offset)


_TRANSIENT = {errno.EINTR, errno.EAGAIN, errno.EMFILE, errno.ENFILE, errno.ENOMEM,
              errno.ESTALE, errno.ETIMEDOUT, errno.ENOBUFS, errno.ECONNRESET,
              errno.ECONNABORTED, errno.EHOSTUNREACH, errno.ENETDOWN, errno.ENETUNREACH}


def is_transient(exc: OSError) -> bool:
    """An error of the moment or of this process (out of file descriptors or memory, a
    timeout, a stale NFS handle, a dropped connection), not of the data: a reader re-raises
    it as it is, rather than calling the checkpoint damaged (and falling back past it)."""
    return isinstance(exc, (TimeoutError, ConnectionError, InterruptedError)) or \
        exc.errno in _TRANSIENT


def open_regular(path: str | os.PathLike[str]) -> int:
    """Open ``path`` for reading; CheckpointCorruptError unless it is a regular file.

    A plain open of a FIFO blocks until something writes to it (forever, in a step
    directory), and a device or a directory is no checkpoint file either: open without
    blocking, check, then make reads block again.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CheckpointCorruptError(f"{os.fsdecode(path)} is not a regular file (a FIFO, "
                                         "device or directory): the checkpoint is damaged; "
                                         "load another step", path=os.fsdecode(path))
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _set_direct(fd: int, path: Path) -> bool:
    """Turn on O_DIRECT for ``fd``; False (the file stays buffered) where it is refused."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | _O_DIRECT)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        log.info("O_DIRECT refused on %s; using buffered writes", path)
        return False
    return True


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        data = data[n:]
        offset += n


def _hostname() -> str:
    """This machine's name, as one word (written in a lock file beside the pid)."""
    name = "".join(ch for ch in socket.gethostname() if ch.isprintable() and not ch.isspace())
    return name[:255] or "unknown-host"


class DirectoryLock:
    """An exclusive advisory lock on a checkpoint directory (``.asyncckpt.lock``).

    Keeps two processes from saving into one directory at once. Not thread-safe.
    """

    NAME = ".asyncckpt.lock"

    def __init__(self, directory: Path, purpose: str = ""):
        self.path = directory / self.NAME
        self.purpose = purpose  # one word the lock file names, for another's error ("clean")
        self._fd: int | None = None
        self._pid = 0  # the process that took the lock
        # set by a closed checkpointer whose save in flight still holds it (a close() that
        # was interrupted): released as that save ends
        self.draining: str | None = None  # what it still writes ("its save of step 7")
        self.freed = threading.Event()  # set by release()
        # who holds it, for another checkpointer's error: where it was made, and the
        # object itself (weakly: the lock must not keep it alive)
        self.made_at = ""
        self.owner: weakref.ref[Any] | None = None

    def acquire(self) -> bool:
        if self._fd is not None and self._pid == os.getpid():
            if self._names_ours():
                return True
            # The directory was deleted (and made again by this save), or replaced: the
            # lock held is on a file no other process can find; take the one there now.
            self.release()
        # (never through a symbolic link, nor into anything but a regular file: a link
        # planted in a shared run directory had a save truncate the file it named)
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP or self.path.is_symlink():
                raise OSError(errno.ELOOP, "it is a symbolic link: asyncckpt writes no lock "
                              "through one; remove it", str(self.path)) from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(errno.EINVAL, "it is no regular file; remove it", str(self.path))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException as exc:  # held elsewhere (or ENOLCK, or Ctrl-C): not ours
            os.close(fd)
            if isinstance(exc, BlockingIOError):
                return False
            raise
        # The pid is for the message another process shows; writing it may fail (a full
        # disk) without making the lock any less held.
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            # (and the host: trainers of many machines share one filesystem, where a pid
            # alone named no process a trial could find)
            purpose = f"{self.purpose}\n" if self.purpose else ""
            os.pwrite(fd, f"{os.getpid()}\n{_hostname()}\n{purpose}".encode(errors="replace"), 0)
        self._fd, self._pid = fd, os.getpid()
        self.freed.clear()
        _held_locks.add(self)
        return True

    def _names_ours(self) -> bool:
        """Whether the lock file's path still names the file this lock holds."""
        assert self._fd is not None
        try:
            there, ours = os.stat(self.path), os.fstat(self._fd)
        except OSError:
            return False
        return (there.st_dev, there.st_ino) == (ours.st_dev, ours.st_ino)

    @property
    def held(self) -> bool:
        """Whether this lock object holds the directory (in this process)."""
        return self._fd is not None and self._pid == os.getpid()

    def held_in_this_process(self) -> DirectoryLock | None:
        """The other lock object of this process that holds the same directory, if any."""
        try:
            mine = os.stat(self.path)
        except OSError:
            return None
        for lk in list(_held_locks):
            fd = lk._fd
            if lk is self or fd is None or lk._pid != os.getpid():
                continue
            with contextlib.suppress(OSError):
                theirs = os.fstat(fd)  # the same file, however its path is spelled
                if (theirs.st_dev, theirs.st_ino) == (mine.st_dev, mine.st_ino):
                    return lk
        return None

    def open_here(self) -> bool | None:
        """Whether this process has the lock file open (None where it cannot tell: no
        /proc): a holder's pid equal to ours may be another container's, or machine's."""
        try:
            mine = os.stat(self.path)
        except OSError:
            return False
        try:
            fds = os.listdir("/proc/self/fd")
        except OSError:
            return None
        for fd in fds:
            with contextlib.suppress(OSError, ValueError):
                st = os.stat(f"/proc/self/fd/{fd}")
                if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
                    return True
        return False

    def held_by_another(self) -> bool | None:
        """Whether a process holds the lock (another, where this one does not), told
        without taking it (see :func:`lock_state`: a probe that took it, for a moment
        even, would fail a save that came then); None where this machine cannot tell."""
        held: bool | None = lock_state(self.path.parent)["held"]
        return held

    def holder(self) -> str:
        """The pid the holder wrote (its first line: a writer that did not truncate
        leaves the end of a longer pid behind it)."""
        return (self._written() or ["unknown"])[0]

    def holder_host(self) -> str | None:
        """The host name the holder wrote (its second line; None from a lock file of a
        version that wrote the pid alone)."""
        words = self._written()
        return words[1] if len(words) > 1 else None

    def holder_purpose(self) -> str:
        """What the holder wrote it holds the lock for (its third line: "clean" for
        ``asyncckpt clean``; "" for a save, or a lock file of a version that wrote none)."""
        words = self._written()
        return words[2] if len(words) > 2 else ""

    def passing(self) -> str | None:
        """What another process holds the lock for where it lets go of it soon, so that
        a caller waits a moment rather than fail: "unwritten" (it took the lock and has
        not written who it is yet), "mark" (a load marking a step damaged), "clean"
        (``asyncckpt clean``: seconds); None for a save, or no holder. One read."""
        words = self._written()
        if not words or words[0] == "unknown":
            return "unwritten"
        purpose = words[2] if len(words) > 2 else ""
        return purpose if purpose in ("mark", "clean") else None

    def _written(self) -> list[str]:
        # (not through a link, nor from a FIFO, on which a read would wait for ever: a
        # lock file planted as one of those holds no pid of ours)
        flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0)
        with contextlib.suppress(OSError):
            fd = os.open(self.path, flags | getattr(os, "O_CLOEXEC", 0))
            try:
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    return os.pread(fd, 320, 0).decode(errors="replace").split()[:3]
            finally:
                os.close(fd)
        return []

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            _held_locks.discard(self)  # first: a fork from now on must not close fd
            with contextlib.suppress(OSError):
                if self._pid == os.getpid():  # a forked child must not unlock its parent
                    fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
        self.freed.set()


_held_locks: weakref.WeakSet[DirectoryLock] = weakref.WeakSet()


def _drop_inherited_locks() -> None:
    """In a forked child: close the lock descriptors it inherited, without unlocking.

    The lock belongs to the parent; a child that kept the descriptor would keep the
    directory locked after the parent died, and one that unlocked it would let another
    process save (and clean up) under the parent's feet.
    """
    for lock in list(_held_locks):
        if lock._fd is not None:
            with contextlib.suppress(OSError):
                os.close(lock._fd)
            lock._fd = None
    _held_locks.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_inherited_locks)


# The inode of /proc/self/ns/pid in the kernel's first pid namespace (a fixed number): there
# /proc/locks shows every process's locks; in a container's, only those of its processes.
_INIT_PID_NS = 0xEFFFFFFC
# Filesystems of one machine, whose locks are all this kernel's (and so in /proc/locks). On
# any other (NFS, Lustre, GPFS, CIFS, FUSE...) another machine's holder is not seen here.
_LOCAL_FS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "bcachefs", "f2fs", "jfs",
                       "reiserfs", "nilfs2", "zfs", "tmpfs", "ramfs", "overlay", "vfat",
                       "exfat", "ntfs", "ntfs3", "hfsplus"})


def lock_state(root: Path) -> dict[str, Any]:
    """Whether a process holds the lock of the (resolved) ``root`` now, and which, told
    without taking the lock (a probe that took it, for a moment even, would fail a save
    that came then) nor creating its file: the kernel's table of locks is read.

    ``held``: True, False, or None where this machine cannot tell (no /proc/locks, a
    network filesystem, a container's pid namespace: a holder elsewhere is not seen).
    ``pid``: the holder's where held; where it cannot tell, the pid the lock file names
    (the last process that took the lock: it may hold it still); else None. ``note``:
    why it cannot tell, or None."""
    lock = DirectoryLock(root)
    try:
        st = os.lstat(lock.path)
    except FileNotFoundError:  # (a save creates it: none has taken a lock here)
        return {"held": False, "pid": None, "note": None}
    except OSError as exc:
        return {"held": None, "pid": None,
                "note": f"its lock file {lock.path} cannot be looked at: {exc.strerror or exc}"}
    if not stat.S_ISREG(st.st_mode):  # (a link or a FIFO: no save takes a lock on it)
        return {"held": False, "pid": None, "note": None}
    named = lock.holder()
    file_pid = int(named) if named.isdecimal() else None
    mount = _mount_of(root)
    devices = {st.st_dev} | ({mount[1]} if mount is not None else set())
    holders = _flock_holders(st.st_ino, devices)
    if holders:
        pid = next((p for p in holders if p > 0), None)  # (this namespace's pid of it)
        return {"held": True, "pid": pid if pid is not None else file_pid, "note": None}
    if holders is None:
        note = "this system has no /proc/locks to tell it"
    elif mount is None or mount[0] not in _LOCAL_FS:
        fs = f"a {mount[0]} filesystem" if mount is not None else "a filesystem of unknown type"
        note = f"on {fs}, a holder on another machine is not seen from here"
    elif not _in_init_pid_namespace():
        note = ("this runs in a container's pid namespace: a holder in another container "
                "(or on the host) is not seen from here")
    else:
        return {"held": False, "pid": None, "note": None}
    return {"held": None, "pid": file_pid, "note": note}


def _flock_holders(inode: int, devices: set[int]) -> list[int] | None:
    """The pids (0 or less where not known here) of the processes /proc/locks says hold a
    flock on the file ``inode`` of one of ``devices``; None where there is no /proc/locks."""
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            lines = f.read(1 << 24).splitlines()
    except OSError:
        return None
    pids = []
    for line in lines:  # "1: FLOCK  ADVISORY  WRITE 5846 fe:00:2146431 0 EOF"
        fields = line.split()
        if len(fields) < 6 or fields[1] != "FLOCK":  # (" -> FLOCK": one waiting for it)
            continue
        with contextlib.suppress(ValueError):
            major, minor, ino = fields[5].split(":")
            if int(ino) == inode and os.makedev(int(major, 16), int(minor, 16)) in devices:
                pids.append(int(fields[4]))
    return pids


def _mount_of(path: Path) -> tuple[str, int] | None:
    """The type of the filesystem ``path`` (resolved) lies on, and its device number as
    /proc/locks gives it (the mount's: stat() gives another on btrfs); None where
    /proc/self/mountinfo cannot be read."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            lines = f.read(1 << 24).splitlines()
    except OSError:
        return None
    target = str(path)
    found: tuple[str, str, int] | None = None
    for line in lines:  # "27 1 254:0 / / rw,relatime - ext4 /dev/vda rw"
        fields = line.split()
        with contextlib.suppress(ValueError, IndexError):
            fstype = fields[fields.index("-", 6) + 1]
            major, minor = (int(n) for n in fields[2].split(":"))
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
            inside = target == point or target.startswith(point.rstrip("/") + "/")
            # (the longest mount point holding it; of equal ones, the last: mounted over)
            if inside and (found is None or len(point) >= len(found[0])):
                found = (point, fstype, os.makedev(major, minor))
    return None if found is None else found[1:]


def _in_init_pid_namespace() -> bool:
    try:
        return os.stat("/proc/self/ns/pid").st_ino == _INIT_PID_NS
    except OSError:
        return False
