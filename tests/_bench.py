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
