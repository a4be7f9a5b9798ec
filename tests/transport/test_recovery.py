"""The whole recovery story, with two real processes on 127.0.0.1.

Process A trains for N steps, then offers its live state (model, AdamW, LR scheduler,
RNG state, step) through a transport. Process B starts fresh, fetches step N into its
own model and optimizer in place, and both train K more steps on the same per-step
data. Their losses and final state must be bit for bit equal: B is a true replacement
for A. Run over HTTP (A prints its address and waits) and over a gloo process group
(A sends while B receives). This file is also the program of both processes.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import hashlib
import json
import os
import select
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

N, K = 6, 5  # steps before the recovery, steps after it
HARD_TIMEOUT_S = 45.0
TOKEN_ENV = "RECOVERY_TEST_TOKEN"


# --- the training job both processes run -----------------------------------------------------

def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return model, opt, sched


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any,
               step: int) -> float:
    g = torch.Generator().manual_seed(10_000 + step)  # the data of a step is fixed
    x = torch.randn(8, 16, generator=g)
    y = torch.randn(8, 4, generator=g)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)  # dropout draws from the global RNG
    loss.backward()
    opt.step()
    sched.step()
    return float(loss.item())


def fingerprint(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any
                ) -> dict[str, str]:
    """sha256 of every tensor of the model and optimizer, and the scheduler's state."""
    out: dict[str, str] = {}

    def add(name: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous().reshape(-1)
            out[name] = hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()
        elif isinstance(value, dict):
            for k, v in value.items():
                add(f"{name}/{k}", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                add(f"{name}/{i}", v)
        else:
            out[name] = repr(value)

    add("model", model.state_dict())
    add("optim", opt.state_dict())
    add("sched", sched.state_dict())
    out["rng"] = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()
    return out


def live_state(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any,
               step: int) -> dict[str, Any]:
    from asyncckpt import RNGState

    return {"model": model, "optim": opt, "sched": sched, "rng": RNGState(), "step": step}


# --- the two processes -----------------------------------------------------------------------

def process_a(kind: str, work: Path, port: int) -> None:
    """Train N steps, offer the state, wait until B has it, train K more."""
    losses = []
    model, opt, sched = build(seed=0)
    for step in range(N):
        losses.append(train_step(model, opt, sched, step))
    timeout = datetime.timedelta(seconds=30)
    if kind == "http":
        from asyncckpt.transport import HTTPTransport

        tr = HTTPTransport(timeout=timeout, token=os.environ[TOKEN_ENV])
        tr.send_checkpoint([1], N, live_state(model, opt, sched, N), timeout)
        print(tr.address(), flush=True)
        fetched = work / "fetched"
        deadline = time.monotonic() + 30
        while not fetched.exists():  # the tensors must not change until B has them
            if time.monotonic() > deadline:
                raise TimeoutError("B never fetched the state")
            time.sleep(0.02)
        tr.disallow_checkpoint()
    else:
        print("pg:0", flush=True)  # B joins the group: this rank's metadata() is known
        tr = pg_transport(0, port)
        assert tr.metadata() == "pg:0"
        tr.send_checkpoint([1], N, live_state(model, opt, sched, N), timeout)
        tr.disallow_checkpoint()
    for step in range(N, N + K):
        losses.append(train_step(model, opt, sched, step))
    tr.shutdown()
    finish(work / "result_a.json", {"losses": [x.hex() for x in losses[N:]],
                                    "before": [x.hex() for x in losses[:N]],
                                    "state": fingerprint(model, opt, sched)})


def process_b(kind: str, work: Path, port: int, address: str) -> None:
    """Start fresh, fetch step N into the fresh objects in place, train K steps."""
    model, opt, sched = build(seed=1234)  # other weights, no optimizer state, other RNG
    params = [(p, p.data_ptr()) for p in model.parameters()]
    state = live_state(model, opt, sched, 0)
    timeout = datetime.timedelta(seconds=30)
    if kind == "http":
        from asyncckpt.transport import HTTPTransport

        tr = HTTPTransport(timeout=timeout, token=os.environ[TOKEN_ENV])
        out = tr.recv_checkpoint(0, address, N, timeout, into=state)
        (work / "fetched").write_text("ok")
    else:
        tr = pg_transport(1, port)
        out = tr.recv_checkpoint(0, address, N, timeout, into=state)
    assert out is state and state["step"] == N, state["step"]
    assert all(p is q and p.data_ptr() == ptr
               for (q, ptr), p in zip(params, model.parameters(), strict=True))
    losses = [train_step(model, opt, sched, step) for step in range(N, N + K)]
    tr.shutdown()
    finish(work / "result_b.json", {"losses": [x.hex() for x in losses],
                                    "state": fingerprint(model, opt, sched)})


def pg_transport(rank: int, port: int) -> Any:
    import torch.distributed as dist

    from asyncckpt.transport import PGTransport

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=30))
    return PGTransport(dist.new_group(backend="gloo"), datetime.timedelta(seconds=30))


def finish(path: Path, result: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.rename(path)
    sys.stdout.flush()
    os._exit(0)  # no teardown: a process group's threads must not hold up the exit


def child_main(argv: list[str]) -> None:
    faulthandler.dump_traceback_later(HARD_TIMEOUT_S - 5, exit=True)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    role, kind, work, port = argv[0], argv[1], Path(argv[2]), int(argv[3])
    if role == "a":
        process_a(kind, work, port)
    else:
        process_b(kind, work, port, argv[4])


# --- the test --------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("kind", ["http", "pg"])
def test_a_fresh_process_recovers_from_a_live_peer_bit_exactly(kind: str, tmp_path: Path
                                                                ) -> None:
    env = {**os.environ, TOKEN_ENV: "recovery-secret", "OMP_NUM_THREADS": "1",
           "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1"}
    port = str(_free_port())
    deadline = time.monotonic() + HARD_TIMEOUT_S
    logs = {r: open(tmp_path / f"{r}.err", "wb") for r in "ab"}  # noqa: SIM115
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        procs["a"] = subprocess.Popen(
            [sys.executable, __file__, "a", kind, str(tmp_path), port], env=env,
            stdout=subprocess.PIPE, stderr=logs["a"])
        assert procs["a"].stdout is not None
        ready, _, _ = select.select([procs["a"].stdout], [], [], HARD_TIMEOUT_S)
        address = procs["a"].stdout.readline().decode().strip() if ready else ""
        assert address, f"A printed no address:\n{_log(tmp_path, 'a')}"
        procs["b"] = subprocess.Popen(
            [sys.executable, __file__, "b", kind, str(tmp_path), port, address], env=env,
            stdout=logs["b"], stderr=subprocess.STDOUT)
        for r, p in procs.items():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{r.upper()} hit the hard timeout:\n{_log(tmp_path, r)}")
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait()
        for f in logs.values():
            f.close()
    for r, p in procs.items():
        assert p.returncode == 0, f"{r.upper()} failed ({p.returncode}):\n{_log(tmp_path, r)}"
    a = json.loads((tmp_path / "result_a.json").read_text())
    b = json.loads((tmp_path / "result_b.json").read_text())
    assert len(a["losses"]) == K
    assert a["losses"] == b["losses"], "the losses after the recovery differ"
    assert a["state"] == b["state"], sorted(k for k in a["state"]
                                            if a["state"][k] != b["state"].get(k))
    assert len(set(a["before"] + a["losses"])) == N + K  # it did train: every loss differs


def _log(tmp_path: Path, r: str) -> str:
    with contextlib.suppress(OSError):
        return (tmp_path / f"{r}.err").read_text(errors="replace")[-6000:]
    return ""


if __name__ == "__main__":
    child_main(sys.argv[1:])
