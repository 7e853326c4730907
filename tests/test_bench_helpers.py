"""Shared bits for the bench tests (no tests here): a small Plan built inline (test data, not a real model)."""
from __future__ import annotations

from typing import Any

from moetplan.contract.model import Attention, ModelSpec
from moetplan.contract import (
    GPUInfo, HardwareProfile, HostInfo, Launch, MemoryLedger, Placement, Plan, Prediction,
)


def tiny_plan(prediction: dict[str, Any] | None = None, concurrency: int = 2, served: str | None = "fake-moe") -> Plan:
    spec = ModelSpec(
        id="local:tiny-test", name="tiny test MoE", num_layers=2, moe_layers=2, hidden_size=64,
        moe_intermediate_size=32, n_routed_experts=8, top_k=2, vocab_size=1000, max_position_embeddings=4096,
        attention=Attention(kind="gqa", num_heads=4, num_kv_heads=2, head_dim=16),
        kv_bytes_per_token={"bf16": 256.0}, non_routed_params_b=0.001,
    )
    hw = HardwareProfile(
        gpus=[GPUInfo(name="Test GPU", vram_gib=24.0, mem_bw_gbps=900.0, compute_capability="8.9")],
        host=HostInfo(ram_gib=64.0),
    )
    pred = {"decode_tok_s": 100.0, "aggregate_tok_s": 180.0, "prefill_tok_s": 5000.0, "ttft_ms": 20.0,
            "token_hit_rate": 0.9, "zero_miss_step_share": 0.5, "misses_per_step": 3.0}
    pred.update(prediction or {})
    return Plan(
        model=spec, hardware=hw, placement=Placement(concurrency=concurrency, max_num_seqs=concurrency),
        memory=MemoryLedger(), prediction=Prediction(**pred), launch=Launch(served_model_name=served),
    )
