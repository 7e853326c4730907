"""ModelSpec: the architecture numbers that matter for placement, and the byte footprints they imply.

A ModelSpec comes from hwdb/models/<id>.yaml (moetplan.hwdb.model_spec) or from a local config.json /
checkpoint folder (moetplan.models.from_config). Everything byte-sized is derived here, in one place.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from moetplan.contract.layout import FORMATS as ROW_FORMATS
from moetplan.contract.layout import RowLayout, tp_splits
from moetplan.contract.units import GIB

# Bits per routed-expert weight for the formats the runtime stores (FACTS.md: "The 2-bit expert format").
EXPERT_FORMAT_BITS: dict[str, float] = {
    "2bit": 2.25,  # codes {-4,-1,+1,+4} + UE8M0 scale per 32
    "fp4": 4.25,  # e2m1 + the same UE8M0 block-32 scales (reserve format, MXFP4)
    "mxfp4": 4.25,  # checkpoint name for the same bits
    "nvfp4": 4.5,  # e2m1 + e4m3 per 16
    "int4": 4.5,  # int4 group 32 with bf16 scale
    "fp8": 8.0 + 32.0 / (128 * 128),
    "bf16": 16.0,
    "fp16": 16.0,
    "fp32": 32.0,
}
# Bytes per weight of the dense (non-routed) stack at checkpoint precision.
DENSE_BYTES_PER_PARAM: dict[str, float] = {
    "bf16": 2.0,
    "fp16": 2.0,
    "fp32": 4.0,
    "fp8": 1.0 + 4.0 / (128 * 128),
    "nvfp4": 4.5 / 8,
    "mxfp4": 4.25 / 8,
}

AttentionKind = Literal["mla", "mla_sparse", "csa", "gqa", "mha"]


class Attention(BaseModel):
    model_config = ConfigDict(extra="allow")
    kind: AttentionKind
    num_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    sliding_window: int | None = None
    full_attention_layers: int | None = Field(None, description="Layers whose KV grows with context (GQA hybrids)")


class ModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    id: str = Field(description="hwdb id (e.g. glm-5.2) or 'local:<dir name>'")
    name: str
    aliases: list[str] = Field(default_factory=list)
    family: str | None = None
    vllm_arch: str | None = None
    hf_repo: str | None = None
    local_path: str | None = None

    num_layers: int
    moe_layers: int
    hidden_size: int
    moe_intermediate_size: int
    dense_intermediate_size: int | None = None
    n_routed_experts: int
    top_k: int
    n_shared_experts: int = 0
    vocab_size: int
    max_position_embeddings: int
    attention: Attention

    # KV bytes per token summed over all layers, per kv dtype name ("bf16", "fp8", "fp8_ds_mla", "nvfp4_ds_mla").
    # MLA: every TP rank holds the full latent, so this is also the per-rank figure.
    kv_bytes_per_token: dict[str, float]
    kv_fixed_bytes_per_seq: dict[str, float] = Field(default_factory=dict)
    # Sliding-window and compressor-state caches (DeepSeek-V4) that vLLM reserves per admitted request for every
    # token in flight (max_num_batched_tokens), on top of the window: counted once, in the one request the pool
    # must admit at the full context.
    kv_inflight_bytes_per_token: dict[str, float] = Field(default_factory=dict)
    kv_shards_with_tp: bool = Field(False, description="GQA KV heads split across TP ranks; MLA does not")
    kv_dtype_forced: str | None = Field(
        None, description="The KV layout vLLM allocates for this architecture whatever --kv-cache-dtype says "
        "(DeepSeek-V4: fp8_ds_mla, hwdb's 'fp8'); every KV size of the model is that layout's (kv_layout)")

    # Non-routed weights (attention, dense FFN, shared experts, router, embeddings, lm head) in bytes at
    # checkpoint precision. `dense_gib_published` overrides the param-derived figure where a measured one exists.
    non_routed_params_b: float
    dense_precision: str = "bf16"
    dense_gib_published: float | None = None
    dense_includes_mtp: bool = Field(False, description="dense_gib_published already counts the MTP layer")
    expert_precision: str = Field("bf16", description="Checkpoint precision of routed experts")

    mtp_layers: int = 0
    mtp_params_b: float = 0.0
    mtp_acceptance: dict[int, float] = Field(
        default_factory=dict, description="Mean tokens per step by MTP depth k (model fact, overridable)"
    )
    drafter_gib: float = Field(0.0, description="Separate drafter (e.g. Eagle3) size, when one exists")
    drafter_hf_repo: str | None = Field(None, description="Where the separate drafter's checkpoint lives")
    dense_replicated_gib: float = Field(
        0.0, description="Part of the non-routed stack every TP rank holds whole beyond what the attention "
        "geometry implies (e.g. a vision tower), GiB; included in dense_gib_published")
    swiglu_limit: float | None = None

    params_total_b: float | None = None
    params_active_b: float | None = None
    # Routing locality: (share of experts cached per layer, share of routings served) points.
    coverage_points: list[tuple[float, float]] = Field(default_factory=list)
    sources: list[str] = Field(default_factory=list)

    # ------------------------------------------------------------------ derived sizes

    @property
    def expert_params(self) -> int:
        """Weights of one routed expert (gate, up, down)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def routed_expert_params(self) -> int:
        return self.moe_layers * self.n_routed_experts * self.expert_params

    def row_layout(self, fmt: str = "2bit", tp: int = 1) -> RowLayout:
        """The byte layout of one routed expert row on one TP rank, as the runtime allocates it."""
        return RowLayout.for_expert(self.hidden_size, self.moe_intermediate_size, tp, fmt)

    def splits_over(self, tp: int) -> bool:
        """The routed experts have a row layout at this tensor-parallel degree (block-32 shards)."""
        return tp_splits(self.hidden_size, self.moe_intermediate_size, tp)

    def expert_bytes(self, fmt: str = "2bit", tp: int = 1) -> float:
        """Bytes of one routed expert (one layer) on one TP rank in the given storage format.

        The runtime's formats (2bit, fp4) count the row as allocated (contract.layout: sections and rows aligned),
        so a planned slot is an allocated slot; checkpoint formats count their bits per weight.
        """
        if fmt in ROW_FORMATS:
            return float(self.row_layout(fmt, tp).stride)
        return self.expert_params * EXPERT_FORMAT_BITS[fmt] / 8 / tp

    def expert_read_bytes(self, fmt: str = "2bit", tp: int = 1) -> float:
        """Bytes a kernel reads of one routed expert on one rank: the row's payload, without its alignment
        padding (equal to the bits-per-weight figure). Memory is booked with expert_bytes, traffic with this."""
        return self.expert_params * EXPERT_FORMAT_BITS[fmt] / 8 / tp

    def routed_bytes(self, fmt: str = "2bit", tp: int = 1) -> float:
        """All routed experts, one TP rank."""
        return self.moe_layers * self.n_routed_experts * self.expert_bytes(fmt, tp)

    def routed_gib(self, fmt: str = "2bit", tp: int = 1) -> float:
        return self.routed_bytes(fmt, tp) / GIB

    def dense_bytes(self) -> float:
        """Whole non-routed stack (without MTP) at checkpoint precision."""
        if self.dense_gib_published is not None:
            return self.dense_gib_published * GIB
        return self.non_routed_params_b * 1e9 * DENSE_BYTES_PER_PARAM[self.dense_precision]

    def dense_bytes_per_rank(self, tp: int = 1) -> float:
        # Embeddings/lm_head and attention shard with TP in vLLM; a small replicated part (norms, router) is ignored.
        return self.dense_bytes() / tp

    def mtp_bytes_per_rank(self, tp: int = 1) -> float:
        """The MTP layer(s) as our runtime holds them: routed experts at 2-bit, the rest at dense precision."""
        if self.mtp_layers <= 0 or self.dense_includes_mtp:
            return 0.0
        rows = self.mtp_layers * self.n_routed_experts
        rest = max(self.mtp_params_b * 1e9 - rows * self.expert_params, 0.0)
        return rest * DENSE_BYTES_PER_PARAM[self.dense_precision] / tp + rows * self.expert_bytes("2bit", tp)

    @model_validator(mode="after")
    def _forced_kv_is_a_layout(self) -> "ModelSpec":
        if self.kv_dtype_forced is not None and self.kv_dtype_forced not in self.kv_bytes_per_token:
            raise ValueError(f"kv_dtype_forced '{self.kv_dtype_forced}' is not one of kv_bytes_per_token's layouts "
                             f"({', '.join(self.kv_bytes_per_token)})")
        return self

    def kv_dtypes(self) -> list[str]:
        """The KV layouts a plan may choose: the one vLLM forces, when it forces one."""
        return [self.kv_dtype_forced] if self.kv_dtype_forced else list(self.kv_bytes_per_token)

    def kv_layout(self, kv_dtype: str) -> str:
        """The layout vLLM allocates when asked for `kv_dtype`: the forced one, when the architecture has one (a plan
        written before the fact, or a pin, is sized as served)."""
        return self.kv_dtype_forced or kv_dtype

    def kv_bytes(self, kv_dtype: str, tokens: int, tp: int = 1, seqs: int = 1) -> float:
        """KV bytes on one TP rank for `tokens` cached tokens spread over `seqs` sequences, in the layout vLLM
        allocates for `kv_dtype` (kv_layout)."""
        if kv_dtype not in self.kv_bytes_per_token:
            raise KeyError(f"{self.id} has no KV layout '{kv_dtype}' (known: {', '.join(self.kv_bytes_per_token)})")
        kv_dtype = self.kv_layout(kv_dtype)
        per_tok = self.kv_bytes_per_token[kv_dtype]
        fixed = self.kv_fixed_bytes_per_seq.get(kv_dtype, 0.0) * seqs
        total = per_tok * tokens + fixed
        return total / tp if self.kv_shards_with_tp else total

    def mtp_accept(self, k: int) -> float:
        """Mean tokens emitted per decode step at MTP depth k (1.0 without speculation)."""
        if k <= 0:
            return 1.0
        if k in self.mtp_acceptance:
            return self.mtp_acceptance[k]
        known = sorted(self.mtp_acceptance)
        if known:
            # Beyond the known depths each extra draft adds less; cap growth at the last known point + 0.3/token.
            last = known[-1]
            return self.mtp_acceptance[last] + 0.3 * max(0, k - last) if k > last else self.mtp_acceptance[known[0]]
        # Documented default for MTP heads without published acceptance: 0.7 per drafted token, geometric.
        return sum(0.7**i for i in range(k + 1))

    @property
    def has_speculation(self) -> bool:
        return self.mtp_layers > 0 or self.drafter_gib > 0
