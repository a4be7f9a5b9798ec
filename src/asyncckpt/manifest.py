"""The on-disk format: manifest schema, safetensors headers, checksums.

A shard file is a valid safetensors file: an 8-byte little-endian header length, a
JSON header padded with spaces so that the tensor bytes start on a 4 KiB boundary
(O_DIRECT writes need that), then the tensor bytes. ``manifest.json`` describes
every tensor of the checkpoint: dtype, global shape and its chunks (file, key,
offsets and lengths within the global tensor, byte range in the file, checksums).
Since format version 2, a tensor stored whole in one chunk under its own key (most
tensors) is written short, as ``[dtype, shape, kind, file, start, checksums]``: the
rest of its chunk follows from those (at 25,000 tensors, 0.55x the manifest's bytes,
parsed in 0.65x the time). Since version 3, a chunk of a tensor of several chunks
(a sharded one) stored under the tensor's key is written short too, as ``[file,
offsets, lengths, start, checksums]``: a sharded checkpoint's manifest has ranks x
tensors chunks, and every rank of a load parses all of them. Versions 1 and 2 are
still read.

Everything read from disk is validated here before anything else trusts it: a
forged size, offset or file name gives CheckpointCorruptError, never a huge
allocation or a path outside the checkpoint directory.
"""

from __future__ import annotations

import base64
import binascii
import collections
import functools
import itertools
import json
import math
import operator
import re
import struct
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar, cast, overload

import numpy as np
import torch
import xxhash

from .boxes import slabs_problem, slabs_tile, tiling_problem
from .errors import (
    CheckpointConfigError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointVersionError,
)
from .tree import (
    ARRAY_NODES,
    RESERVED_KEY,
    _is_bits,
    dtype_from_name,
    dtype_name,
    nan_from_bits,
)

FORMAT_NAME = "asyncckpt"
FORMAT_VERSION = 4
# How a metric may rank (Manifest.metric_modes): the least best, or the greatest
METRIC_MODES = ("min", "max")
MANIFEST_NAME = "manifest.json"
ALIGN = 4096
CHECKSUM_ALGORITHM = "xxh3_64"
DEFAULT_BLOCK_BYTES = 4 * 1024 * 1024  # small enough that a resharding read verifies
# only the blocks it needs, large enough that hashing costs nothing per block
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the largest a read accepts (a save writes no more
# than safetensors' own readers accept, WRITE_MAX_HEADER_BYTES: any tool opens the shards)
WRITE_MAX_HEADER_BYTES = 100_000_000
MAX_MANIFEST_BYTES = 1024 * 1024 * 1024
_FILE_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_DIGEST_TAIL = re.compile(rb',"digest":"([0-9a-f]{16})"\}\n?\Z')
_HEX16 = re.compile(r"[0-9a-f]{16}")
_MAX_DIM = 1 << 62
_MAX_UNIX = 253402300799  # 9999-12-31T23:59:59Z, the last second a datetime can show

# torch dtype -> safetensors dtype. Dtypes safetensors lacks are stored as raw bytes
# ("U8" of shape [nbytes]); the manifest keeps their real dtype.
_ST_DTYPES: dict[torch.dtype, str] = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16",
    torch.uint16: "U16", torch.int32: "I32", torch.uint32: "U32", torch.int64: "I64",
    torch.uint64: "U64", torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32",
    torch.float64: "F64", torch.complex64: "C64", torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2", torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
}


def check_block_bytes(block_bytes: object) -> None:
    """Refuse a checksum block size other than a positive multiple of ALIGN (a reader
    seeks to block starts, and receivers refuse manifests with any other)."""
    if type(block_bytes) is not int or block_bytes < ALIGN or block_bytes % ALIGN:
        raise CheckpointConfigError(f"block_bytes={block_bytes!r}: use a multiple of {ALIGN}")


def shard_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def is_shard_file_name(name: str) -> bool:
    """Whether ``name`` looks like a rank's shard file (``rank_*.safetensors``)."""
    return name.startswith("rank_") and name.endswith(".safetensors")


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


# --- checksums -------------------------------------------------------------------------------

def block_checksums(data: memoryview | bytes, block_bytes: int) -> list[str]:
    """xxh3-64 of each ``block_bytes`` block of ``data`` (one entry for empty data)."""
    if len(data) <= block_bytes:  # one block (or empty data): most tensors
        return [xxhash.xxh3_64_hexdigest(data)]
    return [xxhash.xxh3_64_hexdigest(data[i:i + block_bytes])
            for i in range(0, len(data), block_bytes)]


class BlockHasher:
    """Streams bytes through xxh3-64, emitting one digest per ``block_bytes`` block.

    Lets a reader hash each piece right after reading it, while it is still in cache.
    """

    def __init__(self, total: int, block_bytes: int):
        self.total = total
        self.block_bytes = block_bytes
        self.digests: list[str] = []
        self._h = xxhash.xxh3_64()
        self._in_block = 0
        self._seen = 0

    def update(self, data: memoryview) -> None:
        pos = 0
        n = len(data)
        while pos < n:
            take = min(n - pos, self.block_bytes - self._in_block)
            self._h.update(data[pos:pos + take])
            pos += take
            self._in_block += take
            self._seen += take
            if self._in_block == self.block_bytes:
                self.digests.append(self._h.hexdigest())
                self._h.reset()
                self._in_block = 0

    def finish(self) -> list[str]:
        if self._in_block or not self.digests:
            self.digests.append(self._h.hexdigest())
        return self.digests


# --- safetensors header ----------------------------------------------------------------------

@dataclass(frozen=True)
class HeaderEntry:
    """One tensor in a safetensors header; offsets are relative to the body start."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def st_dtype_and_shape(dtype: torch.dtype, shape: tuple[int, ...], nbytes: int
                       ) -> tuple[str, list[int]]:
    st = _ST_DTYPES.get(dtype)
    if st is None:
        return "U8", [nbytes]
    return st, list(shape)


def encode_header(entries: Iterable[HeaderEntry], metadata: dict[str, str] | None = None
                  ) -> bytes:
    """Encode a safetensors header (length prefix included), padded to a 4 KiB multiple."""
    header: dict[str, Any] = {RESERVED_KEY: {"format": "pt", **(metadata or {})}}
    for e in entries:
        st, shape = st_dtype_and_shape(e.dtype, e.shape, e.end - e.start)
        header[e.key] = {"dtype": st, "shape": shape, "data_offsets": [e.start, e.end]}
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    total = align_up(8 + len(raw))
    raw = raw + b" " * (total - 8 - len(raw))
    return struct.pack("<Q", len(raw)) + raw


def decode_header(prefix: bytes, path: str) -> tuple[dict[str, Any], int]:
    """Parse a safetensors header given the file's first bytes; return (header, body offset).

    Raises CheckpointCorruptError when the header is malformed; ``prefix`` must hold at
    least 8 bytes plus the declared header length.
    """
    if len(prefix) < 8:
        raise CheckpointCorruptError(f"{path}: file too short for a safetensors header", path=path)
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES:
        raise CheckpointCorruptError(f"{path}: safetensors header length {n} is implausible",
                                     path=path)
    if len(prefix) < 8 + n:
        raise CheckpointCorruptError(f"{path}: header truncated ({len(prefix) - 8} of {n} bytes)",
                                     path=path)
    try:
        header = json.loads(prefix[8:8 + n])
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointCorruptError(f"{path}: safetensors header is not JSON: {exc}",
                                     path=path) from exc
    if not isinstance(header, dict):
        raise CheckpointCorruptError(f"{path}: safetensors header is not an object", path=path)
    return header, 8 + n


# --- manifest --------------------------------------------------------------------------------

class Chunk(NamedTuple):
    """A box of a tensor stored contiguously (row-major) in one file.

    (A NamedTuple, as TensorEntry is: a load makes one of each per tensor, and a frozen
    dataclass took ~3x as long to build, ~0.13 s of a load of 100,000 tensors.)"""

    file: str
    key: str
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    byte_range: tuple[int, int]
    checksums: tuple[str, ...]

    @property
    def nbytes(self) -> int:
        return self.byte_range[1] - self.byte_range[0]


class ChunkTable(Sequence[Chunk]):
    """The chunks of one sharded tensor, held as columns: a Chunk is made only when asked
    for (a loading rank asks for the few its box meets: ``meeting``).

    Every rank of a load reads a sharded checkpoint's whole manifest, ranks x tensors
    chunks: held as Chunk objects, ~420 bytes each (512 ranks x 1,000 tensors: 213 MB in
    every process of the load); as columns, ~90. ``rows`` holds per chunk [file index
    into ``files``, first byte, end byte, offsets..., lengths...]; ``sums``, every
    chunk's checksums (16 hex digits each) end to end, chunk ``i``'s from checksum
    ``at[i]`` to ``at[i + 1]``.
    """

    __slots__ = ("at", "files", "key", "rows", "sums")

    def __init__(self, key: str, files: tuple[str, ...], rows: np.ndarray, sums: str,
                 at: np.ndarray):
        self.key, self.files, self.rows, self.sums, self.at = key, files, rows, sums, at

    @classmethod
    def of(cls, key: str, files: tuple[str, ...], file_index: Any, starts: Any, ends: Any,
           boxes: np.ndarray, counts: Any, sums: str) -> ChunkTable:
        """From columns: each chunk's index into ``files``, first and end byte, box (its
        offsets, then its lengths) and count of checksums; ``sums``, those end to end."""
        n = len(boxes)
        rows = np.empty((n, 3 + boxes.shape[1]), dtype=np.int64)
        rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3:] = file_index, starts, ends, boxes
        at = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(counts, out=at[1:])
        return cls(key, files, rows, sums, at)

    def __len__(self) -> int:
        return len(self.rows)

    @overload
    def __getitem__(self, i: int) -> Chunk: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[Chunk, ...]: ...

    def __getitem__(self, i: int | slice) -> Chunk | tuple[Chunk, ...]:
        if isinstance(i, slice):
            return tuple(self._made(range(len(self))[i]))
        if not -len(self) <= i < len(self):
            raise IndexError(f"chunk {i} of {len(self)}")
        return next(self._made([i % len(self)]))

    def __iter__(self) -> Iterator[Chunk]:
        return self._made(range(len(self)))

    def _made(self, which: Iterable[int]) -> Iterator[Chunk]:
        which = list(which)
        nd = (self.rows.shape[1] - 3) // 2
        rows, at, sums, files, key = self.rows[which].tolist(), self.at.tolist(), self.sums, \
            self.files, self.key
        for i, r in zip(which, rows, strict=True):
            lo, hi = at[i] * 16, at[i + 1] * 16
            yield Chunk(files[r[0]], key, tuple(r[3:3 + nd]), tuple(r[3 + nd:]), (r[1], r[2]),
                        tuple(sums[j:j + 16] for j in range(lo, hi, 16)))

    def meeting(self, box: tuple[tuple[int, ...], tuple[int, ...]]) -> list[Chunk]:
        """The chunks whose boxes touch ``box`` (and maybe a few more: a superset of those
        whose intersection with it is not empty), in order."""
        rows = self.rows
        nd = (rows.shape[1] - 3) // 2
        try:
            lo = np.asarray(box[0], dtype=np.int64)
            hi = lo + np.asarray(box[1], dtype=np.int64)
        except OverflowError:  # (no tensor is this large: every chunk, for intersect to judge)
            return list(self)
        offs, lens = rows[:, 3:3 + nd], rows[:, 3 + nd:]
        near = ((offs <= hi) & (offs + lens >= lo)).all(axis=1)
        return list(self._made(np.flatnonzero(near).tolist()))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ChunkTable | tuple | list):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"ChunkTable({self.key!r}, {len(self)} chunks)"


class TensorEntry(NamedTuple):
    """One array leaf of the checkpoint: dtype, global shape and its chunks."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    kind: str  # "torch" | "numpy" | "numpy_scalar"
    chunks: tuple[Chunk, ...] | ChunkTable

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class FileEntry:
    name: str
    bytes: int
    rank: int
    header_bytes: int
    """Length of the safetensors header (prefix included): the body starts here."""
    header_checksum: str
    """xxh3-64 of those header bytes, so a changed header is caught like changed data."""


@dataclass(frozen=True)
class Manifest:
    """Everything a reader needs to know about one committed checkpoint."""

    step: int
    world_size: int
    created_unix: float
    library_version: str
    block_bytes: int
    files: dict[str, FileEntry]
    tensors: dict[str, TensorEntry]
    skeleton: dict[str, Any]
    user_metadata: dict[str, str] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    partial: bool = False
    """True for a view that holds only some boxes of its tensors (what a peer serves)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """What ``save_async(metrics=...)`` recorded (a validation loss...), for keep_best."""
    metric_modes: dict[str, str] = field(default_factory=dict)
    """Which way a metric ranks ("min" or "max"), as the saving checkpointer's
    ``best_metric`` and ``best_mode`` said: what a later reader ranks by unless told."""
    pruned: bool = field(default=False, compare=False)
    """True for a load's view without some tensors (exclude=): the files hold more."""
    from_headers: bool = field(default=False, compare=False)
    """True for what plain safetensors files' headers describe (load_safetensors): no
    manifest to check them against."""

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files.values())

    def to_json(self) -> bytes:
        return self.encode()

    def tensor_parts(self) -> tuple[list[str], list[str]]:
        """tensors_json_parts of this manifest's tensors, in its format version."""
        return tensors_json_parts(self.tensors, self.files, version=self.format_version)

    def encode(self, tensors_text: str | None = None, skeleton_text: str | None = None) -> bytes:
        """The manifest's bytes; ``tensors_text`` / ``skeleton_text``, when given, stand
        for the JSON of ``tensors`` / ``skeleton`` (a coordinator that fills a template
        of the tensors' text rather than building their objects again)."""
        head = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "library_version": self.library_version,
            "step": self.step,
            "created_unix": self.created_unix,
            "world_size": self.world_size,
            "checksum": {"algorithm": CHECKSUM_ALGORITHM, "block_bytes": self.block_bytes},
            "files": {n: {"bytes": f.bytes, "rank": f.rank, "header_bytes": f.header_bytes,
                          "header_checksum": f.header_checksum}
                      for n, f in self.files.items()},
        }
        # Compact: an indented dump takes Python's slow encoder (0.3 s for 4,000 tensors).
        # The tensors, one small object per chunk (100,000 and more in a large job),
        # are written by tensors_json_parts: building the dicts for json.dumps took as
        # long as encoding them.
        if tensors_text is None:
            tensors_text = join_parts(*self.tensor_parts())
        if skeleton_text is None:
            skeleton_text = compact_json(self.skeleton)
        parts = [compact_json(head)[:-1], ',"tensors":', tensors_text,
                 ',"skeleton":', skeleton_text, ',"user_metadata":',
                 compact_json(self.user_metadata)]
        if self.metrics:
            parts += [',"metrics":', compact_json(metrics_text(self.metrics))]
        if self.metric_modes:
            parts += [',"metric_modes":', compact_json(self.metric_modes)]
        if self.partial:
            parts.append(',"partial":true')
        parts.append("}")
        return seal("".join(parts).encode("ascii"))


def metrics_text(metrics: Mapping[str, float]) -> dict[str, str]:
    """Metrics as a manifest (and a rank's record of a save) holds them: each value as
    Python's repr, as the skeleton's floats, so that NaN and infinities are JSON too."""
    return {k: repr(float(v)) for k, v in metrics.items()}


def compact_json(v: Any) -> str:
    """JSON as a manifest holds it: compact, ASCII."""
    return json.dumps(v, separators=(",", ":"), ensure_ascii=True)


def tensors_json_parts(tensors: dict[str, TensorEntry], files: Mapping[str, FileEntry], *,
                       version: int = FORMAT_VERSION) -> tuple[list[str], list[str]]:
    """The "tensors" object of a manifest, as json.dumps would write it (compact, ASCII),
    cut around each chunk's checksums: ``(fixed, sums)`` with ``len(fixed) == len(sums)
    + 1``, the text being ``fixed[0] + sums[0] + fixed[1] + ... + fixed[-1]``
    (join_parts). Between saves of one layout only the sums change. In the short forms
    of ``version``: from 2, a tensor that is one whole chunk under its own key is written
    as ``[dtype, shape, kind, file, start, checksums]``; from 3, a chunk of several under
    the tensor's key as ``[file, offsets, lengths, start, checksums]``; from 4, the
    chunks of a tensor of TABLE_MIN_CHUNKS or more, all under its key, as a table
    (``files`` gives the rank that wrote each file). Version 1 knows only the long forms.

    Every string goes through the json module's own ASCII quoting; every number is an
    int's decimal digits. (A test holds it to json.dumps of the same dicts.)
    """
    quote = _quote
    names: dict[str, str] = {}  # (few files, many chunks)
    fixed: list[str] = []
    sums: list[str] = []
    pending = "{"
    short, short_chunks = version >= 2, version >= 3
    ranks = _ranks_of(files) if version >= 4 else None
    for n, (k, t) in enumerate(tensors.items()):
        qk = quote(k)
        chunks = t.chunks
        rows = None
        if ranks is not None and t.shape and len(chunks) >= TABLE_MIN_CHUNKS and (
                chunks.key == k if type(chunks) is ChunkTable else {c.key for c in chunks} == {k}):
            rows = _table_rows(chunks, ranks)
        if rows is not None:
            pending += (f'{"," if n else ""}{qk}:{{"dtype":{quote(dtype_name(t.dtype))},'
                        f'"shape":[{_ints(t.shape)}],"kind":{quote(t.kind)},"table":{{'
                        f'"rows":[{rows}],"checksums":[')
            for i, c in enumerate(chunks):  # (a slot per chunk, as short chunks have)
                fixed.append(pending if not i else pending + ",")
                sums.append(",".join(map(quote, c.checksums)))
                pending = ""
            pending = "]}}"
            continue
        if short and len(chunks) == 1 and _is_whole_chunk(chunks[0], k, t.shape):
            c = chunks[0]
            qf = names.get(c.file)
            if qf is None:
                qf = names[c.file] = quote(c.file)
            fixed.append(f'{pending}{"," if n else ""}{qk}:[{quote(dtype_name(t.dtype))},'
                         f'[{_ints(t.shape)}],{quote(t.kind)},{qf},{int(c.byte_range[0])},[')
            sums.append(",".join(map(quote, c.checksums)))
            pending = "]]"
            continue
        pending += (f'{"," if n else ""}{qk}:{{"dtype":{quote(dtype_name(t.dtype))},'
                    f'"shape":[{_ints(t.shape)}],"kind":{quote(t.kind)},"chunks":[')
        for i, c in enumerate(chunks):
            qf = names.get(c.file)
            if qf is None:
                qf = names[c.file] = quote(c.file)
            if short_chunks and c.key == k:
                fixed.append(f'{pending}{"," if i else ""}[{qf},[{_ints(c.offsets)}],'
                             f'[{_ints(c.lengths)}],{int(c.byte_range[0])},[')
                sums.append(",".join(map(quote, c.checksums)))
                pending = "]]"
                continue
            qck = qk if c.key == k else quote(c.key)
            fixed.append(
                f'{pending}{"," if i else ""}{{"file":{qf},"key":{qck},'
                f'"offsets":[{_ints(c.offsets)}],"lengths":[{_ints(c.lengths)}],'
                f'"byte_range":[{_ints(c.byte_range)}],"checksums":[')
            sums.append(",".join(map(quote, c.checksums)))
            pending = "]}"
        pending += "]}"
    fixed.append(pending + "}")
    return fixed, sums


def _ranks_of(files: Mapping[str, FileEntry]) -> dict[str, int]:
    """Each file's writing rank, for the files whose rank names no other file: how a
    table's rows name their files (format version 4)."""
    count = collections.Counter(f.rank for f in files.values())
    return {n: f.rank for n, f in files.items() if count[f.rank] == 1 and f.rank < _MAX_INT64}


def _table_rows(chunks: Sequence[Chunk], ranks: Mapping[str, int]) -> str | None:
    """The text of a table's rows: [rank, start, offsets..., lengths...] per chunk, end to
    end (format version 4); None when a chunk's file has no rank of its own in
    ``ranks``."""
    if type(chunks) is ChunkTable:
        rank = [ranks.get(f, -1) for f in chunks.files]
        if min(rank) < 0:
            return None
        rows = np.delete(chunks.rows, 2, axis=1)  # (the end: start + the chunk's bytes)
        rows[:, 0] = np.array(rank, dtype=np.int64)[rows[:, 0]]
        return _ints(rows.ravel().tolist())
    if not {c.file for c in chunks} <= ranks.keys():
        return None
    return ",".join(map(str, itertools.chain.from_iterable(
        (ranks[c.file], c.byte_range[0], *c.offsets, *c.lengths) for c in chunks)))


def _is_whole_chunk(c: Chunk, key: str, shape: tuple[int, ...]) -> bool:
    """Whether ``c`` is all of tensor ``key`` of ``shape``, stored under that key: what
    a short entry (format version 2) describes."""
    return c.key == key and c.lengths == shape and not any(c.offsets)


def join_parts(fixed: list[str], sums: Iterable[str]) -> str:
    """The text that tensors_json_parts cut: ``fixed`` and ``sums`` interleaved."""
    # (fixed has one more part than sums: the zip leaves it for the end)
    return "".join(itertools.chain.from_iterable(zip(fixed, sums, strict=False))) + fixed[-1]


def _ints(v: Iterable[int]) -> str:
    return ",".join(map(str, map(int, v)))


# The json module's C quoting of a str as an ASCII JSON string (what json.dumps uses).
_quote: Any = getattr(json.encoder, "c_encode_basestring_ascii", None) or (
    json.encoder.encode_basestring_ascii)


def seal(body: bytes) -> bytes:
    """Close a manifest's JSON object with its own digest.

    The digest covers every other byte, so a changed scalar of the state, a key or the
    step is caught like a changed tensor byte. ``body`` is the JSON without it.
    """
    head = memoryview(body)[:-1] if body.endswith(b"}") else body
    # (one copy of a manifest that may be tens of MB: bytes.join takes the view)
    return b"".join((head, b',"digest":"', xxhash.xxh3_64_hexdigest(body).encode(), b'"}\n'))


def is_sealed(raw: bytes) -> bool:
    """Whether ``raw`` ends with the digest :func:`seal` gives it, and the digest matches."""
    m = _DIGEST_TAIL.search(raw, max(0, len(raw) - 64))
    return m is not None and xxhash.xxh3_64_hexdigest(
        raw[:m.start()] + b"}") == m.group(1).decode()


class _Check:
    """Small helpers that turn a bad manifest field into CheckpointCorruptError."""

    def __init__(self, path: str):
        self.path = path

    def fail(self, what: str, key: str | None = None) -> CheckpointCorruptError:
        where = f" (tensor {key!r})" if key else ""
        return CheckpointCorruptError(f"{self.path}: malformed manifest{where}: {what}",
                                      path=self.path, key=key)

    def int_(self, v: Any, what: str, key: str | None = None, lo: int = 0) -> int:
        if type(v) is not int or v < lo:
            raise self.fail(f"{what} must be an integer >= {lo}, got {v!r:.80}", key)
        return v

    def ints(self, v: Any, what: str, key: str | None = None) -> tuple[int, ...]:
        if type(v) is list and len(v) <= 64:  # the common, valid case: checked in one pass
            out = tuple(v)
            if all(type(x) is int for x in out) and (not out or min(out) >= 0):
                return out
        if not isinstance(v, list) or len(v) > 64:
            raise self.fail(f"{what} must be a list of at most 64 integers", key)
        return tuple(self.int_(x, what, key) for x in v)

    def obj(self, v: Any, what: str, key: str | None = None) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise self.fail(f"{what} must be an object", key)
        return v

    def str_(self, v: Any, what: str, key: str | None = None) -> str:
        if not isinstance(v, str):
            raise self.fail(f"{what} must be a string", key)
        return v


_P = TypeVar("_P")


def _on_a_fresh_stack(parse: Callable[[bytes, str], _P], raw: bytes, path: str
                      ) -> BaseException | None:
    """What ``parse(raw, path)`` raises on a thread's own, empty stack (None: nothing)."""
    got: list[BaseException | None] = []

    def run() -> None:
        try:
            parse(raw, path)
            got.append(None)
        except BaseException as exc:  # (reported to the caller's thread)
            got.append(exc)

    t = threading.Thread(target=run, name="asyncckpt-json")
    t.start()
    t.join()
    return got[0]  # (run() notes every outcome: it catches BaseException)


def _deep_stack_aware(parse: Callable[[bytes, str], _P]) -> Callable[[bytes, str], _P]:
    """``parse``, telling apart a manifest nested too deep for any stack (damage: the
    library never writes one) from an intact one that the caller's own deep stack cannot
    parse. The digest has matched by then; a fallback load that took the latter for
    damage would silently load an older step. Python's limit shows in json's parser
    (3.11) or in the checks of the skeleton after it (3.12+, where json counts C
    recursion apart)."""

    @functools.wraps(parse)
    def wrapper(raw: bytes, path: str) -> _P:
        try:
            return parse(raw, path)
        except RecursionError as exc:
            fresh = _on_a_fresh_stack(parse, raw, path)
            if fresh is None:  # intact: it is the caller's stack that is deep
                raise CheckpointError(
                    f"{path}: the manifest nests deeper than Python's recursion limit "
                    f"({sys.getrecursionlimit()}) allows from this call stack; the checkpoint "
                    "is intact: load it from a shallower call stack, or raise the limit "
                    "(sys.setrecursionlimit)") from exc
            if isinstance(fresh, CheckpointError):
                raise fresh from None
            if isinstance(fresh, RecursionError):
                raise CheckpointCorruptError(f"{path}: manifest is not valid JSON: {fresh}",
                                             path=path) from exc
            raise fresh from exc

    return wrapper


class _Head(NamedTuple):
    """What a manifest says before its tensors: parsed and checked by :func:`_parse_head`."""

    check: _Check
    doc: dict[str, Any]
    version: int
    block_bytes: int
    files: dict[str, FileEntry]
    partial: bool


def _refuse_undigested(raw: bytes, path: str) -> None:
    """CheckpointVersionError for a whole manifest of the first development builds
    (before 2026-11-21), which carried no digest nor shard header checksums: without this,
    such a checkpoint would be reported corrupt, and a user might delete good data.
    Returns for anything else (a truncated manifest is no complete JSON object)."""
    if len(raw) > 1 << 30:
        return
    try:
        doc = json.loads(raw)  # (a RecursionError is _deep_stack_aware's to judge)
    except (UnicodeDecodeError, ValueError):
        return
    if not (isinstance(doc, dict) and doc.get("format") == FORMAT_NAME
            and doc.get("format_version") == 1 and "digest" not in doc
            and isinstance(doc.get("files"), dict) and not any(
                isinstance(f, dict) and "header_checksum" in f
                for f in doc["files"].values())):
        return
    raise CheckpointVersionError(
        f"{path}: this manifest was written by an early development build of asyncckpt "
        "(before 2026-11-21: no manifest digest, no shard header checksums), which this "
        "release does not read; the checkpoint is not known to be damaged. Load it with the "
        "build that wrote it (the asyncckpt git history before commit 2422d0d) and save the "
        "state again with this one", path=path)


def first_repeat(items: Iterable[Any]) -> Any:
    """The first item of ``items`` met a second time; None where none is."""
    seen: set[Any] = set()
    for x in items:
        if x in seen:
            return x
        seen.add(x)
    return None


class RepeatedKey(ValueError):
    """A JSON object names a key twice (json.loads would keep the last; other readers
    keep the first, or refuse)."""

    def __init__(self, key: str):
        super().__init__(f"the key {key[:100]!r} appears twice in one object (damaged, or "
                         "forged: readers differ on which one counts)")
        self.key = key


def no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict (``object_pairs_hook``); RepeatedKey for a key it
    holds twice."""
    out = dict(pairs)
    if len(out) != len(pairs):
        raise RepeatedKey(first_repeat(k for k, _ in pairs))
    return out


def _parse_head(raw: bytes, path: str) -> _Head:
    """The digest, the JSON, and every field a manifest has before its tensors, checked."""
    c = _Check(path)
    m = _DIGEST_TAIL.search(raw, max(0, len(raw) - 64))
    if m is None:
        _refuse_undigested(raw, path)
        raise CheckpointCorruptError(f"{path}: the manifest does not end with its digest: it "
                                     "was truncated or is not an asyncckpt manifest", path=path)
    if xxhash.xxh3_64_hexdigest(raw[:m.start()] + b"}") != m.group(1).decode():
        raise CheckpointCorruptError(f"{path}: the manifest's digest does not match its "
                                     "contents: it is corrupt", path=path)
    try:
        # (a RecursionError is _deep_stack_aware's to judge; a key twice in one object is
        # refused: a security review's second "tensors" won, which a reader keeping the
        # first, or a strict one, reads otherwise)
        doc = json.loads(raw, object_pairs_hook=no_repeats)
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointCorruptError(f"{path}: manifest is not valid JSON: {exc}",
                                     path=path) from exc
    doc = c.obj(doc, "document")
    if doc.get("format") != FORMAT_NAME:
        raise c.fail(f"format is {doc.get('format')!r:.40}, expected {FORMAT_NAME!r}")
    version = c.int_(doc.get("format_version"), "format_version", lo=1)
    if version > FORMAT_VERSION:
        raise CheckpointVersionError(
            f"{path}: format version {version} is newer than this library reads "
            f"({FORMAT_VERSION}): the checkpoint is not damaged; upgrade asyncckpt to load "
            "it", path=path)
    cs = c.obj(doc.get("checksum"), "checksum")
    if cs.get("algorithm") != CHECKSUM_ALGORITHM:
        raise c.fail(f"unknown checksum algorithm {cs.get('algorithm')!r:.40}")
    block_bytes = c.int_(cs.get("block_bytes"), "checksum.block_bytes", lo=ALIGN)
    if block_bytes % ALIGN:  # a reader seeks to block starts, which must stay aligned
        raise c.fail(f"checksum.block_bytes {block_bytes} is not a multiple of {ALIGN}")
    files: dict[str, FileEntry] = {}
    for name, f in c.obj(doc.get("files"), "files").items():
        if not _FILE_NAME.fullmatch(name) or name in (".", ".."):
            raise c.fail(f"file name {name!r:.80} is not a plain file name")
        f = c.obj(f, f"files[{name!r}]")
        size = c.int_(f.get("bytes"), "file bytes")
        if size >= 1 << 63:  # (no file can be: off_t; nor could a listing print it)
            raise c.fail(f"file {name}: its size is impossibly large")
        header_bytes = c.int_(f.get("header_bytes"), "file header_bytes", lo=8)
        if header_bytes > size:
            raise c.fail(f"file {name}: header_bytes {header_bytes} exceed its size {size}")
        if header_bytes > 8 + MAX_HEADER_BYTES:  # a reader allocates and hashes that many
            raise c.fail(f"file {name}: header_bytes {header_bytes} exceed the largest "
                         f"safetensors header ({8 + MAX_HEADER_BYTES} bytes)")
        hsum = f.get("header_checksum")
        if not (isinstance(hsum, str) and _HEX16.fullmatch(hsum)):
            raise c.fail(f"file {name}: header_checksum must be 16 hex digits")
        files[name] = FileEntry(name, size, c.int_(f.get("rank"), "file rank"), header_bytes,
                                hsum)
    partial = doc.get("partial", False)
    if type(partial) is not bool:
        raise c.fail("partial must be true or false")
    return _Head(c, doc, version, block_bytes, files, partial)


@dataclass(frozen=True)
class ManifestSummary:
    """What a listing shows of a step (``asyncckpt ls``), read without parsing every
    tensor entry (the digest is checked, so damage still shows)."""

    step: int
    created_unix: float
    library_version: str
    files: dict[str, FileEntry]
    tensors: int
    partial: bool
    metrics: dict[str, float] = field(default_factory=dict)
    metric_modes: dict[str, str] = field(default_factory=dict)
    manifest_bytes: int = 0
    """The size of ``manifest.json`` itself (a state of many scalars: most of the step)."""

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files.values())


def _metrics(c: _Check, doc: dict[str, Any]) -> dict[str, float]:
    """The manifest's metrics: names to floats, written as Python's repr of each."""
    out = {}
    for name, v in c.obj(doc.get("metrics", {}), "metrics").items():
        text = c.str_(v, f"metrics[{name!r:.80}]")
        try:
            out[name] = float(text)
        except ValueError:
            raise c.fail(f"metrics[{name!r:.80}] holds {v!r:.40}, which is no number") from None
    return out


def _metric_modes(c: _Check, doc: dict[str, Any]) -> dict[str, str]:
    """The manifest's metric_modes: metric names to "min" or "max". An entry of another
    value (a later library's way of ranking), or a field that is no object, is passed
    over, as if none was recorded: the step's data is not in question."""
    modes = doc.get("metric_modes", {})  # (advice, not data: one of another shape too)
    if not isinstance(modes, dict):
        return {}
    return {name: mode for name, mode in modes.items() if name and mode in METRIC_MODES}


def _created(c: _Check, doc: dict[str, Any]) -> float:
    created = doc.get("created_unix")
    if not isinstance(created, (int, float)) or isinstance(created, bool) or not (
            0 <= created <= _MAX_UNIX):
        raise c.fail(f"created_unix must be seconds from 0 to {_MAX_UNIX} (year 9999), got "
                     f"{created!r:.40}")
    return float(created)


@_deep_stack_aware
def parse_manifest_summary(raw: bytes, path: str) -> ManifestSummary:
    """:func:`parse_manifest`'s checks but of the tensor entries, which are only counted
    (a manifest of 100,000 tensors: ~0.25 s rather than ~0.7 s)."""
    h = _parse_head(raw, path)
    c, doc = h.check, h.doc
    tensors = c.obj(doc.get("tensors"), "tensors")
    return ManifestSummary(step=c.int_(doc.get("step"), "step"), created_unix=_created(c, doc),
                           library_version=c.str_(doc.get("library_version"),
                                                  "library_version"),
                           files=h.files, tensors=len(tensors), partial=h.partial,
                           metrics=_metrics(c, doc), metric_modes=_metric_modes(c, doc))


@_deep_stack_aware
def parse_manifest(raw: bytes, path: str) -> Manifest:
    """Parse and validate manifest bytes; raise CheckpointCorruptError naming what is wrong."""
    h = _parse_head(raw, path)
    c, doc, version, block_bytes, files, partial = h
    tensors: dict[str, TensorEntry] = {}
    short = version >= 2  # (and from 3, short chunks: _parse_tensor's)
    named = _Named(files)
    for key, t in c.obj(doc.get("tensors"), "tensors").items():
        if short and type(t) is list:
            tensors[key] = (_parse_short_tensor(key, t, files, block_bytes)
                            or _parse_short_tensor_checked(c, key, t, files, block_bytes,
                                                           partial))
        else:
            tensors[key] = _parse_tensor(c, key, c.obj(t, "tensor", key), files,
                                         block_bytes, partial, version, named)
    _check_layout(c, files, tensors)
    skeleton = c.obj(doc.get("skeleton"), "skeleton")
    _check_skeleton(c, skeleton, {k: t.dtype for k, t in tensors.items()}, partial=partial)
    meta = c.obj(doc.get("user_metadata", {}), "user_metadata")
    created = _created(c, doc)
    return Manifest(
        step=c.int_(doc.get("step"), "step"),
        world_size=c.int_(doc.get("world_size"), "world_size", lo=1),
        created_unix=created,
        library_version=c.str_(doc.get("library_version"), "library_version"),
        block_bytes=block_bytes, files=files, tensors=tensors, skeleton=skeleton,
        user_metadata={str(k): str(v) for k, v in meta.items()}, format_version=version,
        partial=partial, metrics=_metrics(c, doc), metric_modes=_metric_modes(c, doc))


# Names of the dtypes a manifest may hold, for a fast lookup; others take the slow path.
_STORABLE_DTYPES: dict[str, torch.dtype] = {
    dtype_name(d): d for d in vars(torch).values()
    if isinstance(d, torch.dtype) and not _is_bits(dtype_name(d))}


# The same with each dtype's item size, which a torch.dtype computes at every ask.
_SIZED_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    n: (d, d.itemsize) for n, d in _STORABLE_DTYPES.items()}


# The dtypes a numpy array (an "ndarray"/"npscalar" skeleton node) can be restored as.
_NUMPY_DTYPES = frozenset((
    torch.bool, torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.float16, torch.float32, torch.float64, torch.complex64,
    torch.complex128))


def _nonneg_ints(v: Any) -> bool:
    """A list of at most 64 integers >= 0 (bools are no integers here)."""
    return (type(v) is list and len(v) <= 64 and _INT_TYPE.issuperset(map(type, v))
            and (not v or min(v) >= 0))


_INT_TYPE = frozenset((int,))
_STR_TYPE = frozenset((str,))
_HEX_RUN = re.compile(r"[0-9a-f]*")
# what the name of a torch dtype looks like (float8_e4m3fn, bfloat16, uint16, complex32),
# of this torch's or a newer one's
_DTYPE_LIKE = re.compile(r"(?:u?int|b?float|complex)[0-9]{1,3}(?:_[a-z0-9]{1,12}){0,3}")


def _hex16s(sums: list[Any]) -> bool:
    """Every item is a string of 16 lowercase hex digits."""
    if len(sums) == 1:  # most chunks: one checksum block
        return type(sums[0]) is str and _HEX16.fullmatch(sums[0]) is not None
    return (_STR_TYPE.issuperset(map(type, sums)) and set(map(len, sums)) <= {16}
            and _HEX_RUN.fullmatch("".join(sums)) is not None)


def _parse_whole_tensor(key: str, t: dict[str, Any], files: dict[str, FileEntry],
                        block_bytes: int) -> TensorEntry | None:
    """The common entry, one chunk that is the whole tensor, checked in one pass.

    Returns None for anything else (or anything wrong): the full parser then takes it
    and names the problem. Accepts exactly what the full parser accepts. (It runs once
    per tensor of every load: kept cheap.)
    """
    head = _fast_head(t)
    if head is None or len(head[3]) != 1:
        return None
    dtype, dims, kind, raw = head
    chunk = _fast_chunk(key, raw[0], files, dims, dtype.itemsize, block_bytes, whole=True)
    return None if chunk is None else TensorEntry(dtype, dims, kind, (chunk,))


_KINDS = frozenset(("torch", "numpy", "numpy_scalar"))


def _parse_chunked_tensor(key: str, t: dict[str, Any], files: dict[str, FileEntry],
                          block_bytes: int, partial: bool, version: int) -> TensorEntry | None:
    """A tensor of several chunks (a sharded one), valid, checked chunk by chunk in one
    pass each; None for anything else or anything wrong, which the full parser then
    names. Accepts exactly what the full parser accepts."""
    head = _fast_head(t)
    if head is None:
        return None
    dtype, dims, kind, raw = head
    itemsize, short = dtype.itemsize, version >= 3
    if short and raw and type(raw[0]) is list:  # (what a sharded save writes)
        at_once = _short_chunks_at_once(key, raw, files, dims, itemsize, block_bytes, partial)
        if at_once is not None:
            return TensorEntry(dtype, dims, kind, at_once)
    chunks = []
    for ch in raw:  # (short chunks among long ones, which no writer makes: the checked parse)
        chunk = _fast_chunk(key, ch, files, dims, itemsize, block_bytes, whole=False)
        if chunk is None:
            return None
        chunks.append(chunk)
    if tiling_problem(dims, [(ch.offsets, ch.lengths) for ch in chunks],
                      allow_gaps=partial) is not None:
        return None
    return TensorEntry(dtype, dims, kind, tuple(chunks))


_LIST_TYPE = frozenset((list,))


def _short_chunks_at_once(key: str, raw: list[Any], files: dict[str, FileEntry],
                          dims: tuple[int, ...], itemsize: int, block_bytes: int,
                          partial: bool) -> tuple[Chunk, ...] | ChunkTable | None:
    """All the chunks of tensor ``key`` (of shape ``dims``, at least 1-D) when every one
    is short and valid and they tile it (or, ``partial``, do not overlap); None for
    anything else, which the chunk-by-chunk parse then takes. The checks run column by
    column, each one pass in C over all the chunks: a sharded checkpoint's manifest holds
    ranks x tensors chunks and every rank of a load reads them all (64 x 1,000 chunks:
    ~3x faster than a Python call per chunk)."""
    ndim = len(dims)
    if (not ndim or not _LIST_TYPE.issuperset(map(type, raw))
            or set(map(len, raw)) != {5}):
        return None
    names, offs, lens, starts, sums = zip(*raw, strict=True)
    if not (_STR_TYPE.issuperset(map(type, names)) and _LIST_TYPE.issuperset(map(type, offs))
            and _LIST_TYPE.issuperset(map(type, lens)) and _INT_TYPE.issuperset(map(type, starts))
            and _LIST_TYPE.issuperset(map(type, sums)) and set(names) <= files.keys()
            and set(map(len, offs)) == {ndim} and set(map(len, lens)) == {ndim}):
        return None
    flat_o = list(itertools.chain.from_iterable(offs))
    flat_l = list(itertools.chain.from_iterable(lens))
    if not (_INT_TYPE.issuperset(map(type, flat_o)) and _INT_TYPE.issuperset(map(type, flat_l))
            and min(flat_o) >= 0 and min(flat_l) >= 0 and min(starts) >= 0):
        return None
    partial_dims = []
    for d, size in enumerate(dims):
        o_d, l_d = flat_o[d::ndim], flat_l[d::ndim]
        if max(map(operator.add, o_d, l_d)) > size:
            return None  # (a chunk outside the tensor)
        if any(o_d) or set(l_d) != {size}:
            partial_dims.append(d)
    nbytes = [n * itemsize for n in map(math.prod, lens)]
    ends = list(map(operator.add, starts, nbytes))
    entries = [files[n] for n in names]
    if not all(map(operator.le, ends, [f.bytes for f in entries])):
        return None
    if max(nbytes) <= block_bytes:
        if set(map(len, sums)) != {1}:
            return None
    elif list(map(len, sums)) != [max(1, -(-n // block_bytes)) for n in nbytes]:
        return None
    flat_s = list(itertools.chain.from_iterable(sums))
    if not (_STR_TYPE.issuperset(map(type, flat_s)) and set(map(len, flat_s)) == {16}
            and _HEX_RUN.fullmatch("".join(flat_s))):
        return None
    if math.prod(dims) and len(partial_dims) <= 1:  # (1-D meshes: slabs along one dim)
        d = partial_dims[0] if partial_dims else 0
        spans = sorted((o[d], o[d] + n[d]) for o, n, b in zip(offs, lens, nbytes, strict=True)
                       if b)
        if slabs_problem(dims[d], spans, partial) is not None:
            return None
    elif math.prod(dims) and tiling_problem(dims, list(zip(offs, lens, strict=True)),
                                            allow_gaps=partial) is not None:
        return None
    if len(raw) >= TABLE_MIN_CHUNKS:
        return _table(key, [f.name for f in entries], flat_o, flat_l, starts, ends, sums,
                      flat_s)
    shared: dict[tuple[int, ...], tuple[int, ...]] = {}
    return tuple(map(tuple.__new__, itertools.repeat(Chunk), zip(
        [f.name for f in entries], itertools.repeat(key), map(tuple, offs),
        [shared.setdefault(n, n) for n in map(tuple, lens)], zip(starts, ends, strict=True),
        map(tuple, sums))))


# From this many chunks a tensor's are held as a ChunkTable: below, numpy's cost per call
# outweighs what the columns save (a 2-rank checkpoint of 100,000 tensors).
TABLE_MIN_CHUNKS = 16


def _table(key: str, names: list[str], flat_o: list[int], flat_l: list[int],
           starts: Sequence[int], ends: Sequence[int], sums: Sequence[list[str]],
           flat_s: list[str]) -> ChunkTable:
    """A ChunkTable of valid columns (as _short_chunks_at_once checked them)."""
    n = len(names)
    index = {name: i for i, name in enumerate(dict.fromkeys(names))}
    boxes = np.hstack((np.array(flat_o, dtype=np.int64).reshape(n, -1),
                       np.array(flat_l, dtype=np.int64).reshape(n, -1)))
    return ChunkTable.of(key, tuple(index), list(map(index.__getitem__, names)), starts, ends,
                         boxes, list(map(len, sums)), "".join(flat_s))


def _fast_head(t: dict[str, Any]) -> tuple[torch.dtype, tuple[int, ...], str, list[Any]] | None:
    """A tensor entry's dtype, shape, kind and raw chunk list, if all are valid."""
    name = t.get("dtype")
    dtype = _STORABLE_DTYPES.get(name) if type(name) is str else None
    shape: Any = t.get("shape")
    chunks = t.get("chunks")
    kind = t.get("kind")
    if (dtype is None or type(chunks) is not list or type(kind) is not str
            or kind not in _KINDS or not _nonneg_ints(shape)
            or (shape and max(shape) >= _MAX_DIM)
            or math.prod(shape) * dtype.itemsize >= _MAX_DIM):
        return None
    return dtype, tuple(shape), kind, chunks


def _fast_chunk(key: str, ch: Any, files: dict[str, FileEntry], dims: tuple[int, ...],
                itemsize: int, block_bytes: int, *, whole: bool) -> Chunk | None:
    """One raw chunk (long form) of tensor ``key`` of shape ``dims``, if valid (``whole``:
    it must be the whole tensor); None otherwise."""
    if type(ch) is not dict:
        return None
    file: Any = ch.get("file")
    ckey: Any = ch.get("key")
    offsets: Any = ch.get("offsets")
    lengths: Any = ch.get("lengths")
    br: Any = ch.get("byte_range")
    sums: Any = ch.get("checksums")
    entry = files.get(file) if type(file) is str else None
    if (entry is None or type(ckey) is not str or type(offsets) is not list
            or type(lengths) is not list or len(offsets) != len(dims)
            or type(br) is not list or len(br) != 2 or type(sums) is not list):
        return None
    if whole:
        # (lengths equal to the shape and offsets all zero are non-negative: only their
        # types are left to check, as 64.0 == 64 and False == 0)
        if (tuple(lengths) != dims or any(offsets) or not _INT_TYPE.issuperset(map(type, lengths))
                or not _INT_TYPE.issuperset(map(type, offsets))):
            return None
    elif (not _nonneg_ints(offsets) or not _nonneg_ints(lengths) or len(lengths) != len(dims)
            or any(o + n > d for o, n, d in zip(offsets, lengths, dims, strict=True))):
        return None
    lo, hi = br
    nbytes = math.prod(lengths) * itemsize
    if (type(lo) is not int or type(hi) is not int or not 0 <= lo <= hi <= entry.bytes
            or hi - lo != nbytes or len(sums) != max(1, -(-nbytes // block_bytes))
            or not _hex16s(sums)):
        return None
    # (the strings a load holds once per chunk are the file's and the tensor's own)
    return Chunk(entry.name, key if ckey == key else ckey, tuple(offsets), tuple(lengths),
                 (lo, hi), tuple(sums))


# The offsets of a whole chunk, by its rank (a manifest's tensors have at most 64 dims).
_ZEROS = tuple((0,) * n for n in range(65))


def _parse_short_tensor(key: str, t: list[Any], files: dict[str, FileEntry], block_bytes: int
                        ) -> TensorEntry | None:
    """A short entry (format version 2), ``[dtype, shape, kind, file, start, checksums]``:
    the tensor is one chunk, all of it, under its own key. None for anything wrong,
    which _parse_short_tensor_checked then names. (Once per tensor of every load.)"""
    if len(t) != 6:
        return None
    name, shape, kind, file, lo, sums = t
    dt = _SIZED_DTYPES.get(name) if type(name) is str else None
    entry = files.get(file) if type(file) is str else None
    if (dt is None or entry is None or type(kind) is not str or kind not in _KINDS
            or type(shape) is not list or len(shape) > 64
            or not _INT_TYPE.issuperset(map(type, shape)) or type(lo) is not int
            or type(sums) is not list or (shape and (min(shape) < 0 or max(shape) >= _MAX_DIM))):
        return None
    nbytes = math.prod(shape) * dt[1]
    if nbytes >= _MAX_DIM or not 0 <= lo <= entry.bytes - nbytes:
        return None
    if len(sums) == 1 and nbytes <= block_bytes:  # (inline: most tensors, one block)
        if type(sums[0]) is not str or _HEX16.fullmatch(sums[0]) is None:
            return None
    elif len(sums) != max(1, -(-nbytes // block_bytes)) or not _hex16s(sums):
        return None
    dtype, dims = dt[0], tuple(shape)
    return TensorEntry(dtype, dims, kind, (
        Chunk(entry.name, key, _ZEROS[len(dims)], dims, (lo, lo + nbytes), tuple(sums)),))


def _parse_short_tensor_checked(c: _Check, key: str, t: list[Any], files: dict[str, FileEntry],
                                block_bytes: int, partial: bool) -> TensorEntry:
    """A short entry, every check one by one so that the error names the first problem:
    written out long, as the entry it stands for, and parsed as that."""
    if len(t) != 6:
        raise c.fail(f"a short tensor entry must be [dtype, shape, kind, file, start, "
                     f"checksums], got a list of {len(t)}", key)
    name, shape, kind, file, lo, sums = t
    dtype = _checked_dtype(c, key, name)
    dims = _checked_shape(c, key, shape, dtype)
    lo = _checked_start(c, key, lo)
    long = {"dtype": name, "shape": shape, "kind": kind, "chunks": [{
        "file": file, "key": key, "offsets": [0] * len(dims), "lengths": shape,
        "byte_range": [lo, lo + math.prod(dims) * dtype.itemsize], "checksums": sums}]}
    return _parse_tensor_checked(c, key, long, files, block_bytes, partial, version=2)


class _Named:
    """The file each rank wrote, as a table's rows name them (format version 4): the
    ranks of the manifest's files that name only one."""

    def __init__(self, files: dict[str, FileEntry]):
        self.files = files
        self._by_rank: dict[int, str] | None = None

    @property
    def by_rank(self) -> dict[int, str]:
        if self._by_rank is None:
            self._by_rank = {r: n for n, r in _ranks_of(self.files).items()}
        return self._by_rank


def _parse_tensor(c: _Check, key: str, t: dict[str, Any], files: dict[str, FileEntry],
                  block_bytes: int, partial: bool, version: int,
                  named: _Named | None = None) -> TensorEntry:
    if "table" in t:
        if version < 4:
            raise c.fail(f"a table of chunks is format version 4's; this manifest says "
                         f"{version}", key)
        if "chunks" in t:
            raise c.fail("a tensor entry holds both chunks and a table", key)
        by_rank = (named or _Named(files)).by_rank
        return (_parse_table(key, t, files, by_rank, block_bytes, partial)
                or _parse_table_checked(c, key, t, files, by_rank, block_bytes, partial,
                                        version))
    fast = (_parse_whole_tensor(key, t, files, block_bytes)
            or _parse_chunked_tensor(key, t, files, block_bytes, partial, version))
    if fast is not None:
        return fast
    return _parse_tensor_checked(c, key, t, files, block_bytes, partial, version)


_TABLE_FIELDS = frozenset(("rows", "checksums"))
_MAX_INT64 = 1 << 63


def _parse_table(key: str, t: dict[str, Any], files: dict[str, FileEntry],
                 by_rank: dict[int, str], block_bytes: int, partial: bool
                 ) -> TensorEntry | None:
    """A table of chunks (format version 4), checked column by column in numpy: what
    every rank of a load of a sharded checkpoint parses, ranks x tensors chunks. None for
    anything wrong, which _parse_table_checked then names; accepts exactly what it
    accepts."""
    name, shape, kind, tab = t.get("dtype"), t.get("shape"), t.get("kind"), t.get("table")
    dt = _SIZED_DTYPES.get(name) if type(name) is str else None
    if (dt is None or type(kind) is not str or kind not in _KINDS or not _nonneg_ints(shape)
            or not shape or max(shape) >= _MAX_DIM or math.prod(shape) * dt[1] >= _MAX_DIM
            or type(tab) is not dict or tab.keys() != _TABLE_FIELDS or len(t) != 4):
        return None
    flat, sums = tab["rows"], tab["checksums"]
    if not (type(flat) is list and type(sums) is list and _INT_TYPE.issuperset(map(type, flat))):
        return None
    nd, itemsize = len(shape), dt[1]
    width = 2 + 2 * nd
    if not flat or len(flat) % width:
        return None
    try:
        rows = np.array(flat, dtype=np.int64).reshape(-1, width)
    except OverflowError:  # (past 2**63)
        return None
    ranks, fidx = np.unique(rows[:, 0], return_inverse=True)
    by = [by_rank.get(r) for r in ranks.tolist()]
    if rows.min() < 0 or None in by:
        return None
    names = cast(list[str], by)
    starts, offs, lens = rows[:, 1], rows[:, 2:2 + nd], rows[:, 2 + nd:]
    dims = np.array(shape, dtype=np.int64)
    if starts.max() >= _MAX_DIM or (offs > dims).any() or (lens > dims - offs).any():
        return None
    # (each length at most its dimension: the products stay below the tensor's bytes)
    nbytes = lens.prod(axis=1) * itemsize
    sizes = np.array([files[n].bytes for n in names], dtype=np.int64)
    if (starts > sizes[fidx] - nbytes).any():
        return None
    # (a chunk's bytes are below 2**62: a larger block is one block, and numpy's int64)
    counts = np.maximum(1, -(-nbytes // min(block_bytes, _MAX_DIM)))
    if (len(sums) != int(counts.sum()) or not _STR_TYPE.issuperset(map(type, sums))
            or set(map(len, sums)) != {16}):
        return None
    joined = "".join(sums)
    if not _HEX_RUN.fullmatch(joined):
        return None
    fit = slabs_tile(tuple(shape), offs, lens, partial)  # (1-D meshes)
    if fit is None:  # (not slabs: the grid check)
        fit = tiling_problem(tuple(shape), [(tuple(o), tuple(n)) for o, n in zip(
            offs.tolist(), lens.tolist(), strict=True)], allow_gaps=partial) is None
    if not fit:
        return None
    return TensorEntry(dt[0], tuple(shape), kind, ChunkTable.of(
        key, tuple(names), fidx.reshape(-1), starts, starts + nbytes, rows[:, 2:], counts,
        joined))


def _parse_table_checked(c: _Check, key: str, t: dict[str, Any], files: dict[str, FileEntry],
                         by_rank: dict[int, str], block_bytes: int, partial: bool,
                         version: int) -> TensorEntry:
    """A table, every check one by one so that the error names the first problem: its
    rows decoded, then written out as the long chunks they stand for and parsed as those."""
    dtype = _checked_dtype(c, key, t.get("dtype"))
    dims = _checked_shape(c, key, t.get("shape"), dtype)
    tab = c.obj(t.get("table"), "table", key)
    if tab.keys() != _TABLE_FIELDS or len(t) != 4:
        raise c.fail(f"a table entry holds dtype, shape, kind and a table of rows and "
                     f"checksums; got {sorted(t)[:8]} and {sorted(tab)[:8]}", key)
    flat = tab["rows"]
    if not isinstance(flat, list) or not all(type(v) is int and 0 <= v < _MAX_INT64
                                             for v in flat):
        raise c.fail("table rows must be a list of integers >= 0 (below 2**63)", key)
    nd = len(dims)
    width = 2 + 2 * nd
    if not nd:
        raise c.fail("a 0-d tensor cannot be stored as a table of chunks", key)
    if not flat or len(flat) % width:
        raise c.fail(f"table rows hold {len(flat)} integers, not one or more rows of {width} "
                     f"(file, start, {nd} offsets, {nd} lengths)", key)
    sums = tab["checksums"]
    if not isinstance(sums, list):
        raise c.fail("table checksums must be a list", key)
    chunks, at = [], 0
    for i in range(0, len(flat), width):
        row = flat[i:i + width]
        f, start, offsets, lengths = row[0], row[1], row[2:2 + nd], row[2 + nd:]
        if f not in by_rank:
            raise c.fail(f"table row {i // width} names rank {f}, which wrote no file of this "
                         "manifest (or several)", key)
        start = _checked_start(c, key, start)
        nbytes = math.prod(c.ints(lengths, "chunk lengths", key)) * dtype.itemsize
        n = max(1, -(-nbytes // block_bytes))
        chunks.append({"file": by_rank[f], "key": key, "offsets": offsets, "lengths": lengths,
                       "byte_range": [start, start + nbytes], "checksums": sums[at:at + n]})
        at += n
    if at != len(sums):
        raise c.fail(f"the table holds {len(sums)} checksums where its chunks need {at}", key)
    return _parse_tensor_checked(c, key, {"dtype": t["dtype"], "shape": t["shape"],
                                          "kind": t.get("kind"), "chunks": chunks},
                                 files, block_bytes, partial, version)


def _long_chunk(c: _Check, key: str, ch: list[Any], dtype: torch.dtype) -> dict[str, Any]:
    """A short chunk (format version 3) written out as the long chunk it stands for, for
    the checks one by one; its own shape is checked here."""
    if len(ch) != 5:
        raise c.fail(f"a short chunk must be [file, offsets, lengths, start, checksums], got "
                     f"a list of {len(ch)}", key)
    file, offsets, lengths, lo, sums = ch
    lens = c.ints(lengths, "chunk lengths", key)
    if any(n >= _MAX_DIM for n in lens):
        raise c.fail("chunk lengths are impossibly large", key)
    nbytes = math.prod(lens) * dtype.itemsize
    lo = _checked_start(c, key, lo)
    return {"file": file, "key": key, "offsets": offsets, "lengths": lengths,
            "byte_range": [lo, lo + nbytes], "checksums": sums}


def _checked_start(c: _Check, key: str, lo: Any) -> int:
    """A short entry's or chunk's start, bounded before any sum is made of it: a number
    past 4,300 digits could not even be written into the error that names it."""
    start = c.int_(lo, "start", key)
    if start >= _MAX_DIM:
        raise c.fail("start is impossibly large", key)
    return start


def _parse_tensor_checked(c: _Check, key: str, t: dict[str, Any], files: dict[str, FileEntry],
                          block_bytes: int, partial: bool, version: int) -> TensorEntry:
    """Every check one by one, so that the error names the first problem."""
    dtype = _checked_dtype(c, key, t.get("dtype"))
    shape = _checked_shape(c, key, t.get("shape"), dtype)
    kind = t.get("kind")
    if kind not in ("torch", "numpy", "numpy_scalar"):
        raise c.fail(f"kind {kind!r:.40} is unknown", key)
    raw_chunks = t.get("chunks")
    if not isinstance(raw_chunks, list):
        raise c.fail("chunks must be a list", key)
    chunks = []
    for ch in raw_chunks:
        if type(ch) is list:
            if version < 3:
                raise c.fail(f"chunk must be an object (short chunks, [file, offsets, lengths, "
                             f"start, checksums], are format version 3's; this manifest says "
                             f"{version})", key)
            ch = _long_chunk(c, key, ch, dtype)
        ch = c.obj(ch, "chunk", key)
        file = c.str_(ch.get("file"), "chunk file", key)
        if file not in files:
            raise c.fail(f"chunk names file {file!r:.80}, which the manifest does not list", key)
        offsets = c.ints(ch.get("offsets"), "chunk offsets", key)
        lengths = c.ints(ch.get("lengths"), "chunk lengths", key)
        if len(offsets) != len(shape) or len(lengths) != len(shape):
            raise c.fail("chunk offsets/lengths do not match the tensor's rank", key)
        if any(o + n > s for o, n, s in zip(offsets, lengths, shape, strict=True)):
            raise c.fail("chunk lies outside the tensor's shape", key)
        br = c.ints(ch.get("byte_range"), "chunk byte_range", key)
        if len(br) != 2 or br[0] > br[1] or br[1] > files[file].bytes:
            raise c.fail(f"byte_range {list(br)} lies outside {file} ({files[file].bytes} B)", key)
        if br[1] - br[0] != math.prod(lengths) * dtype.itemsize:
            raise c.fail("chunk byte_range does not match its lengths and dtype", key)
        sums = ch.get("checksums")
        n_blocks = max(1, -(-(br[1] - br[0]) // block_bytes))
        if not isinstance(sums, list) or len(sums) != n_blocks or not all(
                isinstance(s, str) and _HEX16.fullmatch(s) for s in sums):
            raise c.fail(f"chunk needs {n_blocks} 16-hex-digit checksums", key)
        chunks.append(Chunk(file, c.str_(ch.get("key"), "chunk key", key), offsets, lengths,
                            (br[0], br[1]), tuple(sums)))
    problem = tiling_problem(shape, [(ch.offsets, ch.lengths) for ch in chunks],
                             allow_gaps=partial)
    if problem is not None:
        raise c.fail(f"its chunks do not tile shape {list(shape)}: {problem}", key)
    return TensorEntry(dtype, shape, kind, tuple(chunks))


def _checked_dtype(c: _Check, key: str, name: Any) -> torch.dtype:
    dtype = _STORABLE_DTYPES.get(name) if type(name) is str else None
    if dtype is None:
        text = c.str_(name, "dtype", key)  # (its refusal as it is: wrapped, it said twice
        # which manifest and tensor)
        try:
            dtype = dtype_from_name(text)
        except ValueError as exc:
            if not _DTYPE_LIKE.fullmatch(text) or hasattr(torch, text):
                raise c.fail(str(exc), key) from exc  # (an alias, or no dtype at all)
            # A dtype name this torch lacks, in a manifest whose digest matched: written
            # where torch had it (a newer torch's float8 kind). No damage: a fallback load
            # that took it for damage marked every intact step, and the trainer's next
            # retention deleted them (a review).
            raise CheckpointVersionError(
                f"{c.path}: tensor {key!r} has dtype {text!r}, which this torch "
                f"({torch.__version__}) does not have: the checkpoint is not damaged; load "
                "it with the torch it was saved with (or a newer one)",
                path=c.path) from exc
        if _is_bits(dtype_name(dtype)):
            raise c.fail(f"dtype {dtype} cannot be stored in a checkpoint", key)
    return dtype


def _checked_shape(c: _Check, key: str, shape: Any, dtype: torch.dtype) -> tuple[int, ...]:
    dims = c.ints(shape, "shape", key)
    if any(d >= _MAX_DIM for d in dims) or math.prod(dims) * dtype.itemsize >= _MAX_DIM:
        raise c.fail(f"shape {list(dims)[:8]} is impossibly large", key)
    return dims


def _check_layout(c: _Check, files: dict[str, FileEntry], tensors: dict[str, TensorEntry]
                  ) -> None:
    """In each file, the tensor bytes lie past the header and no two chunks share a byte.

    A writer stores every tensor once (tied ones too) and back to back after the header,
    so shared bytes are forged: unchecked, a small file could stand in for any number of
    large tensors, each allocated and filled from the same bytes. Empty chunks hold no
    bytes and may lie anywhere in the file.
    """
    ranges: dict[str, list[tuple[int, int, str]]] = {}
    tables: list[ChunkTable] = []
    for key, t in tensors.items():
        if type(t.chunks) is ChunkTable:
            tables.append(t.chunks)
            continue
        for ch in t.chunks:
            lo, hi = ch.byte_range
            if hi > lo:
                ranges.setdefault(ch.file, []).append((lo, hi, key))
    if tables:
        _check_table_layout(c, files, ranges, tables)
        return
    for name, spans in ranges.items():
        spans.sort()
        body = files[name].header_bytes
        lo, hi, key = spans[0]
        if lo < body:
            raise c.fail(f"byte_range [{lo}, {hi}] of {name} starts inside its header (the "
                         f"tensor bytes start at byte {body})", key)
        for (_, end, prev), (lo, hi, key) in itertools.pairwise(spans):
            if lo < end:
                raise c.fail(f"byte_range [{lo}, {hi}] of {name} overlaps the bytes of tensor "
                             f"{prev!r} (which end at byte {end})", key)


def _check_table_layout(c: _Check, files: dict[str, FileEntry],
                        ranges: dict[str, list[tuple[int, int, str]]],
                        tables: list[ChunkTable]) -> None:
    """_check_layout's checks over ``ranges`` (the byte ranges of chunks held as objects)
    and the chunks of ``tables``, column by column: a sharded checkpoint has ranks x
    tensors of them."""
    fid = {name: i for i, name in enumerate(files)}
    keys: list[str] = []
    cols: list[np.ndarray] = []  # [file, lo, hi, key] per chunk
    for name, held in ranges.items():
        if held:
            part = np.empty((len(held), 4), dtype=np.int64)
            part[:, 0] = fid[name]
            part[:, 1:3] = [h[:2] for h in held]
            part[:, 3] = np.arange(len(keys), len(keys) + len(held))
            keys += [h[2] for h in held]
            cols.append(part)
    for tab in tables:
        rows = tab.rows[tab.rows[:, 2] > tab.rows[:, 1]]
        part = np.empty((len(rows), 4), dtype=np.int64)
        part[:, 0] = np.array([fid[f] for f in tab.files], dtype=np.int64)[rows[:, 0]]
        part[:, 1:3] = rows[:, 1:3]
        part[:, 3] = len(keys)
        keys.append(tab.key)
        cols.append(part)
    if not cols:
        return
    every = np.concatenate(cols)
    spans = every[np.lexsort((every[:, 3], every[:, 2], every[:, 1], every[:, 0]))]
    first = np.ones(len(spans), dtype=bool)
    first[1:] = spans[1:, 0] != spans[:-1, 0]
    names = list(files)
    bodies = np.array([files[n].header_bytes for n in names], dtype=np.int64)
    inside = np.flatnonzero(first & (spans[:, 1] < bodies[spans[:, 0]]))
    over = np.flatnonzero(~first[1:] & (spans[1:, 1] < spans[:-1, 2])) + 1
    bad = min(inside.tolist()[:1] + over.tolist()[:1], default=None)
    if bad is None:
        return
    f, lo, hi, k = spans[bad].tolist()
    if first[bad]:
        raise c.fail(f"byte_range [{lo}, {hi}] of {names[f]} starts inside its header (the "
                     f"tensor bytes start at byte {bodies[f]})", keys[k])
    end, prev = spans[bad - 1, 2].tolist(), keys[int(spans[bad - 1, 3])]
    raise c.fail(f"byte_range [{lo}, {hi}] of {names[f]} overlaps the bytes of tensor "
                 f"{prev!r} (which end at byte {end})", keys[k])


def check_skeleton(skeleton: Any, dtypes: Mapping[str, torch.dtype], path: str) -> None:
    """Raise CheckpointCorruptError unless ``skeleton`` is one a load reads: known node
    types, values of their type, array nodes naming tensors of ``dtypes``."""
    _check_skeleton(_Check(path), skeleton, dtypes)


def _check_skeleton(c: _Check, node: Any, dtypes: Mapping[str, torch.dtype],
                    depth: int = 0, *, partial: bool = False) -> None:
    """``partial``: a view of what one rank of a group wrote, whose skeleton names the
    tensors other ranks wrote too (replicated ones, written by one rank each): those
    need not be listed (a load that wants one says the view does not hold it)."""
    if depth > 200:
        raise c.fail("skeleton is nested too deeply")
    node = c.obj(node, "skeleton node")
    t = node.get("t")
    if t in ARRAY_NODES:
        key = node.get("key")
        if not isinstance(key, str) or (key not in dtypes and not partial):
            raise c.fail(f"skeleton names tensor {key!r:.80}, which is not listed")
        if key not in dtypes:  # (partial: another rank wrote it)
            return
        dtype = dtypes[key]
        if t != "tensor" and dtype not in _NUMPY_DTYPES:
            raise c.fail(f"{t} node has dtype {dtype_name(dtype)}, which numpy cannot hold",
                         node["key"])
    elif t == "dict":
        items = node.get("items")
        if not isinstance(items, list):
            raise c.fail("dict node needs items")
        for it in items:
            if not (isinstance(it, list) and len(it) == 2 and type(it[0]) in (str, int)):
                raise c.fail("dict item must be [str or int key, node]")
            _check_skeleton(c, it[1], dtypes, depth + 1, partial=partial)
        twice = first_repeat((type(it[0]), it[0]) for it in items)
        if twice is not None:
            raise c.fail(f"a dict of the skeleton names the key {twice[1]!r:.100} twice "
                         "(which one a reader keeps differs: damaged, or forged)")
    elif t in ("list", "tuple"):
        items = node.get("items")
        if not isinstance(items, list):
            raise c.fail(f"{t} node needs items")
        for it in items:
            _check_skeleton(c, it, dtypes, depth + 1, partial=partial)
    elif t == "stateful":
        _check_skeleton(c, node.get("state"), dtypes, depth + 1, partial=partial)
    elif t == "none":
        pass
    elif t in ("bool", "int", "str", "float", "bytes"):
        expect = {"bool": bool, "int": int, "str": str, "float": str, "bytes": str}[t]
        v = node.get("v")
        if type(v) is not expect:
            raise c.fail(f"{t} node has a value of the wrong type")
        try:
            if t == "float" and isinstance(v, str):
                float(v)
            elif t == "bytes" and isinstance(v, str):
                base64.b64decode(v, validate=True)
        except (ValueError, binascii.Error) as exc:
            raise c.fail(f"{t} node holds {v!r:.40}, which is no {t}") from exc
        if t == "float" and "bits" in node:  # a NaN's sign and payload (optional)
            bits = node["bits"]
            if not math.isnan(float(v)):
                raise c.fail(f"float node {v!r:.40} has bits, which only a NaN's node has")
            try:
                if type(bits) is not str:
                    raise ValueError("not a string")
                nan_from_bits(bits)
            except ValueError as exc:
                raise c.fail(f"NaN float node has bits {bits!r:.40}, which are not a "
                             f"NaN's 16 hex digits ({exc})") from exc
    else:
        raise c.fail(f"unknown skeleton node type {t!r:.40}")
