"""ruff and mypy, configured in pyproject.toml, pass on the tree (fast tier: each takes seconds).

ruff checks the whole repository with a rule set that finds bugs (pyflakes, pycodestyle errors, bugbear);
mypy checks the packages listed in [tool.mypy] files (contract/, plan/, launch/). Both come with the `dev`
extra (scripts/setup.sh installs it).
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(tool: str, *args: str) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec(tool) is None:
        pytest.fail(f"{tool} is not installed in this environment: `pip install -e '.[dev]'` (scripts/setup.sh "
                    "installs it)")
    return subprocess.run([sys.executable, "-m", tool, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def test_ruff_finds_nothing() -> None:
    res = _run("ruff", "check", "--no-cache", ".")
    assert res.returncode == 0, f"`ruff check .` found problems:\n{res.stdout[-8000:]}{res.stderr[-2000:]}"


def test_mypy_finds_nothing_in_the_checked_packages() -> None:
    res = _run("mypy")
    assert res.returncode == 0, f"`mypy` (files in pyproject's [tool.mypy]) found problems:\n" \
                                f"{res.stdout[-8000:]}{res.stderr[-2000:]}"
