"""Kill a training run with SIGKILL, resume it from its last checkpoint, and show that
the resumed run is bitwise identical to one that was never interrupted.

    python examples/resume_demo.py [--steps 60] [--every 5] [--kill-at 41] [--dir DIR]

1. a reference run trains an MLP (with dropout) for --steps steps, never interrupted;
2. a second run saves async checkpoints every --every steps and is killed with SIGKILL
   once it reports step --kill-at;
3. a third run loads the latest committed checkpoint (model, AdamW, step counter and
   the RNG state that drives dropout) and trains to --steps;
4. the losses of every step after the resume point must equal the reference exactly.

Each batch is generated from (seed, step), so any step's data can be regenerated on
resume without saving a data loader. Exit code 0: identical; 1: not; 2: bad options.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

import asyncckpt
from asyncckpt import commit, storage
from asyncckpt.cli import main as cli_main
from asyncckpt.reader import verify_checkpoint

SEED = 1234
IN_FEATURES, HIDDEN, CLASSES, BATCH = 256, 1024, 10, 128
KEEP_LAST = 3
WORKER_TIMEOUT_S = 300


# --- the training worker (runs in a subprocess) ---------------------------------------------

def make_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step``: inputs from a generator seeded by (SEED, step), labels from a
    fixed random linear teacher. Needs no state, so a resumed run regenerates it exactly."""
    teacher = torch.randn(IN_FEATURES, CLASSES, generator=torch.Generator().manual_seed(SEED))
    g = torch.Generator().manual_seed(SEED * 1_000_003 + step)
    x = torch.randn(BATCH, IN_FEATURES, generator=g)
    return x, (x @ teacher).argmax(dim=1)


def build_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(
        torch.nn.Linear(IN_FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(HIDDEN, CLASSES))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def emit(*words: object) -> None:
    # One write of the whole line: print() writes each word on its own when stdout is
    # unbuffered (PYTHONUNBUFFERED), and a SIGKILL between two writes cut a line short.
    sys.stdout.write(" ".join(map(str, words)) + "\n")
    sys.stdout.flush()


def worker(kind: str, steps: int, every: int, directory: Path | None, gated: bool = False
           ) -> int:
    """Train to ``steps``; print ``loss STEP HEX`` per step (the parent parses it).

    ``gated``: after each step, wait for a line on stdin before going on.
    """
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(SEED)  # model init, then the dropout masks
    random.seed(SEED)
    np.random.seed(SEED)
    model, optim = build_model()
    train = {"step": 0}
    state = {"model": model, "optim": optim, "train": train, "rng": asyncckpt.RNGState()}
    ckpt = None
    if directory is not None:
        ckpt = asyncckpt.AsyncCheckpointer(directory, mode="async_pinned", keep_last=KEEP_LAST)
        if kind == "resume":
            # in place: weights, AdamW moments, step counter, RNG (none committed: from scratch)
            with contextlib.suppress(asyncckpt.CheckpointNotFoundError):
                ckpt.load(state)
    start = train["step"]
    emit("start", start)
    fut: asyncckpt.CheckpointFuture | None = None

    def committed(f: asyncckpt.CheckpointFuture) -> None:
        info = f.wait()
        emit("commit", info.step, f"{info.durable_s:.4f}", f"{info.blocked_s:.4f}")

    for step in range(start + 1, steps + 1):
        x, y = make_batch(step)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        if fut is not None:
            fut.wait_staged()  # the last save was copying the weights during this step
        optim.step()  # mutates weights and moments: only after staging has finished
        emit("loss", step, float(loss.item()).hex())
        if fut is not None and fut.done():
            committed(fut)
            fut = None
        if ckpt is not None and step % every == 0:
            if fut is not None:
                committed(fut)
            train["step"] = step
            fut = ckpt.save_async(state, step, overlap=True)  # returns at once
        if gated and not sys.stdin.readline():
            return 1  # the narrator is gone
    if fut is not None:
        committed(fut)
    if ckpt is not None:
        ckpt.close()
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    emit("final", digest.hexdigest())
    return 0


# --- the narrator (the parent process) --------------------------------------------------------

@dataclass
class Run:
    """What a worker reported."""

    start: int = 0
    losses: dict[int, str] = field(default_factory=dict)  # step -> float.hex()
    commits: list[int] = field(default_factory=list)
    final: str | None = None
    returncode: int | None = None
    seconds: float = 0.0

    def feed(self, line: str) -> str:
        word, *rest = line.split()
        if word == "start":
            self.start = int(rest[0])
        elif word == "loss":
            self.losses[int(rest[0])] = rest[1]
        elif word == "commit":
            self.commits.append(int(rest[0]))
        elif word == "final":
            self.final = rest[0]
        return word

    @property
    def last_step(self) -> int:
        return max(self.losses, default=self.start)


def run_worker(kind: str, opts: argparse.Namespace, directory: Path | None,
               kill_at: int | None = None, say: Callable[[str], None] = print) -> Run:
    """Run a worker to the end, or SIGKILL it once it reports step ``kill_at``.

    A worker that is to be killed waits for a go-ahead line after each step, so the
    kill lands right after ``kill_at`` however busy the machine is (its background
    checkpoint threads keep running meanwhile).
    """
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind,
           "--steps", str(opts.steps), "--every", str(opts.every)]
    if directory is not None:
        cmd += ["--dir", str(directory)]
    if kill_at is not None:
        cmd.append("--gated")
    run = Run()
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as errlog, subprocess.Popen(
            cmd, stdin=subprocess.PIPE if kill_at is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=errlog, text=True, bufsize=1) as proc:
        watchdog = threading.Timer(WORKER_TIMEOUT_S, proc.kill)
        watchdog.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                word = run.feed(line)
                if word == "commit" and kill_at is not None:
                    say(f"      step {run.commits[-1]:>4}: checkpoint committed "
                        f"(save_async blocked {float(line.split()[3]) * 1e3:.1f} ms)")
                if kill_at is None or word != "loss":
                    continue
                if run.last_step >= kill_at:
                    os.kill(proc.pid, signal.SIGKILL)
                    say(f"      step {run.last_step:>4}: SIGKILL")
                    break
                assert proc.stdin is not None
                proc.stdin.write("go\n")
                proc.stdin.flush()
            run.returncode = proc.wait()
            for line in proc.stdout:  # whatever it printed before it died
                if line.endswith("\n"):  # not a line the kill cut short
                    run.feed(line)
        finally:
            watchdog.cancel()
            run.seconds = time.perf_counter() - t0
        if run.returncode not in (0, -signal.SIGKILL):
            errlog.seek(0)
            say(errlog.read().decode(errors="replace")[-3000:])
    return run


def compare(reference: dict[int, str], other: dict[int, str], steps: range) -> list[int]:
    """Steps whose losses differ (or are missing on either side)."""
    return [s for s in steps if s not in reference or reference.get(s) != other.get(s)]


def check_after_kill(directory: Path, say: Callable[[str], None]) -> tuple[list[int], bool]:
    """Committed steps on disk after the kill, and whether every one of them verifies."""
    st = storage.LocalStorage()
    steps = commit.committed_steps(directory, st)
    ok = True
    for name in sorted(os.listdir(directory)):
        if name.startswith("step_") and not (directory / name / "manifest.json").exists():
            say(f"      PROBLEM: {name} is visible but has no manifest")
            ok = False
    for s in steps:
        report = verify_checkpoint(directory / commit.step_dir_name(s), st)
        ok = ok and report.ok
        verdict = (f"verified, {report.tensors} tensors" if report.ok
                   else "CORRUPT: " + "; ".join(report.problems))
        say(f"      step {s}: {verdict}")
    return steps, ok


def demo(opts: argparse.Namespace, directory: Path,
         on_killed: Callable[[Path], None] | None = None, say: Callable[[str], None] = print
         ) -> int:
    say(f"asyncckpt resume demo: MLP {IN_FEATURES}-{HIDDEN}-{CLASSES} with dropout, AdamW, "
        f"{opts.steps} steps, async_pinned checkpoint every {opts.every} steps "
        f"(keep_last={KEEP_LAST}) into {directory}")
    say("\n[1/4] reference run, never interrupted ...")
    ref = run_worker("reference", opts, None, say=say)
    if ref.returncode != 0 or len(ref.losses) != opts.steps:
        say("      the reference run failed")
        return 1
    say(f"      {len(ref.losses)} steps in {ref.seconds:.1f}s, final loss "
        f"{float.fromhex(ref.losses[opts.steps]):.6f}")

    say(f"\n[2/4] training run with checkpoints; killed with SIGKILL at step {opts.kill_at} ...")
    killed = run_worker("train", opts, directory, kill_at=opts.kill_at, say=say)
    if killed.returncode != -signal.SIGKILL:
        say(f"      the run was not killed mid-run (exit code {killed.returncode}); "
            "use a smaller --kill-at")
        return 1
    say(f"      it died after reporting step {killed.last_step}; on disk now "
        f"(asyncckpt ls {directory}):")
    listing = io.StringIO()
    with contextlib.redirect_stdout(listing):
        cli_main(["ls", str(directory)])
    for line in listing.getvalue().splitlines():
        say("        " + line)
    steps, intact = check_after_kill(directory, say)
    if not intact:
        return 1
    if len(steps) > KEEP_LAST:
        say(f"      {len(steps)} steps are kept for now: the kill came after step {steps[-1]} "
            f"committed and before retention removed step {steps[0]}; the next save does that")
    for name in commit.abandoned_dirs(directory, storage.LocalStorage()):
        what = ("a save was still being written" if ".tmp-" in name else
                "retention was deleting an old step")
        say(f"      {name}: {what} when the process died; never read, and removed by the "
            "next save here")
    if on_killed is not None:
        on_killed(directory)
    same_before = not compare(ref.losses, killed.losses, range(1, killed.last_step + 1))
    say(f"      its losses up to step {killed.last_step} "
        + ("equal the reference: checkpointing did not disturb training" if same_before
           else "DIFFER from the reference"))

    say("\n[3/4] resumed run: load the latest committed step in place, train to the end ...")
    resumed = run_worker("resume", opts, directory, say=say)
    if resumed.returncode != 0:
        say("      the resumed run failed")
        return 1
    expect = steps[-1] if steps else 0
    say(f"      loaded step {resumed.start} (model, optimizer, step counter, RNG) and trained "
        f"steps {resumed.start + 1}..{opts.steps} in {resumed.seconds:.1f}s")

    say("\n[4/4] losses after the resume point, resumed vs reference (bitwise):")
    after = range(resumed.start + 1, opts.steps + 1)
    bad = compare(ref.losses, resumed.losses, after)
    say(f"      {'step':>4}  {'reference':<22}  {'resumed':<22}  equal")
    for s in after:
        r, o = ref.losses[s], resumed.losses.get(s)
        shown = repr(float.fromhex(o)) if o else "missing"
        say(f"      {s:>4}  {float.fromhex(r)!r:<22}  {shown:<22}  {'yes' if r == o else 'NO'}")
    same_final = resumed.final is not None and resumed.final == ref.final
    ok = not bad and same_before and same_final and resumed.start == expect and len(after) > 0
    say(f"\nfinal weights sha256: reference {ref.final}\n"
        f"                      resumed   {resumed.final}")
    if ok:
        say(f"MATCH: all {len(after)} losses after step {resumed.start} and the final weights "
            "are bitwise identical to the uninterrupted run")
        return 0
    say(f"MISMATCH: {len(bad)} of {len(after)} losses differ (steps {bad[:10]}); final weights "
        f"{'equal' if same_final else 'differ'}; resumed from {resumed.start}, expected {expect}")
    return 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--steps", type=int, default=60, help="steps to train (default 60)")
    p.add_argument("--every", type=int, default=5, help="checkpoint every N steps (default 5)")
    p.add_argument("--kill-at", type=int, default=None,
                   help="SIGKILL the run once it reports this step (default: just after the "
                   "checkpoint nearest 70%% of --steps)")
    p.add_argument("--dir", type=Path, default=None,
                   help="fresh checkpoint directory, kept afterwards (default: a temporary one)")
    p.add_argument("--worker", choices=("reference", "train", "resume"), help=argparse.SUPPRESS)
    p.add_argument("--gated", action="store_true", help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.worker:
        return opts
    if opts.every < 1 or opts.steps < 2:
        p.error("use --every >= 1 and --steps >= 2")
    if opts.every + 1 >= opts.steps:  # (else no KILL_AT fits: a trial was told of it)
        p.error(f"--every {opts.every} leaves no step to kill at between the first checkpoint "
                f"and the end (--steps {opts.steps}): use --every < {opts.steps - 1}")
    if opts.kill_at is None:
        # just after a save: that save is likely still being written when the kill comes
        opts.kill_at = max(opts.steps * 7 // 10 // opts.every * opts.every, opts.every) + 1
    if not opts.every < opts.kill_at < opts.steps:
        p.error(f"--kill-at must lie after the first checkpoint and before the end: "
                f"{opts.every} < KILL_AT < {opts.steps}")
    if opts.dir is not None and opts.dir.exists() and any(opts.dir.iterdir()):
        p.error(f"--dir {opts.dir} is not empty: pass a fresh directory")
    return opts


def main(argv: list[str] | None = None, *,
         on_killed: Callable[[Path], None] | None = None) -> int:
    """Run the demo; ``on_killed(dir)`` is called between the kill and the resume."""
    try:
        opts = parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    if opts.worker:
        return worker(opts.worker, opts.steps, opts.every, opts.dir, opts.gated)
    started = time.perf_counter()
    if opts.dir is not None:
        opts.dir.mkdir(parents=True, exist_ok=True)
        code = demo(opts, opts.dir, on_killed)
        print(f"checkpoints kept in {opts.dir}: try  asyncckpt inspect {opts.dir}")
    else:
        with tempfile.TemporaryDirectory(prefix="asyncckpt-demo-") as tmp:
            code = demo(opts, Path(tmp), on_killed)
    print(f"({time.perf_counter() - started:.1f}s)")
    return code


if __name__ == "__main__":
    sys.exit(main())
