"""One MoE layer's routed experts after load, as the custom op computes them: unquantized through the reference,
2-bit resident from the layer's own slot pool, or tiered through the worker's expert store."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from moetplan.contract.layout import RowLayout
from moetplan.contract.runtime import KernelPolicy
from moetplan.runtime.vllm.graph_counters import capturing
from moetplan.runtime.op.ops import PathLog, moe_forward
from moetplan.runtime.op.reference import moe_reference

log = logging.getLogger("vllm.moetplan")


@dataclass
class LayerState:
    """What one MoE layer computes from; `fp4` is the worker's reserve holder (its reserve is built once every
    layer has loaded, so a layer reads it per call)."""

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
    layout: RowLayout | None = None
    store: Any = None  # tiers.TieredExperts, when the tier is not resident
    source: str = ""  # where the rows came from: the checkpoint dtype (quantized at load) or pack:<file>
    first: bool = False  # first MoE layer of the model: marks a step
    fp4: Any = None  # reserve_build.ReserveState of the worker
    policy: KernelPolicy = field(default_factory=KernelPolicy)
    paths: PathLog | None = None
    # Inside graphs (section.records_steps): (device) -> the worker's StepMisses, the step's device record of
    # routings and misses that the replay driver reads once at step end; None: per-layer host bookkeeping.
    record: Any = None
    # Tier host, split path: the plan's cpu_miss_ratio (0 = fetch every miss); see _cpu_miss_forward
    cpu_miss_ratio: float = 0.0

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                warmup: bool = False, paths: Any = None) -> torch.Tensor:
        """The layer's routed sum. `paths` hears the kernel paths of this call instead of the layer's PathLog.

        A resident 2-bit layer without an FP4 reserve is capture-safe: no host sync and no Python state changed
        (its work is kernel launches sized by shapes alone); the other kinds do host work per call."""
        paths = self.paths if paths is None else paths
        if self.fmt == "unquantized":
            assert self.w13 is not None and self.w2 is not None
            w13, w2 = self.w13, self.w2
            if paths is not None:
                paths.ran("reference:unquantized")
            return moe_reference(x, topk_ids, topk_weights, lambda e, _fp4: (w13[e], w2[e]), self.swiglu_limit)
        fp4 = self.fp4_args(topk_ids, warmup)
        if self.store is None:
            if self.record is not None and fp4:  # the FP4 reserve heats from the step's record
                rec = self.record(x.device)
                if not rec.eager:
                    rec.record(self.moe_index, self.slot_of, topk_ids)
            return self._op(x, topk_ids, topk_weights, self.rows, self.slot_of, fp4, paths)
        return self._store_forward(x, topk_weights, topk_ids, fp4)

    def fp4_args(self, topk_ids: torch.Tensor, warmup: bool = False) -> dict[str, Any]:
        """The FP4 reserve's arguments for this call (read every call: a promotion becomes visible through them).
        Profile / dummy runs are not traffic: they do not heat the reserve."""
        res = self.fp4.reserve if self.fp4 is not None else None
        if res is None or self.moe_index >= res.num_layers:
            return {}
        if not warmup and self.record is None:  # recorded steps heat it at step end, from the device record
            res.observe(self.moe_index, topk_ids)
        return res.op_args(self.moe_index)

    def _op(self, x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, pool: torch.Tensor, slot_of: torch.Tensor,
            fp4: dict[str, Any], paths: Any = None) -> torch.Tensor:
        return moe_forward(x, ids, wts, pool, slot_of, self.layout, swiglu_limit=self.swiglu_limit, policy=self.policy,
                           paths=self.paths if paths is None else paths, **fp4)

    def _replay_forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        fp4: dict[str, Any], store: Any, misses: Any) -> torch.Tensor:
        """Inside a graph (replay mode): compute from the cache as it stands and record, on the device, what the
        call routed to and what had no slot; the driver fetches and re-runs a step that missed. Capture-safe on
        the kernels (a pair without a row contributes zeros and sets the flag, read with the counters); the torch
        reference (CPU) gets the same zeros by weight 0 on a resident expert."""
        layer = self.moe_index
        slot_of = store.residency[layer]
        misses.record(layer, slot_of, topk_ids)
        if x.is_cuda or capturing():
            return self._op(x, topk_ids, topk_weights, store.data, slot_of, fp4)
        miss = slot_of.index_select(0, topk_ids.reshape(-1).long()).view(topk_ids.shape) < 0
        if bool(miss.any()):  # CPU: no graph, a host read is free of a sync
            if bool(miss.all()):
                return torch.zeros_like(x)
            topk_ids = torch.where(miss, topk_ids[~miss][0], topk_ids)
            topk_weights = torch.where(miss, torch.zeros_like(topk_weights), topk_weights)
        return self._op(x, topk_ids, topk_weights, store.data, slot_of, fp4)

    def _cpu_miss_forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                          store: Any) -> torch.Tensor | None:
        """Misses served where cheapest (issue 39; tier host, split path): this layer's missing experts are split
        between the CPU, which computes them from the pinned host rows with the CPU kernels, and the link, which
        fetches the rest into the cache, at the plan's cpu_miss_ratio (cost_model.cpu_compute.split_misses, the
        split the cost model priced). Both at once: the link's copies are queued before the CPU computes. The
        misses with the fewest routings go to the CPU (its time grows with each token, the link's does not).
        None when the CPU takes none of them (the caller fetches as before)."""
        from moetplan.cost_model.cpu_compute import split_misses
        from moetplan.runtime.store.store import StoreCapacityError

        layer_rows = getattr(store.backing, "layer_rows", None)
        if layer_rows is None:  # only the pinned host store holds every row where the CPU reads it
            return None
        layer = self.moe_index
        ids_h = topk_ids.detach().to("cpu", torch.int64)
        uniq, counts = np.unique(ids_h.numpy(), return_counts=True)
        absent = store.pool.res[layer][uniq] < 0
        missing = uniq[absent]
        n_cpu = split_misses(int(missing.size), 1, self.cpu_miss_ratio, 1.0).cpu if missing.size else 0
        if n_cpu == 0:
            return None
        cpu_set = missing[np.argsort(counts[absent], kind="stable")[:n_cpu]]
        on_cpu = torch.from_numpy(np.isin(ids_h.numpy(), cpu_set))
        ids_d = wts_d = None
        if not bool(on_cpu.all()):
            keep = ids_h[~on_cpu][0]  # a pair the device computes: the CPU's pairs ride on it with weight 0
            ids_d = torch.where(on_cpu, keep, ids_h).to(topk_ids.device, topk_ids.dtype)
            mask = on_cpu.to(topk_weights.device)
            wts_d = torch.where(mask, torch.zeros_like(topk_weights), topk_weights)
            try:
                # the link's share, queued; only the device's own pairs count (not the riders)
                store.ensure(layer, ids_h[~on_cpu], num_tokens=int(ids_h.shape[0]))
            except StoreCapacityError:
                return None
        t_idx, j_idx = on_cpu.nonzero(as_tuple=True)
        rows, slot_of = layer_rows(layer)
        assert self.layout is not None
        y_pairs = moe_forward(x.detach().to("cpu", torch.float32)[t_idx], ids_h[t_idx, j_idx].view(-1, 1),
                              topk_weights.detach().to("cpu", torch.float32)[t_idx, j_idx].view(-1, 1), rows,
                              slot_of, self.layout, swiglu_limit=self.swiglu_limit, policy=self.policy,
                              paths=self.paths)
        y_cpu = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32).index_add_(0, t_idx, y_pairs)
        store.count_cpu_computed(layer, ids_h[on_cpu], ensured=ids_d is not None)
        if ids_d is None:
            return y_cpu.to(x.device, x.dtype)
        y = self._op(x, ids_d, wts_d, store.data, store.residency[layer], {})
        return y + y_cpu.to(y.device, y.dtype)

    def _store_forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       fp4: dict[str, Any]) -> torch.Tensor:
        """Make this layer's routed experts resident in the slot pool, then compute from it.

        A call that needs more rows than the cache may hold (a long prefill) is computed in chunks: each chunk's
        experts are resident while it is computed, the other pairs count with weight 0 (routed to a resident
        expert so the op reads valid rows).
        """
        from moetplan.runtime.store.store import StoreCapacityError

        store = self.store.get()
        layer = self.moe_index
        misses = self.record(x.device) if self.record is not None else None
        if misses is not None and not misses.eager and (
                x.shape[0] <= store.prefill_tokens or capturing()):
            return self._replay_forward(x, topk_weights, topk_ids, fp4, store, misses)
        if x.shape[0] <= store.prefill_tokens:  # decode: the step's working set fits (the planner's guard)
            if self.cpu_miss_ratio > 0 and not fp4:
                y = self._cpu_miss_forward(x, topk_weights, topk_ids, store)
                if y is not None:
                    return y
            try:
                store.ensure(layer, topk_ids)
                return self._op(x, topk_ids, topk_weights, store.data, store.residency[layer], fp4)
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
            y = self._op(x, ids, wts, store.data, store.residency[layer], fp4)
            out = y if out is None else out + y
        return out if out is not None else torch.zeros_like(x)


__all__ = ["LayerState"]
