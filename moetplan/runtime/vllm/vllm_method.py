"""The MoE method vLLM gives each routed-experts layer: experts loaded as the checkpoint stores them, then
re-quantized / placed per the plan's runtime section, computed by the custom op (moe_op).

Each method holds the process's `WorkerRuntime` (from the quantization config); its layer state goes to the
worker, which the custom op reaches by id. Module level: vLLM pickles the config into its engine processes.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import torch

from moetplan import vllm_compat
from moetplan.contract.errors import ConfigError
from moetplan.contract.layout import RowLayout
from moetplan.runtime.vllm import moe_op  # noqa: F401 (registers torch.ops.moetplan.routed_experts)
from moetplan.runtime.vllm.expert_source import ExpertSource, source_expert_weights
from moetplan.runtime.vllm.worker import WorkerRuntime
from moetplan.vllm_compat import FUSED_MOE_UNQUANTIZED_CONFIG, FusedMoEMethodBase

log = logging.getLogger("vllm.moetplan")


def _drop_loaded_weight(param: Any, loaded_weight: Any, *args: Any, **kwargs: Any) -> bool | None:
    """Weight loader for expert tensors a valid pack already holds: accept and drop them."""
    return True if kwargs.get("return_success") else None


def _layer_device(layer: Any) -> torch.device:
    for p in layer.parameters(recurse=False):
        return p.device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _free_checkpoint_experts(layer: Any, loader: Any = None) -> None:
    for name, p in list(layer.named_parameters(recurse=False)):
        if name.startswith(("w13_", "w2_")):
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            if loader is not None:
                p.weight_loader = loader


class MoetplanMoEMethod(FusedMoEMethodBase):
    """Routed experts: loaded as the checkpoint stores them, re-quantized / placed per the plan."""

    def __init__(self, moe: Any, source_method: Any = None, worker: WorkerRuntime | None = None):
        super().__init__(moe)
        self.source_method = source_method
        self.worker = worker if worker is not None else WorkerRuntime.for_process()
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
        w, s = self.worker, self.worker.section
        self.key = w.new_moe_index()
        self.worker_id = moe_op.op_id(w)  # an int for the op: apply() stays free of Python objects for Dynamo
        self.dims = (num_experts, hidden_size, intermediate_size_per_partition)
        w.packs.remember_model_dir()  # while vLLM's config is current
        self.layout = self.fp4_layout = self.pack = None
        if s.expert_format == "2bit":
            tp = int(self.moe.moe_parallel_config.tp_size or 1)
            self.layout = RowLayout.for_expert(hidden_size, intermediate_size_per_partition * tp, tp, "2bit")
            if s.expert_row_bytes and self.layout.stride != s.expert_row_bytes:
                raise ConfigError(f"{layer.layer_name}: its 2-bit rows are {self.layout.stride} bytes at tp={tp}, "
                                  f"the plan sized {s.expert_row_bytes}-byte rows (another model or TP degree): "
                                  "re-plan")
            pack = w.packs.valid_pack(self.layout, num_experts) if s.knobs.weights != "dummy" else None
            if pack is not None and self.key < pack.num_layers:
                self.pack = pack
            if s.reserve_wanted:
                self.fp4_layout = RowLayout.for_expert(hidden_size, intermediate_size_per_partition * tp, tp, "fp4")
                w.fp4.check_fp4_pack(w.packs, self.fp4_layout, num_experts)
        if s.knobs.weights == "dummy":
            # No checkpoint: the expert tensors stay empty (vLLM's dummy loader fills nothing of them) and the
            # rows are generated in their tier after load.
            self._create_empty_experts(layer, params_dtype, extra_weight_attrs)
        elif self.source_method is not None:
            self.source_method.create_weights(layer, num_experts, hidden_size,
                                              intermediate_size_per_partition, params_dtype,
                                              **extra_weight_attrs)
        else:
            from moetplan.vllm_compat import set_weight_attrs

            for name, shape in (("w13_weight", (num_experts, 2 * intermediate_size_per_partition, hidden_size)),
                                ("w2_weight", (num_experts, hidden_size, intermediate_size_per_partition))):
                p = torch.nn.Parameter(torch.empty(*shape, dtype=params_dtype), requires_grad=False)
                layer.register_parameter(name, p)
                set_weight_attrs(p, extra_weight_attrs)
        if self.pack is not None and not (self.fp4_layout is not None and w.fp4.needs_weights(self.key)):
            # A valid pack holds this layer's rows: the checkpoint's experts are never materialised (an NVFP4
            # GLM-5.2 would not fit in VRAM); their tensors stream past a loader that drops them. (Unless the FP4
            # reserve has no pack yet: then its rows are quantized from these weights at load.)
            _free_checkpoint_experts(layer, _drop_loaded_weight)

    @staticmethod
    def _create_empty_experts(layer: Any, params_dtype: Any, attrs: dict) -> None:
        from moetplan.vllm_compat import set_weight_attrs

        for name in ("w13_weight", "w2_weight"):
            p = torch.nn.Parameter(torch.empty(0, dtype=params_dtype), requires_grad=False)
            layer.register_parameter(name, p)
            set_weight_attrs(p, {**attrs, "weight_loader": _drop_loaded_weight})

    def get_fused_moe_quant_config(self, layer):
        return FUSED_MOE_UNQUANTIZED_CONFIG

    def process_weights_after_loading(self, layer) -> None:
        t0 = time.perf_counter()
        w, s, key = self.worker, self.worker.section, self.key
        if key is None:
            raise ConfigError(f"{layer.layer_name}: weights processed before they were created")
        src: ExpertSource | None = None
        if s.knobs.weights == "dummy":
            E, H, inter = self.dims
            device, source = _layer_device(layer), "dummy"
        elif self.pack is not None:
            E, H, inter = self.dims
            device = _layer_device(layer)
            source = f"pack:{self.pack.path.name}"
            if layer.w13_weight.data.numel():  # materialised for the FP4 reserve's rows
                src = source_expert_weights(layer)
        else:
            src = source_expert_weights(layer)
            E, H, inter, device, source = src.num_experts, src.hidden, src.inter, src.device, src.name
        st = w.layer_state(key=key, moe_index=key, name=layer.layer_name, fmt=s.expert_format, tier=s.expert_tier,
                           num_experts=E, hidden=H, inter=inter, swiglu_limit=getattr(layer, "swiglu_limit", None),
                           first=(key == 0), source=source)
        if s.expert_format == "unquantized":
            assert src is not None
            st.tier = "resident"
            dtype = layer.params_dtype if source == "fp8" else None
            pairs = [src.expert(e) for e in range(E)]
            st.w13 = torch.stack([p[0].to(dtype) if dtype else p[0] for p in pairs])
            st.w2 = torch.stack([p[1].to(dtype) if dtype else p[1] for p in pairs])
        else:
            from moetplan.runtime.format.format import pack_expert_row

            layout = self.layout
            rows: torch.Tensor | None = torch.empty(E, layout.stride, dtype=torch.uint8)
            if source == "dummy":
                # Generated where they live: on the device for resident experts, by the store's backing otherwise.
                from moetplan.runtime.vllm.dummy_experts import device_rows

                rows = device_rows(layout, E, device, key, s.knobs.seed) if s.expert_tier == "resident" else None
            elif self.pack is not None:
                # Packs are the persistent quantization cache: a later boot reads rows, skips the quantizer.
                self.pack.read_rows([self.pack.row_index(key, e) for e in range(E)], rows.numpy())
            else:
                for e in range(E):
                    w13_e, w2_e = src.expert(e)
                    pack_expert_row(w13_e, w2_e, layout, out=rows[e])  # quantized where the weights are
            st.layout = layout
            if self.fp4_layout is not None:
                w.fp4.collect_rows(key, src, self.fp4_layout, E)
            if s.expert_tier == "resident":
                assert rows is not None
                st.rows = rows.to(device)
                st.slot_of = torch.arange(E, device=device, dtype=torch.int32)
            else:
                st.store = w.attach_store(st, rows)
        _free_checkpoint_experts(layer)  # the op reads the layer state only
        w.layer_loaded(st, device, time.perf_counter() - t0)
        log.info(
            "moetplan: %s experts=%d source=%s format=%s tier=%s (%.2fs)",
            layer.layer_name, E, source, st.fmt, st.tier, time.perf_counter() - t0,
        )
        writer = w.writer()
        if writer is not None:
            writer.write()

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
        if self.key is None:
            raise ConfigError(f"{layer.layer_name}: moetplan experts used before weights were processed")
        if not self.worker.in_graphs:
            # This plan's MoE layers do host work every step (a split plan): where vLLM captures breakable CUDA
            # graphs (DeepSeek-V3.2/V4, GLM-5: no torch.compile, so no splitting ops) the layer is an eager
            # segment between two graph segments instead of being recorded once.
            return vllm_compat.graph_break(self._routed, x, topk_weights, topk_ids)
        return self._routed(x, topk_weights, topk_ids)

    def _routed(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        topk_ids = self.worker.route(self.key, topk_ids)
        return torch.ops.moetplan.routed_experts(x, topk_weights, topk_ids, self.worker_id, self.key)


_WRAPPED: dict[type, type] = {}


def method_for(moe: Any, source: Any = None, worker: WorkerRuntime | None = None) -> MoetplanMoEMethod:
    """Our MoE method; over a quantized checkpoint, a subclass named after the checkpoint's method (vLLM's
    loader branches on that name, e.g. "ModelOpt" for NVFP4 scales)."""
    if source is None:
        return MoetplanMoEMethod(moe, worker=worker)
    cls = _WRAPPED.get(type(source))
    if cls is None:
        cls = type(f"Moetplan{type(source).__name__}", (MoetplanMoEMethod,), {"__module__": __name__})
        _WRAPPED[type(source)] = cls
    return cls(moe, source, worker)


def after_model_loaded(model: Any, vllm_config: Any = None) -> Any:
    """The plugin's model-loader hook: a moetplan model gets its routers linked (where the method routes itself)
    and its worker's confidence gate; any other model is returned untouched."""
    worker = worker_of(model)
    if worker is None:
        return model
    if vllm_compat.cpu_routes_in_method():
        vllm_compat.link_routers(model, MoetplanMoEMethod)
    if worker.section.knobs.weights == "dummy":
        ran = vllm_compat.finish_dummy_load(model)
        if ran:
            log.info("moetplan: dummy weights: ran %s", ", ".join(ran))
    return worker.after_model_loaded(model, vllm_config)


def worker_of(model: Any) -> WorkerRuntime | None:
    """The worker whose MoE methods serve this loaded vLLM model (None: not a moetplan model)."""
    for m in model.modules():
        qm = getattr(m, "quant_method", None)
        if isinstance(qm, MoetplanMoEMethod):
            return qm.worker
    return None


__all__ = ["MoetplanMoEMethod", "after_model_loaded", "method_for", "worker_of"]
