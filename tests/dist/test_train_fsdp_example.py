"""examples/train_fsdp.py under torchrun (CPU, gloo, FSDP2): crash with SIGKILL, resume at
the same and at a different world size, and end where an uninterrupted run ends."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from _torch_compat import fsdp2_on_cpu
from safetensors.torch import load_file

import asyncckpt
from asyncckpt.export import export_safetensors
from asyncckpt.tree import flatten

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.distributed.is_available()
                       or not torch.distributed.is_gloo_available(),
                       reason="needs torch.distributed with gloo"),
    pytest.mark.skipif(not fsdp2_on_cpu(), reason=f"torch {torch.__version__}: no FSDP2 on "
                       "CPU (the public fully_shard, torch 2.6 on)"),
]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_fsdp.py"
STEPS, EVERY, KILL_AT = 12, 3, 7
RUN_TIMEOUT_S = 90
RTOL, ATOL = 1e-5, 1e-6


@dataclass
class Run:
    rc: int
    out: str
    err: str
    losses: dict[int, float] = field(default_factory=dict)
    resumed: tuple[int, int, int] | None = None  # (step, saved world size, world size)
    done: int | None = None
    init: str | None = None

    def describe(self) -> str:
        return f"exit {self.rc}\n--- stdout\n{self.out[-3000:]}\n--- stderr\n{self.err[-3000:]}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(nproc: int, directory: Path, *extra: str) -> Run:
    """Run the example under torchrun in its own process group, with a hard timeout."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(EXAMPLE), "--dir", str(directory), "--steps", str(STEPS), "--every", str(EVERY),
           *extra]
    # (TMPDIR: torchrun makes a torchelastic_* directory there and never removes it; the
    # suite's runs would otherwise leave theirs in /tmp)
    scratch = directory.parent / f"tmp-{directory.name}"
    scratch.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "TMPDIR": str(scratch)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"torchrun {nproc} ranks timed out after {RUN_TIMEOUT_S}s:\n{out}\n{err}")
    run = Run(proc.returncode, out, err)
    for line in out.splitlines():
        if m := re.fullmatch(r"loss (\d+) (\S+)", line):
            run.losses[int(m.group(1))] = float(m.group(2))
        elif m := re.fullmatch(r"resume (\d+) (\d+) (\d+)", line):
            run.resumed = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
        elif m := re.fullmatch(r"done (\d+)", line):
            run.done = int(m.group(1))
        elif m := re.fullmatch(r"init (.+)", line):
            run.init = m.group(1)
    return run


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    return dict(flatten(asyncckpt.load(directory)).tensors)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The uninterrupted 2-rank reference and the 2-rank run killed after step KILL_AT."""
    base = tmp_path_factory.mktemp("fsdp")
    ref = torchrun(2, base / "ref")
    assert ref.rc == 0, ref.describe()
    killed = torchrun(2, base / "killed", "--kill-at", str(KILL_AT))
    return {"base": base, "ref": ref, "killed": killed}


def test_reference_and_killed_runs(runs: dict[str, object]) -> None:
    base, ref, killed = runs["base"], runs["ref"], runs["killed"]
    assert isinstance(base, Path) and isinstance(ref, Run) and isinstance(killed, Run)
    assert sorted(ref.losses) == list(range(1, STEPS + 1)) and ref.done == STEPS
    assert ref.resumed is None
    assert ref.losses[STEPS] < 0.6 * ref.losses[1], ref.losses  # it does learn
    ckpt = asyncckpt.AsyncCheckpointer(base / "ref")
    assert ckpt.steps() == [STEPS - EVERY, STEPS]  # keep_last=2
    m = ckpt.manifest()
    assert m.world_size == 2 and len(m.files) == 2
    assert m.metrics == {"loss": ref.losses[STEPS]}  # recorded with the save, exactly
    # the weights are really sharded: every rank file holds a piece of the first layer
    assert {c.file for c in m.tensors["model/0.weight"].chunks} == set(m.files)
    assert asyncckpt.load(base / "ref")["step"] == STEPS

    assert killed.rc != 0, killed.describe()
    assert killed.done is None and max(killed.losses) == KILL_AT, killed.describe()
    # same world size and data before the crash: the very same losses
    assert all(killed.losses[s] == ref.losses[s] for s in killed.losses)
    steps = asyncckpt.AsyncCheckpointer(base / "killed").steps()
    assert steps and set(steps) <= {EVERY * k for k in range(1, KILL_AT // EVERY + 1)}
    assert len(steps) <= 2


@pytest.mark.parametrize("world", [1, 3, 2])
def test_resume_at_world_size(world: int, runs: dict[str, object], tmp_path: Path) -> None:
    base, ref = runs["base"], runs["ref"]
    assert isinstance(base, Path) and isinstance(ref, Run)
    directory = tmp_path / "resumed"
    shutil.copytree(base / "killed", directory)
    start = asyncckpt.AsyncCheckpointer(directory).latest_step()
    assert start is not None

    run = torchrun(world, directory)
    assert run.rc == 0, run.describe()
    assert run.resumed == (start, 2, world), run.describe()
    assert sorted(run.losses) == list(range(start + 1, STEPS + 1)) and run.done == STEPS
    for s, loss in run.losses.items():
        if world == 2:
            assert loss == ref.losses[s], (s, loss, ref.losses[s])
        else:
            assert loss == pytest.approx(ref.losses[s], rel=RTOL, abs=ATOL), s

    resumed = asyncckpt.load(directory)
    assert resumed["step"] == STEPS
    assert asyncckpt.AsyncCheckpointer(directory).manifest().world_size == world
    want, got = tensors(base / "ref"), tensors(directory)
    assert sorted(got) == sorted(want)
    for key in want:  # model and optimizer state alike
        assert got[key].dtype == want[key].dtype and got[key].shape == want[key].shape, key
        if world == 2:
            assert torch.equal(got[key], want[key]), key
        else:
            assert torch.allclose(got[key], want[key], rtol=RTOL, atol=ATOL), (
                key, (got[key] - want[key]).abs().max().item())
    assert resumed["optim"]["param_groups"][0]["lr"] == 0.01

    # the exported model (one safetensors file, whole tensors) matches the reference too
    out = tmp_path / "model.safetensors"
    report = export_safetensors(directory, out, prefix="model/", strip_prefix=True)
    exported = load_file(out)
    assert sorted(exported) == sorted(k.removeprefix("model/") for k in want
                                      if k.startswith("model/"))
    assert {t.chunks for t in report.tensors} <= set(range(1, world + 1))
    for name, t in exported.items():
        assert torch.equal(t, got["model/" + name]), name
        assert torch.allclose(t, want["model/" + name], rtol=RTOL, atol=ATOL), name


def test_sigterm_to_one_rank_saves_that_step_and_resumes_exactly(
        runs: dict[str, object], tmp_path: Path) -> None:
    ref = runs["ref"]
    assert isinstance(ref, Run)
    term_at = EVERY + 2  # not a save step: the preempted save is the only one of it
    directory = tmp_path / "preempted"
    run = torchrun(2, directory, "--term-at", str(term_at))
    assert run.rc == 0, run.describe()
    assert f"preempted {term_at}" in run.out.splitlines() and run.done is None, run.describe()
    assert max(run.losses) == term_at, run.describe()  # stopped at the end of that step
    assert asyncckpt.AsyncCheckpointer(directory).steps() == [EVERY, term_at]
    assert asyncckpt.load(directory)["step"] == term_at

    resumed = torchrun(2, directory)
    assert resumed.rc == 0 and resumed.resumed == (term_at, 2, 2), resumed.describe()
    assert resumed.done == STEPS
    for s, loss in {**run.losses, **resumed.losses}.items():
        assert loss == ref.losses[s], (s, loss, ref.losses[s])


def test_a_new_run_starts_from_exported_bf16_weights_at_another_world_size(
        runs: dict[str, object], tmp_path: Path) -> None:
    import importlib.util

    from torch import nn

    base, ref = runs["base"], runs["ref"]
    assert isinstance(base, Path) and isinstance(ref, Run)
    weights = tmp_path / "model.safetensors"
    export_safetensors(base / "ref", weights, prefix="model/", strip_prefix=True, dtype="bf16")
    run = torchrun(3, tmp_path / "fresh", "--init-from", str(weights))
    assert run.rc == 0 and run.init == str(weights) and run.resumed is None, run.describe()
    # its first loss is that of the exported weights (bf16, cast to fp32) on batch 1
    spec = importlib.util.spec_from_file_location("train_fsdp_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    plain = nn.Sequential(nn.Linear(ex.IN_FEATURES, ex.HIDDEN), nn.Tanh(),
                          nn.Linear(ex.HIDDEN, ex.HIDDEN), nn.Tanh(),
                          nn.Linear(ex.HIDDEN, ex.OUT_FEATURES))
    asyncckpt.load_safetensors(weights, plain)
    assert plain[0].weight.dtype == torch.float32
    x, y = ex.make_batch(1, 0, 1)
    with torch.no_grad():
        want = nn.functional.mse_loss(plain(x), y).item()
    assert run.losses[1] == pytest.approx(want, rel=RTOL, abs=ATOL)
    assert run.losses[1] < 0.6 * ref.losses[1]  # trained weights, not the seed's
