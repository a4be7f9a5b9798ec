"""Live recovery under torchft: a killed replica heals from a healthy one through an
asyncckpt transport.

    python examples/torchft_heal.py [--transport http|pg] [--in-place] [--steps N]

torchft's ``Manager`` takes any object with the checkpoint-transport interface as
``checkpoint_transport=``; asyncckpt's ``HTTPTransport`` and ``PGTransport`` are such
objects. This script starts torchft's ``LighthouseServer`` on 127.0.0.1 and two replica
groups, separate processes of one gloo CPU rank each, training a tiny MLP with Adam
under torchft's ``DistributedDataParallel`` and ``OptimizerWrapper``. It SIGKILLs
replica 1 after a few steps and restarts it with other random weights: at its first
quorum the Manager sees it is behind and has it receive replica 0's model and optimizer
state with the transport's ``recv_checkpoint``. Both train to step N (``--steps``) and
on until they take a step together. PASS (exit 0) when the restarted replica healed that
way and both end at the same step with identical model and optimizer state (sha256 of
the tensors' bytes); else FAIL with the reason (exit 1).

``--transport http`` (default) sends over HTTP on 127.0.0.1, ``pg`` over torchft's own
replica process group. ``--in-place`` gives the transport ``state_dict=`` so that the
receiver fills its own tensors instead of new ones (docs/peer-recovery.md, "With torchft").

Install: torchft's wheel depends on torch, and pip would replace a CPU torch with a build
of its choosing. Install torch first, then torchft without dependencies, then the three
it needs (pure Python; they pull in protobuf, googleapis-common-protos, requests and
more opentelemetry packages, not torch). torchft 0.2.0's wheel is for CPython 3.11::

    pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    pip install --no-deps torchft==0.2.0
    pip install opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp-proto-http
    pip install -e .          # asyncckpt, from this repository
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

KILL_AFTER = 5  # replica 1 is killed once it has committed this many steps
TIMEOUT = timedelta(seconds=10)  # torchft's and the transport's timeouts
REPLICA_LIMIT_S = 45  # a replica process that runs longer kills itself (SIGALRM)
RUN_LIMIT_S = 50  # the whole run, as seen by the orchestrator


# ------------------------------------------------------------------------- a replica group
def state_hash(tree: Any) -> str:
    """sha256 over every tensor's bytes and every other value's repr, in key order."""

    def leaves(node: Any, path: str) -> Iterator[tuple[str, Any]]:
        if isinstance(node, dict):
            for key in sorted(node, key=str):
                yield from leaves(node[key], f"{path}/{key}")
        elif isinstance(node, (list, tuple)):
            for i, item in enumerate(node):
                yield from leaves(item, f"{path}[{i}]")
        else:
            yield path, node

    h = hashlib.sha256()
    for path, value in leaves(tree, ""):
        h.update(path.encode())
        h.update(value.numpy().tobytes() if hasattr(value, "numpy") else repr(value).encode())
    return h.hexdigest()


def run_replica(args: argparse.Namespace) -> None:
    signal.alarm(REPLICA_LIMIT_S)  # never outlive the orchestrator for long
    import torch
    import torch.distributed as dist
    from torch import nn, optim
    from torchft import Manager, ProcessGroupGloo
    from torchft.ddp import DistributedDataParallel
    from torchft.optim import OptimizerWrapper

    from asyncckpt.transport import HTTPTransport, PGTransport

    rid, inc, workdir = args.replica, args.incarnation, Path(args.workdir)
    torch.set_num_threads(1)
    torch.manual_seed(100 * rid + inc)  # a restarted replica starts from other weights
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    adam = optim.Adam(model.parameters(), lr=1e-2)

    def state_dict() -> dict[str, Any]:  # what the Manager sends to a recovering replica
        return {"model": model.state_dict(), "optim": adam.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:  # what it does with a received one
        model.load_state_dict(state["model"])
        adam.load_state_dict(state["optim"])

    # With --in-place the transport receives into the tensors of the Manager's own state
    # (model, optimizer and torchft's counters); `manager` is looked up when it receives.
    into = (lambda: manager._manager_state_dict()) if args.in_place else None
    pg = ProcessGroupGloo(timeout=TIMEOUT)
    transport: HTTPTransport | PGTransport
    if args.transport == "http":
        transport = HTTPTransport(timeout=TIMEOUT, host="127.0.0.1", state_dict=into)
    else:
        transport = PGTransport(pg, timeout=TIMEOUT, device="cpu", state_dict=into)

    # Wrap recv_checkpoint to leave a marker: the orchestrator checks that the heal
    # really went through this transport.
    receive = transport.recv_checkpoint

    def recv_checkpoint(src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        state = receive(src_rank, metadata, step, timeout)
        print(f"replica {rid}: healed to step {step} with {type(transport).__name__}",
              flush=True)
        (workdir / f"healed-{rid}-{inc}").write_text(str(step))
        return state

    transport.recv_checkpoint = recv_checkpoint  # type: ignore[method-assign]

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=pg, min_replica_size=1, load_state_dict=load_state_dict, state_dict=state_dict,
        replica_id=str(rid), rank=0, world_size=1, store_addr="127.0.0.1",
        store_port=store.port, lighthouse_addr=args.lighthouse, hostname="127.0.0.1",
        port=0, timeout=TIMEOUT, quorum_timeout=2 * TIMEOUT, connect_timeout=TIMEOUT,
        checkpoint_transport=transport,
    )
    ddp = DistributedDataParallel(manager, model)
    optimizer = OptimizerWrapper(manager, adam)

    # Train to --steps, and on until the last step was taken by both replica groups
    # together: a replica that finished alone would leave the other one nobody to heal from.
    while manager.current_step() < args.steps or manager.num_participants() < 2:
        # each replica group trains on its own batches, a function of (replica, step)
        gen = torch.Generator().manual_seed(1000 * rid + manager.current_step())
        x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        optimizer.zero_grad()  # starts a quorum; a replica that is behind heals here
        nn.functional.cross_entropy(ddp(x), y).backward()  # gradients averaged
        optimizer.step()  # applied only if every rank commits
        (workdir / f"step-{rid}").write_text(str(manager.current_step()))
        time.sleep(0.05)

    final = f"{manager.current_step()} {state_hash(state_dict())}"
    (workdir / f"result-{rid}-{inc}").write_text(final)
    print(f"replica {rid}: finished at step {final}", flush=True)
    time.sleep(1)  # let the peer finish its last step before this one leaves the quorum
    manager.shutdown(wait=False)


# ------------------------------------------------------------------------- the orchestrator
def read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def orchestrate(args: argparse.Namespace, workdir: Path, lighthouse: str,
                procs: list[subprocess.Popen[bytes]]) -> str | None:
    """Runs the scenario; returns None on success, else why it failed."""
    deadline = time.monotonic() + RUN_LIMIT_S

    def spawn(rid: int, inc: int) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, __file__, "--replica", str(rid), "--incarnation", str(inc),
               "--lighthouse", lighthouse, "--workdir", str(workdir),
               "--transport", args.transport, "--steps", str(args.steps)]
        cmd += ["--in-place"] if args.in_place else []
        with open(workdir / f"replica-{rid}-{inc}.log", "wb") as log:
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
        return procs[-1]

    def step_of(rid: int) -> int:
        text = read(workdir / f"step-{rid}")
        return int(text) if text.strip() else -1  # (empty while being rewritten)

    first, second = spawn(0, 0), spawn(1, 0)
    while min(step_of(0), step_of(1)) < KILL_AFTER:
        exited = first.poll() is not None or second.poll() is not None
        if exited or time.monotonic() > deadline:
            return f"the replicas did not run to step {KILL_AFTER}"
        time.sleep(0.05)
    second.kill()  # SIGKILL: no chance to clean up, as in a real crash
    second.wait()
    print(f"killed replica 1 at step {step_of(1)}, restarting it", flush=True)
    restarted = spawn(1, 1)

    for rid, proc in ((0, first), (1, restarted)):
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return f"replica {rid} did not finish within {RUN_LIMIT_S} s"
        if proc.returncode != 0:
            return f"replica {rid} exited with code {proc.returncode}"
    healed_at = read(workdir / "healed-1-1")
    if not healed_at:
        return "the restarted replica 1 never called recv_checkpoint"
    print(f"the restarted replica 1 healed to step {healed_at}", flush=True)
    results = [read(workdir / "result-0-0"), read(workdir / "result-1-1")]
    print(f"replica 0: {results[0]}\nreplica 1: {results[1]}", flush=True)
    if results[0] != results[1] or int(results[0].split()[0]) < args.steps:
        return "the replicas did not end at the same step with the same state"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transport", choices=["http", "pg"], default="http")
    parser.add_argument("--in-place", action="store_true",
                        help="receive into the recovering replica's own tensors")
    parser.add_argument("--steps", type=int, default=30, help="train to at least this step")
    # set by the orchestrator when it starts a replica group
    parser.add_argument("--replica", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--incarnation", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps <= KILL_AFTER + 5:
        parser.error(f"--steps must be more than {KILL_AFTER + 5}")
    if args.replica is not None:
        run_replica(args)
        return 0

    # on SIGTERM, exit through the `finally` below that stops the replicas
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse logs every quorum at INFO
    try:
        from torchft.coordination import LighthouseServer
    except ImportError as exc:  # (a docs trial met a bare traceback)
        print(f"FAIL: torchft is not installed ({exc}); install it as this script's "
              "docstring says (torch first, then pip install --no-deps torchft==0.2.0)",
              file=sys.stderr)
        return 1

    print(f"transport={args.transport} in_place={args.in_place} steps={args.steps}", flush=True)
    procs: list[subprocess.Popen[bytes]] = []
    # A quorum waits up to join_timeout_ms for the replicas of the last one; a replica
    # silent for heartbeat_timeout_ms counts as gone. (torchft's defaults suit clusters.)
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=3000,
                                  quorum_tick_ms=100, heartbeat_timeout_ms=2000)
    with tempfile.TemporaryDirectory(prefix="torchft_heal-") as tmp:
        try:
            # (its address names this host; the replicas connect where it listens)
            address = f"http://127.0.0.1:{urlsplit(lighthouse.address()).port}"
            failure = orchestrate(args, Path(tmp), address, procs)
        finally:
            for proc in procs:  # whatever happened, leave no replica behind
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            lighthouse.shutdown()
        if failure is not None:
            for log in sorted(Path(tmp).glob("replica-*.log")):
                tail = log.read_text(errors="replace").splitlines()[-15:]
                print(f"--- last lines of {log.name}:", *tail, sep="\n")
            print(f"FAIL: {failure}")
            return 1
    print("PASS: replica 1 healed from replica 0 and both ended identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
