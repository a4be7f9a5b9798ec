"""Failures under distribution: a rank that raises, dies, or cannot commit.

Whatever goes wrong on one rank, every rank's save must fail (promptly when the
failure is reported, within ``timeout_s`` when a rank goes silent), nothing may
become visible, and the next save must work. Workers (``*_worker``) run in the ranks.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import errno
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from _harness import Checks, Kill, RankCtx, full_tensor, run_ranks, same_bits
from _torch_compat import distribute_locally, dtensor_api

import asyncckpt

MODULE = "test_dist_failures"
PROMPT_S = 5.0  # "promptly": a reported failure must not wait out timeout_s
TIMEOUT_S = 20.0  # the checkpointers' timeout_s where failures are reported
SHORT_TIMEOUT_S = 6.0  # the checkpointers' timeout_s where a rank goes silent


def _state(ctx: RankCtx, step: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    dt = dtensor_api()
    Shard = dt.Shard

    mesh = init_device_mesh("cpu", (ctx.world,))
    return {
        "w": distribute_locally(full_tensor(f"f{step}/w", (12, 6)), mesh, [Shard(0)]),
        "p": full_tensor(f"f{step}/p", (40_000,)),
        "step": step,
    }


def _check_step(c: Checks, ck: Any, step: int) -> None:
    got = c.run(f"load step {step}", ck.load, step=step)
    if got is None:
        return
    c.check(same_bits(got["w"], full_tensor(f"f{step}/w", (12, 6))), f"step {step}: w differs")
    c.check(same_bits(got["p"], full_tensor(f"f{step}/p", (40_000,))), f"step {step}: p differs")
    c.check(got["step"] == step, f"step {step}: step leaf {got['step']!r}")


def _attempt(ck: Any, state: Any, step: int) -> dict[str, Any]:
    """Save and wait; say whether it raised, what, and after how long."""
    t0 = time.monotonic()
    where = "save_async"
    try:
        fut = ck.save_async(state, step)
        where = "future"
        fut.wait(120)
    except Exception as exc:
        return {"raised": type(exc).__name__, "msg": str(exc), "where": where,
                "elapsed": time.monotonic() - t0,
                "is_checkpoint_error": isinstance(exc, asyncckpt.CheckpointError),
                "ranks": list(getattr(exc, "ranks", ()))}
    return {"raised": None, "elapsed": time.monotonic() - t0}


def _tmp_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if ".tmp-" in p.name or ".deleting-" in p.name)


def _flaky_storage() -> Any:
    from asyncckpt.storage import LocalStorage

    class Flaky(LocalStorage):
        """Fails shard writes or the commit rename, or is slow to start, on cue."""

        fail_write = False
        fail_rename = False
        slow_makedirs = False
        slow_write = False  # a 10 s write that stops as soon as its save has failed
        slow_s = 10.0  # (how long the slow write takes)
        fail_late = False  # the write fails after staging, once its record is out
        write_elsewhere = False  # a node-local disk: the shard lands in another directory
        pause_write = 0.0  # seconds a write waits first

        def makedirs(self, path: Path) -> None:
            if self.slow_makedirs and ".tmp-" in Path(path).name:
                time.sleep(1.0)  # a peer that is late to start its write
            super().makedirs(path)

        def write_arena(self, path: Path, *a: Any, **kw: Any) -> None:
            time.sleep(self.pause_write)
            if self.write_elsewhere:
                other = Path(path).parent.parent / "elsewhere" / Path(path).parent.name
                other.mkdir(parents=True, exist_ok=True)
                path = other / Path(path).name
            if self.fail_write:
                raise OSError(errno.EIO, "injected write failure")
            if self.fail_late:
                a[2](a[1])  # staged: the hash thread posts this rank's record meanwhile
                time.sleep(0.5)  # e.g. the fsync at the end of the file fails
                raise OSError(errno.EIO, "injected late write failure")
            if self.slow_write:
                nbytes, ready = a[1], a[2]
                end = time.monotonic() + self.slow_s
                while time.monotonic() < end:
                    ready(nbytes)  # raises once the save has failed
                    time.sleep(0.05)
            super().write_arena(path, *a, **kw)

        def rename(self, src: Path, dst: Path) -> None:
            if self.fail_rename and Path(dst).name.startswith("step_"):
                raise OSError(errno.EIO, "injected rename failure")
            super().rename(src, dst)

    return Flaky()


# --- a rank raises (reported failures) --------------------------------------------------------

def raising_worker(ctx: RankCtx) -> dict[str, Any]:
    root = Path(ctx.args["root"])
    storage = _flaky_storage()
    out: dict[str, Any] = {}
    c = Checks()
    ck = asyncckpt.AsyncCheckpointer(root, timeout_s=TIMEOUT_S, storage=storage)

    def good(step: int, name: str) -> None:
        out[name] = _attempt(ck, _state(ctx, step), step)
        ctx.barrier()

    def after(name: str, committed: list[int]) -> None:
        ctx.barrier()  # every rank has seen its failure
        checks = Checks()
        checks.check(ck.steps() == committed, f"steps {ck.steps()} != {committed}")
        checks.check(_tmp_dirs(root) == [], f"temporary dirs left: {_tmp_dirs(root)}")
        for s in committed:
            _check_step(checks, ck, s)
        out[name]["after"] = checks.failures
        ctx.barrier()

    good(1, "good_1")
    # (a) an unsupported leaf on rank 1 only: flatten raises there
    state = _state(ctx, 2)
    if ctx.rank == 1:
        state["bad"] = object()
    out["bad_leaf"] = _attempt(ck, state, 2)
    after("bad_leaf", [1])
    good(3, "good_3")
    # a rank's shard write fails
    storage.fail_write = ctx.rank == 1
    out["write_fails"] = _attempt(ck, _state(ctx, 4), 4)
    storage.fail_write = False
    after("write_fails", [1, 3])
    good(5, "good_5")
    # (c) the coordinator cannot commit (its rename fails)
    storage.fail_rename = ctx.rank == 0
    out["commit_fails"] = _attempt(ck, _state(ctx, 6), 6)
    storage.fail_rename = False
    after("commit_fails", [1, 3, 5])
    good(7, "good_7")
    ctx.barrier()
    for s in (1, 3, 5, 7):
        _check_step(c, ck, s)
    out["loads"] = c.failures
    # the coordinator's write fails while rank 1 is still on its way to its write
    storage.fail_write = ctx.rank == 0
    storage.slow_makedirs = ctx.rank == 1
    out["late_peer"] = _attempt(ck, _state(ctx, 8), 8)
    storage.fail_write = storage.slow_makedirs = False
    ctx.barrier()
    out["late_peer"]["steps"] = ck.steps()
    out["late_peer"]["tmp_left"] = _tmp_dirs(root)
    ctx.barrier()
    # a failed step, saved again under the same step number
    state = _state(ctx, 9)
    if ctx.rank == 1:
        state["bad"] = object()
    out["retry_first"] = _attempt(ck, state, 9)
    ctx.barrier()
    out["retry"] = _attempt(ck, _state(ctx, 9), 9)
    ctx.barrier()
    retry_checks = Checks()
    if out["retry"]["raised"] is None:
        _check_step(retry_checks, ck, 9)
    out["retry"]["after"] = retry_checks.failures
    ctx.barrier()
    # rank 1 cannot allocate its arena (after the layout exchange, before any write)
    # while the coordinator's write is slow: the coordinator stops writing at once
    storage.slow_write = ctx.rank == 0
    import asyncckpt.checkpointer as checkpointer_module

    real_arena = checkpointer_module.HostArena
    if ctx.rank == 1:
        def no_memory(*a: Any, **kw: Any) -> Any:
            raise MemoryError("injected: no memory")
        ck._arena = None  # the next save allocates one
        checkpointer_module.HostArena = no_memory  # type: ignore[misc, assignment]
    out["arena_fails"] = _attempt(ck, _state(ctx, 10), 10)
    storage.slow_write = False
    checkpointer_module.HostArena = real_arena  # type: ignore[misc]
    after("arena_fails", [1, 3, 5, 7, 9])
    # rank 1's shard lands in a directory of its own (node-local disks under one path):
    # a step the coordinator cannot see whole is never committed
    storage.write_elsewhere = ctx.rank == 1
    out["not_shared"] = _attempt(ck, _state(ctx, 11), 11)
    storage.write_elsewhere = False
    after("not_shared", [1, 3, 5, 7, 9])
    # rank 1 is still busy with its last save and has on_busy="error": it refuses the
    # next one at once, and the coordinator must hear of it, not wait out its timeout
    ck.config = dataclasses.replace(ck.config, on_busy="error" if ctx.rank == 1 else "wait")
    storage.pause_write = 1.5 if ctx.rank == 1 else 0.0
    ck.save_async(_state(ctx, 12), 12)  # (its future is waited on by the next wait())
    storage.pause_write = 0.0
    out["busy"] = _attempt(ck, _state(ctx, 13), 13)
    ck.config = dataclasses.replace(ck.config, on_busy="wait")
    ck.wait()
    after("busy", [1, 3, 5, 7, 9, 12])
    ck.close()
    # ranks that chunk their checksums differently (block_bytes): their layouts do not
    # merge into a manifest a load could read, so nothing is committed
    root2 = Path(ctx.args["root"] + "_blocks")
    ck2 = asyncckpt.AsyncCheckpointer(root2, timeout_s=TIMEOUT_S,
                                      block_bytes=(1 if ctx.rank == 0 else 2) << 20)
    from torch.distributed.device_mesh import init_device_mesh
    dt = dtensor_api()
    Shard = dt.Shard

    state = _state(ctx, 1)  # each rank writes a 4 MiB row: 4 or 2 checksum blocks
    state["big"] = distribute_locally(full_tensor("big", (2, 1 << 20)),
                                     init_device_mesh("cpu", (ctx.world,)), [Shard(0)])
    out["block_bytes"] = _attempt(ck2, state, 1)
    ctx.barrier()
    out["block_bytes"]["after"] = [] if ck2.steps() == [] else [f"committed {ck2.steps()}"]
    ck2.close()
    # keep_last on one rank only: rank 0 applies retention for the group, and silently
    # kept every step
    root3 = Path(ctx.args["root"] + "_keep")
    ck3 = asyncckpt.AsyncCheckpointer(root3, timeout_s=TIMEOUT_S,
                                      keep_last=1 if ctx.rank == 1 else None)
    out["keep_last"] = _attempt(ck3, _state(ctx, 1), 1)
    ctx.barrier()
    out["keep_last"]["after"] = [] if ck3.steps() == [] else [f"committed {ck3.steps()}"]
    ck3.close()
    # a DTensor rank 1's state leaves out: told as a gap in its indices, and (since stop
    # 48) with the ranks that saved none of it
    root4 = Path(ctx.args["root"] + "_omit")
    ck4 = asyncckpt.AsyncCheckpointer(root4, timeout_s=TIMEOUT_S)
    state = _state(ctx, 1)
    if ctx.rank == 1:
        del state["w"]
    out["omitted"] = _attempt(ck4, state, 1)
    ctx.barrier()
    out["omitted"]["after"] = [] if ck4.steps() == [] else [f"committed {ck4.steps()}"]
    ck4.close()
    return out


def _two_ranks_ran(tmp_path_factory: pytest.TempPathFactory, name: str,
                   worker: str) -> dict[int, dict[str, Any]]:
    """Each rank's result of ``worker`` run by two ranks on a fresh root."""
    base = tmp_path_factory.mktemp(name)
    runs = run_ranks(MODULE, worker, 2, base / "run", args={"root": str(base / "ck")})
    return {r: run.result for r, run in runs.items()}


@pytest.fixture(scope="module")
def raising(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    return _two_ranks_ran(tmp_path_factory, "dist_raise", "raising_worker")


def _assert_all_failed_promptly(res: dict[int, dict[str, Any]], name: str,
                                culprit: int | None) -> None:
    for rank, out in sorted(res.items()):
        got = out[name]
        assert got["raised"] is not None, f"rank {rank}: step saved despite rank {culprit}'s error"
        assert got["is_checkpoint_error"], f"rank {rank}: raised {got['raised']}: {got['msg']}"
        assert got["elapsed"] < PROMPT_S, (
            f"rank {rank} took {got['elapsed']:.1f}s to fail (timeout_s={TIMEOUT_S}): "
            f"{got['msg']}")
        if culprit is not None and rank != culprit:
            assert f"rank {culprit}" in got["msg"], (
                f"rank {rank}'s error does not name rank {culprit}: {got['msg']}")
        assert got["after"] == [], f"rank {rank}:\n" + "\n".join(got["after"])


def test_good_saves_around_failures_commit(raising: dict[int, dict[str, Any]]) -> None:
    for rank, out in sorted(raising.items()):
        for name in ("good_1", "good_3", "good_5", "good_7"):
            assert out[name]["raised"] is None, f"rank {rank} {name}: {out[name]}"
        assert out["loads"] == [], f"rank {rank}:\n" + "\n".join(out["loads"])


def test_unsupported_leaf_on_one_rank_fails_every_rank(
        raising: dict[int, dict[str, Any]]) -> None:
    _assert_all_failed_promptly(raising, "bad_leaf", culprit=1)
    assert raising[1]["bad_leaf"]["raised"] == "UnsupportedLeafError"
    assert raising[1]["bad_leaf"]["where"] == "save_async"


def test_a_dtensor_one_rank_leaves_out_is_told_naming_the_ranks(
        raising: dict[int, dict[str, Any]]) -> None:
    _assert_all_failed_promptly(raising, "omitted", culprit=None)
    for rank in (0, 1):
        assert ("tensor 'w' of shape [12, 6]: chunks leave part of the tensor uncovered"
                in raising[rank]["omitted"]["msg"]), raising[rank]["omitted"]["msg"]
        assert ("its chunks come from rank(s) [0] alone: did one of the ranks that wrote "
                "none of it (1) leave it out of its state, or hold something else at its path?"
                in raising[rank]["omitted"]["msg"]), raising[rank]["omitted"]["msg"]


def test_failed_shard_write_fails_every_rank(raising: dict[int, dict[str, Any]]) -> None:
    _assert_all_failed_promptly(raising, "write_fails", culprit=1)
    assert "injected write failure" in raising[0]["write_fails"]["msg"]


def test_coordinator_commit_failure_fails_every_rank(raising: dict[int, dict[str, Any]]) -> None:
    _assert_all_failed_promptly(raising, "commit_fails", culprit=None)
    for rank in (0, 1):
        assert "injected rename failure" in raising[rank]["commit_fails"]["msg"], rank


def test_coordinator_write_failure_with_a_late_peer_fails_every_rank(
        raising: dict[int, dict[str, Any]]) -> None:
    for rank, out in sorted(raising.items()):
        got = out["late_peer"]
        assert got["raised"] is not None and got["is_checkpoint_error"], (rank, got)
        assert got["elapsed"] < PROMPT_S, (rank, got)
        assert "injected write failure" in got["msg"], (rank, got["msg"])
        assert got["steps"] == [1, 3, 5, 7], (rank, got["steps"])


def test_failed_save_with_a_late_peer_leaves_no_temporary_dir(
        raising: dict[int, dict[str, Any]]) -> None:
    for rank, out in sorted(raising.items()):
        assert out["late_peer"]["tmp_left"] == [], (rank, out["late_peer"]["tmp_left"])


def test_arena_failure_on_one_rank_stops_the_coordinators_write(
        raising: dict[int, dict[str, Any]]) -> None:
    _assert_all_failed_promptly(raising, "arena_fails", culprit=1)
    assert raising[1]["arena_fails"]["where"] == "save_async"
    for rank in (0, 1):
        msg = raising[rank]["arena_fails"]["msg"]
        assert "could not allocate the host buffer" in msg and "injected: no memory" in msg, msg


def test_a_shard_outside_the_shared_directory_fails_every_rank(
        raising: dict[int, dict[str, Any]]) -> None:
    _assert_all_failed_promptly(raising, "not_shared", culprit=1)
    for rank in (0, 1):
        assert "must be on a filesystem every rank shares" in raising[rank]["not_shared"]["msg"]


def test_a_rank_busy_with_on_busy_error_fails_every_rank_at_once(
        raising: dict[int, dict[str, Any]]) -> None:
    _assert_all_failed_promptly(raising, "busy", culprit=1)
    # every rank: the documented `except CheckpointInFlightError` skips the save on each
    # (rank 0 raised CheckpointSaveError, and its training loop crashed there)
    assert {r: out["busy"]["raised"] for r, out in raising.items()} == {
        r: "CheckpointInFlightError" for r in raising}


def test_ranks_with_different_block_bytes_commit_nothing(
        raising: dict[int, dict[str, Any]]) -> None:
    _assert_all_failed_promptly(raising, "block_bytes", culprit=None)
    for r in (0, 1):  # (found before anything is written)
        msg = raising[r]["block_bytes"]["msg"]
        assert "made with different block_bytes (rank 0: 1048576, rank 1: 2097152)" in msg, msg


def test_ranks_with_different_retention_commit_nothing(
        raising: dict[int, dict[str, Any]]) -> None:
    _assert_all_failed_promptly(raising, "keep_last", culprit=None)
    for r in (0, 1):
        msg = raising[r]["keep_last"]["msg"]
        assert "made with different keep_last (rank 0: None, rank 1: 1)" in msg, msg
        assert raising[r]["keep_last"]["raised"] == "CheckpointConfigError"


def test_failed_step_number_can_be_saved_again(raising: dict[int, dict[str, Any]]) -> None:
    for rank, out in sorted(raising.items()):
        assert out["retry_first"]["raised"] is not None, rank
    outcomes = {rank: out["retry"]["raised"] for rank, out in raising.items()}
    assert len(set(outcomes.values())) == 1, f"the ranks disagree on the retry: {outcomes}"
    for rank, out in sorted(raising.items()):
        got = out["retry"]
        assert got["raised"] is None, f"rank {rank}: the retry of step 9 failed: {got}"
        assert got["after"] == [], f"rank {rank}:\n" + "\n".join(got["after"])


# --- a rank dies mid-save (silent failures) ------------------------------------------------------

def _dying_storage(ctx: RankCtx, *, die_in: str | None = None, die_after: str | None = None,
                   hang: bool = False, written_marker: bool = False) -> Any:
    """Storage that, once armed, SIGKILLs this rank in ``makedirs``, ``listdir`` or
    ``write_arena`` (after marker ``die_after`` appears), or stalls it in ``write_arena``."""
    from asyncckpt.storage import LocalStorage

    class Dying(LocalStorage):
        armed = False

        def _die(self) -> None:
            if die_after is not None:
                deadline = time.monotonic() + 60
                while not ctx.marker(die_after).exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
            ctx.touch(f"dying_{ctx.rank}")
            os.kill(os.getpid(), signal.SIGKILL)

        def makedirs(self, path: Path) -> None:
            if self.armed and die_in == "makedirs":
                self._die()
            super().makedirs(path)

        def listdir(self, path: Path) -> list[str]:
            if self.armed and die_in == "listdir":  # save_async looks for committed steps
                self._die()
            return super().listdir(path)

        def write_arena(self, path: Path, *a: Any, **kw: Any) -> None:
            if self.armed and die_in == "write":
                self._die()
            if self.armed and hang:
                ctx.touch(f"writing_{ctx.rank}")
                time.sleep(300)  # the parent kills the job meanwhile
            super().write_arena(path, *a, **kw)
            if self.armed and written_marker:
                ctx.touch(f"written_{ctx.rank}")

    return Dying()


def one_dies_worker(ctx: RankCtx) -> dict[str, Any]:
    root = Path(ctx.args["root"])
    victim = ctx.args["victim"]
    storage = _dying_storage(ctx, die_in="write" if ctx.rank == victim else None)
    ck = asyncckpt.AsyncCheckpointer(root, timeout_s=SHORT_TIMEOUT_S, storage=storage)
    out: dict[str, Any] = {"good_1": _attempt(ck, _state(ctx, 1), 1)}
    ctx.barrier()
    storage.armed = True
    out["dies"] = _attempt(ck, _state(ctx, 2), 2)
    # no collective from here on: a rank is gone
    c = Checks()
    c.check(ck.steps() == [1], f"steps {ck.steps()}")
    if ctx.rank == 0:
        c.check(_tmp_dirs(root) == [], f"the coordinator left {_tmp_dirs(root)}")
    _check_step(c, ck, 1)
    out["after"] = c.failures
    return out


@pytest.fixture(scope="module")
def one_dies(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, Any]]:
    """Three ranks save step 1; rank 2 is SIGKILLed inside its write of step 2."""
    base = tmp_path_factory.mktemp("dist_one_dies")
    root = base / "ck"
    runs = run_ranks(MODULE, "one_dies_worker", 3, base / "run",
                     args={"root": str(root), "victim": 2}, expect_killed=[2])
    assert (base / "run" / "marker_dying_2").exists(), "rank 2 never reached its write"
    return root, {r: run.result for r, run in runs.items() if r != 2}


def test_rank_killed_mid_write_fails_the_others_within_timeout(
        one_dies: tuple[Path, dict[int, Any]]) -> None:
    root, res = one_dies
    for rank, out in sorted(res.items()):
        assert out["good_1"]["raised"] is None, out["good_1"]
        got = out["dies"]
        assert got["raised"] is not None, f"rank {rank}: step 2 committed without rank 2"
        assert got["is_checkpoint_error"], got
        assert got["elapsed"] < SHORT_TIMEOUT_S + 5, (
            f"rank {rank} took {got['elapsed']:.1f}s (timeout_s={SHORT_TIMEOUT_S})")
        assert out["after"] == [], f"rank {rank}:\n" + "\n".join(out["after"])
    # rank 1 hears it from the coordinator, whose error names the silent rank; and it
    # raises the same kind (it raised CheckpointSaveError, without .ranks: an `except
    # CheckpointTimeoutError` caught the failure on rank 0 alone)
    for rank in (0, 1):
        assert res[rank]["dies"]["raised"] == "CheckpointTimeoutError", res[rank]["dies"]
        assert res[rank]["dies"]["ranks"] == [2], res[rank]["dies"]
    assert "rank(s) [2]" in res[1]["dies"]["msg"], res[1]["dies"]["msg"]
    ck = asyncckpt.AsyncCheckpointer(root)
    assert ck.steps() == [1]
    assert not (root / "step_000000002").exists()
    assert _tmp_dirs(root) == []  # the coordinator removed what the dead step had written


def test_coordinator_error_names_the_dead_rank(one_dies: tuple[Path, dict[int, Any]]) -> None:
    _, res = one_dies
    msg = res[0]["dies"]["msg"]
    assert "rank(s) [2]" in msg, f"rank 0's error does not name rank 2: {msg}"
    # (a distributed trial: the others said "not committed", rank 0 did not)
    assert "step 2 was not committed (the steps committed before it are intact)" in msg, msg


def test_future_wait_reraises_the_saves_timeout_error() -> None:
    """The same bug without ranks: a save that failed with CheckpointTimeoutError."""
    durable: cf.Future[Any] = cf.Future()
    durable.set_exception(asyncckpt.CheckpointTimeoutError(
        "rank 0: timed out after 6s waiting for the shard files of step 2 from rank(s) [2]"))
    staged: cf.Future[None] = cf.Future()
    staged.set_result(None)
    fut = asyncckpt.CheckpointFuture(2, durable, staged)
    for timeout in (None, 30.0):
        with pytest.raises(asyncckpt.CheckpointTimeoutError, match=r"rank\(s\) \[2\]"):
            fut.wait(timeout)


def crash_worker(ctx: RankCtx) -> dict[str, Any]:
    root = Path(ctx.args["root"])
    storage = _dying_storage(ctx, hang=ctx.rank == 1, written_marker=ctx.rank == 0)
    ck = asyncckpt.AsyncCheckpointer(root, timeout_s=60, storage=storage)
    ck.save(_state(ctx, 1), 1)
    ctx.barrier()
    storage.armed = True
    ck.save_async(_state(ctx, 2), 2)
    time.sleep(300)  # the parent kills the whole job while rank 1 writes
    return {}


def recover_worker(ctx: RankCtx) -> dict[str, Any]:
    root = Path(ctx.args["root"])
    c = Checks()
    ck = asyncckpt.AsyncCheckpointer(root, timeout_s=TIMEOUT_S)
    # Constructing touches nothing: the coordinator cleans up in the first save, before
    # the layout exchange tells the other ranks the nonce that names its directory.
    c.check(len(_tmp_dirs(root)) == 1, f"rank {ctx.rank}: after construction {_tmp_dirs(root)}")
    c.check(ck.steps() == [1], f"steps {ck.steps()}")
    _check_step(c, ck, 1)
    ctx.barrier()
    res = _attempt(ck, _state(ctx, 3), 3)
    c.check(res["raised"] is None, f"the save after the crash failed: {res}")
    ctx.barrier()
    c.check(ck.steps() == [1, 3], f"steps {ck.steps()}")
    _check_step(c, ck, 3)
    c.check(_tmp_dirs(root) == [], f"after the save {_tmp_dirs(root)}")
    ck.close()
    return {"failures": c.failures}


def test_job_killed_mid_save_leaves_nothing_visible_and_next_run_cleans(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    base = tmp_path_factory.mktemp("dist_crash")
    root = base / "ck"
    run = base / "run"
    run_ranks(MODULE, "crash_worker", 2, run, args={"root": str(root)},
              kill=Kill(when=[run / "marker_written_0", run / "marker_writing_1"], ranks=[0, 1]))
    abandoned = _tmp_dirs(root)
    assert len(abandoned) == 1 and abandoned[0].startswith(".step_000000002.tmp-"), abandoned
    assert (root / abandoned[0] / "rank_00000.safetensors").exists()
    assert asyncckpt.AsyncCheckpointer(root).steps() == [1]
    with pytest.raises(asyncckpt.CheckpointNotFoundError):
        asyncckpt.load(root, step=2)
    runs = run_ranks(MODULE, "recover_worker", 2, base / "run2", args={"root": str(root)})
    for rank, r in sorted(runs.items()):
        assert r.result["failures"] == [], f"rank {rank}:\n" + "\n".join(r.result["failures"])
    assert _tmp_dirs(root) == []


def coordinator_dies_worker(ctx: RankCtx) -> dict[str, Any]:
    """Rank 0 (which hosts the Store) is SIGKILLed during step 2: ``where="write"`` once
    rank 1 has written its shard, ``where="before"`` before rank 1 calls save_async."""
    root = Path(ctx.args["root"])
    where = ctx.args["where"]
    if ctx.rank == 0:
        storage = _dying_storage(ctx, die_in="write" if where == "write" else "listdir",
                                 die_after="written_1" if where == "write" else None)
    else:
        storage = _dying_storage(ctx, written_marker=True)
    ck = asyncckpt.AsyncCheckpointer(root, timeout_s=SHORT_TIMEOUT_S, storage=storage)
    out: dict[str, Any] = {"good_1": _attempt(ck, _state(ctx, 1), 1)}
    state = _state(ctx, 2)
    ctx.barrier()
    storage.armed = True
    if ctx.rank == 1 and where == "before":
        while not ctx.marker("dying_0").exists():
            time.sleep(0.01)
        time.sleep(0.5)
    out["dies"] = _attempt(ck, state, 2)
    out["steps"] = ck.steps()
    return out


def _coordinator_dies(base: Path, where: str) -> tuple[Path, dict[str, Any]]:
    root = base / "ck"
    runs = run_ranks(MODULE, "coordinator_dies_worker", 2, base / "run",
                     args={"root": str(root), "where": where}, expect_killed=[0],
                     exit_ranks=[1])
    return root, runs[1].result


def _assert_survivor_failed(root: Path, out: dict[str, Any]) -> None:
    assert out["good_1"]["raised"] is None, out["good_1"]
    got = out["dies"]
    assert got["raised"] is not None, "step 2 committed without the coordinator"
    assert got["elapsed"] < SHORT_TIMEOUT_S + 5, (
        f"rank 1 took {got['elapsed']:.1f}s (timeout_s={SHORT_TIMEOUT_S}): {got['msg']}")
    assert out["steps"] == [1]
    assert asyncckpt.AsyncCheckpointer(root).steps() == [1]
    assert got["is_checkpoint_error"], (
        f"rank 1 raised {got['raised']} ({got['msg']}) from {got['where']}, not a "
        "CheckpointError")


def test_coordinator_killed_mid_write_fails_the_others(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    root, out = _coordinator_dies(tmp_path_factory.mktemp("dist_coord_dies_write"), "write")
    _assert_survivor_failed(root, out)
    assert out["dies"]["where"] == "future"


def test_coordinator_dead_before_save_raises_a_checkpoint_error(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    root, out = _coordinator_dies(tmp_path_factory.mktemp("dist_coord_dies_before"), "before")
    assert out["dies"]["where"] == "save_async"
    _assert_survivor_failed(root, out)


# --- a slow coordinator: every rank must agree on the outcome ----------------------------------

VERDICT_T = 2.5  # timeout_s here: a peer waits VERDICT_T (no grace) for the verdict


def slow_coordinator_worker(ctx: RankCtx) -> dict[str, Any]:
    """Rank 0 is slow past rank 1's wait for the verdict: in its write (step 2: it has
    not decided yet, so rank 1's claim wins and nothing commits), then in its rename
    (step 3: it decided "commit" first, so rank 1 waits for it and both succeed)."""
    from asyncckpt import writer
    from asyncckpt.storage import LocalStorage

    writer._VERDICT_GRACE_S = 0.0
    verdict_wait = VERDICT_T  # (of the coordinator's silence: it beats in none of these)

    class Slow(LocalStorage):
        where: str | None = None

        def write_arena(self, path: Path, *a: Any, **kw: Any) -> None:
            super().write_arena(path, *a, **kw)
            if self.where == "write":
                time.sleep(verdict_wait + 2.0)

        def rename(self, src: Path, dst: Path) -> None:
            if self.where == "rename":
                time.sleep(verdict_wait + 0.8)
            super().rename(src, dst)

    storage = Slow()
    root = Path(ctx.args["root"])
    ck = asyncckpt.AsyncCheckpointer(root, timeout_s=VERDICT_T, storage=storage)
    out: dict[str, Any] = {"good_1": _attempt(ck, _state(ctx, 1), 1)}
    for step, where in ((2, "write"), (3, "rename")):
        ctx.barrier()
        storage.where = where if ctx.rank == 0 else None
        out[where] = _attempt(ck, _state(ctx, step), step)
        storage.where = None
    ctx.barrier()
    out["steps"] = ck.steps()
    out["tmp"] = _tmp_dirs(root)
    return out


def test_a_late_commit_never_meets_a_rank_that_reported_failure(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    base = tmp_path_factory.mktemp("dist_slow_coordinator")
    runs = run_ranks(MODULE, "slow_coordinator_worker", 2, base / "run",
                     args={"root": str(base / "ck")})
    res = {r: run.result for r, run in runs.items()}
    for rank, run in runs.items():  # waits of seconds, and no warning from torch per second
        assert "waitForInput" not in run.log, (rank, run.log[-2000:])
    for rank, out in sorted(res.items()):
        assert out["good_1"]["raised"] is None, (rank, out["good_1"])
        # step 2: rank 1 gave up first, so rank 0 must not commit it
        assert out["write"]["raised"] is not None, (rank, "step 2 reported committed")
        assert out["write"]["is_checkpoint_error"], (rank, out["write"])
        # step 3: rank 0 had decided to commit, so rank 1 waited for its rename
        assert out["rename"]["raised"] is None, (rank, out["rename"])
        assert out["steps"] == [1, 3], (rank, out["steps"])
    # rank 0 hears why: rank 1 gave up waiting (by its claim, or by its abort)
    msg = res[0]["write"]["msg"]
    assert "rank 1" in msg and "waiting for the commit of step 2" in msg, msg
    assert res[0]["tmp"] == [], res[0]["tmp"]


# --- ranks that are slow, not dead; loads on other ranks against retention --------------------

LIVE_TIMEOUT_S = 3.0


def liveness_worker(ctx: RankCtx) -> dict[str, Any]:
    """With timeout_s=3: a rank whose write fails late stops the other rank's 10 s
    write within a second or so (and the next save meets no stale barrier); a rank that
    writes for 7 s longer than the other is slow, not dead; a load of an old step on
    rank 1 keeps the coordinator's keep_last retention from deleting it."""
    root = Path(ctx.args["root"])
    storage = _flaky_storage()
    out: dict[str, Any] = {}
    ck = asyncckpt.AsyncCheckpointer(root, timeout_s=LIVE_TIMEOUT_S, storage=storage)
    for step, failing in ((1, 1), (3, 0)):
        storage.fail_late = ctx.rank == failing
        storage.slow_write = ctx.rank != failing
        out[f"fails_{step}"] = _attempt(ck, _state(ctx, step), step)
        storage.fail_late = storage.slow_write = False
        # at once, as a training loop would: no barrier between the two saves
        out[f"next_{step + 1}"] = _attempt(ck, _state(ctx, step + 1), step + 1)
    ctx.barrier()
    storage.slow_write, storage.slow_s = ctx.rank == 1, 7.0
    out["slow"] = _attempt(ck, _state(ctx, 5), 5)
    storage.slow_write = False
    ctx.barrier()
    out["steps"] = ck.steps()
    ck.close()

    class SlowReads(type(storage)):  # type: ignore[misc]
        slow = 0.0

        def pread_into(self, *a: Any, **kw: Any) -> int:
            time.sleep(self.slow)
            return int(super().pread_into(*a, **kw))

    reads = SlowReads()
    root2 = Path(ctx.args["root"] + "_keep")
    ck2 = asyncckpt.AsyncCheckpointer(root2, keep_last=1, timeout_s=TIMEOUT_S, storage=reads)
    ck2.save(_state(ctx, 1), 1)
    ctx.barrier()
    loaded: cf.Future[Any] = cf.Future()
    if ctx.rank == 1:
        reads.slow = 0.3

        def load() -> None:
            try:
                loaded.set_result(ck2.load(step=1))
            except BaseException as exc:
                loaded.set_exception(exc)

        import threading

        threading.Thread(target=load).start()
        time.sleep(0.5)  # the load has found step 1 and is reading it
    ctx.barrier()
    out["keep_2"] = _attempt(ck2, _state(ctx, 2), 2)
    ck2.wait()  # and its retention
    if ctx.rank == 1:
        c = Checks()
        got = c.run("load of step 1 beside retention", loaded.result, 60)
        if got is not None:
            c.check(same_bits(got["p"], full_tensor("f1/p", (40_000,))), "step 1: p differs")
        out["load"] = c.failures
        reads.slow = 0.0
    ctx.barrier()
    out["keep_steps"] = ck2.steps()
    ctx.barrier()  # the load is over: the next retention deletes step 1 (and 2)
    out["keep_3"] = _attempt(ck2, _state(ctx, 3), 3)
    ck2.wait()
    ctx.barrier()
    out["keep_after"] = ck2.steps()
    ck2.close()
    return out


@pytest.fixture(scope="module")
def liveness(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    return _two_ranks_ran(tmp_path_factory, "dist_live", "liveness_worker")


@pytest.mark.parametrize("step,failing", [(1, 1), (3, 0)])
def test_a_late_write_failure_stops_the_other_ranks_write(
        liveness: dict[int, dict[str, Any]], step: int, failing: int) -> None:
    for rank, out in sorted(liveness.items()):
        got = out[f"fails_{step}"]
        assert got["raised"] is not None and got["is_checkpoint_error"], (rank, got)
        assert f"rank {failing}" in got["msg"] and "injected late" in got["msg"], (rank, got)
        # the other rank's write would take 10 s: it stopped when the failure was posted
        assert got["elapsed"] < PROMPT_S, (rank, got)
        # and the next save, started at once, met no barrier left waiting
        assert out[f"next_{step + 1}"]["raised"] is None, (rank, out[f"next_{step + 1}"])


def test_a_rank_slower_than_timeout_s_is_not_declared_dead(
        liveness: dict[int, dict[str, Any]]) -> None:
    for rank, out in sorted(liveness.items()):
        assert out["slow"]["raised"] is None, (rank, out["slow"])
        assert out["slow"]["elapsed"] > 2 * LIVE_TIMEOUT_S, (rank, out["slow"])
        assert out["steps"] == [2, 4, 5], (rank, out["steps"])


def test_retention_spares_a_step_another_rank_is_loading(
        liveness: dict[int, dict[str, Any]]) -> None:
    assert liveness[1]["load"] == [], liveness[1]["load"]
    for rank, out in sorted(liveness.items()):
        assert out["keep_2"]["raised"] is None, (rank, out["keep_2"])
        assert out["keep_steps"] == [1, 2], (rank, out["keep_steps"])  # 1 spared
        assert out["keep_3"]["raised"] is None, (rank, out["keep_3"])
        assert out["keep_after"] == [3], (rank, out["keep_after"])  # then deleted


# --- a failure reported while another rank is late ---------------------------------------------

def late_rank_worker(ctx: RankCtx) -> dict[str, Any]:
    """Rank 1 cannot save (an unsupported leaf), rank 2 comes 4 s late: rank 0 must fail
    as soon as rank 1's error is posted, not when the late rank arrives."""
    root = Path(ctx.args["root"])
    ck = asyncckpt.AsyncCheckpointer(root, timeout_s=TIMEOUT_S)
    state = _state(ctx, 1)
    if ctx.rank == 1:
        state["bad"] = object()
    if ctx.rank == 2:
        time.sleep(4.0)
    out = _attempt(ck, state, 1)
    ctx.barrier()
    out["next"] = _attempt(ck, _state(ctx, 2), 2)  # and the group goes on
    ck.close()
    return out


def test_a_reported_failure_is_not_held_up_by_a_late_rank(tmp_path: Path) -> None:
    runs = run_ranks(MODULE, "late_rank_worker", 3, tmp_path / "run",
                     args={"root": str(tmp_path / "ck")})
    got = runs[0].result
    assert got["raised"] is not None and got["is_checkpoint_error"], got
    assert "rank 1" in got["msg"] and "UnsupportedLeafError" in got["msg"], got["msg"]
    assert got["elapsed"] < 3.0, got  # rank 2 arrives only after 4 s
    for rank, run in sorted(runs.items()):
        assert run.result["next"]["raised"] is None, (rank, run.result["next"])
