#!/usr/bin/env bash
# Wheels the lent GPU machine lacks, for its Python 3.12, into .whl/ (git-ignored; a device call names a folder of
# it in `carry` and installs it first, docs/KERNELS.md "Reproducing", docs/VLLM_VERSIONS.md "The GPU machine").
#
#   bash bench/tools/device_wheels.sh       moetplan's own needs (the image has torch, typer, rich, numpy, pyyaml,
#                                        psutil, safetensors, nvidia-ml-py, xxhash, httpx; not pydantic or
#                                        platformdirs) -> .whl/*.whl, installed with
#        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#        .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
#
#   bash bench/tools/device_wheels.sh vllm  vLLM 0.26.0 (CUDA 13, torch 2.11: the image's torch) trimmed for sm_90,
#                                        the packages it imports to serve a text model that the image lacks, and
#                                        moetplan's -> .whl/p1 .. .whl/pN, each a carry of at most the budget
#                                        (64 MiB less the working tree); .whl/manifest.json lists them. One device
#                                        call per piece, each carrying its folder:
#        run(carry=[".whl/pK"], command="bash bench/tools/device_install.sh && ...")
#      bench/tools/device_install.sh installs every piece present (pieces of earlier calls stay in the warm
#      machine's checkout) into /tmp/site and, once all are in, checks the imports; then
#        export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0
#      MOETPLAN_DS4=0 leaves out TileLang (DeepSeek-V4 only); MOETPLAN_FA2=1 adds FlashAttention 2.
#   Either mode rewrites .whl/ (the vllm pieces hold moetplan's wheels too). Downloads are cached in
#   $MOETPLAN_WHEEL_CACHE (default ~/.cache/moetplan/device-wheels).
set -euo pipefail
cd "$(dirname "$0")/../.."
mode=${1:-moetplan}
PY=python3; [ -x .venv/bin/python ] && PY=.venv/bin/python
CACHE=${MOETPLAN_WHEEL_CACHE:-$HOME/.cache/moetplan/device-wheels}
plat=""
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
  plat="$plat --platform $p"
done
download() {  # download DIR NAME==VERSION...
  local dir=$1; shift
  mkdir -p "$dir"
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat \
    -d "$dir" "$@"
}
# The versions the project's venv (scripts/setup.sh) resolved, else unpinned (one of each: two stop the install).
pins() {
  "$PY" - "$@" <<'PY'
import importlib.metadata as md
import sys
out = []
for n in sys.argv[1:]:
    if "==" in n:
        out.append(n)
        continue
    try:
        out.append(f"{n}=={md.version(n)}")
    except md.PackageNotFoundError:
        out.append(n)
print(" ".join(out))
PY
}
MOETPLAN_DEPS="pydantic pydantic-core annotated-types typing-inspection typing-extensions platformdirs"

if [ "$mode" = moetplan ]; then
  rm -rf .whl && mkdir -p .whl
  # shellcheck disable=SC2046
  download .whl $(pins $MOETPLAN_DEPS)
  ls .whl
  exit 0
fi
[ "$mode" = vllm ] || { echo "usage: bash bench/tools/device_wheels.sh [moetplan|vllm]" >&2; exit 2; }

VLLM=vllm==0.26.0
# What vLLM 0.26 imports when it starts serving a text model (bench/tools/vllm_imports.py: module-level imports from
# the CLI, OpenAI server, engine, GPU worker, models and attention backends), less the image's packages, with
# what those need in turn. fastapi/starlette are held to vLLM 0.26's range; compressed-tensors is its pin.
SERVE_DEPS="fastapi==0.136.3 starlette uvicorn python-multipart openai jiter distro sniffio openai-harmony \
msgspec pyzmq cbor2 pybase64 cachetools partial-json-parser watchfiles model-hosting-container-standards \
jmespath supervisor prometheus-fastapi-instrumentator compressed-tensors==0.17.0 loguru blake3 setproctitle"
DS4_DEPS="tilelang==0.1.9 apache-tvm-ffi==0.1.10 z3-solver==4.15.4.0 torch-c-dlpack-ext"

download "$CACHE/vllm" "$VLLM"
rm -rf "$CACHE/core" "$CACHE/ds4"
# shellcheck disable=SC2046
download "$CACHE/core" $(pins $MOETPLAN_DEPS $SERVE_DEPS)
ds4=()
if [ "${MOETPLAN_DS4:-1}" != 0 ]; then
  # shellcheck disable=SC2086
  download "$CACHE/ds4" $DS4_DEPS
  ds4=(--ds4-deps "$CACHE/ds4")
fi
fa2=(); [ "${MOETPLAN_FA2:-0}" = 1 ] && fa2=(--with-fa2)
# The working tree travels with every piece: the budget is what it leaves of 64 MiB, less 1 MiB of slack.
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
budget=$(python3 -c "print(round(64 - $tree / 2**20 - 1, 1))")
rm -rf .whl && mkdir -p .whl
python3 bench/tools/device_pack.py --vllm-wheel "$(ls "$CACHE"/vllm/vllm-0.26.0-*.whl)" --deps "$CACHE/core" \
  "${ds4[@]}" "${fa2[@]}" --out .whl --budget-mib "$budget" --arch 90
echo "working tree $(python3 -c "print(round($tree / 2**20, 1))") MiB; budget per piece $budget MiB"
