#!/usr/bin/env bash
# On the GPU machine: install the pieces `bench/tools/device_wheels.sh vllm` made (.whl/p1 ...) into /tmp/site.
# Each device call carries one piece; the pieces of earlier calls stay in the warm machine's checkout, so every
# call installs whatever has not been installed yet (markers in /tmp/site/.pieces). Once every core piece is in,
# it registers moetplan's vLLM plugin entry point (the code runs from the checkout) and imports what serving needs.
#   bash bench/tools/device_install.sh && export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0
set -euo pipefail
cd "$(dirname "$0")/../.."
SITE=${MOETPLAN_SITE:-/tmp/site}
mkdir -p "$SITE/.pieces"
for dir in .whl/p*/; do
  [ -d "$dir" ] || continue
  name=$(basename "$dir")
  [ -e "$SITE/.pieces/$name" ] && continue
  shopt -s nullglob
  wheels=("$dir"*.whl)
  tars=("$dir"*.tar.xz)
  shopt -u nullglob
  if [ ${#wheels[@]} -gt 0 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "${wheels[@]}"
  fi
  for t in "${tars[@]}"; do
    python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='tar')" "$t" "$SITE"
  done
  touch "$SITE/.pieces/$name"
  echo "installed $name (${#wheels[@]} wheels, ${#tars[@]} vLLM archives)"
done
manifest=$(ls .whl/p*/manifest.json 2>/dev/null | head -1 || true)
if [ -z "$manifest" ]; then
  echo "no piece of .whl/ here: carry one (bench/tools/device_wheels.sh vllm makes them)" >&2
  exit 2
fi
missing=$(python3 - "$manifest" "$SITE" <<'PY'
import json, os, sys
m = json.load(open(sys.argv[1]))
print(" ".join(p["name"] for p in m["pieces"] if p["group"] == "core"
               and not os.path.exists(os.path.join(sys.argv[2], ".pieces", p["name"]))))
PY
)
if [ -n "$missing" ]; then
  echo "core pieces still to carry: $missing"
  exit 0
fi
ep="$SITE/moetplan-0.1.0.dist-info"
if [ ! -e "$ep/entry_points.txt" ]; then
  mkdir -p "$ep"
  printf 'Metadata-Version: 2.1\nName: moetplan\nVersion: 0.1.0\n' > "$ep/METADATA"
  printf '[vllm.general_plugins]\nmoetplan = moetplan.runtime.plugin:register\n' > "$ep/entry_points.txt"
  : > "$ep/RECORD"
fi
PYTHONPATH="$SITE:$PWD" python3 - <<'PY'
import importlib, importlib.metadata as md
mods = ["vllm", "vllm.entrypoints.openai.api_server", "vllm.v1.engine.core", "vllm.v1.worker.gpu_worker",
        "vllm.v1.worker.gpu_model_runner", "vllm._C_stable_libtorch", "vllm._moe_C_stable_libtorch",
        "vllm.vllm_flash_attn.flash_attn_interface", "vllm.model_executor.models.deepseek_v2",
        "vllm.models.deepseek_v4", "vllm.models.deepseek_v32", "moetplan.runtime.plugin"]
bad = []
for m in mods:
    try:
        importlib.import_module(m)
    except Exception as e:  # noqa: BLE001 - report every failure, not the first
        bad.append(f"import {m}: {type(e).__name__}: {e}")
eps = [e.name for e in md.entry_points(group="vllm.general_plugins")]
print("vllm", md.version("vllm"), "| plugins:", eps)
import torch
if not bad:
    from vllm.vllm_flash_attn import flash_attn_interface as fa
    print("FA3 available:", fa.FA3_AVAILABLE, "| FA2 available:", fa.FA2_AVAILABLE)
if torch.cuda.is_available() and not bad:
    # one kernel from each pruned extension: the sm_90 code kept by bench/tools/fatbin_prune.py loads and runs
    from vllm import _custom_ops as ops
    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    out, w = torch.empty_like(x), torch.ones(256, device="cuda", dtype=torch.bfloat16)
    ops.rms_norm(out, x, w, 1e-6)
    ref = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    logits = torch.randn(4, 16, device="cuda")
    tw = torch.empty(4, 2, device="cuda")
    ti = torch.empty(4, 2, device="cuda", dtype=torch.int32)
    ops.topk_softmax(tw, ti, torch.empty_like(ti), logits, False)
    torch.cuda.synchronize()
    ok_norm = torch.allclose(out.float(), ref, atol=2e-2, rtol=2e-2)
    ok_topk = torch.equal(ti.sort(-1).values.long(), logits.topk(2, -1).indices.sort(-1).values)
    print("sm_90 kernels: rms_norm", "ok" if ok_norm else "WRONG", "| topk_softmax", "ok" if ok_topk else "WRONG")
    if not (ok_norm and ok_topk):
        bad.append("a pruned extension computed a wrong result")
for line in bad:
    print("FAILED", line)
raise SystemExit(1 if bad or "moetplan" not in eps else 0)
PY
