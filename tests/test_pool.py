"""The kept threads every load of a process shares (asyncckpt._pool)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

import pytest

from _forks import in_forked_child
from asyncckpt._pool import KeptThreads, kept_threads, run_beside


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


def _sigint_main_in(seconds: float) -> None:
    """A real Ctrl-C (SIGINT to the main thread) in ``seconds``: it lands in whatever
    the main thread then waits in, as a user's would."""
    main = threading.main_thread().ident
    assert main is not None and threading.current_thread() is threading.main_thread()
    threading.Timer(seconds, signal.pthread_kill, (main, signal.SIGINT)).start()


def test_run_beside_returns_results_in_order_and_runs_refused_calls_here() -> None:
    class Refusing:  # an executor of an exiting interpreter after its first submission
        def __init__(self) -> None:
            self.pool = KeptThreads(2, "test-beside")
            self.taken = 0

        def submit(self, fn: Callable[..., object], *args: object) -> object:
            if self.taken:
                raise RuntimeError("cannot schedule new futures after interpreter shutdown")
            self.taken += 1
            return self.pool.submit(fn, *args)

    where: list[str] = []

    def at(k: int) -> Callable[[], int]:
        def run() -> int:
            where.append(threading.current_thread().name)
            return k
        return run

    assert run_beside(Refusing(), at(0), [at(1), at(2), at(3)], lambda: None) == [0, 1, 2, 3]
    assert where.count(threading.current_thread().name) == 3  # the first and two refused


def test_run_beside_raises_the_first_error_else_the_first_others() -> None:
    pool = KeptThreads(3, "test-beside")

    def fails(exc: Exception) -> Callable[[], None]:
        def run() -> None:
            raise exc
        return run

    with pytest.raises(KeyError):
        run_beside(pool, fails(KeyError("first")), [fails(ValueError("other"))], lambda: None)
    with pytest.raises(ValueError, match="one"):
        run_beside(pool, lambda: None, [fails(ValueError("one")), fails(ValueError("two"))],
                   lambda: None)


def test_a_failing_first_stops_the_others_and_skips_those_not_started() -> None:
    pool = KeptThreads(1, "test-beside-one")  # one thread: the second call queues behind
    stopped = threading.Event()
    running = threading.Event()
    ran: list[str] = []

    def busy() -> None:
        running.set()
        assert stopped.wait(10)
        time.sleep(0.2)  # (still writing, say, after the stop: waited out)
        ran.append("busy ended")

    def first() -> None:
        assert running.wait(10)
        raise ValueError("bad bytes")

    with pytest.raises(ValueError, match="bad bytes"):
        run_beside(pool, first, [busy, lambda: ran.append("queued ran")], stopped.set)
    ran.append("raised")
    time.sleep(0.2)  # (the queued call had its turn on the pool's thread)
    assert ran == ["busy ended", "raised"]


@pytest.mark.usefixtures("ctrl_c")
def test_a_ctrl_c_in_the_wait_stops_the_others_and_is_raised_once_they_ended() -> None:
    """A review's Ctrl-C in a load's wait for its reader threads made it raise while they
    still wrote into the caller's tensors."""
    pool = KeptThreads(2, "test-beside")
    stopped = threading.Event()
    events: list[str] = []

    def reading() -> None:
        assert stopped.wait(10)  # ends once told to stop, as a load's group does
        time.sleep(0.3)
        events.append("helper ended")

    _sigint_main_in(0.2)
    with pytest.raises(KeyboardInterrupt):
        run_beside(pool, lambda: events.append("first done"), [reading], stopped.set)
    events.append("raised")
    assert events == ["first done", "helper ended", "raised"]


def test_a_ctrl_c_in_a_submission_skips_the_call_it_queued() -> None:
    """A Ctrl-C between the pool queueing a call and the submission returning lost its
    future: the call then ran after the caller had gone (a save's copier wrote into the
    arena the next save filled)."""
    pool = KeptThreads(2, "test-beside")
    ran: list[str] = []
    gate = threading.Event()

    class Interrupted:
        def submit(self, fn: Callable[..., object], *args: object) -> object:
            pool.submit(lambda: (gate.wait(10), fn(*args)))  # queued, then the Ctrl-C
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_beside(Interrupted(), lambda: ran.append("first"), [lambda: ran.append("other")],
                   lambda: None)
    gate.set()
    time.sleep(0.2)
    assert ran == []  # (the first never started; the queued one was skipped)


def test_what_a_signal_handler_raises_in_the_wait_is_held_too(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """(review) A SIGTERM handler's sys.exit() in the wait left at once, the others still
    running and never told to stop."""
    pool = KeptThreads(2, "test-beside")
    stopped = threading.Event()
    events: list[str] = []

    def reading() -> None:
        assert stopped.wait(10)
        time.sleep(0.2)
        events.append("helper ended")

    def on_term(signum: int, frame: object) -> None:
        raise SystemExit(143)

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        main = threading.main_thread().ident
        assert main is not None
        threading.Timer(0.2, signal.pthread_kill, (main, signal.SIGTERM)).start()
        with pytest.raises(SystemExit):
            run_beside(pool, lambda: None, [reading], stopped.set)
        events.append("raised")
    finally:
        signal.signal(signal.SIGTERM, old)
    assert events == ["helper ended", "raised"]


def test_a_stop_that_fails_still_waits_for_the_others(
        caplog: pytest.LogCaptureFixture) -> None:
    pool = KeptThreads(2, "test-beside")
    started, release = threading.Event(), threading.Event()
    events: list[str] = []

    def other() -> None:
        started.set()
        assert release.wait(10)
        events.append("other ended")

    def first() -> None:
        assert started.wait(10)
        threading.Timer(0.3, release.set).start()
        raise ValueError("bad bytes")

    def stop() -> None:
        raise RuntimeError("stop failed")

    with pytest.raises(ValueError, match="bad bytes"):
        run_beside(pool, first, [other], stop)
    events.append("raised")
    assert events == ["other ended", "raised"]
    assert "stopping the threads" in caplog.text
