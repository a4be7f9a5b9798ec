"""Smoke test of benchmarks/bench_checkpoint.py: the --quick run works end to end."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from _bench import import_bench, needs_dcp_stager
from _bench import positive as _positive


def _bench() -> ModuleType:
    return import_bench("bench_checkpoint")


@pytest.mark.slow
@needs_dcp_stager()
def test_quick_run_measures_every_section(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                          ) -> None:
    bench = _bench()
    out = tmp_path / "results.json"
    assert bench.main(["--quick", "--dir", str(tmp_path), "--json", str(out)]) == 0

    res = json.loads(out.read_text())
    assert sorted(res["meta"]["sections"]) == sorted(bench.SECTIONS)
    assert res["meta"]["state_bytes"] > 0

    limits = res["limits"]["median"]
    for key in ("copy_s", "odirect_write_s", "cold_read_s", "hot_read_s"):
        assert _positive(limits[key]), key

    methods = res["methods"]
    expected = [label for label, _, _ in bench.ASYNCCKPT_MODES]
    expected += ["torch.save", "safetensors", "asyncckpt.load_safetensors", "DCP async_save"]
    assert sorted(methods) == sorted(expected)
    for name, m in methods.items():
        for key in ("blocked_s", "staged_s", "durable_s", "load_cold_s", "load_hot_s"):
            assert _positive(m["median"][key]), (name, key)
        # every save had the limits measured beside it, and the ratios follow from them
        for key in ("paired_copy_s", "paired_write_s", "paired_read_s"):
            assert len(m[key]) == len(m["blocked_s"]) and all(map(_positive, m[key])), key
        assert m["paired_ratio"]["durable_write"] == pytest.approx(
            m["durable_s"][0] / m["paired_write_s"][0])

    mem = res["memory"]
    assert _positive(mem["max_extra"]) and _positive(mem["first_blocked_s"])
    assert len(mem["blocked_s"]) == mem["saves"]

    verdicts = {t["verdict"] for t in res["targets"]}
    assert verdicts <= {"PASS", "MISS", "n/a"} and verdicts & {"PASS", "MISS"}

    table = capsys.readouterr().out
    assert "### Targets" in table and "| asyncckpt async |" in table
    # the run cleans up after itself: nothing but the JSON is left in --dir
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_only_selects_sections(tmp_path: Path) -> None:
    bench = _bench()
    out = tmp_path / "r.json"
    argv = ["--quick", "--dir", str(tmp_path), "--json", str(out), "--only", "limits"]
    assert bench.main(argv) == 0
    res = json.loads(out.read_text())
    assert res["meta"]["sections"] == ["limits"]
    assert not res["methods"] and "memory" not in res


def test_rejects_unknown_section(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        _bench().main(["--only", "nonsense"])
    assert info.value.code == 2  # argparse's usage error, before anything runs
    assert "error: unknown sections ['nonsense']; use limits, asyncckpt" in \
        capsys.readouterr().err


def test_run_folders_of_killed_runs_are_removed_and_live_ones_kept(tmp_path: Path) -> None:
    """A run killed by a timeout leaves gigabytes behind (37 GB had piled up)."""
    import os
    import subprocess

    bench = _bench()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = tmp_path / f"run-20260101-000000-{gone.pid}"
    live = tmp_path / f"run-20260101-000001-{os.getpid()}"
    other = tmp_path / "notes"
    for d in (dead, live, other):
        (d / "step").mkdir(parents=True)
    bench._remove_dead_runs(tmp_path)
    assert not dead.exists() and live.exists() and other.exists()


def test_memory_targets_are_said_to_be_not_run_only_when_they_were_not() -> None:
    bench = _bench()
    mem = {"max_extra": 1, "saves": 2, "growth": 0, "flat_tolerance": 1, "flat": True,
           "first_blocked_s": 1.0, "later_blocked_median_s": 1.0}
    names = [t.name for t in bench.evaluate_targets({"memory": mem}, 10)]
    assert "memory targets" not in names and any("extra RSS" in n for n in names), names
    names = [t.name for t in bench.evaluate_targets({}, 10)]
    assert "memory targets" in names, names
