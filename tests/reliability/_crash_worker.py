"""Processes that save checkpoints in a loop and die by SIGKILL at a chosen instant.

Two ways to run it (``python _crash_worker.py MODE ...``):

``zygote``
    Imports torch and asyncckpt once, then reads one JSON command per line on stdin.
    For each it forks a child that opens the checkpoint directory, checks the newest
    committed step, and saves ``state_for(step)`` for step after step with
    ``keep_last=2`` until it is killed: by its own hand, from inside a storage layer,
    at the N-th call of one phase's operation, or by a timer thread at a random
    instant. The zygote answers each command with one JSON line saying how the child
    ended. Forking from an already imported interpreter makes a kill point cost a few
    milliseconds instead of a second and a half of ``import torch``.

``rank SPEC.json``
    One rank of a 2-rank gloo group on 127.0.0.1 (the multi-rank crash test).

Each child appends JSON lines to an events file (``resumed``, ``cleanup``,
``durable``) with unbuffered writes, so what it logged survives its SIGKILL.

The helpers at the top (``state_for``, ``same_tree``) are shared with the tests.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

# --- the state saved at each step: a pure function of the step -------------------------------

KEEP_LAST = 2
TMP_OR_DELETING = re.compile(r"^\.step_\d+\.(tmp|deleting)-[0-9a-f]+$")
STEP_DIR = re.compile(r"^step_(\d{9,})$")


def state_for(step: int) -> dict[str, Any]:
    """What the worker saves at ``step`` (about 22 KB of tensors of four dtypes, and scalars)."""
    g = torch.Generator().manual_seed(7919 * step + 1)
    return {
        "model": {
            "w": torch.randn(48, 64, generator=g),
            "b": torch.randn(64, generator=g, dtype=torch.float64),
            "emb": torch.randn(40, 64, generator=g).to(torch.bfloat16),
        },
        "optim": {
            "count": torch.tensor(step, dtype=torch.int64),
            "m": torch.randint(-(2 ** 31), 2 ** 31 - 1, (1024,), generator=g, dtype=torch.int32),
        },
        "meta": {"step": step, "name": f"run-{step}", "lr": 1e-3 * (1 + step % 7),
                 "flags": (True, None)},
    }


def global_w(step: int) -> torch.Tensor:
    """The hand-sharded tensor of the 2-rank state (rows split between the ranks)."""
    g = torch.Generator().manual_seed(104729 * step + 3)
    return torch.randn(64, 32, generator=g)


def rank_state(step: int, rank: int, world: int) -> dict[str, Any]:
    """What rank ``rank`` of ``world`` holds at ``step``: its rows of ``w`` plus replicas."""
    rows = 64 // world
    base = state_for(step)
    return {"w": global_w(step)[rank * rows:(rank + 1) * rows].clone(),
            "model": base["model"], "meta": base["meta"]}


def global_state(step: int) -> dict[str, Any]:
    """What loading the 2-rank checkpoint of ``step`` without a target must return."""
    base = state_for(step)
    return {"w": global_w(step), "model": base["model"], "meta": base["meta"]}


def save_two_ranks(directory: Path, steps: Sequence[int]) -> None:
    """A real 2-rank checkpoint written in one process: two checkpointers on a shared
    HashStore, driven from two threads."""
    import torch.distributed as dist

    import asyncckpt
    from asyncckpt import ShardMetadata

    store = dist.HashStore()
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            with asyncckpt.AsyncCheckpointer(directory, rank=rank, world_size=2, store=store,
                                             mode="sync", timeout_s=60) as ckpt:
                for s in steps:
                    ckpt.save_async(rank_state(s, rank, 2), s, shards={
                        "w": ShardMetadata(global_shape=(64, 32), offsets=(32 * rank, 0))}
                    ).wait()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]


def same_tree(a: Any, b: Any, path: str = "<root>") -> str | None:
    """None when ``a`` and ``b`` are equal bit for bit and type for type, else where not."""
    if type(a) is not type(b):
        return f"{path}: type {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{path}: {a.dtype} {list(a.shape)} != {b.dtype} {list(b.shape)}"
        ab = a.detach().contiguous().reshape(-1).view(torch.uint8)
        bb = b.detach().contiguous().reshape(-1).view(torch.uint8)
        return None if torch.equal(ab, bb) else f"{path}: tensor bytes differ"
    if isinstance(a, dict):
        if list(a) != list(b) or [type(k) for k in a] != [type(k) for k in b]:
            return f"{path}: keys {list(a)!r} != {list(b)!r}"
        for k in a:
            d = same_tree(a[k], b[k], f"{path}/{k}")
            if d:
                return d
        return None
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            d = same_tree(x, y, f"{path}/{i}")
            if d:
                return d
        return None
    if isinstance(a, float):
        same = (math.isnan(a) and math.isnan(b)) or a.hex() == b.hex()
        return None if same else f"{path}: {a!r} != {b!r}"
    return None if a == b else f"{path}: {a!r} != {b!r}"


# --- dying on cue ----------------------------------------------------------------------------

# phase -> (storage operation counted, where in it the process dies)
PHASES: dict[str, tuple[str, str]] = {
    "stage": ("stage", "partway"),                 # the N-th tensor copied into the arena
    "write_arena_before": ("write_arena", "before"),
    "write_arena_pieces": ("piece", "before"),     # before the N-th 4 KiB piece of a shard
    "write_arena_after": ("write_arena", "after"),  # shard written and fsync'd
    "manifest_before": ("write_bytes", "before"),
    "manifest_partial": ("write_bytes", "partway"),  # half the manifest on disk
    "manifest_after": ("write_bytes", "after"),
    "fsync_dir_before": ("fsync_dir", "before"),
    "fsync_dir_after": ("fsync_dir", "after"),
    "rename_before": ("rename", "before"),          # commit and retention renames
    "rename_after": ("rename", "after"),
    "remove_tree_before": ("remove_tree", "before"),  # retention and cleanup deletes
    "remove_tree_partial": ("remove_tree", "partway"),
    "remove_tree_after": ("remove_tree", "after"),
    "timer": ("timer", "random"),
    "none": ("none", "never"),
}


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # never reached: SIGKILL cannot be caught


def make_storage(phase: str, n: int) -> Any:
    """A LocalStorage that SIGKILLs its process at the ``n``-th call of ``phase``'s operation."""
    from asyncckpt.storage import LocalStorage

    op, where = PHASES[phase]

    class KillingStorage(LocalStorage):
        armed = True

        def __init__(self) -> None:
            self._counts: dict[str, int] = {}
            self._lock = threading.Lock()

        def hit(self, name: str, position: str) -> bool:
            """Count a call of ``name`` (once, at "before") and say whether to die here."""
            if not self.armed or name != op:
                return False
            with self._lock:
                if position == "before":
                    self._counts[name] = self._counts.get(name, 0) + 1
                return self._counts.get(name, 0) == n and position == where

        def write_arena(self, path: Path, buf: memoryview, nbytes: int,
                        ready: Callable[[int], None], direct: bool = True) -> None:
            if self.hit("write_arena", "before"):
                die()

            def ready_or_die(end: int) -> None:
                if self.hit("piece", "before"):
                    die()
                ready(end)

            super().write_arena(path, buf, nbytes, ready_or_die, direct)
            if self.hit("write_arena", "after"):
                die()

        def write_bytes(self, path: Path, data: bytes) -> None:
            if self.hit("write_bytes", "before"):
                die()
            if self.hit("write_bytes", "partway"):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                os.write(fd, data[:len(data) // 2])
                die()
            super().write_bytes(path, data)
            if self.hit("write_bytes", "after"):
                die()

        def fsync_dir(self, path: Path) -> None:
            if self.hit("fsync_dir", "before"):
                die()
            super().fsync_dir(path)
            if self.hit("fsync_dir", "after"):
                die()

        def rename(self, src: Path, dst: Path) -> None:
            if self.hit("rename", "before"):
                die()
            super().rename(src, dst)
            if self.hit("rename", "after"):
                die()

        def remove_tree(self, path: Path) -> None:
            if self.hit("remove_tree", "before"):
                die()
            if self.hit("remove_tree", "partway"):
                files = sorted(p for p in Path(path).rglob("*") if p.is_file())
                for p in files[:max(1, len(files) // 2)]:
                    p.unlink()
                die()
            super().remove_tree(path)
            if self.hit("remove_tree", "after"):
                die()

    storage = KillingStorage()
    if op == "stage":
        hook_staging_copies(lambda: storage.hit("stage", "before") or storage.hit("stage",
                                                                              "partway"))
    return storage


def hook_staging_copies(should_die: Callable[[], bool]) -> None:
    """Call ``should_die`` before each tensor copy into the arena; die when it says so.

    Staging copies each tensor with ``ctypes.memmove``, or the memmove that keeps the GIL
    for a small one (or ``HostArena.view(...).copy_`` for tensors that need a
    conversion); all are wrapped. Only in a throwaway child.
    """
    import ctypes

    import asyncckpt.staging as staging

    real_view = staging.HostArena.view

    def view(self: Any, item: Any) -> torch.Tensor:
        if should_die():
            die()
        return real_view(self, item)

    def dying(real: Callable[[Any, Any, int], Any]) -> Callable[[Any, Any, int], Any]:
        def memmove(dst: Any, src: Any, count: int) -> Any:
            if should_die():
                die()
            return real(dst, src, count)
        return memmove

    staging.HostArena.view = view  # type: ignore[method-assign]
    ctypes.memmove = dying(ctypes.memmove)  # type: ignore[assignment]
    staging._memmove_holding_gil = dying(staging._memmove_holding_gil)


class Events:
    """Append-only JSON lines, one unbuffered write each (they survive a SIGKILL)."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def __call__(self, **kw: Any) -> None:
        os.write(self.fd, (json.dumps(kw) + "\n").encode())


def abandoned(directory: Path) -> list[str]:
    try:
        return sorted(n for n in os.listdir(directory) if TMP_OR_DELETING.match(n))
    except FileNotFoundError:
        return []


def run_child(cmd: dict[str, Any]) -> None:
    """Open ``cmd["dir"]``, check its newest step, then save step after step until killed."""
    import asyncckpt
    import asyncckpt.storage as storage_mod

    directory = Path(cmd["dir"])
    ev = Events(cmd["events"])
    storage_mod.PIECE_BYTES = 4096  # many pieces per shard file: kills land between them
    storage = make_storage(cmd["phase"], int(cmd.get("n", 1)))
    left_over = abandoned(directory)
    ckpt = asyncckpt.AsyncCheckpointer(directory, mode=cmd.get("mode", "async"),
                                       keep_last=KEEP_LAST, storage=storage)
    steps = ckpt.steps()
    if steps:  # resume as a training job would: load the newest step, check it
        got = ckpt.load(step=steps[-1])
        ev(resumed=steps[-1], diff=same_tree(got, state_for(steps[-1])))
    if cmd["phase"] == "timer":
        delay = random.Random(cmd["seed"]).uniform(0.0, float(cmd.get("max_delay", 0.25)))
        threading.Timer(delay, die).start()
    step = steps[-1] + 1 if steps else 1
    prev = None
    for i in range(int(cmd.get("max_saves", 1000))):
        fut = ckpt.save_async(state_for(step), step)
        if i == 0:  # the first save took the lock and removes what earlier crashes left
            # (on the reaper thread: ckpt.wait() waits for it, and this save)
            ckpt.wait()
            ev(cleanup=left_over, still_there=sorted(set(left_over) & set(abandoned(directory))))
        if prev is not None:
            prev.wait()
            ev(durable=prev.step)
        prev = fut
        step += 1
    if prev is not None:
        prev.wait()
        ev(durable=prev.step)
    ckpt.wait()
    ckpt.close()
    ev(finished=True, steps=asyncckpt.AsyncCheckpointer(directory).steps())


def zygote_main() -> None:
    """Serve fork-per-command; reply with how each child ended."""
    import importlib

    for name in ("asyncckpt", "asyncckpt.loader", "asyncckpt.reader", "asyncckpt.storage"):
        importlib.import_module(name)  # once, before any fork

    torch.set_num_threads(1)
    out = sys.stdout
    for line in sys.stdin:
        cmd = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 0
            try:
                fd = os.open(cmd["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                run_child(cmd)
            except BaseException:
                traceback.print_exc()
                sys.stderr.flush()
                code = 1
            os._exit(code)
        deadline = time.monotonic() + float(cmd.get("timeout_s", 60))
        timed_out = False
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                timed_out = True
                os.kill(pid, signal.SIGKILL)
                _, status = os.waitpid(pid, 0)
                break
            time.sleep(0.002)
        reply = {"signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                 "code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
                 "timed_out": timed_out}
        out.write(json.dumps(reply) + "\n")
        out.flush()


# --- one rank of a gloo group ------------------------------------------------------------------

def rank_main(spec_path: str) -> None:
    """Save ``spec["steps"]`` as one rank of a group; die inside one save if told to."""
    import torch.distributed as dist

    import asyncckpt
    import asyncckpt.storage as storage_mod
    from asyncckpt import ShardMetadata

    spec = json.loads(Path(spec_path).read_text())
    rank, world = spec["rank"], spec["world"]
    storage_mod.PIECE_BYTES = 4096
    kill = spec.get("kill") or {}
    storage = make_storage(kill.get("phase", "none"), int(kill.get("n", 1)))
    storage.armed = False
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank,
                            world_size=world)
    result: dict[str, Any] = {"rank": rank, "committed": [], "failed": {}}
    ckpt = asyncckpt.AsyncCheckpointer(spec["dir"], mode="async", keep_last=KEEP_LAST,
                                       timeout_s=spec["timeout_s"], storage=storage)
    rows = 64 // world
    for step in spec["steps"]:
        storage.armed = step == kill.get("step")
        t0 = time.monotonic()
        try:
            fut = ckpt.save_async(rank_state(step, rank, world), step, shards={
                "w": ShardMetadata(global_shape=(64, 32), offsets=(rank * rows, 0))})
            fut.wait(timeout=spec["timeout_s"] * 6 + 30)
            result["committed"].append(step)
        except Exception as exc:
            result["failed"][str(step)] = {"type": type(exc).__name__, "message": str(exc),
                                           "seconds": time.monotonic() - t0}
    ckpt.close()  # waits for the retention that follows the last save, too
    result["steps"] = asyncckpt.AsyncCheckpointer(spec["dir"]).steps()
    result["abandoned"] = abandoned(Path(spec["dir"]))
    if rank == 0 and result["steps"]:  # the newest committed step must load, bit-exact
        got = asyncckpt.load(spec["dir"], step=result["steps"][-1])
        result["newest_diff"] = same_tree(got, global_state(result["steps"][-1]))
    Path(spec["result"]).write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # leave without a teardown that could wait for a dead peer


def main(argv: Sequence[str]) -> None:
    if argv[:1] == ["zygote"]:
        zygote_main()
    elif argv[:1] == ["rank"] and len(argv) == 2:
        rank_main(argv[1])
    else:
        raise SystemExit("usage: _crash_worker.py zygote | rank SPEC.json")


if __name__ == "__main__":
    main(sys.argv[1:])
