#!/usr/bin/env bash
# H22 ceiling runs on the H200 (one device call): one tree per "label:patch" in $VARIANTS (label "a" with no patch =
# this tree), built in parallel, then the decode bench over the trees in turn, twice, then $EXTRA steps on this tree.
# Usage (repo root, GPU machine):
#   VARIANTS="a: h:bench/results/h22_variants/dec_half.patch n:bench/results/h22_variants/dec_none.patch" \
#   SITE=<site-packages with pydantic etc.> OUT=... bash bench/results/h22_variants/run_variants.sh
set -u
OUT=${OUT:-/tmp/h22}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
root=$PWD
mp() { python3 -c 'from moetplan.cli import main; main()' "$@"; }
labels=()
for v in $VARIANTS; do
  l=${v%%:*}; p=${v#*:}; labels+=("$l")
  if [ -n "$p" ]; then rm -rf /tmp/v$l && cp -r "$root" /tmp/v$l && (cd /tmp/v$l && patch -s -p1 < "$root/$p") || exit 1
  else rm -rf /tmp/v$l && ln -s "$root" /tmp/v$l; fi
  (cd /tmp/v$l && PYTHONPATH=$SITE:/tmp/v$l MOETPLAN_KERNEL_CACHE=/tmp/kc$l timeout 400 \
     bash -c "$(declare -f mp); mp build-kernels --arch 9.0" > "$OUT/build_$l.log" 2>&1; echo "build $l rc=$?") &
done
wait
for rep in 1 2; do for l in "${labels[@]}"; do
  (cd /tmp/v$l && PYTHONPATH=$SITE:/tmp/v$l MOETPLAN_KERNEL_CACHE=/tmp/kc$l timeout 120 python3 bench/kernels.py --quick \
     --sections bw,decode --decode-kernels ${DK:-gemv} --no-baselines --out "$OUT/decode_$l$rep.json" \
     > "$OUT/decode_$l$rep.log" 2>&1; echo "bench $l$rep rc=$?")
done; done
python3 - "$OUT" "${labels[@]}" <<'PY'
import json, sys
out, labels = sys.argv[1], sys.argv[2:]
runs = {l + r: json.load(open(f"{out}/decode_{l}{r}.json")) for l in labels for r in "12"}
for lab, d in runs.items():
    print(lab, "read GB/s %.0f" % d["read_bandwidth"]["reference_gbps"])
P = {lab: {(e["model"][:4], e["tokens"], v): x["per_layer_us"] for e in d["decode"] for v, x in e["variants"].items()}
     for lab, d in runs.items()}
base = labels[0]
print("point", " ".join(f"{l}1 {l}2" for l in labels), " ratios over", base)
for key in sorted(P[base + "1"]):
    row = {lab: P[lab].get(key) for lab in P}
    rat = " ".join("%s %.3f/%.3f" % (l, row[l + "1"] / row[base + "1"], row[l + "2"] / row[base + "2"]) for l in labels[1:])
    print(key, " ".join("%.1f" % row[l] for l in P), " ", rat)
PY
for s in ${EXTRA:-}; do
  case $s in
    ncu) (l=${NCU_LABEL:-${labels[0]}}; cd /tmp/v$l && export PYTHONPATH=$SITE MOETPLAN_KERNEL_CACHE=/tmp/kc$l && NCU_TOKENS=8 OUT=$OUT bash bench/gpu_session.sh ncu) ;;
  esac
done
