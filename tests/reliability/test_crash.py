"""Crash at any instant: SIGKILL a saving process at hundreds of points, lose nothing.

A zygote process (``_crash_worker.py zygote``) imports torch once and forks one child
per kill point. Each child opens the checkpoint directory like a restarted training
job (loads and checks the newest step), then saves ``state_for(step)`` step after step
with ``keep_last=2`` until it SIGKILLs itself at the N-th call of one phase's
operation (staging copies, shard pieces, manifest write, directory fsyncs, renames,
retention deletes — see ``PHASES``) or a timer thread kills it at a random instant.

After every kill the test checks the directory:

- nothing partial is visible: every ``step_*`` directory has its manifest, everything
  else is the lock file or an abandoned ``.step_*.tmp-*`` / ``.deleting-*`` directory;
- every committed step passes ``verify_checkpoint`` and loads bit-exact equal to
  ``state_for(step)``;
- nothing is lost: the newest committed step never goes back, and a step whose future
  completed is still there unless two newer steps are (``keep_last=2``);
- the next child removes the abandoned directories at its first save.

Two zygotes run side by side, each on its own directory.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import asyncckpt
from asyncckpt.commit import step_dir_name
from asyncckpt.manifest import MANIFEST_NAME
from asyncckpt.reader import verify_checkpoint
from asyncckpt.storage import LocalStorage

from ._crash_worker import (
    KEEP_LAST,
    PHASES,
    STEP_DIR,
    TMP_OR_DELETING,
    abandoned,
    global_state,
    same_tree,
    state_for,
)

WORKER = Path(__file__).with_name("_crash_worker.py")
LOCK_NAME = ".asyncckpt.lock"

# How many kill points of each phase: the N-th call of the phase's operation, N in range.
KILL_RANGES: dict[str, range] = {
    "stage": range(1, 26),               # 5 tensors per save: 5 saves deep
    "write_arena_before": range(1, 11),
    "write_arena_pieces": range(1, 43),  # 7 pieces of 4 KiB per shard file: 6 saves deep
    "write_arena_after": range(1, 11),
    "manifest_before": range(1, 7),
    "manifest_partial": range(1, 7),
    "manifest_after": range(1, 7),
    "fsync_dir_before": range(1, 13),    # three per save: tmp dir, root, root after retention
    "fsync_dir_after": range(1, 13),
    "rename_before": range(1, 11),       # commit and retention renames alternate
    "rename_after": range(1, 11),
    "remove_tree_before": range(1, 7),
    "remove_tree_partial": range(1, 7),
    "remove_tree_after": range(1, 7),
}
TIMER_KILLS = 150
CHAINS = 2


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": "lo"})
    return env


class Zygote:
    """A ``_crash_worker.py zygote`` process: one forked child per command."""

    def __init__(self, log: Path):
        self._log = open(log, "ab")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen([sys.executable, str(WORKER), "zygote"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, env=worker_env(), text=True)

    def run(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"the zygote died (exit status {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def kill_points() -> list[dict[str, Any]]:
    points: list[dict[str, Any]] = [{"phase": phase, "n": n}
                                    for phase, ns in KILL_RANGES.items() for n in ns]
    points += [{"phase": "timer", "n": 0, "seed": seed} for seed in range(TIMER_KILLS)]
    random.Random(20240601).shuffle(points)  # every directory sees every kind, mixed
    for i, p in enumerate(points):
        p["mode"] = "sync" if i % 5 == 4 else "async"  # sync saves die too
    return points


def read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Chain:
    """One checkpoint directory and the kill points run against it, one after another."""

    def __init__(self, root: Path, index: int):
        self.index = index
        self.dir = root / f"ckpt{index}"
        self.work = root / f"work{index}"
        self.work.mkdir(parents=True)
        self.zygote = Zygote(self.work / "zygote.log")
        self.durable: set[int] = set()
        self.newest = 0
        self.failures: list[str] = []
        self.killed = 0
        self.cleanups_checked = 0
        self.by_phase: dict[str, int] = {}

    def fail(self, what: str) -> None:
        self.failures.append(f"[dir {self.index}] {what}")

    def run_point(self, i: int, point: dict[str, Any], max_saves: int = 1000) -> dict[str, Any]:
        events = self.work / f"events_{i}.jsonl"
        cmd = {"dir": str(self.dir), "events": str(events), "log": str(self.work / f"log_{i}.txt"),
               "phase": point["phase"], "n": point["n"], "seed": point.get("seed", 0),
               "mode": point.get("mode", "async"), "max_saves": max_saves, "timeout_s": 90}
        reply = self.zygote.run(cmd)
        what = f"kill point {i} {point}"
        evs = read_events(events)
        for e in evs:
            if "resumed" in e and e["diff"] is not None:
                self.fail(f"{what}: the newest step {e['resumed']} loaded wrong: {e['diff']}")
            if "cleanup" in e:
                if e["still_there"]:
                    self.fail(f"{what}: abandoned dirs survived the first save: "
                              f"{e['still_there']}")
                elif e["cleanup"]:
                    self.cleanups_checked += 1
            if "durable" in e:
                self.durable.add(e["durable"])
        if reply["timed_out"] or reply["code"] not in (None, 0):
            log = (self.work / f"log_{i}.txt")
            text = log.read_text(errors="replace")[-4000:] if log.exists() else ""
            self.fail(f"{what}: child ended badly {reply}\n{text}")
        return reply

    def check_dir(self, what: str) -> list[int]:
        """Everything visible is whole and exact; nothing committed was lost."""
        names = os.listdir(self.dir) if self.dir.exists() else []
        for name in names:
            if name == LOCK_NAME or TMP_OR_DELETING.match(name):
                continue
            if STEP_DIR.match(name):
                if not (self.dir / name / MANIFEST_NAME).exists():
                    self.fail(f"{what}: partial checkpoint visible: {name} has no manifest")
                continue
            self.fail(f"{what}: unexpected entry {name!r} in the checkpoint root")
        if not self.dir.exists():
            return []
        ckpt = asyncckpt.AsyncCheckpointer(self.dir, mode="sync")
        try:
            steps = ckpt.steps()
            for s in steps:
                report = verify_checkpoint(self.dir / step_dir_name(s), LocalStorage())
                if not report.ok:
                    self.fail(f"{what}: step {s} fails verification: {report.problems}")
                    continue
                diff = same_tree(ckpt.load(step=s), state_for(s))
                if diff is not None:
                    self.fail(f"{what}: step {s} loads wrong values: {diff}")
        finally:
            ckpt.close()
        # (more than KEEP_LAST may be there: each kill between a commit and its retention
        # leaves one more; the next completed save trims them, checked by the final run)
        newest = steps[-1] if steps else 0
        if newest < self.newest:
            self.fail(f"{what}: newest committed step went back from {self.newest} to {newest}")
        self.newest = max(self.newest, newest)
        for d in sorted(self.durable):
            if d not in steps and sum(s > d for s in steps) < KEEP_LAST:
                self.fail(f"{what}: step {d} was reported durable but is gone ({steps})")
        return steps

    def run(self, points: list[tuple[int, dict[str, Any]]]) -> None:
        try:
            for i, point in points:
                reply = self.run_point(i, point, 1000 if point["phase"] == "timer" else 40)
                if reply["signal"] == signal.SIGKILL:
                    self.killed += 1
                    self.by_phase[point["phase"]] = self.by_phase.get(point["phase"], 0) + 1
                elif not reply["timed_out"] and reply["code"] == 0:
                    self.fail(f"kill point {i} {point}: the process was never killed")
                self.check_dir(f"after kill point {i} {point}")
            # A last, unharmed run: it cleans up at its first save and leaves KEEP_LAST steps.
            reply = self.run_point(len(points) + 1000, {"phase": "none", "n": 0}, max_saves=3)
            if reply["code"] != 0:
                self.fail(f"the final clean run ended with {reply}")
            steps = self.check_dir("after the final clean run")
            if len(steps) != KEEP_LAST:
                self.fail(f"after the final clean run {steps} are committed, not {KEEP_LAST}")
            if abandoned(self.dir):
                self.fail(f"abandoned directories left after a clean run: {abandoned(self.dir)}")
        except BaseException as exc:  # report it from the main thread
            self.fail(f"the chain broke: {type(exc).__name__}: {exc}")
        finally:
            self.zygote.close()


def test_sigkill_at_any_point_loses_nothing(short_tmp: Path, figures: Any) -> None:
    points = kill_points()
    assert len(points) >= 200
    assert {p["phase"] for p in points} == set(PHASES) - {"none"}
    chains = [Chain(short_tmp, c) for c in range(CHAINS)]
    work = [[(i, p) for i, p in enumerate(points) if i % CHAINS == c] for c in range(CHAINS)]
    t0 = time.monotonic()
    threads = [threading.Thread(target=ch.run, args=(w,), name=f"chain{ch.index}")
               for ch, w in zip(chains, work, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failures = [f for ch in chains for f in ch.failures]
    killed = sum(ch.killed for ch in chains)
    by_phase: dict[str, int] = {}
    for ch in chains:
        for k, v in ch.by_phase.items():
            by_phase[k] = by_phase.get(k, 0) + v
    cleanups = sum(ch.cleanups_checked for ch in chains)
    print(f"\nsurvived {killed} SIGKILLs in {time.monotonic() - t0:.1f}s; by phase: {by_phase}; "
          f"abandoned directories removed at the next first save: {cleanups} times")
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:10])
    assert killed >= 200
    assert cleanups > 0
    figures.add("kill_points_survived", killed)
    figures.set("kill_points_by_phase", by_phase)
    figures.add("abandoned_cleanups_verified", cleanups)


# --- a rank of a 2-rank group dies mid-save ----------------------------------------------------

def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_group(root: Path, name: str, directory: Path, steps: list[int], *,
              kill: dict[str, Any] | None = None, timeout_s: float = 5.0
              ) -> tuple[dict[int, int], dict[int, Any], dict[int, str]]:
    """Run 2 ranks that save ``steps``; rank 1 dies as ``kill`` says. Returns
    (exit status, result, log) per rank."""
    port = free_port()
    procs, logs = {}, {}
    for rank in range(2):
        spec = {"rank": rank, "world": 2, "port": port, "dir": str(directory), "steps": steps,
                "timeout_s": timeout_s, "kill": kill if rank == 1 else None,
                "result": str(root / f"{name}_result_{rank}.json")}
        spec_path = root / f"{name}_spec_{rank}.json"
        spec_path.write_text(json.dumps(spec))
        logs[rank] = root / f"{name}_log_{rank}.txt"
        with open(logs[rank], "wb") as log:
            procs[rank] = subprocess.Popen([sys.executable, str(WORKER), "rank", str(spec_path)],
                                           stdout=log, stderr=subprocess.STDOUT, env=worker_env())
    deadline = time.monotonic() + 180
    try:
        for p in procs.values():
            p.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = {r: p.returncode for r, p in procs.items()}
    results = {}
    for r in procs:
        res = root / f"{name}_result_{r}.json"
        results[r] = json.loads(res.read_text()) if res.exists() else None
    texts = {r: logs[r].read_text(errors="replace")[-6000:] for r in procs}
    return codes, results, texts


@pytest.mark.parametrize("kill", [
    {"phase": "write_arena_pieces", "n": 3},  # partway through its shard file
    {"phase": "write_arena_after", "n": 1},   # shard durable, never reported
], ids=["mid-write", "after-write"])
def test_rank_killed_mid_save_fails_the_step_cleanly(short_tmp: Path, kill: dict[str, Any],
                                                     figures: Any) -> None:
    directory = short_tmp / "ckpt"
    timeout_s = 5.0
    codes, res, logs = run_group(short_tmp, "crash", directory, [1, 2],
                                 kill={**kill, "step": 2}, timeout_s=timeout_s)
    assert codes[1] == -signal.SIGKILL, f"rank 1 was not killed: {codes}\n{logs[1]}"
    assert codes[0] == 0 and res[0] is not None, f"rank 0 failed: {codes}\n{logs[0]}"
    r0 = res[0]
    assert r0["committed"] == [1], r0
    failed = r0["failed"].get("2")
    assert failed is not None, r0
    assert failed["type"] in ("CheckpointTimeoutError", "CheckpointSaveError"), failed
    assert "rank(s) [1]" in failed["message"] or "rank 1" in failed["message"], failed
    # it raised because of the dead rank, within its timeout (plus generous slack), not later
    assert failed["seconds"] < timeout_s * 3 + 20, failed
    assert r0["steps"] == [1] and r0["newest_diff"] is None, r0
    assert not (directory / step_dir_name(2)).exists()
    assert asyncckpt.AsyncCheckpointer(directory).steps() == [1]

    # A new group saves into the same directory: step 2 again, then 3.
    codes, res, logs = run_group(short_tmp, "again", directory, [2, 3], timeout_s=timeout_s)
    assert codes == {0: 0, 1: 0}, f"{codes}\n{logs[0]}\n{logs[1]}"
    for r in (0, 1):
        assert res[r]["committed"] == [2, 3] and not res[r]["failed"], res[r]
    assert res[0]["steps"] == [2, 3] and res[0]["newest_diff"] is None, res[0]
    assert abandoned(directory) == [], "the new group left or kept abandoned directories"
    for s in (2, 3):
        assert verify_checkpoint(directory / step_dir_name(s), LocalStorage()).ok
        assert same_tree(asyncckpt.load(directory, step=s), global_state(s)) is None
    figures.add("rank_kills_survived", 1)
