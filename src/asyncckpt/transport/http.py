"""HTTP transport: a healthy worker serves its checkpoint; a recovering one fetches it.

Server: ``GET /v1/<step>/manifest.json`` and ``GET /v1/<step>/files/<name>`` with a
``Range`` header, over HTTP/1.1 keep-alive. It starts locked, serves only the allowed
step (requests while locked wait until allowed or time out), requires
``Authorization: Bearer <token>`` when a token is set, bounds connections and range
sizes, and binds to 127.0.0.1 unless told otherwise. It serves bytes, never pickle.

Client: an HTTP implementation of ReadStorage, so the ordinary loader — resharding,
checksum verification, in-place loads — runs over the network unchanged. Ranges are
fetched on several connections at once and a failed range is retried.
"""

from __future__ import annotations

import contextlib
import hmac
import http.client
import ipaddress
import itertools
import json
import logging
import os
import random
import re
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlsplit

from ..commit import MAX_STEP, StepLike, as_step
from ..errors import (
    CheckpointClosedError,
    CheckpointConfigError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    CheckpointTransportError,
    check_flags,
    retold,
    seconds_text,
)
from ..manifest import DEFAULT_BLOCK_BYTES, MANIFEST_NAME, Manifest, check_block_bytes
from .base import (
    PEER_MAX_MANIFEST_BYTES,
    CheckpointTransport,
    LiveSource,
    Served,
    StateChanged,
    StepNotOffered,
    check_state_dict_fn,
    seconds,
    serve_directory,
    serve_state,
    uncopied_hint,
)

if TYPE_CHECKING:
    from ..loader import KeyMap

log = logging.getLogger(__name__)

_PATH = re.compile(
    r"/v1/(0|[1-9][0-9]{0,18})/(manifest\.json|files/[A-Za-z0-9_.-]{1,128}|done)")
_FETCH = "Asyncckpt-Fetch"  # the header naming the fetch a request belongs to
_FETCH_ID = re.compile(r"[0-9a-f]{16,64}")
_MAX_FETCHES = 1024  # fetches a server keeps track of at most (the oldest go first)
_CURRENT = "/v1/current"
# (RFC 9110 14.1.1: first-last, first- (the rest) or -suffix (the last bytes); one range)
_RANGE = re.compile(r"bytes=(?:([0-9]{1,18})-([0-9]{1,18})?|-([0-9]{1,18}))")
_SIZE = re.compile(r"[0-9]{1,18}")
_MiB = 1024 * 1024
_STREAM_FIRST = 1 * _MiB  # the range a client thread asks for where it starts reading
_STREAM_MAX = 64 * _MiB  # ranges double up to this while the thread reads on sequentially
_SKIP = 1 * _MiB  # a gap up to this in a stream is read and dropped, not a new request
STALL_S = 10.0  # a transfer taken nothing of for this long is cut off by a drain (_drain)
# A fetch whose last transfer broke off (its receiver gone: killed, or cut off), and that
# has no other running nor asks again within this long, is over: a receive retries a
# broken range at once (a re-check trial's killed receiver held disallow STALL_S)
_BROKEN_GRACE_S = 2.0
# (struct tcp_info: 8 one-byte fields, 24 u32s, then u64 pacing_rate, max_pacing_rate and
# bytes_acked)
_ACKED_AT = 8 + 24 * 4 + 2 * 8
_MIN_RANGE = 64 * 1024  # below this, a server's 413 is an error rather than halved again
# (and a server's max_range_bytes below it is refused)
_NOT_ALLOWED = "was not allowed"  # a 503 a client answers by asking again, up to its timeout
_CLOSED = "is shutting down"  # the 503 of a request that waited while the server shut down
_REASON = "Asyncckpt-Reason"  # a refusal's reason, as its body says it: a HEAD gets no body
_HEADER_WAIT_S = 10.0  # at most, for a request's line and headers (an idle keep-alive too)
_BACKOFF_FIRST_S = 0.05  # a client's first pause after a 503 "server full"
_BACKOFF_MAX_S = 1.0  # the pauses double up to this
_HANGUP_CHECK_S = 0.25  # a request waiting for a step checks this often that its client is there
_DONE_WAIT_S = 1.0  # at most, for the peer to take a fetch's "done"


MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week: socket and thread timeouts overflow far above

DEFAULT_MAX_FILE_BYTES = 1 << 40
"""The largest shard file a receive accepts from a peer's manifest by default
(``max_file_bytes``): 1 TiB, PGTransport's default too. A shard file holds one rank's
state, which lives in that rank's accelerator memory (a few hundred GB on the largest) and
its share of its host's, so no real shard comes near it; without a limit a forged manifest
could claim any size short of what the receiving machine could ever hold. A default
cannot tell a forged 16 GiB claim from a real 16 GiB shard: a receiver that knows the
size of its peers' shards sets a tighter limit."""


def fetch_connections(asked: int) -> int:
    """The connections (and reader threads) a fetch uses: ``asked``, but at most one per
    CPU this process may run on (2 at least). Each connection needs a CPU to copy its
    bytes out of the kernel: on a 2-core machine 8 of them only contend for the GIL and
    the cores, and receive about a fifth slower than 2 do."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(asked, max(2, cpus)))


def _reachable(host: str) -> str:
    """The host to advertise for a server bound to ``host``: a wildcard address ("0.0.0.0",
    "::", "") means every interface, which no peer can connect to by that name."""
    if host in ("", "0") or _unspecified(host):
        return socket.gethostname()
    return host


def _bare_host(host: str, name: str) -> str:
    """``host`` without the brackets of an IPv6 address written as in a URL ("[::1]");
    a host with a port (as "node7:8000", which is no IPv6 address) is refused."""
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if (not bare and name != "host") or any(c.isspace() or not c.isprintable() or c in "/@?#"
                                            for c in bare):
        # (a URL, "http://node7", or a name with a space: the advertised address would
        # be one no peer can fetch from; "" binds every interface, but names none)
        raise CheckpointConfigError(
            f"{name}={host!r}: pass a bare host name or address ('node7', '10.0.0.7', "
            "'::1'): no scheme, path, port or spaces")
    if ":" in bare:
        try:
            ipaddress.IPv6Address(bare.split("%")[0])
        except ValueError:
            raise CheckpointConfigError(
                f"{name}={host!r}: pass a host name or address without a port (the port "
                "is the transport's own: port=)") from None
    return bare


def _unspecified(host: str) -> bool:
    """Any spelling of the wildcard address ("0.0.0.0", "::", "::0", "0:0:0:0:0:0:0:0")."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:  # a host name
        return False


def check_max_file_bytes(value: Any, label: str = "max_file_bytes") -> int | None:
    """A limit on the file bytes a peer's manifest may claim: an int of 1 or more, or None
    (no limit)."""
    if value is not None and (type(value) is not int or value < 1):
        # (bool, float, numpy ints refused, as max_manifest_bytes's: a limit is bytes)
        raise CheckpointConfigError(f"{label}={value!r}: use an int of 1 or more (bytes), "
                                    "or None for no limit")
    return value


def _size(n: int) -> str:
    """``n`` bytes, in bytes and a unit a person reads at a glance: "17179869184 bytes
    (16 GiB)"."""
    x, unit = float(n), ""
    for u in ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if x < 1024:
            break
        x, unit = x / 1024, u
    return f"{n} bytes ({x:.3g} {unit})" if unit else f"{n} bytes"


def fetch_timeout(timeout: timedelta | float) -> float:
    """A fetch's whole-fetch timeout in seconds: positive, at most ``MAX_TIMEOUT_S``."""
    t = seconds(timeout)
    if not t > 0:  # (nan too)
        raise CheckpointConfigError(f"timeout={timeout!r}: pass a positive number of seconds")
    return min(t, MAX_TIMEOUT_S)


class HTTPTransport(CheckpointTransport[Any]):
    """Serve and fetch checkpoints over HTTP.

    Thread-safe: the server runs on its own threads; ``allow``/``disallow``/``serve``
    may be called from any thread. ``recv_checkpoint`` runs on the caller's thread
    and ``num_chunks`` connections.

    Args:
        timeout: how long a request may wait for a step to be allowed, and the default
            for how long a fetch may take as a whole.
        num_chunks: parallel connections a fetch uses (0 counts as 1); above 2, at
            most one per CPU the process may run on (more only contend for the CPUs).
        host: interface to bind (127.0.0.1 by default; "0.0.0.0" or "::" for all).
        port: port to bind (0 picks a free one).
        advertise_host: the host put in ``metadata()`` when it differs from ``host``
            (default: ``host``; for a wildcard ``host``, this machine's host name, since
            a peer told "0.0.0.0" would connect to itself).
        token: a shared secret every request must carry; None disables the check (an
            empty token is refused: it could never match).
        max_connections: connections served at once. When all are taken, a new one
            replaces the connection that has waited longest for a request (idle, or
            still sending its headers); with none such it is refused with 503.
        max_range_bytes: the largest byte range one request may ask for (at least 64 KiB:
            a receiver halves its ranges down to that on a 413, not below).
        max_manifest_bytes: the largest manifest a fetch accepts from a peer (a manifest
            grows up to ~25x in memory while parsed; ~60 MB holds 100k tensors).
        max_file_bytes: the largest shard file a peer's manifest may claim (1 TiB by
            default, as PGTransport's; None: no limit). A receive refuses a manifest
            claiming a larger one before it allocates anything; a receive with no
            ``into=`` target, which allocates every tensor the manifest claims, also
            refuses files that total more. It bounds what a forged manifest makes this
            receiver allocate: set it just above the shards your peers send.
        withdraw_grace: how long ``withdraw()`` -- what a checkpointer serving its saves
            calls before its next save restages the arena, and at ``close()`` -- lets the
            transfers of the old offer run before it cuts them off (their receivers then
            fetch the new offer: ``asyncckpt.load`` of the step on offer does so itself).
            It is time the training thread waits, so it is short (1 s by default), and
            not the ``timeout`` ``disallow_checkpoint()`` grants, as torchft expects.
    """

    def __init__(self, timeout: timedelta | float = 60.0, num_chunks: int = 8, *,
                 host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None,
                 token: str | None = None, max_connections: int = 64,
                 max_range_bytes: int = 1 << 30, block_bytes: int = DEFAULT_BLOCK_BYTES,
                 max_manifest_bytes: int = PEER_MAX_MANIFEST_BYTES,
                 state_dict: Callable[[], Any] | None = None,
                 withdraw_grace: timedelta | float = 1.0,
                 max_file_bytes: int | None = DEFAULT_MAX_FILE_BYTES):
        for name, value in (("num_chunks", num_chunks), ("max_connections", max_connections),
                            ("max_range_bytes", max_range_bytes), ("port", port)):
            if isinstance(value, bool) or not isinstance(value, int):
                # (a float max_connections would make a semaphore that never blocks)
                raise CheckpointConfigError(f"{name}={value!r}: pass an int")
        for name, host_value in (("host", host), ("advertise_host", advertise_host)):
            if not isinstance(host_value, str) and (name == "host" or host_value is not None):
                raise CheckpointConfigError(f"{name}={host_value!r}: pass a host name or "
                                            "address as a str")
        if num_chunks < 0:
            raise CheckpointConfigError(f"num_chunks={num_chunks}: use 1 or more (0, "
                                        "torchft's 'no chunking', counts as 1)")
        num_chunks = max(1, num_chunks)  # torchft's default 0 means "no chunking"
        self.timeout_s = fetch_timeout(timeout)  # (capped at a week, as a fetch's is)
        self.withdraw_grace_s = seconds(withdraw_grace, "withdraw_grace")
        if not self.withdraw_grace_s >= 0:  # (nan too)
            raise CheckpointConfigError(f"withdraw_grace={withdraw_grace!r}: use 0 or more "
                                        "seconds")
        self.withdraw_grace_s = min(self.withdraw_grace_s, MAX_TIMEOUT_S)
        self.num_chunks = num_chunks
        self.token = _check_token(token)
        if max_connections < 1:
            raise CheckpointConfigError(f"max_connections={max_connections}: use 1 or more")
        if max_range_bytes < _MIN_RANGE:  # (receivers would fail on every 413)
            raise CheckpointConfigError(
                f"max_range_bytes={max_range_bytes}: use {_MIN_RANGE} (64 KiB) or more; "
                f"a receiver halves the ranges a server refuses down to {_MIN_RANGE} bytes, "
                "not below")
        if type(max_manifest_bytes) is not int or max_manifest_bytes < 1:
            raise CheckpointConfigError(f"max_manifest_bytes={max_manifest_bytes!r}: use an "
                                        "int of 1 or more")
        self.max_manifest_bytes = max_manifest_bytes
        self.max_file_bytes = check_max_file_bytes(max_file_bytes)
        self._state_dict = check_state_dict_fn(state_dict)
        if not 0 <= port <= 65535:
            raise CheckpointConfigError(f"port={port}: use 0 (any free port) to 65535")
        check_block_bytes(block_bytes)
        self.block_bytes = block_bytes
        self.max_range_bytes = max_range_bytes
        self._pid = os.getpid()  # (its server thread runs in this process only)
        self._cond = threading.Condition()
        self._offered: Served | None = None
        self._allowed: int | None = None
        self._retired: str | None = None  # why nothing will be offered (see withdraw)
        # disallow_checkpoint() and withdraw() calls so far: a send_checkpoint that one of
        # them overtook offers as if it had come first (see send_checkpoint)
        self._disallows = 0
        self._withdrawals = 0
        # (step, why): the last send_checkpoint failed at the sender; requests for that
        # step are refused at once instead of waiting for an offer that will not come
        self._failed: tuple[int, str] | None = None
        self._sending = 0  # send_checkpoint calls laying out a state now
        self._closed = False  # shutdown() has begun: requests and offers are refused
        self._mixed = False  # offers of two origins met (warned of once)
        self._serving: dict[int, tuple[socket.socket, Served]] = {}  # ticket -> transfer
        # Fetches (a receiver's requests, from its manifest to its "done") of the offers,
        # with when each was last seen: a disallow_checkpoint() lets those of the offer
        # it stops finish (their next requests too), not just the requests in flight.
        self._fetches: dict[str, tuple[Served, float]] = {}
        self._draining: Served | None = None  # the offer a disallow lets fetches finish
        self._fetch_of: dict[socket.socket, str] = {}  # a transfer's fetch, while it runs
        self._broken: dict[str, float] = {}  # when a fetch's last transfer broke off
        # (or its last connection closed, its receiver saying nothing: killed between
        # requests; a disallow waited STALL_S for it, not _BROKEN_GRACE_S)
        self._open_conns: dict[str, int] = {}  # a fetch's connections still open
        self._receiving: set[HTTPStorage] = set()  # recv_checkpoint's fetches in progress
        self._tickets = itertools.count()
        host = _bare_host(host, "host")
        if advertise_host is not None:
            advertise_host = _bare_host(advertise_host, "advertise_host")
        try:
            self._server = _Server((host, port), _Handler, self, max_connections)
        except OSError as exc:  # (socket.gaierror too: an unknown host name)
            raise CheckpointConfigError(
                f"HTTPTransport cannot listen on host={host!r} port={port}: "
                f"{type(exc).__name__}: {exc} (pass an address of this machine, 0.0.0.0 or :: "
                "for all of them, and port=0 for any free port)") from exc
        self._advertise = advertise_host or _reachable(host)
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        name="asyncckpt-http", daemon=True)
        self._thread.start()

    # --- serving side ----------------------------------------------------------------------

    def address(self) -> str:
        """Base URL of this server: ``http://host:port/v1``."""
        host = self._advertise
        if ":" in host and not host.startswith("["):
            # (an IPv6 zone, "fe80::1%eth0", is written %25eth0 in a URL: RFC 6874)
            host = "[" + host.replace("%25", "%").replace("%", "%25") + "]"
        return f"http://{host}:{self._server.server_address[1]}/v1"

    def metadata(self) -> str:
        return self.address()

    def serve(self, served: Served, *, allow: bool = True,
              _since: tuple[int, int] | None = None) -> None:
        """Offer ``served`` (replacing what was offered before) and allow its step
        (``allow=False``: offer it not allowed yet, for ``allow_checkpoint``).
        ``_since`` is internal (send_checkpoint's: the offer is not made, or not
        allowed, if a withdraw() or disallow_checkpoint() came meanwhile).

        Raises:
            CheckpointClosedError: after ``shutdown()``.
            CheckpointConfigError: a step above 2**63-1 (``commit.MAX_STEP``), as a
                PGTransport's.
        """
        self._refuse_forked("serve")
        as_step(served.step)  # (at most 2**63-1: 19 digits in a URL, an int64 on a PG's wire)
        check_flags(allow=allow)
        with self._cond:
            self._check_open("serve")
            if _since is not None and _since[1] != self._withdrawals:
                # withdrawn while send_checkpoint prepared this offer: as if it had come
                # first, then the withdrawal, nothing of it is on offer
                served.close()
                log.warning("send_checkpoint of step %d on %s: withdraw() was called while it "
                            "laid out the state (a checkpointer's next save, if it shares "
                            "this transport), so nothing of it is offered", served.step,
                            self.address())
                return
            if _since is not None and _since[0] != self._disallows:
                allow = False  # (disallowed meanwhile: offered, as if before the disallow)
            self._failed = None
            old = self._offered
            self._offered = served
            self._allowed = served.step if allow else None
            self._retired = None  # (offered again: requests wait for an allowed step)
            self._forget_fetches(lambda srv: srv is not served)  # (nor keep old offers alive)
            self._cond.notify_all()
        if old is not None and old is not served:
            if old.origin and served.origin and old.origin != served.origin and not self._mixed:
                self._mixed = True  # (once: both go on replacing each other)
                log.warning("this HTTPTransport (%s) was offered step %d by %s while it served "
                            "step %d of %s: it serves one offer at a time, so each replaces "
                            "the other; give each its own transport", self.address(),
                            served.step, served.origin, old.step, old.origin)
            self._close_when_idle(old)

    def send_checkpoint(self, dst_ranks: list[int], step: StepLike, state_dict: Any,
                        timeout: timedelta | float) -> None:
        """Offer the live ``state_dict`` at ``step``; returns at once.

        Only small tensors are copied (the buffers a forward pass updates: BatchNorm's
        running statistics); the rest are served as they are, so they must not change
        until ``disallow_checkpoint()`` returns (torchft's contract). A disallow (or
        withdraw) on another thread while this lays out the state wins: the offer is
        made as if before it. If this raises, requests for ``step`` are refused at once.
        ``timeout`` (None: the transport's) bounds how long the ``disallow_checkpoint()``
        that ends this offer waits for transfers in progress, at most the transport's
        ``timeout`` (the offer itself is made at once: torchft passes its Manager's
        timeout, which a trial expected to bound the training thread's stall).
        """
        from .. import __version__

        self._refuse_forked("send_checkpoint")
        _check_ranks(dst_ranks, "dst_ranks")
        drain_s = None if timeout is None else fetch_timeout(timeout)  # (0, -5, "x" refused)
        step = as_step(step)
        with self._cond:
            self._check_open("send_checkpoint")
            since = (self._disallows, self._withdrawals)
            if self._failed is not None and self._failed[0] == step:
                self._failed = None  # (sent again: its requests wait for this offer)
            self._retired = None  # (something is being offered: requests wait for it)
            self._sending += 1  # (requests for the step on offer wait for this one)
        try:
            try:
                served = serve_state(step, state_dict, block_bytes=self.block_bytes,
                                     library_version=__version__)
                served.drain_s = drain_s
            except Exception as exc:
                # (a leaf that cannot be served, a state_dict() that raised) The receivers
                # of this step would wait out their timeout for it: tell them now.
                failed = None
                with contextlib.suppress(CheckpointError, TypeError, ValueError):
                    failed = (as_step(step), f"its send_checkpoint failed at the sender "
                                             f"({type(exc).__name__}: {exc})")
                    with self._cond:
                        self._failed = failed
                with self._cond:
                    stale = self._offered is not None
                if failed is not None and stale:  # (not an argument refused: a bad step)
                    # The step on offer before is stale: its sender moved on (and may
                    # change its tensors); still allowed, it was served as current, and a
                    # receiver waiting for this step was told to fetch that one. Its
                    # receivers are told at once, not left to wait their timeout.
                    self.withdraw(retired=f"the sender moved on to step {failed[0]}, whose "
                                          f"send_checkpoint failed ({type(exc).__name__}: "
                                          f"{exc})")
                raise
            # A disallow_checkpoint() (or withdraw()) from another thread while the state
            # was laid out returned at once: its caller may be changing the tensors now.
            # The offer is made as if it had come first: not allowed (or, withdrawn, not
            # made at all).
            self.serve(served, _since=since)
        finally:
            with self._cond:
                self._sending -= 1
                self._cond.notify_all()  # (a failure, or the send's end: waiters look again)

    def serve_directory(self, step_dir: str | Path) -> int:
        """Serve a committed checkpoint from disk (a step directory, or a checkpoint root:
        its latest step); returns its step."""
        self._refuse_forked("serve_directory")
        self._check_open("serve_directory")  # (before the files are read)
        served = serve_directory(Path(step_dir))
        try:
            self.serve(served)
        except BaseException:
            served.close()
            raise
        return served.step

    def allow_checkpoint(self, step: StepLike) -> None:
        """Serve the offered checkpoint if it is of ``step``.

        Raises:
            CheckpointNotFoundError: nothing of ``step`` is on offer (never offered, or
                withdrawn).
            CheckpointClosedError: after ``shutdown()``.
        """
        self._refuse_forked("allow_checkpoint")
        step = as_step(step)
        with self._cond:
            self._check_open("allow_checkpoint")
            if self._offered is None:
                raise CheckpointNotFoundError(
                    f"cannot allow step {step}: nothing is on offer (never offered, or "
                    "withdrawn: send_checkpoint() or a checkpointer's next save offers one)")
            if self._offered.step != step:
                raise CheckpointNotFoundError(
                    f"cannot allow step {step}: the checkpoint on offer is of step "
                    f"{self._offered.step}")
            self._allowed = step
            self._offered.cancelled.clear()  # a disallow may have cut its checksumming off
            self._cond.notify_all()

    def disallow_checkpoint(self) -> None:
        """Stop serving. Transfers in progress may finish within the timeout; then they
        are cut off. Once this returns, nothing served is read any more (torchft changes
        the tensors right after)."""
        self._refuse_forked("disallow_checkpoint")
        with self._cond:
            self._allowed = None
            self._disallows += 1
            self._draining = self._offered
            bound = self._offered.drain_s if self._offered is not None else None
            try:
                self._drain(None, self.timeout_s if bound is None else min(bound, self.timeout_s),
                            "disallow_checkpoint", fetches=True)
            finally:
                self._draining = None
                self._forget_fetches(lambda srv: True)

    def withdraw(self, retired: str | None = None) -> None:
        """Stop serving, then forget the offer: its step cannot be allowed again, and the
        memory it serves (a checkpointer's staged arena) is no longer held. A checkpointer
        calls this before it restages its arena and when it closes: the bytes on offer are
        about to change or be released. Transfers in progress may finish within
        ``withdraw_grace`` (not ``timeout``: a stalled receiver held the next save for all
        of it); then they are cut off, and their receivers told the step is gone.

        ``retired`` (a checkpointer that closes: why nothing will follow): until something
        is offered again, requests are answered at once (404, with that reason) instead of
        waiting their timeout for a step."""
        self._refuse_forked("withdraw")
        with self._cond:
            # Forgotten before the wait for its transfers: an allow_checkpoint() of its
            # step meanwhile (another thread) must fail, not serve an arena being refilled.
            old, self._offered = self._offered, None
            self._allowed = None
            self._retired = retired
            self._withdrawals += 1
            self._forget_fetches(lambda srv: True)
            self._cond.notify_all()  # (waiting requests learn it now)
            if old is not None:
                self._drain(old, self.withdraw_grace_s, "withdraw")
        if old is not None:
            old.close()

    @property
    def closed(self) -> bool:
        """Whether ``shutdown()`` was called: nothing can be served any more."""
        return self._closed

    def shutdown(self, wait: bool = True) -> None:
        """Stop the server and end every connection: idle keep-alives, half-sent requests
        and requests waiting for a step (answered 503) included. Transfers in progress are
        cut off; the files they send are closed only once they have stopped. This
        transport's receives in progress are cut off too (they raise
        ``CheckpointTransportError``), and later ones refused (``CheckpointClosedError``).

        In a process forked from the one that made the transport, it only closes this
        process's copy of the listening socket: the server, its thread and its
        connections are the parent's (waiting for that thread here waited forever).
        """
        if self._forked():
            self._closed = True
            with contextlib.suppress(OSError):
                self._server.socket.close()  # (the parent's copy stays open and served)
            return
        with self._cond:
            self._closed = True
            self._allowed = None
            self._cond.notify_all()  # requests waiting for a step get 503 at once
            receiving = list(self._receiving)
        for storage in receiving:
            storage.cancel("the receiving HTTPTransport was shut down (shutdown())")
        self._server.shutdown()
        self._server.server_close()
        self._server.close_connections()
        if wait:
            self._thread.join(self.timeout_s)
        with self._cond:
            old, self._offered = self._offered, None
            self._drain(None, 0.0, "shutdown")  # never close a file a transfer still sends
        if old is not None:
            old.close()

    def _forked(self) -> bool:
        return os.getpid() != self._pid

    def _refuse_forked(self, what: str) -> None:
        """Refuse a call in a forked child, before it takes a lock that a thread of the
        parent may have held at the fork."""
        if self._forked():
            raise CheckpointClosedError(
                f"{what}() in process {os.getpid()}: this HTTPTransport serves from process "
                f"{self._pid}, which this one was forked from, and its server runs there "
                "only; make a new HTTPTransport in this process")

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise CheckpointClosedError(f"{what}: this HTTPTransport was shut down; make a "
                                        "new one to serve again")

    def _drain(self, served: Served | None, grace_s: float, who: str,
               fetches: bool = False) -> None:
        """Wait up to ``grace_s`` for the transfers of ``served`` (None: of anything) to
        end (``fetches``: and the fetches ``_draining`` lets finish), then cut off the
        rest: shut their sockets (a send fails at once) and cancel checksumming; return
        once none runs. Call with ``self._cond`` held."""
        def running() -> list[tuple[socket.socket, Served]]:
            return [v for v in self._serving.values() if served is None or v[1] is served]

        def busy() -> bool:  # requests in flight, or (a disallow) fetches not ended yet
            return bool(running() or (fetches and self._fetching()))

        # A transfer whose receiver has taken no byte for STALL_S (stopped, SIGSTOPped,
        # cut off by the network) is cut off before the grace ends: disallow_checkpoint(),
        # which torchft calls on the training thread, waited all of the timeout for one
        # (60 s in its set-up). One that moves, however slowly, has the whole grace.
        deadline = time.monotonic() + grace_s
        acked: dict[socket.socket, tuple[int, float]] = {}
        cut: set[socket.socket] = set()
        while busy():
            left = deadline - time.monotonic()
            if left <= 0 or self._cond.wait_for(lambda: not busy(), min(left, 0.25)):
                break
            if grace_s <= STALL_S:
                continue
            now = time.monotonic()
            for sock, _ in running():
                n = _bytes_acked(sock)
                seen = acked.get(sock)
                if n is None or sock in cut:
                    continue
                if seen is None or seen[0] != n or not _unsent(sock):
                    # (nothing waits in the socket: the server itself is busy, e.g.
                    # checksumming a live state for its manifest; no receiver to blame)
                    acked[sock] = (n, now)
                elif now - seen[1] >= STALL_S:
                    log.warning("%s: cutting off a transfer whose receiver took nothing for "
                                "%gs", who, STALL_S)
                    cut.add(sock)
                    # (its fetch is waited for no longer either: its receiver is stuck)
                    self._fetches.pop(self._fetch_of.get(sock, ""), None)
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)
        if fetches and self._fetching():
            n = len(self._fetching())
            log.warning("%s: %d %s not end within %gs: their later requests are refused", who,
                        n, "fetch did" if n == 1 else "fetches did", grace_s)
        self._draining = None  # (from here on no request is let in: only cut off)
        if not running():
            return
        log.warning("%s: cutting off %d transfers still running after %gs", who,
                    len(running()), grace_s)
        for sock, srv in running():
            srv.cancelled.set()
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        if not self._cond.wait_for(lambda: not running(), max(10.0, self.timeout_s)):
            log.error("%s: %d transfers did not stop", who, len(running()))

    def _close_when_idle(self, served: Served) -> None:
        def close() -> None:
            with self._cond:
                self._drain(served, self.timeout_s, "serve")
            served.close()
        threading.Thread(target=close, daemon=True).start()

    def _acquire(self, step: int, sock: socket.socket, fetch: str | None = None
                 ) -> tuple[Served, int] | int | None:
        """Wait until ``step`` may be served (to ``fetch``: its own, a request of a
        fetch that began before a disallow_checkpoint that still waits for it). Returns
        the offer and the ticket to ``_release``; or the step that is served instead,
        None when nothing is on offer. ``_ClientGone`` when the client on ``sock`` hangs
        up meanwhile."""
        with self._cond:
            allowed = self._wait_allowed(sock, step, fetch)
            if self._offered is None:
                return None
            if allowed != step:
                return allowed
            ticket = next(self._tickets)
            self._serving[ticket] = (sock, self._offered)
            if fetch is not None:
                self._seen(fetch, self._offered)
                self._fetch_of[sock] = fetch
            return self._offered, ticket

    def _seen(self, fetch: str, served: Served) -> None:
        """Note a request of ``fetch`` for ``served``. Call with ``self._cond`` held."""
        if fetch not in self._fetches and len(self._fetches) >= _MAX_FETCHES:
            self._fetches.pop(min(self._fetches, key=lambda f: self._fetches[f][1]))
        self._fetches[fetch] = (served, time.monotonic())
        self._broken.pop(fetch, None)  # (it asks again: a retry, not a receiver gone)

    def _finishing(self, fetch: str | None, step: int | None) -> bool:
        """Whether ``fetch`` began on the offer a disallow_checkpoint() is draining, and
        may go on (its receiver asked or took something within STALL_S). Call with
        ``self._cond`` held."""
        seen = self._fetches.get(fetch) if fetch is not None else None
        served = self._draining
        if seen is None or served is None or seen[0] is not served or (
                served is not self._offered or served.step != step):
            return False
        now = time.monotonic()
        broke = self._broken.get(fetch) if fetch is not None else None
        if broke is not None and now - broke >= _BROKEN_GRACE_S and (
                fetch not in self._fetch_of.values()):
            return False
        return now - seen[1] < STALL_S

    def _fetching(self) -> list[str]:
        """The fetches a disallow_checkpoint() in progress waits for. Call with
        ``self._cond`` held."""
        return [f for f in self._fetches if self._finishing(f, self._offered.step)] \
            if self._draining is not None and self._offered is not None else []

    def _forget_fetches(self, which: Callable[[Served], bool]) -> None:
        for f in [f for f, (srv, _) in self._fetches.items() if which(srv)]:
            del self._fetches[f]

    def _fetch_done(self, fetch: str) -> None:
        """The receiver of ``fetch`` is done (or gave up): a disallow waits for it no
        longer."""
        with self._cond:
            if self._fetches.pop(fetch, None) is not None:
                self._cond.notify_all()

    def _wait_allowed(self, sock: socket.socket, step: int | None = None,
                      fetch: str | None = None) -> int:
        """The allowed step, once there is one; TimeoutError after the timeout,
        CheckpointClosedError once shutdown() has begun, ``_ClientGone`` once the client
        on ``sock`` has hung up (checked every ``_HANGUP_CHECK_S``: a client that gave
        up must not keep its connection slot for the rest of the timeout, or slots
        pile up until the server answers "server full" with nobody connected). Call
        with ``self._cond`` held."""
        deadline = time.monotonic() + self.timeout_s
        while self._allowed is None:
            self._check_open("serving a request")
            if self._finishing(fetch, step):
                assert step is not None
                return step
            if self._failed is not None and (self._failed[0] == step or (
                    step is None and not self._sending)):
                # (a request for "the step on offer" too, unless another send is laying
                # out its state: it waited out its whole timeout for an offer that had
                # failed, told nothing of why; a docs trial)
                raise _Retired(self._failed[1])
            if self._retired is not None:
                raise _Retired(self._retired)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            self._cond.wait(min(left, _HANGUP_CHECK_S))
            # (once allowed too: a client that gave up within the last check's interval,
            # served, would count as a fetch that the next disallow_checkpoint() waits
            # STALL_S for, on the training thread; a trial's took 10 s)
            if _hung_up(sock):
                raise _ClientGone
        return self._allowed

    def _allowed_step(self, sock: socket.socket) -> int:
        with self._cond:
            return self._wait_allowed(sock)

    def _release(self, ticket: int, fetch: str | None = None, served_whole: bool = False
                 ) -> None:
        """End a transfer; one of ``fetch`` that was ``served_whole`` counts as that
        fetch's sign of life (a cut-off one does not: its receiver may be stuck)."""
        with self._cond:
            sock, served = self._serving.pop(ticket)
            self._fetch_of.pop(sock, None)
            if served_whole and fetch is not None and fetch in self._fetches:
                self._seen(fetch, served)
            elif fetch is not None and fetch in self._fetches:
                self._mark_broken(fetch)
            self._cond.notify_all()

    def _connection_of(self, fetch: str) -> None:
        """A connection served its first request of ``fetch``."""
        with self._cond:
            self._open_conns[fetch] = self._open_conns.get(fetch, 0) + 1

    def _connection_closed(self, fetches: Iterable[str], gone: bool = True) -> None:
        """A connection that served requests of ``fetches`` closed: a fetch left with
        none open, not said done, counts as broken off (its receiver ``gone`` between
        requests: it closed the connection, not the server), as if a transfer broke."""
        with self._cond:
            for fetch in fetches:
                n = self._open_conns.pop(fetch, 1) - 1
                if n > 0:
                    self._open_conns[fetch] = n
                elif gone and fetch in self._fetches:
                    self._mark_broken(fetch)
            self._cond.notify_all()

    def _mark_broken(self, fetch: str) -> None:
        self._broken[fetch] = time.monotonic()
        if len(self._broken) > _MAX_FETCHES:  # (of fetches forgotten since)
            self._broken = {f: t for f, t in self._broken.items() if f in self._fetches}

    def _authorized(self, header: str | None) -> bool:
        if self.token is None:
            return True
        if header is None:
            return False
        # (the scheme's name is case-insensitive: RFC 9110 11.1)
        scheme, _, given = header.strip().partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode(), self.token.encode())

    # --- receiving side --------------------------------------------------------------------

    def recv_checkpoint(self, src_rank: int, metadata: str, step: StepLike,
                        timeout: timedelta | float | None = None, *, into: Any = None,
                        strict: bool = True, ignore_unexpected: bool = False,
                        exclude: str | Iterable[str] | None = None,
                        key_map: KeyMap | None = None, cast: bool = False) -> Any:
        """Fetch ``step`` from the peer at ``metadata`` (its ``address()``) within
        ``timeout`` (the whole fetch, waiting for the step to be allowed included;
        None: the transport's timeout; at most a week).

        Returns a plain tree of fresh CPU tensors, or with ``into=`` loads into that
        state in place (resharding to its layout) and returns it. ``strict`` and
        ``ignore_unexpected`` (fetch only what ``into`` holds, e.g. the model of a
        training state) as for ``AsyncCheckpointer.load``; ``exclude=["optim"]`` leaves
        those parts out (not fetched, and in ``into`` left as they are).

        Raises:
            CheckpointClosedError: after ``shutdown()``; a ``shutdown()`` during the
                receive cuts it off (``CheckpointTransportError``).
        """
        from ..loader import (
            COPIES_EXPECTED,
            check_exclude,
            check_key_map,
            excluded_view,
            load_from,
            load_reusing,
        )

        if step is None:  # (a peer serves one step: name it, as the sender offered it)
            raise CheckpointConfigError("step=None: pass the step the peer offers")
        self._refuse_forked("recv_checkpoint")
        _check_ranks(src_rank, "src_rank")
        check_flags(strict=strict, ignore_unexpected=ignore_unexpected, cast=cast)
        parts = check_exclude(exclude)
        check_key_map(key_map)
        step = as_step(step)
        t = self.timeout_s if timeout is None else fetch_timeout(timeout)
        # A receive with no target (state_dict= too: what its state lacks comes new)
        # allocates every tensor the manifest claims: the files' total is bounded as well.
        storage = HTTPStorage(metadata, step, token=self.token, timeout_s=t, deadline_s=t,
                              max_manifest_bytes=self.max_manifest_bytes,
                              max_file_bytes=self.max_file_bytes,
                              max_total_bytes=self.max_file_bytes if into is None else None)
        with self._cond:  # (under the lock: a shutdown() meanwhile cuts it off)
            if self._closed:
                storage.close_all()
                raise CheckpointClosedError(f"recv_checkpoint of step {step}: this "
                                            "HTTPTransport was shut down; make a new one")
            self._receiving.add(storage)
        reuse = None
        copies = COPIES_EXPECTED.set(True)  # (its caller hands them to load_state_dict)
        try:
            if into is None and self._state_dict is not None:
                reuse = self._state_dict()  # (torchft's Manager passes no target)
                return load_reusing(Path(f"peer-step-{step}"), reuse, storage,
                                    threads=fetch_connections(self.num_chunks), exclude=parts,
                                    key_map=key_map)
            target, _, finish = excluded_view(into, parts)
            return finish(load_from(Path(f"peer-step-{step}"), target, storage, strict=strict,
                                    ignore_unexpected=ignore_unexpected,
                                    threads=fetch_connections(self.num_chunks), exclude=parts,
                                    key_map=key_map, cast=cast))
        except CheckpointError as exc:
            raise peer_error(exc, into if reuse is None else reuse, storage) from exc.__cause__
        finally:
            COPIES_EXPECTED.reset(copies)
            with self._cond:
                self._receiving.discard(storage)
            storage.close_all()


def _check_ranks(ranks: Any, label: str) -> None:
    """Ranks HTTP does not use (the address in ``metadata`` names the peer; any peer with
    the token may fetch) are still ranks: what PGTransport takes, so that swapped
    arguments fail here as there rather than on the other transport only."""
    try:
        given = [ranks] if label == "src_rank" else list(ranks)
    except TypeError:
        raise CheckpointConfigError(f"{label}={ranks!r}: pass a list of ranks (ints)") from None
    for r in given:
        if isinstance(r, bool) or not hasattr(r, "__index__") or r.__index__() < 0:
            what = f"{label}={r!r}" if label == "src_rank" else f"{label}: {r!r}"
            raise CheckpointConfigError(
                f"{what} is not a rank (an int, 0 or more); HTTPTransport fetches from the "
                "address in metadata (the peer's address()), whatever the rank")


def _check_token(token: str | None) -> str | None:
    """An empty token is refused rather than taken as "no token": a server would then want
    "Bearer " while a client sends no header at all, so every request would get 401."""
    if token is not None and not token:
        raise CheckpointConfigError("token='': use a non-empty shared secret, or None for "
                                    "no token check")
    if token is not None and not isinstance(token, str):
        raise CheckpointConfigError(f"token: pass a str (not {type(token).__name__}); the "
                                    "token itself is not shown")
    if token is not None and not (token.isascii()
                                  and token.isprintable() and " " not in token):
        # (a header cannot carry it: a raw error at the first request, quoting the secret;
        # the usual cause is the newline a token file ends with)
        raise CheckpointConfigError(
            "token: use printable ASCII without spaces or line breaks (a token read from a "
            "file: strip its trailing newline); the token itself is not shown")
    return token


def peer_error(exc: CheckpointError, into: Any, storage: HTTPStorage) -> CheckpointError:
    """``exc`` of a fetch from a peer (``storage``), told as one: its files named by their
    URLs, not the local-looking names the loader gave them; for damaged bytes, the advice
    of a transfer (receive again), not of a checkpoint on disk (load another step); and,
    once tensor bytes were read into in-place targets (``into``), that those may hold
    part of the peer's state."""
    text = old = str(exc)
    local = f"peer-step-{storage.step}/"
    url = f"http://{storage.where}{storage.prefix}/{storage.step}/"
    text = text.replace(local + MANIFEST_NAME, url + MANIFEST_NAME).replace(local, url + "files/")
    text = text.replace(local[:-1], url[:-1])  # (the step as a whole: "cannot load ...")
    if isinstance(exc, CheckpointCorruptError) and storage.saved_view:
        # (a trial: a disk peer's damage was told the live state's send_checkpoint advice;
        # a step served whole is one from disk, or one process's staged save: no tensor
        # of a training loop changes under it)
        text = text.replace("the checkpoint is corrupt; load another step",
                            "the bytes were damaged in transit, in the peer's memory, or on "
                            "its disk (it serves a saved step: from disk, run 'asyncckpt "
                            "verify' on it there); receive them again, or from another peer")
    if isinstance(exc, CheckpointCorruptError):
        text = text.replace("the checkpoint is corrupt; load another step",
                            "the bytes were damaged in transit, in the peer's memory, or "
                            "on its disk (a peer serving a checkpoint from disk: run "
                            "'asyncckpt verify' there), or the peer changed its tensors "
                            "while it offered them (send_checkpoint's must stay as they are "
                            f"until disallow_checkpoint() returns: {uncopied_hint()}; "
                            "then every try fails until it offers again); receive them "
                            "again, or from another peer")
        text = text.replace("load another step", "receive it again, or from another peer")
    if into is not None and storage.tensor_bytes_read:
        text += ("; the targets were loaded in place and may hold part of the peer's state: "
                 "receive again before using them")
    if text == old:
        return exc
    out = retold(exc, text)
    path = getattr(out, "path", None)
    if isinstance(path, str) and path.startswith(local):
        out.path = url + ("" if path == local + MANIFEST_NAME else "files/") + path[len(local):]  # type: ignore[attr-defined]
    return out


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, addr: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 transport: HTTPTransport, max_connections: int):
        self.address_family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
        self.transport = transport
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        # Connections waiting for a request's line and headers (idle keep-alives too), by
        # handler: when their deadline passes, or a new connection needs the slot, they go.
        self._deadlines: dict[int, tuple[float, socket.socket]] = {}
        self._deadlines_lock = threading.Lock()
        self._connections: set[socket.socket] = set()  # every connection holding a slot
        super().__init__(addr, handler)
        threading.Thread(target=self._reap, name="asyncckpt-http-reaper", daemon=True).start()

    def set_deadline(self, handler: BaseHTTPRequestHandler) -> None:
        # Its own short bound, not the transport's timeout (which may be long: it bounds
        # the wait for a step): a client that says nothing must not keep its slot.
        wait = min(self.transport.timeout_s, _HEADER_WAIT_S)
        with self._deadlines_lock:
            self._deadlines[id(handler)] = (time.monotonic() + wait, handler.connection)

    def clear_deadline(self, handler: BaseHTTPRequestHandler) -> bool:
        """Lift ``handler``'s deadline; False when it was already gone: the reaper or an
        eviction took it, and has cut (or is cutting) the connection."""
        with self._deadlines_lock:
            return self._deadlines.pop(id(handler), None) is not None

    def _reap(self) -> None:
        """Close connections whose request did not arrive in time (one thread for all)."""
        tick = min(0.25, self.transport.timeout_s / 4)
        while self.socket.fileno() != -1:
            time.sleep(tick)
            now = time.monotonic()
            with self._deadlines_lock:  # (held: a handler whose request is in is not cut)
                for k in [k for k, (d, _) in self._deadlines.items() if d < now]:
                    _cut(self._deadlines.pop(k)[1])

    def _evict_idle(self) -> bool:
        """Cut the connection that has waited longest for a request, so that a new one can
        have its slot: a client that connects and says nothing, or keeps an unused
        keep-alive, must not lock authorized ones out. One with a request in (a transfer,
        or a wait for a step) is never cut. False when there is none to cut."""
        with self._deadlines_lock:
            if not self._deadlines:
                return False
            k = min(self._deadlines, key=lambda k: self._deadlines[k][0])
            _cut(self._deadlines.pop(k)[1])
        return True

    def process_request(self, request: Any, client_address: Any) -> None:
        # The cut connection's handler sees its end at once and gives its slot back.
        if not self._slots.acquire(blocking=False) and not (
                self._evict_idle() and self._slots.acquire(timeout=1.0)):
            body = (f"server full: {self.max_connections} connections are busy; retry "
                    "later").encode()
            try:
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\n%s: %s\r\nContent-Type: "
                                b"text/plain\r\nContent-Length: %d\r\nConnection: close"
                                b"\r\n\r\n%s" % (_REASON.encode(), body, len(body), body))
            except OSError:
                pass
            finally:
                self.shutdown_request(request)
            return
        with self._deadlines_lock:
            self._connections.add(request)
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread serves it (none could start): its slot is free
            with self._deadlines_lock:
                self._connections.discard(request)
            self._slots.release()
            raise

    def close_connections(self) -> None:
        """Shut every connection (call once no new one is accepted): idle and half-sent
        ones end at once, and a transfer's next send fails."""
        with self._deadlines_lock:
            self._deadlines.clear()
            for sock in self._connections:
                _cut(sock)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that hangs up mid-response is routine (a fetch retried or cancelled).
        log.debug("connection from %s ended with an error", client_address, exc_info=True)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._deadlines_lock:
                self._connections.discard(request)
            self._slots.release()


class _ClientGone(Exception):
    """The client hung up while its request waited for a step to be allowed."""


class _Retired(Exception):
    """Nothing is on offer, and nothing will be until something is offered again (the
    checkpointer that served through the transport closed): the reason, for the 404."""


def _hung_up(sock: socket.socket) -> bool:
    """Whether the client on ``sock`` has closed its end (or the connection failed), at
    once. ``poll``, not ``select``: select fails on descriptors above 1024. A client that
    sends more (a pipelined request) is still there; one that only shut its sending half
    reads as gone (an HTTP client does not)."""
    try:
        p = select.poll()
        p.register(sock, select.POLLIN)  # (POLLHUP and POLLERR come unasked)
        events = p.poll(0)
    except (OSError, ValueError):  # closed meanwhile
        return True
    if not events:
        return False
    if events[0][1] & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
        return True
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


def _cut(sock: socket.socket) -> None:
    """Shut ``sock`` both ways: its handler's read or send fails at once. (Not closed:
    its handler still owns the descriptor.)"""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


_UNREAD = b"\0unread"  # a handler's request line before it is read
_MAX_HEADER_BYTES = 64 * 1024  # a request's header lines, in all (ours send a few hundred)


class _HeaderBudget:
    """A handler's input as its headers are parsed: lines while the budget lasts, then
    http.client's LineTooLong (the handler answers 431)."""

    def __init__(self, f: Any, budget: int) -> None:
        self._f, self._left = f, budget

    def readline(self, limit: int = -1) -> bytes:
        if self._left <= 0:
            raise http.client.LineTooLong("header lines")
        line: bytes = self._f.readline(self._left + 1 if limit < 0 else min(limit,
                                                                           self._left + 1))
        self._left -= len(line)
        if self._left < 0:
            raise http.client.LineTooLong("header lines")
        return line

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Responses are a header write then body writes: without this, Nagle holds the last
    # small segment for the client's delayed ACK (~35 ms a request on loopback).
    disable_nagle_algorithm = True
    server: _Server

    def setup(self) -> None:
        super().setup()
        # a slow or silent client must not hold a thread forever
        self.connection.settimeout(self.server.transport.timeout_s)
        self._fetches: set[str] = set()  # the fetches this connection served requests of
        # The server cut it (idle past its deadline, or evicted for a new connection): its
        # receiver may be busy at home, allocating say, not gone (a review's healthy fetch
        # was cut off by the next disallow so)
        self._cut_by_server = False
        self._request_in = False

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            if self._fetches:
                self.server.transport._connection_closed(self._fetches,
                                                         gone=not self._cut_by_server)

    def handle_one_request(self) -> None:
        # The socket timeout bounds each recv, not a whole request: a client sending one
        # header byte at a time (or an idle keep-alive) would hold its slot for ever. The
        # server's reaper closes the connection if the request line and headers are not in
        # by the deadline (at most _HEADER_WAIT_S); the deadline is lifted once they are (a
        # transfer may take long). Until then a new connection may also take its slot.
        self.server.set_deadline(self)
        self._request_in = False
        self.raw_requestline = _UNREAD  # (left so by a read of the request that timed out)
        try:
            super().handle_one_request()
            if self.raw_requestline is _UNREAD:  # (the socket's timeout, the server's own)
                self._cut_by_server = True
        finally:
            if not self.server.clear_deadline(self) and not self._request_in:
                self._cut_by_server = True  # (the reaper or an eviction took its deadline)

    def parse_request(self) -> bool:
        # The request is in: from here on it is never evicted. If it was meanwhile (the
        # cut socket reads as the end of the headers), it is not served: its slot is
        # for the connection that evicted it. Its headers are read within
        # _MAX_HEADER_BYTES in all (http.client allows 100 lines of 64 KiB: a review's 64
        # unauthenticated connections, each held before the token was asked, took 470 MiB).
        rfile = self.rfile
        self.rfile = cast(Any, _HeaderBudget(rfile, _MAX_HEADER_BYTES))
        try:
            if not super().parse_request():
                return False
        finally:
            self.rfile = rfile
        if not self.server.clear_deadline(self):
            self.close_connection = True
            self._cut_by_server = True
            return False
        self._request_in = True
        if self.request_version == "HTTP/0.9":  # (no status line to refuse it with)
            self.close_connection = True
            return False
        if self.headers.defects or self.headers.get_payload():
            # A header line that is none ("Transfer-Encoding : chunked", a space before the
            # colon): the parser ended the headers there, and what follows it was served
            # as a second request (a review's smuggling); a proxy may read it as framing.
            # Refused (RFC 9112 5.1), with the connection (as every refusal but 413).
            self._refuse(400, "a malformed header line")
            return False
        lengths = self.headers.get_all("Content-Length") or ["0"]
        if self.headers.get("Transfer-Encoding") or lengths != ["0"]:
            # A body is never read here: left on the connection, it would be parsed as the
            # next request (so is a second Content-Length, a proxy's framing maybe). (The
            # token is not asked: nothing is told but this.)
            self._refuse(400, "a request here has no body")
            return False
        if not hasattr(self, "do_" + self.command):
            # A method of no name here (PROPFIND, FOO) would get the base class's 501
            # before the token is looked at: it gets what POST gets (401, else 405).
            self._not_allowed()
            return False
        return True

    def version_string(self) -> str:
        return "asyncckpt"  # (BaseHTTPRequestHandler's Server header names Python's version)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def send_error(self, code: int, message: str | None = None,
                   explain: str | None = None) -> None:
        """The refusals of http.server's own parsing (a request line or header too long,
        a malformed one): answered as every refusal here, with its reason header."""
        if self.request_version == "HTTP/0.9":  # (the default, kept by a line it refused)
            self.request_version = "HTTP/1.1"
        self._refuse(code, message or self.responses.get(code, ("error",))[0])

    def do_GET(self) -> None:
        self._handle(send_body=True)

    def do_HEAD(self) -> None:
        self._handle(send_body=False)

    def handle_expect_100(self) -> bool:
        # Never a "100 Continue": it invites a body, which no request here may have (a
        # token-holder's request with one got 100, then 400). The request is answered as
        # it stands: its final status, or 401 without the token.
        return self._token_ok()

    def _token_ok(self) -> bool:
        """Whether the request carries the token; if not, it is answered 401 here."""
        if self.server.transport._authorized(self.headers.get("Authorization")):
            return True
        self._refuse(401, "missing or wrong token", [("WWW-Authenticate", "Bearer")])
        return False

    def _not_allowed(self) -> None:
        if not self._token_ok():  # nothing is told to a client without the token
            return
        # (the connection is closed: the request's body, if any, is never read)
        self._refuse(405, f"method {self.command} not allowed: use GET or HEAD",
                     [("Allow", "GET, HEAD")])

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = _not_allowed

    def _refuse(self, code: int, why: str, headers: Sequence[tuple[str, str]] = ()) -> None:
        """Answer ``code``, and close the connection: a refused client (a wrong token, a
        bad request, a step not served) gets nothing more by staying. A 413 is the one
        refusal a client works through on the same connection (it asks for less)."""
        body = why.encode()
        self.send_response(code)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header(_REASON, " ".join(why.split()))
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        if code != 413:
            self.send_header("Connection", "close")  # sets self.close_connection
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _client_gone(self) -> None:
        """The client hung up while its request waited for a step: answer nothing, and
        close the connection (its slot comes free)."""
        log.debug("%s hung up while its request for %s waited for a step to be allowed",
                  self.address_string(), self.path)
        self.close_connection = True

    def _current(self, tr: HTTPTransport) -> None:
        """The step on offer, once one is allowed: ``{"step": N}``."""
        try:
            step = tr._allowed_step(self.connection)
        except _Retired as exc:
            return self._refuse(404, f"no step is on offer: {exc}")
        except _ClientGone:
            return self._client_gone()
        except TimeoutError:
            return self._refuse(503, f"a step {_NOT_ALLOWED} within {seconds_text(tr.timeout_s)}")
        except CheckpointClosedError:
            return self._refuse(503, f"the server {_CLOSED}")
        body = f'{{"step": {step}}}'.encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _handle(self, send_body: bool) -> None:
        # (the request is in: parse_request lifted its deadline, serving may take longer)
        tr = self.server.transport
        if not self._token_ok():
            return None
        if self.path == _CURRENT:
            return self._current(tr)
        m = _PATH.fullmatch(self.path)
        if m is None:
            return self._refuse(404, _NO_SUCH_RESOURCE)
        step, what = int(m.group(1)), m.group(2)
        fetch = self.headers.get(_FETCH)
        if fetch is not None and not _FETCH_ID.fullmatch(fetch):
            fetch = None  # (not one of ours: the request is served as one of no fetch)
        if what == "done":  # the fetch ended: a disallow waits for it no longer
            if fetch is not None:
                tr._fetch_done(fetch)
            self.send_response(204)
            self.end_headers()
            return None
        if fetch is not None and fetch not in self._fetches and len(self._fetches) < 4:
            self._fetches.add(fetch)  # (a handful: a client cycling ids gains nothing)
            tr._connection_of(fetch)
        try:
            got = tr._acquire(step, self.connection, fetch)
        except _Retired as exc:
            return self._refuse(404, f"step {step} is not being served: {exc}")
        except _ClientGone:
            return self._client_gone()
        except TimeoutError:
            return self._refuse(
                503, f"step {step} {_NOT_ALLOWED} within {seconds_text(tr.timeout_s)}")
        except CheckpointClosedError:
            return self._refuse(503, f"the server {_CLOSED}")
        if got is None:
            return self._refuse(404, f"step {step} is not being served: no step is on offer")
        if isinstance(got, int):
            return self._refuse(404, f"step {step} is not being served (step {got} is): fetch "
                                f"step {got}, or ask {_CURRENT} for the step on offer")
        served, ticket = got
        whole = False  # (whether the answer went out whole)
        try:
            if what == MANIFEST_NAME:
                try:
                    body = served.manifest()
                except StateChanged as exc:
                    return self._refuse(409, str(exc))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if send_body:
                    self.wfile.write(body)
                whole = True
                return
            source = served.files.get(what.removeprefix("files/"))
            if source is None:
                return self._refuse(404, "no such file")
            rng = self.headers.get("Range")
            if rng is None:
                lo, hi = 0, source.size
            else:
                r = _RANGE.fullmatch(rng.strip())
                if r is None:
                    return self._refuse(400, "Range must be one range: bytes=<first>-<last>, "
                                             "bytes=<first>- or bytes=-<suffix length>")
                if r.group(3) is not None:  # the last n bytes (all of a shorter file)
                    lo, hi = max(source.size - int(r.group(3)), 0), source.size
                    unsatisfiable = int(r.group(3)) == 0 or source.size == 0
                else:
                    lo = int(r.group(1))
                    hi = source.size if r.group(2) is None else int(r.group(2)) + 1
                    if lo >= hi and r.group(2) is not None:  # (a last byte before the first)
                        return self._refuse(400, "Range must be bytes=<first>-<last>, with "
                                                 "first <= last")
                    # (a last byte past the end means the rest of the file, as RFC 9110
                    # says: 416 only for a first byte that is not there)
                    unsatisfiable = lo >= source.size
                    hi = min(hi, source.size)
                if unsatisfiable:
                    return self._refuse(416, f"range outside the file ({source.size} bytes)",
                                        [("Content-Range", f"bytes */{source.size}")])
            if send_body and hi - lo > tr.max_range_bytes:  # HEAD only asks for the size
                return self._refuse(413, f"ranges are limited to {tr.max_range_bytes} bytes")
            self.send_response(206 if rng is not None else 200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(hi - lo))
            if rng is not None:
                self.send_header("Content-Range", f"bytes {lo}-{hi - 1}/{source.size}")
            self.end_headers()
            if send_body:
                source.send(self.connection, lo, hi - lo)
                if served.changed is not None and isinstance(source, LiveSource):
                    # (the receiver may fail its checksums: say why)
                    served.tell_changed(source.keys_in(lo, hi - lo))
            whole = True
        finally:
            tr._release(ticket, fetch, whole)


def _printable(text: str) -> str:
    """A peer's words as they may go into an error: control characters (a terminal's
    escapes, a forged line of a log) shown escaped."""
    return text if text.isprintable() else "".join(
        c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


# The server's 404 for a path it does not know (not /v1/...)
_NO_SUCH_RESOURCE = "no such resource"
# The server's 404 for a step it does not serve (see _Handler._handle): which it does.
_SERVED_INSTEAD = re.compile(r"step \d+ is not being served \(step (\d+) is\)")


def _unsent(sock: socket.socket) -> int:
    """The bytes in ``sock``'s send queue, sent or not but not yet acknowledged (Linux's
    SIOCOUTQ); 0 where that cannot be read."""
    try:
        import fcntl
        import termios

        got = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except (OSError, ImportError, AttributeError, ValueError):
        return 0
    return int(struct.unpack("i", got)[0])


def _bytes_acked(sock: socket.socket) -> int | None:
    """How many bytes the receiver on ``sock`` has acknowledged (Linux's TCP_INFO
    ``tcpi_bytes_acked``); None where that cannot be read (another system, a kernel before
    4.1, a socket that is no TCP one)."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    except (OSError, AttributeError, ValueError):
        return None
    if len(info) < _ACKED_AT + 8:
        return None
    return int(struct.unpack_from("=Q", info, _ACKED_AT)[0])


class _RangeTooLarge(Exception):
    """The server answered 413: the range is above its max_range_bytes."""


class _Stream:
    """A range response a client thread reads on: bytes [pos, end) of file ``name`` are
    still to come."""

    __slots__ = ("ahead", "end", "name", "pos", "resp")

    def __init__(self, name: str, pos: int, end: int, resp: http.client.HTTPResponse,
                 ahead: int):
        self.name, self.pos, self.end, self.resp, self.ahead = name, pos, end, resp, ahead


def _discard(resp: http.client.HTTPResponse, n: int) -> None:
    """Read ``n`` bytes of ``resp`` and drop them."""
    while n > 0:
        got = len(resp.read(min(n, _MiB)))
        if not got:
            raise http.client.IncompleteRead(b"", n)
        n -= got


class HTTPStorage:
    """ReadStorage over a peer's HTTP server. Thread-safe: one connection per thread.

    ``timeout_s`` bounds every wait on the network (a stalled peer); ``deadline_s``, when
    given, bounds the whole fetch: once it has passed, a watchdog shuts every connection,
    so that a peer trickling bytes just fast enough to beat the stall timeout cannot hold
    the receiver for ever. Call ``close_all()`` when done (it also stops the watchdog).

    ``max_file_bytes`` bounds each file the peer's manifest claims, ``max_total_bytes``
    (for a load with no target, which allocates every tensor it claims) their total; a
    manifest over either is refused once parsed, before the load allocates anything.
    None: no limit. Named ``max_file_bytes=`` in the errors: HTTPTransport's option.
    """

    peer_view = True
    """A peer serves the boxes it holds: a manifest marked partial is read as such."""

    def __init__(self, base: str, step: int, *, token: str | None, timeout_s: float,
                 retries: int = 3, deadline_s: float | None = None,
                 max_manifest_bytes: int = PEER_MAX_MANIFEST_BYTES,
                 max_file_bytes: int | None = DEFAULT_MAX_FILE_BYTES,
                 max_total_bytes: int | None = None, timeout_told: float | None = None):
        try:
            u = urlsplit(base)
            port = u.port
        except ValueError as exc:  # a port out of range, a broken IPv6 literal
            raise CheckpointConfigError(f"{base!r} is not an http:// address of a peer: "
                                        f"{exc}") from None
        if u.scheme != "http" or not u.hostname:
            raise CheckpointConfigError(f"{base!r} is not an http:// address of a peer")
        self.host, self.port = u.hostname.replace("%25", "%"), port or 80  # (an IPv6 zone)
        self.prefix = u.path.rstrip("/")
        self.step = step
        self.timeout_s = timeout_s
        self.retries = retries
        token = _check_token(token)
        self._headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        # every request names the fetch: a disallow_checkpoint() lets it finish
        self._fetch_id = secrets.token_hex(8)
        self._headers[_FETCH] = self._fetch_id
        self._said_done = False
        self._local = threading.local()
        self._names: list[str] = []
        self._sizes: dict[str, int] = {}  # by file name: a file is opened more than once
        self._conns: list[http.client.HTTPConnection] = []
        # Every socket a connection of this fetch opened, for the deadline's watchdog to
        # shut: a response that closes its connection (HTTP/1.0, "Connection: close")
        # takes the socket over and leaves the connection's ``sock`` None.
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._max_range = 1 << 62  # lowered when the server answers 413
        self.saved_view = False  # the peer serves a saved step whole (see check_manifest)
        # The timeout the caller passed, as errors quote it: a fetch begun again within
        # what was left of it (the step on offer moved on) told "0.078 s"
        self._told_s = timeout_told if timeout_told is not None else deadline_s
        self._ends_at = None if deadline_s is None else time.monotonic() + deadline_s
        self.max_manifest_bytes = max_manifest_bytes
        self.max_file_bytes = check_max_file_bytes(max_file_bytes)
        self.max_total_bytes = check_max_file_bytes(max_total_bytes, "max_total_bytes")
        self._expired = False
        self._cancelled: str | None = None  # why ``cancel()`` cut the fetch off
        self._cancel = threading.Event()  # set with it: pauses between requests end
        self._answered = False  # the peer has answered a request of this fetch
        self._closed = threading.Event()
        self.tensor_bytes_read = False
        """Set once a read of tensor bytes (into the load's targets) has started."""
        if deadline_s is not None:
            threading.Thread(target=self._watch, args=(deadline_s,), daemon=True,
                             name="asyncckpt-http-deadline").start()

    def _watch(self, deadline_s: float) -> None:
        """Once the fetch has run out of time, cut its connections until it is closed
        (again and again: a thread may be opening a new one meanwhile); the threads
        reading on them fail and raise the timeout."""
        if self._closed.wait(deadline_s):
            return
        with self._lock:  # (under the lock: ``_connect`` then cuts what it opens later)
            self._expired = True
        while True:
            with self._lock:
                socks = [s for s in self._socks if s.fileno() != -1]
            for sock in socks:
                _cut(sock)
            if self._closed.wait(0.1):
                return

    def cancel(self, why: str) -> None:
        """Cut the fetch off from another thread: shut its connections; its threads then
        raise ``CheckpointTransportError`` saying ``why``. Thread-safe."""
        with self._lock:
            self._cancelled = why
            socks = [s for s in self._socks if s.fileno() != -1]
        self._cancel.set()
        for sock in socks:
            _cut(sock)

    def interrupt(self) -> None:
        """The load failed (bad bytes in one thread's range): shut every connection of
        the fetch, so that threads blocked reading from a peer that also stalls fail at
        once instead of at the deadline (their errors are not the one the load raises).
        Thread-safe."""
        self.cancel("another read of this fetch failed")

    def _check_cancelled(self) -> None:
        if self._cancelled is not None:
            raise CheckpointTransportError(
                f"fetching step {self.step} from {self._peer} was cut off: {self._cancelled}")

    def _check_deadline(self) -> None:
        """Raise the timeout error once the whole fetch's deadline has passed (or the
        error of ``cancel()``, once it was called)."""
        self._check_cancelled()
        if self._expired:
            raise self._timed_out()

    def _timed_out(self) -> CheckpointTimeoutError:
        return CheckpointTimeoutError(
            f"fetching {f'step {self.step}' if self.step >= 0 else 'the current step'} "
            f"from {self._peer} did not end within its timeout of "
            f"{seconds_text(self._told_s)}: the timeout is too short for this state's "
            "size over this network (pass a larger one), or the peer stalls or sends too "
            "slowly")

    def _unanswered(self, what: str, slack: float = 0.0) -> None:
        """Raise the timeout error of a request (``_url``'s ``what``) that was sent and
        whose answer had not begun when the fetch's deadline passed (or was ``slack``
        seconds away): the peer did not serve the step, rather than sent it too slowly.
        Having answered earlier requests of this fetch, it holds this one back because the
        step was withdrawn meanwhile (a server waits for the step to be allowed again)."""
        self._check_cancelled()
        if not (self._expired or (
                self._ends_at is not None and time.monotonic() >= self._ends_at - slack)):
            return
        if self._answered:
            raise CheckpointTimeoutError(
                f"{self._peer} answered this fetch's first requests of step {self.step}, then "
                f"not {self._url(what)} within the fetch's timeout of "
                f"{seconds_text(self._told_s)}: it withdrew the step (disallow_checkpoint(), "
                "or the next save of a checkpointer serving it) and did not allow it again, "
                "or is stuck; fetch again (the step it serves now: /v1/current)")
        if what == "current":
            raise CheckpointTimeoutError(
                f"{self._peer} did not say which step it serves within the fetch's timeout "
                f"of {seconds_text(self._told_s)}: it allows none (not yet, or it was "
                "withdrawn), or is stuck; pass a larger timeout to wait longer")
        checksumming = (", or is still checksumming the live state it serves (the first "
                        "answer of a send_checkpoint waits for that: seconds for GBs)"
                        if what == MANIFEST_NAME else "")
        raise CheckpointTimeoutError(
            f"{self._peer} did not answer the request for step {self.step} "
            f"({self._url(what)}) within the fetch's timeout of "
            f"{seconds_text(self._told_s)}: it is not serving that step (not allowed yet, "
            f"or withdrawn){checksumming}, or is stuck; pass a larger timeout to wait longer")

    def _conn(self, fresh: bool = False) -> http.client.HTTPConnection:
        c: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if c is None or fresh:
            self._drop_conn()
            # (not cut by the deadline's watchdog until connected: bounded by what is left)
            c = http.client.HTTPConnection(self.host, self.port, timeout=self._time_left())
            self._local.conn = c
            with self._lock:
                self._conns.append(c)
            self._check_deadline()
        return c

    def _time_left(self) -> float:
        """A socket timeout for this fetch: ``timeout_s``, but no longer than what is left
        of the whole fetch's deadline."""
        if self._ends_at is None:
            return self.timeout_s
        return max(0.01, min(self.timeout_s, self._ends_at - time.monotonic()))

    def _connect(self, conn: http.client.HTTPConnection) -> None:
        """Connect ``conn`` here rather than let http.client do it inside ``request``, to
        record its socket for the deadline's watchdog (``conn.sock`` does not keep it:
        a response that closes the connection takes the socket over)."""
        conn.timeout = self._time_left()  # (a reconnection too: bounded by what is left)
        conn.connect()
        sock = conn.sock
        with self._lock:
            self._socks = [s for s in self._socks if s.fileno() != -1]  # closed ones go
            self._socks.append(sock)
            cut = self._expired or self._cancelled is not None
        if cut:  # opened after the watchdog's last round (or cancel()'s): cut here
            _cut(sock)

    def _not_allowed(self, what: str, answer: str, deadline: float, slack: float = 0.0
                     ) -> None:
        """Raise the timeout error of a request (``_url``'s ``what``) that the peer
        answered with 503 "not allowed" (``answer``) until ``deadline`` (or ``slack``
        seconds before it), once that has passed."""
        self._check_cancelled()
        if not (self._expired or time.monotonic() >= deadline - slack):
            return
        waited = self._told_s if self._told_s is not None else self.timeout_s
        step = "any step" if what == "current" else f"step {self.step}"
        raise CheckpointTimeoutError(
            f"{self._peer} did not allow {step} within the fetch's timeout of "
            f"{seconds_text(waited)} (its last answer to {self._url(what)}: 503 {answer!r}): "
            "it is not serving it (not yet, or it was withdrawn); pass a larger timeout to wait "
            "longer")

    def _url(self, what: str) -> str:
        if what == "current":
            return f"{self.prefix}/current"
        return f"{self.prefix}/{self.step}/{what}"

    def current_step(self) -> int:
        """The step the peer offers (waits until it allows one)."""
        resp = self._request("GET", "current", {})
        body = self._read_body(resp, 256, "the current step", exact=False)
        try:
            step = json.loads(body)["step"]
            if type(step) is not int or not 0 <= step <= MAX_STEP:
                raise TypeError(f"step {step!r:.40} is not a step number")
            return step
        except (ValueError, KeyError, TypeError) as exc:
            self._check_deadline()  # (cut off at the deadline, trickling: a timeout)
            raise CheckpointTransportError(f"{self.where} answered {body[:80]!r} for "
                                           "the current step") from exc

    def _request(self, method: str, what: str, headers: dict[str, str]
                 ) -> http.client.HTTPResponse:
        """Send one request, retrying on connection failures; raise on refusals.

        A 503 from a full server is not a failure but a wait: the request is sent again
        after a pause (exponential with jitter, 50 ms doubling to 1 s) until the timeout,
        so that receivers beyond the server's max_connections get their turn as others
        end, rather than all failing at once. So is a 503 "not allowed": the server waited
        its own timeout for the step to be allowed, the fetch waits up to its own."""
        self._drop_stream()  # the connection must be done with any earlier response
        deadline = time.monotonic() + self.timeout_s
        if self._ends_at is not None:
            deadline = min(deadline, self._ends_at)
        last: Exception | None = None
        attempt = 0
        pause = _BACKOFF_FIRST_S
        full = False  # the last answer was a 503 "server full"
        refused: str | None = None  # the peer's last 503 "not allowed", if any
        while attempt <= self.retries:
            if refused is not None:
                self._not_allowed(what, refused, deadline)
            self._check_deadline()
            if time.monotonic() > deadline:
                if self._ends_at is not None and time.monotonic() >= self._ends_at:
                    # (the fetch's time is up; its watchdog may not have said so yet: it
                    # ended with "failed after 4 attempts: None")
                    if not self._answered:
                        self._unanswered(what)
                    raise self._timed_out()
                break
            sent = False  # then its answer is awaited: a deadline hit here is no stall
            try:
                conn = self._conn(fresh=attempt > 0)
                if conn.sock is None:  # new, or closed by the peer after its last answer
                    self._connect(conn)
                conn.request(method, self._url(what), headers={**self._headers, **headers})
                sent = True
                resp = conn.getresponse()
            except TimeoutError:
                if sent and refused is not None:
                    self._not_allowed(what, refused, deadline, slack=0.1)
                if sent:  # (the socket's timeout ends with the fetch's: whichever is first)
                    self._unanswered(what, slack=0.1)
                self._check_deadline()
                raise CheckpointTimeoutError(
                    f"{self.where} sent nothing for {seconds_text(self.timeout_s)} on "
                    f"{self._url(what)}: the peer is not serving step {self.step} yet, or "
                    "is stuck") from None
            except (OSError, http.client.HTTPException) as exc:
                if sent and refused is not None:
                    self._not_allowed(what, refused, deadline)
                if sent:  # (the deadline's watchdog cuts the connection: that ends it too)
                    self._unanswered(what)
                last, full = exc, False
                attempt += 1
                continue
            if resp.status in (200, 206):
                self._answered = True
                return resp
            try:
                body = resp.read(4096).decode(errors="replace")
            except (OSError, http.client.HTTPException) as exc:
                last = exc
                attempt += 1
                continue
            reason = resp.getheader(_REASON)
            if reason is None and resp.status < 500:  # (a proxy's 502/503/504 may pass)
                self._answered = True
                text = " ".join(body.split())
                raise CheckpointTransportError(
                    f"http://{self.where}{self._url(what)} answered HTTP {resp.status} "
                    f"{resp.reason} without asyncckpt's {_REASON} header: something other "
                    "than an asyncckpt peer answered (another server, or a proxy in between); "
                    "check the address (HTTPTransport.address() or 'asyncckpt serve' prints "
                    "it, ending in /v1)"
                    + (f"; its answer began: {_printable(text[:160])}" if text else ""))
            # (the answer to a HEAD, asking a file's size, has the reason in a header only)
            body = _printable(body or reason or "")
            if resp.status == 503 and _NOT_ALLOWED in body:
                # Not an answer for the step (``_unanswered`` still applies): ask again
                # until the fetch's own deadline.
                refused = body
                left = deadline - time.monotonic()
                if left > 0:
                    self._cancel.wait(min(left, pause * random.uniform(0.5, 1.0)))
                    pause = min(2 * pause, _BACKOFF_MAX_S)
                continue
            self._answered = True
            where = f"http://{self.where}{self._url(what)}"
            if resp.status == 401:
                raise CheckpointTransportError(
                    f"{where}: refused (401): {body}; "
                    + ("both sides need the same token" if "Authorization" in self._headers
                       else "the peer requires a token, and none was given: pass token= "
                       "(the peer's shared secret)"))
            if resp.status == 404:
                moved = _SERVED_INSTEAD.match(body)
                if moved is not None:
                    # (the server's words are the wire's: a trial's Python caller was told
                    # to ask /v1/current)
                    raise StepNotOffered(f"{where}: " + body.replace(
                        f"ask {_CURRENT} for the step on offer", "load the peer's address "
                        "with no step (asyncckpt.load(address, state)) for the step on offer; "
                        "the error's .offered holds it"), int(moved.group(1)))
                if not self.prefix.endswith("/v1"):  # (the server knows /v1/... only)
                    hint = (f"; a peer's address ends in /v1 (http://{self.where}/v1, as "
                            "HTTPTransport.address() gives it)")
                    if body == _NO_SUCH_RESOURCE:  # (no step to wait for: no retrying)
                        raise CheckpointConfigError(f"{where}: {body}{hint}")
                    body += hint  # (a proxy in front may map its own path to /v1)
                raise CheckpointNotFoundError(f"{where}: {body}")
            if resp.status == 413 and "Range" in headers:
                raise _RangeTooLarge(body)
            last = CheckpointTransportError(f"{where}: HTTP {resp.status}: {body}")
            if resp.status < 500:
                raise last
            full = resp.status == 503 and _CLOSED not in body
            if full:  # wait for a free slot
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cancel.wait(min(left, pause * random.uniform(0.5, 1.0)))
                pause = min(2 * pause, _BACKOFF_MAX_S)
                continue
            attempt += 1
        if full:  # out of time, as a receive whose server never answers
            raise CheckpointTimeoutError(
                f"fetching {self._url(what)} from {self.where}: the server stayed "
                f"full for {seconds_text(self.timeout_s)}: {last}") from last
        gone = (" (nothing listens there: the peer shut its server down or exited, or "
                "the address is wrong)" if isinstance(last, ConnectionRefusedError) else
                " (its host does not resolve here: where the peer advertises a name only it "
                "knows, give its HTTPTransport advertise_host= a name or address this "
                "machine reaches)" if isinstance(last, socket.gaierror) else "")
        raise CheckpointTransportError(
            f"fetching {self._url(what)} from {self.where} failed after "
            f"{self.retries + 1} attempts: {last}{gone}") from last

    # ReadStorage -------------------------------------------------------------------------

    def listdir(self, path: Path) -> list[str]:
        return [MANIFEST_NAME]

    def read_bytes(self, path: Path, limit: int) -> bytes:
        resp = self._request("GET", MANIFEST_NAME, {})
        n = self._length(resp, MANIFEST_NAME)
        limit = min(limit, self.max_manifest_bytes)
        if n > limit:
            resp.close()
            raise CheckpointTransportError(
                f"{self._peer}: the manifest is {n} bytes, above the limit of {limit} "
                "(max_manifest_bytes=); refused before reading it")
        return self._read_body(resp, n, "the manifest")

    def check_manifest(self, manifest: Manifest) -> None:
        """Refuse a manifest of another step than the one asked for (the loader calls
        this once it has parsed it): the peer must answer ``/v1/<step>/manifest.json``
        with that step's manifest, or 404."""
        self.saved_view = not manifest.partial  # (a step's whole manifest: see peer_error)
        if manifest.step != self.step:
            url = self._url(MANIFEST_NAME)
            raise CheckpointCorruptError(
                f"{self._peer}: the manifest it served at {url} is of step {manifest.step}, "
                f"not of the requested step {self.step}: the peer is broken or not an "
                "asyncckpt server; fetch from another peer",
                path=f"http://{self.where}{url}")
        self._check_sizes(manifest)

    def _check_sizes(self, manifest: Manifest) -> None:
        """Refuse a manifest claiming more file bytes than this receiver accepts: before
        the load allocates the tensors it claims (sizes a peer chooses: a manifest of
        78 KB claimed a 16 GiB tensor, and the receiver reserved it)."""
        files = manifest.files
        if not files:
            return
        raise_it = ("if the peer's shards are that large, raise the limit "
                    "(max_file_bytes= of the HTTPTransport, or of asyncckpt.load(address, "
                    "...); None: no limit)")
        big = max(files.values(), key=lambda e: e.bytes)
        limit = self.max_file_bytes
        if limit is not None and big.bytes > limit:
            raise CheckpointTransportError(
                f"{self._peer}: its manifest of step {self.step} claims the shard file "
                f"http://{self.where}{self._url('files/' + big.name)} is {_size(big.bytes)}, "
                f"above this receiver's limit of {_size(limit)} (max_file_bytes=); refused "
                f"before any tensor is allocated: {raise_it}")
        limit = self.max_total_bytes
        total = sum(e.bytes for e in files.values())
        if limit is not None and total > limit:
            raise CheckpointTransportError(
                f"{self._peer}: its manifest of step {self.step} claims {len(files)} shard "
                f"files of {_size(total)} in all (the largest "
                f"http://{self.where}{self._url('files/' + big.name)}, {_size(big.bytes)}), "
                f"above this receiver's limit of {_size(limit)} (max_file_bytes=), which a "
                "receive with no target (it allocates every tensor they hold) applies to "
                f"their total; refused before any tensor is allocated: {raise_it}")

    @property
    def where(self) -> str:
        """``host:port``, an IPv6 address in brackets (``[::1]:8000``, not ``::1:8000``)."""
        host = self.host
        if ":" in host:
            host = "[" + host.replace("%", "%25") + "]"
        return f"{host}:{self.port}"

    @property
    def _peer(self) -> str:
        return f"the peer {self.where}"

    def _length(self, resp: http.client.HTTPResponse, what: str) -> int:
        """The body length a response announces; a response without one is refused."""
        if resp.length is None or resp.chunked:
            resp.close()
            raise CheckpointTransportError(
                f"{self._peer} answered {what} without a Content-Length (chunked or "
                "unbounded): not an asyncckpt server?")
        return resp.length

    def _read_body(self, resp: http.client.HTTPResponse, n: int, what: str, *,
                   exact: bool = True) -> bytes:
        """Up to ``n`` bytes of a response's body (exactly ``n`` when ``exact``), with
        the transport's errors: a stalled or broken peer never surfaces as a raw error."""
        try:
            body = resp.read(n)
        except TimeoutError:
            self._check_deadline()
            raise CheckpointTimeoutError(
                f"{self._peer} stalled for {seconds_text(self.timeout_s)} sending {what}") from None
        except (OSError, http.client.HTTPException) as exc:
            self._check_deadline()
            raise CheckpointTransportError(
                f"{self._peer} broke off {what}: {type(exc).__name__}: {exc}") from exc
        if exact and len(body) != n:
            self._check_deadline()
            raise CheckpointTransportError(
                f"{self._peer} sent {len(body)} of the {n} bytes of {what}, then closed the "
                "connection (it died, or shut down, in the middle of its answer): receive "
                "again, from it once it serves again or from another peer")
        return body

    def open_read(self, path: Path) -> int:
        with self._lock:
            self._names.append(path.name)
            return len(self._names) - 1

    def close(self, fd: int) -> None:
        # A range this thread will not read further keeps the server's handler sending
        # it, holding a connection slot until the server's send times out: on a full
        # server, other receivers would wait for that. (Never raises: the loader calls
        # it in a ``finally``.)
        st: _Stream | None = getattr(self._local, "stream", None)
        if st is not None and st.name == self._names[fd]:
            self._drop_stream()

    def abort(self, fd: int) -> None:
        """Close ``fd`` after a failed read (bad bytes, another thread's failure): the
        rest of this thread's range is not read, its connection is dropped. Reading it
        to keep the connection would wait on a peer that may have stalled, up to the
        fetch's deadline, and hide the failure behind a timeout."""
        st: _Stream | None = getattr(self._local, "stream", None)
        if st is not None and st.name == self._names[fd]:
            self._drop_stream(keep=False)

    def file_size(self, fd: int) -> int:
        name = self._names[fd]
        size = self._sizes.get(name)
        if size is None:
            resp = self._request("HEAD", f"files/{name}", {})
            self._read_body(resp, 0, f"the size of files/{name}")
            raw = resp.getheader("Content-Length") or ""
            if not _SIZE.fullmatch(raw):  # ASCII digits: str.isdigit() takes "²" too
                raise CheckpointTransportError(
                    f"{self._peer} gave files/{name} the size {raw!r:.40}: not an asyncckpt "
                    "server?")
            size = self._sizes[name] = int(raw)
        return size

    def pread_into(self, fd: int, views: Sequence[memoryview], offset: int) -> int:
        """Read into ``views`` from ``offset``: straight from the socket into their memory.

        Each thread reads from one open range response (a stream) as long as its reads go
        on sequentially, which is how the loader reads: no request per tensor, and no
        read-ahead buffer to copy out of. A broken stream is retried on a fresh connection.
        """
        total = sum(len(v) for v in views)
        if total == 0:
            return 0
        if offset > 0:
            # Byte 0 starts the header, which a load reads (to check it) before anything
            # else; every later read is of tensor bytes.
            self.tensor_bytes_read = True
        for attempt in range(self.retries + 1):
            try:
                return self._fetch(fd, views, offset)
            except CheckpointError:
                self._drop_stream(keep=False)  # (a failed stream is not read on)
                raise
            except TimeoutError:  # a stall, not a broken connection: retrying waits again
                self._drop_stream(keep=False)
                self._check_deadline()
                raise CheckpointTimeoutError(
                    f"{self._peer} stalled for {seconds_text(self.timeout_s)} sending "
                    f"files/{self._names[fd]} at byte {offset}") from None
            except (OSError, http.client.HTTPException) as exc:
                self._drop_stream(keep=False)
                self._check_deadline()
                if attempt == self.retries:
                    raise CheckpointTransportError(
                        f"the peer {self.where} broke off files/{self._names[fd]} "
                        f"at byte {offset}: {exc}") from exc
        raise AssertionError("unreachable")

    def _fetch(self, fd: int, views: Sequence[memoryview], offset: int) -> int:
        end = offset + sum(len(v) for v in views)
        pos = offset
        for v in views:
            done = 0
            while done < len(v):
                st = self._stream_at(fd, pos, end - pos)
                k = min(len(v) - done, st.end - st.pos)
                part = v[done:done + k]
                got = 0
                while got < k:
                    n = st.resp.readinto(part[got:])
                    if not n:
                        raise http.client.IncompleteRead(b"", k - got)
                    got += n
                st.pos += k
                done += k
                pos += k
        return end - offset

    def _stream_at(self, fd: int, pos: int, need: int) -> _Stream:
        """This thread's stream, positioned at ``pos`` of file ``fd``; a new range request
        when there is none there. Ranges grow while a thread reads on from where its last
        one ended (as TCP's slow start does), so a sequential reader makes few requests and
        one that jumps around asks for little it will not read."""
        st: _Stream | None = getattr(self._local, "stream", None)
        name = self._names[fd]
        if st is not None and st.name == name and st.pos <= pos < st.end \
                and pos - st.pos <= _SKIP:
            if pos > st.pos:  # a small gap (alignment, a tensor not wanted): read past it
                _discard(st.resp, pos - st.pos)
                st.pos = pos
            return st
        ahead = _STREAM_FIRST
        if st is not None:
            if st.name == name and st.pos == st.end == pos:
                ahead = min(2 * st.ahead, _STREAM_MAX)
            self._drop_stream()
        size = self.file_size(fd)
        what = f"files/{name}"
        while True:
            n = max(1, min(max(need, ahead), size - pos, self._max_range))
            try:
                resp = self._request("GET", what, {"Range": f"bytes={pos}-{pos + n - 1}"})
            except _RangeTooLarge:
                # The server bounds its ranges below what we asked for: ask for halves.
                if n <= _MIN_RANGE:
                    raise CheckpointTransportError(
                        f"{self.where} refuses even {n}-byte ranges") from None
                with self._lock:
                    self._max_range = min(self._max_range, max(_MIN_RANGE, n // 2))
                continue
            got = resp.getheader("Content-Range") or ""
            if resp.length != n or not got.startswith(f"bytes {pos}-{pos + n - 1}/"):
                resp.close()
                self._conn(fresh=True)
                raise CheckpointTransportError(
                    f"{self.where} answered {resp.length} bytes ({got!r}) for the "
                    f"range {pos}-{pos + n - 1} of {what}")
            st = self._local.stream = _Stream(name, pos, pos + n, resp, ahead)
            return st

    def _drop_stream(self, keep: bool = True) -> None:
        """Forget this thread's stream. With ``keep``, a stream with a few bytes left is
        read to its end so that its connection can be reused; otherwise its connection
        is closed (the next request opens a new one). Never raises."""
        st: _Stream | None = getattr(self._local, "stream", None)
        if st is None:
            return
        self._local.stream = None
        left = st.end - st.pos
        if left == 0:
            return
        if keep and left <= _SKIP:
            try:
                _discard(st.resp, left)
                return
            except (OSError, http.client.HTTPException):
                pass
        with contextlib.suppress(OSError):
            st.resp.close()  # (a response that closes its connection holds the socket alone)
        self._drop_conn()

    def _drop_conn(self) -> None:
        """Close this thread's connection; its next request opens a new one."""
        c: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        self._local.conn = None
        if c is not None:
            with self._lock:
                c.close()
                with contextlib.suppress(ValueError):
                    self._conns.remove(c)

    def close_all(self) -> None:
        # (a fetch cut off by a failed read, or by a shutdown() here, says it too: the
        # peer's disallow_checkpoint() would wait STALL_S for it; not once its time is up)
        if self._answered and not self._expired and not self._said_done:
            self._said_done = True
            if self._cancelled is None:
                self._say_done()
            else:  # (cut off: the caller's error must not wait on a peer that may be stuck)
                self._drop_stream(keep=False)
                threading.Thread(target=self._say_done, kwargs={"reuse": False}, daemon=True,
                                 name="asyncckpt-http-done").start()
        self._closed.set()
        with self._lock:
            for c in self._conns:
                c.close()
            self._conns.clear()

    def _say_done(self, reuse: bool = True) -> None:
        """Tell the peer this fetch is over, so that a disallow_checkpoint() there waits
        for it no longer: on this thread's connection where it is free (``reuse``), else
        on a new one; best effort, ``_DONE_WAIT_S`` in all (a peer that is gone or stuck,
        or of a version that knows no such request, answers nothing that matters). The
        bound is a timer that shuts every socket of it: a socket's timeout bounds each
        read alone, and a review's hostile peer, trickling its answer's headers a byte at
        a time, held a load 30 s past its 3 s timeout."""
        ends = time.monotonic() + _DONE_WAIT_S
        socks: list[socket.socket] = []
        lock = threading.Lock()
        over = [False]

        def cut_all() -> None:
            with lock:
                over[0] = True
                mine = list(socks)
            for sock in mine:
                _cut(sock)

        def watch(sock: socket.socket) -> None:
            with lock:
                socks.append(sock)
                late = over[0]
            if late:
                _cut(sock)

        def ask(c: http.client.HTTPConnection) -> bool:
            left = ends - time.monotonic()
            if left <= 0:
                return False
            try:
                # (connected here, not by request(), which reconnects a connection whose
                # socket was closed with its own timeout, unwatched)
                c.timeout = left
                if c.sock is None:
                    c.connect()
                sock: socket.socket = c.sock
                sock.settimeout(left)
                watch(sock)
                c.request("GET", self._url("done"), headers=self._headers)
                c.getresponse().read(4096)
                return True
            except (OSError, http.client.HTTPException) as exc:
                log.debug("telling %s that fetch %s is over failed: %s", self.where,
                          self._fetch_id, exc)
                return False

        timer = threading.Timer(_DONE_WAIT_S, cut_all)
        timer.daemon = True
        timer.start()
        try:
            if reuse:
                self._drop_stream(keep=True)
                conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
                if conn is not None and ask(conn):
                    return
            new = http.client.HTTPConnection(self.host, self.port, timeout=_DONE_WAIT_S)
            try:
                ask(new)
            finally:
                new.close()
        finally:
            timer.cancel()
