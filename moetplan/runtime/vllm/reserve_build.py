"""A worker's FP4 reserve and confidence gate (docs/GATE.md): where the reserve's rows come from, building it once
every MoE layer has loaded, and installing the gate on the loaded model."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from moetplan.contract.layout import RowLayout
from moetplan.contract.runtime import RuntimeSection
from moetplan.contract.sizing import reserve_slots
from moetplan.runtime.vllm.expert_source import ExpertSource
from moetplan.runtime.vllm.pack_resolve import PackResolver

log = logging.getLogger("vllm.moetplan")


@dataclass
class ReserveState:
    """The worker's FP4 reserve and gate controller, and what building them found."""

    reserve: Any = None  # moetplan.runtime.reserve.reserve.FP4Reserve
    controller: Any = None  # moetplan.runtime.reserve.gate.GateController, once installed on the model
    fp4_rows: dict[int, torch.Tensor] = field(default_factory=dict)  # MoE layer -> [E, fp4 stride], until built
    fp4_pack: Any = None
    fp4_pack_checked: bool = False
    built: bool = False  # the reserve was built (or found impossible) once all MoE layers had loaded
    source: str = ""
    note: str = ""  # why the reserve is absent although the plan asked for one
    gate_note: str = ""  # why the gate is not installed although the plan enabled it

    def check_fp4_pack(self, packs: PackResolver, layout: RowLayout, num_experts: int) -> Any:
        if not self.fp4_pack_checked:
            self.fp4_pack_checked = True
            self.fp4_pack = packs.valid_pack(layout, num_experts)
        return self.fp4_pack

    def pack_covers(self, moe_index: int) -> bool:
        p = self.fp4_pack
        return p is not None and moe_index < p.num_layers

    def needs_weights(self, moe_index: int) -> bool:
        """This layer's checkpoint weights are needed for FP4 rows (no FP4 pack holds them yet)."""
        return not self.pack_covers(moe_index) and not self.built

    def collect_rows(self, moe_index: int, src: ExpertSource | None, layout: RowLayout, num_experts: int) -> None:
        """Quantize this layer's experts to FP4 reserve rows while the checkpoint's weights are still loaded (they
        are freed right after); skipped when the FP4 pack already holds them."""
        if not self.needs_weights(moe_index) or src is None:
            return  # no weights and no pack: build() says so
        from moetplan.runtime.format.format import pack_expert_row

        rows = torch.empty(num_experts, layout.stride, dtype=torch.uint8)
        for e in range(num_experts):
            w13_e, w2_e = src.expert(e)
            pack_expert_row(w13_e, w2_e, layout, out=rows[e])
        self.fp4_rows[moe_index] = rows

    def build(self, section: RuntimeSection, packs: PackResolver, first_layer: Any, num_layers: int, device: Any,
              name: str) -> Any:
        """The reserve over all `num_layers` MoE layers (None, with the reason logged, when it cannot be built)."""
        from moetplan.runtime.store.backing import ArrayRowSource
        from moetplan.runtime.reserve.reserve import FP4Reserve

        self.built = True
        L, E = num_layers, first_layer.num_experts
        tp = first_layer.layout.tp
        fp4_layout = RowLayout.for_expert(first_layer.hidden, first_layer.inter * tp, tp, "fp4")
        if self.fp4_pack is not None and self.fp4_pack.num_layers >= L and self.fp4_pack.num_experts == E:
            source, self.source = self.fp4_pack, f"pack:{self.fp4_pack.path.name}"
        elif sorted(self.fp4_rows) == list(range(L)):
            data = np.concatenate([self.fp4_rows[i].numpy() for i in range(L)])
            self.fp4_rows.clear()
            source, self.source = ArrayRowSource(data, L, E), "quantized at load (host RAM)"
            if section.pack_dir:
                # The FP4 rows persist like the 2-bit ones: the next boot reads the pack instead of quantizing.
                try:
                    source = packs.write_and_open(data, L, E, fp4_layout)
                    self.source = f"pack:{source.path.name}"
                except Exception as e:  # a read-only pack dir must not stop the server: serve from RAM
                    log.warning("moetplan: FP4 pack not written (%s); reserve rows held in host RAM", e)
        else:
            self.note = ("no FP4 source: the 2-bit pack was read and the FP4 pack is missing or stale; run "
                         "`moetplan quantize` with the FP4 reserve, or remove the 2-bit pack so this boot re-quantizes")
            log.warning("moetplan: FP4 reserve not built: %s", self.note)
            return None
        slots = reserve_slots(section.fp4_reserve_slots, L, E)
        if slots <= 0:
            self.note = f"fp4_reserve_slots {section.fp4_reserve_slots} holds no FP4 row"
            log.warning("moetplan: FP4 reserve not built: %s", self.note)
            return None
        self.reserve = FP4Reserve(source, slots, layout=fp4_layout, device=device,
                                  background=section.knobs.promoter == "background", name=name)
        log.info("moetplan: FP4 reserve %d slots x %d B over %d layers x %d experts, rows from %s, promoter %s",
                 slots, fp4_layout.stride, L, E, self.source, section.knobs.promoter)
        return self.reserve

    def install_gate(self, section: RuntimeSection, model: Any, vllm_config: Any = None) -> Any:
        """Wrap the loaded model with the plan's confidence gate (once; not without a reserve or under CUDA
        graphs, which would replay the first pass and skip the recompute)."""
        if self.controller is not None or not section.gate.enabled:
            return model
        if self.reserve is None:
            self.gate_note = ("not installed: no FP4 reserve to promote into" +
                              (f" ({self.note})" if self.note else "; plan an fp4_reserve_gib > 0"))
            log.warning("moetplan: confidence gate %s", self.gate_note)
            return model
        if section.mtp > 0:
            log.info("moetplan: confidence gate off: speculative decoding (MTP %d) verify steps are not judged "
                     "(docs/GATE.md); steps are counted as skipped", section.mtp)
        if torch.cuda.is_available() and not _eager(vllm_config):
            self.gate_note = "not installed: CUDA graphs are on; start vLLM with --enforce-eager"
            log.warning("moetplan: confidence gate needs eager execution on CUDA (the recompute re-runs Python the "
                        "graphs would skip); %s", self.gate_note)
            return model
        from moetplan.runtime.reserve.gate import GateController, wrap_vllm_model

        controller = GateController.from_section(section, self.reserve)
        wrap_vllm_model(model, controller)
        self.controller = controller
        log.info("moetplan: confidence gate installed: tau=%.3g max_promotions_per_step=%s", controller.tau,
                 controller.max_promotions_per_step)
        return model

    def kpis(self) -> dict[str, Any]:
        """Gate and FP4-reserve counters for the run record."""
        from moetplan.runtime.reserve.gate import run_record_kpis

        try:
            out = run_record_kpis(self.controller, self.reserve)
        except Exception as e:  # a broken KPI read must not take the worker down
            return {"fp4_kpi_error": repr(e)}
        if self.note:
            out["fp4_reserve_note"] = self.note
        if self.gate_note:
            out["gate_note"] = self.gate_note
        if self.source:
            out["fp4_source"] = self.source
        return out

    def version(self) -> tuple[Any, ...]:
        g, r = self.controller, self.reserve
        return (g.c.steps if g is not None else None,
                (r.c.promotions, r.c.gate_promotions, r.c.routings) if r is not None else None)

    def close(self) -> None:
        if self.reserve is not None:
            self.reserve.close()


def _eager(vllm_config: Any) -> bool:
    try:
        return bool(vllm_config.model_config.enforce_eager)
    except AttributeError:
        return False


__all__ = ["ReserveState"]
