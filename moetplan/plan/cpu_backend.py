"""Plans for vLLM's CPU backend: a machine with no NVIDIA GPU serves small models with every expert in RAM.

The GPU solver has nothing to place on such a machine; this plan still carries the ledger, a cost-model prediction
and (through `moetplan run`) the launch, so the rest of the path — plugin, run record, diff, calibrate — is the same.
"""
from __future__ import annotations

import os
from typing import Any

from moetplan import contract as _schema
from moetplan.contract.vocab import ExpertFormat, ExpertTier, MoeGraphs


def host_info() -> Any:
    """This machine's host facts, cheaply (no bandwidth tests): enough to plan a CPU-backend run."""
    import psutil

    vm = psutil.virtual_memory()
    return _schema.HostInfo(
        ram_gib=round(vm.total / 2**30, 2), ram_available_gib=round(vm.available / 2**30, 2),
        cores=os.cpu_count(), sources={"ram_gib": "measured", "ram_available_gib": "measured", "cores": "measured"},
    )


CPU_TIERS: tuple[ExpertTier, ...] = ("resident", "host")
# Attention kinds vLLM's CPU backend has no kernels for (sparse MLA: GLM-5.x, DeepSeek-V3.2/V4).
CPU_UNSERVED_ATTENTION = ("mla_sparse",)


def cpu_backend_serves(spec: Any) -> bool:
    """Whether a GPU-less machine can serve `spec` from a checkpoint here: one on disk (a folder, a tiny model)
    whose attention vLLM's CPU backend runs. hwdb models without a checkpoint are planned for a GPU box."""
    return bool(spec.local_path) and spec.attention.kind not in CPU_UNSERVED_ATTENTION


def plan_for_cpu(spec: Any, context: int | None = None, expert_format: ExpertFormat = "2bit",
                 max_num_seqs: int = 4, expert_tier: ExpertTier = "resident",
                 gpu_expert_cache_gib: float | None = None, pack_dir: str | None = None,
                 moe_graphs: MoeGraphs = "replay", tp: int = 1, host: Any = None) -> Any:
    """A Plan that serves `spec` on vLLM's CPU backend, 1 GiB of KV cache: experts resident in RAM, or (tier
    "host") an expert cache of `gpu_expert_cache_gib` over a host store of every row, both in RAM. The tiered plan
    runs the GPU path's store and its hit-rate bookkeeping on a machine without a GPU.

    `tp` > 1 runs that many vLLM CPU workers (gloo all-reduce), each with its shard of every expert, its own
    cache of `gpu_expert_cache_gib` and its own 1 GiB of KV; the launch binds each worker's threads to its own
    cores (launch/command.py), so the machine needs at least `tp` cores.

    The GPU solver has nothing to place on a machine without a GPU; this plan still carries the ledger and
    the launch so the rest of the path (plugin, run record, diff) is the same as on a GPU box.

    host: this machine's HostInfo as the probe measured it (cores, DRAM copy rate, the CPU expert kernels' ISA and
    prefill rates: what the CPU step's and prefill's predictions divide by); default host_info(), which measures
    nothing (the rates then fall back to their table values in hwdb/calibration/gpu_compute.yaml).
    """
    from moetplan.contract.errors import UsageError

    if expert_tier not in CPU_TIERS:
        raise UsageError(f"expert_tier={expert_tier}: a CPU-backend plan keeps experts in RAM: "
                         f"{' or '.join(CPU_TIERS)}")
    from moetplan.contract.runtime import MOE_GRAPHS

    if moe_graphs not in MOE_GRAPHS:
        raise UsageError(f"moe_graphs={moe_graphs}: must be one of {', '.join(MOE_GRAPHS)}")
    tiered = expert_tier == "host"
    if tiered and expert_format != "2bit":
        raise UsageError("expert_tier=host caches 2-bit rows; drop --experts unquantized")
    if tiered and not gpu_expert_cache_gib:
        raise UsageError("expert_tier=host needs a cache size: --set gpu_expert_cache_gib=GIB (on the CPU backend "
                         "the cache is RAM too)")
    host = host or host_info()
    tp = int(tp)
    if tp < 1:
        raise UsageError(f"tp={tp}: the tensor-parallel degree is a whole number of ranks, 1 or more")
    if tp > 1:
        if (host.cores or 1) < tp:
            raise UsageError(f"tp={tp} on the CPU backend runs {tp} workers, each bound to its own cores; this "
                             f"machine has {host.cores} core(s): pin tp={host.cores or 1} or fewer")
        if not spec.splits_over(tp):
            raise UsageError(f"tp={tp}: {spec.id}'s expert FFN ({spec.moe_intermediate_size}) does not split into "
                             f"{tp} shards of whole 32-weight blocks; pin a tp that does (1 always does)")
    ctx = int(min(context or 2048, spec.max_position_embeddings))
    kv_gib = 1.0  # per worker: vLLM's CPU workers each allocate VLLM_CPU_KVCACHE_SPACE
    fmt_bits = "2bit" if expert_format == "2bit" else spec.expert_precision
    experts_gib = spec.routed_gib(fmt_bits if fmt_bits in ("2bit", "bf16", "fp16", "fp32", "fp8") else "bf16")
    dense_gib = spec.dense_bytes() / 2**30
    placement = _schema.Placement.for_model(
        spec, tp=tp, pp=1, expert_tier=expert_tier, kv_dtype="bf16", kv_cache_gib=kv_gib, context=ctx,
        max_num_seqs=max_num_seqs, concurrency=1, max_num_batched_tokens=max(2048, ctx),
        gpu_memory_utilization=0.9, expert_format=expert_format, pack_dir=pack_dir, moe_graphs=moe_graphs,
        **({"gpu_expert_cache_gib": float(gpu_expert_cache_gib or 0)} if tiered else {}),
    )
    cache = placement.gpu_expert_cache_gib * tp  # slots are per rank, each rank caching its shard of a row
    if tiered and placement.gpu_expert_cache_slots < spec.top_k * max_num_seqs:
        raise UsageError(f"gpu_expert_cache_gib={gpu_expert_cache_gib} holds {placement.gpu_expert_cache_slots} "
                         f"rows; a decode step of {max_num_seqs} sequence(s) needs {spec.top_k * max_num_seqs}: "
                         "give more")
    items = [
        _schema.LedgerItem(name="routed experts", gib=round(experts_gib, 6),
                           note=f"{expert_format}, {'host store' if tiered else 'resident'}"),
        _schema.LedgerItem(name="dense weights", gib=round(dense_gib, 6), note=spec.dense_precision),
        _schema.LedgerItem(name="kv cache", gib=kv_gib * tp,
                           note="VLLM_CPU_KVCACHE_SPACE" + (f" per worker, {tp} workers" if tp > 1 else "")),
    ]
    if tiered:
        items.insert(1, _schema.LedgerItem(name="expert cache", gib=round(cache, 6),
                                           note=f"{placement.gpu_expert_cache_slots} rows"
                                           + (f" per worker, {tp} workers" if tp > 1 else "")))
    memory = _schema.MemoryLedger(
        host_gib=round(experts_gib + cache + dense_gib + kv_gib * tp, 4), host_total_gib=host.ram_gib,
        host_items=items, guards=["cpu backend: no GPU guards apply"],
    )
    if memory.host_gib > (host.ram_available_gib or host.ram_gib) * 0.9:
        from moetplan.contract.errors import InfeasibleError

        raise InfeasibleError(
            f"{spec.id} needs ~{memory.host_gib:.1f} GiB of RAM on the CPU backend, this machine has "
            f"{host.ram_available_gib:.1f} GiB available",
            shortfalls=[f"host RAM short by {memory.host_gib - (host.ram_available_gib or 0):.1f} GiB"],
            suggestions=["serve a tiny model (`moetplan run --model tiny-moe`)", "plan for a GPU box (--box)"],
        )
    from moetplan.cost_model import predict

    hw = _schema.HardwareProfile(source="probe:host", host=host,
                                 description="this machine, no NVIDIA GPU: vLLM CPU backend")
    # The cost model prices a GPU-less host as one rank with its own 'cpu' factor family, so plan-vs-run diffs
    # and `moetplan calibrate` work on CPU runs too (the factors are rough until calibrated on this machine).
    # TP workers on one CPU share its cores and DRAM: the step is priced as one worker's over the same rows and
    # cache slots (the cost model's TP terms are GPU links); the gloo all-reduce between them is not priced.
    prediction = predict(spec, hw, placement if tp == 1 else placement.resized(spec, tp=1))
    prediction.notes.append("CPU-backend plans are for checking the path; calibrate with `moetplan calibrate`")
    if tp > 1:
        prediction.notes.append(f"tp={tp} on the CPU backend is priced as one worker sharing the cores (the gloo "
                                "all-reduce between workers is not priced; its compute on the cores less the one "
                                "vLLM's auto binding leaves to the scheduler, though the per-worker binding uses "
                                "every core: slower by cores/(cores-1) than it should be)")
    return _schema.Plan(
        model=spec,
        hardware=hw,
        goals=_schema.Goals(context=context, pack_dir=pack_dir),
        placement=placement,
        memory=memory,
        prediction=prediction,
        reasons=[_schema.Reason(knob="expert_tier", text="no NVIDIA GPU here: vLLM's CPU backend with every "
                                "routed expert " + ("in a host store behind an expert cache, both in RAM" if tiered
                                                    else "resident in RAM")),
                 _schema.Reason(knob="kv_cache_gib", text="1 GiB CPU KV cache (VLLM_CPU_KVCACHE_SPACE)")]
        + ([_schema.Reason(knob="tp", text=f"pinned: {tp} CPU workers, each with its shard of every expert, its "
                           "threads bound to its own cores")] if tp > 1 else []),
    )
