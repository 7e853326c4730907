"""The solver: enumerate the discrete choices, size the continuous ones, keep what fits, rank by the cost model.

Discrete: TP x PP, expert tier, KV dtype, MTP depth, context (a grid, or the pinned value).
Continuous (sized, not searched): GPU expert cache = what is left of the VRAM budget after everything else;
KV pool = the context promise (resident tier: plus all leftover, as vLLM does); host arena = usable RAM.
Every pinned knob (`--set name=value`) collapses its dimension; with all pinned, this evaluates one placement.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

from moetplan import __version__
from moetplan.contract.errors import InfeasibleError, UsageError
from moetplan.contract.model import GIB, ModelSpec
from moetplan.contract.sizing import reserve_slots, rows_in
from moetplan.plan import ledger as L
from moetplan.contract import (
    PINNABLE_KNOBS,
    parse_tokens,
    Alternative,
    Gate,
    Goals,
    HardwareProfile,
    MemoryLedger,
    Placement,
    Plan,
    Prediction,
    Reason,
)

TIERS = ("resident", "host", "nvme")
EXTRA_KNOBS = ("gate_tau", "max_num_batched_tokens")
SWEEP_TOP = 4  # discrete choices whose context range is swept in full


@dataclass
class Candidate:
    placement: Placement
    ledger: MemoryLedger
    prediction: Prediction


# --------------------------------------------------------------------------- pins


def parse_set(items: Iterable[str]) -> dict[str, Any]:
    """Parse `--set name=value` strings into typed pins (names exactly as in PINNABLE_KNOBS)."""
    pins: dict[str, Any] = {}
    int_knobs = {"tp", "pp", "context", "mtp", "max_num_seqs", "concurrency", "max_num_batched_tokens"}
    float_knobs = {"gpu_expert_cache_gib", "fp4_reserve_gib", "host_arena_gib", "mtp_acceptance",
                   "gpu_memory_utilization", "gate_tau"}
    for item in items:
        if "=" not in item:
            raise UsageError(f"--set '{item}': expected name=value (e.g. --set tp=2)")
        name, value = (s.strip() for s in item.split("=", 1))
        if name not in PINNABLE_KNOBS and name not in EXTRA_KNOBS:
            import difflib

            close = difflib.get_close_matches(name, PINNABLE_KNOBS + EXTRA_KNOBS, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise UsageError(f"--set: unknown knob '{name}'.{hint} Knobs: {', '.join(PINNABLE_KNOBS + EXTRA_KNOBS)}")
        try:
            if name in int_knobs:
                v: Any = parse_tokens(value) if name == "context" else int(value)
            elif name in float_knobs:
                v = float(value)
            else:
                v = value
        except ValueError:
            raise UsageError(f"--set {name}={value}: not a number") from None
        if name == "expert_tier" and v not in TIERS:
            raise UsageError(f"--set expert_tier={value}: must be one of {', '.join(TIERS)}")
        if name == "gpu_memory_utilization" and not 0.1 <= v <= 0.99:
            raise UsageError(f"--set gpu_memory_utilization={value}: must be between 0.1 and 0.99")
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v < 0:
            raise UsageError(f"--set {name}={value}: must not be negative")
        pins[name] = v
    return pins


# --------------------------------------------------------------------------- enumeration


def _tp_pp_options(model: ModelSpec, n_gpus: int, pins: dict[str, Any]) -> list[tuple[int, int]]:
    max_tp = L.guards()["planner"]["max_tp"]
    out = []
    for tp in (1, 2, 4, 8):
        if tp > min(n_gpus, max_tp) or not model.splits_over(tp):
            continue
        for pp in (1, 2, 4, 8):
            if tp * pp > n_gpus or pp > model.num_layers:
                continue
            # PP only to use all GPUs when TP cannot (a stage boundary costs a hop per step).
            if pp > 1 and tp * pp != n_gpus:
                continue
            out.append((tp, pp))
    if "tp" in pins or "pp" in pins:
        tp, pp = pins.get("tp"), pins.get("pp")
        want = [(t, p) for (t, p) in out if (tp is None or t == tp) and (pp is None or p == pp)]
        if not want:
            t, p = tp or 1, pp or 1
            if t * p > n_gpus:
                raise InfeasibleError(f"TP{t} x PP{p} needs {t * p} GPUs; this machine has {n_gpus}",
                                      [f"{t * p - n_gpus} GPU(s) short"], [f"use --set tp={n_gpus}"])
            if not model.splits_over(t):
                raise UsageError(f"--set tp={t}: {model.id}'s expert FFN ({model.moe_intermediate_size}) / {t} is "
                                 "not a multiple of 32 (2-bit blocks are 32 wide)")
            want = [(t, p)]
        return want
    return out


def _kv_options(model: ModelSpec, hw: HardwareProfile, pins: dict[str, Any]) -> list[str]:
    if "kv_dtype" in pins:
        if pins["kv_dtype"] not in model.kv_bytes_per_token:
            raise UsageError(f"--set kv_dtype={pins['kv_dtype']}: {model.id} has KV layouts "
                             f"{', '.join(model.kv_bytes_per_token)}")
        return [pins["kv_dtype"]]
    out = []
    for kv in model.kv_bytes_per_token:
        if kv == "nvfp4" and not all(g.fp4 for g in hw.gpus):
            continue  # the packed FP4 KV layout needs FP4-capable GPUs (SM120 in vLLM-Moet)
        if kv == "fp8" and not all(g.fp8 or float(g.compute_capability) >= 8.0 for g in hw.gpus):
            continue
        out.append(kv)
    return out or list(model.kv_bytes_per_token)[:1]


def _mtp_options(model: ModelSpec, pins: dict[str, Any]) -> list[int]:
    if "mtp" in pins:
        if pins["mtp"] > 0 and not model.has_speculation:
            raise UsageError(f"--set mtp={pins['mtp']}: {model.id} has no MTP head or drafter")
        return [pins["mtp"]]
    if model.mtp_layers > 0:
        return [d for d in L.guards()["planner"]["mtp_depths"]]
    return [0]  # separate drafters are opt-in (an extra download): --set mtp=3


def _context_options(model: ModelSpec, goals: Goals, pins: dict[str, Any]) -> list[int]:
    if "context" in pins:
        return [pins["context"]]
    lo = goal_context(goals, model)
    grid = [c for c in L.guards()["planner"]["context_grid"] if lo <= c <= model.max_position_embeddings]
    return sorted(set([lo] + grid))


def _default_pack_dir() -> str:
    """Packs are the quantization cache for every tier; without a probed/given pack dir, the user cache dir."""
    from moetplan.contract import default_pack_dir

    return str(default_pack_dir())


def goal_context(goals: Goals, model: ModelSpec) -> int:
    if goals.context:
        return min(goals.context, model.max_position_embeddings)
    return min(L.guards()["planner"]["default_context"][goals.objective], model.max_position_embeddings)


# --------------------------------------------------------------------------- sizing one candidate


def size_placement(model: ModelSpec, hw: HardwareProfile, goals: Goals, pins: dict[str, Any], tp: int, pp: int,
                   tier: str, kv: str, mtp: int, context: int) -> tuple[Placement | None, list[str]]:
    """Size the continuous knobs for one discrete choice. Returns (placement, []) or (None, problems)."""
    vram = min(g.vram_gib for g in hw.gpus[: tp * pp])
    util = pins.get("gpu_memory_utilization", L.gpu_memory_utilization_default(vram))
    conc = pins.get("concurrency", goals.concurrency)
    seqs = pins.get("max_num_seqs", max(conc, 1))
    gate_tau = pins.get("gate_tau")
    p = Placement(
        tp=tp, pp=pp, expert_tier=tier, kv_dtype=kv, context=context, mtp=mtp,
        mtp_acceptance=pins.get("mtp_acceptance", model.mtp_accept(mtp)),
        max_num_seqs=seqs, concurrency=conc, gpu_memory_utilization=util,
        max_num_batched_tokens=pins.get("max_num_batched_tokens", max(8192, min(context, 16384))),
        pack_dir=goals.pack_dir or hw.storage.path or _default_pack_dir(),
        gate=Gate(enabled=bool(gate_tau), tau=gate_tau or 0.5),
        expert_row_bytes=int(model.expert_bytes("2bit", tp)), fp4_row_bytes=int(model.expert_bytes("fp4", tp)),
    )
    budget = vram * util
    fixed = sum(i.gib for i in L.fixed_gpu_items(model, p))
    kv_need = L.kv_needed_gib(model, p)
    row2, row4 = p.expert_row_bytes, p.fp4_row_bytes
    max_slots = math.ceil(model.moe_layers / pp) * model.n_routed_experts
    left = budget - fixed - kv_need
    problems: list[str] = []

    if tier == "resident":
        left -= L.experts_resident_gib(model, p)
        if left < 0:
            return None, [f"resident: short {-left:.1f} GiB VRAM per GPU"]
        reserve = pins.get("fp4_reserve_gib", _default_reserve(model, p, left, row4))
        if p.gate.enabled and "fp4_reserve_gib" not in pins:
            reserve = min(left, L.fp4_gate_floor_slots(model, p) * row4 / GIB)
        if reserve > left + 1e-9:
            return None, [f"resident: FP4 reserve {reserve:.1f} GiB does not fit ({left:.1f} GiB left)"]
        p.fp4_reserve_slots = reserve_slots(rows_in(reserve, row4), math.ceil(model.moe_layers / pp),
                                            model.n_routed_experts)
        p.kv_cache_gib = kv_need + (left - reserve)  # vLLM hands the rest of the budget to the KV pool
    else:
        reserve = pins.get("fp4_reserve_gib", 0.0)
        if p.gate.enabled and "fp4_reserve_gib" not in pins:
            reserve = L.fp4_gate_floor_slots(model, p) * row4 / GIB
        cache = pins.get("gpu_expert_cache_gib", left - reserve)
        slots = min(rows_in(cache, row2), max_slots)
        if slots >= max_slots and "expert_tier" not in pins:
            return None, [f"{tier}: every expert fits in the cache; resident is the same placement"]
        if cache + reserve > left + 1e-9:
            return None, [f"{tier}: cache {cache:.1f} + reserve {reserve:.1f} GiB exceed {left:.1f} GiB left"]
        p.gpu_expert_cache_slots = slots
        p.fp4_reserve_slots = reserve_slots(rows_in(reserve, row4), math.ceil(model.moe_layers / pp),
                                            model.n_routed_experts)
        p.kv_cache_gib = kv_need + max(0.0, left - reserve - p.gpu_expert_cache_gib)
        floor = L.cache_floor_slots(model, p)
        if slots < floor:
            return None, [f"{tier}: GPU expert cache {slots} slots < floor {floor}"]
        if tier == "nvme":
            usable = L.host_usable_gib(hw) - L.host_reserve_gib(hw)
            arena = pins.get("host_arena_gib", max(0.0, min(usable, model.routed_gib("2bit", 1))))
            if arena < L.guards()["host"]["arena_min_gib"] and "host_arena_gib" not in pins:
                arena = 0.0  # page cache as the only RAM tier
            p.host_arena_rows = rows_in(math.floor(arena * 10) / 10, row2 * tp)
    if p.fp4_reserve_slots > 0:
        if p.gate.enabled and p.fp4_reserve_slots < L.fp4_gate_floor_slots(model, p):
            p.gate.degraded = True
            p.gate.max_promotions_per_step = p.fp4_reserve_slots // max(1, math.ceil(model.moe_layers / pp))
    p.kv_cache_gib = math.floor(p.kv_cache_gib * 1000) / 1000  # round down: never past the budget
    check = L.build_ledger(model, hw, p)
    if not check.ok:
        return None, check.problems
    return p, problems


def _default_reserve(model: ModelSpec, p: Placement, left_gib: float, row4: float) -> float:
    """Resident tier: spend up to a quarter of the slack on FP4 rows for the hottest experts (quality, not speed),
    capped at one step's working set; never below one layer's top-k (useless) — else 0."""
    ws = L.step_working_set_slots(model, p) // max(1, p.mtp + 1)
    want = min(left_gib * 0.25, ws * row4 / GIB)
    return round(want, 1) if want * GIB >= model.top_k * model.moe_layers / p.pp * row4 else 0.0


# --------------------------------------------------------------------------- solve


def search(model: ModelSpec, hw: HardwareProfile, goals: Goals, calib: Any = None) -> list[Candidate]:
    """Every feasible candidate, predicted; InfeasibleError (with what is short and what fits) if none."""
    from moetplan.cost_model import predict

    pins = dict(goals.pinned)
    if not hw.gpus:
        raise InfeasibleError("no GPU in the hardware profile to plan for",
                              ["0 GPUs"], ["plan for a reference box: --box rtx-5090x1", "or --gpus 1xrtx-5090"])
    tiers = [pins["expert_tier"]] if "expert_tier" in pins else list(TIERS)
    problems: dict[str, list[str]] = {}
    ctx_opts = _context_options(model, goals, pins)

    def evaluate(choice: tuple, ctx: int) -> Candidate | None:
        p, why = size_placement(model, hw, goals, pins, *choice, ctx)
        if p is None:
            problems.setdefault(choice[2], []).extend(why)
            return None
        return Candidate(p, L.build_ledger(model, hw, p).ledger, predict(model, hw, p, calib))

    # Phase 1: every discrete choice at the smallest context the goals accept.
    first: list[tuple[tuple, Candidate]] = []
    for tp, pp in _tp_pp_options(model, hw.num_gpus, pins):
        for tier in tiers:
            for kv in _kv_options(model, hw, pins):
                for mtp in _mtp_options(model, pins):
                    c = evaluate((tp, pp, tier, kv, mtp), ctx_opts[0])
                    if c is not None:
                        first.append(((tp, pp, tier, kv, mtp), c))
    if not first:
        raise _diagnose(model, hw, goals, pins, problems)
    # Phase 2: longer contexts only for the most promising choices (a context sweep never reorders them by much:
    # more KV only takes expert cache away), plus the best choice of each KV dtype, which decides context reach.
    first.sort(key=lambda fc: -fc[1].prediction.decode_tok_s)
    keep = first[:SWEEP_TOP]
    for kv in {fc[0][3] for fc in first}:
        best_kv = next(fc for fc in first if fc[0][3] == kv)
        if best_kv not in keep:
            keep.append(best_kv)
    cands = [c for _, c in first]
    for choice, _ in keep:
        for ctx in ctx_opts[1:]:
            c = evaluate(choice, ctx)
            if c is None:
                break  # larger contexts only need more memory
            cands.append(c)
    return cands


def solve(model: ModelSpec, hw: HardwareProfile, goals: Goals | None = None, calib: Any = None) -> Plan:
    """Search (or, with every knob pinned, evaluate) and return the chosen Plan; InfeasibleError if nothing fits.

    The plan's `launch` section is left empty: the launch is built from the plan (`launch.command.build_launch`)."""
    goals = goals or Goals()
    cands = search(model, hw, goals, calib)

    chosen = _choose(cands, goals, model)
    plan = Plan(
        moetplan_version=__version__, model=model, hardware=hw, goals=goals, placement=chosen.placement,
        memory=chosen.ledger, prediction=chosen.prediction,
        reasons=_reasons(model, hw, goals, chosen, cands),
        alternatives=_alternatives(cands, chosen),
        warnings=_warnings(model, hw, chosen),
    )
    return plan


def _key(c: Candidate) -> tuple:
    return (c.placement.context, c.prediction.decode_tok_s)


def _choose(cands: list[Candidate], goals: Goals, model: ModelSpec) -> Candidate:
    lo = goal_context(goals, model)
    ok = [c for c in cands if c.placement.context >= lo] or cands
    if goals.objective == "decode":
        return max(ok, key=lambda c: (c.prediction.decode_tok_s, c.placement.context))
    if goals.objective == "context":
        return max(ok, key=lambda c: (c.placement.context, c.prediction.decode_tok_s))
    best = max(c.prediction.decode_tok_s for c in ok)
    keep = L.guards()["planner"]["balanced_keep_decode"]
    near = [c for c in ok if c.prediction.decode_tok_s >= keep * best]
    return max(near, key=lambda c: (c.placement.context, c.prediction.decode_tok_s))


def pareto(cands: list[Candidate]) -> list[Candidate]:
    """Non-dominated set over (context up, decode tok/s up), best decode per context first."""
    best: dict[int, Candidate] = {}
    for c in cands:
        k = c.placement.context
        if k not in best or c.prediction.decode_tok_s > best[k].prediction.decode_tok_s:
            best[k] = c
    out, top = [], -1.0
    for ctx in sorted(best, reverse=True):
        c = best[ctx]
        if c.prediction.decode_tok_s > top:
            out.append(c)
            top = c.prediction.decode_tok_s
    return sorted(out, key=lambda c: c.placement.context)


def _summary(p: Placement) -> dict[str, Any]:
    return {k: getattr(p, k) for k in ("tp", "pp", "expert_tier", "gpu_expert_cache_gib", "fp4_reserve_gib",
                                       "host_arena_gib", "kv_dtype", "context", "mtp", "max_num_seqs")}


def _label(p: Placement) -> str:
    s = f"TP{p.tp}" + (f"xPP{p.pp}" if p.pp > 1 else "") + f" {p.expert_tier}"
    if p.expert_tier != "resident":
        s += f" cache {p.gpu_expert_cache_gib:.1f}G"
    return s + f" kv={p.kv_dtype} mtp={p.mtp} ctx={p.context // 1024}K"


def _alternatives(cands: list[Candidate], chosen: Candidate, n: int = 6) -> list[Alternative]:
    """The whole Pareto front (context vs decode tok/s) and the best of up to `n` other (tier, TP, PP) families."""
    front = pareto(cands)
    front_ids = {id(c) for c in front}
    # Best of each (tier, tp) family too, so the user sees why the others lost.
    fams: dict[tuple, Candidate] = {}
    for c in cands:
        k = (c.placement.expert_tier, c.placement.tp, c.placement.pp)
        if k not in fams or c.prediction.decode_tok_s > fams[k].prediction.decode_tok_s:
            fams[k] = c
    picked: list[Candidate] = [c for c in front if c is not chosen]
    others = 0
    for c in sorted(fams.values(), key=lambda c: -c.prediction.decode_tok_s):
        if others < n and c is not chosen and all(c is not q for q in picked):
            picked.append(c)
            others += 1
    return [Alternative(label=_label(c.placement), placement=_summary(c.placement), context=c.placement.context,
                        decode_tok_s=round(c.prediction.decode_tok_s, 2),
                        aggregate_tok_s=round(c.prediction.aggregate_tok_s, 2),
                        bottleneck=c.prediction.bottleneck, pareto=id(c) in front_ids) for c in picked]


def _reasons(model: ModelSpec, hw: HardwareProfile, goals: Goals, ch: Candidate,
             cands: list[Candidate]) -> list[Reason]:
    p, pins = ch.placement, goals.pinned
    gpu = hw.gpus[0]
    r: list[Reason] = []

    def add(knob: str, text: str) -> None:
        r.append(Reason(knob=knob, text=("pinned (--set). " if knob in pins else "") + text))

    exp_rank = L.experts_resident_gib(model, p)
    ranks = p.tp * p.pp
    add("tp", (f"one GPU of {hw.num_gpus}: " if ranks == 1 else
               f"TP{p.tp}" + (f" x PP{p.pp}" if p.pp > 1 else "") + f" over {ranks} of {hw.num_gpus} GPUs: ")
        + f"dense {model.dense_bytes() / GIB:.1f} GiB and 2-bit experts {model.routed_gib():.1f} GiB"
        + ("" if ranks == 1 else f" are split {ranks} ways")
        + (" (PCIe all-reduce per layer; no NVLink)" if p.tp > 1 and not hw.p2p else ""))
    if p.expert_tier == "resident":
        add("expert_tier", f"resident: the 2-bit experts ({exp_rank:.1f} GiB/rank) fit in VRAM "
            f"({gpu.vram_gib:.0f} GiB x {p.gpu_memory_utilization:.2f}) beside dense and KV; no expert misses")
    else:
        short = exp_rank - (ch.ledger.gpus[0].budget_gib - sum(
            i.gib for i in ch.ledger.gpus[0].items if i.name not in ("expert_cache", "kv_cache", "fp4_reserve")))
        where = ("pinned host RAM" if p.expert_tier == "host" else
                 f"NVMe packs with a {p.host_arena_gib:.0f} GiB pinned RAM arena")
        add("expert_tier", f"{p.expert_tier}: 2-bit experts ({exp_rank:.1f} GiB/rank) exceed VRAM by "
            f"{max(short, 0):.1f} GiB; the base lives in {where}, the GPU holds an expert cache")
        floor = L.cache_floor_slots(model, p)
        cov = p.gpu_expert_cache_slots / (math.ceil(model.moe_layers / p.pp) * model.n_routed_experts)
        add("gpu_expert_cache_gib", f"{p.gpu_expert_cache_gib:.1f} GiB = {p.gpu_expert_cache_slots} slots "
            f"({cov:.0%} of experts, {p.gpu_expert_cache_slots / floor * 1.15:.2f}x one step's working set; "
            f"floor 1.15x): all VRAM left after dense, KV for {p.context} tokens and workspaces; predicted "
            f"zero-miss steps {(ch.prediction.zero_miss_step_share or 0):.0%}")
        if p.expert_tier == "nvme":
            add("host_arena_gib", f"{p.host_arena_gib:.0f} GiB pinned arena: usable RAM after OS and workers "
                f"({L.host_usable_gib(hw):.0f} GiB usable of {hw.host.ram_gib:.0f}); host RAM cannot pin all "
                f"{model.routed_gib():.1f} GiB")
    if p.fp4_reserve_gib > 0:
        add("fp4_reserve_gib", f"{p.fp4_reserve_gib:.1f} GiB = {p.fp4_reserve_slots} hottest experts at FP4 "
            "(quality where routing concentrates)" + (" — gate degraded: below 1.7x working set, promotions "
                                                      "capped" if p.gate.degraded else ""))
    else:
        add("fp4_reserve_gib", "0: no VRAM to spare for FP4 rows" if p.expert_tier != "resident"
            else "0: slack too small for a useful FP4 reserve")
    alts_kv = sorted({c.placement.kv_dtype for c in cands})
    add("kv_dtype", f"{p.kv_dtype}: {model.kv_bytes_per_token[p.kv_dtype] / 1024:.1f} KiB/token "
        f"(options here: {', '.join(alts_kv)})")
    lo = goal_context(goals, model)
    add("context", f"{p.context} tokens: objective '{goals.objective}' (minimum {lo}); KV pool "
        f"{p.kv_cache_gib:.1f} GiB/rank")
    if p.mtp:
        add("mtp", f"MTP depth {p.mtp}: {p.mtp_acceptance:.2f} tokens per step expected")
    else:
        add("mtp", "no speculation" + ("" if model.has_speculation else " (the model has no MTP head)"))
    add("max_num_seqs", f"{p.max_num_seqs} (concurrency {p.concurrency}); the expert-cache floor scales "
        "with min(seqs, 4)")
    add("gpu_memory_utilization", f"{p.gpu_memory_utilization:.2f}: leaves room for the CUDA context on a "
        f"{gpu.vram_gib:.0f} GiB card")
    return r


def _warnings(model: ModelSpec, hw: HardwareProfile, ch: Candidate) -> list[str]:
    w = list(hw.warnings)
    p = ch.placement
    if p.expert_tier in ("host", "nvme") and hw.host.memlock_bytes is not None:
        w.append(f"memlock limit is {hw.host.memlock_bytes / 2**20:.0f} MiB: pinned host buffers may fail; "
                 "run `ulimit -l unlimited`")
    if p.expert_tier == "nvme" and hw.storage.warnings:
        w.extend(hw.storage.warnings)
    if p.expert_tier == "nvme" and p.host_arena_gib == 0:
        w.append("no pinned arena: the page cache is the only RAM tier (vLLM-Moet measured ~22% slower decode)")
    if model.mtp_layers == 0 and model.drafter_gib > 0 and p.mtp == 0:
        w.append(f"{model.id} has a separate drafter ({model.drafter_gib:.0f} GiB); enable with --set mtp=3")
    return w


# --------------------------------------------------------------------------- infeasible: what is short, what fits


def _diagnose(model: ModelSpec, hw: HardwareProfile, goals: Goals, pins: dict[str, Any],
              problems: dict[str, list[str]]) -> InfeasibleError:
    gpu = hw.gpus[0]
    n = hw.num_gpus
    min_ctx = 4096
    shortfalls: list[str] = []
    # VRAM: what the smallest configuration needs per GPU, at the widest TP available.
    tp = max(t for t in (1, 2, 4, 8) if t <= n and model.splits_over(t))
    probe = Placement(tp=tp, pp=1, context=min_ctx, kv_dtype=_kv_options(model, hw, {})[0], max_num_seqs=1)
    fixed = sum(i.gib for i in L.fixed_gpu_items(model, probe)) + L.kv_needed_gib(model, probe)
    floor_gib = L.cache_floor_slots(model, probe) * model.expert_bytes("2bit", tp) / GIB
    budget = gpu.vram_gib * L.gpu_memory_utilization_default(gpu.vram_gib)
    need_gpu = fixed + floor_gib
    if need_gpu > budget:
        shortfalls.append(f"VRAM: even with the base off the GPU, each of {n}x {gpu.name} needs {need_gpu:.1f} GiB "
                          f"(dense {model.dense_bytes() / tp / GIB:.1f} + minimal expert cache {floor_gib:.1f} + "
                          f"KV/workspace {fixed - model.dense_bytes() / tp / GIB:.1f}) of a {budget:.1f} GiB budget; "
                          f"short {need_gpu - budget:.1f} GiB")
    host_need = model.routed_gib() + L.host_reserve_gib(hw)
    host_usable = L.host_usable_gib(hw)
    if host_need > host_usable:
        shortfalls.append(f"host RAM: a pinned 2-bit store needs {host_need:.0f} GiB usable, "
                          f"{host_usable:.0f} GiB usable of {hw.host.ram_gib:.0f}; short {host_need - host_usable:.0f}")
    disk_need = model.routed_gib()
    free = hw.storage.free_gib
    if free is None:
        shortfalls.append(f"NVMe: no pack directory given; the nvme tier needs {disk_need:.0f} GiB of packs")
    elif free < disk_need:
        shortfalls.append(f"NVMe: pack dir has {free:.0f} GiB free, packs need {disk_need:.0f} GiB")
    if not shortfalls or pins:
        # With knobs pinned the generic picture is not the point: say what the pinned placement ran into.
        seen: set[str] = set()
        for tier, why in problems.items():
            for w in why:
                if w not in seen and len(seen) < 4:
                    seen.add(w)
                    shortfalls.insert(len(seen) - 1, w if w.startswith(tier) else f"{tier}: {w}")

    suggestions: list[str] = []
    name = gpu.hwdb_id or gpu.name
    ram = math.ceil(host_need / L.guards()["host"]["usable_fraction"] / 16) * 16
    disk = math.ceil(disk_need * 1.05)
    # What fits, cheapest change first: the same machine with more GPUs of this kind; then with a pinned-RAM base
    # or an NVMe pack dir, on this many GPUs or the fewest more that make it fit.
    with_ram = hw.model_copy(update={"host": hw.host.model_copy(update={"ram_gib": float(ram)})})
    with_disk = hw.model_copy(update={"storage": hw.storage.model_copy(update={
        "free_gib": float(disk), "seq_read_gbps": hw.storage.seq_read_gbps or 3.5,
        "rand_read_gbps": hw.storage.rand_read_gbps or 3.0})})
    options = [(hw, "(with this host RAM and disk)")]
    if ram > hw.host.ram_gib:
        options.append((with_ram, f"+ host RAM >= {ram} GiB (2-bit base pinned in RAM, tier host)"))
    if free is None or free < disk_need:
        options.append((with_disk, f"+ an NVMe pack dir with >= {disk} GiB free (tier nvme; say so with "
                                   "--pack-dir-free-gib / --nvme-gbps, or probe --pack-dir)"))
    plain_k = None  # GPUs that suffice with nothing else changed: options needing as many are not worth listing
    for base, what in options:
        for k in (n, 2, 4, 8):
            if k < n or (k == n and base is hw) or (plain_k is not None and k >= plain_k):
                continue
            if _fits(model, _with_gpus(base, k), goals, pins):
                suggestions.append((f"{k}x {name} " if k > n else "") + (what[2:] if k == n else what))
                if base is hw:
                    plain_k = k
                break
    if "context" in pins and pins["context"] > min_ctx:
        suggestions.append(f"a shorter context (--set context={min_ctx})")
    msg = f"{model.name} does not fit on {n}x {gpu.name} with {hw.host.ram_gib:.0f} GiB RAM"
    if "context" in pins:
        msg += f" at context {pins['context']}"
    return InfeasibleError(msg, shortfalls, suggestions or [f"GPUs with more VRAM than {n}x {name}"])


def _with_gpus(hw: HardwareProfile, k: int) -> HardwareProfile:
    g0 = hw.gpus[0]
    return hw.model_copy(update={"gpus": [g0.model_copy(update={"index": i}) for i in range(k)]})


def _fits(model: ModelSpec, hw: HardwareProfile, goals: Goals, pins: dict[str, Any]) -> bool:
    pins = {k: v for k, v in pins.items() if k not in ("tp", "pp")}
    for tp, pp in _tp_pp_options(model, hw.num_gpus, {}):
        for tier in TIERS:
            for kv in _kv_options(model, hw, {}):
                p, _ = size_placement(model, hw, goals, pins, tp, pp, tier, kv, 0, goal_context(goals, model))
                if p is not None:
                    return True
    return False
