"""Slot counts: how many expert rows a byte budget holds, one decode step's working set, and the FP4 reserve's size.

One rule each, shared by the planner (ledger, solver), the runtime (the reserve it builds) and the quality harness,
so the reserve a plan sizes is the reserve a worker allocates.
"""
from __future__ import annotations

import math

from moetplan.contract.units import GIB

# A GiB budget that is an exact number of rows, written as a float, may land a hair below it: count it as full.
_EPS = 1e-9


def rows_in(gib: float, row_bytes: int) -> int:
    """Whole rows of `row_bytes` in `gib` GiB (0 when either is 0)."""
    if gib <= 0 or row_bytes <= 0:
        return 0
    return int(math.floor(gib * GIB / row_bytes + _EPS))


def step_working_set(moe_layers: int, top_k: int, spec_tokens: int = 0, seqs: int = 1) -> int:
    """One decode step's routed (layer, expert) pairs: MoE layers x top_k x (1 + speculative tokens) x sequences."""
    return moe_layers * top_k * (1 + max(0, spec_tokens)) * max(1, seqs)


def gate_floor_slots(working_set: int, floor_factor: float, pp: int = 1) -> int:
    """FP4 rows the confidence gate needs to promote one step's experts (x floor_factor), per pipeline stage."""
    return math.ceil(floor_factor * working_set / max(1, pp))


def reserve_slots(slots: int, num_layers: int, num_experts: int) -> int:
    """The FP4 reserve's rows: what was sized, never more than there are (layer, expert) rows to hold."""
    return max(0, min(int(slots), num_layers * num_experts))


__all__ = ["gate_floor_slots", "reserve_slots", "rows_in", "step_working_set"]
