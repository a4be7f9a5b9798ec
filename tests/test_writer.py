"""What a rank of a group leaves behind when its save fails (writer._abort)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from asyncckpt.dist import DistContext
from asyncckpt.plan import plan_writes
from asyncckpt.staging import StagingProgress
from asyncckpt.storage import LocalStorage
from asyncckpt.tree import flatten
from asyncckpt.writer import SaveJob, _abort


def _peer_job(root: Path, store: Any, *, announced: bool, rejected: bool) -> SaveJob:
    flat = flatten({"w": torch.ones(4)})
    plan = plan_writes(flat.tensors, "rank_00001.safetensors")
    ctx = DistContext(rank=1, world_size=2, store=store, namespace="t", timeout_s=5)
    job = SaveJob(root=root, step=3, plan=plan, arena=None,  # type: ignore[arg-type]
                  progress=StagingProgress(), flat=flat, ctx=ctx, token="abc",
                  storage=LocalStorage(), keep_last=None, block_bytes=1 << 22,
                  library_version="test", user_metadata={}, direct_io=False,
                  started=time.perf_counter(), tag="s3.1", announced=announced,
                  rejected=rejected)
    job.tmp = job.tmp_path
    job.tmp.mkdir(parents=True)
    (job.tmp / plan.file).write_bytes(b"shard")
    return job


@pytest.mark.parametrize(("announced", "rejected", "kept"), [
    (True, False, True),    # durable, announced, no verdict heard: the coordinator may commit
    (True, True, False),    # the coordinator's verdict said no: take the file out
    (False, False, False),  # failed before its file was durable
])
def test_peer_abort_keeps_an_announced_file_until_a_verdict(
        tmp_path: Path, announced: bool, rejected: bool, kept: bool) -> None:
    store = dist.HashStore()
    job = _peer_job(tmp_path, store, announced=announced, rejected=rejected)
    shard = job.tmp_path / job.plan.file
    _abort(job, TimeoutError("no verdict"))
    assert shard.exists() == kept
    assert job.tmp_path.exists() == kept  # the directory goes with its last file
    if not announced:  # the failure is posted where the coordinator waits for it
        for part in ("record", "done"):
            got = json.loads(store.get(job.ctx.key("s3.1", part, 1)))
            assert "no verdict" in got["error"], (part, got)
