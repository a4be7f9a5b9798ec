"""asyncckpt.load_safetensors: plain safetensors files (Hugging Face weights, exports)."""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import asyncckpt
from asyncckpt import (
    CheckpointConfigError,
    CheckpointCorruptError,
    CheckpointNotFoundError,
    ShardMetadata,
    StateMismatchError,
)
from asyncckpt.export import export_safetensors


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7),
                               torch.nn.Linear(7, 2))


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in _model(seed).state_dict().items()}


def _every_dtype() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    out = {
        "f32": torch.randn(3, 4, generator=g),
        "bf16": torch.randn(5, generator=g).to(torch.bfloat16),
        "f16": torch.randn(2, 2, generator=g).half(),
        "f64": torch.randn(3, generator=g).double(),
        "i64": torch.randint(-9, 9, (4,), generator=g),
        "i8": torch.randint(-9, 9, (4,), generator=g).to(torch.int8),
        "u8": torch.randint(0, 255, (6,), generator=g).to(torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "fp8": torch.randn(4, generator=g).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
    }
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and a.reshape(-1).contiguous().view(torch.uint8).equal(
                b.reshape(-1).contiguous().view(torch.uint8)))


def _write_raw(path: Path, header: dict[str, Any], body: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + body)


# --- loads that work --------------------------------------------------------------------------


def test_a_model_loads_in_place_and_keeps_its_parameters(tmp_path: Path) -> None:
    save_file(_weights(0), str(tmp_path / "model.safetensors"))
    model = _model(1)
    params = dict(model.named_parameters())
    out = asyncckpt.load_safetensors(tmp_path / "model.safetensors", model)
    assert out is model
    assert all(p is params[k] for k, p in model.named_parameters())
    for k, v in _weights(0).items():
        assert torch.equal(model.state_dict()[k], v), k


def test_a_fresh_load_equals_safetensors_own_for_every_dtype(tmp_path: Path) -> None:
    tensors = _every_dtype()
    save_file(tensors, str(tmp_path / "t.safetensors"))
    got = asyncckpt.load_safetensors(tmp_path / "t.safetensors", threads=2)
    ref = load_file(str(tmp_path / "t.safetensors"))
    assert set(got) == set(ref) == set(tensors)
    for k in tensors:
        assert _same(got[k], ref[k]) and _same(got[k], tensors[k]), k


def test_in_place_into_every_dtype(tmp_path: Path) -> None:
    tensors = _every_dtype()
    save_file(tensors, str(tmp_path / "t.safetensors"))
    target = {k: torch.zeros_like(v) for k, v in tensors.items()}
    kept = {k: v for k, v in target.items()}
    asyncckpt.load_safetensors(tmp_path / "t.safetensors", target)
    for k, v in tensors.items():
        assert target[k] is kept[k] and _same(target[k], v), k


def test_hugging_face_sharded_directory_with_its_index(tmp_path: Path) -> None:
    full = {f"model.{k}": v for k, v in _weights(0).items()}
    names = sorted(full)
    files = {"model-00001-of-00002.safetensors": names[:3],
             "model-00002-of-00002.safetensors": names[3:]}
    for fname, keys in files.items():
        save_file({k: full[k] for k in keys}, str(tmp_path / fname), metadata={"format": "pt"})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, ks in files.items() for k in ks}}))
    (tmp_path / "config.json").write_text("{}")
    model = _model(1)
    asyncckpt.load_safetensors(tmp_path, model, key_map=lambda k: k.removeprefix("model."))
    for k, v in _weights(0).items():
        assert torch.equal(model.state_dict()[k], v), k


def test_an_export_comes_back_as_the_tree_it_was_exported_from(tmp_path: Path) -> None:
    state = {"model": _weights(0), "ema": {"decay": torch.tensor(0.99)},
             "optim": {"state": {0: {"exp_avg": torch.arange(4.0)}}}}
    asyncckpt.save(state, tmp_path / "ck", step=3)
    export_safetensors(tmp_path / "ck", tmp_path / "all.safetensors")
    target = {"model": _weights(1), "ema": {"decay": torch.tensor(0.0)},
              "optim": {"state": {0: {"exp_avg": torch.zeros(4)}}}}
    asyncckpt.load_safetensors(tmp_path / "all.safetensors", target)
    assert torch.equal(target["optim"]["state"][0]["exp_avg"], torch.arange(4.0))
    assert target["ema"]["decay"].item() == pytest.approx(0.99)
    for k, v in state["model"].items():
        assert torch.equal(target["model"][k], v), k
    fresh = asyncckpt.load_safetensors(tmp_path / "all.safetensors")
    assert set(fresh) == {"model", "ema", "optim"} and set(fresh["model"]) == set(state["model"])
    assert torch.equal(fresh["optim"]["state"]["0"]["exp_avg"], torch.arange(4.0))


def test_an_export_of_lists_or_of_one_tensor_loads_back_into_its_tree(tmp_path: Path) -> None:
    """(stop 48's trial) A file's names are text: an export of lists came back as dicts
    of "0", "1"... and did not load into the list it came from; an export of a tensor
    alone (its name "") did not load into a tensor, and the error named the root ""."""
    lists = {"l": [torch.arange(2.0), [torch.arange(3.0)]], "t": (torch.ones(1),)}
    asyncckpt.save(lists, tmp_path / "ck", step=1)
    export_safetensors(tmp_path / "ck", tmp_path / "lists.safetensors")
    target = {"l": [torch.zeros(2), [torch.zeros(3)]], "t": (torch.zeros(1),)}
    out = asyncckpt.load_safetensors(tmp_path / "lists.safetensors", target)
    assert out["l"][1][0] is target["l"][1][0] and type(out["t"]) is tuple
    assert torch.equal(target["l"][0], torch.arange(2.0))
    assert torch.equal(target["l"][1][0], torch.arange(3.0))
    assert torch.equal(target["t"][0], torch.ones(1))
    with pytest.raises(StateMismatchError, match="missing from the checkpoint: l/2"):
        asyncckpt.load_safetensors(tmp_path / "lists.safetensors",
                                   {"l": [torch.zeros(2), [torch.zeros(3)], torch.zeros(1)],
                                    "t": (torch.zeros(1),)})
    asyncckpt.save(torch.arange(5.0), tmp_path / "one", step=1)
    export_safetensors(tmp_path / "one", tmp_path / "one.safetensors")
    t = torch.zeros(5)
    assert asyncckpt.load_safetensors(tmp_path / "one.safetensors", t) is t
    assert torch.equal(t, torch.arange(5.0))
    with pytest.raises(StateMismatchError, match="mismatched: <root>: the checkpoint holds a "
                                                 "dict, the target a list"):
        asyncckpt.load_safetensors(tmp_path / "one.safetensors", [torch.zeros(5)])


def test_key_map_as_a_mapping_renames_and_a_function_may_leave_out(tmp_path: Path) -> None:
    save_file({"old.w": torch.ones(2), "b": torch.full((3,), 2.0), "junk": torch.zeros(1)},
              str(tmp_path / "f.safetensors"))
    got = asyncckpt.load_safetensors(tmp_path / "f.safetensors",
                                     key_map={"old.w": "layer/w"})
    assert set(got) == {"layer", "b", "junk"} and torch.equal(got["layer"]["w"], torch.ones(2))
    target = {"b": torch.zeros(3)}
    asyncckpt.load_safetensors(tmp_path / "f.safetensors", target,
                               key_map=lambda k: None if k != "b" else k)
    assert torch.equal(target["b"], torch.full((3,), 2.0))


def test_hand_sharded_target_reads_its_box(tmp_path: Path) -> None:
    w = torch.arange(48.0).reshape(6, 8)
    save_file({"w": w}, str(tmp_path / "f.safetensors"))
    target = {"w": torch.zeros(3, 4)}
    asyncckpt.load_safetensors(tmp_path / "f.safetensors", target,
                               shards={"w": ShardMetadata((6, 8), (3, 4))})
    assert torch.equal(target["w"], w[3:6, 4:8])


def test_ignore_unexpected_exclude_and_progress(tmp_path: Path) -> None:
    save_file({"a": torch.ones(1000), "b": torch.ones(10), "skip/x": torch.ones(4)},
              str(tmp_path / "f.safetensors"))
    seen: list[tuple[int, int]] = []
    target = {"a": torch.zeros(1000), "skip": {"x": torch.zeros(4)}}
    asyncckpt.load_safetensors(tmp_path / "f.safetensors", target, ignore_unexpected=True,
                               exclude="skip", progress=lambda d, t: seen.append((d, t)))
    assert torch.equal(target["a"], torch.ones(1000))
    assert torch.equal(target["skip"]["x"], torch.zeros(4))  # excluded: left alone
    assert seen and seen[-1][0] == seen[-1][1] == 4000  # 'a' alone was read


# --- mistakes and damage ---------------------------------------------------------------------


def test_names_that_do_not_match_get_the_key_map_hint(tmp_path: Path) -> None:
    save_file({f"model.{k}": v for k, v in _weights(0).items()}, str(tmp_path / "m.safetensors"))
    with pytest.raises(StateMismatchError) as info:
        asyncckpt.load_safetensors(tmp_path / "m.safetensors", {"model": _model(1)})
    msg = str(info.value)
    assert "m.safetensors" in msg and "model/0.weight" in msg
    assert "model/0.weight" in info.value.missing
    # a prefix apart: the very key_map that loads them, whichever side has what
    # (guarded: a name without the prefix keeps its own, as it matched already)
    assert msg.endswith("key_map=lambda name: 'model/' + name[6:] if name.startswith('model.') "
                        "else name"), msg
    assert "strict=False" not in msg, msg  # (it loads none of them: a trial was told to)
    asyncckpt.load_safetensors(tmp_path / "m.safetensors", {"model": _model(1)},
                               key_map=lambda name: "model/" + name.removeprefix("model."))
    with pytest.raises(StateMismatchError,
                       match=r"key_map=lambda name: name\.removeprefix\('model\.'\)") as info:
        asyncckpt.load_safetensors(tmp_path / "m.safetensors", _model(1))
    assert str(info.value).count("key_map=") == 1, info.value  # (one example, not two)
    save_file(_weights(0), str(tmp_path / "bare.safetensors"))
    with pytest.raises(StateMismatchError, match=r"key_map=lambda name: 'model/' \+ name$"):
        asyncckpt.load_safetensors(tmp_path / "bare.safetensors", {"model": _model(1)})
    save_file({"x": torch.ones(1)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(StateMismatchError, match=r"key_map=\{'x': 'y'\}"):  # (one for one)
        asyncckpt.load_safetensors(tmp_path / "other.safetensors", {"y": torch.ones(1)})
    save_file({"x": torch.ones(3, dtype=torch.int64)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(StateMismatchError, match=r"e\.g\. key_map=lambda name: 'model/' \+ "
                       r"name puts them"):  # nothing in common: the general way
        asyncckpt.load_safetensors(tmp_path / "other.safetensors", {"y": torch.ones(1)})


def test_a_renamed_submodule_s_key_map_renames_that_submodule_alone(tmp_path: Path) -> None:
    """(a fine-tuning trial) A file's final_norm.* for the model's ln_f.* was answered
    "key_map=lambda name: 'ln_f.' + name.removeprefix('final_norm.')", which renamed every
    other tensor too; the advice given is pasted and loads."""
    weights = {**_weights(0), "final_norm.weight": torch.ones(3), "final_norm.bias":
               torch.zeros(3)}
    save_file(weights, str(tmp_path / "r.safetensors"))
    target = {**{k: torch.zeros_like(v) for k, v in _weights(1).items()},
              "ln_f.weight": torch.zeros(3), "ln_f.bias": torch.ones(3)}
    with pytest.raises(StateMismatchError, match=r"key_map=(lambda name: .*)$") as info:
        asyncckpt.load_safetensors(tmp_path / "r.safetensors", target)
    code = re.search(r"key_map=(lambda name: .*)$", str(info.value)).group(1)  # type: ignore
    asyncckpt.load_safetensors(tmp_path / "r.safetensors", target, key_map=eval(code))
    assert torch.equal(target["ln_f.weight"], torch.ones(3))
    assert torch.equal(target["0.weight"], weights["0.weight"])
    # a file with nothing of the target's prefix-apart, of a LoRA-wrapped model: the
    # loader's renamed-submodule advice, not "'model/' + name puts them under 'model'"
    lora = {"blocks.0.qkv.base.weight": torch.zeros(2, 2), "blocks.0.qkv.lora_A":
            torch.zeros(1, 2), "blocks.1.qkv.base.weight": torch.zeros(2, 2)}
    save_file({"blocks.0.qkv.weight": torch.ones(2, 2), "blocks.1.qkv.weight":
               torch.ones(2, 2)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(StateMismatchError) as info:
        asyncckpt.load_safetensors(tmp_path / "plain.safetensors", lora)
    assert "puts them under 'model'" not in str(info.value), info.value
    # (second trial: the one rule for every block, not one pair per error)
    assert "key_map=lambda p: p.replace('.qkv.', '.qkv.base.', 1)" in str(info.value), info.value


def test_a_tied_head_held_once_is_left_out_with_its_resized_embedding(tmp_path: Path) -> None:
    """(fine-tuning trial) A vocabulary grown on a tied model, its file holding the shared
    tensor once as Hugging Face saves it: told exclude=['emb'], then, followed, of the
    head the embedding stood for. Both at once now."""
    class Tied(torch.nn.Module):
        def __init__(self, vocab: int) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(vocab, 4)
            self.body = torch.nn.Linear(4, 4)
            self.head = torch.nn.Linear(4, vocab, bias=False)
            self.head.weight = self.emb.weight

    src = Tied(6)
    save_file({k: v for k, v in src.state_dict().items() if k != "head.weight"},
              str(tmp_path / "t.safetensors"))
    target = Tied(8)
    with pytest.raises(StateMismatchError, match=r"exclude=(\[[^]]*\])") as info:
        asyncckpt.load_safetensors(tmp_path / "t.safetensors", target)
    told = re.findall(r"exclude=(\[[^]]*\])", str(info.value))[-1]
    assert sorted(eval(told)) == ["emb", "head"], str(info.value)
    asyncckpt.load_safetensors(tmp_path / "t.safetensors", target, exclude=eval(told))
    assert torch.equal(target.body.weight, src.body.weight)


def test_key_map_collisions_and_clashes_are_refused(tmp_path: Path) -> None:
    save_file({"a": torch.ones(1), "b": torch.ones(1)}, str(tmp_path / "f.safetensors"))
    with pytest.raises(CheckpointConfigError, match=r"'a'.*'b'|'b'.*'a'"):
        asyncckpt.load_safetensors(tmp_path / "f.safetensors", key_map=lambda k: "same")
    with pytest.raises(CheckpointConfigError, match=r"tensor itself|holds other tensors"):
        asyncckpt.load_safetensors(tmp_path / "f.safetensors", key_map={"b": "a/b"})
    with pytest.raises(CheckpointConfigError, match="key_map"):
        asyncckpt.load_safetensors(tmp_path / "f.safetensors", key_map=lambda k: 3)
    with pytest.raises(CheckpointConfigError, match="key_map"):
        asyncckpt.load_safetensors(tmp_path / "f.safetensors", key_map="a")  # type: ignore[arg-type]


def test_a_key_in_two_files_of_a_directory_is_refused(tmp_path: Path) -> None:
    save_file({"w": torch.ones(2)}, str(tmp_path / "a.safetensors"))
    save_file({"w": torch.zeros(2)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(CheckpointCorruptError, match=r"'w'.*both files"):
        asyncckpt.load_safetensors(tmp_path)


def test_index_problems_name_the_index_or_the_tensor(tmp_path: Path) -> None:
    save_file({"w": torch.ones(2)}, str(tmp_path / "a.safetensors"))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"w": "a.safetensors", "v": "a.safetensors"}}))
    with pytest.raises(CheckpointCorruptError, match=r"'v'.*incomplete") as info:
        asyncckpt.load_safetensors(tmp_path)
    assert info.value.key == "v"
    index.write_text(json.dumps({"weight_map": {"w": "gone.safetensors"}}))
    with pytest.raises(CheckpointNotFoundError, match=r"gone.safetensors"):
        asyncckpt.load_safetensors(tmp_path)
    index.write_text(json.dumps({"weight_map": {"w": "../a.safetensors"}}))
    with pytest.raises(CheckpointCorruptError, match="not a file beside it"):
        asyncckpt.load_safetensors(tmp_path)
    index.write_text("{not json")
    with pytest.raises(CheckpointCorruptError, match="not JSON"):
        asyncckpt.load_safetensors(tmp_path)


@pytest.mark.parametrize(("header", "body", "match"), [
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4,
     "outside the file"),
    ({"w": {"dtype": "F32", "shape": [1 << 40], "data_offsets": [0, 8]}}, b"\0" * 8,
     "holds 8 bytes"),
    ({"w": {"dtype": "Q9", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, "dtype 'Q9'"),
    ({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, "shape"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"\0" * 8, "outside"),
    ({"w": {"dtype": "F32", "shape": [2]}}, b"\0" * 8, "data_offsets"),
    ({"w": [1, 2]}, b"", "not an object"),
    # F4 values fill whole bytes, as safetensors' own reader checks
    ({"w": {"dtype": "F4", "shape": [5], "data_offsets": [0, 3]}}, b"\0" * 3,
     "end inside a byte"),
    ({"w": {"dtype": "F4", "shape": [], "data_offsets": [0, 1]}}, b"\0", "end inside a byte"),
    ({"w": {"dtype": "F4", "shape": [2, 4], "data_offsets": [0, 8]}}, b"\0" * 8,
     "holds 8 bytes, but 4"),
])
def test_bad_headers_are_corrupt_and_name_file_and_tensor(tmp_path: Path, header: Any,
                                                           body: bytes, match: str) -> None:
    path = tmp_path / "bad.safetensors"
    _write_raw(path, header, body)
    with pytest.raises(CheckpointCorruptError, match=match) as info:
        asyncckpt.load_safetensors(path)
    assert info.value.key == "w" and "bad.safetensors" in str(info.value)


def test_files_that_are_no_safetensors_at_all(tmp_path: Path) -> None:
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"abc")
    with pytest.raises(CheckpointCorruptError, match="too short"):
        asyncckpt.load_safetensors(short)
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes(struct.pack("<Q", 1 << 50) + b"{}")
    with pytest.raises(CheckpointCorruptError, match="header claims"):
        asyncckpt.load_safetensors(huge)
    text = tmp_path / "text.safetensors"
    text.write_bytes(struct.pack("<Q", 4) + b"[1,2")
    with pytest.raises(CheckpointCorruptError, match="not JSON"):
        asyncckpt.load_safetensors(text)
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        asyncckpt.load_safetensors(tmp_path / "nope.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match=r"no .safetensors"):
        asyncckpt.load_safetensors(tmp_path / "empty")


def test_a_truncated_file_is_caught(tmp_path: Path) -> None:
    path = tmp_path / "f.safetensors"
    save_file({"w": torch.ones(1024)}, str(path))
    raw = path.read_bytes()
    path.write_bytes(raw[:-100])
    with pytest.raises(CheckpointCorruptError) as info:
        asyncckpt.load_safetensors(path)
    assert info.value.key == "w"


def test_asyncckpt_checkpoints_are_pointed_to_the_right_loader(tmp_path: Path) -> None:
    asyncckpt.save({"w": torch.ones(2)}, tmp_path / "ck", step=1)
    with pytest.raises(CheckpointConfigError, match=r"asyncckpt.load"):
        asyncckpt.load_safetensors(tmp_path / "ck")
    step_dir = next((tmp_path / "ck").glob("step_*"))
    with pytest.raises(CheckpointConfigError, match=r"asyncckpt.load"):
        asyncckpt.load_safetensors(step_dir)
    with pytest.raises(CheckpointConfigError, match="shard file of an asyncckpt"):
        asyncckpt.load_safetensors(next(step_dir.glob("rank_*.safetensors")))
    save_file({"w": torch.ones(2)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(CheckpointNotFoundError, match="load_safetensors"):
        asyncckpt.load(tmp_path / "plain.safetensors")


def test_bf16_weights_load_into_an_fp32_model_by_default(tmp_path: Path) -> None:
    half = {k: v.to(torch.bfloat16) for k, v in _weights(0).items()}
    save_file(half, str(tmp_path / "m.safetensors"))
    model = _model(1)
    weight = model[0].weight
    asyncckpt.load_safetensors(tmp_path / "m.safetensors", model)
    assert model[0].weight is weight and weight.dtype == torch.float32
    for k, v in half.items():
        assert torch.equal(model.state_dict()[k], v.float()), k
    with pytest.raises(StateMismatchError, match=r"0\.weight: checkpoint torch\.bfloat16"):
        asyncckpt.load_safetensors(tmp_path / "m.safetensors", _model(1), cast=False)
    save_file({"0.weight": torch.ones(7, 5, dtype=torch.int32)}, str(tmp_path / "i.safetensors"))
    with pytest.raises(StateMismatchError, match="another kind of dtype"):
        asyncckpt.load_safetensors(tmp_path / "i.safetensors", _model(1), ignore_unexpected=True)


def test_a_hugging_face_cache_snapshot_of_symlinks_loads(tmp_path: Path) -> None:
    # huggingface_hub's cache: snapshots/<rev>/ holds symlinks into blobs/
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc123"
    blobs.mkdir()
    snap.mkdir(parents=True)
    save_file(_weights(0), str(blobs / "e3b0c442"))
    (snap / "model.safetensors").symlink_to(Path("../../blobs/e3b0c442"))
    model = _model(1)
    asyncckpt.load_safetensors(snap, model)
    for k, v in _weights(0).items():
        assert torch.equal(model.state_dict()[k], v), k


class _Tied(torch.nn.Module):
    """An LM's tied input and output embeddings (GPT-2, Llama 3.2 1B, Gemma...)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(11, 4)
        self.head = torch.nn.Linear(4, 11, bias=False)
        self.head.weight = self.embed.weight


def test_tied_embeddings_saved_once_as_hugging_face_does_load_strictly(tmp_path: Path) -> None:
    src = _Tied(0)
    for kept in ("embed.weight", "head.weight"):  # either path may be the one saved
        save_file({kept: src.embed.weight.detach().clone()}, str(tmp_path / "t.safetensors"))
        model = _Tied(1)
        asyncckpt.load_safetensors(tmp_path / "t.safetensors", model)
        assert model.head.weight is model.embed.weight
        assert torch.equal(model.embed.weight, src.embed.weight), kept
    # untied paths are still each wanted
    untied = torch.nn.ModuleDict({"embed": torch.nn.Embedding(11, 4),
                                  "head": torch.nn.Linear(4, 11, bias=False)})
    with pytest.raises(StateMismatchError, match=r"missing from the checkpoint: embed\.weight"):
        asyncckpt.load_safetensors(tmp_path / "t.safetensors", untied)


def test_a_key_map_entry_naming_no_tensor_of_the_file_is_warned_of(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """(review) load_safetensors, where key_map is used most, said nothing of a typo."""
    save_file({"head.weight": torch.ones(2)}, str(tmp_path / "k.safetensors"))
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        got = asyncckpt.load_safetensors(tmp_path / "k.safetensors",
                                         key_map={"head.weight ": "w", "head.weight": "h"})
    assert sorted(got) == ["h"]
    assert f"{tmp_path / 'k.safetensors'} holds no tensor named 'head.weight '" in caplog.text


def test_a_torch_save_file_or_json_passed_as_safetensors_is_named(tmp_path: Path) -> None:
    # (both said only that the header claims some 10**17 bytes)
    # (and not as damaged, CheckpointCorruptError, which inspect's exit code 1 says: a
    # trial's torch.save file was; they are files of another format)
    torch.save({"w": torch.ones(2)}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointNotFoundError, match=r"is no safetensors file \(a zip "
                       r"archive: a torch.save file\? load it with torch.load\(path, "
                       r"weights_only=True\)"):
        asyncckpt.load_safetensors(tmp_path / "model.safetensors")
    torch.save({"w": torch.ones(2)}, tmp_path / "old.safetensors",
               _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointNotFoundError, match=r"a pickle: a torch.save file of the "
                                                      r"legacy format"):
        asyncckpt.load_safetensors(tmp_path / "old.safetensors")
    (tmp_path / "index.safetensors").write_text('{"weight_map": {"w": "model.safetensors"}}')
    with pytest.raises(CheckpointNotFoundError, match=r"it begins as JSON"):
        asyncckpt.load_safetensors(tmp_path / "index.safetensors")
    from asyncckpt.cli import main

    assert main(["inspect", str(tmp_path / "model.safetensors")]) == 2  # (not 1: damaged)
    # a safetensors file cut short in a header of 640 bytes, whose length reads as a
    # pickle's first bytes (80 02): damaged, not another format (a review)
    (tmp_path / "cut.safetensors").write_bytes(struct.pack("<Q", 640) + b'{"w": ' * 10)
    with pytest.raises(CheckpointCorruptError, match="header claims 640 bytes"):
        asyncckpt.load_safetensors(tmp_path / "cut.safetensors")


def test_forged_headers_with_shared_bytes_or_repeated_names_are_refused(tmp_path: Path) -> None:
    both = tmp_path / "both.safetensors"
    _write_raw(both, {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12)
    with pytest.raises(CheckpointCorruptError, match="'a' and 'b' claim the same bytes"):
        asyncckpt.load_safetensors(both)
    twice = tmp_path / "twice.safetensors"
    text = (b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
            b'"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}')
    twice.write_bytes(struct.pack("<Q", len(text)) + text + b"\0" * 8)
    with pytest.raises(CheckpointCorruptError, match="names 'w' twice"):
        asyncckpt.load_safetensors(twice)
    (tmp_path / "sub" / "dir.safetensors").mkdir(parents=True)  # (listed as a file)
    with pytest.raises(CheckpointCorruptError, match="not a regular file") as info:
        asyncckpt.load_safetensors(tmp_path / "sub")
    assert "earlier step" not in str(info.value)


def test_numpy_targets_are_never_cast_and_are_told_so(tmp_path: Path) -> None:
    import numpy as np

    save_file({"a": torch.ones(3, dtype=torch.float16)}, str(tmp_path / "f.safetensors"))
    with pytest.raises(StateMismatchError, match="numpy arrays are never cast") as info:
        asyncckpt.load_safetensors(tmp_path / "f.safetensors", {"a": np.zeros(3, np.float32)})
    # (a trial was shown its array's dtype as torch.float32)
    assert "a: checkpoint torch.float16 [3], target numpy float32 [3]" in str(info.value)


def _bn_net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4),
                               torch.nn.Sequential(torch.nn.BatchNorm1d(2)))


def test_weights_without_batch_norm_counters_load_as_load_state_dict_takes_them(
        tmp_path: Path) -> None:
    # published weights (and those saved before torch had the counter) often lack
    # num_batches_tracked; torch's load_state_dict keeps the module's counter for it
    src = _bn_net()
    with torch.no_grad():
        for p in src.parameters():
            p.add_(1.5)
    weights = {k: v for k, v in src.state_dict().items()
               if not k.endswith("num_batches_tracked")}
    save_file(weights, str(tmp_path / "w.safetensors"))
    expected = _bn_net()
    expected.load_state_dict(load_file(str(tmp_path / "w.safetensors")))
    target = _bn_net()
    target[1].num_batches_tracked.fill_(7)
    asyncckpt.load_safetensors(tmp_path / "w.safetensors", target)
    for k, v in expected.state_dict().items():
        if k == "1.num_batches_tracked":
            assert int(target.state_dict()[k]) == 7  # kept, as torch keeps it
        else:
            assert torch.equal(target.state_dict()[k], v), k
    # the same in a checkpoint of the weights alone, into a model in a tree
    asyncckpt.save({"model": weights}, tmp_path / "ck")
    fresh = _bn_net()
    asyncckpt.load(tmp_path / "ck", {"model": fresh})
    assert torch.equal(fresh[0].weight, src[0].weight)
    assert torch.equal(fresh[2][0].bias, src[2][0].bias)


def test_only_batch_norm_counters_are_let_go_missing(tmp_path: Path) -> None:
    # a missing weight, or a missing tensor that is named like a counter but held by
    # another kind of module, is still refused
    class Counting(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("num_batches_tracked", torch.tensor(0))

    net = torch.nn.Sequential(_bn_net(), Counting())
    weights = {k: v for k, v in net.state_dict().items()
               if not k.endswith("num_batches_tracked")}
    save_file(weights, str(tmp_path / "w.safetensors"))
    with pytest.raises(StateMismatchError) as err:
        asyncckpt.load_safetensors(tmp_path / "w.safetensors", net)
    assert err.value.missing == ["1.num_batches_tracked"]
    del weights["0.1.weight"]
    save_file(weights, str(tmp_path / "w2.safetensors"))
    with pytest.raises(StateMismatchError) as err:
        asyncckpt.load_safetensors(tmp_path / "w2.safetensors", net)
    assert sorted(err.value.missing) == ["0.1.weight", "1.num_batches_tracked"]


# --- dtypes newer than asyncckpt's own: F4 (packed float4) and F8_E8M0 ----------------------

needs_fp4 = pytest.mark.skipif(
    not (hasattr(torch, "float4_e2m1fn_x2") and hasattr(torch, "float8_e8m0fnu")),
    reason="this torch has no float4_e2m1fn_x2 or float8_e8m0fnu")


def _header(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header: dict[str, Any] = json.loads(raw[8:8 + n])
    return header


def _mx() -> dict[str, torch.Tensor]:
    """An MX-style pair, packed 4-bit values and their power-of-two scales, with random
    bits (every byte pattern, NaN scales included)."""
    g = torch.Generator().manual_seed(5)
    bits = torch.randint(0, 256, (3, 4, 6), dtype=torch.uint8, generator=g)
    return {"q": bits.view(torch.float4_e2m1fn_x2),
            "s": bits[:, :, 0].clone().view(torch.float8_e8m0fnu),
            "empty": torch.zeros(2, 0, dtype=torch.uint8).view(torch.float4_e2m1fn_x2),
            "w": torch.arange(3.0)}


@needs_fp4
def test_f4_and_f8_e8m0_load_bit_exact_as_safetensors_own_does(tmp_path: Path) -> None:
    # The trial: a valid file with an F4 tensor was called corrupt (and inspect exited 1).
    tensors = _mx()
    path = tmp_path / "mx.safetensors"
    save_file(tensors, str(path))
    header = _header(path)
    assert header["q"]["dtype"] == "F4" and header["q"]["shape"] == [3, 4, 12]
    assert header["s"]["dtype"] == "F8_E8M0"
    ref = load_file(str(path))
    got = asyncckpt.load_safetensors(path, threads=2)
    assert set(got) == set(ref) == set(tensors)
    for k, t in tensors.items():
        assert _same(got[k], ref[k]) and _same(got[k], t), k
        assert torch.equal(got[k].view(torch.uint8), t.view(torch.uint8)), k
    # in place, and a box of the packed tensor along its last dim
    target = {k: torch.empty_like(t) for k, t in tensors.items()}
    kept = dict(target)
    asyncckpt.load_safetensors(path, target)
    for k, t in tensors.items():
        assert target[k] is kept[k] and _same(target[k], t), k
    part = {"q": torch.empty(3, 2, 3, dtype=torch.float4_e2m1fn_x2)}
    asyncckpt.load_safetensors(path, part, ignore_unexpected=True,
                               shards={"q": ShardMetadata((3, 4, 6), (0, 2, 3))})
    assert _same(part["q"], tensors["q"][:, 2:, 3:].contiguous())


@needs_fp4
def test_inspect_lists_an_f4_file_and_exits_0(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from asyncckpt.cli import main

    path = tmp_path / "mx.safetensors"
    save_file(_mx(), str(path))
    assert main(["inspect", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {t["path"]: t for t in doc["tensors"]}
    assert rows["q"]["dtype"] == "float4_e2m1fn_x2" and rows["q"]["shape"] == [3, 4, 6]
    assert rows["q"]["bytes"] == 72 and rows["s"]["dtype"] == "float8_e8m0fnu"
    # a dtype torch has none for: no damage (1), but "could not tell" (2), saying which
    _unloadable_file(tmp_path / "new.safetensors")
    assert main(["inspect", str(tmp_path / "new.safetensors")]) == 2
    assert "'f6' cannot be loaded" in capsys.readouterr().err


def _unloadable_file(path: Path) -> None:
    """A valid file (safetensors' own reader opens it) with two tensors torch cannot hold:
    an F6 one (torch has no 6-bit dtype) and an F4 one whose last dim is odd (torch's
    float4_e2m1fn_x2 holds two values an element), and one it can."""
    _write_raw(path, {"f6": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [0, 3]},
                      "odd": {"dtype": "F4", "shape": [2, 3], "data_offsets": [3, 6]},
                      "w": {"dtype": "F32", "shape": [2], "data_offsets": [6, 14]}},
               b"\1" * 6 + struct.pack("<2f", 1.5, -2.0))


def test_a_dtype_this_torch_cannot_hold_is_refused_as_such_not_as_corrupt(
        tmp_path: Path) -> None:
    path = tmp_path / "new.safetensors"
    _unloadable_file(path)
    with safe_open(str(path), "pt") as f:  # (valid: safetensors opens it, and reads "w")
        assert set(f.keys()) == {"f6", "odd", "w"}
        assert torch.equal(f.get_tensor("w"), torch.tensor([1.5, -2.0]))
    with pytest.raises(CheckpointConfigError) as err:
        asyncckpt.load_safetensors(path)
    text = str(err.value)
    assert not isinstance(err.value, CheckpointCorruptError)
    assert "new.safetensors" in text and "'f6'" in text and "F6_E2M3" in text
    assert "'odd'" in text and "key_map=lambda name: None if name in ('f6', 'odd')" in text
    with pytest.raises(CheckpointConfigError, match=r"'odd' cannot be loaded: .*last dim"):
        asyncckpt.load_safetensors(path, key_map=lambda n: None if n == "f6" else n)


def test_key_map_leaving_out_the_tensors_this_torch_cannot_hold_loads_the_rest(
        tmp_path: Path) -> None:
    # key_map's None leaves a tensor out (docs/api.md): the trial could load nothing of
    # such a file at all
    path = tmp_path / "new.safetensors"
    _unloadable_file(path)
    skip = {"f6", "odd"}
    got = asyncckpt.load_safetensors(path, key_map=lambda n: None if n in skip else n)
    assert set(got) == {"w"} and torch.equal(got["w"], torch.tensor([1.5, -2.0]))
    target = {"w": torch.zeros(2)}
    asyncckpt.load_safetensors(path, target, key_map=lambda n: None if n in skip else n)
    assert torch.equal(target["w"], torch.tensor([1.5, -2.0]))


def test_a_state_dict_copy_without_batch_norm_counters_loads_as_the_module_does(
        tmp_path: Path) -> None:
    """(a second migration trial) the module kept its counter; its state_dict() copy, which
    the guide says loads in place, was refused as missing it."""
    src = _bn_net()
    weights = {k: v for k, v in src.state_dict().items()
               if not k.endswith("num_batches_tracked")}
    save_file(weights, str(tmp_path / "w.safetensors"))
    target = _bn_net()
    sd = target.state_dict()
    asyncckpt.load_safetensors(tmp_path / "w.safetensors", sd)
    assert torch.equal(target[0].weight, src[0].weight)
    asyncckpt.save({"model": weights}, tmp_path / "ck")
    asyncckpt.load(tmp_path / "ck", {"model": _bn_net().state_dict()})
    bad = {k: v for k, v in weights.items() if k != "1.running_var"}  # (a statistic is
    save_file(bad, str(tmp_path / "b.safetensors"))                    # missing still)
    with pytest.raises(StateMismatchError) as err:
        asyncckpt.load_safetensors(tmp_path / "b.safetensors", _bn_net().state_dict())
    assert sorted(err.value.missing) == ["1.running_var"]


def test_tied_weights_written_twice_with_the_same_bytes_are_not_warned_of(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """(a second migration trial) a file holding a tied embedding under both names, as
    export(tied="copy") writes it, was warned of as "the last one wins": the values are
    read first now (no checksums to tell), and only differing ones are warned of."""
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(4, 3)
            self.head = torch.nn.Linear(3, 4, bias=False)
            self.head.weight = self.emb.weight

    w = Tied().emb.weight.detach().clone()
    save_file({"emb.weight": w, "head.weight": w.clone()}, str(tmp_path / "same.safetensors"))
    save_file({"emb.weight": w, "head.weight": w + 1}, str(tmp_path / "diff.safetensors"))
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        model = Tied()
        asyncckpt.load_safetensors(tmp_path / "same.safetensors", model)
        assert torch.equal(model.emb.weight, w) and not caplog.records
        asyncckpt.load_safetensors(tmp_path / "diff.safetensors", Tied())
    assert "share memory" in caplog.text and "last one wins" in caplog.text


def test_a_dcp_directory_passed_to_load_safetensors_is_named(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "dcp"))
    with pytest.raises(CheckpointNotFoundError, match=r"holds no .safetensors file; it holds "
                                                      r"a PyTorch DCP checkpoint"):
        asyncckpt.load_safetensors(tmp_path / "dcp")


def test_two_tied_pairs_of_the_same_bytes_each_are_not_warned_of(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """(a review) two tied pairs in one file: the sharing was judged over all four keys at
    once, which are no one view, and warned of."""
    class Two(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.pos = torch.nn.Embedding(4, 3), torch.nn.Embedding(5, 3)
            self.head = torch.nn.Linear(3, 4, bias=False)
            self.pos_out = torch.nn.Linear(3, 5, bias=False)
            self.head.weight, self.pos_out.weight = self.emb.weight, self.pos.weight

    m = Two()
    e, p = m.emb.weight.detach().clone(), m.pos.weight.detach().clone()
    save_file({"emb.weight": e, "head.weight": e.clone(), "pos.weight": p,
               "pos_out.weight": p.clone()}, str(tmp_path / "two.safetensors"))
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        asyncckpt.load_safetensors(tmp_path / "two.safetensors", Two())
    assert not caplog.records, caplog.text


def test_an_index_that_is_no_file_or_names_a_nul_is_refused_at_once(tmp_path: Path) -> None:
    """(a review) A FIFO named model.safetensors.index.json hung the load for ever (a plain
    open), and a NUL in an index's file name surfaced as a bare ValueError."""
    save_file({"w": torch.ones(2)}, str(tmp_path / "a.safetensors"))
    index = tmp_path / "model.safetensors.index.json"
    os.mkfifo(index)
    got: list[BaseException] = []

    def load() -> None:
        try:
            asyncckpt.load_safetensors(tmp_path)
        except BaseException as exc:  # (what the load raised, checked below)
            got.append(exc)

    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():  # (a writer lets a blocked open of the FIFO go, and the thread end)
        with open(os.open(index, os.O_WRONLY | os.O_NONBLOCK), "wb"):
            pass
        pytest.fail("load_safetensors blocked on a FIFO named as the index")
    assert len(got) == 1 and isinstance(got[0], CheckpointCorruptError), got
    assert "not a regular file" in str(got[0])
    index.unlink()
    index.write_text(json.dumps({"weight_map": {"w": "a.safe\0tensors"}}))
    with pytest.raises(CheckpointCorruptError, match="which is not a file beside it"):
        asyncckpt.load_safetensors(tmp_path)


def test_a_shape_no_tensor_can_have_is_a_damaged_header_not_out_of_memory(
        tmp_path: Path) -> None:
    """(a review) [0, 2**61, 2**61] holds no bytes, so its size matched its empty range,
    and torch's refusal to lay it out was told "could not be allocated (out of memory?)"."""
    _write_raw(tmp_path / "f.safetensors",
               {"w": {"dtype": "F32", "shape": [0, 2**61, 2**61], "data_offsets": [0, 0]}}, b"")
    with pytest.raises(CheckpointCorruptError, match=r"is too large for any tensor"):
        asyncckpt.load_safetensors(tmp_path / "f.safetensors")
