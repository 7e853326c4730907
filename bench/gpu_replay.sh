#!/usr/bin/env bash
# The device call of issue 38 (replay vs split, the 32 GB-card emulation): DeepSeek-V4-Flash at full size with dummy
# weights, experts in the host tier behind the card's expert cache, the locality router; `consumer_replay` (replay) and `consumer` (split)
# served one after the other in this call (bench/e2e_gpu.py --cases consumer_replay,consumer), decode tok/s next to each plan's
# prediction, greedy tokens compared. Needs vLLM 0.26 in /tmp/site (bench/gpu_session.sh's install steps).
#   OUT=/path bash bench/gpu_replay.sh
set -uo pipefail
OUT=${OUT:-/tmp/moetplan-e2e-out}
exec env OUT="$OUT" bash "$(dirname "$0")/gpu_e2e.sh" --cases consumer_replay,consumer --deadline-s 560 --min-case-s 240 \
  --out "$OUT/e2e_h200_replay.json" "$@"
