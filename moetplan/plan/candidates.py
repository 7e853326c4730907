"""What the solver hands on: one sized and predicted placement (`Candidate`), the context the goals aim at, and
the candidates worth showing (the pareto set); the solver, its reasons and alternatives read them."""
from __future__ import annotations

from dataclasses import dataclass

from moetplan.contract import Goals, MemoryLedger, Placement, Prediction
from moetplan.contract.model import ModelSpec
from moetplan.plan import ledger as L


@dataclass
class Candidate:
    placement: Placement
    ledger: MemoryLedger
    prediction: Prediction


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
