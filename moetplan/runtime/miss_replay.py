"""Tiered experts inside CUDA graphs, by replay (vLLM-Moet's approach): every tiered layer computes from the cache
as it stands and records, on the device, which experts the step used and which of them had no slot; at step end
one read tells whether the step missed; if it did, every missing row is fetched in one batch and the step is run
again (a graph replay), now from resident rows only.

Plain torch, capture-safe on the layer side (`StepMisses.record`: index and scatter kernels of fixed shape, no host
read); the step side (`ReplayDriver.step`) runs on the host between steps. The launch keeps the split for tiered
plans until a GPU run measures this against it (docs/CUDA_GRAPHS.md); the driver needs the engine to
re-run a step, which vLLM's model runner does not offer a plugin.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from moetplan.contract.errors import MoetplanError


class ReplayError(MoetplanError):
    """A replayed step missed again: its working set does not fit the expert cache."""


class StepMisses:
    """Per tiered layer: the experts this step routed to (`used`) and those of them without a slot (`missed`),
    int32 [layers, experts] on the device, filled in-graph, read and cleared at step end."""

    def __init__(self, num_layers: int, num_experts: int, device: Any = "cpu"):
        self.used = torch.zeros(2, num_layers, num_experts, dtype=torch.int32, device=device)  # [0] used, [1] missed

    def record(self, layer: int, slot_of: torch.Tensor, topk_ids: torch.Tensor) -> None:
        """Capture-safe: three kernels whose shapes are the call's, whatever the routing."""
        ids = topk_ids.reshape(-1).long()
        self.used[0, layer].index_fill_(0, ids, 1)
        missing = (slot_of.index_select(0, ids) < 0).to(torch.int32)
        # duplicates of an id carry the same value, so the reduction is deterministic
        self.used[1, layer].scatter_reduce_(0, ids, missing, reduce="amax")

    def take(self) -> dict[int, np.ndarray] | None:
        """At step end, one device->host read: None for a step that missed nothing, else {layer: every expert the
        step used in that layer} for the layers that missed (the hits are fetched-or-kept with them, so the batch
        cannot evict a row the replay needs). Clears the record for the next step."""
        both = self.used.to("cpu", copy=True).numpy()  # a copy on the CPU too: the record is cleared next
        self.used.zero_()
        used, missed = both[0], both[1]
        layers = np.flatnonzero(missed.any(axis=1))
        if not layers.size:
            return None
        return {int(layer): np.flatnonzero(used[layer]) for layer in layers}


@dataclass
class ReplayCounts:
    steps: int = 0
    replayed: int = 0  # steps run twice: they missed
    fetched_rows: int = 0
    fetch_batches: int = 0

    def as_dict(self) -> dict[str, Any]:
        zero = (self.steps - self.replayed) / self.steps if self.steps else None
        return {"steps": self.steps, "replayed_steps": self.replayed, "zero_miss_step_share": zero,
                "fetched_rows": self.fetched_rows, "fetch_batches": self.fetch_batches}


def store_fetch(store: Any) -> Callable[[dict[int, np.ndarray]], int]:
    """The batch fetch over an ExpertStore: the step's used experts of each missed layer made resident, layer by
    layer in one pass (one store step: its pins keep the earlier layers' rows); returns the rows brought in."""

    def fetch(need: dict[int, np.ndarray]) -> int:
        missing = 0
        for layer in sorted(need):
            missing += int((store.pool.res[layer][need[layer]] < 0).sum())  # the host mirror: no device read
            store.ensure(layer, torch.from_numpy(need[layer].astype(np.int64)).view(1, -1), prefill=False,
                         num_tokens=1)
        store.begin_step()
        return missing

    return fetch


class ReplayDriver:
    """Runs a step (`run`: a graph replay, or any callable computing the step), and again after one batch fetch when
    it missed."""

    def __init__(self, misses: StepMisses, fetch: Callable[[dict[int, np.ndarray]], int]):
        self.misses, self.fetch = misses, fetch
        self.counts = ReplayCounts()

    def step(self, run: Callable[[], Any]) -> Any:
        out = run()
        self.counts.steps += 1
        need = self.misses.take()
        if need is None:
            return out
        self.counts.fetched_rows += int(self.fetch(need))
        self.counts.fetch_batches += 1
        self.counts.replayed += 1
        out = run()
        again = self.misses.take()
        if again is not None:
            raise ReplayError(f"the replayed step missed again in layer(s) {sorted(again)}: the step's experts do "
                              "not fit the expert cache at once; re-plan with more gpu_expert_cache_slots")
        return out


__all__ = ["ReplayCounts", "ReplayDriver", "ReplayError", "StepMisses", "store_fetch"]
