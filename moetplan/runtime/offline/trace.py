"""Routing traces through the expert store: hit rate and zero-miss steps vs cache size.

A trace is the routed expert ids of every decode step: int [steps, layers, tokens, top_k]. It is either recorded
(saved with `Trace.save`, .npz) or synthetic (`synthetic_trace`): per-layer Zipf-like popularity plus a slowly
drifting, layer-correlated preference per token stream, sampled top-k without replacement (Gumbel top-k).

`replay(trace, gpu_expert_cache_slots)` runs it through a real `ExpertStore` on the CPU (tiny rows, so only the
policy costs) and returns the Plan's KPIs; `replay_curve` does it for several cache sizes, so the cost model's
coverage curves can be checked against the store's actual policy. `moetplan replay --help` (or `python -m moetplan.runtime.offline.trace`) for the command line.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from moetplan.contract.errors import UsageError


@dataclass
class Trace:
    ids: np.ndarray  # int32 [steps, layers, tokens, top_k]
    num_experts: int
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.ids.ndim != 4:
            raise UsageError(f"a routing trace is [steps, layers, tokens, top_k]; got shape {self.ids.shape}")
        if self.ids.size and (self.ids.min() < 0 or self.ids.max() >= self.num_experts):
            raise UsageError(f"trace has expert ids outside 0..{self.num_experts - 1}")

    @property
    def steps(self) -> int:
        return int(self.ids.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.ids.shape[1])

    @property
    def tokens(self) -> int:
        return int(self.ids.shape[2])

    @property
    def top_k(self) -> int:
        return int(self.ids.shape[3])

    def save(self, path: str | os.PathLike[str]) -> None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.tmp.npz")
        np.savez_compressed(tmp, ids=self.ids, num_experts=np.int64(self.num_experts), meta=json.dumps(self.meta))
        os.replace(tmp, p)

    @classmethod
    def load(cls, path: str | os.PathLike[str], num_experts: int | None = None) -> "Trace":
        """Load a .npz written by `save`, or a bare .npy of ids [steps, layers, tokens, top_k]."""
        p = Path(path)
        if not p.is_file():
            raise UsageError(f"routing trace {p} does not exist")
        try:
            if p.suffix == ".npy":
                ids = np.load(p)
                if ids.ndim == 3:  # [steps, layers, top_k]: one token per step
                    ids = ids[:, :, None, :]
                return cls(ids.astype(np.int32), int(num_experts or int(ids.max()) + 1), {"source": str(p)})
            with np.load(p, allow_pickle=False) as z:
                meta = json.loads(str(z["meta"])) if "meta" in z else {}
                return cls(z["ids"].astype(np.int32), int(num_experts or int(z["num_experts"])), meta)
        except (ValueError, KeyError, OSError) as e:
            raise UsageError(f"{p}: not a routing trace (.npz from Trace.save or .npy ids): {e}") from e

    def coverage(self, shares: Sequence[float]) -> dict[float, float]:
        """Static coverage: share of routings served by the top `share` experts of each layer (by count)."""
        L, E = self.num_layers, self.num_experts
        counts = np.zeros((L, E), dtype=np.int64)
        for layer in range(L):
            counts[layer] = np.bincount(self.ids[:, layer].reshape(-1), minlength=E)
        srt = -np.sort(-counts, axis=1)
        cum = np.cumsum(srt, axis=1) / np.maximum(srt.sum(axis=1, keepdims=True), 1)
        out = {}
        for s in shares:
            k = int(round(s * E))
            out[s] = float(cum[:, k - 1].mean()) if k > 0 else 0.0
        return out


class TraceRecorder:
    """Collects routed ids of real decode steps into a Trace (what `replay --trace` reads).

    Call `observe(layer, topk_ids)` for every MoE layer of a step (the store's convention: a layer index that
    does not increase starts a new step). Steps must have one shape to stack, so only steps with the token count
    of the first complete step are kept; the others are counted in `skipped_steps`. Bounded by `max_steps`.
    """

    def __init__(self, num_layers: int, num_experts: int, max_steps: int = 10_000):
        self.num_layers, self.num_experts, self.max_steps = num_layers, num_experts, max_steps
        self._steps: list[np.ndarray] = []
        self._cur: dict[int, np.ndarray] = {}
        self._last = -1
        self._shape: tuple[int, int] | None = None
        self.skipped_steps = 0

    def observe(self, layer: int, topk_ids: Any) -> None:
        ids = topk_ids.detach().cpu().numpy() if hasattr(topk_ids, "detach") else np.asarray(topk_ids)
        if ids.ndim != 2:
            raise UsageError(f"topk_ids must be [tokens, top_k], got shape {ids.shape}")
        if layer <= self._last:
            self._flush()
        self._cur[layer], self._last = ids.astype(np.int32), layer

    def _flush(self) -> None:
        cur, self._cur, self._last = self._cur, {}, -1
        if len(cur) != self.num_layers or len(self._steps) >= self.max_steps:
            self.skipped_steps += bool(cur)
            return
        shapes = {a.shape for a in cur.values()}
        if len(shapes) != 1 or (self._shape is not None and shapes != {self._shape}):
            self.skipped_steps += 1
            return
        self._shape = shapes.pop()
        self._steps.append(np.stack([cur[layer] for layer in range(self.num_layers)]))

    def trace(self, meta: dict[str, Any] | None = None) -> Trace:
        self._flush()
        if not self._steps:
            raise UsageError("no complete decode step was recorded (every MoE layer, one token count per step)")
        return Trace(np.stack(self._steps), self.num_experts, {"recorded": True, **(meta or {})})


def synthetic_trace(num_layers: int, num_experts: int, top_k: int, steps: int, *, tokens: int = 1,
                    skew: float = 1.0, temporal: float = 0.9, layer_corr: float = 0.5, drift: float = 1.0,
                    seed: int = 0) -> Trace:
    """A routing trace with Zipf-like skew, correlated over time (per token stream) and across layers.

    Expert e of layer l has base logit -skew * ln(rank + 1) (a random rank order per layer); every token stream
    adds a preference vector that follows an AR(1) process over steps (`temporal` = step-to-step correlation) whose
    innovations are correlated with the previous layer's (`layer_corr`, through a fixed expert mapping);
    `drift` scales that preference. Each token picks top_k distinct experts by Gumbel top-k.
    """
    if not (1 <= top_k <= num_experts and num_layers >= 1 and steps >= 1 and tokens >= 1):
        raise UsageError(f"bad trace shape: layers={num_layers} experts={num_experts} top_k={top_k} steps={steps} "
                         f"tokens={tokens} (need 1 <= top_k <= experts and positive sizes)")
    if not (0 <= temporal < 1 and 0 <= layer_corr < 1 and skew >= 0 and drift >= 0):
        raise UsageError("need 0 <= temporal < 1, 0 <= layer_corr < 1, skew >= 0, drift >= 0")
    rng = np.random.default_rng(seed)
    L, E, T = num_layers, num_experts, tokens
    base = np.empty((L, E), dtype=np.float32)
    for layer in range(L):
        base[layer, rng.permutation(E)] = -skew * np.log(np.arange(1, E + 1, dtype=np.float64))
    link = np.stack([rng.permutation(E) for _ in range(L)])  # expert mapping layer l-1 -> l
    a_t, a_l = math.sqrt(1 - temporal**2), math.sqrt(1 - layer_corr**2)
    pref = rng.standard_normal((L, T, E), dtype=np.float32)
    ids = np.empty((steps, L, T, top_k), dtype=np.int32)
    for s in range(steps):
        fresh = rng.standard_normal((L, T, E), dtype=np.float32)
        for layer in range(1, L):
            fresh[layer] = layer_corr * fresh[layer - 1][:, link[layer]] + a_l * fresh[layer]
        pref = temporal * pref + a_t * fresh
        gumbel = -np.log(-np.log(rng.random((L, T, E), dtype=np.float32) + 1e-12) + 1e-12)
        logits = base[:, None, :] + drift * pref + gumbel
        ids[s] = np.argpartition(-logits, top_k - 1, axis=-1)[..., :top_k]
    meta = {"synthetic": True, "skew": skew, "temporal": temporal, "layer_corr": layer_corr, "drift": drift,
            "seed": seed}
    return Trace(ids, E, meta)


def fit_skew(num_experts: int, top_k: int, share: float, coverage: float, *, layers: int = 4, steps: int = 200,
             tokens: int = 1, temporal: float = 0.9, layer_corr: float = 0.5, drift: float = 1.0, seed: int = 0,
             iters: int = 14) -> float:
    """The Zipf skew whose synthetic trace has static `coverage` at cache `share` (e.g. DeepSeek-V4-Flash's
    ~19% of experts -> ~96% of routings), by bisection; coverage grows with skew."""
    if not (0 < share < 1 and 0 < coverage < 1):
        raise UsageError(f"need 0 < share < 1 and 0 < coverage < 1, got share={share} coverage={coverage}")

    def cov(skew: float) -> float:
        tr = synthetic_trace(layers, num_experts, top_k, steps, tokens=tokens, skew=skew, temporal=temporal,
                             layer_corr=layer_corr, drift=drift, seed=seed)
        return tr.coverage([share])[share]

    lo, hi = 0.0, 8.0
    if cov(hi) < coverage:
        raise UsageError(f"coverage {coverage} at share {share} is beyond what skew <= {hi} reaches; lower drift")
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cov(mid) < coverage else (lo, mid)
    return (lo + hi) / 2


def replay(trace: Trace, gpu_expert_cache_slots: int, *, warmup_steps: int = 0, decay: float = 0.99,
           prefetch: bool = False, row_bytes: int = 16) -> dict[str, Any]:
    """Feed `trace` through an ExpertStore of `gpu_expert_cache_slots` slots on the CPU; KPIs counted after
    `warmup_steps`.

    `prefetch`: hint each layer's previous-step experts before the layer runs (what a runtime could do).
    A step's experts are pinned until it ends, so the slots must hold one step's working set (at most
    layers x top_k x tokens rows): fewer raises StoreCapacityError, as the planner's guard would.
    """
    from moetplan.contract.runtime import RuntimeSection
    from moetplan.runtime.store.backing import ArrayRowSource
    from moetplan.runtime.vllm.tiers import expert_store

    L, E = trace.num_layers, trace.num_experts
    src = ArrayRowSource(np.zeros((L * E, row_bytes), dtype=np.uint8), L, E)
    section = RuntimeSection(expert_tier="host", gpu_expert_cache_slots=gpu_expert_cache_slots)
    store = expert_store(section, src, pin=False, decay=decay, prefill_tokens=max(trace.tokens, 1))
    warm = min(max(warmup_steps, 0), trace.steps - 1)
    for s in range(trace.steps):
        if s == warm:
            store.reset_stats()
        step = trace.ids[s]
        for layer in range(L):
            if prefetch and s:
                store.prefetch(layer, trace.ids[s - 1, layer])
            store.ensure(layer, step[layer], prefill=False)
    store.begin_step()
    st = store.stats()
    return {
        "slots": gpu_expert_cache_slots,
        "slot_share": gpu_expert_cache_slots / (L * E),
        "token_hit_rate": st["token_hit_rate"],
        "zero_miss_step_share": st["zero_miss_step_share"],
        "misses_per_step": st["misses_per_step"],
        "steps": st["decode"]["steps"],
        "warmup_steps": warm,
        "layers": L,
        "experts": E,
        "top_k": trace.top_k,
        "tokens_per_step": trace.tokens,
    }


def replay_curve(trace: Trace, slot_counts: Sequence[int], **kw: Any) -> list[dict[str, Any]]:
    """`replay` for each cache size; the coverage-vs-cache-size curve the cost model predicts."""
    out = []
    for n in slot_counts:
        r = replay(trace, int(n), **kw)
        r["static_coverage"] = trace.coverage([min(1.0, n / (trace.num_layers * trace.num_experts))])[
            min(1.0, n / (trace.num_layers * trace.num_experts))]
        out.append(r)
    return out


def run_replay(*, trace_path: str | None = None, model: Any = None, layers: int = 8, experts: int = 64,
               top_k: int = 6, tokens: int = 1, steps: int = 300, skew: float | None = None, temporal: float = 0.9,
               layer_corr: float = 0.5, seed: int = 0, shares: Sequence[float] = (0.05, 0.1, 0.2, 0.3, 0.5),
               warmup: int = 50, decay: float = 0.99) -> dict[str, Any]:
    """Build (or load) a trace and replay it at several cache sizes -> JSON-ready dict (what `moetplan replay` shows).

    With `model` (a ModelSpec), the shape comes from it (MoE layers, experts, top-k) and, unless `skew` is given,
    the skew is fitted to the model's first published coverage point (DeepSeek-V4-Flash: 19% of experts -> 96% of
    routings).
    """
    fitted_to = None
    if trace_path:
        tr = Trace.load(trace_path)
    else:
        if model is not None:
            spec = model
            layers, experts, top_k = spec.moe_layers, spec.n_routed_experts, spec.top_k
            if skew is None and spec.coverage_points:
                fitted_to = tuple(spec.coverage_points[0])
                skew = fit_skew(experts, top_k, fitted_to[0], fitted_to[1], temporal=temporal,
                                layer_corr=layer_corr, seed=seed)
        tr = synthetic_trace(layers, experts, top_k, steps, tokens=tokens, skew=1.0 if skew is None else skew,
                             temporal=temporal, layer_corr=layer_corr, seed=seed)
        tr.meta.update({"model": model.id if model is not None else None, "skew_fitted_to": fitted_to})
    total = tr.num_layers * tr.num_experts
    need = tr.num_layers * tr.top_k * tr.tokens  # one decode step's working set must fit (the planner's guard)
    counts = sorted({max(need, int(round(sh * total))) for sh in shares})
    rows = replay_curve(tr, counts, warmup_steps=min(warmup, tr.steps // 2), decay=decay)
    return {"trace": {"steps": tr.steps, "layers": tr.num_layers, "experts": tr.num_experts, "top_k": tr.top_k,
                      "tokens": tr.tokens, **tr.meta}, "curve": rows}



__all__ = ["Trace", "TraceRecorder", "fit_skew", "replay", "replay_curve", "run_replay", "synthetic_trace"]
