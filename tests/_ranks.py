"""Ranks as threads of the test process, for the tests that pair checkpointers through
an in-memory Store (the real multi-process ranks are in tests/dist/)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def in_threads(fn: Callable[[int], Any], world: int = 2, timeout: float = 60.0
               ) -> dict[int, Any]:
    """Run ``fn(rank)`` on one thread per rank; return each rank's result or exception.

    A rank still running after ``timeout`` seconds fails the test ("a rank hung")."""
    out: dict[int, Any] = {}

    def main(r: int) -> None:
        try:
            out[r] = fn(r)
        except BaseException as exc:
            out[r] = exc

    threads = [threading.Thread(target=main, args=(r,), daemon=True) for r in range(world)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout)
    assert sorted(out) == list(range(world)), f"a rank hung: ranks {sorted(out)} finished"
    return out


def all_ok(out: dict[int, Any]) -> dict[int, Any]:
    """``out`` of ``in_threads``; the first rank's exception, if any, is raised."""
    for r in sorted(out):
        if isinstance(out[r], BaseException):
            raise out[r]
    return out
