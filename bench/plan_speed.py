"""How long `moetplan plan` takes: the whole command with no hardware given (the issue promises under a second on
a machine without a GPU), and solve() alone for the issue's examples and every reference box x target model.

    python bench/plan_speed.py [--out bench/results/plan_speed.json] [--runs 5]

The command is timed end to end in fresh interpreters (startup, imports, hardware resolution, search, output);
the import time of `moetplan.cli` is broken down by the module each registration line pulls in. Medians of
`--runs` after one warm-up (which also caches the bytecode, as an install does); JSON with machine info.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moetplan import __version__, hwdb  # noqa: E402
from moetplan.contract import Goals, atomic_write_text  # noqa: E402
from moetplan.contract.errors import InfeasibleError  # noqa: E402
from moetplan.plan.solver import solve  # noqa: E402
from moetplan.contract.machine import machine_info  # noqa: E402

CLI_CASES = [["plan", "--model", "glm-5.2"], ["plan", "--model", "deepseek-v4-flash"],
             ["plan", "--model", "glm-5.2", "--gpus", "2xrtx-4090", "--host-ram-gib", "256"]]
SOLVE_CASES = [("glm-5.2", "box", "rtx-pro-6000x2"), ("deepseek-v4-flash", "inline", ("1xrtx-5090", 96)),
               ("kimi-k2.7-code", "inline", ("1xrtx-4090", 32))]
SOLVE_CASES += [(m, "box", b) for m in ("glm-5.2", "deepseek-v4-flash", "kimi-k2.7-code") for b in hwdb.box_ids()]


PYCACHE = Path(tempfile.gettempdir()) / "moetplan-plan-speed-pycache"


def _env() -> dict[str, str]:
    """An installed moetplan runs from cached bytecode; so do the timed children (the warm-up run writes it, into a
    temporary prefix so the checkout stays clean), even where this shell sets PYTHONDONTWRITEBYTECODE."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**env, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "PYTHONPYCACHEPREFIX": str(PYCACHE)}


def time_cli(args: list[str], runs: int) -> dict:
    """Wall time, and the child's CPU time (user + sys), which a busy shared machine inflates far less."""
    import resource

    times, cpu, rc = [], [], None
    for i in range(runs + 1):
        t, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
        p = subprocess.run([sys.executable, "-m", "moetplan.cli", *args], capture_output=True, env=_env(), cwd=ROOT)
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        if i:
            times.append(time.perf_counter() - t)
            cpu.append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
        rc = p.returncode
    return {"command": "moetplan " + " ".join(args), "exit_code": rc, "median_s": round(statistics.median(times), 3),
            "max_s": round(max(times), 3), "median_cpu_s": round(statistics.median(cpu), 3)}


def import_breakdown() -> dict:
    p = subprocess.run([sys.executable, "-X", "importtime", "-c", "import moetplan.cli"], capture_output=True,
                       text=True, env=_env(), cwd=ROOT)
    out: dict[str, float] = {}
    for line in p.stderr.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+(\d+) \|(\s+)(\S+)", line)
        if m and len(m.group(2)) <= 3:  # the modules moetplan.cli imports directly
            out[m.group(3)] = round(int(m.group(1)) / 1e6, 3)
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:12])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "plan_speed.json"))
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    cli = [time_cli(c, args.runs) for c in CLI_CASES]
    for c in cli:
        print(f"{c['command']:70s} {c['median_s'] * 1000:7.0f} ms wall, {c['median_cpu_s'] * 1000:5.0f} ms CPU "
              f"(exit {c['exit_code']})")
    rows = []
    for model, kind, hwarg in SOLVE_CASES:
        spec = hwdb.model_spec(model)
        hw = hwdb.box_profile(hwarg) if kind == "box" else hwdb.inline_profile(hwarg[0], hwarg[1], None, None)
        times, outcome = [], ""
        for i in range(args.runs + 1):
            t = time.perf_counter()
            try:
                plan = solve(spec, hw, Goals())
                outcome = f"{plan.placement.expert_tier} {plan.prediction.decode_tok_s:.1f} tok/s"
            except InfeasibleError:
                outcome = "infeasible (diagnosed)"
            if i:
                times.append(time.perf_counter() - t)
        med = statistics.median(times)
        rows.append({"model": model, "hardware": hwarg if kind == "box" else f"{hwarg[0]} + {hwarg[1]} GiB RAM",
                     "median_s": round(med, 4), "max_s": round(max(times), 4), "outcome": outcome})
        print(f"solve {model:18s} {str(rows[-1]['hardware']):26s} {med * 1000:7.1f} ms  {outcome}")
    imports = import_breakdown()
    print("import moetplan.cli, by module it pulls in (s):", imports)
    doc = {"bench": "plan_speed", "moetplan": __version__, "runs": args.runs, "machine": machine_info(),
           "load_average": os.getloadavg(), "bytecode": "cached (as installed)", "cli": cli, "solve": rows, "cli_imports_s": imports,
           "max_solve_median_s": max(r["median_s"] for r in rows)}
    atomic_write_text(args.out, json.dumps(doc, indent=2) + "\n")
    print(f"slowest solve median {doc['max_solve_median_s'] * 1000:.0f} ms; wrote {args.out}")


if __name__ == "__main__":
    main()
