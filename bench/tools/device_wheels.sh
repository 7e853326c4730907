#!/usr/bin/env bash
# Wheels the lent GPU machine lacks for moetplan (its image has torch, typer, rich, numpy, pyyaml, psutil,
# safetensors, nvidia-ml-py, xxhash, httpx; not pydantic or platformdirs), for its Python 3.12, into .whl/
# (git-ignored; a device call names it in `carry` and installs it first, docs/KERNELS.md "Reproducing"):
#   bash bench/tools/device_wheels.sh
#   run: python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#        .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf .whl && mkdir -p .whl
# The versions the project's venv (scripts/setup.sh) resolved, else this python's (one of each: two stop the
# install there).
PY=python3; [ -x .venv/bin/python ] && PY=.venv/bin/python
pkgs=$("$PY" - <<'PY'
import importlib.metadata as md
names = ["pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions", "platformdirs"]
out = []
for n in names:
    try:
        out.append(f"{n}=={md.version(n)}")
    except md.PackageNotFoundError:
        out.append(n)
print(" ".join(out))
PY
)
plat=""
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  plat="$plat --platform $p"
done
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat -d .whl $pkgs
ls .whl
