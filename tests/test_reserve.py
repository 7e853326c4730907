"""The FP4 reserve: right rows published, non-resident experts untouched, promotion off the step's path."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from moetplan.contract.errors import ConfigError, UsageError
from moetplan.contract.runtime import RuntimeSection
from moetplan.runtime.store.backing import ArrayRowSource
from moetplan.runtime.format.format import RowLayout, dequantize_fp4, pack_expert_row, quantize_fp4, unpack_expert_row
from moetplan.runtime.op.ops import moe_forward
from moetplan.runtime.reserve.reserve import FP4Reserve, reserve_from_section
from moetplan.runtime.reserve.reserve_sources import Mxfp4RowSource, QuantizingRowSource

L, E, H, I = 2, 8, 64, 64
LAY2 = RowLayout.for_expert(H, I, 1, "2bit")
LAY4 = RowLayout.for_expert(H, I, 1, "fp4")
_g = torch.Generator().manual_seed(3)
W13 = torch.randn(L, E, 2 * I, H, generator=_g) * 0.05
W2 = torch.randn(L, E, H, I, generator=_g) * 0.05


def weights(l: int, e: int):
    return W13[l, e], W2[l, e]


def pool2(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    pool = torch.empty((E, LAY2.stride), dtype=torch.uint8)
    for e in range(E):
        pack_expert_row(W13[layer, e], W2[layer, e], LAY2, out=pool[e])
    return pool, torch.arange(E, dtype=torch.int32)


POOLS = [pool2(l) for l in range(L)]


def source() -> QuantizingRowSource:
    return QuantizingRowSource(weights, LAY4, L, E)


def run(x, ids, layer=0, reserve=None, fp4_row=None):
    w = torch.full(ids.shape, 1.0 / ids.shape[1])
    pool, slot_of = POOLS[layer]
    extra = {}
    if reserve is not None:
        extra = reserve.op_args(layer)
        if fp4_row is not None:
            extra["fp4_slot_of"] = fp4_row
    return moe_forward(x, ids, w, pool, slot_of, LAY2, **extra)


def x_and_ids(t=6, seed=0, experts=range(E)):
    g = torch.Generator().manual_seed(seed)
    ex = torch.tensor(list(experts))
    ids = ex[torch.randint(0, len(ex), (t, 2), generator=g)]
    ids[:, 1] = torch.where(ids[:, 1] == ids[:, 0], ex[(torch.searchsorted(ex, ids[:, 0].contiguous()) + 1) % len(ex)], ids[:, 1])
    return torch.randn(t, H, generator=g), ids.to(torch.int32)


# --------------------------------------------------------------------------- bytes and publishing


def test_promoted_rows_are_the_fp4_rows_and_op_uses_them():
    r = FP4Reserve(source(), 4, layout=LAY4, background=False)
    got = r.promote_now([(0, 1), (1, 3)])
    assert got == [(0, 1), (1, 3)]
    for l, e in got:
        slot = int(r.slot_of(l)[e])
        want = pack_expert_row(*weights(l, e), LAY4)
        assert torch.equal(r.data[slot], want)
    assert r.published() == {(0, 1), (1, 3)} == r.resident()
    r.check()
    # the op computes expert 1 from FP4: same as an op whose only pool is an all-FP4 pool
    x, ids = x_and_ids(experts=[1, 2])
    out = run(x, ids, reserve=r)
    assert not torch.equal(out, run(x, ids))
    w13_4, _ = unpack_expert_row(r.data[int(r.slot_of(0)[1])], LAY4)
    assert torch.allclose(w13_4, dequantize_fp4(*quantize_fp4(W13[0, 1])))


def test_non_resident_experts_are_bit_identical_with_and_without_reserve():
    r = FP4Reserve(source(), 3, layout=LAY4, background=False)
    r.promote_now([(0, 0), (0, 1), (0, 2)])
    # a batch where some tokens use reserve experts and others only non-reserve ones
    x, ids = x_and_ids(t=12, seed=5)
    ids[:4] = torch.tensor([[0, 3], [1, 4], [2, 5], [0, 1]], dtype=torch.int32)
    ids[4:] = torch.tensor([[3, 4], [5, 6], [7, 3], [4, 6], [6, 7], [3, 5], [4, 7], [5, 3]], dtype=torch.int32)
    with_r, without = run(x, ids, reserve=r), run(x, ids)
    only_cold = ~torch.isin(ids, torch.tensor([0, 1, 2])).any(dim=1)
    assert only_cold.sum() == 8
    assert torch.equal(with_r[only_cold], without[only_cold])
    assert not torch.equal(with_r[~only_cold], without[~only_cold])


def test_published_row_is_swapped_never_edited():
    r = FP4Reserve(source(), 2, layout=LAY4, background=False)
    before = r.slot_of(0)
    snapshot = before.clone()
    r.promote_now([(0, 5)])
    assert torch.equal(before, snapshot), "a row a step already holds must not change under it"
    assert int(r.slot_of(0)[5]) >= 0 and r.slot_of(0) is not before


# --------------------------------------------------------------------------- background promotion


def hot(r: FP4Reserve, layer: int, experts: list[int], times: int = 5) -> None:
    for _ in range(times):
        with r.step():
            r.observe(layer, torch.tensor([experts], dtype=torch.int32))


def test_background_worker_fills_with_hottest():
    r = FP4Reserve(source(), 3, layout=LAY4, background=True, idle_poll_s=0.01)
    try:
        hot(r, 0, [2, 6], times=6)
        hot(r, 1, [4], times=3)
        hot(r, 1, [7], times=1)  # coldest: does not fit in 3 slots
        assert r.wait_idle(10)
        assert r.published() == {(0, 2), (0, 6), (1, 4)}
        s = r.stats()
        assert s["promotions"] == 3 and s["slots_used"] == 3 and s["worker_errors"] == 0
    finally:
        r.close()


class GatedSource(QuantizingRowSource):
    """A slow row source: read_rows blocks until the test lets it go."""

    def __init__(self):
        super().__init__(weights, LAY4, L, E)
        self.entered, self.release = threading.Event(), threading.Event()

    def read_rows(self, rows, out, o_direct=False):
        self.entered.set()
        assert self.release.wait(20), "test never released the source"
        super().read_rows(rows, out, o_direct)


def test_step_never_waits_for_promotion_in_flight():
    src = GatedSource()
    r = FP4Reserve(src, 2, layout=LAY4, background=True, idle_poll_s=0.01)
    try:
        x, ids = x_and_ids(experts=[3, 4, 5], seed=2)
        two_bit = run(x, ids)
        hot(r, 0, [3], times=4)
        assert src.entered.wait(10), "the worker did not start promoting"
        assert r.in_flight()
        t0 = time.perf_counter()
        with r.step():  # a step issued while the promotion is stuck in the source
            r.observe(0, ids)
            out = run(x, ids, reserve=r)
        dt = time.perf_counter() - t0
        assert r.in_flight(), "the step must have completed while the promotion was still in flight"
        assert dt < 5
        assert torch.equal(out, two_bit), "not-yet-published experts must be computed from their 2-bit rows"
        src.release.set()
        assert r.wait_idle(10)
        assert (0, 3) in r.published()
        assert not torch.equal(run(x, ids, reserve=r), two_bit)
    finally:
        src.release.set()
        r.close()


def test_evicted_slot_not_reused_while_a_step_holds_the_old_row():
    r = FP4Reserve(source(), 2, layout=LAY4, background=False, hysteresis=0.0)
    hot(r, 0, [0, 1], times=3)
    while r.maintain():
        pass
    assert r.resident() == {(0, 0), (0, 1)}
    r.begin_step()
    held = r.slot_of(0)  # a step in flight took this row
    rows_before = r.data.clone()
    heat = np.zeros((L, E))
    heat[0, 6] = heat[0, 7] = 100.0
    heat[0, 0] = heat[0, 1] = 1.0
    r.seed_heat(heat)
    r.maintain()  # worker round during the step: may evict, must not overwrite the held slots
    assert torch.equal(r.data, rows_before)
    assert int(held[0]) >= 0 and int(held[1]) >= 0
    assert r.stats()["evictions"] == 2 and r.published() == set()
    r.end_step()
    while r.maintain():
        pass
    assert r.published() == {(0, 6), (0, 7)}
    for e in (6, 7):
        assert torch.equal(r.data[int(r.slot_of(0)[e])], pack_expert_row(*weights(0, e), LAY4))
    r.check()


def test_promote_now_limit_pins_and_eviction():
    r = FP4Reserve(source(), 3, layout=LAY4, background=False)
    assert r.promote_now([(0, 0), (0, 1), (0, 2), (0, 3)], limit=2) == [(0, 0), (0, 1)]
    r.end_step()
    r.begin_step()
    got = r.promote_now([(1, 0), (1, 1)])  # one free slot + evict the coldest unpinned
    assert got == [(1, 0), (1, 1)] and len(r.resident()) == 3
    # pinned for the step: a worker round cannot evict them even if colder
    heat = np.zeros((L, E))
    heat[0, 4:] = 50.0
    r.seed_heat(heat)
    r.maintain()
    assert {(1, 0), (1, 1)} <= r.published()
    r.end_step()
    assert r.stats()["gate_promotions"] == 4


def test_worker_error_is_counted_not_fatal():
    class Broken(QuantizingRowSource):
        def read_rows(self, rows, out, o_direct=False):
            raise OSError("disk gone")

    r = FP4Reserve(Broken(weights, LAY4, L, E), 2, layout=LAY4, background=True, idle_poll_s=0.01)
    try:
        hot(r, 0, [1])
        deadline = time.time() + 10
        while r.stats()["worker_errors"] == 0 and time.time() < deadline:
            time.sleep(0.01)
        assert r.stats()["worker_errors"] >= 1
        assert r.published() == set() and r._free  # slot given back
    finally:
        r.close()


# --------------------------------------------------------------------------- sources


def test_fp4_pack_source_matches_requantization(tmp_path):
    from moetplan.runtime.format.packs import Pack, PackWriter

    with PackWriter(tmp_path, "m", 0, 1, LAY4, L, E, identity="id") as w:
        for l in range(L):
            for e in range(E):
                w.write_row(l, e, pack_expert_row(*weights(l, e), LAY4))
        w.commit()
    pack = Pack.open(tmp_path, "m", 1, 0, fmt="fp4")
    a = FP4Reserve(pack, 4, layout=LAY4, background=False)
    b = FP4Reserve(source(), 4, layout=LAY4, background=False)
    for r in (a, b):
        r.promote_now([(1, 2), (0, 7)])
    for l, e in [(1, 2), (0, 7)]:
        assert torch.equal(a.data[int(a.slot_of(l)[e])], b.data[int(b.slot_of(l)[e])])
    pack.close()


def test_two_bit_pack_or_wrong_stride_is_refused():
    rows = np.zeros((L * E, LAY2.stride), dtype=np.uint8)
    with pytest.raises(ConfigError, match="stride"):
        FP4Reserve(ArrayRowSource(rows, L, E), 2, layout=LAY4, background=False)
    with pytest.raises(UsageError, match="fp4"):
        FP4Reserve(ArrayRowSource(rows, L, E), 2, layout=LAY2, background=False)
    fake_pack = ArrayRowSource(np.zeros((L * E, LAY4.stride), dtype=np.uint8), L, E)
    fake_pack.layout = LAY2
    with pytest.raises(ConfigError, match="fp4 pack"):
        FP4Reserve(fake_pack, 2, layout=LAY4, background=False)
    r = FP4Reserve(source(), 2, layout=LAY4, background=False)
    with pytest.raises(UsageError, match="outside"):
        r.promote_now([(L, 0)])
    with pytest.raises(UsageError, match="expert ids"):
        r.observe(0, torch.tensor([[E]]))


def test_mxfp4_bytes_are_used_as_is():
    g = torch.Generator().manual_seed(9)

    def mx(l, e):
        return (torch.randint(0, 256, (2 * I, H // 2), generator=g, dtype=torch.uint8),
                torch.randint(110, 130, (2 * I, H // 32), generator=g, dtype=torch.uint8),
                torch.randint(0, 256, (H, I // 2), generator=g, dtype=torch.uint8),
                torch.randint(110, 130, (H, I // 32), generator=g, dtype=torch.uint8))

    src = Mxfp4RowSource(mx, LAY4, L, E)
    g.manual_seed(9)
    p13, _, _, s2 = mx(0, 0)
    g.manual_seed(9)
    r = FP4Reserve(src, 1, layout=LAY4, background=False)
    r.promote_now([(0, 0)])
    row = r.data[int(r.slot_of(0)[0])]
    assert torch.equal(row[LAY4.w13_q_off:LAY4.w13_q_off + p13.numel()], p13.reshape(-1))
    assert torch.equal(row[LAY4.w2_s_off:LAY4.w2_s_off + s2.numel()], s2.reshape(-1))


def test_reserve_from_section_and_fp4_routing_share():
    assert reserve_from_section(RuntimeSection(fp4_reserve_slots=0), source(), layout=LAY4) is None
    r = reserve_from_section(RuntimeSection(fp4_reserve_slots=2), source(), layout=LAY4, background=False)
    assert r is not None and r.pool.num_slots == 2
    r.promote_now([(0, 1)])
    r.observe(0, torch.tensor([[1, 2], [1, 3]]))
    assert r.stats()["fp4_routing_share"] == pytest.approx(0.5)
    with pytest.raises(UsageError, match="decay"):
        FP4Reserve(source(), 2, layout=LAY4, decay=0.0)


def test_begin_step_can_adopt_the_step_observe_opened():
    """The gate judges a step after its first pass: adopting the inferred step counts it (and decays heat) once."""
    r = FP4Reserve(source(), 2, layout=LAY4, background=False, decay=0.5)
    ids = torch.tensor([[1, 2]])
    r.observe(0, ids)  # first pass of a step: opened implicitly
    r.begin_step(adopt=True)
    r.observe(0, ids)  # the recompute: explicit step, no new boundary inferred
    r.end_step()
    assert r.stats()["steps"] == 1
    assert r.heat()[0, 1] == pytest.approx(2 * 0.5)  # two observations, one decay tick
    r.observe(0, ids)
    r.begin_step()  # without adopt: the open step ends, a new one starts
    r.end_step()
    assert r.stats()["steps"] == 3


@pytest.mark.gpu
def test_reserve_on_gpu_background_and_gate_paths():
    r = FP4Reserve(source(), 3, layout=LAY4, device="cuda", background=True, idle_poll_s=0.01)
    try:
        hot(r, 0, [2, 5], times=4)
        assert r.wait_idle(20)
        assert r.published() == {(0, 2), (0, 5)}
        assert r.slot_of(0).is_cuda and r.data.is_cuda
        for e in (2, 5):
            assert torch.equal(r.data[int(r.slot_of(0)[e])].cpu(), pack_expert_row(*weights(0, e), LAY4))
        with r.step():
            assert r.promote_now([(1, 1), (1, 2)]) == [(1, 1), (1, 2)]
        torch.cuda.synchronize()
        assert torch.equal(r.data[int(r.slot_of(1)[2])].cpu(), pack_expert_row(*weights(1, 2), LAY4))
        r.check()
    finally:
        r.close()


# --------------------------------------------------------------------------- inside CUDA graphs


def _heat(r: FP4Reserve, layer: int, experts: list[int], n: int = 50) -> None:
    counts = np.zeros((L, E), dtype=np.int64)
    counts[layer, experts] = n
    r.begin_step()
    r.observe_counts(counts)  # the step's routings from the device record, read once at step end
    r.sync_graph_tables()
    r.end_step()


def test_inside_graphs_the_op_reads_fixed_tables_that_change_only_at_step_ends():
    """A captured graph keeps the table tensor it captured: promotions reach it in place at the next step end, and
    a slot evicted meanwhile is not refilled until the step after that sync has finished."""
    r = FP4Reserve(source(), 2, layout=LAY4, background=False, hysteresis=0.0)
    r.use_graph_tables()
    table = r.op_args(0)["fp4_slot_of"]
    _heat(r, 0, [1, 2])
    assert r.maintain() == 2 and r.c.routings == 100
    assert r.op_args(0)["fp4_slot_of"] is table and (table < 0).all()  # published, not yet seen by a graph
    x, ids = x_and_ids(seed=4, experts=[1, 2])
    before = run(x, ids, reserve=r)
    assert torch.equal(before, run(x, ids))  # 2-bit rows until the step end
    _heat(r, 0, [1, 2])
    assert r.op_args(0)["fp4_slot_of"] is table and sorted(np.flatnonzero(table.numpy() >= 0).tolist()) == [1, 2]
    assert not torch.allclose(run(x, ids, reserve=r), before)  # the FP4 rows now
    slots = {e: int(table[e]) for e in (1, 2)}
    rows = {e: r.pool.data[s].clone() for e, s in slots.items()}
    for _ in range(3):  # another pair turns hot: 1 and 2 are evicted, their slots retired
        _heat(r, 0, [5, 6], n=500)
        r.maintain()
        if (table[[5, 6]] >= 0).all():
            break
        live = {e for e in (1, 2) if int(table[e]) >= 0}  # what a graph running now would read
        for e in live:
            assert torch.equal(r.pool.data[slots[e]], rows[e]), "a slot a graph table still maps was refilled"
    _heat(r, 0, [5, 6], n=500)
    r.maintain()
    _heat(r, 0, [5, 6], n=500)
    assert (table[[5, 6]] >= 0).all() and (table[[1, 2]] < 0).all()
    r.close()
