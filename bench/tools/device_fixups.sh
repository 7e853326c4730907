#!/usr/bin/env bash
# On the GPU machine, after bench/tools/device_install.sh has extracted the pieces into /tmp/site (it runs this):
# repairs the carried vLLM 0.26 set needs on the H200 image (found on the device, 2026-12-02). Idempotent.
#  - vLLM's structured-output backends evaluate llguidance / xgrammar / lmformatenforcer annotations at class and
#    def time (a LazyLoader attribute access = an import), and those packages do not travel (structured output is
#    not used here): postpone the annotations (PEP 563) in those three files;
#  - pieces made before device_wheels.sh pinned openai 2.x and left typing_extensions to the image: openai 3.x
#    imports httpx2, which the image lacks (give a folder holding an openai 2.x wheel as $1 to replace it), and
#    the pieces' typing_extensions 4.15 shadowed the image's 4.16 (`typing_extensions.sentinel`): remove it.
#   bash bench/tools/device_fixups.sh [DIR_WITH_OPENAI_2_WHEEL]
set -euo pipefail
SITE=${MOETPLAN_SITE:-/tmp/site}
if ls "$SITE"/openai-3.*.dist-info >/dev/null 2>&1; then
  fix=${1:?openai 3.x is installed: give the folder holding an openai 2.x wheel}
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
