"""The runtime section of the Plan: every knob a vLLM worker reads, typed and frozen, in one object.

`KernelPolicy` says which MoE kernel paths the op may take; `RuntimeKnobs` holds what the planner does not decide
(kernel policy, who promotes into the FP4 reserve, where the run record goes, checkpoint or dummy weights, the
model's router or the published-locality one); `RuntimeSection` is what a worker
reads: those knobs with the placement's fields under their own names (sizes as rows, not GiB: what the plan sized
is what the worker allocates). The allowed values of each enumerated knob live in contract.vocab.
Benches and tests build a `KernelPolicy` and pass it to the op; nothing reads a module flag.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from moetplan.contract.errors import ConfigError, UsageError
from moetplan.contract.vocab import (
    DECODE_KERNELS,
    DECODE_RINGS,
    PREFILL_KERNELS,
    PROMOTERS,
    ROUTERS,
    WEIGHT_SOURCES,
    DecodeKernel,
    DecodeRing,
    MOE_GRAPHS,
    MoeGraphs,
    ExpertFormat,
    ExpertTier,
    PrefillKernel,
    Promoter,
    Router,
    WeightSource,
)


@dataclass(frozen=True)
class KernelPolicy:
    """Which CUDA paths the routed-expert op takes (docs/KERNELS.md has the measurements behind each default).

    Every choice is deterministic; the alternatives stay selectable because benches time them against each other
    and because a GPU the defaults were not measured on may prefer another.
    """

    # Use the CUDA kernels where they apply (False: the torch reference everywhere, for checking a kernel).
    cuda: bool = True
    # Use the CPU kernels (csrc/cpu/) for steps whose x is on the CPU (False: the torch reference there).
    cpu: bool = True
    # Small (decode) steps: "auto" = rowdot up to rowdot_max_tokens tokens, else gemv; "rowdot" = CUDA-core row
    # streaming; "gemv" = mma.sync streaming stages; "mma" = the scan-mode tiles.
    decode: DecodeKernel = "auto"
    # "auto" sends steps of at most this many tokens to rowdot. 0: gemv measured faster at every token count.
    rowdot_max_tokens: int = 0
    # Routed (prefill) steps: "auto" = wgmma for wide passes on Hopper, else tiled; "tiled" = mma.sync block tiles;
    # "wgmma" = warpgroup tiles (sm_90a only); "warp" = one-warp tiles (shapes the block tiles do not take).
    prefill: PrefillKernel = "auto"
    # The tiled prefill stages' warp arrangement: 1 = 8 warps along M; 2 = a 4 x 2 grid (slower, kept to compare).
    prefill_variant: int = 1
    # Fold the weighted per-token sum into the w2 decode launch (one launch fewer); the separate combine was faster.
    fused_combine: bool = False
    # The w13 decode stage reads codes as an e4m3 A operand (sm_89+, bf16 x): slower where e4m3 MMA is emulated.
    e4m3_decode: bool = False
    # The w13 decode stage reads codes as an int8 A operand on the TMA ring (bf16 x): the faster stage on Hopper.
    i8_decode: bool = True
    # With the int8 w13 stage, the w2 stage takes an int8 operand too (one xprep launch more, faster overall).
    i8_w2: bool = True
    # How gemv stages spread units over warps: None = the extension's plan, False / True force plain / balanced.
    gemv_balance: bool | None = None
    # Which ring streams gemv weight rounds into shared memory: None = the extension's choice per stage.
    decode_ring: DecodeRing | None = None
    # Programmatic dependent launch between the op's kernels (sm_90+).
    pdl: bool = True
    # Read the kernels' residency error flag after each call (a device sync; never during graph capture).
    check_residency: bool = True

    def __post_init__(self) -> None:
        for name, value, allowed in (("decode", self.decode, DECODE_KERNELS),
                                     ("prefill", self.prefill, PREFILL_KERNELS),
                                     ("decode_ring", self.decode_ring, DECODE_RINGS),
                                     ("prefill_variant", self.prefill_variant, (1, 2))):
            if value not in allowed:
                raise UsageError(f"KernelPolicy.{name}={value!r} is not one of "
                                 f"{', '.join(repr(a) for a in allowed)}; leave it out for the default")
        if self.rowdot_max_tokens < 0:
            raise UsageError(f"KernelPolicy.rowdot_max_tokens must be >= 0, got {self.rowdot_max_tokens}")

    def describe(self) -> dict[str, Any]:
        """The fields that differ from the defaults (for run records and bench results)."""
        base = KernelPolicy()
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != getattr(base, f.name)}


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())


class Gate(BaseModel):
    """The confidence gate's knobs (docs/GATE.md)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())
    enabled: bool = False
    tau: float = Field(0.5, ge=0)
    max_promotions_per_step: int | None = None
    degraded: bool = False


class RuntimeKnobs(_Frozen):
    """What the worker needs beyond the placement; nothing here is planned."""

    kernels: KernelPolicy = Field(default_factory=KernelPolicy)
    # Who fills the FP4 reserve: "background" (the hottest experts, off the critical path) or "gate" (only the
    # gate's synchronous promotions; tokens then do not depend on a thread's timing: runs compare token for token).
    promoter: Promoter = "background"
    # The run record's file; None = beside the plan (plan.run.json, plan.run.rank<N>.json for other ranks).
    record_path: str | None = None
    record_interval_s: float = 2.0
    # Where the weights come from: "checkpoint" (loaded from the model folder) or "dummy" (vLLM's random dense
    # weights from a config-only folder; routed experts as random 2-bit rows written straight into their tier).
    weights: WeightSource = "checkpoint"
    # Who picks each token's experts: "model" (its own router) or "locality" (sampled so each layer's expert
    # popularity follows `router_popularity`: the model's published coverage curve, what the cost model predicts
    # hit rates from).
    router: Router = "model"
    # Share of one layer's routings each expert takes, hottest first (sums to 1; len = routed experts).
    router_popularity: tuple[float, ...] = ()
    # Seeds the dummy expert rows and the locality router's rankings and draws.
    seed: int = 0

    @model_validator(mode="after")
    def _locality_needs_popularity(self) -> "RuntimeKnobs":
        if self.router == "locality" and not self.router_popularity:
            raise ValueError("router 'locality' needs router_popularity (the coverage curve's expert shares); "
                             "`moetplan run --router locality` fills it from the model's hwdb entry")
        if self.router_popularity and abs(sum(self.router_popularity) - 1.0) > 1e-3:
            raise ValueError(f"router_popularity sums to {sum(self.router_popularity):.4f}, not 1")
        return self


class RuntimeSection(_Frozen):
    """Everything a worker reads from the Plan (`Plan.runtime`): the placement's fields it needs, under the
    Placement's own names (sizes as rows, not GiB: what the plan sized is what the worker allocates), the
    runtime knobs as they are, and what the run record names the run by."""

    expert_format: ExpertFormat = "2bit"
    expert_tier: ExpertTier = "resident"
    tp: int = 1
    gpu_expert_cache_slots: int = 0  # GPU expert cache rows per rank (tiers host / nvme): the slot pool's size
    host_arena_rows: int = 0  # pinned RAM arena rows per rank over the pack file (tier nvme; 0 = the page cache)
    fp4_reserve_slots: int = 0  # FP4 reserve rows per rank
    expert_row_bytes: int = 0  # one 2-bit expert row per rank (contract.layout); the worker's rows must be this size
    fp4_row_bytes: int = 0
    pack_dir: str | None = None
    gate: Gate = Field(default_factory=Gate)
    mtp: int = 0
    decode_batch_tokens: int = 1  # the most tokens a decode step carries: max_num_seqs x (1 + MTP depth)
    knobs: RuntimeKnobs = Field(default_factory=RuntimeKnobs)
    moe_graphs: MoeGraphs = "replay"
    # Tier host, split path: each layer's misses split between the CPU (from the pinned host rows) and the link
    cpu_miss_ratio: float = 0.0
    # The run record's identity: the plan's model and its placement as plan.json holds it (`moetplan diff` lines
    # the two up).
    model_id: str | None = None
    record_placement: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _tiers_need_a_cache(self) -> "RuntimeSection":
        # The one check of the cache size's floor: every path from a plan to the slot pool passes through here.
        if self.expert_tier != "resident" and self.gpu_expert_cache_slots < 1:
            raise ConfigError(f"expert_tier '{self.expert_tier}' needs at least 1 GPU expert cache slot "
                              f"(placement.gpu_expert_cache_slots is {self.gpu_expert_cache_slots}); re-plan "
                              "(`moetplan plan`) or pin a cache size (--set gpu_expert_cache_gib=...)")
        return self

    @property
    def reserve_wanted(self) -> bool:
        return self.fp4_reserve_slots > 0

    @property
    def records_steps(self) -> bool:
        """MoE layers inside vLLM's graphs record each step's routings on the device, read once at step end (the
        tiered store's misses and heat, the FP4 reserve's heat) by the replay driver around the forward call."""
        return self.moe_split_reason is None and (self.expert_tier != "resident" or self.reserve_wanted)

    @property
    def replays(self) -> bool:
        """Tiered layers run inside vLLM's graphs and a step that missed is run again (runtime/store/miss_replay.py)."""
        return self.records_steps and self.expert_tier != "resident"

    @property
    def moe_split_reason(self) -> str | None:
        """Why the MoE layers must run outside CUDA graphs (the launch splits vLLM's piecewise graph at them and
        captures no full graphs), or None: the op is capture-safe and vLLM records it inside its graphs.

        The one place this is decided (docs/CUDA_GRAPHS.md): each reason is host work the op does per
        call, which a graph replay would skip."""
        if self.expert_format == "unquantized":
            return "unquantized experts run on the torch reference, which groups each call's pairs on the host"
        if self.gate.enabled:
            return "the confidence gate re-runs a step's forward from Python"
        if self.moe_graphs == "split" and self.expert_tier != "resident":
            return (f"expert_tier {self.expert_tier} with moe_graphs=split: the expert store learns each step's routed "
                    "experts on the host and fetches the missing rows before the layer computes")
        if self.moe_graphs == "split" and self.reserve_wanted:
            return "the FP4 reserve with moe_graphs=split: it heats experts from each layer's routed ids on the host"
        return None


def runtime_section(placement: Any, knobs: RuntimeKnobs, model_id: str | None = None) -> RuntimeSection:
    """The worker's view of a placement (contract.schema.Placement) and the runtime knobs: each RuntimeSection
    field named as a Placement field is copied from it, so a placement knob reaches the worker by being declared
    in RuntimeSection under its own name."""
    p = placement
    shared = {f: getattr(p, f) for f in RuntimeSection.model_fields if f in type(p).model_fields}
    shared = {f: v.model_copy() if isinstance(v, BaseModel) else v for f, v in shared.items()}
    return RuntimeSection(
        **shared, decode_batch_tokens=max(1, int(p.max_num_seqs) * (1 + int(p.mtp))), knobs=knobs,
        model_id=model_id, record_placement=p.model_dump(mode="json"))


__all__ = ["DECODE_KERNELS", "DECODE_RINGS", "Gate", "KernelPolicy", "MOE_GRAPHS", "MoeGraphs", "PREFILL_KERNELS",
           "PROMOTERS", "ROUTERS",
           "RuntimeKnobs", "RuntimeSection", "WEIGHT_SOURCES", "runtime_section"]
