"""What would move the bottleneck: re-predict the plan with one knob changed and say what changes.

Lines like "+4 GiB GPU expert cache: miss steps 100% -> 62%, +6.1 tok/s (33.0 -> 39.1)" for `moetplan plan
--explain`. Each changed placement also goes through the memory ledger (the solver's own check): when the plan as
given fits but the change does not, the line says what would be short, and changes that fit come first.
"""
from __future__ import annotations

import math

from moetplan.cost_model.calibration import Calibration, load_calibration
from moetplan.cost_model.predict import predict
from moetplan.cost_model.terms import KV
from moetplan.contract.model import ModelSpec
from moetplan.plan.ledger import build_ledger
from moetplan.contract import HardwareProfile, Placement, Prediction


MAX_LINES = 6


def _variants(model: ModelSpec, hw: HardwareProfile, pl: Placement, base: Prediction) -> list[tuple[str, Placement]]:
    out: list[tuple[str, Placement]] = []

    def v(label: str, **changes: object) -> None:
        q = pl.resized(model, **changes)  # GiB changes become rows, as the solver sizes them
        if "gpu_expert_cache_gib" in changes or "expert_tier" in changes:
            max_slots = math.ceil(model.moe_layers / q.pp) * model.n_routed_experts
            q.gpu_expert_cache_slots = min(q.gpu_expert_cache_slots, max_slots)
        out.append((label, q))

    if pl.expert_tier != "resident":
        v("+4 GiB GPU expert cache", gpu_expert_cache_gib=pl.gpu_expert_cache_gib + 4)
        if pl.gpu_expert_cache_gib > 4:
            v("-4 GiB GPU expert cache (e.g. for more KV)", gpu_expert_cache_gib=pl.gpu_expert_cache_gib - 4)
        if pl.expert_tier == "nvme":
            v("+16 GiB pinned RAM arena", host_arena_gib=pl.host_arena_gib + 16)
            v("experts pinned in host RAM instead of NVMe (tier host)", expert_tier="host", host_arena_gib=0.0)
    if pl.fp4_reserve_gib > 0:
        v("no FP4 reserve (2-bit reads only)", fp4_reserve_gib=0.0)
    if model.has_speculation:
        if pl.mtp > 0:
            v(f"MTP depth {pl.mtp} -> {pl.mtp - 1}", mtp=pl.mtp - 1, mtp_acceptance=1.0)
        v(f"MTP depth {pl.mtp} -> {pl.mtp + 1}", mtp=pl.mtp + 1, mtp_acceptance=1.0)
    kv_term = next((t for t in base.terms if t.name == KV), None)
    if kv_term is not None and kv_term.share > 0.05 and pl.context >= 8192:
        v(f"context {pl.context} -> {pl.context // 2}", context=pl.context // 2)
    if pl.tp * 2 * pl.pp <= len(hw.gpus):
        v(f"tensor parallel {pl.tp} -> {pl.tp * 2} (needs {pl.tp * 2 * pl.pp} GPUs)", tp=pl.tp * 2)
    return out


def whatifs(model: ModelSpec, hw: HardwareProfile, placement: Placement,
            calib: Calibration | None = None) -> list[str]:
    """The knob changes that move decode speed most, best first, each with its effect in words."""
    calib = calib or load_calibration(hw)
    base = predict(model, hw, placement, calib)
    check_fit = build_ledger(model, hw, placement).ok  # a hand-made placement that does not fit: no fit notes
    scored: list[tuple[bool, float, str]] = []
    for label, pl in _variants(model, hw, placement, base):
        try:
            p = predict(model, hw, pl, calib)
        except Exception:  # noqa: BLE001 - a variant the hardware cannot express is simply not offered
            continue
        problems = build_ledger(model, hw, pl).problems if check_fit else []
        delta = p.decode_tok_s - base.decode_tok_s
        parts = []
        if base.zero_miss_step_share is not None and p.zero_miss_step_share is not None:
            parts.append(f"miss steps {1 - base.zero_miss_step_share:.0%} -> {1 - p.zero_miss_step_share:.0%}")
        if p.bottleneck != base.bottleneck:
            parts.append(f"bottleneck becomes {p.bottleneck}")
        parts.append(f"{delta:+.1f} tok/s ({base.decode_tok_s:.1f} -> {p.decode_tok_s:.1f})")
        if abs(p.aggregate_tok_s - base.aggregate_tok_s) > 0.05 * max(base.aggregate_tok_s, 1e-9) \
                and placement.concurrency > 1:
            parts.append(f"aggregate {base.aggregate_tok_s:.0f} -> {p.aggregate_tok_s:.0f} tok/s")
        line = f"{label}: " + ", ".join(parts)
        if problems:
            line += f" — does not fit as planned: {problems[0]}"
        scored.append((not problems, abs(delta), line))
    scored.sort(key=lambda s: (not s[0], -s[1]))
    return [s for _, _, s in scored[:MAX_LINES]]
