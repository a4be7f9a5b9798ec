"""One contract, two transports: what torchft's Manager relies on, checked against
HTTPTransport (server and client in this process) and PGTransport (two gloo ranks).

Each scenario is a pair of straight-line scripts, one per side, that meet at
``link.sync()``. For HTTP the two sides run on two threads of this process; for the
process group they run in two rank processes on 127.0.0.1 that this file starts (it is
also the rank program: ``python test_contract.py SPEC``). Every rank runs every scenario
once (one launch for the whole suite) and reports failures per scenario as JSON.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import json
import os
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncckpt.errors import CheckpointConfigError, CheckpointNotFoundError, StateMismatchError
from asyncckpt.transport import StepNotOffered

T = 15.0  # the timeout of every transfer
HARD_TIMEOUT_S = 50.0  # the rank processes are killed after this


# --- the state every scenario moves --------------------------------------------------------

# Module init draws from torch's global generator; the HTTP scenarios build the sender's
# and the receiver's models on two threads at once, so seeding and drawing must not race.
_GLOBAL_RNG = threading.Lock()


def make_model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    with _GLOBAL_RNG:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(),
                                    torch.nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(4, 6, generator=g)
        y = torch.randn(4, 3, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def extras(seed: int) -> dict[Any, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "bf16": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "int64": torch.randint(-1000, 1000, (7,), generator=g),
        "int8": torch.randint(-128, 127, (2, 3), generator=g).to(torch.int8),
        "flags": torch.rand(4, generator=g) > 0.5,
        "f64_scalar": torch.rand((), generator=g, dtype=torch.float64),
        "transposed": torch.randn(3, 4, generator=g).t(),  # not contiguous
        "empty": torch.empty(0, 4),
        3: torch.randn(2, generator=g),  # an int key
    }


def make_state(train_steps: int, seed: int = 0) -> dict[str, Any]:
    """Module state + AdamW state + scalars + bf16/int tensors, the same in every process."""
    model, opt = make_model(seed)
    train(model, opt, range(train_steps))
    return {"model": model.state_dict(), "optim": opt.state_dict(), "extra": extras(seed),
            "step": train_steps, "lr": 0.01, "name": "run-a", "nested": [1, (2.5, None)]}


def diff(a: Any, b: Any, path: str = "<root>") -> list[str]:
    """Differences between two trees: key order and types, dtypes, shapes, raw bytes."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{path}: {type(a).__name__} vs {type(b).__name__}"]
        if a.dtype != b.dtype or a.shape != b.shape:
            return [f"{path}: {a.dtype} {list(a.shape)} vs {b.dtype} {list(b.shape)}"]
        if raw(a) != raw(b):
            return [f"{path}: tensor bytes differ"]
        return []
    if isinstance(a, Mapping) or isinstance(b, Mapping):
        if not (isinstance(a, Mapping) and isinstance(b, Mapping)):
            return [f"{path}: {type(a).__name__} vs {type(b).__name__}"]
        ka, kb = list(a), list(b)
        if [(type(k), k) for k in ka] != [(type(k), k) for k in kb]:
            return [f"{path}: keys {ka!r} vs {kb!r}"]
        return [d for k in ka for d in diff(a[k], b[k], f"{path}/{k}")]
    if type(a) is not type(b):
        return [f"{path}: {type(a).__name__} vs {type(b).__name__}"]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True))
                for d in diff(x, y, f"{path}/{i}")]
    if isinstance(a, float):
        return [] if a.hex() == b.hex() else [f"{path}: {a!r} vs {b!r}"]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def raw(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous().reshape(-1)
    return bytes(t.view(torch.uint8).numpy()) if t.numel() else b""


def tensor_leaves(tree: Any, path: str = "") -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {path: tree}
    if isinstance(tree, Mapping):
        return {p: t for k, v in tree.items() for p, t in tensor_leaves(v, f"{path}/{k}").items()}
    if isinstance(tree, (list, tuple)):
        return {p: t for i, v in enumerate(tree)
                for p, t in tensor_leaves(v, f"{path}/{i}").items()}
    return {}


# --- the scenarios -------------------------------------------------------------------------

@dataclass
class Link:
    """One side of a scenario: its transport, the other side's rank and metadata."""

    tr: Any
    peer: int
    peer_meta: str
    sync: Callable[[], None]


def fresh_send(link: Link) -> None:
    link.tr.send_checkpoint([link.peer], 11, make_state(2), datetime.timedelta(seconds=T))
    link.sync()
    link.tr.disallow_checkpoint()


def fresh_recv(link: Link) -> list[str]:
    got = link.tr.recv_checkpoint(link.peer, link.peer_meta, 11, datetime.timedelta(seconds=T))
    link.sync()
    return diff(got, make_state(2))


def into_send(link: Link) -> None:
    link.tr.send_checkpoint([link.peer], 12, make_state(3), datetime.timedelta(seconds=T))
    link.sync()
    link.tr.disallow_checkpoint()


def into_recv(link: Link) -> list[str]:
    """Into live objects: a Module, a fresh AdamW (no state yet) and a dict of tensors."""
    model, opt = make_model(seed=99)
    target = {"model": model, "optim": opt, "extra": extras(seed=99), "step": 0, "lr": 0.5,
              "name": "other", "nested": [0, (0.0, None)]}
    params = {n: (p, p.data_ptr()) for n, p in model.named_parameters()}
    extra = {k: (t, t.data_ptr()) for k, t in target["extra"].items()}
    out = link.tr.recv_checkpoint(link.peer, link.peer_meta, 12, datetime.timedelta(seconds=T),
                                  into=target)
    link.sync()
    want = make_state(3)
    failures = []
    if out is not target:
        failures.append("recv_checkpoint(into=) did not return the target")
    for n, p in model.named_parameters():
        if p is not params[n][0] or p.data_ptr() != params[n][1]:
            failures.append(f"model/{n}: parameter replaced instead of loaded in place")
    for k, (t, ptr) in extra.items():
        if target["extra"][k] is not t or t.data_ptr() != ptr:
            failures.append(f"extra/{k}: tensor replaced instead of loaded in place")
    failures += diff(model.state_dict(), want["model"], "model")
    failures += diff(opt.state_dict(), want["optim"], "optim")
    failures += diff({k: v for k, v in target.items() if k not in ("model", "optim")},
                     {k: v for k, v in want.items() if k not in ("model", "optim")})
    return failures


def wrong_step_send(link: Link) -> None:
    state = make_state(2)
    link.tr.send_checkpoint([link.peer], 13, state, datetime.timedelta(seconds=T))
    link.sync()
    link.tr.send_checkpoint([link.peer], 13, state, datetime.timedelta(seconds=T))  # again
    link.sync()
    link.tr.disallow_checkpoint()


def wrong_step_recv(link: Link) -> list[str]:
    failures = []
    t0 = time.monotonic()
    try:
        link.tr.recv_checkpoint(link.peer, link.peer_meta, 14, datetime.timedelta(seconds=T))
        failures.append("asking for step 14 from a peer offering 13 did not raise")
    except CheckpointNotFoundError as exc:
        if time.monotonic() - t0 > T / 2:
            failures.append(f"the refusal took {time.monotonic() - t0:.1f}s")
        if "14" not in str(exc):
            failures.append(f"the refusal does not name the step asked for: {exc}")
        if not isinstance(exc, StepNotOffered) or exc.offered != 13:
            # (a retry loop written against one transport broke on the other)
            failures.append(f"not a StepNotOffered naming step 13: {exc!r}")
    link.sync()
    got = link.tr.recv_checkpoint(link.peer, link.peer_meta, 13, datetime.timedelta(seconds=T))
    link.sync()
    return failures + diff(got, make_state(2))


def new_step_send(link: Link) -> None:
    model, opt = make_model(0)
    train(model, opt, range(2))
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    link.tr.send_checkpoint([link.peer], 20, state, datetime.timedelta(seconds=T))
    link.sync()
    link.tr.disallow_checkpoint()
    # (disallowed before the receiver asks for step 21: a request for it while step 20
    # was still allowed is told at once that step 20 is served, as the contract wants;
    # the receiver's ask a moment after the first sync failed the scenario, rarely)
    link.sync()
    train(model, opt, range(2, 3))  # the served tensors change once disallowed
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    link.tr.send_checkpoint([link.peer], 21, state, datetime.timedelta(seconds=T))
    link.sync()
    link.tr.disallow_checkpoint()


def new_step_recv(link: Link) -> list[str]:
    got20 = link.tr.recv_checkpoint(link.peer, link.peer_meta, 20, datetime.timedelta(seconds=T))
    link.sync()
    link.sync()  # (the sender has disallowed step 20)
    got21 = link.tr.recv_checkpoint(link.peer, link.peer_meta, 21, datetime.timedelta(seconds=T))
    link.sync()
    failures = []
    for got, steps in ((got20, 2), (got21, 3)):
        want = make_state(steps)
        failures += diff(got, {"model": want["model"], "optim": want["optim"]},
                         f"<step {18 + steps}>")
    return failures


def send_twice(step: int) -> Callable[[Link], None]:
    """A sender offering make_state(2) as ``step`` for two receives."""
    def send(link: Link) -> None:
        for _ in range(2):  # (a PG send serves one receive)
            link.tr.send_checkpoint([link.peer], step, make_state(2),
                                    datetime.timedelta(seconds=T))
            link.sync()
        link.tr.disallow_checkpoint()
    return send


def model_alone_recv(link: Link) -> list[str]:
    """The model alone out of a whole training state: refused as it is (naming the way
    out, the target untouched), fetched with ignore_unexpected=True."""
    model, _ = make_model(seed=99)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    failures = []
    try:
        link.tr.recv_checkpoint(link.peer, link.peer_meta, 15, datetime.timedelta(seconds=T),
                                into={"model": model})
        failures.append("a target lacking most of the state loaded without ignore_unexpected")
    except StateMismatchError as exc:
        if "ignore_unexpected=True" not in str(exc) or "optim/" not in str(exc):
            failures.append(f"the refusal names neither the way out nor the keys: {exc}")
    failures += diff(model.state_dict(), before, "<refused, model>")
    link.sync()
    target = {"model": model}
    out = link.tr.recv_checkpoint(link.peer, link.peer_meta, 15, datetime.timedelta(seconds=T),
                                  into=target, ignore_unexpected=True)
    link.sync()
    want = make_state(2)
    if out is not target or "optim" in out or "extra" in out:  # (tensors it had no place for)
        failures.append(f"returned {type(out).__name__} with {list(out)!r:.80}, not the target")
    # nor the values without tensors (what the target lacks is skipped, values too)
    added = [k for k in ("step", "lr", "name", "nested") if k in out]
    if added:
        failures.append(f"values the target lacked were added: {added}")
    return failures + diff(model.state_dict(), want["model"], "model")


def exclude_recv(link: Link) -> list[str]:
    """exclude= leaves a part out on both sides: into a target, that part of the target is
    left as it was (its tensors too); fresh, the part is absent from the tree (and
    key_map= renames what comes, cast= converts into a bf16 model)."""
    model, opt = make_model(seed=99)
    model.to(torch.bfloat16)  # (an eval replica in bf16: cast=True converts on receipt)
    mine = extras(seed=99)
    before = {k: v.clone() for k, v in mine.items()}
    target = {"model": model, "optim": opt, "extra": mine, "step": 0, "lr": 0.5,
              "name": "other", "nested": [0, (0.0, None)]}
    out = link.tr.recv_checkpoint(link.peer, link.peer_meta, 17, datetime.timedelta(seconds=T),
                                  into=target, exclude=["extra", "optim"], cast=True)
    link.sync()
    want = make_state(2)
    failures = []
    if out is not target or target["extra"] is not mine or target["optim"] is not opt:
        failures.append("the target or its excluded parts were replaced")
    if opt.state:
        failures.append("the excluded optimizer got state")
    failures += diff(mine, before, "<excluded extra>")
    failures += diff(model.state_dict(), {k: v.to(torch.bfloat16)
                                          for k, v in want["model"].items()}, "model")
    failures += diff({k: target[k] for k in ("step", "lr", "name", "nested")},
                     {k: want[k] for k in ("step", "lr", "name", "nested")})
    fresh = link.tr.recv_checkpoint(link.peer, link.peer_meta, 17,
                                    datetime.timedelta(seconds=T), exclude="extra",
                                    key_map=lambda p: p.replace("model/", "net/", 1))
    link.sync()
    if "extra" in fresh or "model" in fresh:
        failures.append(f"a fresh receive returned {sorted(map(str, fresh))}: the excluded "
                        "part, or the renamed one under its old name")
    want["net"] = want.pop("model")
    return failures + diff(fresh, {k: v for k, v in want.items() if k != "extra"}, "<fresh>")


def reuse_send(link: Link) -> None:
    link.tr.send_checkpoint([link.peer], 16, make_state(3), datetime.timedelta(seconds=T))
    link.sync()
    link.tr.disallow_checkpoint()


def reuse_recv(link: Link) -> list[str]:
    """A transport made with ``state_dict=`` (torchft's way to receive in place: its Manager
    passes no target): the received tree, in the target's tensors where they match."""
    model, opt = make_model(seed=99)  # (AdamW with no state yet: its moments come new)
    extra = extras(seed=99)
    extra["bf16"] = torch.zeros(2, 2, dtype=torch.bfloat16)  # another shape: not reused
    target = {"model": model.state_dict(), "optim": opt.state_dict(), "extra": extra,
              "step": 0, "lr": 0.5, "name": "other", "nested": [0, (0.0, None)]}
    link.tr._state_dict = lambda: target  # (as if passed to the constructor)
    try:
        out = link.tr.recv_checkpoint(link.peer, link.peer_meta, 16,
                                      datetime.timedelta(seconds=T))
    finally:
        link.tr._state_dict = None
    link.sync()
    want = make_state(3)
    failures = diff(out, want)  # the sender's tree, every value
    for n, p in model.named_parameters():
        if out["model"][n].data_ptr() != p.data_ptr():
            failures.append(f"model/{n}: not received into the parameter")
    failures += diff(model.state_dict(), want["model"], "<parameters>")
    if out["extra"]["int64"] is not extra["int64"]:
        failures.append("extra/int64: a new tensor, not the target's")
    if out["extra"]["bf16"] is extra["bf16"] or extra["bf16"].abs().sum() != 0:
        failures.append("extra/bf16: a target of another shape was used")
    if target["step"] != 0 or opt.state_dict()["state"]:
        failures.append("the target's own values or the optimizer were changed")
    return failures


def not_ranks_send(link: Link) -> None:
    """What is not a rank is refused before anything is offered, by both transports (HTTP,
    which fetches from the address in metadata, took any src_rank)."""
    for bad in (["one"], [-1], 3):
        with contextlib.suppress(CheckpointConfigError):
            link.tr.send_checkpoint(bad, 18, {"w": torch.ones(2)}, datetime.timedelta(seconds=T))
            raise AssertionError(f"send_checkpoint({bad!r}, ...) was not refused")
    # (nor is a timeout that is no positive number: HTTP's send, which waits for nothing,
    # took 0, -5 and "x", which PG's refused: a torchft trial)
    for timeout in (0, -5, "x"):
        with contextlib.suppress(CheckpointConfigError):
            link.tr.send_checkpoint([link.peer], 18, {"w": torch.ones(2)}, timeout)
            raise AssertionError(f"send_checkpoint(timeout={timeout!r}) was not refused")
    link.sync()


def not_ranks_recv(link: Link) -> list[str]:
    failures = []
    for bad in ("peer", -1, True, None):
        try:
            link.tr.recv_checkpoint(bad, link.peer_meta, 18, datetime.timedelta(seconds=T))
            failures.append(f"recv_checkpoint(src_rank={bad!r}) was not refused")
        except CheckpointConfigError as exc:
            if f"src_rank={bad!r}" not in str(exc):
                failures.append(f"src_rank={bad!r}: the refusal does not name it: {exc}")
    link.sync()
    return failures


SCENARIOS: dict[str, tuple[Callable[[Link], None], Callable[[Link], list[str]], int]] = {
    "fresh": (fresh_send, fresh_recv, 1),
    "into": (into_send, into_recv, 1),
    "wrong_step": (wrong_step_send, wrong_step_recv, 2),
    "disallow_then_new_step": (new_step_send, new_step_recv, 3),
    "model_alone": (send_twice(15), model_alone_recv, 2),
    "exclude": (send_twice(17), exclude_recv, 2),
    "state_dict_fn": (reuse_send, reuse_recv, 1),
    "not_ranks": (not_ranks_send, not_ranks_recv, 1),
}


def run_side(name: str, role: str, link: Link) -> list[str]:
    """Run one side of a scenario; on failure still meet the other side at every sync."""
    send, recv, nsync = SCENARIOS[name]
    done = 0

    def counted() -> None:
        nonlocal done
        done += 1
        link.sync()

    side = Link(link.tr, link.peer, link.peer_meta, counted)
    try:
        if role == "send":
            send(side)
            return []
        return recv(side)
    except Exception:
        return [f"{role} side raised:\n{traceback.format_exc()}"]
    finally:
        for _ in range(nsync - done):
            with contextlib.suppress(Exception):
                link.sync()


# --- HTTP: both sides in this process --------------------------------------------------------

def run_http(name: str) -> list[str]:
    from asyncckpt.transport import HTTPTransport

    server = HTTPTransport(timeout=T, token="contract-token")
    client = HTTPTransport(timeout=T, token="contract-token")
    barrier = threading.Barrier(2, timeout=2 * T)
    results: dict[str, list[str]] = {}

    def side(role: str, tr: Any, meta: str) -> None:
        results[role] = run_side(name, role, Link(tr, 0, meta, barrier.wait))

    threads = [threading.Thread(target=side, args=("send", server, "")),
               threading.Thread(target=side, args=("recv", client, server.metadata()))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(2 * T + 10)
        if any(t.is_alive() for t in threads):
            return [f"scenario {name} still running after {2 * T + 10:.0f}s"]
    finally:
        server.shutdown()
        client.shutdown()
    return results.get("send", ["no result"]) + results.get("recv", ["no result"])


# --- PG: two gloo ranks ----------------------------------------------------------------------

def _import_path() -> str:
    """PYTHONPATH for the ranks: the asyncckpt under test first (a relative path in
    the caller's PYTHONPATH would not hold in the ranks' working directory)."""
    import asyncckpt

    src = str(Path(asyncckpt.__file__).resolve().parents[1])
    return os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_pg_ranks(run_dir: Path) -> dict[str, list[str]]:
    """Run every scenario on two gloo ranks; scenario -> failures of both sides."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONUNBUFFERED": "1", "PYTHONPATH": _import_path()}
    procs, logs = [], []
    for rank in range(2):
        spec = run_dir / f"spec_{rank}.json"
        spec.write_text(json.dumps({"rank": rank, "port": port, "out": str(run_dir)}))
        log = open(run_dir / f"log_{rank}.txt", "wb")  # noqa: SIM115 - closed below
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, __file__, str(spec)], stdout=log,
                                      stderr=subprocess.STDOUT, env=env, cwd=str(run_dir)))
    deadline = time.monotonic() + HARD_TIMEOUT_S
    try:
        for p in procs:
            p.wait(max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for log in logs:
            log.close()
    out: dict[str, list[str]] = {name: [] for name in SCENARIOS}
    for rank, p in enumerate(procs):
        res = run_dir / f"result_{rank}.json"
        text = (run_dir / f"log_{rank}.txt").read_text(errors="replace")[-6000:]
        if p.returncode != 0 or not res.exists():
            for name in out:
                out[name].append(f"rank {rank} exited with {p.returncode}:\n{text}")
            continue
        for name, failures in json.loads(res.read_text()).items():
            out[name] += [f"rank {rank}: {f}" for f in failures]
    return out


def rank_main(spec_path: str) -> None:
    import torch.distributed as dist

    from asyncckpt.transport import PGTransport

    spec = json.loads(Path(spec_path).read_text())
    rank = spec["rank"]
    faulthandler.dump_traceback_later(HARD_TIMEOUT_S - 5, exit=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=2 * T))
    group = dist.new_group([0, 1], backend="gloo")  # the transport's own group
    tr = PGTransport(group, datetime.timedelta(seconds=T))
    assert tr.metadata() == f"pg:{rank}", tr.metadata()
    results = {}
    for name in SCENARIOS:
        role = "send" if rank == 0 else "recv"
        results[name] = run_side(name, role, Link(tr, 1 - rank, f"pg:{1 - rank}", dist.barrier))
    tr.shutdown()
    Path(spec["out"], f"result_{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


# --- the tests -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pg_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    return launch_pg_ranks(tmp_path_factory.mktemp("pg_contract"))


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("transport", ["http", "pg"])
def test_contract(transport: str, scenario: str, request: pytest.FixtureRequest) -> None:
    if transport == "http":
        failures = run_http(scenario)
    else:
        failures = request.getfixturevalue("pg_results")[scenario]
    assert not failures, "\n".join(failures)


def test_state_is_deterministic() -> None:
    """The receivers rebuild the sender's state to compare: it must not vary."""
    assert diff(make_state(3), make_state(3)) == []
    assert diff(make_state(3), make_state(2)) != []


if __name__ == "__main__":
    rank_main(sys.argv[1])
