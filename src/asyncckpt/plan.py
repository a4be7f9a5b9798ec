"""Write plans and read plans: plain data made by pure functions.

A write plan fixes the byte layout of one shard file: the safetensors header, then
every tensor at a known offset. The staging arena is laid out exactly like the file,
so the write is a few large sequential writes of the arena.

A read plan says, for each wanted tensor box, which saved chunks intersect it and
where the intersection lies on both sides (resharding is box intersection).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ._gc import gc_paused
from .boxes import Box, box_byte_span, intersect, row_major_strides, tiling_problem
from .errors import CheckpointConfigError
from .manifest import (
    WRITE_MAX_HEADER_BYTES,
    Chunk,
    ChunkTable,
    HeaderEntry,
    Manifest,
    align_up,
    encode_header,
)

__all__ = ["Box", "ReadItem", "WriteItem", "WritePlan", "box_byte_span", "intersect",
           "plan_reads", "plan_writes", "row_major_strides", "tiling_problem"]

# Parallel staging hands out units of about this many consecutive bytes.
COPY_UNIT_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class WriteItem:
    """One tensor's place in a shard file; ``offset`` counts from the file's first byte."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class WritePlan:
    """The layout of one shard file: header bytes, then items back to back.

    ``signature`` identifies the layout: two saves with equal signatures can share one
    arena and one header.
    """

    file: str
    header: bytes
    items: tuple[WriteItem, ...]
    file_bytes: int
    signature: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]

    @property
    def body_offset(self) -> int:
        return len(self.header)

    @functools.cached_property
    def copy_units(self) -> tuple[tuple[tuple[int, int, int], ...], ...]:
        """The items split into units of about 16 MiB of consecutive bytes, in file order.

        A unit is a tuple of ``(item index, first byte, end byte)`` segments; a tensor
        larger than a unit is split over several. Parallel staging hands them out.
        """
        units: list[tuple[tuple[int, int, int], ...]] = []
        cur: list[tuple[int, int, int]] = []
        size = 0
        for i, item in enumerate(self.items):
            lo = 0
            while True:
                take = min(item.nbytes - lo, COPY_UNIT_BYTES - size)
                cur.append((i, lo, lo + take))
                size += take
                lo += take
                if size >= COPY_UNIT_BYTES:
                    units.append(tuple(cur))
                    cur, size = [], 0
                if lo >= item.nbytes:
                    break
        if cur:
            units.append(tuple(cur))
        return tuple(units)

    @property
    def written_bytes(self) -> int:
        """What a save of this layout writes: the shard file, or nothing when it holds no
        tensor (no file is written then)."""
        return self.file_bytes if self.items else 0

    @property
    def padded_bytes(self) -> int:
        """File size rounded up to the O_DIRECT alignment: the arena's size."""
        return align_up(self.file_bytes)


def layout_signature(tensors: Mapping[str, torch.Tensor]
                     ) -> tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]:
    # (dtypes and torch.Size as they are: built at every save, 40% cheaper than names)
    return tuple((k, t.dtype, t.shape) for k, t in tensors.items())


def plan_writes(tensors: Mapping[str, torch.Tensor], file: str,
                metadata: dict[str, str] | None = None, *, sized: bool = True) -> WritePlan:
    """Lay out ``tensors`` in one safetensors file.

    Tensors are ordered by element size, largest first, then by insertion order, so
    every tensor starts at an offset aligned to its own element size without padding
    (safetensors forbids holes in the body). A header larger than safetensors' readers
    take raises CheckpointConfigError, unless ``sized`` is False (for an estimate).

    Example:
        >>> plan = plan_writes({"w": torch.ones(4)}, "rank_00000.safetensors")
        >>> plan.items[0].offset == plan.body_offset
        True
    """
    order = sorted(tensors, key=lambda k: -tensors[k].element_size())
    rel: list[tuple[str, int, int]] = []
    pos = 0
    for k in order:
        t = tensors[k]
        n = t.numel() * t.element_size()
        rel.append((k, pos, pos + n))
        pos += n
    header = encode_header(
        (HeaderEntry(k, tensors[k].dtype, tuple(tensors[k].shape), s, e) for k, s, e in rel),
        metadata)
    if sized and len(header) - 8 > WRITE_MAX_HEADER_BYTES:  # (safetensors would refuse it)
        names = sum(len(json.dumps(k)) - 2 for k in tensors)  # (as the header spells them)
        raise CheckpointConfigError(
            f"{file}: the safetensors header listing its {len(tensors):,} tensors would take "
            f"{len(header) - 8:,} bytes, over the {WRITE_MAX_HEADER_BYTES:,} that safetensors "
            f"readers accept; their names alone take {names:,} bytes: shorten the keys, or "
            "save fewer, larger tensors (stack rows into one), or spread them over more "
            "ranks; refused before anything was written or sent")
    base = len(header)
    items = tuple(WriteItem(k, tensors[k].dtype, tuple(tensors[k].shape), base + s, e - s)
                  for k, s, e in rel)
    return WritePlan(file=file, header=header, items=items, file_bytes=base + pos,
                     signature=layout_signature(tensors))


class ReadItem(NamedTuple):
    """Copy the intersection ``box`` of a saved chunk into a wanted box of tensor ``key``.

    ``box`` is in global coordinates. ``whole_chunk`` and ``whole_dst`` say when the
    intersection is the entire chunk and the entire destination: then the chunk's bytes
    can be read straight into the destination's memory.
    """

    key: str
    chunk: Chunk
    box: Box
    dst_box: Box

    @property
    def whole_chunk(self) -> bool:
        return self.box == (self.chunk.offsets, self.chunk.lengths)

    @property
    def whole_dst(self) -> bool:
        return self.box == self.dst_box


def plan_reads(manifest: Manifest, wanted: Mapping[str, Box | None]) -> list[ReadItem]:
    """Plan the reads that fill each wanted box (``None`` means the whole tensor).

    Items come in file and byte order so that reads stay sequential. Thousands of small
    objects in a burst: the cyclic collector is paused meanwhile (see gc_paused).
    """
    with gc_paused():
        return _plan_reads(manifest, wanted)


def _plan_reads(manifest: Manifest, wanted: Mapping[str, Box | None]) -> list[ReadItem]:
    items: list[ReadItem] = []
    for key, box in wanted.items():
        entry = manifest.tensors[key]
        chunks = entry.chunks
        if box is None and len(chunks) == 1 and chunks[0].lengths == entry.shape:
            # The common case: one chunk holds the whole tensor (so its offsets are 0).
            whole = (chunks[0].offsets, entry.shape)
            items.append(ReadItem(key, chunks[0], whole, whole))
            continue
        dst: Box = box if box is not None else (tuple(0 for _ in entry.shape), entry.shape)
        # A sharded tensor has a chunk per rank and the wanted box meets a few of them:
        # along the dimension where the box is narrowest (most likely the sharded one),
        # a chunk that misses it is passed over without the intersection's work.
        near: Sequence[Chunk] = chunks
        if type(chunks) is ChunkTable:  # (held as columns: the few that meet the box)
            near, d, lo, hi = chunks.meeting(dst), -1, 0, 0
        else:
            d, lo, hi = _narrowest(dst, entry.shape) if len(chunks) > 4 else (-1, 0, 0)
        for chunk in near:
            if d >= 0 and not (chunk.offsets[d] < hi and chunk.offsets[d] + chunk.lengths[d] > lo):
                continue  # (what intersect finds in dimension d: the box is not empty there)
            inter = intersect((chunk.offsets, chunk.lengths), dst)
            if inter is None:
                continue
            if math.prod(inter[1]) == 0 and math.prod(dst[1]) != 0:
                continue
            items.append(ReadItem(key, chunk, inter, dst))
    items.sort(key=lambda it: (it.chunk.file, it.chunk.byte_range[0]))
    return items


def _narrowest(box: Box, shape: tuple[int, ...]) -> tuple[int, int, int]:
    """``(d, lo, hi)``: the dimension in which ``box`` covers the least of ``shape``, and
    the box's span there; ``(-1, 0, 0)`` when it has no dimension or is empty in one."""
    best, frac = -1, 2.0
    for i, (n, s) in enumerate(zip(box[1], shape, strict=True)):
        if n == 0:
            return -1, 0, 0
        if n / s < frac:
            best, frac = i, n / s
    return (best, box[0][best], box[0][best] + box[1][best]) if best >= 0 else (-1, 0, 0)


def plain_memory(t: torch.Tensor, *, empty_ok: bool = False) -> bool:
    """Whether ``t``'s bytes lie as they are, row-major, at its data pointer on the CPU,
    so that a memcpy or a read may go straight from or into them. A wrapper subclass
    (torchao's Float8 or NF4) has no memory there (pointer 0): a memcpy from it would
    crash the process, so it goes through copy_, which its own dispatch handles (or
    refuses). ``empty_ok``: an empty tensor, which may have no pointer, qualifies (a read
    of nothing into it is fine)."""
    return (t.is_cpu and t.is_contiguous() and not t.is_conj() and not t.is_neg()
            and (t.data_ptr() != 0 or (empty_ok and t.numel() == 0)))
