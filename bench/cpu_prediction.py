"""The CPU backend's planned decode against what `moetplan bench` measures on the README's main job.

    .venv/bin/python bench/cpu_prediction.py                 # serve tiny-moe-py (`moetplan run`), bench it, compare
    .venv/bin/python bench/cpu_prediction.py --rounds 2      # bench the same server twice (load varies on a shared VM)
    .venv/bin/python bench/cpu_prediction.py --url http://127.0.0.1:8141 --plan ~/.cache/moetplan/runs/tiny-moe-py/plan.json

Starts the README's server (`moetplan run --model tiny-moe-py`: the trained tiny MoE; the first run trains it, cached
after) unless --url names one, runs `moetplan bench` against it (single stream, no probes) and writes
bench/results/cpu_prediction.json: the plan's predicted decode and prefill tok/s, the measured medians, their
ratios, and the machine's load average before and after each round (os.getloadavg), with machine info. On a shared
2-core VM the load is part of the figure: read the ratio next to it.

Prefill is predicted twice: by the plan (`moetplan run` derives the CPU kernels' ISA from the CPU's flags and takes
their per-core rates, and the dense GEMM and attention rates for that ISA, from hwdb/calibration/gpu_compute.yaml) and
with the rates `moetplan probe` measures on this machine (hw/profile_probe.measure_cpu_prefill and measure_cpu_dense,
measured here after the rounds), so both sources are judged.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moetplan.contract import atomic_write_text  # noqa: E402
from moetplan.contract.machine import machine_info  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bench(url: str, plan: str, out: Path, runs: int, tokens: int) -> dict[str, Any]:
    argv = [sys.executable, "-m", "moetplan.cli", "bench", "--url", url, "--plan", plan, "--concurrency", "1",
            "--runs", str(runs), "--max-tokens", str(tokens), "--no-probes", "--needle-lens", "", "--out", str(out)]
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    res = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise SystemExit(f"moetplan bench failed ({res.returncode}):\n{res.stdout[-3000:]}{res.stderr[-3000:]}")
    record = json.loads(out.read_text())
    m = record.get("measured") or {}
    return {"load_before": [round(x, 2) for x in load_before], "load_after": [round(x, 2) for x in os.getloadavg()],
            "seconds": round(time.perf_counter() - t0, 1), "decode_tok_s": m.get("decode_tok_s"),
            "decode_runs_tok_s": m.get("decode_runs_tok_s"), "decode_runs_wall_tok_s": m.get("decode_runs_wall_tok_s"),
            "prefill_tok_s": m.get("prefill_tok_s"), "prefill_by_len": m.get("prefill_by_len"),
            "ttft_ms": m.get("ttft_ms")}


def predict_with_probed_rates(plan: dict[str, Any]) -> dict[str, Any]:
    """The plan's prefill re-predicted with the CPU kernels' rates measured now (what `moetplan probe` records),
    and its terms: the check that the prediction holds from the component measurements, not the table."""
    from moetplan.contract import Plan
    from moetplan.cost_model import predict
    from moetplan.cost_model.calibration import load_calibration
    from moetplan.cost_model.prefill import prefill_run
    from moetplan.hw.profile_probe import measure_cpu_dense, measure_cpu_prefill

    p = Plan.model_validate(plan)
    detail = measure_cpu_prefill(p.hardware.host, quick=False)
    detail["dense"] = measure_cpu_dense(p.hardware.host, quick=False)
    h = p.hardware.host
    pr = predict(p.model, p.hardware, p.placement)
    calib = load_calibration(p.hardware)
    run = prefill_run(p.model, p.hardware, p.placement, calib)
    return {"host": {k: getattr(h, k) for k in ("cpu_kernel_isa", "cpu_expert_prefill_gflops",
                                                 "cpu_expert_scalar_gflops", "cpu_gemm_gflops", "cpu_gemm_dtype",
                                                 "cpu_attention_gflops")},
            "probe_detail": detail, "prefill_tok_s": pr.prefill_tok_s, "prefill_prompt_tokens": pr.prefill_prompt_tokens,
            "prefill_terms": [{"name": t.name, "ms": round(t.ms(calib, p.hardware), 2), "note": t.note}
                              for t in run.terms]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-moe-py")
    ap.add_argument("--url", help="an already running server (default: start `moetplan run --model MODEL`)")
    ap.add_argument("--plan", help="its plan.json (with --url)")
    ap.add_argument("--rounds", type=int, default=1, help="bench rounds against the same server")
    ap.add_argument("--runs", type=int, default=5, help="timed runs per round (median reported)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ready-timeout", type=float, default=3600.0, help="seconds for the first run's training + boot")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cpu_prediction.json"))
    args = ap.parse_args()

    run = None
    if args.url:
        if not args.plan:
            raise SystemExit("--url needs --plan (the plan.json the server serves)")
        url, plan_path = args.url, args.plan
    else:
        from moetplan.launch.harness import RunProcess

        run = RunProcess(["--model", args.model, "--port", str(_port())]).start()
        ready = run.wait_ready(args.ready_timeout)
        url, plan_path = str(run.url), str(ready["plan"])
    try:
        plan = json.loads(Path(plan_path).read_text())
        pred = plan.get("prediction") or {}
        rounds = []
        with tempfile.TemporaryDirectory(prefix="moetplan-cpu-pred-") as tmp:
            for i in range(args.rounds):
                r = _bench(url, plan_path, Path(tmp) / f"run{i}.json", args.runs, args.max_tokens)
                r["decode_measured_over_predicted"] = (round(r["decode_tok_s"] / pred["decode_tok_s"], 3)
                                                       if r.get("decode_tok_s") and pred.get("decode_tok_s") else None)
                rounds.append(r)
                print(f"round {i + 1}: decode {r['decode_tok_s']} tok/s measured vs {pred.get('decode_tok_s')} "
                      f"predicted (x{r['decode_measured_over_predicted']}); prefill {r['prefill_tok_s']} vs "
                      f"{pred.get('prefill_tok_s')}; load {r['load_before']} -> {r['load_after']}")
    finally:
        if run is not None:
            run.stop()
    hw = plan.get("hardware") or {}
    probed = predict_with_probed_rates(plan)
    for r in rounds:
        for key, pre in (("prefill_measured_over_predicted", pred), ("prefill_measured_over_probed", probed)):
            r[key] = (round(r["prefill_tok_s"] / pre["prefill_tok_s"], 3)
                      if r.get("prefill_tok_s") and pre.get("prefill_tok_s") else None)
        print(f"prefill {r['prefill_tok_s']} tok/s measured: x{r['prefill_measured_over_predicted']} the plan's "
              f"{pred.get('prefill_tok_s')}, x{r['prefill_measured_over_probed']} with the probed rates "
              f"({probed.get('prefill_tok_s')})")
    doc = {"bench": "cpu_prediction", "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "command": "python bench/cpu_prediction.py" + (f" --rounds {args.rounds}" if args.rounds != 1 else ""),
           "machine": machine_info(), "model": args.model, "cpu_count": os.cpu_count(),
           "host": hw.get("host"),
           "predicted": {k: pred.get(k) for k in ("decode_tok_s", "prefill_tok_s", "ttft_ms", "step_ms",
                                                  "bottleneck", "prefill_prompt_tokens")},
           "predicted_terms": [{"name": t.get("name"), "ms": t.get("ms")} for t in pred.get("terms") or []],
           "predicted_with_probed_rates": probed,
           "rounds": rounds}
    atomic_write_text(args.out, json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
