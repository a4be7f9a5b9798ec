"""The Store protocol's waits, on an in-memory HashStore (no processes needed)."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from asyncckpt.dist import DistContext
from asyncckpt.errors import CheckpointSaveError, CheckpointTimeoutError


def _ctx(timeout_s: float = 30.0) -> DistContext:
    return DistContext(rank=0, world_size=3, store=dist.HashStore(), namespace="t",
                       timeout_s=timeout_s)


def test_gather_returns_every_ranks_value_in_rank_order() -> None:
    ctx = _ctx()
    for r in (2, 0, 1):
        ctx.put(ctx.key("s1", "record", r), {"rank": r})
    assert ctx.gather(("s1", "record"), "records") == {0: {"rank": 0}, 1: {"rank": 1},
                                                      2: {"rank": 2}}


def test_gather_timeout_names_the_silent_ranks() -> None:
    ctx = _ctx(timeout_s=1.0)
    ctx.put(ctx.key("s1", "record", 0), {"rank": 0})
    with pytest.raises(CheckpointTimeoutError, match=r"records of step 1 from rank\(s\) \[1, 2\]"):
        ctx.gather(("s1", "record"), "the records of step 1")


def test_cancelled_gather_gives_up_within_a_slice() -> None:
    ctx = _ctx(timeout_s=60.0)
    failed = threading.Event()
    threading.Timer(0.3, failed.set).start()
    t0 = time.monotonic()
    with pytest.raises(CheckpointSaveError, match=r"stopped waiting for the records.*failed"):
        ctx.gather(("s1", "record"), "the records", cancelled=failed.is_set)
    assert time.monotonic() - t0 < 5.0  # not the 60 s timeout


def test_gather_that_is_never_cancelled_still_completes() -> None:
    ctx = _ctx()
    threading.Timer(0.3, lambda: [ctx.put(ctx.key("s", "done", r), {}) for r in range(3)]).start()
    assert len(ctx.gather(("s", "done"), "dones", cancelled=lambda: False)) == 3
