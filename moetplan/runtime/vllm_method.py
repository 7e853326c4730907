"""The "moetplan" quantization method for vLLM: routed experts in our format, everything else as the checkpoint has it.

Selection: `--quantization moetplan`. For a bf16 checkpoint (no quantization_config) vLLM then builds
`MoetplanConfig()` with no arguments; for a quantized checkpoint (FP8, ...) `override_quantization_method`
claims it when the user asked for moetplan, and `from_config` receives the checkpoint's own config, which we
keep as the *inner* config: dense layers and the expert weight loading go through it unchanged, and only the
routed experts are re-quantized at load. Users point at the official checkpoint; nothing is edited on disk.

Configuration comes from the Plan only (env `MOETPLAN_PLAN`): expert tier, cache sizes, pack dir, FP4 reserve, gate.

FP4 reserve and confidence gate (docs/GATE.md): when the plan sizes a reserve (placement.fp4_reserve_slots, or
placement.fp4_reserve_slots), each worker builds one FP4Reserve over all its MoE layers once the last one has loaded; every
MoE call feeds it the routed ids and computes resident experts from their FP4 rows. Its rows come from the FP4
pack when a valid one exists, else from the checkpoint's experts quantized to FP4 at load (written to an FP4 pack
when the plan has a pack_dir, so the next boot reads it). The gate is installed on the loaded model by the plugin's
model-loader hook (`after_model_loaded`), in the worker process.

Routed-expert computation runs behind an opaque custom op (`torch.ops.moetplan.routed_experts`) so
torch.compile / Dynamo does not trace into the data-dependent bookkeeping (unique ids, cache lookups).
"""
from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from moetplan import vllm_compat
from moetplan.contract.errors import ConfigError, UsageError
from moetplan.runtime import records
from moetplan.vllm_compat import (
    FUSED_MOE_UNQUANTIZED_CONFIG,
    FusedMoEMethodBase,
    QuantizationConfig,
    register_quantization_config,
)

# Under the "vllm" logger tree so lines share vLLM's handler/format (`moetplan run` parses them for progress).
log = logging.getLogger("vllm.moetplan")

PLAN_ENV = "MOETPLAN_PLAN"
METHOD_NAME = "moetplan"
EXPERT_FORMATS = ("2bit", "unquantized")


# --------------------------------------------------------------------------- settings from the plan


@dataclass
class RuntimeSettings:
    """What the method needs from the Plan (read once per process)."""

    plan_path: str | None
    plan: Any  # moetplan.contract.Plan | None
    expert_format: str = "2bit"
    expert_tier: str = "resident"
    cache_slots: int = 0
    arena_rows: int = 0
    pack_dir: str | None = None
    gate: dict[str, Any] = field(default_factory=dict)
    fp4_reserve_slots: int = 0
    mtp: int = 0
    decode_batch_tokens: int = 1
    record_interval_s: float = 2.0

    @classmethod
    def from_env(cls) -> "RuntimeSettings":
        path = os.environ.get(PLAN_ENV)
        if not path:
            raise ConfigError(
                f"The moetplan quantization method needs a plan: {PLAN_ENV} is not set. Start the server with "
                "`moetplan run plan.json` (or export MOETPLAN_PLAN=/path/plan.json before `vllm serve`)"
            )
        from moetplan.contract import Plan, SchemaError, load_json

        try:
            plan = load_json(Plan, path)
        except SchemaError as e:
            raise ConfigError(f"{PLAN_ENV}: {e}") from None
        return cls.from_plan(plan, path)

    @classmethod
    def from_plan(cls, plan: Any, path: str | None = None) -> "RuntimeSettings":
        pl = plan.placement
        fmt = pl.expert_format
        if fmt not in EXPERT_FORMATS:
            raise ConfigError(
                f"{path or 'plan'}: expert_format '{fmt}' is not one the runtime serves; use one of "
                f"{', '.join(EXPERT_FORMATS)}"
            )
        return cls(
            plan_path=str(path) if path else None,
            plan=plan,
            expert_format=fmt,
            expert_tier=pl.expert_tier,
            cache_slots=int(pl.gpu_expert_cache_slots),
            arena_rows=int(pl.host_arena_rows),
            pack_dir=pl.pack_dir,
            gate=pl.gate.model_dump(),
            fp4_reserve_slots=int(pl.fp4_reserve_slots),
            mtp=int(pl.mtp),
            decode_batch_tokens=max(1, int(pl.max_num_seqs) * (1 + int(pl.mtp))),
        )


_SETTINGS: RuntimeSettings | None = None
_SETTINGS_LOCK = threading.Lock()


def settings() -> RuntimeSettings:
    global _SETTINGS
    with _SETTINGS_LOCK:
        if _SETTINGS is None:
            _SETTINGS = RuntimeSettings.from_env()
        return _SETTINGS


def _reset_for_tests(s: RuntimeSettings | None = None) -> None:
    """Tests install settings directly (or clear them) without a server."""
    global _SETTINGS, _STATS, _WRITER
    _SETTINGS = s
    _STATS = None
    _WRITER = None
    _LAYERS.clear()
    _PACK.clear()
    _MODEL_DIR.clear()
    _MOE_COUNTER[0] = 0
    global _TIERED
    _TIERED = None
    _reset_reserve()


# --------------------------------------------------------------------------- per-process stats + run record

_STATS: records.RuntimeStats | None = None
_WRITER: records.RecordWriter | None = None


def stats() -> records.RuntimeStats:
    global _STATS
    if _STATS is None:
        s = _SETTINGS
        _STATS = records.RuntimeStats(decode_batch_tokens=s.decode_batch_tokens if s else 1)
    return _STATS


def _tp_rank() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:
        return 0


def _store_kpis() -> dict[str, Any]:
    out: dict[str, Any] = {}
    tiers = {st.tier for st in _LAYERS.values()}
    out["expert_tier"] = ",".join(sorted(tiers)) if tiers else None
    out["expert_format"] = next((st.fmt for st in _LAYERS.values()), None)
    out["expert_sources"] = sorted({st.source for st in _LAYERS.values()})
    if _TIERED is not None and _TIERED.pack_path:
        out["pack"] = _TIERED.pack_path
    resident = all(st.store is None for st in _LAYERS.values())
    if resident and _LAYERS:
        # Every routed expert is in the device pool: every routing is a hit, no step waits on a fetch.
        out.update(token_hit_rate=1.0, misses_per_step=0.0, zero_miss_step_share=1.0)
        return out
    store = _TIERED.store if _TIERED is not None else None
    if store is not None:
        try:
            out.update(store.stats())  # hit rates, misses per step, bytes moved: already in the Plan's names
        except Exception as e:  # a broken KPI read must not take the worker down
            out["store_kpi_error"] = repr(e)
    return out


def _reserve_kpis() -> dict[str, Any]:
    """Gate and FP4-reserve counters (gate fires, steps, promotions, recomputes, gate_fire_share, reserve stats)."""
    from moetplan.runtime.gate import run_record_kpis

    try:
        out = run_record_kpis(_GATE_STATE.controller, _GATE_STATE.reserve)
    except Exception as e:  # a broken KPI read must not take the worker down
        return {"fp4_kpi_error": repr(e)}
    if _GATE_STATE.note:
        out["fp4_reserve_note"] = _GATE_STATE.note
    if _GATE_STATE.gate_note:
        out["gate_note"] = _GATE_STATE.gate_note
    if _GATE_STATE.source:
        out["fp4_source"] = _GATE_STATE.source
    return out


def _make_record():
    s = _SETTINGS
    return records.build_run_record(
        s.plan if s else None,
        s.plan_path if s else None,
        stats(),
        store_kpis={**_store_kpis(), **_reserve_kpis()},
        extra_runtime={"tp_rank": _tp_rank(), "worker_pid": os.getpid()},
    )


def _record_version() -> tuple[Any, ...]:
    """Changes whenever the record would: MoE calls, and gate steps / reserve promotions (the gate judges a step
    after its MoE calls, and the background promoter works between steps)."""
    st = stats()
    g, r = _GATE_STATE.controller, _GATE_STATE.reserve
    return (st.moe_calls, st.warmup_calls, st.recompute_calls, st.layers, g.c.steps if g is not None else None,
            (r.c.promotions, r.c.gate_promotions, r.c.routings) if r is not None else None)


def writer() -> records.RecordWriter | None:
    global _WRITER
    s = _SETTINGS
    if _WRITER is None and s is not None and s.plan_path:
        path = os.environ.get("MOETPLAN_RUN_RECORD") or str(records.run_record_path(s.plan_path, _tp_rank()))
        _WRITER = records.RecordWriter(path, _make_record, s.record_interval_s, version=_record_version)
        _WRITER.start_flusher()
        atexit.register(_WRITER.close)
    return _WRITER


# --------------------------------------------------------------------------- expert computation


@dataclass
class LayerState:
    """One MoE layer's routed experts after load, as the custom op sees them."""

    key: int
    moe_index: int  # counts MoE layers only (pack row order)
    name: str
    fmt: str
    tier: str
    num_experts: int
    hidden: int
    inter: int  # per TP rank
    swiglu_limit: float | None = None
    w13: torch.Tensor | None = None  # unquantized: [E, 2I, H]
    w2: torch.Tensor | None = None  # unquantized: [E, H, I]
    rows: torch.Tensor | None = None  # 2-bit resident: [E, stride] uint8 device pool
    slot_of: torch.Tensor | None = None  # expert id -> pool slot
    layout: Any = None  # moetplan.runtime.format.RowLayout
    store: Any = None  # TieredExperts, when the tier is not resident
    source: str = ""  # where the rows came from: the checkpoint dtype (quantized at load) or pack:<file>
    first: bool = False  # first MoE layer of the model: marks a step

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                warmup: bool = False) -> torch.Tensor:
        if self.fmt == "unquantized":
            assert self.w13 is not None and self.w2 is not None
            w13, w2 = self.w13, self.w2
            from moetplan.runtime.reference import moe_reference

            return moe_reference(x, topk_ids, topk_weights, lambda e, _fp4: (w13[e], w2[e]), self.swiglu_limit)
        return self._forward_2bit(x, topk_weights, topk_ids, warmup)

    def fp4_args(self, topk_ids: torch.Tensor, warmup: bool = False) -> dict[str, Any]:
        """The FP4 reserve's arguments for this call (read every call: a promotion becomes visible through them).
        Profile / dummy runs are not traffic: they do not heat the reserve."""
        res = _GATE_STATE.reserve
        if res is None or self.moe_index >= res.num_layers:
            return {}
        if not warmup:
            res.observe(self.moe_index, topk_ids)
        return res.op_args(self.moe_index)

    def _forward_2bit(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      warmup: bool = False) -> torch.Tensor:
        from moetplan.runtime.ops import moe_forward

        fp4 = self.fp4_args(topk_ids, warmup)
        if self.store is None:
            return moe_forward(x, topk_ids, topk_weights, self.rows, self.slot_of, self.layout,
                               swiglu_limit=self.swiglu_limit, **fp4)
        return _store_forward(self, x, topk_weights, topk_ids, fp4)


def _store_forward(st: LayerState, x: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, fp4: dict[str, Any] | None = None) -> torch.Tensor:
    """Tiered experts: make this layer's routed experts resident in the slot pool, then compute from it.

    A call that needs more rows than the cache may hold (a long prefill) is computed in chunks: each chunk's
    experts are resident while it is computed, the other pairs count with weight 0 (routed to a resident
    expert so the op reads valid rows).
    """
    from moetplan.runtime.ops import moe_forward
    from moetplan.runtime.store import StoreCapacityError

    store = st.store.get()
    layer = st.moe_index
    if x.shape[0] <= store.prefill_tokens:  # decode: the step's working set fits (the planner's guard)
        try:
            store.ensure(layer, topk_ids)
            return moe_forward(x, topk_ids, topk_weights, store.data, store.residency[layer], st.layout,
                               swiglu_limit=st.swiglu_limit, **(fp4 or {}))
        except StoreCapacityError as e:
            log.warning("moetplan: %s; computing this step in chunks", e)
    out = None
    for mask, _slots in store.ensure_chunks(layer, topk_ids, num_tokens=int(x.shape[0])):
        mask = mask.to(topk_ids.device)
        if not bool(mask.any()):
            continue
        if bool(mask.all()):
            ids, wts = topk_ids, topk_weights
        else:
            ids = torch.where(mask, topk_ids, topk_ids[mask][0])
            wts = torch.where(mask, topk_weights, torch.zeros_like(topk_weights))
        y = moe_forward(x, ids, wts, store.data, store.residency[layer], st.layout, swiglu_limit=st.swiglu_limit,
                        **(fp4 or {}))
        out = y if out is None else out + y
    return out if out is not None else torch.zeros_like(x)


_LAYERS: dict[int, LayerState] = {}
_MOE_COUNTER = [0]


def _is_warmup() -> bool:
    """True inside vLLM's profile/dummy runs (no attention metadata): not user traffic, not counted."""
    try:
        from vllm.forward_context import (
            get_forward_context,
            is_forward_context_available,
        )

        if not is_forward_context_available():
            return True
        return get_forward_context().attn_metadata is None
    except Exception:
        return False


def _run_layer(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, key: int) -> torch.Tensor:
    st = _LAYERS[key]
    t0 = time.perf_counter()
    warmup = _is_warmup()
    ctrl = _GATE_STATE.controller
    out = st.forward(x, topk_weights, topk_ids, warmup)
    stats().on_call(st.first, int(x.shape[0]), int(topk_ids.numel()), warmup, time.perf_counter() - t0,
                    recompute=ctrl is not None and ctrl.recomputing)
    w = writer()
    if w is not None:
        w.maybe_write()
    return out


@torch.library.custom_op("moetplan::routed_experts", mutates_args=())
def routed_experts_op(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, key: int) -> torch.Tensor:
    return _run_layer(x, topk_weights, topk_ids, key)


@routed_experts_op.register_fake
def _routed_experts_fake(x, topk_weights, topk_ids, key):  # type: ignore[no-untyped-def]
    return torch.empty_like(x)


# --------------------------------------------------------------------------- source dequantization


def _expand_block_scale(s: torch.Tensor, rows: int, cols: int, block: list[int] | None) -> torch.Tensor:
    """A [sn, sk] block-scale grid -> [rows, cols]. The block size is the layer's `weight_block_size` when it
    fits the grid, else the grid's own (vLLM may refine a checkpoint's 128x128 grid for small experts)."""
    sn, sk = s.shape
    if block and -(-rows // block[0]) == sn and -(-cols // block[1]) == sk:
        bn, bk = block
    else:
        bn, bk = -(-rows // sn), -(-cols // sk)
    return s.to(torch.float64).repeat_interleave(bn, 0)[:rows].repeat_interleave(bk, 1)[:, :cols]


@dataclass
class ExpertSource:
    """A layer's loaded routed experts, handed out one expert at a time (an FP8 layer dequantized whole in
    float64 would not fit in memory for the big models)."""

    name: str  # "bfloat16", "float32", "fp8", ...
    num_experts: int
    hidden: int
    inter: int
    device: torch.device
    get: Any  # e -> (w13 [2I, H], w2 [H, I]); exact values (float64 for FP8)

    def expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.get(e)


def _fp8_expert(layer: Any, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    from moetplan.runtime.sources import dequantize_fp8

    block = getattr(layer, "weight_block_size", None)
    out = []
    for name, halves in (("w13", 2), ("w2", 1)):
        w = getattr(layer, f"{name}_weight").data[e]
        sp = getattr(layer, f"{name}_weight_scale_inv", None)
        if sp is None:
            sp = getattr(layer, f"{name}_weight_scale")
        E = getattr(layer, f"{name}_weight").data.shape[0]
        # [E, sn, sk] block grid, [E, 2] / [E] per tensor (per half for w13), or one global scale
        s = sp.data[e] if sp.data.dim() >= 1 and sp.data.shape[0] == E and sp.data.numel() > 1 else \
            sp.data.reshape(-1)[:1]
        base = dequantize_fp8(w, torch.ones(1), f"{layer.layer_name}.{name}[{e}]")  # exact e4m3 -> float64
        N, K = w.shape
        if s.dim() == 2:  # block grid; gate and up halves carry their own rows of it
            parts = []
            for h in range(halves):
                rows = N // halves
                sh = s[h * s.shape[0] // halves:(h + 1) * s.shape[0] // halves]
                parts.append(_expand_block_scale(sh, rows, K, block))
            scale = torch.cat(parts, 0)
        elif s.numel() == halves == 2:  # per tensor, one scale per half
            scale = s.to(torch.float64).repeat_interleave(N // halves).reshape(N, 1)
        else:
            scale = s.to(torch.float64).reshape(-1)[:1].reshape(1, 1)
        out.append(base * scale)
    return out[0], out[1]


def source_expert_weights(layer: Any) -> ExpertSource:
    """The layer's loaded routed experts as exact values, per expert, and the source format's name."""
    w13 = layer.w13_weight.data
    E, two_i, H = w13.shape
    if w13.dtype in (torch.bfloat16, torch.float16, torch.float32):
        w2 = layer.w2_weight.data
        return ExpertSource(str(w13.dtype).replace("torch.", ""), E, H, two_i // 2, w13.device,
                            lambda e: (w13[e], w2[e]))
    if w13.dtype in (torch.float8_e4m3fn, torch.uint8) and (
        hasattr(layer, "w13_weight_scale") or hasattr(layer, "w13_weight_scale_inv")
    ):
        return ExpertSource("fp8", E, H, two_i // 2, w13.device, lambda e: _fp8_expert(layer, e))
    raise ConfigError(
        f"{getattr(layer, 'layer_name', 'MoE layer')}: routed experts of dtype {w13.dtype} are not a source the "
        "moetplan method reads (bf16/fp16/fp32/FP8 at load; convert NVFP4/MXFP4 checkpoints with "
        "`moetplan quantize` into packs first)"
    )


# --------------------------------------------------------------------------- vLLM classes
# Module level (not defined inside a function): vLLM pickles the quantization config into its engine processes.


class MoetplanMoEMethod(FusedMoEMethodBase):
    """Routed experts: loaded as the checkpoint stores them, re-quantized / placed per the plan."""

    def __init__(self, moe: Any, source_method: Any = None):
        super().__init__(moe)
        self.source_method = source_method
        self.key: int | None = None
        self.router: Any = None  # set by vllm_compat.link_routers where this method routes itself

    # vLLM's expert weight loader asks the layer's method how the checkpoint stores its experts (block-scale
    # refinement, global scale factors, FP4 scale patterns, and by class name ModelOpt / compressed-tensors):
    # answer as the checkpoint's own method would, so its tensors land exactly as they do without us.
    def __getattr__(self, name: str) -> Any:
        src = self.__dict__.get("source_method")
        if src is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(src, name)

    def uses_weight_scale_2_pattern(self) -> bool:
        return bool(self.source_method is not None and self.source_method.uses_weight_scale_2_pattern())

    @property
    def is_monolithic(self) -> bool:
        # vLLM routes, we compute: apply() gets topk ids and weights; except on a CPU backend without a CPU
        # router, where apply_monolithic routes as vLLM's own CPU MoE does.
        return vllm_compat.cpu_routes_in_method()

    def apply_monolithic(self, layer, x, router_logits, input_ids=None):
        topk_weights, topk_ids = vllm_compat.cpu_select_experts(layer, x, router_logits, self.router)
        return self.apply(layer, x, topk_weights, topk_ids)

    @property
    def supports_eplb(self) -> bool:
        return False

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       **extra_weight_attrs):
        if self.moe.moe_parallel_config.use_ep:
            raise ConfigError(
                "The moetplan method shards experts by tensor parallelism only; drop --enable-expert-parallel"
            )
        if not self.moe.is_act_and_mul:
            raise ConfigError(f"{layer.layer_name}: only gated (SwiGLU) experts are supported by moetplan")
        if self.moe.has_bias:
            raise ConfigError(f"{layer.layer_name}: expert biases are not supported by the moetplan method")
        # MoE layers are numbered in construction order, which is the pack's layer order (MoE layers only).
        self.key = _MOE_COUNTER[0]
        _MOE_COUNTER[0] += 1
        self.dims = (num_experts, hidden_size, intermediate_size_per_partition)
        _model_dir()  # remember the checkpoint while vLLM's config is current
        self.layout = None
        self.fp4_layout = None
        self.pack = None
        s = settings()
        if s.expert_format == "2bit":
            from moetplan.runtime.format import RowLayout

            tp = int(self.moe.moe_parallel_config.tp_size or 1)
            self.layout = RowLayout.for_expert(hidden_size, intermediate_size_per_partition * tp, tp, "2bit")
            pack = _cached_pack(s, self.layout, num_experts)
            if pack is not None and self.key < pack.num_layers:
                self.pack = pack
            if reserve_wanted(s):
                self.fp4_layout = RowLayout.for_expert(hidden_size, intermediate_size_per_partition * tp, tp, "fp4")
                _cached_fp4_pack(s, self.fp4_layout, num_experts)
        if self.source_method is not None:
            self.source_method.create_weights(layer, num_experts, hidden_size,
                                              intermediate_size_per_partition, params_dtype,
                                              **extra_weight_attrs)
        else:
            from moetplan.vllm_compat import set_weight_attrs

            w13 = torch.nn.Parameter(
                torch.empty(num_experts, 2 * intermediate_size_per_partition, hidden_size, dtype=params_dtype),
                requires_grad=False,
            )
            layer.register_parameter("w13_weight", w13)
            set_weight_attrs(w13, extra_weight_attrs)
            w2 = torch.nn.Parameter(
                torch.empty(num_experts, hidden_size, intermediate_size_per_partition, dtype=params_dtype),
                requires_grad=False,
            )
            layer.register_parameter("w2_weight", w2)
            set_weight_attrs(w2, extra_weight_attrs)
        fp4_needs_weights = (self.fp4_layout is not None and not _fp4_pack_covers(self.key)
                             and not _GATE_STATE.built)
        if self.pack is not None and not fp4_needs_weights:
            # A valid pack holds this layer's rows: the checkpoint's experts are never materialised (an NVFP4
            # GLM-5.2 would not fit in VRAM); their tensors stream past a loader that drops them. (Unless the FP4
            # reserve has no pack yet: then its rows are quantized from these weights at load.)
            for name, p in list(layer.named_parameters(recurse=False)):
                if name.startswith(("w13_", "w2_")):
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                    p.weight_loader = _drop_loaded_weight

    def get_fused_moe_quant_config(self, layer):
        return FUSED_MOE_UNQUANTIZED_CONFIG

    def process_weights_after_loading(self, layer) -> None:
        t0 = time.perf_counter()
        s = settings()
        key = self.key
        if key is None:
            raise ConfigError(f"{layer.layer_name}: weights processed before they were created")
        src = None
        if self.pack is not None:
            E, H, inter = self.dims
            device = _layer_device(layer)
            source = f"pack:{self.pack.path.name}"
            if layer.w13_weight.data.numel():  # materialised for the FP4 reserve's rows
                src = source_expert_weights(layer)
        else:
            src = source_expert_weights(layer)
            E, H, inter, device, source = src.num_experts, src.hidden, src.inter, src.device, src.name
        st = LayerState(
            key=key, moe_index=key, name=layer.layer_name, fmt=s.expert_format, tier=s.expert_tier,
            num_experts=E, hidden=H, inter=inter, swiglu_limit=getattr(layer, "swiglu_limit", None),
            first=(key == 0), source=source,
        )
        if s.expert_format == "unquantized":
            assert src is not None
            st.tier = "resident"
            dtype = layer.params_dtype if source == "fp8" else None
            pairs = [src.expert(e) for e in range(E)]
            st.w13 = torch.stack([p[0].to(dtype) if dtype else p[0] for p in pairs])
            st.w2 = torch.stack([p[1].to(dtype) if dtype else p[1] for p in pairs])
        else:
            from moetplan.runtime.format import pack_expert_row

            layout = self.layout
            rows = torch.empty(E, layout.stride, dtype=torch.uint8)
            if self.pack is not None:
                # Packs are the persistent quantization cache: a later boot reads rows, skips the quantizer.
                self.pack.read_rows([self.pack.row_index(key, e) for e in range(E)], rows.numpy())
            else:
                for e in range(E):
                    w13_e, w2_e = src.expert(e)
                    pack_expert_row(w13_e, w2_e, layout, out=rows[e])  # quantized where the weights are
            st.layout = layout
            if self.fp4_layout is not None:
                _collect_fp4_rows(key, src, self.fp4_layout, E)
            if s.expert_tier == "resident":
                st.rows = rows.to(device)
                st.slot_of = torch.arange(E, device=device, dtype=torch.int32)
            else:
                st.store = _attach_store(st, rows, s)
        # The checkpoint-format copies are no longer read: free them (the op reads LayerState only).
        for pname in [n for n, _ in layer.named_parameters(recurse=False) if n.startswith(("w13_", "w2_"))]:
            p = getattr(layer, pname)
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        _LAYERS[key] = st
        if s.expert_format == "unquantized" and reserve_wanted(s) and key == 0:
            log.info("moetplan: the plan's FP4 reserve (and gate) do not apply to unquantized experts: "
                     "every expert is computed at the checkpoint's precision already")
            _GATE_STATE.note = "not applicable: experts unquantized"
        if (s.expert_format == "2bit" and reserve_wanted(s) and not _GATE_STATE.built
                and len(_LAYERS) == _MOE_COUNTER[0]):
            # the last MoE layer of this worker: the reserve spans them all (built once: a speculative drafter's
            # MoE layers, loaded later, are not in it)
            _GATE_STATE.built = True
            _build_reserve(s, device)
        stats().layers = len(_LAYERS)
        stats().load_s += time.perf_counter() - t0
        log.info(
            "moetplan: %s experts=%d source=%s format=%s tier=%s (%.2fs)",
            layer.layer_name, E, source, st.fmt, st.tier, time.perf_counter() - t0,
        )
        w = writer()
        if w is not None:
            w.write()

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
        if self.key is None:
            raise ConfigError(f"{layer.layer_name}: moetplan experts used before weights were processed")
        return torch.ops.moetplan.routed_experts(x, topk_weights, topk_ids, self.key)


_WRAPPED: dict[type, type] = {}


def method_for(moe: Any, source: Any = None) -> MoetplanMoEMethod:
    """Our MoE method; over a quantized checkpoint, a subclass named after the checkpoint's method (vLLM's
    loader branches on that name, e.g. "ModelOpt" for NVFP4 scales)."""
    if source is None:
        return MoetplanMoEMethod(moe)
    cls = _WRAPPED.get(type(source))
    if cls is None:
        cls = type(f"Moetplan{type(source).__name__}", (MoetplanMoEMethod,), {"__module__": __name__})
        _WRAPPED[type(source)] = cls
    return cls(moe, source)


class MoetplanConfig(QuantizationConfig):
    """Routed experts in the moetplan format; other layers as the checkpoint (or its own config) has them."""

    def __init__(self, checkpoint_config: dict[str, Any] | None = None):
        super().__init__()
        settings()  # fail at config time, with the fix in the message, when the plan is missing or bad
        self.checkpoint_config = checkpoint_config
        self.inner = None
        qm = (checkpoint_config or {}).get("quant_method")
        if qm and qm != METHOD_NAME:
            from moetplan.vllm_compat import get_quantization_config

            self.inner = get_quantization_config(qm).from_config(checkpoint_config)
            # One shared dict: vLLM fills the mapping in place on the config it sees (ours).
            self.inner.packed_modules_mapping = self._packed

    # Models fill packed_modules_mapping on the config they see; the inner config needs it too.
    @property
    def packed_modules_mapping(self):  # type: ignore[override]
        return self._packed

    @packed_modules_mapping.setter
    def packed_modules_mapping(self, value):
        self._packed = value
        if getattr(self, "inner", None) is not None:
            self.inner.packed_modules_mapping = value

    def get_name(self) -> str:
        return METHOD_NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 70  # the torch path runs anywhere CUDA does; kernels pick themselves at runtime

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "MoetplanConfig":
        return cls(config)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None):
        # Claim any checkpoint format when the user asked for moetplan: we re-quantize its routed experts.
        return METHOD_NAME if user_quant == METHOD_NAME else None

    def get_quant_method(self, layer, prefix):
        vllm_compat.check_moe_backend()
        from moetplan.vllm_compat import (
            LinearBase,
            RoutedExperts,
            UnquantizedLinearMethod,
        )

        if isinstance(layer, RoutedExperts):
            source = self.inner.get_quant_method(layer, prefix) if self.inner is not None else None
            if source is not None and type(source).__name__ == "UnquantizedFusedMoEMethod":
                source = None
            return method_for(layer.moe_config, source)
        if self.inner is not None:
            return self.inner.get_quant_method(layer, prefix)
        if isinstance(layer, LinearBase):
            return UnquantizedLinearMethod()
        return None

    def get_cache_scale_mapper(self):
        return self.inner.get_cache_scale_mapper() if self.inner is not None else super().get_cache_scale_mapper()

    def apply_vllm_mapper(self, hf_to_vllm_mapper):
        if self.inner is not None:
            self.inner.apply_vllm_mapper(hf_to_vllm_mapper)

    def maybe_update_config(self, model_name, hf_config=None, revision=None):
        if self.inner is not None:
            self.inner.maybe_update_config(model_name, hf_config, revision)


def register_method() -> type:
    """Register the config class under "moetplan" (idempotent: re-registering the same class is a no-op)."""
    from moetplan.vllm_compat import (
        QUANTIZATION_METHODS,
        get_quantization_config,
    )

    if METHOD_NAME not in QUANTIZATION_METHODS or get_quantization_config(METHOD_NAME) is not MoetplanConfig:
        register_quantization_config(METHOD_NAME)(MoetplanConfig)
    return MoetplanConfig


def _drop_loaded_weight(param: Any, loaded_weight: Any, *args: Any, **kwargs: Any) -> bool | None:
    """Weight loader for expert tensors a valid pack already holds: accept and drop them."""
    return True if kwargs.get("return_success") else None


def _layer_device(layer: Any) -> torch.device:
    for p in layer.parameters(recurse=False):
        return p.device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _attach_store(st: LayerState, rows: torch.Tensor, s: RuntimeSettings) -> "TieredExperts":
    """Hand a layer's rows to the process's tiered store (built once every MoE layer has loaded)."""
    global _TIERED
    if _TIERED is None:
        _TIERED = TieredExperts(s)
    _TIERED.add(st.moe_index, rows, st.layout)
    return _TIERED


class TieredExperts:
    """The expert store behind every MoE layer of this worker when experts are not resident.

    vLLM processes layers one at a time, but the store's backing (pinned host copy, or the pack file) covers all
    MoE layers, so rows are collected at load and the store is built at the first forward.
    """

    def __init__(self, s: RuntimeSettings):
        self.s = s
        self.rows: dict[int, torch.Tensor] = {}
        self.layout: Any = None
        self.store: Any = None
        self.pack_path: str | None = None

    def add(self, moe_index: int, rows: torch.Tensor, layout: Any) -> None:
        self.rows[moe_index] = rows
        self.layout = layout

    def get(self) -> Any:
        if self.store is None:
            self.store = self._build()
        return self.store

    def _build(self) -> Any:
        import numpy as np

        from moetplan.runtime.backing import (
            ArrayRowSource,
            PackArenaStore,
            PinnedHostStore,
        )
        from moetplan.runtime.store import ExpertStore

        L = len(self.rows)
        if sorted(self.rows) != list(range(L)):
            raise ConfigError(f"MoE layers {sorted(self.rows)} did not all load; cannot build the expert store")
        E, stride = self.rows[0].shape
        s = self.s
        if s.cache_slots <= 0:
            raise ConfigError(
                f"expert_tier '{s.expert_tier}' needs gpu_expert_cache_slots > 0 in the plan; re-plan "
                "(`moetplan plan`) or pin a cache size (--set gpu_expert_cache_gib=...)"
            )
        data = np.concatenate([self.rows[i].numpy() for i in range(L)])
        if s.expert_tier == "host":
            backing = PinnedHostStore(ArrayRowSource(data, L, E))
        else:
            pack = _write_and_open_pack(data, L, E, self.layout, s)
            self.pack_path = str(pack.path)
            backing = PackArenaStore(pack, max(1, s.arena_rows))
        self.rows.clear()  # the backing holds its own copy
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        _route_store_log()
        # KPI line in the server log every 30 s (hit rate, zero-miss steps, misses per step, transfer rates)
        store = ExpertStore(backing, s.cache_slots, device=device, prefill_tokens=s.decode_batch_tokens,
                            kpi_every_s=30.0)
        log.info("moetplan: store %s tier=%s slots=%d layers=%d experts=%d", type(backing).__name__,
                 s.expert_tier, s.cache_slots, L, E)
        return store


_TIERED: TieredExperts | None = None


def _route_store_log() -> None:
    """The store logs to "moetplan.store"; inside vLLM send it through vLLM's handlers into the server log."""
    lg = logging.getLogger("moetplan.store")
    if not lg.handlers:
        for h in logging.getLogger("vllm").handlers:
            lg.addHandler(h)
        lg.setLevel(logging.INFO)
        lg.propagate = False
_PACK: dict[str, Any] = {}


def _cached_pack(s: RuntimeSettings, layout: Any, num_experts: int) -> Any:
    if "pack" not in _PACK:
        _PACK["pack"] = open_valid_pack(s, layout, num_experts)
        if _PACK["pack"] is not None:
            log.info("moetplan: pack %s valid, reading rows instead of quantizing", _PACK["pack"].path)
    return _PACK["pack"]


_MODEL_DIR: list[str | None] = []


def _model_dir() -> str | None:
    """The checkpoint vLLM is loading (remembered at load: the current vLLM config is unset during forwards)."""
    if not _MODEL_DIR:
        try:
            from vllm.config import get_current_vllm_config

            _MODEL_DIR.append(get_current_vllm_config().model_config.model)
        except Exception:
            return None
    return _MODEL_DIR[0]


def _pack_identity() -> tuple[str, str]:
    """(model key, identity) of the checkpoint being served, for pack file names and staleness checks."""
    from moetplan.runtime.packs import checkpoint_identity, model_key_for

    model = _model_dir() or "model"
    folder = model if os.path.isdir(model) else _hub_snapshot(model)
    if folder:
        return model_key_for(folder if os.path.isdir(model) else model), checkpoint_identity(folder)
    return model_key_for(model), f"hub:{model}"


def _hub_snapshot(repo: str) -> str | None:
    """The local snapshot folder vLLM downloaded a hub checkpoint to (identity = what `moetplan quantize` saw)."""
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo, local_files_only=True, allow_patterns=["*.json", "*.safetensors"])
    except Exception:
        return None


def _pack_dir(s: RuntimeSettings) -> str:
    if not s.pack_dir:
        raise ConfigError("expert_tier 'nvme' needs placement.pack_dir in the plan; plan with --pack-dir DIR")
    return s.pack_dir


def open_valid_pack(s: RuntimeSettings, layout: Any, num_experts: int) -> Any:
    """The finished pack of this checkpoint / TP rank / layout (its format: 2bit or fp4) in the plan's pack_dir,
    or None (reason logged)."""
    if not s.pack_dir or not os.path.isdir(s.pack_dir):
        return None
    from moetplan.runtime.packs import Pack, StalePackError

    key, ident = _pack_identity()
    pack = None
    reasons = []
    # By name first; then any pack of this TP layout whose identity matches (a pack built from the same
    # checkpoint under another folder name).
    for mk in (key, None):
        try:
            pack = Pack.open(s.pack_dir, model_key=mk, tp=layout.tp, tp_rank=_tp_rank(), fmt=layout.fmt,
                             expect_identity=ident, expect_layout=layout)
            break
        except (StalePackError, ConfigError, UsageError) as e:
            reasons.append(str(e))
    if pack is None:
        log.info("moetplan: %s pack not used (%s); quantizing at load", layout.fmt, reasons[0])
        return None
    if pack.num_experts != num_experts:
        log.info("moetplan: pack %s has %d experts per layer, model has %d; quantizing at load",
                 pack.path, pack.num_experts, num_experts)
        return None
    return pack


def _write_and_open_pack(data: Any, L: int, E: int, layout: Any, s: RuntimeSettings) -> Any:
    """Make sure a finished pack of these rows exists (written here when missing or stale) and open it."""
    from moetplan.runtime.packs import Pack, PackWriter, StalePackError

    key, ident = _pack_identity()
    pack_dir = _pack_dir(s)
    try:
        return Pack.open(pack_dir, model_key=key, tp=layout.tp, tp_rank=_tp_rank(), fmt=layout.fmt,
                         expect_identity=ident, expect_layout=layout)
    except StalePackError as e:
        log.info("moetplan: pack (re)build: %s", e)
    with PackWriter(pack_dir, key, _tp_rank(), layout.tp, layout, L, E, ident,
                    source={"written_by": "moetplan runtime at load"}) as w:
        for layer in range(L):
            for e in range(E):
                w.write_row(layer, e, data[layer * E + e])
        w.commit()
    log.info("moetplan: pack written %s (%d layers x %d experts)", w.path, L, E)
    return Pack.open(pack_dir, model_key=key, tp=layout.tp, tp_rank=_tp_rank(), fmt=layout.fmt,
                     expect_identity=ident, expect_layout=layout)


# --------------------------------------------------------------------------- FP4 reserve and confidence gate


@dataclass
class GateState:
    """This worker's FP4 reserve and gate controller (one per process: one TP rank)."""

    reserve: Any = None  # moetplan.runtime.reserve.FP4Reserve
    controller: Any = None  # moetplan.runtime.gate.GateController, once installed on the model
    fp4_rows: dict[int, torch.Tensor] = field(default_factory=dict)  # MoE layer -> [E, fp4 stride], until built
    fp4_pack: Any = None
    fp4_pack_checked: bool = False
    built: bool = False  # the reserve was built (or found impossible) once all MoE layers had loaded
    source: str = ""
    note: str = ""  # why the reserve is absent although the plan asked for one
    gate_note: str = ""  # why the gate is not installed although the plan enabled it


_GATE_STATE = GateState()


def _reset_reserve() -> None:
    global _GATE_STATE
    if _GATE_STATE.reserve is not None:
        _GATE_STATE.reserve.close()
    _GATE_STATE = GateState()


PROMOTER_ENV = "MOETPLAN_FP4_PROMOTER"
PROMOTER_MODES = ("background", "gate")


def promoter_mode() -> str:
    """Who fills the reserve: "background" (default: the hottest experts, promoted off the critical path) or
    "gate" (only the gate's synchronous promotions). A debugging switch, not a plan knob: with "gate" a run's
    tokens do not depend on the background thread's timing, which makes runs comparable token for token."""
    mode = os.environ.get(PROMOTER_ENV, "background").strip().lower() or "background"
    if mode not in PROMOTER_MODES:
        raise ConfigError(f"{PROMOTER_ENV}={mode!r} is not one of {', '.join(PROMOTER_MODES)}; unset it for the "
                          "default (background)")
    return mode


def reserve_wanted(s: RuntimeSettings) -> bool:
    return s.fp4_reserve_slots > 0


def reserve_slots(s: RuntimeSettings, fp4_layout: Any, num_layers: int, num_experts: int) -> int:
    """Rows the reserve holds: the plan's slots, never more rows than there are experts."""
    from moetplan.contract.sizing import reserve_slots as cap

    return cap(s.fp4_reserve_slots, num_layers, num_experts)


def _cached_fp4_pack(s: RuntimeSettings, layout: Any, num_experts: int) -> Any:
    g = _GATE_STATE
    if not g.fp4_pack_checked:
        g.fp4_pack_checked = True
        g.fp4_pack = open_valid_pack(s, layout, num_experts)
        if g.fp4_pack is not None:
            log.info("moetplan: FP4 pack %s valid, the reserve reads its rows", g.fp4_pack.path)
    return g.fp4_pack


def _fp4_pack_covers(moe_index: int) -> bool:
    p = _GATE_STATE.fp4_pack
    return p is not None and moe_index < p.num_layers


def _collect_fp4_rows(key: int, src: ExpertSource | None, fp4_layout: Any, num_experts: int) -> None:
    """Quantize this layer's experts to FP4 reserve rows while the checkpoint's weights are still loaded (they are
    freed right after); skipped when the FP4 pack already holds them."""
    if _fp4_pack_covers(key) or _GATE_STATE.built:
        return
    if src is None:
        return  # no weights and no pack: _build_reserve says so
    from moetplan.runtime.format import pack_expert_row

    rows = torch.empty(num_experts, fp4_layout.stride, dtype=torch.uint8)
    for e in range(num_experts):
        w13_e, w2_e = src.expert(e)
        pack_expert_row(w13_e, w2_e, fp4_layout, out=rows[e])
    _GATE_STATE.fp4_rows[key] = rows


def _build_reserve(s: RuntimeSettings, device: Any) -> Any:
    """The worker's FP4 reserve over all its MoE layers (None, with the reason logged, when it cannot be built)."""
    from moetplan.runtime.reserve import FP4Reserve

    g = _GATE_STATE
    L = len(_LAYERS)
    E = _LAYERS[0].num_experts
    first = _LAYERS[0]
    tp = first.layout.tp
    from moetplan.runtime.format import RowLayout

    fp4_layout = RowLayout.for_expert(first.hidden, first.inter * tp, tp, "fp4")
    if g.fp4_pack is not None and g.fp4_pack.num_layers >= L and g.fp4_pack.num_experts == E:
        source, g.source = g.fp4_pack, f"pack:{g.fp4_pack.path.name}"
    elif sorted(g.fp4_rows) == list(range(L)):
        import numpy as np

        from moetplan.runtime.backing import ArrayRowSource

        data = np.concatenate([g.fp4_rows[i].numpy() for i in range(L)])
        g.fp4_rows.clear()
        if s.pack_dir:
            # The FP4 rows persist like the 2-bit ones: the next boot reads the pack instead of quantizing.
            try:
                source = _write_and_open_pack(data, L, E, fp4_layout, s)
                g.source = f"pack:{source.path.name}"
            except Exception as e:  # a read-only pack dir must not stop the server: serve from RAM
                log.warning("moetplan: FP4 pack not written (%s); reserve rows held in host RAM", e)
                source, g.source = ArrayRowSource(data, L, E), "quantized at load (host RAM)"
        else:
            source, g.source = ArrayRowSource(data, L, E), "quantized at load (host RAM)"
    else:
        g.note = ("no FP4 source: the 2-bit pack was read and the FP4 pack is missing or stale; run "
                  "`moetplan quantize` with the FP4 reserve, or remove the 2-bit pack so this boot re-quantizes")
        log.warning("moetplan: FP4 reserve not built: %s", g.note)
        return None
    slots = reserve_slots(s, fp4_layout, L, E)
    if slots <= 0:
        g.note = f"fp4_reserve_slots {s.fp4_reserve_slots} holds no FP4 row"
        log.warning("moetplan: FP4 reserve not built: %s", g.note)
        return None
    background = promoter_mode() == "background"
    g.reserve = FP4Reserve(source, slots, layout=fp4_layout, device=device, background=background,
                           name=f"fp4_reserve.rank{_tp_rank()}")
    log.info("moetplan: FP4 reserve %d slots x %d B over %d layers x %d experts, rows from %s, promoter %s", slots,
             fp4_layout.stride, L, E, g.source, promoter_mode())
    return g.reserve


def after_model_loaded(model: Any, vllm_config: Any = None) -> Any:
    """Called by the plugin's model-loader hook in the worker once the model is loaded: installs the plan's
    confidence gate on it (when this process serves moetplan experts and the plan enables the gate)."""
    s = _SETTINGS
    if s is None or not _LAYERS or _GATE_STATE.controller is not None:
        return model
    if vllm_compat.cpu_routes_in_method():
        vllm_compat.link_routers(model, MoetplanMoEMethod)
    if not s.gate.get("enabled"):
        return model
    g = _GATE_STATE
    if g.reserve is None:
        g.gate_note = ("not installed: no FP4 reserve to promote into" +
                       (f" ({g.note})" if g.note else "; plan an fp4_reserve_gib > 0"))
        log.warning("moetplan: confidence gate %s", g.gate_note)
        return model
    if s.mtp > 0:
        log.info("moetplan: confidence gate off: speculative decoding (MTP %d) verify steps are not judged "
                 "(docs/GATE.md); steps are counted as skipped", s.mtp)
    if torch.cuda.is_available() and not _eager(vllm_config):
        g.gate_note = "not installed: CUDA graphs are on; start vLLM with --enforce-eager"
        log.warning("moetplan: confidence gate needs eager execution on CUDA (the recompute re-runs Python the "
                    "graphs would skip); %s", g.gate_note)
        return model
    from moetplan.runtime.gate import GateController, wrap_vllm_model

    controller = GateController.from_plan(s.plan, g.reserve)
    wrap_vllm_model(model, controller)
    g.controller = controller
    log.info("moetplan: confidence gate installed: tau=%.3g max_promotions_per_step=%s", controller.tau,
             controller.max_promotions_per_step)
    return model


def _eager(vllm_config: Any) -> bool:
    try:
        return bool(vllm_config.model_config.enforce_eager)
    except AttributeError:
        return False
