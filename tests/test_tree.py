"""flatten / unflatten of state trees, aliasing, unsupported leaves, statefuls and RNG state."""

from __future__ import annotations

import collections
import collections.abc
import enum
import io
import json
import math
import random
import re
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import asyncckpt
from _torch_compat import dtensor_api
from asyncckpt import UnsupportedLeafError
from asyncckpt.tree import (
    RNGState,
    Stateful,
    capture_rng_state,
    escape_key,
    flatten,
    is_copied,
    merge_skeletons,
    restore_into,
    restore_rng_state,
    unflatten,
)


def roundtrip(state, *, via_json=True, clone=True):
    """flatten -> (skeleton through JSON, as a manifest does) -> unflatten."""
    flat = flatten(state)
    skeleton = json.loads(json.dumps(flat.skeleton)) if via_json else flat.skeleton
    tensors = {k: v.clone() for k, v in flat.tensors.items()} if clone else flat.tensors
    return flat, unflatten(skeleton, tensors)


@pytest.mark.parametrize(("a", "b"), [
    ({0: 1}, {"0": 1}),
    ((1,), [1]),
    ({"a": 1, "b": 2}, {"b": 2, "a": 1}),
    (-0.0, 0.0),
    (1, True),
    (float("nan"), 1.0),
    (torch.tensor([float("nan")]), torch.tensor([-float("nan")])),
    (torch.zeros(2), torch.zeros(2, dtype=torch.float64)),
    (torch.zeros(2, 1), torch.zeros(1, 2)),
    (np.zeros(2, np.float32), np.zeros(2, np.float64)),
    (np.float32(1), np.float64(1)),
    (np.zeros(1), torch.zeros(1, dtype=torch.float64)),
])
def test_comparison_helper_is_strict(a, b, same):
    with pytest.raises(AssertionError):
        same(a, b)


def test_comparison_helper_accepts_nan_and_equal_trees(same):
    same({"x": [float("nan"), torch.tensor([float("nan")])]},
         {"x": [float("nan"), torch.tensor([float("nan")])]})


# --- scalars and containers ------------------------------------------------------------------

def test_nested_containers_keep_key_types_and_container_types(same):
    state = {
        "a": {1: "one", "1x": 2, -7: [None, True, False]},
        "tup": (1, (2.5, "x"), []),
        "list": [[], {}, ()],
        3: {"deep": {"deeper": {0: b"\x00\xff"}}},
    }
    _, back = roundtrip(state)
    same(state, back)
    assert list(back["a"]) == [1, "1x", -7]
    assert type(next(iter(back["a"]))) is int
    assert type(back["tup"]) is tuple and type(back["tup"][1]) is tuple
    assert type(back["list"][2]) is tuple


@pytest.mark.parametrize("value", [
    0, -1, 2**70, -(2**65), 1.5, 1e-310, 1e308, float("inf"), float("-inf"), 0.0, -0.0, True,
    False, None, "", "unicode: \u00e9\u4e2d\U0001f600 \\ \" \n", b"", b"\x00\x01\xfe"])
def test_scalar_leaves_roundtrip_exactly(value, same):
    _, back = roundtrip({"v": value, "in_list": [value], "in_tuple": (value,)})
    same({"v": value, "in_list": [value], "in_tuple": (value,)}, back)


def test_float_specials_keep_sign_and_bits():
    state = {"nan": float("nan"), "negzero": -0.0, "poszero": 0.0, "inf": math.inf,
             "tiny": 5e-324, "third": 1 / 3}
    _, back = roundtrip(state)
    assert math.isnan(back["nan"])
    assert math.copysign(1.0, back["negzero"]) == -1.0
    assert math.copysign(1.0, back["poszero"]) == 1.0
    assert back["inf"] == math.inf
    for k in ("tiny", "third"):
        assert back[k].hex() == state[k].hex()


def test_bool_is_not_turned_into_int():
    _, back = roundtrip({"t": True, "i": 1})
    assert back["t"] is True
    assert type(back["i"]) is int


def test_bytes_and_str_stay_distinct():
    _, back = roundtrip({"b": b"abc", "s": "abc"})
    assert type(back["b"]) is bytes and type(back["s"]) is str


def test_numpy_arrays_and_scalars_roundtrip(same):
    state = {
        "f32": np.arange(6, dtype=np.float32).reshape(2, 3),
        "u64": np.array([0, 2**64 - 1], dtype=np.uint64),
        "b": np.array([True, False]),
        "c128": np.array([1 + 2j, np.nan], dtype=np.complex128),
        "zero_d": np.array(3.5),
        "empty": np.zeros((0, 4), dtype=np.int16),
        "strided": np.arange(12, dtype=np.int32).reshape(3, 4)[:, ::2],
        "reversed": np.arange(5, dtype=np.int64)[::-1],
        "s_f64": np.float64(-0.0),
        "s_i8": np.int8(-5),
        "s_bool": np.bool_(True),
        "s_f16": np.float16(1.5),
        "s_c64": np.complex64(1 - 1j),
    }
    _, back = roundtrip(state)
    same(state, back)
    assert type(back["s_f64"]) is np.float64 and math.copysign(1, back["s_f64"]) == -1
    assert isinstance(back["zero_d"], np.ndarray) and back["zero_d"].shape == ()


def test_numpy_leaves_get_their_kind():
    flat = flatten({"a": np.zeros(2), "s": np.int32(4), "t": torch.zeros(2)})
    assert flat.kinds == {"a": "numpy", "s": "numpy_scalar", "t": "torch"}


# --- paths ------------------------------------------------------------------------------------

def test_paths_join_keys_with_slashes():
    flat = flatten({"model": {"layers.0.weight": torch.ones(1)}, "optim": {"state": {0: {
        "exp_avg": torch.ones(1)}}}, "lst": [torch.ones(1), (torch.ones(1),)]})
    assert set(flat.tensors) == {"model/layers.0.weight", "optim/state/0/exp_avg", "lst/0",
                                 "lst/1/0"}


def test_slash_and_percent_in_keys_do_not_collide(same):
    tensors = [torch.full((1,), float(i)) for i in range(7)]
    state = {
        "a/b": tensors[0],
        "a": {"b": tensors[1]},
        "a%2Fb": tensors[2],
        "%": tensors[3],
        "%25": tensors[4],
        "%2F": tensors[5],
        "/": tensors[6],
    }
    flat, back = roundtrip(state)
    assert len(flat.tensors) == 7
    assert len(set(flat.refs.values())) == 7
    same(state, back)


@pytest.mark.parametrize("key", ["", "a", "/", "%", "%2F", "a/b%c", "%%//", 0, -3, 17])
def test_escape_key_is_injective_and_slash_free(key):
    seg = escape_key(key)
    assert "/" not in seg
    others = ["", "a", "/", "%", "%2F", "%25", "a/b%c", "%%//", "0", "-3", "17", "a%2Fb%25c"]
    for other in others:
        if str(other) != str(key):
            assert escape_key(other) != seg


@pytest.mark.parametrize("state, where", [
    ({0: 1, "0": 2}, "<root>"),
    ({"x": {"y": {7: torch.ones(1), "7": torch.ones(1)}}}, "x/y"),
    ({"x": [{-1: None, "-1": None}]}, "x/0"),
])
def test_int_and_str_key_naming_one_path_raise(state, where):
    with pytest.raises(UnsupportedLeafError) as info:
        flatten(state)
    assert where in str(info.value)


class _IntKeyed(collections.abc.Mapping):  # a mapping whose lookups take ints only
    def __init__(self, d):
        self._d = d

    def __getitem__(self, k):
        if type(k) is not int:
            raise TypeError("int keys only")
        return self._d[k]

    def __iter__(self):
        return iter(self._d)

    def __len__(self):
        return len(self._d)


@pytest.mark.parametrize("state, told", [
    ({0: 1, "0": 2}, "keys 0 and '0'"),
    ({"0": 1, 0: 2}, "keys '0' and 0"),
    ({"x": collections.OrderedDict([("-5", torch.ones(1)), (-5, torch.ones(1))])},
     "keys '-5' and -5"),
])
def test_key_collision_names_both_keys_in_their_order(state, told):
    with pytest.raises(UnsupportedLeafError, match="name the same path; rename one") as info:
        flatten(state)
    assert told in str(info.value)


def test_keys_that_only_escape_alike_do_not_collide(same):
    """An escaped key holds a "%", which no plain key nor int does: ``"a/b"``, ``"a%2Fb"``
    (escaped too), ``"1"`` and ``2`` are four paths; a mapping that takes only ints is
    not asked for a str key."""
    state = {"a/b": torch.ones(1), "a%2Fb": torch.zeros(1), "1": torch.ones(2), 2: 3,
             "m": _IntKeyed({4: torch.ones(3), 5: 6})}
    flat, _ = roundtrip(state)
    assert sorted(flat.tensors) == ["1", "a%252Fb", "a%2Fb", "m/4"]


def test_empty_string_key_at_root_does_not_collide(same, tmp_path):
    """``{"": [t]}`` must not name the same path as ``{"0": t}``: the empty key is saved
    (as ``%00``), and the state comes back whole, through a real checkpoint too."""
    state = {"": [torch.ones(2)], "0": torch.zeros(2)}
    flat, back = roundtrip(state)
    assert sorted(flat.tensors) == ["%00/0", "0"]
    same(state, back)
    asyncckpt.save(state, tmp_path, step=1)
    same(state, asyncckpt.load(tmp_path))


def test_empty_string_key_below_root_roundtrips(same):
    state = {"a": {"": torch.ones(2), "x": [torch.zeros(1)]}, "b": {"": {"": torch.ones(1)}}}
    flat, back = roundtrip(state)
    assert len(flat.tensors) == 3
    same(state, back)


def test_root_tensor_and_root_list():
    t = torch.arange(3.0)
    flat, back = roundtrip(t)
    assert torch.equal(back, t)
    flat, back = roundtrip([t, t + 1])
    assert set(flat.tensors) == {"0", "1"}
    assert torch.equal(back[1], t + 1)


# --- unsupported leaves -----------------------------------------------------------------------

class _Opaque:
    pass


@pytest.mark.filterwarnings("ignore::UserWarning")  # quantized/CSR creation warns
@pytest.mark.parametrize("bad", [
    pytest.param(lambda: object(), id="object"),
    pytest.param(lambda: {1, 2}, id="set"),
    pytest.param(lambda: frozenset(), id="frozenset"),
    pytest.param(lambda: _Opaque(), id="custom-object"),
    pytest.param(lambda: {1.5: "x"}, id="float-key"),
    pytest.param(lambda: {(1, 2): "x"}, id="tuple-key"),
    pytest.param(lambda: {True: "x"}, id="bool-key"),
    pytest.param(lambda: 1 + 2j, id="complex-scalar"),
    pytest.param(lambda: bytearray(b"x"), id="bytearray"),
    pytest.param(lambda: torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.qint8),
                 id="quantized"),
    pytest.param(lambda: torch.eye(3).to_sparse(), id="sparse-coo"),
    pytest.param(lambda: torch.eye(3).to_sparse_csr(), id="sparse-csr"),
    pytest.param(lambda: torch.empty(3, device="meta"), id="meta"),
    pytest.param(lambda: torch.empty(2, dtype=torch.bits8), id="bits8"),
    pytest.param(lambda: torch.empty(2, dtype=torch.uint4), id="uint4"),
    pytest.param(lambda: np.array([object()], dtype=object), id="numpy-object"),
    pytest.param(lambda: np.array(["a"]), id="numpy-str"),
    pytest.param(lambda: np.arange(3, dtype=">i4"), id="numpy-big-endian"),
    pytest.param(lambda: np.datetime64("2020-01-01"), id="numpy-datetime-scalar"),
])
def test_unsupported_leaf_names_its_path(bad):
    state = {"outer": {"inner": [0, bad()]}}
    with pytest.raises(UnsupportedLeafError) as info:
        flatten(state)
    assert isinstance(info.value, TypeError)
    assert isinstance(info.value, asyncckpt.CheckpointError)
    assert " at 'outer/inner/1'" in str(info.value)  # the whole path, quoted: to the leaf


def test_a_dataclass_leaf_is_told_how_to_save_it():
    """A trial's run config (a dataclass) was refused without a word of asdict."""
    import dataclasses

    @dataclasses.dataclass
    class Cfg:
        lr: float = 0.1
        betas: tuple[float, float] = (0.9, 0.99)

    with pytest.raises(UnsupportedLeafError, match=r"at 'cfg'.*save dataclasses\.asdict\(x\) "
                       r".*rebuild it with .*Cfg\(\*\*d\)"):
        flatten({"cfg": Cfg()})
    _, back = roundtrip({"cfg": dataclasses.asdict(Cfg())})  # (the advice round-trips)
    assert Cfg(**back["cfg"]) == Cfg()


def test_unsupported_root_says_root():
    with pytest.raises(UnsupportedLeafError, match="<root>"):
        flatten(object())


def test_cycles_raise():
    d: dict = {"x": 1}
    d["self"] = d
    with pytest.raises(UnsupportedLeafError, match="cycle"):
        flatten(d)
    lst: list = []
    lst.append([lst])
    with pytest.raises(UnsupportedLeafError, match="cycle"):
        flatten({"l": lst})


def test_shared_subtree_is_not_a_cycle(same):
    shared = [1, 2, {"k": "v"}]
    state = {"a": shared, "b": shared, "c": (shared,)}
    _, back = roundtrip(state)
    same(state, back)


# --- aliasing ---------------------------------------------------------------------------------

def test_tied_tensor_is_stored_once():
    w = torch.randn(4, 3)
    flat = flatten({"emb": {"weight": w}, "head": {"weight": w}, "again": w.view(4, 3)})
    assert len(flat.tensors) == 1
    (key,) = flat.tensors
    assert flat.refs == {"emb/weight": key, "head/weight": key, "again": key}
    back = unflatten(flat.skeleton, flat.tensors)
    assert back["emb"]["weight"] is back["head"]["weight"] is back["again"]


def test_detached_views_of_one_parameter_are_tied():
    p = torch.nn.Parameter(torch.randn(5))
    flat = flatten({"a": p.detach(), "b": p.detach(), "c": p})
    assert len(flat.tensors) == 1


@pytest.mark.parametrize("views", [
    pytest.param(lambda t: (t[0], t[1]), id="rows"),
    pytest.param(lambda t: (t, t.T), id="transpose"),
    pytest.param(lambda t: (t, t.reshape(-1)), id="reshape"),
    pytest.param(lambda t: (t[:, :2], t[:, 1:]), id="overlapping-slices"),
    pytest.param(lambda t: (t, t.view(torch.int32)), id="dtype-view"),
    pytest.param(lambda t: (t[0], t[0].clone()), id="clone"),
])
def test_different_views_of_one_storage_are_different_keys(views, same):
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    a, b = views(base)
    flat, back = roundtrip({"a": a, "b": b})
    assert len(flat.tensors) == 2
    assert flat.refs == {"a": "a", "b": "b"}
    same({"a": a, "b": b}, back)


def test_conjugate_view_is_not_tied_to_its_base():
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    flat = flatten({"a": z, "b": z.conj()})
    assert len(flat.tensors) == 2


def test_empty_tensors_are_never_aliased():
    e = torch.empty(0, 3)
    flat = flatten({"a": e, "b": e, "c": e[:0], "d": torch.empty(0)})
    assert len(flat.tensors) == 4
    assert flat.refs == {p: p for p in "abcd"}


def test_one_numpy_array_twice_is_one_tensor_but_not_one_with_a_tensor_or_a_view():
    arr = np.arange(4.0)
    flat = flatten({"a": arr, "b": arr, "v": arr[1:], "r": arr.reshape(2, 2),
                    "t": torch.from_numpy(arr), "e": np.zeros(0), "f": np.zeros(0)})
    assert flat.refs["b"] == "a" and sorted(flat.tensors) == ["a", "e", "f", "r", "t", "v"]
    assert flat.kinds["a"] == "numpy" and flat.kinds["t"] == "torch"


def test_numpy_arrays_are_recorded_and_negative_strides_copied():
    arr = np.arange(6.0)
    rev = arr[::-1]
    flat = flatten({"a": arr, "r": rev, "s": np.float32(1), "t": torch.zeros(1)})
    assert set(flat.arrays) == {"a", "r"}
    assert flat.arrays["a"] is arr and flat.arrays["r"] is rev
    assert not is_copied(arr) and is_copied(rev) and is_copied(np.zeros((2, 3))[:, ::-1])
    assert np.shares_memory(flat.tensors["a"].numpy(), arr)
    assert not np.shares_memory(flat.tensors["r"].numpy(), arr)
    assert flat.tensors["r"].tolist() == rev.tolist()


def _restore(saved, target, keys):
    """restore_into ``target`` from ``saved``'s skeleton with only ``keys`` loaded (as fresh
    tensors: not in place, so a restored leaf becomes the loaded tensor)."""
    src, flat = flatten(saved), flatten(target)
    tensors = {k: v for k, v in src.tensors.items() if k in keys}
    return restore_into(target, json.loads(json.dumps(src.skeleton)), tensors, "", flat)


def _ids(items):
    return [id(x) for x in items]


def test_restore_into_lists_of_different_lengths():
    t0, t1, a, b = torch.ones(1), torch.ones(1) * 2, torch.zeros(1), torch.zeros(1)
    # the checkpoint's extra item was skipped (strict=False): left out, no KeyError
    lst = [a]
    assert _restore({"l": [t0, t1]}, {"l": lst}, {"l/0"})["l"] is lst
    assert _ids(lst) == _ids([t0])
    # ... or loaded (a lenient stateful passes it through): added
    lst = [a]
    _restore({"l": [t0, t1]}, {"l": lst}, {"l/0", "l/1"})
    assert _ids(lst) == _ids([t0, t1])
    # an item after a skipped one is not shifted into its place
    lst = []
    _restore({"l": [t0, t1, 3]}, {"l": lst}, {"l/1"})
    assert lst == []
    # the target's extra items hold arrays the checkpoint lacks: kept, in place
    c = {"c": 1}
    lst = [a, b, c]
    assert _restore({"l": [t0]}, {"l": lst}, {"l/0"})["l"] is lst
    assert _ids(lst) == _ids([t0, b, c])
    tup = _restore((t0,), (a, b), {"0"})
    assert type(tup) is tuple and _ids(tup) == _ids([t0, b])
    # only scalars differ: the checkpoint's list wins, as it always did
    lst = [5, 6, 7]
    assert _restore({"l": [1]}, {"l": lst}, set())["l"] is lst and lst == [1]
    # a leaf the target lacks keeps the target's value
    assert _restore({"l": [t0], "d": {"x": t1}}, {"l": [5], "d": {"x": None}}, set()) == {
        "l": [5], "d": {"x": None}}


# --- statefuls --------------------------------------------------------------------------------

class Counter:
    def __init__(self):
        self.count = 0
        self.buf = torch.zeros(3)
        self.loaded = None

    def state_dict(self):
        return {"count": self.count, "buf": self.buf}

    def load_state_dict(self, sd):
        self.loaded = sd


def test_stateful_protocol_recognises_modules_optimizers_and_custom_classes():
    m = torch.nn.Linear(2, 2)
    assert isinstance(m, Stateful)
    assert isinstance(torch.optim.SGD(m.parameters(), lr=0.1), Stateful)
    assert isinstance(Counter(), Stateful)
    assert not isinstance(object(), Stateful)


def test_module_flattens_through_state_dict(same):
    m = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    flat = flatten({"model": m})
    assert set(flat.tensors) == {f"model/{k}" for k in m.state_dict()}
    assert flat.skeleton["items"][0][1]["t"] == "stateful"
    assert "model" in flat.statefuls and flat.statefuls["model"][0] is m
    back = unflatten(json.loads(json.dumps(flat.skeleton)), flat.tensors)
    assert isinstance(back["model"], dict)
    assert set(back["model"]) == set(m.state_dict())
    for k, v in m.state_dict().items():
        assert torch.equal(back["model"][k], v)
    # the BatchNorm step counter is an int64 tensor, kept as such
    assert back["model"]["1.num_batches_tracked"].dtype == torch.int64


def test_optimizer_flattens_with_int_state_keys():
    m = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    m(torch.randn(4, 3)).sum().backward()
    opt.step()
    flat = flatten({"optim": opt})
    assert "optim/state/0/exp_avg" in flat.tensors
    assert "optim/state/1/exp_avg_sq" in flat.tensors
    back = unflatten(json.loads(json.dumps(flat.skeleton)), flat.tensors)
    assert set(back["optim"]["state"]) == {0, 1}
    assert all(type(k) is int for k in back["optim"]["state"])
    assert back["optim"]["param_groups"][0]["params"] == [0, 1]
    assert type(back["optim"]["param_groups"][0]["betas"]) is tuple


def test_custom_stateful_flattens_through_state_dict():
    c = Counter()
    c.count = 5
    flat = flatten({"c": c})
    assert set(flat.tensors) == {"c/buf"}
    assert flat.tensors["c/buf"] is c.buf
    back = unflatten(flat.skeleton, flat.tensors)
    assert back == {"c": {"count": 5, "buf": c.buf}}


def test_stateful_state_dict_is_checked_for_bad_leaves():
    class Bad(Counter):
        def state_dict(self):
            return {"ok": 1, "bad": object()}

    with pytest.raises(UnsupportedLeafError, match="s/bad"):
        flatten({"s": Bad()})


# --- RNG state --------------------------------------------------------------------------------

def _draw():
    return ([random.random() for _ in range(5)], np.random.rand(5).tolist(),
            torch.rand(5).tolist(), torch.randn(3).tolist(), np.random.randn(3).tolist(),
            random.gauss(0, 1))


def test_capture_and_restore_rng_state_replays_every_generator():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.randn()  # leaves a cached gaussian in numpy's state
    state = capture_rng_state()
    first = _draw()
    restore_rng_state(state)
    assert _draw() == first


def test_rng_state_survives_flatten_json_unflatten():
    random.seed(11)
    state = capture_rng_state()
    _, back = roundtrip({"rng": state})
    first = _draw()
    restore_rng_state(back["rng"])
    assert _draw() == first


def test_rng_state_object_is_a_stateful_leaf():
    rng = RNGState()
    assert isinstance(rng, Stateful)
    flat = flatten({"rng": rng})
    assert "rng/ranks/0/torch" in flat.tensors
    first = _draw()
    back = unflatten(json.loads(json.dumps(flat.skeleton)),
                     {k: v.clone() for k, v in flat.tensors.items()})
    RNGState().load_state_dict(back["rng"])
    assert _draw() == first


def test_rng_state_of_the_old_layout_still_restores(caplog):
    old = capture_rng_state()  # what RNGState.state_dict() returned before per-rank entries
    first = _draw()
    with caplog.at_level("WARNING"):
        RNGState().load_state_dict(old)
    assert _draw() == first
    assert caplog.text == ""  # one process: it is this process's state


def test_rng_state_of_the_old_layout_in_a_group_warns_it_is_one_ranks(caplog):
    # A group's save of the old layout kept one set of generators for every rank; each
    # rank restored it without a word, its draws no longer its own.
    old = capture_rng_state()
    first = _draw()
    with caplog.at_level("WARNING"):
        RNGState(rank=1).load_state_dict(old)
    assert _draw() == first  # restored, as before: a resume still goes on
    assert "one set of generators for every rank" in caplog.text and "rank 1" in caplog.text


def test_each_rank_restores_its_own_generators(tmp_path, caplog):
    import asyncckpt

    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    r0 = RNGState(rank=0).state_dict()
    want0 = _draw()
    random.seed(6)
    np.random.seed(6)
    torch.manual_seed(6)
    r1 = RNGState(rank=1).state_dict()
    want1 = _draw()
    both = {"rng": {"ranks": {**r0["ranks"], **r1["ranks"]}}}
    asyncckpt.save(both, tmp_path / "ck")
    for rank, want in ((1, want1), (0, want0)):
        asyncckpt.load(tmp_path / "ck", {"rng": RNGState(rank=rank)})
        assert _draw() == want, rank
    # a rank the checkpoint has nothing for (a larger world): not missing, left as it is
    torch.manual_seed(9)
    random.seed(9)
    np.random.seed(9)
    with caplog.at_level("WARNING"):
        asyncckpt.load(tmp_path / "ck", {"rng": RNGState(rank=2)})
    assert "not of rank 2" in caplog.text
    torch.manual_seed(9)
    random.seed(9)
    np.random.seed(9)
    unchanged = _draw()
    torch.manual_seed(9)
    random.seed(9)
    np.random.seed(9)
    asyncckpt.load(tmp_path / "ck", {"rng": RNGState(rank=2)})
    assert _draw() == unchanged


def test_merged_skeletons_report_the_non_tensor_values_ranks_disagree_on():
    a = flatten({"step": 3, "pos": 10, "w": torch.ones(2), "l": [1, 2]}).skeleton
    b = flatten({"step": 3, "pos": 11, "w": torch.ones(2), "l": [1, 5]}).skeleton
    differing: list[str] = []
    merged = merge_skeletons([a, b], differing)
    assert differing == ["pos", "l/1"]
    assert merged == a
    # (a trial's int on one rank and a dict on another was told "different values" alone)
    kinds: list[str] = []
    merge_skeletons([a, flatten({"step": {"n": 3}, "pos": None, "w": torch.ones(2),
                                 "l": [1, 2]}).skeleton], kinds)
    assert kinds == ["step (int on one rank, a dict on another)",
                     "pos (int on one rank, None on another)"]
    # (distributed trial) three ranks, two of them apart at one path: said once
    from asyncckpt.dist import merged_skeleton

    c = flatten({"step": 3, "pos": 12, "w": torch.ones(2), "l": [1]}).skeleton
    with pytest.raises(asyncckpt.CheckpointSaveError) as info:
        merged_skeleton([a, b, c], 1, 0, strict=True)
    assert "values at 'pos', 'l/1', 'l'," in str(info.value), info.value


def test_merged_skeletons_refuse_an_array_on_one_rank_and_a_value_on_another():
    """Rank 0's tensor won silently over a later rank's int (the reverse was refused)."""
    from asyncckpt.errors import CheckpointSaveError

    tensor = flatten({"a": 1, "x": torch.ones(2)}).skeleton
    for other, kind in (({"a": 1, "x": 5}, "int"), ({"a": 1, "x": {"n": 5}}, "dict"),
                        ({"a": 1, "x": None}, "none")):
        value = flatten(other).skeleton
        for pair, kinds in (([tensor, value], f"tensor on one rank, {kind} on another"),
                            ([value, tensor], f"{kind} on one rank, tensor on another")):
            with pytest.raises(CheckpointSaveError, match=f"disagree at 'x': {kinds}"):
                merge_skeletons(pair, [])
    # two arrays of another kind (a tensor, a numpy array) still merge: rank 0's wins
    arr = flatten({"a": 1, "x": np.ones(2)}).skeleton
    assert merge_skeletons([tensor, arr], []) == tensor


# --- property: any random state tree round-trips exactly ----------------------------------------

_TORCH_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                 torch.uint16, torch.uint32, torch.uint64, torch.float16, torch.bfloat16,
                 torch.float32, torch.float64, torch.complex64, torch.complex128,
                 torch.float8_e4m3fn, torch.float8_e5m2]
_NP_DTYPES = [np.bool_, np.int8, np.uint16, np.int32, np.uint64, np.float16, np.float32,
              np.float64, np.complex64]


@st.composite
def small_tensors(draw):
    dtype = draw(st.sampled_from(_TORCH_DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    n = math.prod(shape) * dtype.itemsize
    data = bytearray(draw(st.binary(min_size=n, max_size=n)))
    raw = torch.frombuffer(data, dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
    if dtype == torch.bool:
        raw = raw & 1
    t = raw.view(dtype).reshape(shape)
    if draw(st.booleans()) and t.dim() >= 2:
        t = t.transpose(0, 1)  # a non-contiguous leaf
    return t


@st.composite
def small_arrays(draw):
    dtype = np.dtype(draw(st.sampled_from(_NP_DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
    n = math.prod(shape) * dtype.itemsize
    data = draw(st.binary(min_size=n, max_size=n))
    arr = np.frombuffer(data, dtype=np.uint8).copy()
    if dtype == np.bool_:
        arr &= 1
    arr = arr.view(dtype).reshape(shape)
    return arr[()] if draw(st.booleans()) and shape == () else arr


_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8),
                     st.binary(max_size=8))
_leaves = st.one_of(_scalars, small_tensors(), small_arrays())
_keys = st.one_of(st.text(max_size=4), st.integers(-3, 10))


def _dicts(children, keys):
    pairs = st.lists(st.tuples(keys, children), max_size=4, unique_by=lambda kv: str(kv[0]))
    return pairs.map(dict)


trees = st.recursive(
    _leaves,
    lambda children: st.one_of(_dicts(children, _keys), st.lists(children, max_size=4),
                               st.lists(children, max_size=4).map(tuple)),
    max_leaves=12)
root_trees = st.one_of(
    _dicts(trees, st.one_of(st.text(max_size=4), st.integers(-3, 10))),
    st.lists(trees, max_size=4), trees.filter(lambda x: not isinstance(x, dict)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(root_trees)
def test_random_trees_roundtrip_exactly(same, tree):
    flat = flatten(tree)
    same(tree, unflatten(flat.skeleton, flat.tensors))
    # and through JSON with copies of the tensors, as a checkpoint does
    _, back = roundtrip(tree)
    same(tree, back)
    # every array leaf has a path, and refs point at stored tensors only
    assert set(flat.refs.values()) <= set(flat.tensors)
    assert set(flat.tensors) <= set(flat.refs)


def test_unescape_path_undoes_escape_key_on_every_part():
    from asyncckpt.tree import join_path, unescape_path

    keys = ["model", "50%", "", "a.b", 3, "%2F"]
    path = ""
    for k in keys:
        path = join_path(path, k)
    assert "%00" in path and "%2525" not in path
    assert unescape_path(path) == "/".join(str(k) for k in keys)
    assert unescape_path("plain/path") == "plain/path"


def _python_version_99(s):
    s["python"] = (99, *s["python"][1:])


def _numpy_name(s):
    s["numpy"] = ("XYZ", *s["numpy"][1:])


BAD_RNG = {  # case -> (the part named, the change to this rank's saved state)
    "python_version": ("ranks/0/python", _python_version_99),
    "python_short": ("ranks/0/python",
                     lambda s: s.__setitem__("python", (3, torch.zeros(5, dtype=torch.int64)))),
    "numpy_name": ("ranks/0/numpy", _numpy_name),
    "torch_size": ("ranks/0/torch",
                   lambda s: s.__setitem__("torch", torch.zeros(3, dtype=torch.uint8))),
    "torch_missing": ("ranks/0/torch", lambda s: s.pop("torch")),
    "rank_not_a_dict": ("ranks/0", None),
}


@pytest.mark.parametrize("case", sorted(BAD_RNG))
def test_a_malformed_rng_state_is_corrupt_and_changes_no_generator(case):
    # Python's generator used to be set before numpy's refused its state: a partly
    # restored set of generators, and a raw ValueError.
    what, change = BAD_RNG[case]
    rank0 = dict(RNGState().state_dict()["ranks"][0])
    if change is not None:
        change(rank0)
    bad = {"ranks": {0: rank0 if change is not None else 1}}
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    with pytest.raises(asyncckpt.CheckpointCorruptError,
                       match=f"the saved generator state {what} is malformed .*no generator "
                       "was changed"):
        RNGState().load_state_dict(bad)
    drawn = _draw()
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    assert _draw() == drawn
    # given straight to restore_rng_state (perhaps made by hand): also told what it takes
    with pytest.raises(asyncckpt.CheckpointCorruptError) as info:
        asyncckpt.restore_rng_state(bad)
    assert "restore_rng_state takes what capture_rng_state() returns" in "".join(
        getattr(info.value, "__notes__", []))


def test_a_hand_made_rng_state_is_not_called_a_corrupt_checkpoint():
    """(fine-tuning trial) capture_rng_state() with 'numpy' removed, given straight to
    restore_rng_state: "the checkpoint is corrupt", where no checkpoint was involved."""
    state = asyncckpt.capture_rng_state()
    del state["numpy"]
    with pytest.raises(asyncckpt.CheckpointCorruptError) as info:
        asyncckpt.restore_rng_state(state)
    assert str(info.value).startswith("the given generator state numpy is malformed (KeyError")
    assert "checkpoint is corrupt" not in str(info.value)


def test_a_rewritten_rng_state_in_a_checkpoint_is_corrupt_naming_its_path(tmp_path):
    import re

    from asyncckpt.manifest import seal

    asyncckpt.save({"rng": RNGState()}, tmp_path, step=1)
    asyncckpt.save({"rng": RNGState()}, tmp_path, step=2)
    path = tmp_path / "step_000000002" / "manifest.json"
    raw = path.read_bytes()
    doc = json.loads(raw[:re.search(rb',"digest"', raw).start()] + b"}")

    def bump(node):  # Python's generator state version, the one int 3 of the state
        if isinstance(node, dict):
            if node.get("t") == "int" and node.get("v") == 3:
                node["v"] = 99
                return True
            return any(bump(v) for v in node.values())
        return isinstance(node, list) and any(bump(v) for v in node)

    assert bump(doc["skeleton"])
    path.write_bytes(seal(json.dumps(doc).encode()))
    with pytest.raises(asyncckpt.CheckpointCorruptError,
                       match=r"^rng \(RNGState\): the saved generator state ranks/0/python"):
        asyncckpt.load(tmp_path, {"rng": RNGState()})
    asyncckpt.load(tmp_path, {"rng": RNGState()}, fallback=True)  # step 1 is intact


# --- DTensors, in a world of one process ---------------------------------------------------


@pytest.fixture
def mesh1():
    """A 1-D CPU device mesh of this process alone (a gloo group of one)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        if made:
            dist.destroy_process_group()


def test_overlap_refuses_dtensors_changed_in_place_before_they_were_staged(
        mesh1, tmp_path, monkeypatch):
    """A trial's FSDP2 saves with overlap=True committed values changed after the call
    (opt.step() before wait_staged()): an in-place op on a DTensor bumps its own version
    counter, not its local tensor's, which was the one watched."""
    import threading

    import asyncckpt.checkpointer as mod

    dt = dtensor_api()
    w = dt.distribute_tensor(torch.zeros(64, 4), mesh1, [dt.Shard(0)])
    release = threading.Event()
    real_stage = mod.stage

    def gated_stage(*args, **kwargs):
        assert release.wait(30)
        real_stage(*args, **kwargs)

    monkeypatch.setattr(mod, "stage", gated_stage)
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async") as ckpt:
        fut = ckpt.save_async({"w": w}, step=1, overlap=True)
        w.add_(1.0)  # in place on the DTensor, before the copy began
        release.set()
        with pytest.raises(asyncckpt.CheckpointSaveError, match=r"'w' were changed in place"):
            fut.wait(30)
        assert ckpt.steps() == []


def test_a_dtensor_spec_changed_in_place_has_its_box_worked_out_again(mesh1, monkeypatch):
    """flatten keeps the box of each DTensor spec it met, by identity: a spec that changed
    since (torch sets fields of specs in place) must not give the box it had."""
    dt = dtensor_api()
    DTensor, Replicate, Shard = dt.DTensor, dt.Replicate, dt.Shard

    import asyncckpt.dist as adist

    worked_out = []
    real_new_box = adist._new_box

    def counting_new_box(spec, t, mesh, placements, where):
        worked_out.append(placements)
        return real_new_box(spec, t, mesh, placements, where)

    monkeypatch.setattr(adist, "_new_box", counting_new_box)
    monkeypatch.setattr(adist, "_boxes", {})
    monkeypatch.setattr(adist, "_seen_specs", {})
    d = DTensor.from_local(torch.zeros(2, 3), mesh1, [Shard(0)], run_check=False)
    for _ in range(2):
        assert flatten({"w": d}).boxes["w"] == ((2, 3), ((0, 0), (2, 3)))
    assert worked_out == [(Shard(0),)]
    # (a dict finds a key by identity before comparing hashes: with the live spec as a
    # key, the changed spec would find its old entry whenever its new hash lands there)
    assert adist._boxes and all(k is not d._spec for k in adist._boxes)
    d._spec.placements = (Replicate(),)
    assert flatten({"w": d}).boxes["w"] == ((2, 3), ((0, 0), (2, 3)))
    assert worked_out == [(Shard(0),), (Replicate(),)]


def test_flattening_the_same_dtensors_again_compares_no_specs(mesh1, monkeypatch):
    """A state of DTensors is flattened at every save: a spec met before (the same
    object, unchanged) gives its box without a comparison of specs (~1.5 us each)."""
    dt = dtensor_api()
    DTensor, Replicate, Shard = dt.DTensor, dt.Replicate, dt.Shard
    DTensorSpec = dtensor_api("_dtensor_spec").DTensorSpec

    compared = []
    real_eq = DTensorSpec.__eq__

    def counting_eq(self, other):
        compared.append(1)
        return real_eq(self, other)

    monkeypatch.setattr(DTensorSpec, "__eq__", counting_eq)
    # equal specs in distinct objects (as a model's parameter and its optimizer moments)
    state = {f"t{i}": DTensor.from_local(torch.full((5, 2), float(i)), mesh1,
                                         [Shard(0) if i % 2 else Replicate()],
                                         run_check=False)
             for i in range(6)}
    first = flatten(state)
    assert compared, "the equal specs were never compared: the test proves nothing"
    compared.clear()
    again = flatten(state)
    assert compared == []
    assert again.boxes == first.boxes
    assert all(again.tensors[k] is state[k]._local_tensor for k in state)


def test_flattening_keeps_no_dtensor_spec_alive(mesh1):
    """The specs met are remembered by identity, weakly: a state of DTensors made anew
    for every save (and what each spec holds) is freed as it would be without a save."""
    import gc
    import weakref

    dt = dtensor_api()
    DTensor, Shard = dt.DTensor, dt.Shard

    d = DTensor.from_local(torch.zeros(4, 2), mesh1, [Shard(0)], run_check=False)
    flat = flatten({"w": d})
    assert flat.boxes["w"] == ((4, 2), ((0, 0), (4, 2)))
    spec = weakref.ref(d._spec)
    del d, flat
    gc.collect()
    assert spec() is None
    # and a new DTensor (whose spec may take the dead one's address) gets its own box
    e = DTensor.from_local(torch.zeros(6, 2), mesh1, [Shard(0)], run_check=False)
    assert flatten({"w": e}).boxes["w"] == ((6, 2), ((0, 0), (6, 2)))


def test_an_error_of_a_state_dict_names_where_its_object_is() -> None:
    class Broken:
        def state_dict(self) -> dict[str, int]:
            raise ValueError("boom")

        def load_state_dict(self, sd: object) -> None:
            pass

    for target in (False, True):  # a save's state, and a load's target
        with pytest.raises(ValueError, match="boom") as info:
            flatten({"deep": {"obj": Broken()}}, target=target)
        assert getattr(info.value, "__notes__", []) == [
            "asyncckpt: raised by state_dict() of the "
            "test_an_error_of_a_state_dict_names_where_its_object_is.<locals>.Broken at "
            "'deep/obj' of the state tree"]


def test_many_views_of_one_buffer_are_tied_by_layout_without_comparing_all_pairs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncckpt.tree as tree_mod

    calls = 0
    real = tree_mod._same_view

    def counted(a: torch.Tensor, b: torch.Tensor, *, empty_ok: bool = False) -> bool:
        nonlocal calls
        calls += 1
        return real(a, b, empty_ok=empty_ok)

    monkeypatch.setattr(tree_mod, "_same_view", counted)
    base = torch.arange(1000.0)
    state = {}
    for i in range(200):  # 200 views of one buffer, each twice (a tie)
        state[f"a{i}"] = base.as_strided((4,), (i + 1,))
        state[f"b{i}"] = base.as_strided((4,), (i + 1,))
    flat = flatten(state)
    assert len(flat.tensors) == 200
    assert all(flat.refs[f"b{i}"] == f"a{i}" for i in range(200))
    assert calls < 200  # (pair by pair: ~40,000 comparisons; quadratic in the views)


def test_restoring_a_statefuls_dict_does_not_copy_the_statefuls() -> None:
    from asyncckpt.tree import _without

    flat = flatten({str(i): torch.nn.Linear(2, 2) for i in range(3)}, target=True)
    inner = _without(flat, "1")
    # (a copy of them for each of n objects made a load of n modules n**2)
    assert inner.statefuls is flat.statefuls and inner.entered == "1"


@pytest.mark.parametrize("make, how", [
    (lambda: torch.Generator(), "g.get_state()"),
    (lambda: np.random.default_rng(1), "g.bit_generator.state"),
    (lambda: random.Random(1), "g.getstate()"),
    (lambda: np.random.RandomState(1), "g.get_state(legacy=False)"),
])
def test_a_generator_in_the_state_is_refused_saying_how_to_save_its_state(
        tmp_path, make, how) -> None:
    """A trial put a torch.Generator in its state: refused, naming the path, but not how
    to save one. The state the hint names saves, and restores the generator."""
    g = make()
    with pytest.raises(UnsupportedLeafError, match=re.escape(how)) as info:
        asyncckpt.save({"sampler": {"g": g}}, tmp_path / "a", step=1)
    assert "'sampler/g'" in str(info.value) and "asyncckpt.RNGState()" in str(info.value)
    state = {torch.Generator: lambda: g.get_state(),
             np.random.Generator: lambda: g.bit_generator.state,
             random.Random: lambda: g.getstate(),
             np.random.RandomState: lambda: g.get_state(legacy=False)}
    saved = next(f for cls, f in state.items() if isinstance(g, cls))()
    asyncckpt.save({"g": saved}, tmp_path / "b", step=1)
    got = asyncckpt.load(tmp_path / "b")["g"]
    fresh = make()
    if isinstance(fresh, torch.Generator):
        fresh.set_state(got)
        assert torch.equal(torch.rand(3, generator=fresh), torch.rand(3, generator=g))
    elif isinstance(fresh, np.random.Generator):
        fresh.bit_generator.state = got
        assert (fresh.random(3) == g.random(3)).all()
    elif isinstance(fresh, random.Random):
        fresh.setstate(got)
        assert fresh.random() == g.random()
    else:
        fresh.set_state(got)
        assert (fresh.random_sample(3) == g.random_sample(3)).all()


def test_a_numpy_scalar_of_no_tensor_dtype_is_called_a_scalar() -> None:
    with pytest.raises(UnsupportedLeafError,
                       match=r"numpy scalar at 'x' has dtype float128, .*complex scalars"):
        flatten({"x": np.longdouble(1.0)})
    with pytest.raises(UnsupportedLeafError, match=r"numpy array at 'y' has dtype float128"):
        flatten({"y": np.ones(2, dtype=np.longdouble)})


class _Point(collections.namedtuple("_Point", "x y")):
    pass


class _Level(enum.IntEnum):
    LOW = 1


class _Mode(str, enum.Enum):
    TRAIN = "train"


class _Color(enum.Enum):
    RED = 1


class _OnlySaves:
    def state_dict(self) -> dict[str, int]:
        return {}


class _OnlyLoads:
    def load_state_dict(self, sd: dict[str, int]) -> None:
        pass


class _Steps(list):
    pass


@pytest.mark.parametrize("make, told", [
    pytest.param(lambda: collections.namedtuple("NT", "a b")(1, 2),
                 ["is a subclass of tuple that would come back as a plain tuple", "tuple(x)",
                  "x._asdict()", "NT(*v)"], id="namedtuple"),
    pytest.param(lambda: _Point(1, 2), ["subclass of tuple", "x._asdict()"],
                 id="namedtuple-subclass"),
    pytest.param(lambda: torch.Size([2, 3]),
                 ["is a subclass of tuple that would come back as a plain tuple", "tuple(x)",
                  "list(x)", "torch.Size(v)"], id="torch.Size"),
    pytest.param(lambda: _Level.LOW,
                 ["is a subclass of int that would come back as a plain int", "x.value",
                  "x.name", "_Level(v)"], id="IntEnum"),
    pytest.param(lambda: _Mode.TRAIN,
                 ["is a subclass of str that would come back as a plain str", "x.value",
                  "x.name"], id="str-Enum"),
    pytest.param(lambda: _Color.RED, ["is not a tensor", "x.value", "x.name", "_Color[name]"],
                 id="Enum"),
    pytest.param(lambda: np.str_("a"),
                 ["is a subclass of str that would come back as a plain str", "save str(x)"],
                 id="np.str_"),
    pytest.param(lambda: np.bytes_(b"a"),
                 ["is a subclass of bytes that would come back as plain bytes",
                  "save bytes(x)"], id="np.bytes_"),
    pytest.param(lambda: _Steps([1]),
                 ["is a subclass of list that would come back as a plain list", "list(x)"],
                 id="list-subclass"),
    pytest.param(lambda: bytearray(b"x"), ["save bytes(x)"], id="bytearray"),
    pytest.param(lambda: {2, 1}, ["save sorted(x)", "set(v)"], id="set"),
    pytest.param(lambda: frozenset({1}), ["save sorted(x)", "frozenset(v)"], id="frozenset"),
    pytest.param(lambda: 1 + 2j, ["two floats", "torch.tensor(z, dtype=torch.complex128)"],
                 id="complex"),
    pytest.param(lambda: torch.bfloat16, ["save str(x)", "getattr(torch"], id="torch.dtype"),
    pytest.param(lambda: torch.device("cpu"), ["save str(x)", "torch.device(s)"],
                 id="torch.device"),
    pytest.param(lambda: torch.utils.data.DataLoader([1, 2, 3]),
                 ["DataLoader has no state_dict()", "StatefulDataLoader"], id="DataLoader"),
    pytest.param(lambda: io.BytesIO(b"x"), ["x.getvalue()", "io.BytesIO(b)"], id="BytesIO"),
    pytest.param(lambda: _OnlySaves(), ["has state_dict() but no load_state_dict()",
                                        "add load_state_dict() to _OnlySaves"],
                 id="state_dict-alone"),
    pytest.param(lambda: _OnlyLoads(), ["has load_state_dict() but no state_dict()",
                                        "add state_dict() to _OnlyLoads"],
                 id="load_state_dict-alone"),
])
def test_a_value_of_no_saved_type_is_refused_saying_what_to_save(make, told) -> None:
    """A trial's namedtuple was told it "is not a ... tuple", and neither it nor an enum,
    a torch.Size or a set was told what to save instead. They are refused, not converted:
    what comes back must be of the type that was saved."""
    with pytest.raises(UnsupportedLeafError) as info:
        flatten({"cfg": [make()]})
    msg = str(info.value)
    assert "at 'cfg/0'" in msg
    for phrase in told:
        assert phrase in msg, (phrase, msg)
    if "subclass of" in told[0]:
        assert "is not a tensor" not in msg


def test_what_a_refusal_says_to_save_round_trips() -> None:
    nt = collections.namedtuple("NT", "a b")(1, (2, 3))
    saved = {"nt": nt._asdict(), "size": tuple(torch.Size([2, 3])), "level": _Level.LOW.value,
             "mode": _Mode.TRAIN.name, "dtype": str(torch.bfloat16),
             "device": str(torch.device("cpu")), "set": sorted({3, 1}),
             "z": torch.tensor(1 / 3 + 2j, dtype=torch.complex128)}
    _, back = roundtrip(saved)
    assert type(nt)(**back["nt"]) == nt
    assert torch.Size(back["size"]) == torch.Size([2, 3])
    assert _Level(back["level"]) is _Level.LOW and _Mode[back["mode"]] is _Mode.TRAIN
    assert getattr(torch, back["dtype"].removeprefix("torch.")) is torch.bfloat16
    assert torch.device(back["device"]) == torch.device("cpu")
    assert set(back["set"]) == {1, 3} and back["z"].item() == 1 / 3 + 2j


@pytest.mark.filterwarnings("ignore::UserWarning")  # quantized creation is deprecated
def test_a_quantized_tensor_is_told_to_save_its_integers_and_scale() -> None:
    """It was told it "has no stable byte layout": its bytes are plain integers, but its
    scale and zero point are no part of them."""
    per_tensor = torch.quantize_per_tensor(torch.randn(3), 0.1, 2, torch.qint8)
    with pytest.raises(UnsupportedLeafError) as info:
        flatten({"q": per_tensor})
    msg = str(info.value)
    assert "tensor at 'q' is quantized (torch.qint8)" in msg
    for phrase in ("x.int_repr()", "x.q_scale()", "x.q_zero_point()", "x.dequantize()"):
        assert phrase in msg
    assert "stable byte layout" not in msg and "per_channel" not in msg
    per_channel = torch.quantize_per_channel(torch.randn(2, 3), torch.tensor([0.1, 0.2]),
                                             torch.tensor([0, 1]), 0, torch.quint8)
    with pytest.raises(UnsupportedLeafError, match=r"x\.q_per_channel_scales\(\), "
                       r"x\.q_per_channel_zero_points\(\) and x\.q_per_channel_axis\(\)"):
        flatten({"q": per_channel})
    _, back = roundtrip({"r": per_tensor.int_repr(), "s": per_tensor.q_scale(),
                         "z": per_tensor.q_zero_point()})
    rebuilt = torch._make_per_tensor_quantized_tensor(back["r"], back["s"], back["z"])
    assert torch.equal(rebuilt.int_repr(), per_tensor.int_repr())
    assert rebuilt.q_scale() == per_tensor.q_scale()


@pytest.mark.parametrize("make", [
    pytest.param(lambda: torch._to_functional_tensor(torch.randn(3)), id="values"),
    pytest.param(lambda: torch._to_functional_tensor(torch.empty(0)), id="empty"),
])
def test_a_functional_tensor_is_refused_when_flattened(tmp_path, make) -> None:
    """A functionalization wrapper is a plain Tensor by its type, with no memory of its
    own: a save got as far as the copy into the host buffer, and raised torch's "INTERNAL
    ASSERT FAILED" as a CheckpointSaveError."""
    ft = make()
    for where, state in (("m/w", {"m": {"w": ft}}), ("m/0", {"m": [ft]})):
        for target in (False, True):
            with pytest.raises(UnsupportedLeafError,
                               match=rf"tensor at '{where}' is a functionalization wrapper"):
                flatten(state, target=target)
    with pytest.raises(UnsupportedLeafError, match="checkpoint outside the functionalized"):
        asyncckpt.save({"w": ft}, tmp_path, step=1)
    torch._sync(ft)  # (what the message says to save)
    assert flatten({"w": torch._from_functional_tensor(ft)}).tensors["w"].shape == ft.shape


def _float_of(bits: str) -> float:
    return struct.unpack(">d", bytes.fromhex(bits))[0]


@pytest.mark.parametrize("bits", ["7ff8000000000000", "fff8000000000000", "7ff8dead0000beef",
                                  "fffc000000000001", "7ff0000000000001"])
def test_a_float_nan_keeps_its_sign_and_payload(tmp_path, bits) -> None:
    """Its node held repr's "nan" alone: -nan and a payload came back as float("nan"),
    where a tensor keeps NaN bits."""
    x = _float_of(bits)
    flat, back = roundtrip({"v": x, "in_list": [x], "in_tuple": (x,)})
    for got in (back["v"], back["in_list"][0], back["in_tuple"][0]):
        assert struct.pack(">d", got) == struct.pack(">d", x)
    node = flat.skeleton["items"][0][1]
    assert node["v"] == "nan"  # (what readers before "bits" read, as float("nan"))
    assert ("bits" in node) == (bits != struct.pack(">d", float("nan")).hex())
    asyncckpt.save({"v": x, "l": [x]}, tmp_path, step=1)
    loaded = asyncckpt.load(tmp_path)
    target = {"v": 0.0, "l": [1.0]}
    asyncckpt.load(tmp_path, target)
    for got in (loaded["v"], loaded["l"][0], target["v"], target["l"][0]):
        assert struct.pack(">d", got) == struct.pack(">d", x)


def test_a_nan_node_without_bits_reads_as_float_nan() -> None:
    # (as every NaN node of a checkpoint written before "bits")
    got = unflatten({"t": "float", "v": "nan"}, {})
    assert struct.pack(">d", got) == struct.pack(">d", float("nan"))


def test_an_argparse_namespace_is_told_to_be_saved_as_a_dict() -> None:
    """(a migration trial: a run's args, refused with no word of what to do)"""
    import argparse

    with pytest.raises(UnsupportedLeafError, match=r"save vars\(x\) \(a dict of its fields\)"):
        flatten({"args": argparse.Namespace(lr=0.1)})


def test_a_numpy_array_of_zero_byte_items_is_refused_as_unsupported() -> None:
    """np.dtype([]) has items of 0 bytes: a trial's save raised ZeroDivisionError from the
    stride check, no CheckpointError."""
    with pytest.raises(UnsupportedLeafError, match=r"at 'v'.*no tensor equivalent"):
        flatten({"v": np.empty(2, dtype=np.dtype([]))})


def test_a_str_with_a_surrogate_pair_is_refused_and_a_lone_surrogate_round_trips() -> None:
    """JSON readers join an escaped high and low surrogate into the one character they
    encode: a trial's '\\ud83d\\ude00' came back as one emoji, unequal to what was saved."""
    with pytest.raises(UnsupportedLeafError) as info:
        flatten({"run": {"name": "ok \ud83d\ude00"}})
    msg = str(info.value)
    assert "at 'run/name'" in msg and "surrogate pair" in msg and "at index 3" in msg, msg
    assert "'\U0001f600'" in msg or "\U0001f600" in msg, msg  # the joined character
    flatten({"name": "\ud83d\ude00"}, target=True)  # a target's value is replaced: loads
    _, back = roundtrip({"a": "x\udcffy", "b": "\udc00\ud800", "c": "\U0001f600"})
    assert back == {"a": "x\udcffy", "b": "\udc00\ud800", "c": "\U0001f600"}


@pytest.mark.parametrize(("key", "fix"), [(np.int64(3), "convert the key to int (int(k)"),
                                          (True, "convert the key to str"),
                                          (2.5, "convert the key to str")])
def test_a_key_of_another_type_is_told_the_type_to_convert_it_to(key: object, fix: str) -> None:
    with pytest.raises(UnsupportedLeafError, match=re.escape(fix)):
        flatten({key: 1})
