"""Write plans (file layout) and read plans (box intersection for resharding)."""

from __future__ import annotations

import itertools
import math
import re

import numpy as np
import pytest
import safetensors
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import asyncckpt
from asyncckpt.manifest import (
    ALIGN,
    Chunk,
    FileEntry,
    Manifest,
    TensorEntry,
    block_checksums,
    decode_header,
)
from asyncckpt.plan import (
    box_byte_span,
    intersect,
    plan_reads,
    plan_writes,
    row_major_strides,
    tiling_problem,
)

_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32,
           torch.uint32, torch.int64, torch.uint64, torch.float16, torch.bfloat16, torch.float32,
           torch.float64, torch.complex64, torch.complex128, torch.float8_e4m3fn,
           torch.float8_e5m2]

# --- plan_writes ------------------------------------------------------------------------------

tensor_specs = st.dictionaries(
    st.text(min_size=1, max_size=6),
    st.tuples(st.sampled_from(_DTYPES), st.lists(st.integers(0, 5), max_size=3).map(tuple)),
    max_size=8)


def _make(specs, byte=0):
    """Tensors of the specs, every byte ``byte`` (made as bytes: torch 2.4 cannot fill
    fp8 tensors on the CPU)."""
    return {k: torch.full((math.prod(shape) * dt.itemsize,), byte, dtype=torch.uint8)
            .view(dt).reshape(shape) for k, (dt, shape) in specs.items()}


def check_layout(plan, tensors):
    assert plan.body_offset == len(plan.header)
    assert len(plan.header) % ALIGN == 0
    assert {it.key for it in plan.items} == set(tensors)
    assert len(plan.items) == len(tensors)
    pos = plan.body_offset
    for it in plan.items:
        t = tensors[it.key]
        assert it.offset == pos, "items must be back to back, starting right after the header"
        assert it.nbytes == t.numel() * t.element_size()
        assert it.offset % t.element_size() == 0
        assert it.dtype == t.dtype and it.shape == tuple(t.shape)
        assert it.end == it.offset + it.nbytes
        pos = it.end
    assert plan.file_bytes == pos == len(plan.header) + sum(
        t.numel() * t.element_size() for t in tensors.values())
    assert plan.padded_bytes % ALIGN == 0 and 0 <= plan.padded_bytes - plan.file_bytes < ALIGN
    # the header describes exactly this layout, relative to the body
    header, body = decode_header(plan.header, plan.file)
    assert body == plan.body_offset
    for it in plan.items:
        assert header[it.key]["data_offsets"] == [it.offset - body, it.end - body]


@settings(max_examples=150, deadline=None)
@given(tensor_specs)
def test_plan_writes_layout_property(specs):
    tensors = _make(specs)
    plan = plan_writes(tensors, "rank_00000.safetensors", {"asyncckpt_format": "1"})
    check_layout(plan, tensors)
    assert plan.file == "rank_00000.safetensors"
    # same layout (other values, other tensor objects) -> same signature and same items
    again = plan_writes(_make(specs, byte=1), "rank_00000.safetensors",
                        {"asyncckpt_format": "1"})
    assert again.signature == plan.signature
    assert again.items == plan.items and again.header == plan.header


@settings(max_examples=80, deadline=None)
@given(tensor_specs.filter(bool), st.data())
def test_changed_layout_changes_signature(specs, data):
    key = data.draw(st.sampled_from(sorted(specs)))
    dt, shape = specs[key]
    new_shape = (*shape, 2)
    changed = dict(specs)
    changed[key] = (dt, new_shape)
    assert plan_writes(_make(changed), "f").signature != plan_writes(_make(specs), "f").signature
    other = next(d for d in _DTYPES if d != dt)
    changed[key] = (other, shape)
    assert plan_writes(_make(changed), "f").signature != plan_writes(_make(specs), "f").signature


def test_mixed_itemsizes_are_aligned_without_holes():
    tensors = {"b": torch.zeros(3, dtype=torch.bool), "c": torch.zeros(1, dtype=torch.complex128),
               "h": torch.zeros(3, dtype=torch.float16), "d": torch.zeros(1, dtype=torch.float64),
               "i": torch.zeros(1, dtype=torch.int32)}
    plan = plan_writes(tensors, "f")
    check_layout(plan, tensors)
    # odd-sized small tensors come last, so nothing after them is misaligned
    sizes = [tensors[it.key].element_size() for it in plan.items]
    assert sizes == sorted(sizes, reverse=True)


def test_empty_plan():
    plan = plan_writes({}, "f")
    assert plan.items == ()
    assert plan.file_bytes == len(plan.header) == plan.body_offset


def test_planned_file_opens_with_safetensors(tmp_path, tensor_bytes):
    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(3, 5, generator=g), "ids": torch.arange(7),
               "mask": torch.tensor([True, False, True]), "h": torch.randn(2, generator=g).half(),
               "z": torch.randn(2, dtype=torch.complex64, generator=g), "e": torch.empty(0, 4)}
    plan = plan_writes(tensors, "rank_00000.safetensors")
    buf = bytearray(plan.file_bytes)
    buf[:len(plan.header)] = plan.header
    for it in plan.items:
        buf[it.offset:it.end] = tensor_bytes(tensors[it.key])
    path = tmp_path / plan.file
    path.write_bytes(bytes(buf))
    with safetensors.safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == set(tensors)
        for k, t in tensors.items():
            got = f.get_tensor(k)
            assert got.dtype == t.dtype and got.shape == t.shape
            assert tensor_bytes(got) == tensor_bytes(t)


# --- intersect ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("a", "b", "want"), [
    ((((0,), (4,))), ((2,), (4,)), ((2,), (2,))),
    ((((0,), (4,))), ((4,), (4,)), None),  # touching
    ((((0,), (4,))), ((5,), (1,)), None),  # apart
    (((0, 0), (4, 4)), ((1, 1), (2, 2)), ((1, 1), (2, 2))),  # contained
    (((0, 0), (4, 4)), ((1, 4), (2, 2)), None),  # overlap in one dim only
    (((), ()), ((), ()), ((), ())),  # 0-d boxes always meet
    (((0, 0), (0, 3)), ((0, 0), (0, 3)), ((0, 0), (0, 3))),  # equal empty boxes
    (((0,), (5,)), ((2,), (0,)), None),  # an empty box inside a full one
])
def test_intersect_cases(a, b, want):
    assert intersect(a, b) == want
    assert intersect(b, a) == want


def test_intersect_rank_mismatch_is_an_error():
    """Boxes of different ranks are a bug of the caller, refused by zip(strict=True), not
    truncated to the shorter rank. intersect is internal: the manifest parser refuses
    chunks of another rank than their tensor's, and load refuses a target or a shard of
    another rank first (next test), so no user ever sees this message."""
    for a, b in [(((0,), (1,)), ((0, 0), (1, 1))), (((0, 0), (1, 1)), ((0,), (1,)))]:
        # (b's offsets, zip's third argument, against a's offsets and lengths)
        with pytest.raises(ValueError, match=r"zip\(\) argument 3 is (shorter|longer) than "
                                             r"arguments 1-2"):
            intersect(a, b)


@pytest.mark.parametrize("target", [(16,), (4, 4, 1)])
def test_a_rank_mismatch_is_refused_before_planning(tmp_path, target):
    asyncckpt.save({"w": torch.zeros(4, 4)}, tmp_path, step=1)
    with pytest.raises(asyncckpt.StateMismatchError, match=re.escape(
            f"shape/dtype mismatch: w: checkpoint torch.float32 [4, 4], target torch.float32 "
            f"{list(target)}")):
        asyncckpt.load(tmp_path, {"w": torch.zeros(target)})
    with pytest.raises(asyncckpt.CheckpointConfigError, match=re.escape(
            "shards['w'].global_shape is [4, 4, 1]: 3 numbers for a 2-dimensional local "
            "tensor of shape [2, 4]; give one per dimension")):
        asyncckpt.AsyncCheckpointer(tmp_path).load(
            {"w": torch.zeros(2, 4)}, shards={"w": asyncckpt.ShardMetadata((4, 4, 1), (0, 0, 0))})
    with pytest.raises(asyncckpt.CheckpointConfigError, match=re.escape(
            "shards['w'].global_shape is [4, 4]: 2 numbers for a 1-dimensional")):
        asyncckpt.AsyncCheckpointer(tmp_path).load(
            {"w": torch.zeros(4)}, shards={"w": asyncckpt.ShardMetadata((4, 4), (0, 0))})
    with pytest.raises(asyncckpt.CheckpointConfigError, match=re.escape(
            "shards['w'] is (4, 4): pass asyncckpt.ShardMetadata(global_shape=..., offsets=...)")):
        asyncckpt.AsyncCheckpointer(tmp_path).load(
            {"w": torch.zeros(2, 4)}, shards={"w": (4, 4)})  # (an AttributeError escaped)
    with pytest.raises(asyncckpt.CheckpointConfigError, match="does not fit in global shape"):
        asyncckpt.AsyncCheckpointer(tmp_path).load(
            {"w": torch.zeros(2, 4)}, shards={"w": asyncckpt.ShardMetadata((4, 4), (3, 0))})


@pytest.mark.parametrize("args, field", [
    (((8, 6), (2.0, 0)), "offsets"),
    (((8, 6), ("2", 0)), "offsets"),
    (((8, 6), (True, 0)), "offsets"),
    (((8.0, 6), (2, 0)), "global_shape"),
    ((8, (2, 0)), "global_shape"),
    (("86", (2, 0)), "global_shape"),
])
def test_shards_of_other_than_whole_numbers_are_refused(tmp_path, args, field):
    # (refused where it is written, not by the save or load it is passed to)
    with pytest.raises(asyncckpt.CheckpointConfigError,
                       match=re.escape(f"ShardMetadata's {field} is ")):
        asyncckpt.ShardMetadata(*args)
    for bad, why in ((((-4,), (0,)), "never negative"), (((4, 4), (0,)), "one offset per")):
        with pytest.raises(asyncckpt.CheckpointConfigError, match=why):
            asyncckpt.ShardMetadata(*bad)
    asyncckpt.save({"w": torch.zeros(8, 6)}, tmp_path, step=1)
    ck = asyncckpt.AsyncCheckpointer(tmp_path)
    # numpy's ints are whole numbers too
    target = {"w": torch.ones(2, 6)}
    ck.load(target, shards={"w": asyncckpt.ShardMetadata(
        (np.int64(8), 6), (np.int32(2), 0))})
    assert not target["w"].any()


boxes = st.integers(0, 3).flatmap(lambda r: st.tuples(
    st.lists(st.tuples(st.integers(0, 8), st.integers(0, 6)), min_size=r, max_size=r)))


@settings(max_examples=200, deadline=None)
@given(boxes, boxes)
def test_intersect_property(a, b):
    (da,), (db,) = a, b
    r = min(len(da), len(db))
    ba = (tuple(o for o, _ in da[:r]), tuple(n for _, n in da[:r]))
    bb = (tuple(o for o, _ in db[:r]), tuple(n for _, n in db[:r]))
    got = intersect(ba, bb)
    assert got == intersect(bb, ba)
    shape = (16,) * r
    ma, mb = np.zeros(shape, bool), np.zeros(shape, bool)
    ma[tuple(slice(o, o + n) for o, n in zip(*ba, strict=True))] = True
    mb[tuple(slice(o, o + n) for o, n in zip(*bb, strict=True))] = True
    both = ma & mb
    if both.any():
        assert got is not None
        mg = np.zeros(shape, bool)
        mg[tuple(slice(o, o + n) for o, n in zip(*got, strict=True))] = True
        assert (mg == both).all()
    elif got is not None:
        assert math.prod(got[1]) == 0  # only empty boxes may "meet" without sharing elements


# --- tiling_problem ---------------------------------------------------------------------------

def _tiling_by_counting(shape, boxes, allow_gaps):
    """The verdict tiling_problem must give, by counting every element's boxes."""
    count = np.zeros(shape, np.int64)
    for offs, lens in boxes:
        count[tuple(slice(o, o + n) for o, n in zip(offs, lens, strict=True))] += 1
    if (count > 1).any():
        return "chunks overlap"
    if not allow_gaps and (count == 0).any():
        return "chunks leave part of the tensor uncovered"
    return None


def _check_verdict(shape, boxes, allow_gaps):
    """tiling_problem's verdict is the counting one, and a hole it names is one: every
    element of the box (or indices) it names is in no box."""
    got = tiling_problem(shape, boxes, allow_gaps=allow_gaps)
    want = _tiling_by_counting(shape, boxes, allow_gaps)
    assert (None if got is None else got.split(" (")[0]) == want, got
    if want != "chunks leave part of the tensor uncovered":
        return
    count = np.zeros(shape, np.int64)
    for offs, lens in boxes:
        count[tuple(slice(o, o + n) for o, n in zip(offs, lens, strict=True))] += 1
    m = re.search(r"box at offsets \[(.*)\] of lengths \[(.*)\]\)", got)
    if m is not None:
        offs = [int(x) for x in m.group(1).split(",")]
        lens = [int(x) for x in m.group(2).split(",")]
        hole = tuple(slice(o, o + n) for o, n in zip(offs, lens, strict=True))
    else:
        m = re.search(r"indices (\d+)\.\.(\d+)(?: along dimension (\d+))?\)", got)
        assert m is not None, got
        d = int(m.group(3) or 0)
        hole = tuple(slice(int(m.group(1)), int(m.group(2)) + 1) if i == d else slice(None)
                     for i in range(len(shape)))
    assert count[hole].size > 0 and (count[hole] == 0).all(), (got, count)


@st.composite
def shape_and_boxes(draw):
    """A grid that tiles a shape, often spoiled: a cell dropped, doubled, or a box added."""
    rank = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=rank, max_size=rank)))
    edges = [sorted({0, n, *draw(st.lists(st.integers(0, n), max_size=3))}) for n in shape]
    cells = [(tuple(a for a, _ in cell), tuple(b - a for a, b in cell))
             for cell in itertools.product(*(itertools.pairwise(e) for e in edges))]
    for _ in range(draw(st.integers(0, 2))):
        op = draw(st.sampled_from(["drop", "double", "add"]))
        if op == "drop" and cells:
            cells.pop(draw(st.integers(0, len(cells) - 1)))
        elif op == "double" and cells:
            cells.append(cells[draw(st.integers(0, len(cells) - 1))])
        else:
            offs = tuple(draw(st.integers(0, n)) for n in shape)
            cells.append((offs, tuple(draw(st.integers(0, n - o))
                                      for n, o in zip(shape, offs, strict=True))))
    return shape, draw(st.permutations(cells))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape_and_boxes(), st.booleans())
def test_tiling_problem_matches_counting_every_element(case, allow_gaps):
    shape, boxes = case
    _check_verdict(shape, boxes, allow_gaps)


@st.composite
def slabs(draw):
    """Slabs along one dimension (a Shard(d) tensor's chunks), often spoiled: a slab
    dropped, doubled, widened into its neighbour, or made partial in another dimension."""
    rank = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=rank, max_size=rank)))
    d = draw(st.integers(0, rank - 1))
    edges = sorted({0, shape[d], *draw(st.lists(st.integers(0, shape[d]), max_size=4))})

    def box(a: int, b: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (tuple(a if i == d else 0 for i in range(rank)),
                tuple(b - a if i == d else n for i, n in enumerate(shape)))

    boxes = [box(a, b) for a, b in itertools.pairwise(edges)]
    for _ in range(draw(st.integers(0, 2))):
        op = draw(st.sampled_from(["drop", "double", "widen", "other dim"]))
        i = draw(st.integers(0, len(boxes) - 1))
        (offs, lens) = boxes[i]
        if op == "drop":
            boxes.pop(i)
        elif op == "double":
            boxes.append(boxes[i])
        elif op == "widen" and offs[d] + lens[d] < shape[d]:
            boxes[i] = box(offs[d], offs[d] + lens[d] + 1)
        elif op == "other dim" and rank > 1:
            e = (d + 1) % rank
            boxes[i] = (offs, tuple(n - 1 if j == e and n > 1 else n
                                    for j, n in enumerate(lens)))
        if not boxes:
            break
    return shape, draw(st.permutations(boxes))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(slabs(), st.booleans())
def test_tiling_problem_of_slabs_matches_counting_every_element(case, allow_gaps):
    """The slab shortcut (one partial dimension: sorted intervals, no grid) gives the
    grid check's verdict."""
    shape, boxes = case
    _check_verdict(shape, boxes, allow_gaps)


@st.composite
def many_slabs(draw):
    """At least 16 slabs along one dimension (what numpy checks), often spoiled."""
    rank = draw(st.integers(1, 3))
    d = draw(st.integers(0, rank - 1))
    shape = tuple(draw(st.integers(16, 40)) if i == d else draw(st.integers(1, 4))
                  for i in range(rank))
    edges = sorted({0, shape[d], *draw(st.sets(st.integers(1, shape[d] - 1), min_size=15,
                                                max_size=shape[d] - 1))})
    boxes = [(tuple(a if i == d else 0 for i in range(rank)),
              tuple(b - a if i == d else n for i, n in enumerate(shape)))
             for a, b in itertools.pairwise(edges)]
    boxes += [(tuple(a if i == d else 0 for i in range(rank)),
               tuple(0 if i == d else n for i, n in enumerate(shape)))
              for a in draw(st.lists(st.integers(0, shape[d]), max_size=2))]  # empty ones
    for _ in range(draw(st.integers(0, 2))):
        op = draw(st.sampled_from(["drop", "double", "widen", "other dim", "outside"]))
        i = draw(st.integers(0, len(boxes) - 1))
        offs, lens = boxes[i]
        if op == "drop":
            boxes.pop(i)
        elif op == "double":
            boxes.append(boxes[i])
        elif op == "widen":
            boxes[i] = (offs, tuple(n + 1 if j == d else n for j, n in enumerate(lens)))
        elif op == "other dim" and rank > 1:
            e = (d + 1) % rank
            boxes[i] = (offs, tuple(n - 1 if j == e and n > 1 else n
                                    for j, n in enumerate(lens)))
        elif op == "outside":
            boxes[i] = (tuple(o + 1 if j == d else o for j, o in enumerate(offs)), lens)
    return shape, draw(st.permutations(boxes))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(many_slabs(), st.booleans())
def test_tiling_problem_of_many_slabs_matches_counting_every_element(case, allow_gaps):
    """From 16 boxes, slabs that tile are recognised in numpy; the verdict (and, for
    anything else, the problem named) is the one the checks one by one give."""
    shape, boxes = case
    if any(o + n > s for b in boxes for o, n, s in zip(*b, shape, strict=True)):
        assert tiling_problem(shape, boxes, allow_gaps=allow_gaps).startswith("chunk at")
        return
    _check_verdict(shape, boxes, allow_gaps)


def test_tiling_problem_rejects_nested_boxes_without_visiting_each_one():
    # K boxes nested on the diagonal of a K x K tensor: adding each box to a count before
    # looking for overlaps took O(K^3) (seconds for one small hostile manifest)
    k = 1500
    nested = [((i, i), (k - i, k - i)) for i in range(k)]
    assert tiling_problem((k, k), nested) == "chunks overlap"
    assert tiling_problem((k, k), nested[::-1]) == "chunks overlap"
    assert tiling_problem((k, k), nested[::-1], allow_gaps=True) == "chunks overlap"


# --- plan_reads -------------------------------------------------------------------------------

def _grid_manifest(shape, cuts_per_dim, files, dtype=torch.float32, key="t"):
    """A manifest whose chunks are the cells of a grid that partitions ``shape``."""
    edges = [sorted({0, n, *cuts}) for n, cuts in zip(shape, cuts_per_dim, strict=True)]
    spans = [list(itertools.pairwise(e)) for e in edges]
    pos = dict.fromkeys(files, 4096)
    chunks = []
    for i, cell in enumerate(itertools.product(*spans)):
        offsets = tuple(a for a, _ in cell)
        lengths = tuple(b - a for a, b in cell)
        file = files[i % len(files)]
        n = math.prod(lengths) * dtype.itemsize
        chunks.append(Chunk(file, f"{key}.{i}", offsets, lengths, (pos[file], pos[file] + n),
                            tuple(block_checksums(bytes(n), 4096))))
        pos[file] += n
    return Manifest(step=0, world_size=len(files), created_unix=0.0, library_version="t",
                    block_bytes=4096,
                    files={f: FileEntry(f, pos[f], r, 8, "0" * 16) for r, f in enumerate(files)},
                    tensors={key: TensorEntry(dtype, tuple(shape), "torch", tuple(chunks))},
                    skeleton={"t": "tensor", "key": key})


@st.composite
def grid_and_box(draw):
    rank = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=rank, max_size=rank)))
    cuts = [draw(st.lists(st.integers(1, max(1, n - 1)), max_size=3)) if n > 1 else []
            for n in shape]
    files = draw(st.sampled_from([["a.safetensors"], ["a.safetensors", "b.safetensors"],
                                  ["z.safetensors", "a.safetensors", "m.safetensors"]]))
    offsets, lengths = [], []
    for n in shape:
        o = draw(st.integers(0, n - 1))
        offsets.append(o)
        lengths.append(draw(st.integers(1, n - o)))
    return shape, cuts, files, (tuple(offsets), tuple(lengths))


def _slices(box):
    return tuple(slice(o, o + n) for o, n in zip(*box, strict=True))


def _inside(inner, outer):
    return all(oo <= io and io + il <= oo + ol
               for io, il, oo, ol in zip(inner[0], inner[1], outer[0], outer[1], strict=True))


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(grid_and_box())
def test_plan_reads_cover_the_wanted_box_exactly_once(case):
    shape, cuts, files, wanted = case
    manifest = _grid_manifest(shape, cuts, files)
    items = plan_reads(manifest, {"t": wanted})
    count = np.zeros(shape, dtype=np.int64)
    for it in items:
        assert it.key == "t"
        assert it.dst_box == wanted
        chunk_box = (it.chunk.offsets, it.chunk.lengths)
        assert _inside(it.box, chunk_box)
        assert _inside(it.box, wanted)
        assert math.prod(it.box[1]) > 0
        assert it.whole_chunk == (it.box == chunk_box)
        assert it.whole_dst == (it.box == wanted)
        count[_slices(it.box)] += 1
    inside = np.zeros(shape, dtype=bool)
    inside[_slices(wanted)] = True
    assert (count[inside] == 1).all(), "every wanted element is read exactly once"
    assert (count[~inside] == 0).all(), "nothing outside the wanted box is read"
    order = [(it.chunk.file, it.chunk.byte_range[0]) for it in items]
    assert order == sorted(order), "reads go in file and byte order"


@settings(max_examples=100, deadline=None)
@given(grid_and_box())
def test_plan_reads_whole_tensor_reads_every_chunk_once(case):
    shape, cuts, files, _ = case
    manifest = _grid_manifest(shape, cuts, files)
    items = plan_reads(manifest, {"t": None})
    chunks = manifest.tensors["t"].chunks
    assert sorted(it.chunk.key for it in items) == sorted(c.key for c in chunks)
    assert all(it.whole_chunk for it in items)
    full = (tuple(0 for _ in shape), tuple(shape))
    assert all(it.dst_box == full for it in items)
    assert all(it.whole_dst == (len(chunks) == 1) for it in items)


def test_plan_reads_of_a_single_whole_chunk_is_direct():
    m = _grid_manifest((4, 6), [[], []], ["a.safetensors"])
    (item,) = plan_reads(m, {"t": None})
    assert item.whole_chunk and item.whole_dst
    assert item.box == ((0, 0), (4, 6))


def test_plan_reads_of_an_empty_tensor_still_visits_its_chunk():
    # the reader verifies checksums per read item: an empty tensor must still get one
    chunk = Chunk("a.safetensors", "t", (0, 0), (0, 3), (4096, 4096),
                  tuple(block_checksums(b"", 4096)))
    m = Manifest(step=0, world_size=1, created_unix=0.0, library_version="t", block_bytes=4096,
                 files={"a.safetensors": FileEntry("a.safetensors", 4096, 0, 8, "0" * 16)},
                 tensors={"t": TensorEntry(torch.float32, (0, 3), "torch", (chunk,))},
                 skeleton={"t": "tensor", "key": "t"})
    (item,) = plan_reads(m, {"t": None})
    assert item.box == ((0, 0), (0, 3)) and item.whole_chunk


def test_plan_reads_several_tensors():
    a = _grid_manifest((4,), [[2]], ["a.safetensors"], key="a")
    b = _grid_manifest((3, 3), [[1], [2]], ["b.safetensors"], key="b")
    m = Manifest(step=0, world_size=1, created_unix=0.0, library_version="t", block_bytes=4096,
                 files={**a.files, **b.files}, tensors={**a.tensors, **b.tensors},
                 skeleton={"t": "none"})
    items = plan_reads(m, {"a": ((1,), (2,)), "b": None})
    assert sorted({it.key for it in items}) == ["a", "b"]
    assert len([it for it in items if it.key == "a"]) == 2
    assert len([it for it in items if it.key == "b"]) == 4


# --- byte spans of sub-boxes ------------------------------------------------------------------

@st.composite
def chunk_and_inner_box(draw):
    rank = draw(st.integers(0, 3))
    lengths = tuple(draw(st.lists(st.integers(1, 5), min_size=rank, max_size=rank)))
    offsets = tuple(draw(st.lists(st.integers(0, 4), min_size=rank, max_size=rank)))
    box_off, box_len = [], []
    for o, n in zip(offsets, lengths, strict=True):
        start = draw(st.integers(0, n - 1))
        box_off.append(o + start)
        box_len.append(draw(st.integers(1, n - start)))
    return offsets, lengths, (tuple(box_off), tuple(box_len))


@settings(max_examples=200, deadline=None)
@given(chunk_and_inner_box(), st.sampled_from([1, 2, 4, 8, 16]))
def test_box_byte_span_spans_first_to_last_element(case, itemsize):
    offsets, lengths, box = case
    # the element index of every cell of the chunk, in its row-major layout
    index = np.arange(math.prod(lengths)).reshape(lengths)
    rel = tuple(slice(o - c, o - c + n) for o, n, c in zip(*box, offsets, strict=True))
    inside = index[rel]
    lo, hi = box_byte_span(offsets, lengths, box, itemsize)
    assert lo == int(inside.min()) * itemsize
    assert hi == (int(inside.max()) + 1) * itemsize
    assert 0 <= lo < hi <= math.prod(lengths) * itemsize


def test_box_byte_span_of_an_empty_box_is_empty():
    assert box_byte_span((0, 0), (4, 4), ((1, 1), (0, 2)), 4) == (0, 0)


@pytest.mark.parametrize("shape", [(), (5,), (2, 3), (4, 1, 3), (0, 2)])
def test_row_major_strides_match_torch(shape):
    assert row_major_strides(shape) == torch.empty(shape).stride()


@settings(max_examples=400, deadline=None)
@given(extent=st.integers(0, 12), allow_gaps=st.booleans(),
       spans=st.lists(st.tuples(st.integers(0, 12), st.integers(1, 6)), max_size=6))
def test_slabs_fit_in_numpy_is_slabs_problem_finding_nothing(
        extent: int, allow_gaps: bool, spans: list[tuple[int, int]]) -> None:
    """The table parse's check of a 1-D mesh's slabs, one pass in numpy, says what the
    loop over them says."""
    from asyncckpt.boxes import slabs_fit, slabs_problem

    spans = sorted((lo, lo + n) for lo, n in spans if lo + n <= extent)
    lo = np.array([s[0] for s in spans], dtype=np.int64)
    hi = np.array([s[1] for s in spans], dtype=np.int64)
    assert slabs_fit(extent, lo, hi, allow_gaps) == (
        slabs_problem(extent, spans, allow_gaps) is None)
