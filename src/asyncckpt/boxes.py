"""Boxes of a tensor (offsets and lengths in global coordinates) and their geometry.

Pure functions shared by planning, the manifest's validation and the coordinator.
"""

from __future__ import annotations

import math

import numpy as np

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, lengths)


def intersect(a: Box, b: Box) -> Box | None:
    """Intersection of two boxes, or None when it is empty (0-d boxes always intersect)."""
    offs, lens = [], []
    for ao, al, bo, bl in zip(a[0], a[1], b[0], b[1], strict=True):
        lo = max(ao, bo)
        hi = min(ao + al, bo + bl)
        if hi <= lo and not (al == 0 and bl == 0 and ao == bo):
            return None
        offs.append(lo)
        lens.append(max(0, hi - lo))
    return tuple(offs), tuple(lens)


def box_byte_span(chunk_offsets: tuple[int, ...], chunk_lengths: tuple[int, ...], box: Box,
                  itemsize: int) -> tuple[int, int]:
    """The byte range, relative to a chunk's first byte, from the first to the last element
    of ``box`` in the chunk's row-major layout (``(0, 0)`` for an empty box)."""
    lens = box[1]
    if any(n == 0 for n in lens):
        return 0, 0
    strides = row_major_strides(chunk_lengths)
    first = sum((o - c) * s for o, c, s in zip(box[0], chunk_offsets, strides, strict=True))
    last = first + sum((n - 1) * s for n, s in zip(lens, strides, strict=True))
    return first * itemsize, (last + 1) * itemsize


def row_major_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a contiguous tensor of ``shape``."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return tuple(strides)


def tiling_problem(shape: tuple[int, ...], boxes: list[Box], max_cells: int = 10_000_000,
                   *, allow_gaps: bool = False) -> str | None:
    """Why ``boxes`` fail to tile a tensor of ``shape`` exactly once, or None if they do.

    With ``allow_gaps`` only overlaps count (a partial view, as a peer serves).

    Cuts the tensor into the grid made by every box edge and marks the grid cells each
    box covers, stopping at the first box that touches a marked cell: exact for any
    layout, and the work is bounded by the number of cells however the boxes overlap.
    """
    if (len(boxes) == 1 and tuple(boxes[0][1]) == tuple(shape)
            and len(boxes[0][0]) == len(shape) and not any(boxes[0][0])):
        return None  # the common case, checked first (once per tensor): one whole chunk
    if len(boxes) >= _MANY and _slabs_that_tile(shape, boxes, allow_gaps):
        return None  # a sharded tensor's chunks on a 1-D mesh, checked in numpy
    for offs, lens in boxes:
        if len(offs) != len(shape) or any(o + n > s for o, n, s in zip(offs, lens, shape,
                                                                        strict=True)):
            return f"chunk at offsets {list(offs)} does not fit in shape {list(shape)}"
    boxes = [b for b in boxes if math.prod(b[1]) > 0]
    if math.prod(shape) == 0:
        return None
    if not shape:
        if len(boxes) > 1 or (not boxes and not allow_gaps):
            return f"{len(boxes)} chunks for one scalar"
        return None
    slab = _slab_dim(shape, boxes)
    if slab is not None:
        return slabs_problem(shape[slab], sorted((b[0][slab], b[0][slab] + b[1][slab])
                                                  for b in boxes), allow_gaps, dim=slab)
    cuts = [sorted({0, s, *(b[0][d] for b in boxes), *(b[0][d] + b[1][d] for b in boxes)})
            for d, s in enumerate(shape)]
    cells = math.prod(len(c) - 1 for c in cuts)
    if cells > max_cells:
        return f"chunks cut the tensor into {cells} pieces, too many to check"
    where = [{x: i for i, x in enumerate(c)} for c in cuts]  # edge -> its grid index
    covered = np.zeros([len(c) - 1 for c in cuts], dtype=np.bool_)
    for offs, lens in boxes:
        idx = tuple(slice(w[o], w[o + n]) for w, o, n in zip(where, offs, lens, strict=True))
        cell = covered[idx]
        if cell.any():  # boxes that do not overlap visit each cell once
            return "chunks overlap"
        cell[...] = True
    if not allow_gaps and not covered.all():
        first = [int(i) for i in np.argwhere(~covered)[0]]  # (where to look: a trial asked)
        at = [c[i] for c, i in zip(cuts, first, strict=True)]
        size = [c[i + 1] - c[i] for c, i in zip(cuts, first, strict=True)]
        return (f"chunks leave part of the tensor uncovered (no chunk holds the box at "
                f"offsets {at} of lengths {size})")
    return None


# From this many boxes, slabs that tile are recognised in numpy (a coordinator checks a
# chunk per rank of every sharded tensor at a first save: 128,000 at 64 x 2,000).
_MANY = 16


def _slabs_that_tile(shape: tuple[int, ...], boxes: list[Box], allow_gaps: bool) -> bool:
    """True when ``boxes`` are slabs along one dimension that tile ``shape`` (or, with
    ``allow_gaps``, do not overlap); False for anything else, whose verdict the checks
    one by one then give."""
    nd = len(shape)
    if not nd:
        return False
    try:
        rows = np.array([(*o, *n) for o, n in boxes], dtype=np.int64)
    except (ValueError, TypeError, OverflowError):  # (boxes of another rank, or huge)
        return False
    if rows.shape != (len(boxes), 2 * nd) or rows.min() < 0:
        return False
    dims = np.array(shape, dtype=np.int64)
    offs, lens = rows[:, :nd], rows[:, nd:]
    if (offs > dims).any() or (lens > dims - offs).any():
        return False
    return slabs_tile(shape, offs, lens, allow_gaps) is True


def slabs_tile(shape: tuple[int, ...], offs: np.ndarray, lens: np.ndarray,
               allow_gaps: bool) -> bool | None:
    """For boxes given as arrays of offsets and lengths (a row each, every box inside
    ``shape``): whether they tile it (``allow_gaps``: do not overlap) when those that
    hold elements are slabs along one dimension (a ``Shard(d)`` tensor's chunks on a 1-D
    mesh), in a few passes in numpy; None when they are not slabs (tiling_problem's grid
    then decides)."""
    if math.prod(shape) == 0:
        return True
    held = (lens > 0).all(axis=1)
    offs, lens = offs[held], lens[held]
    cut = np.flatnonzero(((offs != 0) | (lens != np.array(shape, dtype=np.int64))).any(axis=0))
    if len(cut) > 1:
        return None
    d = int(cut[0]) if len(cut) else 0
    lo, hi = offs[:, d], offs[:, d] + lens[:, d]
    order = np.lexsort((hi, lo))
    return slabs_fit(shape[d], lo[order], hi[order], allow_gaps)


def _slab_dim(shape: tuple[int, ...], boxes: list[Box]) -> int | None:
    """The one dimension in which the boxes may be partial, whole in every other (the
    chunks of a ``Shard(d)`` tensor on a 1-D mesh), or None when there is no such one."""
    dim = None
    for offs, lens in boxes:
        for d, (o, n, s) in enumerate(zip(offs, lens, shape, strict=True)):
            if o or n != s:
                if dim is None:
                    dim = d
                elif d != dim:
                    return None
    return 0 if dim is None else dim  # (whole boxes: any dimension tells)


def slabs_problem(extent: int, spans: list[tuple[int, int]], allow_gaps: bool,
                  dim: int | None = None) -> str | None:
    """tiling_problem for slabs, given their sorted [start, end) along their dimension
    (``dim``, to name it): any overlap first (as the grid check finds one wherever it is),
    then any gap."""
    end = 0
    for lo, hi in spans:
        if lo < end:
            return "chunks overlap"
        end = hi
    if allow_gaps:
        return None
    end = 0
    gap_end = extent
    for lo, hi in spans:
        if lo > end:
            gap_end = lo
            break
        end = hi
    if end == extent:
        return None
    along = "" if dim is None else f" along dimension {dim}"
    return (f"chunks leave part of the tensor uncovered (no chunk holds indices "
            f"{end}..{gap_end - 1}{along})")


def slabs_fit(extent: int, lo: np.ndarray, hi: np.ndarray, allow_gaps: bool) -> bool:
    """Whether slabs_problem finds nothing, for slabs given as arrays of their sorted
    starts and ends: one pass in numpy over a sharded tensor's chunks."""
    if not len(lo):
        return allow_gaps or extent == 0
    if (lo[1:] < hi[:-1]).any():
        return False  # (an overlap)
    return allow_gaps or bool(lo[0] == 0 and (lo[1:] == hi[:-1]).all() and hi[-1] == extent)
