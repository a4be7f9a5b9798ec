"""The on-disk format: safetensors headers, the manifest schema and its validation, checksums."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import itertools
import json
import math
import struct
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import safetensors
import safetensors.torch
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import asyncckpt
from _manifests import long_entries
from asyncckpt import CheckpointCorruptError, CheckpointVersionError
from asyncckpt.manifest import (
    _NUMPY_DTYPES,
    _STORABLE_DTYPES,
    ALIGN,
    FORMAT_VERSION,
    MAX_HEADER_BYTES,
    TABLE_MIN_CHUNKS,
    BlockHasher,
    Chunk,
    FileEntry,
    HeaderEntry,
    Manifest,
    TensorEntry,
    block_checksums,
    decode_header,
    encode_header,
    parse_manifest,
    seal,
)
from reliability.fuzz_manifest import past_digest, reseal

PATH = "/ckpt/step_000000007/manifest.json"
FILE = "rank_00000.safetensors"
BLOCK = 4096


def _chunk(key, dtype, shape, start, offsets=None, lengths=None, file=FILE):
    lengths = tuple(shape) if lengths is None else tuple(lengths)
    offsets = tuple(0 for _ in shape) if offsets is None else tuple(offsets)
    n = math.prod(lengths) * dtype.itemsize
    sums = block_checksums(bytes(n), BLOCK)
    return Chunk(file, key, offsets, lengths, (start, start + n), tuple(sums))


def make_manifest(**overrides) -> Manifest:
    """A small valid manifest: a 2-D tensor in two chunks, a 0-d scalar, an empty tensor."""
    base = 4096
    w0 = _chunk("w.0", torch.float32, (4, 3), base, (0, 0), (2, 3))
    w1 = _chunk("w.1", torch.float32, (4, 3), w0.byte_range[1], (2, 0), (2, 3))
    s = _chunk("s", torch.int64, (), w1.byte_range[1])
    big = _chunk("big", torch.uint8, (5000,), s.byte_range[1])  # two checksum blocks
    e = _chunk("e", torch.float16, (0, 3), big.byte_range[1])
    end = e.byte_range[1]
    tensors = {
        "model/w": TensorEntry(torch.float32, (4, 3), "torch", (w0, w1)),
        "step_arr": TensorEntry(torch.int64, (), "numpy_scalar", (s,)),
        "big": TensorEntry(torch.uint8, (5000,), "numpy", (big,)),
        "empty": TensorEntry(torch.float16, (0, 3), "torch", (e,)),
    }
    skeleton = {"t": "dict", "items": [
        ["model", {"t": "stateful", "cls": "Linear", "state": {"t": "dict", "items": [
            ["w", {"t": "tensor", "key": "model/w"}]]}}],
        ["step_arr", {"t": "npscalar", "key": "step_arr"}],
        ["big", {"t": "ndarray", "key": "big"}],
        ["empty", {"t": "tensor", "key": "empty"}],
        [3, {"t": "tuple", "items": [{"t": "none"}, {"t": "bool", "v": True},
                                     {"t": "int", "v": -5}, {"t": "float", "v": "-0.0"},
                                     {"t": "str", "v": "x"}, {"t": "bytes", "v": "AAE="}]}],
        ["l", {"t": "list", "items": []}],
    ]}
    fields = dict(step=7, world_size=1, created_unix=1700000000.25, library_version="0.1.0",
                  block_bytes=BLOCK, files={FILE: FileEntry(FILE, end, 0, 8, "0" * 16)},
                  tensors=tensors,
                  skeleton=skeleton, user_metadata={"run": "exp1", "note": "\u00e9"})
    fields.update(overrides)
    return Manifest(**fields)


def _reference_json(m: Manifest) -> bytes:
    """What Manifest.to_json writes, by json.dumps of plain dicts (how it was written
    before the tensors got an encoder of their own)."""
    doc: dict = {
        "format": "asyncckpt", "format_version": m.format_version,
        "library_version": m.library_version, "step": m.step, "created_unix": m.created_unix,
        "world_size": m.world_size,
        "checksum": {"algorithm": "xxh3_64", "block_bytes": m.block_bytes},
        "files": {n: {"bytes": f.bytes, "rank": f.rank, "header_bytes": f.header_bytes,
                      "header_checksum": f.header_checksum} for n, f in m.files.items()},
        "tensors": {k: _reference_entry(m, k, t) for k, t in m.tensors.items()},
        "skeleton": m.skeleton, "user_metadata": m.user_metadata}
    if m.partial:
        doc["partial"] = True
    return seal(json.dumps(doc, separators=(",", ":"), ensure_ascii=True).encode("ascii"))


def _reference_entry(m: Manifest, key: str, t: TensorEntry) -> Any:
    """A tensor's entry: from format version 2, a tensor that is one chunk holding all of
    it under its own key is ``[dtype, shape, kind, file, start, checksums]``; from 3, a
    chunk of several under the tensor's key is ``[file, offsets, lengths, start,
    checksums]``."""
    dtype = str(t.dtype).removeprefix("torch.")
    (c, *more) = t.chunks
    if (m.format_version >= 4 and t.shape and len(t.chunks) >= TABLE_MIN_CHUNKS
            and all(ch.key == key for ch in t.chunks)):
        rows = [v for ch in t.chunks for v in (m.files[ch.file].rank, ch.byte_range[0],
                                               *ch.offsets, *ch.lengths)]
        return {"dtype": dtype, "shape": list(t.shape), "kind": t.kind, "table": {
            "rows": rows, "checksums": [s for ch in t.chunks for s in ch.checksums]}}
    if (m.format_version >= 2 and not more and c.key == key and list(c.lengths) == list(t.shape)
            and set(c.offsets) <= {0}):
        return [dtype, list(t.shape), t.kind, c.file, c.byte_range[0], list(c.checksums)]
    return {"dtype": dtype, "shape": list(t.shape), "kind": t.kind,
            "chunks": [[c.file, list(c.offsets), list(c.lengths), c.byte_range[0],
                        list(c.checksums)] if m.format_version >= 3 and c.key == key else
                       {"file": c.file, "key": c.key, "offsets": list(c.offsets),
                        "lengths": list(c.lengths), "byte_range": list(c.byte_range),
                        "checksums": list(c.checksums)} for c in t.chunks]}


@settings(max_examples=150, deadline=None)
@given(keys=st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=6, unique=True),
       partial=st.booleans(), version=st.sampled_from([1, 2, 3, FORMAT_VERSION]))
def test_to_json_writes_the_bytes_json_dumps_would(keys: list[str], partial: bool,
                                                   version: int) -> None:
    """Keys of any text (quotes, backslashes, control characters, non-ASCII, surrogates
    aside) come out quoted exactly as json.dumps quotes them, and so does the rest, in
    the long entries of tensors of several chunks and the short ones of whole tensors."""
    keys = [k for k in keys if not any(0xD800 <= ord(ch) <= 0xDFFF for ch in k)] or ["k"]
    base = make_manifest()
    w, big = base.tensors["model/w"], base.tensors["big"]
    tensors = {}
    for k in keys:
        tensors[k] = TensorEntry(w.dtype, w.shape, w.kind,
                                 tuple(c._replace(key=k) for c in w.chunks))
        tensors[k + "/whole"] = TensorEntry(big.dtype, big.shape, big.kind, tuple(
            c._replace(key=k + "/whole") for c in big.chunks))
    tensors.update(base.tensors)
    m = make_manifest(tensors=tensors, partial=partial, format_version=version)
    assert m.to_json() == _reference_json(m)


def good_doc() -> dict:
    """make_manifest's document, every tensor entry long (the fields the tests change)."""
    return long_entries(json.loads(make_manifest().to_json()))


def parse_doc(doc) -> Manifest:
    doc = {k: v for k, v in doc.items() if k != "digest"}
    return parse_manifest(seal(json.dumps(doc).encode()), PATH)


# --- safetensors headers ----------------------------------------------------------------------

def _decode_padded(out: bytes) -> tuple[int, dict]:
    (n,) = struct.unpack("<Q", out[:8])
    return n, json.loads(out[8:8 + n])


def test_encode_header_is_length_prefixed_padded_json():
    entries = [HeaderEntry("a", torch.float32, (2, 3), 0, 24),
               HeaderEntry("b/c", torch.int8, (5,), 24, 29)]
    out = encode_header(entries, {"asyncckpt_format": "1"})
    assert len(out) % ALIGN == 0
    n, header = _decode_padded(out)
    assert 8 + n == len(out)
    body = out[8:]
    stripped = body.rstrip(b" ")
    assert set(body[len(stripped):]) <= {ord(" ")}
    assert stripped.endswith(b"}")
    assert header["__metadata__"] == {"format": "pt", "asyncckpt_format": "1"}
    assert header["a"] == {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}
    assert header["b/c"] == {"dtype": "I8", "shape": [5], "data_offsets": [24, 29]}
    decoded, body_offset = decode_header(out, "f")
    assert decoded == header
    assert body_offset == len(out)


def test_encode_header_pads_only_when_needed():
    def raw_len(m):
        return len(json.dumps({"__metadata__": {"format": "pt", "k": "x" * m}},
                              separators=(",", ":")))

    m = ALIGN - 8 - raw_len(0)  # JSON exactly fills the first 4 KiB with the prefix
    assert raw_len(m) + 8 == ALIGN
    exact = encode_header([], {"k": "x" * m})
    assert len(exact) == ALIGN and exact.endswith(b"}")
    over = encode_header([], {"k": "x" * (m + 1)})
    assert len(over) == 2 * ALIGN and over.endswith(b" ")
    assert decode_header(over, "f")[0]["__metadata__"]["k"] == "x" * (m + 1)


def test_encode_header_grows_past_one_block():
    entries = [HeaderEntry(f"tensor_{i:04d}", torch.float32, (1,), 4 * i, 4 * i + 4)
               for i in range(300)]
    out = encode_header(entries)
    assert len(out) > ALIGN and len(out) % ALIGN == 0
    header, off = decode_header(out, "f")
    assert off == len(out) and len(header) == 301


def _all_dtypes():
    names = ["bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
             "float16", "bfloat16", "float32", "float64", "complex32", "complex64",
             "complex128", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
             "float8_e8m0fnu", "float4_e2m1fn_x2"]
    return [getattr(torch, n) for n in names if isinstance(getattr(torch, n, None), torch.dtype)]


# dtypes safetensors has no name for: the file must carry their raw bytes as U8
_RAW_DTYPES = {torch.complex32, torch.complex128, getattr(torch, "float8_e8m0fnu", None),
               getattr(torch, "float4_e2m1fn_x2", None)}


def _random_tensor(dtype, shape, seed):
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape) * dtype.itemsize
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw & 1
    return raw.view(dtype).reshape(shape)


def test_header_and_body_open_with_real_safetensors(tmp_path, tensor_bytes):
    tensors = {}
    for i, dt in enumerate(_all_dtypes()):
        tensors[f"t/{dt}".replace("torch.", "")] = _random_tensor(dt, (3, 2), i)
        tensors[f"scalar_{i}"] = _random_tensor(dt, (), 100 + i)
        tensors[f"empty_{i}"] = _random_tensor(dt, (0, 2), 0)
    order = sorted(tensors, key=lambda k: -tensors[k].element_size())
    entries, body, pos = [], b"", 0
    for k in order:
        data = tensor_bytes(tensors[k])
        entries.append(HeaderEntry(k, tensors[k].dtype, tuple(tensors[k].shape), pos,
                                   pos + len(data)))
        body += data
        pos += len(data)
    path = tmp_path / "x.safetensors"
    path.write_bytes(encode_header(entries, {"user": "meta"}) + body)

    loaded = safetensors.torch.load_file(str(path))
    assert set(loaded) == set(tensors)
    with safetensors.safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "user": "meta"}
        assert set(f.keys()) == set(tensors)
        for k, src in tensors.items():
            got = f.get_tensor(k)
            for t in (got, loaded[k]):
                if src.dtype in _RAW_DTYPES:
                    assert t.dtype == torch.uint8
                    assert tuple(t.shape) == (src.numel() * src.element_size(),)
                else:
                    assert t.dtype == src.dtype
                    assert t.shape == src.shape
                assert tensor_bytes(t) == tensor_bytes(src), k


# --- decode_header ----------------------------------------------------------------------------

@pytest.mark.parametrize("prefix", [
    pytest.param(b"", id="empty"),
    pytest.param(b"\x01\x00", id="short"),
    pytest.param(struct.pack("<Q", 2**63) + b"{}", id="implausible-length"),
    pytest.param(struct.pack("<Q", 10) + b"{}", id="truncated"),
    pytest.param(struct.pack("<Q", 4) + b"{x}}", id="not-json"),
    pytest.param(struct.pack("<Q", 2) + b"\xff\xfe", id="not-utf8"),
    pytest.param(struct.pack("<Q", 2) + b"[]", id="not-an-object"),
    pytest.param(struct.pack("<Q", 4) + b"null", id="null"),
])
def test_decode_header_rejects_malformed_prefixes(prefix):
    with pytest.raises(CheckpointCorruptError) as info:
        decode_header(prefix, "/d/rank_00000.safetensors")
    assert "/d/rank_00000.safetensors" in str(info.value)
    assert info.value.path == "/d/rank_00000.safetensors"


def test_decode_header_rejects_deeply_nested_json():
    body = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(CheckpointCorruptError):
        decode_header(struct.pack("<Q", len(body)) + body, "/d/f")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_decode_header_fuzz_random_bytes(data):
    try:
        header, off = decode_header(data, "p")
    except CheckpointCorruptError:
        return
    assert isinstance(header, dict) and off <= len(data)


_json_text = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=6)),
    lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(st.text(max_size=4), c,
                                                                 max_size=3)),
    max_leaves=10).map(json.dumps)


@settings(max_examples=300, deadline=None)
@given(st.one_of(_json_text.map(str.encode), st.binary(max_size=40)), st.integers(-3, 3))
def test_decode_header_fuzz_consistent_length_prefix(body, slack):
    n = max(0, len(body) + slack)
    prefix = struct.pack("<Q", n) + body
    try:
        header, off = decode_header(prefix, "p")
    except CheckpointCorruptError:
        return
    assert isinstance(header, dict)
    assert off == 8 + n <= len(prefix)


# --- manifest round trip ----------------------------------------------------------------------

@pytest.mark.parametrize("version", [1, 2, 3, FORMAT_VERSION])
def test_manifest_json_roundtrip_is_exact(version):
    m = make_manifest(format_version=version)
    back = parse_manifest(m.to_json(), PATH)
    assert back == m
    assert back.total_bytes == m.files[FILE].bytes
    assert back.tensors["model/w"].nbytes == 48
    assert back.format_version == version
    # int dict keys of the skeleton survive
    assert back.skeleton["items"][4][0] == 3
    # version 2 writes a whole tensor stored under its own key short; the one of two
    # chunks, and those stored under another key ("s", "e"), long. Version 1 knows only
    # the long entries.
    short = {k for k, t in json.loads(m.to_json())["tensors"].items() if isinstance(t, list)}
    assert short == ({"big"} if version >= 2 else set())


def test_a_short_entry_in_a_version_1_manifest_is_corrupt():
    doc = json.loads(make_manifest().to_json())
    doc["format_version"] = 1
    with pytest.raises(CheckpointCorruptError, match=r"'big'.*tensor must be an object"):
        parse_doc(doc)
    assert parse_doc(long_entries(doc)).format_version == 1  # the long entries it stands for


@settings(max_examples=60, deadline=None)
@given(step=st.integers(0, 2**62), created=st.floats(0, 2e9),
       meta=st.dictionaries(st.text(max_size=10), st.text(max_size=10), max_size=4),
       version=st.text(max_size=10))
def test_manifest_roundtrip_property(step, created, meta, version):
    m = make_manifest(step=step, created_unix=created, user_metadata=meta,
                      library_version=version)
    raw = m.to_json()
    raw.decode("ascii")  # the manifest is plain ASCII whatever the metadata holds
    assert parse_manifest(raw, PATH) == m


# --- manifest validation: each corruption is refused, naming the file --------------------------

def _set(path, value):
    def mutate(doc):
        *parents, last = path
        node = doc
        for p in parents:
            node = node[p]
        node[last] = value
    return mutate


def _rename_file(new):
    def mutate(doc):
        doc["files"] = {new: doc["files"][FILE]}
        for t in doc["tensors"].values():
            for c in t["chunks"]:
                c["file"] = new
    return mutate


def _w_chunk(field, value):
    return _set(["tensors", "model/w", "chunks", 0, field], value)


def _deep_skeleton_text(depth):
    return ('{"t":"list","items":[' * depth) + '{"t":"none"}' + (']}' * depth)


CORRUPTIONS = {
    "wrong-format-name": _set(["format"], "safetensors"),
    "missing-format": lambda d: d.pop("format"),
    "version-zero": _set(["format_version"], 0),
    "version-string": _set(["format_version"], "1"),
    "unknown-checksum": _set(["checksum", "algorithm"], "md5"),
    "tiny-block-bytes": _set(["checksum", "block_bytes"], 16),
    "unaligned-block-bytes": _set(["checksum", "block_bytes"], 4098),
    "file-with-slash": _rename_file("sub/rank_00000.safetensors"),
    "file-dotdot": _rename_file(".."),
    "file-dot": _rename_file("."),
    "file-parent-path": _rename_file("../../etc/passwd"),
    "file-absolute": _rename_file("/etc/passwd"),
    "file-empty": _rename_file(""),
    "file-backslash": _rename_file("..\\x"),
    "file-nul": _rename_file("a\x00b"),
    "file-negative-bytes": _set(["files", FILE, "bytes"], -1),
    "chunk-unknown-file": _w_chunk("file", "other.safetensors"),
    "byte-range-past-eof": _set(["tensors", "empty", "chunks", 0, "byte_range"],
                                [10**9, 10**9]),
    "byte-range-reversed": _w_chunk("byte_range", [4120, 4096]),
    "byte-range-three": _w_chunk("byte_range", [4096, 4120, 4120]),
    "byte-range-vs-lengths": _w_chunk("byte_range", [4096, 4124]),
    "lengths-vs-byte-range": _w_chunk("lengths", [1, 3]),
    "chunk-outside-shape": _w_chunk("offsets", [3, 0]),
    "chunk-rank-mismatch": _w_chunk("offsets", [0]),
    "too-few-checksums": _set(["tensors", "big", "chunks", 0, "checksums"],
                              [block_checksums(bytes(5000), BLOCK)[0]]),
    "too-many-checksums": _w_chunk("checksums", ["0" * 16, "0" * 16]),
    "no-checksums-for-empty": _set(["tensors", "empty", "chunks", 0, "checksums"], []),
    "checksum-wrong-length": _w_chunk("checksums", ["abc"]),
    "checksum-not-str": _w_chunk("checksums", [12345]),
    "checksum-not-hex": _w_chunk("checksums", ["g" * 16]),
    "checksum-upper-case": _w_chunk("checksums", ["ABCDEF0123456789"]),
    "checksum-of-whole-tensor-not-hex": _set(["tensors", "step_arr", "chunks", 0, "checksums"],
                                             ["-" * 16]),
    "header-checksum-not-hex": _set(["files", FILE, "header_checksum"], "z" * 16),
    "byte-ranges-overlap": _set(["tensors", "step_arr", "chunks", 0, "byte_range"],
                                [4104, 4112]),  # inside model/w's first chunk
    "byte-ranges-identical": _set(["tensors", "model/w", "chunks", 1, "byte_range"],
                                  [4096, 4120]),  # the first chunk's bytes again
    "byte-range-in-header": _set(["files", FILE, "header_bytes"], 4104),
    "header-bytes-past-max": lambda d: d["files"][FILE].update(bytes=2**40, header_bytes=2**40),
    "unknown-dtype": _set(["tensors", "model/w", "dtype"], "floaty"),
    "dtype-alias": _set(["tensors", "model/w", "dtype"], "float"),
    "dtype-not-a-dtype": _set(["tensors", "model/w", "dtype"], "tensor"),
    "unknown-kind": _set(["tensors", "model/w", "kind"], "pickle"),
    "negative-shape": _set(["tensors", "model/w", "shape"], [-4, 3]),
    "float-shape": _set(["tensors", "model/w", "shape"], [4.0, 3]),
    "bool-shape": _set(["tensors", "model/w", "shape"], [True, 3]),
    "shape-not-list": _set(["tensors", "model/w", "shape"], 12),
    "shape-rank-65": _set(["tensors", "model/w", "shape"], [1] * 65),
    "chunks-not-list": _set(["tensors", "model/w", "chunks"], {}),
    "skeleton-unknown-tensor": _set(["skeleton", "items", 0, 1, "state", "items", 0, 1, "key"],
                                    "model/nope"),
    "skeleton-unknown-type": _set(["skeleton", "items", 5, 1, "t"], "pickle"),
    "skeleton-no-type": _set(["skeleton", "items", 5, 1], {}),
    "skeleton-not-object": _set(["skeleton"], []),
    "skeleton-int-as-str": _set(["skeleton", "items", 4, 1, "items", 2, "v"], "5"),
    "skeleton-bool-as-int": _set(["skeleton", "items", 4, 1, "items", 1, "v"], 1),
    "skeleton-float-as-number": _set(["skeleton", "items", 4, 1, "items", 3, "v"], 0.5),
    "skeleton-dict-float-key": _set(["skeleton", "items", 0, 0], 1.5),
    "skeleton-dict-item-short": _set(["skeleton", "items", 0], ["model"]),
    "skeleton-list-no-items": _set(["skeleton", "items", 5, 1], {"t": "list"}),
    "skeleton-too-deep": lambda d: d.__setitem__("skeleton", json.loads(_deep_skeleton_text(300))),
    "step-negative": _set(["step"], -1),
    "step-bool": _set(["step"], True),
    "world-size-zero": _set(["world_size"], 0),
    "created-string": _set(["created_unix"], "yesterday"),
    "created-negative": _set(["created_unix"], -1.0),
    "created-past-year-9999": _set(["created_unix"], 5e11),
    "created-nan": _set(["created_unix"], float("nan")),
    "library-version-int": _set(["library_version"], 1),
    "metadata-list": _set(["user_metadata"], ["a"]),
    "files-list": _set(["files"], []),
    "tensors-list": _set(["tensors"], []),
    "document-list": lambda d: d.clear() or d.update({"not": "a manifest"}),
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_parse_manifest_rejects_corruption(name):
    doc = good_doc()
    CORRUPTIONS[name](doc)
    assert json.dumps(doc) != json.dumps(good_doc())
    with pytest.raises(CheckpointCorruptError) as info:
        parse_doc(doc)
    assert PATH in str(info.value)
    assert info.value.path == PATH


def _short(field, value):
    """Set item ``field`` of the short entry of tensor "big"."""
    at = {"dtype": 0, "shape": 1, "kind": 2, "file": 3, "start": 4, "checksums": 5}[field]
    return _set(["tensors", "big", at], value)


# Each damage of a short entry, with what the error says (it names tensor "big").
SHORT_CORRUPTIONS = {
    "too-short": (lambda d: d["tensors"]["big"].pop(), "list of 5"),
    "too-long": (lambda d: d["tensors"]["big"].append(0), "list of 7"),
    "unknown-dtype": (_short("dtype", "floaty"), "floaty"),
    "dtype-not-str": (_short("dtype", 7), "dtype must be a string"),
    "negative-shape": (_short("shape", [-5000]), "shape must be"),
    "bool-shape": (_short("shape", [True]), "shape must be"),
    "huge-shape": (_short("shape", [2**40, 2**40]), "impossibly large"),
    "shape-vs-checksums": (_short("shape", [4000]), "checksums"),
    "unknown-kind": (_short("kind", "pickle"), "kind"),
    "kind-not-str": (_short("kind", ["torch"]), "kind"),
    "unknown-file": (_short("file", "other.safetensors"), "does not list"),
    "file-not-str": (_short("file", 0), "chunk file must be a string"),
    "negative-start": (_short("start", -1), "start must be an integer >= 0"),
    "bool-start": (_short("start", True), "start must be an integer"),
    "float-start": (_short("start", 4152.0), "start must be an integer"),
    "start-past-eof": (_short("start", 10**9), "lies outside"),
    "start-in-other-tensor": (_short("start", 4096), "overlaps"),
    "too-few-checksums": (_short("checksums", ["0" * 16]), "needs 2"),
    "checksum-not-hex": (_short("checksums", ["0" * 16, "g" * 16]), "needs 2"),
    "checksums-not-list": (_short("checksums", "0" * 32), "needs 2"),
}


@pytest.mark.parametrize("name", sorted(SHORT_CORRUPTIONS))
def test_a_damaged_short_entry_is_corrupt_naming_its_tensor(name):
    damage, says = SHORT_CORRUPTIONS[name]
    doc = json.loads(make_manifest().to_json())
    damage(doc)
    with pytest.raises(CheckpointCorruptError) as info:
        parse_doc(doc)
    assert info.value.key == "big" and info.value.path == PATH
    assert says in str(info.value)


@pytest.mark.parametrize("raw", [
    pytest.param(b"", id="empty"),
    pytest.param(b"{not json", id="not-json"),
    pytest.param(b"\xff\xfe\x00", id="not-utf8"),
    pytest.param(b"[1, 2]", id="array"),
    pytest.param(b"null", id="null"),
    pytest.param(b"NaN", id="nan"),
    pytest.param(_deep_skeleton_text(10_000).encode(), id="deep-10000"),
    pytest.param(b'{"format":"asyncckpt","format_version":1,"skeleton":'
                 + _deep_skeleton_text(10_000).encode() + b"}", id="deep-skeleton-10000"),
])
def test_parse_manifest_rejects_bad_documents(raw):
    for doc in (raw, reseal(raw)):  # refused by the digest, and by the parser behind it
        with pytest.raises(CheckpointCorruptError) as info:
            parse_manifest(doc, PATH)
        assert PATH in str(info.value)
    assert past_digest(info.value), f"the re-sealed document stopped at the digest: {info.value}"


def test_header_bytes_are_bounded_by_the_largest_header():
    # A sparse file (or a peer's claim) can make a file as large as the manifest says:
    # header_bytes is allocated and hashed by every reader, so it is bounded on its own.
    doc = good_doc()
    doc["files"][FILE].update(bytes=2**40, header_bytes=8 + MAX_HEADER_BYTES + 1)
    with pytest.raises(CheckpointCorruptError, match="exceed the largest safetensors header"):
        parse_doc(doc)
    doc = good_doc()
    doc["files"][FILE]["header_bytes"] = 4096  # up to where the first tensor starts: fine
    assert parse_doc(doc).files[FILE].header_bytes == 4096


def test_overlapping_byte_ranges_name_both_tensors():
    doc = good_doc()
    doc["tensors"]["step_arr"]["chunks"][0]["byte_range"] = [4104, 4112]
    with pytest.raises(CheckpointCorruptError, match="overlaps the bytes of tensor 'model/w'") \
            as info:
        parse_doc(doc)
    assert info.value.key == "step_arr" and "4104, 4112" in str(info.value)


def test_many_tensors_sharing_one_byte_range_are_refused():
    # What made a 1 MiB file allocate and fill a GiB: every entry points at one range.
    doc = good_doc()
    for i in range(100):
        doc["tensors"][f"copy{i}"] = copy.deepcopy(doc["tensors"]["big"])
        doc["skeleton"]["items"].append([f"copy{i}", {"t": "tensor", "key": f"copy{i}"}])
    with pytest.raises(CheckpointCorruptError, match="overlaps"):
        parse_doc(doc)


def test_empty_chunks_may_lie_anywhere():
    # Zero-length ranges hold no bytes: inside the header or another tensor's is fine.
    for where in ([0, 0], [8, 8], [4100, 4100]):
        doc = good_doc()
        doc["tensors"]["empty"]["chunks"][0]["byte_range"] = where
        assert parse_doc(doc).tensors["empty"].chunks[0].byte_range == tuple(where)


def test_deep_but_valid_skeleton_within_limits_is_accepted():
    doc = good_doc()
    doc["skeleton"] = json.loads(_deep_skeleton_text(150))
    assert parse_doc(doc).skeleton == doc["skeleton"]


def test_newer_version_message_says_to_upgrade():
    doc = good_doc()
    doc["format_version"] = 99
    with pytest.raises(CheckpointVersionError, match="upgrade") as info:
        parse_doc(doc)
    assert not isinstance(info.value, CheckpointCorruptError)  # not damaged: no fallback


def _undigested(step_dir: Path) -> dict[str, Any]:
    """The manifest of ``step_dir`` as the first development builds wrote it: version 1,
    long entries, no digest, no shard header fields."""
    doc = long_entries(json.loads((step_dir / "manifest.json").read_bytes()))
    del doc["digest"]
    doc["format_version"] = 1
    for f in doc["files"].values():
        del f["header_bytes"], f["header_checksum"]
    return doc


def test_a_manifest_of_the_first_builds_is_refused_as_old_not_corrupt(tmp_path: Path) -> None:
    # It was "corrupt: truncated or not an asyncckpt manifest", in load, fallback and
    # verify alike: a user might have deleted good checkpoints.
    asyncckpt.save({"w": torch.arange(4.0)}, tmp_path, step=3)
    step_dir = tmp_path / "step_000000003"
    raw = json.dumps(_undigested(step_dir)).encode()
    (step_dir / "manifest.json").write_bytes(raw)
    for call in (lambda: asyncckpt.load(tmp_path), lambda: asyncckpt.load(tmp_path, step=3),
                 lambda: asyncckpt.load(tmp_path, {"w": torch.empty(4)}, fallback=True)):
        with pytest.raises(CheckpointVersionError, match="early development build") as info:
            call()
        assert not isinstance(info.value, CheckpointCorruptError)
        assert "save the state again" in str(info.value)
    # a truncated one is no complete document: damage, as before
    (step_dir / "manifest.json").write_bytes(raw[:-40])
    with pytest.raises(CheckpointCorruptError, match="does not end with its digest"):
        asyncckpt.load(tmp_path)


def test_a_manifest_without_its_digest_but_with_header_checksums_is_corrupt(
        tmp_path: Path) -> None:
    # (every build that wrote header checksums also sealed the manifest with a digest)
    asyncckpt.save({"w": torch.arange(4.0)}, tmp_path, step=3)
    step_dir = tmp_path / "step_000000003"
    doc = long_entries(json.loads((step_dir / "manifest.json").read_bytes()))
    del doc["digest"]
    doc["format_version"] = 1
    (step_dir / "manifest.json").write_bytes(json.dumps(doc).encode())
    with pytest.raises(CheckpointCorruptError, match="does not end with its digest"):
        asyncckpt.load(tmp_path)


@pytest.mark.parametrize("name", ["float8_e9m9fn", "float128", "uint256"])
@pytest.mark.parametrize("short", [False, True])
def test_a_dtype_this_torch_lacks_is_a_version_error_not_damage(name: str, short: bool):
    """A review: a reader on an older torch took a newer torch's dtype for a malformed
    manifest (CheckpointCorruptError), so a fallback load marked every intact step
    damaged and the trainer's retention deleted them. The digest matched: the manifest is
    as written, by a torch that had the dtype."""
    doc = json.loads(make_manifest().to_json()) if short else good_doc()
    key = "big" if short else "model/w"
    entry = doc["tensors"][key]
    if short:
        entry[0] = name
    else:
        entry["dtype"] = name
    with pytest.raises(CheckpointVersionError, match=rf"tensor '{key}' has dtype '{name}', "
                       r"which this torch \(.+\) does not have: the checkpoint is not "
                       "damaged") as info:
        parse_doc(doc)
    assert not isinstance(info.value, CheckpointCorruptError)


def test_dtype_error_names_the_tensor():
    doc = good_doc()
    doc["tensors"]["model/w"]["dtype"] = "floaty"
    with pytest.raises(CheckpointCorruptError) as info:
        parse_doc(doc)
    assert info.value.key == "model/w"


@pytest.mark.parametrize("key", [["model/w"], {"a": 1}])
def test_unhashable_skeleton_key_is_corrupt(key):
    doc = good_doc()
    doc["skeleton"]["items"][0][1]["state"]["items"][0][1]["key"] = key
    with pytest.raises(CheckpointCorruptError):
        parse_doc(doc)


def test_huge_created_unix_is_corrupt():
    raw = make_manifest().to_json().replace(b'"created_unix":1700000000.25',
                                            b'"created_unix":1' + b"0" * 400)
    assert raw != make_manifest().to_json()
    with pytest.raises(CheckpointCorruptError, match="created_unix"):
        parse_manifest(reseal(raw), PATH)


@pytest.mark.parametrize("created, ok", [(0, True), (253402300799, True), (253402300799.5, False),
                                         (-0.5, False)])
def test_created_unix_must_be_a_time_a_datetime_can_show(created, ok):
    doc = good_doc()
    doc["created_unix"] = created
    if ok:
        assert parse_doc(doc).created_unix == created
    else:
        with pytest.raises(CheckpointCorruptError, match="created_unix must be seconds from 0"):
            parse_doc(doc)


def _with_block_bytes(doc, block_bytes):
    """``doc`` with ``block_bytes`` and every chunk's checksums recomputed to match."""
    doc["checksum"]["block_bytes"] = block_bytes
    for t in doc["tensors"].values():
        for c in t["chunks"]:
            start, end = c["byte_range"]
            c["checksums"] = block_checksums(bytes(end - start), block_bytes)
    return doc


def test_block_bytes_must_be_a_multiple_of_4096():
    # a reader seeks to block starts: an unaligned block size would misalign its reads
    assert parse_doc(_with_block_bytes(good_doc(), 8192)).block_bytes == 8192
    doc = _with_block_bytes(good_doc(), 4098)
    with pytest.raises(CheckpointCorruptError,
                       match=r"checksum\.block_bytes 4098 is not a multiple of 4096") as info:
        parse_doc(doc)
    assert info.value.path == PATH


@pytest.mark.parametrize("key, node, dtype", [
    pytest.param("empty", "ndarray", "bfloat16", id="bfloat16-ndarray"),
    pytest.param("empty", "npscalar", "bfloat16", id="bfloat16-npscalar"),
    pytest.param("big", "ndarray", "float8_e4m3fn", id="float8-ndarray"),
    pytest.param("big", "ndarray", "float8_e5m2", id="float8-e5m2-ndarray"),
])
def test_numpy_node_of_a_dtype_numpy_lacks_is_corrupt(key, node, dtype):
    doc = good_doc()
    doc["tensors"][key]["dtype"] = dtype  # same itemsize: the byte ranges stay consistent
    skeleton_node = dict(doc["skeleton"]["items"])[key]  # "big" and "empty" sit at the top
    skeleton_node["t"] = node
    with pytest.raises(CheckpointCorruptError, match=f"{node} node has dtype {dtype}") as info:
        parse_doc(doc)
    assert info.value.key == key
    # the same tensor under a "tensor" node is fine: torch holds every storable dtype
    skeleton_node["t"] = "tensor"
    assert str(parse_doc(doc).tensors[key].dtype) == f"torch.{dtype}"


def test_numpy_dtypes_are_those_torch_converts_to_numpy():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32 warns that it is experimental
        for dtype in _STORABLE_DTYPES.values():
            try:
                torch.empty(0, dtype=dtype).numpy()  # (torch 2.4 cannot fill fp8 ones)
                converts = True
            except (TypeError, NotImplementedError):
                converts = False
            assert (dtype in _NUMPY_DTYPES) == converts, dtype


@pytest.mark.parametrize("shape, chunks", [
    pytest.param([4, 3], [], id="no-chunks"),
    pytest.param([2**40], [], id="huge-shape-no-chunks"),
    pytest.param([4, 3], "first-only", id="half-covered"),
])
def test_chunks_must_cover_the_tensor(shape, chunks):
    doc = good_doc()
    entry = doc["tensors"]["model/w"]
    entry["shape"] = shape
    entry["chunks"] = entry["chunks"][:1] if chunks == "first-only" else chunks
    with pytest.raises(CheckpointCorruptError):
        parse_doc(doc)


@pytest.mark.parametrize("dtype", ["qint8", "quint8", "bits8", "uint4"])
def test_unsavable_dtype_in_manifest_is_corrupt(dtype):
    doc = good_doc()
    assert getattr(torch, dtype).itemsize == 1  # byte_range of the uint8 tensor stays consistent
    doc["tensors"]["big"]["dtype"] = dtype
    with pytest.raises(CheckpointCorruptError):
        parse_doc(doc)


def test_file_name_with_trailing_newline_is_refused():
    doc = good_doc()
    _rename_file(FILE + "\n")(doc)
    with pytest.raises(CheckpointCorruptError):
        parse_doc(doc)


# --- fuzz: parse_manifest returns a Manifest or raises CheckpointCorruptError (or, for a
# format_version above ours, CheckpointVersionError), nothing else --------------------------

_VALID_RAW = make_manifest().to_json()
_COMPACT = json.dumps(json.loads(_VALID_RAW), separators=(",", ":"))  # short entries


def _parse_or_corrupt(raw: bytes) -> None:
    for doc in (raw, reseal(raw)):  # as damaged, and re-sealed to reach the parser
        try:
            m = parse_manifest(doc, PATH)
        except CheckpointCorruptError as exc:
            assert exc.path == PATH
            continue
        except CheckpointVersionError as exc:  # a mutated format_version above ours
            assert exc.path == PATH and "format version" in str(exc)
            continue
        assert isinstance(m, Manifest)


_edits = st.lists(st.tuples(st.sampled_from(["flip", "delete", "insert"]),
                            st.integers(0, len(_COMPACT)), st.integers(1, 8),
                            st.text(alphabet='{}[]",:0123456789-.eE tfnaul\\x', min_size=1,
                                    max_size=8)),
                  min_size=1, max_size=4)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_edits)
def test_fuzz_character_edits(edits):
    text = _COMPACT
    for op, pos, n, payload in edits:
        pos = min(pos, len(text))
        if op == "flip":
            text = text[:pos] + payload[:n] + text[pos + n:]
        elif op == "delete":
            text = text[:pos] + text[pos + n:]
        else:
            text = text[:pos] + payload + text[pos:]
    _parse_or_corrupt(text.encode())


def _all_paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _all_paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _all_paths(v, (*prefix, i))


_words = st.sampled_from(["tensor", "ndarray", "npscalar", "dict", "list", "tuple", "stateful",
                          "none", "int", "float", "str", "bool", "bytes", "model/w", "big",
                          FILE, "..", "float32", "uint8", "torch", "numpy", "xxh3_64",
                          "asyncckpt", "0" * 16])
_scalar_json = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                         st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=6),
                         _words)
_container_json = st.recursive(_scalar_json, lambda c: st.one_of(
    st.lists(c, max_size=3), st.dictionaries(st.one_of(st.text(max_size=4), _words), c,
                                             max_size=3)), max_leaves=6)


def _mutate_structure(data, values):
    # the manifest as written (short entries for its whole tensors) or all long
    doc = data.draw(st.sampled_from([json.loads(_VALID_RAW), good_doc()]), label="doc")
    paths = list(_all_paths(doc))
    for _ in range(data.draw(st.integers(1, 3), label="n_mutations")):
        path = data.draw(st.sampled_from(paths), label="path")
        op = data.draw(st.sampled_from(["replace", "delete", "insert"]), label="op")
        if not path:
            continue
        parent = doc
        try:
            for p in path[:-1]:
                parent = parent[p]
            last = path[-1]
            if not isinstance(parent, (dict, list)):
                continue  # an earlier mutation replaced this container with a scalar
            if op == "replace":
                parent[last] = data.draw(values, label="value")
            elif op == "delete":
                del parent[last]
            elif isinstance(parent, dict):
                parent[data.draw(_words, label="new key")] = data.draw(values, label="value")
            else:
                parent.insert(last, data.draw(values, label="value"))
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation removed or replaced this path
    return json.dumps(doc).encode()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzz_structural_scalar_mutations(data):
    _parse_or_corrupt(_mutate_structure(data, _scalar_json))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzz_structural_container_mutations(data):
    _parse_or_corrupt(_mutate_structure(data, _container_json))


def test_the_fuzz_base_documents_are_valid():
    assert parse_manifest(_COMPACT.encode(), PATH) == parse_manifest(_VALID_RAW, PATH)
    assert parse_doc(good_doc()) == parse_manifest(_VALID_RAW, PATH)
    assert isinstance(json.loads(_COMPACT)["tensors"]["big"], list)


# --- checksums --------------------------------------------------------------------------------

def _sizes(bb):
    return sorted({0, 1, bb - 1, bb, bb + 1, 2 * bb - 1, 2 * bb, 2 * bb + 1, 3 * bb})


@pytest.mark.parametrize("bb", [1, 7, 64, 4096])
def test_block_checksums_hash_each_block(bb):
    for n in _sizes(bb):
        data = bytes((i * 31 + 7) % 251 for i in range(n))
        sums = block_checksums(data, bb)
        assert len(sums) == max(1, -(-n // bb))
        if n == 0:
            assert sums == [xxhash.xxh3_64_hexdigest(b"")]
        else:
            assert sums == [xxhash.xxh3_64_hexdigest(data[i:i + bb]) for i in range(0, n, bb)]
        assert all(len(s) == 16 for s in sums)
        assert block_checksums(memoryview(data), bb) == sums


@settings(max_examples=200, deadline=None)
@given(bb=st.sampled_from([1, 3, 16, 64]), extra=st.integers(-2, 2), blocks=st.integers(0, 4),
       cuts=st.lists(st.integers(0, 300), max_size=8), seed=st.integers(0, 255))
def test_block_hasher_streaming_equals_one_shot(bb, extra, blocks, cuts, seed):
    n = max(0, blocks * bb + extra)
    data = bytes((seed + i * 17) % 256 for i in range(n))
    points = sorted({min(c, n) for c in cuts} | {0, n})
    hasher = BlockHasher(n, bb)
    for a, b in itertools.pairwise(points):
        hasher.update(memoryview(data)[a:b])
    assert hasher.finish() == block_checksums(data, bb)


def test_block_hasher_detects_a_flipped_byte():
    data = bytearray(range(200))
    good = block_checksums(bytes(data), 64)
    data[130] ^= 1
    h = BlockHasher(200, 64)
    h.update(memoryview(bytes(data)))
    got = h.finish()
    assert got[0] == good[0] and got[1] == good[1] and got[2] != good[2]


_ODD_VALUES = [None, True, False, 0, 1, -1, 2, 3, 12, 48, 2**62, 1.0, "x", "0" * 16, "float32",
               "torch", [], [0], [1], [True], [-1], [0, 0], [4, 3], [2, 3], [0, 48], [48, 0],
               ["0" * 16], ["0" * 15], [[]], {}, {"a": 1},
               # multi-block checksum lists that are wrong in one item only, and lists
               # equal to valid ones that hold no ints (4.0 == 4, False == 0)
               ["0" * 16, "0" * 16], ["0" * 15, "0" * 17], ["0" * 16, "g" * 16],
               ["0" * 16, 7], ["0" * 16, "0" * 16, "0" * 16], [4.0, 3], [4, 3.0], [0.0, 0],
               [False, 0], [0, False]]


def _fast_vs_checked(t: object, files: dict, block_bytes: int,
                     version: int = FORMAT_VERSION) -> int:
    """The one-pass parsers (a whole tensor; several chunks) agree with the checked one
    of format ``version``: same entry, or they decline. Returns how many took ``t``."""
    from asyncckpt.manifest import (
        _Check,
        _parse_chunked_tensor,
        _parse_tensor_checked,
        _parse_whole_tensor,
    )

    took = 0
    for fast_parse in (lambda t, f, b: _parse_whole_tensor("k", t, f, b),
                       lambda t, f, b: _parse_chunked_tensor("k", t, f, b, False, version)):
        try:
            fast = fast_parse(t, files, block_bytes)
        except Exception as exc:  # it must decline, never raise
            raise AssertionError(f"fast path raised {exc!r} on {t!r}") from exc
        if fast is None:
            continue
        slow = _parse_tensor_checked(_Check(PATH), "k", t, files,  # type: ignore[arg-type]
                                     block_bytes, False, version)
        assert fast == slow, t
        took += 1
    return took


def _mutations(entry: dict, fields: list[tuple]) -> Iterator[dict]:
    """Copies of a tensor entry, each with one field (a path into it) set to one of the
    odd values, or deleted."""
    for path in fields:
        for value in [*_ODD_VALUES, "__delete__"]:
            t = copy.deepcopy(entry)
            parent = t
            for p in path[:-1]:
                parent = parent[p]
            if value == "__delete__":
                del parent[path[-1]]
            else:
                parent[path[-1]] = value
            yield t


def test_fast_tensor_parse_accepts_exactly_what_the_checked_parse_accepts():
    doc = good_doc()
    files = parse_doc(doc).files
    whole = doc["tensors"]["big"]  # one chunk that is the whole tensor, two blocks
    _fast_vs_checked(whole, files, BLOCK)
    assert _parse_whole(whole, files) is not None  # the fast path does take valid entries
    fields = [("dtype",), ("shape",), ("kind",), ("chunks",)] + [
        ("chunks", 0, f) for f in ("file", "key", "offsets", "lengths", "byte_range",
                                   "checksums")]
    n = 0
    for t in _mutations(whole, fields):
        _fast_vs_checked(t, files, BLOCK)
        n += 1
    for name in ("step_arr", "empty", "model/w"):  # 0-d, empty and two-chunk tensors
        assert _fast_vs_checked(doc["tensors"][name], files, BLOCK) >= 1, name
    assert n > 300


def test_fast_parse_of_a_short_entry_accepts_exactly_what_the_checked_parse_accepts():
    """A short entry the one-pass parser declines is refused by the checked one, and one
    it takes gives the checked one's entry: every item set to each odd value, or
    removed, or one item more."""
    from asyncckpt.manifest import _Check, _parse_short_tensor, _parse_short_tensor_checked

    doc = json.loads(make_manifest().to_json())
    files = parse_doc(doc).files
    short = doc["tensors"]["big"]  # the whole tensor, two checksum blocks
    assert isinstance(short, list)
    one = [short[0], [4000], *short[2:5], short[5][:1]]  # the same bytes' first 4000: one block
    variants = [*_mutations(short, [(i,) for i in range(6)]), [*short, 0],
                *_mutations(one, [(1,), (5,)])]
    taken = 0
    for t in [short, one, *variants]:
        try:
            fast = _parse_short_tensor("big", t, files, BLOCK)
        except Exception as exc:  # it must decline, never raise
            raise AssertionError(f"fast path raised {exc!r} on {t!r}") from exc
        try:
            slow = _parse_short_tensor_checked(_Check(PATH), "big", t, files, BLOCK, False)
        except CheckpointCorruptError:
            assert fast is None, t
            continue
        assert fast == slow, t
        taken += 1
    assert len(variants) > 300 and 2 <= taken < len(variants) // 4


def test_fast_parse_of_a_chunked_tensor_accepts_exactly_what_the_checked_parse_accepts():
    doc = good_doc()
    files = parse_doc(doc).files
    sharded = doc["tensors"]["model/w"]  # two chunks
    assert len(sharded["chunks"]) == 2
    fields = [("dtype",), ("shape",), ("kind",), ("chunks",)] + [
        ("chunks", i, f) for i in (0, 1) for f in ("file", "key", "offsets", "lengths",
                                                    "byte_range", "checksums")]
    n = taken = 0
    for t in _mutations(sharded, fields):
        taken += _fast_vs_checked(t, files, BLOCK)
        n += 1
    for swap in (True, False):  # chunk order, and one chunk twice (an overlap)
        t = copy.deepcopy(sharded)
        t["chunks"] = t["chunks"][::-1] if swap else [t["chunks"][0]] * 2
        taken += _fast_vs_checked(t, files, BLOCK)
    assert n > 600 and taken > 0


def _sharded_doc() -> dict:
    """make_manifest's document with "model/w"'s two chunks stored under its own key, as
    every sharded save stores them: format version 3 writes them short."""
    base = make_manifest()
    w = base.tensors["model/w"]
    tensors = dict(base.tensors, **{"model/w": w._replace(
        chunks=tuple(c._replace(key="model/w") for c in w.chunks))})
    return json.loads(make_manifest(tensors=tensors).to_json())


def _columns_and_checked(t: dict, files: dict, dims: tuple[int, ...]) -> tuple[Any, Any]:
    """The checked parse of a tensor entry of short chunks (its entry, or None when it
    refuses) and the column parse of its chunks (which must decline, never raise)."""
    from asyncckpt.manifest import _Check, _parse_tensor_checked, _short_chunks_at_once

    try:
        slow = _parse_tensor_checked(_Check(PATH), "k", t, files, BLOCK, False,
                                     FORMAT_VERSION)
    except CheckpointCorruptError:
        slow = None
    try:
        fast = _short_chunks_at_once("k", t["chunks"], files, dims, 4, BLOCK, False)
    except Exception as exc:
        raise AssertionError(f"column parse raised {exc!r} on {t!r:.300}") from exc
    return slow, fast


def test_fast_parse_of_short_chunks_accepts_exactly_what_the_checked_parse_accepts():
    """Short chunks (format version 3): the column-by-column parse of all of a tensor's
    chunks, the chunk-by-chunk one and the checked one agree on every variant: each item
    of either chunk set to each odd value or removed, one item more, a chunk of each
    form, chunks swapped, one chunk twice, one missing."""
    doc = _sharded_doc()
    files = parse_doc(doc).files
    sharded = doc["tensors"]["model/w"]
    assert [type(c) for c in sharded["chunks"]] == [list, list]
    long = long_entries(copy.deepcopy(doc))["tensors"]["model/w"]["chunks"]
    variants = [*_mutations(sharded, [("chunks", i, f) for i in (0, 1) for f in range(5)])]
    variants += [dict(sharded, chunks=[[*sharded["chunks"][0], 0], sharded["chunks"][1]]),
                 dict(sharded, chunks=[long[0], sharded["chunks"][1]]),
                 dict(sharded, chunks=sharded["chunks"][::-1]),
                 dict(sharded, chunks=[sharded["chunks"][0]] * 2),
                 dict(sharded, chunks=sharded["chunks"][:1])]
    taken = at_once = 0
    for t in [sharded, *variants]:
        for v in (2, FORMAT_VERSION):
            took = _fast_vs_checked(t, files, BLOCK, version=v)
            if v == 2:  # a version 2 manifest has no short chunks
                assert not took or not any(isinstance(c, list) for c in t["chunks"]), t
            taken += took
        slow, fast = _columns_and_checked(t, files, (4, 3))
        if fast is not None:
            assert slow is not None and fast == slow.chunks, t
            at_once += 1
    assert len(variants) > 300 and taken >= 3 and at_once >= 3


def test_short_chunks_are_what_a_sharded_manifest_holds_and_read_back_the_same():
    doc = _sharded_doc()
    m = parse_doc(doc)
    assert m == parse_doc(long_entries(copy.deepcopy(doc)))  # the long chunks they stand for
    assert [c.key for c in m.tensors["model/w"].chunks] == ["model/w"] * 2
    # the strings a load of many chunks holds are the manifest's own, once each
    assert all(c.file is next(iter(m.files)) for t in m.tensors.values() for c in t.chunks)
    assert all(c.key is k for k, t in m.tensors.items() for c in t.chunks if c.key == k)
    assert m.tensors["model/w"].chunks[0].key is next(k for k in m.tensors if k == "model/w")
    doc["format_version"] = 2  # before version 3, a chunk is an object
    with pytest.raises(CheckpointCorruptError, match=r"'model/w'.*chunk must be an object"):
        parse_doc(doc)
    doc["format_version"] = 3
    doc["tensors"]["model/w"]["chunks"][1] = doc["tensors"]["model/w"]["chunks"][1][:3]
    with pytest.raises(CheckpointCorruptError, match=r"'model/w'.*a short chunk must be \[file, "
                       r"offsets, lengths, start, checksums\], got a list of 3"):
        parse_doc(doc)


@pytest.mark.parametrize("where", ["short chunk", "short entry", "file size", "lengths"])
def test_numbers_too_long_to_print_are_corruption_not_a_crash(where: str) -> None:
    """json reads integers of up to 4,300 digits, and Python cannot print a longer one:
    a start, size or length past any real file's is refused before a sum of it could
    reach an error message (a ValueError there broke load(fallback=True))."""
    doc = _sharded_doc()
    huge = 10 ** 4300 - 1
    if where == "short chunk":
        doc["tensors"]["model/w"]["chunks"][1][3] = huge
    elif where == "short entry":
        doc["tensors"]["big"][4] = huge
    elif where == "file size":
        doc["files"][FILE]["bytes"] = huge
    else:
        doc["tensors"]["model/w"]["chunks"][1][2] = [huge, 3]
    with pytest.raises(CheckpointCorruptError, match=r"impossibly large|outside"):
        parse_doc(doc)


def _parse_whole(t: dict, files: dict):
    from asyncckpt.manifest import _parse_whole_tensor

    return _parse_whole_tensor("k", t, files, BLOCK)


# --- docs/format.md: its reader, written from the format alone, reads what is saved --------

def test_the_reader_in_the_format_doc_reads_short_and_long_entries(tmp_path, monkeypatch):
    import re

    from asyncckpt.reader import read_manifest
    from asyncckpt.storage import LocalStorage

    doc = (Path(__file__).resolve().parent.parent / "docs" / "format.md").read_text()
    ns: dict[str, Any] = {}
    exec(re.search(r"```python\n(.*?)```", doc, re.S).group(1), ns)
    read_whole = ns["read_whole"]
    w, e = torch.randn(300, 70), torch.empty(0, 3)
    with asyncckpt.AsyncCheckpointer(tmp_path, block_bytes=ALIGN) as ckpt:
        ckpt.save({"model": {"w": w, "e": e}}, step=1)  # w: 21 checksum blocks
    step_dir = tmp_path / "step_000000001"
    raw = json.loads((step_dir / "manifest.json").read_bytes())
    assert isinstance(raw["tensors"]["model/w"], list)  # short
    assert torch.equal(torch.from_numpy(read_whole(step_dir, "model/w")), w)
    assert read_whole(step_dir, "model/e").shape == (0, 3)
    m = read_manifest(step_dir, LocalStorage())
    (step_dir / "manifest.json").write_bytes(dataclasses.replace(m, format_version=1).to_json())
    assert torch.equal(torch.from_numpy(read_whole(step_dir, "model/w")), w)  # long
    with open(step_dir / "rank_00000.safetensors", "r+b") as f:  # a damaged byte is seen
        f.seek(m.tensors["model/w"].chunks[0].byte_range[0] + 5000)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(AssertionError, match="checksum mismatch"):
        read_whole(step_dir, "model/w")

    # a sharded checkpoint (two ranks as threads): its chunks are short
    from _ranks import all_ok, in_threads

    big = torch.randn(301, 70)
    store = torch.distributed.HashStore()
    root = tmp_path / "sharded"
    ckpts = [asyncckpt.AsyncCheckpointer(root, mode="sync", rank=r, world_size=2, store=store,
                                         block_bytes=ALIGN, timeout_s=60) for r in range(2)]

    def rank_main(r: int) -> None:
        part = big.tensor_split(2)[r].clone()
        ckpts[r].save({"w": part}, step=1, shards={"w": asyncckpt.ShardMetadata(
            tuple(big.shape), (151 * r, 0))})
        ckpts[r].close()

    all_ok(in_threads(rank_main, 2))
    step_dir = root / "step_000000001"
    chunks = json.loads((step_dir / "manifest.json").read_bytes())["tensors"]["w"]["chunks"]
    assert [c[0] for c in chunks] == ["rank_00000.safetensors", "rank_00001.safetensors"]
    assert torch.equal(torch.from_numpy(read_whole(step_dir, "w")), big)

    # ... and the same chunks as a table (what a job of 16 ranks or more writes)
    m = read_manifest(step_dir, LocalStorage())
    import asyncckpt.manifest as manifest_module

    monkeypatch.setattr(manifest_module, "TABLE_MIN_CHUNKS", 2)
    (step_dir / "manifest.json").write_bytes(m.to_json())
    entry = json.loads((step_dir / "manifest.json").read_bytes())["tensors"]["w"]
    assert set(entry) == {"dtype", "shape", "kind", "table"}
    assert len(entry["table"]["checksums"]) == 2 * 11  # (each chunk: 11 blocks)
    assert torch.equal(torch.from_numpy(read_whole(step_dir, "w")), big)
    assert read_manifest(step_dir, LocalStorage()) == m


def test_a_deep_manifest_read_from_a_deep_call_stack_is_not_called_corrupt(
        tmp_path: Path) -> None:
    import asyncckpt
    from asyncckpt.errors import CheckpointCorruptError, CheckpointError
    from asyncckpt.manifest import parse_manifest, parse_manifest_summary, seal

    deep: object = torch.ones(2)
    for _ in range(189):  # the deepest tree a save takes
        deep = {"d": deep}
    asyncckpt.save(deep, tmp_path, step=1)
    raw = (tmp_path / "step_000000001" / "manifest.json").read_bytes()
    assert parse_manifest(raw, "m").step == 1

    def at_depth(k: int, parse: Any) -> Any:
        if k:
            return at_depth(k - 1, parse)
        try:
            return parse(raw, "m")
        except CheckpointError as exc:
            return exc

    # Python's limit hit by the caller's frames: an intact checkpoint (a fallback load
    # skipped it as corrupt, for an older step), said so. The caller leaves the parse 60
    # frames: json's parser needs more (3.11), or, where json counts C recursion apart
    # (3.12+), the checks of the skeleton after it (which raised a raw RecursionError).
    exc = at_depth(sys.getrecursionlimit() - len(inspect.stack()) - 60, parse_manifest)
    assert type(exc) is CheckpointError and "the checkpoint is intact" in str(exc)
    # the summary checks no skeleton: on 3.12+ it has nothing too deep to parse
    got = at_depth(sys.getrecursionlimit() - len(inspect.stack()) - 60, parse_manifest_summary)
    if isinstance(got, BaseException):
        assert type(got) is CheckpointError and "the checkpoint is intact" in str(got)
    else:
        assert got.step == 1 and got.tensors == 1
    # nesting no stack could parse (the library never writes it) is damage
    forged = seal(b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    with pytest.raises(CheckpointCorruptError, match="not valid JSON"):
        parse_manifest(forged, "m")


# --- many chunks of a tensor: held as columns (ChunkTable) ---------------------------------------

def _many_chunks_manifest(rows: int = 40, parts: int = 20, files: int = 4,
                          version: int = FORMAT_VERSION) -> Manifest:
    """A 2-D tensor ``(rows, 3)`` sharded in ``parts`` slabs of uneven heights (one
    empty), spread over ``files`` files, chunks under the tensor's own key (as every
    sharded save writes them), beside a whole tensor in the first file."""
    assert parts >= TABLE_MIN_CHUNKS
    cuts = [*sorted({0, rows, *range(1, rows, max(1, rows // parts))})[:parts], rows]
    cuts[-2] = cuts[-1]  # (the last slab empty: it may lie anywhere in its file)
    names = [f"rank_{i:05d}.safetensors" for i in range(files)]
    pos = dict.fromkeys(names, 4096)
    chunks = []
    for i, (a, b) in enumerate(itertools.pairwise(cuts)):
        name = names[i % files]
        chunks.append(_chunk("w", torch.float32, (rows, 3), pos[name], (a, 0), (b - a, 3),
                             file=name))
        pos[name] = chunks[-1].byte_range[1]
    whole = _chunk("b", torch.int8, (7,), pos[names[0]], file=names[0])
    pos[names[0]] = whole.byte_range[1]
    tensors = {"w": TensorEntry(torch.float32, (rows, 3), "torch", tuple(chunks)),
               "b": TensorEntry(torch.int8, (7,), "torch", (whole,))}
    skeleton = {"t": "dict", "items": [["w", {"t": "tensor", "key": "w"}],
                                       ["b", {"t": "tensor", "key": "b"}]]}
    return make_manifest(files={n: FileEntry(n, pos[n] + 10, i, 8, "0" * 16)
                                for i, n in enumerate(names)},
                         tensors=tensors, skeleton=skeleton, world_size=files,
                         format_version=version)


def test_a_tensor_of_many_chunks_is_held_as_columns_and_reads_back_the_same():
    from asyncckpt.manifest import ChunkTable

    made = _many_chunks_manifest()
    doc = json.loads(made.to_json())
    assert set(doc["tensors"]["w"]) == {"dtype", "shape", "kind", "table"}  # (version 4)
    assert isinstance(doc["tensors"]["b"], list)
    m = parse_manifest(made.to_json(), PATH)
    table = m.tensors["w"].chunks
    assert type(table) is ChunkTable and type(m.tensors["b"].chunks) is tuple
    want = made.tensors["w"].chunks
    assert m == made and m.tensors == made.tensors and table == want and want == table
    assert list(table) == list(want) and len(table) == len(want) == 20
    assert table[3] == want[3] and table[-1] == want[-1] and table[2:5] == want[2:5]
    assert all(type(v) is int for c in table for v in (*c.offsets, *c.lengths, *c.byte_range))
    assert hash(table) == hash(want) and "20 chunks" in repr(table)
    with pytest.raises(IndexError):
        table[20]
    # re-encoded from the columns: the same bytes
    assert parse_manifest(m.to_json(), PATH).to_json() == made.to_json()


def test_the_chunks_a_box_meets_are_planned_as_from_chunk_objects():
    """plan_reads over the columns (the chunks a box meets, picked in numpy) plans the
    same reads as over Chunk objects, for boxes anywhere in the tensor."""
    import random

    from asyncckpt.plan import plan_reads

    m = parse_manifest(_many_chunks_manifest(rows=40).to_json(), PATH)
    objects = dataclasses.replace(m, tensors={
        k: t._replace(chunks=tuple(t.chunks)) for k, t in m.tensors.items()})
    rng = random.Random(7)
    boxes = [None, ((0, 0), (40, 3)), ((39, 2), (1, 1)), ((5, 0), (0, 3)), ((40, 3), (0, 0))]
    for _ in range(300):
        lo = (rng.randrange(41), rng.randrange(4))
        boxes.append((lo, (rng.randrange(41 - lo[0]), rng.randrange(4 - lo[1]))))
    for box in boxes:
        got = plan_reads(m, {"w": box, "b": None})
        assert got == plan_reads(objects, {"w": box, "b": None}), box
        if box is not None and all(box[1]):  # every element once
            assert sum(math.prod(it.box[1]) for it in got if it.key == "w") == math.prod(box[1])


def _rows(entry: dict) -> list[list[int]]:
    """A table's rows: [file, start, offsets..., lengths...] each."""
    flat = entry["table"]["rows"]
    width = 2 + 2 * len(entry["shape"])
    return [flat[i:i + width] for i in range(0, len(flat), width)]


def _set_rows(entry: dict, rows: list[list[int]]) -> None:
    entry["table"]["rows"] = [v for r in rows for v in r]


@pytest.mark.parametrize("version", [3, 4])
@pytest.mark.parametrize("forge", ["overlap", "header", "other tensor"])
def test_forged_byte_ranges_of_chunks_held_as_columns_are_corruption(forge: str, version: int):
    doc = json.loads(_many_chunks_manifest(version=version).to_json())
    w = doc["tensors"]["w"]
    starts = [c[3] for c in w["chunks"]] if version == 3 else [r[1] for r in _rows(w)]
    if forge == "overlap":  # chunk 4 (in file 0, as chunk 0) starts inside chunk 0
        at, value, match = 4, starts[0] + 4, r"'w'.*overlaps the bytes of tensor 'w'"
    elif forge == "header":
        at, value, match = 1, 0, r"'w'.*starts inside its header"
    else:  # the whole tensor's bytes, which lie after every chunk of its file
        at, value, match = None, starts[8], r"overlaps the bytes of tensor"
        doc["tensors"]["b"][4] = value
    if at is not None and version == 3:
        w["chunks"][at][3] = value
    elif at is not None:
        rows = _rows(w)
        rows[at][1] = value
        _set_rows(w, rows)
    with pytest.raises(CheckpointCorruptError, match=match):
        parse_doc(doc)


def test_the_column_parse_of_many_chunks_accepts_exactly_what_the_checked_parse_accepts():
    from asyncckpt.manifest import ChunkTable

    doc = json.loads(_many_chunks_manifest(version=3).to_json())
    files = parse_doc(doc).files
    w = doc["tensors"]["w"]
    variants = [*_mutations(w, [("chunks", i, f) for i in (0, 7, 19) for f in range(5)])]
    variants += [dict(w, chunks=w["chunks"][::-1]), dict(w, chunks=w["chunks"][:-2]),
                 dict(w, chunks=[*w["chunks"][:-1], w["chunks"][0]])]
    tables = 0
    for t in [w, *variants]:
        slow, fast = _columns_and_checked(t, files, (40, 3))
        if fast is not None:
            assert slow is not None and fast == slow.chunks, t
            tables += type(fast) is ChunkTable
    assert len(variants) > 200 and tables >= 3


def _table_variants(w: dict) -> Iterator[dict]:
    """A table entry with one thing changed: each field of it, each value of rows 0, 7
    and 19 (set to odd numbers: a rank among them), the rows, and the checksums."""
    yield from _mutations(w, [("dtype",), ("shape",), ("kind",), ("table",),
                              ("table", "rows"), ("table", "checksums"),
                              ("table", "checksums", 3)])
    yield {**w, "extra": 1}
    yield {**w, "chunks": []}
    yield {**w, "table": {**w["table"], "extra": 1}}
    rows = _rows(w)
    for i in (0, 7, 19):
        for j in range(len(rows[i])):
            for value in (-1, 1, 2, 3, 4, 39, 40, 41, 4095, 10**6, 2**62, 2**63 - 1, 2**63,
                          2**64, 10**4000, True, 1.0, "1", None):
                t = copy.deepcopy(w)
                changed = copy.deepcopy(rows)
                changed[i][j] = value
                _set_rows(t, changed)
                yield t
    for changed in (rows[::-1], rows[:-1], rows[:-2], [*rows[:-1], rows[0]], rows[:1], []):
        t = copy.deepcopy(w)
        _set_rows(t, changed)
        yield t
    flat = w["table"]["rows"]
    for bad in (flat[:-1], [*flat, 0], {"0": flat}, "0,1"):
        yield {**w, "table": {**w["table"], "rows": bad}}
    sums = w["table"]["checksums"]
    for bad in (sums[:-1], [*sums, sums[0]], [*sums[:3], "0" * 15, *sums[4:]],
                [*sums[:3], "G" * 16, *sums[4:]], [*sums[:3], 7, *sums[4:]]):
        yield {**w, "table": {**w["table"], "checksums": bad}}


def test_the_table_parse_accepts_exactly_what_the_checked_parse_accepts():
    """Format version 4's table of chunks: the parse in numpy and the one that names the
    problem agree on every variant (the same entry, or both refuse), and the numpy one
    never raises."""
    from asyncckpt.manifest import ChunkTable, _Check, _parse_table, _parse_table_checked

    doc = json.loads(_many_chunks_manifest().to_json())
    files = parse_doc(doc).files
    by_rank = {f.rank: n for n, f in files.items()}
    w = doc["tensors"]["w"]
    n = taken = 0
    for t in [w, *_table_variants(w)]:
        n += 1
        try:
            slow = _parse_table_checked(_Check(PATH), "w", t, files, by_rank, BLOCK, False,
                                        FORMAT_VERSION)
        except CheckpointCorruptError:
            slow = None
        try:
            fast = _parse_table("w", t, files, by_rank, BLOCK, False)
        except Exception as exc:  # it must decline, never raise
            raise AssertionError(f"table parse raised {exc!r} on {t!r:.300}") from exc
        assert (fast is None) == (slow is None), t
        if fast is not None:
            assert type(fast.chunks) is ChunkTable and fast == slow, t
            taken += 1
    assert n > 500 and 3 <= taken < n // 4


def test_a_table_is_version_4s_and_stands_alone_in_its_entry():
    doc = json.loads(_many_chunks_manifest().to_json())
    doc["format_version"] = 3
    with pytest.raises(CheckpointCorruptError, match=r"'w'.*a table of chunks is format "
                       r"version 4's; this manifest says 3"):
        parse_doc(doc)
    doc["format_version"] = 4
    doc["tensors"]["w"]["chunks"] = []
    with pytest.raises(CheckpointCorruptError, match=r"'w'.*both chunks and a table"):
        parse_doc(doc)
    del doc["tensors"]["w"]["chunks"]
    doc["tensors"]["w"]["table"]["rows"][-1] = -1
    with pytest.raises(CheckpointCorruptError, match=r"'w'.*table rows must be a list of "
                       r"integers >= 0"):
        parse_doc(doc)
    doc["tensors"]["w"]["table"]["rows"].pop()
    with pytest.raises(CheckpointCorruptError, match=r"'w'.*table rows hold 119 integers, "
                       r"not one or more rows of 6 \(file, start, 2 offsets, 2 lengths\)"):
        parse_doc(doc)
    doc["tensors"]["w"]["table"]["rows"].append(3)
    doc["tensors"]["w"]["table"]["rows"][6] = 9  # (row 1's rank)
    with pytest.raises(CheckpointCorruptError, match=r"'w'.*table row 1 names rank 9, which "
                       r"wrote no file of this manifest"):
        parse_doc(doc)
    doc["tensors"]["w"]["table"]["rows"][6] = 1
    doc["files"]["rank_00002.safetensors"]["rank"] = 1  # two files of rank 1
    with pytest.raises(CheckpointCorruptError, match=r"'w'.*names rank 1, which wrote no "
                       r"file of this manifest \(or several\)"):
        parse_doc(doc)


@pytest.mark.parametrize("version", [1, 2, 3, 4])
def test_many_chunks_are_written_as_json_dumps_would_in_every_version(version: int):
    m = _many_chunks_manifest(version=version)
    assert m.to_json() == _reference_json(m)
    back = parse_manifest(m.to_json(), PATH)
    assert back == m and back.format_version == version
    fewer = _many_chunks_manifest(parts=TABLE_MIN_CHUNKS, version=version)
    assert fewer.to_json() == _reference_json(fewer)  # (the least a table holds)
    one_less = dataclasses.replace(fewer, tensors={**fewer.tensors, "w": fewer.tensors["w"]
                                                   ._replace(chunks=fewer.tensors["w"].chunks[1:])})
    assert "table" not in json.loads(one_less.to_json(), strict=False)["tensors"]["w"]


def test_a_table_of_blocks_past_any_chunk_is_one_checksum_a_chunk():
    """block_bytes is bounded below only: a block larger than numpy's integers is still
    one block a chunk (it overflowed the table parse)."""
    big = _many_chunks_manifest(version=3)
    huge = 1 << 63
    tensors = {k: t._replace(chunks=tuple(c._replace(checksums=c.checksums[:1])
                                          for c in t.chunks)) for k, t in big.tensors.items()}
    m = dataclasses.replace(big, block_bytes=huge, tensors=tensors)
    v4 = parse_manifest(dataclasses.replace(m, format_version=4).to_json(), PATH)
    assert "table" in json.loads(dataclasses.replace(m, format_version=4).to_json())[
        "tensors"]["w"]
    assert v4.tensors == parse_manifest(m.to_json(), PATH).tensors == m.tensors


def test_a_table_is_written_only_for_chunks_under_its_own_key_and_ranks_it_can_name():
    """A ChunkTable moved under another key keeps its chunks' key (written as chunks that
    name it), and files whose ranks a table cannot name (several files of one rank, or a
    rank past 2**63) are written as short chunks: what is written reads back the same."""
    m = parse_manifest(_many_chunks_manifest().to_json(), PATH)
    moved = dataclasses.replace(m, tensors={"v": m.tensors["w"], "b": m.tensors["b"]},
                                skeleton={"t": "dict", "items": [
                                    ["v", {"t": "tensor", "key": "v"}],
                                    ["b", {"t": "tensor", "key": "b"}]]})
    doc = json.loads(moved.to_json())
    assert "chunks" in doc["tensors"]["v"]
    back = parse_manifest(moved.to_json(), PATH)
    assert {c.key for c in back.tensors["v"].chunks} == {"w"} and back == moved
    for ranks in ([1 << 64, 1, 2, 3], [0, 0, 1, 2]):
        files = {n: dataclasses.replace(f, rank=r) for (n, f), r in zip(m.files.items(), ranks,
                                                                        strict=True)}
        odd = dataclasses.replace(m, files=files)
        entry = json.loads(odd.to_json())["tensors"]["w"]
        assert "chunks" in entry and "table" not in entry
        assert parse_manifest(odd.to_json(), PATH) == odd


def _with_float(node: dict[str, Any]) -> dict[str, Any]:
    doc = good_doc()
    doc["skeleton"]["items"][4][1]["items"][3] = node
    return doc


@pytest.mark.parametrize("bits", ["fff8000000000000", "7FF8DEAD0000BEEF", "7ff0000000000001"])
def test_a_nan_float_node_with_bits_parses(bits: str) -> None:
    node = {"t": "float", "v": "nan", "bits": bits}
    assert parse_doc(_with_float(node)).skeleton["items"][4][1]["items"][3] == node


@pytest.mark.parametrize("node, told", [
    ({"t": "float", "v": "nan", "bits": "3ff0000000000000"}, "pattern of 1.0, not of a NaN"),
    ({"t": "float", "v": "nan", "bits": "7ff0000000000000"}, "pattern of inf, not of a NaN"),
    ({"t": "float", "v": "nan", "bits": "fff800000000000"}, "is not 16 hex digits"),
    ({"t": "float", "v": "nan", "bits": "fff80000000000000"}, "is not 16 hex digits"),
    ({"t": "float", "v": "nan", "bits": "fff800000000000g"}, "is not 16 hex digits"),
    ({"t": "float", "v": "nan", "bits": "fff8 00000000000"}, "is not 16 hex digits"),
    ({"t": "float", "v": "nan", "bits": 1234567890123456}, "not a string"),
    ({"t": "float", "v": "nan", "bits": None}, "not a string"),
    ({"t": "float", "v": "1.5", "bits": "fff8000000000000"}, "only a NaN's node has"),
])
def test_a_float_node_with_bad_bits_is_corrupt(node: dict[str, Any], told: str) -> None:
    with pytest.raises(CheckpointCorruptError, match="malformed manifest") as info:
        parse_doc(_with_float(node))
    assert told in str(info.value)


def test_a_key_twice_in_a_manifest_is_refused(tmp_path: Path) -> None:
    """(security review) A second "tensors" object won over the first, and a skeleton dict
    naming a key twice loaded the last (inspect listed both): readers that keep the first,
    or refuse, read another checkpoint. Both are refused as damaged or forged."""
    import re

    import asyncckpt
    from asyncckpt.errors import CheckpointCorruptError
    from asyncckpt.manifest import seal

    asyncckpt.save({"w": torch.ones(4, 8), "train": {"lr": 0.1}}, tmp_path, step=1)
    path = tmp_path / "step_000000001" / "manifest.json"
    raw = path.read_bytes()
    body = raw[:re.search(rb',"digest"', raw).start()] + b"}"  # type: ignore[union-attr]
    doc = json.loads(body)
    # a second "user_metadata" object, as text (json.dumps cannot write a key twice)
    twice = body[:-1] + b',"user_metadata":{"x":"y"}}'
    path.write_bytes(seal(twice))
    with pytest.raises(CheckpointCorruptError, match="the key 'user_metadata' appears twice"):
        asyncckpt.load(tmp_path)
    # a skeleton dict with "lr" twice
    train = next(v for k, v in doc["skeleton"]["items"] if k == "train")
    train["items"].append(["lr", {"t": "float", "v": "1e9"}])
    path.write_bytes(seal(json.dumps(doc, separators=(",", ":")).encode()))
    with pytest.raises(CheckpointCorruptError, match="names the key 'lr' twice"):
        asyncckpt.load(tmp_path)


def test_a_dtype_that_is_no_string_is_told_once() -> None:
    """(security review) "...manifest.json: malformed manifest (tensor 'w'): ...manifest.json:
    malformed manifest (tensor 'w'): dtype must be a string"."""
    from asyncckpt.errors import CheckpointCorruptError
    from asyncckpt.manifest import _Check, _checked_dtype

    with pytest.raises(CheckpointCorruptError) as info:
        _checked_dtype(_Check("m.json"), "w", 7)
    assert str(info.value) == "m.json: malformed manifest (tensor 'w'): dtype must be a string"
