#!/usr/bin/env bash
# On the GPU machine: install the pieces `bench/tools/device_wheels.sh vllm` made (.whl/p1 ...) into /tmp/site.
# Each device call carries one piece; the pieces of earlier calls stay in the warm machine's checkout, so every
# call installs whatever has not been installed yet (one marker per archive in /tmp/site/.pieces). An archive split
# over pieces (`NAME.tar.xz.partK-of-N`) is joined once all its parts are here. Once every piece is in, it applies
# bench/tools/device_fixups.sh, registers moetplan's vLLM plugin entry point (the code runs from the checkout) and
# imports what serving needs, DeepSeek-V4's function-level imports (CuTe-DSL, quack, TileLang) included.
# MOETPLAN_BUILD_KERNELS=1: once moetplan's own needs are in, build its CUDA extension for sm_90a in a process of its
# own session (it outlives the call on a warm machine; ~110 s) into $MOETPLAN_KERNEL_CACHE (default /tmp/kc);
# bench/gpu_e2e.sh waits for it.
#   bash bench/tools/device_install.sh && \
#     export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD VLLM_USE_FLASHINFER_SAMPLER=0
set -euo pipefail
cd "$(dirname "$0")/../.."
SITE=${MOETPLAN_SITE:-/tmp/site}
mkdir -p "$SITE/.pieces"
manifest=$(ls .whl/p*/manifest.json 2>/dev/null | head -1 || true)
if [ -z "$manifest" ]; then
  echo "no piece of .whl/ here: carry one (bench/tools/device_wheels.sh vllm makes them)" >&2
  exit 2
fi
# Extract every archive (or joined set of parts) present and not yet installed, in parallel; print what is missing.
python3 - "$manifest" "$SITE" <<'PY'
import concurrent.futures as cf
import glob
import json
import os
import re
import subprocess
import sys
import tarfile
import time

manifest, site = json.load(open(sys.argv[1])), sys.argv[2]
part_re = re.compile(r"^(?P<name>.+)\.part(?P<k>\d+)-of-(?P<n>\d+)$")
here: dict[str, str] = {os.path.basename(f): f for f in glob.glob(".whl/p*/*") if not f.endswith("manifest.json")}
archives: dict[str, list[str]] = {}  # archive -> the files that make it (in order), from the manifest
for piece in manifest["pieces"]:
    for f in piece["files"]:
        m = part_re.match(f)
        archives.setdefault(m["name"] if m else f, []).append(f)
for name, files in archives.items():
    files.sort(key=lambda f: int(part_re.match(f)["k"]) if part_re.match(f) else 0)


def install(name: str, files: list[str]) -> str:
    t0 = time.monotonic()
    paths = [here[f] for f in files]
    if name.endswith(".whl"):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", site, *paths], check=True)
    else:
        cat = subprocess.Popen(["cat", *paths], stdout=subprocess.PIPE)
        with tarfile.open(fileobj=cat.stdout, mode="r|xz") as tar:
            for member in tar:  # archives extract in parallel into one tree: folders may appear meanwhile
                os.makedirs(os.path.join(site, os.path.dirname(member.name)), exist_ok=True)
                tar.extract(member, site, filter="tar")
        if cat.wait() != 0:
            raise RuntimeError(f"cat {paths} failed")
    open(os.path.join(site, ".pieces", name), "w").close()
    return f"installed {name} ({sum(os.path.getsize(p) for p in paths) / 2**20:.1f} MiB) in {time.monotonic() - t0:.1f} s"


todo = {n: fs for n, fs in archives.items()
        if not os.path.exists(os.path.join(site, ".pieces", n)) and all(f in here for f in fs)}
with cf.ThreadPoolExecutor(max_workers=min(12, os.cpu_count() or 4)) as ex:
    for line in ex.map(lambda kv: install(*kv), todo.items()):
        print(line, flush=True)
installed = {n for n in archives if os.path.exists(os.path.join(site, ".pieces", n))}
missing = [p["name"] for p in manifest["pieces"] if not all(f in here for f in p["files"])
           and not all((part_re.match(f)["name"] if part_re.match(f) else f) in installed for f in p["files"])]
open(os.path.join(site, ".pieces", "MISSING"), "w").write(" ".join(missing))
waiting = sorted(set(archives) - installed)
print("pieces still to carry:", " ".join(missing) if missing else "none",
      f"| archives waiting for them: {' '.join(waiting)}" if waiting else "")
PY
if [ "${MOETPLAN_BUILD_KERNELS:-0}" = 1 ] && [ ! -e /tmp/kc-build.pid ] \
    && PYTHONPATH="$SITE:$PWD" python3 -c "import pydantic, platformdirs, moetplan.cli" 2>/dev/null; then
  KC=${MOETPLAN_KERNEL_CACHE:-/tmp/kc}
  PYTHONPATH="$SITE:$PWD" MOETPLAN_KERNEL_CACHE=$KC setsid nohup python3 -c \
    'from moetplan.cli import main; main()' build-kernels --arch 9.0 > /tmp/kc-build.log 2>&1 < /dev/null &
  echo $! > /tmp/kc-build.pid
  echo "kernel build started in the background (pid $(cat /tmp/kc-build.pid), log /tmp/kc-build.log, cache $KC)"
fi
if [ -s "$SITE/.pieces/MISSING" ]; then
  exit 0
fi
bash bench/tools/device_fixups.sh
ep="$SITE/moetplan-0.1.0.dist-info"
if [ ! -e "$ep/entry_points.txt" ]; then
  mkdir -p "$ep"
  printf 'Metadata-Version: 2.1\nName: moetplan\nVersion: 0.1.0\n' > "$ep/METADATA"
  printf '[vllm.general_plugins]\nmoetplan = moetplan.runtime.plugin:register\n' > "$ep/entry_points.txt"
  : > "$ep/RECORD"
fi
[ -e "$SITE/.pieces/CHECKED" ] && { echo "install check passed earlier"; exit 0; }
PYTHONPATH="$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages:$PWD" python3 bench/tools/vllm_imports.py --check \
  && touch "$SITE/.pieces/CHECKED"
