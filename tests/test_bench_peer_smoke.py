"""Smoke test of the peer-recovery section of the benchmark (benchmarks/bench_peer.py):
--quick runs end to end through bench_checkpoint.main, measures the loopback limit and the
receives, and checks what every receive got against the sender's values."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from _bench import import_bench


def _bench() -> ModuleType:
    return import_bench("bench_checkpoint")


def _positive(xs: Any) -> bool:
    return (isinstance(xs, list) and len(xs) >= 1
            and all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in xs))


@pytest.mark.slow
def test_quick_peer_section(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = _bench()
    out = tmp_path / "results.json"
    argv = ["--quick", "--only", "peer", "--dir", str(tmp_path), "--json", str(out)]
    assert bench.main(argv) == 0

    res = json.loads(out.read_text())
    assert res["meta"]["sections"] == ["peer"]
    p = res["peer"]
    assert p["state_bytes"] > 0 and p["tensors"] >= 16

    # the loopback limit: every stream count measured, the fastest named
    assert set(p["limits"]) == {"1", "2", "4", "8"}
    for rec in p["limits"].values():
        for key in ("recv_s", "send_s"):
            assert _positive(rec[key]), (key, rec)
    assert p["limit_s"] > 0 and str(p["limit_streams"]) in p["limits"]

    # the receives that always run, with positive times
    methods = p["methods"]
    must = {"in place, num_chunks=8", "fresh (no target), num_chunks=8",
            "arena: ckpt.serve + save_async, num_chunks=8"}
    assert must <= set(methods), sorted(methods)
    for label, m in methods.items():
        assert _positive(m["recv_s"]), (label, m)
        assert all(b >= 0 for b in m["blocked_s"]), (label, m)
    assert _positive(methods["arena: ckpt.serve + save_async, num_chunks=8"]["durable_s"])
    assert list(p["profiles"]) == ["the library as is"]
    for prof in p["profiles"].values():
        assert prof["connections"] and prof["server_checksum_s"] > 0
    assert _positive(p["send_blocked_s"])

    # torchft: measured, or the reason it was not
    ft = p["torchft"]
    if not any(label.startswith("torchft") for label in methods):
        assert ft.get("error") or ft.get("import")

    # what was received was checked against the sender's values, every receive
    checked = p["checked"]
    assert len(p["probes"]) >= 5
    for label in must:
        assert checked.get(label, 0) >= len(p["probes"]), (label, checked)
    assert sum(checked.values()) >= len(p["probes"]) * len(must)

    verdicts = {t["verdict"] for t in p["targets"]}
    assert verdicts <= {"PASS", "MISS", "n/a"} and len(p["targets"]) >= 5

    table = capsys.readouterr().out
    assert "### Peer recovery" in table and "**the loopback limit**" in table
    assert "#### Targets (peer recovery)" in table
    # the run cleans up after itself: nothing but the JSON is left in --dir
    assert [q.name for q in tmp_path.iterdir()] == ["results.json"]
