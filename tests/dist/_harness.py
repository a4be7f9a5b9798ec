"""Spawning real ranks for the distributed tests, and helpers the rank workers share.

The parent (a test) calls :func:`run_ranks`, which starts one ``python _harness.py
<spec>`` subprocess per rank. Each child joins a gloo process group on 127.0.0.1,
imports the worker module named in the spec (a test module of this folder), calls
``worker(rank_ctx)`` and writes what it returns as JSON to ``<run>/result_<rank>.json``.
A child that raises prints its traceback (kept in its log) and exits with 1; the
parent raises an AssertionError that shows the log of every rank that failed.

Every child is killed when the run's hard timeout passes, so a hang fails the test
instead of hanging CI; a child also dumps its threads' stacks shortly before that
(faulthandler), so the log shows where it hung.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEFAULT_TIMEOUT_S = 150.0


# --- the parent side ---------------------------------------------------------------------------

def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RankRun:
    """What one rank process did: its exit status, log and returned value."""

    rank: int
    returncode: int | None
    log: str
    result: Any = None


@dataclass
class Kill:
    """SIGKILL ``ranks`` once every file in ``when`` exists."""

    when: Sequence[Path]
    ranks: Sequence[int]
    done: bool = field(default=False, init=False)


def run_ranks(module: str, worker: str, world: int, run_dir: Path, *,
              args: Mapping[str, Any] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
              expect_killed: Iterable[int] = (), kill: Kill | None = None,
              exit_ranks: Iterable[int] | None = None, init_group: bool = True
              ) -> dict[int, RankRun]:
    """Run ``module.worker`` on ``world`` ranks; return each rank's RankRun.

    Ranks in ``expect_killed`` must die of SIGKILL (by their own hand or by ``kill``);
    every other rank must exit 0, else AssertionError with the logs of the failed ranks.
    ``exit_ranks`` are the ranks that meet at the end before rank 0 (which hosts the
    Store) exits; by default every rank not expected to be killed.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    killed = set(expect_killed)
    if kill is not None:
        killed |= set(kill.ranks)
    meet = sorted(set(range(world)) - killed if exit_ranks is None else set(exit_ranks))
    port = free_port()
    env = dict(os.environ)
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(
                    [str(HERE), str(HERE.parent),  # (tests/: _torch_compat)
                     *filter(None, [os.environ.get("PYTHONPATH")])])})
    procs: dict[int, subprocess.Popen[bytes]] = {}
    logs: dict[int, Path] = {}
    try:
        for rank in range(world):
            spec = {"module": module, "worker": worker, "rank": rank, "world": world,
                    "port": port, "run_dir": str(run_dir), "args": dict(args or {}),
                    "timeout_s": timeout_s, "exit_ranks": meet, "init_group": init_group}
            spec_path = run_dir / f"spec_{rank}.json"
            spec_path.write_text(json.dumps(spec))
            logs[rank] = run_dir / f"log_{rank}.txt"
            with open(logs[rank], "wb") as log:
                procs[rank] = subprocess.Popen(
                    [sys.executable, str(HERE / "_harness.py"), str(spec_path)],
                    stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(run_dir),
                    start_new_session=True)
        deadline = time.monotonic() + timeout_s
        timed_out = False
        while any(p.poll() is None for p in procs.values()):
            if kill is not None and not kill.done and all(Path(w).exists() for w in kill.when):
                for r in kill.ranks:
                    with contextlib.suppress(ProcessLookupError):
                        procs[r].send_signal(signal.SIGKILL)
                kill.done = True
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.02)
    finally:
        for p in procs.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
            p.wait()
    runs: dict[int, RankRun] = {}
    for rank, p in procs.items():
        text = logs[rank].read_text(errors="replace")
        res_path = run_dir / f"result_{rank}.json"
        result = json.loads(res_path.read_text()) if res_path.exists() else None
        runs[rank] = RankRun(rank, p.returncode, text, result)
    bad = []
    for rank, r in runs.items():
        want = -signal.SIGKILL if rank in killed else 0
        if r.returncode != want:
            bad.append(rank)
    if timed_out or bad:
        head = (f"{module}.{worker} on {world} rank(s) "
                + (f"hit the hard timeout of {timeout_s:.0f}s" if timed_out else "failed"))
        parts = [head]
        for rank in sorted(set(bad) | (set(runs) if timed_out else set())):
            r = runs[rank]
            parts.append(f"----- rank {rank} (exit status {r.returncode}, expected "
                         f"{'SIGKILL' if rank in killed else 0}) -----\n{_tail(r.log)}")
        raise AssertionError("\n".join(parts))
    return runs


def _tail(text: str, n: int = 12000) -> str:
    return text if len(text) <= n else "...\n" + text[-n:]


# --- helpers for the rank workers (and the parent) ------------------------------------------

def full_tensor(name: str, shape: Sequence[int], dtype: Any = None) -> Any:
    """The deterministic global value of tensor ``name``: the same on every rank."""
    import torch

    dtype = dtype or torch.float32
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if dtype.is_floating_point:
        return torch.randn(tuple(shape), generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-(2 ** 15), 2 ** 15, tuple(shape), generator=g, dtype=torch.int64
                         ).to(dtype)


def bits(t: Any) -> bytes:
    """The raw bytes of a tensor's elements in row-major order."""
    import torch

    t = t.detach().cpu().contiguous().reshape(-1)
    return bytes(t.view(torch.uint8).numpy()) if t.numel() else b""


def same_bits(a: Any, b: Any) -> bool:
    return (a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and bits(a) == bits(b))


def split_sizes(n: int, parts: int) -> list[int]:
    """Sizes of an even split of ``n`` into ``parts`` (numpy.array_split rule)."""
    q, r = divmod(n, parts)
    return [q + (1 if i < r else 0) for i in range(parts)]


class Checks:
    """Collects named check failures in a worker instead of stopping at the first."""

    def __init__(self) -> None:
        self.failures: list[str] = []

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            self.failures.append(what)

    def run(self, name: str, fn: Any, *a: Any, **kw: Any) -> Any:
        try:
            return fn(*a, **kw)
        except Exception:
            self.failures.append(f"{name}: raised\n{traceback.format_exc()}")
            return None


@dataclass
class RankCtx:
    """What a worker gets: its rank, the world, the run's folder and the test's args."""

    rank: int
    world: int
    run_dir: Path
    args: dict[str, Any]

    def marker(self, name: str) -> Path:
        return self.run_dir / f"marker_{name}"

    def touch(self, name: str) -> None:
        self.marker(name).write_text(str(os.getpid()))

    def barrier(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized() and self.world > 1:
            dist.barrier()


def selftest_worker(ctx: RankCtx) -> dict[str, Any]:
    """For the harness's own tests: fail on cue, or hang."""
    if ctx.args.get("hang"):
        time.sleep(600)
    if ctx.rank == ctx.args.get("raise_on"):
        raise ValueError(f"boom from rank {ctx.rank}")
    return {"rank": ctx.rank, "world": ctx.world}


# --- the child side ----------------------------------------------------------------------------

def _exit_meeting(store: Any, rank: int, ranks: Sequence[int], timeout_s: float) -> None:
    """Ranks other than 0 check in; rank 0, which hosts the Store, waits for them."""
    if store is None or len(ranks) <= 1 or rank not in ranks:
        return
    store.add("harness/exit", 1)
    if rank != 0:
        return
    deadline = time.monotonic() + timeout_s
    while store.add("harness/exit", 0) < len(ranks) and time.monotonic() < deadline:
        time.sleep(0.02)


def _child(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    rank, world = spec["rank"], spec["world"]
    # Print every thread's stack a little before the parent's hard timeout kills us.
    faulthandler.dump_traceback_later(max(5.0, spec["timeout_s"] - 5.0), exit=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    run_dir = Path(spec["run_dir"])
    code = 0
    store = None
    try:
        if spec["init_group"]:
            import datetime

            import torch.distributed as dist

            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank,
                world_size=world, timeout=datetime.timedelta(seconds=60))
            if world > 1:
                from torch.distributed import distributed_c10d as c10d

                store = c10d._get_default_store()
        mod = importlib.import_module(spec["module"])
        ctx = RankCtx(rank, world, run_dir, spec["args"])
        result = getattr(mod, spec["worker"])(ctx)
        tmp = run_dir / f"result_{rank}.json.tmp"
        tmp.write_text(json.dumps(result))
        tmp.rename(run_dir / f"result_{rank}.json")
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        _exit_meeting(store, rank, spec["exit_ranks"], 20.0)
    except BaseException:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: a checkpointer's threads may still wait on dead peers.
    os._exit(code)


if __name__ == "__main__":
    _child(sys.argv[1])
