"""Export a (possibly sharded) checkpoint as one safetensors file of whole tensors (or,
with ``max_shard_bytes``, a directory of them with an index, as Hugging Face publishes).

The output is what Hugging Face and inference tools load: one ``.safetensors`` file,
each selected tensor whole, named by its asyncckpt path (``model/layers.0.weight``,
or ``layers.0.weight`` with the prefix stripped). The export streams: the header is
built from the manifest's dtypes and shapes first, then the tensors are read one at a
time (checksums verified as they are read, whichever rank files hold their chunks)
and appended. The file is written under a temporary name next to the output, fsync'd
and renamed into place, so a crash or a corrupt checkpoint never leaves a half file.

Example:
    >>> report = export_safetensors("runs/exp1", "model.safetensors", prefix="model/",
    ...                             strip_prefix=True, dtype="bf16")
    >>> [t.name for t in report.tensors][:2]
    ['layers.0.weight', 'layers.0.bias']
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import shutil
import stat
import struct
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import commit
from .commit import StepLike
from .errors import (
    CheckpointConfigError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    check_flags,
)
from .loader import check_progress
from .manifest import _ST_DTYPES, MANIFEST_NAME, WRITE_MAX_HEADER_BYTES, Manifest
from .reader import _load_checked, check_files, read_manifest, tensor_bytes
from .safetensors_files import st_dtype, st_shape
from .storage import DirectoryLock, LocalStorage, Storage
from .tree import RESERVED_KEY, dtype_name, iter_array_nodes, unescape_path

__all__ = ["DTYPE_ALIASES", "ExportReport", "ExportedTensor", "SkippedTensor",
           "export_safetensors"]

log = logging.getLogger(__name__)
# What the report carries too (skipped tensors, overflowing casts): the CLI prints those
# from the report and mutes this logger alone, not the module's other warnings.
report_log = logging.getLogger(__name__ + ".report")

DTYPE_ALIASES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "fp64": torch.float64, "float64": torch.float64, "double": torch.float64,
    # the two float8 formats of the Hub's files (safetensors' F8_E4M3 and F8_E5M2)
    "fp8_e4m3": torch.float8_e4m3fn, "fp8_e4m3fn": torch.float8_e4m3fn,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2, "float8_e5m2": torch.float8_e5m2,
}
"""Names accepted for ``dtype``, by the CLI's ``--dtype`` too."""

_CAST_PIECE_ELEMS = 1024 * 1024  # a cast goes through pieces of this many elements
_WRITE_PIECE = 8 * 1024 * 1024
# tensors of at most _BATCH_ONE bytes (not cast) are read and written in runs of at most
# _BATCH_BYTES: one read of a run, not a read plan, an open and a write per tensor (an
# export of 20,000 small tensors took ~55 us a tensor)
_BATCH_ONE = 4 * 1024 * 1024
_BATCH_BYTES = 64 * 1024 * 1024
_HEADER_ALIGN = 8  # the body starts 8-byte aligned, as safetensors' own writer does


@dataclass(frozen=True)
class ExportedTensor:
    """One tensor of the output file: its name there and where it came from."""

    name: str
    """The name in the safetensors file."""
    key: str
    """The asyncckpt path it was read from."""
    dtype: str
    """Its dtype in the output (after ``dtype`` casting)."""
    source_dtype: str
    shape: tuple[int, ...]
    nbytes: int
    chunks: int
    """How many saved chunks (rank file pieces) it was assembled from."""


@dataclass(frozen=True)
class SkippedTensor:
    """A selected tensor that was not written, and why."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    reason: str


@dataclass
class ExportReport:
    """What :func:`export_safetensors` wrote."""

    out_path: Path
    step_dir: Path
    step: int
    tensors: list[ExportedTensor] = field(default_factory=list)
    skipped: list[SkippedTensor] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)
    """Selected paths that share storage with a written tensor (tied weights): alias
    name -> written name. Written once, as safetensors and Hugging Face expect."""
    overflowed: dict[str, int] = field(default_factory=dict)
    """Written name -> how many values the ``dtype`` cast could not hold: finite values
    beyond the smaller dtype's range (e.g. from 65520 for fp16), which became +-inf, NaN
    (formats without inf) or its largest value (casts that saturate: float8_e4m3fn), and
    infinities of a format without them (which became NaN or its largest value)."""
    file_bytes: int = 0
    tensor_bytes: int = 0
    seconds: float = 0.0
    files: list[str] = field(default_factory=list)
    """The files written: the output's name, or (``max_shard_bytes``) those in its directory."""
    weight_map: dict[str, str] = field(default_factory=dict)
    """With ``max_shard_bytes``: each written tensor's file (the index's ``weight_map``)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "out": str(self.out_path), "checkpoint": str(self.step_dir), "step": self.step,
            "files": list(self.files),
            "file_bytes": self.file_bytes, "tensor_bytes": self.tensor_bytes,
            "seconds": round(self.seconds, 6),
            "tensors": [{"name": t.name, "key": t.key, "dtype": t.dtype,
                         "source_dtype": t.source_dtype, "shape": list(t.shape),
                         "bytes": t.nbytes, "chunks": t.chunks} for t in self.tensors],
            "skipped": [{"key": s.key, "dtype": s.dtype, "shape": list(s.shape),
                         "reason": s.reason} for s in self.skipped],
            "aliases": dict(self.aliases),
            "overflowed": dict(self.overflowed),
            "weight_map": dict(self.weight_map),  # ({} for one file)
        }


@dataclass(frozen=True)
class _Planned:
    name: str
    key: str
    src: torch.dtype
    out: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    chunks: int
    full: str = ""  # its path in the state tree, keys as they are
    own_slash: bool = False  # a key on its path holds a '/' of its own


def export_safetensors(ckpt_path: str | os.PathLike[str], out_path: str | os.PathLike[str], *,
                       step: StepLike | None = None, prefix: str = "",
                       strip_prefix: bool = False,
                       dtype: torch.dtype | str | None = None, force: bool = False,
                       storage: Storage | None = None,
                       progress: Callable[[int, int], None] | None = None,
                       max_shard_bytes: int | None = None, tied: str = "once") -> ExportReport:
    """Write the tensors of one checkpoint under ``prefix`` to one safetensors file.

    ``ckpt_path`` is a checkpoint root (latest step, or ``step``) or a step directory.
    Tensors are written whole whatever world size saved them, named by their path in
    the state tree (dict keys joined by ``/``, as they were: no escaping). ``prefix``
    selects whole parts of that name: ``"model"`` takes ``model/...`` and ``model.…``
    but not ``model_ema/...``; a prefix ending in ``/`` or ``.`` is matched as it is.
    ``strip_prefix`` removes it (and the separator after it) from the names.
    ``dtype`` ("bf16", "fp16", "fp32" or a torch floating dtype safetensors holds) casts
    every floating tensor torch can convert; others (integers, bool, complex, packed
    float4) keep their dtype. Tensors whose dtype safetensors cannot express (e.g.
    complex128) are skipped with a warning and listed in ``report.skipped``; those of
    float8_e8m0fnu and float4_e2m1fn_x2 are written as safetensors does (``F8_E8M0``,
    and ``F4``, whose header shape counts the 4-bit values: the last dim doubled).
    Tied tensors (two paths, one storage) are written once (``tied="once"``, as Hugging
    Face publishes tied embeddings; see ``report.aliases``, also in each file's metadata
    as ``asyncckpt_tied``, JSON of alias -> name), or under each of their names
    (``tied="copy"``: for a strict ``load_state_dict`` of the tied model, which wants
    both names, at the cost of the bytes twice).
    ``progress(done, total)`` is called with the bytes written so far, after each tensor.

    Memory: about one tensor at a time (plus the header). The output appears atomically:
    written to a temporary file beside it, fsync'd, then renamed. The temporary of an
    export that was killed is removed by the next export into that directory on the
    same machine.

    ``max_shard_bytes``: ``out_path`` is then a directory to create, laid out as Hugging
    Face publishes a model: files of at most that many tensor bytes (a larger tensor gets
    one of its own), ``model-00001-of-0000N.safetensors``... with a
    ``model.safetensors.index.json`` naming each tensor's file, or ``model.safetensors``
    alone when one file holds them all. The directory appears whole (built under a
    temporary name beside it, then renamed); ``force`` replaces only a directory that
    holds nothing but safetensors files and their index (an earlier export).

    Raises:
        CheckpointNotFoundError: no checkpoint there (or no such step).
        CheckpointCorruptError: a checksum, size or header does not match; nothing is
            left at ``out_path``.
        CheckpointExistsError: ``out_path`` exists and ``force`` is False.
        CheckpointConfigError: a bad ``dtype``, a ``prefix`` that selects nothing, an
            output path inside a step directory (or its ``manifest.json``), or one that
            cannot be written (the error names it).
    """
    started = time.perf_counter()
    check_flags(strip_prefix=strip_prefix, force=force)
    check_progress(progress)
    storage = storage or LocalStorage()
    out = Path(out_path)
    if max_shard_bytes is not None:
        if (isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int)
                or max_shard_bytes < 1):
            raise CheckpointConfigError(f"max_shard_bytes={max_shard_bytes!r}: give a "
                                        "positive number of bytes (e.g. 5_000_000_000)")
        out = Path(str(out_path).rstrip("/" + os.sep) or str(out_path))
    elif str(out_path).endswith(("/", os.sep)):
        raise CheckpointConfigError(
            f"{out_path} ends in a separator, but export writes one file: name it (e.g. "
            f"{out_path}model.safetensors), or pass max_shard_bytes (--max-shard-size) for a "
            "directory of files")
    cast = _cast_dtype(dtype)
    if tied not in ("once", "copy"):
        raise CheckpointConfigError(f"tied={tied!r:.40}: use 'once' (tied tensors written "
                                    "under one name) or 'copy' (under each of theirs)")
    if max_shard_bytes is None:
        _check_out(out, force)
    else:
        _check_out_dir(out, force)
    root = Path(ckpt_path)
    step = commit.check_step(step)
    step_dir, _ = commit.resolve_step_dir(root, step, storage, uncommitted_ok=True)
    manifest = read_manifest(step_dir, storage)
    if step is not None and manifest.step != step:
        raise CheckpointNotFoundError(
            f"{step_dir} holds step {manifest.step}, not step {step}: drop the step or pass "
            "the checkpoint root")
    if step_dir.resolve() in out.resolve().parents:
        raise CheckpointConfigError(f"{out} is inside the checkpoint it exports ({step_dir}): "
                                    "write the export elsewhere")
    report = ExportReport(out_path=out, step_dir=step_dir, step=manifest.step)
    planned = _plan(manifest, prefix, strip_prefix, cast, report, copy_tied=tied == "copy")
    for s in report.skipped:
        report_log.warning("export: skipping %s (%s %s): %s", s.key, s.dtype, list(s.shape),
                           s.reason)
    _warn_of_names(planned, prefix, strip_prefix)
    # every file once, up front (size and header): not once per tensor, which re-read
    # and re-hashed the headers of all the files a sharded tensor touches
    check_files(step_dir, manifest,
                sorted({c.file for p in planned for c in manifest.tensors[p.key].chunks}),
                storage)
    _remove_stale_temporaries(out.parent)
    tmp = _temporary(out.parent)
    written = _Written(sum(p.nbytes for p in planned), progress)
    if max_shard_bytes is None:
        # (refused: nothing written)
        header = _encode_header(planned, manifest, step_dir, report.aliases)
        try:
            size = _write_file(tmp, planned, header, step_dir, manifest, storage, out,
                               report, written)
            with _writing(out):
                _publish(tmp, out, force)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        report.files = [out.name]
    else:
        size = _write_shards(tmp, out, force, _shards(planned, max_shard_bytes), step_dir,
                             manifest, storage, report, written)
    with contextlib.suppress(OSError):
        _fsync_dir(out.parent)
    report.file_bytes = size
    report.tensor_bytes = sum(p.nbytes for p in planned)
    report.tensors = [ExportedTensor(p.name, p.key, dtype_name(p.out), dtype_name(p.src),
                                     p.shape, p.nbytes, p.chunks) for p in planned]
    report.seconds = time.perf_counter() - started
    for name, n in report.overflowed.items():
        # (as ``overflowed`` counts them: infinities a format without them cannot hold too)
        report_log.warning("export: %d values of %s are beyond the range of %s (or infinite "
                           "where it holds no inf) and became inf or NaN (or its largest "
                           "value, where the cast saturates)",
                           n, name, dtype_name(cast) if cast is not None else "its dtype")
    log.info("exported %d tensors (%d bytes) of step %d from %s to %s in %.3fs",
             len(planned), report.tensor_bytes, manifest.step, step_dir, out, report.seconds)
    return report


def _cast_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        if dtype is not None:
            _check_cast_target(dtype)
        return dtype
    found = DTYPE_ALIASES.get(dtype.lower())
    if found is None:
        raise CheckpointConfigError(
            f"dtype={dtype!r}: use one of {', '.join(sorted(DTYPE_ALIASES))}")
    return found


def _check_cast_target(dtype: torch.dtype) -> None:
    """Refuse, up front and naming it, a target no tensor could be written as; else every
    tensor would be skipped (the error then blaming their own dtypes) or silently kept."""
    if not dtype.is_floating_point:
        raise CheckpointConfigError(f"dtype={dtype}: only floating dtypes can be cast to")
    usable = ", ".join(dtype_name(d) for d in _ST_DTYPES if d.is_floating_point)
    if dtype not in _ST_DTYPES:
        # float8_e8m0fnu (scales: powers of two, no sign) and the packed float4: tensors of
        # them are written as they are, but no weights are cast to them
        why = (f"safetensors has no dtype for {dtype_name(dtype)}" if st_dtype(dtype) is None
               else f"{dtype_name(dtype)} tensors are exported as they are (safetensors' "
               f"{st_dtype(dtype)}), but other tensors are not cast to it")
        raise CheckpointConfigError(f"dtype={dtype}: {why}; cast to one of {usable}")
    try:
        torch.zeros(1).to(dtype)
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        raise CheckpointConfigError(
            f"dtype={dtype}: torch cannot convert to {dtype_name(dtype)} ({exc}); cast to one "
            f"of {usable}") from None


@contextlib.contextmanager
def _writing(out: Path) -> Iterator[None]:
    """Errors of the output side, as CheckpointConfigError naming the output."""
    try:
        yield
    except CheckpointError:
        raise
    except OSError as exc:
        if exc.errno in _STORAGE_ERRNOS:  # (not a setting to change: a CLI trial's full
            # disk read as CheckpointConfigError)
            what = ("free space, or write elsewhere" if exc.errno in (
                errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else "check that storage, or write "
                "elsewhere")
            raise CheckpointSaveError(f"cannot write {out}: {exc.strerror or exc}; the "
                                      f"export was not published: {what}") from exc
        raise CheckpointConfigError(f"cannot write {out}: {exc.strerror or exc}") from exc


# Errors of the storage under an export's output, not of what it was asked to do
_STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG, errno.EROFS})


def _selects(name: str, prefix: str) -> bool:
    if not prefix or prefix.endswith(("/", ".")):
        return name.startswith(prefix)
    return name == prefix or (name.startswith(prefix) and name[len(prefix)] in "/.")


def _stripped(name: str, prefix: str) -> str:
    """``name`` without ``prefix`` and the one separator after it (a key of its own may
    begin with another: ``model/.hidden`` is ``.hidden``)."""
    rest = name[len(prefix):]
    if prefix and not prefix.endswith(("/", ".")) and rest[:1] in ("/", "."):
        rest = rest[1:]
    return rest


def _refuse_inside_a_checkpoint(out: Path) -> Path:
    """CheckpointConfigError if ``out`` is (in) a step directory; its resolved path."""
    target = out.parent.resolve() / out.name
    d = commit.step_dir_around(target)  # (the output itself, named like a step: refused)
    if d is not None:
        where = ("is named like a step directory" if d == target else
                 f"is inside the checkpoint directory {d}")
        raise CheckpointConfigError(
            f"{out} {where}: writing there would change a "
            "committed (or in-flight) step; name a file outside it (force=True or --force "
            "does not change that)")
    return target


def _check_out(out: Path, force: bool) -> None:
    if out.is_dir():
        raise CheckpointConfigError(f"{out} is a directory: name the .safetensors file to write")
    if not out.parent.is_dir():
        what = "is not a directory" if out.parent.exists() else "does not exist"
        raise CheckpointConfigError(f"{out.parent} {what}: name a file in an existing directory")
    if out.name == DirectoryLock.NAME:
        raise CheckpointConfigError(
            f"{out} is the lock file of a checkpoint directory: writing it would let two "
            "savers in at once; name another file (force=True or --force does not change that)")
    target = _refuse_inside_a_checkpoint(out)
    if out.name == MANIFEST_NAME and (commit.is_checkpoint_root(target.parent)
                                      or commit.has_rank_files(target.parent)):
        # A root (or a step directory) with a manifest.json is read as a step directory
        # by every load and verify of it: the root's real steps would be out of reach.
        raise CheckpointConfigError(
            f"{out} would be read as the checkpoint manifest of {target.parent}, which is a "
            "checkpoint directory: every load and verify of it would break; name the export "
            "otherwise (e.g. model.safetensors) or write it elsewhere (force=True or --force "
            "does not change that)")
    try:
        st = os.lstat(out)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        # The output is renamed over the path: a device (/dev/full), a FIFO or a symlink
        # (/dev/stdout) would be replaced by a regular file, not written through.
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a regular file"
        raise CheckpointConfigError(
            f"{out} is {kind}; export writes a new file and renames it into place, so it "
            "would replace it: name a regular file (force=True or --force does not change that)")
    if not force:
        raise CheckpointExistsError(f"{out} already exists; pass force=True (--force) to "
                                    "overwrite it")


_WRAPPERS = ("_orig_mod.", "module.")  # torch.compile's; DataParallel's and DDP's


def _warn_of_names(planned: list[_Planned], prefix: str, strip: bool) -> None:
    """Names a reader of the file will not expect: every one under a wrapper's prefix (a
    trial exported a torch.compile'd model as _orig_mod.*, which no model loads), or
    holding a key's own '/' (read back as a separator, into nested dicts)."""
    if planned:
        for wrapper in _WRAPPERS:
            if all(p.name.startswith(wrapper) for p in planned):
                first = planned[0]
                cut = first.full[:len(first.full) - len(first.name)] + wrapper
                log.warning("export: every tensor name starts with %r, a wrapper's part of "
                            "the names (torch.compile, DataParallel), which the model that "
                            "loads the file will not have: export with prefix=%r and "
                            "strip_prefix (--prefix %s --strip-prefix) to drop it", wrapper,
                            cut, cut)
                break
    slashed = [p.name for p in planned if p.own_slash]
    if slashed:
        log.warning("export: %d tensor name(s) hold a '/' of their key's own (%s): a "
                    "safetensors name has no way to tell it from the '/' between keys, and "
                    "load_safetensors reads it back as one (nested dicts); rename those keys "
                    "to load the file into the tree it came from", len(slashed),
                    ", ".join(repr(n) for n in slashed[:3]) + (", ..." if len(slashed) > 3
                                                               else ""))


def _plan(manifest: Manifest, prefix: str, strip: bool, cast: torch.dtype | None,
          report: ExportReport, copy_tied: bool = False) -> list[_Planned]:
    """Choose the tensors and their output names, dtypes and order (``copy_tied``: a
    tied tensor under each of its names, not once)."""
    written: dict[str, str] = {}  # storage key -> output name
    names: dict[str, str] = {}  # output name -> storage key
    planned: list[_Planned] = []
    for path, node in iter_array_nodes(manifest.skeleton):
        full = unescape_path(path)
        if not _selects(full, prefix):
            continue
        key = node["key"]
        name = _stripped(full, prefix) if strip else full
        if key in written and not copy_tied:
            if names.get(name) == key or report.aliases.get(name) == written[key]:
                continue  # the same tensor again under a name it already has
            if name in names or name in report.aliases:
                raise CheckpointConfigError(
                    f"tensor {path!r} would be named {name!r} in the output, as is "
                    f"{_named(name, names, report.aliases)}; rename one of the keys or "
                    "export them with prefixes that keep them apart")
            report.aliases[name] = written[key]
            continue
        entry = manifest.tensors[key]
        out = cast if cast is not None and _castable(entry.dtype, cast) else entry.dtype
        if st_dtype(out) is None or st_shape(out, entry.shape) is None:
            report.skipped.append(SkippedTensor(
                key, dtype_name(entry.dtype), entry.shape,
                f"safetensors has no dtype for {dtype_name(out)}" if st_dtype(out) is None
                else f"safetensors' {st_dtype(out)} counts the 4-bit values, two to each "
                f"element of a {dtype_name(out)}: a 0-d one has no shape there (reshape it "
                "to (1,) to export it)"))
            continue
        if name == RESERVED_KEY or (not name and strip and prefix):
            # A key of its own may be '' (safetensors allows it); a name that stripping
            # emptied, or the metadata's own, cannot be written.
            what = ("is the name safetensors keeps for its metadata" if name
                    else "is empty once the prefix is stripped")
            fix = ("use a shorter prefix or drop strip_prefix (--strip-prefix)"
                   if strip and prefix else "rename its key")
            raise CheckpointConfigError(
                f"tensor {full!r} would be named {name!r} in the output, which {what}; {fix}")
        if names.get(name) == key:
            continue  # (copy_tied: the same tensor again under a name it already has)
        if name in names or name in report.aliases:
            raise CheckpointConfigError(
                f"tensor {path!r} would be named {name!r} in the output, as is "
                f"{_named(name, names, report.aliases)}; rename one of the keys or export "
                "them with prefixes that keep them apart")
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: a str and JSON allow it, UTF-8 not
            raise CheckpointConfigError(
                f"tensor {full!r} would be named {name!r} in the output, which is not valid "
                "UTF-8 (it holds a lone surrogate) and so no safetensors name; export the "
                "other tensors with a prefix that leaves it out, or rename its key") from None
        written.setdefault(key, name)
        names[name] = key
        n = 1
        for s in entry.shape:
            n *= s
        planned.append(_Planned(name, key, entry.dtype, out, entry.shape, n * out.itemsize,
                                len(entry.chunks), full, "%2F" in path))
    if not planned and report.skipped:
        raise CheckpointConfigError(
            f"every tensor under {prefix!r} in step {manifest.step} is of a dtype (or, a 0-d "
            "float4_e2m1fn_x2, a shape) safetensors cannot hold: "
            + "; ".join(f"{k.key} ({k.dtype})" for k in report.skipped[:5])
            + ("..." if len(report.skipped) > 5 else "") + "; nothing to export")
    if not planned:
        # (as the prefix is matched: keys as they were, not as the manifest escapes them)
        tops = sorted({unescape_path(p.split("/", 1)[0]) + ("/" if "/" in p else "")
                       for p, _ in iter_array_nodes(manifest.skeleton)})
        if not tops:  # (a trial's: "no tensor is under '' ...; start with: none")
            raise CheckpointConfigError(f"step {manifest.step} holds no tensors: nothing to "
                                        "export")
        have = ", ".join(repr(t) for t in tops[:10])
        raise CheckpointConfigError(
            f"no tensor is under {prefix!r} in step {manifest.step}; the tensor paths "
            f"start with: {have}")
    # Largest element size first: every tensor starts aligned to its own element size
    # and the body needs no padding (safetensors allows no holes). Stable otherwise.
    planned.sort(key=lambda p: -p.out.itemsize)
    return planned


def _named(name: str, names: dict[str, str], aliases: dict[str, str]) -> str:
    """What already goes by ``name`` in the output, for an error: its saved path as
    ``inspect`` lists it (escaped: a key 'a/b' is 'a%2Fb' there, not the nested 'a/b')."""
    if name in names:
        return f"the tensor saved as {names[name]!r}"
    return f"a tied copy of {aliases[name]!r}"


def _castable(src: torch.dtype, dst: torch.dtype) -> bool:
    """Floating dtypes torch can convert (packed ones such as float4_e2m1fn_x2 cannot)."""
    if not src.is_floating_point:
        return False
    try:
        torch.zeros(src.itemsize, dtype=torch.uint8).view(src).to(dst)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def _encode_header(planned: list[_Planned], manifest: Manifest, step_dir: Path,
                   aliases: dict[str, str]) -> bytes:
    meta = {"format": "pt", "asyncckpt_step": str(manifest.step),
            # A name that is no UTF-8 (surrogate escapes) would make the file unloadable.
            "asyncckpt_source": os.fsencode(step_dir.name).decode("utf-8", "backslashreplace")}
    if aliases:  # (which names a tied tensor's one copy stands for: the file's readers)
        meta["asyncckpt_tied"] = json.dumps(aliases, separators=(",", ":"), ensure_ascii=True)
    header: dict[str, Any] = {RESERVED_KEY: meta}
    pos = 0
    for p in planned:
        # (F4's shape counts 4-bit values: twice float4_e2m1fn_x2's along the last dim)
        header[p.name] = {"dtype": st_dtype(p.out), "shape": st_shape(p.out, p.shape),
                          "data_offsets": [pos, pos + p.nbytes]}
        pos += p.nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    pad = -(8 + len(raw)) % _HEADER_ALIGN
    raw += b" " * pad
    if len(raw) > WRITE_MAX_HEADER_BYTES:  # (no safetensors reader would open the file)
        raise CheckpointConfigError(
            f"the safetensors header of {len(planned):,} tensors would take {len(raw):,} "
            f"bytes, over the {WRITE_MAX_HEADER_BYTES:,} that safetensors readers accept: "
            "pass max_shard_bytes (--max-shard-size) to spread them over several files, or "
            "a prefix to export fewer; nothing was written")
    return struct.pack("<Q", len(raw)) + raw


class _Written:
    """Bytes of tensors written so far, told to ``progress`` after each tensor."""

    def __init__(self, total: int, progress: Callable[[int, int], None] | None) -> None:
        self.done, self.total, self.progress = 0, total, progress

    def add(self, n: int) -> None:
        self.done += n
        if self.progress is not None:
            self.progress(self.done, self.total)


def _write_file(path: Path, planned: list[_Planned], header: bytes, step_dir: Path,
                manifest: Manifest, storage: Storage, out: Path, report: ExportReport,
                written: _Written) -> int:
    """Create ``path`` (a new file) holding ``header`` and ``planned``, fsync'd; return its
    size. The caller removes it on failure."""
    with _writing(out):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0),
                     0o644)
    try:
        with _writing(out):
            _write_all(fd, memoryview(header))
        run: list[_Planned] = []
        run_bytes = 0
        for p in planned:
            if p.out == p.src and p.nbytes <= _BATCH_ONE:
                run.append(p)
                run_bytes += p.nbytes
                if run_bytes >= _BATCH_BYTES:
                    _write_run(fd, step_dir, manifest, storage, run, out, written)
                    run_bytes = 0
                continue
            _write_run(fd, step_dir, manifest, storage, run, out, written)
            run_bytes = 0
            over = _write_tensor(fd, step_dir, manifest, storage, p, out)
            if over:
                report.overflowed[p.name] = over
            written.add(p.nbytes)
        _write_run(fd, step_dir, manifest, storage, run, out, written)
        with _writing(out):
            os.fsync(fd)
            return os.fstat(fd).st_size
    finally:
        os.close(fd)


def _shards(planned: list[_Planned], max_bytes: int) -> list[list[_Planned]]:
    """``planned`` cut, in order, into runs of at most ``max_bytes`` of tensors (a larger
    tensor alone), as Hugging Face cuts a model (each run keeps the order: largest
    element size first, so no file needs padding)."""
    out: list[list[_Planned]] = [[]]
    size = 0
    for p in planned:
        if out[-1] and size + p.nbytes > max_bytes:
            out.append([])
            size = 0
        out[-1].append(p)
        size += p.nbytes
    return out


INDEX_NAME = "model.safetensors.index.json"


def _write_shards(tmp: Path, out: Path, force: bool, shards: list[list[_Planned]],
                  step_dir: Path, manifest: Manifest, storage: Storage, report: ExportReport,
                  written: _Written) -> int:
    """Build the directory of ``shards`` (and its index) at ``tmp``, then publish it as
    ``out``; return the bytes of its files."""
    n = len(shards)
    names = (["model.safetensors"] if n == 1 else
             [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)])
    # (every header first: one that safetensors would refuse is told before any is written)
    headers = [_encode_header(part, manifest, step_dir, report.aliases) for part in shards]
    try:
        with _writing(out):
            os.mkdir(tmp, 0o755)
        size = 0
        for name, part, header in zip(names, shards, headers, strict=True):
            size += _write_file(tmp / name, part, header, step_dir, manifest, storage, out,
                                report, written)
            report.weight_map.update((p.name, name) for p in part)
        if n > 1:
            index = {"metadata": {"total_size": sum(p.nbytes for part in shards
                                                    for p in part)},
                     "weight_map": report.weight_map}
            raw = json.dumps(index, indent=2, ensure_ascii=True).encode("ascii") + b"\n"
            with _writing(out):
                fd = os.open(tmp / INDEX_NAME,
                             os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0),
                             0o644)
                try:
                    _write_all(fd, memoryview(raw))
                    os.fsync(fd)
                finally:
                    os.close(fd)
            size += len(raw)
            names.append(INDEX_NAME)
        with _writing(out):
            _fsync_dir(tmp)
            _publish_dir(tmp, out, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    report.files = names
    return size


def _publish_dir(tmp: Path, out: Path, force: bool) -> None:
    """Rename the finished directory to ``out``. An existing ``out`` (an earlier export,
    ``force``) is renamed out of the way first and removed once the new one is in place:
    a crash in between leaves both under temporary names, never neither."""
    if not os.path.lexists(out):
        try:
            os.rename(tmp, out)
        except OSError as exc:  # (made meanwhile, by another process)
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise CheckpointExistsError(f"{out} appeared while the export was written; "
                                            "pass force=True (--force) to replace it") from None
            raise
        return
    if not force:
        raise CheckpointExistsError(f"{out} already exists; pass force=True (--force) to "
                                    "replace it")
    _check_replaceable(out)
    old = _temporary(out.parent)
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)  # (put the earlier export back)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _check_replaceable(out: Path) -> None:
    """``force`` replaces a directory of safetensors files and their index only."""
    if os.path.islink(out) or not out.is_dir():
        raise CheckpointConfigError(f"{out} is not a directory: name a new directory for the "
                                    "sharded export (force=True or --force does not change that)")
    other = sorted(n for n in os.listdir(out)
                   if not (n.endswith(".safetensors") or n.endswith(".safetensors.index.json"))
                   or not (out / n).is_file() or (out / n).is_symlink())
    if other:
        raise CheckpointConfigError(
            f"{out} holds more than an export ({', '.join(other[:5])}"
            f"{'...' if len(other) > 5 else ''}): replacing it would delete those; name a new "
            "directory (force=True or --force replaces an earlier export only)")


def _check_out_dir(out: Path, force: bool) -> None:
    """The checks of :func:`_check_out` for a directory of files."""
    if not out.parent.is_dir():
        what = "is not a directory" if out.parent.exists() else "does not exist"
        raise CheckpointConfigError(f"{out.parent} {what}: name a directory to create in an "
                                    "existing one")
    if out.name in (MANIFEST_NAME, DirectoryLock.NAME):
        # (in a checkpoint root, a directory of that name breaks its loads or its lock)
        raise CheckpointConfigError(f"{out}: name the export's directory otherwise (e.g. "
                                    "hf-model)")
    _refuse_inside_a_checkpoint(out)
    if os.path.lexists(out):
        if not force:
            raise CheckpointExistsError(f"{out} already exists; pass force=True (--force) to "
                                        "replace it")
        _check_replaceable(out)


def _write_run(fd: int, step_dir: Path, manifest: Manifest, storage: Storage,
               run: list[_Planned], out: Path, written: _Written) -> None:
    """Read the tensors of ``run`` (verified; their files were checked) with one read,
    append them in order, and empty ``run``."""
    if not run:
        return
    got = _load_checked(step_dir, manifest, dict.fromkeys(p.key for p in run), storage,
                        verify=True, threads=None, boxes={})
    # (one writev from the tensors read, not a join of them: a trial measured the run
    # held twice, 128 MB for an export of 64 MiB runs)
    with _writing(out):
        _writev_all(fd, [tensor_bytes(got[p.key]) for p in run])
    del got
    for p in run:
        written.add(p.nbytes)
    run.clear()


def _write_tensor(fd: int, step_dir: Path, manifest: Manifest, storage: Storage,
                  p: _Planned, out: Path) -> int:
    """Read one whole tensor (verified; its files were checked) and append it, cast piece
    by piece if asked; returns how many finite values the cast made inf or NaN."""
    t = _load_checked(step_dir, manifest, {p.key: None}, storage, verify=True, threads=None,
                      boxes={})[p.key]
    if p.out == p.src:
        with _writing(out):
            _write_all(fd, tensor_bytes(t))
        return 0
    flat = t.reshape(-1)
    narrower = torch.finfo(p.out).max < torch.finfo(p.src).max
    beyond = _rounds_beyond(p.out) if narrower else None
    over = 0
    for i in range(0, flat.numel(), _CAST_PIECE_ELEMS):
        src = flat[i:i + _CAST_PIECE_ELEMS]
        piece = src.to(p.out).contiguous()
        if narrower:
            # Non-finite after the cast, not inf: formats without inf (float8_e4m3fnuz...)
            # turn an overflow into NaN. torch has no isfinite for most float8 formats.
            # The source may be a float8 format too (e4m3fn cast to e4m3fnuz).
            after = piece if piece.dtype.itemsize > 1 else piece.float()
            wide = src if src.dtype.itemsize >= 4 else src.float()
            lost = ~torch.isfinite(after) & torch.isfinite(wide)
            if beyond is not None:  # a saturating cast (float8_e4m3fn) makes them its max
                lost |= torch.isfinite(wide) & (wide.abs() > beyond)
            # and infinities of a format without them (made its max, or NaN): a weight
            # that diverged must not come out as a plausible number without a word
            lost |= torch.isinf(wide) & ~torch.isinf(after)
            over += int(lost.sum())
        with _writing(out):
            _write_all(fd, tensor_bytes(piece))
    return over


@functools.cache
def _rounds_beyond(dtype: torch.dtype) -> float | None:
    """The magnitude above which a value does not round to ``dtype``'s largest finite
    value (halfway from it to where the next one would be, a step as far as the one
    below it): a cast that gives the largest value to such a value saturated. Found by
    listing the format's values (1 and 2 bytes); None for wider formats, whose casts
    overflow to inf."""
    if dtype.itemsize > 2:
        return None
    bits = torch.arange(2 ** (8 * dtype.itemsize), dtype=torch.int32)
    raw = bits.to(torch.uint8 if dtype.itemsize == 1 else torch.int16)
    values = raw.view(dtype).double()
    top: list[float] = torch.unique(values[torch.isfinite(values)].abs())[-2:].tolist()
    below, largest = top
    return largest + (largest - below) / 2


def _writev_all(fd: int, views: list[memoryview]) -> None:
    """Write ``views`` one after another, in as few calls as the system takes."""
    todo = [v.cast("B") if v.format != "B" or v.ndim != 1 else v for v in views if v.nbytes]
    i = 0
    while i < len(todo):
        k = os.writev(fd, todo[i:i + _IOV_MAX])
        if k <= 0:
            raise OSError(errno.EIO, "short write")
        while k and i < len(todo):  # (past what was written; a view cut where it stopped)
            if k >= len(todo[i]):
                k -= len(todo[i])
                i += 1
            else:
                todo[i] = todo[i][k:]
                k = 0


def _iov_max() -> int:
    """How many buffers one writev takes here (1024 on Linux; 16, POSIX's least)."""
    try:
        n = os.sysconf("SC_IOV_MAX")
    except (ValueError, OSError, AttributeError):
        return 16
    return min(n, 1024) if n > 0 else 16


_IOV_MAX = _iov_max()


def _write_all(fd: int, data: memoryview) -> None:
    pos = 0
    n = len(data)
    while pos < n:
        k = os.write(fd, data[pos:pos + _WRITE_PIECE])
        if k <= 0:
            raise OSError(errno.EIO, "short write")
        pos += k


_TMP_PREFIX = ".asyncckpt-export-"
# this machine's name as a temporary's name may hold it (no "-": it separates the parts)
_HOST = "".join(c if c.isalnum() else "_" for c in os.uname().nodename)[:64] or "host"


def _temporary(where: Path) -> Path:
    """A new temporary name in ``where``, as :func:`_remove_stale_temporaries` reads them
    (this machine, this process)."""
    return where / f"{_TMP_PREFIX}{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:12]}.tmp"


def _remove_stale_temporaries(where: Path) -> None:
    """Delete the temporaries of exports into ``where`` that died unfinished (killed:
    no ``finally`` ran) in a process of this machine that is gone. Those of other
    machines (a shared directory) and of live processes are left alone."""
    try:
        names = os.listdir(where)
    except OSError:
        return  # the export itself will say what is wrong with the directory
    for name in names:
        if not (name.startswith(_TMP_PREFIX) and name.endswith(".tmp")):
            continue
        host, _, rest = name[len(_TMP_PREFIX):].partition("-")
        pid = rest.partition("-")[0]
        if host != _HOST or not pid.isdigit() or _alive(int(pid)):
            continue
        with contextlib.suppress(OSError):
            if os.path.isdir(where / name) and not os.path.islink(where / name):
                shutil.rmtree(where / name)  # (a sharded export's directory)
            else:
                os.unlink(where / name)
            log.warning("export: removed %s, left by an export that did not finish",
                        where / name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (EPERM: another user's process)
        return True
    return True


def _publish(tmp: Path, out: Path, force: bool) -> None:
    """Move the finished file to ``out``: never over an existing file unless ``force``."""
    if force:
        os.replace(tmp, out)
        return
    try:
        os.link(tmp, out)  # atomic and fails if ``out`` appeared in the meantime
    except FileExistsError:
        raise CheckpointExistsError(f"{out} already exists; pass force=True (--force) to "
                                    "overwrite it") from None
    except OSError as exc:  # filesystems without hard links
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV,
                             errno.EMLINK):
            raise
        if out.exists():
            raise CheckpointExistsError(f"{out} already exists; pass force=True (--force) to "
                                        "overwrite it") from None
        os.rename(tmp, out)
        return
    os.unlink(tmp)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
