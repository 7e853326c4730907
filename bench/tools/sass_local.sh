#!/usr/bin/env bash
# The decode stages' registers, shared memory and round bodies from SASS, on a machine without a GPU (nvcc only):
# compiles csrc/moe_kernels.cu of a tree to a cubin against the venv's (CPU) torch headers, with empty stand-ins
# for the CUDA-library headers a CPU torch does not ship, then cuobjdump -res-usage and bench/tools/sass_loop.py per
# gemv stage form. How the numbers in docs/KERNELS.md under "SASS without a device" were made.
#   bash bench/tools/sass_local.sh [TREE]          (default: this checkout; ARCH=90a, OUT=/tmp/moetplan-sass)
# e.g. a variant:  git worktree add /tmp/v HEAD && (cd /tmp/v && patch -p1 < /tmp/X.patch)
#                  bash bench/tools/sass_local.sh /tmp/v
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
tree=$(cd "${1:-$root}" && pwd)
ARCH=${ARCH:-90a}
OUT=${OUT:-/tmp/moetplan-sass}
PY=python3; [ -x "$root/.venv/bin/python" ] && PY=$root/.venv/bin/python
mkdir -p "$OUT/stub/c10/cuda/impl"
printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > "$OUT/stub/c10/cuda/impl/cuda_cmake_macros.h"
echo 'typedef struct cusparseContext* cusparseHandle_t;' > "$OUT/stub/cusparse.h"
printf 'typedef struct cublasContext* cublasHandle_t;\ntypedef int cublasStatus_t;\n' > "$OUT/stub/cublas_v2.h"
echo 'typedef struct cublasLtContext* cublasLtHandle_t;' > "$OUT/stub/cublasLt.h"
printf 'typedef struct cusolverDnContext* cusolverDnHandle_t;\ntypedef int cusolverStatus_t;\n' > "$OUT/stub/cusolverDn.h"
: > "$OUT/stub/cusolver_common.h"
inc=$("$PY" -c "import sysconfig, torch.utils.cpp_extension as c; print(' '.join('-I' + p for p in c.include_paths() + [sysconfig.get_paths()['include']]))")
cuobjdump=$(command -v cuobjdump || "$PY" -c "import triton, pathlib; print(pathlib.Path(triton.__file__).parent / 'backends/nvidia/bin/cuobjdump')")
# shellcheck disable=SC2086
nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_$ARCH,code=sm_$ARCH -cubin -o "$OUT/k.cubin" \
  "$tree/csrc/moe_kernels.cu" $inc -I"$OUT/stub" -DTORCH_EXTENSION_NAME=moetplan_sass -diag-suppress 3306 \
  2> >(grep -v -e "bit-field" -e "C++20" -e "^\s*$" -e "\^" -e "Remark" >&2)
"$cuobjdump" -sass "$OUT/k.cubin" > "$OUT/k.sass"
echo "== gemv stages (sm_$ARCH): registers, spill stack, static shared memory"
"$cuobjdump" -res-usage "$OUT/k.cubin" 2>&1 | grep -A1 "gemv_stage" | grep -oE "Function [^ :]+|REG:[0-9]+|STACK:[0-9]+|SHARED:[0-9]+" | paste - - - -
for f in $(grep -oE "Function : _ZN4moet17gemv_stage_kernel[A-Za-z0-9_]+" "$OUT/k.sass" | awk '{print $3}' | sort -u); do
  echo "== $f"
  "$PY" "$root/bench/tools/sass_loop.py" "$OUT/k.sass" "$f"
done
