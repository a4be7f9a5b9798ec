"""Corruption is always detected, never loaded as wrong values.

Hundreds of seeded random trials, each on a fresh copy of a committed checkpoint:
flipped bytes (tensor data, safetensors header, manifest), truncated files, deleted
shard files and manifests, shard files swapped between steps and between the ranks of
a 2-rank checkpoint. ``verify_checkpoint`` must report every one, naming the file, and
``asyncckpt.load`` must raise CheckpointCorruptError naming the file (and the tensor
where one applies) — or, where the damage changes nothing that is read (whitespace in
a header), return values bit-exact equal to what was saved. A deleted manifest makes
the step simply not committed (CheckpointNotFoundError). Damaged manifests are tried
as damaged (the digest must refuse them) and re-sealed (the checks behind the digest
must refuse them, or load the tensors right).
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import shutil
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import asyncckpt
from _manifests import long_entries
from asyncckpt import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
)
from asyncckpt.commit import step_dir_name
from asyncckpt.manifest import MANIFEST_NAME, decode_header
from asyncckpt.reader import verify_checkpoint
from asyncckpt.storage import LocalStorage

from ._crash_worker import global_state, same_tree, save_two_ranks, state_for
from .fuzz_manifest import past_digest, reseal, sealed

SHARD = "rank_00000.safetensors"


def skeleton_scalar_bug(exc: BaseException) -> bool:
    """A skeleton float or bytes value that does not parse once raised a bare ValueError
    from tree.py; the parser now refuses it, so nothing may match any more."""
    frames = traceback.extract_tb(exc.__traceback__)
    return (isinstance(exc, ValueError) and not isinstance(exc, CheckpointError)
            and any(f.filename.endswith("tree.py") and "asyncckpt" in f.filename
                    for f in frames))
STEPS = (1, 2, 3)
METADATA = {"note": "reliability"}


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corruption-template")
    with asyncckpt.AsyncCheckpointer(root / "one", mode="sync") as ckpt:
        for s in STEPS:
            ckpt.save(state_for(s), s, metadata=METADATA)
    save_two_ranks(root / "two", (1, 2))
    return root


def body_offset(data: bytes) -> int:
    return 8 + int.from_bytes(data[:8], "little")


def tensor_at(step_dir: Path, file: str, offset: int) -> str | None:
    """The manifest's tensor whose bytes in ``file`` hold ``offset``."""
    doc = long_entries(json.loads((step_dir / MANIFEST_NAME).read_bytes()))
    for key, t in doc["tensors"].items():
        for ch in t["chunks"]:
            lo, hi = ch["byte_range"]
            if ch["file"] == file and lo <= offset < hi:
                return str(key)
    return None


def flip(path: Path, offset: int, rng: random.Random) -> bytes:
    """XOR one byte with a random non-zero mask; return the file's original bytes."""
    data = path.read_bytes()
    b = bytearray(data)
    b[offset] ^= rng.randrange(1, 256)
    path.write_bytes(bytes(b))
    return data


class Outcome:
    """What verify and load said about one damaged checkpoint."""

    def __init__(self, step_dir: Path):
        self.verify_problems: list[str] | None = None
        self.verify_error: BaseException | None = None
        try:
            self.verify_problems = verify_checkpoint(step_dir, LocalStorage()).problems
        except CheckpointError as exc:
            self.verify_error = exc
        self.loaded: Any = None
        self.load_error: BaseException | None = None
        try:
            self.loaded = asyncckpt.load(step_dir)
        except CheckpointError as exc:
            self.load_error = exc

    def verify_names(self, needle: str) -> bool:
        if self.verify_error is not None:
            return needle in str(self.verify_error)
        return any(needle in p for p in self.verify_problems or [])

    @property
    def verify_ok(self) -> bool:
        return self.verify_error is None and not self.verify_problems


class Trials:
    """Runs damaged copies of a checkpoint and collects what went wrong."""

    def __init__(self, template: Path, work: Path):
        self.template = template
        self.work = work
        self.n = 0
        self.tried: dict[str, int] = {}
        self.detected: dict[str, int] = {}
        self.failures: list[str] = []

    def copy(self, sub: str, step: int) -> Path:
        self.n += 1
        dst = self.work / f"t{self.n}" / step_dir_name(step)
        shutil.copytree(self.template / sub / step_dir_name(step), dst)
        return dst

    def count(self, kind: str, detected: bool) -> None:
        self.tried[kind] = self.tried.get(kind, 0) + 1
        self.detected[kind] = self.detected.get(kind, 0) + int(detected)

    def fail(self, what: str) -> None:
        self.failures.append(what)

    def expect_detected(self, kind: str, what: str, out: Outcome, file: Path,
                        key: str | None) -> None:
        """verify names the file (and tensor); load raises CheckpointCorruptError naming them."""
        ok = True
        if out.verify_ok or not out.verify_names(str(file)):
            self.fail(f"{what}: verify missed it or did not name {file}: "
                      f"{out.verify_problems or out.verify_error}")
            ok = False
        elif key is not None and not out.verify_names(repr(key)):
            self.fail(f"{what}: verify did not name tensor {key!r}: {out.verify_problems}")
            ok = False
        err = out.load_error
        if not isinstance(err, CheckpointCorruptError):
            self.fail(f"{what}: load gave {type(err).__name__ if err else 'values'}, not "
                      f"CheckpointCorruptError")
            ok = False
        elif err.path != str(file) or (key is not None and err.key != key):
            self.fail(f"{what}: load blamed path={err.path} key={err.key}, not {file} {key!r}")
            ok = False
        self.count(kind, ok)

    def finish(self, figures: Any) -> None:
        """Kinds ending in ``_noop`` changed nothing that is read (they count as loaded
        exact); every other kind must have been detected."""
        real = [k for k in self.tried if not k.endswith("_noop")]
        tried = sum(self.tried[k] for k in real)
        detected = sum(self.detected[k] for k in real)
        print(f"\ncorruptions tried {tried}, detected {detected}; per kind (detected/tried): "
              + ", ".join(f"{k} {self.detected[k]}/{v}" for k, v in sorted(self.tried.items())))
        assert not self.failures, f"{len(self.failures)} failures:\n" + "\n".join(
            self.failures[:10])
        figures.add("corruptions_tried", tried)
        figures.add("corruptions_detected", detected)
        for k, v in self.tried.items():
            figures.add(f"corruptions.{k}.tried", v)
            figures.add(f"corruptions.{k}.detected", self.detected[k])


def header_unchanged(old: bytes, new: bytes) -> bool:
    """True when the damaged header still parses to the same JSON (e.g. padding)."""
    try:
        return decode_header(old, "old") == decode_header(new, "new")
    except CheckpointError:
        return False


def test_random_damage_is_always_detected(template: Path, tmp_path: Path, figures: Any) -> None:
    rng = random.Random(1234)
    t = Trials(template, tmp_path)

    def data_flip(sub: str, step: int, file: str, expected: Callable[[int], Any]) -> None:
        d = t.copy(sub, step)
        raw = (d / file).read_bytes()
        off = rng.randrange(body_offset(raw), len(raw))
        key = tensor_at(d, file, off)
        assert key is not None  # the body has no holes
        flip(d / file, off, rng)
        t.expect_detected("data_flip", f"step {step} {file} byte {off} flipped", Outcome(d),
                          d / file, key)

    for _ in range(200):
        data_flip("one", rng.choice(STEPS), SHARD, state_for)
    for _ in range(60):
        data_flip("two", rng.choice((1, 2)), f"rank_0000{rng.randrange(2)}.safetensors",
                  global_state)

    # safetensors header: detected unless the header still means the same (padding)
    for _ in range(150):
        step = rng.choice(STEPS)
        d = t.copy("one", step)
        raw = (d / SHARD).read_bytes()
        # the length prefix, the JSON, and some of the space padding after it
        json_end = 8 + len(raw[8:body_offset(raw)].rstrip(b" "))
        off = rng.randrange(0, min(body_offset(raw), json_end + 64))
        before = flip(d / SHARD, off, rng)
        after = (d / SHARD).read_bytes()
        out = Outcome(d)
        what = f"step {step} header byte {off} flipped"
        if header_unchanged(before[:body_offset(before)], after[:body_offset(before)]):
            if out.verify_ok and same_tree(out.loaded, state_for(step)) is None:
                t.count("header_padding_noop", True)
            else:
                t.fail(f"{what}: a change that means nothing broke the checkpoint")
            continue
        # A change only to __metadata__ or to a key no tensor uses reads the same tensors,
        # but it is caught all the same: the manifest holds the header's checksum.
        kind = ("header_flip_unlisted_key" if _only_unlisted_changed(before, after)
                else "header_flip")
        t.expect_detected(kind, what, out, d / SHARD, None)

    # truncation of either file
    for _ in range(80):
        step = rng.choice(STEPS)
        d = t.copy("one", step)
        name = rng.choice([SHARD, MANIFEST_NAME])
        data = (d / name).read_bytes()
        cut = rng.randrange(0, len(data))
        (d / name).write_bytes(data[:cut])
        what = f"step {step} {name} truncated to {cut} of {len(data)} bytes"
        out = Outcome(d)
        if name == MANIFEST_NAME and data[:cut].strip() == data.strip():
            ok = out.verify_ok and same_tree(out.loaded, state_for(step)) is None
            if not ok:
                t.fail(f"{what}: dropping the final newline broke the checkpoint")
            t.count("truncate_newline_noop", ok)
            continue
        t.expect_detected(f"truncate_{'shard' if name == SHARD else 'manifest'}", what, out,
                          d / name, None)

    # deleted shard file (one rank's of two, or the only one)
    for sub, step, name in [("one", 1, SHARD), ("one", 3, SHARD),
                            ("two", 1, "rank_00000.safetensors"),
                            ("two", 2, "rank_00001.safetensors")]:
        d = t.copy(sub, step)
        (d / name).unlink()
        t.expect_detected("delete_shard", f"{sub} step {step}: {name} deleted", Outcome(d),
                          d / name, None)

    # shard files swapped between two steps (same layout, same size, other values)
    for a, b in [(1, 2), (2, 3), (1, 3)]:
        da, db = t.copy("one", a), t.copy("one", b)
        tmp = da / "swap.tmp"
        (da / SHARD).rename(tmp)
        (db / SHARD).rename(da / SHARD)
        tmp.rename(db / SHARD)
        for d, s in ((da, a), (db, b)):
            t.expect_detected("swap_steps", f"step {s}: shard swapped between steps {a}/{b}",
                              Outcome(d), d / SHARD, None)

    # shard files swapped between the ranks of a 2-rank checkpoint
    for step in (1, 2):
        d = t.copy("two", step)
        f0, f1 = d / "rank_00000.safetensors", d / "rank_00001.safetensors"
        tmp = d / "swap.tmp"
        f0.rename(tmp)
        f1.rename(f0)
        tmp.rename(f1)
        out = Outcome(d)
        ok = (not out.verify_ok and isinstance(out.load_error, CheckpointCorruptError)
              and out.load_error.path in (str(f0), str(f1)))
        if not ok:
            t.fail(f"2-rank step {step}: rank files swapped, verify={out.verify_problems} "
                   f"load={out.load_error!r}")
        t.count("swap_ranks", ok)
    t.finish(figures)


def _only_unlisted_changed(before: bytes, after: bytes) -> bool:
    """The damaged header parses and its entries for the tensors the manifest lists are
    unchanged: only ``__metadata__`` or a key no tensor uses differs."""
    try:
        h0, _ = decode_header(before, "before")
        h1, _ = decode_header(after, "after")
    except CheckpointError:
        return False
    listed = {k for k in h0 if k != "__metadata__"}
    return all(h0[k] == h1.get(k) for k in listed)


def test_deleted_manifest_means_not_committed(template: Path, tmp_path: Path) -> None:
    root = tmp_path / "root"
    shutil.copytree(template / "one", root)
    (root / step_dir_name(3) / MANIFEST_NAME).unlink()
    ckpt = asyncckpt.AsyncCheckpointer(root)
    assert ckpt.steps() == [1, 2]
    with pytest.raises(CheckpointNotFoundError, match="step 3"):
        asyncckpt.load(root, step=3)
    with pytest.raises(CheckpointNotFoundError):
        asyncckpt.load(root / step_dir_name(3))
    assert same_tree(asyncckpt.load(root), state_for(2)) is None
    ckpt.close()


def manifest_leaves(doc: Any, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], str]]:
    """Every scalar (and every dict key, as ("key", name)) of a JSON document."""
    out: list[tuple[tuple[Any, ...], str]] = []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out.append(((*path, ("key", k)), "key"))
            out += manifest_leaves(v, (*path, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += manifest_leaves(v, (*path, i))
    else:
        out.append((path, type(doc).__name__))
    return out


def mutate_leaf(doc: Any, path: tuple[Any, ...]) -> None:
    """Change one leaf (or key) to another value of its type, as bit rot might."""
    *parents, last = path
    node = doc
    for p in parents:
        node = node[p]
    if isinstance(last, tuple):  # rename a key, keeping its place
        old = last[1]
        new = old[:-1] + ("x" if not old.endswith("x") else "y") if old else "x"
        items = [(new if k == old else k, v) for k, v in node.items()]
        node.clear()
        node.update(items)
        return
    v = node[last]
    if isinstance(v, bool):
        node[last] = not v
    elif isinstance(v, int):
        node[last] = v + 1
    elif isinstance(v, float):
        node[last] = v + 1.0
    elif isinstance(v, str):
        if v and all(c in "0123456789abcdef" for c in v):
            node[last] = v[:-1] + ("0" if v[-1] != "0" else "1")
        else:
            node[last] = v[:-1] + ("x" if not v.endswith("x") else "y") if v else "x"
    elif v is None:
        node[last] = 0


@dataclasses.dataclass
class Results:
    """What damaged manifests did: refused (by the digest check or behind it), loaded
    unchanged, or loaded with something changed; errors that were not the library's."""

    cases: int = 0
    refused_by_digest: int = 0
    refused: int = 0
    unchanged: int = 0
    scalar_changed: list[str] = dataclasses.field(default_factory=list)
    verify_only: list[str] = dataclasses.field(default_factory=list)
    """Loaded right, but verify found the shard header's entry for a tensor unlike the
    manifest's: a changed chunk ``key`` (only verify reads the header's entries; load
    reads by byte range, under the header's checksum)."""
    wrong_tensors: list[str] = dataclasses.field(default_factory=list)
    bare_value_error: list[str] = dataclasses.field(default_factory=list)
    foreign: list[str] = dataclasses.field(default_factory=list)

    def counts(self) -> dict[str, int]:
        return {k: v if isinstance(v, int) else len(v) for k, v in vars(self).items()}


def load_damaged(d: Path, step: int, what: str, res: Results) -> None:
    """Verify and load the step in ``d`` (its manifest damaged) and file the outcome."""
    res.cases += 1
    try:
        report = verify_checkpoint(d, LocalStorage())
        got = asyncckpt.load(d)
        manifest = asyncckpt.AsyncCheckpointer(d).manifest()
    except CheckpointCorruptError as exc:
        if past_digest(exc):
            res.refused += 1
        else:
            res.refused_by_digest += 1
        return
    except CheckpointError as exc:  # (a CheckpointVersionError, from a higher version)
        res.refused += 1
        assert "format version" in str(exc), f"{what}: {type(exc).__name__}: {exc}"
        return
    except Exception as exc:
        bucket = res.bare_value_error if skeleton_scalar_bug(exc) else res.foreign
        bucket.append(f"{what}: {type(exc).__name__}: {exc}")
        return
    want = state_for(step)
    if sorted(_arrays(got)) != sorted(_arrays(want)):
        res.wrong_tensors.append(f"{what}: {same_tree(got, want)}; verify {report.problems}")
        return
    if not report.ok:
        if all(re.search(r": header entry of tensor '[^']+' is ", p) for p in report.problems):
            res.verify_only.append(f"{what}: {report.problems}")
        else:  # verify found more than a header entry: what did load read?
            res.wrong_tensors.append(f"{what}: loaded, yet verify says {report.problems}")
        return
    diff = same_tree(got, want)
    if diff is None and manifest.user_metadata != METADATA:
        diff = f"user_metadata {manifest.user_metadata}"
    if diff is None and manifest.step != step:
        diff = f"manifest says step {manifest.step} in {d.name}"
    if diff is None:
        res.unchanged += 1
    else:
        res.scalar_changed.append(f"{what}: {diff}")
    shutil.rmtree(d.parent)


def run_leaf_mutations(template: Path, work: Path, resealed: bool) -> Results:
    """Mutate every manifest leaf of step 2 in turn, the manifest written back as damaged
    or re-sealed (a valid digest again, so that the checks behind it run)."""
    src = template / "one" / step_dir_name(2)
    raw = (src / MANIFEST_NAME).read_bytes()
    res = Results()
    # the manifest as written (its whole tensors' entries short), and written all long
    cases = [(base, path) for base in (json.loads, lambda r: long_entries(json.loads(r)))
             for path, _ in manifest_leaves(base(raw))]
    for i, (base, path) in enumerate(cases):
        d = work / f"leaf{i}{'s' if resealed else ''}" / step_dir_name(2)
        shutil.copytree(src, d)
        mutated = base(raw)
        mutate_leaf(mutated, path)
        text = json.dumps(mutated, separators=(",", ":")).encode()
        (d / MANIFEST_NAME).write_bytes(reseal(text) if resealed else text)
        load_damaged(d, 2, str(path), res)
    return res


def test_manifest_leaf_mutations_fail_cleanly(template: Path, tmp_path: Path,
                                              figures: Any) -> None:
    """Every field of the manifest changed in turn. As damaged, the digest refuses every
    one: nothing loads. Re-sealed, the checks behind the digest run: only the library's
    errors, and the tensors are never wrong (their checksums, ranges, shapes and dtypes
    are checked); a changed scalar of the state or of the metadata may load (nothing
    but the digest covers them)."""
    damaged = run_leaf_mutations(template, tmp_path, resealed=False)
    print(f"\nmanifest leaf mutations, damaged: {damaged.counts()}")
    assert damaged.refused_by_digest == damaged.cases > 150, damaged.counts()
    loaded = damaged.scalar_changed + damaged.wrong_tensors + damaged.foreign
    assert not loaded, "\n".join(loaded[:10])
    sealed = run_leaf_mutations(template, tmp_path, resealed=True)
    print(f"manifest leaf mutations, re-sealed: {sealed.counts()}")
    assert not sealed.foreign, "\n".join(sealed.foreign[:10])
    assert not sealed.bare_value_error, "\n".join(sealed.bare_value_error[:10])
    assert not sealed.wrong_tensors, "\n".join(sealed.wrong_tensors[:10])
    assert sealed.refused_by_digest == 0 and sealed.refused > 100, sealed.counts()
    figures.add("manifest_leaf_mutations", damaged.cases)
    figures.set("manifest_leaf_mutations_silently_accepted", len(damaged.scalar_changed))
    figures.set("manifest_leaf_mutations_resealed_refused", sealed.refused)
    figures.set("manifest_leaf_mutations_resealed_scalar_changed", len(sealed.scalar_changed))


@pytest.mark.parametrize(("node", "message"), [
    ({"t": "float", "v": "0.00x"}, "float node holds '0.00x', which is no float"),
    ({"t": "bytes", "v": "abc"}, "bytes node holds 'abc', which is no bytes")])
def test_malformed_skeleton_scalar_is_a_corrupt_error(tmp_path: Path, node: dict,
                                                       message: str) -> None:
    asyncckpt.save({"w": torch.ones(2), "x": 0.5}, tmp_path, step=1)
    mp = tmp_path / step_dir_name(1) / MANIFEST_NAME
    doc = json.loads(mp.read_bytes())
    doc["skeleton"]["items"][1][1] = node
    mp.write_bytes(sealed(doc))  # unsealed, only the digest check would ever run
    with pytest.raises(CheckpointCorruptError, match=re.escape(message)) as info:
        asyncckpt.load(tmp_path)
    assert info.value.path == str(mp)
    assert not verify_checkpoint(mp.parent, LocalStorage()).ok


def test_random_manifest_flips_fail_cleanly(template: Path, tmp_path: Path,
                                            figures: Any) -> None:
    """Random byte flips anywhere in the manifest. As damaged, the digest refuses every
    one. Re-sealed (the checks behind it then run): only the library's errors, and the
    tensors are never wrong; a flip in a scalar of the state may load (counted)."""
    rng = random.Random(99)
    src = template / "one" / step_dir_name(3)
    raw = (src / MANIFEST_NAME).read_bytes()
    damaged, sealed_ = Results(), Results()
    for i in range(300):
        off = rng.randrange(len(raw))
        b = bytearray(raw)
        b[off] ^= rng.randrange(1, 256)
        for res, data in ((damaged, bytes(b)), (sealed_, reseal(bytes(b)))):
            d = tmp_path / f"m{i}{'s' if res is sealed_ else ''}" / step_dir_name(3)
            shutil.copytree(src, d)
            (d / MANIFEST_NAME).write_bytes(data)
            load_damaged(d, 3, f"byte {off}", res)
    print(f"\nrandom manifest flips, damaged: {damaged.counts()}\n"
          f"random manifest flips, re-sealed: {sealed_.counts()}")
    # with the digest intact nothing loads, not even a changed scalar
    assert damaged.refused_by_digest == damaged.cases, damaged.counts()
    assert not damaged.scalar_changed and not damaged.bare_value_error, damaged.counts()
    assert not sealed_.foreign, "\n".join(sealed_.foreign[:10])
    assert not sealed_.bare_value_error, "\n".join(sealed_.bare_value_error[:10])
    assert not sealed_.wrong_tensors, "\n".join(sealed_.wrong_tensors[:10])
    assert sealed_.refused_by_digest == 0 and sealed_.refused > 150, sealed_.counts()
    figures.add("manifest_flips_tried", damaged.cases)
    figures.add("manifest_flips_refused", damaged.refused_by_digest + damaged.refused)
    figures.add("manifest_flips_loaded_unchanged", damaged.unchanged)
    figures.add("manifest_flips_loaded_scalar_changed", len(damaged.scalar_changed))
    figures.add("manifest_flips_bare_value_error", len(damaged.bare_value_error))
    figures.add("manifest_flips_resealed_refused", sealed_.refused)
    figures.add("manifest_flips_resealed_loaded_scalar_changed", len(sealed_.scalar_changed))


def _arrays(tree: Any) -> list[tuple[str, str, tuple[int, ...], bytes]]:
    """Every array leaf (torch tensor, numpy array or scalar) as (type, dtype, shape, bytes)."""
    if isinstance(tree, torch.Tensor):
        return [("torch", str(tree.dtype), tuple(tree.shape), _raw(tree))]
    if isinstance(tree, (np.ndarray, np.generic)):
        a = np.asarray(tree)
        return [(type(tree).__name__, str(a.dtype), a.shape, a.tobytes())]
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in _arrays(v)]
    if isinstance(tree, (list, tuple)):
        return [x for v in tree for x in _arrays(v)]
    return []


def _raw(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def test_any_header_change_is_detected(template: Path, tmp_path: Path) -> None:
    for old, new in [(b'"dtype":"F32"', b'"dtype":"F64"'), (b'"format":"pt"', b'"format":"pu"'),
                     (b'"__metadata__"', b'"__metadata_x"')]:
        d = tmp_path / old.decode().replace('"', "").replace(":", "_") / step_dir_name(1)
        shutil.copytree(template / "one" / step_dir_name(1), d)
        raw = (d / SHARD).read_bytes()
        assert old in raw[:body_offset(raw)]
        (d / SHARD).write_bytes(raw.replace(old, new, 1))
        assert not verify_checkpoint(d, LocalStorage()).ok, f"verify missed {old!r} -> {new!r}"
        with pytest.raises(CheckpointCorruptError):
            asyncckpt.load(d)


def test_fallback_loads_the_newest_intact_step(template: Path, tmp_path: Path) -> None:
    rng = random.Random(5)
    root = tmp_path / "root"
    shutil.copytree(template / "one", root)

    def damage(step: int) -> None:
        f = root / step_dir_name(step) / SHARD
        raw = f.read_bytes()
        flip(f, rng.randrange(body_offset(raw), len(raw)), rng)

    damage(3)
    with pytest.raises(CheckpointCorruptError, match="step_000000003"):
        asyncckpt.load(root)
    assert same_tree(asyncckpt.load(root, fallback=True), state_for(2)) is None
    # in place: whatever the corrupt step wrote into the targets is overwritten
    target = state_for(0)
    tensors = dict(target["model"])
    out = asyncckpt.load(root, target, fallback=True)
    assert same_tree(out, state_for(2)) is None
    for k, t in tensors.items():  # into the target's own tensors
        assert out["model"][k] is t and same_tree(t, state_for(2)["model"][k]) is None, k
    (root / step_dir_name(2) / SHARD).unlink()  # a missing file counts as corrupt too
    with asyncckpt.AsyncCheckpointer(root) as ckpt:
        assert same_tree(ckpt.load(fallback=True), state_for(1)) is None
    (root / step_dir_name(1) / MANIFEST_NAME).write_text("{}")  # and an unreadable manifest
    with pytest.raises(CheckpointCorruptError, match="no intact checkpoint") as ei:
        asyncckpt.load(root, fallback=True)
    for s in STEPS:
        assert f"step {s}" in str(ei.value)
