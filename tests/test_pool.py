"""The kept threads every load of a process shares (asyncckpt._pool)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from _forks import in_forked_child
from asyncckpt._pool import KeptThreads, kept_threads


def test_calls_run_and_their_errors_come_back() -> None:
    pool = KeptThreads(4, "test-pool")
    assert [f.result(timeout=10) for f in [pool.submit(pow, 2, k) for k in range(6)]] == [
        1, 2, 4, 8, 16, 32]
    with pytest.raises(ZeroDivisionError):
        pool.submit(divmod, 1, 0).result(timeout=10)
    assert pool.submit(len, "abc").result(timeout=10) == 3  # (a failure kept no thread)


def test_threads_start_only_when_none_is_free() -> None:
    """Rounds of 1 to 8 calls at a time, as loads of 1 to 8 groups make, never need more
    than 8 threads. (Python 3.12's ThreadPoolExecutor lost count of its idle threads and
    reached its limit of 64 here; counting a thread free only once it waited again
    reached 16, as the next round came while the last one's threads were finishing.)"""
    pool = KeptThreads(64, "test-pool")

    def work() -> int:
        return sum(range(2000))

    for _ in range(20):
        for n in range(1, 9):
            futures = [pool.submit(work) for _ in range(n)]
            assert [f.result(timeout=10) for f in futures] == [sum(range(2000))] * n
    assert pool.threads <= 8


def test_calls_beyond_the_limit_queue_for_a_free_thread() -> None:
    pool = KeptThreads(2, "test-pool")
    gate = threading.Event()
    running: list[int] = []

    def hold(i: int) -> int:
        running.append(i)
        gate.wait(10)
        return i

    futures = [pool.submit(hold, i) for i in range(5)]
    deadline = time.monotonic() + 10
    while len(running) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    assert len(running) == 2 and pool.threads == 2  # the other three wait
    gate.set()
    assert [f.result(timeout=10) for f in futures] == [0, 1, 2, 3, 4]
    assert pool.threads == 2


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX")
def test_a_forked_child_gets_a_pool_of_its_own() -> None:
    """The parent's threads do not exist in a child: a pool that believed its idle ones
    were there made every multi-threaded load in a forked child wait forever."""
    pool = kept_threads("test-fork-pool", 8)
    assert pool.submit(abs, -1).result(timeout=10) == 1  # an idle thread, in the parent

    def child() -> int:
        mine = kept_threads("test-fork-pool", 8)
        ok = mine is not pool and mine.submit(abs, -3).result(timeout=10) == 3
        try:
            pool.submit(abs, -2)  # the parent's pool, carried over: refused, not a hang
        except RuntimeError as exc:
            return 0 if ok and "belongs to process" in str(exc) else 3
        return 4

    assert in_forked_child(child) == 0
