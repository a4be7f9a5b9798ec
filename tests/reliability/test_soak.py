"""Soak: 200 consecutive async saves leak nothing.

Resident memory, open file descriptors and threads are sampled every 20 saves after
a warm-up; they must stay flat (small noise allowed). At the end no temporary
directory is left and only ``keep_last`` steps remain, each loading bit-exact.
"""

from __future__ import annotations

import gc
import os
import threading
from pathlib import Path
from typing import Any

import psutil

import asyncckpt

from ._crash_worker import same_tree, state_for

SAVES = 200
WARMUP = 20
RSS_NOISE = 24 << 20  # bytes
FD_NOISE = 2
THREAD_NOISE = 1


def sample() -> dict[str, int]:
    gc.collect()
    return {"rss": int(psutil.Process().memory_info().rss),
            "fds": len(os.listdir("/proc/self/fd")),
            "threads": threading.active_count(),
            "tasks": len(os.listdir("/proc/self/task"))}


def test_200_async_saves_stay_flat(tmp_path: Path, figures: Any) -> None:
    samples: list[dict[str, int]] = []
    ckpt = asyncckpt.AsyncCheckpointer(tmp_path, mode="async", keep_last=2)
    for step in range(1, SAVES + 1):
        ckpt.save_async(state_for(step), step)  # waits for the previous save first
        if step % 50 == 0:  # a training job reads back now and then
            ckpt.wait()
            latest = ckpt.latest_step()
            assert latest is not None
            assert same_tree(ckpt.load(step=latest), state_for(latest)) is None
        if step >= WARMUP and step % 20 == 0:
            ckpt.wait()
            samples.append(sample())
    ckpt.wait()
    base = samples[0]
    worst = {k: max(s[k] for s in samples) - base[k] for k in base}
    print(f"\n{SAVES} saves; growth after warm-up: rss {worst['rss'] / 1e6:.1f} MB, "
          f"fds {worst['fds']}, threads {worst['threads']}, tasks {worst['tasks']}")
    assert worst["rss"] < RSS_NOISE, [s["rss"] for s in samples]
    assert worst["fds"] <= FD_NOISE, [s["fds"] for s in samples]
    assert worst["threads"] <= THREAD_NOISE, [s["threads"] for s in samples]
    assert worst["tasks"] <= THREAD_NOISE, [s["tasks"] for s in samples]
    assert ckpt.steps() == [SAVES - 1, SAVES]
    for s in ckpt.steps():
        assert same_tree(ckpt.load(step=s), state_for(s)) is None
    ckpt.close()
    assert sorted(os.listdir(tmp_path)) == [".asyncckpt.lock", "step_000000199",
                                            "step_000000200"]
    after = sample()
    assert after["threads"] <= base["threads"], "closing left threads behind"
    assert after["fds"] <= base["fds"], "closing left file descriptors open"
    figures.add("soak_saves", SAVES)
    figures.set("soak_growth", {"rss_mb": round(worst["rss"] / 1e6, 1), "fds": worst["fds"],
                                "threads": worst["threads"]})
