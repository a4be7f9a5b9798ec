"""Manifest documents for tests that edit one: the short entries of whole tensors
(format version 2) written out long, so that a test names the field it changes."""

from __future__ import annotations

import math
from typing import Any

import torch


def long_entries(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` (a parsed manifest) with every short tensor entry, ``[dtype, shape, kind,
    file, start, checksums]``, replaced in place by the long entry it stands for: one
    chunk of the whole tensor under its own key; and every short chunk (format version
    3), ``[file, offsets, lengths, start, checksums]``, by the long chunk it stands for,
    under the tensor's key. Returns ``doc``."""
    tensors = doc["tensors"]
    for key, t in tensors.items():
        if isinstance(t, list):
            dtype, shape, kind, file, start, sums = t
            nbytes = math.prod(shape) * getattr(torch, dtype).itemsize
            tensors[key] = {"dtype": dtype, "shape": shape, "kind": kind, "chunks": [{
                "file": file, "key": key, "offsets": [0] * len(shape), "lengths": list(shape),
                "byte_range": [start, start + nbytes], "checksums": sums}]}
        else:
            itemsize = getattr(torch, t["dtype"]).itemsize
            t["chunks"] = [{"file": c[0], "key": key, "offsets": c[1], "lengths": c[2],
                            "byte_range": [c[3], c[3] + math.prod(c[2]) * itemsize],
                            "checksums": c[4]} if isinstance(c, list) else c
                           for c in t["chunks"]]
    return doc
