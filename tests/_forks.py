"""Running a piece of a test in a forked child (POSIX)."""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable


def in_forked_child(work: Callable[[], int], timeout_s: float = 30.0) -> int:
    """Run ``work()`` in a forked child and return its exit status: what ``work`` returned,
    1 if it raised, -9 if it was still running after ``timeout_s`` (then killed)."""
    with warnings.catch_warnings():  # (3.12+ warns about forking a threaded process)
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = int(work())
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return -9
