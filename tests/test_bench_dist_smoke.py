"""Smoke test of the 2-rank section of the benchmark (benchmarks/bench_dist.py): --quick
runs end to end through bench_checkpoint.main, measures everything, and checks its loads."""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from _bench import import_bench, needs_dcp_stager


def _bench() -> ModuleType:
    return import_bench("bench_checkpoint")


def _measured(tree: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Every value under a key ending in ``_s`` or ``_bytes`` (seconds, sizes), at any depth."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            p = f"{path}/{k}"
            if str(k).endswith(("_s", "_bytes")):
                yield from _leaves(v, p)
            else:
                yield from _measured(v, p)
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _measured(v, f"{path}/{i}")


def _leaves(tree: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{path}/{k}")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _leaves(v, f"{path}/{i}")
    else:
        yield path, tree


@pytest.mark.slow
@needs_dcp_stager()
def test_quick_dist_section(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = _bench()
    out = tmp_path / "results.json"
    argv = ["--quick", "--only", "dist", "--world", "2", "--dir", str(tmp_path),
            "--json", str(out)]
    assert bench.main(argv) == 0

    res = json.loads(out.read_text())
    assert res["meta"]["sections"] == ["dist"]
    d = res["dist"]
    assert d["world"] == 2 and d["state_bytes"] > 0 and len(d["rank_bytes"]) == 2
    # each rank holds half of every sharded tensor, and every (replicated) step scalar
    assert d["state_bytes"] <= sum(d["rank_bytes"]) <= d["state_bytes"] + 4 * d["tensors"]

    measured = list(_measured(d))
    assert len(measured) > 100
    bad = [(p, v) for p, v in measured
           if not (isinstance(v, (int, float)) and not isinstance(v, bool)
                   and math.isfinite(v) and v > 0)]
    assert not bad, bad[:10]

    # what the tables are made of: every rank, every library, every load
    for label in ("asyncckpt async", "DCP async_save"):
        s = d["saves"][label]
        assert set(s["ranks"]) == {"0", "1"}
        for r in ("0", "1"):
            for key in ("blocked_s", "staged_s", "durable_s"):
                assert len(s["ranks"][r][key]) == 1, (label, r, key)
        assert len(s["global_durable_s"]) == 1
    assert "first_prepared" in d["saves"]["asyncckpt async"]["ranks"]["0"]
    # every timed asyncckpt save had its limits measured beside it
    ours = d["saves"]["asyncckpt async"]
    assert len(ours["paired_write_global_s"]) == 1 and ours["paired_write_global_s"][0] > 0
    assert all(len(v) == 1 and v[0] > 0 for v in ours["paired_copy_s"].values())
    for lib in ("asyncckpt", "DCP"):
        for case in ("same_shard0", "reshard_shard1"):
            for temp in ("cold", "hot"):
                assert len(d["loads"][lib][case][f"{temp}_global_s"]) == 1, (lib, case, temp)
    whole = d["loads"]["asyncckpt"]["whole_one_process"]
    assert whole["cold_s"] and whole["hot_s"]

    # the loads were checked against the originals: every load, on every rank
    for r in ("0", "1"):
        checked = d["checked"][r]
        assert set(checked) == {f"{lib} {case} {temp}" for lib in ("asyncckpt", "DCP")
                                for case in ("same_shard0", "reshard_shard1")
                                for temp in ("cold", "hot")}
        assert all(n >= 5 for n in checked.values()), checked
    assert d["checked"]["whole_one_process"] >= 10

    verdicts = {t["verdict"] for t in d["targets"]}
    assert verdicts <= {"PASS", "MISS"} and len(d["targets"]) >= 5

    table = capsys.readouterr().out
    assert "### World size 2" in table and "#### Targets (world size 2)" in table
    assert "(b) resharded into Shard(1)" in table
    # the run cleans up after itself: nothing but the JSON is left in --dir
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_world_must_be_at_least_two(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        _bench().main(["--only", "dist", "--world", "1"])
    assert info.value.code == 2  # argparse's usage error, before any rank starts
    assert "error: need --world >= 2" in capsys.readouterr().err


def test_probes_rebuild_the_saved_values() -> None:
    """The seeded shards put back together are what a rank holds, for any world size."""
    _bench()
    bd = importlib.import_module("bench_dist")
    leaves = bd.layout(1 << 16, 16)
    for leaf in bd.probe_leaves(leaves):
        for world in (2, 3):
            full = bd.full_values(leaf, world)
            assert tuple(full.shape) == leaf.shape
            if leaf.shape:
                lo, n = bd.chunk(leaf.shape[0], world, world - 1)
                assert full[lo:lo + n].equal(bd.local_values(leaf, world, world - 1))
