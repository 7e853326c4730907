"""Fixtures shared by the test modules."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Callable

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _load_bench(name: str) -> ModuleType:
    # bench/ scripts are not a package; each puts bench/ on sys.path itself for its `kernels` imports.
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def load_bench() -> Callable[[str], ModuleType]:
    """A bench/ script as a module: load_bench("decode_timeline")."""
    return _load_bench
