"""Ranks, the Store-based completion protocol, and who writes what.

Every cross-rank exchange goes through torch.distributed's key-value Store with JSON
values: no collective ever runs on the training process group from a background
thread, and nothing received is unpickled. Every wait has a timeout whose error
names the ranks that did not answer.

Per save, under ``asyncckpt/<namespace>/n<save number>/``:

- ``layout/<rank>``: the step and the digest of the rank's local layout, on the
  training thread. When a digest is new, the full item list was put under
  ``asyncckpt/<namespace>/items/<rank>/<digest>`` first.
- ``go``: the coordinator's answer once every rank's ``layout`` is in (the one barrier
  of a save): the nonce that names the step's temporary directory and the id of the
  group's layout, or why the save cannot start. The coordinator alone reads the
  others' layouts (when a digest changed, their item lists too, to choose the writers
  of replicated boxes) and posts each rank's share under
  ``asyncckpt/<namespace>/share/<layout id>/<rank>``; a rank reads only the ``go`` and,
  when the layout id is new to it, its own share. A save thus costs the Store O(world
  size) reads, not O(world size²), and a rank's first save reads its own layout's size.
- ``record/<rank>``: what the rank writes (file, chunks, checksums), or its error. Put
  once its bytes are hashed, long before they are durable, so that the coordinator
  merges the manifest while the shard files are still being written. Whole at a rank's
  first save and whenever its layout changed; otherwise only its checksums (and what
  changed of its skeleton): see ``reports``.
- ``done/<rank>``: that the rank's shard file is durable, or its error.
- ``decision``: claimed once, atomically (``compare_set``): "commit" by the coordinator
  just before its rename, or why not by a peer that gave up waiting for the verdict.
  Whoever claims first decides, so a late commit never meets a rank that already
  reported the save failed.
- ``verdict``: the coordinator's "ok" after the commit, or the error that aborted it.
- ``beat/<rank>``: a count the rank moves about once a second while it makes progress:
  writes, copies into host memory, or waits on other ranks (a wait that itself times
  out); and what it is doing (see Pulse). A wait counts a rank whose count moves as
  alive, so its timeout names only ranks that went silent or stuck (saying what they
  were doing), not ones that are merely slower.
- ``abort``: why the save failed, posted by the first rank whose part failed; the others
  notice within about a second and stop their writes instead of finishing them.

The namespace pairs the checkpointers of one directory across ranks: the directory's
absolute path and how many checkpointers of it this rank has saved with before
(counted in the Store: ``asyncckpt/sessions/<dir hash>/<rank>``). It is chosen by the
first save, not by the constructor, so a checkpointer one rank opens only to load or
list steps pairs with nothing. ``asyncckpt/where/<dir hash>/<rank>`` says which
namespace a rank joined last (per directory), for the error of a wait that never meets
its peers.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import logging
import numbers
import os
import re
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ._gc import gc_paused, gc_resumed
from .boxes import tiling_problem
from .errors import (
    CheckpointConfigError,
    CheckpointError,
    CheckpointInFlightError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    CheckpointTimeoutError,
    few,
    seconds_text,
)
from .loader import Finding
from .manifest import Chunk, FileEntry, Manifest, TensorEntry
from .tree import dtype_from_name, iter_array_nodes, merge_skeletons

log = logging.getLogger(__name__)

Box = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class LocalItem:
    """One tensor box this rank holds: the global tensor's dtype and shape, and the box."""

    key: str
    dtype: str
    global_shape: tuple[int, ...]
    box: Box
    nbytes: int

    def to_json(self) -> list[Any]:
        return [self.key, self.dtype, list(self.global_shape), list(self.box[0]),
                list(self.box[1]), self.nbytes]

    @staticmethod
    def from_json(v: list[Any]) -> LocalItem:
        return LocalItem(v[0], v[1], tuple(v[2]), (tuple(v[3]), tuple(v[4])), v[5])


def layout_digest(items: Sequence[LocalItem]) -> str:
    raw = json.dumps([i.to_json() for i in items], separators=(",", ":")).encode()
    return hashlib.sha256(raw).hexdigest()[:24]


def layout_id(digests: Sequence[str]) -> str:
    """Names the group's layout: every rank's layout digest, in rank order."""
    return hashlib.sha256(",".join(digests).encode()).hexdigest()[:24]


def encode_share(items: Sequence[LocalItem], writes: set[tuple[str, Box]]) -> dict[str, Any]:
    """What the coordinator tells a rank to write of its own layout: positions in the
    items it posted, the shorter of the two lists (``skip``: all but these; ``only``)."""
    skip = [i for i, it in enumerate(items) if (it.key, it.box) not in writes]
    if 2 * len(skip) <= len(items):
        return {"skip": skip}
    return {"only": [i for i, it in enumerate(items) if (it.key, it.box) in writes]}


def decode_share(keys: Sequence[str], share: Any, what: str) -> set[str]:
    """The keys of ``keys`` (this rank's layout, in the order posted) that ``share``
    (see :func:`encode_share`) says this rank writes."""
    if type(share) is dict and len(share) == 1:
        (kind, idx), = share.items()
        if (kind in ("skip", "only") and type(idx) is list and all(
                type(i) is int and 0 <= i < len(keys) for i in idx)):
            picked = {keys[i] for i in idx}
            return set(keys) - picked if kind == "skip" else picked
    raise CheckpointSaveError(
        f"{what}: the coordinator's answer {str(share)[:200]!r} does not fit this rank's "
        f"{len(keys)} tensors; are the ranks running the same version of asyncckpt?")


def assign_writers(items_by_rank: Mapping[int, Sequence[LocalItem]]
                   ) -> dict[int, set[tuple[str, Box]]]:
    """Choose one writer for every distinct (key, box); balance bytes across ranks.

    Replicated boxes (held by several ranks) go, largest first, to the holder with the
    fewest bytes so far. Pure and deterministic: every rank computes the same answer
    from the same gathered layouts. Raises CheckpointConfigError when ranks disagree
    on a tensor's dtype or global shape.
    """
    holders: dict[tuple[str, Box], list[int]] = {}
    meta: dict[str, tuple[str, tuple[int, ...], int, bool]] = {}
    sizes: dict[tuple[str, Box], int] = {}
    for rank in sorted(items_by_rank):
        for it in items_by_rank[rank]:
            seen = meta.get(it.key)
            whole = it.box[1] == it.global_shape
            if seen is None:
                meta[it.key] = (it.dtype, it.global_shape, rank, whole)
            elif seen[:2] != (it.dtype, it.global_shape):
                hint = ""
                if seen[3] != whole:  # one passed a shard, the other the tensor as a whole
                    sharded, plain = (seen[2], rank) if whole else (rank, seen[2])
                    hint = (f"; rank {sharded} saves a shard of it (a DTensor, or "
                            f"shards={{{it.key!r}: ShardMetadata(...)}}), rank {plain} a plain "
                            "tensor, taken as the whole: every rank must declare its shard")
                elif seen[1] == it.global_shape:  # (one shape, two dtypes)
                    hint = ("; every rank must hold it in one dtype (a cast on one rank?)")
                elif whole:  # (both whole: per-rank values at one path, a distributed trial)
                    hint = ("; a plain tensor at one path on every rank is taken as one "
                            "replicated tensor: give each rank's own value a path of its "
                            f"own (e.g. under the rank: f'{it.key}_rank{{rank}}'), or "
                            f"declare the sharding (a DTensor, or shards={{{it.key!r}: "
                            "ShardMetadata(...)})")
                else:  # (both shards, of two global shapes: a distributed trial)
                    hint = ("; these are the global shapes the two ranks' shards declare (a "
                            "DTensor's, or ShardMetadata's global_shape): every rank must "
                            "declare the one shape of the whole tensor, its shard's offsets "
                            "within it")
                raise CheckpointConfigError(
                    f"ranks {seen[2]} and {rank} disagree on tensor {it.key!r}: "
                    f"{seen[0]} {list(seen[1])} vs {it.dtype} {list(it.global_shape)}{hint}")
            holders.setdefault((it.key, it.box), []).append(rank)
            sizes[(it.key, it.box)] = it.nbytes
    load = dict.fromkeys(items_by_rank, 0)
    out: dict[int, set[tuple[str, Box]]] = {r: set() for r in items_by_rank}
    for kb in sorted(holders, key=lambda kb: (-sizes[kb], kb[0], kb[1])):
        cands = holders[kb]
        writer = min(cands, key=lambda r: (load[r], r))
        load[writer] += sizes[kb]
        out[writer].add(kb)
    return out


_LEDGER_LOCK = threading.Lock()
# How often a wait asks the Store at most (the training thread; background threads, whose
# waits nobody sits behind, five times less often): with thousands of ranks polling the
# coordinator's Store, each poll counts.
_POLL_MAX_S = 0.02
_SLICE_S = 1.0  # wait_keys asks for its keys in slices of at most this
_LOOK_EVERY_MAX = 4  # wait_keys' look: at least every this many slices
_PROCESS: tuple[int, str] = (0, "")


# The most a Store value holds in one message: torch's TCPStore (libuv) refuses more than
# 8 MiB and drops the connection. Longer values are posted in parts (DistContext.put).
_STORE_PART = 4 << 20
# What DistContext.peek asks compare_set to expect (and set, were it there: never is)
_ABSENT = "\x00asyncckpt: not set"
_PARTS = "asyncckpt_parts"


def _outside(exc: CheckpointConfigError, rank: object) -> CheckpointConfigError:
    """``exc`` noting the rank found in another save than this one (another directory,
    checkpointer or save of the group's), which never reads this save's keys: the
    coordinator's close() waits for no word from it (see ``outside_ranks``)."""
    exc._outside_ranks = (rank,) if type(rank) is int else ()  # type: ignore[attr-defined]
    return exc


def outside_ranks(exc: BaseException) -> tuple[int, ...]:
    """The ranks ``exc`` found saving outside the save it ended (see ``_outside``)."""
    return tuple(getattr(exc, "_outside_ranks", ()))


def _part_key(key: str, i: int) -> str:
    return f"{key}/part/{i}"


def _process_token() -> str:
    """Names this process in the Store (a forked child is another process)."""
    global _PROCESS
    pid = os.getpid()
    if _PROCESS[0] != pid:
        _PROCESS = (pid, f"{pid}-{uuid.uuid4().hex}")
    return _PROCESS[1]


@dataclass
class DistContext:
    """This process's place in a job and the Store it coordinates through.

    Thread-safe (Store clients are). The coordinator is rank 0 of the group.
    """

    rank: int
    world_size: int
    store: Any  # torch.distributed.Store; None when world_size == 1
    namespace: str  # "" until join()
    timeout_s: float
    directory: str = ""  # absolute: what pairs checkpointers across ranks (with a count)
    # the saves whose verdict this rank said it read (once each: see saw_verdict)
    _saw: set[str] = field(default_factory=set, repr=False, compare=False)
    # (checkpointer number, step) of the others' first save this rank skipped (see join)
    passed_over: tuple[int, int] | None = field(default=None, repr=False, compare=False)
    # (count, step) of a namespace whose first save was given up on (see note_opened)
    _dead_at_open: tuple[int, int] | None = field(default=None, repr=False, compare=False)

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def key(self, *parts: object, namespace: str | None = None) -> str:
        """A Store key of this checkpointer's namespace (or of ``namespace``)."""
        namespace = namespace or self.namespace
        assert namespace, "join() first"
        return "/".join(["asyncckpt", namespace, *map(str, parts)])

    def _count_key(self) -> str:
        """The Store's count of this rank's checkpointers of the directory (see join)."""
        return f"asyncckpt/sessions/{self._base()}/{self.rank}"

    def join(self) -> None:
        """Choose the namespace (the first save of a checkpointer in a group calls this).

        Every rank's n-th checkpointer of a directory to save pairs with every other
        rank's n-th: saves are collective, so they start in the same order everywhere.
        Counted per rank in the Store, not in this process: a replaced rank's new process
        goes on from its predecessor's count (and pairs with survivors that reopen their
        checkpointers), and a job restarted with a fresh Store starts over. An n-th whose
        first save the group had given up waiting for this rank in when this checkpointer
        was made (see note_opened) is passed over: this rank skipped that save with a
        checkpointer that never saved, or died before it, and the others' reopened
        checkpointers are the next.
        """
        if self.namespace:
            return
        base = self._base()
        with contextlib.suppress(Exception), _LEDGER_LOCK:  # (a failure keeps steps held)
            self._claim_holds()  # a new process of this rank: what its predecessor held
        with self._store_errors(f"counting this checkpointer of {self.directory!r}"):
            n = self.store.add(self._count_key(), 1) - 1
            # (a trial's rank 2 skipped the first save of its checkpointer; after the
            # recovery the docs give, closing and reopening on every rank, its new one
            # was its first to save and paired with the others' old one: every later
            # save failed on every rank)
            dead = self._dead_at_open
            if dead is not None and dead[0] == n:
                self.passed_over = (n + 1, dead[1])
                log.warning("rank=%d: the group gave up waiting for this rank in the first "
                            "save of its checkpointer #%d of %r (step %d), which this rank "
                            "never made: this checkpointer pairs with the others' next one",
                            self.rank, n + 1, self.directory, dead[1])
                n = self.store.add(self._count_key(), 1) - 1
        self.namespace = f"{base}.{n}"
        with contextlib.suppress(Exception):  # only ever read to explain a timeout
            self.store.set(self._where_key(self.rank), json.dumps(
                {"namespace": self.namespace, "session": n}))
            self.store.set(self._last_directory_key(self.rank), self.directory)

    def _base(self) -> str:
        return hashlib.sha256(self.directory.encode()).hexdigest()[:12]

    def note_opened(self) -> None:
        """At a checkpointer's construction: note whether the checkpointer number its
        first save would take is one whose first save the group has already given up
        on for want of this rank; if so, join passes it over. (Noted now, not at the
        first save: a rank that skipped a save with the checkpointer it goes on with
        must pair with the group's abandoned save, and be told at once.)"""
        base = self._base()
        try:
            n = self.store.add(self._count_key(), 0)
            key = self.key("n1", "go", namespace=f"{base}.{n}")
            raw = self.peek(key)  # (forgotten once the group starts its next save)
            if raw is None:
                return
            go = self._decode(key, raw)
        except Exception:  # (a best effort: the save goes on, and fails as before)
            return
        if (type(go) is dict and go.get("kind") == "CheckpointTimeoutError"
                and self.rank in go.get("ranks", ()) and type(go.get("step")) is int):
            self._dead_at_open = (n, int(go["step"]))

    @staticmethod
    def _saving_key(rank: int) -> str:
        """Which directory and step ``rank`` is saving, while it waits for the others to
        enter the save (any directory's checkpointer sets it)."""
        return f"asyncckpt/saving/{rank}"

    def note_saving(self, step: int, waiting: bool) -> None:
        """Post that this rank waits for the group in its save of ``step`` (or no longer
        does): what refuse_saving_elsewhere reads."""
        with contextlib.suppress(Exception):  # (a best effort: it only cuts a wait short)
            self.store.set(self._saving_key(self.rank), json.dumps(
                {"directory": self.directory, "step": step, "waiting": waiting,
                 "namespace": self.namespace}))

    def refuse_saving_elsewhere(self, ranks: Sequence[int], step: int) -> None:
        """CheckpointConfigError when a rank waited for is itself waiting for the group
        in a save of the same step into another directory: saves are collective, so
        neither can go on (a trial's ranks, each given a directory of its own as on
        nodes without a shared filesystem, waited out the whole timeout_s). The rank
        that finds it tells the other too (its own note is cleared as it raises)."""
        told = f"asyncckpt/saving-elsewhere/{self.rank}"
        try:
            order = f"asyncckpt/out-of-order/{self.rank}"
            raw = self.peek(order)
            if raw is not None:
                got = json.loads(raw)
                if (got.get("step") == step and got.get("directory") == self.directory
                        and got.get("namespace") == self.namespace):
                    with contextlib.suppress(Exception):
                        self.store.delete_key(order)
                    raise _outside(CheckpointConfigError(str(got.get("text"))),
                                   got.get("from"))
            raw = self.peek(told)
            if raw is not None:
                got = json.loads(raw)
                if got.get("step") == step and got.get("directory") == self.directory:
                    with contextlib.suppress(Exception):
                        self.store.delete_key(told)
                    raise _outside(CheckpointConfigError(self._elsewhere_text(
                        got.get("rank"), got.get("other"), step)), got.get("rank"))
            # (peeked: a rank that closes meanwhile takes its note away)
            notes = [(r, self.peek(self._saving_key(r))) for r in ranks]
        except CheckpointError:
            raise
        except Exception:  # (a best effort: the wait goes on, and times out as before)
            return
        for r, v in notes:
            if v is None:
                continue
            try:
                got = json.loads(v)
            except ValueError:
                continue
            theirs = got.get("namespace") if isinstance(got, dict) else None
            if (isinstance(got, dict) and got.get("waiting") and got.get("step") == step
                    and got.get("directory") == self.directory and isinstance(theirs, str)
                    and theirs != self.namespace
                    and theirs.rsplit(".", 1)[-1].isdigit()
                    and self.namespace.rsplit(".", 1)[-1].isdigit()):
                # (a distributed trial's rank 1 closed and reopened its checkpointer after
                # an error, the others not: every later save waited out timeout_s)
                mine = int(self.namespace.rsplit(".", 1)[1]) + 1
                other = int(theirs.rsplit(".", 1)[1]) + 1

                def text(me: int, them: int, n_me: int, n_them: int) -> str:
                    return (f"rank {me}: rank {them} is saving step {step} into "
                            f"{self.directory!r} with its checkpointer #{n_them} of that "
                            f"directory, this rank with its #{n_me}: the ranks pair their "
                            "checkpointers by the order they made them, so these cannot save "
                            "together. Every rank must make (and close) its checkpointers "
                            "in the same order: after one rank closed and reopened its own, "
                            "close and reopen it on every rank")

                # (the other rank is told too)
                self._tell(r, step, theirs, text(r, self.rank, other, mine))
                raise _outside(CheckpointConfigError(text(self.rank, r, mine, other)), r)
            if (isinstance(got, dict) and got.get("waiting") and got.get("step") == step
                    and got.get("directory") != self.directory):
                with contextlib.suppress(Exception):
                    self.store.set(f"asyncckpt/saving-elsewhere/{r}", json.dumps(
                        {"step": step, "directory": got.get("directory"), "rank": self.rank,
                         "other": self.directory}))
                raise _outside(CheckpointConfigError(
                    self._elsewhere_text(r, got.get("directory"), step)), r)

    def tell_out_of_order(self, rank: int, step: int, text: str) -> None:
        """Have ``rank``'s wait in its save of ``step`` with this checkpointer's
        namespace end with ``text`` (refuse_saving_elsewhere reads it)."""
        self._tell(rank, step, self.namespace, text)

    def _tell(self, rank: int, step: int, namespace: str, text: str) -> None:
        with contextlib.suppress(Exception):  # (a best effort: the wait times out)
            self.store.set(f"asyncckpt/out-of-order/{rank}", json.dumps(
                {"step": step, "directory": self.directory, "namespace": namespace,
                 "text": text, "from": self.rank}))

    def _elsewhere_text(self, other: object, where: object, step: int) -> str:
        # (a trial's ranks passed a directory and a symlink to it: one directory, told as
        # two; the ranks compare the paths as given, as one alias may lead each node to
        # another mount)
        same = ""
        with contextlib.suppress(OSError, TypeError, ValueError):
            if isinstance(where, str) and os.path.samefile(where, self.directory):
                same = (" (they are one directory here, under two names: the ranks compare "
                        "the paths they were given, as one name may lead each machine to "
                        "another mount; pass the same path on every rank)")
        return (f"rank {self.rank}: rank {other} is saving step {step} into {where!r}, this "
                f"rank into {self.directory!r}{same}: a save is one checkpoint of the whole "
                "group, so every rank must save into the same directory, one that all of "
                "them share (NFS, Lustre...), with its checkpointers made in the same order")

    @staticmethod
    def _last_directory_key(rank: int) -> str:
        """Which directory ``rank`` last started saving into (any directory's checkpointer
        sets it): a rank saving elsewhere never shows up under this directory's keys."""
        return f"asyncckpt/last-directory/{rank}"

    def _where_key(self, rank: int) -> str:
        """Which checkpointer of this directory ``rank`` last started saving with."""
        return f"asyncckpt/where/{self._base()}/{rank}"

    # --- loads on any rank against the coordinator's retention (keep_last) ---------------
    # A load counts itself under ``asyncckpt/holds/<dir hash>/<step>`` ("any": a load
    # that may fall back to any step); retention posts ``retiring/<dir hash>/<step>``
    # before it reads that count. The Store orders the two, so either retention sees the
    # load and spares the step, or the load sees the step retiring and does not read it.
    # A process that dies in a load never takes its count back: each rank also keeps
    # what it holds in ``holding/<dir hash>/<rank>`` (JSON: the process and its holds),
    # and a new process of the rank, before it holds or saves anything, takes back what
    # its predecessor still held (``_claim_holds``). A hold is counted before it is
    # recorded, and un-recorded before it is uncounted: a process that dies between the
    # two leaves a step held (kept), never a count taken back twice.

    @staticmethod
    def _hold_name(step: int | None) -> str:
        return "any" if step is None else str(step)

    def _hold_key(self, step: int | None) -> str:
        return self._hold_key_named(self._hold_name(step))

    def _hold_key_named(self, name: str) -> str:
        return f"asyncckpt/holds/{self._base()}/{name}"

    def _holding_key(self) -> str:
        return f"asyncckpt/holding/{self._base()}/{self.rank}"

    def _note_hold(self, step: int | None, delta: int) -> None:
        """Count ``delta`` more holds of ``step`` in this rank's record, which this
        process takes over first if another process of the rank wrote it."""
        name = self._hold_name(step)
        with _LEDGER_LOCK:
            held = self._claim_holds()
            held[name] = held.get(name, 0) + delta
            self.store.set(self._holding_key(), json.dumps(
                {"process": _process_token(), "held": {k: n for k, n in held.items() if n > 0}}))

    def _claim_holds(self) -> dict[str, int]:
        """What this process holds (from this rank's record); an earlier process's
        holds are taken back first: it died, and retention would keep those steps for
        ever. Call under _LEDGER_LOCK."""
        key = self._holding_key()
        raw = self.peek(key)
        if raw is None:
            return {}
        record = json.loads(raw)
        held = {str(k): int(n) for k, n in record.get("held", {}).items()}
        if record.get("process") == _process_token():
            return held
        for name, n in held.items():
            if n > 0:
                self.store.add(self._hold_key_named(name), -n)
        self.store.delete_key(key)
        if held:
            log.warning("rank=%d: an earlier process of this rank ended in a load of %s; "
                        "its hold on step(s) %s is taken back", self.rank, self.directory,
                        ", ".join(sorted(held)))
        return {}

    def _retiring_key(self, step: int) -> str:
        return f"asyncckpt/retiring/{self._base()}/{step}"

    def hold_step(self, step: int | None) -> bool:
        """Count a load of ``step`` (None: any step) for the coordinator's retention;
        True once counted (then ``release_step``). Raises CheckpointNotFoundError when
        retention is deleting the step."""
        if not self.distributed:
            return False
        try:
            self.store.add(self._hold_key(step), 1)
            self._note_hold(step, 1)
            if step is None or not self.store.check([self._retiring_key(step)]):
                return True
            self._note_hold(step, -1)
            self.store.add(self._hold_key(step), -1)
        except Exception as exc:  # no Store, no coordinator: no retention to fear either
            log.warning("rank=%d: could not hold step %s for a load through the Store "
                        "(%s: %s); loading it anyway", self.rank, step, type(exc).__name__, exc)
            return False
        raise CheckpointNotFoundError(
            f"step {step} under {self.directory} is being deleted by the keep_last retention "
            "of a newer save: load a newer step")

    def release_step(self, step: int | None) -> None:
        with contextlib.suppress(Exception):  # a dead Store keeps the count: steps stay
            self._note_hold(step, -1)
            self.store.add(self._hold_key(step), -1)

    def may_retire(self, step: int) -> bool:
        """Coordinator: mark ``step`` retiring unless a load on any rank holds it; True
        when it may be deleted (then ``retired`` once it is out of sight)."""
        if not self.distributed:
            return True
        try:
            self.store.set(self._retiring_key(step), "1")
            if not (self._holds(step) or self._holds(None)):
                return True
        except Exception as exc:  # unsure whether a load holds it: keep it
            log.warning("rank=0: keeping step %d: the Store could not say whether a load "
                        "holds it (%s: %s)", step, type(exc).__name__, exc)
        self.retired(step)
        return False

    def _holds(self, step: int | None) -> int:
        """How many loads hold ``step``. A count never made is 0, and is not made here:
        ``add(key, 0)`` would leave a key per step retired in the Store, for the job's
        life. (A load that counts itself after this check sees the retiring mark.)"""
        return self._peek_count(self._hold_key(step))

    def _peek_count(self, key: str) -> int:
        """The count under ``key``, 0 where none was made; none is made here, as
        ``add(key, 0)`` would (and leave it in the Store)."""
        raw = self.peek(key)
        return 0 if raw is None else int(raw)

    def peek(self, key: str) -> bytes | None:
        """What ``key`` holds, or None where it is not set, without waiting: ``get`` of a
        key another rank deletes between a ``check`` and the ``get`` waits for it the
        Store's whole timeout (a suite run's rank, looking at the others' notes of the
        save they wait in, sat in a ``multi_get`` after one closed and took its note away).
        ``compare_set`` against a value no key holds answers at once: the key's value,
        or the expected value back where there is no key (and makes none)."""
        got = self.store.compare_set(key, _ABSENT, _ABSENT)
        raw = got if isinstance(got, bytes) else str(got).encode()
        return None if raw == _ABSENT.encode() else raw

    def retired(self, step: int) -> None:
        """Coordinator: the step is out of sight (or spared): drop its retiring mark, so
        that a later save of the same step number loads again."""
        with contextlib.suppress(Exception):
            self.store.delete_key(self._retiring_key(step))

    # --- a fallback load on every rank: one verdict per step for the whole group ----------

    def fallback_agreement(self) -> FallbackAgreement:
        """For a ``fallback=True`` load in a group: each rank reads (and verifies) only
        its own boxes, so one rank may find a step damaged that the others loaded. The
        ranks post their verdict on each step they try and all fall back together."""
        # Counted in the Store, not in this process: a restart with a fresh Store starts
        # over, and a replaced rank does not pair with a survivor's old count.
        with self._store_errors("counting this fallback load", CheckpointError):
            n = self.store.add(f"asyncckpt/fallback/{self._base()}/count/{self.rank}", 1)
        return FallbackAgreement(self, f"asyncckpt/fallback/{self._base()}/{n}")

    def unposted(self, keys: Mapping[int, str]) -> list[int]:
        """The ranks whose key in ``keys`` is not in the Store (best effort, to explain a
        timeout: a rank the Store cannot answer for is not named)."""
        absent = []
        for r, key in keys.items():
            with contextlib.suppress(Exception):
                if not self.store.check([key]):
                    absent.append(r)
        return absent

    def why_absent(self, ranks: Sequence[int], seq: int) -> str:
        """What ``ranks``, which never posted their layout for save number ``seq`` of
        this namespace, are doing instead, as far as the Store tells: for an error."""
        notes = []
        mine = int(self.namespace.rsplit(".", 1)[1])
        for r in ranks:
            try:
                raw = self.peek(self._where_key(r))
                where = None if raw is None else json.loads(raw)
                raw = self.peek(self._last_directory_key(r))
                elsewhere = self.directory if raw is None else raw.decode(errors="replace")
                if where is None and elsewhere != self.directory:  # never saved here
                    notes.append(f"rank {r} last started saving into {elsewhere!r}, this rank "
                                 f"into {self.directory!r}")
                    continue
                if where is not None and where["namespace"] != self.namespace:
                    notes.append(
                        f"rank {r} last started saving into {self.directory!r} with its "
                        f"checkpointer #{where['session'] + 1} of it, this rank with its "
                        f"#{mine + 1}")
                    continue
                for later in range(seq + 1, seq + 4):
                    raw = self.peek(self.key(f"n{later}", "layout", r))
                    if raw is not None:
                        got = json.loads(raw)
                        notes.append(f"rank {r} is at its save #{later} with this checkpointer "
                                     f"(step {got.get('step')}), this rank at #{seq}")
                        break
            except Exception:  # an explanation is a best effort
                continue
        if self.passed_over is not None and seq == 1:  # (its first save: said once)
            n, skipped = self.passed_over
            notes.append(
                f"this rank skipped the group's save of step {skipped} (the first of the "
                f"others' checkpointer #{n} of {self.directory!r}, which they gave up on "
                f"for want of this rank), so this checkpointer pairs with the others' "
                f"#{n + 1}: close and reopen theirs too")
        if not notes:
            return ""
        return ("; " + "; ".join(notes) + ". Every rank must create the checkpointers it "
                "saves with in the same order, for the same directory, and call save_async "
                "the same number of times")

    def release(self, tags: Sequence[str], digests: Sequence[str],
                layouts: Sequence[str] = ()) -> None:
        """At close: post what this rank may have left in the Store (the tags of saves
        not yet forgotten, the digests of the layouts it posted, the group layouts whose
        shares it handed out) and count itself out;
        the last rank of the group to close deletes all of it (by then no rank waits on
        any of it). The ``where`` keys and the checkpointer counts stay: one of each per
        rank and directory, and each rank's last directory (one key per rank); the note of
        the save this rank waits in goes (see note_saving)."""
        if not self.namespace:
            return
        with contextlib.suppress(Exception):
            self.store.delete_key(self._saving_key(self.rank))
        with contextlib.suppress(Exception):
            self.store.set(self.key("closing", self.rank), json.dumps(
                {"tags": list(tags), "digests": list(digests), "layouts": list(layouts)}))
            if self.store.add(self.key("closed"), 1) < self.world_size:
                return
            left: set[str] = set()
            shared: set[str] = set()  # group layouts whose shares are in the Store
            keys = [self.key("closed")]
            items = []
            for r in range(self.world_size):
                closing = self.key("closing", r)
                raw = self.peek(closing)
                if raw is not None:
                    info = json.loads(raw)
                    left.update(info["tags"])
                    shared.update(info.get("layouts", ()))
                    items += [self.key("items", r, d) for d in info["digests"]]
                keys.append(closing)
            self.forget(sorted(left), (), (), sorted(shared))
            self._delete(keys, items)

    def put(self, key: str, value: Any) -> None:
        """Post ``value`` as JSON under ``key``. A value longer than the Store takes in one
        message (a rank's record of tens of thousands of tensors) goes in parts, under
        ``<key>/part/<i>``, before ``key`` itself, which then names their count: readers
        wait for ``key`` alone, and find every part there."""
        data = json.dumps(value, separators=(",", ":"))  # (ASCII: a character is a byte)
        with self._store_errors(f"posting {key}"):
            if len(data) <= _STORE_PART:
                self.store.set(key, data)
                return
            parts = range(0, len(data), _STORE_PART)
            for i, start in enumerate(parts):
                self.store.set(_part_key(key, i), data[start:start + _STORE_PART])
            self.store.set(key, json.dumps({_PARTS: len(parts)}))

    def _decode(self, key: str, raw: bytes) -> Any:
        """The value posted under ``key`` (see :meth:`put`), from what ``key`` holds.

        Decoded with the collector paused: a rank's record holds a list per tensor, and
        the coordinator decodes every rank's in a burst (see _gc.gc_paused)."""
        with gc_paused():
            value = json.loads(raw)
        if type(value) is dict and len(value) == 1 and type(value.get(_PARTS)) is int:
            joined = b"".join(self.store.get(_part_key(key, i)) for i in range(value[_PARTS]))
            with gc_paused():
                value = json.loads(joined)
        return value

    def get(self, key: str, what: str, timeout_s: float | None = None, *, rank: int = 0,
            pulse: Pulse | None = None, look: Callable[[list[int]], None] | None = None,
            absent: str = "not called save_async for this step") -> Any:
        """Wait for ``key`` (posted by ``rank``) and return its decoded value."""
        self.wait_keys({rank: key}, what, timeout_s, pulse=pulse, look=look, absent=absent)
        with self._store_errors(f"reading {what}"):
            return self._decode(key, self.store.get(key))

    def gather(self, prefix: tuple[object, ...], what: str, timeout_s: float | None = None,
               *, cancelled: Callable[[], bool] | None = None,
               pulse: Pulse | None = None, have: Mapping[int, Any] | None = None,
               look: Callable[[list[int]], None] | None = None,
               absent: str = "not called save_async for this step") -> dict[int, Any]:
        """Wait for ``<prefix>/<rank>`` from every rank and return the decoded values, or
        as soon as one that has arrived is an error: then only those read so far (the
        callers raise the error; a late or dead rank must not delay a reported failure).

        ``cancelled`` is asked about once a second; when it says yes the wait ends with
        CheckpointSaveError (a background wait whose save has already failed). ``have``:
        the values of ranks that need not be read (this rank's own).
        """
        got: dict[int, Any] = dict(have or {})
        keys = {r: self.key(*prefix, r) for r in range(self.world_size) if r not in got}

        def failed(r: int) -> bool:
            with self._store_errors(f"reading {what}"):
                got[r] = self._decode(keys[r], self.store.get(keys[r]))
            return isinstance(got[r], dict) and "error" in got[r]

        if self.wait_keys(keys, what, timeout_s, cancelled=cancelled, stop=failed, pulse=pulse,
                          look=look, absent=absent):
            return got
        rest = [r for r in range(self.world_size) if r not in got]
        with self._store_errors(f"reading {what}"):
            raw = self.store.multi_get([keys[r] for r in rest]) if rest else []
            got.update({r: self._decode(keys[r], v) for r, v in zip(rest, raw, strict=True)})
        return {r: got[r] for r in range(self.world_size)}

    def claim(self, key: str, value: str, what: str,
              error: type[CheckpointError] = CheckpointSaveError) -> str:
        """Set ``key`` to ``value`` unless it is set already; return what it holds now."""
        with self._store_errors(what, error):
            got = self.store.compare_set(key, "", value)
        return got.decode(errors="replace") if isinstance(got, bytes) else str(got)

    def forget(self, tags: Sequence[str | None], old_digests: Sequence[str],
               digests: Sequence[str], old_layouts: Sequence[str] = ()) -> None:
        """Delete the keys of finished saves, layouts no rank uses any more, and the
        shares the coordinator handed out for ``old_layouts`` (group layouts gone)."""
        keys = []
        parted = []  # the keys whose values may have been posted in parts (see put)
        for tag in tags:
            if tag is None:
                continue
            keys += [self.key(tag, part, r) for part in ("layout", "done")
                     for r in range(self.world_size)]
            parted += [self.key(tag, "record", r) for r in range(self.world_size)]
            keys += [self.key(tag, "beat", r) for r in range(self.world_size)]
            keys += [self.key(tag, part)
                     for part in ("go", "verdict", "decision", "abort", "seen")]
        parted += [self.key("items", r, d) for r, d in enumerate(old_digests) if d != digests[r]]
        parted += [self.key("share", lid, r) for lid in old_layouts
                   for r in range(1, self.world_size)]
        self._delete(keys, parted)

    def saw_verdict(self, tag: str) -> None:
        """A peer has read the coordinator's verdict on save ``tag`` (best effort; counted
        once per rank and save: a rank that read a refusal and then failed with it would
        count twice, and rank 0's close() stop waiting before another rank read it)."""
        if tag in self._saw:
            return
        self._saw.add(tag)
        if len(self._saw) > 64:  # (the newest tags matter: saves go one at a time)
            self._saw = {tag}
        with contextlib.suppress(Exception):
            self.store.add(self.key(tag, "seen"), 1)

    def wait_verdict_seen(self, tag: str, timeout_s: float, peers: int | None = None
                          ) -> bool:
        """Coordinator, at close: wait until every peer (``peers`` of them, where fewer
        are alive to read it) has read the verdict on save ``tag``, or ``timeout_s``
        passes. Rank 0 often hosts the Store (``init_method=tcp://``, ``mp.spawn``): were
        it to exit at once, a peer still polling for the verdict would see the connection
        reset and report its last save failed, though it was committed (or blame the
        Store for a failure it was not told). True once they have read it, or every other
        rank has closed its checkpointer of this group (none reads anything more: a rank
        that skipped the save refused, then closed, held this wait its whole timeout)."""
        want = self.world_size - 1 if peers is None else peers
        deadline = time.monotonic() + timeout_s
        poll_s = 0.001
        closed = self.key("closed")  # (see release)
        while True:
            try:
                if self.store.add(self.key(tag, "seen"), 0) >= want:
                    return True
                if self._peek_count(closed) >= self.world_size - 1:
                    return True
            except Exception:
                return False  # the Store is gone already: nobody is left to tell
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(poll_s, left))
            poll_s = min(2 * poll_s, _POLL_MAX_S)

    def _delete(self, keys: Sequence[str], parted: Sequence[str] = ()) -> None:
        for k in keys:
            with contextlib.suppress(Exception):  # housekeeping: a missing key is fine
                self.store.delete_key(k)
        for k in parted:
            with contextlib.suppress(Exception):
                self.store.delete_key(k)
                i = 0
                while self.store.delete_key(_part_key(k, i)):  # until the first one missing
                    i += 1

    @contextlib.contextmanager
    def _store_errors(self, what: str,
                      error: type[CheckpointError] = CheckpointSaveError) -> Iterator[None]:
        try:
            yield
        except CheckpointError:
            raise
        except Exception as exc:  # the Store's own errors: a dead peer, a broken socket
            raise error(
                f"rank {self.rank}: coordination through the Store failed while {what} (is "
                "the process that hosts the Store alive? under torchrun its agent, else "
                f"usually rank 0): {type(exc).__name__}: {exc}") from exc

    def wait_keys(self, keys: Mapping[int, str], what: str, timeout_s: float | None = None,
                  *, cancelled: Callable[[], bool] | None = None,
                  stop: Callable[[int], bool] | None = None,
                  pulse: Pulse | None = None, until: Callable[[], bool] | None = None,
                  absent: str = "not called save_async for this step",
                  error: type[CheckpointError] = CheckpointSaveError,
                  look: Callable[[list[int]], None] | None = None) -> bool:
        """Block until every key exists; on timeout name the ranks whose keys are missing.

        The keys are asked for in slices of at most a second: after each, ``cancelled``
        is asked, and ``stop`` about each key that arrived meanwhile: when it says yes,
        the wait ends early and returns True. ``look`` is shown the ranks still waited
        for after slices 1, 2, 4, 8, then every 4th (a few Store reads in a long wait),
        and may raise.

        With ``pulse`` (the save's), this rank beats while it waits, the wait ends with
        the other ranks' abort, and the timeout counts from the last progress of the
        ranks waited for: a rank still copying or writing (its count moved within
        ``timeout_s``) holds the wait open, and only the silent or stuck ones are named,
        with what they were last doing.
        """
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        # The baseline of the counts is taken after the first slice: it must end well
        # before the deadline, or a count that moves in between is never seen to.
        first_slice = min(_SLICE_S, timeout / 2)
        # A waiting rank beats once a slice: with a pulse, slices as short as its beats,
        # or a rank waiting on this one could see it silent for a whole timeout_s
        slice_s = _SLICE_S if pulse is None else min(_SLICE_S, pulse.every_s)
        first_slice = min(first_slice, slice_s)
        pending = dict(keys)
        baseline = False
        slices, next_look = 0, 1
        poll_s = 0.001
        main = threading.current_thread() is threading.main_thread()
        poll_max_s = _POLL_MAX_S if main else 5 * _POLL_MAX_S
        while pending:
            if cancelled is not None and cancelled():
                raise CheckpointSaveError(
                    f"rank {self.rank}: stopped waiting for {what}: the save already failed")
            if until is not None:
                with self._store_errors(f"waiting for {what}", error):
                    if until():
                        return True
            if pulse is not None:
                # progress: this wait itself times out; the ranks it waits on go with it,
                # so that a rank timing out on this one learns whom it was held up by
                pulse(f"waiting for {what} from {_ranks_text(sorted(pending))}")
            slice_end = min(deadline, time.monotonic() + (slice_s if baseline else first_slice))
            while True:  # until every key is there or the slice ends
                with self._store_errors(f"waiting for {what}", error):
                    if self.store.check(list(pending.values())):
                        return False
                left = slice_end - time.monotonic()
                if left <= 0:
                    break
                # (save_async pauses the collector, for the whole process, over its bursts
                # of small objects and over this wait for the group between them, which a
                # late rank can stretch to timeout_s: its other threads' cycles are
                # collected meanwhile)
                with gc_resumed(own=True):
                    time.sleep(min(poll_s, left))
                poll_s = min(2 * poll_s, poll_max_s)
            with self._store_errors(f"waiting for {what}", error):
                arrived = [r for r, k in pending.items() if self.store.check([k])]
            for r in arrived:
                del pending[r]
                if stop is not None and stop(r):
                    return True
            slices += 1
            if look is not None and pending and slices == next_look:
                # (1, 2, 4, 8, then every 4th: a refusal another rank posted is read within
                # seconds; doubling for ever, a CI run's rank 0 read it after 32 s)
                next_look += min(next_look, _LOOK_EVERY_MAX)
                with self._store_errors(f"waiting for {what}", error):
                    look(sorted(pending))
            if pulse is not None and not baseline and pending:
                # what the counts of the ranks still missing are a slice into the wait:
                # one that has not moved from here by the deadline went silent
                pulse.progressed(sorted(pending))
                baseline = True
            if pending and time.monotonic() >= deadline:
                silent = sorted(pending)
                if pulse is not None:
                    alive = set(pulse.progressed(silent))
                    silent = [r for r in silent if r not in alive]
                    if not silent:  # slower, not dead: wait on while they make progress
                        deadline = time.monotonic() + timeout
                        continue
                    doing = pulse.doing(silent)
                    why = (f"rank(s) {silent}, which made no progress for the last "
                           f"{seconds_text(timeout)}" + (f" ({doing})" if doing else "")
                           + "; they may have died or hung")
                else:
                    why = f"rank(s) {silent}; they may have died or {absent}"
                err = CheckpointTimeoutError(
                    f"rank {self.rank}: timed out after {seconds_text(timeout)} waiting for "
                    f"{what} from " + why)
                err.ranks = tuple(silent)
                raise err
        return False


# How _abort words a rank's refusal of the settings (see stopped_error)
_CONFIG_REFUSED = re.compile(r"rank \d+: CheckpointConfigError: ")


def silent_ranks_advice(step: int, started: bool) -> str:
    """What rank 0's timeout on silent ranks adds, as the others' errors say it: the
    step's fate, and what to do."""
    fate = "was not committed" if started else "was not started, nothing committed"
    return (f"step {step} {fate} (the steps committed before it are intact): restart the "
            "group without the silent rank(s), or wait for them")


def stopped_error(message: str, why: str) -> CheckpointError:
    """The error of a rank stopped because another failed the save for ``why`` (as the
    failing rank's abort worded it): CheckpointConfigError where that rank refused the
    settings, as it raised itself, else CheckpointSaveError."""
    if _CONFIG_REFUSED.match(why):
        return CheckpointConfigError(message)
    return CheckpointSaveError(message)


class Pulse:
    """One rank's signs of life during one save, through the Store (never the training
    process group, so background threads may call it).

    Calling it (cheap: it acts at most once a second) posts this rank's count, with
    what it is doing, under ``<tag>/beat/<rank>`` and, while ``watch`` is set, raises
    CheckpointSaveError once another rank posted ``<tag>/abort``: the writers call it
    between pieces and while they wait for staging, the waits in ``wait_keys`` once a
    second. The count moves only with progress: a piece to write, a slice of a wait
    that has its own timeout, or staging that got further (``mark``) — a writer waiting
    for a copy that hangs (a CUDA stream stuck behind a hung collective) still beats,
    but its count stays put, so the other ranks' waits time out on it. A peer clears
    ``watch`` once its file is durable and announced: from then on only the
    coordinator's verdict decides. ``progressed`` tells a wait which of the ranks it
    waits for moved their count since it last asked, ``doing`` what they were doing.
    Thread-safe.
    """

    def __init__(self, ctx: DistContext, tag: str) -> None:
        self.ctx, self.tag = ctx, tag
        # at least four beats within the shortest wait (timeout_s): one cannot fall
        # between a wait's baseline and its deadline
        self.every_s = min(1.0, ctx.timeout_s / 4)
        self._lock = threading.Lock()
        self._next = 0.0
        self._count = 0
        self._mark: object = None  # the staging progress the count last moved for
        self._seen: dict[int, object] = {}
        self._doing: dict[int, str] = {}
        self._abort_key = ctx.key(tag, "abort")
        self.watch = True

    def __call__(self, doing: str = "", *, mark: object = None, at_once: bool = False) -> None:
        """Beat: ``doing`` says what this rank is doing (for the others' errors); the
        count moves unless ``mark`` is given and is the one it last moved for. With
        ``at_once``, beat even within a second of the last beat: a rank that starts work
        during which it does not beat (the commit) says so, or a rank timing out on it
        would be told what it did before ("waiting for the shard files" from ranks that
        had posted them)."""
        now = time.monotonic()
        with self._lock:
            if now < self._next and not at_once:
                return
            self._next = now + self.every_s
            if mark is None or mark != self._mark:
                self._count += 1
                self._mark = mark
            count = self._count
        ctx = self.ctx
        beat = json.dumps({"n": count, "doing": doing}, separators=(",", ":"))
        with ctx._store_errors(f"posting rank {ctx.rank}'s sign of life"):
            ctx.store.set(ctx.key(self.tag, "beat", ctx.rank), beat)
            said = ctx.peek(self._abort_key) if self.watch else None
            if said is None:
                return
            why = said.decode(errors="replace")
        raise stopped_error(f"rank {ctx.rank}: stopped, nothing committed: {why}", why)

    def aborted(self) -> str | None:
        """Why another rank (or this one) stopped the save, if one has; None when none
        has, or the Store cannot say."""
        with contextlib.suppress(Exception):
            said = self.ctx.peek(self._abort_key)
            if said is not None:
                return said.decode(errors="replace")
        return None

    def stopped(self) -> bool:
        """Whether another rank (or this one) stopped the save, or the Store is gone (its
        host, rank 0 often, failed the save and exited: a storage trial's rank 1 went on
        waiting for room its whole 10 s, asking a Store that no longer answered)."""
        try:
            return bool(self.ctx.store.check([self._abort_key]))
        except Exception:
            return True

    def abort(self, why: str) -> None:
        """Post why the save failed, unless a rank did first (best effort)."""
        with contextlib.suppress(Exception):
            self.ctx.store.compare_set(self._abort_key, "", why)

    def progressed(self, ranks: Sequence[int]) -> list[int]:
        """Which of ``ranks`` moved their count since the last call (at the first call,
        which takes the baseline: those that beat at all)."""
        ctx, moved = self.ctx, []
        for r in ranks:
            key = ctx.key(self.tag, "beat", r)
            with ctx._store_errors(f"reading rank {r}'s sign of life"):
                raw = ctx.peek(key)
                if raw is None:
                    continue
            count: object = raw
            try:
                beat = json.loads(raw)
                count, doing = beat["n"], str(beat.get("doing") or "")
            except Exception:  # not a beat of this version: any change counts
                doing = ""
            with self._lock:
                self._doing[r] = doing
                if self._seen.get(r) != count:
                    self._seen[r] = count
                    moved.append(r)
        return moved

    def doing(self, ranks: Sequence[int]) -> str:
        """What ``ranks`` said they were doing when ``progressed`` last read their beats
        ("" when none said): for the error of a wait that timed out on them."""
        parts = []
        with self._lock:
            for r in ranks:
                what = self._doing.get(r)
                if what:
                    parts.append(f"rank {r} was last {what}")
                elif r not in self._seen:  # (killed before its first beat, say)
                    parts.append(f"rank {r} gave no sign of life in this save")
        more = f"; and {len(parts) - 8} more" if len(parts) > 8 else ""
        return "; ".join(parts[:8]) + more


def _ranks_text(ranks: Sequence[int], most: int = 8) -> str:
    """``rank(s) [1, 2]``, with at most ``most`` ranks named (``... and 3 more``)."""
    if len(ranks) <= most:
        return f"rank(s) {list(ranks)}"
    return f"rank(s) {list(ranks[:most])} and {len(ranks) - most} more"


def raise_failures(answers: Mapping[int, Mapping[str, Any]], head: str) -> None:
    """Raise CheckpointSaveError ``head: rank r failed: ...`` if any rank's answer is an
    error (what a rank posts when its part of a save fails); CheckpointInFlightError when
    every failed rank refused the save as busy (on_busy="error": a save to skip)."""
    failed = {r: a["error"] for r, a in answers.items() if "error" in a}
    if failed:
        kinds = {answers[r].get("kind") for r in failed}
        # (a rank told it is out of step, or that the ranks' settings differ: the same
        # kind of error on every rank, the coordinator too; a trial's got a SaveError)
        kind = (CheckpointInFlightError if kinds == {"CheckpointInFlightError"} else
                CheckpointConfigError if kinds == {"CheckpointConfigError"} else
                CheckpointSaveError)
        raise kind(f"{head}: " + "; ".join(
            f"rank {r} failed: {msg}" for r, msg in sorted(failed.items())))




def resolve_context(directory: str, *, process_group: Any = None, rank: int | None = None,
                    world_size: int | None = None, store: Any = None,
                    timeout_s: float = 600.0) -> DistContext:
    """Work out rank, world size and Store from the arguments or the default group.

    ``directory`` should be absolute and normalized (``os.path.abspath``): it pairs the
    checkpointers of the ranks (see DistContext.join).
    """
    if process_group is not None or (rank is None and dist.is_available()
                                     and dist.is_initialized()):
        group = process_group
        rank = dist.get_rank(group) if rank is None else rank
        world_size = dist.get_world_size(group) if world_size is None else world_size
        if store is None and world_size > 1:
            store = _group_store(group)
    rank = 0 if rank is None else rank
    world_size = 1 if world_size is None else world_size
    given: tuple[tuple[str, object], ...] = (("rank", rank), ("world_size", world_size))
    for name, value in given:  # (numpy's ints too)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise CheckpointConfigError(f"{name}={value!r:.40}: pass a whole number (an int)")
    rank, world_size = int(rank), int(world_size)
    if world_size < 1:
        raise CheckpointConfigError(f"world_size={world_size}: a group has one rank or more "
                                    "(pass world_size=1 for this process alone)")
    if not 0 <= rank < world_size:
        raise CheckpointConfigError(f"rank={rank} is outside world_size={world_size}")
    if world_size > 1 and store is None:
        if dist.is_available() and dist.is_initialized():
            raise CheckpointConfigError(
                f"rank={rank}, world_size={world_size}: a rank given by hand leaves the "
                "default process group (and its Store) aside: drop rank= and world_size= "
                "to use the default group, or pass process_group= or store= as well")
        raise CheckpointConfigError(
            f"world_size={world_size} needs a torch.distributed Store to coordinate through: "
            "call torch.distributed.init_process_group first, or pass store=")
    return DistContext(rank, world_size, None if store is None else LosableStore(store), "",
                       timeout_s, directory)


class LosableStore:
    """A Store that, once its connection is lost (a DistNetworkError: its host died,
    rank 0's process often), is asked no more: each later call raises that loss again at
    once. torch prints a C++ stack trace of ~25 lines for every call that fails so: a
    distributed trial's survivors printed 5-6 each, which buried asyncckpt's message."""

    _CALLS = frozenset({"add", "check", "compare_set", "delete_key", "get", "multi_get",
                        "multi_set", "set", "wait", "num_keys", "append"})

    def __init__(self, store: Any) -> None:
        self.inner = store
        self.lost: str | None = None  # the loss, in words

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name not in self._CALLS:
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.lost is not None:
                raise torch.distributed.DistNetworkError(self.lost)
            try:
                return attr(*args, **kwargs)
            except torch.distributed.DistNetworkError as exc:
                self.lost = f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
                raise
        return call


def _group_store(group: Any) -> Any:
    from torch.distributed import distributed_c10d as c10d

    if group is None or group is c10d.GroupMember.WORLD:
        return c10d._get_default_store()
    return c10d._get_process_group_store(group)


# (DTensor spec) -> (mesh, local shape, global offsets, global shape)
_Hit = tuple[Any, tuple[int, ...], tuple[int, ...], tuple[int, ...]]
_boxes: dict[Any, _Hit] = {}
# id(spec) -> (a weak reference to the spec, its cached hash then, the box): the DTensor
# specs met, by identity. Weak: a state of DTensors made anew at every save must not keep
# every old spec (and what it holds) alive until the cache is cleared.
_seen_specs: dict[int, tuple[Any, Any, _Hit]] = {}


def dtensor_box(t: torch.Tensor, where: str) -> tuple[torch.Tensor, tuple[int, ...], Box]:
    """(local tensor, global shape, box of the local shard) of a DTensor.

    Shard(d) (split in the spec's shard order where it has one), Replicate() and the
    strided shards of FSDP2 + tensor parallel (``_StridedShard``) are taken where every
    rank's shard is one box of the global tensor. Raises UnsupportedLeafError for
    anything else (Partial, a strided shard whose local rows are scattered) — reduce or
    redistribute those first.
    """
    spec: Any = getattr(t, "_spec", None)
    # The same spec object as at the last save, unchanged since (torch drops its cached
    # hash when a hashed field is set): its box without comparing specs (~1.5 us each).
    cached = getattr(spec, "_hash", None)
    seen = _seen_specs.get(id(spec)) if cached is not None else None
    hit = seen[2] if seen is not None and seen[0]() is spec and seen[1] is cached else (
        _box_of(t, spec, where))
    _, shape, offsets, global_shape = hit
    # to_local() goes through autograd (~7 us a tensor, every save); the attribute does not.
    local = getattr(t, "_local_tensor", None)
    if not isinstance(local, torch.Tensor):
        local = t.to_local()  # type: ignore[attr-defined]
    if shape != local.shape:
        if local.numel() == 0 and 0 in shape:
            # FSDP2 gives a shard with no elements the length 0 on its shard dim and
            # keeps the rest: (0, 0) where the placements say (2, 0). Both hold nothing.
            return local.reshape(shape), global_shape, (offsets, shape)
        from .errors import UnsupportedLeafError

        raise UnsupportedLeafError(
            f"DTensor at {where!r}: local shard shape {list(local.shape)} does not match its "
            f"placements ({list(shape)})")
    return local, global_shape, (offsets, shape)


def _box_of(t: torch.Tensor, spec: Any, where: str) -> _Hit:
    """The box of a DTensor whose spec was not met before (or changed since)."""
    # The DTensor's own spec (mesh, placements, global shape, dtype, stride) is the key
    # where there is one: it caches its hash, so a hit costs about a microsecond.
    mesh = getattr(spec, "mesh", None)
    if mesh is None or not getattr(type(spec), "__hash__", None):
        mesh = t.device_mesh  # type: ignore[attr-defined]
        spec = (t.shape, tuple(t.placements), id(mesh),  # type: ignore[attr-defined]
                getattr(spec, "shard_order", None))
    hit = _boxes.get(spec)
    if hit is None or hit[0] is not mesh:
        mesh = t.device_mesh  # type: ignore[attr-defined]
        hit = _new_box(spec, t, mesh, tuple(t.placements), where)  # type: ignore[attr-defined]
    cached = getattr(spec, "_hash", None)
    if cached is not None:
        try:
            ref = weakref.ref(spec)
        except TypeError:  # (a spec type without weak references: looked up by value)
            return hit
        if len(_seen_specs) > 100_000:
            _seen_specs.clear()
        # (a spec that dies leaves an entry whose reference is dead: a new spec at the
        # same id finds it and misses)
        _seen_specs[id(spec)] = (ref, cached, hit)
    return hit


@functools.cache
def dtensor_module(sub: str = "") -> Any:
    """torch's DTensor module (``sub``: one of its submodules): torch.distributed.tensor,
    public from torch 2.5 on, else torch.distributed._tensor, where torch 2.4 keeps it."""
    import importlib

    public = importlib.import_module("torch.distributed.tensor")
    if hasattr(public, "Shard"):
        return importlib.import_module(f"{public.__name__}.{sub}") if sub else public
    return importlib.import_module(f"torch.distributed._tensor{'.' + sub if sub else ''}")


def _new_box(spec: Any, t: torch.Tensor, mesh: Any, placements: tuple[Any, ...], where: str
             ) -> _Hit:
    """Work out (and cache) the box of a DTensor layout not seen before."""
    api = dtensor_module()
    Replicate, Shard = api.Replicate, api.Shard

    from .errors import UnsupportedLeafError

    if mesh.get_coordinate() is None:
        raise UnsupportedLeafError(
            f"DTensor at {where!r} lives on a device mesh that does not include this "
            "rank, which holds none of it: leave it out of this rank's state")
    unusual = [p for p in placements if type(p) not in (Shard, Replicate)]
    for p in unusual:
        if type(p) is not _strided_shard_type():
            raise UnsupportedLeafError(
                f"DTensor at {where!r} has placement {p}: only Shard(d), Replicate() and strided "
                "shards that leave each rank one box can be checkpointed; redistribute it first "
                "(e.g. t.redistribute(placements=...))")
    order = _shard_order(getattr(t, "_spec", None))
    if order is not None and unusual:  # each rank's part may be no box: never guess
        raise UnsupportedLeafError(
            f"DTensor at {where!r} has placements {tuple(map(str, placements))} and the shard "
            f"order {order}: only Shard(d) and Replicate() can be checkpointed in an order "
            "other than the mesh's; redistribute it first (e.g. t.redistribute(placements="
            "...))")
    if order is not None:
        shape, offsets = _ordered_shape_and_offsets(t.shape, mesh, placements, order, where)
    else:
        shape, offsets = _local_shape_and_offsets(t.shape, mesh, placements, where)
    if unusual:  # strided shards, rare: check that this rank's part really is one box
        _check_one_box(t, mesh, placements, {p.dim for p in unusual}, shape, offsets, where)
    if len(_boxes) > 100_000:
        _boxes.clear()
    # The mesh is kept alive in the entry, so its id cannot be reused by another mesh.
    hit = (mesh, tuple(shape), tuple(offsets), tuple(t.shape))
    # Keyed by a copy that nobody changes: a dict finds a key by identity before its hash,
    # so the DTensor's own spec, changed in place later, could find this entry again.
    _boxes[spec if isinstance(spec, tuple) else copy.copy(spec)] = hit
    return hit


@functools.cache
def _strided_shard_type() -> type | None:
    """torch's ``_StridedShard`` placement (FSDP2 over tensor parallel), if it has one."""
    try:
        types = dtensor_module("placement_types")
    except ImportError:  # a torch without it cannot make such DTensors either
        return None
    return getattr(types, "_StridedShard", None)  # (nor one without the class)


def _local_shape_and_offsets(global_shape: torch.Size, mesh: Any, placements: tuple[Any, ...],
                             where: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """torch's own (local shape, global offsets) of this rank's shard."""
    try:
        compute_local_shape_and_global_offset = (
            dtensor_module("_utils").compute_local_shape_and_global_offset)
    except (ImportError, AttributeError) as exc:  # a private helper: a torch may move it
        from .errors import UnsupportedLeafError

        raise UnsupportedLeafError(
            f"DTensor at {where!r}: this torch {torch.__version__} lacks "
            "torch.distributed.tensor._utils.compute_local_shape_and_global_offset, which "
            "asyncckpt uses to find a DTensor's shard; use a torch version asyncckpt supports, "
            "or save t.to_local() with shards=ShardMetadata(...)") from exc
    shape, offsets = compute_local_shape_and_global_offset(global_shape, mesh, placements)
    return tuple(shape), tuple(offsets)


def _shard_order(spec: Any) -> tuple[tuple[int, tuple[int, ...]], ...] | None:
    """A spec's ``shard_order`` (a field of newer torch's DTensorSpec) as (tensor dim, mesh
    dims) pairs, where it is not the default that the placements alone say (each tensor
    dim split by its mesh dims in increasing order); None where it is."""
    order = getattr(spec, "shard_order", None)
    if not order:
        return None
    pairs = tuple((int(e.tensor_dim), tuple(int(m) for m in e.mesh_dims)) for e in order)
    if all(list(dims) == sorted(dims) for _, dims in pairs):
        return None
    return pairs


def _ordered_shape_and_offsets(global_shape: torch.Size, mesh: Any, placements: tuple[Any, ...],
                               order: tuple[tuple[int, tuple[int, ...]], ...], where: str
                               ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offsets) of a DTensor whose shard order is not the default.

    A tensor dim sharded over several mesh dims is split by each in the order given
    (``ShardOrderEntry(0, (1, 0))``: by mesh dim 1, then each part by mesh dim 0), so the
    rank's part is still one box. torch computes boxes splitting by mesh dims left to
    right, and each tensor dim apart: it is asked with the mesh dims reordered so that
    left to right is the order given.
    """
    from .errors import UnsupportedLeafError

    try:
        _compute_local_shape_and_global_offset = (
            dtensor_module("_utils")._compute_local_shape_and_global_offset)
    except (ImportError, AttributeError) as exc:  # a private helper: a torch may move it
        raise UnsupportedLeafError(
            f"DTensor at {where!r} has a shard order other than its mesh's ({order}), and "
            f"this torch {torch.__version__} lacks the helper asyncckpt finds its shard with; "
            "redistribute it to the default order first (e.g. t.redistribute(placements="
            "t.placements))") from exc
    firsts = [m for _, dims in order for m in dims]
    perm = firsts + [m for m in range(len(placements)) if m not in firsts]
    coord = mesh.get_coordinate()
    shape, offsets = _compute_local_shape_and_global_offset(
        global_shape, [mesh.size(m) for m in perm], [coord[m] for m in perm],
        [placements[m] for m in perm])
    return tuple(shape), tuple(offsets)


def _check_one_box(t: torch.Tensor, mesh: Any, placements: tuple[Any, ...], dims: set[int],
                   shape: tuple[int, ...], offsets: tuple[int, ...], where: str) -> None:
    """Raise UnsupportedLeafError unless this rank's indices along each of ``dims`` are the
    contiguous range [offset, offset + length) of the computed box.

    torch's own sharding finds them: a tensor of global indices along ``d`` (size 1 on
    the other dimensions) is split by the same placements (``src_data_rank=None``:
    locally, with no communication). Runs once per new layout, never per save.
    """
    api = dtensor_module()
    Replicate, distribute_tensor = api.Replicate, api.distribute_tensor

    from .errors import UnsupportedLeafError

    ndim = len(t.shape)
    for d in sorted(x % ndim for x in dims):
        n = t.shape[d]
        index = torch.arange(n).reshape([n if e == d else 1 for e in range(ndim)])
        along = [p if type(p) is not Replicate and p.dim % ndim == d else Replicate()
                 for p in placements]
        try:
            got = distribute_tensor(index, mesh, along, src_data_rank=None).to_local()
            got = got.reshape(-1).cpu()
        except Exception as exc:
            raise UnsupportedLeafError(
                f"DTensor at {where!r} has placements {tuple(map(str, placements))}, which this "
                f"torch {torch.__version__} could not split along dimension {d} to check that "
                f"each rank holds one box ({type(exc).__name__}: {exc}); redistribute it first "
                "(e.g. t.redistribute(placements=...))") from exc
        if not torch.equal(got, torch.arange(offsets[d], offsets[d] + shape[d])):
            rows: list[Any] = got[:9].tolist()
            shown = rows if len(rows) <= 8 else [*rows[:8], "..."]
            raise UnsupportedLeafError(
                f"DTensor at {where!r} has placements {tuple(map(str, placements))}, which give "
                f"this rank indices {shown} of dimension {d}, not one contiguous range: only "
                "Shard(d), Replicate() and strided shards that leave each rank one box can be "
                "checkpointed; redistribute it first (e.g. t.redistribute(placements=...))")


# --- what each rank wrote, and the merged manifest --------------------------------------------

def merge_records(records: Sequence[dict[str, Any]], *, step: int, library_version: str,
                  block_bytes: int, user_metadata: dict[str, str], created_unix: float,
                  partial: bool = False, metrics: dict[str, float] | None = None,
                  metric_modes: dict[str, str] | None = None,
                  strict_replicas: bool = False) -> Manifest:
    """Build the global manifest from every rank's record (coordinator's first).

    Raises CheckpointSaveError when the chunks of a tensor overlap or leave part of it
    uncovered: a checkpoint that cannot be loaded whole is never committed.
    """
    files: dict[str, FileEntry] = {}
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...], str, list[Chunk]]] = {}
    for rec in records:
        if rec["file"] is not None:
            files[rec["file"]] = FileEntry(rec["file"], rec["bytes"], rec["rank"],
                                           rec["header_bytes"], rec["header_checksum"])
        for key, t in rec["tensors"].items():
            dtype = dtype_from_name(t["dtype"])
            entry = tensors.setdefault(key, (dtype, tuple(t["shape"]), t["kind"], []))
            entry[3].append(Chunk(rec["file"], key, tuple(t["offsets"]), tuple(t["lengths"]),
                                  (t["byte_range"][0], t["byte_range"][1]),
                                  tuple(t["checksums"])))
    out: dict[str, TensorEntry] = {}
    for key, (dtype, shape, kind, chunks) in tensors.items():
        chunks.sort(key=lambda c: c.offsets)
        _check_coverage(key, shape, chunks, partial, files, [r["rank"] for r in records])
        out[key] = TensorEntry(dtype, shape, kind, tuple(chunks))
    skeleton = merged_skeleton([r["skeleton"] for r in records], step, records[0]["rank"],
                               strict_replicas)
    warn_differing_replicas(step, [(r["rank"], r.get("replicas", {})) for r in records],
                            _saved_checksums(out), strict_replicas)
    if len(records) > 1:  # (one record: its skeleton and tensors come from one flatten)
        check_reachable(skeleton, out.keys())
    return Manifest(step=step, world_size=len(records), created_unix=created_unix,
                    library_version=library_version, block_bytes=block_bytes, files=files,
                    tensors=out, skeleton=skeleton, user_metadata=user_metadata,
                    partial=partial, metrics=dict(metrics or {}),
                    metric_modes=dict(metric_modes or {}))


def merged_skeleton(skeletons: list[Any], step: int, first_rank: int,
                    strict: bool = False) -> Any:
    """The ranks' skeletons as one (rank ``first_rank``'s values where they differ, with
    a warning; ``strict``: CheckpointSaveError instead); one that is the same on every
    rank is taken as it is."""
    first = skeletons[0]
    if all(s == first for s in skeletons[1:]):  # (compared in C: the usual case)
        return first
    differing: list[str] = []
    skeleton = merge_skeletons(skeletons, differing)
    differing = list(dict.fromkeys(differing))  # (one path per rank that differs: once)
    if differing:
        more = f" and {len(differing) - 5} more" if len(differing) > 5 else ""
        if strict:
            raise CheckpointSaveError(
                f"step {step} aborted, nothing committed (strict_replicas=True): ranks saved "
                f"different non-tensor values at {', '.join(map(repr, differing[:5]))}{more}, "
                "a path that every rank holds being one replicated value; give per-rank "
                "values per-rank paths (e.g. under the rank), or find why the ranks diverged")
        log.warning("step %d: ranks saved different non-tensor values at %s%s; the checkpoint "
                    "keeps rank %d's (values with one path on every rank are taken as "
                    "replicated: give per-rank values per-rank paths, e.g. under the rank)",
                    step, ", ".join(map(repr, differing[:5])), more, first_rank)
    return skeleton


def check_reachable(skeleton: Any, keys: Iterable[str]) -> None:
    """Refuse tensors that the merged skeleton does not lead to: written, a load would
    never find them (the ranks' state trees disagree)."""
    reachable = {node["key"] for _, node in iter_array_nodes(skeleton)}
    lost = [k for k in keys if k not in reachable]
    if lost:
        more = f" and {len(lost) - 8} more" if len(lost) > 8 else ""
        raise CheckpointSaveError(
            f"tensors {', '.join(map(repr, lost[:8]))}{more} are saved by some ranks where the "
            "ranks' state trees disagree (a list of another length, or a non-tensor value on "
            "another rank); give every rank a state tree of the same structure")


Replica = list[str] | dict[str, Any]
"""What a rank that holds a replicated box but does not write it reports of it: a whole
tensor's checksums, or ``{"box": offsets, "sums": checksums}`` of a box of a sharded one
(HSDP's replicated shards, declared shards held twice; small CPU ones always, every one
with strict_replicas)."""


def _saved_checksums(tensors: Mapping[str, TensorEntry]
                     ) -> Callable[[str, tuple[int, ...] | None], Sequence[str] | None]:
    """written() of warn_differing_replicas for a merged manifest's ``tensors``."""
    boxes: dict[tuple[str, tuple[int, ...]], Sequence[str]] = {}

    def written(key: str, box: tuple[int, ...] | None) -> Sequence[str] | None:
        entry = tensors.get(key)
        if entry is None:
            return None
        if box is None:
            return entry.chunks[0].checksums if len(entry.chunks) == 1 else None
        if not boxes:  # (indexed once, at the first box asked for)
            boxes.update(((k, c.offsets), c.checksums)
                         for k, e in tensors.items() for c in e.chunks)
        return boxes.get((key, box))

    return written


def _replica_sums(held: Replica) -> tuple[tuple[int, ...] | None, list[str]]:
    """A replica report as (the box's offsets, or None for a whole tensor; checksums)."""
    if isinstance(held, dict):
        return tuple(held.get("box", ())), list(held.get("sums", ()))
    return None, list(held)


def warn_differing_replicas(step: int, replicas: Sequence[tuple[int, Mapping[str, Replica]]],
                            written: Callable[[str, tuple[int, ...] | None],
                                              Sequence[str] | None],
                            strict: bool = False) -> None:
    """Warn when a rank's copy of a replicated tensor differs from the copy saved: one
    path on every rank is taken as one replicated tensor, written once, so the others'
    values are lost (per-rank values under a shared path, e.g. each rank's RNG state).

    ``replicas``: (rank, its checksums of the replicas it holds but does not write);
    ``written(key, box)``: the checksums of the saved chunk of ``key`` at offsets ``box``
    (None: the key's one chunk; returns None where there is no such chunk);
    ``strict``: raise CheckpointSaveError instead (nothing is committed).
    """
    differing: dict[str, list[int]] = {}
    for rank, held in replicas:
        for key, report in held.items():
            box, sums = _replica_sums(report)
            saved = written(key, box)
            if saved is not None and list(saved) != sums:
                differing.setdefault(key, []).append(rank)
    if differing:
        keys = sorted(differing)
        more = f" and {len(keys) - 5} more" if len(keys) > 5 else ""
        # each with the ranks whose copy is not the one saved (it was one list for all)
        named = ", ".join(f"{k!r} (rank(s) {sorted(differing[k])})" for k in keys[:5]) + more
        if strict:
            raise CheckpointSaveError(
                f"step {step} aborted, nothing committed (strict_replicas=True): ranks hold "
                f"different values of tensor(s) {named}, each saved once as a value several "
                "ranks hold (a replicated tensor, or a box of a sharded one that several "
                "ranks declare; the ranks named hold values other than the copy saved); give "
                "per-rank values per-rank paths (e.g. under the rank; asyncckpt.RNGState() "
                "for generators), or find why the replicas diverged")
        log.warning("step %d: ranks hold different values of tensor(s) %s, each saved once as "
                    "a value several ranks hold (a replicated tensor, or a box of a sharded "
                    "one that several ranks declare; the ranks named hold values other than "
                    "the copy saved, which are lost); a tensor at one path on every rank is "
                    "taken as replicated: give per-rank values per-rank paths, e.g. under the rank "
                    "(asyncckpt.RNGState() for generators)", step, named)


def _check_coverage(key: str, shape: tuple[int, ...], chunks: Sequence[Chunk],
                    partial: bool = False, files: Mapping[str, FileEntry] | None = None,
                    ranks: Sequence[int] = ()) -> None:
    """CheckpointSaveError where ``chunks`` do not tile ``shape`` once (``partial``: gaps
    allowed). ``files`` (by name) and ``ranks`` (every rank of the save) name the ranks
    that saved none of a tensor left uncovered: a DTensor one rank's state leaves out
    (or holds something else at its path) read as a gap in its indices alone."""
    problem = tiling_problem(shape, [(c.offsets, c.lengths) for c in chunks], allow_gaps=partial)
    if problem is not None:
        hint = ""
        if problem == "chunks overlap":
            problem += _which_overlap(shape, chunks)
        elif files is not None:
            wrote = {files[c.file].rank for c in chunks if c.file in files}
            silent = sorted(set(ranks) - wrote)
            if wrote and silent:
                # (not "did they leave it out": a replica of a part, an empty shard, writes
                # nothing either)
                hint = (f"; its chunks come from rank(s) {sorted(wrote)} alone: did one of "
                        f"the ranks that wrote none of it ({few(list(map(str, silent)), 8)}) "
                        "leave it out of its state, or hold something else at its path? (a "
                        "DTensor must be in every rank's state, at the same path)")
            elif wrote and len(chunks) <= 8:
                # (a distributed trial's rank that declared a shard a row short: the gap
                # was named, not whose box stops short of it)
                hint = "; the ranks' boxes: " + "; ".join(
                    f"rank {files[c.file].rank} at offsets {list(c.offsets)}, lengths "
                    f"{list(c.lengths)}" for c in chunks if c.file in files)
        raise CheckpointSaveError(
            f"tensor {key!r} of shape {list(shape)}: {problem}; every part of a tensor must be "
            f"held by exactly one box of the ranks' declared shards{hint}")


def _which_overlap(shape: tuple[int, ...], chunks: Sequence[Chunk], most: int = 4096) -> str:
    """Two overlapping chunks, and whose files they are in (the first ``most`` chunks are
    compared pairwise: this is an error's path). A rank that declared no shard for the
    tensor holds all of it: the usual cause, said so."""
    held = [c for c in chunks[:most] if all(c.lengths)]
    for i, a in enumerate(held):
        for b in held[i + 1:]:
            if all(max(x, y) < min(x + n, y + m) for x, n, y, m in
                   zip(a.offsets, a.lengths, b.offsets, b.lengths, strict=True)):
                told = [f"{c.file} at offsets {list(c.offsets)} (lengths {list(c.lengths)})"
                        for c in (a, b)]
                whole = [c.file for c in (a, b) if tuple(c.lengths) == tuple(shape)]
                hint = (f" ({whole[0]} holds the whole tensor: did its rank pass no shards= "
                        "entry for it?)" if len(whole) == 1 else "")
                return f": the box in {told[0]} and the box in {told[1]}{hint}"
    return ""


# The most "other ranks could not load this step" a group fallback load's decision carries:
# each rank reads the decision, and a thousand ranks' problems, read by a thousand ranks,
# would be a million through the Store.
_MAX_BAD_REPORTED = 16


@dataclass
class FallbackAgreement:
    """The verdicts of one group fallback load, attempt by attempt (see DistContext).

    Under ``<prefix>/<attempt>/``: each rank's verdict (``<rank>``) and the attempt's
    ``decision``, claimed once (``compare_set``): "agreed" (with the ranks that found the
    step damaged) by rank 0 once it has read every verdict, or why not by rank 0 or by a
    rank that failed otherwise or gave up waiting. Every rank acts on the decision, so a
    rank that times out and one that comes late (and would find every verdict posted,
    the stale one of the rank that gave up among them) end the same way. Only rank 0
    reads the verdicts: an attempt costs the Store O(world size) reads.
    """

    ctx: DistContext
    prefix: str

    @property
    def rank(self) -> int:
        return self.ctx.rank

    def __call__(self, attempt: int, step: int | None, problem: str | None,
                 failed: bool = False, gone: bool = False,
                 maybe_intact: bool = False) -> list[Finding]:
        """Post this rank's verdict on ``step`` (its ``attempt``-th try: None is intact;
        ``gone``: the problem is that the step was not found; ``maybe_intact``: it may be
        no damage, as an EIO of an outage, which marks nothing; ``failed``: it raised
        something no fallback answers, or has no step to try, ``step`` None) and wait for
        the group's decision. Returns the other ranks that could not load the step, with
        what they found (at most 16 of them).

        Raises:
            CheckpointError: another rank failed otherwise, or tried another step.
            CheckpointTimeoutError: a rank did not post within the timeout (it did not
                call load(fallback=True), or is stuck).
        """
        ctx = self.ctx
        here = f"{self.prefix}/{attempt}"
        decision_key = f"{here}/decision"
        keys = {r: f"{here}/{r}" for r in range(ctx.world_size)}
        what = "a load with fallback=True"
        absent = "not called load(fallback=True) (in a group every rank must call it)"
        with ctx._store_errors(f"posting its verdict in {what}", CheckpointError):
            ctx.store.set(keys[ctx.rank],
                          json.dumps({"step": step, "problem": problem, "failed": failed,
                                      "gone": gone, "maybe_intact": maybe_intact}))
        if failed:
            self._decide(decision_key, {"rank": ctx.rank, "error": str(problem)})
            return []
        timed_out: CheckpointTimeoutError | None = None
        try:
            if ctx.rank == 0:
                ctx.wait_keys(keys, f"the ranks' verdicts on step {step} of {what}",
                              until=lambda: ctx.store.check([decision_key]), absent=absent,
                              error=CheckpointError)
            else:
                ctx.wait_keys({0: decision_key}, f"rank 0's decision on step {step} of {what}",
                              absent=absent, error=CheckpointError)
        except CheckpointTimeoutError as exc:
            timed_out = exc
            if ctx.rank != 0:  # name the ranks whose verdicts are missing, if any
                silent = ctx.unposted(keys)
                if silent:
                    timed_out = CheckpointTimeoutError(
                        f"rank {ctx.rank}: timed out after {seconds_text(ctx.timeout_s)} "
                        f"waiting for the ranks' verdicts on step {step} of {what} from rank(s) "
                        f"{silent}; they may have died or {absent}")
                    timed_out.ranks = tuple(silent)
        with ctx._store_errors(f"reading the decision of {what}", CheckpointError):
            if timed_out is not None:
                decision = self._decide(decision_key, {"rank": ctx.rank, "error": str(timed_out),
                                                       "timeout": True})
            elif (said := ctx.peek(decision_key)) is not None:
                decision = json.loads(said)
            else:  # rank 0, with every verdict in
                verdicts = [json.loads(v) for v in ctx.store.multi_get(list(keys.values()))]
                decision = self._decide(decision_key, _decision(verdicts, step))
        if not decision.get("agreed"):
            if timed_out is not None and decision.get("rank") == ctx.rank:
                raise timed_out
            cls = CheckpointTimeoutError if decision.get("timeout") else CheckpointError
            raise cls(f"rank {ctx.rank}: load(fallback=True) under {ctx.directory} stopped at "
                      f"step {step}: rank {decision.get('rank')} failed: {decision.get('error')}")
        return [Finding(r, p, bool(g), bool(m[0]) if m else False)
                for r, p, g, *m in decision.get("bad", ()) if r != ctx.rank]

    def _decide(self, key: str, value: dict[str, Any]) -> dict[str, Any]:
        """Claim the attempt's decision; return the one that holds (maybe another's)."""
        got = self.ctx.claim(key, json.dumps(value), "deciding a load with fallback=True",
                             CheckpointError)
        decided: dict[str, Any] = json.loads(got)
        return decided


def _decision(verdicts: Sequence[dict[str, Any]], step: int | None) -> dict[str, Any]:
    """Rank 0's decision on an attempt from every rank's verdict."""
    bad = []
    for r, got in enumerate(verdicts):
        if got["failed"]:
            return {"rank": r, "error": str(got["problem"])}
        if got["step"] != step:
            return {"rank": r, "error": (
                f"it tried step {got['step']} where rank 0 tried step {step}: the ranks see "
                "different committed steps (a directory that is not shared?)")}
        if got["problem"] is not None:
            bad.append((r, str(got["problem"]), bool(got.get("gone")),
                        bool(got.get("maybe_intact"))))
    if len(bad) > _MAX_BAD_REPORTED:
        # the damage first: ranks that did not find the step (a lagging network
        # filesystem's view, on every rank of other nodes), or whose finding may be no
        # damage (an EIO), must not crowd out the one that found it corrupt, whose
        # finding marks the step damaged
        bad.sort(key=lambda b: (b[2], b[3]))
        r, last, _, _ = bad[_MAX_BAD_REPORTED - 1]
        rest = bad[_MAX_BAD_REPORTED - 1:]
        bad[_MAX_BAD_REPORTED - 1] = (r, f"{last} (and {len(bad) - _MAX_BAD_REPORTED} more "
                                         "ranks could not load this step)",
                                      all(b[2] for b in rest),
                                      all(b[2] or b[3] for b in rest) and not all(
                                          b[2] for b in rest))
        del bad[_MAX_BAD_REPORTED:]
    return {"agreed": True, "bad": bad}
