"""Save on preemption: turn SIGTERM into a request the training loop answers at a step.

A scheduler (Kubernetes, SLURM, a spot-instance reclaim) sends SIGTERM and kills the
process a grace period later. Saving from the signal handler would copy tensors an
optimizer step may be changing; instead the handler only notes the request, and the
loop, at its next step boundary, asks every rank whether one of them was told to stop,
saves synchronously and exits.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import threading
from collections.abc import Iterable
from types import FrameType, TracebackType
from typing import Any

import torch

from .errors import CheckpointConfigError, CheckpointTimeoutError

log = logging.getLogger(__name__)

_Handler = Any  # what signal.signal returns: a callable, an int, a Handlers member or None


def _signals(values: Iterable[int], name: str) -> list[signal.Signals]:
    """``values`` as signals; CheckpointConfigError naming ``name`` for anything else."""
    if isinstance(values, int) or not isinstance(values, Iterable):
        raise CheckpointConfigError(f"{name}={values!r}: pass a tuple of signals, e.g. "
                                    "(signal.SIGTERM,)")
    out = []
    for v in values:
        try:
            out.append(signal.Signals(v))
        except ValueError:
            raise CheckpointConfigError(f"{name}: {v!r} is no signal of this platform") from None
    return out


# (torch cannot cancel a collective: a late rank's next all-reduce pairs with this one)
_ABANDONED = (". The all-reduce stays pending: a rank that joins late pairs its later "
              "calls with it, so do not call should_stop again in this process group; end "
              "the job (it resumes from the last committed step)")


class PreemptionWatch:
    """Notes SIGTERM (or the signals given) while installed; the loop polls ``should_stop``.

    The first signal only sets a flag (the handler that was there before is not called):
    training goes on to the next step boundary, where ``should_stop()`` returns True on
    every rank at the same step, the loop saves with ``ckpt.save`` (synchronous:
    durable before it returns) and leaves. Later signals are noted and change nothing,
    except those in ``escalate`` (SIGINT by default, when watched: someone pressing
    Ctrl-C again), which get the handler that was there before. A repeated SIGTERM is
    no one insisting: torchrun's agent forwards a SIGTERM twice when it gets two (as
    under ``timeout``, or a scheduler that signals every process), and a scheduler
    that means it sends SIGKILL after its grace period anyway.

    Not thread-safe: install and poll from the main thread (Python runs signal handlers
    there only). ``should_stop`` is collective when a default process group exists:
    call it on every rank at the same steps.

    Example:
        >>> with asyncckpt.PreemptionWatch() as preempt:
        ...     for step in range(start, steps):
        ...         train_step()
        ...         if preempt.should_stop():
        ...             ckpt.save(state, step=step + 1)
        ...             break
    """

    def __init__(self, signals: Iterable[int] = (signal.SIGTERM,), *,
                 escalate: Iterable[int] = (signal.SIGINT,)) -> None:
        # (once each: installed twice, the watch would be its own "previous" handler)
        self.signals = tuple(dict.fromkeys(_signals(signals, "signals")))
        if not self.signals:
            raise CheckpointConfigError("PreemptionWatch(signals=()): name at least one "
                                        "signal to watch, e.g. signal.SIGTERM")
        self.escalate = frozenset(_signals(escalate, "escalate"))
        uncatchable = sorted(s.name for s in self.escalate
                             if s in (signal.SIGKILL, getattr(signal, "SIGSTOP", None)))
        if uncatchable:  # (no handler ever sees them: it would do nothing, silently)
            raise CheckpointConfigError(
                f"PreemptionWatch(escalate=...): {', '.join(uncatchable)} cannot be caught, "
                "so it cannot escalate; name watched signals whose second delivery should "
                "go to the handler installed before, e.g. escalate=(signal.SIGINT,)")
        self._previous: dict[signal.Signals, _Handler] = {}
        self._received: signal.Signals | None = None
        self._agreed = False
        self._cpu_group: Any = None  # gloo, for should_stop beside an NCCL default group

    @property
    def requested(self) -> bool:
        """Whether this process received one of the signals (no other rank is asked)."""
        return self._received is not None

    @property
    def received(self) -> signal.Signals | None:
        """The first watched signal this process received, or None."""
        return self._received

    def install(self) -> PreemptionWatch:
        """Install the handlers (the context manager does this); returns ``self``."""
        if threading.current_thread() is not threading.main_thread():
            raise CheckpointConfigError(
                "PreemptionWatch must be installed from the main thread: Python delivers "
                "signals to it only; create it where the training loop runs")
        if self._previous:
            raise CheckpointConfigError("this PreemptionWatch is installed already")
        for sig in self.signals:
            try:
                self._previous[sig] = signal.signal(sig, self._on_signal)
            except (OSError, ValueError) as exc:  # SIGKILL, SIGSTOP: no handler is allowed
                self.uninstall()  # (what was installed before it: none left behind)
                raise CheckpointConfigError(
                    f"PreemptionWatch cannot catch {sig.name}: {exc}; watch signals a "
                    "process may handle (SIGTERM, SIGUSR1...)") from exc
        return self

    def uninstall(self) -> None:
        """Put back the handlers that were there before ``install``."""
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)

    def __enter__(self) -> PreemptionWatch:
        return self.install()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.uninstall()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if self._received is None:
            self._received = sig  # all a handler should do: the loop does the rest
            return
        if sig not in self.escalate:  # delivered again, not insisted on: the save goes on
            return
        # Asked again: the user means it. Hand the signal to whoever had it before us,
        # which for SIGINT is KeyboardInterrupt, for SIGTERM by default the end.
        previous = self._previous.get(sig, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
            return
        if previous == signal.SIG_IGN:
            return
        self.uninstall()
        os.kill(os.getpid(), signum)

    def should_stop(self, group: Any = None, *, timeout: float = 300.0) -> bool:
        """Whether any rank received a watched signal: the step to save and leave at.

        With a default process group this is a collective (one all-reduce of one
        number, on the calling thread): every rank of ``group`` (default: all) must call
        it at the same steps, and all get the same answer. Over NCCL, with ``group``
        None, the number goes over a gloo group of all ranks made on the first call, so
        that the CPU never waits for the GPU here. Without one it returns
        ``requested``. Once True it stays True without asking the ranks again.

        Raises:
            CheckpointTimeoutError: the other ranks did not join within ``timeout``
                seconds (a rank died, or does not call should_stop at this step).
        """
        if self._agreed:
            return True
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            self._agreed = self.requested
            return self._agreed
        backend = str(dist.get_backend(group))
        device = torch.device("cpu")
        if "gloo" not in backend and "nccl" in backend:
            if group is None:
                # NCCL would queue the all-reduce behind the step's kernels and make the
                # CPU wait for the GPU at every step: ask over a gloo group of all ranks
                # instead (made once, on the first call, which every rank makes).
                if self._cpu_group is None:
                    self._cpu_group = dist.new_group(backend="gloo")
                group = self._cpu_group
            else:  # a subgroup: not every rank would join the making of a gloo twin
                device = torch.device("cuda", torch.cuda.current_device())
        flag = torch.tensor([1 if self.requested else 0], dtype=torch.int32, device=device)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True)
        try:
            finished = work.wait(timeout=datetime.timedelta(seconds=timeout))
        except RuntimeError as exc:
            raise CheckpointTimeoutError(
                f"should_stop: the ranks did not all join its all-reduce within {timeout:g} "
                f"s ({exc}); call it on every rank at the same steps{_ABANDONED}") from exc
        if finished is False:
            raise CheckpointTimeoutError(
                f"should_stop: the ranks did not all join its all-reduce within {timeout:g} "
                f"s; call it on every rank at the same steps{_ABANDONED}")
        self._agreed = bool(flag.item())
        if self._agreed:
            log.warning("rank=%d: preemption requested (%s on %s): stopping at this step",
                        dist.get_rank(), self._received.name if self._received else "signal",
                        "this rank" if self._received else "another rank")
        return self._agreed
