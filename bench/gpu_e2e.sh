#!/usr/bin/env bash
# The device call of the end-to-end GPU bench (bench/e2e_gpu.py): installs what is left of the carried pieces
# (bench/tools/device_install.sh: the last piece, the fixups, the import check), waits for the kernel build an
# earlier call started, then serves DeepSeek-V4-Flash at full size with dummy weights, case by case, next to the
# plan's predictions. Everything lands in $OUT as it is made (install log, e2e JSON rewritten after each case, the
# e2e log, the server logs as one archive), so a call cut short still brings back what it measured.
#   OUT=/path bash bench/gpu_e2e.sh [extra args for bench/e2e_gpu.py]
#   E2E_CALL_S: the device call's limit in seconds (default 560): the bench stops starting cases and stops a
#   server early enough to write its result and the logs before the call ends (bench/e2e_gpu.py --deadline-at).
set -uo pipefail
CALL_START=$(date +%s)
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/moetplan-e2e-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 MOETPLAN_KERNEL_CACHE=${MOETPLAN_KERNEL_CACHE:-/tmp/kc}
export PYTHONPATH="/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD"
bash bench/tools/device_install.sh 2>&1 | tee -a "$OUT/install.log"
[ "${PIPESTATUS[0]}" = 0 ] || echo "the install check failed (above): serving anyway, the servers' logs say more"
[ -s /tmp/site/.pieces/MISSING ] && { echo "pieces missing: $(cat /tmp/site/.pieces/MISSING)"; exit 3; }
if [ -e /tmp/kc-build.pid ] && kill -0 "$(cat /tmp/kc-build.pid)" 2>/dev/null; then
  echo "waiting for the kernel build (pid $(cat /tmp/kc-build.pid))"
  while kill -0 "$(cat /tmp/kc-build.pid)" 2>/dev/null; do sleep 2; done
fi
[ -e /tmp/kc-build.log ] && tail -3 /tmp/kc-build.log | tee -a "$OUT/install.log"
logs() {
  find /tmp/moetplan-e2e \( -name '*.log' -o -name '*.json' \) -size -50M -print0 2>/dev/null \
    | tar czf "$OUT/e2e_server_logs.tgz" --null -T - 2>/dev/null
  nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv >> "$OUT/e2e_gpu.log" 2>&1
}
trap logs EXIT
# A call killed at its limit runs no trap: snapshot the server logs into $OUT every 20 s (atomic replace).
( while sleep 20; do
    find /tmp/moetplan-e2e \( -name '*.log' -o -name '*.json' \) -size -50M -print0 2>/dev/null \
      | tar czf "$OUT/.logs.tmp" --null -T - 2>/dev/null && mv -f "$OUT/.logs.tmp" "$OUT/e2e_server_logs.tgz"
  done ) &
SNAP=$!
# The plan is solved for this machine's probe: the H200's is in bench/results; another GPU is probed here first.
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
case "$gpu" in
  *H200*) tag=h200 ;;
  *H100*) tag=h100 ;;
  *) tag=gpu ;;
esac
hw=bench/results/hw_${tag}_probe.json
if [ ! -e "$hw" ]; then
  hw=$OUT/hw_${tag}_probe.json
  python3 -c 'from moetplan.cli import main; main()' probe --quick --out "$hw" 2>&1 | tail -5 | tee -a "$OUT/e2e_gpu.log"
fi
echo "GPU: $gpu -> plans for $hw, results in e2e_$tag.json" | tee -a "$OUT/e2e_gpu.log"
python3 bench/e2e_gpu.py --hw "$hw" --out "$OUT/e2e_$tag.json" \
  --deadline-at $((CALL_START + ${E2E_CALL_S:-560} - 45)) "$@" 2>&1 | tee -a "$OUT/e2e_gpu.log"
kill "$SNAP" 2>/dev/null
