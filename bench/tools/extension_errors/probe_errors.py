"""Do errors raised in C++ extension code reach Python as exceptions on this machine, or crash the process?

The moetplan extension once segfaulted (inside std::ostream::_M_insert<long>) on a TORCH_CHECK that formats a
number, on the lent H200 (torch 2.11 + CUDA 13, g++ 13), while string-only messages raised (csrc/moe_kernels.cu
MOET_CHECK now formats numbers itself). Each case runs in its own process under a SIGSEGV handler that prints the
native stack; the results go to one JSON file:

    python3 bench/tools/extension_errors/probe_errors.py [--out extension_errors.json] [--cases a,b]

Cases: cpp_check / cpp_num / cpp_std (g++-compiled extension: TORCH_CHECK with a string, with a number,
std::runtime_error), cu_check / cu_num / cu_std (the same from nvcc-compiled host code, csrc/'s flags), torch_num
(torch's own error with a number), moetplan (the moetplan extension: gemv_plan with K = 100, a MOET_CHECK).
"""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parents[2]))
CASES = ["cpp_check", "cpp_num", "cpp_std", "cu_check", "cu_num", "cu_std", "torch_num", "moetplan"]
BUILD = Path(os.environ.get("MOETPLAN_PROBE_BUILD", "/tmp/moetplan-extension-errors"))


def run_case(case: str) -> None:
    """In the child: load the probes, trigger one error, print how it surfaced."""
    import torch
    from torch.utils.cpp_extension import load

    BUILD.mkdir(parents=True, exist_ok=True)
    segv = load("moetplan_segv_probe", [str(HERE / "segv.cpp")], build_directory=str(BUILD), extra_cflags=["-O3"])
    segv.install()
    try:
        if case.startswith("cpp"):
            getattr(segv, case)(*([5] if case == "cpp_num" else []))
        elif case.startswith("cu"):
            from moetplan.runtime.op.kernels import gencode_flags, normalize_archs

            archs = normalize_archs(None)
            os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(archs)
            cu = load("moetplan_cu_probe", [str(HERE / "cu.cu")], build_directory=str(BUILD),
                      extra_cuda_cflags=["-O3", "-std=c++17", "--expt-relaxed-constexpr", *gencode_flags(archs)],
                      extra_cflags=["-O3"])
            getattr(cu, case)(*([5] if case == "cu_num" else []))
        elif case == "torch_num":
            torch.zeros(6).view(4)
        else:
            from moetplan.runtime.op import kernels

            kernels.get_module().gemv_plan(True, False, False, 100, 1, -1)
        print("RESULT no exception")
    except Exception as e:  # noqa: BLE001 - the point is how it surfaced
        print(f"RESULT raised {type(e).__name__}: {str(e).splitlines()[0][:200]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="extension_errors.json")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        run_case(args.child)
        return 0
    import torch

    from bench.moe_kernels import atomic_write_json, machine_info

    machine = machine_info() if torch.cuda.is_available() else {"gpu": None, "torch": torch.__version__,
                                                               "host": platform.node()}
    res = {"machine": machine, "command": "python3 " + " ".join(sys.argv), "cases": []}
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"probe: unknown case {unknown[0]!r}; choose from {CASES}")
    for case in cases:
        t0 = time.time()
        p = subprocess.run([sys.executable, __file__, "--child", case], capture_output=True, text=True, timeout=600)
        result = next((ln[7:] for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
        row = {"case": case, "returncode": p.returncode, "crashed": p.returncode >= 100 or p.returncode < 0,
               "result": result, "seconds": round(time.time() - t0, 1),
               "stderr_tail": p.stderr.strip().splitlines()[-25:] if p.returncode else []}
        print(f"{case:10s} rc={p.returncode:4d}  {result or 'CRASHED'}", flush=True)
        res["cases"].append(row)
        atomic_write_json(Path(args.out), res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
