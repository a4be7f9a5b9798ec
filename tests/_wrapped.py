"""A tensor subclass without memory of its own, shared by the tests of several modules."""

from __future__ import annotations

import torch


class Wrapped(torch.Tensor):
    """A wrapper subclass (as torchao's NF4 and Float8 tensors are): no memory of its own
    (its data pointer is 0); every op runs on the plain tensor it wraps."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> Wrapped:
        t = torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)
        t.inner = inner  # type: ignore[attr-defined]
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        def unwrap(x):  # type: ignore[no-untyped-def]
            return x.inner if isinstance(x, Wrapped) else x
        return func(*torch.utils._pytree.tree_map(unwrap, args),
                    **torch.utils._pytree.tree_map(unwrap, kwargs or {}))
