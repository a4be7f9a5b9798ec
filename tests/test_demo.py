"""examples/resume_demo.py: SIGKILL mid-run, resume, bitwise-identical losses."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

import asyncckpt
from asyncckpt import commit
from asyncckpt.storage import LocalStorage

DEMO = Path(__file__).parents[1] / "examples" / "resume_demo.py"


@pytest.fixture(scope="module")
def demo() -> ModuleType:
    spec = importlib.util.spec_from_file_location("resume_demo", DEMO)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["resume_demo"] = module
    spec.loader.exec_module(module)
    return module


def test_kill_and_resume_matches_reference(demo: ModuleType, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    ckpt_dir = tmp_path / "ckpts"
    seen: dict[str, object] = {}

    def after_kill(directory: Path) -> None:
        # Only committed steps are visible, and each one loads (with verification).
        storage = LocalStorage()
        steps = commit.committed_steps(directory, storage)
        visible = sorted(p.name for p in directory.iterdir() if p.name.startswith("step_"))
        assert visible == [commit.step_dir_name(s) for s in steps]
        # keep_last=3, plus one when the kill came between a commit and its retention
        assert 1 <= len(steps) <= 4
        assert all(s % 4 == 0 for s in steps)
        for s in steps:
            tree = asyncckpt.load(directory, step=s)
            assert tree["train"]["step"] == s
            assert isinstance(tree["model"]["0.weight"], torch.Tensor)
            assert tree["model"]["0.weight"].shape == (demo.HIDDEN, demo.IN_FEATURES)
        for name in commit.abandoned_dirs(directory, storage):
            assert name.startswith(".step_")  # an interrupted save or deletion, never read
        seen["steps"] = steps

    code = demo.main(["--steps", "24", "--every", "4", "--kill-at", "17", "--dir", str(ckpt_dir)],
                     on_killed=after_kill)
    out = capsys.readouterr().out
    assert code == 0, out
    steps = seen["steps"]
    assert isinstance(steps, list)
    latest = steps[-1]
    m = re.search(r"MATCH: all (\d+) losses after step (\d+)", out)
    assert m is not None, out
    assert int(m.group(2)) == latest and int(m.group(1)) == 24 - latest
    rows = re.findall(r"^\s+(\d+)\s+(\S+)\s+(\S+)\s+(yes|NO)$", out, flags=re.M)
    assert [int(r[0]) for r in rows] == list(range(latest + 1, 25))
    assert all(r[1] == r[2] and r[3] == "yes" for r in rows)
    assert "SIGKILL" in out and "equal the reference" in out
    # the resumed run went on checkpointing: 24 is the latest step now, 3 kept
    assert commit.committed_steps(ckpt_dir, LocalStorage()) == [16, 20, 24]
    assert commit.abandoned_dirs(ckpt_dir, LocalStorage()) == []


def test_compare_flags_any_difference(demo: ModuleType) -> None:
    ref = {1: (0.5).hex(), 2: (0.25).hex(), 3: (0.125).hex()}
    assert demo.compare(ref, dict(ref), range(1, 4)) == []
    off = {**ref, 2: (0.25 + 2**-50).hex()}  # one ulp-scale difference
    assert demo.compare(ref, off, range(1, 4)) == [2]
    assert demo.compare(ref, {1: ref[1]}, range(1, 4)) == [2, 3]


@pytest.mark.parametrize("argv,named", [
    (["--steps", "10", "--kill-at", "12"], "--kill-at"),
    (["--steps", "10", "--every", "5", "--kill-at", "3"], "--kill-at"),
    (["--every", "0"], "--every"), (["--steps", "1"], "--steps"),
    # (a trial: told "--kill-at must lie ...: 12 < KILL_AT < 12", of a --kill-at not given)
    (["--steps", "12", "--every", "12"], "--every 12 leaves no step to kill at"),
    (["--steps", "12", "--every", "20", "--kill-at", "6"], "use --every < 11")])
def test_bad_options(demo: ModuleType, argv: list[str], named: str,
                     capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(argv) == 2
    assert named in capsys.readouterr().err


def test_refuses_non_empty_dir(demo: ModuleType, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "old").write_text("x")
    assert demo.main(["--dir", str(tmp_path)]) == 2
    assert "not empty" in capsys.readouterr().err


_MIGRATING = Path(__file__).parents[1] / "docs" / "migrating.md"


@pytest.mark.parametrize("index", [0, 1, 2, 3])
def test_every_block_of_the_migration_guide_prints_what_it_says(
        index: int, tmp_path: Path) -> None:
    """docs/migrating.md says its blocks run as they are; each ends in a print whose
    output its comment gives."""
    import subprocess

    blocks = re.findall(r"```python\n(.*?)```", _MIGRATING.read_text(), re.S)
    assert len(blocks) == 4
    code = blocks[index]
    said = [m.group(1).strip() for m in re.finditer(r"print\(.*\)\s*#\s*(.+)", code)]
    assert said, code
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:len(said)] == said, (out.stdout, said)
