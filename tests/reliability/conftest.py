"""Shared fixtures of the reliability suite, and the figures it reports.

Tests record figures (kill points survived, corruptions detected, fuzz cases run)
with the ``figures`` fixture. They are printed at the end of the run and, when the
environment variable ``ASYNCCKPT_RELIABILITY_REPORT`` names a file, merged into that
JSON file (docs/reliability.md quotes it).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

REPORT_ENV = "ASYNCCKPT_RELIABILITY_REPORT"
_FIGURES: dict[str, Any] = {}


class Figures:
    """Counters a test adds to; ``figures.add("kill_points_survived", 1)``."""

    def add(self, key: str, n: int = 1) -> None:
        _FIGURES[key] = _FIGURES.get(key, 0) + n

    def set(self, key: str, value: Any) -> None:
        _FIGURES[key] = value


@pytest.fixture(scope="session")
def figures() -> Figures:
    return Figures()


@pytest.fixture
def short_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh directory under /tmp with a short path (unix socket and argv friendly)."""
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="ackrel-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _FIGURES:
        return
    terminalreporter.section("asyncckpt reliability figures")
    for key in sorted(_FIGURES):
        terminalreporter.write_line(f"{key}: {_FIGURES[key]}")
    path = os.environ.get(REPORT_ENV)
    if not path:
        return
    doc: dict[str, Any] = {}
    p = Path(path)
    if p.exists():
        try:
            doc = json.loads(p.read_text())
        except ValueError:
            doc = {}
    doc.update(_FIGURES)
    doc["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    doc["machine"] = (f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, "
                      f"python {platform.python_version()}, torch {torch.__version__}")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    terminalreporter.write_line(f"figures written to {p}")
