"""``asyncckpt export``: one safetensors file of whole tensors from single-process and
sharded checkpoints; prefix selection, dtype casts, overwrite protection, corruption."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import logging
import math
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import safetensors
import safetensors.torch
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import asyncckpt
from _manifests import long_entries
from _ranks import all_ok, in_threads
from asyncckpt import AsyncCheckpointer, CheckpointExistsError, ShardMetadata, tree
from asyncckpt import export as export_mod
from asyncckpt.cli import main
from asyncckpt.export import export_safetensors
from asyncckpt.manifest import _ST_DTYPES
from asyncckpt.reader import verify_checkpoint
from asyncckpt.storage import DirectoryLock, LocalStorage
from asyncckpt.tree import flatten

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")


def raw(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def assert_exact(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert raw(a) == raw(b), f"{what}: bytes differ"


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def full_state() -> dict[str, Any]:
    """Model weights of several dtypes and shapes, an optimizer-like subtree, scalars."""
    return {
        "model": {
            "embed.weight": randn(37, 16, seed=1),
            "layers.0.weight": randn(16, 16, seed=2, dtype=torch.bfloat16),
            "layers.0.bias": randn(16, seed=3, dtype=torch.float16),
            "layers.1.weight": randn(5, 16, seed=4, dtype=torch.float64),
            "norm.scale": torch.tensor(1.5),  # 0-d
            "mask": torch.tensor([True, False, True]),
            "empty": torch.zeros(0, 4),
            "positions": torch.arange(11, dtype=torch.int64),
        },
        "optim": {"state": {"0": {"exp_avg": randn(37, 16, seed=5),
                                  "step": torch.tensor(7.0)}},
                  "param_groups": [{"lr": 0.1, "params": ["embed.weight"]}]},
        "step": 7,
    }


def tensors_of(state: Any) -> dict[str, torch.Tensor]:
    return dict(flatten(state).tensors)


def export(*argv: str) -> tuple[int, str, str]:
    """Run the CLI in-process; return (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["export", *argv])
    return code, out.getvalue(), err.getvalue()


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".tmp-" in p.name)


# --- building checkpoints ------------------------------------------------------------------

@pytest.fixture
def single(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    state = full_state()
    root = tmp_path / "single"
    with AsyncCheckpointer(root, mode="sync") as ckpt:
        ckpt.save(state, step=7)
    return root, state


def save_sharded(root: Path, state: dict[str, Any], split: dict[str, int], step: int,
                 monkeypatch: pytest.MonkeyPatch, world: int = 2) -> None:
    """Save ``state`` as ``world`` ranks would, in threads of this process.

    Each tensor path in ``split`` is cut with ``tensor_split`` along the given dim (uneven
    pieces allowed) and every rank holds its piece as a hand-declared shard; the other
    tensors are replicated on every rank (one of them writes each). The ranks coordinate
    through an in-memory HashStore exactly as they would through torch.distributed's.
    """
    store = torch.distributed.HashStore()
    ckpts = []
    for r in range(world):
        ckpts.append(AsyncCheckpointer(root, mode="sync", rank=r, world_size=world,
                                       store=store, timeout_s=60))
    flat = tensors_of(state)

    def rank_main(r: int) -> None:
        local = _local_tree(state, "", split, r, world)
        shards = {}
        for path, dim in split.items():
            t = flat[path]
            sizes = [p.shape[dim] for p in t.tensor_split(world, dim)]
            offsets = [0] * t.dim()
            offsets[dim] = sum(sizes[:r])
            shards[path] = ShardMetadata(tuple(t.shape), tuple(offsets))
        ckpts[r].save_async(local, step, shards=shards).wait()

    try:
        all_ok(in_threads(rank_main, world, timeout=120))
    finally:
        for c in ckpts:
            c.close()


def _local_tree(node: Any, path: str, split: dict[str, int], r: int, world: int) -> Any:
    if isinstance(node, dict):
        return {k: _local_tree(v, f"{path}/{k}" if path else k, split, r, world)
                for k, v in node.items()}
    if isinstance(node, list):
        return [_local_tree(v, f"{path}/{i}", split, r, world) for i, v in enumerate(node)]
    if isinstance(node, torch.Tensor) and path in split:
        return node.tensor_split(world, split[path])[r].clone()
    return node.clone() if isinstance(node, torch.Tensor) else node


SPLIT = {"model/embed.weight": 0,  # 37 rows: 19 + 18
         "model/layers.0.weight": 1,  # columns: chunks are not contiguous in the global tensor
         "model/layers.1.weight": 0,  # 5 rows: 3 + 2
         "optim/state/0/exp_avg": 0}


@pytest.fixture
def sharded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, dict[str, Any]]:
    state = full_state()
    root = tmp_path / "sharded"
    save_sharded(root, state, SPLIT, 7, monkeypatch)
    return root, state


# --- whole-file equality -------------------------------------------------------------------

@pytest.mark.parametrize("which", ["single", "sharded"])
def test_export_everything_exactly(which: str, request: pytest.FixtureRequest,
                                   tmp_path: Path) -> None:
    root, state = request.getfixturevalue(which)
    manifest = asyncckpt.AsyncCheckpointer(root).manifest()
    if which == "sharded":
        assert manifest.world_size == 2 and len(manifest.files) == 2
        for path in SPLIT:
            assert len(manifest.tensors[path].chunks) == 2
    out = tmp_path / "all.safetensors"
    report = export_safetensors(root, out)
    got = load_file(out)
    want = tensors_of(state)
    assert list(got) == list(want) or sorted(got) == sorted(want)
    for key, t in want.items():
        assert_exact(got[key], t, key)
    # also equal to what asyncckpt itself loads
    loaded = tensors_of(asyncckpt.load(root))
    for key, t in loaded.items():
        assert_exact(got[key], t, key)
    assert report.step == 7 and not report.skipped and not report.aliases
    assert {t.name for t in report.tensors} == set(want)
    assert report.file_bytes == out.stat().st_size
    if which == "sharded":
        assert {t.key: t.chunks for t in report.tensors}["model/layers.0.weight"] == 2
    with safetensors.safe_open(str(out), "pt") as f:
        meta = f.metadata()
    assert meta["format"] == "pt" and meta["asyncckpt_step"] == "7"
    assert leftovers(tmp_path) == []


def test_export_prefix_and_strip(sharded: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    root, state = sharded
    want = {k: v for k, v in tensors_of(state).items() if k.startswith("model/")}
    out = tmp_path / "model.safetensors"
    code, stdout, stderr = export(str(root), str(out), "--prefix", "model/", "--strip-prefix")
    assert code == 0, stderr
    got = load_file(out)
    assert sorted(got) == sorted(k.removeprefix("model/") for k in want)
    for k, t in want.items():
        assert_exact(got[k.removeprefix("model/")], t, k)
    assert "layers.0.weight" in stdout and "wrote" in stdout
    head = stdout.splitlines()[0].split()
    assert head == ["NAME", "DTYPE", "SHAPE", "BYTES", "FROM"], head  # (names renamed)
    assert "model/layers.0.weight" in stdout

    kept = tmp_path / "kept.safetensors"
    code, stdout, _ = export(str(root), str(kept), "--prefix", "model/layers.")
    assert code == 0
    # no name differs from its key: no FROM column, always empty (a user trial)
    assert stdout.splitlines()[0].split() == ["NAME", "DTYPE", "SHAPE", "BYTES"], stdout
    assert sorted(load_file(kept)) == ["model/layers.0.bias", "model/layers.0.weight",
                                       "model/layers.1.weight"]
    # a prefix without the slash still gives clean names
    report = export_safetensors(root, tmp_path / "o.safetensors", prefix="optim",
                                strip_prefix=True)
    assert [t.name for t in report.tensors] == ["state/0/exp_avg", "state/0/step"]


def test_export_dtype_cast(sharded: tuple[Path, dict[str, Any]], tmp_path: Path,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    root, state = sharded
    want = {k: v for k, v in tensors_of(state).items() if k.startswith("model/")}
    monkeypatch.setattr(export_mod, "_CAST_PIECE_ELEMS", 100)  # cast through several pieces
    # the CLI takes the names the Python API takes, in any case (BF16, bfloat16, Half)
    for flag, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16),
                        ("fp32", torch.float32), ("BF16", torch.bfloat16),
                        ("bfloat16", torch.bfloat16), ("Half", torch.float16)):
        out = tmp_path / f"{flag}.safetensors"
        code, _, err = export(str(root), str(out), "--prefix", "model/", "--dtype", flag)
        assert code == 0, err
        got = load_file(out)
        for k, t in want.items():
            if t.dtype.is_floating_point:
                assert_exact(got[k], t.to(dtype), k)
            else:
                assert_exact(got[k], t, k)  # int64 and bool are never cast
    report = export_safetensors(root, tmp_path / "x.safetensors", prefix="model/",
                                dtype=torch.bfloat16)
    by = {t.key: t for t in report.tensors}
    assert by["model/embed.weight"].dtype == "bfloat16"
    assert by["model/embed.weight"].source_dtype == "float32"
    assert by["model/embed.weight"].nbytes == 37 * 16 * 2
    assert by["model/positions"].dtype == "int64"
    with pytest.raises(asyncckpt.CheckpointConfigError, match="int8"):
        export_safetensors(root, tmp_path / "y.safetensors", dtype="int8")


def test_export_reports_its_progress(sharded: tuple[Path, dict[str, Any]], tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    root, _ = sharded
    seen: list[tuple[int, int]] = []
    report = export_safetensors(root, tmp_path / "m.safetensors", prefix="model",
                                progress=lambda done, total: seen.append((done, total)))
    assert [d for d, _ in seen] == list(itertools.accumulate(t.nbytes for t in report.tensors))
    assert {t for _, t in seen} == {report.tensor_bytes}
    # the command line draws it on a terminal only, and erases it
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    out, err = io.StringIO(), Tty()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main(["export", str(root), str(tmp_path / "t.safetensors")]) == 0
    drawn = err.getvalue()
    assert f"exporting {root}: " in drawn and "(100%)" in drawn and drawn.endswith("\r")
    assert "\r" not in out.getvalue() and "wrote" in out.getvalue()
    assert "\r" not in export(str(root), str(tmp_path / "n.safetensors"))[2]


def test_export_older_step_and_step_dir(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with AsyncCheckpointer(root, mode="sync") as ckpt:
        for s in (1, 2):
            ckpt.save({"w": torch.full((3,), float(s))}, step=s)
    out = tmp_path / "one.safetensors"
    assert export(str(root), str(out), "--step", "1")[0] == 0
    assert_exact(load_file(out)["w"], torch.full((3,), 1.0), "w")
    latest = export_safetensors(root / "step_000000002", tmp_path / "two.safetensors")
    assert latest.step == 2
    assert export(str(root), str(tmp_path / "n.safetensors"), "--step", "5")[0] == 2
    assert not (tmp_path / "n.safetensors").exists()


# --- refusing, failing ---------------------------------------------------------------------

def test_export_refuses_to_overwrite(single: tuple[Path, dict[str, Any]], tmp_path: Path
                                     ) -> None:
    root, state = single
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"precious")
    code, _, err = export(str(root), str(out))
    assert code == 2 and "already exists; pass --force to overwrite it" in err, err
    assert "force=True" not in err  # (the Python argument's name, in the CLI's words)
    assert out.read_bytes() == b"precious"
    with pytest.raises(CheckpointExistsError):
        export_safetensors(root, out)
    assert out.read_bytes() == b"precious"
    code, _, err = export(str(root), str(out), "--force", "--prefix", "model/")
    assert code == 0, err
    assert_exact(load_file(out)["model/embed.weight"], state["model"]["embed.weight"], "w")
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("which", ["single", "sharded"])
def test_export_of_corrupt_checkpoint_fails_and_leaves_nothing(
        which: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    root, _ = request.getfixturevalue(which)
    step_dir = root / "step_000000007"
    manifest = long_entries(json.loads((step_dir / "manifest.json").read_text()))
    # a tensor written late in the output, so part of the file is written before the check
    chunk = manifest["tensors"]["model/positions"]["chunks"][-1]
    with open(step_dir / chunk["file"], "r+b") as f:
        f.seek(chunk["byte_range"][0] + 9)
        b = f.read(1)
        f.seek(chunk["byte_range"][0] + 9)
        f.write(bytes([b[0] ^ 0x01]))
    outdir = tmp_path / "outdir"
    outdir.mkdir()
    out = outdir / "model.safetensors"
    code, _, err = export(str(root), str(out))
    assert code == 1
    assert "checksum mismatch" in err and "model/positions" in err
    assert not out.exists() and list(outdir.iterdir()) == []
    with pytest.raises(asyncckpt.CheckpointCorruptError):
        export_safetensors(root, out, prefix="model/")
    assert list(outdir.iterdir()) == []
    # what the corruption does not touch still exports
    assert export(str(root), str(out), "--prefix", "optim/")[0] == 0


def test_export_missing_rank_file_fails(sharded: tuple[Path, dict[str, Any]], tmp_path: Path
                                        ) -> None:
    root, _ = sharded
    (root / "step_000000007" / "rank_00001.safetensors").unlink()
    out = tmp_path / "m.safetensors"
    code, _, err = export(str(root), str(out))
    assert code == 1 and "rank_00001" in err
    assert not out.exists() and leftovers(tmp_path) == []


def test_export_usage_errors(single: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    root, _ = single
    out = tmp_path / "u.safetensors"
    safetensors.torch.save_file({"w": torch.ones(2)}, str(tmp_path / "plain.safetensors"))
    code, _, err = export(str(tmp_path / "plain.safetensors"), str(out))
    assert code == 2 and "pass a checkpoint root" in err
    assert "verify" not in err  # (verify's hint for such a file: the review found it here)
    code, _, err = export(str(root), str(out), "--prefix", "modle/")
    assert code == 2 and "'model/'" in err  # names the prefixes that exist
    code, _, err = export(str(tmp_path / "nothing"), str(out))
    assert code == 2 and "does not exist" in err
    code, _, err = export(str(root), str(tmp_path / "no" / "dir" / "x.safetensors"))
    assert code == 2 and "does not exist" in err
    code, _, err = export(str(root), str(tmp_path))
    assert code == 2 and "directory" in err
    code, _, err = export(str(root), str(out), "--strip-prefix")
    assert code == 2 and "--prefix" in err
    code, _, err = export(str(root), str(out), "--dtype", "int8")
    assert code == 2 and ("invalid dtype (bf16, fp16, fp32, fp64, fp8_e4m3 or fp8_e5m2) "
                          "value: 'int8'") in err
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = export(str(empty), str(out))
    assert code == 2 and "no committed checkpoint" in err
    assert not out.exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("name,dtype", [("fp8_e4m3", torch.float8_e4m3fn),
                                        ("FLOAT8_E5M2", torch.float8_e5m2),
                                        ("fp64", torch.float64)])
def test_export_cli_casts_to_fp8_and_fp64(tmp_path: Path, name: str, dtype: torch.dtype) -> None:
    """--dtype offered bf16, fp16 and fp32 alone: a trial publishing fp8 weights for an
    inference server needed the Python API for what the API already did."""
    w = torch.tensor([1.0, -2.5, 0.125, 300.0])
    asyncckpt.save({"w": w, "n": torch.arange(3)}, tmp_path / "c", step=1)
    out = tmp_path / "o.safetensors"
    code, _, err = export(str(tmp_path / "c"), str(out), "--dtype", name)
    assert code == 0, err
    got = load_file(out)
    assert got["w"].dtype == dtype
    assert_exact(got["w"], w.to(dtype), "w")
    assert got["n"].dtype == torch.int64  # (only floating tensors are cast)
    if dtype == torch.float8_e4m3fn:  # 1e10 lies beyond it: the cast saturates, not inf
        asyncckpt.save({"w": torch.tensor([1e10, math.inf, -math.inf, 1.0])},
                       tmp_path / "big", step=1)
        code, _, err = export(str(tmp_path / "big"), str(tmp_path / "b.safetensors"),
                              "--dtype", name, "--json")
        # infinities too (a trial's diverged weight came out as 448 without a word)
        assert code == 0 and ("3 values of w are beyond the range of fp8_e4m3 (or infinite: "
                              "it has no inf) and became its largest value (448)") in err, err
        assert load_file(tmp_path / "b.safetensors")["w"].float().tolist() == [
            448.0, 448.0, -448.0, 1.0]


def test_export_refuses_a_name_that_is_not_utf8_before_writing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Older versions saved a key holding a lone surrogate (a str and JSON allow it, save
    # now refuses it) and load gives it back, but no safetensors name can hold it: export
    # refuses it before anything is written.
    root = tmp_path / "s"
    monkeypatch.setattr(tree, "_check_key_text", lambda k, where: None)
    asyncckpt.save({"w\ud800": torch.ones(2), "ok": torch.zeros(3)}, root, step=1)
    assert torch.equal(asyncckpt.load(root)["w\ud800"], torch.ones(2))
    outdir = tmp_path / "out"
    outdir.mkdir()
    out = outdir / "m.safetensors"
    with pytest.raises(asyncckpt.CheckpointConfigError,
                       match=r"would be named 'w\\ud800' in the output, which is not valid UTF-8"):
        export_safetensors(root, out)
    assert list(outdir.iterdir()) == []
    code, _, err = export(str(root), str(out))
    assert code == 2 and "lone surrogate" in err and list(outdir.iterdir()) == []
    code, _, err = export(str(root), str(out), "--prefix", "ok")  # the others export
    assert code == 0, err
    assert list(load_file(out)) == ["ok"]


# --- odd content ---------------------------------------------------------------------------

def _all_dtypes() -> list[torch.dtype]:
    names = ["bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
             "float16", "bfloat16", "float32", "float64", "complex32", "complex64",
             "complex128", "float8_e8m0fnu", "float4_e2m1fn_x2",
             *sorted(n for n in dir(torch) if n.startswith("float8_"))]
    out = []
    for n in dict.fromkeys(names):
        dt = getattr(torch, n, None)
        if not isinstance(dt, torch.dtype):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.zeros(32, dtype=torch.uint8).view(dt).clone()
        except (RuntimeError, TypeError):
            continue
        out.append(dt)
    return out


def test_export_every_dtype(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Dtypes safetensors names come out bit-exact; the others are skipped with a warning."""
    state = {}
    for i, dt in enumerate(_all_dtypes()):
        g = torch.Generator().manual_seed(i)
        n = 6 * 4 * dt.itemsize
        bits = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        if dt == torch.bool:
            bits = bits & 1
        state[str(dt).removeprefix("torch.")] = bits.view(dt).reshape(6, 4)
    root = tmp_path / "dtypes"
    asyncckpt.save(state, root)
    out = tmp_path / "d.safetensors"
    with caplog.at_level("WARNING", logger="asyncckpt.export"):
        report = export_safetensors(root, out)
    got = load_file(out)
    back = asyncckpt.load_safetensors(out)
    skipped = {s.key for s in report.skipped}
    # safetensors 0.8 names these two too (F8_E8M0, F4): written, not skipped
    newer = {getattr(torch, n) for n in ("float8_e8m0fnu", "float4_e2m1fn_x2")
             if hasattr(torch, n)}
    for name, t in state.items():
        if t.dtype in _ST_DTYPES or t.dtype in newer:
            assert_exact(got[name], t, name)
            assert_exact(back[name], t, name)
        else:
            assert name in skipped and name not in got
            assert name in caplog.text
    assert "complex128" in skipped and not {"float8_e8m0fnu", "float4_e2m1fn_x2"} & skipped
    code, _, err = export(str(root), str(tmp_path / "e.safetensors"))
    assert code == 0 and "warning: skipped complex128" in err
    assert err.count("complex128 (") == 1 and "export: skipping" not in err  # said once


def test_export_tied_weights_written_once(tmp_path: Path) -> None:
    w = randn(8, 4, seed=9)
    root = tmp_path / "tied"
    asyncckpt.save({"model": {"embed.weight": w, "lm_head.weight": w, "b": torch.ones(4)}}, root)
    out = tmp_path / "t.safetensors"
    report = export_safetensors(root, out, prefix="model/", strip_prefix=True)
    got = load_file(out)
    assert sorted(got) == ["b", "embed.weight"]
    assert report.aliases == {"lm_head.weight": "embed.weight"}
    assert_exact(got["embed.weight"], w, "embed")
    code, stdout, _ = export(str(root), str(tmp_path / "t2.safetensors"), "--json")
    assert code == 0
    doc = json.loads(stdout)
    assert doc["aliases"] == {"model/lm_head.weight": "model/embed.weight"}
    assert doc["step"] == 0 and len(doc["tensors"]) == 2
    with safe_open(str(out), "pt") as f:  # (the file says what its one copy stands for)
        assert json.loads(f.metadata()["asyncckpt_tied"]) == {"lm_head.weight": "embed.weight"}


def test_a_tied_export_loads_into_an_untied_model_through_its_metadata(tmp_path: Path) -> None:
    """(trial v2) A tied LM exported with its head written once, loaded by
    load_safetensors into an untied LM: lm_head was missing, and strict=False left it
    random although the file's metadata says whose copy it is."""
    class LM(torch.nn.Module):
        def __init__(self, tie: bool) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)
            self.lm_head = torch.nn.Linear(4, 10, bias=False)
            if tie:
                self.lm_head.weight = self.emb.weight

    src = LM(tie=True)
    asyncckpt.save({"model": src}, tmp_path / "ck", step=1)
    out = tmp_path / "once.safetensors"
    export_safetensors(tmp_path / "ck", out, prefix="model", strip_prefix=True)
    untied = LM(tie=False)
    asyncckpt.load_safetensors(out, untied)  # strict
    assert torch.equal(untied.lm_head.weight, src.emb.weight)
    assert torch.equal(untied.emb.weight, src.emb.weight)
    fresh = asyncckpt.load_safetensors(out)
    assert sorted(fresh) == ["emb.weight", "lm_head.weight"]
    assert fresh["lm_head.weight"] is fresh["emb.weight"]  # (tied, as saved)
    # (third review) a base model without the head loads strictly: an alias is the
    # target's to want; metadata too deep to parse, or with empty names, is ignored
    base = torch.nn.Module()
    base.emb = torch.nn.Embedding(10, 4)
    asyncckpt.load_safetensors(out, base)
    assert torch.equal(base.emb.weight, src.emb.weight)
    odd = tmp_path / "odd.safetensors"
    for tied in ("[" * 100_000 + "]" * 100_000, '{"": "w", "a//b": "w"}'):
        save_file({"w": torch.ones(3)}, str(odd), metadata={"asyncckpt_tied": tied})
        got = {"w": torch.zeros(3)}
        asyncckpt.load_safetensors(odd, got)
        assert torch.equal(got["w"], torch.ones(3))


def test_export_tied_weights_copied_for_a_strict_load_state_dict(tmp_path: Path) -> None:
    """A trial's tied LM, exported, could not be loaded strictly into its own class by
    plain torch (lm_head.weight missing): tied="copy" writes it under each name."""
    class LM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)
            self.lm_head = torch.nn.Linear(4, 10, bias=False)
            self.lm_head.weight = self.emb.weight

    src = LM()
    asyncckpt.save({"model": src}, tmp_path / "ck", step=1)
    out = tmp_path / "copy.safetensors"
    report = export_safetensors(tmp_path / "ck", out, prefix="model", strip_prefix=True,
                                tied="copy")
    assert report.aliases == {} and [t.name for t in report.tensors] == ["emb.weight",
                                                                         "lm_head.weight"]
    got = load_file(out)
    model = LM()
    model.load_state_dict(got)  # strict
    assert torch.equal(model.emb.weight, src.emb.weight) and model.lm_head.weight is \
        model.emb.weight
    with safe_open(str(out), "pt") as f:
        assert "asyncckpt_tied" not in f.metadata()
    code, _, _ = export(str(tmp_path / "ck"), str(tmp_path / "hf"), "--prefix", "model",
                        "--strip-prefix", "--tied", "copy", "--max-shard-size", "100")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert code == 0 and sorted(index["weight_map"]) == ["emb.weight", "lm_head.weight"]
    with pytest.raises(asyncckpt.CheckpointConfigError, match="tied='twice'"):
        export_safetensors(tmp_path / "ck", tmp_path / "x.safetensors", tied="twice")


def test_export_streams_one_tensor_at_a_time(sharded: tuple[Path, dict[str, Any]],
                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                             ) -> None:
    """The export asks the reader for a large tensor alone and for small ones in runs of
    bounded bytes (one per tensor cost ~55 us a tensor: 1.1 s for 20,000), each tensor
    once, and checks each file's header once (not once per tensor: that grew with the
    square of the tensor count)."""
    root, state = sharded
    sizes = {k: t.nbytes for k, t in tensors_of(state).items()}
    one = sorted(sizes.values())[len(sizes) // 2]  # (half the tensors count as large)
    monkeypatch.setattr(export_mod, "_BATCH_ONE", one)
    monkeypatch.setattr(export_mod, "_BATCH_BYTES", 2 * one)
    asked: list[list[str]] = []
    checked: list[str] = []
    import asyncckpt.reader as reader_mod

    real, real_check = export_mod._load_checked, reader_mod._check_file

    def spy(step_dir: Path, manifest: Any, dests: dict[str, Any], storage: Any,
            **kw: Any) -> dict[str, torch.Tensor]:
        asked.append(list(dests))
        assert all(v is None for v in dests.values())
        return real(step_dir, manifest, dests, storage, **kw)

    def check_spy(step_dir: Path, manifest: Any, name: str, storage: Any,
                  chunks: Any = None) -> None:
        checked.append(name)
        real_check(step_dir, manifest, name, storage, chunks)

    monkeypatch.setattr(export_mod, "_load_checked", spy)
    monkeypatch.setattr(reader_mod, "_check_file", check_spy)  # (through check_files)
    export_safetensors(root, tmp_path / "s.safetensors")
    every = [k for a in asked for k in a]
    assert sorted(every) == sorted(sizes), asked  # (each once)
    assert any(len(a) > 1 for a in asked), asked  # (runs)
    for a in asked:
        if len(a) > 1:
            assert all(sizes[k] <= one for k in a), (a, one)
            assert sum(sizes[k] for k in a) < 2 * one + one, (a, one)
    assert all([k] in asked for k, n in sizes.items() if n > one)  # (alone)
    out = safetensors.torch.load_file(tmp_path / "s.safetensors")
    assert all(torch.equal(out[k], t) for k, t in tensors_of(state).items())
    assert sorted(checked) == sorted(set(checked)) and len(checked) >= 2, checked


def test_export_header_is_compact_and_aligned(single: tuple[Path, dict[str, Any]],
                                              tmp_path: Path) -> None:
    root, _ = single
    out = tmp_path / "h.safetensors"
    export_safetensors(root, out)
    data = out.read_bytes()
    n = int.from_bytes(data[:8], "little")
    assert (8 + n) % 8 == 0
    header = json.loads(data[8:8 + n])
    spans = sorted(tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__")
    assert spans[0][0] == 0 and spans[-1][1] == len(data) - 8 - n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))  # no holes
    for k, v in header.items():  # every tensor starts aligned to its element size
        if k != "__metadata__":
            size = {"F64": 8, "I64": 8, "F32": 4, "BF16": 2, "F16": 2, "BOOL": 1}[v["dtype"]]
            assert (8 + n + v["data_offsets"][0]) % size == 0
            assert v["data_offsets"][1] - v["data_offsets"][0] == math.prod(v["shape"]) * size


# --- names, prefixes and where errors come from ---------------------------------------------------

def test_prefix_selects_whole_name_parts_and_names_keep_their_keys(tmp_path: Path) -> None:
    one = torch.ones(2)
    state = {"model": {"a.weight": one, "odd/key": one * 2, "50%": one * 3},
             "model_ema": {"a.weight": one * 4}, "model.flat": one * 5}
    asyncckpt.save(state, tmp_path / "ck")
    out = tmp_path / "m.safetensors"
    export_safetensors(tmp_path / "ck", out, prefix="model", strip_prefix=True)
    got = load_file(str(out))
    assert sorted(got) == ["50%", "a.weight", "flat", "odd/key"], sorted(got)
    assert got["odd/key"].tolist() == [2.0, 2.0] and got["50%"].tolist() == [3.0, 3.0]
    export_safetensors(tmp_path / "ck", out, prefix="model_ema", force=True)
    assert sorted(load_file(str(out))) == ["model_ema/a.weight"]


def test_strip_prefix_removes_one_separator_and_no_more(tmp_path: Path) -> None:
    one = torch.ones(2)
    asyncckpt.save({"model": {".hidden": one, "/abs": one * 2, "w": one * 3}}, tmp_path / "ck")
    out = tmp_path / "m.safetensors"
    export_safetensors(tmp_path / "ck", out, prefix="model", strip_prefix=True)
    got = load_file(str(out))
    assert sorted(got) == [".hidden", "/abs", "w"]  # (were "abs", "hidden", "w")
    assert got[".hidden"].tolist() == [1.0, 1.0] and got["/abs"].tolist() == [2.0, 2.0]
    export_safetensors(tmp_path / "ck", out, prefix="model/", strip_prefix=True, force=True)
    assert sorted(load_file(str(out))) == [".hidden", "/abs", "w"]


def test_export_never_writes_inside_the_checkpoint(tmp_path: Path) -> None:
    asyncckpt.save({"w": torch.ones(2)}, tmp_path / "ck", step=1)
    shard = tmp_path / "ck" / "step_000000001" / "rank_00000.safetensors"
    before = shard.read_bytes()
    with pytest.raises(asyncckpt.CheckpointConfigError, match="inside the checkpoint"):
        export_safetensors(tmp_path / "ck", shard, force=True)
    assert shard.read_bytes() == before
    assert asyncckpt.load(tmp_path / "ck")["w"].tolist() == [1.0, 1.0]


@pytest.mark.parametrize("where", ["other_step/manifest.json", "other_step/x.safetensors",
                                   "lock", "copied_step/x.safetensors", "tmp_step/x",
                                   "named_like_a_step"])
def test_export_never_writes_into_any_step_or_the_lock(tmp_path: Path, where: str) -> None:
    root = tmp_path / "ck"
    for step in (1, 2):
        asyncckpt.save({"w": torch.full((2,), float(step))}, root, step=step)
    copied = tmp_path / "best"  # a step directory copied under another name
    shutil.copytree(root / "step_000000002", copied)
    (root / ".step_000000003.tmp-0123456789ab").mkdir()  # a save in flight
    (root / DirectoryLock.NAME).touch()
    out = {"other_step/manifest.json": root / "step_000000002" / "manifest.json",
           "other_step/x.safetensors": root / "step_000000002" / "x.safetensors",
           "lock": root / DirectoryLock.NAME,
           "copied_step/x.safetensors": copied / "x.safetensors",
           "tmp_step/x": root / ".step_000000003.tmp-0123456789ab" / "x",
           "named_like_a_step": root / "step_000000004"}[where]
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    manifest = (root / "step_000000002" / "manifest.json").read_bytes()
    with pytest.raises(asyncckpt.CheckpointConfigError, match=r"name a|name another"):
        export_safetensors(root, out, step=1, force=True)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before
    assert (root / "step_000000002" / "manifest.json").read_bytes() == manifest
    assert not verify_checkpoint(root / "step_000000002", LocalStorage()).problems


def test_export_to_a_path_ending_in_a_separator_is_refused(tmp_path: Path) -> None:
    asyncckpt.save({"w": torch.ones(2)}, tmp_path / "ck", step=1)
    with pytest.raises(asyncckpt.CheckpointConfigError, match="name it"):
        export_safetensors(tmp_path / "ck", f"{tmp_path}/outdir/")
    assert not (tmp_path / "outdir").exists()


def test_export_errors_name_the_side_they_come_from(tmp_path: Path) -> None:
    asyncckpt.save({"w": torch.ones(2)}, tmp_path / "ck", step=1)
    with pytest.raises(asyncckpt.CheckpointConfigError, match="cannot write /proc"):
        export_safetensors(tmp_path / "ck", "/proc/asyncckpt.safetensors")
    long_name = tmp_path / ("x" * 240 + ".safetensors")  # legal; its temporary must be too
    export_safetensors(tmp_path / "ck", long_name)
    assert load_file(str(long_name))["w"].tolist() == [1.0, 1.0]
    shard = tmp_path / "ck" / "step_000000001" / "rank_00000.safetensors"
    shard.unlink()
    shard.mkdir()  # unreadable as a file: the checkpoint's fault, not the output's
    with pytest.raises(asyncckpt.CheckpointCorruptError, match=r"rank_00000\.safetensors"):
        export_safetensors(tmp_path / "ck", tmp_path / "y.safetensors")
    assert main(["verify", str(tmp_path / "ck")]) == 1


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_export_never_replaces_what_is_not_a_regular_file(
        single: tuple[Path, dict[str, Any]], tmp_path: Path, kind: str) -> None:
    """The output is renamed into place: over a symlink (/dev/stdout) or a device
    (/dev/full) it would replace the node itself, even with --force."""
    root, _ = single
    out = tmp_path / "out.safetensors"
    target = tmp_path / "kept.safetensors"
    if kind == "symlink":
        target.write_bytes(b"precious")
        out.symlink_to(target)
    else:
        os.mkfifo(out)
    code, _, err = export(str(root), str(out), "--force")
    assert code == 2 and ("symlink" if kind == "symlink" else "not a regular file") in err
    assert out.is_symlink() if kind == "symlink" else stat.S_ISFIFO(os.lstat(out).st_mode)
    if kind == "symlink":
        assert target.read_bytes() == b"precious"


def test_export_of_only_unsupported_tensors_writes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    with AsyncCheckpointer(root, mode="sync") as ckpt:
        ckpt.save({"model": {"c": torch.ones(3, dtype=torch.complex128)},
                   "w": torch.ones(2)}, step=1)
    out = tmp_path / "out.safetensors"
    code, _, err = export(str(root), str(out), "--prefix", "model/")
    assert code == 2 and "model/c (complex128)" in err and "nothing to export" in err
    assert not out.exists() and leftovers(tmp_path) == []


def test_export_into_a_path_under_a_file_says_it_is_not_a_directory(
        single: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    root, _ = single
    (tmp_path / "afile").write_bytes(b"x")
    code, _, err = export(str(root), str(tmp_path / "afile" / "out.safetensors"))
    assert code == 2 and "is not a directory" in err


def _exporting(tmp_path: Path) -> tuple[Path, Path, subprocess.Popen[str]]:
    """(checkpoint root, output directory, the CLI process) of a 384 MiB export, once
    its temporary output file exists."""
    root = tmp_path / "ck"
    with AsyncCheckpointer(root, mode="sync") as ckpt:
        ckpt.save({f"w{i}": torch.randn(1 << 21) for i in range(48)}, step=1)  # 384 MiB
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "asyncckpt", "export", str(root),
                             str(out_dir / "o.safetensors"), "--dtype", "bf16"],
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not any(out_dir.iterdir()) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)  # until the temporary output exists
    return root, out_dir, proc


def test_export_ended_by_sigterm_leaves_no_temporary_file(tmp_path: Path) -> None:
    _, out_dir, proc = _exporting(tmp_path)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err  # (signalled as soon as its output file appeared)
    assert "interrupted" in err
    assert list(out_dir.iterdir()) == []


def test_the_temporary_of_a_killed_export_is_removed_by_the_next(tmp_path: Path) -> None:
    root, out_dir, proc = _exporting(tmp_path)
    proc.kill()  # no finally runs: its temporary stays
    proc.communicate(timeout=60)
    (left,) = out_dir.iterdir()
    assert left.name.startswith(".asyncckpt-export-") and str(proc.pid) in left.name
    # not to be touched: a live process's (this one's), another machine's, not ours
    keep = [f".asyncckpt-export-{export_mod._HOST}-{os.getpid()}-abc.tmp",
            f".asyncckpt-export-elsewhere-{proc.pid}-abc.tmp", "user-file.tmp"]
    for name in keep:
        (out_dir / name).write_bytes(b"x")
    code, _, err = export(str(root), str(out_dir / "small.safetensors"), "--prefix", "w1")
    assert code == 0, err
    assert sorted(p.name for p in out_dir.iterdir()) == sorted([*keep, "small.safetensors"])
    # the CLI says what it removed (it muted the export's warnings wholesale before)
    assert f"removed {out_dir / left.name}, left by an export that did not finish" in err
    assert not any(name in err for name in keep)


def test_export_cast_says_which_values_overflowed(tmp_path: Path) -> None:
    """fp16 tops out at 65504: a cast that turns finite weights into inf is worth a word."""
    big = torch.tensor([1.0, 7e4, -1e6, float("inf"), 3.0])
    asyncckpt.save({"big": big, "fine": torch.ones(3), "bf": big.to(torch.bfloat16)},
                   tmp_path / "c", step=1)
    out = tmp_path / "half.safetensors"
    code, _, err = export(str(tmp_path / "c"), str(out), "--dtype", "fp16")
    assert code == 0
    got = load_file(out)
    assert torch.isinf(got["big"]).tolist() == [False, True, True, True, False]
    # the inf that was inf before is not counted; "fine" has nothing to say
    assert "2 values of big are beyond the range of fp16 and became inf" in err
    assert "2 values of bf are" in err and "fine" not in err
    report = export_safetensors(tmp_path / "c", tmp_path / "b.safetensors", dtype="bf16")
    assert report.overflowed == {}  # float32 7e4 and 1e6 fit in bfloat16
    assert export_safetensors(tmp_path / "c", tmp_path / "h.safetensors",
                              dtype=torch.float16).overflowed == {"big": 2, "bf": 2}


@pytest.mark.parametrize("holder", ["committed", "lock", "step_without_manifest"])
def test_export_never_writes_a_manifest_into_a_checkpoint_directory(tmp_path: Path,
                                                                     holder: str) -> None:
    """ROOT/manifest.json would make the root read as a step directory: every load and
    verify of ROOT would then fail."""
    root = tmp_path / "ck"
    asyncckpt.save({"w": torch.ones(2)}, root, step=1)
    src = root
    if holder == "lock":  # a root whose first save is still to come
        src = tmp_path / "other"
        shutil.move(root, src)
        root.mkdir()
        (root / DirectoryLock.NAME).touch()
        src = src / "step_000000001"
    elif holder == "step_without_manifest":  # rank files, manifest lost: no new one
        shutil.copytree(root / "step_000000001", tmp_path / "best")
        (tmp_path / "best" / "manifest.json").unlink()
        root = tmp_path / "best"
    code, _, err = export(str(src), str(root / "manifest.json"), "--force")
    assert code == 2 and "would be read as the checkpoint manifest of" in err, err
    assert not (root / "manifest.json").exists() and leftovers(root) == []
    if holder == "committed":
        assert asyncckpt.load(root)["w"].tolist() == [1.0, 1.0]
        assert main(["verify", str(root)]) == 0
    # a manifest.json anywhere else is just a file name
    (tmp_path / "hf").mkdir()
    report = export_safetensors(src, tmp_path / "hf" / "manifest.json")
    assert list(load_file(report.out_path)) == ["w"]


def test_a_folder_merely_named_like_a_step_is_no_checkpoint(tmp_path: Path) -> None:
    """``hf/step_000000001/model.safetensors``: no manifest, no shard files, no checkpoint
    root around it: the name alone does not make it a checkpoint."""
    asyncckpt.save({"w": torch.ones(2)}, tmp_path / "ck", step=1)
    for out in (tmp_path / "hf" / "step_000000001" / "model.safetensors",
                tmp_path / "hf" / ".step_000000002.tmp-0123456789ab" / "model.safetensors",
                tmp_path / "hf" / "step_000000003"):
        out.parent.mkdir(parents=True, exist_ok=True)
        code, _, err = export(str(tmp_path / "ck"), str(out))
        assert code == 0, err
        assert load_file(out)["w"].tolist() == [1.0, 1.0]
    # with evidence it is refused: a manifest in it, shard files, or a checkpoint root
    step = tmp_path / "hf" / "step_000000001"
    for evidence in ("manifest.json", "rank_00000.safetensors"):
        (step / evidence).write_bytes(b"{}")
        code, _, err = export(str(tmp_path / "ck"), str(step / "m2.safetensors"))
        assert code == 2 and "inside the checkpoint directory" in err, err
        (step / evidence).unlink()
    (tmp_path / "hf" / DirectoryLock.NAME).touch()
    code, _, err = export(str(tmp_path / "ck"), str(step / "m3.safetensors"))
    assert code == 2 and "inside the checkpoint directory" in err, err
    assert not (step / "m2.safetensors").exists() and not (step / "m3.safetensors").exists()


@pytest.mark.parametrize("name", ["float8_e8m0fnu", "float4_e2m1fn_x2"])
def test_export_refuses_a_cast_target_it_cannot_write(tmp_path: Path, name: str) -> None:
    """A target safetensors cannot hold (or torch cannot convert to) is refused by its own
    name, not blamed on the tensors' dtypes, nor silently ignored."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        pytest.skip(f"this torch has no {name}")
    asyncckpt.save({"w": torch.ones(4)}, tmp_path / "c", step=1)
    out = tmp_path / "o.safetensors"
    with pytest.raises(asyncckpt.CheckpointConfigError,
                       match=rf"dtype=torch\.{name}: .*{name}.*; cast to one of .*bfloat16"):
        export_safetensors(tmp_path / "c", out, dtype=dtype)
    assert not out.exists() and leftovers(tmp_path) == []


def test_export_cast_to_float8_counts_overflow_to_nan(tmp_path: Path) -> None:
    """float8 formats: no crash (torch has no isinf for most), and values that overflow
    count whether they become inf (e5m2) or NaN (the fnuz formats, which have no inf)."""
    big = torch.tensor([1.0, 1e6, -1e6, float("inf"), float("nan"), 3.0])
    asyncckpt.save({"big": big}, tmp_path / "c", step=1)
    for name in ("float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3fn"):
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            continue
        out = tmp_path / f"{name}.safetensors"
        report = export_safetensors(tmp_path / "c", out, dtype=dtype)
        assert_exact(load_file(out)["big"], big.to(dtype), name)
        # inf, NaN, or (float8_e4m3fn, which saturates on this torch) 448: counted alike;
        # and the infinity, where the format has none to hold it
        assert report.overflowed == {"big": 2 if name == "float8_e5m2" else 3}, name


@pytest.mark.parametrize(("dtype", "values", "want"), [
    (torch.float16, [65504.0, 65519.0, 65521.0, -7e4], 2),  # 65519 rounds to 65504
    (torch.float8_e4m3fn, [448.0, 463.0, 465.0, -500.0, 1.0], 2),  # 463 rounds to 448
])
def test_export_counts_values_beyond_the_range_not_those_that_round_to_its_edge(
        tmp_path: Path, dtype: torch.dtype, values: list[float], want: int) -> None:
    asyncckpt.save({"w": torch.tensor(values)}, tmp_path / "c", step=1)
    report = export_safetensors(tmp_path / "c", tmp_path / "o.safetensors", dtype=dtype)
    assert report.overflowed == {"w": want}


def test_export_of_an_uncommitted_dir_warns_as_verify_does(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    asyncckpt.save({"w": torch.ones(2)}, root, step=1)
    tmp = root / ".step_000000002.tmp-0123456789ab"
    shutil.copytree(root / "step_000000001", tmp)  # a crash between manifest and rename
    gone = root / ".step_000000001.deleting-0123456789ab"
    shutil.copytree(root / "step_000000001", gone)
    for src, what in ((tmp, "is the temporary directory of a save that did not commit"),
                      (gone, "is a step being removed by retention")):
        out = tmp_path / f"{src.name}.safetensors"
        code, _, err = export(str(src), str(out))
        assert code == 0 and err.startswith(f"asyncckpt: warning: {src} {what}"), err
        assert load_file(out)["w"].tolist() == [1.0, 1.0]
        assert main(["verify", str(src)]) == 0
    for src in (root, root / "step_000000001"):  # committed: nothing to say
        code, _, err = export(str(src), str(tmp_path / "c.safetensors"), "--force")
        assert code == 0 and err == "", err


def test_export_casts_a_float8_checkpoint_to_a_narrower_float8(tmp_path: Path) -> None:
    """torch has no isfinite for most float8 formats: the source side needs widening too."""
    w = torch.tensor([1.0, 2.0, 300.0, -448.0, 0.5]).to(torch.float8_e4m3fn)
    asyncckpt.save({"w": w}, tmp_path / "c", step=1)
    out = tmp_path / "o.safetensors"
    report = export_safetensors(tmp_path / "c", out, dtype=torch.float8_e4m3fnuz)
    assert_exact(load_file(out)["w"], w.to(torch.float8_e4m3fnuz), "w")
    assert report.overflowed == {"w": 2}  # 300 and -448 lie beyond e4m3fnuz's 240


def test_export_refuses_a_tied_name_that_another_tensor_is_written_under(tmp_path: Path
                                                                         ) -> None:
    """A key holding '/' reads as the nested path: a tied copy named 'a/b' must not hide
    that a different tensor is written as 'a/b' (the report would tie it to 'x')."""
    w, v = torch.ones(2), torch.zeros(2)
    for i, state in enumerate(({"x": w, "a": {"b": w}, "a/b": v},
                               {"x": w, "a/b": v, "a": {"b": w}})):
        asyncckpt.save(state, tmp_path / f"c{i}", step=1)
        out = tmp_path / f"o{i}.safetensors"
        with pytest.raises(asyncckpt.CheckpointConfigError,
                           match=r"tensor 'a%2Fb' would be named 'a/b' in the output, as is"
                                 r"|'a/b' would be named 'a/b' in the output, as is the "
                                 r"tensor saved as 'a%2Fb'"):  # (saved paths as inspect shows)
            export_safetensors(tmp_path / f"c{i}", out)
        assert not out.exists()
    # the same tensor under one name twice is no conflict: written once, no alias
    asyncckpt.save({"a": {"b": w}, "a/b": w, "t": w}, tmp_path / "same", step=1)
    report = export_safetensors(tmp_path / "same", tmp_path / "same.safetensors")
    assert sorted(load_file(tmp_path / "same.safetensors")) == ["a/b"]
    assert report.aliases == {"t": "a/b"}


def test_export_writes_a_tensor_whose_key_is_empty(tmp_path: Path) -> None:
    """safetensors allows the name ''; only stripping a prefix down to nothing is refused,
    and that error (not another) speaks of the prefix."""
    a, b = torch.ones(2), torch.arange(3.0)
    asyncckpt.save({"": a, "m": {"": b}}, tmp_path / "c", step=1)
    out = tmp_path / "o.safetensors"
    export_safetensors(tmp_path / "c", out)
    got = load_file(out)
    assert sorted(got) == ["", "m/"]
    assert_exact(got[""], a, "''")
    assert_exact(got["m/"], b, "m/")
    with pytest.raises(asyncckpt.CheckpointConfigError,
                       match=r"'m/' would be named '' in the output, which is empty once "
                             r"the prefix is stripped; use a shorter prefix"):
        export_safetensors(tmp_path / "c", tmp_path / "p.safetensors", prefix="m",
                           strip_prefix=True)


def test_export_from_a_directory_whose_name_is_not_utf8_loads(tmp_path: Path) -> None:
    """The source's name goes into the metadata: undecodable bytes must not make the
    whole file unreadable to safetensors."""
    asyncckpt.save({"w": torch.ones(2)}, tmp_path / "c", step=1)
    odd = os.fsdecode(os.fsencode(tmp_path) + b"/copy\xff")
    shutil.copytree(tmp_path / "c" / "step_000000001", odd)
    out = tmp_path / "o.safetensors"
    export_safetensors(odd, out)
    assert load_file(out)["w"].tolist() == [1.0, 1.0]
    with safetensors.safe_open(out, "pt") as f:
        assert f.metadata()["asyncckpt_source"] == "copy\\xff"


def test_export_speaks_of_keys_as_they_were_not_as_the_manifest_escapes_them(
        tmp_path: Path) -> None:
    # The prefix is matched against the keys as saved ("a/b"); the hint listed them
    # escaped ("a%2Fb"), which, passed as the prefix, selects nothing.
    asyncckpt.save({"x%y": torch.ones(1), "a/b": torch.zeros(1)}, tmp_path / "c", step=0)
    with pytest.raises(asyncckpt.CheckpointConfigError) as info:
        export_safetensors(tmp_path / "c", tmp_path / "o.safetensors", prefix="nothing")
    assert str(info.value).endswith("start with: 'a/b', 'x%y'")
    export_safetensors(tmp_path / "c", tmp_path / "o.safetensors", prefix="a/b")
    assert list(load_file(tmp_path / "o.safetensors")) == ["a/b"]
    # (stop 48's trial) a step of no tensors at all: "no tensor is under '' ...: none"
    asyncckpt.save({"step": 3, "lr": 0.1}, tmp_path / "none", step=1)
    with pytest.raises(asyncckpt.CheckpointConfigError,
                       match=r"^step 1 holds no tensors: nothing to export$"):
        export_safetensors(tmp_path / "none", tmp_path / "n.safetensors")


# --- max_shard_bytes: a directory of files, as Hugging Face publishes a model -------------------


def _many(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(21)
    model = {"emb": torch.randn(500, generator=g), "w1": torch.randn(100, generator=g),
             "w2": torch.randn(120, generator=g).to(torch.bfloat16),
             "ids": torch.arange(40), "b": torch.randn(7, generator=g)}
    asyncckpt.save({"model": model, "step": 3}, tmp_path / "ck", step=3)
    return tmp_path / "ck", model


def test_a_sharded_export_is_a_hugging_face_directory(tmp_path: Path) -> None:
    root, model = _many(tmp_path)
    out = tmp_path / "hf"
    report = export_safetensors(root, out, prefix="model", strip_prefix=True,
                                max_shard_bytes=1000)
    files = sorted(p.name for p in out.iterdir())
    n = len(files) - 1
    assert n >= 3 and files == sorted([*(f"model-{i:05d}-of-{n:05d}.safetensors"
                                         for i in range(1, n + 1)),
                                       "model.safetensors.index.json"])
    assert sorted(report.files) == files and report.out_path == out
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in model.values())
    assert index["weight_map"] == report.weight_map and set(index["weight_map"]) == set(model)
    for name, t in model.items():  # every file a plain safetensors file holding its share
        shard = load_file(out / index["weight_map"][name])
        assert torch.equal(shard[name], t), name
    for f in set(index["weight_map"].values()):  # at most 1000 bytes, but for a larger one
        sizes = [t.nbytes for k, t in model.items() if index["weight_map"][k] == f]
        assert sum(sizes) <= 1000 or len(sizes) == 1
    assert index["weight_map"]["emb"] != index["weight_map"]["w1"]  # 2000 bytes: alone
    back = asyncckpt.load_safetensors(out)
    assert all(torch.equal(back[k], t) for k, t in model.items()) and set(back) == set(model)


def test_a_sharded_export_that_fits_one_file_is_model_safetensors(tmp_path: Path) -> None:
    root, model = _many(tmp_path)
    report = export_safetensors(root, tmp_path / "hf", prefix="model/", strip_prefix=True,
                                max_shard_bytes=10**9)
    assert report.files == ["model.safetensors"] and report.weight_map == {
        k: "model.safetensors" for k in model}
    assert [p.name for p in (tmp_path / "hf").iterdir()] == ["model.safetensors"]


def test_a_sharded_export_replaces_only_an_earlier_export(tmp_path: Path) -> None:
    root, _ = _many(tmp_path)
    out = tmp_path / "hf"
    export_safetensors(root, out, max_shard_bytes=1000)
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(CheckpointExistsError, match="already exists"):
        export_safetensors(root, out, max_shard_bytes=3000)
    assert sorted(p.name for p in out.iterdir()) == before
    export_safetensors(root, out, max_shard_bytes=10**9, force=True)
    assert [p.name for p in out.iterdir()] == ["model.safetensors"]
    (out / "README.md").write_text("mine")
    with pytest.raises(asyncckpt.CheckpointConfigError, match=r"holds more than an export "
                       r"\(README\.md\)"):
        export_safetensors(root, out, max_shard_bytes=1000, force=True)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "hf"]  # no temporaries
    with pytest.raises(asyncckpt.CheckpointConfigError, match="max_shard_bytes=0"):
        export_safetensors(root, tmp_path / "x", max_shard_bytes=0)
    (tmp_path / "fresh").mkdir()
    for name in ("manifest.json", ".asyncckpt.lock"):  # a root's: its loads or its lock
        with pytest.raises(asyncckpt.CheckpointConfigError, match="name the export's"):
            export_safetensors(root, tmp_path / "fresh" / name, max_shard_bytes=1000)
    (tmp_path / "fresh").rmdir()
    with pytest.raises(asyncckpt.CheckpointConfigError, match="named like a step directory"):
        export_safetensors(root, root / "step_000000009", max_shard_bytes=1000)
    with pytest.raises(asyncckpt.CheckpointConfigError, match="inside the checkpoint"):
        export_safetensors(root, root / "step_000000003" / "hf", max_shard_bytes=1000)
    assert asyncckpt.AsyncCheckpointer(root).steps() == [3]


def test_a_sharded_export_of_a_damaged_checkpoint_leaves_nothing(tmp_path: Path) -> None:
    root, _ = _many(tmp_path)
    shard = root / "step_000000003" / "rank_00000.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-5] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(asyncckpt.CheckpointCorruptError):
        export_safetensors(root, tmp_path / "hf", max_shard_bytes=1000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_the_directory_of_a_killed_sharded_export_is_removed_by_the_next(
        tmp_path: Path) -> None:
    root, _ = _many(tmp_path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    left = tmp_path / f".asyncckpt-export-{export_mod._HOST}-{dead.stdout.strip()}-abc.tmp"
    left.mkdir()
    (left / "model-00001-of-00002.safetensors").write_bytes(b"half")
    export_safetensors(root, tmp_path / "hf", max_shard_bytes=1000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "hf"]


def test_cli_export_max_shard_size(tmp_path: Path) -> None:
    root, model = _many(tmp_path)
    code, out, err = export(str(root), str(tmp_path / "hf"), "--prefix", "model",
                            "--strip-prefix", "--max-shard-size", "1KB")
    assert code == 0, err
    assert "files: model-00001-of-0000" in out and "model.safetensors.index.json" in out
    back = asyncckpt.load_safetensors(tmp_path / "hf")
    assert all(torch.equal(back[k], t) for k, t in model.items())
    code, _, err = export(str(root), str(tmp_path / "x"), "--max-shard-size", "5XB")
    assert code == 2 and "is no size" in err
    code, out, err = export(str(root), str(tmp_path / "y"), "--max-shard-size", "0.5KiB",
                            "--json")
    doc = json.loads(out)
    assert code == 0 and len(doc["files"]) > 2
    # each tensor's file, as the index has it (a trial read the index instead)
    index = json.loads((tmp_path / "y" / "model.safetensors.index.json").read_text())
    assert doc["weight_map"] == index["weight_map"] and len(doc["weight_map"]) == len(model)


def test_an_export_whose_header_safetensors_would_refuse_is_refused_and_can_be_split(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = {f"{'k' * 100}{i}": torch.full((4,), float(i)) for i in range(300)}
    asyncckpt.save(state, tmp_path / "ck", step=0)
    monkeypatch.setattr(export_mod, "WRITE_MAX_HEADER_BYTES", 20_000)  # (~49 KB needed)
    out = tmp_path / "out" / "model.safetensors"
    out.parent.mkdir()
    with pytest.raises(asyncckpt.CheckpointConfigError,
                       match=r"header of 300 tensors would take [\d,]+ bytes, over the 20,000 "
                             r"that safetensors readers accept: pass max_shard_bytes"):
        export_safetensors(tmp_path / "ck", out)
    assert list(out.parent.iterdir()) == []  # nothing left behind
    report = export_safetensors(tmp_path / "ck", tmp_path / "split", max_shard_bytes=16 * 100)
    files = sorted((tmp_path / "split").glob("*.safetensors"))
    assert len(files) == 3 and len(report.tensors) == 300
    back: dict[str, torch.Tensor] = {}
    for f in files:
        assert f.stat().st_size < 20_000 + 100 * 16
        back.update(safetensors.torch.load_file(str(f)))
    assert set(back) == set(state) and all(torch.equal(back[k], v) for k, v in state.items())


def test_a_sharded_export_checks_every_header_before_it_writes_any(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """(The review: a shard whose header safetensors would refuse was found only once
    the shards before it were written, then removed.)"""
    state = {f"s{i:03d}": torch.ones(4) for i in range(150)}  # a first shard that fits
    state.update({f"{'k' * 100}{i}": torch.ones(4) for i in range(150)})  # a second: not
    asyncckpt.save(state, tmp_path / "ck", step=0)
    monkeypatch.setattr(export_mod, "WRITE_MAX_HEADER_BYTES", 20_000)
    writes: list[int] = []
    real = export_mod._write_all
    monkeypatch.setattr(export_mod, "_write_all", lambda fd, data: (writes.append(len(data)),
                                                                    real(fd, data))[1])
    with pytest.raises(asyncckpt.CheckpointConfigError, match="header of 150 tensors would "
                                                              "take"):
        export_safetensors(tmp_path / "ck", tmp_path / "out", max_shard_bytes=150 * 16)
    assert writes == [] and not (tmp_path / "out").exists()


# --- F4 (packed float4) and F8_E8M0, which safetensors 0.8 writes ------------------------------

needs_fp4 = pytest.mark.skipif(
    not (hasattr(torch, "float4_e2m1fn_x2") and hasattr(torch, "float8_e8m0fnu")),
    reason="this torch has no float4_e2m1fn_x2 or float8_e8m0fnu")


def _mx_state() -> dict[str, Any]:
    """Packed 4-bit weights and their power-of-two scales (random bits: NaN scales too)."""
    g = torch.Generator().manual_seed(11)
    bits = torch.randint(0, 256, (5, 6, 8), dtype=torch.uint8, generator=g)
    return {"model": {"q": bits.view(torch.float4_e2m1fn_x2),
                      "s": bits[:, :, 0].clone().view(torch.float8_e8m0fnu),
                      "qe": torch.zeros(3, 0, dtype=torch.uint8).view(torch.float4_e2m1fn_x2),
                      "w": randn(4, seed=12, dtype=torch.bfloat16)}}


@needs_fp4
@pytest.mark.parametrize("world", [1, 2])
def test_export_writes_f4_and_f8_e8m0_as_safetensors_does(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, world: int) -> None:
    """(The trial: both were skipped, 'safetensors has no dtype for ...'.) Bit-exact, in
    the header safetensors' own save_file writes, and back to the dtype and shape they
    had through safetensors' reader and asyncckpt's."""
    state = _mx_state()
    root = tmp_path / "ck"
    if world == 1:
        asyncckpt.save(state, root, step=1)
    else:  # the packed tensor split along its last dim, the scales along the first
        save_sharded(root, state, {"model/q": 2, "model/s": 0}, 1, monkeypatch)
    out = tmp_path / "mx.safetensors"
    report = export_safetensors(root, out, prefix="model", strip_prefix=True)
    assert not report.skipped
    want = dict(state["model"])
    save_file(want, str(tmp_path / "ref.safetensors"))  # what safetensors itself writes
    ours, theirs = _headers(out), _headers(tmp_path / "ref.safetensors")
    assert set(ours) - {"__metadata__"} == set(want)
    for k in want:
        assert ours[k]["dtype"] == theirs[k]["dtype"] and ours[k]["shape"] == theirs[k]["shape"]
    assert ours["q"]["dtype"] == "F4" and ours["q"]["shape"] == [5, 6, 16]
    assert ours["s"]["dtype"] == "F8_E8M0"
    got = load_file(out)
    back = asyncckpt.load_safetensors(out)
    for k, t in want.items():
        assert_exact(got[k], t, k)
        assert_exact(back[k], t, k)
        assert torch.equal(got[k].view(torch.uint8), t.view(torch.uint8)), k


def _headers(path: Path) -> dict[str, Any]:
    raw_bytes = path.read_bytes()
    n = int.from_bytes(raw_bytes[:8], "little")
    header: dict[str, Any] = json.loads(raw_bytes[8:8 + n])
    return header


@needs_fp4
def test_export_keeps_packed_float4_under_a_cast_and_skips_only_a_0d_one(
        tmp_path: Path) -> None:
    """A cast leaves the packed float4 as it is (torch cannot convert it); a 0-d one (two
    values) has no F4 shape, as safetensors' save_file refuses it too, and is skipped
    saying why."""
    state = _mx_state()
    zero_d = torch.tensor(0x3C, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    with pytest.raises(safetensors.SafetensorError, match="byte boundary"):
        save_file({"z": zero_d}, str(tmp_path / "no.safetensors"))
    state["model"]["z"] = zero_d
    asyncckpt.save(state, tmp_path / "ck", step=1)
    out = tmp_path / "bf16.safetensors"
    report = export_safetensors(tmp_path / "ck", out, dtype="bf16")
    assert [(s.key, s.dtype) for s in report.skipped] == [("model/z", "float4_e2m1fn_x2")]
    assert "0-d" in report.skipped[0].reason and "reshape it" in report.skipped[0].reason
    got = load_file(out)
    assert_exact(got["model/q"], state["model"]["q"], "q")
    assert got["model/w"].dtype == torch.bfloat16 and "model/z" not in got


def test_export_warns_of_a_wrapper_s_prefix_on_every_name_and_says_how_to_drop_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A trial exported a torch.compile'd model with --prefix model --strip-prefix and got
    _orig_mod.* names, which no model loads, without a word."""
    model = torch.compile(torch.nn.Linear(2, 2))
    asyncckpt.save({"model": model}, tmp_path / "ck", step=1)
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        export_safetensors(tmp_path / "ck", tmp_path / "a.safetensors", prefix="model",
                           strip_prefix=True)
    said = [r.getMessage() for r in caplog.records if "wrapper" in r.getMessage()]
    assert len(said) == 1 and "prefix='model/_orig_mod.'" in said[0], said
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):  # as it advises: quiet
        export_safetensors(tmp_path / "ck", tmp_path / "b.safetensors",
                           prefix="model/_orig_mod.", strip_prefix=True)
    assert not caplog.records
    assert sorted(load_file(str(tmp_path / "b.safetensors"))) == ["bias", "weight"]


def test_export_warns_of_a_key_s_own_slash(tmp_path: Path,
                                            caplog: pytest.LogCaptureFixture) -> None:
    asyncckpt.save({"x": {"a/b": torch.ones(1), "c": torch.ones(1)}}, tmp_path / "ck", step=1)
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        export_safetensors(tmp_path / "ck", tmp_path / "a.safetensors")
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "1 tensor name(s) hold a '/' of their key's own ('x/a/b')" in \
        said[0], said
    assert asyncckpt.load_safetensors(tmp_path / "a.safetensors")["x"]["a"]["b"].item() == 1.0


def test_a_run_of_small_tensors_is_written_from_the_tensors_through_short_writes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # (a memory trial saw each 64 MiB run held twice: a join of the tensors' bytes; the
    # run is now written from them with writev, which may write less than asked)
    import asyncckpt.export as export_module

    real = os.writev
    calls: list[int] = []

    def short(fd: int, buffers: Any) -> int:
        calls.append(len(buffers))
        return real(fd, [bytes(memoryview(buffers[0]).cast("B")[:7])])  # (7 bytes a call)

    monkeypatch.setattr(export_module.os, "writev", short)
    path = tmp_path / "out.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    views = [memoryview(bytes(range(i, i + 10))) for i in range(5)] + [memoryview(b"")]
    views.append(memoryview(torch.arange(3, dtype=torch.int16).numpy()))  # (format 'h')
    export_module._writev_all(fd, views)
    os.close(fd)
    assert path.read_bytes() == b"".join(bytes(v.cast("B")) for v in views)
    assert max(calls) == 6 and len(calls) > 5


def test_a_full_disk_under_the_output_is_a_save_error_leaving_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CLI trial's export onto a full disk was told CheckpointConfigError (a setting to
    change) for "No space left on device"."""
    import errno as errno_

    import asyncckpt.export as export_mod

    asyncckpt.save({"model": {"w": torch.ones(1000)}}, tmp_path / "ck", step=1)

    def full(fd: int, data: Any) -> int:
        raise OSError(errno_.ENOSPC, "No space left on device")

    monkeypatch.setattr(export_mod.os, "write", full)
    out = tmp_path / "out" / "m.safetensors"
    out.parent.mkdir()
    with pytest.raises(asyncckpt.CheckpointSaveError, match=r"cannot write .*m\.safetensors: "
                       r"No space left on device; the export was not published: free "
                       r"space"):
        export_safetensors(tmp_path / "ck", out)
    monkeypatch.undo()
    assert os.listdir(out.parent) == []
