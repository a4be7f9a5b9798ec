"""The asyncckpt command line: ls, inspect, verify, on real checkpoints."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

import asyncckpt
import asyncckpt.storage as storage_mod
from _manifests import long_entries
from asyncckpt import tree
from asyncckpt.cli import _iso, _when, human_bytes, main
from asyncckpt.manifest import shard_file_name
from asyncckpt.reader import read_manifest
from asyncckpt.storage import LocalStorage

HOST = socket.gethostname()  # (the lock file names it beside the pid)


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(4, 8, generator=g), "b": torch.zeros(8, dtype=torch.bfloat16)},
        "ids": torch.arange(5, dtype=torch.int64),
        "train": {"step": step, "lr": 0.5},
    }


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A checkpoint root with steps 10, 20, 30 committed."""
    d = tmp_path / "ckpts"
    with asyncckpt.AsyncCheckpointer(d, mode="async") as ckpt:
        for step in (10, 20, 30):
            ckpt.save_async(_state(step), step).wait()
    return d


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def flip_byte(step_dir: Path, tensor: str, offset: int = 3) -> None:
    manifest = long_entries(json.loads((step_dir / "manifest.json").read_text()))
    chunk = manifest["tensors"][tensor]["chunks"][0]
    start, end = chunk["byte_range"]
    assert end - start > offset
    with open(step_dir / chunk["file"], "r+b") as f:
        f.seek(start + offset)
        b = f.read(1)
        f.seek(start + offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_human_bytes() -> None:
    assert human_bytes(0) == "0 B"
    assert human_bytes(1023) == "1023 B"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(3 * 1024**3) == "3.0 GiB"


def test_ls_table(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "ls", str(root))
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split() == ["STEP", "SIZE", "TENSORS", "CREATED"]
    rows = [ln.split() for ln in lines[1:4]]
    assert [r[0] for r in rows] == ["10", "20", "30"]
    assert all(r[3] == "3" for r in rows)  # model/w, model/b, ids
    assert rows[2][-1] == "latest" and rows[0][-1] != "latest"
    assert "3 committed steps" in out
    assert "incomplete" not in out


def test_ls_says_what_a_step_s_directory_holds_on_disk(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An ops trial: a shard cut to 1,000 bytes was listed at the size its manifest
    claims, and a stray 3 MB file in a step directory was neither counted nor told."""
    step = root / "step_000000020"
    (step / "core.1234").write_bytes(b"x" * 3000)
    code, out, _ = run(capsys, "ls", str(root), "--json")
    rows = {r["step"]: r for r in json.loads(out)["steps"]}
    assert code == 0, out  # (a file no save wrote is no damage)
    assert rows[10]["disk_bytes"] == rows[10]["bytes"] and rows[10]["extra_files"] == []
    assert rows[20]["extra_files"] == ["core.1234"]
    assert rows[20]["disk_bytes"] == rows[20]["bytes"] + 3000
    shard = step / "rank_00000.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(100)
    code, out, _ = run(capsys, "ls", str(root), "--json")
    row = {r["step"]: r for r in json.loads(out)["steps"]}[20]
    assert code == 1 and row["damaged"], out
    assert row["disk_bytes"] == sum(p.stat().st_size for p in step.iterdir())
    code, out, _ = run(capsys, "ls", str(root))
    assert "1 entry no save wrote: core.1234" in out, out
    assert "in their directories)" in out, out
    # a subdirectory's files count too, as du counts them (a QA re-check: left out)
    (step / "sub").mkdir()
    (step / "sub" / "x").write_bytes(b"y" * 5000)
    code, out, _ = run(capsys, "ls", str(root), "--json")
    row = {r["step"]: r for r in json.loads(out)["steps"]}[20]
    assert row["extra_files"] == ["core.1234", "sub/"], row
    assert row["disk_bytes"] == 5000 + sum(p.stat().st_size for p in step.iterdir()
                                           if p.is_file()), row


def test_ls_stats_a_step_s_files_once(
        root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """ls lists each step's directory for its disk usage; the sizes its damage check
    compares are taken from that listing, not from a second stat of every file (a
    metadata call per file and step saved, on NFS)."""
    from asyncckpt import commit

    stated: list[str] = []
    real_stat = os.stat

    def counting_stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        stated.append(os.fspath(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(commit.os, "stat", counting_stat)
    code, out, _ = run(capsys, "ls", str(root), "--json")
    assert code == 0 and len(json.loads(out)["steps"]) == 3, out
    assert not [p for p in stated if p.endswith(".safetensors")], stated
    # a shard cut short is still told, from the listing's size
    shard = root / "step_000000020" / "rank_00000.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(100)
    code, out, _ = run(capsys, "ls", str(root), "--json")
    row = {r["step"]: r for r in json.loads(out)["steps"]}[20]
    assert code == 1 and len(row["damaged"]) == 1, row
    assert row["damaged"][0].startswith("rank_00000.safetensors is 100 bytes, not "), row
    # a link in a shard's place is followed, as a load follows it
    shard.unlink()
    (root / "elsewhere").mkdir()
    (root / "elsewhere" / "s").write_bytes(b"z" * 100)
    shard.symlink_to(root / "elsewhere" / "s")
    code, out, _ = run(capsys, "ls", str(root), "--json")
    row = {r["step"]: r for r in json.loads(out)["steps"]}[20]
    assert code == 1 and "rank_00000.safetensors is 100 bytes" in row["damaged"][0], row


def test_steps_without_their_manifest_are_listed_in_order(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # (an ops trial: in directory order, which made cron logs diff noisily)
    for s in (85, 58, 74, 59, 84, 27):
        (root / f"step_{s:09d}").mkdir()
    code, out, _ = run(capsys, "ls", str(root), "--json")
    assert code == 1  # (steps without their manifest)
    bare = json.loads(out)["without_manifest"]
    assert bare == sorted(bare) and len(bare) == 6, bare
    _, out, _ = run(capsys, "clean", str(root), "--without-manifest", "--dry-run", "--json")
    names = [r["name"] for r in json.loads(out)["abandoned"] if r["kind"] == "without_manifest"]
    assert names == sorted(names) and len(names) == 6, out


def test_ls_json_and_abandoned(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (root / ".step_000000040.tmp-0123abcd").mkdir()
    (root / "step_000000050").mkdir()  # no manifest: not committed (its manifest lost?)
    code, out, _ = run(capsys, "ls", str(root), "--json")
    assert code == 1  # a checkpoint lost, or a copy cut short: not "all is well"
    doc = json.loads(out)
    assert [s["step"] for s in doc["steps"]] == [10, 20, 30]
    assert doc["latest"] == 30
    assert doc["incomplete"] == [".step_000000040.tmp-0123abcd"]
    assert doc["without_manifest"] == doc["no_manifest"] == ["step_000000050"]  # (both names)
    assert doc["ok"] is False  # as verify's documents say it
    manifest = asyncckpt.AsyncCheckpointer(root).manifest(20)
    s20 = doc["steps"][1]
    # (its files and its manifest.json: a state of 59 MB of scalars showed 4 KiB)
    d20 = root / "step_000000020"
    assert s20["bytes"] == manifest.total_bytes + (d20 / "manifest.json").stat().st_size
    assert s20["bytes"] == sum(f.stat().st_size for f in d20.iterdir())
    assert s20["tensors"] == 3
    assert s20["created_unix"] == manifest.created_unix
    assert Path(s20["path"]).name == "step_000000020"
    code, out, _ = run(capsys, "ls", str(root))
    assert "1 incomplete or abandoned temp dir" in out
    assert ".step_000000040.tmp-0123abcd" in out
    assert "1 step directory without manifest.json (checkpoints whose manifest was lost" in out
    assert "step_000000050" in out
    # verify ROOT (the latest committed step, 30): intact, but a newer step lost its
    # manifest (a cron job on it saw OK, exit 0); --all says so as well
    code, out, _ = run(capsys, "verify", str(root))
    first, second = out.splitlines()[:2]
    assert code == 1 and first.startswith(f"DAMAGED {root}: ") and (
        "newer step directory without manifest.json: step_000000050: the newest checkpoint "
        "lost its manifest") in first and first.endswith("loads take step 30:"), out
    assert second.startswith("OK ") and "step 30" in second
    code, out, _ = run(capsys, "verify", str(root), "--json")
    doc = json.loads(out)
    assert code == 1 and doc["ok"] is False and doc["without_manifest"] == doc[
        "newer_without_manifest"] == ["step_000000050"]
    code, out, _ = run(capsys, "verify", str(root), "--all", "--json")
    assert code == 1 and json.loads(out)["without_manifest"] == ["step_000000050"]
    code, _, _ = run(capsys, "verify", str(root), "--step", "20")  # (a step named: its verdict)
    assert code == 0
    code, _, err = run(capsys, "verify", str(root), "--step", "50")
    assert code == 1 and ("step_000000050 is there without its manifest.json (the manifest "
                          "lost, or a copy cut short)") in err, err
    (root / "step_000000050").rmdir()
    (root / "step_000000005").mkdir()  # older: verify ROOT's latest is not concerned
    assert run(capsys, "verify", str(root))[0] == 0
    assert run(capsys, "verify", str(root), "--all")[0] == 1


def test_ls_marks_a_step_whose_files_are_missing_or_cut_short(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # (listed as a healthy "latest" step, while a load of it failed at once)
    shard = "rank_00000.safetensors"
    (root / "step_000000030" / shard).unlink()
    with open(root / "step_000000020" / shard, "r+b") as f:
        f.truncate(100)
    code, out, _ = run(capsys, "ls", str(root))
    assert code == 1  # a corrupt checkpoint, as verify says (it exited 0)
    rows = {ln.split()[0]: ln for ln in out.splitlines()[1:4]}
    assert rows["30"].endswith(f"latest, DAMAGED: {shard} is missing (run 'asyncckpt verify "
                               f"{root} --step 30')")
    assert f"DAMAGED: {shard} is 100 bytes, not " in rows["20"]
    assert "DAMAGED" not in rows["10"]
    code, out, _ = run(capsys, "ls", str(root), "--json")
    doc = json.loads(out)
    size = asyncckpt.AsyncCheckpointer(root).manifest(20).files[shard].bytes
    assert [s["damaged"] for s in doc["steps"]] == [
        [], [f"{shard} is 100 bytes, not {size}"], [f"{shard} is missing"]]


def test_ls_marks_a_step_a_fallback_load_found_damaged(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # (its files all there, of their sizes: without damaged.json ls said nothing amiss)
    shard = root / "step_000000030" / "rank_00000.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 1
    shard.write_bytes(bytes(raw))
    assert run(capsys, "ls", str(root))[0] == 0
    with asyncckpt.AsyncCheckpointer(root) as ck:
        ck.load(fallback=True)
    code, out, _ = run(capsys, "ls", str(root))
    assert code == 1, out
    row = next(ln for ln in out.splitlines() if ln.split()[:1] == ["30"])
    assert "latest, DAMAGED: a load found it damaged at 20" in row, row
    assert "(damaged.json: " in row and "checksum mismatch" in row, row
    doc = json.loads(run(capsys, "ls", str(root), "--json")[1])
    assert [bool(s["damaged"]) for s in doc["steps"]] == [False, False, True]
    code, out, _ = run(capsys, "verify", str(root / "step_000000030"))
    assert code == 1 and "delete" not in out, out
    shard.write_bytes(bytes(raw[:-1] + bytes([raw[-1] ^ 1])))  # mended
    code, out, _ = run(capsys, "verify", str(root))
    assert code == 0 and "a load found it damaged at 20" in out, out
    assert f"it verifies now: if that was a passing fault, delete {root / 'step_000000030'}" \
        f"/damaged.json" in out, out
    doc = json.loads(run(capsys, "verify", str(root), "--json")[1])
    assert doc["ok"] and "checksum mismatch" in doc["damaged_mark"]["problem"], doc
    code, out, _ = run(capsys, "verify", str(root), "--all")  # (every step: said there too)
    assert code == 0 and "delete " + str(root / "step_000000030" / "damaged.json") in out, out
    doc = json.loads(run(capsys, "verify", str(root), "--all", "--json")[1])
    assert [("damaged_mark" in s) for s in doc["steps"]] == [False, False, True], doc
    (root / "step_000000030" / "damaged.json").write_bytes(b" " * 70000)  # (over the limit)
    assert "damaged.json cannot be read" in run(capsys, "ls", str(root))[1]
    (root / "step_000000030" / "damaged.json").write_text("{not json")
    assert "its damage mark is unreadable: damaged.json is not a JSON object" in run(
        capsys, "ls", str(root))[1]


def test_ls_says_a_garbage_damage_mark_is_unreadable_with_verify_s_advice(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """(a crash trial) ls showed a damaged.json of garbage as a load's verdict, "a load
    found it damaged (damaged.json: damaged.json is not a JSON object)": it says the mark
    is unreadable, and what verify says to do of it (delete it where the step verifies)."""
    mark = root / "step_000000020" / "damaged.json"
    mark.write_bytes(b"\x00\xffgarbage{{")
    code, out, _ = run(capsys, "ls", str(root))
    row = next(ln for ln in out.splitlines() if ln.split()[:1] == ["20"])
    assert code == 1 and "DAMAGED: a load found it damaged" not in row, row
    assert ("DAMAGED: its damage mark is unreadable: damaged.json is not a JSON object; "
            "whether a load found it damaged is unknown: if verify finds the step intact, "
            f"delete {mark} (run 'asyncckpt verify {root} --step 20')") in row, row
    code, out, _ = run(capsys, "verify", str(root), "--step", "20")  # (the advice it gives)
    assert code == 0 and f"it verifies now: if that was a passing fault, delete {mark}" in out
    assert "its damage mark is unreadable" in out and "a load found it damaged (" not in out


def test_ls_empty_and_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "ls", str(tmp_path))
    assert code == 0 and "no committed checkpoints" in out
    code, out, err = run(capsys, "ls", str(tmp_path / "nope"))
    assert code == 2 and out == ""
    assert "nope does not exist" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_inspect_table(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "inspect", str(root))
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split() == ["PATH", "DTYPE", "SHAPE", "BYTES", "FILE"]
    by_path = {ln.split()[0]: ln for ln in lines[1:4]}
    assert set(by_path) == {"model/w", "model/b", "ids"}
    assert "float32" in by_path["model/w"] and "[4, 8]" in by_path["model/w"]
    assert by_path["model/w"].split()[-2:] == ["128", "rank_00000.safetensors"]
    assert "bfloat16" in by_path["model/b"] and by_path["model/b"].split()[-2] == "16"
    assert "int64" in by_path["ids"] and by_path["ids"].split()[-2] == "40"
    summary = lines[4]
    assert summary.startswith("step 30  world size 1  3 tensors  184 tensor bytes")
    assert f"asyncckpt {asyncckpt.__version__}" in summary
    assert "train/step=30" in out and "train/lr=0.5" in out


def test_inspect_names_the_first_and_last_of_many_files(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from _ranks import all_ok, in_threads

    world = 5
    store = torch.distributed.HashStore()

    def rank(r: int) -> None:
        with asyncckpt.AsyncCheckpointer(tmp_path, mode="sync", rank=r, world_size=world,
                                         store=store, timeout_s=60) as ck:
            ck.save({"w": torch.full((2, 3), float(r))}, step=1, shards={
                "w": asyncckpt.ShardMetadata((2 * world, 3), (2 * r, 0))})

    all_ok(in_threads(rank, world=world))
    code, out, _ = run(capsys, "inspect", str(tmp_path / "step_000000001"))
    line = out.splitlines()[1]
    assert code == 0 and line.split()[0] == "w"
    assert line.endswith("rank_00000.safetensors ... rank_00004.safetensors (5 files)")
    code, out, _ = run(capsys, "inspect", "--json", str(tmp_path / "step_000000001"))
    assert json.loads(out)["tensors"][0]["files"] == [shard_file_name(r) for r in range(world)]


def test_inspect_shows_tied_paths(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Tied weights are stored once under one path; inspect must still show the others.
    emb = torch.randn(6, 4)
    asyncckpt.save({"embed": {"weight": emb}, "head": {"weight": emb}, "x": emb[:2],
                    "b": torch.zeros(3)}, tmp_path / "ck", step=1)
    code, out, _ = run(capsys, "inspect", str(tmp_path / "ck"))
    assert code == 0
    assert "head/weight: tied to embed/weight (stored once)" in out
    assert out.count("tied to") == 1  # a view of another shape is saved apart, not tied
    code, out, _ = run(capsys, "inspect", str(tmp_path / "ck"), "--json")
    tensors = {t["path"]: t for t in json.loads(out)["tensors"]}
    assert tensors["embed/weight"]["tied"] == ["head/weight"]
    assert tensors["b"]["tied"] == [] and "head/weight" not in tensors


def test_inspect_cuts_long_scalars_short(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """(stop 48's trial) A 20 MB bytes value made the summary one 33 MB line; --json
    still holds it whole."""
    long = "x" * 100_000
    asyncckpt.save({"w": torch.zeros(2), "note": long, "k" * 500: 1, "step": 7,
                    "s": "7", "none": None, "s_none": "None", "raw": b"ab"},
                   tmp_path / "ck", step=1)
    code, out, _ = run(capsys, "inspect", str(tmp_path / "ck"))
    assert code == 0 and len(out) < 2000, len(out)
    assert f"note='{'x' * 59}... (99,942 more characters)" in out, out
    assert f"{'k' * 60}... (440 more characters)=1" in out and "step=7" in out, out
    # (and kinds that print alike told apart: a trial read "s5=5, i5=5")
    assert "s='7'" in out and "none=None" in out and "s_none='None'" in out, out
    assert "raw=b64:YWI=" in out, out
    code, out, _ = run(capsys, "inspect", str(tmp_path / "ck"), "--json")
    scalars = {s["path"]: s["value"] for s in json.loads(out)["skeleton"]["scalars"]}
    assert scalars["note"] == long


def test_inspect_json_step_and_step_dir(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "inspect", str(root), "--step", "20", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["step"] == 20 and doc["world_size"] == 1
    assert doc["library_version"] == asyncckpt.__version__
    tensors = {t["path"]: t for t in doc["tensors"]}
    assert tensors["model/w"]["dtype"] == "float32"
    assert tensors["model/w"]["shape"] == [4, 8]
    assert tensors["model/w"]["bytes"] == 128
    assert tensors["ids"] == {"path": "ids", "dtype": "int64", "shape": [5], "bytes": 40,
                              "kind": "torch", "files": ["rank_00000.safetensors"], "chunks": 1,
                              "tied": []}
    assert doc["tensor_bytes"] == 128 + 16 + 40
    assert doc["total_bytes"] == sum(f["bytes"] for f in doc["files"].values())
    assert {"path": "train/step", "type": "int", "value": 20} in doc["skeleton"]["scalars"]
    # a step directory works directly, and --step must agree with it
    step_dir = root / "step_000000010"
    code, out, _ = run(capsys, "inspect", str(step_dir), "--json")
    assert code == 0 and json.loads(out)["step"] == 10
    code, out, err = run(capsys, "inspect", str(step_dir), "--step", "20")
    assert code == 2 and "of step 10, not 20: drop --step" in err


def test_inspect_of_a_step_with_a_truncated_shard_exits_1_as_ls(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A trial's cron job ran inspect on a step whose shard was cut short: it listed the
    tensors from the manifest and exited 0, where ls said DAMAGED and exited 1."""
    shard = root / "step_000000030" / shard_file_name(0)
    os.truncate(shard, shard.stat().st_size - 10)
    code, out, err = run(capsys, "inspect", str(root))
    assert code == 1 and "model/w" in out  # (still listed)
    assert f"step 30 is DAMAGED: {shard_file_name(0)} is " in err
    assert f"run 'asyncckpt verify {root / 'step_000000030'}'" in err
    code, out, _ = run(capsys, "inspect", str(root), "--json")
    assert code == 1 and json.loads(out)["ok"] is False
    assert json.loads(out)["damaged"] == [
        f"{shard_file_name(0)} is {shard.stat().st_size} bytes, not "
        f"{shard.stat().st_size + 10}"]
    assert run(capsys, "ls", str(root))[0] == 1  # the same verdict
    code, out, err = run(capsys, "inspect", str(root), "--step", "20", "--json")
    assert code == 0 and json.loads(out)["damaged"] == [] and err == ""
    assert json.loads(out)["ok"] is True  # (every --json document has ok)
    out_file = root.parent / "o.safetensors"
    code, out, _ = run(capsys, "export", str(root), str(out_file), "--step", "20", "--json")
    assert code == 0 and json.loads(out)["ok"] is True


def test_inspect_of_a_step_whose_header_disagrees_with_its_manifest_exits_1(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A shard's header rewritten to list a decoy over the bytes of 'w', under a manifest
    re-sealed with the new header's checksum: inspect showed it as sound and exited 0,
    where verify and a load refuse it."""
    import struct

    import xxhash

    from asyncckpt.manifest import seal

    asyncckpt.save({"w": torch.arange(8.0)}, tmp_path, step=1)
    step_dir = tmp_path / "step_000000001"
    assert run(capsys, "inspect", str(tmp_path))[0] == 0
    shard = step_dir / shard_file_name(0)
    raw = shard.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header["decoy"] = header.pop("w")
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (n - len(text))  # (the same length: the body stays where it was)
    shard.write_bytes(raw[:8] + text + raw[8 + n:])
    path = step_dir / "manifest.json"
    man = path.read_bytes()
    doc = long_entries(json.loads(man[:man.rindex(b',"digest"')] + b"}"))
    doc["files"][shard_file_name(0)]["header_checksum"] = xxhash.xxh3_64_hexdigest(
        raw[:8] + text)
    path.write_bytes(seal(json.dumps(doc, separators=(",", ":")).encode()))
    code, out, err = run(capsys, "inspect", str(tmp_path))
    assert code == 1 and "w" in out  # (listed from the manifest, as for a truncated shard)
    assert "step 1 is DAMAGED: " in err and "header entry of tensor 'w' is null" in err, err
    assert "the file's header and the manifest disagree" in err
    code, out, _ = run(capsys, "inspect", str(tmp_path), "--json")
    assert code == 1 and json.loads(out)["ok"] is False
    assert any("header entry of tensor 'w' is null" in d for d in json.loads(out)["damaged"])
    assert run(capsys, "verify", str(tmp_path))[0] == 1  # the same verdict


def test_inspect_not_found(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
                           ) -> None:
    code, out, err = run(capsys, "inspect", str(root), "--step", "25")
    assert code == 2 and out == ""
    assert "no committed checkpoint for step 25" in err and "10, 20, 30" in err
    code, _, err = run(capsys, "inspect", str(tmp_path / "missing"))
    assert code == 2 and "does not exist" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = run(capsys, "inspect", str(empty))
    assert code == 2 and "no committed checkpoint under" in err
    assert "Traceback" not in err


def test_verify_ok(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "verify", str(root))
    assert code == 0
    assert out.startswith(f"OK {root / 'step_000000030'}: step 30, 3 tensors")
    assert "(184 bytes) checked" in out and "GB/s" in out
    code, out, _ = run(capsys, "verify", str(root), "--step", "10", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["ok"] is True and doc["step"] == 10
    assert doc["tensors"] == 3 and doc["bytes"] == 184 and doc["problems"] == []
    asyncckpt.save({"w": torch.ones(2)}, root.parent / "one", step=1)
    code, out, _ = run(capsys, "verify", str(root.parent / "one"))
    assert code == 0 and ": step 1, 1 tensor, " in out, out  # (not "1 tensors")


def test_verify_shows_its_progress_on_a_terminal_only(
        root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    code, out, err = run(capsys, "verify", str(root), "--threads", "3")
    assert code == 0 and out.startswith("OK") and err == ""  # not a terminal: no progress
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    code, out, err = run(capsys, "verify", str(root), "--json")
    assert code == 0 and json.loads(out)["ok"] is True  # stdout stays a JSON document
    lines = err.split("\r")
    assert "verifying" in err and "184 B of 184 B (100%)" in err, err
    assert err.endswith("\r") and lines[-2].strip() == ""  # the line is erased at the end
    code, _, err = run(capsys, "verify", str(root), "--threads", "0")
    assert code == 2 and "--threads 0: give 1 or more" in err


def test_progress_is_redrawn_at_most_every_interval() -> None:
    from asyncckpt.cli import _Progress

    drawn: list[str] = []
    progress = _Progress("work", enabled=True, interval_s=3600)
    progress._draw = drawn.append  # type: ignore[method-assign]
    for done in range(0, 10 * 2**20, 2**20):
        progress(done, 10 * 2**20)
    assert drawn == []  # within the interval
    progress(10 * 2**20, 10 * 2**20)
    assert len(drawn) == 1 and drawn[0].startswith("work: 10.0 MiB of 10.0 MiB (100%)")
    assert "left" not in drawn[0]


def test_verify_flipped_byte(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flip_byte(root / "step_000000030", "model/w")
    code, out, _ = run(capsys, "verify", str(root))
    assert code == 1
    assert out.startswith("CORRUPT") and "1 problem" in out
    assert "checksum mismatch in tensor 'model/w'" in out
    # (each problem said "load an earlier step" too; and of step 0, or of a corrupt best
    # step, "earlier" meant nothing: a trial)
    assert "load an earlier step" not in out, out
    assert out.count("load another step, an intact one") == 1, out
    code, out, _ = run(capsys, "verify", str(root), "--json")
    assert code == 1
    doc = json.loads(out)
    assert doc["ok"] is False and doc["tensors"] == 2 and len(doc["problems"]) == 1
    # the other steps are untouched
    assert run(capsys, "verify", str(root), "--step", "20")[0] == 0


def test_verify_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "verify", str(tmp_path / "nope"))
    assert code == 2 and out == ""
    assert "nope" in err and len(err.strip().splitlines()) == 1


def test_a_failed_command_with_json_prints_the_error_as_json(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "verify", str(root / "nope"), "--json")
    doc = json.loads(out)
    assert code == 2 and doc["ok"] is False
    assert doc["error"]["type"] == "UsageError"
    assert doc["error"]["exit_code"] == 2 and "nope" in doc["error"]["message"]
    assert doc["error"]["message"] in err  # stderr says it too
    (root / "step_000000020" / "manifest.json").write_text("{not json")
    code, out, _ = run(capsys, "inspect", str(root), "--step", "20", "--json")
    doc = json.loads(out)
    assert code == 1 and doc["error"]["type"] == "CheckpointCorruptError"
    assert doc["error"]["exit_code"] == 1 and "digest" in doc["error"]["message"]
    code, out, _ = run(capsys, "inspect", str(root), "--step", "20")
    assert code == 1 and out == ""  # tables: stderr only
    code, out, err = run(capsys, "verify", str(root), "--step", "x", "--json")  # argparse's
    doc = json.loads(out)
    assert code == 2 and doc["error"]["type"] == "UsageError"
    assert "invalid step number (0 or more) value: 'x'" in doc["error"]["message"]
    assert err.startswith("usage:")


def test_bad_manifest(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (root / "step_000000020" / "manifest.json").write_text("{not json")
    code, out, _ = run(capsys, "ls", str(root))
    assert code == 1 and "DAMAGED" in out and "latest" in out  # (exit 1: corrupt)
    assert "UNREADABLE" not in out  # (that is a permission, exit 2: a CLI trial)
    code, out, _ = run(capsys, "ls", str(root), "--json")
    (row,) = [r for r in json.loads(out)["steps"] if r["step"] == 20]
    assert row["error"] and row["damaged"] == [row["error"]]
    code, _, err = run(capsys, "inspect", str(root), "--step", "20")
    assert code == 1 and "does not end with its digest" in err and "Traceback" not in err
    code, out, _ = run(capsys, "verify", str(root), "--step", "20")
    assert code == 1 and "does not end with its digest" in out


def test_a_dcp_checkpoint_or_a_torch_save_file_is_told_apart(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # (a user migrating said only "no committed checkpoint under dcp_dir", or "is not a
    # directory")
    dcp = tmp_path / "dcp"
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(b"x")
    (dcp / "__0_0.distcp").write_bytes(b"x")
    pt = tmp_path / "model.pt"
    torch.save({"w": torch.ones(2)}, pt)
    said = "it holds a PyTorch DCP checkpoint (.metadata, *.distcp), which asyncckpt does not read"
    with pytest.raises(asyncckpt.CheckpointNotFoundError, match=re.escape(said)):
        asyncckpt.load(dcp)
    with pytest.raises(asyncckpt.CheckpointNotFoundError, match=re.escape(
            "a torch.save file (.pt)? load it with torch.load(path, weights_only=True)")):
        asyncckpt.load(pt)
    code, out, _ = run(capsys, "ls", str(dcp))
    assert code == 0 and said in out
    for cmd in ("ls", "inspect", "verify"):
        code, _, err = run(capsys, cmd, str(pt))
        assert code == 2 and "a torch.save file (.pt)?" in err, (cmd, err)
    # a Hugging Face directory, and one of torch.save files (a trial got no hint for them)
    hf = tmp_path / "hf"
    hf.mkdir()
    safetensors.torch.save_file({"w": torch.ones(2)}, str(hf / "model.safetensors"))
    (hf / "config.json").write_text("{}")
    said = "it holds plain safetensors files (model.safetensors; Hugging Face weights?), which "
    with pytest.raises(asyncckpt.CheckpointNotFoundError, match=re.escape(said)):
        asyncckpt.load(hf)
    assert asyncckpt.load_safetensors(hf)["w"].tolist() == [1.0, 1.0]  # (as it says)
    code, out, _ = run(capsys, "ls", str(hf))
    assert code == 0 and said in out
    pts = tmp_path / "pts"
    pts.mkdir()
    for name in ("b.pt", "a.pt", "c.pth", "d.bin"):
        torch.save({"w": torch.ones(2)}, pts / name)
    with pytest.raises(asyncckpt.CheckpointNotFoundError, match=re.escape(
            "it holds torch.save files (a.pt, b.pt, c.pth and 1 more)? load one with")):
        asyncckpt.load(pts)
    # both kinds in one folder: each told (a trial's was told of the safetensors alone)
    safetensors.torch.save_file({"w": torch.ones(2)}, str(pts / "old.safetensors"))
    with pytest.raises(asyncckpt.CheckpointNotFoundError, match=re.escape(
            "Hugging Face weights?), which asyncckpt.load_safetensors(path, state) loads; and "
            "torch.save files (a.pt, b.pt, c.pth and 1 more)? load one with")):
        asyncckpt.load(pts)
    (tmp_path / "empty").mkdir()  # and nothing is said of a directory of neither
    with pytest.raises(asyncckpt.CheckpointNotFoundError) as info:
        asyncckpt.load(tmp_path / "empty")
    assert str(info.value) == f"no committed checkpoint under {tmp_path / 'empty'}"


def test_verify_all_checks_every_committed_step(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # (a trial looped over --step to check what a root retains)
    code, out, _ = run(capsys, "verify", str(root), "--all")
    assert code == 0 and out.count("\nOK ") + out.startswith("OK ") == 3, out
    assert out.rstrip().endswith("3 committed steps verified: all intact")
    flip_byte(root / "step_000000020", "model/w")
    code, out, _ = run(capsys, "verify", str(root), "--all")
    assert code == 1 and "CORRUPT " in out and "checksum mismatch in tensor 'model/w'" in out
    assert out.rstrip().endswith("3 committed steps verified: 1 corrupt (step_000000020); "
                                 "load another step"), out
    code, out, _ = run(capsys, "verify", str(root), "--all", "--json")
    doc = json.loads(out)
    assert code == 1 and doc["ok"] is False
    assert [(s["step"], s["ok"]) for s in doc["steps"]] == [(10, True), (20, False), (30, True)]
    for argv, says in ((["--all", "--step", "20"], "--all verifies every committed step: "
                        "drop --step"), (["--all"], "is one step's directory")):
        where = str(root / "step_000000010") if says.startswith("is one") else str(root)
        code, _, err = run(capsys, "verify", where, *argv)
        assert code == 2 and says in err, err


def test_verify_of_a_newer_format_is_no_verdict_of_corruption(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    step_dir = root / "step_000000030"
    m = read_manifest(step_dir, LocalStorage())
    (step_dir / "manifest.json").write_bytes(
        dataclasses.replace(m, format_version=m.format_version + 1).to_json())
    code, out, err = run(capsys, "verify", str(root))
    assert code == 2, (out, err)  # could not tell: not 1 (corrupt), which says "roll back"
    assert "CORRUPT" not in out and "upgrade asyncckpt" in err and "not damaged" in err
    code, out, err = run(capsys, "ls", str(root))  # nor does ls say it is: nor all is well
    assert code == 2 and "UNREADABLE" in out and "upgrade asyncckpt" in out, out


def test_created_past_year_9999(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # datetime cannot show it: the manifest is refused as corrupt, and nothing crashes
    step_dir = root / "step_000000030"
    m = read_manifest(step_dir, LocalStorage())
    (step_dir / "manifest.json").write_bytes(dataclasses.replace(m, created_unix=5e11).to_json())
    code, out, err = run(capsys, "ls", str(root))
    assert code == 1 and err == ""
    row = out.splitlines()[3].split()
    assert row[:5] == ["30", "?", "?", "?", "DAMAGED:"] and "created_unix" in out
    code, out, err = run(capsys, "inspect", str(root))
    assert code == 1 and out == "" and "created_unix must be seconds from 0" in err
    assert len(err.strip().splitlines()) == 1
    # were such a time to reach the formatting, it would show as the raw number
    assert _when(5e11) == _iso(5e11) == "500000000000.0"
    assert _iso(0) == "1970-01-01T00:00:00+00:00"


def test_ls_of_a_step_dir_without_its_manifest_says_so(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    step_dir = root / "step_000000030"
    (step_dir / "manifest.json").unlink()
    code, out, err = run(capsys, "ls", str(step_dir))
    # exit 1, as the same directory under its root (a trial's cron job read 2 as "could
    # not tell" from ls STEPDIR and verify STEPDIR, 1 from ls ROOT)
    assert code == 1 and out == ""
    assert "has no manifest.json: that step is uncommitted" in err and "no committed" not in err
    for cmd in ("verify", "inspect"):
        code, out, err = run(capsys, cmd, str(step_dir), "--json")
        assert code == 1 and "has no manifest.json" in err, cmd
        assert json.loads(out)["error"]["exit_code"] == 1
    code, out, _ = run(capsys, "ls", str(root))  # the root still lists the others
    assert code == 1 and "2 committed steps" in out  # (and exits 1: the newest is lost)


def test_verify_of_a_root_whose_only_steps_lost_their_manifests_exits_1(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for step in (10, 20, 30):
        (root / f"step_{step:09d}" / "manifest.json").unlink()
    assert run(capsys, "ls", str(root))[0] == 1
    for extra in ((), ("--all",)):
        code, _, err = run(capsys, "verify", str(root), *extra)
        assert code == 1, extra
        assert ("3 step directories without manifest.json (step_000000010, step_000000020, "
                "step_000000030: ") in err
    shutil.rmtree(root)
    root.mkdir()  # an empty root: nothing to tell
    assert run(capsys, "verify", str(root))[0] == 2
    assert run(capsys, "verify", str(root), "--all")[0] == 2


def test_ls_of_a_renamed_step_dir(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    best = root.parent / "best"
    shutil.copytree(root / "step_000000020", best)
    code, out, err = run(capsys, "ls", str(best))
    assert code == 0 and err == ""
    assert out.splitlines()[1].split()[0] == "20"  # the step comes from the manifest
    (best / "manifest.json").write_bytes(b"{}")
    code, out, err = run(capsys, "ls", str(best))
    assert code == 1 and err == ""
    row = out.splitlines()[1].split()
    assert row[:5] == ["?", "?", "?", "?", "DAMAGED:"]
    assert "does not end with its digest" in out
    code, out, _ = run(capsys, "ls", str(best), "--json")
    assert code == 1
    doc = json.loads(out)
    assert doc["steps"][0]["step"] is None and "error" in doc["steps"][0]
    assert doc["latest"] is None


def test_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert main(["frobnicate"]) == 2
    assert main(["--help"]) == 0
    capsys.readouterr()


def test_python_dash_m(root: Path) -> None:
    # the subprocess imports the same asyncckpt as this test does
    src = str(Path(asyncckpt.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "asyncckpt", "ls", str(root)],
                          capture_output=True, text=True, env=env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert [ln.split()[0] for ln in proc.stdout.splitlines()[1:4]] == ["10", "20", "30"]
    proc = subprocess.run([sys.executable, "-m", "asyncckpt", "ls", str(root / "nope")],
                          capture_output=True, text=True, env=env, timeout=120, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr


def test_version_says_the_library_and_torch_versions(capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    """(a fine-tuning trial) --version was a usage error, exit 2."""
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == (
        f"asyncckpt {asyncckpt.__version__} (torch {torch.__version__})")


def test_inspect_prints_keys_and_values_no_encoding_can_hold(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A lone surrogate is a valid str (and JSON) that load returns (save refuses it in a
    # key now, as a safetensors header cannot hold it, but older versions kept it, and a
    # str value keeps it); no stdout encoding takes it: printed as a backslash escape.
    monkeypatch.setattr(tree, "_check_key_text", lambda k, where: None)
    asyncckpt.save({"w\ud800": torch.ones(2), "note": "x\udcff"}, tmp_path, step=1)
    errors = sys.stdout.errors
    code, out, err = run(capsys, "inspect", str(tmp_path))
    assert code == 0 and err == "", err
    assert "w\\ud800" in out and "note='x\\udcff'" in out
    assert sys.stdout.errors == errors  # set back as it was
    code, out, _ = run(capsys, "inspect", "--json", str(tmp_path))
    assert code == 0 and json.loads(out)["tensors"][0]["path"] == "w\ud800"
    assert run(capsys, "verify", str(tmp_path))[0] == 0


def _deny(monkeypatch: pytest.MonkeyPatch, method: str, name: str) -> None:
    """Make LocalStorage.<method> fail with EACCES for paths ending in ``name`` (the tests
    run as root, for whom chmod 000 denies nothing)."""
    real = getattr(LocalStorage, method)

    def denied(self: LocalStorage, path: Path, *args: Any) -> Any:
        if Path(path).name == name:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real(self, path, *args)

    monkeypatch.setattr(LocalStorage, method, denied)


def test_a_file_it_may_not_read_is_not_called_corrupt(
        root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """No permission says nothing of the bytes: no CORRUPT verdict, no "load an earlier
    step", and a fallback load does not silently skip the step."""
    _deny(monkeypatch, "open_read", "rank_00000.safetensors")
    code, out, err = run(capsys, "verify", str(root))
    assert code == 2 and "CORRUPT" not in out + err
    assert "rank_00000.safetensors cannot be read: Permission denied" in err
    assert "read access" in err and "earlier step" not in err
    with pytest.raises(asyncckpt.CheckpointPermissionError, match="read access") as info:
        asyncckpt.load(root)
    assert info.value.path == str(root / "step_000000030" / "rank_00000.safetensors")
    with asyncckpt.AsyncCheckpointer(root) as ckpt, \
            pytest.raises(asyncckpt.CheckpointPermissionError):
        ckpt.load(fallback=True)  # step 20 is there, but 30 may well be intact


def test_ls_of_a_manifest_it_may_not_read_cannot_tell_as_verify(
        root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """(The review: ls exited 1, "damaged", for a manifest it had no permission to read,
    where verify exits 2.)"""
    _deny(monkeypatch, "read_bytes", "manifest.json")
    code, out, _ = run(capsys, "verify", str(root), "--step", "20")
    assert code == 2
    code, out, _ = run(capsys, "ls", str(root))
    assert code == 2 and "UNREADABLE" in out, out


def test_verify_names_a_missing_file_once(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (root / "step_000000030" / "rank_00000.safetensors").unlink()
    code, out, _ = run(capsys, "verify", str(root), "--json")
    assert code == 1
    problems = json.loads(out)["problems"]
    assert len(problems) == 2, problems
    assert problems[0].endswith("rank_00000.safetensors is missing: the checkpoint is damaged")
    assert "its 3 tensors were not read" in problems[1]


def test_verify_counts_as_intact_only_the_tensors_it_checked(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """(a crash trial) A step whose shard file was missing, or whose manifest was cut
    short, read "0 tensors intact" of tensors never read: it says what it checked."""
    from asyncckpt.cli import _tensors_checked
    from asyncckpt.reader import VerifyReport

    flip_byte(root / "step_000000010", "model/w")
    code, out, _ = run(capsys, "verify", str(root), "--step", "10")
    assert code == 1 and "1 problem (2 of 3 tensors intact):" in out, out
    (root / "step_000000030" / "rank_00000.safetensors").unlink()
    code, out, _ = run(capsys, "verify", str(root))
    assert code == 1 and "0 tensors intact" not in out, out
    assert ("2 problems (0 of 3 tensors checked: 0 intact; the rest could not be read "
            "because of the problems below):") in out, out
    manifest = root / "step_000000020" / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:100])
    code, out, _ = run(capsys, "verify", str(root), "--step", "20")
    assert code == 1 and "0 tensors intact" not in out, out
    assert ("1 problem (no tensor checked: none could be read because of the problems "
            "below):") in out, out
    # (a step of several files, one of them damaged: the others' tensors are checked)
    some = VerifyReport(root, 5, tensors=2, problems=["x", "y", "z"], listed=6, unchecked=3)
    assert _tensors_checked(some) == ("3 of 6 tensors checked: 2 intact; the rest could not "
                                      "be read because of the problems below")


def test_verify_of_an_emptied_shard_says_it_is_too_short(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # (it said "its header claims 0 bytes, more than the whole file")
    (root / "step_000000030" / "rank_00000.safetensors").write_bytes(b"")
    code, out, _ = run(capsys, "verify", str(root), "--json")
    assert code == 1
    problems = json.loads(out)["problems"]
    assert any("rank_00000.safetensors: the file is 0 bytes long, too short for a "
               "safetensors header" in p for p in problems), problems


def test_verify_json_of_an_unreadable_manifest_takes_the_step_from_the_name(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """As ls does (a trial's health check matched verify's rows to ls's by step)."""
    (root / "step_000000020" / "manifest.json").write_text("{not json")
    code, out, _ = run(capsys, "verify", str(root), "--step", "20", "--json")
    doc = json.loads(out)
    assert code == 1 and doc["ok"] is False
    assert doc["step"] == 20
    code, out, _ = run(capsys, "verify", str(root), "--all", "--json")
    assert [s["step"] for s in json.loads(out)["steps"]] == [10, 20, 30]
    other = root.parent / "copy"  # a directory of another name: no step to tell
    shutil.copytree(root / "step_000000020", other)
    code, out, _ = run(capsys, "verify", str(other), "--json")
    assert code == 1 and json.loads(out)["step"] is None  # (not -1, which is no step either)


def test_ls_shows_a_step_dir_it_cannot_list(root: Path, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    _deny(monkeypatch, "listdir", "step_000000020")
    code, out, err = run(capsys, "ls", str(root))
    # could not tell (as verify of it says): not all is well, which a health check read
    assert code == 2 and err == ""
    lines = out.splitlines()
    assert [ln.split()[0] for ln in lines[1:4]] == ["10", "20", "30"]
    assert "UNREADABLE: cannot be listed (Permission denied)" in lines[2]
    # (an ops trial: ls said it "counts as no committed step" where verify said it may)
    assert "it may hold a committed step, so which steps are committed is unknown" in out
    assert lines[3].rstrip().endswith("latest")
    assert "2 committed steps" in out and "1 step directory cannot be listed" in out
    code, out, _ = run(capsys, "ls", str(root), "--json")
    doc = json.loads(out)
    assert doc["latest"] == 30 and [e["step"] for e in doc["steps"]] == [10, 20, 30]
    assert "Permission denied" in doc["steps"][1]["error"]
    # every row has every key: a script reading row["bytes"] failed on the unreadable ones
    assert [sorted(e) for e in doc["steps"]] == [sorted(doc["steps"][0])] * 3
    assert doc["steps"][1]["bytes"] is None and doc["steps"][0]["error"] is None


def test_tables_escape_control_characters_in_keys(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A key is the checkpoint's data: printed raw, a newline breaks the table and an
    escape sequence drives the terminal."""
    key = "w\x1b[2J\nfake\u202erow"
    asyncckpt.save({key: torch.ones(2), "meta": {"x\ry": 1}}, tmp_path / "c", step=1)
    code, out, _ = run(capsys, "inspect", str(tmp_path / "c"))
    assert code == 0
    assert "\x1b" not in out and "\u202e" not in out and "\r" not in out
    assert "w\\x1b[2J\\nfake\\u202erow" in out and "x\\ry=1" in out
    # JSON output escapes by itself and keeps the key exact
    code, out, _ = run(capsys, "inspect", str(tmp_path / "c"), "--json")
    assert key in [t["path"] for t in json.loads(out)["tensors"]]


def test_library_warnings_come_out_as_the_commands_own(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A warning the library logs (here: an export removing what a killed export left)
    is printed with the command's prefix, and the handler is gone once the command
    returns."""
    from asyncckpt import export as export_mod

    out_dir = root.parent / "out"
    out_dir.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    left = out_dir / f".asyncckpt-export-{export_mod._HOST}-{int(dead.stdout)}-abc.tmp"
    left.write_bytes(b"x")
    code, _, err = run(capsys, "export", str(root), str(out_dir / "m.safetensors"))
    assert code == 0, err
    assert err.startswith("asyncckpt: warning: export: removed ") and left.name in err
    assert len(err.strip().splitlines()) == 1 and not left.exists()
    library = logging.getLogger("asyncckpt")
    assert not any(type(h).__name__ == "_LibraryLog" for h in library.handlers)


def test_a_newest_step_that_cannot_be_listed_fails_verify_and_shows_in_ls(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # verify of the root checked step 30 and said OK, the newest step skipped unseen
    os.symlink("step_000000040", root / "step_000000040")  # a loop: listing it fails
    code, out, err = run(capsys, "verify", str(root))
    assert code == 1 and "step_000000040 cannot be listed" in err, (out, err)
    assert "run 'asyncckpt verify'" not in err  # (it is the command running)
    code, out, err = run(capsys, "verify", "--step", "30", str(root))
    assert code == 0 and "step 30" in out
    code, out, err = run(capsys, "ls", str(root))  # ls shows it in a row of its own
    assert code == 1 and err == "" and "1 step directory cannot be listed" in out  # (as verify)
    assert "it counts as no committed step (a symbolic link loop?" in out


def test_a_temp_or_deleting_dir_is_named_uncommitted(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tmp = root / ".step_000000040.tmp-0123abcd"
    shutil.copytree(root / "step_000000030", tmp)  # a crash between manifest and rename
    for cmd in ("ls", "verify", "inspect"):
        code, _, err = run(capsys, cmd, str(tmp))
        assert code == 0, (cmd, err)
        assert err.startswith(f"asyncckpt: warning: {tmp} is the temporary directory of a "
                              "save that did not commit"), (cmd, err)
    gone = root / ".step_000000020.deleting-0123abcd"
    (root / "step_000000020").rename(gone)
    code, _, err = run(capsys, "verify", str(gone))
    assert code == 0 and "is a step being removed by retention" in err
    code, _, err = run(capsys, "verify", str(root / "step_000000030"))
    assert code == 0 and err == ""  # a committed step: no warning


def test_commit_names_a_step_dir_without_manifest_in_the_way(tmp_path: Path) -> None:
    from asyncckpt import commit
    from asyncckpt.errors import CheckpointExistsError

    storage = LocalStorage()
    (tmp_path / "step_000000007").mkdir()  # empty: rename() would silently replace it
    tmp = tmp_path / commit.tmp_dir_name(7, "abc")
    tmp.mkdir()
    (tmp / "manifest.json").write_text("{}")
    with pytest.raises(CheckpointExistsError, match=r"holds no manifest\.json, so it is no "
                       "committed step"):
        commit.commit(tmp, tmp_path, 7, storage)
    assert tmp.is_dir() and os.listdir(tmp_path / "step_000000007") == []
    (tmp_path / "step_000000007" / "manifest.json").write_text("{}")
    with pytest.raises(CheckpointExistsError, match="step 7 is already committed"):
        commit.commit(tmp, tmp_path, 7, storage)


class _Unwritable:
    """A stdout whose every write fails as ``exc`` does: a reader gone, a full disk."""

    errors = "strict"

    def __init__(self, exc: OSError):
        self.exc = exc

    def write(self, text: str) -> int:
        raise self.exc

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("exc", [BrokenPipeError(errno.EPIPE, "Broken pipe"),
                                 OSError(errno.ENOSPC, "No space left on device")],
                         ids=["closed-pipe", "disk-full"])
def test_a_failing_stdout_keeps_the_verdict(root: Path, capsys: pytest.CaptureFixture[str],
                                            exc: OSError) -> None:
    """``verify CORRUPT | head`` must still exit 1: the exit code is the verdict's, not
    the printing's. A full disk is a failure to write, not to read the checkpoint."""
    flip_byte(root / "step_000000030", "model/w")
    for argv, want in ((["verify", str(root)], 1), (["verify", str(root), "--json"], 1),
                       (["verify", str(root), "--step", "20"], 0), (["ls", str(root)], 0)):
        with contextlib.redirect_stdout(_Unwritable(exc)):  # type: ignore[type-var]
            code = main(argv)
        err = capsys.readouterr().err
        if isinstance(exc, BrokenPipeError):
            assert code == want, (argv, err)
            assert err == "", (argv, err)  # a reader that stopped reading: no complaint
        else:
            assert code == (want or 2), (argv, err)  # an ok command whose output is lost fails
            assert "could not write the output to stdout: No space left on device" in err
            assert "cannot read" not in err


def test_a_closed_pipe_ends_quietly_with_the_verdict(root: Path) -> None:
    """A real closed pipe, stdout block-buffered (the EPIPE comes at the final flush):
    exit 1 for a corrupt step, nothing printed about the pipe, at exit either."""
    flip_byte(root / "step_000000030", "model/w")
    src = str(Path(asyncckpt.__file__).parents[1])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env["PYTHONPATH"] = os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before anything is written
    try:
        proc = subprocess.run([sys.executable, "-m", "asyncckpt", "verify", str(root)],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, env=env,
                              timeout=120, check=False)
    finally:
        os.close(write_end)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr == ""


def test_a_step_dir_without_its_manifest_is_not_called_an_empty_root(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Its manifest lost, a step directory is still no checkpoint root: the error says
    which file is missing and where the committed steps are listed."""
    step = root / "step_000000030"
    shutil.copytree(step, root.parent / "best")  # a copy under another name: rank files
    (step / "manifest.json").unlink()
    (root.parent / "best" / "manifest.json").unlink()
    for path, why in ((step, "is named like a step directory and holds rank files"),
                      (root.parent / "best", "holds rank files")):
        for argv in (["verify", str(path)], ["inspect", str(path), "--step", "30"]):
            code, out, err = run(capsys, *argv)
            assert code == 1 and out == "", (argv, err)  # damage, as ls says under the root
            assert f"{path} {why} but has no manifest.json: that step is uncommitted" in err
            assert err.rstrip().endswith(f"'asyncckpt ls {path.parent}' lists the committed "
                                         "steps"), err
            assert "no committed checkpoint under" not in err
    with pytest.raises(asyncckpt.CheckpointNotFoundError, match=r"has no manifest\.json"):
        asyncckpt.load(step)
    # the root itself is untouched: its other steps load (verify exits 1: the newest
    # step lost its manifest), and an empty folder is no step
    code, out, _ = run(capsys, "verify", str(root))
    assert code == 1 and out.startswith("DAMAGED ") and "\nOK " in out
    assert "step_000000030: the newest" in out
    (root.parent / "empty").mkdir()
    code, _, err = run(capsys, "verify", str(root.parent / "empty"))
    assert code == 2 and "no committed checkpoint under" in err


def test_options_are_not_abbreviated(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """'--js' was taken for --json, yet its usage errors got no JSON document."""
    code, out, err = run(capsys, "ls", str(root), "--js")
    assert code == 2 and out == "" and "unrecognized arguments: --js" in err
    # told with the command's usage (it was the top level's, which names no option)
    assert err.startswith("usage: asyncckpt ls [-h] [--best METRIC] [--max] [--min] [--json] "
                          "DIR"), err
    assert "asyncckpt ls: error: unrecognized arguments: --js" in err, err
    safetensors.torch.save_file({"w": torch.ones(2)}, str(root.parent / "plain.safetensors"))
    code, _, err = run(capsys, "verify", str(root.parent / "plain.safetensors"))
    assert code == 2 and "a plain safetensors file holds no checksums to verify" in err, err
    code, out, _ = run(capsys, "verify", str(root), "--step", "x", "--json")
    assert code == 2 and json.loads(out)["ok"] is False


def test_without_stderr_nothing_meant_for_it_lands_on_stdout(root: Path) -> None:
    """print(file=None) writes on stdout: a process started with stderr closed got its
    errors and warnings inside the --json document."""
    (root / "step_000000020" / "manifest.json").write_text("{not json")
    for argv, code in ((["verify", str(root / "nope"), "--json"], 2),
                       (["ls", str(root), "--json"], 1),  # warns of the unreadable step
                       (["verify", str(root), "--step", "x", "--json"], 2)):
        cmd = " ".join(map(shlex.quote, [sys.executable, "-m", "asyncckpt", *argv]))
        proc = subprocess.run(["sh", "-c", f"exec {cmd} 2>&-"], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == code, (argv, proc.stdout)
        assert "asyncckpt: " not in proc.stdout, (argv, proc.stdout)
        json.loads(proc.stdout)  # one document, nothing else


@pytest.mark.parametrize("gone", [20, 30])
def test_ls_leaves_out_a_step_retired_while_it_lists(
        root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        gone: int) -> None:
    """A save's retention may remove a step between the listing and the manifest read:
    that step no longer exists, it is not UNREADABLE (nor counted, nor the latest)."""
    from asyncckpt import cli

    real = cli.read_manifest_summary

    def retired_meanwhile(d: Path, storage: Any) -> Any:
        if d.name == f"step_{gone:09d}":
            shutil.rmtree(d)
        return real(d, storage)

    monkeypatch.setattr(cli, "read_manifest_summary", retired_meanwhile)
    code, out, _ = run(capsys, "ls", str(root), "--json")
    doc = json.loads(out)
    left = [s for s in (10, 20, 30) if s != gone]
    assert code == 0 and [e["step"] for e in doc["steps"]] == left, doc
    assert doc["latest"] == left[-1] and all(e["error"] is None for e in doc["steps"])
    (root / f"step_{gone:09d}").mkdir()  # (for the table: retire it again)
    (root / f"step_{gone:09d}" / "manifest.json").write_text("{}")
    code, out, _ = run(capsys, "ls", str(root))
    assert code == 0 and "UNREADABLE" not in out and "2 committed steps" in out, out


class _Stateful:
    def __init__(self) -> None:
        self.lr, self.w = 0.5, torch.ones(2)

    def state_dict(self) -> dict[str, Any]:
        return {"lr": self.lr, "w": self.w}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.lr, self.w = sd["lr"], sd["w"]


def test_inspect_counts_a_stateful_roots_scalars_as_its_own(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Scalars of a stateful object are its own, not loose ones: the root one too."""
    asyncckpt.save(_Stateful(), tmp_path / "root", step=1)
    asyncckpt.save({"opt": _Stateful(), "epoch": 3}, tmp_path / "nested", step=1)
    for where, loose in (("root", ""), ("nested", " (1 outside the objects: epoch=3)")):
        code, out, _ = run(capsys, "inspect", str(tmp_path / where))
        line = next(ln for ln in out.splitlines() if ln.startswith("non-tensor state"))
        assert code == 0 and line.startswith(f"non-tensor state: {2 if loose else 1} "
                                             f"scalars{loose}; objects "), line


def test_a_step_that_cannot_be_is_told_in_the_cli_s_words(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    asyncckpt.save({"w": torch.ones(2)}, tmp_path, step=1)
    code, _, err = run(capsys, "verify", str(tmp_path), "--step", "-1")
    assert code == 2 and "--step: invalid step number (0 or more) value: '-1'" in err, err
    assert "None" not in err  # (the Python API's words: "or None for the latest")
    # a step directory with another --step: one message, the one that says what to do
    code, _, err = run(capsys, "verify", str(tmp_path / "step_000000001"), "--step", "2")
    assert code == 2
    assert err.strip() == (f"asyncckpt: error: {tmp_path / 'step_000000001'} is the step "
                           "directory of step 1, not 2: drop --step or pass the checkpoint root")
    assert run(capsys, "verify", str(tmp_path / "step_000000001"), "--step", "1")[0] == 0


def test_a_closed_stdout_is_told_as_such_with_the_verdict_kept(
        root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # Started with stdout closed (>&-), Python has no sys.stdout: the flush at the end
    # raised AttributeError, a traceback and exit 1 ("corrupt") for an intact checkpoint.
    monkeypatch.setattr(sys, "stdout", None)
    assert main(["verify", str(root)]) == 2  # intact, but the report was not written
    flip_byte(root / "step_000000030", "model/w")
    assert main(["verify", str(root)]) == 1  # the verdict stands
    err = capsys.readouterr().err
    assert "Traceback" not in err and "stdout is closed" in err


def test_ls_reads_a_summary_that_agrees_with_the_whole_manifest(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # (ls no longer parses every tensor entry of every step: 2 s a step of 100k tensors)
    from asyncckpt.reader import read_manifest, read_manifest_summary
    from asyncckpt.storage import LocalStorage

    step_dir = root / "step_000000030"
    whole = read_manifest(step_dir, LocalStorage())
    summary = read_manifest_summary(step_dir, LocalStorage())
    assert (summary.step, summary.created_unix, summary.library_version, summary.files,
            summary.tensors, summary.total_bytes) == (
        whole.step, whole.created_unix, whole.library_version, whole.files,
        len(whole.tensors), whole.total_bytes)
    # damage the digest catches is still told; a step copied under another name too
    raw = (step_dir / "manifest.json").read_bytes()
    (step_dir / "manifest.json").write_bytes(raw.replace(b'"step":30', b'"step":31'))
    code, out, _ = run(capsys, "ls", str(root))
    assert code == 1 and "DAMAGED" in out and "digest does not match" in out, out


def test_inspect_plain_safetensors_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                         ) -> None:
    from safetensors.torch import save_file

    save_file({"model.w": torch.ones(2, 3), "model.b": torch.zeros(4, dtype=torch.bfloat16)},
              str(tmp_path / "one.safetensors"))
    code, out, _ = run(capsys, "inspect", str(tmp_path / "one.safetensors"))
    assert code == 0 and "model.w  float32   [2, 3]" in out and "model.b  bfloat16" in out
    assert "plain safetensors: 2 tensors  32 tensor bytes" in out and "load_safetensors" in out
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"a": torch.ones(5)}, str(hf / "model-1.safetensors"))
    save_file({"b": torch.ones(2, dtype=torch.int64)}, str(hf / "model-2.safetensors"))
    (hf / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}))
    code, out, _ = run(capsys, "inspect", str(hf), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["format"] == "safetensors" and doc["step"] is None
    # the keys of a checkpoint's document, those without meaning null (a trial's script
    # read doc["damaged"] of both: KeyError on plain files)
    asyncckpt.save({"w": torch.ones(2)}, tmp_path / "ck", step=1)
    code, ck_out, _ = run(capsys, "inspect", str(tmp_path / "ck"), "--json")
    ck_doc = json.loads(ck_out)
    assert ck_doc["format"] == "asyncckpt" and ck_doc["damaged"] == []
    assert sorted(ck_doc) == sorted(doc) and doc["damaged"] is None
    assert [(t["path"], t["dtype"], t["shape"], t["files"]) for t in doc["tensors"]] == [
        ("a", "float32", [5], ["model-1.safetensors"]),
        ("b", "int64", [2], ["model-2.safetensors"])]
    assert doc["tensor_bytes"] == 36 and sorted(doc["files"]) == ["model-1.safetensors",
                                                                  "model-2.safetensors"]
    code, _, err = run(capsys, "inspect", str(hf), "--step", "3")
    assert code == 2 and "no steps" in err
    (hf / "model-2.safetensors").write_bytes(b"\x05" + b"\0" * 7 + b"{bad}")
    code, _, err = run(capsys, "inspect", str(hf))
    assert code == 1 and "model-2.safetensors" in err and "not JSON" in err


class _RetiredWhileListed(LocalStorage):
    """A root whose step 10 a saver's keep_last retires as it is looked into, while the
    saver commits step 40: the look reads the directory as its files go (nothing), and
    the root's listing taken before lacks step 40."""

    def __init__(self, root: Path, step_40: Path) -> None:
        self.root, self.step_40, self.done = root, step_40, False

    def listdir(self, path: Path) -> list[str]:
        if path == self.root / "step_000000010" and not self.done:
            self.done = True
            os.rename(path, self.root / ".step_000000010.deleting-abc")
            os.rename(self.step_40, self.root / "step_000000040")
            return []
        return super().listdir(path)


def _step_40(tmp_path: Path) -> Path:
    """A committed step 40 elsewhere, to be renamed into a root as a saver commits it."""
    asyncckpt.save(_state(40), tmp_path / "side", step=40)
    return tmp_path / "side" / "step_000000040"


def test_a_step_retired_while_listed_is_neither_lost_nor_a_reason_to_miss_new_ones(
        root: Path, tmp_path: Path) -> None:
    """A trial's cron job beside a trainer with keep_last: ls said a step had no
    manifest.json (1 run in 150) and steps() returned [] while 2 steps were committed."""
    from asyncckpt import commit

    lost: list[str] = []
    unlistable: list[tuple[str, str]] = []
    storage = _RetiredWhileListed(root, _step_40(tmp_path))
    steps = commit.committed_steps(root, storage, unlistable, lost)
    assert storage.done and steps == [20, 30, 40]  # listed again: step 40 is seen
    assert lost == [] and unlistable == []


def test_a_root_listed_again_names_each_unlistable_step_once(
        root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """(The review: each listing taken again added the symlink loop to ls's rows again.)"""
    from asyncckpt import commit

    os.symlink("step_000000007", root / "step_000000007")  # a loop: cannot be listed
    unlistable: list[tuple[str, str]] = []
    caplog.set_level(logging.WARNING, logger="asyncckpt")
    steps = commit.committed_steps(root, _RetiredWhileListed(root, _step_40(tmp_path)),
                                   unlistable)
    assert steps == [20, 30, 40]
    assert [n for n, _ in unlistable] == ["step_000000007"]
    assert caplog.text.count("step_000000007: it cannot be listed") == 1


def test_a_saves_temporary_directory_is_no_damage_to_the_commands(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """ls of the root lists it as incomplete (exit 0); given the directory itself the
    commands could not tell (2), not corrupt (1), as for a step without manifest."""
    tmp = root / ".step_000000040.tmp-0123abcd"
    shutil.copytree(root / "step_000000030", tmp)
    (tmp / "manifest.json").unlink()  # (still being written)
    assert run(capsys, "ls", str(root))[0] == 0
    for cmd in ("ls", "verify", "inspect"):
        code, _, err = run(capsys, cmd, str(tmp))
        assert code == 2 and "has no manifest.json" in err, (cmd, err)


@pytest.mark.parametrize("when", ["before its listing", "after its listing"])
def test_ls_skips_a_step_whose_files_went_with_it_while_looked_at(
        root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        when: str) -> None:
    import asyncckpt.cli as cli
    from asyncckpt import commit

    module, hooked = ((cli, "_on_disk") if when == "before its listing"
                      else (commit, "files_amiss"))
    real = getattr(module, hooked)

    def retire_first(step_dir: Path, *args: Any) -> Any:
        if step_dir.name == "step_000000010" and step_dir.exists():
            shutil.rmtree(step_dir)  # (as retention, after the manifest was read)
        return real(step_dir, *args)

    monkeypatch.setattr(module, hooked, retire_first)
    code, out, _ = run(capsys, "ls", str(root), "--json")
    doc = json.loads(out)
    assert code == 0 and [e["step"] for e in doc["steps"]] == [20, 30]
    assert all(e["damaged"] == [] for e in doc["steps"])


@pytest.mark.parametrize("cmd", ["verify", "inspect", "export", "serve"])
def test_a_latest_step_retired_while_read_is_read_again_as_the_new_latest(
        root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch, cmd: str) -> None:
    """A trial's 'verify ROOT' beside a trainer exited 2 ("deleted while it was being
    read") in 12 runs of 20, and 'serve ROOT' gave up in 13 of 25: the new latest is read,
    as asyncckpt.load does."""
    import asyncckpt.cli as cli
    from asyncckpt import commit

    real = LocalStorage.read_bytes
    gone: list[Path] = []
    step_40 = _step_40(tmp_path)

    def retire_latest(self: LocalStorage, path: Path, limit: int) -> bytes:
        data = real(self, path, limit)
        step_dir = path.parent
        if not gone and step_dir.name == "step_000000030" and path.name == "manifest.json":
            gone.append(step_dir)
            # the trainer commits step 40 and its keep_last retires step 30
            os.rename(step_40, root / "step_000000040")
            os.rename(step_dir, root / ".step_000000030.deleting-x")
            shutil.rmtree(root / ".step_000000030.deleting-x")
        return data

    monkeypatch.setattr(LocalStorage, "read_bytes", retire_latest)
    argv = {"verify": [], "inspect": [], "export": [str(tmp_path / "o.safetensors")],
            "serve": ["--json"]}[cmd]
    if cmd == "serve":  # (stopped as soon as it serves)
        monkeypatch.setattr(cli, "_serve_until", lambda stop, check=None: None)
    code, out, err = run(capsys, cmd, str(root), *argv)
    assert gone and code == 0, (out, err)
    assert "step_000000040" in out + err, (out, err)
    assert commit.committed_steps(root, LocalStorage()) == [10, 20, 40]


def test_serve_warns_once_when_its_step_is_removed_while_served(
        root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ops trial: a trainer's keep_last removed the step 'serve ROOT' served; its files,
    held open, kept 48 MB of disk that neither ls nor du showed, unsaid."""
    import asyncckpt.cli as cli

    checks: list[Any] = []

    def retired_while_served(stop: Any, check: Any = None) -> None:
        check()  # (still there: nothing said)
        shutil.rmtree(root / "step_000000030")
        check()
        check()
        checks.append(check)

    monkeypatch.setattr(cli, "_serve_until", retired_while_served)
    code, out, err = run(capsys, "serve", str(root), "--json")
    assert code == 0 and checks and json.loads(out)["step"] == 30
    assert err.count("was removed") == 1, err
    assert (f"step 30 was removed from {root} while served (a saver's keep_last?): it is "
            "still served, from its files held open, whose ") in err, err
    assert "KiB of disk space stays in use" in err
    # a step saved anew meanwhile (a rollback, then the step again): stale, told
    checks.clear()

    def saved_anew(stop: Any, check: Any = None) -> None:
        check()
        with asyncckpt.AsyncCheckpointer(root) as ck:
            assert ck.discard_steps_after(10) == [20]
            ck.save({"w": torch.ones(3)}, step=20)
        check()
        check()
        checks.append(check)

    monkeypatch.setattr(cli, "_serve_until", saved_anew)
    code, out, err = run(capsys, "serve", str(root), "--json")
    assert code == 0 and checks and json.loads(out)["step"] == 20, (out, err)
    assert err.count("was saved anew while served") == 1, err
    assert f"step 20 under {root} was saved anew while served (a rollback, then that " \
        "step again?)" in err and "was removed" not in err, err


def test_serve_checks_its_step_while_it_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncckpt.cli as cli

    monkeypatch.setattr(cli, "_SERVE_CHECK_S", 0.0)
    stop, calls = cli._StopFlag(), []

    def check() -> None:
        calls.append(1)
        if len(calls) == 2:
            stop.set()

    cli._serve_until(stop, check)
    assert len(calls) == 2


def test_serve_warns_of_a_step_a_load_marked_damaged(
        root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # (an evaluator trial: 'serve ROOT' served a latest step ls showed DAMAGED, unwarned,
    # and every client failed on it)
    import asyncckpt.cli as cli
    from asyncckpt import commit

    monkeypatch.setattr(cli, "_serve_until", lambda stop, check=None: None)
    code, out, err = run(capsys, "serve", str(root), "--json")
    assert code == 0 and "marked damaged" not in err
    assert commit.mark_damaged(root, 30, "checksum mismatch in tensor 'w'", LocalStorage()) \
        is None
    code, out, err = run(capsys, "serve", str(root), "--json")
    assert code == 0 and json.loads(out)["step"] == 30
    assert "step 30 is marked damaged: a load found it damaged" in err, err
    assert "serve another step (--step)" in err


def test_docs_cli_names_every_key_of_every_json_document(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/cli.md is what scripts rely on (a trial guessed the keys from one run): every
    key the commands print, at the top and in rows, is named there."""
    doc_text = (Path(__file__).parents[1] / "docs" / "cli.md").read_text()
    named = set(re.findall(r"`([a-z_]+)`", doc_text))
    out_file = root.parent / "o.safetensors"
    keys: set[str] = set()
    (root / ".step_000000040.tmp-0123abcd").mkdir()  # (for clean's rows, run last)
    for argv in (["ls", str(root)], ["inspect", str(root)], ["verify", str(root)],
                 ["verify", str(root), "--all"], ["export", str(root), str(out_file)],
                 ["clean", str(root), "--dry-run"], ["clean", str(root)]):
        code, out, _ = run(capsys, *argv, "--json")
        assert code == 0, argv
        doc = json.loads(out)
        assert doc["ok"] is True, argv
        keys |= set(doc) | set(doc.get("lock") or {})
        for rows in ("steps", "tensors", "abandoned"):
            if isinstance(doc.get(rows), list):  # (verify's "tensors" is a count)
                keys |= set(doc[rows][0])
    assert keys - named == set(), sorted(keys - named)


def test_ls_row_of_an_unreadable_manifest_shows_its_damaged_mark(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """(A trial: after a fallback load marked a step whose manifest was corrupt, ls showed
    UNREADABLE alone, and docs/cli.md's rows say damaged holds the mark.)"""
    from asyncckpt import commit

    step_dir = root / "step_000000030"
    (step_dir / "manifest.json").write_text("{}")
    assert commit.mark_damaged(root, 30, "its manifest is corrupt", LocalStorage()) is None
    code, out, _ = run(capsys, "ls", str(root), "--json")
    row = json.loads(out)["steps"][-1]
    assert code == 1 and row["step"] == 30 and row["error"] and row["bytes"] is None
    assert row["damaged"][0] == row["error"] and len(row["damaged"]) == 2
    assert "its manifest is corrupt" in row["damaged"][1]
    code, out, _ = run(capsys, "ls", str(root))
    assert "DAMAGED: " in out and "a load found it damaged" in out


def test_a_very_long_key_is_printed_whole_without_widening_the_other_rows(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    long = "k" * 300
    asyncckpt.save({"a": torch.ones(2), long: torch.zeros(3), "b": {"c": torch.ones(1, 2)}},
                   tmp_path, step=0)
    code, out, _ = run(capsys, "inspect", str(tmp_path))
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == ["PATH", "DTYPE", "SHAPE", "BYTES", "FILE"]
    row = next(line for line in lines if line.startswith(long))
    assert row.split() == [long, "float32", "[3]", "12", "rank_00000.safetensors"]
    others = [line for line in lines[:4] if line is not row]
    assert all(len(line) < 60 for line in others), others  # (they were 300+ wide)
    assert len({line.index("float32") for line in others[1:]}) == 1  # still aligned


@pytest.mark.parametrize(("argv", "says"), [
    (["--host", "node7:8000"], "--host 'node7:8000': pass a host name or address without a "
                               "port (the port is the transport's own: --port)"),
    (["--advertise-host", "a b"], "--advertise-host 'a b': pass a bare host name"),
    (["--host", "nosuchhost.invalid"], "cannot listen on --host 'nosuchhost.invalid' --port 0: "),
])
def test_serve_names_its_options_in_a_refusal_of_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], says: str) -> None:
    asyncckpt.save({"w": torch.ones(2)}, tmp_path, step=1)
    code, out, err = run(capsys, "serve", str(tmp_path), *argv)
    assert code == 2 and out == "" and says in err, err
    assert "port=" not in err and "host=" not in err
    assert "without a token" not in err  # (no warning about a server that never ran)


def test_out_of_memory_reading_a_checkpoint_is_no_verdict_and_keeps_the_json_promise(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A trial's 47 MB manifest (valid, padded) took ~1 GB to parse: under a memory limit
    verify --json printed a traceback, no document, and exit 1 ("corrupt")."""
    from asyncckpt import reader

    asyncckpt.save({"w": torch.ones(2)}, tmp_path, step=1)

    def no_memory(*args: Any, **kwargs: Any) -> Any:
        raise MemoryError

    monkeypatch.setattr(reader, "parse_manifest", no_memory)
    code, out, err = run(capsys, "verify", str(tmp_path), "--json")
    doc = json.loads(out)
    assert code == 2 and doc["ok"] is False and doc["error"]["type"] == "MemoryError"
    assert "out of memory while reading the checkpoint" in err and "Traceback" not in err


def test_a_damaged_plain_safetensors_file_is_not_sent_to_verify(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import safetensors.torch

    path = tmp_path / "model.safetensors"
    safetensors.torch.save_file({"w": torch.ones(4)}, str(path))
    data = bytearray(path.read_bytes())
    data[8:10] = b"[]"  # (no JSON object: damaged)
    path.write_bytes(bytes(data))
    code, _, err = run(capsys, "inspect", str(path))
    assert code == 1 and "asyncckpt verify" not in err, err  # (verify takes no such file)


def test_verify_all_goes_on_past_a_step_it_cannot_read(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A trial: one step unreadable (another user's 0600 shard) ended --all with that
    one error and no word of the intact steps; --json had no "steps"."""
    import asyncckpt.cli as cli_module
    from asyncckpt.errors import CheckpointPermissionError

    with asyncckpt.AsyncCheckpointer(tmp_path) as ck:
        for s in (1, 2, 3):
            ck.save({"w": torch.full((10,), float(s))}, step=s)
    real = cli_module._verified

    def verified(step_dir: Path, storage: Any, threads: int | None = None) -> Any:
        if step_dir.name == "step_000000002":
            raise CheckpointPermissionError(f"{step_dir}/rank_00000.safetensors cannot be "
                                            "read: Permission denied")
        return real(step_dir, storage, threads)

    monkeypatch.setattr(cli_module, "_verified", verified)
    code, out, _ = run(capsys, "verify", str(tmp_path), "--all")
    assert code == 2, out
    assert "OK " in out and "step 1," in out and "step 3," in out
    assert f"NOT VERIFIED {tmp_path / 'step_000000002'}: " in out and "Permission" in out
    assert "2 committed steps verified: all intact; 1 could not be verified" in out
    code, out, _ = run(capsys, "verify", str(tmp_path), "--all", "--json")
    doc = json.loads(out)
    assert code == 2 and doc["ok"] is False
    assert [s["step"] for s in doc["steps"]] == [1, 3]
    assert [(s["step"], "Permission denied" in s["error"]) for s in doc["not_verified"]] == [
        (2, True)]
    flip_byte(tmp_path / "step_000000003", "w")  # one corrupt: exit 1 all the same
    assert run(capsys, "verify", str(tmp_path), "--all")[0] == 1


def test_inspect_json_gives_float_scalars_as_numbers(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """cli.md: numbers are JSON numbers (NaN and the infinities strings); a trial's float
    scalars came out as strings, ints as numbers."""
    asyncckpt.save({"w": torch.ones(1), "lr": 1.5e-4, "n": 3, "bad": float("nan"),
                    "top": float("-inf")}, tmp_path, step=1)
    code, out, _ = run(capsys, "inspect", str(tmp_path), "--json")
    values = {s["path"]: s["value"] for s in json.loads(out)["skeleton"]["scalars"]}
    assert code == 0 and values == {"lr": 1.5e-4, "n": 3, "bad": "nan", "top": "-inf"}


def test_a_shard_file_is_named_as_one_by_load_and_verify(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """(a migration trial) load said "a plain safetensors file: use load_safetensors",
    which said "a shard file: load its step directory"; verify, "holds no checksums"."""
    asyncckpt.save({"w": torch.ones(2)}, tmp_path, step=20)
    shard = tmp_path / "step_000000020" / "rank_00000.safetensors"
    with pytest.raises(asyncckpt.CheckpointNotFoundError,
                       match=r"is a shard file of the checkpoint .*step_000000020: load that "
                             r"step directory"):
        asyncckpt.load(shard)
    code, _, err = run(capsys, "verify", str(shard))
    assert code == 2 and "is a shard file of the checkpoint" in err, err


# --- clean, and the lock as ls tells it --------------------------------------------------------

def _leftovers(root: Path) -> dict[str, int]:
    """A save's temporary directory and a half-deleted step, as a killed run leaves them:
    name -> the bytes of its files."""
    made = {".step_000000040.tmp-0123abcd": 3000, ".step_000000020.deleting-4567ef01": 1234}
    for name, size in made.items():
        (root / name / "sub").mkdir(parents=True)
        (root / name / "shard.bin").write_bytes(b"x" * (size - 100))
        (root / name / "sub" / "manifest.json").write_bytes(b"y" * 100)
    return made


def _holder_process(root: Path) -> subprocess.Popen[str]:
    """Another process whose AsyncCheckpointer saved into ``root`` and holds its lock
    until a line is written to its stdin."""
    src = str(Path(asyncckpt.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    script = ("import sys, torch, asyncckpt\n"
              "c = asyncckpt.AsyncCheckpointer(sys.argv[1], mode='sync')\n"
              "c.save_async({'w': torch.zeros(4)}, 40).wait()\n"
              "print('ready', flush=True)\n"
              "sys.stdin.readline()\n"
              "c.close()\n")
    proc = subprocess.Popen([sys.executable, "-c", script, str(root)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n", proc.poll()
    return proc


def test_clean_removes_abandoned_dirs_and_no_committed_step(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    made = _leftovers(root)
    (root / ".step_000000050.tmp-NOTHEX").mkdir()  # (no name a save gives: not ours)
    (root / "notes").mkdir()
    code, out, err = run(capsys, "clean", str(root), "--json")
    assert code == 0 and err == "", err
    doc = json.loads(out)
    assert doc["ok"] is True and doc["dry_run"] is False and doc["root"] == str(root)
    assert doc["removed"] == sorted(made)
    assert {r["name"]: (r["bytes"], r["removed"], r["error"]) for r in doc["abandoned"]} == {
        name: (size, True, None) for name, size in made.items()}
    assert {r["name"]: r["kind"] for r in doc["abandoned"]} == {
        ".step_000000040.tmp-0123abcd": "tmp", ".step_000000020.deleting-4567ef01": "deleting"}
    assert doc["bytes_freed"] == sum(made.values())
    # (it took it itself)
    assert doc["lock"] == {"held": False, "pid": None, "note": None, "host": None}
    assert sorted(os.listdir(root)) == [".asyncckpt.lock", ".step_000000050.tmp-NOTHEX",
                                        "notes", "step_000000010", "step_000000020",
                                        "step_000000030"]
    assert run(capsys, "verify", str(root), "--all")[0] == 0  # every step whole
    # the lock was released: a save takes it
    with asyncckpt.AsyncCheckpointer(root, mode="sync") as ckpt:
        ckpt.save_async(_state(40), 40).wait()
    made = _leftovers(root)
    code, out, err = run(capsys, "clean", str(root))
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split() == ["DIRECTORY", "SIZE"]
    assert lines[1].split() == [".step_000000020.deleting-4567ef01", "1.2", "KiB", "removed"]
    assert lines[2].split() == [".step_000000040.tmp-0123abcd", "2.9", "KiB", "removed"]
    assert lines[3] == f"removed 2 abandoned directories under {root}, 4.1 KiB freed"
    code, out, _ = run(capsys, "clean", str(root))  # again: nothing left
    assert code == 0 and out == f"nothing to remove under {root}: no abandoned temporary " \
        "directories\n"
    assert asyncckpt.AsyncCheckpointer(root).steps() == [10, 20, 30, 40]


def test_clean_dry_run_removes_nothing(root: Path, capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    made = _leftovers(root)
    before = sorted(os.listdir(root))
    lock_file = (root / ".asyncckpt.lock").read_bytes()
    code, out, err = run(capsys, "clean", str(root), "--dry-run")
    assert code == 0 and err == ""
    assert [ln.split()[-3:] for ln in out.splitlines()[1:3]] == [["would", "be", "removed"]] * 2
    assert "2 abandoned directories, 4.1 KiB: none removed (--dry-run)" in out
    code, out, _ = run(capsys, "clean", str(root), "--dry-run", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["dry_run"] is True and doc["removed"] == []
    assert doc["bytes_freed"] == 0
    assert {r["name"]: (r["bytes"], r["removed"]) for r in doc["abandoned"]} == {
        n: (size, False) for n, size in made.items()}
    assert sorted(os.listdir(root)) == before
    assert (root / ".asyncckpt.lock").read_bytes() == lock_file  # (not taken: no pid written)
    _no_lock_taken(monkeypatch)  # (a save that came meanwhile would fail)
    assert run(capsys, "clean", str(root), "--dry-run")[0] == 0
    assert sorted(os.listdir(root)) == before


def test_clean_refuses_while_another_process_holds_the_lock(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    proc = _holder_process(root)
    try:
        made = _leftovers(root)  # (after its first save, which removed what was there)
        code, out, err = run(capsys, "clean", str(root))
        assert code == 2 and out == ""
        assert (f"asyncckpt: error: the lock of {root} is held by pid {proc.pid} on host "
                f"{HOST} (the pid its lock file names), a trainer saving there or another "
                "clean: nothing was removed") in err, err
        code, out, _ = run(capsys, "clean", str(root), "--json")
        doc = json.loads(out)
        assert code == 2 and doc["ok"] is False
        assert doc["error"]["type"] == "CheckpointLockedError"
        assert doc["error"]["exit_code"] == 2 and f"pid {proc.pid}" in doc["error"]["message"]
        assert doc["lock"] == {"held": True, "pid": proc.pid, "note": None, "host": HOST}
        code, out, err = run(capsys, "clean", str(root), "--dry-run")  # (its verdict too)
        assert code == 2 and f"held by pid {proc.pid} on host {HOST} (as /proc/locks shows)" \
            in err, err
        # ... and what it would remove, listed all the same (a CLI trial's listed nothing)
        assert all(name in out for name in made) and "none removed (--dry-run)" in out, out
        code, out, _ = run(capsys, "clean", str(root), "--dry-run", "--json")
        doc = json.loads(out)
        assert code == 2 and doc["ok"] is False and doc["dry_run"] is True
        assert sorted(r["name"] for r in doc["abandoned"]) == sorted(made)
        assert doc["error"]["type"] == "CheckpointLockedError" and doc["lock"]["held"] is True
        assert all((root / name).is_dir() for name in made)
        # ls says a save may be writing them
        code, out, _ = run(capsys, "ls", str(root))
        assert code == 0
        assert (f"  the lock of {root} is held by pid {proc.pid} on host {HOST}: a save may "
                "be writing or removing them right now") in out.splitlines(), out
        code, out, _ = run(capsys, "ls", str(root), "--json")
        assert json.loads(out)["lock"] == {"held": True, "pid": proc.pid, "note": None,
                                           "host": HOST}
    finally:
        assert proc.stdin is not None
        proc.stdin.write("\n")
        proc.stdin.close()
        proc.wait(timeout=60)
    assert proc.returncode == 0
    code, out, _ = run(capsys, "ls", str(root), "--json")
    assert json.loads(out)["lock"]["held"] is not True  # (it ended: its lock went with it)
    code, out, _ = run(capsys, "clean", str(root), "--json")
    assert code == 0 and json.loads(out)["removed"] == sorted(made)


def test_clean_refuses_beside_a_checkpointer_of_this_process(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with asyncckpt.AsyncCheckpointer(root, mode="sync") as ckpt:
        ckpt.save_async(_state(40), 40).wait()  # (takes the lock, holds it until closed)
        made = _leftovers(root)
        code, _, err = run(capsys, "clean", str(root))
        assert code == 2 and f"held by pid {os.getpid()}" in err
        assert all((root / name).is_dir() for name in made)
        ckpt.save_async(_state(50), 50).wait()  # (its lock is still its own)
    assert run(capsys, "clean", str(root))[0] == 0
    assert not any((root / name).exists() for name in made)


def _no_lock_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any attempt to take a lock fail the test (ls must not: a save that came
    meanwhile would find the lock held, and fail)."""
    import asyncckpt.storage

    real = asyncckpt.storage.fcntl.flock

    def no_flock(fd: int, op: int) -> None:
        if not op & asyncckpt.storage.fcntl.LOCK_UN:
            raise AssertionError("a lock was tried")
        real(fd, op)

    monkeypatch.setattr(asyncckpt.storage.fcntl, "flock", no_flock)


def test_ls_tells_whether_the_lock_is_held(root: Path, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    if not Path("/proc/locks").exists():
        pytest.skip("no /proc/locks here: ls cannot tell")
    made = _leftovers(root)
    with asyncckpt.AsyncCheckpointer(root, mode="sync") as ckpt:  # (made after: they stay)
        ckpt.save_async(_state(40), 40).wait()
        ckpt.wait()  # (and the removal of those made before, which runs in the background:
        # a loaded CI's mkdir met them still there)
        made = _leftovers(root)
        _no_lock_taken(monkeypatch)  # (ls neither takes the lock nor waits for it)
        code, out, _ = run(capsys, "ls", str(root))
        assert code == 0
        assert ("2 incomplete or abandoned temp dirs (never read; the next save here removes "
                f"them): {', '.join(sorted(made))}") in out
        assert (f"  the lock of {root} is held by pid {os.getpid()} on host {HOST}: a save "
                "may be writing or removing them right now") in out.splitlines()
        code, out, _ = run(capsys, "ls", str(root), "--json")
        doc = json.loads(out)
        assert doc["incomplete"] == sorted(made)  # (as it was)
        assert doc["lock"] == {"held": True, "pid": os.getpid(), "note": None, "host": HOST}
    # closed: nobody holds it
    code, out, _ = run(capsys, "ls", str(root), "--json")
    lock = json.loads(out)["lock"]
    code, text, _ = run(capsys, "ls", str(root))
    if lock["held"] is False:  # (a local filesystem, seen from the first pid namespace)
        assert lock == {"held": False, "pid": None, "note": None, "host": None}
        assert (f"  no process holds the lock of {root}: they are abandoned; 'asyncckpt clean "
                f"{root}' removes them") in text.splitlines(), text
    else:  # (where a holder on another machine or in another container would not be seen)
        assert lock["held"] is None and lock["note"] and lock["pid"] == os.getpid(), lock
    # where a holder elsewhere would not be seen (NFS), ls says it cannot tell
    real_mount = storage_mod._mount_of

    def nfs(path: Path) -> tuple[str, int] | None:
        found = real_mount(path)
        return None if found is None else ("nfs4", found[1])

    monkeypatch.setattr(storage_mod, "_mount_of", nfs)
    code, out, _ = run(capsys, "ls", str(root), "--json")
    assert json.loads(out)["lock"] == {
        "held": None, "pid": os.getpid(),  # (the last to take it, as its lock file says)
        "note": "on a nfs4 filesystem, a holder on another machine is not seen from here",
        "host": HOST}
    code, out, _ = run(capsys, "ls", str(root))
    assert (f"  whether a process holds the lock of {root} cannot be told here (on a nfs4 "
            "filesystem, a holder on another machine is not seen from here; its lock file "
            f"names pid {os.getpid()} on host {HOST}, the last process that took it): "
            "'asyncckpt clean "
            f"{root}' removes them unless one does") in out, out
    code, out, _ = run(capsys, "clean", str(root), "--dry-run")  # (and lists them all the same)
    assert code == 0 and "whether a process holds the lock of" in out
    # without /proc/locks: cannot tell either
    monkeypatch.setattr(storage_mod, "_flock_holders", lambda inode, devices: None)
    code, out, _ = run(capsys, "ls", str(root), "--json")
    assert json.loads(out)["lock"]["held"] is None


def test_ls_of_a_root_without_a_lock_file_creates_none(
        tmp_path: Path, root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    (copy / ".asyncckpt.lock").unlink()  # (a root copied without it, or of an old version)
    (copy / ".step_000000040.tmp-0123abcd").mkdir()
    code, out, _ = run(capsys, "ls", str(copy), "--json")
    assert code == 0 and json.loads(out)["lock"] == {"held": False, "pid": None, "note": None,
                                                     "host": None}
    assert not (copy / ".asyncckpt.lock").exists()
    code, out, _ = run(capsys, "ls", str(copy / "step_000000010"), "--json")
    assert code == 0 and json.loads(out)["lock"] is None  # (a step directory has none)
    code, out, _ = run(capsys, "ls", str(root))
    assert "held" not in out and "lock" not in out  # (no temporary directory: nothing said)


def test_clean_of_a_missing_root_or_a_step_dir_is_an_error(
        tmp_path: Path, root: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "nope" / "ckpts"
    code, out, err = run(capsys, "clean", str(missing))
    assert code == 2 and out == ""
    assert f"asyncckpt: error: {missing} does not exist: pass a checkpoint root directory" in err
    code, out, _ = run(capsys, "clean", str(missing), "--json")
    doc = json.loads(out)
    assert code == 2 and doc["ok"] is False and doc["error"]["type"] == "UsageError"
    assert not (tmp_path / "nope").exists()  # (no root made, nor its parent)
    _leftovers(root)
    _no_lock_taken(monkeypatch)  # (refused before it is taken)
    for inside in (root / "step_000000020", root / "step_000000020" / "sub"):
        inside.mkdir(exist_ok=True)
        code, _, err = run(capsys, "clean", str(inside))
        assert code == 2 and "pass the checkpoint root" in err, err
    code, _, err = run(capsys, "clean", str(root / "step_000000020" / "manifest.json"))
    assert code == 2 and "is not a directory" in err
    assert len(commit_abandoned(root)) == 2  # (none of it removed)
    # a directory that is no checkpoint root (a path mistyped): nothing removed, no lock made
    plain = tmp_path / "plain"
    plain.mkdir()
    assert run(capsys, "clean", str(plain)) == (
        0, f"nothing to remove under {plain}: no abandoned temporary directories\n", "")
    assert os.listdir(plain) == []


def commit_abandoned(root: Path) -> list[str]:
    from asyncckpt import commit

    return commit.abandoned_dirs(root, LocalStorage())


def test_clean_says_what_it_could_not_remove(
        root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    made = _leftovers(root)
    _deny(monkeypatch, "remove_tree", ".step_000000040.tmp-0123abcd")
    code, out, err = run(capsys, "clean", str(root), "--json")
    assert code == 2
    assert "asyncckpt: warning: could not remove abandoned" in err and "Permission denied" in err
    doc = json.loads(out)
    assert doc["ok"] is False and doc["removed"] == [".step_000000020.deleting-4567ef01"]
    assert doc["bytes_freed"] == made[".step_000000020.deleting-4567ef01"]
    row = {r["name"]: r for r in doc["abandoned"]}[".step_000000040.tmp-0123abcd"]
    assert row["removed"] is False and "Permission denied" in row["error"]
    assert (root / ".step_000000040.tmp-0123abcd").is_dir()
    code, out, _ = run(capsys, "clean", str(root))
    assert code == 2 and "NOT REMOVED: could not remove abandoned" in out
    assert out.splitlines()[-1].endswith("; 1 could not be removed")
    # the lock was released all the same
    with asyncckpt.AsyncCheckpointer(root, mode="sync") as ckpt:
        ckpt.save_async(_state(40), 40).wait()


def test_clean_without_manifest_removes_the_step_dirs_ls_reports_as_lost(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # (a crash trial's copy held a step directory without its manifest: ls exited 1 for
    # ever after, retention never removed it, and clean said "nothing to remove")
    bare = root / "step_000000005"
    bare.mkdir()
    (bare / "rank_00000.safetensors").write_bytes(b"x" * 100)
    code, out, _ = run(capsys, "ls", str(root))
    assert code == 1 and f"'asyncckpt clean {root} --without-manifest' removes them" in out
    code, out, _ = run(capsys, "clean", str(root))  # (not asked for: kept, and said)
    assert code == 0 and bare.is_dir()
    assert ("1 step directory without manifest.json left as they are (step_000000005): "
            "--without-manifest removes them") in out, out
    code, out, _ = run(capsys, "clean", str(root), "--json")
    assert json.loads(out)["without_manifest_left"] == ["step_000000005"]
    code, out, _ = run(capsys, "clean", str(root), "--without-manifest", "--dry-run", "--json")
    doc = json.loads(out)
    assert code == 0 and [(r["name"], r["kind"], r["removed"]) for r in doc["abandoned"]] == [
        ("step_000000005", "without_manifest", False)] and bare.is_dir()
    code, out, err = run(capsys, "clean", str(root), "--without-manifest")
    assert code == 0 and err == "", err
    assert out.splitlines()[1].split() == ["step_000000005", "100", "B", "removed"]
    assert not bare.exists()
    assert run(capsys, "ls", str(root))[0] == 0
    assert asyncckpt.AsyncCheckpointer(root).steps() == [10, 20, 30]
    code, out, _ = run(capsys, "clean", str(root), "--without-manifest")
    assert out == (f"nothing to remove under {root}: no abandoned temporary directories, "
                   "no step directory without its manifest\n")


def test_inspect_tells_a_tab_from_a_backslash_and_a_t(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # (a trial's keys "a<TAB>b" and "a\\tb" were listed as two rows of 'a\tb')
    asyncckpt.save({"a\tb": torch.ones(1), "a\\tb": torch.ones(2)}, tmp_path, step=1)
    code, out, _ = run(capsys, "inspect", str(tmp_path))
    rows = {ln.split()[0]: ln.split()[2] for ln in out.splitlines()[1:3]}
    assert code == 0 and rows == {"a\\tb": "[1]", "a\\\\tb": "[2]"}, out
    asyncckpt.save({"a\\tb": torch.ones(2)}, tmp_path / "alone", step=1)
    code, out, _ = run(capsys, "inspect", str(tmp_path / "alone"))  # (no escapes: as it is)
    assert out.splitlines()[1].split()[0] == "a\\tb"


@pytest.mark.parametrize("cmd", ["ls", "verify"])
def test_ls_and_verify_all_list_the_root_again_for_the_steps_committed_meanwhile(
        root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch, cmd: str) -> None:
    """A trial beside a trainer with keep_last=1: 'ls --json' said an old step was the
    latest, and 'verify --all' skipped the newest, when the step they read was retired
    meanwhile (docs/cli.md: the root is listed again for the steps committed since)."""
    import asyncckpt.cli as cli

    step_40 = _step_40(tmp_path)
    os.symlink("step_000000007", root / "step_000000007")  # a loop: one row, said once
    name = "read_manifest_summary" if cmd == "ls" else "_verified"
    real = getattr(cli, name)
    gone: list[Path] = []

    def retired_meanwhile(step_dir: Path, storage: Any, *args: Any) -> Any:
        if not gone and step_dir.name == "step_000000030":
            gone.append(step_dir)
            # the trainer commits step 40 and its keep_last retires step 30
            os.rename(step_40, root / "step_000000040")
            os.rename(step_dir, root / ".step_000000030.deleting-x")
            shutil.rmtree(root / ".step_000000030.deleting-x")
        return real(step_dir, storage, *args)

    monkeypatch.setattr(cli, name, retired_meanwhile)
    argv = ["ls", str(root)] if cmd == "ls" else ["verify", str(root), "--all"]
    code, out, err = run(capsys, *argv, "--json")
    doc = json.loads(out)
    assert gone and [e["step"] for e in doc["steps"] if e["step"] != 7] == [10, 20, 40], doc
    assert code == 1 and err == "", (out, err)  # (1: the loop)
    assert [e["step"] for e in doc["steps"]] == [7, 10, 20, 40], doc
    if cmd == "ls":
        assert doc["latest"] == 40
        assert [e["error"] is None for e in doc["steps"]] == [False, True, True, True]
    else:
        assert [e["ok"] for e in doc["steps"]] == [False, True, True, True]


def test_verify_all_counts_a_step_dir_it_cannot_list_as_verify_and_ls_do(
        root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trial: with step_000000040 a symbolic link loop (standing in for EIO), 'verify
    ROOT --all' said "all intact" and exited 0, where 'verify ROOT' and 'ls' exit 1."""
    os.symlink("step_000000040", root / "step_000000040")
    assert run(capsys, "verify", str(root))[0] == 1
    assert run(capsys, "ls", str(root))[0] == 1
    code, out, err = run(capsys, "verify", str(root), "--all")
    assert code == 1 and "all intact" not in out and err == "", (out, err)
    assert f"CORRUPT {root / 'step_000000040'}" in out and "cannot be listed" in out
    assert "4 committed steps verified: 1 corrupt (step_000000040)" in out
    code, out, _ = run(capsys, "verify", str(root), "--all", "--json")
    doc = json.loads(out)
    assert code == 1 and doc["ok"] is False and doc["not_verified"] == []
    assert [(s["step"], s["ok"]) for s in doc["steps"]] == [
        (10, True), (20, True), (30, True), (40, False)]
    assert "damaged_mark" not in doc["steps"][-1]  # (nothing of it could be read)
    (root / "step_000000040").unlink()
    # one it may not list: not verified (exit 2), the others verified all the same (it
    # failed whole, with no "steps")
    _deny(monkeypatch, "listdir", "step_000000020")
    code, out, _ = run(capsys, "verify", str(root), "--all", "--json")
    doc = json.loads(out)
    assert code == 2 and [s["step"] for s in doc["steps"]] == [10, 30], doc
    assert [(e["step"], "Permission denied" in e["error"]) for e in doc["not_verified"]] == [
        (20, True)]


def test_ls_of_a_step_dir_it_may_read_but_not_search_is_no_damage(
        root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trial's step directory of mode 0400 (listed, but every file in it "permission
    denied"): ls said "a load found it damaged (damaged.json: damaged.json cannot be read
    (Permission denied))" and exited 1, where docs/cli.md says 2."""
    real = LocalStorage.read_bytes

    def unsearchable(self: LocalStorage, path: Path, limit: int) -> bytes:
        if Path(path).parent.name == "step_000000020":  # (the tests run as root)
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real(self, path, limit)

    monkeypatch.setattr(LocalStorage, "read_bytes", unsearchable)
    code, out, _ = run(capsys, "ls", str(root))
    assert code == 2 and "UNREADABLE" in out and "Permission denied" in out, out
    assert "damaged" not in out, out
    code, out, _ = run(capsys, "ls", str(root), "--json")
    row = json.loads(out)["steps"][1]
    assert code == 2 and row["step"] == 20 and row["damaged"] == [], row
    # a damaged.json that is there, if unreadable, still marks the step
    (root / "step_000000020" / "damaged.json").write_text("{}")
    code, out, _ = run(capsys, "ls", str(root), "--json")
    row = json.loads(out)["steps"][1]
    assert code == 1 and "damaged.json cannot be read (Permission denied)" in row["damaged"][0]


def test_ls_of_a_shard_this_user_may_not_read_is_a_step_it_cannot_tell_of(
        root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # (an adversary trial: a shard of mode 000 was OK to ls, exit 0, while every load,
    # inspect and verify raised CheckpointPermissionError, exit 2)
    real = os.access

    def access(path: Any, mode: int, **kw: Any) -> bool:  # (the tests run as root)
        if "step_000000020" in os.fspath(path) and str(path).endswith(".safetensors"):
            return False
        return real(path, mode, **kw)

    monkeypatch.setattr(os, "access", access)
    code, out, _ = run(capsys, "ls", str(root))
    assert code == 2, out
    assert "cannot be read by this user (permission denied): a load of this step fails" in out
    code, out, _ = run(capsys, "ls", str(root), "--json")
    row = json.loads(out)["steps"][1]
    assert code == 2 and row["step"] == 20 and "permission denied" in row["error"], row
    # (an ops trial: its manifest was read, yet every value was null, and the file named
    # bare) what the manifest says is kept, the file named by its path
    assert row["created_unix"] is not None and row["tensors"] == 3 and row["bytes"] > 0, row
    assert row["error"].startswith(str(root / "step_000000020" / "rank_00000.safetensors"))


def test_ls_and_verify_all_name_a_root_they_may_not_list_as_the_other_commands(
        root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # (ls and verify --all said "PermissionError", the others CheckpointPermissionError)
    _deny(monkeypatch, "listdir", root.name)
    for argv in (["ls"], ["verify", "--all"], ["verify"], ["inspect"]):
        code, out, err = run(capsys, *argv, str(root), "--json")
        error = json.loads(out)["error"]
        assert code == 2 and error["type"] == "CheckpointPermissionError", (argv, error)
        assert "read access" in error["message"] and "read access" in err


def test_ls_says_a_fifo_or_a_directory_in_a_files_place_is_not_a_regular_file(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """As verify says (ls said "is 0 bytes, not N" of a FIFO, "4096 bytes" of a directory)."""
    shard = "rank_00000.safetensors"
    (root / "step_000000020" / shard).unlink()
    os.mkfifo(root / "step_000000020" / shard)
    (root / "step_000000030" / shard).unlink()
    (root / "step_000000030" / shard).mkdir()
    code, out, _ = run(capsys, "ls", str(root), "--json")
    rows = json.loads(out)["steps"]
    assert code == 1
    assert [r["damaged"] for r in rows] == [[], *[[
        f"{shard} is not a regular file (a FIFO, device or directory)"]] * 2], rows
    code, _, err = run(capsys, "inspect", str(root))
    assert code == 1 and f"{shard} is not a regular file" in err, err


def test_export_of_a_damaged_best_or_latest_step_names_the_one_to_pass_instead(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A deploy trial's 'export --best' beside a trainer met a damaged best step (a reader
    cannot mark it: ls and export --best go on naming it), told no step to pass instead."""
    root = tmp_path / "ck"
    with asyncckpt.AsyncCheckpointer(root, mode="sync", best_metric="loss") as ckpt:
        for step, loss in ((1, 3.0), (2, 1.0), (3, 2.0)):
            ckpt.save({"model": {"w": torch.full((64,), float(step))}}, step,
                      metrics={"loss": loss})
    flip_byte(root / "step_000000002", "model/w")
    out = tmp_path / "out.safetensors"
    assert main(["export", "--best", "loss", str(root), str(out)]) == 1
    err = capsys.readouterr().err
    assert "--best loss was step 2; the next best is step 3: pass --step 3" in err, err
    assert main(["export", "--step", "3", str(root), str(out)]) == 0
    flip_byte(root / "step_000000003", "model/w")
    assert main(["export", "--force", str(root), str(out)]) == 1
    err = capsys.readouterr().err
    assert "the latest step was step 3; the step before it is step 2: pass --step 2" in err
    assert main(["export", "--force", "--step", "3", str(root), str(out)]) == 1
    assert "pass --step" not in capsys.readouterr().err  # (a step named: nothing else to say)


def test_ls_of_a_step_retired_as_its_files_are_checked_for_access_drops_it(
        root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
        ) -> None:
    """A CLI trial's ls beside a trainer (keep_last=2) exited 2 about once in 1,500 runs:
    a step retention renamed away between the size check and the access check read as
    "cannot be read by this user (permission denied)"."""
    import asyncckpt.cli as cli

    real_access = os.access

    def retire_then_access(path: Any, mode: int) -> bool:
        step_dir = Path(path).parent
        if step_dir.name == "step_000000010":  # (as retention hides a step)
            step_dir.rename(step_dir.with_name(".step_000000010.deleting-0123456789ab"))
        return real_access(path, mode)

    monkeypatch.setattr(cli.os, "access", retire_then_access)
    code, out, err = run(capsys, "ls", str(root), "--json")
    doc = json.loads(out)
    assert code == 0 and [r["step"] for r in doc["steps"]] == [20, 30], (out, err)
    assert all(r["error"] is None for r in doc["steps"])


def test_a_step_older_than_the_latest_and_gone_is_told_retention_may_have_removed_it(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A CLI trial's 'verify ROOT --step 13' of a step ls had just listed, removed since by
    a trainer's keep_last, was told to "check the path"."""
    code, _, err = run(capsys, "verify", str(root), "--step", "15")
    assert code == 2 and "(committed steps: 10, 20, 30); older than the latest: if it was " \
        "saved, retention (a saver's keep_last) may have removed it since" in err, err
    code, _, err = run(capsys, "verify", str(root), "--step", "31")  # (newer: never saved)
    assert code == 2 and "retention" not in err and "check the path" in err, err  # (a typo?)


@pytest.mark.parametrize("argv", [["ls", ""], ["clean", ""], ["verify", ""], ["inspect", ""],
                                  ["export", "", "out.safetensors"], ["serve", ""]])
def test_an_empty_path_is_a_usage_error_not_the_working_directory(
        argv: list[str], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A CLI trial's cron job ran 'ls "$UNSET" --json': exit 0, no steps, a false green."""
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, *argv, "--json")
    doc = json.loads(out)
    assert code == 2 and doc["ok"] is False and "is empty: pass a path" in \
        doc["error"]["message"], (out, err)
    assert os.listdir(tmp_path) == []  # (nothing made in the working directory)


@pytest.mark.parametrize("flag", [["--step", "1"], ["--best", "val_loss"]])
def test_inspect_of_plain_safetensors_refuses_a_step_choice(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: list[str]) -> None:
    """A CLI trial's CI gate ran 'inspect model.safetensors --best val_loss': exit 0, as if
    it had inspected the best step (--step was refused)."""
    f = tmp_path / "model.safetensors"
    safetensors.torch.save_file({"w": torch.ones(2)}, str(f))
    code, _, err = run(capsys, "inspect", str(f), *flag)
    assert code == 2 and f"which have no steps: drop {flag[0]}" in err, err


def test_inspect_says_it_takes_safetensors_files_and_the_directory_of_an_index(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A CLI trial: inspect of an index.json said "pass a checkpoint root or a step
    directory", ignoring the plain safetensors files inspect takes."""
    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"weight_map": {}}')
    code, _, err = run(capsys, "inspect", str(index))
    assert code == 2 and "a .safetensors file or a directory of them" in err
    assert f"an index of sharded safetensors files: pass {tmp_path}, which holds it" in err
    code, _, err = run(capsys, "verify", str(index))
    assert code == 2 and "which holds it" not in err and "or a step directory" in err, err


def test_sigterm_ends_a_command_as_ctrl_c_does_with_its_json_document(
        root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
        ) -> None:
    """A CLI trial: SIGTERM to export exited 130 with "KeyboardInterrupt" (no library
    type), to verify, ls or inspect it killed the process (143) with no JSON document."""
    import signal
    import time

    import asyncckpt.cli as cli

    def terminated(args: Any) -> int:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        raise AssertionError("SIGTERM did not end the command")

    monkeypatch.setattr(cli, "cmd_ls", terminated)
    before = signal.getsignal(signal.SIGTERM)
    code, out, err = run(capsys, "ls", str(root), "--json")
    assert code == 130 and json.loads(out)["error"] == {
        "type": "Interrupted", "message": "interrupted", "exit_code": 130}, (out, err)
    assert signal.getsignal(signal.SIGTERM) is before  # (put back)


def test_a_second_sigterm_does_not_cut_the_clean_up_of_the_first_short(
        root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
        ) -> None:
    """(a review) `timeout` signals a command, then its process group: the second
    SIGTERM, raised inside the clean-up the first started, left a sharded export's
    temporary directory (GBs of shards) behind."""
    import signal
    import time

    import asyncckpt.cli as cli

    cleaned: list[bool] = []

    def terminated(args: Any) -> int:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
            raise AssertionError("SIGTERM did not end the command")
        except KeyboardInterrupt:
            os.kill(os.getpid(), signal.SIGTERM)  # (the process group's, mid-clean-up)
            time.sleep(0.05)
            cleaned.append(True)
            raise

    monkeypatch.setattr(cli, "cmd_ls", terminated)
    code, out, _ = run(capsys, "ls", str(root), "--json")
    assert code == 130 and cleaned == [True]
    assert json.loads(out)["error"]["type"] == "Interrupted"


def test_a_sigterm_the_caller_ignores_stays_ignored(
        root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
        ) -> None:
    """(review) `trap '' TERM` before a command: its SIGTERM stays ignored, and the
    handler is put back as it was."""
    import signal

    import asyncckpt.cli as cli

    def terminated(args: Any) -> int:
        os.kill(os.getpid(), signal.SIGTERM)
        return 0

    monkeypatch.setattr(cli, "cmd_ls", terminated)
    before = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        assert run(capsys, "ls", str(root))[0] == 0
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, before)


def test_serve_verify_of_a_damaged_step_directory_names_no_latest(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """(review) A step directory given was told "the latest step was step 30; the step
    before it is step 20: pass --step 20", which a step directory refuses."""
    flip_byte(root / "step_000000030", "model/w")
    assert main(["serve", str(root / "step_000000030"), "--verify"]) == 1
    err = capsys.readouterr().err
    assert "not serving" in err and "latest" not in err and "--step" not in err, err


def test_a_step_retired_while_inspect_reads_it_is_no_step_not_damage(
        root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
        ) -> None:
    """A re-check trial's inspect --step of the oldest step beside a trainer (keep_last=2)
    said DAMAGED, "rank_00000.safetensors is missing", exit 1, 66 times in 1,719: the step
    was removed by retention as it was read."""
    import asyncckpt.cli as cli

    real = cli._damaged

    def retired_meanwhile(step_dir: Path, files: Any, storage: Any) -> list[str]:
        step_dir.rename(step_dir.with_name(".step_000000010.deleting-0123456789ab"))
        return real(step_dir, files, storage)

    monkeypatch.setattr(cli, "_damaged", retired_meanwhile)
    code, out, err = run(capsys, "inspect", str(root), "--step", "10", "--json")
    assert code == 2 and "was deleted while it was being read" in json.loads(out)[
        "error"]["message"], (out, err)
    assert "DAMAGED" not in err


def test_a_latest_step_retired_at_every_read_names_the_race_not_the_path(
        root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
        ) -> None:
    """An ops trial's export beside a keep_last=1 trainer saving faster than it read, 1 run
    in 3: told to "use a step that is still committed" and to run 'asyncckpt ls' twice."""
    import asyncckpt.cli as cli
    from asyncckpt.loader import LATEST_TRIES

    real = cli._damaged
    assert LATEST_TRIES == 3  # (the root holds 3 steps: each read retires one)

    def retired_meanwhile(step_dir: Path, files: Any, storage: Any) -> list[str]:
        step_dir.rename(step_dir.with_name(f".{step_dir.name}.deleting-0123456789ab"))
        return real(step_dir, files, storage)

    monkeypatch.setattr(cli, "_damaged", retired_meanwhile)
    code, out, _ = run(capsys, "inspect", str(root), "--json")
    said = json.loads(out)["error"]["message"]
    assert code == 2 and said.startswith(
        f"the latest step under {root} was deleted while it was being read, 3 times in a "
        "row (last step_000000010)"), said
    assert "keep_last=2" in said and said.count("asyncckpt ls") == 0, said


def test_a_step_retired_as_it_is_resolved_is_not_one_without_its_manifest(
        root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
        ) -> None:
    """A re-check trial's export --step beside a trainer was told, 3 times in 1,511,
    "step_N is there without its manifest.json" (exit 1) of a step retention had hidden
    between the listing and the look for its manifest."""
    from asyncckpt import commit

    real = commit._is_committed

    def hidden_meanwhile(root_: Path, name: str, *a: Any, **kw: Any) -> bool:
        if name == "step_000000010" and (root_ / name).exists():
            (root_ / name).rename(root_ / ".step_000000010.deleting-0123456789ab")
        return real(root_, name, *a, **kw)

    monkeypatch.setattr(commit, "_is_committed", hidden_meanwhile)
    code, _, err = run(capsys, "export", str(root), str(root.parent / "o.safetensors"),
                       "--step", "10")
    assert code == 2 and "without its manifest" not in err and \
        "no committed checkpoint for step 10" in err, err


def test_an_interrupt_after_the_json_document_is_out_keeps_its_verdict(
        root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
        ) -> None:
    """A re-check trial's SIGTERM at the end of a long --json document gave a whole
    "ok": true document and exit 130 (the code must say what the document says)."""
    import asyncckpt.cli as cli

    real = cli.cmd_ls

    def then_interrupted(args: Any) -> int:
        real(args)
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_ls", then_interrupted)
    code, out, _ = run(capsys, "ls", str(root), "--json")
    doc = json.loads(out)  # (one document, whole)
    assert code == 0 and doc["ok"] is True

    def interrupted_midway(args: Any) -> int:
        cli._decided(args, 0)
        cli._DOC_OUT[0] = 1  # (as if cut off in its write)
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_ls", interrupted_midway)
    code, out, err = run(capsys, "ls", str(root), "--json")
    assert code == 130 and out == "" and "what was printed is incomplete" in err


def test_a_blank_path_is_a_usage_error_too(
        root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    """A re-check trial's 'export ROOT " "' wrote a file named " " in the working
    directory, where "" was refused."""
    monkeypatch.chdir(tmp_path)
    before = sorted(os.listdir(tmp_path))
    code, _, err = run(capsys, "export", str(root), " ")
    assert code == 2 and "OUT is ' ': pass a path" in err, err
    assert sorted(os.listdir(tmp_path)) == before


def test_serve_verify_of_a_damaged_oldest_step_names_the_latest(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A re-check trial's damaged step 0 (the oldest) was told "no other step to name
    instead" while later steps were committed and intact."""
    flip_byte(root / "step_000000010", "model/w")
    assert main(["serve", str(root), "--step", "10", "--verify"]) == 1
    assert "the latest is step 30: pass --step 30" in capsys.readouterr().err


def test_ls_best_of_a_metric_no_step_recorded_says_so(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A researcher trial's typo, 'ls --best val_los', printed the table as if all was
    well, where export --best says no step recorded it."""
    code, out, _ = run(capsys, "ls", str(root), "--best", "val_los")
    assert code == 0 and "no committed step recorded the metric 'val_los'" in out, out


def test_best_by_a_metric_that_reads_the_other_way_is_told_of(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A researcher trial's export --best val_acc without --max exported the worst kept
    step, exit 0 and not a word (its steps recorded no best_mode: saved without best_metric)."""
    root = tmp_path / "ck"
    with asyncckpt.AsyncCheckpointer(root, mode="sync") as ckpt:
        for step, acc, loss in ((1, 0.5, 2.0), (2, 0.9, 1.0), (3, 0.6, 1.5)):
            ckpt.save(_state(step), step, metrics={"val_acc": acc, "val_loss": loss})
    code, _, err = run(capsys, "ls", str(root), "--best", "val_acc")
    assert code == 0 and "ranks by the least value (step 1), as for a loss (no step " \
        "recorded a best_mode for it): pass --max" in err
    code, _, err = run(capsys, "ls", str(root), "--best", "val_acc", "--max")
    assert code == 0 and err == ""
    code, _, err = run(capsys, "ls", str(root), "--best", "val_loss")
    assert code == 0 and err == ""  # (a loss: the least, as asked)
    _, _, err = run(capsys, "ls", str(root), "--best", "val_loss", "--max")
    assert "drop --max if the least is best" in err
