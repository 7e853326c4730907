"""The slot pool both GPU pools share (the expert cache and the FP4 reserve), and the expert cache's counters.

`SlotPool`: N slots x stride bytes (uint8, on the compute device) and residency int32 [layers, experts] -> slot or
-1, on the same device (the op takes `slot_of = residency[layer]`), with a host mirror for bookkeeping.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from moetplan.runtime.store.backing import Key


# --------------------------------------------------------------------------- slot pool


class SlotPool:
    """N rows of `stride` bytes on `device`, plus the residency table [layers, experts] -> slot or -1.

    The pool only moves bytes and keeps the two maps consistent; which slot to reuse is the store's business.
    """

    def __init__(self, num_slots: int, stride: int, num_layers: int, num_experts: int,
                 device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.num_slots, self.stride = int(num_slots), int(stride)
        self.num_layers, self.num_experts = int(num_layers), int(num_experts)
        self.data = torch.empty((self.num_slots, self.stride), dtype=torch.uint8, device=self.device)
        # Host mirror: the store decides on the host; on CPU the device table *is* the mirror (shared memory).
        self.res = np.full((self.num_layers, self.num_experts), -1, dtype=np.int32)
        self.key_layer = np.full(self.num_slots, -1, dtype=np.int64)
        self.key_expert = np.full(self.num_slots, -1, dtype=np.int64)
        if self.device.type == "cpu":
            self.residency = torch.from_numpy(self.res)
        else:
            self.residency = torch.full((self.num_layers, self.num_experts), -1, dtype=torch.int32, device=self.device)
        self._free: list[int] = list(range(self.num_slots - 1, -1, -1))
        self._dirty: dict[int, int] = {}  # flat residency index -> new value, not yet on the device

    @property
    def used(self) -> int:
        return self.num_slots - len(self._free)

    @property
    def free_count(self) -> int:
        return len(self._free)

    def take_free(self, n: int) -> list[int]:
        n = min(n, len(self._free))
        out = [self._free.pop() for _ in range(n)]
        return out

    def evict(self, slot: int) -> Key:
        layer, expert = int(self.key_layer[slot]), int(self.key_expert[slot])
        if layer >= 0:
            self.res[layer, expert] = -1
            self._dirty[layer * self.num_experts + expert] = -1
        self.key_layer[slot] = self.key_expert[slot] = -1
        return layer, expert

    def assign(self, slot: int, layer: int, expert: int) -> None:
        self.res[layer, expert] = slot
        self.key_layer[slot], self.key_expert[slot] = layer, expert
        self._dirty[layer * self.num_experts + expert] = slot

    def unassign(self, slot: int) -> None:
        """Undo an assign whose bytes never arrived (a failed fetch): the slot goes back to the free list."""
        self.evict(slot)
        self._free.append(slot)

    def publish(self) -> None:
        """Push residency changes to the device table, ordered on the current (compute) stream."""
        if not self._dirty:
            return
        if self.device.type != "cpu":
            upd = np.array([list(self._dirty.keys()), list(self._dirty.values())], dtype=np.int64)
            # Pageable source + non_blocking: CUDA stages the bytes before returning, so no host sync is needed.
            dev = torch.from_numpy(upd).to(self.device, non_blocking=True)
            self.residency.view(-1).index_copy_(0, dev[0], dev[1].to(torch.int32))
        self._dirty.clear()

    def check(self) -> None:
        """Consistency of the maps (tests call it after every operation)."""
        occupied = np.nonzero(self.key_layer >= 0)[0]
        assert len(occupied) + len(self._free) == self.num_slots, "slot accounting broken"
        assert not set(occupied.tolist()) & set(self._free), "a free slot holds a row"
        for s in occupied.tolist():
            assert self.res[self.key_layer[s], self.key_expert[s]] == s, "residency does not point back"
        assert int((self.res >= 0).sum()) == len(occupied), "residency holds stale slots"


# --------------------------------------------------------------------------- statistics


@dataclass
class CacheCounters:
    steps: int = 0
    zero_miss_steps: int = 0
    calls: int = 0
    routings: int = 0  # (token, expert) pairs
    routing_hits: int = 0
    misses: int = 0  # rows fetched on demand (unique per call)
    _step_misses: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "calls": self.calls,
            "routings": self.routings,
            "misses": self.misses,
            "token_hit_rate": self.routing_hits / self.routings if self.routings else None,
            "zero_miss_step_share": self.zero_miss_steps / self.steps if self.steps else None,
            "misses_per_step": self.misses / self.steps if self.steps else None,
        }


@dataclass
class Transfers:
    bytes_host: int = 0  # rows served from host RAM (pinned store, arena hits)
    bytes_nvme: int = 0  # rows read from the pack file
    bytes_h2d: int = 0
    h2d_s: float = 0.0  # time the copies took (CUDA events; wall time on CPU)
    h2d_timed_bytes: int = 0
    read_s: float = 0.0
    batches: int = 0
    prefetched_rows: int = 0
    evictions: int = 0
    cpu_rows: int = 0  # missed rows computed on the CPU from the host store instead of fetched (tier host, split)
    pending: list = field(default_factory=list)  # (start event, end event, bytes) not yet resolved


def coalesce_runs(views: list[torch.Tensor], slots: list[int], stride: int) -> list[tuple[torch.Tensor, int]]:
    """Merge (source row, slot) pairs whose sources are adjacent in memory and whose slots are consecutive."""
    pairs = sorted(zip(slots, range(len(views))))
    runs: list[tuple[torch.Tensor, int]] = []
    i = 0
    while i < len(pairs):
        s0, v0 = pairs[i]
        j = i + 1
        while (j < len(pairs) and pairs[j][0] == s0 + (j - i)
               and views[pairs[j][1]].data_ptr() == views[v0].data_ptr() + (j - i) * stride):
            j += 1
        src = views[v0] if j == i + 1 else views[v0].as_strided((j - i, stride), (stride, 1))
        runs.append((src.reshape(-1, stride), s0))
        i = j
    return runs


__all__ = ["CacheCounters", "SlotPool", "Transfers", "coalesce_runs"]
