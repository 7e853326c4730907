"""Fixtures and collection rules shared by the test modules."""
from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Callable

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `vllm` skip where vLLM cannot be imported (trylast: after `-m` deselection, so a tier without
    them never imports vLLM here)."""
    marked = [item for item in items if item.get_closest_marker("vllm")]
    if not marked:
        return
    try:
        importlib.import_module("vllm")
    except ImportError as e:
        skip = pytest.mark.skip(reason=f"marked vllm and vLLM is not importable here ({e})")
        for item in marked:
            item.add_marker(skip)


def _load_bench(name: str) -> ModuleType:
    # bench/ scripts are not a package; each puts its own folder (and bench/) on sys.path for its imports.
    # Benchmarks live in bench/, profiling tools in bench/tools/.
    path = next((p for p in (BENCH / f"{name}.py", BENCH / "tools" / f"{name}.py") if p.exists()), None)
    assert path is not None, f"no bench/{name}.py or bench/tools/{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def load_bench() -> Callable[[str], ModuleType]:
    """A bench/ (or bench/tools/) script as a module: load_bench("decode_timeline")."""
    return _load_bench
