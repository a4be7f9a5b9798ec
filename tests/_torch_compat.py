"""What the tests take from torch's distributed APIs, on every torch asyncckpt supports
(``torch>=2.4``): torch 2.4 keeps DTensor in ``torch.distributed._tensor`` (public as
``torch.distributed.tensor`` from 2.5) and FSDP2's ``fully_shard`` in
``torch.distributed._composable.fsdp`` (public in ``torch.distributed.fsdp`` from 2.6)."""

from __future__ import annotations

import importlib
from typing import Any

# submodules that torch 2.4 names otherwise
_OLD_NAMES = {"_dtensor_spec": "placement_types"}


def dtensor_api(sub: str = "") -> Any:
    """torch's DTensor module, or its submodule ``sub`` (``_dtensor_spec``...)."""
    public = importlib.import_module("torch.distributed.tensor")
    if hasattr(public, "Shard"):
        return importlib.import_module(f"torch.distributed.tensor.{sub}") if sub else public
    old = _OLD_NAMES.get(sub, sub)
    return importlib.import_module(f"torch.distributed._tensor{'.' + old if old else ''}")


def fully_shard_fn() -> Any:
    """FSDP2's ``fully_shard``."""
    fsdp = importlib.import_module("torch.distributed.fsdp")
    if hasattr(fsdp, "fully_shard"):
        return fsdp.fully_shard
    return importlib.import_module("torch.distributed._composable.fsdp").fully_shard


def distribute_locally(full: Any, mesh: Any, placements: Any) -> Any:
    """``distribute_tensor`` of a tensor every rank holds whole, without communication
    (``src_data_rank=None``); torch 2.4 has no such argument (it would scatter from rank
    0): there this rank's box is cut out of ``full`` here."""
    api = dtensor_api()
    try:
        return api.distribute_tensor(full, mesh, placements, src_data_rank=None)
    except TypeError:
        shape, offsets = dtensor_api("_utils").compute_local_shape_and_global_offset(
            full.shape, mesh, placements)
        local = full
        for d, (o, n) in enumerate(zip(offsets, shape, strict=True)):
            local = local.narrow(d, o, n)
        return api.DTensor.from_local(local.contiguous(), mesh, placements, run_check=False,
                                      shape=full.shape, stride=full.stride())


def fsdp2_on_cpu() -> bool:
    """Whether this torch's FSDP2 runs on CPU tensors (gloo): the public ``fully_shard``
    (torch 2.6 on) does; torch 2.4's asks CUDA for streams."""
    return hasattr(importlib.import_module("torch.distributed.fsdp"), "fully_shard")
