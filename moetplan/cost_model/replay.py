"""The replay term of a tiered decode step (`moe_graphs=replay`, runtime/miss_replay.py).

A tiered step runs as a CUDA-graph step; every step ends with one device->host read of the layers' miss record;
a step with at least one miss (probability P, the coverage model's 1 - zero-miss share) fetches every missing row
in one batch and runs the graph again:

    tiered step = graph step + P x (batched fetch + graph step) + one read

The graph step is the forward-pass terms already in the step; this adds the rest. The fetched bytes stay in the
miss term (their expectation is the same either way). The batch's fixed cost keeps the calibrated form, one link
round trip per layer with misses (`link.fetch_overhead_mib` was fitted that way on vLLM-Moet's replay numbers,
whose batches are gathered layer by layer; a refit may fold it into one per batch), plus one round trip every step
for the read of the record.
"""
from __future__ import annotations

from dataclasses import dataclass

from moetplan.cost_model.coverage import MissStats

MIB = 2**20


@dataclass(frozen=True)
class ReplayCost:
    """Coefficients of the replay term (parameters of calibration.PARAMS -> coefficient) and its rates."""

    parts: dict[str, float]
    replay_rate: float  # steps run twice, per step: P(step misses)
    zero_miss_share: float

    def note(self) -> str:
        return (f"replay: {self.replay_rate:.0%} of steps fetch their misses in one batch and run again "
                f"({self.zero_miss_share:.0%} zero-miss), one miss-record read per step")


def replay_cost(miss: MissStats, graph_ms: float, h2d_gbps: float) -> ReplayCost:
    """P x (the batched fetch + a graph re-run) + one read per step, as calibration coefficients:
    `family.miss_replay_factor` scales the re-run (graph steps), `link.fetch_overhead_mib` the round trips over the
    host link (the batch's, per layer with misses, and the step-end read)."""
    p = min(max(miss.p_step_miss, 0.0), 1.0)
    round_trip_ms = MIB / (h2d_gbps * 1e9) * 1e3  # the unit of link.fetch_overhead_mib: 1 MiB at link speed
    return ReplayCost(parts={"family.miss_replay_factor": p * graph_ms,
                             "link.fetch_overhead_mib": (miss.layers_with_miss + 1.0) * round_trip_ms},
                      replay_rate=p, zero_miss_share=1.0 - p)


__all__ = ["ReplayCost", "replay_cost"]
