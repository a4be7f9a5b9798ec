"""Not run: type-checked by mypy (pyproject's files), as users' code is. The forms the
docs say the API takes must pass `mypy --strict` (a docs trial found numpy and tensor
steps, and numpy metadata, refused by the hints while taken at run time)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

import asyncckpt
from asyncckpt.export import export_safetensors
from asyncckpt.transport.http import HTTPTransport


def documented_forms(root: Path) -> None:
    state = {"w": torch.ones(2)}
    step = np.int64(3)
    with asyncckpt.AsyncCheckpointer(root) as ckpt:
        ckpt.save_async(state, step).wait()
        ckpt.save(state, torch.tensor(4), metadata={
            "lr": 1e-3, "epoch": 2, "name": "run", "ema": True, "np": np.float32(0.5),
            "t": torch.tensor(7)})
        ckpt.load(state, step=np.int32(4))
        ckpt.manifest(np.int64(4))
        ckpt.discard_steps_after(torch.tensor(4))
    asyncckpt.save(state, root / "one", step=np.uint8(1))
    asyncckpt.load(root / "one", state, step=torch.tensor(1))
    export_safetensors(root, root / "out.safetensors", step=np.int64(4))
    transport = HTTPTransport()
    transport.send_checkpoint([1], np.int64(5), state, 10.0)
    transport.allow_checkpoint(np.int64(5))
    transport.shutdown()
