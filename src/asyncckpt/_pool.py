"""A pool of threads kept for the process's loads: started on demand, never while one is free.

``concurrent.futures.ThreadPoolExecutor`` would do, but for two things a pool shared by
every load of a long-lived process must get right:

* From Python 3.12 on, its count of idle threads falls behind when a thread that just
  finished a task takes the next one before the thread woken for it does: the woken one
  goes back to waiting without being counted again, so later submissions start new
  threads beside idle ones (loads of 2..9 tensors left 14 reader threads, not 7).
* In a child forked after the pool was made, its threads are gone but its count says
  they are idle: a submission waits forever for a thread that does not exist (a forked
  worker that loaded a checkpoint hung). Here a child starts over with a pool of its own.

Threads are daemons: an idle one never holds up the interpreter's exit.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

R = TypeVar("R")
log = logging.getLogger(__name__)


class KeptThreads:
    """Runs submitted calls on kept threads, starting one only when the threads not
    running a call are fewer than the calls waiting (up to ``max_threads``; beyond that,
    calls queue for the next thread to be free)."""

    def __init__(self, max_threads: int, name: str):
        if max_threads < 1:
            raise ValueError(f"max_threads={max_threads}: at least 1")
        self.max_threads = max_threads
        self.name = name
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._tasks: deque[tuple[cf.Future[Any], Callable[..., Any], tuple[Any, ...]]] = deque()
        self._threads = 0
        # Threads running a call. A thread stops counting before it completes the call's
        # future: whoever waits on it and submits again finds the thread free, though it
        # has not gone back to waiting yet (counting it once waiting started new threads
        # beside finishing ones: 16 for calls never more than 8 at a time).
        self._busy = 0
        self._pid = os.getpid()

    @property
    def threads(self) -> int:
        """How many threads the pool has started (all alive: they never exit)."""
        return self._threads

    def submit(self, fn: Callable[..., R], *args: Any) -> cf.Future[R]:
        if os.getpid() != self._pid:  # (a pool carried into a forked child has no threads)
            raise RuntimeError(f"{self.name}: this pool belongs to process {self._pid}")
        fut: cf.Future[R] = cf.Future()
        # (the lock's own ``with``, in C: a Ctrl-C inside Condition.__enter__, a Python
        # call, could land once it held the lock, and leave it held: a review's next load
        # hung in submit)
        with self._lock:
            self._tasks.append((fut, fn, args))
            self._cv.notify()  # (a free thread not waiting yet finds the call when it looks)
            if len(self._tasks) > self._threads - self._busy \
                    and self._threads < self.max_threads:
                t = threading.Thread(target=self._work, daemon=True,
                                     name=f"{self.name}_{self._threads}")
                try:
                    t.start()
                except RuntimeError:  # (can't start new thread: the process is at a limit)
                    if not self._threads:  # no thread would ever run it
                        self._tasks.pop()
                        raise
                else:  # (else the call waits for one of the threads there are)
                    self._threads += 1
        return fut

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._tasks:
                    self._cv.wait()
                fut, fn, args = self._tasks.popleft()
                self._busy += 1
            result: Any = None
            error: BaseException | None = None
            try:
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    result = fn(*args)
                except BaseException as exc:  # (the caller's to see, through the future)
                    error = exc
            finally:
                with self._cv:
                    self._busy -= 1
            if error is None:
                fut.set_result(result)
            else:
                fut.set_exception(error)
            del fut, fn, args, result, error  # (nothing of a call outlives it here)


def run_beside(pool: Any, first: Callable[[], R], others: Sequence[Callable[[], R]],
               stop: Callable[[], None]) -> list[R]:
    """``first()`` on this thread and each of ``others`` on ``pool``'s threads (anything
    with ``submit``); their results, in order, once every one is done. Raises the
    first's error, else the first other's (in order).

    Never returns or raises while one of ``others`` still runs, not even on a Ctrl-C:
    those calls write where the caller is about to look (a review's Ctrl-C let a load
    return while reader threads still wrote into the caller's tensors, and a save return
    while a copier still wrote the arena its next save reused). Once ``first`` fails, or
    a Ctrl-C comes, ``stop()`` is called (the others must then end soon), those not
    started yet are skipped, even one whose submission the Ctrl-C interrupted, and those
    running are waited out; a Ctrl-C during that wait is held and raised once they are.
    Calls the pool refuses (the interpreter is exiting) run on this thread, after
    ``first``.
    """
    lock = threading.Lock()
    closed = [False]
    running: list[threading.Lock] = []  # the ``done`` of each call that started
    n = len(others)
    out: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n

    # Each call's ``done`` is a plain lock, held until the call ends: waited for by
    # ``with done: pass``, in C. (cf.wait and Event.wait take their locks in Python: a
    # review's Ctrl-C 20 us apart landed inside them and left one held, the next wait
    # hung for ever.)
    def call(i: int, done: threading.Lock) -> None:
        try:
            with lock:
                if closed[0]:
                    return  # (stopped before it started: skipped)
                running.append(done)
            try:
                out[i] = others[i]()
            except BaseException as exc:  # (the caller's to see)
                errors[i] = exc
        finally:
            with contextlib.suppress(RuntimeError):  # (released once)
                done.release()

    def close() -> None:
        with lock:
            closed[0] = True
        stop()

    dones: list[threading.Lock] = []
    refused: list[int] = []
    try:
        for i in range(n):
            if not refused:
                done = threading.Lock()
                done.acquire()
                try:
                    pool.submit(call, i, done)
                except RuntimeError:  # (the interpreter is exiting: this thread runs it)
                    done.release()
                else:
                    dones.append(done)
                    continue
            refused.append(i)
        result = first()
        for i in refused:
            out[i] = others[i]()
    except BaseException:
        _to_the_end(close)
        _wait_all(lambda: _through_all(lock, running), None)
        raise  # (this error, not a Ctrl-C held meanwhile: it is the cause)
    held = _wait_all(lambda: [functools.partial(_through, d) for d in dones], close)
    if held is not None:
        raise held
    for exc in errors:
        if exc is not None:
            raise exc
    return [result, *out]


def _through(done: threading.Lock) -> None:
    """Wait until ``done`` is released (its call ended)."""
    with done:
        pass


def _through_all(lock: threading.Lock, running: list[threading.Lock]
                 ) -> list[Callable[[], object]]:
    with lock:
        return [functools.partial(_through, d) for d in running]


def _to_the_end(fn: Callable[[], object]) -> None:
    """``fn()``, run again if a Ctrl-C cuts it short (it must be idempotent); an error of
    its own is logged, never in the way of the waits that follow it."""
    while True:
        try:
            fn()
            return
        except KeyboardInterrupt:
            pass
        except Exception:
            log.exception("stopping the threads of a load or save failed; waiting for them")
            return


def _wait_all(waits: Callable[[], Sequence[Callable[[], object]]],
              on_interrupt: Callable[[], None] | None) -> BaseException | None:
    """Run each of ``waits()`` to its end: a Ctrl-C (or what a signal handler raises, a
    SystemExit of SIGTERM's) does not end one but is held (the first one, returned), and
    calls ``on_interrupt`` once. (The waits are made inside the guarded loop too: a review
    sent Ctrl-Cs 20 us apart, and one landed while they were made. Pure Python leaves a
    few bytecodes between one handler and the next try: two Ctrl-Cs within microseconds
    of each other may still land there.)"""
    held: BaseException | None = None
    todo: list[Callable[[], object]] | None = None
    while todo is None or todo:
        try:
            if todo is None:
                todo = list(waits())
            while todo:
                todo[0]()
                todo.pop(0)
        except BaseException as exc:  # (held: the caller raises it)
            if held is None:
                held = exc
                if on_interrupt is not None:
                    _to_the_end(on_interrupt)
    return held


_lock = threading.Lock()
_pools: dict[str, KeptThreads] = {}


def kept_threads(name: str, max_threads: int) -> KeptThreads:
    """The process's pool called ``name`` (made on first use)."""
    with _lock:
        pool = _pools.get(name)
        if pool is None:
            pool = _pools[name] = KeptThreads(max_threads, name)
        return pool


def _forget_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # (another thread may have held it at the fork)
    _pools.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
