"""PreemptionWatch: SIGTERM becomes a request answered at a step boundary, in a real
process that saves and exits; a second SIGTERM ends the process as before."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import asyncckpt
from asyncckpt import CheckpointConfigError
from asyncckpt.preemption import PreemptionWatch

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

# A training loop: saves every 5 steps in the background; on SIGTERM saves at the next
# step boundary, synchronously, prints it and exits 0. ``hang`` makes the preempted save
# "take forever" (a sleep), to send the second signal during it.
LOOP = textwrap.dedent("""
    import sys, time
    import torch
    import asyncckpt

    root, hang = sys.argv[1], sys.argv[2] == "hang"
    w = torch.zeros(1000)
    with asyncckpt.PreemptionWatch() as preempt, \\
            asyncckpt.AsyncCheckpointer(root, keep_last=2) as ckpt:
        print("ready", flush=True)
        for step in range(1, 100000):
            w += 1  # the "optimizer step": w == step after it
            if preempt.should_stop():
                print("preempted", step, preempt.received.name, flush=True)
                if hang:
                    time.sleep(60)
                ckpt.save({"w": w, "step": step}, step=step)
                print("saved", step, flush=True)
                break
            if step % 5 == 0:
                ckpt.save_async({"w": w, "step": step}, step=step)
            time.sleep(0.002)
    sys.exit(0)
""")


def _start(tmp_path: Path, mode: str) -> subprocess.Popen[str]:
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "ck"), mode],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read() if proc.stderr else ""
    return proc


def test_sigterm_saves_at_the_next_step_and_exits_cleanly(tmp_path: Path) -> None:
    proc = _start(tmp_path, "normal")
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while len(list((tmp_path / "ck").glob("step_*"))) < 2:  # let it train and save a while
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no two saves in 60 s: {proc.communicate()}")
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    words = out.split()
    assert "preempted" in words and "SIGTERM" in words, out
    step = int(words[words.index("saved") + 1])
    assert step == int(words[words.index("preempted") + 1])
    with asyncckpt.AsyncCheckpointer(tmp_path / "ck") as ckpt:
        assert ckpt.latest_step() == step
        got = ckpt.load(step=step)
    assert got["step"] == step
    assert torch.equal(got["w"], torch.full((1000,), float(step)))


def test_a_second_sigterm_ends_the_process_as_before(tmp_path: Path) -> None:
    proc = _start(tmp_path, "hang")
    assert proc.stdout is not None
    proc.send_signal(signal.SIGTERM)
    line = proc.stdout.readline()
    assert line.startswith("preempted"), line
    proc.send_signal(signal.SIGTERM)  # during the (slow) save: the default handler's turn
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGTERM


def test_handlers_are_put_back_and_a_signal_in_process_is_noted() -> None:
    before = signal.getsignal(signal.SIGUSR2)
    seen: list[int] = []
    signal.signal(signal.SIGUSR2, lambda s, f: seen.append(s))
    try:
        with PreemptionWatch([signal.SIGUSR2]) as preempt:
            assert not preempt.requested and not preempt.should_stop()
            signal.raise_signal(signal.SIGUSR2)
            assert preempt.requested and preempt.received == signal.SIGUSR2
            assert preempt.should_stop() and preempt.should_stop()  # stays True
            assert seen == []  # the first signal is ours alone
            signal.raise_signal(signal.SIGUSR2)  # the second goes to the previous handler
            assert seen == [signal.SIGUSR2]
        signal.raise_signal(signal.SIGUSR2)  # uninstalled: the previous handler again
        assert seen == [signal.SIGUSR2, signal.SIGUSR2]
    finally:
        signal.signal(signal.SIGUSR2, before)


def test_a_second_signal_that_was_ignored_stays_ignored() -> None:
    before = signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    try:
        with PreemptionWatch([signal.SIGUSR2]) as preempt:
            signal.raise_signal(signal.SIGUSR2)
            signal.raise_signal(signal.SIGUSR2)  # previous was SIG_IGN: still alive
            assert preempt.requested
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGUSR2, before)


def test_installing_off_the_main_thread_or_twice_is_refused() -> None:
    errors: list[BaseException] = []

    def off_main() -> None:
        try:
            PreemptionWatch().install()
        except BaseException as exc:
            errors.append(exc)

    th = threading.Thread(target=off_main)
    th.start()
    th.join()
    assert len(errors) == 1 and isinstance(errors[0], CheckpointConfigError)
    assert "main thread" in str(errors[0])
    with PreemptionWatch([signal.SIGUSR2]) as preempt, \
            pytest.raises(CheckpointConfigError, match="installed already"):
        preempt.install()
    with pytest.raises(CheckpointConfigError, match="at least one"):
        PreemptionWatch([])
