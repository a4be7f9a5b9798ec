"""Healing a rank of an FSDP2 job from the same rank of a healthy replica (ckpt.serve).

Two gloo ranks train an FSDP2 model with Adam, saving with ``ckpt.serve`` on: each rank
offers its view of the save. Adam's ``step`` counts are plain tensors on every rank,
written by one of them; the other rank's view offered only its own file, so a peer
healing that rank from it could not get them. Here each rank then builds a fresh model
and optimizer (as a replacement replica would), fetches from its own view into the
targets ``get_state_dict`` makes, applies them, and must hold the saved state bit for
bit, step counts included, while the live state has moved on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _harness import Checks, RankCtx, bits, run_ranks
from _torch_compat import fsdp2_on_cpu, fully_shard_fn

import asyncckpt

MODULE = "test_dist_serve_heal"


def _trained(ctx: RankCtx, seed: int, steps: int) -> tuple[Any, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))
    fully_shard_fn()(model, mesh=init_device_mesh("cpu", (ctx.world,)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(100 + ctx.rank)
    for _ in range(steps):
        loss = model(torch.randn(4, 6, generator=gen)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _local_bits(sd: Any, prefix: str = "") -> dict[str, str]:
    """Each tensor of a state dict (DTensors by their local shard) as its bytes' digest."""
    import torch

    out: dict[str, str] = {}
    items = sd.items() if isinstance(sd, dict) else enumerate(sd)
    for k, v in items:
        path = f"{prefix}/{k}" if prefix else str(k)
        if isinstance(v, torch.Tensor):
            local = v.to_local() if hasattr(v, "to_local") else v
            out[path] = bits(local)
        elif isinstance(v, (dict, list, tuple)):
            out.update(_local_bits(v, path))
    return out


def worker(ctx: RankCtx) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from asyncckpt.transport import HTTPTransport

    c = Checks()
    model, opt = _trained(ctx, seed=0, steps=3)
    transport = HTTPTransport(timeout=30)
    ckpt = asyncckpt.AsyncCheckpointer(Path(ctx.args["root"]), timeout_s=60)
    try:
        ckpt.serve(transport)
        msd, osd = get_state_dict(model, opt)
        ckpt.save_async({"model": msd, "optim": osd}, step=3).wait()
        saved = _local_bits({"model": msd, "optim": osd})
        steps = [k for k in saved if k.endswith("/step")]
        c.check(len(steps) == 4, f"Adam's step counts: {steps}")
        # training goes on (the view keeps step 3's values)
        model(__import__("torch").ones(2, 6)).sum().backward()
        opt.step()
        ctx.barrier()
        # a replacement for this rank: fresh model and optimizer, healed from the view
        fresh, fresh_opt = _trained(ctx, seed=1, steps=0)
        fmsd, fosd = get_state_dict(fresh, fresh_opt)  # (makes the optimizer's state)
        target = {"model": fmsd, "optim": fosd}
        got = asyncckpt.load(transport.address(), target, timeout=30)
        set_state_dict(fresh, fresh_opt, model_state_dict=got["model"],
                       optim_state_dict=got["optim"])
        healed = _local_bits(dict(zip(("model", "optim"), get_state_dict(fresh, fresh_opt),
                                      strict=True)))
        c.check(healed == saved, "the healed state differs from the saved one: " + ", ".join(
            k for k in sorted(set(saved) | set(healed)) if saved.get(k) != healed.get(k)))
        ctx.barrier()  # (each rank serves until both have fetched)
    finally:
        ckpt.close()
        transport.shutdown()
    return {"failures": c.failures}


@pytest.mark.skipif(not fsdp2_on_cpu(), reason="this torch's FSDP2 needs CUDA")
def test_a_rank_of_an_fsdp2_job_heals_from_its_peer_view_with_adams_step_counts(
        tmp_path: Path) -> None:
    runs = run_ranks(MODULE, "worker", 2, tmp_path / "run",
                     args={"root": str(tmp_path / "ck")}, timeout_s=120)
    for r, run in runs.items():
        assert run.result["failures"] == [], (r, run.result["failures"])
