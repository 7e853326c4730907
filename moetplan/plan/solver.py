"""The solver: enumerate the discrete choices, size the continuous ones, keep what fits, rank by the cost model.

Discrete: TP x PP, expert tier, KV dtype, MTP depth (or drafter tokens), context (a grid, or the pinned value).
Continuous (sized, not searched): GPU expert cache = what is left of the VRAM budget after everything else;
KV pool = the window's need (resident tier: plus all leftover, as vLLM does); host arena = usable RAM less the
page cache's share. max_num_batched_tokens: vLLM's default for the card, smaller when its activation peak does
not fit; on a tiered store each smaller budget that gives the expert cache more rows is predicted too and the
objective picks (a smaller budget: more cache and decode, slower prefill). Every pinned knob (`--set name=value`) collapses its dimension; with all pinned, this evaluates one
placement.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, Iterable, Iterator

from moetplan import __version__
from moetplan.contract import (
    Gate,
    Goals,
    HardwareProfile,
    Placement,
    Plan,
    Prediction,
)
from moetplan.contract.errors import InfeasibleError, UsageError
from moetplan.contract.model import GIB, ModelSpec
from moetplan.contract.schema import parse_knob
from moetplan.contract.vocab import EXPERT_TIERS
from moetplan.contract.sizing import reserve_slots, rows_in
from moetplan.plan import ledger as L
from moetplan.plan import support
from moetplan.plan.candidates import BudgetOption, Candidate, goal_context, pick_budget
from moetplan.plan.diagnose import diagnose
from moetplan.plan.reasons import alternatives, reasons, warnings

_BYTE_SUFFIXES = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20,
                  "g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40}


def parse_bytes(value: str) -> int:
    """A byte count as vLLM's --kv-cache-memory-bytes takes it: 8589934592, 8GiB, 8G (decimal), 512MiB."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _BYTE_SUFFIXES:
        raise ValueError(value)
    return int(float(m.group(1)) * _BYTE_SUFFIXES[m.group(2).lower()])


def kv_clamp_gib(pins: dict[str, Any]) -> float | None:
    """The pinned KV clamp in GiB per rank (kv_cache_memory_bytes, the one KV-clamp knob; 0: no clamp), or None."""
    if pins.get("kv_cache_memory_bytes"):
        return pins["kv_cache_memory_bytes"] / GIB
    return None


SWEEP_TOP = 4  # discrete choices whose context range is swept in full


# --------------------------------------------------------------------------- pins


def parse_set(items: Iterable[str]) -> dict[str, Any]:
    """Parse `--set name=value` strings into typed pins (names exactly as in PINNABLE_KNOBS; each value typed and
    checked as the schema declares its field: contract.schema.parse_knob)."""
    pins: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise UsageError(f"--set '{item}': expected name=value (e.g. --set tp=2)")
        name, value = (s.strip() for s in item.split("=", 1))
        if name == "kv_cache_memory_bytes":  # vLLM's byte spellings (8GiB, 8589934592), not a plain int
            try:
                pins[name] = parse_bytes(value)
            except ValueError:
                raise UsageError(f"--set {name}={value}: not a byte count; give bytes, e.g. "
                                 f"--set {name}=8589934592 or --set {name}=8GiB") from None
        else:
            pins[name] = parse_knob(name, value)
    return pins


def check_goals(model: ModelSpec, goals: Goals) -> None:
    """Usage errors for goals no hardware could meet, before any search."""
    if goals.concurrency < 1:
        raise UsageError(f"--concurrency {goals.concurrency}: must be at least 1 (streams decoded at once)")
    top = model.max_position_embeddings
    for where, ctx in (("--context", goals.context), ("--set context", goals.pinned.get("context"))):
        if ctx is not None and ctx > top:
            raise UsageError(f"{where} {ctx}: {model.name} supports at most {top} tokens "
                             f"(max_position_embeddings); ask for {top} or less")


# --------------------------------------------------------------------------- enumeration


def _tp_pp_options(model: ModelSpec, n_gpus: int, pins: dict[str, Any]) -> list[tuple[int, int]]:
    max_tp = L.guards()["planner"]["max_tp"]
    out = []
    for tp in (1, 2, 4, 8):
        if tp > min(n_gpus, max_tp) or not model.splits_over(tp):
            continue
        for pp in range(1, 9):
            if tp * pp > n_gpus or pp > model.num_layers:
                continue
            # PP only to use all GPUs when TP cannot (a stage boundary costs a hop per step).
            if pp > 1 and tp * pp != n_gpus:
                continue
            out.append((tp, pp))
    if "tp" in pins or "pp" in pins:
        pin_tp, pin_pp = pins.get("tp"), pins.get("pp")
        want = [(t, p) for (t, p) in out if (pin_tp is None or t == pin_tp) and (pin_pp is None or p == pin_pp)]
        if not want:
            t, p = int(pin_tp or 1), int(pin_pp or 1)
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
        if model.kv_dtype_forced and pins["kv_dtype"] != model.kv_dtype_forced:
            raise UsageError(f"--set kv_dtype={pins['kv_dtype']}: vLLM serves {model.name}'s KV cache only as "
                             f"{model.kv_dtype_forced} ({model.vllm_arch}; hwdb kv_dtype_forced), whatever "
                             f"--kv-cache-dtype says; pin kv_dtype={model.kv_dtype_forced} or leave it unpinned")
        return [pins["kv_dtype"]]
    engine = support.kv_dtypes_on(model, hw)
    out = []
    for kv in model.kv_dtypes():
        if engine is not None and kv not in engine:
            continue
        if kv == "nvfp4" and not all(g.fp4 for g in hw.gpus):
            continue  # the packed FP4 KV layout needs FP4-capable GPUs (SM120 in vLLM-Moet)
        if kv == "fp8" and not all(g.fp8 or float(g.compute_capability) >= 8.0 for g in hw.gpus):
            continue
        out.append(kv)
    return out or model.kv_dtypes()[:1]


def _mtp_options(model: ModelSpec, pins: dict[str, Any], tier: str) -> list[int]:
    if "mtp" in pins:
        if pins["mtp"] > 0 and not model.has_speculation:
            raise UsageError(f"--set mtp={pins['mtp']}: {model.id} has no MTP head or drafter")
        return [pins["mtp"]]
    if not model.has_speculation:
        return [0]
    depths = list(L.guards()["planner"]["mtp_depths"])
    if tier != "resident":
        depths = [d for d in depths if d <= L.guards()["planner"]["mtp_depth_max_tiered"]]
    return depths


def _context_options(model: ModelSpec, goals: Goals, pins: dict[str, Any]) -> list[int]:
    if "context" in pins:
        return [pins["context"]]
    lo = goal_context(goals, model)
    grid = [c for c in L.guards()["planner"]["context_grid"] if lo <= c <= model.max_position_embeddings]
    return sorted(set([lo] + grid))


def _context_allowed(kv: str, ctx: int, goals: Goals, pins: dict[str, Any]) -> bool:
    """A KV layout is planned only up to the window it was validated to, unless that window was asked for."""
    limit = support.validated_context(kv)
    asked = max(goals.context or 0, pins.get("context") or 0)
    return limit is None or ctx <= max(limit, asked)


@lru_cache(maxsize=1)
def _default_pack_dir() -> str:
    """Packs are the quantization cache for every tier; without a probed/given pack dir, the user cache dir."""
    from moetplan.contract import default_pack_dir

    return str(default_pack_dir())


def _batched_tokens_options(vram: float, pins: dict[str, Any]) -> list[int]:
    if "max_num_batched_tokens" in pins:
        return [pins["max_num_batched_tokens"]]
    g = L.guards()["planner"]
    top = g["batched_tokens_default_large"] if vram >= g["batched_tokens_large_card_gib"] \
        else g["batched_tokens_default_small"]
    return [t for t in g["batched_tokens_grid"] if t <= top]


# --------------------------------------------------------------------------- sizing one candidate


def size_placement(model: ModelSpec, hw: HardwareProfile, goals: Goals, pins: dict[str, Any], tp: int, pp: int,
                   tier: str, kv: str, mtp: int, context: int) -> tuple[Placement | None, list[str]]:
    """Size the continuous knobs for one discrete choice. Returns (placement, []) or (None, problems).

    max_num_batched_tokens starts at vLLM's default for the card and halves while its activation peak is what
    does not fit."""
    vram = min(g.vram_gib for g in hw.gpus[: tp * pp])
    why: list[str] = []
    pack_dir = goals.pack_dir or hw.storage.path or _default_pack_dir()
    for mnbt in _batched_tokens_options(vram, pins):
        p, why = _size(model, hw, goals, pins, tp, pp, tier, kv, mtp, context, mnbt, vram, pack_dir)
        if p is not None:
            return p, []
        if not any(w.split(":", 1)[0] in _BATCH_SENSITIVE for w in why):
            break  # fewer batched tokens would not change what is short
    return None, why


def size_budgets(model: ModelSpec, hw: HardwareProfile, goals: Goals, pins: dict[str, Any], tp: int, pp: int,
                 tier: str, kv: str, mtp: int, context: int) -> tuple[list[Placement], list[str]]:
    """The placements worth weighing for one discrete choice, one per max_num_batched_tokens, largest first: the
    one size_placement finds, then each smaller budget on the grid that still holds a whole decode step
    (max_num_seqs x (1 + MTP) tokens) and gives the GPU expert cache more rows (a smaller activation peak, and
    where vLLM reserves in-flight KV state per batched token, a smaller KV floor). A pinned budget, a resident plan
    or a pinned cache size has one. The caller predicts each and picks by the objective (candidates.pick_budget)."""
    first, why = size_placement(model, hw, goals, pins, tp, pp, tier, kv, mtp, context)
    if first is None:
        return [], why
    out = [first]
    if "max_num_batched_tokens" in pins or tier == "resident" or "gpu_expert_cache_gib" in pins:
        return out, []
    vram = min(g.vram_gib for g in hw.gpus[: tp * pp])
    pack_dir = goals.pack_dir or hw.storage.path or _default_pack_dir()
    step = max(first.max_num_seqs, 1) * (1 + max(mtp, 0))
    for mnbt in _batched_tokens_options(vram, pins):
        if mnbt >= out[-1].max_num_batched_tokens:
            continue
        if mnbt < step:
            break
        p, _ = _size(model, hw, goals, pins, tp, pp, tier, kv, mtp, context, mnbt, vram, pack_dir)
        if p is None:
            break  # the cache outgrew the tier ("every expert fits"): the resident choice covers it
        if p.gpu_expert_cache_slots > out[-1].gpu_expert_cache_slots:
            out.append(p)
    return out, []


def default_batched_tokens(hw: HardwareProfile, p: Placement) -> int:
    """vLLM's default max_num_batched_tokens for the placement's cards."""
    return _batched_tokens_options(min(g.vram_gib for g in hw.gpus[: p.tp * p.pp]), {})[0]


_ALL_FIT = "expert_cache: every expert fits in the cache"
# Ledger items a smaller activation peak can make room for.
_BATCH_SENSITIVE = {"kv_cache", "vram", "gpu_memory_utilization", "expert_cache"}


def _size(model: ModelSpec, hw: HardwareProfile, goals: Goals, pins: dict[str, Any], tp: int, pp: int, tier: str,
          kv: str, mtp: int, context: int, mnbt: int, vram: float,
          pack_dir: str) -> tuple[Placement | None, list[str]]:
    conc = pins.get("concurrency", goals.concurrency)
    seqs = pins.get("max_num_seqs", max(conc, 1))
    gate_tau = pins.get("gate_tau")
    p = Placement.for_model(
        model, tp=tp, pp=pp, expert_tier=tier, kv_dtype=kv, context=context, mtp=mtp,
        mtp_acceptance=pins.get("mtp_acceptance", model.mtp_accept(mtp)),
        max_num_seqs=seqs, concurrency=conc, max_num_batched_tokens=mnbt,
        pack_dir=pack_dir,
        gate=Gate(enabled=bool(gate_tau), tau=gate_tau or 0.5), moe_graphs=pins.get("moe_graphs", "replay"),
    )
    if "cpu_miss_ratio" in pins:
        p.cpu_miss_ratio = pins["cpu_miss_ratio"]
    elif tier == "host" and hw.host.cpu_expert_gbps:  # misses served where cheapest (issue 39)
        from moetplan.cost_model.cpu_compute import cpu_miss_ratio

        p.cpu_miss_ratio = cpu_miss_ratio(hw, p)
    p.gpu_memory_utilization = pins.get("gpu_memory_utilization", L.gpu_memory_utilization_for(model, p, vram))
    budget = vram * p.gpu_memory_utilization
    fixed = sum(i.gib for i in L.fixed_gpu_items(model, p))
    kv_floor = L.kv_floor_gib(model, p)
    row2, row4 = p.expert_row_bytes, p.fp4_row_bytes
    max_slots = math.ceil(model.moe_layers / pp) * model.n_routed_experts
    layers_here = math.ceil(model.moe_layers / pp)
    clamp = kv_clamp_gib(pins)
    left = budget - fixed
    rule_min = float(support.serving_rules(model).get("fp4_reserve_min_gib", 0.0))

    def inside(reserve: float) -> float:
        return reserve - L.fp4_outside_gib(p, vram, reserve)

    def set_reserve(gib: float) -> None:
        rows = rows_in(gib, row4)
        if "fp4_reserve_gib" not in pins and rows * row4 < rule_min * GIB <= gib * GIB:
            rows = math.ceil(rule_min * GIB / row4)  # the architecture's minimum is a floor: whole rows above it
        p.fp4_reserve_slots = reserve_slots(rows, layers_here, model.n_routed_experts)

    if tier == "resident":
        left -= L.experts_resident_gib(model, p)
        if left < 0:
            # Weights and workspaces alone exceed the budget: name what they are, the largest optional one first.
            items = L.fixed_gpu_items(model, p)
            parts = ", ".join(f"{i.name} {i.gib:.1f}" for i in items)
            optional = [i for i in items if i.name in ("drafter", "mtp_layer") and i.gib >= -left]
            item = optional[0].name if optional else "vram"
            return None, [f"{item}: {parts} and resident experts {L.experts_resident_gib(model, p):.1f} GiB/rank "
                          f"exceed the {budget:.1f} GiB budget before any KV pool; short {-left + kv_floor:.1f} GiB"]
        if left < kv_floor:
            return None, [f"kv_cache: resident experts leave {left:.1f} GiB/rank for the KV pool, which needs "
                          f"{kv_floor:.1f} GiB; short {kv_floor - left:.1f} GiB"]
        reserve = pins.get("fp4_reserve_gib")
        if reserve is None:
            reserve = _default_reserve(model, p, left - kv_floor, row4, rule_min)
            if p.gate.enabled:
                reserve = max(reserve, min(left - kv_floor, L.fp4_gate_floor_slots(model, p) * row4 / GIB))
        set_reserve(reserve)
        p.kv_cache_gib = clamp if clamp is not None else left - inside(p.fp4_reserve_gib)  # vLLM hands out the rest
    else:
        reserve = pins.get("fp4_reserve_gib")
        if reserve is None:
            reserve = rule_min
            if p.gate.enabled:
                reserve = L.fp4_gate_floor_slots(model, p) * row4 / GIB
        kv_target = clamp if clamp is not None else kv_floor
        set_reserve(reserve)  # whole rows first: the cache gets what they leave
        gpu_expert_cache_gib = pins.get("gpu_expert_cache_gib", left - inside(p.fp4_reserve_gib) - kv_target)
        p.gpu_expert_cache_slots = min(rows_in(gpu_expert_cache_gib, row2), max_slots)  # the GiB -> rows rule
        if p.gpu_expert_cache_slots >= max_slots and "expert_tier" not in pins:
            return None, [f"{_ALL_FIT}; resident is the same placement"]
        p.kv_cache_gib = clamp if clamp is not None else left - inside(p.fp4_reserve_gib) - p.gpu_expert_cache_gib
        floor = L.cache_floor_slots(model, p)
        if p.gpu_expert_cache_slots < floor:
            return None, [f"expert_cache: GPU expert cache of {p.gpu_expert_cache_slots} slots is below the floor "
                          f"of one step's working set x 1.15 = {floor} slots ({floor * row2 / GIB:.1f} GiB/rank)"]
        if tier == "nvme":
            arena = pins.get("host_arena_gib", min(L.arena_budget_gib(hw, tp * pp), model.routed_gib("2bit", tp)))
            if arena < L.guards()["host"]["arena_min_gib"] and "host_arena_gib" not in pins:
                arena = 0.0  # page cache as the only RAM tier
            p.host_arena_rows = rows_in(math.floor(arena * 10) / 10, row2)
    if p.fp4_reserve_slots > 0:
        if p.gate.enabled and p.fp4_reserve_slots < L.fp4_gate_floor_slots(model, p):
            p.gate.degraded = True
            p.gate.max_promotions_per_step = p.fp4_reserve_slots // max(1, math.ceil(model.moe_layers / pp))
    if clamp is None:  # the other sizes are whole rows already
        p.kv_cache_gib = round(math.floor(p.kv_cache_gib / L.ROUND_GIB) * L.ROUND_GIB, 6)  # never past the budget
    p.kv_cache_clamped = clamp is not None
    p.kv_cache_memory_bytes = int(round(clamp * GIB)) if clamp is not None else 0
    p.kv_tokens = L.kv_tokens(model, p)
    p.activation_peak_gib = round(L.activation_gib(model, p), 3)
    check = L.build_ledger(model, hw, p, frozenset(pins))
    if not check.ok:
        return None, check.problems
    return p, []


def _default_reserve(model: ModelSpec, p: Placement, slack_gib: float, row4: float, rule_min: float) -> float:
    """Resident tier: spend up to a quarter of the slack on FP4 rows for the hottest experts (quality, not speed),
    capped at one step's working set; never below one layer's top-k (useless) — else the architecture's rule."""
    ws = L.step_working_set_slots(model, p) // max(1, p.mtp + 1)
    want = min(slack_gib * 0.25, ws * row4 / GIB)
    if want * GIB < model.top_k * model.moe_layers / p.pp * row4:
        want = 0.0
    return round(max(want, rule_min if slack_gib >= rule_min else 0.0), 1)


# --------------------------------------------------------------------------- solve


def _choices(model: ModelSpec, hw: HardwareProfile, goals: Goals,
             pins: dict[str, Any]) -> Iterator[tuple[int, int, str, str, int]]:
    tiers = [pins["expert_tier"]] if "expert_tier" in pins else list(EXPERT_TIERS)
    for tp, pp in _tp_pp_options(model, hw.num_gpus, pins):
        for tier in tiers:
            for kv in _kv_options(model, hw, pins):
                for mtp in _mtp_options(model, pins, tier):
                    yield tp, pp, tier, kv, mtp


def _precheck(model: ModelSpec, hw: HardwareProfile, goals: Goals) -> None:
    check_goals(model, goals)
    if not hw.gpus:
        raise InfeasibleError("no GPU in the hardware profile to plan for",
                              ["0 GPUs"], ["plan for a reference box: --box rtx-5090x1", "or --gpus 1xrtx-5090"])
    support.check(model, hw)


def feasible(model: ModelSpec, hw: HardwareProfile, goals: Goals) -> bool:
    """Whether search() would find a placement: the same enumeration and sizing, stopped at the first fit."""
    try:
        _precheck(model, hw, goals)
    except (InfeasibleError, UsageError):
        return False
    pins = dict(goals.pinned)
    ctx = _context_options(model, goals, pins)[0]
    pack_dir = goals.pack_dir or hw.storage.path or _default_pack_dir()
    for choice in _choices(model, hw, goals, pins):
        if not _context_allowed(choice[3], ctx, goals, pins):
            continue
        # Fewer batched tokens only shrink the activation peak: a choice short of memory at the fewest is short at
        # all, which rules most choices out in one sizing (not so "every expert fits", which more room causes);
        # the rest take search()'s own path, so the answers agree.
        vram = min(g.vram_gib for g in hw.gpus[: choice[0] * choice[1]])
        fewest = _batched_tokens_options(vram, pins)[-1]
        p, why = _size(model, hw, goals, pins, *choice, ctx, fewest, vram, pack_dir)
        if p is None and not any(w.startswith(_ALL_FIT) for w in why):
            continue
        if size_placement(model, hw, goals, pins, *choice, ctx)[0]:
            return True
    return False


def search(model: ModelSpec, hw: HardwareProfile, goals: Goals, calib: Any = None) -> list[Candidate]:
    """Every feasible candidate, predicted; InfeasibleError (with what is short and what fits) if none."""
    _precheck(model, hw, goals)
    pins = dict(goals.pinned)
    problems: dict[str, list[str]] = {}
    ctx_opts = _context_options(model, goals, pins)
    loaded = [calib]

    def evaluate(choice: tuple[int, int, str, str, int], ctx: int) -> Candidate | None:
        if not _context_allowed(choice[3], ctx, goals, pins):
            return None
        ps, why = size_budgets(model, hw, goals, pins, *choice, ctx)
        if not ps:
            problems.setdefault(choice[2], []).extend(why)
            return None
        from moetplan.cost_model import load_calibration, predict  # numpy: only once something fits

        if loaded[0] is None:
            loaded[0] = load_calibration(hw)  # once per search, not per candidate
        preds: dict[int, Prediction] = {}

        def option(i: int) -> BudgetOption:
            if i not in preds:
                preds[i] = predict(model, hw, ps[i], loaded[0])
            p, r = ps[i], preds[i]
            return BudgetOption(p.max_num_batched_tokens, p.gpu_expert_cache_gib, L.kv_floor_gib(model, p),
                                r.decode_tok_s, r.prefill_tok_s, r.token_hit_rate)

        i = pick_budget(len(ps), option, goals.objective)
        option(i)
        weighed = [option(j) for j in sorted(preds)] if len(ps) > 1 else []
        return Candidate(ps[i], L.build_ledger(model, hw, ps[i], frozenset(pins)).ledger, preds[i], weighed,
                         default_batched_tokens(hw, ps[i]), [q.max_num_batched_tokens for q in ps])

    # Phase 1: every discrete choice at the smallest context the goals accept.
    first: list[tuple[tuple, Candidate]] = []
    for choice in _choices(model, hw, goals, pins):
        c = evaluate(choice, ctx_opts[0])
        if c is not None:
            first.append((choice, c))
    if not first:
        raise diagnose(model, hw, goals, pins, problems, feasible, _kv_options(model, hw, {})[0])
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
        reasons=reasons(model, hw, goals, chosen, cands),
        alternatives=alternatives(cands, chosen),
        warnings=warnings(model, hw, goals, chosen)
        + [g for g in chosen.ledger.guards if g.startswith(L.PAST_GUARD)],
    )
    return plan


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
