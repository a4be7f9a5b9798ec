"""PreemptionWatch on two real ranks: a SIGTERM to one rank stops both at the same step,
where they save together; a rank that does not join should_stop is timed out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from _harness import RankCtx, run_ranks

MODULE = "test_dist_preemption"
TERM_AT = 3  # rank 1 gets SIGTERM during this step


def test_sigterm_on_one_rank_stops_every_rank_at_the_same_step(tmp_path: Path) -> None:
    runs = run_ranks(MODULE, "agree_worker", 2, tmp_path / "run", timeout_s=90,
                     args={"root": str(tmp_path / "ck")})
    for r, run in runs.items():
        assert run.result["stopped_at"] == TERM_AT, (r, run.result)
        assert run.result["requested"] == (r == 1), (r, run.result)
        assert run.result["latest"] == TERM_AT and run.result["w"] == float(TERM_AT), (r, run.result)


def agree_worker(ctx: RankCtx) -> dict[str, Any]:
    import signal

    import torch

    import asyncckpt

    w = torch.zeros(8)
    stopped_at = None
    with asyncckpt.PreemptionWatch() as preempt, \
            asyncckpt.AsyncCheckpointer(ctx.args["root"], timeout_s=30) as ckpt:
        for step in range(1, 20):
            w += 1
            if step == TERM_AT and ctx.rank == 1:
                signal.raise_signal(signal.SIGTERM)  # the scheduler's notice, to rank 1 only
            if preempt.should_stop():
                stopped_at = step
                ckpt.save({"w": w, "step": step}, step=step)  # synchronous: durable now
                break
        latest = ckpt.latest_step()
        got = ckpt.load(step=latest)
    return {"stopped_at": stopped_at, "requested": preempt.requested, "latest": latest,
            "w": float(got["w"][0])}


def test_a_rank_that_does_not_join_is_timed_out(tmp_path: Path) -> None:
    runs = run_ranks(MODULE, "absent_worker", 2, tmp_path / "run", timeout_s=60)
    assert "CheckpointTimeoutError" in runs[0].result["error"], runs[0].result
    assert "every rank at the same steps" in runs[0].result["error"], runs[0].result
    # (a trial's late rank then paired its later calls with the abandoned all-reduce)
    assert "do not call should_stop again in this process group" in runs[0].result["error"]


def absent_worker(ctx: RankCtx) -> dict[str, Any]:
    import time

    import asyncckpt

    if ctx.rank == 1:  # never calls should_stop; stays up past rank 0's timeout
        time.sleep(4)
        return {}
    with asyncckpt.PreemptionWatch() as preempt:
        try:
            preempt.should_stop(timeout=1.0)
        except asyncckpt.CheckpointTimeoutError as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
    return {"error": "should_stop returned"}
