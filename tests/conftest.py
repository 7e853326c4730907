"""Fixtures and collection rules shared by the test modules.

Tiers (README, "Run the tests"): the default run leaves out tests marked `slow` (the full-size dummy-weights
serve, the second vLLM version); `--run-slow`, MOETPLAN_SLOW=1 or a `-m` expression naming `slow` runs them.
Tests marked `gpu` skip where torch sees no CUDA device, tests marked `vllm` where vLLM cannot be imported.
Every test module gets a private MOETPLAN_CACHE_DIR and an offline Hugging Face environment (autouse fixtures).
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
SLOW_ENV = "MOETPLAN_SLOW"
# Set for every test: no test reaches the Hugging Face hub (tiny models are generated, dummy ones written).
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", default=False,
                     help=f"also run tests marked slow (as {SLOW_ENV}=1 does)")


def _slow_selected(config: pytest.Config) -> bool:
    if config.getoption("--run-slow") or os.environ.get(SLOW_ENV, "") not in ("", "0"):
        return True
    expr = config.getoption("markexpr") or ""
    return "slow" in expr and "not slow" not in expr


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect `slow` tests unless asked for; skip `gpu` without CUDA and `vllm` without vLLM (trylast: after `-m`
    deselection, so a tier without them never imports torch or vLLM here)."""
    if not _slow_selected(config):
        slow = [item for item in items if item.get_closest_marker("slow")]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if not item.get_closest_marker("slow")]
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        try:
            import torch

            why = None if torch.cuda.is_available() else "marked gpu and torch sees no CUDA device"
        except Exception as e:  # no torch, or a half-installed CUDA runtime that raises instead of answering
            why = f"marked gpu and torch cannot drive CUDA here ({e})"
        if why:
            for item in gpu:
                item.add_marker(pytest.mark.skip(reason=why))
    marked = [item for item in items if item.get_closest_marker("vllm")]
    if not marked:
        return
    try:
        importlib.import_module("vllm")
    except ImportError as e:
        skip = pytest.mark.skip(reason=f"marked vllm and vLLM is not importable here ({e})")
        for item in marked:
            item.add_marker(skip)


def pytest_report_header(config: pytest.Config) -> str:
    if _slow_selected(config):
        return "tiers: slow tests included"
    return f"tiers: slow tests left out (--run-slow or {SLOW_ENV}=1 runs them)"


@pytest.fixture(autouse=True, scope="module")
def _test_environment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Each test module gets its own moetplan cache (tiny checkpoints, runs, packs: one module's packs never
    change what another's server finds) and no hub access; restored when the module ends. Kernel and quality
    caches have their own variables and stay shared."""
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOETPLAN_CACHE_DIR", str(cache))
        for k, v in OFFLINE_ENV.items():
            mp.setenv(k, v)
        yield cache


@pytest.fixture(scope="module")
def cpu_mod(_test_environment: Path) -> Any:
    """The CPU expert kernels' extension (built on first use into the module's cache); skips, naming why, where it
    cannot build."""
    from moetplan.runtime.op import cpu_kernels

    m = cpu_kernels.get_module()
    if m is None:
        pytest.skip(f"CPU kernels not built here: {cpu_kernels.fallback_reason()}")
    return m


@pytest.fixture(scope="module")
def module_cache(_test_environment: Path) -> Path:
    """This module's MOETPLAN_CACHE_DIR."""
    return _test_environment


@pytest.fixture(scope="module")
def e2e_env(_test_environment: Path) -> dict[str, str]:
    """The environment of a `moetplan run` / offline vLLM subprocess: this module's cache, offline, a 1 GiB CPU
    KV cache (the tiny models need no more; 2 cores, 24 GiB)."""
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}


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
