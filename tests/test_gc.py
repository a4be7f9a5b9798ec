"""Pausing the cyclic collector: pauses on several threads nest, and a collector the
caller disabled stays disabled."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest

from asyncckpt._gc import gc_paused


@pytest.fixture(autouse=True)
def restore_gc() -> Iterator[None]:
    was = gc.isenabled()
    yield
    if was:
        gc.enable()
    else:
        gc.disable()


def test_overlapping_pauses_on_two_threads_resume_only_when_both_end() -> None:
    gc.enable()
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    def second() -> None:
        with gc_paused():
            second_in.set()
            assert first_out.wait(10)
            seen["after the first ended"] = gc.isenabled()
        seen["after both ended"] = gc.isenabled()

    with gc_paused():
        first_in.set()
        t = threading.Thread(target=second)
        t.start()
        assert second_in.wait(10)
    first_out.set()
    t.join(10)
    assert seen == {"after the first ended": False, "after both ended": True}


def test_a_collector_the_caller_disabled_stays_disabled() -> None:
    gc.disable()
    with gc_paused():
        with gc_paused():
            pass
        assert not gc.isenabled()
    assert not gc.isenabled()
    gc.enable()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
