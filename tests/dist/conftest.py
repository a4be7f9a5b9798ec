"""Distributed tests: real ranks (subprocesses) joined by gloo on 127.0.0.1."""

from __future__ import annotations

import pytest
import torch.distributed as dist


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "dist: spawns real ranks joined by gloo on 127.0.0.1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = None
    if not dist.is_available():
        reason = "torch.distributed is not available in this build"
    elif not dist.is_gloo_available():
        reason = "the gloo backend is not available in this build"
    for item in items:
        if "tests/dist/" in item.nodeid.replace("\\", "/") or item.nodeid.startswith("dist/"):
            item.add_marker(pytest.mark.dist)
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))
