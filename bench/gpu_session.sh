#!/usr/bin/env bash
# One device call's worth of GPU work (the device machine has torch+CUDA but no vLLM and no moetplan install):
# the probe reference profile, the GPU tests of the store/probe/kernels, the tier and kernel benchmarks.
# Usage (on the GPU machine, repo root):  OUT=/path bash bench/gpu_session.sh [probe] [tests] [tiers] [kernels]
#                                                                          [pattern] [ncu] [ncu-prefill]
#                                                                          [timeline] [e4m3] [errors]
#                                                                          [pipes] [agreement]
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
    errors)  # do errors raised in extension code reach Python here, or crash the process (docs/KERNELS.md)
             timeout 300 python3 bench/tools/extension_errors/probe_errors.py --out "$OUT/extension_errors_h200.json" \
               > "$OUT/errors.log" 2>&1; echo "errors rc=$?"; cat "$OUT/errors.log" ;;
    agreement) # tiny GLM / DeepSeek-V4 / Kimi served three ways (kernels + graphs, kernels eager, torch reference
             # eager): the kernels' error alone and what compilation adds (tests/test_e2e_cuda.py; needs vLLM in /tmp/site)
             while [ -e /tmp/kc-build.pid ] && kill -0 "$(cat /tmp/kc-build.pid)" 2>/dev/null; do sleep 2; done
             MOETPLAN_KERNEL_CACHE=${MOETPLAN_KERNEL_CACHE:-/tmp/kc} PYTHONPATH="/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH" VLLM_USE_FLASHINFER_SAMPLER=0 \
               MOETPLAN_E2E_OUT="$OUT" MOETPLAN_E2E_STARTUP_S=${AGREEMENT_STARTUP_S:-400} \
               timeout "${AGREEMENT_S:-540}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_e2e_cuda.py \
               > "$OUT/agreement.log" 2>&1
             echo "agreement rc=$?"; tail -30 "$OUT/agreement.log" ;;
    tests)   timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ > "$OUT/pytest_gpu.log" 2>&1
             echo "pytest rc=$?"; tail -25 "$OUT/pytest_gpu.log" ;;
    tiers)   timeout 200 python3 bench/tiers.py --out "$OUT/tiers_h200.json" > "$OUT/tiers.log" 2>&1
             echo "tiers rc=$?"; tail -20 "$OUT/tiers.log" ;;
    kernels) timeout 300 python3 bench/moe_kernels.py --quick --out "$OUT/kernels_h200.json" > "$OUT/kernels.log" 2>&1
             echo "kernels rc=$?"; tail -30 "$OUT/kernels.log" ;;
    pattern) timeout 240 python3 bench/tools/read_pattern.py --out "$OUT/read_pattern_h200.json" > "$OUT/pattern.log" 2>&1
             echo "pattern rc=$?"; tail -20 "$OUT/pattern.log" ;;
    ncu)     # Nsight Compute on the decode stages (DeepSeek-V4-Flash, NCU_TOKENS tokens, default 8): details page +
             # per-instruction stall samples (SASS csv).
             nt=${NCU_TOKENS:-8}
             timeout 240 ncu --set full --import-source no --clock-control none -k regex:gemv_stage --launch-skip 2 \
               --launch-count 2 -o "$OUT/gemv_t$nt" python3 bench/tools/ncu_gemv.py --tokens "$nt" > "$OUT/ncu_t$nt.log" 2>&1
             echo "ncu rc=$?"
             ncu -i "$OUT/gemv_t$nt.ncu-rep" --page details > "$OUT/ncu_gemv_t$nt.txt" 2>&1
             ncu -i "$OUT/gemv_t$nt.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_gemv_t${nt}_sass.csv" 2>&1
             ncu -i "$OUT/gemv_t$nt.ncu-rep" --page raw --csv > "$OUT/ncu_gemv_t${nt}_raw.csv" 2>&1
             rm -f "$OUT/gemv_t$nt.ncu-rep"; grep -E "Duration|Issue Slots Busy|DRAM Throughput" "$OUT/ncu_gemv_t$nt.txt"
             python3 bench/tools/ncu_stalls.py "$OUT/ncu_gemv_t${nt}_sass.csv" | tee "$OUT/ncu_gemv_t${nt}_stalls.txt" ;;
    pipes)   # pipe shares of the decode stages (Nsight Compute raw metrics; bench/tools/ncu_pipes.py): the integer ALU pipe
             # (the 2-bit decode) against issue, DRAM and the SM clock; DeepSeek-V4-Flash at 1 and 8 tokens, Kimi at 8.
             csvs=(); labels=(); weights=()
             for spec in "DeepSeek-V4-Flash 1" "DeepSeek-V4-Flash 8" "Kimi-K2.7-Code 8"; do
               set -- $spec; f="$OUT/ncu_pipes_${1%%-*}_t$2.csv"
               for extra in "--metrics sm__inst_executed_pipe_alu.sum,sm__inst_executed.sum" ""; do
                 # shellcheck disable=SC2086
                 timeout 150 ncu --section ComputeWorkloadAnalysis --section SpeedOfLight --section SchedulerStats \
                   $extra --clock-control none -k regex:gemv_stage --launch-skip 2 --launch-count 2 --page raw --csv \
                   --log-file "$f" python3 bench/tools/ncu_gemv.py --model "$1" --tokens "$2" > "$f.log" 2>&1
                 grep -q '^"ID"' "$f" && break
               done
               csvs+=("$f"); labels+=(--label "$1 T=$2")
               w=$(grep -o 'weights=[0-9]*' "$f.log" | cut -d= -f2); weights+=(--weights "${w:-0}")
             done
             python3 bench/tools/ncu_pipes.py "${csvs[@]}" "${labels[@]}" "${weights[@]}" --out "$OUT/ncu_pipes_h200.json" \
               > "$OUT/pipes.log" 2>&1; echo "pipes rc=$?"; tail -40 "$OUT/pipes.log" ;;
    timeline) # per-kernel durations of the decode step (bench/tools/decode_timeline.py), all three model shapes
             timeout 200 python3 bench/tools/decode_timeline.py --models DeepSeek-V4-Flash,GLM-5.2,Kimi-K2.7-Code \
               --tokens 1,2,8 --out "$OUT/decode_timeline_h200.json" > "$OUT/timeline.log" 2>&1
             echo "timeline rc=$?"; grep -v -i warn "$OUT/timeline.log" | tail -20 ;;
    e4m3)    # the opt-in e4m3 w13 stage's distance from the bf16 stage (bench/e4m3_precision.py)
             timeout 120 python3 bench/e4m3_precision.py --out "$OUT/e4m3_precision_h200.json" > "$OUT/e4m3.log" 2>&1
             echo "e4m3 rc=$?"; tail -24 "$OUT/e4m3.log" ;;
    ncu-prefill)  # Nsight Compute on the prefill stages (DeepSeek-V4-Flash, 8192 tokens, w13 + w2 of one call).
             k=${PREFILL_KERNEL:-auto}; re=$([ "$k" = wgmma ] && echo prefill_wgmma || echo prefill_stage)
             timeout 240 ncu --set full --clock-control none -k "regex:$re" --launch-count 2 -o "$OUT/prefill" \
               python3 bench/tools/ncu_gemv.py --tokens 8192 --calls 1 --prefill-kernel "$k" > "$OUT/ncu_prefill.log" 2>&1
             echo "ncu rc=$?"
             ncu -i "$OUT/prefill.ncu-rep" --page details > "$OUT/ncu_prefill_t8192.txt" 2>&1
             ncu -i "$OUT/prefill.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_prefill_sass.csv" 2>&1
             rm -f "$OUT/prefill.ncu-rep"; grep -E "Duration|Issue Slots Busy|Tensor" "$OUT/ncu_prefill_t8192.txt" ;;
  esac
done
