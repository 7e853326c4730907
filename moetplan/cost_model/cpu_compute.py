"""A missed routed expert computed on the CPU from its host copy vs fetched over the host link (issue 39).

Both read the expert's 2-bit row from host RAM once; the CPU path reads it through the memory bus at the rate
`moetplan probe` measures (hw.json `host.cpu_expert_gbps`: GB/s of 2-bit rows at batch 1, all cores), the fetch path
over PCIe at the pinned H2D rate. The two links work at once, so a step's misses are split to finish both at the
same time. The plan carries the ratio of the two rates (Placement.cpu_miss_ratio), which is all a split needs: the
cost model prices the tiered step with it and the runtime's split path splits each layer's misses by it.
Torch-free: the planner and the cost model call it with measured rates.

It also prices a token-expert pair of a prefill chunk on vLLM's CPU backend (expert_pair_cost): the kernels' vector
loop takes whole blocks of each row's weights, the scalar loop the rest, each at the rate the probe measured.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from moetplan.contract import HardwareProfile, Placement
from moetplan.cost_model.hardware import rates


@dataclass(frozen=True)
class MissSplit:
    """How one step's misses are served: `cpu` computed on the CPU, `fetched` over the link; `seconds` until
    both are done (the later of the two)."""

    cpu: int
    fetched: int
    seconds: float
    fetch_only_seconds: float

    @property
    def cpu_share(self) -> float:
        n = self.cpu + self.fetched
        return self.cpu / n if n else 0.0


def split_misses(misses: int, row_bytes: int, cpu_gbps: float | None, h2d_gbps: float) -> MissSplit:
    """The split of `misses` rows of `row_bytes` that minimises max(CPU time, fetch time); no CPU rate (not
    probed, or no CPU kernels) means every miss is fetched."""
    if misses < 0 or row_bytes <= 0 or h2d_gbps <= 0:
        raise ValueError(f"misses={misses}, row_bytes={row_bytes}, h2d_gbps={h2d_gbps}: need misses >= 0 and "
                         "positive sizes and rates")
    fetch = misses * row_bytes / (h2d_gbps * 1e9)
    if not cpu_gbps or cpu_gbps <= 0 or misses == 0:
        return MissSplit(0, misses, fetch, fetch)
    per_cpu, per_link = row_bytes / (cpu_gbps * 1e9), row_bytes / (h2d_gbps * 1e9)
    best = MissSplit(0, misses, fetch, fetch)
    for n in range(1, misses + 1):  # a step misses tens of experts at most: exact search, no rounding question
        t = max(n * per_cpu, (misses - n) * per_link)
        if t < best.seconds:
            best = MissSplit(n, misses - n, t, fetch)
    return best


def cpu_miss_ratio(hw: HardwareProfile, placement: Placement) -> float:
    """The per-miss speed of the CPU relative to the host link for this placement: the probed CPU expert rate
    (shared by the host's TP ranks) over the pinned H2D rate. 0 where no CPU rate was probed, or the tier is not
    `host` (only the pinned host store holds every row where the CPU can read it)."""
    cpu = hw.host.cpu_expert_gbps
    if placement.expert_tier != "host" or not cpu or not hw.gpus:
        return 0.0
    h2d = rates(hw, placement).h2d_gbps
    return round(cpu / max(1, placement.tp) / h2d, 4) if h2d > 0 else 0.0


def layer_split(misses: float, ratio: float) -> tuple[float, float]:
    """One MoE layer that misses `misses` experts on average (fractional: that many, between its floor and its
    ceiling): (share of them computed on the CPU, the layer's fetch time relative to fetching all). `ratio` is
    cpu_miss_ratio; 0 fetches everything."""
    if ratio <= 0 or misses <= 0:
        return 0.0, 1.0
    lo = max(1, math.floor(misses))
    hi = max(lo, math.ceil(misses))
    w_hi = misses - math.floor(misses) if hi > lo else 0.0
    cpu = secs = total = 0.0
    for n, w in ((lo, 1.0 - w_hi), (hi, w_hi)):
        if w <= 0:
            continue
        sp = split_misses(n, 1, ratio, 1.0)
        cpu += w * sp.cpu
        total += w * n
        secs += w * sp.seconds / sp.fetch_only_seconds
    return cpu / total, secs


# Weights of a 2-bit row the CPU kernels' vector loop takes per block, by ISA (csrc/cpu/moe_cpu.cpp: rows_avx512
# runs paired 512-weight chunks then 256-weight blocks, rows_avx2 128-weight blocks, i.e. WPB x V); the rest of a row,
# and every row shorter than one block, runs the scalar loop (tail_scalar). A row is K weights long: hidden for the
# gate and up rows, the intermediate size for the down rows.
CPU_VECTOR_BLOCK: dict[str, int] = {"avx512": 256, "avx2": 128, "scalar": 0}


@dataclass(frozen=True)
class PairCost:
    """One token-expert pair on the CPU kernels at prefill batch (compute-bound: each row block is reused across
    the expert's tokens in the chunk)."""

    seconds: float
    vector_flops: float
    scalar_flops: float

    @property
    def scalar_share(self) -> float:
        total = self.vector_flops + self.scalar_flops
        return self.scalar_flops / total if total else 0.0


def _vector_weights(k: int, isa: str) -> int:
    block = CPU_VECTOR_BLOCK.get(isa)
    if block is None:
        raise ValueError(f"CPU kernel ISA {isa!r}: one of {', '.join(CPU_VECTOR_BLOCK)}")
    return (k // block) * block if block else 0


def expert_pair_cost(hidden: int, inter: int, isa: str, vector_gflops: float, scalar_gflops: float) -> PairCost:
    """Time of one token-expert pair (gate, up and down rows: 6 x hidden x inter FLOPs) on the CPU kernels: the
    weights the vector loop takes at its measured rate, the rest at the scalar loop's."""
    if hidden <= 0 or inter <= 0 or vector_gflops <= 0 or scalar_gflops <= 0:
        raise ValueError(f"hidden={hidden}, inter={inter}, vector {vector_gflops} / scalar {scalar_gflops} GFLOP/s: "
                         "need positive shapes and rates")
    vec = 2.0 * (2 * inter * _vector_weights(hidden, isa) + hidden * _vector_weights(inter, isa))
    sca = 6.0 * hidden * inter - vec
    return PairCost(vec / (vector_gflops * 1e9) + sca / (scalar_gflops * 1e9), vec, sca)


__all__ = ["CPU_VECTOR_BLOCK", "MissSplit", "PairCost", "cpu_miss_ratio", "expert_pair_cost", "layer_split",
           "split_misses"]
