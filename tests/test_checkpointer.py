"""AsyncCheckpointer: saving, policies, background errors, retention, corruption, crashes."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import errno
import gc
import itertools
import json
import logging
import math
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import safetensors.torch
import torch

import asyncckpt
import asyncckpt.storage
from _faults import GatedCommit, StuckCommit
from asyncckpt import commit
from asyncckpt.manifest import MANIFEST_NAME
from asyncckpt.storage import LocalStorage


def make_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 16, generator=g)).sum().backward()
    opt.step()
    return {"model": model, "optim": opt, "train": {"step": seed, "epoch": 2}}


class GatedStorage(LocalStorage):
    """Local storage whose shard writes wait for a gate, or fail, on cue."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.fail_with: BaseException | None = None

    def write_arena(self, path: Path, buf: memoryview, nbytes: int,
                    ready: Callable[[int], None], direct: bool = True) -> None:
        self.entered.set()
        assert self.gate.wait(30), "test gate never opened"
        if self.fail_with is not None:
            # Fail partway, as a full disk does: some bytes are already on disk.
            with open(path, "wb") as f:
                f.write(bytes(buf[:min(nbytes, 4096)]))
            raise self.fail_with
        super().write_arena(path, buf, nbytes, ready, direct)


def tensors_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_async_save_loads_back(tmp_path: Path) -> None:
    state = make_state(1)
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async") as ckpt:
        info = ckpt.save_async(state, step=50).wait()
        assert info.step == 50
        assert info.path == tmp_path / "step_000000050"
        assert info.bytes == (info.path / "rank_00000.safetensors").stat().st_size
        assert 0 < info.blocked_s <= info.durable_s and info.staged_s <= info.durable_s
        loaded = ckpt.load(step=50)
    assert tensors_equal(loaded["model"], state["model"].state_dict())
    assert loaded["train"] == {"step": 1, "epoch": 2}
    assert loaded["optim"]["param_groups"][0]["lr"] == 1e-3


def test_in_sync_mode_the_caller_is_blocked_until_durable(tmp_path: Path) -> None:
    slow = GatedCommit(wait_s=0.3)  # (never opened: the commit waits 0.3 s longer)
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="sync", storage=slow) as ckpt:
        started = time.perf_counter()
        fut = ckpt.save_async({"w": torch.ones(1000)}, step=1)
        took = time.perf_counter() - started
        info = fut.wait()
    assert info.blocked_s >= info.durable_s >= 0.3  # not the copy's time alone
    assert info.blocked_s <= took


def test_in_sync_mode_blocked_s_counts_keep_last_s_removals(tmp_path: Path) -> None:
    """A trial's storage whose removals took 0.5 s (a network filesystem): each sync
    save_async took 0.52 s, and blocked_s said 6 ms (it was taken at the commit)."""

    class SlowRemove(asyncckpt.storage.LocalStorage):
        def remove_tree(self, path: Path) -> None:
            time.sleep(0.4)
            super().remove_tree(path)

    with asyncckpt.AsyncCheckpointer(tmp_path, mode="sync", keep_last=1,
                                     storage=SlowRemove()) as ckpt:
        ckpt.save({"w": torch.ones(1000)}, step=1)
        started = time.perf_counter()
        info = ckpt.save_async({"w": torch.ones(1000)}, step=2).wait()
        took = time.perf_counter() - started
        assert ckpt.steps() == [2]
    assert took >= 0.4 and 0.4 <= info.blocked_s <= took, (info, took)
    assert info.durable_s < 0.4  # (committed before the removal)


def test_a_load_logs_what_it_read_and_how_fast(tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    state = {"w": torch.ones(250_000), "n": 3}  # 1 MB
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="sync") as ckpt:
        ckpt.save(state, step=4)
        with caplog.at_level("INFO", logger="asyncckpt"):
            ckpt.load(state)
            ckpt.load(step=4, verify=False)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loaded ")]
    step_dir = tmp_path / "step_000000004"
    assert len(lines) == 2, lines
    assert re.fullmatch(rf"loaded {re.escape(str(step_dir))} in place: 0\.001 GB of saved "
                        r"chunks in [0-9.]+s \([0-9.]+ GB/s\)", lines[0]), lines[0]
    assert lines[1].startswith(f"loaded {step_dir} as a new tree: 0.001 GB") and lines[1].endswith(
        ", checksums not checked")


class _Stepped(LocalStorage):
    """A storage that holds the save at cue points until the test lets it go: before the
    second piece of the shard file (``piece``), and at the commit's rename (``commit``);
    with ``fail`` set, the second piece fails (a disk error)."""

    def __init__(self) -> None:
        self.at = {k: threading.Event() for k in ("piece", "commit")}
        self.go = {k: threading.Event() for k in ("piece", "commit")}
        self.fail = False

    def _hold(self, cue: str) -> None:
        self.at[cue].set()
        assert self.go[cue].wait(30), f"the test never let {cue} go"

    def write_arena(self, path: Path, buf: memoryview, nbytes: int,
                    ready: Callable[[int], None], direct: bool = True) -> None:
        calls = [0]

        def held(offset: int) -> None:
            ready(offset)
            calls[0] += 1
            if calls[0] == 2:  # (the first piece is written)
                self._hold("piece")
                if self.fail:
                    raise OSError(errno.EIO, "Input/output error")

        super().write_arena(path, buf, nbytes, held, direct)

    def rename(self, src: Path, dst: Path) -> None:
        if commit.is_step_dir_name(dst.name):
            self._hold("commit")
        super().rename(src, dst)


def test_a_save_tells_its_progress(tmp_path: Path) -> None:
    """A long save can be watched: bytes copied and written, and its phase, until the
    commit; a failed save says so."""
    storage = _Stepped()
    state = {"w": torch.arange(12_000_000, dtype=torch.float32)}  # 48 MB: two pieces
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async", storage=storage) as ckpt:
        fut = ckpt.save_async(state, step=1)
        total = fut.progress().total_bytes
        assert storage.at["piece"].wait(30)
        p = fut.progress()  # the copy is over; the first 32 MiB piece is written
        assert (p.phase, p.staged_bytes, p.written_bytes) == ("writing", total, 32 * 2**20), p
        assert 0.5 < p.fraction < 1
        storage.go["piece"].set()
        assert storage.at["commit"].wait(30)
        p = fut.progress()  # written and fsync'd: the rename is left
        assert (p.phase, p.written_bytes) == ("committing", total), p
        assert p.fraction == 0.99  # (not 100% before the commit: a trial's progress bar)
        storage.go["commit"].set()
        info = fut.wait(30)
        p = fut.progress()
        assert (p.phase, p.staged_bytes, p.written_bytes, p.fraction) == (
            "committed", total, total, 1.0)
        assert info.bytes == total == p.total_bytes and p.step == 1
        # a save that fails says so, without raising or marking the failure as seen
        storage.at["piece"].clear()
        storage.fail = True
        fut2 = ckpt.save_async(state, step=2)
        assert storage.at["piece"].wait(30)
        with pytest.raises(asyncckpt.CheckpointError, match="Input/output error"):
            fut2.wait(30)
        assert fut2.progress().phase == "failed"


def test_a_save_in_its_copy_says_staging() -> None:
    """The phase follows the staging progress and the two futures (``overlap=True``
    returns while the copy still runs)."""
    import concurrent.futures as cf

    from asyncckpt.staging import StagingProgress
    from asyncckpt.writer import CheckpointFuture

    progress = StagingProgress()
    durable: cf.Future[Any] = cf.Future()
    staged: cf.Future[None] = cf.Future()
    fut = CheckpointFuture(3, durable, staged, progress, 1000)
    progress.publish(400)
    progress.written = 100  # the writer follows behind the copy
    p = fut.progress()
    assert (p.phase, p.staged_bytes, p.written_bytes, p.fraction) == ("staging", 400, 100, 0.25)
    progress.finish(1000)
    staged.set_result(None)
    assert fut.progress().phase == "writing"
    progress.written = 1000
    assert fut.progress().phase == "committing"
    progress.fail(RuntimeError("rank 1 failed"))
    assert fut.progress().phase == "failed"
    assert not fut.observed


def test_a_save_that_allocates_slowly_suggests_prepare(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncckpt.staging import HostArena

    real = HostArena.__init__

    def slow(self: HostArena, nbytes: int, *, pinned: bool, threads: int = 1) -> None:
        time.sleep(0.3)  # as faulting in gigabytes of fresh memory takes
        real(self, nbytes, pinned=pinned, threads=threads)

    monkeypatch.setattr(HostArena, "__init__", slow)
    hints = lambda: [r for r in caplog.records if "ckpt.prepare(state)" in r.getMessage()]  # noqa: E731
    with caplog.at_level("INFO", logger="asyncckpt"), asyncckpt.AsyncCheckpointer(
            tmp_path, mode="async") as ckpt:
        ckpt.save({"w": torch.ones(1000)}, step=1)
        assert len(hints()) == 1 and "rank=0 step=1: allocating the " in hints()[0].getMessage()
        ckpt.save({"w": torch.ones(1000)}, step=2)  # the buffer is kept: no allocation
        bigger = {"w": torch.ones(5_000_000)}
        ckpt.prepare(bigger, background=False)  # grown, but allocated ahead
        ckpt.save(bigger, step=3)
        assert len(hints()) == 1


def test_two_saves_in_a_row_both_land(tmp_path: Path) -> None:
    s1, s2 = make_state(1), make_state(2)
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async_pinned") as ckpt:
        f1 = ckpt.save_async(s1, step=1)
        f2 = ckpt.save_async(s2, step=2)  # waits for step 1 first (on_busy="wait")
        f2.wait()
        assert f1.done() and f1.exception() is None
        assert ckpt.steps() == [1, 2]
        assert ckpt.load(step=1)["train"]["step"] == 1
        assert tensors_equal(ckpt.load(step=2)["model"], s2["model"].state_dict())


def test_async_pinned_without_cuda_says_it_stages_into_ordinary_memory(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (documented, but a trial found only host_buffer_pinned to tell it)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.INFO, logger="asyncckpt"):
        with asyncckpt.AsyncCheckpointer(tmp_path / "a", mode="async_with_pinned_mem") as ck:
            ck.save({"w": torch.ones(4)}, step=1)
            assert not ck.host_buffer_pinned
        with asyncckpt.AsyncCheckpointer(tmp_path / "b", mode="async"):
            pass
    said = [r.getMessage() for r in caplog.records if "without CUDA" in r.getMessage()]
    assert said == ["mode='async_with_pinned_mem' without CUDA: the saves stage into ordinary "
                    "(pageable) host memory, as mode='async' does"], said


def test_sync_and_async_write_the_same_bytes(tmp_path: Path) -> None:
    state = make_state(3)
    asyncckpt.AsyncCheckpointer(tmp_path / "a", mode="sync").save(state, step=7)
    with asyncckpt.AsyncCheckpointer(tmp_path / "b", mode="async_with_pinned_mem") as ckpt:
        ckpt.save_async(state, step=7).wait()
    a = (tmp_path / "a/step_000000007/rank_00000.safetensors").read_bytes()
    b = (tmp_path / "b/step_000000007/rank_00000.safetensors").read_bytes()
    assert a == b
    ma = json.loads((tmp_path / "a/step_000000007" / MANIFEST_NAME).read_text())
    mb = json.loads((tmp_path / "b/step_000000007" / MANIFEST_NAME).read_text())
    assert ma["tensors"] == mb["tensors"] and ma["skeleton"] == mb["skeleton"]


def test_sync_mode_is_durable_on_return(tmp_path: Path) -> None:
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="disabled") as ckpt:
        fut = ckpt.save_async(make_state(), step=3)
        assert fut.done()
        assert ckpt.steps() == [3]
        assert not ckpt.is_pending


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_save_has_applied_keep_last_on_return(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              mode: str) -> None:
    # (in the async modes, save() returned once committed: the old step was still listed,
    # and on the disk, in 23 of 30 saves)
    import time

    from asyncckpt import commit

    real = commit.doomed_steps
    real_remove = asyncckpt.storage.LocalStorage.remove_tree

    def slow(*args: object, **kwargs: object) -> list[int]:
        time.sleep(0.05)  # retention runs on the writer thread, after the commit
        return real(*args, **kwargs)  # type: ignore[arg-type]

    def slow_remove(self: Any, path: Path) -> None:
        time.sleep(0.05)  # the files go on the reaper thread, after that
        real_remove(self, path)

    monkeypatch.setattr(commit, "doomed_steps", slow)
    monkeypatch.setattr(asyncckpt.storage.LocalStorage, "remove_tree", slow_remove)
    with asyncckpt.AsyncCheckpointer(tmp_path, mode=mode, keep_last=1) as ckpt:
        for step in range(1, 4):
            ckpt.save({"w": torch.ones(4)}, step=step)
            assert ckpt.steps() == [step]
            assert sorted(p.name for p in tmp_path.iterdir() if p.name != ".asyncckpt.lock"
                          ) == [f"step_{step:09d}"]


@pytest.mark.parametrize("kwargs", [{"mode": "fast"}, {"keep_last": 0}, {"on_busy": "skip"},
                                    {"keep_last": 1.5}, {"block_bytes": 1000},
                                    {"keep_every": 0, "keep_last": 2},
                                    {"keep_every": True, "keep_last": 2},
                                    {"keep_every": 1000}])
def test_bad_config_is_a_value_error(tmp_path: Path, kwargs: dict) -> None:
    with pytest.raises(asyncckpt.CheckpointConfigError, match=next(iter(kwargs))) as ei:
        asyncckpt.AsyncCheckpointer(tmp_path, **kwargs)
    assert isinstance(ei.value, ValueError)


def test_bad_step_is_refused(tmp_path: Path) -> None:
    with asyncckpt.AsyncCheckpointer(tmp_path) as ckpt:
        for step in (-1, 1.0, "3", True):
            with pytest.raises(asyncckpt.CheckpointConfigError, match="step"):
                ckpt.save_async(make_state(), step=step)  # type: ignore[arg-type]
        assert ckpt.steps() == []


def test_dropping_the_checkpointer_waits_for_its_save(tmp_path: Path) -> None:
    storage = GatedStorage()
    storage.gate.clear()
    ckpt = asyncckpt.AsyncCheckpointer(tmp_path, storage=storage)
    ckpt.save_async(make_state(), step=1)
    threading.Timer(0.2, storage.gate.set).start()
    del ckpt
    assert asyncckpt.AsyncCheckpointer(tmp_path).steps() == [1]


def test_interpreter_exit_waits_for_the_save_in_flight(tmp_path: Path) -> None:
    code = textwrap.dedent("""
        import sys, torch, asyncckpt
        ckpt = asyncckpt.AsyncCheckpointer(sys.argv[1])
        ckpt.save_async({"w": torch.ones(1 << 22)}, step=9)
        # exits at once, the checkpointer still referenced by a global
    """)
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=120)
    assert torch.equal(asyncckpt.load(tmp_path, step=9)["w"], torch.ones(1 << 22))


def test_a_ctrl_c_at_exit_with_a_save_in_flight_leaves_the_process_free_to_end(
        tmp_path: Path) -> None:
    """A trial: the script ended with a save in flight and the user pressed Ctrl-C once
    while Python waited for it at exit. The checkpointer, collected as Python finalized,
    then waited for a save whose threads Python had stopped: the process never ended."""
    (tmp_path / "slow.py").write_text(textwrap.dedent("""
        import logging, os, time
        from asyncckpt.storage import LocalStorage
        logging.basicConfig(level=logging.WARNING)

        class SlowStorage(LocalStorage):
            delay = 0.0

            def fsync_dir(self, path):
                if os.path.basename(str(path)).startswith(".step_"):
                    time.sleep(self.delay)
                return super().fsync_dir(path)
    """))
    (tmp_path / "main.py").write_text(textwrap.dedent("""
        import os, signal, sys, threading, time, torch, asyncckpt
        import concurrent.futures.thread as pools
        # (Ctrl-C as at a terminal: a shell's background job inherits SIGINT ignored)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.path.insert(0, sys.argv[2])
        from slow import SlowStorage
        state = {"w": torch.arange(1000.0)}
        ckpt = asyncckpt.AsyncCheckpointer(sys.argv[1], mode="async")
        ckpt.save(state, 1)
        ckpt.storage.__class__ = SlowStorage
        ckpt.storage.delay = 30.0
        ckpt.save_async({"w": torch.arange(1000.0) + 1}, 2)

        def ctrl_c_while_exit_waits():  # (once Python's exit hook waits for the pools)
            while not pools._shutdown:
                time.sleep(0.01)
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=ctrl_c_while_exit_waits, daemon=True).start()
        print("in flight", flush=True)
    """))
    root = tmp_path / "ckpt"
    with open(tmp_path / "err", "wb") as err:
        proc = subprocess.Popen([sys.executable, str(tmp_path / "main.py"), str(root),
                                 str(tmp_path)], stdout=subprocess.PIPE, stderr=err)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"in flight\n"
        proc.wait(25)  # (it waited for ever; the save would take 30 s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    said = (tmp_path / "err").read_text()
    assert "step 2 is being written" in said and "stays uncommitted" in said, said
    assert asyncckpt.AsyncCheckpointer(root).steps() == [1]
    assert torch.equal(asyncckpt.load(root)["w"], torch.arange(1000.0))


def test_a_root_deleted_while_a_step_is_written_is_said_so(tmp_path: Path) -> None:
    storage = GatedStorage()
    root = tmp_path / "ck"
    with asyncckpt.AsyncCheckpointer(root, mode="async", storage=storage) as ckpt:
        ckpt.save(make_state(), step=1)
        storage.gate.clear()
        storage.entered.clear()
        fut = ckpt.save_async(make_state(), step=2)
        assert storage.entered.wait(10)
        for attempt in range(100):  # (an operator's rm -rf)
            try:
                shutil.rmtree(root)
                break
            except OSError:  # the hash thread wrote the manifest into it meanwhile (CI)
                assert attempt < 99
                time.sleep(0.05)
        storage.gate.set()
        with pytest.raises(asyncckpt.CheckpointSaveError,
                           match=r"saving step 2 under .* failed( in \S+)?: "
                                 r"FileNotFoundError: .* \(the checkpoint directory was "
                                 r"deleted or moved while the step was written: the next "
                                 r"save makes it again"):
            fut.wait(30)
        ckpt.save(make_state(), step=3)
        assert ckpt.steps() == [3]


def test_a_checkpointer_dropped_by_a_thread_still_running_at_exit_closes_as_ever(
        tmp_path: Path) -> None:
    """(The review: once Python's exit hook shut the pools, a checkpointer a non-daemon
    thread still running dropped was taken for one collected at exit: "stays
    uncommitted" was logged of a step that committed, and it was never closed.)"""
    code = textwrap.dedent("""
        import logging, os, sys, threading, time, torch, asyncckpt
        import concurrent.futures.thread as pools
        from asyncckpt.storage import LocalStorage
        logging.basicConfig(level=logging.WARNING)

        class Slow(LocalStorage):
            def fsync_dir(self, path):
                if os.path.basename(str(path)).startswith(".step_"):
                    time.sleep(1.5)
                return super().fsync_dir(path)

        started = threading.Event()

        def train():
            ckpt = asyncckpt.AsyncCheckpointer(sys.argv[1], mode="async", storage=Slow())
            ckpt.save_async({"w": torch.ones(16)}, 1)
            started.set()
            while not pools._shutdown:  # (main has returned: the exit hook waits)
                time.sleep(0.01)
            print("dropped", flush=True)  # (ckpt collected as this returns, this thread)

        threading.Thread(target=train).start()
        started.wait()
    """)
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                         text=True, timeout=120)
    assert "dropped" in out.stdout and "Python is exiting" not in out.stderr, out
    assert asyncckpt.AsyncCheckpointer(tmp_path).steps() == [1]


def test_a_failed_save_nobody_waited_on_is_logged_when_the_script_ends(tmp_path: Path) -> None:
    # (The review of the fix above: a checkpointer collected as Python finalizes skipped
    # its close, and with it the log of a failed save nobody waited on: silence, exit 0.)
    code = textwrap.dedent("""
        import errno, logging, sys, time, torch, asyncckpt
        from asyncckpt.storage import LocalStorage
        logging.basicConfig(level=logging.WARNING)

        class Failing(LocalStorage):
            def write_arena(self, path, buf, nbytes, ready, direct=True):
                raise OSError(errno.EIO, "injected")

        ckpt = asyncckpt.AsyncCheckpointer(sys.argv[1], storage=Failing())
        fut = ckpt.save_async({"w": torch.ones(4)}, step=1)
        while not fut.done():
            time.sleep(0.01)
        # no wait(), no close(): the global is collected as Python finalizes
    """)
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                         text=True, timeout=120)
    assert "step 1 was not saved, and its future was never waited on" in out.stderr, out
    assert "injected" in out.stderr


class _Eager(LocalStorage):
    """Writes buf[:nbytes] at once, never calling ready()."""

    def write_arena(self, path: Path, buf: memoryview, nbytes: int,
                    ready: Callable[[int], None], direct: bool = True) -> None:
        with open(path, "wb") as f:
            f.write(buf[:nbytes])


class _Padded(LocalStorage):
    """Writes the buffer whole: its padding too."""

    def write_arena(self, path: Path, buf: memoryview, nbytes: int,
                    ready: Callable[[int], None], direct: bool = True) -> None:
        ready(nbytes)
        with open(path, "wb") as f:
            f.write(buf)


class _Short(LocalStorage):
    """Writes 100 bytes less than it was given (a storage trial's was told that
    "something moved or removed it")."""

    def write_arena(self, path: Path, buf: memoryview, nbytes: int,
                    ready: Callable[[int], None], direct: bool = True) -> None:
        ready(nbytes)
        with open(path, "wb") as f:
            f.write(buf[:nbytes - 100])


class _NoFile(LocalStorage):
    """Returns without making the file."""

    def write_arena(self, path: Path, buf: memoryview, nbytes: int,
                    ready: Callable[[int], None], direct: bool = True) -> None:
        ready(nbytes)


@pytest.mark.parametrize(("storage", "says"), [
    (_Eager, r"step 1: _Eager\.write_arena returned without calling ready\(\d+\) \(it got "
             r"to 0\).*nothing was committed"),
    (_Padded, r"_Padded\.write_arena wrote more than it was given \(it must write exactly "
              r"nbytes"),
    (_Short, r"_Short\.write_arena wrote less than it was given \(it must write exactly "
             r"nbytes\)"),
    (_NoFile, r"_NoFile\.write_arena returned without making it"),
])
def test_a_storage_that_breaks_the_write_arena_contract_commits_nothing(
        tmp_path: Path, storage: type[LocalStorage], says: str) -> None:
    """A trial's storage wrote buf[:nbytes] at once, never calling ready(): every save
    "succeeded", and a committed step held a former save's bytes."""
    _first_save_fails(tmp_path, storage(), says)


@pytest.mark.parametrize("call", ["fsync_dir", "write_bytes", "rename"])
def test_a_failed_save_names_the_storage_call_that_failed(tmp_path: Path, call: str) -> None:
    """A storage trial's failures all read "saving step 40 under ... failed: OSError: [Errno
    5] Input/output error": an fsync's EIO names no file, so which call failed was anyone's
    guess."""
    def eio(path: Path) -> None:
        if ".step_" in str(path):
            raise OSError(errno.EIO, "Input/output error")

    class Failing(LocalStorage):  # (each call as a storage author writes it)
        def fsync_dir(self, path: Path) -> None:
            if call == "fsync_dir":
                eio(path)
            super().fsync_dir(path)

        def write_bytes(self, path: Path, data: bytes) -> None:
            if call == "write_bytes":
                eio(path)
            super().write_bytes(path, data)

        def rename(self, src: Path, dst: Path) -> None:
            if call == "rename":
                eio(src)
            super().rename(src, dst)

    _first_save_fails(tmp_path, Failing(),
                      rf"saving step 1 under .* failed in Failing\.{call}\(\S*"
                      rf"\.step_000000001\.tmp-\w+\S*\): OSError: \[Errno 5\]")


def _first_save_fails(root: Path, storage: LocalStorage, says: str) -> None:
    """A first save into ``root`` through ``storage`` raises CheckpointSaveError matching
    ``says``, and commits nothing."""
    with asyncckpt.AsyncCheckpointer(root, mode="async", storage=storage) as ckpt:
        with pytest.raises(asyncckpt.CheckpointSaveError, match=says):
            ckpt.save(make_state(), step=1)
        assert ckpt.steps() == []


def test_a_failed_fd_call_of_a_save_names_the_file_it_was_of(tmp_path: Path) -> None:
    """A storage trial's failed size check read "Failing.file_size(None)": an fd call
    names the fd and the file its caller opened; and a storage that takes ``*args`` names
    the path it was given."""
    class Failing(LocalStorage):
        def file_size(self, fd: int) -> int:
            raise OSError(errno.EIO, "Input/output error")

    class Wrapping(LocalStorage):  # (a storage that passes every call on, as a trial's)
        def write_bytes(self, *args: Any) -> None:
            if args[0].name == "manifest.json":
                raise OSError(errno.EIO, "Input/output error")
            super().write_bytes(*args)

    _first_save_fails(tmp_path, Wrapping(),
                      r"failed in Wrapping\.write_bytes\(\S*\.step_000000001\.tmp-"
                      r"\w+/manifest\.json\): OSError")
    _first_save_fails(tmp_path, Failing(),
                      r"failed in Failing\.file_size\(fd \d+ of \S*\.step_000000001"
                      r"\.tmp-\w+/rank_0+\.safetensors\): OSError: \[Errno 5\]")


def test_on_busy_error_raises_while_in_flight(tmp_path: Path) -> None:
    storage = GatedStorage()
    storage.gate.clear()
    ckpt = asyncckpt.AsyncCheckpointer(tmp_path, on_busy="error", storage=storage)
    fut = ckpt.save_async(make_state(), step=1)
    assert storage.entered.wait(10)
    assert ckpt.is_pending and not fut.done()
    with pytest.raises(asyncckpt.CheckpointInFlightError, match="step 1"):
        ckpt.save_async(make_state(), step=2)
    assert ckpt.steps() == []  # not visible before the commit
    storage.gate.set()
    fut.wait(30)
    ckpt.save_async(make_state(), step=2).wait()
    assert ckpt.steps() == [1, 2]
    ckpt.close()


def test_on_busy_wait_blocks_until_previous_commits(tmp_path: Path) -> None:
    storage = GatedStorage()
    storage.gate.clear()
    ckpt = asyncckpt.AsyncCheckpointer(tmp_path, on_busy="wait", storage=storage)
    f1 = ckpt.save_async(make_state(), step=1)
    assert storage.entered.wait(10)
    threading.Timer(0.3, storage.gate.set).start()
    ckpt.save_async(make_state(), step=2)  # returns only after step 1 finished
    assert f1.done()
    assert ckpt.wait() is not None
    assert ckpt.steps() == [1, 2]
    ckpt.close()


def test_timeouts_name_the_step(tmp_path: Path) -> None:
    storage = GatedStorage()
    storage.gate.clear()
    ckpt = asyncckpt.AsyncCheckpointer(tmp_path, storage=storage)
    fut = ckpt.save_async(make_state(), step=4)
    with pytest.raises(asyncckpt.CheckpointTimeoutError, match="step 4"):
        fut.wait(timeout=0.05)
    storage.gate.set()
    assert fut.wait(30).step == 4
    ckpt.close()


def test_background_error_is_reraised_and_nothing_is_lost(tmp_path: Path) -> None:
    storage = GatedStorage()
    ckpt = asyncckpt.AsyncCheckpointer(tmp_path, storage=storage)
    good = make_state(1)
    ckpt.save(good, step=1)
    storage.fail_with = OSError(errno.ENOSPC, "No space left on device")
    fut = ckpt.save_async(make_state(2), step=2)
    with pytest.raises(asyncckpt.CheckpointSaveError, match=r"step 2.*disk is full") as ei:
        fut.wait()
    assert isinstance(ei.value.__cause__, OSError)
    assert ckpt.wait() is None  # handed over by fut.wait(): not reported again
    with pytest.raises(asyncckpt.CheckpointSaveError, match=r"step 2.*disk is full"):
        ckpt.save(make_state(2), step=2)
    assert ckpt.wait() is None  # nor after a failed save(), at the end of training
    assert ckpt.steps() == [1]
    assert sorted(os.listdir(tmp_path)) == [".asyncckpt.lock", "step_000000001"]  # tmp removed
    assert tensors_equal(ckpt.load(step=1)["model"], good["model"].state_dict())
    storage.fail_with = None  # space is back: the same checkpointer saves again
    ckpt.save(make_state(3), step=3)
    assert ckpt.steps() == [1, 3]
    ckpt.close()


def test_overlapped_staging_stops_before_a_failed_save_resolves(tmp_path: Path) -> None:
    # The write fails at once while overlap=True staging still copies on its thread: the
    # future must not resolve (and free the arena for the next save) until it has stopped.
    class NoTmpDir(LocalStorage):
        fail = True

        def makedirs(self, path: Path) -> None:
            if self.fail and ".tmp-" in Path(path).name:
                raise OSError(errno.ENOSPC, "No space left on device")
            super().makedirs(path)

    storage = NoTmpDir()
    slow = torch.ones(4096, 8192).t()  # 128 MiB, non-contiguous: a slow copy
    zeros = torch.zeros(30 << 20)  # another layout, same arena
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async", storage=storage,
                                     copy_threads=2) as ckpt:
        for step in (1, 3, 5):
            storage.fail = True
            fut = ckpt.save_async({"a": slow}, step=step, overlap=True)
            with pytest.raises(asyncckpt.CheckpointSaveError, match="disk is full"):
                fut.wait(60)
            storage.fail = False
            ckpt.save({"b": zeros}, step=step + 1)
            got = ckpt.load(step=step + 1)["b"]
            assert int(torch.count_nonzero(got)) == 0, f"step {step + 1} holds step {step}'s ones"


def test_retention_spares_the_step_being_loaded(tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    # keep_last=1: the save in flight's retention would delete step 1 while it is read.
    class Hooked(GatedStorage):
        on_open: Callable[[], None] | None = None

        def open_read(self, path: Path) -> int:
            if self.on_open is not None and "step_000000001" in str(path):
                hook, self.on_open = self.on_open, None
                hook()
            return super().open_read(path)

    storage = Hooked()
    big = {"w": torch.arange(1 << 20, dtype=torch.float32)}
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async", keep_last=1,
                                     storage=storage) as ckpt:
        ckpt.save(big, step=1)
        storage.gate.clear()
        fut = ckpt.save_async({"w": torch.zeros(4)}, step=2)

        def retention_runs_now() -> None:  # inside the load of step 1, after it began
            storage.gate.set()
            fut.wait(30)
            assert ckpt._retention is not None
            ckpt._retention.result(30)

        storage.on_open = retention_runs_now
        got = ckpt.load(step=1)
        assert torch.equal(got["w"], big["w"])
        assert ckpt.steps() == [1, 2]  # spared this time
        with caplog.at_level(logging.INFO, logger="asyncckpt"):
            ckpt.save({"w": torch.ones(4)}, step=3)
            ckpt.wait()
        assert ckpt.steps() == [3]  # and removed by the next retention
        # with its own step: no "several steps at once" warning of changed settings (a
        # distributed trial's log after every load that overlapped a save)
        assert "retention removed steps [1, 2]" in caplog.text, caplog.text
        assert "at once" not in caplog.text, caplog.text


def test_an_error_nobody_waited_for_is_logged_and_raised_by_wait(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    storage = GatedStorage()
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async", storage=storage) as ckpt:
        storage.fail_with = OSError(errno.EIO, "injected")
        dropped = ckpt.save_async({"w": torch.ones(4)}, step=1)  # nobody waits on it
        while not dropped.done():  # (polling is not asking for the outcome)
            threading.Event().wait(0.01)
        storage.fail_with = None
        ckpt.save_async({"w": torch.ones(4)}, step=2)
        assert "step 1 was not saved" in caplog.text
        with pytest.raises(asyncckpt.CheckpointSaveError, match="step 1") as info:
            ckpt.wait()  # (after waiting for step 2)
        # (its CheckpointInfo is not returned now, nor by the next wait(): said instead)
        assert info.value.__notes__ == ["the last save, step 2, was committed"]
        assert ckpt.wait() is None and ckpt.steps() == [2]  # reported once
        # a failure its caller saw is not reported again
        storage.fail_with = OSError(errno.EIO, "injected")
        fut = ckpt.save_async({"w": torch.ones(4)}, step=3)
        with pytest.raises(asyncckpt.CheckpointSaveError):
            fut.wait()
        storage.fail_with = None
        ckpt.save({"w": torch.ones(4)}, step=4)
        ckpt.wait()
        assert ckpt.steps() == [2, 4]


def test_an_earlier_failure_outlives_a_wait_timeout_and_joins_a_later_failure(
        tmp_path: Path) -> None:
    storage = GatedStorage()
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async", storage=storage) as ckpt:
        storage.fail_with = OSError(errno.EIO, "injected")
        dropped = ckpt.save_async({"w": torch.ones(4)}, step=1)  # nobody waits on it
        while not dropped.done():
            threading.Event().wait(0.01)
        storage.fail_with = None
        storage.gate.clear()
        ckpt.save_async({"w": torch.ones(4)}, step=2)
        with pytest.raises(asyncckpt.CheckpointTimeoutError):
            ckpt.wait(timeout=0.05)  # step 2 still writing: step 1's failure must stay
        storage.gate.set()
        with pytest.raises(asyncckpt.CheckpointSaveError, match="step 1"):
            ckpt.wait()
        assert ckpt.wait() is None and ckpt.steps() == [2]  # reported once
        # two failures nobody waited on: the one wait() raises names the other too
        storage.fail_with = OSError(errno.EIO, "injected")
        three = ckpt.save_async({"w": torch.ones(4)}, step=3)
        while not three.done():
            threading.Event().wait(0.01)
        ckpt.save_async({"w": torch.ones(4)}, step=4)
        with pytest.raises(asyncckpt.CheckpointSaveError, match="step 4") as got:
            ckpt.wait()
        assert any("step 3" in note for note in getattr(got.value, "__notes__", []))
        storage.fail_with = None


def test_a_signal_while_waiting_for_the_previous_save_keeps_it_pending(tmp_path: Path) -> None:
    # A preemption handler raises on the training thread while save_async waits for the
    # save in flight: that is not the save's failure. It must propagate, and the save
    # must stay pending, or the next save would restage the arena the writer still reads.
    import signal

    class Preempted(Exception):
        pass

    def handler(signum: int, frame: object) -> None:
        raise Preempted

    storage = GatedStorage()
    previous = signal.signal(signal.SIGALRM, handler)
    try:
        with asyncckpt.AsyncCheckpointer(tmp_path, mode="async", storage=storage) as ckpt:
            storage.gate.clear()
            ckpt.save_async({"w": torch.full((1 << 16,), 1.0)}, step=1)
            assert storage.entered.wait(10)
            signal.setitimer(signal.ITIMER_REAL, 0.2)
            with pytest.raises(Preempted):
                ckpt.save_async({"w": torch.full((1 << 16,), 2.0)}, step=2)
            assert ckpt.is_pending  # step 1 is still being written
            storage.gate.set()
            ckpt.save({"w": torch.full((1 << 16,), 3.0)}, step=3)  # waits for step 1 first
            assert ckpt.steps() == [1, 3]
        for step, value in ((1, 1.0), (3, 3.0)):
            got = asyncckpt.load(tmp_path, step=step)["w"]
            assert torch.equal(got, torch.full((1 << 16,), value))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        storage.gate.set()


def test_a_failed_save_releases_its_arena_and_its_checkpointer(tmp_path: Path) -> None:
    # Neither the arena nor the checkpointer (its lock, its threads) may stay alive through
    # a failed save's error, which the future keeps and a traceback links back to frames.
    import gc
    import weakref

    storage = GatedStorage()
    storage.fail_with = OSError(errno.EIO, "injected")
    ckpt = asyncckpt.AsyncCheckpointer(tmp_path, mode="async", storage=storage)
    fut = ckpt.save_async({"w": torch.ones(1 << 16)}, step=1)
    with pytest.raises(asyncckpt.CheckpointSaveError):
        ckpt.wait()
    arena = weakref.ref(ckpt._arena)
    ckpt_ref = weakref.ref(ckpt)
    was = gc.isenabled()
    gc.disable()  # reference counting alone must free them
    try:
        ckpt.close()
        assert arena() is None
        del ckpt
        assert ckpt_ref() is None
    finally:
        if was:
            gc.enable()
    with pytest.raises(asyncckpt.CheckpointSaveError):
        fut.wait()  # the future still reports its failure
    storage.fail_with = None
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async", storage=storage) as again:
        again.save({"w": torch.ones(4)}, step=2)  # the lock was released


def test_a_new_checkpoint_directory_is_made_durable_in_its_parent(tmp_path: Path) -> None:
    class Recording(LocalStorage):
        synced: list[Path] = []

        def fsync_dir(self, path: Path) -> None:
            self.synced.append(Path(path))
            super().fsync_dir(path)

    storage = Recording()
    root = tmp_path / "new" / "run"
    with asyncckpt.AsyncCheckpointer(root, storage=storage) as ckpt:
        ckpt.save({"w": torch.ones(4)}, step=1)
    # every directory it created is durable in its parent, before the commit
    assert storage.synced.index(tmp_path) < storage.synced.index(root)
    assert storage.synced.index(root.parent) < storage.synced.index(root)


def test_a_step_directory_without_manifest_is_named_not_overwritten(tmp_path: Path) -> None:
    with asyncckpt.AsyncCheckpointer(tmp_path) as ckpt:
        ckpt.save({"w": torch.ones(4)}, step=1)
        (tmp_path / "step_000000002").mkdir()
        (tmp_path / "step_000000002" / "notes.txt").write_text("copy in progress")
        with pytest.raises(asyncckpt.CheckpointExistsError, match=r"holds no manifest\.json"):
            ckpt.save({"w": torch.ones(4)}, step=2)
        assert (tmp_path / "step_000000002" / "notes.txt").exists()
        assert ckpt.steps() == [1]
        ckpt.save({"w": torch.ones(4)}, step=3)


def test_an_uncollected_error_survives_prepare_and_is_not_reported_twice(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    storage = GatedStorage()
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async", storage=storage) as ckpt:
        storage.fail_with = OSError(errno.EIO, "injected")
        f1 = ckpt.save_async({"w": torch.ones(4)}, step=1)
        while not f1.done():
            threading.Event().wait(0.01)
        storage.fail_with = None
        ckpt.prepare({"w": torch.ones(8)}, background=False)  # waits for step 1 itself
        ckpt.save_async({"w": torch.ones(8)}, step=2)
        with pytest.raises(asyncckpt.CheckpointSaveError, match="earlier save failed"):
            ckpt.wait()  # prepare's wait did not count as the caller's
        # seen by its caller after the next save began: not raised again
        storage.fail_with = OSError(errno.EIO, "injected")
        f3 = ckpt.save_async({"w": torch.ones(8)}, step=3)
        while not f3.done():
            threading.Event().wait(0.01)
        storage.fail_with = None
        ckpt.save_async({"w": torch.ones(8)}, step=4)
        with pytest.raises(asyncckpt.CheckpointSaveError):
            f3.wait()
        assert ckpt.wait() is not None and ckpt.steps() == [2, 4]
    # closing with a failed save nobody waited on raises it (the caller's last chance)...
    storage.fail_with = OSError(errno.EIO, "injected")
    with (pytest.raises(asyncckpt.CheckpointSaveError, match=r"closing .*nobody waited on"),
          asyncckpt.AsyncCheckpointer(tmp_path / "b", mode="async", storage=storage) as ckpt):
        ckpt.save_async({"w": torch.ones(4)}, step=1)
    assert "closing" not in caplog.text  # (raised: not also logged, said once)
    # ...but never hides the exception that is already ending the block: logged then
    with (pytest.raises(KeyError, match="from the training loop"),
          asyncckpt.AsyncCheckpointer(tmp_path / "c", mode="async", storage=storage) as ckpt):
        ckpt.save_async({"w": torch.ones(4)}, step=1)
        raise KeyError("from the training loop")
    assert not ckpt.is_pending
    assert "closing" in caplog.text and "step 1 was not saved" in caplog.text


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_state_too_big_for_its_header_or_manifest_is_refused_not_committed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    # A trial: 30,000 tensors with 4,000-character keys committed a step no load (and no
    # safetensors reader) opens, whose place retention then took from a good one.
    from asyncckpt import plan, writer

    many = {f"{'k' * 100}{i}": torch.ones(1) for i in range(300)}  # ~49 KB of header
    with asyncckpt.AsyncCheckpointer(tmp_path, mode=mode, keep_last=1) as ckpt:
        ckpt.save({"w": torch.ones(3)}, step=1)
        monkeypatch.setattr(plan, "WRITE_MAX_HEADER_BYTES", 20_000)
        with pytest.raises(asyncckpt.CheckpointConfigError,
                           match=r"rank_00000\.safetensors: the safetensors header listing its "
                                 r"300 tensors would take 49,\d+ bytes, over the 20,000 .*"
                                 "shorten the keys"):
            ckpt.save_async(many, step=2)
        monkeypatch.undo()
        monkeypatch.setattr(writer, "MAX_MANIFEST_BYTES", 5_000)
        with pytest.raises(asyncckpt.CheckpointSaveError,
                           match=r"step 3: its manifest\.json would take [\d,]+ bytes, over "
                                 "the 5,000 a load reads.*not committed"):
            ckpt.save_async(many, step=3).wait()  # (mode="sync" raises at the call)
        monkeypatch.undo()
        assert ckpt.steps() == [1]  # kept: retention ran for neither
        assert {p.name for p in tmp_path.iterdir()} == {".asyncckpt.lock", "step_000000001"}
        assert torch.equal(ckpt.load(step=1)["w"], torch.ones(3))
        ckpt.save(many, step=4)  # within the limits: saved as ever
        assert ckpt.steps() == [4] and len(ckpt.load(step=4)) == 300


def test_a_save_writes_no_header_larger_than_safetensors_reads(tmp_path: Path) -> None:
    import safetensors

    from asyncckpt.plan import WRITE_MAX_HEADER_BYTES

    for n, opens in ((WRITE_MAX_HEADER_BYTES, True), (WRITE_MAX_HEADER_BYTES + 1, False)):
        path = tmp_path / f"h{n}.safetensors"
        with open(path, "wb") as f:
            f.write(n.to_bytes(8, "little") + b"{}" + b" " * (n - 2))
        try:
            with safetensors.safe_open(str(path), "pt") as st:
                assert list(st.keys()) == []
            opened = True
        except Exception as exc:  # (safetensors' own error type)
            assert "header too large" in str(exc), exc
            opened = False
        assert opened is opens, n
        path.unlink()


def test_staging_error_raises_at_once_and_leaves_no_trace(tmp_path: Path) -> None:
    class Exploding:
        def state_dict(self) -> dict:
            raise RuntimeError("boom in state_dict")

        def load_state_dict(self, sd: dict) -> None:
            pass

    with asyncckpt.AsyncCheckpointer(tmp_path) as ckpt:
        with pytest.raises(RuntimeError, match="boom"):
            ckpt.save_async({"x": Exploding()}, step=1)
        with pytest.raises(asyncckpt.UnsupportedLeafError, match="train/when"):
            ckpt.save_async({"train": {"when": object()}}, step=1)
        ckpt.save(make_state(), step=1)
        assert ckpt.steps() == [1]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".step")]


def test_retention_keeps_the_newest(tmp_path: Path) -> None:
    with asyncckpt.AsyncCheckpointer(tmp_path, keep_last=2) as ckpt:
        for step in (10, 20, 30, 40):
            ckpt.save_async(make_state(step), step=step)
        ckpt.wait()
        assert ckpt.steps() == [30, 40]
        assert ckpt.latest_step() == 40
    assert sorted(os.listdir(tmp_path)) == [".asyncckpt.lock", "step_000000030",
                                            "step_000000040"]


def test_retention_keeps_the_multiples_of_keep_every_as_well(tmp_path: Path) -> None:
    """keep_last counts the newest steps, milestones among them; the older steps that
    are multiples of keep_every stay for good."""
    with asyncckpt.AsyncCheckpointer(tmp_path, keep_last=2, keep_every=3) as ckpt:
        for step in range(8):
            ckpt.save_async(make_state(step), step=step)
            ckpt.wait()
            kept = [s for s in range(step + 1) if s >= step - 1 or s % 3 == 0]
            assert ckpt.steps() == kept, step
        assert ckpt.steps() == [0, 3, 6, 7]
        assert ckpt.load(step=3)["train"]["step"] == 3
    # the milestones are kept by the checkpointer that says so, not marked on disk
    with asyncckpt.AsyncCheckpointer(tmp_path, keep_last=1) as ckpt:
        ckpt.save(make_state(8), step=8)
        ckpt.wait()  # (its deletions too)
        assert ckpt.steps() == [8]


def _step_dirs(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith(("step_", ".step_")))


def test_a_step_whose_removal_failed_is_removed_by_a_later_retention(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Only a new checkpointer's clean-up used to retry it: a long run leaked a step's
    # disk space per failed removal.
    class FailsOnce(LocalStorage):
        fails = 1

        def remove_tree(self, path: Path) -> None:
            if ".deleting-" in path.name and self.fails:
                self.fails -= 1
                raise OSError(errno.EBUSY, "Device or resource busy (injected)", str(path))
            super().remove_tree(path)

    caplog.set_level(logging.INFO, logger="asyncckpt.writer")
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="sync", keep_last=1,
                                     storage=FailsOnce()) as ckpt:
        ckpt.save({"w": torch.ones(8)}, step=1)
        ckpt.save({"w": torch.ones(8)}, step=2)  # removing step 1 fails
        left = [n for n in _step_dirs(tmp_path) if n.startswith(".step_000000001.deleting-")]
        assert len(left) == 1 and "could not remove" in caplog.text
        ckpt.save({"w": torch.ones(8)}, step=3)
        assert _step_dirs(tmp_path) == ["step_000000003"]
        assert f"removed {left[0]}" in caplog.text


def test_a_step_hidden_but_not_made_durable_is_removed_all_the_same(tmp_path: Path) -> None:
    # hide_step renamed the step, then the directory fsync failed: retention saw an error
    # and had nothing to remove, and the .deleting- directory stayed.
    class FsyncFailsOnce(LocalStorage):
        armed = tripped = False

        def rename(self, src: Path, dst: Path) -> None:
            super().rename(src, dst)
            self.armed = ".deleting-" in dst.name and not self.tripped

        def fsync_dir(self, path: Path) -> None:
            if self.armed:
                self.armed, self.tripped = False, True
                raise OSError(errno.EIO, "Input/output error (injected)", str(path))
            super().fsync_dir(path)

    storage = FsyncFailsOnce()
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="sync", keep_last=1,
                                     storage=storage) as ckpt:
        ckpt.save({"w": torch.ones(8)}, step=1)
        ckpt.save({"w": torch.ones(8)}, step=2)
        assert storage.tripped
        assert _step_dirs(tmp_path) == ["step_000000002"]


def test_retention_leaves_a_save_in_progress_alone(tmp_path: Path) -> None:
    # A .tmp- directory may be a save being written (another rank's, in a group): only
    # .deleting- ones are retention's to remove.
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="sync", keep_last=1) as ckpt:
        ckpt.save({"w": torch.ones(8)}, step=1)
        writing = tmp_path / ".step_000000009.tmp-0123456789ab"
        writing.mkdir()
        (writing / "rank_00000.safetensors").write_bytes(b"x")
        ckpt.save({"w": torch.ones(8)}, step=2)
        assert (writing / "rank_00000.safetensors").exists()


def test_a_step_that_cannot_be_moved_does_not_keep_the_newer_ones(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # The oldest step is retention's first: its failure ended the whole pass, every save,
    # and keep_last kept nothing from then on (an immutable or mounted step, another
    # user's): the disk filled.
    class Pinned(LocalStorage):
        def rename(self, src: Path, dst: Path) -> None:
            if src.name == "step_000000000":
                raise OSError(errno.EPERM, "Operation not permitted (injected)", str(src))
            super().rename(src, dst)

    caplog.set_level(logging.WARNING, logger="asyncckpt.writer")
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="sync", keep_last=2,
                                     storage=Pinned()) as ckpt:
        for step in range(7):
            ckpt.save({"w": torch.full((4,), float(step))}, step=step)
        ckpt.wait()
        assert ckpt.steps() == [0, 5, 6]
    assert "could not delete step 0" in caplog.text


def test_a_symlinked_step_is_retired_by_removing_the_link(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # rmtree refuses a symbolic link: the renamed link stayed, and every later save
    # warned that it would try again, for ever.
    elsewhere = tmp_path / "elsewhere"
    asyncckpt.save({"w": torch.ones(4)}, elsewhere, step=0)
    root = tmp_path / "run"
    root.mkdir()
    os.symlink(elsewhere / "step_000000000", root / "step_000000000")
    caplog.set_level(logging.WARNING)
    with asyncckpt.AsyncCheckpointer(root, mode="sync", keep_last=1) as ckpt:
        assert ckpt.steps() == [0]
        ckpt.save({"w": torch.zeros(4)}, step=1)
        ckpt.save({"w": torch.zeros(4)}, step=2)
        ckpt.wait()
    assert sorted(os.listdir(root)) == [".asyncckpt.lock", "step_000000002"]
    assert "could not" not in caplog.text and "tries again" not in caplog.text
    # what the link pointed to is not the checkpointer's to delete
    assert torch.equal(asyncckpt.load(elsewhere)["w"], torch.ones(4))


def test_a_lock_file_that_cannot_be_opened_is_a_save_error_naming_it(tmp_path: Path) -> None:
    # (a read-only mount, a directory without write permission, no inode left: the same
    # open) It escaped as a bare OSError, no CheckpointError and no hint.
    asyncckpt.save({"w": torch.ones(4)}, tmp_path, step=0)
    lock = tmp_path / ".asyncckpt.lock"
    lock.unlink(missing_ok=True)
    lock.mkdir()  # open(O_RDWR) of a directory fails: EISDIR
    with pytest.raises(asyncckpt.CheckpointSaveError, match=r"lock file .*\.asyncckpt\.lock"):
        asyncckpt.save({"w": torch.ones(4)}, tmp_path, step=1)
    ckpt = asyncckpt.AsyncCheckpointer(tmp_path)
    with pytest.raises(asyncckpt.CheckpointSaveError, match="lock file"):
        ckpt.save({"w": torch.ones(4)}, step=1)
    ckpt.close()
    assert torch.equal(asyncckpt.load(tmp_path)["w"], torch.ones(4))  # loads need no lock


class _Denied(LocalStorage):
    """Listing ``denied`` fails for lack of permission (root, as the tests run, passes
    every permission check)."""

    def __init__(self, *denied: Path):
        super().__init__()
        self.denied = set(denied)

    def listdir(self, path: Path) -> list[str]:
        if path in self.denied:
            raise PermissionError(errno.EACCES, "Permission denied (injected)", str(path))
        return super().listdir(path)


def test_a_newest_step_this_user_may_not_list_is_no_silent_resume_from_an_older_one(
        tmp_path: Path) -> None:
    # It counted as "no committed step": latest_step() said 0 and load() resumed from
    # step 0 without an error (a warning in the log only).
    asyncckpt.save({"w": torch.zeros(4)}, tmp_path, step=0)
    asyncckpt.save({"w": torch.ones(4)}, tmp_path, step=10)
    storage = _Denied(tmp_path / "step_000000010")
    ckpt = asyncckpt.AsyncCheckpointer(tmp_path, storage=storage)
    for call in (ckpt.steps, ckpt.latest_step, ckpt.load,
                 lambda: ckpt.load({"w": torch.empty(4)}),
                 lambda: ckpt.load({"w": torch.empty(4)}, fallback=True)):
        with pytest.raises(asyncckpt.CheckpointPermissionError,
                           match=r"step_000000010 cannot be listed.*read access") as ei:
            call()
        assert ei.value.path == str(tmp_path / "step_000000010")
    with pytest.raises(asyncckpt.CheckpointPermissionError):
        ckpt.load(step=10)
    assert torch.equal(ckpt.load(step=0)["w"], torch.zeros(4))  # another step: fine
    # A save goes on (the step is another user's problem), and keeps its order checks.
    ckpt.save({"w": torch.full((4,), 2.0)}, step=20)
    ckpt.close()
    assert asyncckpt.AsyncCheckpointer(tmp_path).steps() == [0, 10, 20]


def test_a_newest_step_that_cannot_be_listed_is_refused_unless_falling_back(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    asyncckpt.save({"w": torch.zeros(4)}, tmp_path, step=0)
    os.symlink("step_000000010", tmp_path / "step_000000010")  # a loop: ELOOP
    ckpt = asyncckpt.AsyncCheckpointer(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert ckpt.steps() == [0]  # listed, with a warning (no permission problem)
    assert "step_000000010" in caplog.text
    with pytest.raises(asyncckpt.CheckpointCorruptError,
                       match=r"step_000000010 cannot be listed.*fallback=True"):
        ckpt.load()
    with pytest.raises(asyncckpt.CheckpointCorruptError, match="step_000000010"):
        ckpt.load(step=10)
    assert torch.equal(ckpt.load({"w": torch.empty(4)}, fallback=True)["w"], torch.zeros(4))
    ckpt.close()


def test_a_root_that_cannot_be_listed_raises_a_checkpoint_error(tmp_path: Path) -> None:
    root = tmp_path / "loop"
    os.symlink("loop", root)
    ckpt = asyncckpt.AsyncCheckpointer(root)
    with pytest.raises(asyncckpt.CheckpointNotFoundError, match="cannot be listed"):
        ckpt.steps()
    with pytest.raises(asyncckpt.CheckpointNotFoundError, match="cannot be listed"):
        ckpt.load()
    # It was refused as "a file" before.
    with pytest.raises(asyncckpt.CheckpointConfigError, match="symbolic link"):
        ckpt.save({"w": torch.ones(4)}, step=0)
    ckpt.close()
    denied = asyncckpt.AsyncCheckpointer(tmp_path, storage=_Denied(tmp_path))
    with pytest.raises(asyncckpt.CheckpointPermissionError, match="cannot be listed"):
        denied.steps()
    denied.close()


def test_a_rollback_discards_the_later_steps_and_saves_go_on(tmp_path: Path) -> None:
    # Loading an older step and training on was refused at the next save ("older than
    # step(s) [20] already committed"), with no way but moving directories by hand.
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="sync") as ckpt:
        for step in (5, 10, 15, 20):
            ckpt.save({"w": torch.full((4,), float(step))}, step=step)
        target = {"w": torch.zeros(4)}
        ckpt.load(target, step=10)
        with pytest.raises(asyncckpt.CheckpointExistsError, match="older than"):
            ckpt.save(target, step=11)
        assert ckpt.discard_steps_after(10) == [15, 20]
        assert ckpt.steps() == [5, 10]
        ckpt.save({"w": torch.full((4,), 15.5)}, step=15)
        assert ckpt.discard_steps_after(15) == []
        assert ckpt.steps() == [5, 10, 15]
        assert torch.equal(ckpt.load()["w"], torch.full((4,), 15.5))
        ckpt.save_async({"w": torch.ones(4)}, step=30)  # in flight: waited for, then gone
        assert ckpt.discard_steps_after(5) == [10, 15, 30]
        with pytest.raises(asyncckpt.CheckpointConfigError, match="step=-1"):
            ckpt.discard_steps_after(-1)
    assert _step_dirs(tmp_path) == ["step_000000005"]
    with pytest.raises(asyncckpt.CheckpointClosedError):
        ckpt.discard_steps_after(0)


def test_a_rollback_that_fails_part_way_says_what_it_deleted(tmp_path: Path) -> None:
    class Stuck(LocalStorage):
        def rename(self, src: Path, dst: Path) -> None:
            if src.name == "step_000000015":
                raise OSError(errno.EBUSY, "Device or resource busy (injected)", str(src))
            super().rename(src, dst)

    with asyncckpt.AsyncCheckpointer(tmp_path, mode="sync", storage=Stuck()) as ckpt:
        for step in (5, 10, 15, 20):
            ckpt.save({"w": torch.ones(4)}, step=step)
        with pytest.raises(asyncckpt.CheckpointSaveError,
                           match=r"failed at step 15: .*busy.*\(deleted: \[20\]\)"):
            ckpt.discard_steps_after(10)
        assert ckpt.steps() == [5, 10, 15]  # newest first: what is left is still in order
        # what it took out of sight before failing is removed all the same (nothing else
        # would remove it until a new checkpointer's clean-up)
        assert _step_dirs(tmp_path) == ["step_000000005", "step_000000010", "step_000000015"]
    never = tmp_path / "never_saved"
    with asyncckpt.AsyncCheckpointer(never) as ckpt:
        assert ckpt.discard_steps_after(0) == []
    assert not never.exists()  # a rollback creates no directory


def test_a_rollback_spares_a_step_a_load_is_reading(tmp_path: Path) -> None:
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="sync") as ckpt:
        for step in (1, 2):
            ckpt.save({"w": torch.ones(4)}, step=step)
        ckpt._in_use.hold(2)  # as a load in another thread does
        with pytest.raises(asyncckpt.CheckpointInFlightError, match=r"step\(s\) \[2\]"):
            ckpt.discard_steps_after(1)
        ckpt._in_use.release(2)
        assert ckpt.steps() == [1, 2]
        assert ckpt.discard_steps_after(1) == [2]


def test_committed_step_cannot_be_overwritten(tmp_path: Path) -> None:
    with asyncckpt.AsyncCheckpointer(tmp_path) as ckpt:
        ckpt.save(make_state(1), step=5)
        with pytest.raises(asyncckpt.CheckpointExistsError, match="step 5"):
            ckpt.save_async(make_state(2), step=5)
        assert ckpt.load(step=5)["train"]["step"] == 1


@pytest.mark.parametrize("keep_last", [None, 2])
def test_a_step_older_than_a_committed_one_is_refused(tmp_path: Path,
                                                      keep_last: int | None) -> None:
    # After a rollback to step 10, saving 11 beside a committed 20 would make every load
    # take the abandoned step 20, and keep_last would delete 11, 12... before it.
    with asyncckpt.AsyncCheckpointer(tmp_path, keep_last=keep_last) as ckpt:
        for step in (10, 20):
            ckpt.save(make_state(step), step=step)
        with pytest.raises(asyncckpt.CheckpointExistsError,
                           match=r"step 11 is older than step\(s\) \[20\]"
                                 r".*discard_steps_after\(11\)"):
            ckpt.save(make_state(11), step=11)
        assert ckpt.steps() == [10, 20]
        ckpt.save(make_state(21), step=21)  # later steps go on as before
        assert ckpt.steps() == [10, 20, 21] if keep_last is None else [20, 21]


def test_a_step_above_without_its_manifest_does_not_count_as_committed(
        tmp_path: Path) -> None:
    with asyncckpt.AsyncCheckpointer(tmp_path) as ckpt:
        ckpt.save(make_state(10), step=10)
        (tmp_path / "step_000000030").mkdir()  # no manifest: no committed step
        ckpt.save(make_state(20), step=20)
        (tmp_path / "step_000000025").mkdir()
        with pytest.raises(asyncckpt.CheckpointExistsError,
                           match=r"step 11 is older than step\(s\) \[20\] already "
                                 r"committed under .*: a load would take step 20\."):
            ckpt.save(make_state(11), step=11)
        ckpt.save(make_state(21), step=21)
        assert ckpt.steps() == [10, 20, 21]


def test_a_save_looks_into_no_step_directory_however_many_are_kept(tmp_path: Path) -> None:
    """The checks before a save list the root once, and a load looks into the step it
    reads only: on a network filesystem each listing is a round trip, and the caller
    would wait for one per step kept."""
    class Counting(LocalStorage):
        thread: int | None = None
        listed: list[str] = []

        def listdir(self, path: Path) -> list[str]:
            if threading.get_ident() == self.thread:
                self.listed.append(Path(path).name)
            return super().listdir(path)

    storage = Counting()
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async", storage=storage) as ckpt:
        for step in range(12):
            ckpt.save({"w": torch.ones(4)}, step=step)
        storage.thread = threading.get_ident()
        fut = ckpt.save_async({"w": torch.ones(4)}, step=12)
        storage.thread = None
        fut.wait()
        assert storage.listed == [tmp_path.name]
        storage.listed.clear()
        storage.thread = threading.get_ident()
        ckpt.load({"w": torch.zeros(4)})  # the latest: only its directory is looked into
        ckpt.load({"w": torch.zeros(4)}, step=3)
    assert set(storage.listed) == {tmp_path.name, "step_000000012", "step_000000003"}


def test_overlap_returns_before_staging_and_matches(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncckpt.checkpointer as mod

    release = threading.Event()
    threads: list[str] = []
    real_stage = mod.stage

    def gated_stage(*args: object, **kwargs: object) -> None:
        threads.append(threading.current_thread().name)
        assert release.wait(30)
        real_stage(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(mod, "stage", gated_stage)
    state = make_state(4)
    with asyncckpt.AsyncCheckpointer(tmp_path) as ckpt:
        fut = ckpt.save_async(state, step=1, overlap=True)
        assert not fut.staged() and not fut.done()  # returned while staging is held
        with pytest.raises(asyncckpt.CheckpointTimeoutError, match="staging"):
            fut.wait_staged(0.05)
        release.set()
        fut.wait_staged(30)
        fut.wait(30)
        assert threads and threads[0] != threading.current_thread().name
        assert tensors_equal(ckpt.load(step=1)["model"], state["model"].state_dict())


@pytest.mark.parametrize("copy_threads", [1, 2])
def test_overlap_refuses_tensors_changed_before_they_were_staged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, copy_threads: int) -> None:
    # optimizer.step() before fut.wait_staged(): the copy may mix old and new values, and
    # the checksums would bless it. The save must fail instead, naming the tensor.
    import asyncckpt.checkpointer as mod

    release = threading.Event()
    real_stage = mod.stage

    def gated_stage(*args: object, **kwargs: object) -> None:
        assert release.wait(30)
        real_stage(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(mod, "stage", gated_stage)
    state = {"w": torch.zeros(1 << 16), "b": torch.zeros(8), "n": np.zeros(4)}
    with asyncckpt.AsyncCheckpointer(tmp_path, copy_threads=copy_threads) as ckpt:
        fut = ckpt.save_async(state, step=1, overlap=True)
        state["w"].add_(1.0)  # in place, while the copy has not even begun
        release.set()
        with pytest.raises(asyncckpt.CheckpointSaveError, match=r"'w' were changed in place.*"
                           r"wait_staged\(\)"):
            fut.wait(30)
        assert ckpt.steps() == []
        # used as documented, the same save goes through
        fut = ckpt.save_async(state, step=2, overlap=True)
        fut.wait_staged(30)
        state["w"].add_(1.0)
        fut.wait(30)
        assert torch.equal(ckpt.load(step=2)["w"], torch.ones(1 << 16))


def test_a_step_directory_is_refused_as_the_directory_to_save_into(tmp_path: Path) -> None:
    # CheckpointInfo.path (or what `ls` prints) passed where the root belongs: the new
    # steps went inside the committed one, unseen, and its retention deleted them.
    root = tmp_path / "run"
    with asyncckpt.AsyncCheckpointer(root, keep_last=1) as ckpt:
        info = ckpt.save({"w": torch.ones(2)}, step=5)
    before = sorted(p.name for p in info.path.iterdir())
    for where in (info.path, info.path / "sub", root / "step_000000007"):
        ck = asyncckpt.AsyncCheckpointer(where)
        with pytest.raises(asyncckpt.CheckpointConfigError,
                           match=r"step directory.*pass the checkpoint root") as exc:
            ck.save({"w": torch.zeros(2)}, step=6)
        assert str(root) in str(exc.value)
        ck.close()
        assert not where.exists() or where == info.path
    assert sorted(p.name for p in info.path.iterdir()) == before  # step 5 untouched
    with asyncckpt.AsyncCheckpointer(root) as ckpt:
        assert ckpt.steps() == [5]
        assert torch.equal(ckpt.load(step=5)["w"], torch.ones(2))
    # a root that merely has a step-like name, in no checkpoint, is fine
    asyncckpt.save({"w": torch.ones(2)}, tmp_path / "elsewhere" / "step_000000001")


def test_a_load_that_passes_a_newer_step_directory_without_a_manifest_says_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # (no commit leaves one: damage, or a copy cut short; the resume took step 100 and
    # nothing told the user why not step 200)
    with asyncckpt.AsyncCheckpointer(tmp_path) as ckpt:
        for step in (100, 200):
            ckpt.save({"w": torch.full((2,), float(step))}, step=step)
    (tmp_path / "step_000000200" / "manifest.json").unlink()
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        for _ in range(2):
            assert torch.equal(asyncckpt.load(tmp_path)["w"], torch.full((2,), 100.0))
    told = [r.getMessage() for r in caplog.records if "no manifest.json" in r.getMessage()]
    assert len(told) == 1, told  # once, not at every load
    assert "step_000000200 has no manifest.json" in told[0], told
    assert "taking step 100, the newest committed one" in told[0], told


class _HeldWrite(asyncckpt.storage.LocalStorage):
    """Writes a save's file only once ``release`` is set (staging runs as usual)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def write_arena(self, *args: Any, **kwargs: Any) -> None:
        assert self.release.wait(30)
        super().write_arena(*args, **kwargs)


@pytest.mark.parametrize("seen_by", ["wait_staged", "the writer"])
def test_overlap_refuses_a_change_made_after_the_copy_but_before_wait_staged(
        tmp_path: Path, seen_by: str) -> None:
    # A change still running as the copy ends is not counted yet (torch bumps the version
    # when the kernel is done): optimizer.step() racing the copy committed rows of both
    # steps. The tensors are checked again when the caller takes them back
    # (wait_staged), or, never taken back, before the commit: a change counted by then
    # fails the save, whatever the timing.
    storage = _HeldWrite()
    w = torch.zeros(1 << 16)
    with asyncckpt.AsyncCheckpointer(tmp_path, storage=storage) as ckpt:
        fut = ckpt.save_async({"w": w}, step=1, overlap=True)
        deadline = time.monotonic() + 30
        while not fut.staged():  # (the write waits: staging alone runs)
            assert time.monotonic() < deadline
            time.sleep(0.005)
        w.add_(1.0)  # the copy is over and passed its own check: the contract is broken
        if seen_by == "wait_staged":
            with pytest.raises(asyncckpt.CheckpointSaveError,
                               match=r"'w' were changed in place after save_async\(overlap="
                                     r"True\) and before fut.wait_staged\(\) returned"):
                fut.wait_staged(30)
        storage.release.set()
        with pytest.raises(asyncckpt.CheckpointSaveError, match=r"before fut\.wait_staged"):
            fut.wait(30)
        assert ckpt.steps() == []
        # taken back first, the tensors are the caller's: the same change is no error
        fut = ckpt.save_async({"w": w}, step=2, overlap=True)
        fut.wait_staged(30)
        w.add_(1.0)
        fut.wait(30)
        assert torch.equal(ckpt.load(step=2)["w"], torch.ones(1 << 16))
    # seen through wait_staged (or fut.wait), the failure is not raised again by close


@pytest.mark.parametrize("alias", ["set_", "from_numpy"])
def test_overlap_refuses_a_change_through_a_tied_alias_with_its_own_counter(
        tmp_path: Path, alias: str) -> None:
    """(a review) Two leaves that are the same view of one memory are stored once, and
    the change check watched the kept tensor alone: an alias with a version counter of
    its own (made with set_(), or torch.from_numpy of one array twice) was changed in
    place before wait_staged() and mixed values were committed, no error."""
    storage = _HeldWrite()
    if alias == "set_":
        a = torch.zeros(1 << 16)
        b = torch.empty(0).set_(a.untyped_storage(), 0, a.shape, a.stride())
    else:
        arr = np.zeros(1 << 16, dtype=np.float32)
        a, b = torch.from_numpy(arr), torch.from_numpy(arr)
    with asyncckpt.AsyncCheckpointer(tmp_path, storage=storage) as ckpt:
        fut = ckpt.save_async({"a": a, "b": b}, step=1, overlap=True)
        deadline = time.monotonic() + 30
        while not fut.staged():  # (the write waits: staging alone runs)
            assert time.monotonic() < deadline
            time.sleep(0.005)
        b.add_(1.0)  # through the alias, before wait_staged(): the contract is broken
        with pytest.raises(asyncckpt.CheckpointSaveError,
                           match=r"'b' were changed in place after save_async"):
            fut.wait_staged(30)
        storage.release.set()
        with pytest.raises(asyncckpt.CheckpointSaveError):
            fut.wait(30)
        assert ckpt.steps() == []
        fut = ckpt.save_async({"a": a, "b": b}, step=2, overlap=True)  # (still tied)
        fut.wait_staged(30)
        fut.wait(30)
        loaded = ckpt.load(step=2)
        assert loaded["a"] is loaded["b"] and torch.equal(loaded["a"], torch.ones(1 << 16))


def test_a_failure_seen_through_wait_staged_is_not_raised_again_by_close(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncckpt.checkpointer as mod

    real_stage = mod.stage
    fail = [True]

    def failing_stage(*args: object, **kwargs: object) -> None:
        if fail[0]:
            raise RuntimeError("device lost (simulated)")
        real_stage(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(mod, "stage", failing_stage)
    with asyncckpt.AsyncCheckpointer(tmp_path) as ckpt:
        fut = ckpt.save_async({"w": torch.ones(4)}, step=1, overlap=True)
        with pytest.raises(RuntimeError, match="device lost"):
            fut.wait_staged(30)  # the caller sees the failure here...
        fail[0] = False
        ckpt.save({"w": torch.ones(4)}, step=2)
    # ...so leaving the block (close) does not raise it again as one nobody saw
    assert ckpt.steps() == [2]


def test_in_place_load_keeps_identity_and_restores_everything(tmp_path: Path) -> None:
    src = make_state(5)
    with asyncckpt.AsyncCheckpointer(tmp_path) as ckpt:
        ckpt.save(src, step=1)
        dst = make_state(6)
        weight = dst["model"][0].weight
        ptr = weight.data_ptr()
        out = ckpt.load(dst)
    assert out is dst
    assert dst["model"][0].weight is weight and weight.data_ptr() == ptr
    assert tensors_equal(dst["model"].state_dict(), src["model"].state_dict())
    assert dst["train"] == {"step": 5, "epoch": 2}
    so, do = src["optim"].state_dict(), dst["optim"].state_dict()
    assert all(tensors_equal(so["state"][i], do["state"][i]) for i in so["state"])


def test_corrupted_byte_is_detected_naming_file_and_tensor(tmp_path: Path) -> None:
    with asyncckpt.AsyncCheckpointer(tmp_path) as ckpt:
        ckpt.save(make_state(), step=1)
        man = ckpt.manifest(1)
    key = "model/2.weight"
    start, end = man.tensors[key].chunks[0].byte_range
    shard = tmp_path / "step_000000001/rank_00000.safetensors"
    with open(shard, "r+b") as f:
        f.seek((start + end) // 2)
        b = f.read(1)
        f.seek((start + end) // 2)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(asyncckpt.CheckpointCorruptError, match=r"rank_00000\.safetensors") as ei:
        asyncckpt.load(tmp_path)
    assert ei.value.key == key and key in str(ei.value)
    assert asyncckpt.load(tmp_path, verify=False)["train"]["step"] == 0  # verify=False reads


def test_truncated_shard_is_detected(tmp_path: Path) -> None:
    asyncckpt.save(make_state(), tmp_path, step=1)
    shard = tmp_path / "step_000000001/rank_00000.safetensors"
    os.truncate(shard, shard.stat().st_size - 10)
    with pytest.raises(asyncckpt.CheckpointCorruptError, match="truncated"):
        asyncckpt.load(tmp_path)


def test_a_first_save_refused_before_writing_leaves_the_directory_free(tmp_path: Path) -> None:
    """A notebook re-run from the top (a trial): the first checkpointer's save of step 0
    into a run at step 100 was refused, yet kept the lock; the traceback kept it alive,
    and the corrected cell's new checkpointer was refused as a second writer."""
    asyncckpt.save(make_state(), tmp_path, step=100)
    first = asyncckpt.AsyncCheckpointer(tmp_path)
    with pytest.raises(asyncckpt.CheckpointExistsError):
        first.save(make_state(), step=0)
    second = asyncckpt.AsyncCheckpointer(tmp_path)  # (first is still alive)
    second.save(make_state(), step=101)
    # a checkpointer that has saved keeps its lock through a refused save
    with pytest.raises(asyncckpt.CheckpointExistsError):
        second.save(make_state(), step=50)
    with pytest.raises(asyncckpt.CheckpointLockedError, match="of this process"):
        first.save(make_state(), step=102)
    second.close()
    first.save(make_state(), step=102)
    first.close()


def test_a_lock_of_this_process_it_cannot_see_is_said_to_be_its_own(tmp_path: Path) -> None:
    """After importlib.reload of every asyncckpt module (IPython's autoreload), a new
    checkpointer cannot see the old one's lock: it blamed "another process" of its own
    pid, whose advice was to stop the kernel."""
    old = asyncckpt.AsyncCheckpointer(tmp_path)
    old.save(make_state(), step=1)
    with mock.patch("asyncckpt.storage._held_locks", weakref.WeakSet()), \
            mock.patch("asyncckpt.checkpointer._DRAIN_GRACE_S", 0.05), \
            pytest.raises(asyncckpt.CheckpointLockedError,
                          match=rf"this process \(pid {os.getpid()}\) holds .* made before its "
                                r"asyncckpt modules were loaded again"):
        asyncckpt.AsyncCheckpointer(tmp_path).save(make_state(), step=2)
    old.close()


def test_the_checkpointer_and_its_futures_show_where_they_stand(tmp_path: Path) -> None:
    """What a notebook displays of ``ckpt`` and ``fut`` (a trial: "<... object at 0x...>",
    alike before and after close())."""
    storage = GatedCommit()
    ck = asyncckpt.AsyncCheckpointer(tmp_path, mode="async", storage=storage)
    assert repr(ck) == f"<AsyncCheckpointer {str(tmp_path.resolve())!r} mode='async': no save yet>"
    fut = ck.save_async(make_state(), step=7)
    assert repr(ck).endswith(": saving step 7>")
    assert re.fullmatch(r"<CheckpointFuture step=7 (staging|writing|committing) \d+% of "
                        r"\d+\.\d kB>", repr(fut)), repr(fut)  # (trial v2: "0.000 GB")
    storage.gate.set()
    fut.wait()
    assert repr(fut) == "<CheckpointFuture step=7 committed>"
    info = fut.wait()  # (its repr: times to the ms, the path as text)
    assert re.fullmatch(rf"CheckpointInfo\(step=7, path='{re.escape(str(info.path))}', "
                        r"bytes=\d+, blocked_s=\d+\.\d{3}, staged_s=\d+\.\d{3}, "
                        r"durable_s=\d+\.\d{3}\)", repr(info)), repr(info)
    assert repr(ck).endswith(": last save step 7 committed>")
    assert ck.wait() is not None and ck.wait() is None  # (handed over once)
    assert repr(ck).endswith(": last save step 7 committed>")  # (review: "no save yet")
    ck.save_async(make_state(), step=8).wait()
    with pytest.raises(asyncckpt.CheckpointExistsError):  # (its previous save settled here)
        ck.save_async(make_state(), step=8)
    assert repr(ck).endswith(": last save step 8 committed>")
    half = asyncckpt.AsyncCheckpointer.__new__(asyncckpt.AsyncCheckpointer)  # (__init__ raised)
    assert repr(half) == "<AsyncCheckpointer '?': not made>"
    ck.close()
    assert repr(ck).endswith(": closed>")
    failing = asyncckpt.AsyncCheckpointer(tmp_path / "f", storage=StuckCommit(tmp_path / "f"))
    failing.save(make_state(), step=1)
    fut = failing.save_async(make_state(), step=2)
    with pytest.raises(asyncckpt.CheckpointSaveError):
        fut.wait()
    assert repr(fut) == f"<CheckpointFuture step=2 failed: {type(fut.exception()).__name__}>"
    assert repr(failing).endswith(": last save step 2 failed>")
    failing.close()


def test_loading_the_latest_beside_its_own_save_in_flight_is_warned_of(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A notebook trial's ckpt.load() right after save_async(step=5) gave step 4 without
    a word (documented; the checkpointer knows better)."""
    storage = GatedCommit()
    storage.gate.set()
    ck = asyncckpt.AsyncCheckpointer(tmp_path, mode="async", storage=storage)
    ck.save({"w": torch.full((2,), 4.0)}, step=4)
    storage.gate.clear()
    fut = ck.save_async({"w": torch.full((2,), 5.0)}, step=5)
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        assert ck.load()["w"][0] == 4.0
        ck.load(step=4)  # (a step asked for by number: no word)
        for _ in range(3):  # (once per save: a trial's eval loop logged it at every load)
            assert ck.load()["w"][0] == 4.0
    assert caplog.text.count("while this checkpointer's save of step 5 is in flight") == 1
    storage.gate.set()
    fut.wait()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        assert ck.load()["w"][0] == 5.0
    assert "in flight" not in caplog.text
    storage.gate.clear()
    fut = ck.save_async({"w": torch.full((2,), 6.0)}, step=6)
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        ck.load()
        ck.load()
    assert caplog.text.count("while this checkpointer's save of step 6 is in flight") == 1
    storage.gate.set()
    ck.close()


def test_a_holder_of_our_pid_in_another_process_is_not_called_ours(tmp_path: Path) -> None:
    """(review) The lock file holds a pid alone: a container's process of the same pid on
    a shared volume was told it was this process, after a module reload."""
    lock = tmp_path / ".asyncckpt.lock"
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import fcntl, os, sys
            fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.pwrite(fd, b"{os.getpid()}\\n", 0)  # (our pid: another namespace's)
            print("locked", flush=True)
            sys.stdin.read()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "locked"
        with mock.patch("asyncckpt.checkpointer._DRAIN_GRACE_S", 0.05), \
                pytest.raises(asyncckpt.CheckpointLockedError,
                              match=rf"another process \(pid {os.getpid()} \(not this one"):
            asyncckpt.AsyncCheckpointer(tmp_path).save(make_state(), step=1)
    finally:
        child.communicate("", timeout=30)


def test_saving_a_committed_step_again_is_told_the_rollback_that_works(tmp_path: Path) -> None:
    """(trial v2) "save under a new step number or delete that directory first": the
    directory deleted, the save was refused again as older than step 2, and step 1 was
    lost for nothing. The advice now is discard_steps_after, which works."""
    asyncckpt.save({"w": torch.ones(2)}, tmp_path, step=1)
    asyncckpt.save({"w": torch.ones(2)}, tmp_path, step=2)
    with pytest.raises(asyncckpt.CheckpointExistsError,
                       match=re.escape("ckpt.discard_steps_after(0)")):
        asyncckpt.save({"w": torch.zeros(2)}, tmp_path, step=1)
    with asyncckpt.AsyncCheckpointer(tmp_path) as ck:
        assert ck.discard_steps_after(0) == [1, 2]
        ck.save({"w": torch.zeros(2)}, step=1)
    assert torch.equal(asyncckpt.load(tmp_path)["w"], torch.zeros(2))


def test_a_corrupt_latest_step_is_told_of_fallback(tmp_path: Path) -> None:
    """(trial v2) A checksum error said "load an earlier step", and a corrupt manifest
    nothing at all: neither named fallback=True, which does just that."""
    asyncckpt.save({"w": torch.ones(64)}, tmp_path, step=1)
    asyncckpt.save({"w": torch.full((64,), 2.0)}, tmp_path, step=2)
    shard = tmp_path / "step_000000002" / "rank_00000.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-5] ^= 0xFF
    shard.write_bytes(bytes(raw))
    for load in (lambda **kw: asyncckpt.load(tmp_path, **kw),
                 lambda **kw: asyncckpt.AsyncCheckpointer(tmp_path).load(**kw)):
        with pytest.raises(asyncckpt.CheckpointCorruptError) as info:
            load()
        assert "fallback=True" in str(info.value)  # (in the message: a log line's too)
        assert load(fallback=True)["w"][0] == 1.0
        with pytest.raises(asyncckpt.CheckpointCorruptError) as info:
            load(step=2)  # (a step asked for: no other step would do)
        assert "fallback=True" not in str(info.value)
    with pytest.raises(asyncckpt.CheckpointCorruptError) as info:  # (a step directory)
        asyncckpt.load(tmp_path / "step_000000002")
    assert "fallback=True" not in str(info.value)


def test_nothing_committed_is_a_clear_not_found(tmp_path: Path) -> None:
    (tmp_path / ".step_000000003.tmp-abc123").mkdir()
    with pytest.raises(asyncckpt.CheckpointNotFoundError, match="1 incomplete"):
        asyncckpt.load(tmp_path)
    with asyncckpt.AsyncCheckpointer(tmp_path) as ckpt:
        ckpt.save(make_state(), step=1)
        with pytest.raises(asyncckpt.CheckpointNotFoundError, match="committed steps: 1"):
            ckpt.load(step=2)
    assert not (tmp_path / ".step_000000003.tmp-abc123").exists()  # cleaned at first save


class _SlowRemoval(LocalStorage):
    """Removing a tree waits for ``gate`` (a network filesystem's slow deletes)."""

    def __init__(self) -> None:
        self.gate = threading.Event()

    def remove_tree(self, path: Path) -> None:
        self.gate.wait(30)
        super().remove_tree(path)


def test_a_restart_s_first_save_does_not_wait_for_the_killed_run_s_leftovers(
        tmp_path: Path) -> None:
    """(preemption trial) A run killed with a backlog of half-removed steps: the restart's
    first save_async returned after 19 s, removing them on the training thread. They are
    removed on the reaper thread; wait() and close() wait for it."""
    for name in (".step_000000003.tmp-abc123", ".step_000000001.deleting-0123456789ab"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "rank_00000.safetensors").write_bytes(b"x" * 100)
    storage = _SlowRemoval()
    ckpt = asyncckpt.AsyncCheckpointer(tmp_path, mode="async", storage=storage)
    fut = ckpt.save_async(make_state(), step=4)
    fut.wait(30)  # (committed while the removals wait on the gate)
    assert ckpt.steps() == [4]
    assert (tmp_path / ".step_000000003.tmp-abc123").exists()
    with pytest.raises(asyncckpt.CheckpointTimeoutError, match="still being removed"):
        ckpt.wait(timeout=0.1)
    t0 = time.monotonic()  # (review: close(timeout=) did not wait for it, then hung in join)
    with pytest.raises(asyncckpt.CheckpointTimeoutError, match=r"still being removed.*os\._exit"):
        ckpt.close(timeout=0.2)
    assert time.monotonic() - t0 < 10
    storage.gate.set()
    ckpt.wait(timeout=30)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".step")) == []
    ckpt.close()


def test_close_with_a_timeout_waits_no_longer_for_a_stuck_clean_up(tmp_path: Path) -> None:
    """(review) With the save committed and its retention done, close(timeout=) did not
    wait for the clean-up of a killed run's temporary directory: it hung in the join."""
    (tmp_path / ".step_000000003.tmp-abc123").mkdir()
    storage = _SlowRemoval()
    ckpt = asyncckpt.AsyncCheckpointer(tmp_path, mode="async", storage=storage)
    ckpt.save_async(make_state(), step=4).wait(30)
    with pytest.raises(asyncckpt.CheckpointTimeoutError, match="a killed run left"):
        ckpt.close(timeout=0.2)
    storage.gate.set()
    ckpt.close(timeout=30)
    assert not (tmp_path / ".step_000000003.tmp-abc123").exists()


def test_second_writer_on_one_directory_is_refused(tmp_path: Path) -> None:
    a = asyncckpt.AsyncCheckpointer(tmp_path)
    b = asyncckpt.AsyncCheckpointer(tmp_path)
    a.save(make_state(), step=1)
    with pytest.raises(asyncckpt.CheckpointLockedError,
                       match=r"another AsyncCheckpointer of this process, made at "
                             r"test_checkpointer\.py:\d+, holds .*close") as info:
        b.save(make_state(), step=2)
    assert info.value.holder is a  # (a notebook's way to one no name reaches)
    back = pickle.loads(pickle.dumps(info.value))  # (from a worker process: no holder)
    assert str(back) == str(info.value) and back.holder is None
    # ... and at start-up, by prepare() (a trial's second trainer learned it at its first
    # save, an hour of training later)
    with pytest.raises(asyncckpt.CheckpointLockedError, match="of this process, made at"):
        b.prepare(make_state())
    assert b.load(step=1)["train"]["step"] == 0  # reading needs no lock
    a.close()
    b.save(make_state(), step=2)
    b.close()
    # the same directory under another name (a symlink) is still this process's
    (tmp_path.parent / f"{tmp_path.name}-link").symlink_to(tmp_path)
    c = asyncckpt.AsyncCheckpointer(tmp_path.parent / f"{tmp_path.name}-link")
    c.save(make_state(), step=3)
    with pytest.raises(asyncckpt.CheckpointLockedError, match="of this process"):
        asyncckpt.AsyncCheckpointer(tmp_path).save(make_state(), step=4)
    c.close()
    # another process: named by its pid (and host: a pid alone names no process of a
    # fleet sharing one filesystem)
    lock = tmp_path / ".asyncckpt.lock"
    assert lock.read_text().split() == [str(os.getpid()), socket.gethostname()]
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import fcntl, os, sys, time
            fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.pwrite(fd, f"{{os.getpid()}}\\n".encode(), 0)  # (not truncated)
            print("locked", flush=True)
            sys.stdin.read()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "locked"
        with (pytest.raises(asyncckpt.CheckpointLockedError,
                            match=f"another process \\(pid {child.pid} on host "),
              asyncckpt.AsyncCheckpointer(tmp_path) as c):
            c.save(make_state(), step=3)
    finally:
        child.communicate("", timeout=30)


def test_close_waits_and_refuses_later_saves(tmp_path: Path) -> None:
    storage = GatedStorage()
    storage.gate.clear()
    ckpt = asyncckpt.AsyncCheckpointer(tmp_path, storage=storage)
    fut = ckpt.save_async(make_state(), step=1)
    threading.Timer(0.2, storage.gate.set).start()
    ckpt.close()
    assert fut.done() and ckpt.steps() == [1]
    with pytest.raises(asyncckpt.CheckpointClosedError):
        ckpt.save_async(make_state(), step=2)


def test_close_with_a_timeout_leaves_a_hung_save_open_and_closes_once_it_ends(
        tmp_path: Path) -> None:
    """A save stuck on its storage (a dead mount) held close() for ever: close(timeout=)
    raises CheckpointTimeoutError naming the step, and the checkpointer stays usable."""
    storage = GatedStorage()
    storage.gate.clear()
    ckpt = asyncckpt.AsyncCheckpointer(tmp_path, storage=storage)
    for bad in (-1, float("nan"), "3", True):
        with pytest.raises(asyncckpt.CheckpointConfigError, match=r"close\(timeout="):
            ckpt.close(timeout=bad)  # type: ignore[arg-type]
    fut = ckpt.save_async(make_state(), step=1)
    # (second operations trial: wait(timeout=True) said "not durable after Trues"; a str
    # raised a bare TypeError)
    for call, name in ((ckpt.wait, "wait"), (fut.wait, "wait"), (fut.wait_staged,
                                                                  "wait_staged")):
        for bad in (-1, float("nan"), "3", True):
            with pytest.raises(asyncckpt.CheckpointConfigError, match=rf"{name}\(timeout="):
                call(timeout=bad)  # type: ignore[operator]
    with pytest.raises(asyncckpt.CheckpointTimeoutError, match=r"not durable after 0.05s \(still "
                                                               r"(writing|committing)"):
        fut.wait(timeout=0.05)
    t0 = time.monotonic()
    with pytest.raises(asyncckpt.CheckpointTimeoutError, match=r"step 1 is still being saved.*"
                                                               r"stays open"):
        ckpt.close(timeout=0.2)
    assert 0.15 < time.monotonic() - t0 < 5.0
    assert not fut.done() and repr(ckpt).endswith(": saving step 1>")
    storage.gate.set()
    ckpt.close(timeout=30)
    assert fut.done() and ckpt.steps() == [1]
    with pytest.raises(asyncckpt.CheckpointClosedError):
        ckpt.save_async(make_state(), step=2)
    ckpt.close(timeout=0)  # (closed: nothing to wait for)
    # a failure nobody waited on is raised by close(timeout=) as by close()
    failing = asyncckpt.AsyncCheckpointer(tmp_path / "f", storage=StuckCommit(tmp_path / "f"))
    failing.save(make_state(), step=1)
    failing.save_async(make_state(), step=2)
    with pytest.raises(asyncckpt.CheckpointSaveError):
        failing.close(timeout=30)


def test_a_checkpointer_made_before_init_process_group_refuses_to_save_in_a_group(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """(distributed trial) Made before init_process_group, a checkpointer saved as one
    process: rank 1 committed its own state as the job's step, and rank 0 was told
    "another process" held the lock. Its first save in a group of 2 now says why."""
    import torch.distributed as dist

    from asyncckpt import checkpointer as checkpointer_module

    early = asyncckpt.AsyncCheckpointer(tmp_path / "early")
    alone = asyncckpt.AsyncCheckpointer(tmp_path / "alone", rank=0, world_size=1)
    monkeypatch.setattr(checkpointer_module, "_group_up", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    with pytest.raises(asyncckpt.CheckpointConfigError,
                       match=r"made before torch\.distributed\.init_process_group.*of 2 ranks"):
        early.save(make_state(), step=1)
    for call in (lambda: early.prepare(make_state()), lambda: early.discard_steps_after(0)):
        with pytest.raises(asyncckpt.CheckpointConfigError, match=r"made before torch"):
            call()  # (review: prepare's lock error named "another process", as before)
    assert not (tmp_path / "early" / "step_000000001").exists()
    alone.save(make_state(), step=1)  # (one process's by choice: saves)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    early.save(make_state(), step=1)  # (a group of one: nothing lost)
    early.close()
    alone.close()


class _FailsOnce(LocalStorage):
    """The first shard file written fails with ENOSPC; every later one is written."""

    def __init__(self) -> None:
        self.failed = False

    def write_arena(self, path: Path, *args: Any, **kwargs: Any) -> Any:
        if not self.failed:
            self.failed = True
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write_arena(path, *args, **kwargs)


def test_the_preemption_recipe_s_final_save_survives_an_earlier_unwaited_failure(
        tmp_path: Path) -> None:
    """(preemption trial) api.md's recipe called ckpt.wait() first, which raised a failure
    of 1,300 steps before, so the final save never ran. The recipe's save_async(...).wait()
    commits the step; the old failure is still raised, by close()."""
    ckpt = asyncckpt.AsyncCheckpointer(tmp_path, mode="async", storage=_FailsOnce())
    ckpt.save_async(make_state(), step=1)  # fails; nobody waits on its future
    ckpt.save_async(make_state(), step=2)
    assert ckpt.latest_step() != 3
    info = ckpt.save_async(make_state(), step=3).wait()  # (the recipe's final save)
    assert info.step == 3 and ckpt.steps() == [2, 3]
    with pytest.raises(asyncckpt.CheckpointSaveError, match="step 1"):
        ckpt.close()


def test_a_save_waiting_long_for_the_one_in_flight_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """(second operations trial) A save hung on a dead mount held the next save_async, and
    the training loop with it, silently until the scheduler's SIGKILL."""
    from asyncckpt import checkpointer as checkpointer_module

    monkeypatch.setattr(checkpointer_module, "BUSY_SAY_S", 0.2)
    storage = GatedStorage()
    storage.gate.clear()
    ckpt = asyncckpt.AsyncCheckpointer(tmp_path, storage=storage)
    ckpt.save_async(make_state(), step=1)
    threading.Timer(1.0, storage.gate.set).start()
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        ckpt.save_async(make_state(), step=2).wait(30)
    said = [r.getMessage() for r in caplog.records if "has waited" in r.getMessage()]
    assert said and "for the save of step 1, still" in said[0] and "os._exit()" in said[0]
    assert 1 <= len(said) <= 4  # (again each time the wait doubles)
    ckpt.close()


def test_one_shot_helpers_accept_root_or_step_dir(tmp_path: Path) -> None:
    state = make_state(8)
    info = asyncckpt.save(state, tmp_path / "final")
    fresh = make_state(9)
    asyncckpt.load(info.path, fresh)
    assert tensors_equal(fresh["model"].state_dict(), state["model"].state_dict())
    assert asyncckpt.load(tmp_path / "final")["train"]["step"] == 8


def test_arena_is_reused_across_saves(tmp_path: Path) -> None:
    with asyncckpt.AsyncCheckpointer(tmp_path) as ckpt:
        state = make_state()
        ckpt.save(state, step=1)
        arena = ckpt._arena
        assert arena is not None
        ckpt.save(state, step=2)
        assert ckpt._arena is arena  # same layout: no new allocation


_KILLED_WRITER = textwrap.dedent("""
    import os, sys, time, torch, asyncckpt
    from asyncckpt.storage import LocalStorage

    class Slow(LocalStorage):
        def write_arena(self, path, buf, nbytes, ready, direct=True):
            def slow_ready(n):
                ready(n)
                if n > 4096:
                    print("WRITING", flush=True)
                    time.sleep(60)
            super().write_arena(path, buf, nbytes, slow_ready, direct)

    root = sys.argv[1]
    state = {"w": torch.arange(1 << 20, dtype=torch.float32), "step": 1}
    asyncckpt.AsyncCheckpointer(root, mode="sync").save(state, step=1)
    ckpt = asyncckpt.AsyncCheckpointer(root, storage=Slow(), direct_io=False)
    state["w"] += 1
    state["step"] = 2
    ckpt.save_async(state, step=2).wait()
""")


def test_writer_killed_mid_save_leaves_previous_checkpoint(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "WRITING"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    names = os.listdir(tmp_path)
    assert "step_000000001" in names and "step_000000002" not in names
    assert any(n.startswith(".step_000000002.tmp-") for n in names)  # the abandoned one
    loaded = asyncckpt.load(tmp_path)
    assert loaded["step"] == 1
    assert torch.equal(loaded["w"], torch.arange(1 << 20, dtype=torch.float32))
    with asyncckpt.AsyncCheckpointer(tmp_path) as ckpt:  # the next writer cleans up
        ckpt.save({"w": torch.zeros(2), "step": 3}, step=3)
        assert ckpt.steps() == [1, 3]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".step")]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_stage_through_pinned_memory(tmp_path: Path) -> None:
    model = torch.nn.Linear(256, 256).cuda()
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async_pinned") as ckpt:
        fut = ckpt.save_async({"model": model}, step=1, overlap=True)
        fut.wait_staged()
        assert ckpt._arena is not None and ckpt._arena.pinned
        fut.wait()
        other = torch.nn.Linear(256, 256).cuda()
        ckpt.load({"model": other})
    assert torch.equal(other.weight, model.weight) and other.weight.is_cuda


def test_a_step_directory_with_another_step_is_not_found(tmp_path: Path) -> None:
    info = asyncckpt.save(make_state(), tmp_path, step=5)
    assert asyncckpt.load(info.path, step=5)["train"]["step"] == 0
    with pytest.raises(asyncckpt.CheckpointNotFoundError, match="step 5, not of step 999"):
        asyncckpt.load(info.path, step=999)


def test_reading_a_missing_directory_creates_nothing(tmp_path: Path) -> None:
    ckpt = asyncckpt.AsyncCheckpointer(tmp_path / "typo")
    assert ckpt.steps() == [] and ckpt.latest_step() is None
    with pytest.raises(asyncckpt.CheckpointNotFoundError, match="no checkpoint directory"):
        ckpt.load()
    assert not (tmp_path / "typo").exists()
    ckpt.save(make_state(), step=1)  # the first save creates it
    assert ckpt.steps() == [1]


def test_rng_state_round_trips_compactly(tmp_path: Path) -> None:
    import random

    import numpy as np

    asyncckpt.save({"rng": asyncckpt.RNGState()}, tmp_path)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.random(), np.random.rand(), torch.rand(3)  # move every generator on
    asyncckpt.load(tmp_path, {"rng": asyncckpt.RNGState()})
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    skeleton = json.loads((tmp_path / "step_000000000" / MANIFEST_NAME).read_text())["skeleton"]
    ints = json.dumps(skeleton).count('"t": "int"')
    assert 0 < ints < 20  # not 625 scalars for Python's generator


def test_fallback_refuses_what_a_load_without_it_refuses(tmp_path: Path) -> None:
    # fallback=True took any directory holding a manifest as a step directory: a save's
    # temporary directory was loaded (uncommitted bytes), and a file raised a bare
    # NotADirectoryError.
    with asyncckpt.AsyncCheckpointer(tmp_path / "run") as ckpt:
        ckpt.save(make_state(1), step=1)
    tmp = tmp_path / "run" / ".step_000000002.tmp-abc"
    shutil.copytree(tmp_path / "run" / "step_000000001", tmp)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for path, why in ((tmp, "the temporary directory of a save that did not commit"),
                      (a_file, "is a file, not a checkpoint directory")):
        for fallback in (False, True):
            with pytest.raises(asyncckpt.CheckpointNotFoundError, match=why):
                asyncckpt.load(path, fallback=fallback)
    assert asyncckpt.load(tmp_path / "run", fallback=True)["train"]["step"] == 1


def test_a_newer_format_stops_a_fallback_load_instead_of_rolling_back(tmp_path: Path) -> None:
    with asyncckpt.AsyncCheckpointer(tmp_path) as ckpt:
        for step in (1, 2):
            ckpt.save(make_state(step), step=step)
        man = ckpt.manifest(2)
    (tmp_path / "step_000000002" / MANIFEST_NAME).write_bytes(
        dataclasses.replace(man, format_version=man.format_version + 1).to_json())
    for load in (lambda: asyncckpt.load(tmp_path, fallback=True),
                 lambda: asyncckpt.load(tmp_path)):
        with pytest.raises(asyncckpt.CheckpointVersionError, match="upgrade") as info:
            load()
        assert not isinstance(info.value, asyncckpt.CheckpointCorruptError)
        assert info.value.path == str(tmp_path / "step_000000002" / MANIFEST_NAME)
    assert asyncckpt.load(tmp_path, step=1)["train"]["step"] == 1


def test_a_fallback_that_ends_on_a_mismatch_says_why_it_fell_back(tmp_path: Path) -> None:
    """Step 2 is corrupt, and step 1 lacks a key the target has: the mismatch alone hid
    that step 2 was tried, and that the targets hold its bytes."""
    asyncckpt.save({"a": torch.full((1000,), 1.0)}, tmp_path, step=1)
    asyncckpt.save({"a": torch.full((1000,), 2.0), "new": torch.full((1000,), 2.0)},
                   tmp_path, step=2)
    shard = tmp_path / "step_000000002" / "rank_00000.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-10] ^= 1
    shard.write_bytes(bytes(raw))
    target = {"a": torch.zeros(1000), "new": torch.zeros(1000)}
    with pytest.raises(asyncckpt.StateMismatchError) as info:
        asyncckpt.load(tmp_path, target, fallback=True)
    msg = str(info.value)
    assert msg.startswith(f"cannot load {tmp_path / 'step_000000001'}")
    assert "newer ones failed: step 2: " in msg and "checksum mismatch" in msg
    assert "targets were loaded in place and may hold parts of those steps" in msg
    assert info.value.missing == ["new"]  # the error's fields are kept
    with pytest.raises(asyncckpt.StateMismatchError) as info:  # nothing newer failed
        asyncckpt.load(tmp_path, target, step=1)
    assert "newer ones failed" not in str(info.value)


def test_retention_does_not_count_a_step_a_fallback_load_found_damaged(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """keep_last=2 over steps 10 and 20, 20 corrupt: a fallback load resumed from 10, and
    the next save's retention deleted 10, keeping [20 (corrupt), 30]. A damaged step is
    not counted now, and goes once older than every step kept."""
    with asyncckpt.AsyncCheckpointer(tmp_path, keep_last=2) as ck:
        for s in (10, 20):
            ck.save({"w": torch.full((1000,), float(s))}, step=s)
    shard = tmp_path / "step_000000020" / "rank_00000.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-10] ^= 1
    shard.write_bytes(bytes(raw))
    with asyncckpt.AsyncCheckpointer(tmp_path, keep_last=2) as ck:
        with caplog.at_level(logging.WARNING, logger="asyncckpt"):
            assert ck.load(fallback=True)["w"][0].item() == 10.0
        assert "step(s) [20] under" in caplog.text and "discard_steps_after" in caplog.text
        ck.save({"w": torch.full((1000,), 30.0)}, step=30)
        assert ck.steps() == [10, 20, 30]  # the intact 10 stays beside 30; 20 for a look
        ck.save({"w": torch.full((1000,), 40.0)}, step=40)
        assert ck.steps() == [30, 40]
    # discarded and saved anew, a damaged step is intact again (a trial's keep_last=2 kept
    # [3, 4, 5], then warned of removing two steps at once)
    shard = tmp_path / "step_000000040" / "rank_00000.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-10] ^= 1
    shard.write_bytes(bytes(raw))
    with asyncckpt.AsyncCheckpointer(tmp_path, keep_last=2) as ck:
        assert ck.load(fallback=True)["w"][0].item() == 30.0
        assert ck.discard_steps_after(30) == [40]
        for s in (40, 41):
            ck.save({"w": torch.full((1000,), float(s))}, step=s)
        assert ck.steps() == [40, 41]
    with asyncckpt.AsyncCheckpointer(tmp_path, keep_last=1) as ck:  # (no fallback: as ever)
        ck.save({"w": torch.ones(2)}, step=50)
        assert ck.steps() == [50]


def _flip_a_byte(step_dir: Path) -> None:
    shard = step_dir / "rank_00000.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-10] ^= 1
    shard.write_bytes(bytes(raw))


class _RacedListing(asyncckpt.storage.LocalStorage):
    """The first listing of the root as readdir may return it while a save commits (a
    rename in) and its keep_last retention hides the step before (a rename out): neither
    step, and the retention's directory."""

    def __init__(self, root: Path, times: int = 1, *, bare: bool = False) -> None:
        self.root, self.times, self.bare = root, times, bare

    def listdir(self, path: Path) -> list[str]:
        names = super().listdir(path)
        if path == self.root and self.times > 0:
            self.times -= 1
            # (bare: readdir missed the retention's directory as well)
            return [n for n in names if not n.startswith("step_")] + (
                [] if self.bare else [".step_000000001.deleting-0123abcd"])
        return names


def test_a_step_not_committed_names_the_steps_that_are(tmp_path: Path) -> None:
    with asyncckpt.AsyncCheckpointer(tmp_path) as ck:
        for s in range(12):
            ck.save({"w": torch.ones(1)}, step=2 * s)
    with pytest.raises(asyncckpt.CheckpointNotFoundError,
                       match=r"\(committed steps: 4, 6, .*, 22; and 2 older\)"):
        asyncckpt.load(tmp_path, step=7)


def test_a_listing_that_raced_with_a_commit_is_taken_again(tmp_path: Path) -> None:
    """A trial's reader of a keep_last=1 run: 'no committed checkpoint' without fallback,
    and with it 'no intact checkpoint under ...: ' listing no failure (about 1 load in
    600)."""
    from asyncckpt import commit
    from asyncckpt.loader import load_newest_intact

    asyncckpt.save({"w": torch.full((4,), 2.0)}, tmp_path, step=2)
    d, step = commit.resolve_step_dir(tmp_path, None, _RacedListing(tmp_path))
    assert step == 2 and d == tmp_path / "step_000000002"
    got = load_newest_intact(tmp_path, None, _RacedListing(tmp_path))
    assert got["w"][0].item() == 2.0
    with pytest.raises(asyncckpt.CheckpointNotFoundError, match="no committed checkpoint"):
        commit.resolve_step_dir(tmp_path, None, _RacedListing(tmp_path, times=10))


def test_a_listing_that_raced_with_a_commit_and_shows_nothing_is_taken_again(
        tmp_path: Path) -> None:
    """The same reader once it was taken again where a temporary directory showed: 1 load
    in ~30,000 still said 'no committed checkpoint' (readdir missed that one as well)."""
    from asyncckpt import commit
    from asyncckpt.loader import load_newest_intact

    asyncckpt.save({"w": torch.full((4,), 2.0)}, tmp_path, step=2)
    d, step = commit.resolve_step_dir(tmp_path, None, _RacedListing(tmp_path, bare=True))
    assert step == 2 and d == tmp_path / "step_000000002"
    assert commit.committed_steps(tmp_path, _RacedListing(tmp_path, bare=True)) == [2]
    got = load_newest_intact(tmp_path, None, _RacedListing(tmp_path, bare=True))
    assert got["w"][0].item() == 2.0
    # an empty root is still told so, after that one listing more
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(asyncckpt.CheckpointNotFoundError, match="no committed checkpoint"):
        commit.resolve_step_dir(empty, None, asyncckpt.storage.LocalStorage())


def test_a_load_of_the_latest_step_retired_while_read_loads_the_newer_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """(the trial's reader, without fallback: 'was deleted while it was being read')"""
    asyncckpt.save({"w": torch.full((4,), 1.0)}, tmp_path, step=1)
    real = asyncckpt._load_from
    calls = []

    def retired_meanwhile(step_dir: Path, *a: Any, **kw: Any) -> Any:
        calls.append(step_dir.name)
        if len(calls) == 1:  # a newer save commits, and its retention removes this one
            asyncckpt.save({"w": torch.full((4,), 2.0)}, tmp_path, step=2)
            shutil.rmtree(step_dir)
        return real(step_dir, *a, **kw)

    monkeypatch.setattr(asyncckpt, "_load_from", retired_meanwhile)
    assert asyncckpt.load(tmp_path)["w"][0].item() == 2.0
    assert calls == ["step_000000001", "step_000000002"]
    monkeypatch.setattr(asyncckpt, "_load_from", lambda d, *a, **kw: (
        asyncckpt.save({"w": torch.ones(1)}, tmp_path, step=3), shutil.rmtree(d),
        real(d, *a, **kw)))
    with pytest.raises(asyncckpt.CheckpointNotFoundError,
                       match="step_000000002 was deleted while it was being read"):
        asyncckpt.load(tmp_path, step=2)  # (a step asked for by number is not replaced)


def test_a_load_of_the_latest_step_outpaced_every_time_says_so_and_what_to_do(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A trial's reader beside a keep_last=1 saver (110 saves a second) had its third
    try's step retired too, and was told of that step alone, to 'use a step that is
    still committed'."""
    from asyncckpt import checkpointer

    saved = [1]
    asyncckpt.save({"w": torch.ones(4)}, tmp_path, step=1)

    def outpaced(real: Any) -> Any:
        def load(step_dir: Path, *a: Any, **kw: Any) -> Any:
            saved.append(saved[-1] + 1)  # a newer save commits; its keep_last=1 retires this
            asyncckpt.save({"w": torch.ones(4)}, tmp_path, step=saved[-1])
            shutil.rmtree(step_dir)
            return real(step_dir, *a, **kw)
        return load

    monkeypatch.setattr(asyncckpt, "_load_from", outpaced(asyncckpt._load_from))
    monkeypatch.setattr(checkpointer, "load_from", outpaced(checkpointer.load_from))
    advice = ("the latest step went while it was read 3 times in a row: a saver's keep_last "
              "here removes each step sooner than this load reads it; load when that saver "
              "is done or saves less often, keep more steps there (keep_last=2, keep_every), "
              "or pass step= of a step it keeps")
    with pytest.raises(asyncckpt.CheckpointNotFoundError) as info:
        asyncckpt.load(tmp_path)
    assert str(info.value).startswith(f"{tmp_path / 'step_000000003'} was deleted while")
    assert str(info.value).endswith(advice), info.value
    with asyncckpt.AsyncCheckpointer(tmp_path) as ck, pytest.raises(
            asyncckpt.CheckpointNotFoundError) as info:
        ck.load({"w": torch.zeros(4)})
    assert str(info.value).startswith(f"{tmp_path / 'step_000000006'} was deleted while")
    assert str(info.value).endswith(advice), info.value
    with pytest.raises(asyncckpt.CheckpointNotFoundError) as info:  # one asked for: as ever
        asyncckpt.load(tmp_path, step=7)
    assert "went while it was read" not in str(info.value)


def test_a_damaged_step_is_marked_on_disk_for_later_processes(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A trial's later process loaded the intact step 6 (never reading the damaged 4), and
    its keep_last=3 counted 4: [4 (corrupt), 5, 6]. The checkpointer that found 4 damaged
    writes step_4/damaged.json; every later checkpointer's retention reads it."""
    with asyncckpt.AsyncCheckpointer(tmp_path, keep_last=3) as ck:
        for s in (3, 4):
            ck.save({"w": torch.full((1000,), float(s))}, step=s)
    _flip_a_byte(tmp_path / "step_000000004")
    with asyncckpt.AsyncCheckpointer(tmp_path, keep_last=3) as ck:
        with caplog.at_level(logging.WARNING, logger="asyncckpt"):
            assert ck.load(fallback=True)["w"][0].item() == 3.0
        assert "step(s) [4] under" in caplog.text and "marked by damaged.json" in caplog.text
        # training on from step 3 saves step 4 again: the refusal says why, and the cure
        # (a trial's resume met 'already committed ... delete that directory')
        with pytest.raises(asyncckpt.CheckpointExistsError,
                           match=r"a fallback load found it damaged \(damaged.json\): .*"
                                 r"ckpt\.discard_steps_after\(<that step>\)"):
            ck.save({"w": torch.full((1000,), 4.0)}, step=4)
    mark = json.loads((tmp_path / "step_000000004" / "damaged.json").read_text())
    assert mark["step"] == 4 and "checksum mismatch in tensor 'w'" in mark["problem"], mark
    assert abs(mark["found_unix"] - time.time()) < 60
    # a plain load of the marked step is warned of (a distributed trial's group loaded
    # one: the rank whose part was intact without a word, the others failed)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        with pytest.raises(asyncckpt.CheckpointCorruptError):
            asyncckpt.load(tmp_path)
        assert f"{tmp_path / 'step_000000004'} is marked damaged: a load found it damaged " \
            "at " in caplog.text and "load(..., fallback=True) takes the newest intact step" \
            in caplog.text, caplog.text
        caplog.clear()
        with asyncckpt.AsyncCheckpointer(tmp_path) as ck, pytest.raises(
                asyncckpt.CheckpointCorruptError):
            ck.load(step=4)
        assert "step_000000004 is marked damaged" in caplog.text
        caplog.clear()
        assert asyncckpt.load(tmp_path, step=3)["w"][0].item() == 3.0
        assert "marked damaged" not in caplog.text
    # a later process: its loads read the newest step only, which is intact
    with asyncckpt.AsyncCheckpointer(tmp_path, keep_last=3) as ck:
        for s in (5, 6):
            ck.save({"w": torch.full((1000,), float(s))}, step=s)
            assert ck.load()["w"][0].item() == float(s)
        assert ck.steps() == [3, 4, 5, 6]  # three intact steps, and 4 for a look
        ck.save({"w": torch.full((1000,), 7.0)}, step=7)
        assert ck.steps() == [5, 6, 7]  # 4 went once older than every step kept
    assert asyncckpt.load(tmp_path, step=5)["w"][0].item() == 5.0


def test_a_step_saved_anew_while_read_is_not_called_corrupt(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A trial's evaluator read step 2 while its trainer rolled back
    (discard_steps_after(1)) and saved step 2 again: 'checksum mismatch ... the checkpoint
    is corrupt', and with fallback a damaged.json in the healthy new step."""
    def state(value: float) -> dict[str, torch.Tensor]:
        return {f"t{i}": torch.full((1 << 18,), value) for i in range(24)}

    def save_two(root: Path) -> None:
        with asyncckpt.AsyncCheckpointer(root) as ck:
            for s in (1, 2):
                ck.save(state(float(s)), step=s)

    class RolledBack(asyncckpt.storage.LocalStorage):
        def __init__(self, root: Path) -> None:
            self.root, self.done = root, False

        def pread_into(self, fd: int, views: Any, offset: int) -> int:
            got = super().pread_into(fd, views, offset)
            if not self.done:  # (the first read, of the header: then the rollback)
                self.done = True
                with asyncckpt.AsyncCheckpointer(self.root) as trainer:
                    trainer.discard_steps_after(1)
                    trainer.save(state(22.0), step=2)
            return got

    save_two(tmp_path)
    reader = asyncckpt.AsyncCheckpointer(tmp_path, storage=RolledBack(tmp_path))
    with pytest.raises(asyncckpt.CheckpointNotFoundError,
                       match="step_000000002 was replaced while it was being read"):
        reader.load(step=2)
    shutil.rmtree(tmp_path)
    save_two(tmp_path)  # the latest, asked for as such: the new one is loaded
    got = asyncckpt.AsyncCheckpointer(tmp_path, storage=RolledBack(tmp_path)).load()
    assert {t[0].item() for t in got.values()} == {22.0}
    shutil.rmtree(tmp_path)
    save_two(tmp_path)
    reader = asyncckpt.AsyncCheckpointer(tmp_path, storage=RolledBack(tmp_path))
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        got = reader.load(fallback=True)
    assert len({t[0].item() for t in got.values()}) == 1  # one step's values, not mixed
    assert not list(tmp_path.glob("step_*/damaged.json")), caplog.text
    assert "failed their checks" not in caplog.text, caplog.text


def test_a_reader_beside_another_process_that_saves_there_does_not_mark(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """damaged.json is the owner's (a review: an evaluator's fallback load marked its
    trainer's steps)."""
    with asyncckpt.AsyncCheckpointer(tmp_path, keep_last=3) as ck:
        for s in (3, 4):
            ck.save({"w": torch.full((10,), float(s))}, step=s)
    _flip_a_byte(tmp_path / "step_000000004")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time\n"
         f"fd = os.open({str(tmp_path / '.asyncckpt.lock')!r}, os.O_RDWR)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX); os.pwrite(fd, b'%d\\n' % os.getpid(), 0)\n"
         "print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with caplog.at_level(logging.WARNING, logger="asyncckpt"), \
                asyncckpt.AsyncCheckpointer(tmp_path, keep_last=3) as ck:
            assert ck.load(fallback=True)["w"][0].item() == 3.0
        assert f"step 4: another process (pid {holder.pid}) saves there" in caplog.text
        assert not (tmp_path / "step_000000004" / "damaged.json").exists()
    finally:
        holder.communicate("", timeout=30)
    with asyncckpt.AsyncCheckpointer(tmp_path, keep_last=3) as ck:  # none saves there now
        ck.load(fallback=True)
    assert (tmp_path / "step_000000004" / "damaged.json").exists()
    assert not asyncckpt.storage.DirectoryLock(tmp_path).held_in_this_process()  # (let go)


def test_a_damaged_step_that_cannot_be_marked_is_still_not_counted(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    class NoMarks(asyncckpt.storage.LocalStorage):
        def write_bytes(self, path: Path, data: bytes) -> None:
            if path.name == "damaged.json":
                raise PermissionError(errno.EROFS, "Read-only file system")
            super().write_bytes(path, data)

    with asyncckpt.AsyncCheckpointer(tmp_path, keep_last=2) as ck:
        for s in (10, 20):
            ck.save({"w": torch.full((10,), float(s))}, step=s)
    _flip_a_byte(tmp_path / "step_000000020")
    with asyncckpt.AsyncCheckpointer(tmp_path, keep_last=2, storage=NoMarks()) as ck:
        with caplog.at_level(logging.WARNING, logger="asyncckpt"):
            assert ck.load(fallback=True)["w"][0].item() == 10.0
        assert ("damaged.json could not be written (step 20: Read-only file system): only "
                "this checkpointer knows") in caplog.text, caplog.text
        ck.save({"w": torch.full((10,), 30.0)}, step=30)
        assert ck.steps() == [10, 20, 30]  # known in memory all the same
    assert not (tmp_path / "step_000000020" / "damaged.json").exists()


def test_retention_that_removes_several_steps_at_once_warns(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A restart with narrower retention (keep_every dropped from a config) removed the
    run's milestones with an INFO line alone; one step a save stays INFO."""
    with asyncckpt.AsyncCheckpointer(tmp_path, keep_last=1, keep_every=10) as ck:
        for s in (10, 20, 25, 30):
            ck.save({"w": torch.ones(2)}, step=s)
        assert ck.steps() == [10, 20, 30]
    with caplog.at_level(logging.INFO, logger="asyncckpt"), \
            asyncckpt.AsyncCheckpointer(tmp_path, keep_last=1) as ck:
        ck.save({"w": torch.ones(2)}, step=35)
        ck.wait()
    warned = [r for r in caplog.records if r.levelno == logging.WARNING
              and "removed 3 steps at once, [10, 20, 30] (keep_last=1, keep_every=None" in
              r.getMessage()]
    assert len(warned) == 1, caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="asyncckpt"), \
            asyncckpt.AsyncCheckpointer(tmp_path, keep_last=1) as ck:
        ck.save({"w": torch.ones(2)}, step=40)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "retention removed steps [35]" in caplog.text
    # keep_best removes the step before and a best one the new step displaced: two at
    # once, as a rule (a trial's keep_last=1, keep_best=2 run warned at every such save)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="asyncckpt"), asyncckpt.AsyncCheckpointer(
            tmp_path / "best", keep_last=1, keep_best=2, best_metric="loss") as ck:
        for step, loss in enumerate([5, 3, 4, 1, float("nan"), 2]):
            ck.save({"w": torch.ones(2)}, step=step, metrics={"loss": loss})
    assert "retention removed steps [1, 4]" in caplog.text, caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_prepare_allocates_the_arena_the_first_save_uses(tmp_path: Path) -> None:
    state = make_state()
    with asyncckpt.AsyncCheckpointer(tmp_path) as ckpt:
        ckpt.prepare(state).result(30)
        arena = ckpt._arena
        assert arena is not None
        ckpt.save(state, step=1)
        assert ckpt._arena is arena
        ckpt.prepare(state, background=False)
        ckpt.save(state, step=2)
        assert ckpt._arena is arena
    assert tensors_equal(asyncckpt.load(tmp_path, step=2)["model"], state["model"].state_dict())


def test_the_host_buffer_size_is_public_and_stays_across_saves(tmp_path: Path) -> None:
    state = {"w": torch.ones(1 << 16), "b": torch.zeros(100, dtype=torch.int16)}
    ckpt = asyncckpt.AsyncCheckpointer(tmp_path, mode="async_pinned")
    assert ckpt.host_buffer_bytes == 0 and not ckpt.host_buffer_pinned
    ckpt.save(state, step=1)
    size = ckpt.host_buffer_bytes
    raw = (1 << 16) * 4 + 200
    assert raw <= size <= raw + (2 << 20)  # the file's layout: header, alignment
    assert ckpt.host_buffer_pinned == torch.cuda.is_available()
    for step in range(2, 5):
        ckpt.save_async(state, step=step).wait()
        assert ckpt.host_buffer_bytes == size
    ckpt.close()
    assert ckpt.host_buffer_bytes == 0


def test_release_host_buffer_frees_it_until_the_next_save(tmp_path: Path) -> None:
    """A root that saves rarely (the best model) held a buffer of the state's size from
    one save to the next; its only way out was to close the checkpointer each time."""
    state = {"w": torch.arange(1 << 16, dtype=torch.float32), "n": 3}
    ckpt = asyncckpt.AsyncCheckpointer(tmp_path, mode="async", keep_last=2)
    assert ckpt.release_host_buffer() == 0  # (none yet)
    ckpt.save(state, step=1)
    size = ckpt.host_buffer_bytes
    assert size > 0
    gone = weakref.ref(ckpt._arena)
    assert ckpt.release_host_buffer() == size
    gc.collect()
    assert ckpt.host_buffer_bytes == 0 and gone() is None  # (no reference left anywhere)
    assert ckpt.release_host_buffer() == 0
    state["w"] += 1
    fut = ckpt.save_async(state, step=2)  # allocated again, as the first save did
    assert ckpt.release_host_buffer() == size  # waits for the save in flight to be written
    assert fut.wait().step == 2 and ckpt.host_buffer_bytes == 0
    got = asyncckpt.load(tmp_path, step=2)
    assert torch.equal(got["w"], state["w"]) and got["n"] == 3
    ckpt.prepare(state)  # (in the background: waited for)
    assert ckpt.release_host_buffer() == size
    ckpt.close()
    assert ckpt.release_host_buffer() == 0  # (close freed it)


def test_release_host_buffer_withdraws_what_serve_offers_from_it(tmp_path: Path) -> None:
    class Transport:
        closed = False

        def __init__(self) -> None:
            self.offers: list[Any] = []
            self.withdrawn = 0

        def serve(self, served: Any, **_: Any) -> None:
            self.offers.append(served)

        def withdraw(self, retired: str | None = None) -> None:
            self.withdrawn += 1

        def disallow_checkpoint(self) -> None:
            raise AssertionError("withdraw() is the way: not disallow")

    transport = Transport()
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async") as ckpt:
        ckpt.serve(transport)
        ckpt.save({"w": torch.ones(1000)}, step=1)
        assert len(transport.offers) == 1
        before = transport.withdrawn
        assert ckpt.release_host_buffer() > 0
        assert transport.withdrawn == before + 1


@pytest.mark.parametrize("background", [True, False])
def test_prepare_for_a_new_layout_waits_for_the_save_in_flight(tmp_path: Path,
                                                               background: bool) -> None:
    # The new layout's (longer) header must not land in the arena while the save in
    # flight still writes it: that save would commit a file its manifest does not match.
    storage = GatedStorage()
    storage.gate.clear()
    small = {"w": torch.arange(1000, dtype=torch.float32)}
    big = {f"layer{i}.weight_with_a_long_name": torch.ones(8) for i in range(300)}
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async", storage=storage) as ckpt:
        fut = ckpt.save_async(small, step=1)
        assert storage.entered.wait(30)
        done = threading.Event()

        def prepare() -> None:
            ckpt.prepare(big, background=background).result(30)
            done.set()

        t = threading.Thread(target=prepare)
        t.start()
        assert not done.wait(0.5)  # it waits for step 1, which cannot finish yet
        storage.gate.set()
        fut.wait(30)
        t.join(30)
        assert done.is_set()
        ckpt.save(big, step=2)
    from asyncckpt.reader import verify_checkpoint

    report = verify_checkpoint(tmp_path / "step_000000001", LocalStorage())
    assert report.ok, report
    assert torch.equal(asyncckpt.load(tmp_path, step=1)["w"], small["w"])
    assert torch.equal(asyncckpt.load(tmp_path, step=2)["layer7.weight_with_a_long_name"],
                       torch.ones(8))


def test_prepare_with_on_busy_error_refuses_while_a_save_is_in_flight(tmp_path: Path) -> None:
    storage = GatedStorage()
    storage.gate.clear()
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async", on_busy="error",
                                     storage=storage) as ckpt:
        fut = ckpt.save_async({"w": torch.ones(4)}, step=1)
        with pytest.raises(asyncckpt.CheckpointInFlightError, match="step 1"):
            ckpt.prepare({"v": torch.ones(8)})
        storage.gate.set()
        fut.wait(30)
    assert asyncckpt.load(tmp_path, step=1)["w"].sum() == 4


class RecordingTransport:
    """What a checkpointer asks of a transport it serves through."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.served: list[object] = []

    def serve(self, served: object, *, allow: bool = True) -> None:
        self.calls.append("serve")
        self.served.append(served)

    def disallow_checkpoint(self) -> None:
        self.calls.append("disallow")


def test_close_withdraws_the_arena_from_its_transports(tmp_path: Path) -> None:
    transport = RecordingTransport()
    ckpt = asyncckpt.AsyncCheckpointer(tmp_path, mode="async")
    ckpt.serve(transport)
    ckpt.save({"w": torch.arange(10.0)}, step=1)
    assert transport.calls[-1] == "serve"  # the staged arena was offered
    ckpt.close()
    assert transport.calls[-1] == "disallow"  # and withdrawn before the arena is released
    n = len(transport.calls)
    ckpt.close()
    assert len(transport.calls) == n  # once


def test_a_fetch_from_a_closed_checkpointer_s_transport_is_refused_at_once(
        tmp_path: Path) -> None:
    """A peer asking a transport whose checkpointer closed waited its whole timeout for a
    step that would never come (503 "not allowed" until then): it is told at once now,
    until something is offered again."""
    from asyncckpt.transport import HTTPTransport

    transport = HTTPTransport(timeout=30)
    try:
        state = {"w": torch.arange(10.0)}
        with asyncckpt.AsyncCheckpointer(tmp_path, mode="async") as ckpt:
            ckpt.serve(transport)
            ckpt.save(state, step=1)
            assert torch.equal(asyncckpt.load(transport.address(), timeout=30)["w"], state["w"])
        t0 = time.monotonic()
        for step in (None, 1):
            with pytest.raises(asyncckpt.CheckpointNotFoundError, match=(
                    r"the AsyncCheckpointer that served its saves of .* here closed")):
                asyncckpt.load(transport.address(), step=step, timeout=30)
        assert time.monotonic() - t0 < 10  # not the 30 s timeout
        transport.send_checkpoint([1], 5, state, 10.0)  # offered again: served again
        assert torch.equal(asyncckpt.load(transport.address(), timeout=30)["w"], state["w"])
    finally:
        transport.shutdown()


def test_one_process_serves_the_manifest_it_commits(tmp_path: Path) -> None:
    """The staged arena is offered with the manifest the hash thread made for the commit,
    not one merged and encoded again (seconds for 100,000 tensors); a later save offers
    its own."""
    transport = RecordingTransport()
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async") as ckpt:
        ckpt.serve(transport)
        for step in (1, 2):
            ckpt.save({"w": torch.arange(10.0) + step, "n": step}, step=step)
            served = transport.served[-1]
            assert served.manifest() == (  # type: ignore[attr-defined]
                tmp_path / f"step_{step:09d}" / "manifest.json").read_bytes()
            assert served.step == step  # type: ignore[attr-defined]


class SlowRemove(LocalStorage):
    """Removing a directory blocks until ``release`` is set; ``removing`` says one began."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.removing = threading.Event()
        self.failed: list[Path] = []

    def remove_tree(self, path: Path) -> None:
        self.removing.set()
        if not self.release.wait(30):
            self.failed.append(path)  # (retention logs the error and goes on)
            raise AssertionError(f"{path}: a removal waited 30 s for release")
        super().remove_tree(path)


def test_removing_old_steps_never_delays_the_next_save(tmp_path: Path) -> None:
    """Retention hides an old step at once but removes its files on the reaper thread:
    the next save commits while a removal is stuck, and wait() waits for the removal."""
    storage = SlowRemove()
    release, removing = storage.release, storage.removing

    ckpt = asyncckpt.AsyncCheckpointer(tmp_path, keep_last=1, storage=storage)
    try:
        ckpt.save(make_state(1), step=1)
        # hides step 1; its removal blocks (a future's wait() is for the commit alone:
        # save() waits for the removal too, and held this test 30 s, its removal failed)
        ckpt.save_async(make_state(2), step=2).wait()
        assert removing.wait(10)
        assert ckpt.steps() == [2]  # out of sight already
        info = ckpt.save_async(make_state(3), step=3).wait(timeout=20)
        assert info.step == 3 and not release.is_set()  # committed behind the stuck removal
        assert 3 in ckpt.steps()  # (step 2 is hidden by the retention that follows)
        with pytest.raises(asyncckpt.CheckpointTimeoutError, match="being removed"):
            ckpt.wait(timeout=0.2)  # the retention of step 3 is behind the stuck one
        release.set()
        ckpt.wait(timeout=20)
        assert ckpt.steps() == [3]
        assert sorted(n for n in os.listdir(tmp_path) if n.startswith(("step", ".step"))) == [
            "step_000000003"]
        assert storage.failed == [], storage.failed  # (each removal waited, none gave up)
    finally:
        release.set()
        ckpt.close()


def test_a_stuck_removal_keeps_neither_the_old_arena_nor_the_old_state(tmp_path: Path) -> None:
    """Retention holds its save's job until old steps are removed: it must not hold the
    arena and the state tree too, or a save whose state grew has two arenas at once."""
    import weakref

    storage = SlowRemove()
    release, removing = storage.release, storage.removing

    ckpt = asyncckpt.AsyncCheckpointer(tmp_path, mode="async", keep_last=1,
                                       storage=storage)
    try:
        ckpt.save_async({"w": torch.zeros(1 << 16)}, step=1).wait()
        state = {"w": torch.zeros(1 << 16)}
        ckpt.save_async(state, step=2).wait()  # hides step 1; its removal blocks
        assert removing.wait(10)
        old_tensor = weakref.ref(state["w"])
        old_arena = weakref.ref(ckpt._arena)
        del state
        ckpt.save_async({"w": torch.zeros(1 << 18)}, step=3).wait()  # grown: a new arena
        assert ckpt._arena is not old_arena()  # (what the rest relies on)
        assert not release.is_set()  # step 2's retention still holds its job
        gc.collect()
        assert old_tensor() is None, "the stuck retention keeps the saved state alive"
        assert old_arena() is None, "the stuck retention keeps the old arena alive"
    finally:
        release.set()
        ckpt.close()
    assert ckpt.steps() == [3]


def test_serving_through_a_transport_that_cannot_is_refused_and_never_costs_a_save(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    class SendOnly:  # e.g. a PGTransport: send_checkpoint on request, no serve()
        def send_checkpoint(self, *args: object) -> None:
            pass

    class Broken(RecordingTransport):
        def serve(self, served: object, *, allow: bool = True) -> None:
            raise OSError("the transport broke")

    with asyncckpt.AsyncCheckpointer(tmp_path) as ckpt:
        with pytest.raises(asyncckpt.CheckpointConfigError, match="SendOnly cannot serve"):
            ckpt.serve(SendOnly())
        ckpt.serve(Broken())
        ckpt.save({"w": torch.ones(4)}, step=1)  # offering the arena failed: saved anyway
        assert ckpt.steps() == [1]
    assert "offering the staged state to peers through Broken failed" in caplog.text
    with pytest.raises(asyncckpt.CheckpointClosedError):
        ckpt.serve(RecordingTransport())  # it would never be offered anything


def test_an_entry_named_like_a_step_that_cannot_be_listed_is_skipped(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # One stray entry (a symlink loop here; EIO alike) must not make every listing,
    # fallback and save of the root fail; a load of the latest names it rather than take
    # an older step unasked (it may be the newest step, damaged). No permission: above.
    with asyncckpt.AsyncCheckpointer(tmp_path) as ckpt:
        for step in (1, 2):
            ckpt.save(make_state(step), step=step)
    loop = tmp_path / "step_000000003"
    loop.symlink_to(loop)
    with caplog.at_level(logging.WARNING, logger="asyncckpt.commit"):
        assert asyncckpt.AsyncCheckpointer(tmp_path).steps() == [1, 2]
    assert f"skipping {loop}: it cannot be listed (Too many levels of symbolic links)" \
        in caplog.text
    with pytest.raises(asyncckpt.CheckpointCorruptError, match="step_000000003 cannot be"):
        asyncckpt.load(tmp_path)
    assert asyncckpt.load(tmp_path, step=2)["train"]["step"] == 2
    assert asyncckpt.load(tmp_path, fallback=True)["train"]["step"] == 2
    with asyncckpt.AsyncCheckpointer(tmp_path, keep_last=2) as ckpt:
        ckpt.save(make_state(4), step=4)
    assert ckpt.steps() == [2, 4] and loop.is_symlink()  # retention works, leaves it be


def test_only_the_canonical_name_of_a_step_directory_counts(tmp_path: Path) -> None:
    # step_0000000003 (10 digits) is no step 3: counted as one, it resolved to
    # step_000000003, which does not exist, and a load (fallback too) found nothing.
    with asyncckpt.AsyncCheckpointer(tmp_path) as ckpt:
        for step in (1, 2):
            ckpt.save(make_state(step), step=step)
    for odd in ("step_0000000003", "step_00000000\u0664"):  # and no Arabic-Indic digit
        shutil.copytree(tmp_path / "step_000000002", tmp_path / odd)
    assert asyncckpt.AsyncCheckpointer(tmp_path).steps() == [1, 2]
    assert asyncckpt.load(tmp_path)["train"]["step"] == 2
    assert asyncckpt.load(tmp_path, fallback=True)["train"]["step"] == 2
    # passed itself, it loads like any copy of a step directory under another name
    assert asyncckpt.load(tmp_path / "step_0000000003")["train"]["step"] == 2


def test_a_commit_that_can_be_neither_made_durable_nor_withdrawn_says_so(
        tmp_path: Path) -> None:
    """The rename happened, the fsync of the root failed, and so did taking the step
    back: the error must not read as "nothing was saved" while the step is visible."""
    with asyncckpt.AsyncCheckpointer(tmp_path, storage=StuckCommit(tmp_path)) as ckpt:
        ckpt.save({"w": torch.ones(4)}, step=1)
        with pytest.raises(asyncckpt.CheckpointSaveError,
                           match=r"step 2 is committed at .*a crash may lose it.*read-only"):
            ckpt.save({"w": torch.full((4,), 2.0)}, step=2)
        assert ckpt.steps() == [1, 2]
        assert torch.equal(ckpt.load(step=2)["w"], torch.full((4,), 2.0))


@pytest.mark.parametrize("sharded", ["a", "b"])
def test_a_tied_weight_loads_whole_at_one_path_and_a_shard_at_another(
        tmp_path: Path, sharded: str) -> None:
    """Tied embedding and output weights, one of them sharded in the target (tensor
    parallel on one side only): each path gets its own part. Once, the whole target got
    the shard, broadcast over its rows, without a word."""
    w = torch.arange(12.0).reshape(4, 3)
    asyncckpt.save({"a": w, "b": w}, tmp_path)
    target = {"a": torch.zeros(4, 3), "b": torch.zeros(4, 3)}
    target[sharded] = torch.zeros(1, 3)
    with asyncckpt.AsyncCheckpointer(tmp_path) as ck:
        ck.load(target, shards={sharded: asyncckpt.ShardMetadata((4, 3), (2, 0))})
    whole = "b" if sharded == "a" else "a"
    assert torch.equal(target[whole], w)
    assert torch.equal(target[sharded], w[2:3])


def test_load_step_of_a_step_dir_with_a_name_of_ones_own(tmp_path: Path) -> None:
    """A step directory copied to "best/" says nothing of its step by its name: a load
    that asks for another step is refused, not served step 3's data; fallback works."""
    asyncckpt.save({"a": torch.arange(4.0)}, tmp_path / "run", step=3)
    best = tmp_path / "best"
    shutil.copytree(tmp_path / "run" / "step_000000003", best)
    assert torch.equal(asyncckpt.load(best, step=3)["a"], torch.arange(4.0))
    with pytest.raises(asyncckpt.CheckpointNotFoundError, match="of step 3, not of step 7"):
        asyncckpt.load(best, step=7)
    with asyncckpt.AsyncCheckpointer(best) as ck, \
            pytest.raises(asyncckpt.CheckpointNotFoundError, match="not of step 7"):
        ck.load(step=7)
    for d in (best, tmp_path / "run" / "step_000000003"):  # no older step, but this one
        assert torch.equal(asyncckpt.load(d, fallback=True)["a"], torch.arange(4.0))
        with asyncckpt.AsyncCheckpointer(d) as ck:
            assert torch.equal(ck.load(fallback=True)["a"], torch.arange(4.0))


@pytest.mark.parametrize(("saved", "target", "says"), [
    ({"x": 3}, {"x": {"y": 5}}, "x: the checkpoint holds an int, the target a dict"),
    ({"layers": {0: torch.ones(2), 1: torch.ones(2)}},
     {"layers": [torch.zeros(2), torch.zeros(2)]},
     "the checkpoint holds a dict, the target a list"),
    ({"cfg": [torch.ones(2), 5]}, {"cfg": {0: torch.zeros(2), 1: 0}},
     "the checkpoint holds a list, the target a dict"),
    ({"w": torch.ones(2), "cfg": {"lr": 0.1}}, {"w": {"a": torch.zeros(1)}, "cfg": {"lr": 0}},
     "w: the checkpoint holds a tensor, the target a dict"),
    # (a key holding ': ': the paths told are kept as paths, not parsed back out of words)
    ({"w: x": torch.ones(2)}, {"w: x": {"a": torch.zeros(1)}},
     "w: x: the checkpoint holds a tensor, the target a dict"),
])
def test_a_container_the_checkpoint_replaces_with_another_kind_is_a_mismatch(
        tmp_path: Path, saved: dict[str, Any], target: dict[str, Any], says: str) -> None:
    """The load would swap the target's container for the checkpoint's value; whoever
    holds the old one sees stale values. strict=False does not make it fit either."""
    asyncckpt.save(saved, tmp_path)
    for strict in (True, False):
        with pytest.raises(asyncckpt.StateMismatchError, match=says) as info:
            asyncckpt.load(tmp_path, target, strict=strict)
        assert len(info.value.mismatched) == 1, info.value.mismatched  # (said once)


def test_targets_whose_elements_share_memory_are_refused_before_any_read(
        tmp_path: Path) -> None:
    asyncckpt.save({"a": torch.arange(10.0), "b": torch.arange(10.0)}, tmp_path)
    b = torch.zeros(10)
    with pytest.raises(asyncckpt.StateMismatchError, match=r"elements share memory.*: a;"):
        asyncckpt.load(tmp_path, {"a": torch.zeros(1).expand(10), "b": b})
    assert torch.equal(b, torch.zeros(10))  # refused before anything was read


def test_layouts_torch_cannot_judge_are_checked_for_shared_elements(tmp_path: Path) -> None:
    # torch says "too hard to tell" for these: (1, 1) strides over a (2, 3) view overlap
    # (the load gave [[0, 1, 2], [1, 2, 5]] without error); the others do not.
    from asyncckpt.loader import _overlaps_itself

    asyncckpt.save({"a": torch.arange(6.0).reshape(2, 3)}, tmp_path)
    mem = torch.zeros(64)
    with pytest.raises(asyncckpt.StateMismatchError, match=r"elements share memory.*: a;"):
        asyncckpt.load(tmp_path, {"a": mem.as_strided((2, 3), (1, 1))})
    assert not mem.any()
    for shape, stride in (((2, 3), (1, 2)), ((3, 2), (2, 3)), ((2, 3), (3, 1)),
                          ((3, 3), (1, 3)), ((2, 2, 2), (1, 4, 2))):
        t = mem.as_strided(shape, stride)
        # the truth: one element per location
        locs = {sum(i * s for i, s in zip(idx, stride, strict=True)) for idx in itertools.product(
            *[range(n) for n in shape])}
        assert _overlaps_itself(t) == (len(locs) < t.numel()), (shape, stride)
    t = mem.as_strided((2, 3), (2, 1))  # interleaved: overlaps (offset 2 twice)
    assert _overlaps_itself(t)
    ok = {"a": mem.as_strided((2, 3), (1, 2))}  # interleaved, yet disjoint: loads
    asyncckpt.load(tmp_path, ok)
    assert torch.equal(ok["a"], torch.arange(6.0).reshape(2, 3))


def test_one_saved_tensor_into_two_overlapping_targets(tmp_path: Path) -> None:
    """Tied at save, two overlapping views at load: the second copy would read what it
    overwrites (torch raised half-way); each target gets the value, the last one wins."""
    w = torch.arange(6.0)
    asyncckpt.save({"a": w, "b": w}, tmp_path)
    buf = torch.zeros(8)
    asyncckpt.load(tmp_path, {"a": buf[0:6], "b": buf[2:8]})
    assert torch.equal(buf[2:8], w)
    assert torch.equal(buf[0:2], w[0:2])


class _TiedLM(torch.nn.Module):
    def __init__(self, seed: int, tie: bool = True) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(10, 4)
        self.lm_head = torch.nn.Linear(4, 10, bias=False)
        if tie:
            self.lm_head.weight = self.emb.weight


def test_a_tied_target_path_is_filled_through_its_tie(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A checkpoint that holds one of a tied pair (saved from a plain dict, or a model
    that had them apart and dropped one) fills the other through the tie: not missing
    in a strict load, and not "left as it is" by strict=False (a trial: it warned so of
    a weight it had just changed)."""
    src = _TiedLM(0)
    for kept in ("emb.weight", "lm_head.weight"):
        asyncckpt.save({"model": {kept: src.emb.weight.detach().clone()}}, tmp_path / kept)
        for strict in (True, False):
            model = _TiedLM(1)
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="asyncckpt"):
                asyncckpt.load(tmp_path / kept, {"model": model}, strict=strict)
            assert model.lm_head.weight is model.emb.weight
            assert torch.equal(model.emb.weight, src.emb.weight), (kept, strict)
            assert "as they are" not in caplog.text
            assert "get their values through the tensors they are tied to" in caplog.text
    # paths that are not tied are each wanted, as ever
    with pytest.raises(asyncckpt.StateMismatchError,
                       match=r"missing from the checkpoint: model/lm_head\.weight"):
        asyncckpt.load(tmp_path / "emb.weight", {"model": _TiedLM(1, tie=False)})


def test_equal_saved_tensors_into_one_tied_target_are_not_warned_of(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """(trial) An untied model whose head equals its embedding, loaded into the tied
    model, was warned that "the last one wins": its checksums say they are alike."""
    src = _TiedLM(0, tie=False)
    with torch.no_grad():
        src.lm_head.weight.copy_(src.emb.weight)
    asyncckpt.save({"model": src}, tmp_path / "eq", step=1)
    asyncckpt.save({"model": _TiedLM(2, tie=False)}, tmp_path / "ne", step=1)
    for which, warned in (("eq", False), ("ne", True)):
        caplog.clear()
        model = _TiedLM(1)
        with caplog.at_level(logging.WARNING, logger="asyncckpt"):
            asyncckpt.load(tmp_path / which, {"model": model})
        assert ("the last one wins" in caplog.text) == warned, (which, caplog.text)
    assert torch.equal(model.emb.weight, _TiedLM(2, tie=False).lm_head.weight)
    # (fine-tuning trial) which one won, and how to keep another
    assert "wins ('model/lm_head.weight', whose values differ" in caplog.text, caplog.text
    assert "key_map= returning None" in caplog.text
    # (second review) equal values into overlapping views are no tie: still warned of
    asyncckpt.save({"a": torch.arange(4.0), "b": torch.arange(4.0)}, tmp_path / "ov", step=1)
    base = torch.zeros(6)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        asyncckpt.load(tmp_path / "ov", {"a": base[0:4], "b": base[2:6]})
    assert "the last one wins" in caplog.text


def test_a_target_over_read_only_memory_is_not_called_corrupt(tmp_path: Path) -> None:
    """The checkpoint is intact, so neither "corrupt" nor a fallback past every intact
    step: the target is refused up front (as a read-only numpy array is), and where the
    process's mappings cannot be read, pread into it fails with EFAULT."""
    asyncckpt.save({"a": torch.arange(4.0)}, tmp_path / "c", step=1)
    asyncckpt.save({"a": torch.arange(4.0)}, tmp_path / "c", step=2)
    np.save(tmp_path / "z.npy", np.zeros(4, dtype=np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: the array is not writable
        t = torch.from_numpy(np.load(tmp_path / "z.npy", mmap_mode="r"))
    for fallback in (False, True):
        with pytest.raises(asyncckpt.StateMismatchError, match="memory that cannot be written"):
            asyncckpt.load(tmp_path / "c", {"a": t}, fallback=fallback)
    with mock.patch("asyncckpt.loader._writable_ranges", return_value=[]):  # unknown
        for fallback in (False, True):
            with pytest.raises(asyncckpt.CheckpointConfigError, match="cannot be written"):
                asyncckpt.load(tmp_path / "c", {"a": t}, fallback=fallback)


# --- interrupts and leftovers of the save path (from a review of the lifecycle) ------------

def _lock_fds() -> list[str]:
    """The fds of this process open on a lock file. (Other threads open and close fds
    meanwhile: one listed may be gone by the time its link is read.)"""
    out = []
    for f in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{f}").endswith(".asyncckpt.lock"):
                out.append(f)
        except FileNotFoundError:
            continue
    return out


def _within(fn: Callable[[], Any], seconds: float = 30.0) -> None:
    """Run ``fn`` on a thread; fail (rather than hang the suite) if it does not end."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{fn} still blocked after {seconds}s"
    if errors:
        raise errors[0]


def test_an_interrupt_before_staging_begins_lets_the_next_save_and_close_go_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer was queued and waited for staging that never began: the next save
    and close() hung forever (and so did the interpreter's exit)."""
    from asyncckpt import checkpointer as C

    real = C._versions

    def ctrl_c(tensors: Any) -> Any:
        monkeypatch.setattr(C, "_versions", real)
        raise KeyboardInterrupt

    monkeypatch.setattr(C, "_versions", ctrl_c)
    ck = asyncckpt.AsyncCheckpointer(tmp_path, mode="async")
    state = {"w": torch.arange(1000.0)}
    with pytest.raises(KeyboardInterrupt):
        ck.save_async(state, step=1, overlap=True)
    _within(lambda: ck.save(state, step=2))
    _within(ck.close)  # the interrupted save's failure was the caller's: not raised again
    assert asyncckpt.AsyncCheckpointer(tmp_path).steps() == [2]


@pytest.mark.parametrize("pool", ["asyncckpt-hash", "asyncckpt-copy"])
def test_an_interrupt_as_a_thread_starts_leaves_no_thread_that_exit_waits_for(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pool: str) -> None:
    """Ctrl-C in the first save, as a pool started its thread (started, not yet recorded
    by the pool): that thread waited for work for ever, and so did the interpreter's
    exit (uncaught, the script hung instead of ending with 130)."""
    real = threading.Thread.start
    started: list[threading.Thread] = []

    def start(self: threading.Thread) -> None:
        real(self)
        if self.name.startswith(pool) and not started:
            started.append(self)
            raise KeyboardInterrupt

    monkeypatch.setattr(threading.Thread, "start", start)
    ck = asyncckpt.AsyncCheckpointer(tmp_path, mode="async", copy_threads=2)
    state = {"w": torch.arange(1000.0)}
    with pytest.raises(KeyboardInterrupt):
        ck.save_async(state, step=1)
    assert started
    started[0].join(5.0)
    assert not started[0].is_alive()  # woken, and ended
    ck.save(state, step=2)  # the next save goes on
    ck.close()
    assert asyncckpt.AsyncCheckpointer(tmp_path).steps() == [2]


def test_an_interrupt_after_staging_keeps_the_save_pending(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Interrupted after staging but before the save was recorded as pending: its write
    went on while the next save restaged the arena under it (step 1 became corrupt)."""
    from asyncckpt import checkpointer as C

    class SlowDisk(LocalStorage):
        def write_arena(self, path, buf, nbytes, ready, direct=True):  # type: ignore[no-untyped-def]
            def slowly(n: int) -> None:
                ready(n)
                time.sleep(0.05)
            return super().write_arena(path, buf, nbytes, slowly, direct)

    monkeypatch.setattr(asyncckpt.storage, "PIECE_BYTES", 1 << 20)
    real = C.CheckpointFuture

    class Interrupted(real):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any) -> None:
            monkeypatch.setattr(C, "CheckpointFuture", real)
            raise KeyboardInterrupt

    monkeypatch.setattr(C, "CheckpointFuture", Interrupted)
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async", storage=SlowDisk()) as ck:
        with pytest.raises(KeyboardInterrupt):
            ck.save_async({"w": torch.full((4_000_000,), 1.0)}, step=1)
        ck.save_async({"w": torch.full((4_000_000,), 2.0)}, step=2).wait()
        assert ck.steps() == [1, 2]
        assert torch.equal(ck.load(step=1)["w"].unique(), torch.tensor([1.0]))


@pytest.mark.parametrize("at", [1, 2])
def test_an_interrupt_while_the_writer_queues_the_save_lets_later_saves_go_on(
        tmp_path: Path, at: int) -> None:
    """A Ctrl-C inside the writer's submit, with the hash task queued (at=1) or the
    write task too (at=2) but not the rest: the queued tasks waited for a staging that
    never came, and every later save, close() and the interpreter's exit hung."""

    class Interrupting:
        def __init__(self, inner: Any):
            self.inner, self.calls = inner, 0

        def submit(self, *args: Any, **kw: Any) -> Any:
            self.calls += 1
            if self.calls == at:
                raise KeyboardInterrupt
            return self.inner.submit(*args, **kw)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    ck = asyncckpt.AsyncCheckpointer(tmp_path, mode="async")
    state = {"w": torch.arange(1000.0)}
    ck.save(state, step=1)
    writer = ck._ensure_writer()
    real = writer._write
    writer._write = Interrupting(real)  # type: ignore[assignment]
    with pytest.raises(KeyboardInterrupt):
        ck.save_async(state, step=2)
    writer._write = real
    infos: list[Any] = []
    _within(lambda: infos.append(ck.save_async({"w": torch.arange(1000.0) + 3}, step=3).wait()))
    assert [i.step for i in infos] == [3]
    _within(ck.close)
    assert asyncckpt.AsyncCheckpointer(tmp_path).steps() == [1, 3]
    assert torch.equal(asyncckpt.load(tmp_path, step=3)["w"], torch.arange(1000.0) + 3)


def test_an_interrupted_close_still_releases_the_lock(tmp_path: Path) -> None:
    class InterruptedRemove(LocalStorage):
        def remove_tree(self, path: Path) -> None:
            raise KeyboardInterrupt  # Ctrl-C while retention removes an old step

    ck = asyncckpt.AsyncCheckpointer(tmp_path, mode="async", keep_last=1,
                                     storage=InterruptedRemove())
    state = {"w": torch.ones(10)}
    ck.save(state, step=1)
    ck.save_async(state, step=2).wait()  # its retention, run by close(), is interrupted
    with contextlib.suppress(KeyboardInterrupt, asyncckpt.CheckpointSaveError):
        ck.close()
    assert ck._lock._fd is None and not _lock_fds()
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async") as again:
        again.save(state, step=3)  # was: "another AsyncCheckpointer of this process holds"


def test_a_close_interrupted_twice_keeps_the_lock_until_the_save_in_flight_ends(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
        ) -> None:
    """Ctrl-C twice in close() (a slow disk): the lock was released while the save went
    on writing, and a checkpointer opened on the directory meanwhile (a notebook's next
    cell) deleted its temporary directory as abandoned: the save failed. The lock now
    goes when the save ends; the first interrupt says what close() waits for."""
    from asyncckpt import writer as W

    slow = GatedCommit()
    release = slow.gate
    ck = asyncckpt.AsyncCheckpointer(tmp_path, mode="async", storage=slow)
    state = {"w": torch.arange(10.0)}
    fut = ck.save_async(state, step=1)

    def interrupted(*a: Any, **kw: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(asyncckpt.AsyncCheckpointer, "_settle", staticmethod(interrupted))
    monkeypatch.setattr(W.BackgroundWriter, "shutdown", interrupted)  # the second Ctrl-C
    with caplog.at_level(logging.WARNING, logger="asyncckpt"), \
            pytest.raises(KeyboardInterrupt):
        ck.close()
    monkeypatch.undo()
    assert "closing" in caplog.text and "interrupt again" in caplog.text, caplog.text
    assert not fut.done()
    # the save goes on, and the checkpointer says so (a trial: is_pending False and wait()
    # None while it was still being written)
    assert ck.is_pending and repr(ck).endswith(": closed>")
    with pytest.raises(asyncckpt.CheckpointTimeoutError):
        ck.wait(timeout=0.05)
    with pytest.raises(asyncckpt.CheckpointLockedError, match=(
            r"a closed AsyncCheckpointer of this process is still finishing its save of step "
            r"1 in .* \(its close\(\) was interrupted\)")):
        asyncckpt.AsyncCheckpointer(tmp_path).save(state, step=2)
    release.set()
    info = ck.wait(30)
    assert info is not None and info.step == 1 and not ck.is_pending
    assert fut.wait(30).step == 1
    # at once: the writer's thread releases the lock just after the future completes (a
    # trial's save right after wait() was refused for a few ms)
    with asyncckpt.AsyncCheckpointer(tmp_path) as again:
        again.save(state, step=2)
        assert again.steps() == [1, 2]
    assert torch.equal(asyncckpt.load(tmp_path, step=1)["w"], state["w"])


def test_close_again_after_a_close_interrupted_twice_waits_for_the_save(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A concurrency trial caught the KeyboardInterrupt of a close() interrupted twice and
    called close() again to let the save finish: it returned at once, and the process's
    exit left the step uncommitted (exit status 0)."""
    from asyncckpt import writer as W

    slow = GatedCommit()
    ck = asyncckpt.AsyncCheckpointer(tmp_path, mode="async", storage=slow)
    state = {"w": torch.arange(10.0)}
    ck.save_async(state, step=1)

    def interrupted(*a: Any, **kw: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(asyncckpt.AsyncCheckpointer, "_settle", staticmethod(interrupted))
    monkeypatch.setattr(W.BackgroundWriter, "shutdown", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ck.close()
    monkeypatch.undo()
    # (a review: a `with` block left by an exception, and the collector, return at once:
    # the second interrupt asked not to wait)
    t0 = time.monotonic()
    ck.__exit__(RuntimeError, RuntimeError("the block failed"), None)
    ck.__del__()
    assert time.monotonic() - t0 < 1.0 and ck.is_pending
    with pytest.raises(asyncckpt.CheckpointTimeoutError, match=r"still being saved to \S+ "
                       r"\(\w+\); close\(\) again waits on"):
        ck.close(timeout=0.05)  # (a timeout is kept too; "stays open" it is not)
    monkeypatch.setattr(asyncckpt.AsyncCheckpointer, "_settle", staticmethod(interrupted))
    with pytest.raises(KeyboardInterrupt):  # (a third interrupt, in this wait)
        ck.close()
    monkeypatch.undo()
    assert ck.is_pending  # (not forgotten: the review's third close returned at once)
    threading.Timer(0.3, slow.gate.set).start()
    ck.close()
    assert not ck.is_pending and ck.steps() == [1]
    ck.close()  # (and a close() after that does nothing)
    assert torch.equal(asyncckpt.load(tmp_path, step=1)["w"], state["w"])


def test_a_checkpointer_dropped_by_its_own_prepare_releases_the_lock(tmp_path: Path) -> None:
    """Dropped while prepare() allocates in the background, the last reference was the
    stager's task: close ran on that thread, could not join it, and kept the lock."""
    def run() -> None:
        ck = asyncckpt.AsyncCheckpointer(tmp_path, mode="async")
        ck.save({"w": torch.ones(10)}, step=1)
        ck.prepare({"w": torch.ones(20_000_000)})

    run()
    deadline = time.monotonic() + 30
    while _lock_fds() and time.monotonic() < deadline:
        time.sleep(0.05)
        gc.collect()
    assert not _lock_fds()
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async") as again:
        again.save({"w": torch.ones(10)}, step=2)


@pytest.mark.parametrize("where", ["write", "hash"])
def test_a_checkpointer_collected_on_a_thread_of_its_own_save_does_not_deadlock(
        tmp_path: Path, where: str) -> None:
    """Held in a cycle and dropped while it saves, it was collected on its write (or
    hash) thread, whose close waited for the save that very thread runs: the step was
    never committed and the process hung at exit."""
    dropped = threading.Event()

    class CollectsThere(LocalStorage):
        def _collect(self) -> None:
            dropped.wait(10)
            gc.collect()  # an automatic collection, as allocations set off on any thread

        def write_arena(self, *args: Any, **kwargs: Any) -> None:
            if where == "write":
                self._collect()
            super().write_arena(*args, **kwargs)

        def write_bytes(self, path: Path, data: bytes) -> None:
            if where == "hash" and path.name == MANIFEST_NAME:
                self._collect()
            super().write_bytes(path, data)

    class Trainer:
        def __init__(self) -> None:
            self.ckpt = asyncckpt.AsyncCheckpointer(tmp_path, mode="async",
                                                    storage=CollectsThere())
            self.ckpt._owner = self  # type: ignore[attr-defined]  # a cycle

    enabled = gc.isenabled()
    gc.disable()  # (only the storage's collection finds the cycle)
    try:
        trainer = Trainer()
        trainer.ckpt.save_async({"w": torch.ones(1000)}, step=1)
        del trainer
        dropped.set()
        deadline = time.monotonic() + 30
        while (_lock_fds() or not (tmp_path / "step_000000001").exists()) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        if enabled:
            gc.enable()
    assert (tmp_path / "step_000000001").exists() and not _lock_fds()
    for t in threading.enumerate():
        if t.name == "asyncckpt-close":  # the close it handed over ends too
            t.join(10)
            assert not t.is_alive()
    assert torch.equal(asyncckpt.load(tmp_path)["w"], torch.ones(1000))


@pytest.mark.parametrize("how", ["save", "fut.wait", "ckpt.wait", "wait_staged"])
def test_a_checkpointer_whose_failure_was_seen_is_freed_when_dropped(
        tmp_path: Path, how: str) -> None:
    """The error kept by the failed save's future gathered the frames it was raised
    through, the caller's too, which held the checkpointer: dropped without close() by a
    retry function, it kept its lock and host buffer until a full collection, and the
    retry was refused ("another AsyncCheckpointer of this process holds ...")."""
    class Full(LocalStorage):
        def write_arena(self, path: Path, *args: Any, **kwargs: Any) -> None:
            raise OSError(errno.ENOSPC, "No space left on device (injected)", str(path))

    def attempt(step: int) -> str:
        ck = asyncckpt.AsyncCheckpointer(tmp_path, mode="async", storage=Full())
        state = {"w": torch.ones(1000)}
        try:
            if how == "save":
                ck.save(state, step=step)
            elif how == "fut.wait":
                ck.save_async(state, step=step).wait()
            elif how == "ckpt.wait":
                ck.save_async(state, step=step)
                ck.wait()
            else:
                fut = ck.save_async(state, step=step, overlap=True)
                fut.wait_staged()
                fut.wait()
        except asyncckpt.CheckpointSaveError as exc:
            return type(exc).__name__
        return "saved"

    enabled = gc.isenabled()
    gc.disable()  # (a full collection would free it anyway, at some point)
    try:
        assert attempt(1) == "CheckpointSaveError"
        assert not _lock_fds()
        assert attempt(2) == "CheckpointSaveError"  # not CheckpointLockedError
    finally:
        if enabled:
            gc.enable()


@pytest.mark.parametrize("before", ["nothing", "a save"])
def test_a_save_from_an_atexit_handler_is_refused_with_a_checkpoint_error(
        tmp_path: Path, before: str) -> None:
    # It raised a bare RuntimeError ("cannot schedule new futures after shutdown"), which
    # `except CheckpointError` does not catch: the final checkpoint was lost unseen.
    script = textwrap.dedent(f"""
        import atexit, torch, asyncckpt
        ck = asyncckpt.AsyncCheckpointer({str(tmp_path)!r}, mode="sync")
        if {before == "a save"}:
            ck.save({{"w": torch.ones(4)}}, step=1)
        def final():
            try:
                ck.save({{"w": torch.ones(4)}}, step=2)
                print("saved")
            except asyncckpt.CheckpointSaveError as exc:
                print("refused:", exc)
            ck.close()
        atexit.register(final)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("refused: step 2 cannot be saved: the interpreter is "
                                 "exiting"), (out.stdout, out.stderr)
    assert "save before the program ends" in out.stdout
    assert asyncckpt.AsyncCheckpointer(tmp_path).steps() == ([1] if before == "a save" else [])


def test_every_unwaited_failure_is_reported_not_only_the_first(tmp_path: Path) -> None:
    # Of several saves that failed with nobody waiting on their futures, only the first
    # was ever raised (the others were in the log alone).
    class Fails(LocalStorage):
        def write_arena(self, path: Path, *args: Any, **kwargs: Any) -> None:
            if "step_000000003" not in str(path):
                raise OSError(errno.EIO, "Input/output error (injected)", str(path))
            super().write_arena(path, *args, **kwargs)

    def said(exc: BaseException) -> str:
        return "\n".join([str(exc), *getattr(exc, "__notes__", ())])

    ck = asyncckpt.AsyncCheckpointer(tmp_path, mode="async", storage=Fails())
    for step in (1, 2, 3):
        ck.save_async({"w": torch.ones(4)}, step=step)  # futures never waited on
    with pytest.raises(asyncckpt.CheckpointSaveError) as ei:
        ck.wait()
    assert "step 1 " in said(ei.value) and "step 2 failed too" in said(ei.value), said(ei.value)
    ck.close()  # said once
    assert ck.steps() == [3]
    ck = asyncckpt.AsyncCheckpointer(tmp_path / "all", mode="async", storage=Fails())
    for step in (4, 5, 6):
        ck.save_async({"w": torch.ones(4)}, step=step)
    with pytest.raises(asyncckpt.CheckpointSaveError, match="step 6") as ei:
        ck.close()
    assert "step 4 " in said(ei.value) and "step 5 failed too" in said(ei.value), said(ei.value)


def test_many_unwaited_failures_are_told_up_to_a_count_then_summed(tmp_path: Path) -> None:
    """A soak trial's flaky disk: 5,000 saves never waited on, and wait() raised one error
    with 2,468 notes, 670 KB of text."""
    from asyncckpt.checkpointer import MISSED_SHOWN

    class Fails(LocalStorage):
        def write_arena(self, path: Path, *args: Any, **kwargs: Any) -> None:
            raise OSError(errno.EIO, "Input/output error (injected)", str(path))

    ck = asyncckpt.AsyncCheckpointer(tmp_path, mode="async", storage=Fails())
    n = MISSED_SHOWN + 15
    for step in range(1, n + 1):
        ck.save_async({"w": torch.ones(4)}, step=step)  # futures never waited on
    with pytest.raises(asyncckpt.CheckpointSaveError) as ei:
        ck.close()
    notes = ei.value.__notes__
    told = [m for m in notes if "failed too, and nobody waited" in m]
    assert len(told) == MISSED_SHOWN, notes
    summed = [m for m in notes if m.startswith("... and ")]
    assert len(summed) == 1 and f"the last: step {n - 1}: " in summed[0], notes
    assert int(summed[0].split()[2]) + len(told) + 2 == n  # (the first, and the last one)


def test_a_lock_whose_pid_cannot_be_written_is_still_taken_and_released(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.pwrite

    def full(fd: int, data: bytes, offset: int) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".asyncckpt.lock"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", full)
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async") as ck:
        ck.save({"w": torch.ones(4)}, step=1)  # raised a bare OSError
    monkeypatch.setattr(os, "pwrite", real)
    assert not _lock_fds()
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async") as again:
        again.save({"w": torch.ones(4)}, step=2)  # was: "another process is saving"


def test_a_failed_future_does_not_keep_the_arena_alive(tmp_path: Path) -> None:
    """The error's frames held views of the arena: close() could not free it while the
    caller kept the future (or the next, larger save held two arenas)."""
    class Full(LocalStorage):
        def write_arena(self, path, buf, nbytes, ready, direct=True):  # type: ignore[no-untyped-def]
            raise OSError(errno.ENOSPC, "No space left on device")

    ck = asyncckpt.AsyncCheckpointer(tmp_path, mode="async", storage=Full())
    fut = ck.save_async({"w": torch.ones(1 << 16)}, step=1)
    with pytest.raises(asyncckpt.CheckpointSaveError, match="No space left"):
        fut.wait()
    exc: BaseException | None = fut.exception()
    views = []
    while exc is not None:
        tb = exc.__traceback__
        while tb is not None:
            views += [v for v in tb.tb_frame.f_locals.values() if isinstance(v, memoryview)]
            tb = tb.tb_next
        exc = exc.__cause__ or exc.__context__
    assert views == []


def test_prepare_in_the_foreground_waits_for_one_in_the_background(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both allocated at once: the first one's header landed in the second's arena, and
    the next save committed a shard that neither it nor safetensors could read."""
    from asyncckpt import staging as S

    main_wrote = threading.Event()
    real = S.HostArena.write_header

    def interleaved(self: Any, header: bytes) -> None:
        # the background prepare writes its header after the foreground one (when they
        # run at once; with the fix, the foreground waits, and this waits 2 s in vain)
        if threading.current_thread() is not threading.main_thread():
            main_wrote.wait(2)
            real(self, header)
        else:
            real(self, header)
            main_wrote.set()
            time.sleep(0.5)

    monkeypatch.setattr(S.HostArena, "write_header", interleaved)
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async") as ck:
        ck.prepare({"a": torch.randn(100_000)})
        time.sleep(0.3)
        b = {"b": torch.randn(5000), "c": torch.arange(3)}
        ck.prepare(b, background=False)
        ck.save(b, step=1)
        assert torch.equal(ck.load(step=1)["c"], torch.arange(3))
    assert set(safetensors.torch.load_file(tmp_path / "step_000000001" /
                                           "rank_00000.safetensors")) == {"b", "c"}


@pytest.mark.parametrize("kwargs", [
    {"mode": ["sync"]}, {"on_busy": ["wait"]}, {"timeout_s": "5"}, {"timeout_s": math.inf},
    {"timeout_s": True}, {"direct_io": "no"},
])
def test_config_values_of_the_wrong_type_are_config_errors(tmp_path: Path,
                                                           kwargs: dict[str, Any]) -> None:
    with pytest.raises(asyncckpt.CheckpointConfigError, match=next(iter(kwargs)) + "="):
        asyncckpt.AsyncCheckpointer(tmp_path, **kwargs)


def test_an_arena_that_cannot_be_allocated_names_the_directory_and_fitting_advice(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncckpt import checkpointer as C

    def no_memory(*args: Any, **kwargs: Any) -> Any:
        raise MemoryError("no memory")

    monkeypatch.setattr(C, "HostArena", no_memory)
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async") as ck, \
            pytest.raises(asyncckpt.CheckpointSaveError) as info:
        ck.save({"w": torch.ones(4)}, step=1)
    assert str(tmp_path) in str(info.value) and "free host memory" in str(info.value)
    assert "not pinned" not in str(info.value)  # it was not pinned


def test_staging_copies_alone_once_the_interpreter_refuses_new_threads_work(
        tmp_path: Path) -> None:
    """A script that ends right after save_async(overlap=True): the copy helpers refuse
    work once the interpreter is exiting, and the save was lost (only a log line)."""
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async", copy_threads=2) as ck:
        ck.save({"w": torch.ones(4)}, step=1)  # the writer and its helpers exist now

        def exiting(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")

        ck._writer.copiers.submit = exiting  # type: ignore[union-attr, method-assign]
        state = {f"t{i}": torch.full((1000,), float(i)) for i in range(64)}
        ck.save_async(state, step=2, overlap=True).wait()
        got = ck.load(step=2)
    assert all(torch.equal(got[k], v) for k, v in state.items())


def test_a_file_where_the_directory_should_be_gets_checkpoint_errors(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_bytes(b"mine")
    for call in (lambda: asyncckpt.load(afile), lambda: asyncckpt.AsyncCheckpointer(afile).steps(),
                 lambda: asyncckpt.AsyncCheckpointer(afile).load(),
                 lambda: asyncckpt.AsyncCheckpointer(afile).latest_step()):
        with pytest.raises(asyncckpt.CheckpointNotFoundError, match="is a file"):
            call()
    for where in (afile, afile / "sub"):
        with pytest.raises(asyncckpt.CheckpointConfigError, match="is a file"):
            asyncckpt.save({"a": torch.ones(1)}, where, step=1)
    assert afile.read_bytes() == b"mine"


@pytest.mark.parametrize("kwargs,match", [
    ({"fallback": True, "step": 1}, "pass one of them"),
    ({"fallback": True, "verify": False}, "drop verify=False")])
def test_fallback_beside_what_it_would_override_is_refused(
        tmp_path: Path, kwargs: dict[str, Any], match: str) -> None:
    asyncckpt.save({"a": torch.ones(1)}, tmp_path, step=1)
    with pytest.raises(asyncckpt.CheckpointConfigError, match=match):
        asyncckpt.load(tmp_path, **kwargs)
    with pytest.raises(asyncckpt.CheckpointConfigError, match=match):
        asyncckpt.AsyncCheckpointer(tmp_path).load(**kwargs)


@pytest.mark.parametrize("address", ["https://127.0.0.1:1/v1", "s3://bucket/ckpt"])
def test_an_address_of_another_scheme_is_refused_by_name(address: str) -> None:
    with pytest.raises(asyncckpt.CheckpointConfigError, match="must start with http://"):
        asyncckpt.load(address)


@pytest.mark.parametrize("address", ["http:/127.0.0.1:1/v1", "HTTP:127.0.0.1:1/v1",
                                     "https:/host/v1"])
def test_an_address_missing_a_slash_is_refused_as_an_address(address: str) -> None:
    """(a trial's http:/x was read as a local path: "no checkpoint directory at http:/x")"""
    with pytest.raises(asyncckpt.CheckpointConfigError, match=r"not a peer's address .*two "
                                                             r"slashes after http:"):
        asyncckpt.load(address)


def test_an_address_s_scheme_may_be_in_any_case() -> None:
    """(RFC 3986: a trial's HTTP://host/v1 was refused as another scheme)"""
    from asyncckpt.transport import HTTPTransport

    with HTTPTransport(timeout=5.0) as srv:
        state = {"w": torch.arange(5.0)}
        srv.send_checkpoint([1], 3, state, 5.0)
        got = asyncckpt.load(srv.address().replace("http://", "HTTP://", 1), step=3)
    assert torch.equal(got["w"], state["w"])


def test_fallback_from_a_peer_address_is_refused() -> None:
    with pytest.raises(asyncckpt.CheckpointConfigError, match="drop fallback"):
        asyncckpt.load("http://127.0.0.1:1/v1", fallback=True)


class _Reentrant:
    """A stateful object whose state_dict() runs ``hook`` once: a signal handler or
    another thread calling in while save_async flattens the state."""

    def __init__(self, hook: Callable[[], None]):
        self.hook: Callable[[], None] | None = hook

    def state_dict(self) -> dict[str, Any]:
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()
        return {"x": torch.ones(3)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass


def test_a_call_from_within_save_async_is_refused_and_the_save_lands(tmp_path: Path) -> None:
    """A save_async started before the one running has returned (a signal handler
    interrupting it) would stage into the same arena while the first is written from it,
    or deadlock waiting for it: it is refused, and the running save is not harmed."""
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async") as ckpt:
        ckpt.save({"w": torch.zeros(4)}, 1)  # the arena exists: the next save reuses it
        refused: list[BaseException] = []

        def handler() -> None:
            for call in (lambda: ckpt.save_async({"w": torch.full((4,), 9.0)}, 999),
                         lambda: ckpt.prepare({"w": torch.zeros(4)}), ckpt.close):
                try:
                    call()
                except asyncckpt.CheckpointInFlightError as exc:
                    refused.append(exc)

        state = {"w": torch.arange(4.0), "obj": _Reentrant(handler)}
        ckpt.save_async(state, 2).wait()
        assert len(refused) == 3, refused
        assert "while its save_async() is still running on thread 'MainThread'" in str(
            refused[0])
        assert "set a flag and save from the training loop" in str(refused[0])
        assert ckpt.steps() == [1, 2]
        assert torch.equal(ckpt.load(step=2)["w"], torch.arange(4.0))
        ckpt.save({"w": torch.ones(4)}, 3)  # and the checkpointer goes on as before
        # (an integrator's thread was told "its save_async()" beside a save())
        refused.clear()
        ckpt.save({"w": torch.arange(4.0), "obj": _Reentrant(handler)}, 4)
        assert "save_async() of the checkpointer" in str(refused[0])
        assert "while its save() is still running on thread 'MainThread'" in str(refused[0])
    assert asyncckpt.AsyncCheckpointer(tmp_path).steps() == [1, 2, 3, 4]


def test_save_async_from_a_second_thread_meanwhile_is_refused(tmp_path: Path) -> None:
    inside, go_on = threading.Event(), threading.Event()

    def hold() -> None:
        inside.set()
        assert go_on.wait(30)

    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async") as ckpt:
        first = threading.Thread(
            target=lambda: ckpt.save({"w": torch.ones(4), "obj": _Reentrant(hold)}, 1))
        first.start()
        try:
            assert inside.wait(30)
            with pytest.raises(asyncckpt.CheckpointInFlightError,
                               match="from several threads, save from one"):
                ckpt.save_async({"w": torch.full((4,), 2.0)}, 2)
        finally:
            go_on.set()
            first.join(30)
        assert ckpt.steps() == [1]
        assert torch.equal(ckpt.load(step=1)["w"], torch.ones(4))


def test_a_tensor_resized_once_staged_does_not_fail_its_save(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once save_async returns the tensors are the caller's again; the manifest record,
    built later on the hash thread, must take the shapes the save began with."""
    from asyncckpt import writer

    resized = threading.Event()
    real = writer._record

    def late_record(job: Any, checksums: Any) -> Any:
        assert resized.wait(30)
        return real(job, checksums)

    monkeypatch.setattr(writer, "_record", late_record)
    buf = torch.arange(6.0)
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async") as ckpt:
        fut = ckpt.save_async({"buf": buf}, 1)
        buf.resize_(2, 2)
        resized.set()
        fut.wait()
        assert ckpt.manifest(1).tensors["buf"].shape == (6,)
        assert torch.equal(ckpt.load(step=1)["buf"], torch.arange(6.0))


def test_ckpt_wait_reports_a_failure_it_has_not_handed_over_once(tmp_path: Path) -> None:
    storage = GatedStorage()
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async", storage=storage) as ckpt:
        storage.fail_with = OSError(errno.EIO, "injected")
        ckpt.save_async({"w": torch.ones(4)}, step=1)
        with pytest.raises(asyncckpt.CheckpointSaveError, match="injected"):
            ckpt.wait()
        assert ckpt.wait() is None  # once
        storage.fail_with = None


def test_wait_staged_of_a_save_that_failed_first_raises_why(tmp_path: Path) -> None:
    """overlap=True: the save fails before staging starts (its directory cannot be
    made); wait_staged must raise that failure, not only "failed before staging", and
    must not mark it seen without having said what it was."""
    class NoTmpDir(LocalStorage):
        def makedirs(self, path: Path) -> None:
            if ".tmp-" in str(path):
                raise OSError(errno.ENOSPC, "No space left on device")
            super().makedirs(path)

    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async", storage=NoTmpDir()) as ckpt:
        go = threading.Event()
        ckpt._ensure_writer().stager.submit(go.wait, 30)  # staging starts once it failed
        fut = ckpt.save_async({"w": torch.ones(1 << 20)}, step=1, overlap=True)
        while not fut.done():
            time.sleep(0.01)
        go.set()
        with pytest.raises(asyncckpt.CheckpointSaveError, match="disk is full"):
            fut.wait_staged()
        assert fut.observed
        assert ckpt.wait() is None and ckpt.steps() == []


def test_the_collector_runs_while_a_save_writes_and_a_load_calls_user_code(
        tmp_path: Path) -> None:
    """The cyclic collector is paused only over the bursts of small objects (flattening,
    the layout, planning, the copy): not over the write a sync save waits for, nor over
    the user's load_state_dict, which may make cycles of its own."""
    seen: dict[str, bool] = {}

    class Recording(LocalStorage):
        def write_arena(self, *args: Any, **kw: Any) -> Any:
            out = super().write_arena(*args, **kw)
            time.sleep(0.5)  # (the copy of a few bytes is long over: save() waits)
            seen["write"] = gc.isenabled()
            return out

    class Obj:
        def state_dict(self) -> dict[str, Any]:
            return {"x": torch.ones(2)}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            seen["load_state_dict"] = gc.isenabled()

    assert gc.isenabled()
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="sync", storage=Recording()) as ckpt:
        ckpt.save({"obj": Obj(), "w": torch.ones(3)}, 1)
        ckpt.load({"obj": Obj(), "w": torch.zeros(3)})
    assert seen == {"write": True, "load_state_dict": True}


def test_the_collector_runs_while_a_save_waits_for_the_previous_one(tmp_path: Path) -> None:
    storage = GatedStorage()
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async", storage=storage) as ckpt:
        storage.gate.clear()  # step 1's write waits
        ckpt.save_async({"w": torch.ones(4)}, 1)
        seen: list[bool] = []

        def sample_then_open() -> None:
            time.sleep(0.5)  # the next save_async is waiting for step 1 by now
            seen.append(gc.isenabled())
            storage.gate.set()

        sampler = threading.Thread(target=sample_then_open)
        sampler.start()
        ckpt.save_async({"w": torch.ones(4)}, 2).wait()
        sampler.join()
        assert seen == [True] and ckpt.steps() == [1, 2]


@pytest.mark.parametrize("name", [".step_000000001.tmp-abc123def456",
                                  ".step_000000001.deleting-abc123def456"])
def test_a_load_refuses_an_uncommitted_directory_passed_by_path(tmp_path: Path, name: str):
    """Loads read committed steps only, also when handed a temporary or retiring
    directory's path (one may hold part of a step); the CLI still inspects it."""
    asyncckpt.save({"w": torch.ones(2)}, tmp_path / "ck", step=1)
    odd = tmp_path / "ck" / name
    (tmp_path / "ck" / "step_000000001").rename(odd)
    with pytest.raises(asyncckpt.CheckpointNotFoundError, match="loads read committed steps "
                                                                 "only"):
        asyncckpt.load(odd)
    with pytest.raises(asyncckpt.CheckpointNotFoundError):
        asyncckpt.AsyncCheckpointer(odd).load()
    from asyncckpt.cli import main
    assert main(["verify", str(odd)]) == 0


def test_a_save_without_tensors_reports_the_bytes_it_wrote_none(tmp_path: Path) -> None:
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async") as ck:
        info = ck.save_async({"step": 3, "name": "run"}, step=1).wait()
        assert sorted(p.name for p in info.path.iterdir()) == ["manifest.json"]
        assert info.bytes == 0  # was the size of a shard file that is never written
        info = ck.save_async({"step": 3, "w": torch.ones(10)}, step=2).wait()
        assert info.bytes == (info.path / "rank_00000.safetensors").stat().st_size


def test_an_empty_or_non_path_directory_is_refused_naming_the_argument(tmp_path: Path,
                                                                        monkeypatch: Any
                                                                        ) -> None:
    monkeypatch.chdir(tmp_path)  # "" meant the current directory: it must stay empty
    for bad, name in (("", "directory"), (None, "directory"), (b"run", "directory")):
        with pytest.raises(asyncckpt.CheckpointConfigError, match=f"^{name}="):
            asyncckpt.AsyncCheckpointer(bad)  # type: ignore[arg-type]
    with pytest.raises(asyncckpt.CheckpointConfigError, match=r"^directory=''"):
        asyncckpt.save({"w": torch.ones(2)}, "")
    with pytest.raises(asyncckpt.CheckpointConfigError, match=r"^path=''"):
        asyncckpt.load("")
    assert list(tmp_path.iterdir()) == []
    asyncckpt.save({"w": torch.ones(2)}, ".", step=1)  # the current directory, said so
    assert asyncckpt.load(".")["w"].tolist() == [1.0, 1.0]


@pytest.mark.parametrize("n, threads", [(1000, 1), (2_000_000, 2)])  # serial, parallel
def test_a_tensor_whose_memory_shrank_before_it_was_staged_fails_the_save(
        tmp_path: Path, n: int, threads: int) -> None:
    """``w.data = smaller`` before wait_staged(): staging memmoved the planned bytes from
    the new, smaller memory, reading past its end (garbage committed, or a crash)."""
    ck = asyncckpt.AsyncCheckpointer(tmp_path, mode="async", copy_threads=threads)
    w = torch.nn.Parameter(torch.ones(n))
    state = {"w": w, "b": torch.ones(n)}
    ck.save(state, step=1)
    gate = threading.Event()
    ck._ensure_writer().stager.submit(gate.wait, 10)  # the copy waits behind this
    fut = ck.save_async(state, step=2, overlap=True)
    w.data = torch.full((10,), 2.0)  # the contract broken: no wait_staged() first
    gate.set()
    with pytest.raises(asyncckpt.CheckpointSaveError, match="tensor 'w' changed while it "
                                                            "was being saved") as info:
        fut.wait(timeout=30)
    assert "wait_staged()" in str(info.value)
    assert ck.steps() == [1]
    ck.close()


def test_metadata_is_str_to_str_and_anything_else_is_refused_naming_the_key(
        tmp_path: Path) -> None:
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async") as ck:
        state = {"w": torch.ones(2)}
        ck.save(state, step=1, metadata={"run": "a", "loss": 0.25, "n": 3, "ok": True})
        assert ck.manifest(1).user_metadata == {"run": "a", "loss": "0.25", "n": "3",
                                                "ok": "True"}
        cases = [({"cfg": {"lr": 1}}, r"metadata\['cfg'\] is of type dict"),  # was its repr
                 ({"o": object()}, r"metadata\['o'\] is of type object"),  # failed later
                 ({1: "x"}, "metadata key 1: keys must be str"),
                 ("ab", "pass a mapping of str to str")]
        for bad, message in cases:
            with pytest.raises(asyncckpt.CheckpointConfigError, match=message):
                ck.save_async(state, step=2, metadata=bad)  # type: ignore[arg-type]
        ck.save(state, step=2)  # nothing was left pending by the refusals
        assert ck.steps() == [1, 2] and ck.manifest(2).user_metadata == {}


def test_one_process_saving_part_of_a_hand_sharded_tensor_is_refused_at_once(
        tmp_path: Path) -> None:
    from asyncckpt import ShardMetadata

    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async") as ck:
        rows = torch.ones(2, 2)
        with pytest.raises(asyncckpt.CheckpointConfigError,
                           match=r"shards\['w'\]: a box of shape \[2, 2\] at offsets \[2, 0\] "
                                 r"of a tensor of global shape \[4, 2\], saved by one process"):
            ck.save_async({"w": rows}, step=1,
                          shards={"w": ShardMetadata(global_shape=(4, 2), offsets=(2, 0))})
        # (was a CheckpointSaveError from the background: "chunks leave part ... uncovered")
        whole = ShardMetadata(global_shape=(2, 2), offsets=(0, 0))
        ck.save({"w": rows}, step=1, shards={"w": whole})  # the whole of it is a save
        assert ck.steps() == [1]


def test_a_save_that_does_not_commit_is_not_left_on_offer_to_peers(tmp_path: Path) -> None:
    """Its staged arena was offered before the commit failed, and stayed offered: a peer
    recovered step 2, which no load from disk could find (step 1's offer was gone)."""
    from asyncckpt.transport import HTTPTransport

    class FailingRename(LocalStorage):
        fail = False

        def rename(self, src: Path, dst: Path) -> None:
            if self.fail:
                raise OSError(errno.EIO, "injected EIO on rename")
            super().rename(src, dst)

    storage = FailingRename()
    transport = HTTPTransport(timeout=1.0)
    try:
        with asyncckpt.AsyncCheckpointer(tmp_path, mode="async", storage=storage) as ckpt:
            ckpt.serve(transport)
            ckpt.save({"w": torch.full((100,), 1.0)}, step=1)
            assert asyncckpt.load(transport.address(), timeout=5)["w"][0] == 1.0
            storage.fail = True
            with pytest.raises(asyncckpt.CheckpointSaveError, match="injected EIO"):
                ckpt.save({"w": torch.full((100,), 2.0)}, step=2)
            assert ckpt.steps() == [1]
            with pytest.raises(asyncckpt.CheckpointTimeoutError,
                               match="not yet, or it was withdrawn"):
                asyncckpt.load(transport.address(), timeout=1.5)
            storage.fail = False
            ckpt.save({"w": torch.full((100,), 3.0)}, step=3)  # offered again
            assert asyncckpt.load(transport.address(), timeout=5)["w"][0] == 3.0
    finally:
        transport.shutdown()


@pytest.mark.parametrize("background", [True, False])
def test_a_failed_prepare_neither_fails_nor_holds_the_next_save(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, background: bool) -> None:
    """prepare(background=False) that failed left its future pending: the next save
    waited on it for ever. A failed background prepare made the next save raise the
    prepare's error (its future had told it already), though the save's own, smaller
    state would have fitted."""
    real = asyncckpt.AsyncCheckpointer._arena_for
    calls: list[int] = []

    def out_of_memory(self: Any, plan: Any, **kwargs: Any) -> Any:
        calls.append(plan.padded_bytes)
        if len(calls) == 1:  # the prepare's allocation
            raise asyncckpt.CheckpointSaveError("could not allocate the host buffer")
        return real(self, plan, **kwargs)

    monkeypatch.setattr(asyncckpt.AsyncCheckpointer, "_arena_for", out_of_memory)
    ck = asyncckpt.AsyncCheckpointer(tmp_path, mode="async")
    if background:
        with pytest.raises(asyncckpt.CheckpointSaveError, match="could not allocate"):
            ck.prepare({"w": torch.ones(1000)}).result(timeout=30)
    else:
        with pytest.raises(asyncckpt.CheckpointSaveError, match="could not allocate"):
            ck.prepare({"w": torch.ones(1000)}, background=False)
    infos: list[Any] = []
    _within(lambda: infos.append(ck.save({"w": torch.arange(4.0)}, step=1)))
    assert [i.step for i in infos] == [1] and len(calls) == 2
    _within(ck.close)
    assert asyncckpt.load(tmp_path)["w"].tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("value", ["false", 0, 1, None, [True]])
def test_flag_arguments_that_are_not_bools_are_refused_before_anything_happens(
        tmp_path: Path, value: object) -> None:
    # read by truth, the string "false" would turn a flag on (ignore_unexpected: a partial
    # load that says nothing; overlap: a save racing the optimizer)
    from asyncckpt.export import export_safetensors

    state = {"w": torch.arange(4.0)}
    with asyncckpt.AsyncCheckpointer(tmp_path / "c", mode="async") as ck:
        ck.save(state, step=1)
        calls: list[tuple[str, Callable[[], Any]]] = [
            ("overlap", lambda: ck.save_async(state, step=2, overlap=value)),
            ("background", lambda: ck.prepare(state, background=value)),
        ] + [(name, lambda name=name: ck.load({"w": torch.zeros(4)}, **{name: value}))
             for name in ("strict", "verify", "fallback", "ignore_unexpected")] + [
            (name, lambda name=name: asyncckpt.load(tmp_path / "c", {"w": torch.zeros(4)},
                                                    **{name: value}))
            for name in ("strict", "verify", "fallback", "ignore_unexpected")] + [
            (name, lambda name=name: export_safetensors(tmp_path / "c", tmp_path / "o.st",
                                                        **{name: value}))
            for name in ("strip_prefix", "force")]
        for name, call in calls:
            with pytest.raises(asyncckpt.CheckpointConfigError, match=f"^{name}=.*True or False"):
                call()
        assert ck.steps() == [1] and not ck.is_pending
        assert not (tmp_path / "o.st").exists()
    # numpy's bools are bools
    got = asyncckpt.load(tmp_path / "c", {"w": torch.zeros(4)}, strict=np.bool_(True))
    assert torch.equal(got["w"], state["w"])


def test_the_directory_is_pinned_when_the_checkpointer_is_made(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Read again later, a relative path after os.chdir (or a symlink pointed elsewhere)
    # split a save between two directories: the data file in one, the manifest renamed
    # into place in the other, and "committed".
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    os.symlink(tmp_path / "a", tmp_path / "link")
    for where in ("runs", tmp_path / "link" / "runs"):
        with asyncckpt.AsyncCheckpointer(where, mode="async") as ck:
            ck.save({"w": torch.ones(4)}, step=1)
            monkeypatch.chdir(tmp_path / "b")
            (tmp_path / "link").unlink()
            os.symlink(tmp_path / "b", tmp_path / "link")
            info = ck.save_async({"w": torch.full((4,), 2.0)}, step=2).wait()
            assert info.path == tmp_path / "a" / "runs" / "step_000000002"
        assert asyncckpt.load(tmp_path / "a" / "runs")["w"].tolist() == [2.0] * 4
        assert not (tmp_path / "b" / "runs").exists()
        shutil.rmtree(tmp_path / "a" / "runs")
        monkeypatch.chdir(tmp_path / "a")
        (tmp_path / "link").unlink()
        os.symlink(tmp_path / "a", tmp_path / "link")


def test_a_save_whose_shard_file_vanished_is_not_committed(tmp_path: Path) -> None:
    class LosesTheFile(LocalStorage):
        def fsync_dir(self, path: Path) -> None:  # (the commit's, just before the rename)
            if ".tmp-" in path.name:
                for f in path.glob("rank_*.safetensors"):
                    f.unlink()
            super().fsync_dir(path)

    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async", storage=LosesTheFile()) as ck:
        with pytest.raises(asyncckpt.CheckpointSaveError,
                           match=r"step 1 aborted, nothing committed: its shard file .*"
                                 r"rank_00000.safetensors is not there"):
            ck.save({"w": torch.ones(4)}, step=1)
        assert ck.steps() == [] and not (tmp_path / "step_000000001").exists()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX only")
def test_a_forked_child_neither_hangs_nor_saves_with_its_parents_checkpointer(
        tmp_path: Path) -> None:
    # No thread of the child finishes the save in flight at the fork: closing (at exit,
    # or by the garbage collector) waited for it forever, as did a save or a wait.
    held = GatedCommit()
    gate = held.gate
    ck = asyncckpt.AsyncCheckpointer(tmp_path, mode="async", storage=held)
    fut = ck.save_async({"w": torch.ones(4)}, step=1)
    r, w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads around
        pid = os.fork()
    if pid == 0:  # the child: report, then leave as a script ends (the collector closes)
        code = 0
        try:
            os.close(r)
            said = []
            # (a trial's child polled fut.done() and ckpt.is_pending: False and True for
            # ever); repr() says what it knows, without raising
            said.append("repr" if "saving step 1" in repr(ck) and "step=1" in repr(fut)
                        else repr(ck))
            for call in (lambda: ck.save({"w": torch.zeros(4)}, step=2), ck.wait, fut.wait,
                         lambda: ck.load(), fut.done, lambda: ck.is_pending,
                         fut.exception, fut.progress):  # (its phase stayed "writing")
                try:
                    call()
                    said.append("no error")
                except asyncckpt.CheckpointClosedError as exc:
                    said.append("refused" if "forked from" in str(exc) else str(exc))
                    if "load()" in str(exc) and "(or read with asyncckpt.load(" not in str(exc):
                        said[-1] = "no hint: " + str(exc)
            ck.close()
            os.write(w, ",".join(said).encode())
        except BaseException:
            code = 1
        finally:
            os.close(w)
            del ck  # (__del__ must return at once)
            os._exit(code)
    os.close(w)
    deadline = time.monotonic() + 20
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    with os.fdopen(r, "rb") as f:  # (the child wrote before it left, or was killed)
        said = f.read().decode()
    assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0, "the child hung"
    assert said == "repr," + ",".join(["refused"] * 8), said
    gate.set()
    assert fut.wait(30).step == 1 and ck.steps() == [1]  # the parent's save is unharmed
    ck.close()


def test_save_and_close_from_a_handler_that_interrupted_a_load_do_not_hang(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A SIGTERM handler that saves and closes, run while the load it interrupted picks its
    # step (holding the lock retention takes), waited for close() -> retention -> that
    # lock, on the very thread holding it: the process hung for good.
    import asyncckpt.commit as cmod

    monkeypatch.setattr(cmod, "RETENTION_LOCK_S", 0.2, raising=False)
    ck = asyncckpt.AsyncCheckpointer(tmp_path, keep_last=1)
    ck.save({"w": torch.ones(4)}, 1)
    ck.save({"w": torch.ones(4)}, 2)
    raised: list[BaseException] = []

    def handler_during_load() -> None:
        with ck._in_use.lock:  # where a load holds it, as the handler interrupts it
            try:
                ck.discard_steps_after(1)
            except asyncckpt.CheckpointInFlightError as exc:
                raised.append(exc)
            ck.save({"w": torch.full((4,), 3.0)}, 3)
            ck.close()

    with caplog.at_level(logging.WARNING, logger="asyncckpt.writer"):
        t = threading.Thread(target=handler_during_load, daemon=True)
        t.start()
        t.join(30)
        hung = t.is_alive()
        if hung:
            ck._in_use.lock.release()  # (let it finish, then fail)
            t.join(30)
    assert not hung, "save + close under a load's lock hung"
    assert raised and "did not let go of its steps" in str(raised[0])
    assert "left to the next save's retention" in caplog.text
    assert asyncckpt.AsyncCheckpointer(tmp_path).steps() == [2, 3]  # step 3 committed
    with asyncckpt.AsyncCheckpointer(tmp_path, keep_last=1) as again:
        again.save({"w": torch.ones(4)}, 4)
        again.wait()
    assert asyncckpt.load(tmp_path)["w"].sum() == 4 and len(list(tmp_path.glob("step_*"))) == 1


def test_the_module_level_fallback_load_marks_the_damaged_step_too(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """api.md has asyncckpt.load(fallback=True) behave as ckpt.load: a trial's did not
    mark, and a later keep_last=2 deleted the intact step 1 and kept the corrupt 2."""
    with asyncckpt.AsyncCheckpointer(tmp_path) as ck:
        for s in (1, 2):
            ck.save({"w": torch.full((10,), float(s))}, step=s)
    _flip_a_byte(tmp_path / "step_000000002")
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        assert asyncckpt.load(tmp_path, fallback=True)["w"][0].item() == 1.0
    assert "step(s) [2] under" in caplog.text and "marked by damaged.json" in caplog.text
    assert "AsyncCheckpointer(root).discard_steps_after(<the step loaded>)" in caplog.text
    assert not asyncckpt.storage.DirectoryLock(tmp_path).held_in_this_process()  # (let go)
    with asyncckpt.AsyncCheckpointer(tmp_path, keep_last=2) as ck:
        ck.save({"w": torch.full((10,), 3.0)}, step=3)
        assert ck.steps() == [1, 2, 3]  # the intact 1 kept, 2 for a look


def test_only_rank_0_of_a_job_marks_in_a_module_level_fallback_load(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """(a review) every rank of a job calling asyncckpt.load(fallback=True) took the lock
    to mark, and rank 0's first save could meet one of them holding it."""
    with asyncckpt.AsyncCheckpointer(tmp_path) as ck:
        for s in (1, 2):
            ck.save({"w": torch.full((10,), float(s))}, step=s)
    _flip_a_byte(tmp_path / "step_000000002")
    monkeypatch.setenv("RANK", "1")
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        assert asyncckpt.load(tmp_path, fallback=True)["w"][0].item() == 1.0
    assert "rank=1: step(s) [2] under" in caplog.text and "marked by damaged.json" not in \
        caplog.text and "(not marked by this rank: rank 0 marks what its own load finds)" \
        in caplog.text
    assert not (tmp_path / "step_000000002" / "damaged.json").exists()
    monkeypatch.setenv("RANK", "0")
    asyncckpt.load(tmp_path, fallback=True)
    assert (tmp_path / "step_000000002" / "damaged.json").exists()


def test_a_damaged_mark_cut_short_by_a_full_disk_is_not_left_behind(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A trial's full disk left a 0-byte damaged.json that later read as a mark ("not a
    JSON object"), where the warning said none was written."""
    class Full(asyncckpt.storage.LocalStorage):
        def write_bytes(self, path: Path, data: bytes) -> None:
            if path.name == "damaged.json":
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                os.close(fd)  # created, then no room for a byte of it
                raise OSError(errno.ENOSPC, "No space left on device")
            super().write_bytes(path, data)

    with asyncckpt.AsyncCheckpointer(tmp_path) as ck:
        for s in (1, 2):
            ck.save({"w": torch.full((10,), float(s))}, step=s)
    _flip_a_byte(tmp_path / "step_000000002")
    with caplog.at_level(logging.WARNING, logger="asyncckpt"), \
            asyncckpt.AsyncCheckpointer(tmp_path, storage=Full()) as ck:
        assert ck.load(fallback=True)["w"][0].item() == 1.0
    assert "could not be written (step 2: No space left on device)" in caplog.text
    assert not (tmp_path / "step_000000002" / "damaged.json").exists()


def test_a_host_buffer_that_cannot_be_allocated_is_told_in_words(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A trial's message read "...the host buffer of 4398.05 GB that saves into DIR stage
    into (OSError ...)"."""
    import asyncckpt.checkpointer as checkpointer_module

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(checkpointer_module, "HostArena", refuse)
    with asyncckpt.AsyncCheckpointer(tmp_path) as ck, pytest.raises(
            asyncckpt.CheckpointSaveError) as err:
        ck.save({"w": torch.zeros(1).expand(1000)}, step=1)
    text = str(err.value)
    assert text.startswith("rank 0: could not allocate the host buffer of 0.00 GB (OSError: ")
    assert f"into which the saves to {tmp_path} copy the state: free host memory" in text
    assert "ulimit -v" not in text  # (no limit here)
    assert ck.steps() == []
    # (a memory trial's ulimit -v refused a save with memory to spare)
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda what: (4_000_000_000, -1))
    with asyncckpt.AsyncCheckpointer(tmp_path) as ck, pytest.raises(
            asyncckpt.CheckpointSaveError) as err:
        ck.save({"w": torch.zeros(4)}, step=1)
    assert ("This process's address space is limited to 4.00 GB (ulimit -v), which counts "
            "what threads reserve") in str(err.value)
    assert "MALLOC_ARENA_MAX=2" in str(err.value)


def test_a_path_under_a_file_names_the_file_not_the_path(tmp_path: Path) -> None:
    """(a trial: DIR/iamafile/sub was said to be a file)"""
    (tmp_path / "iamafile").write_text("x")
    for call in (lambda: asyncckpt.AsyncCheckpointer(tmp_path / "iamafile" / "sub").steps(),
                 lambda: asyncckpt.load(tmp_path / "iamafile" / "sub")):
        with pytest.raises(asyncckpt.CheckpointNotFoundError) as err:
            call()
        assert str(err.value) == (f"no checkpoint directory at {tmp_path / 'iamafile' / 'sub'}"
                                  f": {tmp_path / 'iamafile'}, on its path, is a file; check "
                                  "the path")
    with pytest.raises(asyncckpt.CheckpointNotFoundError, match="iamafile is a file, not a "):
        asyncckpt.load(tmp_path / "iamafile")


def test_a_file_named_as_a_step_is_said_to_be_a_file(tmp_path: Path) -> None:
    with asyncckpt.AsyncCheckpointer(tmp_path) as ck:
        ck.save({"w": torch.ones(2)}, step=1)
        (tmp_path / "step_000000005").write_text("x")
        with pytest.raises(asyncckpt.CheckpointExistsError,
                           match=r"step_000000005 is in the way of step 5's commit: it is a "
                                 r"file, not a step directory"):
            ck.save({"w": torch.ones(2)}, step=5)
        ck.save({"w": torch.ones(2)}, step=6)
        assert ck.steps() == [1, 6]


def test_the_host_buffer_grows_with_room_and_gives_back_what_a_shrunk_state_left(
        tmp_path: Path) -> None:
    """A soak trial: a state growing by 16 KiB a save made a new host buffer at every save
    (blocked 10 -> 19 ms), and one that shrank for good kept its old size until close."""
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async") as ck:
        big = torch.zeros(24 << 20)  # 96 MiB
        ck.save({"w": big}, step=0)
        first = ck.host_buffer_bytes
        assert first < 98 << 20  # (the first: as needed)
        sizes = []
        for s in range(1, 11):  # grows 16 KiB a save
            ck.save({"w": big, "g": torch.zeros(4096 * s)}, step=s)
            sizes.append(ck.host_buffer_bytes)
        assert len(set(sizes)) == 1 and sizes[0] > first, sizes  # made anew once only
        small = {"w": torch.zeros(1 << 20)}  # 4 MiB: far less, for good
        held = []
        for s in range(11, 16):
            ck.save(small, step=s)
            held.append(ck.host_buffer_bytes)
        assert held[0] == sizes[0] and held[-1] < 8 << 20, held  # given back, not at once
        alternating = []
        for s in range(16, 24):  # alternating: made anew once, not at each save
            ck.save({"w": big} if s % 2 else small, step=s)
            alternating.append(ck.host_buffer_bytes)
        assert len(set(alternating[1:])) == 1 and alternating[1] > 96 << 20, alternating
        assert asyncckpt.load(tmp_path, step=23)["w"].numel() == big.numel()


def test_a_shrunk_host_buffer_fits_the_largest_of_the_small_saves_and_prepare_counts_not(
        tmp_path: Path) -> None:
    """(a review) the new buffer was the third small save's size, which the next, a
    little larger, outgrew at once; a prepare() counted as a save and shrank it without
    stopping what peers were served from it."""
    mib = 1 << 18  # float32 elements in a MiB
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async") as ck:
        ck.save({"w": torch.zeros(160 * mib)}, step=0)
        big = ck.host_buffer_bytes
        ck.save({"w": torch.zeros(20 * mib)}, step=1)
        ck.save({"w": torch.zeros(4 * mib)}, step=2)
        ck.prepare({"w": torch.zeros(4 * mib)}, background=False)  # (no save: not counted)
        assert ck.host_buffer_bytes == big
        ck.save({"w": torch.zeros(8 * mib)}, step=3)  # the third small save
        shrunk = ck.host_buffer_bytes
        assert 20 << 20 < shrunk < 24 << 20, shrunk  # the largest (20 MiB), 1/16 to spare
        ck.save({"w": torch.zeros(21 * mib)}, step=4)
        assert ck.host_buffer_bytes == shrunk  # (fits still)


def test_a_directory_of_another_format_s_checkpoint_is_told_where_no_step_is_found(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """(a migration trial) a checkpointer on the old run's directory (last.pt, or a DCP
    checkpoint): latest_step() said None without a word, and the resume began at 0."""
    torch.save({"w": torch.ones(2)}, tmp_path / "last.pt")
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        ck = asyncckpt.AsyncCheckpointer(tmp_path)
        assert ck.latest_step() is None and ck.steps() == []
    said = [r.getMessage() for r in caplog.records if "no committed asyncckpt step" in
            r.getMessage()]
    assert len(said) == 1 and "torch.save files (last.pt)" in said[0], said  # (said once)
    ck.save({"w": torch.ones(2)}, step=1)
    ck.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        assert asyncckpt.AsyncCheckpointer(tmp_path / "fresh").latest_step() is None
    assert not caplog.records  # (an empty directory: nothing to say)


def test_a_run_directory_s_other_files_are_no_checkpoint_to_warn_of(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """(a review) a tokenizer's .tar or a run's training_args.bin, and a .metadata file
    without DCP's shards, were taken for another format's checkpoint."""
    (tmp_path / "tokenizer.tar").write_bytes(b"x")
    (tmp_path / "training_args.bin").write_bytes(b"x")
    (tmp_path / ".metadata").write_bytes(b"x")
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        assert asyncckpt.AsyncCheckpointer(tmp_path).latest_step() is None
    assert not caplog.records, caplog.text
    (tmp_path / "__0_0.distcp").write_bytes(b"x")
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        asyncckpt.AsyncCheckpointer(tmp_path).steps()
    assert "PyTorch DCP checkpoint" in caplog.text


def test_a_fallback_load_writes_no_mark_through_a_step_linked_out_of_the_root(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """(security review) A downloaded root whose step 2 was a link to a directory elsewhere:
    a fallback load wrote damaged.json there. It writes nothing outside the root, and says
    so; step 1 loads."""
    root = tmp_path / "dl"
    for s in (1, 2):
        asyncckpt.save({"w": torch.arange(4.0) + s}, root, step=s)
    shard = root / "step_000000002" / "rank_00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    outside = tmp_path / "elsewhere"
    shutil.move(str(root / "step_000000002"), str(outside))
    (root / "step_000000002").symlink_to(outside)
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        got = asyncckpt.load(root, fallback=True)
    assert torch.equal(got["w"], torch.arange(4.0) + 1)
    assert sorted(p.name for p in outside.iterdir()) == ["manifest.json", "rank_00000.safetensors"]
    assert "leads out of" in caplog.text, caplog.text


def test_a_fallback_load_marks_no_other_step_through_a_step_linked_to_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """(adversary trial) Step 30 a link to step 10's directory: refused (the manifest of
    step 10), it was marked through the link, so intact step 10 read as damaged and the
    next save's retention removed it."""
    for s in (10, 20):
        asyncckpt.save({"w": torch.full((4,), float(s))}, tmp_path, step=s)
    os.symlink("step_000000010", tmp_path / "step_000000030")
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        got = asyncckpt.load(tmp_path, fallback=True)
    assert torch.equal(got["w"], torch.full((4,), 20.0))
    assert not (tmp_path / "step_000000010" / "damaged.json").exists()
    assert "leads elsewhere in" in caplog.text, caplog.text
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="sync", keep_last=3) as ck:
        ck.save({"w": torch.full((4,), 40.0)}, step=40)
    assert (tmp_path / "step_000000010" / "manifest.json").exists()


_CLEAN_HOLDER = """\
import sys
from pathlib import Path
from asyncckpt.storage import DirectoryLock
lock = DirectoryLock(Path(sys.argv[1]), purpose=sys.argv[2])
assert lock.acquire()
print("held", flush=True)
sys.stdin.readline()
lock.release()
print("released", flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("purpose", ["clean", "mark"])
def test_a_save_waits_for_asyncckpt_clean_to_release_the_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, purpose: str) -> None:
    """(operations trial) While `asyncckpt clean` (a cron job) held the lock, a trainer
    starting there failed its first save, told another process "is saving" there: it
    waits for the clean, and one that holds on is named as what it is. So for a load
    beside it that marks a step damaged (a review: plain loads mark too)."""
    import asyncckpt.checkpointer as C
    from asyncckpt.storage import DirectoryLock

    asyncckpt.save({"w": torch.zeros(4)}, tmp_path, step=1)

    def hold() -> subprocess.Popen[str]:
        p = subprocess.Popen([sys.executable, "-c", _CLEAN_HOLDER, str(tmp_path), purpose],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert p.stdout is not None and p.stdout.readline().strip() == "held"
        return p

    def let_go(p: subprocess.Popen[str]) -> None:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()

    holder = hold()
    try:
        assert DirectoryLock(tmp_path).holder_purpose() == purpose
        threading.Timer(0.5, let_go, (holder,)).start()
        t0 = time.monotonic()
        with asyncckpt.AsyncCheckpointer(tmp_path) as ck:
            ck.save({"w": torch.ones(4)}, step=2)
            assert time.monotonic() - t0 >= 0.4  # (it waited for the clean to end)
            assert ck.steps() == [1, 2]
    finally:
        holder.communicate("go\n", timeout=30)
    assert DirectoryLock(tmp_path).holder_purpose() == ""  # a save's lock names none
    monkeypatch.setattr(C, "_CLEAN_WAIT_S", 0.3)
    holder = hold()
    try:
        who, doing = (("`asyncckpt clean`", "removing what earlier runs left there")
                      if purpose == "clean" else
                      ("a load", r"marking a step it found damaged \(damaged.json\)"))
        with pytest.raises(asyncckpt.CheckpointLockedError, match=(
                rf"{who} \(pid {holder.pid} on host .*\) has held "
                rf"{re.escape(str(tmp_path))} for 0.3s, {doing}: save again once it ends")):
            asyncckpt.AsyncCheckpointer(tmp_path).save({"w": torch.ones(4)}, step=3)
    finally:
        holder.communicate("go\n", timeout=30)


_UNWRITTEN_HOLDER = """\
import fcntl, os, sys
fd = os.open(os.path.join(sys.argv[1], ".asyncckpt.lock"), os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
os.ftruncate(fd, 0)  # (taken, not yet written: what every holder is for a moment)
print("held", flush=True)
sys.stdin.readline()
os.close(fd)
sys.stdin.read()
"""


def test_a_save_waits_a_moment_for_a_holder_that_has_not_written_who_it_is(
        tmp_path: Path) -> None:
    """(evaluator trial) A reader marking a step damaged takes the lock a moment, and
    writes its purpose just after: a trainer's first save caught in between failed at once,
    "another process (pid unknown) is saving", 6 restarts in 100."""
    asyncckpt.save({"w": torch.zeros(4)}, tmp_path, step=1)
    holder = subprocess.Popen([sys.executable, "-c", _UNWRITTEN_HOLDER, str(tmp_path)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"

        def let_go() -> None:
            assert holder.stdin is not None
            holder.stdin.write("go\n")
            holder.stdin.flush()

        threading.Timer(0.3, let_go).start()
        with asyncckpt.AsyncCheckpointer(tmp_path) as ck:
            ck.save({"w": torch.ones(4)}, step=2)
            assert ck.steps() == [1, 2]
    finally:
        holder.communicate("go\n", timeout=30)


def test_a_reader_beside_a_trainer_says_the_trainer_does_not_know_of_the_damage(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """(re-check trial) An evaluator that found a step damaged while a trainer held the
    lock marks nothing, and its warning said "keep_last does not count them": the
    trainer's retention, knowing nothing, goes on counting (and keep_best ranking) them."""
    for s in (1, 2):
        asyncckpt.save({"w": torch.arange(1000.0)}, tmp_path, step=s)
    _flip_a_byte(tmp_path / "step_000000002")
    holder = subprocess.Popen([sys.executable, "-c", _CLEAN_HOLDER, str(tmp_path), ""],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with caplog.at_level(logging.WARNING, logger="asyncckpt"), pytest.raises(
                asyncckpt.CheckpointCorruptError):
            asyncckpt.load(tmp_path, step=2)
    finally:
        holder.communicate("go\n", timeout=30)
    assert not (tmp_path / "step_000000002" / "damaged.json").exists()
    assert "the process saving there does not know of them" in caplog.text, caplog.text
    assert "keep_last does not count them" not in caplog.text


def test_saving_the_step_of_the_save_in_flight_says_it_is_saved(tmp_path: Path) -> None:
    # (a preemption trial asked should_stop() after the periodic save_async: latest_step()
    # did not count the step in flight, the final save of it raised, and the error's
    # advice, discard_steps_after(step - 1), would have deleted the step just committed)
    from asyncckpt.storage import LocalStorage

    gate = threading.Event()

    class HeldCommit(LocalStorage):  # (the save stays in flight until the gate opens)
        def rename(self, src: Path, dst: Path) -> None:
            assert gate.wait(30)
            super().rename(src, dst)

    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async", storage=HeldCommit()) as ck:
        state = {"w": torch.ones(1000)}
        ck.save_async(state, step=3)
        threading.Timer(0.3, gate.set).start()
        with pytest.raises(asyncckpt.CheckpointExistsError) as info:
            ck.save_async(state, step=3).wait()
        assert "by this checkpointer's own previous save of it (in flight, or not waited " \
               "for, when this call came): it is saved, nothing to do" in str(info.value)
        assert "discard_steps_after" not in str(info.value)
        assert ck.steps() == [3]
    other = asyncckpt.AsyncCheckpointer(tmp_path, mode="async")  # (not its own: the advice)
    with other, pytest.raises(asyncckpt.CheckpointExistsError, match="discard_steps_after"):
        other.save({"w": torch.ones(1000)}, step=3)


def test_saving_the_step_of_a_save_committed_since_but_not_waited_for_says_it_is_saved(
        tmp_path: Path) -> None:
    # (a trial's guard, latest_step() != step, ran while the periodic save was in flight;
    # a validation pass later, the save had committed, and the final save of the step
    # was told to discard_steps_after(step - 1), which would delete the step just saved)
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async") as ck:
        state = {"w": torch.ones(1000)}
        fut = ck.save_async(state, step=3)
        while not fut.done():
            time.sleep(0.01)
        with pytest.raises(asyncckpt.CheckpointExistsError) as info:
            ck.save(state, step=3)
        assert "own previous save of it" in str(info.value)
        assert "discard_steps_after" not in str(info.value)


def test_saving_a_step_saved_before_keeps_the_advice_to_save_it_anew(tmp_path: Path) -> None:
    # (the review: a step saved and waited for is no save in flight)
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async") as ck:
        ck.save({"w": torch.ones(10)}, step=3)
        with pytest.raises(asyncckpt.CheckpointExistsError) as info:
            ck.save({"w": torch.zeros(10)}, step=3)
        assert "in flight" not in str(info.value)
        assert "ckpt.discard_steps_after(2)" in str(info.value)


def test_a_failure_handled_through_its_future_is_not_raised_again_once_it_is_dropped(
        tmp_path: Path) -> None:
    # (an integrator's callback asked a failed save's future, logged it and dropped it:
    # close() raised it again, in place of the training error being handled)
    import gc

    from asyncckpt.storage import LocalStorage

    class FailStep2(LocalStorage):
        def write_arena(self, path: Path, *args: Any, **kwargs: Any) -> Any:
            if "step_000000002" in str(path):
                raise OSError(5, "injected EIO")
            return super().write_arena(path, *args, **kwargs)

    ck = asyncckpt.AsyncCheckpointer(tmp_path, mode="async", storage=FailStep2())
    futs = [ck.save_async({"w": torch.ones(4)}, 2)]
    futs.append(ck.save_async({"w": torch.ones(4)}, 3))  # (after step 2's failure)
    assert [f.exception() is not None for f in futs] == [True, False]
    futs.clear()
    gc.collect()
    ck.close()  # (raised "an earlier save failed and nobody waited on its future")
    assert ck.steps() == [3]
    # one nobody asked for is still raised, dropped or not
    ck = asyncckpt.AsyncCheckpointer(tmp_path / "b", mode="async", storage=FailStep2())
    ck.save_async({"w": torch.ones(4)}, 2)
    ck.save_async({"w": torch.ones(4)}, 4)
    gc.collect()
    with pytest.raises(asyncckpt.CheckpointSaveError, match="nobody waited on its future"):
        ck.close()


def test_a_done_callback_is_called_once_the_save_ends(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    # (an integrator polled its futures from the training loop to log their info)
    from asyncckpt.storage import LocalStorage

    gate = threading.Event()

    class HeldCommit(LocalStorage):
        def rename(self, src: Path, dst: Path) -> None:
            assert gate.wait(30)
            super().rename(src, dst)

    seen: list[tuple[int, bool, str]] = []
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async", storage=HeldCommit()) as ck:
        fut = ck.save_async({"w": torch.ones(4)}, 1)
        fut.add_done_callback(lambda f: seen.append(
            (f.step, f.observed, threading.current_thread().name)))
        assert seen == [] and not fut.done()
        gate.set()
        deadline = time.monotonic() + 30
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen[0][:2] == (1, False) and seen[0][2] != threading.current_thread().name
        assert not fut.observed  # (a callback alone asks for nothing)
        fut.wait(30)
        done_now: list[int] = []
        fut.add_done_callback(lambda f: done_now.append(f.step))  # (done: called at once)
        assert done_now == [1]
        fut.add_done_callback(lambda f: 1 / 0)
        assert "the done callback" in caplog.text and "ZeroDivisionError" in caplog.text
        with pytest.raises(asyncckpt.CheckpointConfigError, match="pass a function"):
            fut.add_done_callback(5)  # type: ignore[arg-type]


def test_a_done_callback_may_wait_for_the_checkpointer(tmp_path: Path) -> None:
    # (the review: run on the writer's thread, a callback calling ckpt.wait() waited for
    # work queued behind it on that thread: for ever)
    got: list[Any] = []
    done = threading.Event()
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async", keep_last=1) as ck:
        def on_done(f: Any) -> None:
            got.append(ck.wait(timeout=20))
            done.set()

        ck.save_async({"w": torch.ones(4)}, 1).add_done_callback(on_done)
        assert done.wait(30)
    assert got and got[0].step == 1


def test_a_file_named_like_a_hidden_step_is_left_and_told_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A storage trial's file named like a step retention hid warned at every save (each
    retention retried it, and a non-directory is not a save's to remove)."""
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async", keep_last=1) as ckpt:
        odd = tmp_path / ".step_000000001.deleting-0123456789ab"
        odd.write_bytes(b"not ours")
        with caplog.at_level(logging.WARNING, logger="asyncckpt"):
            for step in range(1, 5):
                ckpt.save({"w": torch.ones(4)}, step=step)
        told = [r.getMessage() for r in caplog.records if odd.name in r.getMessage()]
        assert len(told) == 1 and "remove it by hand" in told[0], told
        assert odd.read_bytes() == b"not ours" and ckpt.steps() == [4]


def test_a_parent_of_per_step_roots_names_them(tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A DCP migrant saved each step under a directory of its own (ckpt/step_10 as the
    root): loading, listing or resuming from ckpt said only "no committed checkpoint",
    and a resume by latest_step() started afresh."""
    for step in (10, 20):
        asyncckpt.save({"w": torch.full((2,), float(step))}, tmp_path / f"step_{step}",
                       step=step)
    (tmp_path / "notes.txt").write_text("a run's notes")
    (tmp_path / "empty").mkdir()
    with pytest.raises(asyncckpt.CheckpointNotFoundError,
                       match=r"step_10, \S*step_20 are checkpoint roots of their own: to load "
                             r"from one, pass it as the directory"):
        asyncckpt.load(tmp_path)
    from asyncckpt.cli import main
    with caplog.at_level(logging.WARNING, logger="asyncckpt"), \
            asyncckpt.AsyncCheckpointer(tmp_path) as ckpt:
        assert ckpt.latest_step() is None
    assert any("are checkpoint roots of their own" in r.getMessage() for r in caplog.records)
    capsys.readouterr()
    assert main(["verify", "--all", str(tmp_path)]) != 0
    err = capsys.readouterr().err
    assert "checkpoint roots of their own" in err and "check the path" not in err, err
    main(["ls", str(tmp_path)])
    assert "are checkpoint roots of their own" in capsys.readouterr().out
    # a root of its own steps is not told of others' (a best-model root inside it)
    asyncckpt.save({"w": torch.ones(2)}, tmp_path / "step_10" / "best", step=1)
    with asyncckpt.AsyncCheckpointer(tmp_path / "step_10") as ckpt:
        assert ckpt.latest_step() == 10
    assert asyncckpt.load(tmp_path / "step_10")["w"].tolist() == [10.0, 10.0]


def test_strict_false_over_renamed_keys_warns_with_the_key_map(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """strict=False over a renamed model loads nothing: its warning gives the key_map that
    would (and not strict=True's "strict=False would load none of them")."""
    saved = torch.nn.Sequential(torch.nn.Linear(4, 4))
    asyncckpt.save({"model": saved}, tmp_path, step=1)

    class Renamed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc = torch.nn.Linear(4, 4)

    target = Renamed()
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        asyncckpt.load(tmp_path, {"model": target}, strict=False)
    assert "pass key_map=lambda p: 'model/enc.' + p[8:]" in caplog.text
    assert "would load none" not in caplog.text
    asyncckpt.load(tmp_path, {"model": target}, key_map={"model/0.weight": "model/enc.weight",
                                                         "model/0.bias": "model/enc.bias"})
    assert torch.equal(target.enc.weight, saved[0].weight)


def test_a_failed_saves_temporary_directory_left_behind_is_told(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A storage trial's failed save whose removal of its .tmp- directory failed too said
    nothing of the directory left behind."""
    class Failing(LocalStorage):
        def write_bytes(self, path: Path, data: bytes) -> None:
            raise OSError(errno.EIO, "Input/output error")

        def remove_tree(self, path: Path) -> None:
            if ".tmp-" in path.name:
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            super().remove_tree(path)

    with caplog.at_level(logging.WARNING, logger="asyncckpt"), asyncckpt.AsyncCheckpointer(
            tmp_path, mode="async", storage=Failing()) as ckpt, pytest.raises(
                asyncckpt.CheckpointSaveError):
        ckpt.save(make_state(), step=1)
    left = [n for n in os.listdir(tmp_path) if ".tmp-" in n]
    assert len(left) == 1
    told = [r.getMessage() for r in caplog.records if left[0] in r.getMessage()]
    assert told and "could not be removed" in told[0] and "asyncckpt clean" in told[0], told
    with asyncckpt.AsyncCheckpointer(tmp_path) as ckpt:  # (the next one removes it)
        ckpt.save(make_state(), step=2)
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


@pytest.mark.parametrize("code", [errno.EIO, errno.EINVAL])
def test_a_failed_fsync_of_a_new_roots_parent_is_told_unless_refused(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, code: int) -> None:
    """A storage trial's EIO of the parent's fsync as the root was made was silent (a crash
    may lose the root's entry, and every step in it); a filesystem refusing directory
    fsyncs (EINVAL) loses nothing and is not told of."""
    class Failing(LocalStorage):
        def fsync_dir(self, path: Path) -> None:
            if path == tmp_path:
                raise OSError(code, os.strerror(code))
            super().fsync_dir(path)

    with caplog.at_level(logging.WARNING, logger="asyncckpt"), asyncckpt.AsyncCheckpointer(
            tmp_path / "run", mode="async", storage=Failing()) as ckpt:
        ckpt.save(make_state(), step=1)
        assert ckpt.steps() == [1]
    told = [r.getMessage() for r in caplog.records if "may not survive a crash" in
            r.getMessage()]
    if code == errno.EIO:
        assert len(told) == 1 and str(tmp_path / "run") in told[0], told
    else:
        assert not told


def test_a_wait_out_of_time_during_retention_keeps_the_saves_info_for_the_next(
        tmp_path: Path) -> None:
    """A concurrency trial's poll loop of ckpt.wait(timeout=0.001): a timeout after the
    commit, during keep_last's removals, dropped the save's CheckpointInfo, and every next
    wait() returned None."""
    class SlowRemove(LocalStorage):
        def remove_tree(self, path: Path) -> None:
            time.sleep(1.0)
            super().remove_tree(path)

    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async", keep_last=1,
                                     storage=SlowRemove()) as ckpt:
        ckpt.save(make_state(), step=1)
        ckpt.save_async(make_state(), step=2).wait()  # (its retention of step 1 runs now)
        with pytest.raises(asyncckpt.CheckpointTimeoutError,
                           match=r"old steps .* are still being removed after 0\.1s "
                                 r"\(retention, keep_last=1\)"):
            ckpt.wait(timeout=0.1)
        info = ckpt.wait()
        assert info is not None and info.step == 2
        assert ckpt.wait() is None  # (returned once)
        assert ckpt.steps() == [2]


def test_pickling_a_checkpointer_or_its_future_says_what_to_send_instead(
        tmp_path: Path) -> None:
    """A concurrency trial's Dataset held the checkpointer: a spawn DataLoader failed with
    "cannot pickle '_thread.lock' object"."""
    import pickle

    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async") as ckpt:
        fut = ckpt.save_async(make_state(), step=1)
        with pytest.raises(asyncckpt.CheckpointConfigError,
                           match=r"cannot be pickled .*pass the directory instead"):
            pickle.dumps(ckpt)
        with pytest.raises(asyncckpt.CheckpointConfigError,
                           match=r"step 1 cannot be pickled .*send fut\.wait\(\)'s "
                                 r"CheckpointInfo"):
            pickle.dumps(fut)
        with pytest.raises(TypeError):  # (as pickle's own refusals: is_picklable helpers)
            copy.deepcopy(ckpt)
        info = pickle.loads(pickle.dumps(fut.wait()))
        assert info.step == 1 and ckpt.steps() == [1]


def test_a_step_older_than_those_committed_is_told_to_go_in_oldest_first(
        tmp_path: Path) -> None:
    """A trial converted old files in glob order (step 60, then 20): the advice named
    discard_steps_after(20) alone, which deletes the step 60 just converted."""
    asyncckpt.save({"w": torch.ones(2)}, tmp_path, step=60)
    with pytest.raises(asyncckpt.CheckpointExistsError) as info:
        asyncckpt.save({"w": torch.zeros(2)}, tmp_path, step=20)
    said = str(info.value)
    assert "is older than step(s) [60]" in said and "discard_steps_after(20)" in said
    assert "save them oldest step first (sorted by step, not by file name): remove the " \
        "newer ones converted already" in said
    assert asyncckpt.AsyncCheckpointer(tmp_path).steps() == [60]


def test_a_step_whose_damage_mark_cannot_be_read_is_not_said_marked(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A QA re-check: a step directory this user may not search (no damaged.json in it)
    was warned of as 'marked damaged: a load found it damaged'."""
    from asyncckpt import commit

    class Unsearchable(asyncckpt.storage.LocalStorage):
        def read_bytes(self, path: Path, limit: int) -> bytes:
            if path.name == commit.DAMAGED_NAME:
                raise PermissionError(13, "Permission denied")
            return super().read_bytes(path, limit)

    asyncckpt.save({"w": torch.ones(2)}, tmp_path, step=1)
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        commit.warn_if_marked(tmp_path / "step_000000001", Unsearchable())
    assert "marked damaged" not in caplog.text
    # a mark that is there but cannot be read is one (review: retention counts it)
    (tmp_path / "step_000000001" / commit.DAMAGED_NAME).write_text("{}")
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        commit.warn_if_marked(tmp_path / "step_000000001", Unsearchable())
    assert "step_000000001 is marked damaged" in caplog.text
    # a time no date can show is said as its number, never in the load's way
    (tmp_path / "step_000000001" / commit.DAMAGED_NAME).write_text(
        '{"found_unix": 1e30, "problem": "checksum mismatch"}')
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        commit.warn_if_marked(tmp_path / "step_000000001", asyncckpt.storage.LocalStorage())
    assert "a load found it damaged at 1e+30 (damaged.json: checksum mismatch)" in caplog.text


def test_prepare_with_an_optimizer_that_has_no_state_yet_says_when_to_call_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A perf trial called prepare() at start-up, as the README shows, before its AdamW's
    first step: the buffer was sized without the moments, and the first save after the
    step allocated again, its hint repeating "call prepare() at start-up"."""
    import asyncckpt.checkpointer as ck_mod

    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    state = {"model": model, "optim": opt}
    monkeypatch.setattr(ck_mod, "_PREPARE_HINT_S", 0.0)  # (every allocation hinted)
    with caplog.at_level(logging.INFO, logger="asyncckpt"), \
            asyncckpt.AsyncCheckpointer(tmp_path) as ck:
        ck.prepare(state, background=False)
        assert "prepare(): the optimizer at 'optim' has no state yet" in caplog.text
        model(torch.randn(2, 64)).sum().backward()
        opt.step()
        caplog.clear()
        ck.save(state, step=1)
        assert "the state grew since prepare(): an optimizer makes its state at its first " \
            "step, so call prepare() after that step" in caplog.text, caplog.text
        caplog.clear()
        ck.prepare(state, background=False)  # (after the step: nothing to say)
    assert "has no state yet" not in caplog.text
    # nor of an optimizer that never makes state: plain SGD, frozen parameters (review)
    frozen = torch.nn.Linear(4, 4).requires_grad_(False)
    with caplog.at_level(logging.INFO, logger="asyncckpt"), \
            asyncckpt.AsyncCheckpointer(tmp_path / "sgd") as ck:
        ck.prepare({"m": model, "sgd": torch.optim.SGD(model.parameters(), lr=0.1),
                    "frozen": torch.optim.AdamW(frozen.parameters())}, background=False)
    assert "has no state yet" not in caplog.text


def test_a_rollback_to_a_step_not_committed_is_warned_of_naming_what_goes(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A perf trial's discard_steps_after(0), its step 0 long removed by keep_last, deleted
    its only step, said at INFO alone."""
    with asyncckpt.AsyncCheckpointer(tmp_path) as ck:
        for s in (30, 40):
            ck.save({"w": torch.ones(2)}, step=s)
        with caplog.at_level(logging.WARNING, logger="asyncckpt"):
            assert ck.discard_steps_after(30) == [40]  # (a committed step: as asked)
            assert "is not committed" not in caplog.text
            ck.save({"w": torch.ones(2)}, step=40)
            assert ck.discard_steps_after(5) == [30, 40]
        assert ck.steps() == []
    assert (f"discard_steps_after(5): step 5 is not committed under {tmp_path}; deleting "
            "every step after it, [30, 40], which leaves no step at all") in caplog.text
