#!/usr/bin/env bash
# One device call's worth of GPU work (the device machine has torch+CUDA but no vLLM and no moetplan install):
# the probe reference profile, the GPU tests of the store/probe/kernels, the tier and kernel benchmarks.
# Usage (on the GPU machine, repo root):  OUT=/path bash bench/gpu_session.sh [probe] [tests] [tiers] [kernels]
set -u
OUT=${OUT:-/tmp/moetplan-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
steps=${*:-probe tests tiers kernels}
mp() { python3 -c 'from moetplan.cli import main; main()' "$@"; }
for s in $steps; do
  echo "=== $s $(date -u +%T)"
  case $s in
    probe)   timeout 240 bash -c "$(declare -f mp); mp probe --pack-dir /tmp/mp-packs --out $OUT/hw_h200_probe.json" \
               > "$OUT/probe.log" 2>&1; echo "probe rc=$?"; tail -40 "$OUT/probe.log" ;;
    tests)   timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ > "$OUT/pytest_gpu.log" 2>&1
             echo "pytest rc=$?"; tail -25 "$OUT/pytest_gpu.log" ;;
    tiers)   timeout 200 python3 bench/tiers.py --out "$OUT/tiers_h200.json" > "$OUT/tiers.log" 2>&1
             echo "tiers rc=$?"; tail -20 "$OUT/tiers.log" ;;
    kernels) timeout 300 python3 bench/kernels.py --quick --out "$OUT/kernels_h200.json" > "$OUT/kernels.log" 2>&1
             echo "kernels rc=$?"; tail -30 "$OUT/kernels.log" ;;
  esac
done
