#!/usr/bin/env bash
# H22 side-by-side runs on the H200 (one device call): tree A = this tree with the patch named by $PATCH reversed
# (the code before it), tree B = this tree; both built in parallel, then the decode bench ABAB, then $EXTRA steps
# on tree B. Usage (repo root, GPU machine): PATCH=bench/results/h22_variants/hi_half.patch OUT=... bash <this>
set -u
OUT=${OUT:-/tmp/h22}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
root=$PWD
rm -rf /tmp/va && cp -r "$root" /tmp/va && (cd /tmp/va && patch -s -R -p1 < "$root/$PATCH") || exit 1
mp() { python3 -c 'from moetplan.cli import main; main()' "$@"; }
build() { (cd "$1" && PYTHONPATH=$SITE:$1 MOETPLAN_KERNEL_CACHE=$2 timeout 400 bash -c "$(declare -f mp); mp build-kernels --arch 9.0" > "$OUT/build_$3.log" 2>&1; echo "build $3 rc=$?"); }
build /tmp/va /tmp/kcA A & build "$root" /tmp/kcB B & wait
bench() {  # tree cache label
  (cd "$1" && PYTHONPATH=$SITE:$1 MOETPLAN_KERNEL_CACHE=$2 timeout 120 python3 bench/kernels.py --quick --sections bw,decode \
     --decode-kernels ${DK:-gemv} --no-baselines --out "$OUT/decode_$3.json" > "$OUT/decode_$3.log" 2>&1; echo "bench $3 rc=$?")
}
bench /tmp/va /tmp/kcA a1; bench "$root" /tmp/kcB b1; bench /tmp/va /tmp/kcA a2; bench "$root" /tmp/kcB b2
python3 - "$OUT" <<'PY'
import json, sys, glob, os
out = sys.argv[1]
runs = {os.path.basename(p)[7:-5]: json.load(open(p)) for p in sorted(glob.glob(out + "/decode_*.json"))}
for lab, d in runs.items():
    print(lab, "read GB/s %.0f" % d["read_bandwidth"]["reference_gbps"])
P = {lab: {(e["model"], e["tokens"], v): x["per_layer_us"] for e in d["decode"] for v, x in e["variants"].items()}
     for lab, d in runs.items()}
for key in sorted(P.get("a1", {})):
    row = [P[l].get(key) for l in ("a1", "b1", "a2", "b2") if l in P]
    if len(row) == 4 and None not in row:
        print(key, " ".join("%.1f" % x for x in row), " b/a %.3f %.3f" % (row[1] / row[0], row[3] / row[2]))
PY
for s in ${EXTRA:-}; do
  case $s in
    tests) (cd "$root" && PYTHONPATH=$SITE:$root MOETPLAN_KERNEL_CACHE=/tmp/kcB timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ > "$OUT/pytest_gpu.log" 2>&1; echo "pytest rc=$?"; tail -5 "$OUT/pytest_gpu.log") ;;
    prefill) for t in a:/tmp/va:/tmp/kcA b:$root:/tmp/kcB; do IFS=: read l d c <<< "$t"
               (cd "$d" && PYTHONPATH=$SITE:$d MOETPLAN_KERNEL_CACHE=$c timeout 200 python3 bench/kernels.py --quick --sections bw,prefill \
                 --prefill-kernels auto --out "$OUT/prefill_$l.json" > "$OUT/prefill_$l.log" 2>&1; echo "prefill $l rc=$?"; tail -12 "$OUT/prefill_$l.log"); done ;;
  esac
done
