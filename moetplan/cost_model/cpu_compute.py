"""A missed routed expert computed on the CPU from its host copy vs fetched over the host link (issue 39).

Both read the expert's 2-bit row from host RAM once; the CPU path reads it through the memory bus at the rate
`moetplan.runtime.op.cpu_kernels.measure_expert_throughput` measures (GB/s of 2-bit rows at batch 1, all cores), the
fetch path over PCIe at the pinned H2D rate. The two links work at once, so a step's misses are split to finish
both at the same time. Torch-free: the planner and the cost model call it with measured rates.
"""
from __future__ import annotations

from dataclasses import dataclass


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


__all__ = ["MissSplit", "split_misses"]
