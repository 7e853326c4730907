"""A full-size model served by `moetplan run --dummy-weights` on this GPU, measured by `moetplan bench`, next to
the plan's prediction for the same machine (issue: predicted vs measured, end to end).

Cases (`--cases`, in order, each its own server):
  resident   all 2-bit experts resident on the GPU, MTP off; bench at --streams (default 1,4,16)
  mtp        the same with MTP (depth 1) on
  consumer   the GPU limited to a 32 GB card (gpu_memory_utilization), the 2-bit base pinned in host RAM, the GPU
             an expert cache over PCIe, the locality router (popularity = the model's published coverage curve);
             one stream: tok/s, token hit rate and zero-miss steps next to the plan's. MoE layers split out of
             vLLM's graphs (`split`; pinned as moe_graphs=split where the knob exists)
  consumer_replay  the same with moe_graphs=replay (tiered layers inside the graphs, a missing step re-run):
             only where the Plan schema has the knob
Each case: the plan solved for `--hw` (a probe of this machine) with that case's pins, served with dummy weights,
benched (decode tok/s at 1 stream, the batch curve at the others), stopped. The result file is rewritten after
every case, so a run cut short keeps what it measured; `--deadline-s` skips the cases that cannot finish; a case
whose server fails to start is retried with --enforce-eager when `--fallback-eager` and time allow (its rows say
eager). With MTP, vLLM's spec-decode counters give the measured acceptance, and the plan is also solved at that
acceptance (dummy weights draft at whatever rate random weights give). `--dry-run`: plans and predictions only.

Stock vLLM on the same model: its own weights (MXFP4 experts + FP8 dense) are sized from hwdb and compared with
the GPU's memory; it is served only where they fit.

    PYTHONPATH=. python3 bench/e2e_gpu.py --model deepseek-v4-flash --hw bench/results/hw_h200_probe.json \
        --out bench/results/e2e_h200.json
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.moe_kernels import atomic_write_json  # noqa: E402

GIB = 1024**3
CONSUMER_CARD_GIB = 32.0
# Pins every case shares: what the bench measures must not move with the planner's other choices.
COMMON_PINS = {"fp4_reserve_gib": 0.0}
CASES: dict[str, dict[str, Any]] = {
    "resident": {"tier": "resident", "pins": {"expert_tier": "resident", "mtp": 0}, "router": "locality"},
    "mtp": {"tier": "resident", "pins": {"expert_tier": "resident", "mtp": 1}, "router": "locality"},
    "consumer": {"tier": "host", "pins": {"expert_tier": "host", "mtp": 0, "max_num_seqs": 1}, "router": "locality",
                 "streams": (1,), "moe_graphs": "split", "card_gib": CONSUMER_CARD_GIB},
    # A host tier whose cache holds most experts (the 60 of 72.6 GiB; on a smaller card what leaves 30 GiB
    # for the dense weights, KV cache and activations).
    "host_large": {"tier": "host", "pins": {"expert_tier": "host", "mtp": 0, "max_num_seqs": 1}, "router": "locality",
                   "streams": (1,), "moe_graphs": "split", "cache_gib": 60.0, "label": "large-cache"},
    "consumer_replay": {"tier": "host", "pins": {"expert_tier": "host", "mtp": 0, "max_num_seqs": 1},
                        "router": "locality", "streams": (1,), "moe_graphs": "replay",
                        "card_gib": CONSUMER_CARD_GIB},
}


TOKEN_PROMPT = "The expert cache of a mixture-of-experts model on one consumer GPU"
TOKEN_COUNT = 32
# Cases whose greedy tokens must agree: replay against split (split computes every layer from resident rows).
TOKEN_PAIR = ("consumer_replay", "consumer")


def greedy_tokens(url: str, model: str) -> list[int] | str:
    """Greedy token ids of one fixed prompt (the cases' outputs compared token for token)."""
    import httpx

    try:
        r = httpx.post(f"{url.rstrip('/')}/completions", timeout=600, json={
            "model": model, "prompt": TOKEN_PROMPT, "max_tokens": TOKEN_COUNT, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        r.raise_for_status()
        return list(r.json()["choices"][0]["token_ids"])
    except Exception as e:  # noqa: BLE001 - the speed numbers still count
        return f"{type(e).__name__}: {e}"


def token_check(runs: dict[str, Any]) -> dict[str, Any] | None:
    """Whether replay's greedy tokens equal split's (None until both ran)."""
    toks = [runs.get(c, {}).get("greedy_tokens") for c in TOKEN_PAIR]
    if not all(isinstance(t, list) for t in toks):
        return None
    a, b = toks
    return {"pair": list(TOKEN_PAIR), "equal": a == b, "tokens": TOKEN_COUNT,
            "first_difference": next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)}


def case_pins(case: dict[str, Any], hw: Any = None) -> dict[str, Any]:
    """The case's pins; `moe_graphs` only where the Plan schema has that knob (split is then the only mode)."""
    from moetplan.contract import PINNABLE_KNOBS

    pins = dict(case["pins"])
    if case.get("cache_gib") and hw is not None:
        pins["gpu_expert_cache_gib"] = round(min(case["cache_gib"], hw.gpus[0].vram_gib - 30.0), 1)
    if case.get("moe_graphs") and "moe_graphs" in PINNABLE_KNOBS:
        pins["moe_graphs"] = case["moe_graphs"]
    return pins


def case_unsupported(case: dict[str, Any]) -> str | None:
    from moetplan.contract import PINNABLE_KNOBS

    if case.get("moe_graphs") == "replay" and "moe_graphs" not in PINNABLE_KNOBS:
        return "this tree has no moe_graphs knob: tiered plans run split (replay not built here)"
    return None


def card_pins(card_gib: float | None, hw: Any) -> dict[str, Any]:
    """A smaller card emulated on this GPU: its memory as a utilization of this one, and the batched-token budget
    the planner gives a card of that size (hwdb guards: vLLM's default below 70 GiB), which this GPU's size would
    otherwise set (DeepSeek-V4's sliding-window state grows with it: 3.3 GiB of KV per request at 8192)."""
    if card_gib is None:
        return {}
    from moetplan.hwdb import guards

    g = guards()["planner"]
    mnbt = g["batched_tokens_default_large"] if card_gib >= g["batched_tokens_large_card_gib"] \
        else g["batched_tokens_default_small"]
    return {"gpu_memory_utilization": round(card_gib / hw.gpus[0].vram_gib, 4), "max_num_batched_tokens": mnbt}


def _profile(hw_path: str):
    from moetplan.contract import HardwareProfile, load_json

    return load_json(HardwareProfile, hw_path)


def make_plan(model: str, hw: Any, case: dict[str, Any], context: int, max_seqs: int, card_gib: float | None,
              folder: Path) -> tuple[Path, Any]:
    from moetplan import hwdb
    from moetplan.contract import Goals, save_json
    from moetplan.launch.dummy import apply_dummy_weights
    from moetplan.plan.solver import solve

    spec = hwdb.model_spec(model)
    pins = {**COMMON_PINS, "context": context, "max_num_seqs": max_seqs, **case_pins(case, hw),
            **card_pins(card_gib, hw)}
    plan = solve(spec, hw, Goals(context=context, pinned=pins))
    apply_dummy_weights(plan, case["router"])
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "plan.json"
    save_json(plan, path)
    return path, plan


def predictions(model: str, hw: Any, case: dict[str, Any], context: int, max_seqs: int, card_gib: float | None,
                streams: tuple[int, ...], extra_pins: dict[str, Any] | None = None) -> dict[int, dict[str, Any]]:
    """The plan's prediction at each stream count (the same pins, the planner told the concurrency)."""
    from moetplan import hwdb
    from moetplan.contract import Goals
    from moetplan.plan.solver import solve

    spec = hwdb.model_spec(model)
    out = {}
    for n in streams:
        pins = {**COMMON_PINS, "context": context, "max_num_seqs": max_seqs, **case_pins(case, hw),
                **card_pins(card_gib, hw), **(extra_pins or {})}
        p = solve(spec, hw, Goals(context=context, concurrency=n, pinned=pins)).prediction
        out[n] = {"decode_tok_s": p.decode_tok_s, "aggregate_tok_s": p.aggregate_tok_s, "step_ms": p.step_ms,
                  "bottleneck": p.bottleneck, "token_hit_rate": p.token_hit_rate,
                  "zero_miss_step_share": p.zero_miss_step_share, "replay_rate": p.replay_rate,
                  "terms": [t.model_dump(mode="json") for t in p.terms]}
    return out


def stock_fit(model: str, hw: Any) -> dict[str, Any]:
    """Stock vLLM's own weights for the model (its released formats) against this GPU's memory."""
    from moetplan import hwdb

    s = hwdb.model_spec(model)
    e = hwdb.model_entry(model)
    routed_params = s.n_routed_experts * s.moe_layers * 3 * s.hidden_size * s.moe_intermediate_size
    # MXFP4: 4 bits per weight + one e8m0 byte per 32 weights.
    experts_gb = routed_params * (4 / 8 + 1 / 32) / 1e9
    dense_gb = (s.dense_gib_published or 0) * GIB / 1e9 if s.dense_gib_published else None
    vram_gb = hw.gpus[0].vram_gib * GIB / 1e9
    return {"expert_precision": s.expert_precision, "dense_precision": s.dense_precision,
            "routed_expert_weights_gb": round(experts_gb, 1), "dense_weights_gb": dense_gb and round(dense_gb, 1),
            "total_weights_gb": dense_gb and round(experts_gb + dense_gb, 1), "gpu_memory_gb": round(vram_gb, 1),
            "fits": bool(dense_gb and experts_gb + dense_gb < 0.95 * vram_gb),
            "hwdb_params_total_b": e.get("params_total_b") if isinstance(e, dict) else None}


def spec_decode_counters(url: str) -> dict[str, float]:
    """vLLM's speculative-decoding counters from /metrics (drafts, draft tokens, accepted tokens)."""
    import httpx

    try:
        text = httpx.get(url.rstrip("/") + "/metrics", timeout=5.0).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:spec_decode_num_") and not line.startswith("#"):
            name = line.split("{")[0].split(" ")[0].removeprefix("vllm:spec_decode_").removesuffix("_total")
            try:
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            except ValueError:
                continue
    return out


def _tail(path: Path, lines: int) -> list[str]:
    """The last lines of a log (the MoE layers' one-line-per-layer notes left out), for the result file."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [line[-400:] for line in text if "experts=" not in line or "tier=" not in line][-lines:]


class CallLimit(Exception):
    """The device call's limit is near (SIGTERM from `timeout`): stop the case, keep what was measured."""


def capture_sizes_arg(plan: Any, streams: tuple[int, ...], vllm_args: str) -> list[str]:
    """CUDA graphs captured at the batch sizes the bench decodes at only (streams x tokens per step): a device call
    has minutes, and DeepSeek-V4's TileLang kernels compile again for each new batch shape during capture (vLLM's
    default list runs to 512 tokens). The measured sizes replay the same graphs as under the default list. The
    plan's own compilation config (a split plan's) is kept: a later --compilation-config replaces an earlier one."""
    from moetplan.launch.command import compilation_config

    if "--enforce-eager" in vllm_args or "--compilation-config" in vllm_args:
        return []
    per_step = 1 + int(plan.placement.mtp or 0)
    comp = dict(compilation_config(plan) or {})
    comp["cudagraph_capture_sizes"] = sorted({int(s) * per_step for s in streams})
    return ["--compilation-config", json.dumps(comp, separators=(",", ":"))]


def run_case(name: str, case: dict[str, Any], args: argparse.Namespace, hw: Any, root: Path,
             deadline: float, vllm_args: str, res: dict[str, Any] | None = None) -> dict[str, Any]:
    """Plan, serve, bench and stop one case; fills and returns `res` (given by the caller, so what a case stopped
    by the call's limit had found, its plan and predictions, is kept)."""
    from moetplan.measure.phases import run_bench
    from moetplan.launch.harness import RunFailed, RunProcess

    streams = tuple(case.get("streams") or args.streams)
    card = case.get("card_gib")
    folder = root / (name + ("-eager" if "--enforce-eager" in vllm_args else ""))
    t0 = time.monotonic()
    plan_path, plan = make_plan(args.model, hw, case, args.context, max(streams), card, folder)
    res = {} if res is None else res
    res.update({"plan": str(plan_path), "placement": plan.placement.model_dump(mode="json"),
                "prediction_served_plan": plan.prediction.model_dump(mode="json"),
                "runtime_section": plan.runtime.model_dump(mode="json")})
    res["predicted"] = predictions(args.model, hw, case, args.context, max(streams), card, streams)
    port = 8100 + len(list(root.iterdir()))
    left = deadline - time.monotonic()
    extra_args = vllm_args.split() + capture_sizes_arg(plan, streams, vllm_args)
    extra = ["--", *extra_args] if extra_args else []
    res["vllm_extra_args"] = " ".join(extra_args) or None
    run = RunProcess([str(plan_path), "--port", str(port), "--timeout", str(int(max(left - 30, 60))), *extra],
                     log_path=folder / "events.log").start()
    try:
        ready = run.wait_ready(max(left - 25, 60))
        res["startup_s"] = round(time.monotonic() - t0, 1)
        print(f"{name}: ready after {res['startup_s']} s", flush=True)
        rec = run_bench(run.url, plan=plan_path, concurrency=streams, runs=args.runs, max_tokens=args.max_tokens,
                        prompt_lens=(args.prompt_len,), needle_lens=(), probes=False, warmup=1,
                        out=folder / "bench.run.json")
        res["measured"] = rec.measured
        res["runtime"] = rec.runtime
        res["errors"] = rec.errors
        res["notes"] = rec.notes
        res["ready"] = {k: ready.get(k) for k in ("endpoint", "model", "startup_s")}
        if name in TOKEN_PAIR:
            res["greedy_tokens"] = greedy_tokens(run.url, ready.get("model") or plan.launch.served_model_name)
        if case["pins"].get("mtp"):
            sd = spec_decode_counters(run.url)
            res["spec_decode"] = sd
            if sd.get("num_draft_tokens"):
                acc = sd.get("num_accepted_tokens", 0.0) / sd["num_draft_tokens"]
                res["measured_mtp_acceptance"] = round(acc, 4)
                try:
                    res["predicted_at_measured_acceptance"] = predictions(
                        args.model, hw, case, args.context, max(streams), card, streams,
                        {"mtp_acceptance": round(min(max(acc, 0.0), 1.0), 4)})
                except Exception as e:  # noqa: BLE001 - the measurement stands without it
                    res["predicted_at_measured_acceptance"] = f"{type(e).__name__}: {e}"
    except RunFailed as e:
        res["error"] = str(e)[-2000:]
        res["ready_failed"] = not res.get("startup_s")
    except BaseException as e:  # the call's limit (SIGTERM) or Ctrl-C: say so, stop the server, pass it on
        res["error"] = f"stopped before it finished: {type(e).__name__}: {e}"
        raise
    finally:
        if "measured" not in res:
            res["server_log_tail"] = _tail(folder / "plan.server.log", 60)
        res["stopped"] = {k: v for k, v in run.stop().items() if k in ("leftover", "leftover_killed", "returncode")}
        res["wall_s"] = round(time.monotonic() - t0, 1)
    return res


def case_rows(name: str, case: dict[str, Any], res: dict[str, Any], model: str) -> list[dict[str, Any]]:
    """One row per stream count: the `cases` list of the result file."""
    rows = []
    m = res.get("measured") or {}
    curve = {int(k): v for k, v in (m.get("batch_curve") or {}).items()}
    eager = "--enforce-eager" in (res.get("vllm_extra_args") or "")
    mode = case.get("moe_graphs") if case["tier"] != "resident" else None
    at_acc = res.get("predicted_at_measured_acceptance")
    for n, pred in sorted((res.get("predicted") or {}).items()):
        n = int(n)
        measured = m.get("decode_tok_s") if n == 1 else curve.get(n)
        why = None
        if measured is None:
            why = (res.get("error") or "; ".join(res.get("errors") or []) or "not measured")[-600:]
        rows.append({
            "case": f"{model} {case['tier']}{f' {mode}' if mode else ''}{' mtp1' if case['pins'].get('mtp') else ''}"
                    f"{' eager' if eager else ''}"
                    f"{' 32GB-card' if case.get('card_gib') else ''}{' ' + case['label'] if case.get('label') else ''}"
                    f" {n} stream{'s' if n > 1 else ''}",
            "streams": n,
            "cuda_graphs": not eager,
            "predicted_decode_tok_s": pred["decode_tok_s"] if n == 1 else pred["aggregate_tok_s"],
            "measured_decode_tok_s": measured,
            "measured_is": "single-stream decode tok/s" if n == 1 else "aggregate decode tok/s over the streams",
            "error_pct": (round(100 * (measured / (pred["decode_tok_s"] if n == 1 else pred["aggregate_tok_s"]) - 1), 1)
                          if measured else None),
            **({"predicted_token_hit_rate": pred.get("token_hit_rate"),
                "predicted_zero_miss_step_share": pred.get("zero_miss_step_share"),
                "measured_token_hit_rate": (res.get("runtime") or {}).get("token_hit_rate"),
                "measured_zero_miss_step_share": (res.get("runtime") or {}).get("zero_miss_step_share"),
                "predicted_replay_rate": pred.get("replay_rate"),
                "measured_replay_rate": (res.get("runtime") or {}).get("replay_rate"),
                "measured_replay": (res.get("runtime") or {}).get("replay")}
               if case["tier"] != "resident" else {}),
            **({"measured_mtp_acceptance": res.get("measured_mtp_acceptance"),
                "predicted_decode_tok_s_at_measured_acceptance":
                    (at_acc[n]["decode_tok_s"] if n == 1 else at_acc[n]["aggregate_tok_s"])}
               if isinstance(at_acc, dict) and n in at_acc else {}),
            **({"not_measured_because": why} if why else {}),
        })
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="deepseek-v4-flash")
    ap.add_argument("--hw", required=True, help="hw.json of this machine (moetplan probe)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/e2e_h200.json"))
    ap.add_argument("--cases", default="resident,consumer,mtp")
    ap.add_argument("--streams", default="1,4,16")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--work", type=Path, default=Path("/tmp/moetplan-e2e"))
    ap.add_argument("--deadline-s", type=float, default=540.0, help="stop starting cases after this many seconds")
    ap.add_argument("--deadline-at", type=float, help="the same as a Unix time (the device call's end less a margin; "
                    "bench/gpu_e2e.sh passes it): the earlier of the two counts")
    ap.add_argument("--min-case-s", type=float, default=200.0, help="a case needs at least this long to start")
    ap.add_argument("--vllm-args", default="", help="extra vLLM arguments for every server (e.g. --enforce-eager: "
                    "then the case names say eager)")
    ap.add_argument("--fallback-eager", action="store_true",
                    help="a case whose server did not start is retried with --enforce-eager if time allows")
    ap.add_argument("--dry-run", action="store_true", help="plans and predictions only (no server)")
    args = ap.parse_args()
    args.streams = tuple(int(s) for s in args.streams.split(",") if s)
    start = time.monotonic()
    deadline = start + args.deadline_s
    if args.deadline_at is not None:
        deadline = min(deadline, start + args.deadline_at - time.time())

    def on_term(signum: int, _frame: Any) -> None:
        raise CallLimit(f"signal {signum}: the device call's limit")

    signal.signal(signal.SIGTERM, on_term)
    hw = _profile(args.hw)
    from moetplan.measure.phases import machine_info

    try:
        import vllm
        vllm_version = vllm.__version__
    except Exception as e:  # noqa: BLE001
        vllm_version = f"not importable: {e}"
    doc: dict[str, Any] = {"machine": machine_info(), "vllm": vllm_version, "command": " ".join(sys.argv),
                           "hw_profile": args.hw, "model": args.model, "weights": "dummy (moetplan --dummy-weights)",
                           "cases": [], "runs": {}, "skipped": {}, "stock_vllm": stock_fit(args.model, hw)}
    if not doc["stock_vllm"]["fits"]:
        doc["skipped"]["stock_vllm"] = ("stock vLLM's own weights for this model do not fit this GPU: "
                                        f"{doc['stock_vllm']}")
    args.work.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out, doc)
    names = [c for c in args.cases.split(",") if c]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}: choose from {', '.join(CASES)}")
    if args.dry_run:
        for name in names:
            case = CASES[name]
            streams = tuple(case.get("streams") or args.streams)
            doc["runs"][name] = {"predicted": predictions(args.model, hw, case, args.context, max(streams),
                                                          case.get("card_gib"), streams),
                                 "pins": case_pins(case, hw), "error": "dry run: not served"}
            doc["cases"] += case_rows(name, case, doc["runs"][name], args.model)
        atomic_write_json(args.out, doc)
        for row in doc["cases"]:
            print(f"{row['case']:<60} predicted {row['predicted_decode_tok_s']:8.1f}")
        return 0
    for name in names:
        case = CASES[name]
        why_not = case_unsupported(case)
        if why_not:
            doc["skipped"][name] = why_not
            atomic_write_json(args.out, doc)
            continue
        attempts = [args.vllm_args] + (["--enforce-eager " + args.vllm_args]
                                       if args.fallback_eager and "--enforce-eager" not in args.vllm_args else [])
        for vllm_args in attempts:
            if deadline - time.monotonic() < args.min_case_s:
                doc["skipped"][name] = f"not started: {deadline - time.monotonic():.0f} s left of the call's budget"
                break
            stop = None
            res: dict[str, Any] = {}
            try:
                run_case(name, case, args, hw, args.work, deadline, vllm_args.strip(), res)
            except CallLimit as e:
                res["error"] = f"stopped at the device call's limit ({e}) before the server was measured"
                res.setdefault("vllm_extra_args", vllm_args.strip() or None)
                res.setdefault("server_log_tail", _tail(args.work / name / "plan.server.log", 60))
                stop = e
            except Exception as e:  # noqa: BLE001 - the other cases still run
                res.update({"error": f"{type(e).__name__}: {e}", "vllm_extra_args": vllm_args.strip() or None})
            key = name + ("-eager" if "--enforce-eager" in vllm_args else "")
            doc["runs"][key] = res
            doc["cases"] += case_rows(name, case, res, args.model)
            atomic_write_json(args.out, doc)
            print(json.dumps({"case": key, "rows": case_rows(name, case, res, args.model),
                              "error": res.get("error")}, default=str)[:3000], flush=True)
            check = token_check(doc["runs"])
            if check is not None:
                doc["token_check"] = check
                atomic_write_json(args.out, doc)
            if stop is not None:
                return 3
            if not res.get("ready_failed"):
                break  # measured, or failed after it started: an eager retry would not tell more
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
