"""Machine-limit probes for the checkpoint benchmark: memory copy, disk write, cold read.

Everything here measures what the hardware can do with the simplest possible code, so
that checkpointing results can be expressed as ratios to it. Also: page-cache control
(per-file ``posix_fadvise`` and the global ``drop_caches``), page-cache residency via
``mincore(2)``, RSS sampling and machine facts for the report header.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import mmap
import os
import platform
import re
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil
import torch

PIECE_BYTES = 8 * 1024 * 1024  # reads (and dd)
# O_DIRECT writes go in 32 MiB pieces, as asyncckpt's writer does: on this VM that was
# ~3% faster than 8 MiB (0.83 s against 0.86 s for 3.2 GB), so the limit is the stricter.
WRITE_PIECE_BYTES = 32 * 1024 * 1024
PAGE = mmap.PAGESIZE
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def align_up(n: int, align: int = PAGE) -> int:
    return (n + align - 1) // align * align


# --- buffers -----------------------------------------------------------------------------


class AlignedBuffer:
    """A page-aligned anonymous mapping (huge pages requested) with a uint8 tensor view."""

    def __init__(self, nbytes: int, *, touch: bool = True):
        self.nbytes = align_up(max(nbytes, 1))
        self._mmap = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            with contextlib.suppress(OSError):
                self._mmap.madvise(mmap.MADV_HUGEPAGE)
        self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
        if touch:
            self.tensor.fill_(1)

    def memoryview(self) -> memoryview:
        return memoryview(self._mmap)

    def views_like(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Typed views laid back to back, one per tensor (each aligned to its element size)."""
        out = []
        pos = 0
        for t in tensors:
            pos = align_up(pos, t.element_size())
            n = t.numel() * t.element_size()
            out.append(self.tensor[pos:pos + n].view(t.dtype).view(t.shape))
            pos += n
        if pos > self.nbytes:
            raise ValueError(f"{pos} bytes do not fit into a {self.nbytes}-byte buffer")
        return out

    def close(self) -> None:
        del self.tensor
        with contextlib.suppress(BufferError):  # a view still alive: leave it to the GC
            self._mmap.close()


def packed_nbytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes that :meth:`AlignedBuffer.views_like` needs for ``tensors``."""
    pos = 0
    for t in tensors:
        pos = align_up(pos, t.element_size()) + t.numel() * t.element_size()
    return pos


def memcpy_tensors(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor],
                  threads: int) -> float:
    """Copy each contiguous ``src`` into ``dst`` with libc memcpy, the tensors split into
    ``threads`` equal-byte runs copied by as many threads (memcpy releases the GIL)."""
    pairs = [(d.data_ptr(), s.data_ptr(), s.numel() * s.element_size())
             for d, s in zip(dst, src, strict=True)]
    total = sum(n for _, _, n in pairs) or 1
    runs: list[list[tuple[int, int, int]]] = [[] for _ in range(threads)]
    acc = 0
    for p in pairs:
        runs[min(threads - 1, acc * threads // total)].append(p)
        acc += p[2]

    def run(part: list[tuple[int, int, int]]) -> None:
        for d, s, n in part:
            ctypes.memmove(d, s, n)

    t0 = time.perf_counter()
    others = [threading.Thread(target=run, args=(r,)) for r in runs[1:]]
    for t in others:
        t.start()
    run(runs[0])
    for t in others:
        t.join()
    return time.perf_counter() - t0


def copy_tensors(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> float:
    """Copy each ``src`` into the matching ``dst``; return the seconds it took."""
    t0 = time.perf_counter()
    with torch.no_grad():
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)
    return time.perf_counter() - t0


# --- disk ----------------------------------------------------------------------------------


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        if n <= 0:
            raise OSError("short write")
        data = data[n:]
        offset += n


def odirect_write(path: Path, buf: memoryview, nbytes: int) -> tuple[float, bool]:
    """Write ``buf[:align_up(nbytes)]`` to a new file in 32 MiB pieces, then fsync.

    Uses O_DIRECT when the filesystem accepts it. Returns (seconds, used O_DIRECT).
    """
    padded = align_up(nbytes)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    direct = bool(_O_DIRECT)
    t0 = time.perf_counter()
    try:
        fd = os.open(path, flags | _O_DIRECT, 0o644) if direct else os.open(path, flags, 0o644)
    except OSError:
        direct = False
        fd = os.open(path, flags, 0o644)
    try:
        for off in range(0, padded, WRITE_PIECE_BYTES):
            _pwrite_all(fd, buf[off:min(off + WRITE_PIECE_BYTES, padded)], off)
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0, direct


def dd_write(path: Path, nbytes: int) -> tuple[float, str]:
    """``dd if=/dev/zero of=path bs=8M count=N conv=fsync``; returns (seconds, dd's summary)."""
    count = max(1, -(-nbytes // PIECE_BYTES))
    cmd = ["dd", "if=/dev/zero", f"of={path}", "bs=8M", f"count={count}", "conv=fsync"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - t0
    if proc.returncode:
        raise OSError(f"dd exited with {proc.returncode}: {proc.stderr.strip()[-200:]}")
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    return seconds, lines[-1] if lines else ""


def sequential_read(path: Path, buf: memoryview) -> tuple[float, int]:
    """Read the whole file in 8 MiB pieces into ``buf`` (buffered I/O); (seconds, bytes)."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    total = 0
    try:
        size = os.fstat(fd).st_size
        while total < size:
            n = os.preadv(fd, [buf[total:min(total + PIECE_BYTES, size)]], total)
            if n <= 0:
                break
            total += n
    finally:
        os.close(fd)
    return time.perf_counter() - t0, total


def parallel_read(path: Path, buf: memoryview, streams: int) -> float:
    """Read the file as ``streams`` contiguous parts, each sequentially on its own thread."""
    size = path.stat().st_size
    bounds = [size * i // streams // PIECE_BYTES * PIECE_BYTES for i in range(streams)] + [size]
    errors: list[BaseException] = []

    def part(lo: int, hi: int) -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                pos = lo
                while pos < hi:
                    n = os.preadv(fd, [buf[pos:min(pos + PIECE_BYTES, hi)]], pos)
                    if n <= 0:
                        break
                    pos += n
            finally:
                os.close(fd)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=part, args=(bounds[i], bounds[i + 1]))
               for i in range(streams)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return seconds


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` torch intra-op threads, then restore the previous count."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# --- page cache ----------------------------------------------------------------------------

_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def cache_residency(path: Path) -> float:
    """Fraction of the file's pages in the page cache (mincore); NaN when it cannot tell."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0.0
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            return float("nan")
        try:
            pages = -(-size // PAGE)
            vec = np.zeros(pages, dtype=np.uint8)
            if _libc.mincore(addr, size, vec.ctypes.data) != 0:
                return float("nan")
            return float(np.count_nonzero(vec & 1)) / pages
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def fadvise_dontneed(path: Path) -> None:
    """Ask the kernel to drop the (clean) cached pages of one file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def drop_all_caches() -> str | None:
    """``sync; echo 1 > /proc/sys/vm/drop_caches``; returns None on success, else why not."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
    except OSError as exc:
        return f"{type(exc).__name__}: {exc.strerror or exc}"
    return None


@dataclass
class DropReport:
    """How the page cache of some files was dropped, and how much of them stayed cached."""

    method: str
    residency_before: float
    residency_after: float


def files_under(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file())


def residency(path: Path) -> float:
    """Fraction of the bytes of ``path`` (a file, or the files under a directory) cached."""
    return _residency(files_under(path))


def _residency(files: Iterable[Path]) -> float:
    sizes = {p: p.stat().st_size for p in files}
    total = sum(sizes.values())
    if total == 0:
        return 0.0
    return sum(cache_residency(p) * n for p, n in sizes.items() if n) / total


def drop_cache(path: Path, *, threshold: float = 0.01) -> DropReport:
    """Drop the page cache of ``path`` (a file, or every file under a directory).

    ``posix_fadvise(DONTNEED)`` first; when more than ``threshold`` stays resident (by
    mincore), the global ``drop_caches`` too.
    """
    files = files_under(path)
    before = _residency(files)
    for p in files:
        fadvise_dontneed(p)
    after = _residency(files)
    method = "fadvise"
    if not after <= threshold:  # also when NaN
        if drop_all_caches() is None:
            method = "fadvise+drop_caches"
            after = _residency(files)
        else:
            method = "fadvise (drop_caches refused)"
    return DropReport(method, before, after)


# --- memory --------------------------------------------------------------------------------


def rss_bytes() -> int:
    return int(psutil.Process().memory_info().rss)


def malloc_trim() -> None:
    """Give freed heap memory back to the OS (glibc), so RSS baselines mean something."""
    with contextlib.suppress(AttributeError):
        _libc.malloc_trim(0)


class RssSampler:
    """Samples this process's RSS on a thread every ``interval`` seconds; keeps the max."""

    def __init__(self, interval: float = 0.01):
        self.interval = interval
        self.max_rss = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.max_rss = max(self.max_rss, rss_bytes())

    def _run(self) -> None:
        proc = psutil.Process()
        while not self._stop.wait(self.interval):
            self.max_rss = max(self.max_rss, int(proc.memory_info().rss))


def peak_rss_bytes() -> int:
    """Peak RSS of this process so far (VmHWM)."""
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


# --- machine facts -------------------------------------------------------------------------


def filesystem_of(path: Path) -> str:
    """The filesystem type and device that hold ``path`` (longest mount-point match)."""
    best, kind = "", "?"
    path = path.resolve()
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) < 3:
                continue
            mnt = parts[1].replace("\\040", " ")
            if (str(path) == mnt or str(path).startswith(mnt.rstrip("/") + "/")) and len(
                    mnt) >= len(best):
                best, kind = mnt, f"{parts[2]} ({parts[0]} on {mnt})"
    return kind


def cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return re.sub(r"\s+", " ", line.split(":", 1)[1]).strip()
    return platform.processor() or "?"


@dataclass
class Machine:
    cores: int
    cpu: str
    ram_gib: float
    kernel: str
    python: str
    torch: str
    torch_threads: int
    thp: str
    extra: dict[str, str] = field(default_factory=dict)


def machine() -> Machine:
    thp = "?"
    with contextlib.suppress(OSError):
        thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    return Machine(
        cores=os.cpu_count() or 0, cpu=cpu_model(),
        ram_gib=psutil.virtual_memory().total / 2**30, kernel=platform.release(),
        python=platform.python_version(), torch=torch.__version__,
        torch_threads=torch.get_num_threads(), thp=thp)
