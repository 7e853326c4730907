"""What the solver hands on: one sized and predicted placement (`Candidate`), the context the goals aim at, and
the candidates worth showing (the pareto set); the solver, its reasons and alternatives read them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from moetplan.contract import Goals, MemoryLedger, Placement, Prediction
from moetplan.contract.model import ModelSpec
from moetplan.plan import ledger as L


@dataclass(frozen=True)
class BudgetOption:
    """One max_num_batched_tokens the solver sized and predicted for a discrete choice and context."""
    max_num_batched_tokens: int
    gpu_expert_cache_gib: float
    kv_floor_gib: float
    decode_tok_s: float
    prefill_tok_s: float
    token_hit_rate: float | None


@dataclass
class Candidate:
    placement: Placement
    ledger: MemoryLedger
    prediction: Prediction
    # The batched-token budgets predicted for this placement (largest first) and vLLM's default for the card; empty
    # when only one was sized (pinned, resident, or nothing smaller changes the expert cache).
    budgets: list[BudgetOption] = field(default_factory=list)
    default_budget: int = 0
    budgets_sized: list[int] = field(default_factory=list)  # every budget sized (those predicted are in `budgets`)


def pick_budget(n: int, option: Callable[[int], BudgetOption], objective: str) -> int:
    """Which of `n` sized budgets (largest first, each giving the expert cache more rows than the one before) the
    objective prefers; `option(i)` predicts budget i (the caller memoises it). A smaller budget shrinks the
    activation peak and, where vLLM reserves per-token in-flight KV state (DeepSeek-V4), the KV floor: more cache,
    decode gains; every chunk costs prefill. 'decode' takes the fastest decode (a tie: the larger budget, faster
    prefill); 'balanced' and 'context' give up no more decode than balanced's own context rule does
    (balanced_keep_decode) and take the largest budget within it.

    More cache never slows decode, so the fastest decode is the smallest budget's, and the budgets within the
    tolerance are a run from it upward: only the ends and the edge of that run are predicted."""
    if n <= 1:
        return 0
    best = max(option(0).decode_tok_s, option(n - 1).decode_tok_s)
    keep = 1.0 if objective == "decode" else float(L.guards()["planner"]["balanced_keep_decode"])

    def within(i: int) -> bool:
        return option(i).decode_tok_s >= keep * best - 1e-9

    if keep >= 1.0:  # the fastest is usually the smallest: walk up from it while decode holds
        i = n - 1 if within(n - 1) else 0
        while i > 0 and within(i - 1):
            i -= 1
        return i
    return next(i for i in range(n) if within(i))


def goal_context(goals: Goals, model: ModelSpec) -> int:
    if goals.context:
        return min(goals.context, model.max_position_embeddings)
    return min(L.guards()["planner"]["default_context"][goals.objective], model.max_position_embeddings)


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


def context_tradeoff(chosen: Candidate, cands: list[Candidate]) -> str:
    """What the windows beyond the chosen one would cost in decode speed (the same discrete choice, the Pareto front
    above the chosen context), e.g. "524288 tokens: 39.8 tok/s (-6%)"; "" when no longer window fits."""
    p = chosen.placement
    same = [c for c in cands if (c.placement.tp, c.placement.pp, c.placement.expert_tier, c.placement.kv_dtype,
                                 c.placement.mtp) == (p.tp, p.pp, p.expert_tier, p.kv_dtype, p.mtp)
            and c.placement.context > p.context]
    base = chosen.prediction.decode_tok_s
    parts = [f"{c.placement.context} tokens: {c.prediction.decode_tok_s:.1f} tok/s "
             f"({c.prediction.decode_tok_s / base - 1:+.0%})" for c in pareto(same)] if base > 0 else []
    return ("longer windows cost decode: " + ", ".join(parts)) if parts else ""
