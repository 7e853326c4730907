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
#        export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD
#      (CuTe-DSL's `cutlass` lives under nvidia_cutlass_dsl/dsl_packages, which its wheel's .pth adds; a --target
#      folder reads no .pth). MOETPLAN_DS4=0 leaves out TileLang, CuTe-DSL and quack (DeepSeek-V4 only);
#      MOETPLAN_FA2=1 adds FlashAttention 2.
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
# The GPU image's typing_extensions (4.16) is newer than what serving needs and its own packages need it
# (`typing_extensions.sentinel`): the vLLM set leaves it to the image.
VLLM_MOETPLAN_DEPS="pydantic pydantic-core annotated-types typing-inspection platformdirs"

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
# what those need in turn. fastapi/starlette are held to vLLM 0.26's range; compressed-tensors is its pin; openai
# 2.x (vLLM asks >=2.0): 3.x imports httpx2, which the GPU image lacks (docs/GPU_RESULTS.md).
SERVE_DEPS="fastapi==0.136.3 starlette uvicorn python-multipart openai==2.54.0 jiter distro sniffio openai-harmony \
msgspec pyzmq cbor2 pybase64 cachetools partial-json-parser watchfiles model-hosting-container-standards \
jmespath supervisor prometheus-fastapi-instrumentator compressed-tensors==0.17.0 loguru blake3 setproctitle"
# DeepSeek-V4 on CUDA: TileLang (hyper-connection kernels) with z3 and tvm-ffi; CuTe-DSL (vLLM 0.26 pins
# nvidia-cutlass-dsl[cu13] 4.6.0) and quack (0.6.0 accepts that pin): the KV compressor at head_dim 512, the
# indexer's q quantization and the k gather import them inside functions (vllm/models/deepseek_v4/compressor.py,
# common/ops). CuTe-DSL's cu12 libraries stay behind: the driver (580, CUDA 13) picks cu13.
DS4_DEPS="tilelang==0.1.9 apache-tvm-ffi==0.1.10 z3-solver==4.15.4.0 torch-c-dlpack-ext==0.1.5 \
nvidia-cutlass-dsl==4.6.0 nvidia-cutlass-dsl-libs-base==4.6.0 nvidia-cutlass-dsl-libs-core==4.6.0 \
nvidia-cutlass-dsl-libs-cu13==4.6.0 quack-kernels==0.6.0"

download "$CACHE/vllm" "$VLLM"
rm -rf "$CACHE/core" "$CACHE/ds4"  # the lists change; the xz cache is keyed by wheel name
# shellcheck disable=SC2046
download "$CACHE/core" $(pins $VLLM_MOETPLAN_DEPS $SERVE_DEPS)
ds4=()
if [ "${MOETPLAN_DS4:-1}" != 0 ]; then
  # shellcheck disable=SC2086
  download "$CACHE/ds4" $DS4_DEPS
  ds4=(--ds4-deps "$CACHE/ds4")
fi
fa2=(); [ "${MOETPLAN_FA2:-0}" = 1 ] && fa2=(--with-fa2)
# The working tree travels with every piece: the budget is what it leaves of 64 MiB, less 1 MiB of slack
# (MOETPLAN_CARRY_EXTRA_MIB: more that travels beside a piece, e.g. a copy of a worktree).
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
budget=$(python3 -c "print(round(64 - $tree / 2**20 - 1 - ${MOETPLAN_CARRY_EXTRA_MIB:-0}, 1))")
rm -rf .whl && mkdir -p .whl
python3 bench/tools/device_pack.py --vllm-wheel "$(ls "$CACHE"/vllm/vllm-0.26.0-*.whl)" --deps "$CACHE/core" \
  "${ds4[@]}" "${fa2[@]}" --out .whl --budget-mib "$budget" --arch 90 --cache "$CACHE/xz"
echo "working tree $(python3 -c "print(round($tree / 2**20, 1))") MiB; budget per piece $budget MiB"
