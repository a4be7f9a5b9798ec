"""What each rank reports of a save, and the manifest the coordinator makes of the reports.

A rank's record of a save has two parts. Its *frame* -- the shard file, its header, and
each tensor's dtype, global shape, box and byte range -- follows from the layout, which
training keeps from one save to the next. The rest is new at every save: each tensor's
block checksums, the skeleton (which holds the step's non-tensor values) and the
checksums of the replicas the rank holds but does not write.

Sending, merging, encoding and re-reading every frame at every save cost the coordinator
O(all chunks) of Python a save (~3 s at 64 ranks x 2,000 sharded tensors; ~1.3 s for one
process of 100,000 tensors) and the Store O(all tensors) of traffic into one rank. So:

- A rank (``RecordSender``) sends its whole record whenever the coordinator may not hold
  its frame: at its first save, when its frame changed, and after any save that failed.
  Otherwise it sends a *delta*: the frame's id, the checksums in the frame's order, and
  the skeleton only if it changed -- and then, when only values changed (a learning
  rate, a step count), only those: a *patch*, [index, node] per scalar leaf that
  changed, counted in walk order. A delta is bound to the coordinator that took the
  frame: the nonce of its checkpointer, which every save's ``go`` carries.
- The coordinator (``RecordBook``) keeps each rank's frame. Once it has merged a set of
  frames into a manifest (and, for several ranks, read that back as a load would), it
  keeps the text of the manifest's tensors cut around each chunk's checksums. A save of
  the same frames checks the form of the new checksums and fills them in; the skeleton
  is merged and checked again only when a rank's changed.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from .dist import (
    Replica,
    check_reachable,
    merge_records,
    merged_skeleton,
    warn_differing_replicas,
)
from .errors import CheckpointCorruptError, CheckpointSaveError
from .manifest import (
    FileEntry,
    Manifest,
    check_skeleton,
    compact_json,
    join_parts,
    parse_manifest,
)
from .plan import WritePlan
from .tree import SCALAR_NODES, FlatState, dtype_name

__all__ = ["RecordBook", "RecordSender", "Reports", "frame_of", "full_record"]

# A frame's fields, in the order its text (and so its id) is made of.
_FILE_FIELDS = ("rank", "file", "bytes", "header_bytes", "header_checksum")
_TENSOR_FIELDS = ("dtype", "shape", "kind", "offsets", "lengths", "byte_range")
_HEX = re.compile(r"[0-9a-f]*")


class _Reshaped(Exception):
    """Two skeletons differ in more than their scalar values."""


def skeleton_patch(new: Any, old: Any) -> list[list[Any]] | None:
    """What turns skeleton ``old`` into ``new``: [index, node] for each scalar leaf that
    differs (leaves counted in walk order), or None when they differ in more than that
    (a key, a list's length, a tensor)."""
    out: list[list[Any]] = []
    try:
        _diff(new, old, out, [0])
    except _Reshaped:
        return None
    return out


def _diff(a: Any, b: Any, out: list[list[Any]], seen: list[int]) -> None:
    ta, tb = a.get("t"), b.get("t")
    if ta in SCALAR_NODES and tb in SCALAR_NODES:
        if a != b:
            out.append([seen[0], a])
        seen[0] += 1
    elif ta != tb:
        raise _Reshaped
    elif ta == "dict":
        if len(a["items"]) != len(b["items"]):
            raise _Reshaped
        for (ka, na), (kb, nb) in zip(a["items"], b["items"], strict=True):
            if ka != kb or type(ka) is not type(kb):
                raise _Reshaped
            _diff(na, nb, out, seen)
    elif ta in ("list", "tuple"):
        if len(a["items"]) != len(b["items"]):
            raise _Reshaped
        for na, nb in zip(a["items"], b["items"], strict=True):
            _diff(na, nb, out, seen)
    elif ta == "stateful":
        if a.get("cls") != b.get("cls"):
            raise _Reshaped
        _diff(a["state"], b["state"], out, seen)
    elif a != b:  # array nodes (their keys), and anything else as a whole
        raise _Reshaped


def _scalar_slots(root: list[Any]) -> list[tuple[Any, Any]]:
    """Where each scalar leaf of the skeleton ``root[0]`` sits, as (container, index), in
    the walk order of skeleton_patch."""
    slots: list[tuple[Any, Any]] = []

    def walk(holder: Any, at: Any) -> None:
        node = holder[at]
        t = node.get("t") if isinstance(node, dict) else None
        if t in SCALAR_NODES:
            slots.append((holder, at))
        elif t == "dict":
            for item in node["items"]:
                walk(item, 1)
        elif t in ("list", "tuple"):
            for i in range(len(node["items"])):
                walk(node["items"], i)
        elif t == "stateful":
            walk(node, "state")

    walk(root, 0)
    return slots


def _frame_text(frame: Mapping[str, Any]) -> str:
    return json.dumps(frame, separators=(",", ":"))


def _frame_id(text: str) -> str:
    return xxhash.xxh3_128_hexdigest(text.encode())


def frame_of(rank: int, plan: WritePlan, flat: FlatState) -> dict[str, Any]:
    """A rank's frame: its shard file as ``plan`` lays it out, and each planned tensor's
    dtype, global shape, kind, box and byte range.

    The plan's shapes, taken when the save began: not the live tensors', which the caller
    may resize once staging is over (frames are made later, on the hash thread)."""
    tensors: dict[str, Any] = {}
    boxes, kinds = flat.boxes, flat.kinds
    for it in plan.items:
        shaped = boxes.get(it.key)
        whole = shaped[0] if shaped is not None else it.shape
        box = shaped[1] if shaped is not None else ((0,) * len(it.shape), it.shape)
        tensors[it.key] = {"dtype": dtype_name(it.dtype), "shape": list(whole),
                           "kind": kinds[it.key], "offsets": list(box[0]),
                           "lengths": list(box[1]), "byte_range": [it.offset, it.end]}
    return {"rank": rank, "file": plan.file if plan.items else None,
            "bytes": plan.file_bytes, "header_bytes": len(plan.header),
            "header_checksum": xxhash.xxh3_64_hexdigest(plan.header), "tensors": tensors}


def full_record(frame: Mapping[str, Any], sums: Sequence[Sequence[str]], skeleton: Any,
                replicas: Mapping[str, Replica], fid: str | None = None) -> dict[str, Any]:
    """A rank's whole record: its frame, ``sums`` (the checksums of the frame's tensors,
    in order) and the rest; ``fid``, the frame's id, when it goes to a coordinator.
    ``dist.merge_records`` merges these."""
    tensors = {k: {**t, "checksums": s}
               for (k, t), s in zip(frame["tensors"].items(), sums, strict=True)}
    out = {**frame, "tensors": tensors, "skeleton": skeleton}
    if fid is not None:
        out["frame"] = fid
    if replicas:
        out["replicas"] = dict(replicas)
    return out


class RecordSender:
    """One rank's side: the record of each save, whole or as a delta (module docstring).

    Used by one save at a time (saves of a checkpointer follow one another).
    """

    def __init__(self) -> None:
        self._made_from: tuple[WritePlan, dict[str, str], dict[str, Any]] | None = None
        # the frame's text: kept rather than its objects (~600 bytes a tensor), and read
        # again only for a whole record
        self._frame_text = ""
        self._fid = ""
        # (coordinator, frame id, skeleton) of the last committed save: what the
        # coordinator holds of this rank
        self._acked: tuple[str, str, Any] | None = None
        # what the save in flight sent: (coordinator, frame id, skeleton, sums, replicas)
        self._sent: tuple[str, str, Any, list[list[str]], dict[str, Replica]] | None = None

    def _frame_of(self, rank: int, plan: WritePlan, flat: FlatState
                  ) -> tuple[dict[str, Any] | None, str]:
        """This save's frame and its id; the frame is None when it is the last save's
        (then only its text is kept)."""
        made = self._made_from
        # (the kinds and boxes compare in C; the plan is kept while the layout is)
        if made is not None and made[0] is plan and made[1] == flat.kinds and (
                made[2] == flat.boxes):
            return None, self._fid
        frame = frame_of(rank, plan, flat)
        self._made_from = (plan, flat.kinds, flat.boxes)
        self._frame_text = _frame_text(frame)
        self._fid = _frame_id(self._frame_text)
        return frame, self._fid

    def record(self, *, rank: int, coordinator: str, plan: WritePlan, flat: FlatState,
               sums: list[list[str]], replicas: dict[str, Replica],
               local: bool = False) -> dict[str, Any]:
        """This save's record. ``coordinator`` names the checkpointer that merges it;
        ``sums``: each planned tensor's block checksums, in the plan's order. ``local``:
        the record reaches the coordinator without the Store (it is the coordinator's
        own), so a changed skeleton goes as it is, never as a patch."""
        frame, fid = self._frame_of(rank, plan, flat)
        skeleton = flat.skeleton
        acked = self._acked
        self._sent = (coordinator, fid, skeleton, sums, replicas)
        if acked is None or acked[0] != coordinator or acked[1] != fid:
            return full_record(json.loads(self._frame_text) if frame is None else frame,
                               sums, skeleton, replicas, fid)
        return _delta(rank, fid, sums, skeleton, acked[2], replicas, patch=not local)

    def sent_whole(self) -> dict[str, Any]:
        """The save in flight's record, whole."""
        assert self._sent is not None
        _, fid, skeleton, sums, replicas = self._sent
        return full_record(json.loads(self._frame_text), sums, skeleton, replicas, fid)

    def sent_to(self, book: RecordBook, rank: int) -> dict[str, Any]:
        """The save in flight's record for ``book``, a book of this process's own (the
        view of its part that a rank of a group serves to peers): whole when the book
        does not hold its frame, else what changed (the skeleton as it is, never a patch:
        the book and this sender share one process)."""
        assert self._sent is not None
        _, fid, skeleton, sums, replicas = self._sent
        known = book.frames.get(rank)
        if known is None or known.fid != fid:
            return self.sent_whole()
        return _delta(rank, fid, sums, skeleton, book.skeletons.get(rank), replicas,
                      patch=False)

    def settled(self, committed: bool) -> None:
        """The save in flight is over. Committed: the coordinator holds what it sent.
        Failed: maybe not (it may have failed before the coordinator read it, or the
        coordinator may be gone), so the next save sends its whole record."""
        sent, self._sent = self._sent, None
        self._acked = (sent[0], sent[1], sent[2]) if committed and sent is not None else None


def _delta(rank: int, fid: str, sums: list[list[str]], skeleton: Any, held: Any,
           replicas: dict[str, Replica], *, patch: bool) -> dict[str, Any]:
    """A record that says only what changed against a frame ``fid`` and a skeleton
    ``held`` that its receiver holds: the checksums, and the skeleton if it differs
    (with ``patch``, only its changed scalar leaves where that says it all)."""
    delta: dict[str, Any] = {"rank": rank, "frame": fid, "sums": sums}
    if skeleton != held:  # (compared in C; the walk below only when it differs)
        changed = skeleton_patch(skeleton, held) if patch else None
        if changed is None:
            delta["skeleton"] = skeleton
        else:
            delta["skeleton_patch"] = changed
    if replicas:
        delta["replicas"] = dict(replicas)
    return delta


@dataclass
class _Frame:
    """What the coordinator keeps of one rank's frame."""

    fid: str
    head: dict[str, Any]  # the file fields (rank, file, bytes, ...)
    text: str  # the whole frame's JSON: its tensors, for a merge that needs them again
    counts: list[int]  # checksums per tensor (blocks), in order


@dataclass
class _Report:
    """One rank's record of this save, resolved against its frame."""

    frame: _Frame
    sums: list[list[str]]
    skeleton: Any
    replicas: dict[str, Replica]
    whole: dict[str, Any] | None  # the record itself, when it came whole
    reskeletoned: bool  # its skeleton is not the one it reported last


@dataclass
class _Template:
    """A merged manifest of one set of frames, cut where the checksums go."""

    fids: tuple[str, ...]
    block_bytes: int
    fixed: list[str]  # tensors_json_parts' fixed text, with the quotes around each slot
    order: list[int]  # per chunk, in the text's order: its place among all reports' sums
    files: dict[str, FileEntry]
    dtypes: dict[str, torch.dtype]
    single: dict[str, int]  # the place of each tensor saved as one chunk (as in order)
    # (strict_replicas) the place of each chunk by tensor and offsets, for the replicas
    # of boxes of sharded tensors
    boxes: dict[tuple[str, tuple[int, ...]], int]
    skeletons: list[Any]  # the ranks' skeletons that ``skeleton`` was merged from
    skeleton: Any
    skeleton_text: str


@dataclass
class RecordBook:
    """The merging side: every rank's frame, and the last merged manifest's template
    (the coordinator's, of the manifest; a serving rank's, of the view of its own part).
    Used by one save at a time."""

    frames: dict[int, _Frame] = field(default_factory=dict)
    skeletons: dict[int, Any] = field(default_factory=dict)
    template: _Template | None = None
    # where the scalar leaves of a rank's skeleton sit, once a patch came for it: a
    # holder of the skeleton, and (container, index) per leaf in walk order
    slots: dict[int, tuple[list[Any], list[tuple[Any, Any]]]] = field(default_factory=dict)

    def manifest(self, records: Sequence[dict[str, Any]], *, step: int, library_version: str,
                 block_bytes: int, user_metadata: dict[str, str], created_unix: float,
                 partial: bool = False, metrics: dict[str, float] | None = None,
                 metric_modes: dict[str, str] | None = None,
                 strict_replicas: bool = False) -> tuple[bytes, list[dict[str, Any]]]:
        """The manifest's bytes for these records (every rank's, coordinator's first),
        and each rank's file fields (rank, file, bytes...). ``partial``: the records
        cover only some boxes of their tensors (a rank's view of its own part); a book
        makes manifests of one kind. ``strict_replicas``: ranks' differing values at one
        path fail the save, rather than being warned of.

        Raises CheckpointSaveError when the records do not merge into a checkpoint that
        loads whole; nothing is then committed.
        """
        what = f"step {step} aborted, nothing committed"
        reports = [self._resolve(rec, block_bytes, what) for rec in records]
        fids = tuple(r.frame.fid for r in reports)
        kw: dict[str, Any] = {"step": step, "library_version": library_version,
                              "block_bytes": block_bytes, "user_metadata": user_metadata,
                              "created_unix": created_unix, "partial": partial,
                              "metrics": dict(metrics or {}),
                              "metric_modes": dict(metric_modes or {})}
        t = self.template
        if t is not None and t.fids == fids and t.block_bytes == block_bytes:
            raw = self._fill(t, reports, kw, strict_replicas)
        else:
            self.template = None
            raw = self._merge(reports, fids, kw, strict_replicas)
        return raw, [r.frame.head for r in reports]

    def _resolve(self, rec: dict[str, Any], block_bytes: int, what: str) -> _Report:
        try:
            rank = rec["rank"]
            if "tensors" in rec:  # whole: (re)learn its frame, named by its content here
                frame = {f: rec[f] for f in _FILE_FIELDS}
                frame["tensors"] = {k: {f: t[f] for f in _TENSOR_FIELDS}
                                    for k, t in rec["tensors"].items()}
                sums = [t["checksums"] for t in rec["tensors"].values()]
                text = _frame_text(frame)
                fid = _frame_id(text)
                known = self.frames.get(rank)
                if known is None or known.fid != fid:
                    counts = [_blocks(t["byte_range"], block_bytes)
                              for t in frame["tensors"].values()]
                    known = self.frames[rank] = _Frame(
                        fid, {f: frame[f] for f in _FILE_FIELDS}, text, counts)
                self.skeletons[rank] = rec["skeleton"]
                self.slots.pop(rank, None)
                report = _Report(known, sums, rec["skeleton"], rec.get("replicas", {}), rec,
                                 True)
            else:
                known = self.frames.get(rank)
                if known is None or known.fid != rec["frame"]:
                    raise CheckpointSaveError(
                        f"{what}: rank {rank} reported only what changed since its last "
                        "save, but the coordinator does not hold the record of that save (it "
                        "may have been restarted since, under the same Store); every rank "
                        "reports whole at its next save")
                if "skeleton" in rec:
                    self.skeletons[rank] = rec["skeleton"]
                    self.slots.pop(rank, None)
                elif "skeleton_patch" in rec:
                    self._patch(rank, rec["skeleton_patch"], what)
                report = _Report(known, rec["sums"], self.skeletons[rank],
                                 rec.get("replicas", {}), None,
                                 "skeleton" in rec or "skeleton_patch" in rec)
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise CheckpointSaveError(
                f"{what}: a rank's record of its shard file is malformed "
                f"({type(exc).__name__}: {exc})") from exc
        _check_sums(report, block_bytes, what)
        return report

    def _patch(self, rank: int, patch: Any, what: str) -> None:
        """Apply a rank's skeleton patch to the skeleton it reported last (in place: a
        skeleton that came through the Store is the book's own)."""
        entry = self.slots.get(rank)
        if entry is None:
            holder = [self.skeletons[rank]]  # (the root's place, should it be a leaf)
            entry = self.slots[rank] = (holder, _scalar_slots(holder))
        holder, slots = entry
        for i, node in patch:
            if not (type(i) is int and 0 <= i < len(slots) and isinstance(node, dict)
                    and node.get("t") in SCALAR_NODES):
                raise CheckpointSaveError(
                    f"{what}: rank {rank}'s record changes its skeleton at leaf {i!r:.20} "
                    f"of {len(slots)}, with {node!r:.60}: it does not fit the skeleton it "
                    "reported before")
            container, at = slots[i]
            container[at] = node
        self.skeletons[rank] = holder[0]

    def _merge(self, reports: list[_Report], fids: tuple[str, ...], kw: dict[str, Any],
               strict: bool) -> bytes:
        """Merge the whole records, as a load will read them; keep the template."""
        whole = [r.whole if r.whole is not None else
                 full_record(json.loads(r.frame.text), r.sums, r.skeleton, r.replicas,
                             r.frame.fid) for r in reports]
        manifest = merge_records(whole, strict_replicas=strict, **kw)
        fixed, sums = manifest.tensor_parts()
        skeleton_text = compact_json(manifest.skeleton)
        raw = manifest.encode(join_parts(fixed, sums), skeleton_text)
        if len(whole) > 1:
            # Merged from what other processes reported: read it as a load will, and never
            # commit a manifest that no load could read.
            try:
                parse_manifest(raw, f"the merged manifest of step {manifest.step}")
            except CheckpointCorruptError as exc:
                raise CheckpointSaveError(
                    f"step {manifest.step} aborted, nothing committed: the ranks' shard "
                    f"layouts do not merge into a readable manifest ({exc})") from exc
        # Where each chunk's checksums are among all reports' sums, laid end to end.
        where: dict[str | None, dict[str, int]] = {}
        start = 0
        for rec in whole:
            where[rec["file"]] = {k: start + n for n, k in enumerate(rec["tensors"])}
            start += len(rec["tensors"])
        order: list[int] = []
        single: dict[str, int] = {}
        boxes: dict[tuple[str, tuple[int, ...]], int] = {}
        # Boxes are indexed where replicas of boxes are compared: with strict_replicas, or
        # when a rank reports one (a small box two ranks declare: which boxes are probed
        # follows from the layout, which the template's saves share).
        by_box = strict or any(isinstance(v, dict) for r in reports for v in r.replicas.values())
        for key, entry in manifest.tensors.items():
            order += [where[c.file][c.key] for c in entry.chunks]
            if len(entry.chunks) == 1:
                single[key] = order[-1]
            elif by_box:
                boxes.update(((key, c.offsets), where[c.file][c.key]) for c in entry.chunks)
        # Every chunk has a checksum (one for empty data): its quotes go with the fixed
        # text, so a fill joins each list of checksums with '","' alone.
        if len(fixed) > 1:
            fixed = [fixed[0] + '"', *('"' + f + '"' for f in fixed[1:-1]), '"' + fixed[-1]]
        self.template = _Template(
            fids, manifest.block_bytes, fixed, order, manifest.files,
            {k: e.dtype for k, e in manifest.tensors.items()}, single, boxes,
            [r.skeleton for r in reports], manifest.skeleton, skeleton_text)
        return raw

    def _fill(self, t: _Template, reports: list[_Report], kw: dict[str, Any],
              strict: bool) -> bytes:
        """The template's manifest with this save's checksums and skeleton."""
        step = kw["step"]
        skeletons = [r.skeleton for r in reports]
        if any(r.reskeletoned for r in reports) or any(
                a is not b for a, b in zip(skeletons, t.skeletons, strict=True)):
            skeleton = merged_skeleton(skeletons, step, reports[0].frame.head["rank"], strict)
            if len(reports) > 1:  # (one rank's skeleton and tensors come from one flatten)
                check_reachable(skeleton, t.dtypes)
                try:
                    check_skeleton(skeleton, t.dtypes, f"the merged manifest of step {step}")
                except CheckpointCorruptError as exc:
                    raise CheckpointSaveError(
                        f"step {step} aborted, nothing committed: the ranks' skeletons do not "
                        f"merge into a readable manifest ({exc})") from exc
            t.skeletons, t.skeleton, t.skeleton_text = skeletons, skeleton, compact_json(skeleton)
        sums = list(itertools.chain.from_iterable(r.sums for r in reports))
        if any(r.replicas for r in reports):
            def written(key: str, box: tuple[int, ...] | None) -> list[str] | None:
                at = t.single.get(key) if box is None else t.boxes.get((key, box))
                return None if at is None else sums[at]
            warn_differing_replicas(step, [(r.frame.head["rank"], r.replicas) for r in reports],
                                    written, strict)
        # (checked: 16 lowercase hex digits each, which JSON quotes as they are)
        texts = map('","'.join, map(sums.__getitem__, t.order))
        manifest = Manifest(world_size=len(reports), files=t.files, tensors={},
                            skeleton=t.skeleton, **kw)
        return manifest.encode(join_parts(t.fixed, texts), t.skeleton_text)


def _blocks(byte_range: Sequence[int], block_bytes: int) -> int:
    """How many checksums a tensor of this byte range has (one for empty data)."""
    return max(1, -(-(byte_range[1] - byte_range[0]) // block_bytes))


def _check_sums(report: _Report, block_bytes: int, what: str) -> None:
    """Refuse checksums that do not fit the rank's frame, or are not xxh3-64 hex."""
    sums, counts, rank = report.sums, report.frame.counts, report.frame.head["rank"]
    problem = None
    if (type(sums) is not list or len(sums) != len(counts)
            or not set(map(type, sums)) <= {list}):
        problem = f"{len(sums) if isinstance(sums, list) else 'no'} lists for {len(counts)} tensors"
    elif list(map(len, sums)) != counts:
        n = next(i for i, (s, c) in enumerate(zip(sums, counts, strict=True)) if len(s) != c)
        key, t = list(json.loads(report.frame.text)["tensors"].items())[n]
        lo, hi = t["byte_range"]
        problem = (f"{len(sums[n])} checksum(s) of tensor {key!r} ({hi - lo:,} bytes) where the "
                   f"coordinator's block_bytes={block_bytes:,} gives {counts[n]}: every rank must "
                   "save with the same block_bytes")
    else:
        every = list(itertools.chain.from_iterable(sums))
        if not set(map(type, every)) <= {str} or set(map(len, every)) - {16} or (
                not _HEX.fullmatch("".join(every))):
            problem = "checksums that are not 16 hex digits"
    if problem is not None:
        raise CheckpointSaveError(f"{what}: rank {rank}'s record does not merge into a readable "
                                  f"manifest: {problem}")


@dataclass
class Reports:
    """A checkpointer's memory of its reports: its own side, (coordinator) the book of
    every rank's, and (a rank of a group that serves peers) the book of the view of its
    own part that it serves."""

    sender: RecordSender = field(default_factory=RecordSender)
    book: RecordBook = field(default_factory=RecordBook)
    served: RecordBook = field(default_factory=RecordBook)
    # (coordinator) the metrics and metadata keys whose differing values across ranks
    # were warned of
    metrics_warned: set[str] = field(default_factory=set)
    metadata_warned: set[str] = field(default_factory=set)
