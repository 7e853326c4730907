#!/usr/bin/env bash
# Kernel variants side by side in one device call (docs/KERNELS.md, "Reproducing"): one source tree per "label:patch" in
# $VARIANTS (the first is the baseline; an empty patch = this tree), built in parallel with their own kernel
# caches, then bench/moe_kernels.py's decode section in each tree in turn, $REPS times, then one experiment file
# (bench/tools/variants.py: every run with its code, ratios over the baseline) — a single file, because a device call
# returns only a few. Usage, on the GPU machine at the repo root:
#   VARIANTS="a: s1:/tmp/ns1.patch" BASE=$(git rev-parse --short HEAD) SITE=<wheels dir> \
#   OUT=<dir> [REPS=2] [DK=gemv] [BENCH_ARGS="--models DeepSeek-V4-Flash"] [NCU_LABEL=s1] bash bench/tools/variants.sh
set -u
OUT=${OUT:-/tmp/variants}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
root=$PWD
mp() { python3 -c 'from moetplan.cli import main; main()' "$@"; }
labels=(); specs=()
for v in ${VARIANTS:?set VARIANTS=\"label:patch ...\"}; do
  l=${v%%:*}; p=${v#*:}; labels+=("$l")
  rm -rf "/tmp/v$l"
  if [ -n "$p" ]; then cp -r "$root" "/tmp/v$l" && (cd "/tmp/v$l" && patch -s -p1 < "$root/$p") || exit 1
  else ln -s "$root" "/tmp/v$l"; fi
  (cd "/tmp/v$l" && PYTHONPATH=${SITE:-}:/tmp/v$l MOETPLAN_KERNEL_CACHE=/tmp/kc$l timeout 400 \
     bash -c "$(declare -f mp); mp build-kernels --arch 9.0" > "$OUT/build_$l.log" 2>&1; echo "build $l rc=$?") &
done
wait
for rep in $(seq 1 "${REPS:-2}"); do for l in "${labels[@]}"; do
  (cd "/tmp/v$l" && PYTHONPATH=${SITE:-}:/tmp/v$l MOETPLAN_KERNEL_CACHE=/tmp/kc$l timeout 150 python3 bench/moe_kernels.py \
     --quick --sections bw,decode --decode-kernels "${DK:-gemv}" --no-baselines ${BENCH_ARGS:-} \
     --out "$OUT/run_${l}_$rep.json" > "$OUT/run_${l}_$rep.log" 2>&1; echo "bench ${l}_$rep rc=$?")
done; done
for v in $VARIANTS; do
  l=${v%%:*}; p=${v#*:}
  specs+=("$l${p:+@$p}=$(ls -v "$OUT"/run_"$l"_[0-9]*.json 2>/dev/null | paste -sd,)")
done
PYTHONPATH=${SITE:-}:$root python3 bench/tools/variants.py --out "$OUT/variants.json" --base "${BASE:-this tree}" \
  --note "VARIANTS=$VARIANTS" "${specs[@]}" && rm -f "$OUT"/run_*.json "$OUT"/run_*.log "$OUT"/build_*.log
if [ -n "${NCU_LABEL:-}" ]; then  # Nsight Compute of one tree at 8 tokens (bench/gpu_session.sh ncu)
  (cd "/tmp/v$NCU_LABEL" && PYTHONPATH=${SITE:-} MOETPLAN_KERNEL_CACHE=/tmp/kc$NCU_LABEL NCU_TOKENS=8 OUT=$OUT \
     bash bench/gpu_session.sh ncu; rm -f "$OUT"/*.csv "$OUT"/ncu_t8.log)
fi
