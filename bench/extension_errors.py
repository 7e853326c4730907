"""Does a failing TORCH_CHECK in a torch extension reach Python as a RuntimeError on this machine?

Builds three one-function extensions (plain C++ via load_inline, CUDA via load_inline, and a .cu file holding its
own PYBIND11_MODULE, as csrc/moe_kernels.cu does), calls each with an argument its TORCH_CHECK rejects, each in a
subprocess, and prints the exit code and what was raised. On the H200 machine of 2026-11-30 (torch 2.11.0+cu130)
all three died with SIGSEGV (rc -11): there the kernels' argument checks crash instead of raising, so ops
validates arguments before calling them (docs/KERNELS.md, H20 status).

    python3 bench/extension_errors.py
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

BODY = 'int64_t f(int64_t k) { TORCH_CHECK(k > 0, "k must be positive, got ", k); return k; }'


def build(kind: str):
    from torch.utils.cpp_extension import load, load_inline

    if kind == "cpp":
        return load_inline("probe_cpp", cpp_sources=[BODY], functions=["f"])
    if kind == "cu":
        return load_inline("probe_cu", cpp_sources=["int64_t f(int64_t k);"], cuda_sources=[BODY], functions=["f"])
    d = tempfile.mkdtemp(prefix="probe_cu_mod")
    path = os.path.join(d, "p.cu")
    with open(path, "w") as fh:
        fh.write("#include <torch/extension.h>\n" + BODY +
                 '\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("f", &f); }\n')
    return load("probe_cu_mod", [path], extra_cuda_cflags=["-O3", "-std=c++17"], extra_cflags=["-O3"])


def main() -> None:
    if len(sys.argv) > 1:  # the child: build one kind and call it with a rejected argument
        m = build(sys.argv[1])
        try:
            m.f(-1)
            print("no error")
        except RuntimeError as e:
            print("RuntimeError:", str(e).splitlines()[0][:80])
        return
    for kind in ("cpp", "cu", "cu_mod"):
        r = subprocess.run([sys.executable, __file__, kind], capture_output=True, text=True, timeout=300)
        last = (r.stdout.strip().splitlines() or [""])[-1]
        print(f"{kind:7s} rc={r.returncode:4d} {last[:100]}")


if __name__ == "__main__":
    main()
