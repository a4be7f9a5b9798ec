"""Flatten state trees into {path: tensor} plus a JSON skeleton, and build them back.

A state tree is nested dicts (str or int keys), lists and tuples whose leaves are
torch tensors, numpy arrays and int/float/bool/str/None/bytes. Objects with
``state_dict()``/``load_state_dict()`` are saved through ``state_dict()`` and
restored in place through ``load_state_dict()``.

Every array leaf gets a *path*: its keys joined by ``/`` (a ``/`` or ``%`` inside a
key is percent-escaped), e.g. ``model/layers.0.weight`` or ``optim/state/0/exp_avg``.
The skeleton keeps everything else (containers, key types, scalars) with type tags,
so that round trips are exact: int keys stay ints, tuples stay tuples.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import enum
import functools
import io
import logging
import random
import re
import struct
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from ._gc import gc_resumed
from .errors import (
    CheckpointConfigError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointSaveError,
    StateMismatchError,
    UnsupportedLeafError,
    add_note,
)

log = logging.getLogger(__name__)

__all__ = [
    "FlatState",
    "RNGState",
    "Stateful",
    "capture_rng_state",
    "flatten",
    "restore_rng_state",
    "unflatten",
]

# Tensors met so far, by data pointer: (tensor, its storage key) for alias detection.
# data pointer (or storage) -> the leaf seen there, as (tensor, path), or the leaves once
# there are several (most pointers are seen once: no object made for them)
_Seen = dict[Any, "tuple[torch.Tensor, str] | _Views"]

# The skeleton is plain JSON data; its nodes are dicts with a "t" (type) tag.
MAX_DEPTH = 190  # containers nested in one another; loads refuse skeletons deeper than 200
RESERVED_KEY = "__metadata__"  # a safetensors header's name for its metadata: no tensor's
Node = dict[str, Any]
Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, lengths) in global coordinates


@runtime_checkable
class Stateful(Protocol):
    """An object saved through ``state_dict()`` and restored through ``load_state_dict()``."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any, /) -> Any: ...


def _is_stateful(obj: object) -> bool:
    return (
        not isinstance(obj, (Mapping, torch.Tensor, np.ndarray, type))
        and callable(getattr(obj, "state_dict", None))
        and callable(getattr(obj, "load_state_dict", None))
    )


def escape_key(key: str | int) -> str:
    """Return one path segment for a dict key or list index.

    ``%`` and ``/`` are percent-escaped, and the empty key becomes ``%00`` so that it
    cannot vanish from a path (``{"": [t]}`` must not name the same path as ``{"0": t}``).
    """
    if isinstance(key, int):  # bool keys never get here: flatten refuses them
        return str(key)
    if key == "":
        return "%00"
    if "%" not in key and "/" not in key:
        return key
    return key.replace("%", "%25").replace("/", "%2F")


def unescape_path(path: str) -> str:
    """A path with its keys as they were: :func:`escape_key` undone on every part (for
    names shown to other tools; ``/`` inside a key then reads like a separator)."""
    if "%" not in path:
        return path
    return "/".join("" if seg == "%00" else seg.replace("%2F", "/").replace("%25", "%")
                    for seg in path.split("/"))


def join_path(prefix: str, key: str | int) -> str:
    seg = escape_key(key)
    return f"{prefix}/{seg}" if prefix else seg


@functools.cache
def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


@functools.cache  # (a failure raises, and is not kept)
def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; raises ValueError for names that are no torch dtype."""
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype) or dtype_name(dt) != name:
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def _is_bits(name: str) -> bool:
    """Quantized and sub-byte dtypes have no stable byte layout to promise: refuse them."""
    if name.startswith(("qint", "quint", "bits")) or name == "bit":
        return True
    # int1..int7 and uint1..uint7 are sub-byte placeholder dtypes
    for p in ("int", "uint"):
        rest = name[len(p):] if name.startswith(p) else ""
        if rest.isascii() and rest.isdigit() and int(rest) < 8:
            return True
    return False


@dataclass
class FlatState:
    """A flattened state tree.

    ``tensors`` maps a storage key to the tensor to save (numpy arrays are viewed as
    CPU tensors); tensors that alias one another (tied weights) appear once.
    ``refs`` maps the path of every array leaf to its storage key, so two paths may
    share one key. ``kinds`` says how a key is restored: ``torch``, ``numpy`` or
    ``numpy_scalar``. ``statefuls`` maps a path to the stateful object found there
    and the state dict it returned. ``arrays`` maps the key of every numpy array leaf
    to the array itself: its tensor is a view of it, or a contiguous copy where the
    array has negative strides (see :func:`is_copied`), which a load writes back.
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)
    skeleton: Node = field(default_factory=dict)
    statefuls: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    boxes: dict[str, tuple[tuple[int, ...], Box]] = field(default_factory=dict)
    loaded_in_place: set[str] = field(default_factory=set)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    target: bool = False  # flattened as the target of a load
    # restoring a stateful's state dict, whose lists may be the object's own and shared
    # (SequentialLR's _last_lr is its current scheduler's): build new ones there
    in_state_dict: bool = False
    # restoring the state dict of an optimizer or LR scheduler (takes_whole_state): its
    # load_state_dict gets the checkpoint's state alone, with none of the target's own
    # entries merged in (the target's tensors are only where the checkpoint's were read)
    checkpoint_only: bool = False
    # the path of the stateful whose state dict is being restored: there, the state
    # dict's own node is not the object again
    entered: str | None = None
    # a load that skips what the target lacks (ignore_unexpected=True, strict=False): the
    # checkpoint's entries at keys of the target's own dicts that it lacks are not added
    # (values without tensors too: "the model alone" got the trainer's other parts)
    skip_extra: bool = False
    # a load's exclude= (see excluded_here): those parts of the target are not flattened
    # (a lazy or meta head left out of a load is not refused), and where they were
    exclude: tuple[str, ...] = ()
    excluded: list[str] = field(default_factory=list)
    # (the tensors exclude= left out, by path: one tied to a tensor the load fills would
    # be filled through it, see flatten)
    excluded_tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    module_paths: set[str] = field(default_factory=set)  # (with exclude: modules' paths)
    # key -> the DTensor leaf whose local shard ``tensors`` holds: its version counter is
    # the one in-place ops on it bump (its local tensor's stays as it was)
    wrappers: dict[str, torch.Tensor] = field(default_factory=dict)
    # path -> a torch leaf stored under another path's key (the same view of the same
    # memory) that is another tensor object: its own version counter may count an
    # in-place change the kept one's does not (one made with set_(), or from_numpy twice)
    aliases: dict[str, torch.Tensor] = field(default_factory=dict)

    def global_shape(self, key: str) -> tuple[int, ...]:
        box = self.boxes.get(key)
        return box[0] if box is not None else tuple(self.tensors[key].shape)

    def box(self, key: str) -> Box | None:
        """The box of ``key`` in global coordinates, or None for a whole tensor."""
        b = self.boxes.get(key)
        return b[1] if b is not None else None


def excluded_here(path: str, segments: Iterable[str], exclude: tuple[str, ...],
                  module: bool = False) -> set[str]:
    """The segments (escaped keys) of the dict at ``path`` that ``exclude`` leaves out:
    those it names, and in a module's state dict (``module``), where it names a key the
    dict lacks, the keys that name goes on with a ``.``: a module's state dict names a
    submodule's tensors ``head.weight`` (no ``head``). In a plain dict, ``model`` is the
    key ``model`` alone, never ``model.ema``."""
    prefix = f"{path}/" if path else ""
    named = {e[len(prefix):] for e in exclude
             if e.startswith(prefix) and "/" not in e[len(prefix):]}
    if not named:
        return set()
    segs = list(segments)
    have = set(segs)
    dotted = tuple(f"{x}." for x in named if x not in have) if module else ()
    return {sg for sg in segs if sg in named or (dotted and sg.startswith(dotted))}


def flatten(state: Any, *, target: bool = False, exclude: tuple[str, ...] = ()) -> FlatState:
    """Flatten a state tree; raise UnsupportedLeafError naming the path of a bad leaf.

    ``target``: the tree is what a load fills. Stateful objects that ask for it (a true
    ``_asyncckpt_load_fresh`` attribute, as RNGState has) then stand for an empty state
    dict: whatever the checkpoint holds for them is loaded fresh and handed over whole.

    Example:
        >>> flat = flatten({"w": torch.ones(2), "step": 3})
        >>> list(flat.tensors), flat.skeleton["t"]
        (['w'], 'dict')
    """
    flat = FlatState(target=target, exclude=exclude)
    seen: _Seen = {}
    flat.skeleton = _flatten(state, "", flat, seen, set())
    if flat.excluded_tensors and flat.tensors:
        _refuse_half_a_tie(flat)
    return flat


def version_counters(tensors: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Each tensor's version counter (bumped by every in-place op on it or on a view of
    its storage), where it has one: inference tensors have none."""
    out = {}
    for key, t in tensors.items():
        try:  # noqa: SIM105 - suppress() would cost more than the read, per tensor
            out[key] = t._version
        except RuntimeError:
            pass
    return out


def changed_in_place(tensors: Mapping[str, torch.Tensor], versions: Mapping[str, int],
                     keys: Iterable[str] | None = None) -> list[str]:
    """The keys of ``versions`` (``version_counters`` of ``tensors``, taken earlier) whose
    tensor torch saw changed in place since; of ``keys`` alone, where given."""
    if keys is None:
        return [key for key, v in versions.items() if tensors[key]._version != v]
    return [key for key in keys if key in versions and tensors[key]._version != versions[key]]


def _refuse_half_a_tie(flat: FlatState) -> None:
    """CheckpointConfigError where exclude= leaves out a tensor that shares its memory with
    one the load fills (tied weights: an embedding and its head): the excluded name would
    be filled all the same, through the other (a trial's, silently)."""
    def where(t: torch.Tensor) -> tuple[int, int] | None:
        if t.device.type == "meta" or torch.nn.parameter.is_lazy(t):
            return None
        try:
            s = t.untyped_storage()
            return (s.data_ptr(), s.nbytes()) if s.nbytes() else None
        except (RuntimeError, NotImplementedError):  # (a tensor subclass without storage)
            return None

    left_out = {w: p for p, t in flat.excluded_tensors if (w := where(t)) is not None}
    if not left_out:
        return
    paths: dict[str, str] = {}
    for p, k in flat.refs.items():
        paths.setdefault(k, p)
    for k, t in flat.tensors.items():
        w = where(t)
        if w is not None and w in left_out and k in paths:
            raise CheckpointConfigError(
                f"exclude= leaves out {left_out[w]!r}, which shares its memory with "
                f"{paths[k]!r}, which the load fills (tied weights): it would be filled "
                f"through {paths[k]!r} all the same. Exclude both (or neither)")


def _flatten(obj: Any, path: str, flat: FlatState, seen: _Seen,
             active: set[int]) -> Node:
    if type(obj) is dict and id(obj) not in active and len(active) < MAX_DEPTH:
        return _flatten_mapping(obj, path, flat, seen, active)  # the common inner node
    where = path or "<root>"
    if isinstance(obj, torch.Tensor):
        return {"t": "tensor", "key": _add_tensor(obj, path, flat, seen, "torch")}
    if isinstance(obj, np.ndarray):
        if type(obj) is not np.ndarray and not isinstance(obj, np.memmap):
            raise UnsupportedLeafError(
                f"numpy array at {where!r} is a {type(obj).__module__}.{type(obj).__qualname__}, "
                "whose extras (a mask, a matrix's shape rules) an array would lose: save "
                "np.asarray(x) and what else it holds (e.g. np.ma.getmaskarray(x)) apart")
        key = _add_tensor(_numpy_as_tensor(obj, where), path, flat, seen, "numpy",
                          writeable=bool(obj.flags.writeable))
        flat.arrays[key] = obj
        return {"t": "ndarray", "key": key}
    if isinstance(obj, np.generic) and not isinstance(obj, (np.object_, np.str_, np.bytes_,
                                                             np.void)):
        arr = np.asarray(obj)
        return {"t": "npscalar", "key": _add_tensor(_numpy_as_tensor(arr, where, "scalar"),
                                                    path, flat, seen, "numpy_scalar")}
    t = type(obj)
    if obj is None:
        return {"t": "none"}
    if t is bool:
        return {"t": "bool", "v": obj}
    if t is int:
        if obj.bit_length() > _MAX_INT_BITS:
            raise UnsupportedLeafError(_huge_int(f"int at {where!r}", obj))
        return {"t": "int", "v": obj}
    if t is float:
        if obj != obj:  # NaN: its sign and payload are no part of repr's "nan"
            return _nan_node(obj)
        return {"t": "float", "v": repr(obj)}
    if t is str:
        if not obj.isascii() and not flat.target:  # (a target's value is replaced)
            _check_no_surrogate_pair(obj, where)
        return {"t": "str", "v": obj}
    if t is bytes:
        return {"t": "bytes", "v": base64.b64encode(obj).decode("ascii")}
    if id(obj) in active:
        raise UnsupportedLeafError(f"state tree has a cycle at {where!r}")
    if len(active) >= MAX_DEPTH:  # a load would refuse the skeleton: refuse the save
        raise UnsupportedLeafError(
            f"state tree is nested more than {MAX_DEPTH} levels deep at {where!r}; flatten it")
    if isinstance(obj, Mapping):
        return _flatten_mapping(obj, path, flat, seen, active)
    if t is list or t is tuple:
        active.add(id(obj))
        children = [_flatten(v, join_path(path, i), flat, seen, active) for i, v in enumerate(obj)]
        active.discard(id(obj))
        return {"t": "list" if t is list else "tuple", "items": children}
    if _is_stateful(obj):
        if flat.target and loads_fresh(obj):
            flat.statefuls[path] = (obj, {})
            return {"t": "stateful", "cls": type(obj).__qualname__,
                    "state": {"t": "dict", "items": []}}
        active.add(id(obj))
        try:
            sd = obj.state_dict()
        except Exception as exc:  # the object's own error, told where it came from
            add_note(exc, f"asyncckpt: raised by state_dict() of the {t.__qualname__} at "
                          f"{where!r} of the state tree")
            raise
        flat.statefuls[path] = (obj, sd)
        if flat.exclude and isinstance(obj, torch.nn.Module):
            flat.module_paths.add(path)
        node = {"t": "stateful", "cls": type(obj).__qualname__,
                "state": _flatten(sd, path, flat, seen, active)}
        active.discard(id(obj))
        return node
    raise UnsupportedLeafError(_refusal(obj, where))


# The types a value leaf or container is saved as: a subclass of one would come back as it.
_SAVED_BASES = (tuple, list, str, bytes, int, float)


def _refusal(obj: Any, where: str) -> str:
    """Why ``obj`` cannot be saved, and what to save instead.

    Values are never converted on their way in: a round trip gives back each value as
    the type it was saved as, so a namedtuple or an IntEnum is refused, not saved as the
    plain tuple or int that would come back."""
    t = type(obj)
    name = f"{t.__module__}.{t.__qualname__}"
    base = next((b for b in _SAVED_BASES if isinstance(obj, b)), None)
    if base is not None:
        b = base.__name__
        plain = "plain bytes" if b == "bytes" else f"a plain {b}"
        return (f"cannot checkpoint the value at {where!r}: type {name} is a subclass of {b} "
                f"that would come back as {plain}; " + _subclass_fix(obj, b))
    return (f"cannot checkpoint the value at {where!r}: type {name} is not a tensor, numpy "
            "array, int/float/bool/str/None/bytes, dict, list, tuple or an object with "
            "state_dict()/load_state_dict()" + _leaf_hint(obj))


def _subclass_fix(obj: Any, base: str) -> str:
    """What to save instead of ``obj``, an instance of a subclass of ``base``."""
    cls = type(obj).__qualname__
    if isinstance(obj, enum.Enum):
        return f"save x.value or x.name, and rebuild it with {cls}(v) or {cls}[name]"
    if isinstance(obj, torch.Size):
        return "save tuple(x) or list(x), and rebuild it with torch.Size(v)"
    if isinstance(obj, tuple) and callable(getattr(obj, "_asdict", None)):  # a namedtuple
        return (f"save tuple(x), or x._asdict() (a dict of its fields), and rebuild it with "
                f"{cls}(*v) or {cls}(**d)")
    if isinstance(obj, np.generic):  # numpy's str_ and bytes_
        return f"save {base}(x)"
    return f"save {base}(x) (and rebuild the {cls} from it after loading)"


def _leaf_hint(obj: Any) -> str:
    """How to save what a checkpoint holds no type for: a random generator (it has no
    state_dict()), a dataclass (a run's config), an enum, a set, a complex number..."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return ("; for a dataclass, save dataclasses.asdict(x) (plain values, tuples kept) "
                f"and rebuild it with {type(obj).__qualname__}(**d)")

    if isinstance(obj, torch.Generator):
        return ("; save a generator's state instead (g.get_state(), a uint8 tensor; restore "
                "it with g.set_state(...)), or the process's generators with "
                "asyncckpt.RNGState()")
    if isinstance(obj, (random.Random, np.random.Generator, np.random.RandomState)):
        how = ("g.bit_generator.state, a dict; restore it by assigning it back"
               if isinstance(obj, np.random.Generator) else
               "g.getstate() / g.setstate(...)" if isinstance(obj, random.Random) else
               "g.get_state(legacy=False), a dict / g.set_state(...)")
        return (f"; save its state instead ({how}), or the process's global generators with "
                "asyncckpt.RNGState()")
    cls = type(obj).__qualname__
    if isinstance(obj, enum.Enum):
        return f"; save x.value or x.name, and rebuild it with {cls}(v) or {cls}[name]"
    if isinstance(obj, bytearray):
        return "; save bytes(x) (and rebuild it with bytearray(b) after loading)"
    if isinstance(obj, (set, frozenset)):
        return (f"; save sorted(x) (or another list of its items), and rebuild it with "
                f"{cls}(v)")
    if isinstance(obj, complex):
        return ("; save two floats (z.real, z.imag), or a complex tensor "
                "torch.tensor(z, dtype=torch.complex128) (without dtype= it is complex64)")
    if isinstance(obj, torch.dtype):
        return "; save str(x), and rebuild it with getattr(torch, s.removeprefix('torch.'))"
    if isinstance(obj, torch.device):
        return "; save str(x), and rebuild it with torch.device(s)"
    if isinstance(obj, argparse.Namespace):
        return ("; save vars(x) (a dict of its fields), and rebuild it with "
                "argparse.Namespace(**d)")
    if isinstance(obj, torch.utils.data.DataLoader):
        return ("; a DataLoader has no state_dict(): save its position (epoch, batches "
                "seen, the sampler's seed) through an object with state_dict()/"
                "load_state_dict(), or use torchdata's StatefulDataLoader, which has them")
    if isinstance(obj, io.BytesIO):  # (a module's get_extra_state() of some libraries)
        return ("; save its bytes (x.getvalue()), and rebuild it with io.BytesIO(b) "
                "after loading")
    has_save = callable(getattr(obj, "state_dict", None))
    if has_save != callable(getattr(obj, "load_state_dict", None)):
        # (a trial's object had state_dict() alone, and was told of both as if of neither)
        there, absent = (("state_dict", "load_state_dict") if has_save else
                         ("load_state_dict", "state_dict"))
        return (f"; it has {there}() but no {absent}(), and a checkpoint needs both (the "
                f"load gives the saved state back through load_state_dict): add "
                f"{absent}() to {cls}" + (", or save x.state_dict() and restore it yourself"
                                          if has_save else ""))
    return ""


def _flatten_mapping(obj: Mapping[Any, Any], path: str, flat: FlatState, seen: _Seen,
                     active: set[int]) -> Node:
    # This runs for every dict of the tree inside save_async: the common case (short
    # ascii str or int keys, tensor leaves) is kept cheap.
    where = path or "<root>"
    prefix = f"{path}/" if path else ""
    active.add(id(obj))
    items: list[list[Any]] = []
    str_keys: Any = obj if isinstance(obj, dict) else None  # (made for other mappings)
    gone = excluded_here(path, (escape_key(k) for k in obj if type(k) in (str, int)),
                         flat.exclude, path in flat.module_paths) if flat.exclude else None
    for k, v in obj.items():
        tk = type(k)
        if tk is str:
            if not k.isascii():
                _check_key_text(k, where)
            # (an escaped segment holds a "%", which neither an unescaped key nor an int's
            # digits do: escaped keys name no other key's path, and one another's only if
            # they are equal)
            seg = k if k and "%" not in k and "/" not in k else escape_key(k)
        elif tk is int:
            if k.bit_length() > _MAX_INT_BITS:
                raise UnsupportedLeafError(_huge_int(f"dict key at {where!r}", k))
            seg = str(k)
            if str_keys is None:
                str_keys = {x for x in obj if type(x) is str}
            if seg in str_keys:  # the one pair of keys that name one path: 1 and "1"
                first, second = (k, seg) if _before(obj, k, seg) else (seg, k)
                raise UnsupportedLeafError(
                    f"dict at {where!r} has keys {first!r} and {second!r}, which name the "
                    "same path; rename one of them")
        else:
            raise UnsupportedLeafError(
                f"dict key {k!r} of type {tk.__name__} at {where!r}: only str and int keys "
                "can be checkpointed; convert the key to "
                + ("int (int(k): a numpy integer)" if isinstance(k, np.integer) else
                   "int" if isinstance(k, int) and not isinstance(k, bool) else "str"))
        if gone and seg in gone:  # (a load's exclude=: left out of the target)
            flat.excluded.append(prefix + seg)
            if isinstance(v, torch.Tensor):
                flat.excluded_tensors.append((prefix + seg, v))
            elif type(v) is np.ndarray and not is_copied(v):  # (tied as arrays too)
                with contextlib.suppress(UnsupportedLeafError):
                    flat.excluded_tensors.append((prefix + seg, _numpy_as_tensor(v, "")))
            continue
        tv = type(v)
        if tv in _PLAIN_TENSOR_TYPES or (  # the common leaves, without recursion
                tv.__name__ == "DTensor" and isinstance(v, torch.Tensor)):
            items.append([k, {"t": "tensor", "key": _add_tensor(v, prefix + seg, flat, seen,
                                                                "torch")}])
        else:
            items.append([k, _flatten(v, prefix + seg, flat, seen, active)])
    active.discard(id(obj))
    return {"t": "dict", "items": items}


def _before(obj: Mapping[Any, Any], a: Any, b: Any) -> bool:
    """Whether key ``a`` comes before key ``b`` in ``obj``."""
    for k in obj:
        if k == a and type(k) is type(a):
            return True
        if k == b and type(k) is type(b):
            return False
    return True


def _check_key_text(k: str, where: str) -> None:
    try:
        k.encode("utf-8")
    except UnicodeEncodeError:
        raise UnsupportedLeafError(
            f"dict key {k!r} at {where!r} holds a lone surrogate, which is no text (UTF-8 "
            "cannot encode it, and safetensors readers refuse the file's header); fix the "
            "key") from None


_SURROGATE_PAIR = re.compile("[\ud800-\udbff][\udc00-\udfff]")


def _check_no_surrogate_pair(text: str, where: str) -> None:
    """Refuse a str holding a high surrogate then a low one: the manifest's JSON writes
    the two as escapes that every JSON reader joins into the one character they encode in
    UTF-16, so the string would not come back as saved (a trial's '\\ud83d\\ude00' came
    back as one emoji). A lone surrogate comes back as it is."""
    found = _SURROGATE_PAIR.search(text)
    if found is None:
        return
    joined = found.group().encode("utf-16", "surrogatepass").decode("utf-16")
    raise UnsupportedLeafError(
        f"str at {where!r} holds a UTF-16 surrogate pair ({found.group()!r} at index "
        f"{found.start()}), which a load would give back as the one character it encodes "
        f"({joined!r}), not as the two saved: join such pairs before saving "
        "(s.encode('utf-16', 'surrogatepass').decode('utf-16')), or save the text as bytes")


# str(int) refuses more than 4300 digits (sys.int_info.default_max_str_digits), and a
# manifest writes ints as text: refuse such an int when the tree is flattened, naming
# its path, not when the background writer encodes the manifest.
_MAX_INT_BITS = 14_000  # ~4214 decimal digits


def _huge_int(what: str, value: int) -> str:
    return (f"{what} has {value.bit_length()} bits, more than the {_MAX_INT_BITS} a "
            "checkpoint's metadata holds: save it as bytes (value.to_bytes(...)) or a string "
            "of hex digits")


def _numpy_as_tensor(arr: np.ndarray, where: str, kind: str = "array") -> torch.Tensor:
    if not arr.dtype.isnative:
        raise UnsupportedLeafError(
            f"numpy {kind} at {where!r} has non-native byte order ({arr.dtype.str}); convert it "
            "with arr.astype(arr.dtype.newbyteorder('='))")
    if is_copied(arr):
        # (not ascontiguousarray: numpy calls an array with a negative stride on a
        # dimension of 1, np.array([5.])[::-1], C-contiguous, and returns it as it is)
        arr = np.array(arr, order="C", copy=True)
    try:
        if not arr.flags.writeable:  # (only read, or refused as a target by the loader:
            with warnings.catch_warnings():  # torch's warning would only be noise)
                warnings.filterwarnings("ignore", "The given NumPy array is not writable")
                return torch.from_numpy(arr)
        return torch.from_numpy(arr)
    except TypeError as exc:
        raise UnsupportedLeafError(
            f"numpy {kind} at {where!r} has dtype {arr.dtype}, which has no tensor equivalent: "
            f"only bool, int, uint, float and complex {kind}s can be checkpointed") from exc


def is_copied(arr: np.ndarray) -> bool:
    """Whether a flattened array's tensor is a copy: torch has no negative strides, nor
    strides that are no multiple of the item size (a field of a record array)."""
    # (an item of 0 bytes, np.dtype([]): no copy; torch then refuses its dtype, as any void's)
    return arr.itemsize > 0 and any(s < 0 or s % arr.itemsize for s in arr.strides)


def _add_tensor(t: torch.Tensor, path: str, flat: FlatState, seen: _Seen, kind: str,
                writeable: bool = True) -> str:
    # This runs once per tensor inside save_async: the common case is kept cheap.
    leaf = t
    box = None
    what = "tensor"
    if type(t) not in _PLAIN_TENSOR_TYPES and _is_dtensor(t):
        # What is saved or filled is the local shard, checked below as any tensor is (it
        # has the DTensor's dtype and layout): a wrapper subclass there (FSDP2 over
        # torchao's Float8 or NF4) has no memory at its data pointer, which staging and
        # reads would use. (A state of DTensors pays this path for every tensor.)
        wrapper = t
        t, global_shape, local_box = _dtensor_box()(t, path or "<root>")
        box = (global_shape, local_box)
        what = "the local shard of the DTensor"
    if (type(t) not in _PLAIN_TENSOR_TYPES or t.dtype in _REFUSED_DTYPES
            or t.layout is not _STRIDED or t.is_nested):
        _check_unusual_tensor(t, path, what)
    if t.is_meta:
        raise UnsupportedLeafError(
            f"tensor at {path or '<root>'!r} is on the meta device and holds no data; " + (
                "give it memory first (module.to_empty(device=...), then tie its tied "
                "weights again), or load with state=None and hand the tensors to "
                "module.load_state_dict(..., assign=True) (which makes each a Parameter of "
                "its own: tie tied weights again after it, as module.tie_weights() does)"
                if flat.target else "save the module once its tensors are on a real device"))
    if path == RESERVED_KEY:
        raise UnsupportedLeafError(
            f"a tensor at {RESERVED_KEY!r}: safetensors reserves that name for the file's "
            "metadata (readers would fail on the shard file); rename the key")
    if kind == "numpy":
        # the same array twice (a weight and its tied head kept as arrays) is stored once
        # and comes back as one array; numpy arrays are not tied to tensors that share
        # their memory (a leaf's kind says how it comes back)
        # (a read-only view and a writable array of one memory are not one target: the
        # load refuses the first by its own path, and fills the second)
        tie: Any = ("numpy", t.data_ptr(), writeable) if t.data_ptr() else 0
        empty_shard = False
    elif kind == "torch":
        tie = t.data_ptr()  # empty tensors have no data to share...
        empty_shard = box is not None and t.numel() == 0
        if empty_shard:
            # ...but an empty shard of a DTensor (a rank that holds none of a small tensor)
            # must be tied where the ranks holding data tie it by data pointer, or the
            # ranks disagree on the keys: tie it by its storage.
            tie = ("empty shard", t.untyped_storage()._cdata, t.storage_offset())
    if kind in ("torch", "numpy"):
        if not tie and torch._is_functional_tensor(t):
            # a plain Tensor by its type, with no memory to stage: the copy into the host
            # buffer raised torch's internal assert
            raise UnsupportedLeafError(_functional(f"{what} at {path or '<root>'!r}"))
        if tie:
            met = seen.get(tie)
            if met is None:
                seen[tie] = (t, path)
            else:
                views = met if isinstance(met, _Views) else _Views(*met)
                seen[tie] = views
                # the same memory as another leaf's, seen the same way and standing for
                # the same part of the same global tensor (a DTensor's local shard may
                # also be a plain leaf, or the shard of another placement)
                key = views.find(t, box, flat, empty_shard)
                if key is not None:
                    flat.refs[path] = key
                    if kind == "torch" and leaf is not flat.wrappers.get(key, flat.tensors[key]):
                        flat.aliases[path] = leaf
                    return key
                views.add(t, path, box, flat)
    if path in flat.tensors:  # escaping makes paths unique; never overwrite if it did not
        raise UnsupportedLeafError(f"two leaves of the state tree share the path {path!r}")
    flat.tensors[path] = t
    flat.kinds[path] = kind
    flat.refs[path] = path
    if box is not None:
        flat.boxes[path] = box
        flat.wrappers[path] = wrapper
    return path


class _Views:
    """The leaves seen at one data pointer (a tie): a list while there are few (a weight
    and its transpose), indexed by layout once there are many (thousands of views of
    one buffer made a save n**2: 6 s for 4,000)."""

    __slots__ = ("index", "leaves")
    _FEW = 8

    def __init__(self, t: torch.Tensor, path: str):
        self.leaves = [(t, path)]
        self.index: dict[tuple[Any, ...], str] | None = None

    def find(self, t: torch.Tensor, box: Any, flat: FlatState, empty_ok: bool) -> str | None:
        """The key of an earlier leaf that is the same view as ``t`` (and box), if any."""
        if self.index is None:
            for other, key in self.leaves:
                if _same_view(t, other, empty_ok=empty_ok) and flat.boxes.get(key) == box:
                    return key
            return None
        if not (empty_ok or t.numel() > 0):
            return None
        return self.index.get(_layout(t, box))

    def add(self, t: torch.Tensor, path: str, box: Any, flat: FlatState) -> None:
        """Note a leaf ``find`` found no match for (``box``: its box, not yet in flat)."""
        self.leaves.append((t, path))
        if self.index is None and len(self.leaves) > self._FEW:
            self.index = {}
            for other, key in self.leaves[:-1]:
                self.index.setdefault(_layout(other, flat.boxes.get(key)), key)
        if self.index is not None:
            self.index.setdefault(_layout(t, box), path)


def _layout(t: torch.Tensor, box: Any) -> tuple[Any, ...]:
    """How ``t`` shows its memory (device, dtype, shape, strides, conj/neg bits), and its
    box: equal for two views of one data pointer that are the same view."""
    return (t.device, t.dtype, tuple(t.shape), t.stride(), t.is_conj(), t.is_neg(), box)


def _same_view(a: torch.Tensor, b: torch.Tensor, *, empty_ok: bool = False) -> bool:
    """Whether two tensors at one data pointer show the same elements the same way."""
    return (empty_ok or a.numel() > 0) and _layout(a, None) == _layout(b, None)


_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_STRIDED = torch.strided


def _refused_dtypes() -> frozenset[torch.dtype]:
    """Every torch dtype without a stable byte layout (see _is_bits); made once, as
    _REFUSED_DTYPES (below _is_bits: looked up for every tensor saved)."""
    return frozenset(d for d in vars(torch).values()
                     if isinstance(d, torch.dtype) and _is_bits(dtype_name(d)))


def _refused_dtype(dtype: torch.dtype) -> bool:
    return dtype in _REFUSED_DTYPES


def _check_unusual_tensor(t: torch.Tensor, path: str, what: str = "tensor") -> None:
    """Refuse a tensor whose bytes cannot be saved or filled as they lie in memory.

    ``what`` says which tensor at ``path`` is ``t`` (a DTensor's local shard)."""
    where = path or "<root>"
    if isinstance(t, torch.nn.parameter.UninitializedTensorMixin):  # type: ignore[attr-defined]
        raise UnsupportedLeafError(
            f"{what} at {where!r} is an uninitialized parameter of a lazy module: run one "
            "forward pass (or materialize the module) before saving or loading it")
    if t.is_nested:
        raise UnsupportedLeafError(
            f"{what} at {where!r} is a nested tensor; save its components "
            "(t.unbind()) or a padded tensor (t.to_padded_tensor(0))")
    if t.layout != torch.strided:
        raise UnsupportedLeafError(
            f"{what} at {where!r} has layout {t.layout}; convert it with .to_dense()")
    if t.is_quantized:
        raise UnsupportedLeafError(_quantized(t, f"{what} at {where!r}"))
    if _refused_dtype(t.dtype):
        raise UnsupportedLeafError(
            f"{what} at {where!r} has dtype {t.dtype}, which has no stable byte layout to save")
    if not _is_dtensor(t) and t.numel() > 0 and not t.is_meta and t.data_ptr() == 0:
        raise UnsupportedLeafError(
            f"{what} at {where!r} is a {type(t).__qualname__} that holds no memory of its own "
            "(a wrapper subclass, as torchao's NF4 or Float8 tensors are): save its "
            "component tensors, or a plain tensor of its values")


def _quantized(t: torch.Tensor, what: str) -> str:
    """The refusal of a quantized tensor: its values are integers plus a scale and zero
    point that are no part of its bytes."""
    try:
        per_channel = t.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric,
                                      torch.per_channel_affine_float_qparams)
        params = ("x.q_per_channel_scales(), x.q_per_channel_zero_points() and "
                  "x.q_per_channel_axis()" if per_channel else "x.q_scale() and x.q_zero_point()")
    except RuntimeError:  # (a quantizer of no known scheme)
        params = "its scale and zero point (x.q_scale() and x.q_zero_point(), or q_per_channel_*)"
    return (f"{what} is quantized ({t.dtype}): a checkpoint holds a tensor's bytes, not its "
            f"scale and zero point; save x.int_repr() with {params}, or x.dequantize()")


def _functional(what: str) -> str:
    return (f"{what} is a functionalization wrapper (torch.func.functionalize, or "
            "torch.compile's tracing), which holds no memory of its own: checkpoint "
            "outside the functionalized code, or save its value (torch._sync(x); "
            "torch._from_functional_tensor(x))")


@functools.cache
def _dtensor_box() -> Any:
    from .dist import dtensor_box  # dist imports torch.distributed: only when DTensors appear

    return dtensor_box


def _is_dtensor(t: torch.Tensor) -> bool:
    if type(t) in _DTENSOR_TYPES:
        return True
    if type(t).__name__ == "DTensor" and hasattr(t, "device_mesh"):
        _DTENSOR_TYPES.add(type(t))
        return True
    return False


# The DTensor classes met so far (found by name: torch.distributed is not imported here).
_DTENSOR_TYPES: set[type] = set()


def unflatten(skeleton: Node, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Build a plain tree from a skeleton and loaded tensors (stateful nodes become dicts).

    Two leaves with one storage key come back as the same tensor object, or the same
    array (a review found two arrays over one memory, where tied tensors are one).
    """
    return _build(skeleton, tensors, {})


def _build(node: Node, tensors: Mapping[str, torch.Tensor], arrays: dict[str, Any]) -> Any:
    t = node["t"]
    if t == "tensor":
        return tensors[node["key"]]
    if t == "ndarray":
        key = node["key"]
        got = arrays.get(key)
        if got is None:
            got = arrays[key] = tensors[key].numpy()
        return got
    if t == "npscalar":
        return tensors[node["key"]].numpy()[()]
    if t == "dict":
        return {k: _build(v, tensors, arrays) for k, v in node["items"]}
    if t == "list":
        return [_build(v, tensors, arrays) for v in node["items"]]
    if t == "tuple":
        return tuple(_build(v, tensors, arrays) for v in node["items"])
    if t == "stateful":
        return _build(node["state"], tensors, arrays)
    return scalar_value(node)


# float("nan")'s bits, which a NaN node's "v": "nan" stands for alone; another NaN (-nan,
# a payload) adds "bits", which readers before it ignore (they read float("nan")).
NAN_BITS = "7ff8000000000000"


def _nan_node(x: float) -> Node:
    bits = struct.pack(">d", x).hex()
    return {"t": "float", "v": "nan"} if bits == NAN_BITS else {
        "t": "float", "v": "nan", "bits": bits}


def nan_from_bits(bits: str) -> float:
    """The float of a NaN node's ``bits`` (16 hex digits of its IEEE 754 binary64
    pattern, big-endian); ValueError for a string that is no such pattern of a NaN."""
    if len(bits) != 16 or not all(c in "0123456789abcdefABCDEF" for c in bits):
        raise ValueError(f"{bits!r:.40} is not 16 hex digits")
    x: float = struct.unpack(">d", bytes.fromhex(bits))[0]
    if x == x:
        raise ValueError(f"{bits!r} is the pattern of {x!r}, not of a NaN")
    return x


def scalar_value(node: Node) -> Any:
    """Value of a scalar skeleton node."""
    t = node["t"]
    if t == "none":
        return None
    if t in ("bool", "int", "str"):
        return node["v"]
    if t == "float":
        bits = node.get("bits")
        return float(node["v"]) if bits is None else nan_from_bits(bits)
    if t == "bytes":
        return base64.b64decode(node["v"])
    raise ValueError(f"unknown skeleton node type {t!r}")


ARRAY_NODES = ("tensor", "ndarray", "npscalar")  # the skeleton's kinds of array leaf
SCALAR_NODES = frozenset(("none", "bool", "int", "float", "str", "bytes"))  # of value leaf


def iter_array_nodes(node: Node, path: str = "") -> Iterator[tuple[str, Node]]:
    """Yield (path, node) for every tensor/ndarray/npscalar node of a skeleton."""
    t = node["t"]
    if t in ARRAY_NODES:
        yield path, node
    elif t == "dict":
        for k, v in node["items"]:
            yield from iter_array_nodes(v, join_path(path, k))
    elif t in ("list", "tuple"):
        for i, v in enumerate(node["items"]):
            yield from iter_array_nodes(v, join_path(path, i))
    elif t == "stateful":
        yield from iter_array_nodes(node["state"], path)


def restore_into(target: Any, node: Node, tensors: Mapping[str, torch.Tensor], path: str,
                 flat: FlatState) -> Any:
    """Restore a skeleton into an existing tree, in place where the tree allows.

    ``tensors`` maps storage keys to loaded tensors; where a target tensor was loaded
    in place it *is* that tensor, so identity is kept. Stateful objects receive their
    rebuilt state dict through ``load_state_dict``; dicts and lists are updated in
    place; tuples are rebuilt. Returns the restored value for this position.

    What was not loaded (strict=False skips what either side lacks) keeps the target's
    value: a leaf the checkpoint has but the target lacks is left out, and of two lists
    of different lengths the common prefix is restored, the checkpoint's extra items
    are added while all their arrays were loaded, and the target's extra items are
    kept when they hold arrays (the checkpoint's list wins where only scalars differ).
    """
    if path in flat.statefuls and path != flat.entered:
        obj, sd = flat.statefuls[path]
        inner = node["state"] if node["t"] == "stateful" else node
        own = set(sd) if isinstance(obj, torch.nn.Module) and isinstance(sd, dict) and (
            not loads_fresh(obj)) else None
        restored = restore_into(sd, inner, tensors, path, _without(flat, path))
        if own is not None and isinstance(restored, dict) and len(restored) > len(own):
            # a module refuses keys its state dict lacks; strict loads refused them before
            # reading, so these are what strict=False skips (deleted in place: the dict
            # keeps its _metadata, which modules read for their version)
            for k in [k for k in restored if k not in own]:
                del restored[k]
        try:
            with gc_resumed():  # (the user's code, in a load that pauses the collector)
                obj.load_state_dict(restored)
        except CheckpointCorruptError as exc:  # e.g. RNGState's: say whose state it was
            raise CheckpointCorruptError(f"{path or '<root>'} ({type(obj).__name__}): {exc}",
                                         path=exc.path, key=exc.key) from exc
        except CheckpointError:
            raise
        except Exception as exc:  # its own refusal (param groups differ, unexpected keys)
            where = path or "<root>"
            raise StateMismatchError(
                f"{where} ({type(obj).__name__}).load_state_dict refused the checkpoint's "
                f"state: {type(exc).__name__}: {exc}. The load stopped there, half done: "
                "every tensor loaded in place holds the checkpoint's values, but the objects "
                "and plain values after this one were not restored; load again into a state "
                "that matches the checkpoint's before using any of it",
                mismatched=[where]) from exc
        return obj
    t = node["t"]
    if t == "stateful":
        return restore_into(target, node["state"], tensors, path, flat)
    if t not in ARRAY_NODES and isinstance(target, (torch.Tensor, np.ndarray)) and (
            not flat.checkpoint_only):
        # strict loads refused this (the target's array is missing from the checkpoint);
        # strict=False keeps the target's value rather than drop it for a container or
        # scalar that held nothing the target asked for
        return target
    if t in ARRAY_NODES:
        if path in flat.loaded_in_place and isinstance(target, (torch.Tensor, np.ndarray)):
            # its data (a DTensor's local shard, an array's memory) was loaded; it keeps
            # its own kind even where the checkpoint's was the other (tensor vs array)
            return target
        value = tensors.get(node["key"])
        if value is None:  # skipped: the target has no array here
            return target
        if t == "ndarray":
            return value.numpy()
        if t == "npscalar":
            return value.numpy()[()]
        return value
    if t == "dict":
        if flat.checkpoint_only:
            mine = target if isinstance(target, dict) else {}
            return {k: restore_into(mine.get(k), c, tensors, join_path(path, k), flat)
                    for k, c in node["items"]}
        if isinstance(target, dict):
            for k, child in node["items"]:
                if k in target:
                    target[k] = restore_into(target[k], child, tensors, join_path(path, k), flat)
                elif (not flat.skip_extra or flat.in_state_dict) and _all_present(child, tensors):
                    target[k] = restore_into(None, child, tensors, join_path(path, k), flat)
            return target
        fresh = {k: restore_into(None, c, tensors, join_path(path, k), flat)
                 for k, c in node["items"] if _all_present(c, tensors)}
        # every entry skipped (strict=False: the target had no place for them): keep the
        # target's own value (a None, say) rather than put an empty dict in its place
        return target if node["items"] and not fresh else fresh
    if t in ("list", "tuple"):
        items = node["items"]
        old = list(target) if isinstance(target, (list, tuple)) else []
        common = min(len(old), len(items))
        values = [restore_into(old[i], items[i], tensors, join_path(path, i), flat)
                  for i in range(common)]
        for i in range(common, len(items)):  # the checkpoint's extra items
            if not _all_present(items[i], tensors):
                break  # strict=False skipped it: the items after it would take its index
            values.append(restore_into(None, items[i], tensors, join_path(path, i), flat))
        if len(old) > len(items) and not flat.checkpoint_only and _holds_arrays(
                flat, path, len(items)):
            values += old[len(items):]  # the checkpoint lacks them: strict=False keeps them
        if items and not values and not isinstance(target, (list, tuple)):
            return target  # as for dicts: all skipped, the target keeps its value
        if t == "list" and isinstance(target, list) and not flat.in_state_dict:
            target[:] = values  # the user's list keeps its identity
            return target
        return values if t == "list" else tuple(values)
    return scalar_value(node)


def _holds_arrays(flat: FlatState, path: str, start: int) -> bool:
    """Whether the items from ``start`` on of the target's list at ``path`` hold arrays."""
    prefix = f"{path}/" if path else ""
    for p in flat.refs:
        if p.startswith(prefix):
            seg = p[len(prefix):].partition("/")[0]
            if seg.isascii() and seg.isdigit() and int(seg) >= start:  # not "²"
                return True
    return False


def _without(flat: FlatState, path: str) -> FlatState:
    """A view of ``flat`` in which ``path`` is no longer stateful (to recurse into its
    dict). (Not a copy of the statefuls without it: that made a load of a tree of n
    modules take n**2 time, 104 s for 16,000.)"""
    obj = flat.statefuls[path][0]
    return dataclasses.replace(flat, entered=path, in_state_dict=True,
                               checkpoint_only=takes_whole_state(obj))


def loads_fresh(obj: object) -> bool:
    """Whether ``obj`` asks a load for the checkpoint's state dict alone (a true
    ``_asyncckpt_load_fresh``): its live state is not read (see :func:`flatten`)."""
    return getattr(obj, "_asyncckpt_load_fresh", False) is True


def takes_whole_state(obj: object) -> bool:
    """Whether a load replaces ``obj``'s state dict as a whole (its live moments or
    history are not merged with the checkpoint's): an optimizer, an LR scheduler, or an
    object that asks for the checkpoint's state alone with a true
    ``_asyncckpt_load_fresh`` (see :func:`flatten`). Other objects' state dicts are
    filled like the target tree (what the checkpoint lacks is missing)."""
    return isinstance(obj, (torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler)) or (
        loads_fresh(obj))


def _all_present(node: Node, tensors: Mapping[str, torch.Tensor]) -> bool:
    """True when every array leaf under ``node`` was loaded (strict=False may skip some)."""
    return all(n["key"] in tensors for _, n in iter_array_nodes(node))


def merge_skeletons(skeletons: list[Node], differing: list[str] | None = None) -> Node:
    """Merge the ranks' skeletons: the union of dict keys, earlier skeletons winning
    where values differ (the coordinator's comes first). The paths where a later
    skeleton had another non-tensor value are appended to ``differing``."""
    out = skeletons[0]
    for other in skeletons[1:]:
        out = _merge(out, other, "", differing)
    return out


def _merge(a: Node, b: Node, path: str, differing: list[str] | None) -> Node:
    if a == b:  # the common case for whole subtrees: compared in C
        return a
    if a["t"] == "dict" and b["t"] == "dict":
        items = [list(it) for it in a["items"]]
        index = {(type(k), k): i for i, (k, _) in enumerate(items)}
        for k, v in b["items"]:
            i = index.get((type(k), k))
            if i is None:
                items.append([k, v])
            else:
                items[i][1] = _merge(items[i][1], v, join_path(path, k), differing)
        return {"t": "dict", "items": items}
    if a["t"] == b["t"] == "stateful":
        return {**a, "state": _merge(a["state"], b["state"], path, differing)}
    if a["t"] == b["t"] and a["t"] in ("list", "tuple") and len(a["items"]) == len(b["items"]):
        return {"t": a["t"], "items": [_merge(x, y, join_path(path, i), differing)
                                       for i, (x, y) in enumerate(zip(a["items"], b["items"],
                                                                      strict=True))]}
    if ("key" in a) != ("key" in b):
        # An array on one rank, another value on the other: keeping either loses the
        # other rank's (rank 0's tensor won silently over a later rank's int).
        kinds = f"{a['t']} on one rank, {b['t']} on another"
        raise CheckpointSaveError(
            f"the ranks' state trees disagree at {path or '<root>'!r}: {kinds}; give every "
            "rank a state tree of the same structure (per-rank values under per-rank paths)")
    if differing is not None and a != b and "key" not in a:
        # (a trial's int on two ranks and a dict on the third was told "different
        # values", as two ints would be: the kinds are said where they differ)
        differing.append((path or "<root>") if a["t"] == b["t"] else
                         f"{path or '<root>'} ({_kind_text(a)} on one rank, {_kind_text(b)} "
                         "on another)")
    return a


def _kind_text(node: Node) -> str:
    """What kind of value a skeleton node is, for a message: 'int', 'a dict'..."""
    t = str(node["t"])
    return {"dict": "a dict", "list": "a list", "tuple": "a tuple", "stateful": "an object's "
            "state", "none": "None"}.get(t, t)


# --- RNG state -----------------------------------------------------------------------------

def capture_rng_state() -> dict[str, Any]:
    """Capture the Python, NumPy, torch CPU and (when present) CUDA generators' states.

    Example:
        >>> state = {"model": model, "rng": capture_rng_state()}
    """
    version, mt, gauss = random.getstate()
    out: dict[str, Any] = {
        # one int64 tensor rather than 625 scalars in the manifest
        "python": (version, torch.tensor(mt, dtype=torch.int64), gauss),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        out["cuda"] = list(torch.cuda.get_rng_state_all())
    return out


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Restore generator states captured by :func:`capture_rng_state` (e.g. loaded back),
    or this rank's from what an :class:`RNGState` saved.

    Every part is checked before any generator is set: a malformed one raises
    CheckpointCorruptError naming it, and the generators keep their state.
    """
    try:
        if isinstance(state, Mapping) and "ranks" in state:
            RNGState().load_state_dict(state)
            return
        _set_rng_state(_checked_rng_state(state, "", given=True))
    except CheckpointCorruptError as exc:
        # (what it was given may come from a checkpoint, or be made by hand: a trial's was
        # told its "checkpoint" was corrupt)
        add_note(exc, "restore_rng_state takes what capture_rng_state() returns (or an "
                      "RNGState's state dict), as loaded back from a checkpoint")
        raise


# What a malformed generator state makes the conversions and setters below raise.
_RNG_ERRORS = (KeyError, IndexError, TypeError, ValueError, RuntimeError, OverflowError,
               AttributeError)


@dataclass(frozen=True)
class _RNGParts:
    python_state: tuple[Any, ...]
    numpy_state: tuple[Any, ...]
    cpu_state: torch.Tensor
    cuda_states: list[torch.Tensor] | None


def _checked_rng_state(state: Any, where: str, given: bool = False) -> _RNGParts:
    """The generator states of ``state``, each tried on a scratch generator first.

    ``where`` names ``state`` within an RNGState's state dict (e.g. ``ranks/0/``);
    ``given``: handed to restore_rng_state, maybe made by hand, not loaded by a load.
    """
    part = ""
    try:
        if not isinstance(state, Mapping):
            raise TypeError(f"got {type(state).__name__}, not a dict of generator states")
        part = "python"
        py = state["python"]
        mt = py[1].tolist() if isinstance(py[1], torch.Tensor) else list(py[1])
        py_state = (py[0], tuple(int(x) for x in mt), py[2])
        random.Random().setstate(py_state)
        part = "numpy"
        npst = state["numpy"]
        np_state = (npst[0], np.asarray(npst[1]), *npst[2:])
        np.random.RandomState().set_state(np_state)
        part = "torch"
        cpu = torch.as_tensor(state["torch"]).to("cpu", torch.uint8)
        torch.Generator().set_state(cpu)
        cuda = None
        if "cuda" in state and not torch.cuda.is_available() and not (
                isinstance(state["cuda"], (list, tuple)) and not state["cuda"]):
            # (a trial's GPU run resumed on a CPU machine: the part went without a word)
            log.warning("the %s generator state%s holds CUDA generators, which are not "
                        "restored: this process has no CUDA device",
                        "given" if given else "saved", f" {where}".rstrip("/ ") if where
                        else "")
        if "cuda" in state and torch.cuda.is_available():
            part = "cuda"
            cuda = [torch.as_tensor(s).cpu() for s in state["cuda"]]
            if any(s.dtype != torch.uint8 or s.dim() != 1 for s in cuda):
                raise TypeError("each device's state must be a 1-D uint8 tensor")
    except _RNG_ERRORS as exc:
        what = f"{where}{part}".rstrip("/")
        raise CheckpointCorruptError(
            f"the {'given' if given else 'saved'} generator state"
            f"{' ' + what if what else ''} is malformed ({type(exc).__name__}: "
            f"{str(exc)[:200]}): "
            + ("" if given else "the checkpoint is corrupt; ")
            + "no generator was changed") from exc
    return _RNGParts(py_state, np_state, cpu, cuda)


def _set_rng_state(parts: _RNGParts) -> None:
    if parts.cuda_states is not None:  # first: a machine with fewer devices may refuse it
        torch.cuda.set_rng_state_all(parts.cuda_states)
    random.setstate(parts.python_state)
    np.random.set_state(parts.numpy_state)
    torch.set_rng_state(parts.cpu_state)


def _group_size() -> int:
    """The default process group's size; 1 without one."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class RNGState:
    """A stateful leaf that captures RNG state on save and restores it on load.

    Put one in the state tree: ``{"model": model, "rng": RNGState()}``. Under
    torch.distributed every rank's generators are saved under its own rank (``rank``,
    by default the rank in the default process group), and each rank restores its own.
    Generators saved by one process (or fetched from one peer) are restored whatever
    the rank; a rank that a checkpoint of several has none for (a larger world size)
    keeps its generators as they are, with a warning. Not thread-safe: it reads and
    sets process-global generators.
    """

    # A load hands this object the checkpoint's generators as they are (every rank's
    # entry that was saved, never mixed with this process's current ones).
    _asyncckpt_load_fresh = True

    def __init__(self, rank: int | None = None):
        # (a trial's rank="a" and -1 saved, and no rank found its generators again)
        if rank is not None and (isinstance(rank, (bool, np.bool_))
                                 or not isinstance(rank, (int, np.integer)) or rank < 0):
            raise CheckpointConfigError(
                f"RNGState(rank={rank!r:.40}): pass the rank as a non-negative int, or None "
                "for the rank in the default process group")
        self.rank = None if rank is None else int(rank)

    def _rank(self) -> int:
        if self.rank is not None:
            return self.rank
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def state_dict(self) -> dict[str, Any]:
        return {"ranks": {self._rank(): capture_rng_state()}}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore this rank's generators; CheckpointCorruptError, with every generator
        left as it was, when any part of their saved state is malformed."""
        if not isinstance(state_dict, Mapping) or "ranks" not in state_dict:
            # Saved before generators were kept per rank (asyncckpt before 2026-11-22): a
            # group's save kept one rank's generators, and every rank now gets those.
            _set_rng_state(_checked_rng_state(state_dict, ""))
            if _group_size() > 1 or (self.rank or 0) > 0:
                log.warning("RNGState: this checkpoint holds one set of generators for every "
                            "rank (an asyncckpt from before 2026-11-22 saved it so): rank %d "
                            "now has that one's state, not the one it saved; its random "
                            "draws differ from an uninterrupted run", self._rank())
            return
        ranks = state_dict["ranks"]
        if not isinstance(ranks, Mapping):
            raise CheckpointCorruptError(
                f"the saved generator state ranks is a {type(ranks).__name__}, not a dict of "
                "ranks: the checkpoint is corrupt; no generator was changed")
        rank = self._rank()
        if rank not in ranks and len(ranks) == 1:  # one process's (or a peer's): take it
            rank = next(iter(ranks))
        if rank not in ranks:
            log.warning("RNGState: the checkpoint holds the generators of ranks %s, not of "
                        "rank %d: its generators keep their current state", sorted(ranks), rank)
            return
        _set_rng_state(_checked_rng_state(ranks[rank], f"ranks/{rank}/"))


_REFUSED_DTYPES = _refused_dtypes()
