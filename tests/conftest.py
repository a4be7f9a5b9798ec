"""Shared helpers for the test-suite: exact, bitwise, type-strict comparison of state trees."""

from __future__ import annotations

import math
import signal
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch


def raw_bytes(t: torch.Tensor) -> bytes:
    """The bytes of a tensor's elements in row-major order (bitwise: NaN payloads count)."""
    return bytes(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def assert_same(a: Any, b: Any, path: str = "<root>") -> None:
    """Assert ``a`` and ``b`` are equal *and* of the same types all the way down.

    Dict keys must match in order and type (0 is not "0"), tuples stay tuples, floats
    compare bit for bit (NaN equals NaN, -0.0 differs from 0.0), tensors and arrays
    compare dtype, shape and raw bytes.
    """
    assert type(a) is type(b), f"{path}: type {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        assert raw_bytes(a) == raw_bytes(b), f"{path}: tensor bytes differ"
    elif isinstance(a, (np.ndarray, np.generic)):
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert np.shape(a) == np.shape(b), f"{path}: shape {np.shape(a)} != {np.shape(b)}"
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), f"{path}: bytes differ"
    elif isinstance(a, dict):
        ka, kb = list(a), list(b)
        assert len(ka) == len(kb), f"{path}: keys {ka!r} != {kb!r}"
        for x, y in zip(ka, kb, strict=True):
            assert type(x) is type(y) and x == y, f"{path}: key {x!r} != {y!r}"
            assert_same(a[x], b[y], f"{path}/{x}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}/{i}")
    elif isinstance(a, float):
        if math.isnan(a):
            assert math.isnan(b), f"{path}: {a!r} != {b!r}"
        else:
            assert a.hex() == b.hex(), f"{path}: {a!r} != {b!r}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


@pytest.fixture(scope="session")
def same():
    """The strict tree comparison (session scoped so hypothesis tests may use it)."""
    return assert_same


@pytest.fixture(scope="session")
def tensor_bytes():
    """Bitwise view of a tensor: ``tensor_bytes(t) -> bytes``."""
    return raw_bytes


@pytest.fixture()
def ctrl_c() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt in the main thread, as at a terminal, for a test
    that sends itself one: a shell's background job (CI started so) inherits SIGINT
    ignored, and Python then leaves it ignored."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


@pytest.fixture(autouse=True)
def no_collector_pause_left() -> Iterator[None]:
    """Every test ends with no pause of the garbage collector held (see asyncckpt._gc),
    once its background threads had a few seconds to finish: a pause a code path never
    ends leaves the user's process without cyclic collection for good. A suite run's hung
    rank thread held one and failed ten later tests, far from the cause; this names the
    test that left it, and where the holders stand."""
    import gc
    import sys
    import time
    import traceback

    from asyncckpt import _gc

    yield
    deadline = time.monotonic() + 5.0
    while (_gc._depth or not gc.isenabled()) and time.monotonic() < deadline:
        time.sleep(0.01)
    if _gc._depth or not gc.isenabled():
        frames = sys._current_frames()
        where = ["".join(traceback.format_stack(frames[t])[-4:])
                 for t in list(_gc._held) if t in frames]
        pytest.fail(f"the test left the collector paused (pauses held: {_gc._depth}, "
                    f"collector enabled: {gc.isenabled()}); the holding threads stand at:\n"
                    + "\n".join(where), pytrace=False)
