"""A bench/ script imported as a module for its pure helpers (bench/ is not a package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"


def load_bench(name: str):
    """bench/<name>.py as a module of its own (under a name that cannot clash with an installed one)."""
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", BENCH_DIR / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
