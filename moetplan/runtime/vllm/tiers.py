"""The expert store as the Plan's runtime section sizes it: the one factory (`expert_store`), and the worker's
tiered store over all its MoE layers (`TieredExperts`) when experts are not resident."""
from __future__ import annotations

import atexit
import logging
from typing import Any, Callable

import numpy as np
import torch

from moetplan.contract.errors import ConfigError, UsageError
from moetplan.contract.layout import RowLayout
from moetplan.contract.runtime import RuntimeSection
from moetplan.runtime.store.backing import ArrayRowSource, make_backing
from moetplan.runtime.store.store import ExpertStore

log = logging.getLogger("vllm.moetplan")


def expert_store(section: RuntimeSection, source: Any, *, device: str | torch.device = "cpu", pin: bool | None = None,
                 **kw: Any) -> ExpertStore:
    """The GPU expert cache the section sizes (gpu_expert_cache_slots) over the backing its tier names: pinned
    host RAM for "host"; for "nvme" the pack file with an arena of `host_arena_rows` pinned rows (0: the page cache
    alone). `pin`:
    page-lock host rows (None: when CUDA is there); `kw` go to ExpertStore (decay, prefill_tokens, ...)."""
    _check_cache(section)
    if section.expert_row_bytes and int(source.stride) != section.expert_row_bytes:
        raise ConfigError(f"expert rows are {source.stride} bytes but the plan sized {section.expert_row_bytes}-byte "
                          "rows; "
                          "the plan was made for another model shape or TP degree: re-plan")
    backing = make_backing(section.expert_tier, source, arena_rows=section.host_arena_rows, pin=pin)
    return ExpertStore(backing, section.gpu_expert_cache_slots, device=device, **kw)


def _check_cache(section: RuntimeSection) -> None:
    # The cache size's floor is the section's own check (RuntimeSection: a tiered section has at least one slot).
    if section.expert_tier == "resident":
        raise UsageError("experts are resident in this plan (expert_tier resident): the tiered store is only for "
                         "expert_tier host / nvme plans")


def route_store_log() -> None:
    """The store logs to "moetplan.store"; inside vLLM send it through vLLM's handlers into the server log."""
    lg = logging.getLogger("moetplan.store")
    if not lg.handlers:
        for h in logging.getLogger("vllm").handlers:
            lg.addHandler(h)
        lg.setLevel(logging.INFO)
        lg.propagate = False


class TieredExperts:
    """The expert store behind every MoE layer of a worker when experts are not resident.

    vLLM processes layers one at a time, but the store's backing (pinned host copy, or the pack file) covers all
    MoE layers, so rows are collected at load and the store is built at the first forward.
    """

    def __init__(self, section: RuntimeSection, write_pack: Callable[[Any, int, int, RowLayout], Any]):
        self.section = section
        self.write_pack = write_pack  # (rows [L*E, stride], L, E, layout) -> the opened pack
        self.rows: dict[int, torch.Tensor] = {}
        self.layout: RowLayout | None = None
        self.store: ExpertStore | None = None
        self.pack_path: str | None = None
        self.dummy = False
        self.heat_keeper: Any = None

    def add(self, moe_index: int, rows: torch.Tensor | None, layout: RowLayout, num_experts: int = 0) -> None:
        """A layer's rows; None: dummy weights, the rows are generated into the backing at build time."""
        self.rows[moe_index] = rows if rows is not None else torch.empty(num_experts, 0, dtype=torch.uint8)
        self.dummy = rows is None
        self.layout = layout

    def get(self) -> ExpertStore:
        if self.store is None:
            self.store = self._build()
        return self.store

    def _build(self) -> ExpertStore:
        L = len(self.rows)
        if sorted(self.rows) != list(range(L)):
            raise ConfigError(f"MoE layers {sorted(self.rows)} did not all load; cannot build the expert store")
        E = self.rows[0].shape[0]
        s = self.section
        _check_cache(s)  # before any pack is written
        if self.dummy:
            # Random rows straight into the pinned store or the pack file: no copy of them exists elsewhere.
            from moetplan.runtime.vllm.dummy_experts import RandomRowSource

            assert self.layout is not None
            data: Any = RandomRowSource(self.layout, L, E, seed=s.knobs.seed)
        else:
            data = np.concatenate([self.rows[i].numpy() for i in range(L)])
        if s.expert_tier == "host":
            source: Any = data if self.dummy else ArrayRowSource(data, L, E)
        else:
            source = self.write_pack(data, L, E, self.layout)
            self.pack_path = str(source.path)
        self.rows.clear()  # the backing holds its own copy
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        route_store_log()
        # KPI line in the server log every 30 s (hit rate, zero-miss steps, misses per step, transfer rates)
        store = expert_store(s, source, device=device, prefill_tokens=s.decode_batch_tokens, kpi_every_s=30.0)
        log.info("moetplan: store %s tier=%s gpu_expert_cache_slots=%d layers=%d experts=%d%s",
                 type(store.backing).__name__, s.expert_tier, s.gpu_expert_cache_slots, L, E,
                 " (graph replay)" if s.replays else "")
        if self.pack_path:
            # A pack-backed store restarts warm: its heat is saved beside the pack (every 5 min, on the step
            # boundary) and preloaded on the next start (runtime/store/heat.py).
            from moetplan.runtime.store.heat import HeatKeeper, restore_heat

            try:
                restore_heat(store, progress=False)
                self.heat_keeper = HeatKeeper(store).attach()
                atexit.register(self.heat_keeper.save)
            except Exception as e:  # heat is an optimisation, never a reason to refuse to start
                log.warning("moetplan: expert heat not restored/kept: %r", e)
        return store


__all__ = ["TieredExperts", "expert_store", "route_store_log"]
