"""Tiered experts inside CUDA graphs, by replay (vLLM-Moet's approach): every tiered layer computes from the cache
as it stands and records, on the device, how often the step routed to each expert and which of them had no slot;
at step end one read tells whether the step missed; if it did, every missing row is fetched in one batch and the
step is run again (a graph replay), now from resident rows.

Plain torch, capture-safe on the layer side (`StepMisses.record`: index and scatter kernels of fixed shape, no host
read); the step side (`ReplayDriver.step`) runs on the host between steps, around vLLM's forward call
(`vllm_compat.install_forward_hook`: outside the captured graph, before sampling).

Why a replay may miss again, and when that is an error: a layer that missed computed without some experts, so the
layers after it saw other inputs and may route differently in the replay. Layers before the first missed layer
computed exactly; the first missed layer, its experts now resident and pinned, computes exactly in the replay. So
each replay moves the first missed layer strictly later, and the loop ends within the MoE layer count. A replay
whose first missed layer is not later than the previous one's (its rows were fetched and are gone again), or a
batch the cache cannot hold with the step's pins, is an error naming the cache size, never wrong tokens.

Steps bigger than the cache's decode working set (prefill chunks) re-run eagerly instead (`eager`): the layers then
run the per-layer store path (`ensure` / `ensure_chunks`), which computes any call whatever its size.
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
    """Per MoE layer and expert: routings this step (`used[0]`) and whether the expert had no slot (`used[1]`),
    int32 [2, layers, experts] on the device, filled in-graph, read and cleared at step end.

    `eager`: set by the driver while a step re-runs eagerly; the layers then take the per-layer store path."""

    def __init__(self, num_layers: int, num_experts: int, device: Any = "cpu"):
        self.used = torch.zeros(2, num_layers, num_experts, dtype=torch.int32, device=device)
        self.eager = False

    def record(self, layer: int, slot_of: torch.Tensor, topk_ids: torch.Tensor) -> None:
        """Capture-safe: kernels whose shapes are the call's, whatever the routing."""
        ids = topk_ids.reshape(-1).long()
        self.used[0, layer].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        missing = (slot_of.index_select(0, ids) < 0).to(torch.int32)
        # duplicates of an id carry the same value, so the reduction is deterministic
        self.used[1, layer].scatter_reduce_(0, ids, missing, reduce="amax")

    def clear(self) -> None:
        self.used.zero_()

    def take(self) -> tuple[np.ndarray, np.ndarray]:
        """At step end, one device->host read: (routings [layers, experts], missed bool [layers, experts]).
        Clears the record for the next step."""
        both = self.used.to("cpu", copy=True).numpy()  # a copy on the CPU too: the record is cleared next
        self.used.zero_()
        return both[0], both[1] > 0


@dataclass
class ReplayCounts:
    steps: int = 0
    replayed: int = 0  # steps run more than once: their first pass missed
    replay_passes: int = 0  # re-runs in all (a step may need more than one: see the module note)
    eager_reruns: int = 0  # re-runs of steps above the decode working set, through the per-layer store
    fetched_rows: int = 0
    fetch_batches: int = 0
    drafter_rows: int = 0  # rows a speculative drafter's layers missed, fetched with the next step's batch

    def as_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "replayed_steps": self.replayed, "replay_passes": self.replay_passes,
                "eager_reruns": self.eager_reruns, "fetched_rows": self.fetched_rows,
                "fetch_batches": self.fetch_batches, "drafter_rows": self.drafter_rows,
                "replay_rate": round(self.replayed / self.steps, 6) if self.steps else None}


Need = dict[int, np.ndarray]  # layer -> every expert the step used there (the hits are pinned with the misses)


def _need(routings: np.ndarray, layers: np.ndarray | None = None) -> Need:
    """Every expert the pass used, per layer (all layers by default: the hits are pinned with the misses)."""
    if layers is None:
        layers = np.flatnonzero(routings.any(axis=1))
    return {int(layer): np.flatnonzero(routings[layer]) for layer in layers}


def store_fetch(store: Any) -> Callable[[Need], int]:
    """The batch fetch over an ExpertStore (`fetch_step`: one backing fetch, one copy submission, the step's rows
    pinned until the step closes); returns the rows brought in."""
    return store.fetch_step


class ReplayDriver:
    """Runs a step (`run`: a graph replay, or any callable computing the step) and, while it missed, fetches in one
    batch and runs it again.

    `main_layers`: the target model's MoE layers (those after it are a speculative drafter's: their misses only
    weaken drafts the target verifies, so they are fetched with the next batch, never replayed). `observe` hears
    each step's first-pass record (routings, missed) for the store's counters and heat. `before_rerun` restores
    what a re-run must see as the first pass did (the locality router's draw counter)."""

    def __init__(self, misses: StepMisses, fetch: Callable[[Need], int], *, main_layers: int | None = None,
                 gpu_expert_cache_slots: int = 0, observe: Callable[[np.ndarray, np.ndarray, bool], None] | None = None,
                 end_step: Callable[[], None] | None = None, agree: Callable[[bool], bool] | None = None):
        self.misses, self.fetch = misses, fetch
        self.main_layers = main_layers if main_layers is not None else int(misses.used.shape[1])
        self.gpu_expert_cache_slots = gpu_expert_cache_slots
        self.observe, self.end_step, self.agree = observe, end_step, agree
        self.counts = ReplayCounts()
        self._fresh = True

    def _error(self, why: str) -> ReplayError:
        size = f"{self.gpu_expert_cache_slots} slots" if self.gpu_expert_cache_slots else "its slots"
        return ReplayError(f"a replayed step missed again ({why}): the step's experts do not fit the expert cache "
                           f"({size}) at once; re-plan with a larger gpu_expert_cache_gib (more "
                           "gpu_expert_cache_slots) or fewer max_num_seqs, or serve with --set moe_graphs=split")

    def step(self, run: Callable[[], Any], *, large: bool = False, eager: Callable[[], Any] | None = None,
             before_rerun: Callable[[], None] | None = None) -> Any:
        """`large`: the step carries more tokens than the cache's decode working set; a miss then re-runs it
        through `eager` (the per-layer store path) instead of a batch fetch and replay."""
        if self._fresh:  # vLLM's warm-up and capture runs recorded too; they are not this step
            self.misses.clear()
            self._fresh = False
        try:
            out = run()
            self.counts.steps += 1
            routings, missed = self.misses.take()
            if self.observe is not None:
                self.observe(routings, missed, large)
            layers = np.flatnonzero(missed.any(axis=1))
            main = layers[layers < self.main_layers]
            if not self._any(main):
                if layers.size:  # only the drafter's layers missed: fetch for its next pass, no replay
                    self.counts.drafter_rows += self._fetch(_need(routings, layers))
                return out
            self.counts.replayed += 1
            if large and eager is not None:
                if before_rerun is not None:
                    before_rerun()
                self.counts.eager_reruns += 1
                self.counts.replay_passes += 1
                self.misses.eager = True
                try:
                    out = eager()
                finally:
                    self.misses.eager = False
                self.misses.clear()
                return out
            first_before = -1
            for _ in range(self.main_layers + 1):
                if main.size:  # (under TP another rank may be the one that missed: run again with it)
                    first = int(main[0])
                    if first <= first_before:
                        raise self._error(f"layer {first} again, after its rows were fetched")
                    self.counts.fetched_rows += self._fetch(_need(routings))
                    first_before = first
                if before_rerun is not None:
                    before_rerun()
                out = run()
                self.counts.replay_passes += 1
                routings, missed = self.misses.take()
                layers = np.flatnonzero(missed.any(axis=1))
                main = layers[layers < self.main_layers]
                if not self._any(main):
                    if layers.size:
                        self.counts.drafter_rows += self._fetch(_need(routings, layers))
                    return out
            raise self._error(f"still missing after {self.main_layers} replays")
        finally:
            if self.end_step is not None:
                self.end_step()

    def _any(self, main: np.ndarray) -> bool:
        """Whether any rank's target layers missed: every tensor-parallel rank runs the forward (and its
        all-reduces) the same number of times, so the decision is agreed (`agree`, one tiny all-reduce)."""
        local = bool(main.size)
        return self.agree(local) if self.agree is not None else local

    def _fetch(self, need: Need) -> int:
        from moetplan.runtime.store.store import StoreCapacityError

        try:
            n = int(self.fetch(need))
        except StoreCapacityError as e:
            raise self._error(str(e)) from None
        self.counts.fetch_batches += 1
        return n


__all__ = ["ReplayCounts", "ReplayDriver", "ReplayError", "StepMisses", "store_fetch"]
