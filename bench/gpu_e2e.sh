#!/usr/bin/env bash
# The device call of the end-to-end GPU bench (bench/e2e_gpu.py), after device_install.sh + device_fixups.sh have
# put vLLM 0.26 into /tmp/site: DeepSeek-V4-Flash at full size with dummy weights, resident / consumer-box / MTP,
# next to the plan's predictions; the server logs come back as one archive.
#   OUT=/path bash bench/gpu_e2e.sh [extra args for bench/e2e_gpu.py]
set -uo pipefail
OUT=${OUT:-/tmp/moetplan-e2e-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONPATH="/tmp/site:$PWD"
python3 bench/e2e_gpu.py --hw bench/results/hw_h200_probe.json --out "$OUT/e2e_h200.json" "$@" 2>&1 | tee "$OUT/e2e_gpu.log"
find /tmp/moetplan-e2e \( -name '*.log' -o -name '*.json' \) -size -50M -print0 2>/dev/null \
  | tar czf "$OUT/e2e_server_logs.tgz" --null -T - 2>/dev/null
nvidia-smi --query-gpu=memory.used,memory.total --format=csv >> "$OUT/e2e_gpu.log" 2>&1
