#!/usr/bin/env bash
# On the GPU machine, after bench/tools/device_install.sh has installed p1 and p2 into /tmp/site: three repairs
# the carried vLLM 0.26 set needed on the H200 image (found on the device, 2026-12-02):
#  - openai 3.x imports httpx2, which neither the image nor the pieces have; openai 2.x (vLLM asks >=2.0) uses
#    the image's httpx: install the 2.x wheel given in $1 over it;
#  - the pieces' typing_extensions 4.15 shadows the image's 4.16, which the image's own packages need
#    (`typing_extensions.sentinel`): remove ours;
#  - vLLM's structured-output backends evaluate llguidance / xgrammar / lmformatenforcer annotations at class and
#    def time (a LazyLoader attribute access = an import), and those packages do not travel (structured output is
#    not used here): postpone the annotations (PEP 563) in those three files.
#   bash bench/tools/device_fixups.sh DIR_WITH_OPENAI_2_WHEEL
set -euo pipefail
SITE=${MOETPLAN_SITE:-/tmp/site}
fix=${1:?give the folder holding the openai 2.x wheel}
if [ -d "$SITE/openai" ] && ls "$SITE"/openai-3.*.dist-info >/dev/null 2>&1; then
  rm -rf "$SITE/openai" "$SITE"/openai-3.*.dist-info
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$fix"/openai-2.*.whl
  echo "fixup: openai 2.x in place of 3.x"
fi
rm -rf "$SITE/typing_extensions.py" "$SITE"/typing_extensions-*.dist-info
so="$SITE/vllm/v1/structured_output"
for f in backend_guidance backend_xgrammar backend_lm_format_enforcer; do
  [ -f "$so/$f.py" ] || continue
  grep -q "^from __future__ import annotations" "$so/$f.py" && continue
  sed -i '0,/^import /s//from __future__ import annotations\nimport /' "$so/$f.py"
  python3 -m py_compile "$so/$f.py"
  echo "fixup: postponed annotations in $f.py"
done
