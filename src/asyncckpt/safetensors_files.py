"""Loading plain safetensors files: a Hugging Face model's weights, an export, any tool's.

A safetensors file (or a directory of them, with or without a
``*.safetensors.index.json``) is read as a checkpoint of one step: each of its tensors
is one whole chunk, named by its key, and the state tree is its keys split at ``/``
(so that an ``asyncckpt export`` comes back as the tree it was exported from, while a
Hugging Face key such as ``model.layers.0.mlp.up_proj.weight`` stays one key). The
description is built here from the files' headers, validated as strictly as a
manifest, and the load itself is asyncckpt's: in place into the target's tensors, a
DTensor or hand-sharded target reading only its box, several reader threads, fresh
tensors on huge pages, the same key checks and errors. Nothing is unpickled.

These files carry no checksums, so nothing can be verified beyond their structure.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import struct
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
import xxhash

from .errors import (
    CheckpointConfigError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    check_flags,
)
from .loader import (
    KeyMap,
    ShardMetadata,
    check_exclude,
    check_key_map,
    check_progress,
    check_threads,
    excluded_view,
    load_from,
    mapped_name,
    without_excluded,
)
from .manifest import (
    _ST_DTYPES,
    DEFAULT_BLOCK_BYTES,
    MANIFEST_NAME,
    MAX_HEADER_BYTES,
    Chunk,
    FileEntry,
    Manifest,
    RepeatedKey,
    TensorEntry,
    no_repeats,
)
from .storage import LocalStorage, open_regular
from .tree import ARRAY_NODES, dtype_name, escape_key, flatten

log = logging.getLogger(__name__)

__all__ = ["load_safetensors"]

# torch dtype -> its safetensors name, as export writes it: asyncckpt's own, and those
# newer safetensors writes for dtypes this torch has
_NAMES: dict[torch.dtype, str] = dict(_ST_DTYPES)
for _name, _attr in (("F8_E8M0", "float8_e8m0fnu"), ("F4", "float4_e2m1fn_x2")):
    if hasattr(torch, _attr):
        _NAMES[getattr(torch, _attr)] = _name
# safetensors dtype name -> torch dtype: the inverse, and C128, which other writers use
# (safetensors' own readers do not know it, so it is read, not written)
_DTYPES: dict[str, torch.dtype] = {v: k for k, v in _NAMES.items()} | {"C128": torch.complex128}

# The bits of one value of each dtype safetensors (0.8) names, and C128, which other
# writers use. A name outside it is no safetensors file's; one inside it that _DTYPES
# lacks is a valid file's tensor this torch has no dtype for (F6_E2M3...), which a
# key_map may leave out.
_BITS: dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
    "C128": 128, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}

# Packed dtypes: the header's shape counts the safetensors values, while torch's dtype
# holds this many of them in one element along the last dim (F4: float4_e2m1fn_x2, two
# 4-bit values a byte). safetensors.torch converts the shapes so; here too, both ways.
_PACKED: dict[str, int] = {"F4": 2}


def st_dtype(dtype: torch.dtype) -> str | None:
    """The safetensors name of ``dtype`` for a file others read (None: it has none)."""
    return _NAMES.get(dtype)


def st_shape(dtype: torch.dtype, shape: tuple[int, ...]) -> list[int] | None:
    """The header shape of a tensor of ``dtype`` and (torch) ``shape``, as safetensors
    writes it; None where its format cannot say it (a 0-d float4_e2m1fn_x2 is two F4
    values, which no header shape counts)."""
    per = _PACKED.get(st_dtype(dtype) or "", 1)
    if per == 1:
        return list(shape)
    if not shape:
        return None
    return [*shape[:-1], shape[-1] * per]

_INDEX_SUFFIX = ".safetensors.index.json"
_MAX_INDEX_BYTES = 256 * 1024 * 1024


def load_safetensors(source: str | os.PathLike[str], state: Any = None, *,
                     key_map: KeyMap | None = None, strict: bool = True,
                     ignore_unexpected: bool = False,
                     shards: Mapping[str, ShardMetadata] | None = None,
                     threads: int | None = None,
                     progress: Callable[[int, int], None] | None = None,
                     exclude: str | Iterable[str] | None = None, cast: bool = True) -> Any:
    """Load plain safetensors files (not written by asyncckpt) into ``state``.

    ``source`` is one ``.safetensors`` file, or a directory holding a Hugging Face
    ``*.safetensors.index.json`` (its files are read) or, without one, ``.safetensors``
    files (all of them are read; a key in two files is an error). Tensor names are
    paths: ``a/b`` is key ``b`` of dict ``a``, as ``asyncckpt inspect`` lists them and
    ``asyncckpt export`` writes them; a name without ``/`` is one key.

    ``key_map`` renames the files' tensors before anything is matched: a mapping of
    names (names it lacks keep theirs) or a function of the name returning the new
    name, or None to leave that tensor out. E.g. a Hugging Face model into
    ``{"model": model}``: ``key_map=lambda k: "model/" + k.removeprefix("model.")``.

    With ``state`` the tensors are loaded in place, as :meth:`AsyncCheckpointer.load`
    does (``strict``, ``ignore_unexpected``, ``shards`` and ``exclude`` as there:
    a DTensor reads just its box of each file). Without it, a dict of fresh CPU tensors
    is returned. ``threads``, ``progress``: as for ``asyncckpt.load``. ``cast=True``: a
    target tensor of another floating dtype (fp32 master weights, bf16 files) or integer
    dtype gets the values cast, as ``load_state_dict`` does (through a temporary of at
    most 64 MiB at a time); ``cast=False`` makes any dtype difference an error.

    A target tensor at several paths (tied embeddings) needs to be in the files at one of
    them only, as Hugging Face saves it.

    Safetensors files hold no checksums: a damaged byte goes unseen here, as with any
    safetensors reader; what is checked is each header's structure, each tensor's
    dtype, shape and byte range against its file's size. ``F4`` (packed float4) loads
    as ``torch.float4_e2m1fn_x2``, its last dim half the header's, as
    ``safetensors.torch`` loads it.

    Raises:
        CheckpointNotFoundError: no such file, or a directory without safetensors files.
        CheckpointCorruptError: a header, index or byte range that is not valid; names
            the file and tensor.
        CheckpointConfigError: a bad ``key_map`` (two tensors to one name, a name that
            is both a tensor and a dict), an asyncckpt checkpoint's own files (load
            those with ``asyncckpt.load``), or a tensor of a valid file that this torch
            cannot hold (F6_E2M3; F4 with an odd last dim): the message names the
            ``key_map`` that leaves it out, so that the rest loads.
        StateMismatchError: as for :meth:`AsyncCheckpointer.load`.
    """
    check_flags(strict=strict, ignore_unexpected=ignore_unexpected, cast=cast)
    check_threads(threads)
    check_key_map(key_map)
    check_progress(progress)
    parts = check_exclude(exclude)
    path = Path(source)
    where, names, index = files_of(path)
    aliases: list[str] = []
    manifest = describe(where, names, key_map, index, aliases)
    state, shards, finish = excluded_view(state, parts, shards)
    digits = any(k.isdigit() or not k for k in _dict_keys(manifest.skeleton))
    if state is not None and (aliases or digits):
        target = flatten(state, target=True, exclude=parts)
        # A name the file stands for but does not hold is the target's to want, not the
        # file's to push on it: a base model without the tied head loads it strictly.
        gone = tuple(a for a in aliases if a not in target.refs)
        if gone:
            manifest = without_excluded(manifest, gone)
        if digits:
            # A name is text: where the target's dict has int keys (an optimizer's
            # state), "0" names key 0 (asyncckpt's export writes it so); where it has a
            # list or tuple, "0", "1"... name its items, and where the target is one
            # tensor, the name "" is it (an export of a list, or of a tensor alone, did
            # not load back into the tree it came from: a trial)
            _typed_like(manifest.skeleton, target.skeleton)
    out = load_from(where, state, LocalStorage(), strict=strict,
                    ignore_unexpected=ignore_unexpected, verify=False, shards=shards,
                    threads=threads, manifest=manifest, progress=progress, exclude=parts,
                    shown=None if where == path else path, cast=cast,
                    rename_hint=_rename_hint if key_map is None else None)
    return finish(out)


def _rename_hint(missing: list[str], unexpected: list[str]) -> tuple[str, str]:
    """The key_map that would match most names, when a prefix is all that differs
    (Hugging Face's ``model.``, a state's ``model/``); and the general advice, for when
    neither this nor the loader's own hints (a wrapper's part, a renamed submodule) find
    one."""
    def splits(name: str) -> Iterable[tuple[str, str]]:  # (prefix, rest) at "." and "/"
        yield "", name
        for i, ch in enumerate(name[:-1]):
            if ch in "./":
                yield name[:i + 1], name[i + 1:]

    # rest -> the one target prefix before it (None: several; "weight" ends them all).
    # Linear in the names' length: a model of 100,000 tensors gets its hint at once.
    wanted: dict[str, str | None] = {}
    for m in missing:
        for pre, rest in splits(m):
            wanted[rest] = pre if rest not in wanted else None
    counts: dict[tuple[str, str], int] = {}  # (the files' prefix, the target's) -> names
    example: dict[tuple[str, str], tuple[str, str]] = {}
    for u in unexpected:
        for pre, rest in splits(u):  # (the longest rest the target has: the one match)
            if rest in wanted:
                theirs = wanted[rest]
                if theirs is not None and theirs != pre:
                    k = (pre, theirs)
                    counts[k] = counts.get(k, 0) + 1
                    example.setdefault(k, (u, theirs + rest))
                break
    general = ("The files' tensors can be renamed with key_map=, e.g. key_map=lambda name: "
               "'model/' + name puts them under 'model'")
    if counts:
        (drop, add), n = max(counts.items(), key=lambda kv: kv[1])
        # (a prefix added to every name only where every name lacks it: a trial's renamed
        # submodule, final_norm. for ln_f., was told 'ln_f.' + name, which renamed all)
        if 2 * n >= len(missing) and (drop or n == len(unexpected)):
            file, target = example[(drop, add)]
            if not add:
                code = f"name.removeprefix({drop!r})"
            elif not drop:
                code = f"{add!r} + name"
            else:
                code = f"{add!r} + name[{len(drop)}:] if name.startswith({drop!r}) else name"
            return (f"The files' names differ from the target's by a prefix (file {file!r}, "
                    f"target {target!r}): pass key_map=lambda name: {code}"), general
    return "", general


def _dict_keys(node: dict[str, Any]) -> Iterable[str]:
    """Every dict key of a skeleton of nested dicts (what :func:`describe` builds)."""
    for k, child in node["items"]:
        yield k
        if child["t"] == "dict":
            yield from _dict_keys(child)


def _typed_like(mine: dict[str, Any], theirs: dict[str, Any]) -> None:
    """Shape ``mine`` (a skeleton of nested dicts with str keys) after the target skeleton
    ``theirs``, in place: its keys made ints where ``theirs`` has that int key at the same
    place and not the string; a dict of the keys "0" to "n-1" made the list or tuple
    ``theirs`` has there; a root dict of the one key "" made the tensor it holds, where
    ``theirs`` is one."""
    while theirs.get("t") == "stateful":
        theirs = theirs["state"]
    items = mine["items"]
    if theirs.get("t") in ARRAY_NODES and [k for k, _ in items] == [""]:
        only = items[0][1]
        mine.clear()
        mine.update(only)
        return
    if theirs.get("t") in ("list", "tuple") and sorted(k for k, _ in items) == sorted(
            str(i) for i in range(len(items))):
        by_index = {int(k): c for k, c in items}
        mine["t"] = theirs["t"]
        mine["items"] = [by_index[i] for i in range(len(items))]
        for child, other in zip(mine["items"], theirs["items"], strict=False):
            if child["t"] == "dict":
                _typed_like(child, other)
        return
    if theirs.get("t") != "dict":
        return
    children = {k: c for k, c in theirs["items"]}
    ints = {str(k): k for k in children if type(k) is int}
    for item in items:
        k = item[0]
        if k not in children and k in ints:
            item[0] = k = ints[k]
        if item[1]["t"] == "dict" and k in children:
            _typed_like(item[1], children[k])


def files_of(source: Path) -> tuple[Path, list[str], dict[str, str] | None]:
    """The directory and the names of the safetensors files ``source`` stands for, and the
    weight map of its index (tensor name -> file name) when it has one."""
    try:
        is_dir = source.is_dir()
        exists = is_dir or source.exists()
    except OSError as exc:
        raise CheckpointNotFoundError(f"{source}: cannot be read: {exc}") from exc
    if not exists:
        raise CheckpointNotFoundError(f"{source} does not exist: pass a .safetensors file or "
                                      "a directory of them")
    if not is_dir:
        return source.parent, [source.name], None
    try:
        listing = sorted(os.listdir(source))
    except OSError as exc:
        raise CheckpointNotFoundError(f"{source}: cannot be listed: {exc}") from exc
    if MANIFEST_NAME in listing or any(n.startswith("step_") for n in listing):
        raise CheckpointConfigError(
            f"{source} is an asyncckpt checkpoint, not a set of plain safetensors files: "
            "load it with asyncckpt.load")
    indexes = [n for n in listing if n.endswith(_INDEX_SUFFIX)]
    if indexes:
        chosen = "model" + _INDEX_SUFFIX
        if chosen not in indexes:
            if len(indexes) > 1:
                raise CheckpointConfigError(
                    f"{source} holds several indexes ({', '.join(indexes)}): pass the files "
                    "of one of them (or a directory holding one index)")
            chosen = indexes[0]
        wmap = _weight_map(source / chosen)
        return source, list(dict.fromkeys(wmap.values())), wmap
    names = [n for n in listing if n.endswith(".safetensors")]
    if not names:
        from .commit import foreign_hint

        raise CheckpointNotFoundError(f"{source} holds no .safetensors file"
                                      f"{foreign_hint(source, listing)}")
    return source, names, None


def _weight_map(index: Path) -> dict[str, str]:
    """A Hugging Face index's ``weight_map`` (tensor name -> file name), checked."""
    try:  # (a FIFO there hung the load, a link to /dev/zero read 256 MiB: a review)
        with open(index, "rb", opener=lambda p, _: open_regular(p)) as f:
            raw = f.read(_MAX_INDEX_BYTES + 1)
    except OSError as exc:
        raise CheckpointNotFoundError(f"{index}: cannot be read: {exc}") from exc
    try:
        doc = json.loads(raw) if len(raw) <= _MAX_INDEX_BYTES else None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointCorruptError(f"{index} is not JSON: {exc}", path=str(index)) from exc
    wmap = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
        raise CheckpointCorruptError(
            f"{index} has no weight_map of tensor names to file names", path=str(index))
    for n in set(wmap.values()):
        if not n or "/" in n or "\\" in n or "\0" in n or n in (".", ".."):
            raise CheckpointCorruptError(
                f"{index} names file {n!r}, which is not a file beside it", path=str(index))
    return wmap


def describe(where: Path, names: list[str], key_map: KeyMap | None = None,
             index: Mapping[str, str] | None = None,
             aliases: list[str] | None = None) -> Manifest:
    """A manifest of one step for the safetensors files ``names`` in ``where``: each tensor
    one whole chunk, without checksums (load it with ``verify=False``). ``index``: the
    weight map the files must agree with (every tensor it names in the file it names)."""
    files: dict[str, FileEntry] = {}
    found: dict[str, tuple[str, str]] = {}  # path -> (file, name in it)
    tensors: dict[str, TensorEntry] = {}
    root: dict[str, Any] = {}  # nested dicts of the paths; leaves are storage keys
    dropped: set[tuple[str, str]] = set()  # (file, name) that key_map left out
    tied: dict[str, str] = {}  # alias -> the name written (asyncckpt export's metadata)
    unloadable: list[tuple[str, str, str]] = []  # (file, name, why) that key_map kept
    for fname in names:
        entry, header = _read_header(where / fname)
        files[fname] = FileEntry(fname, entry[0], 0, entry[1], entry[2])
        tied.update(_tied_names(header.get("__metadata__")))
        ranges: list[tuple[int, int, str]] = []
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype, shape, lo, hi, why = _tensor_info(where / fname, name, info,
                                                     entry[0] - entry[1])
            ranges.append((lo, hi, name))
            path = _mapped(name, key_map)
            if path is None:
                dropped.add((fname, name))
                continue
            if dtype is None:
                unloadable.append((fname, name, why))
                continue
            if path in found:
                was = found[path]
                what = ("is in both files" if was[1] == name
                        else f"and {was[1]!r} ({was[0]}) are both named {path!r}")
                raise (CheckpointCorruptError if was[1] == name else CheckpointConfigError)(
                    f"tensor {name!r} ({fname}) {what}: "
                    + ("a directory holds one model's files only; pass one file"
                       if was[1] == name else "map them to different names"))
            found[path] = (fname, name)
            key = _place(root, path, name)
            tensors[key] = TensorEntry(dtype, shape, "torch", (Chunk(
                fname, name, (0,) * len(shape), shape, (entry[1] + lo, entry[1] + hi), ()),))
        _check_apart(where / fname, ranges)
    if unloadable:
        raise _unloadable(where, unloadable, key_map)
    for alias, name in tied.items():
        # A tensor `asyncckpt export` wrote once for several names (tied embeddings): its
        # other names stand for it too, as the checkpoint it came from had them (a trial's
        # untied LM got a random lm_head from a file that said whose copy it was).
        apath, npath = _mapped(alias, key_map), _mapped(name, key_map)
        if apath is None or npath is None or apath in found or npath not in found:
            continue
        with contextlib.suppress(CheckpointConfigError):  # (a name in the way: not tied)
            _place(root, apath, alias, key="/".join(escape_key(p) for p in npath.split("/")))
            if aliases is not None:  # (its path as a load names paths: keys escaped)
                aliases.append("/".join(escape_key(p) for p in apath.split("/")))
    if isinstance(key_map, Mapping):  # (a typo renames nothing: say so, as load does)
        had = {n for _, n in found.values()} | {n for _, n in dropped} | set(tied)
        unmatched = [k for k in key_map if k not in had]
        if unmatched:
            log.warning("key_map: %s no tensor named %s: %s renamed nothing",
                        f"{where / names[0]} holds" if len(names) == 1
                        else f"the files of {where} hold",
                        ", ".join(repr(k) for k in unmatched[:5])
                        + (f" and {len(unmatched) - 5} more" if len(unmatched) > 5 else ""),
                        "that entry" if len(unmatched) == 1 else "those entries")
    if index is not None:
        held = {(f, n) for f, n in found.values()} | dropped
        lost = sorted(k for k, f in index.items() if (f, k) not in held)
        if lost:
            raise CheckpointCorruptError(
                f"{where}: the index names tensor(s) {', '.join(map(repr, lost[:5]))}"
                f"{f' and {len(lost) - 5} more' if len(lost) > 5 else ''} in files that do "
                "not hold them: a download is incomplete or the index is stale",
                path=str(where), key=lost[0])
    return Manifest(step=0, world_size=1, created_unix=0.0, library_version="",
                    block_bytes=DEFAULT_BLOCK_BYTES, files=files, tensors=tensors,
                    skeleton=_skeleton(root), from_headers=True)


def _unloadable(where: Path, found: list[tuple[str, str, str]],
                key_map: KeyMap | None) -> CheckpointConfigError:
    """The refusal of tensors of valid files that this torch cannot hold, saying how to
    load the rest (a key_map that leaves them out)."""
    fname, name, why = found[0]
    more = (f" (and {len(found) - 1} more: "
            + ", ".join(f"{n!r} ({f})" for f, n, _ in found[1:4])
            + (", ..." if len(found) > 4 else "") + ")") if len(found) > 1 else ""
    names = sorted({n for _, n, _ in found})
    if key_map is not None or len(names) > 3:
        fix = "have key_map return None for " + ("it" if len(found) == 1 else "them")
    elif len(names) == 1:
        fix = f"pass key_map=lambda name: None if name == {names[0]!r} else name"
    else:
        fix = f"pass key_map=lambda name: None if name in {tuple(names)!r} else name"
    return CheckpointConfigError(
        f"{where / fname}: tensor {name!r} cannot be loaded: {why}{more}. The file is "
        f"valid: to load its other tensors, {fix}")


def _read_header(path: Path) -> tuple[tuple[int, int, str], dict[str, Any]]:
    """((file bytes, body offset, xxh3 of the header bytes), header) of a safetensors file."""
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path} does not exist (a broken link, or a file the "
                                      "index names that is missing)") from None
    except CheckpointCorruptError:  # (its words are a checkpoint's: "load another step")
        raise CheckpointCorruptError(f"{path} is not a regular file (a directory, FIFO or "
                                     "device): pass safetensors files",
                                     path=str(path)) from None
    except CheckpointError:
        raise
    except OSError as exc:
        raise CheckpointNotFoundError(f"{path}: cannot be opened: {exc}") from exc
    try:
        size = os.fstat(fd).st_size
        prefix = os.pread(fd, 8, 0)
        if len(prefix) < 8:
            raise CheckpointCorruptError(f"{path} is {size} bytes: too short for a "
                                         "safetensors file", path=str(path))
        (n,) = struct.unpack("<Q", prefix)
        if n > MAX_HEADER_BYTES and _other_format(prefix):  # (a zip's, a pickle's, JSON's
            # first bytes read as a length of petabytes; a safetensors file cut short in
            # its header, whose length may begin as a pickle's, is damaged: not this)
            # another format, which the first bytes name: not damaged (a trial's torch.save
            # file was called corrupt, and inspect exits 1 for that)
            raise CheckpointNotFoundError(
                f"{path} is no safetensors file{_other_format(prefix)}")
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise CheckpointCorruptError(
                f"{path}: its safetensors header claims {n} bytes, more than "
                f"{'the file holds' if 8 + n > size else 'any header may'}: not a "
                "safetensors file, or a damaged one" + _other_format(prefix), path=str(path))
        head = os.pread(fd, 8 + n, 0)
    except CheckpointNotFoundError:  # (an OSError too: not one of reading)
        raise
    except OSError as exc:
        raise CheckpointCorruptError(f"{path}: cannot be read: {exc}", path=str(path)) from exc
    finally:
        os.close(fd)
    if len(head) != 8 + n:
        raise CheckpointCorruptError(f"{path} was cut short while being read", path=str(path))
    try:
        header = json.loads(head[8:], object_pairs_hook=no_repeats)
    except RepeatedKey as exc:
        raise CheckpointCorruptError(f"{path}: its safetensors header names {exc.key!r} twice: "
                                     "a damaged or forged file", path=str(path)) from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointCorruptError(f"{path}: its safetensors header is not JSON: {exc}",
                                     path=str(path)) from exc
    if not isinstance(header, dict):
        raise CheckpointCorruptError(f"{path}: its safetensors header is not an object",
                                     path=str(path))
    meta = header.get("__metadata__")
    if isinstance(meta, dict) and "asyncckpt_format" in meta:
        raise CheckpointConfigError(
            f"{path} is a shard file of an asyncckpt checkpoint, whose tensors may be parts "
            "of larger ones: load its step directory with asyncckpt.load")
    return (size, 8 + n, xxhash.xxh3_64_hexdigest(head)), header


def _check_apart(path: Path, ranges: list[tuple[int, int, str]]) -> None:
    """No two tensors' bytes overlap (safetensors' own reader refuses that too): a forged
    header could otherwise give two tensors the same bytes."""
    end, last = 0, ""
    for lo, hi, name in sorted(r for r in ranges if r[0] < r[1]):
        if lo < end:
            raise CheckpointCorruptError(
                f"{path}: tensors {last!r} and {name!r} claim the same bytes: a damaged or "
                "forged file", path=str(path), key=name)
        end, last = hi, name


class _Info(NamedTuple):
    """A header entry, checked: its torch dtype and shape and its bytes in the body."""

    dtype: torch.dtype | None
    """None: a valid safetensors dtype this torch cannot load (``why`` says so)."""
    shape: tuple[int, ...]
    lo: int
    hi: int
    why: str = ""


def _tensor_info(path: Path, name: str, info: Any, body: int) -> _Info:
    """dtype, shape (torch's) and byte range (in the body) of header entry ``name``,
    checked as safetensors checks them (a header it refuses is corrupt here)."""
    def bad(what: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{path}: tensor {name!r}: {what}", path=str(path),
                                      key=name)

    if not isinstance(info, dict):
        raise bad("its header entry is not an object")
    st = info.get("dtype")
    if not isinstance(st, str) or st not in _BITS:
        raise bad(f"dtype {st!r} is none that safetensors names (known: "
                  f"{', '.join(sorted(_BITS))})")
    shape = info.get("shape")
    if (not isinstance(shape, list) or len(shape) > 64
            or not all(type(d) is int and 0 <= d < 1 << 62 for d in shape)):
        raise bad(f"shape {shape!r} is not a list of sizes")
    if math.prod(d for d in shape if d) >= 1 << 62:  # (a 0 among them: no bytes, yet torch
        # cannot lay it out; a review's [0, 2**61, 2**61] was told "out of memory?")
        raise bad(f"shape {shape} is too large for any tensor (a damaged or forged header)")
    offsets = info.get("data_offsets")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(type(o) is int for o in offsets)):
        raise bad(f"data_offsets {offsets!r} is not [begin, end]")
    lo, hi = offsets
    if not 0 <= lo <= hi <= body:
        raise bad(f"its bytes {lo}..{hi} lie outside the file's {body} bytes of data: the "
                  "file is truncated or damaged")
    nbits = math.prod(shape) * _BITS[st]
    if nbits % 8:  # (F4 and F6: the values of each tensor fill whole bytes)
        n = math.prod(shape)
        raise bad(f"shape {shape} makes it {n} {st} value{'s' if n != 1 else ''} of "
                  f"{_BITS[st]} bits, which end inside a byte: safetensors allows no such "
                  "tensor (a damaged or forged header)")
    if hi - lo != nbits // 8:
        raise bad(f"holds {hi - lo} bytes, but {nbits // 8} are a {st} tensor of shape "
                  f"{shape}")
    dtype = _DTYPES.get(st)
    if dtype is None:
        return _Info(None, tuple(shape), lo, hi, f"torch {torch.__version__} has no dtype "
                     f"for {st} (a newer torch may have one)")
    per = _PACKED.get(st, 1)
    if per == 1:
        return _Info(dtype, tuple(shape), lo, hi)
    if not shape or shape[-1] % per:
        return _Info(None, tuple(shape), lo, hi, (
            f"its shape {shape} counts {st} values, which torch's {dtype_name(dtype)} "
            f"holds {per} to an element along the last dim: a last dim that is not a "
            f"multiple of {per} has no torch shape"))
    return _Info(dtype, (*shape[:-1], shape[-1] // per), lo, hi)


def _mapped(name: str, key_map: KeyMap | None) -> str | None:
    return name if key_map is None else mapped_name(name, key_map)


def _tied_names(meta: Any) -> dict[str, str]:
    """The aliases a file's metadata names (``asyncckpt_tied``: JSON of alias -> name
    written); {} where it names none, or not as asyncckpt writes it."""
    raw = meta.get("asyncckpt_tied") if isinstance(meta, dict) else None
    if not isinstance(raw, str) or len(raw) > 10_000_000:
        return {}
    try:
        got = json.loads(raw)
    except (ValueError, RecursionError):  # (deeply nested: no metadata asyncckpt writes)
        return {}
    if not isinstance(got, dict):
        return {}
    return {a: n for a, n in got.items() if isinstance(a, str) and isinstance(n, str)
            and all(a.split("/")) and all(n.split("/"))}  # (no empty name, nor part)


def _place(root: dict[str, Any], path: str, name: str, key: str | None = None) -> str:
    """Put ``path`` into the nested dicts ``root``; return its storage key (``key``: an
    existing one, for a second name of one tensor)."""
    parts = path.split("/")
    node = root
    for i, part in enumerate(parts[:-1]):
        sub = node.setdefault(part, {})
        if not isinstance(sub, dict):
            raise CheckpointConfigError(
                f"tensor {name!r} is named {path!r}, below {'/'.join(parts[:i + 1])!r}, "
                "which is a tensor itself: map one of them to another name")
        node = sub
    if parts[-1] in node:
        raise CheckpointConfigError(
            f"tensor {name!r} is named {path!r}, which holds other tensors below it: map "
            "one of them to another name")
    key = key if key is not None else "/".join(escape_key(p) for p in parts)
    node[parts[-1]] = key
    return key


def _skeleton(node: dict[str, Any]) -> dict[str, Any]:
    return {"t": "dict", "items": [
        [k, _skeleton(v) if isinstance(v, dict) else {"t": "tensor", "key": v}]
        for k, v in node.items()]}


def _other_format(prefix: bytes) -> str:
    """What a file whose first bytes are ``prefix`` is instead, if it says ("" if not)."""
    if prefix.startswith(b"PK\x03\x04"):
        return (" (a zip archive: a torch.save file? load it with torch.load(path, "
                "weights_only=True))")
    if prefix[:1] == b"\x80" and prefix[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return (" (a pickle: a torch.save file of the legacy format? load it with "
                "torch.load(path, weights_only=True))")
    if prefix.lstrip()[:1] in (b"{", b"["):
        return " (it begins as JSON: an index or a manifest? pass the directory that holds it)"
    return ""
