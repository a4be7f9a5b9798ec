"""Plain safetensors files (a Hugging Face model's sharded weights) loaded into DTensors.

Rank 0 writes a model's weights as Hugging Face does (``model.``-prefixed names, two
files and a ``model.safetensors.index.json``); both ranks load them with
``asyncckpt.load_safetensors`` into an FSDP2 model (``Shard(0)``) and into a
tensor-parallel one (``Shard(0)`` columns, ``Shard(1)`` rows, a replicated bias), each
rank reading its box, and every local shard must be the full weight's slice, bit-exact.
The files hold bf16 and the models fp32: each box is read as saved, then cast.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from _harness import Checks, RankCtx, bits, run_ranks
from _torch_compat import fully_shard_fn

import asyncckpt

MODULE = "test_dist_safetensors"


def _model(seed: int) -> Any:
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))


def _write_hf(where: Path) -> dict[str, Any]:
    """The model of seed 0 as a Hugging Face sharded checkpoint; its full weights."""
    import torch
    from safetensors.torch import save_file

    # in bf16, as Hugging Face publishes weights; the models train in fp32 (cast on load)
    full = {f"model.{k}": v.detach().to(torch.bfloat16)
            for k, v in _model(0).state_dict().items()}
    names = sorted(full)
    parts = {"model-00001-of-00002.safetensors": names[:2],
             "model-00002-of-00002.safetensors": names[2:]}
    where.mkdir(parents=True)
    for fname, keys in parts.items():
        save_file({k: full[k] for k in keys}, str(where / fname), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.nbytes for t in full.values())},
             "weight_map": {k: f for f, keys in parts.items() for k in keys}}
    (where / "model.safetensors.index.json").write_text(json.dumps(index))
    return full


def worker(ctx: RankCtx) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    c = Checks()
    hf = Path(ctx.args["hf"])
    if ctx.rank == 0:
        _write_hf(hf)
    ctx.barrier()
    full = {k.removeprefix("model."): t
            for k, t in asyncckpt.load_safetensors(hf).items()}  # (fresh, whole: checked below)
    c.check(all(torch.equal(full[k], v.to(torch.bfloat16))
                for k, v in _model(0).state_dict().items()),
            "the fresh whole load differs from the model's weights")
    mesh = init_device_mesh("cpu", (ctx.world,))
    placements = {}
    for name, build in (("fsdp", lambda m: fully_shard_fn()(m, mesh=mesh)),
                        ("tp", lambda m: parallelize_module(
                            m, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()}))):
        model = _model(seed=1)
        build(model)
        params = dict(model.named_parameters())
        c.run(f"{name} load", asyncckpt.load_safetensors, hf, model,
              key_map=lambda k: k.removeprefix("model."))
        for k, t in model.state_dict().items():
            placements[f"{name}/{k}"] = str(t.placements)
            local = t.to_local()
            want = full[k].float()
            for d, p in enumerate(t.placements):
                if p.is_shard():
                    want = want.chunk(ctx.world, p.dim)[mesh.get_coordinate()[d]]
            c.check(local.shape == want.shape and bits(local) == bits(want),
                    f"{name} {k} ({t.placements}): {local} != {want}")
        c.check(all(p is params[k] for k, p in model.named_parameters()),
                f"{name}: parameters replaced rather than loaded in place")
    return {"failures": c.failures, "placements": placements}


def test_hf_sharded_files_load_into_fsdp2_and_tensor_parallel_dtensors(tmp_path: Path) -> None:
    runs = run_ranks(MODULE, "worker", 2, tmp_path / "run", args={"hf": str(tmp_path / "hf")},
                     timeout_s=90)
    for r, run in runs.items():
        assert run.result["failures"] == [], (r, run.result["failures"])
    got = runs[0].result["placements"]
    # the layouts this was meant to cover really occurred
    assert "Shard(dim=0)" in got["fsdp/0.weight"] and "Shard(dim=0)" in got["tp/0.weight"]
    assert "Shard(dim=1)" in got["tp/2.weight"] and "Replicate()" in got["tp/2.bias"]
