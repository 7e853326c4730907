"""The one contract: pydantic models serialised as plan.json / hw.json / run.json.

Every stage (probe, plan, run, bench, diff) reads and writes these and nothing else. Knob names in
`Placement` are the names users pin with `--set name=value`; do not rename them without bumping
SCHEMA_VERSION.
"""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, ValidationError, computed_field, \
    model_validator
from pydantic.fields import FieldInfo

from moetplan.contract.model import ModelSpec
from moetplan.contract.errors import UsageError
from moetplan.contract.runtime import Gate, RuntimeKnobs, RuntimeSection, runtime_section
from moetplan.contract.sizing import rows_in
from moetplan.contract.units import GIB, parse_tokens
from moetplan.contract.vocab import CpuIsa, ExpertFormat, ExpertTier, MoeGraphs, Objective, ToolStrictLevel, \
    ValueSource

SCHEMA_VERSION = "1.0"


def _tokens(v: Any) -> Any:
    # A token count as users write it ("128k"); numbers pass through to the int check.
    if isinstance(v, str):
        try:
            return parse_tokens(v)
        except ValueError:
            return v  # the int check names the field and the bad value
    return v


# A token count: an int, or a string users write ("32768", "128k").
Tokens = Annotated[int, BeforeValidator(_tokens)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


# --------------------------------------------------------------------------- hardware


class GPUInfo(_Model):
    index: int = 0
    name: str = Field(description="Name as reported by the driver, or the hwdb display name")
    hwdb_id: str | None = Field(None, description="Matched hwdb/gpus.yaml id; None when unmatched")
    uuid: str | None = None
    vram_gib: float
    free_gib: float | None = None
    mem_bw_gbps: float = Field(description="Device memory bandwidth, GB/s")
    compute_capability: str = Field(description='e.g. "12.0"')
    fp8: bool = False
    fp4: bool = False
    pcie_gen: int | None = None
    pcie_width: int | None = None
    pcie_gen_max: int | None = None
    pcie_width_max: int | None = None
    power_limit_w: float | None = None
    h2d_pinned_gbps: float | None = Field(None, description="Pinned host->device GB/s at expert-sized copies")
    h2d_pageable_gbps: float | None = None
    h2d_batched_gbps: float | None = Field(None, description="Many expert-sized copies in one go")
    d2d_gbps: float | None = Field(None, description="Device memory copy GB/s (read+write counted)")
    nvlink_peers: list[int] = Field(default_factory=list)
    sources: dict[str, ValueSource] = Field(
        default_factory=dict, description="Where each numeric field came from: measured vs datasheet"
    )


class HostInfo(_Model):
    ram_gib: float
    ram_available_gib: float | None = None
    cpu_model: str | None = None
    cores: int | None = None
    numa_nodes: int | None = None
    hugepages_total: int | None = None
    hugepage_size_kib: int | None = None
    memlock_bytes: int | None = Field(None, description="RLIMIT_MEMLOCK soft limit; None = unlimited")
    pinned_alloc_ok: bool | None = Field(None, description="Pinned allocation of a test size worked")
    dram_gbps: float | None = None
    cpu_expert_gbps: float | None = Field(
        None, description="GB/s of 2-bit expert rows the CPU kernels compute at batch 1 on all cores (a missed "
        "expert computed from its host copy instead of fetched); None: not measured (no CPU kernels, older probe)")
    # What a prefill chunk costs on the CPU backend (cost_model/prefill.py): every token-expert pair runs through
    # the CPU kernels, compute-bound; their vector loop takes whole blocks of a row's weights, the rest of a row
    # (and every row shorter than a block) runs the scalar loop, about 50x slower.
    cpu_kernel_isa: CpuIsa | None = Field(
        None, description="The CPU kernels' instruction set here (avx512, avx2 or scalar): it sets how many of an "
        "expert row's weights the vector loop takes; None: not measured")
    cpu_expert_prefill_gflops: float | None = Field(
        None, description="GFLOP/s of expert math the CPU kernels' vector loop reaches at prefill batch (64 tokens "
        "per expert) on one core (one thread: a worker's cores multiply it); None: not measured")
    cpu_expert_scalar_gflops: float | None = Field(
        None, description="GFLOP/s of the CPU kernels' scalar loop at prefill batch on one core (rows shorter than "
        "one vector block, remainders); None: not measured")
    # The rest of a CPU prefill chunk (cost_model/prefill.py): the dense layers' GEMMs (projections, shared experts,
    # LM head) and attention, at rates measured with torch on one thread in the dtype vLLM's CPU backend computes
    # them in (the checkpoint's bf16: vLLM keeps bf16 on every x86 CPU, emulated where AVX512-BF16/AMX are absent).
    cpu_gemm_gflops: float | None = Field(
        None, description="GFLOP/s of a dense GEMM (prefill-sized, cpu_gemm_dtype) on one core (a worker's cores "
        "multiply it); None: not measured (no torch)")
    cpu_gemm_dtype: str | None = Field(None, description="The dtype cpu_gemm_gflops was measured in (bf16)")
    cpu_attention_gflops: float | None = Field(
        None, description="GFLOP/s of causal prefill attention (QK^T and PV FLOPs) on one core; None: not measured")
    sources: dict[str, ValueSource] = Field(default_factory=dict)


class StorageInfo(_Model):
    path: str | None = None
    fs_type: str | None = None
    free_gib: float | None = None
    seq_read_gbps: float | None = None
    rand_read_gbps: float | None = Field(None, description="Expert-sized (4-16 MiB) random reads, O_DIRECT")
    o_direct: bool | None = None
    warnings: list[str] = Field(default_factory=list)
    sources: dict[str, ValueSource] = Field(default_factory=dict)


class HardwareProfile(_Model):
    schema_version: str = SCHEMA_VERSION
    source: str = Field("inline", description='"probe", "box:<id>", "inline", "file:<path>" or "default"')
    box_id: str | None = None
    description: str | None = None
    gpus: list[GPUInfo] = Field(default_factory=list)
    host: HostInfo
    storage: StorageInfo = Field(default_factory=StorageInfo)
    p2p: bool = Field(False, description="GPU peer-to-peer usable for tensor parallel traffic")
    measured_at: str | None = None
    warnings: list[str] = Field(default_factory=list)

    @property
    def num_gpus(self) -> int:
        return len(self.gpus)


# --------------------------------------------------------------------------- goals & placement


class Goals(_Model):
    context: int | None = Field(None, description="Wanted max context (tokens); None = as much as fits")
    concurrency: int = 1
    objective: Objective = "balanced"
    pinned: dict[str, Any] = Field(default_factory=dict, description="Knobs fixed with --set name=value")
    pack_dir: str | None = None


# GiB knobs a user pins (--set) or a measurement names, and the stored count each one becomes: (count field, row
# size field). All three are per GPU rank.
SIZE_KNOBS: dict[str, tuple[str, str]] = {
    "gpu_expert_cache_gib": ("gpu_expert_cache_slots", "expert_row_bytes"),
    "fp4_reserve_gib": ("fp4_reserve_slots", "fp4_row_bytes"),
    "host_arena_gib": ("host_arena_rows", "expert_row_bytes"),
}


def _int_or(v: Any, default: int) -> int:
    try:
        return int(v or default)
    except (TypeError, ValueError):  # not a number: the field's own validation reports it
        return default


def _size_knobs_schema(schema: dict[str, Any]) -> None:
    # The derived GiB are written to plan.json and read back (checked against the rows), so the schema lists them.
    for knob, (count, _) in SIZE_KNOBS.items():
        schema.setdefault("properties", {})[knob] = {
            "type": "number", "title": knob.replace("_", " ").capitalize(),
            "description": f"Derived: {count} x the row size, in GiB. As input (a pin) it becomes {count}."}


class Placement(_Model):
    """Sizes are stored once, as rows; their GiB are derived from the row sizes (contract.layout), so what is
    planned is what the runtime allocates. GiB given as input (a pin, a measurement) becomes rows."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=(), json_schema_extra=_size_knobs_schema)

    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    expert_tier: ExpertTier = "resident"
    gpu_expert_cache_slots: int = Field(0, ge=0, description="Expert rows (per layer-expert) the cache holds per rank")
    fp4_reserve_slots: int = Field(0, ge=0, description="FP4 expert rows the reserve holds per rank")
    host_arena_rows: int = Field(0, ge=0, description="Rows of the pinned RAM arena over NVMe packs, per rank "
                                 "(tier nvme); each rank's arena holds its own TP shard of the rows")
    expert_row_bytes: int = Field(0, description="One 2-bit expert row on one rank (what a cache slot and an arena "
                                  "row hold); 0 until sized for a model")
    fp4_row_bytes: int = Field(0, description="One FP4 expert row on one rank (what a reserve slot holds)")
    kv_dtype: str = "fp8"
    kv_cache_gib: float = Field(0.0, ge=0, description="Per GPU rank")
    kv_tokens: int = Field(0, description="Tokens the KV pool holds (what vLLM prints as 'GPU KV cache size')")
    kv_cache_clamped: bool = Field(False, description="kv_cache_gib is given to vLLM (--kv-cache-memory-bytes) "
                                                      "instead of being what gpu_memory_utilization leaves")
    kv_cache_memory_bytes: int = Field(0, ge=0, description="vLLM's --kv-cache-memory-bytes: the KV pool per rank, "
                                       "clamped (0 = vLLM sizes it from gpu_memory_utilization)")
    context: Tokens = Field(4096, ge=1, description="max_model_len")
    mtp: int = Field(0, ge=0, description="Speculative tokens per step (MTP depth)")
    mtp_acceptance: float = Field(1.0, ge=0, description="Mean tokens emitted per decode step")
    max_num_seqs: int = Field(1, ge=1)
    concurrency: int = Field(1, ge=1)
    max_num_batched_tokens: int = Field(8192, ge=1)
    activation_peak_gib: float = Field(0.0, description="Per GPU rank: the forward pass's activation peak at "
                                                        "max_num_batched_tokens tokens (outside the KV pool)")
    gpu_memory_utilization: float = Field(0.92, ge=0.1, le=0.99)
    pack_dir: str | None = None
    expert_format: ExpertFormat = Field(
        "2bit", description="Routed experts as the runtime stores them; 'unquantized' keeps the checkpoint's "
        "(for checking the path against stock vLLM)")
    gate: Gate = Field(default_factory=Gate)
    moe_graphs: MoeGraphs = Field("replay", description="Tiered experts inside vLLM's CUDA graphs, a step that "
                                  "missed fetched in one batch and run again ('replay'), or outside them with the "
                                  "store on the host per layer ('split', the measured fallback)")
    cpu_miss_ratio: float = Field(0.0, ge=0, description="Per-miss speed of the CPU computing a missed expert from "
                                  "the host rows relative to the link fetching it (the probe's host.cpu_expert_gbps "
                                  "per rank / the pinned H2D rate); tier host: each layer's misses are split between "
                                  "the two, both at once. 0 fetches every miss")

    @model_validator(mode="before")
    @classmethod
    def _rows_from_gib(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not any(k in data for k in SIZE_KNOBS):
            return data
        data = dict(data)
        for knob, (count, row_field) in SIZE_KNOBS.items():
            if knob not in data:
                continue
            gib = float(data.pop(knob) or 0.0)
            row = _int_or(data.get(row_field), 0)
            if count in data:  # a saved plan carries both: the GiB is derived, and must agree with the rows
                if row and abs(gib * GIB - _int_or(data[count], 0) * row) > row:
                    raise ValueError(f"{knob}={gib} disagrees with {count}={data[count]} rows of {row} bytes; "
                                     f"{count} is what the runtime allocates: edit it (or drop {knob})")
                continue
            if gib and not row:
                raise ValueError(f"{knob}={gib} needs the row size to become {count}: build the placement with "
                                 f"Placement.for_model(model, {knob}=...) or give {count}")
            data[count] = rows_in(gib, row)
        return data

    @computed_field  # type: ignore[prop-decorator]
    @property
    def gpu_expert_cache_gib(self) -> float:
        """Per GPU rank; 0 when experts are resident."""
        return self.gpu_expert_cache_slots * self.expert_row_bytes / GIB

    @computed_field  # type: ignore[prop-decorator]
    @property
    def fp4_reserve_gib(self) -> float:
        """Per GPU rank."""
        return self.fp4_reserve_slots * self.fp4_row_bytes / GIB

    @computed_field  # type: ignore[prop-decorator]
    @property
    def host_arena_gib(self) -> float:
        """Pinned RAM over NVMe packs, per GPU rank (each rank's arena holds rows of its own TP shard)."""
        return self.host_arena_rows * self.expert_row_bytes / GIB

    @classmethod
    def for_model(cls, model: ModelSpec, **fields: Any) -> "Placement":
        """A placement whose row sizes are `model`'s at the given tp; GiB sizes among `fields` become rows."""
        tp = int(fields.get("tp", 1))
        if model.splits_over(tp):
            fields["expert_row_bytes"] = int(model.expert_bytes("2bit", tp))
            fields["fp4_row_bytes"] = int(model.expert_bytes("fp4", tp))
        return cls(**fields)

    def resized(self, model: ModelSpec, **changes: Any) -> "Placement":
        """A copy with `changes` (GiB sizes become rows; a new tp brings its own row sizes, the counts stay)."""
        data = self.model_dump(exclude=set(SIZE_KNOBS) | {"expert_row_bytes", "fp4_row_bytes"})
        for knob in SIZE_KNOBS.keys() & changes.keys():
            data.pop(SIZE_KNOBS[knob][0], None)
        return Placement.for_model(model, **{**data, **changes})


# Knob names accepted by --set (the issue fixes these names): Placement fields, the GiB sizes that become rows
# (SIZE_KNOBS), and the KNOB_FIELDS below. kv_cache_memory_bytes clamps the KV pool (vLLM's --kv-cache-memory-bytes).
# Each knob's type, allowed values and bounds are its field's (`parse_knob`): a new knob is a field and a name here.
PINNABLE_KNOBS: tuple[str, ...] = (
    "tp", "pp", "expert_tier", "gpu_expert_cache_gib", "fp4_reserve_gib", "host_arena_gib", "kv_dtype",
    "context", "mtp", "mtp_acceptance", "max_num_seqs", "concurrency", "gpu_memory_utilization", "moe_graphs",
    "gate_tau", "max_num_batched_tokens", "kv_cache_memory_bytes", "cpu_miss_ratio",
)
# --set names that are not a Placement field's own name: (model, field) they are typed by.
KNOB_FIELDS: dict[str, tuple[type[BaseModel], str]] = {"gate_tau": (Gate, "tau")}


def knob_field(name: str) -> Any:
    """The pydantic FieldInfo that types --set `name` (a GiB size is a float with its row count's bounds)."""
    if name in KNOB_FIELDS:
        model, field = KNOB_FIELDS[name]
        return model.model_fields[field]
    if name in SIZE_KNOBS:
        count = Placement.model_fields[SIZE_KNOBS[name][0]]
        return FieldInfo.from_annotated_attribute(Annotated[(float, *count.metadata)], 0.0)  # type: ignore[arg-type]
    return Placement.model_fields[name]


def _describe(field: Any) -> str:
    ann = field.annotation
    if get_origin(ann) is Literal:
        return f"choose one of {', '.join(str(a) for a in get_args(ann))}"
    bounds = [f"{op} {getattr(m, attr)}" for m in field.metadata
              for attr, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")) if hasattr(m, attr)]
    kind = {int: "a whole number", float: "a number", str: "a name"}.get(ann, getattr(ann, "__name__", str(ann)))
    return f"give {kind}{' ' + ' and '.join(bounds) if bounds else ''}"


def parse_knob(name: str, value: str) -> Any:
    """`--set name=value`'s value, typed and checked as the schema declares the knob: its field's type, its
    allowed values (a Literal) and its bounds (ge/le). UsageError naming the knob, the allowed values and the fix."""
    if name not in PINNABLE_KNOBS:
        import difflib

        close = difflib.get_close_matches(name, PINNABLE_KNOBS, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise UsageError(f"--set: unknown knob '{name}'.{hint} Knobs: {', '.join(PINNABLE_KNOBS)}")
    field = knob_field(name)
    try:
        typed = Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
        return TypeAdapter(typed).validate_python(value)  # type: ignore[arg-type]
    except ValidationError as e:
        problem = e.errors()[0]["msg"]
        example = field.default if field.default is not None else ""
        raise UsageError(f"--set {name}={value}: {problem}; {_describe(field)} "
                         f"(e.g. --set {name}={example})") from None


# --------------------------------------------------------------------------- memory ledger


class LedgerItem(_Model):
    name: str
    gib: float
    note: str | None = None


class GPURankMemory(_Model):
    rank: int
    gpu: str
    total_gib: float
    budget_gib: float = Field(description="total x gpu_memory_utilization")
    used_gib: float
    items: list[LedgerItem] = Field(default_factory=list)

    @property
    def free_gib(self) -> float:
        return self.budget_gib - self.used_gib


class MemoryLedger(_Model):
    gpus: list[GPURankMemory] = Field(default_factory=list)
    host_gib: float = Field(0.0, description="Host RAM the plan uses (pinned store or arena, dense staging)")
    host_total_gib: float = 0.0
    host_items: list[LedgerItem] = Field(default_factory=list)
    disk_gib: float = Field(0.0, description="Pack files on disk")
    disk_free_gib: float | None = None
    disk_items: list[LedgerItem] = Field(default_factory=list)
    guards: list[str] = Field(default_factory=list, description="Guards checked and how they came out")


# --------------------------------------------------------------------------- prediction


class Term(_Model):
    name: str
    ms: float
    share: float = 0.0
    note: str | None = None


class Prediction(_Model):
    decode_tok_s: float
    aggregate_tok_s: float = 0.0
    prefill_tok_s: float = 0.0
    ttft_ms: float | None = None
    prefill_prompt_tokens: int | None = Field(None, description="Prompt length prefill_tok_s and ttft_ms refer to")
    bottleneck: str = ""
    step_ms: float = 0.0
    tokens_per_step: float = 1.0
    terms: list[Term] = Field(default_factory=list)
    token_hit_rate: float | None = None
    zero_miss_step_share: float | None = None
    misses_per_step: float | None = None
    replay_rate: float | None = Field(None, description="Decode steps run twice (they missed and were replayed after "
                                      "one batch fetch), per step; tiered plans with moe_graphs=replay")
    gate_fire_share: float | None = None
    cpu_miss_share: float | None = Field(None, description="Tiered plans: share of the expert misses computed on the "
                                         "CPU from the host rows (the rest fetched over the link, both at once)")
    notes: list[str] = Field(default_factory=list)


# --------------------------------------------------------------------------- plan


class Reason(_Model):
    knob: str
    text: str


class Alternative(_Model):
    label: str
    placement: dict[str, Any]
    context: int
    decode_tok_s: float
    aggregate_tok_s: float = 0.0
    bottleneck: str = ""
    pareto: bool = False


class Launch(_Model):
    """What `moetplan run` reads beyond the model and placement: where the weights are and the name vLLM serves.
    The vLLM command and environment are derived from the Plan when it is served (launch.command.build_launch;
    `moetplan run --dry-run` prints them), so they are not stored."""

    model_path: str | None = Field(None, description="Checkpoint folder vLLM loads; None: the model's own")
    served_model_name: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _drop_saved_command(cls, data: Any) -> Any:
        # Plans saved before the command was derived at serve time carry argv/env, which `run` never read.
        if isinstance(data, dict) and ("argv" in data or "env" in data):
            data = {k: v for k, v in data.items() if k not in ("argv", "env")}
        return data


class Serving(_Model):
    """How vLLM speaks the model's chat format (hwdb/serving.yaml, or the user's override): the tool-call and
    reasoning parsers (vLLM registry names; None: that feature off), the tokenizer mode and a chat template
    (None: the checkpoint's own). `checked_with`: the vLLM release the names were checked against when planned.

    `tool_strict_level` defaults to "parameter": a coding agent's tools rarely say `"strict": true`, and vLLM's
    own default (auto) then leaves a call's arguments free, so a quantized model's small slip (a missing key, a
    number where a path goes) reaches the agent as a failed call or as text with no parsed `tool_calls`. Pinning
    every call to its schema costs a grammar mask inside tool calls only. Passed where the installed vLLM has the
    flag (0.31 on); older releases hold forced calls (`required`, a named tool) to the schema anyway."""
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    tokenizer_mode: str | None = None
    chat_template: str | None = None
    tool_strict_level: ToolStrictLevel = "parameter"
    source: str = ""
    checked_with: str | None = None
    notes: list[str] = Field(default_factory=list)


class Plan(_Model):
    schema_version: str = SCHEMA_VERSION
    kind: Literal["plan"] = "plan"
    created_at: str = Field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    moetplan_version: str = ""
    model: ModelSpec
    hardware: HardwareProfile
    goals: Goals = Field(default_factory=Goals)
    placement: Placement
    memory: MemoryLedger
    prediction: Prediction
    reasons: list[Reason] = Field(default_factory=list)
    alternatives: list[Alternative] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)
    launch: Launch = Field(default_factory=Launch)
    serving: Serving | None = Field(default=None, description="tool-call / reasoning parsers, tokenizer mode and "
                                    "chat template the launch passes to vLLM (None in plans older than it)")
    runtime_knobs: RuntimeKnobs = Field(default_factory=RuntimeKnobs, description="What the worker reads beyond "
                                        "the placement: kernel policy, FP4 promoter, run-record path")

    @property
    def runtime(self) -> RuntimeSection:
        """The runtime section: everything a vLLM worker reads, typed and frozen (placement sizes as rows)."""
        return runtime_section(self.placement, self.runtime_knobs, model_id=self.model.id)

    @model_validator(mode="before")
    @classmethod
    def _row_sizes_of_saved_plans(cls, data: Any) -> Any:
        # A plan saved before the row sizes were stored: take them from its model, so its GiB sizes become rows.
        if isinstance(data, dict) and isinstance(data.get("placement"), dict) and isinstance(data.get("model"), dict):
            pl = data["placement"]
            if not pl.get("expert_row_bytes"):
                try:
                    model = ModelSpec.model_validate(data["model"])
                except ValueError:  # the model's own validation reports it
                    return data
                tp = _int_or(pl.get("tp"), 1)
                if model.splits_over(tp):
                    data = {**data, "placement": {**pl, "expert_row_bytes": int(model.expert_bytes("2bit", tp)),
                                                  "fp4_row_bytes": int(model.expert_bytes("fp4", tp))}}
        return data

    @model_validator(mode="after")
    def _row_sizes_from_model(self) -> "Plan":
        p = self.placement
        if not p.expert_row_bytes and self.model.splits_over(p.tp):  # a placement built without its model
            p.expert_row_bytes = int(self.model.expert_bytes("2bit", p.tp))
            p.fp4_row_bytes = int(self.model.expert_bytes("fp4", p.tp))
        return self


class RunRecord(_Model):
    """What a served run measured, in the Plan's vocabulary (written by the runtime and by `moetplan bench`)."""

    schema_version: str = SCHEMA_VERSION
    kind: Literal["run"] = "run"
    created_at: str = Field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    model_id: str | None = None
    plan_path: str | None = None
    placement: dict[str, Any] = Field(default_factory=dict, description="The plan's placement, when known")
    measured: dict[str, Any] = Field(
        default_factory=dict,
        description="Metrics named as in Prediction: decode_tok_s, prefill_tok_s, aggregate_tok_s, ttft_ms, ...",
    )
    runtime: dict[str, Any] = Field(
        default_factory=dict,
        description="Runtime KPIs: token_hit_rate, zero_miss_step_share, misses_per_step, moe_calls, ...",
    )
    probes: dict[str, Any] = Field(default_factory=dict, description="Quality probes: PASS/FAIL per probe")
    machine: dict[str, Any] = Field(default_factory=dict)
    server: dict[str, Any] = Field(default_factory=dict)
    errors: list[str] = Field(default_factory=list, description="What failed (a bench with errors exits 1)")
    notes: list[str] = Field(default_factory=list, description="What was skipped or adjusted, and why")
