"""What ranks report of each save (whole, or what changed) and the manifest the coordinator
fills from a template: always the bytes a merge of the whole records writes."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import asyncckpt
from asyncckpt import CheckpointSaveError, ShardMetadata
from asyncckpt.dist import merge_records
from asyncckpt.loader import apply_shards
from asyncckpt.manifest import block_checksums, shard_file_name
from asyncckpt.plan import WritePlan, plan_writes
from asyncckpt.reports import RecordBook, RecordSender, skeleton_patch
from asyncckpt.tree import FlatState, flatten

BLOCK = 4096
KW: dict[str, Any] = {"library_version": "test", "block_bytes": BLOCK,
                      "user_metadata": {"run": "r"}, "created_unix": 1_700_000_000.5}


class _Rank:
    """One rank's layout (kept while its state's layout is, as a checkpointer keeps it)."""

    def __init__(self, r: int, world: int):
        self.r, self.world = r, world
        self.sender = RecordSender()
        self.plan: WritePlan | None = None
        self.extra = False  # holds a tensor of its own
        self.lr = 0.1
        self.row = r  # which rows of "w" it holds (times 2)
        self.numpy_ids = True
        self.state_extra = False  # a non-tensor value more (the skeleton's shape changes)

    def state(self, save: int) -> tuple[dict[str, Any], dict[str, ShardMetadata]]:
        gen = torch.Generator().manual_seed(100 * save + self.r)
        state: dict[str, Any] = {
            "w": torch.randn(2, 3, generator=gen),  # rows 2r, 2r+1 of a (2 * world, 3)
            f"own{self.r}": {"big": torch.randn(3 * BLOCK // 4 + 25, generator=gen),  # 4 blocks
                             "ids": np.arange(5, dtype=np.int64) + save},
            "optim": {"param_groups": [{"lr": self.lr, "betas": (0.9, 0.99)}]},
        }
        if self.state_extra:
            state["optim"]["param_groups"][0]["momentum"] = 0.9
        if not self.numpy_ids:
            state[f"own{self.r}"]["ids"] = torch.from_numpy(state[f"own{self.r}"]["ids"])
        if self.extra:
            state[f"extra{self.r}"] = torch.full((7,), float(save))
        return state, {"w": ShardMetadata((2 * self.world, 3), (2 * self.row, 0))}

    def record(self, save: int, coordinator: str = "c") -> tuple[dict[str, Any], FlatState]:
        state, shards = self.state(save)
        flat = flatten(state)
        apply_shards(flat, shards)
        plan = plan_writes(flat.tensors, shard_file_name(self.r))
        if self.plan is None or self.plan.signature != plan.signature:
            self.plan = plan
        sums = [block_checksums(flat.tensors[it.key].contiguous().view(-1).view(torch.uint8)
                                .numpy().tobytes(), BLOCK) for it in self.plan.items]
        rec = self.sender.record(rank=self.r, coordinator=coordinator, plan=self.plan,
                                 flat=flat, sums=sums, replicas={})
        return json.loads(json.dumps(rec)), flat  # as the Store carries it


def _reference(ranks: list[_Rank], step: int) -> bytes:
    whole = [json.loads(json.dumps(rk.sender.sent_whole())) for rk in ranks]
    return merge_records(whole, step=step, **KW).to_json()


def _save(ranks: list[_Rank], book: RecordBook, save: int, **kw: Any) -> list[dict[str, Any]]:
    records = [rk.record(save, **kw)[0] for rk in ranks]
    raw, heads = book.manifest(records, step=save, **KW)
    assert raw == _reference(ranks, save), f"save {save}: the filled manifest differs"
    assert [h["rank"] for h in heads] == [rk.r for rk in ranks]
    assert all(h["file"] == shard_file_name(h["rank"]) for h in heads)
    return records


def _whole(rec: dict[str, Any]) -> bool:
    return "tensors" in rec


def _settle(ranks: list[_Rank], ok: bool = True) -> None:
    for rk in ranks:
        rk.sender.settled(ok)


def _second_save() -> tuple[list[_Rank], RecordBook, list[dict[str, Any]]]:
    """Two ranks whose first save committed, and their records of the second (deltas)."""
    ranks = [_Rank(r, 2) for r in range(2)]
    book = RecordBook()
    _save(ranks, book, 1)
    _settle(ranks)
    records = [rk.record(2)[0] for rk in ranks]
    assert not any(map(_whole, records))
    return ranks, book, records


def test_a_group_reports_whole_once_then_what_changed_and_the_manifest_stays_exact() -> None:
    ranks = [_Rank(r, 3) for r in range(3)]
    book = RecordBook()
    fills = []
    real_fill = book._fill

    def fill(*a: Any) -> bytes:
        fills.append(1)
        return real_fill(*a)

    book._fill = fill  # type: ignore[method-assign,assignment]

    first = _save(ranks, book, 1)
    assert all(map(_whole, first)) and not fills
    _settle(ranks)
    second = _save(ranks, book, 2)  # new values, same layouts
    assert not any(map(_whole, second)) and len(fills) == 1
    assert all("skeleton" not in rec for rec in second)  # (the non-tensor values did not change)
    assert all(len(json.dumps(d)) * 3 < len(json.dumps(w)) for d, w in zip(second, first,
                                                                            strict=True))
    _settle(ranks)
    ranks[1].lr = 0.05  # a scheduler moved rank 1's lr: that value travels, nothing else
    third = _save(ranks, book, 3)
    assert ["skeleton" in rec for rec in third] == [False, False, False]
    assert [rec.get("skeleton_patch") for rec in third] == [
        None, [[0, {"t": "float", "v": "0.05"}]], None]
    assert len(fills) == 2
    _settle(ranks)
    ranks[1].lr = 0.1
    ranks[0].lr = 0.2
    assert [len(rec.get("skeleton_patch", ())) for rec in _save(ranks, book, 31)] == [1, 1, 0]
    _settle(ranks)
    ranks[0].lr = 0.1
    _save(ranks, book, 32)
    _settle(ranks)
    ranks[2].extra = True  # rank 2's layout changes: its record is whole, the merge redone
    fourth = _save(ranks, book, 4)
    assert list(map(_whole, fourth)) == [False, False, True] and len(fills) == 4
    _settle(ranks)
    assert not any(map(_whole, _save(ranks, book, 5))) and len(fills) == 5
    _settle(ranks, False)  # a failed save: every rank reports whole again, and the template serves
    assert all(map(_whole, _save(ranks, book, 6))) and len(fills) == 6
    _settle(ranks)
    assert all(map(_whole, _save(ranks, book, 7, coordinator="another")))  # a new coordinator
    assert len(fills) == 7
    _settle(ranks)
    ranks[0].row, ranks[1].row = 1, 0  # the same local shapes, other boxes
    assert list(map(_whole, _save(ranks, book, 8, coordinator="another"))) == [True, True, False]
    _settle(ranks)
    ranks[2].numpy_ids = False  # the same dtype and shape, another kind of array
    assert list(map(_whole, _save(ranks, book, 9, coordinator="another"))) == [False, False, True]
    assert len(fills) == 7
    _settle(ranks)
    ranks[2].lr = 0.3  # a changed value beside a changed structure: the whole skeleton goes
    ranks[2].state_extra = True
    tenth = _save(ranks, book, 10, coordinator="another")
    assert "skeleton" in tenth[2] and "skeleton_patch" not in tenth[2] and len(fills) == 8


def test_one_process_that_saves_a_changing_state_writes_what_a_whole_merge_writes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end: every committed manifest is byte for byte the one a merge of the
    whole record writes (but for its time), through layout and value changes."""
    def state(save: int) -> dict[str, Any]:
        out: dict[str, Any] = {"model": {f"l{i}": torch.full((3, 1 + i), float(save + i))
                                         for i in range(4)},
                               "big": torch.arange(5000, dtype=torch.float64) + save,
                               "train": {"epoch": save // 3, "ids": np.arange(3) * save}}
        if save >= 4:
            out["model"]["l4"] = torch.ones(2)  # the layout changes once
        return out

    written: list[tuple[bytes, bytes]] = []
    from asyncckpt import writer

    real = writer._manifest_bytes

    def both(job: Any, records: list[dict[str, Any]]) -> bytes:
        raw = real(job, records)
        reference = merge_records([job.reports.sender.sent_whole()], step=job.step,
                                  library_version=job.library_version,
                                  block_bytes=job.block_bytes, user_metadata=job.user_metadata,
                                  created_unix=json.loads(raw)["created_unix"]).to_json()
        written.append((raw, reference))
        return raw

    fills: list[int] = []
    real_fill = RecordBook._fill

    def fill(self: RecordBook, *a: Any) -> bytes:
        fills.append(1)
        return real_fill(self, *a)

    monkeypatch.setattr(writer, "_manifest_bytes", both)
    monkeypatch.setattr(RecordBook, "_fill", fill)
    with asyncckpt.AsyncCheckpointer(tmp_path, mode="async", block_bytes=BLOCK) as ck:
        for save in range(1, 8):
            ck.save_async(state(save), step=save).wait()
        got = ck.load(step=7)
    assert len(written) == 7
    assert len(fills) == 5  # all but the first save and the one whose layout changed
    for raw, reference in written:
        assert raw == reference
    assert torch.equal(got["big"], torch.arange(5000, dtype=torch.float64) + 7)
    assert got["train"]["epoch"] == 2 and torch.equal(got["model"]["l4"], torch.ones(2))
    assert (tmp_path / "step_000000007" / "manifest.json").read_bytes() == written[-1][0]


def test_a_rank_serves_a_view_of_its_part_that_a_whole_merge_would_make() -> None:
    """The book of the view a rank of a group serves peers (writer._offer_arena) is
    filled like the coordinator's, through value, lr and layout changes and failed saves:
    byte for byte what a merge of the rank's whole record, marked partial, makes."""
    rank = _Rank(1, 2)
    served = RecordBook()
    fills: list[int] = []
    real_fill = served._fill

    def fill(*a: Any) -> bytes:
        fills.append(1)
        return real_fill(*a)

    served._fill = fill  # type: ignore[method-assign,assignment]
    sent = []
    for save, change, ok in [(1, None, True), (2, None, True), (3, "lr", True),
                             (4, None, False), (5, "extra", True), (6, "lr", True),
                             (7, "state_extra", True), (8, None, True)]:
        if change == "lr":
            rank.lr += 0.01
        elif change is not None:
            setattr(rank, change, True)
        rank.record(save)
        rec = rank.sender.sent_to(served, 1)
        sent.append(rec)
        raw, heads = served.manifest([rec], step=save, partial=True, **KW)
        reference = merge_records([rank.sender.sent_whole()], step=save, partial=True,
                                  **KW).to_json()
        assert raw == reference, f"save {save}: the served view differs"
        assert json.loads(raw)["partial"] is True and heads[0]["rank"] == 1
        _settle([rank], ok)
    # Whole at the first save and when the layout changed; else only the checksums, and
    # the skeleton when a value of it changed. A failed save changes nothing here: the
    # book is this process's own.
    assert list(map(_whole, sent)) == [True, False, False, False, True, False, False, False]
    assert ["skeleton" in rec for rec in sent] == [True, False, True, False, True, True,
                                                   True, False]
    assert len(fills) == 6


def test_a_report_against_a_frame_the_coordinator_lacks_fails_the_save_then_heals() -> None:
    ranks, _, records = _second_save()
    with pytest.raises(CheckpointSaveError,
                       match=r"step 2 aborted, nothing committed: rank 0 reported only what "
                             r"changed.*does not hold the record"):
        RecordBook().manifest(records, step=2, **KW)  # (a coordinator restarted)
    _settle(ranks, False)
    assert all(map(_whole, _save(ranks, RecordBook(), 3)))


@pytest.mark.parametrize(("mutate", "problem"), [
    (lambda s: s.__setitem__(0, s[0] + ["0" * 16]), "checksum(s) of tensor"),
    (lambda s: s.pop(), "lists for"),
    (lambda s: s[-1].__setitem__(0, "xyz" + s[-1][0][3:]), "not 16 hex digits"),
    (lambda s: s[-1].__setitem__(0, s[-1][0].upper()), "not 16 hex digits"),
    (lambda s: s[-1].__setitem__(0, 12), "not 16 hex digits"),
    (lambda s: s.__setitem__(1, "ab"), "lists for"),
])
def test_checksums_that_do_not_fit_the_frame_are_refused(mutate: Any, problem: str) -> None:
    _, book, records = _second_save()
    mutate(records[1]["sums"])
    with pytest.raises(CheckpointSaveError, match=rf"step 2 aborted.*rank 1's record does not "
                                                  rf"merge.*{re.escape(problem)}"):
        book.manifest(records, step=2, **KW)


def test_a_changed_skeleton_that_loses_tensors_is_refused_on_the_fast_path() -> None:
    """A rank whose tree changed shape but not its tensors' layout (a list shortened
    where another rank keeps tensors): the fill re-checks what a load reaches."""
    ranks, book, records = _second_save()
    for rec in records:  # both ranks' trees lose "own0" (rank 0 still writes it)
        rec["skeleton"] = {"t": "dict", "items": [
            it for it in ranks[rec["rank"]].sender._sent[2]["items"]
            if it[0] != "own0"]}
    with pytest.raises(CheckpointSaveError,
                       match=r"tensors 'own0/ids', 'own0/big' .*state trees disagree"):
        book.manifest(records, step=2, **KW)


def test_differing_replicas_are_still_reported_on_the_fast_path(
        caplog: pytest.LogCaptureFixture) -> None:
    _, book, records = _second_save()
    written = records[0]["sums"]  # rank 0 writes own0/...; rank 1 says it holds a copy
    key = next(k for k in json.loads(book.frames[0].text)["tensors"] if k.startswith("own0"))
    n = list(json.loads(book.frames[0].text)["tensors"]).index(key)
    records[1]["replicas"] = {key: written[n]}
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        book.manifest(records, step=2, **KW)
    assert "hold different values" not in caplog.text
    records[1]["replicas"] = {key: ["0" * 16] * len(written[n])}
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        book.manifest(records, step=2, **KW)
    assert f"hold different values of tensor(s) {key!r}" in caplog.text


_LEAF = object()
_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**62), 2**62),
                     st.floats(allow_nan=True), st.text(max_size=4), st.binary(max_size=4))
_shapes = st.recursive(
    st.just(_LEAF),
    lambda kids: st.one_of(st.lists(kids, max_size=3), st.lists(kids, max_size=3).map(tuple),
                           st.dictionaries(st.text("abc", max_size=2) | st.integers(0, 3), kids,
                                           max_size=3)),
    max_leaves=12)


def _fill_leaves(shape: Any, values: Iterator[Any]) -> Any:
    if shape is _LEAF:
        return next(values)
    if isinstance(shape, dict):
        return {k: _fill_leaves(v, values) for k, v in shape.items()}
    return type(shape)(_fill_leaves(v, values) for v in shape)


def _leaves(shape: Any) -> int:
    if shape is _LEAF:
        return 1
    return sum(map(_leaves, shape.values() if isinstance(shape, dict) else shape))


@settings(max_examples=150, deadline=None)
@given(data=st.data(), shape=_shapes)
def test_a_patch_turns_the_old_skeleton_into_the_new_on_the_coordinator(
        data: st.DataObject, shape: Any) -> None:
    n = _leaves(shape)
    old_values = data.draw(st.lists(_scalars, min_size=n, max_size=n))
    new_values = [data.draw(_scalars) if data.draw(st.booleans()) else v for v in old_values]
    old = flatten({"s": _fill_leaves(shape, iter(old_values))}).skeleton
    new = flatten({"s": _fill_leaves(shape, iter(new_values))}).skeleton
    patch = skeleton_patch(new, old)
    assert patch is not None
    assert [i for i, _ in patch] == sorted({i for i, _ in patch})  # each leaf once, in order
    book = RecordBook()
    book.skeletons[0] = json.loads(json.dumps(old))  # as the Store carries them
    book._patch(0, json.loads(json.dumps(patch)), "x")
    assert book.skeletons[0] == json.loads(json.dumps(new))
    assert (patch == []) == (new == old)
    book._patch(0, json.loads(json.dumps(skeleton_patch(old, new))), "x")  # and back again
    assert book.skeletons[0] == json.loads(json.dumps(old))


@pytest.mark.parametrize(("old", "new"), [
    ({"a": 1}, {"a": 1, "b": 2}),  # a key more
    ({"a": 1}, {"b": 1}),  # another key
    ({1: 1}, {"1": 1}),  # a key of another type
    ([1, 2], [1]),  # a shorter list
    ([1, 2], (1, 2)),  # a tuple for a list
    ({"a": 1}, {"a": [1]}),  # a container for a value
    ({"a": torch.ones(1)}, {"a": 1.0}),  # a value for a tensor
])
def test_skeletons_of_another_shape_have_no_patch(old: Any, new: Any) -> None:
    assert skeleton_patch(flatten(new).skeleton, flatten(old).skeleton) is None


@pytest.mark.parametrize(("patch", "problem"), [
    ([[5, {"t": "int", "v": 1}]], "at leaf 5 of 2"),
    ([[-1, {"t": "int", "v": 1}]], "at leaf -1 of 2"),
    ([["0", {"t": "int", "v": 1}]], "at leaf '0' of 2"),
    ([[0, {"t": "dict", "items": []}]], "at leaf 0 of 2, with {'t': 'dict'"),
    ([[0, {"t": "tensor", "key": "w"}]], "at leaf 0 of 2, with {'t': 'tensor'"),
])
def test_a_patch_that_does_not_fit_is_refused(patch: Any, problem: str) -> None:
    book = RecordBook()
    book.skeletons[1] = json.loads(json.dumps(flatten({"lr": 0.1, "n": [3]}).skeleton))
    with pytest.raises(CheckpointSaveError, match=rf"rank 1's record changes its skeleton "
                                                  rf"{re.escape(problem)}"):
        book._patch(1, patch, "step 2 aborted")


def test_a_manifest_of_chunk_tables_is_filled_as_a_whole_merge_writes_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """From TABLE_MIN_CHUNKS chunks a tensor's go in a table (format version 4), whose
    checksums the template fills in as it fills those of short chunks."""
    from asyncckpt import manifest

    monkeypatch.setattr(manifest, "TABLE_MIN_CHUNKS", 3)
    ranks = [_Rank(r, 3) for r in range(3)]
    book = RecordBook()
    for save in range(1, 5):
        _save(ranks, book, save)  # (each the bytes of a whole merge)
        _settle(ranks)
        if save == 3:
            ranks[1].lr = 0.5
    raw, _ = book.manifest([rk.record(5)[0] for rk in ranks], step=5, **KW)
    assert raw == _reference(ranks, 5)
    doc = json.loads(raw)
    assert set(doc["tensors"]["w"]) == {"dtype", "shape", "kind", "table"}
    assert len(doc["tensors"]["w"]["table"]["checksums"]) == 3
    parsed = manifest.parse_manifest(raw, "m")
    assert type(parsed.tensors["w"].chunks) is manifest.ChunkTable
    assert [c.offsets for c in parsed.tensors["w"].chunks] == [(0, 0), (2, 0), (4, 0)]
