"""keep_best and best_step(): steps ranked by a metric that saves record."""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import asyncckpt
from _ranks import all_ok, in_threads
from asyncckpt import AsyncCheckpointer, CheckpointConfigError, CheckpointCorruptError
from asyncckpt.best import Ranking, StepMetrics, checked_metrics
from asyncckpt.cli import main
from asyncckpt.manifest import parse_manifest, seal
from asyncckpt.reader import read_manifest
from asyncckpt.storage import LocalStorage

NAN, INF = float("nan"), float("inf")


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((4,), float(step)), "step": step}


# --- what a save may record --------------------------------------------------------------------

def test_metrics_are_names_to_real_numbers_of_any_kind() -> None:
    got = checked_metrics({"loss": 2, "acc": np.float32(0.5), "ppl": torch.tensor(7.25),
                           "n": np.int64(3), "bad": NAN})
    assert got == {"loss": 2.0, "acc": 0.5, "ppl": 7.25, "n": 3.0, "bad": got["bad"]}
    assert all(type(v) is float for v in got.values()) and math.isnan(got["bad"])
    assert checked_metrics(None) == {}


@pytest.mark.parametrize(("metrics", "match"), [
    ({"loss": True}, r"metrics\['loss'\] = True: pass a real number"),
    ({"loss": "2.3"}, r"metrics\['loss'\] = '2.3'"),
    ({"loss": torch.ones(2)}, r"metrics\['loss'\]"),
    ({"loss": 1j}, r"metrics\['loss'\]"),
    ({3: 1.0}, r"the name 3 is not a non-empty str"),
    ({"": 1.0}, r"the name '' is not"),
    ([("loss", 1.0)], r"pass a mapping of names to numbers"),
])
def test_a_metric_that_is_no_number_is_refused_naming_it(metrics: Any, match: str,
                                                          tmp_path: Path) -> None:
    with pytest.raises(CheckpointConfigError, match=match):
        checked_metrics(metrics)
    with AsyncCheckpointer(tmp_path, mode="sync") as ckpt:  # before anything is written
        with pytest.raises(CheckpointConfigError, match=match):
            ckpt.save(_state(1), 1, metrics=metrics)
        assert ckpt.steps() == []


def test_retention_settings_take_numpy_ints_and_a_huge_int_metric_is_told_its_range(
        tmp_path: Path) -> None:
    """(retention trial) keep_* refused np.int64 where a step takes it; 10**400 as a metric
    was told to be "a real number (a float, an int...)", which it is."""
    ckpt = AsyncCheckpointer(tmp_path, keep_last=np.int64(2), keep_every=np.int32(5),
                             keep_best=np.int64(1), best_metric="loss")
    assert (ckpt.config.keep_last, ckpt.config.keep_every, ckpt.config.keep_best) == (2, 5, 1)
    assert type(ckpt.config.keep_last) is int
    with pytest.raises(CheckpointConfigError, match=r"out of a float's range"):
        ckpt.save(_state(1), 1, metrics={"loss": 10**400})
    ckpt.close()


def test_ranking_puts_nan_last_and_the_newer_of_equals_first() -> None:
    scores = {1: 3.0, 2: NAN, 3: 1.0, 4: 3.0, 5: -INF, 6: INF}
    assert Ranking("x", "min").best(scores) == [5, 3, 4, 1, 6, 2]
    assert Ranking("x", "max").best(scores) == [6, 4, 1, 3, 5, 2]
    assert Ranking("x", "min").best(scores, 2) == [5, 3]
    assert Ranking("x").best({}) == []


@pytest.mark.parametrize(("kw", "match"), [
    ({"keep_last": 1, "keep_best": 2}, r"keep_best=2 needs best_metric"),
    ({"keep_best": 2, "best_metric": "val_loss"}, r"pass keep_last too"),
    ({"keep_last": 1, "keep_best": 0, "best_metric": "l"}, r"keep_best=0: use a positive int"),
    ({"keep_last": 1, "keep_best": True, "best_metric": "l"}, r"keep_best=True"),
    ({"best_metric": "l", "best_mode": "avg"}, r"best_mode='avg': use 'min'"),
    ({"best_mode": "MAX"}, r"best_mode='MAX'"),
    ({"best_metric": ""}, r"best_metric='': name the metric"),
    ({"best_metric": 3}, r"best_metric=3"),
])
def test_keep_best_is_refused_when_it_could_not_work(kw: dict[str, Any], match: str,
                                                     tmp_path: Path) -> None:
    with pytest.raises(CheckpointConfigError, match=match):
        AsyncCheckpointer(tmp_path, **kw)


# --- in the manifest ---------------------------------------------------------------------------

def test_metrics_round_trip_through_the_manifest_nan_and_infinities_too(tmp_path: Path) -> None:
    with AsyncCheckpointer(tmp_path, mode="sync") as ckpt:
        ckpt.save(_state(1), 1, metrics={"loss": 0.1, "ppl": INF, "gnorm": NAN, "lo": -INF})
        ckpt.save(_state(2), 2)
    step = tmp_path / "step_000000001"
    raw = (step / "manifest.json").read_bytes()
    assert json.loads(raw)["metrics"] == {"loss": "0.1", "ppl": "inf", "gnorm": "nan",
                                          "lo": "-inf"}  # (strict JSON: no NaN literal)
    m = read_manifest(step, LocalStorage())
    assert m.metrics["loss"] == 0.1 and m.metrics["ppl"] == INF and m.metrics["lo"] == -INF
    assert math.isnan(m.metrics["gnorm"])
    # a step saved without metrics has no such field at all
    assert "metrics" not in json.loads((tmp_path / "step_000000002" / "manifest.json")
                                       .read_bytes())
    assert read_manifest(tmp_path / "step_000000002", LocalStorage()).metrics == {}


@pytest.mark.parametrize(("metrics", "match"), [
    ({"loss": 0.5}, r"metrics\['loss'\] must be a string"),
    ({"loss": "half"}, r"metrics\['loss'\] holds 'half', which is no number"),
    (["loss"], r"metrics must be an object"),
])
def test_malformed_metrics_in_a_manifest_are_corruption(tmp_path: Path, metrics: Any,
                                                        match: str) -> None:
    with AsyncCheckpointer(tmp_path, mode="sync") as ckpt:
        ckpt.save(_state(1), 1, metrics={"loss": 1.0})
    doc = json.loads((tmp_path / "step_000000001" / "manifest.json").read_bytes())
    del doc["digest"]
    doc["metrics"] = metrics
    with pytest.raises(CheckpointCorruptError, match=match):
        parse_manifest(seal(json.dumps(doc, separators=(",", ":")).encode()), "m")


# --- retention ---------------------------------------------------------------------------------

LOSSES = [(1, 3.0), (2, 2.0), (3, 2.5), (4, NAN), (5, 1.5), (6, 4.0), (7, None), (8, 1.5)]


def test_keep_best_keeps_the_best_steps_beside_the_newest(tmp_path: Path) -> None:
    seen = []
    with AsyncCheckpointer(tmp_path, mode="sync", keep_last=1, keep_best=2,
                           best_metric="val_loss") as ckpt:
        for step, loss in LOSSES:
            ckpt.save(_state(step), step,
                      metrics=None if loss is None else {"val_loss": loss, "acc": -step})
            seen.append(ckpt.steps())
        assert ckpt.best_step() == 8  # 1.5 twice: the newer
        assert ckpt.best_step("acc", "max") == 5 and ckpt.best_step("acc") == 8  # of [5, 8]
        assert ckpt.best_step("nothing") is None
        assert set(ckpt._metrics._known) == {5, 8}  # the deleted steps' are forgotten
    assert seen == [[1], [1, 2], [2, 3], [2, 3, 4], [2, 5], [2, 5, 6], [2, 5, 7], [5, 8]]
    restored = asyncckpt.load(tmp_path, step=5)
    assert restored["step"] == 5 and torch.equal(restored["w"], torch.full((4,), 5.0))


def test_keep_best_of_a_maximum_with_keep_every(tmp_path: Path) -> None:
    with AsyncCheckpointer(tmp_path, mode="async", keep_last=2, keep_best=1, keep_every=4,
                           best_metric="acc", best_mode="max") as ckpt:
        for step, acc in [(1, 0.5), (2, 0.9), (3, 0.1), (4, 0.2), (5, 0.3), (6, 0.4),
                          (7, 0.95), (8, 0.0), (9, 0.0)]:
            ckpt.save_async(_state(step), step, metrics={"acc": acc}).wait()
            ckpt.wait()  # (and its retention)
        assert ckpt.steps() == [4, 7, 8, 9]  # milestone 4 (and 8), the best 7, the newest two
        assert ckpt.best_step() == 7


def test_a_new_checkpointer_reads_each_steps_metrics_once(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    with AsyncCheckpointer(tmp_path, mode="sync") as ckpt:
        for step in range(1, 6):
            ckpt.save(_state(step), step, metrics={"loss": float(10 - step)})
    import asyncckpt.best as best

    reads: list[str] = []
    real = best.read_manifest_summary

    def counted(step_dir: Path, storage: Any) -> Any:
        reads.append(step_dir.name)
        return real(step_dir, storage)

    monkeypatch.setattr(best, "read_manifest_summary", counted)
    with AsyncCheckpointer(tmp_path, mode="sync", keep_last=2, keep_best=1,
                           best_metric="loss", best_mode="max") as ckpt:
        assert ckpt.best_step() == 1
        assert sorted(reads) == [f"step_00000000{s}" for s in range(1, 6)]
        for step in range(6, 10):  # the new steps' metrics are known without reading
            ckpt.save(_state(step), step, metrics={"loss": float(10 - step)})
        assert ckpt.best_step() == 1
        assert len(reads) == 5
        assert ckpt.steps() == [1, 8, 9]


def test_without_keep_best_a_checkpointer_holds_metrics_only_of_steps_it_was_asked_about(
        tmp_path: Path) -> None:
    """Nothing is kept per save unless retention ranks steps: a long run without
    keep_best would otherwise hold every step it ever saved."""
    with AsyncCheckpointer(tmp_path, mode="sync", keep_last=2) as ckpt:
        for step in range(1, 11):
            ckpt.save(_state(step), step, metrics={"loss": float(step)})
        assert ckpt._metrics._known == {}
        assert ckpt.best_step("loss") == 9
        assert set(ckpt._metrics._known) == {9, 10}


def test_a_rolled_back_step_saved_again_ranks_by_its_new_metrics(tmp_path: Path) -> None:
    with AsyncCheckpointer(tmp_path, mode="sync") as ckpt:
        ckpt.save(_state(1), 1, metrics={"loss": 2.0})
        ckpt.save(_state(2), 2, metrics={"loss": 1.0})
        assert ckpt.best_step("loss") == 2
        assert ckpt.discard_steps_after(1) == [2]
        ckpt.save(_state(2), 2, metrics={"loss": 5.0})
        assert ckpt.best_step("loss") == 1


def test_another_checkpointer_sees_a_step_saved_again_after_a_rollback(tmp_path: Path) -> None:
    """What a checkpointer knows of a step's metrics is tied to its manifest file: a step
    rolled back and saved again by another checkpointer (a trainer, beside an evaluator
    that asks best_step()), or deleted by hand and saved again, is read again."""
    evaluator = AsyncCheckpointer(tmp_path, mode="sync")
    with AsyncCheckpointer(tmp_path, mode="sync") as trainer:
        trainer.save(_state(1), 1, metrics={"loss": 3.0})
        trainer.save(_state(2), 2, metrics={"loss": 1.0})
        assert evaluator.best_step("loss") == 2
        trainer.discard_steps_after(1)
        trainer.save(_state(2), 2, metrics={"loss": 5.0})
        trainer.save(_state(3), 3, metrics={"loss": 0.5})
        assert evaluator.best_step("loss") == 3
        assert trainer.best_step("loss") == 3
        import shutil

        shutil.rmtree(tmp_path / "step_000000003")  # by hand
        assert evaluator.best_step("loss") == 1 and trainer.best_step("loss") == 1
    with AsyncCheckpointer(tmp_path, mode="sync") as again:
        again.save(_state(3), 3, metrics={"loss": 9.0})  # the number reused
        assert again.best_step("loss") == 1
    assert evaluator.best_step("loss") == 1 and evaluator.best_step("loss", "max") == 3
    evaluator.close()


def test_a_metric_whose_conversion_fails_is_refused_naming_it() -> None:
    import fractions

    for bad in (np.timedelta64(5, "s"), torch.tensor(1.0, device="meta")):
        with pytest.raises(CheckpointConfigError, match=r"metrics\['m'\] = .*: pass a real"):
            checked_metrics({"m": bad})
    for huge in (10 ** 400, fractions.Fraction(10 ** 400, 3)):  # numbers, past float's range
        with pytest.raises(CheckpointConfigError, match=r"metrics\['m'\] = .*: out of a "
                                                        r"float's range"):
            checked_metrics({"m": huge})


def test_a_step_whose_manifest_cannot_be_read_counts_as_one_without_metrics(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with AsyncCheckpointer(tmp_path, mode="sync") as ckpt:
        ckpt.save(_state(1), 1, metrics={"loss": 0.5})
        ckpt.save(_state(2), 2, metrics={"loss": 1.0})
    man = tmp_path / "step_000000001" / "manifest.json"
    man.write_bytes(man.read_bytes()[:-20])
    cache = StepMetrics()
    assert cache.scores(tmp_path, LocalStorage(), [1, 2], "loss") == {2: 1.0}
    assert "step 1's metrics cannot be read" in caplog.text
    with AsyncCheckpointer(tmp_path, mode="sync") as ckpt:
        assert ckpt.best_step("loss") == 2


def test_best_step_needs_a_metric(tmp_path: Path) -> None:
    with AsyncCheckpointer(tmp_path, mode="sync") as ckpt:
        with pytest.raises(CheckpointConfigError, match=r"best_step\('val_loss'\)"):
            ckpt.best_step()
        with pytest.raises(CheckpointConfigError, match=r"best_step\(metric=3\): name"):
            ckpt.best_step(3)  # type: ignore[arg-type]
        with pytest.raises(CheckpointConfigError, match=r"best_step\(mode='avg'\): use"):
            ckpt.best_step("loss", "avg")
        assert ckpt.best_step("val_loss") is None  # nothing saved


def _group_saves(root: Path, world: int, mode: str, best_metric: str,
                 metrics_of: Callable[[int, int, float], dict[str, float]]
                 ) -> tuple[list[list[int]], list[AsyncCheckpointer]]:
    """``world`` thread ranks save steps 1-4 of a sharded tensor, with the metrics
    ``metrics_of(rank, step, loss)`` (the loss is least at step 2), keep_last=1 and
    keep_best=1 by ``best_metric``: each rank's committed steps at the end, and its
    (closed) checkpointer. The steps are listed once every rank has closed: rank 0
    removes the old ones, and another rank may list one it has not removed yet."""
    store = torch.distributed.HashStore()
    ckpts = [AsyncCheckpointer(root, mode=mode, rank=r, world_size=world, store=store,
                               timeout_s=60, keep_last=1, keep_best=1, best_metric=best_metric)
             for r in range(world)]

    def rank_main(r: int) -> None:
        for step, loss in [(1, 2.0), (2, 1.0), (3, 3.0), (4, 4.0)]:
            part = torch.arange(4.0) + 10 * r + step
            ckpts[r].save_async({"w": part}, step, metrics=metrics_of(r, step, loss),
                                shards={"w": asyncckpt.ShardMetadata((4 * world,), (4 * r,))}
                                ).wait()
        ckpts[r].close()

    all_ok(in_threads(rank_main, world))
    return [c.steps() for c in ckpts], ckpts


def test_in_a_group_the_coordinator_records_its_metrics_and_keeps_the_best(
        tmp_path: Path) -> None:
    out, _ = _group_saves(tmp_path, 2, "sync", "loss",
                       lambda r, step, loss: {"loss": loss if r == 0 else -loss})
    assert out[0] == out[1] == [2, 4]  # rank 0's losses rank the steps: 1.0 at step 2
    m = read_manifest(tmp_path / "step_000000002", LocalStorage())
    assert m.metrics == {"loss": 1.0}


def test_the_one_shot_save_records_metadata_and_metrics(tmp_path: Path) -> None:
    asyncckpt.save(_state(3), tmp_path, step=3, metadata={"run": "a"},
                   metrics={"val_loss": torch.tensor(0.5)})
    m = read_manifest(tmp_path / "step_000000003", LocalStorage())
    assert m.metrics == {"val_loss": 0.5} and m.user_metadata == {"run": "a"}
    with pytest.raises(CheckpointConfigError, match=r"metrics\['x'\]"):
        asyncckpt.save(_state(4), tmp_path, step=4, metrics={"x": "high"})
    with AsyncCheckpointer(tmp_path) as ckpt:
        assert ckpt.steps() == [3]


def test_in_a_group_any_rank_may_pass_a_metric_and_the_lowest_ranks_value_counts(
        tmp_path: Path) -> None:
    """A pipeline's last stage knows the loss: a metric only rank 2 passes ranks the
    steps; a name that ranks 1 and 2 both pass is rank 1's; rank 0's own stay its."""
    out, ckpts = _group_saves(tmp_path, 3, "async", "val_loss", lambda r, step, loss: [
        {"lr": 0.1}, {"tokens": 7.0 * step}, {"val_loss": loss, "tokens": -1.0}][r])
    assert out[0] == out[1] == out[2] == [2, 4]  # rank 2's val_loss: 1.0 at step 2
    m = read_manifest(tmp_path / "step_000000002", LocalStorage())
    assert m.metrics == {"lr": 0.1, "tokens": 14.0, "val_loss": 1.0}
    assert ckpts[1].best_step() == 2


def test_a_malformed_metric_in_a_ranks_record_fails_the_save_naming_the_rank() -> None:
    from asyncckpt.best import merged_metrics
    from asyncckpt.errors import CheckpointSaveError
    from asyncckpt.manifest import metrics_text as record_of

    records = [{"rank": 0}, {"rank": 1, "metrics": record_of({"a": NAN, "b": 2.0})},
               {"rank": 2, "metrics": {"b": "3.0", "c": "-inf"}}]
    got = merged_metrics({"b": 1.0}, records, 5)
    assert got["b"] == 1.0 and got["c"] == -INF and math.isnan(got["a"])
    assert all("metrics" not in rec for rec in records)  # taken out for the merge
    for bad in [{"x": "many"}, {"x": 3.0}, {"": "1.0"}, ["x"]]:
        with pytest.raises(CheckpointSaveError, match=r"step 5 aborted, nothing committed: "
                           r"rank 1's record"):
            merged_metrics({}, [{"rank": 1, "metrics": bad}], 5)


def test_a_metric_ranks_pass_with_different_values_is_warned_of_once(
        caplog: pytest.LogCaptureFixture) -> None:
    """DDP ranks that each pass their own batch's loss: the lowest rank's is recorded,
    and the coordinator says so once per name, not at every save."""
    from asyncckpt.best import merged_metrics
    from asyncckpt.manifest import metrics_text as record_of

    warned: set[str] = set()

    def records(step: int) -> list[dict[str, Any]]:
        return [{"rank": 0}, *({"rank": r, "metrics": record_of(
            {"loss": 1.0 + r + step, "acc": 0.5, "nan": NAN})} for r in (1, 2))]

    with caplog.at_level("WARNING", logger="asyncckpt.best"):
        for step in (1, 2):
            got = merged_metrics({"lr": 0.1}, records(step), step, warned)
            assert got["loss"] == 2.0 + step and got["acc"] == 0.5
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and warned == {"loss"}  # (equal values and NaNs are no news)
    assert msgs[0] == ("step 1: ranks passed different values of metric 'loss' (rank 1: 3.0, "
                       "rank 2: 4.0): rank 1's is recorded. Pass one value on every rank "
                       "that passes the metric (all-reduce it first)")


# --- the command line --------------------------------------------------------------------------

def test_ls_and_inspect_show_the_metrics(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                         ) -> None:
    with AsyncCheckpointer(tmp_path, mode="sync") as ckpt:
        ckpt.save(_state(1), 1, metrics={"val_loss": 2.3125, "ppl": NAN})
        ckpt.save(_state(2), 2)
    assert main(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "METRICS" in out and "val_loss=2.3125 ppl=nan" in out
    assert main(["ls", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)  # strict JSON: NaN as a string
    assert [s["metrics"] for s in doc["steps"]] == [{"val_loss": 2.3125, "ppl": "nan"}, {}]
    assert main(["inspect", str(tmp_path), "--step", "1"]) == 0
    assert "metrics: val_loss=2.3125 ppl=nan" in capsys.readouterr().out
    with AsyncCheckpointer(tmp_path / "none", mode="sync") as ckpt:
        ckpt.save(_state(1), 1)
    assert main(["ls", str(tmp_path / "none")]) == 0
    assert "METRICS" not in capsys.readouterr().out  # no column where no step has any


def test_manifest_metrics_survive_replace_and_encode() -> None:
    from test_manifest import PATH, make_manifest

    m = make_manifest(metrics={"loss": 0.25})
    back = parse_manifest(m.to_json(), PATH)
    assert back == m and back.metrics == {"loss": 0.25}
    assert parse_manifest(dataclasses.replace(m, metrics={}).to_json(), PATH).metrics == {}


def test_a_damaged_step_is_no_best_step_nor_takes_an_intact_ones_place(tmp_path: Path) -> None:
    """A trial's deploy script took best_step() = a step whose damaged.json said a load
    found it corrupt; and keep_best, ranking it, kept it in place of an intact step."""
    from asyncckpt import commit

    with AsyncCheckpointer(tmp_path, mode="sync", keep_last=1, keep_best=1,
                           best_metric="val_loss") as ckpt:
        for step, loss in ((1, 3.0), (2, 1.0), (3, 2.0)):
            ckpt.save(_state(step), step, metrics={"val_loss": loss})
        assert ckpt.steps() == [2, 3] and ckpt.best_step() == 2
        assert commit.mark_damaged(tmp_path, 2, "checksum mismatch", ckpt.storage) is None
        assert ckpt.best_step() == 3  # (2 is the best, but damaged)
        ckpt.save(_state(4), 4, metrics={"val_loss": 2.5})
        # the best intact step (3) stays; damaged 2 too (a mark may be wrong), while it
        # ranks above every other
        assert ckpt.steps() == [2, 3, 4] and ckpt.best_step() == 3
        ckpt._damaged.add(3)  # (found damaged by this checkpointer's own load)
        assert ckpt.best_step() == 4
        ckpt.save(_state(5), 5, metrics={"val_loss": 0.5})  # better than all: they go
        assert ckpt.steps() == [5] and ckpt.best_step() == 5


def _flip_last_byte(step_dir: Path) -> None:
    from asyncckpt.manifest import shard_file_name

    shard = step_dir / shard_file_name(0)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["checkpointer", "module"])
def test_a_load_of_a_step_that_finds_it_corrupt_marks_it(
        tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture) -> None:
    """A trial: the best step, a byte flipped, raised CheckpointCorruptError when loaded
    by step=, but only a fallback load marked steps: it stayed best_step(), export --best
    chose it, and keep_best kept it while intact steps went."""
    with AsyncCheckpointer(tmp_path, mode="sync", best_metric="val_loss") as ckpt:
        for step, loss in ((1, 3.0), (2, 1.0), (3, 2.0)):
            ckpt.save(_state(step), step, metrics={"val_loss": loss})
        _flip_last_byte(tmp_path / "step_000000002")
        with pytest.raises(CheckpointCorruptError), caplog.at_level(logging.WARNING):
            if how == "checkpointer":
                ckpt.load(step=ckpt.best_step())
            else:
                asyncckpt.load(tmp_path, step=2)
        assert (tmp_path / "step_000000002" / "damaged.json").exists()
        # (nothing was loaded: not the fallback's "discard_steps_after(<the step
        # loaded>)", which a review's user filled with step 1, deleting intact step 3)
        assert "load(..., fallback=True) loads the newest intact step" in caplog.text
        assert "<the step loaded>" not in caplog.text
        assert AsyncCheckpointer(tmp_path, best_metric="val_loss").best_step() == 3
    # (a step directory given itself is not marked: it may be a copy outside any root)
    _flip_last_byte(tmp_path / "step_000000003")
    with pytest.raises(CheckpointCorruptError):
        asyncckpt.load(tmp_path / "step_000000003")
    assert not (tmp_path / "step_000000003" / "damaged.json").exists()


def test_a_tensor_larger_than_this_machine_s_memory_marks_no_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """(a review) Such a tensor may be real (a 200 GB embedding read on a 128 GB node): the
    load refuses it, but marking the step would have retention and best_step() drop it."""
    import asyncckpt.reader as reader

    with AsyncCheckpointer(tmp_path, mode="sync", best_metric="val_loss") as ckpt:
        ckpt.save({"w": torch.zeros(1 << 16)}, 1, metrics={"val_loss": 1.0})
        monkeypatch.setattr(reader, "_physical_memory", lambda: 1000)
        monkeypatch.setattr(reader, "fresh_tensor", _fails_to_allocate)
        for load in (lambda: ckpt.load(step=1), lambda: asyncckpt.load(tmp_path, step=1)):
            with pytest.raises(CheckpointCorruptError, match="made on a machine with more "
                                                             "memory"):
                load()
        assert not (tmp_path / "step_000000001" / "damaged.json").exists()
        assert ckpt.best_step() == 1


def test_a_module_level_load_of_one_rank_of_a_job_that_finds_damage_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # (a re-check trial: rank 1's note said "fallback=True loads the newest intact step",
    # which it did, alone, while rank 0 had loaded the newer step)
    asyncckpt.save(_state(1), tmp_path, step=1)
    asyncckpt.save(_state(2), tmp_path, step=2)
    _flip_last_byte(tmp_path / "step_000000002")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(CheckpointCorruptError) as info:
        asyncckpt.load(tmp_path)
    said = str(info.value)  # (not a note: a log line of str(exc) lost it)
    assert "rank 1: asyncckpt.load is this process's alone, with fallback=True too" in said
    assert "AsyncCheckpointer(root).load(..., fallback=True) on every rank" in said


def _fails_to_allocate(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("out of memory")


def test_best_step_passes_over_a_step_whose_files_are_cut_short(tmp_path: Path) -> None:
    """A trial's deploy script: best_step() gave a step that ls already said was DAMAGED
    (a shard cut short), found by a stat, as ls finds it."""
    from asyncckpt.manifest import shard_file_name

    with AsyncCheckpointer(tmp_path, mode="sync", best_metric="val_loss") as ckpt:
        for step, loss in ((1, 3.0), (2, 1.0), (3, 2.0)):
            ckpt.save(_state(step), step, metrics={"val_loss": loss})
        shard = tmp_path / "step_000000002" / shard_file_name(0)
        os.truncate(shard, shard.stat().st_size - 1)
        assert ckpt.best_step() == 3
        shard.unlink()
        assert ckpt.best_step() == 3
        assert main(["ls", str(tmp_path)]) == 1  # (the same verdict)


@pytest.mark.parametrize("how", ["cut short", "missing"])
def test_retention_keeps_the_intact_best_step_beside_one_cut_short(tmp_path: Path,
                                                                   how: str) -> None:
    """A trial: the best step's shard cut short (or gone), no load had marked it yet;
    best_step() named the intact runner-up, and the next save's retention deleted it,
    keeping the unloadable one. A stat now tells retention too."""
    from asyncckpt.manifest import shard_file_name

    ckpt = AsyncCheckpointer(tmp_path, keep_last=1, keep_best=1, best_metric="loss")
    ckpt.save(_state(0), 0, metrics={"loss": 0.1})
    ckpt.save(_state(1), 1, metrics={"loss": 5.0})
    shard = tmp_path / "step_000000000" / shard_file_name(0)
    if how == "missing":
        shard.unlink()
    else:
        os.truncate(shard, shard.stat().st_size - 100)
    assert ckpt.best_step() == 1
    ckpt.save(_state(2), 2, metrics={"loss": 6.0})
    assert 1 in ckpt.steps() and ckpt.best_step() == 1  # (was: [0, 2], and 2)
    ckpt.load(step=1)
    ckpt.close()
    # keep_last alone: a newest step cut short takes no intact step's place
    root = tmp_path / "last"
    with AsyncCheckpointer(root, keep_last=2) as ck:
        for step in range(3):
            ck.save(_state(step), step)
        (root / "step_000000002" / shard_file_name(0)).unlink()
        ck.save(_state(3), 3)
        assert ck.steps() == [1, 2, 3]  # (two intact, the damaged one newer than both kept)
        ck.save(_state(4), 4)
        assert ck.steps() == [3, 4]


class _FlakyManifests(LocalStorage):
    """Reading a manifest fails with ``err`` while ``on`` (a network mount's hiccup)."""

    def __init__(self, err: int) -> None:
        super().__init__()
        self.err = err
        self.on = False

    def read_bytes(self, path: Path, limit: int) -> bytes:
        if self.on and path.name == "manifest.json":
            raise OSError(self.err, os.strerror(self.err), str(path))
        return super().read_bytes(path, limit)


@pytest.mark.parametrize("err", [errno.ESTALE, errno.EIO, errno.EACCES, errno.EMFILE])
def test_retention_keeps_steps_whose_manifests_cannot_be_read_for_the_moment(
        tmp_path: Path, err: int, caplog: pytest.LogCaptureFixture) -> None:
    """A review: a restarted run's first retention met an ESTALE on every old manifest,
    took the steps for damaged (not counted among the newest, older than the newest
    kept) and deleted all but the new one. An error that says nothing of the bytes now
    counts the step as intact, with a warning."""
    with AsyncCheckpointer(tmp_path, keep_last=3, mode="sync") as ckpt:
        for step in (1, 2, 3):
            ckpt.save(_state(step), step)
    flaky = _FlakyManifests(err)
    with AsyncCheckpointer(tmp_path, keep_last=3, mode="sync", storage=flaky) as ckpt:
        flaky.on = True
        ckpt.save(_state(4), 4)
        flaky.on = False
        assert ckpt.steps() == [2, 3, 4]  # (was: [4])
        assert ckpt.load(step=2)["step"] == 2
    assert "retention keeps the step and counts it as intact" in caplog.text
    # a manifest damaged for sure is still passed over: it takes no intact step's place
    manifest = tmp_path / "step_000000004" / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:-5])
    with AsyncCheckpointer(tmp_path, keep_last=3, mode="sync") as ckpt:
        ckpt.save(_state(5), 5)
        assert ckpt.steps() == [2, 3, 4, 5]


def test_retention_keeps_steps_whose_files_cannot_be_stat_ed_for_the_moment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same with a stat of the old shard files failing (ESTALE) in the running
    checkpointer, whose manifests it knew: they counted as "cannot be read", amiss."""
    import asyncckpt.commit as commit

    real_stat = os.stat
    on = [False]

    def stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        p = str(path)
        if on[0] and p.endswith(".safetensors") and "step_000000004" not in p:
            raise OSError(errno.ESTALE, os.strerror(errno.ESTALE), p)
        return real_stat(path, *args, **kwargs)

    with AsyncCheckpointer(tmp_path, keep_last=3, mode="sync") as ckpt:
        for step in (1, 2, 3):
            ckpt.save(_state(step), step)
        step_dir = tmp_path / "step_000000002"
        sizes = {p.name: p.stat().st_size for p in step_dir.glob("*.safetensors")}
        monkeypatch.setattr(commit.os, "stat", stat)  # (os.stat itself)
        on[0] = True
        ckpt.save(_state(4), 4)
        assert ckpt.steps() == [2, 3, 4]  # (was: [4])
        # ls still shows a stat that failed; retention's sure=True passes it over
        assert [a for a in commit.files_amiss(step_dir, sizes) if "cannot be read" in a]
        assert commit.files_amiss(step_dir, sizes, sure=True) == []
        on[0] = False
        assert commit.files_amiss(step_dir, sizes) == []


def test_keep_best_keeps_the_best_step_whose_manifest_cannot_be_read_for_the_moment(
        tmp_path: Path) -> None:
    """A review: an ESTALE on the best step's manifest made it a step without metrics,
    and the next save's retention deleted it (keep_last=1, keep_best=1)."""
    with AsyncCheckpointer(tmp_path, keep_last=1, keep_best=1, best_metric="val_loss",
                           mode="sync") as ckpt:
        for step, loss in ((1, 0.1), (2, 0.5), (3, 0.7)):
            ckpt.save(_state(step), step, metrics={"val_loss": loss})
        assert ckpt.steps() == [1, 3]
    flaky = _FlakyManifests(errno.ESTALE)
    with AsyncCheckpointer(tmp_path, keep_last=1, keep_best=1, best_metric="val_loss",
                           mode="sync", storage=flaky) as ckpt:
        flaky.on = True
        ckpt.save(_state(4), 4, metrics={"val_loss": 0.9})
        flaky.on = False
        assert 1 in ckpt.steps()  # (was: [3, 4]); 3 stays too while 1 could not be ranked
        assert ckpt.best_step() == 1
        ckpt.save(_state(5), 5, metrics={"val_loss": 0.8})  # (readable again: ranked)
        assert ckpt.steps() == [1, 5]


def test_a_step_kept_while_its_manifest_could_not_be_read_goes_once_it_can(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The step keep_best kept for a passing ESTALE (not the best) is ranked again once its
    manifest reads, in the same checkpointer, whose metrics it had cached: not kept for
    ever."""
    flaky = _FlakyManifests(errno.ESTALE)
    real_stat = os.stat
    on = [False]

    def stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if on[0] and str(path).endswith(os.path.join("step_000000002", "manifest.json")):
            raise OSError(errno.ESTALE, os.strerror(errno.ESTALE), str(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    with AsyncCheckpointer(tmp_path, keep_last=1, keep_best=1, best_metric="val_loss",
                           mode="sync", storage=flaky) as ckpt:
        ckpt.save(_state(1), 1, metrics={"val_loss": 0.1})
        ckpt.save(_state(2), 2, metrics={"val_loss": 0.5})
        assert ckpt.steps() == [1, 2]
        flaky.on = on[0] = True
        ckpt.save(_state(3), 3, metrics={"val_loss": 0.7})
        assert ckpt.steps() == [1, 2, 3]  # (2 could not be ranked: kept)
        flaky.on = on[0] = False
        ckpt.save(_state(4), 4, metrics={"val_loss": 0.9})
        assert ckpt.steps() == [1, 4]


def test_a_reader_whose_torch_lacks_a_dtype_marks_no_step_and_retention_keeps_them(
        tmp_path: Path) -> None:
    """A review: an evaluator on an older torch ran load(fallback=True) over steps holding
    a dtype that torch lacks; each was taken for corrupt and marked damaged.json, and
    the trainer's next save deleted them all but the new one."""
    with AsyncCheckpointer(tmp_path, keep_last=3, mode="sync") as ckpt:
        for step in (1, 2, 3):
            ckpt.save({"w": torch.full((4,), float(step)), "q": torch.zeros(8, dtype=torch.uint8)},
                      step)
    originals = {}
    for step in (1, 2, 3):  # as a torch without uint8 would read them
        manifest = tmp_path / f"step_{step:09d}" / "manifest.json"
        raw = originals[manifest] = manifest.read_bytes()
        body = raw[:raw.rindex(b',"digest"')] + b"}"
        assert body.count(b'"uint8"') == 1
        manifest.write_bytes(seal(body.replace(b'"uint8"', b'"float8_e9m9fn"')))
    with pytest.raises(asyncckpt.CheckpointVersionError, match="'float8_e9m9fn'"):
        AsyncCheckpointer(tmp_path).load(fallback=True)
    assert not list(tmp_path.glob("step_*/damaged.json"))
    for manifest, raw in originals.items():  # (the trainer's torch has it)
        manifest.write_bytes(raw)
    with AsyncCheckpointer(tmp_path, keep_last=3, mode="sync") as ckpt:
        ckpt.save({"w": torch.zeros(4), "q": torch.zeros(8, dtype=torch.uint8)}, 4)
        assert ckpt.steps() == [2, 3, 4]


def test_a_step_retired_while_its_metrics_are_read_is_no_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A monitor's best_step() beside a trainer's keep_last logged "metrics cannot be read
    ... not a committed checkpoint" for steps merely deleted (229 in a trial's run)."""
    with AsyncCheckpointer(tmp_path, mode="sync") as ckpt:
        for step, loss in ((1, 3.0), (2, 1.0)):
            ckpt.save(_state(step), step, metrics={"val_loss": loss})
    metrics = StepMetrics()
    shutil.rmtree(tmp_path / "step_000000001")  # (deleted after it was listed)
    caplog.set_level(logging.WARNING, logger="asyncckpt")
    assert metrics.scores(tmp_path, LocalStorage(), [1, 2], "val_loss") == {2: 1.0}
    assert "cannot be read" not in caplog.text
    (tmp_path / "step_000000002" / "manifest.json").write_text("{}")  # there, unreadable
    assert StepMetrics().scores(tmp_path, LocalStorage(), [2], "val_loss") == {}
    assert "step 2's metrics cannot be read" in caplog.text


def test_the_cli_takes_the_best_step_by_a_metric(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A deploy script picked the best step through the Python API: `--best METRIC` on
    ls (marked), inspect, verify, export and serve, as best_step() picks it."""
    root = tmp_path / "ck"
    with AsyncCheckpointer(root, mode="sync") as ckpt:
        for step, loss in ((1, 3.0), (2, 1.0), (3, 2.0)):
            ckpt.save(_state(step), step, metrics={"val_loss": loss, "acc": float(step)})
    capsys.readouterr()
    assert main(["ls", str(root), "--best", "val_loss"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[2].split()[0] == "2" and rows[2].endswith("best val_loss")
    assert main(["ls", str(root), "--best", "acc", "--max", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["best"] == 3
    assert main(["inspect", str(root), "--best", "val_loss", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 2
    assert main(["verify", str(root), "--best", "acc", "--max", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 3
    out = tmp_path / "best.safetensors"
    assert main(["export", str(root), str(out), "--best", "val_loss", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 2
    # a step known damaged is passed over, as best_step() does
    from asyncckpt import commit

    assert commit.mark_damaged(root, 2, "checksum mismatch", LocalStorage()) is None
    assert main(["verify", str(root), "--best", "val_loss", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 3
    # what cannot be
    for argv, said in ((["inspect", str(root), "--best", "nothing"],
                        "no committed step under"),
                       (["verify", str(root), "--best", "val_loss", "--step", "1"],
                        "--step and --best each name a step"),
                       (["verify", str(root), "--all", "--best", "val_loss"], "drop --best"),
                       (["ls", str(root), "--max"], "--max goes with --best"),
                       (["inspect", str(root / "step_000000001"), "--best", "val_loss"],
                        "--best picks among the steps of a checkpoint root")):
        assert main(argv) == 2, argv
        assert said in capsys.readouterr().err, argv


@pytest.mark.parametrize("how", ["checkpointer", "module"])
def test_a_latest_load_that_finds_damage_says_what_to_do_in_its_message(
        tmp_path: Path, how: str) -> None:
    """The advice was an exception note, which a log line of str(exc) does not show."""
    asyncckpt.save(_state(1), tmp_path, step=1)
    asyncckpt.save(_state(2), tmp_path, step=2)
    _flip_last_byte(tmp_path / "step_000000002")
    with pytest.raises(CheckpointCorruptError) as info:
        if how == "checkpointer":
            with AsyncCheckpointer(tmp_path) as ckpt:
                ckpt.load()
        else:
            asyncckpt.load(tmp_path)
    assert "load(..., fallback=True) loads the newest intact step instead" in str(info.value)
    assert info.value.path is not None and "step_000000002" in info.value.path
    assert "fallback=True) loads the newest" not in " ".join(getattr(info.value, "__notes__",
                                                                     ()))


def test_saving_a_step_again_with_its_metrics_says_they_were_not_recorded(
        tmp_path: Path) -> None:
    """A researcher trial saved a step, validated, then saved the step again with
    metrics=: "it is saved, nothing to do", and the metrics were lost without a word."""
    with AsyncCheckpointer(tmp_path, mode="async", keep_last=2, keep_best=1,
                           best_metric="val_loss") as ckpt:
        fut = ckpt.save_async(_state(1), 1, overlap=True)
        fut.wait_staged()
        with pytest.raises(asyncckpt.CheckpointExistsError,
                           match=r"its metrics \(val_loss=0\.5\) were NOT recorded"):
            ckpt.save_async(_state(1), 1, metrics={"val_loss": 0.5})
        ckpt.wait()
        with pytest.raises(asyncckpt.CheckpointExistsError,
                           match=r"its metrics \(val_loss=0\.5\) were NOT recorded by this "
                                 r"save: record_metrics\(step, metrics\) adds them"):
            ckpt.save(_state(1), 1, metrics={"val_loss": 0.5})
        assert ckpt.manifest(1).metrics == {}


# --- which way a metric ranks, as the saves recorded it ----------------------------------------

def _accuracies(root: Path, **kw: Any) -> None:
    """Steps 1-4 saved with acc 0.5, 0.9, 0.1, 0.7 (best by the greatest: step 2)."""
    with AsyncCheckpointer(root, mode="sync", **kw) as ckpt:
        for step, acc in ((1, 0.5), (2, 0.9), (3, 0.1), (4, 0.7)):
            ckpt.save(_state(step), step, metrics={"acc": acc, "loss": 1 - acc})


def test_a_save_records_its_best_mode_and_another_reader_ranks_by_it(tmp_path: Path) -> None:
    """A researcher trial's evaluator (another process) asked best_step("val_acc") of a
    root saved with best_mode="max", and got the worst step."""
    _accuracies(tmp_path, best_metric="acc", best_mode="max")
    assert read_manifest(tmp_path / "step_000000004", LocalStorage()).metric_modes == {
        "acc": "max"}
    reader = AsyncCheckpointer(tmp_path, mode="sync")
    assert reader.recorded_best_mode("acc") == "max"
    assert reader.recorded_best_mode("loss") is None  # (only best_metric's is recorded)
    assert reader.best_step("acc") == 2
    assert reader.best_step("acc", "min") == 3  # (a mode given is taken as given)
    assert reader.best_step("loss") == 2  # (nothing recorded: the least)
    with pytest.raises(CheckpointConfigError, match=r"recorded_best_mode\(metric=''\)"):
        reader.recorded_best_mode("")
    reader.close()


def test_without_best_metric_a_save_records_no_mode(tmp_path: Path) -> None:
    _accuracies(tmp_path)
    m = read_manifest(tmp_path / "step_000000001", LocalStorage())
    assert m.metric_modes == {} and b"metric_modes" not in (
        tmp_path / "step_000000001" / "manifest.json").read_bytes()
    with AsyncCheckpointer(tmp_path, mode="sync") as ckpt:
        assert ckpt.recorded_best_mode("acc") is None and ckpt.best_step("acc") == 3


def test_a_resume_without_best_mode_keeps_the_best_as_the_run_before_it_ranked(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """keep_best of a run resumed without best_mode="max" kept the worst steps."""
    with AsyncCheckpointer(tmp_path, mode="sync", keep_last=1, keep_best=1,
                           best_metric="acc", best_mode="max") as ckpt:
        for step, acc in ((1, 0.5), (2, 0.9), (3, 0.1)):
            ckpt.save(_state(step), step, metrics={"acc": acc})
        assert ckpt.steps() == [2, 3]
    caplog.set_level(logging.WARNING, logger="asyncckpt")
    with AsyncCheckpointer(tmp_path, mode="async", keep_last=1, keep_best=1,
                           best_metric="acc") as ckpt:
        assert ckpt.config.best_mode is None
        assert ckpt.best_step() == 2
        for step, acc in ((4, 0.2), (5, 0.95), (6, 0.3)):
            ckpt.save_async(_state(step), step, metrics={"acc": acc}).wait()
            ckpt.wait()
        assert ckpt.steps() == [5, 6] and ckpt.best_step() == 5
    assert read_manifest(tmp_path / "step_000000006", LocalStorage()).metric_modes == {
        "acc": "max"}  # (inherited, and recorded again for the readers after it)
    assert "best_mode" not in caplog.text


def test_a_root_with_no_recorded_mode_ranks_by_the_least_and_records_none(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The default "min" is no choice: recorded, it silenced the CLI's check of the name
    (a review: `--best val_acc` then took the worst step without a word)."""
    with AsyncCheckpointer(tmp_path, mode="sync", keep_last=1, keep_best=1,
                           best_metric="acc") as ckpt:
        for step, acc in ((1, 2.0), (2, 1.0), (3, 3.0)):
            ckpt.save(_state(step), step, metrics={"acc": acc})
        assert ckpt.steps() == [2, 3] and ckpt.best_step() == 2
    assert read_manifest(tmp_path / "step_000000003", LocalStorage()).metric_modes == {}
    capsys.readouterr()
    assert main(["ls", str(tmp_path), "--best", "acc"]) == 0
    assert "as for a loss (no step recorded a best_mode for it)" in capsys.readouterr().err


def test_a_save_with_a_mode_given_against_the_recorded_one_is_refused(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A trial resumed a best_mode="max" run with best_mode="min": its first save's
    retention removed the two best steps, and the root then recorded "min" for good."""
    _accuracies(tmp_path, best_metric="acc", best_mode="max")
    caplog.set_level(logging.WARNING, logger="asyncckpt")
    for mode in ("sync", "async"):
        with AsyncCheckpointer(tmp_path, mode=mode, keep_last=1, keep_best=1,
                               best_metric="acc", best_mode="min") as ckpt:
            with pytest.raises(CheckpointConfigError) as ei:
                ckpt.save_async(_state(5), 5, metrics={"acc": 0.05}).wait()
            assert ckpt.steps() == [1, 2, 3, 4]  # nothing removed, nothing committed
            assert ckpt.best_step() == 3  # (read: ranked as given, warned of)
    said = str(ei.value)
    assert "best_mode='min' ranks 'acc' by the least value, but step 4 under" in said, said
    assert "recorded best_mode='max'" in said and "the steps ranked best so far would be " \
        "removed; pass best_mode='max' (or None: as the steps recorded)" in said, said
    assert "nothing was committed" in said
    warned = [r.getMessage() for r in caplog.records if "ranks by the least value as given"
              in r.getMessage()]
    assert len(warned) == 2, warned  # (once per checkpointer)
    with AsyncCheckpointer(tmp_path, mode="sync", keep_last=1, keep_best=1,
                           best_metric="acc", best_mode="max") as ckpt:
        ckpt.save(_state(5), 5, metrics={"acc": 0.05})
        assert ckpt.steps() == [2, 5]


def test_steps_that_recorded_both_ways_are_warned_of_and_ranked_by_the_newest(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A trial copied one step of another run (ranked "min") into a "max" root: the
    whole root then ranked by the least, and a resumed trainer removed the best steps,
    without a word."""
    _accuracies(tmp_path / "a", best_metric="acc", best_mode="max")
    _accuracies(tmp_path / "b", best_metric="acc", best_mode="min")
    shutil.copytree(tmp_path / "b" / "step_000000004", tmp_path / "a" / "step_000000004",
                    dirs_exist_ok=True)
    caplog.set_level(logging.WARNING, logger="asyncckpt")
    with AsyncCheckpointer(tmp_path / "a", mode="sync", best_metric="acc") as ckpt:
        assert ckpt.best_step() == 3  # (by the newest's, "min")
        assert ckpt.best_step() == 3
    said = [r.getMessage() for r in caplog.records if "recorded both ways" in r.getMessage()]
    assert len(said) == 1, said
    assert "recorded both ways of ranking 'acc': best_mode='max' at steps 1, 2, 3; " \
           "best_mode='min' at step 4 (a step copied in from another run?" in said[0], said


def test_the_config_takes_best_mode_none_and_refuses_others_naming_none_too(
        tmp_path: Path) -> None:
    with pytest.raises(CheckpointConfigError, match=r"best_mode='up'.*or None: as the root's"):
        AsyncCheckpointer(tmp_path, best_metric="acc", best_mode="up")
    with AsyncCheckpointer(tmp_path, mode="sync") as ckpt:
        assert ckpt.best_step("acc", None) is None


def test_in_a_group_the_coordinator_records_the_mode(tmp_path: Path) -> None:
    store = torch.distributed.HashStore()
    ckpts = [AsyncCheckpointer(tmp_path, mode="sync", rank=r, world_size=2, store=store,
                               timeout_s=60, best_metric="acc", best_mode="max")
             for r in range(2)]

    def rank_main(r: int) -> None:
        part = torch.arange(4.0) + 10 * r
        ckpts[r].save({"w": part}, 1, metrics={"acc": 0.5},
                      shards={"w": asyncckpt.ShardMetadata((8,), (4 * r,))})
        ckpts[r].close()

    all_ok(in_threads(rank_main, 2))
    assert read_manifest(tmp_path / "step_000000001", LocalStorage()).metric_modes == {
        "acc": "max"}


def test_the_manifest_carries_metric_modes_and_passes_over_unknown_ones(
        tmp_path: Path) -> None:
    _accuracies(tmp_path, best_metric="acc", best_mode="max")
    m = read_manifest(tmp_path / "step_000000001", LocalStorage())
    assert m.metric_modes == {"acc": "max"}
    assert parse_manifest(m.encode(), "x").metric_modes == {"acc": "max"}
    other = dataclasses.replace(m, metric_modes={"acc": "median", "f1": "max"})
    assert parse_manifest(other.encode(), "x").metric_modes == {"f1": "max"}
    # (advice, not data: a field of another shape leaves the step loadable: a review)
    broken = dataclasses.replace(m, metric_modes=["acc"])  # type: ignore[arg-type]
    assert parse_manifest(broken.encode(), "x").metric_modes == {}


def test_the_cli_ranks_by_the_recorded_mode_and_says_when_told_otherwise(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A researcher trial's `export --best val_acc`, without --max, exported the worst."""
    _accuracies(tmp_path, best_metric="acc", best_mode="max")
    capsys.readouterr()
    assert main(["ls", str(tmp_path), "--best", "acc", "--json"]) == 0
    got = capsys.readouterr()
    doc = json.loads(got.out)
    assert doc["best"] == 2 and got.err == ""
    assert [r["metric_modes"] for r in doc["steps"]] == [{"acc": "max"}] * 4
    assert main(["inspect", str(tmp_path), "--best", "acc", "--json"]) == 0
    got = capsys.readouterr()
    assert json.loads(got.out)["step"] == 2 and json.loads(got.out)["metric_modes"] == {
        "acc": "max"}
    assert main(["inspect", str(tmp_path), "--step", "2"]) == 0
    assert "ranked by: acc (greatest is best)" in capsys.readouterr().out
    assert main(["ls", str(tmp_path), "--best", "acc", "--min", "--json"]) == 0
    got = capsys.readouterr()
    assert json.loads(got.out)["best"] == 3
    assert "--best acc --min ranks by the least value (step 3), but the steps recorded " \
           "best_mode='max'" in got.err
    assert main(["ls", str(tmp_path), "--best", "acc", "--max", "--json"]) == 0
    got = capsys.readouterr()
    assert json.loads(got.out)["best"] == 2 and got.err == ""
    for argv, said in ((["ls", str(tmp_path), "--min"], "--min goes with --best"),
                       (["ls", str(tmp_path), "--best", "acc", "--max", "--min"],
                        "--max and --min each say")):
        assert main(argv) == 2, argv
        assert said in capsys.readouterr().err, argv


def test_the_cli_without_a_recorded_mode_ranks_by_the_least_and_warns_by_the_name(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _accuracies(tmp_path)
    capsys.readouterr()
    assert main(["ls", str(tmp_path), "--best", "acc", "--json"]) == 0
    got = capsys.readouterr()
    assert json.loads(got.out)["best"] == 3
    assert "ranks by the least value (step 3), as for a loss (no step recorded" in got.err
    assert main(["ls", str(tmp_path), "--best", "acc", "--min", "--json"]) == 0
    assert "as for a loss" in capsys.readouterr().err  # (--min told: the name still reads)


# --- metrics recorded after the save -----------------------------------------------------------

def test_metrics_recorded_after_the_save_rank_the_step_as_its_own(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An evaluation that ends after the step was saved had no way to count for keep_best:
    the roadmap's "no API adds metrics to a committed step"."""
    with AsyncCheckpointer(tmp_path, mode="async", keep_last=2, keep_best=1,
                           best_metric="val_loss") as ckpt:
        for step in (1, 2):
            ckpt.save_async(_state(step), step).wait()
        # step 1's evaluation ends now: the best
        assert ckpt.record_metrics(1, {"val_loss": torch.tensor(0.25)}) == {"val_loss": 0.25}
        assert ckpt.best_step() == 1 and ckpt.step_metrics(1) == {"val_loss": 0.25}
        fut = ckpt.save_async(_state(3), 3)
        assert ckpt.record_metrics(3, {"val_loss": 0.5}) == {"val_loss": 0.5}  # (waited)
        assert fut.done()
        ckpt.save_async(_state(4), 4, metrics={"val_loss": 0.75}).wait()
        ckpt.wait()
        assert ckpt.steps() == [1, 3, 4]  # step 1 spared as the best, 2 removed
    files = sorted(p.name for p in (tmp_path / "step_000000001").iterdir())
    assert files == ["manifest.json", "metrics.json", "rank_00000.safetensors"]  # (no tmp)
    reader = AsyncCheckpointer(tmp_path, mode="sync")
    assert reader.best_step("val_loss") == 1
    assert reader.step_metrics(4) == {"val_loss": 0.75} and reader.step_metrics(3) == {
        "val_loss": 0.5}
    # a second evaluation replaces the value; another checkpointer reads it again
    with AsyncCheckpointer(tmp_path, mode="sync") as evaluator:
        assert evaluator.record_metrics(1, {"val_loss": 0.9, "acc": 0.1}) == {
            "val_loss": 0.9, "acc": 0.1}
    assert reader.best_step("val_loss") == 3
    capsys.readouterr()
    assert main(["ls", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["steps"]
    assert [r["metrics"] for r in rows] == [{"val_loss": 0.9, "acc": 0.1}, {"val_loss": 0.5},
                                            {"val_loss": 0.75}]
    assert main(["inspect", str(tmp_path), "--step", "1"]) == 0
    assert "(val_loss, acc recorded after the save)" in capsys.readouterr().out
    reader.close()


def test_record_metrics_keeps_what_the_save_recorded(tmp_path: Path) -> None:
    with AsyncCheckpointer(tmp_path, mode="sync") as ckpt:
        ckpt.save(_state(1), 1, metrics={"val_loss": 2.0, "nan": NAN})
        with pytest.raises(CheckpointConfigError,
                           match=r"step 1: val_loss=1 \(its save recorded 2\): the metrics a "
                                 r"save recorded are not rewritten.*'val_loss_2'"):
            ckpt.record_metrics(1, {"val_loss": 1.0, "acc": 0.5})
        assert not (tmp_path / "step_000000001" / "metrics.json").exists()  # (nothing)
        got = ckpt.record_metrics(1, {"val_loss": 2.0, "nan": NAN, "acc": 0.5})  # (the same)
        assert got["val_loss"] == 2.0 and got["acc"] == 0.5 and math.isnan(got["nan"])
        assert read_manifest(tmp_path / "step_000000001", LocalStorage()).metrics[
            "val_loss"] == 2.0


def test_record_metrics_refuses_what_it_cannot_record(tmp_path: Path) -> None:
    with AsyncCheckpointer(tmp_path, mode="sync") as ckpt:
        ckpt.save(_state(1), 1)
        with pytest.raises(asyncckpt.CheckpointNotFoundError, match="step 7"):
            ckpt.record_metrics(7, {"val_loss": 1.0})
        with pytest.raises(CheckpointConfigError, match="pass the metrics to record"):
            ckpt.record_metrics(1, {})
        with pytest.raises(CheckpointConfigError, match=r"metrics\['x'\]"):
            ckpt.record_metrics(1, {"x": "high"})
        other = tmp_path.parent / f"{tmp_path.name}-elsewhere"
        shutil.copytree(tmp_path / "step_000000001", other)
        os.symlink(other, tmp_path / "step_000000002")
        with pytest.raises(CheckpointConfigError, match=r"step 2: its directory leads out of"):
            ckpt.record_metrics(2, {"val_loss": 1.0})
        assert not (other / "metrics.json").exists()
    with pytest.raises(asyncckpt.CheckpointClosedError):
        ckpt.record_metrics(1, {"val_loss": 1.0})


def test_a_damaged_metrics_file_counts_as_none_and_is_replaced(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    with AsyncCheckpointer(tmp_path, mode="sync") as ckpt:
        ckpt.save(_state(1), 1, metrics={"loss": 3.0})
        ckpt.save(_state(2), 2, metrics={"loss": 2.0})
        ckpt.record_metrics(1, {"val_loss": 1.0})
    path = tmp_path / "step_000000001" / "metrics.json"
    path.write_bytes(path.read_bytes().replace(b'"1.0"', b'"0.5"'))  # (edited by hand)
    caplog.set_level(logging.WARNING, logger="asyncckpt")
    with AsyncCheckpointer(tmp_path, mode="sync") as ckpt:
        assert ckpt.best_step("val_loss") is None
        assert ckpt.best_step("val_loss") is None
        said = [r.getMessage() for r in caplog.records if "metrics.json" in r.getMessage()]
        assert len(said) == 1 and "its digest does not match" in said[0], said
        assert "record them again" in said[0]
        with pytest.raises(CheckpointCorruptError, match=r"metrics\.json"):
            ckpt.step_metrics(1)
        capsys.readouterr()
        assert main(["ls", str(tmp_path), "--json"]) == 0  # (the data is fine: exit 0)
        got = capsys.readouterr()
        assert json.loads(got.out)["steps"][0]["metrics"] == {"loss": 3.0}
        assert "its digest does not match" in got.err
        row = json.loads(got.out)["steps"][0]
        assert "its digest does not match" in row["metrics_error"] and not row["damaged"]
        # --best cannot tell which step is best (an ops trial: export --best took another
        # step, exit 0, and ls --best --json said ok): exit 2, the step named
        ckpt.record_metrics(2, {"val_loss": 0.7})
        capsys.readouterr()
        assert main(["ls", str(tmp_path), "--json", "--best", "val_loss"]) == 2
        doc = json.loads(capsys.readouterr().out)
        assert doc["best"] == 2 and doc["unranked"] == [1] and doc["ok"] is False
        assert main(["ls", str(tmp_path), "--best", "val_loss"]) == 2
        assert "step 1 cannot be read: it may hold a better val_loss" in capsys.readouterr().out
        out = tmp_path.parent / f"{tmp_path.name}.safetensors"
        assert main(["export", str(tmp_path), str(out), "--best", "val_loss"]) == 2
        assert not out.exists()
        assert ("cannot tell which step is best under" in capsys.readouterr().err)
        # a metric the save recorded itself is known whatever metrics.json says (the
        # review: --best loss was refused, though step 1's loss is in its manifest)
        assert main(["ls", str(tmp_path), "--json", "--best", "loss"]) == 0
        assert json.loads(capsys.readouterr().out)["unranked"] == []
        assert ckpt.record_metrics(1, {"val_loss": 0.5}) == {"val_loss": 0.5, "loss": 3.0}
        assert ckpt.best_step("val_loss") == 1
        assert main(["ls", str(tmp_path), "--json", "--best", "val_loss"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["best"] == 1 and doc["unranked"] == [] and doc["steps"][0][
            "metrics_error"] is None


def test_a_save_looks_for_the_mode_to_inherit_in_the_newest_steps_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the save's path: a root of many steps that recorded no mode (an earlier
    library's) is not read whole before the first save's manifest."""
    with AsyncCheckpointer(tmp_path, mode="sync") as ckpt:
        for step in range(1, 13):
            ckpt.save(_state(step), step, metrics={"loss": float(step)})
    import asyncckpt.best as best

    reads: list[int] = []
    real = best.read_manifest_summary

    def counted(step_dir: Path, storage: Any) -> Any:
        reads.append(int(step_dir.name.split("_")[1]))
        return real(step_dir, storage)

    monkeypatch.setattr(best, "read_manifest_summary", counted)
    with AsyncCheckpointer(tmp_path, mode="sync", best_metric="loss") as ckpt:
        ckpt.save(_state(13), 13, metrics={"loss": 0.5})
    assert sorted(reads) == list(range(5, 13))
    assert read_manifest(tmp_path / "step_000000013", LocalStorage()).metric_modes == {}


def test_a_rollback_looks_up_the_mode_to_inherit_again(tmp_path: Path) -> None:
    """A review: the mode a checkpointer's saves record was looked up once, and outlived
    discard_steps_after() of the steps it came from."""
    _accuracies(tmp_path)  # steps 1-4 record no mode
    with AsyncCheckpointer(tmp_path, mode="sync", best_metric="acc",
                           best_mode="max") as ckpt:
        ckpt.save(_state(5), 5, metrics={"acc": 0.3})
    with AsyncCheckpointer(tmp_path, mode="sync", best_metric="acc") as ckpt:
        ckpt.save(_state(6), 6, metrics={"acc": 0.2})  # inherits "max" from step 5
        assert ckpt.manifest(6).metric_modes == {"acc": "max"}
        assert ckpt.best_step() == 2
        assert ckpt.discard_steps_after(4) == [5, 6]
        ckpt.save(_state(5), 5, metrics={"acc": 0.05})  # nothing to inherit now
        assert ckpt.manifest(5).metric_modes == {}
        assert ckpt.best_step() == 5  # (the least: 0.05; by the greatest, step 2's 0.9)


def test_a_metric_recorded_right_after_the_save_counts_though_retention_noted_it_later(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A review: retention noted the save's own metrics under an identity that already
    held the metrics.json recorded meanwhile, which then never counted: keep_best
    deleted the best step."""
    import asyncckpt.best as best

    real = best.StepMetrics.note

    def late(self: Any, *args: Any, **kw: Any) -> None:
        import time as _time

        _time.sleep(0.2)  # (the writer thread, scheduled late)
        real(self, *args, **kw)

    monkeypatch.setattr(best.StepMetrics, "note", late)
    with AsyncCheckpointer(tmp_path, mode="async", keep_last=2, keep_best=1,
                           best_metric="val_loss") as ckpt:
        for step in range(1, 7):
            ckpt.save_async(_state(step), step)
            ckpt.record_metrics(step, {"val_loss": -1.0 if step == 3 else float(step)})
            if step >= 3:
                assert ckpt.best_step() == 3
        ckpt.wait()
        assert ckpt.steps() == [3, 5, 6]


def test_metrics_recorded_through_another_storage_are_seen_by_the_same_checkpointer(
        tmp_path: Path) -> None:
    """A review: a storage that is no LocalStorage trusted what it knew of a step for
    ever, so a metric recorded later never counted for retention."""
    class Passing:  # a storage of the protocol's calls, delegating to the local one
        def __init__(self) -> None:
            self._local = LocalStorage()

        def __getattr__(self, name: str) -> Any:
            return getattr(self._local, name)

    with AsyncCheckpointer(tmp_path, mode="sync", keep_last=1, keep_best=1,
                           best_metric="val_loss", storage=Passing()) as ckpt:
        ckpt.save(_state(1), 1, metrics={"val_loss": 3.0})
        ckpt.save(_state(2), 2)
        assert ckpt.best_step() == 1
        ckpt.record_metrics(2, {"val_loss": 1.0})
        assert ckpt.best_step() == 2
        ckpt.save(_state(3), 3, metrics={"val_loss": 2.0})
        assert ckpt.steps() == [2, 3]


def test_a_metrics_file_this_user_may_not_read_leaves_the_saves_own_metrics(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A review: an evaluator's unreadable metrics.json hid the manifest's metrics too, and
    keep_best deleted the best step."""
    with AsyncCheckpointer(tmp_path, mode="sync") as ckpt:
        ckpt.save(_state(1), 1, metrics={"val_loss": 0.1})
        ckpt.record_metrics(1, {"acc": 0.5})
        ckpt.save(_state(2), 2, metrics={"val_loss": 0.5})
    import asyncckpt.best as best

    real = LocalStorage.read_bytes

    def denied(self: Any, path: Path, limit: int) -> bytes:
        if path.name == "metrics.json" and path.exists():
            raise PermissionError(13, "Permission denied", str(path))
        return real(self, path, limit)

    caplog.set_level(logging.WARNING, logger="asyncckpt")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LocalStorage, "read_bytes", denied)
        with AsyncCheckpointer(tmp_path, mode="sync", keep_last=1, keep_best=1,
                               best_metric="val_loss") as ckpt:
            assert ckpt.best_step() == 1
            ckpt.save(_state(3), 3, metrics={"val_loss": 0.9})
            assert ckpt.steps() == [1, 3]
            with pytest.raises(asyncckpt.CheckpointPermissionError,
                               match=r"metrics\.json cannot be read by this user.*give it "
                                     r"read access"):
                ckpt.step_metrics(1)
    said = [r.getMessage() for r in caplog.records if "metrics.json" in r.getMessage()]
    assert len(said) == 1 and "give it read access" in said[0], said
    assert best.LATER_METRICS_NAME == "metrics.json"


def test_record_metrics_names_the_clashing_metric_in_its_advice(tmp_path: Path) -> None:
    with AsyncCheckpointer(tmp_path, mode="sync") as ckpt:
        ckpt.save(_state(1), 1, metrics={"nan": NAN, "val_loss": 2.0})
        with pytest.raises(CheckpointConfigError, match=r"e\.g\. 'val_loss_2'"):
            ckpt.record_metrics(1, {"nan": NAN, "val_loss": 1.0})


def test_a_record_that_races_retention_counts_for_it_or_finds_its_step_gone(
        tmp_path: Path) -> None:
    """A trial: an evaluator recorded the best step after retention had ranked the steps,
    and before it removed that one: record_metrics returned, and the step was gone 1 ms
    later, the best lost."""
    import threading

    evaluator = AsyncCheckpointer(tmp_path, mode="sync")  # (as another process's would)
    outcome: list[Any] = []

    class Racing(LocalStorage):
        def rename(self, src: Path, dst: Path) -> None:
            if ".deleting-" in dst.name and not outcome:  # (ranked: about to hide step 2)
                def record() -> None:
                    try:
                        outcome.append(evaluator.record_metrics(2, {"val_acc": 0.99}))
                    except asyncckpt.CheckpointNotFoundError as exc:
                        outcome.append(exc)

                t = threading.Thread(target=record)
                t.start()
                t.join(0.5)  # (it waits for the retention: the lock)
                assert t.is_alive() and not outcome
                self.waiter = t
            super().rename(src, dst)

    storage = Racing()
    with AsyncCheckpointer(tmp_path, mode="async", keep_last=2, keep_best=1,
                           best_metric="val_acc", best_mode="max", storage=storage) as ckpt:
        ckpt.save({"w": torch.zeros(4)}, 1, metrics={"val_acc": 0.5})
        ckpt.save({"w": torch.zeros(4)}, 2)
        ckpt.save({"w": torch.zeros(4)}, 3)
        ckpt.save({"w": torch.zeros(4)}, 4)  # (step 2 leaves keep_last here)
    storage.waiter.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], asyncckpt.CheckpointNotFoundError)
    assert "step 2 was removed" in str(outcome[0]) and "nothing was recorded" in str(
        outcome[0])
    assert evaluator.steps() == [1, 3, 4] and evaluator.best_step("val_acc") == 1
    evaluator.close()


def test_keep_best_keeps_a_step_whose_later_metrics_cannot_be_read(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A trial: the best step's hand-corrected metrics.json (its digest then wrong) had the
    step deleted at the next save, before its metrics could be recorded again."""
    with AsyncCheckpointer(tmp_path, mode="sync", keep_last=1, keep_best=1,
                           best_metric="val_acc", best_mode="max") as ckpt:
        ckpt.save(_state(1), 1, metrics={"val_acc": 0.5})
        ckpt.save(_state(2), 2)
        ckpt.record_metrics(2, {"val_acc": 0.9})
        ckpt.save(_state(3), 3, metrics={"val_acc": 0.1})
        assert ckpt.steps() == [2, 3]
        path = tmp_path / "step_000000002" / "metrics.json"
        path.write_bytes(path.read_bytes().replace(b'"0.9"', b'"0.8"'))
        caplog.set_level(logging.WARNING, logger="asyncckpt")
        ckpt.save(_state(4), 4, metrics={"val_acc": 0.2})
        assert ckpt.steps() == [2, 4]  # (kept: its metrics unread; 4 the best read)
        assert "keep_best keeps the step until they can be read" in caplog.text
        ckpt.record_metrics(2, {"val_acc": 0.8})  # (recorded again: it ranks again)
        ckpt.save(_state(5), 5, metrics={"val_acc": 0.3})
        assert ckpt.steps() == [2, 5] and ckpt.best_step() == 2


def test_a_metrics_file_copied_from_another_step_is_refused(tmp_path: Path) -> None:
    with AsyncCheckpointer(tmp_path, mode="sync") as ckpt:
        ckpt.save(_state(1), 1)
        ckpt.save(_state(2), 2)
        ckpt.record_metrics(2, {"val_acc": 0.9})
        shutil.copy(tmp_path / "step_000000002" / "metrics.json",
                    tmp_path / "step_000000001" / "metrics.json")
        with pytest.raises(CheckpointCorruptError,
                           match=r"it holds the metrics of step 2, not of step 1 \(copied"):
            ckpt.step_metrics(1)
        assert ckpt.best_step("val_acc") == 2


def test_ls_of_a_step_directory_with_best_is_a_usage_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A trial: `ls STEP_DIR --best val_acc` said no step recorded val_acc, beside the step
    showing val_acc=0.871."""
    _accuracies(tmp_path)
    capsys.readouterr()
    assert main(["ls", str(tmp_path / "step_000000002"), "--best", "acc"]) == 2
    assert "--best picks among the steps of a checkpoint root" in capsys.readouterr().err


def test_best_mode_without_best_metric_ranks_the_metric_best_step_names(tmp_path: Path) -> None:
    """A trial: AsyncCheckpointer(root, best_mode="max").best_step("val_acc") ignored the
    mode and named the worst step."""
    _accuracies(tmp_path)
    with AsyncCheckpointer(tmp_path, mode="sync", best_mode="max") as ckpt:
        assert ckpt.best_step("acc") == 2 and ckpt.best_step("acc", "min") == 3


def _at_once(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "steps at once" in r.getMessage()]


def test_a_restart_that_lowers_keep_best_is_warned_of_the_steps_it_removes(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A trial: keep_best=3 then 1 removed two best steps in one save, unwarned (two at
    once was taken for a best displaced beside the step leaving keep_last)."""
    with AsyncCheckpointer(tmp_path, mode="sync", keep_last=1, keep_best=3,
                           best_metric="loss") as ckpt:
        for step, loss in ((1, 3.0), (2, 2.0), (3, 1.0)):
            ckpt.save(_state(step), step, metrics={"loss": loss})
        assert ckpt.steps() == [1, 2, 3]
    caplog.set_level(logging.WARNING, logger="asyncckpt")
    with AsyncCheckpointer(tmp_path, mode="sync", keep_last=1, keep_best=1,
                           best_metric="loss") as ckpt:
        ckpt.save(_state(4), 4, metrics={"loss": 5.0})
        assert ckpt.steps() == [3, 4]
    said = _at_once(caplog)
    assert len(said) == 1 and "removed 2 steps at once, [1, 2]" in said[0], said


def test_bests_displaced_by_metrics_recorded_later_are_no_changed_settings(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A trial: after an evaluator's records, a save's removals (bests displaced, and the
    step leaving keep_last) were told "if a restart changed those settings". Bests
    displaced are known now, and not counted (one removal more is warned of)."""
    caplog.set_level(logging.WARNING, logger="asyncckpt")
    with AsyncCheckpointer(tmp_path, mode="sync", keep_last=1, keep_best=2,
                           best_metric="loss") as ckpt:
        for step, loss in ((1, 5.0), (2, 4.0), (3, None), (4, None)):
            ckpt.save(_state(step), step, metrics=None if loss is None else {"loss": loss})
        assert ckpt.steps() == [1, 2, 4]
        ckpt.record_metrics(4, {"loss": 1.0})
        ckpt.save(_state(5), 5, metrics={"loss": 0.5})
        assert ckpt.steps() == [4, 5]
    assert _at_once(caplog) == []


def test_the_cli_says_when_the_best_it_takes_is_nan(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A trial: `export --best val_loss` of a root whose every val_loss was NaN took a
    step, exit 0, without a word."""
    with AsyncCheckpointer(tmp_path, mode="sync") as ckpt:
        for step in (1, 2, 3):
            ckpt.save(_state(step), step, metrics={"val_loss": NAN})
    capsys.readouterr()
    assert main(["ls", str(tmp_path), "--best", "val_loss", "--json"]) == 0
    got = capsys.readouterr()
    assert json.loads(got.out)["best"] == 3
    assert "--best val_loss: step 3 is taken, but its val_loss is NaN, as is every step's" \
        in got.err, got.err
    # (an ops trial: a diverged run's loss of -inf was taken as best, unsaid)
    with AsyncCheckpointer(tmp_path / "inf", mode="sync") as ckpt:
        for step, loss in ((1, 2.0), (2, -INF), (3, 1.0)):
            ckpt.save(_state(step), step, metrics={"loss": loss})
    capsys.readouterr()
    assert main(["ls", str(tmp_path / "inf"), "--best", "loss", "--json"]) == 0
    got = capsys.readouterr()
    assert json.loads(got.out)["best"] == 2
    assert "--best loss: step 2 is taken, and its loss is -inf, which no finite value " \
        "outranks" in got.err, got.err
    assert main(["ls", str(tmp_path / "inf"), "--best", "loss", "--max"]) == 0
    assert "outranks" not in capsys.readouterr().err  # (+inf/-inf ranked last: no word)
    # every step's +inf, ranked by the least: the worst there is (a QA re-check: told
    # "no finite value outranks" it)
    with AsyncCheckpointer(tmp_path / "allinf", mode="sync") as ckpt:
        for step in (1, 2):
            ckpt.save(_state(step), step, metrics={"loss": INF})
    capsys.readouterr()
    assert main(["ls", str(tmp_path / "allinf"), "--best", "loss"]) == 0
    err = capsys.readouterr().err
    assert "outranks" not in err and "its loss is inf, as is (or NaN) every step's" in err, err


def test_a_refused_best_mode_is_raised_before_anything_is_staged_or_removed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A review: on a disk short of room, the save's retention made room (ranking by the
    mode given, removing the best steps) before the refusal; and a refused save wrote its
    whole file first."""
    _accuracies(tmp_path, best_metric="acc", best_mode="max")
    import asyncckpt.writer as writer

    monkeypatch.setattr(writer, "_free_bytes", lambda *a, **k: 1)  # (no room: make some)
    ckpt = AsyncCheckpointer(tmp_path, mode="async", keep_last=1, keep_best=1,
                             best_metric="acc", best_mode="min")
    with pytest.raises(CheckpointConfigError, match="recorded best_mode='max'"):
        ckpt.save_async(_state(5), 5, metrics={"acc": 0.05})  # (at once, on this thread)
    assert ckpt.host_buffer_bytes == 0  # (nothing staged)
    assert ckpt.steps() == [1, 2, 3, 4]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".step_")] == []
    ckpt.close()


def test_a_mode_given_is_checked_against_steps_older_than_the_newest_eight(
        tmp_path: Path) -> None:
    """A review: two "max" steps under eight that recorded none were not looked at, and
    the "min" run's retention removed them."""
    with AsyncCheckpointer(tmp_path, mode="sync", best_metric="acc", best_mode="max") as c:
        c.save(_state(1), 1, metrics={"acc": 0.99})
        c.save(_state(2), 2, metrics={"acc": 0.98})
    with AsyncCheckpointer(tmp_path, mode="sync") as c:
        for step in range(3, 11):
            c.save(_state(step), step, metrics={"acc": 0.1})
    with AsyncCheckpointer(tmp_path, mode="sync", keep_last=1, keep_best=2,
                           best_metric="acc", best_mode="min") as ckpt:
        with pytest.raises(CheckpointConfigError, match="step 2 under"):
            ckpt.save(_state(11), 11, metrics={"acc": 0.05})
        assert ckpt.steps() == list(range(1, 11))


def test_in_a_group_every_rank_is_refused_a_best_mode_given_against_the_steps(
        tmp_path: Path) -> None:
    """A review: rank 0 raised CheckpointConfigError, rank 1 a CheckpointSaveError."""
    _accuracies(tmp_path, best_metric="acc", best_mode="max")
    store = torch.distributed.HashStore()
    ckpts = [AsyncCheckpointer(tmp_path, mode="async", rank=r, world_size=2, store=store,
                               timeout_s=30, keep_last=1, keep_best=1, best_metric="acc",
                               best_mode="min") for r in range(2)]
    raised: dict[int, BaseException] = {}

    def rank_main(r: int) -> None:
        try:
            ckpts[r].save_async({"w": torch.arange(4.0) + r}, 5, metrics={"acc": 0.05},
                                shards={"w": asyncckpt.ShardMetadata((8,), (4 * r,))}).wait()
        except CheckpointConfigError as exc:
            raised[r] = exc
        finally:
            ckpts[r].close()

    all_ok(in_threads(rank_main, 2))
    assert set(raised) == {0, 1}, raised
    assert "recorded best_mode='max'" in str(raised[1])
    assert AsyncCheckpointer(tmp_path).steps() == [1, 2, 3, 4]


def test_the_ranking_lock_is_released_though_a_child_forked_while_it_was_held(
        tmp_path: Path) -> None:
    """A review: a child forked while a retention held the lock shared its open file, and
    kept the lock until it exited: every later retention and record waited 30 s."""
    import signal
    import threading
    import time
    import warnings

    from asyncckpt import commit

    tmp_path.mkdir(exist_ok=True)
    inside, leave = threading.Event(), threading.Event()

    def hold() -> None:
        with commit.ranking_lock(tmp_path, LocalStorage(), "test") as held:
            assert held
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    inside.wait(10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        time.sleep(20)
        os._exit(0)
    try:
        leave.set()
        t.join(10)
        t0 = time.monotonic()
        with commit.ranking_lock(tmp_path, LocalStorage(), "test") as held:
            assert held
        assert time.monotonic() - t0 < 1.0
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_a_filesystem_without_flock_records_unlocked(tmp_path: Path) -> None:
    import errno
    import fcntl

    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    with AsyncCheckpointer(tmp_path, mode="sync") as ckpt:
        ckpt.save(_state(1), 1)
        with pytest.MonkeyPatch.context() as mp:  # (the record's alone: not the lock's)
            mp.setattr(fcntl, "flock", no_locks)
            assert ckpt.record_metrics(1, {"acc": 0.5}) == {"acc": 0.5}


def test_what_a_killed_record_left_is_swept_by_the_next(tmp_path: Path) -> None:
    with AsyncCheckpointer(tmp_path, mode="sync") as ckpt:
        ckpt.save(_state(1), 1)
        left = tmp_path / "step_000000001" / ".metrics.json.tmp-deadbeef"
        left.write_bytes(b"{")
        ckpt.record_metrics(1, {"acc": 0.5})
        assert not left.exists()
        assert ckpt.step_metrics(1) == {"acc": 0.5}


def test_modes_are_read_from_manifests_alone(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A review: every step's metrics.json was read again to learn its mode (4 reads a
    step at each retention on a storage that is not local)."""
    _accuracies(tmp_path, best_metric="acc", best_mode="max")
    import asyncckpt.best as best

    reads: list[Path] = []
    real = best.read_later_metrics
    monkeypatch.setattr(best, "read_later_metrics",
                        lambda d, s: reads.append(d) or real(d, s))
    cache = StepMetrics()
    assert cache.recorded_modes(tmp_path, LocalStorage(), [1, 2, 3, 4], "acc") == {
        "max": [4, 3, 2, 1]}
    assert reads == []


def _mixed_root(root: Path) -> None:
    """A "max" root (acc 0.5, 0.9, 0.1, 0.7 at steps 1-4) with step 5 copied in from a
    "min" run (acc 0.2)."""
    _accuracies(root / "a", best_metric="acc", best_mode="max")
    with AsyncCheckpointer(root / "b", mode="sync", best_metric="acc", best_mode="min") as c:
        c.save(_state(5), 5, metrics={"acc": 0.2})
    shutil.copytree(root / "b" / "step_000000005", root / "a" / "step_000000005")


def test_a_mixed_root_takes_a_mode_one_of_its_steps_recorded_and_refuses_none(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A QA trial: with a step copied in from a "min" run, the right best_mode="max" was
    refused (its advice: "min" or None, which removed the best steps), and None inherited
    the copied step's "min" and removed the two best steps."""
    _mixed_root(tmp_path)
    root = tmp_path / "a"
    with AsyncCheckpointer(root, mode="sync", keep_last=1, keep_best=2,
                           best_metric="acc") as ckpt:
        with pytest.raises(CheckpointConfigError, match=(
                r"recorded both ways of ranking 'acc' \(best_mode='max' at steps 1, 2, 3, 4; "
                r"best_mode='min' at step 5: a step copied in from another run\?\), and no "
                r"best_mode was given to say which this run ranks by: pass best_mode='min' "
                r"or 'max'")):
            ckpt.save(_state(6), 6, metrics={"acc": 0.3})
        assert ckpt.steps() == [1, 2, 3, 4, 5]
    caplog.set_level(logging.WARNING, logger="asyncckpt")
    with AsyncCheckpointer(root, mode="sync", keep_last=1, keep_best=2,
                           best_metric="acc", best_mode="max") as ckpt:
        ckpt.save(_state(6), 6, metrics={"acc": 0.3})
        assert ckpt.steps() == [2, 4, 6]  # (the two best by the greatest, and the newest)
    assert "recorded both ways of ranking 'acc'" in caplog.text
    assert "ranked by 'max' (the greatest value best, as given)" in caplog.text


def test_the_cli_warns_of_a_root_whose_steps_recorded_both_ways(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A QA trial: `ls --best` and `inspect --best` of a mixed root named the step the
    copied one's mode picked, without a word."""
    _mixed_root(tmp_path)
    capsys.readouterr()
    assert main(["ls", str(tmp_path / "a"), "--best", "acc", "--json"]) == 0
    got = capsys.readouterr()
    assert json.loads(got.out)["best"] == 3
    assert "recorded both ways of ranking 'acc'" in got.err, got.err
    assert "ranked by 'min' (the least value best: the newest step's)" in got.err


def test_a_retention_leaves_its_round_to_the_next_save_while_a_record_holds_the_lock(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A QA trial: an evaluator stopped inside record_metrics (SIGSTOP, a debugger) held
    every keep_best save of the trainer 30 s."""
    import threading
    import time

    from asyncckpt import commit

    monkeypatch.setattr(commit, "RETENTION_RANKING_S", 0.3)
    caplog.set_level(logging.WARNING, logger="asyncckpt")
    with AsyncCheckpointer(tmp_path, mode="async", keep_last=1, keep_best=1,
                           best_metric="loss") as ckpt:
        ckpt.save(_state(1), 1, metrics={"loss": 1.0})
        inside, leave = threading.Event(), threading.Event()

        def stopped_evaluator() -> None:
            with commit.ranking_lock(tmp_path, LocalStorage(), "test"):
                inside.set()
                leave.wait(30)

        t = threading.Thread(target=stopped_evaluator)
        t.start()
        inside.wait(10)
        t0 = time.monotonic()
        for step in (2, 3):
            ckpt.save_async(_state(step), step, metrics={"loss": float(step)}).wait()
            ckpt.wait()
        assert time.monotonic() - t0 < 5
        assert ckpt.steps() == [1, 2, 3]  # (left to the next save's retention)
        leave.set()
        t.join(10)
        ckpt.save(_state(4), 4, metrics={"loss": 4.0})
        assert ckpt.steps() == [1, 4]
    assert "retention left the old steps to the next save's" in caplog.text


def test_release_host_buffer_tells_a_served_root_s_peers_at_once(tmp_path: Path) -> None:
    """A QA trial: after a release, peers' fetches waited out their whole timeout."""
    import time

    from asyncckpt.transport import HTTPTransport

    srv = HTTPTransport(timeout=10.0)
    try:
        with AsyncCheckpointer(tmp_path, mode="async") as ckpt:
            ckpt.serve(srv)
            ckpt.save(_state(1), 1)
            ckpt.release_host_buffer()
            t0 = time.monotonic()
            with pytest.raises(asyncckpt.CheckpointNotFoundError,
                               match="released the host buffer it served from"):
                asyncckpt.load(srv.address(), timeout=10)
            assert time.monotonic() - t0 < 5
    finally:
        srv.shutdown()


def test_an_older_step_s_lost_metrics_are_not_sent_to_record_metrics(tmp_path: Path) -> None:
    """A QA trial: saving step 0 with metrics= beside step 1 was told record_metrics adds
    them to "the committed step", which step 0 is not."""
    with AsyncCheckpointer(tmp_path, mode="sync") as ckpt:
        ckpt.save(_state(1), 1)
        with pytest.raises(asyncckpt.CheckpointExistsError) as ei:
            ckpt.save(_state(0), 0, metrics={"loss": 1.0})
        assert "were NOT recorded by this save" in str(ei.value)
        assert "record_metrics" not in str(ei.value), ei.value


def test_a_record_tied_to_one_save_of_a_step_is_refused_for_another(tmp_path: Path) -> None:
    """A trial: an evaluator scored step 30, the trainer rolled back and saved step 30
    anew, and the score landed on the new weights (best_step() then named a step never
    evaluated)."""
    with AsyncCheckpointer(tmp_path, mode="sync") as trainer:
        trainer.save(_state(10), 10)
        trainer.save(_state(30), 30)
        evaluator = AsyncCheckpointer(tmp_path, mode="sync")
        seen = evaluator.manifest(30).created_unix  # (read before the load)
        scored = evaluator.load(step=30)
        assert scored["step"] == 30
        trainer.discard_steps_after(10)
        trainer.save(_state(-1), 30)  # (the same number, another state)
        with pytest.raises(asyncckpt.CheckpointNotFoundError,
                           match=r"step 30 under .* was saved again since the save of "
                                 r"created_unix=.*nothing was recorded"):
            evaluator.record_metrics(30, {"acc": 0.9}, created_unix=seen)
        assert evaluator.step_metrics(30) == {}
        now = evaluator.manifest(30).created_unix
        assert evaluator.record_metrics(30, {"acc": 0.1}, created_unix=now) == {"acc": 0.1}
        with pytest.raises(CheckpointConfigError, match=r"created_unix='x'"):
            evaluator.record_metrics(30, {"acc": 0.1}, created_unix="x")  # type: ignore[arg-type]
        evaluator.close()


def test_the_cli_takes_a_flag_some_step_of_a_mixed_root_recorded_without_a_word_against_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _mixed_root(tmp_path)
    capsys.readouterr()
    assert main(["ls", str(tmp_path / "a"), "--best", "acc", "--max", "--json"]) == 0
    got = capsys.readouterr()
    assert json.loads(got.out)["best"] == 2
    assert "drop --max" not in got.err, got.err


def test_a_best_metric_that_would_rank_first_for_ever_is_warned_of_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A trial: a broken evaluation's inf accuracy made its step best for good, unwarned."""
    caplog.set_level(logging.WARNING, logger="asyncckpt")
    with AsyncCheckpointer(tmp_path, mode="sync", best_metric="acc", best_mode="max") as c:
        c.save(_state(1), 1, metrics={"acc": -INF})  # (last for ever: no harm)
        c.save(_state(2), 2, metrics={"acc": INF})
        c.save(_state(3), 3)
        c.record_metrics(3, {"acc": INF})
    said = [r.getMessage() for r in caplog.records if "for ever" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("step 2: acc=inf ranks first for ever by "
                                                 "the greatest value"), said
    caplog.clear()
    with AsyncCheckpointer(tmp_path / "loss", mode="sync", best_metric="loss") as c:
        c.save(_state(1), 1)
        c.record_metrics(1, {"loss": -INF})
    assert "loss=-inf ranks first for ever by the least value" in caplog.text


def test_an_accuracy_ranked_by_the_default_least_value_is_warned_of_before_it_counts(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A trial: keep_best=1 of best_metric="val_acc" without best_mode kept the step of the
    worst accuracy and removed the best, unwarned (the CLI's --best warned of the name)."""
    caplog.set_level(logging.WARNING, logger="asyncckpt")
    with AsyncCheckpointer(tmp_path / "acc", mode="sync", keep_last=1, keep_best=1,
                           best_metric="val_acc") as c:
        for step, acc in enumerate([0.5, 0.9, 0.6], start=1):
            c.save(_state(step), step, metrics={"val_acc": acc})
    said = [r.getMessage() for r in caplog.records if "ranks by the least" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("best_metric='val_acc' ranks by the least "
                                                 "value, as for a loss"), said
    assert "pass best_mode='max'" in said[0]
    # a loss, a mode given, or one recorded by the steps: nothing to tell
    caplog.clear()
    for name, mode in (("val_loss", None), ("top1_err", None), ("val_acc", "min")):
        with AsyncCheckpointer(tmp_path / name, mode="sync", best_metric=name,
                               best_mode=mode) as c:
            c.save(_state(1), 1, metrics={name: 1.0})
    with AsyncCheckpointer(tmp_path / "max", mode="sync", best_metric="acc",
                           best_mode="max") as c:
        c.save(_state(1), 1, metrics={"acc": 1.0})
    with AsyncCheckpointer(tmp_path / "max", mode="sync", best_metric="acc") as c:
        c.save(_state(2), 2, metrics={"acc": 2.0})
        assert c.best_step() == 2
    assert "ranks by the least" not in caplog.text


def test_metric_names_are_read_by_their_words_not_inside_others() -> None:
    """(review) The name rules that warn at a first save matched inside other words:
    "iou" in "previous", "r2" in "layer2", "win" in "window"."""
    from asyncckpt.best import reads_greater_is_better, reads_less_is_better

    for name in ("val_acc", "valAcc", "accuracy", "top1", "f1", "mAP", "val_iou", "win_rate",
                 "eval/score", "val_r2", "mIoU", "miou", "meanIoU", "val_mIoU", "valacc",
                 "bestacc", "rocauc", "sacrebleu"):
        assert reads_greater_is_better(name) and not reads_less_is_better(name), name
    for name in ("previous", "layer2", "window", "power"):
        assert not reads_greater_is_better(name) and not reads_less_is_better(name), name
    for name in ("val_loss", "top1_err", "ValError", "val_ppl", "acc_loss", "valloss",
                 "trainloss", "val_wer"):
        assert reads_less_is_better(name) and not reads_greater_is_better(name), name
