"""The peer-recovery section of the checkpoint benchmark (``--only peer``).

A recovering worker fetches the live training state from a healthy peer on the same
machine, over 127.0.0.1. The healthy peer is a separate process (``python bench_peer.py
--peer-server <spec.json>``) that holds the benchmark's state -- the same GPT-like model +
AdamW moments layout as ``bench_checkpoint.py`` (``model_shapes``), each tensor filled from
its own seed (``bench_dist.local_values`` with a world of 1) so that any process can rebuild
any tensor to check what it received -- and serves it. This process is the receiver: it
holds an identically shaped target state (zeros, pre-touched) to load into in place.
Measured, in one run:

* limits    -- raw TCP over 127.0.0.1 moving the same number of bytes: ``sendall`` from a
               pre-touched buffer in the serving process, ``recv_into`` a pre-touched buffer
               here, with 1 stream and with 2, 4 and 8 parallel streams (the num_chunks values
               asyncckpt is tried with). The fastest is **the loopback limit**. The buffers are
               min(state, 1 GiB), cycled: far larger than the last-level cache, so the bytes
               come from and go to memory as a real transfer's do;
* asyncckpt -- ``HTTPTransport.send_checkpoint`` of the live state (serving-side blocked
               time), then ``recv_checkpoint(into=target)`` in place with num_chunks 1, 2, 4
               and 8, fresh (no target), and ``asyncckpt.load(address, target)``; every
               receive follows its own ``send_checkpoint``, so it includes the server's lazy
               checksumming (on its first manifest request), as a real recovery does;
* arena     -- ``ckpt.serve(transport)`` + ``save_async(state, overlap=True)`` in the serving
               process (serving-side blocked time: the save's), then an in-place receive of
               the staged arena once the save is durable;
* torchft   -- torchft's ``HTTPTransport`` where it imports and runs, num_chunks 0 (its
               Manager's default) and 8: its blocked ``send_checkpoint`` and its
               ``recv_checkpoint``, whose fresh state dict is then copied into the target
               for parity;
* profile   -- one instrumented in-place receive (default num_chunks): the server's
               checksum time (a timed manifest request), and per connection the bytes, the
               range requests, the reads (one per tensor or run of small ones, or per
               piece of the loader's read size of a larger one) and the time spent
               fetching and hashing them; and for every
               transfer the CPU seconds both processes spent.

Every receive zeroes a few target tensors first and checks them afterwards against the
seeded originals. Run it through ``bench_checkpoint.py --only peer`` (or this file).
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import http.client
import importlib
import importlib.util
import json
import math
import os
import queue
import secrets
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
import types
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import torch

import _limits as lim
import asyncckpt
import bench_checkpoint as bc
import bench_dist as bd
from asyncckpt.transport import HTTPTransport
from asyncckpt.transport.http import fetch_connections

GB = 1e9
GiB = 2**30
MiB = 2**20
HERE = Path(__file__).resolve().parent
STREAMS = (1, 2, 4, 8)  # raw TCP streams, and the num_chunks values asyncckpt is tried with
DEFAULT_CHUNKS = 8  # HTTPTransport's default num_chunks (checked in run())
TORCHFT_CHUNKS = (0, 8)  # 0: no chunking, torchft Manager's default
RING_BYTES = GiB  # the raw-TCP buffers: min(state, this), cycled
RATIO_OK = 0.8  # receive bandwidth ≥ 0.8x the loopback limit
BLOCKED_OK_S = 0.050  # serving-side blocked time "≈ 0"

pc = time.perf_counter


def median(xs: Sequence[float]) -> float:
    return bc.median(list(xs))


# --- the state: bench_checkpoint's layout, each tensor from its own seed --------------------


def leaves_for(state_gib: float, n_tensors: int) -> list[bd.Leaf]:
    return bd.layout(int(state_gib * GiB / 12), n_tensors)


def build_state(leaves: Sequence[bd.Leaf]) -> dict[str, Any]:
    """The served state: ``{"model": {...}, "optim": {"state": {i: {...}}}}``, seeded."""
    return bd.nest({lf.path: bd.local_values(lf, 1, 0) for lf in leaves})


def build_target(leaves: Sequence[bd.Leaf]) -> dict[str, Any]:
    """An identically shaped state of zeros (written, so its pages are touched)."""
    return bd.nest({lf.path: torch.zeros(lf.shape) for lf in leaves})


class Checker:
    """Checks a received state against the seeded originals: keys, shapes, a few values."""

    def __init__(self, leaves: Sequence[bd.Leaf]):
        self.shapes = {lf.path: lf.shape for lf in leaves}
        self.probes = {lf.path: bd.full_values(lf, 1) for lf in bd.probe_leaves(leaves)}
        self.checked: dict[str, int] = {}

    def zero_probes(self, target: Any) -> None:
        flat = bd.flat_of(target)
        with torch.no_grad():
            for path in self.probes:
                flat[path].zero_()

    def check(self, tree: Any, who: str) -> None:
        flat = bd.flat_of(tree)
        if set(flat) != set(self.shapes):
            raise RuntimeError(f"{who}: received keys differ: "
                               f"{sorted(set(flat) ^ set(self.shapes))[:5]}")
        for path, t in flat.items():
            if tuple(t.shape) != self.shapes[path] or t.dtype != torch.float32:
                raise RuntimeError(f"{who}: {path} is {t.dtype} {list(t.shape)}, want float32 "
                                   f"{list(self.shapes[path])}")
        for path, want in self.probes.items():
            if not torch.equal(flat[path], want):
                raise RuntimeError(f"{who}: {path} differs from the sender's values")
        self.checked[who] = self.checked.get(who, 0) + len(self.probes)


# --- torchft, where it imports ----------------------------------------------------------------


def import_torchft() -> tuple[Any, str]:
    """torchft's HTTPTransport class (or None) and how it was imported (or why not)."""
    try:
        from torchft.checkpointing.http_transport import HTTPTransport as FtHTTP
        return FtHTTP, "imported normally"
    except Exception as exc:
        first = f"{type(exc).__name__}: {exc}"
    spec = None
    with contextlib.suppress(Exception):
        spec = importlib.util.find_spec("torchft")
    if spec is None or not spec.submodule_search_locations:
        return None, f"not installed (`import torchft`: {first})"
    # torchft/__init__.py imports its Manager, process groups and OpenTelemetry logging;
    # the HTTP transport needs none of them: import it without running that file.
    for name in [m for m in sys.modules if m == "torchft" or m.startswith("torchft.")]:
        del sys.modules[name]
    pkg = types.ModuleType("torchft")
    pkg.__path__ = list(spec.submodule_search_locations)
    sys.modules["torchft"] = pkg
    try:
        mod = importlib.import_module("torchft.checkpointing.http_transport")
    except Exception as exc:
        return None, (f"`import torchft` fails ({first}), and "
                      f"torchft.checkpointing.http_transport alone too ({type(exc).__name__}: "
                      f"{exc})")
    return mod.HTTPTransport, (f"`import torchft` fails ({first}); imported "
                               "torchft.checkpointing.http_transport without torchft/__init__.py")


def _read_piece() -> int:
    """The bytes a load reads at once from one chunk (what a 'read' above is)."""
    import asyncckpt.reader as reader

    return int(reader._PIECE)


def torchft_version() -> str:
    import importlib.metadata as md

    try:
        return md.version("torchft")
    except md.PackageNotFoundError:
        return "not installed"


# --- the serving process --------------------------------------------------------------------


def _cpu_s(proc: psutil.Process | None = None) -> float:
    t = (proc or psutil.Process()).cpu_times()
    return float(t.user + t.system)


def _send_streams(port: int, shares: Sequence[tuple[int, int]], mv: memoryview) -> float:
    """Raw TCP sender: one connection per share, each ``sendall`` of its bytes (cycling
    through ``mv``) after an 8-byte index. Returns the seconds until all were sent."""
    ring = len(mv)
    t0 = pc()
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in shares]
    errors: list[BaseException] = []

    def send(i: int, s: socket.socket, lo: int, hi: int) -> None:
        try:
            s.sendall(struct.pack("<Q", i))
            pos = lo
            while pos < hi:
                off = pos % ring
                k = min(hi - pos, ring - off)
                s.sendall(mv[off:off + k])
                pos += k
            s.shutdown(socket.SHUT_WR)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=send, args=(i, s, lo, hi))
               for i, (s, (lo, hi)) in enumerate(zip(socks, shares, strict=True))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in socks:
        s.close()
    if errors:
        raise errors[0]
    return pc() - t0


def server_main(spec_path: str) -> None:
    """The healthy peer: builds the state, then serves it as the receiver asks (JSON lines
    on stdin; one JSON answer per line on the original stdout)."""
    spec = json.loads(Path(spec_path).read_text())
    faulthandler.dump_traceback_later(spec["timeout_s"], exit=True)
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints go to the log, never into the answers

    def answer(msg: dict[str, Any]) -> None:
        answers.write(json.dumps(msg) + "\n")
        answers.flush()

    code = 0
    try:
        leaves = leaves_for(spec["state_gib"], spec["tensors"])
        t0 = pc()
        state = build_state(leaves)
        build_s = pc() - t0
        srv: HTTPTransport | None = HTTPTransport(timeout=spec["timeout_s"], token=spec["token"])
        answer({"ok": True, "build_s": build_s, "address": srv.metadata(),
                "state_bytes": bc.state_bytes(state), "rss_bytes": lim.rss_bytes()})
        ring: lim.AlignedBuffer | None = None
        ckpt: asyncckpt.AsyncCheckpointer | None = None
        ft_cls: Any = None
        ft: dict[int, Any] = {}
        for line in sys.stdin:
            cmd = json.loads(line)
            op = cmd["op"]
            try:
                out: dict[str, Any] = {}
                if op == "raw_send":
                    if ring is None:
                        ring = lim.AlignedBuffer(cmd["ring_bytes"])
                    mv = ring.memoryview()[:cmd["ring_bytes"]]
                    try:
                        out["send_s"] = _send_streams(cmd["port"], cmd["shares"], mv)
                    finally:
                        del mv
                elif op == "raw_prepare":
                    if ring is None:
                        ring = lim.AlignedBuffer(cmd["ring_bytes"])
                elif op == "raw_done":
                    if ring is not None:
                        ring.close()
                        ring = None
                    bc.free_memory()
                elif op == "live":
                    assert srv is not None
                    t0 = pc()
                    srv.send_checkpoint([1], cmd["step"], state, timedelta(seconds=60))
                    out["blocked_s"] = pc() - t0
                elif op == "arena":
                    assert srv is not None
                    if ckpt is None:
                        ckpt = asyncckpt.AsyncCheckpointer(Path(spec["work"]) / "arena",
                                                           mode="async", keep_last=1)
                        t0 = pc()
                        ckpt.serve(srv)
                        out["serve_call_s"] = pc() - t0
                        t0 = pc()
                        ckpt.prepare(state, background=False)
                        out["prepare_s"] = pc() - t0
                    t0 = pc()
                    fut = ckpt.save_async(state, cmd["step"], overlap=True)
                    out["blocked_s"] = pc() - t0
                    fut.wait_staged()
                    out["staged_s"] = pc() - t0
                    fut.wait()
                    out["durable_s"] = pc() - t0
                elif op == "arena_close":
                    assert srv is not None
                    out["rss_before_close_bytes"] = lim.rss_bytes()
                    if ckpt is not None:
                        ckpt.close()
                        ckpt = None
                    gc.collect()
                    bc.free_memory()
                    out["rss_after_close_bytes"] = lim.rss_bytes()
                    # the transport may still offer the arena: replace the offer
                    srv.send_checkpoint([1], cmd["step"], state, timedelta(seconds=60))
                    time.sleep(0.2)  # the old offer is closed on a thread once idle
                    gc.collect()
                    bc.free_memory()
                    out["rss_after_replace_bytes"] = lim.rss_bytes()
                elif op == "torchft_done":
                    for t in ft.values():
                        with contextlib.suppress(Exception):
                            t.shutdown(wait=True)
                    ft.clear()
                    gc.collect()
                elif op == "asyncckpt_done":
                    if ckpt is not None:
                        ckpt.close()
                        ckpt = None
                    if srv is not None:
                        srv.disallow_checkpoint()
                        srv.shutdown()
                        srv = None
                    bc.free_memory()
                elif op == "torchft":
                    if ft_cls is None:
                        ft_cls, out["how"] = import_torchft()
                        if ft_cls is None:
                            raise RuntimeError(f"torchft's HTTPTransport: {out['how']}")
                        # its request handler logs every request to stderr
                        from http.server import BaseHTTPRequestHandler

                        BaseHTTPRequestHandler.log_message = (  # type: ignore[method-assign]
                            lambda self, *a: None)
                    c = cmd["num_chunks"]
                    if c not in ft:
                        ft[c] = ft_cls(timedelta(seconds=spec["timeout_s"]), num_chunks=c)
                    ft[c].disallow_checkpoint()
                    t0 = pc()
                    ft[c].send_checkpoint([1], cmd["step"], state, timedelta(seconds=60))
                    out["blocked_s"] = pc() - t0
                    out["address"] = ft[c].metadata()
                elif op == "stop":
                    for t in ft.values():
                        with contextlib.suppress(Exception):
                            t.shutdown(wait=False)
                    answer({"ok": True, "peak_rss_bytes": lim.peak_rss_bytes()})
                    break
                else:
                    raise ValueError(f"unknown op {op!r}")
                answer({"ok": True, **out})
            except Exception:
                answer({"ok": False, "error": traceback.format_exc()})
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no teardown: server threads may still hold sockets


class PeerProcess:
    """The serving process, seen from the receiver: ask it to do things, wait for answers."""

    def __init__(self, spec: dict[str, Any], work: Path):
        spec_path = work / "peer_spec.json"
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ)
        env.update({"PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join([
            str(HERE), str(Path(asyncckpt.__file__).resolve().parent.parent),
            *filter(None, [os.environ.get("PYTHONPATH")])])})
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "bench_peer.py"), "--peer-server", str(spec_path)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=str(work),
            start_new_session=True)
        self.ps = psutil.Process(self.proc.pid)
        self._answers: queue.Queue[bytes | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name="peer-answers", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._answers.put(line)
        self._answers.put(None)

    def send(self, op: str, **kw: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"op": op, **kw}) + "\n").encode())
        self.proc.stdin.flush()

    def answer(self, timeout_s: float) -> dict[str, Any]:
        try:
            line = self._answers.get(timeout=timeout_s)
        except queue.Empty:
            raise RuntimeError(f"peer: the serving process did not answer in {timeout_s:.0f}s"
                               ) from None
        if line is None:
            raise RuntimeError(f"peer: the serving process exited (status {self.proc.wait()})")
        msg: dict[str, Any] = json.loads(line)
        if not msg.get("ok"):
            raise PeerError(msg.get("error", "?"))
        return msg

    def call(self, op: str, timeout_s: float, **kw: Any) -> dict[str, Any]:
        self.send(op, **kw)
        return self.answer(timeout_s)

    def cpu_s(self) -> float:
        return _cpu_s(self.ps)

    def close(self) -> int:
        """Stop the process; returns its peak RSS (0 when it could not say)."""
        peak = 0
        try:
            if self.proc.poll() is None:
                peak = int(self.call("stop", 30).get("peak_rss_bytes", 0))
                self.proc.wait(30)
        except (RuntimeError, PeerError, OSError, subprocess.TimeoutExpired):
            pass
        finally:
            if self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.send_signal(signal.SIGKILL)
                self.proc.wait()
        return peak


class PeerError(RuntimeError):
    """The serving process failed an operation; carries its traceback."""


# --- the receiver ---------------------------------------------------------------------------


class Transfer:
    """Times one transfer and the CPU both processes spent on it."""

    def __init__(self, peer: PeerProcess):
        self.peer = peer

    def __enter__(self) -> Transfer:
        self.cpu0 = (_cpu_s(), self.peer.cpu_s())
        self.t0 = pc()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = pc() - self.t0
        self.recv_cpu_s = _cpu_s() - self.cpu0[0]
        self.send_cpu_s = self.peer.cpu_s() - self.cpu0[1]

    def as_dict(self) -> dict[str, float]:
        return {"recv_s": self.seconds, "recv_cpu_s": self.recv_cpu_s,
                "send_cpu_s": self.send_cpu_s}


def raw_limit(peer: PeerProcess, nbytes: int, streams: int, ring: lim.AlignedBuffer,
              ring_bytes: int, timeout_s: float) -> dict[str, Any]:
    """One raw TCP transfer of ``nbytes`` over ``streams`` connections into ``ring``."""
    lsock = socket.create_server(("127.0.0.1", 0), backlog=streams)
    lsock.settimeout(timeout_s)
    mv = ring.memoryview()[:ring_bytes]
    base, extra = divmod(nbytes, streams)
    shares, pos = [], 0
    for i in range(streams):
        n = base + (i < extra)
        shares.append((pos, pos + n))
        pos += n
    done: dict[int, float] = {}
    errors: list[BaseException] = []

    def receive(conn: socket.socket) -> None:
        try:
            head = bytearray(8)
            got = 0
            while got < 8:
                n = conn.recv_into(memoryview(head)[got:])
                if not n:
                    raise ConnectionError("the sender hung up before its index")
                got += n
            (i,) = struct.unpack("<Q", head)
            lo, hi = shares[i]
            p = lo
            while p < hi:
                off = p % ring_bytes
                n = conn.recv_into(mv[off:off + min(hi - p, ring_bytes - off)])
                if not n:
                    raise ConnectionError(f"stream {i} ended {hi - p} bytes early")
                p += n
            done[i] = pc()
        except BaseException as exc:
            errors.append(exc)
        finally:
            conn.close()

    threads = []
    try:
        with Transfer(peer) as tr:
            t0 = pc()
            peer.send("raw_send", port=lsock.getsockname()[1], shares=shares,
                      ring_bytes=ring_bytes)
            for _ in range(streams):
                conn, _ = lsock.accept()
                conn.settimeout(timeout_s)
                t = threading.Thread(target=receive, args=(conn,))
                t.start()
                threads.append(t)
            for t in threads:
                t.join()
        sent = peer.answer(timeout_s)
    finally:
        lsock.close()
    if errors:
        raise RuntimeError(f"peer: raw TCP with {streams} streams failed: {errors[0]!r}")
    return {"recv_s": tr.seconds, "send_s": sent["send_s"], "recv_cpu_s": tr.recv_cpu_s,
            "send_cpu_s": tr.send_cpu_s,
            "stream_s": [done[i] - t0 for i in range(streams)],
            "stream_bytes": [hi - lo for lo, hi in shares]}


def manifest_request(address: str, step: int, token: str, timeout_s: float) -> float:
    """Seconds of one manifest request (the server checksums the live state on the first)."""
    u = address.removeprefix("http://")
    hostport, prefix = u.split("/", 1)
    host, port = hostport.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        t0 = pc()
        conn.request("GET", f"/{prefix}/{step}/manifest.json",
                     headers={"Authorization": f"Bearer {token}"})
        resp = conn.getresponse()
        body = resp.read()
        t = pc() - t0
        if resp.status != 200 or not body:
            raise RuntimeError(f"peer: manifest request answered {resp.status}")
        return t
    finally:
        conn.close()


def profiled(fn: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    """Run ``fn`` (one receive) recording, per thread (= connection), the bytes, the
    reads, the range requests and the seconds spent in HTTPStorage._fetch and in
    hashing."""
    import asyncckpt.reader as reader
    from asyncckpt.transport import http as ahttp

    recs: dict[int, dict[str, float]] = {}
    lock = threading.Lock()

    def rec() -> dict[str, float]:
        with lock:
            return recs.setdefault(threading.get_ident(), {
                "bytes": 0, "pieces": 0, "requests": 0, "fetch_s": 0.0, "hash_s": 0.0,
                "first": math.inf,
                "last": 0.0})

    orig_fetch = ahttp.HTTPStorage._fetch
    orig_request = ahttp.HTTPStorage._request

    def request(self: Any, method: str, what: str, headers: dict[str, str]) -> Any:
        if "Range" in headers:
            rec()["requests"] += 1
        return orig_request(self, method, what, headers)
    orig_hasher = reader.BlockHasher

    def fetch(self: Any, fd: int, views: Any, offset: int) -> int:
        t0 = pc()
        n = orig_fetch(self, fd, views, offset)
        t1 = pc()
        r = rec()
        r["bytes"] += n
        r["pieces"] += 1
        r["fetch_s"] += t1 - t0
        r["first"] = min(r["first"], t0)
        r["last"] = max(r["last"], t1)
        return int(n)

    class TimedHasher(orig_hasher):  # type: ignore[misc, valid-type]
        def update(self, data: memoryview) -> None:
            t0 = pc()
            super().update(data)
            t1 = pc()
            r = rec()
            r["hash_s"] += t1 - t0
            r["last"] = max(r["last"], t1)

    ahttp.HTTPStorage._fetch = fetch  # type: ignore[method-assign]
    ahttp.HTTPStorage._request = request  # type: ignore[method-assign]
    reader.BlockHasher = TimedHasher  # type: ignore[misc]
    try:
        t0 = pc()
        out = fn()
        total = pc() - t0
    finally:
        ahttp.HTTPStorage._fetch = orig_fetch  # type: ignore[method-assign]
        ahttp.HTTPStorage._request = orig_request  # type: ignore[method-assign]
        reader.BlockHasher = orig_hasher  # type: ignore[misc]
    conns = sorted(({**r, "span_s": r["last"] - r["first"]} for r in recs.values()
                    if r["pieces"]), key=lambda r: r["first"])
    for r in conns:
        r["first_s"] = r.pop("first") - t0
        r.pop("last")
    return out, {"total_s": total, "connections": conns}


def run(args: Any, work: Path) -> dict[str, Any]:
    """Run the section with ``args`` of bench_checkpoint (state_gib, tensors, repeats)."""
    import inspect

    started = pc()
    default = inspect.signature(HTTPTransport.__init__).parameters["num_chunks"].default
    if default != DEFAULT_CHUNKS:
        raise RuntimeError(f"HTTPTransport's default num_chunks is {default}, "
                           f"bench_peer assumes {DEFAULT_CHUNKS}")
    leaves = leaves_for(args.state_gib, args.tensors)
    nbytes = sum(lf.nbytes for lf in leaves)
    timeout_s = 120.0 + 120.0 * args.state_gib
    budget_s = max(30.0, 110.0 * args.state_gib)
    token = secrets.token_hex(16)
    work.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {
        "state_bytes": nbytes, "tensors": len(leaves),
        "model_tensors": sum(lf.kind == "model" for lf in leaves), "repeats": args.repeats,
        "default_chunks": DEFAULT_CHUNKS, "streams": list(STREAMS), "budget_s": budget_s,
        "slow_s": max(2.0, 10.0 * args.state_gib / 3), "ring_bytes": min(nbytes, RING_BYTES),
        "skipped": {}, "torchft": {"version": torchft_version()},
        "connections": {str(c): fetch_connections(c) for c in STREAMS}}
    spec = {"state_gib": args.state_gib, "tensors": args.tensors, "token": token,
            "timeout_s": timeout_s, "work": str(work)}
    bc.log(f"peer: starting the serving process ({nbytes / GiB:.3f} GiB state)")
    peer = PeerProcess(spec, work)
    try:
        with bd.SystemMemory() as mem:
            t0 = pc()
            target = build_target(leaves)
            checker = Checker(leaves)
            res["target_build_s"] = pc() - t0
            hello = peer.answer(timeout_s)
            res["server_build_s"] = hello["build_s"]
            if hello["state_bytes"] != nbytes:
                raise RuntimeError(f"peer: the server holds {hello['state_bytes']} bytes, "
                                   f"the receiver expects {nbytes}")
            bc.log(f"peer: the server built its state in {hello['build_s']:.1f}s, serving at "
                   f"{hello['address']}")
            res["limits"] = run_limits(peer, nbytes, args.repeats, res["ring_bytes"], timeout_s)
            Session(peer, target, checker, res, hello["address"], token, timeout_s,
                    started + budget_s).run()
            res["checked"] = checker.checked
            res["probes"] = sorted(checker.probes)
            del target
            bc.free_memory()
        res["memory"] = {"baseline_used_bytes": mem.baseline,
                         "peak_extra_used_bytes": mem.peak - mem.baseline,
                         "receiver_peak_rss_bytes": lim.peak_rss_bytes()}
    finally:
        server_peak = peer.close()
    res["memory"]["server_peak_rss_bytes"] = server_peak
    summarize(res)
    res["targets"] = [{**asdict(t), "verdict": t.verdict} for t in evaluate(res)]
    res["wall_s"] = pc() - started
    return res


def run_limits(peer: PeerProcess, nbytes: int, repeats: int, ring_bytes: int,
               timeout_s: float) -> dict[str, dict[str, list[Any]]]:
    """Raw TCP with 1, 2, 4 and 8 streams, ``repeats`` rounds."""
    peer.call("raw_prepare", timeout_s, ring_bytes=ring_bytes)
    ring = lim.AlignedBuffer(ring_bytes)
    limits: dict[str, dict[str, list[Any]]] = {str(s): {} for s in STREAMS}
    try:
        for r in range(repeats):
            for s in STREAMS:
                one = raw_limit(peer, nbytes, s, ring, ring_bytes, timeout_s)
                for k, v in one.items():
                    limits[str(s)].setdefault(k, []).append(v)
                bc.log(f"peer limit {r + 1}/{repeats}: {s} stream(s) {one['recv_s']:.3f}s "
                       f"({nbytes / one['recv_s'] / GB:.2f} GB/s)")
    finally:
        ring.close()
        del ring
        peer.call("raw_done", timeout_s)
        bc.free_memory()
    return limits


class Session:
    """The receives, most important first; the optional ones while the time budget lasts."""

    def __init__(self, peer: PeerProcess, target: Any, checker: Checker, res: dict[str, Any],
                 address: str, token: str, timeout_s: float, deadline: float):
        self.peer, self.target, self.checker, self.res = peer, target, checker, res
        self.address, self.token, self.timeout_s, self.deadline = address, token, timeout_s, \
            deadline
        self.nbytes = res["state_bytes"]
        self.repeats = res["repeats"]
        self.slow_s = res["slow_s"]
        self.methods: dict[str, dict[str, Any]] = {}
        res["methods"] = self.methods
        res["profiles"] = {}
        res["send_blocked_s"] = []  # every send_checkpoint of the run
        self.step = 0
        self.clients: dict[int, HTTPTransport] = {}

    def client(self, c: int) -> HTTPTransport:
        if c not in self.clients:
            self.clients[c] = HTTPTransport(timeout=self.timeout_s, num_chunks=c,
                                            token=self.token)
        return self.clients[c]

    def live(self) -> float:
        """A fresh ``send_checkpoint`` in the serving process; its blocked seconds."""
        self.step += 1
        blocked = float(self.peer.call("live", self.timeout_s, step=self.step)["blocked_s"])
        self.res["send_blocked_s"].append(blocked)
        return blocked

    def measure(self, label: str, meta: dict[str, Any],
                one: Callable[[], dict[str, float]]) -> None:
        """``repeats`` runs of ``one`` (a single run when the first is slow)."""
        m = self.methods.setdefault(label, dict(meta))
        for r in range(self.repeats):
            rec = one()
            for k, v in rec.items():
                m.setdefault(k, []).append(v)
            bc.log(f"peer {r + 1}/{self.repeats} {label}: blocked {rec['blocked_s'] * 1e3:.1f}"
                   f" ms, receive {rec['recv_s']:.3f}s ({self.nbytes / rec['recv_s'] / GB:.2f}"
                   " GB/s)")
            if r == 0 and self.repeats > 1 and rec["recv_s"] > self.slow_s:
                m["runs_note"] = (f"1 run: it took {rec['recv_s']:.1f}s, more than "
                                  f"{self.slow_s:.0f}s")
                break

    def transfer(self, blocked: float, fn: Callable[[], Any], who: str, *,
                 in_place: bool = True, **extra: float) -> dict[str, float]:
        if in_place:
            self.checker.zero_probes(self.target)
        with Transfer(self.peer) as tr:
            got = fn()
        self.checker.check(self.target if in_place else got, who)
        del got
        return {"blocked_s": blocked, **tr.as_dict(), **extra}

    def in_place(self, c: int, label: str) -> Callable[[], dict[str, float]]:
        def one() -> dict[str, float]:
            blocked = self.live()
            return self.transfer(blocked, lambda: self.client(c).recv_checkpoint(
                0, self.address, self.step, self.timeout_s, into=self.target), label)
        return one

    def run(self) -> None:
        d = DEFAULT_CHUNKS
        try:
            label = f"in place, num_chunks={d}"
            self.measure(label, {"kind": "live", "chunks": d}, self.in_place(d, label))

            label = f"fresh (no target), num_chunks={d}"

            def fresh() -> dict[str, float]:
                blocked = self.live()
                rec = self.transfer(blocked, lambda: self.client(d).recv_checkpoint(
                    0, self.address, self.step, self.timeout_s), label, in_place=False)
                bc.free_memory()
                return rec
            self.measure(label, {"kind": "live", "chunks": d}, fresh)

            self.profile("the library as is")
            self.arena()
            self.res["torchft"].update(self.torchft())
            self.optional()
        finally:
            for cl in self.clients.values():
                cl.shutdown()
            self.peer.call("asyncckpt_done", self.timeout_s)
            bc.free_memory()

    def profile(self, key: str) -> None:
        """The server's checksum time, then one instrumented in-place receive."""
        blocked = self.live()
        checksum_s = manifest_request(self.address, self.step, self.token, self.timeout_s)
        holder: dict[str, Any] = {}

        def fetch() -> None:
            _, holder["prof"] = profiled(lambda: self.client(DEFAULT_CHUNKS).recv_checkpoint(
                0, self.address, self.step, self.timeout_s, into=self.target))
        rec = self.transfer(blocked, fetch, "profiled")
        prof = holder["prof"]
        prof.update(rec)
        prof["server_checksum_s"] = checksum_s
        prof["manifest_again_s"] = manifest_request(self.address, self.step, self.token,
                                                     self.timeout_s)
        self.res["profiles"][key] = prof
        bc.log(f"peer profile ({key}): server checksums {checksum_s:.3f}s, then the transfer "
               f"{rec['recv_s']:.3f}s")

    def arena(self) -> None:
        """``ckpt.serve`` + ``save_async(overlap=True)``; receive once the save is durable."""
        d = DEFAULT_CHUNKS
        label = f"arena: ckpt.serve + save_async, num_chunks={d}"

        def one() -> dict[str, float]:
            self.step += 1
            saved = self.peer.call("arena", self.timeout_s, step=self.step)
            m = self.methods[label]
            for k in ("serve_call_s", "prepare_s"):
                if k in saved:
                    m[k] = saved[k]
            return self.transfer(saved["blocked_s"], lambda: self.client(d).recv_checkpoint(
                0, self.address, self.step, self.timeout_s, into=self.target), label,
                staged_s=saved["staged_s"], durable_s=saved["durable_s"])
        try:
            self.measure(label, {"kind": "arena", "chunks": d}, one)
        finally:
            self.step += 1
            closed = self.peer.call("arena_close", self.timeout_s, step=self.step)
            self.res["arena_close"] = closed

    def torchft(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        cls, how = import_torchft()
        out["import"] = how
        if cls is None:
            out["error"] = f"receiver: {how}"
            return out
        clients: dict[int, Any] = {}
        try:
            for c in TORCHFT_CHUNKS:
                label = f"torchft HTTPTransport, num_chunks={c}"

                def one(c: int = c, label: str = label) -> dict[str, float]:
                    self.step += 1
                    sent = self.peer.call("torchft", self.timeout_s, step=self.step,
                                          num_chunks=c)
                    if "how" in sent:
                        out["server_import"] = sent["how"]
                    if c not in clients:
                        clients[c] = cls(timedelta(seconds=self.timeout_s), num_chunks=c)
                    times: dict[str, float] = {}

                    def fetch() -> None:
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore")
                            t0 = pc()
                            tree = clients[c].recv_checkpoint(
                                0, sent["address"], self.step, timedelta(seconds=self.timeout_s))
                            t1 = pc()
                            with lim.torch_threads(1):  # see the note in render()
                                bc.copy_tree(self.target, tree)
                            times.update(recv_only_s=t1 - t0, copy_s=pc() - t1)
                            del tree
                    rec = self.transfer(sent["blocked_s"], fetch, label)
                    gc.collect()
                    bc.free_memory()
                    return {**rec, **times}
                self.measure(label, {"kind": "torchft", "chunks": c}, one)
        except (PeerError, OSError, RuntimeError) as exc:
            out["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1]}"
            bc.log(f"peer torchft failed: {out['error']}")
        finally:
            for client in clients.values():
                with contextlib.suppress(Exception):
                    client.shutdown(wait=False)
            with contextlib.suppress(PeerError):
                self.peer.call("torchft_done", self.timeout_s)
        return out

    def optional(self) -> None:
        """``asyncckpt.load(address)`` and the other num_chunks values, while time is left:
        each is estimated from the default's receive time (x 8/num_chunks)."""
        base = median(self.methods[f"in place, num_chunks={DEFAULT_CHUNKS}"]["recv_s"])
        todo: list[tuple[str, float, dict[str, Any], Callable[[], dict[str, float]]]] = []
        label = "asyncckpt.load(address, target)"

        def load() -> dict[str, float]:
            blocked = self.live()
            return self.transfer(blocked, lambda: asyncckpt.load(
                self.address, self.target, token=self.token, timeout=self.timeout_s), label)
        todo.append((label, base, {"kind": "live", "chunks": 8}, load))
        seen = {fetch_connections(DEFAULT_CHUNKS)}
        for c in sorted((c for c in STREAMS if c != DEFAULT_CHUNKS), reverse=True):
            label = f"in place, num_chunks={c}"
            if fetch_connections(c) in seen:  # bounded by the CPUs: a run already measured
                self.res["skipped"][label] = (f"opens {fetch_connections(c)} connections on "
                                              "this machine, as a larger num_chunks did")
                continue
            seen.add(fetch_connections(c))
            todo.append((label, base * DEFAULT_CHUNKS / c, {"kind": "live", "chunks": c},
                         self.in_place(c, label)))
        for label, est, meta, one in todo:
            runs = self.repeats if est <= self.slow_s else 1
            left = self.deadline - pc()
            if est * runs * 1.2 > left:
                self.res["skipped"][label] = (f"estimated {est * runs:.0f}s ({runs} run(s)); "
                                              f"{max(0.0, left):.0f}s of the section's "
                                              f"{self.res['budget_s']:.0f}s budget left")
                bc.log(f"peer: skipping {label}: {self.res['skipped'][label]}")
                continue
            self.measure(label, meta, one)


# --- numbers, targets, table -------------------------------------------------------------------


def summarize(res: dict[str, Any]) -> None:
    limits = res["limits"]
    best = min(limits, key=lambda s: median(limits[s]["recv_s"]))
    res["limit_streams"] = int(best)
    res["limit_s"] = median(limits[best]["recv_s"])
    live = {k: m for k, m in res["methods"].items()
            if k.startswith("in place") and m["kind"] == "live"}
    if live:
        res["best_chunks"] = min(live.values(), key=lambda m: median(m["recv_s"]))["chunks"]


def _verdict(ratio: float, blocked: float) -> str:
    if math.isnan(ratio) or math.isnan(blocked):
        return "n/a"
    misses = []
    if ratio < RATIO_OK:
        misses.append(f"< {RATIO_OK:g}x")
    if blocked > BLOCKED_OK_S:
        misses.append(f"blocked > {BLOCKED_OK_S * 1e3:.0f} ms")
    return "PASS" if not misses else "MISS (" + ", ".join(misses) + ")"


def evaluate(res: dict[str, Any]) -> list[bc.Target]:
    limit = res["limit_s"]
    methods = res["methods"]
    out: list[bc.Target] = []

    def bw(label: str, name: str) -> None:
        m = methods.get(label)
        s = median(m["recv_s"]) if m else math.nan
        r = bc.ratio(limit, s)
        out.append(bc.Target(name, bc.fmt_s(s), f"≥ {RATIO_OK:g}x loopback "
                             f"({bc.fmt_s(limit)})", r, None if math.isnan(r) else r >= RATIO_OK))

    def blocked(label: str, name: str) -> None:
        m = methods.get(label)
        b = median(m["blocked_s"]) if m else math.nan
        out.append(bc.Target(name, bc.fmt_s(b), f"≤ {BLOCKED_OK_S * 1e3:.0f} ms",
                             bc.ratio(b, BLOCKED_OK_S),
                             None if math.isnan(b) else b <= BLOCKED_OK_S))

    d = DEFAULT_CHUNKS
    sends = res.get("send_blocked_s", [])
    if sends:
        b = median(sends)
        out.append(bc.Target(f"serving-side blocked ≈ 0: send_checkpoint (median of all "
                             f"{len(sends)} calls, {bc.fmt_s(min(sends))} to "
                             f"{bc.fmt_s(max(sends))})", bc.fmt_s(b),
                             f"≤ {BLOCKED_OK_S * 1e3:.0f} ms", bc.ratio(b, BLOCKED_OK_S),
                             b <= BLOCKED_OK_S))
    bw(f"in place, num_chunks={d}",
       f"peer receive in place ≥ {RATIO_OK:g}x loopback limit (default num_chunks={d})")
    best = res.get("best_chunks", d)
    if best != d:
        bw(f"in place, num_chunks={best}",
           f"peer receive in place ≥ {RATIO_OK:g}x loopback limit (best num_chunks={best})")
    bw(f"fresh (no target), num_chunks={d}",
       f"peer receive fresh ≥ {RATIO_OK:g}x loopback limit")
    bw(f"arena: ckpt.serve + save_async, num_chunks={d}",
       f"arena receive in place ≥ {RATIO_OK:g}x loopback limit")
    blocked(f"arena: ckpt.serve + save_async, num_chunks={d}",
            "serving-side blocked ≈ 0: save_async(overlap=True) with ckpt.serve")
    ft = [m for k, m in methods.items() if k.startswith("torchft")]
    if ft:
        ours = median(methods[f"in place, num_chunks={d}"]["recv_s"])
        theirs = min(median(m["recv_s"]) for m in ft)
        r = bc.ratio(ours, theirs)
        out.append(bc.Target("ahead of torchft HTTPTransport (its best, receive + copy into "
                             "the target)", bc.fmt_s(ours), f"≤ {bc.fmt_s(theirs)}", r,
                             None if math.isnan(r) else r <= 1.0))
    return out


def render(res: dict[str, Any]) -> str:
    n = res["repeats"]
    nbytes = res["state_bytes"]
    limit = res["limit_s"]
    fmt_s, fmt_x, ratio = bc.fmt_s, bc.fmt_x, bc.ratio

    def gbps(s: float) -> str:
        return bc.fmt_gbps(nbytes, s)

    def cpu(m: dict[str, Any]) -> str:
        return (f"{median(m['send_cpu_s']) / (nbytes / GB):.2f} / "
                f"{median(m['recv_cpu_s']) / (nbytes / GB):.2f}")

    parts = [f"### Peer recovery: receiving the state from a peer process over 127.0.0.1 "
             f"(median of {n})", "",
             f"A serving process holds {nbytes / GiB:.3f} GiB ({nbytes / GB:.3f} GB) in "
             f"{res['tensors']} tensors (bench_checkpoint's layout, seeded per tensor); this "
             "process receives it into an identically shaped target. Every asyncckpt receive "
             "follows its own send (or save), so it includes the server's checksumming on "
             "the first manifest request. CPU columns: CPU seconds per GB spent by the "
             "serving / receiving process (2 cores in all).", ""]
    rows = []
    for s, rec in res["limits"].items():
        t = median(rec["recv_s"])
        note = ("**the loopback limit** (fastest)" if int(s) == res["limit_streams"]
                else f"{fmt_x(ratio(limit, t))} the limit")
        rows.append([f"raw TCP, {s} stream{'s' if int(s) > 1 else ''}: sendall / recv_into "
                     "pre-touched buffers", fmt_s(t), gbps(t), cpu(rec), note])
    parts += ["#### Limits", "", bc.table(["limit", "time", "GB/s", "CPU s/GB send / recv",
                                           "notes"], rows), "",
              f"Buffers of {res['ring_bytes'] / GiB:.3g} GiB on each side, cycled "
              f"({nbytes / res['ring_bytes']:.2g}x) to move the state's bytes.", ""]
    rows = []
    for label, m in res["methods"].items():
        t = median(m["recv_s"])
        b = median(m["blocked_s"])
        r = ratio(limit, t)
        name = label if label.startswith(("torchft", "asyncckpt.")) else f"asyncckpt {label}"
        if "runs_note" in m:
            name += f" [{m['runs_note']}]"
        if label.startswith("torchft"):
            name += (f" (receive {fmt_s(median(m['recv_only_s']))} + copy into the target "
                     f"{fmt_s(median(m['copy_s']))})")
        rows.append([name, fmt_s(b), fmt_s(t), gbps(t), fmt_x(r), cpu(m), _verdict(r, b)])
    parts += ["#### Methods", "",
              bc.table(["method", "serving-side blocked", "receive", "GB/s",
                        "BW / loopback limit", "CPU s/GB send / recv",
                        f"≥ {RATIO_OK:g}x and blocked ≤ {BLOCKED_OK_S * 1e3:.0f} ms"], rows), ""]
    notes = []
    best = res.get("best_chunks")
    if best is not None:
        notes.append(f"- num_chunks: best {best} "
                     f"({fmt_s(median(res['methods'][f'in place, num_chunks={best}']['recv_s']))})"
                     f", default {DEFAULT_CHUNKS}")
    conns = res.get("connections", {})
    if any(int(c) != n for c, n in conns.items()):
        notes.append("- connections opened: " + ", ".join(
            f"num_chunks={c}: {n}" for c, n in sorted(conns.items(), key=lambda kv: -int(kv[0])))
            + " (a fetch opens at most one per CPU, 2 at least)")
    arena = next((m for k, m in res["methods"].items() if k.startswith("arena")), None)
    if arena:
        serve_s, prep_s = arena.get("serve_call_s", math.nan), arena.get("prepare_s", math.nan)
        notes.append(f"- arena: `ckpt.serve(transport)` took {fmt_s(serve_s)}, "
                     f"`ckpt.prepare(state)` {fmt_s(prep_s)} "
                     "(once, before the saves); blocked is `save_async(state, overlap=True)` "
                     f"(staged after {fmt_s(median(arena['staged_s']))}, durable after "
                     f"{fmt_s(median(arena['durable_s']))}; the receive starts once durable)")
    for label, why in res.get("skipped", {}).items():
        notes.append(f"- not measured: {label}: {why}")
    closed = res.get("arena_close")
    if closed:
        notes.append("- arena memory: serving process RSS "
                     f"{closed['rss_before_close_bytes'] / GiB:.2f} GiB before `ckpt.close()`, "
                     f"{closed['rss_after_close_bytes'] / GiB:.2f} GiB after it, "
                     f"{closed['rss_after_replace_bytes'] / GiB:.2f} GiB once the "
                     "transport offered something else")
    ft = res["torchft"]
    if "error" in ft or not any(k.startswith("torchft") for k in res["methods"]):
        notes.append(f"- torchft {ft.get('version')}: not measured: "
                     f"{ft.get('error', ft.get('import', '?'))}")
    else:
        notes.append(f"- torchft {ft['version']}: {ft.get('import')}; its receive returns a "
                     "fresh state dict (unpickled with weights_only=False), copied into the "
                     "target for parity (the copy is in its receive time; it runs with 1 torch "
                     "thread: with 2, the copy varied from 0.2 s to 8 s on this busy 2-core "
                     "machine)")
    checked = res.get("checked", {})
    notes.append(f"- every receive was checked: keys, shapes, and {len(res.get('probes', []))} "
                 f"tensors zeroed before and compared with the seeded originals after "
                 f"({sum(checked.values())} tensor checks in all)")
    parts += [*notes, ""]
    for key, prof in res.get("profiles", {}).items():
        rows = []
        for i, c in enumerate(prof["connections"]):
            rows.append([str(i), f"{c['bytes'] / MiB:.0f} MiB", str(int(c["requests"])),
                         str(int(c["pieces"])),
                         fmt_s(c["fetch_s"]), bc.fmt_gbps(int(c["bytes"]), c["fetch_s"]),
                         fmt_s(c["hash_s"]), f"{fmt_s(c['first_s'])} → "
                         f"{fmt_s(c['first_s'] + c['span_s'])}",
                         fmt_s(c["fetch_s"] / max(1, c["requests"]))])
        pieces = sum(int(c["pieces"]) for c in prof["connections"])
        requests = sum(int(c["requests"]) for c in prof["connections"])
        parts += [f"#### Profile of one in-place receive, num_chunks={DEFAULT_CHUNKS}: {key}", "",
                  f"Server checksums (the first manifest request after send_checkpoint): "
                  f"{fmt_s(prof['server_checksum_s'])} (a second request: "
                  f"{fmt_s(prof['manifest_again_s'])}); then the receive, manifest cached: "
                  f"{fmt_s(prof['recv_s'])} ({gbps(prof['recv_s'])} GB/s, "
                  f"{fmt_x(ratio(limit, prof['recv_s']))} the limit) in {requests} range "
                  f"requests and {pieces} reads (one per tensor or run of small ones, or per "
                  f"{_read_piece() // MiB} MiB piece of a larger one); CPU s/GB send / recv "
                  f"{prof['send_cpu_s'] / (nbytes / GB):.2f} / "
                  f"{prof['recv_cpu_s'] / (nbytes / GB):.2f}.", "",
                  bc.table(["connection", "bytes", "requests", "reads", "in _fetch",
                            "GB/s while fetching", "hashing", "active (from the call)",
                            "per request"], rows), ""]
    parts += ["#### Targets (peer recovery)", "",
              bc.table(["target", "measured", "threshold", "ratio", "verdict"],
                       [[t["name"], t["measured"], t["threshold"], fmt_x(t["ratio"]),
                         t["verdict"]] for t in res["targets"]]), ""]
    mem = res["memory"]
    parts.append("Peer section: peak machine memory in use "
                 f"{mem['peak_extra_used_bytes'] / GiB:.2f} GiB above the "
                 f"{mem['baseline_used_bytes'] / GiB:.2f} GiB before it; peak RSS "
                 f"serving process {mem['server_peak_rss_bytes'] / GiB:.2f} GiB, receiver "
                 f"{mem['receiver_peak_rss_bytes'] / GiB:.2f} GiB; wall time "
                 f"{res.get('wall_s', 0):.0f} s.")
    return "\n".join(parts)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--peer-server":
        server_main(sys.argv[2])
    else:
        raise SystemExit(bc.main(["--only", "peer", *sys.argv[1:]]))
