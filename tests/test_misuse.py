"""Arguments a user may get wrong, refused where they are given with a CheckpointError
that names them (a trial misused every public call: these escaped as AttributeError or
TypeError, or were taken without a word)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import asyncckpt
from asyncckpt import CheckpointConfigError
from asyncckpt.export import export_safetensors


@pytest.mark.parametrize("storage", ["local", object()])
def test_a_storage_that_is_no_storage_is_refused_at_construction(
        tmp_path: Path, storage: object) -> None:
    with pytest.raises(CheckpointConfigError, match=r"storage=.* is no Storage: it lacks "
                       r"makedirs, write_arena, write_bytes, fsync_dir\.\.\."):
        asyncckpt.AsyncCheckpointer(tmp_path, storage=storage)  # type: ignore[arg-type]
    assert not list(tmp_path.iterdir())


def test_progress_that_is_no_function_is_refused_before_anything_is_read(
        tmp_path: Path) -> None:
    asyncckpt.save({"w": torch.ones(3)}, tmp_path / "c", step=1)
    target = {"w": torch.zeros(3)}
    calls = [lambda: asyncckpt.load(tmp_path / "c", target, progress=5),
             lambda: asyncckpt.AsyncCheckpointer(tmp_path / "c").load(target, progress="x"),
             lambda: export_safetensors(tmp_path / "c", tmp_path / "o.safetensors",
                                        progress=1)]
    for call in calls:
        with pytest.raises(CheckpointConfigError, match="pass a function of "
                                                        r"\(done, total\)"):
            call()  # type: ignore[no-untyped-call]
    assert not target["w"].any() and not (tmp_path / "o.safetensors").exists()
    export_safetensors(tmp_path / "c", tmp_path / "a.safetensors")
    with pytest.raises(CheckpointConfigError, match=r"progress=1\.0: pass a function"):
        asyncckpt.load_safetensors(tmp_path / "a.safetensors", target,
                                   progress=1.0)  # type: ignore[arg-type]
    seen: list[tuple[int, int]] = []
    asyncckpt.load(tmp_path / "c", target, progress=lambda d, t: seen.append((d, t)))
    assert seen and seen[-1][0] == seen[-1][1] and target["w"].all()


@pytest.mark.parametrize("rank", ["a", -1, True, 1.5])
def test_rng_state_refuses_a_rank_that_is_no_rank(rank: object) -> None:
    with pytest.raises(CheckpointConfigError, match=r"RNGState\(rank=.*\): pass the rank as "
                                                    "a non-negative int"):
        asyncckpt.RNGState(rank=rank)  # type: ignore[arg-type]
    assert asyncckpt.RNGState(rank=2).state_dict()["ranks"].keys() == {2}


@pytest.mark.skipif(torch.cuda.is_available(), reason="tells of CUDA parts without CUDA")
def test_restoring_cuda_generators_without_cuda_is_told(
        caplog: pytest.LogCaptureFixture) -> None:
    state = asyncckpt.capture_rng_state()
    state["cuda"] = [torch.zeros(16, dtype=torch.uint8)]
    wanted = torch.rand(3)
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        asyncckpt.restore_rng_state(state)
    assert torch.equal(torch.rand(3), wanted)  # (the rest is restored)
    assert ("the given generator state holds CUDA generators, which are not restored: this "
            "process has no CUDA device") in caplog.text
    caplog.clear()
    del state["cuda"]
    asyncckpt.restore_rng_state(state)
    assert "CUDA" not in caplog.text


@pytest.mark.parametrize("new", ["x/", "/x", "x//y", ""])
def test_key_map_onto_a_path_with_an_empty_key_is_refused(tmp_path: Path, new: str) -> None:
    asyncckpt.save({"m": {"a": torch.ones(1)}}, tmp_path, step=1)
    with pytest.raises(CheckpointConfigError, match="a path with an empty key in it"):
        asyncckpt.load(tmp_path, key_map={"m/a": new})
    assert asyncckpt.load(tmp_path, key_map={"m/a": "x/%00"})["x"] == {"": torch.ones(1)}


@pytest.mark.parametrize("kwargs, why", [
    ({"rank": "a", "world_size": 2}, "rank='a': pass a whole number"),
    ({"rank": 0, "world_size": True}, "world_size=True: pass a whole number"),
    ({"rank": 0, "world_size": 0}, "world_size=0: a group has one rank or more"),
    ({"rank": 2, "world_size": 2}, "rank=2 is outside world_size=2"),
])
def test_a_rank_or_world_size_that_cannot_be_is_refused(tmp_path: Path, kwargs: dict[str, object],
                                                         why: str) -> None:
    with pytest.raises(CheckpointConfigError, match=why):
        asyncckpt.AsyncCheckpointer(tmp_path, **kwargs)  # type: ignore[arg-type]


def test_metadata_takes_numpy_and_0_dim_tensor_numbers_as_metrics_do(tmp_path: Path) -> None:
    # (an integrator passed the same np.int64 epoch and 0-dim tensor step to metrics= and
    # metadata=: metadata refused them, np.bool_ as "of type bool: ... or bool")
    import numpy as np

    with asyncckpt.AsyncCheckpointer(tmp_path) as ck:
        ck.save({"w": torch.ones(1)}, 1, metadata={
            "a": np.int64(3), "b": np.float32(0.5), "c": np.bool_(True), "d": torch.tensor(7),
            "e": 1e-3, "f": torch.tensor(True)})
        assert ck.manifest(1).user_metadata == {"a": "3", "b": "0.5", "c": "True", "d": "7",
                                                "e": "0.001", "f": "True"}
        for bad in ([1], torch.ones(2), np.complex64(1j), torch.tensor(1j),
                    torch.empty((), device="meta")):  # (item() of it raised RuntimeError)
            with pytest.raises(CheckpointConfigError, match=r"metadata\['x'\] is of type "):
                ck.save({"w": torch.ones(1)}, 2, metadata={"x": bad})
        assert ck.steps() == [1]
