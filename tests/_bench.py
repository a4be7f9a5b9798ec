"""Importing the benchmark scripts (benchmarks/ is no package) for their smoke tests."""

from __future__ import annotations

import importlib
import math
import sys
from pathlib import Path
from types import ModuleType

BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"


def import_bench(name: str) -> ModuleType:
    """The module ``benchmarks/<name>.py`` (its siblings, such as _limits, importable)."""
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))
    return importlib.import_module(name)


def positive(x: object) -> bool:
    """A measured figure: a number, not NaN, above 0."""
    return isinstance(x, (int, float)) and not math.isnan(x) and x > 0


def needs_dcp_stager() -> object:
    """A skip mark for the runs that measure DCP ``async_save`` as the benchmark's spec
    asks (a reused ``DefaultStager``), which torch before 2.9 lacks: asyncckpt supports
    torch 2.4, its benchmark the torch that has that anchor."""
    import pytest
    import torch

    try:
        from torch.distributed.checkpoint.staging import DefaultStager  # noqa: F401
        missing = False
    except ImportError:
        missing = True
    return pytest.mark.skipif(missing, reason=f"torch {torch.__version__} has no DCP "
                              "DefaultStager, the anchor the benchmark measures")
