"""Smoke test of benchmarks/bench_manifest.py: a small run times every kind of save and
sees the deltas smaller than the whole records, and the manifest's short chunks smaller than
version 2's objects."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _bench import import_bench, positive


def test_small_run_times_every_kind_of_save(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    bench = import_bench("bench_manifest")
    out = tmp_path / "results.json"
    assert bench.main(["--world", "3", "--tensors", "20", "--repeats", "2",
                       "--json", str(out)]) == 0
    res = json.loads(out.read_text())["run"]
    for key in ("whole_merge", "first_save", "steady_save", "skeleton_changed", "parse",
                "parse_v3", "parse_v2", "held", "held_v3"):
        assert len(res[key]) == 2 and all(map(positive, res[key])), key
    sizes = res["record_bytes"]
    assert sizes["delta"] < sizes["delta_with_skeleton"] < sizes["whole"]
    assert 0 < res["manifest_bytes"] <= res["manifest_bytes_v3"] < res["manifest_bytes_v2"]
    out = capsys.readouterr().out
    assert "| steady save (deltas, same skeletons) |" in out
    assert "| format version 2 (every chunk an object) |" in out
