"""Two servers of one model, compared through their logprobs on the same tokens (teacher forcing).

Greedy tokens of a random model are a poor comparison: a near tie flips a token, and everything after it differs.
Instead both servers score one token sequence (`prompt_logprobs`: the top-k logprobs at every position), and the
comparison is the relative L2 distance of their logits: a logprob is the logit less the position's log-sum-exp,
so subtracting each position's mean over the tokens both servers listed removes that constant and leaves the
centred logits. That is the model-level analogue of the kernel tests' relative L2 error (docs/KERNELS.md).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import httpx

Table = list[dict[int, float]]  # per scored position: token id -> logprob


def completion(url: str, model: str, prompt: str | Sequence[int], max_tokens: int, *,
               prompt_logprobs: int | None = None, timeout: float = 120.0) -> dict[str, Any]:
    """A greedy, non-streamed /v1/completions answer with token ids (vLLM's `return_token_ids`)."""
    body: dict[str, Any] = {"model": model, "prompt": list(prompt) if not isinstance(prompt, str) else prompt,
                            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                            "return_token_ids": True}
    if prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs
    r = httpx.post(url.rstrip("/") + "/v1/completions", json=body, timeout=timeout)
    r.raise_for_status()
    return r.json()


def token_ids(doc: dict[str, Any]) -> tuple[list[int], list[int]]:
    """(prompt token ids, generated token ids) of a completion answer."""
    ch = doc["choices"][0]
    prompt = doc.get("prompt_token_ids") or ch.get("prompt_token_ids") or []
    return [int(t) for t in prompt], [int(t) for t in ch.get("token_ids") or []]


def prompt_table(doc: dict[str, Any]) -> Table:
    """The scored positions of a `prompt_logprobs` answer (the first position has no logprob)."""
    raw = doc["choices"][0].get("prompt_logprobs") or doc.get("prompt_logprobs") or []
    out: Table = []
    for pos in raw:
        if not pos:
            continue
        row = {}
        for tok, v in pos.items():
            lp = v.get("logprob") if isinstance(v, dict) else v
            if lp is not None and math.isfinite(float(lp)):
                row[int(tok)] = float(lp)
        out.append(row)
    return out


def centered_error(a: Table, b: Table, min_shared: int = 2) -> dict[str, Any]:
    """Relative L2 distance of a's centred logits from b's (b is the reference), over each position's tokens
    listed by both; positions sharing fewer than `min_shared` tokens are skipped (nothing to centre)."""
    if len(a) != len(b):
        raise ValueError(f"the tables score different lengths ({len(a)} vs {len(b)} positions)")
    num = den = 0.0
    worst = 0.0
    used = shared = 0
    for ra, rb in zip(a, b):
        ids = sorted(set(ra) & set(rb))
        if len(ids) < min_shared:
            continue
        ma = sum(ra[i] for i in ids) / len(ids)
        mb = sum(rb[i] for i in ids) / len(ids)
        for i in ids:
            d = (ra[i] - ma) - (rb[i] - mb)
            num += d * d
            den += (rb[i] - mb) ** 2
            worst = max(worst, abs(d))
        used += 1
        shared += len(ids)
    if used == 0:
        return {"rel_l2": None, "max_abs": None, "positions": 0, "shared_tokens": 0, "reference_rms": None}
    # reference_rms: how far the reference's logits spread around their mean (nats); near zero, every token is
    # equally likely and no comparison of two servers can tell them apart.
    return {"rel_l2": math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else math.inf),
            "max_abs": worst, "positions": used, "shared_tokens": shared, "reference_rms": math.sqrt(den / shared)}


def top1_agreement(a: Table, b: Table) -> float | None:
    """Share of positions where both servers rank the same token first."""
    pairs = [(max(ra, key=ra.get), max(rb, key=rb.get)) for ra, rb in zip(a, b) if ra and rb]
    return sum(x == y for x, y in pairs) / len(pairs) if pairs else None


__all__ = ["Table", "centered_error", "completion", "prompt_table", "token_ids", "top1_agreement"]
