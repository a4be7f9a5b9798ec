"""Smoke test of benchmarks/bench_many.py: a small run measures every method, and a
method that loads wrong bytes is caught rather than timed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _bench import import_bench, positive


@pytest.mark.slow
def test_small_run_measures_every_method(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                         ) -> None:
    bench = import_bench("bench_many")
    out = tmp_path / "results.json"
    assert bench.main(["--layers", "50", "--side", "8", "--repeats", "1", "--dir", str(tmp_path),
                       "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["tensors"] == 200 and res["bytes"] == 50 * (3 * 8 * 8 * 4 + 4)
    assert all(positive(v) for v in res["limits"].values())
    methods = res["methods"]
    assert sorted(methods) == ["asyncckpt", "dcp", "safetensors", "torch_save"]
    for key in ("blocked", "durable", "load_in_place", "load_fresh", "first_blocked"):
        assert len(methods["asyncckpt"][key]) == 1 and positive(methods["asyncckpt"][key][0])
    assert positive(methods["dcp"]["load_in_place"][0])
    report = capsys.readouterr().out
    assert "| asyncckpt async |" in report and "µs/tensor" in report
    assert list(tmp_path.iterdir()) == [out]  # its work directory is removed


def test_a_wrong_load_is_caught() -> None:
    bench = import_bench("bench_many")
    state = bench.build_state(3, 4)
    got = {k: v.clone() for k, v in bench.leaves(state).items()}
    bench.check_equal(state, got, "clone")  # equal: passes
    got["optim/state/1/exp_avg"][0, 0] += 1
    with pytest.raises(AssertionError, match="1 tensors differ"):
        bench.check_equal(state, got, "damaged")
    del got["model/layers.0.weight"]
    with pytest.raises(AssertionError, match="keys differ"):
        bench.check_equal(state, got, "short")


def test_options_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    bench = import_bench("bench_many")
    with pytest.raises(SystemExit) as exc:
        bench.main(["--only", "asyncckpt,pickle"])
    assert exc.value.code == 2 and "unknown method(s) pickle" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--layers", "0"])
    assert torch.equal(bench.build_state(2, 3)["model"]["layers.1.weight"],
                       bench.build_state(2, 3)["model"]["layers.1.weight"])  # seeded
