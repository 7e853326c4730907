"""One size rule: the bytes the planner counts for an expert row are the bytes the runtime allocates for it."""
from __future__ import annotations

import pytest

from moetplan import hwdb
from moetplan.contract import HardwareProfile, HostInfo, MemoryLedger, Placement, Plan, Prediction
from moetplan.contract.errors import UsageError
from moetplan.contract.layout import RowLayout as ContractLayout
from moetplan.contract.units import GIB
from moetplan.plan.ledger import build_ledger
from moetplan.runtime.format.format import RowLayout
from moetplan.runtime.store.slots import SlotPool
from moetplan.runtime.vllm.tiers import expert_store

TPS = (1, 2, 4, 8)
CASES = [(m, tp) for m in hwdb.model_ids() for tp in TPS]


def test_the_runtime_layout_is_the_contract_layout():
    assert RowLayout is ContractLayout


@pytest.mark.parametrize("model_id, tp", CASES)
def test_planned_expert_bytes_equal_allocated_bytes(model_id, tp):
    spec = hwdb.model_spec(model_id)
    if not spec.splits_over(tp):
        # no layout at this TP: the runtime refuses it, and so does the planner (it never offers this TP)
        with pytest.raises(UsageError):
            RowLayout.for_expert(spec.hidden_size, spec.moe_intermediate_size, tp, "2bit")
        return
    slots, reserve, arena = 3, 2, 5
    p = Placement.for_model(spec, tp=tp, expert_tier="nvme", gpu_expert_cache_slots=slots,
                            fp4_reserve_slots=reserve, host_arena_rows=arena)
    for fmt, count, gib in (("2bit", slots, p.gpu_expert_cache_gib), ("fp4", reserve, p.fp4_reserve_gib)):
        allocated = RowLayout.for_expert(spec.hidden_size, spec.moe_intermediate_size, tp, fmt).stride
        assert spec.expert_bytes(fmt, tp) == allocated  # the planner's row is the runtime's row
        # what a kernel reads of it (the cost model's traffic) is its payload, without the alignment padding
        assert spec.expert_read_bytes(fmt, tp) == RowLayout.for_expert(spec.hidden_size, spec.moe_intermediate_size,
                                                                       tp, fmt).payload_bytes
        pool = SlotPool(count, allocated, spec.moe_layers, spec.n_routed_experts)  # what a worker allocates
        assert pool.data.numel() == count * allocated == gib * GIB  # the plan's GiB are those bytes
    assert spec.routed_bytes("2bit", tp) == spec.moe_layers * spec.n_routed_experts * p.expert_row_bytes
    assert p.host_arena_gib * GIB == arena * p.expert_row_bytes  # per rank: each rank's arena holds its shard's rows
    ledger = build_ledger(spec, hwdb.inline_profile(f"{tp}xh200", host_ram_gib=4096), p).ledger
    items = {i.name: i.gib for i in ledger.gpus[0].items}
    assert items["expert_cache"] * GIB == slots * p.expert_row_bytes
    assert items["fp4_reserve"] * GIB == reserve * p.fp4_row_bytes
    # the worker's store, built by the one factory from the plan's runtime section, allocates those bytes
    section = _plan(spec, p).runtime
    store = expert_store(section, _Rows(spec, section.expert_row_bytes), pin=False)
    assert store.data.numel() == p.gpu_expert_cache_gib * GIB  # the GPU expert cache
    assert store.backing.arena.numel() == p.host_arena_gib * GIB  # the pinned arena (each rank its own)
    store.close()


class _Rows:
    """A row source of the model's shape that reads nothing (the factory only needs its shape)."""

    def __init__(self, spec, stride: int):
        self.num_layers, self.num_experts, self.stride = spec.moe_layers, spec.n_routed_experts, stride

    def row_index(self, layer: int, expert: int) -> int:
        return layer * self.num_experts + expert

    def read_rows(self, rows, out, o_direct: bool = False) -> None:
        pass


def _plan(spec, placement: Placement) -> Plan:
    return Plan(model=spec, hardware=HardwareProfile(host=HostInfo(ram_gib=64)), placement=placement,
                memory=MemoryLedger(), prediction=Prediction(decode_tok_s=0))


def test_a_pinned_gib_becomes_whole_rows_and_round_trips():
    spec = hwdb.model_spec("glm-5.2")
    p = Placement.for_model(spec, tp=2, expert_tier="nvme", gpu_expert_cache_gib=14, host_arena_gib=20)
    row = spec.expert_bytes("2bit", 2)
    assert p.gpu_expert_cache_slots == int(14 * GIB // row) and p.host_arena_rows == int(20 * GIB // row)
    assert Placement.model_validate(p.model_dump()) == p  # the saved GiB agree with the rows
    edited = {**p.model_dump(), "gpu_expert_cache_gib": 20.0}
    with pytest.raises(ValueError, match="gpu_expert_cache_slots is what the runtime allocates"):
        Placement.model_validate(edited)
    with pytest.raises(ValueError, match="needs the row size"):
        Placement(gpu_expert_cache_gib=3)
