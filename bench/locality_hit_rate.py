"""The store's hit rate under the locality router vs the plan's prediction, per cache size (no server).

What `moetplan run --dummy-weights --router locality` serves, without the model's compute: the runtime's expert
store (tiers.expert_store, as the plan's runtime section sizes it) fed by the locality router, one decode step of
`--seqs` tokens through every MoE layer at a time, after a prefill of `--prompt` tokens. Rows are small (the hit
rate depends on slots and routing, not on row bytes), so a run takes seconds. Reports the plan's predicted
token_hit_rate and misses per step next to the store's, cumulative from cold and over the steps after `--warmup`.
Usage: python bench/locality_hit_rate.py [--model qwen3-30b-a3b] [--cache-gib 1,2,4] [--steps 400] [--warmup 100]
       [--out bench/results/locality_hit_rate.json]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from moetplan import hwdb
from moetplan.contract import HardwareProfile, HostInfo, Placement, atomic_write_text
from moetplan.contract.layout import RowLayout
from moetplan.contract.machine import machine_info
from moetplan.contract.runtime import RuntimeKnobs, runtime_section
from moetplan.cost_model import predict
from moetplan.cost_model.coverage import expert_popularity
from moetplan.runtime.vllm.dummy_experts import RandomRowSource
from moetplan.runtime.vllm.routers import router_for
from moetplan.runtime.vllm.tiers import expert_store


def one(model: str, cache_gib: float, steps: int, warmup: int, seqs: int, prompt: int) -> dict:
    spec = hwdb.model_spec(model)
    # the placement `moetplan run --dummy-weights --set expert_tier=host` plans on a CPU machine (plan/cpu_backend)
    placement = Placement.for_model(spec, expert_tier="host", gpu_expert_cache_gib=cache_gib, max_num_seqs=seqs,
                                    context=1024, kv_dtype="bf16", kv_cache_gib=1.0)
    hw = HardwareProfile(source="probe:host", host=HostInfo(ram_gib=64.0), description="vLLM CPU backend")
    pred = predict(spec, hw, placement)
    knobs = RuntimeKnobs(weights="dummy", router="locality", router_popularity=tuple(expert_popularity(spec)))
    s = runtime_section(placement, knobs).model_copy(update={"expert_row_bytes": 0})  # small rows: same slots, routing
    lay = RowLayout.for_expert(32, 32, 1, "2bit")
    store = expert_store(s, RandomRowSource(lay, spec.moe_layers, spec.n_routed_experts), device="cpu", pin=False,
                         prefill_tokens=s.decode_batch_tokens)
    router = router_for(s.knobs, spec.top_k)
    t0 = time.perf_counter()
    for layer in range(spec.moe_layers):  # the prompt: pins only its own rows, feeds no decode heat
        ids = router.route(layer, torch.zeros(prompt, spec.top_k, dtype=torch.int64))
        for _ in store.ensure_chunks(layer, ids, num_tokens=prompt):
            pass
    z = torch.zeros(seqs, spec.top_k, dtype=torch.int64)
    cold = None
    for step in range(steps):
        if step == warmup:
            cold = store.stats()
            store.reset_stats()
        for layer in range(spec.moe_layers):
            store.ensure(layer, router.route(layer, z))
    k = store.stats()
    return {"model": model, "cache_gib": cache_gib, "cache_slots": s.gpu_expert_cache_slots,
            "cached_share": round(s.gpu_expert_cache_slots / (spec.moe_layers * spec.n_routed_experts), 4),
            "seqs": seqs,
            "predicted": {"token_hit_rate": pred.token_hit_rate, "misses_per_step": pred.misses_per_step,
                          "zero_miss_step_share": pred.zero_miss_step_share},
            "first_steps": None if cold is None else {"steps": warmup, "token_hit_rate": cold["token_hit_rate"]},
            "after_warmup": {"steps": steps - warmup, "token_hit_rate": k["token_hit_rate"],
                             "misses_per_step": k["misses_per_step"],
                             "zero_miss_step_share": k["zero_miss_step_share"]},
            "points_below_prediction": round(100 * (pred.token_hit_rate - k["token_hit_rate"]), 2),
            "seconds": round(time.perf_counter() - t0, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--cache-gib", default="1,2,4")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--seqs", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=12)
    ap.add_argument("--out", default="bench/results/locality_hit_rate.json")
    args = ap.parse_args()
    rows = [one(args.model, float(g), args.steps, args.warmup, args.seqs, args.prompt)
            for g in args.cache_gib.split(",")]
    for r in rows:
        print(f"{r['model']} cache {r['cache_gib']} GiB ({r['cached_share']:.0%}): predicted "
              f"{r['predicted']['token_hit_rate']:.3f}, store {r['after_warmup']['token_hit_rate']:.3f} over "
              f"{r['after_warmup']['steps']} steps after {args.warmup} ({r['points_below_prediction']:+.1f} points "
              "below)")
    doc = {"bench": "locality_hit_rate", "args": vars(args), "rows": rows, "machine": machine_info()}
    atomic_write_text(args.out, json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
