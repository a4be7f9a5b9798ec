"""PreemptionWatch: SIGTERM becomes a request answered at a step boundary, in a real
process that saves and exits; a repeated SIGTERM does not cut the save short, a signal
in ``escalate`` (SIGINT by default) does."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

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
    import signal, sys, time
    import torch
    import asyncckpt

    root, hang = sys.argv[1], sys.argv[2] == "hang"
    escalate = [getattr(signal, name) for name in sys.argv[3:]]
    # Python's own Ctrl-C handler, whatever this process inherited: a suite started in
    # the background by a shell ignores SIGINT, which Python then leaves ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    w = torch.zeros(1000)
    with asyncckpt.PreemptionWatch(escalate=escalate) as preempt, \\
            asyncckpt.AsyncCheckpointer(root, keep_last=2) as ckpt:
        print("ready", flush=True)
        for step in range(1, 100000):
            w += 1  # the "optimizer step": w == step after it
            if preempt.should_stop():
                print("preempted", step, preempt.received.name, flush=True)
                if hang:
                    time.sleep(3)
                ckpt.save({"w": w, "step": step}, step=step)
                print("saved", step, flush=True)
                break
            if step % 5 == 0:
                ckpt.save_async({"w": w, "step": step}, step=step)
            time.sleep(0.002)
    sys.exit(0)
""")


def _start(tmp_path: Path, mode: str, *escalate: str) -> subprocess.Popen[str]:
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "ck"), mode,
                             *escalate],
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


def test_a_repeated_sigterm_does_not_cut_the_save_short(tmp_path: Path) -> None:
    """torchrun's agent forwards SIGTERM twice when it gets two (under ``timeout``, or
    a scheduler that signals every process): the save must still happen."""
    proc = _start(tmp_path, "hang")
    assert proc.stdout is not None
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)  # (at once: before or after the handler ran)
    line = proc.stdout.readline()
    assert line.startswith("preempted"), line
    proc.send_signal(signal.SIGTERM)  # and during the (slow) save
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    step = int(line.split()[1])
    assert f"saved {step}" in out, out
    with asyncckpt.AsyncCheckpointer(tmp_path / "ck") as ckpt:
        assert ckpt.latest_step() == step


@pytest.mark.parametrize("escalate,second", [("SIGTERM", signal.SIGTERM),
                                             ("SIGINT", signal.SIGINT)])
def test_a_signal_in_escalate_ends_the_process_during_the_save(
        tmp_path: Path, escalate: str, second: signal.Signals) -> None:
    proc = _start(tmp_path, "hang", escalate)
    assert proc.stdout is not None
    proc.send_signal(signal.SIGTERM)
    line = proc.stdout.readline()
    assert line.startswith("preempted"), line
    proc.send_signal(second)  # during the (slow) save: the previous handler's turn
    out, err = proc.communicate(timeout=30)
    if second == signal.SIGTERM:
        assert proc.returncode == -signal.SIGTERM
    else:  # Python's own SIGINT handler: KeyboardInterrupt
        assert proc.returncode != 0 and "KeyboardInterrupt" in err, err
    assert "saved" not in out, out


def test_handlers_are_put_back_and_a_signal_in_process_is_noted() -> None:
    before = signal.getsignal(signal.SIGUSR2)
    seen: list[int] = []
    signal.signal(signal.SIGUSR2, lambda s, f: seen.append(s))
    try:
        with PreemptionWatch([signal.SIGUSR2], escalate=[signal.SIGUSR2]) as preempt:
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


def test_by_default_a_repeated_signal_is_only_noted() -> None:
    before = signal.getsignal(signal.SIGUSR2)
    seen: list[int] = []
    signal.signal(signal.SIGUSR2, lambda s, f: seen.append(s))
    try:
        with PreemptionWatch([signal.SIGUSR2]) as preempt:
            for _ in range(3):
                signal.raise_signal(signal.SIGUSR2)
            assert preempt.received == signal.SIGUSR2 and seen == []
    finally:
        signal.signal(signal.SIGUSR2, before)


def test_a_signal_named_twice_is_watched_once_and_put_back() -> None:
    """Installed twice, the watch was its own "previous" handler: the second signal
    recursed (RecursionError) and uninstall() left the watch in place for good."""
    before = signal.getsignal(signal.SIGUSR2)
    seen: list[int] = []
    mine = lambda s, f: seen.append(s)  # noqa: E731
    signal.signal(signal.SIGUSR2, mine)
    try:
        watch = PreemptionWatch([signal.SIGUSR2, signal.SIGUSR2], escalate=[signal.SIGUSR2])
        assert watch.signals == (signal.SIGUSR2,)
        with watch:
            signal.raise_signal(signal.SIGUSR2)
            signal.raise_signal(signal.SIGUSR2)  # handed to the previous handler
            assert watch.received == signal.SIGUSR2 and seen == [signal.SIGUSR2]
        assert signal.getsignal(signal.SIGUSR2) is mine
    finally:
        signal.signal(signal.SIGUSR2, before)


def test_a_signal_that_cannot_be_caught_is_refused_and_nothing_stays_installed() -> None:
    before = signal.getsignal(signal.SIGUSR2)
    watch = PreemptionWatch([signal.SIGUSR2, signal.SIGKILL])
    with pytest.raises(CheckpointConfigError, match="cannot catch SIGKILL"):
        watch.install()
    assert signal.getsignal(signal.SIGUSR2) == before  # was left taken over by the watch
    watch = PreemptionWatch([signal.SIGUSR2])
    with watch:  # and the same kind of object installs afresh
        assert signal.getsignal(signal.SIGUSR2) == watch._on_signal
    for bad, what in ((signal.SIGTERM, "signals=<Signals.SIGTERM: 15>: pass a tuple"),
                      ((12345,), "12345 is no signal")):
        with pytest.raises(CheckpointConfigError, match=what):
            PreemptionWatch(bad)  # type: ignore[arg-type]
    with pytest.raises(CheckpointConfigError, match="escalate"):
        PreemptionWatch(escalate=(12345,))
    # (a trial's escalate=(SIGKILL,) was taken silently: no handler ever sees it)
    with pytest.raises(CheckpointConfigError, match="SIGKILL cannot be caught, so it cannot "
                                                    "escalate"):
        PreemptionWatch(escalate=(signal.SIGKILL,))


def test_should_stop_over_nccl_asks_over_a_gloo_group_of_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Over NCCL the all-reduce would wait for the step's kernels, every step: the
    default group's question goes over a gloo group made once, with a CPU tensor."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a default process group is already set up in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        made: list[Any] = []
        real_new_group, real_all_reduce = dist.new_group, dist.all_reduce
        reduced: list[tuple[Any, torch.device]] = []

        def new_group(*a: Any, **kw: Any) -> Any:
            made.append(kw.get("backend"))
            return real_new_group(*a, **kw)

        def all_reduce(t: torch.Tensor, *a: Any, group: Any = None, **kw: Any) -> Any:
            reduced.append((group, t.device))
            return real_all_reduce(t, *a, group=group, **kw)

        monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
        monkeypatch.setattr(dist, "new_group", new_group)
        monkeypatch.setattr(dist, "all_reduce", all_reduce)
        preempt = PreemptionWatch([signal.SIGUSR2])
        assert not preempt.should_stop() and not preempt.should_stop()
        assert made == ["gloo"]  # once
        assert len(reduced) == 2 and all(g is not None and g is reduced[0][0]
                                         and d.type == "cpu" for g, d in reduced), reduced
    finally:
        dist.destroy_process_group()


def test_a_second_signal_that_was_ignored_stays_ignored() -> None:
    before = signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    try:
        with PreemptionWatch([signal.SIGUSR2], escalate=[signal.SIGUSR2]) as preempt:
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
